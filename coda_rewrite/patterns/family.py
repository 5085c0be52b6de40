"""The protocol every rewrite family implements, and what it hands the pipeline.

A family is one module of patterns/ (attention, residual_rmsnorm, gated_mlp, rope,
cross_entropy), listed in patterns/registry.py in the order the pipeline runs them. Per
captured graph the pipeline calls, for each family:

    find(graph)             → candidate matches, and near misses (NoMatch) with the reason
    describe_match(match)   → what the report says of the candidate before any decision
    decide(match, context)  → Decided: a frozen plan and the proof, or a typed rejection.
                              Legality is the algebra's (algebra/<family>.py): pure, it
                              reads the match and changes nothing
    apply(graph, plan, context) → graph surgery from the plan alone; returns what the
                              report says of the rewrite. Raises NotPlaceable, before the
                              graph changes, where the fused call has no place

The pipeline owns the rest: the match records, options.patterns, a checker that raises
(INTERNAL_ERROR, never a failed compile), and matches that an earlier rewrite of the
same family made stale (a node they name erased): the pipeline finds them again in the
graph as it is now, or refuses them ("stale"). A family that follows the nodes earlier
rewrites replaced itself (Context.current; the norm families, which report what the
replacement leaves them) says so with ``FOLLOWS_REPLACED = True``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Protocol

import torch.fx as fx

from ..algebra import sharding
from ..algebra.decision import Decision, Rejection, Why, code_of
from ..canonical import meta
from ..capture import describe, model_path
from ..kernels.quack_path import gemm_violation, program_violation

if TYPE_CHECKING:
    from ..options import Options


@dataclasses.dataclass
class NoMatch:
    """A candidate a pattern could not use, and why (for the report). Each pattern
    module subclasses it to set ``pattern``."""
    node: fx.Node
    reason: str                    # a Why carries its code
    pattern: ClassVar[str] = ""

    @property
    def path(self) -> str:
        return model_path(self.node)

    @property
    def code(self) -> str:
        return code_of(self.reason)


@dataclasses.dataclass(frozen=True)
class DeferredNorm:
    """A normalised value h = h2 ⊙ r (per row) left materialised for its other readers:
    the values a reader may take instead, and the norm's nodes (dead once none reads
    them)."""
    h2: fx.Node
    r: fx.Node
    dim: int
    nodes: tuple[fx.Node, ...]


@dataclasses.dataclass
class Context:
    """What decide and apply may read besides the match: the options, and the nodes the
    rewrites so far in this graph replaced (a value a match names may have moved)."""
    options: "Options"
    replaced: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    # normalised values whose row scale a rewrite deferred, by the norm's output node:
    # what a later family may read instead (the routed experts' gather of the tokens)
    deferred: dict[fx.Node, "DeferredNorm"] = dataclasses.field(default_factory=dict)

    def current(self, node):
        """``node``, or what replaced it (followed to the end)."""
        while node in self.replaced:
            node = self.replaced[node]
        return node


@dataclasses.dataclass(frozen=True)
class Decided:
    """A family's decision on one match. ``plan`` is None when the match is left as is;
    ``rejection`` then says why, as a type and a line. ``report`` holds the MatchRecord
    fields the report shows either way (per-consumer decisions, notes)."""
    decision: Decision | None
    plan: Any = None
    rejection: Rejection | None = None
    report: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def refuse(cls, rejection: Rejection, **report) -> "Decided":
        return cls(rejection, None, rejection, report)

    @classmethod
    def by(cls, decision: Decision, plan) -> "Decided":
        """``plan`` where the algebra accepted the match, its rejection otherwise."""
        return cls(decision, plan) if decision.accepted else cls.refuse(decision)


def on_gpu(t) -> bool:
    """Whether a traced value lives where the generated kernels run (a function of its
    own: the CPU tests stand a GPU graph in with it)."""
    return t.device.type == "cuda"


def no_kernel(out: fx.Node, code: str, weights, n: int | None = None,
              program=None) -> Why | None:
    """Why a fused GEMM making ``out`` could run no generated kernel on the GPU its graph
    runs on, as the graph's static widths and dtype tell: fused, every call would take
    the reference path, slower than the graph it replaced. Its B stacks the rows of
    ``weights`` (nn.Linear's [N, K]: one, or gate and up, or q, k and v), or ``n`` of
    them where a match reads some columns of a packed projection; ``program`` is its
    epilogue (kernels/quack_path: gemm_violation, N not a multiple of 8 as a router over
    60 experts, a float32 GEMM; program_violation, a gated pair's half width, a QK-norm's
    heads). None on the CPU (the reference path anyway), where a width is symbolic or a
    weight sharded (decided per call), and where a kernel can take it. The families call
    it from decide(): the norm's consumers, the LM head + loss, the gated MLP, RoPE."""
    o, ws = meta(out), [meta(w) for w in weights]
    if o is None or not on_gpu(o) or any(w is None or w.dim() != 2 for w in ws) or \
            any(sharding.is_dtensor(w) for w in weights) or \
            not all(isinstance(d, int) for w in ws for d in w.shape):
        return None
    k = ws[0].shape[1]
    n = sum(w.shape[0] for w in ws) if n is None else n
    why = gemm_violation(o.dtype, o.dtype, k, n) or \
        (None if program is None else program_violation(program, n))
    if why is None:
        return None
    return Why(f"{describe(out)}: {why}: no generated kernel takes this GEMM, so the fused "
               "one would run its reference on the GPU; left to cuBLAS", code)


class Family(Protocol):
    """A patterns/ module (modules satisfy it: each defines these names)."""
    NAME: str

    def find(self, graph: fx.Graph) -> Iterable[Any]: ...

    def describe_match(self, match) -> dict: ...

    def decide(self, match, context: Context) -> Decided: ...

    def apply(self, graph: fx.Graph, plan, context: Context) -> dict: ...
