"""The FlashAttention-2 (v2.8) functions, on the flashv100 kernels.

Code written for ``flash_attn`` runs by changing one import line::

    from torch_flash_v100.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

Same names, arguments, defaults, return values and semantics as ``flash_attn.flash_attn_interface``
(v2.8), on every device (CPU included) and every floating dtype. Differences:

- a query row that sees no key (e.g. ``causal=True`` with ``seqlen_q > seqlen_k``, or an empty
  window) gives ``out = 0`` and ``softmax_lse = -inf``; flash_attn writes ``+inf`` to that lse;
- ``window_size`` follows its definition exactly; flash_attn treats ``window_size[1] >=
  seqlen_k`` as unbounded, which (when also ``seqlen_q > window_size[1] + 1``) lets its first
  rows see keys right of their window;
- ``S_dmask`` (``return_attn_probs=True``) is always returned (flash_attn returns ``None``
  without dropout) and is exactly the softmax probabilities, [B, H, max_seqlen_q, max_seqlen_k]
  without rounding of the lengths, dropped entries negated (see ``flash_attn_func``);
- ``softmax_lse`` is fp64 for fp64 inputs (fp32 otherwise, as flash_attn);
- ``flash_attn_with_kvcache`` takes paged caches of any page size that is a multiple of 16
  (flash_attn: 256), ``cache_leftpad`` together with ``block_table`` (flash_attn refuses it), and
  CPU tensors of every floating dtype; its bad index values (a ``block_table`` entry outside the
  cache, a cache too small for the append) raise instead of reading or writing out of bounds;
- ``flash_attn_varlen_func`` with ``block_table`` (a paged KV cache, forward only) takes no dropout
  and no ``return_attn_probs``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import flash_scores

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
]


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if len(window_size) != 2:
        raise ValueError(f"window_size: expected (left, right), got {window_size!r}")
    window_left, window_right = window_size
    out, softmax_lse, rng_state = torch.ops.flashv100._flash_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(dropout_p),
        float(softmax_scale), bool(causal), int(window_left), int(window_right), float(softcap),
        alibi_slopes, bool(deterministic))
    if not return_attn_probs:
        return out
    probs = _attention_probs(q, k, softmax_lse, rng_state, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes)
    return out, softmax_lse, probs


def _padded(packed: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int):
    """[total, H, D] -> zero-padded [B, max_seqlen, H, D] and the lengths [B] (no host sync)."""
    batch = cu_seqlens.numel() - 1
    rows = torch.arange(packed.shape[0], device=packed.device)
    sequence = torch.searchsorted(cu_seqlens[1:], rows.to(cu_seqlens.dtype), right=True)
    position = rows - cu_seqlens[sequence]
    padded = packed.new_zeros((batch, max_seqlen) + tuple(packed.shape[1:]))
    padded[sequence, position] = packed
    return padded, cu_seqlens.diff(), (sequence, position)


@torch.no_grad()
def _attention_probs(q, k, softmax_lse, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes):
    """S_dmask: exp(scores - softmax_lse) with the kernels' lse, [B, Hq, Sq, Sk] in q's dtype,
    dropped entries negated; zero where a key is hidden or outside a sequence."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    lens_q = lens_k = None
    lse = softmax_lse
    if cu_seqlens_q is not None:
        q, lens_q, (sequence, position) = _padded(q, cu_seqlens_q, max_seqlen_q)
        k, lens_k, _ = _padded(k, cu_seqlens_k, max_seqlen_k)
        lse = softmax_lse.new_full((q.shape[0], q.shape[2], max_seqlen_q), float("-inf"))
        lse[sequence, :, position] = softmax_lse.t()
    scores = flash_scores(q.to(compute), k.to(compute), softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size, softcap=softcap,
                          alibi_slopes=alibi_slopes, seqlens_q=lens_q, seqlens_k=lens_k)
    lse = lse.to(compute)[..., None]
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0))
    if dropout_p > 0.0:
        keep = torch.ops.flashv100._dropout_mask(rng_state, q.shape[0], q.shape[2], q.shape[1],
                                                 k.shape[1], dropout_p)
        probs = torch.where(keep, probs, -probs)
    return probs.to(q.dtype)


