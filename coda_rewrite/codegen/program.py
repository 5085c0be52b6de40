"""The epilogue-program IR: the one vocabulary that patterns, algebra, codegen and the
reference implementation share.

A program says what happens to a GEMM's output tile while it is still on chip: the
accumulator ``acc[i, j] = sum_k a[i, k] * b[j, k]`` (``b`` in nn.Linear's [N, K] layout)
flows through a short straight-line body and leaves as tile stores and per-row values.
A program without a GEMM reads its tile from memory instead (a norm whose input is a
graph input has no producing GEMM to ride on).

Why data and not code: four readers consume the same program. The pattern that built it,
the algebra that checks it (tile locality, reduction decomposition), the code generator
that turns it into a QuACK ``gemm_epilogue`` function, and the reference interpreter that
runs it in plain torch on any device. A new combination of primitives is a new program,
never new kernel code.

Value kinds (what a value varies along; they broadcast like [M, N], [M, 1], [1, N], []):

    TILE         one value per output element            acc, a residual tile
    PER_ROW      one value per row i (QuACK: ColVec)      the deferred rstd r[i]
    PER_FEATURE  one value per output feature j (RowVec)  gamma[j], a bias
    SCALAR       one value                                 eps, 1/d
    PAIR         one value per row and feature *pair*      silu(acc[i,2j])·acc[i,2j+1]
                 (2j, 2j+1): a tile half as wide
    COS_SIN      per row i, a table of head_dim columns     a precomputed RoPE table
                 read at column j mod head_dim: (cos, sin)
                 of pair p at (2p, 2p+1); only ``rope_table``
                 reads it
    ROW_PARTIALS per row i, the unmerged per-tile partials   a norm producer's sum of
                 P[i, t] of a row sum ([M, T] float32, any    squares, handed on
                 T): an output of a ``row_sum`` value, an
                 operand only ``rstd_partials`` reads

The primitive classes of DESIGN.md, and where each lives here:

    1 elementwise map       body ops in ``ELEMENTWISE`` (add, mul, rsqrt, silu, cast, ...)
    3 vector load           operands of kind PER_ROW / PER_FEATURE
    4 tile load / store     operands of kind TILE / outputs of kind TILE
    5 tile reduction        ``row_sum`` / ``row_max``: per-tile partials merged by an
                            associative, commutative merge with identity; values computed
                            from a reduction are *final* (known only after every tile of
                            the row is done), so they may feed per-row outputs only
    2 pairwise map          ``swiglu`` / ``geglu`` / ``geglu_erf`` read the adjacent pair (x[i, 2j],
                            x[i, 2j+1]) of interleaved gate/up columns and yield
                            act(gate)·up at [i, j] (a PAIR value, half as wide; QuACK's
                            mode="acc_pair"). Tile-local: a pair never straddles a tile.
                            ``rope(x, pos, freq)`` rotates each adjacent pair by the
                            angle θ = pos[i]·f_j (full width, a TILE value):
                              out[i, 2j]   = x[i, 2j]·cos θ − x[i, 2j+1]·sin θ
                              out[i, 2j+1] = x[i, 2j]·sin θ + x[i, 2j+1]·cos θ
                            with ``pos`` a per-row operand (positions, float32) and
                            ``freq`` a per-feature operand holding each pair's frequency
                            in turns per position as a float-float split:
                            f_j = freq[2j] + freq[2j+1] (QuACK's rope_posfreq encoding;
                            the angle is formed in float-float and reduced exactly
                            mod 1). f_j = 0 is an exact identity: columns that are not
                            rotated (v of a packed q/k/v GEMM) pass through.
                            ``rope_table(x, cs)`` is the same rotation with cos/sin read
                            from a COS_SIN operand (a precomputed table: TorchTitan's
                            freqs_cis). ``rope_table(x, cs, rot)`` rotates only where the
                            per-feature operand rot is 1 and passes columns where it is
                            0 through (v beside q and k): cos' = rot·cos + (1 − rot),
                            sin' = rot·sin, exact for rot in {0, 1}.
    5' group statistic      ``head_rstd(x, w, eps)`` = rsqrt(mean(x²) + eps) over each
                            group of w adjacent columns (a head of head_dim features),
                            broadcast over the group: a TILE value, tile-local because
                            the layout contract puts whole groups in a tile (QK-norm:
                            QuACK's HeadRstd, folded in the accumulator prepass). Its
                            argument is computed from the accumulator and vectors only
                            (the prepass sees no tile operand).
    5'' deferred statistic  ``rstd_partials(P, d, eps)`` = rsqrt(Σ_t P[i, t] / d + eps): a
                            norm's row scale r from a ROW_PARTIALS operand, its producer's
                            raw per-tile partials (deferred_rstd.py): per row, known before
                            the tile (the whole row is in the operand), so not final.
    6 stateful reduction    ``row_logsumexp`` keeps a per-row online (max, sum-exp) state,
                            merged across tiles by the proved LSE merge
                            (algebra/statements.py); ``select_column(x, idx)`` picks
                            x[i, idx[i]] for a per-row integer operand (0 where idx[i] is
                            out of range, e.g. ignore_index). Both are final values, like
                            the row reductions.

Programs are immutable and serialise to a canonical JSON text, which is what travels
through the graph as the ``coda::gemm_epilogue`` op's first argument: the op is
self-contained (Inductor's FX cache, pickling, another process), and the text is the
cache key of the generated kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Union

from .op_table import (ACC, ELEMENTWISE_CLASS, GROUPED_CLASS, PAIRWISE_CLASS, PARTIALS_CLASS,
                       REDUCTION_CLASS, ROTARY_CLASS, STATEFUL_CLASS, Kind, ProgramError,
                       kind_of, of_class)

Arg = Union[str, float]  # a value name, or a literal constant


# The op vocabulary, by class (codegen/op_table.py is the one table; these views of it
# are what the builder and the lowering iterate over).
ELEMENTWISE = {n: op.arity[0] for n, op in of_class(ELEMENTWISE_CLASS).items()}
PAIRWISE = {n: op.gate_activation for n, op in of_class(PAIRWISE_CLASS).items()}
ROTARY = {n: op.arity for n, op in of_class(ROTARY_CLASS).items()}
STATEFUL = {n: op.arity[0] for n, op in of_class(STATEFUL_CLASS).items()}
REDUCTIONS = {n: op.combine for n, op in of_class(REDUCTION_CLASS).items()}
GROUPED = {n: op.arity for n, op in of_class(GROUPED_CLASS).items()}
PARTIALS = {n: op.arity for n, op in of_class(PARTIALS_CLASS).items()}


@dataclasses.dataclass(frozen=True)
class Operand:
    name: str
    kind: Kind


@dataclasses.dataclass(frozen=True)
class Instr:
    out: str
    op: str
    args: tuple[Arg, ...]
    dtype: str | None = None  # ``cast`` only: the storage dtype to round through


@dataclasses.dataclass(frozen=True)
class Output:
    value: str
    kind: Kind  # TILE, PAIR, PER_ROW, or ROW_PARTIALS (a row_sum's unmerged partials)
    dtype: str  # storage dtype, e.g. "bfloat16"


@dataclasses.dataclass(frozen=True)
class EpilogueProgram:
    name: str
    gemm: bool
    operands: tuple[Operand, ...]
    body: tuple[Instr, ...]
    outputs: tuple[Output, ...]  # kinds TILE, PAIR, PER_ROW, ROW_PARTIALS
    # The rewrite family that built the program ("rowscale", "residual_rmsnorm", "gated",
    # "rope", "cross_entropy"): the backward dispatches on it (kernels/backward/). Empty
    # for a program no family built (the general backward rule).
    family: str = ""

    def __post_init__(self):
        self.value_kinds()  # validates

    # ---- analysis -------------------------------------------------------------------
    def value_kinds(self) -> dict[str, tuple[Kind, bool]]:
        """Kind of every value, and whether it is *final* (depends on a reduction).

        Enforces tile locality: a tile output may read only the accumulator, its own
        row's and feature's vector values and same-position tiles; a value that needs the
        whole row (a reduction result) can only reach per-row outputs.
        """
        env: dict[str, tuple[Kind, bool]] = {}
        if self.gemm:
            env[ACC] = (Kind.TILE, False)
        for o in self.operands:
            if o.name in env:
                raise ProgramError(f"{self.name}: operand {o.name!r} defined twice")
            env[o.name] = (Kind(o.kind), False)
        if not self.gemm and not any(o.kind == Kind.TILE for o in self.operands):
            raise ProgramError(f"{self.name}: a program without a GEMM needs a tile operand")

        def kind_of_arg(a: Arg) -> tuple[Kind, bool]:
            if isinstance(a, str):
                if a not in env:
                    raise ProgramError(f"{self.name}: {a!r} is read before it is defined")
                return env[a]
            return (Kind.SCALAR, False)

        for ins in self.body:
            if ins.out in env:
                raise ProgramError(f"{self.name}: value {ins.out!r} assigned twice")
            env[ins.out] = kind_of(self, ins, [kind_of_arg(a) for a in ins.args])
            k, final = env[ins.out]
            if final and k in (Kind.TILE, Kind.PER_FEATURE):
                raise ProgramError(
                    f"{self.name}: {ins.out!r} mixes a whole-row reduction into a tile value "
                    "(not tile-local: the row is complete only after every tile is done)")
        sums = {i.out for i in self.body if i.op == "row_sum"}
        for o in self.outputs:
            k, final = kind_of_arg(o.value)
            if o.kind == Kind.TILE and final:
                raise ProgramError(f"{self.name}: tile output {o.value!r} is not tile-local")
            if o.kind == Kind.PER_ROW and k not in (Kind.PER_ROW, Kind.SCALAR):
                raise ProgramError(f"{self.name}: per-row output {o.value!r} is a {k.value}")
            if o.kind == Kind.PAIR and k != Kind.PAIR or k == Kind.PAIR and o.kind != Kind.PAIR:
                raise ProgramError(f"{self.name}: output {o.value!r} is a {k.value}, "
                                   f"declared {o.kind.value}")
            if o.kind == Kind.ROW_PARTIALS and (
                    o.value not in sums or o.dtype != "float32"):
                raise ProgramError(f"{self.name}: a row_partials output is a row_sum's value, "
                                   "stored as float32")
            if o.kind not in (Kind.TILE, Kind.PER_ROW, Kind.PAIR, Kind.ROW_PARTIALS):
                raise ProgramError(f"{self.name}: outputs are tiles, pairs, per-row vectors "
                                   "or row partials")
        return env

    @functools.cached_property
    def index_operands(self) -> frozenset[str]:
        """Per-row operands used as column indices (integer tensors at run time)."""
        names = {o.name for o in self.operands if o.kind == Kind.PER_ROW}
        return frozenset({i.args[1] for i in self.body if i.op == "select_column"} & names)

    @functools.cached_property
    def rotation_operands(self) -> frozenset[str]:
        """Operands a rotation reads its angle from (positions, frequencies, a cos/sin
        table): float32 at run time, whatever the model's dtype."""
        return frozenset(a for i in self.body if i.op in ROTARY for a in i.args[1:])

    # ---- serialisation ----------------------------------------------------------------
    # Computed once per program: the op reads the key on every call (runtime counters).
    # (cached_property writes the instance __dict__ directly, which a frozen dataclass
    # allows; equality and hashing still use the fields only.)
    @functools.cached_property
    def _text(self) -> str:
        d = dataclasses.asdict(self)
        if not d["family"]:  # untagged programs keep the text (and key) they always had
            del d["family"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def to_text(self) -> str:
        return self._text

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(self._text.encode()).hexdigest()[:10]

    @functools.cached_property
    def key(self) -> str:
        """Short readable handle: name and digest."""
        return f"{self.name}#{self.digest}"

    def pretty(self) -> str:
        """The program as readable math (for explain() and the dump)."""
        head = f"program {self.key}"
        if self.gemm:
            head += "   acc[i, j] = Σ_k a[i, k]·b[j, k]"
        lines = [head]
        if self.operands:
            lines.append("  operands: " + ", ".join(f"{o.name} ({o.kind.value})"
                                                    for o in self.operands))
        kinds = self.value_kinds()
        for ins in self.body:
            args = ", ".join(_fmt_arg(a) for a in ins.args)
            rhs = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}",
                   "div": "{0} / {1}"}.get(ins.op)
            if rhs:
                rhs = rhs.format(*(_fmt_arg(a) for a in ins.args))
            elif ins.op == "cast":
                rhs = f"round_{ins.dtype}({args})"
            elif ins.op in GROUPED:  # the group's width is a count
                rhs = f"{ins.op}({ins.args[0]}, width={int(ins.args[1])}, " \
                      f"eps={float(ins.args[2]):g})"
            else:
                rhs = f"{ins.op}({args})"
            note = "   # per-tile partials, merged" if ins.op in REDUCTIONS or \
                ins.op in STATEFUL else ""
            lines.append(f"  {ins.out} = {rhs}    [{kinds[ins.out][0].value}]{note}")
        lines.append("  out: " + ", ".join(f"{o.value} ({o.kind.value}, {o.dtype})"
                                           for o in self.outputs))
        return "\n".join(lines)


