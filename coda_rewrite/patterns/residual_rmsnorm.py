"""GEMM → residual add → RMSNorm → GEMM(s): the row-scale deferral.

In a pre-norm decoder the norm sits between two GEMMs, three times per layer boundary
(attention out-proj → post-attention norm → gate/up; down-proj → next input norm →
q/k/v; last down-proj → final norm → LM head), and once with no GEMM before it (the first
layer's input norm reads the embedding). Eager reads and writes the residual stream
between them twice. The rewrite:

    producer GEMM epilogue:  z = x·W0ᵀ (+ b0) + residual      (the residual stream, kept)
                             h2 = z ⊙ γ                        (what the consumers read)
                             ss[i] = Σ_j z[i, j]²              (per-tile partials, merged)
    finaliser:               r[i] = rsqrt(ss[i] / d + eps)
    each consumer epilogue:  out = r[i] · (h2·Wkᵀ)[i, j] (+ bk[j])

which holds because r is one scalar per row and a GEMM that contracts over features
commutes with a row scale: (diag(r)·H)·W = diag(r)·(H·W) (algebra/row_scale.py proves it
and checks the side conditions on the matched graph). A norm with no producing GEMM gets
the same deferral from a row-wise program.

The graph keeps every value it had before: the residual stream comes out of the fused
producer and replaces the residual add; each accepted consumer GEMM is replaced by a
row-scaled GEMM; the original norm nodes are left where they were and removed only if
nothing reads them any more. So a normalised tensor that is also returned, or read by
something that is not a GEMM, is still computed exactly as eager computes it
(materialised), and every other reader of the region is untouched.

Legality: algebra/row_scale.py. The family's runtime helpers (a per-feature factor folded
into the live weights, a shift distributed as a bias) are below, with the graph surgery.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import patterns
from ..algebra import row_scale, sharding
from ..algebra.decision import Rejection, Why
from ..canonical import canon, inactive_dropout, meta
from ..capture import describe, model_path
from ..codegen import layouts
from ..codegen.program import ACC, EpilogueProgram, Kind, ProgramBuilder
from ..codegen.quack_source import Unlowerable, generate
from ..codegen.reference import dtype_name
from ..graph_utils import (cast_for_gemm, copy_meta, erase_if_dead, graph_replay, results,
                           same_meta, updated_between)
from ..kernels import ops
from ..rmsnorm_idiom import NearMiss, RmsNorm, find_rms_norms
from . import gated_mlp
from .family import Context, Decided, DeferredNorm, no_kernel

NAME = "residual_rmsnorm_gemm"
# its rewrites replace GEMMs by fused ones, where they pay (size_policy.py)
FUSES_GEMMS = True
# a match an earlier rewrite of this family made stale is decided on the values that
# replaced its nodes (Context.replaced: it reports what it could not fuse and
# why), not found again by the pipeline
FOLLOWS_REPLACED = True
# ... from this many rows (size_policy.py; benchmarks/small_m.py --static and
# inference.py small_m on the H200, BENCHMARKS.md sixth session):
# the norm producer: its finaliser is a second launch, 1.05x at 1024 rows of the 1B
# shape (N = 2048), 1.16–1.19x below; every family fused, the 4-layer forward runs 1.07x
# torch.compile at 2048 rows
FUSED_FROM_ROWS = 2048
# ... and in a training step (training_policy.py; +4.3 ms and
# +1.8 GiB per 1B step)
PAYS_IN_TRAINING = False
_CHAIN_DEPTH = 4


@dataclasses.dataclass
class Producer:
    linear: fx.Node
    add: fx.Node          # the residual add; the norm reads its value
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    residual: fx.Node
    scale: float = 1.0    # a scalar residual multiplier between the GEMM and the add
    between: tuple[fx.Node, ...] = ()   # identity ops and the multiplier, in order


@dataclasses.dataclass
class Consumer:
    linear: fx.Node
    chain: tuple[fx.Node, ...]   # nodes between the norm output and the GEMM, in order
    weight: fx.Node
    bias: fx.Node | None


@dataclasses.dataclass(frozen=True)
class Match:
    norm: RmsNorm
    producer: Producer | None
    producer_note: str                    # why there is no producing GEMM, if none (a Why
                                          # where the reason has a code)
    consumers: list[Consumer]
    other_readers: list[fx.Node]          # readers of the normalised value that are not GEMMs

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.norm.output) or model_path(self.norm.nodes[-1])


class NoMatch(patterns.NoMatch):
    pattern = NAME


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    results: list[Match | NoMatch] = []
    for norm in find_rms_norms(graph):
        if isinstance(norm, NearMiss):
            results.append(NoMatch(norm.node, norm.reason))
            continue
        consumers, others = consumers_of(norm.output)
        if not consumers:
            results.append(NoMatch(norm.output, _why_no_consumer(norm, others)))
            continue
        producer, note = _producer(norm)
        results.append(Match(norm, producer, note, consumers, others))
    return results


def _why_no_consumer(norm: RmsNorm, readers: list[fx.Node]) -> Why:
    """Why a norm no GEMM reads is left, as specifically as the graph says."""
    if any(n.op == "output" for n in readers):
        return Why("the normalised value leaves this graph (a graph output) and no GEMM in "
                   "it reads the value: its GEMMs are in the next graph. A graph break puts "
                   "them there, or DDP's bucket split (torch._dynamo.config.optimize_ddp = "
                   "'ddp_optimizer' cuts the graph at gradient-bucket boundaries; "
                   "'python_reducer' keeps one graph)", "row_scale.leaves_graph")
    if _post_sublayer(norm):
        return Why(f"a post-sublayer (\"sandwich\") norm: it normalises "
                   f"{describe(norm.input)}, a GEMM's output, and the residual add reads it; "
                   "no GEMM reads the normalised value, and its producer would need the "
                   "whole row's statistic before the add: an epilogue could only emit the "
                   "sums of squares, and the second pass over the output it still needs is "
                   "what Inductor's one kernel after the GEMM does (left by measurement: "
                   "BENCHMARKS.md, the sandwich norm)", "row_scale.post_sublayer")
    if _over_projection(norm):
        return Why(f"a norm over a projection's output ({describe(norm.input)}: a QK-norm, "
                   "say) that no GEMM reads: nothing to defer its row scale into; a "
                   "per-head QK-norm before a rotation goes into the projection's epilogue "
                   "with the rotation (the rope family's record for this attention says "
                   "whether it did)", "row_scale.over_projection")
    what = ", ".join(describe(n) for n in readers) or "nothing"
    return Why(f"no GEMM reads the normalised value (read by {what}): nothing to defer the "
               "row scale into", "row_scale.no_consumer_gemm")


def _post_sublayer(norm: RmsNorm) -> bool:
    """Gemma 2/3, OLMo 2, GLM-4: residual + norm(sublayer GEMM output)."""
    gemm = _through_upcast(norm.input)
    c = canon(gemm) if isinstance(gemm, fx.Node) else None
    return c is not None and c.name == "linear" and any(
        canon(u) is not None and canon(u).name == "add" for u in norm.output.users)


def _over_projection(norm: RmsNorm) -> bool:
    """The norm's input is a GEMM's output, up to views (Qwen3's per-head q_norm reads
    q_proj(x).view(..., heads, head_dim))."""
    node = _through_upcast(norm.input)
    for _ in range(3):
        c = canon(node) if isinstance(node, fx.Node) else None
        if c is not None and c.name == "linear":
            return True
        if not isinstance(node, fx.Node) or node.op != "call_method" or \
                node.target not in ("view", "reshape", "unflatten", "transpose"):
            return False
        node = _through_upcast(node.args[0])
    return False


def _producer(norm: RmsNorm) -> tuple[Producer | None, str]:
    z = norm.input
    c = canon(z)
    if z.op == "placeholder":
        return None, f"the norm's input {z.name} is a graph input (no producing GEMM here)"
    if c is None or c.name != "add":
        return None, f"the norm's input {describe(z)} is not a residual add"
    for lin, res in (c.args, c.args[::-1]):
        lin, scale, between = _through_scale_and_identity(lin)
        lin = _through_upcast(lin)
        sharded = _sharded_gemm_behind(lin)
        if sharded is not None:
            return None, sharded
        cl = canon(lin) if isinstance(lin, fx.Node) else None
        if cl is None or cl.name != "linear" or not isinstance(res, fx.Node):
            continue
        if len(lin.users) != 1:
            return None, (f"the GEMM output {describe(lin)} is also read elsewhere: fusing "
                          "the residual add would have to materialise it")
        ml, mr = meta(lin), meta(res)
        if ml is None or mr is None or tuple(ml.shape) != tuple(mr.shape):
            return None, "the residual is broadcast against the GEMM output"
        x, w, b = cl.args
        if meta(w) is None or meta(w).dim() != 2 or (b is not None and not isinstance(b, fx.Node)):
            return None, f"{describe(lin)} has a weight or bias that is not a 2-D/1-D tensor"
        return Producer(lin, z, x, w, b, res, scale, between), ""
    return None, f"neither operand of the residual add {describe(z)} is a GEMM"


def _through_scale_and_identity(node):
    """(the value under identity ops and scalar multipliers, the product of the
    multipliers, the nodes walked) for a residual add's operand: Phi-3's and Granite's
    ``residual + dropout(out) * multiplier`` with the dropout inactive (eval, or p = 0).
    Each step must be the only reader of what it reads: the fused producer no longer
    writes the GEMM's output. An active dropout stops the walk (it stays a reason)."""
    scale, between = 1.0, []
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method"):
        src = node.args[0] if node.args else None
        # every value between the GEMM and the add read only on this path: one read
        # elsewhere (a returned sublayer output) would need the GEMM a second time
        if not isinstance(src, fx.Node) or len(src.users) != 1 or len(node.users) != 1:
            break
        if inactive_dropout(node):
            pass
        else:
            c = canon(node)
            if c is None or c.name not in ("mul", "div"):
                break
            a, b = c.args
            if c.name == "mul" and isinstance(a, (int, float)) and not isinstance(a, bool):
                a, b = b, a
            if a is not src or not isinstance(b, (int, float)) or isinstance(b, bool) or \
                    (c.name == "div" and b == 0):
                break
            scale *= float(b) if c.name == "mul" else 1.0 / float(b)
        between.append(node)
        node = src
    return node, scale, tuple(reversed(between))


