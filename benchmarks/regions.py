"""Each matched region at Llama-3-8B shapes (8192 tokens, hidden 4096, intermediate
14336, 32 q / 8 kv heads, vocab 128256): the producing GEMM + residual + RMSNorm + every
consumer GEMM, as the pass rewrites it (optimize(): generated kernels), against the same
bare cuBLAS GEMMs, torch.compile of the unfused region and eager.

    source .gpu/setup.sh && python benchmarks/regions.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import bench, bench_rounds, env_line, write_csv

import coda_rewrite
from coda_rewrite.kernels import ops
from coda_rewrite.codegen import layouts

M, H, FFN, Q, KV, V, HEAD = 8192, 4096, 14336, 4096, 1024, 128256, 128
bf = torch.bfloat16


class Region(nn.Module):
    """producer GEMM -> residual add -> Hugging Face-style RMSNorm -> consumer GEMMs
    (-> SwiGLU of the two consumers, for the gated region)."""

    def __init__(self, k0, consumers, gated=False):
        super().__init__()
        self.gated = gated
        self.producer = nn.Linear(k0, H, bias=False)
        self.weight = nn.Parameter(torch.rand(H) + 0.5)
        self.consumers = nn.ModuleList(nn.Linear(H, n, bias=False) for n in consumers)

    def forward(self, x, residual):
        z = residual + self.producer(x)
        h = z.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        h = self.weight * h.to(z.dtype)
        if self.gated:
            gate, up = self.consumers
            return z, [F.silu(gate(h)) * up(h)]
        return z, [c(h) for c in self.consumers]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RopeRegion(nn.Module):
    """[producer GEMM -> residual -> RMSNorm ->] q, k, v -> Hugging Face RoPE on q and k
    (cos/sin from positions x inverse frequencies, as LlamaRotaryEmbedding computes them)
    -> causal SDPA, tokens as [4, 2048]: the attention input of a Llama-3-8B layer (the
    bare baseline runs the same SDPA on its GEMMs' outputs)."""

    def __init__(self, norm: bool):
        super().__init__()
        self.norm = Region(FFN, [Q, KV, KV]) if norm else None
        self.q, self.k, self.v = (nn.Linear(H, n, bias=False) for n in (Q, KV, KV))
        if norm:  # one set of projections: the norm region's consumers
            self.q, self.k, self.v = self.norm.consumers
        d = HEAD
        self.register_buffer("inv_freq", 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d)))

    def forward(self, x, residual):
        b, s = x.shape[:2]
        if self.norm is not None:
            z = residual + self.norm.producer(x)
            h = z.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
            h = self.norm.weight * h.to(z.dtype)
        else:
            z, h = residual, x
        pos = torch.arange(s, device=x.device)[None]
        th = (self.inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((th, th), -1)
        cos, sin = emb.cos().to(h.dtype)[:, None], emb.sin().to(h.dtype)[:, None]
        q = self.q(h).view(b, s, -1, HEAD).transpose(1, 2)
        k = self.k(h).view(b, s, -1, HEAD).transpose(1, 2)
        v = self.v(h).view(b, s, -1, HEAD).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # attention reads q and k (the permuted order never leaves the region)
        return z, [F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)]


