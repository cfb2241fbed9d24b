"""torch.compile integration: rewrite real-world attention into ``flashv100.attention`` (or, for
sliding windows, tanh soft-capping and ALiBi, the FlashAttention-2 op ``flashv100._flash_forward``).

Two ways in:

* ``torch_flash_v100.enable(force=False)`` installs :class:`FlashV100Pass` as Inductor's
  ``pre_grad_custom_pass`` (chained with whatever pass was there), so a plain
  ``torch.compile(model)`` rewrites; ``torch_flash_v100.disable()`` removes it again.
* ``torch.compile(model, backend="flashv100")`` or ``backend=torch_flash_v100.backend(force=True)``
  rewrites one model, then hands the graph to Inductor (or to another backend, see
  :func:`backend`).

The pass runs on the torch-level graph *before* autograd, so in training AOTAutograd derives the
backward of the fused op itself (``flashv100._attention_backward``, ``flashv100._flash_backward``):
no unfused O(L*S) backward is left behind.  By default only attention on CUDA devices of compute
capability < 8.0 (V100, T4) is rewritten; ``force=True`` rewrites on every device, CPU included.

Every rewritten site increments ``torch._dynamo.utils.counters["flashv100"]["fused_attention"]``.
Every softmax/SDPA site considered is logged on the ``torch_flash_v100.compile`` logger (INFO),
with the reason when it is not rewritten; ``TORCH_LOGS=torch_flash_v100`` (or
``torch._logging.set_logs(modules={"torch_flash_v100": logging.INFO})``) turns that log on.
Both also happen when Inductor's caches hit: the pass runs on every compile (see
:func:`enable`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, Optional

import torch
try:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # torch 2.5: plain callables as custom passes, and no cache-key helper
    CustomGraphPass = object

    def get_hash_for_files(paths, extra: str = "") -> bytes:
        """What torch >= 2.6's helper of this name returns: sha256 over the files' contents."""
        h = hashlib.sha256(extra.encode())
        for path in paths:
            with open(path, "rb") as f:
                h.update(f.read())
        return h.digest()

from ._rewrite import AttentionRewriter, history, rewrite

log = logging.getLogger("torch_flash_v100.compile")

__all__ = ["enable", "disable", "backend", "FlashV100Pass", "rewrite", "rewrite_module",
           "AttentionRewriter",
           "is_enabled", "history"]

_SOURCES = ("__init__.py", "_rewrite.py", "_match.py", "_plan.py", "_emit.py", "_masks.py",
            "_fx_nodes.py")
_SOURCE_HASH = get_hash_for_files(
    tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), n) for n in _SOURCES)).hex()


def _as_list(p: Any) -> list:
    if p is None:
        return []
    if isinstance(p, (list, tuple)):
        return list(p)
    return [p]


class FlashV100Pass(CustomGraphPass):
    """Inductor ``pre_grad_custom_pass``: the attention rewrite, then any previously set pass.

    ``uuid()`` is stable (hash of this package's sources, ``force``, and the chained pass' uuid),
    so Inductor's FX graph cache keeps working.
    """

    def __init__(self, force: bool = False, previous: Any = None):
        self.force = bool(force)
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite(graph, force=self.force)
        for p in _as_list(self.previous):
            p(graph)

    def uuid(self) -> Optional[Any]:
        parts = [_SOURCE_HASH, f"force={self.force}"]
        if not self.force:
            # what gets rewritten depends on the GPUs' compute capability, which the cache key
            # does not otherwise see
            try:
                if torch.cuda.is_available():
                    parts.append(repr([torch.cuda.get_device_capability(i)
                                       for i in range(torch.cuda.device_count())]))
            except Exception:  # pragma: no cover
                pass
        for p in _as_list(self.previous):
            u = p.uuid() if hasattr(p, "uuid") else None
            if u is None:
                return None  # the chained pass cannot be cached: neither can we
            parts.append(repr(u))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()

    def __repr__(self) -> str:
        return f"FlashV100Pass(force={self.force}, previous={self.previous!r})"


def rewrite_module(gm: torch.fx.GraphModule, force: bool = False) -> int:
    """Rewrite ``gm`` and the graphs nested in it (e.g. activation-checkpointed regions)."""
    fused = 0
    for m in list(gm.modules()):
        if isinstance(m, torch.fx.GraphModule):
            rw = rewrite(m.graph, force=force)
            if rw.fused or rw.shielded:
                m.recompile()
            fused += rw.fused
    return fused


def _config():
    import torch._inductor.config as cfg
    return cfg


def enable(force: bool = False) -> None:
    """Make a plain ``torch.compile(model)`` (Inductor) rewrite attention into flashv100.

    Idempotent; calling it again with another ``force`` updates the setting.  An already set
    ``pre_grad_custom_pass`` keeps running (after ours).  Call before compiling: graphs compiled
    earlier are not recompiled.  On torch >= 2.13 it sets ``pre_grad_pass_timing`` to "early"
    (if still "default") so that the counter and the log also cover FX graph / AOTAutograd
    cache hits; :func:`disable` restores it.
    """
    cfg = _config()
    cur = cfg.pre_grad_custom_pass
    if isinstance(cur, FlashV100Pass):
        if cur.force == bool(force):
            return
        cur = cur.previous
    cfg.pre_grad_custom_pass = FlashV100Pass(force=force, previous=cur)
    _run_pre_grad_passes_on_cache_hits(cfg)


# torch >= 2.13 runs pre-grad passes after the AOTAutograd cache lookup ("late") by default, so
# on a warm cache the pass would not run and neither count nor log the sites it fused; "early"
# runs them on every compile (the cache still hits: its key is taken after them).  Older torch
# has no such setting and always runs them early.  A timing the user chose is left as it is.
_TIMING = "pre_grad_pass_timing"
_timing_set_by_enable = False


def _run_pre_grad_passes_on_cache_hits(cfg) -> None:
    global _timing_set_by_enable
    if getattr(cfg, _TIMING, None) == "default":
        setattr(cfg, _TIMING, "early")
        _timing_set_by_enable = True


def _restore_pre_grad_pass_timing(cfg) -> None:
    global _timing_set_by_enable
    if _timing_set_by_enable and getattr(cfg, _TIMING, None) == "early":
        setattr(cfg, _TIMING, "default")
    _timing_set_by_enable = False


def disable() -> None:
    """Remove the pass installed by :func:`enable` (idempotent), restoring the previous pass."""
    cfg = _config()
    _restore_pre_grad_pass_timing(cfg)
    cur = cfg.pre_grad_custom_pass
    if isinstance(cur, FlashV100Pass):
        cfg.pre_grad_custom_pass = cur.previous
    elif isinstance(cur, (list, tuple)) and any(isinstance(p, FlashV100Pass) for p in cur):
        rest = [p.previous if isinstance(p, FlashV100Pass) else p for p in cur]
        flat = []
        for p in rest:
            flat.extend(_as_list(p))
        cfg.pre_grad_custom_pass = type(cur)(flat) if flat else None


def is_enabled() -> bool:
    cur = _config().pre_grad_custom_pass
    return any(isinstance(p, FlashV100Pass) for p in _as_list(cur))


def backend(force: bool = False, compiler: Any = "inductor",
            **inductor_options: Any) -> Callable:
    """A ``torch.compile`` backend: the attention rewrite, then ``compiler``.

    ``compiler`` is "inductor" (default; ``inductor_options`` become Inductor config patches),
    any registered backend name (e.g. "aot_eager", "eager"), or a backend callable.
    """

    def flashv100_backend(gm: torch.fx.GraphModule, example_inputs):
        rewrite_module(gm, force=force)
        if compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx
            if inductor_options:
                return compile_fx(gm, example_inputs, config_patches=dict(inductor_options))
            return compile_fx(gm, example_inputs)
        fn = compiler
        if isinstance(fn, str):
            from torch._dynamo.backends.registry import lookup_backend
            fn = lookup_backend(fn)
        return fn(gm, example_inputs)

    flashv100_backend.force = force  # type: ignore[attr-defined]
    return flashv100_backend


def _flashv100_default_backend(gm, example_inputs):
    return backend()(gm, example_inputs)
