"""Pattern families: each module finds its matches (or near misses, with the reason) and
builds their epilogue programs; legality is the algebra's call, graph changes rewrite.py's."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch.fx as fx

from ..capture import model_path


@dataclasses.dataclass
class NoMatch:
    """A candidate a pattern could not use, and why (for the report). Each pattern
    module subclasses it to set ``pattern``."""
    node: fx.Node
    reason: str
    pattern: ClassVar[str] = ""

    @property
    def path(self) -> str:
        return model_path(self.node)
