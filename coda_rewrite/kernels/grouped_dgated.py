"""The routed experts' backward fused the CODA way: the gated activation's derivative and
the combine weight's gradient in the epilogue of the down projection's grouped dgrad GEMM.

    coda::grouped_dgated(op, params, dout [S, H], w_down [E, H, I], offsets, p [S, 2I],
                         score [S]?, bounds_proved) -> (dp [S, 2I], h·w [S, I],
                                                        dscore [S] float32)

The forward of a routed expert block is o[s] = w[s]·(h[s]·W_d[e]ᵀ) with h = pair(p) the
gated grouped GEMM's output, p its stored pre-activation (interleaved [g0, u0, ...]) and
w the router's combine weight of routed row s (kernels/grouped.py). Its backward starts
with the grouped dgrad acc = dout·W_d[e] [S, I]; the rules (grouped.GroupedDown, then
GroupedGated) write acc, read it back for dh = w·acc, the combine weight's gradient
Σ_j h·acc and the activation's derivative, and keep h from the forward for W_d's
gradient. Here the dgrad GEMM's epilogue (codegen/dgated_source.generate(routed=True),
the shape of QuACK's own ``make_dgated_moe_mod``) reads p and w and writes

    D       = dp = pair'(p)·(w·acc)        the gate/up GEMM's backward reads it as it is
    postact = h·w                          W_d's gradient is doutᵀ·(h·w), per expert
    dscore  = Σ_j h[s, j]·acc[s, j]        w's gradient (float32 per-tile partials,
                                           summed here over the N tiles)

so acc is never written, h is never kept (S × I values per layer), and the down GEMM's
forward keeps p instead of y (which the gated GEMM keeps anyway). Without a combine
weight (score None) the dense epilogue runs under the variable-length groups: dp and h.

QuACK's variable-length GEMM (``cu_seqlens_m``) on Hopper, planned once per tensor-
metadata class like every fused GEMM; elsewhere the reference (reference.grouped_mm,
reference.dgated), the reason counted in ops.RUNTIME. Rows past offsets[-1] belong to no
expert: the kernel does not write them, and nothing downstream reads them
(GroupedGatedDown).
"""

from __future__ import annotations

import functools

import torch

from ..codegen import dgated_source, reference
from ..codegen.op_table import OPS, pair_value
from . import ops, quack_path
from .grouped import (_cu_seqlens, check_routing, down_operand_names, grouped_gemm_epilogue,
                      grouped_linear, per_expert_sum, weight_grad)

# 128 x 128 tiles, cluster 2 (as the dense epilogue's kernels/dgated.LARGE_M_TILES): the
# best of five configs at the three MoE shapes of benchmarks/moe.py (H200, 8192 tokens):
# 0.514 / 3.529 / 1.113 ms at Qwen3-30B-A3B / Mixtral-8x7B / gpt-oss-20b against QuACK's
# default 128 x 192's 0.733 / 4.747 / 2.142 (its D is twice the GEMM's N wide, packed
# pairs); 64 x 192 ties at the Qwen3 shape only (BENCHMARKS.md, twelfth session)
ROUTED_TILES = (128, 128, 2)


def contract_violation(dout, weight, offsets, p, score) -> str | None:
    """Why these tensors break the kernel's contract (None: they meet it)."""
    if dout.dim() != 2 or weight.dim() != 3 or p.dim() != 2:
        return "dout [S, H], w_down [E, H, I] and p [S, 2I] expected"
    (rows, hidden), (experts, _, inter) = dout.shape, weight.shape
    if tuple(weight.shape[1:]) != (hidden, inter) or tuple(p.shape) != (rows, 2 * inter):
        return (f"shapes dout {tuple(dout.shape)}, w_down {tuple(weight.shape)}, p "
                f"{tuple(p.shape)}: expected [S, H], [E, H, I], [S, 2I]")
    if dout.dtype not in quack_path._GEMM_DTYPES or weight.dtype != dout.dtype or \
            p.dtype != dout.dtype:
        return f"dtypes {dout.dtype}/{weight.dtype}/{p.dtype}: one 16-bit dtype"
    if rows == 0 or hidden % 8 or inter % 8:
        return f"S={rows}, H={hidden}, I={inter}: rows, and H, I multiples of 8"
    if not (quack_path._aligned(dout) and quack_path._aligned(p)
            and (weight.is_contiguous() or weight.mT.is_contiguous())
            and weight.data_ptr() % 16 == 0):
        return "dout or p not row-major and 16-byte aligned, or w_down neither H- nor " \
               "I-contiguous"
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (experts,):
        return f"offsets {offsets.dtype} {tuple(offsets.shape)}: need int32 [{experts}]"
    if score is not None and (score.dtype != torch.float32 or tuple(score.shape) != (rows,)
                              or not quack_path._aligned(score)):
        return f"score {score.dtype} {tuple(score.shape)}: need float32 [{rows}], aligned"
    return None


@functools.lru_cache(maxsize=None)
def load(op: str, params: tuple, routed: bool):
    return quack_path.import_generated(dgated_source.generate(op, params, routed))


