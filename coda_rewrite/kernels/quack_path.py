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

Configs are QuACK's per-arch defaults (``tuned=False``): a call makes no tuning
decision, and the first call of a program and tensor-metadata class compiles (logged
once, with its time); run one warm-up step before capturing a CUDA graph.
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
from ..codegen import reference

log = logging.getLogger("coda_rewrite.kernels")

# Hopper is what the generated kernels are validated on; QuACK also has sm100/sm120
# GEMMs, which join this set once measured there.
SUPPORTED_ARCH_MAJOR = (9,)
_GEMM_DTYPES = (torch.bfloat16, torch.float16)
_STORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# A cos/sin table wraps every head_dim columns, so a tile must hold whole heads or a
# whole fraction of one: such programs run at tile_n 128 (QuACK's default, 192, fits
# neither 64 nor 128; measured on the H200: BENCHMARKS.md, RoPE sources).
TABLE_TILE_N = 128
# ... and QuACK's TMA table load needs whole epilogue subtiles per head (seen on the
# H200: head_dim 16 fails its "multiple of the epi tile N" check; 64 and 128 run)
TABLE_MIN_HEAD = 64

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


def write_module(ks: KernelSource, folder: Path | None = None) -> Path:
    """Write the generated module (atomically; unchanged files are left alone)."""
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
    path = write_module(ks)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    return ks, importlib.import_module(ks.module_name)


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


def contract_violation(program: EpilogueProgram, a, b, operands) -> str | None:
    """Why these tensors break the layout contract (None: they meet it)."""
    if not program.gemm:
        return "no GEMM in the program (row-wise torch ops)"
    if a.dtype not in _GEMM_DTYPES or b.dtype != a.dtype:
        return f"GEMM operands {a.dtype}/{b.dtype} (QuACK's GEMM takes bf16/fp16 pairs)"
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return "empty problem"
    if k % 8 or n % 8:
        return f"K={k} or N={n} not a multiple of 8 (16-byte TMA rows)"
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
            if t.dim() != 2 or t.shape[0] != m or hd % TABLE_MIN_HEAD or n % max(hd, 1) or \
                    (TABLE_TILE_N % hd and hd % TABLE_TILE_N):
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
        if t.dtype not in _STORE_DTYPES:
            return f"operand {spec.name} is {t.dtype}"
        want = {Kind.TILE: (m, n), Kind.PER_ROW: (m,), Kind.PER_FEATURE: (n,)}[spec.kind]
        if tuple(t.shape) != want:
            return f"operand {spec.name} has shape {tuple(t.shape)}, expected {want}"
        if not _aligned(t):
            return f"operand {spec.name} is not unit-stride and 16-byte aligned"
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


@functools.lru_cache(maxsize=None)
def _table_config():
    from quack.gemm_config import GemmConfig
    return GemmConfig(tile_m=128, tile_n=TABLE_TILE_N, pingpong=True, cluster_m=2,
                      cluster_n=1, is_dynamic_persistent=False)


def config_for(prog: EpilogueProgram):
    """The GemmConfig to launch ``prog`` with (None: QuACK's default; other configs
    measured within noise of it, BENCHMARKS.md)."""
    if any(o.kind == Kind.COS_SIN for o in prog.operands):
        return _table_config()
    return None


def run(ks: KernelSource, module, a, b, operands) -> list[torch.Tensor]:
    """Launch the kernel, then the row-stage finaliser; outputs in program order."""
    prog = ks.program
    m, n = a.shape[0], b.shape[0]
    by_name = dict(zip((o.name for o in prog.operands), operands))
    kwargs, c = {}, None
    for bnd in ks.contract.operands:
        t = by_name[bnd.name]
        if bnd.param == "c":
            c = t
        elif bnd.param in module.epilogue.fn.__code__.co_varnames or \
                bnd.name in prog.index_operands:
            # a scalar goes by device pointer: no host sync, safe in CUDA graphs
            kwargs[bnd.param] = t.float().reshape(1).contiguous() \
                if bnd.kind == Kind.SCALAR else t
    out_dtype = {o.value: reference.dtype_from_name(o.dtype) for o in prog.outputs}
    width = {o.value: n // 2 if o.kind == Kind.PAIR else n for o in prog.outputs}
    out = {name: torch.empty(m, width[value], device=a.device, dtype=out_dtype[value])
           for value, name in ks.contract.tile_outputs}
    # QuACK compiles once per kernel and tensor-metadata class; dtypes stand in for that
    # class here, for the one log line per compile (a shape class QuACK sees as new only
    # shows as a slower first call, never as a wrong result)
    key = (ks.module_name, a.dtype, tuple(t.dtype for t in operands))
    first = key not in _seen
    t0 = time.perf_counter()
    config = config_for(prog)
    result = module.epilogue(a, b.t(), c, out=out, store_d="D" in out, tuned=False,
                             config=config, **kwargs)
    if first:
        if not torch.cuda.is_current_stream_capturing():  # timing only; never in a capture
            torch.cuda.synchronize(a.device)
        with _lock:
            _seen.add(key)
            COMPILES.append((ks.program.key, time.perf_counter() - t0))
        log.info("coda_rewrite: kernel %s ready in %.1f s (first call: compile or disk-cache "
                 "load)", ks.program.key, time.perf_counter() - t0)

    env: dict[str, torch.Tensor] = {}
    for value, name in ks.contract.tile_outputs:
        env[value] = result[name] if name in result else out[name]
    for r in ks.contract.reductions:
        env[r.value] = result[r.sink].reshape(m, 1).float()
        if r.combine == "select":  # rows whose index is out of range are never written
            (instr,) = [i for i in prog.body if i.out == r.value]
            idx = by_name[instr.args[1]].reshape(m, 1)
            ok = (idx >= 0) & (idx < n)
            env[r.value] = torch.where(ok, env[r.value], torch.zeros((), device=a.device))
    if ks.row_stage:
        for spec, t in zip(prog.operands, operands):
            if spec.kind in (Kind.PER_ROW, Kind.SCALAR):
                env[spec.name] = t.float().reshape(-1, 1) if spec.kind == Kind.PER_ROW \
                    else t.float()
        reference.eval_body(ks.row_stage, env, torch.float32)
    outs = []
    for o in prog.outputs:
        v = env[o.value]
        outs.append(v.reshape(m).to(out_dtype[o.value]) if o.kind == Kind.PER_ROW else v)
    return outs
