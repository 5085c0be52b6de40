"""Legality of an LM head → cross-entropy rewrite: the identity, the side conditions on
the matched graph, and a float64 replay of the matched nodes against the rewrite.

Identity: F.cross_entropy(y, t)_i = log Σ_j exp(y[i, j]) − y[i, t_i] for a row whose
target is a class index, 0 for an ignored row; the log-sum-exp is merged from per-tile
(max, Σ exp) states (statements.prove_lse_merge: associative, commutative, with an
identity, NaN-free at the (−∞, 0) identity), and the target logit lives in exactly one
tile. Side conditions checked here:

* between the GEMM and the loss only views that keep the class dim, upcasts, and at
  most one slice of rows (the pattern refuses anything else);
* nothing else reads those intermediate values, and nothing updates the logits in place;
* a reader of the logits other than the loss comes after the loss in the graph (the
  fused GEMM runs where the loss was; the pass does not move other nodes).
"""

from __future__ import annotations

import dataclasses

import torch

from ..canonical import meta
from ..capture import describe
from ..codegen.program import parse
from ..kernels import ops
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection
from .row_scale import mutated_value
from .witness import _eval, _size, _Unreplayable


def side_conditions(m) -> tuple[list[str], str | None]:
    held = []
    nodes = [m.proj.out, *m.chain]
    for node, nxt in zip(nodes, [*m.chain, m.ce]):
        others = [u for u in node.users if u is not nxt and node is not m.proj.out]
        if others:
            return held, (f"{describe(node)} is also read by "
                          f"{', '.join(describe(u) for u in others)}")
    for reader in m.logits_readers:
        if mutated_value(reader) is m.proj.out:
            return held, f"{describe(reader)} updates the logits in place"
    order = {n: i for i, n in enumerate(m.ce.graph.nodes)}
    early = [r for r in m.logits_readers if order[r] < order[m.ce]]
    if early:
        return held, (f"the logits are read before the loss ({describe(early[0])}); the "
                      "fused GEMM would run after that reader")
    held.append("between the GEMM and the loss: " + (", ".join(
        describe(n) for n in m.chain) or "nothing") + " (views, upcasts, a row slice)")
    if m.row_slice is not None:
        dim, start, stop = m.row_slice
        held.append(f"rows outside the slice {start}:{stop} of dim {dim} get ignore_index "
                    f"({m.ignore_index}): they contribute 0 and are not counted")
    held.append("logits " + ("written as eager writes them (read by " + ", ".join(
        describe(r) for r in m.logits_readers) + ")" if m.materialise else
        "never written" + (" (materialize_logits=False: readers get an empty tensor)"
                           if m.logits_readers else " (nothing reads them)")))
    return held, None


def decide(m, witness: bool = True) -> Decision:
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    merge = statements.prove_lse_merge()
    seen = replay(m) if witness else ""
    if isinstance(seen, Rejection):
        return seen
    return Proof(
        "CE(y, t)_i = log Σ_j exp y[i, j] − y[i, t_i] (0 for an ignored row), the "
        "log-sum-exp merged from per-tile (max, Σexp) states",
        (*merge.assumptions, *held),
        (f"merge: {merge.statement}",
         "y[i, t_i] is read in the one tile that holds column t_i; the others give 0",
         f"reduction {m.reduction!r}: " + {
             "mean": "Σ_i loss_i / #(rows not ignored), as PyTorch (NaN if none)",
             "sum": "Σ_i loss_i", "none": "loss_i for the loss's own rows"}[m.reduction]),
        seen)


def replay(m) -> str | Rejection:
    try:
        return _replay(m)
    except _Unreplayable as e:
        return f"skipped: {e}"
    except (RuntimeError, IndexError, ValueError) as e:
        return f"skipped: the matched nodes do not replay at small shapes ({e})"


def _exact(program_text: str) -> str:
    prog = parse(program_text)
    return dataclasses.replace(prog, outputs=tuple(
        dataclasses.replace(o, dtype="float64") for o in prog.outputs)).to_text()


def _replay(m) -> str | Rejection:
    gen = torch.Generator().manual_seed(97)
    p = m.proj
    out_shape = meta(p.out).shape
    lead = [min(_size(s), 3) for s in out_shape[:-1]]
    vocab = _size(out_shape[-1])
    k = 8
    env: dict = {"__gen__": gen}

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    env[p.x] = rand(*lead, k)
    env[p.weight] = rand(vocab, k)
    if p.bias is not None:
        env[p.bias] = rand(vocab)
    if p.r is not None:
        env[p.r] = rand(*lead, 1).abs() + 0.5
    order = {n: i for i, n in enumerate(m.ce.graph.nodes)}
    for node in sorted(p.nodes, key=order.__getitem__):
        if node.target is ops.fused_linear:
            env[node] = ops.fused_linear_reference(
                _exact(node.args[0]), *(env[a] for a in node.args[1:]))
        else:
            env[node] = _eval(node, env)
    for node in m.chain:
        env[node] = _eval(node, env)
    rows = env[m.chain[-1] if m.chain else p.out].shape[0]
    t = torch.randint(0, vocab, (rows,), generator=gen)
    t[::3] = m.ignore_index
    env[m.target] = t
    eager = _eval(m.ce, env)

    x = env[p.x]
    dim, start, stop = m.row_slice if m.row_slice is not None else (None, None, None)
    targets = ops.row_targets(t, x, vocab, dim, start, stop, m.ignore_index)
    operands = ([env[p.r]] if p.r is not None else []) + \
        ([env[p.bias]] if p.bias is not None else []) + [targets]
    outs = ops.fused_linear_reference(_exact(m.program.to_text()), x, env[p.weight], *operands)
    ours = ops.cross_entropy_from_rows(outs[-2], targets, m.ignore_index, m.reduction, x,
                                       dim, start, stop, torch.float64)
    err = rel_err(ours.reshape(eager.shape), eager.double())
    tol = 1e-6
    if not err <= tol:
        return Rejection(f"checker bug: the float64 witness disagrees ({err:.1e}; tol "
                         f"{tol:g}); the rewrite is not applied", m.path)
    return f"replay in float64 on rows {lead}, every third target ignored: rel. error " \
           f"{err:.1e} (tol {tol:g})"
