"""The linears that read an RMSNorm's output as one FP8 (e4m3) GEMM, opt-in:
``Options(fp8=True)``.

    h = rmsnorm(z)·γ;  y_i = h·W_iᵀ (+ b_i)        (q/k/v, a packed qkv, the LM head)

becomes

    q = e4m3(z·rsqrt(mean(z²) + eps)·448/√N)       graph ops: the norm's own kernel
    y = coda::fp8_linear(q; W_1..W_n, b, γ)          one e4m3 GEMM, acc·ws[j] (+ b[j])
    y_i = y[..., columns of W_i]

with the weights stacked along their outputs, γ folded in, each row quantised (its
amax/448) and kept by version (kernels/fp8.py), and the input's one static scale from the
norm's bound |n_k| ≤ √N (codegen/fp8.py): no amax pass, the quantisation inside the
norm's kernel. It runs after the FP8 MLP (which takes a norm's gated pair and down
projection) and before the bf16 families: an attention block's q/k/v in FP8 rotate and
attend in graph ops (RoPE's bf16 fusion needs the projections as bf16 GEMMs). Legality
and the replay against torchao's row-wise recipe: algebra/fp8.py.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import patterns
from ..algebra import fp8 as fp8_algebra
from ..algebra.decision import Rejection, Why
from ..algebra.gated import upstream
from ..canonical import canon, meta
from ..capture import describe, model_path
from ..graph_utils import copy_meta, erase_if_dead
from ..codegen import fp8
from ..kernels import fp8 as fp8_ops
from ..rmsnorm_idiom import RmsNorm, find_rms_norms
from .family import Context, Decided

NAME = "fp8_linear"
OPT_IN = "fp8"  # the pipeline runs this family only where options.fp8 is set
FUSES_GEMMS = False

_VIEWS = {"view", torch.Tensor.view, torch.ops.aten.view.default}


@dataclasses.dataclass(frozen=True)
class Linear:
    node: fx.Node                 # the linear's output
    weight: fx.Node
    bias: fx.Node | None
    nodes: tuple[fx.Node, ...]    # what computes it from the norm's output and the weight


@dataclasses.dataclass(frozen=True)
class Match:
    norm: RmsNorm
    linears: tuple[Linear, ...]   # in graph order

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.linears[0].node)


class NoMatch(patterns.NoMatch):
    pattern = NAME


def _linear_of(node: fx.Node, x: fx.Node) -> Linear | Why | None:
    """``node`` as a linear of ``x`` (None: not a linear of it; Why: one FP8 cannot take)."""
    c = canon(node)
    if c is None or c.name != "linear" or c.args[0] is not x:
        return None
    w, b = c.args[1], c.args[2]
    why = fp8_algebra.linear_refusal(node, x, w, b)
    if why is not None:
        return why
    nodes = tuple(n for n in upstream(node, {x, w, b}) if n is not x)
    return Linear(node, w, b, nodes)


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    out, order = [], None
    for norm in find_rms_norms(graph):
        if not isinstance(norm, RmsNorm):
            continue
        found = [(u, _linear_of(u, norm.output)) for u in norm.output.users]
        linears = tuple(f for _, f in found if isinstance(f, Linear))
        # a linear this GEMM cannot take is reported and left out; the others still go
        out += [NoMatch(u, f) for u, f in found if isinstance(f, Why)]
        if linears:
            order = order or {n: i for i, n in enumerate(graph.nodes)}
            out.append(Match(norm, tuple(sorted(linears, key=lambda lin: order[lin.node]))))
    return out


def describe_match(m: Match) -> dict:
    return {"producer": describe(m.norm.output),
            "consumers": [describe(lin.node) for lin in m.linears]}


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    program: object   # EpilogueProgram


def decide(m: Match, context: Context) -> Decided:
    if any(meta(lin.node).requires_grad for lin in m.linears):
        return Decided.refuse(Rejection(Why(
            "a training graph: the bounds come from kept weights, which an optimizer "
            "changes every step; the linears go on to fp8_rowwise (FP8 forward and "
            "backward)", "fp8.training"), m.path))
    program = fp8.scaled_program(meta(m.linears[0].node).dtype,
                                 bias=any(lin.bias is not None for lin in m.linears))
    return Decided.by(fp8_algebra.decide_linears(m, program), Plan(m, program))


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """The norm's quantised row at the norm, one FP8 GEMM before the first linear, each
    linear's output its column range of the GEMM's."""
    m = plan.match
    norm, linears = m.norm, m.linears
    first = linears[0].node
    order = {n: i for i, n in enumerate(graph.nodes)}
    for lin in linears:  # a module attribute read after the first linear: read it there
        for t in (lin.weight, lin.bias):
            if t is not None and order[t] > order[first]:
                first.prepend(t)
    with graph.inserting_after(norm.output):
        q = graph.call_function(fp8.quantize_normalized, (norm.input, norm.eps, norm.dim))
    pairs, columns = fp8_algebra.stacked_columns(linears, lambda w: meta(w).shape[0])
    sources = [w for w, _ in pairs] + [b for _, b in pairs if b is not None]
    sources += [] if norm.weight is None else [norm.weight]
    biased = [b is not None for _, b in pairs]
    with graph.inserting_before(first):
        y = graph.call_function(fp8_ops.fp8_linear, (
            plan.program.to_text(), q, sources, biased, norm.weight is not None,
            float(norm.weight_offset), int(norm.dim)))
        copy_meta(y, first)
        copies = []
        for lin, (lo, hi) in zip(linears, columns):
            value = y
            if len(pairs) > 1:
                value = graph.call_function(torch.ops.aten.slice.Tensor, (y, -1, lo, hi))
                if not all(_reads_as_is(u, lin.node) for u in lin.node.users):
                    value = graph.call_method("contiguous", (value,))
                    copies.append(describe(lin.node))
            copy_meta(value, lin.node)
            lin.node.replace_all_uses_with(value)
    erase_if_dead(graph, [n for lin in reversed(linears) for n in lin.nodes]
                  + list(reversed(norm.nodes)))
    alive = set(graph.nodes)
    return {"programs": [plan.program],
            "materialised": [describe(n) for n in norm.nodes if n in alive],
            "weights": (f"e4m3 per output row, γ folded, {len(pairs)} weight(s) stacked in "
                        f"one GEMM, kept by version (kernels/fp8.py); input e4m3(n·448/"
                        f"√{norm.dim}) from the norm's statistics" + (
                            "; a contiguous copy of the columns of " + ", ".join(copies)
                            + " (a reader that may need contiguous rows: _reads_as_is)"
                            if copies else ""))}


def _reads_as_is(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` can read ``value`` as a column range of the GEMM's output (rows
    strided by the whole width): a view that keeps every leading dim and splits the last
    (``q.view(b, s, -1, d)``), and any torch op that takes strided tensors (reshape and
    the elementwise ones copy or stride as they need). A view that merges rows, a module
    or a custom op (which may assume a contiguous tensor) reads a contiguous copy."""
    if user.op == "call_module":
        return False
    target = user.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and \
            target.namespace not in ("aten", "prims"):
        return False
    if target not in _VIEWS:
        return True
    before, after = meta(value), meta(user)
    if user.args[0] is not value or before is None or after is None or \
            after.dim() < before.dim():
        return False
    lead = before.dim() - 1
    return all(statically_known_true(a == b) for a, b in
               zip(after.shape[:lead], before.shape[:lead]))
