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
through ``param.data``. That, and the memory of one more copy of every re-laid-out weight (which also
travels with the parameter object: ``copy.deepcopy`` and pickling the whole module carry
it; ``state_dict()`` does not), is why it is opt-in: for serving, where weights do not
change and the per-call cost is pure overhead.
"""

from __future__ import annotations

import collections

import torch

from ..codegen import layouts
from . import ops, versioned

# kind -> the re-layout function (the spec's decoded layout, then the sources)
_KINDS = {
    "interleave_rows": lambda layout, *src: layouts.interleave_rows(*src),
    "interleave_halves": lambda layout, *src: layouts.interleave_halves(*src),
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


@torch.library.custom_op("coda::gemm_relaid", mutates_args=())
def gemm_relaid(program: str, a: torch.Tensor, kind: str, spec: str,
                sources: list[torch.Tensor], operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """``coda::gemm_epilogue(program, a, b, operands)`` with b the kept re-layout of
    ``sources`` (inference only: the op has no autograd formula, and the rewrite uses
    it only in graphs that compute no gradient)."""
    b = kept(kind, spec, sources, a.dtype)
    return list(torch.ops.coda.gemm_epilogue(program, a, b, operands))


@gemm_relaid.register_fake
def _(program, a, kind, spec, sources, operands):
    b = compute(kind, spec, sources, a.dtype)
    return list(torch.ops.coda.gemm_epilogue(program, a, b, operands))


def fused_linear_relaid(program: str, x: torch.Tensor, kind: str, spec: str,
                        sources: list[torch.Tensor], *operands: torch.Tensor):
    """``ops.fused_linear`` over the kept re-layout of ``sources`` (nn.Linear layout)."""
    return ops._linear(lambda text, a, _, flat: torch.ops.coda.gemm_relaid(
        text, a, kind, spec, sources, flat), program, x, None, operands)
