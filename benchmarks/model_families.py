"""The model-family variants of issue #19 at Llama-3-8B-like shapes (8192 tokens as
[4, 2048], hidden 4096, 32 q / 8 kv heads of 128, intermediate 14336, vocab 128256),
each beside torch.compile of the same region, bare cuBLAS and eager, in one run
(variants in alternating rounds):

* q, k, v -> interleaved-pair RoPE (GLM's spelling: cos/sin of cat(θ, θ), halved and
  repeat_interleaved, x[..., 0::2] / x[..., 1::2]) -> SDPA, beside the half-split
  (Llama) spelling of the same region;
* packed q/k/v (GPT-NeoX's per-head [q, k, v], Falcon's grouped layout, CodeGen's
  blocks) -> RoPE -> SDPA: the member gathers of the fused GEMM against torch.compile;
* multi-head latent attention at DeepSeek-V3's layer shapes ([2, 2048] tokens, 128 heads
  of 128 + 64 features for q·k and 128 for v, q rank 1536, kv rank 512, hidden 7168):
  q_b_proj -> rotated suffix -> cat, the shared rotary key head, the key buffer, SDPA;
* LM head -> soft-capped cross-entropy (Gemma 2: 30·tanh(y / 30)), forward + backward,
  beside the uncapped loss, torch.compile and Liger's fused linear cross-entropy with
  its softcap (when installed); peak memory too;
* QK-norm (Qwen3-8B-like: hidden 4096, 32 q / 8 kv heads of 128, an RMSNorm over each
  head of q and k before the rotation) -> RoPE -> SDPA at 8192, 2048, 1024, 256 and 64
  tokens (the rewrite forced at every size: min_fused_rows=0), beside torch.compile, the
  bare GEMMs + SDPA and eager: where the norm + rotation in the GEMM's epilogue pays;
* LayerNorm (GPT-NeoX-like: Pythia-6.9B widths, hidden 4096, MLP 16384 with GELU;
  vocab 50432; CODA_LN_HIDDEN=2048: Pythia-1B's): z = x + residual -> LayerNorm -> up
  projection -> GELU (the activation in the epilogue), and the final LayerNorm -> LM head,
  at 8192, 4096, 2048, 1024 and 256 tokens (CODA_LN_TOKENS; forced at every size, the
  folded weights kept), beside torch.compile, the bare GEMM and eager, from CUDA graphs
  too; and the MLP input's forward + backward (training; CODA_LN_TRAIN=0 skips it): where
  the deferred norm pays;
* post-sublayer ("sandwich") norm: GEMM -> RMSNorm -> + residual, under torch.compile,
  against the GEMM alone and against the GEMM + the one pass a fused epilogue would
  still need (the norm's statistic spans the whole row, and the residual is added after
  the norm: the epilogue could only emit sums of squares, a second pass reads the GEMM's
  output back). What a fusion could save is the difference.

    source .gpu/setup.sh && python benchmarks/model_families.py \
        [rope,packed,mla,head,sandwich,qknorm,layernorm]
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import bench_graphed, bench_rounds, env_line, write_csv

import coda_rewrite

B, S, H, FFN, Q, KV, V, HEAD = 4, 2048, 4096, 14336, 4096, 1024, 128256, 128
M = B * S
bf = torch.bfloat16
CAP = 30.0


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):  # GLM / Cohere
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def tables(inv_freq, x):
    """Hugging Face's cos/sin of cat(θ, θ) for x's positions, [1, 1, S, HEAD] (the head
    axis unit), in x's dtype."""
    pos = torch.arange(x.shape[1], device=x.device)[None]
    th = (inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((th, th), -1)
    return emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]


