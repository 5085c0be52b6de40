"""The gated MLP's backward in its down projection's dgrad GEMM (kernels/gated_down.py,
kernels/dgated.py): where it is taken (training graphs, the product read only by a plain
down projection), where not and why, gradients against eager on every path (optimize(),
the backend through AOTAutograd and Inductor, autocast), the float64 reference against
autograd, the witness failing closed, and the statement catching a wrong derivative."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, seed, settings
from hypothesis import strategies as st
import torch.nn as nn
import torch.nn.functional as F

import coda_rewrite
from coda_rewrite.algebra import statements
from coda_rewrite.codegen import reference
from coda_rewrite.kernels import dgated, ops
from coda_rewrite.kernels.gated_down import GatedDown
from coda_rewrite.numerics import rel_err

from conftest import build, tokens

# the families without the norm producer: their down projections stay plain GEMMs
NO_NORM = ("attention_inputs", "gated_mlp", "rope", "lm_head_cross_entropy")
OPS = {"llama": "swiglu", "gemma": "geglu", "phi3": "swiglu", "qwen2": "swiglu"}


def down_notes(report):
    """(label, decision) of every gated match's note on its down projection."""
    return [n for r in report.records if r.pattern == "gated_mlp" for n in r.notes]


def dgated_calls(op: str) -> int:
    return sum(n for (key, _, _), n in ops.runtime_counts().items() if key == f"dgated_{op}")


def grads_close(model, ref, tol):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, name
        assert rel_err(p.grad, q.grad) <= tol, (name, rel_err(p.grad, q.grad))


@pytest.mark.parametrize("family", OPS)
@pytest.mark.parametrize("via", ["optimize", "backend"])
def test_down_projection_backward_fused_and_exact(family, via):
    """Every layer's down projection takes the fused backward: the report proves it per
    match (statement, float64 gradient replay), the dgrad op runs once per layer and
    step, and the loss and every gradient match eager's in float32."""
    torch.manual_seed(0)
    model = build(family, layers=2).train()
    ref = copy.deepcopy(model)
    ids = tokens()
    options = dict(fuse_in_training=True, patterns=NO_NORM)
    if via == "optimize":
        fast = coda_rewrite.optimize(model, **options)
        report = fast.report
    else:
        torch._dynamo.reset()
        backend = coda_rewrite.CodaBackend(coda_rewrite.Options(**options))
        fast, report = torch.compile(model, backend=backend), backend.report
    before = dgated_calls(OPS[family])
    loss = fast(ids, labels=ids).loss
    want = ref(ids, labels=ids).loss
    loss.backward()
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    grads_close(model, ref, 1e-5)
    notes = down_notes(report)
    assert len(notes) == 2 and all(d.accepted for _, d in notes), str(report)
    assert all("witness replay in float64" in d.render() and "gradients of gate, up, W_d"
               in d.render() for _, d in notes)
    assert dgated_calls(OPS[family]) - before == 2, ops.runtime_summary()


class GatedMLP(nn.Module):
    """A gated MLP spelled by hand: exact GELU, a biased down projection, and variants
    whose down projection is not the product's only reader."""

    def __init__(self, kind: str = "plain", d: int = 16, i: int = 24):
        super().__init__()
        self.kind = kind
        self.gate, self.up = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down = nn.Linear(i, d, bias=kind in ("bias", "erf_bias"))

    def forward(self, x):
        act = F.gelu if self.kind == "erf_bias" else F.silu
        h = act(self.gate(x)) * self.up(x)
        if self.kind == "returns_h":
            return self.down(h), h
        if self.kind == "in_place":
            h.mul_(2.0)
        if self.kind == "two_readers":
            return self.down(h) + h.sum(-1, keepdim=True)
        if self.kind == "matmul":
            return h @ self.down.weight.T
        return self.down(h)


@pytest.mark.parametrize("kind,op", [("plain", "swiglu"), ("bias", "swiglu"),
                                     ("erf_bias", "geglu_erf"), ("matmul", "swiglu")])
