"""Legality of an LM head → cross-entropy rewrite: the identity, the side conditions on
the matched graph, and a float64 replay of the matched nodes against the rewrite (where
the loss trains, of the gradients too, the program differentiated by the backward rule
training runs: witness.run_program).

Identity: F.cross_entropy(y, t)_i = log Σ_j exp(y[i, j]) − y[i, t_i] for a row whose
target is a class index, 0 for an ignored row; the log-sum-exp is merged from per-tile
(max, Σ exp) states (statements.prove_lse_merge: associative, commutative, with an
identity, NaN-free at the (−∞, 0) identity), and the target logit lives in exactly one
tile. Side conditions checked here:

* between the GEMM and the loss only views that keep the class dim, upcasts, at most
  one slice of rows, and an elementwise map z = g(y) by constants with at most one tanh
  (the pattern refuses anything else): the loss is that of z, and z is what the
  model's other readers of the logits get;
* nothing else reads those intermediate values, and nothing updates the logits in place;
* a reader of the logits other than the loss comes after the loss in the graph (the
  fused GEMM runs where the loss was; the pass does not move other nodes).
"""

from __future__ import annotations

import torch

from ..canonical import meta
from ..capture import describe
from ..codegen import layouts
from ..graph_utils import mutated_value, updated_between
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .witness import (LEAVES, MATH, _Unreplayable, _size, eval_nodes, exact, fused_linear,
                      gradient_error, guarded_with_gradients, verdict)


def describe_map(logits_map: tuple) -> str:
    """z = g(y) as text: ``tanh(y / 30) * 30``."""
    z = "y"
    for op, c in logits_map:
        z = f"tanh({z})" if op == "tanh" else f"{z} {'*' if op == 'mul' else '/'} {c:g}"
    return z


def side_conditions(m, materialise: bool) -> tuple[list[str], str | None]:
    held = []
    nodes = [m.proj.out, *m.chain]
    for node, nxt in zip(nodes, [*m.chain, m.ce]):
        others = [u for u in node.users if u is not nxt and node is not m.logits]
        if others:
            return held, Why(f"{describe(node)} is also read by "
                             f"{', '.join(describe(u) for u in others)}",
                             "cross_entropy.chain_read")
    for reader in m.logits_readers:
        if mutated_value(reader) is m.logits:
            return held, Why(f"{describe(reader)} updates the logits in place",
                             "cross_entropy.in_place")
    order = {n: i for i, n in enumerate(m.ce.graph.nodes)}
    gemm = min((n for n in m.proj.nodes if n in order), key=order.get, default=m.proj.out)
    moved = updated_between([m.proj.x, m.proj.weight, m.proj.bias, m.proj.r],
                            gemm, m.ce)
    if moved is not None:  # the fused GEMM runs at the loss, eager's GEMM before
        return held, Why(f"{describe(moved[0])} updates {describe(moved[1])} in place between "
                         "the logits GEMM and the loss, where the fused GEMM would read it",
                         "cross_entropy.in_place")
    early = [r for r in m.logits_readers if order[r] < order[m.ce]]
    if early:
        return held, Why(f"the logits are read before the loss ({describe(early[0])}); the "
                         "fused GEMM would run after that reader",
                         "cross_entropy.read_before_loss")
    held.append("between the GEMM and the loss: " + (", ".join(
        describe(n) for n in m.chain) or "nothing") + " (views, upcasts, a row slice"
        + (", an elementwise map by constants" if m.logits_map else "") + ")")
    if m.logits_map:
        held.append(f"the logits the loss and the model's readers see are z = "
                    f"{describe_map(m.logits_map)}, computed in the epilogue in float32 "
                    "(eager: in the logits' dtype)")
    if m.row_slice is not None:
        dim, start, stop = m.row_slice
        held.append(f"rows outside the slice {start}:{stop} of dim {dim} get ignore_index "
                    f"({m.ignore_index}): they contribute 0 and are not counted")
    if materialise and m.logits_readers:
        shown = "written as eager writes them (read by " + ", ".join(
            describe(r) for r in m.logits_readers) + ")"
    elif materialise:
        shown = ("written for the backward only, as eager keeps them (its softmax gradient "
                 "is one pass over them; materialize_logits=False recomputes them instead)")
    elif m.logits_readers or meta(m.ce).requires_grad:
        shown = ("never written (materialize_logits=False: " + (
            "readers get an empty tensor; " if m.logits_readers else "") +
            "the backward recomputes them in a GEMM)")
    else:
        shown = "never written (nothing reads them)"
    held.append("logits " + shown)
    return held, None


