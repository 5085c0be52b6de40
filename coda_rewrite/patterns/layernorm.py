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

What it saves, the write of LN(z), is small beside the GEMM: measured on the H200
(BENCHMARKS.md, the LayerNorm regions), the deferral alone is level with torch.compile at
best. What pays is the plain MLP's activation in the same epilogue (GPT-NeoX, Falcon,
StarCoder2, MPT: GELU; OPT: ReLU; Nemotron, Persimmon: ReLU²): out = act(r·(acc − μ·s)
+ b'), the pre-activation
never written, in graphs that compute no gradient (a backward would read it): 2–9% over
torch.compile from 1024 tokens at Pythia's widths, with the folded weights kept between
calls. Made on every call instead, the fold is a pass over W (0.16–0.22 ms there) and
the rewrite loses. So on the GPU a norm is deferred where some consumer takes its
activation and the folded weights are kept (Options.cache_relayouts, whose memory cost,
one more copy of those weights, the user accepts there) and the graph is not replayed
from CUDA graphs (where nothing can be kept: a replay cannot see a weight change);
elsewhere it is left with the reason (``layernorm.fold_per_call``,
``layernorm.alone_does_not_pay``, ``layernorm.cuda_graphs``), unless
options.min_fused_rows asks for every fusion by size alone.

A norm whose output is also read by something other than an accepted GEMM (a fused
RoPE projection, a second branch, a returned value) is left as it is: eager's LN(z)
would still be written, and the statistics and the weight fold would only add work
(``layernorm.materialised_anyway``). This family runs last, after the ones that
rewrite a GEMM with their own epilogue (RoPE, the gated MLP, the loss): those pay more,
and their GEMMs are then no longer plain ones this family can take.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..algebra import layernorm as legality
from ..algebra import row_scale
from ..algebra.decision import Rejection, Why
from ..canonical import canon_name, meta
from ..capture import describe, model_path
from ..codegen import layouts
from ..codegen.program import ACC, EpilogueProgram, Kind, ProgramBuilder
from ..codegen.reference import dtype_name
from ..graph_utils import cast_for_gemm, copy_meta, erase_if_dead, graph_replay, results
from ..kernels import ops, relayout
from ..layernorm_idiom import LayerNorm, NearMiss, find_layer_norms
from . import NoMatch as _NoMatch
from . import family
from .family import Context, Decided, no_kernel
from .gated_mlp import dense_activation
from .residual_rmsnorm import Consumer, consumers_of

NAME = "layernorm_gemm"
# its rewrites replace GEMMs by fused ones, where they pay (size_policy.py)
FUSES_GEMMS = True
# a match an earlier rewrite of this family made stale is decided on the values that
# replaced its nodes (Context.replaced: it reports what it could not fuse and
# why), not found again by the pipeline
FOLLOWS_REPLACED = True
# ... from this many rows, where a consumer takes its activation and the folded weights
# are kept (size_policy.py; the module docstring says when else it does not pay; H200,
# BENCHMARKS.md, eighth session: the MLP input 0.94x torch.compile at 1024 rows of
# Pythia-6.9B's widths, 0.86–0.90x from 2048; not measured below 1024)
FUSED_FROM_ROWS = 1024
# ... and in a training step (training_policy.py): the MLP input's forward + backward ran
# 1.14x torch.compile's (its backward is a rule, and the fold is made every step)
PAYS_IN_TRAINING = False

@dataclasses.dataclass(frozen=True)
class Match:
    norm: LayerNorm
    consumers: list[Consumer]
    other_readers: list[fx.Node]    # readers of LN(z) that are not GEMMs
    # consumer GEMM -> (epilogue op, last node, nodes before it) of its activation
    activations: dict = dataclasses.field(default_factory=dict)

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.norm.output)


class NoMatch(_NoMatch):
    pattern = NAME


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    found: list[Match | NoMatch] = []
    for norm in find_layer_norms(graph):
        if isinstance(norm, NearMiss):
            found.append(NoMatch(norm.node, norm.reason))
            continue
        node = norm.output
        consumers, others = consumers_of(node)
        if not consumers:
            what = ", ".join(describe(n) for n in others) or "nothing"
            found.append(NoMatch(node, Why(
                f"no plain GEMM reads the normalised value (read by {what}): nothing to "
                "defer the statistics into", "layernorm.no_consumer_gemm")))
            continue
        found.append(Match(norm, consumers, others, _activations(consumers)))
    return found


def _only_reader(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].args and users[0].args[0] is node \
        else None


