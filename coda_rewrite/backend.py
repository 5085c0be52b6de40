"""The ``"coda"`` torch.compile backend.

Each dynamo graph (one per graph break, one per compiled block in TorchTitan-style
per-block compiles) is rewritten on its own, then handed to Inductor, which traces the
``coda::`` ops as custom ops (fake implementations, no graph breaks), or returned as is
with ``options={"inductor": False}``.

``torch.compile(m, backend="coda")`` works after ``import coda_rewrite`` and also without
it: the package declares a ``torch_dynamo_backends`` entry point, and dynamo registers
entry-point backends itself when the name is first looked up (which is why
``coda_rewrite/__init__.py`` registers the name only when no entry point declares it).
"""

from __future__ import annotations

import collections
import dataclasses

import torch.fx as fx

from . import cuda_graphs
from .kernels import inductor_calls
from .options import Options
from .pipeline import rewrite_graph
from .report import Report

# Reports of compiles that went through the string name, where the caller holds no
# backend object to ask (see coda_rewrite.last_report()).
SESSION_REPORT = Report()


class CodaBackend:
    """A dynamo backend object with its own options and report."""

    def __init__(self, options: Options | None = None, report: Report | None = None):
        self.options = options or Options()
        self.report = report if report is not None else Report()
        self.runs = 0  # executions of this backend's graphs: optimize() checks a call ran one
        self._breaks_seen = _graph_breaks()
        # optimize()'s: guard every module's hooks in the graphs this backend compiles
        # (HookGuards says why); torch.compile(backend="coda") keeps dynamo's setting
        self.hook_guards: HookGuards | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs, mode: str | None = None,
                 options: dict | None = None):
        opts = self.options
        if mode is not None or options:  # torch.compile(m, backend=this, mode=/options=)
            opts = Options.make({**dataclasses.asdict(opts), **(options or {})},
                                **({"mode": mode} if mode else {}))
        return self._compile(gm, example_inputs, opts)

    def _compile(self, gm: fx.GraphModule, example_inputs, opts: Options):
        if self.hook_guards is not None:
            self.hook_guards.on_compile()
        g = rewrite_graph(gm, opts, index=len(self.report.graphs))
        self.report.add(g, opts.dump_dir)
        # dynamo counts a graph break before it compiles the graph in front of it: the
        # reasons new since this backend last compiled go to the report (compile time,
        # not per call)
        now = _graph_breaks()
        self.report.graph_breaks += [reason.splitlines()[0] for reason, n in now.items()
                                     if n > self._breaks_seen.get(reason, 0)]
        self._breaks_seen = now
        if opts.inductor:
            from torch._inductor.compile_fx import compile_fx
            inductor_calls.install()  # its wrapper calls our ops' kernels directly
            # as torch.compile's own Inductor wrapper passes a mode's settings
            return self._counted(compile_fx(gm, example_inputs,
                                            config_patches=opts.inductor_config()))
        if opts.cudagraphs:  # AOTAutograd, no Inductor, then cudagraph trees
            return self._counted(cuda_graphs.cudagraphs(gm, example_inputs))
        return self._counted(gm.forward)

    def _counted(self, fn):
        def run(*args):
            self.runs += 1
            return fn(*args)
        # Inductor's compiled callables carry attributes dynamo reads (boxed calling)
        run.__dict__.update(getattr(fn, "__dict__", {}))
        return run


class HookGuards:
    """Makes the guards of the graphs being compiled check every module's hooks.

    Dynamo by default (``skip_nnmodule_hook_guards``) does not guard a module's empty
    hook dictionaries: a forward hook registered after the first call, on a module that
    had none (activation steering, a probe that records outputs), is never run, and
    the compiled model answers as if it were not there. torch.compile users accept
    dynamo's semantics; optimize() promises the model's own, so its graphs guard the
    hooks too, and a hook added later recompiles the graph that runs it (or, past
    dynamo's recompile limit, runs as eager with optimize()'s warning). Cost: one length
    check per hook dictionary per call: about 17 µs a Llama decoder layer of host time on
    a 2-core CPU (BENCHMARKS.md), a few percent of an optimize()d forward's host time
    (backend="coda" is the spelling for the least host time).

    Dynamo reads the setting when it builds a graph's guards, after the backend
    compiled the graph, and reads it from its global config: it is switched on while
    a call compiles (on_compile, from the backend) and put back as the call ends
    (restore, from optimize()'s module), so the user's other compiles keep theirs."""

    def __init__(self):
        self._saved: bool | None = None

    def on_compile(self) -> None:
        import torch._dynamo.config as dynamo_config
        if self._saved is None:
            self._saved = dynamo_config.skip_nnmodule_hook_guards
        dynamo_config.skip_nnmodule_hook_guards = False

    def restore(self) -> None:
        if self._saved is not None:
            import torch._dynamo.config as dynamo_config
            dynamo_config.skip_nnmodule_hook_guards, self._saved = self._saved, None


def _graph_breaks() -> collections.Counter:
    """Dynamo's graph-break reasons so far in this process (a copy)."""
    from torch._dynamo.utils import counters
    return collections.Counter(counters["graph_break"])


def coda_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None,
                 mode: str | None = None):
    """``torch.compile(model, backend="coda", options={...}, mode=...)``; options as in
    Options (an unknown one raises); ``mode`` as torch.compile's, applied to Inductor."""
    return CodaBackend(Options.make(options, **({"mode": mode} if mode else {})),
                       SESSION_REPORT)(gm, example_inputs)
