"""coda_rewrite: move the memory-bound work between a Transformer's GEMMs into GEMM
epilogues, after proving each rewrite legal.

    model = coda_rewrite.optimize(model)                 # rewritten graphs, run as is
    model = torch.compile(model, backend="coda")         # rewritten graphs, then Inductor
    print(coda_rewrite.explain(model, input_ids))        # what was rewritten, and why

The pipeline: capture.py → canonical.py → for each family of patterns/registry.py, its
patterns/ module (find, apply) asking its algebra/ module (legality) → codegen/ (programs,
the op table, kernel sources) → kernels/ (the coda:: ops, the runtime); pipeline.py
drives it and report.py records it.
"""

from .api import CodaModule, explain, optimize
from .backend import SESSION_REPORT, CodaBackend, coda_backend
from .options import Options
from .report import Report

__all__ = ["optimize", "explain", "CodaModule", "CodaBackend", "coda_backend", "Options",
           "Report", "last_report"]
__version__ = "0.1.0"


def last_report() -> Report:
    """Reports of every compile through ``backend="coda"`` (the string) in this process."""
    return SESSION_REPORT


def _register_backend_name() -> None:
    # Dynamo loads entry-point backends itself and refuses a name registered twice, so
    # register "coda" here only when no installed distribution declares it.
    from importlib.metadata import entry_points

    if "coda" in entry_points(group="torch_dynamo_backends").names:
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "coda" not in _COMPILER_FNS:
        register_backend(compiler_fn=coda_backend, name="coda")


_register_backend_name()
