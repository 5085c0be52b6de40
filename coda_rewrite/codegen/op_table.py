"""The epilogue IR's op table: everything the pass knows about an op, in one place.

Per op: its class (what it does to the tile: elementwise, a pair of adjacent columns, a
rotation of column pairs, a stateful row reduction, a row reduction), its arity, its
reference semantics in torch (what codegen/reference.py runs and the witnesses replay),
its QuACK lowering where it is a plain expression (pairs, rotations and reductions are
lowered by class in codegen/quack_source.py), whether f(0) = 0 (the padding analysis of
a ragged tile), and its derivative. The derivative of every op is autograd's through the
reference (the general backward rule); the families' hand-derived rules
(kernels/backward/) only combine these, and are checked against it in the tests.

The kind rule of each class (which value kinds an op reads and what it makes) is
``kind_of`` below; EpilogueProgram.value_kinds runs it over a program.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable

import torch
import torch.nn.functional as F


class Kind(str, enum.Enum):
    TILE = "tile"
    PER_ROW = "per_row"
    PER_FEATURE = "per_feature"
    SCALAR = "scalar"
    PAIR = "pair"
    COS_SIN = "cos_sin"
    ROW_PARTIALS = "row_partials"


ACC = "acc"  # the accumulator's reserved value name

ELEMENTWISE_CLASS, PAIRWISE_CLASS, ROTARY_CLASS, STATEFUL_CLASS, REDUCTION_CLASS = (
    "elementwise", "pairwise", "rotary", "stateful", "reduction")
GROUPED_CLASS = "grouped"  # a statistic over groups of adjacent columns, inside a tile
PARTIALS_CLASS = "partials"  # a per-row value from another GEMM's unmerged row partials


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    klass: str
    arity: tuple[int, ...]
    # reference(args, ins, compute dtype) -> tensor; args are tensors or numbers
    reference: Callable
    lower: str | None = None       # QuACK expression, "{}" per argument (elementwise ops)
    zero_preserving: bool = False  # f(0, ...) = 0 for a zero first argument
    gate_activation: str | None = None   # pairwise: act(gate)·up with this activation
    # pairwise, any other pair function: (gate, up, *literal args) -> tensor, and its
    # QuACK call ("{g}", "{u}" the lanes, "{0}"... the literal args)
    pair_reference: Callable | None = None
    pair_lower: str | None = None
    combine: str | None = None     # reduction: how per-tile partials merge


# ---- reference semantics of the rotations ----------------------------------------------

def rotate_pairs(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """``rope``: rotate each adjacent column pair (2j, 2j+1) of x [M, N] by
    θ = pos[i]·f_j turns, f_j = freq[2j] + freq[2j+1] (pos [M, 1], freq [1, N]). The
    angle is formed and reduced mod 1 in float64 (as exact as the kernel's float-float
    angle, at any position below 2^24); cos and sin of the reduced angle are taken in
    x's dtype (float32: the kernel's MUFU accuracy; float64 for float64 models).
    Differentiable in x (the backward of a rotation is the rotation by −θ: pass −freq)."""
    f = freq[..., 0::2].double() + freq[..., 1::2].double()
    theta = (torch.remainder(pos.double() * f, 1.0) * (2 * math.pi)).to(x.dtype)
    c, s = torch.cos(theta), torch.sin(theta)
    x1, x2 = x[:, 0::2], x[:, 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def rotate_pairs_by_table(x: torch.Tensor, cs: torch.Tensor,
                          rot: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_table``: rotate each adjacent column pair of x [M, N] by the angle whose
    (cos, sin) row i of the table [M, head_dim] holds at (2p, 2p+1), p = (j mod
    head_dim) / 2: the table repeats every head_dim columns. With ``rot`` ([1, N], 0 or
    1 per column) only where it is 1: (cos, sin) = (1, 0) elsewhere, exactly."""
    reps = x.shape[1] // cs.shape[1]
    c, s = cs[:, 0::2].to(x.dtype).repeat(1, reps), cs[:, 1::2].to(x.dtype).repeat(1, reps)
    if rot is not None:
        on = rot.reshape(1, -1)[:, 0::2].to(x.dtype)
        c, s = on * c + (1 - on), on * s
    x1, x2 = x[:, 0::2], x[:, 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, alpha, limit) -> torch.Tensor:
    """gpt-oss's gated activation of a (gate, up) pair: the gate clamped above and the up
    lane on both sides at ``limit``, then g·sigmoid(α·g)·(u + 1) (its SwiGLU with a
    sharper sigmoid and a shifted up lane). NaN passes through the clamps, as
    torch.clamp's does; the clamps' derivative is autograd's (1 inside, boundary
    included, 0 outside)."""
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(g * alpha) * (u + 1)


