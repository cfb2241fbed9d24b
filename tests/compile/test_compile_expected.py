"""expecttest inline expectations of the rewritten (pre-autograd) graph for canonical cases.

Regenerate with EXPECTTEST_ACCEPT=1 after an intended change of the rewrite."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

TestCase = pytest.importorskip("expecttest").TestCase

from compile_testing import Capture, qkv, reset


def _code(fn, *args) -> str:
    args = [a.cpu() for a in args]  # the expected text is the CPU graph
    reset()
    cap = Capture()
    torch.compile(fn, backend=cap.backend(), fullgraph=True)(*args)
    (gm,) = cap.dynamo
    lines = []
    for line in gm.code.strip().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("def forward"):
            continue
        line = re.sub(r"\s+#.*$", "", line)
        lines.append(line)
    # the graph inputs (`l_q_ = L_q_`) come in first-use or in argument order, depending on the
    # torch version: sorted, they do not depend on it
    inputs = sorted(line for line in lines if re.fullmatch(r"\w+ = L_\w+", line))
    return "\n".join(inputs + [line for line in lines if line not in inputs])


def sdpa_math(q, k, v, mask):
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    s = s + mask
    return F.dropout(F.softmax(s, dim=-1), p=0.0, training=False) @ v


def causal_padding_gqa(q, k, v, keep):
    b, hk, s_, d = k.shape
    n = q.size(1) // hk
    k = k[:, :, None].expand(b, hk, n, s_, d).reshape(b, hk * n, s_, d)
    v = v[:, :, None].expand(b, hk, n, s_, d).reshape(b, hk * n, s_, d)
    L = q.size(-2)
    i = torch.arange(L)[:, None]
    j = torch.arange(s_)[None, :]
    m = (j <= i) & keep[:, None, None, :]
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    s = s.masked_fill(~m, torch.finfo(s.dtype).min)
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def sliding_window(q, k, v):  # transformers' masks of Mistral-style sliding layers
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    qi = torch.arange(8)[None, None, :, None]
    kj = torch.arange(8)[None, None, None, :]
    keep = (kj > qi - 3) & (kj <= qi)
    s = s + torch.where(keep, torch.zeros(()), torch.finfo(s.dtype).min)
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def gemma2_softcap(q, k, v):
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    s = torch.tanh(s / 50.0) * 50.0
    s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), torch.finfo(s.dtype).min)
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def mpt_alibi(q, k, v):
    slopes = (1.0 / torch.pow(2, torch.arange(1, 5).float() * 2.0)).view(1, 4, 1, 1)
    alibi = (torch.arange(-7, 1).view(1, 1, 1, 8) * slopes).squeeze(0)
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.25 + alibi
    s = s.masked_fill(torch.arange(8)[None, :] > torch.arange(8)[:, None],
                      torch.finfo(s.dtype).min)
    return torch.matmul(F.softmax(s.float(), dim=-1).to(v.dtype), v)


def einsum_blhd(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


class TestExpectedGraphs(TestCase):
    def test_sdpa_math(self):
        q, k, v = qkv()
        self.assertExpectedInline(_code(sdpa_math, q, k, v, torch.randn(2, 1, 8, 8)), """\
l_k_ = L_k_
l_mask_ = L_mask_
l_q_ = L_q_
l_v_ = L_v_
attention_default = torch.ops.flashv100.attention.default(l_q_, l_k_, l_v_, l_mask_, 0.0, False, scale = 0.25, enable_gqa = False);  l_q_ = l_k_ = l_v_ = l_mask_ = None
return (attention_default,)""")

    def test_causal_padding_gqa(self):
        q, k, v = qkv(h=4, hk=2)
        keep = torch.ones(2, 8, dtype=torch.bool)
        self.assertExpectedInline(_code(causal_padding_gqa, q, k, v, keep), """\
