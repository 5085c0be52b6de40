"""Weight re-layouts kept between calls, inside the GEMM op that reads them.

The fused GEMMs read re-laid-out weights (gate/up interleaved, q/k per-head permuted and
concatenated with v). By default the rewritten graph recomputes them from the live
parameters on every call (kernels/ops.py; under Inductor one generated copy kernel):
always right, and it costs a read and a write of the weights per call (measured on the
H200 at Llama-3-8B shapes: 0.12 ms per gated MLP, 0.04 ms per q/k/v; BENCHMARKS.md).

With ``Options(cache_relayouts=True)`` an inference graph calls ``coda::gemm_relaid``
instead: the op takes the *source* weights, keeps their re-layout (cast to the GEMM's
dtype) on the first source tensor and recomputes it only when a source changed, by its
version counter (kernels/versioned.py: every in-place update autograd sees moves it,
optimizer steps, ``copy_`` under no_grad, ``load_state_dict``). Inside a CUDA-graph
capture, and for inference tensors (``torch.inference_mode()``: no version counter), it
recomputes on every call.

The kept tensor never leaves the op. Handed out as an op's output, Inductor's buffer
planning could reuse its memory as scratch once the last reader ran and write over it;
inside the op nothing else can reach it.

Graphs that compute gradients always recompute (their weights change every step, and a
kept copy would be saved for the backward as well). What the cache cannot see: writes
through ``param.data``. That, and the memory of one more copy of every re-laid-out weight
(which also travels with the parameter object: ``copy.deepcopy`` and pickling the whole module carry
it; ``state_dict()`` does not), is why it is opt-in: for serving, where weights do not
change and the per-call cost is pure overhead.
"""

from __future__ import annotations

import collections

import torch

from ..codegen import layouts
from ..graph_utils import ROW_CALL_MARK
from . import inductor_calls, ops, versioned

# kind -> the re-layout function (the spec's decoded layout, then the sources)
_KINDS = {
    "interleave_rows": lambda layout, *src: layouts.interleave_rows(*src),
    "interleave_halves": lambda layout, *src: layouts.interleave_halves(*src),
    "interleave_halves_up_first":
        lambda layout, *src: layouts.interleave_halves_up_first(*src),
    "rope_segments": layouts.rope_segments,
}
STATS = collections.Counter()  # "hit" / "miss" / "not kept": what the cache did
_ATTR = "_coda_relayout_cache"


def spec_of(layout: tuple) -> str:
    """The op's string form of a layout: "lo,hi,heads,d,r;..." ("" for none)."""
    return ";".join(",".join(str(int(v)) for v in seg) for seg in layout)


def _layout(spec: str) -> tuple:
    return tuple(tuple(int(v) for v in seg.split(",")) for seg in spec.split(";") if seg)


def compute(kind: str, spec: str, sources, dtype: torch.dtype) -> torch.Tensor:
    """The re-layout of ``sources`` in the GEMM's dtype, contiguous."""
    return _KINDS[kind](_layout(spec), *sources).to(dtype).contiguous()


def kept(kind: str, spec: str, sources, dtype: torch.dtype) -> torch.Tensor:
    """``compute(...)``, reused while no source changed (see the module docstring)."""
    def fresh():
        with torch.no_grad():
            return compute(kind, spec, sources, dtype)
    out, what = versioned.kept(sources[0], _ATTR, sources, (kind, spec, dtype), fresh)
    STATS[what] += 1
    return out


def _serving(x: torch.Tensor) -> bool:
    """Whether a kept value, if current, can go straight to ops.fused_linear (the
    serving path, every call of a decode step): grad mode off and a plain x, so the call
    is the kernel route the op's own kernel would take. Else (grad mode on: the op
    refuses a call autograd could record; traced or DTensor tensors: the op) the full
    call. Measured on the 2-core CPU, QuACK's launch stubbed, a q/k/v call in a chain:
    16.0 µs through the op's argument handling, 7.6 here (the fused call alone 3.1); on
    an H100 machine's host 25.5 µs, F.linear + 8.4 (BENCHMARKS.md, forty-first
    session)."""
    return not torch.is_grad_enabled() and type(x) in ops._PLAIN


def _current(value):
    """``value`` (versioned.peek's), counted as the cache's hit it is."""
    if value is not None:
        STATS["hit"] += 1
    return value


# The ops below are defined through torch.library's low-level API, as coda::gemm_epilogue
# is (kernels/ops.py): custom_op's wrapper layers are host time on every call.
_RELAID_SCHEMA = ("(str program, Tensor a, str kind, str spec, Tensor[] sources, "
                  "Tensor[] operands) -> Tensor[]")


