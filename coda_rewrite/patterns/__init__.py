"""Rewrite families, one module each: find (matches and near misses), describe, decide
(asks algebra/ for legality; a frozen plan or a typed rejection), apply (graph surgery
from the plan), and the family's graph-side runtime helpers. family.py states the
protocol; registry.py lists the families in the order the pipeline runs them."""

from .family import Context, Decided, Family, NoMatch

__all__ = ["Context", "Decided", "Family", "NoMatch"]
