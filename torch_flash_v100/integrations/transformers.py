"""HuggingFace ``transformers`` attention backend on the flashv100 kernels.

::

    from torch_flash_v100.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())

``register()`` adds one function to transformers' ``AttentionInterface`` and the matching one to
its ``AttentionMaskInterface``; every attention layer of a model loaded (or switched with
``model.set_attn_implementation``) under that name then runs the flashv100 kernels:

- causal or not as the layer says (``module.is_causal``, or the ``is_causal`` the model passes):
  decoders, encoders, cross-attention;
- padding (a 2D attention mask) runs as one ``flash_attn_varlen_func`` call over the unpadded
  tokens, never as a dense mask;
- packed batches without padding (``DataCollatorWithFlattening``: ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` kwargs, or ``position_ids`` restarting at each sequence) run as one varlen
  call over the packed tokens;
- ``sliding_window`` becomes ``window_size``, ``softcap`` the fused softcap, ``scaling`` the
  softmax scale, ``dropout`` the fused dropout; GQA / MQA by head counts;
- on CUDA, fp16 and bf16 (FlashAttention-2's rule; fp32 raises ``TypeError``);
- any other mask (custom 4D masks, image-token overlays, ...) falls back to
  ``torch_flash_v100.attention`` with that mask as a dense boolean / additive mask, so it is
  still exact.

The attention weights are not computed (fused kernels never materialise them): the function
returns ``(attn_output, None)`` as transformers' own flash and SDPA backends do, so
``output_attentions=True`` gives ``None`` weights.

Decoding with ``DynamicCache`` / ``StaticCache``: single-token steps of a left-padded batch (what
``generate()`` makes) run ``flash_attn_with_kvcache`` on the keys where the cache holds them
(``cache_leftpad`` skips each row's padding; split-KV decode kernels on CUDA, GQA heads packed
into the rows of one tile); other steps run the varlen path over the unpadded tokens.

Versions: transformers has ``AttentionInterface`` since 4.48 and ``AttentionMaskInterface``
since 4.53; this backend needs the mask functions of transformers 5, which take ``q_length`` /
``q_offset`` (``register`` raises ``ImportError`` otherwise), and is tested with 5.24. It reads
the structure of transformers' mask functions (``masking_utils``) to tell padding-only masks
from general ones; a structure it does not know takes the exact dense fallback.

Padding and packing cost a few host syncs per forward step (the varlen lengths and indices,
derived once from the mask every layer shares), so these paths do not run under
``torch.compile(fullgraph=True)``. A one-token step of a left-padded batch runs
``flash_attn_with_kvcache`` on cache indices made the same way, trusted (no per-layer copies).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch

from .. import attention as _dense_attention
from ..bert_padding import _cu_seqlens, pad_input
from ..flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["register", "attention_forward", "attention_mask", "DEFAULT_NAME"]

# transformers treats every implementation name containing "flash" as a flash-attention request:
# it then loads a flash-attention package or a Hub kernel for it
# (`is_flash_attention_requested` -> `lazy_import_flash_attention`), which fails for our function
# ("Could not find the currently requested flash attention implementation"), and generate() and
# the mask code take flash-specific paths. Names containing "sdpa"
# or "flex_attention" get those backends' dispatch checks, and "org/name" is read as a Hub kernel.
DEFAULT_NAME = "fused_v100"
_RESERVED = ("flash", "sdpa", "flex_attention")


def register(name: str = DEFAULT_NAME) -> str:
    """Register the flashv100 attention and mask functions with transformers under ``name``.

    Afterwards ``attn_implementation=name`` (``from_pretrained``, ``from_config``) or
    ``model.set_attn_implementation(name)`` routes every attention layer through the flashv100
    kernels. Returns ``name``. Registering the same name again is harmless.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    lowered = name.lower()
    reserved = [word for word in _RESERVED if word in lowered]
    if reserved or name == "eager" or any(char in name for char in "/:|"):
        word = reserved[0] if reserved else "eager, /, : or |"
        raise ValueError(
            f"name: {name!r} cannot be used: transformers gives names containing {word!r} a "
            "meaning of their own (a flash-attention package or Hub kernel, another backend's "
            f"checks, a kernel repository); pick another, e.g. the default {DEFAULT_NAME!r}")
    parameters = inspect.signature(sdpa_mask).parameters
    if "q_length" not in parameters or "q_offset" not in parameters:
        import transformers

        raise ImportError(
            f"transformers {transformers.__version__} is too old for the flashv100 backend: it "
            "needs the mask functions of transformers 5 (q_length, q_offset); upgrade transformers")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# --- the mask function ----------------------------------------------------------------------------