def swiglu_clamp(g: torch.Tensor, u: torch.Tensor, limit) -> torch.Tensor:
    """DeepSeek-V4's and Hunyuan-V4's gated activation of a (gate, up) pair: SwiGLU of the
    gate clamped above and the up lane clamped on both sides at ``limit``,
    silu(min(g, l))·clamp(u, −l, l). NaN passes through the clamps, as torch.clamp's
    does; the clamps' derivative is autograd's (1 inside, boundary included, 0 outside)."""
    return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)


def pair_value(op: "Op", g: torch.Tensor, u: torch.Tensor, *args) -> torch.Tensor:
    """A pairwise op's value on separate gate and up lanes."""
    if op.pair_reference is not None:
        return op.pair_reference(g, u, *args)
    return OPS[op.gate_activation].reference([g], None, g.dtype) * u


def _pairwise(gate_activation=None, pair_reference=None, pair_lower=None, literals=0):
    return dict(klass=PAIRWISE_CLASS, arity=(1 + literals,), gate_activation=gate_activation,
                pair_reference=pair_reference, pair_lower=pair_lower,
                reference=lambda a, ins, cd: pair_value(OPS[ins.op], a[0][:, 0::2],
                                                        a[0][:, 1::2], *a[1:]))


def head_rstd(x: torch.Tensor, width, eps) -> torch.Tensor:
    """``head_rstd(x, w, eps)``: rsqrt(mean(x², over each group of w adjacent columns) +
    eps), broadcast back over the group's columns (x [M, N], N a multiple of w): the
    per-head RMSNorm statistic of a QK-norm, heads being groups of head_dim columns."""
    m, n = x.shape
    w = int(width)
    groups = x.reshape(m, n // w, w)
    r = torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)
    return r.expand(m, n // w, w).reshape(m, n)


def rstd_of_partials(partials: torch.Tensor, d, eps) -> torch.Tensor:
    """``rstd_partials(P, d, eps)``: rsqrt(Σ_t P[i, t] / d + eps) per row, P [M, T] the
    per-tile partials of a row sum (any T: the kernel's tiles, or one column). A norm's
    row scale r, read by the GEMM that applies it from its producer's raw partials."""
    return torch.rsqrt(partials.sum(dim=1, keepdim=True) / d + eps)


def _select_column(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[i, idx[i]], 0 where the index is outside the row (an ignored target)."""
    idx = idx.long()
    ok = (idx >= 0) & (idx < x.shape[1])
    return torch.where(ok, x.gather(1, idx.clamp(0, x.shape[1] - 1)),
                       torch.zeros((), dtype=x.dtype, device=x.device))


STORAGE_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}


def _unary(fn, lower, zero=False):
    return dict(klass=ELEMENTWISE_CLASS, arity=(1,),
                reference=lambda a, ins, cd: fn(a[0]), lower=lower, zero_preserving=zero)


def _binary(fn, symbol, zero=False):
    return dict(klass=ELEMENTWISE_CLASS, arity=(2,),
                reference=lambda a, ins, cd: fn(*a), lower="{} " + symbol + " {}",
                zero_preserving=zero)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


_SPECS = {
    # elementwise, in the compute dtype (float32; float64 when an input is float64)
    "add": _binary(torch.add, "+"),
    "sub": _binary(torch.sub, "-"),
    "mul": _binary(torch.mul, "*", zero=True),
    "div": _binary(torch.div, "/", zero=True),
    "neg": _unary(torch.neg, "(-{})", zero=True),
    "square": _unary(torch.square, "({0} * {0})", zero=True),
    "rsqrt": _unary(torch.rsqrt, "cute.math.rsqrt({})"),
    "sqrt": _unary(torch.sqrt, "cute.math.sqrt({})", zero=True),
    "exp": _unary(torch.exp, "pexp({})"),
    "silu": _unary(F.silu, "silu({})", zero=True),
    "relu": _unary(F.relu, "relu({})", zero=True),
    "relu_sq": _unary(lambda x: F.relu(x).square(), "relu_sq({})", zero=True),
    "sigmoid": _unary(torch.sigmoid, "sigmoid({})"),
    # logit soft-capping, c·tanh(y / c). Kernels: MUFU tanh.approx.f32 (relative error
    # ~2^-11, below one rounding of the 16-bit logits they write; an exact tanh made the
    # 8B LM head's epilogue compute-bound: 22.0 ms against 14.3 for torch.compile)
    "tanh": _unary(torch.tanh, "tanh_approx({})", zero=True),
    "gelu_tanh": _unary(_gelu_tanh, "gelu_tanh_approx({})", zero=True),
    "gelu_erf": _unary(F.gelu, "gelu_erf({})", zero=True),
    # rounds to a 16-bit storage dtype and back, as a 16-bit GEMM's tile store rounds
    # (the cross-entropy's lse reads the logits as stored): in float32, the kernels'
    # accumulator and the reference's for 16-bit operands. Evaluated in float64 (the
    # witness's replay, whose GEMM keeps every bit and so has no store to round) it is the
    # identity, as the store it stands for is there. Kernels: kernels/epi_ops.round_*.
    "cast": dict(klass=ELEMENTWISE_CLASS, arity=(1,), zero_preserving=True,
                 reference=lambda a, ins, cd: a[0] if cd == torch.float64 else
                 a[0].to(STORAGE_DTYPES[ins.dtype]).to(cd)),
    # gated pairs over interleaved columns: act(gate at 2j) · up at 2j + 1, half width
    "swiglu": _pairwise("silu"),
    "geglu": _pairwise("gelu_tanh"),
    "geglu_erf": _pairwise("gelu_erf"),
    # swiglu_oai(x, alpha, limit): gpt-oss's clamped SwiGLU (literal alpha and limit);
    # QuACK's own swiglu_oai (its clamps propagate NaN like torch.clamp)
    "swiglu_oai": _pairwise(pair_reference=swiglu_oai, literals=2,
                            pair_lower="swiglu_oai({g}, {u}, {0}, {1})"),
    # swiglu_clamp(x, limit): DeepSeek-V4's clamped SwiGLU (literal limit); the clamps are
    # QuACK's swiglu_oai's (NaN through them like torch.clamp), then its SiLU
    "swiglu_clamp": _pairwise(pair_reference=swiglu_clamp, literals=1,
                              pair_lower="silu(_minnumf({g}, {0})) * "
                                         "_maxnumf(_minnumf({u}, {0}), -{0})"),
    # rotations of adjacent column pairs: rope(x, per-row positions, per-feature
    # float-float frequencies in turns); rope_table(x, cos/sin table [, per-feature 0/1
    # rotate flag])
    "rope": dict(klass=ROTARY_CLASS, arity=(3,),
                 reference=lambda a, ins, cd: rotate_pairs(*a)),
    "rope_table": dict(klass=ROTARY_CLASS, arity=(2, 3),
                       reference=lambda a, ins, cd: rotate_pairs_by_table(*a)),
    # a statistic per row and group of w adjacent columns, broadcast over the group:
    # head_rstd(x, w, eps) (literal w and eps). Tile-local where a tile holds whole
    # groups (the layout contract: w divides the tile width and N); QuACK's HeadRstd,
    # its sum of squares folded in the accumulator prepass, deterministically
    "head_rstd": dict(klass=GROUPED_CLASS, arity=(3,),
                      reference=lambda a, ins, cd: head_rstd(*a)),
    # a norm's row scale from a ROW_PARTIALS operand: rstd_partials(P, d, eps) (literal
    # d and eps); QuACK's ColVecLoad with the fold in front (kernels/epi_ops.py)
    "rstd_partials": dict(klass=PARTIALS_CLASS, arity=(3,),
                          reference=lambda a, ins, cd: rstd_of_partials(*a)),
    # stateful row reductions (online across tiles)
    "row_logsumexp": dict(klass=STATEFUL_CLASS, arity=(1,),
                          reference=lambda a, ins, cd: torch.logsumexp(a[0], 1, keepdim=True)),
    "select_column": dict(klass=STATEFUL_CLASS, arity=(2,),
                          reference=lambda a, ins, cd: _select_column(*a)),
    # row reductions over the feature dim; per-tile partials merge with the same op
    "row_sum": dict(klass=REDUCTION_CLASS, arity=(1,), combine="sum",
                    reference=lambda a, ins, cd: a[0].sum(dim=1, keepdim=True)),
    "row_max": dict(klass=REDUCTION_CLASS, arity=(1,), combine="max",
                    reference=lambda a, ins, cd: a[0].amax(dim=1, keepdim=True)),
}

OPS: dict[str, Op] = {name: Op(name, **spec) for name, spec in _SPECS.items()}


def of_class(klass: str) -> dict[str, Op]:
    return {name: op for name, op in OPS.items() if op.klass == klass}


# ---- kind rules ----------------------------------------------------------------------------

class ProgramError(ValueError):
    """A program that breaks the IR's rules (unknown value, non-local read, ...)."""


def _join(kinds: list[Kind]) -> Kind:
    """The kind of an elementwise result: what its arguments vary along, together."""
    s = set(kinds) - {Kind.SCALAR}
    if not s:
        return Kind.SCALAR
    if Kind.PAIR in s:
        if s - {Kind.PAIR, Kind.PER_ROW}:
            raise ProgramError("a pair value (half width) meets a full-width tile or "
                               "per-feature value")
        return Kind.PAIR
    if Kind.TILE in s or s == {Kind.PER_ROW, Kind.PER_FEATURE}:
        return Kind.TILE
    return s.pop()


def kind_of(program, ins, kinds: list[tuple[Kind, bool]]) -> tuple[Kind, bool]:
    """(kind, final) of ``ins``'s result from its arguments' (kind, final), or a
    ProgramError naming what the op cannot read. final: depends on a whole-row reduction."""
    name = program.name
    op = OPS.get(ins.op)
    if op is None:
        raise ProgramError(f"{name}: unknown op {ins.op!r}")
    if len(ins.args) not in op.arity:
        raise ProgramError(f"{name}: {ins.op} takes {' or '.join(map(str, op.arity))} args")
    if any(k == Kind.COS_SIN for k, _ in kinds) and ins.op != "rope_table":
        raise ProgramError(f"{name}: a cos_sin table is read by rope_table only")
    if any(k == Kind.ROW_PARTIALS for k, _ in kinds) != (op.klass == PARTIALS_CLASS):
        raise ProgramError(f"{name}: row partials are read by rstd_partials only, and it "
                           "reads nothing else")
    operand_kind = {o.name: o.kind for o in program.operands}
    if op.klass == PARTIALS_CLASS:
        d, eps = ins.args[1:]
        if operand_kind.get(ins.args[0]) != Kind.ROW_PARTIALS or isinstance(d, str) or \
                isinstance(eps, str) or not d > 0 or not eps >= 0:
            raise ProgramError(f"{name}: {ins.op} reads a row_partials operand with a "
                               "literal d > 0 and eps >= 0")
        # the whole row's partials are an operand: known before the tile, not final
        return Kind.PER_ROW, False
    if op.klass == ELEMENTWISE_CLASS:
        if ins.op == "cast" and not ins.dtype:
            raise ProgramError(f"{name}: cast needs a dtype")
        return _join([k for k, _ in kinds]), any(f for _, f in kinds)
    k, final = kinds[0]
    if op.klass == PAIRWISE_CLASS:
        if k != Kind.TILE or final:
            raise ProgramError(f"{name}: {ins.op} pairs up the columns of a tile")
        if any(isinstance(a, str) or not math.isfinite(a) for a in ins.args[1:]):
            raise ProgramError(f"{name}: {ins.op} takes finite literal parameters")
        return Kind.PAIR, False
    if op.klass == GROUPED_CLASS:
        if k != Kind.TILE or final:
            raise ProgramError(f"{name}: {ins.op} reads the columns of a tile")
        w, eps = ins.args[1:]
        if isinstance(w, str) or isinstance(eps, str) or float(w) != int(w) or w < 1 \
                or not eps >= 0:
            raise ProgramError(f"{name}: {ins.op} takes a literal group width and eps")
        return Kind.TILE, False
    if op.klass == ROTARY_CLASS:
        if k != Kind.TILE or final:
            raise ProgramError(f"{name}: {ins.op} rotates column pairs of a tile")
        if ins.op == "rope_table" and (operand_kind.get(ins.args[1]) != Kind.COS_SIN or any(
                operand_kind.get(a) != Kind.PER_FEATURE for a in ins.args[2:])):
            raise ProgramError(f"{name}: rope_table reads a cos_sin operand (and a "
                               "per-feature rotate-or-not operand)")
        if ins.op == "rope" and (operand_kind.get(ins.args[1]) != Kind.PER_ROW or
                                 operand_kind.get(ins.args[2]) != Kind.PER_FEATURE):
            raise ProgramError(f"{name}: {ins.op} reads its positions from a per-row "
                               "operand and its frequencies from a per-feature operand")
        return Kind.TILE, False
    if k != Kind.TILE or final:  # stateful and plain row reductions
        raise ProgramError(f"{name}: {ins.op} reduces a tile value")
    if ins.op == "select_column" and operand_kind.get(ins.args[1]) != Kind.PER_ROW:
        raise ProgramError(f"{name}: select_column's index must be a per-row operand")
    return Kind.PER_ROW, True
