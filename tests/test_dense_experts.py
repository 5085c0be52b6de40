"""Dense experts (Llama 4's every-token-through-every-expert bmm) run on their routed rows
only (patterns/dense_experts.py): outputs and gradients against eager and float64, the
routing edge cases, and the look-alikes that must be left as they are."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import coda_rewrite
from coda_rewrite import routing
from coda_rewrite.kernels.expert_gemm import expert_gemm
from coda_rewrite.numerics import rel_err

from conftest import codes

DENSE_ONLY = {"patterns": ("dense_experts",)}


def llama4(top_k: int = 2, experts: int = 4, dtype=torch.float32, seed: int = 0, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(
        "llama4_text", vocab_size=128, hidden_size=64, intermediate_size=32,
        intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=experts,
        num_experts_per_tok=top_k, interleave_moe_layer_step=1, max_position_embeddings=64,
        **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    for name, p in model.named_parameters():  # zeros at init: give the experts weights
        if "experts" in name:
            torch.nn.init.normal_(p, std=p.shape[-2] ** -0.5)
    return model.to(dtype)


def _rewritten(report) -> list[str]:
    return [r.path for r in report.records if r.pattern == "dense_experts" and
            r.status == "rewritten"]


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("via", ["optimize", "backend"])
def test_llama4_experts_run_on_their_routed_rows(top_k, via):
    """Every Llama 4 MoE layer rewritten; logits equal to eager's in float32 (the routed
    rows are the dense layer's nonzero ones); the dense bmm is gone from the graph."""
    model = llama4(top_k).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = model(ids).logits
        if via == "optimize":
            fast = coda_rewrite.optimize(copy.deepcopy(model), **DENSE_ONLY)
            got, report = fast(ids).logits, fast.report
        else:
            torch._dynamo.reset()
            fast = torch.compile(copy.deepcopy(model), backend="coda")
            got = fast(ids).logits
            report = coda_rewrite.last_report()
    assert rel_err(got, want) <= 1e-5
    rewritten = _rewritten(report)
    assert rewritten[-2:] == [f"model.layers.{i}.feed_forward.experts" for i in (0, 1)], \
        str(report)
    text = str(report)
    assert f"top-{top_k} of 4 experts" in text and "PROVED" in text


def test_no_dense_bmm_left_in_the_graph():
    model = llama4().eval()
    report = coda_rewrite.explain(model, torch.randint(0, 128, (1, 8)), **DENSE_ONLY)
    rewritten = report.graphs[0].rewritten_code
    assert "torch.bmm" not in rewritten and "sort_by_expert" in rewritten
    assert "repeat" not in rewritten