def _sharded_gemm_behind(node) -> Why | None:
    """Why a GEMM reached from the residual add through DTensor layout ops (the
    all-reduce or reduce-scatter after RowwiseParallel's o_proj / down projection)
    cannot carry the norm, or None where there is none."""
    seen, collectives = 0, []
    while isinstance(node, fx.Node) and seen < 4 and (
            sharding.boundary_op(node) or sharding.collective_op(node)):
        if sharding.collective_op(node) not in (None, "wait_tensor"):
            collectives.append(sharding.collective_op(node))
        node, seen = node.args[0], seen + 1
    cl = canon(node) if isinstance(node, fx.Node) else None
    if cl is None or cl.name != "linear" or not (seen or sharding.is_dtensor(node)):
        return None
    if collectives:
        return Why(f"(e) the GEMM {describe(node)} reaches the residual add through "
                   f"{', '.join(collectives)}: its epilogue would run before the collective "
                   "(on each rank's summand); the norm is fused after it instead (row-wise "
                   "program)", "collective.between")
    pl = sharding.placements(node) or ()
    if any(p.is_partial() for p in pl):
        return Why(f"(e) the GEMM {describe(node)} produces a partial sum (DTensor Partial "
                   "placement: a split contraction, reduced after it): the norm's statistic "
                   "needs the complete sum, ss(z₁ + z₂) ≠ ss(z₁) + ss(z₂); the norm is "
                   "fused after the reduce instead (row-wise program)", "dtensor.partial_sum")
    return Why(f"(e) the GEMM {describe(node)} reaches the residual add through DTensor "
               "layout ops: its epilogue would see a different layout than the add",
               "dtensor.producer_boundary")


