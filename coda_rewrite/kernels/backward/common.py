"""What the family rules share: the compute dtype, the two GEMMs around an epilogue's
VJP, the rowscale rule every consumer program starts with, and shape checks that
``python -O`` keeps."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable

import torch

from ...codegen import layouts
from ...codegen.program import EpilogueProgram


@dataclasses.dataclass(frozen=True)
class Rule:
    """A family's backward: ``fits(prog)`` (the program shape it is written for),
    ``vjp(prog, a, b, operands, outputs, grads) -> (grad_a, grad_b, [grad per operand])``
    and ``saves(prog) -> (output indices the backward reads, operand names it needs only
    the dtype of)``. The gradient of an output nothing reads arrives as None (the op
    does not materialise zeros), and every vjp takes that."""
    fits: Callable[[EpilogueProgram], bool]
    vjp: Callable
    saves: Callable[[EpilogueProgram], tuple[list[int], set[str]]] = \
        lambda prog: ([], set())


def up(t: torch.Tensor) -> torch.Tensor:
    """The compute dtype of the forward: float32, or float64 for a float64 model."""
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


class OtherShape(Exception):
    """A program is not of the shape a specialised rule's parser reads."""


def expect(condition: bool) -> None:
    """A shape parser's check: a plain ``if``, never an ``assert`` (``python -O`` strips
    those, and a rule would then be taken for a program it does not fit)."""
    if not condition:
        raise OtherShape


def shaped(parts):
    """A predicate from a program-shape parser: ``parts(prog)`` raises OtherShape on
    another shape (each rule parses its program once, and the parse is its test)."""
    def matches(prog: EpilogueProgram) -> bool:
        try:
            parts(prog)
            return True
        except (OtherShape, ValueError, KeyError, IndexError):  # unpacking a short body
            return False
    return matches


# Whether the fused GEMM's weight (b) wants a gradient: set by the op's autograd around
# its rule (weight_grad_wanted: kernels/ops._backward, relayout's recomputed backward).
# Frozen weights (adapter fine-tuning) skip the wgrad GEMM, which optimize()'s graphs, run
# without AOTAutograd's dead-code elimination, would otherwise compute and drop.
_WANT_WEIGHT_GRAD = contextvars.ContextVar("coda_want_weight_grad", default=True)


@contextlib.contextmanager
def weight_grad_wanted(wanted):
    """Run a rule knowing whether its weight wants a gradient (``wgrad`` reads it)."""
    token = _WANT_WEIGHT_GRAD.set(bool(wanted))
    try:
        yield
    finally:
        _WANT_WEIGHT_GRAD.reset(token)


# Which arrangement the rules take, forced: None lets the tensors decide (traced). The
# witness's gradient replay runs every rule both ways (algebra/witness.both_arrangements):
# it runs inside the compiler, where the tensors alone would pick the traced one, while
# optimize()'s graphs run an eager backward
_ARRANGEMENT = contextvars.ContextVar("coda_backward_arrangement", default=None)


class Arrangement:
    """A forced arrangement, and whether a rule read it (``asked``): a replay no rule
    asked took the one path there is, so the other arrangement is the same replay."""

    def __init__(self, traced_backward: bool):
        self.traced, self.asked = bool(traced_backward), False


@contextlib.contextmanager
def arranged_as(traced_backward: bool):
    """Run rules as a traced backward (True) or an eager one (False) arranges them,
    whatever the tensors are; yields the Arrangement."""
    arrangement = Arrangement(traced_backward)
    token = _ARRANGEMENT.set(arrangement)
    try:
        yield arrangement
    finally:
        _ARRANGEMENT.reset(token)


def traced(tensors) -> bool:
    """Whether a rule takes a traced backward's arrangement: fake or functional tensors
    (what AOTAutograd traces for Inductor), unless arranged_as forces one."""
    forced = _ARRANGEMENT.get()
    if forced is None:
        return not layouts.real(tensors)
    forced.asked = True
    return forced.traced


