"""Legality of a RoPE rewrite: the interleave identity, the escape analysis of the
permuted q and k, the side conditions, and a float64 replay of the matched rotation.

The identities (statements.py): π(rope_half(x)) = rope_pairs(π(x)) for the per-head
interleave π; (Q·P)(K·P)ᵀ = Q·Kᵀ when q and k carry the same permutation; frequency 0
passes a pair through (v in the same GEMM); R(−θ) undoes R(θ) (the backward).

Escape analysis. The fused GEMM leaves q and k in the permuted order. Starting from the
rotated values, the *permuted region* grows through ops that act on the head dim as a
whole (views and reshapes that keep it last, transposes of other dims, expand, casts,
index ops that leave it alone, a scale that is the same for every feature of a head,
concatenation along another dim of values that are all in the region); where a region
value meets anything else, the permutation would show:

* a scaled_dot_product_attention whose query and key both come from the region, or an
  eager attention's ``q @ k.transpose(-2, -1)`` with both from it, sums over the head
  dim: invariant, the permutation stays (the point of the rewrite);
* every other edge (a returned KV cache, a concatenation with cached keys in eager
  order, an attention that gets only one of q and k permuted, an unknown op) gets the
  eager order back on that edge (codegen/layouts.rope_unpermute, a copy of that value only).

So every value outside the region is eager's, and inside it only an invariant
contraction reads the permuted order: the rewrite is exact wherever it is applied. It is
made only where some attention keeps the permuted order (a speed decision, not a legal
one: with none, every rotated value would be copied back, a pass over q and k as costly
as the unfused rotation it replaces; code ``rope.no_invariant_reader``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import torch
import torch.fx as fx

from ..canonical import SDPA as _SDPA
from ..canonical import canon, meta
from ..capture import describe
from ..codegen import layouts
from ..graph_utils import MATMUL, mutated_value, same_value, swaps_heads, updated_between
from ..numerics import rel_err
from . import statements
from .decision import Decision, Proof, Rejection, Why
from .witness import (_Unreplayable, _size, exact, fused_linear, gradient_error,
                      guarded_with_gradients, verdict)

_SHAPE = {"view", "reshape", "expand", "unsqueeze", "contiguous", "clone", "detach",
          torch.reshape, torch.unsqueeze, torch.clone, torch.detach}
_CAT = {torch.cat, torch.concat, torch.concatenate}


@dataclasses.dataclass
class Region:
    """Where the permuted order lives, and the edges that get eager's order back."""
    nodes: set
    invariant: list[fx.Node]                 # attentions reading permuted q and k
    unpermute: list[tuple[fx.Node, fx.Node]]  # (consumer, region value it reads)
    key_writes: list[tuple[fx.Node, fx.Node]] = dataclasses.field(default_factory=list)
    # multi-head latent attention: (node, value) where ``node`` puts ``value`` into a
    # key as its rotated features (a copy_ into the key buffer, or a concatenation);
    # that value gets the query's pair order (layouts.rope_permute)

    def describe(self) -> str:
        inv = ", ".join(n.name for n in self.invariant) or "none"
        back = ", ".join(f"{v.name} → {'output' if c.op == 'output' else c.name}"
                         for c, v in self.unpermute) or "none"
        keys = "".join(f"; the key's rotated part {v.name} (into {c.name}) gets the same "
                       "order" for c, v in self.key_writes)
        return f"q·k invariant at {inv}; eager order restored on {back}{keys}"


def _last_dim_kept(node: fx.Node, src: fx.Node) -> bool:
    """``node`` (one input ``src``) keeps src's last dim as its last dim, intact."""
    mi, mo = meta(src), meta(node)
    if mi is None or mo is None or mi.dim() == 0 or mo.dim() == 0 \
            or mi.shape[-1] != mo.shape[-1]:
        return False
    t = node.target
    if t in ("transpose", torch.transpose):
        dims = [a for a in node.args[1:3]]
        return all(isinstance(d, int) and d % mi.dim() != mi.dim() - 1 for d in dims)
    if t in ("permute", torch.permute):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) \
            else node.args[1:]
        return len(dims) > 0 and isinstance(dims[-1], int) and dims[-1] % mi.dim() == mi.dim() - 1
    if t is operator.getitem:
        idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if Ellipsis in idx:
            tail = idx[idx.index(Ellipsis) + 1:]
            return all(isinstance(e, slice) and e == slice(None) for e in tail)
        real = [e for e in idx if e is not None]
        return len(real) < mi.dim() or (isinstance(real[-1], slice) and real[-1] == slice(None))
    c = canon(node)
    if c is not None and c.name == "cast":
        return True
    return t in _SHAPE  # same last dim size: rows of the head dim stay whole (C order)


def _uniform_scale(node: fx.Node, src: fx.Node, region: set) -> bool:
    """``node`` = src·c or src / c with c the same for every feature of a head (a number,
    or a tensor outside the region whose last dim is 1: Ministral 3's per-position query
    scale ``q · s[:, None, :, None]``): it keeps the permutation, as a view does."""
    c = canon(node)
    if c is None or c.name not in ("mul", "div") or src not in c.args[:2]:
        return False
    other = c.args[1] if c.args[0] is src else c.args[0]
    if c.name == "div" and c.args[0] is not src:
        return False
    if not isinstance(other, fx.Node):
        return isinstance(other, (int, float))
    mo, mn, ms = meta(other), meta(node), meta(src)
    return other not in region and mo is not None and mn is not None and ms is not None \
        and (mo.dim() == 0 or mo.shape[-1] == 1) and mn.shape == ms.shape


