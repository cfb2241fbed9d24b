"""Timing, memory, accuracy and the run loop of the attention benchmark.

Method (also written into every JSON under metadata.method):
  * time: CUDA events around each repetition (or ``triton.testing.do_bench`` when Triton is
    installed and one call is short enough for its fixed estimate runs), after a warm-up; on CPU
    ``time.perf_counter``. Reported: median, 20th and 80th percentile, number of repetitions.
    Repetitions are a fixed count per measurement (``repetitions``: every measurement runs, on
    any machine under any load), or chosen adaptively from a time budget for the whole suite.
  * forward is timed with inputs that require grad (a training forward); backward is
    ``out.backward(dout, retain_graph=True)`` on one retained graph; fwd+bwd is both per call.
    On CUDA also ``graph fwd+bwd``: forward and ``torch.autograd.grad`` captured once in a CUDA
    graph and replayed, the kernels' time without the host work of a step (which is what eager
    fwd+bwd measures at small shapes, where the host is slower than the GPU).
    Gradients are reset to None between repetitions (outside the timed region).
  * memory: the peak *extra* memory of one forward+backward above what is allocated before it
    (inputs, dout), including the three gradient tensors (the same for every implementation).
    CUDA: ``torch.cuda.max_memory_allocated`` delta. CPU: the running sum of the CPU allocator's
    allocation/free events recorded by ``torch.profiler(profile_memory=True)`` (no tracemalloc;
    memory a kernel takes outside the PyTorch allocator is not seen). ``mem_fwd_mb`` is the same
    for one forward under ``torch.no_grad`` (inference).
  * accuracy: max abs error of out / dq / dk / dv of every implementation vs an fp64 reference
    (torch_flash_v100.reference.reference_attention, computed on the device in head chunks),
    for the same inputs, attn_mask and output gradient. Not applicable with dropout (random
    outputs): recorded as such, no reference is computed.
  * TFLOP/s: forward = 4*B*H*L*S*E (causal: half), backward = 2.5x forward; masks and dropout do
    not change the count (a padding mask does not reduce it).
  * overhead (suites with mask/dropout variants): time(variant) / time(same shape, plain), per
    implementation.
  * unstable: a measurement whose p80 / p20 exceeds UNSTABLE_SPREAD in a phase, or whose fwd+bwd
    is faster than its fwd or bwd alone, lists why under ``unstable`` (empty when neither).
  * rounds (``rounds`` > 1): each configuration's implementations are measured in turn, that many
    times, and each phase reports the median of the rounds' medians (``<phase>_ms_rounds`` lists
    them), so that a GPU's clock changes (a power cap at long shapes) fall on all implementations
    alike instead of on whichever ran last.
"""
from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from torch_flash_v100._measure import cuda_graph_replay, peak_memory_mb, synchronize, time_fn
from torch_flash_v100.reference import reference_attention

from .implementations import FLASH, Impl, Unsupported, load_flashv100, make_impls
from .suites import BWD_FLOP_RATIO, Config, flops_fwd

