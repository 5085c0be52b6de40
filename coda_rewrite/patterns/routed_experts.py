"""Routed experts → two grouped GEMMs with epilogues (mixture-of-experts layers).

Hugging Face's default experts implementation (``grouped_mm``: Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V2/V3, GLM-4-MoE, ...; transformers/integrations/moe.py) sorts the
(token, expert) pairs by expert, gathers the routed rows and runs:

    x_g  = h[idx]                       (S × K written, then read)
    x_g.masked_fill_(sentinel, 0)       (expert-parallel sentinels; for the backward)
    p    = grouped_mm(x_g, W_guᵀ, offs).masked_fill(sentinel, 0)      (S × 2I)
    y    = act(p[:, :I]) · p[:, I:]                                   (S × I)
    o    = grouped_mm(y, W_dᵀ, offs).masked_fill(sentinel, 0) · w[:, None]

gpt-oss's spelling is the same pipeline with its weights stored [E, K, N] (grouped_mm's
own layout), gate and up interleaved (``p[..., ::2]``, ``p[..., 1::2]``), a per-expert
bias after each GEMM (``p.add_(b[ids])``, ids the sorted expert ids the offsets count)
and its clamped SwiGLU, ``(clamp(u, -l, l) + 1)·g·sigmoid(α·g)`` with g = min(gate, l)
(the IR's ``swiglu_oai``).

The rewrite (kernels/grouped.py, QuACK's variable-length GEMM):

    y = grouped GEMM of h with rows idx (the gather is the GEMM's row read: x_g is never
        written), [gate; up] halves of each expert's W_gu read interleaved in place,
        epilogue act(gate)·up                                          (S × I stored)
    o = grouped GEMM of y, epilogue w[s]·acc                            (S × K stored)

with each expert's bias, where there is one, added in the epilogue from its row of the
[E, N] table (the gather by expert id never written), and [E, K, N] weights read in
place (QuACK takes N-contiguous B). Where the gathered tokens are a normalised value
whose row scale the norm family deferred (h = h2 ⊙ r: patterns/residual_rmsnorm.py,
the producer's epilogue wrote h2 and r), the GEMM reads h2's rows and scales each routed
row by its token's r (r[idx], in the epilogue before the activation): a row scale moves
through a row selection, and h is never written.

A fill of rows before a row-local map is dead where the same rows are filled after it,
and grouped GEMMs are row-local: so the sentinel fill of x_g is dead (the gate/up output
is filled on the same rows), and so is that one (the down output is): only the last fill
stays, a graph op Inductor fuses into the scatter back. (Where the down output is not
filled, the gate/up fill by c stays, on the product, as a fill by act(c)·c.) The scatter back to
token order (inverse permutation, sum over top-k) stays a graph op for Inductor.

Legality: algebra/routed_experts.py (statements.prove_routed_experts, a float64 replay
of the matched nodes, and of their gradients in a training graph). In training the gated
GEMM also stores its pre-activation, the down projection's backward runs in its grouped
dgrad epilogue (kernels/grouped_dgated.py) and the gate/up GEMM's as rules
(kernels/grouped.GroupedGated); the scatter back after the experts is the next family's
(patterns/scatter_back.py). Where the graph computes the routing as transformers does
(offsets = cumsum(histc(...)), index = a sort's permutation // top_k) its bounds hold by
construction and the grouped launches check nothing on the device
(legality.routing_in_bounds; each such check was a handful of tiny kernels per launch,
enough to make a training step host-bound).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .. import patterns
from ..algebra import routed_experts as legality
from ..algebra import row_scale
from ..algebra.decision import Rejection, Why
from ..canonical import canon, constant, meta, pair_clamp_limit, transpose_property
from ..capture import describe, model_path
from ..codegen.program import EpilogueProgram, Kind, ProgramBuilder
from ..codegen.reference import dtype_name
from ..graph_utils import (chunk_half, copy_meta, erase_if_dead, graph_replay, mutated_value,
                           results, sole_user, through_casts)
from ..kernels.grouped import grouped_linear, static_violation
from ..kernels.grouped_dgated import grouped_down_linear
from . import family
from .family import Context, Decided, DeferredNorm
from .gated_mlp import activation_of

NAME = "routed_experts"
# its rewrites replace GEMMs by fused ones, where they pay (size_policy.py) ...
FUSES_GEMMS = True
# ... from this many routed rows (tokens × top-k; benchmarks/moe.py small, H200, the
# forward replayed from CUDA graphs against torch.compile's grouped_mm, every size fused,
# three alternating rounds). Since the routing's bounds are proved and the scatter back
# runs as gathers (fifteenth session): Qwen3-30B-A3B-shaped 1.071x / 1.172x / 1.276x at
# 16384 / 32768 / 65536 rows, gpt-oss-20b-shaped 1.070x / 1.020x / 1.126x at 8192 /
# 16384 / 32768, Mixtral-8x7B-shaped 0.980x / 0.987x / 1.011x at 4096 / 8192 / 16384,
# OLMoE-1B-7B-shaped 1.038x / 1.102x / 1.178x at 8192 / 16384 / 32768.
# Before those changes the Qwen3 layer ran 0.94-0.96x at 16384 rows and 0.99x at 32768,
# and 0.61-0.66x at 64 to 4096 rows (tenth and thirteenth sessions; nothing since makes
# the small sizes' kernels faster). From 16384 rows none of the four loses (Mixtral's
# 1.011x is even, within the rounds' noise)
FUSED_FROM_ROWS = 16384
# ... and in a training step (training_policy.py): forward + backward of the block at
# 8192 tokens, the routing's bounds proved (no device-side check per launch), the scatter
# back as gathers added in token order and its gradient a gather, against torch.compile's
# in alternating rounds: Qwen3-30B-A3B-shaped (65536 routed rows) 1.147x, gpt-oss-20b-
# shaped (32768) 1.099x, Mixtral-8x7B-shaped (16384) 1.035x (BENCHMARKS.md, fourteenth
# session; before these changes the fused step was host-bound: 0.98-1.01x, twelfth and
# thirteenth sessions). So training graphs fuse them from 32768 rows (Mixtral's 16384
# were measured at 1.01-1.04x, inside the rounds' spreads; smaller training batches not
# measured)
PAYS_IN_TRAINING = True
FUSED_FROM_ROWS_IN_TRAINING = 32768
FUSED_FROM_ROWS_FOR = {"in a training graph": FUSED_FROM_ROWS_IN_TRAINING}


@dataclasses.dataclass(frozen=True)
class Fill:
    """``value.masked_fill(mask, constant)`` (or the in-place ``masked_fill_``)."""
    node: fx.Node
    mask: fx.Node
    constant: float


@dataclasses.dataclass(frozen=True)
class ExpertBias:
    """``p + table[ids]`` or ``p.add_(table[ids])``: each routed row's expert's bias."""
    add: fx.Node
    table: fx.Node                 # [E, N]
    ids: fx.Node                   # the expert id of each routed row
    gathered: fx.Node              # table[ids]
    in_place: bool


@dataclasses.dataclass(frozen=True)
class Match:
    mul: fx.Node                   # the gated product, pair(gate, up)
    act_nodes: tuple[fx.Node, ...]  # between the lanes and the product (act(gate), ...)
    op: str                        # swiglu | geglu | geglu_erf | swiglu_oai
    params: tuple[float, ...]      # the pair op's literal parameters (alpha, limit)
    gate_up: fx.Node               # grouped_mm(x, W_guᵀ, offs)
    down: fx.Node                  # grouped_mm(y, W_dᵀ, offs)
    x: fx.Node                     # the gate/up GEMM's input (under identity casts)
    source: fx.Node | None         # h, where x = h[index] (the gather)
    index: fx.Node | None
    w_gate_up: fx.Node             # [E, 2I, K], or [E, K, 2I] where gate_up_kn
    w_down: fx.Node                # [E, K', I], or [E, I, K'] where down_kn
    gate_up_kn: bool
    down_kn: bool
    offsets: fx.Node
    chunk: fx.Node | None          # the [gate; up] split (None: interleaved lanes)
    gate: fx.Node
    up: fx.Node
    input_fill: Fill | None        # x.masked_fill_(M, c) before the first GEMM
    gate_up_bias: ExpertBias | None
    gate_up_fill: Fill | None      # p.masked_fill(M, c)
    down_bias: ExpertBias | None
    down_fill: Fill | None
    combine: fx.Node | None        # o · w[:, None]
    weight: fx.Node | None         # w [S]
    out: fx.Node                   # what the rewrite replaces (combine, fill or down)

    @property
    def interleaved(self) -> bool:
        return self.chunk is None

    @property
    def biases(self) -> list[ExpertBias]:
        return [b for b in (self.gate_up_bias, self.down_bias) if b is not None]

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.mul)


class NoMatch(patterns.NoMatch):
    pattern = NAME


def _fill(node) -> Fill | None:
    """``node`` as a masked_fill of a tensor by a constant, in place or not."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name not in ("masked_fill", "masked_fill_") or len(node.args) != 3 or node.kwargs:
        return None
    _, mask, value = node.args
    if not isinstance(mask, fx.Node) or isinstance(value, bool) or \
            not isinstance(value, (int, float)):
        return None
    return Fill(node, mask, float(value))


