"""FlashAttention-2's rotary embedding (``flash_attn.layers.rotary``, v2.8): the same names,
arguments and results, so that code written for it runs by changing one import line::

    from torch_flash_v100.layers.rotary import RotaryEmbedding, apply_rotary_emb

Rotary embedding rotates the first ``rotary_dim = 2 * cos.shape[1]`` dims of each head by the
angles of the token's position (``cos`` / ``sin`` ``[seqlen_rotary, rotary_dim / 2]``, row p for
position p): pairs ``(x[i], x[i + rotary_dim / 2])`` (GPT-NeoX), or ``(x[2i], x[2i + 1])`` with
``interleaved=True`` (GPT-J); the other dims are kept. Token t of a sequence is at position
``t + seqlen_offsets`` (an int, or one per sequence: decoding after a KV cache). This is the
rotation ``flash_attn_with_kvcache`` applies itself when given ``rotary_cos`` / ``rotary_sin``.

Differences from flash_attn: plain differentiable torch (it computes in fp32, fp64 for fp64
inputs, like flash_attn's kernel; ``torch.compile`` fuses it into one kernel, eager runs a few
elementwise ones), so double backward works and cos / sin get gradients where they require them;
cos / sin may have any floating dtype; a position past the cos / sin table raises (flash_attn
leaves such dims unrotated), checked with one device-to-host copy where the offsets or
``cu_seqlens`` are tensors (keyword ``check_index_values=False`` skips it, e.g. under CUDA-graph
capture; positions must then be in range).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_qkv_",
           "apply_rotary_emb_kv_", "RotaryEmbedding"]

Offsets = Union[int, torch.Tensor]


def _positions(fn: str, x: torch.Tensor, cos: torch.Tensor, seqlen_offsets: Offsets,
               cu_seqlens: Optional[torch.Tensor], check: bool) -> torch.Tensor:
    """Each token's row of cos / sin: [B, S] or [S] (x [B, S, H, D]), [T] (packed x [T, H, D])."""
    table_rows = cos.shape[0]
    offsets_are_tensor = isinstance(seqlen_offsets, torch.Tensor)
    if offsets_are_tensor and (seqlen_offsets.dim() != 1 or seqlen_offsets.is_floating_point()):
        raise ValueError(f"{fn}: seqlen_offsets must be an int or an integer [batch] tensor, got "
                         f"{seqlen_offsets.dtype} of shape {tuple(seqlen_offsets.shape)}")
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"{fn}: x must be [batch, seqlen, nheads, headdim] (or packed "
                             f"[total, nheads, headdim] with cu_seqlens), got {tuple(x.shape)}")
        steps = torch.arange(x.shape[1], device=x.device)
        if not offsets_are_tensor:
            if seqlen_offsets < 0 or x.shape[1] + seqlen_offsets > table_rows:
                raise ValueError(f"{fn}: positions {seqlen_offsets}..{seqlen_offsets + x.shape[1]}"
                                 f" must lie in the cos/sin table's {table_rows} rows")
            return steps + seqlen_offsets
        if seqlen_offsets.shape[0] != x.shape[0]:
            raise ValueError(f"{fn}: seqlen_offsets must have one entry per sequence "
                             f"({x.shape[0]}), got {seqlen_offsets.shape[0]}")
        positions = steps + seqlen_offsets.to(device=x.device, dtype=torch.int64)[:, None]
    else:
        if x.dim() != 3:
            raise ValueError(f"{fn}: with cu_seqlens, x must be packed [total, nheads, headdim], "
                             f"got {tuple(x.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 1:
            raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32 tensor [batch + 1], got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        batch = cu_seqlens.numel() - 1
        if offsets_are_tensor and seqlen_offsets.shape[0] != batch:
            raise ValueError(f"{fn}: seqlen_offsets must have one entry per sequence ({batch}), "
                             f"got {seqlen_offsets.shape[0]}")
        starts = cu_seqlens.to(device=x.device, dtype=torch.int64)
        tokens = torch.arange(x.shape[0], device=x.device)
        # Token t belongs to the last sequence that starts at or before it.
        sequence = torch.searchsorted(starts[1:], tokens, right=True)
        sequence = sequence.clamp_(max=max(batch - 1, 0))
        positions = tokens - starts[sequence]
        if offsets_are_tensor:
            positions = positions + seqlen_offsets.to(device=x.device, dtype=torch.int64)[sequence]
        else:
            positions = positions + seqlen_offsets
    if not check:
        return positions
    # One host read: cu_seqlens' ends and order (packed x), then the positions' range.
    values = []
    if cu_seqlens is not None:
        values = [starts[0], starts[-1], (starts.diff() < 0).any().to(torch.int64)]
    if positions.numel():
        values += [positions.min(), positions.max()]
    values = torch.stack(values).tolist() if values else []
    if cu_seqlens is not None:
        first, last, falls = values[:3]
        values = values[3:]
        if first != 0 or last != x.shape[0] or falls:
            raise ValueError(f"{fn}: cu_seqlens must rise from 0 to x's {x.shape[0]} tokens")
    if values:
        low, high = values
        if low < 0 or high >= table_rows:
            raise ValueError(f"{fn}: token positions {low}..{high} (seqlen_offsets included) must "
                             f"lie in the cos/sin table's {table_rows} rows")
    return positions


def _rotated(fn: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
             seqlen_offsets: Offsets, cu_seqlens: Optional[torch.Tensor],
             check: bool) -> torch.Tensor:
    """x's first rotary_dim dims rotated (in x's dtype; the other dims not included)."""
    if cos.dim() != 2 or sin.shape != cos.shape or not (cos.is_floating_point()
                                                        and sin.is_floating_point()):
        raise ValueError(f"{fn}: cos and sin must be floating [seqlen_rotary, rotary_dim / 2], got "
                         f"{tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"{fn}: rotary_dim (2 * cos.shape[1] = {rotary_dim}) must be at most the "
                         f"head dim {x.shape[-1]}")
    positions = _positions(fn, x, cos, seqlen_offsets, cu_seqlens, check)
    compute = torch.promote_types(x.dtype, torch.float32)
    # [..., tokens, 1 (heads), rotary_dim / 2]
    c = cos.to(device=x.device, dtype=compute)[positions].unsqueeze(-2)
    s = sin.to(device=x.device, dtype=compute)[positions].unsqueeze(-2)
    head = x[..., :rotary_dim].to(compute)
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = head.chunk(2, dim=-1)
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return out.to(x.dtype)


def _rotate_in_place(fn: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool, seqlen_offsets: Offsets,
                     cu_seqlens: Optional[torch.Tensor], check: bool) -> None:
    """x's first rotary_dim dims overwritten by their rotation (x may be a view)."""
    out = _rotated(fn, x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, check)
    x[..., :out.shape[-1]].copy_(out)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: Offsets = 0, cu_seqlens: Optional[torch.Tensor] = None,
                     max_seqlen: Optional[int] = None, *,
                     check_index_values: bool = True) -> torch.Tensor:
    """Rotary embedding of x's first ``rotary_dim = 2 * cos.shape[1]`` dims (module docstring).

    Args:
        x: ``[batch, seqlen, nheads, headdim]``, or packed ``[total, nheads, headdim]`` with
            ``cu_seqlens``.
        cos, sin: ``[seqlen_rotary, rotary_dim / 2]``.
        interleaved: rotate pairs (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim / 2).
        inplace: write the result into x (and return x).
        seqlen_offsets: int, or ``[batch]`` integer tensor: each sequence's first position.
        cu_seqlens: int32 ``[batch + 1]`` sequence starts of a packed x.
        max_seqlen: the longest sequence of a packed x (accepted for compatibility; the
            positions are derived from cu_seqlens).
        check_index_values: check that every position lies in the cos/sin table (one
            device-to-host copy where offsets or cu_seqlens are tensors).
    """
    del max_seqlen  # flash_attn's kernel grid size; nothing here depends on it
    fn = "apply_rotary_emb"
    if inplace:
        _rotate_in_place(fn, x, cos, sin, interleaved, seqlen_offsets, cu_seqlens,
                         check_index_values)
        return x
    out = _rotated(fn, x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, check_index_values)
    return torch.cat([out, x[..., out.shape[-1]:]], dim=-1)


