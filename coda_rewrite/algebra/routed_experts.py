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
* the combine weight is one value per routed row;
* an expert bias ``table[ids]`` ([E, N], the experts' dtype) is gathered by the sorted
  expert ids the offsets count (offsets = cumsum(histc(ids, E bins over [0, E-1])),
  ids = sort(...).values), so row s's id is the expert whose rows s falls in; nothing
  updates the ids in place but a clamp to [0, E-1] (values below E unchanged).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..canonical import canon, meta
from ..capture import describe
from ..codegen import dgated_source, reference
from ..codegen.op_table import OPS, pair_value
from ..codegen.program import parse
from ..graph_utils import arg, in_place_update_of, in_place_updates, sort_permutation
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .witness import _size, eval_nodes, exact, guarded, replay_off_thread, verdict


def product_fill(op: str, c: float, params=()) -> float:
    """pair(c, c) (act(c)·c): what a fill of both halves by c makes of the gated product."""
    x = torch.tensor([c], dtype=torch.float64)
    return float(pair_value(OPS[op], x, x, *params)[0])


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
    inner = [m.gate_up, m.gate, m.up, *m.act_nodes, m.mul, m.down]
    inner += [n for n in (m.chunk,) if n is not None]
    inner += [f.node for f in (m.gate_up_fill, m.down_fill) if f is not None]
    inner += [b.add for b in m.biases if not b.in_place]
    in_place_biases = {b.add for b in m.biases if b.in_place}
    inside = set(inner) | in_place_biases
    inside |= {m.out} | ({m.combine} if m.combine is not None else set())
    for value in inner:
        if value is m.out:
            continue
        reader = _reads_outside(value, inside | _casts_between(m))
        if reader is not None:
            return held, Why(f"{describe(value)} is also read by {describe(reader)}: the "
                             "fused GEMMs never write it", "moe.intermediate_read")
    updated = next(((n, v) for n, v in in_place_updates(set(inner) - {m.out}, m.mul.graph)
                    if n not in in_place_biases), None)
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
    wg, wd = _nk(m.w_gate_up, m.gate_up_kn), _nk(m.w_down, m.down_kn)
    if wg[0] != wd[0] or wg[1] % 2 or wd[2] * 2 != wg[1]:
        return held, Why(f"expert weights {tuple(meta(m.w_gate_up).shape)} and "
                         f"{tuple(meta(m.w_down).shape)}: need [E, 2I, K] and [E, K', I] "
                         "(or [E, K, 2I] and [E, I, K'])", "moe.weight_shapes")
    mo = meta(m.offsets)
    if mo is None or mo.dim() != 1 or mo.shape[0] != wg[0] or \
            mo.dtype not in (torch.int32, torch.int64):
        return held, Why(f"offsets {describe(m.offsets)} are not one integer per expert",
                         "moe.offsets")
    held.append(f"both grouped GEMMs group rows by {describe(m.offsets)} over "
                f"{wg[0]} experts")
    for bias, width in ((m.gate_up_bias, wg[1]), (m.down_bias, wd[1])):
        if bias is None:
            continue
        why = _bias_condition(m, bias, wg[0], width)
        if why:
            return held, why
        held.append(f"{describe(bias.gathered)} is each row's expert's bias: "
                    f"{describe(bias.ids)} are the sorted expert ids the offsets count")
    values = [m.x, m.gate_up, m.gate, m.up, m.mul, m.down, m.w_gate_up, m.w_down]
    values += [b.table for b in m.biases]
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
            product_fill(m.op, m.gate_up_fill.constant, m.params)):
        return held, Why("the gate/up fill makes a non-finite product", "moe.fill_value")
    return held, None


def _moved_input_updated(m):
    """(node, value) of an update in place of a value the fused GEMMs read where the match
    ends (the gathered source, the index, offsets, masks, router and expert weights), or
    of memory one shares (a view of it, the tensor it is a view of); the gathered rows'
    own fill excepted (dead, side condition below)."""
    values = {m.index, m.offsets, m.weight, m.w_gate_up, m.w_down, m.source}
    values |= {b.table for b in m.biases}
    values |= {f.mask for f in (m.input_fill, m.gate_up_fill, m.down_fill) if f is not None}
    return next(((n, v) for n, v in in_place_updates({v for v in values if v is not None},
                                                      m.mul.graph)
                 if m.input_fill is None or n is not m.input_fill.node), None)


