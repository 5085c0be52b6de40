"""Legality of running a dense experts layer on its routed rows only
(patterns/dense_experts.py): the identity (statements.prove_dense_experts), its side
conditions on the matched graph, and a float64 replay of the matched nodes (the router
from its logits, every expert on every token, the sum) against the routed form
(coda_rewrite/routing.py) on the same values, and of their gradients in a training graph.

Side conditions, each checked here:

* each expert's input is token t's row times scores[t, e] (``tokens.repeat(E, 1)`` times
  the scores' transposed column; the replay checks the pairing);
* the scores are zero, exactly, off the router's top-k: a tensor filled with a constant c
  into which the top-k values are scattered at the top-k indices, then elementwise ops
  (casts, a sigmoid, ...) that map c to 0 (sigmoid(−∞) = 0); the top-k indices are
  distinct per token (torch.topk over the experts), so each chosen pair is one routed row;
* each expert's MLP maps a zero row to a zero row: no bias (torch.bmm has none), and the
  gated product of two zero lanes is zero (act(0)·0, replayed: finite act(0));
* what the routed form never computes — the scaled copies, both dense GEMMs' outputs, the
  halves, the activation, the product, the views before the sum — is read only inside the
  match, and nothing updates the values the routed form reads (tokens, scores, indices,
  weights) in place.

Not covered: non-finite tokens or expert weights. Eager multiplies them by a zero score
(∞·0 = NaN), so one bad expert weight makes every token's output NaN there, and one
bad token every expert's row; the routed form runs only the chosen pairs, so the NaN
stays on the tokens and experts that hold it.
"""

from __future__ import annotations

import torch

from ..canonical import meta, under_autocast
from ..capture import describe
from ..graph_utils import memory_sharers, mutated_value
from .. import routing
from ..codegen import reference
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .witness import _size, eval_nodes, guarded_with_gradients, verdict


def side_conditions(m) -> tuple[list[str], str | None]:
    """(conditions that hold, the first that does not)."""
    held = []
    e, top_k = _size(meta(m.w_gate_up).shape[0]), m.top_k
    t, k = (_size(s) for s in meta(m.tokens).shape)
    ok = (tuple(_size(s) for s in meta(m.scores).shape) == (t, e) and
          tuple(_size(s) for s in meta(m.index).shape) == (t, top_k) and
          _size(meta(m.w_gate_up).shape[1]) == k and m.repeats == e and
          _size(meta(m.w_down).shape[0]) == e and top_k <= e and
          2 * _size(meta(m.w_down).shape[1]) == _size(meta(m.w_gate_up).shape[2]))
    if not ok:
        return held, Why(f"tokens {_shape(m.tokens)}, scores {_shape(m.scores)}, top-k "
                         f"indices {_shape(m.index)}, expert weights {_shape(m.w_gate_up)} "
                         f"and {_shape(m.w_down)}, {m.repeats} copies: not [T, K], [T, E], "
                         "[T, k], [E, K, 2I], [E, I, K'], E", "moe.dense_shapes")
    held.append(f"{e} experts, top-{top_k} routing over [T, {e}] scores")
    if under_autocast(m.gate_up):
        return held, Why(f"{describe(m.gate_up)} runs under autocast: eager's bmm casts "
                         "its operands and rounds its output to the autocast dtype, the "
                         "routed grouped GEMMs do not (torch._grouped_mm is not "
                         "autocast-aware): the layer's dtypes would change", "moe.dense_autocast")
    inside = set(m.nodes)
    for node in m.dense:  # the scores' column may live on: it is [T·E, 1]
        reader = next((u for u in node.users if u not in inside), None)
        if reader is not None and node is not m.out and node not in m.column:
            return held, Why(f"{describe(node)} is also read by {describe(reader)}: the "
                             "routed form never computes it", "moe.dense_intermediate_read")
    read = {m.tokens, m.scores, m.index, m.w_gate_up, m.w_down}
    watched = memory_sharers(set(m.dense) | read)
    for node in m.tokens.graph.nodes:
        target = mutated_value(node)
        if target is not None and target in watched and node is not m.scatter:
            return held, Why(f"{describe(node)} updates {describe(target)} in place",
                             "moe.dense_in_place")
    held.append("the dense intermediates are read only on the way to the sum over the "
                "experts; nothing updates what the routed form reads in place")
    why = _zero_off_top_k(m)
    if why:
        return held, why
    held.append(f"scores[t, e] = 0 exactly off the top-{top_k}: the fill {m.fill:g} maps "
                f"to 0 through {describe(m.scores)}'s elementwise chain")
    zero = _pair_of_zero(m)
    if zero:
        return held, Why(f"the gated product of zero lanes is {zero}, not 0: an expert "
                         "would add to tokens it was not chosen for", "moe.dense_zero_row")
    held.append("each expert's MLP maps a zero row to zero (no bias; act(0)·0 = 0)")
    return held, None