class GatedMLP(nn.Module):
    """gate, up -> SwiGLU on an input with no norm in front (the pairwise epilogue
    alone; the region of ../shared/gpu/README.md's rstd + SwiGLU figure)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, FFN, bias=False)
        self.up = nn.Linear(H, FFN, bias=False)

    def forward(self, x, residual):
        return residual, [F.silu(self.gate(x)) * self.up(x)]


# name -> (producer K, consumer Ns, kind, rewrites expected: norm, gated, rope)
REGIONS = {
    "o_proj -> post-attn norm -> gate, up": (H, [FFN, FFN], "plain", (1, 0, 0)),
    "o_proj -> norm -> gate, up -> SwiGLU": (H, [FFN, FFN], "gated", (1, 1, 0)),
    "gate, up -> SwiGLU (no norm)": (None, [FFN, FFN], "gated", (0, 1, 0)),
    "down -> input norm -> q, k, v": (FFN, [Q, KV, KV], "plain", (1, 0, 0)),
    "down -> norm -> q, k, v -> RoPE": (FFN, [Q, KV, KV], "rope", (1, 0, 1)),
    "q, k, v -> RoPE (no norm)": (None, [Q, KV, KV], "rope", (0, 0, 1)),
    "down -> final norm -> lm_head": (FFN, [V], "plain", (1, 0, 0)),
}


def make_region(k0, consumers, kind):
    if kind == "rope":
        return RopeRegion(norm=k0 is not None)
    return Region(k0, consumers, kind == "gated") if k0 else GatedMLP()


def per_gemm(fused, *args) -> list[tuple[str, float, float]]:
    """Each generated GEMM of one call of ``fused``, timed alone against cuBLAS's
    ``torch.mm`` at its shape: (what, generated ms, cuBLAS ms). Says which kernel a
    region's gap is in."""
    from coda_rewrite.codegen.program import parse
    calls, run = [], ops.gemm_epilogue

    def spy(program, a, b, operands):
        calls.append((program, a, b, list(operands)))
        return run(program, a, b, operands)
    ops.gemm_epilogue = spy
    try:
        fused(*args)
    finally:
        ops.gemm_epilogue = run
    rows = []
    for program, a, b, operands in calls:
        if a is None:
            continue
        what = f"{parse(program).name} (M {a.shape[0]}, K {a.shape[1]}, N {b.shape[0]})"
        t = bench_rounds({"gen": lambda: run(program, a, b, operands),
                          "mm": lambda: torch.mm(a, b.t())})
        rows.append((what, t["gen"][0], t["mm"][0]))
    return rows


