"""torch-flash-v100: FlashAttention-2-class fused attention for NVIDIA V100 (sm_70) GPUs.

``torch_flash_v100.attention`` calls the op ``torch.ops.flashv100.attention``: the semantics of
``torch.nn.functional.scaled_dot_product_attention``, with CPU and CUDA kernels, fake kernels
and autograd, usable under ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch

from . import _C  # noqa: F401  (loads the extension: registers the flashv100 ops)
from . import _ops  # noqa: F401  (fake kernels and autograd)
from . import _flash_ops  # noqa: F401  (the same for the FlashAttention-2 ops)
from ._flash_attn_alias import alias_flash_attn
from .reference import reference_attention

__version__ = "0.1.0"

def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, *, scale: Optional[float] = None,
              enable_gqa: bool = False) -> torch.Tensor:
    r"""Fused scaled dot-product attention, with the semantics of
    :func:`torch.nn.functional.scaled_dot_product_attention`.

    ``softmax(query @ key.transpose(-2, -1) * scale + mask) @ value``, computed tile by tile
    without materialising the ``[L, S]`` scores (memory O(L)), differentiable in query, key,
    value and a floating ``attn_mask``. Calls the op ``torch.ops.flashv100.attention``, which is
    what ``torch.compile`` graphs and graph passes see.

    Args:
        query: ``[..., Hq, L, E]``.
        key: ``[..., Hkv, S, E]``, the same batch dims as query.
        value: ``[..., Hkv, S, Ev]``. One floating dtype (fp16, bf16, fp32, fp64) and one device
            for query, key and value; a ``[B, L, H, E]`` tensor ``.transpose(1, 2)`` is used
            without a copy.
        attn_mask: ``None``, a bool mask (``True`` = attend) or a floating mask added to the
            scores (any float dtype, may require grad), broadcastable to ``[..., Hq, L, S]``.
        dropout_p: dropout probability on the attention weights, applied whenever non-zero (as
            in SDPA: not tied to ``module.training``). Draws from torch's generator of the
            tensors' device, so ``torch.manual_seed`` reproduces a run.
        is_causal: top-left aligned causal mask, as in SDPA; may be combined with ``attn_mask``
            (both apply).
        scale: softmax scale; ``None`` means ``1 / sqrt(E)``.
        enable_gqa: grouped-query / multi-query attention: ``Hq`` a multiple of ``Hkv``, without
            repeating key and value.

    Returns:
        ``[..., Hq, L, Ev]`` in the dtype of query. Rows in which every key is masked are zeros.

    Under ``torch.use_deterministic_algorithms(True)`` the backward is bitwise reproducible.

    Example::

        >>> q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
        >>> out = torch_flash_v100.attention(q, k, v, is_causal=True)
        >>> out.shape
        torch.Size([2, 8, 128, 64])
    """
    return torch.ops.flashv100.attention(query, key, value, attn_mask, dropout_p, is_causal,
                                         scale=scale, enable_gqa=enable_gqa)


def build_info() -> dict:
    """Facts about this build: torch version built against, CUDA version and archs compiled."""
    info = dict(_C.build_info())
    info["version"] = __version__
    info["torch_runtime_version"] = torch.__version__
    return info


def _cuda_kernels_missing_note(build: dict) -> Optional[str]:
    """What to tell a user whose torch can use a CUDA GPU when this build has no CUDA kernels
    (None otherwise): pip hides the CMake summary that says so."""
    if build["cuda"] or torch.version.cuda is None or not torch.cuda.is_available():
        return None
    return ("torch_flash_v100 was built without CUDA kernels (CPU kernels only), but torch can "
            "use a CUDA GPU: attention on CUDA tensors raises NotImplementedError. To build them, "
            f"put a CUDA toolkit of torch's CUDA version ({torch.version.cuda}) on PATH and "
            "reinstall from the source tree: `pip install -v --no-build-isolation .` (-e for a "
            "development install; TORCH_CUDA_ARCH_LIST=7.0 for a V100), whose CMake output says "
            "'CUDA kernels ON, archs ...'. `python -m torch_flash_v100 info` shows what was built.")


_note = _cuda_kernels_missing_note(_C.build_info())
if _note:
    warnings.warn(_note, stacklevel=2)
del _note


def force_volta_atom() -> bool:
    """Whether the Volta ``mma.m8n8k4`` kernels are forced on GPUs that have newer atoms."""
    return _C.force_volta_atom()


def set_force_volta_atom(force: bool) -> None:
    """Force (or stop forcing) the Volta kernels; also set by ``FLASHV100_FORCE_VOLTA=1``."""
    _C.set_force_volta_atom(bool(force))


@contextlib.contextmanager
def volta_atom(force: bool = True):
    """Context manager around :func:`set_force_volta_atom`."""
    previous = force_volta_atom()
    set_force_volta_atom(force)
    try:
        yield
    finally:
        set_force_volta_atom(previous)


def kernel_path(device: torch.device | str | None = None) -> str:
    """The kernel family that attention on ``device`` runs: "cpu" or the tensor-core atom."""
    device = torch.device(device if device is not None else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu"
    if not _C.build_info()["cuda"]:
        return "unavailable: built without CUDA kernels"
    major, minor = torch.cuda.get_device_capability(device)
    return _C.mma_atom_name(major, minor)


_COMPILE_API = ("enable", "disable", "backend")
_FLASH_ATTN_API = (
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
)


def __getattr__(name: str):
    # The torch.compile integration imports Dynamo and Inductor (over a second): load it on first use.
    if name in _COMPILE_API:
        from . import compile as _compile

        return getattr(_compile, name)
    if name in _FLASH_ATTN_API:
        from . import flash_attn_interface

        return getattr(flash_attn_interface, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_COMPILE_API))


__all__ = [
    "attention", "build_info", "force_volta_atom", "set_force_volta_atom", "volta_atom",
    "kernel_path", "reference_attention", "alias_flash_attn", "__version__", *_COMPILE_API,
    *_FLASH_ATTN_API,
]