def _closure(function) -> dict:
    cells = function.__closure__ or ()
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in cells)))


def _mask_pattern(mask_function):
    """What a transformers mask function computes, when it is one we run without a dense mask:
    ("causal" | "bidirectional" | "sliding" | "packed", payload), or None for anything else.

    The mask functions are closures built by transformers.masking_utils; an unknown structure
    (custom overlays, a future version's changes) gives None and so the exact dense fallback."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return "causal", None
    if mask_function is mu.bidirectional_mask_function:
        return "bidirectional", None
    if mask_function.__qualname__ != mu.and_masks(mu.causal_mask_function).__qualname__:
        return None
    parts = tuple(_closure(mask_function).get("mask_functions", ()))
    if len(parts) != 2:
        return None
    first, second = (part.__qualname__ for part in parts)
    if first.startswith("sliding_window_overlay.") and parts[1] is mu.causal_mask_function:
        return "sliding", _closure(parts[0]).get("sliding_window")
    if second.startswith("packed_sequence_mask_function."):
        # Each packed sequence is causal, with the layer's window if it has one: the layer's
        # mask function itself (transformers <= 5.17: windows count positions in the packed row,
        # the same differences) or over positions remapped per sequence (later releases).
        layer_mask = parts[0]
        if first.startswith("remap_positions_for_packed_sequence."):
            layer_mask = _closure(parts[0]).get("mask_function")
        layer_pattern = _mask_pattern(layer_mask) if callable(layer_mask) else None
        if layer_pattern is not None and layer_pattern[0] in ("causal", "sliding"):
            return "packed", _closure(parts[1]).get("packed_sequence_mask")
    return None


def _rows_with_holes(padding: torch.Tensor) -> torch.Tensor:
    """Which rows of a [B, S] bool mask are not one contiguous run of True (bool [B])."""
    starts = padding[:, 1:] & ~padding[:, :-1]
    return (starts.sum(dim=1) + padding[:, :1].long().squeeze(1)) > 1


def _has_holes(padding: torch.Tensor) -> bool:
    return bool(_rows_with_holes(padding).any())


class _StepMemo:
    """What the layers of one forward step derive from the mask they share, derived once.

    Every layer of a step gets the same mask object, so the host syncs that deriving lengths and
    indices needs happen once per step, not once per layer. Keyed by the mask's identity and
    what is derived, and dropped when the mask is written in place (a caller's position_ids
    buffer reused across steps) or freed (a weak reference: its id may be reused then). Off while
    torch.compile traces."""

    _by_mask: dict = {}

    @classmethod
    def get(cls, mask: torch.Tensor, what, derive):
        if torch.compiler.is_compiling():
            return derive()
        key = id(mask)
        entry = cls._by_mask.get(key)
        if entry is None or entry[0]() is not mask or entry[1] != mask._version:
            entry = (weakref.ref(mask, lambda _: cls._by_mask.pop(key, None)), mask._version, {})
            cls._by_mask[key] = entry
        derived = entry[2]
        if what not in derived:
            derived[what] = derive()
        return derived[what]


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """The ``AttentionMaskInterface`` function: what ``attention_forward`` reads as its mask.

    - ``None``: no padding (causal or not, with a sliding window or not, comes from the layer);
    - a bool ``[B, n]`` padding mask (``True`` = a real token) over the first ``n`` keys of the
      layer's key/value tensors (``n < kv_length`` for a static cache: the rest is unused);
    - an integer ``[B, S]`` tensor of sequence ids: a packed batch (``position_ids`` restarting
      per sequence), each run of equal ids one causal sequence;
    - a 4D mask (``sdpa_mask``'s, ``True`` = attend) for every other pattern.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    pattern = _mask_pattern(mask_function)
    if pattern is not None and pattern[0] == "packed" and attention_mask is None:
        return pattern[1]
    if pattern is not None and pattern[0] != "packed":
        kind = pattern[0]
        q_offset = int(q_offset)
        # Causal layers see the keys up to the last query; the kernels align the last query on
        # the last key they are given, so keys past it (a static cache's free slots) are cut.
        keys_end = q_offset + q_length if kind != "bidirectional" else kv_offset + kv_length
        keys_end = min(keys_end, kv_offset + kv_length)
        if attention_mask is None:
            if keys_end == kv_offset + kv_length:
                return None
            return torch.ones(batch_size, keys_end - kv_offset, dtype=torch.bool,
                              device=kwargs.get("device", "cpu"))
        padding = attention_mask.to(torch.bool)
        if padding.shape[-1] < keys_end:
            padding = torch.nn.functional.pad(padding, (0, keys_end - padding.shape[-1]))
        padding = padding[:, kv_offset:keys_end]
        # A window counts positions; the varlen kernels count the unpadded tokens: the same
        # only when each row's tokens are one contiguous run (left or right padding).
        if not (kind == "sliding" and _has_holes(padding)):
            if keys_end == kv_offset + kv_length and bool(padding.all()):
                return None
            return padding
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, **kwargs)


