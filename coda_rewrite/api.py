"""The public entry points: optimize() and explain()."""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import types
import warnings
from typing import Any

import torch
import torch.nn as nn

from .backend import CodaBackend, HookGuards
from .options import Options
from .patterns import routed_experts
from .report import Report


_ENTRIES = itertools.count()


def _entry_point() -> types.FunctionType:
    """``entry(model, *args, **kwargs) = model(*args, **kwargs)`` with a code object of its
    own. Dynamo keeps compiled graphs per code object and stops compiling one after a few
    entries (its recompile limit), without an error: Hugging Face wraps every model's
    forward in one shared decorator, so compiling models themselves, after about nine of
    them in a process, returned models that silently ran unrewritten. Starting each
    optimize() at a fresh code object gives every model its own budget, and leaves
    dynamo's settings, which the user's other compiles share, as they are. (The model is
    an argument, not a closure: the graph's parameter names stay ``L['self']...``.)"""
    def entry(self, *args, **kwargs):
        return self(*args, **kwargs)
    code = entry.__code__.replace(co_name=f"coda_optimized_{next(_ENTRIES)}")
    return types.FunctionType(code, entry.__globals__, code.co_name)


class CodaModule(nn.Module):
    """What optimize() returns: the user's module, called through the rewritten graphs.

    The original module is this module's ``module`` child, so parameters, buffers,
    train()/eval() and optimizer updates are shared; every call reads the live
    parameters (they are graph inputs). Attributes it does not have (``config``) are
    looked up on the original; ``generate()`` runs the original's generation loop over
    the rewritten forward.

    A call that ran no rewritten graph at all (dynamo skipped or gave up on the frame)
    warns once and is recorded in the report: an optimized model never runs as eager
    without saying so. Hooks registered on the model's modules after the first call run
    (the graphs guard them: backend.HookGuards).
    """

    def __init__(self, model: nn.Module, compiled, backend: CodaBackend):
        super().__init__()
        self.module = model
        object.__setattr__(self, "_compiled", compiled)  # not a child: no second copy
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "report", backend.report)
        object.__setattr__(self, "_warned", False)
        object.__setattr__(self, "_warned_generate", False)

    def __deepcopy__(self, memo):
        """A copy of the original, optimized anew with the same options (an EMA or a
        frozen reference model is usually made this way). Copying this module's fields
        would leave the copy calling the original's compiled function, whose backend
        counts and reports the copy's graphs as the original's: the copy would warn that
        it ran uncompiled and its report would stay empty. Its graphs compile again on
        its first call."""
        compile_args, options = self._recipe
        return optimize(copy.deepcopy(self._modules["module"], memo), **compile_args,
                        **options)

    def forward(self, *args, **kwargs):
        # two integer reads around the call: the per-call cost of "never silently eager"
        runs, breaks = self._backend.runs, len(self.report.graph_breaks)
        try:
            out = self._compiled(self._modules["module"], *args, **kwargs)
        finally:  # a call that compiled switched dynamo's hook guards on: switch back
            self._backend.hook_guards.restore()
        if self._backend.runs == runs:
            self._ran_uncompiled()
        if len(self.report.graph_breaks) != breaks:  # the backend saw a break compiling
            new = self.report.graph_breaks[breaks:]
            warnings.warn(
                f"coda_rewrite.optimize(): dynamo broke the graph ({len(new)} break(s): "
                f"{new[0]}); the code between graphs runs as eager, unrewritten (the report "
                "lists the reasons)", RuntimeWarning, stacklevel=4)  # the model's caller
        return out

    def _ran_uncompiled(self) -> None:
        self.report.uncaptured_calls += 1
        if not self._warned:
            object.__setattr__(self, "_warned", True)
            warnings.warn(
                "coda_rewrite.optimize(): a call ran without any rewritten graph: dynamo "
                "did not compile it (a recompile limit reached, a skipped frame, "
                "compilation disabled, or an outer torch.compile tracing the optimized "
                "model, which compiles it with its own backend: pass backend=\"coda\" "
                "there instead), so the model ran without the rewrites. The report counts "
                "such calls.", RuntimeWarning, stacklevel=5)  # the model's caller

    def generate(self, *args, **kwargs):
        """The original model's ``generate()``, its every forward through the rewritten
        graphs (prefill and decode steps alike). A generation loop that never calls this
        module's forward (a wrapper's generate() that generates through the module it
        wraps: peft's PeftModel through its base model) ran unrewritten: it warns once and
        is counted and noted in the report, never silent."""
        view, calls = self._generation_view()
        out = view.generate(*args, **kwargs)
        if not calls:
            self._generated_around()
        return out

    def _generated_around(self) -> None:
        self.report.uncaptured_calls += 1
        if self._warned_generate:
            return
        object.__setattr__(self, "_warned_generate", True)
        why = (f"generate() of {type(self._modules['module']).__name__} ran without the "
               "rewritten forward: it generates through the forward of another module (a "
               "wrapper such as peft's PeftModel generates through its base model), so "
               "every step ran as eager. Optimize the module that generates (peft: "
               "model.get_base_model(), whose layers hold the adapters) or merge the "
               "adapters into it first (merge_and_unload())")
        self.report.notes.append(why)
        warnings.warn(f"coda_rewrite.optimize(): {why}", RuntimeWarning, stacklevel=3)

    def _generation_view(self) -> tuple[nn.Module, list]:
        """A shallow copy of the original whose ``forward`` is this module's: generation
        code reads the model's class, config and methods, and calls ``self(...)``. The
        copy shares parameters, buffers and submodules; its own hooks are empty (the
        compiled call runs the original's, once). Made per generate() call, so that it
        sees what the original holds now (a replaced generation_config, say). With it, a
        list that gets an entry per forward it runs."""
        model = self._modules["module"]
        view = copy.copy(model)
        view.__dict__.update(_forward_hooks=collections.OrderedDict(),
                             _forward_pre_hooks=collections.OrderedDict(),
                             _forward_hooks_with_kwargs=collections.OrderedDict(),
                             _forward_pre_hooks_with_kwargs=collections.OrderedDict(),
                             _forward_hooks_always_called=collections.OrderedDict())
        rewritten, calls = self.forward, []

        @functools.wraps(model.forward)  # generation reads the signature's arguments
        def forward(*args, **kwargs):
            calls.append(None)
            return rewritten(*args, **kwargs)
        view.forward = forward
        return view, calls

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _call(module, example_inputs):
    if isinstance(example_inputs, dict):
        return module(**example_inputs)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    return module(*example_inputs)


