"""GEMM → RoPE: the rotation of q and k in their projection's epilogue, q/k/v in one GEMM.

Hugging Face models rotate q and k after their projections with

    q_embed = q·cos + rotate_half(q)·sin        rotate_half(q) = cat(−q[..., h:], q[..., :h])
    cos, sin = cos(emb), sin(emb) (· s)         emb = cat(θ, θ),  θ[b, s, p] = pos[b, s]·f_p

(s: the rope type's attention scaling), i.e. feature i of each head is rotated with
feature i + h (h = rotary_dim / 2) by the angle pos·f_i. Eager writes q and k, reads them
back, writes the rotated copies and reads them again for attention. The rewrite makes
the pair adjacent by permuting each head's output features of W_q and W_k
([x0, x_h, x1, x_h+1, ...]; pass-through features of a partial rotary stay at the end),
runs q, k (and v, when it reads the same input) as one GEMM and rotates each column pair
in the epilogue, with cos/sin computed there from the row's position and the column's
frequency (QuACK's rope_posfreq form: measured faster than a cos/sin table on the H200,
and frequency 0, an exact identity, lets v share the GEMM; see BENCHMARKS.md):

    epilogue:  y = r[i]·acc[i, :] (+ b)   (· s_j)      r: the input norm's deferred rstd;
                                                    s_j: s on rotated columns, 1 on v's
               out[i, 2p], out[i, 2p+1] = rotation of (y[i, 2p], y[i, 2p+1]) by pos[i]·f_p

q and k then stay in the permuted order: attention scores are sums over the head dim,
invariant when q and k carry the same permutation. Where a rotated value flows anywhere
else (a returned KV cache, a cache concatenation with earlier keys, an attention that is
not a q·k contraction), the rewrite puts the eager order back on that edge
(algebra/rope.py proves which edges need it); where no attention keeps the permuted
order at all (a decode step's keys are concatenated with cached ones), it is left.

Spellings: separate q/k/v projections (Llama, Qwen2 with biases, Mistral, Gemma) or one
packed projection sliced into q, k, v (Phi-3); full or partial rotary (Phi-style
``q_rot, q_pass = q[..., :rot], q[..., rot:]``); heads before or after the sequence dim
(unsqueeze_dim 1 or 2); rotate_half by slices or chunk; any rope type whose angle is
pos × inv_freq computed in the graph (default, linear, llama3, YaRN: the frequencies are
read from the graph, the attention scaling, a run-time scalar under dynamic=True,
becomes the per-column s_j).

The complex form (TorchTitan: ``view_as_real(view_as_complex(q.float().reshape(..., -1,
2)) * freqs_cis).flatten(3).type_as(q)``) already rotates adjacent pairs: no permutation,
q/k/v in one GEMM whose epilogue reads (cos, sin) from the model's own table (QuACK's
rotary_cos_sin_load; the table repeats every head_dim columns, so a per-column 0/1 flag
says which columns it rotates: v's pass through). A table computed in the graph as
``polar(ones_like(θ), θ)`` (· s) with θ = pos ⊗ inv_freq (DeepSeek-V2, Llama 4) has its
angles recomputed instead, as the half-split form's are: the pairs are stored adjacent,
nothing is permuted.

When cos/sin are not an outer product computed in this graph (graph inputs: a decoder
layer compiled alone, dynamic NTK rope's graph break; angles of another shape), the
half-split form reads them as a table instead (algebra/rope.py: their halves are checked
on the device at run time), v again passing through under a 0 flag.

Multi-head latent attention (DeepSeek-V3, MiniCPM3, ...) rotates a suffix of each q head
(``q_pass, q_rot = split(q, [p, r], -1)``, the head put back as ``cat((q_pass,
rope(q_rot)), -1)``): the epilogue rotates that span (its rows permuted into pairs, or
kept where DeepSeek-V3's rope_interleave stores them so) and the GEMM's output is the
whole head. k's rotated part is one small head shared by all heads, from another GEMM:
left as graph ops, it takes the query's pair order where the key is assembled
(algebra/rope.py, _latent_key_write), so the query is never copied back.

QK-norm (Qwen3, Gemma 3, Exaone 4: an RMSNorm over each head of q and k between the head
split and the rotation) goes into the same epilogue, before the rotation:

    epilogue:  y = r[i]·acc[i, :] (+ b);  y ← y·(n·g_j + keep_j),  n = rsqrt(mean over
               the head's d columns of y² + eps)      (QuACK's HeadRstd, from the prepass)

g_j: the norm's weight (Gemma's 1 + w) in the head's pair order; keep_j: 1 on columns no
norm scales (v), so v still shares the GEMM. The statistic is a sum over the head, the
same in the permuted order (algebra/statements.prove_head_norm_permutation), and a tile
holds whole heads (the kernel's tile width is a multiple of head_dim). A norm after the
rotation (HunYuan) is the same program in the other order: the rotation keeps each pair's
sum of squares, so n is formed from the value the rotation reads
(prove_head_norm_through_rotation) and out = rot·(n·g_j + keep_j).

Left with the reason: q or k read before the rotation (or before its norm), a norm over
the whole projection before the head split (OLMo 2: its statistic spans tiles), QK-norms
with different eps, a run-time eps, differently rotated q and k, a latent suffix rotated
by a complex table from outside the graph, a table or QK-norm head no kernel tile fits
(on the GPU), no attention keeping the permuted order.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import ClassVar

import torch
import torch.fx as fx

from .. import patterns, size_policy
from ..algebra import rope as rope_algebra
from ..algebra.decision import Rejection, Why
from ..canonical import canon, constant, meta, runtime_scalar
from ..capture import describe, model_path
from ..codegen import layouts
from ..codegen.program import EpilogueProgram, Kind, ProgramBuilder
from ..codegen.reference import dtype_name
from ..graph_utils import (CHUNK, MATMUL, SPLIT, anchor_in_mode_of, calls, chunk_half,
                           copy_meta, erase_if_dead, fused_linear_call, gradient_read, hoist_before,
                           results, same_meta, same_value, shared_call, swaps_heads,
                           through_casts)
from ..kernels import ops, versioned
from ..rmsnorm_idiom import RmsNorm, find_rms_norms
from . import family
from .family import Context, Decided, no_kernel
from .gated_mlp import Projection, projection_of
from .relaid_gemm import relaid_gemm, relayout_node, weights_line

NAME = "rope"
# its rewrites replace GEMMs by fused ones, where they pay (size_policy.py)
FUSES_GEMMS = True
# ... from this many rows (size_policy.py; benchmarks/small_m.py --static and
# inference.py small_m on the H200, BENCHMARKS.md sixth session):
# the RoPE GEMM: 1.19x at 256 rows of the 8B shape (q/k/v, N = 6144; 0.97x at the 1B
# shape), 0.88–0.94x from 1024; its per-call q/k/v weight permutation is a pass over the
# weights too
FUSED_FROM_ROWS = 1024
# ... but replayed from CUDA graphs, where the GEMM reads a model width of at most
# NARROW_WIDTH (K), the whole forward gains from far fewer rows (the H100, against the
# default's forward: a 4-layer Llama at dim 2048 1.04x at 128 rows, 1.07x at 256, 1.08x
# at 512; a 2-layer Hugging Face Llama at the 1B shape 1.04x at 128 and 512; at dim
# 4096 0.96x at 128 and 0.98x at 512, so wider models keep 1024). Not without CUDA
# graphs: the Hugging Face model's host-bound forward ran 0.89x its speed with RoPE
# unfused (BENCHMARKS.md, thirty-eighth session)
NARROW_WIDTH = 2048
NARROW_FUSED_FROM_ROWS = 128
# ... but with a QK-norm in the same GEMM (the norm's pass over q and k saved too) the
# region (q/k/v + QK-norm + RoPE + SDPA at Qwen3-8B shapes, from CUDA graphs) beats
# torch.compile's from 32 rows: 1.04x at 32, 1.02x at 64 tokens, 1.11x at 256, 1.06x at
# 1024, 1.18x at 2048, 1.12x at 8192; at decode sizes it loses (0.73x at 1 row, 0.87x at
# 16) (benchmarks/model_families.py qknorm; BENCHMARKS.md, seventh session)
QK_NORM_FUSED_FROM_ROWS = 64
FUSED_FROM_ROWS_FOR = {"with a QK-norm": QK_NORM_FUSED_FROM_ROWS,
                       f"from CUDA graphs, a GEMM at most {NARROW_WIDTH} wide (K)":
                       NARROW_FUSED_FROM_ROWS}
# ... and in a training step (training_policy.py; +1.4 ms and +0.7 GiB per 1B step; with
# the angles read from one table, +1.6 ms of kernel time over the gated MLP's step,
# seventeenth session)
PAYS_IN_TRAINING = False


def fused_from_rows_of(match, graphed: bool = False) -> int:
    """size_policy.fused_from_rows for one match: a QK-norm's from fewer rows, and so,
    in a graph replayed from CUDA graphs, is one whose GEMMs all read a narrow model
    width (a static K of at most NARROW_WIDTH)."""
    if getattr(match, "head_norm", None) is not None:
        return QK_NORM_FUSED_FROM_ROWS
    if graphed:
        widths = [size_policy.static_width(g) for g in size_policy.gemms_of(match)]
        if widths and all(w is not None and w <= NARROW_WIDTH for w in widths):
            return NARROW_FUSED_FROM_ROWS
    return FUSED_FROM_ROWS


_CAT = {torch.cat, torch.concat, torch.concatenate}
_COS = {torch.cos, "cos"}
_SIN = {torch.sin, "sin"}
_SPLIT = {"view", "reshape", torch.reshape}
_TRANSPOSE = {"transpose", torch.transpose}


@dataclasses.dataclass(frozen=True)
class Angle:
    """Where the rotation's cos/sin come from. ``source == "angles"``: cos/sin of
    emb = cat(θ, θ) with θ = (inv_freq ⊗ pos)ᵀ, computed in this graph (the epilogue
    recomputes them from positions and frequencies). ``"table"``: the [Bp, S, r] cos/sin
    values themselves (graph inputs after a graph break, a layer compiled alone, angles
    that are no outer product): the epilogue reads them as a table."""
    emb: fx.Node | None
    inv_freq: fx.Node | None  # the h frequencies, batch-independent: [1, h, 1] (the matmul
                              # spelling) or [h] / [1, 1, h] (the broadcast one)
    pos: fx.Node | None       # float positions [Bp, 1, S] (matmul) or [Bp, S, 1] (broadcast)
    scale: float | fx.Node    # the rope type's attention scaling (cos·s, sin·s); a 0-d
                              # tensor node when only known at run time (dynamic=True)
    cos: fx.Node              # the [Bp, S, r] tables the rotation reads
    sin: fx.Node
    why_table: str = ""       # "table": why the angles are not recomputed in the epilogue
    half_width: bool = False  # cos/sin of θ itself, [Bp, S, r/2] (gpt-oss's written-out
                              # rotation), not of cat(θ, θ)

    @property
    def source(self) -> str:
        return "angles" if self.inv_freq is not None else "table"

    @property
    def frequency_count(self):
        """h: the number of frequencies (inv_freq's one dim longer than 1)."""
        return max(meta(self.inv_freq).shape)

    @property
    def positions_shape(self) -> tuple:
        """(Bp, S) of the positions, whichever spelling laid them out."""
        mp = meta(self.pos)
        return mp.shape[0], mp.shape[2] if mp.shape[1] == 1 else mp.shape[1]


@dataclasses.dataclass(frozen=True)
class HeadNorm:
    """An RMSNorm over each head's features between the projection and the rotation
    (QK-norm: Qwen3's ``q_norm(q_proj(x).view(..., H, d)).transpose(1, 2)``, Gemma 3's
    norm after the transpose), or of the rotated heads (HunYuan): the epilogue forms each
    head's statistic from the accumulator and scales by it and the norm's weight before
    rotating (after it)."""
    idiom: RmsNorm
    after: tuple[fx.Node, ...] = ()  # the heads' transpose between the norm and the rotation
    after_rotation: bool = False     # the norm reads the rotated heads instead

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        """The norm's nodes and a transpose after it: what the fused GEMM replaces (and
        what the witness replays, in graph order, from the head split)."""
        return (*self.idiom.nodes, *self.after)


@dataclasses.dataclass(frozen=True)
class Rotated:
    """One rotated projection (q or k): out = rope(split(GEMM columns [lo, hi)))."""
    rotates: ClassVar[bool] = True
    out: fx.Node             # the rotated heads eager writes (q_embed)
    heads: fx.Node           # the head-split projection it rotates (query_states)
    split: tuple[fx.Node, ...]   # view (/transpose) from the projection's columns to heads
    proj: Projection
    columns: tuple[int, int]
    column_node: fx.Node     # the [.., hi - lo] value: the projection, or its slice
    n_heads: int
    head_dim: int
    rotary_dim: int
    angle: Angle | None      # "half": cos/sin of pos ⊗ inv_freq (or tables); "pairs":
                             # the complex table's angles where it is polar(1, θ) in
                             # this graph, else None (the table is read)
    nodes: tuple[fx.Node, ...]   # the rotation's own nodes (erased once dead)
    form: str = "half"       # "half" (rotate_half) | "pairs" (complex, adjacent pairs)
                             # | "interleaved" (real, adjacent pairs: rotate_every_two)
    table: fx.Node | None = None     # "pairs": the complex table [(Bt,) S, hd/2]
    table_view: fx.Node | None = None  # "pairs": the table broadcast against the heads
    member: tuple = ()       # (groups, g, i0, i1, d): the projection's features are
                             # groups [groups, g, d] (GPT-NeoX: [q_h, k_h, v_h] per head;
                             # Falcon: one group of all heads) and this value is members
                             # [i0, i1) of each; columns are then positions in the
                             # members' order, [i0·groups·d, i1·groups·d)
    rotary_offset: int = 0   # each head rotates [offset, offset + rotary_dim): a suffix
                             # in multi-head latent attention (q = cat(q_pass, rope(q_rot)))
    stored_pairs: bool = False   # "half" read from pairs stored adjacent (DeepSeek-V3's
                             # rope_interleave: x[0::2], x[1::2]): no weight permutation
    norm: HeadNorm | None = None  # a QK-norm before the rotation (or after it)

    @property
    def transposed(self) -> bool:
        """Heads before the sequence ([b, h, s, d]) in the split."""
        return any(swaps_heads(n) for n in self.split)


@dataclasses.dataclass(frozen=True)
class Passthrough:
    """A projection (or packed slice) that joins the GEMM unrotated: v."""
    rotates: ClassVar[bool] = False
    proj: Projection
    columns: tuple[int, int]
    column_node: fx.Node
    member: tuple = ()       # as Rotated.member: v of a per-head packed projection, whose
    split: tuple = ()        # head split (getitem, chunk[, transpose], view) is rebuilt


@dataclasses.dataclass(frozen=True)
class Match:
    rotated: list[Rotated]         # q and k, in graph order
    passthrough: list[Passthrough]  # v, when it reads the same input (frequency 0)
    remainders: list = dataclasses.field(default_factory=list)  # packed slices left over:
                                   # their own GEMM (algebra/rope.side_conditions)

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.rotated[0].out)

    @property
    def proj(self) -> Projection:
        return self.rotated[0].proj

    @property
    def angle(self) -> Angle | None:
        return self.rotated[0].angle

    @property
    def form(self) -> str:
        return self.rotated[0].form

    @property
    def table(self) -> fx.Node | None:
        return self.rotated[0].table

    @property
    def angle_source(self) -> str:
        """"angles" (recomputed from positions and frequencies) or "table"."""
        return "table" if self.angle is None else self.angle.source

    @property
    def segments(self) -> list[Rotated | Passthrough]:
        """The fused GEMM's output columns, in order: rotated q, k, then v."""
        return [*self.rotated, *self.passthrough]

    @property
    def has_bias(self) -> bool:
        return any(s.proj.bias is not None for s in self.segments)

    @property
    def head_norm(self) -> tuple[int, float, bool] | None:
        """(head_dim, eps, after the rotation) of the QK-norm the epilogue applies (the
        side conditions hold every normed segment to one eps and one order), None
        without one."""
        normed = [r for r in self.rotated if r.norm is not None]
        return (normed[0].head_dim, normed[0].norm.idiom.eps,
                normed[0].norm.after_rotation) if normed else None

    @property
    def scaled(self) -> bool:
        """Whether the rotation carries an attention scaling other than a constant 1."""
        return self.angle_source == "angles" and not (
            isinstance(self.angle.scale, float) and self.angle.scale == 1.0)