def _order_keeping_input(node: fx.Node, region: set) -> fx.Node | None:
    """The input whose head-dim order ``node`` keeps (a view, cast or uniform scale of
    it: what the region grows through), or None."""
    if node.args and isinstance(node.args[0], fx.Node) and \
            len(node.all_input_nodes) == 1 and _last_dim_kept(node, node.args[0]):
        return node.args[0]
    c = canon(node)
    if c is not None and c.name in ("mul", "div"):
        for a in c.args[:2]:
            if isinstance(a, fx.Node) and _uniform_scale(node, a, region):
                return a
    return None


def _cat_in_region(node: fx.Node, region: set) -> bool | None:
    """For a concatenation: whether it joins the region (None: not a concatenation)."""
    if node.target not in _CAT:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    m = meta(node)
    if m is None or not isinstance(dim, int) or dim % m.dim() == m.dim() - 1:
        return False
    live = [t for t in tensors if meta(t) is None or meta(t).numel() != 0]
    return all(t in region for t in live)


def _sdpa_inputs(u: fx.Node) -> tuple:
    """(query, key, the nodes among its other arguments) of an SDPA call."""
    q = u.args[0] if u.args else u.kwargs.get("query")
    k = u.args[1] if len(u.args) > 1 else u.kwargs.get("key")
    rest = [a for i, a in enumerate(u.args) if i >= 2] + \
        [v for name, v in u.kwargs.items() if name not in ("query", "key")]
    nodes: list[fx.Node] = []
    fx.node.map_arg(rest, nodes.append)
    return q, k, nodes


def _flex_attention(u: fx.Node) -> bool:
    """``u`` is flex_attention (transformers' attn_implementation="flex_attention"):
    query, key, value, then score and mask functions that see each score q·kᵀ and the
    positions, never q's or k's features."""
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return flex is not None and u.target is flex


def _invariant_attention(u: fx.Node, region: set) -> bool:
    """An attention (SDPA, flex_attention) whose region inputs are exactly its query
    and key: it reads them only through q·kᵀ, a sum over the head dim."""
    if u.target not in _SDPA and not _flex_attention(u):
        return False
    q, k, rest = _sdpa_inputs(u)
    return q in region and k in region and not any(a in region for a in rest)


def _swaps_last_two(node: fx.Node) -> bool:
    m = meta(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if m is None or m.dim() < 2:
        return False
    if node.target in ("transpose", torch.transpose) and len(node.args) == 3:
        dims = {d % m.dim() for d in node.args[1:] if isinstance(d, int)}
        return dims == {m.dim() - 2, m.dim() - 1}
    return False


def _invariant_matmul(u: fx.Node, region: set) -> bool:
    """``q @ kᵀ`` with q and k from the region: a sum over the head dim (eager
    attention's scores). ``u`` is the matmul or the transpose feeding it."""
    if u.target not in MATMUL:
        users = list(u.users)
        return _swaps_last_two(u) and u.args[0] in region and bool(users) and \
            all(_invariant_matmul(m, region) for m in users)
    if len(u.args) != 2 or not all(isinstance(a, fx.Node) for a in u.args):
        return False
    q, kt = u.args
    return q in region and kt not in region and _swaps_last_two(kt) and kt.args[0] in region \
        and len(kt.users) == 1


_EMPTY = {"new_empty", torch.empty}


def _attention_key(u: fx.Node, q: fx.Node, region: set) -> fx.Node | None:
    """The key of an attention ``u`` whose query is ``q`` and which reads nothing else
    from the region: SDPA's key, or k of eager attention's ``q @ k.transpose(-2, -1)``."""
    if u.target in _SDPA:
        query, key, rest = _sdpa_inputs(u)
        ok = query is q and key not in region and not any(a in region for a in rest)
        return key if ok else None
    if u.target in MATMUL and len(u.args) == 2 and u.args[0] is q:
        kt = u.args[1]
        if isinstance(kt, fx.Node) and kt not in region and _swaps_last_two(kt) and \
                len(kt.users) == 1:
            return kt.args[0]
    return None


def _latent_key_write(u: fx.Node, q: fx.Node, region: set, head_dim: int,
                      offset: int) -> tuple[fx.Node, fx.Node] | None:
    """Multi-head latent attention assembles each key head from k_nope and the shared
    rotated part: ``k = cat((k_nope, k_rot), -1)``, or in a fresh buffer, ``k =
    new_empty(..., head_dim)``, ``k[..., :offset].copy_(k_nope)``, ``k[...,
    offset:].copy_(k_rot)`` (Hugging Face), read only by the attention (through views
    that keep the head dim: repeat_kv). Where ``u`` is such an attention of the permuted
    query ``q`` (rotated features [offset, head_dim)): (the node that puts k_rot in,
    k_rot). Giving k_rot the query's pair order keeps q·kᵀ exact, with no copy of the
    query. Else None."""
    key = _attention_key(u, q, region)
    if key is None:
        return None
    reader = u if u.target in _SDPA else u.args[1]
    while isinstance(key, fx.Node) and key.target not in _EMPTY and key.target not in _CAT:
        src = _order_keeping_input(key, region)
        if src is None or len(key.users) != 1:
            return None
        reader, key = key, src
    mk = meta(key) if isinstance(key, fx.Node) else None
    if mk is None or mk.dim() == 0 or mk.shape[-1] != head_dim:
        return None
    if key.target in _CAT:
        parts = key.args[0] if key.args else key.kwargs.get("tensors")
        dim = key.args[1] if len(key.args) > 1 else key.kwargs.get("dim", 0)
        widths = [meta(t).shape[-1] if isinstance(t, fx.Node) and meta(t) is not None
                  else None for t in parts]
        if dim not in (-1, mk.dim() - 1) or widths != [offset, head_dim - offset] or \
                len(key.users) != 1:
            return None
        return key, parts[1]
    order = {n: i for i, n in enumerate(u.graph.nodes)}
    writes = {}
    for w in key.users:
        if w is reader:
            continue
        idx = w.args[1] if w.target is operator.getitem else None
        if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and
                isinstance(idx[1], slice) and idx[1].step in (None, 1)):
            return None
        lo, hi = idx[1].start or 0, head_dim if idx[1].stop is None else idx[1].stop
        copy = next(iter(w.users)) if len(w.users) == 1 else None
        if copy is None or copy.target != "copy_" or copy.args[0] is not w or \
                order[copy] > order[u] or (lo, hi) in writes:
            return None
        writes[(lo, min(hi, head_dim))] = copy
    if set(writes) != {(0, offset), (offset, head_dim)}:
        return None
    copy = writes[(offset, head_dim)]
    return copy, copy.args[1]