def _fmt_arg(a: Arg) -> str:
    return a if isinstance(a, str) else repr(float(a))


def scaled_acc_prefix(program: EpilogueProgram) -> tuple[str, int]:
    """(value, instructions used) of the ``ProgramBuilder.scaled_acc`` prefix at the
    start of ``program``'s body: ``(ACC, 0)`` when it has neither a row scale nor a bias."""
    names = {o.name for o in program.operands}
    body, v, i = program.body, ACC, 0
    if "r" in names and i < len(body) and (body[i].op, body[i].args) == ("mul", (ACC, "r")):
        v, i = body[i].out, i + 1
    if "bias" in names and i < len(body) and (body[i].op, body[i].args) == ("add", (v, "bias")):
        v, i = body[i].out, i + 1
    return v, i


@functools.lru_cache(maxsize=1024)
def parse(text: str) -> EpilogueProgram:
    """Inverse of ``to_text`` (cached: the op wrapper parses on every call)."""
    d = json.loads(text)
    return EpilogueProgram(
        name=d["name"],
        gemm=d["gemm"],
        operands=tuple(Operand(o["name"], Kind(o["kind"])) for o in d["operands"]),
        body=tuple(Instr(i["out"], i["op"], tuple(i["args"]), i["dtype"]) for i in d["body"]),
        outputs=tuple(Output(o["value"], Kind(o["kind"]), o["dtype"]) for o in d["outputs"]),
        family=d.get("family", ""),
    )