class NoMatch(patterns.NoMatch):
    pattern = NAME


# ---- small graph helpers ----------------------------------------------------------------

def _args(node: fx.Node, *names, defaults=()):
    """Positional-or-keyword arguments of a call, by name."""
    vals = list(node.args) + [None] * len(names)
    out = []
    for i, n in enumerate(names):
        v = node.kwargs.get(n, vals[i] if i < len(node.args) else None)
        if v is None and i < len(defaults):
            v = defaults[i]
        out.append(v)
    return out


def _last_dim_index(node) -> tuple[fx.Node, slice] | None:
    """(x, the slice) for ``x[..., a:b:c]`` or ``x[:, :, :, a:b:c]`` (every leading dim
    whole): an index of the last dim only, else None."""
    if not (calls(node, {operator.getitem}) and isinstance(node.args[0], fx.Node)):
        return None
    idx, mx = node.args[1], meta(node.args[0])
    if not (isinstance(idx, tuple) and idx and isinstance(idx[-1], slice)) or mx is None:
        return None
    lead = idx[:-1]
    if lead == (Ellipsis,) or (len(idx) == mx.dim() and all(e == slice(None) for e in lead)):
        return node.args[0], idx[-1]
    return None


def _last_dim_slice(node) -> tuple[fx.Node, int | None, int | None] | None:
    """(x, start, stop) for ``x[..., start:stop]`` (step 1), else None."""
    found = _last_dim_index(node)
    if found is None or found[1].step not in (None, 1):
        return None
    return found[0], found[1].start, found[1].stop


def _norm_slice(start, stop, n) -> tuple[int, int] | None:
    if not all(isinstance(v, (int, type(None))) for v in (start, stop)):
        return None
    a = 0 if start is None else (start + n if start < 0 else start)
    b = n if stop is None else (stop + n if stop < 0 else min(stop, n))
    return (a, b) if 0 <= a <= b <= n else None


def _cat_last(node) -> list | None:
    """The inputs of a concatenation along the last dim."""
    if not calls(node, _CAT):
        return None
    tensors, dim = _args(node, "tensors", "dim", defaults=(None, 0))
    m = meta(node)
    if m is None or not isinstance(tensors, (list, tuple)) or dim not in (-1, m.dim() - 1):
        return None
    return list(tensors)


def _is_cast(node) -> bool:
    c = canon(node) if isinstance(node, fx.Node) else None
    return c is not None and c.name == "cast"


# ---- the angle: cos/sin of cat(θ, θ), θ an outer product of positions and frequencies ----

def _scalar_scale(node) -> tuple[fx.Node, float | fx.Node] | None:
    """(x, s) for x·s with s a constant or a run-time scalar."""
    c = canon(node) if isinstance(node, fx.Node) else None
    if c is None or c.name != "mul":
        return None
    a, b = c.args
    for t, s in ((a, b), (b, a)):
        if not (isinstance(t, fx.Node) and meta(t) is not None and meta(t).dim() > 0):
            continue
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            return t, float(s)
        if runtime_scalar(s) is not None:
            return t, runtime_scalar(s)
    return None


def _table(node) -> tuple[fx.Node, fx.Node, float] | str:
    """(emb, the cos/sin node, scale) of a cos or sin table [Bp, S, r] (casts and one
    scalar scale allowed on the way), or why not."""
    scale = 1.0
    node, _ = through_casts(node)
    found = _scalar_scale(node)
    if found is not None:
        node, scale = found
    node, _ = through_casts(node)
    if isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr"):
        return (f"cos/sin {describe(node)} come from outside this graph (a graph break, or "
                "a precomputed table): the epilogue needs their positions and frequencies")
    if not (calls(node, _COS) or calls(node, _SIN)):
        return f"{describe(node)} is not cos/sin of an angle table"
    return node.args[0], node, scale


def _outer(theta) -> tuple[fx.Node, fx.Node] | None:
    """(inv_freq, pos) for θ [Bp, S, h] = pos ⊗ inv_freq computed in this graph, in either
    of transformers' spellings: ``(inv_freq [1, h, 1] @ pos [Bp, 1, S]).transpose(1, 2)``
    (up to 5.2x) or ``pos[..., None] * inv_freq`` (a broadcast product: 5.25)."""
    found = _matmul_outer(theta)
    return found if found is not None else _broadcast_outer(theta)


def _broadcast_outer(theta) -> tuple[fx.Node, fx.Node] | None:
    """(inv_freq [h] or [1, 1, h], pos [Bp, S, 1]) for θ = pos · inv_freq broadcast to
    [Bp, S, h], both floating (either factor first). Frequencies with a batch or position
    dim other than 1 vary along it: no outer product."""
    c = canon(theta) if isinstance(theta, fx.Node) else None
    mt = meta(theta)
    if c is None or c.name != "mul" or len(c.args) != 2 or mt is None or mt.dim() != 3 \
            or not all(isinstance(a, fx.Node) for a in c.args):
        return None
    for p, f in (c.args, c.args[::-1]):
        mp, mf = meta(p), meta(f)
        if mp is None or mf is None or not (mp.is_floating_point() and
                                            mf.is_floating_point()):
            continue
        if mp.dim() == 3 and mp.shape[2] == 1 and tuple(mp.shape[:2]) == tuple(mt.shape[:2]) \
                and 1 <= mf.dim() <= 3 and mf.shape[-1] == mt.shape[-1] \
                and all(d == 1 for d in mf.shape[:-1]):
            return f, p
    return None


def _matmul_outer(theta) -> tuple[fx.Node, fx.Node] | None:
    """(inv_freq [1, h, 1], pos [Bp, 1, S]) for θ = (inv_freq @ pos).transpose(1, 2)."""
    if not calls(theta, _TRANSPOSE):
        return None
    x, d0, d1 = _args(theta, "input", "dim0", "dim1")
    if sorted((d0 % 3, d1 % 3)) != [1, 2] or not calls(x, MATMUL):
        return None
    a, p = x.args[:2]
    ma, mp = meta(a), meta(p)
    if ma is None or mp is None or ma.dim() != 3 or mp.dim() != 3 \
            or ma.shape[2] != 1 or mp.shape[1] != 1:
        return None
    # frequencies must not vary with the batch: a [1, h, 1] value, possibly expanded
    while meta(a).shape[0] != 1 and (_is_cast(a) or (calls(a, {"expand"}))):
        a = a.args[0]
    if meta(a) is None or meta(a).dim() != 3 or meta(a).shape[0] != 1:
        return None
    if not (ma.is_floating_point() and mp.is_floating_point()):
        return None
    return a, p


@dataclasses.dataclass(frozen=True)
class NoAngle:
    """Why cos/sin are not computed from an angle in this graph; ``as_table``: they may
    still be read as a table (a precomputed one), rather than being no rotation at all."""
    why: str
    as_table: bool


