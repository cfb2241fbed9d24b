"""Pure-PyTorch reference of the flashv100 semantics (those of scaled_dot_product_attention).

Materialises the score matrix; computes in the dtype it is given (pass float64 tensors for ground
truth). Used by the tests and the benchmarks, never by the library itself.
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
