"""Values derived from tensors, kept on a tensor between calls and recomputed when one
of those tensors changed.

Two things are worth keeping this way: the fused GEMMs' re-laid-out weights
(relayout.py, opt-in) and RoPE's per-column frequencies (patterns/rope.rope_frequencies, run
eagerly). The key is what PyTorch itself tracks: each tensor's version counter (moved
by every in-place update autograd sees, shared by aliases), storage, shape, strides and
dtype. The kept value lives on the holder tensor object, so it dies with it: no stale
hit from a new tensor at a recycled address.

Nothing is kept where the key would mean nothing: traced (fake or functional) tensors,
a CUDA-graph capture in progress (a replay cannot look at versions), inference tensors
(no version counter; inference mode may update them in place unseen). Writes through
``t.data`` go unseen (a separate version counter), as they do by autograd. A value made
under torch.inference_mode() is an inference tensor, which autograd refuses to save: it
is handed out only inside inference mode, and made again outside it (an evaluation under
inference_mode followed by a training step would otherwise fail in the backward).
"""

from __future__ import annotations

import torch

from ..codegen.layouts import real


def _keyable(tensors) -> bool:
    # loops, not generators: this runs on every kept-weight GEMM call of a decode step
    if not real(tensors):
        return False
    cuda = False
    for t in tensors:
        if t.is_inference():
            return False
        cuda = cuda or t.is_cuda
    return not (cuda and torch.cuda.is_current_stream_capturing())


def kept(holder: torch.Tensor, slot: str, tensors, extra, compute):
    """(``compute()``, "hit" / "miss" / "not kept"): the value kept on ``holder`` under
    ``slot`` while no tensor changed and ``extra`` (what else the value depends on) is
    the same; else computed, and kept where a key means something."""
    if not _keyable(tensors):
        return compute(), "not kept"
    key = _key(tensors, extra)
    cache = getattr(holder, slot, None)
    if cache is not None and cache[0] == key and usable_here(cache[1]):
        return cache[1], "hit"
    out = compute()
    setattr(holder, slot, (key, out))
    return out, "miss"


def peek(holder: torch.Tensor, slot: str, tensors, extra):
    """The value ``kept`` would hand out as a hit, else None (nothing computed or kept):
    a caller's fast path that falls back to its full call on None."""
    cache = getattr(holder, slot, None)
    if cache is None or not _keyable(tensors) or cache[0] != _key(tensors, extra) or \
            not usable_here(cache[1]):
        return None
    return cache[1]


def _key(tensors, extra) -> tuple:
    return (extra, tuple([(t._version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
                          for t in tensors]))


def usable_here(value) -> bool:
    """Whether a kept value may be handed out in the current mode: an inference tensor
    only inside inference mode (outside it autograd cannot save it)."""
    return not (isinstance(value, torch.Tensor) and value.is_inference()
                and not torch.is_inference_mode_enabled())
