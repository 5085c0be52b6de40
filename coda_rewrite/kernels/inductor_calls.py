"""Inductor's generated code calls a coda op's Python kernel itself, not through torch.ops.

Every fused GEMM is a ``coda::`` op whose one kernel is a Python function (ops.py, and
the ops beside it: relayout.py, grouped.py, fp8.py, dgated.py). Inductor has no lowering
for them, so its wrapper calls each as ``torch.ops.coda.<op>.default(...)``: the
dispatcher, then its Python kernel holder, which converts every argument into a Python
object again (the program's text into a new string, hashed again by the route lookup)
and the returned list back. That round trip is what the op boundary costs a fused call
under Inductor: ~2.9 µs of a 2-core CPU for a kernel that does nothing, 4.8–6.4 µs of
an H100 machine's host for the fused GEMMs at M = 64 (BENCHMARKS.md, fortieth session),
paid once per fused GEMM per forward, where #15's bar is F.linear's call + 10 µs.

Inside Inductor's compiled code what the dispatcher adds does not apply to a fused
GEMM's forward kernel: no autograd records there (AOTAutograd wraps the compiled forward,
and these ops have no formula of their own: a call where one could be asked for is
refused by the kernel itself, not by the dispatcher), no mode is active that Inductor's
own kernels would not escape as well, and the kernel is device-generic
(CompositeExplicitAutograd). What can still tell the two calls apart is what the
kernel itself does inside a compiled graph: the kernels registered here launch QuACK or
run the reference's torch ops on tensors that require no grad, and the GPU suite runs
them called directly; FP8's column quantisation, which compiles an Inductor graph of its
own on its first call, failed called directly from a compiled backward (H100, fortieth
session: "FunctionalTensor on its own" in its nested AOTAutograd trace; cause not
isolated; the thread-local dispatch-key sets inside a kernel are the same either way, on
the CPU). So only the forward GEMM ops register through ``python_kernel``
(gemm_epilogue_nograd, gemm_relaid, gemm_layernorm_kept, grouped_gemm_epilogue: what an
inference graph calls); the FP8 ops and the backward's stay behind the dispatcher.
``python_kernel`` registers an op's kernel for both: the
dispatcher (eager calls, tracing, every graph optimize() runs as Python) and, under a
name on Inductor's ``extern_kernels`` namespace (where its generated code finds its own
extern kernels), Inductor's wrapper.

``install`` (the backend, before it hands a graph to Inductor) registers for each op
what Inductor's implicit fallback would (make_fallback: its layout constraint, realized
inputs) and a lowering that builds the fallback kernel (the same fake outputs and
argument code) as ``_PythonKernelCall``, a FallbackKernel whose generated call names that
function. Where it does not apply, the op is called as before (the same results, the
dispatcher's cost): a C++ or FX wrapper, and a torch whose Inductor lacks these hooks
(checked once: ``install`` returns False, and ops.runtime_summary says so).
The dispatcher also makes the profiler's CPU-side record of an op; the direct call makes
its own, under the op's name, only while a profiler runs (``_recorded``: one C check per
call otherwise), so a trace of a compiled model still shows each fused GEMM as
``coda::<op>`` around its QuACK kernel. Inductor's FX graph
cache does not key on lowerings, so code generated either way may be loaded by the
other (from a cache made before this module, or where ``install`` found no hooks): both
call the same kernel, and ``install`` runs before any compile that could load it.
"""

from __future__ import annotations

import torch

# op (OpOverload) -> (the name its kernel has on Inductor's extern_kernels, the kernel)
_KERNELS: dict = {}
_installed: bool | None = None
_PREFIX = "coda_"
_kernel_class_made = None  # _PythonKernelCall, made on first use (it imports Inductor)