class Attention(nn.Module):
    """q, k, v -> RoPE -> causal SDPA; ``interleaved`` picks GLM's spelling."""

    def __init__(self, interleaved: bool):
        super().__init__()
        self.interleaved = interleaved
        self.q, self.k, self.v = (nn.Linear(H, n, bias=False) for n in (Q, KV, KV))
        self.register_buffer("inv_freq",
                             1.0 / (500000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD)))

    def forward(self, x):
        b, s = x.shape[:2]
        cos, sin = tables(self.inv_freq, x)
        if self.interleaved:
            cos = cos[..., :HEAD // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., :HEAD // 2].repeat_interleave(2, dim=-1)
        rot = rotate_pairs if self.interleaved else rotate_half
        q = self.q(x).view(b, s, -1, HEAD).transpose(1, 2)
        k = self.k(x).view(b, s, -1, HEAD).transpose(1, 2)
        v = self.v(x).view(b, s, -1, HEAD).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Head(nn.Module):
    """The final norm's output -> LM head -> (soft-capped) logits -> mean cross-entropy."""

    def __init__(self, cap: float | None):
        super().__init__()
        self.cap = cap
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, h, labels):
        logits = self.lm_head(h)
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return F.cross_entropy(logits.float().view(-1, V), labels.view(-1))


class Sandwich(nn.Module):
    """o_proj -> post-sublayer RMSNorm -> + residual (Gemma 2/3, OLMo 2, GLM-4)."""

    def __init__(self):
        super().__init__()
        self.o = nn.Linear(H, H, bias=False)
        self.weight = nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, x, residual):
        y = self.o(x).float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return residual + (self.weight * y).to(residual.dtype)


