"""The generated-kernel path: programs compiled through QuACK, on Hopper.

``select`` decides, per call, whether a program can run as a generated kernel on these
tensors (device, dtypes, alignment, shapes: the layout contract), and says why not when
it cannot: the op then runs the reference and counts the reason. Nothing here guesses:
a tensor the contract does not cover never reaches a kernel.

Generated sources are written once per program into the kernel folder
(``$CODA_KERNEL_DIR``, default ``~/.cache/coda_rewrite/kernels/<versions>``), which is
put on ``sys.path``: QuACK's compile cache needs an importable home for an epilogue
function, and its disk cache then makes a warm start skip compilation. The folder name
carries the generator's and QuACK's versions, so a new version never reads stale code.

Configs are QuACK's per-arch defaults (no autotuning): a call makes no tuning decision.
The first call of a program on a tensor-metadata class prepares its launch (``Launch``:
QuACK's ``EpiMod.plan``, which compiles on a cold cache; logged once per kernel, with
its time); every later call of that class is ``EpiPlan.run``, no host decision. Run one
warm-up step before capturing a CUDA graph.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from ..codegen.program import EpilogueProgram, Kind
from ..codegen.quack_source import GENERATOR_VERSION, KernelSource, Unlowerable, generate
from ..codegen import fp8, reference

log = logging.getLogger("coda_rewrite.kernels")

# Hopper is what the generated kernels are validated on; QuACK also has sm100/sm120
# GEMMs, which join this set once measured there.
SUPPORTED_ARCH_MAJOR = (9,)
_GEMM_DTYPES = (torch.bfloat16, torch.float16)
# e4m3 x e4m3 (codegen/fp8.py): QuACK's SM90 GEMM takes 8-bit operands K-major only, which
# nn.Linear's [N, K] weight and a row-major activation are
_FP8_GEMM_DTYPES = (torch.float8_e4m3fn,)
FP8_FAMILY = fp8.FAMILY  # the programs codegen/fp8.py builds: their configs are FP8's
_STORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# A cos/sin table wraps every head_dim columns, so a tile must hold whole heads or a
# whole fraction of one (QuACK's rotary epilogue asserts tile_N % head_dim == 0 or
# head_dim % tile_N == 0): such programs run at tile_n 128, which fits every head the
# contract takes (64 and multiples of 128) ...
TABLE_TILE_N = 128
# ... and, past the row classes, heads of 64 at QuACK's default width (three heads a
# tile). The 1B q/k/v + RoPE (head_dim 64, N = 3072, K = 2048) at 8192 rows on an H100:
# 150.2 µs at 128 x 192 against 178.8 at 128 x 128 (cuBLAS alone 141.9); the plain GEMM
# 137.6 against 167.2 (BENCHMARKS.md, forty-fifth session). Heads of 128 keep 128: 128 x
# 256 cooperative measured within 2% of it on the 8B q/k/v.
TABLE_WIDE_TILE_N = 192
# ... and QuACK's TMA table load needs whole epilogue subtiles per head (seen on the
# H200: head_dim 16 fails its "multiple of the epi tile N" check; 64 and 128 run)
TABLE_MIN_HEAD = 64


def table_head_fits(head_dim: int) -> bool:
    """Whether a cos/sin table that wraps every ``head_dim`` columns fits the kernel's
    table tiles (the contract checks it before a launch; the RoPE pattern before a
    rewrite, so that no rewrite is made whose every call would run the reference path)."""
    return head_dim % TABLE_MIN_HEAD == 0 and (
        TABLE_TILE_N % head_dim == 0 or head_dim % TABLE_TILE_N == 0)


# A per-head statistic (QK-norm: QuACK's HeadRstd) needs whole heads in a tile: its
# width must divide the tile's. Heads of 64, 128 or 256 features fit the tiles below
# (a 128- or 256-wide head sets the tile width to its own where the row class's does
# not hold it); QuACK also needs each thread's run of an epilogue subtile inside one
# group, which narrower heads do not give.
GROUP_WIDTHS = (64, 128, 256)


def group_fits(width: int) -> bool:
    """Whether heads ``width`` features wide fit the kernel's tiles (the contract checks
    it before a launch; the RoPE pattern before a QK-norm rewrite on the GPU)."""
    return width in GROUP_WIDTHS


def _group_widths(prog: EpilogueProgram) -> set[int]:
    return {int(i.args[1]) for i in prog.body if i.op == "head_rstd"}


COMPILES: list[tuple[str, float]] = []  # (kernel, seconds of its first call)
_seen: set = set()
_lock = threading.Lock()


def kernel_dir() -> Path:
    explicit = os.environ.get("CODA_KERNEL_DIR")
    if explicit:
        return Path(explicit)
    versions = f"gen{GENERATOR_VERSION}-quack{_version('quack-kernels')}-" \
               f"dsl{_version('nvidia-cutlass-dsl')}"
    return Path.home() / ".cache" / "coda_rewrite" / "kernels" / versions


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=None)
def quack_available() -> str | None:
    """None if QuACK imports, else why not."""
    try:
        import quack.epilogue.frontend  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA toolchain
        return f"quack-kernels unavailable ({type(e).__name__}: {str(e).splitlines()[0]})"
    return None


def write_module(ks, folder: Path | None = None) -> Path:
    """Write a generated module (anything with ``module_name`` and ``source``: a
    KernelSource, a DgatedSource) atomically; unchanged files are left alone."""
    folder = folder or kernel_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{ks.module_name}.py"
    if not path.exists() or path.read_text() != ks.source:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(ks.source)
        tmp.replace(path)
    return path


@functools.lru_cache(maxsize=None)
def load(program_text: str):
    """(KernelSource, imported module) for a program text; raises Unlowerable."""
    from ..codegen.program import parse

    ks = generate(parse(program_text))
    return ks, import_generated(ks)


def import_generated(source):
    """Write a generated module into the kernel folder and import it."""
    path = write_module(source)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    return importlib.import_module(source.module_name)


def _aligned(t: torch.Tensor) -> bool:
    """TMA: 16-byte aligned base and row stride, unit stride along the last dim."""
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and \
        (t.dim() == 1 or (t.stride(0) * es) % 16 == 0)


def device_violation(a: torch.Tensor) -> str | None:
    """Why this device cannot run generated kernels (None: it can)."""
    if a.device.type != "cuda":
        return f"device {a.device.type} (generated kernels are CUDA only)"
    return _arch_violation(a.device.index if a.device.index is not None
                           else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _arch_violation(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if major not in SUPPORTED_ARCH_MAJOR:
        return f"sm_{major}{minor}: generated kernels are validated on sm_90 only"
    return None


def gemm_violation(a_dtype: torch.dtype, b_dtype: torch.dtype, k: int, n: int) -> str | None:
    """Why a GEMM of these operand dtypes and widths breaks the layout contract whatever
    its tensors (None: these allow it): what a graph's static shapes tell before any
    call (patterns/family.no_kernel: a family leaves such a GEMM unfused on the GPU)."""
    if a_dtype not in _GEMM_DTYPES + _FP8_GEMM_DTYPES or b_dtype != a_dtype:
        return (f"GEMM operands {a_dtype}/{b_dtype} (QuACK's GEMM takes bf16/fp16 or e4m3 "
                "pairs)")
    if n == 0 or k == 0:
        return "empty problem"
    per_row = 16 // a_dtype.itemsize  # elements per 16 bytes
    if k % per_row:
        return f"K={k} not a multiple of {per_row} (16-byte TMA rows)"
    if n % 8:
        return f"N={n} not a multiple of 8 (16-byte TMA rows)"
    return None


def contract_violation(program: EpilogueProgram, a, b, operands) -> str | None:
    """Why these tensors break the layout contract (None: they meet it)."""
    if not program.gemm:
        return "no GEMM in the program (row-wise torch ops)"
    m, k = a.shape
    n = b.shape[0]
    why = gemm_violation(a.dtype, b.dtype, k, n)
    if why is not None:
        return why
    if m == 0:
        return "empty problem"
    if not (_aligned(a) and _aligned(b)):
        return "a or b not K-contiguous and 16-byte aligned"
    indices = program.index_operands
    for spec, t in zip(program.operands, operands):
        if spec.name in program.rotation_operands and t.dtype != torch.float32:
            return (f"rotation operand {spec.name} is {t.dtype} (positions and float-float "
                    "frequencies are float32)")
        if spec.name in indices:
            if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (m,):
                return f"index operand {spec.name} must be int32/int64 of shape ({m},)"
            continue
        if spec.kind == Kind.COS_SIN:
            hd = t.shape[-1] if t.dim() == 2 else 0
            if t.dim() != 2 or t.shape[0] != m or not hd or n % hd or \
                    not table_head_fits(hd):
                return (f"cos/sin table {spec.name} of shape {tuple(t.shape)}: needs [M, hd] "
                        f"with hd a multiple of {TABLE_MIN_HEAD} dividing N, and dividing or "
                        f"a multiple of {TABLE_TILE_N} (the kernel's tile width)")
            if t.dtype not in (torch.float32, torch.bfloat16) or not _aligned(t):
                return f"cos/sin table {spec.name} is {t.dtype} or not 16-byte aligned"
            continue
        if spec.kind == Kind.SCALAR:
            if t.numel() != 1:
                return f"scalar operand {spec.name} has {t.numel()} elements"
            continue
        if spec.kind == Kind.ROW_PARTIALS:  # read element by element (epi_ops.py)
            if t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] != m or \
                    t.shape[1] < 1 or t.stride(-1) != 1:
                return (f"row partials {spec.name}: {t.dtype} {tuple(t.shape)}, expected "
                        f"float32 [{m}, T] with unit stride along T")
            continue
        if t.dtype not in _STORE_DTYPES:
            return f"operand {spec.name} is {t.dtype}"
        want = {Kind.TILE: (m, n), Kind.PER_ROW: (m,), Kind.PER_FEATURE: (n,)}[spec.kind]
        if tuple(t.shape) != want:
            return f"operand {spec.name} has shape {tuple(t.shape)}, expected {want}"
        if not _aligned(t):
            return f"operand {spec.name} is not unit-stride and 16-byte aligned"
    return program_violation(program, n)


def program_violation(program: EpilogueProgram, n: int) -> str | None:
    """Why the program's own epilogue cannot run on a GEMM N columns wide, whatever its
    tensors (None: it can): its per-head statistics, its outputs' dtypes and pair widths.
    With gemm_violation, what a graph's static widths tell before any call
    (patterns/family.no_kernel)."""
    for w in _group_widths(program):
        if n % w or not group_fits(w):
            return (f"a per-head statistic over {w} columns with N={n}: the kernel's tiles "
                    f"hold whole heads of {', '.join(map(str, GROUP_WIDTHS))} features")
    for o in program.outputs:
        if reference.dtype_from_name(o.dtype) not in _STORE_DTYPES:
            return f"output {o.value} stored as {o.dtype}"
        if o.kind == Kind.PAIR and n % 16:
            return f"N={n}: gated pairs need N a multiple of 16 (16-byte half-width rows)"
    return None


def select(program: EpilogueProgram, program_text: str, a, b, operands):
    """(KernelSource, module) to launch, or (None, why not)."""
    why = contract_violation(program, a, b, operands) or device_violation(a)
    if why is None:
        why = quack_available()
    if why is not None:
        return None, why
    try:
        return load(program_text), None
    except Unlowerable as e:
        return None, f"not lowerable: {e}"


def _row_rstd_kernel(partials_shape, dtype=torch.float32):
    """QuACK's rsqrt(Σ_tiles partials · scale + eps) per row (quack_source.norm_row_stage),
    compiled for this partial width, called as ``fn(partials, rstd, scale, eps)``: the
    norm's rstd in one kernel where the generic finaliser ran a torch op per instruction
    (measured on the H200 at M = 64: 75 → 53 µs of host time per producer call). The
    compiled function is resolved once per launch: ``rms_final_reduce`` itself looks the
    kernel up through a custom op, a dtype map and a cache key on every call, host time a
    decode step pays per layer."""
    from quack import rms_final_reduce as final
    from quack.cute_dsl_utils import torch2cute_dtype_map
    return final._compile_rms_final_reduce(torch2cute_dtype_map[dtype], partials_shape[-1])


def tile_config(tile_m: int, tile_n: int, cluster_m: int, split_k: int = 1,
                pingpong: bool = True, fp8_fast_accum: bool = False):
    """QuACK's GemmConfig of a planned launch (``pingpong``: one warp group per tile, two
    tiles in flight; False: two warp groups share one tile). ``split_k`` > 1 splits the
    contraction over that many CTAs per output tile, SERIAL: the splits add their float32
    partials in split order and only the last runs the epilogue, on the whole sum (QuACK's
    stream-K fixup: any epilogue, reductions included, sees exactly the unsplit
    accumulator, and the order is fixed, so the result is deterministic)."""
    cls = _fp8_fast_accum_config() if fp8_fast_accum else _gemm_config()
    return cls(tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m,
               cluster_n=1, is_dynamic_persistent=False, split_k=split_k)


def _gemm_config():
    from quack.gemm_config import GemmConfig
    return GemmConfig


_FAST_ACCUM = []


def _fp8_fast_accum_config():
    """GemmConfig of an e4m3 GEMM that accumulates in the tensor cores' own accumulator
    (what cuBLAS's use_fast_accum and torchao's float8 inference do): QuACK's SM90 FP8
    mainloop otherwise adds each K tile into a second float32 accumulator (its
    fp8_slow_accum), which doubles the accumulator registers. QuACK's GemmConfig has no
    field for it; EpiMod.gemm takes it as a post-init attribute (Planned)."""
    if not _FAST_ACCUM:
        from dataclasses import dataclass

        @dataclass(frozen=True)
        class Fp8FastAccumConfig(_gemm_config()):
            fp8_fast_accum: bool = True
        _FAST_ACCUM.append(Fp8FastAccumConfig)
    return _FAST_ACCUM[0]


def fast_accum(config) -> bool:
    return bool(getattr(config, "fp8_fast_accum", False))


# e4m3 GEMMs (codegen/fp8.py) accumulate in the tensor cores' own accumulator ("fast
# accumulation", cuBLAS's use_fast_accum): what torchao's float8 inference recipe does,
# the baseline of README's FP8 policy. QuACK's SM90 FP8 mainloop otherwise adds each K
# tile into a second float32 accumulator (its fp8_slow_accum, for the ~14 bits Hopper's
# FP8 MMA keeps while accumulating), which doubles the accumulator registers: a
# ping-pong tile over 128 x 64 then spills (QuACK's default 128 x 192: ~10x a bf16
# GEMM's time) and only cooperative tiles run at speed. Measured on the H200 at the 8B
# MLP's shapes, gate/up (K 4096, N 28672) / down (K 14336, N 4096), in ms (BENCHMARKS.md,
# nineteenth session), against cuBLAS's row-scaled FP8 GEMM with fast accumulation:
#   rows    tiles (ping-pong, cluster)     fast            precise (best tile)   cuBLAS
#   8192    128 x 192, 2                   1.294 / 0.666   1.402 / 0.686         1.425 / 0.760
#   1024    128 x 128, 2                   0.185 / 0.087   0.200 / 0.094         0.166 / 0.098
#   256     128 x 128, 2                   0.055 / 0.043   0.064 / 0.037         0.054 / 0.042
#   64      64 x 128, 1                    0.042 / 0.032   0.043 / 0.037         0.046 / 0.041
# Fast accumulation's own error, on e4m3 inputs at K 14336: 3.3e-3 against float64 (1.7e-3
# precise: the bf16 store's rounding); an e4m3 rounding of the inputs costs ~3e-2. The 8B
# layer's output: 7.19e-3 from float64 with it, 7.18e-3 without (torchao 7.27e-3).
# The training step's GEMMs (BENCHMARKS.md, twenty-second session; 1B step shapes, 8192
# rows, fast accumulation, µs): where N ≤ 2048, 128 x 128 tiles beat 128 x 192 at any K
# (gate/up dgrad, K 8192: 208.8 against 221.3; down forward 206.6 / 225.0; q/o forward
# 53.2 / 54.7; k/v forward, N 512: 20.4 / 24.7); at N = 8192 128 x 192 stays ahead (202.6
# against 214.2). Split-K (2–4) never paid there, even for the wgrad's 4 x 16 tiles of a
# k/v projection over K = 8192 (26.5 against 27.6, inside the noise).
FP8_ROW_CLASSES = (  # (rows at most or None: any, widest N or None: any, (tile_m, tile_n,
    (64, None, (64, 128, 1, 1, True, True)),  # cluster_m, split_k, pingpong, fast));
    (4095, None, (128, 128, 2, 1, True, True)),  # first match wins
    (None, 2048, (128, 128, 2, 1, True, True)),
)
FP8_LARGE = (128, 192, 2, 1, True, True)


def _fp8_config(m: int, n: int):
    return tile_config(*(_first_class(FP8_ROW_CLASSES, m, n) or FP8_LARGE))


# Tile configs by problem size, decided once per (rows, columns) class from the sweep of
# every family at M in {1 ... 4096} on the 1B and 8B layer shapes (benchmarks/small_m.py,
# BENCHMARKS.md "small M"). QuACK's default (128 x 192 tiles, cluster 2) fills the H200's
# 132 SMs only from a few thousand rows; below that the grid starves and smaller tiles
# win: 64-row tiles for decode and short prompts (64 x 256 for wide outputs up to 16
# rows: the gated pair, the LM head), 128 x 64 for narrow outputs (the norm
# producers, N <= 8192) up to 256 rows, 128 x 128 (cluster 2) in between; the default
# for large problems and for vocabulary-wide outputs (the LM head), where it is fastest.
ROW_CLASSES = (  # (rows at most, widest N, (tile_m, tile_n, cluster_m)); first match wins
    (16, 8192, (64, 128, 1)),
    (16, None, (64, 256, 1)),
    (64, None, (64, 128, 1)),
    (256, 8192, (128, 64, 1)),
    (4095, 65535, (128, 128, 2)),
)


# Past the row classes, a norm producer (patterns/residual_rmsnorm.norm_program: its
# epilogue reads the residual and stores z, h2 and the row partials) up to N = 4096 runs
# on 128 x 256 cooperative tiles, cluster 2: against QuACK's default on an H100 at the
# 1B and 8B producers (o_proj K = dim, down K = ffn), 4096 and 8192 rows, µs (BENCHMARKS.md,
# forty-fifth session): 1B down 196.7 / 209.6 and 390.2 / 423.4, 1B o_proj 64.5 / 66.5 and
# 122.3 / 124.6, 8B down 681.1 / 711.9 and 1360.0 / 1382.7, 8B o_proj 208.4 / 213.1 and,
# the one loss, 420.2 / 410.7 at 8192 rows. Wider producers were not measured.
NORM_PRODUCER_FAMILY = "residual_rmsnorm"
NORM_PRODUCER_LARGE = (4096, (128, 256, 2, 1, False))  # (widest N, tiles: tile_m, tile_n,
# cluster_m, split_k, pingpong)


def config_for(prog: EpilogueProgram, m: int, n: int, head_dim: int | None = None):
    """The GemmConfig to launch ``prog`` with on an (m, n) output (None: QuACK's
    default): the row class's (ROW_CLASSES), past them a norm producer's own
    (NORM_PRODUCER_LARGE). A cos/sin table wraps every head_dim
    columns, so table programs keep a tile width of 64 or TABLE_TILE_N (the contract
    checks head_dim against both), and past the row classes TABLE_WIDE_TILE_N where the
    launch's table has heads of ``head_dim`` = 64 (None: not known, as for AOT, whose
    tables have heads of 128)."""
    if prog.family == FP8_FAMILY:
        return _fp8_config(m, n)
    table = any(o.kind == Kind.COS_SIN for o in prog.operands)
    groups = _group_widths(prog)
    row_class = _row_class(m, n)
    if row_class is not None:
        tile_m, tile_n, cluster_m, *split_k = row_class
        tile_n = min(tile_n, TABLE_TILE_N) if table else tile_n
        return tile_config(tile_m, _holding(groups, tile_n), cluster_m, *split_k)
    if prog.gemm and prog.family == NORM_PRODUCER_FAMILY and not table and not groups \
            and n <= NORM_PRODUCER_LARGE[0]:
        return tile_config(*NORM_PRODUCER_LARGE[1])
    if table:
        wide = head_dim is not None and TABLE_WIDE_TILE_N % head_dim == 0 \
            and table_head_fits(head_dim)
        return tile_config(128, _holding(groups, TABLE_WIDE_TILE_N if wide else TABLE_TILE_N),
                           2)
    return tile_config(128, _holding(groups, 192), 2) if groups - {64} else None


def config_for_size(m: int, n: int):
    """config_for of a GEMM whose epilogue has neither a cos/sin table nor per-head
    groups (the gated backward's dgrad GEMM: kernels/dgated.py)."""
    row_class = _row_class(m, n)
    return None if row_class is None else tile_config(*row_class)


def _row_class(m: int, n: int) -> tuple[int, ...] | None:
    """(tile_m, tile_n, cluster_m[, split_k]) of the first row class holding an (m, n)
    output."""
    return _first_class(ROW_CLASSES, m, n)


def _first_class(classes, m: int, n: int) -> tuple | None:
    """The tiles of the first (rows at most, widest N, tiles) class holding an (m, n)
    output; None in a bound means any."""
    for rows, widest, tiles in classes:
        if (rows is None or m <= rows) and (widest is None or n <= widest):
            return tiles
    return None


def _table_head_dim(prog: EpilogueProgram, operands) -> int | None:
    """The head width of a launch's cos/sin table ([M, head_dim]), or None: no table, or
    the program also writes per-tile row partials, whose count a traced graph decides
    from the shapes alone (partial_columns: config_for without the head)."""
    if any(o.kind == Kind.ROW_PARTIALS for o in prog.outputs):
        return None
    for spec, t in zip(prog.operands, operands):
        if spec.kind == Kind.COS_SIN:
            return int(t.shape[-1])
    return None


def _holding(groups: set[int], tile_n: int) -> int:
    """``tile_n``, or the widest group width where it does not hold whole groups (the
    contract has checked each width is one of GROUP_WIDTHS, which divide one another)."""
    return tile_n if all(tile_n % w == 0 for w in groups) else max(groups)


def configs_of(prog: EpilogueProgram) -> list:
    """Every config config_for can give ``prog``, at any problem size (one row count and
    one width at each class bound and one past the last): what AOT compiles."""
    if prog.family == FP8_FAMILY:  # the classes' own tiles: no size to probe
        return list(dict.fromkeys(tile_config(*tiles) for tiles in
                                  [t for _, _, t in FP8_ROW_CLASSES] + [FP8_LARGE]))
    rows = sorted({r for r, _, _ in ROW_CLASSES})
    widths = sorted({w for _, w, _ in ROW_CLASSES if w is not None} |
                    {NORM_PRODUCER_LARGE[0]})
    out = []
    for m in rows + [rows[-1] + 1]:
        for n in widths + [widths[-1] + 1]:
            cfg = config_for(prog, m, n)
            if cfg not in out:
                out.append(cfg)
    return out


def config_name(cfg) -> str:
    if cfg is None:
        return "QuACK's default config (128 x 192 tiles, cluster 2)"
    return f"{cfg.tile_m} x {cfg.tile_n} tiles, cluster {cfg.cluster_m}" + (
        f", split-K {cfg.split_k}" if cfg.split_k > 1 else "") + (
        "" if cfg.pingpong else ", cooperative") + (
        ", fast FP8 accumulation" if fast_accum(cfg) else "")


def row_class_lines() -> list[str]:
    """The size policy as the report shows it."""
    lines = [f"M <= {rows}" + (f", N <= {widest}" if widest else "")
             + f": tiles {t[0]} x {t[1]}, cluster {t[2]}"
             + (f", split-K {t[3]}" if len(t) > 3 and t[3] > 1 else "")
             for rows, widest, t in ROW_CLASSES]
    widest, (tile_m, tile_n, cluster_m, *_) = NORM_PRODUCER_LARGE
    return lines + [f"otherwise, a norm producer with N <= {widest}: tiles {tile_m} x "
                    f"{tile_n}, cluster {cluster_m}, cooperative",
                    "otherwise: QuACK's default (128 x 192, cluster 2; "
                    f"cos/sin tables: 128 x {TABLE_WIDE_TILE_N} for heads of 64, else "
                    f"128 x {TABLE_TILE_N})"]


class Planned:
    """QuACK's plan of one epilogue module on one tensor-metadata class: its resolved GEMM
    (``gemm``: launched by run_gemm_epi_plan, no host decision) or, where Hopper's direct
    launch does not apply, the EpiPlan to run; the reductions' scratch shapes; and, for a
    split-K config, the shapes of the split's semaphore and float32 workspace.

    ``EpiMod.plan`` does not thread split_k through (QuACK 0.6.5: "pass it explicitly via
    mod.gemm for the starved-grid decode-shape win"), so a split config is planned with
    ``mod.gemm(..., split_k=, _launch=False)`` on the sinks' scratch as plan() would make
    it. The split's buffers are made per call, like every other buffer of a launch (see
    Launch): the semaphore zeroed (the serial protocol counts the committed splits in it),
    the workspace uninitialised (split 0 writes it before any other split reads it). No
    row class uses split-K: on the H200 it ran 1.2–2x slower than the same tile unsplit
    at every small-M shape tried (BENCHMARKS.md, sixteenth session); benchmarks/small_m.py
    sweeps it. A config with fast FP8 accumulation (tile_config) is planned the same way:
    plan() takes no post-init attributes either."""

    __slots__ = ("epi_plan", "gemm", "scratch", "split_buffers", "device")

    def __init__(self, mod, a, b_kn, c, out: dict, operands: dict, config):
        self.device = a.device
        self.split_buffers = None
        if config is None or (config.split_k == 1 and not fast_accum(config)):
            self.epi_plan = mod.plan(a, b_kn, c, out=out, config=config, **operands)
            # Hopper takes B as the (k, n) view plan() saw and nothing is swapped; any
            # other plan goes through EpiPlan.run, which knows how to relabel it
            direct = self.epi_plan.b_kn and not self.epi_plan.swapped
            self.gemm = self.epi_plan.gemm_plan if direct else None
            self.scratch = {n: (t.shape, t.dtype) for n, t in self.epi_plan.scratch.items()}
            self.epi_plan.scratch = {}
            return
        from quack.gemm import _split_k_buffers
        from quack.gemm_config import SplitKMode
        if _capability(a.device)[0] != 9 or config.swap_ab or (
                config.split_k > 1 and out.get("D") is None):
            raise ValueError(f"{config_name(config)}: planned only for Hopper's direct "
                             "launch" + (" of a GEMM that stores D" if config.split_k > 1
                                         else ""))
        epi_args = {**operands, **out}
        lead, n = tuple(a.shape[:-1]), b_kn.shape[-1]
        scratch = mod._alloc_sinks(epi_args, lead, n, config, a.device)
        self.epi_plan = None
        self.gemm = mod.gemm(
            a, b_kn, out.get("D"), c, epi_args=epi_args, tile_M=config.tile_m,
            tile_N=config.tile_n, tile_K=config.tile_k, cluster_M=config.cluster_m,
            cluster_N=config.cluster_n, pingpong=config.pingpong, persistent=True,
            is_dynamic_persistent=False, max_swizzle_size=config.max_swizzle_size,
            b_kn=True, split_k=config.split_k, split_k_mode=SplitKMode.SERIAL,
            post_init_attrs=(("fp8_slow_accum", False),) if fast_accum(config) else (),
            _launch=False)
        self.scratch = {n: (t.shape, t.dtype) for n, t in scratch.items()}
        if config.split_k == 1:
            return
        sem, ws = _split_k_buffers(out["D"][None], SplitKMode.SERIAL, config.tile_m,
                                   config.tile_n, config.cluster_m, config.cluster_n, False)
        self.split_buffers = (sem.shape, ws.shape)

    def launch(self, a, b_kn, d, c, values: dict) -> None:
        """The resolved GEMM on these tensors (``values``: operands, outputs, scratch)."""
        if self.split_buffers is None:
            run_gemm_epi_plan(self.gemm, a, b_kn, d, c, values)
            return
        sem, ws = self.split_buffers
        run_gemm_epi_plan(self.gemm, a, b_kn, d, c, values, split_k_buffers=(
            torch.zeros(sem, device=self.device, dtype=torch.int32),
            torch.empty(ws, device=self.device, dtype=torch.float32)))


def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability; a CPU tensor is the AOT compile's (sm_90a)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


def prepare(ks: KernelSource, module, a, b, operands, config=None) -> "Launch":
    """The launch of ``ks`` for the tensor-metadata class of these tensors (the caller
    keeps it, keyed by ``metadata_key``); ``config`` overrides config_for (benchmarks)."""
    return Launch(ks, module, a, b, operands, config)


def metadata_key(*tensors) -> tuple:
    """What a prepared launch may assume of its tensors: shapes, strides, storage offsets,
    dtypes, devices and each pointer's 16-byte alignment (a planned launch trusts its
    caller: a key that misses one of these would be a wrong result, not a slow call)."""
    key = []
    for t in tensors:
        if isinstance(t, (list, tuple)):
            key.append(metadata_key(*t))
        elif t is None:
            key.append(None)
        else:
            key.append((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device,
                        t.data_ptr() % 16 == 0))
    return tuple(key)


class Launch:
    """One program on one tensor-metadata class, prepared once: which operand binds
    where, the output buffers' shapes and dtypes, and QuACK's GEMM plan (``EpiMod.plan``:
    config and compiled kernel resolved, so a call makes no host decision). A call
    allocates the outputs, launches, and folds the reductions' per-tile partials.

    The reductions' per-tile partial buffers are allocated by each call, like its
    outputs, not kept with the plan: a buffer the plan kept would be shared by calls on
    different streams, and one allocated while a CUDA graph tree warms up would live in
    its memory pool untracked (which cudagraph trees refuse).

    A call's host work is what a decode step pays per fused GEMM, so everything that
    depends only on the metadata class is decided here, and ``__call__`` is the
    allocations, the launch (QuACK's ``run_gemm_epi_plan`` on the plan's resolved GEMM:
    ``EpiPlan.run`` without its per-call dict building and B relabel, which Hopper never
    needs) and the finaliser (benchmarks/host_overhead.py measures it against F.linear)."""

    __slots__ = ("ks", "planned", "c_index", "tensor_params", "scalar_params", "outs",
                 "sinks", "m", "n", "device", "out_dtypes", "row_rstd", "norm", "config",
                 "results", "unfolded", "calls", "buffer_names", "buffer_specs", "d_index",
                 "returned")

    def __init__(self, ks: KernelSource, module, a, b, operands, config=None):
        prog = ks.program
        self.ks, self.m, self.n, self.device = ks, a.shape[0], b.shape[0], a.device
        # launches so far (ops.runtime_counts): an attribute, not a shared counter, since
        # this is every fused call's host path; two threads may lose an increment
        self.calls = 0
        names = [o.name for o in prog.operands]
        # the operands QuACK takes by name: tensors as they are, scalars by pointer
        self.c_index, tensors, scalars = None, [], []
        for bnd in ks.contract.operands:
            i = names.index(bnd.name)
            if bnd.param == "c":
                self.c_index = i
            elif bnd.param in module.epilogue.fn.__code__.co_varnames or \
                    bnd.name in prog.index_operands:
                (scalars if bnd.kind == Kind.SCALAR else tensors).append((bnd.param, i))
        self.tensor_params, self.scalar_params = tuple(tensors), tuple(scalars)
        self.out_dtypes = {o.value: reference.dtype_from_name(o.dtype) for o in prog.outputs}
        width = {o.value: self.n // 2 if o.kind == Kind.PAIR else self.n for o in prog.outputs}
        self.outs = [(name, (self.m, width[value]), self.out_dtypes[value])
                     for value, name in ks.contract.tile_outputs]
        self.config = config or config_for(prog, self.m, self.n, _table_head_dim(prog, operands))
        t0 = time.perf_counter()
        mod = module.epilogue
        self.planned = Planned(mod, a, b.t(), self._c(operands), self._alloc(),
                               self._operands(operands), self.config)
        self.sinks = [(r, mod.sinks[r.sink]) for r in ks.contract.reductions]
        self.row_rstd = self.norm = None
        if ks.norm_stage is not None:  # (partials name, 2-D shape, 1/d, eps)
            sink, _value, scale, eps = ks.norm_stage
            # the norm's sum of squares, nothing else
            (name, (shape, dtype)), = self.planned.scratch.items()
            if name != sink or dtype != torch.float32 or shape.numel() != self.m * shape[-1]:
                raise RuntimeError(f"norm producer {prog.key}: QuACK planned partials "
                                   f"{name} {tuple(shape)} {dtype}, expected {sink}, float32 "
                                   f"[{self.m}, tiles]")
            # the [M, T] view the finaliser reads, None where QuACK's buffer is one (a
            # 2-D problem's: a view per call is host time for nothing)
            rows = (self.m, shape[-1])
            self.norm = (sink, None if tuple(shape) == rows else rows, scale, eps)
            self.row_rstd = _row_rstd_kernel(shape)
        self.unfolded = not self.sinks
        self.results = self._result_sources()
        self._bind()
        if config is None:  # an override (a benchmark's) is no traced graph's promise
            self._check_partials_width()
        first = ks.module_name not in _seen
        if first:
            with _lock:
                _seen.add(ks.module_name)
                COMPILES.append((prog.key, time.perf_counter() - t0))
            log.info("coda_rewrite: kernel %s ready in %.1f s (first plan: compile or "
                     "disk-cache load)", prog.key, time.perf_counter() - t0)

    def _result_sources(self):
        """Where each program output comes from when no per-row stage runs but the norm's
        (None otherwise): a kernel output buffer by name, the norm's rstd (None), or a
        reduction's raw partials, unmerged (a ROW_PARTIALS output: ("partials", sink))."""
        ks = self.ks
        if ks.row_stage and ks.norm_stage is None:
            return None
        tile = dict(ks.contract.tile_outputs)
        sink_of = {r.value: r.sink for r in ks.contract.reductions}
        sources = []
        for o in ks.program.outputs:
            if o.value in tile:
                sources.append(tile[o.value])
            elif o.kind == Kind.ROW_PARTIALS and o.value in sink_of:
                sources.append(("partials", sink_of[o.value]))
            elif ks.norm_stage is not None and o.value == ks.norm_stage[1] and \
                    self.out_dtypes[o.value] == torch.float32:
                sources.append(None)
            else:
                return None
        # every reduction handed on unmerged: nothing to fold after the kernel
        partial_sinks = {s[1] for s in sources if isinstance(s, tuple)}
        self.unfolded = all(r.sink in partial_sinks for r, _ in self.sinks)
        return sources

    def _check_partials_width(self) -> None:
        """A ROW_PARTIALS output must be as wide as partial_columns says: a traced graph
        was promised that width (ops._fake) before any launch was planned. A launch
        whose outputs are not all sourced from its buffers (``results`` None: a per-row
        stage runs) gives the merged column, one wide."""
        prog = self.ks.program
        sources = self.results if self.results is not None else [None] * len(prog.outputs)
        for spec, src in zip(prog.outputs, sources):
            if spec.kind != Kind.ROW_PARTIALS:
                continue
            planned = self.planned.scratch[src[1]][0][-1] if isinstance(src, tuple) else 1
            want = partial_columns(prog, self.m, self.n, self.device)
            if _handed_on(planned) != want:
                raise RuntimeError(f"{prog.key}: the launch gives {_handed_on(planned)} row "
                                   f"partials of {spec.value} for {self.m} x {self.n} "
                                   f"(QuACK planned {planned}), partial_columns says {want}")

    def _c(self, operands):
        return None if self.c_index is None else operands[self.c_index]

    def _operands(self, operands) -> dict:
        # a scalar goes by device pointer: no host sync, safe in CUDA graphs; a group
        # statistic's width is a constant the kernel is compiled with
        values = {param: operands[i] for param, i in self.tensor_params}
        for param, i in self.scalar_params:
            values[param] = operands[i].float().reshape(1)
        values.update(self.ks.constants)
        return values

    def _alloc(self) -> dict:
        return {name: torch.empty(*shape, device=self.device, dtype=dtype)
                for name, shape, dtype in self.outs}

    def _bind(self) -> None:
        """What every call repeats, laid out once (a call's host time is the bar: each
        dict a call built and each buffer it looked up by name cost ~0.3 µs of a 2-core
        CPU, 1.0–1.8 µs of a norm producer's 7.2 with QuACK's launch stubbed; on an H100
        machine's faster host the difference stayed inside its ±2 µs, BENCHMARKS.md,
        thirty-ninth session): the buffers a call allocates (the outputs, then the
        reductions' partials) under QuACK's names (the operands, tensors and scalars,
        are bound in __init__: ``_operands``), and, where the program's outputs
        are those buffers as the kernel leaves them, which buffer each one is
        (``returned``; None where a per-row stage, a fold, the norm's finaliser or a
        view of the partials makes them: the general path)."""
        scratch = self.planned.scratch
        self.buffer_names = tuple(name for name, _, _ in self.outs) + tuple(scratch)
        if len(set(self.buffer_names)) != len(self.buffer_names):
            raise RuntimeError(f"{self.ks.program.key}: an output and a reduction's partials "
                               f"share a name in QuACK's plan: {self.buffer_names}")
        self.buffer_specs = tuple((shape, dtype) for _, shape, dtype in self.outs) + \
            tuple((tuple(shape), dtype) for shape, dtype in scratch.values())
        self.d_index = self.buffer_names.index("D") if "D" in self.buffer_names else None
        self.returned = None
        if self.norm is not None or self.results is None or not self.unfolded:
            return
        returned = []
        for src in self.results:
            if isinstance(src, tuple):  # a reduction's partials, handed on
                shape = scratch[src[1]][0]
                if len(shape) != 2 or _handed_on(shape[1]) != shape[1]:
                    return  # viewed as [M, T] or summed per call (_partials)
                src = src[1]
            returned.append(self.buffer_names.index(src))
        self.returned = tuple(returned)

    def __call__(self, a, b, operands) -> list[torch.Tensor]:
        self.calls += 1
        device = self.device
        buffers = [torch.empty(*shape, device=device, dtype=dtype)
                   for shape, dtype in self.buffer_specs]
        planned = self.planned
        c = None if self.c_index is None else operands[self.c_index]
        if planned.gemm is not None:
            values = self._operands(operands)
            values.update(zip(self.buffer_names, buffers))
            planned.launch(a, b.t(), None if self.d_index is None else buffers[self.d_index],
                           c, values)
            if self.returned is not None:
                return [buffers[i] for i in self.returned]
        n_out = len(self.outs)
        out = dict(zip(self.buffer_names[:n_out], buffers[:n_out]))
        scratch = dict(zip(self.buffer_names[n_out:], buffers[n_out:]))
        if planned.gemm is None:
            planned.epi_plan.run(a, b.t(), c, out=out, scratch=scratch,
                                 **self._operands(operands))
        if self.norm is not None:  # the norm's rstd: one QuACK kernel, no torch ops
            sink, rows, scale, eps = self.norm
            rstd = torch.empty(self.m, device=device, dtype=torch.float32)
            partials = scratch[sink] if rows is None else scratch[sink].view(*rows)
            self.row_rstd(partials, rstd, scale, eps)
            if self.results is not None:
                return [rstd if s is None else out[s] for s in self.results]
            return self._outputs(out, {self.ks.norm_stage[1]: rstd.view(self.m, 1)})
        if self.results is not None and self.unfolded:
            return [self._partials(scratch[s[1]]) if isinstance(s, tuple) else out[s]
                    for s in self.results]
        return self._outputs(out, self._fold(a, operands, scratch))

    def _partials(self, sink: torch.Tensor) -> torch.Tensor:
        """A ROW_PARTIALS output: the sink's [M, T] partials as the kernel left them, or,
        past READER_FOLDS_PARTIALS of them, summed here to one column (the same row sums
        in another grouping): each reading CTA folds its rows' partials before its
        epilogue, a cost that grows with T (kernels/epi_ops.py)."""
        partials = sink if sink.dim() == 2 else sink.view(self.m, -1)
        if _handed_on(partials.shape[1]) != partials.shape[1]:
            return partials.sum(1, keepdim=True)
        return partials

    def _fold(self, a, operands, scratch) -> dict:
        """The reductions' per-row values from their per-tile partials, and the per-row
        stage (reference ops) where the program has one."""
        ks, m = self.ks, self.m
        env: dict[str, torch.Tensor] = {}
        for r, op in self.sinks:
            partials = scratch[r.sink]
            folded = op.host_finalize(partials) if getattr(op, "host_finalize", None) \
                else partials
            env[r.value] = folded.reshape(m, 1).float()
            if r.combine == "select":  # rows whose index is out of range are never written
                (instr,) = [i for i in ks.program.body if i.out == r.value]
                idx = operands[[o.name for o in ks.program.operands].index(instr.args[1])]
                ok = (idx.reshape(m, 1) >= 0) & (idx.reshape(m, 1) < self.n)
                env[r.value] = torch.where(ok, env[r.value], torch.zeros((), device=a.device))
        if ks.row_stage:
            for spec, t in zip(ks.program.operands, operands):
                if spec.kind in (Kind.PER_ROW, Kind.SCALAR):
                    env[spec.name] = t.float().reshape(-1, 1) if spec.kind == Kind.PER_ROW \
                        else t.float()
            reference.eval_body(ks.row_stage, env, torch.float32)
        return env

    def _outputs(self, out, env) -> list[torch.Tensor]:
        ks, m = self.ks, self.m
        env.update({value: out[name] for value, name in ks.contract.tile_outputs})
        return [env[o.value].reshape(m).to(self.out_dtypes[o.value])
                if o.kind == Kind.PER_ROW else env[o.value] for o in ks.program.outputs]


# The most per-tile partials a ROW_PARTIALS reader folds itself (deferred_rstd.py). On the
# H200 (BENCHMARKS.md, twenty-sixth session) a consumer's fold at 256 rows costs within
# 0.7 µs of reading r up to T = 16, +2.4-4.2 µs at T = 32, +4.5-8.6 at T = 64 (the 8B
# producer's 64-wide tiles at 129-256 rows); the finaliser it replaces costs 1.3-1.8 µs
# of GPU time and ~8 µs of host. At 32 the producer-consumer pair ran at parity on the
# GPU (0.98-1.01x) for that host saving; past it the producer's launch sums its partials
# to one column (one small kernel, as the finaliser was, but a torch op's host time).
READER_FOLDS_PARTIALS = 32


def _handed_on(tiles: int) -> int:
    """How many of a launch's ``tiles`` partials per row it hands on: all of them, or
    past READER_FOLDS_PARTIALS their sum (Launch._partials)."""
    return tiles if tiles <= READER_FOLDS_PARTIALS else 1


def partial_columns(prog: EpilogueProgram, m: int, n: int, device: torch.device) -> int:
    """How many partials per row a ROW_PARTIALS output of ``prog`` holds on an (m, n)
    problem: the launch's tiles along N (QuACK's sink rule, ``sink_alloc_shape``: one
    partial per ``tile_n`` columns), one where the launch sums them (past
    READER_FOLDS_PARTIALS) and where no launch can serve the call (the reference's
    merged column: off CUDA, without QuACK, on a GPU the kernels are not validated on).
    A function of the shapes alone, so a traced graph's fake knows it (ops._fake): a
    Launch checks that QuACK planned as many, and the reference route on CUDA pads its
    merged column to it with zeros (ops._run_reference)."""
    if device.type != "cuda" or not _kernels_run_on(device):
        return 1
    cfg = config_for(prog, m, n) or _default_config(device)
    return _handed_on(-(-n // cfg.tile_n))


def _kernels_run_on(device: torch.device) -> bool:
    """Whether generated kernels can run on this CUDA device (QuACK imports, the arch is
    one they are validated on)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return quack_available() is None and _arch_violation(index) is None


def _default_config(device: torch.device):
    from quack.gemm_config import default_config
    return default_config(device)


def run_gemm_epi_plan(*args, **kwargs):
    """QuACK's planned launch (quack.gemm_runtime.host), imported on first use: this
    module loads on machines without QuACK."""
    global run_gemm_epi_plan
    from quack.gemm_runtime.host import run_gemm_epi_plan as launch
    run_gemm_epi_plan = launch
    return launch(*args, **kwargs)
