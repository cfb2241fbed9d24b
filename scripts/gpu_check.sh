#!/usr/bin/env bash
# GPU check, run from the repo root on a machine with a CUDA GPU:
#   build (editable, TORCH_CUDA_ARCH_LIST default 9.0) -> GPU tests -> 2-GPU tests (EXPECT_GPUS=2)
#   -> the rest of the test suite
#   -> random-case fuzz vs the fp64 reference (FUZZ_CASES per atom, default 2000, both atoms)
#   -> compute-sanitizer memcheck, racecheck, synccheck, initcheck on odd shapes (both atoms)
#   -> short benchmark.
# Writes gpu_check.log, junit XML, summary.json, fuzz.json and bench.json to $OUT (default
# ./gpu_results).
# Exits non-zero if any step fails or if no GPU test ran (a silently skipped GPU suite is a failure).
# EXPECT_GPUS=2 (on a machine with 2+ GPUs) runs tests/cuda/test_cuda_distributed.py (NCCL: ring
# attention, tensor-parallel heads, DDP / FSDP2 training) as the step multi_gpu, where any skipped
# test is a failure; without it those tests are not run.
# FLASHV100_COMMIT names the commit in the benchmark metadata (for copied trees).
# STEPS=build,gpu_tests,multi_gpu,tests,fuzz,sanitize,bench selects steps (default: all); STEP_TIMEOUT (seconds,
# default 1800) bounds each step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./gpu_results}"
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
STEPS="${STEPS:-build,gpu_tests,multi_gpu,tests,fuzz,sanitize,bench}"
EXPECT_GPUS="${EXPECT_GPUS:-1}"
export EXPECT_GPUS  # the 2-GPU tests fail instead of skipping when GPUs are missing
MULTI_GPU_TESTS=tests/cuda/test_cuda_distributed.py
PY="${PYTHON:-python}"
declare -A RESULT=()

want() { [[ ",$STEPS," == *",$1,"* ]]; }
run_step() {  # run_step NAME CMD...: records pass/fail and wall time
  local name=$1 start=$SECONDS
  shift
  echo "==== $name: $* ($(date -u +%H:%M:%S))"
  if timeout "${STEP_TIMEOUT:-1800}" "$@"; then RESULT[$name]=pass; else RESULT[$name]=fail; fi
  echo "==== $name: ${RESULT[$name]} in $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv || true
want build && run_step build "$PY" -m pip install --no-build-isolation --no-deps -e .
if want gpu_tests; then
  run_step gpu_tests "$PY" -m pytest -q -m cuda tests --junitxml="$OUT_DIR/gpu_tests.xml" \
    -p no:cacheprovider --tb=short --maxfail=40 --continue-on-collection-errors \
    --ignore="$MULTI_GPU_TESTS"
fi
if want multi_gpu; then
  if [ "$EXPECT_GPUS" -ge 2 ]; then
    run_step multi_gpu "$PY" -m pytest -q "$MULTI_GPU_TESTS" --junitxml="$OUT_DIR/multi_gpu.xml" \
      -p no:cacheprovider --tb=short
  else
    echo "==== multi_gpu: not run (EXPECT_GPUS=$EXPECT_GPUS; set EXPECT_GPUS=2 on a 2-GPU machine)"
  fi
fi
if want tests; then
  run_step tests "$PY" -m pytest -q -m "not cuda" tests --junitxml="$OUT_DIR/tests.xml" \
    -p no:cacheprovider --tb=short --continue-on-collection-errors
fi
want fuzz && run_step fuzz "$PY" -m torch_flash_v100.fuzz --device cuda --atoms volta,native \
  --cases "${FUZZ_CASES:-2000}" --json "$OUT_DIR/fuzz.json"
if want sanitize; then
  SAN="compute-sanitizer --error-exitcode 1 --kernel-name kns=flash"
  run_step memcheck $SAN --tool memcheck "$PY" scripts/sanitize_kernels.py
  run_step racecheck $SAN --tool racecheck --racecheck-report hazard "$PY" scripts/sanitize_kernels.py
  run_step synccheck $SAN --tool synccheck "$PY" scripts/sanitize_kernels.py
  # initcheck sees reads of memory never written, e.g. past a tensor's end inside an allocator
  # block, which memcheck cannot. It runs without the kernel filter: writes by kernels it does not
  # instrument (PyTorch's randn, copies) are invisible to it, so every read of an input would be
  # reported as uninitialized.
  run_step initcheck compute-sanitizer --error-exitcode 1 --tool initcheck \
    "$PY" scripts/sanitize_kernels.py
fi
# The fa2 suite of the benchmark harness: native path vs SDPA flash / efficient, fwd and fwd+bwd.
want bench && run_step bench "$PY" -m torch_flash_v100 bench --suite fa2 --device cuda \
  --impls flashv100,sdpa-flash,sdpa-efficient --time-budget "${BENCH_BUDGET:-60}" --no-progress \
  --json "$OUT_DIR/bench.json"

# Summary: step results and GPU test counts; a GPU suite where nothing passed is a failure.
STEP_RESULTS="$(for k in "${!RESULT[@]}"; do echo "$k=${RESULT[$k]}"; done)"
STEP_RESULTS="$STEP_RESULTS" "$PY" - "$OUT_DIR" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out = sys.argv[1]
summary = {"steps": dict(l.split("=", 1) for l in os.environ["STEP_RESULTS"].split() if l)}
for name in ("gpu_tests", "multi_gpu", "tests"):
    path = os.path.join(out, f"{name}.xml")
    if os.path.exists(path):
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        summary[name] = counts
ok = all(v == "pass" for v in summary["steps"].values())
if "gpu_tests" in summary["steps"] and summary.get("gpu_tests", {}).get("passed", 0) == 0:
    summary["error"] = "no GPU test ran"
    ok = False
multi = summary.get("multi_gpu")
if "multi_gpu" in summary["steps"] and (multi is None or multi["skipped"] or not multi["passed"]):
    summary["error"] = "2-GPU tests expected (EXPECT_GPUS) but skipped or not run"
    ok = False
summary["ok"] = ok
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
sys.exit(0 if ok else 1)
EOF
