"""Numeric witness: the matched nodes themselves against the programs that replace them.

A proof covers the identity; the witness covers the glue (which operand is the residual,
the eps, γ's offset, the chain replayed onto r, each program's outputs). It replays the
*original graph nodes* of the match on random float64 inputs of small shapes and runs the
rewrite's programs through the reference interpreter on the same inputs. A disagreement
means the checker or a pattern is wrong: the rewrite is rejected and reported as a
checker bug (RejectionKind.WITNESS_DISAGREES), never applied.

Values can agree where gradients do not: a detach between a norm and its GEMM that the
rewrite applied to h2 and not to the deferred r gave exact logits and every upstream
gradient 12% off. So where a match trains, the families whose replay can make its inputs
leaves (the norms, RoPE, the gated pair, the LM head + loss, the experts) replay it once
more for the gradients: every input a float64 leaf (MATH: casts as identities, the
programs' outputs unrounded), the gradients of Σ out·R on both sides to every leaf
compared (gradient_error; code ``witness.gradients_disagree``), once with each rule
arranged as an eager backward runs it and once as a compiled one does. On a fresh thread
(isolated.py).
A program with a GEMM is differentiated there by its family's backward rule, through the
op's own autograd glue (kernels/ops.RuleReplayGemm: the reference's forward, the rule
training runs as its backward), so one replay checks the rewrite's math and the rule on
the match's own program (autograd through the reference would check the math alone).
What this replay cannot see has side conditions of its own: a torch.no_grad() block
(grad_mode.mixed), a zero gradient where eager's is None (rope.member_not_differentiated).

The witness fails closed: a replay that cannot run (a graph input it cannot invent, an
op that raises on the replay's inputs, as eager's F.linear does on mixed dtypes) refuses
the rewrite (RejectionKind.WITNESS_UNAVAILABLE), with the reason. Nothing is applied on
the strength of the proof alone.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..canonical import canon, canon_name, default_rms_eps, meta
from ..codegen import layouts, reference
from ..codegen.program import parse
from ..graph_utils import SPLIT, fused_linear_call, splits_in_halves
# the one edge from the legality layer to the runtime: the gradient replay differentiates
# the fused GEMM with the backward training runs (tests/test_structure.py names it)
from ..kernels.ops import RuleReplayGemm, arranged_as
from . import sharding
from .decision import Rejection, RejectionKind
from .isolated import off_thread

_MAX_ELEMS = 1 << 16
MATH = "__math__"  # an env key: every cast replayed as the identity (a gradient replay)
LEAVES = "__leaves__"  # an env key: the graph inputs a gradient replay invented, as leaves


class _Unreplayable(Exception):
    pass


def _eval(node: fx.Node, env: dict, replace=None, depth: int = 3):
    """Evaluate ``node`` on the values in ``env`` (``replace=(src, x)``: x in place of
    src); a missing argument computed by a short pure chain from values in ``env`` (the
    upcast of a GEMM output) is evaluated on the way."""
    def arg(n):
        if replace is not None and n is replace[0]:
            return replace[1]
        return _value(n, env, depth)
    if sharding.boundary_op(node) is not None:
        # a DTensor layout op the match crosses is the identity on the global value
        # (side condition (e), checked before the witness runs); the replay is global
        return arg(node.args[0])
    if env.get(MATH) and canon_name(node) == "cast":
        # the gradient replay computes the dataflow's derivative in float64 throughout: a
        # cast rounds the value, and its derivative is the identity
        return arg(node.args[0])
    if _identity_cast(node):
        # ``.to(torch.bfloat16)`` of a bfloat16 value does nothing in the model; replayed
        # on float64 it would round, and the witness would refuse a correct rewrite as
        # the pass's own bug (found by tests/test_property_gated.py). A cast that changes
        # the dtype in the model is replayed as it is: a real rounding the rewrite must
        # keep (or refuse) shows up as a disagreement.
        return arg(node.args[0])
    if node.op != "placeholder" and node.target in SPLIT and splits_in_halves(node):
        # split(n, -1) of the model's 2n-wide value, on the replay's narrower one: the
        # same two halves (a split's sizes are the model's literals)
        return torch.chunk(arg(node.args[0]), 2, dim=-1)
    c = canon(node)
    if c is not None and c.name == "rms_norm" and c.args[3] is None and \
            meta(c.args[0]) is not None:
        # eps=None is the model's dtype's eps (default_rms_eps), not the replay's float64's
        x, shape, w, _ = c.args
        return torch.nn.functional.rms_norm(
            arg(x), list(shape), None if w is None else arg(w),
            default_rms_eps(meta(x).dtype))
    if c is not None and c.name == "grouped_mm":
        # torch._grouped_mm takes no float64: the same product, in the reference's loop
        return reference.grouped_mm(*(arg(x) for x in c.args))
    args = fx.node.map_arg(node.args, arg)
    kwargs = fx.node.map_arg(node.kwargs, arg)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _identity_cast(node: fx.Node) -> bool:
    """A dtype cast whose input already has that dtype in the model (what dynamo traced)."""
    c = canon(node)
    if c is None or c.name != "cast":
        return False
    src = meta(c.args[0])
    return src is not None and src.dtype == c.args[1]


def _random_like(n: fx.Node, env: dict) -> torch.Tensor:
    """A graph input the match reads besides its own (a per-feature factor, an index):
    random values of its shape and dtype (integer inputs cannot be invented)."""
    m = meta(n)
    if m is None or not m.is_floating_point() or m.numel() > _MAX_ELEMS:
        raise _Unreplayable(f"{n.name} is a graph input the witness cannot invent")
    shape = [_size(s) for s in m.shape]
    t = torch.rand(shape, generator=env["__gen__"], dtype=torch.float64) + 0.5
    if env.get(MATH):  # a gradient replay: one more input whose gradient is compared
        env.setdefault(LEAVES, []).append(t.requires_grad_())
        return t
    return t if m.dtype == torch.float32 else t.to(m.dtype)


def _value(x, env, depth: int = 3):
    """The replay value of ``x``: a node from env, a graph input invented at random, a
    node computed on the way, or (not a node) what replay_chain built from those."""
    if not isinstance(x, fx.Node):
        return x
    if x not in env:
        if x.op in ("placeholder", "get_attr"):
            env[x] = _random_like(x, env)
        elif depth == 0 or x.op not in ("call_function", "call_method") or x.is_impure():
            raise _Unreplayable(f"{x.name} is computed outside the match")
        else:
            env[x] = _eval(x, env, depth=depth - 1)
    return env[x]


def _size(s) -> int:
    if isinstance(s, torch.SymInt):
        return s.node.hint if s.node.hint is not None else 2
    return int(s)


# ---- shared by every family's witness --------------------------------------------------

def exact(program_text: str) -> str:
    """The program with float64 outputs: a replay compares math, not roundings."""
    return exact_program(parse(program_text)).to_text()


def exact_program(prog):
    """``exact`` on a parsed program."""
    return dataclasses.replace(prog, outputs=tuple(
        dataclasses.replace(o, dtype="float64") for o in prog.outputs))


def run_program(prog, a, b, operands, gradients: bool = False) -> list[torch.Tensor]:
    """reference.run_program; in a gradient replay (``gradients``) a program with a GEMM
    runs through kernels/ops.RuleReplayGemm: the same values, and as their backward the
    family's rule, what training runs (no GEMM: the row-wise programs are graph ops in
    training too, differentiated by autograd). So the replay checks the rule on the
    match's own program (its operands, biases, offsets, maps, targets) as well as the
    rewrite's math."""
    if not gradients or not prog.gemm:
        return reference.run_program(prog, a, b, operands)
    return list(RuleReplayGemm.apply(prog.to_text(), a, b, *operands))


