"""Legality of a gated-MLP rewrite: the interleave identity, its side conditions on the
matched graph, and a float64 replay of the matched nodes against the fused program.

The identity (statements.prove_gated_interleave): with W_int[2j] = W_g[j] and
W_int[2j+1] = W_u[j], the GEMM x·W_intᵀ holds the gate GEMM's (i, j) entry at column 2j
and the up GEMM's at 2j+1, so act(r·acc[i,2j])·(r·acc[i,2j+1]) is eager's
act(gate)·up. Side conditions, each checked here:

* gate and up read the same input (and, if they are rewritten norm consumers, the same
  deferred row scale r: the scale is applied before the activation, which is not
  linear, so both lanes of a pair must carry the same one);
* nothing else reads gate, up or act(gate): the fused GEMM never writes them;
* gate, up and the product share one dtype (no cast between them that the fused
  epilogue would skip).

In a training graph the down projection that reads the product may take its backward
from the fused one (kernels/gated_down.py: dSwiGLU/dGeGLU in its dgrad GEMM's epilogue):
decide_down checks that it is the product's only reader and replays the matched nodes'
gradients in float64 against the fused backward's math (statements.prove_gated_backward).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..canonical import canon, meta
from ..capture import describe
from ..codegen import layouts
from ..graph_utils import same_value, updated_between
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .witness import (MATH, _size, eval_nodes, exact, fused_linear, gradient_error, guarded,
                      guarded_with_gradients, replay_off_thread, verdict)


def _only_reader(value: fx.Node, reader: fx.Node) -> str | None:
    """None if ``reader`` is all that reads ``value`` (through dtype-preserving casts)."""
    node = value
    while True:
        users = list(node.users)
        if users == [reader]:
            return None
        if len(users) == 1 and canon(users[0]) is not None and canon(users[0]).name == "cast":
            node = users[0]
            continue
        others = [u for u in users if u is not reader]
        return Why(
                f"{describe(node)} is also read by {', '.join(describe(u) for u in others)}: "
                "the fused GEMM never writes it", "gated.intermediate_read")


def side_conditions(m) -> tuple[list[str], str | None]:
    """(conditions that hold, the first that does not)."""
    held = []
    g, u = m.gate, m.up
    if m.packed:
        chunk = g.nodes[-1]
        for v, reader in ((m.gate_value, m.gate_reader), (m.up_value, m.up_reader),
                          (g.out, chunk), *_clamp_readers(m)):
            why = _only_reader(v, reader)
            if why:
                return held, why
        if set(chunk.users) != {m.gate_value, m.up_value}:
            return held, Why(f"{describe(chunk)} has readers besides its two halves",
                             "gated.chunk_read")
        if meta(g.out).shape[-1] % 2:
            return held, Why("the packed projection has an odd number of output features",
                             "gated.odd_packed")
        held.append("gate and up are the two halves of one projection: same input, same "
                    "row scale")
        gate_v, up_v = m.gate_value, m.up_value
    else:
        if g.out is u.out:
            return held, Why("gate and up are the same GEMM output", "gated.same_output")
        if not same_value(g.x, u.x):
            return held, Why(f"gate and up read different inputs ({describe(g.x)} vs "
                             f"{describe(u.x)})", "gated.different_inputs")
        if (g.r is None) != (u.r is None) or (g.r is not None and not same_value(g.r, u.r)):
            return held, Why("gate and up carry different deferred row scales (the scale "
                             "precedes the activation: a pair needs one)",
                             "gated.different_row_scales")
        if tuple(meta(g.out).shape) != tuple(meta(u.out).shape):
            return held, Why("gate and up outputs differ in shape", "gated.shapes")
        held.append(f"gate and up read the same input {describe(g.x)}"
                    + (f" and row scale {describe(g.r)}" if g.r is not None else ""))
        for v, reader in ((g.out, m.gate_reader), (u.out, m.up_reader), *_clamp_readers(m)):
            why = _only_reader(v, reader)
            if why:
                return held, why
        for p in (g, u):  # the rowscale call behind a getitem: read by that getitem only
            for n in p.nodes[1:]:
                if len(n.users) != 1:
                    return held, Why(f"{describe(n)} has other readers", "gated.call_read")
        gate_v, up_v = g.out, u.out
    why = _only_reader(m.act, m.mul)
    if why:
        return held, why
    held.append("gate, up and act(gate) are read only by the gated product")
    dtypes = {meta(n).dtype for n in (gate_v, up_v, m.act, m.mul, *m.clamps)}
    if len(dtypes) != 1:
        return held, Why(f"gate, up, act(gate) and the product differ in dtype "
                         f"({sorted(map(str, dtypes))}): a cast between them", "gated.dtypes")
    if tuple(meta(m.mul).shape) != tuple(meta(gate_v).shape):
        return held, Why("the product broadcasts gate against up", "gated.broadcast")
    held.append(f"one dtype throughout ({dtypes.pop()})")
    why = moved_read_updated(m)
    if why:
        return held, why
    held.append("nothing the fused GEMM reads is updated in place between eager's reads and "
                "the product")
    return held, None


def _clamp_readers(m) -> tuple:
    """(clamp, its only reader) of the clamped SwiGLU's two clamps: the gate's by the
    activation, the up lane's by the product."""
    return ((m.clamps[0], m.act), (m.clamps[1], m.mul)) if m.clamps else ()


