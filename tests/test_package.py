"""The Python package surface."""

import importlib.metadata
import inspect
import os
import pydoc
import subprocess
import sys

import torch
import torch.nn.functional as F

import torch_flash_v100 as flash


def test_attention_has_sdpa_signature_and_docs():
    params = inspect.signature(flash.attention).parameters
    assert list(params) == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                            "enable_gqa"]
    assert {n: p.default for n, p in params.items() if p.default is not p.empty} == {
        "attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    assert [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY] == ["scale", "enable_gqa"]
    text = pydoc.render_doc(flash.attention, renderer=pydoc.plaintext)
    assert "attention(query" in text and "scaled_dot_product_attention" in text
    assert "OpOverloadPacket" not in text
    for name in params:
        assert f"{name}:" in flash.attention.__doc__, name


def test_public_functions_have_docs():
    for name in flash.__all__:
        obj = getattr(flash, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name
            inspect.signature(obj)  # a real signature, not (*args, **kwargs) of an op packet


def test_dir_lists_the_lazy_compile_api():
    names = dir(flash)
    assert {"enable", "disable", "backend", "attention", "build_info"} <= set(names)
    assert names == sorted(names)


def test_attention_calls_the_op():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    torch.testing.assert_close(flash.attention(q, k, v, is_causal=True, scale=0.3),
                               torch.ops.flashv100.attention(q, k, v, is_causal=True, scale=0.3),
                               rtol=0, atol=0)
    torch.testing.assert_close(flash.attention(q, k, v, is_causal=True, scale=0.3),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))


def test_compiled_graph_holds_the_op():
    """Dynamo traces through the Python function: its graph calls the op itself."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    out = torch.compile(flash.attention, backend=capture, fullgraph=True)(q, k, v, is_causal=True)
    torch.testing.assert_close(out, flash.attention(q, k, v, is_causal=True))
    (graph,) = graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    op = torch.ops.flashv100.attention
    assert targets in ([op.default], [op]), targets


def test_version_and_build_info():
    assert flash.__version__
    info = flash.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda"], bool)
    assert info["cuda"] == bool(info["cuda_archs"])


def test_volta_override_round_trip():
    before = flash.force_volta_atom()
    with flash.volta_atom(True):
        assert flash.force_volta_atom()
    assert flash.force_volta_atom() == before


def test_smem_limit_override_round_trip():
    from torch_flash_v100 import _C

    before = _C.smem_limit_override()
    try:
        _C.set_smem_limit_override(99 * 1024)
        assert _C.smem_limit_override() == 99 * 1024
        _C.set_smem_limit_override(-5)  # no cap
        assert _C.smem_limit_override() == 0
    finally:
        _C.set_smem_limit_override(before)


def test_kernel_path_names_cpu():
    assert flash.kernel_path("cpu") == "cpu"


def test_seeded_tag():
    assert torch.Tag.nondeterministic_seeded in torch.ops.flashv100._attention_forward.default.tags
    assert torch.Tag.nondeterministic_seeded in torch.ops.flashv100.attention.default.tags


def test_missing_cuda_kernels_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    note = flash._cuda_kernels_missing_note({"cuda": False})
    assert "without CUDA kernels" in note and "NotImplementedError" in note
    assert "pip install -v" in note and "12.6" in note
    assert flash._cuda_kernels_missing_note({"cuda": True}) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash._cuda_kernels_missing_note({"cuda": False}) is None


# Imports the package where torch claims a usable CUDA GPU; prints the warnings of the import.
IMPORT_WITH_CUDA = """
import warnings
import torch
torch.cuda.is_available = lambda: True
torch.version.cuda = torch.version.cuda or "12.6"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_flash_v100
print(torch_flash_v100.build_info()["cuda"])
print(sum("without CUDA kernels" in str(w.message) for w in caught))
"""


def test_import_warns_once_without_cuda_kernels():
    r = subprocess.run([sys.executable, "-c", IMPORT_WITH_CUDA], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    has_cuda_kernels, warnings = r.stdout.split()
    assert warnings == ("0" if has_cuda_kernels == "True" else "1")


def test_numpy_is_a_dependency():
    """torch warns "Failed to initialize NumPy" at import without numpy: the package needs it."""
    requires = importlib.metadata.requires("torch-flash-v100") or []
    runtime = [r.split(";")[0].strip() for r in requires if "extra ==" not in r]
    assert "numpy" in runtime, requires


# With numpy hidden: the package and its tools still work and add no NumPy warning of their own
# (torch's own, at `import torch`, is what the dependency avoids).
WITHOUT_NUMPY = """
import sys
import warnings

sys.modules["numpy"] = None  # import numpy raises ImportError; importlib.util.find_spec gives None
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_flash_v100
    from torch_flash_v100 import cli

    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    torch_flash_v100.attention(q, q, q, is_causal=True).sum().backward()
    rc = cli.main(["bench", "--suite", "tiny", "--device", "cpu", "--impls", "flashv100",
                   "--repetitions", "1", "--no-progress"])
print("NumPy warnings:", [str(w.message) for w in caught if "NumPy" in str(w.message)])
sys.exit(rc)
"""


def test_package_needs_no_numpy():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "NumPy warnings: []" in r.stdout
