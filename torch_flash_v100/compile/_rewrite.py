"""The rewrite driver: every softmax / SDPA site of a graph through match -> plan -> emit.

Each site considered is logged on ``torch_flash_v100.compile`` (INFO), with the reason when it is
left alone, counted in ``counters["flashv100"]`` and kept in :data:`history`.
"""

from __future__ import annotations

import logging
import re

import torch
from torch.fx import Graph, Node

from ._emit import emit, softmax_to_last_dim, target_op
from ._fx_nodes import norm, val
from ._masks import MaskFacts
from ._match import Reject, match_sdpa, match_softmax
from ._plan import FusedCall, device_supported, plan_sdpa, plan_softmax

log = logging.getLogger("torch_flash_v100.compile")

#: (site, rewritten, how-or-why) for every site considered since import; tests and reports
#: read it (``history.clear()`` to start afresh).
history: list[tuple[str, bool, str]] = []


def _counters():
    from torch._dynamo.utils import counters
    return counters


def _where(node: Node) -> str:
    st = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', st)
    if frames:
        f, line, fn = frames[-1]
        return f"{f.rsplit('/', 1)[-1]}:{line} in {fn}"
    return "<unknown location>"


def describe(call: FusedCall, mask) -> str:
    if call.flash is not None:
        rules = call.flash
        desc = ["from SDPA" if call.origin == "sdpa" else f"scale={call.scale:.6g}"]
        if rules.window_right == 0:
            desc.append("causal=True")
        if (rules.window_left, rules.window_right) not in ((-1, -1), (-1, 0)):
            desc.append(f"window_size=({rules.window_left}, {rules.window_right})")
        if rules.softcap:
            desc.append(f"softcap={rules.softcap:.6g}")
        if rules.alibi is not None:
            desc.append("alibi_slopes=yes")
        if call.dropout_p:
            desc.append(f"dropout_p={call.dropout_p}")
        if call.enable_gqa:
            desc.append("gqa")
        return "flashv100._flash_forward(" + ", ".join(desc) + ")"
    note = f"; {call.note}" if call.note else ""
    if call.origin == "sdpa":
        return (f"flashv100.attention(from SDPA, is_causal={call.is_causal}{call.causal_note}, "
                f"mask={'yes' if mask is not None else 'no'}, enable_gqa={call.enable_gqa})"
                f"{note}")
    desc = [f"scale={call.scale:.6g}"]
    if call.is_causal:
        desc.append("is_causal=True")
    if mask is not None:
        desc.append(f"attn_mask={'bool' if val(mask).dtype == torch.bool else 'float'}")
    if call.dropout_p:
        desc.append(f"dropout_p={call.dropout_p}")
    if call.enable_gqa:
        desc.append("enable_gqa=True")
    return "flashv100.attention(" + ", ".join(desc) + ")" + note


class AttentionRewriter:
    """Rewrites the attention sites of one graph; ``results`` holds what happened to each."""

    def __init__(self, graph: Graph, force: bool = False):
        self.graph = graph
        self.force = force
        self.facts = MaskFacts()
        self.key = "example_value"
        for n in graph.nodes:
            if "example_value" in n.meta:
                break
            if "val" in n.meta:
                self.key = "val"
                break
        self.erased: set = set()
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.fused = 0
        self.shielded = 0  # softmaxes left alone but moved to the last dim (_shield_from_inductor)
        self.results: list[tuple[str, bool, str]] = []

    def run(self) -> int:
        for node in list(self.graph.nodes):
            if node in self.erased:
                continue
            op = norm(node)
            if op is None or op.name not in ("softmax", "sdpa"):
                continue
            site = f"{op.name} {node.name} at {_where(node)}"
            try:
                if op.name == "softmax":
                    call = plan_softmax(match_softmax(op), self.facts, self.force)
                else:
                    call = plan_sdpa(match_sdpa(op), self.facts, self.force)
                _, mask = emit(call, self.graph, self.key, self.erased, self.pos)
                how = describe(call, mask)
            except Reject as e:
                why = str(e)
                if op.name == "softmax" and self._shield_from_inductor(op):
                    why += ("; computed as a softmax over the last dim of a transposed view, "
                            "out of reach of Inductor's attention patterns")
                self._not_fused(site, why, logging.INFO)
                continue
            except Exception as e:  # a bug of ours must not break the user's compile
                self._not_fused(site, f"internal error in the matcher: {type(e).__name__}: {e}",
                                logging.WARNING, exc_info=True)
                continue
            self.fused += 1
            self.results.append((site, True, how))
            _counters()["flashv100"]["fused_attention"] += 1
            log.info("flashv100: rewritten: %s -> %s", site, how)
        return self.fused

    def _shield_from_inductor(self, sm) -> bool:
        """A softmax left alone over a dim that is not the last, where the pass owns attention:
        Inductor's attention fusion, which runs after us, ignores the softmax dim (see
        :func:`softmax_to_last_dim`)."""
        if not device_supported(val(sm.get("self")), self.force)[0]:
            return False
        if not softmax_to_last_dim(sm, self.graph, self.key, self.erased, self.pos):
            return False
        self.shielded += 1
        return True

    def _not_fused(self, site: str, why: str, level: int, exc_info: bool = False) -> None:
        self.results.append((site, False, why))
        log.log(level, "flashv100: NOT rewritten: %s: %s", site, why, exc_info=exc_info)
        _counters()["flashv100"]["not_fused"] += 1


def rewrite(graph: Graph, force: bool = False) -> AttentionRewriter:
    """Rewrite every attention subgraph of ``graph`` in place; returns the rewriter (results)."""
    rw = AttentionRewriter(graph, force=force)
    try:
        target_op()
    except Exception as e:  # the extension failed to load: leave the graph alone
        log.warning("flashv100: the flashv100 ops are unavailable (%s); no rewrite", e)
        return rw
    rw.run()
    history.extend(rw.results)
    del history[:-10000]
    if rw.fused or rw.shielded:
        graph.lint()
    return rw