def moved_read_updated(m) -> Why | None:
    """The fused GEMM runs where the product was, so it reads x, the weights, biases and
    row scale there, later than eager's gate and up GEMMs did: an update in place of one
    of them (or of memory one shares) in between would reach the fused GEMM and not
    eager's (a gate GEMM, then x.add_(1), then the up GEMM: the two read different x)."""
    projections = (m.gate,) if m.packed else (m.gate, m.up)
    order = {n: i for i, n in enumerate(m.mul.graph.nodes)}
    first = min((n for p in projections for n in p.nodes if n in order), key=order.get)
    found = updated_between([v for p in projections for v in (p.x, p.weight, p.bias, p.r)],
                            first, m.mul)
    if found is None:
        return None
    return Why(f"{describe(found[0])} updates {describe(found[1])} in place between eager's "
               "gate/up GEMMs and the product: the fused GEMM, which runs at the product, "
               "would read the updated value", "gated.in_place")


def decide(m, program) -> Decision:
    """Legality of replacing match ``m`` by one GEMM running ``program``. Pure."""
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    proof = statements.prove_gated_interleave()
    product = meta(m.mul)
    seen = guarded_with_gradients(
        lambda m, gradients=False: _replay(m, program, gradients), m,
        product is None or product.requires_grad)  # unknown counts as training: replay
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps, seen)


def _replay(m, program, gradients: bool = False) -> str | Rejection:
    """The matched nodes on random float64 inputs (small shapes) against the fused
    program, through the reference, on the same inputs; with ``gradients`` (a match that
    trains), the inputs, row scale, weights and biases are leaves, casts identities, and
    the gradients of both sides to each are compared instead."""
    leaves: list[torch.Tensor] | None = [] if gradients else None
    env, lead, w_int, b_int = _random_inputs(m, leaves)
    g, u = m.gate, m.up
    eval_nodes([*g.nodes, *u.nodes, *([m.gate_value, m.up_value] if m.packed else []),
                *m.clamps, m.act, m.mul], env)
    operands = ([env[g.r]] if g.r is not None else []) + ([b_int] if b_int is not None else [])
    fused = fused_linear(exact(program.to_text()), env[g.x], w_int, *operands,
                         gradients=gradients)[0]
    if leaves is not None:
        return verdict(gradient_error([fused], [env[m.mul]], leaves),
                       f"the gradients to the {len(leaves)} inputs, rows {lead}", m.path,
                       gradients=True)
    return verdict(rel_err(fused, env[m.mul]), f"rows {lead}", m.path)