def _shape(node) -> tuple:
    return tuple(meta(node).shape) if meta(node) is not None else ("?",)


def _zero_off_top_k(m) -> str | None:
    """Why the scores are not exactly zero off the top-k (None: they are): the router's
    chain from the scatter to the scores replayed on a tensor of the fill constant."""
    z = meta(m.scatter)
    env = {m.scatter: torch.full((1, 1), m.fill, dtype=z.dtype)}
    try:
        eval_nodes(m.chain, env)
    except (RuntimeError, TypeError, ValueError) as e:
        return Why(f"the scores' chain does not replay on the fill ({e})",
                   "moe.dense_scores")
    value = env[m.scores] if m.chain else env[m.scatter]
    if not bool((value == 0).all()):
        return Why(f"the scores off the top-k are {float(value.flatten()[0]):g}, not 0 "
                   f"({describe(m.scores)} of the fill {m.fill:g}): every expert "
                   "contributes to every token", "moe.dense_scores")
    return None


def _pair_of_zero(m) -> str:
    """The gated product of two zero lanes where it is not exactly zero ("" where it is)."""
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    env = {m.gate: zeros, m.up: zeros.clone(), "__gen__": torch.Generator().manual_seed(0)}
    eval_nodes([*m.act_nodes, m.mul], env)
    out = env[m.mul]
    return "" if bool((out == 0).all()) else f"{float(out.flatten()[0]):g}"


def decide(m) -> Decision:
    """Legality of replacing match ``m`` by its routed form. Pure."""
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    proof = statements.prove_dense_experts()
    seen = guarded_with_gradients(_replay, m, bool(meta(m.out).requires_grad))
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps, seen)


def _values(m, gen) -> dict:
    """Random float64 values for the match's inputs at small sizes: few tokens, a narrow
    expert MLP; the experts and the model widths as the graph's views spell them."""
    e = _size(meta(m.w_gate_up).shape[0])
    k, k_out = _size(meta(m.tokens).shape[1]), _size(meta(m.w_down).shape[2])
    t, inter = 7, 3
    f64 = torch.float64
    return {m.logits: torch.randn(t, e, generator=gen, dtype=f64),
            m.tokens: torch.randn(t, k, generator=gen, dtype=f64),
            m.w_gate_up: torch.randn(e, k, 2 * inter, generator=gen, dtype=f64),
            m.w_down: torch.randn(e, inter, k_out, generator=gen, dtype=f64)}


def _replay(m, gradients: bool = False) -> str | Rejection:
    """The matched nodes — the router from random logits, every expert on every token,
    the sum — against the routed form on the same values; ``gradients``: the gradients
    of (out · r).sum() to the tokens, the logits and both expert weights."""
    gen = torch.Generator().manual_seed(0)
    values = _values(m, gen)
    results = []
    for routed in (False, True):
        leaves = {n: v.clone().requires_grad_(gradients) for n, v in values.items()}
        with torch.set_grad_enabled(gradients):
            env = {"__gen__": torch.Generator().manual_seed(1), **leaves}
            eval_nodes(m.router, env)
            out = _routed(m, env) if routed else _dense(m, env)
            if not gradients:
                results.append(out)
                continue
            r = torch.randn(out.shape, generator=torch.Generator().manual_seed(2),
                            dtype=out.dtype)
            grads = torch.autograd.grad((out * r).sum(), list(leaves.values()),
                                        allow_unused=True)
            results.append([torch.zeros_like(v) if g is None else g
                            for g, v in zip(grads, leaves.values())])
    if gradients:
        err = max(rel_err(a, b) for a, b in zip(*results))
        what = "the gradients of the tokens, the router logits and both expert weights"
    else:
        err = rel_err(results[1], results[0])
        what = (f"{_size(meta(m.w_gate_up).shape[0])} experts, top-{m.top_k}, "
                f"{values[m.tokens].shape[0]} tokens")
    return verdict(err, what, m.path, tol=1e-10)


def _dense(m, env: dict) -> torch.Tensor:
    eval_nodes(m.dense, env)
    return env[m.out]


def _routed(m, env: dict) -> torch.Tensor:
    """The routed form (coda_rewrite/routing.py) with the matched activation replayed on the
    routed rows' halves."""
    index, scores = env[m.index], env[m.scores]
    perm, offsets, inverse = routing.sort_by_expert(index, _size(meta(m.w_gate_up).shape[0]))
    x = routing.gather_scaled(env[m.tokens], scores, index, perm, inverse)
    p = reference.grouped_mm(x, env[m.w_gate_up], offsets)
    lanes = {m.gate_up: p, "__gen__": env["__gen__"]}
    eval_nodes(m.pair_nodes, lanes)
    o = reference.grouped_mm(lanes[m.product], env[m.w_down], offsets)
    return routing.sum_to_tokens(o, perm, inverse, m.top_k)
