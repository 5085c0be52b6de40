"""Batched experts → the grouped spelling (transformers' ``batched_mm`` experts
implementation).

Hugging Face's ``batched_mm`` experts (transformers/integrations/moe.py, selected with
``model.set_experts_implementation("batched_mm")`` for any MoE class that supports the
experts interface) run one GEMV per (token, expert) pair, S = T·k of them, each with its
own copy of the expert's weights:

    x   = h.repeat_interleave(k, dim=0)                      [S, K]: pair s is token s // k
    ids = top_k_index.reshape(-1).clamp(0, E - 1)            [S]
    p   = bmm(W_gu[ids], x.unsqueeze(-1)).squeeze(-1)        W_gu[ids]: [S, 2I, K] copied
    p.add_(b_gu[ids])                                        (where the experts have biases)
    y   = act(gate)·up of p's halves (or act(p): experts without a gate)
    o   = bmm(W_d[ids], y.unsqueeze(-1)).squeeze(-1) (+ b_d[ids])
    out = (o · w[:, None]).view(T, k, K').sum(1)             w = top_k_weights.reshape(-1)

(gpt-oss's [E, K, N] weights spell each GEMV bmm(x.unsqueeze(1), W[ids]).squeeze(1)).
Every GEMV reads a copy of its expert's matrices, written first: at decode (T = 1,
Qwen3-30B-A3B's top-8) the copies are 8 experts' weights written and read again, and
at a prompt of 8192 tokens they would be 65536 expert matrices. The rewrite puts the
same products in transformers' grouped spelling, which reads each expert's weights once,
in place:

    ids_g, perm = sort(ids)                                  the pairs sorted by expert
    offsets     = cumsum(histc(ids_g, E bins))               each expert's rows
    p   = grouped_mm(h[perm // k], W_guᵀ, offsets) (+ b_gu[ids_g])
    y   = act(gate)·up, the matched activation replayed on p
    o   = grouped_mm(y, W_dᵀ, offsets) (+ b_d[ids_g])
    out = Σ over each token's k rows of o · w[perm][:, None], in token order

so the families after it see Hugging Face's grouped experts: the norm's row scale
deferred through the gather, the routed experts' fused GEMMs where they pay
(patterns/routed_experts.py), and torch's grouped_mm where they do not. The sum back is
routing.sum_to_tokens (each token's rows gathered and added in float32, one rounding,
as the view's sum does).

Legality: algebra/batched_experts.py (statements.prove_batched_experts: the grouped
rows compute every pair's expert exactly where its ids lie in [0, E); a float64 replay of
the matched nodes against this module's recipe, and of their gradients in a training
graph).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import patterns, routing
from ..algebra import batched_experts as legality
from ..algebra.decision import Why
from ..canonical import canon, meta
from ..capture import describe, model_path
from ..graph_utils import (CHUNK, NotPlaceable, TracedEmitter, arg, calls, chunk_half,
                           erase_if_dead, sole_user)
from ..kernels.expert_gemm import expert_gemm
from .family import Context, Decided
from .routed_experts import lane_of, pair_of

NAME = "batched_experts"

_BMM = {torch.bmm, "bmm"}
_VIEWS = {"view", "reshape", torch.reshape}
# the tokens' copies: repeat_interleave is the spelling; repeat (copies in the other
# order) is reported
_COPIES = {"repeat_interleave", torch.repeat_interleave, "repeat"}


@dataclasses.dataclass(frozen=True)
class Gemv:
    """One of the spelling's per-pair GEMMs: bmm of the gathered weights W[ids] and the
    rows, squeezed, plus each pair's gathered bias where there is one."""
    bmm: fx.Node
    weight: fx.Node                # the stacked expert weights
    gathered: fx.Node              # weight[ids]
    rows: fx.Node                  # the [S, K] rows (before the unsqueeze)
    unsqueeze: fx.Node
    out: fx.Node                   # the squeeze
    weight_first: bool             # bmm(W[ids], x.unsqueeze(-1)): weight stored [E, N, K]
    bias: fx.Node | None           # the [E, N] table
    bias_gathered: fx.Node | None  # table[ids]
    bias_add: fx.Node | None       # out.add_(table[ids]) or out + table[ids]
    result: fx.Node                # what the readers read: out, or the out-of-place sum

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return tuple(n for n in (self.gathered, self.unsqueeze, self.bmm, self.out,
                                 self.bias_gathered, self.bias_add) if n is not None)


