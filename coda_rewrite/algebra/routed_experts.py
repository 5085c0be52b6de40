"""Legality of a routed-experts rewrite (patterns/routed_experts.py): the identity
(statements.prove_routed_experts), its side conditions on the matched graph, and a
float64 replay of the matched nodes against the two grouped programs.

Side conditions, each checked here:

* the values the fused GEMMs never write are read only inside the match: the gate/up
  GEMM's output (and its fill), the chunk and its halves, act(gate), the product, the
  down GEMM's output (and its fill); none of them updated in place;
* both GEMMs group rows by the same offsets; the weights are [E, 2I, K] and [E, K', I]
  with one E and an even 2I; one floating dtype throughout (casts between the GEMMs
  identities: a rounding the epilogue would skip is refused);
* every fill fills whole rows (a boolean [S, 1] mask);
* the gathered rows are read only by the gate/up GEMM, and by a fill in place of the
  same mask the gate/up output is filled with (so that fill is dead: a grouped GEMM is
  row-local); a fill of other rows is refused;
* a fill of (gate, up) by c moves past the product as act(c)·c, finite; the down
  output's fill is by 0 where the router weight multiplies after it (the weight moves
  into the epilogue, before the fill);
* nothing updates in place a value the fused GEMMs read where the match ends (the
  gathered source, the index, offsets, masks, weights): eager read them earlier;
* the combine weight is one value per routed row.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..canonical import canon, meta
from ..capture import describe
from ..codegen import reference
from ..codegen.op_table import OPS
from ..codegen.program import parse
from ..graph_utils import aliases, in_place_update_of, mutated_value
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .isolated import off_thread
from .witness import _size, eval_nodes, exact, guarded, verdict


def product_fill(op: str, c: float) -> float:
    """act(c)·c: what a fill of both halves by c makes of the gated product."""
    x = torch.tensor([c], dtype=torch.float64)
    return float(reference.unary(OPS[op].gate_activation)(x)[0] * c)


def product_fill_dead(m) -> bool:
    """Whether the gate/up output's fill is dead: the down GEMM is row-local too and its
    output is filled on the same rows (Hugging Face fills all three with one sentinel
    mask), so only the last fill stays (Inductor fuses it into the scatter back)."""
    return m.gate_up_fill is not None and m.down_fill is not None and \
        m.down_fill.mask is m.gate_up_fill.mask


def _reads_outside(value: fx.Node, allowed: set) -> fx.Node | None:
    return next((u for u in value.users if u not in allowed), None)


def side_conditions(m) -> tuple[list[str], str | None]:
    """(conditions that hold, the first that does not)."""
    held = []
    inner = [m.gate_up, m.chunk, m.gate, m.up, m.act, m.mul, m.down]
    inner += [f.node for f in (m.gate_up_fill, m.down_fill) if f is not None]
    inside = set(inner) | {m.out} | ({m.combine} if m.combine is not None else set())
    for value in inner:
        if value is m.out:
            continue
        reader = _reads_outside(value, inside | _casts_between(m))
        if reader is not None:
            return held, Why(f"{describe(value)} is also read by {describe(reader)}: the "
                             "fused GEMMs never write it", "moe.intermediate_read")
    updated = in_place_update_of(set(inner) - {m.out}, m.mul.graph)
    if updated is not None:
        return held, Why(f"{describe(updated[0])} updates {describe(updated[1])} in place",
                         "moe.in_place")
    moved = _moved_input_updated(m)
    if moved is not None:
        return held, Why(f"{describe(moved[0])} updates {describe(moved[1])} in place: the "
                         "fused GEMMs read it where the match ends, not where eager read it",
                         "moe.in_place")
    held.append("gate/up output, halves, act(gate), product and down output are read "
                "only inside the match")
    wg, wd = meta(m.w_gate_up), meta(m.w_down)
    if wg.shape[0] != wd.shape[0] or wg.shape[1] % 2 or wd.shape[2] * 2 != wg.shape[1]:
        return held, Why(f"expert weights {tuple(wg.shape)} and {tuple(wd.shape)}: need "
                         "[E, 2I, K] and [E, K', I]", "moe.weight_shapes")
    mo = meta(m.offsets)
    if mo is None or mo.dim() != 1 or mo.shape[0] != wg.shape[0] or \
            mo.dtype not in (torch.int32, torch.int64):
        return held, Why(f"offsets {describe(m.offsets)} are not one integer per expert",
                         "moe.offsets")
    held.append(f"both grouped GEMMs group rows by {describe(m.offsets)} over "
                f"{wg.shape[0]} experts")
    values = [m.x, m.gate_up, m.gate, m.up, m.act, m.mul, m.down, m.w_gate_up, m.w_down]
    if m.source is not None:
        values.append(m.source)
    dtypes = {meta(v).dtype for v in values}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        return held, Why(f"the experts' values differ in dtype ({sorted(map(str, dtypes))}):"
                         " a cast the fused epilogue would skip", "moe.dtypes")
    held.append(f"one dtype throughout ({dtypes.pop()})")
    for f in (m.input_fill, m.gate_up_fill, m.down_fill):
        mask = meta(f.mask) if f is not None else None
        if f is not None and (mask is None or mask.dtype != torch.bool or mask.dim() != 2
                              or mask.shape[1] != 1):
            return held, Why(f"{describe(f.node)} fills by a mask of shape "
                             f"{tuple(mask.shape) if mask is not None else '?'}, not whole "
                             "rows ([S, 1]): the fills' rules are about rows",
                             "moe.fill_not_rows")
    why = _input_fill(m)
    if why:
        return held, why
    if m.input_fill is not None:
        held.append(f"the fill in place of the gathered rows ({describe(m.input_fill.node)})"
                    " is dead: the same rows of the gate/up output are filled")
    if m.combine is not None and m.down_fill is not None and m.down_fill.constant != 0:
        return held, Why(f"{describe(m.down_fill.node)} fills by {m.down_fill.constant} "
                         "before the router weight multiplies: with the weight in the "
                         "epilogue the filled rows would not be scaled", "moe.fill_value")
    if product_fill_dead(m):
        held.append("the fill of the gate/up output is dead: the down output is filled on "
                    "the same rows")
    elif m.gate_up_fill is not None and not math.isfinite(
            product_fill(m.op, m.gate_up_fill.constant)):
        return held, Why("the gate/up fill makes a non-finite product", "moe.fill_value")
    return held, None


def _moved_input_updated(m):
    """(node, value) of an update in place of a value the fused GEMMs read where the match
    ends (the gathered source, the index, offsets, masks, router and expert weights), or
    of a view of one; the gathered rows' own fill excepted (dead, side condition below)."""
    values = {m.index, m.offsets, m.weight, m.w_gate_up, m.w_down, m.source}
    values |= {f.mask for f in (m.input_fill, m.gate_up_fill, m.down_fill) if f is not None}
    watched = aliases({v for v in values if v is not None})
    for node in m.mul.graph.nodes:
        target = mutated_value(node)
        if target is not None and target in watched and \
                (m.input_fill is None or node is not m.input_fill.node):
            return node, target
    return None


