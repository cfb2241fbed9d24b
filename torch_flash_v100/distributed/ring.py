"""Context parallelism: ring attention over a sequence split across the ranks of a process group.

Each rank holds one shard of the sequence of query, key and value (``[B, H, L / W, E]``, W ranks).
The forward keeps its queries and passes the key/value blocks around the ring (rank r sends to
r + 1 and receives from r - 1, the next transfer in flight while the current block is computed),
so after W steps every query block has met every key block. Each step runs the fused forward op
``flashv100::_attention_forward`` on one (query, key block) pair; the partial outputs are merged by
their per-row log-sum-exp:

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

which is exact (the softmax over all keys, block by block). The backward rotates the key/value
blocks again and runs ``flashv100::_attention_backward`` per block with the merged output and lse
(the softmax statistics of the whole row): dQ stays local, and each block's dK/dV accumulator
travels with the block and is sent back to its owner after the last step.

Memory per rank: the local shards plus two key/value blocks (the one computed and the one in
flight); the backward also holds two dK/dV accumulators (fp32, fp64 for fp64 inputs). Nothing of
size O(L) x O(L) or O(W) blocks is kept: the backward re-rotates K/V instead of saving them.

Causal attention is exact at block granularity: a query block skips key blocks entirely above the
diagonal, runs the diagonal block with the causal kernel and the blocks below without a mask. With
the contiguous layout (rank r holds positions [r L/W, (r+1) L/W)) rank r computes r + 1 blocks,
so the last rank does W times the work of the first. The ``"zigzag"`` layout balances it: the
sequence is cut into 2W chunks and rank r holds chunks r and 2W - 1 - r; then every step except
the diagonal one costs each rank exactly half a block (the whole of its queries against the first
half of the key block, or the second half of its queries against the whole key block).
:func:`shard_sequence` / :func:`unshard_sequence` convert between full tensors and either layout.

PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` is not used: it
monkey-patches ``torch.nn.functional.scaled_dot_product_attention`` and routes only ATen's
flash/efficient/cuDNN SDPA ops (a fixed table in a private handler,
``DTensor._op_dispatcher._custom_op_handlers``) to its ring; there is no documented hook to
register another attention op, and CPU SDPA is not among them.

Not supported (raise): attention masks other than causal, dropout (each block would draw its own
mask; the result could not match an unsharded run), and ``torch.compile`` tracing (the ring runs
eagerly: a graph break).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_ops = torch.ops.flashv100

LAYOUTS = ("contiguous", "zigzag")
_KV_TAG, _GRAD_KV_TAG = 1, 2  # separate message streams for K/V and their gradients


def _process_group(group):
    """A ProcessGroup from None (the default group), a ProcessGroup or a 1-D DeviceMesh."""
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group"):  # DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"ring attention: expected a 1-D DeviceMesh, got {group.ndim} dims")
        return group.get_group()
    return group


def _chunk_ids(layout: str, rank: int, world: int) -> List[int]:
    """Which of the sequence's chunks rank ``rank`` holds (W chunks, or 2W for zigzag), in order."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def _chunks_per_rank(layout: str) -> int:
    return len(_chunk_ids(layout, 0, 1))


