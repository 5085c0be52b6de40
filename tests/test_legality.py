"""Never a wrong number: models without the pattern, bad inputs and near misses are left
untouched (or rewritten only where legal), and the report says why."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import coda_rewrite
from coda_rewrite.numerics import rel_err

from conftest import codes, hf_model, tokens

D = 32


def rms(x, g, eps=1e-6, dim=-1):
    xf = x.float()
    return g * (xf * torch.rsqrt(xf.pow(2).mean(dim, keepdim=True) + eps)).to(x.dtype)


class Block(nn.Module):
    """linear → residual → norm → linear, with a hook to bend it out of shape."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.w0 = nn.Linear(D, D, bias=False)
        self.w1 = nn.Linear(D, D, bias=False)
        self.g = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x, res):
        return self.body(self, x, res)


def run(body, *inputs):
    torch.manual_seed(0)
    model = Block(body)
    ref = copy.deepcopy(model)
    if not inputs:
        g = torch.Generator().manual_seed(0)
        inputs = (torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g))
    fast = coda_rewrite.optimize(model)
    got, want = fast(*inputs), ref(*inputs)
    return fast.report, got, want


def same(got, want, tol=0.0):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for a, b in zip(got, want):
        if tol == 0.0:
            assert torch.equal(a, b)
        else:
            assert rel_err(a, b) <= tol


# ---- models without the pattern ------------------------------------------------------

class PostNormLayerNorm(nn.Module):
    """BERT-style: LayerNorm after the residual add."""

    def __init__(self):
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.ln = nn.ModuleList(nn.LayerNorm(D) for _ in range(3))

    def forward(self, x):
        for lin, ln in zip(self.lin, self.ln):
            x = ln(x + lin(x))
        return x


def test_layernorm_post_norm_model_is_unchanged():
    """Post-norm: each LayerNorm's output is the residual stream the next add reads, so
    LN(z) is written anyway and no norm is deferred; the last one feeds no GEMM. Each says
    so; the model runs exactly as eager."""
    model = PostNormLayerNorm()
    x = torch.randn(2, 5, D)
    fast = coda_rewrite.optimize(model)
    assert torch.equal(fast(x), model(x))
    report = fast.report
    assert report.count() == 0 and report.count(pattern="layernorm_gemm") == 0
    assert [r.code for r in report.records] == ["layernorm.materialised_anyway"] * 2 + [
        "layernorm.no_consumer_gemm"], str(report)


def test_a_model_without_norms_says_nothing_matched():
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    fast = coda_rewrite.optimize(model)
    x = torch.randn(2, 5, D)
    assert torch.equal(fast(x), model(x))
    assert not fast.report.records
    assert "nothing matched" in str(fast.report) and "RMSNorm" in str(fast.report)


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_norm_before_the_residual_stays_right(family):
    """Gemma 2 / OLMo 2 normalise the block output before the residual add: no norm
    has a producing GEMM; outputs stay right and the report says why."""
    model = hf_model(family, layers=2).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
    report = fast.report
    producers = [r for r in report.records
                 if r.programs and r.programs[0].name == "residual_rmsnorm"]
    assert not producers, str(report)
    assert "row_scale.post_sublayer" in codes(report)  # the post-block norms
    if family == "gemma2":
        assert "neither operand of the residual add" in str(report)  # the producer note


def test_gemma_scale_offset_is_rewritten():
    model = hf_model("gemma", layers=2).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
    assert fast.report.count() == 5, str(fast.report)
    assert "gamma + 1.0" in str(fast.report)


