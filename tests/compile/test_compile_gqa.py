"""GQA / MQA through repeat_kv (expand + reshape) or repeat_interleave: enable_gqa=True, no copies."""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import check, qkv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])


def repeat_kv(x, n_rep):  # HF transformers
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(b, h, n_rep, s, d)
    return x.reshape(b, h * n_rep, s, d)


def gqa_repeat_kv(q, k, v):
    n = q.size(1) // k.size(1)
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def gqa_unsqueeze_expand(q, k, v):
    b, hk, s_, d = k.shape
    n = q.size(1) // hk
    k = k.unsqueeze(2).expand(b, hk, n, s_, d).reshape(b, hk * n, s_, d)
    v = v.unsqueeze(2).expand(b, hk, n, s_, d).reshape(b, hk * n, s_, d)
    return F.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v


def gqa_repeat_interleave(q, k, v):
    n = q.size(1) // k.size(1)
    k = k.repeat_interleave(n, dim=1)
    v = torch.repeat_interleave(v, n, dim=1)
    return F.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v


def tiled_repeat(q, k, v):  # .repeat tiles heads (h -> h % Hk): NOT SDPA's GQA grouping
    n = q.size(1) // k.size(1)
    k, v = k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1)
    return F.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v


def _no_expand_left(cap):
    for gm in cap.fw:
        for n in gm.graph.nodes:
            assert "expand" not in str(n.target) and "repeat_interleave" not in str(n.target), \
                gm.code


@TRAIN
@pytest.mark.parametrize("fn", [gqa_repeat_kv, gqa_unsqueeze_expand, gqa_repeat_interleave],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("hk", [2, 1], ids=["gqa", "mqa"])
def test_gqa(fn, hk, train):
    cap = check(fn, qkv(h=4, hk=hk), train=train)
    (call,) = cap.attention_calls()
    assert call["enable_gqa"] is True
    assert call["key"].meta["example_value"].shape[1] == hk
    _no_expand_left(cap)


@TRAIN
def test_tiled_repeat_is_not_gqa(train):
    cap = check(tiled_repeat, qkv(h=4, hk=2), train=train)
    assert cap.attention_calls()[0]["enable_gqa"] is False


def mqa_broadcast(q, k, v):  # Falcon multi-query: one k/v head broadcast by matmul
    return F.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v


@TRAIN
def test_mqa_by_broadcasting(train):
    cap = check(mqa_broadcast, qkv(h=4, hk=1), train=train)
    assert cap.attention_calls()[0]["enable_gqa"] is True