@dataclasses.dataclass(frozen=True)
class Match:
    total: fx.Node                 # the sum over each token's k rows
    tokens: fx.Node                # h [T, K]
    copies: fx.Node                # h.repeat_interleave(k, dim=0)
    top_k: int
    ids: fx.Node                   # [S]: the expert of each pair
    experts: int
    scores: fx.Node                # [S]: each pair's combine weight
    gate_up: Gemv
    down: Gemv
    activation: str                # the gated pair's op, or "elementwise"
    pair_nodes: tuple[fx.Node, ...]  # the GEMM's output → the down GEMM's rows, in order
    product: fx.Node               # what the down GEMM's rows are (the product, cast)
    combine: fx.Node               # o · w[:, None]
    column: fx.Node                # w[:, None]
    view: fx.Node                  # [T, k, K']
    nodes: tuple[fx.Node, ...]     # everything the grouped spelling replaces, in order

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.gate_up.bmm)


class NoMatch(patterns.NoMatch):
    pattern = NAME


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    """Every bmm of per-pair expert weights (a stacked weight indexed by a 1-D id
    vector) whose rows are copies of the tokens (``repeat_interleave``): a candidate,
    rewritten or reported."""
    out = []
    for node in graph.nodes:
        gemv = _gemv(node) if calls(node, _BMM) else None
        if gemv is not None and calls(gemv.rows, _COPIES):
            out.append(_match(gemv))
    return out


def _weight_gather(node) -> tuple[fx.Node, fx.Node] | None:
    """(W, ids) where ``node`` is ``W[ids]``, W a 3-D parameter or buffer, ids 1-D int."""
    c = canon(node) if isinstance(node, fx.Node) else None
    if c is None or c.name != "getitem" or not isinstance(c.args[1], fx.Node):
        return None
    w, ids = c.args
    mw, mi = meta(w), meta(ids)
    if not isinstance(w, fx.Node) or w.op not in ("placeholder", "get_attr") or \
            mw is None or mw.dim() != 3 or mi is None or mi.dim() != 1 or \
            mi.dtype not in (torch.int32, torch.int64):
        return None
    return w, ids


def _gemv(bmm: fx.Node) -> Gemv | None:
    """The per-pair GEMM around ``bmm``: bmm(W[ids], x.unsqueeze(-1)).squeeze(-1) or
    bmm(x.unsqueeze(1), W[ids]).squeeze(1), with the pair's bias added after."""
    a, b = bmm.args[:2] if len(bmm.args) >= 2 else (None, None)
    for gathered, rows_u, weight_first in ((a, b, True), (b, a, False)):
        found = _weight_gather(gathered)
        if found is None or not calls(rows_u, {"unsqueeze", torch.unsqueeze}):
            continue
        dim = arg(rows_u, 1, "dim")
        squeeze = sole_user(bmm)
        want = (-1, 2) if weight_first else (1, -2)
        if dim not in want or not calls(squeeze, {"squeeze", torch.squeeze}) or \
                arg(squeeze, 1, "dim") not in want:
            return None
        weight, _ = found
        result, bias, bias_gathered, add = squeeze, None, None, None
        adds = [u for u in squeeze.users if calls(u, {"add_"}) and u.args[0] is squeeze]
        plus = sole_user(squeeze)
        if len(adds) == 1 and len(adds[0].args) == 2 and not adds[0].users:
            add = adds[0]
        elif plus is not None and canon(plus) is not None and canon(plus).name == "add":
            add = plus
            result = plus
        if add is not None:
            other = add.args[1] if add.args[0] is squeeze else add.args[0]
            c = canon(other) if isinstance(other, fx.Node) else None
            if c is not None and c.name == "getitem" and isinstance(c.args[1], fx.Node) \
                    and meta(c.args[0]) is not None and meta(c.args[0]).dim() == 2:
                bias, bias_gathered = c.args[0], other
            else:
                result, add = squeeze, None
        return Gemv(bmm, weight, gathered, rows_u.args[0], rows_u, squeeze, weight_first,
                    bias, bias_gathered, add, result)
    return None