def t5_rms(x, g, eps=1e-6):
    """T5's RMSNorm (also CPM-Ant's, IDEFICS', Kosmos-2.5's): the mean squares
    x.to(float32), the product multiplies the uncast x back."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if g.dtype in (torch.float16, torch.bfloat16):
        y = y.to(g.dtype)
    return g * y


def twice_cast_rms(x, g, eps=1e-6):
    """Two casts of x, one squared, one multiplied back."""
    return g * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
                ).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [t5_rms, twice_cast_rms])
def test_the_input_multiplied_back_uncast_is_the_same_norm(norm, dtype):
    """x and x.to(float32) hold the same values: squaring one and multiplying the other
    back is the norm (a bf16 x times the float32 rsqrt is promoted to float32)."""
    def body(self, x, res):
        return self.w1(norm(self.w0(x) + res, self.g))

    torch.manual_seed(0)
    model = Block(body).to(dtype)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(2, 6, D, generator=g) for _ in range(2))
    fast = coda_rewrite.optimize(model)
    got = fast(x.to(dtype), res.to(dtype))
    assert fast.report.count() == 1, str(fast.report)
    want, want64 = ref(x.to(dtype), res.to(dtype)), ref64(x.double(), res.double())
    if dtype == torch.float32:
        assert rel_err(got, want) <= 1e-5
    else:  # no worse than eager against float64 (a 10% margin for one draw)
        assert rel_err(got.double(), want64) <= 1.1 * rel_err(want.double(), want64)


@pytest.mark.parametrize("back", ["narrowed", "round_trip", "half_to_bf16", "other"])
def test_a_value_multiplied_back_that_is_not_the_squared_one_is_not_the_norm(back):
    """Look-alikes of T5's spelling: what is multiplied back reaches x through a cast
    that rounds (to bf16, or a round trip through it; fp16 to bf16 loses range and
    precision both ways), or is another value of x's shape."""
    def body(self, x, res):
        z = self.w0(x) + res
        zm = {"narrowed": lambda: z.to(torch.bfloat16),
              "round_trip": lambda: z.to(torch.bfloat16).to(torch.float32),
              "half_to_bf16": lambda: z.half().to(torch.bfloat16).float(),
              "other": lambda: z + 1e-3}[back]()
        if back == "half_to_bf16":
            z = z.half().float()
        y = zm * torch.rsqrt(z.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.w1((self.g * y).to(self.w1.weight.dtype))

    report, got, want = run(body)
    assert report.count() == 0, str(report)
    assert "rmsnorm.not_multiplied_back" in codes(report)
    same(got, want)


def test_t5_norms_are_rewritten():
    """T5 (gated GELU, v1.1 / Flan-T5): every pre-norm a GEMM reads, encoder and decoder;
    the logits and a training step's gradients as eager's."""
    import transformers as tf
    cfg = tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_heads=4, decoder_start_token_id=0, feed_forward_proj="gated-gelu",
                      dropout_rate=0.0)
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(cfg)
    ref = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    loss = fast(input_ids=ids, decoder_input_ids=ids, labels=ids).loss
    want = ref(input_ids=ids, decoder_input_ids=ids, labels=ids).loss
    loss.backward()
    want.backward()
    # encoder: 2 x (attention, MLP) norms; decoder: 2 x (self-attention, cross-attention,
    # MLP) norms; the two final norms, read through an inactive dropout (p = 0): 12
    assert fast.report.count() == 12, str(fast.report)
    assert not codes(fast.report, "residual_rmsnorm_gemm")
    assert rel_err(loss, want) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name


class NormThenGemm(nn.Module):
    """z = x·W0ᵀ + res -> norm -> ``between`` -> W1, and z read by W2 too."""

    def __init__(self, norm: str, between: str):
        super().__init__()
        self.between = between
        self.w0, self.w1, self.w2 = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.norm = nn.RMSNorm(D) if norm == "rms" else nn.LayerNorm(D)
        self.v = nn.Parameter(torch.rand(D) + 0.5)   # a per-feature factor after the norm
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x, res):
        z = self.w0(x) + res
        h = self.norm(z)
        h = {"detach": lambda: h.detach(),
             "scale_then_detach": lambda: (h * self.v).detach(),
             "detach_then_scale": lambda: h.detach() * self.v,
             "dropout_eval": lambda: F.dropout(h, 0.1, training=False),
             "dropout_p0": lambda: F.dropout(h, 0.0, training=True),
             "dropout_active": lambda: F.dropout(h, 0.3, training=True)}[self.between]()
        return self.w1(h) + self.w2(z)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("between", ["detach", "scale_then_detach", "detach_then_scale",
                                     "dropout_eval", "dropout_p0", "dropout_active"])