def _nk(w: fx.Node, kn: bool) -> tuple[int, int, int]:
    """(E, N, K) of an expert weight stored [E, N, K], or [E, K, N] where ``kn``."""
    e, a, b = meta(w).shape
    return (e, b, a) if kn else (e, a, b)


def histogram_summed(offsets: fx.Node) -> fx.Node | None:
    """The ``histc`` node where ``offsets = cumsum(histc(...), dim=0)``, else None."""
    if offsets.target is not torch.cumsum or arg(offsets, 1, "dim") not in (0, -1):
        return None
    hist = offsets.args[0]
    return hist if isinstance(hist, fx.Node) and hist.target is torch.histc else None


def sorted_ids_counted(ids: fx.Node, offsets: fx.Node, experts: int) -> str | None:
    """Why row s's id is not the expert whose rows s falls in (None: it is): ``ids`` must
    be the values of a sort of a 1-D tensor, ascending, and ``offsets`` the cumulative
    count of them per expert, cumsum(histc(ids, bins=E, min=0, max=E-1)) (an id of E or
    more, an expert-parallel sentinel, is counted by no bin: its row lies past
    offsets[-1], where nothing is written)."""
    sort = ids.args[0] if ids.target is operator.getitem and ids.args[1] == 0 else None
    if not isinstance(sort, fx.Node) or sort.target not in (torch.sort, "sort") or \
            arg(sort, 2, "descending", False) or meta(sort.args[0]) is None or \
            meta(sort.args[0]).dim() != 1:
        return f"{describe(ids)} are not the ascending sorted values of a 1-D tensor"
    hist = histogram_summed(offsets)
    if hist is None:
        return f"{describe(offsets)} is not a cumulative sum of per-expert counts"
    if _under_number_casts(hist.args[0]) is not ids:
        return f"{describe(offsets)} does not count {describe(ids)} (histc)"
    bins, lo, hi = (arg(hist, 1, "bins", 100), arg(hist, 2, "min", 0),
                    arg(hist, 3, "max", 0))
    if (bins, lo, hi) != (experts, 0, experts - 1):
        return (f"{describe(hist)} counts {bins} bins over [{lo}, {hi}], not one per expert "
                f"over [0, {experts - 1}]")
    for node, _ in in_place_updates({ids}, ids.graph):
        if not (node.op == "call_method" and node.target == "clamp_" and
                arg(node, 1, "min") in (None, 0) and arg(node, 2, "max") == experts - 1):
            return f"{describe(node)} updates the expert ids in place"
    return None


# the number types that hold every expert id exactly (bf16 and fp16 round ids above
# 256 / 2048, bool folds them to 0 and 1)
_EXACT_ID_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


def _under_number_casts(node):
    """``node`` under casts to number types that keep every expert id (histc counts
    ``ids.float()`` on the CPU and ``ids.int()`` on CUDA: transformers picks by device)."""
    while isinstance(node, fx.Node) and node.op == "call_method" and \
            node.target in ("int", "long", "float", "double", "to") and \
            meta(node) is not None and meta(node).dtype in _EXACT_ID_DTYPES:
        node = node.args[0]
    return node


def _bias_condition(m, bias, experts: int, width: int) -> str | None:
    mt = meta(bias.table)
    if tuple(mt.shape) != (experts, width):
        return Why(f"the bias table {describe(bias.table)} is {tuple(mt.shape)}, not "
                   f"[{experts}, {width}] (one row per expert)", "moe.bias_index")
    why = sorted_ids_counted(bias.ids, m.offsets, experts)
    return Why(f"{describe(bias.gathered)}: {why}", "moe.bias_index") if why else None


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


def token_order(m) -> tuple[fx.Node, int] | None:
    """(perm, k) where the gather index is ``perm // k``, perm the permutation a sort
    returned of N = T·k values and T the gathered source's rows (Hugging Face's
    ``hidden[perm // top_k]`` after ``sort(top_k_index.reshape(-1))``): every token is
    gathered exactly k times, so the gather's gradient is each token's k rows summed
    after the inverse permutation, a gather and a sum instead of N atomic adds. None
    elsewhere (any other index, a shape that is not provably T·k, perm updated in place):
    the backward scatters with index_add."""
    idx, src = m.index, m.source
    if idx is None or src is None or idx.op != "call_function" or \
            idx.target not in (operator.floordiv, torch.floor_divide) or len(idx.args) != 2:
        return None
    perm, k = idx.args
    if not isinstance(k, int) or k < 1 or not sort_permutation(perm):
        return None
    mp, ms = meta(perm), meta(src)
    if mp is None or ms is None or mp.dim() != 1 or \
            not statically_known_true(mp.shape[0] == ms.shape[0] * k):
        return None
    if in_place_update_of({perm}, perm.graph) is not None:
        return None
    return perm, k


