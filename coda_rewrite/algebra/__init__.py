"""Legality: every rewrite asks here, and the answer (a Proof or a Rejection) is what the
report shows. Symbolic identities are proved with sympy once and cached; side conditions
are checked on the matched graph; a float64 witness replays the matched nodes against the
replacement programs."""

from .decision import Decision, Proof, Rejection
from . import row_scale, witness

__all__ = ["Decision", "Proof", "Rejection", "decide_row_scale"]


def decide_row_scale(match, graph):
    """Decision for a residual→RMSNorm→GEMM match, and the consumers it accepts."""
    decision, per_consumer = row_scale.check(match, graph)
    if not decision.accepted:
        return decision, per_consumer, []
    accepted = [c for c in match.consumers if per_consumer[c.linear].accepted]
    seen = witness.witness(match, accepted)
    if isinstance(seen, Rejection):
        return seen, per_consumer, []
    decision = Proof(decision.statement, decision.assumptions, decision.steps, seen)
    return decision, per_consumer, accepted
