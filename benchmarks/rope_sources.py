"""Where should a RoPE epilogue get cos/sin from? QuACK offers both sources:

  table    a (tokens, head_dim) interleaved cos/sin table, staged by TMA
           (rope_table_epi) or loaded per tile into registers (rope_table_ldg_epi);
           the table wraps every head_dim columns, so it rotates every column and
           q and k share one GEMM while v needs its own
  posfreq  cos/sin computed in the epilogue from a per-row position and a per-column
           inverse frequency (rope_posfreq_epi); zero-frequency columns are an exact
           identity, so q, k and v share one GEMM

This times each against the bare cuBLAS GEMMs of the same projections, torch.compile of
the unfused projections + Hugging Face's rotate_half RoPE, and eager, at Llama-3-8B and
Llama-3.2-1B shapes (8192 tokens), and checks every variant against float64 first.

    source .gpu/setup.sh && python benchmarks/rope_sources.py
"""

from __future__ import annotations

import math

import torch

from common import bench, env_line

bf = torch.bfloat16
M, SEQ = 8192, 2048
SHAPES = {  # name: hidden, q heads, kv heads, head_dim
    "8B": (4096, 32, 8, 128),
    "1B": (2048, 32, 8, 64),
}


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_qkv_rope(x, wq, wk, wv, cos, sin, hq, hkv, d):
    """Hugging Face's projections + apply_rotary_pos_emb (cos/sin [B, S, d])."""
    b = x.shape[0] // SEQ
    q = (x @ wq.t()).view(b, SEQ, hq, d).transpose(1, 2)
    k = (x @ wk.t()).view(b, SEQ, hkv, d).transpose(1, 2)
    v = (x @ wv.t()).view(b, SEQ, hkv, d).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v


def half_to_interleaved(w, heads, d):
    """Per head, output feature i -> 2i and i + d/2 -> 2i + 1."""
    return w.view(heads, 2, d // 2, -1).transpose(1, 2).reshape(heads * d, -1)


def interleaved_to_half(y, heads, d):
    return y.view(*y.shape[:-1], heads, d // 2, 2).transpose(-1, -2).reshape(y.shape)


def err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def main():
    from quack.epilogue.rotary import (make_interleaved_inv_freq, rope_posfreq_epi,
                                       rope_table_epi, rope_table_ldg_epi)
    from quack.gemm_config import GemmConfig
    PP128 = GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=2, cluster_n=1,
                       is_dynamic_persistent=False)
    WIDE = GemmConfig(tile_m=128, tile_n=256, pingpong=False, cluster_m=2, cluster_n=1,
                      is_dynamic_persistent=False)
    print(env_line(), flush=True)
    rows = []
    for shape, (hidden, hq, hkv, d) in SHAPES.items():
        torch.manual_seed(0)
        nq, nk = hq * d, hkv * d
        x = torch.randn(M, hidden, device="cuda", dtype=bf)
        wq, wk, wv = (torch.randn(n, hidden, device="cuda", dtype=bf) / math.sqrt(hidden)
                      for n in (nq, nk, nk))
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        pos = torch.arange(SEQ, device="cuda").float().repeat(M // SEQ)        # [M]
        ang = pos[:, None] * inv_freq[None, :]                                # [M, d/2] fp32
        cos = torch.cat((ang, ang), -1).cos().view(M // SEQ, SEQ, d)
        sin = torch.cat((ang, ang), -1).sin().view(M // SEQ, SEQ, d)
        table_ = torch.stack((ang.cos(), ang.sin()), -1).reshape(M, d).contiguous()

        # fused weights: q and k per-head interleaved (pairs adjacent), v as is
        wqk = torch.cat((half_to_interleaved(wq, hq, d), half_to_interleaved(wk, hkv, d)))
        wqkv = torch.cat((wqk, wv))
        freq = make_interleaved_inv_freq(inv_freq.double(), nq + nk, nk).cuda()
        zero_bias = torch.zeros(1, nq + nk, device="cuda")  # dense calls take (l, n) vectors

        # float64 reference (HF math on float64 copies)
        with torch.no_grad():
            rq, rk, rv = hf_qkv_rope(x.double(), wq.double(), wk.double(), wv.double(),
                                     cos.double(), sin.double(), hq, hkv, d)
            ref = torch.cat([t.transpose(1, 2).reshape(M, -1) for t in (rq, rk, rv)], -1)

        def table(epi, cfg):
            def fn():
                qk = epi(x, wqk.t(), cs=table_, bias=zero_bias, tuned=False, config=cfg)["D"]
                return qk, x @ wv.t()
            return fn

        def posfreq(cfg=None):
            def fn():
                y = rope_posfreq_epi(x, wqkv.t(), pos=pos[None], freq=freq[None].float(),
                                     tuned=False, config=cfg)["D"]
                return y[:, :nq + nk], y[:, nq + nk:]
            return fn

        def unpermute(qk, v):
            return torch.cat((interleaved_to_half(qk[:, :nq], hq, d),
                              interleaved_to_half(qk[:, nq:], hkv, d), v), -1)

        compiled = torch.compile(hf_qkv_rope)
        variants = {
            "bare cuBLAS q,k,v (3 GEMMs)": lambda: (x @ wq.t(), x @ wk.t(), x @ wv.t()),
            "bare cuBLAS qkv (1 GEMM)": lambda: x @ wqkv.t(),
            # the table wraps per head: tile_N must divide or be a multiple of head_dim,
            # which QuACK's default (tile_n 192) is not for head_dim 128
            "table TMA 128x128 pp (qk + v GEMM)": table(rope_table_epi, PP128),
            "table TMA 128x256 (qk + v GEMM)": table(rope_table_epi, WIDE),
            "table LDG 128x128 pp (qk + v GEMM)": table(rope_table_ldg_epi, PP128),
            "posfreq default cfg (qkv GEMM)": posfreq(),
            "posfreq 128x128 pp (qkv GEMM)": posfreq(PP128),
            "torch.compile, unfused": lambda: compiled(x, wq, wk, wv, cos.to(bf), sin.to(bf),
                                                       hq, hkv, d),
            "eager": lambda: hf_qkv_rope(x, wq, wk, wv, cos.to(bf), sin.to(bf), hq, hkv, d),
        }
        with torch.no_grad():
            for name, fn in variants.items():
                try:
                    out = fn()
                except Exception as exc:  # a config QuACK refuses: say so, go on
                    print(f"{shape:>3}  {name:<34} failed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[-1][:120]}", flush=True)
                    continue
                if name.startswith(("table", "posfreq")):
                    e = f"{err(unpermute(*out), ref):.2e}"
                elif name in ("eager", "torch.compile, unfused"):
                    flat = torch.cat([t.transpose(1, 2).reshape(M, -1) for t in out], -1)
                    e = f"{err(flat, ref):.2e}"
                else:
                    e = "-"
                ms = bench(fn)
                rows.append((shape, name, ms, e))
                print(f"{shape:>3}  {name:<34} {ms:7.3f} ms   err vs float64 {e}", flush=True)

    print("\n| shape | variant | ms | norm-wise error vs float64 |\n|---|---|---|---|")
    for shape, name, ms, e in rows:
        print(f"| {shape} | {name} | {ms:.3f} | {e} |")


if __name__ == "__main__":
    main()