def fused_linear(program: str, x: torch.Tensor, weight: torch.Tensor, *operands,
                 gradients: bool = False) -> tuple[torch.Tensor, ...]:
    """layouts.fused_linear_reference (kernels/ops.fused_linear's shapes, no op), its
    flattened call through ``run_program(..., gradients)``."""
    return layouts.fused_linear_reference(
        program, x, weight, *operands,
        run=lambda prog, a, b, ops: run_program(prog, a, b, ops, gradients))


def gradient_error(outs, refs, leaves, seed: int = 7) -> float:
    """How far the gradients of Σ outs·R (R random, one per output) to ``leaves`` are
    from those of Σ refs·R: the largest over the leaves of ‖g − g_ref‖ over ‖g_ref‖,
    where a gradient autograd never reaches counts as zero. A leaf whose reference
    gradient is exactly zero (a path a detach cuts) is judged against the largest
    gradient's norm, so a rewrite that lets a gradient through where eager's graph
    does not shows as an error of order one, and rounding at float64's as none."""
    gen = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]

    def grads(values):
        total = sum((v.double() * c).sum() for v, c in zip(values, cotangents))
        if not total.requires_grad:
            return [torch.zeros_like(t) for t in leaves]
        seen = torch.autograd.grad(total, leaves, allow_unused=True, retain_graph=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(seen, leaves)]

    got, want = grads(outs), grads(refs)
    floor = 1e-9 * max([float(g.norm()) for g in want] + [1e-300])
    return max([float((a - b).norm()) / max(float(b.norm()), floor)
                for a, b in zip(got, want)] + [0.0])


