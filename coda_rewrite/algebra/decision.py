"""What a legality check returns: a Proof, or a Rejection that names the failed condition.

Both print as readable math and are what explain() shows next to each match.
"""

from __future__ import annotations

import dataclasses
import enum


class RejectionKind(enum.Enum):
    """Why a match was left as is. Two of these are bugs in the pass, never a property
    of the user's model: the test suite fails on them wherever they occur."""
    CONDITION = "a side condition does not hold"
    WITNESS_UNAVAILABLE = "the float64 witness could not run (fail closed)"
    WITNESS_DISAGREES = "the float64 witness disagrees with the replacement (a bug)"
    INTERNAL_ERROR = "the checker raised (a bug)"
    NOT_PLACEABLE = "no place in the graph for the fused call"
    DISABLED = "the pattern is disabled by options.patterns"

    @property
    def is_bug(self) -> bool:
        return self in (RejectionKind.WITNESS_DISAGREES, RejectionKind.INTERNAL_ERROR)


@dataclasses.dataclass(frozen=True)
class Proof:
    statement: str                  # the identity the rewrite relies on
    assumptions: tuple[str, ...]    # side conditions, each checked on the matched graph
    steps: tuple[str, ...]          # how the identity follows
    witness: str = ""               # the numeric check that backs it

    accepted = True

    def render(self, indent: str = "") -> str:
        out = [f"{indent}PROVED  {self.statement}"]
        out += [f"{indent}  given  {a}" for a in self.assumptions]
        out += [f"{indent}  step   {s}" for s in self.steps]
        if self.witness:
            out.append(f"{indent}  witness {self.witness}")
        return "\n".join(out)


class Why(str):
    """A reason as text for the report, with a stable code for programs and tests:
    ``"<family>.<condition>"`` (``"row_scale.feature_index"``, ``"rope.unrotated_read"``,
    ``"mask.window"``), ``"witness.unavailable"`` / ``"witness.disagrees"`` /
    ``"witness.gradients_disagree"``, and the pipeline's own ``"disabled"``,
    ``"internal_error"``, ``"not_placeable"``, ``"graph.eager_raises"``. Code reads the
    code, never the words."""
    code: str

    def __new__(cls, text: str, code: str) -> "Why":
        why = super().__new__(cls, text)
        why.code = code
        return why


def code_of(reason) -> str:
    """The code of a reason (a Why), or "" for plain text."""
    return getattr(reason, "code", "")


@dataclasses.dataclass(frozen=True)
class Rejection:
    condition: str   # the side condition that does not hold (a Why carries its code)
    where: str       # node and model path
    kind: RejectionKind = RejectionKind.CONDITION
    code: str = ""   # the condition's stable code; default: the condition's own

    def __post_init__(self):
        if not self.code:
            object.__setattr__(self, "code", code_of(self.condition))

    accepted = False

    def render(self, indent: str = "") -> str:
        return f"{indent}REJECTED  {self.condition}\n{indent}  at {self.where}"


Decision = Proof | Rejection
