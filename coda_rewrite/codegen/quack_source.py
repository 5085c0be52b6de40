"""Lower an epilogue program to the source of a QuACK ``gemm_epilogue`` module.

QuACK's front end (quack/epilogue/frontend.py) turns a Python function over one
accumulator element into a fused Hopper/Blackwell GEMM; the GEMM mainloop, TMA, the
epilogue pipeline, per-tile reductions and their merge are QuACK's. This module writes
that function from a program, so a new combination of primitives is a new kernel with no
new kernel code. The program splits in two stages:

  tile stage   everything computable per element while the tile is on chip: the
               generated ``epilogue(acc, ...)`` function. Tile outputs become ``D``
               and auxiliary TileStores; a gated pair (swiglu/geglu) switches QuACK to
               mode="acc_pair" and stores the half-width result as ``postact``
               (and at most one full-width tile, the pre-activation a backward
               reads, as ``D``); a rotation (rope) is pair mode too, full width,
               with cos/sin from QuACK's float-float angle in turns
               (quack.epilogue.rotary: the math of its rope_posfreq epilogues) or
               from a cos/sin table (its rotary_cos_sin_load, staged by TMA);
               row reductions become ColVecReduce sinks
               (``scaled=True`` with the two factors when the reduced value is a
               product, so the fold is one FMA and the product is never rounded);
               a group statistic (head_rstd: a QK-norm's per-head rstd) is QuACK's
               HeadRstd, fed by a generated accumulator prepass that recomputes its
               argument from acc and vectors, its value read like an operand;
               a norm's row scale from its producer's raw partials (rstd_partials of
               a ROW_PARTIALS operand) is kernels/epi_ops.RstdOfPartials, a ColVecLoad
               that folds the partials first, its value read like an operand;
               a cast rounds a value to a 16-bit dtype and back (kernels/epi_ops
               round_bfloat16 / round_float16: what a reduction of stored values reads).
  row stage    values computed from merged reductions (``r = rsqrt(ss / d + eps)``):
               the norm's rstd is QuACK's rms_final_reduce, one kernel over the raw
               per-tile partials (norm_row_stage); any other stage is a few per-row
               torch ops on the GPU after the kernel, run by the reference interpreter
               so there is one definition of them. A reduction output of kind
               ROW_PARTIALS has no stage: the raw partials are the output.

Operands bind to QuACK by kind, always pinned with ``ops=`` (QuACK infers the kind from
shapes and cannot when M == N). Mind QuACK's names: a per-row vector is a *column*
vector there (ColVecLoad, one value per row i), a per-feature vector a *row* vector
(RowVecLoad). The first tile operand rides the GEMM's C operand; others are TileLoads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from .op_table import ELEMENTWISE_CLASS, OPS
from .program import (ACC, GROUPED, PAIRWISE, PARTIALS, REDUCTIONS, ROTARY, STATEFUL,
                      EpilogueProgram, Instr, Kind)

GENERATOR_VERSION = "4"


class Unlowerable(ValueError):
    """A program (or part of one) this generator cannot turn into a kernel."""


@dataclasses.dataclass(frozen=True)
class Binding:
    name: str          # the program's operand name
    kind: Kind
    param: str         # the generated function's parameter ("c" for the C operand)
    quack_op: str      # the pinned QuACK op (source text), or "C operand"


@dataclasses.dataclass(frozen=True)
class Reduction:
    value: str         # the program value holding the merged reduction
    sink: str          # QuACK's sink name (what the kernel call returns)
    combine: str       # "add" | "max"
    scaled: bool       # folded as fma(x, y, acc) from two factors


@dataclasses.dataclass(frozen=True)
class LayoutContract:
    """What the kernel expects of its tensors; checked before every launch."""
    program_key: str
    operands: tuple[Binding, ...]
    tile_outputs: tuple[tuple[str, str], ...]   # (program value, kernel output name)
    reductions: tuple[Reduction, ...]
    weight_permutation: str = "none"            # the re-layout b must already carry
    pair_outputs: frozenset = frozenset()        # kernel outputs half as wide (gated)
    notes: tuple[str, ...] = ()                  # operand encodings worth stating

    def render(self) -> str:
        lines = [f"layout contract of {self.program_key}",
                 "  a   [M, K]  bf16/fp16 or e4m3, K contiguous, 16-byte aligned rows",
                 "  b   [N, K]  nn.Linear layout, same dtype as a; QuACK reads it as (K, N)",
                 f"  weight permutation: {self.weight_permutation}"]
        for b in self.operands:
            shape = {Kind.TILE: "[M, N]", Kind.PER_ROW: "[M]", Kind.PER_FEATURE: "[N]",
                     Kind.SCALAR: "[]", Kind.COS_SIN: "[M, hd]",
                     Kind.ROW_PARTIALS: "[M, T]"}[b.kind]
            lines.append(f"  {b.name:<10} {shape:<7} {b.kind.value:<11} -> {b.quack_op}")
        for value, out in self.tile_outputs:
            shape = "[M, N/2]" if out in self.pair_outputs else "[M, N]"
            lines.append(f"  out {value:<6} {shape:<8} tile store '{out}'")
        lines += [f"  {n}" for n in self.notes]
        for r in self.reductions:
            how = "scaled fma" if r.scaled else r.combine
            op = {"lse": "OnlineLSEReduce", "select": "ColVecSelect"}.get(r.combine,
                                                                       "ColVecReduce")
            lines.append(f"  reduce {r.value:<3} [M]     {op} '{r.sink}' ({how}), "
                         "per-tile partials merged by QuACK")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class KernelSource:
    program: EpilogueProgram
    module_name: str
    source: str
    contract: LayoutContract
    row_stage: tuple[Instr, ...]   # the finaliser, run after the kernel
    # (sink, value, 1/d, eps) where the row stage is a norm's rstd (norm_row_stage)
    norm_stage: tuple | None = None
    # (kernel argument, int) the launch passes as they are: a group statistic's width
    constants: tuple[tuple[str, int], ...] = ()


# elementwise lowerings (QuACK expressions) and f(0) = 0, from the op table
_LOWER = {name: op.lower for name, op in OPS.items() if op.lower is not None}
# the dtypes a cast rounds to in the kernel (kernels/epi_ops.round_<dtype>)
ROUNDINGS = ("bfloat16", "float16")
_ZERO_PRESERVING = {name for name, op in OPS.items()
                    if op.zero_preserving and op.klass == ELEMENTWISE_CLASS} - {"mul", "div"}


def zero_on_padding(program: EpilogueProgram) -> dict[str, bool]:
    """Which values are provably 0 on the padding lanes of a ragged last tile.

    QuACK's add-reduce folds every lane of the tile, and a lane past N holds a zero
    accumulator and zero-filled tile loads (TMA), but a per-feature vector lane there
    is not loaded at all, and per-row values and constants are what they are. So a
    row sum is exact only if its value is 0 wherever acc and the tiles are 0, for any
    value of the rest; this is that check (a zero-lattice abstract interpretation)."""
    zero: dict[str, bool] = {ACC: True}
    for o in program.operands:
        zero[o.name] = o.kind == Kind.TILE

    def z(a) -> bool:
        return zero[a] if isinstance(a, str) else a == 0.0

    for i in program.body:
        args = [z(a) for a in i.args]
        if i.op in ("add", "sub"):
            zero[i.out] = all(args)
        elif i.op == "mul":
            zero[i.out] = any(args)
        elif i.op == "div":
            zero[i.out] = args[0]
        elif i.op in _ZERO_PRESERVING or i.op == "cast":
            zero[i.out] = args[0]
        else:  # rsqrt, exp, sigmoid, reductions
            zero[i.out] = False
    return zero


def _prepass_lines(program: EpilogueProgram, grouped: list[Instr], arg
                   ) -> list[str]:
    """The accumulator prepass of the group statistics: each statistic's argument
    recomputed from acc and vectors (the elementwise instructions it depends on, in
    program order), squared under the statistic's sink name. QuACK runs it element by
    element over the raw accumulator before any store, so it sees no pair, no rotation
    and no tile operand: a program whose statistic needs one is not lowerable."""
    defs = {i.out: i for i in program.body}
    operand_kind = {o.name: o.kind for o in program.operands}
    needed: set[str] = set()
    todo = [g.args[0] for g in grouped]
    while todo:
        v = todo.pop()
        if not isinstance(v, str) or v == ACC or v in needed:
            continue
        if v in operand_kind:
            if operand_kind[v] not in (Kind.PER_ROW, Kind.PER_FEATURE, Kind.SCALAR):
                raise Unlowerable(f"a group statistic reads the {operand_kind[v].value} "
                                  f"operand {v!r} (QuACK's prepass sees the accumulator and "
                                  "vectors only)")
            continue
        ins = defs[v]
        if ins.op not in _LOWER:
            raise Unlowerable(f"a group statistic's argument goes through {ins.op} (the "
                              "prepass runs elementwise ops only)")
        needed.add(v)
        todo.extend(ins.args)
    lines = [f"{arg(i.out)} = {_LOWER[i.op].format(*(arg(a) for a in i.args))}"
             for i in program.body if i.out in needed]
    ret = ", ".join(f'"{_group_sink(k, g)}": {arg(g.args[0])} * {arg(g.args[0])}'
                    for k, g in enumerate(grouped))
    return lines + ["return {" + ret + "}"]


def _group_sink(k: int, ins: Instr) -> str:
    return f"grp{k}_{ins.out}"


def generate(program: EpilogueProgram) -> KernelSource:
    if not program.gemm:
        raise Unlowerable("no GEMM: a row-wise program runs as plain torch ops")
    kinds = program.value_kinds()
    pair_mode = any(i.op in PAIRWISE or i.op in ROTARY for i in program.body)
    rotary = any(i.op in ROTARY for i in program.body)
    angles = any(i.op == "rope" for i in program.body)
    table = any(o.kind == Kind.COS_SIN for o in program.operands)
    if pair_mode and any(i.op in REDUCTIONS or i.op in STATEFUL for i in program.body):
        raise Unlowerable("row reductions in pair mode")
    if pair_mode and sum(o.kind == Kind.TILE for o in program.outputs) > 1:
        raise Unlowerable("pair mode stores the gated half-width output and at most one "
                          "full-width tile (as D)")
    tile_body = [i for i in program.body
                 if i.op not in REDUCTIONS and not kinds[i.out][1]]
    row_stage = tuple(i for i in program.body
                      if i.op not in REDUCTIONS and i.op not in STATEFUL and kinds[i.out][1])
    reductions_ir = [i for i in program.body if i.op in REDUCTIONS]
    grouped = [i for i in program.body if i.op in GROUPED]

    # operands
    bindings, first_tile = [], True
    for o in program.operands:
        if o.kind == Kind.TILE and first_tile:
            bindings.append(Binding(o.name, o.kind, "c", "C operand"))
            first_tile = False
            continue
        op = {Kind.TILE: "TileLoad", Kind.PER_ROW: "ColVecLoad",
              Kind.PER_FEATURE: "RowVecLoad", Kind.SCALAR: "Scalar",
              Kind.COS_SIN: "rotary_cos_sin_load",
              Kind.ROW_PARTIALS: "RstdOfPartials"}[o.kind]
        param = f"o_{o.name}"  # prefixed: no clash with imports or the C operand
        pin = f'{op}("{param}")'
        if o.kind == Kind.ROW_PARTIALS:  # the op folds them: 1/d and eps are its own
            pin = _rstd_of_partials_pin(program, o.name, param)
        bindings.append(Binding(o.name, o.kind, param, pin))
    names = {b.name: b.param for b in bindings}

    def _arg(a) -> str:
        if not isinstance(a, str):
            return repr(float(a))
        return "acc" if a == ACC else names.get(a, f"v_{a}")

    # reductions: sinks, folding a product into a scaled reduce
    uses: dict[str, int] = {}
    for i in program.body:
        for a in i.args:
            if isinstance(a, str):
                uses[a] = uses.get(a, 0) + 1
    for o in program.outputs:
        uses[o.value] = uses.get(o.value, 0) + 1
    defs = {i.out: i for i in program.body}
    reductions, sink_values, folded = [], {}, set()
    padding_zero = zero_on_padding(program)
    for i, r in enumerate(reductions_ir):
        (x,) = r.args
        sink = f"red{i}_{r.out}"
        combine = REDUCTIONS[r.op]
        if combine == "sum" and not padding_zero[x]:
            raise Unlowerable(
                f"row_sum of {x!r}, which is not 0 on the padding of a ragged tile (it "
                "reads a per-feature vector, a per-row value or a constant outside a "
                "product with the accumulator): the kernel's sum would count the padding")
        src = defs.get(x)
        if combine == "sum" and src is not None and uses.get(x) == 1 \
                and src.op in ("square", "mul"):
            factors = (src.args[0], src.args[0]) if src.op == "square" else src.args
            sink_values[sink] = f"({_arg(factors[0])}, {_arg(factors[1])})"
            folded.add(x)
            reductions.append(Reduction(r.out, sink, "add", True))
        else:
            sink_values[sink] = _arg(x)
            reductions.append(Reduction(r.out, sink, "add" if combine == "sum" else "max",
                                        False))

    # stateful sinks: online log-sum-exp, and a per-row column select whose index rides a
    # companion ColVecLoad the function never sees
    stateful, companions = [], []
    for i, r in enumerate(x for x in program.body if x.op in STATEFUL):
        if r.op == "row_logsumexp":
            sink = f"lse{i}_{r.out}"
            stateful.append(f'"{sink}": OnlineLSEReduce("{sink}")')
        else:
            sink = f"sel{i}_{r.out}"
            idx = names[r.args[1]]
            companions.append(idx)
            stateful.append(f'"{sink}": ColVecSelect("{sink}", idx_op=_index_{idx})')
        sink_values[sink] = _arg(r.args[0])
        reductions.append(Reduction(r.out, sink, "lse" if r.op == "row_logsumexp"
                                    else "select", False))

    # group statistics: QuACK's HeadRstd per (row, group), whose value port the function
    # reads like an operand (a dense multiplier over the group's columns)
    group_sinks = {g.out: _group_sink(k, g) for k, g in enumerate(grouped)}
    prepass = _prepass_lines(program, grouped, _arg) if grouped else []

    # tile outputs: the first is D, the others auxiliary TileStores
    tile_outputs, returned, d_pairs = [], [], []
    for k, o in enumerate(o for o in program.outputs if o.kind == Kind.TILE):
        tile_outputs.append((o.value, "D" if k == 0 else f"out{k}_{o.value}"))
        if pair_mode:  # values arrive as (gate, up) lane pairs: D stores both lanes
            lo, hi = f"{_arg(o.value)}_lo", f"{_arg(o.value)}_hi"
            d_pairs.append(f"{lo}, {hi} = unpack({_arg(o.value)})")
            returned.append(f"pack({lo}, {hi})")
        else:
            returned.append(_arg(o.value))
    pairs = [o for o in program.outputs if o.kind == Kind.PAIR]
    if len(pairs) > 1:
        raise Unlowerable("more than one gated output")
    for o in pairs:  # QuACK's half-width auxiliary store in pair mode
        tile_outputs.append((o.value, "postact"))
        returned.append(_arg(o.value))

    # the function body
    lines = []
    for i in tile_body:
        if i.out in folded:
            continue
        args = [_arg(a) for a in i.args]
        if i.op in PAIRWISE:  # the accumulator arrives as (gate, up) pairs
            g, u = f"{_arg(i.out)}_gate", f"{_arg(i.out)}_up"
            lines.append(f"{g}, {u} = unpack({args[0]})")
            op = OPS[i.op]
            rhs = op.pair_lower.format(*args[1:], g=g, u=u) if op.pair_lower else \
                f"{_LOWER[op.gate_activation].format(g)} * {u}"
        elif i.op in ROTARY:  # (x1, x2) pairs rotated by θ = pos·f turns, or by a table
            o = _arg(i.out)
            lines.append(f"{o}_x1, {o}_x2 = unpack({args[0]})")
            if i.op == "rope_table":
                lines.append(f"{o}_cos, {o}_sin = unpack({args[1]})")
                if len(args) == 3:  # 1: rotate; 0: pass through (cos 1, sin 0), exactly
                    lines.append(f"{o}_on, _ = unpack({args[2]})")
                    lines.append(f"{o}_cos = {o}_on * {o}_cos + (1.0 - {o}_on)")
                    lines.append(f"{o}_sin = {o}_on * {o}_sin")
            else:
                lines.append(f"{o}_sin, {o}_cos = _sincos_turns(*_angle_turns({args[1]}, "
                             f"{args[2]}))")
            rhs = (f"pack({o}_x1 * {o}_cos - {o}_x2 * {o}_sin, "
                   f"{o}_x1 * {o}_sin + {o}_x2 * {o}_cos)")
        elif i.op in GROUPED:
            rhs = group_sinks[i.out]
        elif i.op in PARTIALS:  # RstdOfPartials' value port is r itself
            rhs = _arg(i.args[0])
        elif i.op == "cast":  # rounded to a 16-bit dtype and back (kernels/epi_ops.py)
            if i.dtype not in ROUNDINGS:
                raise Unlowerable(f"a cast to {i.dtype} (the kernel rounds to "
                                  f"{' or '.join(ROUNDINGS)} only)")
            rhs = f"round_{i.dtype}({args[0]})"
        elif i.op in _LOWER:
            rhs = _LOWER[i.op].format(*args)
        else:
            raise Unlowerable(f"{i.op} has no kernel lowering yet")
        lines.append(f"{_arg(i.out)} = {rhs}")
    lines += d_pairs
    ret = [f'"{name}": {value}' for (_, name), value in zip(tile_outputs, returned)]
    ret += [f'"{s}": {v}' for s, v in sink_values.items()]
    lines.append("return {" + ", ".join(ret) + "}")

    body_src = "\n".join(lines)
    roundings = sorted({f"round_{i.dtype}" for i in tile_body if i.op == "cast"})
    prepass_src = "\n".join(prepass)
    params = ["acc"] + [b.param for b in bindings if _used(b.param, body_src + prepass_src)
                        and b.name not in program.index_operands] + list(group_sinks.values())
    prepass_params = ["acc"] + [p for p in params[1:] if _used(p, prepass_src)
                                and p not in group_sinks.values()]
    pins = [f'"{b.param}": {b.quack_op}' for b in bindings
            if b.param != "c" and b.param in params]
    pins += [f'"{sink}": _{sink}' for sink in group_sinks.values()]
    aux = [name for _, name in tile_outputs if name != "D"]
    reduces = [f'"{r.sink}": ColVecReduce("{r.sink}"'
               + (", scaled=True" if r.scaled else "")
               + (', combine="max"' if r.combine == "max" else "") + ")"
               for r in reductions if r.combine in ("add", "max")]
    decorator = ["@gemm_epilogue("]
    if aux:
        decorator.append(f"    outputs=({', '.join(repr(a) for a in aux)},),")
    if pins:
        decorator.append(f"    ops={{{', '.join(pins)}}},")
    if reduces:
        decorator.append(f"    reduces={{{', '.join(reduces)}}},")
    if stateful:
        decorator.append(f"    outs={{{', '.join(stateful)}}},")
    if companions:
        decorator.append(f"    extra_ops=({', '.join(f'_index_{c}' for c in companions)},),")
    if grouped:
        decorator.append("    prepass=prepass,")
        outs = "".join(repr(s) + ", " for s in group_sinks.values())
        decorator.append(f"    prepass_outs=({outs}),")
    if pair_mode:
        decorator.append('    mode="acc_pair",')
    decorator.append(")")
    # The module holds the tile stage only: programs that differ only in their row
    # stage (another eps) share one kernel, named by the digest of its source.
    source = "\n".join([
        f'"""Generated by coda_rewrite (generator v{GENERATOR_VERSION}): the tile stage of',
        f"{program.name} programs. Do not edit; coda_rewrite rewrites it from the program.",
        "",
        *ks_contract_lines([b for b in bindings if b.param in params or b.param in companions],
                           tile_outputs, reductions),
        '"""',
        "",
        "import cutlass.cute as cute",
        "from quack.activation import gelu_erf, gelu_tanh_approx, relu, relu_sq, sigmoid, silu",
        "from quack.epilogue.frontend import gemm_epilogue",
        "from quack.epilogue.math import pack, pexp, unpack",
        "from quack.epilogue.ops import (ColVecLoad, ColVecReduce, ColVecSelect, OnlineLSEReduce,",
        "                                RowVecLoad, Scalar, TileLoad)",
        # QuACK's float-float angle in turns and its MUFU sin/cos (private helpers of
        # the rope_posfreq epilogues; quack-kernels is pinned, and CI compiles this)
        *(["from quack.epilogue.rotary import _angle_turns, _sincos_turns"] if angles else []),
        *(["from quack.epilogue.rotary import rotary_cos_sin_load"] if table else []),
        *(["from coda_rewrite.kernels.epi_ops import RstdOfPartials"]
          if any(o.kind == Kind.ROW_PARTIALS for o in program.operands) else []),
        *([f"from coda_rewrite.kernels.epi_ops import {', '.join(roundings)}"]
          if roundings else []),
        "",
        *(["from quack.activation import tanh as tanh_approx", ""]
          if any(i.op == "tanh" for i in program.body) else []),
        *(["from quack.activation import swiglu_oai", ""]
          if any(i.op == "swiglu_oai" for i in program.body) else []),
        # the clamps of QuACK's swiglu_oai (private helpers; quack-kernels is pinned, and
        # CI compiles this)
        *(["from quack.activation import _maxnumf, _minnumf", ""]
          if any(i.op == "swiglu_clamp" for i in program.body) else []),
        *(f'_index_{c} = ColVecLoad("{c}")' for c in companions),
        *([""] if companions else []),
        *(["from quack.epilogue.head_rmsnorm import HeadRstd", ""] if grouped else []),
        *(f'_{group_sinks[g.out]} = HeadRstd("{group_sinks[g.out]}", eps={float(g.args[2])!r})'
          for g in grouped),
        *([""] if grouped else []),
        *([f"def prepass({', '.join(prepass_params)}):",
           *("    " + ln for ln in prepass), ""] if grouped else []),
        "",
        *decorator,
        f"def epilogue({', '.join(params)}):",
        *("    " + ln for ln in body_src.splitlines()),
        "",
    ])
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    bindings = [dataclasses.replace(b, quack_op="ColVecLoad (index of a ColVecSelect)")
                if b.param in companions else b for b in bindings]
    contract = LayoutContract(
        program.key, tuple(bindings), tuple(tile_outputs), tuple(reductions),
        weight_permutation=(
            "rows (2j, 2j+1) of b are one rotation pair (a half-split model's heads are "
            "permuted so); cos/sin from a [M, head_dim] table repeating every head_dim "
            "columns" if table else
            "rows (2j, 2j+1) of b are one rotation pair (per head: [x0, x_h, x1, x_h+1, "
            "...], h = rotary_dim/2); zero-frequency columns pass through" if rotary else
            "rows of b interleave gate and up: [g0, u0, g1, u1, ...]" if pair_mode
            else "none"),
        pair_outputs=frozenset({"postact"} if pairs else ()),
        notes=tuple(
            f"{i.args[1]}, {i.args[2]}: float32; positions, and each pair's frequency in turns "
            f"per position as a float-float split (f_j = {i.args[2]}[2j] + {i.args[2]}[2j+1]; "
            "0 passes the pair through)" if i.op == "rope" else
            f"{i.args[1]}: float32 [M, head_dim], (cos, sin) of pair p at (2p, 2p+1); head_dim "
            "must divide tile_n or be a multiple of it"
            + (f"; {i.args[2]}: float32 [N], 1 on rotated columns, 0 on pass-through ones"
               if len(i.args) == 3 else "") for i in program.body if i.op in ROTARY) + tuple(
            f"{i.out}: rsqrt(mean({i.args[0]}²) + {float(i.args[2]):g}) per row and group of "
            f"{int(i.args[1])} columns (QuACK's HeadRstd '{group_sinks[i.out]}', from the "
            f"accumulator prepass); {int(i.args[1])} must divide the tile width and N"
            for i in grouped) + tuple(
            f"out {o.value:<6} [M, T]   row partials: reduce '{sink}''s per-tile partials "
            "as the kernel leaves them, unmerged (T = N-tiles; the reader folds them)"
            for o in program.outputs if o.kind == Kind.ROW_PARTIALS
            for r in reductions if r.value == o.value for sink in [r.sink]))
    return KernelSource(program, f"coda_epi_{program.name}_{digest}", source, contract,
                        row_stage, norm_row_stage(row_stage, reductions, program.outputs),
                        tuple((group_sinks[g.out], int(g.args[1])) for g in grouped))