def permuted_region(starts: list[fx.Node], head_dim: int = 0, offset: int = 0) -> Region:
    """The permuted region grown from ``starts`` (see the module docstring); where the
    rotated features are a suffix [offset, head_dim) of each head (multi-head latent
    attention), attentions whose key is assembled from a rotated part in a buffer
    (_latent_key_write) stay invariant, that part getting the query's order."""
    region = set(starts)
    changed = True
    while changed:  # grow to a fixpoint (a concatenation waits for all its inputs)
        changed = False
        for n in list(region):
            for u in n.users:
                if u in region or u.op not in ("call_function", "call_method"):
                    continue
                cat = _cat_in_region(u, region)
                if cat is None:
                    ok = len([a for a in u.all_input_nodes if a in region]) == 1 and (
                        _uniform_scale(u, n, region) or
                        (u.args and u.args[0] is n and _last_dim_kept(u, n)))
                else:
                    ok = cat
                if ok:
                    region.add(u)
                    changed = True
    invariant, unpermute = [], []
    for n in region:
        for u in n.users:
            if u in region:
                continue
            if _invariant_attention(u, region) or _invariant_matmul(u, region):
                if (u.target in _SDPA or u.target in MATMUL or _flex_attention(u)) and \
                        u not in invariant:
                    invariant.append(u)
                continue
            unpermute.append((u, n))
    key_writes = []
    if offset:
        kept = []
        for u, n in unpermute:
            write = _latent_key_write(u, n, region, head_dim, offset)
            if write is None:
                kept.append((u, n))
                continue
            if u not in invariant:
                invariant.append(u)
            if write not in key_writes:
                key_writes.append(write)
        unpermute = kept
    order = {x: i for i, x in enumerate(starts[0].graph.nodes)}
    unpermute = sorted(set(unpermute), key=lambda e: (order[e[0]], order[e[1]]))
    return Region(region, invariant, unpermute, key_writes)


def keeps_order(region: Region) -> bool:
    """Whether some attention reads the permuted q and k as they are: else every rotated
    value is copied back, and the fusion gains nothing (decide leaves it)."""
    return bool(region.invariant)


def region_of(m, starts: list[fx.Node]) -> Region:
    """The permuted region of match ``m``'s rotated outputs ``starts``: with latent keys
    where each head's rotated features are a suffix after others (multi-head latent
    attention)."""
    rot = m.rotated[0]
    suffix = rot.rotary_offset and rot.rotary_offset + rot.rotary_dim == rot.head_dim
    return permuted_region(starts, rot.head_dim, rot.rotary_offset if suffix else 0)


# ---- side conditions ---------------------------------------------------------------------

def _private(m) -> list[fx.Node]:
    """Nodes only the fused GEMM may read: everything between the projections and the
    rotated outputs."""
    nodes = []
    for r in m.rotated:
        nodes += [n for n in r.nodes if n is not r.out] + list(r.split) + [r.column_node]
    return nodes


def side_conditions(m) -> tuple[list[str], str | None]:
    """(conditions that hold, the first that fails or None) for a match whose segments
    the pattern has planned (patterns/rope.plan_segments: the v that can join, the packed
    slices left over). Pure."""
    held: list[str] = []
    return held, _side_conditions(m, held)


def moved_read_updated(m) -> str | None:
    """The fused GEMM reads x, the weights, biases, row scale and angles at one point
    (patterns/rope.apply's anchor), eager's projections and rotations at theirs: an update
    in place of one of them (or of memory one shares) anywhere from the first projection
    to the last reader of a value the match replaces would be read by one and not the
    other (q's GEMM, then x.add_(1), then k's: the two read different x)."""
    order = {n: i for i, n in enumerate(m.rotated[0].out.graph.nodes)}
    gemms = [n for s in m.segments for n in s.proj.nodes if n in order]
    # to the last reader of what it replaces (the fused GEMM may sit as late as the first)
    ends = [r.out for r in m.rotated] + [s.column_node for s in m.passthrough]
    ends += [u for e in list(ends) for u in e.users]
    angles = (m.angle.inv_freq, m.angle.pos, m.angle.cos, m.angle.sin) \
        if m.angle is not None else ()
    reads = [m.proj.x, m.proj.r, m.table, *angles,
             *(v for s in m.segments for v in (s.proj.weight, s.proj.bias))]
    ends = [n for n in ends if n in order]
    if not gemms or not ends:  # fails closed: where eager read them is not in the graph
        return Why("the projections or the values they replace are not in the graph: "
                   "where eager read the fused GEMM's inputs cannot be checked",
                   "rope.in_place")
    found = updated_between(reads, min(gemms, key=order.get), max(ends, key=order.get))
    if found is None:
        return None
    return Why(f"{describe(found[0])} updates {describe(found[1])} in place between the "
               "projections and the rotation: the fused GEMM reads it at one point, eager's "
               "GEMMs at theirs", "rope.in_place")