def eval_nodes(nodes, env: dict) -> None:
    """Evaluate ``nodes`` into ``env`` in graph order; a fused_linear call an earlier
    rewrite made (a rowscale consumer) runs the reference with unrounded outputs."""
    nodes = list(nodes)
    if not nodes:
        return
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__):
        if fused_linear_call(node):
            env[node] = fused_linear(exact(node.args[0]), *(_value(a, env)
                                                            for a in node.args[1:]),
                                     gradients=bool(env.get(MATH)))
        else:
            env[node] = _eval(node, env)


def unavailable(why: str, path: str) -> Rejection:
    """The witness could not run: the rewrite is refused (fail closed)."""
    return Rejection(f"the float64 witness could not run ({why}); not applied without it",
                     path, RejectionKind.WITNESS_UNAVAILABLE, "witness.unavailable")


def guarded(replay, match) -> str | Rejection:
    """Run ``replay(match)``; a graph the witness cannot replay refuses the rewrite."""
    from ..kernels import ops
    try:
        with ops.uncounted():  # a replay is no call of the model's (kernels/ops.count)
            return replay(match)
    except _Unreplayable as e:
        return unavailable(str(e), match.path)
    except (RuntimeError, IndexError, ValueError, TypeError) as e:  # an op that raises
        return unavailable(f"the matched nodes raise on the replay's inputs: "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           match.path)


def replay_off_thread(fn, *args):
    """``off_thread(fn, *args)`` for a witness's replay (algebra/isolated.py: away from
    the caller's thread-local torch state), its calls of the fused ops not counted as
    the model's there either (kernels/ops.uncounted is per thread)."""
    from ..kernels import ops

    def uncounted(*a):
        with ops.uncounted():
            return fn(*a)
    return off_thread(uncounted, *args)


def guarded_with_gradients(replay, match, gradients: bool) -> str | Rejection:
    """``guarded(replay, match)``, and where the match trains (``gradients``) the same
    replay of the gradients (``replay(match, True)``, on a fresh thread: the pass may run
    under the caller's no_grad or inference mode); the witness lines joined, or the
    first rejection."""
    seen = guarded(replay, match)
    if isinstance(seen, Rejection) or not gradients:
        return seen
    grads = guarded(lambda m: both_arrangements(replay, m, True), match)
    return grads if isinstance(grads, Rejection) else f"{seen}; {grads}"


def both_arrangements(replay, *args) -> str | Rejection:
    """A gradient replay ``replay(*args)`` on a fresh thread, run twice: with every rule
    arranged as an eager backward (optimize()) runs it, and as the backward Inductor
    compiles does (kernels/backward/common.through_scaled_acc puts a row scale on dy
    there, on the activation in an eager one; the cross-entropy rule forms the softmax
    gradient as graph ops): the same gradients through another code path, so each is
    witnessed. Forced both ways, since the replay runs inside the compiler, where the
    tensors alone would pick the traced way and never check optimize()'s. A replay whose
    rules never read the arrangement runs once (RoPE's and LayerNorm's rules have one
    path; explicit attention and dense experts call no fused-GEMM rule). The lines joined, or the first rejection; what the
    replay raises goes to the caller's guard."""
    asked = []
    eager = replay_off_thread(_arranged(replay, False, asked), *args)
    if isinstance(eager, Rejection):
        return eager
    if not any(asked):
        return f"{eager} (no rule on its path reads the arrangement: one replay)"
    traced = replay_off_thread(_arranged(replay, True, []), *args)
    return traced if isinstance(traced, Rejection) else \
        f"{eager}; as a compiled backward arranges it: {traced}"


def _arranged(replay, traced: bool, asked: list):
    def run(*args):
        with arranged_as(traced) as arrangement:  # on the replay's own thread
            try:
                return replay(*args)
            finally:
                asked.append(arrangement.asked)
    return run


def verdict(err: float, what: str, path: str, tol: float = 1e-6,
            gradients: bool = False) -> str | Rejection:
    """The witness line, or a checker-bug rejection when the replay disagrees
    (``gradients``: a gradient replay's, whose values agreed)."""
    if not err <= tol:  # NaN fails too
        if gradients:
            return Rejection(f"checker bug: the gradient replay disagrees ({err:.1e} on "
                             f"{what}; tol {tol:g}): the rewrite's values are eager's and "
                             "its gradients are not; not applied", path,
                             RejectionKind.WITNESS_DISAGREES, "witness.gradients_disagree")
        return Rejection(f"checker bug: the float64 witness disagrees ({err:.1e}; tol "
                         f"{tol:g}); the rewrite is not applied", path,
                         RejectionKind.WITNESS_DISAGREES, "witness.disagrees")
    if gradients:
        return f"gradient replay on {what}: rel. error {err:.1e} (tol {tol:g})"
    return f"replay in float64 on {what}: rel. error {err:.1e} (tol {tol:g})"


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p
