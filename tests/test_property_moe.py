"""An adversary for the routed-experts rewrite: hypothesis generates Hugging Face's
grouped_mm experts spelling and its look-alikes (routings: experts, top-k, tokens, an
expert left empty or every token to one; the sentinel fills present, absent, or on
other rows; the gate activation, DeepSeek-V4's clamps or only the gate's; the product's
operand order; a cast between; the
router weights applied per row, per entry or not at all; second readers of the gate/up
output, a half, the activation or the product; updates in place; training and
inference) and checks that the rewritten module computes what eager computes (bf16
outputs no worse than eager against a float64 copy; gradients), that the canonical
spelling is rewritten, and that every match left carries a reason."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import coda_rewrite
from coda_rewrite.codegen import reference
from coda_rewrite.numerics import rel_err

from conftest import adversary_records

H, I = 32, 16
ACTIVATIONS = {"silu": (F.silu, True), "gelu": (F.gelu, True),
               "gelu_tanh": (lambda g: F.gelu(g, approximate="tanh"), True),
               "relu": (F.relu, False), "sigmoid": (torch.sigmoid, False)}
READERS = ("none", "gate_up", "gate", "up", "act", "product", "gate_up_inplace",
           "product_inplace")


def _gmm(a, b, offs):
    if a.dtype == torch.float64:
        return reference.grouped_mm(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


class Experts(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        e = case["experts"]
        self.router = nn.Parameter(torch.randn(e, H) * case["router_scale"])
        self.gate_up = nn.Parameter(torch.randn(e, 2 * I, H) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(e, H, I) / I ** 0.5)

    def forward(self, h):
        c, e, k = self.case, self.case["experts"], self.case["top_k"]
        probs = F.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, k, dim=-1)
        w, ids = top_w.to(h.dtype).reshape(-1), top_i.reshape(-1)
        ids_g, perm = torch.sort(ids)
        x = h[perm // k]
        w_g = w[perm]
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=e, min=0, max=e - 1), dim=0,
                            dtype=torch.int32)
        mask = (ids_g >= c["sentinel_from"]).unsqueeze(-1)
        if c["fills"] in ("all", "input_only", "other_input"):
            in_mask = (ids_g >= e - 1).unsqueeze(-1) if c["fills"] == "other_input" else mask
            x.masked_fill_(in_mask, 0.0)
        if c["cast"]:
            x = x.to(h.dtype)
        p = _gmm(x, self.gate_up.transpose(-2, -1), offs)
        if c["fills"] in ("all", "other_input", "no_input"):
            p = p.masked_fill(mask, 0.0)
        extra = None
        if c["reader"] == "gate_up":
            extra = p.sum()
        if c["reader"] == "gate_up_inplace":
            p.mul_(1.5)
        gate, up = p.chunk(2, dim=-1)
        if c["clamp"] is not None:  # DeepSeek-V4's clamped SwiGLU (0.5: both clamps
            gate = gate.clamp(max=0.5)  # bite), or only the gate clamped (a look-alike)
            if c["clamp"] == 0.5:
                up = up.clamp(min=-0.5, max=0.5)
        a = ACTIVATIONS[c["act"]][0](gate)
        y = a * up if c["order"] == "act*up" else up * a
        extra = {"gate": gate, "up": up, "act": a, "product": y}.get(c["reader"], extra)
        if c["reader"] == "product_inplace":
            y.mul_(2.0)
        o = _gmm(y, self.down.transpose(-2, -1), offs)
        if c["fills"] in ("all", "other_input", "no_input"):
            o = o.masked_fill(mask, 0.0)
        if c["weights"] == "rows":
            o = o * w_g.unsqueeze(-1)
        elif c["weights"] == "rows[:, None]":
            o = o * w_g[:, None]
        elif c["weights"] == "entries":
            o = o * w_g.unsqueeze(-1).expand(-1, H).contiguous()
        out = _scatter_back(o, perm, h.shape[0], k, c["scatter"])
        return out if extra is None else (out, extra)


def _scatter_back(o, perm, tokens: int, k: int, spelling: str):
    """The rows back in token order, summed per token: transformers' spelling
    (rewritten as gathers added in token order) or a variant (reshape, sum(-2): taken
    too; an argsort inverse, a strided grouping of other rows: left as graph ops)."""
    if spelling == "argsort":
        return o[torch.argsort(perm)].view(tokens, k, -1).sum(dim=1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    if spelling == "strided":
        return o[inv].view(k, tokens, -1).sum(dim=0)
    if spelling == "reshape":
        return o[inv].reshape(tokens, k, -1).sum(-2)
    return o[inv].view(tokens, k, -1).sum(dim=1)


def _mostly(value, others):
    return st.one_of(st.just(value), st.just(value), others)


cases = st.fixed_dictionaries({
    "experts": st.integers(1, 6),
    "top_k": st.integers(1, 3),
    "tokens": st.sampled_from([1, 3, 8, 13]),
    "router_scale": st.sampled_from([0.0, 1.0, 8.0]),  # 0: every token to the same experts
    "sentinel_from": st.sampled_from([99, 2]),  # 2: rows of experts ≥ 2 filled
    "fills": _mostly("all", st.sampled_from(["none", "input_only", "other_input",
                                             "no_input"])),
    "cast": st.booleans(),
    "act": _mostly("silu", st.sampled_from(sorted(ACTIVATIONS))),
    "order": st.sampled_from(["act*up", "up*act"]),
    "clamp": _mostly(None, st.sampled_from([0.5, "gate_only"])),
    "weights": st.sampled_from(["rows", "rows[:, None]", "entries", "none"]),
    "reader": _mostly("none", st.sampled_from(READERS)),
    "train": st.booleans(),
    "scatter": _mostly("inverse", st.sampled_from(["argsort", "strided", "reshape"])),
})


def _canonical(case) -> bool:
    clamp_ok = case["clamp"] is None or (case["clamp"] == 0.5 and case["act"] == "silu")
    return ACTIVATIONS[case["act"]][1] and case["reader"] == "none" and clamp_ok and \
        case["fills"] in ("all", "none", "no_input")


def _run(case, note=event):
    _check(Experts, case, _canonical(case), note, min_tokens=24, grad_tol=6e-2)


def _check(model_class, case, canonical: bool, note, min_tokens: int, grad_tol: float):
    """The rewritten module against eager and a float64 copy: outputs no worse than eager's
    (pooled over draws of at least ``min_tokens`` tokens: one draw of a token or three is
    a handful of roundings, 1.53x was seen on one draw for a rewrite whose median over
    twelve is 0.81x), gradients within ``grad_tol`` of eager's; the canonical spelling
    rewritten, every match left with a code."""
    if case["top_k"] > case["experts"]:
        case = {**case, "top_k": case["experts"]}
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_class(case).bfloat16().train(case["train"])
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    h = torch.randn(case["tokens"], H)
    xs = [h.bfloat16().requires_grad_(case["train"]),
          h.bfloat16().requires_grad_(case["train"]), h.double()]
    fast = coda_rewrite.optimize(model)
    with torch.set_grad_enabled(case["train"]):
        got, want = fast(xs[0]), ref(xs[1])
    with torch.no_grad():
        truth = exact(xs[2])
    got, want, truth = ((t if isinstance(t, tuple) else (t,)) for t in (got, want, truth))
    adversary_records(fast.report, "routed_experts", canonical, note)
    # the scatter back run as gathers in token order where spelled as transformers does
    # (or reshaped, sum(-2)), whatever happened to the experts; never for the look-alikes
    taken = [r.status == "rewritten" for r in fast.report.records
             if r.pattern == "scatter_back"]
    assert taken == ([True] if case["scatter"] in ("inverse", "reshape") else
                     [False] if case["scatter"] == "strided" else []), case
    for o, w in zip(got, want):
        assert o.shape == w.shape and o.dtype == w.dtype
    draws = [(got, want, truth)]
    with torch.no_grad():
        for _ in range(max(0, -(-min_tokens // case["tokens"]) - 1)):
            hi = torch.randn(case["tokens"], H)
            draws.append(tuple(t if isinstance(t, tuple) else (t,) for t in (
                fast(hi.bfloat16()), ref(hi.bfloat16()), exact(hi.double()))))
    for j in range(len(got)):
        pool = [torch.cat([d[i][j].double().reshape(-1) for d in draws]) for i in range(3)]
        assert rel_err(pool[0], pool[2]) <= 1.25 * rel_err(pool[1], pool[2]) + 1e-6, case
    if not case["train"]:
        return
    sum(o.float().sum() for o in got).backward()
    sum(w.float().sum() for w in want).backward()
    pairs = [(xs[0].grad, xs[1].grad)] + [(p.grad, q.grad) for p, q in zip(
        model.parameters(), ref.parameters())]
    for a, b in pairs:  # bf16 gradients: a loose bound a wrong rule still breaks
        assert (a is None) == (b is None) and (a is None or rel_err(a, b) <= grad_tol), case


@seed(20261202)
@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_generated_expert_layers_match_eager(case):
    _run(case)


# ---- gpt-oss's spelling ------------------------------------------------------------------

class OaiExperts(nn.Module):
    """gpt-oss's experts as transformers' grouped_mm path writes them ([E, K, N] weights,
    each expert's bias gathered by the sorted ids and added, interleaved lanes, the
    clamped SwiGLU), each piece drawn from its spellings and look-alikes."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        e = case["experts"]
        kn = case["layout"] == "kn"
        self.router = nn.Parameter(torch.randn(e, H) * case["router_scale"])
        self.gate_up = nn.Parameter(torch.randn(*((e, H, 2 * I) if kn else (e, 2 * I, H)))
                                    / H ** 0.5)
        self.down = nn.Parameter(torch.randn(*((e, I, H) if kn else (e, H, I))) / I ** 0.5)
        self.b_gu = nn.Parameter(torch.randn(e, 2 * I) * 0.5)
        self.b_d = nn.Parameter(torch.randn(e, H) * 0.5)

    def _bias(self, p, table, ids):
        c = self.case
        if c["bias"] == "none":
            return p
        b = table[ids]
        if c["bias"] == "in_place":
            p.add_(b)
            return p
        return b + p if c["bias"] == "left" else p + b

    def forward(self, h):
        c, e, k, lim = self.case, self.case["experts"], self.case["top_k"], self.case["limit"]
        logits = F.linear(h, self.router)
        top_v, top_i = torch.topk(logits, k, dim=-1)
        w = F.softmax(top_v, dim=1, dtype=top_v.dtype).reshape(-1)
        ids = top_i.reshape(-1)
        ids_g, perm = torch.sort(ids)
        x = h[perm // k]
        w_g = w[perm]
        counted = ids_g.double() if c["count_cast"] == "double" else ids_g.float()
        offs = torch.cumsum(torch.histc(counted, bins=e, min=0, max=e - 1), dim=0,
                            dtype=torch.int32)
        mask = (ids_g >= c["sentinel_from"]).unsqueeze(-1)
        if c["ids"] == "clamped":
            ids_g.clamp_(max=e - 1)
        elif c["ids"] == "clamped_lower" and e > 1:  # changes the last expert's ids
            ids_g.clamp_(max=e - 2)
        x.masked_fill_(mask, 0.0)
        kn = c["layout"] == "kn"
        p = _gmm(x, self.gate_up if kn else self.gate_up.transpose(-2, -1), offs)
        p = self._bias(p, self.b_gu, ids if c["ids"] == "unsorted" else ids_g)
        p = p.masked_fill(mask, 0.0)
        gate, up = (p[..., ::2], p[..., 1::2]) if c["lanes"] == "ellipsis" else \
            (p[:, 0::2], p[:, 1::2])
        if c["act"] == "odd_gate":
            gate, up = up, gate
        g = gate.clamp(min=-lim if c["act"] == "gate_both_sides" else None, max=lim)
        u = up.clamp(min=-lim, max=lim)
        sig = torch.sigmoid((gate if c["act"] == "sigmoid_raw" else g) * c["alpha"])
        glu = g * sig if c["order"] == "g*sig" else sig * g
        shifted = u + (2 if c["act"] == "shift_two" else 1)
        y = shifted * glu if c["order"] == "g*sig" else glu * shifted
        extra = {"glu": glu, "gate_up": p}.get(c["reader"])
        o = _gmm(y, self.down if kn else self.down.transpose(-2, -1), offs)
        o = self._bias(o, self.b_d, ids_g)
        o = o.masked_fill(mask, 0.0) * w_g.unsqueeze(-1)
        out = _scatter_back(o, perm, h.shape[0], k, c["scatter"])
        return out if extra is None else (out, extra)


oai_cases = st.fixed_dictionaries({
    "experts": st.integers(1, 6),
    "top_k": st.integers(1, 3),
    "tokens": st.sampled_from([1, 3, 8, 13]),
    "router_scale": st.sampled_from([0.0, 1.0, 8.0]),
    "sentinel_from": st.sampled_from([99, 2]),
    "limit": st.sampled_from([0.4, 1.0, 7.0]),      # 0.4: both clamps bite often
    "alpha": st.sampled_from([1.702, 1.0]),
    "layout": _mostly("kn", st.just("nk")),
    "lanes": st.sampled_from(["ellipsis", "slices"]),
    "bias": _mostly("in_place", st.sampled_from(["none", "right", "left"])),
    "ids": _mostly("clamped", st.sampled_from(["unclamped", "unsorted", "clamped_lower"])),
    "count_cast": st.sampled_from(["float", "double"]),
    "act": _mostly("oai", st.sampled_from(["odd_gate", "gate_both_sides", "sigmoid_raw",
                                           "shift_two"])),
    "order": st.sampled_from(["g*sig", "sig*g"]),
    "reader": _mostly("none", st.sampled_from(["glu", "gate_up"])),
    "train": st.booleans(),
    "scatter": _mostly("inverse", st.sampled_from(["argsort", "strided", "reshape"])),
})


def _oai_canonical(case) -> bool:
    wrong_ids = case["ids"] == "unsorted" or (case["ids"] == "clamped_lower"
                                              and case["experts"] > 1)
    return case["act"] == "oai" and case["reader"] == "none" and \
        not (case["bias"] != "none" and wrong_ids)


def _run_oai(case, note=event):
    # pooled over 64 tokens: a pre-activation whose rounding crosses a clamp is one
    # small draw's whole error
    _check(OaiExperts, case, _oai_canonical(case), note, min_tokens=64, grad_tol=1e-1)


@seed(20261203)
@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(oai_cases)
def test_generated_gpt_oss_expert_layers_match_eager(case):
    _run_oai(case)