def _rstd_of_partials_pin(program: EpilogueProgram, name: str, param: str) -> str:
    """The RstdOfPartials op of a ROW_PARTIALS operand: the one rstd_partials reading it
    gives 1/d and eps (two readers with other constants would need two ops)."""
    reads = {(float(i.args[1]), float(i.args[2])) for i in program.body
             if i.op in PARTIALS and i.args[0] == name}
    if len(reads) != 1:
        raise Unlowerable(f"row partials {name!r} are read by {len(reads)} different "
                          "rstd_partials (one is lowerable)")
    ((d, eps),) = reads
    return f'RstdOfPartials("{param}", inv_d={1.0 / d!r}, eps={eps!r})'


def norm_row_stage(stage, reductions, outputs) -> tuple | None:
    """(sink, value, 1/d, eps) where the row stage is exactly a norm's rstd,
    ``r = rsqrt(ss / d + eps)`` of one row sum ss with constant d and eps, and r is the
    only per-row output: QuACK's ``rms_final_reduce`` (the second kernel of its gemm_rms)
    computes it from the raw per-tile partials in one launch. None for any other stage.

    Numerics: the partials are summed in float32 in a fixed order, and the rsqrt is the
    fast-math one (about 1 ulp of float32): both far inside a bf16 rounding of r·h."""
    reds = {r.value: r for r in reductions}
    if [i.op for i in stage] != ["div", "add", "rsqrt"]:
        return None
    div, add, rsqrt = stage
    ss, d = div.args
    red = reds.get(ss)
    if red is None or red.combine != "add" or isinstance(d, str) or float(d) <= 0:
        return None
    others = [x for x in add.args if x != div.out]
    if len(add.args) != 2 or len(others) != 1 or isinstance(others[0], str) or \
            rsqrt.args != (add.out,):
        return None
    if any(o.kind == Kind.PER_ROW and o.value != rsqrt.out for o in outputs):
        return None  # another per-row value needs the generic row stage
    return red.sink, rsqrt.out, 1.0 / float(d), float(others[0])


def ks_contract_lines(bindings, tile_outputs, reductions) -> list[str]:
    """The kernel's side of the contract, for the module docstring."""
    lines = ["acc[i, j] = sum_k a[i, k] * b[j, k]   (a [M, K], b [N, K], bf16/fp16)"]
    lines += [f"{b.param}: {b.kind.value} operand {b.name!r} ({b.quack_op})" for b in bindings]
    lines += [f"store {name}: tile value {value!r}" for value, name in tile_outputs]
    lines += [f"reduce {r.sink}: per-row {'sum of products' if r.scaled else r.combine} "
              f"-> {r.value!r}" for r in reductions]
    return lines


def _used(name: str, src: str) -> bool:
    return re.search(rf"\b{name}\b", src) is not None