class PackedAttention(nn.Module):
    """One q/k/v projection whose heads are not contiguous slices, then half-split RoPE
    and SDPA, as three models spell it (32 q heads of 128; k, v per ``layout``):

    * "neox": [q_h, k_h, v_h] side by side per head (GPT-NeoX: 32 kv heads);
    * "grouped": view(b, s, 8, 4 + 2, 128), q = [..., :-2, :], k / v = [..., [-2] /
      [-1], :] broadcast to the group's 4 query heads (Falcon-40B's layout);
    * "blocks": 4 model-parallel blocks of [q, v, k] (CodeGen's; 32 kv heads)."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        n = {"neox": 3 * Q, "grouped": Q + 2 * KV, "blocks": 3 * Q}[layout]
        self.qkv = nn.Linear(H, n, bias=False)
        self.register_buffer("inv_freq",
                             1.0 / (500000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD)))

    def heads(self, y, b, s):
        if self.layout == "neox":
            return y.view(b, s, -1, 3 * HEAD).transpose(1, 2).chunk(3, dim=-1)
        if self.layout == "grouped":
            qkv = y.view(b, s, KV // HEAD, Q // KV + 2, HEAD)
            q = qkv[:, :, :, :-2]
            k = torch.broadcast_to(qkv[:, :, :, [-2]], q.shape)
            v = torch.broadcast_to(qkv[:, :, :, [-1]], q.shape)
            return [t.flatten(2, 3).transpose(1, 2) for t in (q, k, v)]
        blocks = y.reshape(b, s, 4, -1)
        q, v, k = torch.split(blocks, Q // 4, dim=-1)
        return [t.reshape(b, s, 4, -1, HEAD).reshape(b, s, -1, HEAD).transpose(1, 2)
                for t in (q, k, v)]

    def forward(self, x):
        b, s = x.shape[:2]
        cos, sin = tables(self.inv_freq, x)
        q, k, v = self.heads(self.qkv(x), b, s)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class LatentAttention(nn.Module):
    """DeepSeek-V3's attention inputs as Hugging Face spells them (rope_interleave: pairs
    read from adjacent features, written as halves), from the q_a norm's output ``xq``
    and the layer input ``x`` (the kv_a norm left out: the region is about q)."""
    HEADS, NOPE, ROPE, VDIM, QR, KVR, HID = 128, 128, 64, 128, 1536, 512, 7168

    def __init__(self):
        super().__init__()
        n, d = self.HEADS, self.NOPE + self.ROPE
        self.q_b = nn.Linear(self.QR, n * d, bias=False)
        self.kv_a = nn.Linear(self.HID, self.KVR + self.ROPE, bias=False)
        self.kv_b = nn.Linear(self.KVR, n * (self.NOPE + self.VDIM), bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (
            torch.arange(0, self.ROPE, 2).float() / self.ROPE)))

    def forward(self, xq, x):
        b, s = x.shape[:2]
        pos = torch.arange(s, device=x.device)[None]
        th = (self.inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((th, th), -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = self.q_b(xq).view(b, s, -1, self.NOPE + self.ROPE).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.NOPE, self.ROPE], dim=-1)
        kv, k_rot = torch.split(self.kv_a(x), [self.KVR, self.ROPE], dim=-1)
        k_rot = k_rot.view(b, 1, s, self.ROPE)
        c, sn = cos[..., :self.ROPE // 2].unsqueeze(1), sin[..., :self.ROPE // 2].unsqueeze(1)

        def rope(t):
            t1, t2 = t[..., 0::2], t[..., 1::2]
            return torch.cat([t1 * c - t2 * sn, t2 * c + t1 * sn], dim=-1)
        q_rot, k_rot = rope(q_rot), rope(k_rot)
        kv = self.kv_b(kv).view(b, s, -1, self.NOPE + self.VDIM).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.NOPE, self.VDIM], dim=-1)
        query = torch.cat((q_pass, q_rot), dim=-1)
        key = kv.new_empty(*kv.shape[:-1], self.NOPE + self.ROPE)
        key[..., :self.NOPE].copy_(k_nope)
        key[..., self.NOPE:].copy_(k_rot.expand(-1, self.HEADS, -1, -1))
        return F.scaled_dot_product_attention(query, key, v, is_causal=True)


class QkNormAttention(nn.Module):
    """Qwen3's attention inputs: q, k, v -> RMSNorm over each head of q and k (float32
    statistic, weight after the cast back) -> RoPE -> causal SDPA (GQA)."""

    EPS = 1e-6

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(H, n, bias=False) for n in (Q, KV, KV))
        self.q_norm, self.k_norm = (nn.Parameter(1 + 0.1 * torch.randn(HEAD))
                                    for _ in range(2))
        self.register_buffer("inv_freq",
                             1.0 / (1000000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD)))

    def norm(self, x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.EPS)
        return w * h.to(x.dtype)

    def forward(self, x):
        b, s = x.shape[:2]
        cos, sin = tables(self.inv_freq, x)
        q = self.norm(self.q(x).view(b, s, -1, HEAD), self.q_norm).transpose(1, 2)
        k = self.norm(self.k(x).view(b, s, -1, HEAD), self.k_norm).transpose(1, 2)
        v = self.v(x).view(b, s, -1, HEAD).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def qknorm_rows():
    """The QK-norm region at several token counts, the rewrite forced at every size."""
    rows, table = [], []
    for b, s in ((4, 2048), (1, 2048), (1, 1024), (1, 256), (1, 64)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        region = QkNormAttention().cuda().to(bf)
        x = torch.randn(b, s, H, device="cuda", dtype=bf)
        ws = [region.q.weight, region.k.weight, region.v.weight]

        def bare(x=x, ws=ws, b=b, s=s):
            q, k, v = (torch.mm(x.view(b * s, H), w.t()).view(b, s, -1, HEAD).transpose(1, 2)
                       for w in ws)
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        name = f"QK-norm q,k,v -> RoPE, {b * s} tokens"
        r, t = _region_rows(name, region, x, bare, graphed=True, min_fused_rows=0)
        rows, table = rows + r, table + t
    return rows, table


# Pythia-6.9B's widths; CODA_LN_HIDDEN=2048 gives Pythia-1B's (MLP 4 × hidden)
LN_H = int(os.environ.get("CODA_LN_HIDDEN", "4096"))
LN_FFN, LN_VOCAB = 4 * LN_H, 50432


class LayerNormUp(nn.Module):
    """GPT-NeoX's MLP input: the residual add, the post-attention LayerNorm, the up
    projection and GELU."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(LN_H)
        self.up = nn.Linear(LN_H, LN_FFN)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x, residual):
        return F.gelu(self.up(self.ln(x + residual)))


