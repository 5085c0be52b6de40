"""GEMM → gated activation: SwiGLU / GeGLU as one GEMM with a pairwise epilogue.

A gated MLP computes act(x·W_gᵀ) ⊙ (x·W_uᵀ): two GEMMs over the same input whose
outputs [M, I] are written, read back by an elementwise pass, and only then reduced to
the [M, I] product the down projection reads. The rewrite runs one GEMM over the
interleaved weight W_int = [g0, u0, g1, u1, ...] (W_int[2j] = W_g[j], W_int[2j+1] =
W_u[j]), so that each adjacent pair of output columns is one (gate, up) pair, and the
epilogue writes act(gate)·up at half width (QuACK's mode="acc_pair"):

    epilogue:  y = r[i]·acc[i, :] (+ b_int)          (r: a deferred rstd, if any)
               out[i, j] = act(y[i, 2j])·y[i, 2j+1]   (stored, [M, I])
               y                                      (stored only when training:
                                                       what the backward reads, and
                                                       what eager keeps as gate and up)

Spellings: two projections (Llama, Qwen2, Mistral, Gemma: ``act(gate_proj(x)) *
up_proj(x)``, either operand order) and one packed projection split in two (Phi-3:
``gate, up = gate_up_proj(x).chunk(2, dim=-1)``). A projection may already be a
rewritten norm consumer (``fused_linear`` with the rowscale program): the deferred rstd
is then applied before the activation, as the math requires (it is not linear), which
needs gate and up to carry the same r. Activations: silu (swiglu), gelu with the tanh
approximation (geglu: Gemma's gelu_pytorch_tanh) and exact gelu (geglu_erf).

Legality: algebra/gated.py. The weight re-layout is a graph op on every call
(codegen/layouts.interleave_rows), computed from the live parameters, or kept inside the GEMM
op with cache_relayouts (patterns/relaid_gemm.py).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
import torch.fx as fx

from .. import patterns, training_policy
from ..algebra import gated as gated_algebra
from ..algebra import sharding
from ..algebra.decision import Rejection, Why
from ..canonical import canon, meta, pair_clamp_limit, under_autocast
from ..capture import describe, model_path
from ..codegen import dgated_source
from ..codegen.program import EpilogueProgram, Kind, ProgramBuilder, parse
from ..codegen.reference import dtype_name
from ..graph_utils import (cast_for_gemm, chunk_half, copy_meta, erase_if_dead,
                           fused_linear_call, results, through_casts)
from ..kernels.gated_down import gated_down_linear
from .family import Context, Decided, no_kernel
from .relaid_gemm import relaid_gemm, relayout_node, weights_line

NAME = "gated_mlp"
# its rewrites replace GEMMs by fused ones, where they pay (size_policy.py)
FUSES_GEMMS = True
# ... from this many rows (size_policy.py; benchmarks/small_m.py --static and
# inference.py small_m on the H200, BENCHMARKS.md sixth session):
# the gated pair: its GEMM alone is ≤ 1.03x of cuBLAS + Inductor's epilogue from 16
# rows, but a forward with it fused from 16 rows ran 0.76x torch.compile at 128 rows and
# 0.91x at 512 (4-layer model from CUDA graphs; 1.01x at 1024): the per-call gate/up
# weight interleave, a pass over the weights, is the likely cost (not profiled). On the
# H100 (BENCHMARKS.md, thirty-eighth session) the same forward at 1024 rows, graphed,
# ran 0.92x / 0.97x torch.compile with it fused there and 1.01x / 1.06x without it, in
# two runs; from 2048 rows every variant ran alike (1.01-1.02x)
FUSED_FROM_ROWS = 2048
# ... and in a training step (training_policy.py) where its down projection takes the
# fused backward (kernels/gated_down.py; decide() refuses the match otherwise, with
# training.does_not_pay): against the attention rewrite + LM head alone, 129.1 vs 127.9
# ms per 1B step (+0.9%, inside the 2.0–3.2% spread between rounds) and 17.8 vs 19.8 GiB;
# with its backward as graph ops +2.8 ms and no memory saved (BENCHMARKS.md, ninth session)
PAYS_IN_TRAINING = True

_SILU = {F.silu, torch.nn.functional.silu, torch.ops.aten.silu.default, "silu"}
_GELU = {F.gelu, torch._C._nn.gelu, torch.ops.aten.gelu.default, "gelu"}
_RELU = {F.relu, torch.relu, torch.ops.aten.relu.default, "relu"}


@dataclasses.dataclass(frozen=True)
class Projection:
    """One GEMM output the gated product reads (or both halves of a packed one)."""
    out: fx.Node                   # the value read as gate / up (packed: the GEMM output)
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    r: fx.Node | None              # the deferred row scale of a rewritten norm consumer
    nodes: tuple[fx.Node, ...]     # what computes ``out`` (erased once dead)
    # tensor parallelism: ``out`` is the local shard (``to_local``) of a column-parallel
    # GEMM's DTensor output; the fused GEMM runs on the shards and is made local the same way
    local: bool = False


@dataclasses.dataclass(frozen=True)
class Match:
    mul: fx.Node
    act: fx.Node
    op: str                        # swiglu | geglu | geglu_erf
    gate: Projection
    up: Projection                 # packed: the same Projection as gate
    packed: bool
    gate_value: fx.Node | None = None   # packed: chunk(...)[0] / [1]
    up_value: fx.Node | None = None
    params: tuple[float, ...] = ()      # the pair op's literals (swiglu_clamp: the limit)
    clamps: tuple[fx.Node, ...] = ()    # swiglu_clamp: gate.clamp(max=l), up.clamp(-l, l)
    up_first: bool = False              # packed as [up; gate] (x-transformers' GLU)

    pattern = NAME

    @property
    def gate_reader(self) -> fx.Node:
        """What reads the gate value: its clamp, else the activation."""
        return self.clamps[0] if self.clamps else self.act

    @property
    def up_reader(self) -> fx.Node:
        return self.clamps[1] if self.clamps else self.mul

    @property
    def path(self) -> str:
        return model_path(self.mul)

    @property
    def relayout(self) -> str:
        """The re-layout (codegen/layouts.py) that interleaves this MLP's gate and up rows
        into the pair epilogue's [g0, u0, g1, u1, ...]."""
        if not self.packed:
            return "interleave_rows"
        return "interleave_halves_up_first" if self.up_first else "interleave_halves"

    @property
    def intermediates(self) -> list[fx.Node]:
        """Values eager writes that the fused GEMM never materialises."""
        if self.packed:
            return [*self.clamps, self.gate_value, self.up_value, self.gate.out, self.act]
        return [*self.clamps, self.gate.out, self.up.out, self.act]