def _through_upcast(node):
    """The GEMM under ``gemm(...).float()`` when that upcast is its only reader: the
    fused epilogue adds the residual to the float32 accumulator, which the upcast of
    the rounded GEMM output only approximates."""
    if not isinstance(node, fx.Node) or canon(node) is None or canon(node).name != "cast":
        return node
    src = node.args[0]
    ms, mo = meta(src), meta(node)
    if isinstance(src, fx.Node) and len(src.users) == 1 and ms is not None and \
            torch.finfo(mo.dtype).bits > torch.finfo(ms.dtype).bits:
        return src
    return node


def consumers_of(h: fx.Node) -> tuple[list[Consumer], list[fx.Node]]:
    """GEMMs that read ``h`` (possibly through a short chain of single-input ops: the
    algebra decides whether each chain keeps rows intact), and every other reader."""
    consumers, others = [], []

    def walk(node: fx.Node, chain: tuple[fx.Node, ...]):
        for u in node.users:
            c = canon(u)
            if c is not None and c.name == "linear" and c.args[0] is node \
                    and node not in (c.args[1], c.args[2]):
                consumers.append(Consumer(u, chain, c.args[1], c.args[2]))
            elif len(chain) < _CHAIN_DEPTH and _single_tensor_input(u, node):
                walk(u, chain + (u,))
            else:
                others.append(u)

    walk(h, ())
    return consumers, others


