"""FP8 gated MLP (options.fp8; patterns/fp8_mlp.py, kernels/fp8.py, algebra/fp8.py).

On the CPU both GEMMs run the reference interpreter on e4m3 values (products of two e4m3
values are exact in float32, as in the kernel), so these tests check the numerics the
GPU kernels must reproduce (tests/gpu), the bound that keeps every scaled value inside
e4m3's range, the look-alikes the family must leave to the bf16 rewrites, and that the
kept FP8 weights follow the parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import coda_rewrite
from coda_rewrite.algebra.fp8 import rowwise
from coda_rewrite.codegen import reference
from coda_rewrite.codegen import fp8
from coda_rewrite.kernels import ops
from coda_rewrite.kernels import fp8 as fp8_ops
from coda_rewrite.numerics import rel_err
from conftest import codes, hf_model, plain_llama, tokens

bf = torch.bfloat16


def fp8_records(report, status="rewritten"):
    return [r for r in report.records if r.pattern == "fp8_mlp" and r.status == status]


def rowwise_mlps(model, projections):
    """``model`` with torchao's row-wise FP8 recipe emulated on each MLP's projections
    (``projections(layer)``: gate, up, down): the numerics bar of README's "FP8"."""
    emu = copy.deepcopy(model)
    for layer in projections(emu):
        for lin in layer:
            lin.forward = (lambda x, lin=lin: rowwise(
                x.reshape(-1, x.shape[-1]).double(), lin.weight.double()
            ).reshape(*x.shape[:-1], -1).to(x.dtype))
    return emu


def hf_projections(m):
    return [(l.mlp.gate_proj, l.mlp.up_proj, l.mlp.down_proj) for l in m.model.layers]


# Helium: its norm multiplies γ in float32 and ends in a cast to the model dtype
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "helium"])
def test_hf_mlps_run_in_fp8_no_worse_than_torchaos_rowwise(family):
    model = hf_model(family, layers=2, hidden=128, dtype=bf).eval()
    ids = tokens(seq=32)
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(ids).logits
        eager = model(ids).logits
        before = dict(ops.RUNTIME)
        fast = coda_rewrite.optimize(model, fp8=True)
        got = fast(ids).logits
        emulated = rowwise_mlps(model, hf_projections)(ids).logits
    assert len(fp8_records(fast.report)) == 2, str(fast.report)
    ran = {k[0].split("#")[0] for k, v in ops.RUNTIME.items() if before.get(k) != v}
    op = "geglu" if family == "gemma" else "swiglu"
    assert {f"fp8_{op}", "fp8_scaled"} <= ran, ran
    err, bar, base = rel_err(got, truth), rel_err(emulated, truth), rel_err(eager, truth)
    assert err <= 1.5 * bar, (err, bar, base)
    assert base < err  # it is FP8: were it bf16's error, the FP8 path would not have run


def test_the_norm_family_keeps_the_attention_norm_and_the_gated_family_gets_nothing():
    model = hf_model("llama", layers=2, hidden=128, dtype=bf).eval()
    report = coda_rewrite.explain(model, tokens(), fp8=True)
    assert len(fp8_records(report)) == 2
    assert not [r for r in report.records if r.pattern == "gated_mlp"]
    # the attention norms and the final norm still defer their rstd (bf16)
    assert report.count(pattern="residual_rmsnorm_gemm") == 3, str(report)
    text = str(report)
    assert "448/√128" in text and "Cauchy–Schwarz" in text and "torchao row-wise" in text


def test_off_by_default_and_not_even_matched():
    report = coda_rewrite.explain(hf_model("llama").to(bf).eval(), tokens())
    assert not [r for r in report.records if r.pattern == "fp8_mlp"]


def test_plain_llama_under_the_backend_matches_optimize():
    """Inductor fuses the quantisation into the norm's kernel; both paths run the same
    math (the reference on the CPU)."""
    model = plain_llama(dim=128).to(bf).eval()
    ids = tokens()
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(ids)
        a = coda_rewrite.optimize(model, fp8=True)(ids)
        b = torch.compile(model, backend=coda_rewrite.CodaBackend(
            coda_rewrite.Options(fp8=True)))(ids)
        emulated = rowwise_mlps(model, lambda m: [
            (l.feed_forward.w1, l.feed_forward.w3, l.feed_forward.w2) for l in m.layers])(ids)
    bar = rel_err(emulated, truth)
    assert rel_err(a, truth) <= 1.5 * bar and rel_err(b, truth) <= 1.5 * bar
    assert rel_err(a, b) <= 0.02


