"""The grouped GEMM with an epilogue program: routed experts (patterns/routed_experts.py).

    coda::grouped_gemm_epilogue(program, a, b, offsets, index, operands, interleaved,
                                bounds_proved) -> outputs

is torch._grouped_mm's problem with the program of kernels/ops.py in its epilogue:
row s of the problem is ``a[index[s]]`` (``a[s]`` without an index: the gather of the
tokens routed to an expert, read by the GEMM instead of written first), its weight
expert e's ``b[e]`` [N, K] for the e with offsets[e-1] <= s < offsets[e] (``offsets``:
torch._grouped_mm's cumulative row counts, int32). ``b`` is [E, N, K] K-contiguous (the
nn.Linear layout per expert, as most Hugging Face MoEs store ``gate_up_proj`` and
``down_proj``) or N-contiguous (a transposed view of [E, K, N] weights, gpt-oss's):
QuACK reads either in place. Rows past offsets[-1] are not written, as in torch's
kernel (eager never reads them: Hugging Face fills them). A program with pair outputs
(act(gate)·up) reads each expert's rows as its [gate; up] halves, interleaved inside the
kernel by QuACK's ``concat_layout`` (the weights used as stored: no re-layout, no copy),
or, with ``interleaved``, as adjacent (gate, up) rows already ([g0, u0, g1, u1, ...],
gpt-oss's). Operands: per-row vectors [S] (the router's combine weight, a deferred row
scale) and per-expert vectors [E, N] (each expert's bias: row e applies to expert e's
rows; in the weight's row order). A planned launch trusts the routing's values, so each
call checks them on the device (check_routing: a few tiny kernels per launch) unless the
caller proved them in bounds from the graph (``bounds_proved``: algebra/routed_experts.
routing_in_bounds, e.g. offsets = cumsum(histc(ids))).

On Hopper with tensors that meet the contract this is QuACK's variable-length GEMM
(``cu_seqlens_m``, ``A_idx`` for the gather), planned once per tensor-metadata class
like every fused GEMM (ops.route_of); elsewhere the reference (codegen/reference.
run_grouped), the reason counted in ops.RUNTIME. The op itself has no autograd formula
(it refuses a call that could record one); graphs that compute gradients reach it through
GroupedGated / GroupedDown below, whose backward rules run the grouped dgrad and wgrad
GEMMs (``coda::grouped_mm``) with the activation's derivative and the combine weight's
gradient as elementwise ops between them: nothing recomputed but the gather. Where the
down GEMM reads the gated GEMM's output itself, kernels/grouped_dgated.GroupedGatedDown
takes its place: the activation's derivative and the combine weight's gradient in the
down projection's dgrad epilogue, the CODA way.
"""

from __future__ import annotations

import torch

from .. import routing
from ..codegen import reference
from ..codegen.program import PAIRWISE, REDUCTIONS, STATEFUL, Kind, parse
from . import inductor_calls, ops, quack_path

# QuACK's default config (the tile the varlen MoE GEMMs were measured with: BENCHMARKS.md)
GROUPED_TILES = (128, 192, 2)


def static_violation(dtype: torch.dtype, k: int, n: int, pairs: bool) -> str | None:
    """Why grouped GEMMs of this operand dtype and these widths break the contract
    whatever their tensors (None: these allow it): what a graph's static shapes tell
    before any call (patterns/routed_experts: such experts are left unfused on the GPU)."""
    if dtype not in quack_path._GEMM_DTYPES:
        return f"GEMM operands {dtype} (QuACK's GEMM takes bf16/fp16 pairs)"
    if k % 8 or n % 8:
        return f"K={k} or N={n} not a multiple of 8 (16-byte TMA rows)"
    if pairs and n % 32:
        return f"N={n}: gated pairs need N a multiple of 32"
    return None