def _side_conditions(m, held) -> str | None:
    why = moved_read_updated(m)
    if why:
        return why
    shapes = {(r.head_dim, r.rotary_dim, r.rotary_offset, r.stored_pairs) for r in m.rotated}
    if len(shapes) != 1:
        return Why("q and k differ in head_dim, rotary span or stored pair order (one "
                   "permutation for both)", "rope.head_shapes")
    head_dim, rotary_dim, offset, _ = shapes.pop()
    if rotary_dim % 2 or offset % 2 or offset + rotary_dim > head_dim:
        return Why(f"the rotated features [{offset}, {offset + rotary_dim}) are odd or exceed "
                   f"head_dim {head_dim}", "rope.rotary_dim")
    x = meta(m.proj.x)
    if m.form == "pairs" and m.angle_source == "table":
        mt = meta(m.table)
        if mt.requires_grad:
            return Why(f"the table {describe(m.table)} requires grad",
                       "rope.angle_requires_grad")
        if x is None or x.dim() != 3 or mt.shape[-2] != x.shape[1] or \
                (mt.dim() == 3 and mt.shape[0] not in (1, x.shape[0])):
            return Why("the GEMM input is not [batch, seq, hidden] matching the table",
                       "rope.input_shape")
        held.append(f"q and k rotate adjacent pairs by the complex table {describe(m.table)}")
    elif m.form == "interleaved":
        rows = layouts.table_rows_shape(meta(m.angle.cos).shape)
        width = rotary_dim // 2 if m.angle.half_width else rotary_dim
        if x is None or x.dim() != 3 or rows is None or rows[0] not in (1, x.shape[0]) or \
                rows[1] != x.shape[1] or rows[2] != width:
            return Why("the GEMM input is not [batch, seq, hidden] matching the cos/sin tables",
                       "rope.input_shape")
        held.append(f"q and k rotate adjacent pairs (x[2p], x[2p+1]) by the tables "
                    f"{describe(m.angle.cos)}, {describe(m.angle.sin)} read as they are")
        held.append("the tables hold one angle per rotation pair (the rotation written out "
                    "over each pair's two elements)" if m.angle.half_width else
                    "both features of a pair share cos and sin (repeat_interleave(θ, 2), as "
                    "the models build them): checked on the device at every call (a table "
                    "that breaks it fails loudly)")
    elif m.angle_source == "table":
        rows = layouts.table_rows_shape(meta(m.angle.cos).shape)
        if x is None or x.dim() != 3 or rows is None or rows[1] != x.shape[1] or \
                rows[0] not in (1, x.shape[0]):
            return Why("the GEMM input is not [batch, seq, hidden] matching the cos/sin tables",
                       "rope.input_shape")
        held.append(f"cos/sin read as tables ({describe(m.angle.cos)}, "
                    f"{describe(m.angle.sin)}): {m.angle.why_table}")
        if m.angle.half_width:
            held.append("the tables hold one angle per rotation pair (the rotation written "
                        "out over x's halves)")
        else:
            held.append("their halves agree (cat(θ, θ), as Hugging Face builds them): not "
                        "visible in this graph, so checked on the device at every call (a "
                        "table that breaks it fails loudly)")
    else:
        angle = m.angle
        n_freq = angle.frequency_count
        if 2 * n_freq != rotary_dim:
            return Why(f"{n_freq} frequencies for a rotary_dim of {rotary_dim}",
                       "rope.frequency_count")
        for node in (angle.inv_freq, angle.pos):
            if meta(node).requires_grad:
                return Why(f"{describe(node)} requires grad (positions and frequencies "
                           "are data)", "rope.angle_requires_grad")
        held.append(f"the angle is pos ⊗ inv_freq ({describe(angle.pos)}, "
                    f"{describe(angle.inv_freq)}), cos/sin of "
                    + ("θ (the rotation written out over x's halves)" if angle.half_width
                       else "cat(θ, θ)")
                    + ("" if not m.scaled else ", scaled by " + (
                        f"{angle.scale:g}" if isinstance(angle.scale, float)
                        else f"the run-time scalar {describe(angle.scale)}")))
        pos_batch, pos_len = angle.positions_shape
        if x is None or x.dim() != 3 or pos_len != x.shape[1] or \
                pos_batch not in (1, x.shape[0]):
            return Why("the GEMM input is not [batch, seq, hidden] matching the positions",
                       "rope.input_shape")
    normed = [r for r in m.rotated if r.norm is not None]
    if normed:
        if len({r.norm.idiom.eps for r in normed}) != 1:
            return Why("the QK-norms of q and k have different eps (the kernel's per-head "
                       "statistic has one)", "rope.qk_norm_eps")
        if len({r.norm.after_rotation for r in normed}) != 1:
            return Why("q is normalised before its rotation and k after it, or the other way "
                       "round (the epilogue has one order)", "rope.qk_norm_order")
        if any(r.member for r in normed):
            return Why("a QK-norm over the heads of a per-head packed projection (not "
                       "implemented)", "rope.qk_norm_packed")
        held.append(f"the QK-norm ({', '.join(describe(r.norm.idiom.output) for r in normed)}"
                    f") normalises each head's {head_dim} features with eps "
                    f"{normed[0].norm.idiom.eps:g}, "
                    + ("after the rotation: its statistic is formed from the value the "
                       "rotation reads, the weight applied to the rotated columns"
                       if normed[0].norm.after_rotation else
                       "before the rotation, as eager does: its statistic is formed in the "
                       "epilogue from the GEMM's output, the weight applied per column"))
    private = set(_private(m))
    for r in m.rotated:
        if r.columns[1] - r.columns[0] != r.n_heads * r.head_dim:
            return Why(f"{describe(r.column_node)} is not the {r.n_heads} heads it splits",
                       "rope.head_split")
    inside = private | {r.out for r in m.rotated} | {
        n for s in m.passthrough if s.member for n in (s.column_node, *s.split)}
    for n in private:
        outside = [u for u in n.users if u not in inside]
        if outside:
            return Why(f"{describe(n)} is also read by {describe(outside[0])}: the fused "
                       "GEMM writes only the rotated values", "rope.unrotated_read")
    dtypes = {meta(r.out).dtype for r in m.rotated}
    if len(dtypes) != 1:
        return Why("q and k are rotated into different dtypes", "rope.dtypes")
    held.append("the unrotated q and k are read only by their rotation")
    for proj in {s.proj.out: s.proj for s in m.segments}.values():
        covered = sorted([s.columns for s in m.segments if s.proj.out is proj.out] +
                         [s.columns for s in m.remainders if s.proj.out is proj.out])
        if _tiling(covered, meta(proj.out).shape[-1]) is None:
            return Why(f"the slices of {describe(proj.out)} do not cover it exactly once",
                       "rope.packed_cover")
    if m.remainders:
        held.append("the rest of the packed projection (" + ", ".join(
            describe(s.column_node) for s in m.remainders) + ") gets a GEMM of its own")
    return None