def wgrad(d: torch.Tensor, a: torch.Tensor, r: torch.Tensor | None = None
          ) -> torch.Tensor | None:
    """dᵀ·a, the weight's gradient, or dᵀ·(r ⊙ a) under a row scale r (float32/64,
    [M, 1]); in the operands' dtype; None where the weight is frozen.

    Given r, it goes on the activation, not on d: r ⊙ a is the normalised row eager's
    own weight gradient reads (of order one), while d is at the loss scale and r can be
    large (1/rms of a residual stream: about 50 at initialisation), so r ⊙ d can leave
    float16's range where eager's GEMM operands stay inside it (a float16 step under a
    loss scale of 2¹⁶ gave infinite gradients that way). It is also the narrower of the
    two in every consumer of a norm (K ≤ N: q/k/v, gate/up, the LM head). The one
    exception is through_scaled_acc's: a traced backward outside float16, where r ⊙ d
    rides in the kernel that forms d and costs nothing."""
    if not _WANT_WEIGHT_GRAD.get():
        return None
    if r is not None:
        d, a = d.to(a.dtype), (up(a) * r).to(a.dtype)
    return d.t() @ a


def gemm_grads(d_acc: torch.Tensor, a, b):
    """grad_a = d_acc·b, grad_b = d_accᵀ·a (None for a frozen weight), in the operands'
    dtype."""
    d = d_acc.to(a.dtype)
    return d @ b, wgrad(d, a)


def through_scaled_acc(prog, a, b, operands, dy, dy_fusable: bool = True):
    """Gradients of y = r ⊙ acc (+ bias) given dy (float32/64, or 16-bit where a backward
    GEMM's epilogue formed it): the rowscale rule
    (no acc needed: dr is a row dot with the GEMM dy·b the backward computes anyway).
    Operands other than r and bias get no gradient.

    Where r goes: on dy (dy_r = r ⊙ dy feeds both GEMMs: grad_a = dy_r·b, grad_b =
    dy_rᵀ·a, dr = Σ_k grad_a·a / r; 0 on a row whose r is 0, where only r³·dr is read)
    when the backward is traced, dy comes out of a kernel Inductor writes
    (``dy_fusable``: not an opaque op's output) and the dtype is not float16: the scale
    then rides in the kernel that forms dy, where r ⊙ a (wgrad's other placement) is a
    pass of its own over the activation, one per norm and step (0.69 ms of the 1B step
    on an H100, BENCHMARKS.md forty-seventh session). Otherwise on a, as ``wgrad``
    explains (float16's range; an eager backward, where r ⊙ dy would be a pass
    over the wider side)."""
    by_name = dict(zip((o.name for o in prog.operands), operands))
    grads_by_name = {}
    if "bias" in by_name:  # dy may be 16-bit (formed in a GEMM's epilogue): sum wide
        grads_by_name["bias"] = dy.sum(0, dtype=up(dy).dtype).to(by_name["bias"].dtype)
    if "r" in by_name:
        r = up(by_name["r"])[:, None]
        if dy_fusable and a.dtype != torch.float16 and traced([dy]):
            dy_r = (up(dy) * r).to(b.dtype)               # in dy's own kernel
            grad_a = (dy_r @ b).to(a.dtype)                # r ⊙ (dy·b)
            grad_b = wgrad(dy_r.to(a.dtype), a)
            # a row with r = 0 (z² overflowed) has grad_a = 0 exactly: 0, not 0/0
            nonzero = torch.where(r[:, 0] == 0, torch.ones_like(r[:, 0]), r[:, 0])
            grads_by_name["r"] = ((up(grad_a) * up(a)).sum(-1) / nonzero).to(
                by_name["r"].dtype)
        else:
            g = up(dy.to(b.dtype) @ b)                    # G = dy·b
            grad_a = (g * r).to(a.dtype)
            grad_b = wgrad(dy, a, r)
            grads_by_name["r"] = (g * up(a)).sum(-1).to(by_name["r"].dtype)
    else:
        grad_a, grad_b = gemm_grads(dy, a, b)
    return grad_a, grad_b, [grads_by_name.get(o.name) for o in prog.operands]


