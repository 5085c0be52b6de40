"""Which problem sizes get a fused GEMM: a speed decision, not a legality one.

At decode and short-prompt sizes QuACK's fused GEMM on its default config (128 × 192
tiles, cluster 2) leaves most of the H200's 132 SMs idle and loses to cuBLAS plus a fused
elementwise kernel from Inductor; measured on the 4-layer forward from CUDA graphs, all
fused against torch.compile: 0.54x at 128 rows, 0.92x at 1024, 0.98x at 2048, 1.07x at
4096 (BENCHMARKS.md, "small M"). Tile configs by row class (kernels/quack_path.config_for)
moved that to 0.89x at 512 rows and 1.00x at 1024 (BENCHMARKS.md, fourth session).

Each family's fused GEMM stops paying at its own size. Against cuBLAS plus Inductor's
epilogue compiled for that M (benchmarks/small_m.py --static, the 1B and 8B layer shapes,
H200; BENCHMARKS.md, sixth session) the gated pair's GEMM holds from 16 rows, the LM head
(+ loss) from 64, the RoPE GEMM from 1024 and the norm producer (its finaliser is a second
launch) from 4096 at the 1B shape; but in a whole forward (inference.py small_m) the gated
pair fused below 1024 rows made it slower (0.76x torch.compile at 128 rows), and every
family fused runs 1.01x at 1024 rows and 1.07x at 2048 (on the H100 the gated pair
still lost 3-8% of that forward at 1024 rows, so it fuses from 2048; RoPE fused from 128
rows made it 4-8% faster from CUDA graphs at dim 2048, not at 4096, and not without CUDA
graphs in a Hugging Face Llama). So each family says from how many rows it fuses
(``FUSED_FROM_ROWS`` in its pattern module, the larger of the measurements); a match
whose GEMMs all run on fewer static rows is left to cuBLAS with its epilogue as graph
ops, with the reason (code ``shape.small_m``).
The routed experts' grouped GEMMs count routed rows (tokens × top-k): they lose to
torch's grouped_mm at decode and short-prompt sizes and win or run even from 16384
(patterns/routed_experts.py; a training graph's threshold is its own).
``options.min_fused_rows`` overrides every family's threshold (0: always fuse).
"""

from __future__ import annotations

import torch.fx as fx

from . import canonical
from .graph_utils import graph_nodes_of


def fused_from_rows(family, override: int | None, match=None, graphed: bool = False) -> int:
    """The fewest rows a match of ``family`` fuses at: the option where set, else the
    family's measured threshold (0 for a family that fuses no GEMM); a family whose
    matches differ in what the fusion saves says so per match (``fused_from_rows_of``:
    RoPE with a QK-norm in the same GEMM pays from fewer rows than without; so does RoPE
    in a narrow model replayed from CUDA graphs, ``graphed``, where the host time per
    call is not paid)."""
    if not getattr(family, "FUSES_GEMMS", False):
        return 0
    if override is not None:
        return override
    per_match = getattr(family, "fused_from_rows_of", None)
    return per_match(match, graphed) if per_match is not None else family.FUSED_FROM_ROWS


def too_few_rows(family, match, override: int | None, graphed: bool = False) -> str:
    """Why a GEMM-fusing match is left to cuBLAS at this size ("" where it is not): every
    GEMM it would fuse has a static row count below the family's threshold
    (``fused_from_rows``; ``override`` is options.min_fused_rows, ``graphed`` whether
    the graph replays from CUDA graphs: Options.graphed)."""
    min_rows = fused_from_rows(family, override, match, graphed)
    if min_rows <= 0:
        return ""
    counts = [static_rows(n) for n in gemms_of(match)]
    if not counts or any(c is None or c >= min_rows for c in counts):
        return ""
    limit = (f"min_fused_rows = {min_rows}" if override is not None else
             f"the {family.NAME} fusion's measured threshold, {min_rows} rows")
    return (f"the GEMM{'s' if len(counts) > 1 else ''} would run on {max(counts)} rows, fewer "
            f"than {limit}: at this size cuBLAS with the epilogue as graph ops is faster "
            "than the fused GEMM (left unfused)")


def gemms_of(match) -> list[fx.Node]:
    """The GEMM nodes (linear; grouped_mm: routed experts, whose rows are the routed
    ones) a match holds: what a fusing family would replace, and what both speed
    policies (this one, training_policy.py) look at."""
    return [n for n in graph_nodes_of(match) if canonical.canon(n) is not None
            and canonical.canon(n).name in ("linear", "grouped_mm")]


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


def static_width(linear: fx.Node) -> int | None:
    """The static width (K) of a GEMM's input; None where it is symbolic or untraced."""
    x = canonical.meta(canonical.canon(linear).args[0])
    k = x.shape[-1] if x is not None and x.dim() else None
    return k if isinstance(k, int) else None


def threshold_lines(override: int | None = None) -> list[str]:
    """The size policy as the report shows it: from how many rows each family fuses."""
    from .patterns.registry import FAMILIES
    if override is not None:
        return [f"every family fuses from {override} rows (options.min_fused_rows)"]
    return [f"{f.NAME} fuses from {f.FUSED_FROM_ROWS} rows" + "".join(
        f"; {what}: from {rows}" for what, rows in getattr(f, "FUSED_FROM_ROWS_FOR", {}).items())
        for f in FAMILIES if getattr(f, "FUSES_GEMMS", False)] + [
        "(options.min_fused_rows sets one threshold for every family; 0 fuses every size)"]