class NoMatch(patterns.NoMatch):
    pattern = NAME


@dataclasses.dataclass(frozen=True)
class Down:
    """The down projection reading the gated product (its input), whose backward the
    fused one can take: dSwiGLU/dGeGLU in its dgrad GEMM's epilogue."""
    linear: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    between: tuple[fx.Node, ...]   # nodes between the weight and the GEMM (``w.T``)


def down_projection_of(m: Match) -> Down | Why:
    """The down projection ``m``'s product feeds, or why there is none to fuse with."""
    users = list(m.mul.users)
    lin = users[0] if len(users) == 1 else None
    c = canon(lin) if lin is not None else None
    if lin is not None and fused_linear_call(lin) and lin.args[1] is m.mul:
        return Why(f"the down projection {describe(lin)} is already a fused GEMM (a norm "
                   "producer): its backward is that family's", "gated.down_already_fused")
    if c is None or c.name != "linear" or c.args[0] is not m.mul:
        readers = ", ".join(describe(u) for u in users) or "nothing"
        return Why(f"the gated product is read by {readers}, not only by a projection's "
                   "input", "gated.no_down_projection")
    w, b = c.args[1], c.args[2]
    mw, mm = meta(w), meta(m.mul)
    if not isinstance(w, fx.Node) or mw is None or mw.dim() != 2 or \
            (b is not None and (not isinstance(b, fx.Node) or meta(b) is None
                                or meta(b).dim() != 1)):
        return Why(f"{describe(lin)}'s weight is not a 2-D tensor (or its bias not 1-D)",
                   "gated.down_weight")
    if m.gate.local or sharding.is_dtensor(w):
        return Why("tensor parallelism: the down projection runs on sharded weights "
                   "(its backward stays eager's)", "gated.down_sharded")
    if not under_autocast(lin) and any(meta(t).dtype != mm.dtype for t in (w, b)
                                       if t is not None):
        return Why(f"{describe(lin)} mixes dtypes with the product", "gated.down_dtypes")
    return Down(lin, w, b, tuple(n for n in gated_algebra.upstream(lin, {m.mul, w, b})
                                 if n is not lin))


