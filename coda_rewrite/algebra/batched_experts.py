"""Legality of putting per-pair expert GEMMs in the grouped spelling
(patterns/batched_experts.py): the identity (statements.prove_batched_experts), its side
conditions on the matched graph, and a float64 replay of the matched nodes against the
pattern's own recipe (the very function that builds the replacement), and of their
gradients in a training graph.

Side conditions, each checked here:

* every pair's expert id lies in [0, E): the ids are clamped to a sub-range of it
  (transformers' ``clamp(0, E - 1)``), or they are the indices of a top-k over E columns.
  Eager's W[ids] raises on an id of E or more and wraps a negative one to E − 1 (torch's
  indexing), where the grouped rows count ids in [0, E) only (histc's bins): outside that
  range the two differ, so the bound must hold by construction;
* the rows are each token's row repeated k times in a row (``repeat_interleave(k,
  dim=0)``) and the sum adds each token's k consecutive pairs ([T, k, K'] view, sum over
  dim 1): pair s belongs to token s // k in both;
* what runs between the two GEMMs maps each row alone (the gated pair on the row's
  halves or lanes, or a chain of elementwise ops: the grouped spelling runs it on the
  rows in sorted order);
* both GEMMs gather their weights by the same ids, the biases (where there are any) too;
  a bias added in place (``p.add_(b[ids])``) is added before anything else reads p;
* what the grouped spelling never computes (the copies of the tokens and of the weights,
  the per-pair GEMMs' outputs, the halves, the product, the weighted rows, the view) is
  read only inside the match, and nothing else updates what it reads in place;
* not under autocast (eager's bmm would cast its operands; the grouped GEMMs do not).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..canonical import meta, under_autocast
from ..capture import describe
from ..graph_utils import arg, calls, memory_sharers, mutated_value
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .witness import _size, eval_nodes, guarded_with_gradients, verdict

_CLAMPS = {"clamp", "clip", torch.clamp, torch.clip}
_FLATTENS = {"reshape", "view", "flatten", torch.reshape, torch.flatten}


def ids_in_range(m) -> tuple[str | None, Why | None]:
    """(why every id lies in [0, E), None) or (None, why that is not known)."""
    e, node = m.experts, m.ids
    if calls(node, _CLAMPS):
        lo, hi = arg(node, 1, "min"), arg(node, 2, "max")
        if isinstance(lo, int) and isinstance(hi, int) and 0 <= lo and hi <= e - 1:
            return f"the expert ids are clamped to [{lo}, {hi}] ⊆ [0, {e - 1}]", None
    else:
        src = node
        while calls(src, _FLATTENS):
            src = src.args[0]
        top = src.args[0] if isinstance(src, fx.Node) and src.target is operator.getitem \
            and src.args[1] == 1 else None
        if calls(top, {torch.topk, "topk"}):
            scores, dim = meta(top.args[0]), arg(top, 2, "dim", -1)
            if scores is not None and dim in (-1, scores.dim() - 1) and \
                    statically_known_true(scores.shape[-1] == e):
                return f"the expert ids are a top-k's indices over {e} columns", None
    return None, Why(f"{describe(node)} is not known to lie in [0, {e}) (clamped to it, or "
                     f"a top-k over {e} columns): eager's W[ids] raises past E and wraps "
                     "a negative id, the grouped rows count ids in [0, E) only",
                     "moe.batched_ids")


def _shapes(m) -> Why | None:
    t, k_in = (_size(s) for s in meta(m.tokens).shape)
    s, e, k = _size(meta(m.ids).shape[0]), m.experts, m.top_k
    gu, dn = (meta(g.weight).shape for g in (m.gate_up, m.down))
    # [E, N, K] where the weight comes first in the bmm (nn.Linear per expert), else [E, K, N]
    (gu_n, gu_k), (dn_n, dn_k) = ((x[1], x[2]) if m.gate_up.weight_first else (x[2], x[1])
                                  for x in (gu, dn))
    view = meta(m.view)
    ok = (s == t * k and tuple(meta(m.scores).shape) == (meta(m.ids).shape[0],) and
          statically_known_true(meta(m.ids).shape[0] == meta(m.tokens).shape[0] * k) and
          gu[0] == e and dn[0] == e and gu_k == k_in and _halved(m) * dn_k == gu_n and
          view is not None and view.dim() == 3 and
          statically_known_true(view.shape[0] == meta(m.tokens).shape[0]) and
          view.shape[1] == k and view.shape[2] == dn_n)
    for g, n in ((m.gate_up, gu_n), (m.down, dn_n)):
        if g.bias is not None:
            ok = ok and tuple(meta(g.bias).shape) == (e, n)
    if not ok:
        return Why(f"tokens {_shape(m.tokens)}, {k} copies each, ids {_shape(m.ids)}, "
                   f"weights {_shape(m.scores)}, expert weights {_shape(m.gate_up.weight)} "
                   f"and {_shape(m.down.weight)}, view {_shape(m.view)}: not [T, K], T·k, "
                   "[T·k], [T·k], [E, 2I, K] (without a gate [E, I, K]) and [E, K', I] (or "
                   "both [E, K, N]), [T, k, K']",
                   "moe.batched_shapes")
    dim = arg(m.total, 1, "dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    if dim not in (1, -2) or arg(m.total, 2, "keepdim", False) or "dtype" in m.total.kwargs:
        return Why(f"{describe(m.total)} does not sum over each token's k rows",
                   "moe.batched_output")
    return None


def _halved(m) -> int:
    """How many times wider the first GEMM's output is than the second's input: 2 for a
    gated pair, 1 for an elementwise activation."""
    return 1 if m.activation == "elementwise" else 2


def _shape(node) -> tuple:
    return tuple(meta(node).shape) if meta(node) is not None else ("?",)


def side_conditions(m) -> tuple[list[str], Why | None]:
    """(conditions that hold, the first that does not)."""
    why = _shapes(m)
    if why is not None:
        return [], why
    held = [f"{m.experts} experts, top-{m.top_k}: pair s is token s // {m.top_k} in the "
            "copies and in the sum"]
    bounded, why = ids_in_range(m)
    if why is not None:
        return held, why
    held.append(bounded)
    for g in (m.gate_up, m.down):
        if under_autocast(g.bmm):
            return held, Why(f"{describe(g.bmm)} runs under autocast: eager's bmm casts "
                             "its operands, the grouped GEMMs do not", "moe.batched_autocast")
    inside = set(m.nodes)
    adds = {g.bias_add for g in (m.gate_up, m.down) if g.bias_add is not None}
    for node in m.nodes:
        reader = next((u for u in node.users if u not in inside), None)
        if reader is not None and node is not m.total:
            return held, Why(f"{describe(node)} is also read by {describe(reader)}: the "
                             "grouped spelling never computes it", "moe.intermediate_read")
    order = {n: i for i, n in enumerate(m.total.graph.nodes)}
    for g in (m.gate_up, m.down):
        if calls(g.bias_add, {"add_"}) and any(
                order[u] < order[g.bias_add] for u in g.out.users if u is not g.bias_add):
            return held, Why(f"{describe(g.out)} is read before {describe(g.bias_add)} adds "
                             "the bias in place", "moe.in_place")
    read = {m.tokens, m.ids, m.scores, *(n for g in (m.gate_up, m.down)
                                         for n in (g.weight, g.bias) if n is not None)}
    watched = memory_sharers(inside | read)
    for node in m.total.graph.nodes:
        target = mutated_value(node)
        if target is not None and target in watched and node not in adds:
            return held, Why(f"{describe(node)} updates {describe(target)} in place",
                             "moe.in_place")
    held.append("the copies, the per-pair GEMMs' outputs and the weighted rows are read "
                "only on the way to the sum; nothing else updates what the grouped "
                "spelling reads in place")
    return held, None


def decide(m, recipe) -> Decision:
    """Legality of replacing match ``m`` by ``recipe`` (the pattern's grouped spelling,
    built by a builder: patterns/batched_experts.grouped_spelling). Pure."""
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    proof = statements.prove_batched_experts()
    seen = guarded_with_gradients(lambda m, grads=False: _replay(m, recipe, grads), m,
                                  bool(meta(m.total).requires_grad))
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps, seen)


class _Evaluate:
    """The builder the replay hands the recipe: each call made at once, on tensors."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen

    def call(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def method(self, name: str, target, *args, **kwargs):
        return getattr(target, name)(*args, **kwargs)

    def copy(self, node: fx.Node, copies: dict):
        env = {"__gen__": self.gen, **copies}
        eval_nodes([node], env)
        return env[node]


def _values(m, gen) -> dict:
    """float64 inputs at a few tokens, a narrow expert MLP, the model's widths; the ids
    drawn over [0, E) (so some experts get several rows and some none)."""
    t, k = min(_size(meta(m.tokens).shape[0]), 5), m.top_k
    e, inter = m.experts, 3
    f64 = torch.float64
    out = {m.tokens: torch.randn(t, _size(meta(m.tokens).shape[1]), generator=gen, dtype=f64),
           m.ids: torch.randint(0, e, (t * k,), generator=gen, dtype=meta(m.ids).dtype),
           m.scores: torch.rand(t * k, generator=gen, dtype=f64)}
    for g, n, k_in in ((m.gate_up, _halved(m) * inter, None), (m.down, None, inter)):
        shape = list(_size(s) for s in meta(g.weight).shape)
        if n is not None:  # the gate/up GEMM's output width
            shape[1 if g.weight_first else 2] = n
        else:  # the down GEMM's input width
            shape[2 if g.weight_first else 1] = k_in
        out[g.weight] = torch.randn(shape, generator=gen, dtype=f64)
        if g.bias is not None:
            width = shape[1] if g.weight_first else shape[2]
            out[g.bias] = torch.randn(e, width, generator=gen, dtype=f64)
    return out


def _replay(m, recipe, gradients: bool = False) -> str | Rejection:
    """The matched nodes (the per-pair copies, GEMVs and weighted sum) against the
    recipe on the same random values; ``gradients``: of (out · r).sum() to the tokens,
    the combine weights, the expert weights and biases."""
    values = _values(m, torch.Generator().manual_seed(0))
    t, k = values[m.tokens].shape[0], m.top_k
    floats = [n for n, v in values.items() if v.is_floating_point()]
    results = []
    for grouped in (False, True):
        leaves = {n: v.clone().requires_grad_(gradients and v.is_floating_point())
                  for n, v in values.items()}
        with torch.set_grad_enabled(gradients):
            gen = torch.Generator().manual_seed(1)
            if grouped:
                out = recipe(_Evaluate(gen), m, leaves)
            else:  # the view's sizes are the graph's: the sum is replayed at these
                env = {"__gen__": gen, **leaves}
                eval_nodes([n for n in m.nodes if n not in (m.view, m.total)], env)
                out = env[m.combine].view(t, k, -1).sum(1)
            if not gradients:
                results.append(out)
                continue
            r = torch.randn(out.shape, generator=torch.Generator().manual_seed(2),
                            dtype=out.dtype)
            grads = torch.autograd.grad((out * r).sum(), [leaves[n] for n in floats],
                                        allow_unused=True)
            results.append([torch.zeros_like(values[n]) if g is None else g
                            for g, n in zip(grads, floats)])
    if gradients:
        err = max(rel_err(a, b) for a, b in zip(*results))
        what = "the gradients of the tokens, the combine weights and the experts' weights"
    else:
        err = rel_err(results[1], results[0])
        what = f"{m.experts} experts, top-{k}, {t} tokens, random ids"
    return verdict(err, what, m.path, tol=1e-10)
