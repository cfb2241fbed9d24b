"""Fixtures of the GPU tests: each case in each 16-bit dtype, on both tensor-core atoms (the
`atom` fixture of tests/conftest.py)."""
import pytest
import torch


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def dtype(request, atom):
    if request.param == torch.bfloat16 and (atom or torch.cuda.get_device_capability()[0] < 8):
        pytest.skip("bf16 runs on the native m16n8k16 atom only")
    return request.param