# flash_attn's older name
apply_rotary_emb_func = apply_rotary_emb


def _qk_views(fn: str, qkv: torch.Tensor, num_heads_q: Optional[int]):
    """The q and k parts of a packed qkv, as views."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"{fn}: qkv must be [batch, seqlen, 3, nheads, headdim], got "
                             f"{tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError(f"{fn}: qkv must be [batch, seqlen, 3, nheads, headdim], or [batch, "
                         f"seqlen, num_heads_q + 2 * num_heads_k, headdim] with num_heads_q; got "
                         f"{tuple(qkv.shape)}, num_heads_q={num_heads_q}")
    heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q < 1 or heads_k < 1 or num_heads_q + 2 * heads_k != qkv.shape[2]:
        raise ValueError(f"{fn}: qkv's {qkv.shape[2]} heads are not num_heads_q ({num_heads_q}) "
                         "+ 2 * num_heads_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + heads_k]


def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cos_k: Optional[torch.Tensor] = None,
                          sin_k: Optional[torch.Tensor] = None, interleaved: bool = False,
                          seqlen_offsets: Offsets = 0, num_heads_q: Optional[int] = None, *,
                          check_index_values: bool = True) -> torch.Tensor:
    """Rotary embedding of q and k inside qkv, in place; returns qkv.

    qkv: ``[batch, seqlen, 3, nheads, headdim]``, or ``[batch, seqlen, num_heads_q + 2 *
    num_heads_k, headdim]`` (GQA / MQA) with ``num_heads_q``. k takes ``cos_k`` / ``sin_k`` where
    given (xPos), else cos / sin."""
    fn = "apply_rotary_emb_qkv_"
    q, k = _qk_views(fn, qkv, num_heads_q)
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    for part, c, s in ((q, cos, sin), (k, cos_k, sin_k)):
        _rotate_in_place(fn, part, c, s, interleaved, seqlen_offsets, None, check_index_values)
    return qkv


def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         interleaved: bool = False, seqlen_offsets: Offsets = 0, *,
                         check_index_values: bool = True) -> torch.Tensor:
    """Rotary embedding of k inside kv ``[batch, seqlen, 2, nheads, headdim]``, in place;
    returns kv."""
    fn = "apply_rotary_emb_kv_"
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"{fn}: kv must be [batch, seqlen, 2, nheads, headdim], got "
                         f"{tuple(kv.shape)}")
    _rotate_in_place(fn, kv[:, :, 0], cos, sin, interleaved, seqlen_offsets, None,
                     check_index_values)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding (RoFormer) with flash_attn's module interface: angles
    ``position * base ** (-2i / dim)``, cos / sin tables cached in the inputs' dtype and grown
    on demand. ``scale_base`` adds xPos (Sun et al. 2022): q's cos / sin scaled by
    ``((2i + 0.4 dim) / (1.4 dim)) ** ((position - seqlen // 2) / scale_base)``, k's divided by
    it (seqlen: the cached table's length, as flash_attn)."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False,
                 scale_base: Optional[float] = None, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be a positive even number, got {dim}")
        self.dim, self.base = dim, float(base)
        self.interleaved, self.scale_base = interleaved, scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", self._xpos_scale(device) if scale_base is not None else None,
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = None
        self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / self.base ** exponents

    def _xpos_scale(self, device=None) -> torch.Tensor:
        steps = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
        return (steps + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        cached = self._cos_cached
        if (cached is not None and seqlen <= self._seq_len_cached and cached.device == device
                and cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # Angles in fp32 whatever the module's dtype: positions times frequencies are large.
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32),
                             inv_freq.to(device))
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._xpos_scale(device)
        power = (torch.arange(seqlen, device=device, dtype=torch.float32) - seqlen // 2)
        scale = scale.to(device) ** (power / self.scale_base)[:, None]
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Offsets = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """In place. ``qkv`` as in apply_rotary_emb_qkv_, or q ``[batch, seqlen, nheads,
        headdim]`` when ``kv`` ``[batch, seqlen, 2, nheads, headdim]`` is given (then returns
        ``(q, kv)``). ``seqlen_offset``: int or ``[batch]`` tensor; with a tensor, pass
        ``max_seqlen`` (the table must cover every position)."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("RotaryEmbedding: a tensor seqlen_offset needs max_seqlen (the "
                             "cos/sin table's length)")
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k, sin_k,
                                         interleaved=self.interleaved,
                                         seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached,
                             interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved,
                                       seqlen_offsets=seqlen_offset)