l_k_ = L_k_
l_keep_ = L_keep_
l_q_ = L_q_
l_v_ = L_v_
arange = torch.arange(8)
i = arange[(slice(None, None, None), None)];  arange = None
arange_1 = torch.arange(8)
j = arange_1[(None, slice(None, None, None))];  arange_1 = None
le = j <= i;  j = i = None
getitem_4 = l_keep_[(slice(None, None, None), None, None, slice(None, None, None))];  l_keep_ = None
m = le & getitem_4;  le = getitem_4 = None
where = torch.where(m, 0.0, -3.4028234663852886e+38);  m = None
attention_default = torch.ops.flashv100.attention.default(l_q_, l_k_, l_v_, where, 0.0, True, scale = 0.25, enable_gqa = True);  l_q_ = l_k_ = None
amax = torch.amax(where, -1, True)
amin = torch.amin(where, -1, True);  where = None
eq = torch.eq(amin, amax);  amin = None
le_1 = torch.le(amax, -1.7014117331926443e+38)
logical_and = torch.logical_and(eq, le_1);  eq = le_1 = None
isfinite = torch.isfinite(amax);  amax = None
logical_and_1 = torch.logical_and(logical_and, isfinite);  logical_and = isfinite = None
mean = torch.mean(l_v_, -2, True);  l_v_ = None
repeat_interleave = torch.repeat_interleave(mean, 2, -3);  mean = None
where_1 = torch.where(logical_and_1, repeat_interleave, attention_default);  logical_and_1 = repeat_interleave = attention_default = None
return (where_1,)""")

    def test_einsum_blhd(self):
        self.assertExpectedInline(_code(einsum_blhd, *qkv(layout="blhd")), """\
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
permute = torch.permute(l_q_, [0, 2, 1, 3]);  l_q_ = None
permute_1 = torch.permute(l_k_, [0, 2, 1, 3]);  l_k_ = None
permute_2 = torch.permute(l_v_, [0, 2, 1, 3]);  l_v_ = None
attention_default = torch.ops.flashv100.attention.default(permute, permute_1, permute_2, None, 0.0, False, scale = 0.25, enable_gqa = False);  permute = permute_1 = permute_2 = None
permute_3 = torch.permute(attention_default, [0, 2, 1, 3]);  attention_default = None
return (permute_3,)""")

    def test_sliding_window(self):
        self.assertExpectedInline(_code(sliding_window, *qkv()), """\
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
transpose_1 = torch.transpose(l_q_, 1, 2);  l_q_ = None
transpose_2 = torch.transpose(l_k_, 1, 2);  l_k_ = None
transpose_3 = torch.transpose(l_v_, 1, 2);  l_v_ = None
_flash_forward_default = torch.ops.flashv100._flash_forward.default(transpose_1, transpose_2, transpose_3, None, None, 8, 8, 0.0, 0.25, True, 2, 0, 0.0, None);  transpose_1 = transpose_2 = transpose_3 = None
getitem_2 = _flash_forward_default[0];  _flash_forward_default = None
transpose_4 = torch.transpose(getitem_2, 1, 2);  getitem_2 = None
return (transpose_4,)""")

    def test_gemma2_softcap(self):
        self.assertExpectedInline(_code(gemma2_softcap, *qkv()), """\
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
transpose_1 = torch.transpose(l_q_, 1, 2);  l_q_ = None
transpose_2 = torch.transpose(l_k_, 1, 2);  l_k_ = None
transpose_3 = torch.transpose(l_v_, 1, 2);  l_v_ = None
_flash_forward_default = torch.ops.flashv100._flash_forward.default(transpose_1, transpose_2, transpose_3, None, None, 8, 8, 0.0, 0.25, True, -1, 0, 50.0, None);  transpose_1 = transpose_2 = transpose_3 = None
getitem = _flash_forward_default[0];  _flash_forward_default = None
transpose_4 = torch.transpose(getitem, 1, 2);  getitem = None
return (transpose_4,)""")

    def test_mpt_alibi(self):
        self.assertExpectedInline(_code(mpt_alibi, *qkv()), """\
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
arange = torch.arange(1, 5)
float_1 = arange.float();  arange = None
mul = float_1 * 2.0;  float_1 = None
pow_1 = torch.pow(2, mul);  mul = None
truediv = 1.0 / pow_1;  pow_1 = None
slopes = truediv.view(1, 4, 1, 1);  truediv = None
getitem_2 = l_q_[(Ellipsis, 0, 0)]
zeros_like = torch.zeros_like(getitem_2, dtype = torch.float32);  getitem_2 = None
reshape = torch.reshape(slopes, (4,));  slopes = None
to_1 = reshape.to(torch.float32);  reshape = None
add_1 = torch.add(zeros_like, to_1);  zeros_like = to_1 = None
transpose_1 = torch.transpose(l_q_, 1, 2);  l_q_ = None
transpose_2 = torch.transpose(l_k_, 1, 2);  l_k_ = None
transpose_3 = torch.transpose(l_v_, 1, 2);  l_v_ = None
_flash_forward_default = torch.ops.flashv100._flash_forward.default(transpose_1, transpose_2, transpose_3, None, None, 8, 8, 0.0, 0.25, True, -1, 0, 0.0, add_1);  transpose_1 = transpose_2 = transpose_3 = add_1 = None
getitem_3 = _flash_forward_default[0];  _flash_forward_default = None
transpose_4 = torch.transpose(getitem_3, 1, 2);  getitem_3 = None
return (transpose_4,)""")