def test_what_only_the_gradient_or_nothing_sees_between_the_norm_and_its_gemm(norm,
                                                                                between):
    """A detach between the norm and its GEMM stops the gradient of the GEMM's input,
    r·h (or r·(z − μ)): the deferred row statistics must be detached too, or they carry
    to z the gradient eager does not (found: 12% off in every gradient upstream, the
    forward exact, so the float64 witness saw nothing), and so must a factor folded into
    the GEMM's weights from before it; a LayerNorm whose γ and β the fold would take
    across a detach is left (layernorm.detach). An inactive dropout (eval, or p = 0) is
    the identity; an active one stays between, with its reason."""
    torch.manual_seed(0)
    model = NormThenGemm(norm, between)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast = coda_rewrite.optimize(model, fuse_in_training=True)
    cot = torch.randn(2, 6, D, generator=g)
    torch.manual_seed(1)
    got = fast(x1, res)
    torch.manual_seed(1)
    want = ref(x2, res)
    (got * cot).sum().backward()
    (want * cot).sum().backward()
    pattern = "residual_rmsnorm_gemm" if norm == "rms" else "layernorm_gemm"
    (rec,) = [r for r in fast.report.records if r.pattern == pattern]
    consumers = {name.split(" ")[-1]: d.accepted for name, d, _ in rec.consumer_decisions}
    left = {"dropout_active": "row_scale.op_between"}
    if norm == "layer":
        left.update({k: "layernorm.detach" for k in ("detach", "scale_then_detach",
                                                      "detach_then_scale")})
    assert consumers.get("(w1)") == (between not in left), str(fast.report)
    if between in left:
        assert left[between] in codes(fast.report, pattern)
    assert rel_err(got, want) <= 1e-5
    assert rel_err(x1.grad, x2.grad) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:  # behind the detach, or not read
            assert p.grad is None, name
        else:
            assert rel_err(p.grad, q.grad) <= 1e-5, name


@pytest.mark.provokes_pass_bug
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("between", ["detach", "scale_then_detach"])
def test_the_gradient_replay_refuses_what_the_forward_witness_cannot_see(monkeypatch,
                                                                         norm, between):
    """A norm's witness replays the gradients too where the match trains. With the detach
    bug above put back (RMSNorm: the detach applied to h2 and not to the deferred r;
    LayerNorm: γ and β folded across the detach, layernorm.detach dropped), the forward
    is exact and every gradient upstream is off: the rewrite is refused as the pass's own
    bug and the model trains as eager; the forward witness alone passed it."""
    from coda_rewrite.algebra import layernorm as layernorm_algebra
    from coda_rewrite.algebra import row_scale

    real, condition = row_scale.replay_chain, layernorm_algebra._consumer_condition

    def without_the_detach_rule(c, n):
        why = condition(c, n)
        return None if why is not None and why.code == "layernorm.detach" else why

    def old_bug(chain, head, d, h2, r, like, call):
        kept = {"r": r}

        def like_keeping_r(node, src, x):  # the detach reaches h2 only
            if x is kept["r"] and row_scale.chain_op(node, src, d)[0] == "detach":
                return x
            out = like(node, src, x)
            if x is kept["r"]:
                kept["r"] = out
            return out

        return real(chain, head, d, h2, r, like_keeping_r, call)

    if norm == "rms":
        monkeypatch.setattr(row_scale, "replay_chain", old_bug)
    else:
        monkeypatch.setattr(layernorm_algebra, "_consumer_condition", without_the_detach_rule)
    torch.manual_seed(0)
    model = NormThenGemm(norm, between)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g)
    fast = coda_rewrite.optimize(model, fuse_in_training=True)
    fast(x, res).sum().backward()
    ref(x, res).sum().backward()
    pattern = "residual_rmsnorm_gemm" if norm == "rms" else "layernorm_gemm"
    (rec,) = [r for r in fast.report.records if r.pattern == pattern]
    assert rec.status != "rewritten" and rec.code == "witness.gradients_disagree", \
        str(fast.report)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-5, name


def test_a_training_match_states_its_gradient_replay():
    """What the report shows for a norm whose GEMMs train: the forward replay and the
    gradients' (an inference graph has the forward's alone)."""
    def body(self, x, res):
        return self.w1(rms(self.w0(x) + res, self.g))

    torch.manual_seed(0)
    model = Block(body)
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g)
    trains = coda_rewrite.optimize(copy.deepcopy(model), fuse_in_training=True)
    trains(x, res).sum().backward()
    with torch.no_grad():
        infers = coda_rewrite.optimize(copy.deepcopy(model))
        infers(x, res)
    assert trains.report.count() == 1 == infers.report.count()
    assert "gradient replay on the gradients to the 5 inputs" in str(trains.report)
    assert "gradient replay" not in str(infers.report)


class GradModeRegion(nn.Module):
    """z = x·W0ᵀ + res -> norm -> W1 (and a gated MLP), one part under torch.no_grad()."""

    def __init__(self, region: str):
        super().__init__()
        self.region = region
        self.w0, self.w1, self.w2, self.w3 = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.norm = nn.RMSNorm(D)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x, res):
        with torch.set_grad_enabled(self.region != "producer"):
            z = self.w0(x) + res
        with torch.set_grad_enabled(self.region != "norm"):
            h = self.norm(z)
        with torch.set_grad_enabled(self.region != "consumers"):
            y = F.silu(self.w1(h)) * self.w3(h)
        return self.w2(y) + z


