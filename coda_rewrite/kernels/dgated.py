"""``coda::dgated``: the gated MLP's backward epilogue on the down projection's dgrad GEMM.

    dgated(op, dout [M, H], w_down [H, I], p [M, 2I]) -> (dp [M, 2I], h [M, I])

dh = dout·w_down is the GEMM (w_down in nn.Linear's [out, in] layout is already the
(k, n) operand QuACK takes, n-contiguous: no transpose, no copy); its epilogue turns dh
and the stored interleaved pre-activation p into dp and the recomputed h
(codegen/dgated_source.py says how, codegen/reference.dgated is the same math in torch).
On Hopper, with tensors that meet the contract below, the generated QuACK kernel runs;
everywhere else the reference, and ``ops.RUNTIME`` counts which ran and why, as it does
for every fused program.

The op has no autograd formula: it is the backward (kernels/gated_down.py); a second
derivative through it is refused by autograd's fallback.
"""

from __future__ import annotations

import functools

import torch

from ..codegen import dgated_source, reference
from . import ops, quack_path

_GEMM_DTYPES = quack_path._GEMM_DTYPES
# Past the row classes (quack_path.ROW_CLASSES) QuACK's default, 128 x 192 tiles, leaves
# this epilogue exposed (its D is twice the GEMM's N wide: packed pairs); 128 x 128
# (pingpong, cluster 2) ran 0.492 ms against 0.577 at the 1B MLP (8192 x 2048 x 8192)
# and 1.622 against 1.655 at the 8B one (8192 x 4096 x 14336); cooperative 256 x 128,
# 128 x 256 and 256 x 192 ran 1.3-1.7x slower (H200, benchmarks/gated_backward.py)
LARGE_M_TILES = (128, 128, 2)


def contract_violation(dout, w, p) -> str | None:
    """Why these tensors break the kernel's contract (None: they meet it)."""
    if dout.dim() != 2 or w.dim() != 2 or p.dim() != 2:
        return "dout, w_down and p must be 2-D"
    m, hidden = dout.shape
    inter = w.shape[1]
    if tuple(w.shape) != (hidden, inter) or tuple(p.shape) != (m, 2 * inter):
        return (f"shapes dout {tuple(dout.shape)}, w_down {tuple(w.shape)}, p "
                f"{tuple(p.shape)}: expected [M, H], [H, I], [M, 2I]")
    if dout.dtype not in _GEMM_DTYPES or w.dtype != dout.dtype or p.dtype != dout.dtype:
        return (f"dtypes {dout.dtype}/{w.dtype}/{p.dtype} (one 16-bit dtype: QuACK's GEMM "
                "and its packed 16-bit C/D)")
    if m == 0 or hidden == 0 or inter == 0:
        return "empty problem"
    if hidden % 8 or inter % 8:
        return f"H={hidden} or I={inter} not a multiple of 8 (16-byte TMA rows)"
    if not all(quack_path._aligned(t) for t in (dout, w, p)):
        return "dout, w_down or p not unit-stride along the last dim and 16-byte aligned"
    return None


@functools.lru_cache(maxsize=None)
def load(op: str):
    """The imported generated module of ``op``'s backward epilogue."""
    return quack_path.import_generated(dgated_source.generate(op))


def select(op: str, dout, w, p):
    """(module, None) to launch, or (None, why not)."""
    if not dgated_source.supported(op):
        return None, f"no backward epilogue for {op}"
    why = contract_violation(dout, w, p) or quack_path.device_violation(dout) or \
        quack_path.quack_available()
    if why is not None:
        return None, why
    return load(op), None


class Launch:
    """The dgrad GEMM + epilogue on one tensor-metadata class, planned once (QuACK's
    ``EpiMod.plan``; the tile config by row class, as the forward's: quack_path); a call
    allocates dp and h and launches."""

    __slots__ = ("planned", "m", "n", "inter", "device", "dtype", "config", "key")

    def __init__(self, module, dout, w, p, config=None, op: str = ""):
        """``config`` overrides the row class's (benchmarks); ``op`` names it in the
        report's launch configs."""
        self.key = f"dgated_{op}"
        self.m, self.inter = dout.shape[0], w.shape[1]
        self.n = self.inter
        self.device, self.dtype = dout.device, dout.dtype
        self.config = config or quack_path.config_for_size(self.m, self.inter) or \
            quack_path.tile_config(*LARGE_M_TILES)
        self.planned = quack_path.Planned(module.epilogue, dout, w, p, self._alloc(), {},
                                          self.config)

    def _alloc(self) -> dict:
        return {"D": torch.empty(self.m, 2 * self.inter, device=self.device, dtype=self.dtype),
                "postact": torch.empty(self.m, self.inter, device=self.device,
                                       dtype=self.dtype)}

    def __call__(self, dout, w, p):
        out = self._alloc()
        if self.planned.gemm is not None:
            self.planned.launch(dout, w, out["D"], p, {"postact": out["postact"]})
        else:
            self.planned.epi_plan.run(dout, w, p, out=out)
        return out["D"], out["postact"]


def run_reference(op: str, dout, w, p):
    """dh = dout·w_down accumulated as the kernel does (float32 from 16-bit operands,
    float64 otherwise), then codegen/reference.dgated."""
    cd = reference.accumulate_dtype(p.dtype)
    with torch.autocast(device_type=dout.device.type, enabled=False):
        return reference.dgated(op, dout.to(cd) @ w.to(cd), p)


def execute(op: str, dout, w, p) -> list[torch.Tensor]:
    """The kernel where the contract holds, else the reference: decided once per op and
    tensor-metadata class, in the fused ops' route table (ops.route_of)."""
    def decide():
        module, why = select(op, dout, w, p)
        return Launch(module, dout, w, p, op=op) if module is not None else why
    route = ops.route_of((f"dgated:{op}", quack_path.metadata_key(dout, w, p)), decide)
    name = f"dgated_{op}"
    if isinstance(route, str):
        ops.count_reference(name, route, dout.device)
        return list(run_reference(op, dout, w, p))
    ops.count(name, "kernel", "generated QuACK epilogue (packed C/D)")
    return list(route(dout, w, p))


def _fake(op, dout, w, p):
    m, inter = dout.shape[0], w.shape[1]
    return [p.new_empty(m, 2 * inter), p.new_empty(m, inter)]


ops._lib.define("dgated(str op, Tensor dout, Tensor w, Tensor p) -> Tensor[]")
ops._lib.impl("dgated", execute, "CompositeExplicitAutograd")
torch.library.register_fake("coda::dgated", _fake)
