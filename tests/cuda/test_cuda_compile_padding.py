"""CUDA fp16: HF decoders with left and right padding, compiled through the flashv100 backend,
equal eager at every position (padded ones included), in inference and training. The reference
is eager in fp32 on the same weights (eager fp16 rounds its scores; the padded rows of both are
the uniform average, the scores of these tiny models stay far below fp16 finfo.min's spacing)."""

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.cuda]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "compile"))
hf_padding = pytest.importorskip("hf_padding")


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(hf_padding.DECODERS))
def test_fp16_every_position_equals_eager(name, side, train):
    hf_padding.check_all_positions(name, side, train, dtype=torch.float16, device="cuda",
                                   reference_dtype=torch.float32, atol=2e-2, rtol=2e-2)
