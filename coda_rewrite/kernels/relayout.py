"""Weight re-layouts kept between calls, keyed by the parameters' version counters.

The fused GEMMs read re-laid-out weights (gate/up interleaved, q/k per-head permuted and
concatenated with v). By default the rewritten graph recomputes them from the live
parameters on every call (kernels/ops.py): always right, and it costs a read and a write
of the weights per call (measured on the H200 at Llama-3-8B shapes: 0.12 ms per gated
MLP, 0.09 ms per q/k/v; BENCHMARKS.md). With ``Options(cache_relayouts=True)`` the graph
calls this op instead, which keeps the last result next to the first source tensor and
recomputes only when a source changed:

* a source's version counter moves with every in-place update that autograd sees
  (optimizer steps, ``copy_`` under no_grad, ``load_state_dict``), and aliases share it;
* the cache lives on the source tensor object, so it dies with it (no stale hit from a
  new tensor at a recycled address);
* inside a CUDA-graph capture it always recomputes (a replay cannot look at versions).

What it cannot see: writes through ``param.data`` (a separate version counter), which
PyTorch itself does not track either. That, and the memory of one more copy of every
re-laid-out weight, is why it is opt-in: for serving, where weights do not change and
the per-call cost is pure overhead.
"""

from __future__ import annotations

import collections

import torch

from . import ops

# kind -> the re-layout function (sources first, then the spec's decoded layout)
_KINDS = {
    "interleave_rows": lambda spec, *src: ops.interleave_rows(*src),
    "interleave_halves": lambda spec, *src: ops.interleave_halves(*src),
    "rope_segments": lambda spec, *src: ops.rope_segments(_layout(spec), *src),
}
STATS = collections.Counter()  # "hit" / "miss": what the cache did (tests, benchmarks)
_ATTR = "_coda_relayout_cache"


def spec_of(layout: tuple, sources) -> str:
    """The op's string argument: the layout ("lo,hi,heads,d,r;...") and which sources are
    present ("|" then 1 or 0 per source). Missing ones (a bias only some projections
    have) are left out of the op's tensor list: autograd does not see through None
    entries of a tensor list, so they never enter it."""
    return ";".join(",".join(str(int(v)) for v in seg) for seg in layout) + "|" + \
        "".join("0" if t is None else "1" for t in sources)


def _layout(spec: str) -> tuple:
    text = spec.split("|")[0]
    return tuple(tuple(int(v) for v in seg.split(",")) for seg in text.split(";") if seg)


def _with_missing(spec: str, sources) -> list:
    present = iter(sources)
    return [next(present) if c == "1" else None for c in spec.split("|")[1]]


def compute(kind: str, spec: str, sources) -> torch.Tensor:
    """The re-layout of the present ``sources`` (missing ones as the spec says)."""
    return _KINDS[kind](spec, *_with_missing(spec, sources))


def _key(kind, spec, sources):
    return (kind, spec, tuple((t._version, t.data_ptr(), tuple(t.shape), tuple(t.stride()),
                               t.dtype) for t in sources))


@torch.library.custom_op("coda::relayout", mutates_args=())
def relayout(kind: str, spec: str, sources: list[torch.Tensor]) -> torch.Tensor:
    """``compute(kind, spec, sources)``, reused while no source changed."""
    holder = sources[0]
    capturing = holder.is_cuda and torch.cuda.is_current_stream_capturing()
    key = _key(kind, spec, sources)
    cache = getattr(holder, _ATTR, None)
    if not capturing and cache is not None and cache[0] == key:
        STATS["hit"] += 1
        return cache[1].detach()  # a new tensor object: each call's autograd history is its own
    with torch.no_grad():
        out = compute(kind, spec, sources).contiguous()
    STATS["miss"] += 1
    if not capturing:
        setattr(holder, _ATTR, (key, out))
    return out


@relayout.register_fake
def _(kind, spec, sources):
    return compute(kind, spec, sources).contiguous()


def _setup_context(ctx, inputs, output):
    kind, spec, sources = inputs
    ctx.kind, ctx.spec = kind, spec
    ctx.save_for_backward(*sources)


def _backward(ctx, grad):
    """A re-layout only moves entries: its gradient moves them back (autograd of the
    same function on the saved sources)."""
    sources = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = compute(ctx.kind, ctx.spec, sources)
        got = torch.autograd.grad(out, sources, grad, allow_unused=True)
    return None, None, list(got)


relayout.register_autograd(_backward, setup_context=_setup_context)
