"""Numeric witness: the matched nodes themselves against the programs that replace them.

A proof covers the identity; the witness covers the glue (which operand is the residual,
the eps, γ's offset, the chain replayed onto r, each program's outputs). It replays the
*original graph nodes* of the match on random float64 inputs of small shapes and runs the
rewrite's programs through the reference interpreter on the same inputs. A disagreement
means the checker or a pattern is wrong: the rewrite is rejected and reported as a
checker bug (RejectionKind.WITNESS_DISAGREES), never applied.

The witness fails closed: a replay that cannot run (a graph input it cannot invent, an
op that raises on the replay's inputs, as eager's F.linear does on mixed dtypes) refuses
the rewrite (RejectionKind.WITNESS_UNAVAILABLE), with the reason. Nothing is applied on
the strength of the proof alone.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..canonical import meta
from ..codegen.program import parse
from ..kernels import ops as ops_mod
from ..kernels import reference
from ..numerics import rel_err
from ..patterns import residual_rmsnorm
from .decision import Rejection, RejectionKind
from .row_scale import replay_chain

_MAX_ELEMS = 1 << 16


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
    args = fx.node.map_arg(node.args, arg)
    kwargs = fx.node.map_arg(node.kwargs, arg)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _random_like(n: fx.Node, env: dict) -> torch.Tensor:
    """A graph input the match reads besides its own (a per-feature factor, an index):
    random values of its shape and dtype (integer inputs cannot be invented)."""
    m = meta(n)
    if m is None or not m.is_floating_point() or m.numel() > _MAX_ELEMS:
        raise _Unreplayable(f"{n.name} is a graph input the witness cannot invent")
    shape = [_size(s) for s in m.shape]
    t = torch.rand(shape, generator=env["__gen__"], dtype=torch.float64) + 0.5
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


# ---- shared by the witnesses of the later patterns (gated MLP, cross-entropy) ---------

def exact(program_text: str) -> str:
    """The program with float64 outputs: a replay compares math, not roundings."""
    prog = parse(program_text)
    return dataclasses.replace(prog, outputs=tuple(
        dataclasses.replace(o, dtype="float64") for o in prog.outputs)).to_text()


def eval_nodes(nodes, env: dict) -> None:
    """Evaluate ``nodes`` into ``env`` in graph order; a fused_linear call an earlier
    rewrite made (a rowscale consumer) runs the reference with unrounded outputs."""
    nodes = list(nodes)
    if not nodes:
        return
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__):
        if node.target is ops_mod.fused_linear:
            env[node] = ops_mod.fused_linear_reference(
                exact(node.args[0]), *(_value(a, env) for a in node.args[1:]))
        else:
            env[node] = _eval(node, env)


def unavailable(why: str, path: str) -> Rejection:
    """The witness could not run: the rewrite is refused (fail closed)."""
    return Rejection(f"the float64 witness could not run ({why}); not applied without it",
                     path, RejectionKind.WITNESS_UNAVAILABLE)


def guarded(replay, match) -> str | Rejection:
    """Run ``replay(match)``; a graph the witness cannot replay refuses the rewrite."""
    try:
        return replay(match)
    except _Unreplayable as e:
        return unavailable(str(e), match.path)
    except (RuntimeError, IndexError, ValueError, TypeError) as e:  # an op that raises
        return unavailable(f"the matched nodes raise on the replay's inputs: "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           match.path)


def verdict(err: float, what: str, path: str, tol: float = 1e-6) -> str | Rejection:
    """The witness line, or a checker-bug rejection when the replay disagrees."""
    if not err <= tol:  # NaN fails too
        return Rejection(f"checker bug: the float64 witness disagrees ({err:.1e}; tol "
                         f"{tol:g}); the rewrite is not applied", path,
                         RejectionKind.WITNESS_DISAGREES)
    return f"replay in float64 on {what}: rel. error {err:.1e} (tol {tol:g})"


def witness(match, consumers) -> str | Rejection:
    lead_full = [_size(s) for s in meta(match.norm.input).shape[:-1]]
    leads = [[min(s, 3) for s in lead_full]]
    if lead_full != leads[0] and _prod(lead_full) * match.norm.dim <= _MAX_ELEMS:
        leads.append(lead_full)
    # float64 where the graph has float32; the graph's own dtypes when it casts
    # explicitly (a float64 operand would then meet a bfloat16 one)
    attempts = [(lead, native) for lead in leads for native in (False, True)]
    last_err = ""
    for lead, native in attempts:
        try:
            return _witness(match, consumers, lead, native)
        except _Unreplayable as e:
            return unavailable(str(e), match.path)
        except (RuntimeError, IndexError, ValueError, TypeError) as e:  # an op that raises
            last_err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return unavailable(f"the matched nodes raise on the replay's inputs: {last_err}",
                       match.path)


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def _witness(match, consumers, lead, native: bool) -> str | Rejection:
    norm, prod = match.norm, match.producer
    d = norm.dim
    g = torch.Generator().manual_seed(1234)

    def rand(node, *shape, base=0.0):
        dtype = meta(node).dtype
        if not native and dtype == torch.float32:
            dtype = torch.float64
        return (base + torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    env: dict = {"__gen__": g}
    ops_in, reference_outs, rewritten_outs, names = [], [], [], []
    if norm.weight is not None:
        env[norm.weight] = rand(norm.weight, d, base=1.0) * 0.5
    if prod is not None:
        # the GEMM's contracted dim is shrunk for speed, except where a node plays two
        # roles (x + W·x: x is the residual; a consumer that reuses W): one node, one shape
        k = _size(meta(prod.x).shape[-1])
        if prod.x is not prod.residual and all(c.weight is not prod.weight for c in consumers):
            k = min(k, 16)
        env[prod.x] = rand(prod.x, *lead, k)
        env[prod.weight] = rand(prod.weight, d, k)
        if prod.bias is not None:
            env[prod.bias] = rand(prod.bias, d)
        env[prod.residual] = rand(prod.residual, *lead, d)
        env[prod.linear] = _eval(prod.linear, env)
        env[prod.add] = _eval(prod.add, env)
        ops_in = [env[prod.x].reshape(-1, k), env[prod.weight],
                  [*([env[prod.bias]] if prod.bias is not None else []),
                   env[prod.residual].reshape(-1, d)]]
    else:
        env[norm.input] = rand(norm.input, *lead, d)
        ops_in = [None, None, [env[norm.input].reshape(-1, d)]]
    if isinstance(norm.eps, fx.Node):
        env[norm.eps] = torch.tensor(1e-5, dtype=torch.float64)
        for u in norm.eps.users:  # the idiom may read it through .item()
            if u.op == "call_method" and u.target == "item":
                env[u] = 1e-5
    ops_in[2] += [env[n] for n in residual_rmsnorm.norm_operands(norm)]
    for n in norm.nodes:
        env[n] = _eval(n, env)

    outs = reference.run_program(match.norm_program, *ops_in)
    if prod is not None:
        z, h2, r = outs
        reference_outs.append(env[prod.add])
        rewritten_outs.append(z.reshape(env[prod.add].shape))
        names.append(prod.add.name)
    else:
        h2, r = outs
    h2 = h2.reshape(*lead, d)
    r = r.reshape(*lead, 1)

    for c in consumers:
        n_out = min(_size(meta(c.weight).shape[0]), 8)
        if c.weight not in env:  # a weight two GEMMs share keeps its first value
            env[c.weight] = rand(c.weight, n_out, d)
        n_out = env[c.weight].shape[0]
        if c.bias is not None and c.bias not in env:
            env[c.bias] = rand(c.bias, n_out)
        for node in c.chain:
            env[node] = _eval(node, env)
        ref = _eval(c.linear, env)
        def like(node, src, x):
            return _eval(node, env, replace=(src, x))

        def call(fn, *args):
            return fn(*(_value(a, env) for a in args))

        hc, rc, scale, shift = replay_chain(c.chain, norm.output, d, h2, r, like, call)
        weight, bias = env[c.weight], env.get(c.bias)
        if scale is not None:
            weight = ops_mod.fold_scale(env[c.weight], _value(scale, env))
        if shift is not None:
            bias = ops_mod.distribute_bias(_value(shift, env), env[c.weight], bias)
        ops = [rc.reshape(-1), *([bias] if bias is not None else [])]
        (out,) = reference.run_program(match.consumer_programs[c.linear],
                                       hc.reshape(-1, d), weight, ops)
        reference_outs.append(ref)
        rewritten_outs.append(out.reshape(ref.shape))
        names.append(c.linear.name)

    low_precision = any(m is not None and m.dtype in (torch.float16, torch.bfloat16)
                        for m in map(meta, [norm.input, norm.output, *norm.nodes,
                                            *(c.linear for c in consumers)]))
    tol = 3e-2 if low_precision else 1e-5 if native else 1e-6
    errs = [rel_err(a, b) for a, b in zip(rewritten_outs, reference_outs)]
    shown = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs))
    if not all(e <= tol for e in errs):  # NaN fails too
        return Rejection(f"checker bug: the float64 witness disagrees ({shown}; tol {tol:g}); "
                         "the rewrite is not applied", match.path,
                         RejectionKind.WITNESS_DISAGREES)
    how = "in the graph's dtypes" if native else "in float64"
    return f"replay {how} on rows {lead}: rel. error {shown} (tol {tol:g})"
