"""An adversary for the dense-experts rewrite (patterns/dense_experts.py): hypothesis draws
the dense MoE layer as people spell it and its look-alikes — the router's fill and the
elementwise chain after the scatter, the transpose and operand orders, the activation,
the sum, second readers — and checks outputs and gradients against eager, that every
legal spelling is rewritten and every other is left with a reason."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import coda_rewrite
from coda_rewrite.numerics import rel_err

# (fill, chain): whether the scores are zero off the top-k
ROUTERS = {("-inf", "sigmoid"): True, ("-inf", "exp"): True, ("zero", "none"): True,
           ("zero", "sigmoid"): False, ("-inf", "softmax"): False, ("logits", "sigmoid"): False}
TRANSPOSES = ("t", "transpose", "T", "permute")


class Layer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        e, h, i = d["experts"], 12, 6
        g = torch.Generator().manual_seed(d["seed"])
        self.router = torch.nn.Parameter(torch.randn(e, h, generator=g) / h ** 0.5)
        self.w_gu = torch.nn.Parameter(torch.randn(e, h, 2 * i, generator=g) / h ** 0.5)
        self.w_d = torch.nn.Parameter(torch.randn(e, i, h, generator=g) / i ** 0.5)

    def scores(self, x):
        d = self.d
        logits = F.linear(x, self.router)
        top, idx = torch.topk(logits, d["top_k"], dim=1)
        fill, chain = d["router"]
        base = {"-inf": torch.full_like(logits, float("-inf")),
                "zero": torch.zeros_like(logits), "logits": logits.clone()}[fill]
        z = base.scatter_(1, idx, top if chain != "none" else torch.softmax(top, -1))
        if chain == "sigmoid":
            return torch.sigmoid(z.float()).to(x.dtype)
        if chain == "exp":
            return torch.exp(z)
        if chain == "softmax":
            return torch.softmax(z, dim=-1)
        return z

    def forward(self, x):
        d = self.d
        e = d["experts"]
        s = self.scores(x)
        st = {"t": lambda: s.t(), "transpose": lambda: s.transpose(0, 1),
              "T": lambda: s.T, "permute": lambda: s.permute(1, 0)}[d["transpose"]]()
        col, rep = st.reshape(-1, 1), x.repeat(e, 1)
        rows = rep * col if d["rows_first"] else col * rep
        gate, up = torch.bmm(rows.view(e, -1, x.shape[-1]), self.w_gu).chunk(2, dim=-1)
        act = F.silu(gate) if d["act"] == "silu" else F.gelu(gate, approximate=d["act"])
        prod = act * up if d["act_first"] else up * act
        out = torch.bmm(prod, self.w_d)
        total = out.sum(dim=0) if d["sum"] == "method" else torch.sum(out, 0)
        if d["second"] == "product":
            return total, prod.sum()
        if d["second"] == "gate_up":
            return total, gate.mean()
        return total


LAYERS = st.fixed_dictionaries({
    "experts": st.integers(2, 5), "top_k": st.integers(1, 5), "seed": st.integers(0, 99),
    "router": st.sampled_from(sorted(ROUTERS)), "transpose": st.sampled_from(TRANSPOSES),
    "rows_first": st.booleans(), "act": st.sampled_from(["silu", "tanh", "none"]),
    "act_first": st.booleans(), "sum": st.sampled_from(["method", "function"]),
    "second": st.sampled_from(["none", "none", "product", "gate_up"]),
    "dtype": st.sampled_from([torch.float64, torch.float32]), "training": st.booleans(),
    "tokens": st.integers(2, 9)})


@seed(20261202)
@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(LAYERS)
def test_dense_experts_adversary(d):
    d = dict(d, top_k=min(d["top_k"], d["experts"]))
    layer = Layer(d).to(d["dtype"])
    x = torch.randn(d["tokens"], 12, dtype=d["dtype"], requires_grad=d["training"])
    fast_layer = copy.deepcopy(layer)
    fast = coda_rewrite.optimize(fast_layer, patterns=("dense_experts",))
    with torch.set_grad_enabled(d["training"]):
        got, want = fast(x), layer(x)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    tol = 1e-10 if d["dtype"] == torch.float64 else 1e-5
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    if d["training"]:
        loss = [sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum()
                    for o in outs) for outs in (got, want)]
        g1 = torch.autograd.grad(loss[0], [x, *fast_layer.parameters()], allow_unused=True)
        g0 = torch.autograd.grad(loss[1], [x, *layer.parameters()], allow_unused=True)
        for a, b in zip(g1, g0):
            assert (a is None) == (b is None)
            if a is not None:
                assert rel_err(a, b) <= tol
    records = [r for r in fast.report.records if r.pattern == "dense_experts"]
    legal = ROUTERS[d["router"]] and d["second"] == "none"
    assert len(records) == 1, str(fast.report)
    assert (records[0].status == "rewritten") == legal, (d, str(fast.report))
    if not legal:  # the scores' condition, or the reader the routed form never writes
        assert records[0].code in ("moe.dense_scores", "moe.dense_intermediate_read",
                                   "moe.intermediate_read"), str(fast.report)