def routing_in_bounds(m) -> str | None:
    """Why the grouped kernels of this match need no device-side check of the routing's
    values (kernels/grouped.check_routing), or None (each call checks them). A planned
    launch trusts its tensors' values: offsets that decrease or pass the S routed rows,
    or a gather index past the source's rows, would read or write out of bounds. Both
    hold by construction, whatever the router computed, where

        offsets = cumsum(histc(v))      over at most S values (each value counted by one
                                        bin or none: counts >= 0, so offsets increase
                                        and end at most at S)
        index   = perm // k             perm a sort's permutation of T·k values, T the
                                        source's rows (token_order): index in [0, T)

    and nothing updates offsets, their counts or the index in place. Hugging Face's
    grouped_mm experts compute both so (transformers/integrations/moe.py)."""
    off, rows = m.offsets, meta(m.index if m.index is not None else m.x)
    hist = histogram_summed(off)
    if hist is None:
        return None
    counted, counts = meta(hist.args[0]), meta(hist)
    if counted is None or counts is None or rows is None or \
            not statically_known_true(counted.numel() <= rows.shape[0]):
        return None
    # float counts are exact integers up to 2**24 (histc counts in its input's dtype)
    if counts.dtype.is_floating_point and \
            not statically_known_true(counted.numel() <= 2 ** 24):
        return None
    if m.index is not None and token_order(m) is None:
        return None
    if in_place_update_of({off, hist} | ({m.index} if m.index is not None else set()),
                          off.graph) is not None:
        return None
    return (f"the routing's bounds hold by construction ({describe(off)} = cumsum(histc) "
            "over at most the routed rows" +
            (f"; {describe(m.index)} = a sort's permutation // top-k" if m.index is not None
             else "") + "): no device-side check per launch")


def down_backward_fused(m) -> bool:
    """Whether the down GEMM's backward runs in its dgrad epilogue (kernels/grouped_dgated)
    when the match trains: its input is the gated GEMM's output itself (a live fill of the
    product changes rows that the pair recomputed from p would not) and the pair has a
    backward epilogue."""
    product_filled = m.gate_up_fill is not None and not product_fill_dead(m)
    return not product_filled and dgated_source.supported(m.op)


def decide(m, gated, down, deferred: bool = False) -> Decision:
    """Legality of replacing match ``m`` by the grouped programs ``gated`` and ``down``;
    ``deferred``: the gathered tokens are a norm's h2 ⊙ r, read as h2 with each routed
    row scaled by its token's r (the norm family proved h = h2 ⊙ r for its output; the
    replays feed h = h2 ⊙ r to the matched nodes and (h2, r) to the programs)."""
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    if deferred:
        held.append("the gathered tokens are a normalised value h2 ⊙ r (rstd r per token): "
                    "the row scale moves through the gather into the epilogue")
    proof = statements.prove_routed_experts()
    seen = guarded(lambda m: _replay(m, gated, down, deferred), m)
    if isinstance(seen, Rejection):
        return seen
    statement, assumptions, steps = proof.statement, (*proof.assumptions, *held), proof.steps
    if meta(m.out).requires_grad:
        grads = guarded(lambda m: replay_off_thread(_replay_gradients, m, gated, down,
                                                    deferred), m)
        if isinstance(grads, Rejection):
            return grads
        seen = f"{seen}; {grads}"
        if down_backward_fused(m):
            back = statements.prove_routed_backward()
            statement = f"{statement}; backward: {back.statement}"
            assumptions, steps = (*assumptions, *back.assumptions), (*steps, *back.steps)
        if token_order(m) is not None:  # the gather's gradient: a sum per token
            moved = statements.prove_token_routing()
            statement = f"{statement}; {moved.statement}"
            assumptions, steps = (*assumptions, *moved.assumptions), (*steps, *moved.steps)
            seen = f"{seen}; {moved.witness}"
    return Proof(statement, assumptions, steps, seen)