def activation_of(node: fx.Node) -> tuple[str, fx.Node] | str | None:
    """(pair op, gate) when ``node`` is a gating activation of one tensor; a reason
    string for an activation the epilogue does not have; None when not an activation."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    key = node.target
    gate = node.args[0]
    if not isinstance(gate, fx.Node):
        return None
    if key in _SILU:
        return "swiglu", gate
    if key in _GELU:
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approx == "tanh":
            return "geglu", gate
        if approx == "none":
            return "geglu_erf", gate
        return Why(f"gelu(approximate={approx!r}) has no epilogue op", "gated.activation")
    return None


def dense_activation(node: fx.Node) -> str | None:
    """The epilogue op (codegen/op_table.py) of ``node`` when it is an activation of one
    tensor (a plain MLP's: GELU, exact or tanh, ReLU, SiLU), not in place; None otherwise
    (another activation, or an op that is not one)."""
    if node.op not in ("call_function", "call_method") or not node.args or \
            not isinstance(node.args[0], fx.Node):
        return None
    key, extra = node.target, node.args[1:]
    if key in _SILU or key in _RELU:
        inplace = node.kwargs.get("inplace", extra[0] if extra else False)
        if inplace is not False or len(extra) > 1:
            return None
        return "silu" if key in _SILU else "relu"
    if key in _GELU:
        approx = node.kwargs.get("approximate", extra[0] if extra else "none")
        return {"tanh": "gelu_tanh", "none": "gelu_erf"}.get(approx)
    return None


def _rowscale_call(node: fx.Node) -> fx.Node | None:
    """The fused_linear call behind ``node`` = getitem(call, 0) of a rowscale program."""
    if node.op != "call_function" or node.target is not operator.getitem \
            or node.args[1] != 0 or not isinstance(node.args[0], fx.Node):
        return None
    call = node.args[0]
    if not fused_linear_call(call) \
            or len(call.users) != 1 or not isinstance(call.args[0], str):
        return None
    return call if parse(call.args[0]).family == "rowscale" else None


def projection_of(node: fx.Node) -> Projection | None:
    """``node`` as the output of a GEMM: a plain linear or a rewritten rowscale one, or the
    local shard of a column-parallel one (ColwiseParallel: ``to_local`` of its DTensor
    output, through a ``redistribute`` to the placement it already has)."""
    local = _local_shard_of(node)
    if local is not None:
        inner, layout_nodes = local
        p = projection_of(inner)
        return None if p is None else dataclasses.replace(
            p, out=node, nodes=layout_nodes + p.nodes, local=True)
    c = canon(node)
    if c is not None and c.name == "linear":
        x, w, b = c.args
        if isinstance(x, fx.Node) and isinstance(w, fx.Node) and meta(w) is not None \
                and meta(w).dim() == 2 and (b is None or isinstance(b, fx.Node)):
            return Projection(node, x, w, b, None, (node,))
        return None
    call = _rowscale_call(node)
    if call is None:
        return None
    _, x, w, r, *b = call.args
    return Projection(node, x, w, b[0] if b else None, r, (node, call))


def _local_shard_of(node) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """(the DTensor value, the layout nodes) where ``node`` is its local shard and the
    value is split along its last dim only (each rank holds whole output columns, so an
    elementwise epilogue on the shard is the epilogue of the shard): no collective in
    between."""
    if not isinstance(node, fx.Node) or sharding.boundary_op(node) != "to_local":
        return None
    inner, nodes = node.args[0], (node,)
    if isinstance(inner, fx.Node) and sharding.boundary_op(inner) == "redistribute":
        if sharding.placements(inner.args[0]) != sharding.placements(inner):
            return None
        inner, nodes = inner.args[0], nodes + (inner,)
    pl, m = sharding.placements(inner), meta(inner)
    if not isinstance(inner, fx.Node) or pl is None or m is None or \
            any(not (p.is_shard() and p.dim % m.dim() == m.dim() - 1) for p in pl):
        return None
    return inner, nodes


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    out = []
    for node in list(graph.nodes):
        found = match_product(node)
        if found is not None:
            out.append(found)
    return out


def match_product(node: fx.Node) -> Match | NoMatch | None:
    """act(gate)·up at ``node`` (a Match), a near miss there (NoMatch), or None."""
    c = canon(node)
    if c is None or c.name != "mul":
        return None
    found = None
    for act, up in (c.args, c.args[::-1]):
        if not isinstance(act, fx.Node) or not isinstance(up, fx.Node):
            continue
        act, cast_after = through_casts(act)
        a = activation_of(act)
        if a is None:
            continue
        if isinstance(a, str):
            found = found or NoMatch(node, a)
            continue
        gate, cast_before = through_casts(a[1])
        if _clamped_projection(gate) is not None:  # DeepSeek-V4's dense MLP
            m = _clamped_match(node, act, a[0], gate, up)
            if isinstance(m, Match) or found is None:
                found = m
            if isinstance(m, Match):
                break
            continue
        if cast_after or cast_before:
            if projection_of(gate) is not None:
                found = found or NoMatch(node, Why(
                        "a cast changes the dtype between the gate GEMM, its activation and "
                        "the product: the fused epilogue would skip that rounding",
                        "gated.cast_between"))
            found = found or _adapter_miss(node, gate, up)
            continue
        up, cast_up = through_casts(up)
        if cast_up:
            continue
        m = _match(node, act, a[0], gate, up)
        if isinstance(m, Match) or found is None:
            found = m
        if isinstance(m, Match):
            break
    return found


def _clamped_projection(gate) -> fx.Node | None:
    """The GEMM output under ``gate`` where gate is a clamp of one, or of a half of a packed
    one (None otherwise: a routed expert's half is the routed experts' to take)."""
    c = canon(gate) if isinstance(gate, fx.Node) else None
    if c is None or c.name != "clamp" or not isinstance(c.args[0], fx.Node):
        return None
    v = c.args[0]
    half = chunk_half(v)
    packed = half is not None and projection_of(half[0].args[0]) is not None
    return v if projection_of(v) is not None or packed else None


def _clamped_match(mul, act, op, gate_clamp, up) -> Match | NoMatch | None:
    """DeepSeek-V4's clamped SwiGLU, silu(gate.clamp(max=l))·up.clamp(-l, l): the IR's
    swiglu_clamp over the two projections; a reason where the lanes are clamped otherwise."""
    limit = pair_clamp_limit(gate_clamp, up)
    if op != "swiglu" or limit is None or not isinstance(canon(up).args[0], fx.Node):
        return NoMatch(mul, Why(
            f"the gate {describe(gate_clamp)} is clamped before its activation, but not as "
            "the clamped SwiGLU silu(min(g, l))·clamp(u, −l, l) the epilogue has (the gate "
            "clamped above only, the up lane on both sides at the same l, SiLU)",
            "gated.clamped"))
    m = _match(mul, act, "swiglu_clamp", canon(gate_clamp).args[0], canon(up).args[0])
    if not isinstance(m, Match):  # None: the halves of no GEMM's output (routed experts')
        return m
    return dataclasses.replace(m, params=(limit,), clamps=(gate_clamp, up))


def _match(mul, act, op, gate_v, up_v) -> Match | NoMatch | None:
    half_g, half_u = chunk_half(gate_v), chunk_half(up_v)
    if half_g is not None or half_u is not None:
        if half_g is None or half_u is None or half_g[0] is not half_u[0]:
            return NoMatch(mul, Why(
                    "gate and up are not the two halves of one packed projection",
                    "gated.not_halves"))
        if half_g[1] == half_u[1]:
            return NoMatch(mul, Why("gate and up are the same half of one packed projection",
                                    "gated.same_half"))
        chunk = half_g[0]
        proj = projection_of(chunk.args[0])
        if proj is None:
            return None  # a chunked value that no GEMM produced: not this pattern
        proj = dataclasses.replace(proj, nodes=proj.nodes + (chunk,))
        return Match(mul, act, op, proj, proj, True, gate_value=gate_v, up_value=up_v,
                     up_first=half_u[1] == 0)
    g, u = projection_of(gate_v), projection_of(up_v)
    if g is not None and u is not None and g.local != u.local:
        return NoMatch(mul, Why("one of gate and up is a local shard of a sharded GEMM, the "
                                "other is not", "gated.mixed_sharding"))
    if g is None or u is None:
        if g is None and u is None:  # None: a product of values no GEMM made
            return _adapter_miss(mul, gate_v, up_v)
        which = "gate" if g is None else "up"
        return NoMatch(mul, Why(
                f"the {which} operand {describe(gate_v if g is None else up_v)} "
                "is not a GEMM output", "gated.not_a_gemm"))
    return Match(mul, act, op, g, u, False)


def _adapter_miss(mul: fx.Node, gate_v, up_v) -> NoMatch | None:
    """The near miss where gate and up are each a GEMM's output plus another value, as a
    low-rank adapter makes them (peft's lora.Linear: base(x) + s·B(A(x)), in the
    adapter's dtype and cast back), through casts either side of the sum; else None."""
    def gemm_plus_term(v) -> bool:
        c = canon(through_casts(v)[0]) if isinstance(v, fx.Node) else None
        return c is not None and c.name == "add" and any(
            isinstance(a, fx.Node) and projection_of(through_casts(a)[0]) is not None
            for a in c.args)
    if not (gemm_plus_term(gate_v) and gemm_plus_term(up_v)):
        return None
    return NoMatch(mul, Why(
        f"gate {describe(gate_v)} and up {describe(up_v)} are each a GEMM's output plus "
        "another term (a low-rank adapter's, as LoRA adds): the pair epilogue has no "
        "addend for it", "gated.gemm_plus_term"))


def gated_program(op: str, has_r: bool, has_bias: bool, dtype: torch.dtype,
                  keep_preact: bool, params: tuple[float, ...] = ()) -> EpilogueProgram:
    """y = acc (· r) (+ b_int); act = pairop(y) -> act (pair) [, y (tile) when training]."""
    p = ProgramBuilder(f"rowscale_{op}" if has_r else op, gemm=True, family="gated")
    v = p.scaled_acc(has_r, has_bias)
    p.output(p.emit(op, v, *params, name="act"), Kind.PAIR, dtype_name(dtype))
    if keep_preact:
        p.output(v, Kind.TILE, dtype_name(dtype))
    return p.build()


def trains(m: Match) -> bool:
    """Whether the graph computes a gradient through this MLP (its output needs one)."""
    return bool(meta(m.mul).requires_grad)


def build_program(m: Match) -> EpilogueProgram:
    has_bias = m.gate.bias is not None or m.up.bias is not None
    mm = meta(m.mul)
    return gated_program(m.op, m.gate.r is not None, has_bias, mm.dtype,
                         keep_preact=bool(mm.requires_grad), params=m.params)


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    program: EpilogueProgram
    cache_relayouts: bool          # keep the interleaved weights inside the op (inference)
    down: Down | None = None       # training: the down projection's backward fused
    down_note: tuple | None = None  # (label, decision): the report's note on it


# ---- the family's protocol (patterns/family.py) ------------------------------------------

def describe_match(m: Match) -> dict:
    return {"consumers": [describe(m.gate.out)] if m.packed else
            [describe(m.gate.out), describe(m.up.out)]}


def decide(m: Match, context: Context) -> Decided:
    program = build_program(m)
    # an intermediate width no kernel's pair store takes, a float32 MLP (on the GPU)
    why = None if m.gate.local else no_kernel(
        m.gate.out, "gated.no_kernel",
        (m.gate.weight,) if m.packed else (m.gate.weight, m.up.weight), program=program)
    if why is not None:
        return Decided.refuse(Rejection(why, m.path))
    decision = gated_algebra.decide(m, program)
    if not decision.accepted:
        return Decided.refuse(decision)
    cache = context.options.cache_relayouts and not trains(m)
    down, note = _down_decision(m, context)
    if note is not None and not note[1].accepted and note[1].kind.is_bug:
        return Decided.refuse(note[1])  # a checker bug is never a note
    if down is None and note is not None and context.options.fuse_in_training is None \
            and training_policy.computes_gradients(m):
        why = note[1].condition if isinstance(note[1], Rejection) else str(note[1])
        return Decided.refuse(Rejection(Why(
            "a training graph: the gated MLP pays for itself in a step only with its "
            f"backward in the down projection's dgrad GEMM, not taken here ({why}): left "
            "to eager's ops under Inductor; options.fuse_in_training=True fuses it anyway",
            "training.does_not_pay"), m.path))
    return Decided(decision, Plan(m, program, cache, down, note))


def _down_decision(m: Match, context: Context) -> tuple[Down | None, tuple | None]:
    """(the down projection whose backward is fused, or None; the report's note on it:
    (label, decision), None outside training graphs)."""
    if not trains(m):
        return None, None
    if not context.options.backward_epilogues:
        why = Why("options.backward_epilogues=False", "gated.backward_epilogues_off")
        return None, ("down projection: backward as graph ops", Rejection(why, m.path))
    if not dgated_source.supported(m.op):
        why = Why(f"no backward epilogue for {m.op}: the product's backward stays the "
                  "rules'", "gated.down_op")
        return None, ("down projection: backward as graph ops", Rejection(why, m.path))
    down = down_projection_of(m)
    if isinstance(down, Why):
        return None, ("down projection: backward as graph ops", Rejection(down, m.path))
    decision = gated_algebra.decide_down(m, down)
    if not decision.accepted:
        return None, ("down projection: backward as graph ops", decision)
    return down, (f"down projection {describe(down.linear)}: its backward's dgrad GEMM forms "
                  f"d{m.op} in its epilogue from the stored pre-activation (dh never written; "
                  "h recomputed there, not saved)", decision)


def claims_down_projection(product: fx.Node, options) -> Match | None:
    """The gated match whose product is ``product`` where this family will give its down
    projection the fused backward (the structural conditions of _down_decision), None
    otherwise. The residual + RMSNorm family, which runs first, asks before it takes that
    GEMM as a norm producer: one GEMM cannot carry both, and its backward would then be
    the norm's rule, not dSwiGLU in the dgrad epilogue (on the H200 the 1B step with both
    families lost that backward: a 5.2 ms activation-backward pass and h saved, 2 GiB;
    BENCHMARKS.md, seventeenth session)."""
    if NAME not in options.patterns or options.fuse_in_training is False or \
            not options.backward_epilogues:
        return None
    m = match_product(product)
    if not isinstance(m, Match) or not trains(m) or not dgated_source.supported(m.op):
        return None
    down = down_projection_of(m)
    if isinstance(down, Why) or gated_algebra.down_conditions(m, down)[1]:
        return None
    return m


def _fuse_down_backward(graph: fx.Graph, plan: Plan, y: fx.Node, p: fx.Node) -> None:
    """Replace the down projection by GatedDown on (y, p): the same GEMM forward, the
    CODA backward (kernels/gated_down.py)."""
    down = plan.down
    with graph.inserting_before(down.linear):
        y_, w, *bias = cast_for_gemm(graph, down.linear, y, down.weight,
                                     *([down.bias] if down.bias is not None else []))
        call = graph.call_function(gated_down_linear, (plan.match.op, y_, p, w,
                                                       bias[0] if bias else None))
    copy_meta(call, down.linear)
    call.meta.update({k: v for k, v in down.linear.meta.items() if k not in call.meta})
    down.linear.replace_all_uses_with(call)
    erase_if_dead(graph, [down.linear, *down.between])


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """Replace act(gate)·up by one GEMM over the interleaved weights."""
    m = plan.match
    g, u = m.gate, m.up
    with graph.inserting_before(m.mul):
        kind = m.relayout
        weights, biases = ((g.weight,), (g.bias,)) if m.packed else \
            ((g.weight, u.weight), (g.bias, u.bias))
        b = [relayout_node(graph, kind, (), *biases)] if any(t is not None for t in biases) \
            else []
        r = [g.r] if g.r is not None else []
        call = relaid_gemm(graph, plan.cache_relayouts, plan.program.to_text(), g.out, g.x,
                           kind, (), weights, r, b, [], trains=trains(m))
        copy_meta(call, m.mul)
        out, *preact = results(graph, call, 2 if plan.down is not None else 1, m.mul)
        if g.local:  # the product was the local shard: so is the fused GEMM's output
            out = graph.call_method("to_local", (out,))
    out.meta.update({k: v for k, v in m.mul.meta.items() if k not in out.meta})
    m.mul.replace_all_uses_with(out)
    if plan.down is not None:
        _fuse_down_backward(graph, plan, out, preact[0])
    erase_if_dead(graph, [m.mul, m.act, *m.intermediates, *g.nodes, *u.nodes])
    shown = {"programs": [plan.program],
             "weights": weights_line(plan.cache_relayouts, context.options)}
    if plan.down_note is not None:
        shown["notes"] = [plan.down_note]
    if g.r is not None:
        shown["producer"] = f"rows scaled by the deferred rstd {describe(g.r)}"
    return shown
