"""The FP8 ops (the math, the scales and the programs: codegen/fp8.py): the gated MLP's
e4m3 gate/up GEMM and e4m3 down GEMM, the linears of a normalised row as one e4m3 GEMM,
and a linear of row-wise scaled rows; their e4m3 weights computed from the live
parameters and kept between calls by their version counters; each on the generated kernel
where the layout contract holds and the reference elsewhere (kernels/ops.py)."""

from __future__ import annotations

import functools

import torch

from ..codegen import fp8
from . import ops, versioned

_ATTR = "_coda_fp8_mlp"
_ATTR_LINEAR = "_coda_fp8_linear"
_ATTR_ROWWISE = "_coda_fp8_rowwise"


def kept_mlp_weights(sources: list[torch.Tensor], packed: str, has_gamma: bool,
                     gamma_offset: float, width: int):
    """``mlp_weights`` of (gate, up | packed gate_up, down[, γ]), kept on the first weight
    while none of them changed (kernels/versioned.py: recomputed after an optimizer step,
    ``copy_``, ``load_state_dict``; not kept under a CUDA-graph capture or for inference
    tensors)."""
    gate, *rest = sources
    if packed:  # "gate,up" or "up,gate": the halves' order in the packed weight
        gate, up = gate.chunk(2, dim=0)[::1 if packed == "gate,up" else -1]
    else:
        up, *rest = rest
    down, *gamma = rest

    def fresh():
        return fp8.mlp_weights(gate, up, down, gamma[0] if has_gamma else None, gamma_offset,
                           width)
    out, _ = versioned.kept(sources[0], _ATTR, sources, (packed, gamma_offset, width), fresh)
    return out


def gate_up(program: str, q: torch.Tensor, sources: list[torch.Tensor], packed: str,
            has_gamma: bool, gamma_offset: float, width: int) -> torch.Tensor:
    """c·act(g)·u in bf16 from the quantised normalised rows ``q`` [*, N] (the e4m3
    gate/up GEMM); the generated kernel where the layout contract holds, the reference
    elsewhere (counted and reported like every fused GEMM: kernels/ops.py)."""
    ops.refuse_gradients("fp8_gate_up", *sources)
    w_int, ws_int, _, _ = kept_mlp_weights(sources, packed, has_gamma, gamma_offset, width)
    (act,) = ops.execute(program, q.reshape(-1, q.shape[-1]), w_int, [ws_int])
    return act.reshape(*q.shape[:-1], act.shape[-1])


def down(program: str, a: torch.Tensor, sources: list[torch.Tensor], packed: str,
         has_gamma: bool, gamma_offset: float, width: int) -> torch.Tensor:
    """The down projection of the e4m3 product ``a`` [*, I] (the same kept weights)."""
    ops.refuse_gradients("fp8_down", *sources)
    _, _, w_down, ws_down = kept_mlp_weights(sources, packed, has_gamma, gamma_offset, width)
    (out,) = ops.execute(program, a.reshape(-1, a.shape[-1]), w_down, [ws_down])
    return out.reshape(*a.shape[:-1], out.shape[-1])


def kept_linear_weights(sources: list[torch.Tensor], biased: list[bool], has_gamma: bool,
                        gamma_offset: float, width: int):
    """``linear_weights`` of (weights..., the biases of the ``biased`` ones..., [γ]), kept
    on the first weight like kept_mlp_weights."""
    n = len(biased)
    weights, rest = sources[:n], sources[n:]
    given = iter(rest[:sum(biased)])
    biases = [next(given) if b else None for b in biased]

    def fresh():
        return fp8.linear_weights(weights, biases, rest[-1] if has_gamma else None,
                                  gamma_offset, width)
    out, _ = versioned.kept(sources[0], _ATTR_LINEAR, sources,
                            (tuple(biased), gamma_offset, width), fresh)
    return out


def linear(program: str, q: torch.Tensor, sources: list[torch.Tensor], biased: list[bool],
           has_gamma: bool, gamma_offset: float, width: int) -> torch.Tensor:
    """The linears of the quantised normalised rows ``q`` [*, N], their outputs side by
    side [*, ΣN_i] in the order of ``sources`` (the e4m3 GEMM, acc·ws (+ b))."""
    ops.refuse_gradients("fp8_linear", *sources)
    w, ws, b = kept_linear_weights(sources, biased, has_gamma, gamma_offset, width)
    (out,) = ops.execute(program, q.reshape(-1, q.shape[-1]), w,
                         [ws] if b is None else [ws, b])
    return out.reshape(*q.shape[:-1], out.shape[-1])