def test_packed_gate_up():
    """Phi-3's one gate_up_proj, chunked in two: the same policy as two projections
    (torchao's recipe scales each output row alone, so emulating it on the packed
    projection is emulating it on both halves)."""
    model = hf_model("phi3", layers=1, hidden=128, dtype=bf).eval()
    ids = tokens()
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(ids).logits
        fast = coda_rewrite.optimize(model, fp8=True)
        got = fast(ids).logits
        emulated = rowwise_mlps(model, lambda m: [
            (l.mlp.gate_up_proj, l.mlp.down_proj) for l in m.model.layers])(ids).logits
    assert len(fp8_records(fast.report)) == 1, str(fast.report)
    assert rel_err(got, truth) <= 1.5 * rel_err(emulated, truth), \
        (rel_err(got, truth), rel_err(emulated, truth))


def test_weights_follow_the_parameters():
    """The kept FP8 weights are recomputed when a source changes in place (an optimizer
    step, copy_): the output follows the new weights, never the kept ones."""
    model = hf_model("llama", layers=1, hidden=128, dtype=bf).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model, fp8=True)
    with torch.no_grad():
        first = fast(ids).logits
        again = fast(ids).logits
        assert torch.equal(first, again)
        for p in (model.model.layers[0].mlp.down_proj.weight,
                  model.model.layers[0].post_attention_layernorm.weight):
            old = copy.deepcopy(model).double()(ids).logits
            p.mul_(3.0)
            new = copy.deepcopy(model).double()(ids).logits
            got = fast(ids).logits
            assert rel_err(got, new) <= 0.1 and rel_err(got, new) < rel_err(got, old) / 3, \
                (rel_err(got, new), rel_err(got, old))


class Mlp(nn.Module):
    """RMSNorm → gated MLP with the look-alike knobs the family must refuse."""

    def __init__(self, d=64, i=96, bias=False, act="silu", between=False, second=False):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.gate, self.up = nn.Linear(d, i, bias=bias), nn.Linear(d, i, bias=bias)
        self.down = nn.Linear(i, d, bias=False)
        self.act, self.between, self.second = act, between, second

    def forward(self, x):
        h = self.norm(x)
        if self.between:  # a scale after the norm: the input is no longer the norm's row
            h = h * 2.0
        g = self.gate(h)
        a = {"silu": F.silu, "relu": F.relu}[self.act](g)
        p = a * self.up(h)
        out = x + self.down(p)
        return (out, p.sum()) if self.second else out


@pytest.mark.parametrize("knobs,code", [
    (dict(bias=True), "fp8.bias"),
    (dict(between=True), "fp8.input_not_normalised"),
    (dict(second=True), "fp8.no_down_projection"),
])
def test_look_alikes_are_left_to_bf16_with_the_reason(knobs, code):
    model = Mlp(**knobs).to(bf).eval()
    x = torch.randn(2, 8, 64, dtype=bf)
    with torch.no_grad():
        fast = coda_rewrite.optimize(model, fp8=True)
        got, want = fast(x), model(x)
    assert codes(fast.report, "fp8_mlp") == {code}, str(fast.report)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want):  # the bf16 rewrites: eager's numbers (bf16 rounding)
        assert rel_err(a, b) <= 2e-2


def test_relu_gate_is_not_a_pair_the_gated_matcher_knows():
    """relu·up is no pair op the gated family has: nothing to take, nothing reported as
    FP8, eager's numbers."""
    model = Mlp(act="relu").to(bf).eval()
    x = torch.randn(2, 8, 64, dtype=bf)
    with torch.no_grad():
        fast = coda_rewrite.optimize(model, fp8=True)
        assert rel_err(fast(x), model(x)) <= 1e-2
    assert not fp8_records(fast.report)