class Launch:
    """The grouped dgrad GEMM + epilogue on one tensor-metadata class, resolved once
    (QuACK's ``EpiMod.gemm`` without a launch); a call allocates dp, h·w and the dscore
    partials, launches, and sums the partials."""

    __slots__ = ("gemm_plan", "device", "dtype", "partials", "config", "key", "m", "n")

    def __init__(self, module, dout, weight, offsets, p, score, config=None, op: str = ""):
        """``config`` overrides ROUTED_TILES (benchmarks); ``op`` names the kernel in the
        report's launch configs (ops.launch_configs: key, m, n, config). m: the routed
        rows, n: the intermediate width I."""
        self.key, self.m, self.n = f"dgated_routed_{op}", dout.shape[0], weight.shape[2]
        self.device, self.dtype = dout.device, dout.dtype
        tile_m, tile_n, cluster_m = config or ROUTED_TILES
        self.config = quack_path.tile_config(tile_m, tile_n, cluster_m)
        mod = module.epilogue
        self.partials = None
        if score is not None:
            self.partials = mod.sinks["dscore"].sink_alloc_shape(
                (self.m,), self.n, tile_m, tile_n)
        out = self._alloc()
        epi = {k: v for k, v in out.items() if k != "D"}
        if score is not None:
            epi["score"] = score
        # B as QuACK's (n, k) = (I, H) per expert: W_d[e] read in place, either major
        self.gemm_plan = mod.gemm(
            dout, weight.mT, out["D"], p, epi_args=epi, tile_M=tile_m, tile_N=tile_n,
            cluster_M=cluster_m, cluster_N=1, pingpong=True, persistent=True,
            cu_seqlens_m=_cu_seqlens(offsets), b_kn=False, _launch=False)

    def _alloc(self) -> dict:
        out = {"D": torch.empty(self.m, 2 * self.n, device=self.device, dtype=self.dtype),
               "postact": torch.empty(self.m, self.n, device=self.device, dtype=self.dtype)}
        if self.partials is not None:
            out["dscore"] = torch.empty(self.partials, device=self.device,
                                        dtype=torch.float32)
        return out

    def __call__(self, dout, weight, offsets, p, score, bounds_proved: bool = False
                 ) -> list[torch.Tensor]:
        if not bounds_proved:  # grouped.check_routing: unless the graph proved them
            check_routing("grouped_dgated", offsets, self.m)
        out = self._alloc()
        values = {k: v for k, v in out.items() if k != "D"}
        if score is not None:
            values["score"] = score
        quack_path.run_gemm_epi_plan(self.gemm_plan, dout, weight.mT, out["D"], p, values,
                                     cu_seqlens_m=_cu_seqlens(offsets))
        results = [out["D"], out["postact"]]
        if score is not None:
            results.append(out["dscore"].sum(-1))
        return results


def run_reference(op: str, params, dout, weight, offsets, p, score) -> list[torch.Tensor]:
    """The same math in torch: the grouped dgrad accumulated as the kernel does (float32
    from 16-bit operands), then reference.dgated at dh = w·acc."""
    cd = reference.accumulate_dtype(p.dtype)
    with torch.autocast(device_type=dout.device.type, enabled=False):
        acc = reference.grouped_mm(dout, weight, offsets, cd)
        w = torch.ones((), dtype=cd, device=p.device) if score is None else \
            score.to(cd)[:, None]
        dp, _ = reference.dgated(op, acc * w, p, *params)
        g, u = (p[:, k::2].to(cd) for k in (0, 1))
        h = pair_value(OPS[op], g, u, *params)
        results = [dp, (h * w).to(p.dtype)]
        if score is not None:
            results.append((h * acc).sum(-1))
    return results


def _select(op, params, dout, weight, offsets, p, score):
    if not dgated_source.supported(op):
        return f"no backward epilogue for {op}"
    why = contract_violation(dout, weight, offsets, p, score) or \
        quack_path.device_violation(dout) or quack_path.quack_available()
    if why is not None:
        return why
    return Launch(load(op, tuple(params), score is not None), dout, weight, offsets, p, score,
                  op=op)


def execute(op: str, params: list[float], dout, weight, offsets, p, score=None,
            bounds_proved: bool = False) -> list[torch.Tensor]:
    key = ("grouped_dgated", op, tuple(params),
           quack_path.metadata_key(dout, weight, offsets, p, score))
    route = ops.route_of(key, lambda: _select(op, params, dout, weight, offsets, p, score))
    name = f"dgated_routed_{op}"
    if isinstance(route, str):
        ops.count_reference(name, route, dout.device)
        return run_reference(op, params, dout, weight, offsets, p, score)
    ops.count(name, "kernel", "generated QuACK epilogue, grouped dgrad (packed C/D)")
    return route(dout, weight, offsets, p, score, bounds_proved)


