"""LayerNorm → GEMM(s): the centred row-scale deferral.

GPT-NeoX, Falcon, Phi-2, StableLM, GPT-J, CodeGen, OPT, Persimmon, Cohere and others
normalise with a LayerNorm between GEMMs,

    LN(z) = (z − μ)·r ⊙ γ + β,    μ = mean_k z,   r = rsqrt(mean_k (z − μ)² + eps),

and eager writes LN(z) (rows × K) for the next GEMM to read back. The rewrite has the
GEMM read z itself:

    statistics (graph op, one read of z):  r[i], μ[i]                      float32
    weights (from the live parameters):    W' = W ∘ γ,  s_j = Σ_k W'[j, k],  b' = β·Wᵀ + b
    consumer epilogue:                     out = r[i]·(acc − μ[i]·s[j]) + b'[j],  acc = z·W'ᵀ

which holds because μ and r are constant along the row: (z − μ)·W'ᵀ = z·W'ᵀ − μ·s
(algebra/layernorm.py proves it, checks the side conditions on the graph and replays
it in float64). What it saves is the write of LN(z); the statistics read z once, as
eager's norm does, and Inductor fuses them with whatever makes z (the residual add).

Numerics: acc and μ·s are of the size of the mean and cancel down to the size of the
spread, so the float32 accumulation's error grows with |μ|/σ. Measured (benchmarks/
layernorm_numerics.py, DESIGN.md's numerics policy): a bf16 model stays within eager's
error against float64 up to |μ| = 500σ, where its own bf16 residual stream has already
lost all but a bit or two of the spread. That holds only when z reaches the GEMM
unrounded: where eager rounds after centring (a float32 z, a bf16 GEMM: autocast), the
rewrite would round z before centring, and it is refused (``layernorm.rounds_z``).

A norm whose output is also read by something other than an accepted GEMM (a fused
RoPE projection, a second branch, a returned value) is left as it is: eager's LN(z)
would still be written, and the statistics and the weight fold would only add work
(``layernorm.materialised_anyway``). This family runs last, after the ones that
rewrite a GEMM with their own epilogue (RoPE, the gated MLP, the loss): those pay more,
and their GEMMs are then no longer plain ones this family can take.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..algebra import layernorm as legality
from ..algebra.decision import Why
from ..canonical import constant, meta
from ..capture import describe, model_path
from ..codegen import layouts
from ..codegen.program import ACC, EpilogueProgram, Kind, ProgramBuilder
from ..codegen.reference import dtype_name
from ..graph_utils import cast_for_gemm, copy_meta, erase_if_dead, graph_replay, results
from ..kernels import ops, versioned
from . import NoMatch as _NoMatch
from .family import Context, Decided
from .residual_rmsnorm import Consumer, consumers_of

NAME = "layernorm_gemm"
# its rewrites replace GEMMs by fused ones, where they pay (size_policy.py)
FUSES_GEMMS = True
# ... from this many rows (size_policy.py; benchmarks/model_families.py layernorm on the
# H200, BENCHMARKS.md seventh-and-a-half session)
FUSED_FROM_ROWS = 2048
# ... and in a training step (training_policy.py): not measured in a step yet
PAYS_IN_TRAINING = False

_LAYER_NORMS = (F.layer_norm, torch.layer_norm)


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """F.layer_norm(input, (dim,), weight, bias, eps) over the last dim."""
    output: fx.Node           # the call
    input: fx.Node            # z
    weight: fx.Node | None    # γ
    bias: fx.Node | None      # β
    eps: float
    dim: int

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return (self.output,)


@dataclasses.dataclass(frozen=True)
class Match:
    norm: LayerNorm
    consumers: list[Consumer]
    other_readers: list[fx.Node]    # readers of LN(z) that are not GEMMs

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.norm.output)


class NoMatch(_NoMatch):
    pattern = NAME


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _layer_norm(node: fx.Node) -> LayerNorm | Why:
    z = _arg(node, 0, "input")
    shape = _arg(node, 1, "normalized_shape")
    weight, bias = _arg(node, 2, "weight"), _arg(node, 3, "bias")
    eps = constant(_arg(node, 4, "eps", 1e-5))
    mz = meta(z)
    if mz is None or meta(node) is None:
        return Why(f"{describe(node)}: its input is not a tensor the graph traced",
                   "layernorm.not_a_tensor")
    shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
    if len(shape) != 1 or shape[0] != mz.shape[-1]:
        return Why(f"{describe(node)} normalises over the last {len(shape)} dims "
                   f"{shape}: its statistic is not one per row of a GEMM's input",
                   "layernorm.not_last_dim")
    if eps is None:
        return Why(f"{describe(node)} has an eps known only at run time",
                   "layernorm.runtime_eps")
    d = int(mz.shape[-1])
    for t in (weight, bias):
        mt = meta(t)
        if t is not None and (mt is None or tuple(mt.shape) != (d,)):
            return Why(f"{describe(node)}'s affine parameter {describe(t)} is not a [{d}] "
                       "tensor", "layernorm.affine_shape")
    return LayerNorm(node, z, weight, bias, float(eps), d)


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    found: list[Match | NoMatch] = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _LAYER_NORMS:
            continue
        norm = _layer_norm(node)
        if isinstance(norm, Why):
            found.append(NoMatch(node, norm))
            continue
        consumers, others = consumers_of(node)
        if not consumers:
            what = ", ".join(describe(n) for n in others) or "nothing"
            found.append(NoMatch(node, Why(
                f"no plain GEMM reads the normalised value (read by {what}): nothing to "
                "defer the statistics into", "layernorm.no_consumer_gemm")))
            continue
        found.append(Match(norm, consumers, others))
    return found


# ---- programs -------------------------------------------------------------------------

def centred_program(has_bias: bool, out_dtype: str) -> EpilogueProgram:
    """out = r[i]·(acc − μ[i]·s[j]) (+ b'[j]): the consumer's epilogue. The cancellation
    happens first, in float32, between two terms that each carry the mean."""
    p = ProgramBuilder("layernorm_rowscale", gemm=True, family="centred")
    r, mu = p.operand("r", Kind.PER_ROW), p.operand("mu", Kind.PER_ROW)
    s = p.operand("s", Kind.PER_FEATURE)
    v = p.mul(p.sub(ACC, p.mul(mu, s, name="mu_s"), name="t"), r, name="y")
    if has_bias:
        v = p.add(v, p.operand("bias", Kind.PER_FEATURE), name="y_b")
    p.output(v, Kind.TILE, out_dtype)
    return p.build()


def _has_bias(norm: LayerNorm, consumer: Consumer) -> bool:
    return consumer.bias is not None or norm.bias is not None or \
        legality.has_shift(consumer, norm)


def build_programs(match: Match) -> dict[fx.Node, EpilogueProgram]:
    return {c.linear: centred_program(_has_bias(match.norm, c),
                                      dtype_name(meta(c.linear).dtype))
            for c in match.consumers}


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    programs: dict[fx.Node, EpilogueProgram]


# ---- the family's protocol (patterns/family.py) ------------------------------------------

def describe_match(m: Match) -> dict:
    return {"consumers": [describe(c.linear) for c in m.consumers]}


def decide(m: Match, context: Context) -> Decided:
    programs = build_programs(m)
    decision, per_consumer = legality.decide(m, programs, m.norm.output.graph)
    report = {"consumer_decisions": [(describe(n), d, bool(c.chain)) for c in m.consumers
                                     for n, d in [(c.linear, per_consumer.get(c.linear))]
                                     if d is not None], **describe_match(m)}
    if not decision.accepted:
        return Decided(decision, None, decision, report)
    return Decided(decision, Plan(m, programs), None, report)


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """Statistics after the norm (its grad mode), each consumer GEMM replaced where it
    stands; the norm is erased (every reader of it was a consumer)."""
    norm = plan.match.norm
    with graph.inserting_after(norm.output):
        stats = graph.call_function(layouts.layernorm_statistics, (norm.input, norm.eps))
    copy_meta(stats, norm.output)
    with graph.inserting_after(stats):
        r, mu = results(graph, stats, 2, norm.output)

    like, call_fn = graph_replay(graph)
    replayed: dict = {}

    def like_once(node, src, x):  # consumers sharing a chain node share its replay
        if (node, x) not in replayed:
            replayed[(node, x)] = like(node, src, x)
        return replayed[(node, x)]

    order = {n: i for i, n in enumerate(graph.nodes)}
    for c in sorted(plan.match.consumers, key=lambda c: order[c.linear]):
        program = plan.programs[c.linear].to_text()
        with graph.inserting_before(c.linear):
            zc, rc, scale, shift = legality.replay_chain(c.chain, norm, norm.input, r,
                                                         like_once, call_fn)
            _, muc, _, _ = legality.replay_chain(c.chain, norm, norm.input, mu, like_once,
                                                 call_fn)
            weights = graph.call_function(layernorm_weights, (
                c.weight, c.bias, norm.weight, norm.bias, scale, shift))
            w_fold, s, b_fold = results(graph, weights, 3, c.weight)
            x, w = cast_for_gemm(graph, c.linear, zc, w_fold)
            bias = [b_fold] if _has_bias(norm, c) else []
            fused = graph.call_function(ops.fused_linear, (program, x, w, rc, muc, s, *bias))
            copy_meta(fused, c.linear)
            (out,) = results(graph, fused, 1, c.linear)
        out.meta.update({k: v for k, v in c.linear.meta.items() if k not in out.meta})
        c.linear.replace_all_uses_with(out)
        context.replaced[c.linear] = out
        graph.erase_node(c.linear)
        erase_if_dead(graph, c.chain)
    erase_if_dead(graph, [norm.output])
    return {"materialised": [describe(norm.output)] if norm.output in set(graph.nodes) else [],
            "programs": list(dict.fromkeys(plan.programs[c.linear]
                                           for c in plan.match.consumers))}


# ---- graph-side runtime: the folded weights, kept between calls where that is safe ------

_WEIGHTS = "_coda_layernorm_weights"  # attribute of a consumer's weight: its memo


def layernorm_weights(weight, bias, gamma, beta, scale, shift):
    """codegen/layouts.layernorm_weights, kept between calls outside autograd: run on
    every call it is a pass over the consumer's weight (a read and a write of W', a
    reduction for s, a GEMV for b'), as large as the activation write the rewrite saves
    at a few hundred rows. Kept on the consumer's weight, keyed by the version counters
    of every tensor it reads (kernels/versioned.py). Where a gradient flows to them it is
    made on every call, and autograd takes the gradient back through it."""
    tensors = [t for t in (weight, bias, gamma, beta, scale, shift)
               if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return layouts.layernorm_weights(weight, bias, gamma, beta, scale, shift)
    numbers = tuple("tensor" if isinstance(t, torch.Tensor) else t
                    for t in (bias, gamma, beta, scale, shift))
    return versioned.kept(weight, _WEIGHTS, tensors, numbers, lambda: layouts.layernorm_weights(
        weight, bias, gamma, beta, scale, shift))[0]
