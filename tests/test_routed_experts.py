"""Routed experts (patterns/routed_experts.py, kernels/grouped.py): Hugging Face MoE
models whose experts run grouped_mm, rewritten, against eager and a float64 copy (the
per-expert loop); routing edge cases; the look-alikes that must be left as they are,
each with its code; the grouped op's contract, fake and gradient refusal."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F

import coda_rewrite
from coda_rewrite.codegen import reference
from coda_rewrite.kernels import grouped
from coda_rewrite.numerics import rel_err
from coda_rewrite.patterns.routed_experts import down_program, gated_program

from conftest import codes

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
FAMILIES = {
    "mixtral": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      decoder_sparse_step=1),
    "qwen3_moe": dict(intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1),
    "olmoe": dict(intermediate_size=96, num_experts=8, num_experts_per_tok=2),
    "glm4_moe": dict(intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1),
    "granitemoe": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    # group-limited routing, a shared expert, multi-head latent attention (no GQA)
    "deepseek_v3": dict(intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
                        q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                        v_head_dim=32, num_key_value_heads=4),
    "gpt_oss": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["full_attention"] * 2),
    # the clamped SwiGLU silu(min(g, l))·clamp(u, -l, l) (the IR's swiglu_clamp)
    "deepseek_v4": dict(intermediate_size=96, num_local_experts=4, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, first_k_dense_replace=1, n_group=2, topk_group=1),
    "hy_v4": dict(intermediate_size=96, num_experts=4, num_local_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64, q_lora_rank=32, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                  first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
PAIR_PROGRAMS = {"gpt_oss": "experts_swiglu_oai", "deepseek_v4": "experts_swiglu_clamp",
         "hy_v4": "experts_swiglu_clamp"}


def moe_model(family: str, dtype=torch.bfloat16, seed: int = 0, **overrides):
    """(the model, a float64 copy running the per-expert loop) from a tiny config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).to(dtype).eval()
    with torch.no_grad():  # router logits 30x apart: a token whose top-k nearly ties is
        for name, p in model.named_parameters():  # routed by rounding noise, eager's or
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # the rewrite's,
                p.mul_(30.0)  # and the comparison would count the flipped tokens
    exact = AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).double().eval()
    exact.load_state_dict(model.state_dict())
    exact.set_experts_implementation("eager")
    assert model.config._experts_implementation == "grouped_mm"
    return model, exact


def _check(model, exact, ids, moe_layers: int):
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        got, want, truth = fast(ids).logits, model(ids).logits, exact(ids).logits
    done = [r for r in fast.report.records if r.pattern == "routed_experts"]
    assert len(done) == moe_layers and all(r.status == "rewritten" for r in done), \
        str(fast.report)
    if model.dtype == torch.float32:
        assert rel_err(got, want) <= 1e-5
    else:
        assert rel_err(got.double(), truth) <= 1.25 * rel_err(want.double(), truth)
    return fast.report


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_models_rewritten_no_worse_than_eager(family):
    model, exact = moe_model(family)
    moe_layers = 1 if family in ("glm4_moe", "deepseek_v3", "hy_v4") else 2  # layer 0 dense
    report = _check(model, exact, torch.randint(3, 128, (2, 16)), moe_layers)
    rec = next(r for r in report.records if r.pattern == "routed_experts")
    assert [p.name for p in rec.programs] == [PAIR_PROGRAMS.get(family, "experts_swiglu"),
                                              "experts_combine"]
    assert "gathered by the GEMM's row read" in rec.producer
    if family in ("deepseek_v4", "hy_v4"):  # their norms are not multiplied back
        return  # (rmsnorm.not_multiplied_back: no deferred row scale to follow)
    # the post-attention norm's row scale deferred into the experts' GEMM: r per routed
    # row in the epilogue, the normalised tokens never written
    assert "row scale deferred through the routing" in rec.producer
    assert [i.op for i in rec.programs[0].body][:1] == ["mul"]  # acc · r first
    norms = [r for r in report.records if r.path.endswith("post_attention_layernorm")]
    assert norms and all(r.status == "rewritten" for r in norms)


def test_gpt_oss_experts_with_clamps_that_bite():
    """gpt-oss's experts ([E, K, N] weights, interleaved lanes, biases gathered by expert
    id, the clamped SwiGLU) with a limit that clamps a third of the pre-activations and
    large biases: both sides of both clamps are exercised; each bias lands on its
    expert's rows."""
    model, exact = moe_model("gpt_oss")
    for m in (model, exact):
        for layer in m.model.layers:
            layer.mlp.experts.limit = 0.5
            with torch.no_grad():
                layer.mlp.experts.gate_up_proj_bias.normal_(0, 1.0, generator=torch.Generator()
                                                            .manual_seed(1))
                layer.mlp.experts.down_proj_bias.normal_(0, 1.0, generator=torch.Generator()
                                                         .manual_seed(2))
    exact.load_state_dict(model.state_dict())
    report = _check(model, exact, torch.randint(0, 128, (2, 16)), 2)
    rec = next(r for r in report.records if r.pattern == "routed_experts")
    oai = next(i for i in rec.programs[0].body if i.op == "swiglu_oai")
    assert oai.args[1:] == (1.702, 0.5)
    assert "bias" in rec.biases and "N-contiguous" in rec.weights


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_report_names_an_experts_implementation_not_rewritten(impl):
    """A model whose experts run transformers' per-expert loop: nothing of them is a
    candidate (the loop breaks the graph), so the report says so at the model level, with
    the code and the switch that gets the fused path. grouped_mm and batched_mm are
    rewritten (tests/test_batched_experts.py): nothing to say."""
    model, _ = moe_model("qwen3_moe")
    model.set_experts_implementation(impl)
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        fast(torch.randint(0, 128, (2, 8)))
    notes = fast.report.notes
    if impl in ("grouped_mm", "batched_mm"):
        assert not notes
        return
    (note,) = notes
    assert f"experts_implementation={impl!r}" in note and "[moe.implementation]" in note
    assert "2 experts module(s) (model.layers.0.mlp.experts" in note
    assert f"note: {note}" in str(fast.report)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_float32_models_take_transformers_fallback_op(family):
    """In float32, transformers routes grouped_mm through its own custom op under
    torch.compile (transformers::grouped_mm_fallback): the same product, rewritten."""
    model, exact = moe_model(family, torch.float32)
    _check(model, exact, torch.randint(0, 128, (2, 16)), 2)


@pytest.mark.parametrize("case", ["top1", "one_expert", "empty_experts", "one_token"])
def test_routing_edge_cases(case):
    overrides = {"top1": dict(num_experts_per_tok=1),
                 "one_expert": dict(num_experts_per_tok=1),
                 "empty_experts": dict(num_experts=16, num_experts_per_tok=1),
                 "one_token": {}}[case]
    model, exact = moe_model("qwen3_moe", **overrides)
    if case == "one_expert":  # equal router logits: top-1 is expert 0 for every token
        for layer in (model, exact):
            for block in layer.model.layers:
                torch.nn.init.zeros_(block.mlp.gate.weight)
    ids = torch.randint(0, 128, (1, 1) if case == "one_token" else (2, 3 if
                                                                     case == "empty_experts"
                                                                     else 16))
    _check(model, exact, ids, 2)


# ---- look-alikes: hand-written experts in the grouped_mm spelling ----------------------------