def test_spellings_take_the_fused_backward(kind, op):
    torch.manual_seed(0)
    mlp = GatedMLP(kind).train()
    ref = copy.deepcopy(mlp)
    x = torch.randn(2, 5, 16)
    fast = coda_rewrite.optimize(mlp, fuse_in_training=True)
    before = dgated_calls(op)
    out, want = fast(x), ref(x)
    assert rel_err(out, want) <= 1e-6
    out.square().sum().backward()
    want.square().sum().backward()
    grads_close(mlp, ref, 1e-5)
    (note,) = down_notes(fast.report)
    assert note[1].accepted, str(fast.report)
    assert dgated_calls(op) - before == 1


@pytest.mark.parametrize("kind,code", [("returns_h", "gated.no_down_projection"),
                                       ("in_place", "gated.no_down_projection"),
                                       ("two_readers", "gated.no_down_projection")])
def test_other_readers_keep_the_backward_as_graph_ops(kind, code):
    """The fused backward hands the product's whole gradient to the pre-activation: a
    second reader (an output, an in-place update, another op) keeps the down projection
    as it is, with the reason; the gated forward is still fused, gradients still exact."""
    torch.manual_seed(0)
    mlp = GatedMLP(kind).train()
    ref = copy.deepcopy(mlp)
    x = torch.randn(2, 5, 16)
    fast = coda_rewrite.optimize(mlp, fuse_in_training=True)
    before = dgated_calls("swiglu")
    out, want = fast(x), ref(x)
    out, want = (out[0], want[0]) if isinstance(out, tuple) else (out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    grads_close(mlp, ref, 1e-5)
    notes = down_notes(fast.report)
    if kind != "in_place":  # an in-place update of h may also leave the gated match
        assert [r.status for r in fast.report.records if r.pattern == "gated_mlp"] == \
            ["rewritten"], str(fast.report)
    assert all(not d.accepted and d.code == code for _, d in notes), str(fast.report)
    assert dgated_calls("swiglu") == before


def test_not_in_inference_nor_when_asked_and_the_norm_leaves_the_down_projection():
    """Inference graphs have no backward (no note); backward_epilogues=False keeps the
    graph-op backward (the down projection is then the next norm's fused producer); with
    every family on, the down projection keeps the fused backward and the norm after it
    takes the row-wise program instead (row_scale.producer_left_to_gated: one GEMM cannot
    carry both), the step eager's."""
    model = build("llama", layers=1)
    ids = tokens()
    with torch.no_grad():
        report = coda_rewrite.explain(model.eval(), ids, patterns=NO_NORM)
    assert not down_notes(report)
    model.train()
    for options, code in ((dict(patterns=NO_NORM, backward_epilogues=False),
                           "gated.backward_epilogues_off"),
                          (dict(backward_epilogues=False), "gated.backward_epilogues_off"),
                          (dict(), "")):
        torch._dynamo.reset()
        ref = copy.deepcopy(model)
        fast = coda_rewrite.optimize(copy.deepcopy(model), fuse_in_training=True, **options)
        before = dgated_calls("swiglu")
        loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
        loss.backward()
        want.backward()
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
        grads_close(fast, ref, 1e-4)
        notes = down_notes(fast.report)
        assert notes and all(d.accepted if not code else d.code == code
                             for _, d in notes), str(fast.report)
        assert dgated_calls("swiglu") - before == (0 if code else 1)
        if "patterns" in options:
            continue
        # the final norm, after the down projection: its producer, or why it has none
        final = [r for r in fast.report.records if r.pattern == "residual_rmsnorm_gemm"][-1]
        left = "is a gated MLP's down projection" in final.producer
        assert left == (not code), final.producer
        assert final.programs[0].name == ("rmsnorm_rowscale" if left else "residual_rmsnorm")


def test_bf16_autocast_with_float32_weights():
    """Mixed precision (float32 parameters under bf16 autocast, as Trainer's bf16=True
    runs): the down projection's weight is cast for the GEMM like eager's autocast
    does, its gradient reaches the float32 parameter, and every gradient is no worse
    than eager's against float64 under the numerics policy (median ratio over three
    seeds ≤ 1.25; none past 1.5: small tensors, one seed each)."""
    import statistics
    ratios = []
    for s in range(3):
        torch.manual_seed(s)
        torch._dynamo.reset()
        mlp = GatedMLP("bias").train()
        ref = copy.deepcopy(mlp)
        exact = copy.deepcopy(mlp).double()
        x = torch.randn(4, 8, 16)
        fast = coda_rewrite.optimize(mlp, fuse_in_training=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, want = fast(x), ref(x)
        (note,) = down_notes(fast.report)
        assert note[1].accepted, str(fast.report)
        out.float().square().sum().backward()
        want.float().square().sum().backward()
        exact(x.double()).square().sum().backward()
        for p, q, e in zip(mlp.parameters(), ref.parameters(), exact.parameters()):
            assert p.grad.dtype == torch.float32
            ratios.append(rel_err(p.grad, e.grad) / rel_err(q.grad, e.grad))
    assert statistics.median(ratios) <= 1.25 and max(ratios) <= 1.5, ratios


# ---- the math ---------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["swiglu", "geglu", "geglu_erf"])
@pytest.mark.parametrize("bias", [False, True])
def test_function_matches_autograd_in_float64(op, bias):
    """GatedDown's backward (the dgrad op's reference) against autograd through eager's
    spelling, in float64; the gradient reaches p, none reaches y."""
    gen = torch.Generator().manual_seed(1)
    m, n, h = 9, 12, 7
    g, u = (torch.randn(m, n, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    w = torch.randn(h, n, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(h, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    act = {"swiglu": F.silu, "geglu": lambda t: F.gelu(t, approximate="tanh"),
           "geglu_erf": F.gelu}[op]
    dout = torch.randn(m, h, generator=gen, dtype=torch.float64)
    leaves = [g, u, w] + ([b] if bias else [])
    want = torch.autograd.grad(F.linear(act(g) * u, w, b), leaves, dout)
    p = torch.stack([g, u], -1).reshape(m, 2 * n).detach().requires_grad_(True)
    y = (act(g) * u).detach().requires_grad_(True)
    wd = w.detach().requires_grad_(True)
    bd = b.detach().requires_grad_(True) if bias else None
    out = GatedDown.apply(op, y, p, wd, bd)
    assert torch.equal(out, F.linear(y, wd, bd))
    got = torch.autograd.grad(out, [p, wd] + ([bd] if bias else []), dout, retain_graph=True)
    assert rel_err(got[0][:, 0::2], want[0]) <= 1e-12
    assert rel_err(got[0][:, 1::2], want[1]) <= 1e-12
    for x, ref in zip(got[1:], want[2:]):
        assert rel_err(x, ref) <= 1e-12
    assert torch.autograd.grad(out, y, dout, allow_unused=True)[0] is None


def test_reference_accumulates_like_the_kernel():
    """16-bit inputs: dh in float32 (the kernel's accumulator), each output rounded once;
    closer to float64 than rounding dh to bf16 first (eager's order)."""
    gen = torch.Generator().manual_seed(2)
    dout = torch.randn(64, 96, generator=gen).bfloat16()
    w = (torch.randn(96, 80, generator=gen) / 10).bfloat16()
    p = torch.randn(64, 160, generator=gen).bfloat16()
    dp, h = dgated.run_reference("swiglu", dout, w, p)
    assert dp.dtype == h.dtype == torch.bfloat16
    exact_dp, _ = reference.dgated("swiglu", dout.double() @ w.double(), p.double())
    eager_dp, _ = reference.dgated("swiglu", (dout @ w).double(), p.double())
    assert rel_err(dp.double(), exact_dp) <= rel_err(eager_dp.bfloat16().double(), exact_dp)


def test_cpu_tensors_run_the_reference_and_say_why():
    before = dict(ops.runtime_counts())
    t = torch.randn(8, 16, dtype=torch.bfloat16)
    torch.ops.coda.dgated("swiglu", t, torch.randn(16, 8, dtype=torch.bfloat16),
                          torch.randn(8, 16, dtype=torch.bfloat16))
    new = {k for k, v in ops.runtime_counts().items() if before.get(k) != v}
    assert new == {("dgated_swiglu", "reference",
                    "device cpu (generated kernels are CUDA only)")}


@pytest.mark.parametrize("bend,why", [
    (lambda d, w, p: (d, w, p[:, :-8]), "expected [M, H], [H, I], [M, 2I]"),
    (lambda d, w, p: (d, w.float(), p), "one 16-bit dtype"),
    (lambda d, w, p: (d[:, :-4], w[:-4], p), "not a multiple of 8"),
    (lambda d, w, p: (d, w.t().contiguous().t(), p), "unit-stride"),
])
def test_contract_rejects(bend, why):
    d, w, p = (torch.randn(16, 64, dtype=torch.bfloat16),
               torch.randn(64, 32, dtype=torch.bfloat16),
               torch.randn(16, 64, dtype=torch.bfloat16))
    got = dgated.contract_violation(*bend(d, w, p))
    assert got is not None and why in got, got


# ---- fail closed, and the checker's own checks -------------------------------------------

def test_witness_that_cannot_run_keeps_the_graph_op_backward(monkeypatch):
    from coda_rewrite.algebra import gated as gated_algebra

    def unreplayable(m, down):
        raise RuntimeError("cannot evaluate")

    monkeypatch.setattr(gated_algebra, "_replay_down", unreplayable)
    mlp = GatedMLP("plain").train()
    fast = coda_rewrite.optimize(mlp, fuse_in_training=True)
    before = dgated_calls("swiglu")
    fast(torch.randn(2, 3, 16)).sum().backward()
    (note,) = down_notes(fast.report)
    assert not note[1].accepted and note[1].code == "witness.unavailable", str(fast.report)
    assert dgated_calls("swiglu") == before


@pytest.mark.provokes_pass_bug
def test_witness_disagreement_refuses_the_match_as_a_bug(monkeypatch):
    """A wrong backward (here the reference's dg negated) is caught by the per-match
    float64 replay, and reported as the pass's bug, never as a note: the gradient replay,
    which differentiates the gate/up GEMM by the gated rule (the same dg), finds it first."""
    real = reference.dgated

    def wrong(op, dh, p):
        dp, h = real(op, dh, p)
        dp = dp.clone()
        dp[:, 0::2] *= -1
        return dp, h

    monkeypatch.setattr(reference, "dgated", wrong)
    mlp = GatedMLP("plain").train()
    fast = coda_rewrite.optimize(mlp, fuse_in_training=True)
    fast(torch.randn(2, 3, 16)).sum().backward()
    (rec,) = [r for r in fast.report.records if r.pattern == "gated_mlp"]
    assert rec.status != "rewritten" and rec.kind.is_bug and \
        rec.code == "witness.gradients_disagree"


def test_statement_refuses_a_wrong_derivative(monkeypatch):
    import sympy as sp
    statements.prove_gated_backward.cache_clear()
    wrong = dict(statements.GATE_ACTIVATIONS)
    f, _ = wrong["silu"]
    wrong["silu"] = (f, lambda x: 1 / (1 + sp.exp(-x)))  # σ alone: a common slip
    monkeypatch.setattr(statements, "GATE_ACTIVATIONS", wrong)
    try:
        with pytest.raises(statements.Unproved, match="silu"):
            statements.prove_gated_backward()
    finally:
        statements.prove_gated_backward.cache_clear()


# ---- an adversary for the dgrad op's math --------------------------------------------------

@seed(20261202)
@settings(max_examples=60, deadline=None, database=None)
@given(op=st.sampled_from(["swiglu", "geglu", "geglu_erf"]),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       m=st.integers(1, 9), hidden=st.integers(1, 12), inter=st.integers(1, 10),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), data=st.integers(0, 2**31 - 1))
def test_generated_dgrad_inputs_match_autograd(op, dtype, m, hidden, inter, scale, data):
    """coda::dgated on any shape (M = 1 included), dtype and pre-activation scale (tiny,
    ordinary, saturating) against autograd of eager's spelling in float64 on the same
    (rounded) inputs: float64 to 1e-12, float32 to 1e-5, bf16 within one rounding of
    each output."""
    gen = torch.Generator().manual_seed(data)
    dout = torch.randn(m, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, inter, generator=gen).to(dtype)
    p = (torch.randn(m, 2 * inter, generator=gen) * scale).to(dtype)
    dp, h = torch.ops.coda.dgated(op, dout, w, p)
    assert dp.dtype == h.dtype == dtype and dp.shape == p.shape and h.shape == (m, inter)
    act = {"swiglu": F.silu, "geglu": lambda t: F.gelu(t, approximate="tanh"),
           "geglu_erf": F.gelu}[op]
    g = p[:, 0::2].double().requires_grad_(True)
    u = p[:, 1::2].double().requires_grad_(True)
    dh = dout.double() @ w.double()  # the dgrad GEMM, exactly
    want_g, want_u = torch.autograd.grad(act(g) * u, [g, u], dh)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for got, want in ((dp[:, 0::2], want_g), (dp[:, 1::2], want_u),
                      (h, (act(g) * u).detach())):
        assert rel_err(got.double(), want) <= tol, (op, dtype, rel_err(got.double(), want))


def test_a_second_derivative_through_the_fused_backward_raises():
    """GatedDown's backward runs coda::dgated, which has no derivative of its own: a
    backward with create_graph=True raises (the fallback would only warn, and a second
    derivative would lack the dgrad epilogue's terms); a first derivative works."""
    from coda_rewrite.kernels.gated_down import gated_down_linear
    g = torch.Generator().manual_seed(0)
    p = torch.randn(4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = F.silu(p[:, 0::2]) * p[:, 1::2]
    out = gated_down_linear("swiglu", y, p, w)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), p, create_graph=True)
    (dp,) = torch.autograd.grad(out.sum(), p)
    with torch.enable_grad():
        want = torch.autograd.grad((F.silu(p[:, 0::2]) * p[:, 1::2] @ w.T).sum(), p)[0]
    assert rel_err(dp, want) <= 1e-12


def _adapter_model(frozen: bool):
    """HF Llama (2 layers, LM head untied) with every projection and the LM head frozen
    (or not), a copy and token ids."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    for name, p in model.named_parameters():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            p.requires_grad_(not frozen)
    return model, copy.deepcopy(model), torch.randint(0, 128, (2, 16))


@pytest.mark.inductor
def test_frozen_weights_in_a_compiled_step():
    """The compiled backward's arrangement (a norm's row scale on dy, the re-layout's
    gradient not taken) with every projection and the LM head frozen: their .grad stays
    None, and the embedding's and the norms' gradients are eager's."""
    model, ref, ids = _adapter_model(True)
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(fuse_in_training=True))
    loss = torch.compile(model, backend=backend)(ids, labels=ids).loss
    loss.backward()
    want = ref(ids, labels=ids).loss
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    done = {r.pattern for g in backend.report.graphs for r in g.records
            if r.status == "rewritten"}
    assert {"residual_rmsnorm_gemm", "gated_mlp", "lm_head_cross_entropy"} <= done, done
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-5, name


@pytest.mark.parametrize("frozen", [True, False])
def test_frozen_weights_skip_the_weight_gradient_gemm(frozen, monkeypatch):
    """Adapter-style fine-tuning through optimize() (no AOTAutograd to drop unused
    outputs): with every projection and the LM head frozen, no fused GEMM's backward
    runs a wgrad GEMM, and the embedding's gradient is eager's; trainable, they all do."""
    from coda_rewrite.kernels import gated_down
    from coda_rewrite.kernels.backward import centred, common, cross_entropy
    computed = []
    real = common.wgrad

    def spy(d, a, *row_scale):
        out = real(d, a, *row_scale)
        computed.append(out is not None)
        return out
    for mod in (common, centred, cross_entropy, gated_down):
        monkeypatch.setattr(mod, "wgrad", spy)
    model, ref, ids = _adapter_model(frozen)
    fast = coda_rewrite.optimize(model, fuse_in_training=True)
    loss = fast(ids, labels=ids).loss
    computed.clear()  # the witnesses' gradient replays (their weights are leaves) ran the
    loss.backward()   # rules while the forward was compiled: the step's backward counts
    ref(ids, labels=ids).loss.backward()
    assert len(computed) >= 9 and all(c != frozen for c in computed), computed
    emb, want = model.model.embed_tokens.weight.grad, ref.model.embed_tokens.weight.grad
    assert rel_err(emb, want) <= 1e-5
