"""The ``coda::`` custom ops and the functions the rewritten graph calls.

One op runs every program: ``coda::gemm_epilogue(program, a, b, operands)``. The program
text (codegen/program.py) says what the epilogue does, so a new pattern needs no new op.
On Hopper, with tensors that meet the layout contract, the op launches the kernel
generated from the program (kernels/quack_path.py); everywhere else it runs the reference
interpreter (codegen/reference.py). ``runtime_counts()`` says which implementation ran
and why, and the report shows it: a fallback is never silent.

Autograd: kernels/backward/ (a rule per family). The backward runs its GEMMs on the
16-bit operands and recomputes no GEMM for the programs the patterns produce.

The graph does not call the op directly but ``fused_linear`` / ``fused_rowwise`` below:
they flatten leading dims to the op's 2-D contract and give per-row results back a
trailing dim of 1, so the row selections that sit between a norm and its GEMM (Hugging
Face's ``logits_to_keep`` slice) apply to them unchanged. Given the op's 2-D form they
give it back (row_chains.py chains them so), and where nothing traces and no gradient
is recorded they call the kernel path as a function: a call in a metadata class its
program launched in recently, in the op's form or the model's shapes, reaches the launch
through one C++ check (_last_route). Where autograd records the call, ``record`` enters
its C++ apply without Function.apply's per-call Python layer.
"""

from __future__ import annotations

import collections
import functools
import threading
import warnings

import torch

from ..codegen import layouts, reference
from ..codegen.program import Kind, parse
from ..graph_utils import FUSED_LINEAR_MARK, ROW_CALL_MARK
from . import backward, inductor_calls, quack_path, sharding

# (program key, implementation, reason) -> calls, for every call but a generated kernel's
# (each Launch counts its own: Launch.calls). Read both with runtime_counts().
RUNTIME: collections.Counter = collections.Counter()
_lock = threading.Lock()
_KERNEL = ("kernel", "generated QuACK epilogue")


def _count(program, impl: str, reason: str) -> None:
    count(program.key, impl, reason)


def count(key: str, impl: str, reason: str) -> None:
    """One call of the kernel or op named ``key`` ran ``impl`` for ``reason`` (a witness's
    float64 replay is no call of the model's: not counted)."""
    if _witness_running():
        return
    with _lock:
        RUNTIME[(key, impl, reason)] += 1


_replaying = threading.local()


class uncounted:
    """The calls inside are a witness's replay (algebra/witness.guarded): they run the
    reference on float64 tensors by design, and the runtime counts and fallback warnings
    are about the model's own calls (tools/survey.py's "reference ran" listed them)."""

    def __enter__(self):
        _replaying.depth = getattr(_replaying, "depth", 0) + 1

    def __exit__(self, *exc):
        _replaying.depth -= 1


def _witness_running() -> bool:
    """Inside ``uncounted`` (on this thread: a witness's off-thread replay enters it on
    its own, algebra/witness.replay_off_thread)."""
    return getattr(_replaying, "depth", 0) > 0


def count_reference(key: str, reason: str, device: torch.device) -> None:
    """A fused op ran its reference (torch ops in the compute dtype) instead of its kernel.
    Expected off Hopper; on a CUDA device it is a rewrite that runs slower than the graph
    it replaced (seen: a float32 gradient sent the routed experts' backward to the
    reference, 124 ms instead of 32 a step), so it also warns, once per kernel and
    reason (Python's warning registry), besides the count runtime_summary() shows."""
    count(key, "reference", reason)
    if device.type == "cuda" and not _witness_running():
        warnings.warn(f"coda_rewrite: {key} runs its reference implementation on {device}, "
                      f"not its generated kernel ({reason}): slower than the unfused graph; "
                      "coda_rewrite.kernels.ops.runtime_summary() lists every fallback",
                      RuntimeWarning, stacklevel=3)


def runtime_counts() -> collections.Counter:
    """(program key, implementation, reason) -> calls so far: RUNTIME, and each generated
    kernel's launches, which its Launch counts (a fused call's host time is what a decode
    step pays, and a shared counter under a lock cost ~0.9 µs of it on a 2-core CPU)."""
    with _lock:
        counts = collections.Counter(RUNTIME)
        launches = [r for r in _routes.values() if isinstance(r, quack_path.Launch)]
    for launch in launches:
        if launch.calls:
            counts[(launch.ks.program.key, *_KERNEL)] += launch.calls
    return counts


def reset_runtime() -> None:
    """Forget every count runtime_counts() gives (a benchmark that counts per variant)."""
    with _lock:
        RUNTIME.clear()
        for route in _routes.values():
            if isinstance(route, quack_path.Launch):
                route.calls = 0