def _activations(consumers: list[Consumer]) -> dict:
    """The plain MLP activation each consumer's output goes to, where that is its only
    reader (gated_mlp.dense_activation: GELU, ReLU, SiLU; and ReLU squared, Nemotron's
    and Persimmon's relu2, where the ReLU's only reader squares it): consumer GEMM ->
    (epilogue op, the activation's last node, the nodes before it)."""
    out = {}
    for c in consumers:
        act = _only_reader(c.linear)
        op = dense_activation(act) if act is not None else None
        if op is None or meta(act) is None:
            continue
        out[c.linear] = (op, act, ())
        sq = _only_reader(act) if op == "relu" else None
        if sq is not None and canon_name(sq) == "square" and meta(sq) is not None:
            out[c.linear] = ("relu_sq", sq, (act,))
    return out


# ---- programs -------------------------------------------------------------------------

def centred_program(has_bias: bool, out_dtype: str, activation: str | None = None
                    ) -> EpilogueProgram:
    """out = r[i]·(acc − μ[i]·s[j]) (+ b'[j]), then the MLP's activation if one: the
    consumer's epilogue. The cancellation happens first, in float32, between two terms
    that each carry the mean; the activation reads the float32 value (eager's reads it
    rounded to the GEMM's dtype), and the output is rounded once. A program with an
    activation keeps no pre-activation: inference only (its backward rule refuses it)."""
    name = "layernorm_rowscale" + (f"_{activation}" if activation else "")
    p = ProgramBuilder(name, gemm=True, family="centred")
    r, mu = p.operand("r", Kind.PER_ROW), p.operand("mu", Kind.PER_ROW)
    s = p.operand("s", Kind.PER_FEATURE)
    v = p.mul(p.sub(ACC, p.mul(mu, s, name="mu_s"), name="t"), r, name="y")
    if has_bias:
        v = p.add(v, p.operand("bias", Kind.PER_FEATURE), name="y_b")
    if activation:
        v = p.emit(activation, v, name="act")
    p.output(v, Kind.TILE, out_dtype)
    return p.build()


def _has_bias(norm: LayerNorm, consumer: Consumer) -> bool:
    return consumer.bias is not None or norm.bias is not None or \
        legality.has_shift(consumer, norm)


def absorbed(match: Match) -> dict:
    """The activations the consumers' epilogues take: those of GEMMs that compute no
    gradient (the backward would read the pre-activation, which the program never
    writes)."""
    return {lin: act for lin, act in match.activations.items()
            if not meta(lin).requires_grad}


def build_programs(match: Match, acts: dict) -> dict[fx.Node, EpilogueProgram]:
    """One program per consumer; ``acts``: the activations they take (absorbed)."""
    return {c.linear: centred_program(
        _has_bias(match.norm, c),
        dtype_name(meta(acts[c.linear][1] if c.linear in acts else c.linear).dtype),
        acts[c.linear][0] if c.linear in acts else None) for c in match.consumers}


def _kept_fold(match: Match, context: Context) -> bool:
    """Whether the folded weights are kept inside the GEMM op: cache_relayouts, a graph
    computing no gradient, and nothing between the norm and the GEMMs that scales or
    shifts (the op folds γ and β alone)."""
    return context.options.cache_relayouts and not any(
        meta(c.linear).requires_grad for c in match.consumers) and not any(
        kind in ("scale", "shift") for c in match.consumers
        for kind, _ in row_scale.chain_kinds(c, match.norm))


def _no_kernel(match: Match, programs: dict) -> Why | None:
    """A consumer GEMM no generated kernel takes on the GPU (family.no_kernel: a float32
    model, widths under 16-byte rows): every reader of the norm is a consumer the rewrite
    replaces, so one such GEMM leaves the whole match (fused, it would run its reference
    at every call)."""
    for c in match.consumers:
        why = no_kernel(c.linear, "layernorm.no_kernel", (c.weight,),
                        program=programs[c.linear])
        if why is not None:
            return why
    return None


