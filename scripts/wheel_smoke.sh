#!/usr/bin/env bash
# Wheel smoke test: builds a wheel of this tree against the current Python's torch, installs it
# (non-editable) into a fresh virtual environment that reuses this environment's torch, and runs
# `info`, a tiny `bench` and a tiny `e2e` from a directory outside the source tree. Fails on any
# error, and if the package is imported from anywhere but the fresh environment.
#   scripts/wheel_smoke.sh [WORKDIR]   (default: a temporary directory, removed afterwards)
#   PYTHON=... selects the interpreter whose environment provides torch (default: python).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python}"
if [ $# -ge 1 ]; then
  work="$(mkdir -p "$1" && cd "$1" && pwd)"
else
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
fi
echo "== wheel smoke test (in $work) =="

# The build shares build/ with editable installs, so after one of them this is incremental.
"$py" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" ninja cmake
"$py" -m pip wheel -q --no-build-isolation --no-deps "$root" -w "$work/dist"
wheel="$(ls "$work"/dist/torch_flash_v100-*.whl)"
echo "built $(basename "$wheel")"

# A fresh environment that sees this one's packages (torch) through a .pth file, behind its own
# site-packages: `venv --system-site-packages` would expose the base interpreter's packages, and
# a plain path entry does not run this environment's .pth files (an editable install's finder).
rm -rf "$work/venv"
"$py" -m venv --without-pip "$work/venv"
venv_py="$work/venv/bin/python"
venv_site="$("$venv_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$py" -c 'import sysconfig; p = sysconfig.get_paths()
print("\n".join(dict.fromkeys([p["purelib"], p["platlib"]])))' > "$venv_site/_torch_from_parent.pth"
"$py" -m pip --python "$venv_py" install -q --no-deps "$wheel"

mkdir -p "$work/run"
cd "$work/run"
"$venv_py" - "$venv_site" <<'EOF'
import sys
from pathlib import Path

import torch_flash_v100

site = Path(sys.argv[1]).resolve()
package = Path(torch_flash_v100.__file__).resolve()
if site not in package.parents:
    sys.exit(f"wheel smoke: torch_flash_v100 imported from {package}, not from the wheel in {site}")
print(f"torch_flash_v100 {torch_flash_v100.__version__} from {package.parent}")

# The flash_attn-compatible modules ship in the wheel and run.
import torch
from torch_flash_v100 import bert_padding, flash_attn_interface
from torch_flash_v100.layers import rotary

x = torch.randn(2, 4, 2, 8)
x_packed, indices, cu, longest, _ = bert_padding.unpad_input(x, torch.tensor([[0, 1, 1, 1]] * 2))
x_packed = rotary.apply_rotary_emb(x_packed, torch.ones(4, 2), torch.zeros(4, 2), cu_seqlens=cu)
out = flash_attn_interface.flash_attn_varlen_func(x_packed, x_packed, x_packed, cu, cu, longest,
                                                  longest, causal=True)
assert bert_padding.pad_input(out, indices, 2, 4).shape == x.shape
EOF
"$venv_py" -m torch_flash_v100 info
"$venv_py" -m torch_flash_v100 bench --suite tiny --device cpu --impls flashv100,naive \
  --repetitions 1 --no-progress --json "$work/run/bench.json"
"$venv_py" -m torch_flash_v100 e2e --device cpu --modes eager --layers 1 --d-model 32 --heads 2 \
  --seq 16 --batch 2 --steps 2 --check-steps 1 --json "$work/run/e2e.json"
"$venv_py" - <<'EOF'
import json
import sys

bench, e2e = json.load(open("bench.json")), json.load(open("e2e.json"))
bad = [(e["key"], n, r) for e in bench["results"] for n, r in e["impls"].items()
       if r["status"] != "ok"]
bad += [r for r in e2e["runs"] + e2e["check"] if "error" in r]
if bad:
    sys.exit(f"wheel smoke: failed measurements: {bad}")
print("wheel smoke test: ok")
EOF