def contract_violation(program, a, b, offsets, index, operands,
                       interleaved: bool) -> str | None:
    """Why these tensors break the grouped kernel's layout contract (None: they meet it)."""
    if not program.gemm or any(i.op in REDUCTIONS or i.op in STATEFUL for i in program.body) \
            or any(o.kind not in (Kind.TILE, Kind.PAIR) for o in program.outputs):
        return "the grouped kernel runs element-wise programs with tile outputs only"
    if b.dtype != a.dtype:
        return f"GEMM operands {a.dtype}/{b.dtype} (QuACK's GEMM takes bf16/fp16 pairs)"
    if b.dim() != 3 or a.dim() != 2 or a.shape[1] != b.shape[2]:
        return f"shapes a {tuple(a.shape)}, b {tuple(b.shape)}: need [T, K] and [E, N, K]"
    rows = a.shape[0] if index is None else index.shape[0]
    e, n, k = b.shape
    if rows == 0 or n == 0 or k == 0 or a.shape[0] == 0:
        return "empty problem"
    pairs = any(o.kind == Kind.PAIR for o in program.outputs)
    why = static_violation(a.dtype, k, n, pairs)
    if why is not None:
        return why
    if not (quack_path._aligned(a) and (b.is_contiguous() or b.mT.is_contiguous())
            and b.data_ptr() % 16 == 0):
        return "a not K-contiguous and 16-byte aligned, or b neither K- nor N-contiguous"
    if pairs and not interleaved and not b.is_contiguous():
        return "[gate; up] halves (QuACK's concat layout) need b K-contiguous"
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (e,):
        return f"offsets {offsets.dtype} {tuple(offsets.shape)}: need int32 [{e}]"
    if index is not None and (index.dtype not in (torch.int32, torch.int64)
                              or index.dim() != 1):
        return f"index {index.dtype} of {index.dim()} dims: need int32/int64 [S]"
    for spec, t in zip(program.operands, operands):
        shape = {Kind.PER_ROW: (rows,), Kind.PER_FEATURE: (e, n)}.get(spec.kind)
        if shape is None:
            return f"operand {spec.name} is {spec.kind.value}: the grouped kernel takes " \
                   "per-row and per-expert vectors only"
        if spec.kind == Kind.PER_FEATURE and pairs and not interleaved:
            return f"operand {spec.name}: a per-expert vector over [gate; up] halves " \
                   "(the kernel's columns are interleaved)"
        if t.dtype not in quack_path._STORE_DTYPES or tuple(t.shape) != shape or \
                not quack_path._aligned(t):
            return f"operand {spec.name} {t.dtype} {tuple(t.shape)}: need {list(shape)}, " \
                   "aligned"
    return None


class GroupedLaunch:
    """One program on one tensor-metadata class of the grouped GEMM, planned once
    (QuACK's ``EpiMod.gemm`` resolved without a launch, with the variable-length and
    gather flags and the concat layout where the pairs are halves); a call converts the
    offsets to QuACK's cu_seqlens (a leading 0) and the index to int32, allocates the
    outputs and launches the plan."""

    __slots__ = ("ks", "gemm_plan", "kwargs", "outs", "m", "n", "device", "config", "key",
                 "results")

    def __init__(self, ks, module, a, b, offsets, index, operands, interleaved,
                 config=None):
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
        buffers = dict(ks.contract.tile_outputs)  # value -> QuACK's buffer name
        self.results = [buffers[o.value] for o in prog.outputs]  # the program's order
        tile_m, tile_n, cluster_m = config or GROUPED_TILES
        self.config = quack_path.tile_config(tile_m, tile_n, cluster_m)  # for the report
        out = self._alloc()
        epi = {**self._operands(operands), **{k: v for k, v in out.items() if k != "D"}}
        pair = any(o.kind == Kind.PAIR for o in prog.outputs)
        self.gemm_plan = module.epilogue.gemm(
            a, b, out.get("D"), None, epi_args=epi, tile_M=tile_m, tile_N=tile_n,
            cluster_M=cluster_m, cluster_N=1, pingpong=True, persistent=True,
            cu_seqlens_m=_cu_seqlens(offsets), A_idx=_index32(index), b_kn=False,
            concat_layout=("B",) if pair and not interleaved else None, _launch=False)

    def _operands(self, operands) -> dict:
        return {param: operands[i] for param, i in self.kwargs}

    def _alloc(self) -> dict:
        return {name: torch.empty(shape, device=self.device, dtype=dtype)
                for name, shape, dtype in self.outs}

    def __call__(self, a, b, offsets, index, operands, bounds_proved: bool = False
                 ) -> list[torch.Tensor]:
        if not bounds_proved:
            check_routing("grouped_gemm_epilogue", offsets, self.m, index, a.shape[0])
        out = self._alloc()
        values = self._operands(operands)
        values.update(out)
        quack_path.run_gemm_epi_plan(self.gemm_plan, a, b, out.get("D"), None, values,
                                     cu_seqlens_m=_cu_seqlens(offsets),
                                     A_idx=_index32(index))
        return [out[name] for name in self.results]


