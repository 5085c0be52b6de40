"""QuACK epilogue ops this project adds (imported by generated kernel modules).

round_bfloat16, round_float16: a float32 epilogue value rounded to the 16-bit dtype and
back (round to nearest even, as the tile store rounds), for a reduction that must see the
values as stored (the cross-entropy's log-sum-exp of the logits eager's loss reads).

RstdOfPartials: a norm's row scale read by the GEMM that applies it, from the producer's
raw per-tile partials, so the norm needs no kernel of its own between the two GEMMs.

The norm producer (patterns/residual_rmsnorm.py) writes z, h2 = z ⊙ γ and, per row and
N-tile t of its GEMM, the partial sum of squares P[i, t] = Σ_{j in t} z[i, j]²
(QuACK's ColVecReduce sink, [M, T] float32, the row's tiles contiguous). The row scale
r[i] = rsqrt(Σ_t P[i, t] / d + eps) was one more kernel (QuACK's rms_final_reduce) and
one more buffer per producer call: on the H200 ~5 µs of host time to launch and, at a
few hundred rows, a few µs of GPU time between two GEMMs (BENCHMARKS.md, sixth and
sixteenth sessions). Here each consumer CTA folds the partials of its own tile_m rows
once, before its epilogue, into the shared-memory row vector a ColVecLoad would have
filled; everything after that is ColVecLoad's (the broadcast over N, the per-subtile
register copy).

Cost: T = ceil(N_producer / tile_n) float32 loads per row and CTA, from L2, at the start
of each tile's epilogue. Measured on the H200 (BENCHMARKS.md, twenty-sixth session; one
consumer GEMM replayed from a CUDA graph, 256 rows): within 0.7 µs of a ColVecLoad of r
up to T = 16, +2.4–4.2 µs at T = 32, +4.5–8.6 at T = 64 (1B and 8B widths); four or
eight running sums instead of one changed nothing measurable, so the loop is the plain
one. Past
quack_path.READER_FOLDS_PARTIALS the producer sums its partials to one column first.
Numerics: the partials are added in tile order in float32, then
r = rsqrt(s · (1/d) + eps) with the fast-math rsqrt (about 1 ulp of float32), as
rms_final_reduce does; the float64 reference sums the same partials.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from quack.compile_utils import make_fake_tensor
from quack.epilogue.math import F2
from quack.epilogue.ops import ColVecLoad

# bumped whenever begin() changes: QuACK's persistent kernel cache keys an op by its
# type, name and config_key, not by its code
_CODE_VERSION = 4


def _rounded(v, dtype):
    if isinstance(v, tuple):  # packed f32x2 lanes (quack.epilogue.math.F2): lane-wise
        return F2(*(_rounded(x, dtype) for x in v))
    return v.to(dtype).to(Float32)


def round_bfloat16(v):
    return _rounded(v, cutlass.BFloat16)


def round_float16(v):
    return _rounded(v, cutlass.Float16)


class RstdOfPartials(ColVecLoad):
    """r[i] = rsqrt(Σ_t P[i, t] · inv_d + eps) for the CTA's rows, P the [M, T] float32
    partials of a norm producer's sum of squares; the fn reads r per element like a
    ColVecLoad operand. No swapped form (QuACK refuses a swap_ab plan with it)."""

    def __init__(self, name: str, inv_d: float, eps: float):
        super().__init__(name)
        self.inv_d = float(inv_d)
        self.eps = float(eps)

    def config_key(self):
        return (_CODE_VERSION, self.inv_d, self.eps)

    def host_fake_arg(self, key, fctx):
        dtype, ndim = key
        if ndim != 2 or fctx.swapped or fctx.batched or fctx.varlen_m:
            raise ValueError(f"{self.name}: RstdOfPartials takes 2-D [M, tiles] partials of "
                             "a dense, unswapped, unbatched GEMM")
        return make_fake_tensor(dtype, (fctx.m, cute.sym_int()), leading_dim=1,
                                divisibility=1)

    @cute.jit
    def begin(self, gemm, param, smem_tensor, ctx):
        tile_m = ctx.tile_M
        row0 = ctx.tile_coord_mnkl[0] * tile_m
        rows = cute.size(param, mode=[0])
        tiles = cute.size(param, mode=[1])
        for i in cutlass.range(ctx.tidx, tile_m, ctx.num_epi_threads):
            total = Float32(0.0)
            if row0 + i < rows:
                for t in cutlass.range(tiles):
                    total += param[row0 + i, t]
            smem_tensor[i] = cute.math.rsqrt(total * Float32(self.inv_d) + Float32(self.eps),
                                             fastmath=True)
        # ColVecLoad's broadcast of the row vector over the tile's columns
        tDsV = ctx.partition_for_epilogue_fn(
            cute.make_tensor(
                smem_tensor.iterator,
                cute.make_layout((ctx.tile_M, ctx.tile_N), stride=self._broadcast_stride()),
            )
        )
        if const_expr(ctx.tiled_copy_t2r is not None):
            tDsV = ctx.tiled_copy_r2s.retile(tDsV)
        tDsV_sub = cute.group_modes(tDsV, 3, cute.rank(tDsV))[None, None, None, 0]
        tDrV_cvt = cute.make_rmem_tensor(tDsV_sub.layout, gemm.acc_dtype)
        return [tDsV, tDrV_cvt]