def _tiling(cols, n):
    """``cols`` if they tile [0, n) in order, else something else."""
    at = 0
    for lo, hi in cols:
        if lo != at:
            return None
        at = hi
    return cols if at == n else None


def decide(m, program) -> Decision:
    """Legality of replacing match ``m`` (its segments final: see side_conditions) by one
    GEMM running ``program``. Pure."""
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    if m.angle_source == "angles" and not recomputes_angles(m, program):
        held.append("the kernel reads those angles as one (cos, sin) table made from them "
                    "(float64 angle reduced mod one turn, cos and sin rounded once to "
                    "float32): a training graph, whose backward reads the same table")
    # the rotations' outputs are the model's own nodes (the projection's may be an earlier
    # rewrite's call, without a traced value); unknown counts as training: replay
    trains = any(meta(r.out) is None or meta(r.out).requires_grad for r in m.rotated)

    def replay(match, gradients: bool = False, key_order: bool = False):
        return _replay(match, program, key_order, gradients)

    norm = [] if m.head_norm is None else [statements.prove_head_norm_permutation()] + (
        [statements.prove_head_norm_through_rotation()] if m.head_norm[2] else [])
    if m.form in ("pairs", "interleaved"):  # already adjacent pairs: nothing is permuted
        rotation = statements.prove_complex_rotation() if m.form == "pairs" else \
            statements.prove_written_pair_rotation() if m.angle.half_width else \
            statements.prove_pair_rotation()
        facts = statements.prove_rotation_facts()
        seen = guarded_with_gradients(replay, m, trains)
        if isinstance(seen, Rejection):
            return seen
        return Proof("  ;".join(p.statement for p in (rotation, facts, *norm)),
                     (*rotation.assumptions, *held,
                      "q and k keep the model's feature order (no permutation)"),
                     tuple(step for p in (rotation, facts, *norm) for step in p.steps), seen)
    region = region_of(m, [r.out for r in m.rotated])
    for n in region.nodes:  # an in-place update would land in the permuted order
        for u in n.users:
            if mutated_value(u) is n:
                return Rejection(Why(f"{describe(n)} is updated in place by {describe(u)} "
                                     "(a permuted value must only be read)",
                                     "rope.permuted_in_place"), m.path)
    if not keeps_order(region):  # legal, but a speed decision: nothing would be gained
        return Rejection(Why(
            "no attention reads the permuted q and k together (" + region.describe() +
            "): every reader would get eager's order back by a copy, which costs the pass "
            "over q and k the fused rotation saves; left", "rope.no_invariant_reader"),
            m.path)
    interleave = statements.prove_rope_interleave()
    invariance = statements.prove_permutation_invariance()
    facts = statements.prove_rotation_facts()
    held.append(region.describe())
    if m.passthrough:
        held.append("v joins the GEMM " + ("with frequency 0" if recomputes_angles(m, program)
                                          else "under a 0 rotate flag") + ": " + ", ".join(
            describe(s.column_node) for s in m.passthrough))
    seen = guarded_with_gradients(
        functools.partial(replay, key_order=bool(region.key_writes)), m, trains)
    if isinstance(seen, Rejection):
        return seen
    return Proof(
        ";  ".join(p.statement for p in (interleave, invariance, facts, *norm)),
        (*interleave.assumptions, *held, *(a for p in norm for a in p.assumptions)),
        (*interleave.steps, *invariance.steps, *facts.steps,
         *(step for p in norm for step in p.steps),
         "every edge out of the permuted region is an invariant q·k contraction or gets "
         "eager's order back"),
        seen)


# ---- witness -----------------------------------------------------------------------------

def layout(m) -> tuple:
    """The fused GEMM's segments as kernels/ops layouts."""
    out = []
    for s in m.segments:
        lo, hi = s.columns
        if s.rotates and (s.form == "half" or m.angle_source == "angles"):
            # (the complex form's pairs are stored adjacent: recomputed angles need
            # each pair's frequency, and nothing is permuted)
            out.append((lo, hi, s.n_heads, s.head_dim, s.rotary_dim, s.rotary_offset,
                        int(s.stored_pairs), *s.member))
        else:
            out.append((lo, hi, 0, 0, 0, *s.member))
    return tuple(out)


def segment_columns(y: torch.Tensor, s) -> torch.Tensor:
    """A segment's columns of its projection's output y [.., N], in the segment's order
    (a per-head packed member: member i of every head group)."""
    if s.member:
        groups, g, i0, i1, d = s.member
        return y.unflatten(-1, (groups, g, d))[..., i0:i1, :].flatten(-3)
    return y[..., s.columns[0]:s.columns[1]]