# --- the attention function -----------------------------------------------------------------------

def _varlen(query, key, value, cu_q, cu_k, max_q, max_k, flash_kwargs):
    """varlen over [B, S, H, D] tensors whose rows are the packed tokens in order."""
    out = flash_attn_varlen_func(query.flatten(0, 1), key.flatten(0, 1), value.flatten(0, 1),
                                 cu_q, cu_k, max_q, max_k, **flash_kwargs)
    return out.view(query.shape[0], query.shape[1], *out.shape[1:])


def _packed_cu_seqlens(sequence_ids: torch.Tensor):
    """cu_seqlens and the longest length of the runs of equal ids in each row of [B, S] ids."""
    starts = torch.ones_like(sequence_ids, dtype=torch.bool)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    boundaries = torch.nonzero(starts.flatten()).squeeze(1)
    cu = torch.cat([boundaries, boundaries.new_tensor([sequence_ids.numel()])]).to(torch.int32)
    return cu, int(cu.diff().max())


def _decode_indices(padding: torch.Tensor):
    """flash_attn_with_kvcache's cache_seqlens and cache_leftpad for a [B, n] padding mask of
    left padding only (each row's real keys one run ending at key n - 1), else None."""
    left_padded = padding[:, -1].all() & ~_rows_with_holes(padding).any()
    if not bool(left_padded):
        return None
    n = padding.shape[1]
    seqlens = torch.full((padding.shape[0],), n, dtype=torch.int32, device=padding.device)
    return seqlens, (n - padding.sum(dim=1)).to(torch.int32)


def _decode_step(query, key, value, padding, flash_kwargs):
    """One new token per sequence against the cache (generate() after the prefill), or None.

    With left padding only (row b's real keys are the last of the first n, the new token's among
    them) the keys stay where the cache holds them: flash_attn_with_kvcache attends rows
    [leftpad_b, n) of each row in place, on the split-KV decode kernels, with no unpadding copy.
    The indices are valid by construction (0 <= leftpad_b <= n <= the keys held), so the op
    trusts them instead of copying them to the host in every layer.
    """
    if (query.shape[1] != 1 or flash_kwargs["dropout_p"] > 0
            or padding.shape[1] > key.shape[1]):
        return None
    indices = _StepMemo.get(padding, "decode", lambda: _decode_indices(padding))
    if indices is None:
        return None
    seqlens, leftpad = indices
    kwargs = {k: v for k, v in flash_kwargs.items() if k != "dropout_p"}
    return flash_attn_with_kvcache(query, key, value, cache_seqlens=seqlens,
                                   cache_leftpad=leftpad, causal=True, check_index_values=False,
                                   **kwargs)


def _unpadding(padding: torch.Tensor, causal: bool, len_q: int):
    """(keep_q, cu_q, max_q, keep_k, cu_k, max_k): the real tokens of a padded batch (padding
    [B, n], True = real key) as flat indices, cu_seqlens and longest lengths; keep_q None when
    every query runs."""
    lengths_k = padding.sum(dim=1)
    keep_k = torch.nonzero(padding.flatten()).squeeze(1)
    if causal:
        # The queries are the last len_q keys (self-attention, a cache before them): unpadded
        # with the same mask, each real query keeps its causal rank among the real keys.
        padding_q = padding[:, -len_q:]
        lengths_q = padding_q.sum(dim=1)
        keep_q = torch.nonzero(padding_q.flatten()).squeeze(1)
        max_q = int(lengths_q.max())
    else:
        # Not causal (encoders, cross-attention): the mask hides keys only; every query runs.
        lengths_q = torch.full((padding.shape[0],), len_q, dtype=lengths_k.dtype,
                               device=padding.device)
        keep_q, max_q = None, len_q
    return (keep_q, _cu_seqlens(lengths_q), max_q, keep_k, _cu_seqlens(lengths_k),
            int(lengths_k.max()))


