"""Fixtures of the GPU tests: each case on both tensor-core atoms, in each 16-bit dtype."""
import pytest
import torch

import torch_flash_v100 as tfv


@pytest.fixture(params=[True, False], ids=["volta", "native"])
def atom(request):
    with tfv.volta_atom(request.param):
        yield request.param


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def dtype(request, atom):
    if request.param == torch.bfloat16 and (atom or torch.cuda.get_device_capability()[0] < 8):
        pytest.skip("bf16 runs on the native m16n8k16 atom only")
    return request.param