class ProgramBuilder:
    """Small helper to write programs as straight-line math::

        p = ProgramBuilder("rowscale", gemm=True, family="rowscale")
        r = p.operand("r", Kind.PER_ROW)
        p.output(p.mul(ACC, r), Kind.TILE, "bfloat16")
    """

    def __init__(self, name: str, gemm: bool, family: str = ""):
        self.name, self.gemm, self.family = name, gemm, family
        self._operands: list[Operand] = []
        self._body: list[Instr] = []
        self._outputs: list[Output] = []
        self._n = 0

    def operand(self, name: str, kind: Kind) -> str:
        self._operands.append(Operand(name, kind))
        return name

    def emit(self, op: str, *args: Arg, dtype: str | None = None, name: str | None = None) -> str:
        if name is None:
            self._n += 1
            name = f"t{self._n}"
        args = tuple(a if isinstance(a, str) else float(a) for a in args)
        self._body.append(Instr(name, op, args, dtype))
        return name

    def __getattr__(self, op: str):
        if op in ELEMENTWISE or op in REDUCTIONS or op in PAIRWISE or op in STATEFUL \
                or op in ROTARY or op in GROUPED or op in PARTIALS:
            return functools.partial(self.emit, op)
        raise AttributeError(op)

    def scaled_acc(self, row_scale: bool, bias: bool) -> str:
        """acc (· r[i]) (+ b[j]): the GEMM output under a deferred row scale and a bias,
        the prefix consumer programs start with (operands ``r``, ``bias``; values ``y``,
        ``y_b``). ``scaled_acc_prefix`` reads it back."""
        v = ACC
        if row_scale:
            v = self.mul(v, self.operand("r", Kind.PER_ROW), name="y")
        if bias:
            v = self.add(v, self.operand("bias", Kind.PER_FEATURE), name="y_b")
        return v

    def output(self, value: str, kind: Kind, dtype: str) -> None:
        self._outputs.append(Output(value, kind, dtype))

    def build(self) -> EpilogueProgram:
        return EpilogueProgram(self.name, self.gemm, tuple(self._operands),
                               tuple(self._body), tuple(self._outputs), self.family)