def optimize(model: nn.Module, example_inputs=None, *, dynamic: bool | None = None,
             fullgraph: bool = False, **options) -> CodaModule:
    """Return ``model`` with every proved rewrite applied to its captured graphs.

    Same call signature and outputs as ``model``. Graphs are captured by dynamo on the
    first call (or now, on ``example_inputs``: a tuple of positional args or a dict of
    keyword args). Options: see ``coda_rewrite.options.Options``; ``inductor`` defaults
    to False here (the rewritten graph runs as is).
    """
    opts = Options.make(options, inductor=options.get("inductor", False))
    backend = CodaBackend(opts)
    backend.hook_guards = HookGuards()  # hooks added after this call run (HookGuards)
    compiled = torch.compile(_entry_point(), backend=backend, dynamic=dynamic,
                             fullgraph=fullgraph)
    backend.report.notes += routed_experts.implementation_notes(model)
    wrapped = CodaModule(model, compiled, backend)
    object.__setattr__(wrapped, "_recipe", (dict(dynamic=dynamic, fullgraph=fullgraph), options))
    if example_inputs is not None:
        _call(wrapped, example_inputs)
    return wrapped


def explain(model: nn.Module, *example_inputs, **kwargs) -> Report:
    """Capture ``model`` on the example inputs and return the report: every candidate
    match, its model path, the decision (proof or rejection) and the rewritten graph.
    Keyword arguments that are Options go to the pass, the rest to the model."""
    names = set(Options.__dataclass_fields__)
    opts = Options.make({k: v for k, v in kwargs.items() if k in names},
                        inductor=kwargs.get("inductor", False))
    model_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    backend = CodaBackend(opts)
    backend.report.notes += routed_experts.implementation_notes(model)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(*example_inputs, **model_kwargs)
    return backend.report