_ARGS_DOC = """
    dropout_p: float. Dropout probability (in [0, 1)); set it to 0.0 for evaluation. The keep
        mask comes from the counter-based stream of ``torch.ops.flashv100._dropout_mask``.
    softmax_scale: float. Scaling of QK^T before the softmax; default 1 / sqrt(headdim).
    causal: bool. Causal mask aligned to the bottom-right corner of the attention matrix: with
        seqlen_q = 2 and seqlen_k = 5, row 0 sees keys 0..3 and row 1 keys 0..4; with seqlen_q = 5
        and seqlen_k = 2, rows 0..2 see nothing (out 0) and rows 3, 4 see keys 0 and 0..1.
    window_size: (left, right). Sliding window local attention: query i sees key j iff
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 leaves a side
        unbounded. causal=True sets right to 0. Key blocks outside every row's window are skipped.
    softcap: float. > 0: scores s become softcap * tanh(s / softcap) before the softmax (with its
        gradient); 0 disables it.
    alibi_slopes: fp32 (nheads,) or (batch_size, nheads). Adds -slope * |i + seqlen_k - seqlen_q - j|
        to the score of query i and key j; computed in the kernels, never materialised.
    deterministic: bool. Bitwise-reproducible backward (also chosen by
        ``torch.use_deterministic_algorithms(True)``); the CPU backward always is.
    return_attn_probs: bool. Also return softmax_lse and S_dmask (for testing only: S_dmask
        materialises the whole attention matrix).
"""

_RETURNS_DOC = """
    Return:
        out: {out_shape}, q's dtype.
        softmax_lse [if return_attn_probs=True]: {lse_shape}, fp32 (fp64 for fp64 inputs). The
            logsumexp of each row of the modified, scaled scores (the log of the softmax
            normalizer); -inf for rows that see no key.
        S_dmask [if return_attn_probs=True]: (batch_size, nheads, {s_shape}), q's dtype. The
            softmax probabilities exp(score - softmax_lse), zero where a key is hidden (or, for
            varlen, outside a sequence); with dropout, dropped entries are negated (< 0 or -0.0),
            kept ones are not, and neither is rescaled by 1 / (1 - dropout_p).
"""
_DENSE_RETURNS = _RETURNS_DOC.format(
    out_shape="(batch_size, seqlen, nheads, headdim)", lse_shape="(batch_size, nheads, seqlen)",
    s_shape="seqlen, seqlen_k")
