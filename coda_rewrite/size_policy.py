"""Which problem sizes get a fused GEMM: a speed decision, not a legality one.

At decode and short-prompt sizes QuACK's fused GEMM on its default config (128 × 192
tiles, cluster 2) leaves most of the H200's 132 SMs idle and loses to cuBLAS plus a fused
elementwise kernel from Inductor; measured on the 4-layer forward from CUDA graphs, all
fused against torch.compile: 0.54x at 128 rows, 0.92x at 1024, 0.98x at 2048, 1.07x at
4096 (BENCHMARKS.md, "small M"). Tile configs by row class (kernels/quack_path.config_for)
moved that to 0.89x at 512 rows and 1.00x at 1024 (BENCHMARKS.md, fourth session): even,
not a gain, below 4096. So a match whose GEMMs all run on fewer static rows than
``options.min_fused_rows`` is left to them, with the reason (code ``shape.small_m``).
"""

from __future__ import annotations

import torch.fx as fx

from . import canonical
from .graph_utils import graph_nodes_of


def too_few_rows(family, match, min_rows: int) -> str:
    """Why a GEMM-fusing match is left to cuBLAS at this size ("" where it is not): every
    GEMM it would fuse has a static row count below ``min_rows``."""
    if not getattr(family, "FUSES_GEMMS", False) or min_rows <= 0:
        return ""
    counts = [static_rows(n) for n in graph_nodes_of(match)
              if canonical.canon(n) is not None and canonical.canon(n).name == "linear"]
    if not counts or any(c is None or c >= min_rows for c in counts):
        return ""
    return (f"the GEMM{'s' if len(counts) > 1 else ''} would run on {max(counts)} rows, fewer "
            f"than min_fused_rows = {min_rows}: at this size cuBLAS with the epilogue as "
            "graph ops is faster than the fused GEMM (left unfused)")


def static_rows(linear: fx.Node) -> int | None:
    """The static row count (tokens) of a CUDA GEMM's input; None where it is symbolic
    or the GEMM is not on a GPU."""
    x = canonical.meta(canonical.canon(linear).args[0])
    if x is None or x.device.type != "cuda":
        return None
    rows = 1
    for s in x.shape[:-1]:
        if not isinstance(s, int):
            return None
        rows *= s
    return rows