def _float64_truth(model):
    return copy.deepcopy(model).double()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_logits_no_worse_than_eager(seed):
    """bf16: against the float64 model, the routed form's logits are no worse than
    eager's (the same products on the chosen rows; the sum over each token's k rows in
    float32, as eager's sum over the experts)."""
    model = llama4(2, dtype=torch.bfloat16, seed=seed).eval()
    exact = _float64_truth(model)
    ids = torch.randint(0, 128, (4, 32))
    with torch.no_grad():
        fast = coda_rewrite.optimize(copy.deepcopy(model), **DENSE_ONLY)
        got, eager, want = fast(ids).logits, model(ids).logits, exact(ids).logits
    assert _rewritten(fast.report)
    assert rel_err(got.double(), want) <= 1.05 * rel_err(eager.double(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("via", ["optimize", "backend"])
def test_training_step_matches_eager(dtype, via):
    """Loss and every gradient (router, both expert weights, the shared expert, the
    layers before) equal to eager's in float32; in bf16 no worse than eager's against
    the float64 model."""
    model = llama4(2, dtype=dtype).train()
    ref, exact = copy.deepcopy(model), _float64_truth(model)
    ids = torch.randint(0, 128, (4, 32))
    if via == "optimize":
        fast_model = copy.deepcopy(model)
        fast = coda_rewrite.optimize(fast_model, **DENSE_ONLY)
    else:
        fast_model = copy.deepcopy(model)
        fast = torch.compile(fast_model, backend="coda", options=DENSE_ONLY)
    losses = [f(ids, labels=ids).loss for f in (fast, ref, exact)]
    for loss in losses:
        loss.backward()
    if via == "optimize":
        assert _rewritten(fast.report)
    for (name, p), q, t in zip(fast_model.named_parameters(), ref.parameters(),
                               exact.parameters()):
        if dtype == torch.float32:
            assert rel_err(p.grad, q.grad) <= 1e-5, name
        else:
            err, base = rel_err(p.grad.double(), t.grad), rel_err(q.grad.double(), t.grad)
            assert err <= 1.5 * base + 1e-4, (name, err, base)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert abs(float(losses[0]) - float(losses[1])) <= tol


@pytest.mark.parametrize("case", ["one_expert_takes_all", "an_expert_with_no_token"])
def test_routing_edge_cases(case):
    """Every token routed to one expert, and an expert no token chooses: outputs and
    gradients equal to eager's (float32)."""
    model = llama4(1).train()
    bias = {"one_expert_takes_all": [-50.0, -50.0, 0.0, -50.0],
            "an_expert_with_no_token": [0.0, 0.0, 0.0, -50.0]}[case]
    for layer in model.model.layers:  # a fixed logit shift per expert: the router as a
        router = layer.feed_forward.router  # Linear with a bias (Llama 4's has none)
        router.bias = torch.nn.Parameter(torch.tensor(bias), requires_grad=False)
    ids = torch.randint(0, 128, (2, 16))
    ref, fast_model = copy.deepcopy(model), copy.deepcopy(model)
    fast = coda_rewrite.optimize(fast_model, **DENSE_ONLY)
    fast(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    assert _rewritten(fast.report)
    for (name, p), q in zip(fast_model.named_parameters(), ref.parameters()):
        if q.grad is None:  # the frozen router biases
            assert p.grad is None, name
            continue
        assert rel_err(p.grad, q.grad) <= 1e-5, name


class DenseMoE(torch.nn.Module):
    """Llama 4's experts spelled by hand, with switches for the look-alikes."""

    def __init__(self, hidden=16, inter=8, experts=4, top_k=2, variant="canonical"):
        super().__init__()
        self.e, self.k, self.variant = experts, top_k, variant
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        g = torch.Generator().manual_seed(0)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, hidden, 2 * inter,
                                                      generator=g) / hidden ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, inter, hidden,
                                                   generator=g) / inter ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(2 * inter, generator=g))

    def scores(self, h):
        v = self.variant
        logits = self.router(h)
        top, idx = torch.topk(logits, self.k, dim=0 if v == "topk_over_tokens" else 1)
        if v == "topk_over_tokens":
            return torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(
                0, idx, top))
        fill = 0.0 if v == "zero_fill_sigmoid" else float("-inf")
        z = torch.full_like(logits, fill).scatter_(1, idx, top)
        if v == "softmax_scores":
            return torch.softmax(z, dim=-1)
        if v == "scatter_into_logits":
            z = logits.clone().scatter_(1, idx, top)
        return torch.sigmoid(z.float()).to(h.dtype)

    def forward(self, x):
        v = self.variant
        h = x.reshape(-1, x.shape[-1])
        s = self.scores(h)
        if v == "repeat_interleave":
            rows = h.repeat_interleave(self.e, dim=0) * s.reshape(-1, 1)
        elif v == "scores_t":
            rows = h.repeat(self.e, 1) * s.t().reshape(-1, 1)
        elif v == "repeat_tuple":  # repeat((E, 1)), the column first
            rows = s.permute(1, 0).reshape(-1, 1) * h.repeat((self.e, 1))
        else:
            rows = h.repeat(self.e, 1) * s.transpose(0, 1).reshape(-1, 1)
        if v == "tokens_in_place":
            h.mul_(2)
        gu = torch.bmm(rows.view(self.e, -1, h.shape[-1]), self.gate_up)
        if v == "bias":
            gu = gu + self.bias
        gate, up = gu.chunk(2, dim=-1)
        if v == "gelu":
            prod = F.gelu(gate, approximate="tanh") * up
        else:
            prod = F.silu(gate) * up
        out = torch.bmm(prod, self.down)
        if v == "sum_over_tokens":
            return out.sum(1)
        total = out.view(-1, h.shape[-1]).reshape(self.e, -1, h.shape[-1]).sum(dim=0)
        if v == "product_read":
            return total, prod
        return total


@pytest.mark.parametrize("variant", ["canonical", "scores_t", "gelu", "repeat_tuple"])
@pytest.mark.parametrize("training", [False, True])
def test_hand_written_dense_experts(variant, training):
    mod = DenseMoE(variant=variant).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=training)
    fast = coda_rewrite.optimize(copy.deepcopy(mod), **DENSE_ONLY)
    with torch.set_grad_enabled(training):
        got, want = fast(x), mod(x)
    assert rel_err(got, want) <= 1e-12
    assert len(_rewritten(fast.report)) == 1, str(fast.report)
    if training:
        r = torch.randn_like(want)
        g_got = torch.autograd.grad((got * r).sum(), [x, *fast.parameters()],
                                    allow_unused=True)
        g_want = torch.autograd.grad((want * r).sum(), [x, *mod.parameters()],
                                     allow_unused=True)
        for a, b in zip(g_got, g_want):
            assert (a is None) == (b is None)
            if a is not None:
                assert rel_err(a, b) <= 1e-10


