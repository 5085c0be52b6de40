"""The ``coda::`` custom ops and the functions the rewritten graph calls.

One op runs every program: ``coda::gemm_epilogue(program, a, b, operands)``. The program
text (codegen/program.py) says what the epilogue does, so a new pattern needs no new op.
On Hopper, with tensors that meet the layout contract, the op launches the kernel
generated from the program (kernels/quack_path.py); everywhere else it runs the reference
interpreter (kernels/reference.py). ``RUNTIME`` counts which implementation ran and why,
and the report shows it: a fallback is never silent.

Autograd: the backward recomputes the program from the saved inputs (the accumulator
included) and differentiates the reference. That is correct for any program and costs one
extra GEMM per fused op in the backward; a specialised backward that keeps the
GEMM+epilogue shape is future work (DESIGN.md, "Where it leads").

The graph does not call the op directly but ``fused_linear`` / ``fused_rowwise`` below:
they flatten leading dims to the op's 2-D contract and give per-row results back a
trailing dim of 1, so the row selections that sit between a norm and its GEMM (Hugging
Face's ``logits_to_keep`` slice) apply to them unchanged.
"""

from __future__ import annotations

import collections
import threading

import torch

from ..codegen.program import Kind, parse
from . import quack_path, reference

# (program key, implementation, reason) -> calls. Read it with runtime_summary().
RUNTIME: collections.Counter = collections.Counter()
_lock = threading.Lock()


def _count(program, impl: str, reason: str) -> None:
    with _lock:
        RUNTIME[(program.key, impl, reason)] += 1


def runtime_summary() -> list[str]:
    with _lock:
        items = sorted(RUNTIME.items())
    return [f"{key}: {impl} ({reason}) x{n}" for (key, impl, reason), n in items]


def _run_reference(program, a, b, operands):
    device = (a if a is not None else operands[0]).device
    # The op owns its numerics: an ambient autocast must not re-cast inside the reference
    # (the rewrite already cast the GEMM operands where eager's autocast would have).
    with torch.autocast(device_type=device.type, enabled=False):
        return reference.run_program(program, a, b, operands)


def _fresh(outs, inputs):
    """Custom-op outputs may alias neither an input nor each other (a program may store
    an operand unchanged, or one value twice)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    fresh = []
    for o in outs:
        if o.untyped_storage().data_ptr() in taken or not o.is_contiguous():
            o = o.clone(memory_format=torch.contiguous_format)
        taken.add(o.untyped_storage().data_ptr())
        fresh.append(o)
    return fresh


@torch.library.custom_op("coda::gemm_epilogue", mutates_args=())
def gemm_epilogue(program: str, a: torch.Tensor | None, b: torch.Tensor | None,
                  operands: list[torch.Tensor]) -> list[torch.Tensor]:
    prog = parse(program)
    kernel, why = quack_path.select(prog, program, a, b, operands)
    if kernel is not None:
        _count(prog, "kernel", "generated QuACK epilogue")
        outs = quack_path.run(*kernel, a, b, operands)
    else:
        _count(prog, "reference", why)
        outs = _run_reference(prog, a, b, operands)
    return _fresh(outs, [a, b, *operands])


@gemm_epilogue.register_fake
def _(program, a, b, operands):
    prog = parse(program)
    m, n = reference.problem_size(prog, a, b, operands)
    like = a if a is not None else operands[0]
    return [like.new_empty((m, n) if o.kind == Kind.TILE else (m,),
                           dtype=reference.dtype_from_name(o.dtype))
            for o in prog.outputs]


def _setup_context(ctx, inputs, output):
    program, a, b, operands = inputs
    ctx.program = program
    ctx.n_operands = len(operands)
    ctx.has_a, ctx.has_b = a is not None, b is not None
    ctx.save_for_backward(*(t for t in (a, b) if t is not None), *operands)


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    a = saved.pop(0) if ctx.has_a else None
    b = saved.pop(0) if ctx.has_b else None
    operands = saved
    prog = parse(ctx.program)
    leaves = [t for t in (a, b, *operands)
              if t is not None and t.is_floating_point()]
    with torch.enable_grad():
        detached = {id(t): t.detach().requires_grad_(True) for t in leaves}

        def d(t):
            return None if t is None else detached.get(id(t), t)

        outs = _run_reference(prog, d(a), d(b), [d(t) for t in operands])
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = list(detached.values())
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True) if pairs else [None] * len(wrt)
    by_id = dict(zip(detached.keys(), got))
    grad_of = lambda t: None if t is None else by_id.get(id(t))  # noqa: E731
    return None, grad_of(a), grad_of(b), [grad_of(t) for t in operands]


gemm_epilogue.register_autograd(_backward, setup_context=_setup_context)


# ---- what the rewritten graph calls ---------------------------------------------------

def _flatten_operands(prog, operands):
    flat = []
    for spec, t in zip(prog.operands, operands):
        if spec.kind == Kind.TILE:
            t = t.reshape(-1, t.shape[-1])
        elif spec.kind == Kind.PER_ROW:
            t = t.reshape(-1)
        flat.append(t)
    return flat


def _unflatten(prog, outs, lead):
    return tuple(o.reshape(*lead, o.shape[-1]) if spec.kind == Kind.TILE
                 else o.reshape(*lead, 1)
                 for spec, o in zip(prog.outputs, outs))


def fused_linear(program: str, x: torch.Tensor, weight: torch.Tensor,
                 *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``program`` over ``x @ weight.T`` (nn.Linear layout), x of any leading shape.
    Tile outputs come back as [*lead, N], per-row outputs as [*lead, 1]."""
    prog = parse(program)
    lead = x.shape[:-1]
    outs = gemm_epilogue(program, x.reshape(-1, x.shape[-1]), weight,
                         _flatten_operands(prog, operands))
    return _unflatten(prog, outs, lead)


def fused_rowwise(program: str, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A program without a GEMM; its first tile operand gives the leading shape."""
    prog = parse(program)
    tile = next(t for s, t in zip(prog.operands, operands) if s.kind == Kind.TILE)
    lead = tile.shape[:-1]
    outs = gemm_epilogue(program, None, None, _flatten_operands(prog, operands))
    return _unflatten(prog, outs, lead)


def rows_like(r: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Reshape a per-row value [..., 1] to follow ``h``'s reshape of its leading dims
    (the last dim of ``h`` unchanged, so rows keep their C order)."""
    return r.reshape(*h.shape[:-1], 1)