__all__ = ["run_suite", "collect_metadata", "time_fn", "peak_memory_mb", "reference_grads",
           "default_dtype", "DTYPES", "make_attn_mask", "padding_lengths", "overheads",
           "unstable_reasons", "UNSTABLE_SPREAD", "combine_rounds"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def default_dtype(device: torch.device) -> str:
    return "fp16" if device.type == "cuda" else "fp32"


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------

def reference_grads(q, k, v, dout, causal: bool, mem_limit_bytes: Optional[int] = None, *,
                    attn_mask: Optional[torch.Tensor] = None):
    """fp64 out, dq, dk, dv, computed in chunks of (batch, kv-head group) to bound memory.
    ``attn_mask`` broadcasts to [B, H, L, S] (SDPA's meaning: bool keep or additive float)."""
    ref = reference_attention
    B, H, L, E = q.shape
    Hkv, S = k.size(1), k.size(2)
    g = H // Hkv
    dev = q.device
    if mem_limit_bytes is None:
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            mem_limit_bytes = int(free * 0.4)
        else:
            mem_limit_bytes = 1 << 30
    per_kv_head = g * L * S * 8 * 10  # reference_attention keeps ~6 fp64 [L, S] tensors, + backward
    chunk = max(1, min(Hkv, mem_limit_bytes // max(1, per_kv_head)))
    qd, kd, vd, dod = (t.detach().to(torch.float64) for t in (q, k, v, dout))
    # [B|1, H|1, L|1, S]: the leading dims that broadcast stay 1 and are not sliced
    mask4 = None if attn_mask is None else attn_mask.reshape((1,) * (4 - attn_mask.dim()) + attn_mask.shape)
    out = torch.empty_like(qd)
    dq = torch.empty_like(qd)
    dk = torch.empty_like(kd)
    dv = torch.empty_like(vd)
    with torch.enable_grad():
        for b in range(B):
            for h0 in range(0, Hkv, chunk):
                h1 = min(Hkv, h0 + chunk)
                qs = qd[b:b + 1, h0 * g:h1 * g].clone().requires_grad_()
                ks = kd[b:b + 1, h0:h1].clone().requires_grad_()
                vs = vd[b:b + 1, h0:h1].clone().requires_grad_()
                m = None
                if mask4 is not None:
                    m = mask4 if mask4.size(0) == 1 else mask4[b:b + 1]
                    m = m if m.size(1) == 1 else m[:, h0 * g:h1 * g]
                o = ref(qs, ks, vs, attn_mask=m, is_causal=causal, enable_gqa=g > 1)
                o.backward(dod[b:b + 1, h0 * g:h1 * g])
                out[b:b + 1, h0 * g:h1 * g] = o.detach()
                dq[b:b + 1, h0 * g:h1 * g] = qs.grad
                dk[b:b + 1, h0:h1] = ks.grad
                dv[b:b + 1, h0:h1] = vs.grad
                del qs, ks, vs, o
    return out, dq, dk, dv


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x is None:
        return float("nan")
    return float((x.detach().to(torch.float64) - ref).abs().max().item())


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------

def source_checkout() -> Optional[Path]:
    """The repository root when this package runs from a source checkout (an editable install),
    None for an installed wheel: a wheel's metadata must not name the commit of whatever git
    repository happens to contain site-packages."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "csrc").is_dir() else None


def _git(*args) -> Optional[str]:
    root = source_checkout()
    if root is None:
        return None
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:
        return None


def collect_metadata(device: torch.device) -> Dict[str, Any]:
    device = torch.device(device)
    md: Dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # FLASHV100_COMMIT names the commit of a copied tree, whose git metadata (if any) may be
        # stale; it wins over git.
        "git_commit": os.environ.get("FLASHV100_COMMIT") or _git("rev-parse", "HEAD"),
        "git_dirty": None,
        "device": str(device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
    }
    st = None if os.environ.get("FLASHV100_COMMIT") else _git("status", "--porcelain",
                                                              "--untracked-files=no")
    md["git_dirty"] = None if st is None else bool(st)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        md["device_name"] = p.name
        md["compute_capability"] = f"{p.major}.{p.minor}"
        md["device_memory_gb"] = round(p.total_memory / 2**30, 1)
        md["sm_count"] = p.multi_processor_count
        try:
            md["cudnn_version"] = torch.backends.cudnn.version()
        except Exception:
            md["cudnn_version"] = None
    else:
        md["device_name"] = platform.processor() or platform.machine()
        md["compute_capability"] = None
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        md["device_name"] = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    try:
        import triton  # type: ignore
        md["triton_version"] = triton.__version__
    except Exception:
        md["triton_version"] = None
    tfv, reason = load_flashv100()
    if tfv is None:
        md["torch_flash_v100"] = {"error": reason}
    else:
        info: Dict[str, Any] = {"version": getattr(tfv, "__version__", None)}
        try:
            info["build_info"] = _jsonable(tfv.build_info())
        except Exception as e:
            info["build_info"] = {"error": f"{type(e).__name__}: {e}"}
        md["torch_flash_v100"] = info
    md["reference"] = "torch_flash_v100.reference.reference_attention (fp64)"
    md["method"] = {
        "time": "CUDA events per repetition (or triton.testing.do_bench), median/p20/p80; CPU: perf_counter",
        "memory": ("torch.cuda.max_memory_allocated delta over one fwd+bwd" if device.type == "cuda" else
                   "CPU allocator alloc/free events via torch.profiler(profile_memory=True), running-sum peak"),
        "flops": "fwd 4*B*H*L*S*E (causal /2); bwd 2.5x fwd; masks and dropout do not change the count",
        "errors": ("max abs error vs fp64 reference, same inputs, attn_mask and output gradient; "
                   "not applicable with dropout"),
        "overhead": "time(variant) / time(same shape without mask and dropout), per implementation",
        "rounds": ("rounds > 1: a configuration's implementations measured in turn that many "
                   "times; each time the median of the rounds' medians (<phase>_ms_rounds)"),
    }
    return md


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


# ---------------------------------------------------------------------------------------------
# the run loop
# ---------------------------------------------------------------------------------------------

class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.total = total
        self.i = 0
        self.enabled = enabled
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)
            except Exception:
                self.bar = None

    def step(self, desc: str, n: int = 1):
        self.i += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(desc[:60])
            self.bar.update(n)
        else:
            print(f"[{self.i}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _one_line(e: BaseException, limit: int = 500) -> str:
    msg = " ".join(str(e).split())
    return msg[:limit] + "..." if len(msg) > limit else msg


def _short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {_one_line(e)}"


def _is_sticky_cuda_error(e: BaseException) -> bool:
    m = str(e)
    return any(s in m for s in ("illegal memory access", "device-side assert", "unspecified launch failure",
                                "misaligned address", "illegal instruction", "CUDA error: an illegal"))


def _cleanup(device: torch.device, collect: bool = False):
    """Free cached device memory; ``collect`` also runs the (slow: ~0.1 s with torch loaded)
    garbage collector, needed only after an exception (tracebacks hold frames with tensors)."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def accuracy_not_applicable(cfg: Config) -> Optional[str]:
    """Why errors vs the reference mean nothing for ``cfg`` (None: they do)."""
    if cfg.dropout > 0:
        return f"not applicable: dropout {cfg.dropout:g} makes the outputs random"
    return None


def measure(impl: Impl, cfg: Config, inputs, ref, device: torch.device,
            budget_s: Optional[float] = None, timer: str = "auto", *,
            reps: Optional[int] = None) -> Dict[str, Any]:
    """All numbers for one implementation on one configuration (raises on failure).
    ``inputs`` = (q, k, v, dout, attn_mask); ``ref`` = fp64 (out, dq, dk, dv), or None where
    accuracy_not_applicable(cfg). Each of fwd, bwd, fwd+bwd (and on CUDA graph-replayed fwd+bwd)
    is timed over ``reps`` repetitions, or over an equal share of ``budget_s``."""
    q, k, v, dout, mask = inputs
    res: Dict[str, Any] = {"status": "ok"}

    def call():
        return impl.fn(q, k, v, cfg.causal, mask, cfg.dropout)

    def zero():
        q.grad = k.grad = v.grad = None

    with impl.context():
        # 1. one fwd+bwd: accuracy and training memory; also the warm-up
        zero()
        holder = {}

        def fwd_bwd_keep():
            o = call()
            o.backward(dout)
            holder["out"] = o.detach()

        # The clock starts on an idle GPU: started with the fp64 reference still queued, it timed
        # the reference too, and the estimates below then allowed one unwarmed repetition.
        synchronize(device)
        t0 = time.perf_counter()
        res["mem_mb"] = peak_memory_mb(fwd_bwd_keep, device)
        first_ms = (time.perf_counter() - t0) * 1e3
        res["first_fwdbwd_ms"] = first_ms  # with one-time costs (allocations, module loading)
        out = holder.pop("out")
        if ref is None:  # dropout: nothing to compare with
            res.update(err_out=None, err_dq=None, err_dk=None, err_dv=None,
                       accuracy=accuracy_not_applicable(cfg))
        else:
            out_ref, dq_ref, dk_ref, dv_ref = ref
            res["err_out"] = _max_err(out, out_ref)
            res["err_dq"] = _max_err(q.grad, dq_ref)
            res["err_dk"] = _max_err(k.grad, dk_ref)
            res["err_dv"] = _max_err(v.grad, dv_ref)
        del out
        zero()

        def fwd_nograd():
            with torch.no_grad():
                call()

        res["mem_fwd_mb"] = peak_memory_mb(fwd_nograd, device)

        # 2. timings
        graphed = device.type == "cuda"  # CUDA adds the graph-replayed fwd+bwd
        b = None if reps is not None else budget_s / (4 if graphed else 3)
        est = first_ms / 3.5
        tf = time_fn(call, device, b, reps=reps, estimate_ms=est, timer=timer)
        graph = {"out": call()}  # one forward, its graph retained
        tb = time_fn(lambda: graph["out"].backward(dout, retain_graph=True), device, b, reps=reps,
                     setup=zero, estimate_ms=est * BWD_FLOP_RATIO, timer=timer)
        graph.clear()
        zero()

        def fb():
            call().backward(dout)

        tfb = time_fn(fb, device, b, reps=reps, setup=zero, estimate_ms=tf["ms"] + tb["ms"],
                      timer=timer)
        zero()
        timings = [("fwd", tf), ("bwd", tb), ("fwdbwd", tfb)]
        if graphed:
            try:
                timings.append(("graph_fwdbwd", _time_graphed_fwd_bwd(call, (q, k, v), dout, device,
                                                                     b, reps, tfb["ms"], timer)))
            except (RuntimeError, torch.OutOfMemoryError) as e:
                res["graph_error"] = " ".join(str(e).split())[:300]
    for name, t in timings:
        res[f"{name}_ms"] = t["ms"]
        res[f"{name}_ms_p20"] = t["p20"]
        res[f"{name}_ms_p80"] = t["p80"]
        res[f"{name}_reps"] = t["reps"]
        res[f"tflops_{name}"] = _tflops(cfg, name, t["ms"])
        res["timer"] = t["timer"]
    res["unstable"] = unstable_reasons(res)
    return res


def _tflops(cfg: Config, phase: str, ms: float) -> Optional[float]:
    """TFLOP/s of one phase (PHASES) at ``ms`` milliseconds."""
    flops = flops_fwd(cfg) * {"fwd": 1.0, "bwd": BWD_FLOP_RATIO}.get(phase, 1 + BWD_FLOP_RATIO)
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else None


def _round_failed(r: Dict[str, Any]) -> bool:
    """A round's result that ends its implementation's measurement of a configuration: an error
    or unsupported (not ok, not skipped for the time budget)."""
    return r.get("status") not in ("ok", "skipped")


def combine_rounds(cfg: Config, rounds: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One implementation's results of ``cfg`` from several rounds (run_suite's ``rounds``) as
    one: per phase the median of the rounds' medians (listed in ``<phase>_ms_rounds``), the
    median of their p20 and p80, the repetitions summed; accuracy and memory from the first
    round. A round that failed (error, unsupported) is the result; rounds skipped for the time
    budget are left out (all skipped: skipped)."""
    failed = [r for r in rounds if _round_failed(r)]
    ran = [r for r in rounds if r.get("status") == "ok"]
    if failed or not ran:
        return (failed or list(rounds))[0]
    if len(ran) == 1:
        return ran[0]
    res = dict(ran[0])
    for ph in PHASES:
        meds = [r.get(f"{ph}_ms") for r in ran]
        if any(m is None for m in meds):  # a phase not every round has (a graph capture failed)
            for key in (f"{ph}_ms", f"{ph}_ms_p20", f"{ph}_ms_p80", f"{ph}_reps", f"tflops_{ph}"):
                res.pop(key, None)
            continue
        res[f"{ph}_ms"] = statistics.median(meds)
        res[f"{ph}_ms_rounds"] = meds
        for q in ("p20", "p80"):
            res[f"{ph}_ms_{q}"] = statistics.median(r[f"{ph}_ms_{q}"] for r in ran)
        reps = [r.get(f"{ph}_reps") for r in ran]
        res[f"{ph}_reps"] = None if None in reps else sum(reps)
        res[f"tflops_{ph}"] = _tflops(cfg, ph, res[f"{ph}_ms"])
    graph_errors = [r["graph_error"] for r in ran if "graph_error" in r]
    if graph_errors:
        res["graph_error"] = graph_errors[0]
    res["unstable"] = unstable_reasons(res)
    return res


def _time_graphed_fwd_bwd(call, leaves, dout, device, budget_s, reps, estimate_ms, timer):
    """Forward+backward captured in one CUDA graph and replayed: the GPU's time of the step with
    no host work (launches, allocations, autograd) in it. Where a step is shorter than its host
    work (small shapes), eager fwd+bwd times the host; this times the kernels."""
    replay = cuda_graph_replay(lambda: torch.autograd.grad(call(), leaves, dout))
    return time_fn(replay, device, budget_s, reps=reps, estimate_ms=estimate_ms, timer=timer)


# p80 / p20 of one phase above this: the median is no reliable time (a busy machine, clock changes)
UNSTABLE_SPREAD = 2.0
_PHASE_LABELS = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "fwd+bwd", "graph_fwdbwd": "graph fwd+bwd"}


def unstable_reasons(res: Dict[str, Any]) -> List[str]:
    """Why the times of one measurement are not to be trusted; empty when nothing says so."""
    reasons = []
    for ph, label in _PHASE_LABELS.items():
        p20, p80 = res.get(f"{ph}_ms_p20"), res.get(f"{ph}_ms_p80")
        if p20 and p80 and p80 / p20 > UNSTABLE_SPREAD:
            reasons.append(f"{label} p20-p80 spread {p80 / p20:.1f}x")
    both = res.get("fwdbwd_ms")
    for ph in ("fwd", "bwd"):
        alone = res.get(f"{ph}_ms")
        if both and alone and both < alone:
            reasons.append(f"fwd+bwd ({both:.3g} ms) faster than {ph} alone ({alone:.3g} ms)")
    return reasons


def _warm_device(device: torch.device, dtypes: Sequence[str]):
    """One small matmul fwd+bwd per dtype, so that one-time allocations (cuBLAS workspaces,
    handles) are not charged to the first implementation's memory and time; likewise the first
    torch.profiler session of the CPU memory measurement (~1 s), which would also inflate the
    first implementation's time estimate and so cut its repetitions."""
    for name in dtypes:
        try:
            x = torch.randn(2, 64, 64, device=device, dtype=DTYPES[name], requires_grad=True)
            (torch.softmax(x @ x.transpose(-2, -1), -1) @ x).sum().backward()
        except Exception:
            pass
    peak_memory_mb(lambda: None, device)
    synchronize(device)


MASK_SEED = 1234
PAD_MAX_FRACTION = 0.25  # padding masks hide up to this fraction of the keys
FULL_MASK_KEEP = 0.5  # "full" masks keep each key with this probability


def padding_lengths(B: int, S: int, seed: int = MASK_SEED) -> torch.Tensor:
    """Padded (hidden) keys per batch element, int64 [B], in [0, PAD_MAX_FRACTION * S).

    Stratified, one random draw inside each of B equal slices of that range: even a small batch
    covers it (mean ~12.5% of S) rather than landing wherever a few random draws fall."""
    g = torch.Generator().manual_seed(seed)  # on the CPU: the same pads on every device
    u = torch.rand(B, generator=g, dtype=torch.float64)
    return ((torch.arange(B, dtype=torch.float64) + u) / B * (PAD_MAX_FRACTION * S)).long()


def make_attn_mask(cfg: Config, device, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """The attn_mask of ``cfg.mask`` (see suites.MASKS), the one every implementation and the
    reference get. ``dtype`` (of an additive mask) defaults to the config's input dtype."""
    device = torch.device(device)
    B, H, L, S = cfg.B, cfg.H, cfg.L, cfg.S
    if cfg.mask == "none":
        return None
    if cfg.mask in ("padding", "padding-additive"):
        keep_len = S - padding_lengths(B, S)
        keep = (torch.arange(S) < keep_len[:, None]).view(B, 1, 1, S).to(device)
        if cfg.mask == "padding":
            return keep
        dtype = dtype or DTYPES[cfg.dtype or default_dtype(device)]
        return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    if cfg.mask == "full":
        g = torch.Generator(device=device).manual_seed(MASK_SEED)  # on the device: fast for big masks
        keep = torch.rand(B, H, L, S, generator=g, device=device) < FULL_MASK_KEEP
        # a row without any key has no softmax (backends differ: zeros or NaN): keep one at random
        keep.scatter_(-1, torch.randint(S, (B, H, L, 1), generator=g, device=device), True)
        return keep
    raise ValueError(f"unknown mask {cfg.mask!r}")


def _make_inputs(cfg: Config, device: torch.device, seed: int = 0):
    """(q, k, v, dout, attn_mask) for ``cfg`` (attn_mask None without a mask)."""
    dt = DTYPES[cfg.dtype]
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: fast for big inputs

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=device).to(dt)

    q = rnd(cfg.B, cfg.H, cfg.L, cfg.E).requires_grad_()
    k = rnd(cfg.B, cfg.Hkv, cfg.S, cfg.E).requires_grad_()
    v = rnd(cfg.B, cfg.Hkv, cfg.S, cfg.E).requires_grad_()
    dout = rnd(cfg.B, cfg.H, cfg.L, cfg.E)
    return q, k, v, dout, make_attn_mask(cfg, device, dt)


def run_suite(configs: Sequence[Config], device="cpu", *, impl_names: Optional[List[str]] = None,
              impls: Optional[List[Impl]] = None, time_budget_s: Optional[float] = None,
              repetitions: Optional[int] = None, progress: bool = True, timer: str = "auto",
              suite: str = "custom", rounds: int = 1,
              on_config_done: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Run every implementation on every configuration; returns the JSON-able result document.

    A failing implementation for one configuration is recorded with its error and the run goes
    on. ``repetitions`` times every measurement over that many repetitions: what is measured
    and reported does not depend on the machine's speed or load. Otherwise ``time_budget_s``
    bounds the whole run: repetitions are spread over what is left, and past 1.1x the budget the
    remaining measurements are skipped (recorded as such); with neither, each measurement
    takes about 0.3 s. ``rounds`` > 1 measures a configuration's implementations in turn that
    many times (combine_rounds), the budget shared among the rounds. ``on_config_done`` gets
    the partial document after every configuration (for incremental saves).
    """
    if repetitions is not None and time_budget_s is not None:
        raise ValueError("run_suite: give repetitions or time_budget_s, not both")
    if rounds < 1:
        raise ValueError(f"run_suite: rounds must be >= 1, got {rounds}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    configs = [c if c.dtype else c.with_dtype(default_dtype(device)) for c in configs]
    if impls is None:
        impls = make_impls(device, impl_names)
    t_start = time.perf_counter()
    doc: Dict[str, Any] = {
        "schema": "torch_flash_v100.bench/1",
        "suite": suite,
        "metadata": collect_metadata(device),
        "implementations": [
            {"name": im.name, "description": im.description, "available": im.available,
             "skip_reason": im.skip_reason, "kernel_path": im.kernel_path, "notes": im.notes}
            for im in impls],
        "results": [],
    }
    doc["metadata"]["time_budget_s"] = time_budget_s
    doc["metadata"]["repetitions"] = repetitions
    doc["metadata"]["timer"] = timer
    doc["metadata"]["rounds"] = rounds
    runnable = [im for im in impls if im.available]
    # "overhead" (variant vs plain times) only in documents of suites with mask/dropout variants
    has_variants = any(c.variant() for c in configs)

    def publish(entry: Dict[str, Any]):
        """A configuration is done: into the document, overhead rows current, incremental save."""
        doc["results"].append(entry)
        if has_variants:
            doc["overhead"] = overheads(configs, doc["results"], [im.name for im in runnable])
        if on_config_done:
            on_config_done(doc)
    _warm_device(device, sorted({c.dtype for c in configs}))
    n_items = len(configs) * len(runnable) * rounds
    done = 0
    bar = _Progress(n_items, progress)
    sticky: Optional[str] = None

    def measure_item(cfg: Config, im: Impl, inputs, ref) -> Dict[str, Any]:
        """One implementation on one configuration, within the suite's time budget."""
        nonlocal sticky
        elapsed = time.perf_counter() - t_start
        left = n_items - done
        if sticky:
            return {"status": "error", "error": sticky}
        if time_budget_s is not None and elapsed >= 1.1 * time_budget_s:
            return {"status": "skipped",
                    "reason": f"suite time budget of {time_budget_s:.0f}s exhausted"}
        if repetitions is not None:
            budget = None
        elif time_budget_s is None:
            budget = 0.3
        else:
            # ~half of an item's share goes to the timed repetitions; the rest is the
            # accuracy/memory runs, warm-ups and the reference
            budget = max(0.03, min(3.0, 0.5 * (time_budget_s - elapsed) / max(1, left)))
        failed = False
        try:
            r = measure(im, cfg, inputs, ref, device, budget, timer=timer, reps=repetitions)
        except Unsupported as e:
            failed = True
            r = {"status": "unsupported", "reason": _one_line(e)}
        except Exception as e:
            failed = True
            r = {"status": "error", "error": _short_error(e)}
            if device.type == "cuda" and _is_sticky_cuda_error(e):
                sticky = f"CUDA context unusable after an earlier error ({im.name}): {r['error']}"
        inputs[0].grad = inputs[1].grad = inputs[2].grad = None
        if failed:
            _cleanup(device, collect=True)
        return r
    try:
        for cfg in configs:
            entry: Dict[str, Any] = {"key": cfg.key(), "config": cfg.to_dict(), "flops_fwd": flops_fwd(cfg),
                                     "impls": {}, "speedup": {}}
            for im in impls:
                if not im.available:
                    entry["impls"][im.name] = {"status": "skipped", "reason": im.skip_reason}
            inputs = ref = None
            try:
                if sticky:
                    raise RuntimeError(sticky)
                inputs = _make_inputs(cfg, device)
                no_accuracy = accuracy_not_applicable(cfg)
                if no_accuracy:
                    entry["reference"] = no_accuracy
                else:
                    t0 = time.perf_counter()
                    q, k, v, dout, mask = inputs
                    ref = reference_grads(q, k, v, dout, cfg.causal, attn_mask=mask)
                    entry["reference_s"] = round(time.perf_counter() - t0, 3)
            except Exception as e:
                err = _short_error(e)
                if device.type == "cuda" and _is_sticky_cuda_error(e) and not sticky:
                    sticky = f"CUDA context unusable after an earlier error: {err}"
                entry["error"] = f"inputs/reference failed: {err}"
                for im in runnable:
                    entry["impls"][im.name] = {"status": "error", "error": entry["error"]}
                    done += rounds
                    bar.step(f"{cfg.key()} {im.name}", rounds)
                inputs = ref = None
                _cleanup(device, collect=True)
                publish(entry)
                continue
            per_round: Dict[str, List[Dict[str, Any]]] = {im.name: [] for im in runnable}
            for _ in range(rounds):
                for im in runnable:
                    if not any(_round_failed(r) for r in per_round[im.name]):
                        per_round[im.name].append(measure_item(cfg, im, inputs, ref))
                    done += 1  # an implementation failed in an earlier round is not measured again
                    bar.step(f"{cfg.key()} {im.name}")
            for im in runnable:
                entry["impls"][im.name] = combine_rounds(cfg, per_round[im.name])
            entry["speedup"] = _speedups(entry["impls"])
            del inputs, ref
            _cleanup(device)
            publish(entry)
    finally:
        bar.close()
        doc["metadata"]["elapsed_s"] = round(time.perf_counter() - t_start, 2)
    return doc


PHASES = ("fwd", "bwd", "fwdbwd", "graph_fwdbwd")


def _time_ratios(r: Dict[str, Any], base: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """time(r) / time(base) per phase either has timed (None where a time is missing)."""
    out = {}
    for ph in (ph for ph in PHASES if f"{ph}_ms" in r or f"{ph}_ms" in base):
        a, b = r.get(f"{ph}_ms"), base.get(f"{ph}_ms")
        out[ph] = (a / b) if (a and b) else None
    return out


def _speedups(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Optional[float]]]:
    """speedup[X][phase] = time(X) / time(flashv100): > 1 means flashv100 is faster."""
    fl = results.get(FLASH, {})
    if fl.get("status") != "ok":
        return {}
    return {name: _time_ratios(r, fl) for name, r in results.items()
            if name != FLASH and r.get("status") == "ok"}


def overheads(configs: Sequence[Config], results: Sequence[Dict[str, Any]],
              impl_names: Sequence[str]) -> List[Dict[str, Any]]:
    """One row per (mask/dropout variant, implementation) whose plain configuration (same shape,
    no mask, no dropout) has results too: ``fwd``/``bwd``/``fwdbwd`` = time(variant) / time(plain)
    (> 1: the variant costs time), and ``speedup`` = the variant's time(impl) / time(flashv100).
    Where either run is not ok, ``status`` says which and the ratios are absent."""
    by_key = {e["key"]: e for e in results}
    rows: List[Dict[str, Any]] = []
    for cfg in configs:
        ent, plain = by_key.get(cfg.key()), by_key.get(cfg.plain().key())
        if not cfg.variant() or ent is None or plain is None:
            continue
        for name in impl_names:
            r, p = ent["impls"].get(name, {}), plain["impls"].get(name, {})
            row: Dict[str, Any] = {"shape": plain["key"], "variant": cfg.variant(), "impl": name}
            if r.get("status") == "ok" and p.get("status") == "ok":
                row.update(_time_ratios(r, p))
                row["unstable"] = bool(r.get("unstable") or p.get("unstable"))
                if name in ent.get("speedup", {}):
                    row["speedup"] = ent["speedup"][name]
            else:
                row["status"] = (r.get("status", "-") if r.get("status") != "ok"
                                 else f"plain: {p.get('status', '-')}")
            rows.append(row)
    return rows


def dtype_name(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, str(dt))
