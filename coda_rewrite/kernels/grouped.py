"""The grouped GEMM with an epilogue program: routed experts (patterns/routed_experts.py).

    coda::grouped_gemm_epilogue(program, a, b, offsets, index, operands) -> outputs

is torch._grouped_mm's problem with the program of kernels/ops.py in its epilogue:
row s of the problem is ``a[index[s]]`` (``a[s]`` without an index: the gather of the
tokens routed to an expert, read by the GEMM instead of written first), its weight
expert e's ``b[e]`` [N, K] (nn.Linear layout per expert, as Hugging Face stores
``gate_up_proj`` and ``down_proj``) for the e with offsets[e-1] <= s < offsets[e]
(``offsets``: torch._grouped_mm's cumulative row counts, int32). Rows past offsets[-1]
are not written, as in torch's kernel (eager never reads them: Hugging Face fills them).
A program with pair outputs (act(gate)·up) reads each expert's rows as its [gate; up]
halves: QuACK's ``concat_layout`` interleaves them inside the kernel, so the weights are
used as they are stored (no re-layout, no copy). Operands: per-row vectors [S] (the
router's combine weight, a deferred row scale).

On Hopper with tensors that meet the contract this is QuACK's variable-length GEMM
(``cu_seqlens_m``, ``A_idx`` for the gather), planned once per tensor-metadata class
like every fused GEMM (ops.route_of); elsewhere the reference (codegen/reference.
run_grouped), the reason counted in ops.RUNTIME. Forward only: the op has no autograd
formula and refuses a call that could record one (the pattern leaves training graphs
to eager's ops, and says so).
"""

from __future__ import annotations

import torch

from ..codegen import reference
from ..codegen.program import REDUCTIONS, STATEFUL, Kind, parse
from . import ops, quack_path

# QuACK's default config (the tile the varlen MoE GEMMs were measured with: BENCHMARKS.md)
GROUPED_TILES = (128, 192, 2)


def contract_violation(program, a, b, offsets, index, operands) -> str | None:
    """Why these tensors break the grouped kernel's layout contract (None: they meet it)."""
    if not program.gemm or any(i.op in REDUCTIONS or i.op in STATEFUL for i in program.body) \
            or any(o.kind not in (Kind.TILE, Kind.PAIR) for o in program.outputs):
        return "the grouped kernel runs element-wise programs with tile outputs only"
    if a.dtype not in quack_path._GEMM_DTYPES or b.dtype != a.dtype:
        return f"GEMM operands {a.dtype}/{b.dtype} (QuACK's GEMM takes bf16/fp16 pairs)"
    if b.dim() != 3 or a.dim() != 2 or a.shape[1] != b.shape[2]:
        return f"shapes a {tuple(a.shape)}, b {tuple(b.shape)}: need [T, K] and [E, N, K]"
    rows = a.shape[0] if index is None else index.shape[0]
    e, n, k = b.shape
    if rows == 0 or n == 0 or k == 0 or a.shape[0] == 0:
        return "empty problem"
    if k % 8 or n % 8:
        return f"K={k} or N={n} not a multiple of 8 (16-byte TMA rows)"
    if any(o.kind == Kind.PAIR for o in program.outputs) and n % 32:
        return f"N={n}: gated pairs of [gate; up] halves need N a multiple of 32"
    if not (quack_path._aligned(a) and b.is_contiguous() and b.data_ptr() % 16 == 0):
        return "a not K-contiguous and 16-byte aligned, or b not contiguous"
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (e,):
        return f"offsets {offsets.dtype} {tuple(offsets.shape)}: need int32 [{e}]"
    if index is not None and (index.dtype not in (torch.int32, torch.int64)
                              or index.dim() != 1):
        return f"index {index.dtype} of {index.dim()} dims: need int32/int64 [S]"
    for spec, t in zip(program.operands, operands):
        if spec.kind != Kind.PER_ROW:
            return f"operand {spec.name} is {spec.kind.value}: the grouped kernel takes " \
                   "per-row vectors only"
        if t.dtype not in quack_path._STORE_DTYPES or tuple(t.shape) != (rows,) or \
                not quack_path._aligned(t):
            return f"operand {spec.name} {t.dtype} {tuple(t.shape)}: need [{rows}], aligned"
    return None