def _refuse(node: fx.Node, what: str, code: str) -> NoMatch:
    return NoMatch(node, Why(f"{describe(node)} runs the experts one GEMV per (token, "
                             f"expert) pair on copied weights but {what}: left as it is",
                             code))


def _halves(p: fx.Node, gemv: Gemv):
    """(gate, up, split nodes) of the GEMM's output read as [gate; up] halves or as
    interleaved lanes, and by nothing else; a reason otherwise."""
    readers = [u for u in p.users if u is not gemv.bias_add]
    chunks = [u for u in readers if u.target in CHUNK]
    lanes = sorted(((lane[1], u) for u in readers if (lane := lane_of(u)) and lane[0] is p),
                   key=lambda t: t[0])
    split = None
    if len(chunks) == 1:
        halves = sorted(chunks[0].users, key=lambda u: (chunk_half(u) or (None, -1))[1])
        if [(chunk_half(u) or (None, -1))[1] for u in halves] == [0, 1]:
            split = (halves[0], halves[1], (chunks[0], *halves))
    elif [k for k, _ in lanes] == [0, 1]:
        split = (lanes[0][1], lanes[1][1], (lanes[0][1], lanes[1][1]))
    if split is None:
        return Why(f"its output {describe(p)} is not read as [gate; up] halves or as "
                   "interleaved lanes", "moe.not_halves")
    other = next((u for u in readers if u not in split[2]), None)
    if other is not None:
        return Why(f"its output {describe(p)} is also read by {describe(other)}: the "
                   "grouped spelling never computes it", "moe.intermediate_read")
    return split


def _match(gu: Gemv) -> Match | NoMatch:
    copies = gu.rows
    tokens, k = copies.args[0], arg(copies, 1, "repeats")
    if copies.target == "repeat" or not isinstance(k, int) or \
            arg(copies, 2, "dim") not in (0, -2) or arg(copies, 3, "output_size") is not None \
            or not isinstance(tokens, fx.Node) or meta(tokens) is None or meta(tokens).dim() != 2:
        return _refuse(gu.bmm, f"its rows {describe(copies)} are not each token's row "
                       "repeated k times (repeat_interleave(k, dim=0) of a [T, K] matrix)",
                       "moe.batched_rows")
    ids = _weight_gather(gu.gathered)[1]
    found = _halves(gu.result, gu)
    chain = _elementwise_chain(gu.result, gu) if isinstance(found, Why) else None
    if chain:  # experts without a gate: act(x·W_up) (Nemotron-H's relu²)
        op, mul, split, act_nodes = "elementwise", chain[-1], (), chain[:-1]
    elif isinstance(found, Why):
        return _refuse(gu.bmm, found, found.code)
    else:
        gate, up, split = found
        pair = pair_of(gate, up)
        if isinstance(pair, Why):
            return _refuse(gu.bmm, pair, pair.code)
        op, mul, act_nodes, _ = pair
    product, casts = mul, []
    while sole_user(product) is not None and canon(sole_user(product)) is not None and \
            canon(sole_user(product)).name == "cast":
        product = sole_user(product)
        casts.append(product)
    lifted = sole_user(product)
    down_bmm = sole_user(lifted) if lifted is not None else None
    down = _gemv(down_bmm) if calls(down_bmm, _BMM) else None
    if down is None or down.rows is not product:
        return _refuse(gu.bmm, "its gated product is not read by one per-pair GEMM of "
                       "gathered down weights only", "moe.no_down_projection")
    if _weight_gather(down.gathered)[1] is not ids or down.weight_first != gu.weight_first \
            or any(g.bias_gathered is not None and canon(g.bias_gathered).args[1] is not ids
                   for g in (gu, down)):
        return _refuse(gu.bmm, "its two GEMMs gather their weights (or biases) by different "
                       "ids, or store them in different layouts", "moe.batched_ids")
    combine = sole_user(down.result) if down.bias_add is None or \
        down.result is not down.out else next(
            (u for u in down.out.users if u is not down.bias_add), None)
    column, scores = _column(combine, down.result)
    view = sole_user(combine) if combine is not None else None
    total = sole_user(view) if calls(view, _VIEWS) else None
    if column is None or not calls(total, {"sum", torch.sum}):
        return _refuse(gu.bmm, "its down output is not scaled by one weight per pair and "
                       "summed over each token's k rows (o · w[:, None], .view(T, k, K')"
                       ".sum(1))", "moe.batched_output")
    order = {n: i for i, n in enumerate(gu.bmm.graph.nodes)}
    pair_nodes = sorted({*split, *act_nodes, mul, *casts}, key=order.get)
    nodes = sorted({copies, *gu.nodes, *pair_nodes, lifted, *down.nodes, combine, column,
                    view, total}, key=order.get)
    return Match(total, tokens, copies, k, ids, int(meta(gu.weight).shape[0]), scores, gu,
                 down, op, tuple(pair_nodes), product, combine, column, view, tuple(nodes))