def _single_tensor_input(node: fx.Node, src: fx.Node) -> bool:
    """``node`` is a function of ``src`` alone, up to constants and broadcast vectors:
    it reads ``src`` as its first argument, or as one side of a binary op whose other
    side is a number or a tensor that does not vary along rows (a per-feature scale or
    bias). A residual add reads another whole tile: the walk stops there."""
    if node.op not in ("call_function", "call_method") or meta(node) is None \
            or src not in node.args[:2]:
        return False
    if len(node.args) == 2 and not node.kwargs and canon(node) is not None \
            and canon(node).name in ("add", "sub", "mul", "div"):
        other = node.args[1] if node.args[0] is src else node.args[0]
        mo = meta(other)
        return mo is None or all(x == 1 for x in mo.shape[:-1])
    return node.args[0] is src


# ---- programs -------------------------------------------------------------------------

def _dt(node: fx.Node) -> str:
    return dtype_name(meta(node).dtype)


def stat_dtype(norm: RmsNorm) -> str:
    """dtype of the deferred row scale r: float32, or float64 for a float64 model."""
    return "float64" if meta(norm.input).dtype == torch.float64 else "float32"


def norm_program(norm: RmsNorm, producer: Producer | None) -> EpilogueProgram:
    """The producer's epilogue (or, with no producer, a row-wise program)."""
    p = ProgramBuilder("residual_rmsnorm" if producer else "rmsnorm_rowscale",
                       gemm=producer is not None, family="residual_rmsnorm")
    if producer is not None:
        v = ACC
        if producer.bias is not None:
            v = p.add(v, p.operand("bias", Kind.PER_FEATURE))
        if producer.scale != 1.0:
            v = p.mul(v, producer.scale)
        z = p.add(v, p.operand("residual", Kind.TILE), name="z")
    else:
        z = p.operand("x", Kind.TILE)
    h2 = z
    if norm.weight is not None:
        g = p.operand("gamma", Kind.PER_FEATURE)
        if norm.weight_offset:
            g = p.add(g, norm.weight_offset, name="scale")
        h2 = p.mul(z, g, name="h2")
    eps = norm.eps if isinstance(norm.eps, float) else p.operand("eps", Kind.SCALAR)
    ss = p.row_sum(p.square(z), name="ss")
    r = p.rsqrt(p.add(p.div(ss, float(norm.dim)), eps), name="r")
    if producer is not None:
        p.output(z, Kind.TILE, _dt(producer.add))
    p.output(h2, Kind.TILE, _dt(norm.output))
    p.output(r, Kind.PER_ROW, stat_dtype(norm))
    return p.build()


def rowscale_program(consumer: Consumer, shifted: bool) -> EpilogueProgram:
    """out = r[i] · acc[i, j] (+ b[j]). ``shifted``: a shift s between the norm and the
    GEMM, distributed as the bias s·Wᵀ (+ the GEMM's own bias), so the program has a bias
    operand even where the GEMM had none."""
    p = ProgramBuilder("rowscale", gemm=True, family="rowscale")
    has_bias = consumer.bias is not None or shifted
    p.output(p.scaled_acc(True, has_bias), Kind.TILE, _dt(consumer.linear))
    return p.build()


def norm_operands(norm: RmsNorm) -> list[fx.Node]:
    """The norm's operands, in the order norm_program declares them after the GEMM's."""
    return ([norm.weight] if norm.weight is not None else []) + \
        ([norm.eps] if isinstance(norm.eps, fx.Node) else [])


@dataclasses.dataclass(frozen=True)
class Programs:
    """The programs that would replace a match: the producer's (or row-wise) one, one per
    consumer, and the graph values the norm program reads after the GEMM's operands."""
    norm: EpilogueProgram
    consumers: dict[fx.Node, EpilogueProgram]
    norm_operands: tuple[fx.Node, ...]


