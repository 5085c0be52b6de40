"""The operands' encodings: how the rewritten graph lays out what a program reads, from
the model's live tensors, and reads back what it writes. These functions are what the
layout contracts (codegen/quack_source.py) describe, so the code generator, the graph
(every rewritten graph calls them, recomputed on every call from the live parameters)
and the legality witnesses (algebra/) share one definition. Plain torch, no state: a
value kept between calls is the runtime's (kernels/).

    leading dims        flatten_operands / unflatten_outputs / rows_like; as_rows /
                        as_row_vector / lead_of / from_rows (row_chains.py)
    the norm's chain    fold_scale (a per-feature factor into W), distribute_bias (a shift)
    LayerNorm           layernorm_statistics (r, μ), layernorm_weights (W', s, b')
    gated pairs         interleave_rows, interleave_halves(_up_first)
    RoPE                rope_segments (per-head permutation, q/k/v concatenated),
                        segment, pair_order, half_order, rope_unpermute, rope_permute,
                        rope_frequencies, rope_positions, rope_column_scale,
                        rope_rotated_columns, rope_table_rows, rope_half_table_rows,
                        rope_pair_table_rows
    cross-entropy       row_targets, cross_entropy_from_rows, unmaterialised_logits

A RoPE segment layout is (lo, hi, n_heads, head_dim, rotary_dim[, rotary_offset,
stored_pairs][, groups, g, i0, i1, d]) (segment() reads it): rows [lo, hi) of a
projection, per-head interleaved for the rotation (n_heads > 0), or kept as they are
(n_heads == 0: v, frequency 0). Each head rotates features [rotary_offset, rotary_offset
+ rotary_dim) (0 when left out: a prefix; multi-head latent attention rotates a suffix);
stored_pairs = 1 where the projection's rows already hold each rotation pair adjacent
(DeepSeek-V3's rope_interleave: its rotation reads x[0::2], x[1::2]), so nothing is
permuted. With the last five, the projection's rows are groups [groups, g, d] and the
segment is members [i0, i1) of each (GPT-NeoX's [q_h, k_h, v_h] per head; Falcon's
heads), hi − lo its width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import reference
from .program import Kind, parse


def real(tensors) -> bool:
    """Plain tensors of an eager run: not fake or functional ones under tracing."""
    return not torch.compiler.is_compiling() and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


# ---- leading dims ------------------------------------------------------------------------

def flatten_operands(prog, operands):
    """The op's 2-D contract: tile operands [M, N] (row partials [M, T]), per-row operands
    [M] (a tensor already in that form passes as it is: a view per call is host time a
    decode step pays)."""
    return [as_rows(t) if spec.kind in (Kind.TILE, Kind.ROW_PARTIALS) else
            as_row_vector(t) if spec.kind == Kind.PER_ROW else t
            for spec, t in zip(prog.operands, operands)]


def unflatten_outputs(prog, outs, lead):
    """Tile outputs back to [*lead, N], per-row ones to [*lead, 1], row partials to
    [*lead, T] (a 2-D call's, lead (M,), come back as the op gave them: [M, N], [M] and
    [M, T])."""
    lead = tuple(lead)
    return tuple(from_rows(o, lead, spec.kind == Kind.PER_ROW)
                 for spec, o in zip(prog.outputs, outs))


def from_rows(o: torch.Tensor, lead: tuple, per_row: bool) -> torch.Tensor:
    """One output of the op's 2-D form ([M, N], or [M] per row) as [*lead, N] or
    [*lead, 1]; unflatten_outputs per output, and what row_chains.py inserts where a
    value leaves a chain of fused calls."""
    if len(lead) == 1:
        return o
    return o.reshape(tuple(lead) + ((1,) if per_row else (o.shape[-1],)))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[*lead, K] as the op's [M, K] (a tensor already 2-D passes as it is)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def as_row_vector(r: torch.Tensor) -> torch.Tensor:
    """A per-row value [*lead, 1] as the op's [M] (one already 1-D passes as it is)."""
    return r if r.dim() == 1 else r.reshape(-1)


def lead_of(x: torch.Tensor) -> torch.Size:
    """x's leading dims: the shape a chain's results go back to (row_chains.py)."""
    return x.shape[:-1]


