"""The attention implementations compared side by side.

Every implementation takes (q [B,H,L,E], k [B,Hkv,S,E], v [B,Hkv,S,E], causal, attn_mask=None,
dropout_p=0.0) with SDPA's meaning of attn_mask (bool keep-mask or additive float, broadcast to
[B,H,L,S]) and returns out [B,H,L,E], differentiable. ``make_impls(device)`` returns them with,
for those that cannot run on the device, the reason why (recorded in the results instead of
silently dropped). One that refuses particular inputs (an SDPA backend without dropout, say)
raises ``Unsupported``, recorded per configuration as "unsupported" with the reason.
"""
from __future__ import annotations

import contextlib
import functools
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, List, Optional

import torch
import torch.nn.functional as F

from torch_flash_v100.reference import naive_attention

__all__ = ["Impl", "make_impls", "IMPL_NAMES", "naive_attention", "load_flashv100", "FLASH", "Unsupported"]

FLASH = "flashv100"
IMPL_NAMES = [
    "flashv100",
    "flashv100-volta",
    "sdpa-flash",
    "sdpa-efficient",
    "sdpa-cudnn",
    "sdpa-math",
    "naive",
    "naive-fp32softmax",
]


class Unsupported(RuntimeError):
    """The implementation refuses these inputs (e.g. SDPA flash and dropout): not a failure."""


@dataclass
class Impl:
    name: str
    fn: Callable[..., torch.Tensor]
    description: str
    context: Callable[[], ContextManager] = contextlib.nullcontext
    skip_reason: Optional[str] = None
    kernel_path: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.skip_reason is None


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.size(-3) != k.size(-3)


def _expand_kv(q, k, v):
    if _gqa(q, k):
        rep = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    return k, v


# --------------------------------------------------------------------------------------------
# flashv100
# --------------------------------------------------------------------------------------------

def load_flashv100():
    """Import torch_flash_v100; returns (module, None) or (None, reason)."""
    try:
        import torch_flash_v100 as tfv  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the build
        return None, f"import torch_flash_v100 failed: {type(e).__name__}: {e}"
    if not hasattr(tfv, "attention"):
        return None, "torch_flash_v100 has no 'attention' (incomplete build?)"
    return tfv, None


def _kernel_path(tfv, device) -> Optional[str]:
    try:
        return str(tfv.kernel_path(torch.device(device)))
    except Exception as e:
        return f"unknown ({type(e).__name__}: {e})"


def _flash_impls(device: torch.device) -> List[Impl]:
    tfv, reason = load_flashv100()

    def fv(q, k, v, causal, attn_mask=None, dropout_p=0.0):
        return tfv.attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal,
                             enable_gqa=_gqa(q, k))

    out = []
    if tfv is None:
        out.append(Impl("flashv100", fv, "torch_flash_v100.attention, default kernel path",
                        skip_reason=reason))
        out.append(Impl("flashv100-volta", fv, "torch_flash_v100.attention, forced Volta mma.m8n8k4 path",
                        skip_reason=reason))
        return out
    out.append(Impl("flashv100", fv, "torch_flash_v100.attention, default kernel path",
                    kernel_path=_kernel_path(tfv, device)))

    @contextlib.contextmanager
    def forced():
        prev = bool(tfv.force_volta_atom())
        tfv.set_force_volta_atom(True)
        try:
            yield
        finally:
            tfv.set_force_volta_atom(prev)

    skip = None
    kp = None
    if device.type != "cuda":
        skip = f"no Volta tensor-core path on device type {device.type!r}"
    elif not hasattr(tfv, "set_force_volta_atom"):
        skip = "torch_flash_v100.set_force_volta_atom is missing"
    else:
        cc = torch.cuda.get_device_capability(device)
        if cc == (7, 0):
            skip = "device is sm_70: the default path already is the Volta path"
        else:
            with forced():
                kp = _kernel_path(tfv, device)
    volta = Impl("flashv100-volta", fv,
                 "torch_flash_v100.attention with set_force_volta_atom(True) (mma.m8n8k4; emulated "
                 "and slow on sm_80+: a correctness check, its speed there means nothing)",
                 context=forced, skip_reason=skip, kernel_path=kp)
    out.append(volta)
    return out


# --------------------------------------------------------------------------------------------
# SDPA backends
# --------------------------------------------------------------------------------------------

_SDPA_BACKENDS = [
    ("sdpa-flash", "FLASH_ATTENTION"),
    ("sdpa-efficient", "EFFICIENT_ATTENTION"),
    ("sdpa-cudnn", "CUDNN_ATTENTION"),
    ("sdpa-math", "MATH"),
]


def _sdpa_supports_gqa() -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # builtins without a signature: try it
        try:
            x = torch.zeros(1, 2, 1, 8)
            F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False
        except Exception:
            return True