def _readers(node: fx.Node, bias: "ExpertBias | None") -> list[fx.Node]:
    """``node``'s readers but the bias added to it in place."""
    return [u for u in node.users if bias is None or not bias.in_place or u is not bias.add]


def _after(node: fx.Node, bias: "ExpertBias | None" = None) -> tuple[fx.Node, Fill | None]:
    """(the value read after ``node``, its fill): through a masked_fill that is the
    node's only reader."""
    users = _readers(node, bias)
    fill = _fill(users[0]) if len(users) == 1 else None
    if fill is not None and fill.node.args[0] is node and fill.node.target == "masked_fill":
        return fill.node, fill
    return node, None


def _expert_bias(node: fx.Node) -> tuple[fx.Node, ExpertBias | None]:
    """(the value after the bias, the bias) where ``node``'s output gets each routed row's
    expert bias ``table[ids]`` added, in place (``node.add_(b)``, read after by one
    node) or not (its only reader ``node + b``); (node, None) where it does not."""
    def gathered(b):
        c = canon(b) if isinstance(b, fx.Node) else None
        if c is None or c.name != "getitem" or len(b.users) != 1:
            return None
        mt, mi = meta(c.args[0]), meta(c.args[1])
        if mt is None or mt.dim() != 2 or mi is None or mi.dim() != 1 or \
                mi.dtype not in (torch.int32, torch.int64):
            return None
        return c.args[0], c.args[1]
    users = list(node.users)
    adds = [u for u in users if u.op == "call_method" and u.target == "add_"]
    if len(adds) == 1 and len(users) > 1:  # p.add_(b), every other reader after it
        add = adds[0]
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        found = gathered(add.args[1]) if len(add.args) == 2 and not add.kwargs and \
            add.args[0] is node and not add.users else None
        if found and all(order[u] > order[add] for u in users if u is not add):
            return node, ExpertBias(add, *found, add.args[1], True)
    if len(users) == 1:
        c = canon(users[0])
        if c is not None and c.name == "add" and node in c.args:
            b = c.args[1] if c.args[0] is node else c.args[0]
            found = gathered(b)
            if found:
                return users[0], ExpertBias(users[0], *found, b, False)
    return node, None