def build_programs(match: Match) -> Programs:
    """A shift between the norm and a consumer's GEMM becomes that consumer's bias."""
    return Programs(
        norm_program(match.norm, match.producer),
        {c.linear: rowscale_program(c, row_scale.has_shift(c, match.norm))
         for c in match.consumers},
        tuple(norm_operands(match.norm)))


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    programs: Programs
    accepted: tuple[Consumer, ...]


# ---- the family's protocol (patterns/family.py) ------------------------------------------

def describe_match(m: Match) -> dict:
    return {"producer": describe(m.producer.linear) if m.producer else m.producer_note,
            "consumers": [describe(c.linear) for c in m.consumers]}


def refresh(m: Match, context: Context) -> Match:
    """Bring a match found before earlier rewrites up to date: the residual add one norm's
    producer fuses is the residual input of the next norm. A producing GEMM that an
    earlier rewrite already turned into a fused op is not fused a second time (the norm
    then gets the row-wise program, and the report says why)."""
    cur = context.current
    norm = dataclasses.replace(m.norm, input=cur(m.norm.input))
    producer, note = m.producer, m.producer_note
    if producer is not None and (producer.linear in context.replaced
                                 or producer.add in context.replaced):
        producer, note = None, (f"the producing GEMM {producer.linear.name} already carries "
                                "another rewrite's epilogue")
    if producer is not None:
        producer = dataclasses.replace(producer, residual=cur(producer.residual),
                                       x=cur(producer.x))
    return dataclasses.replace(m, norm=norm, producer=producer, producer_note=note)


def _not_lowerable(program: EpilogueProgram) -> str | None:
    """Why ``program`` has no kernel (None: it has one)."""
    try:
        generate(program)
    except Unlowerable as e:
        return str(e)
    return None


def _producer_refused(m: Match) -> Why | None:
    """Why a producing GEMM that could take the norm's epilogue is left as it is: an
    update in place of its input before the residual add, where the fused producer runs
    (it would read the updated input, eager's GEMM the one before); or a program with no
    kernel (a biased producer: its bias lanes past N are not loaded, so the sum of squares
    over a ragged tile would fold them in), or on the GPU widths or a dtype no kernel
    takes (family.no_kernel): fused, it would run as the reference (a float32 GEMM on a
    GPU: 2 ms per call at gpt-oss's 8192 x 2880, H200)."""
    p = m.producer
    moved = updated_between([p.x, p.weight, p.bias], p.linear, p.add)
    if moved is not None:
        return Why(f"{describe(moved[0])} updates {describe(moved[1])} in place between the "
                   "producing GEMM and the residual add, where the fused producer would read "
                   "it: its GEMM is left as it is", "row_scale.producer_input_updated")
    program = norm_program(m.norm, p)
    try:
        generate(program)
    except Unlowerable as e:
        return Why(f"the producer's epilogue has no kernel ({e}): its GEMM is left as it is",
                   "row_scale.producer_unlowerable")
    # on the GPU: widths or a dtype no generated kernel takes (a down projection over an
    # intermediate width that is not a multiple of 8)
    return no_kernel(p.linear, "row_scale.producer_no_kernel", (p.weight,), program=program)


def _producer_left_to_gated(m: Match, context: Context) -> Why | None:
    """Why the producing GEMM is left to the gated MLP: it is the down projection whose
    backward that family fuses in this training graph (gated_mlp.claims_down_projection)."""
    if gated_mlp.claims_down_projection(m.producer.x, context.options) is None:
        return None
    return Why(f"the producing GEMM {describe(m.producer.linear)} is a gated MLP's down "
               "projection whose backward the gated family fuses in this training graph "
               "(the activation's derivative in its dgrad GEMM's epilogue, h not saved): one "
               "GEMM cannot carry both, and that backward saves more; its GEMM is left to "
               "it", "row_scale.producer_left_to_gated")


def decide(m: Match, context: Context) -> Decided:
    m = refresh(m, context)
    why = _producer_refused(m) if m.producer is not None else None
    if why is None and m.producer is not None:
        why = _producer_left_to_gated(m, context)
    if why is not None:  # the norm takes the row-wise program
        m = dataclasses.replace(m, producer=None, producer_note=why)
    programs = build_programs(m)
    decision, per_consumer, accepted = row_scale.decide(m, programs, m.norm.output.graph)
    if decision.accepted:
        decision, accepted = _kernels_take(m, decision, per_consumer, accepted)
    chains = {c.linear: bool(c.chain) for c in m.consumers}
    report = {"consumer_decisions": [(describe(n), d, chains[n])
                                     for n, d in per_consumer.items()],
              **describe_match(m)}
    if not decision.accepted:  # (check() refuses a match no consumer can take)
        return Decided(decision, None, decision, report)
    return Decided(decision, Plan(m, programs, tuple(accepted)), None, report)