@pytest.mark.parametrize("region", ["producer", "norm", "consumers", "none"])
def test_a_match_across_a_no_grad_region_is_left(region):
    """Dynamo traces a torch.no_grad() block inside the model into the graph. A rewrite
    computes a match in one place, in one grad mode: a norm under no_grad whose row
    scale went into a GEMM outside it passed the residual stream a gradient eager does
    not (60-80% off upstream), a producer under no_grad took γ's gradient away. Such a
    match is left (grad_mode.mixed); without a region, or with nothing that requires
    grad, the same graph is rewritten."""
    torch.manual_seed(0)
    model = GradModeRegion(region)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast = coda_rewrite.optimize(model, fuse_in_training=True, min_fused_rows=0)
    cot = torch.randn(2, 6, D, generator=g)
    (fast(x1, res) * cot).sum().backward()
    (ref(x2, res) * cot).sum().backward()
    norm_codes = codes(fast.report, "residual_rmsnorm_gemm")
    assert norm_codes == (set() if region == "none" else {"grad_mode.mixed"}), \
        str(fast.report)
    pairs = [(("x", x1), x2), *zip(model.named_parameters(), ref.parameters())]
    for (name, p), q in pairs:
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or rel_err(p.grad, q.grad) <= 1e-5, name
    torch._dynamo.reset()
    frozen = copy.deepcopy(ref).requires_grad_(False)  # nothing to record, in either mode
    inference = coda_rewrite.optimize(frozen)
    same(inference(x, res), frozen(x, res), 1e-5)
    assert inference.report.count() == 1, str(inference.report)


# ---- bad input -----------------------------------------------------------------------

def test_mixed_dtypes_cast_between_norm_and_gemm():
    def body(self, x, res):
        z = res + self.w0(x.to(self.w0.weight.dtype)).float()
        h = rms(z, self.g.float())
        return self.w1(h.to(self.w1.weight.dtype))

    torch.manual_seed(0)
    model = Block(body)
    model.w0.to(torch.bfloat16)
    model.w1.to(torch.bfloat16)
    ref = copy.deepcopy(model)
    x, res = torch.randn(2, 6, D), torch.randn(2, 6, D)
    fast = coda_rewrite.optimize(model)
    got, want = fast(x, res), ref(x, res)
    assert got.dtype == want.dtype == torch.bfloat16
    assert rel_err(got, want) <= 1e-2
    rec = fast.report.records[0]
    assert rec.status == "rewritten", str(fast.report)
    producer, consumer = rec.programs
    assert producer.name == "residual_rmsnorm"  # through the GEMM output's upcast
    assert [o.dtype for o in producer.outputs] == ["float32", "bfloat16", "float32"]
    assert consumer.outputs[0].dtype == "bfloat16"
    assert "skipped" not in str(rec.decision.witness)


def test_eps_as_0d_tensor_is_read_at_run_time():
    def body(self, x, res):
        z = self.w0(x) + res
        zf = z.float()
        return self.w1(self.g * (zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True)
                                                  + self.eps)))

    torch.manual_seed(0)
    model = Block(body)
    model.register_buffer("eps", torch.tensor(0.5))  # large: a wrong eps would show
    ref = copy.deepcopy(model)
    x, res = torch.randn(2, 6, D), torch.randn(2, 6, D)
    fast = coda_rewrite.optimize(model)
    same(fast(x, res), ref(x, res), tol=1e-5)
    assert fast.report.count() == 1, str(fast.report)
    model.eps.fill_(2.0)
    ref.eps.fill_(2.0)
    same(fast(x, res), ref(x, res), tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_default_eps_is_atens_not_the_input_dtypes(dtype):
    """F.rms_norm / nn.RMSNorm with eps=None take the epsilon of the type ATen computes in
    (float32 for bf16 and fp16), not of the input's (bf16: 2⁻⁷): small rows, where the two
    give visibly different norms, come out as eager's. (A float16 norm with a weight is
    not deferred at all, side condition (f): its output is eager's.)"""
    def body(self, x, res):
        z = self.w0(x) + res
        return self.w1(F.rms_norm(z, (D,), self.g))

    torch.manual_seed(0)
    model = Block(body).to(dtype)
    ref = copy.deepcopy(model)
    x, res = torch.randn(2, 6, D, dtype=dtype) * 0.02, torch.randn(2, 6, D, dtype=dtype) * 0.02
    fast = coda_rewrite.optimize(model)
    got, want = fast(x, res), ref(x, res)
    assert fast.report.count() == (0 if dtype == torch.float16 else 1), str(fast.report)
    assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_eps_as_vector_is_left_alone():
    def body(self, x, res):
        z = self.w0(x) + res
        return self.w1(self.g * z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.eps))

    torch.manual_seed(0)
    model = Block(body)
    model.register_buffer("eps", torch.full((2, 6, 1), 1e-5))
    x, res = torch.randn(2, 6, D), torch.randn(2, 6, D)
    ref = copy.deepcopy(model)
    fast = coda_rewrite.optimize(model)
    same(fast(x, res), ref(x, res))
    assert fast.report.count() == 0
    assert codes(fast.report) == {"rmsnorm.eps"}, str(fast.report)