def _expert_weight(b) -> tuple[fx.Node, bool] | None:
    """(W, kn) for a grouped GEMM's second operand ``b``: W [E, N, K] where ``b`` is its
    transpose(-2, -1) (nn.Linear layout per expert, as most Hugging Face MoEs store
    gate_up_proj and down_proj; kn False), or ``b`` itself [E, K, N] (grouped_mm's own
    layout, gpt-oss's; kn True)."""
    if not isinstance(b, fx.Node):
        return None
    if b.op == "call_method" and b.target == "transpose" and \
            isinstance(b.args[0], fx.Node):
        w = meta(b.args[0])
        if w is not None and w.dim() == 3 and sorted(d % 3 for d in b.args[1:]) == [1, 2]:
            return b.args[0], False
    prop = transpose_property(b)  # W.mT: the last two dims swapped
    if prop is not None and prop[1] == "mT" and meta(prop[0]) is not None and \
            meta(prop[0]).dim() == 3:
        return prop[0], False
    mb = meta(b)
    return (b, True) if mb is not None and mb.dim() == 3 else None


def lane_of(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(p, 0 or 1) for ``p[..., k::2]`` / ``p[:, k::2]`` of a 2-D p (every other column)."""
    c = canon(node)
    if c is None or c.name != "getitem" or meta(c.args[0]) is None or \
            meta(c.args[0]).dim() != 2:
        return None
    idx = c.args[1] if isinstance(c.args[1], tuple) else (c.args[1],)
    if len(idx) != 2 or not (idx[0] is Ellipsis or idx[0] == slice(None)) or \
            not isinstance(idx[1], slice) or idx[1].step != 2 or idx[1].stop is not None:
        return None
    start = idx[1].start or 0
    return (c.args[0], start) if start in (0, 1) else None


def _is(node, name: str) -> bool:
    c = canon(node) if isinstance(node, fx.Node) else None
    return c is not None and c.name == name


def _other(node: fx.Node, one) -> object:
    a, b = canon(node).args
    return b if a is one else a


def swiglu_oai_of(gate: fx.Node, up: fx.Node):
    """(product, nodes between, (alpha, limit)) where ``gate`` and ``up`` are read only by
    gpt-oss's clamped SwiGLU: g = gate.clamp(max=l); u = up.clamp(-l, l);
    (u + 1)·(g·sigmoid(g·α)) (operands in any order); None otherwise."""
    g, u = sole_user(gate), sole_user(up)
    limit = pair_clamp_limit(g, u)
    if limit is None or len(g.users) != 2:
        return None
    scaled = next((n for n in g.users if _is(n, "mul") and constant(_other(n, g))), None)
    glu = next((n for n in g.users if n is not scaled), None)
    sig = sole_user(scaled) if scaled is not None else None
    if sig is None or not _is(sig, "sigmoid") or canon(sig).args[0] is not scaled or \
            not _is(glu, "mul") or set(canon(glu).args) != {g, sig}:
        return None
    alpha = constant(_other(scaled, g))
    shifted = sole_user(u)
    if shifted is None or not _is(shifted, "add") or constant(_other(shifted, u)) != 1.0:
        return None
    out = sole_user(glu)
    if out is None or sole_user(shifted) is not out or not _is(out, "mul") or \
            set(canon(out).args) != {glu, shifted}:
        return None
    return out, (g, u, scaled, sig, glu, shifted), (alpha, limit)


def swiglu_clamp_of(gate: fx.Node, up: fx.Node):
    """(product, nodes between, (limit,)) where ``gate`` and ``up`` are read only by
    DeepSeek-V4's clamped SwiGLU: g = gate.clamp(max=l); u = up.clamp(-l, l);
    silu(g)·u (operands in any order); None otherwise."""
    g, u = sole_user(gate), sole_user(up)
    limit = pair_clamp_limit(g, u)
    if limit is None:
        return None
    act = sole_user(g)
    a = activation_of(act) if act is not None else None
    if a is None or isinstance(a, str) or a != ("swiglu", g):
        return None
    out = sole_user(act)
    if out is None or sole_user(u) is not out or not _is(out, "mul") or \
            set(canon(out).args) != {act, u}:
        return None
    return out, (g, u, act), (limit,)


def pair_of(gate: fx.Node, up: fx.Node):
    """(op, product, nodes between, params) of the gated product of the two lanes, a
    reason where the lanes are not read by one."""
    oai = swiglu_oai_of(gate, up)
    if oai is not None:
        return "swiglu_oai", oai[0], oai[1], oai[2]
    clamped = swiglu_clamp_of(gate, up)
    if clamped is not None:
        return "swiglu_clamp", *clamped
    for half in (gate, up):
        if len(half.users) > 1:
            return Why(f"{describe(half)} has {len(half.users)} readers: the fused GEMM "
                       "never writes it", "moe.intermediate_read")
    act = sole_user(gate)
    a = activation_of(act) if act is not None else None
    if a is None or isinstance(a, str) or a[1] is not gate:
        return Why(f"the gate lane {describe(gate)} is not read by one gating activation "
                   "(silu, gelu) or gpt-oss's clamped SwiGLU only", "moe.activation")
    mul = sole_user(act)
    cm = canon(mul) if mul is not None else None
    if cm is None or cm.name != "mul" or set(cm.args) != {act, up}:
        return Why("act(gate) is not multiplied by the up lane alone", "moe.not_gated")
    return a[0], mul, (act,), ()


def _gather(x: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """(h, index) where ``x`` is ``h[index]`` with a 1-D integer index over h's rows."""
    c = canon(x)
    if c is None or c.name != "getitem":
        return None, None
    h, idx = c.args
    mh, mi = meta(h), meta(idx)
    if mh is None or mh.dim() != 2 or mi is None or mi.dim() != 1 or \
            mi.dtype not in (torch.int32, torch.int64):
        return None, None
    return h, idx


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    out = []
    for node in graph.nodes:
        c = canon(node)
        if c is None or c.name != "grouped_mm":
            continue
        found = _match(node, c.args)
        if found is not None:
            out.append(found)
    return out


def _match(gu: fx.Node, args) -> Match | NoMatch | None:
    """The experts' MLP whose gate/up GEMM is ``gu``; None where ``gu`` is not one (the
    down GEMM, or a grouped GEMM of another kind: not this pattern)."""
    x_cast, b, offsets = args
    w_gu = _expert_weight(b)
    p, gu_bias = _expert_bias(gu)
    p, gu_fill = _after(p, gu_bias)
    readers = _readers(p, gu_bias)
    chunks = [u for u in readers if u.target in ("chunk", torch.chunk)]
    lanes = sorted(((lane[1], u) for u in readers if (lane := lane_of(u)) and lane[0] is p),
                   key=lambda t: t[0])
    if not chunks and [k for k, _ in lanes] != [0, 1]:
        if _after_grouped_gemm(x_cast):
            return None  # a down projection: its match is its gate/up GEMM's
        return NoMatch(gu, Why(f"the grouped GEMM's output {describe(p)} is not split into "
                               "[gate; up] halves by chunk(2, -1) or into interleaved lanes "
                               "p[..., 0::2], p[..., 1::2]", "moe.not_halves"))
    ch = chunks[0] if chunks else None
    if len(readers) > (1 if ch is not None else 2):
        other = next(u for u in readers if u is not ch and all(u is not v for _, v in lanes))
        updated = mutated_value(other) is p
        how = "updated in place" if updated else "read"
        return NoMatch(gu, Why(f"the gate/up output {describe(p)} is also {how} by "
                               f"{describe(other)}: the fused GEMM never writes it",
                               "moe.in_place" if updated else "moe.intermediate_read"))
    if ch is not None:
        halves = sorted((chunk_half(u) or (None, -1))[1] for u in ch.users)
        if halves != [0, 1] or len(ch.users) != 2:
            return NoMatch(gu, Why(f"{describe(ch)} is not read as two halves [gate; up] of "
                                   "the last dim", "moe.not_halves"))
        gate, up = sorted(ch.users, key=lambda u: chunk_half(u)[1])
    else:
        (_, gate), (_, up) = lanes
    pair = pair_of(gate, up)
    if isinstance(pair, Why) and ch is None and not isinstance(pair_of(up, gate), Why):
        return NoMatch(gu, Why(f"the gate is the odd lane of {describe(p)}: the kernel pairs "
                               "(gate, up) as columns (2j, 2j + 1)", "moe.not_halves"))
    if isinstance(pair, Why):
        return NoMatch(gu, pair)
    op, mul, act_nodes, params = pair
    if w_gu is None:
        return NoMatch(gu, Why(f"the gate/up weight {describe(b)} is not a [E, K, 2I] "
                               "expert weight or the transpose of a [E, 2I, K] one",
                               "moe.weight_layout"))
    if w_gu[1] and ch is not None:
        return NoMatch(gu, Why(f"the gate/up weight {describe(b)} is stored [E, K, 2I] and "
                               "split into [gate; up] halves: the kernel reads halves "
                               "interleaved from K-contiguous rows only (QuACK's concat "
                               "layout), and anything else would run as the reference",
                               "moe.weight_layout"))
    if gu_bias is not None and ch is not None:
        return NoMatch(gu, Why(f"{describe(gu_bias.gathered)} biases [gate; up] halves: the "
                               "kernel's columns are the halves interleaved (QuACK's concat "
                               "layout interleaves the weight rows, not a bias), so it "
                               "would run as the reference", "moe.weight_layout"))
    y = sole_user(mul)
    y = sole_user(y) if y is not None and canon(y) is not None and \
        canon(y).name == "cast" else y
    cd = canon(y) if y is not None else None
    if cd is None or cd.name != "grouped_mm" or through_casts(cd.args[0])[0] is not mul:
        return NoMatch(gu, Why("the gated product is not read by one grouped GEMM only",
                               "moe.no_down_projection"))
    w_d = _expert_weight(cd.args[1])
    if w_d is None:
        return NoMatch(gu, Why(f"the down weight {describe(cd.args[1])} is not a [E, I, K] "
                               "expert weight or the transpose of a [E, K, I] one",
                               "moe.weight_layout"))
    if cd.args[2] is not offsets:
        return NoMatch(gu, Why("the two grouped GEMMs take different offsets",
                               "moe.offsets_differ"))
    o, down_bias = _expert_bias(y)
    o, down_fill = _after(o, down_bias)
    combine, weight = _combine(o, down_bias)
    x, _ = through_casts(x_cast)
    source, index = _gather(x)
    fills = [f for f in map(_fill, x.users) if f is not None and f.node.args[0] is x]
    input_fill = fills[0] if len(fills) == 1 and \
        fills[0].node.target == "masked_fill_" else None
    return Match(mul, act_nodes, op, params, gu, y, x, source, index, w_gu[0], w_d[0],
                 w_gu[1], w_d[1], offsets, ch, gate, up, input_fill, gu_bias, gu_fill,
                 down_bias, down_fill, combine, weight,
                 combine if combine is not None else o)


# the experts implementations the pass takes: grouped_mm here, batched_mm through its
# grouped spelling (patterns/batched_experts.py)
TAKEN_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


def implementation_notes(model: torch.nn.Module) -> list[str]:
    """The report's model-level notes: experts modules (transformers'
    ``use_experts_implementation``) whose selected implementation the pass does not take.
    Their per-expert loop ("eager": dynamo also breaks the graph at its data-dependent
    list of experts) or a kernel library's own op (deepgemm, sonicmoe) is not a spelling
    any family rewrites, and nothing in the captured graphs would say so."""
    found: dict[str, list[str]] = {}
    for name, mod in model.named_modules():
        impl = getattr(getattr(mod, "config", None), "_experts_implementation", None)
        if impl is not None and impl not in TAKEN_IMPLEMENTATIONS and hasattr(mod, "has_gate"):
            found.setdefault(impl, []).append(name)
    return [f"{len(names)} experts module(s) ({names[0]}, ...) run "
            f"experts_implementation={impl!r}, which the routed experts rewrite does not "
            "take (it rewrites transformers' grouped_mm and batched_mm paths): set it with "
            "model.set_experts_implementation('grouped_mm') for the fused grouped GEMMs "
            "[moe.implementation]" for impl, names in found.items()]


def _after_grouped_gemm(x, depth: int = 8) -> bool:
    """Whether ``x`` is computed from another grouped GEMM's output within a few ops."""
    todo, seen = [(x, 0)], set()
    while todo:
        n, d = todo.pop()
        if not isinstance(n, fx.Node) or n in seen or d > depth:
            continue
        seen.add(n)
        c = canon(n)
        if c is not None and c.name == "grouped_mm":
            return True
        todo.extend((a, d + 1) for a in n.all_input_nodes)
    return False


def _combine(o: fx.Node, bias: ExpertBias | None) -> tuple[fx.Node | None, fx.Node | None]:
    """(o · w[:, None], w) where the down output's only reader scales each row by one
    value of a 1-D w."""
    users = _readers(o, bias)
    user = users[0] if len(users) == 1 else None
    c = canon(user) if user is not None else None
    if c is None or c.name != "mul":
        return None, None
    other = c.args[1] if c.args[0] is o else c.args[0]
    if not isinstance(other, fx.Node) or other.op != "call_method" or \
            other.target != "unsqueeze" or other.args[1:] not in ((-1,), (1,)):
        return None, None
    w, mo = other.args[0], meta(o)
    mw = meta(w)
    if mw is None or mo is None or mw.dim() != 1 or mw.shape[0] != mo.shape[0] or \
            not mw.is_floating_point():
        return None, None
    return user, w


def gated_program(op: str, dtype: torch.dtype, keep_preact: bool = False,
                  params: tuple[float, ...] = (), bias: bool = False,
                  row_scale: bool = False) -> EpilogueProgram:
    """pair(gate, up) of each (gate, up) pair of the accumulator (· the routed row's
    deferred rstd r) (+ the expert's bias) -> y [S, I] (and the pre-activation [S, 2I],
    interleaved, when training: what the backward reads)."""
    p = ProgramBuilder(f"experts_{op}", gemm=True, family="routed_experts")
    v = p.scaled_acc(row_scale, bias)
    p.output(p.emit(op, v, *params, name="h"), Kind.PAIR, dtype_name(dtype))
    if keep_preact:
        p.output(v, Kind.TILE, dtype_name(dtype))
    return p.build()


def down_program(combined: bool, dtype: torch.dtype, bias: bool = False) -> EpilogueProgram:
    """w[s]·acc (the router's combine weight), or acc -> o [S, K]; with the expert's bias
    (acc + b)·w[s] (the bias added where eager adds it, before the weight)."""
    p = ProgramBuilder("experts_combine" if combined else "experts_down", gemm=True,
                       family="routed_experts")
    if bias:
        v = p.add("acc", p.operand("bias", Kind.PER_FEATURE), name="o_b")
        if combined:
            v = p.mul(v, p.operand("r", Kind.PER_ROW), name="o_w")
    else:
        v = p.scaled_acc(combined, False)
    p.output(v, Kind.TILE, dtype_name(dtype))
    return p.build()


@dataclasses.dataclass(frozen=True)
class Deferral:
    """The gathered tokens h are a norm's output whose row scale was deferred: the ops
    from the norm's output to h (views), replayed on h2 and r."""
    norm_output: fx.Node
    chain: tuple[fx.Node, ...]
    norm: DeferredNorm


def deferral_of(m: Match, context: Context) -> Deferral | None:
    """The deferred norm the gathered source reads through views (a reshape to [tokens,
    hidden], an identity cast), None where it is not one: then h is read as it is."""
    if m.source is None:
        return None
    chain, node = [], m.source
    while node not in context.deferred:
        if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function") \
                or not node.args or not isinstance(node.args[0], fx.Node) or len(chain) > 3:
            return None
        chain.append(node)
        node = node.args[0]
    norm = context.deferred[node]
    src = node
    for n in reversed(chain):
        kind, _ = row_scale.chain_op(n, src, norm.dim)
        if kind not in ("reshape", "identity", "cast") or meta(n).dtype != meta(src).dtype:
            return None
        src = n
    if meta(norm.h2).dtype != meta(m.source).dtype:
        return None
    return Deferral(node, tuple(reversed(chain)), norm)


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    gated: EpilogueProgram
    down: EpilogueProgram
    product_fill: float | None     # act(c)·c: the gate/up fill moved past the product
    #                                (None: no fill, or a dead one)
    deferral: Deferral | None = None
    # training only: the down GEMM's backward in its dgrad epilogue (kernels/grouped_dgated;
    # legality.down_backward_fused), and (perm, top_k) where the tokens' gradient is a sum
    # per token after the inverse permutation (legality.token_order)
    fused_backward: bool = False
    token_order: tuple[fx.Node, int] | None = None
    # why the routing's values need no check per launch (legality.routing_in_bounds;
    # None: the kernels check offsets and index on the device each call)
    bounds: str | None = None


# ---- the family's protocol (patterns/family.py) ------------------------------------------

def fused_from_rows_of(m: Match, graphed: bool = False) -> int:
    """size_policy.fused_from_rows for one match: a training graph's is measured apart
    (with or without CUDA graphs alike)."""
    return FUSED_FROM_ROWS_IN_TRAINING if trains(m) else FUSED_FROM_ROWS


def describe_match(m: Match) -> dict:
    return {"consumers": [describe(m.gate_up), describe(m.down)]}


def trains(m: Match) -> bool:
    """Whether the graph computes a gradient through these experts."""
    return bool(meta(m.out).requires_grad)


def _no_kernel(m: Match) -> Why | None:
    """Why no grouped kernel takes these experts' GEMMs on the GPU their graph runs on,
    as the static widths and dtype tell (kernels/grouped: a float32 model; an expert width
    under the pair store's 32): fused, every call would run the reference. None on the
    CPU (the reference path anyway), where a width is symbolic (decided per call), and
    where the kernels take them."""
    x, gu, d = meta(m.gate_up), meta(m.w_gate_up), meta(m.w_down)
    if x is None or gu is None or d is None or not family.on_gpu(x) or \
            not all(isinstance(s, int) for w in (gu, d) for s in w.shape[1:]):
        return None
    # [E, N, K], or [E, K, N] where stored K-major
    widths = [(w.shape[1], w.shape[2]) if kn else (w.shape[2], w.shape[1])
              for w, kn in ((gu, m.gate_up_kn), (d, m.down_kn))]
    why = static_violation(x.dtype, *widths[0], pairs=True) or \
        static_violation(x.dtype, *widths[1], pairs=False)
    if why is None:
        return None
    return Why(f"{describe(m.gate_up)}: {why}: no generated kernel takes these experts' "
               "GEMMs, so the fused ones would run their reference on the GPU; left to the "
               "model's own grouped GEMMs", "routed_experts.no_kernel")


def decide(m: Match, context: Context) -> Decided:
    why = _no_kernel(m)
    if why is not None:
        return Decided.refuse(Rejection(why, m.path))
    dtype = meta(m.mul).dtype
    deferral = deferral_of(m, context)
    programs = (gated_program(m.op, dtype, trains(m), m.params, m.gate_up_bias is not None,
                              deferral is not None),
                down_program(m.combine is not None, meta(m.out).dtype, m.down_bias is not None))
    decision = legality.decide(m, *programs, deferred=deferral is not None)
    if not decision.accepted:
        return Decided.refuse(decision)
    fill = None
    if m.gate_up_fill is not None and not legality.product_fill_dead(m):
        fill = legality.product_fill(m.op, m.gate_up_fill.constant, m.params)
    training = trains(m)
    order = legality.token_order(m) if training else None
    return Decided(decision, Plan(
        m, *programs, fill, deferral,
        fused_backward=training and legality.down_backward_fused(m),
        token_order=order, bounds=legality.routing_in_bounds(m)))


def _as_nk(graph: fx.Graph, w: fx.Node, kn: bool) -> fx.Node:
    """The expert weight as [E, N, K] (a transposed view of a [E, K, N] one)."""
    return graph.call_function(torch.transpose, (w, 1, 2)) if kn else w


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """Replace the experts' MLP by two grouped GEMMs with epilogues."""
    m, d = plan.match, plan.deferral
    with graph.inserting_before(m.out):
        source = m.source if m.source is not None else m.x
        gu_ops = (m.gate_up_bias.table,) if m.gate_up_bias is not None else ()
        if d is not None:  # h2's rows, each routed row scaled by its token's r
            like, call_fn = graph_replay(graph)
            source, r, _, _ = row_scale.replay_chain(d.chain, d.norm_output, d.norm.dim,
                                                    d.norm.h2, d.norm.r, like, call_fn)
            r = graph.call_method("reshape", (r, -1))
            gu_ops = (graph.call_function(operator.getitem, (r, m.index)), *gu_ops)
        order = plan.token_order
        proved = {"bounds_proved": plan.bounds is not None}
        kwargs = {"interleaved": m.interleaved, **proved}
        if order is not None:  # the gather's gradient: a sum per token, no atomic adds
            kwargs.update(perm=order[0], top_k=order[1])
        call = graph.call_function(grouped_linear, (
            plan.gated.to_text(), source, _as_nk(graph, m.w_gate_up, m.gate_up_kn),
            m.offsets, m.index, *gu_ops), kwargs)
        copy_meta(call, m.mul)
        y = results(graph, call, 1, m.mul)[0]
        if plan.product_fill is not None:
            y = graph.call_method("masked_fill", (y, m.gate_up_fill.mask, plan.product_fill))
        operands = (m.down_bias.table,) if m.down_bias is not None else ()
        if m.weight is not None:
            operands += (graph.call_method("float", (m.weight,)),)
        w_down = _as_nk(graph, m.w_down, m.down_kn)
        if plan.fused_backward:  # the pre-activation, for the down GEMM's backward
            p = graph.call_function(operator.getitem, (call, 1))
            copy_meta(p, m.gate_up)
            o = graph.call_function(grouped_down_linear, (
                plan.down.to_text(), m.op, m.params, y, p, w_down, m.offsets, *operands),
                proved)
            copy_meta(o, m.out)
        else:
            call = graph.call_function(grouped_linear, (
                plan.down.to_text(), y, w_down, m.offsets, None, *operands), proved)
            copy_meta(call, m.out)
            (o,) = results(graph, call, 1, m.out)
        if m.down_fill is not None:
            o = graph.call_method("masked_fill", (o, m.down_fill.mask, m.down_fill.constant))
    o.meta.update({k: v for k, v in m.out.meta.items() if k not in o.meta})
    m.out.replace_all_uses_with(o)
    for b in m.biases:  # an update in place is never dead by itself: its value is
        if b.in_place:
            graph.erase_node(b.add)
    dead = [m.out, m.mul, *reversed(m.act_nodes), m.gate, m.up, m.gate_up, m.down]
    dead += [n for n in (m.chunk,) if n is not None]
    dead += [b.gathered for b in m.biases]
    if m.input_fill is not None:  # dead: the same rows are filled after the GEMM
        m.input_fill.node.replace_all_uses_with(m.x)
        graph.erase_node(m.input_fill.node)
        dead.append(m.x)
    erase_if_dead(graph, dead)
    layout = ("each expert's interleaved (gate, up) columns read as stored"
              if m.interleaved else "each expert's [gate; up] rows read interleaved in "
              "place by the kernel (QuACK's concat layout)")
    stored = "[E, K, N] weights read N-contiguous in place" if m.gate_up_kn else \
        "[E, N, K] weights read K-contiguous in place"
    shown = {"programs": [plan.gated, plan.down],
             "weights": f"{layout}; {stored}: no re-layout, no copy"}
    if m.biases:
        shown["biases"] = ("each expert's bias added in the GEMM epilogue from its row of "
                           "the [E, N] table (the gather by expert id never written)")
    backward = []
    if plan.fused_backward:
        backward.append(f"d{m.op} and the combine weight's gradient in the down "
                        "projection's grouped dgrad epilogue (coda::grouped_dgated: its "
                        "product never written, h not kept)")
    if order is not None:
        backward.append(f"the tokens' gradient: each token's {order[1]} routed rows summed "
                        f"after the inverse of {describe(order[0])} (no atomic scatter)")
    if backward:
        shown["backward"] = "; ".join(backward)
    shown["routing"] = plan.bounds or ("offsets and index checked on the device at each "
                                       "launch (their bounds are not provable from the "
                                       "graph)")
    if m.index is not None:
        shown["producer"] = (f"routed rows gathered by the GEMM's row read "
                             f"({describe(m.source)}[{describe(m.index)}] never written)")
    if d is not None:
        shown["producer"] += (f"; the norm's row scale deferred through the routing: h2's "
                              f"rows read, each scaled by its token's rstd "
                              f"{describe(d.norm.r)} in the epilogue")
    return shown
