"""A mixture-of-experts layer's scatter back → each token's k rows gathered and added,
differentiated as a gather.

Hugging Face's experts (transformers/integrations/moe.py, the grouped_mm path: Mixtral,
Qwen2/3-MoE, DeepSeek, gpt-oss, ...) end with the routed rows back in token order:

    inv = torch.empty_like(perm); inv[perm] = torch.arange(N)    (perm: the sort of the
    out = rows[inv].view(T, k, H).sum(dim=1)                       N = T·k top-k ids)

Inductor compiles ``rows[inv].view(T, k, H).sum(1)`` into a reduction over k whose
gathered loads are a few elements wide, a quarter of the bandwidth (0.320 ms at 8192
tokens × top-8 × 2048 in bf16 on the H200; 0.278 at top-2 × 4096), and autograd
differentiates ``rows[inv]`` as an index_put of atomic adds into a zeroed buffer. The
rewrite (coda_rewrite/routing.sum_to_tokens) adds k row gathers in token order, one
pointwise pass with coalesced row loads (0.081 / 0.140 ms), summed in float32 with one
rounding like torch's sum, and differentiates it as a gather by perm // k (the gather's
and the sum back's gradients are each other: statements.prove_token_routing). Whatever
produced the rows: the routed experts' grouped GEMMs (patterns/routed_experts.py, the
family before it) or torch's grouped_mm where that family left them. Past 16 rows per
token the indexed reduction stays (routing.back_to_tokens).

Legality: algebra/scatter_back.py.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .. import patterns, routing
from ..algebra import scatter_back as legality
from ..algebra.decision import Why
from ..canonical import meta
from ..capture import describe, model_path
from ..graph_utils import erase_if_dead
from .family import Context, Decided

NAME = "scatter_back"
_MAX_TOP_K = routing.UNROLLED_TOP_K


@dataclasses.dataclass(frozen=True)
class Match:
    total: fx.Node                 # .sum(1)
    view: fx.Node                  # .view(T, k, N) / .reshape
    index: fx.Node                 # rows[inv]
    rows: fx.Node
    inverse: fx.Node               # inv
    perm: fx.Node                  # the sort's permutation inv inverts
    top_k: int

    @property
    def path(self) -> str:
        return model_path(self.index)


class NoMatch(patterns.NoMatch):
    pattern = NAME


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    """Every ``rows[inv].view(T, k, N).sum(...)`` with inv an empty_like written in place
    (the scatter back's shape): a candidate, rewritten or reported."""
    out = []
    for node in graph.nodes:
        if node.target is operator.getitem and len(node.args) == 2 and \
                isinstance(node.args[1], fx.Node) and \
                node.args[1].target is torch.empty_like and _sums_after_view(node):
            out.append(_match(node))
    return out


def _sums_after_view(index: fx.Node) -> bool:
    users = list(index.users)
    if len(users) != 1 or users[0].op != "call_method" or \
            users[0].target not in ("view", "reshape"):
        return False
    return any(u.op == "call_method" and u.target == "sum" for u in users[0].users)


def _match(index: fx.Node) -> Match | NoMatch:
    view = next(iter(index.users))
    total = next(u for u in view.users if u.op == "call_method" and u.target == "sum")
    perm, why = legality.inverse_of(index.args[1])
    if why is not None:
        return NoMatch(index, why)
    mv = meta(view)
    k = int(mv.shape[1]) if mv is not None and mv.dim() == 3 and \
        isinstance(mv.shape[1], int) else 0
    if not 1 <= k <= _MAX_TOP_K:
        return NoMatch(index, Why(
            f"{describe(view)} groups {k or 'a symbolic number of'} rows per token (the "
            f"gathers are spelled out for 1 to {_MAX_TOP_K})", "scatter.top_k"))
    return Match(total, view, index, index.args[0], index.args[1], perm, k)


def describe_match(m: Match) -> dict:
    return {"consumers": [describe(m.total)]}


def decide(m: Match, context: Context) -> Decided:
    return Decided.by(legality.decide(m), m)


def apply(graph: fx.Graph, m: Match, context: Context) -> dict:
    with graph.inserting_before(m.total):
        summed = graph.call_function(routing.sum_to_tokens, (
            m.rows, m.perm, m.inverse, m.top_k))
    summed.meta.update(m.total.meta)
    m.total.replace_all_uses_with(summed)
    erase_if_dead(graph, [m.total, m.view, m.index])
    shown = {"producer": f"{describe(m.rows)}: each token's {m.top_k} rows gathered and "
                         "added in token order (float32 sums, one rounding)"}
    if meta(m.rows) is not None and meta(m.rows).requires_grad:
        shown["backward"] = (f"a gather by {describe(m.perm)} // {m.top_k} (no atomic "
                             "scatter into a zeroed buffer)")
    return shown