def check_routing(op: str, offsets: torch.Tensor, rows: int,
                  index: torch.Tensor | None = None, sources: int = 0) -> None:
    """A planned launch trusts its tensors' metadata, not their values: offsets past the
    problem's rows (or an index past the source's) would read or write out of bounds.
    Checked on the device (no host sync; a failed check is a device-side assert, as eager's
    indexing raises one)."""
    ok = (offsets[-1] <= rows) & (torch.diff(offsets) >= 0).all() & (offsets[0] >= 0)
    if index is not None:
        lo, hi = torch.aminmax(index)
        ok = ok & (lo >= 0) & (hi < sources)
    torch._assert_async(ok, f"coda::{op}: offsets not cumulative row counts within the "
                            "rows, or a routed row index out of range")


def _cu_seqlens(offsets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(offsets, (1, 0))


def _index32(index):
    return None if index is None or index.dtype == torch.int32 else index.int()


def _select(prog, text, a, b, offsets, index, operands, interleaved):
    why = contract_violation(prog, a, b, offsets, index, operands, interleaved) or \
        quack_path.device_violation(a) or quack_path.quack_available()
    if why is not None:
        return why
    try:
        ks, module = quack_path.load(text)
    except quack_path.Unlowerable as e:
        return f"not lowerable: {e}"
    return GroupedLaunch(ks, module, a, b, offsets, index, operands, interleaved)


def execute(program: str, a, b, offsets, index, operands, interleaved: bool = False,
            bounds_proved: bool = False) -> list[torch.Tensor]:
    ops.refuse_gradients("grouped_gemm_epilogue", a, b, *operands)
    prog = parse(program)
    key = ("grouped", program, interleaved,
           quack_path.metadata_key(a, b, offsets, index, operands))
    route = ops.route_of(key, lambda: _select(prog, program, a, b, offsets, index, operands,
                                              interleaved))
    if isinstance(route, str):
        ops.count_reference(prog.key, route, a.device)
        with torch.autocast(device_type=a.device.type, enabled=False):
            outs = reference.run_grouped(prog, a, b, offsets, index, operands, interleaved)
        return ops._fresh(outs, [a, b, offsets, index, *operands])
    ops.count(prog.key, "kernel", "generated QuACK epilogue, grouped (variable-length) GEMM")
    return route(a, b, offsets, index, operands, bounds_proved)


ops._lib.define("grouped_gemm_epilogue(str program, Tensor a, Tensor b, Tensor offsets, "
                "Tensor? index, Tensor[] operands, bool interleaved=False, "
                "bool bounds_proved=False) -> Tensor[]")
inductor_calls.python_kernel(ops._lib, "grouped_gemm_epilogue", execute)
grouped_gemm_epilogue = torch.ops.coda.grouped_gemm_epilogue.default


def _fake(program, a, b, offsets, index, operands, interleaved=False, bounds_proved=False):
    ops.refuse_gradients("grouped_gemm_epilogue", a, b, *operands)
    prog = parse(program)
    rows, n = (a.shape[0] if index is None else index.shape[0]), b.shape[1]
    width = {Kind.TILE: n, Kind.PAIR: n // 2}
    return [a.new_empty((rows, width[o.kind]), dtype=reference.dtype_from_name(o.dtype))
            for o in prog.outputs]


torch.library.register_fake("coda::grouped_gemm_epilogue", _fake)


def grouped_linear(program: str, x: torch.Tensor, weight: torch.Tensor,
                   offsets: torch.Tensor, index: torch.Tensor | None,
                   *operands: torch.Tensor, interleaved: bool = False,
                   perm: torch.Tensor | None = None, top_k: int = 0,
                   bounds_proved: bool = False) -> tuple[torch.Tensor, ...]:
    """What the rewritten graph calls: ``program`` over the grouped GEMM of ``x`` [T, K]
    (rows ``x[index]``) with the experts' ``weight`` [E, N, K]. Outside tracing the op
    boundary is skipped (its dispatch costs host time a decode step pays per layer);
    where a gradient can be asked for, the autograd Functions below. ``perm``, ``top_k``:
    index is perm // top_k for a permutation perm of T·top_k rows (algebra/
    routed_experts.token_order), which the gather's gradient uses. ``bounds_proved``: the
    caller proved offsets and index in bounds (no device-side check per launch)."""
    if ops._needs_grad(x, weight, operands):
        prog = parse(program)
        if any(o.kind == Kind.PAIR for o in prog.outputs):
            if len(prog.outputs) < 2:  # the backward reads the stored pre-activation
                raise RuntimeError(f"coda: {prog.key} stores no pre-activation and was "
                                   "called where a gradient can be asked for (a graph "
                                   "rewritten for inference, run with gradients)")
            return GroupedGated.apply(program, x, weight, offsets, index, interleaved,
                                      perm, top_k, bounds_proved, *operands)
        return (GroupedDown.apply(program, x, weight, offsets, bounds_proved, *operands),)
    if ops._direct(x, weight, operands):
        return tuple(execute(program, x, weight, offsets, index, list(operands), interleaved,
                             bounds_proved))
    return tuple(grouped_gemm_epilogue(program, x, weight, offsets, index, list(operands),
                                       interleaved, bounds_proved))


# ---- training: the backward rules ----------------------------------------------------------

def _grouped_mm_runs(a, b) -> bool:
    """Whether torch._grouped_mm takes these operands (CUDA, one 16-bit dtype, rows of a
    multiple of 16 bytes)."""
    return a.is_cuda and a.dtype in quack_path._GEMM_DTYPES and b.dtype == a.dtype and \
        all(t.shape[-1] * t.element_size() % 16 == 0 for t in (a, b))


def grouped_mm_impl(a, b, offsets, wgrad: bool):
    """The grouped GEMMs of the backward. ``wgrad=False``: a [S, K] times b[e] [K, N]
    per group -> [S, N], rows past offsets[-1] unspecified (the callers zero them:
    live_rows); ``wgrad=True``: per group
    a[rows]ᵀ·b[rows] for a [S, M], b [S, N] -> [E, M, N], an expert with no row zero.
    torch._grouped_mm where it runs (CUDA, 16-bit, 16-byte strides), else the reference's
    loop (float32 accumulation)."""
    experts = offsets.shape[0]
    fast = _grouped_mm_runs(a, b)
    if fast and wgrad:
        out = torch._grouped_mm(a.t(), b, offs=offsets)
        if torch.cuda.get_device_capability(a.device)[0] == 9:
            return out  # an expert with no row gets zeros on Hopper
        # elsewhere not (seen on Blackwell: pytorch/pytorch#172439): a pass over [E, M, N]
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return torch.where((counts > 0)[:, None, None], out, 0)
    if fast:  # rows past offsets[-1] unwritten: the caller masks them (live_rows)
        return torch._grouped_mm(a, b, offs=offsets)
    cd = reference.accumulate_dtype(a.dtype)
    if not wgrad:
        return reference.grouped_mm(a, b, offsets, cd).to(a.dtype)
    out = a.new_zeros(experts, a.shape[1], b.shape[1], dtype=cd)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[e] = a[start:end].to(cd).t() @ b[start:end].to(cd)
        start = max(start, end)
    return out.to(a.dtype)


def live_rows(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows past offsets[-1] (no expert's: left unwritten by the grouped
    GEMM) zeroed. A graph op, not part of coda::grouped_mm: Inductor fuses it into the
    elementwise pass that reads the product next (inside the op it was a pass of its
    own over [S, N] per dgrad: 0.24 ms each at the Qwen3-30B-A3B shape)."""
    live = torch.arange(out.shape[0], device=out.device) < offsets[-1]
    return torch.where(live[:, None], out, 0)


def _grouped_mm_fake(a, b, offsets, wgrad):
    if wgrad:
        return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])
    return a.new_empty(a.shape[0], b.shape[-1])


ops._lib.define("grouped_mm(Tensor a, Tensor b, Tensor offsets, bool wgrad) -> Tensor")
ops._lib.impl("grouped_mm", grouped_mm_impl, "CompositeExplicitAutograd")
torch.library.register_fake("coda::grouped_mm", _grouped_mm_fake)


def _pair(program: str):
    (ins,) = [i for i in parse(program).body if i.op in PAIRWISE]
    return ins.op, reference.pair_params(ins)


def per_expert_sum(d: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    """Σ over each expert's rows of ``d`` [S, N] -> [E, N] (rows past offsets[-1] belong to
    no expert, and are not read): a per-expert vector's gradient. Where the grouped GEMM
    runs, as one: 1ᵀ·d per expert (the wgrad of a ones column, float32 accumulation, one
    rounding to d's dtype) — an index_add onto E rows made every routed row an atomic
    add onto a handful of addresses (1.77 ms for gpt-oss-20b's two biases at 8192
    tokens, H200). Elsewhere in the compute dtype."""
    if _grouped_mm_runs(d, d):
        ones = d.new_ones(d.shape[0], 8)  # 8 columns: 16-byte rows for the GEMM
        return torch.ops.coda.grouped_mm(ones, d, offsets, True)[:, 0]
    cd = reference.accumulate_dtype(d.dtype)
    e = reference.expert_of_rows(offsets, d.shape[0])
    return d.new_zeros(experts + 1, d.shape[1], dtype=cd).index_add_(0, e, d.to(cd))[:experts]


def weight_grad(d: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """Each expert's dᵀ·rows [E, N, K] (``d`` [S, N], ``rows`` [S, K]) laid out like
    ``weight``: for an N-contiguous weight (a transposed view of [E, K, N] storage) the
    wgrad GEMM writes [E, K, N] and this is its transposed view, so the gradient reaches
    the parameter in its own layout (a transposed one would make every accumulation
    into .grad a strided pass over the whole weight)."""
    if not weight.is_contiguous() and weight.mT.is_contiguous():
        return torch.ops.coda.grouped_mm(rows, d, offsets, True).mT
    return torch.ops.coda.grouped_mm(d, rows, offsets, True)


def _named(program: str, operands) -> dict:
    return dict(zip((o.name for o in parse(program).operands), operands))


class GroupedGated(torch.autograd.Function):
    """The gated grouped GEMM where autograd records it: the forward also stores the
    pre-activation p [S, 2I] (interleaved, as the kernel computes it; the training
    program's tile output), which is all the backward needs besides the inputs:

        dp  = the pair's derivative at (p, dy)   (reference.dgated: dSwiGLU, dGeGLU, ...)
              + p's own gradient                 (the down GEMM's fused backward,
                                                  grouped_dgated.GroupedGatedDown, forms
                                                  dp in its dgrad epilogue)
        G   = dp·W_gu[e]                         (grouped dgrad)
        dx  = Σ over routed rows of r[s]·G       (each token's top-k rows summed after
                                                  the inverse permutation where the index
                                                  is perm // k, else an index_add)
        dW_gu[e] = (r·dp)ᵀ·x[rows of e]     (grouped wgrad; the gather made again)
        db[e] = Σ over e's rows of dp       (a per-expert bias, where the program has one)
        dr[s] = Σ_k x[s, k]·G[s, k]         (a deferred rstd per routed row, where the
                                             program scales acc by one: no acc needed)

    (dp in the weight's row order: [gate; up] halves, or interleaved as stored; r = 1
    where the program has no row scale)."""

    @staticmethod
    def forward(program, x, weight, offsets, index, interleaved, perm, top_k, bounds_proved,
                *operands):
        return tuple(grouped_gemm_epilogue(program, x, weight, offsets, index,
                                           list(operands), interleaved, bounds_proved))

    @staticmethod
    def setup_context(ctx, inputs, output):
        (program, x, weight, offsets, index, interleaved, perm, top_k, _,
         *operands) = inputs
        ctx.pair, ctx.interleaved, ctx.top_k = _pair(program), interleaved, top_k
        named = _named(program, operands)
        ctx.has_bias, ctx.names = "bias" in named, list(named)
        if set(named) - {"bias", "r"}:
            raise RuntimeError(f"coda: {parse(program).key}: the gated grouped GEMM's "
                               "backward takes a per-expert bias and a row scale only")
        ctx.mark_non_differentiable(*output[2:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, offsets, index, output[1], named.get("r"), perm)

    @staticmethod
    def backward(ctx, dy, dp_given, *_):
        ops.refuse_second_derivative("the routed experts' gate/up GEMM")
        x, weight, offsets, index, p, r, perm = ctx.saved_tensors
        cd = reference.accumulate_dtype(p.dtype)
        op, params = ctx.pair
        dp = dp_given
        if dy is not None:
            dp_y, _ = reference.dgated(op, dy.to(cd), p, *params)
            dp = dp_y if dp is None else (dp.to(cd) + dp_y.to(cd)).to(p.dtype)
        if dp is None:
            return (None,) * (9 + len(ctx.names))
        if not ctx.interleaved:  # [gate; up] like W_gu's rows
            dp = torch.cat((dp[:, 0::2], dp[:, 1::2]), dim=-1)
        # only what is asked for: frozen expert weights (adapter fine-tuning) skip the
        # wgrad GEMM, a frozen input the dgrad
        want_x, want_w = ctx.needs_input_grad[1:3]
        want = dict(zip(ctx.names, ctx.needs_input_grad[9:]))
        want_r = r is not None and want.get("r", False)
        rows = (x if index is None else x[index]) if want_w or want_r else None
        g = live_rows(torch.ops.coda.grouped_mm(dp, weight, offsets, False), offsets) \
            if want_x or want_r else None
        grads = {}
        d_acc, rf = dp, None
        if r is not None:
            rf = r.to(cd)[:, None]
            d_acc = (dp.to(cd) * rf).to(dp.dtype)
            if want_r:
                grads["r"] = (rows.to(cd) * g.to(cd)).sum(-1).to(r.dtype)
        dx = dw = None
        if want_w:
            dw = weight_grad(d_acc, rows, offsets, weight).to(weight.dtype)
        if want_x:
            dx_rows = g if rf is None else (g.to(cd) * rf).to(x.dtype)
            if index is None:
                dx = dx_rows
            elif perm is not None:  # token t's rows are inv[t·k : (t+1)·k]: no atomic adds
                dx = routing.back_to_tokens(dx_rows, routing.inverse_permutation(perm),
                                            ctx.top_k)  # summed in float32
            else:
                dx = x.new_zeros(x.shape, dtype=cd).index_add_(0, index, dx_rows.to(cd))
            dx = dx.to(x.dtype)
        if ctx.has_bias and want.get("bias", False):
            grads["bias"] = per_expert_sum(dp, offsets, weight.shape[0]).to(weight.dtype)
        return (None, dx, dw, None, None, None, None, None, None,
                *(grads.get(n) for n in ctx.names))


def down_operand_names(program: str) -> list[str]:
    """The down program's operand names, which its backward (GroupedDown's, or the fused
    grouped_dgated.GroupedGatedDown's) takes: a combine weight r and a bias."""
    names = [o.name for o in parse(program).operands]
    if set(names) - {"r", "bias"}:
        raise RuntimeError(f"coda: {parse(program).key}: the down grouped GEMM's backward "
                           "takes a combine weight r and a bias only")
    return names


class GroupedDown(torch.autograd.Function):
    """The down grouped GEMM (o = w[s]·(y·W_d[e]ᵀ + b[e]) with the combine weight w and
    a per-expert bias b, either or both optional) where autograd records it. With the
    grouped dgrad g = do·W_d[e]:

        dy = w[s]·g      dw[s] = Σ_i y[s, i]·g[s, i] + Σ_j do[s, j]·b[e, j]
        dW_d[e] = (w·do)ᵀ·y[rows of e]      db[e] = Σ over e's rows of w·do

    (dw from g and y: no stored unscaled output, no GEMM recomputed)."""

    @staticmethod
    def forward(program, y, weight, offsets, bounds_proved, *operands):
        return grouped_gemm_epilogue(program, y, weight, offsets, None, list(operands),
                                     False, bounds_proved)[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        program, y, weight, offsets, _, *operands = inputs
        ctx.names = down_operand_names(program)
        ctx.save_for_backward(y, weight, offsets, *operands)

    @staticmethod
    def backward(ctx, do):
        ops.refuse_second_derivative("the routed experts' down GEMM")
        y, weight, offsets, *operands = ctx.saved_tensors
        by_name = dict(zip(ctx.names, operands))
        cd = reference.accumulate_dtype(y.dtype)
        w, bias = by_name.get("r"), by_name.get("bias")
        want_y, want_w = ctx.needs_input_grad[1:3]
        want = dict(zip(ctx.names, ctx.needs_input_grad[5:]))
        want_r = w is not None and want.get("r", False)
        d_acc = do.to(y.dtype) if w is None else (do.to(cd) * w.to(cd)[:, None]).to(y.dtype)
        g = live_rows(torch.ops.coda.grouped_mm(do.to(y.dtype), weight, offsets, False),
                      offsets) if want_y or want_r else None
        dy = None
        if want_y:
            dy = g if w is None else (g.to(cd) * w.to(cd)[:, None]).to(y.dtype)
        dw = weight_grad(d_acc, y, offsets, weight).to(weight.dtype) if want_w else None
        grads = {}
        if want_r:
            # rows past the last offset: y was never written there (the kernel's), g is 0
            live = torch.arange(y.shape[0], device=y.device) < offsets[-1]
            dot = (g.to(cd) * y.to(cd)).sum(-1)
            if bias is not None:
                e = reference.expert_of_rows(offsets, y.shape[0]).clamp(max=weight.shape[0] - 1)
                dot = dot + (do.to(cd) * bias.to(cd)[e]).sum(-1)
            grads["r"] = torch.where(live, dot, 0).to(w.dtype)
        if bias is not None and want.get("bias", False):
            grads["bias"] = per_expert_sum(d_acc, offsets, weight.shape[0]).to(bias.dtype)
        return (None, dy, dw, None, None, *(grads.get(n) for n in ctx.names))
