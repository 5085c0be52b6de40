"""The public entry points: optimize() and explain()."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .backend import CodaBackend
from .options import Options
from .report import Report


class CodaModule(nn.Module):
    """What optimize() returns: the user's module, called through the rewritten graphs.

    The original module is this module's ``module`` child, so parameters, buffers,
    train()/eval() and optimizer updates are shared; every call reads the live
    parameters (they are graph inputs). Attributes it does not have (``config``,
    ``generate``) are looked up on the original.
    """

    def __init__(self, model: nn.Module, compiled, report: Report):
        super().__init__()
        self.module = model
        object.__setattr__(self, "_compiled", compiled)  # not a child: no second copy
        object.__setattr__(self, "report", report)

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

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
    compiled = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
    wrapped = CodaModule(model, compiled, backend.report)
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
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(*example_inputs, **model_kwargs)
    return backend.report