def _does_not_pay(match: Match, context: Context) -> Why | None:
    """Why a match on the GPU is left for speed (the module docstring: what was
    measured), or None. options.min_fused_rows asks for every fusion by size alone."""
    if context.options.min_fused_rows is not None or not family.on_gpu(meta(match.norm.input)):
        return None
    if any(meta(c.linear).requires_grad for c in match.consumers):
        return None  # a training graph: training_policy.py decided
    opts = context.options
    if opts.cudagraphs or opts.mode in ("reduce-overhead", "max-autotune"):
        return Why("the graph is replayed from CUDA graphs, where the folded weights cannot "
                   "be kept (a replay cannot see a weight change, so they are made again "
                   "on every replay: a pass over the weights, 1–3 ms at Pythia's widths on "
                   "the H200)", "layernorm.cuda_graphs")
    if opts.cache_relayouts and not _kept_fold(match, context):
        return Why("a per-feature scale or shift between the norm and a GEMM: the folded "
                   "weights would be made on every call (the kept fold takes γ and β "
                   "alone), a pass over the weights that costs more than the rewrite saves",
                   "layernorm.fold_per_call")
    if not _kept_fold(match, context):
        return Why("the folded weights W∘γ, s and b' would be made on every call, a pass "
                   "over the weights that costs more than the rewrite saves (H200: "
                   "0.16–0.22 ms at Pythia's MLP widths); Options(cache_relayouts=True) "
                   "keeps them between calls (one more copy of those weights)",
                   "layernorm.fold_per_call")
    if not absorbed(match):
        return Why("no consumer GEMM takes an activation into its epilogue: the deferral "
                   "alone saves one write of LN(z), level with torch.compile at best on the "
                   "H200 (BENCHMARKS.md); left to eager's LayerNorm",
                   "layernorm.alone_does_not_pay")
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    programs: dict[fx.Node, EpilogueProgram]
    activations: dict      # consumer GEMM -> (op, last node, nodes before) it takes
    kept_fold: bool        # the folded weights kept inside the op (relayout.py)


# ---- the family's protocol (patterns/family.py) ------------------------------------------

def describe_match(m: Match) -> dict:
    return {"consumers": [describe(c.linear) for c in m.consumers]}


def decide(m: Match, context: Context) -> Decided:
    """Legality's side conditions first (what the match is says more than a speed
    reason), then the GPU speed policy, then the witness."""
    acts = absorbed(m)
    programs = build_programs(m, acts)
    graph = m.norm.output.graph
    structure, per_consumer = legality.check(m, graph, acts)
    slow = (_no_kernel(m, programs) or _does_not_pay(m, context)) if structure.accepted \
        else None
    if slow is not None:
        structure = Rejection(slow, describe(m.norm.output))
    if structure.accepted:
        decision, per_consumer = legality.decide(m, programs, acts, graph)
    else:
        decision = structure
    report = {"consumer_decisions": [(describe(c.linear), per_consumer[c.linear],
                                      bool(c.chain)) for c in m.consumers
                                     if c.linear in per_consumer], **describe_match(m)}
    if not decision.accepted:
        return Decided(decision, None, decision, report)
    return Decided(decision, Plan(m, programs, acts, _kept_fold(m, context)), None,
                   report)


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
            if plan.kept_fold:  # W', s, b' inside the op, kept between calls
                (x,) = cast_for_gemm(graph, c.linear, zc)
                fused = graph.call_function(relayout.fused_linear_layernorm_kept, (
                    program, x, c.weight, c.bias, norm.weight, norm.bias, rc, muc))
            else:               # made in the graph on every call, differentiably
                weights = graph.call_function(layouts.layernorm_weights, (
                    c.weight, c.bias, norm.weight, norm.bias, scale, shift))
                w_fold, s, b_fold = results(graph, weights, 3, c.weight)
                x, w = cast_for_gemm(graph, c.linear, zc, w_fold)
                bias = [b_fold] if _has_bias(norm, c) else []
                fused = graph.call_function(ops.fused_linear,
                                            (program, x, w, rc, muc, s, *bias))
            copy_meta(fused, c.linear)
            (out,) = results(graph, fused, 1, c.linear)
        _, replaced, between = plan.activations.get(c.linear, (None, c.linear, ()))
        out.meta.update({k: v for k, v in replaced.meta.items() if k not in out.meta})
        replaced.replace_all_uses_with(out)
        context.replaced[replaced] = out
        for node in (replaced, *reversed(between)) if replaced is not c.linear else ():
            graph.erase_node(node)
        graph.erase_node(c.linear)
        erase_if_dead(graph, c.chain)
    erase_if_dead(graph, list(reversed(norm.nodes)))
    return {"materialised": [describe(norm.output)] if norm.output in set(graph.nodes) else [],
            "programs": list(dict.fromkeys(plan.programs[c.linear]
                                           for c in plan.match.consumers)),
            "weights": relayout_line(plan.kept_fold)}


def relayout_line(kept: bool) -> str:
    """What the report says of the folded weights."""
    if kept:
        return ("W∘γ, s and b' folded once, kept inside the GEMM op until W, b, γ or β "
                "changes (cache_relayouts; version-keyed)")
    return "W∘γ, s and b' folded from the live parameters on every call"
