"""RMSNorm → gated MLP → down projection in FP8 (e4m3), opt-in: ``Options(fp8=True)``.

    h = rmsnorm(z)·γ;  out = (act(h·W_gᵀ) ⊙ h·W_uᵀ)·W_dᵀ

becomes

    q   = e4m3(z·rsqrt(mean(z²) + eps)·448/√N)       graph ops: the norm's own kernel
    p   = coda::fp8_gate_up(q; W_g, W_u, W_d, γ)        e4m3 GEMM, act(g)·u·c in bf16
    out = coda::fp8_down(e4m3(p); W_g, W_u, W_d, γ)    e4m3 GEMM (kernels/fp8.py)

with every scale known before the kernel that needs it (codegen/fp8.py says how and why:
the norm bounds the input's range, Cauchy–Schwarz the product's). This family runs before
the bf16 ones, only when ``options.fp8`` is set; an MLP it leaves (a training graph, an
input that is not a norm's output, a bias) goes on to them in bf16, and the report says
why. Legality and the bound: algebra/fp8.py.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import patterns
from ..algebra import fp8 as fp8_algebra
from ..algebra.decision import Rejection, Why
from ..canonical import meta
from ..capture import describe, model_path
from ..graph_utils import copy_meta, erase_if_dead
from ..codegen import fp8
from ..kernels import fp8 as fp8_ops
from ..rmsnorm_idiom import RmsNorm, find_rms_norms
from . import gated_mlp
from .family import Context, Decided

NAME = "fp8_mlp"
OPT_IN = "fp8"  # the pipeline runs this family only where options.fp8 is set
# (no size threshold: FP8 is the user's request, and its weights are half the bytes a
# bf16 GEMM reads at decode sizes; not measured below 8192 rows yet, BENCHMARKS.md)
FUSES_GEMMS = False


@dataclasses.dataclass(frozen=True)
class Match:
    gated: gated_mlp.Match
    norm: RmsNorm
    down: gated_mlp.Down

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.gated.mul)


class NoMatch(patterns.NoMatch):
    pattern = NAME


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    norms = {n.output: n for n in find_rms_norms(graph) if isinstance(n, RmsNorm)}
    out = []
    for m in gated_mlp.find(graph):
        if not isinstance(m, gated_mlp.Match):
            continue  # the gated family reports its own near misses
        norm = norms.get(m.gate.x)
        if norm is None:
            out.append(NoMatch(m.mul, Why(
                f"the gated MLP's input {describe(m.gate.x)} is not an RMSNorm's output: its "
                "rows have no bound to scale them by, and an amax pass per call is what FP8 "
                "here avoids; it runs in bf16", "fp8.input_not_normalised")))
            continue
        down = gated_mlp.down_projection_of(m)
        if isinstance(down, Why):
            out.append(NoMatch(m.mul, Why(
                f"no down projection to run in FP8 ({down}); gate and up go on as linears of "
                "the norm (fp8_linear), the rest in bf16", "fp8.no_down_projection")))
            continue
        out.append(Match(m, norm, down))
    return out


def describe_match(m: Match) -> dict:
    g = m.gated
    gate_up = [describe(g.gate.out)] if g.packed else [describe(g.gate.out),
                                                        describe(g.up.out)]
    return {"producer": describe(m.norm.output),
            "consumers": [*gate_up, describe(m.down.linear)]}


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    gate_up: object   # EpilogueProgram
    down: object


def decide(m: Match, context: Context) -> Decided:
    g = m.gated
    if meta(g.mul).requires_grad:
        return Decided.refuse(Rejection(Why(
            "a training graph: the bounds come from kept weights, which an optimizer "
            "changes every step; the MLP goes on to fp8_rowwise (FP8 forward and "
            "backward)", "fp8.training"), m.path))
    gate_up = fp8.gate_up_program(g.op, g.params)
    down = fp8.down_program(meta(m.down.linear).dtype)
    decision = fp8_algebra.decide(m, gate_up, down)
    return Decided.by(decision, Plan(m, gate_up, down))


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """The norm's quantised row at the norm, the FP8 MLP at the down projection."""
    m = plan.match
    g, norm, down = m.gated, m.norm, m.down
    with graph.inserting_after(norm.output):
        q = graph.call_function(fp8.quantize_normalized, (norm.input, norm.eps, norm.dim))
    sources = [g.gate.weight, *([] if g.packed else [g.up.weight]), down.weight,
               *([] if norm.weight is None else [norm.weight])]
    packed = ("up,gate" if g.up_first else "gate,up") if g.packed else ""
    how = (packed, norm.weight is not None, float(norm.weight_offset), int(norm.dim))
    with graph.inserting_before(down.linear):
        act = graph.call_function(fp8_ops.fp8_gate_up, (plan.gate_up.to_text(), q, sources, *how))
        a8 = graph.call_function(fp8.saturate, (act,))
        call = graph.call_function(fp8_ops.fp8_down, (plan.down.to_text(), a8, sources, *how))
    copy_meta(call, down.linear)
    down.linear.replace_all_uses_with(call)
    erase_if_dead(graph, [down.linear, *down.between, g.mul, g.act, *g.intermediates,
                          *g.gate.nodes, *g.up.nodes, *reversed(norm.nodes)])
    alive = set(graph.nodes)
    return {"programs": [plan.gate_up, plan.down],
            "materialised": [describe(n) for n in norm.nodes if n in alive],
            "weights": (f"e4m3 per output row, γ folded, kept by version (kernels/fp8.py); "
                        f"input e4m3(n·448/√{norm.dim}) from the norm's statistics; the "
                        "gated product scaled by its Cauchy–Schwarz bound per column, cast "
                        "to e4m3 between the GEMMs (one elementwise pass: QuACK's SM90 gated "
                        "store is 16-bit)")}