def rowwise_linear(program: str, q: torch.Tensor, r: torch.Tensor,
                   sources: list[torch.Tensor]) -> torch.Tensor:
    """A linear of e4m3 rows ``q`` [*, K] with their dequantisation scales ``r`` [*, 1]
    (weight[, bias] in ``sources``, the e4m3 weight kept on it by version)."""
    ops.refuse_gradients("fp8_rowwise_linear", *sources)
    weight, *bias = sources
    w, ws, b = versioned.kept(weight, _ATTR_ROWWISE, sources, (),
                              lambda: fp8.rowwise_weights(weight, bias[0] if bias else None))[0]
    (out,) = ops.execute(program, q.reshape(-1, q.shape[-1]), w,
                         [r.reshape(-1).float(), ws] + ([] if b is None else [b]))
    # rows in: the GEMM's own output, no view of it (RowwiseLinear's output must be one
    # autograd can let the model update in place)
    return out if q.dim() == 2 else out.reshape(*q.shape[:-1], out.shape[-1])


class RowwiseLinear(torch.autograd.Function):
    """``coda::fp8_rowwise_linear`` where autograd records it (a training graph): the
    formula-less op forward (grad mode is off inside a Function's forward), torchao's
    float8 row-wise training recipe backward (codegen/fp8.rowwise_grads: dgrad and wgrad
    as e4m3 GEMMs with their scales in the epilogue, the quantisations as traced ops that
    Inductor fuses into the passes that transpose them). Like ops.FusedGemm, a Function
    rather than the op's own formula: AOTAutograd traces it apart, so a compiled step runs
    no Python autograd per call. It keeps what eager's linear keeps (x and W, in their own
    dtypes: what torchao's recipe keeps too) and re-quantises in the backward along the
    dims those GEMMs keep."""

    @staticmethod
    def forward(program, q, r, x, weight, bias):
        return fp8_rowwise_linear(program, q, r, [weight] + ([] if bias is None else [bias]))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, _, x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, dy):
        ops.refuse_second_derivative("the FP8 row-wise linear")
        x, weight = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dx, dw = fp8.rowwise_grads(dy, x, weight, want_x, want_w, _nograd_gemm,
                                   fp8_quantize_columns)
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[5]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return None, None, None, dx, dw, db


def _nograd_gemm(program, a, b, operands):
    return ops.gemm_epilogue_nograd(program, a, b, operands)


