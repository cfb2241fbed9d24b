"""torch-flash-v100: FlashAttention-2-class fused attention for NVIDIA V100 (sm_70) GPUs.

``torch_flash_v100.attention`` is ``torch.ops.flashv100.attention``: the semantics of
``torch.nn.functional.scaled_dot_product_attention``, with CPU and CUDA kernels, fake kernels
and autograd, usable under ``torch.compile``.
"""

from __future__ import annotations

import contextlib

import torch

from . import _C  # noqa: F401  (loads the extension: registers the flashv100 ops)
from . import _ops  # noqa: F401  (fake kernels and autograd)
from . import _flash_ops  # noqa: F401  (the same for the FlashAttention-2 ops)
from .reference import reference_attention

__version__ = "0.1.0"

attention = torch.ops.flashv100.attention


def build_info() -> dict:
    """Facts about this build: torch version built against, CUDA version and archs compiled."""
    info = dict(_C.build_info())
    info["version"] = __version__
    info["torch_runtime_version"] = torch.__version__
    return info


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
    "flash_attn_varlen_kvpacked_func",
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


__all__ = [
    "attention", "build_info", "force_volta_atom", "set_force_volta_atom", "volta_atom",
    "kernel_path", "reference_attention", "__version__", *_COMPILE_API, *_FLASH_ATTN_API,
]
