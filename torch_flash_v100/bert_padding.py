"""FlashAttention-2's padding helpers (``flash_attn.bert_padding``, v2.8): between padded batches
``[B, S, ...]`` with a ``[B, S]`` mask of real tokens and the packed tokens ``[total, ...]`` with
``cu_seqlens`` that the varlen functions take.

Code written for ``flash_attn`` runs by changing one import line::

    from torch_flash_v100.bert_padding import pad_input, unpad_input

    x, indices, cu_seqlens, max_seqlen, _ = unpad_input(hidden_states, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out, indices, batch, seqlen)  # padded positions: zeros

Same names, arguments and return values. Differences: index_first_axis, index_put_first_axis and
pad_input check that the indices lie in range (one device-to-host copy; keyword
``check_index_values=False`` skips it, e.g. under CUDA-graph capture), where flash_attn's would
stop a CUDA kernel with a device-side assert; every function is plain differentiable
torch (``index_select`` / ``index_copy``), so double backward and ``torch.compile`` work (the
masks' data-dependent sizes break the graph where the lengths are read); masks must hold 0 / 1
(bool, integer or floating), and an ``unused_mask`` that overlaps ``attention_mask`` raises,
where flash_attn would count such a token twice in ``cu_seqlens`` but once in ``indices``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input",
           "unpad_input_for_concatenated_sequences", "pad_input"]


def _check_indices(fn: str, indices: torch.Tensor, rows: int, check_values: bool) -> None:
    """indices: 1-D int32/int64, and (check_values: one host read) each in [0, rows): an index
    outside would stop a CUDA kernel with a device-side assert instead of raising here."""
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: indices must be a 1-D int32/int64 tensor, got "
                         f"{indices.dtype} of shape {tuple(indices.shape)}")
    if check_values and indices.numel():
        low, high = torch.stack([indices.min(), indices.max()]).tolist()
        if low < 0 or high >= rows:
            raise ValueError(f"{fn}: indices must lie in [0, {rows}), got values in "
                             f"[{low}, {high}]")


def index_first_axis(input: torch.Tensor, indices: torch.Tensor, *,
                     check_index_values: bool = True) -> torch.Tensor:
    """``input[indices]`` along the first axis: rows ``indices`` of ``[N, ...]``.

    ``check_index_values=False`` skips the range check (a device-to-host copy of two values), as
    under CUDA-graph capture or where the indices come from unpad_input."""
    _check_indices("index_first_axis", indices, input.shape[0], check_index_values)
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int, *,
                         check_index_values: bool = True) -> torch.Tensor:
    """A zero ``[first_axis_dim, ...]`` tensor whose rows ``indices`` are ``values``' rows
    (``check_index_values``: as index_first_axis)."""
    _check_indices("index_put_first_axis", indices, first_axis_dim, check_index_values)
    if values.dim() < 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(f"index_put_first_axis: values must have one row per index "
                         f"({indices.shape[0]}), got shape {tuple(values.shape)}")
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_copy(0, indices, values)


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """int32 ``[n + 1]`` offsets of sequences of ``lengths``, 0 first."""
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _check_mask(fn: str, name: str, mask: torch.Tensor, hidden_states: torch.Tensor) -> None:
    if mask.dim() != 2 or hidden_states.dim() < 2 or hidden_states.shape[:2] != mask.shape:
        raise ValueError(f"{fn}: {name} must be [batch, seqlen] matching hidden_states' first two "
                         f"dims, got {tuple(mask.shape)} and {tuple(hidden_states.shape)}")
    if mask.is_complex():
        raise TypeError(f"{fn}: {name} must be a real 0/1 mask, got {mask.dtype}")


def _not_binary(mask: torch.Tensor) -> torch.Tensor:
    return ((mask != 0) & (mask != 1)).any()


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None):
    """The real tokens of a padded batch, packed.

    Args:
        hidden_states: ``[batch, seqlen, ...]``.
        attention_mask: ``[batch, seqlen]``, 1 (True) = a real token, 0 = padding.
        unused_mask: ``[batch, seqlen]``, 1 = a token kept in the packing but not used (counted
            in ``cu_seqlens``, not in ``seqused``); it must not overlap ``attention_mask``.

    Returns:
        ``(hidden_states[total, ...], indices[total] int64 into the flattened batch, cu_seqlens
        [batch + 1] int32, max_seqlen_in_batch int, seqused [batch] int32)``: the kept tokens
        (real or unused) in batch-major order, and the real ones per sequence.
    """
    fn = "unpad_input"
    _check_mask(fn, "attention_mask", attention_mask, hidden_states)
    real = attention_mask != 0
    kept = real
    # (message, bad) pairs, read back together with the longest length in one host read
    checks = [("attention_mask must hold 0 or 1 only", _not_binary(attention_mask))]
    if unused_mask is not None:
        _check_mask(fn, "unused_mask", unused_mask, hidden_states)
        unused = unused_mask != 0
        checks += [("unused_mask must hold 0 or 1 only", _not_binary(unused_mask)),
                   ("attention_mask and unused_mask both mark a token (a token is real or "
                    "unused, not both)", (real & unused).any())]
        kept = real | unused
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    longest, *failed = torch.stack(
        [seqlens.max() if seqlens.numel() else seqlens.new_zeros(())] +
        [bad.to(torch.int32) for _, bad in checks]).tolist()
    for (message, _), bad in zip(checks, failed):
        if bad:
            raise ValueError(f"{fn}: {message}")
    indices = torch.nonzero(kept.flatten()).flatten()
    packed = index_first_axis(hidden_states.flatten(0, 1), indices, check_index_values=False)
    return packed, indices, _cu_seqlens(seqlens), longest, real.sum(dim=-1, dtype=torch.int32)


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor,
                                           attention_mask_in_length: torch.Tensor):
    """Rows that each hold several sequences back to back, packed as one sequence each.

    Args:
        hidden_states: ``[batch, seqlen, ...]``.
        attention_mask_in_length: ``[batch, seqlen]`` integers: row b's nonzero entries, in
            order, are the lengths of the sequences that fill row b from its start; the rest of
            the row is padding. E.g. ``[[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]]``: row 0 holds
            sequences of 2 and 3 tokens and one padding token, row 1 one sequence of 6.

    Returns:
        ``(hidden_states[total, ...], indices[total], cu_seqlens[n + 1] int32,
        max_seqlen_in_batch)`` over the n sequences of all rows, row by row.
    """
    fn = "unpad_input_for_concatenated_sequences"
    lengths = attention_mask_in_length
    _check_mask(fn, "attention_mask_in_length", lengths, hidden_states)
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"{fn}: attention_mask_in_length must hold integer lengths, got "
                        f"{lengths.dtype}")
    seqlen = lengths.shape[1]
    row_tokens = lengths.sum(dim=-1)
    sequence_lengths = lengths.flatten()[lengths.flatten() != 0].to(torch.int32)
    longest, negative, overfull = torch.stack([
        sequence_lengths.max() if sequence_lengths.numel() else sequence_lengths.new_zeros(()),
        (lengths < 0).any().to(torch.int32), (row_tokens > seqlen).any().to(torch.int32)]).tolist()
    if negative or overfull:
        raise ValueError(f"{fn}: attention_mask_in_length must hold lengths >= 0 whose sum per "
                         f"row is at most seqlen ({seqlen})")
    positions = torch.arange(seqlen, device=lengths.device)
    kept = positions < row_tokens.unsqueeze(1)
    indices = torch.nonzero(kept.flatten()).flatten()
    packed = index_first_axis(hidden_states.flatten(0, 1), indices, check_index_values=False)
    return packed, indices, _cu_seqlens(sequence_lengths), longest


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int, *,
              check_index_values: bool = True) -> torch.Tensor:
    """The inverse of unpad_input: packed ``[total, ...]`` rows at ``indices`` of a zero
    ``[batch, seqlen, ...]`` tensor (padded positions are zeros; ``check_index_values``: as
    index_first_axis)."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen,
                               check_index_values=check_index_values)
    return out.unflatten(0, (batch, seqlen))