@pytest.mark.parametrize("dim", [1, 0])
def test_norm_over_a_dim_other_than_the_last(dim):
    report, got, want = run(lambda s, x, r: s.w1(rms(s.w0(x) + r, 1.0, dim=dim)))
    same(got, want)
    assert report.count() == 0
    assert codes(report) == {"rmsnorm.not_last_dim"}, str(report)


def test_output_hidden_states_agree_with_eager():
    model = hf_model("llama", layers=2).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        got = fast(ids, output_hidden_states=True)
        want = model(ids, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert rel_err(a, b) <= 1e-5
    assert rel_err(got.logits, want.logits) <= 1e-5
    # transformers breaks the graph before the LM head when it collects hidden states;
    # every norm whose consumer GEMM is in the same graph is still rewritten
    assert fast.report.count() >= 4, str(fast.report)


def test_non_contiguous_inputs():
    def body(self, x, res):
        return self.w1(rms(self.w0(x) + res, self.g))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, D, generator=g).transpose(0, 1)
    res = torch.randn(2, D, 6, generator=g).transpose(1, 2)
    assert not x.is_contiguous() and not res.is_contiguous()
    report, got, want = run(body, x, res)
    same(got, want, tol=1e-5)
    assert report.count() == 1
    ids = tokens(seq=32)[:, ::2]
    assert not ids.is_contiguous()
    model = hf_model("llama", layers=2).eval()
    with torch.no_grad():
        assert rel_err(coda_rewrite.optimize(model)(ids).logits, model(ids).logits) <= 1e-5


# ---- near misses ---------------------------------------------------------------------

def test_activation_between_norm_and_gemm():
    report, got, want = run(lambda s, x, r: s.w1(F.silu(rms(s.w0(x) + r, s.g))))
    same(got, want)
    assert report.count() == 0
    assert codes(report) == {"row_scale.op_between"}, str(report)
    assert "silu" in str(report)  # the report names the op


def test_gemm_contracting_over_the_normalised_rows():
    # h has shape [6, D]; W @ h contracts over the 6 rows
    def body(self, x, res):
        h = rms(self.w0(x) + res, self.g)
        return self.w1.weight[:6, :6] @ h

    g = torch.Generator().manual_seed(0)
    report, got, want = run(body, torch.randn(6, D, generator=g), torch.randn(6, D, generator=g))
    same(got, want)
    assert report.count() == 0
    assert codes(report) == {"row_scale.no_consumer_gemm"}, str(report)


def test_in_place_update_of_the_residual_after_the_norm():
    def body(self, x, res):
        z = self.w0(x) + res
        h = rms(z, self.g)
        z.mul_(2.0)
        return self.w1(h), z

    report, got, want = run(body)
    same(got, want)
    assert report.count() == 0
    assert codes(report) == {"row_scale.in_place"}, str(report)


def test_normalised_value_also_returned_is_materialised():
    def body(self, x, res):
        h = rms(self.w0(x) + res, self.g)
        return self.w1(h), h

    report, got, want = run(body)
    same(got, want, tol=1e-5)
    rec = report.records[0]
    assert rec.status == "rewritten" and rec.materialised, str(report)


def test_rows_gathered_before_the_gemm_move_r_with_them():
    def body(self, x, res):
        h = rms(self.w0(x) + res, self.g)
        idx = torch.tensor([5, 0, 3])
        return self.w1(h[:, idx]), self.w1(h[-1])

    report, got, want = run(body)
    same(got, want, tol=1e-5)
    assert report.count() == 1, str(report)
    assert report.records[0].consumer_decisions[0][1].accepted


