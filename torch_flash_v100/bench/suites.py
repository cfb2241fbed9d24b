"""Benchmark configuration suites.

A configuration is (B, H, Hkv, L, S, E, causal, dtype) in the SDPA layout: q [B, H, L, E],
k/v [B, Hkv, S, E]. ``dtype=None`` means the device default (fp16 on CUDA, fp32 on CPU).
``mask`` (one of MASKS) and ``dropout`` (dropout_p) make a *variant* of that shape; the harness
builds the mask (``harness.make_attn_mask``). ``group`` and ``x`` only drive the plot:
configurations of one group are one line per implementation, plotted against the field named by ``x``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["Config", "MASKS", "SUITES", "suite_names", "get_suite", "flops_fwd"]

# attn_mask kinds (built by harness.make_attn_mask, the one place that makes masks):
#   none              no attn_mask
#   padding           bool keep-mask [B, 1, 1, S]: batch b keeps its first S - pad_b keys,
#                     pad_b spread over 0..25% of S (fixed seed)
#   padding-additive  the same as a float mask in the input dtype: 0 keep, -inf drop
#   full              bool [B, H, L, S], random keep (fixed seed), every row keeps a key
MASKS = ("none", "padding", "padding-additive", "full")


@dataclass(frozen=True)
class Config:
    B: int
    H: int
    Hkv: int
    L: int
    S: int
    E: int
    causal: bool
    dtype: Optional[str] = None
    group: str = ""
    x: str = "L"
    mask: str = "none"
    dropout: float = 0.0

    def __post_init__(self):
        if self.mask not in MASKS:
            raise ValueError(f"unknown mask {self.mask!r}; choose from {', '.join(MASKS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def key(self) -> str:
        heads = f"H{self.H}" if self.H == self.Hkv else f"H{self.H}/{self.Hkv}"
        seq = f"L{self.L}" if self.L == self.S else f"L{self.L} S{self.S}"
        c = " causal" if self.causal else ""
        dt = f" {self.dtype}" if self.dtype else ""
        v = f" {self.variant()}" if self.variant() else ""
        return f"B{self.B} {heads} {seq} E{self.E}{c}{dt}{v}"

    def variant(self) -> str:
        """Empty for plain attention, else e.g. "mask=padding dropout=0.1"."""
        parts = []
        if self.mask != "none":
            parts.append(f"mask={self.mask}")
        if self.dropout:
            parts.append(f"dropout={self.dropout:g}")
        return " ".join(parts)

    def plain(self) -> "Config":
        """The same shape without mask and dropout: what a variant's overhead is measured against."""
        return replace(self, mask="none", dropout=0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        # mask and dropout only where set, so that plain configurations' JSON is what it always was
        for name, default in (("mask", "none"), ("dropout", 0.0)):
            if d[name] == default:
                del d[name]
        return d

    def with_dtype(self, dtype: str) -> "Config":
        return replace(self, dtype=dtype)


def flops_fwd(c: Config) -> float:
    """FLOPs of the forward: two matmuls of 2*B*H*L*S*E each; causal counts as half the work.
    Masks and dropout do not change the count (a padding mask does not reduce it), so that a
    variant's TFLOP/s compare with its plain configuration's as inverse times."""
    f = 4.0 * c.B * c.H * c.L * c.S * c.E
    return f / 2 if c.causal else f


# Backward = 5 matmuls vs 2 in the forward (the FlashAttention-2 convention).
BWD_FLOP_RATIO = 2.5


def _both(make: Callable[[bool], List[Config]]) -> List[Config]:
    return make(False) + make(True)


def _seed(device: str) -> List[Config]:
    """The table of the V100 report this project answers (ai-bond/flash-attention-v100 test.py)."""
    out: List[Config] = []
    for causal in (False, True):
        for n in (16, 32, 64, 128, 256):
            out.append(Config(1, 1, 1, n, n, n, causal, group="B1 H1 L=S=E=n", x="L"))
        for h in (16, 32):
            for d in (16, 32, 64):
                out.append(Config(1, h, h, 1024, 1024, d, causal, group=f"B1 H{h} L1024, E sweep", x="E"))
        for d, shapes in ((128, ((16, 1024), (32, 2048), (32, 4096))),
                          (256, ((16, 1024), (32, 2048), (32, 4096)))):
            for h, n in shapes:
                out.append(Config(1, h, h, n, n, d, causal, group=f"B1 H16|32 E{d}", x="L"))
    return out


def _fa2(device: str) -> List[Config]:
    """The FlashAttention-2 paper sweep: B*L = 16k, H*E = 2048, L = 512..16k, E in {64, 128}."""
    out: List[Config] = []
    for causal in (False, True):
        for e in (64, 128):
            h = 2048 // e
            for n in (512, 1024, 2048, 4096, 8192, 16384):
                out.append(Config(16384 // n, h, h, n, n, e, causal, group=f"B*L=16k H{h} E{e}", x="L"))
    return out


def _gqa(device: str) -> List[Config]:
    """vLLM-style prefill: 32 query heads, 8 kv heads, E = 128, L = 1k..8k."""
    return [Config(1, 32, 8, n, n, 128, causal, group="B1 H32/8 E128", x="L")
            for causal in (False, True) for n in (1024, 2048, 4096, 8192)]


def _quick(device: str) -> List[Config]:
    """A handful of configurations; under a minute (smaller shapes on CPU)."""
    if device.startswith("cuda"):
        return [
            Config(1, 16, 16, 1024, 1024, 64, False, group="quick E64", x="L"),
            Config(1, 16, 16, 1024, 1024, 64, True, group="quick E64", x="L"),
            Config(2, 16, 16, 2048, 2048, 128, True, group="quick E128", x="L"),
            Config(1, 32, 8, 2048, 2048, 128, True, group="quick GQA 32/8 E128", x="L"),
            Config(1, 8, 8, 1000, 1100, 96, False, group="quick odd sizes", x="L"),
        ]
    return [
        Config(1, 4, 4, 256, 256, 64, False, group="quick E64", x="L"),
        Config(1, 4, 4, 256, 256, 64, True, group="quick E64", x="L"),
        Config(1, 4, 4, 512, 512, 64, True, group="quick E64", x="L"),
        Config(2, 8, 2, 256, 256, 64, True, group="quick GQA 8/2 E64", x="L"),
        Config(1, 2, 2, 100, 140, 40, False, group="quick odd sizes", x="L"),
    ]


def _tiny(device: str) -> List[Config]:
    """For CI tests: seconds on a CPU."""
    return [
        Config(1, 2, 2, 32, 32, 16, False, group="tiny", x="L"),
        Config(2, 4, 2, 24, 40, 8, True, group="tiny GQA", x="L"),
    ]


def _masks(device: str) -> List[Config]:
    """Overhead of a padding mask and of dropout: fa2 shapes (B*L = 16k, H*E = 2048), L in
    {1k, 4k}, E in {64, 128}, non-causal (older SDPA refuses attn_mask with is_causal), each plain,
    mask=padding, dropout=0.1 and both. On CPU the same variants on two tiny shapes (B*L = 256,
    H = 4, E = 32, L in {64, 128}), seconds in all."""
    if device.startswith("cuda"):
        shapes = [(16384 // n, 2048 // e, n, e) for e in (64, 128) for n in (1024, 4096)]
    else:
        shapes = [(256 // n, 4, n, 32) for n in (64, 128)]
    variants = [("none", 0.0), ("padding", 0.0), ("none", 0.1), ("padding", 0.1)]
    out: List[Config] = []
    for b, h, n, e in shapes:
        for mask, p in variants:
            c = Config(b, h, h, n, n, e, False, x="L", mask=mask, dropout=p)
            out.append(replace(c, group=f"H{h} E{e} {c.variant() or 'plain'}"))
    return out


# name -> (description, generator, default time budget in seconds for the whole suite)
SUITES: Dict[str, Tuple[str, Callable[[str], List[Config]], float]] = {
    "seed": ("V100 report table: (1,1,n,n,n) n=16..256; (1,16|32,1024,D) D=16,32,64; "
             "E=128/256 at 1k-4k; causal and not", _seed, 170.0),
    "fa2": ("FlashAttention-2 sweep: B*L=16k, H*E=2048, L=512..16k, E in {64,128}, causal and not",
            _fa2, 170.0),
    "gqa": ("GQA prefill: 32 query / 8 kv heads, E=128, L=1k..8k, causal and not", _gqa, 150.0),
    "quick": ("a handful of configurations, under a minute", _quick, 45.0),
    "tiny": ("two tiny configurations for CI tests", _tiny, 30.0),
    "masks": ("padding mask / dropout 0.1 overhead: B*L=16k, H*E=2048, L in {1k,4k}, E in {64,128}, "
              "non-causal; plain, mask=padding, dropout=0.1, both", _masks, 170.0),
}


def suite_names() -> List[str]:
    return list(SUITES)


def get_suite(name: str, device: str = "cpu", dtype: Optional[str] = None) -> List[Config]:
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    configs = SUITES[name][1](device)
    if dtype is not None:
        configs = [c.with_dtype(dtype) for c in configs]
    return configs