def _inputs(m):
    """A small float64 routing (an expert with no row, rows past the last offset, and
    filled rows at the tail and inside a group) and values for the match's inputs."""
    g = torch.Generator().manual_seed(0)
    n_exp = _size(meta(m.w_gate_up).shape[0])
    k, i, k_out, tokens, rows = 12, 5, 7, 5, 11
    f64 = torch.float64
    h = torch.randn(tokens, k, generator=g, dtype=f64)
    index = torch.randint(0, tokens, (rows,), generator=g)
    order = token_order(m)
    perm = None
    if order is not None:  # index = perm // top_k: every token gathered top_k times
        rows = tokens * order[1]
        perm = torch.randperm(rows, generator=g)
        index = perm // order[1]
    counts = torch.randint(1, 4, (n_exp,), generator=g)
    if n_exp > 1:
        counts[0] = 0  # an expert with no row
    ends = torch.cumsum(counts, 0).clamp(max=rows - 2).to(meta(m.offsets).dtype)
    # sentinel rows at the tail, and one inside a group (a fill is dead for any rows)
    mask = ((torch.arange(rows) >= int(ends[-1])) | (torch.arange(rows) == 1)).unsqueeze(-1)
    w_gu = torch.randn(n_exp, 2 * i, k, generator=g, dtype=f64)
    w_d = torch.randn(n_exp, k_out, i, generator=g, dtype=f64)
    weight = torch.rand(rows, generator=g, dtype=f64)
    # the expert ids the offsets count (the bias gather's index), sentinels clamped
    ids = reference.expert_of_rows(ends, rows).clamp(max=n_exp - 1).long()
    b_gu = torch.randn(n_exp, 2 * i, generator=g, dtype=f64)
    b_d = torch.randn(n_exp, k_out, generator=g, dtype=f64)
    r_tok = torch.rand(tokens, generator=g, dtype=f64) + 0.5   # a deferred rstd per token
    return dict(n_exp=n_exp, rows=rows, tokens=tokens, h=h, index=index, ends=ends, mask=mask,
                w_gu=w_gu, w_d=w_d, weight=weight, g=g, ids=ids, b_gu=b_gu, b_d=b_d,
                r_tok=r_tok, perm=perm, top_k=order[1] if order is not None else 0)


def _eager_input(v: dict, deferred: bool) -> dict:
    """The values the matched nodes read: h = h2 ⊙ r where the norm's scale is deferred
    (``h`` then holds h2)."""
    return dict(v, h=v["h"] * v["r_tok"][:, None]) if deferred else v


def _stored(w: torch.Tensor, kn: bool) -> torch.Tensor:
    """An [E, N, K] weight as the graph stores it."""
    return w.transpose(1, 2) if kn else w


def _eager(m, v) -> torch.Tensor:
    """The matched nodes replayed on the values ``v``."""
    h, index, mask = v["h"], v["index"], v["mask"]
    x = h[index] if m.source is None else None
    env = {m.offsets: v["ends"], m.w_gate_up: _stored(v["w_gu"], m.gate_up_kn),
           m.w_down: _stored(v["w_d"], m.down_kn), "__gen__": v["g"]}
    for bias, table in ((m.gate_up_bias, v["b_gu"]), (m.down_bias, v["b_d"])):
        if bias is not None:
            env[bias.table], env[bias.ids] = table, v["ids"]
    env.update({m.source: h, m.index: index} if m.source is not None else {m.x: x})
    for f in (m.input_fill, m.gate_up_fill, m.down_fill):
        if f is not None:
            env[f.mask] = mask
    if m.weight is not None:
        env[m.weight] = v["weight"]
    eval_nodes(_nodes_between(m, env), env)
    return env[m.out]