def fused_linear_reference(program: str, x: torch.Tensor, weight: torch.Tensor,
                           *operands: torch.Tensor,
                           run=reference.run_program) -> tuple[torch.Tensor, ...]:
    """kernels/ops.fused_linear through the reference interpreter, with no op (and no
    runtime counters): what the legality witnesses run. ``run(prog, a, b, operands)``
    evaluates the flattened call (the witness's gradient replay passes one whose
    backward is the family's rule: algebra/witness.run_program)."""
    prog = parse(program)
    outs = run(prog, as_rows(x), weight, flatten_operands(prog, operands))
    return unflatten_outputs(prog, outs, x.shape[:-1])


def rows_like(r: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Reshape a per-row value [..., 1] to follow ``h``'s reshape of its leading dims
    (the last dim of ``h`` unchanged, so rows keep their C order)."""
    return r.reshape(*h.shape[:-1], 1)


def fold_scale(weight: torch.Tensor, scale) -> torch.Tensor:
    """W' = W·diag(s): a per-feature factor between the norm and the GEMM, folded into
    the weights (recomputed from the live parameters on every call)."""
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(1, -1).to(weight.dtype)
    return weight * scale


def distribute_bias(shift, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The epilogue bias of (r·h + shift)·Wᵀ + b: shift·Wᵀ + b, one value per output
    feature (recomputed from the live parameters on every call)."""
    if not isinstance(shift, torch.Tensor):
        shift = torch.full((weight.shape[1],), float(shift), dtype=weight.dtype,
                           device=weight.device)
    return F.linear(shift.reshape(-1).to(weight.dtype), weight, bias)


class _LayerNormStatistics(torch.autograd.Function):
    """(r, μ) from the GPU's one-pass Welford kernel, with the analytic backward.

    ``torch.batch_norm_stats`` over z viewed as [1, rows, K] is a per-row mean and
    rsqrt(biased variance + eps) in float32 from a 16-bit z: one read of z, two float32
    vectors written (var_mean of z.float() would first write a float32 copy of z, and
    var_mean of z itself rounds μ to 16 bits, which the correction μ·s cannot afford).
    It has no derivative, hence this Function: dz = dμ/K − dr·r³·(z − μ)/K."""

    @staticmethod
    def forward(ctx, z, eps):
        r, mu = _welford_rows(z, eps)
        ctx.save_for_backward(z, r, mu)
        return r, mu

    @staticmethod
    def backward(ctx, dr, dmu):
        if torch.is_grad_enabled():  # r and μ come from a kernel with no derivative: a
            raise RuntimeError(      # second derivative would miss their dependence on z
                "coda_rewrite: the LayerNorm statistics' backward has no second derivative "
                "(a backward with create_graph=True is not supported through it)")
        z, r, mu = ctx.saved_tensors
        k, wide = z.shape[-1], r.dtype
        dz = torch.zeros_like(z, dtype=wide)
        if dmu is not None:
            dz = dz + dmu.to(wide) / k
        if dr is not None:
            dz = dz - dr.to(wide) * r.pow(3) * (z.to(wide) - mu) / k
        return dz.to(z.dtype), None


def _welford_rows(z: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, μ), each [..., 1], from one batch_norm_stats kernel over z as [1, rows, K]."""
    mu, r = torch.batch_norm_stats(z.reshape(1, -1, z.shape[-1]), eps)
    shape = (*z.shape[:-1], 1)
    return r.reshape(shape), mu.reshape(shape)


def layernorm_statistics(z: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A LayerNorm's row statistics over the last dim, each [..., 1]: r = rsqrt(biased
    variance + eps) and the mean μ, in float32 for a 16-bit z, float64 for a float32 or
    float64 one (an error δμ moves the output by r·δμ·s, of the mean's size: float32 μ of
    a float32 z would cost ~2^-24·|μ|/σ, and the float32 rule is 1e-5 of eager). The
    variance is a Welford / two-pass one, never E[z²] − μ², which cancels when |μ| ≫ σ.
    Differentiable. On the GPU with a 16-bit z: one kernel (_LayerNormStatistics); under
    tracing (Inductor), var_mean of the upcast, which Inductor fuses with what makes z."""
    if real([z]) and z.is_cuda and z.dtype in (torch.bfloat16, torch.float16):
        if torch.is_grad_enabled() and z.requires_grad:
            return _LayerNormStatistics.apply(z, float(eps))
        return _welford_rows(z, float(eps))  # inference: no autograd node on every call
    zc = z.to(reference.accumulate_dtype(z.dtype))
    var, mu = torch.var_mean(zc, dim=-1, keepdim=True, correction=0)
    return torch.rsqrt(var + eps), mu


def layernorm_weights(weight: torch.Tensor, bias: torch.Tensor | None,
                      gamma: torch.Tensor | None, beta: torch.Tensor | None,
                      scale=None, shift=None):
    """(W', s, b') for a GEMM reading LN(z)·scale + shift (scale, shift: what stands
    between the norm and the GEMM, composed by row_scale.replay_chain; None where
    nothing does):

        W' = W ∘ (γ·scale), rounded once to W's dtype     (what the GEMM multiplies z by)
        s_j = Σ_k W'[j, k], from those rounded values: float32 from 16-bit ones, float64
              from float32 ones
        b' = (β·scale + shift)·Wᵀ + b, float32; None where there is nothing to add

    s is summed from the very values the GEMM multiplies, so z·W'ᵀ − μ·s = (z − μ)·W'ᵀ
    holds for the rounded weights too (each product of two 16-bit values is exact in
    float32). s is detached: the program's backward rule (kernels/backward/centred.py)
    returns W'’s whole gradient, s's part included, as (r·dy)ᵀ·(z − μ) (the witness's
    gradient replay runs that rule against eager's autograd)."""
    wide = torch.float64 if weight.dtype == torch.float64 else torch.float32
    factor = None
    for f in (gamma, scale):
        if f is None:
            continue
        f = f.to(wide) if isinstance(f, torch.Tensor) else float(f)
        factor = f if factor is None else factor * f
    w_fold = weight if factor is None else \
        (weight.to(wide) * (factor.reshape(1, -1) if isinstance(factor, torch.Tensor)
                            else factor)).to(weight.dtype)
    # s is multiplied by μ, of the mean's size: from float32 weights it is summed in
    # float64 (a float32 sum's error would move the output by ~2^-24·|μ|/σ)
    s = w_fold.detach().to(reference.accumulate_dtype(weight.dtype)).sum(-1)
    total_shift = None
    if beta is not None:
        total_shift = beta.to(wide)
        if scale is not None:
            total_shift = total_shift * (scale.to(wide) if isinstance(scale, torch.Tensor)
                                         else float(scale))
    if shift is not None:
        sh = shift.to(wide) if isinstance(shift, torch.Tensor) else float(shift)
        total_shift = sh if total_shift is None else total_shift + sh
    if total_shift is None:
        b_fold = None if bias is None else bias.to(wide)
    else:
        if not isinstance(total_shift, torch.Tensor):
            total_shift = torch.full((weight.shape[1],), total_shift, dtype=wide,
                                     device=weight.device)
        b_fold = F.linear(total_shift.reshape(-1), weight.to(wide),
                          None if bias is None else bias.to(wide))
    return w_fold, s, b_fold


def interleave_rows(gate: torch.Tensor | None, up: torch.Tensor | None) -> torch.Tensor:
    """[g0, u0, g1, u1, ...]: the rows (or, for biases, the entries) of a gate and an
    up projection interleaved, so that one GEMM's adjacent output columns are a
    (gate, up) pair. A missing bias side (None) is zeros. Recomputed from the live
    parameters on every call: a re-layout done once would go stale after an optimizer
    step (autograd de-interleaves the gradient)."""
    if gate is None:
        gate = torch.zeros_like(up)
    if up is None:
        up = torch.zeros_like(gate)
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def interleave_halves(packed: torch.Tensor) -> torch.Tensor:
    """interleave_rows for a packed [gate; up] weight or bias (Phi-3's gate_up_proj,
    read as ``chunk(2, dim=-1)``): rows [0, n) are the gate, [n, 2n) the up."""
    half = packed.shape[0] // 2
    return packed.unflatten(0, (2, half)).transpose(0, 1).flatten(0, 1)


def interleave_halves_up_first(packed: torch.Tensor) -> torch.Tensor:
    """interleave_halves for a packed [up; gate] weight or bias (x-transformers' GLU,
    ``x, gate = proj(x).chunk(2, dim=-1)``): rows [0, n) are the up, [n, 2n) the gate."""
    half = packed.shape[0] // 2
    return packed.unflatten(0, (2, half)).flip(0).transpose(0, 1).flatten(0, 1)


# ---- RoPE: layouts, positions and frequencies of the fused q/k/v GEMM -------------------

class Segment(NamedTuple):
    """One segment of a RoPE layout (the module docstring's tuple, decoded)."""
    lo: int
    hi: int
    n_heads: int
    head_dim: int
    rotary_dim: int
    rotary_offset: int = 0
    stored_pairs: bool = False
    member: tuple = ()

    @property
    def rotary(self) -> slice:
        """The rotated features of each head."""
        return slice(self.rotary_offset, self.rotary_offset + self.rotary_dim)


def segment(entry: tuple) -> Segment:
    """A layout entry (plain ints: the custom ops carry it as a string) decoded."""
    if len(entry) in (5, 10):
        head, member = entry[:5], entry[5:]
        return Segment(*head, member=tuple(member))
    if len(entry) in (7, 12):
        head, member = entry[:7], entry[7:]
        return Segment(*head[:6], bool(head[6]), tuple(member))
    raise ValueError(f"a RoPE segment layout has 5, 7, 10 or 12 fields, not {entry}")


def pair_order(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Features [x0 .. x_{h-1}, x_h .. x_{2h-1}] of ``dim`` as [x0, x_h, x1, x_h+1, ...]:
    Hugging Face's rotation pair (f, f + h) made adjacent (2f, 2f + 1). A view where the
    strides allow it."""
    n = t.shape[dim]
    return t.unflatten(dim, (2, n // 2)).transpose(dim, dim - 1 if dim < 0 else dim + 1) \
        .flatten(dim - 1 if dim < 0 else dim, dim if dim < 0 else dim + 1)


def half_order(t: torch.Tensor) -> torch.Tensor:
    """The inverse of pair_order on the last dim: adjacent pairs back to halves."""
    n = t.shape[-1]
    return t.unflatten(-1, (n // 2, 2)).transpose(-1, -2).flatten(-2)


def rope_unpermute(t: torch.Tensor, head_dim: int, rotary_dim: int,
                   rotary_offset: int = 0) -> torch.Tensor:
    """The inverse of rope_segments' per-head permutation on an activation's last dim
    (one head): eager's feature order, for a rotated q or k that flows where the order
    shows. (A segment whose rows were stored in pairs has the same inverse: its rotation
    writes the pairs as halves.)"""
    lo, hi = rotary_offset, rotary_offset + rotary_dim
    parts = [t[..., :lo]] if lo else []
    parts.append(half_order(t[..., lo:hi]))
    if hi < head_dim:
        parts.append(t[..., hi:])
    return (torch.cat(parts, -1) if len(parts) > 1 else parts[0]).contiguous()


def rope_permute(t: torch.Tensor) -> torch.Tensor:
    """A rotated value's whole last dim in the fused GEMM's pair order (pair_order): the
    key side of multi-head latent attention, whose rotated part (one small head shared by
    every query head) comes from another GEMM and must match the fused query's order."""
    return pair_order(t).contiguous()


def _as_row_words(out: torch.Tensor, tensors) -> tuple:
    """``out`` and ``tensors`` with each row read as 8-byte words, where that is a view
    and no gradient is wanted: the re-layouts move whole rows, and PyTorch's strided copy
    moves one element per thread step, so 2-byte elements copy at a quarter of the
    speed (measured on the H200: 0.113 ms for Llama-3-8B's q/k/v weights, a plain
    concatenation of them 0.030). Under autograd or tracing, the tensors as they are."""
    present = [t for t in tensors if t is not None]
    same_dtype = all(t.dtype == out.dtype for t in present)  # a bit copy casts nothing
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in present)
    if out.dim() < 2 or not same_dtype or grad or not real([out, *present]):
        return out, tensors
    try:
        return out.view(torch.int64), [None if t is None else t.view(torch.int64)
                                       for t in tensors]
    except RuntimeError:  # rows not a whole number of aligned words
        return out, tensors


def rope_segments(layout: tuple, *tensors: torch.Tensor | None) -> torch.Tensor:
    """The fused GEMM's weight (or bias) from each segment's projection weight (or bias;
    None: zeros), recomputed from the live parameters on every call. A rotated segment's
    rotary rows are reordered per head to [x0, x_h, x1, x_h+1, ..., x_{h-1}, x_{2h-1}]
    (pair_order; rows stored in pairs stay), h = rotary_dim / 2, the head's other rows
    in place: Hugging Face's rotation pair (f, f + h) becomes the adjacent pair (2f,
    2f + 1). Each segment is written once, in place into the result (one pass over the
    weights, where permuting and then concatenating would make two; autograd scatters
    the gradient back)."""
    like = next(t for t in tensors if t is not None)
    segs = [segment(e) for e in layout]
    out = like.new_empty(sum(s.hi - s.lo for s in segs), *like.shape[1:])
    dst_all, tensors = _as_row_words(out, tensors)
    at = 0
    for s, t in zip(segs, tensors):
        dst = dst_all[at:at + s.hi - s.lo]
        at += s.hi - s.lo
        if t is None:
            dst.zero_()
        elif not s.n_heads:
            if s.member:
                rows = _member_rows(t, s.member)
                dst.unflatten(0, rows.shape[:2]).copy_(rows)
            else:
                dst.copy_(t[s.lo:s.hi])
        elif s.stored_pairs:
            dst.copy_(_member_rows(t, s.member).flatten(0, 1) if s.member else t[s.lo:s.hi])
        else:
            # a member's rows are whole heads in order (d may hold several: CodeGen)
            src = _member_rows(t, s.member).flatten(0, 1).unflatten(0, (s.n_heads, s.head_dim)) \
                if s.member else t[s.lo:s.hi].unflatten(0, (s.n_heads, s.head_dim))
            heads = dst.unflatten(0, (s.n_heads, s.head_dim))
            heads[:, s.rotary].copy_(pair_order(src[:, s.rotary], 1))
            for keep in (slice(0, s.rotary_offset), slice(s.rotary.stop, s.head_dim)):
                if keep.stop > keep.start:
                    heads[:, keep].copy_(src[:, keep])
    return out


def _member_rows(t: torch.Tensor, member) -> torch.Tensor:
    """Members [i0, i1) of each group of a packed projection's rows (weight or bias):
    member = (groups, g, i0, i1, d), [heads, d, ...] in head order (GPT-NeoX: q, k or v
    of each head's [q_h, k_h, v_h]; Falcon: a range of heads); a view where the rows
    allow one."""
    groups, g, i0, i1, d = member
    return t.unflatten(0, (groups, g, d))[:, i0:i1].flatten(0, 1)


def rope_frequencies(inv_freq: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The epilogue's per-column frequencies [N] (float32): each rotation pair (2f, 2f+1)
    holds f's inverse frequency in turns per position as a float-float split (hi, lo),
    so the kernel forms the angle to ~2^-48 relative; pass-through columns hold 0."""
    t = inv_freq.reshape(-1).double() / (2 * math.pi)
    hi = t.float()
    lo = (t - hi.double()).float()
    pair = torch.stack((hi, lo), -1).flatten()
    parts = []
    for s in map(segment, layout):
        if s.n_heads:
            head = F.pad(pair, (s.rotary_offset, s.head_dim - s.rotary_offset - pair.numel()))
            parts.append(head.repeat(s.n_heads))
        else:
            parts.append(pair.new_zeros(s.hi - s.lo))
    return torch.cat(parts)


def rope_column_scale(scale, layout: tuple, like: torch.Tensor) -> torch.Tensor:
    """The attention scaling per output column (float32 [N]): ``scale`` (a number or a
    0-d tensor) on rotated columns, 1 on pass-through ones (v, and the features of a
    partial rotary that the tables do not scale)."""
    parts = []
    for s in map(segment, layout):
        ones = torch.ones(s.hi - s.lo, dtype=torch.float32, device=like.device)
        if s.n_heads:
            heads = ones.unflatten(0, (s.n_heads, s.head_dim))
            heads[:, s.rotary] = heads[:, s.rotary] * scale
        parts.append(ones)
    return torch.cat(parts)


def rope_norm_weight(layout: tuple, offsets: tuple, like: torch.Tensor,
                     *weights: torch.Tensor | None) -> torch.Tensor:
    """A QK-norm's weight per fused column (float32 [N]; float64 for a float64 weight):
    each normed segment's head weight plus its offset (Gemma's 1 + w; 1 for a norm
    without a weight) repeated per head, in the segment's pair order (rope_segments, as
    its weight rows); 0 on the columns of a segment without a norm (``offsets[i]`` None:
    v). From the live parameters (autograd takes the gradient back to them)."""
    per_segment = []
    for s, offset, w in zip(map(segment, layout), offsets, weights):
        if offset is None:
            per_segment.append(None)
            continue
        head = w.to(torch.float64 if w.dtype == torch.float64 else torch.float32) + offset \
            if w is not None else torch.ones(s.head_dim, dtype=torch.float32,
                                             device=like.device)
        per_segment.append(F.pad(head.repeat(s.n_heads), (s.lo, 0)))  # rows [lo, hi)
    return rope_segments(layout, *per_segment)


def rope_norm_keep(layout: tuple, offsets: tuple, like: torch.Tensor) -> torch.Tensor:
    """1 on the fused columns no QK-norm scales (float32 [N]), 0 on normed ones. A
    constant of the match (match_constant)."""
    return match_constant(_norm_keep, (layout, offsets), like)


def _norm_keep(layout: tuple, offsets: tuple, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.full((s.hi - s.lo,), float(offset is None), device=device)
                      for s, offset in zip(map(segment, layout), offsets)])


def rope_rotated_columns(spans: tuple, like: torch.Tensor) -> torch.Tensor:
    """A table rotation's per-column flag (float32 [N]) from the segments' (width,
    rotated) spans: 1 on rotated columns, 0 on pass-through ones (v). A constant of the
    match (match_constant)."""
    return match_constant(_rotated_columns, (spans,), like)


def _rotated_columns(spans: tuple, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.full((width,), float(rotated), device=device)
                      for width, rotated in spans])


# (maker, key, device) -> the tensor it made (match_constant); a few per model
_CONSTANTS: dict[tuple, torch.Tensor] = {}


def match_constant(make, key: tuple, like: torch.Tensor) -> torch.Tensor:
    """``make(*key, like.device)``: an operand that depends on nothing but numbers of the
    match (``key``, hashable) and the device, made once per (make, key, device) where the
    graph runs as Python (optimize()'s). Made per call, RoPE's column flags (three fills
    and a cat) cost optimize()'s 1-layer forward at 1 x 64 tokens 74-102 µs of host time
    on an H100 machine (BENCHMARKS.md, thirty-ninth session); Inductor folds such ops.

    A traced graph gets the ops (a kept real tensor has no place in a fake trace); so
    does a call while a CUDA graph is captured, since a tensor made there holds its
    values only once the graph replays. The tensor is made outside inference mode, so a
    later call that autograd records can save it; its readers never write it (epilogue
    operands)."""
    if not real((like,)) or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return make(*key, like.device)
    full_key = (make, key, like.device)
    value = _CONSTANTS.get(full_key)
    if value is None:
        with torch.inference_mode(False):
            value = _CONSTANTS[full_key] = make(*key, like.device)
    return value


def rope_positions(pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each GEMM row's position (float32 [B·S]) from the graph's positions [Bp, 1, S] or
    [Bp, S, 1] (Bp = 1 or B) and the GEMM input x [B, S, K]."""
    b, s = x.shape[0], x.shape[1]
    return pos.reshape(pos.shape[0], s).float().expand(b, s).reshape(-1).contiguous()


def rope_table_rows(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each GEMM row's (cos, sin) row [B·S, head_dim] (float32, cos at 2p and sin at
    2p+1) from a model's complex table [S, hd/2] or [Bt, S, hd/2] (TorchTitan's
    freqs_cis, or view_as_complex of a real [.., hd/2, 2] one; Bt = 1 or B) and the
    GEMM input x [B, S, K]."""
    b, s = x.shape[0], x.shape[1]
    real = torch.view_as_real(table) if table.is_complex() else table
    rows = real.reshape(-1, s, real.shape[-2] * 2).float()
    return rows.expand(b, -1, -1).reshape(b * s, -1).contiguous()


def _head_rows(pairs: torch.Tensor, head_dim: int, rotary_offset: int) -> torch.Tensor:
    """(cos, sin) pairs [.., rotary_dim] placed in a head's columns [.., head_dim]: the
    features a partial rotary passes through get (1, 0), an identity."""
    before, after = rotary_offset, head_dim - rotary_offset - pairs.shape[-1]
    if not before and not after:
        return pairs
    ident = match_constant(_identity_pair, (pairs.dtype,), pairs)  # no copy per call
    return torch.cat([ident.repeat(before // 2).expand(*pairs.shape[:-1], -1), pairs,
                      ident.repeat(after // 2).expand(*pairs.shape[:-1], -1)], -1)


def _identity_pair(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor([1.0, 0.0], dtype=dtype, device=device)


def table_rows_shape(shape) -> tuple | None:
    """The [batch, seq, width] a cos/sin table holds, however it is broadcast over the
    heads: [seq, w] (litgpt's, broadcast over batch and heads as it is), [Bp, seq, w], or
    four dims with a unit head axis, [Bp, 1, seq, w] or [Bp, seq, 1, w]; None for any
    other shape. The tables' row functions read each as ``reshape(-1, seq, w)``."""
    shape = tuple(shape)
    if len(shape) == 2:
        return (1, *shape)
    if len(shape) == 3:
        return shape
    if len(shape) == 4 and 1 in shape[1:3]:
        return (shape[0], shape[2] if shape[1] == 1 else shape[1], shape[3])
    return None


def rope_half_table_rows(cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor,
                         head_dim: int, rotary_dim: int, half_width: bool = False,
                         rotary_offset: int = 0) -> torch.Tensor:
    """The (cos, sin) rows [B·S, head_dim] (float32) of Hugging Face-style tables
    cos/sin [Bp, S, rotary_dim] for the permuted heads: pair f of each head gets
    (cos[f], sin[f]); pass-through features of a partial rotary get (1, 0), an identity.
    The half-split rotation is a rotation only when both halves of the tables agree
    (HF builds them as cat(θ, θ)); that is checked on the device, every call: a table
    that breaks it fails loudly (asynchronously on the GPU), never a wrong result.
    ``half_width``: tables of θ itself, [Bp, S, rotary_dim / 2] (gpt-oss): nothing to
    check."""
    h = rotary_dim // 2
    if not half_width:
        ok = (cos[..., :h] == cos[..., h:]).all() & (sin[..., :h] == sin[..., h:]).all()
        torch._assert_async(ok, "rope: cos/sin halves differ; the table is not cat(θ, θ)")
    pairs = torch.stack((cos[..., :h].float(), sin[..., :h].float()), -1).flatten(-2)
    pairs = _head_rows(pairs, head_dim, rotary_offset)
    b, s = x.shape[0], x.shape[1]
    return pairs.reshape(-1, s, head_dim).expand(b, -1, -1).reshape(b * s, head_dim) \
        .contiguous()


def rope_pair_table_rows(cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor,
                         head_dim: int, rotary_dim: int,
                         half_width: bool = False) -> torch.Tensor:
    """The (cos, sin) rows [B·S, head_dim] (float32) of the tables an interleaved-pair
    rotation multiplies by (x·cos + rotate_pairs(x)·sin; cos/sin [Bp, S, r] or with a unit
    head axis, [Bp, 1, S, r] / [Bp, S, 1, r]): pair p gets (cos[2p], sin[2p]); pass-
    through features of a partial rotary get (1, 0). It is a rotation only when both
    features of a pair share their values (repeat_interleave(θ, 2), as the models build
    them): checked on the device, every call, like the half-split tables. ``half_width``:
    tables of one entry per pair, [.., r/2] (torchtune's): pair p gets (cos[p], sin[p]),
    nothing to check."""
    b, s = x.shape[0], x.shape[1]
    if half_width:
        cos, sin = (t.reshape(-1, s, rotary_dim // 2).float() for t in (cos, sin))
        pairs = torch.stack((cos, sin), -1).flatten(-2)
        pairs = _head_rows(pairs, head_dim, 0)
        return pairs.expand(b, -1, -1).reshape(b * s, head_dim).contiguous()
    cos, sin = cos.reshape(-1, s, rotary_dim), sin.reshape(-1, s, rotary_dim)  # unit axis out
    ok = (cos[..., 0::2] == cos[..., 1::2]).all() & (sin[..., 0::2] == sin[..., 1::2]).all()
    torch._assert_async(ok, "rope: cos/sin differ within a pair; the table is not "
                            "repeat_interleave(θ, 2)")
    pairs = torch.stack((cos[..., 0::2].float(), sin[..., 0::2].float()), -1).flatten(-2)
    pairs = _head_rows(pairs, head_dim, 0)
    return pairs.expand(b, -1, -1).reshape(b * s, head_dim).contiguous()


def rope_angle_table_rows(pos: torch.Tensor, inv_freq: torch.Tensor, head_dim: int,
                          rotary_offset: int = 0) -> torch.Tensor:
    """The (cos, sin) rows [M, head_dim] (float32, cos at 2p and sin at 2p+1) of the
    angles θ[i, p] = pos[i]·inv_freq[p], from each GEMM row's position (rope_positions'
    [M]) and the h frequencies: the table a training graph's rotation reads instead of
    recomputing the angles (patterns/rope.py says why). The angle is formed and reduced
    mod one turn in float64, as exact as the kernel's float-float angle; cos and sin of
    it in float64, rounded once to float32. Pass-through features of a partial rotary
    get (1, 0). One table serves every layer of a graph: [M, h] angles, not one per
    rotated column."""
    turns = inv_freq.reshape(-1).double() / (2 * math.pi)
    theta = torch.remainder(pos.reshape(-1, 1).double() * turns, 1.0) * (2 * math.pi)
    pairs = torch.stack((theta.cos().float(), theta.sin().float()), -1).flatten(-2)
    return _head_rows(pairs, head_dim, rotary_offset).contiguous()


# ---- cross-entropy from per-row losses -------------------------------------------------

def _lead_slice(n, start, stop):
    """[a, b) of a Python slice start:stop over n rows (step 1), in plain arithmetic so
    that symbolic sizes trace."""
    a = 0 if start is None else (start + n if start < 0 else start)
    b = n if stop is None else (stop + n if stop < 0 else stop)
    return a, b


def row_targets(target: torch.Tensor, x: torch.Tensor, vocab: int, dim, start, stop,
                ignore_index: int) -> torch.Tensor:
    """Each GEMM row's class index, flattened: the loss's targets where the loss reads the
    row, ``ignore_index`` for rows a slice of the logits skipped (the causal shift
    ``logits[..., :-1, :]``). A target outside [0, vocab) that is not ignore_index fails
    as it does in PyTorch (asynchronously on the GPU), never a silent wrong loss."""
    lead = list(x.shape[:-1])
    if dim is None:
        t = target.reshape(-1)
    else:
        d = len(lead) + 1 + dim
        a, b = _lead_slice(lead[d], start, stop)
        shape = lead[:d] + [b - a] + lead[d + 1:]
        pads = [0, 0] * (len(lead) - 1 - d) + [a, lead[d] - b]
        t = F.pad(target.reshape(shape), pads, value=ignore_index).reshape(-1)
    ok = (t == ignore_index) | ((t >= 0) & (t < vocab))
    if t.device.type == "cpu" and real([t]):
        # PyTorch's own error and type on the CPU (an IndexError a caller may catch)
        if not bool(ok.all()):
            raise IndexError(f"Target {int(t[~ok][0])} is out of bounds.")
        return t
    torch._assert_async(ok.all(), "cross_entropy: target out of range")
    return t


def cross_entropy_from_rows(loss_rows: torch.Tensor, targets: torch.Tensor,
                            ignore_index: int, reduction: str, x: torch.Tensor, dim, start,
                            stop, dtype: torch.dtype) -> torch.Tensor:
    """F.cross_entropy's result from the epilogue's per-row lse − target logit: ignored
    rows contribute 0; mean divides by the number of rows not ignored (NaN when there is
    none, as PyTorch); none returns the loss's own rows."""
    rows = loss_rows.reshape(-1)
    valid = targets != ignore_index
    rows = torch.where(valid, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    if reduction == "sum":
        out = rows.sum()
    elif reduction == "mean":
        out = rows.sum() / valid.sum()
    else:
        if dim is not None:
            lead = list(x.shape[:-1])
            d = len(lead) + 1 + dim
            a, b = _lead_slice(lead[d], start, stop)
            rows = rows.reshape(lead).narrow(d, a, b - a)
        out = rows.reshape(-1)
    return out.to(dtype)


def unmaterialised_logits(like: torch.Tensor) -> torch.Tensor:
    """What a reader of logits that were never written gets (materialize_logits=False):
    an empty tensor of their dtype and device."""
    return like.new_empty(0)