def _fake(op, params, dout, weight, offsets, p, score=None, bounds_proved=False):
    rows, inter = dout.shape[0], weight.shape[2]
    outs = [p.new_empty(rows, 2 * inter), p.new_empty(rows, inter)]
    if score is not None:
        outs.append(p.new_empty(rows, dtype=reference.accumulate_dtype(p.dtype)))
    return outs


ops._lib.define("grouped_dgated(str op, float[] params, Tensor dout, Tensor weight, "
                "Tensor offsets, Tensor p, Tensor? score, bool bounds_proved=False) "
                "-> Tensor[]")
ops._lib.impl("grouped_dgated", execute, "CompositeExplicitAutograd")
torch.library.register_fake("coda::grouped_dgated", _fake)


class GroupedGatedDown(torch.autograd.Function):
    """The down grouped GEMM o[s] = w[s]·(y[s]·W_d[e]ᵀ + b[e]) where autograd records it
    and y is the gated grouped GEMM's output h = pair(p) itself (not a filled or
    otherwise changed copy: patterns/routed_experts.py checks). Forward: the down GEMM's
    program, as GroupedDown's. Backward: coda::grouped_dgated, then

        dW_d[e] = doutᵀ·(h·w) over e's rows       (grouped wgrad: no product recomputed)
        dw[s]   = dscore[s] + Σ_j dout[s, j]·b[e, j]     db[e] = Σ over e's rows of w·dout

    The gradient goes to p, none to y: o depends on y only as pair(p). The gated GEMM's
    backward (grouped.GroupedGated) adds a gradient y gets from any other reader."""

    @staticmethod
    def forward(program, op, params, y, p, weight, offsets, bounds_proved, *operands):
        return grouped_gemm_epilogue(program, y, weight, offsets, None, list(operands),
                                     False, bounds_proved)[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        program, op, params, y, p, weight, offsets, bounds_proved, *operands = inputs
        ctx.names = down_operand_names(program)
        ctx.op, ctx.params, ctx.bounds_proved = op, list(params), bounds_proved
        ctx.save_for_backward(p, weight, offsets, *operands)

    @staticmethod
    def backward(ctx, do):
        ops.refuse_second_derivative("the routed experts' down GEMM")
        p, weight, offsets, *operands = ctx.saved_tensors
        by_name = dict(zip(ctx.names, operands))
        w, bias = by_name.get("r"), by_name.get("bias")
        cd = reference.accumulate_dtype(p.dtype)
        want_p, want_w = ctx.needs_input_grad[4:6]
        want = dict(zip(ctx.names, ctx.needs_input_grad[8:]))
        if not (want_p or want_w or any(want.values())):
            return (None,) * (8 + len(ctx.names))
        # the GEMM's operand in the weight's dtype: a combine weight in float32 (Mixtral's
        # router) makes the output, and so dout, float32
        do16 = do.to(p.dtype).contiguous()
        outs = torch.ops.coda.grouped_dgated(ctx.op, ctx.params, do16, weight, offsets, p, w,
                                             ctx.bounds_proved)
        # dp and h·w past the last offset (rows of no expert) are left unwritten by the
        # kernel and read by nothing: the grouped GEMMs and per-expert sums after it read
        # the experts' rows only (masking them would be a pass over each)
        dp, hw = outs[0], outs[1]
        # frozen expert weights (adapter fine-tuning) skip the wgrad GEMM
        dw_down = weight_grad(do16, hw, offsets, weight).to(weight.dtype) if want_w else None
        grads = {}
        if w is not None and want.get("r", False):
            # a gradient of the graph's own tensor: zero past the last offset
            dot = outs[2]
            if bias is not None:
                e = reference.expert_of_rows(offsets, do.shape[0]).clamp(
                    max=weight.shape[0] - 1)
                dot = dot + (do.to(cd) * bias.to(cd)[e]).sum(-1)
            live = torch.arange(p.shape[0], device=p.device) < offsets[-1]
            grads["r"] = torch.where(live, dot, 0).to(w.dtype)
        if bias is not None and want.get("bias", False):
            d_acc = do16 if w is None else (do.to(cd) * w.to(cd)[:, None]).to(p.dtype)
            grads["bias"] = per_expert_sum(d_acc, offsets, weight.shape[0]).to(bias.dtype)
        return (None, None, None, None, dp if want_p else None, dw_down, None, None,
                *(grads.get(n) for n in ctx.names))


def grouped_down_linear(program: str, op: str, params, y: torch.Tensor, p: torch.Tensor,
                        weight: torch.Tensor, offsets: torch.Tensor,
                        *operands: torch.Tensor, bounds_proved: bool = False
                        ) -> torch.Tensor:
    """The down grouped GEMM for the rewritten graph: GroupedGatedDown where a gradient
    can be asked for, else the forward program alone (p unused)."""
    if ops._needs_grad(y, weight, operands) or (p.requires_grad and torch.is_grad_enabled()):
        return GroupedGatedDown.apply(program, op, tuple(params), y, p, weight, offsets,
                                      bounds_proved, *operands)
    return grouped_linear(program, y, weight, offsets, None, *operands,
                          bounds_proved=bounds_proved)[0]