def _gmm(a, b, offs):
    """torch._grouped_mm (16-bit under dynamo); the float64 copy's truth in the
    reference's loop (torch's kernel takes no float64)."""
    if a.dtype == torch.float64:
        return reference.grouped_mm(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


def to_tokens(o, perm, tokens: int, top_k: int, case: str = "canonical"):
    """The routed rows back in token order, summed over each token's top-k (Hugging
    Face's scatter back), or a look-alike of it (``case``)."""
    if case == "inverse_by_argsort":  # the same inverse, not built by a write of perm
        return o[torch.argsort(perm)].view(tokens, top_k, -1).sum(dim=1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    if case == "inverse_updated":  # written again after the inverse was made
        inv[:1] = inv[:1].clone()
    if case == "tokens_strided":  # token t's rows t, T + t, ...: not its own k rows
        return o[inv].view(top_k, tokens, -1).sum(dim=0)
    return o[inv].view(tokens, top_k, -1).sum(dim=1)


class Experts(torch.nn.Module):
    """Hugging Face's grouped_mm experts, written out, with one thing changed by ``case``."""

    def __init__(self, case: str = "canonical", experts=4, hidden=32, inter=16, top_k=2,
                 dtype=torch.bfloat16):
        super().__init__()
        self.case, self.e, self.top_k = case, experts, top_k
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(experts, hidden, generator=g).to(dtype))
        layout = (experts, hidden, 2 * inter) if case == "kn_weights" else \
            (experts, 2 * inter, hidden)
        self.gate_up = torch.nn.Parameter(
            (torch.randn(layout, generator=g) / hidden ** 0.5).to(dtype))
        self.down = torch.nn.Parameter(
            (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype))
        if case == "halves_bias":
            self.bias = torch.nn.Parameter(torch.randn(experts, 2 * inter, generator=g).to(dtype))

    def forward(self, h):
        case = self.case
        probs = F.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        w, ids = top_w.to(h.dtype).reshape(-1), top_i.reshape(-1)
        ids_g, perm = torch.sort(ids)
        x = h[perm // self.top_k]
        if case == "extra_token":  # one more row than tokens: not every row gathered k times
            x = torch.cat((h, h[:1])).__getitem__(perm // self.top_k)
        if case == "other_divisor":  # tokens gathered k + 1 times, some not at all
            x = h[perm // (self.top_k + 1)]
        if case == "perm_updated":  # the permutation changed after the index was made
            index = perm // self.top_k
            x = h[index]
            perm.add_(0)
        if case == "index_clamped":  # the same rows, through an index no sort made
            x = h[(perm // self.top_k).clamp(max=h.shape[0] - 1)]
        w_g = w[perm]
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=self.e, min=0, max=self.e - 1),
                            dim=0, dtype=torch.int32)
        if case == "offsets_by_comparison":  # the same counts, not by histc
            counts = (ids_g[None, :] == torch.arange(self.e)[:, None]).sum(-1)
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        if case == "offsets_updated":  # the same values, updated in place
            offs.add_(0)
        mask = (ids_g >= self.e).unsqueeze(-1)
        if case == "source_updated":  # after the gather: eager's rows are the old ones
            h = h * 1.0
            x = h[perm // self.top_k]
            h.add_(1.0)
        if case == "source_base_updated":  # the tensor the gathered source is a view of
            base = h * 1.0
            h = base.view(-1, base.shape[-1])
            x = h[perm // self.top_k]
            base.add_(1.0)
        in_mask = (ids_g >= self.e - 1).unsqueeze(-1) if case == "input_fill_other_rows" \
            else mask
        x.masked_fill_(in_mask, 0.0)
        b = self.gate_up if case == "kn_weights" else self.gate_up.mT if case == "mT" else \
            self.gate_up.transpose(-2, -1)
        p = _gmm(x, b, offs)
        if case == "halves_bias":  # gpt-oss's per-expert bias, on [gate; up] halves
            p = p + self.bias[ids_g]
        if case == "elementwise_fill":  # the first gate column too: not whole rows
            mask = mask | (torch.arange(p.shape[-1]) == 0)
        p = p.masked_fill(mask, 0.0)
        extra = ()
        if case == "gate_up_read":
            extra = (p.sum(),)
        if case == "gate_up_in_place":
            p.mul_(1.5)
        gate, up = p.chunk(2, dim=-1)
        if case == "gate_read":
            extra = (gate.sum(),)
        if case == "up_first":
            gate, up = up, gate
        if case.startswith("clamped"):  # DeepSeek-V4's clamped SwiGLU, and look-alikes
            lim = 0.6  # small enough that both clamps bite
            gate = gate.clamp(min=-lim if case == "clamped_gate_below" else None, max=lim)
            up = up.clamp(min=None if case == "clamped_up_one_side" else -lim,
                          max=2 * lim if case == "clamped_up_limit_differs" else lim)
        if case == "clamped_gelu":
            y = F.gelu(gate, approximate="tanh") * up
        elif case == "clamped_up_first":
            y = up * F.silu(gate)
        else:
            y = F.silu(gate) * up
        if case == "product_read":
            extra = (y.sum(),)
        if case == "product_in_place":
            y.mul_(2.0)
        offs_d = offs.clone() if case == "other_offsets" else offs
        o = _gmm(y, self.down.transpose(-2, -1), offs_d)
        o = o.masked_fill(mask, 1.0 if case == "fill_one" else 0.0)
        if case == "feature_weights":
            o = o * w_g.unsqueeze(-1).expand(-1, o.shape[-1]).contiguous()
        else:
            o = o * w_g.unsqueeze(-1)
        out = to_tokens(o, perm, h.shape[0], self.top_k, case)
        return (out, *extra) if extra else out


LOOK_ALIKES = {
    "canonical": None,
    "feature_weights": None,        # not a combine: the down GEMM runs without it, fused
    "gate_up_read": "moe.intermediate_read",
    "gate_up_in_place": "moe.in_place",
    "gate_read": "moe.intermediate_read",
    "product_read": "moe.no_down_projection",
    "product_in_place": "moe.no_down_projection",
    "other_offsets": "moe.offsets_differ",
    "input_fill_other_rows": "moe.input_fill",
    "up_first": "moe.activation",
    "kn_weights": "moe.weight_layout",  # [E, K, 2I] split into halves: no kernel reads it
    "mT": None,                     # W.mT: the same transpose as W.transpose(-2, -1)
    "halves_bias": "moe.weight_layout",  # a bias over the halves: no kernel adds it
    "elementwise_fill": "moe.fill_not_rows",  # fills gate and up entries apart
    "source_updated": "moe.in_place",         # the gathered source updated after the gather
    "source_base_updated": "moe.in_place",    # ... through the tensor it is a view of
    "offsets_updated": "moe.in_place",        # offsets updated in place (not placed)
    "fill_one": "moe.fill_value",             # a fill the router weight would scale
    "clamped": None,                          # silu(min(g, l))·clamp(u, -l, l)
    "clamped_up_first": None,                 # the product's operands swapped
    "clamped_gate_below": "moe.activation",   # the gate clamped on both sides
    "clamped_up_one_side": "moe.activation",
    "clamped_up_limit_differs": "moe.activation",
    "clamped_gelu": "moe.activation",         # a clamped GeGLU: no op of the IR
}


def check_look_alike(model, expected: str | None):
    """A look-alike's outputs equal eager's (no worse against float64); rewritten where
    ``expected`` is None, else left with that code."""
    torch.manual_seed(0)  # 64 tokens: with a handful, a few roundings decide the ratio
    h = torch.randn(64, 32).bfloat16()
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        got, want, truth = fast(h), ref(h), exact(h.double())
    got, want, truth = (got, want, truth) if isinstance(got, tuple) else \
        ((got,), (want,), (truth,))
    for a, b, t in zip(got, want, truth):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a.double(), t) <= 1.5 * rel_err(b.double(), t) + 1e-6, model.case
    records = [r for r in fast.report.records if r.pattern == "routed_experts"]
    if expected is None:
        assert [r.status for r in records] == ["rewritten"], str(fast.report)
    else:
        assert expected in codes(fast.report, "routed_experts"), str(fast.report)


@pytest.mark.parametrize("case", list(LOOK_ALIKES))
def test_look_alikes(case):
    """Each look-alike's outputs equal eager's; the spellings the rewrite takes are
    rewritten, the others left with their code."""
    check_look_alike(Experts(case), LOOK_ALIKES[case])


class TitanMoE(torch.nn.Module):
    """TorchTitan's MoE spelling (torchtitan/models/moe): top-k of a softmax router,
    histc counts, a stable argsort, rows gathered by torch.gather, SwiGLU over two
    grouped GEMMs of separate w1 and w3 (no packed [gate; up]), the scores applied after
    the experts, scatter_add back to token order."""

    def __init__(self, dim=32, hidden=16, experts=4, top_k=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(experts, hidden, dim, generator=g)
                                               / dim ** 0.5) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(experts, dim, hidden, generator=g)
                                     / hidden ** 0.5)
        self.e, self.k = experts, top_k

    def forward(self, x):
        scores = F.softmax(self.gate(x).float(), dim=1)
        top_scores, chosen = torch.topk(scores, k=self.k, dim=1)
        counts = torch.histc(chosen.view(-1).float(), bins=self.e, min=0, max=self.e)
        order = torch.argsort(chosen.view(-1), stable=True)
        top_sorted, rows = top_scores.view(-1)[order], order // self.k
        routed = torch.gather(x, 0, rows.reshape(-1, 1).expand(-1, x.shape[1]))
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(routed.bfloat16(), self.w1.bfloat16().transpose(-2, -1),
                                     offs=offs))
        h = h * torch._grouped_mm(routed.bfloat16(), self.w3.bfloat16().transpose(-2, -1),
                                  offs=offs)
        out = torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)
        out = (out.float() * top_sorted.reshape(-1, 1)).to(x.dtype)
        index = rows.reshape(-1, 1).expand(-1, x.shape[1])
        return x + torch.zeros_like(x).scatter_add(0, index, out)


def test_torchtitan_experts_are_left_with_their_reason():
    """TorchTitan's separate w1/w3 grouped GEMMs are not the packed [gate; up] the family
    takes: left, said, and the outputs are eager's to the bit."""
    model = TitanMoE().to(torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        fast = coda_rewrite.optimize(model, min_fused_rows=0)
        assert torch.equal(fast(x), want)
    assert set(codes(fast.report, "routed_experts")) == {"moe.not_halves"}, str(fast.report)


# whether the grouped kernels may trust the routing's values without a device-side check
# per launch (algebra/routed_experts.routing_in_bounds): offsets = cumsum(histc) and
# index = a sort's permutation // top-k hold their bounds whatever the router computed
ROUTING_PROVED = {"canonical": True, "offsets_by_comparison": False, "index_clamped": False}


def _rewritten_for_inference(case: str):
    """(the optimize()d Experts(case), its routed-experts record): outputs checked
    against eager's first (check_look_alike), the record taken from a no_grad call."""
    model = Experts(case)
    check_look_alike(model, None)
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        fast(torch.randn(8, 32).bfloat16())
    (rec,) = [r for r in fast.report.records if r.pattern == "routed_experts"]
    return fast, rec


@pytest.mark.parametrize("case", list(ROUTING_PROVED))
def test_routing_bounds_proved_or_checked_per_launch(case):
    """Every spelling is rewritten with eager's outputs; the report says whether the
    routing's bounds were proved from the graph or are checked on the device."""
    fast, rec = _rewritten_for_inference(case)
    proved = "hold by construction" in rec.routing
    assert proved == ROUTING_PROVED[case], rec.routing
    assert proved or "checked on the device at each launch" in rec.routing
    assert f"routing: {rec.routing}" in str(fast.report)


# the scatter back's family (patterns/scatter_back.py): taken, or left with a code (None:
# not a candidate at all)
SCATTER_BACK = {"canonical": "rewritten", "index_clamped": "rewritten",
                "feature_weights": "rewritten", "inverse_by_argsort": None,
                "inverse_updated": "scatter.inverse", "tokens_strided": "scatter.grouping"}


@pytest.mark.parametrize("case", list(SCATTER_BACK))
def test_scatter_back_as_gathers_in_token_order(case):
    """Inference: the scatter back after the experts runs as k row gathers added per token
    (routing.sum_to_tokens) only where inv is built once as a sort permutation's inverse
    and each token's k rows are consecutive — whatever the gather index or the rows'
    producer; the outputs are eager's either way."""
    fast, _ = _rewritten_for_inference(case)
    back = [r for r in fast.report.records if r.pattern == "scatter_back"]
    graph = str(fast.report)[str(fast.report).index("rewritten graph:"):]
    expected = SCATTER_BACK[case]
    assert ("sum_to_tokens" in graph) == (expected == "rewritten")
    if expected is None:
        assert not back, str(fast.report)
    elif expected == "rewritten":
        assert [r.status for r in back] == ["rewritten"], str(fast.report)
        assert "gathered and added in token order" in back[0].producer
    else:
        assert codes(fast.report, "scatter_back") == {expected}, str(fast.report)


def test_scatter_back_taken_where_the_experts_are_left():
    """The experts refused (a second reader of the gate/up output): the scatter back after
    torch's grouped_mm is still rewritten, with eager's outputs."""
    model = Experts("gate_up_read")
    check_look_alike(model, "moe.intermediate_read")
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        fast(torch.randn(8, 32).bfloat16())
    statuses = {r.pattern: r.status for r in fast.report.records}
    assert statuses["routed_experts"] != "rewritten" and \
        statuses["scatter_back"] == "rewritten", str(fast.report)


@pytest.mark.parametrize("train", [False, True])
def test_dynamic_shapes_keep_the_scatter_back_and_eager_numbers(train):
    """torch.compile(dynamic=True), as a server sees varying token counts: the experts
    rewritten once for every size, the scatter back still taken (its arange's length and
    the view's sizes symbolic), outputs and the input's gradient no worse than eager's
    against float64 at two sizes."""
    torch.manual_seed(0)
    model = Experts("canonical", hidden=64, inter=64)
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    torch._dynamo.reset()
    seen = len(coda_rewrite.last_report().records)  # the session's earlier graphs
    fast = torch.compile(model, backend="coda", dynamic=True)
    for tokens in (64, 96):
        h = torch.randn(tokens, 64)
        xs = [h.bfloat16().requires_grad_(train), h.bfloat16().requires_grad_(train),
              h.double().requires_grad_(train)]
        with torch.set_grad_enabled(train):
            outs = [f(x) for f, x in zip((fast, ref, exact), xs)]
        assert rel_err(outs[0].double(), outs[2]) <= 1.5 * rel_err(outs[1].double(), outs[2])
        if train:
            r = torch.randn(outs[0].shape, dtype=torch.float64)
            for o in outs:
                (o.double() * r).sum().backward()
            assert rel_err(xs[0].grad.double(), xs[2].grad) <= \
                1.5 * rel_err(xs[1].grad.double(), xs[2].grad) + 1e-6
    records = coda_rewrite.last_report().records[seen:]
    for family in ("routed_experts", "scatter_back"):
        assert {r.status for r in records if r.pattern == family} == {"rewritten"}, family
    if train:
        assert all("a gather by" in r.backward for r in records if r.pattern == "scatter_back")


@pytest.mark.parametrize("top_k", [1, 2, 8, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_back_to_tokens_sums_each_tokens_rows(top_k, dtype):
    """routing.back_to_tokens (k gathers added, or the indexed reduction past 16 rows per
    token): each token's k rows summed, in float32 for 16-bit rows with one rounding."""
    from coda_rewrite import routing
    g = torch.Generator().manual_seed(top_k)
    tokens, n = 5, 24
    perm = torch.randperm(tokens * top_k, generator=g)
    rows = torch.randn(tokens * top_k, n, generator=g).to(dtype)
    got = routing.back_to_tokens(rows, routing.inverse_permutation(perm), top_k)
    want = torch.zeros(tokens, n, dtype=torch.float64)
    want.index_add_(0, perm // top_k, rows.double())
    size = torch.zeros(tokens, n, dtype=torch.float64).index_add_(
        0, perm // top_k, rows.double().abs())  # Σ |terms|: the float32 sum's error scale
    assert got.dtype == dtype and got.shape == (tokens, n)
    if dtype == torch.float64:
        assert rel_err(got, want) <= 1e-15
    else:  # summed in float32, rounded to bf16 once: within half a bf16 ulp of the exact
        # sum, elementwise (a sum in bf16, rounded at every add, is not)
        assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 2 ** -20 * size).all()


def test_feature_weights_are_not_a_combine():
    model = Experts("feature_weights")
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        fast(torch.randn(8, 32).bfloat16())
    rec = next(r for r in fast.report.records if r.pattern == "routed_experts")
    assert [p.name for p in rec.programs] == ["experts_swiglu", "experts_down"]


class OaiExperts(torch.nn.Module):
    """gpt-oss's experts in transformers' grouped_mm spelling ([E, K, N] weights, each
    expert's bias gathered by the sorted expert ids and added in place, interleaved
    (gate, up) lanes, the clamped SwiGLU), with one thing changed by ``case``; a limit
    small enough that both clamps bite."""

    def __init__(self, case: str = "canonical", experts=4, hidden=32, inter=16, top_k=2,
                 dtype=torch.bfloat16, limit=0.6):
        super().__init__()
        self.case, self.e, self.top_k, self.limit, self.alpha = case, experts, top_k, limit, 1.702
        g = torch.Generator().manual_seed(0)

        def param(*shape, scale=1.0):
            return torch.nn.Parameter((torch.randn(shape, generator=g) * scale).to(dtype))
        self.router = param(experts, hidden)
        self.gate_up = param(experts, hidden, 2 * inter, scale=hidden ** -0.5)
        self.gate_up_bias = param(experts, 2 * inter, scale=0.5)
        self.down = param(experts, inter, hidden, scale=inter ** -0.5)
        self.down_bias = param(experts, hidden, scale=0.5)

    def forward(self, h):
        case, lim = self.case, self.limit
        logits = F.linear(h, self.router)
        top_v, top_i = torch.topk(logits, self.top_k, dim=-1)
        w = F.softmax(top_v, dim=1, dtype=top_v.dtype).reshape(-1)
        ids = top_i.reshape(-1)
        ids_g, perm = torch.sort(ids)
        x = h[perm // self.top_k]
        w_g = w[perm]
        # another cast before the count (transformers counts ids.int() on CUDA, which
        # the CPU histc does not take)
        counted = ids_g.double() if case == "counted_as_double" else ids_g.float()
        hist = torch.histc(counted, bins=self.e, min=0,
                           max=self.e if case == "histc_range" else self.e - 1)
        offs = torch.cumsum(hist, dim=0, dtype=torch.int32)
        mask = (ids_g >= self.e).unsqueeze(-1)
        ids_g.clamp_(max=self.e - (2 if case == "ids_clamped_lower" else 1))
        b_gu = self.gate_up_bias[ids if case == "bias_unsorted_ids" else ids_g]
        x.masked_fill_(mask, 0.0)
        p = _gmm(x, self.gate_up, offs)
        if case == "bias_after_fill":
            p = p.masked_fill(mask, 0.0) + b_gu
        else:
            p.add_(b_gu)
            p = p.masked_fill(mask, 0.0)
        gate, up = p[..., ::2], p[..., 1::2]
        if case == "odd_gate":
            gate, up = up, gate
        raw = gate
        gate = gate.clamp(min=-lim if case == "gate_clamped_below" else None, max=lim)
        up = up.clamp(min=-lim, max=2 * lim if case == "up_limit_differs" else lim)
        glu = gate * torch.sigmoid((raw if case == "sigmoid_unclamped" else gate) * self.alpha)
        y = (up + (2 if case == "shift_two" else 1)) * glu
        extra = (glu.sum(),) if case == "glu_read" else ()
        o = _gmm(y, self.down, offs)
        o.add_(self.down_bias[ids_g])
        o = o.masked_fill(mask, 0.0) * w_g.unsqueeze(-1)
        out = to_tokens(o, perm, h.shape[0], self.top_k)
        return (out, *extra) if extra else out


OAI_LOOK_ALIKES = {
    "canonical": None,
    "counted_as_double": None,
    "bias_unsorted_ids": "moe.bias_index",     # the bias gathered by the unsorted ids
    "ids_clamped_lower": "moe.bias_index",     # the last expert's rows take another bias
    "histc_range": "moe.bias_index",           # bins over [0, E]: not one per expert
    "bias_after_fill": "moe.not_halves",       # the bias added after the rows are filled
    "odd_gate": "moe.not_halves",              # the gate in the odd lane
    "gate_clamped_below": "moe.activation",
    "up_limit_differs": "moe.activation",
    "sigmoid_unclamped": "moe.intermediate_read",  # the sigmoid reads the unclamped gate
    "shift_two": "moe.activation",             # (u + 2): not gpt-oss's activation
    "glu_read": "moe.activation",              # g·sigmoid(α·g) also returned
}


@pytest.mark.parametrize("case", list(OAI_LOOK_ALIKES))
def test_gpt_oss_look_alikes(case):
    """Each gpt-oss look-alike's outputs equal eager's (both clamps biting); the spelling
    the rewrite takes is rewritten, the others left with their code."""
    check_look_alike(OaiExperts(case), OAI_LOOK_ALIKES[case])


@pytest.mark.provokes_pass_bug
def test_gpt_oss_witness_refuses_biases_of_other_rows(monkeypatch):
    """The float64 replay feeds the bias gather the expert ids the offsets count: with
    each id shifted by one expert it disagrees, and the rewrite is refused."""
    from coda_rewrite.algebra import routed_experts as legality
    real = legality._inputs

    def shifted(m):
        v = real(m)
        v["ids"] = (v["ids"] + 1) % v["n_exp"]
        return v
    monkeypatch.setattr(legality, "_inputs", shifted)
    with torch.no_grad():
        fast = coda_rewrite.optimize(OaiExperts())
        fast(torch.randn(8, 32).bfloat16())
    (rec,) = [r for r in fast.report.records if r.pattern == "routed_experts"]
    assert rec.status == "rejected" and rec.code == "witness.disagrees", str(fast.report)


class NormedExperts(torch.nn.Module):
    """A GEMM, the residual add, an RMSNorm and the experts reading its output (the
    post-attention block of an MoE decoder), with one thing changed by ``case``."""

    def __init__(self, case: str = "plain", hidden=32, dtype=torch.bfloat16):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.case = case
        self.proj = torch.nn.Parameter((torch.randn(hidden, hidden, generator=g) *
                                        hidden ** -0.5).to(dtype))
        self.gamma = torch.nn.Parameter((1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype))
        self.experts = Experts(hidden=hidden, dtype=dtype)

    def forward(self, x, res):
        z = res + F.linear(x, self.proj)
        zf = z.float()
        h = self.gamma * (zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(z.dtype)
        h = h.reshape(-1, h.shape[-1])
        if self.case == "scaled":  # a per-feature factor between the norm and the experts
            h = h * 2.0
        out = self.experts(h)
        return (out, h) if self.case == "norm_returned" else out


@pytest.mark.parametrize("case,deferred", [("plain", True), ("norm_returned", True),
                                           ("scaled", False)])
def test_norm_rstd_deferred_through_the_routing(case, deferred):
    """The norm's row scale moves through the routing into the gate/up grouped GEMM
    (h2's rows read, r per routed row in the epilogue) where the experts read the norm's
    output through views; with a per-feature factor between them the experts read the
    normalised value as it is. Every output no worse than eager against float64."""
    torch.manual_seed(0)  # 64 tokens: with 8, a few roundings decide the ratio to eager's
    model = NormedExperts(case)
    x, res = torch.randn(4, 16, 32).bfloat16(), torch.randn(4, 16, 32).bfloat16()
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        got, want, truth = fast(x, res), ref(x, res), exact(x.double(), res.double())
    got, want, truth = (got, want, truth) if isinstance(got, tuple) else \
        ((got,), (want,), (truth,))
    for a, b, t in zip(got, want, truth):
        assert rel_err(a.double(), t) <= 1.5 * rel_err(b.double(), t) + 1e-6, case
    (rec,) = [r for r in fast.report.records if r.pattern == "routed_experts"]
    (norm,) = [r for r in fast.report.records if r.pattern == "residual_rmsnorm_gemm"]
    assert rec.status == "rewritten" and norm.status == "rewritten", str(fast.report)
    assert ("deferred through the routing" in rec.producer) == deferred, rec.producer
    graph = str(fast.report)[str(fast.report).index("rewritten graph:"):]
    assert ("rsqrt" in graph) == (case != "plain"), case  # the norm materialised or not


@pytest.mark.parametrize("case", ["canonical", "feature_weights", "oai", "extra_token",
                                  "other_divisor", "perm_updated", "inverse_by_argsort",
                                  "inverse_updated", "tokens_strided"])
def test_training_gradients_no_worse_than_eager(case):
    """A training graph: the experts fused, their backward in the down projection's
    dgrad epilogue and the gate/up GEMM's rules; the output
    and every gradient (the input's, the router's through the combine weight, both
    expert weights) against the float64 copy no worse than eager's."""
    # 64 tokens: with fewer, one pre-activation whose bf16 rounding lands on the other
    # side of a clamp (or a ReLU-like kink) than its float64 value decides the ratio
    torch.manual_seed(0)
    size = dict(hidden=64, inter=64)
    model = OaiExperts(**size) if case == "oai" else Experts(case, **size)
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    h = torch.randn(64, 64)
    xs = [h.bfloat16().requires_grad_(), h.bfloat16().requires_grad_(),
          h.double().requires_grad_()]
    fast = coda_rewrite.optimize(model)
    outs = [f(x) for f, x in zip((fast, ref, exact), xs)]
    r = torch.randn(outs[0].shape)
    before = _dgated_routed_calls()
    for o in outs:
        (o.double() * r.double()).sum().backward()
    done = [rec for rec in fast.report.records if rec.pattern == "routed_experts"]
    assert [rec.status for rec in done] == ["rewritten"], str(fast.report)
    # the down projection's backward in its dgrad epilogue (kernels/grouped_dgated.py)
    assert _dgated_routed_calls() == before + 1 and "dgrad epilogue" in done[0].backward
    assert "backward: " in str(fast.report)
    # the tokens' gradient summed per token after the inverse permutation only where the
    # index is perm // top_k over exactly the gathered source's rows, perm not updated
    summed = case not in ("extra_token", "other_divisor", "perm_updated")
    assert ("after the inverse of" in done[0].backward) == summed, done[0].backward
    # the scatter back's gradient a gather (patterns/scatter_back.py) only where inv is
    # built once as a sort permutation's inverse, not updated, and each token's k
    # consecutive rows are summed
    gathered = case not in ("perm_updated", "inverse_by_argsort", "inverse_updated",
                            "tokens_strided")
    back = [rec for rec in fast.report.records if rec.pattern == "scatter_back"]
    assert any(rec.status == "rewritten" for rec in back) == gathered, str(fast.report)
    assert all("a gather by" in rec.backward for rec in back if rec.status == "rewritten")
    assert "gradients" in done[0].decision.witness
    pairs = [(outs[0], outs[1], outs[2]), (xs[0].grad, xs[1].grad, xs[2].grad)]
    pairs += [(p.grad, q.grad, t.grad) for p, q, t in zip(
        model.parameters(), ref.parameters(), exact.parameters())]
    for got, want, truth in pairs:
        assert rel_err(got.double(), truth) <= 1.5 * rel_err(want.double(), truth) + 1e-6


# ---- the grouped op ------------------------------------------------------------------------

def _problem(dtype=torch.bfloat16, experts=4, tokens=6, k=32, inter=16, rows=10):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, k, generator=g).to(dtype)
    w = torch.randn(experts, 2 * inter, k, generator=g).to(dtype)
    index = torch.randint(0, tokens, (rows,), generator=g)
    offsets = torch.tensor([0, 3, 3, rows - 2], dtype=torch.int32)
    return h, w, offsets, index


def test_grouped_reference_is_the_gather_then_grouped_gemm():
    """The op's reference against the spelling it replaces, in float64: rows gathered,
    per-expert GEMMs (an expert with no rows, two rows past the last offset: zero), the
    [gate; up] halves, act(gate)·up."""
    h, w, offsets, index = _problem(torch.float64)
    prog = gated_program("swiglu", torch.float64)
    (y,) = grouped.execute(prog.to_text(), h, w, offsets, index, [])
    x = h[index]
    want = torch.zeros(10, 16, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        gate, up = (x[start:end] @ w[e].T).chunk(2, dim=-1)
        want[start:end] = F.silu(gate) * up
        start = end
    assert rel_err(y, want) <= 1e-12


def test_grouped_op_fake_and_gradient_refusal():
    from torch._subclasses.fake_tensor import FakeTensorMode
    h, w, offsets, index = _problem()
    gated, down = gated_program("geglu", torch.bfloat16), down_program(True, torch.bfloat16)
    with FakeTensorMode() as mode:
        fh, fw, fo, fi = (mode.from_tensor(t) for t in (h, w, offsets, index))
        (y,) = grouped.grouped_gemm_epilogue(gated.to_text(), fh, fw, fo, fi, [])
        assert tuple(y.shape) == (10, 16) and y.dtype == torch.bfloat16
        (o,) = grouped.grouped_gemm_epilogue(
            down.to_text(), y, mode.from_tensor(torch.randn(4, 32, 16).bfloat16()), fo,
            None, [mode.from_tensor(torch.rand(10))])
        assert tuple(o.shape) == (10, 32)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        grouped.execute(gated.to_text(), h, w.requires_grad_(), offsets, index, [])


def _n_major(w):
    return w.transpose(-2, -1).contiguous().transpose(-2, -1)


@pytest.mark.parametrize("change,why", [
    (lambda h, w, o, i: (h.float(), w.float(), o, i), "bf16/fp16"),
    (lambda h, w, o, i: (h, w, o.long(), i), "offsets"),
    (lambda h, w, o, i: (h, _n_major(w), o, i), "halves (QuACK's concat layout) need b K-"),
    (lambda h, w, o, i: (h, w.permute(1, 0, 2).contiguous().permute(1, 0, 2), o, i),
     "neither K- nor N-contiguous"),
    (lambda h, w, o, i: (h[:, :20], w[:, :, :20], o, i), "multiple of 8"),
])
def test_grouped_contract_refusals(change, why):
    """Tensors the kernel cannot take are named (and run the reference)."""
    h, w, offsets, index = change(*_problem())
    prog = gated_program("swiglu", torch.bfloat16)
    assert why in grouped.contract_violation(prog, h, w, offsets, index, [], False)


def test_grouped_contract_takes_n_major_interleaved_and_expert_vectors():
    """gpt-oss's layout: N-contiguous weights, interleaved pairs, a per-expert bias [E, N]
    (refused over [gate; up] halves, whose kernel columns are interleaved)."""
    h, w, offsets, index = _problem()
    bias = torch.randn(4, 32).bfloat16()
    prog = gated_program("swiglu_oai", torch.bfloat16, params=(1.702, 7.0), bias=True)
    assert grouped.contract_violation(prog, h, _n_major(w), offsets, index, [bias],
                                      True) is None
    assert "per-expert vector over [gate; up] halves" in grouped.contract_violation(
        prog, h, w, offsets, index, [bias], False)
    assert "need [4, 32]" in grouped.contract_violation(prog, h, w, offsets, index,
                                                        [bias[:, :16]], True)


@pytest.mark.parametrize("interleaved", [True, False])
def test_grouped_reference_with_expert_bias(interleaved):
    """The op's reference with a per-expert bias, in float64, against the per-expert loop:
    row s takes its expert's bias row (in the weight's row order), the pair over columns
    (2j, 2j + 1) as stored (interleaved) or over the [gate; up] halves."""
    h, w, offsets, index = _problem(torch.float64)
    bias = torch.randn(4, 32, dtype=torch.float64)
    prog = gated_program("swiglu_oai", torch.float64, params=(1.702, 0.5), bias=True)
    (y,) = grouped.execute(prog.to_text(), h, _n_major(w), offsets, index, [bias],
                           interleaved)
    x = h[index]
    want = torch.zeros(10, 16, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        p = x[start:end] @ w[e].T + bias[e]
        g, u = (p[:, 0::2], p[:, 1::2]) if interleaved else p.chunk(2, dim=-1)
        g, u = g.clamp(max=0.5), u.clamp(-0.5, 0.5)
        want[start:end] = g * torch.sigmoid(1.702 * g) * (u + 1)
        start = end
    assert rel_err(y[:8], want[:8]) <= 1e-12  # rows past the last offset: never written


def test_expert_pairs_interleaved():
    w = torch.arange(2 * 3 * 4 * 2.0).reshape(2, 6, 4)  # 2 experts of 3 (gate, up) pairs
    out = reference.expert_pairs_interleaved(w)
    for e in range(2):
        assert torch.equal(out[e, 0::2], w[e, :3]) and torch.equal(out[e, 1::2], w[e, 3:])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
@pytest.mark.parametrize("via", ["optimize", "backend",
                                 pytest.param("inductor", marks=pytest.mark.inductor)])
def test_hf_training_step_matches_eager(via, family):
    """A float32 Qwen3-MoE training step (transformers' grouped_mm fallback op under
    torch.compile), and DeepSeek-V4's (its clamped SwiGLU: the backward as rules, autograd
    of the op table's pair function): loss and every parameter's gradient equal eager's."""
    model, _ = moe_model(family, torch.float32)
    model.train()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 16))
    fast = coda_rewrite.optimize(model) if via == "optimize" else \
        torch.compile(model, backend="coda", options={"inductor": via == "inductor"})
    loss = fast(ids, labels=ids).loss
    want = ref(ids, labels=ids).loss
    assert rel_err(loss, want) <= 1e-5
    loss.backward()
    want.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:  # (torch.compile alone gives DeepSeek-V4's unused compressor
            assert p.grad is None or not p.grad.any(), name  # a zero gradient)
            continue
        # DeepSeek-V4's router, 30x sharpened, gets gradients of ~1e-11 in eager itself:
        # rounding noise, where a relative error says nothing (only there)
        noise = float(q.grad.abs().max()) <= 1e-9
        assert rel_err(p.grad, q.grad) <= 1e-4 or \
            (noise and float((p.grad - q.grad).abs().max()) <= 1e-8), name
    if via == "optimize":
        done = [r for r in fast.report.records if r.pattern == "routed_experts"]
        assert len(done) == 2 and all(r.status == "rewritten" for r in done)


def test_statement_witness_refuses_a_wrong_pair_layout(monkeypatch):
    """The statement's numeric witness reads [gate; up] as the kernel does: with the
    halves left concatenated (no interleave) it disagrees and the proof is refused."""
    from coda_rewrite.algebra import statements
    monkeypatch.setattr(reference, "expert_pairs_interleaved", lambda w: w)
    with pytest.raises(statements.Unproved):
        statements.prove_routed_experts.__wrapped__()


def test_grouped_launch_host_side(monkeypatch):
    """The grouped launch's host side without a GPU (QuACK's planned launch stubbed):
    outputs come back in the program's order (y, then the pre-activation the backward
    reads), the offsets become cu_seqlens with a leading 0, the gather index int32, the
    combine weight goes to the program's per-row operand."""
    from coda_rewrite.codegen.quack_source import generate
    from coda_rewrite.kernels import quack_path
    seen = {}

    def fake_gemm(plan, a, b, d, c, values, cu_seqlens_m=None, A_idx=None):
        seen.update(values=sorted(values), cu=cu_seqlens_m, idx=A_idx)
        if d is not None:
            d.fill_(1.0)
        for name, t in values.items():
            if name.startswith("postact"):
                t.fill_(2.0)

    monkeypatch.setattr(quack_path, "run_gemm_epi_plan", fake_gemm)

    def launch_of(program, m, n):
        launch = object.__new__(grouped.GroupedLaunch)
        launch.ks, launch.gemm_plan = generate(program), object()
        launch.m, launch.n, launch.device = m, n, torch.device("cpu")
        names = [o.name for o in program.operands]
        launch.kwargs = [(bnd.param, names.index(bnd.name))
                         for bnd in launch.ks.contract.operands]
        width = {o.value: n // 2 if o.kind.value == "pair" else n for o in program.outputs}
        launch.outs = [(name, (m, width[value]), torch.bfloat16)
                       for value, name in launch.ks.contract.tile_outputs]
        buffers = dict(launch.ks.contract.tile_outputs)
        launch.results = [buffers[o.value] for o in program.outputs]
        return launch

    h, w, offsets, index = _problem()
    train = launch_of(gated_program("swiglu", torch.bfloat16, keep_preact=True), 10, 32)
    y, p = train(h, w, offsets, index, [])
    assert y.shape == (10, 16) and (y == 2).all() and p.shape == (10, 32) and (p == 1).all()
    assert seen["cu"].tolist() == [0, *offsets.tolist()] and seen["idx"].dtype == torch.int32
    down = launch_of(down_program(True, torch.bfloat16), 10, 32)
    (o,) = down(y, torch.zeros(4, 32, 16).bfloat16(), offsets, None, [torch.rand(10)])
    assert o.shape == (10, 32) and (o == 1).all() and seen["idx"] is None
    assert seen["values"] == sorted(["D", *(b.param for b in down.ks.contract.operands)])
    # values a planned launch cannot trust: checked on the device before the launch
    for bad_offsets, bad_index in ((offsets, index + 6), (offsets, index - 6),
                                   (offsets + 3, index), (offsets.flip(0), index)):
        seen.clear()
        with pytest.raises(RuntimeError):
            train(h, w, bad_offsets, bad_index, [])
        assert not seen  # nothing launched
    # where the graph proved the routing in bounds (routing_in_bounds) nothing is checked
    seen.clear()
    train(h, w, offsets, index, [], True)
    assert seen["cu"].tolist() == [0, *offsets.tolist()]


def test_speed_policies_on_cuda_graphs(monkeypatch):
    """The speed policies see the grouped GEMMs (size_policy.gemms_of): on a GPU the
    routed experts are left to eager's ops below FUSED_FROM_ROWS routed rows (below
    FUSED_FROM_ROWS_IN_TRAINING in a training graph, measured apart),
    unless the options say otherwise;
    CPU graphs are not affected (a real match whose GEMM metas are put on a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_rewrite.algebra.decision import Rejection, Why
    from coda_rewrite.options import Options
    from coda_rewrite.patterns import routed_experts
    from coda_rewrite.patterns.family import Decided
    from coda_rewrite.size_policy import gemms_of, too_few_rows
    from coda_rewrite.training_policy import not_paying_in_training
    matches = []

    def spy(m, context):  # keep the match, leave the graph as captured
        matches.append(m)
        return Decided.refuse(Rejection(Why("held for the test", "test.held"), m.path))

    monkeypatch.setattr(routed_experts, "decide", spy)
    coda_rewrite.optimize(Experts())(torch.randn(8, 32).bfloat16())  # a training graph
    (m,) = matches
    assert set(gemms_of(m)) == {m.gate_up, m.down}
    assert not too_few_rows(routed_experts, m, None)  # CPU: every size
    assert not not_paying_in_training(routed_experts, m, Options.make(fuse_in_training=None))

    from coda_rewrite.canonical import canon

    def on_gpu(rows, grad):  # the GEMMs' outputs and inputs, and the experts' output
        with FakeTensorMode():
            for n in (m.gate_up, m.down, m.out):
                n.meta["example_value"] = torch.empty(rows, 32, device="cuda",
                                                      requires_grad=grad)
            for n in (m.gate_up, m.down):
                canon(n).args[0].meta["example_value"] = torch.empty(rows, 32, device="cuda")

    on_gpu(16, False)
    assert "fewer than the routed_experts fusion's measured threshold" in \
        too_few_rows(routed_experts, m, None)
    assert not too_few_rows(routed_experts, m, 0)
    inference_rows = routed_experts.FUSED_FROM_ROWS
    on_gpu(inference_rows, False)
    assert not too_few_rows(routed_experts, m, None)
    on_gpu(inference_rows // 2, False)
    assert too_few_rows(routed_experts, m, None)
    on_gpu(max(training_rows := routed_experts.FUSED_FROM_ROWS_IN_TRAINING,
               inference_rows), False)
    assert not too_few_rows(routed_experts, m, None)
    # a training graph has its own threshold (measured on forward + backward)
    assert training_rows != inference_rows
    on_gpu(training_rows, True)
    assert not too_few_rows(routed_experts, m, None)
    on_gpu(training_rows // 2, True)
    assert too_few_rows(routed_experts, m, None)
    for option, left in ((None, False), (False, True), (True, False)):
        opts = Options.make(fuse_in_training=option)
        assert bool(not_paying_in_training(routed_experts, m, opts)) == left, option


def test_auxiliary_loss_on_router_logits():
    """Mixtral's load-balancing loss reads the router logits, which the rewrite leaves as
    graph ops (the combine weight is whatever the graph computes): a training step with
    it, the experts rewritten, loss, auxiliary loss and every gradient eager's."""
    model, _ = moe_model("mixtral", torch.float32, output_router_logits=True,
                         router_aux_loss_coef=0.05)
    model.train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    fast = coda_rewrite.optimize(model)
    got, want = fast(ids, labels=ids), ref(ids, labels=ids)
    assert rel_err(got.aux_loss, want.aux_loss) <= 1e-6 and rel_err(got.loss, want.loss) <= 1e-5
    got.loss.backward()
    want.loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4
    done = [r for r in fast.report.records if r.pattern == "routed_experts"]
    assert [r.status for r in done] == ["rewritten"] * 2


def test_what_counts_as_an_update_in_place():
    """graph_utils.mutated_value, which the side conditions' in-place checks read:
    operator.and_ / or_ are named like in-place ops and are not (a mask built with `|`
    was taken for an update of the mask); operator.ior, setitem and `x.mul_` are."""
    from coda_rewrite.graph_utils import mutated_value
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    pure = [g.call_function(operator.or_, (a, b)), g.call_function(operator.and_, (a, b)),
            g.call_method("masked_fill", (a, b, 0.0))]
    updates = [g.call_function(operator.ior, (a, b)), g.call_function(operator.setitem,
                                                                     (a, 0, b)),
               g.call_method("mul_", (a, 2.0)), g.call_function(torch.Tensor.add_, (a, b))]
    assert all(mutated_value(n) is None for n in pure)
    assert all(mutated_value(n) is a for n in updates)


def test_what_shares_memory_with_a_value():
    """graph_utils.aliases, which the in-place side conditions watch: a basic index (a
    slice, an int, a 0-d integer tensor) is a view; advanced indexing by a tensor of one
    or more dims (the experts' gather of the routed rows, a mask) copies. Checked against
    torch itself, so the rule cannot drift from what indexing does."""
    from coda_rewrite.graph_utils import aliases
    x, i1, i0, mask = torch.zeros(4, 3), torch.tensor([1, 2]), torch.tensor(1), \
        torch.tensor([True, False, True, False])
    g = torch.fx.Graph()
    nodes = {}
    for name, value in (("x", x), ("i1", i1), ("i0", i0), ("mask", mask)):
        nodes[name] = g.placeholder(name)
        nodes[name].meta["example_value"] = value
    cases = {"rows": (nodes["i1"],), "row0d": (nodes["i0"],), "mask": (nodes["mask"],),
             "slice": ((slice(None), 1),), "column": ((slice(None), nodes["i1"]),)}
    values = {"rows": x[i1], "row0d": x[i0], "mask": x[mask], "slice": x[:, 1],
              "column": x[:, i1]}
    made = {k: g.call_function(operator.getitem, (nodes["x"], *idx)) for k, idx in cases.items()}
    seen = aliases({nodes["x"]})
    for k, node in made.items():
        shares = values[k].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert (node in seen) == shares, k


@pytest.mark.parametrize("dtype,exact", [(torch.float32, True), (torch.float64, True),
                                         (torch.int32, True), (torch.bfloat16, False),
                                         (torch.float16, False), (torch.bool, False)])
def test_expert_ids_counted_only_through_exact_casts(dtype, exact):
    """The per-expert bias is tied to the offsets only where histc counts the sorted ids
    themselves: through a cast to a number type that keeps every id (bf16 rounds ids above
    256, fp16 above 2048, bool folds them to 0 and 1)."""
    from coda_rewrite.algebra.routed_experts import sorted_ids_counted

    def f(x):
        ids, _ = torch.sort(x)
        return torch.cumsum(torch.histc(ids.to(dtype), bins=4, min=0, max=3), dim=0)
    gm = torch.fx.symbolic_trace(f)
    x = torch.randint(0, 4, (10,))
    vals = {"x": x, "sort": torch.sort(x), "getitem": torch.sort(x)[0],
            "to": x.to(dtype), "histc": torch.zeros(4), "cumsum": torch.zeros(4)}
    for n in gm.graph.nodes:  # the metadata dynamo would give (no histc kernel for ints)
        if n.name in vals:
            n.meta["example_value"] = vals[n.name]
    nodes = {n.name: n for n in gm.graph.nodes}
    why = sorted_ids_counted(nodes["getitem"], nodes["cumsum"], 4)
    assert (why is None) == exact, why


# ---- the backward in the down projection's dgrad epilogue (kernels/grouped_dgated.py) --

def _dgated_routed_calls() -> int:
    from coda_rewrite.kernels import ops
    return sum(n for (key, _, _), n in ops.runtime_counts().items()
               if key.startswith("dgated_routed_"))


PAIRS = {"swiglu": (), "geglu": (), "geglu_erf": (), "swiglu_oai": (1.702, 0.5)}


@pytest.mark.parametrize("op", list(PAIRS))
@pytest.mark.parametrize("combine, bias", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_down_backward_equals_the_rules(op, combine, bias, interleaved, monkeypatch):
    """GroupedGatedDown (dp, h·w and the combine weight's gradient from one dgrad) gives
    every gradient the rules give (GroupedDown, then GroupedGated from dy), in float64
    where both are exact: the input's, both expert weights', the combine weight's, each
    bias's, with an expert that has no row, rows past the last offset and the product
    also read elsewhere (its gradient reaches the gated GEMM beside dp's). The kernel
    leaves the rows past the last offset unwritten: here they hold NaN, and no gradient
    may read them."""
    from coda_rewrite.kernels import grouped_dgated
    from coda_rewrite.kernels.grouped_dgated import grouped_down_linear
    real = grouped_dgated.run_reference

    def unwritten_tail(op_, params_, dout, weight, offsets_, p, score_):
        outs = real(op_, params_, dout, weight, offsets_, p, score_)
        for t in outs:
            t[int(offsets_[-1]):] = float("nan")
        return outs
    monkeypatch.setattr(grouped_dgated, "run_reference", unwritten_tail)
    dt, g = torch.float64, torch.Generator().manual_seed(1)
    experts, tokens, hidden, inter, rows = 4, 6, 16, 8, 11
    params = PAIRS[op]
    h = torch.randn(tokens, hidden, generator=g, dtype=dt)
    w_gu = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=dt)
    w_d = torch.randn(experts, hidden, inter, generator=g, dtype=dt)
    index = torch.randint(0, tokens, (rows,), generator=g)
    offsets = torch.tensor([3, 3, 6, rows - 2], dtype=torch.int32)  # expert 1 empty
    score = torch.rand(rows, generator=g, dtype=dt)
    b_gu = torch.randn(experts, 2 * inter, generator=g, dtype=dt)
    b_d = torch.randn(experts, hidden, generator=g, dtype=dt)
    seed = torch.randn(rows, hidden, generator=g, dtype=dt)
    gated = gated_program(op, dt, True, params, bias).to_text()
    down = down_program(combine, dt, bias).to_text()

    def run(fused: bool):
        leaves = [t.clone().requires_grad_() for t in (h, w_gu, w_d, score, b_gu, b_d)]
        x, wgu, wd, w, bgu, bd = leaves
        gu_ops = (bgu,) if bias else ()
        y, p = grouped.grouped_linear(gated, x, wgu, offsets, index, *gu_ops,
                                      interleaved=interleaved)
        ops_ = ((bd,) if bias else ()) + ((w,) if combine else ())
        if fused:
            o = grouped_down_linear(down, op, params, y, p, wd, offsets, *ops_)
        else:
            (o,) = grouped.grouped_linear(down, y, wd, offsets, None, *ops_)
        live = (torch.arange(rows) < offsets[-1])[:, None]
        loss = (torch.where(live, o, 0) * seed).sum() + (y[:5] ** 2).sum()
        loss.backward()
        return [t.grad for t in leaves]

    before = _dgated_routed_calls()
    got = run(True)
    assert _dgated_routed_calls() == before + 1
    for name, a, b in zip(("h", "w_gate_up", "w_down", "w", "b_gate_up", "b_down"),
                          got, run(False)):
        if b is None:
            assert a is None, name
        else:
            assert rel_err(a, b) <= 1e-10, (name, rel_err(a, b))


def test_grouped_dgated_reference_against_float64():
    """coda::grouped_dgated's reference (what runs off Hopper, and what the kernel is
    checked against on the GPU) at bf16: dp, h·w and the combine weight's gradient no
    further from float64 than bf16 rounding, an empty expert and rows past the last
    offset included (zero)."""
    g = torch.Generator().manual_seed(2)
    experts, hidden, inter, rows = 3, 32, 16, 40
    do = torch.randn(rows, hidden, generator=g).bfloat16()
    w_d = (torch.randn(experts, hidden, inter, generator=g) / hidden ** 0.5).bfloat16()
    p = torch.randn(rows, 2 * inter, generator=g).bfloat16()
    score = torch.rand(rows, generator=g)
    offsets = torch.tensor([17, 17, rows - 3], dtype=torch.int32)
    dp, hw, dscore = torch.ops.coda.grouped_dgated("swiglu", [], do, w_d, offsets, p, score)
    acc = reference.grouped_mm(do.double(), w_d.double(), offsets)
    gate, up = p[:, 0::2].double(), p[:, 1::2].double()
    h = F.silu(gate) * up
    dh = acc * score.double()[:, None]
    sg = torch.sigmoid(gate)
    want_dp = torch.stack((dh * up * sg * (1 + gate * (1 - sg)), dh * F.silu(gate)),
                          -1).reshape(rows, -1)
    live = slice(0, rows - 3)
    assert rel_err(dp[live].double(), want_dp[live]) < 8e-3
    assert rel_err(hw[live].double(), (h * score.double()[:, None])[live]) < 8e-3
    assert rel_err(dscore[live].double(), (h * acc).sum(-1)[live]) < 1e-5
    assert dp[rows - 3:].abs().sum() == 0 and dscore[rows - 3:].abs().sum() == 0
    assert dscore.dtype == torch.float32 and hw.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_fused_down_backward_meets_the_kernel_contract(family):
    """A bf16 MoE model's training step hands coda::grouped_dgated 16-bit operands of one
    dtype (Mixtral's float32 combine weight makes the down output, so dout, float32: the
    GEMM's operand is cast back), so on the CPU the only reason it runs the reference is
    the device (on the H200 a float32 dout sent it to the reference: 124 ms a step)."""
    from coda_rewrite.kernels import ops
    model, _ = moe_model(family)
    model.train()
    ids = torch.randint(0, 128, (2, 16))
    fast = coda_rewrite.optimize(model)
    fast(ids, labels=ids).loss.backward()  # compiles (the witnesses replay in float64)
    ops.reset_runtime()
    fast(ids, labels=ids).loss.backward()
    reasons = {r for (key, _, r) in ops.runtime_counts() if key.startswith("dgated_routed_")}
    assert reasons and all(r.startswith("device cpu") for r in reasons), reasons


def test_dense_experts_are_taken_by_their_own_family():
    """Llama 4's experts run every token through every expert (torch.bmm over stacked
    weights): patterns/dense_experts.py rewrites them to their routed rows
    (tests/test_dense_experts.py); a bmm of two activations (an attention-like product)
    is no candidate of either family; outputs as eager's."""
    from test_dense_experts import llama4
    model = llama4(top_k=1).eval()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        fast = coda_rewrite.optimize(copy.deepcopy(model))
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
    dense = [(r.path, r.status) for r in fast.report.records if r.pattern == "dense_experts"]
    assert dense == [(f"model.layers.{i}.feed_forward.experts", "rewritten") for i in range(2)]

    class Scores(torch.nn.Module):
        def forward(self, q, k):
            return torch.bmm(q, k.transpose(1, 2)).chunk(2, dim=-1)[0].sum()
    scores = coda_rewrite.optimize(Scores())
    scores(torch.randn(2, 4, 8), torch.randn(2, 6, 8))
    assert not [r for r in scores.report.records
                if r.pattern in ("routed_experts", "dense_experts")]


def test_a_second_derivative_through_the_experts_raises():
    """The experts' backward runs ops with no autograd formula (the grouped GEMMs, the
    fused dgrad epilogue): a backward that would build a graph for a second derivative
    raises instead of coming back without their terms (autograd's fallback only warns,
    and a later backward would silently skip them)."""
    from coda_rewrite.kernels.grouped_dgated import grouped_down_linear
    dt, g = torch.float64, torch.Generator().manual_seed(0)
    h, w_gu = torch.randn(4, 8, dtype=dt, generator=g), torch.randn(2, 8, 8, dtype=dt,
                                                                     generator=g)
    w_d, w = torch.randn(2, 8, 4, dtype=dt, generator=g), torch.rand(4, dtype=dt, generator=g)
    for t in (h, w_gu, w_d, w):
        t.requires_grad_()
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    y, p = grouped.grouped_linear(gated_program("swiglu", dt, True).to_text(), h, w_gu,
                                  offsets, torch.arange(4))
    for fused in (True, False):
        o = grouped_down_linear(down_program(True, dt).to_text(), "swiglu", (), y, p, w_d,
                                offsets, w) if fused else \
            grouped.grouped_linear(down_program(True, dt).to_text(), y, w_d, offsets, None,
                                   w)[0]
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(o.sum(), h, create_graph=True)
        (gh,) = torch.autograd.grad(o.sum(), h, retain_graph=True)  # a first one works
        assert torch.isfinite(gh).all()


@pytest.mark.parametrize("fused", [True, False])
def test_frozen_expert_weights_skip_their_gradient_gemms(fused, monkeypatch):
    """Expert weights that do not require a gradient (adapter fine-tuning, a frozen MoE):
    the backward runs no wgrad GEMM, and the gradients asked for (the input's, the
    router weight's) are the ones computed with every weight trainable."""
    from coda_rewrite.kernels import grouped_dgated
    from coda_rewrite.kernels.grouped_dgated import grouped_down_linear
    calls = []
    for mod in (grouped, grouped_dgated):
        real = mod.weight_grad
        monkeypatch.setattr(mod, "weight_grad",
                            lambda *a, real=real: calls.append(1) or real(*a))
    dt, g = torch.float64, torch.Generator().manual_seed(3)
    h = torch.randn(6, 16, dtype=dt, generator=g)
    w_gu, w_d = torch.randn(3, 16, 16, dtype=dt, generator=g), \
        torch.randn(3, 16, 8, dtype=dt, generator=g)
    w = torch.rand(12, dtype=dt, generator=g)
    offsets, index = torch.tensor([4, 4, 12], dtype=torch.int32), torch.arange(12) // 2
    gated, down = gated_program("swiglu", dt, True).to_text(), down_program(True, dt).to_text()

    def run(train_weights: bool):
        x, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        wgu, wd = (t.clone().requires_grad_(train_weights) for t in (w_gu, w_d))
        y, p = grouped.grouped_linear(gated, x, wgu, offsets, index)
        o = grouped_down_linear(down, "swiglu", (), y, p, wd, offsets, wr) if fused else \
            grouped.grouped_linear(down, y, wd, offsets, None, wr)[0]
        (o * torch.linspace(-1, 1, o.numel(), dtype=dt).view_as(o)).sum().backward()
        return x.grad, wr.grad, wgu.grad, wd.grad

    want = run(True)
    assert len(calls) == 2
    calls.clear()
    got = run(False)
    assert calls == [] and got[2] is None and got[3] is None
    for a, b in zip(got[:2], want[:2]):
        assert rel_err(a, b) <= 1e-12


def test_grouped_dgated_launch_host_side(monkeypatch):
    """The routed backward kernel's launch without a GPU (QuACK's planned launch stubbed):
    dp, h·w and the per-tile dscore partials summed per row come back, the offsets
    become cu_seqlens with a leading 0, B is w_down's (I, H) view; offsets a planned
    launch cannot trust are refused on the device before anything launches."""
    from coda_rewrite.kernels import grouped_dgated, quack_path
    seen = {}

    def fake_gemm(plan, a, b, d, c, values, cu_seqlens_m=None):
        seen.update(values=sorted(values), cu=cu_seqlens_m, b=tuple(b.shape), c=c)
        d.fill_(1.0)
        values["postact"].fill_(2.0)
        values["dscore"].fill_(0.5)
    monkeypatch.setattr(quack_path, "run_gemm_epi_plan", fake_gemm)
    launch = object.__new__(grouped_dgated.Launch)
    launch.gemm_plan, launch.key, launch.m, launch.n = object(), "k", 10, 16
    launch.device, launch.dtype, launch.partials = torch.device("cpu"), torch.bfloat16, (10, 3)
    do, w_d = torch.randn(10, 32).bfloat16(), torch.randn(4, 32, 16).bfloat16()
    p, score = torch.randn(10, 32).bfloat16(), torch.rand(10)
    offsets = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    dp, hw, dscore = launch(do, w_d, offsets, p, score)
    assert dp.shape == (10, 32) and (dp == 1).all() and hw.shape == (10, 16) and (hw == 2).all()
    assert (dscore == 1.5).all() and seen["b"] == (4, 16, 32) and seen["c"] is p
    assert seen["cu"].tolist() == [0, 0, 3, 3, 8] and "score" in seen["values"]
    for bad in (offsets + 3, offsets.flip(0), offsets - 1):
        seen.clear()
        with pytest.raises(RuntimeError):
            launch(do, w_d, bad, p, score)
        assert not seen  # nothing launched
    seen.clear()
    launch(do, w_d, offsets, p, score, True)  # proved in bounds by the graph: no check
    assert seen["cu"].tolist() == [0, 0, 3, 3, 8]


def test_witness_replays_are_not_counted_as_the_models_calls():
    """The routed experts' witness replays the grouped GEMMs' forward and backward on
    float64 tensors (their reference, by design); the runtime counts, which
    runtime_summary() and tools/survey.py's "reference ran" report, and the fallback
    warning are about the model's own calls: a bf16 model's training step through
    optimize() counts no float64 call."""
    from coda_rewrite.kernels import ops
    model, _ = moe_model("qwen3_moe")
    model.train()
    before = dict(ops.runtime_counts())
    fast = coda_rewrite.optimize(model)
    ids = torch.randint(0, 128, (2, 16))
    fast(ids, labels=ids).loss.backward()
    assert [r for r in fast.report.records
            if r.pattern == "routed_experts" and r.status == "rewritten"], str(fast.report)
    new = {k: v for k, v in ops.runtime_counts().items() if before.get(k) != v}
    assert any("experts" in k[0] for k in new), new          # the model's calls counted
    assert not [k for k in new if "float64" in k[2]], new     # the replays' not