def runtime_summary() -> list[str]:
    """Which implementation ran for each program and why, and each kernel's first call
    (compile, or a load from QuACK's disk cache on a warm start)."""
    items = sorted(runtime_counts().items())
    lines = [f"{key}: {impl} ({reason}) x{n}" for (key, impl, reason), n in items]
    lines += [f"kernel {key} ready in {s:.1f} s (first call)" for key, s in quack_path.COMPILES]
    if inductor_calls.installed() is False:
        lines.append("Inductor's graphs call the fused ops through torch.ops: this torch's "
                     "Inductor lacks what kernels/inductor_calls.py rests on (the same "
                     "results, the dispatcher's host time per call)")
    return lines + launch_configs()


def launch_configs() -> list[str]:
    """Which tile config each kernel launched with, by problem size (the size policy:
    quack_path.config_for), one line per program and config with the rows it saw."""
    seen: dict[tuple, set] = collections.defaultdict(set)
    with _lock:
        launches = [r for r in _routes.values() if not isinstance(r, str)]
    for r in launches:  # a program's launch, or another op's (kernels/dgated.py: .key)
        key = r.ks.program.key if isinstance(r, quack_path.Launch) else r.key
        seen[(key, quack_path.config_name(r.config))].add((r.m, r.n))
    return [f"kernel {key}: {cfg} for M x N in "
            + ", ".join(f"{m} x {n}" for m, n in sorted(sizes)[:8])
            + (f" (+{len(sizes) - 8} more)" if len(sizes) > 8 else "")
            for (key, cfg), sizes in sorted(seen.items())]


def _run_reference(program, a, b, operands):
    device = (a if a is not None else operands[0]).device
    # The op owns its numerics: an ambient autocast must not re-cast inside the reference
    # (the rewrite already cast the GEMM operands where eager's autocast would have).
    with torch.autocast(device_type=device.type, enabled=False):
        outs = reference.run_program(program, a, b, operands)
    return _partials_as_launched(program, outs, a, b, operands, device)


def _partials_as_launched(prog, outs, a, b, operands, device):
    """The reference's ROW_PARTIALS outputs (one merged column) as wide as a launch gives
    them (quack_path.partial_columns: what a traced graph's fake promised): the sum in the
    first column, zeros after it, so every reader's Σ_t is the same value (x + 0 is x)."""
    if device.type != "cuda" or not any(o.kind == Kind.ROW_PARTIALS for o in prog.outputs):
        return outs
    m, n = reference.problem_size(prog, a, b, operands)
    width = quack_path.partial_columns(prog, m, n, device)
    return [torch.nn.functional.pad(t, (0, width - t.shape[1]))
            if o.kind == Kind.ROW_PARTIALS and t.shape[1] < width else t
            for o, t in zip(prog.outputs, outs)]


def _fresh(outs, inputs):
    """Custom-op outputs may alias neither an input nor each other (a program may store
    an operand unchanged, or one value twice), and may not be views: autograd marks a
    view returned by a multi-output op as one that no in-place op may touch, so a model
    that updates the fused output in place (``p.mul_(s)``, valid in eager) would fail
    (found by tests/test_property_gated.py: the reference's outputs are expand/reshape
    views of its values). A view that covers its whole base gives the base back."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    fresh = []
    for o in outs:
        base = o._base
        if base is not None and base.shape == o.shape and base.stride() == o.stride() \
                and base.storage_offset() == o.storage_offset() and base.dtype == o.dtype:
            o = base
        if o.untyped_storage().data_ptr() in taken or not o.is_contiguous() or \
                o._base is not None:
            o = o.clone(memory_format=torch.contiguous_format)
        taken.add(o.untyped_storage().data_ptr())
        fresh.append(o)
    return fresh


def execute(program: str, a, b, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run a program: the generated kernel where its layout contract holds, else the
    reference. The route (and, for a kernel, its prepared launch) is decided once per
    program and tensor-metadata class (quack_path.metadata_key) and reused; a call in
    the class the program last ran in finds it through _last_route, in one C++ check."""
    outs = _run_known(program, a, b, operands)
    return outs if outs is not None else _decide_and_run(program, a, b, operands)