def test_feature_slice_before_the_gemm_is_rejected():
    def body(self, x, res):
        h = rms(self.w0(x) + res, self.g)
        return F.linear(h[..., :16], self.w1.weight[:, :16])

    report, got, want = run(body)
    same(got, want)
    assert report.count() == 0
    assert codes(report) == {"row_scale.feature_index"}, str(report)


def test_gemm_output_read_twice_keeps_the_producer_unfused():
    def body(self, x, res):
        y = self.w0(x)
        h = rms(y + res, self.g)
        return self.w1(h) + y

    report, got, want = run(body)
    same(got, want, tol=1e-5)
    rec = report.records[0]
    assert rec.status == "rewritten" and "also read elsewhere" in rec.producer


def test_a_biased_producer_whose_epilogue_has_no_kernel_stays_cublas():
    """z = x·W0ᵀ + b0 + res: the bias lanes past N of a ragged tile are not loaded, so the
    producer's sum of squares has no kernel (it would run the reference: a float32 GEMM
    on a GPU). The producing GEMM stays as it is, the norm takes the row-wise program,
    the consumer is still row-scaled."""
    def body(self, x, res):
        h = rms(F.linear(x, self.w0.weight, self.g) + res, self.g)
        return self.w1(h)

    report, got, want = run(body)
    same(got, want, tol=1e-5)
    rec = report.records[0]
    assert rec.status == "rewritten", str(report)
    assert "has no kernel" in rec.producer and "row_sum" in rec.producer, rec.producer
    assert [p.name for p in rec.programs] == ["rmsnorm_rowscale", "rowscale"]


def test_producer_input_updated_before_the_residual_add_keeps_the_producer_unfused():
    """y = x·W0ᵀ, then x updated in place, then y + res: the fused producer runs at the
    add and would read the updated x; the GEMM stays as it is, the norm is still
    deferred (row-wise program)."""
    def body(self, x, res):
        x = x * 1.0
        y = self.w0(x)
        x.add_(1.0)
        return self.w1(rms(y + res, self.g)) + x.sum()

    report, got, want = run(body)
    same(got, want, tol=1e-5)
    rec = report.records[0]
    assert rec.status == "rewritten" and "between the producing GEMM and the residual add" \
        in rec.producer, str(report)
    assert [p.name for p in rec.programs] == ["rmsnorm_rowscale", "rowscale"]


@pytest.mark.provokes_pass_bug
def test_a_checker_crash_costs_the_rewrite_not_the_compile(monkeypatch, _no_pass_bugs):
    from coda_rewrite.algebra import row_scale

    def boom(*_):
        raise RuntimeError("planted")

    monkeypatch.setattr(row_scale, "decide", boom)
    report, got, want = run(lambda s, x, r: s.w1(rms(s.w0(x) + r, s.g)))
    same(got, want)
    assert report.count() == 0 and codes(report) == {"internal_error"}
    assert [r.kind.name for r in _no_pass_bugs] == ["INTERNAL_ERROR"]


def test_the_mask_prover_never_evaluates_what_it_cannot_reproduce():
    """The constant evaluation of gathered ids (packed-sequence masks) refuses
    uninitialised memory and random values, which may differ at run time."""
    import torch.fx as fx

    from coda_rewrite.algebra.mask import _uniform_constant
    for build in (lambda g: g.call_function(torch.empty, ((4,),), {"dtype": torch.int64}),
                  lambda g: g.call_function(torch.randint, (0, 2, (1,))),
                  lambda g: g.call_method("zero_", (g.call_function(
                      torch.zeros, ((4,),), {"dtype": torch.int64}),))):
        graph = fx.Graph()
        node = build(graph)
        for n in graph.nodes:
            n.meta["example_value"] = torch.zeros(4 if n.target is not torch.randint else 1,
                                                  dtype=torch.int64)
        assert _uniform_constant(node) is None
    graph = fx.Graph()  # and a truly constant one is evaluated
    node = graph.call_function(torch.zeros, ((4,),), {"dtype": torch.int64})
    node.meta["example_value"] = torch.zeros(4, dtype=torch.int64)
    assert _uniform_constant(node) == 0