def quantize_columns(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codegen/fp8.quantize_columns (the backward's transposed e4m3 operands and their
    scales) as an op of its own: opaque to the graph around it, compiled apart on the GPU.

    Why: traced into a backward graph beside the row-wise quantisation of the same
    gradient, Inductor fused the two into one kernel, the row amax's reduction loop, whose
    transposed stores write one byte per element at a stride of the row count. The SwiGLU
    gradient and both quantisations of the MLP's two [8192, 8192] gradients took 0.59 ms
    of kernels on the H200 that way, 0.47 with the columns compiled apart (the columns'
    amax, then a transposed cast Inductor tiles; 2026-12-03, BENCHMARKS.md)."""
    return compiled_columns(t) if t.is_cuda else fp8.quantize_columns(t)


# static compiles kept at most (a model's linears have a handful of layouts per token
# count); past it, one dynamic-shape compile serves every new layout (varying sequence
# lengths would otherwise compile a kernel each)
STATIC_LAYOUTS = 32
_STATIC_COLUMNS: dict = {}


def compiled_columns(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codegen/fp8.quantize_columns through Inductor, compiled apart from any graph: one
    static compile per layout (shape, strides, dtype, device and 16-byte alignment: a
    kernel compiled for an aligned pointer assumes it), no dynamo guards per call. Static
    because the dynamic-shape kernel of the columns' amax took 47 µs a call in the 1B
    step, its static split reduction 30 µs at [8192, 8192] (BENCHMARKS.md, 2026-12-03).

    Numerics: the scales are eager's bit for bit; the e4m3 values too, but where x/s lies
    within float32 rounding of the midpoint between two e4m3 values, which Triton's
    float32 division (PTX div.full, within 2 ulp) may put on the other side: one e4m3
    step, 3 of 8M values of a [4096, 2048] gradient on the H200 (tests/gpu)."""
    key = (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
    compiled = _STATIC_COLUMNS.get(key)
    if compiled is None:
        if len(_STATIC_COLUMNS) >= STATIC_LAYOUTS:
            return _dynamic_columns()(t)
        import torch._inductor
        from torch.fx.experimental.proxy_tensor import make_fx
        compiled = torch._inductor.compile(make_fx(fp8.quantize_columns)(t), [t])
        _STATIC_COLUMNS[key] = compiled
    q, s = compiled(t)
    return q, s


@functools.cache
def _dynamic_columns():
    return torch.compile(fp8.quantize_columns, dynamic=True, fullgraph=True)


def trained_rowwise_linear(program: str, q: torch.Tensor, r: torch.Tensor, x: torch.Tensor,
                           weight: torch.Tensor, bias: torch.Tensor | None = None):
    """What a training graph calls for a row-wise FP8 linear (RowwiseLinear): ``x`` is the
    bf16 input ``q`` and ``r`` were quantised from, kept for the backward. The Function
    sees rows and returns the GEMM's own [M, N] output; the reshape to the model's leading
    dims is outside it, as for the bf16 families (ops._linear): a view made inside a
    Function could not be updated in place, and models do (Llama 4's MoE adds the routed
    experts into the shared expert's down projection with ``add_``)."""
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    out = RowwiseLinear.apply(program, rows(q), rows(r), rows(x), weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


# Two ops, with the product's quantisation between them as graph ops (Inductor makes the
# clamp and the cast one pass). The FP8 weights stay inside the ops, computed once per
# weight version and shared by both (an op output could be reused as scratch by Inductor's
# buffer planning once its last reader ran: kernels/relayout.py says why).
_lib = torch.library.Library("coda", "FRAGMENT")
# packed: "" (gate and up separate weights), "gate,up" or "up,gate" (one packed weight)
_ARGS = "Tensor[] sources, str packed, bool has_gamma, float gamma_offset, int width"
_lib.define(f"fp8_gate_up(str program, Tensor q, {_ARGS}) -> Tensor")
_lib.define(f"fp8_down(str program, Tensor a, {_ARGS}) -> Tensor")
_lib.define("fp8_linear(str program, Tensor q, Tensor[] sources, bool[] biased, "
            "bool has_gamma, float gamma_offset, int width) -> Tensor")
_lib.define("fp8_rowwise_linear(str program, Tensor q, Tensor r, Tensor[] sources) -> Tensor")
_lib.impl("fp8_gate_up", gate_up, "CompositeExplicitAutograd")
_lib.impl("fp8_rowwise_linear", rowwise_linear, "CompositeExplicitAutograd")
_lib.impl("fp8_linear", linear, "CompositeExplicitAutograd")
_lib.impl("fp8_down", down, "CompositeExplicitAutograd")
_lib.define("fp8_quantize_columns(Tensor t) -> (Tensor, Tensor)")
_lib.impl("fp8_quantize_columns", quantize_columns, "CompositeExplicitAutograd")


def _intermediate(sources, packed: str) -> int:
    return sources[0].shape[0] // (2 if packed else 1)


def _fake_gate_up(program, q, sources, packed, has_gamma, gamma_offset, width):
    return q.new_empty((*q.shape[:-1], _intermediate(sources, packed)),
                       dtype=_out_dtype(program))


def _fake_down(program, a, sources, packed, has_gamma, gamma_offset, width):
    rows = sources[1 if packed else 2].shape[0]
    return a.new_empty((*a.shape[:-1], rows), dtype=_out_dtype(program))


def _fake_linear(program, q, sources, biased, has_gamma, gamma_offset, width):
    columns = sum(w.shape[0] for w in sources[:len(biased)])
    return q.new_empty((*q.shape[:-1], columns), dtype=_out_dtype(program))


def _fake_rowwise(program, q, r, sources):
    return q.new_empty((*q.shape[:-1], sources[0].shape[0]), dtype=_out_dtype(program))


def _fake_columns(t):
    k = t.shape[-1]
    return t.new_empty((k, t.numel() // k), dtype=fp8.E4M3), t.new_empty(k, dtype=torch.float32)


def _out_dtype(program: str) -> torch.dtype:
    from ..codegen.program import parse
    from ..codegen.reference import dtype_from_name
    return dtype_from_name(parse(program).outputs[0].dtype)


torch.library.register_fake("coda::fp8_gate_up", _fake_gate_up)
torch.library.register_fake("coda::fp8_down", _fake_down)
torch.library.register_fake("coda::fp8_linear", _fake_linear)
torch.library.register_fake("coda::fp8_rowwise_linear", _fake_rowwise)
torch.library.register_fake("coda::fp8_quantize_columns", _fake_columns)
fp8_gate_up = torch.ops.coda.fp8_gate_up.default
fp8_linear = torch.ops.coda.fp8_linear.default
fp8_rowwise_linear = torch.ops.coda.fp8_rowwise_linear.default
fp8_down = torch.ops.coda.fp8_down.default
fp8_quantize_columns = torch.ops.coda.fp8_quantize_columns.default