def _decide_and_run(program: str, a, b, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """execute for a call in no class _last_route knows: the route by tensor metadata
    (decided on the class's first call), then the launch or the reference."""
    prog = parse(program)

    def decide():
        kernel, why = quack_path.select(prog, program, a, b, operands)
        return quack_path.prepare(*kernel, a, b, operands) if kernel is not None else why
    route = route_of((program, quack_path.metadata_key(a, b, operands)), decide)
    if isinstance(route, str):
        count_reference(prog.key, route, (a if a is not None else operands[0]).device)
        return _fresh(_run_reference(prog, a, b, operands), [a, b, *operands])
    _remember(program, a, b, operands, route)
    return route(a, b, operands)  # fresh buffers, never an input; the launch counts it


# (kernel, tensor-metadata key) -> a prepared kernel launch, or why the reference runs
# (a program's text, or another op's tag: kernels/dgated.py); bounded: a launch for a
# shape class not seen again is only a few host objects, but dynamic prompt lengths make
# new classes without end
_routes: dict[tuple, object] = {}
_MAX_ROUTES = 4096


def route_of(key: tuple, decide):
    """The route memoised under ``key``, decided by ``decide()`` on its first call."""
    route = _routes.get(key)
    if route is None:
        route = decide()
        with _lock:
            if len(_routes) >= _MAX_ROUTES:  # e.g. a server seeing every prompt length
                _forget()
            _routes[key] = route
    return route


def forget_routes() -> None:
    """Drop every decided route and prepared launch: each class decides again on its
    next call (a benchmark that changes a tile config between runs)."""
    with _lock:
        _forget()


def _forget() -> None:
    for route in _routes.values():  # the dropped launches' counts stay in the summary
        if isinstance(route, quack_path.Launch) and route.calls:
            RUNTIME[(route.ks.program.key, *_KERNEL)] += route.calls
    _routes.clear()
    _last.clear()  # the fast path's classes point at the routes dropped


# program text -> [(guard, route, the table it came from, no tensor requires grad)]: the
# metadata classes each program last launched in (a few: one program text can serve
# several GEMMs of a layer). Building metadata_key reads six attributes of every tensor
# from Python (3-4 µs for a q/k/v GEMM's five tensors on a 2-core CPU, about twice that
# on the H200's host), per call. Dynamo's TensorGuards checks sizes, strides, dtype,
# device, requires_grad and dispatch keys of all of them in one C++ call (0.45 µs); the
# pointers' 16-byte alignment is read here. A storage offset reaches a launch only
# through its tensor's data pointer, so the pointer's alignment is what a launch assumes
# of it. Kernel routes only: a reference route is the first call's own path. fused_linear
# looks here first too: a call already in the op's form (row_chains.py) with nothing for
# autograd to record goes straight to its launch.
_last: dict[str | tuple, list] = {}
_LAST_CLASSES = 8


def _last_route(program, a, b, operands, grad_free: bool = False):
    """The route of the class ``program`` last ran (a, b, operands) in, if any; with
    ``grad_free``, only a class with no tensor that requires grad."""
    classes = _last.get(program)
    if classes is None or a is None or b is None:
        return None
    for guard, route, table, no_grad in classes:
        if table is _routes and (no_grad or not grad_free) and guard.check(a, b, *operands):
            bits = a.data_ptr() | b.data_ptr()
            for t in operands:
                bits |= t.data_ptr()
            return None if bits & 15 else route
    return None


def _run_known(program, a, b, operands, grad_free: bool = False):
    """The launch's outputs where the call is in a class _last_route knows, else None."""
    route = _last_route(program, a, b, operands, grad_free)
    return None if route is None else route(a, b, operands)


# A call at a chain's edge (row_chains.py) takes the model's [*lead, K] and gives back
# [*lead, N]. Its classes are kept apart, under ("edge", program), each with the launch
# its flattened call ran and the shapes of that call (_EdgeRoute). The flattening is a
# function of the metadata the guard checks (a view where the strides allow one, else a
# contiguous copy, which is aligned), so the class's flattened call is always the one
# the launch was prepared for. Measured on the 2-core CPU (stub launch): 11.1 µs a call
# through _linear, 6.2 here (three reshapes of ~0.8 µs each); the op's 2-D form, 2.1.
class _Reshaped:
    """A program's launch for the calls of one metadata class in the caller's shapes: how
    its first call flattened them into the op's 2-D form (x to ``rows``, each operand
    to its shape, None where it passed as it was) and the shapes its outputs went back
    to. A 2-D x (a call inside a chain) is flattened by nothing (``rows`` None). Every
    route is made from the same arguments (_remember_reshaped); ``flat_outs``, the op's
    own outputs, only the recorded route keeps (its backward's shapes)."""
    __slots__ = ("launch", "ks", "rows", "operand_shapes", "out_shapes")

    def __init__(self, launch, x, a, operands, flat, outs, flat_outs):
        self.launch, self.ks = launch, launch.ks
        self.rows = None if a is x else tuple(a.shape)
        self.operand_shapes = [None if f is t else tuple(f.shape)
                               for t, f in zip(operands, flat)]
        self.out_shapes = None if a is x else [tuple(o.shape) for o in outs]

    def flatten(self, x, operands):
        return (x if self.rows is None else x.reshape(*self.rows),
                [t if s is None else t.reshape(*s)
                 for t, s in zip(operands, self.operand_shapes)])

    def unflatten(self, outs) -> tuple[torch.Tensor, ...]:
        if self.out_shapes is None:
            return tuple(outs)
        return tuple(o.reshape(*s) for o, s in zip(outs, self.out_shapes))


class _EdgeRoute(_Reshaped):
    """A program's launch called on the model's shapes of one metadata class."""
    __slots__ = ()

    def __call__(self, x, weight, operands) -> tuple[torch.Tensor, ...]:
        a, flat = self.flatten(x, operands)
        return self.unflatten(self.launch(a, weight, flat))


def _remember_reshaped(route: type[_Reshaped], kind: str, program, x, weight, operands,
                       a, flat, outs, flat_outs) -> None:
    """After a call on real tensors (x, operands as the caller gave them; a, flat as the
    op's; outs as returned, flat_outs as the op gave them): its class under (``kind``,
    program), as a ``route`` around the launch the flattened call ran, if it ran one
    (execute keeps it among the program's 2-D classes)."""
    launch = _last_route(program, a, weight, flat)
    if launch is not None:
        _remember((kind, program), x, weight, operands,
                  route(launch, x, a, operands, flat, outs, flat_outs))


# A call that autograd records (optimize()'s training forward: grad mode on, a tensor
# that requires grad) in a class seen before is kept under ("recorded", program) with its
# launch (_RecordedRoute): the guard's check covers requires_grad, so a class found there
# is one whose call records a node. It skips _linear's flattening decisions and grad
# checks, Function.apply's argument binding, and the forward's route lookup: autograd's
# C++ apply runs KnownGemm, whose forward is the launch itself; a call in the model's
# shapes runs KnownEdgeGemm, which flattens and reshapes back inside its node. Measured
# on the 2-core CPU (stub launch, rowscale program): 17.2 -> 8.9 µs a recorded call in
# the op's 2-D form, 22.1 -> 13.5 in the model's shapes with the reshapes outside the
# node (each an autograd view node of its own); with them inside, a four-output program
# whose tile operand requires grad 38.1 -> 26.2 µs (the one-output rowscale unchanged).
# On an H100 machine's host the reshapes outside cost 20 µs of a q/k/v call's 68
# (F.linear's recorded call: 26).
class _RecordedRoute(_Reshaped):
    """A program's launch for the recorded calls of one metadata class. A class whose
    first call was in the op's own 2-D form (``op_form``) records KnownGemm around the
    launch; any other records KnownEdgeGemm, whose backward reshapes the gradients
    between the caller's shapes (``x_shape``, ``in_shapes``) and the op's outputs
    (``flat_out_shapes``)."""
    __slots__ = ("op_form", "x_shape", "in_shapes", "flat_out_shapes")

    def __init__(self, launch, x, a, operands, flat, outs, flat_outs):
        super().__init__(launch, x, a, operands, flat, outs, flat_outs)
        # an operand reshaped to () is still reshaped: each shape is tested for None
        self.op_form = self.rows is None and all(s is None for s in self.operand_shapes)
        self.x_shape, self.in_shapes = tuple(x.shape), [tuple(t.shape) for t in operands]
        self.flat_out_shapes = [tuple(o.shape) for o in flat_outs]

    def __call__(self, program, x, weight, operands) -> tuple[torch.Tensor, ...]:
        if self.op_form:
            return _apply_known(self.launch, program, x, weight, *operands)
        return _apply_known_edge(self, program, x, weight, *operands)

    def unflatten_fresh(self, outs) -> tuple[torch.Tensor, ...]:
        """unflatten for a node's forward: each output is returned as a tensor of its own,
        not as a view of the launch's buffer (autograd forbids in-place updates of a view
        a custom Function made, and the model's code may update its outputs in place, as
        it may eager's); the buffer is fresh, so the alias is its only user."""
        if self.out_shapes is None:
            return tuple(outs)
        return tuple(o.reshape(*s).detach() for o, s in zip(outs, self.out_shapes))

    def flat_for_backward(self, a, operands, kept, keep_outputs, grads, dtype_only):
        """The saved tensors and the outputs' gradients in the op's 2-D form (the rule's);
        an operand saved for its dtype alone (an empty tensor) stays as it is."""
        a = a.reshape(*self.rows) if self.rows is not None and a is not None else a
        operands = [t if s is None or only else t.reshape(*s)
                    for t, s, only in zip(operands, self.operand_shapes, dtype_only)]
        flat = self.flat_out_shapes
        kept = [t.reshape(*flat[i]) for t, i in zip(kept, keep_outputs)]
        grads = [None if g is None else g.reshape(*s) for g, s in zip(grads, flat)]
        return a, operands, kept, grads

    def shaped_like_inputs(self, grad_a, grad_ops):
        """The rule's gradients in the caller's shapes of x and the operands."""
        if grad_a is not None and self.rows is not None:
            grad_a = grad_a.reshape(*self.x_shape)
        return grad_a, [g if g is None or s is None else g.reshape(*shape)
                        for g, s, shape in zip(grad_ops, self.operand_shapes,
                                               self.in_shapes)]


def _remember(program, a, b, operands, route) -> None:
    """Keep ``route`` among the program's last classes (``program``: its text, or
    ("edge", text) for the model-shaped calls), where one C++ check finds it again: real
    tensors (a traced one, fake or functional, has no pointer), every pointer aligned,
    the launch a program's (another op's route has no ``ks``)."""
    tensors = (a, b, *operands)
    if _TensorGuards is None or not isinstance(route, (quack_path.Launch, _Reshaped)) or \
            any(type(t) not in _PLAIN for t in tensors) or \
            any(t.data_ptr() & 15 for t in tensors):
        return
    try:
        guard = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except Exception:  # a PyTorch whose private guard API differs: the key path serves
        return
    no_grad = not any(t.requires_grad for t in tensors)
    classes = [c for c in _last.get(program, ()) if c[2] is _routes]
    _last[program] = [(guard, route, _routes, no_grad)] + classes[:_LAST_CLASSES - 1]


try:  # dynamo's C++ tensor check (torch >= 2.1); without it every call builds the key
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover
    _TensorGuards = None


# The op is defined through torch.library's low-level API rather than
# torch.library.custom_op: the same schema, fake and autograd, but a call crosses one
# thin Python kernel instead of custom_op's wrapper layers (measured: 3.4 vs 5.0 µs per
# call under inference_mode, 6.9 vs 8.9 under no_grad, on a 2-core CPU; several times
# that on the GPU host). Inductor calls it once per fused GEMM per forward.
_lib = torch.library.Library("coda", "FRAGMENT")
_lib.define("gemm_epilogue(str program, Tensor? a, Tensor? b, Tensor[] operands) -> Tensor[]")
_lib.impl("gemm_epilogue", execute, "CompositeExplicitAutograd")
gemm_epilogue = torch.ops.coda.gemm_epilogue.default


# The same op without an autograd formula, for graphs that compute no gradient (an
# inference graph under Inductor): the autograd formula above is a Python kernel that
# runs on every call, even under no_grad, and costs more host time than the rest of the
# boundary (measured on a 2-core CPU: 5.9 µs over a direct call with it, 2.3 without; the
# op costs 17–33 µs over a direct call on the H200's host, formula included). Without a
# formula the autograd key falls through to PyTorch's C++ fallback, which would only warn
# if a gradient were asked for: so the op refuses a call where one can be (_needs_grad;
# grad mode below that fallback is the caller's), and fused_linear picks it only where
# none can be. Dynamo guards on grad
# mode and on the inputs' requires_grad, so a graph is retraced if either changes.
_lib.define("gemm_epilogue_nograd(str program, Tensor? a, Tensor? b, Tensor[] operands) "
            "-> Tensor[]")


def refuse_second_derivative(what: str, program: str | None = None) -> None:
    """Called first in a backward that runs ops with no autograd formula of their own (the
    grouped GEMMs, the dgrad epilogues): under ``create_graph=True`` (grad mode on inside
    a backward; AOTAutograd traces backwards with it off) their results would carry no
    graph, and a second derivative would come back without their terms, or a later
    backward would silently skip them. It raises instead. ``program``: a fused GEMM's
    text, named in the message (parsed only then: this runs on every backward)."""
    if torch.is_grad_enabled():
        if program is not None:
            what = f"{what} {parse(program).key}"
        raise RuntimeError(f"coda_rewrite: {what}'s backward runs kernels that have no "
                           "derivative of their own: a backward with create_graph=True "
                           "(a second derivative) is not supported through it; leave the "
                           "family out (options.patterns) for such a model")


def refuse_gradients(op: str, *tensors) -> None:
    """An op without an autograd formula refuses a call where autograd could record one
    (PyTorch's fallback would only warn, and the gradient would be missing). Inside an
    autograd.Function's forward (FusedGemm, relayout.RelaidRecomputed) nothing is
    recorded: grad mode is off there."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"coda::{op} has no autograd formula and was called where a "
                           "gradient can be asked for: the graph must call it through its "
                           "autograd.Function (kernels/ops.FusedGemm, "
                           "kernels/relayout.RelaidRecomputed) there")


def _refuse_gradients(program, a, b, operands) -> None:
    refuse_gradients("gemm_epilogue_nograd", a, b, *operands)


def _execute_nograd(program, a, b, operands):
    # execute's own fast path, inlined: this is every fused call of an Inductor graph
    if torch.is_grad_enabled():
        _refuse_gradients(program, a, b, operands)
    route = _last_route(program, a, b, operands)
    return route(a, b, operands) if route is not None else \
        _decide_and_run(program, a, b, operands)


inductor_calls.python_kernel(_lib, "gemm_epilogue_nograd", _execute_nograd)
gemm_epilogue_nograd = torch.ops.coda.gemm_epilogue_nograd.default


def _fake(program, a, b, operands):
    prog = parse(program)
    m, n = reference.problem_size(prog, a, b, operands)
    like = a if a is not None else operands[0]
    shapes = {Kind.TILE: (m, n), Kind.PAIR: (m, n // 2), Kind.PER_ROW: (m,)}
    if any(o.kind == Kind.ROW_PARTIALS for o in prog.outputs):
        # how many partials a row gets is the launch's tile config, a function of static
        # sizes (deferred_rstd.py defers a traced graph's norms only where they are)
        if not isinstance(m, int) or not isinstance(n, int):
            raise NotImplementedError(f"{prog.key}: row partials of a dynamic row count "
                                      "have no traced shape; such a graph keeps the "
                                      "norm's finaliser")
        shapes[Kind.ROW_PARTIALS] = (m, quack_path.partial_columns(prog, m, n, like.device))
    return [like.new_empty(shapes[o.kind], dtype=reference.dtype_from_name(o.dtype))
            for o in prog.outputs]


def _fake_nograd(program, a, b, operands):
    _refuse_gradients(program, a, b, operands)
    return _fake(program, a, b, operands)


torch.library.register_fake("coda::gemm_epilogue", _fake)
torch.library.register_fake("coda::gemm_epilogue_nograd", _fake_nograd)


def kept_for_backward(program: str, operands, output) -> tuple[list, list, list[int]]:
    """(operands, outputs, their indices) as the program's backward rule reads them, no
    more: an operand it needs only the dtype of (the residual stream coming in) becomes an
    empty tensor of that dtype, so the previous residual is not held alive by the op."""
    keep_outputs, dtype_only = _kept_by_rule(program)
    kept = [t.new_empty(0) if only else t for only, t in zip(dtype_only, operands)]
    return kept, [output[i] for i in keep_outputs], list(keep_outputs)


@functools.lru_cache(maxsize=1024)
def _kept_by_rule(program: str) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(the outputs the program's backward rule reads, per operand whether it reads only
    its dtype), once per program text: every recorded call asks."""
    prog = parse(program)
    keep_outputs, dtype_only = backward.saves(prog)
    return tuple(keep_outputs), tuple(spec.name in dtype_only for spec in prog.operands)


def outputs_for_rule(kept: list, keep_outputs: list[int], n_outputs: int) -> list:
    """The rule's ``outputs`` argument: the kept ones in place, None elsewhere."""
    outputs = [None] * n_outputs
    for i, t in zip(keep_outputs, kept):
        outputs[i] = t
    return outputs


def _setup_context(ctx, inputs, output, weight_input: int = 2):
    """Keep what the backward reads, no more (kept_for_backward). ``weight_input``: where
    b is among the inputs autograd saw (needs_input_grad's index)."""
    program, a, b, operands = inputs
    kept, kept_outputs, ctx.keep_outputs = kept_for_backward(program, operands, output)
    ctx.program, ctx.weight_input = program, weight_input
    ctx.has_a, ctx.has_b = a is not None, b is not None
    ctx.n_operands = len(operands)
    ctx.save_for_backward(*(t for t in (a, b) if t is not None), *kept, *kept_outputs)
    ctx.n_outputs = len(output)
    # an output nothing reads gets None, not a zero tensor of its size (the logits or the
    # gated pre-activation kept for the backward: a memset of tokens x vocab, and a term
    # the rule would add); every rule takes None (kernels/backward/common.Rule)
    ctx.set_materialize_grads(False)


def _backward(ctx, grads, route: "_RecordedRoute | None" = None):
    """The rule's gradients (None, grad_a, grad_b, [per operand]); with ``route``, for a
    node that took the caller's shapes and flattened them inside (KnownEdgeGemm): the
    saved tensors and ``grads`` go to the rule in the op's 2-D form and its gradients
    come back in the caller's shapes."""
    # the rules read saved outputs of a formula-less op and run some (the LM head's
    # softmax gradient, the norm's statistics) in place or as kernels: no graph for a
    # second derivative (seen: 0.68 relative error through RoPE's, silently)
    refuse_second_derivative("the fused GEMM", ctx.program)
    saved = list(ctx.saved_tensors)
    a = saved.pop(0) if ctx.has_a else None
    b = saved.pop(0) if ctx.has_b else None
    operands, kept = saved[:ctx.n_operands], saved[ctx.n_operands:]
    grads = list(grads)
    if route is not None:
        a, operands, kept, grads = route.flat_for_backward(
            a, operands, kept, ctx.keep_outputs, grads, _kept_by_rule(ctx.program)[1])
    outputs = outputs_for_rule(kept, ctx.keep_outputs, ctx.n_outputs)
    with backward.common.weight_grad_wanted(ctx.needs_input_grad[ctx.weight_input]):
        grad_a, grad_b, grad_ops = backward.vjp(parse(ctx.program), a, b, operands, outputs,
                                                grads)
    if route is not None:
        grad_a, grad_ops = route.shaped_like_inputs(grad_a, grad_ops)
    return None, grad_a, grad_b, grad_ops


torch.library.register_autograd("coda::gemm_epilogue", _backward,
                                setup_context=_setup_context)


class FusedGemm(torch.autograd.Function):
    """``coda::gemm_epilogue`` with its backward, for the graphs that record one: an
    autograd.Function over the op without a formula (``gemm_epilogue_nograd``), the
    formula above as its backward.

    Why not the op's own formula: torch.library's autograd kernel is Python that runs on
    every call of the op, also inside a compiled training graph, where AOTAutograd has
    already taken the backward apart (measured on the 2-core CPU: 40 µs of a 55-µs call
    at toy sizes; 200–350 µs per fused call on the H200's host in the 1B step's
    forward, which ran within a few ms of its kernels). AOTAutograd traces a Function
    through: its forward graph calls the formula-less op (no Python at run time beyond
    the op's own), its backward graph the rule's ops."""

    @staticmethod
    def forward(program, a, b, *operands):
        # grad mode is off in here: real tensors need no op boundary (_direct)
        run = _direct_call if _direct(a, b, operands) else gemm_epilogue_nograd
        return tuple(run(program, a, b, list(operands)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        program, a, b, *operands = inputs
        _setup_context(ctx, (program, a, b, operands), list(output))

    @staticmethod
    def backward(ctx, *grads):
        _, grad_a, grad_b, grad_ops = _backward(ctx, grads)
        return (None, grad_a, grad_b, *grad_ops)


class RuleReplayGemm(FusedGemm):
    """FusedGemm's context and backward (the family's rule) over the reference's forward,
    counted nowhere: what a witness's gradient replay differentiates (algebra/witness.py,
    run_program). Autograd through the reference checks that the rewrite's math has
    eager's derivative; through this it checks the rule training runs too, on the match's
    own program (its biases, offsets, maps and targets), in float64."""

    @staticmethod
    def forward(program, a, b, *operands):
        outs = reference.run_program(parse(program), a, b, list(operands))
        return tuple(_fresh(outs, [a, b, *operands]))


# The witness replays each rule twice, under arranged_as(False) as an eager backward runs
# it and under arranged_as(True) as the backward Inductor compiles does
arranged_as = backward.common.arranged_as


class KnownGemm(torch.autograd.Function):
    """FusedGemm for a call in a metadata class whose launch is known (_RecordedRoute):
    the forward is the launch itself (fresh buffers, never an input), the backward
    FusedGemm's. Entered through autograd's C++ apply on real tensors only (_apply_known):
    a traced call never finds a recorded class, since fake and functional tensors fail
    the guard. Written in the old style, forward(ctx, ...), for the reason record()
    gives."""

    @staticmethod
    def forward(ctx, launch, program, a, b, *operands):
        outputs = tuple(launch(a, b, list(operands)))
        _setup_context(ctx, (program, a, b, operands), list(outputs), weight_input=3)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        _, grad_a, grad_b, grad_ops = _backward(ctx, grads)
        return (None, None, grad_a, grad_b, *grad_ops)


class KnownEdgeGemm(torch.autograd.Function):
    """KnownGemm for a call in the model's shapes ([*lead, K] in, [*lead, N] and
    [*lead, 1] out: a chain's edge): the route (_RecordedRoute) flattens x and the
    operands into the op's 2-D form inside the node, launches, and gives the outputs
    back in the model's shapes; the backward reshapes between the two. Outside the node
    each reshape would be an autograd view node of its own."""

    @staticmethod
    def forward(ctx, route, program, x, b, *operands):
        a, flat = route.flatten(x, operands)
        outputs = route.unflatten_fresh(route.launch(a, b, flat))
        ctx.route = route
        _setup_context(ctx, (program, x, b, operands), list(outputs), weight_input=3)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        _, grad_a, grad_b, grad_ops = _backward(ctx, grads, ctx.route)
        return (None, None, grad_a, grad_b, *grad_ops)


# autograd's C++ apply for KnownGemm and KnownEdgeGemm, bound once (record() without its
# checks: the guard that found the class has made them)
_apply_known = super(torch.autograd.Function, KnownGemm).apply
_apply_known_edge = super(torch.autograd.Function, KnownEdgeGemm).apply


def gemm_with_grad(program, a, b, operands) -> tuple[torch.Tensor, ...]:
    """The fused GEMM where autograd records it (FusedGemm)."""
    return record(FusedGemm, program, a, b, *operands)


def record(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, every argument of its forward passed, none defaulted.

    On real tensors with no functorch transform active this applies ``function``'s
    old-style twin (_old_style), the same forward, context and backward. Applying a
    Function that defines setup_context binds its arguments to the forward's signature
    on every call (inspect.signature, for default values: none here): in Function.apply's
    Python layer through torch 2.13, from autograd's C++ apply, which calls back into
    Python for it, since 2.14. Measured on the 2-core CPU, a two-input product: 19 µs a
    call either way, against 6.0 (torch 2.13) and 3.8 (2.14) for the old style: the cost
    of a fused GEMM that autograd records in a graph that runs as Python (optimize()'s
    training forward). A traced call (dynamo, AOTAutograd: fake or functional tensors)
    or one under a transform takes ``function.apply``, which they need (functorch's
    transforms take only Functions that define setup_context)."""
    if torch._C._are_functorch_transforms_active() or \
            not layouts.real([t for t in args if isinstance(t, torch.Tensor)]):
        return function.apply(*args)
    return _old_style(function).apply(*args)


@functools.cache
def _old_style(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """``function`` (a Function with setup_context) as an old-style Function of the same
    name: forward(ctx, *args) runs its forward, then its setup_context on the same
    arguments and outputs (both with grad mode off, as autograd runs the pair), and its
    backward is ``function``'s."""

    def forward(ctx, *args):
        outputs = function.forward(*args)
        function.setup_context(ctx, args, outputs)
        return outputs

    return type(function.__name__, (torch.autograd.Function,), {
        "__module__": function.__module__, "__doc__": _old_style.__doc__,
        "forward": staticmethod(forward), "backward": staticmethod(function.backward)})


# ---- what the rewritten graph calls ---------------------------------------------------

def fused_linear(program: str, x: torch.Tensor, weight: torch.Tensor,
                 *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``program`` over ``x @ weight.T`` (nn.Linear layout), x of any leading shape.
    Tile outputs come back as [*lead, N], per-row outputs as [*lead, 1]; with a 2-D x
    (lead (M,)) they stay in the op's form, [M, N] and [M] (row_chains.py)."""
    if not torch._C._are_functorch_transforms_active():
        # a call in a class this program last launched in (in the op's 2-D form, or in
        # the model's shapes: _EdgeRoute), real tensors (a functorch wrapper or a
        # traced tensor fails the guard's dispatch-key check), and nothing for autograd
        # to record: grad mode off, or a class with no tensor that requires grad (the
        # guard checks requires_grad)
        grad_free = torch.is_grad_enabled()
        if x.dim() == 2:
            outs = _run_known(program, x, weight, operands, grad_free)
            if outs is not None:
                return tuple(outs)
        else:
            outs = _run_known(("edge", program), x, weight, operands, grad_free)
            if outs is not None:
                return outs
        if grad_free:  # grad mode: a class seen recorded records again (_RecordedRoute)
            route = _last_route(("recorded", program), x, weight, operands)
            if route is not None:
                return route(program, x, weight, operands)
    return _linear(gemm_epilogue, program, x, weight, operands)


setattr(fused_linear, FUSED_LINEAR_MARK, True)
setattr(fused_linear, ROW_CALL_MARK, 3)


def _linear(run, program, x, weight, operands):
    prog = parse(program)
    a, ops = layouts.as_rows(x), layouts.flatten_operands(prog, operands)
    if run is gemm_epilogue:
        run = gemm_with_grad if _needs_grad(a, weight, ops) else \
            _direct_call if _real(a, weight, ops) else gemm_epilogue_nograd
    if sharding.is_dtensor(weight):  # tensor parallelism: each rank runs on its shards
        outs = sharding.run_sharded(run, program, prog, a, weight, ops)
    else:
        flat_outs = outs = run(program, a, weight, ops)
        if run is _direct_call and x.dim() != 2:
            outs = layouts.unflatten_outputs(prog, outs, x.shape[:-1])
            _remember_reshaped(_EdgeRoute, "edge", program, x, weight, operands, a,
                               ops, outs, flat_outs)
            return outs
        if run is gemm_with_grad and not torch._C._are_functorch_transforms_active():
            outs = layouts.unflatten_outputs(prog, outs, x.shape[:-1])
            _remember_reshaped(_RecordedRoute, "recorded", program, x, weight,
                               operands, a, ops, outs, flat_outs)
            return outs
    return layouts.unflatten_outputs(prog, outs, x.shape[:-1])


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct(a, b, operands) -> bool:
    """True where the op boundary buys nothing: real tensors (_real) and no gradient to
    record (no functorch transform either). The torch.library dispatch costs tens of µs
    of host time per call, more than the kernel launch itself at decode sizes."""
    return _real(a, b, operands) and not _needs_grad(a, b, operands)


def _real(a, b, operands) -> bool:
    """Plain tensors outside a trace (layouts.real; a missing a or b is not one):
    dynamo, AOTAutograd and Inductor see fake or functional tensors and need the op."""
    return layouts.real((a, b, *operands))


def _needs_grad(a, b, operands) -> bool:
    """Whether autograd could ask this call for a gradient (conservatively yes under a
    functorch transform, grad or vmap, which wraps tensors as plain-typed ones whose
    requires_grad does not tell: the op's autograd must see them)."""
    if torch._C._are_functorch_transforms_active():
        return True
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, *operands))


def _direct_call(program, a, b, operands):
    return execute(program, a, b, operands)



def fused_rowwise(program: str, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A program without a GEMM; its first tile operand gives the leading shape.

    There is no GEMM for an epilogue to ride on, so this is the reference's plain torch
    ops, inlined into the graph rather than hidden in the opaque op: Inductor fuses them
    into one pass (and autograd differentiates them directly)."""
    prog = parse(program)
    tile = next(t for s, t in zip(prog.operands, operands) if s.kind == Kind.TILE)
    lead = tile.shape[:-1]
    outs = reference.run_program(prog, None, None, layouts.flatten_operands(prog, operands))
    return layouts.unflatten_outputs(prog, outs, lead)


setattr(fused_rowwise, ROW_CALL_MARK, 1)
