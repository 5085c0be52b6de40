"""What a legality check returns: a Proof, or a Rejection that names the failed condition.

Both print as readable math and are what explain() shows next to each match.
"""

from __future__ import annotations

import dataclasses


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


@dataclasses.dataclass(frozen=True)
class Rejection:
    condition: str   # the side condition that does not hold
    where: str       # node and model path

    accepted = False

    def render(self, indent: str = "") -> str:
        return f"{indent}REJECTED  {self.condition}\n{indent}  at {self.where}"


Decision = Proof | Rejection