_VARLEN_RETURNS = _RETURNS_DOC.format(
    out_shape="(total, nheads, headdim)", lse_shape="(nheads, total_q)",
    s_shape="max_seqlen_q, max_seqlen_k")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    return _attention(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


flash_attn_func.__doc__ = """Attention over [B, S, H, D] tensors (FlashAttention-2's flash_attn_func).

    Multi-query and grouped-query attention (MQA/GQA): K and V may have fewer heads than Q (nheads
    must be a multiple of nheads_k); query heads 0..g-1 attend with K/V head 0, and so on.

    Arguments:
    q: (batch_size, seqlen, nheads, headdim)
    k: (batch_size, seqlen_k, nheads_k, headdim)
    v: (batch_size, seqlen_k, nheads_k, headdim)
""" + _ARGS_DOC + _DENSE_RETURNS


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    q, k, v = qkv.unbind(dim=2)
    return _attention(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


flash_attn_qkvpacked_func.__doc__ = """flash_attn_func on a packed qkv tensor, without copies.

    The gradient flows to qkv (views of it are passed to the kernels).

    Arguments:
    qkv: (batch_size, seqlen, 3, nheads, headdim)
""" + _ARGS_DOC + _DENSE_RETURNS


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    k, v = kv.unbind(dim=2)
    return _attention(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


flash_attn_kvpacked_func.__doc__ = """flash_attn_func with packed key/value, without copies.

    MQA/GQA as in flash_attn_func; the gradient flows to kv.

    Arguments:
    q: (batch_size, seqlen, nheads, headdim)
    kv: (batch_size, seqlen_k, 2, nheads_k, headdim)
""" + _ARGS_DOC + _DENSE_RETURNS


def _paged_attention(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p,
                     softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                     block_table):
    # Packed queries over each sequence's pages: the KV-cache op's packed-query form, whose key
    # lengths are cu_seqlens_k's differences (its start is never read: the pages place the rows).
    name = "flash_attn_varlen_func"
    if dropout_p != 0.0 or return_attn_probs:
        raise ValueError(f"{name}: with block_table (a paged KV cache, forward only) expected "
                         f"dropout_p=0 and return_attn_probs=False, got dropout_p={dropout_p}, "
                         f"return_attn_probs={return_attn_probs}")
    if not (isinstance(cu_seqlens_k, torch.Tensor) and cu_seqlens_k.dtype == torch.int32
            and cu_seqlens_k.dim() == 1 and cu_seqlens_k.shape == cu_seqlens_q.shape):
        raise ValueError(f"{name}: expected cu_seqlens_k an int32 (batch_size + 1,) tensor like "
                         f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, got "
                         f"{getattr(cu_seqlens_k, 'dtype', type(cu_seqlens_k))} "
                         f"{tuple(getattr(cu_seqlens_k, 'shape', ()))}")
    seqlens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return _kvcache(q, k_cache, v_cache, None, None, None, None, seqlens_k, None, None,
                    block_table, softmax_scale, causal, window_size, softcap, True, alibi_slopes,
                    1, True, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)[0]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    if block_table is not None:
        return _paged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p,
                                softmax_scale, causal, window_size, softcap, alibi_slopes,
                                return_attn_probs, block_table)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


flash_attn_varlen_func.__doc__ = """Attention over a packed batch of variable-length sequences.

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (and of out) and rows
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v; one kernel launch over the whole batch, no
    padding. Empty sequences are allowed. causal, window_size and ALiBi align each sequence on its
    own bottom-right corner (seqlen_q, seqlen_k of that sequence). MQA/GQA as in flash_attn_func.

    Arguments:
    q: (total_q, nheads, headdim), total_q = total number of query tokens in the batch.
    k: (total_k, nheads_k, headdim), total_k = total number of key tokens in the batch.
    v: (total_k, nheads_k, headdim)
    cu_seqlens_q: int32 (batch_size + 1,) on q's device: 0, non-decreasing, ending at total_q.
    cu_seqlens_k: int32 (batch_size + 1,) on q's device: 0, non-decreasing, ending at total_k.
    max_seqlen_q: int, at least the longest query sequence.
    max_seqlen_k: int, at least the longest key sequence.
""" + _ARGS_DOC + """    block_table [optional]: int32 (batch_size, max_num_blocks_per_seq), a paged KV cache
        (inference: no dropout, no return_attn_probs, no backward). k and v are then k_cache and
        v_cache (num_blocks, page_block_size, nheads_k, headdim), page_block_size a multiple of
        16, and sequence b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its
        pages (page i is k[block_table[b, i]]), as in flash_attn_with_kvcache; max_seqlen_k is
        not read then. One launch over the packed queries, no padding.
""" + _VARLEN_RETURNS


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    q, k, v = qkv.unbind(dim=1)
    return _attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


flash_attn_varlen_qkvpacked_func.__doc__ = """flash_attn_varlen_func on a packed qkv tensor.

    The gradient flows to qkv (views of it are passed to the kernels, no copies).

    Arguments:
    qkv: (total, 3, nheads, headdim)
    cu_seqlens: int32 (batch_size + 1,), the sequences of both queries and keys.
    max_seqlen: int, at least the longest sequence.
""" + _ARGS_DOC + _VARLEN_RETURNS


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    k, v = kv.unbind(dim=1)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


flash_attn_varlen_kvpacked_func.__doc__ = """flash_attn_varlen_func with packed key/value.

    MQA/GQA as in flash_attn_func; the gradient flows to kv.

    Arguments:
    q: (total_q, nheads, headdim)
    kv: (total_k, 2, nheads_k, headdim)
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as in flash_attn_varlen_func.
""" + _ARGS_DOC + _VARLEN_RETURNS


def _index_tensor(t):
    return None if t is None else t.contiguous()


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            check_index_values=True):
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("flash_attn_with_kvcache: k and v need cache_seqlens (the rows they "
                             "are appended at)")
        pages = 1 if block_table is None else block_table.shape[1]
        cache_seqlens = k_cache.shape[1] * pages  # the whole cache
    if isinstance(cache_seqlens, (int, torch.SymInt)):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    out, softmax_lse = _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                                causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                                num_splits, check_index_values)
    return (out, softmax_lse) if return_softmax_lse else out