LOOK_ALIKES = {
    "zero_fill_sigmoid": "moe.dense_scores",       # sigmoid(0) = 1/2 off the top-k
    "softmax_scores": "moe.dense_scores",          # not an elementwise chain
    "scatter_into_logits": "moe.dense_scores",     # the logits off the top-k, not a fill
    "topk_over_tokens": "moe.dense_scores",        # the top-k over the wrong dim
    "repeat_interleave": "moe.dense_input",        # token-major copies
    "bias": "moe.dense_halves",                    # an expert bias: F(0) ≠ 0
    "sum_over_tokens": "moe.dense_output",
    "product_read": "moe.dense_intermediate_read",
    "tokens_in_place": "moe.dense_in_place",
}


@pytest.mark.parametrize("variant", list(LOOK_ALIKES))
def test_look_alikes_are_left_with_their_reason(variant):
    mod = DenseMoE(variant=variant).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    fast = coda_rewrite.optimize(copy.deepcopy(mod), **DENSE_ONLY)
    got, want = fast(x.clone()), mod(x.clone())
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want))):
        assert torch.equal(a, b)
    assert LOOK_ALIKES[variant] in codes(fast.report, "dense_experts"), str(fast.report)
    assert not _rewritten(fast.report)


def test_a_product_of_zero_lanes_that_is_not_zero_is_refused(monkeypatch):
    """The zero-row condition itself (no pair the matcher takes breaks it): a pair
    function whose value at zero lanes is 1 is refused with moe.dense_zero_row."""
    from coda_rewrite.patterns import dense_experts, routed_experts

    def shifted(gate, up):
        found = routed_experts.pair_of(gate, up)
        mul = found[1]
        with mul.graph.inserting_after(mul):
            one = mul.graph.call_function(torch.add, (mul, 1.0))
        one.meta.update(mul.meta)
        mul.replace_all_uses_with(one)
        one.args = (mul, 1.0)
        return found[0], one, (*found[2], mul), found[3]
    monkeypatch.setattr(dense_experts, "pair_of", shifted)
    mod = DenseMoE().double()
    fast = coda_rewrite.optimize(mod, **DENSE_ONLY)
    fast(torch.randn(2, 6, 16, dtype=torch.float64))
    assert "moe.dense_zero_row" in codes(fast.report, "dense_experts"), str(fast.report)


def test_routed_form_against_the_dense_sum():
    """coda_rewrite/routing.py with expert_gemm, float64: sort, scaled gather, grouped
    GEMMs, per-token sum equal to every expert on every token summed, top-k 1 to 3, an
    empty expert."""
    g = torch.Generator().manual_seed(0)
    for top_k in (1, 2, 3):
        e, t, k, i = 5, 9, 6, 4
        x, logits = torch.randn(t, k, generator=g, dtype=torch.float64), \
            torch.randn(t, e, generator=g, dtype=torch.float64)
        logits[:, 4] = -100.0  # expert 4 chosen by no token
        w_gu, w_d = torch.randn(e, k, 2 * i, generator=g, dtype=torch.float64), \
            torch.randn(e, i, k, generator=g, dtype=torch.float64)
        v, idx = torch.topk(logits, top_k, dim=1)
        s = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter(1, idx, v))
        gate, up = torch.bmm((x.repeat(e, 1) * s.t().reshape(-1, 1)).view(e, t, k),
                             w_gu).chunk(2, -1)
        want = torch.bmm(F.silu(gate) * up, w_d).sum(0)
        perm, offsets, inverse = routing.sort_by_expert(idx, e)
        assert offsets.dtype == torch.int32 and int(offsets[-1]) == t * top_k
        assert int(offsets[4] - offsets[3]) == 0
        gate, up = expert_gemm(routing.gather_scaled(x, s, idx, perm, inverse), w_gu,
                               offsets).chunk(2, -1)
        got = routing.sum_to_tokens(expert_gemm(F.silu(gate) * up, w_d, offsets),
                                    perm, inverse, top_k)
        assert rel_err(got, want) <= 1e-13


