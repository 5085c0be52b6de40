"""An adversary in the suite: hypothesis generates the region between a GEMM, the residual
add, an RMSNorm and the consumer GEMM (shifts, scales, casts, row slices, reshapes, rolls,
activations, biases, second readers, in-place updates; float32 and bfloat16), and checks
that the rewritten model computes what eager computes, under the numerics policy of
../shared/DESIGN.md, and that every match left as is carries a reason.

Seed 20261201 (100 examples), run against the code before the reliability fixes
(9ddf413), found by itself:
- a bfloat16 round trip between the norm and the GEMM of a float32 model
  (chain ['bf16 round trip']): rel. error 1.6e-3 against eager (limit 1e-5); and, with
  the round trips left out of the draw (hypothesis reports one failing assertion at a
  time),
- a shift after the norm of ``x + a(x)`` (producer, HF norm, chain ['+v']) dropped by the
  consumer's program, with PROVED in the report: rel. error 0.59.
It passes on the fixed code. test_found_counterexamples keeps them as fixed cases; the
module docstring of tests/test_reliability.py gives the root causes.

Seed 11 (300 examples, 2026-12-01) found the bf16 round trip of a bfloat16 model (an
identity there) refused as a witness disagreement (the float64 replay rounded at the
cast; fixed in algebra/witness._identity_cast, see tests/test_property_gated.py) and,
once rewritten, measured against a float64 copy that rounded there too: the float64 copy
now keeps the model's identity an identity.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import coda_rewrite
from coda_rewrite.numerics import rel_err

D, N_OUT, ROWS = 32, 48, (4, 24)

# Ops between the norm's output h and the consumer GEMM. Each is (name, fn(module, h)).
CHAIN_OPS = {
    "+v": lambda s, h: h + s.v,
    "v+": lambda s, h: s.v + h,
    "-v": lambda s, h: h - s.v,
    "+c": lambda s, h: h + 0.75,
    "-c": lambda s, h: h - 0.5,
    "c+": lambda s, h: 1.0 + h,
    "c-": lambda s, h: 1.0 - h,
    "+buf": lambda s, h: h + s.buf,
    "*g": lambda s, h: h * s.g,
    "g*": lambda s, h: s.g * h,
    "*c": lambda s, h: h * 1.5,
    "/c": lambda s, h: h / 3.0,
    # an identity in a bfloat16 model, and so in its float64 copy (the truth the bf16
    # numerics are measured against): there it would round where the model does not
    "bf16 round trip": lambda s, h: h if h.dtype == torch.float64 and
    s.case["dtype"] == torch.bfloat16 else h.to(torch.bfloat16).to(h.dtype),
    "fp16 round trip": lambda s, h: h.half().to(h.dtype),
    "to fp32 and back": lambda s, h: h.float().to(h.dtype),
    "rows 1:": lambda s, h: h[:, 1:],
    "last row": lambda s, h: h[:, -1:],
    "flatten rows": lambda s, h: h.reshape(-1, h.shape[-1]),
    "roll rows": lambda s, h: torch.roll(h, 1, dims=1),
    "roll features": lambda s, h: torch.roll(h, 1, dims=-1),
    "features 1:": lambda s, h: F.pad(h[..., 1:], (0, 1)),
    "relu": lambda s, h: torch.relu(h),
    "silu": lambda s, h: F.silu(h),
    "*row": lambda s, h: h * h.mean(-1, keepdim=True),
    "transpose": lambda s, h: h.transpose(-1, -2).contiguous().transpose(-1, -2),
    "contiguous": lambda s, h: h.contiguous(),
}

NORMS = ("hf", "nn.RMSNorm", "F.rms_norm", "hf unweighted", "gemma 1+w")


class Region(nn.Module):
    """[x + a(x) | x] → norm → chain → b(·), optionally with a second reader of the
    chain's value and an in-place update of the norm's output."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.a = nn.Linear(D, D, bias=case["a_bias"])
        self.b = nn.Linear(D, N_OUT, bias=case["b_bias"])
        self.norm_w = nn.Parameter(torch.rand(D) + 0.5)
        self.v = nn.Parameter(torch.randn(D))
        self.g = nn.Parameter(torch.rand(D) + 0.5)
        self.register_buffer("buf", torch.randn(D))
        self.rms = nn.RMSNorm(D, eps=1e-6)
        with torch.no_grad():
            self.rms.weight.uniform_(0.5, 1.5)

    def norm(self, z):
        kind = self.case["norm"]
        if kind == "nn.RMSNorm":
            return self.rms(z)
        if kind == "F.rms_norm":
            return F.rms_norm(z, (D,), self.norm_w, 1e-6)
        dtype = z.dtype
        x = z.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if kind == "hf unweighted":
            return x.to(dtype)
        if kind == "gemma 1+w":
            return (x * (1.0 + self.norm_w.float())).to(dtype)
        return self.norm_w * x.to(dtype)

    def forward(self, x):
        z = x + self.a(x) if self.case["producer"] else x
        h = self.norm(z)
        if self.case["inplace"]:
            h.mul_(2.0)
        for op in self.case["chain"]:
            h = CHAIN_OPS[op](self, h)
        out = self.b(h)
        return (out, h) if self.case["second_reader"] else out


