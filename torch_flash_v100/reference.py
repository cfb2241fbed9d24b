"""Pure-PyTorch references of the flashv100 semantics: those of scaled_dot_product_attention
(``reference_attention``) and those of FlashAttention-2 (``flash_reference_attention``).

They materialise the score matrix. ``reference_attention`` computes in the dtype it is given (pass
float64 tensors for ground truth); ``flash_reference_attention`` in ``compute_dtype``. Used by the
tests and the benchmarks; the library itself only uses ``flash_scores`` for the optional
``S_dmask`` output of the FlashAttention-2 functions. ``kvcache_reference`` is
``flash_attn_with_kvcache`` from the definitions: pages gathered, rotary applied, rows appended.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2


def causal_keep_mask(len_q: int, len_kv: int, causal_mode: int, device=None) -> torch.Tensor:
    """Bool [L, S], True where query i may attend to key j."""
    rows = torch.arange(len_q, device=device)[:, None]
    cols = torch.arange(len_kv, device=device)[None, :]
    if causal_mode == CAUSAL_TOP_LEFT:
        return cols <= rows
    if causal_mode == CAUSAL_BOTTOM_RIGHT:
        return cols <= rows + (len_kv - len_q)
    return torch.ones(len_q, len_kv, dtype=torch.bool, device=device)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: Optional[float] = None,
                        enable_gqa: bool = False, *, causal_mode: Optional[int] = None,
                        dropout_keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over [..., L, E] inputs with SDPA semantics.

    ``causal_mode`` overrides ``is_causal`` (0 none, 1 top-left, 2 bottom-right). Dropout needs
    the keep mask explicitly (``dropout_keep``, broadcastable to [..., L, S]), so that a result
    can be compared with a fused kernel's; with ``dropout_p > 0`` and no mask, this raises.
    Rows where every key is hidden give zeros, like SDPA.
    """
    if causal_mode is None:
        causal_mode = CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE
    len_q, len_kv = query.shape[-2], key.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = (query @ key.transpose(-2, -1)) * scale
    keep = causal_keep_mask(len_q, len_kv, causal_mode, query.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            scores = scores + attn_mask.to(scores.dtype)
    scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    hidden_row = torch.isneginf(row_max)
    probs = torch.exp(scores - torch.where(hidden_row, torch.zeros_like(row_max), row_max))
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    probs = probs.masked_fill(hidden_row, 0.0)
    if dropout_p > 0.0:
        if dropout_keep is None:
            raise ValueError("reference_attention: dropout_p > 0 needs dropout_keep")
        probs = probs * dropout_keep / (1.0 - dropout_p)
    return probs @ value


def naive_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                    scale: Optional[float] = None, fp32_softmax: bool = False,
                    dropout_p: float = 0.0) -> torch.Tensor:
    """Eager matmul -> scale -> mask -> softmax -> dropout -> matmul in the inputs' dtype, as
    models write it (K/V repeated for GQA; ``fp32_softmax`` upcasts the softmax). The baseline of
    the benchmarks and the demo, not a reference: it materialises the scores and gives NaN for
    fully masked rows.
    """
    if query.size(-3) != key.size(-3):
        group = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        keep = causal_keep_mask(query.size(-2), key.size(-2), CAUSAL_TOP_LEFT, query.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    if fp32_softmax:
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return probs @ value


def flash_keep_mask(len_q: int, len_kv: int, *, causal: bool = False, window_size=(-1, -1),
                    seqlens_q: Optional[torch.Tensor] = None,
                    seqlens_k: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """FlashAttention-2 visibility, bool [Sq, Sk] = [len_q, len_kv]: True where query i sees key j.

    With shift = len_kv - len_q (bottom-right alignment): causal -> j <= i + shift; window right
    >= 0 -> j <= i + shift + right; window left >= 0 -> j >= i + shift - left. ``seqlens_q`` /
    ``seqlens_k`` (int tensors [B]) make it [B, 1, Sq, Sk] for zero-padded batches of sequences
    of those lengths: shift per sequence, rows and keys past a sequence's end hidden.
    """
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(len_q, device=device)[:, None]
    cols = torch.arange(len_kv, device=device)[None, :]
    keep = torch.ones(len_q, len_kv, dtype=torch.bool, device=device)
    if seqlens_q is None:
        diagonal = rows + (len_kv - len_q)
    else:
        lens_q = seqlens_q.to(device)[:, None, None, None]
        lens_k = seqlens_k.to(device)[:, None, None, None]
        diagonal = rows + (lens_k - lens_q)
        keep = (rows < lens_q) & (cols < lens_k)
    if right >= 0:
        keep = keep & (cols <= diagonal + right)
    if left >= 0:
        keep = keep & (cols >= diagonal - left)
    return keep


def flash_scores(q: torch.Tensor, k: torch.Tensor, *, softmax_scale: float, causal: bool = False,
                 window_size=(-1, -1), softcap: float = 0.0,
                 alibi_slopes: Optional[torch.Tensor] = None,
                 seqlens_q: Optional[torch.Tensor] = None,
                 seqlens_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The scores the FlashAttention-2 softmax sees, [B, Hq, Sq, Sk] in q's dtype, -inf where a key
    is hidden: s = softmax_scale * q.k, then softcap * tanh(s / softcap) (softcap > 0), then
    - slope[b, h] * |i + shift - j| (ALiBi). q [B, Sq, Hq, D], k [B, Sk, Hkv, D] (GQA by head
    counts). ``seqlens_q`` / ``seqlens_k`` (int tensors [B]): per-sequence lengths of zero-padded
    batches (see ``flash_keep_mask``).
    """
    len_q, heads_q = q.shape[1], q.shape[2]
    len_kv, heads_kv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(heads_q // heads_kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        rows = torch.arange(len_q, device=q.device)[:, None]
        cols = torch.arange(len_kv, device=q.device)[None, :]
        shift = (len_kv - len_q if seqlens_q is None
                 else (seqlens_k - seqlens_q).to(q.device)[:, None, None, None])
        distance = (rows + shift - cols).abs().to(q.dtype)
        slopes = alibi_slopes.to(q.dtype).reshape(-1, heads_q)[:, :, None, None]
        scores = scores - slopes * distance
    keep = flash_keep_mask(len_q, len_kv, causal=causal, window_size=window_size,
                           seqlens_q=seqlens_q, seqlens_k=seqlens_k, device=q.device)
    return scores.masked_fill(~keep, float("-inf"))


def flash_reference_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None,
                              compute_dtype=torch.float64):
    """Dense-batch FA2 semantics in plain differentiable PyTorch: q [B, Sq, Hq, D], k/v
    [B, Sk, Hkv, D]; dropout_keep: bool [B, Hq, Sq, Sk] (applied with 1/(1-p)).
    Returns (out [B, Sq, Hq, D] in compute_dtype, lse [B, Hq, Sq] in compute_dtype).

    Rows that see no key give out = 0 and lse = -inf. Written from the definitions (see
    ``flash_scores``), never calling the kernels.
    """
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    scores = flash_scores(q, k, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    # Softmax shifted by the (constant) row max; rows that see nothing stay finite and zero.
    if scores.shape[-1] > 0:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    else:  # no keys at all
        row_max = scores.new_full(scores.shape[:-1] + (1,), float("-inf"))
    hidden = torch.isneginf(row_max)
    row_max = row_max.masked_fill(hidden, 0.0)
    exp = torch.exp(scores - row_max)
    total = exp.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(compute_dtype).tiny)
    probs = (exp / total).masked_fill(hidden, 0.0)
    lse = (row_max + torch.log(total)).masked_fill(hidden, float("-inf")).squeeze(-1)
    if dropout_p > 0.0:
        if dropout_keep is None:
            raise ValueError("flash_reference_attention: dropout_p > 0 needs dropout_keep")
        probs = probs * dropout_keep / (1.0 - dropout_p)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotary embedding of x [S, H, D] at ``positions`` [S] (rows of cos/sin [seqlen_ro, R / 2]):
    the first R dims rotate, pairs (0, 1), (2, 3), ... if interleaved, else (i, i + R / 2)."""
    rotary_dim = 2 * cos.shape[1]
    c = cos[positions].to(x.dtype)[:, None, :]
    s = sin[positions].to(x.dtype)[:, None, :]
    head, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = head.chunk(2, dim=-1)
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated, tail], dim=-1)


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, rotary_cos=None,
                      rotary_sin=None, cache_batch_idx=None, cache_leftpad=None,
                      block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                      compute_dtype=torch.float64):
    """flash_attn_with_kvcache from its definition, sequence by sequence; the inputs are left
    untouched. Returns (out [B, Sq, Hq, D] and lse [B, Hq, Sq] in compute_dtype, and the caches
    after the append, copies in the caches' dtype).

    The new keys are rotated in compute_dtype and stored rounded to the cache's dtype, as a cache
    holds them; q is rotated in compute_dtype. cache_seqlens: an int or an int tensor [B].
    """
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, len_q = q.shape[0], q.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    page_size = k_cache.shape[1]
    capacity = page_size * (1 if block_table is None else block_table.shape[1])
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    left, right = window_size
    bounded = [side for side in (left, right) if 0 <= side < capacity]
    advance = causal or bool(bounded)
    outs, lses = [], []
    for b in range(batch):
        length = cache_seqlens if isinstance(cache_seqlens, int) else int(cache_seqlens[b])
        first = 0 if cache_leftpad is None else int(cache_leftpad[b])
        rows = torch.arange(length + seqlen_new)
        if block_table is None:
            cache_b = b if cache_batch_idx is None else int(cache_batch_idx[b])
            index = (torch.full_like(rows, cache_b), rows)
        else:
            index = (block_table[b].cpu().long()[rows // page_size], rows % page_size)
        q_b = q[b].to(compute_dtype)
        if k is not None:
            new_rows = rows[length:]
            new_index = tuple(i[length:] for i in index)
            k_b, v_b = k[b].to(compute_dtype), v[b]
            if rotary_cos is not None:
                k_b = apply_rotary(k_b, rotary_cos.cpu(), rotary_sin.cpu(), new_rows,
                                   rotary_interleaved)
                positions = length + (torch.arange(len_q) if advance
                                      else torch.zeros(len_q, dtype=torch.long))
                q_b = apply_rotary(q_b, rotary_cos.cpu(), rotary_sin.cpu(), positions,
                                   rotary_interleaved)
            k_cache[new_index] = k_b.to(k_cache.dtype)
            v_cache[new_index] = v_b.to(v_cache.dtype)
        keys = tuple(i[first:] for i in index)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        out, lse = flash_reference_attention(
            q_b[None], k_cache[keys][None], v_cache[keys][None], causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            alibi_slopes=slopes, compute_dtype=compute_dtype)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache
