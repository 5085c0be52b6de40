"""A plain-PyTorch Llama (TorchTitan-style modules), for the demo, tests and benchmarks.

No Hugging Face code: nn.RMSNorm, nn.Linear, complex RoPE, grouped-query attention through
SDPA with is_causal, SwiGLU. Random weights; ``LlamaArgs`` sizes it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class LlamaArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    vocab_size: int = 512
    ffn_dim: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 512
    tie_embeddings: bool = False


def rope_table(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """[seq, head_dim / 2, 2]: (cos, sin) per position and frequency. Stored real, so
    that model.to(dtype) keeps it meaningful (a complex buffer would lose its imaginary
    part)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (TorchTitan's view_as_complex convention)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rot = torch.view_as_complex(table.float().contiguous())
    out = torch.view_as_real(xc * rot[None, :, None, :]).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv = a.n_heads, a.n_kv_heads
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads, as TorchTitan spells it: under tensor parallelism a rank holds
        # n_heads / tp of them
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs", rope_table(a.dim // a.n_heads, a.max_seq_len,
                                                 a.rope_theta), persistent=False)
        with torch.no_grad():  # non-trivial norm weights, so a dropped γ would show
            for m in self.modules():
                if isinstance(m, nn.RMSNorm):
                    m.weight.uniform_(0.5, 1.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))