def _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
             rotary_interleaved, alibi_slopes, num_splits, check_index_values, cu_seqlens_q=None,
             max_seqlen_q=0):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if len(window_size) != 2:
        raise ValueError(f"window_size: expected (left, right), got {window_size!r}")
    q, k, v = (x if x is None or x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return torch.ops.flashv100._kvcache_forward(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, _index_tensor(cache_seqlens),
        _index_tensor(cache_batch_idx), _index_tensor(cache_leftpad), block_table,
        float(softmax_scale), bool(causal), int(window_size[0]), int(window_size[1]),
        float(softcap), bool(rotary_interleaved), alibi_slopes, int(num_splits),
        bool(check_index_values), cu_seqlens_q, max_seqlen_q)


flash_attn_with_kvcache.__doc__ = """Attention of new queries to a KV cache, appending new keys and
    values to it in place first (FlashAttention-2's flash_attn_with_kvcache, for decoding).

    If k and v are given, they are written (k after rotary embedding) into k_cache and v_cache at
    rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of each sequence, in place; the
    cache must have room for them. Then q attends to the rows
    [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of its sequence's cache (seqlen_k =
    cache_seqlens - cache_leftpad + seqlen_new keys, new ones included). Work is proportional to
    each sequence's own length. No backward: outputs of inputs that require grad raise on
    backward.

    Rotary embedding (rotary_cos/rotary_sin, needs k and v): the new key i is rotated at position
    cache_seqlens[b] + i; with causal or a window, query row i too, else every query row at
    cache_seqlens[b]. Positions are cache rows (a left padding does not shift them).

    causal and window_size align bottom-right, as in flash_attn_func (seqlen_q against seqlen_k
    above). MQA/GQA as in flash_attn_func; single-token decoding with nheads > nheads_k (and
    neither a left window nor ALiBi) runs the query heads of a KV head as the rows of one tile.

    Arguments:
    q: (batch_size, seqlen, nheads, headdim)
    k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table (a paged
        cache) (num_blocks, page_block_size, nheads_k, headdim); page_block_size a multiple of 16.
        A contiguous last dim.
    v_cache: like k_cache.
    k, v [optional]: (batch_size, seqlen_new, nheads_k, headdim), the new keys and values.
    rotary_cos, rotary_sin [optional]: (seqlen_ro, rotary_dim / 2), contiguous, q's dtype;
        rotary_dim even and <= headdim, seqlen_ro at least the cache's rows per sequence.
    cache_seqlens: int, or int32 (batch_size,): the rows of each sequence already in its cache.
        None: the whole cache (no k, v then).
    cache_batch_idx [optional]: int32 (batch_size,): the k_cache batch row of each sequence (not
        with block_table). With duplicates and k, v, which sequence's rows land is unspecified.
    cache_leftpad [optional]: int32 (batch_size,): the first cache row of each sequence (rows
        before it are ignored); <= cache_seqlens.
    block_table [optional]: int32 (batch_size, max_num_blocks_per_seq): page i of sequence b is
        k_cache[block_table[b, i]]; only the entries of pages holding rows of the sequence are
        read (and checked).
    softmax_scale, causal, window_size, softcap, alibi_slopes: as in flash_attn_func.
    rotary_interleaved: rotary pairs (0, 1), (2, 3), ... if True, else (0, rotary_dim / 2),
        (1, rotary_dim / 2 + 1), ... (GPT-NeoX).
    num_splits: split-KV: > 1 cuts each sequence's keys into that many shares computed by
        separate thread blocks and combined (deterministically) by their softmax_lse; 1: no
        split; 0: chosen from the GPU's SM count and the shape (the CPU kernels take 0 as 1).
    return_softmax_lse: also return softmax_lse.

    check_index_values (keyword only, not in FlashAttention-2): the index values (cache_seqlens,
        cache_leftpad, cache_batch_idx, block_table) are checked on the host. On CUDA that is one
        device-to-host copy of them all, which waits for the GPU's queued work: an eager decode
        loop pays that in every layer of every step. False trusts them, as FlashAttention-2
        does: no copies, and values outside the rules above read and write out of bounds. While
        the current CUDA stream captures a graph they are trusted either way (a capture cannot
        copy to the host). The CPU kernels always check them (they are on the host already).

    Return:
        out: (batch_size, seqlen, nheads, headdim).
        softmax_lse [if return_softmax_lse=True]: (batch_size, nheads, seqlen), fp32 (fp64 for
            fp64 inputs); -inf for rows that see no key.
"""
