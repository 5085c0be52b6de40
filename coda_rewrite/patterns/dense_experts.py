"""Dense experts → their routed rows (mixture-of-experts layers that run every expert on
every token).

Llama 4's text experts (transformers' Llama4TextMoe / Llama4TextExperts) spell the layer
densely:

    logits  = router(h)                                       [T, E]
    v, idx  = topk(logits, k)
    scores  = sigmoid(full_like(logits, −∞).scatter_(1, idx, v))   zero off the top-k
    x       = h.repeat(E, 1) · scoresᵀ.reshape(−1, 1)         [E·T, K]: every token, every expert
    gate, up = bmm(x.view(E, T, K), W_gu).chunk(2, −1)        [E, T, 2I]
    out     = bmm(act(gate) · up, W_d).view(−1, K').reshape(E, T, K').sum(0)

E/k of those rows are exact zeros: a zero score makes a zero input row, and a bias-free
gated MLP maps it to zero. The rewrite (coda_rewrite/routing.py) runs the chosen (token,
expert) pairs only — sorted by expert, each scaled by its score, two grouped GEMMs
(torch._grouped_mm, the layout Hugging Face's other MoEs use), the matched activation
replayed on the routed halves, and a per-token sum back in token order — E/k times fewer
GEMM FLOPs and intermediates (16x for Llama-4-Scout, 128x for Maverick's routed layers).

Legality: algebra/dense_experts.py (statements.prove_dense_experts; the scores' zeros
checked by replaying the router's elementwise chain on its fill; a float64 replay of the
router, the dense layer and the sum against the routed form, and of their gradients in
a training graph). The routed GEMMs are not fused further: Llama 4 stores W_gu as
[E, K, 2I] with [gate; up] halves along N, which QuACK's grouped kernel reads interleaved
only from K-contiguous rows (patterns/routed_experts.py refuses the same layout).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import patterns
from ..algebra import dense_experts as algebra
from ..algebra.decision import Rejection, Why
from ..canonical import canon, meta, transposed_2d
from ..capture import describe, model_path
from ..graph_utils import (CHUNK, NotPlaceable, TracedEmitter, arg, calls, chunk_half,
                           erase_if_dead, sole_user)
from .. import routing
from ..kernels.expert_gemm import expert_gemm
from .family import Context, Decided
from .routed_experts import pair_of

NAME = "dense_experts"

_BMM = {torch.bmm, "bmm"}
_VIEWS = {"view", "reshape", torch.reshape}
_TOPK = {torch.topk, "topk"}
_SCATTER = {"scatter", "scatter_", torch.scatter}
_ELEMENTWISE = {torch.exp, "exp", torch.relu, "relu", F.relu}
_FILLS = {torch.full_like: 1, "new_full": 2, torch.full: 1}
_ZERO_FILLS = {torch.zeros_like, "new_zeros", torch.zeros}


@dataclasses.dataclass(frozen=True)
class Match:
    out: fx.Node                    # Σ over the experts: [T, K']
    tokens: fx.Node                 # h [T, K], repeated once per expert
    repeats: int
    scores: fx.Node                 # [T, E]: each expert's input is h · scores[:, e]
    column: tuple[fx.Node, ...]     # scores → their [E·T, 1] column (transpose, reshape)
    logits: fx.Node                 # what the router's topk ranks
    index: fx.Node                  # [T, k]: the top-k experts per token
    top_k: int
    scatter: fx.Node                # the top-k values scattered into the fill
    fill: float                     # the fill's constant
    chain: tuple[fx.Node, ...]      # elementwise ops from the scatter to the scores
    router: tuple[fx.Node, ...]     # topk → scores (the witness replays them)
    w_gate_up: fx.Node              # [E, K, 2I]
    w_down: fx.Node                 # [E, I, K']
    gate_up: fx.Node                # bmm(x, W_gu)
    gate: fx.Node
    up: fx.Node
    act_nodes: tuple[fx.Node, ...]
    mul: fx.Node                    # the gated product
    product: fx.Node                # what the down bmm reads (the product, under casts)
    op: str
    pair_nodes: tuple[fx.Node, ...]  # chunk → product, in graph order
    dense: tuple[fx.Node, ...]      # the scaled copies → the sum, in graph order

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.gate_up)

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return self.dense


class NoMatch(patterns.NoMatch):
    pattern = NAME


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    """Every bmm of a stacked expert weight whose output is split into halves, or whose
    input is copies of the tokens (``repeat``): a candidate, rewritten or reported."""
    out = []
    for node in graph.nodes:
        if calls(node, _BMM) and _stacked_weight(node.args[1]) and \
                (any(u.target in CHUNK for u in node.users) or _copies_tokens(node.args[0])):
            out.append(_match(node))
    return out


def _copies_tokens(a) -> bool:
    """Whether ``a`` is a view of a product with ``tokens.repeat(...)``."""
    if not calls(a, _VIEWS) or not isinstance(a.args[0], fx.Node):
        return False
    c = canon(a.args[0])
    return c is not None and c.name == "mul" and any(
        isinstance(x, fx.Node) and x.op == "call_method" and x.target == "repeat"
        for x in c.args)


def _stacked_weight(b) -> bool:
    """A [E, K, N] parameter or buffer (a stacked expert weight, not an activation)."""
    return isinstance(b, fx.Node) and b.op in ("placeholder", "get_attr") and \
        meta(b) is not None and meta(b).dim() == 3


def _refuse(node: fx.Node, what: str, code: str) -> NoMatch:
    return NoMatch(node, Why(f"{describe(node)} runs the experts densely (every token "
                             f"through every expert's stacked weights) but {what}: left "
                             "as it is", code))


def _match(gu: fx.Node) -> Match | NoMatch:
    a = gu.args[0]
    if not calls(a, _VIEWS) or meta(a.args[0]) is None or meta(a.args[0]).dim() != 2:
        return _refuse(gu, "its input is not a [E·T, K] matrix viewed as [E, T, K]",
                       "moe.dense_input")
    scaled = a.args[0]
    found = _scaled_copies(scaled)
    if found is None:
        return _refuse(gu, f"{describe(scaled)} is not tokens.repeat(E, 1) times the "
                       "transposed scores' column", "moe.dense_input")
    tokens, repeats, scores, column, rep = found
    router = _router(scores)
    if isinstance(router, str):
        return _refuse(gu, router, "moe.dense_scores")
    logits, index, top_k, scatter, fill, chain, router_nodes = router
    ch = sole_user(gu)
    lanes = sorted(ch.users, key=lambda u: (chunk_half(u) or (None, -1))[1]) \
        if ch is not None and ch.target in CHUNK else []
    if [(chunk_half(u) or (None, -1))[1] for u in lanes] != [0, 1]:
        return _refuse(gu, f"its output {describe(gu)} is not read as [gate; up] halves of "
                       "the last dim only", "moe.dense_halves")
    gate, up = lanes
    pair = pair_of(gate, up)
    if isinstance(pair, Why):
        return _refuse(gu, pair, pair.code)
    op, mul, act_nodes, _ = pair
    users = list(mul.users)
    product = mul
    while len(users) == 1 and canon(users[0]) is not None and canon(users[0]).name == "cast":
        product = users[0]
        users = list(product.users)
    downs = [u for u in users if calls(u, _BMM) and u.args[0] is product]
    if len(downs) == 1 and len(users) > 1:
        other = next(u for u in users if u is not downs[0])
        return _refuse(gu, f"its gated product is also read by {describe(other)}: the "
                       "routed form never computes it", "moe.dense_intermediate_read")
    down = users[0] if len(users) == 1 else None
    if not calls(down, _BMM) or down.args[0] is not product or \
            not _stacked_weight(down.args[1]):
        return _refuse(gu, "its gated product is not read by one bmm with a stacked down "
                       "weight only", "moe.dense_down")
    views, n = [], down
    while sole_user(n) is not None and calls(sole_user(n), _VIEWS):
        n = sole_user(n)
        views.append(n)
    total = sole_user(n)
    if not _sums_experts(total, down, n):
        return _refuse(gu, "the experts' outputs are not summed over the experts "
                       "(sum(dim=0) of the [E, T, K'] product)", "moe.dense_output")
    order = {v: i for i, v in enumerate(gu.graph.nodes)}
    pair_nodes = [ch, gate, up, *act_nodes, mul]
    pair_nodes += [c for c in _casts_after(mul) if order[c] <= order[product]]
    dense = [*column, rep, scaled, a, gu, *pair_nodes, down, *views, total]
    return Match(total, tokens, repeats, scores, tuple(column), logits, index, top_k,
                 scatter, fill, tuple(chain), tuple(sorted(router_nodes, key=order.get)),
                 gu.args[1], down.args[1], gu, gate, up, tuple(act_nodes), mul, product, op,
                 tuple(sorted(pair_nodes, key=order.get)),
                 tuple(sorted(set(dense), key=order.get)))


def _casts_after(node: fx.Node) -> list[fx.Node]:
    out = []
    while sole_user(node) is not None and canon(sole_user(node)) is not None and \
            canon(sole_user(node)).name == "cast":
        node = sole_user(node)
        out.append(node)
    return out


def _scaled_copies(scaled: fx.Node):
    """(tokens, E, scores, column nodes, repeat) where ``scaled`` is
    ``tokens.repeat(E, 1) * scoresᵀ.reshape(-1, 1)`` (either operand order)."""
    c = canon(scaled)
    if c is None or c.name != "mul":
        return None
    for rep, col in (c.args, reversed(c.args)):
        if not (isinstance(rep, fx.Node) and rep.op == "call_method" and
                rep.target == "repeat"):
            continue
        times = rep.args[1] if len(rep.args) == 2 and \
            isinstance(rep.args[1], (tuple, list)) else rep.args[1:]
        tokens = rep.args[0]
        if len(times) != 2 or times[1] != 1 or not isinstance(times[0], int) or \
                meta(tokens) is None or meta(tokens).dim() != 2:
            return None
        column = _column(col)
        if column is None:
            return None
        scores, nodes = column
        return tokens, times[0], scores, nodes, rep
    return None


def _column(col) -> tuple[fx.Node, list[fx.Node]] | None:
    """(scores, nodes) for ``scores.transpose(0, 1).reshape(-1, 1)`` of a 2-D scores
    (``.t()``, ``.T``, ``.mT``, ``permute(1, 0)`` alike): the [E·T, 1] column whose row
    e·T + t is scores[t, e]."""
    if not calls(col, _VIEWS) or meta(col) is None or meta(col).dim() != 2 or \
            meta(col).shape[1] != 1:
        return None
    t = col.args[0]
    if not isinstance(t, fx.Node) or meta(t) is None or meta(t).dim() != 2:
        return None
    src = transposed_2d(t)
    return (src, [t, col]) if isinstance(src, fx.Node) else None


def _router(scores: fx.Node):
    """(logits, index, k, scatter, fill, chain, nodes) where ``scores`` is elementwise ops
    of ``fill.scatter(1, topk(logits, k)[1], values)`` over a constant fill; a reason
    where it is not."""
    chain, node = [], scores
    while not calls(node, _SCATTER):
        c = canon(node) if isinstance(node, fx.Node) else None
        if not (c is not None and c.name in ("cast", "sigmoid")) and \
                not calls(node, _ELEMENTWISE):
            return (f"its scores {describe(scores)} are not elementwise ops (casts, "
                    "sigmoid, exp, relu) of top-k values scattered into a constant")
        chain.append(node)
        node = node.args[0]
    scatter = node
    fill_node, dim, index = (arg(scatter, i, n) for i, n in
                             ((0, "input"), (1, "dim"), (2, "index")))
    values = arg(scatter, 3, "src")
    if dim not in (1, -1) or "reduce" in scatter.kwargs or not isinstance(values, fx.Node):
        return f"{describe(scatter)} does not scatter values along the experts"
    fill = _constant_fill(fill_node)
    if fill is None or len(fill_node.users) != 1:
        return (f"{describe(scatter)} scatters into {describe(fill_node)}, not a constant "
                "fill read by the scatter only")
    top = index.args[0] if isinstance(index, fx.Node) and \
        index.target is operator.getitem and index.args[1] == 1 else None
    if not calls(top, _TOPK) or arg(top, 2, "dim", -1) not in (1, -1):
        return (f"{describe(scatter)} scatters at {describe(index)}, not a topk's indices "
                "over the experts")
    logits, k = top.args[0], arg(top, 1, "k")
    if not isinstance(k, int) or meta(logits) is None or meta(logits).dim() != 2:
        return f"{describe(top)} is not a top-k of [T, E] logits with a literal k"
    nodes = {top, index, fill_node, scatter, *chain}
    nodes |= {u for u in top.users if u.target is operator.getitem}
    nodes |= _between(values, logits)
    return logits, index, k, scatter, fill, list(reversed(chain)), nodes


def _constant_fill(node) -> float | None:
    """The constant of ``full_like(x, c)`` / ``full(size, c)`` / ``x.new_full(size, c)``
    / a zeros fill; None for anything else."""
    if calls(node, _ZERO_FILLS):
        return 0.0
    if not calls(node, _FILLS):
        return None
    value = arg(node, _FILLS[node.target], "fill_value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _between(top: fx.Node, bottom: fx.Node, depth: int = 6) -> set[fx.Node]:
    """The nodes from ``bottom`` (exclusive) up to ``top`` (the top-k values' path from
    the topk, through a few ops)."""
    out, todo = set(), [(top, 0)]
    while todo:
        n, d = todo.pop()
        if n is bottom or n in out or d > depth or n.op not in ("call_function",
                                                                "call_method"):
            continue
        out.add(n)
        todo.extend((x, d + 1) for x in n.all_input_nodes)
    return out


def _sums_experts(total, down: fx.Node, last: fx.Node) -> bool:
    """Whether ``total`` is ``last.sum(dim=0)`` of the down bmm's [E, T, K'] output
    through views that end in its own shape (reshapes compose to the identity)."""
    if not calls(total, {"sum", torch.sum}) or total.args[0] is not last:
        return False
    dim = arg(total, 1, "dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    if dim != 0 or arg(total, 2, "keepdim", False) or "dtype" in total.kwargs:
        return False
    return meta(last) is not None and tuple(meta(last).shape) == tuple(meta(down).shape)


def describe_match(m: Match) -> dict:
    return {"consumers": [describe(m.gate_up), describe(m.out)]}


# Where the routed form pays on the GPU, in routed rows R = tokens × top-k against E
# experts (benchmarks/dense_experts_small.py: the Llama-4-Scout block, 16 experts, top-1,
# H200, CUDA graphs, against torch.compile of the dense block): 4.1x at R = 1, 1.23x at
# 8, 1.07x at 16, then 0.66x / 0.69x / 0.70x at 32 / 64 / 128, 1.02x at 256, 1.87x at
# 512, 6.7x at 8192. While R ≤ E few experts are active and the routed GEMMs read only
# theirs; from about 2E rows every expert is active and torch._grouped_mm reads the
# weights slower than the dense bmm (1.55 ms against ~1.05 for 4 GiB), until the dense
# layer's E/k times larger FLOPs dominate (from 16E rows). Measured at E = 16 only; the
# bounds scale with E by that argument, not by measurement.
FEW_ROWS_PER_EXPERT, MANY_ROWS_PER_EXPERT = 1, 16


def too_dense_to_pay(m: Match, override: int | None) -> str:
    """Why the dense layer is left at this size on the GPU ("" where the routed form
    pays, on other devices, and where the row count is symbolic). ``override``
    (options.min_fused_rows) replaces the window by a plain threshold (0: always)."""
    x = meta(m.tokens)
    tokens = x.shape[0] if x is not None and x.device.type == "cuda" else None
    if not isinstance(tokens, int):
        return ""
    rows, experts = tokens * m.top_k, int(meta(m.w_gate_up).shape[0])
    if override is not None:
        return "" if rows >= override else \
            f"{rows} routed rows, fewer than min_fused_rows = {override}: left dense"
    if rows <= FEW_ROWS_PER_EXPERT * experts or rows >= MANY_ROWS_PER_EXPERT * experts:
        return ""
    return (f"{rows} routed rows over {experts} experts: every expert is active and the "
            "dense bmm reads the weights faster than the routed grouped GEMMs below "
            f"{MANY_ROWS_PER_EXPERT * experts} rows (measured, patterns/dense_experts.py): "
            "left dense")


def decide(m: Match, context: Context) -> Decided:
    dense = too_dense_to_pay(m, context.options.min_fused_rows)
    if dense:
        return Decided.refuse(Rejection(Why(dense, "shape.small_m"), m.path))
    decision = algebra.decide(m)
    if not decision.accepted:
        return Decided.refuse(decision)
    return Decided(decision, m)


def apply(graph: fx.Graph, m: Match, context: Context) -> dict:
    """The routed form (coda_rewrite/routing.py) in place of the dense layer."""
    experts = int(meta(m.w_gate_up).shape[0])
    if getattr(meta(m.out), "fake_mode", None) is None:
        raise NotPlaceable("the graph's values carry no fake tensors to shape new nodes by")
    with graph.inserting_before(m.out):
        emit = TracedEmitter(graph, m.out)
        routing_ = emit.call(routing.sort_by_expert, m.index, experts)
        perm, offsets, inverse = (emit.call(operator.getitem, routing_, i) for i in range(3))
        x = emit.call(routing.gather_scaled, m.tokens, m.scores, m.index, perm, inverse)
        p = emit.call(expert_gemm, x, m.w_gate_up, offsets)
        copies = {m.gate_up: p}
        for node in m.pair_nodes:  # the matched activation, on the routed rows' halves
            copies[node] = emit.copy(node, copies)
        o = emit.call(expert_gemm, copies[m.product], m.w_down, offsets)
        y = emit.call(routing.sum_to_tokens, o, perm, inverse, m.top_k)
    y.meta.update({k: v for k, v in m.out.meta.items() if k not in y.meta})
    m.out.replace_all_uses_with(y)
    erase_if_dead(graph, list(reversed(m.dense)))
    return {"producer": f"{describe(m.index)}'s top-{m.top_k} of {experts} experts: "
                        "the chosen (token, expert) rows sorted by expert, each scaled "
                        "by its score",
            "weights": "the stacked [E, K, N] expert weights read in place by grouped "
                       f"GEMMs over the routed rows ({experts // m.top_k}x fewer GEMM "
                       "rows than the dense bmm); the activation as matched; each "
                       "token's rows summed back in token order"}
