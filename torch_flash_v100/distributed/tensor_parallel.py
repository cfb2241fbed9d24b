"""DTensor sharding rules for the flashv100 ops: tensor parallelism over heads (and batch).

Attention is independent per (batch, head): with query, key and value sharded on the head dim
(``Shard(1)`` in the SDPA layout ``[B, H, L, E]``, ``Shard(2)`` in the FlashAttention-2 layout
``[B, S, H, D]``), each rank runs the op on its own heads and the outputs are sharded the same
way; no communication. The same holds for the batch dim. These rules are registered with
``torch.distributed.tensor.experimental.register_sharding`` for the internal ops
``_attention_forward`` / ``_attention_backward`` and ``_flash_forward`` / ``_flash_backward``.
The public op ``flashv100::attention`` is a composite (CompositeImplicitAutograd): it decomposes
into ``_attention_forward`` before DTensor sees it, so it needs no rule of its own, and
``torch_flash_v100.attention`` and the FlashAttention-2 functions accept DTensors.

Every op also has the all-replicated rule; inputs sharded otherwise (e.g. on the sequence dim)
are redistributed by DTensor to a rule above (use ``ring_attention`` for sequence sharding).
Grouped-query attention is sharded over heads only when the key/value heads divide evenly over
the mesh (query head h reads key/value head h // (Hq / Hkv): uneven chunks would break groups).
A mask broadcast over the sharded dim is replicated, and its gradient is then a partial sum.
Dropout under head sharding draws each rank's mask from its own generator for its local heads:
correct dropout, but not the masks of an unsharded run.
"""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding
except ImportError:  # torch without DTensor's public custom-op sharding API
    register_sharding = None

_ops = torch.ops.flashv100


def available() -> bool:
    """Whether this torch has ``register_sharding`` (and the rules are registered)."""
    return register_sharding is not None


def _heads_shardable(heads_q: int, heads_kv: int, mesh) -> bool:
    return heads_q == heads_kv or heads_kv % mesh.size() == 0


def _replicated(spec):
    """The placement of an optional tensor that every rank needs whole."""
    return None if spec is None else Replicate()


def _optional(spec, dim: int):
    """The placement of an optional tensor broadcastable along ``dim`` when ``dim`` is sharded."""
    if spec is None:
        return None
    return Replicate() if spec.shape[dim] == 1 else Shard(dim)


def _optional_grad(spec, dim: int, requires_grad: bool):
    """The placement of an optional tensor's gradient (an empty tensor when none is computed)."""
    if not requires_grad:
        return Replicate()
    return Partial() if spec.shape[dim] == 1 else Shard(dim)


def _attention_dims(query, key):
    """The dims of the SDPA-layout ops that may be sharded: batch, and heads where groups allow."""
    dims = [0]
    if _heads_shardable(query.shape[1], key.shape[1], query.mesh):
        dims.append(1)
    return dims


def _attention_forward_rules(query, key, value, attn_mask, dropout_p, causal_mode, scale):
    rules = [([Replicate()] * 3, [Replicate()] * 3 + [_replicated(attn_mask)]
              + [None] * 3)]
    for dim in _attention_dims(query, key):
        rules.append(([Shard(dim), Shard(dim), Replicate()],
                      [Shard(dim)] * 3 + [_optional(attn_mask, dim)] + [None] * 3))
    return rules


def _attention_backward_rules(grad_out, query, key, value, attn_mask, out, lse, rng_state,
                              dropout_p, causal_mode, scale, mask_requires_grad, deterministic):
    rules = [([Replicate()] * 4,
              [Replicate()] * 4 + [_replicated(attn_mask)] + [Replicate()] * 3 + [None] * 5)]
    for dim in _attention_dims(query, key):
        rules.append(([Shard(dim)] * 3 + [_optional_grad(attn_mask, dim, mask_requires_grad)],
                      [Shard(dim)] * 4 + [_optional(attn_mask, dim)] + [Shard(dim)] * 2
                      + [Replicate()] + [None] * 5))
    return rules


def _flash_dims(query, key, cu_seqlens_q):
    """(dim of q/k/v/out, dim of softmax_lse, dim of alibi slopes [Hq] or [B, Hq]) per
    shardable dim of the FlashAttention-2 ops: heads (dense [B, S, H, D] or varlen [T, H, D])
    where groups allow, and batch (dense only)."""
    varlen = cu_seqlens_q is not None
    head_dim = 1 if varlen else 2
    dims = []
    if _heads_shardable(query.shape[head_dim], key.shape[head_dim], query.mesh):
        dims.append((head_dim, 0 if varlen else 1, "heads"))
    if not varlen:
        dims.append((0, 0, "batch"))
    return dims


def _slopes(alibi_slopes, kind: str):
    if alibi_slopes is None:
        return None
    if kind == "heads":
        return Shard(alibi_slopes.ndim - 1)
    return Shard(0) if alibi_slopes.ndim == 2 else Replicate()


def _flash_forward_rules(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                         window_right, softcap, alibi_slopes, deterministic=False):
    cu = [_replicated(cu_seqlens_q), _replicated(cu_seqlens_k)]
    rules = [([Replicate()] * 3,
              [Replicate()] * 3 + cu + [None] * 8 + [_replicated(alibi_slopes)])]
    for dim, lse_dim, kind in _flash_dims(query, key, cu_seqlens_q):
        rules.append(([Shard(dim), Shard(lse_dim), Replicate()],
                      [Shard(dim)] * 3 + cu + [None] * 8 + [_slopes(alibi_slopes, kind)]))
    return rules


def _flash_backward_rules(grad_out, query, key, value, out, softmax_lse, rng_state, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                          causal, window_left, window_right, softcap, alibi_slopes,
                          deterministic):
    cu = [_replicated(cu_seqlens_q), _replicated(cu_seqlens_k)]
    rules = [([Replicate()] * 3, [Replicate()] * 7 + cu + [None] * 8
              + [_replicated(alibi_slopes), None])]
    for dim, lse_dim, kind in _flash_dims(query, key, cu_seqlens_q):
        rules.append(([Shard(dim)] * 3,
                      [Shard(dim)] * 5 + [Shard(lse_dim), Replicate()] + cu + [None] * 8
                      + [_slopes(alibi_slopes, kind), None]))
    return rules


if register_sharding is not None:
    register_sharding(_ops._attention_forward.default)(_attention_forward_rules)
    register_sharding(_ops._attention_backward.default)(_attention_backward_rules)
    register_sharding(_ops._flash_forward.default)(_flash_forward_rules)
    register_sharding(_ops._flash_backward.default)(_flash_backward_rules)