def main():
    print(env_line(), flush=True)
    rows = []
    for name, (k0, consumers, kind, expected) in REGIONS.items():
        torch.manual_seed(0)
        region = make_region(k0, consumers, kind).cuda().to(bf)
        lead = (4, M // 4) if kind == "rope" else (M,)  # RoPE needs [batch, seq] tokens
        x = torch.randn(*lead, k0 or H, device="cuda", dtype=bf)
        res = torch.randn(*lead, H, device="cuda", dtype=bf)
        with torch.no_grad():
            fused = coda_rewrite.optimize(region)
            cached = coda_rewrite.optimize(region, cache_relayouts=True)
            compiled = torch.compile(region)
            z, outs = region(x, res)
            zf, outs_f = fused(x, res)
            got = (fused.report.count(pattern="residual_rmsnorm_gemm"),
                   fused.report.count(pattern="gated_mlp"), fused.report.count(pattern="rope"))
            assert got == expected, str(fused.report)
            errs = [float((a.float() - b.float()).norm() / b.float().norm())
                    for a, b in zip([z, *outs], [zf, *outs_f])]
            h = torch.randn(M, H, device="cuda", dtype=bf)
            x2 = x.reshape(M, -1)
            if kind == "rope":
                ws = [region.q.weight, region.k.weight, region.v.weight]
                w0 = region.norm.producer.weight if k0 else None
            else:
                ws = [c.weight for c in region.consumers] if k0 else \
                    [region.gate.weight, region.up.weight]
                w0 = region.producer.weight if k0 else None

            def bare():
                if w0 is not None:
                    torch.mm(x2, w0.t())
                outs = [torch.mm(h, w.t()) for w in ws]
                if kind == "rope":
                    q, k, v = (o.view(4, M // 4, -1, HEAD).transpose(1, 2) for o in outs)
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            fns = {"fused": lambda: fused(x, res), "bare": bare,
                   "compile": lambda: compiled(x, res), "eager": lambda: region(x, res)}
            if kind in ("gated", "rope"):  # serving: the re-layout kept between calls
                backend = torch.compile(region, backend="coda")  # Inductor around the kernels
                backend_kept = torch.compile(region, backend=coda_rewrite.CodaBackend(
                    coda_rewrite.Options(cache_relayouts=True)))
                backend(x, res)
                backend_kept(x, res)
                fns.update(cached=lambda: cached(x, res), backend=lambda: backend(x, res),
                           backend_kept=lambda: backend_kept(x, res))
            compiled(x, res)
            timed = bench_rounds(fns)
            t = {k: ms for k, (ms, _) in timed.items()}
            t["spread"] = max(s for _, s in timed.values())
            gemms = per_gemm(fused, x, res)  # the re-layout as a graph op: the spy sees b
            if kind == "gated":  # the per-call weight re-layout inside "fused", alone
                t["interleave"] = bench(lambda: layouts.interleave_rows(*ws))
            if kind == "rope":
                lay = ((0, Q, Q // HEAD, HEAD, HEAD), (0, KV, KV // HEAD, HEAD, HEAD),
                       (0, KV, 0, 0, 0))
                t["interleave"] = bench(lambda: layouts.rope_segments(lay, *ws))
        rows.append((name, t, max(errs), gemms))
        print(name, t, "max rel diff vs eager", max(errs), flush=True)
        torch.cuda.empty_cache()
    print("\nruntime:", *ops.runtime_summary(), sep="\n  ")
    print(f"\n{env_line()}")
    print(f"{'region (8192 tokens, Llama-3-8B)':40s} {'fused':>8s} {'cuBLAS':>8s} {'compile':>8s} "
          f"{'eager':>8s}  fused/cuBLAS  fused/compile")
    ratios = []
    for name, t, _, _ in rows:
        ratios.append(t["fused"] / t["bare"])
        print(f"{name:40s} {t['fused']:8.3f} {t['bare']:8.3f} {t['compile']:8.3f} "
              f"{t['eager']:8.3f}  {t['fused'] / t['bare']:10.3f}x  {t['fused'] / t['compile']:10.3f}x"
              f"  (spread over rounds up to {t['spread']:.1%})")
    for name, t, _, _ in rows:
        if "interleave" in t:
            print(f"  {name}: of which the per-call weight re-layout {t['interleave']:.3f} ms;"
                  f" with cache_relayouts=True {t['cached']:.3f} ms"
                  f" ({t['cached'] / t['bare']:.3f}x cuBLAS, {t['cached'] / t['compile']:.3f}x"
                  f" compile); backend=\"coda\" {t['backend']:.3f} ms"
                  f" ({t['backend'] / t['bare']:.3f}x cuBLAS, {t['backend'] / t['compile']:.3f}x"
                  f" compile), with cache_relayouts=True {t['backend_kept']:.3f} ms"
                  f" ({t['backend_kept'] / t['bare']:.3f}x cuBLAS,"
                  f" {t['backend_kept'] / t['compile']:.3f}x compile)")
    print("\neach generated GEMM alone vs cuBLAS torch.mm at its shape:")
    seen = set()
    for _, _, _, gemms in rows:
        for what, ms, mm in gemms:
            if what not in seen:
                seen.add(what)
                print(f"  {what:55s} {ms:7.3f} ms  cuBLAS {mm:7.3f}  {ms / mm:6.3f}x")
    g = 1.0
    for r in ratios:
        g *= r
    print(f"geometric mean fused/cuBLAS: {g ** (1 / len(ratios)):.3f}x")
    labels = {"fused": "optimize()", "bare": "cuBLAS", "compile": "torch.compile",
              "eager": "eager", "cached": "optimize(), kept", "backend": 'backend="coda"',
              "backend_kept": 'backend="coda", kept'}
    for name, t, _, _ in rows:
        print("csv:", write_csv(f"region: {name}", [(labels[k], "ms", t[k]) for k in labels
                                                     if k in t]))


if __name__ == "__main__":
    main()