class _RecordWarnings:
    """Collects SDPA's "... not used because ..." warnings to explain a failure."""

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self.records = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def text(self) -> str:
        seen = []
        for w in self.records:
            m = " ".join(_TRIGGERED.sub("", str(w.message)).split())
            if m not in seen:
                seen.append(m)
        # "X not used because:" is followed by its reasons: no separator after the colon
        return " | ".join(seen).replace(": | ", ": ")


# the C++ source location PyTorch appends to its warnings: noise in a reason
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)")
# what SDPA raises when the chosen backend refuses the inputs (the warnings say why)
_SDPA_REFUSED = ("No available kernel", "No viable backend")


def _sdpa_impls(device: torch.device) -> List[Impl]:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # torch < 2.3
        return [Impl(n, None, f"SDPA {b}", skip_reason=f"torch.nn.attention.sdpa_kernel unavailable: {e}")
                for n, b in _SDPA_BACKENDS]
    native_gqa = _sdpa_supports_gqa()
    out = []
    for name, bname in _SDPA_BACKENDS:
        backend = getattr(SDPBackend, bname, None)
        if backend is None:
            out.append(Impl(name, None, f"SDPA {bname}",
                            skip_reason=f"SDPBackend.{bname} does not exist in torch {torch.__version__}"))
            continue

        def make(backend=backend, bname=bname):
            def ctx():
                return sdpa_kernel([backend])

            state = {"native_gqa": native_gqa}

            def call(q, k, v, causal, attn_mask, dropout_p):
                sdpa = functools.partial(F.scaled_dot_product_attention, attn_mask=attn_mask,
                                         dropout_p=dropout_p, is_causal=causal)
                if _gqa(q, k) and state["native_gqa"]:
                    try:
                        return sdpa(q, k, v, enable_gqa=True)
                    except RuntimeError:
                        k2, v2 = _expand_kv(q, k, v)
                        out = sdpa(q, k2, v2)  # raises when refused for another reason (mask, dropout)
                        # this backend has no native GQA: from now on expand K/V (counted in the time)
                        state["native_gqa"] = False
                        return out
                k, v = _expand_kv(q, k, v)
                return sdpa(q, k, v)

            def fn(q, k, v, causal, attn_mask=None, dropout_p=0.0):
                try:
                    return call(q, k, v, causal, attn_mask, dropout_p)
                except RuntimeError as e:
                    # once more, recording SDPA's "... not used because ..." warnings for the reason
                    # (no warnings machinery on the timed path)
                    with _RecordWarnings() as rec:
                        try:
                            call(q, k, v, causal, attn_mask, dropout_p)
                        except Exception:
                            pass
                    why = rec.text()
                    msg = str(e).splitlines()[0] + (f" [{why}]" if why else "")
                    refused = any(m in str(e) for m in _SDPA_REFUSED)
                    raise (Unsupported if refused else RuntimeError)(msg) from None

            return ctx, fn

        ctx, fn = make()
        desc = f"F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.{bname})"
        notes = []
        if device.type == "cpu" and bname == "FLASH_ATTENTION":
            notes.append("on CPU this is PyTorch's own CPU flash kernel, not FlashAttention-2 CUDA")
        skip = _probe_sdpa(ctx, fn, device)
        if skip and device.type == "cpu" and bname in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            skip = f"SDPA {bname} is a CUDA-only backend (probe on CPU: {skip})"
        out.append(Impl(name, fn, desc, context=ctx, skip_reason=skip, notes=notes))
    return out


def _probe_sdpa(ctx, fn, device: torch.device) -> Optional[str]:
    """A tiny fp16/fp32 forward to tell 'never available here' from per-config failures."""
    dt = torch.float16 if device.type == "cuda" else torch.float32
    try:
        q = torch.randn(1, 2, 16, 64, device=device, dtype=dt)
        with ctx():
            fn(q, q, q, False)
        return None
    except Exception as e:
        return " ".join(str(e).split())[:400]


# --------------------------------------------------------------------------------------------

def _naive_fn(fp32_softmax: bool):
    def fn(q, k, v, causal, attn_mask=None, dropout_p=0.0):
        return naive_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal,
                               fp32_softmax=fp32_softmax)
    return fn


def make_impls(device, names: Optional[List[str]] = None) -> List[Impl]:
    device = torch.device(device)
    impls: Dict[str, Impl] = {}
    for im in _flash_impls(device) + _sdpa_impls(device):
        impls[im.name] = im
    impls["naive"] = Impl("naive", _naive_fn(fp32_softmax=False),
                          "eager matmul-softmax-matmul in the input dtype (K/V repeated for GQA; mask by "
                          "masked_fill or addition, F.dropout on the probabilities)")
    impls["naive-fp32softmax"] = Impl("naive-fp32softmax", _naive_fn(fp32_softmax=True),
                                      "eager matmul-softmax-matmul with the softmax in fp32")
    if names:
        unknown = [n for n in names if n not in impls]
        if unknown:
            raise KeyError(f"unknown implementation(s) {unknown}; choose from {IMPL_NAMES}")
        return [impls[n] for n in names]
    return [impls[n] for n in IMPL_NAMES]