@pytest.mark.provokes_pass_bug
def test_witness_refuses_a_wrong_routed_form(monkeypatch):
    """A routed form that pairs rows with the wrong tokens is refused by the per-match
    float64 witness as the pass's own bug, never applied (the statement's own witness,
    proved and cached before the change, is not what refuses it)."""
    from coda_rewrite.algebra import statements
    from coda_rewrite.algebra.decision import RejectionKind
    statements.prove_dense_experts()
    real = routing.back_to_tokens
    monkeypatch.setattr(routing, "back_to_tokens",
                        lambda rows, inverse, k: real(rows, inverse.flip(0), k))
    mod = DenseMoE().double()
    fast = coda_rewrite.optimize(mod, **DENSE_ONLY)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    assert torch.equal(fast(x), mod(x))
    (rec,) = [r for r in fast.report.records if r.pattern == "dense_experts"]
    assert rec.kind == RejectionKind.WITNESS_DISAGREES, str(fast.report)


def _fake_cuda_match(tokens: int, top_k: int = 1, experts: int = 16):
    """A Match whose tokens and weights are CUDA metas (the size rule reads those only)."""
    from types import SimpleNamespace

    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_rewrite.patterns import dense_experts
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(tokens, 64, device="cuda")
        w = torch.empty(experts, 64, 128, device="cuda")
    g = fx.Graph()
    tok, wgu = g.placeholder("x"), g.placeholder("w")
    tok.meta["example_value"], wgu.meta["example_value"] = x, w
    return dense_experts, SimpleNamespace(tokens=tok, w_gate_up=wgu, top_k=top_k)


@pytest.mark.parametrize("tokens,left", [(1, False), (16, False), (17, True), (128, True),
                                         (255, True), (256, False), (8192, False)])
def test_size_rule_on_the_gpu(tokens, left):
    """On CUDA the dense layer is left where the routed GEMMs lose (measured at 16
    experts: 2E to 16E routed rows); min_fused_rows replaces the window by a threshold."""
    family, m = _fake_cuda_match(tokens)
    why = family.too_dense_to_pay(m, None)
    assert bool(why) == left, why
    assert family.too_dense_to_pay(m, 0) == ""
    assert bool(family.too_dense_to_pay(m, 10_000)) == (tokens < 10_000)


def test_gate_up_output_read_twice_is_left_with_its_reason():
    """The first bmm's output read by its chunk and by something else (no sole reader):
    left with `moe.dense_halves`, outputs as eager's."""
    class Twice(DenseMoE):
        def forward(self, x):
            h = x.reshape(-1, x.shape[-1])
            s = self.scores(h)
            rows = h.repeat(self.e, 1) * s.transpose(0, 1).reshape(-1, 1)
            gu = torch.bmm(rows.view(self.e, -1, h.shape[-1]), self.gate_up)
            gate, up = gu.chunk(2, dim=-1)
            out = torch.bmm(F.silu(gate) * up, self.down).sum(dim=0)
            return out, gu.mean()
    mod = Twice().double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    fast = coda_rewrite.optimize(copy.deepcopy(mod), **DENSE_ONLY)
    for a, b in zip(fast(x), mod(x)):
        assert torch.equal(a, b)
    assert codes(fast.report, "dense_experts") == {"moe.dense_halves"}, str(fast.report)


def test_autocast_leaves_the_dense_layer():
    """Under autocast eager's bmm casts to bf16 and rounds its output there; the routed
    GEMMs are not autocast-aware, so the layer's dtypes would change: left with
    `moe.dense_autocast`, outputs as eager's."""
    model = llama4().eval()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fast = coda_rewrite.optimize(copy.deepcopy(model), **DENSE_ONLY)
        got, want = fast(ids).logits, model(ids).logits
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert "moe.dense_autocast" in codes(fast.report, "dense_experts"), str(fast.report)


def test_generate_through_the_routed_form():
    """generate() through optimize(): prefill and every decode step (one token per
    sequence: routed rows = batch × top-k) give eager's tokens."""
    model = llama4(1).eval()
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        fast = coda_rewrite.optimize(copy.deepcopy(model))
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert {r.status for r in fast.report.records if r.pattern == "dense_experts"} == \
        {"rewritten"}


def test_a_second_derivative_through_the_routed_gemm_raises():
    """The routed form's grouped GEMM outside bfloat16 is an autograd Function over a
    formula-less op: a backward that would build a graph for a second derivative raises
    instead of dropping its terms; the first derivative is the dense product's."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(2, 4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    out = expert_gemm(a, w, offsets)
    want = torch.cat((a[:2] @ w[0], a[2:] @ w[1]))
    assert rel_err(out, want) <= 1e-14
    ga, gw = torch.autograd.grad(out.square().sum(), (a, w), retain_graph=True)
    wa, ww = torch.autograd.grad(want.square().sum(), (a, w))
    assert rel_err(ga, wa) <= 1e-14 and rel_err(gw, ww) <= 1e-14
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(out.square().sum(), (a, w), create_graph=True)
