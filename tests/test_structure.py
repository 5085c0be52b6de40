"""The package's structure, as the architecture states it (README, "How it is built"):
no import cycles; algebra/ reads the IR (codegen/) and shared analysis modules, never the
patterns, and the runtime (kernels/) only where the witness differentiates a fused GEMM
with its backward rule; kernels/ never imports patterns/ or algebra/; every
family is in the registry with the protocol's functions."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

import coda_rewrite

ROOT = pathlib.Path(coda_rewrite.__file__).parent


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> nx.DiGraph:
    """module -> package modules it imports at import time (top level; imports inside
    functions run later and cannot form an import cycle)."""
    g = nx.DiGraph()
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    for name, path in modules.items():
        g.add_node(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level \
                    else node.module
                for alias in node.names:  # "from . import x" may name a module
                    full = f"{target}.{alias.name}"
                    g.add_edge(name, full if full in modules else target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    g.add_edge(name, alias.name)
    return g.subgraph(modules)


def test_no_import_cycles():
    g = _imports()
    # leave out the edges between a package and its own submodules (an __init__
    # re-exporting them; a submodule reaching for the package's names)
    h = nx.DiGraph((a, b) for a, b in g.edges
                   if not b.startswith(a + ".") and not a.startswith(b + "."))
    assert h.number_of_edges() > 50  # the graph the check runs on is the package's
    cycles = list(nx.simple_cycles(h))
    assert not cycles, cycles


# The one edge from the legality layer to the runtime: the witness's gradient replay
# differentiates a fused GEMM with the backward training runs (ops.RuleReplayGemm)
ALGEBRA_TO_RUNTIME = {("coda_rewrite.algebra.witness", "coda_rewrite.kernels.ops")}


def test_algebra_reads_the_ir_not_the_runtime_or_the_patterns():
    g = _imports()
    bad = [(a, b) for a, b in g.edges if a.startswith("coda_rewrite.algebra")
           and b.startswith(("coda_rewrite.kernels", "coda_rewrite.patterns"))
           and (a, b) not in ALGEBRA_TO_RUNTIME]
    assert not bad, bad
    assert ALGEBRA_TO_RUNTIME <= set(g.edges)  # named while it exists


def test_the_runtime_does_not_import_the_pass():
    g = _imports()
    bad = [(a, b) for a, b in g.edges if a.startswith("coda_rewrite.kernels")
           and b.startswith(("coda_rewrite.patterns", "coda_rewrite.algebra",
                             "coda_rewrite.pipeline"))]
    assert not bad, bad


def test_every_family_implements_the_protocol():
    from coda_rewrite.patterns.registry import FAMILIES

    names = [f.NAME for f in FAMILIES]
    assert len(set(names)) == len(names)
    for family in FAMILIES:
        for fn in ("find", "describe_match", "decide", "apply"):
            assert callable(getattr(family, fn, None)), (family.__name__, fn)