def _casts_between(m) -> set:
    """The identity casts between the match's values (the product's cast before the
    down GEMM)."""
    out = set()
    for u in m.mul.users:
        c = canon(u)
        if c is not None and c.name == "cast":
            out.add(u)
    return out


def _input_fill(m) -> str | None:
    """Why the gathered rows are read other than by the gate/up GEMM and a dead fill."""
    x = m.x
    readers = [u for u in x.users if m.input_fill is None or u is not m.input_fill.node]
    for r in readers:  # the GEMM, through an identity cast
        c = canon(r)
        ok = r is m.gate_up or (c is not None and c.name == "cast" and
                                list(r.users) == [m.gate_up])
        if not ok:
            return Why(f"the gathered rows {describe(x)} are also read by {describe(r)}",
                       "moe.input_read")
    if m.input_fill is None:
        return None
    if m.gate_up_fill is None or m.gate_up_fill.mask is not m.input_fill.mask:
        return Why(f"{describe(m.input_fill.node)} fills rows of the gathered input that "
                   "are not filled again after the GEMM: the gather cannot be the GEMM's "
                   "row read", "moe.input_fill")
    return None


def decide(m, gated, down) -> Decision:
    """Legality of replacing match ``m`` by the grouped programs ``gated`` and ``down``."""
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    proof = statements.prove_routed_experts()
    seen = guarded(lambda m: _replay(m, gated, down), m)
    if isinstance(seen, Rejection):
        return seen
    if meta(m.out).requires_grad:
        grads = guarded(lambda m: off_thread(_replay_gradients, m, gated, down), m)
        if isinstance(grads, Rejection):
            return grads
        seen = f"{seen}; {grads}"
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps, seen)


def _inputs(m):
    """A small float64 routing (an expert with no row, rows past the last offset, and
    filled rows at the tail and inside a group) and values for the match's inputs."""
    g = torch.Generator().manual_seed(0)
    n_exp = _size(meta(m.w_gate_up).shape[0])
    k, i, k_out, tokens, rows = 12, 5, 7, 5, 11
    f64 = torch.float64
    h = torch.randn(tokens, k, generator=g, dtype=f64)
    index = torch.randint(0, tokens, (rows,), generator=g)
    counts = torch.randint(1, 4, (n_exp,), generator=g)
    if n_exp > 1:
        counts[0] = 0  # an expert with no row
    ends = torch.cumsum(counts, 0).clamp(max=rows - 2).to(meta(m.offsets).dtype)
    # sentinel rows at the tail, and one inside a group (a fill is dead for any rows)
    mask = ((torch.arange(rows) >= int(ends[-1])) | (torch.arange(rows) == 1)).unsqueeze(-1)
    w_gu = torch.randn(n_exp, 2 * i, k, generator=g, dtype=f64)
    w_d = torch.randn(n_exp, k_out, i, generator=g, dtype=f64)
    weight = torch.rand(rows, generator=g, dtype=f64)
    return dict(n_exp=n_exp, rows=rows, tokens=tokens, h=h, index=index, ends=ends, mask=mask,
                w_gu=w_gu, w_d=w_d, weight=weight, g=g)