def shard_sequence(tensor: torch.Tensor, dim: int, *, group=None,
                   layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of a full-sequence ``tensor`` (the same on every rank) along ``dim``.

    The sequence length must be divisible by W (``"contiguous"``) or 2W (``"zigzag"``).
    """
    group = _process_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = _chunk_ids(layout, rank, world)
    pieces = world * len(ids)
    if tensor.shape[dim] % pieces:
        raise ValueError(f"shard_sequence: the length {tensor.shape[dim]} of dim {dim} is not "
                         f"divisible by {pieces} ({layout} layout over {world} ranks)")
    chunks = tensor.chunk(pieces, dim)
    return torch.cat([chunks[i] for i in ids], dim).contiguous()


def unshard_sequence(shard: torch.Tensor, dim: int, *, group=None,
                     layout: str = "contiguous") -> torch.Tensor:
    """The full sequence from every rank's ``shard`` (an all-gather; inverse of
    :func:`shard_sequence`). Not differentiable."""
    group = _process_group(group)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(gathered, shard.contiguous(), group=group)
    per_rank = _chunks_per_rank(layout)
    if shard.shape[dim] % per_rank:
        raise ValueError(f"unshard_sequence: the shard length {shard.shape[dim]} of dim {dim} "
                         f"is not divisible by {per_rank} ({layout} layout)")
    chunks = [None] * (world * per_rank)
    for rank, piece in enumerate(gathered):
        for chunk_id, chunk in zip(_chunk_ids(layout, rank, world), piece.chunk(per_rank, dim)):
            chunks[chunk_id] = chunk
    return torch.cat(chunks, dim)


class _Ring:
    """Sends tensors to the next rank of the group and receives as many from the previous one."""

    def __init__(self, group):
        self.group = group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def shift(self, tensors: Sequence[torch.Tensor], tag: int) -> "_Transfer":
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        return _Transfer(dist.batch_isend_irecv(ops), received)


class _Transfer:
    def __init__(self, works, received):
        self.works, self.received = works, received

    def wait(self) -> List[torch.Tensor]:
        for work in self.works:  # the sends too: their tensors may be reused afterwards
            work.wait()
        return self.received


def _block_plan(rank: int, source: int, causal: bool,
                layout: str) -> Optional[Tuple[Optional[int], Optional[int], int]]:
    """How this rank's queries attend to the key/value block held by ``source``: None (no query
    sees any of its keys), else (query half, key half, causal_mode), a half being None (all rows),
    0 (the first) or 1 (the second chunk of a zigzag shard)."""
    if not causal:
        return None, None, 0
    if source == rank:  # the diagonal: the shards' positions increase with the same order
        return None, None, 1
    if layout == "contiguous":
        return (None, None, 0) if source < rank else None
    # zigzag: rank r holds chunks (r, 2W-1-r). A lower source's first chunk precedes both query
    # chunks and its second follows both; a higher source's chunks both lie between them.
    return (None, 0, 0) if source < rank else (1, None, 0)


def _half(t: torch.Tensor, half: Optional[int]) -> torch.Tensor:
    """The whole sequence dim of ``t`` ([..., L, E] or lse [..., L]) or one zigzag chunk of it."""
    return t if half is None else t.chunk(2, dim=2)[half]


def _merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
            block_lse: torch.Tensor) -> None:
    """Folds one block's normalized output and lse into the running (out, lse), in place."""
    merged = torch.logaddexp(lse, block_lse)
    reached = merged > float("-inf")  # rows no key has reached yet stay (0, -inf)
    keep = torch.where(reached, torch.exp(lse - merged), 0.0)
    take = torch.where(reached, torch.exp(block_lse - merged), 0.0)
    out.mul_(keep.unsqueeze(-1)).add_(block_out.to(out.dtype) * take.unsqueeze(-1))
    lse.copy_(merged)