# Ops the algebra has a rule for (move r with the rows, fold, distribute, cast) are drawn
# twice as often as the ones it must refuse: a chain is rewritten only if all of its ops
# have a rule, and a rewrite is where a wrong result can come from.
HAS_RULE = ("+v", "v+", "-v", "+c", "-c", "c+", "+buf", "*g", "g*", "*c", "bf16 round trip",
            "fp16 round trip", "to fp32 and back", "rows 1:", "last row", "flatten rows",
            "roll rows", "contiguous")
NO_RULE = tuple(sorted(set(CHAIN_OPS) - set(HAS_RULE)))

cases = st.fixed_dictionaries({
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
    "producer": st.booleans(),
    "a_bias": st.booleans(),
    "b_bias": st.booleans(),
    "norm": st.sampled_from(NORMS),
    "chain": st.lists(st.one_of(st.sampled_from(HAS_RULE), st.sampled_from(HAS_RULE),
                                st.sampled_from(NO_RULE)), max_size=3),
    "second_reader": st.booleans(),
    "inplace": st.sampled_from([False, False, False, True]),
})


def _outputs(model, x):
    out = model(x)
    return out if isinstance(out, tuple) else (out,)


def _run(case):
    torch._dynamo.reset()  # each example is a new model of one class: no recompile limit
    torch.manual_seed(0)
    model = Region(case).to(case["dtype"])
    exact = copy.deepcopy(model).double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*ROWS, D, generator=g).to(case["dtype"])
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        try:
            want = _outputs(ref, x)
        except RuntimeError as e:  # eager rejects it: so must the rewritten model
            with pytest.raises(RuntimeError):
                _outputs(fast, x)
            return None, e
        got = _outputs(fast, x)
        truth = _outputs(exact, x.double())
    for a, b, t in zip(got, want, truth):
        assert a.dtype == b.dtype and a.shape == b.shape
        if case["dtype"] == torch.float32:
            assert rel_err(a, b) <= 1e-5, (rel_err(a, b), str(fast.report))
        else:  # no worse than eager against float64 (one draw: 1.5x, not the median's 1.25x)
            ours, eagers = rel_err(a, t), rel_err(b, t)
            assert ours <= 1.5 * eagers, (ours, eagers, str(fast.report))
    for r in fast.report.records:
        if r.status != "rewritten":
            assert r.reason, f"{r.pattern} at {r.path} left as is without a reason"
    return fast.report, None


@seed(20261201)
@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_generated_regions_match_eager(case):
    report, raised = _run(case)
    event("eager raises" if raised else f"{report.count()} norm(s) rewritten")


@pytest.mark.parametrize("case", [
    # the counterexamples the property found on the code before the fixes
    dict(dtype=torch.float32, producer=True, a_bias=False, b_bias=False, norm="hf",
         chain=["+v"], second_reader=False, inplace=False),
    dict(dtype=torch.float32, producer=False, a_bias=False, b_bias=True, norm="hf",
         chain=["-c"], second_reader=False, inplace=False),
    dict(dtype=torch.float32, producer=True, a_bias=False, b_bias=False, norm="nn.RMSNorm",
         chain=["bf16 round trip"], second_reader=False, inplace=False),
], ids=["shift by a parameter", "shift by a constant", "bf16 round trip in fp32"])
def test_found_counterexamples(case):
    _run(case)