def _replay(m, gated, down, deferred: bool = False) -> str | Rejection:
    """The matched nodes on a small float64 routing against the fused programs'
    reference."""
    gated, down = (parse(exact(p.to_text())) for p in (gated, down))  # unrounded outputs
    v = _inputs(m)
    h, index, ends, mask, w_gu, w_d, weight, rows, tokens, n_exp = (
        v[k] for k in ("h", "index", "ends", "mask", "w_gu", "w_d", "weight", "rows",
                       "tokens", "n_exp"))
    want = _eager(m, _eager_input(v, deferred))
    x = h[index]
    y = reference.run_grouped(gated, h if m.source is not None else x, w_gu, ends,
                              index if m.source is not None else None,
                              _gated_operands(m, v, deferred), m.interleaved)[0]
    if m.gate_up_fill is not None and not product_fill_dead(m):
        y = y.masked_fill(mask, product_fill(m.op, m.gate_up_fill.constant, m.params))
    elif m.gate_up_fill is not None:  # what the kernel leaves there: never written
        y = y.masked_fill(mask, float("nan"))
    o = reference.run_grouped(down, y, w_d, ends, None, _down_operands(m, v))[0]
    if m.down_fill is not None:
        o = o.masked_fill(mask, m.down_fill.constant)
    live = torch.arange(rows) < int(ends[-1])
    if m.down_fill is None:  # rows past the last offset are never written by either
        want, o = want[live], o[live]
    return verdict(rel_err(o, want), f"{n_exp} experts, {rows} routed rows of {tokens} "
                   "tokens (one expert empty, filled rows at the tail and inside a group)",
                   m.path)


def _gated_operands(m, v, deferred: bool = False) -> list:
    """The gated program's operands in its order: the routed rows' rstd, the bias."""
    return ([v["r_tok"][v["index"]]] if deferred else []) + \
        ([v["b_gu"]] if m.gate_up_bias is not None else [])


def _down_operands(m, v) -> list:
    """The down program's operands in its order: the bias, then the combine weight."""
    return ([v["b_d"]] if m.down_bias is not None else []) + \
        ([v["weight"]] if m.weight is not None else [])


def _replay_gradients(m, gated, down, deferred: bool = False) -> str | Rejection:
    """Gradients of the matched nodes (float64 autograd) against the fused GEMMs'
    backward (kernels/grouped.GroupedGated with grouped_dgated.GroupedGatedDown, or
    GroupedDown where the down GEMM's backward is not fused) on the same routing: the
    input rows, both expert weights and the combine weight."""
    from ..kernels.grouped import grouped_linear
    from ..kernels.grouped_dgated import grouped_down_linear
    gated, down = (parse(exact(p.to_text())) for p in (gated, down))
    v = _inputs(m)
    leaves = ["h", "w_gu", "w_d"] + (["weight"] if m.weight is not None else [])
    leaves += [k for k, b in (("b_gu", m.gate_up_bias), ("b_d", m.down_bias)) if b is not None]
    leaves += ["r_tok"] if deferred else []
    results = []
    for fused in (False, True):
        vals = {**v, **{k: v[k].detach().clone().requires_grad_() for k in leaves}}
        with torch.enable_grad():
            if fused:
                src = vals["h"] if m.source is not None else vals["h"][v["index"]]
                idx = v["index"] if m.source is not None else None
                y, p = grouped_linear(gated.to_text(), src, vals["w_gu"], v["ends"], idx,
                                      *_gated_operands(m, vals, deferred),
                                      interleaved=m.interleaved, perm=v["perm"],
                                      top_k=v["top_k"])[:2]
                if m.gate_up_fill is not None and not product_fill_dead(m):
                    y = y.masked_fill(v["mask"], product_fill(
                        m.op, m.gate_up_fill.constant, m.params))
                if down_backward_fused(m):
                    out = grouped_down_linear(down.to_text(), m.op, m.params, y, p,
                                              vals["w_d"], v["ends"], *_down_operands(m, vals))
                else:
                    out = grouped_linear(down.to_text(), y, vals["w_d"], v["ends"], None,
                                         *_down_operands(m, vals))[0]
                if m.down_fill is not None:
                    out = out.masked_fill(v["mask"], m.down_fill.constant)
            else:
                out = _eager(m, _eager_input(vals, deferred))
            live = torch.arange(v["rows"]) < int(v["ends"][-1])
            if m.down_fill is None:
                out = out[live]
            r = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                            dtype=out.dtype)
            grads = torch.autograd.grad((out * r).sum(), [vals[k] for k in leaves])
        results.append(grads)
    err = max(rel_err(a, b) for a, b in zip(*results))
    return verdict(err, "the gradients of the input rows, both expert weights, the "
                   "combine weight, the expert biases and the deferred rstd", m.path)


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
    for b in m.biases:  # an update in place: no reader depends on it, the value does
        if b.in_place:
            keep.add(b.add)
            stack = [b.gathered]
            while stack:
                n = stack.pop()
                if n not in keep and n not in env and order.index(n) >= lo:
                    keep.add(n)
                    stack.extend(n.all_input_nodes)
    return [n for n in order[lo:hi + 1] if n in keep]