def _accumulation_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32  # the ops' lse dtype


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, causal, scale, layout):
        ring = _Ring(group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        acc = _accumulation_dtype(query)
        out = query.new_zeros((*query.shape[:-1], value.shape[-1]), dtype=acc)
        lse = query.new_full(query.shape[:-1], float("-inf"), dtype=acc)
        key_block, value_block = key.contiguous(), value.contiguous()
        for step in range(world):
            incoming = ring.shift([key_block, value_block], _KV_TAG) if step + 1 < world else None
            plan = _block_plan(rank, (rank - step) % world, causal, layout)
            if plan is not None:
                query_half, key_half, causal_mode = plan
                block_out, block_lse, _ = _ops._attention_forward(
                    _half(query, query_half), _half(key_block, key_half),
                    _half(value_block, key_half), None, 0.0, causal_mode, scale)
                _merge_(_half(out, query_half), _half(lse, query_half), block_out, block_lse)
            if incoming is not None:
                key_block, value_block = incoming.wait()
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.layout = group, causal, scale, layout
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group, causal, scale, layout = ctx.group, ctx.causal, ctx.scale, ctx.layout
        ring = _Ring(group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        acc = _accumulation_dtype(query)
        grad_out = grad_out.contiguous()
        deterministic = torch.are_deterministic_algorithms_enabled()
        no_dropout_state = torch.zeros(2, dtype=torch.int64, device=query.device)
        grad_query = torch.zeros_like(query, dtype=acc)
        key_block, value_block = key.contiguous(), value.contiguous()
        grads_in_flight = None
        for step in range(world):
            incoming = ring.shift([key_block, value_block], _KV_TAG) if step + 1 < world else None
            plan = _block_plan(rank, (rank - step) % world, causal, layout)
            block_grads = None
            if plan is not None:
                query_half, key_half, causal_mode = plan
                dq, dk, dv, _ = _ops._attention_backward(
                    _half(grad_out, query_half), _half(query, query_half),
                    _half(key_block, key_half), _half(value_block, key_half), None,
                    _half(out, query_half), _half(lse, query_half), no_dropout_state, 0.0,
                    causal_mode, scale, False, deterministic)
                _half(grad_query, query_half).add_(dq)
                block_grads = key_half, dk, dv
            # The gradient accumulator of the block just computed comes from the previous rank
            # (which computed with it a step earlier) and moves on to the next one.
            if grads_in_flight is None:  # contiguous, as sent (key may be a strided view)
                grad_key = key.new_zeros(key.shape, dtype=acc)
                grad_value = value.new_zeros(value.shape, dtype=acc)
            else:
                grad_key, grad_value = grads_in_flight.wait()
            if block_grads is not None:
                key_half, dk, dv = block_grads
                _half(grad_key, key_half).add_(dk)
                _half(grad_value, key_half).add_(dv)
            if world > 1:  # after the last step, the block's next rank is its owner
                grads_in_flight = ring.shift([grad_key, grad_value], _GRAD_KV_TAG)
            if incoming is not None:
                key_block, value_block = incoming.wait()
        if grads_in_flight is not None:
            grad_key, grad_value = grads_in_flight.wait()
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                None, None, None, None)


def _check_inputs(query, key, value, causal, enable_gqa, layout, dropout_p, attn_mask):
    name = "ring_attention"
    if attn_mask is not None:
        raise ValueError(f"{name}: attn_mask is not supported (only is_causal)")
    if dropout_p != 0.0:
        raise ValueError(f"{name}: dropout_p must be 0 (each block would draw its own dropout "
                         f"mask), got {dropout_p}")
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: layout must be one of {LAYOUTS}, got {layout!r}")
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected {arg} of shape [B, H, L, E] (this rank's shard), "
                             f"got {tuple(t.shape)}")
    if key.shape[2] != value.shape[2]:
        raise ValueError(f"{name}: key and value shards differ in length: {key.shape[2]} and "
                         f"{value.shape[2]}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"{name}: key/value heads {key.shape[1]} differ from query heads "
                         f"{query.shape[1]}; pass enable_gqa=True for grouped-query attention")
    if causal and query.shape[2] != key.shape[2]:
        raise ValueError(f"{name}: is_causal needs query and key shards of one length (the same "
                         f"sequence split), got {query.shape[2]} and {key.shape[2]}")
    if layout == "zigzag" and causal and query.shape[2] % 2:
        raise ValueError(f"{name}: a zigzag shard holds two chunks: its length must be even, "
                         f"got {query.shape[2]}")


@torch.compiler.disable
def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   is_causal: bool = False, *, scale: Optional[float] = None,
                   enable_gqa: bool = False, group=None,
                   layout: str = "contiguous") -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of ``group``: SDPA's semantics on the
    full sequence, each rank passing and returning its own shard.

    Args:
        query, key, value: this rank's shards ``[B, H, L_local, E]`` (key/value ``[B, Hkv, S_local,
            E / Ev]``), cut from the full sequence as :func:`shard_sequence` does with ``layout``;
            every rank's shards have the same shape.
        attn_mask, dropout_p: for SDPA's signature; only ``None`` and ``0`` are supported.
        is_causal: causal attention over the full sequence (query and key shards of one length).
        scale: softmax scale, default ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention (query heads a multiple of key/value heads).
        group: a ProcessGroup or a 1-D DeviceMesh (default: the default group).
        layout: ``"contiguous"`` or ``"zigzag"`` (balances causal work; see the module notes).

    Returns:
        this rank's shard of the output, ``[B, H, L_local, Ev]``, differentiable in query, key
        and value.
    """
    _check_inputs(query, key, value, is_causal, enable_gqa, layout, dropout_p, attn_mask)
    group = _process_group(group)
    softmax_scale = scale if scale is not None else query.shape[-1] ** -0.5
    return _RingAttention.apply(query, key, value, group, bool(is_causal), float(softmax_scale),
                                layout)
