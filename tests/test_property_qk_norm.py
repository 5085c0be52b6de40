"""An adversary for the QK-norm in the rotating GEMM: hypothesis generates where an
RMSNorm sits around the rotation (over each head before the heads' transpose, as Qwen3;
after it, as Gemma 3; after the rotation; over the whole projection before the head split,
as OLMo 2), which of q and k it normalises, its weight (none, w, Gemma's 1 + w), its eps
(q's and k's equal or not), the dim its statistic runs over (a look-alike over another
dim), an upcast around it, a bias on the projections, a second reader (the raw, the
normalised or the rotated q returned) and a no_grad block around the angles, and checks
in training that the output and every gradient are eager's, that the rotation takes the
norm exactly where it must, and that every match left carries a reason."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from conftest import adversary_records, outputs_step_matches_eager

H, KV, D, HID = 4, 2, 8, 32


def rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


class Norm(nn.Module):
    def __init__(self, width, weight, eps, upcast, dim=-1):
        super().__init__()
        self.kind, self.eps, self.upcast, self.dim = weight, eps, upcast, dim
        if weight != "none":
            self.weight = nn.Parameter(torch.randn(width) * 0.5 + (0.0 if weight == "gemma"
                                                                    else 1.0))

    def forward(self, x):
        dtype = x.dtype
        h = x.float() if self.upcast else x
        h = h * torch.rsqrt(h.pow(2).mean(self.dim, keepdim=True) + self.eps)
        if self.kind == "gemma":
            return (h * (1.0 + self.weight.float())).type_as(x)
        h = h.to(dtype) if self.upcast else h
        return h if self.kind == "none" else self.weight * h


class Attention(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        bias = case["bias"]
        self.q = nn.Linear(HID, H * D, bias=bias)
        self.k = nn.Linear(HID, KV * D, bias=bias)
        self.v = nn.Linear(HID, KV * D, bias=bias)
        self.o = nn.Linear(H * D, HID, bias=False)
        over = case["norm_at"] == "projection"
        dim = -1 if case["stat"] == "features" else -2
        self.q_norm = Norm(H * D if over else D, case["weight"], 1e-6, case["upcast"], dim)
        self.k_norm = Norm(KV * D if over else D, case["weight"],
                           1e-6 if case["eps_k"] == "same" else 1e-3, case["upcast"], dim)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, D, 2) / D)))

    def forward(self, x):
        b, s, _ = x.shape
        c = self.case
        with torch.set_grad_enabled(not c["angles_no_grad"] and torch.is_grad_enabled()):
            pos = torch.arange(s, device=x.device)[None].float()
            th = (self.inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2)
        emb = torch.cat((th, th), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        extra = []

        def heads(proj, norm, n, normed):
            t = proj(x)
            if normed and c["norm_at"] == "projection":
                t = norm(t)
            t = t.view(b, s, n, D)
            if c["second"] == "raw" and proj is self.q:
                extra.append(t)
            if normed and c["norm_at"] == "heads":
                t = norm(t)
            t = t.transpose(1, 2)
            if normed and c["norm_at"] == "transposed":
                t = norm(t)
            if c["second"] == "normed" and proj is self.q:
                extra.append(t)
            t = t * cos + rotate_half(t) * sin
            if c["second"] == "rotated" and proj is self.q:
                extra.append(t)
            if normed and c["norm_at"] == "after_rotation":
                t = norm(t)
            return t

        q = heads(self.q, self.q_norm, H, c["normed"] in ("both", "q"))
        k = heads(self.k, self.k_norm, KV, c["normed"] in ("both", "k"))
        v = self.v(x).view(b, s, KV, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return (self.o(out.transpose(1, 2).reshape(b, s, H * D)), *extra)


cases = st.fixed_dictionaries({
    "norm_at": st.sampled_from(["heads", "transposed", "after_rotation", "projection"]),
    "normed": st.sampled_from(["both", "q", "k"]),
    "weight": st.sampled_from(["plain", "gemma", "none"]),
    "eps_k": st.sampled_from(["same", "other"]),
    "upcast": st.booleans(),
    "bias": st.booleans(),
    "second": st.sampled_from(["none", "none", "raw", "normed", "rotated"]),
    # the angles in a no_grad block before the projections (Hugging Face's cache code
    # opens one): the fused GEMM must not be placed inside it
    "angles_no_grad": st.booleans(),
    # the statistic over the head's features, or a look-alike over the dim before them
    # (the heads, or the sequence after the transpose): not a per-head norm
    "stat": st.sampled_from(["features", "features", "other_dim"]),
})


def must_rewrite(c) -> bool:
    """The spellings the rotation must take with its norm."""
    # (the rotated q returned before a norm after the rotation: that norm then reads the
    # rotated q too, outside the fusion, so no attention would keep the permuted order)
    rotated_ok = c["second"] == "rotated" and c["norm_at"] != "after_rotation"
    return c["norm_at"] != "projection" and c["stat"] == "features" and (
        c["second"] == "none" or rotated_ok) and (
        c["eps_k"] == "same" or c["normed"] != "both")


@seed(20261201)
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_norms_around_the_rotation_match_eager(case):
    torch._dynamo.reset()
    torch.manual_seed(0)
    report = outputs_step_matches_eager(Attention(case).train(), torch.randn(2, 6, HID), case)
    done = adversary_records(report, "rope", must_rewrite(case), event)
    programs = [p.name for r in report.records if r.pattern == "rope"
                and r.status == "rewritten" for p in r.programs]
    if done and case["norm_at"] != "projection" and case["second"] == "none" and \
            case["stat"] == "features":  # the norm inside
        after = case["norm_at"] == "after_rotation"
        assert all(name.endswith("_qknorm") == after and "qknorm" in name
                   for name in programs), (programs, case)