# ops that map each element on its own (with number constants): a chain of them between
# the two GEMMs is row-local, so it commutes with sorting the rows
_UNARY = {torch.relu, "relu", F.relu, torch.square, "square", F.silu, F.gelu, torch.sigmoid,
          "sigmoid", torch.tanh, "tanh", F.sigmoid, torch.exp, "exp", torch.neg, "neg"}
_WITH_NUMBER = {operator.mul, operator.add, operator.sub, operator.truediv, operator.pow,
                torch.mul, torch.add, "mul", "add", "sub", "pow", "div"}


def _elementwise(node: fx.Node, x: fx.Node) -> bool:
    """``node`` maps each element of ``x`` alone: a unary pointwise op, a cast, or x with
    a number."""
    c = canon(node)
    if c is not None and c.name == "cast":
        return c.args[0] is x
    if calls(node, _UNARY):
        return node.args[:1] == (x,) and all(
            not isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values()))
    if calls(node, _WITH_NUMBER) and len(node.args) == 2 and not node.kwargs:
        return x in node.args and all(isinstance(a, (int, float)) or a is x
                                      for a in node.args)
    return False


def _elementwise_chain(p: fx.Node, gemv: Gemv) -> list[fx.Node]:
    """The elementwise ops from ``p`` (each read only by the next; p also by its bias
    added in place) up to the rows of a per-pair GEMM; [] where the chain ends
    otherwise."""
    readers = [u for u in p.users if u is not gemv.bias_add]
    chain, x = [], p
    while (nxt := readers[0] if x is p and len(readers) == 1 else sole_user(x)) \
            is not None and _elementwise(nxt, x):
        chain.append(nxt)
        x = nxt
    lifted = sole_user(x)
    if not chain or not calls(lifted, {"unsqueeze", torch.unsqueeze}) or \
            not calls(sole_user(lifted), _BMM):
        return []
    return chain


