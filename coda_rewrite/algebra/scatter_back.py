"""Legality of the scatter-back rewrite (patterns/scatter_back.py): the identity
(statements.prove_token_routing), its side conditions on the matched graph, and a float64
replay at the match's sizes.

The match is ``rows[inv].view(T, k, N).sum(1)`` with ``inv`` built in place as the
inverse of a sort's permutation. Side conditions, each checked here:

* ``inv`` is ``empty_like(perm)`` written once, by ``inv[perm] = arange(L)`` with L
  perm's length, and updated by nothing else: inv[perm[s]] = s, so inv is perm's inverse;
* ``perm`` is the indices of a sort (or an argsort) of a 1-D tensor: a permutation, not
  updated in place;
* the view groups k consecutive rows per token (T·k = L rows, the last size the rows'
  width) and the sum runs over those k: token t's rows are the pairs t·k .. t·k + k - 1;
* ``rows[inv]`` and its view are read only by the sum, and nothing updates ``rows`` in
  place (the rewrite reads rows where the sum is, eager where the gather is).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..canonical import meta
from ..capture import describe
from ..graph_utils import (arg, in_place_update_of, in_place_updates, sole_user,
                           sort_permutation)
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .witness import _size, guarded, verdict


def inverse_of(inv: fx.Node) -> tuple[fx.Node | None, Why | None]:
    """(perm, None) where ``inv`` is built as the inverse of the permutation perm, else
    (None, why)."""
    if not isinstance(inv, fx.Node) or inv.target is not torch.empty_like or \
            len(inv.args) != 1 or inv.kwargs:
        return None, Why(f"{describe(inv)} is not an empty_like(...) written as an "
                         "inverse permutation", "scatter.inverse")
    perm = inv.args[0]
    writes = list(in_place_updates({inv}, inv.graph))
    if len(writes) != 1 or writes[0][0].target is not operator.setitem:
        return None, Why(f"{describe(inv)} is written otherwise than once by "
                         "inv[perm] = arange(L)", "scatter.inverse")
    _, key, value = writes[0][0].args
    mp = meta(perm) if isinstance(perm, fx.Node) else None
    # arange(L): 0 .. L - 1 (one argument; its length read from its value, symbolic or not)
    if key is not perm or mp is None or mp.dim() != 1 or not isinstance(value, fx.Node) or \
            value.target is not torch.arange or len(value.args) != 1 or \
            set(value.kwargs) - {"device"} or meta(value) is None or \
            not statically_known_true(meta(value).shape[0] == mp.shape[0]):
        return None, Why(f"{describe(inv)} is not written by inv[perm] = arange(len(perm))",
                         "scatter.inverse")
    if not sort_permutation(perm):
        return None, Why(f"{describe(perm)} is not the indices of a sort of a 1-D tensor",
                         "scatter.permutation")
    if in_place_update_of({perm}, perm.graph) is not None:
        return None, Why(f"{describe(perm)} is updated in place", "scatter.in_place")
    return perm, None


def grouping(m) -> Why | None:
    """Why the view and the sum do not sum each token's k consecutive rows (None: they
    do)."""
    mv, mi = meta(m.view), meta(m.index)
    if mv is None or mi is None or mv.dim() != 3 or mi.dim() != 2 or \
            not statically_known_true(mv.shape[0] * mv.shape[1] == mi.shape[0]) or \
            not statically_known_true(mv.shape[2] == mi.shape[1]):
        return Why(f"{describe(m.view)} is not [T, k, N] of the [T·k, N] rows",
                   "scatter.grouping")
    if arg(m.total, 1, "dim") not in (1, -2) or set(m.total.kwargs) - {"dim"} or \
            len(m.total.args) > 2:
        return Why(f"{describe(m.total)} does not sum over the k rows of a token",
                   "scatter.grouping")
    return None


def side_conditions(m) -> tuple[list[str], Why | None]:
    why = grouping(m)
    if why is not None:
        return [], why
    if sole_user(m.index) is not m.view or sole_user(m.view) is not m.total:
        return [], Why(f"{describe(m.index)} or its view is read besides the sum",
                       "scatter.read")
    if in_place_update_of({m.rows}, m.rows.graph) is not None:
        return [], Why(f"{describe(m.rows)} is updated in place", "scatter.in_place")
    return [f"{describe(m.inverse)} is the inverse of {describe(m.perm)} (written once by "
            "inv[perm] = arange), a sort's permutation",
            f"each token's {m.top_k} rows are consecutive ([T, k, N] view, sum over k)",
            f"{describe(m.index)} and its view are read only by the sum; "
            f"{describe(m.rows)} is not updated in place"], None


def decide(m) -> Decision:
    held, failed = side_conditions(m)
    if failed is not None:
        return Rejection(failed, m.path)
    proof = statements.prove_token_routing()
    seen = guarded(_replay, m)
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps,
                 f"{seen}; {proof.witness}")


def _replay(m) -> str | Rejection:
    """The eager form at the match's sizes against routing.sum_to_tokens in float64, on a
    random permutation: the outputs, and the rows' gradient."""
    from .. import routing
    rows_shape = [_size(s) for s in meta(m.rows).shape]
    n, k = rows_shape[0], m.top_k
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=g)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    rows = torch.randn(rows_shape, generator=g, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():  # the pass may run under the caller's no_grad
        want = rows[inv].view(n // k, k, -1).sum(1)
        got = routing.sum_to_tokens(rows, perm, inv, k)
        d = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (dw,), (dg,) = (torch.autograd.grad((o * d).sum(), rows) for o in (want, got))
    return verdict(max(rel_err(got.detach(), want.detach()), rel_err(dg, dw)),
                   f"a random permutation of {n} rows, outputs and gradient", m.path)