def rotated_spans(m) -> tuple:
    """(width, rotated) per segment of the fused GEMM, for a table rotation's flags."""
    return tuple((s.columns[1] - s.columns[0], s.rotates)
                 for s in m.segments)


def _replay(m, program, key_order: bool = False, gradients: bool = False
            ) -> str | Rejection:
    """The matched rotations on random float64 inputs (one short sequence, the model's
    heads), eager's nodes against the fused program + un-permutation. ``key_order``
    (multi-head latent attention): also q·k of the fused query against a key whose
    rotated part has layouts.rope_permute's order, against eager's q·k. ``gradients``
    (a match that trains): the inputs, weights, biases and QK-norm weights are leaves,
    and the gradients of both sides to each are compared instead (a detach among the
    rotation's nodes is right in value and wrong there)."""
    gen = torch.Generator().manual_seed(2718)
    seq = min(_size(meta(m.proj.x).shape[1]), 5)
    k = min(_size(meta(m.proj.x).shape[-1]), 16)
    x = torch.randn(1, seq, k, generator=gen, dtype=torch.float64)
    r = torch.rand(1, seq, 1, generator=gen, dtype=torch.float64) + 0.5
    n_freq = _size(m.angle.frequency_count) if m.angle_source == "angles" else \
        m.rotated[0].rotary_dim // 2
    # float32-representable frequencies: the kernel's float-float split of a float32
    # inv_freq is exact, so eager and fused see the same angles
    inv = (torch.rand(n_freq, generator=gen, dtype=torch.float64) + 0.05).float().double()
    pos = torch.arange(seq, dtype=torch.float64) * 7 + 3
    weights, biases = {}, {}
    for s in m.segments:
        n_out = _size(meta(s.proj.out).shape[-1])
        if s.proj.out not in weights:
            weights[s.proj.out] = torch.randn(n_out, k, generator=gen, dtype=torch.float64)
            biases[s.proj.out] = torch.randn(n_out, generator=gen, dtype=torch.float64) \
                if s.proj.bias is not None else None

    def projection(s):  # what eager's projection computes: (r·) x·Wᵀ (+ b)
        y = x @ weights[s.proj.out].T
        if s.proj.r is not None:
            y = y * r
        if biases[s.proj.out] is not None:
            y = y + biases[s.proj.out]
        return y

    def columns(s):  # a segment's columns as eager's own split nodes select them
        if not s.member:
            return segment_columns(projection(s), s)
        heads = _through_model_split(s, projection(s), seq)
        return (heads.transpose(1, 2) if _transposed(s) else heads).flatten(-2)

    theta = pos[None, :, None] * inv[None, None, :]          # [1, S, h]
    scale = 1.0 if not m.scaled else \
        m.angle.scale if isinstance(m.angle.scale, float) else 1.25  # a run-time one: any
    emb = torch.cat((theta, theta), -1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    if m.form == "half" and m.angle.half_width:  # tables of θ itself (gpt-oss)
        cos, sin = theta.cos() * scale, theta.sin() * scale
    if m.form == "half" and m.angle_source == "angles":  # the model's own, from θ
        cos, sin = _from_angles(m.angle, theta, (m.angle.cos, m.angle.sin), scale)
    table = torch.polar(torch.ones_like(theta[0]), theta[0])  # the "pairs" form's [S, h]
    # the interleaved form's: each pair's angle on both of its features, or once
    # (half-width tables: torchtune's)
    pair_cos, pair_sin = (t * scale if m.angle is not None and m.angle.half_width else
                          t.repeat_interleave(2, -1) * scale
                          for t in (theta.cos(), theta.sin()))
    # each QK-norm's weight: random, the same on both sides
    norm_weights = {r.norm.idiom.weight: torch.randn(r.head_dim, generator=gen,
                                                     dtype=torch.float64)
                    for r in m.rotated if r.norm is not None and r.norm.idiom.weight is not None}
    leaves = [t.requires_grad_() for t in (x, r, *weights.values(), *biases.values(),
                                           *norm_weights.values())
              if t is not None and gradients]
    want = []
    for rot in m.rotated:
        env = {}
        cols = columns(rot)
        heads = cols.view(1, seq, rot.n_heads, rot.head_dim)
        unsq = 2
        if rot.transposed:
            heads, unsq = heads.transpose(1, 2), 1
        env.update(norm_weights)
        if rot.norm is None or rot.norm.after_rotation:
            env[rot.heads] = heads
        else:  # the model's norm nodes run from the head split (before a transpose after it)
            idiom = rot.norm.idiom
            env[idiom.input] = heads.transpose(1, 2) if rot.norm.after else heads
        if rot.form == "pairs" and m.angle_source == "angles":
            # the model's own nodes from θ to the table (polar(1, θ) · s, moves, views):
            # the replay checks what the pattern read off them, angles and scale
            env[rot.table_view], = _from_angles(rot.angle, theta, (rot.table_view,), scale)
        elif rot.form == "pairs":  # the table broadcast the way the graph broadcasts it
            shape = [1, 1, 1, 1]
            shape[3 - unsq] = seq
            shape[3] = rot.rotary_dim // 2
            env[rot.table_view] = table.reshape(shape)
        elif rot.form == "interleaved":  # the values the rotation multiplies by
            width = rot.rotary_dim // 2 if rot.angle.half_width else rot.rotary_dim
            for node, t in ((rot.angle.cos, pair_cos), (rot.angle.sin, pair_sin)):
                env[node] = t[..., :width].unsqueeze(unsq)
        order = {n: i for i, n in enumerate(rot.out.graph.nodes)}
        for node in sorted(rot.nodes, key=order.__getitem__):  # in graph order
            if node in env:
                continue
            env[node] = _eval_rotation(node, env, rot, cos.unsqueeze(unsq), sin.unsqueeze(unsq))
        out = env[rot.out]
        want.append(out.transpose(1, 2) if unsq == 1 else out)

    lay = layout(m)
    w = layouts.rope_segments(lay, *(weights[s.proj.out] for s in m.segments))
    b = layouts.rope_segments(lay, *(biases[s.proj.out] for s in m.segments)) \
        if m.has_bias else None
    operands = ([r] if m.proj.r is not None else []) + ([b] if b is not None else [])
    if m.head_norm is not None:
        norms = [getattr(s, "norm", None) for s in m.segments]
        offsets = tuple(None if n is None else n.idiom.weight_offset for n in norms)
        operands.append(layouts.rope_norm_weight(lay, offsets, x, *(
            None if n is None else norm_weights.get(n.idiom.weight) for n in norms)))
        if None in offsets:
            operands.append(layouts.rope_norm_keep(lay, offsets, x))
    if m.form == "pairs" and m.angle_source == "table":
        operands.append(layouts.rope_table_rows(table, x))
    elif m.form == "interleaved":
        rot = m.rotated[0]
        operands.append(layouts.rope_pair_table_rows(pair_cos, pair_sin, x, rot.head_dim,
                                                     rot.rotary_dim,
                                                     m.angle.half_width).double())
    elif m.angle_source == "table":
        rot = m.rotated[0]
        operands.append(layouts.rope_half_table_rows(cos, sin, x, rot.head_dim,
                                                     rot.rotary_dim, m.angle.half_width,
                                                     rot.rotary_offset).double())
    if m.angle_source == "angles" and not recomputes_angles(m, program):
        # a training graph's one table, made from the same positions and frequencies
        rot = m.rotated[0]
        operands.append(layouts.rope_angle_table_rows(
            layouts.rope_positions(pos[None, None, :], x), inv.float(), rot.head_dim,
            rot.rotary_offset).double())
    if not recomputes_angles(m, program):
        if m.passthrough:
            operands.append(layouts.rope_rotated_columns(rotated_spans(m), x))
    else:
        if m.scaled:
            operands.append(layouts.rope_column_scale(scale, lay, x))
        operands += [layouts.rope_positions(pos[None, None, :], x),
                     layouts.rope_frequencies(inv.float(), lay)]
    fused = fused_linear(exact(program.to_text()), x, w, *operands, gradients=gradients)[0]
    err, at, gots, refs = 0.0, 0, [], []
    for rot, ref in zip(m.rotated, want):
        got = fused[..., at:at + rot.n_heads * rot.head_dim].unflatten(
            -1, (rot.n_heads, rot.head_dim))
        if key_order:
            k = torch.randn(rot.head_dim, generator=gen, dtype=torch.float64)
            lo = rot.rotary_offset
            k_fused = torch.cat((k[:lo], layouts.rope_permute(k[lo:])))
            err = max(err, rel_err(got @ k_fused, ref @ k))
        if rot.form == "half":
            got = layouts.rope_unpermute(got, rot.head_dim, rot.rotary_dim, rot.rotary_offset)
        err = max(err, rel_err(got, ref))
        gots.append(got)
        refs.append(ref)
        at += rot.n_heads * rot.head_dim
    for s in m.passthrough:
        n = s.columns[1] - s.columns[0]
        err = max(err, rel_err(fused[..., at:at + n], columns(s)))
        gots.append(fused[..., at:at + n])
        refs.append(columns(s))
        at += n
    if gradients:
        return verdict(gradient_error(gots, refs, leaves),
                       f"the gradients to the {len(leaves)} inputs, 1 × {seq} tokens",
                       m.path, gradients=True)
    return verdict(err, f"1 × {seq} tokens, {len(m.segments)} segments", m.path)


def recomputes_angles(m, program) -> bool:
    """Whether the program forms the angles itself (``rope``: positions and frequencies)
    rather than reading a (cos, sin) table (``rope_table``: the model's, or in a training
    graph one made from the graph's angles, patterns/rope.angles_as_table)."""
    return m.angle_source == "angles" and not any(i.op == "rope_table" for i in program.body)


def _from_angles(angle, theta: torch.Tensor, targets: tuple, scale) -> list:
    """``targets`` (the tables the rotation reads) computed by the model's own nodes from
    the replay's angles θ [1, S, h] in place of the graph's θ, and the replay's ``scale``
    in place of a run-time attention scaling: the replay then checks what the pattern
    read off those nodes (cat(θ, θ), cos/sin or polar, the scale, moves and views)
    instead of trusting it. Casts keep float64, as in the rotation's own replay. A node
    on the way that reads anything else: no witness (_Unreplayable)."""
    emb = angle.emb
    parts = emb.args[0] if emb.target in _CAT and emb.args else None
    root = parts[0] if isinstance(parts, (list, tuple)) and len(parts) == 2 and \
        parts[0] is parts[1] else emb  # θ itself under cat(θ, θ)
    env = {root: theta}
    if isinstance(angle.scale, fx.Node):
        env[angle.scale] = torch.tensor(scale, dtype=torch.float64)
    nodes, todo = set(), list(targets)
    while todo:
        n = todo.pop()
        if n in env or n in nodes:
            continue
        if n.op not in ("call_function", "call_method"):
            raise _Unreplayable(f"the rotation's tables read {n.name}, not only the angles")
        nodes.add(n)
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(emb.graph.nodes)}
    for node in sorted(nodes, key=order.__getitem__):
        if _is_cast_node(node):
            env[node] = env[node.args[0]]
            continue
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        env[node] = getattr(args[0], node.target)(*args[1:], **kwargs) \
            if node.op == "call_method" else node.target(*args, **kwargs)
    return [env[t] for t in targets]