def _kernels_take(m: Match, decision, per_consumer: dict, accepted: list):
    """(decision, accepted) without the consumers no generated kernel can take on the GPU
    (family.no_kernel): each is left to cuBLAS reading the norm as eager computes it,
    with its reason in ``per_consumer``; the match is refused where none is left."""
    kept = []
    for c in accepted:
        why = no_kernel(c.linear, "row_scale.no_kernel", (c.weight,))
        if why is None:
            kept.append(c)
        else:
            per_consumer[c.linear] = Rejection(why, describe(c.linear))
    if kept or not accepted:
        return decision, kept
    return row_scale.no_consumer_left(per_consumer[accepted[0].linear]), kept


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """Rewrite one match in place (see the module docstring)."""
    match, programs = plan.match, plan.programs
    norm, prod = match.norm, match.producer
    text = programs.norm.to_text()
    gamma = list(programs.norm_operands)
    if prod is not None:
        with graph.inserting_before(prod.add):
            x, w, *b = cast_for_gemm(graph, prod.linear, prod.x, prod.weight,
                                     *([prod.bias] if prod.bias is not None else []))
            call = graph.call_function(ops.fused_linear, (text, x, w, *b, prod.residual, *gamma))
            copy_meta(call, prod.linear)
            z, h2, r = results(graph, call, 3, norm.output)
            same_meta(h2, norm.output)
        prod.add.replace_all_uses_with(z)
        context.replaced[prod.add] = z
        z.meta.update({k: v for k, v in prod.add.meta.items() if k not in z.meta})
    else:
        with graph.inserting_before(norm.output.next):
            call = graph.call_function(ops.fused_rowwise, (text, norm.input, *gamma))
            copy_meta(call, norm.output)
            h2, r = results(graph, call, 2, norm.output)
            same_meta(h2, norm.output)

    like, call_fn = graph_replay(graph)
    replayed: dict = {}

    def like_once(node, src, x):
        # consumers that share a chain node share its replay: a collective between the
        # norm and its GEMMs (sequence parallelism's all-gather) runs once, as in eager.
        # Consumers go in graph order, so the replay sits before every GEMM that reads it.
        if (node, x) not in replayed:
            replayed[(node, x)] = like(node, src, x)
        return replayed[(node, x)]

    order = {n: i for i, n in enumerate(graph.nodes)}
    for c in sorted(plan.accepted, key=lambda c: order[c.linear]):
        program = programs.consumers[c.linear].to_text()
        with graph.inserting_before(c.linear):
            h2c, rc, scale, shift = row_scale.replay_chain(c.chain, norm.output, norm.dim, h2,
                                                           r, like_once, call_fn)
            weight, bias = c.weight, c.bias
            if scale is not None:  # a per-feature factor, folded into the live weights
                weight = graph.call_function(layouts.fold_scale, (c.weight, scale))
            if shift is not None:  # a shift after the norm, distributed: shift·Wᵀ (+ b)
                bias = graph.call_function(layouts.distribute_bias, (shift, c.weight, c.bias))
            x, w, *b = cast_for_gemm(graph, c.linear, h2c, weight,
                                     *([bias] if bias is not None else []))
            call = graph.call_function(ops.fused_linear, (program, x, w, rc, *b))
            copy_meta(call, c.linear)
            (out,) = results(graph, call, 1, c.linear)
        out.meta.update({k: v for k, v in c.linear.meta.items() if k not in out.meta})
        c.linear.replace_all_uses_with(out)
        context.replaced[c.linear] = out
        graph.erase_node(c.linear)
        erase_if_dead(graph, c.chain)

    context.deferred[norm.output] = DeferredNorm(h2, r, norm.dim, tuple(norm.nodes))
    dead_candidates = [*norm.nodes]
    if prod is not None:
        dead_candidates += [prod.add, *reversed(prod.between), prod.linear]
    erase_if_dead(graph, dead_candidates)
    alive = set(graph.nodes)
    return {"materialised": [describe(n) for n in norm.nodes if n in alive],
            "programs": [programs.norm, *(programs.consumers[c.linear] for c in plan.accepted)]}