def decide(m, program, materialise: bool) -> Decision:
    """Legality of the fused logits GEMM + loss running ``program``. Pure."""
    held, failed = side_conditions(m, materialise)
    if failed:
        return Rejection(failed, m.path)
    merge = statements.prove_lse_merge()
    trains = meta(m.ce) is None or meta(m.ce).requires_grad  # untraced: replayed (closed)
    seen = guarded_with_gradients(
        lambda m, gradients=False: _replay(m, program, gradients), m, trains)
    if isinstance(seen, Rejection):
        return seen
    mapped = ()
    if m.logits_map:
        derivative = statements.prove_logits_map_derivative()
        mapped = (f"z = g(y) elementwise, so tile-local; the backward's g'(y) from z: "
                  f"{derivative.statement}",)
    return Proof(
        "CE(z, t)_i = log Σ_j exp z[i, j] − z[i, t_i] (0 for an ignored row), the "
        "log-sum-exp merged from per-tile (max, Σexp) states" + (
            f", z = {describe_map(m.logits_map)}" if m.logits_map else ", z = y"),
        (*merge.assumptions, *held),
        (*mapped, f"merge: {merge.statement}",
         "z[i, t_i] is read in the one tile that holds column t_i; the others give 0",
         f"reduction {m.reduction!r}: " + {
             "mean": "Σ_i loss_i / #(rows not ignored), as PyTorch (NaN if none)",
             "sum": "Σ_i loss_i", "none": "loss_i for the loss's own rows"}[m.reduction]),
        seen)


def _replay(m, program, gradients: bool = False) -> str | Rejection:
    """The matched nodes (GEMM, chain, loss) on random float64 inputs with every third
    target ignored, against the rewrite's program and reduction on the same inputs. With
    ``gradients`` (a loss that trains): x, the weight, the bias and the row scale are
    leaves, casts identities, and the gradients of the loss (and of the logits where the
    model reads them) to each are compared, the program differentiated by the rule
    training runs (witness.run_program)."""
    gen = torch.Generator().manual_seed(97)
    p = m.proj
    out_shape = meta(p.out).shape
    lead = [min(_size(s), 3) for s in out_shape[:-1]]
    vocab = _size(out_shape[-1])  # the real vocab: views in the chain may spell it out
    k = 8
    env: dict = {"__gen__": gen, MATH: gradients}
    leaves: list[torch.Tensor] = []

    def rand(*shape):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64)
        if gradients:
            leaves.append(t.requires_grad_())
        return t

    env[p.x] = rand(*lead, k)
    env[p.weight] = rand(vocab, k)
    if p.bias is not None:
        env[p.bias] = rand(vocab)
    if p.r is not None:
        env[p.r] = rand(*lead, 1).abs() + 0.5
    eval_nodes([*p.nodes, *m.chain], env)
    rows = env[m.chain[-1] if m.chain else p.out].shape[0]
    t = torch.randint(0, vocab, (rows,), generator=gen)
    t[::3] = m.ignore_index
    env[m.target] = t
    eval_nodes([m.ce], env)

    x = env[p.x]
    dim, start, stop = m.row_slice if m.row_slice is not None else (None, None, None)
    targets = layouts.row_targets(t, x, vocab, dim, start, stop, m.ignore_index)
    operands = ([env[p.r]] if p.r is not None else []) + \
        ([env[p.bias]] if p.bias is not None else []) + [targets]
    outs = fused_linear(exact(program.to_text()), x, env[p.weight], *operands,
                        gradients=gradients)
    ours = layouts.cross_entropy_from_rows(outs[-2], targets, m.ignore_index, m.reduction, x,
                                           dim, start, stop, torch.float64)
    eager = env[m.ce]
    if gradients:
        gots, refs = [ours.reshape(eager.shape)], [eager]
        if len(outs) == 3 and m.logits_readers:  # the logits the model reads: dlogits too
            if env.get(m.logits) is None:  # fail closed: a gradient the replay cannot see
                raise _Unreplayable(f"the logits the model reads ({describe(m.logits)}) "
                                    "are not among the replayed nodes")
            gots.append(outs[0].reshape(env[m.logits].shape))
            refs.append(env[m.logits])
        leaves += env.get(LEAVES, [])
        return verdict(gradient_error(gots, refs, leaves),
                       f"the gradients to the {len(leaves)} inputs, rows {lead}", m.path,
                       gradients=True)
    return verdict(rel_err(ours.reshape(eager.shape), eager.double()),
                   f"rows {lead}, every third target ignored", m.path)
