"""Legality: every rewrite asks here, and the answer (a Proof or a Rejection) is what the
report shows. Symbolic identities are proved with sympy once and cached; side conditions
are checked on the matched graph; a float64 witness replays the matched nodes against the
replacement programs. One module per family (row_scale, gated, rope, cross_entropy, mask),
plus what they share: statements.py, witness.py, decision.py, locality.py."""

from .decision import Decision, Proof, Rejection, RejectionKind

__all__ = ["Decision", "Proof", "Rejection", "RejectionKind"]