def python_kernel(lib: torch.library.Library, name: str, fn) -> None:
    """Registers ``fn`` as op ``name``'s one kernel (CompositeExplicitAutograd), for the
    dispatcher and for Inductor's generated code. Only for an op with no autograd
    formula (a direct call records nothing) whose kernel traces and compiles no torch
    code of its own (the module docstring says why)."""
    lib.impl(name, fn, "CompositeExplicitAutograd")
    op = getattr(getattr(torch.ops, lib.ns), name).default
    _KERNELS[op] = (_PREFIX + name, fn)
    if _installed:
        _register(op)


def install() -> bool:
    """The lowerings, once per process; False where this torch's Inductor lacks what they
    rest on (its fallback kernel's class and naming hook)."""
    global _installed
    if _installed is None:
        _installed = _hooks_present()
        if _installed:
            for op in list(_KERNELS):
                _register(op)
    return _installed


def installed() -> bool | None:
    """None before the first install(), then whether Inductor calls the kernels."""
    return _installed


def kernel_name(op) -> str | None:
    """The name Inductor's generated code calls ``op``'s kernel by, None for another op."""
    found = _KERNELS.get(op)
    return None if found is None else "extern_kernels." + found[0]


def _hooks_present() -> bool:
    try:
        from torch._inductor import ir, lowering, select_algorithm
        from torch._library import utils as library_utils
    except ImportError:
        return False
    return (hasattr(select_algorithm, "extern_kernels")
            and hasattr(library_utils, "get_layout_constraint_tag")
            and hasattr(ir.FallbackKernel, "set_python_kernel_name")
            and hasattr(ir.FallbackKernel, "create")
            and hasattr(lowering, "register_lowering")
            and hasattr(lowering, "make_fallback")
            and hasattr(lowering, "tag_to_layout_constraint"))


def _register(op) -> None:
    from torch._inductor import lowering
    from torch._inductor.select_algorithm import extern_kernels
    from torch._library.utils import get_layout_constraint_tag
    name, fn = _KERNELS[op]
    setattr(extern_kernels, name, _recorded(str(op.name()), fn))
    # what Inductor's implicit fallback registers for a custom op on first sight (its
    # layout constraint from the op's tags, else the configured default; realized
    # inputs; the fallback set), then this lowering in its place
    lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(
        get_layout_constraint_tag(op, with_default=True)), warn=False)
    kernel_class = _kernel_class()

    def lower(*args, **kwargs):
        outputs = kernel_class.create(op, *args, **kwargs)
        return torch.utils._pytree.tree_map(_wrap, outputs)

    lower._is_fallback_handler = True  # a compile in a subprocess rebuilds it as one
    lowering.register_lowering(op, type_promotion_kind=None)(lower)


def _recorded(label: str, fn):
    """``fn`` as Inductor's code calls it: inside a profiler record named ``label`` (the
    op's name, as the dispatcher's record has it) while a profiler runs; else ``fn``
    itself, after one C check of the profiler's state."""
    profiling = torch._C._autograd._profiler_enabled

    def call(*args, **kwargs):
        if not profiling():
            return fn(*args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    call.__wrapped__ = fn  # the op's kernel (tests check the call is that function's)
    call.__name__ = getattr(fn, "__name__", label)
    return call


def _wrap(x):
    from torch._inductor import ir
    if not isinstance(x, ir.IRNode):
        return x
    wrap = getattr(x, "wrap_for_lowering", None)
    return wrap() if wrap is not None else ir.TensorBox.create(x)


def _kernel_class():
    """FallbackKernel, but the Python wrapper's call names the op's kernel (set where
    Inductor names any extern kernel's call, from its op)."""
    global _kernel_class_made
    if _kernel_class_made is not None:
        return _kernel_class_made
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    class _PythonKernelCall(ir.FallbackKernel):
        def set_python_kernel_name(self, python_kernel_name):
            super().set_python_kernel_name(python_kernel_name)
            name = kernel_name(self.op_overload)
            if name is not None and python_kernel_name is None and \
                    not V.graph.cpp_wrapper and not getattr(V.graph, "fx_wrapper", False):
                self.python_kernel_name = name

    _kernel_class_made = _PythonKernelCall
    return _PythonKernelCall