def _transposed(s) -> bool:
    return any(swaps_heads(n) for n in s.split)


def _through_model_split(s, y: torch.Tensor, seq: int) -> torch.Tensor:
    """A packed member's heads from its projection's whole output y [1, seq, N] through
    the model's own split nodes (the view's batch and sequence sizes replaced by the
    replay's; a reshape to the same shape skipped): the witness compares the member
    gather (segment_columns, rope_segments) with what the model selects, instead of
    trusting the pattern's reading of those nodes."""
    v = y
    for node in reversed(s.split):  # the view of the whole projection first
        if node is s.split[-1]:
            sizes = node.args[1:]
            sizes = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) \
                else list(sizes)
            v = v.view(1, seq, *sizes[2:])
        elif node.target in ("view", "reshape", torch.reshape):
            mi, mo = meta(node.args[0]), meta(node)
            if tuple(mi.shape) == tuple(mo.shape):
                continue  # the same-shape reshape after the transpose
            if tuple(mi.shape[:2]) != tuple(mo.shape[:2]):
                raise _Unreplayable(f"{node.name} reshapes the batch or sequence dims")
            sizes = node.args[1:]  # CodeGen's head split: batch and sequence kept first
            sizes = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) \
                else list(sizes)
            v = v.reshape(*v.shape[:2], *sizes[2:])
        elif node.target in ("split", torch.split):
            v = torch.split(v, *node.args[1:], **node.kwargs)
        elif node.target in ("unbind", torch.unbind):
            v = torch.unbind(v, *node.args[1:], **node.kwargs)
        elif node.target in ("unflatten", torch.unflatten):  # of trailing dims: no batch
            v = v.unflatten(*node.args[1:], **node.kwargs)    # or sequence size in it
        elif swaps_heads(node):  # transpose(1, 2), or permute(0, 2, 1, 3)
            v = v.transpose(1, 2)
        elif node.target in ("flatten", torch.flatten):
            v = v.flatten(*node.args[1:], **node.kwargs)
        elif node.target in ("broadcast_to", torch.broadcast_to, "expand"):
            continue  # Falcon's grouped k, v: the rotation commutes with a broadcast of
            # whole heads (tables do not depend on the head); the rewrite replays it
        elif node.target in ("chunk", torch.chunk):
            v = torch.chunk(v, *node.args[1:], **node.kwargs)
        elif node.target is operator.getitem:
            v = v[node.args[1]]
        else:  # a split node this replay does not know: no witness, no rewrite
            raise _Unreplayable(f"{node.name} ({node.target}) in a member's head split")
    return v