class LayerNormHead(nn.Module):
    """The final LayerNorm and the LM head (logits, inference)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(LN_H)
        self.head = nn.Linear(LN_H, LN_VOCAB, bias=False)

    def forward(self, x):
        return self.head(self.ln(x))


def layernorm_rows():
    """The LayerNorm regions at several token counts, the rewrite forced at every size,
    the folded weights kept (cache_relayouts: without it the fold is a weight pass per
    call, which the speed policy refuses on the GPU)."""
    rows, table = [], []
    opts = {"min_fused_rows": 0, "cache_relayouts": True}
    sizes = [int(t) for t in os.environ.get("CODA_LN_TOKENS", "8192,4096,2048,1024,256").split(",")]
    for tokens in sizes:
        for make in (LayerNormUp, LayerNormHead):
            torch._dynamo.reset()
            torch.manual_seed(0)
            region = make().cuda().to(bf)
            xs = (torch.randn(1, tokens, LN_H, device="cuda", dtype=bf) + 2.0,)
            if make is LayerNormUp:
                xs += (torch.randn(1, tokens, LN_H, device="cuda", dtype=bf),)
            w = region.up.weight if make is LayerNormUp else region.head.weight

            def bare(xs=xs, w=w):  # the GEMM alone
                torch.mm(xs[0].view(-1, LN_H), w.t())
            name = f"{make.__name__}, {tokens} tokens"
            r, t = _region_rows(name, region, xs, bare, pattern="layernorm_gemm",
                                graphed=True, **opts)
            rows, table = rows + r, table + t
    if os.environ.get("CODA_LN_TRAIN", "1") == "0":
        return rows, table
    # training: the MLP input's forward + backward at 8192 tokens
    torch._dynamo.reset()
    torch.manual_seed(0)
    region = LayerNormUp().cuda().to(bf)
    xs = [(torch.randn(1, 8192, LN_H, device="cuda", dtype=bf) + 2.0).requires_grad_(),
          torch.randn(1, 8192, LN_H, device="cuda", dtype=bf).requires_grad_()]
    backend = torch.compile(region, backend="coda",
                            options={"min_fused_rows": 0, "fuse_in_training": True})
    compiled = torch.compile(region)

    def step(fn):
        def run():
            fn(*xs).float().square().mean().backward()
        return run
    fns = {"coda backend (train)": step(backend), "torch.compile (train)": step(compiled),
           "eager (train)": step(region)}
    for f in fns.values():
        f()
    t = bench_rounds(fns)
    name = "LayerNormUp fwd+bwd, 8192 tokens"
    rows += [(f"{name}: {v}", "ms", ms) for v, (ms, _) in t.items()]
    table += [(name, v, ms, spread, float("nan")) for v, (ms, spread) in t.items()]
    for v, f in fns.items():
        table.append((name, f"{v} peak GiB", _peak(f), 0.0, float("nan")))
    return rows, table


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def _region_rows(name: str, region: nn.Module, x, bare, pattern: str = "rope",
                 graphed: bool = False, **options) -> tuple[list, list]:
    """One region: optimize(), backend="coda", torch.compile, ``bare`` (the cuBLAS GEMMs,
    + SDPA where the region has one) and eager in alternating rounds, after checking that
    the ``pattern`` rewrite applied once and what it computes against eager. ``graphed``:
    the backend, torch.compile and ``bare`` also from CUDA graphs (the device time alone:
    at a few hundred tokens the plain loop times the host's launches). ``x``: the input,
    or a tuple of them; ``options``: the pass's, for both coda variants."""
    xs = x if isinstance(x, tuple) else (x,)
    with torch.no_grad():
        fused = coda_rewrite.optimize(region, **options)
        backend = torch.compile(region, backend="coda", options=options)
        compiled = torch.compile(region)
        want, got = region(*xs), fused(*xs)
        backend(*xs)
        compiled(*xs)
        assert fused.report.count(pattern=pattern) == 1, str(fused.report)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        variants = {"coda": lambda: fused(*xs), "coda backend": lambda: backend(*xs),
                    "torch.compile": lambda: compiled(*xs), "bare cuBLAS": bare,
                    "eager": lambda: region(*xs)}
        t = bench_rounds(variants)
        seen = {k: [] for k in (("coda backend", "torch.compile", "bare cuBLAS")
                                if graphed else ())}
        for i in range(3 if graphed else 0):
            for k in (list(seen) if i % 2 == 0 else list(seen)[::-1]):
                seen[k].append(bench_graphed(variants[k]))
    rows = [(f"{name}: {variant}", "ms", ms) for variant, (ms, _) in t.items()]
    table = [(name, variant, ms, spread, err) for variant, (ms, spread) in t.items()]
    for k, ts in seen.items():
        ms = sorted(ts)[1]
        rows.append((f"{name}: {k} (CUDA graph)", "ms", ms))
        table.append((name, f"{k}, CUDA graph", ms, (max(ts) - min(ts)) / ms, err))
    return rows, table


def attention_rows():
    x = torch.randn(B, S, H, device="cuda", dtype=bf)
    rows, table = [], []
    for interleaved in (True, False):
        torch.manual_seed(0)
        region = Attention(interleaved).cuda().to(bf)
        ws = [region.q.weight, region.k.weight, region.v.weight]

        def bare():
            q, k, v = (torch.mm(x.view(M, H), w.t()).view(B, S, -1, HEAD).transpose(1, 2)
                       for w in ws)
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        name = "q,k,v -> RoPE (interleaved pairs)" if interleaved else \
            "q,k,v -> RoPE (half-split)"
        r, t = _region_rows(name, region, x, bare)
        rows, table = rows + r, table + t
    return rows, table


def packed_rows():
    """The packed layouts' regions (PackedAttention), each beside torch.compile of it, the
    bare GEMM + SDPA and eager: whether gathering the members into the fused GEMM pays."""
    x = torch.randn(B, S, H, device="cuda", dtype=bf)
    rows, table = [], []
    for layout in ("neox", "grouped", "blocks"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        region = PackedAttention(layout).cuda().to(bf)

        def bare(region=region):
            q, k, v = region.heads(torch.mm(x.view(M, H), region.qkv.weight.t())
                                   .view(B, S, -1), B, S)
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        r, t = _region_rows(f"packed q,k,v ({layout}) -> RoPE", region, x, bare)
        rows, table = rows + r, table + t
    return rows, table


def latent_rows():
    """DeepSeek-V3's attention inputs (LatentAttention) beside torch.compile, the bare
    GEMMs + SDPA (no rotation) and eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    region = LatentAttention().cuda().to(bf)
    b, s, la = 2, 2048, LatentAttention
    xq = torch.randn(b, s, la.QR, device="cuda", dtype=bf)
    x = torch.randn(b, s, la.HID, device="cuda", dtype=bf)

    def bare():
        q = region.q_b(xq).view(b, s, -1, la.NOPE + la.ROPE).transpose(1, 2)
        kv, _ = torch.split(region.kv_a(x), [la.KVR, la.ROPE], dim=-1)
        kv = region.kv_b(kv).view(b, s, -1, la.NOPE + la.VDIM).transpose(1, 2)
        k_nope, v = torch.split(kv, [la.NOPE, la.VDIM], dim=-1)
        F.scaled_dot_product_attention(q, q, v, is_causal=True)
    return _region_rows("MLA q_b_proj -> rotated suffix (DeepSeek-V3)", region, (xq, x), bare)


def head_rows():
    h = torch.randn(M, H, device="cuda", dtype=bf) * 0.5
    labels = torch.randint(0, V, (M,), device="cuda")
    rows, table = [], []
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        LigerFusedLinearCrossEntropyLoss = None
    for cap in (CAP, None):
        torch.manual_seed(0)
        head = Head(cap).cuda().to(bf)
        fused = coda_rewrite.optimize(head)
        backend = torch.compile(head, backend="coda")
        compiled = torch.compile(head)
        hx = h.clone().requires_grad_()

        def step(fn):
            def run():
                fn(hx, labels).backward()
                hx.grad = None
                head.lm_head.weight.grad = None
            return run

        with torch.no_grad():
            want = head(h, labels)
            got = fused(h, labels)
        assert fused.report.count(pattern="lm_head_cross_entropy") == 1, str(fused.report)
        err = abs(float(got) - float(want)) / abs(float(want))
        fns = {"coda": step(fused), "coda backend": step(backend),
               "torch.compile": step(compiled), "eager": step(head)}
        if LigerFusedLinearCrossEntropyLoss is not None:
            liger = LigerFusedLinearCrossEntropyLoss(softcap=cap)
            fns["Liger"] = step(lambda x, t: liger(head.lm_head.weight, x, t))
        for fn in fns.values():
            fn()
        peaks = {k: _peak(fn) for k, fn in fns.items()}
        t = bench_rounds(fns)
        name = f"LM head -> CE, {'soft-capped ' + str(int(cap)) if cap else 'no cap'}, fwd+bwd"
        for variant, (ms, spread) in t.items():
            rows += [(f"{name}: {variant}", "ms", ms),
                     (f"{name}: {variant}", "GiB", peaks[variant])]
            table.append((name, variant, ms, spread, err, peaks[variant]))
    return rows, table


def sandwich_rows():
    torch.manual_seed(0)
    region = Sandwich().cuda().to(bf)
    x = torch.randn(M, H, device="cuda", dtype=bf)
    res = torch.randn(M, H, device="cuda", dtype=bf)
    y = torch.mm(x, region.o.weight.t())
    r = torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6)

    @torch.compile
    def one_pass(y, r, res, w):  # what a fused epilogue would still need: read y back
        return res + (w * (y.float() * r)).to(res.dtype)

    with torch.no_grad():
        compiled = torch.compile(region)
        fused = coda_rewrite.optimize(region)
        compiled(x, res)
        fused(x, res)
        one_pass(y, r, res, region.weight)
        codes = sorted({rec.code for rec in fused.report.records if rec.status != "rewritten"})
        t = bench_rounds({
            "torch.compile": lambda: compiled(x, res),
            "coda (norm left)": lambda: fused(x, res),
            "GEMM alone": lambda: torch.mm(x, region.o.weight.t()),
            "GEMM + one pass (fusion's floor)": lambda: (
                torch.mm(x, region.o.weight.t()), one_pass(y, r, res, region.weight)),
        })
    name = "o_proj -> post-sublayer RMSNorm -> + residual"
    rows = [(f"{name}: {v}", "ms", ms) for v, (ms, _) in t.items()]
    table = [(name, v, ms, spread, float("nan")) for v, (ms, spread) in t.items()]
    return rows, table, codes


def main(which: set[str]):
    print(env_line(), flush=True)
    rows, table = attention_rows() if "rope" in which else ([], [])
    r1, t1 = packed_rows() if "packed" in which else ([], [])
    rows, table = rows + r1, table + t1
    r1, t1 = latent_rows() if "mla" in which else ([], [])
    rows, table = rows + r1, table + t1
    r2, t2 = head_rows() if "head" in which else ([], [])
    r3, t3, codes = sandwich_rows() if "sandwich" in which else ([], [], [])
    r4, t4 = qknorm_rows() if "qknorm" in which else ([], [])
    r3, t3 = r3 + r4, t3 + t4
    r4, t4 = layernorm_rows() if "layernorm" in which else ([], [])
    r3, t3 = r3 + r4, t3 + t4
    path = write_csv("model families (#19)", rows + r2 + r3)
    print(f"rows appended to {path}")
    if codes:
        print(f"sandwich: the pass's reasons: {codes}")
    print("\n| region | variant | ms | spread | rel. err vs eager | peak GiB |")
    print("|---|---|---|---|---|---|")
    for row in table + t2 + t3:
        name, variant, ms, spread, err, *peak = row
        print(f"| {name} | {variant} | {ms:.3f} | {spread:.1%} | {err:.1e} | "
              f"{peak[0] if peak else float('nan'):.2f} |")


if __name__ == "__main__":
    import sys
    main(set(sys.argv[1].split(",")) if len(sys.argv) > 1 else {"rope", "head", "sandwich"})