def _padded_varlen(query, key, value, padding, causal, flash_kwargs):
    """Attention over the real tokens of a padded batch (padding [B, n], True = real key)."""
    batch, len_q = query.shape[:2]
    key, value = key[:, :padding.shape[1]], value[:, :padding.shape[1]]
    keep_q, cu_q, max_q, keep_k, cu_k, max_k = _StepMemo.get(
        padding, ("unpadding", causal, len_q), lambda: _unpadding(padding, causal, len_q))
    packed_q = query.flatten(0, 1)
    if keep_q is not None:
        packed_q = packed_q.index_select(0, keep_q)
    out = flash_attn_varlen_func(
        packed_q, key.flatten(0, 1).index_select(0, keep_k),
        value.flatten(0, 1).index_select(0, keep_k), cu_q, cu_k, max_q, max_k, causal=causal,
        **flash_kwargs)
    if keep_q is not None:
        return pad_input(out, keep_q, batch, len_q, check_index_values=False)
    return out.view(batch, len_q, *out.shape[1:])


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                      cu_seq_lens_q: Optional[torch.Tensor] = None,
                      cu_seq_lens_k: Optional[torch.Tensor] = None,
                      max_length_q: Optional[int] = None, max_length_k: Optional[int] = None,
                      position_ids: Optional[torch.Tensor] = None, **kwargs):
    """The ``AttentionInterface`` function: query [B, Hq, Sq, D], key/value [B, Hkv, Sk, D] (as
    transformers passes them) -> ``(attn_output [B, Sq, Hq, D], None)``.

    ``attention_mask`` is what :func:`attention_mask` produced (or a 4D mask a user passed).
    The attention weights are not computed: the second result is always ``None``.
    """
    if s_aux is not None:
        raise NotImplementedError(
            "s_aux: attention sinks are not supported by the flashv100 backend yet; load the "
            "model with attn_implementation='eager' or 'sdpa'")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    dropout = float(dropout)
    if attention_mask is not None and attention_mask.dim() == 4:
        if softcap:
            raise NotImplementedError(
                "softcap: a general (non-padding) attention mask with logit softcapping is not "
                "supported by the flashv100 backend; use attn_implementation='eager'")
        out = _dense_attention(query, key, value, attention_mask[..., :key.shape[-2]], dropout,
                               scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None

    if query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
        # FlashAttention-2's rule: its kernels (and ours) take fp16 and bf16 only.
        raise TypeError(
            f"the flashv100 backend runs fp16 / bf16 on CUDA, got {query.dtype} queries: load the "
            "model with dtype=torch.float16 (or bfloat16 on sm_80+), or use "
            "attn_implementation='sdpa' for fp32")
    query, key, value = (tensor.transpose(1, 2) for tensor in (query, key, value))
    window = (-1, -1)
    if sliding_window is not None:
        # transformers' windows hold `sliding_window` keys including the query's own (causal),
        # or those at distance <= sliding_window (bidirectional)
        window = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)
    flash_kwargs = dict(dropout_p=dropout, softmax_scale=scaling, window_size=window,
                        softcap=float(softcap or 0.0))

    if all(arg is not None for arg in (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)):
        packed = (cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), int(max_length_q),
                  int(max_length_k))
    elif attention_mask is not None and attention_mask.dtype != torch.bool:
        cu, longest = _StepMemo.get(attention_mask, "packed",
                                    lambda: _packed_cu_seqlens(attention_mask))
        packed = (cu, cu, longest, longest)
    elif attention_mask is not None:
        out = _decode_step(query, key, value, attention_mask, flash_kwargs) if causal else None
        if out is None:
            out = _padded_varlen(query, key, value, attention_mask, causal, flash_kwargs)
        return out, None
    elif (found := _packed_from_position_ids(position_ids, query, key)) is not None:
        cu, longest = found
        packed = (cu, cu, longest, longest)
    else:
        return flash_attn_func(query, key, value, causal=causal, **flash_kwargs), None
    return _varlen(query, key, value, *packed, dict(flash_kwargs, causal=causal)), None


def _packed_from_position_ids(position_ids, query, key):
    """(cu_seqlens, longest) when a batch of one row holds several sequences (position_ids not
    increasing by one), else None. The mask function sees packing only without a cache; a
    forward with use_cache=True (the default outside training) finds it here, at the price of
    one device sync per step, for single-row batches only (as transformers' flash backends)."""
    if (position_ids is None or query.shape[0] != 1 or query.shape[1] == 1
            or query.shape[1] != key.shape[1] or position_ids.shape[-1] != query.shape[1]):
        return None
    return _StepMemo.get(position_ids, "packed", lambda: _packing_of(position_ids))


def _packing_of(position_ids: torch.Tensor):
    positions = position_ids.reshape(1, -1)
    starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    return _packed_cu_seqlens(starts.cumsum(-1))