def _eval_rotation(node, env, rot, cos, sin):
    """One node of the rotation on float64 values; cos/sin tables are the given ones.
    Casts keep float64 (the replay checks math, not roundings), and the complex form's
    split into pairs follows the replay's shape (the graph's has the captured sizes)."""
    if _is_cast_node(node):
        return env[node.args[0]]
    if node.target in ("view", "reshape", torch.reshape) and node.args[0] in env:
        x, mi, mo = env[node.args[0]], meta(node.args[0]), meta(node)
        if rot.form == "pairs":  # x's adjacent pairs split out
            return x.reshape(*x.shape[:-1], -1, 2)
        if mi is not None and mo is not None and mo.dim() == mi.dim() + 1 and \
                tuple(mo.shape[:-2]) == tuple(mi.shape[:-1]):
            # the last dim split in two (torchtune's pairs, OLMo's halves): the same split
            # of the replay's, whose leading sizes are its own
            return x.reshape(*x.shape[:-1], *mo.shape[-2:])
        if mi is not None and mo is not None and mo.dim() == mi.dim() - 1 and \
                tuple(mo.shape[:-1]) == tuple(mi.shape[:-2]):
            return x.flatten(-2)  # the last two merged (einops' '... d r -> ... (d r)')
    def arg(a):
        if isinstance(a, fx.Node):
            if a in env:
                return env[a]
            if _broadcast_of_angle(a, rot):
                return cos if _is_cos_side(a, rot) else sin
            for table in (rot.angle.cos, rot.angle.sin) if rot.angle is not None else ():
                if table in env and same_value(a, table):  # the same read of a table
                    return env[table]
            if rot.angle is not None and a in (rot.angle.cos, rot.angle.sin):
                # a table the graph broadcasts over batch and heads as it is (litgpt's
                # [seq, r]): the replay's own [1, seq', r] in the graph's layout (its own
                # width: r, or r/2 for tables of one entry per pair)
                shape = [1] * (meta(a).dim() - 1) + [meta(a).shape[-1]]
                seq_axis = 2 if len(shape) == 4 and meta(a).shape[1] == 1 else len(shape) - 2
                shape[seq_axis] = -1
                return (cos if a is rot.angle.cos else sin).reshape(shape)
            raise ValueError(f"{a.name} outside the rotation")
        return a
    args = fx.node.map_arg(node.args, arg)
    kwargs = fx.node.map_arg(node.kwargs, arg)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _is_cast_node(node) -> bool:
    c = canon(node)
    return c is not None and c.name == "cast"


def _is_cos_side(unsq: fx.Node, rot) -> bool:
    return unsq.args[0] is rot.angle.cos


def _broadcast_of_angle(node: fx.Node, rot) -> bool:
    """``node`` is cos or sin with a new axis inserted (``unsqueeze(d)``, ``[:, None]``):
    the replay puts its own cos/sin there, broadcast the same way."""
    if rot.angle is None or not node.args or node.args[0] not in (rot.angle.cos, rot.angle.sin):
        return False
    if node.target in ("unsqueeze", torch.unsqueeze):
        return True
    if node.target is operator.getitem:
        idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(i is None or i is Ellipsis or i == slice(None) for i in idx)
    return False
