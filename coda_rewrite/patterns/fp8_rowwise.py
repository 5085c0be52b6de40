"""Every other linear in FP8 (e4m3) with row-wise dynamic scales, opt-in:
``Options(fp8=True)``.

    y = x·Wᵀ (+ b)

becomes

    r = amax(|x|, last dim)/448                 graph ops: fused by Inductor into the
    q = e4m3(x / r)                             kernel that writes x where it can
    y = coda::fp8_rowwise_linear(q, r; W, b)    e4m3 GEMM, acc·r[i]·ws[j] (+ b[j])

torchao's float8 row-wise inference recipe, with both scales in the GEMM's epilogue and
the e4m3 weight kept by version (kernels/fp8.py). It is for the linears no bound covers:
the attention's output projection (its input is the attention's output), an LM head
reading a slice of the final norm, a down projection the FP8 MLP could not take. It runs
after the two bound-scaled families (patterns/fp8_mlp.py, patterns/fp8_linear.py), which
need no amax, and before the bf16 families, so that with options.fp8 every linear of an
inference graph whose widths e4m3 GEMMs take runs in FP8; the report lists the others.

In a training graph (where the bound-scaled families step aside) it takes every linear,
and its backward GEMMs run in FP8 too: ``kernels/fp8.RowwiseLinear``, torchao's row-wise
training recipe (dx = dy·W and dW = dyᵀ·x on e4m3 operands scaled along the dims each GEMM
keeps; codegen/fp8.rowwise_grads). An LM head whose logits a cross-entropy reads stays
bf16 for the cross-entropy family, which fuses it with the loss (fp8.loss_head).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import patterns
from ..algebra import fp8 as fp8_algebra
from ..algebra.decision import Why
from ..canonical import canon, meta
from ..capture import describe, model_path
from ..graph_utils import copy_meta, erase_if_dead
from ..codegen import fp8
from ..kernels import fp8 as fp8_ops
from .family import Context, Decided

NAME = "fp8_rowwise"
OPT_IN = "fp8"  # the pipeline runs this family only where options.fp8 is set
FUSES_GEMMS = False
# e4m3 operands are K-major with 16-byte rows (kernels/quack_path.py's contract): K and N
# multiples of 16, else the reference would run on the GPU
ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Match:
    node: fx.Node                 # the linear's output
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.node)

    @property
    def in_features(self) -> int:
        return int(meta(self.weight).shape[1])


class NoMatch(patterns.NoMatch):
    pattern = NAME


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    out = []
    for node in graph.nodes:
        c = canon(node)
        if c is None or c.name != "linear":
            continue
        x, w, b = c.args
        why = fp8_algebra.linear_refusal(node, x, w, b)
        if why is not None:
            out.append(NoMatch(node, why))
        elif any(int(d) % ALIGN for d in meta(w).shape):
            out.append(NoMatch(node, Why(
                f"{describe(node)}'s weight is {tuple(meta(w).shape)}: an e4m3 GEMM needs both "
                f"widths in multiples of {ALIGN}; it runs in bf16", "fp8.alignment")))
        else:
            out.append(Match(node, x, w, b))
    return out


def describe_match(m: Match) -> dict:
    return {"producer": describe(m.x), "consumers": [describe(m.node)]}


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    program: object   # EpilogueProgram
    trains: bool      # a training graph: the backward GEMMs in FP8 too


def decide(m: Match, context: Context) -> Decided:
    trains = bool(meta(m.node).requires_grad)
    program = fp8.rowwise_program(meta(m.node).dtype, bias=m.bias is not None)
    return Decided.by(fp8_algebra.decide_rowwise(m, program, trains),
                      Plan(m, program, trains))


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """The row scales and the e4m3 rows where the linear was, then its FP8 GEMM."""
    m = plan.match
    with graph.inserting_before(m.node):
        r = graph.call_function(fp8.row_scales, (m.x,))
        q = graph.call_function(fp8.quantize_by, (m.x, r))
        text = plan.program.to_text()
        if plan.trains:
            y = graph.call_function(fp8_ops.trained_rowwise_linear,
                                    (text, q, r, m.x, m.weight, m.bias))
        else:
            sources = [m.weight] + ([] if m.bias is None else [m.bias])
            y = graph.call_function(fp8_ops.fp8_rowwise_linear, (text, q, r, sources))
    copy_meta(y, m.node)
    m.node.replace_all_uses_with(y)
    erase_if_dead(graph, [m.node])
    out = {"programs": [plan.program],
           "weights": "e4m3 per output row, kept by version (kernels/fp8.py); the input "
                      "scaled per row by its amax (graph ops, before the GEMM)"}
    if plan.trains:
        out["backward"] = ("dx = dy·W and dW = dyᵀ·x as e4m3 GEMMs, each operand scaled "
                           "along the dim its GEMM keeps (torchao's row-wise training "
                           "recipe); x and W kept, as eager keeps them")
    return out