def gemm_relaid(program: str, a: torch.Tensor, kind: str, spec: str,
                sources: list[torch.Tensor], operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """``coda::gemm_epilogue(program, a, b, operands)`` with b the kept re-layout of
    ``sources`` (inference only: the op has no autograd formula, and the rewrite uses
    it only in graphs that compute no gradient)."""
    ops.refuse_gradients("gemm_relaid", a, *sources, *operands)
    return _gemm_on(program, a, kept(kind, spec, sources, a.dtype), operands)


ops._lib.define("gemm_relaid" + _RELAID_SCHEMA)
inductor_calls.python_kernel(ops._lib, "gemm_relaid", gemm_relaid)


def _gemm_on(program, a, b, operands) -> list[torch.Tensor]:
    """The fused GEMM on a re-layout ``b`` (the op's outputs are fresh tensors, never
    views of an input: kernels/ops.py). Inside these ops' own kernels the tensors are
    real and no gradient is recorded (the outer op owns the autograd): the kernel path
    is called directly, without a second op boundary; the fake goes through the op."""
    if ops._direct(a, b, operands):
        return list(ops.execute(program, a, b, operands))
    return list(torch.ops.coda.gemm_epilogue(program, a, b, operands))


def _fake_relaid(op: str):
    """Both ops' fake: the re-layout's shape, then the GEMM's outputs (refusing, like
    the op, a call where autograd could record a gradient)."""
    def fake(program, a, kind, spec, sources, operands):
        ops.refuse_gradients(op, a, *sources, *operands)
        return _gemm_on(program, a, compute(kind, spec, sources, a.dtype), operands)
    return fake


torch.library.register_fake("coda::gemm_relaid", _fake_relaid("gemm_relaid"))


def fused_linear_relaid(program: str, x: torch.Tensor, kind: str, spec: str,
                        sources: list[torch.Tensor], *operands: torch.Tensor):
    """``ops.fused_linear`` over the kept re-layout of ``sources`` (nn.Linear layout).
    A serving call whose kept re-layout is current (_serving, versioned.peek) is
    ops.fused_linear on it; else real tensors and no gradient to record call the op's
    kernel as a function, as ops.fused_linear does (the op boundary costs more host
    time than the launch), and anything else the op."""
    if _serving(x):
        b = _current(versioned.peek(sources[0], _ATTR, sources, (kind, spec, x.dtype)))
        if b is not None:
            return ops.fused_linear(program, x, b, *operands)

    def run(text, a, _, flat):
        if ops._direct(a, sources[0], [*sources[1:], *flat]):
            return gemm_relaid(text, a, kind, spec, sources, flat)
        return torch.ops.coda.gemm_relaid(text, a, kind, spec, sources, flat)
    return ops._linear(run, program, x, None, operands)


setattr(fused_linear_relaid, ROW_CALL_MARK, 5)


# ---- training: the re-layout made again in the backward, never saved --------------------
#
# A fused GEMM over a re-layout computed in the graph saves its b operand for the
# backward (grad_a = d_acc·b): a copy of the layer's q/k/v or gate/up weights per layer,
# alive from the forward to the backward (1.2 GiB over the Llama-3.2-1B step's 16
# layers). This op takes the source weights instead, which live anyway, and makes the
# re-layout in its forward and again in its backward (a read and a write of the weights,
# the cost the forward already pays).

def gemm_relaid_recomputed(program: str, a: torch.Tensor, kind: str, spec: str,
                           sources: list[torch.Tensor],
                           operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """``coda::gemm_epilogue(program, a, b, operands)`` with b the re-layout of
    ``sources`` (made here, and again in the backward: RelaidRecomputed). The op has no
    autograd formula; RelaidRecomputed is its autograd, for the reason FusedGemm is
    coda::gemm_epilogue's (kernels/ops.py)."""
    ops.refuse_gradients("gemm_relaid_recomputed", a, *sources, *operands)
    return _gemm_on(program, a, compute(kind, spec, sources, a.dtype), operands)


ops._lib.define("gemm_relaid_recomputed" + _RELAID_SCHEMA)
ops._lib.impl("gemm_relaid_recomputed", gemm_relaid_recomputed, "CompositeExplicitAutograd")
torch.library.register_fake("coda::gemm_relaid_recomputed",
                            _fake_relaid("gemm_relaid_recomputed"))


def _setup_recomputed(ctx, inputs, output):
    """As coda::gemm_epilogue's, with the source weights in place of the re-layout."""
    program, a, kind, spec, sources, operands = inputs
    kept, kept_outputs, keep_outputs = ops.kept_for_backward(program, operands, output)
    ctx.save_for_backward(a, *sources, *kept, *kept_outputs)
    ctx.meta = (program, kind, spec, len(sources), len(operands), keep_outputs, len(output))
    ctx.set_materialize_grads(False)  # as the plain op: None for an output nothing reads


class RelaidRecomputed(torch.autograd.Function):
    """coda::gemm_relaid_recomputed with its backward (the re-layout made again there).
    Tensors travel flat (an autograd.Function tracks tensor arguments only):
    ``apply(program, a, kind, spec, n_sources, *sources, *operands)``."""

    @staticmethod
    def forward(program, a, kind, spec, n_src, *tensors):
        # grad mode is off in here: real tensors need no op boundary (ops.FusedGemm)
        run = gemm_relaid_recomputed if ops._direct(a, tensors[0], tensors[1:]) else \
            torch.ops.coda.gemm_relaid_recomputed
        return tuple(run(program, a, kind, spec, list(tensors[:n_src]),
                         list(tensors[n_src:])))

    @staticmethod
    def setup_context(ctx, inputs, output):
        program, a, kind, spec, n_src, *tensors = inputs
        _setup_recomputed(ctx, (program, a, kind, spec, tensors[:n_src], tensors[n_src:]),
                          list(output))

    @staticmethod
    def backward(ctx, *grads):
        _, grad_a, _, _, grad_src, grad_ops = _backward_recomputed(ctx, grads)
        return (None, grad_a, None, None, None, *grad_src, *grad_ops)


def _backward_recomputed(ctx, grads):
    from ..codegen.program import parse
    from . import backward
    program, kind, spec, n_src, n_ops, keep_outputs, n_out = ctx.meta
    ops.refuse_second_derivative("the fused GEMM", program)  # as ops._backward
    a, *rest = ctx.saved_tensors
    sources, operands, kept = rest[:n_src], rest[n_src:n_src + n_ops], rest[n_src + n_ops:]
    outputs = ops.outputs_for_rule(kept, keep_outputs, n_out)
    # the re-layout made once, recording its own backward (its inverse) where a source
    # wants a gradient; the GEMM rule reads it detached
    src = [s.detach().requires_grad_(s.requires_grad) for s in sources]
    want = [s for s in src if s.requires_grad]
    with torch.enable_grad() if want else torch.no_grad():
        relaid = compute(kind, spec, src, a.dtype)
    with backward.common.weight_grad_wanted(bool(want)):  # frozen sources: no wgrad
        grad_a, grad_b, grad_ops = backward.vjp(parse(program), a, relaid.detach(),
                                                list(operands), outputs, list(grads))
    grad_src = [None] * n_src
    if grad_b is not None and want:
        got = iter(torch.autograd.grad(relaid, want, grad_b.to(relaid.dtype),
                                       allow_unused=True))
        grad_src = [in_source_layout(next(got), s) if s.requires_grad else None
                    for s in src]
    return None, grad_a, None, None, grad_src, grad_ops


def in_source_layout(grad: torch.Tensor | None, source: torch.Tensor):
    """A source's gradient with the source's strides. The re-layout's own backward hands
    views of grad_b (interleave_rows' de-interleave: every other row of [2I, K]), and
    AccumulateGrad, which wants a parameter's layout, then copies each (a zeroed
    .grad) or adds it to the kept one with ATen's strided, non-vectorised kernel
    (gradient accumulation: 32 × 61 µs in the 1B step on an H100, BENCHMARKS.md
    forty-seventh session). One copy here instead, in the backward graph where Inductor
    writes it; AccumulateGrad then takes the tensor as it is or adds it vectorised.
    A source that is a view (``w.t()``, a chunk of a packed parameter) gets its own
    strides, so the view's backward hands the parameter its layout (empty_like keeps a
    dense view's strides; any other gets a contiguous gradient)."""
    if grad is None or grad.stride() == source.stride():
        return grad
    return torch.empty_like(source, dtype=grad.dtype).copy_(grad)


def fused_linear_recomputed(program: str, x: torch.Tensor, kind: str, spec: str,
                            sources: list[torch.Tensor], *operands: torch.Tensor):
    """``ops.fused_linear`` over the re-layout of ``sources`` in a training graph: made in
    the op's forward and again in its backward, never saved. Sharded (DTensor) sources
    take the plain path: the re-layout in the graph, then the fused GEMM on the shards."""
    from . import sharding
    if any(sharding.is_dtensor(s) for s in sources):
        w = _KINDS[kind](_layout(spec), *sources)
        return ops.fused_linear(program, x, w.to(x.dtype), *operands)
    return ops._linear(lambda text, a, _, flat: ops.record(
        RelaidRecomputed, text, a, kind, spec, len(sources), *sources, *flat),
        program, x, None, operands)


setattr(fused_linear_recomputed, ROW_CALL_MARK, 5)


# ---- a LayerNorm's folded weights (patterns/layernorm.py), kept inside the GEMM op -----
#
# The GEMM that reads z in place of LN(z) multiplies by W' = W∘γ, and its epilogue reads
# s = W'·1 and b' = β·Wᵀ + b: three values of the weights alone, a pass over W to make
# (0.16–0.22 ms at Pythia's MLP widths on the H200, more than the rewrite saves). With
# cache_relayouts in an inference graph they are kept here, keyed by the versions of W,
# b, γ and β, and never leave the op (as the re-layouts above).

_FOLD_ATTR = "_coda_layernorm_fold"
_FOLD_PARTS = ("bias", "gamma", "beta")


def fold_parts(bias, gamma, beta) -> str:
    """The op's string form of which of W's companions are present ("bias,gamma")."""
    return ",".join(n for n, t in zip(_FOLD_PARTS, (bias, gamma, beta)) if t is not None)


def _fold(parts: str, weight, rest):
    named = dict(zip([p for p in parts.split(",") if p], rest))
    return layouts.layernorm_weights(weight, named.get("bias"), named.get("gamma"),
                                     named.get("beta"))


def kept_fold(parts: str, weight, rest, dtype: torch.dtype):
    """(W', s, b') of codegen/layouts.layernorm_weights, W' in the GEMM's dtype (an
    autocast GEMM on float32 weights), reused while no source changed."""
    def fresh():
        with torch.no_grad():
            w_fold, s, b_fold = _fold(parts, weight, rest)
            return w_fold.to(dtype).contiguous(), s, b_fold
    out, what = versioned.kept(weight, _FOLD_ATTR, [weight, *rest], (parts, dtype), fresh)
    STATS[what] += 1
    return out


def gemm_layernorm_kept(program: str, a: torch.Tensor, parts: str, weight: torch.Tensor,
                        rest: list[torch.Tensor], operands: list[torch.Tensor]
                        ) -> list[torch.Tensor]:
    """``coda::gemm_epilogue(program, a, W', [*operands, s, (b')])`` with (W', s, b') the
    kept fold of ``weight`` and ``rest`` (inference only: no autograd formula)."""
    ops.refuse_gradients("gemm_layernorm_kept", a, weight, *rest, *operands)
    w_fold, s, b_fold = kept_fold(parts, weight, rest, a.dtype)
    return _gemm_on(program, a, w_fold, [*operands, s, *([b_fold] if b_fold is not None
                                                         else [])])


def _fake_layernorm_kept(program, a, parts, weight, rest, operands):
    ops.refuse_gradients("gemm_layernorm_kept", a, weight, *rest, *operands)
    w_fold, s, b_fold = _fold(parts, weight, rest)
    return _gemm_on(program, a, w_fold.to(a.dtype), [*operands, s, *([b_fold] if b_fold is not None
                                                         else [])])


ops._lib.define("gemm_layernorm_kept(str program, Tensor a, str parts, Tensor weight, "
                "Tensor[] rest, Tensor[] operands) -> Tensor[]")
inductor_calls.python_kernel(ops._lib, "gemm_layernorm_kept", gemm_layernorm_kept)
torch.library.register_fake("coda::gemm_layernorm_kept", _fake_layernorm_kept)


def fused_linear_layernorm_kept(program: str, x: torch.Tensor, weight: torch.Tensor,
                                bias, gamma, beta, *operands: torch.Tensor):
    """``ops.fused_linear`` of a centred program over the kept fold of a consumer's weight
    (``operands``: r and μ; s and b' come from the fold)."""
    parts = fold_parts(bias, gamma, beta)
    rest = [t for t in (bias, gamma, beta) if t is not None]
    if _serving(x):
        fold = _current(versioned.peek(weight, _FOLD_ATTR, [weight, *rest], (parts, x.dtype)))
        if fold is not None:
            w_fold, s, b_fold = fold
            return ops.fused_linear(program, x, w_fold, *operands, s,
                                    *([b_fold] if b_fold is not None else []))

    def run(text, a, _, flat):  # the op's kernel as a function where it may be (above)
        if ops._direct(a, weight, [*rest, *flat]):
            return gemm_layernorm_kept(text, a, parts, weight, rest, flat)
        return torch.ops.coda.gemm_layernorm_kept(text, a, parts, weight, rest, flat)
    return ops._linear(run, program, x, None, operands)


setattr(fused_linear_layernorm_kept, ROW_CALL_MARK, 6)
