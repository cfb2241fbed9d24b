"""Bad input raises a clear error naming the argument."""

import pytest
import torch

import torch_flash_v100 as flash


def _qkv(device="cpu", **overrides):
    t = dict(query=torch.randn(2, 4, 8, 16, device=device), key=torch.randn(2, 4, 10, 16, device=device),
             value=torch.randn(2, 4, 10, 16, device=device))
    t.update(overrides)
    return t


CASES = [
    ("dtype mix", _qkv(key=torch.randn(2, 4, 10, 16, dtype=torch.float64)), {}, "key dtype"),
    ("value dtype", _qkv(value=torch.randn(2, 4, 10, 16).half()), {}, "value dtype"),
    ("integer query", _qkv(query=torch.ones(2, 4, 8, 16, dtype=torch.int64),
                           key=torch.ones(2, 4, 10, 16, dtype=torch.int64),
                           value=torch.ones(2, 4, 10, 16, dtype=torch.int64)), {}, "floating-point query"),
    ("rank", _qkv(key=torch.randn(4, 10, 16)), {}, "rank"),
    ("query rank 1", _qkv(query=torch.randn(16)), {}, "at least 2 dims"),
    ("head dim", _qkv(key=torch.randn(2, 4, 10, 8)), {}, "key head dim"),
    ("value length", _qkv(value=torch.randn(2, 4, 9, 16)), {}, "value length"),
    ("batch", _qkv(key=torch.randn(3, 4, 10, 16), value=torch.randn(3, 4, 10, 16)), {}, "batch dims"),
    ("heads without gqa", _qkv(key=torch.randn(2, 2, 10, 16), value=torch.randn(2, 2, 10, 16)), {},
     "enable_gqa"),
    ("gqa not dividing", _qkv(key=torch.randn(2, 3, 10, 16), value=torch.randn(2, 3, 10, 16)),
     {"enable_gqa": True}, "multiple of key/value heads"),
    ("mask shape", _qkv(), {"attn_mask": torch.zeros(2, 4, 8, 9)}, "attn_mask .* not broadcastable"),
    ("mask rank", _qkv(), {"attn_mask": torch.zeros(1, 2, 4, 8, 10)}, "attn_mask .* more dims"),
    ("mask dtype", _qkv(), {"attn_mask": torch.zeros(8, 10, dtype=torch.int32)}, "attn_mask of dtype bool"),
    ("dropout high", _qkv(), {"dropout_p": 1.5}, "dropout_p in \\[0, 1\\]"),
    ("dropout negative", _qkv(), {"dropout_p": -0.1}, "dropout_p in \\[0, 1\\]"),
]


@pytest.mark.parametrize("name,tensors,kwargs,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises(name, tensors, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        flash.attention(**tensors, **kwargs)


def test_device_mix_raises():
    meta = torch.randn(2, 4, 10, 16, device="meta")
    with pytest.raises(RuntimeError, match="key on cpu"):
        flash.attention(**_qkv(key=meta))
    with pytest.raises(RuntimeError, match="attn_mask on cpu"):
        flash.attention(**_qkv(), attn_mask=torch.zeros(8, 10, device="meta"))


@pytest.mark.parametrize("kwargs,message", [
    ({"causal_mode": 3}, "causal_mode"),
    ({"last_dim_strided": True}, "contiguous last dim"),
    ({"rank3": True}, "4-D"),
])
def test_internal_op_checks(kwargs, message):
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    causal_mode = kwargs.get("causal_mode", 0)
    if kwargs.get("last_dim_strided"):
        q = torch.randn(1, 2, 4, 16)[..., ::2]
    if kwargs.get("rank3"):
        q = q[0]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.flashv100._attention_forward(q, k, v, None, 0.0, causal_mode, 1.0)
