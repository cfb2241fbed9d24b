"""Eager parity on every row: HF decoders with left and right padding.

Left padding makes the padded query rows fully masked (every key at ``finfo.min``); eager
averages v over all keys there, and so must the fused graph, in the forward and in the
gradients, while the causal mask still runs as tile skipping (``is_causal=True``)."""

import pytest
import torch

from hf_padding import DECODERS, check_all_positions
from torch_flash_v100.compile import history


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_every_position_equals_eager(name, side, train):
    cap, calls = check_all_positions(name, side, train)
    print(name, side, [h[2] for h in history])
    # the fast path is kept: the causal part of the mask is tile skipping, not mask reads. Only
    # a mask that enters the graph as an input can't be seen to be causal: transformers 5.17's
    # OPT draws its layerdrop number in training even at layerdrop 0, and the data-dependent
    # branch splits the model between the mask and the layers (the mask is then read: correct)
    assert all(c["is_causal"] or c["attn_mask"].op == "placeholder" for c in calls), history
    # O(L) memory: no [B, H, L, S] tensor in the forward graph that runs (the model's own
    # [B, 1, L, S] mask is the largest); the fix-up of fully masked rows adds [B, 1, L, 1]
    # reductions. BLOOM adds its ALiBi bias [B * H, 1, S] to that mask, which makes the sum
    # [B, H, L, S] (as large as eager's scores): its positions come from the padding mask's
    # cumsum, which the pass cannot prove to be the key index (no alibi_slopes).
    big = [n.format_node() for gm in cap.fw for n in gm.graph.nodes
           if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 3
           and n.meta["val"].shape[-2:] == (10, 10) and n.meta["val"].numel() > 3 * 100]
    assert (len(big) > 0) == (name == "bloom"), big