def test_a_float16_norm_without_weight_is_still_deferred():
    """Side condition (f)'s look-alike on the allowed side: without a weight, h2 = z, the
    float16 stream eager itself holds, so no value leaves float16's range that eager's
    does not (a feature of the stream at 3·10⁴ here)."""
    def body(self, x, res):
        z = self.w0(x) + res
        return self.w1(F.rms_norm(z, (D,)))

    torch.manual_seed(0)
    model = Block(body).to(torch.float16)
    ref = copy.deepcopy(model)
    x, res = torch.randn(2, 6, D, dtype=torch.float16), torch.randn(2, 6, D, dtype=torch.float16)
    res[..., 3] = 3e4
    fast = coda_rewrite.optimize(model)
    got, want = fast(x, res), ref(x, res)
    assert fast.report.count() == 1, str(fast.report)
    assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-2


class NormAndRouter(nn.Module):
    """A norm read by a projection whose widths a kernel takes (N = 48) and by a router
    over 4 experts (N = 4: rows of 8 bytes, under the TMA's 16), in bf16."""

    def __init__(self, router_width: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.RMSNorm(64, eps=1e-6)
        self.proj = nn.Linear(64, 48, bias=False)
        self.router = nn.Linear(64, router_width, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.proj(h), self.router(h)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_consumer_no_kernel_can_take_is_left_on_the_gpu(on_gpu, monkeypatch):
    """On the GPU a consumer GEMM whose static widths break the kernels' layout contract
    (a router over 4 experts) would run its reference at every call: it is left reading
    the norm as eager computes it (row_scale.no_kernel), the other consumer still fused.
    On the CPU (the reference path for every fused call) both are fused. A stand-in for
    the GPU: family.on_gpu."""
    from coda_rewrite.patterns import family
    monkeypatch.setattr(family, "on_gpu", lambda t: on_gpu)
    model = NormAndRouter().to(torch.bfloat16).eval()
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    fast = coda_rewrite.optimize(copy.deepcopy(model), min_fused_rows=0)
    with torch.no_grad():
        (proj, router), (want_proj, want_router) = fast(x), model(x)
    (rec,) = [r for r in fast.report.records if r.pattern == "residual_rmsnorm_gemm"]
    assert rec.status == "rewritten", str(fast.report)
    decided = {where.split("(")[-1].rstrip(")"): d for where, d, _ in rec.consumer_decisions}
    assert decided["proj"].accepted
    assert decided["router"].accepted != on_gpu, str(fast.report)
    if on_gpu:
        assert decided["router"].code == "row_scale.no_kernel"
        assert "N=4 not a multiple of 8" in str(fast.report)
        assert torch.equal(router, want_router)  # eager's norm, eager's GEMM
    assert rel_err(proj, want_proj) <= 1e-2 and rel_err(router, want_router) <= 1e-2


def test_a_norm_no_consumer_kernel_can_take_is_left_on_the_gpu(monkeypatch):
    """Every consumer past the kernels' contract on the GPU: the norm is not rewritten,
    with the consumer's reason."""
    from coda_rewrite.patterns import family
    monkeypatch.setattr(family, "on_gpu", lambda t: True)
    model = nn.Sequential(nn.RMSNorm(64, eps=1e-6), nn.Linear(64, 60, bias=False))
    model = model.to(torch.bfloat16).eval()
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    fast = coda_rewrite.optimize(copy.deepcopy(model), min_fused_rows=0)
    with torch.no_grad():
        assert torch.equal(fast(x), model(x))
    (rec,) = [r for r in fast.report.records if r.pattern == "residual_rmsnorm_gemm"]
    assert rec.status != "rewritten" and rec.code == "row_scale.no_kernel", str(fast.report)


@pytest.mark.parametrize("vocab", [60, 64])
def test_an_lm_head_no_kernel_can_take_keeps_its_loss_on_the_gpu(vocab, monkeypatch):
    """On the GPU the LM head + loss rewrite is left where no generated kernel takes the
    head's GEMM (a vocabulary of 60: rows under 16 bytes, as GPT-2's 50257), with its
    reason (cross_entropy.no_kernel): the loss is eager's exactly. A vocabulary of 64 is
    rewritten."""
    from coda_rewrite.patterns import family
    monkeypatch.setattr(family, "on_gpu", lambda t: True)
    model = hf_model("llama", layers=1, vocab_size=vocab).to(torch.bfloat16).eval()
    ids = tokens(vocab=vocab)
    fast = coda_rewrite.optimize(copy.deepcopy(model), min_fused_rows=0,
                                 patterns=("lm_head_cross_entropy",))
    with torch.no_grad():
        loss, want = fast(ids, labels=ids).loss, model(ids, labels=ids).loss
    (rec,) = [r for r in fast.report.records if r.pattern == "lm_head_cross_entropy"]
    if vocab == 60:
        assert rec.status != "rewritten" and rec.code == "cross_entropy.no_kernel", \
            str(fast.report)
        assert torch.equal(loss, want)
    else:
        assert rec.status == "rewritten", str(fast.report)
        assert abs(loss.item() - want.item()) <= 1e-2 * abs(want.item())


# (model, dtype, training, config overrides, {pattern: the code it is left with on the GPU})
NO_KERNEL_CASES = {
    # float32: no generated kernel takes a float32 GEMM, so on the GPU every kernel family
    # is left (eager's numbers), not fused into calls that run their references
    "float32 llama": ("llama", torch.float32, False, {}, {
        "gated_mlp": "gated.no_kernel", "rope": "rope.no_kernel",
        "residual_rmsnorm_gemm": "row_scale.no_kernel",
        "lm_head_cross_entropy": "cross_entropy.no_kernel"}),
    "float32 layernorm": ("gpt_neox", torch.float32, True, {},
                          {"layernorm_gemm": "layernorm.no_kernel"}),
    "float32 experts": ("gpt_oss", torch.float32, False, {},
                        {"routed_experts": "routed_experts.no_kernel"}),
    # an intermediate width of 100: the pair store's half-width rows are 200 bytes
    "gated width": ("llama", torch.bfloat16, False, {"intermediate_size": 100},
                    {"gated_mlp": "gated.no_kernel"}),
    # QK-norm heads of 32 features: the kernel's per-head statistic needs 64, 128 or 256
    "qk-norm heads": ("qwen3", torch.bfloat16, False, {"head_dim": 32},
                      {"rope": "rope.no_kernel"}),
}


@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("case", list(NO_KERNEL_CASES))
def test_a_family_no_kernel_can_take_is_left_on_the_gpu(case, on_gpu, monkeypatch):
    """Each kernel family checks the graph's static widths and dtype at plan time
    (family.no_kernel): on the GPU (stood in through family.on_gpu) a match no generated
    kernel takes is left with its family's reason, where fused it would run its reference
    at every call, slower than the graph it replaced; on the CPU (the reference path for
    every fused call) the same match is rewritten. Either way the numbers are eager's."""
    from coda_rewrite.patterns import family
    monkeypatch.setattr(family, "on_gpu", lambda t: on_gpu)
    name, dtype, training, overrides, left = NO_KERNEL_CASES[case]
    model = hf_model(name, layers=1, **overrides).to(dtype).train(training)
    ids = tokens()
    fast = coda_rewrite.optimize(copy.deepcopy(model), min_fused_rows=0,
                                 fuse_in_training=True)
    with torch.set_grad_enabled(training):
        torch.manual_seed(0)
        got = fast(ids, labels=ids)
        torch.manual_seed(0)
        want = model(ids, labels=ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got.logits, want.logits) <= tol
    assert abs(got.loss.item() - want.loss.item()) <= tol * abs(want.loss.item())
    for pattern, code in left.items():
        records = [r for r in fast.report.records if r.pattern == pattern]
        assert records, str(fast.report)
        rewritten = [r for r in records if r.status == "rewritten"]
        if on_gpu:
            assert not rewritten, str(fast.report)
            assert code in {r.code for r in records}, str(fast.report)
        else:
            assert rewritten, str(fast.report)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_producer_no_kernel_can_take_is_left_on_the_gpu(on_gpu, monkeypatch):
    """A down projection over an intermediate width of 100 (K = 100: rows of 200 bytes)
    cannot form the final norm's statistics in its epilogue on the GPU: the norm is
    rewritten without it (row-wise), its GEMM left to cuBLAS with the reason
    (row_scale.producer_no_kernel). On the CPU it is the norm's producer."""
    from coda_rewrite.algebra.decision import code_of
    from coda_rewrite.patterns import family
    monkeypatch.setattr(family, "on_gpu", lambda t: on_gpu)
    model = hf_model("llama", layers=1, intermediate_size=100).to(torch.bfloat16).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(copy.deepcopy(model), min_fused_rows=0)
    with torch.no_grad():
        got, want = fast(ids).logits, model(ids).logits
    assert rel_err(got, want) <= 2e-2
    (final,) = [r for r in fast.report.records
                if r.pattern == "residual_rmsnorm_gemm" and r.path == "model.norm"]
    assert final.status == "rewritten", str(fast.report)
    if on_gpu:
        assert code_of(final.producer) == "row_scale.producer_no_kernel", str(fast.report)
        assert "K=100 not a multiple of 8" in final.producer
    else:
        assert "down_proj" in final.producer and not code_of(final.producer), final.producer