def _eager(m, v) -> torch.Tensor:
    """The matched nodes replayed on the values ``v``."""
    h, index, mask = v["h"], v["index"], v["mask"]
    x = h[index] if m.source is None else None
    env = {m.offsets: v["ends"], m.w_gate_up: v["w_gu"], m.w_down: v["w_d"], "__gen__": v["g"]}
    env.update({m.source: h, m.index: index} if m.source is not None else {m.x: x})
    for f in (m.input_fill, m.gate_up_fill, m.down_fill):
        if f is not None:
            env[f.mask] = mask
    if m.weight is not None:
        env[m.weight] = v["weight"]
    eval_nodes(_nodes_between(m, env), env)
    return env[m.out]


def _replay(m, gated, down) -> str | Rejection:
    """The matched nodes on a small float64 routing against the fused programs'
    reference."""
    gated, down = (parse(exact(p.to_text())) for p in (gated, down))  # unrounded outputs
    v = _inputs(m)
    h, index, ends, mask, w_gu, w_d, weight, rows, tokens, n_exp = (
        v[k] for k in ("h", "index", "ends", "mask", "w_gu", "w_d", "weight", "rows",
                       "tokens", "n_exp"))
    want = _eager(m, v)
    x = h[index]
    y = reference.run_grouped(gated, h if m.source is not None else x, w_gu, ends,
                              index if m.source is not None else None, [])[0]
    if m.gate_up_fill is not None and not product_fill_dead(m):
        y = y.masked_fill(mask, product_fill(m.op, m.gate_up_fill.constant))
    elif m.gate_up_fill is not None:  # what the kernel leaves there: never written
        y = y.masked_fill(mask, float("nan"))
    o = reference.run_grouped(down, y, w_d, ends, None,
                              [weight] if m.weight is not None else [])[0]
    if m.down_fill is not None:
        o = o.masked_fill(mask, m.down_fill.constant)
    live = torch.arange(rows) < int(ends[-1])
    if m.down_fill is None:  # rows past the last offset are never written by either
        want, o = want[live], o[live]
    return verdict(rel_err(o, want), f"{n_exp} experts, {rows} routed rows of {tokens} "
                   "tokens (one expert empty, filled rows at the tail and inside a group)",
                   m.path)


def _replay_gradients(m, gated, down) -> str | Rejection:
    """Gradients of the matched nodes (float64 autograd) against the fused GEMMs'
    backward rules (kernels/grouped.GroupedGated, GroupedDown) on the same routing:
    the input rows, both expert weights and the combine weight."""
    from ..kernels.grouped import grouped_linear
    gated, down = (parse(exact(p.to_text())) for p in (gated, down))
    v = _inputs(m)
    leaves = ["h", "w_gu", "w_d"] + (["weight"] if m.weight is not None else [])
    results = []
    for fused in (False, True):
        vals = {**v, **{k: v[k].detach().clone().requires_grad_() for k in leaves}}
        with torch.enable_grad():
            if fused:
                src = vals["h"] if m.source is not None else vals["h"][v["index"]]
                idx = v["index"] if m.source is not None else None
                y = grouped_linear(gated.to_text(), src, vals["w_gu"], v["ends"], idx)[0]
                if m.gate_up_fill is not None and not product_fill_dead(m):
                    y = y.masked_fill(v["mask"], product_fill(m.op, m.gate_up_fill.constant))
                ops_ = [vals["weight"]] if m.weight is not None else []
                out = grouped_linear(down.to_text(), y, vals["w_d"], v["ends"], None, *ops_)[0]
                if m.down_fill is not None:
                    out = out.masked_fill(v["mask"], m.down_fill.constant)
            else:
                out = _eager(m, vals)
            live = torch.arange(v["rows"]) < int(v["ends"][-1])
            if m.down_fill is None:
                out = out[live]
            r = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                            dtype=out.dtype)
            grads = torch.autograd.grad((out * r).sum(), [vals[k] for k in leaves])
        results.append(grads)
    err = max(rel_err(a, b) for a, b in zip(*results))
    return verdict(err, "the gradients of the input rows, both expert weights and the "
                   "combine weight", m.path)


def _nodes_between(m, env: dict) -> list[fx.Node]:
    """The matched nodes from the gather to the output, in graph order: what the output
    reads, back to the values the replay set (``env``)."""
    order = list(m.mul.graph.nodes)
    first = m.x if m.source is not None else None
    lo = order.index(first) if first is not None else order.index(m.gate_up)
    hi = order.index(m.out)
    keep = set()
    stack = [m.out]
    while stack:  # what the output reads, back to the match's inputs
        n = stack.pop()
        if n in keep or n in env or order.index(n) < lo:
            continue
        keep.add(n)
        stack.extend(n.all_input_nodes)
    if m.input_fill is not None:
        keep.add(m.input_fill.node)
    return [n for n in order[lo:hi + 1] if n in keep]