class GroupedLaunch:
    """One program on one tensor-metadata class of the grouped GEMM, planned once
    (QuACK's ``EpiMod.gemm`` resolved without a launch, with the variable-length and
    gather flags and the concat layout); a call converts the offsets to QuACK's
    cu_seqlens (a leading 0) and the index to int32, allocates the outputs and launches
    the plan."""

    __slots__ = ("ks", "gemm_plan", "kwargs", "outs", "m", "n", "device", "config", "key")

    def __init__(self, ks, module, a, b, offsets, index, operands, config=None):
        prog = ks.program
        self.ks, self.key = ks, prog.key
        self.m = a.shape[0] if index is None else index.shape[0]
        self.n, self.device = b.shape[1], a.device
        names = [o.name for o in prog.operands]
        self.kwargs = [(bnd.param, names.index(bnd.name)) for bnd in ks.contract.operands]
        dtypes = {o.value: reference.dtype_from_name(o.dtype) for o in prog.outputs}
        width = {o.value: self.n // 2 if o.kind == Kind.PAIR else self.n
                 for o in prog.outputs}
        self.outs = [(name, (self.m, width[value]), dtypes[value])
                     for value, name in ks.contract.tile_outputs]
        tile_m, tile_n, cluster_m = config or GROUPED_TILES
        self.config = quack_path.tile_config(tile_m, tile_n, cluster_m)  # for the report
        out = self._alloc()
        epi = {**self._operands(operands), **{k: v for k, v in out.items() if k != "D"}}
        pair = any(o.kind == Kind.PAIR for o in prog.outputs)
        self.gemm_plan = module.epilogue.gemm(
            a, b, out.get("D"), None, epi_args=epi, tile_M=tile_m, tile_N=tile_n,
            cluster_M=cluster_m, cluster_N=1, pingpong=True, persistent=True,
            cu_seqlens_m=_cu_seqlens(offsets), A_idx=_index32(index), b_kn=False,
            concat_layout=("B",) if pair else None, _launch=False)

    def _operands(self, operands) -> dict:
        return {param: operands[i] for param, i in self.kwargs}

    def _alloc(self) -> dict:
        return {name: torch.empty(shape, device=self.device, dtype=dtype)
                for name, shape, dtype in self.outs}

    def __call__(self, a, b, offsets, index, operands) -> list[torch.Tensor]:
        out = self._alloc()
        values = self._operands(operands)
        values.update(out)
        quack_path.run_gemm_epi_plan(self.gemm_plan, a, b, out.get("D"), None, values,
                                     cu_seqlens_m=_cu_seqlens(offsets),
                                     A_idx=_index32(index))
        return [out[name] for _, name in self.ks.contract.tile_outputs]


def _cu_seqlens(offsets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(offsets, (1, 0))


def _index32(index):
    return None if index is None or index.dtype == torch.int32 else index.int()


def _select(prog, text, a, b, offsets, index, operands):
    why = contract_violation(prog, a, b, offsets, index, operands) or \
        quack_path.device_violation(a) or quack_path.quack_available()
    if why is not None:
        return why
    try:
        ks, module = quack_path.load(text)
    except quack_path.Unlowerable as e:
        return f"not lowerable: {e}"
    return GroupedLaunch(ks, module, a, b, offsets, index, operands)


def execute(program: str, a, b, offsets, index, operands) -> list[torch.Tensor]:
    ops.refuse_gradients("grouped_gemm_epilogue", a, b, *operands)
    prog = parse(program)
    key = ("grouped", program, quack_path.metadata_key(a, b, offsets, index, operands))
    route = ops.route_of(key, lambda: _select(prog, program, a, b, offsets, index, operands))
    if isinstance(route, str):
        ops.count(prog.key, "reference", route)
        with torch.autocast(device_type=a.device.type, enabled=False):
            outs = reference.run_grouped(prog, a, b, offsets, index, operands)
        return ops._fresh(outs, [a, b, offsets, index, *operands])
    ops.count(prog.key, "kernel", "generated QuACK epilogue, grouped (variable-length) GEMM")
    return route(a, b, offsets, index, operands)


ops._lib.define("grouped_gemm_epilogue(str program, Tensor a, Tensor b, Tensor offsets, "
                "Tensor? index, Tensor[] operands) -> Tensor[]")
ops._lib.impl("grouped_gemm_epilogue", execute, "CompositeExplicitAutograd")
grouped_gemm_epilogue = torch.ops.coda.grouped_gemm_epilogue.default


def _fake(program, a, b, offsets, index, operands):
    ops.refuse_gradients("grouped_gemm_epilogue", a, b, *operands)
    prog = parse(program)
    rows, n = (a.shape[0] if index is None else index.shape[0]), b.shape[1]
    width = {Kind.TILE: n, Kind.PAIR: n // 2}
    return [a.new_empty((rows, width[o.kind]), dtype=reference.dtype_from_name(o.dtype))
            for o in prog.outputs]


torch.library.register_fake("coda::grouped_gemm_epilogue", _fake)


def grouped_linear(program: str, x: torch.Tensor, weight: torch.Tensor,
                   offsets: torch.Tensor, index: torch.Tensor | None,
                   *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the rewritten graph calls: ``program`` over the grouped GEMM of ``x`` [T, K]
    (rows ``x[index]``) with the experts' ``weight`` [E, N, K]. Outside tracing the op
    boundary is skipped (its dispatch costs host time a decode step pays per layer)."""
    if ops._direct(x, weight, operands):
        return tuple(execute(program, x, weight, offsets, index, list(operands)))
    return tuple(grouped_gemm_epilogue(program, x, weight, offsets, index, list(operands)))