def test_training_graphs_run_the_bf16_rewrites():
    model = hf_model("llama", layers=1, hidden=64).train()
    ref = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model, fp8=True)
    loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert codes(fast.report, "fp8_mlp") == {"fp8.training"}, str(fast.report)
    assert [r for r in fast.report.records if r.pattern == "gated_mlp"
            and r.status == "rewritten"], str(fast.report)


def test_the_ops_refuse_gradients():
    w = [torch.randn(32, 16, requires_grad=True), torch.randn(32, 16), torch.randn(16, 32)]
    q = fp8.saturate(torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        fp8_ops.fp8_gate_up(fp8.gate_up_program("swiglu").to_text(), q, w, False, False, 0.0, 16)


# ---- the bound ---------------------------------------------------------------------------

def _scaled_product(z, wg, wu, wd, gamma=None, offset=0.0, op="swiglu"):
    width = z.shape[-1]
    q = fp8.quantize_normalized(z, 1e-6, width)
    w_int, ws_int, w_d, ws_d = fp8.mlp_weights(wg, wu, wd, gamma, offset, width)
    (act,) = reference.run_program(fp8.gate_up_program(op), q, w_int, [ws_int])
    out = reference.run_program(fp8.down_program(torch.float32), fp8.saturate(act), w_d,
                                [ws_d])[0]
    return act.float(), out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), width=st.sampled_from([16, 64, 256]),
       scale=st.floats(1e-3, 1e3), spike=st.floats(0, 1e4),
       op=st.sampled_from(["swiglu", "geglu", "geglu_erf"]))
def test_no_scaled_product_leaves_e4m3s_range(seed, width, scale, spike, op):
    """Rows that put their mass anywhere (one feature, a constant, zero, huge or tiny
    magnitudes) and weights with outlier rows aligned to them: the bf16 product the
    gate/up GEMM writes is within ±448 before the saturating cast, and finite."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, width, generator=g) * scale
    z[0] = 0
    z[0, 1] = spike or 1.0                     # all mass on one feature
    z[1] = scale                               # a constant row
    z[2] = 0                                   # a zero row
    wg, wu = torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)
    wg[0] = wu[0] = 0
    wg[0, 1], wu[0, 1] = 3.0, -2.0             # aligned with row 0: at the bound
    wg[1], wu[1] = 1.0, 1.0                    # aligned with the constant row
    wu[2] = 0                                  # a zero up row: c_j = 1, exact zeros
    wd = torch.randn(5, 8, generator=g)
    gamma = torch.rand(width, generator=g) * 4 + 0.01
    act, out = _scaled_product(z, wg, wu, wd, gamma, 0.0, op)
    assert act.abs().max() <= fp8.E4M3_MAX
    assert torch.isfinite(out).all()
    assert (act[2] == 0).all() and (act[:, 2] == 0).all()


def test_the_aligned_row_comes_close_to_the_bound_and_the_result_is_right():
    """The bound is not vacuous: an input aligned with a weight row reaches a sizeable
    part of 448, and the result still matches float64 within FP8's error."""
    z = torch.zeros(1, 64)
    z[0, 5] = 1.0
    wg, wu = torch.zeros(4, 64), torch.zeros(4, 64)
    wg[:, 5], wu[:, 5] = 2.0, 3.0
    wd = torch.eye(4)
    act, out = _scaled_product(z, wg, wu, wd)
    assert act.abs().max() >= 100  # within 4.5x of 448 at the worst case
    n = 8.0  # |n_5| = √64 for a one-hot row
    want = F.silu(torch.tensor(2 * n)) * 3 * n
    assert abs(out[0, 0] - want) <= 0.07 * want


def test_weight_quantisation_is_per_row_and_exact_for_zero_rows():
    w = torch.randn(5, 32)
    w[3] = 0
    w[1] *= 1e4
    q, s = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5,)
    assert (q.float().abs().amax(-1)[[0, 1, 2, 4]] == fp8.E4M3_MAX).all()
    assert (fp8.dequantize(q, s)[3] == 0).all()
    assert rel_err(fp8.dequantize(q, s), w) <= 0.05