def _random_inputs(m, leaves: list | None = None):
    """(env, leading shape, W_int, b_int): random float64 values for the projections'
    input, row scale, weights and biases, at small shapes; each a leaf appended to
    ``leaves`` where given (a gradient replay, whose casts are identities)."""
    gen = torch.Generator().manual_seed(4321)

    def rand(*shape, positive=False):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64)
        t = t.abs() + 0.5 if positive else t
        if leaves is not None:
            leaves.append(t.requires_grad_())
        return t

    g, u = m.gate, m.up
    out_shape = meta(g.out).shape  # the GEMM output (rewritten nodes may lack meta)
    lead = [min(_size(s), 3) for s in out_shape[:-1]]
    k = min(_contracted(g), 16)
    n = min(_size(out_shape[-1]) // (2 if m.packed else 1), 6)
    env: dict = {"__gen__": gen, MATH: leaves is not None}
    env[g.x] = env[u.x] = rand(*lead, k)
    if g.r is not None:
        env[g.r] = env[u.r] = rand(*lead, 1, positive=True)
    if m.packed:
        env[g.weight] = rand(2 * n, k)
        if g.bias is not None:
            env[g.bias] = rand(2 * n)
        relayout = getattr(layouts, m.relayout)  # [gate; up] or [up; gate]
        w_int = relayout(env[g.weight])
        b_int = relayout(env[g.bias]) if g.bias is not None else None
    else:
        for p in (g, u):
            env[p.weight] = rand(n, k)
            if p.bias is not None:
                env[p.bias] = rand(n)
        w_int = layouts.interleave_rows(env[g.weight], env[u.weight])
        b_int = None if g.bias is None and u.bias is None else \
            layouts.interleave_rows(env.get(g.bias), env.get(u.bias))
    return env, lead, w_int, b_int


# ---- the down projection's backward in its dgrad GEMM (kernels/gated_down.py) ----------

def down_conditions(m, down) -> tuple[list[str], str | None]:
    """(conditions that hold, the first that does not) for fusing the backward of the
    down projection ``down`` (patterns/gated_mlp.Down) reading the gated product."""
    held = []
    if list(m.mul.users) != [down.linear]:
        return held, Why(f"{describe(m.mul)} is read by "
                         f"{', '.join(describe(u) for u in m.mul.users)}: the fused backward "
                         "gives the product's whole gradient to the pre-activation, so the "
                         "down projection must be its only reader", "gated.down_other_reader")
    held.append("the gated product is read only by the down projection, as its input")
    for n in down.between:
        if len(n.users) != 1:
            return held, Why(f"{describe(n)} (the down weight's transpose) has other readers",
                             "gated.down_weight_read")
    return held, None


def upstream(node: fx.Node, known: set) -> list[fx.Node]:
    """``node`` and every node it reads, back to the ``known`` ones."""
    out, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        if n in known or n in seen:
            continue
        seen.add(n)
        out.append(n)
        todo.extend(n.all_input_nodes)
    return out


def decide_down(m, down) -> Decision:
    """Legality of giving ``down``'s backward to kernels/gated_down.GatedDown. Pure."""
    held, failed = down_conditions(m, down)
    if failed:
        return Rejection(failed, m.path)
    proof = statements.prove_gated_backward()
    seen = guarded(lambda m: replay_off_thread(_replay_down, m, down), m)
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps, seen)


def _replay_down(m, down) -> str | Rejection:
    """The matched activation, product and down projection differentiated by autograd
    on random float64 inputs, against the fused backward's math (codegen/reference.dgated
    on the dgrad GEMM dh = dout·W_d, W_d's gradient doutᵀ·h) on the same inputs."""
    from ..codegen import reference

    env, lead, _, _ = _random_inputs(m)
    gen = env["__gen__"]
    g, u = m.gate, m.up
    gate_v, up_v = (m.gate_value, m.up_value) if m.packed else (g.out, u.out)
    eval_nodes([*g.nodes, *u.nodes, *([m.gate_value, m.up_value] if m.packed else [])], env)
    gate, upv = (env[v].detach().requires_grad_(True) for v in (gate_v, up_v))
    env[gate_v], env[up_v] = gate, upv
    n = gate.shape[-1]
    hidden = min(_size(meta(down.linear).shape[-1]), 5)
    env[down.weight] = torch.randn(hidden, n, generator=gen, dtype=torch.float64,
                                   requires_grad=True)
    leaves = [gate, upv, env[down.weight]]
    if down.bias is not None:
        env[down.bias] = torch.randn(hidden, generator=gen, dtype=torch.float64,
                                     requires_grad=True)
        leaves.append(env[down.bias])
    with torch.enable_grad():  # the decision may run under the user's no_grad
        eval_nodes(upstream(down.linear, set(env)), env)
        out = env[down.linear]
        dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        eager = torch.autograd.grad(out, leaves, dout)
    dout2 = dout.reshape(-1, hidden)
    p = torch.stack([gate.detach(), upv.detach()], dim=-1).reshape(-1, 2 * n)
    dp, h = reference.dgated(m.op, dout2 @ env[down.weight].detach(), p)
    fused = [dp[:, 0::2], dp[:, 1::2], dout2.t() @ h] + \
        ([dout2.sum(0)] if down.bias is not None else [])
    err = max(rel_err(f, e.reshape(f.shape)) for f, e in zip(fused, eager))
    return verdict(err, f"rows {lead}, gradients of gate, up, W_d"
                   + (", b_d" if down.bias is not None else ""), m.path)


def _contracted(p) -> int:
    """K of a projection, from the first of x and the weight that carries a shape."""
    for node in (p.x, p.weight):
        while isinstance(node, fx.Node):
            if meta(node) is not None:
                return _size(meta(node).shape[-1])
            node = node.args[0] if node.args else None  # a cast, a folded scale
    return 8