def _first_half(node) -> fx.Node | None:
    """x for ``x[..., :r/2]`` (x's last dim r)."""
    sl = _last_dim_slice(node)
    if sl is None or meta(sl[0]) is None:
        return None
    n = int(meta(sl[0]).shape[-1])
    return sl[0] if n % 2 == 0 and _norm_slice(sl[1], sl[2], n) == (0, n // 2) else None


def angle_of(cos_t, sin_t, half_width: bool = False) -> Angle | NoAngle:
    if half_width and _first_half(cos_t) is not None and _first_half(sin_t) is not None:
        # DeepSeek-V3: cos(cat(θ, θ))[..., :r/2] is cos(θ), one angle per pair
        whole = angle_of(_first_half(cos_t), _first_half(sin_t))
        if isinstance(whole, Angle):
            return dataclasses.replace(whole, cos=cos_t, sin=sin_t, half_width=True)
    c, s = _table(cos_t), _table(sin_t)
    for t in (c, s):
        if isinstance(t, str):
            return NoAngle(t, True)
    (emb_c, cnode, sc_c), (emb_s, snode, sc_s) = c, s
    if not (calls(cnode, _COS) and calls(snode, _SIN)):
        return NoAngle(Why("the cos and sin tables are swapped or not cos/sin",
                           "rope.cos_sin_swapped"), False)
    if emb_c is not emb_s:
        return NoAngle(Why("cos and sin are taken of different angle tables",
                           "rope.different_angles"), False)
    if not same_value(sc_c, sc_s):
        return NoAngle(Why("cos and sin carry different scales",
                           "rope.different_scales"), False)
    theta = emb_c
    if not half_width:
        halves = _cat_last(emb_c)
        if halves is None or len(halves) != 2 or halves[0] is not halves[1]:
            return NoAngle(f"the angle table {describe(emb_c)} is not cat(θ, θ) (the pairing "
                           "of feature i with i + rotary_dim/2 needs both halves to share "
                           "one angle)", True)
        theta = halves[0]
    outer = _outer(theta)
    if outer is None:
        return NoAngle(f"the angles {describe(theta)} are not an outer product of "
                       "positions and frequencies in this graph (a precomputed table)", True)
    return Angle(emb_c, outer[0], outer[1], sc_c, cos_t, sin_t, half_width=half_width)


def table_angle(cos_t, sin_t, why: str, half_width: bool = False) -> Angle | str:
    """cos/sin read as a table: any [Bp, S, r] floating values not needing a gradient
    (their halves must be equal, cat(θ, θ): checked on the device at run time), or
    [Bp, S, r/2] ones of θ itself (``half_width``: nothing to check)."""
    mc, ms = meta(cos_t), meta(sin_t)
    if mc is None or ms is None or layouts.table_rows_shape(mc.shape) is None or \
            tuple(mc.shape) != tuple(ms.shape) or not mc.is_floating_point():
        return Why(f"{why}; and they are not [batch, seq, rotary_dim] tables",
                   "rope.table_shape")
    if mc.requires_grad or ms.requires_grad:
        return Why(f"{why}; and they require grad", "rope.angle_requires_grad")
    return Angle(None, None, None, 1.0, cos_t, sin_t, why_table=why, half_width=half_width)


# ---- the rotation: q·cos + rotate_half(q)·sin ----------------------------------------------

def _half_of(node) -> tuple[fx.Node, int, tuple[fx.Node, ...]] | None:
    """(x, 0 or 1, nodes) for the low or high half of x's last dim: ``x[..., :h]`` /
    ``x[..., h:]``, ``x.chunk(2, dim=-1)[0]`` / ``[1]``, or ``x.view(*lead, 2, h).unbind(
    -2)[0]`` / ``[1]`` (OLMo's rotate_half)."""
    unbound = _unbound_half(node)
    if unbound is not None:
        return unbound
    sl = _last_dim_slice(node)
    if sl is not None:
        x = sl[0]
        if meta(x) is None or int(meta(x).shape[-1]) % 2:
            return None
        n = int(meta(x).shape[-1])
        which = {(0, n // 2): 0, (n // 2, n): 1}.get(_norm_slice(sl[1], sl[2], n))
        return (x, which, (node,)) if which is not None else None
    half = chunk_half(node)
    if half is not None and int(meta(half[0].args[0]).shape[-1]) % 2 == 0:
        return half[0].args[0], half[1], (node, half[0])
    return None


def _unbound_half(node) -> tuple[fx.Node, int, tuple[fx.Node, ...]] | None:
    """(x, i, nodes) for ``x.view(*x.shape[:-1], 2, h).unbind(-2)[i]`` (or ``reshape``,
    ``unflatten(-1, (2, h))``): half i of x's last dim."""
    return _unbound_split(node, pairs=False)


def _unbound_pair_element(node) -> tuple[fx.Node, int, tuple[fx.Node, ...]] | None:
    """(x, i, nodes) for ``x.view(*x.shape[:-1], h, 2).unbind(-1)[i]`` (or ``reshape``,
    ``unflatten``; what einops' ``rearrange(x, '... (d r) -> ... d r', r=2)`` and
    ``unbind(-1)`` trace to: x-transformers' rotate_half): element i of each adjacent
    pair, the even or odd features."""
    return _unbound_split(node, pairs=True)


def _unbound_split(node, pairs: bool) -> tuple[fx.Node, int, tuple[fx.Node, ...]] | None:
    """x's last dim split into [2, h] (halves) or [h, 2] (``pairs``), then unbound along
    the axis of 2: (x, i, nodes) for piece i."""
    if not calls(node, {operator.getitem}) or node.args[1] not in (0, 1):
        return None
    unb = node.args[0]
    if not calls(unb, {"unbind", torch.unbind}):
        return None
    split, dim = _args(unb, "input", "dim", defaults=(None, 0))
    if not calls(split, _SPLIT | {"unflatten", torch.unflatten}) or \
            not isinstance(split.args[0], fx.Node):
        return None
    mx, ms = meta(split.args[0]), meta(split)
    if mx is None or ms is None or not isinstance(dim, int):
        return None
    h = mx.shape[-1] // 2
    shape, axis = ((h, 2), ms.dim() - 1) if pairs else ((2, h), ms.dim() - 2)
    if dim % ms.dim() != axis or tuple(ms.shape) != (*mx.shape[:-1], *shape):
        return None
    return split.args[0], node.args[1], (node, unb, split)


def _rotate_half_of(node) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """(x, its nodes) for ``cat(-x_hi, x_lo, dim=-1)``: the halves of x's last dim
    swapped, the high one negated (Hugging Face's rotate_half)."""
    found = _negated_swap(_cat_last(node), _half_of)
    return None if found is None else (found[0], (node, *found[1]))


def _negated_swap(parts, select) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """(x, nodes) for ``parts == [−part₁(x), part₀(x)]``, ``select(node)`` giving (x,
    which part, its nodes): rotate_half's halves, rotate_every_two's even/odd features."""
    if parts is None or len(parts) != 2:
        return None
    neg, other = parts
    c = canon(neg) if isinstance(neg, fx.Node) else None
    if c is None or c.name != "neg" or not isinstance(other, fx.Node):
        return None
    one, zero = select(c.args[0]), select(other)
    if one is None or zero is None or one[0] is not zero[0] or (one[1], zero[1]) != (1, 0):
        return None
    return one[0], (neg, *one[2], *zero[2])


def _parity_of(node) -> tuple[fx.Node, int, tuple[fx.Node, ...]] | None:
    """(x, 0 or 1, nodes) for the even or odd features of x's last dim: ``x[..., 0::2]``
    / ``x[..., 1::2]``, or each adjacent pair's element split out (``x.reshape(..., -1,
    2)[..., i]``, ``x.view(..., h, 2).unbind(-1)[i]``)."""
    found = _pair_element(node) or _unbound_pair_element(node)
    if found is not None:
        return found
    found = _last_dim_index(node)
    if found is None:
        return None
    x, sl = found
    mx = meta(x)
    if sl.step != 2 or sl.stop is not None or mx is None or int(mx.shape[-1]) % 2:
        return None
    return (x, sl.start or 0, (node,)) if sl.start in (None, 0, 1) else None


def _rotate_pairs_of(node) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """(x, its nodes) for ``stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)``:
    each adjacent pair (x[2p], x[2p+1]) becomes (−x[2p+1], x[2p]) (GLM's, Cohere's and
    GPT-J's rotate_half / rotate_every_two; x-transformers' by einops: the pairs unbound
    from ``x.view(..., h, 2)``, the stack merged back by a reshape)."""
    found = _pair_stack(node)
    if found is None:
        return None
    st, parts = found
    found = _negated_swap(parts, _parity_of)
    return None if found is None else (found[0], (node, st, *found[1]))


def _unsqueezed(node) -> tuple[fx.Node, int] | None:
    """(x, dim) for ``x.unsqueeze(dim)`` or ``x[:, None]``-style indexing."""
    if calls(node, {operator.getitem}):
        x, idx = node.args
        idx = idx if isinstance(idx, tuple) else (idx,)
        nones = [i for i, e in enumerate(idx) if e is None]
        if len(nones) == 1 and isinstance(x, fx.Node) and \
                all(e is None or e == slice(None) for e in idx):
            return x, nones[0]
        return None
    if not calls(node, {"unsqueeze", torch.unsqueeze}):
        return None
    x, dim = _args(node, "input", "dim")
    return (x, dim) if isinstance(x, fx.Node) and isinstance(dim, int) else None


def _rope_core(add: fx.Node):
    """(x, cos table, sin table, head axis, the rotation's own nodes, form, half-width
    tables: False, pairs stored adjacent: False) for
    x·C + rotate_half(x)·S ("half": C and S the [Bp, S, r] tables unsqueezed at the head
    axis) or x·C + rotate_pairs(x)·S ("interleaved": C and S the 4-d values the rotation
    multiplies by, whatever computed them: they are read as a table)."""
    c = canon(add)
    if c is None or c.name != "add" or not all(isinstance(a, fx.Node) for a in c.args):
        return None
    (p1, units1), (p2, units2) = (_under_unit_scale(a) for a in c.args)
    for (m1, u1), (m2, u2) in (((p1, units1), (p2, units2)), ((p2, units2), (p1, units1))):
        c1, c2 = canon(m1), canon(m2)
        if c1 is None or c2 is None or c1.name != "mul" or c2.name != "mul":
            continue
        for rot, s_t in (c2.args, c2.args[::-1]):
            # Ernie 4.5: q.float()·cos + rotate_half(q).float()·sin (casts on both products)
            rot, rot_casts = _casts_under(rot)
            form, found = "half", _rotate_half_of(rot)
            if found is None:
                form, found = "interleaved", _rotate_pairs_of(rot)
            if found is None:
                continue
            x, rot_nodes = found
            x, x_casts = _casts_under(x)  # Cohere: q = q.float() before both products
            for x1, c_t in (c1.args, c1.args[::-1]):
                x1, x1_casts = _casts_under(x1)
                if x1 is not x:
                    continue
                nodes = tuple(dict.fromkeys(  # a cast both products read: once
                    (m1, m2, *u1, *u2, *rot_nodes, *rot_casts, *x_casts, *x1_casts, add)))
                if form == "interleaved":
                    axis = _table_head_axis(x, c_t, s_t)
                    if axis is None:
                        return Why("cos/sin are not [batch, seq, rotary_dim] tables broadcast "
                                   "over the heads", "rope.table_broadcast")
                    return x, c_t, s_t, axis, nodes, form, False, False
                cu, su = _unsqueezed(c_t), _unsqueezed(s_t)
                if cu is not None and su is not None and cu[1] == su[1]:
                    return x, cu[0], su[0], cu[1], nodes, form, False, False
                # litgpt: [seq, rotary_dim] tables broadcast over batch and heads as they are
                axis = _table_head_axis(x, c_t, s_t)
                if axis is None:
                    return Why("cos/sin are not [batch, seq, rotary_dim] tables broadcast over "
                               "the heads", "rope.table_broadcast")
                return x, c_t, s_t, axis, nodes, form, False, False
    return None


def _under_unit_scale(node: fx.Node) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """(v, the products) for ``v * 1`` (either order, repeated) that keeps v's dtype and
    shape: an exact identity (x-transformers multiplies both of the rotation's products
    by a ``scale`` that is 1 without xpos); (node, ()) for anything else."""
    units = []
    while True:
        c = canon(node) if isinstance(node, fx.Node) else None
        if c is None or c.name != "mul":
            break
        a, b = c.args
        v = a if constant(b) == 1.0 else b if constant(a) == 1.0 else None
        mv, mn = meta(v), meta(node)
        if mv is None or mn is None or mv.dtype != mn.dtype or mv.shape != mn.shape:
            break
        units.append(node)
        node = v
    return node, tuple(units)


def _mul_args(node) -> tuple | None:
    c = canon(node) if isinstance(node, fx.Node) else None
    return tuple(c.args) if c is not None and c.name == "mul" else None


def _written_rope_core(cat: fx.Node):
    """(x, cos, sin, unsqueeze dim, nodes, "half", half-width tables, pairs stored
    adjacent) for gpt-oss's written-out rotation: x1, x2 = chunk(x, 2, -1);
    cat((x1·C − x2·S, x2·C + x1·S), -1) with C, S = cos(θ), sin(θ) [Bp, S, r/2]
    unsqueezed at the head axis: the half-split rotation (rotate_half) by another
    spelling. With x1, x2 = x[..., 0::2], x[..., 1::2] (DeepSeek-V3's rope_interleave,
    C = cos(cat(θ, θ))[..., :r/2]) the pairs are read from adjacent features and written
    as halves: the same rotation of a projection whose rows are stored in pair order."""
    parts = _cat_last(cat)
    if parts is None or len(parts) != 2 or not all(isinstance(p, fx.Node) for p in parts):
        return None
    lo, hi = canon(parts[0]), canon(parts[1])
    if lo is None or hi is None or lo.name != "sub" or hi.name != "add":
        return None
    a, b = (_mul_args(n) for n in lo.args)     # x1·C, x2·S
    if a is None or b is None:
        return None
    for x1, c_t in (a, a[::-1]):
        h1 = _half_of(x1) or _parity_of(x1)
        if h1 is None or h1[1] != 0:
            continue
        for x2, s_t in (b, b[::-1]):
            h2 = _half_of(x2) or _parity_of(x2)
            if h2 is None or h2[1] != 1 or h2[0] is not h1[0] or \
                    (_parity_of(x1) is None) != (_parity_of(x2) is None):
                continue  # both halves, or both parities: a mix is no rotation
            want = ({x2, c_t}, {x1, s_t})        # hi = x2·C + x1·S, in any order
            got = [_mul_args(n) for n in hi.args]
            if None in got or sorted(map(len, map(set, got))) != [2, 2] or not (
                    all(any(set(g) == w for g in got) for w in want)):
                continue
            # DeepSeek-V3's rope_interleave reads each pair from adjacent features and
            # writes it as halves: the half-split rotation of rows stored in pair order
            stored_pairs = _parity_of(x1) is not None
            cu, su = _unsqueezed(c_t), _unsqueezed(s_t)
            if cu is None or su is None or cu[1] != su[1]:
                return Why("cos/sin are not [batch, seq, rotary_dim / 2] tables broadcast "
                           "over the heads", "rope.table_broadcast")
            nodes = (cat, *parts, *lo.args, *hi.args, *h1[2], *h2[2])
            return h1[0], cu[0], su[0], cu[1], nodes, "half", True, stored_pairs
    return None


def _pair_element(node) -> tuple[fx.Node, int, tuple[fx.Node, ...]] | None:
    """(x, 0 or 1, nodes) for element i of x's adjacent pairs split out: ``x.reshape(
    *x.shape[:-1], -1, 2)[..., i]`` (or ``view``, ``unflatten(-1, (-1, 2))``): the even
    or odd features, as ``x[..., i::2]``."""
    if not calls(node, {operator.getitem}) or node.args[1] not in ((Ellipsis, 0),
                                                                   (Ellipsis, 1)):
        return None
    split = node.args[0]
    if not calls(split, _SPLIT | {"unflatten", torch.unflatten}) or \
            not isinstance(split.args[0], fx.Node):
        return None
    mx, ms = meta(split.args[0]), meta(split)
    if mx is None or ms is None or tuple(ms.shape) != (*mx.shape[:-1], mx.shape[-1] // 2, 2):
        return None
    return split.args[0], node.args[1][1], (node, split)


def _pair_written_rope_core(flat: fx.Node):
    """(x, cos, sin, head axis, nodes, "interleaved", half-width tables, False) for
    torchtune's written-out rotation of adjacent pairs: x0, x1 = the pairs' elements
    (_pair_element); ``stack((x0·C − x1·S, x1·C + x0·S), -1).flatten(-2)`` with C, S
    the [.., r/2] tables of θ itself broadcast over the heads (``cache[..., 0]``,
    ``cache[..., 1]`` of a [seq, r/2, 2] cache viewed to x's dims): rotate_every_two by
    another spelling, pairs read and written adjacent."""
    found = _pair_stack(flat)
    if found is None:
        return None
    st, parts = found
    lo, hi = (canon(n) for n in parts)
    if lo is None or hi is None or lo.name != "sub" or hi.name != "add":
        return None
    a, b = (_mul_args(n) for n in lo.args)     # x0·C, x1·S
    got = [_mul_args(n) for n in hi.args]
    if a is None or b is None or None in got:
        return None
    for x0, c_t in (a, a[::-1]):
        e0 = _pair_element(x0)
        if e0 is None or e0[1] != 0:
            continue
        for x1, s_t in (b, b[::-1]):
            e1 = _pair_element(x1)
            if e1 is None or e1[1] != 1 or e1[0] is not e0[0] or \
                    not _products_are(got, ((x1, c_t), (x0, s_t))):  # hi = x1·C + x0·S
                continue
            x = e0[0]
            axis = _table_head_axis(x, c_t, s_t, half_width=True)
            if axis is None:
                return Why("cos/sin are not [batch, seq, rotary_dim / 2] tables broadcast "
                           "over the heads", "rope.table_broadcast")
            # hi's own reads of x's elements (dynamo makes each x[..., i] a node of its
            # own) are the rotation's; its reads of C and S are the tables' (the replay
            # knows them as equal values)
            elements = [e[2][0] for g in got for e in map(_pair_element, g) if e is not None]
            nodes = tuple(dict.fromkeys((flat, st, *parts, *lo.args, *hi.args, *e0[2],
                                         *e1[2], *elements)))
            return x, c_t, s_t, axis, nodes, "interleaved", True, False
    return None


def _products_are(products: list, want: tuple) -> bool:
    """Whether two products' factor pairs are ``want``'s two pairs of values, in any
    order (graph_utils.same_value: equal pure calls count as one value)."""
    def same(g, w):
        return same_value(g[0], w[0]) and same_value(g[1], w[1]) or \
            same_value(g[0], w[1]) and same_value(g[1], w[0])
    return same(products[0], want[0]) and same(products[1], want[1]) or \
        same(products[0], want[1]) and same(products[1], want[0])


def _pair_stack(flat: fx.Node) -> tuple[fx.Node, list] | None:
    """(the stack, its two parts) for ``stack((lo, hi), -1).flatten(-2)``, or the stack
    merged back by a view or reshape to ``[..., 2h]`` (einops' ``'... d r -> ... (d
    r)'``)."""
    if calls(flat, {"flatten", torch.flatten}):
        st, start, end = _args(flat, "input", "start_dim", "end_dim", defaults=(None, 0, -1))
    elif calls(flat, _SPLIT) and isinstance(flat.args[0], fx.Node):
        st, start, end = flat.args[0], -2, -1
        mst, mf = meta(st), meta(flat)
        if mst is None or mf is None or mst.dim() < 2 or \
                tuple(mf.shape) != (*mst.shape[:-2], mst.shape[-2] * mst.shape[-1]):
            return None
    else:
        return None
    mst = meta(st) if isinstance(st, fx.Node) else None
    if mst is None or not calls(st, {torch.stack}) or not isinstance(start, int) or \
            not isinstance(end, int) or start % mst.dim() != mst.dim() - 2 or \
            end % mst.dim() != mst.dim() - 1:
        return None
    tensors, dim = _args(st, "tensors", "dim", defaults=(None, 0))
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or \
            not all(isinstance(t, fx.Node) for t in tensors) or \
            dim % mst.dim() != mst.dim() - 1:
        return None
    return st, list(tensors)


def _casts_under(node) -> tuple:
    """(the value under casts, the cast nodes) — the rotation's own upcasts."""
    casts = []
    while isinstance(node, fx.Node) and _is_cast(node):
        casts.append(node)
        node = node.args[0]
    return node, tuple(casts)


def _table_head_axis(x: fx.Node, cos: fx.Node, sin: fx.Node,
                     half_width: bool = False) -> int | None:
    """The head axis (1 or 2) of 4-d rotated heads x that tables cos/sin broadcast over
    (their shape aligned to x's from the right, as broadcasting does: a [seq, r] table
    is [1, 1, seq, r]): unit there, the sequence on the other, x's rotated width last
    (half of it: ``half_width``, one entry per pair), a batch of 1 or x's; None where
    they are not such tables."""
    mx, mc, ms = meta(x), meta(cos), meta(sin)
    if mx is None or mc is None or ms is None or mx.dim() != 4 or not 2 <= mc.dim() <= 4 or \
            tuple(mc.shape) != tuple(ms.shape) or not mc.is_floating_point():
        return None
    shape = (1,) * (4 - mc.dim()) + tuple(mc.shape)
    width = mx.shape[3] // 2 if half_width else mx.shape[3]
    for axis, seq in ((1, 2), (2, 1)):
        if shape[axis] == 1 and shape[seq] == mx.shape[seq] and \
                shape[3] == width and shape[0] in (1, mx.shape[0]):
            return axis
    return None


def _past_head_transpose(node: fx.Node, unsq_dim: int):
    """(the value under the heads' ``transpose(1, 2)``, [that transpose]) where the cos/sin
    unsqueeze dim puts the heads before the sequence (1); (node, []) where it puts them
    after it (2); None for a transpose of other dims or a mismatch. ``permute(0, 2, 1, 3)``
    (einops' rearrange) is that transpose too (graph_utils.swaps_heads)."""
    if calls(node, _TRANSPOSE | {"permute", torch.permute}):
        if not swaps_heads(node) or unsq_dim % 4 != 1:
            return None
        return node.args[0], [node]
    return (node, []) if unsq_dim % 4 == 2 else None


def _head_split(heads: fx.Node, unsq_dim: int):
    """(column value [B, S, H·d], split nodes, H, d) for heads = view(P, (B, S, H, d))
    [.transpose(1, 2)], where the cos/sin unsqueeze dim is the head axis."""
    mh = meta(heads)
    if mh is None or mh.dim() != 4:
        return None
    found = _past_head_transpose(heads, unsq_dim)
    if found is None:
        return None
    return _view_split(*found)


def _view_split(node: fx.Node, split: list):
    """(column value [B, S, H·d], split nodes, H, d) for node = view(P, (B, S, H, d)),
    ``split`` the nodes after it (a transpose)."""
    if not calls(node, _SPLIT) and not calls(node, {"unflatten"}):
        return None
    split.append(node)
    src = node.args[0]
    ms, mv = meta(src), meta(node)
    if ms is None or mv is None or ms.dim() != 3 or tuple(ms.shape[:2]) != tuple(mv.shape[:2]) \
            or ms.shape[2] != mv.shape[2] * mv.shape[3]:
        return None
    return src, tuple(split), int(mv.shape[2]), int(mv.shape[3])


def _normed_head_split(heads: fx.Node, unsq_dim: int, norms: dict):
    """(column value, split nodes, H, d, HeadNorm) for heads that are an RMSNorm over the
    head dim of a projection's head split: ``norm(P.view(B, S, H, d)).transpose(1, 2)``
    (Qwen3), ``norm(P.view(B, S, H, d).transpose(1, 2))`` (Gemma 3), or untransposed;
    None for anything else. ``norms``: the graph's RMSNorms by their output."""
    after = None
    if heads not in norms and swaps_heads(heads) and heads.args[0] in norms:
        after, heads = heads, heads.args[0]
    norm = norms.get(heads)
    if norm is None:
        return None
    inner, split = norm.input, []
    if after is not None:
        if _past_head_transpose(after, unsq_dim) is None or swaps_heads(inner):
            return None
        split = [after]
    else:
        found = _past_head_transpose(inner, unsq_dim)
        if found is None:
            return None
        inner, split = found
    got = _view_split(inner, split)
    if got is None or norm.dim != got[3]:
        return None
    return (*got, HeadNorm(norm, (after,) if after is not None else ()))


def _member_split(heads: fx.Node, unsq_dim: int):
    """(projection value [B, S, N], split nodes from ``heads`` inward, H, d, member) for a
    per-head packed projection: ``P.view(B, S, H, g·d)[.transpose(1, 2)].chunk(g, -1)[i]``
    (GPT-NeoX, g = 3: each head's q, k and v features side by side)."""
    if not (calls(heads, {operator.getitem}) and isinstance(heads.args[1], int)):
        return None
    ch = heads.args[0]
    if not calls(ch, CHUNK):
        return None
    src, g, dim = _args(ch, "input", "chunks", "dim", defaults=(None, None, 0))
    if not isinstance(g, int) or g < 2 or meta(src) is None or \
            dim not in (-1, meta(src).dim() - 1) or not 0 <= heads.args[1] < g:
        return None
    found = _past_head_transpose(src, unsq_dim)
    if found is None:
        return None
    node, split = found[0], [heads, ch, *found[1]]
    if not calls(node, _SPLIT):
        return None
    split.append(node)
    proj_value, mv = node.args[0], meta(node)
    mp = meta(proj_value) if isinstance(proj_value, fx.Node) else None
    if mp is None or mv is None or mp.dim() != 3 or mv.dim() != 4 or mv.shape[3] % g or \
            tuple(mp.shape[:2]) != tuple(mv.shape[:2]) or mp.shape[2] != mv.shape[2] * mv.shape[3]:
        return None
    n_heads, d = int(mv.shape[2]), int(mv.shape[3]) // g
    i = heads.args[1]
    return proj_value, tuple(split), n_heads, d, (n_heads, g, i, i + 1, d)


def _head_index(idx, dims: int, axis: int, n: int):
    """(i0, i1, keeps_dim) of ``x[idx]`` on a ``dims``-d x selecting along ``axis`` (of
    size n) only: a slice (step 1), a one-element list, or an int (the dim goes away);
    None for any other index."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if idx and idx[0] is Ellipsis:
        idx = (slice(None),) * (dims - len(idx) + 1) + idx[1:]
    idx = idx + (slice(None),) * (dims - len(idx))
    if len(idx) != dims or any(e != slice(None) for k, e in enumerate(idx) if k != axis):
        return None
    e = idx[axis]
    if isinstance(e, list) and len(e) == 1:
        e, keeps = e[0], True
    else:
        keeps = not isinstance(e, int)
    if isinstance(e, int) and not isinstance(e, bool) and -n <= e < n:
        return e % n, e % n + 1, keeps
    if isinstance(e, slice) and e.step in (None, 1):
        found = _norm_slice(e.start, e.stop, n)
        return (*found, True) if found is not None else None
    return None


def _indexed_split(heads: fx.Node, unsq_dim: int):
    """As _member_split, for heads indexed out of a view of the projection (Falcon):
    ``P.view(B, S, Ht, d)[..., a:b, :]`` (or ``[..., [j], :]``: a range of all heads) or
    ``P.view(B, S, H, g, d)[..., i, :]`` (member i of each head's group), then
    ``.transpose(1, 2)`` and a reshape to the same shape."""
    split, node = [heads], heads
    mh = meta(heads)
    if mh is None or mh.dim() != 4:
        return None
    if calls(node, _SPLIT) and meta(node.args[0]) is not None and \
            tuple(meta(node.args[0]).shape) == tuple(mh.shape):
        node = node.args[0]  # the reshape after the transpose: same shape, a no-op here
        split.append(node)
    found = _past_head_transpose(node, unsq_dim)
    if found is None:
        return None
    node = found[0]
    if found[1]:
        split.append(node)
    flat = _flattened_members(node)
    if flat is not None:  # Falcon's grouped layout: members kept as a dim, then flattened
        split += [n for n in flat if n not in split]  # heads may be the flatten itself
        node = flat[-1]
    selected = _selection(node)
    if selected is None:
        return None
    view, index, fan = selected
    chain = _views_of_projection(view)
    if chain is None:
        return None
    p, mv = chain[-1].args[0], meta(view)
    mp = meta(p)
    if flat is not None:  # [B, S, G, g, d][..., a:b, :] (or [..., [j], :]), kept
        found = _head_index(index, 5, 3, int(mv.shape[3])) if mv.dim() == 5 else None
        if found is None or not found[2]:
            return None
        member = (int(mv.shape[2]), int(mv.shape[3]), found[0], found[1], int(mv.shape[4]))
        broadcast = next((n for n in flat if calls(n, _BROADCAST)), None)
        if broadcast is not None and (found[1] - found[0] != 1 or tuple(meta(broadcast).shape)
                                      [:3] + tuple(meta(broadcast).shape)[4:] !=
                                      tuple(meta(node).shape)[:3] + tuple(meta(node).shape)[4:]):
            return None  # only a single member is broadcast, along the member dim alone
    elif mv.dim() == 4:   # [B, S, Ht, d]: a range of heads, one group
        found = _head_index(index, 4, 2, int(mv.shape[2]))
        if found is None or not found[2]:
            return None
        member = (1, int(mv.shape[2]), found[0], found[1], int(mv.shape[3]))
    elif mv.dim() == 5:  # [B, S, H, g, d]: member i of each head's group
        found = _head_index(index, 5, 3, int(mv.shape[3]))
        if found is None or found[2]:
            return None
        member = (int(mv.shape[2]), int(mv.shape[3]), found[0], found[1], int(mv.shape[4]))
    else:
        return None
    if member[2] >= member[3] or tuple(mv.shape[:2]) != tuple(mp.shape[:2]):
        return None
    groups, _, i0, i1, d = member
    split += [n for n in (fan, *chain) if n is not None]
    return p, tuple(split), groups * (i1 - i0), d, member


def _selection(node: fx.Node):
    """(the value indexed, the index, the fan-out node or None) for heads selected out of
    a view of the projection: ``view[idx]``; ``view.split([a, b, ..], dim=-2)[j]``
    (transformers 5.25's Falcon multi-query: a range of heads, as ``view[..., a':b', :]``);
    ``view.unbind(-2)[i]`` (its per-head layout after ``unflatten(-2, (H, 3))``: member i
    of each head, as ``view[..., i, :]``). None for anything else."""
    if not calls(node, {operator.getitem}):
        return None
    src = node.args[0]
    if calls(src, _SPLIT):
        return src, node.args[1], None
    if not isinstance(node.args[1], int) or not isinstance(src, fx.Node) or \
            not isinstance(src.args[0], fx.Node) or meta(src.args[0]) is None:
        return None
    j, view = node.args[1], src.args[0]
    dims = meta(view).dim()
    if calls(src, SPLIT):
        _, sizes, dim = _args(src, "input", "split_size", "dim", defaults=(None, None, 0))
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(v, int) for v in sizes) \
                or dims != 4 or dim not in (-2, 2) or not 0 <= j < len(sizes):
            return None
        a = sum(sizes[:j])
        return view, (Ellipsis, slice(a, a + sizes[j]), slice(None)), src
    if calls(src, {"unbind", torch.unbind}):
        _, dim = _args(src, "input", "dim", defaults=(None, 0))
        if dims != 5 or dim not in (-2, 3):
            return None
        return view, (Ellipsis, j, slice(None)), src
    return None


def _views_of_projection(view: fx.Node) -> list[fx.Node] | None:
    """``view`` and the views under it down to the first one of a [B, S, N] projection
    value (the last node's input): views, reshapes and unflattens of the trailing dims
    that keep the batch and sequence dims, so together one row-major split of the
    projection's N (transformers 5.25's Falcon views its packed q/k/v twice). None where
    the chain is anything else."""
    chain, node = [], view
    while True:
        if not (calls(node, _SPLIT) or calls(node, {"unflatten"})):
            return None
        chain.append(node)
        src, mo = node.args[0], meta(node)
        ms = meta(src) if isinstance(src, fx.Node) else None
        if ms is None or mo is None or ms.dim() < 3 or \
                tuple(ms.shape[:2]) != tuple(mo.shape[:2]) or ms.numel() != mo.numel():
            return None
        if ms.dim() == 3:  # the projection's own view: a view or reshape (the replays
            return chain if calls(node, _SPLIT) else None  # read its sizes)
        node = src


_FLATTEN = {"flatten", torch.flatten}
_BROADCAST = {"broadcast_to", torch.broadcast_to, "expand"}


def _flattened_members(node) -> list[fx.Node] | None:
    """[flatten, (broadcast,) getitem] for Falcon's grouped ("new decoder architecture")
    heads: ``view(B, S, G, g, d)[..., a:b, :]`` (the group's query heads, member dim
    kept) or ``[..., [j], :]`` broadcast to the group's g' query heads (k, v), then
    ``.flatten(2, 3)`` into heads. The rotation acts on each head alike (the rotation's
    matcher takes only tables broadcast over the heads), so it commutes with that
    broadcast: the fused GEMM rotates the one key head per group and the broadcast is
    replayed on its output (tests/test_rope.py: a per-head table look-alike is left)."""
    if not calls(node, _FLATTEN):
        return None
    src, start, end = _args(node, "input", "start_dim", "end_dim", defaults=(None, 0, -1))
    ms = meta(src) if isinstance(src, fx.Node) else None
    if ms is None or ms.dim() != 5 or (start % 5, end % 5) != (2, 3):
        return None
    out = [node]
    if calls(src, _BROADCAST):
        out.append(src)
        src = src.args[0]
    if not calls(src, {operator.getitem}):
        return None
    return out + [src]



def _block_split(heads: fx.Node, unsq_dim: int):
    """As _member_split, for CodeGen's model-parallel blocks: the projection viewed as
    ``P.reshape(B, S, mp, -1)``, ``torch.split(·, L, dim=-1)[i]`` (within each of the mp
    blocks, [q, v, k] of L features each), then ``reshape(B, S, mp, H / mp, d)`` and
    ``reshape(B, S, H, d)`` (then ``.transpose(1, 2)`` where the model puts the heads
    first); transformers 5.25 reshapes the block's item to ``(B, S, H, d)`` at once. The
    member is (mp, g, i, i + 1, L); its rows are the heads in the model's order."""
    found = _past_head_transpose(heads, unsq_dim)
    if found is None or not calls(found[0], _SPLIT):
        return None
    top, transposed = found[0], found[1]
    per_block = top.args[0]
    if calls(per_block, {operator.getitem}):  # no per-block reshape in between
        item, per_block = per_block, None
    else:
        item = per_block.args[0] if calls(per_block, _SPLIT) else None
    if item is None or not (calls(item, {operator.getitem}) and isinstance(item.args[1], int)):
        return None
    fan = item.args[0]
    if not calls(fan, SPLIT):
        return None
    blocks, size, dim = _args(fan, "input", "split_size", "dim", defaults=(None, None, 0))
    if not calls(blocks, _SPLIT) or not isinstance(size, int):
        return None
    proj_value = blocks.args[0]
    mh, mb = meta(top), meta(blocks)
    # the block's heads: [B, S, mp, H / mp, d] as the per-block reshape has them, or as
    # the one reshape to [B, S, H, d] splits each block's L features
    mper = meta(per_block) if per_block is not None else None
    mp = meta(proj_value) if isinstance(proj_value, fx.Node) else None
    if None in (mh, mb, mp) or (per_block is not None and mper is None) or mh.dim() != 4 or \
            mb.dim() != 4 or mp.dim() != 3 or dim not in (-1, 3) or mb.shape[3] % size or \
            mh.shape[2] % mb.shape[2]:
        return None
    per = tuple(mper.shape) if mper is not None else \
        (*mh.shape[:2], mb.shape[2], mh.shape[2] // mb.shape[2], mh.shape[3])
    lead = tuple(mp.shape[:2])
    if len(per) != 5 or tuple(mb.shape[:2]) != lead or tuple(per[:2]) != lead or \
            tuple(mh.shape[:2]) != lead or mb.shape[2] * mb.shape[3] != mp.shape[2] or \
            per[2] != mb.shape[2] or per[3] * per[4] != size or \
            mh.shape[2] != per[2] * per[3] or mh.shape[3] != per[4]:
        return None
    n_blocks, g, i = int(mb.shape[2]), int(mb.shape[3]) // size, item.args[1]
    if not 0 <= i < g:
        return None
    nodes = (*transposed, top, *((per_block,) if per_block is not None else ()), item, fan,
             blocks)
    return (proj_value, nodes, int(mh.shape[2]), int(mh.shape[3]),
            (n_blocks, g, i, i + 1, size))


def column_pieces(node: fx.Node) -> list[tuple[int, int]] | None:
    """The column ranges, in order, of the pieces ``x.split(s | [s0, s1, ..], -1)`` or
    ``x.chunk(n, -1)`` (node) cuts x into along its last dim (litgpt's ``q, k, v =
    qkv.split((q_size, k_size, v_size), dim=-1)``); None for anything else."""
    if not calls(node, SPLIT | CHUNK) or not isinstance(node.args[0], fx.Node):
        return None
    mx = meta(node.args[0])
    if mx is None or not isinstance(mx.shape[-1], int):
        return None
    n = mx.shape[-1]
    if calls(node, CHUNK):
        _, chunks, dim = _args(node, "input", "chunks", "dim", defaults=(None, None, 0))
        size = -(-n // chunks) if isinstance(chunks, int) and chunks > 0 else None
    else:
        _, size, dim = _args(node, "input", "split_size", "dim", defaults=(None, None, 0))
        size = node.kwargs.get("split_size_or_sections", size)
    if dim not in (-1, mx.dim() - 1):
        return None
    if isinstance(size, int) and size > 0:  # equal pieces, the last one shorter
        sizes = [size] * (n // size) + ([n % size] if n % size else [])
    elif isinstance(size, (list, tuple)) and all(isinstance(v, int) and v >= 0 for v in size) \
            and sum(size) == n:
        sizes = list(size)
    else:
        return None
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [(e - z, e) for e, z in zip(ends, sizes)]


def _column_piece(value: fx.Node) -> tuple[fx.Node, int, int, tuple[fx.Node, ...]] | None:
    """(x, start, stop, the nodes that select it) for value = ``x[..., start:stop]`` or a
    piece of x cut along its last dim (column_pieces)."""
    sl = _last_dim_slice(value)
    if sl is not None:
        mx = meta(sl[0])
        cols = None if mx is None else _norm_slice(sl[1], sl[2], int(mx.shape[-1]))
        return None if cols is None else (sl[0], *cols, (value,))
    if not calls(value, {operator.getitem}) or not isinstance(value.args[1], int):
        return None
    pieces = column_pieces(value.args[0])
    if pieces is None or not 0 <= value.args[1] < len(pieces):
        return None
    return (value.args[0].args[0], *pieces[value.args[1]], (value, value.args[0]))


def _column_readers(value: fx.Node) -> list[fx.Node]:
    """What reads ``value``, a split's or chunk's pieces along its last dim in the split's
    place (each piece is some of its columns; a split read otherwise stays itself)."""
    readers = []
    for u in value.users:
        items = list(u.users)
        if column_pieces(u) is not None and all(calls(i, {operator.getitem}) for i in items):
            readers += items
        else:
            readers.append(u)
    return readers


def columns_of(value: fx.Node) -> tuple[Projection, tuple[int, int]] | None:
    """The GEMM that produces ``value`` and which of its output columns it is."""
    p = projection_of(value)
    if p is not None:
        return p, (0, int(meta(value).shape[-1]))
    piece = _column_piece(value)
    p = None if piece is None else projection_of(piece[0])
    if p is None or meta(piece[0]) is None:
        return None
    x, a, b, nodes = piece
    return dataclasses.replace(p, nodes=p.nodes + nodes), (a, b)


def _rotated(add: fx.Node, norms: _Norms) -> Rotated | NoMatch | None:
    """The rotation anchored at ``add`` (its last add or cat), or why it is left; None
    where ``add`` is no rotation. ``norms``: the graph's RMSNorms (QK-norm)."""
    core = _rope_core(add) or _written_rope_core(add) or _pair_written_rope_core(add)
    if core is None:
        return None
    if isinstance(core, str):
        return NoMatch(add, core)
    x, cos_t, sin_t, unsq, nodes, form, half_width, stored_pairs = core
    out, rotary_part, offset = add, x, 0
    shared_key = _shared_latent_key(x)
    if shared_key is not None:
        return NoMatch(add, shared_key)
    # multi-head latent attention: q_pass, q_rot = split(q, [p, r], -1); the head is
    # cat((q_pass, rope(q_rot)), -1), a rotated suffix
    suffix = _split_suffix(x)
    sl = _last_dim_slice(x) if suffix is None else None
    if suffix is not None:
        heads, rest, fan, offset = suffix
        users = list(add.users)
        if len(users) != 1 or _cat_last(users[0]) != [rest, add]:
            return NoMatch(add, Why("the rotated suffix of the head is not concatenated back "
                                    "after the rest of the head", "rope.suffix_concat"))
        out = users[0]
        nodes = nodes + (x, rest, fan, out)
    # partial rotary: out = cat([rope(q[..., :r]), q[..., r:]]) over the head dim (litgpt:
    # rope(...).to(dtype) first, a cast, the identity where q's dtype is the table's)
    elif sl is not None:
        heads = sl[0]
        rotated, casts = add, ()
        while len(rotated.users) == 1 and _is_cast(next(iter(rotated.users))):
            rotated = next(iter(rotated.users))
            casts += (rotated,)
        users = [u for u in rotated.users]
        whole = int(meta(heads).shape[-1]) if meta(heads) is not None else None
        if whole is None or _norm_slice(sl[1], sl[2], whole) != (0, int(meta(x).shape[-1])):
            return NoMatch(add, Why("the rotated features are not a prefix of the head",
                                    "rope.partial_prefix"))
        if len(users) != 1 or _cat_last(users[0]) is None:
            return NoMatch(add, Why("a partial rotary whose rotated part is not concatenated "
                                    "back with the rest of the head", "rope.partial_concat"))
        parts = _cat_last(users[0])
        rest = parts[1] if len(parts) == 2 and parts[0] is rotated else None
        rs = _last_dim_slice(rest) if rest is not None else None
        if rs is None or rs[0] is not heads or \
                _norm_slice(rs[1], rs[2], whole) != (int(meta(x).shape[-1]), whole):
            return NoMatch(add, Why("a partial rotary that does not keep the rest of the head",
                                    "rope.partial_rest"))
        out = users[0]
        nodes = nodes + casts + (x, rest, out)
    if suffix is None and sl is None:
        heads = x
    # Cohere's q.float() before the rotation and .to(dtype) after it: the epilogue rotates
    # in float32 and writes the dtype of what the graph returns
    while _is_cast(heads):
        nodes += (heads,)
        heads = heads.args[0]
    norm_after = norms.by_input.get(out)  # a QK-norm of the rotated heads (casts in it),
    if norm_after is not None and (  # when only it reads them, over the head dim
            not set(out.users) <= set(norm_after.nodes) or meta(out) is None or
            norm_after.dim != int(meta(out).shape[-1])):
        norm_after = None
    while norm_after is None and len(out.users) == 1 and _is_cast(next(iter(out.users))):
        out = next(iter(out.users))
        nodes += (out,)
    split, member, norm = _head_split(heads, unsq), (), None
    if split is None:
        split = _normed_head_split(heads, unsq, norms.by_output)
        if split is not None:
            *split, norm = split
            why = _head_norm_misfit(norm)
            if why is not None:
                return NoMatch(add, why)
            nodes = nodes + norm.nodes
    if norm_after is not None and norm is not None:
        return NoMatch(add, Why("a QK-norm both before and after the rotation (the "
                                "epilogue has one)", "rope.qk_norm_twice"))
    if norm_after is not None:
        norm = HeadNorm(norm_after, after_rotation=True)
        why = _head_norm_misfit(norm)
        if why is not None:  # (the rotation alone would not pay either: the norm's weight
            return NoMatch(add, why)  # reads the permuted heads, so no attention keeps them)
        out, nodes = norm_after.output, nodes + norm.nodes
    if split is None:
        split = _member_split(heads, unsq) or _indexed_split(heads, unsq) or \
            _block_split(heads, unsq)
        if split is not None:
            *split, member = split
    if split is None:
        return NoMatch(add, Why(f"the rotated value {describe(heads)} is not the head-split "
                                "output of a projection", "rope.not_head_split"))
    col_value, split_nodes, n_heads, head_dim = split
    cols = columns_of(col_value)
    if cols is None and col_value in norms.by_output:
        return NoMatch(add, Why(
            f"a norm over the whole projection ({describe(col_value)}, OLMo 2's QK-norm) "
            "before the head split: its statistic spans every head, across the GEMM's "
            "tiles, and its row scale cannot be deferred into the attention (a per-row "
            "scale of q or k changes the softmax), so a fused GEMM would still need a pass "
            "over q and k to apply it: the same traffic as torch.compile's one kernel "
            "after the GEMM; not fused", "rope.norm_over_projection"))
    if cols is None:
        return NoMatch(add, Why(f"the rotated heads are not a GEMM's output columns "
                                f"({describe(col_value)} is computed in between: a norm over q "
                                "or k, say)", "rope.not_gemm_columns"))
    proj, columns = cols
    if member:  # positions in the members' order: members [i0, i1) of every head group
        groups, _, i0, i1, d = member
        if columns != (0, int(meta(proj.out).shape[-1])):
            return NoMatch(add, Why("a per-head packed value of a slice of a projection",
                                    "rope.packed_slice"))
        columns = (i0 * groups * d, i1 * groups * d)
    if proj.local:
        return NoMatch(add, Why("the rotated heads are a rank's shard of a column-parallel "
                                "GEMM: RoPE on sharded GEMMs is not implemented (the q/k/v "
                                "merge would gather the weights)", "rope.sharded"))
    if form == "interleaved":  # the tables as the rotation multiplies by them
        angle = Angle(None, None, None, 1.0, cos_t, sin_t, why_table=(
            "interleaved pairs: cos/sin are read as the tables the rotation multiplies by"),
            half_width=half_width)
        if meta(cos_t).requires_grad or meta(sin_t).requires_grad:
            return NoMatch(add, Why("the cos/sin tables require grad",
                                    "rope.angle_requires_grad"))
        return Rotated(out, heads, split_nodes, proj, columns, col_value, n_heads, head_dim,
                       int(meta(rotary_part).shape[-1]), angle, nodes, form=form,
                       member=member, norm=norm)
    angle = angle_of(cos_t, sin_t, half_width)
    if isinstance(angle, NoAngle):
        if not angle.as_table:
            return NoMatch(add, angle.why)
        angle = table_angle(cos_t, sin_t, angle.why, half_width)
        if isinstance(angle, str):
            return NoMatch(add, angle)
    mc = meta(angle.cos)
    rotary_dim = int(meta(rotary_part).shape[-1])
    if mc is None or layouts.table_rows_shape(mc.shape) is None or int(mc.shape[-1]) != (
            rotary_dim // 2 if half_width else rotary_dim):
        return NoMatch(add, Why("cos/sin are not [batch, seq, rotary_dim] tables",
                                "rope.table_shape"))
    return Rotated(out, heads, split_nodes, proj, columns, col_value, n_heads, head_dim,
                   rotary_dim, angle, nodes, member=member, rotary_offset=offset,
                   stored_pairs=stored_pairs, norm=norm)


def _head_norm_misfit(norm: HeadNorm) -> Why | None:
    """Why a QK-norm cannot go into the epilogue (None: it can). The kernel's statistic
    has one eps, compiled in: a run-time eps (dynamic=True) is left."""
    idiom = norm.idiom
    if not isinstance(idiom.eps, float):
        return Why(f"the QK-norm's eps {describe(idiom.eps)} is known only at run time (the "
                   "kernel's per-head statistic compiles its eps in)", "rope.qk_norm_eps")
    if idiom.weight is not None and meta(idiom.weight).dim() != 1:
        return Why("the QK-norm's weight is not one value per head feature",
                   "rope.qk_norm_weight")
    return None


def _split_suffix(x: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, int] | None:
    """(heads, the unrotated item, the split, its width) for x = ``torch.split(heads,
    [p, r], dim=-1)[1]`` where the split's two items are read only here and by the
    concatenation that puts the head back together (multi-head latent attention)."""
    if not (calls(x, {operator.getitem}) and x.args[1] == 1 and calls(x.args[0], SPLIT)):
        return None
    fan = x.args[0]
    src, sizes, dim = _args(fan, "tensor", "split_size_or_sections", "dim",
                            defaults=(None, None, 0))
    ms = meta(src) if isinstance(src, fx.Node) else None
    if ms is None or not isinstance(sizes, (list, tuple)) or len(sizes) != 2 or \
            not all(isinstance(v, int) and v > 0 for v in sizes) or \
            dim not in (-1, ms.dim() - 1) or sum(sizes) != ms.shape[-1]:
        return None
    rest = [u for u in fan.users if u is not x]
    if len(rest) != 1 or not (calls(rest[0], {operator.getitem}) and rest[0].args[1] == 0):
        return None
    return src, rest[0], fan, sizes[0]


def _shared_latent_key(x: fx.Node) -> Why | None:
    """Why a rotation of multi-head latent attention's shared key is left: x =
    ``split(P, [c, r], -1)[1].view(B, 1, S, r)``, one r-wide head sliced off the
    compressed kv projection and shared by every query head."""
    if not (calls(x, _SPLIT) and meta(x) is not None and meta(x).dim() == 4 and
            meta(x).shape[1] == 1):
        return None
    item = x.args[0]
    if not (calls(item, {operator.getitem}) and item.args[1] == 1 and
            calls(item.args[0], SPLIT)):
        return None
    sizes = _args(item.args[0], "tensor", "split_size_or_sections")[1]
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2):
        return None  # [compressed kv, rotary part]; a packed multi-query k has three
    return Why("the rotary part of multi-head latent attention's key: one small head "
               "(tokens × rotary_dim, sliced off the compressed kv projection) shared by "
               "every query head, left as graph ops; where the query's rotation is fused "
               "and leaves it in pair order, the key gets that order where it is "
               "assembled (algebra/rope.py)", "rope.latent_shared_key")


# ---- the complex form: view_as_real(view_as_complex(q) · table) (TorchTitan) ------------------

def _unit_dims_of(node) -> fx.Node | None:
    """The value under views that only add or drop unit dims (a table broadcast for a
    product: ``t[None, :, None, :]``, ``t.view(1, S, 1, d)``, ``t.unsqueeze(k)``)."""
    while isinstance(node, fx.Node) and (calls(node, _SPLIT | {operator.getitem, "unsqueeze",
                                                             torch.unsqueeze, "contiguous"})):
        src = node.args[0]
        ms, mn = meta(src), meta(node)
        if ms is None or mn is None or ms.numel() != mn.numel() or \
                [d for d in ms.shape if d != 1] != [d for d in mn.shape if d != 1]:
            break
        if node.target is operator.getitem:
            idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if not all(e is None or e == slice(None) for e in idx):
                break
        node = src
    return node


def _under_moves(node, casts: bool = False):
    """The value under device moves (``.to(q.device)``: DeepSeek-V2's table), views that
    only add or drop unit dims (_unit_dims_of) and, with ``casts``, dtype casts."""
    while True:
        node = _unit_dims_of(through_casts(node)[0] if casts else node)
        if calls(node, {"to"}) and len(node.args) == 2 and \
                isinstance(node.args[1], torch.device) and not node.kwargs:
            node = node.args[0]
            continue
        return node


def _complex_rotated(vr: fx.Node) -> Rotated | NoMatch | None:
    if not calls(vr, {torch.view_as_real}):
        return None
    c = canon(vr.args[0]) if isinstance(vr.args[0], fx.Node) else None
    if c is None or c.name != "mul":
        return None
    for xc, rot in (c.args, c.args[::-1]):
        if not (calls(xc, {torch.view_as_complex}) and isinstance(rot, fx.Node)):
            continue
        pairs = xc.args[0]
        if not calls(pairs, _SPLIT):
            continue
        heads, casts = pairs.args[0], []  # q.float(): the casts are the rotation's own
        while _is_cast(heads):
            casts.append(heads)
            heads = heads.args[0]
        mh, mp = meta(heads), meta(pairs)
        if mh is None or mp is None or mh.dim() != 4 or \
                tuple(mp.shape) != (*mh.shape[:-1], mh.shape[-1] // 2, 2):
            continue
        table = _under_moves(rot)
        mt, mr = meta(table), meta(rot)
        if mt is None or not mt.is_complex() or mr is None or not 2 <= mr.dim() <= 4:
            return NoMatch(vr, Why(
                    "the complex rotation's factor is not a table broadcast over "
                    "the heads", "rope.table_broadcast"))
        # its shape against the 4-d heads, as broadcasting aligns it (Mistral's reference:
        # freqs_cis[:, None, :], [seq, 1, d/2])
        rshape = (1,) * (4 - mr.dim()) + tuple(mr.shape)
        users = list(vr.users)
        flat = users[0] if len(users) == 1 else None
        if flat is None or not calls(flat, {"flatten", torch.flatten}) or \
                tuple(meta(flat).shape) != tuple(mh.shape):
            return NoMatch(vr, Why("the rotated pairs are not flattened back to the head dim",
                                   "rope.pairs_not_flattened"))
        out, after = flat, []
        while len(out.users) == 1 and _is_cast(next(iter(out.users))):
            out = next(iter(out.users))
            after.append(out)
        shared_key = _shared_latent_key(heads)
        if shared_key is not None:
            return NoMatch(vr, shared_key)
        rotated_width, offset, suffix = int(mh.shape[-1]), 0, _split_suffix(heads)
        if suffix is not None:  # DeepSeek-V2: cat((q_nope, q_pe), -1) of the rotated q_pe
            after.append(heads)
            heads, rest, fan, offset = suffix
            cat = next(iter(out.users)) if len(out.users) == 1 else None
            if cat is None or _cat_last(cat) != [rest, out]:
                return NoMatch(vr, Why("the rotated suffix of the head is not concatenated "
                                       "back after the rest of the head",
                                       "rope.suffix_concat"))
            after += [rest, fan, cat]
            out = cat
        # the head axis is where the table has a unit dim and the heads do not
        for axis in (2, 1):
            split = _head_split(heads, axis)
            if split is not None and rshape[axis] == 1:
                break
        else:
            return NoMatch(vr, Why(f"the rotated value {describe(heads)} is not the head-split "
                                   "output of a projection", "rope.not_head_split"))
        col_value, split_nodes, n_heads, head_dim = split
        angle = _polar_angle(table)
        if suffix is not None and angle is None:
            return NoMatch(vr, Why(
                "multi-head latent attention's rotation by a complex table from outside "
                "this graph: its rotated suffix would need a per-head table as wide as the "
                "head (nope + rope features, 192 for DeepSeek), which the kernel's table "
                "tiles do not fit; left (a table computed in the graph as polar(1, θ) is "
                "recomputed from positions and frequencies instead)",
                "rope.latent_complex_table"))
        seq_axis = 1 if axis == 2 else 2
        if rshape[seq_axis] != mh.shape[seq_axis] or rshape[-1] != rotated_width // 2 or \
                mt.shape[-2] != mh.shape[seq_axis] or mt.dim() not in (2, 3) or \
                (mt.dim() == 3 and mt.shape[0] not in (1, mh.shape[0])):
            return NoMatch(vr, Why(
                    "the table's rows are not the sequence positions of the heads",
                    "rope.table_rows"))
        cols = columns_of(col_value)
        if cols is None:
            return None
        proj, columns = cols
        if proj.local:
            return NoMatch(vr, Why("the rotated heads are a rank's shard of a column-parallel "
                                   "GEMM: RoPE on sharded GEMMs is not implemented (the "
                                   "q/k/v merge would gather the weights)", "rope.sharded"))
        nodes = (*casts, pairs, xc, vr.args[0], vr, flat, *after)
        return Rotated(out, heads, split_nodes, proj, columns, col_value, n_heads, head_dim,
                       rotated_width, angle, nodes, form="pairs", table=table, table_view=rot,
                       rotary_offset=offset, stored_pairs=True)
    return None


def _polar_angle(table: fx.Node) -> Angle | None:
    """The angles of a complex table computed in this graph as ``polar(ones_like(θ), θ)
    (· s)`` with θ = pos ⊗ inv_freq (DeepSeek-V2's freqs_cis): the epilogue recomputes
    them, as for the half-split form; None for any other table (read as a table)."""
    node, scale = _under_moves(table, casts=True), 1.0
    found = _scalar_scale(node)
    if found is not None:
        node, scale = found
    node = _under_moves(node, casts=True)
    if not calls(node, {torch.polar}) or len(node.args) != 2:
        return None
    ones, theta = node.args
    if not (calls(ones, {torch.ones_like}) and ones.args[0] is theta):
        return None
    outer = _outer(theta)
    if outer is None:
        return None
    return Angle(theta, outer[0], outer[1], scale, table, table,
                 why_table="")


# ---- grouping: q and k (and v) over one input ---------------------------------------------

def _same_input(a: Projection, b: Projection) -> bool:
    return same_value(a.x, b.x) and (a.r is None) == (b.r is None) and \
        (a.r is None or same_value(a.r, b.r))


def _passthrough_candidates(group: list[Rotated], graph: fx.Graph,
                            rotated_elsewhere: set) -> list[Passthrough]:
    """Other GEMM outputs over the same input (and row scale): v, or the rest of a
    packed projection. They join the GEMM with frequency 0; not one another group
    rotates (``rotated_elsewhere``: (projection, columns) pairs)."""
    p0 = group[0].proj
    taken = {(r.proj.out, r.columns) for r in group} | rotated_elsewhere
    out = []
    for r in group[:1]:  # a packed projection's other members (v)
        if not r.member:
            continue
        rotated = {n for x in group for n in x.split}
        # what the member's index reads: the chunk, split or unbind, or the view indexed
        at = next((i for i, n in enumerate(r.split) if calls(n, {operator.getitem})), None)
        fan = r.split[at + 1] if at is not None and at + 1 < len(r.split) else r.split[-1]
        siblings = fan.users  # the chunk's or split's items, or the view's indexes
        for item in siblings:  # the chunk's items, or the view's other indexes
            if item in rotated or not calls(item, {operator.getitem}):
                continue
            end, found = item, None
            while True:  # through the transpose and the no-op reshape after it
                found = _member_split(end, 1) or _member_split(end, 2) or \
                    _indexed_split(end, 1) or _indexed_split(end, 2) or \
                    _block_split(end, 1) or _block_split(end, 2)
                if found is not None or len(end.users) != 1:
                    break
                end = next(iter(end.users))
            if found is None or found[0] is not r.column_node:
                continue
            groups, _, i0, i1, d = found[4]
            out.append(Passthrough(r.proj, (i0 * groups * d, i1 * groups * d), end,
                                   member=found[4], split=found[1]))
            taken.add((r.proj.out, out[-1].columns))
    packed = {r.proj.out for r in group}
    for node in graph.nodes:
        if meta(node) is None:
            continue
        found = columns_of(node)
        if found is None:
            continue
        proj, cols = found
        if (proj.out, cols) in taken or not _same_input(proj, p0):
            continue
        if proj.out is node and proj.out in packed:
            continue  # the packed projection itself, not one of its slices
        if node is not proj.out and proj.out not in packed:
            continue  # a slice of another projection: leave it to that projection
        if any(o.column_node is node for o in out):
            continue
        out.append(Passthrough(proj, cols, node))
    return out


@dataclasses.dataclass(frozen=True)
class _Norms:
    """The graph's RMSNorms: by their output, and by the value under the output's own
    trailing casts (Gemma's ``.type_as(x)``: the rotation reads past casts); by input."""
    by_output: dict
    by_input: dict

    @classmethod
    def of(cls, graph: fx.Graph) -> "_Norms":
        by_output, by_input = {}, {}
        for n in find_rms_norms(graph):
            if not isinstance(n, RmsNorm):
                continue
            by_input.setdefault(n.input, n)
            node = n.output
            by_output[node] = n
            while _is_cast(node) and node.args[0] in n.nodes:
                node = node.args[0]
                by_output[node] = n
        return cls(by_output, by_input)


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    found: list[Rotated] = []
    out: list[Match | NoMatch] = []
    norms = _Norms.of(graph)
    for node in list(graph.nodes):
        r = _rotated(node, norms)
        if r is None:
            r = _complex_rotated(node)
        if isinstance(r, NoMatch):
            out.append(r)
        elif r is not None:
            found.append(r)
    groups: list[list[Rotated]] = []
    for r in found:
        for g in groups:
            a, b = g[0].angle, r.angle
            if r.form != g[0].form:
                same_angle = False
            elif r.form == "pairs":
                same_angle = same_value(g[0].table, r.table)
            elif a.source != b.source or a.half_width != b.half_width:
                same_angle = False
            elif b.source == "angles":
                same_angle = a.emb is b.emb
            else:
                same_angle = same_value(a.cos, b.cos) and same_value(a.sin, b.sin)
            # one permutation for the group: heads laid out alike (DeepSeek-V3.2's
            # indexer reads the same input as the attention's q, with other heads)
            same_heads = (g[0].head_dim, g[0].rotary_dim, g[0].rotary_offset,
                          g[0].stored_pairs) == (r.head_dim, r.rotary_dim, r.rotary_offset,
                                                 r.stored_pairs)
            if _same_input(g[0].proj, r.proj) and same_angle and same_heads:
                g.append(r)
                break
        else:
            groups.append([r])
    rotated = {(r.proj.out, r.columns) for r in found}
    for g in groups:
        # v joins at frequency 0 (angles) or under a 0 "rotate" flag (a table)
        passthrough = _passthrough_candidates(g, graph, rotated)
        g, passthrough, left = _members_differentiated_alike(g, passthrough)
        out += left
        if g:
            out.append(Match(g, passthrough))
    return out


def _members_differentiated_alike(group: list[Rotated], passthrough: list[Passthrough]):
    """(the rotated members, the passthrough ones, NoMatches for those left): in a graph
    that differentiates the GEMM, a member no reader differentiates (read through a
    detach) is left out while another is: one fused weight's gradient would give that
    member's weight a zero gradient where eager gives none (.grad None, which an
    optimizer's weight decay and moments skip). Members read alike stay together."""
    value = {id(m): m.out if m.rotates else m.column_node for m in (*group, *passthrough)}
    needs = [m for m in (*group, *passthrough) if meta(value[id(m)]) is not None and
             meta(value[id(m)]).requires_grad]
    dropped = {id(m) for m in needs if not gradient_read(value[id(m)])}
    if not dropped or len(dropped) == len(needs):
        return group, passthrough, []
    left = [NoMatch(value[id(m)], Why(
        f"{describe(value[id(m)])} is read only through a detach while the GEMM's other "
        "members are differentiated: one fused weight would give its weight a zero "
        "gradient where eager gives none", "rope.member_not_differentiated"))
        for m in group if id(m) in dropped]
    return ([m for m in group if id(m) not in dropped],
            [m for m in passthrough if id(m) not in dropped], left)


# ---- the program ----------------------------------------------------------------------------

def _norm_multiplier(p: ProgramBuilder, v: str, norm: tuple) -> str:
    """The QK-norm's per-element multiplier n·g + keep, norm = (head_dim, eps, keep, ...):
    n = head_rstd(v, head_dim, eps) (each head's rsqrt(mean(v²) + eps)), g the norm's
    weight per column (0 where no norm scales: v), keep 1 where no norm scales, else 0;
    without unnormed columns, n·g. (Operands g and keep declared by the caller.)"""
    head_dim, eps, keep = norm[:3]
    n = p.head_rstd(v, head_dim, eps, name="n")
    s = p.mul(n, "g", name="n_g")
    return p.add(s, "keep", name="s") if keep else s


def _program_name(base: str, has_r: bool, norm) -> str:
    name = base if not norm else f"{base}_qknorm" if norm[3] else f"qknorm_{base}"
    return ("rowscale_" if has_r else "") + name


def _rotation_program(name: str, has_r: bool, has_bias: bool, scaled: bool, dtype,
                      norm: tuple | None, rotate) -> EpilogueProgram:
    """y = acc (· r) (+ b), then the QK-norm before the rotation (y · (n·g + keep)), the
    attention scaling (· s_j), the rotation ``rotate(p, y)``, or the QK-norm after it
    (rot · (n·g + keep), n from the value the rotation reads: a rotation keeps each
    pair's sum of squares, so each head's)."""
    p = ProgramBuilder(_program_name(name, has_r, norm), gemm=True, family="rope")
    v = p.scaled_acc(has_r, has_bias)
    if norm is not None:  # operands in one order either way: r, bias, g, keep, the angle's
        p.operand("g", Kind.PER_FEATURE)
        if norm[2]:
            p.operand("keep", Kind.PER_FEATURE)
    before, after = (norm, None) if norm is not None and not norm[3] else (None, norm)
    if before is not None:
        v = p.mul(v, _norm_multiplier(p, v, before), name="y_n")
    if scaled:
        v = p.mul(v, p.operand("colscale", Kind.PER_FEATURE), name="y_s")
    s = _norm_multiplier(p, v, after) if after is not None else None
    out = rotate(p, v)
    if s is not None:
        out = p.mul(out, s, name="rot_n")
    p.output(out, Kind.TILE, dtype_name(dtype))
    return p.build()


def rope_program(has_r: bool, has_bias: bool, scaled: bool, dtype: torch.dtype,
                 norm: tuple | None = None) -> EpilogueProgram:
    """y = acc (· r) (+ b) [QK-norm] (· s_j); out = rope(y, pos, freq) [QK-norm] -> out
    (tile). s_j: the attention scaling on rotated columns, 1 on pass-through ones (a
    per-feature operand: v stays in the GEMM, and a scale known only at run time needs
    no recompile). norm: (head_dim, eps, keep, after the rotation) (_rotation_program)."""
    def rotate(p, v):
        pos = p.operand("pos", Kind.PER_ROW)
        return p.rope(v, pos, p.operand("freq", Kind.PER_FEATURE), name="rot")
    return _rotation_program("rope", has_r, has_bias, scaled, dtype, norm, rotate)


def rope_table_program(has_r: bool, has_bias: bool, dtype: torch.dtype,
                       passthrough: bool = False, norm: tuple | None = None
                       ) -> EpilogueProgram:
    """y = acc (· r) (+ b) [QK-norm]; out = rope_table(y, cs [, on]) [QK-norm] -> out
    (tile). A table repeats every head_dim columns and cannot tell v's heads from q's:
    with pass-through columns a per-feature flag ``on`` (1 rotate, 0 pass through) keeps
    v in the GEMM."""
    def rotate(p, v):
        angle = [p.operand("cs", Kind.COS_SIN)]
        if passthrough:
            angle.append(p.operand("on", Kind.PER_FEATURE))
        return p.rope_table(v, *angle, name="rot")
    return _rotation_program("rope_table", has_r, has_bias, False, dtype, norm, rotate)


def trains(m: Match) -> bool:
    """Whether the graph computes a gradient through these projections."""
    return any(bool(meta(r.out).requires_grad) for r in m.rotated)


def angles_as_table(m: Match) -> bool:
    """Whether the epilogue reads angles computed in this graph (pos ⊗ inv_freq) as one
    (cos, sin) table [rows, head_dim] made from them once per graph
    (layouts.rope_angle_table_rows), instead of recomputing them per column: in training
    graphs. The forward kernel is faster recomputing them (the inference path), but the
    backward's inverse rotation, graph ops under Inductor, then recomputed them per
    rotated element too (a float64 angle, cos and sin for every column of q and k: 2.8 ms
    of the 1B step's 16 layers on the H200, BENCHMARKS.md, seventeenth session). A table
    has one angle per (row, frequency), is shared by every layer of the graph, is what
    eager keeps for its backward anyway (cos and sin), and both directions read it. Not
    with an attention scaling (the table program has no column scale), and on the GPU
    only where the kernel's table tiles fit the head. The table repeats every head_dim
    columns, so every segment of the GEMM (v's too) must be whole heads wide."""
    if not trains(m) or m.angle_source != "angles" or m.scaled:
        return False
    head_dim = m.rotated[0].head_dim
    if any((s.columns[1] - s.columns[0]) % head_dim for s in m.segments):
        return False
    from ..kernels.quack_path import table_head_fits
    x = meta(m.proj.x)
    return x is None or not family.on_gpu(x) or table_head_fits(head_dim)


def build_program(m: Match, table: bool = False) -> EpilogueProgram:
    """The match's program; ``table``: angles read as a table (angles_as_table)."""
    norm = None
    if m.head_norm is not None:
        unnormed = any(getattr(s, "norm", None) is None for s in m.segments)
        head_dim, eps, after = m.head_norm
        norm = (head_dim, eps, unnormed, after)
    if m.angle_source == "table" or table:
        return rope_table_program(m.proj.r is not None, m.has_bias,
                                  meta(m.rotated[0].out).dtype, bool(m.passthrough), norm)
    return rope_program(m.proj.r is not None, m.has_bias, m.scaled,
                        meta(m.rotated[0].out).dtype, norm)


# ---- the family's protocol (patterns/family.py) ------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match                   # its segments final: v that can join, remainders
    program: EpilogueProgram
    cache_relayouts: bool          # keep the permuted weights inside the op (inference)


def describe_match(m: Match, table: bool = False) -> dict:
    pass_through = "frequency 0" if m.angle_source == "angles" and not table else "not rotated"
    shown = {"consumers": [describe(r.out) for r in m.rotated] + [
        f"{describe(s.column_node)} ({pass_through})" for s in m.passthrough]}
    if m.proj.r is not None:
        shown["producer"] = f"rows scaled by the deferred rstd {describe(m.proj.r)}"
    return shown


def plan_segments(m: Match) -> Match | str:
    """The match with its segments final, or why it cannot have them: v joins the fused
    GEMM where it has q's dtype (and, where the epilogue reads a table, which repeats every
    head_dim columns, where it is whole heads wide); a packed projection's slices that the
    fused GEMM does not produce (v, when it cannot join) get a GEMM of their own."""
    dtype = meta(m.rotated[0].out).dtype
    passthrough = [s for s in m.passthrough if meta(s.column_node).dtype == dtype]
    if m.angle_source == "table":  # the table repeats every head_dim columns: whole heads
        head_dim = m.rotated[0].head_dim
        passthrough = [s for s in passthrough if (s.columns[1] - s.columns[0]) % head_dim == 0]
    segments = [*m.rotated, *passthrough]
    seg_nodes = {s.column_node for s in segments}
    remainders = []
    for proj in {s.proj.out: s.proj for s in segments}.values():
        for call in filter(fused_linear_call, proj.nodes):
            if set(call.users) != {proj.out}:
                return Why(f"{describe(call)} has readers outside the fused GEMM",
                           "rope.call_read")
        if proj.out in seg_nodes:
            continue
        for u in _column_readers(proj.out):  # a packed projection: read only by columns
            if u in seg_nodes:
                continue
            sl = columns_of(u)
            if sl is None or sl[0].out is not proj.out:
                return Why(f"the packed projection {describe(proj.out)} is read beyond its "
                           "column slices", "rope.packed_read")
            remainders.append(Passthrough(sl[0], sl[1], u))
    if any(s.member for s in m.passthrough if s not in passthrough):
        return Why("a member of a per-head packed projection (v) cannot join the fused GEMM "
                   "(another dtype)", "rope.packed_member_left")
    return dataclasses.replace(m, passthrough=passthrough, remainders=remainders)


def _table_misfit(m: Match) -> Why | None:
    """Why the GPU kernel cannot read this match's cos/sin table (its width, head_dim,
    fits none of the kernel's table tiles: kernels/quack_path.table_head_fits), so every
    call would take the reference path: such a rewrite is not made. On the CPU (the
    reference path anyway) there is no kernel to fit."""
    from ..kernels.quack_path import table_head_fits
    x = meta(m.proj.x)
    head_dim = m.rotated[0].head_dim
    if m.angle_source != "table" or x is None or not family.on_gpu(x) or \
            table_head_fits(head_dim):
        return None
    why = "the complex form" if m.form == "pairs" else m.angle.why_table
    return Why(f"the cos/sin are read as a table ({why}) whose heads are {head_dim} wide: "
               "the kernel's table tiles need a multiple of 64 that divides or is a "
               "multiple of 128, so every call would run the reference path; left "
               "(cos/sin computed in the same graph, from positions and frequencies, "
               "have no such limit)", "rope.table_head_width")


def decide(m: Match, context: Context) -> Decided:
    planned = plan_segments(m)
    if isinstance(planned, str):
        return Decided.refuse(Rejection(planned, m.path))
    m = planned
    table = angles_as_table(m)
    program = build_program(m, table)
    # on the GPU: a float32 projection, widths or QK-norm heads no kernel takes
    misfit = _table_misfit(m) or (None if m.proj.local else no_kernel(
        m.proj.out, "rope.no_kernel", tuple({s.proj.weight: 0 for s in m.segments}),
        n=sum(s.columns[1] - s.columns[0] for s in m.segments), program=program))
    if misfit is not None:
        return Decided.refuse(Rejection(misfit, m.path))
    decision = rope_algebra.decide(m, program)
    if not decision.accepted:
        return Decided.refuse(decision, **describe_match(m, table))
    cache = context.options.cache_relayouts and not trains(m)
    return Decided(decision, Plan(m, program, cache), None, describe_match(m, table))


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """Replace q/k projections + rotation (and v's projection) by one GEMM with a
    rotating epilogue; eager's feature order is put back on the edges the escape
    analysis names (algebra/rope.py)."""
    m = plan.match

    lay = rope_algebra.layout(m)
    # the fused GEMM goes right after the last value it reads, which must precede every
    # reader of what it replaces: values computed later (TorchTitan's table, made complex
    # inside the rotation of q, after v's reshape) are moved up if they are pure
    p = m.proj
    reads = [p.x, p.r, *(s.proj.weight for s in m.segments), *(s.proj.bias for s in m.segments),
             *((m.angle.inv_freq, m.angle.pos) if m.angle_source == "angles" else
               (m.table,) if m.form == "pairs" else (m.angle.cos, m.angle.sin))]
    # the head split (view, transpose) is rebuilt on the fused GEMM's output: its other
    # arguments (sizes, symbolic under dynamic shapes) must be defined before it too
    rebuilt = [*m.rotated, *(seg for seg in m.passthrough if seg.member)]
    reads += [a for s in rebuilt for node in s.split for a in node.all_input_nodes
              if a is not node.args[0]]
    reads += [r.norm.idiom.weight for r in m.rotated if r.norm is not None]
    reads = [n for n in reads if isinstance(n, fx.Node)]
    readers = [u for r in m.rotated for u in r.out.users] + \
        [u for s in m.passthrough for u in s.column_node.users]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(readers, key=order.__getitem__) if readers else None
    last_read = max(reads, key=order.__getitem__)
    # right after the last value it reads (once those read late are moved up before the
    # first reader), in the grad mode eager computed the rotation in: checked before the
    # graph changes
    anchor = first if first is not None and order[last_read] >= order[first] else \
        last_read.next
    anchor = anchor_in_mode_of(anchor, first, m.rotated[0].out)
    if first is not None:
        hoist_before(first, reads)
    # the angles pos ⊗ inv_freq recomputed in the epilogue, or read from a table: the
    # model's own, or in a training graph one made from those angles (angles_as_table)
    recomputed = rope_algebra.recomputes_angles(m, plan.program)
    if recomputed:
        freq = shared_call(graph, rope_frequencies, (m.angle.inv_freq, lay), anchor)
    with graph.inserting_before(anchor):
        b = [relayout_node(graph, "rope_segments", lay, *(s.proj.bias for s in m.segments))] \
            if m.has_bias else []
        x = p.x  # read for its leading shape only
        rot = m.rotated[0]
        if m.angle_source == "angles":
            rows = shared_call(graph, layouts.rope_positions, (m.angle.pos, x), anchor,
                               same_rows(m.angle.pos, x))
            angle = [rows, freq] if recomputed else [shared_call(  # one table, every layer
                graph, layouts.rope_angle_table_rows,
                (rows, m.angle.inv_freq, rot.head_dim, rot.rotary_offset), anchor)]
            if recomputed and m.scaled:  # a per-column float32 scale before the rotation
                angle.insert(0, graph.call_function(layouts.rope_column_scale,
                                                    (m.angle.scale, lay, x)))
        elif m.form == "half":
            angle = [graph.call_function(layouts.rope_half_table_rows, (
                m.angle.cos, m.angle.sin, x, rot.head_dim, rot.rotary_dim,
                m.angle.half_width, rot.rotary_offset))]
        elif m.form == "interleaved":
            angle = [graph.call_function(layouts.rope_pair_table_rows, (
                m.angle.cos, m.angle.sin, x, rot.head_dim, rot.rotary_dim,
                m.angle.half_width))]
        else:
            angle = [graph.call_function(layouts.rope_table_rows, (m.table, x))]
        if not recomputed and m.passthrough:  # a table cannot tell v's heads from q's
            spans = rope_algebra.rotated_spans(m)
            angle.append(shared_call(graph, layouts.rope_rotated_columns, (spans, x), anchor,
                                      lambda n: n.args[0] == spans))
        if m.head_norm is not None:  # the QK-norm's weight (and unnormed columns' flag)
            angle = _norm_operands(graph, m, lay, x) + angle
        r = [p.r] if p.r is not None else []
        weights = tuple(s.proj.weight for s in m.segments)
        call = relaid_gemm(graph, plan.cache_relayouts, plan.program.to_text(), p.out, p.x,
                           "rope_segments", lay, weights, r, b, angle, trains=trains(m))
        copy_meta(call, m.rotated[0].out)
        y = results(graph, call, 1, m.rotated[0].out)[0]
        at, new_outs = 0, []
        for s in m.segments:
            n = s.columns[1] - s.columns[0]
            piece = graph.call_function(operator.getitem, (y, (Ellipsis, slice(at, at + n))))
            at += n
            if s.member:  # a per-head packed member: heads of d features, not g·d
                v = member_heads(graph, piece, s)
                if isinstance(s, Rotated):
                    new_outs.append(v)
                    s.out.replace_all_uses_with(v)
                else:
                    s.column_node.replace_all_uses_with(v)
                continue
            same_meta(piece, s.column_node)
            if isinstance(s, Rotated):
                v = piece
                for node in reversed(s.split):  # view, then transpose, onto the piece
                    src = node.args[0]
                    v = graph.node_copy(node, lambda a, src=src, v=v: v if a is src else a)
                    same_meta(v, node)
                new_outs.append(v)
                s.out.replace_all_uses_with(v)
            else:
                s.column_node.replace_all_uses_with(piece)
    for s in m.remainders:  # what else a packed projection held: its own GEMM
        with graph.inserting_before(s.column_node):
            s.column_node.replace_all_uses_with(column_gemm(graph, s))
    region = rope_algebra.region_of(m, new_outs) if m.form == "half" else \
        rope_algebra.Region(set(), [], [])
    rot = m.rotated[0]
    for consumer, value in region.unpermute:
        with graph.inserting_before(consumer):
            back = graph.call_function(layouts.rope_unpermute,
                                       (value, rot.head_dim, rot.rotary_dim, rot.rotary_offset))
        same_meta(back, value)
        consumer.replace_input_with(value, back)
    for reader, value in region.key_writes:  # MLA: the key's rotated part in q's order
        permute_key_part(graph, reader, value)
    erase_if_dead(graph, [n for r in m.rotated for n in (r.out, *r.nodes, *r.split)]
                  + [n for s in (*m.segments, *m.remainders)
                     for n in (s.column_node, *s.split, *s.proj.nodes)])
    shown = {"programs": [plan.program],
             "weights": weights_line(plan.cache_relayouts, context.options)}
    if m.angle_source == "angles" and not recomputed:
        shown["backward"] = ("the angles pos ⊗ inv_freq read as one (cos, sin) table, made "
                             "once for the graph's layers: the inverse rotation reads it "
                             "(no angle recomputed per column)")
    if region.unpermute:
        shown["materialised"] = [
            f"{v.name} in eager order for {'the graph output' if c.op == 'output' else c.name}"
            for c, v in region.unpermute]
    return shown


def _norm_operands(graph: fx.Graph, m: Match, lay: tuple, x: fx.Node) -> list[fx.Node]:
    """The QK-norm program's per-feature operands: g (each norm's weight, its offset,
    per column in the fused order) and, where some columns have no norm (v), keep."""
    norms = [getattr(s, "norm", None) for s in m.segments]
    offsets = tuple(None if n is None else n.idiom.weight_offset for n in norms)
    weights = tuple(None if n is None else n.idiom.weight for n in norms)
    out = [graph.call_function(rope_norm_weight, (lay, offsets, x, *weights))]
    if None in offsets:
        out.append(graph.call_function(layouts.rope_norm_keep, (lay, offsets, x)))
    return out


def permute_key_part(graph: fx.Graph, reader: fx.Node, value: fx.Node) -> None:
    """``reader`` (``key[..., offset:].copy_(value)``, or the key's concatenation) reads
    ``rope_permute(value)`` instead; through the broadcast of the shared rotary head to
    every head (``expand``), permuted before it: one small head, not all of them."""
    user = reader
    if calls(value, _BROADCAST) and len(value.users) == 1 and isinstance(value.args[0], fx.Node):
        user, value = value, value.args[0]
    with graph.inserting_before(user):
        permuted = graph.call_function(layouts.rope_permute, (value,))
    same_meta(permuted, value)
    user.replace_input_with(value, permuted)


def member_heads(graph: fx.Graph, piece: fx.Node, s) -> fx.Node:
    """A per-head packed member's heads rebuilt on its columns of the fused GEMM, [B, S,
    H·d] -> [B, S, H, d] (-> [B, H, S, d] where the model transposed): the model's view
    (its sizes, symbolic ones too) with d for the group's g·d."""
    view = s.split[-1]  # the model's view of the whole projection
    sizes = list(view.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = list(sizes[0])
    groups, _, i0, i1, d = s.member
    value = s.heads if isinstance(s, Rotated) else s.column_node
    replayed = None
    if any(calls(n, _FLATTEN) for n in s.split):  # Falcon's grouped heads: the member dim
        replayed = (groups, i1 - i0, d)          # kept, then broadcast and flattened
    elif any(_splits_features(n) for n in s.split):  # CodeGen's blocks: [mp, L] each
        replayed = (groups, d)
    if replayed is not None:  # the member as the model's index gives it, then the
        # model's own nodes after that index replayed onto the piece
        at = next(i for i, n in enumerate(s.split) if calls(n, {operator.getitem}))
        v = graph.call_method("view", (piece, *sizes[:2], *replayed))
        same_meta(v, s.split[at])
        for node in reversed(s.split[:at]):
            v = graph.node_copy(node, lambda a, src=node.args[0], v=v: v if a is src else a)
            same_meta(v, node)
        return v
    v = graph.call_method("view", (piece, *sizes[:2], groups * (i1 - i0), d))
    for node in s.split:
        if swaps_heads(node):
            v = graph.node_copy(node, lambda a, src=node.args[0], v=v: v if a is src else a)
    same_meta(v, value)
    return v


def _splits_features(node: fx.Node) -> bool:
    """A torch.split along the last dim (CodeGen's blocks), not along the heads (Falcon's
    multi-query q, k, v under transformers 5.25)."""
    if not calls(node, SPLIT):
        return False
    return _args(node, "input", "split_size", "dim", defaults=(None, None, 0))[2] in (-1, 3)


def same_rows(pos: fx.Node, x: fx.Node):
    """A rope_positions call on the same positions for GEMM rows of the same shape (x is
    read for its leading shape only)."""
    def same(n):
        mx, other = meta(x), meta(n.args[1])
        return n.args[0] is pos and mx is not None and other is not None \
            and mx.shape[:-1] == other.shape[:-1]
    return same


def column_gemm(graph: fx.Graph, s) -> fx.Node:
    """Columns [lo, hi) of a projection as a GEMM of their own: the weight's (and bias's)
    rows sliced from the live parameters; a rewritten norm consumer keeps its program."""
    lo, hi = s.columns
    p = s.proj
    w = graph.call_function(operator.getitem, (p.weight, slice(lo, hi)))
    b = [graph.call_function(operator.getitem, (p.bias, slice(lo, hi)))] \
        if p.bias is not None else []
    call = next(filter(fused_linear_call, p.nodes), None)
    if call is None:
        out = graph.call_function(torch._C._nn.linear, (p.x, w, *(b or [None])))
    else:
        x, _, r, *_ = call.args[1:]
        new = graph.call_function(ops.fused_linear, (call.args[0], x, w, r, *b))
        copy_meta(new, call)
        out = graph.call_function(operator.getitem, (new, 0))
    same_meta(out, s.column_node)
    return out


# ---- graph-side runtime: the per-column frequencies, kept on the model's buffer --------

_FREQUENCIES = "_coda_rope_frequencies"  # attribute of an inv_freq tensor: its memo


def rope_frequencies(inv_freq: torch.Tensor, layout: tuple) -> torch.Tensor:
    """codegen/layouts.rope_frequencies, kept between calls where that is safe.

    Run eagerly (optimize() without Inductor) this is a dozen tiny launches per call for
    a result that changes only with the model's inv_freq buffer (measured on the H200:
    0.26 ms of host time per graph call): the result is kept on the buffer, keyed by its
    version counter and storage (kernels/versioned.py, as the opt-in weight re-layouts
    are). Under tracing Inductor fuses these ops into one kernel instead."""
    if inv_freq.requires_grad:  # a kept value would cut the graph
        return layouts.rope_frequencies(inv_freq, layout)
    # the graph reads the buffer through a fresh view each call (inv_freq[None, :, None]):
    # the value lives on the view's base, which lives as long as the model's buffer
    holder = inv_freq if inv_freq._base is None else inv_freq._base
    return versioned.kept(holder, _FREQUENCIES, [inv_freq], layout,
                          lambda: layouts.rope_frequencies(inv_freq, layout))[0]


_NORM_WEIGHT = "_coda_rope_norm_weight"  # attribute of a QK-norm weight: its memo


def rope_norm_weight(layout: tuple, offsets: tuple, like: torch.Tensor,
                     *weights: torch.Tensor | None) -> torch.Tensor:
    """codegen/layouts.rope_norm_weight, kept between calls where that is safe: run
    eagerly it is some twenty tiny ops per call (~80 µs of host time on the CPU) for a
    value that changes only with the norms' weights, so outside autograd it is kept on
    the first weight, keyed by the weights' version counters (kernels/versioned.py, as
    rope_frequencies). Where a gradient flows to the weights it is made on every call
    (autograd takes the gradient back through it)."""
    present = [w for w in weights if w is not None]
    if not present or (torch.is_grad_enabled() and any(w.requires_grad for w in present)):
        return layouts.rope_norm_weight(layout, offsets, like, *weights)
    return versioned.kept(present[0], _NORM_WEIGHT, present, (layout, offsets, like.device),
                          lambda: layouts.rope_norm_weight(layout, offsets, like,
                                                           *weights))[0]