def _column(combine, o: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """(w.unsqueeze(-1), w) where ``combine`` is o times a [S] weight's column."""
    c = canon(combine) if isinstance(combine, fx.Node) else None
    if c is None or c.name != "mul" or o not in c.args:
        return None, None
    col = c.args[1] if c.args[0] is o else c.args[0]
    if not calls(col, {"unsqueeze"}) or arg(col, 1, "dim") not in (-1, 1) or \
            len(col.users) != 1:
        return None, None
    w = col.args[0]
    mw = meta(w) if isinstance(w, fx.Node) else None
    return (col, w) if mw is not None and mw.dim() == 1 and mw.is_floating_point() \
        else (None, None)


def describe_match(m: Match) -> dict:
    return {"consumers": [describe(m.gate_up.bmm), describe(m.down.bmm)]}


def decide(m: Match, context: Context) -> Decided:
    return Decided.by(legality.decide(m, grouped_spelling), m)


def grouped_spelling(b, m: Match, values: dict):
    """The match's computation in transformers' grouped spelling, built by ``b``
    (graph_utils.TracedEmitter in apply, the witness's evaluator in the replay):
    ``values`` maps the match's inputs (tokens, ids, scores, the weights and biases) to
    what ``b`` builds on. Returns the per-token sum."""
    tokens, ids, scores = values[m.tokens], values[m.ids], values[m.scores]
    ids_g, perm = (b.call(operator.getitem, s, i)
                   for s in [b.call(torch.sort, ids, stable=True)] for i in (0, 1))
    x = b.call(operator.getitem, tokens, b.call(operator.floordiv, perm, m.top_k))
    # histc counts floats on the CPU and ints on CUDA under deterministic algorithms
    # (transformers picks by device alike); both hold every id exactly
    # (by where ``ids`` lives: the graph's device, or the replay's CPU values)
    on_cuda = (ids if isinstance(ids, torch.Tensor) else meta(ids)).device.type == "cuda"
    counts = b.call(torch.histc, b.method("int" if on_cuda else "float", ids_g),
                    bins=m.experts, min=0, max=m.experts - 1)
    offsets = b.call(torch.cumsum, counts, 0, dtype=torch.int32)

    def gemm(rows, gemv: Gemv):
        weight = values[gemv.weight]
        if gemv.weight_first:  # stored [E, N, K]: grouped_mm reads [E, K, N]
            weight = b.method("transpose", weight, -2, -1)
        out = b.call(expert_gemm, rows, weight, offsets)
        if gemv.bias is None:
            return out
        return b.call(operator.add, out, b.call(operator.getitem, values[gemv.bias], ids_g))
    lanes = {m.gate_up.result: gemm(x, m.gate_up)}
    for node in m.pair_nodes:
        lanes[node] = b.copy(node, lanes)
    o = gemm(lanes[m.product], m.down)
    weights = b.method("unsqueeze", b.call(operator.getitem, scores, perm), -1)
    weighted = b.call(operator.mul, o, weights)
    inverse = b.call(routing.inverse_permutation, perm)
    return b.call(routing.sum_to_tokens, weighted, perm, inverse, m.top_k)


def inputs(m: Match) -> list[fx.Node]:
    """The values the grouped spelling reads."""
    return [n for n in (m.tokens, m.ids, m.scores, m.gate_up.weight, m.gate_up.bias,
                        m.down.weight, m.down.bias) if n is not None]


def apply(graph: fx.Graph, m: Match, context: Context) -> dict:
    if getattr(meta(m.total), "fake_mode", None) is None:
        raise NotPlaceable("the graph's values carry no fake tensors to shape new nodes by")
    with graph.inserting_before(m.total):
        out = grouped_spelling(TracedEmitter(graph, m.total), m, {n: n for n in inputs(m)})
    out.meta.update({k: v for k, v in m.total.meta.items() if k not in out.meta})
    m.total.replace_all_uses_with(out)
    erase_if_dead(graph, list(reversed(m.nodes)))
    s = meta(m.ids).shape[0]
    return {"producer": f"the {s} (token, expert) pairs of {describe(m.ids)} sorted by "
                        f"expert, each token's row gathered (was {describe(m.copies)})",
            "weights": f"each of the {m.experts} experts' stacked weights read in place by "
                       "a grouped GEMM over its rows (the per-pair copies W[ids] gone); the "
                       "activation as matched; each token's rows summed back in token order"}
