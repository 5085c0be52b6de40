"""Batched experts (patterns/batched_experts.py): transformers' ``batched_mm`` experts
implementation put in its grouped spelling, against eager and a float64 copy (the
per-expert loop), then fused by the routed experts' family like the grouped path;
the look-alikes that must be left as they are, each with its code; gradients; dynamic
shapes; a hypothesis search over the spelling's variants."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from packaging.version import Version
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings, strategies as st

import coda_rewrite
from coda_rewrite.numerics import rel_err

from conftest import codes
from test_routed_experts import FAMILIES, moe_model

# DeepSeek-V4's hash-routed layers (its first ones) read their ids from a frozen table,
# ids = tid2eid[input_ids], in transformers after the pinned 5.17.0 (seen with 5.25.0):
# ids read from a buffer are not provably in [0, E), so the batched spelling is refused
# (moe.batched_ids), as it must be, and the model runs as eager's
_HASH_ROUTED = set()
if Version(transformers.__version__) > Version("5.17.0"):
    _HASH_ROUTED.add("deepseek_v4")


def _refused_as_hash_routed(report, layers: int) -> bool:
    """Every batched record refused for ids not proved in range (a hash-routed layer)."""
    left = [r.code for r in report.records if r.pattern == "batched_experts"]
    return left == ["moe.batched_ids"] * layers


def _statuses(report, pattern: str) -> list[str]:
    return [r.status for r in report.records if r.pattern == pattern]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_mm_models_rewritten_no_worse_than_eager(family):
    """Every MoE family of the routed tests with experts_implementation='batched_mm':
    its per-pair GEMVs put in the grouped spelling, then fused by the routed experts'
    family (the norm's row scale deferred through the gather where the grouped path
    gets it); logits no worse than eager's against the float64 per-expert loop."""
    model, exact = moe_model(family)
    model.set_experts_implementation("batched_mm")
    ids = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        got, want, truth = fast(ids).logits, model(ids).logits, exact(ids).logits
    layers = 1 if family in ("glm4_moe", "deepseek_v3", "hy_v4") else 2
    assert rel_err(got.double(), truth) <= 1.25 * rel_err(want.double(), truth)
    if family in _HASH_ROUTED:
        assert _refused_as_hash_routed(fast.report, layers), str(fast.report)
        return
    assert _statuses(fast.report, "batched_experts") == ["rewritten"] * layers, \
        str(fast.report)
    assert _statuses(fast.report, "routed_experts") == ["rewritten"] * layers
    assert not fast.report.notes  # the implementation is rewritten: nothing to say of it
    assert rel_err(got.double(), truth) <= 1.25 * rel_err(want.double(), truth)
    rec = next(r for r in fast.report.records if r.pattern == "batched_experts")
    assert "sorted by expert" in rec.producer and "copies W[ids] gone" in rec.weights
    routed = next(r for r in fast.report.records if r.pattern == "routed_experts")
    assert "by construction" in routed.routing  # the spelling's routing proves its bounds


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v4"])
@pytest.mark.parametrize("routed", [True, False])
def test_batched_spelling_becomes_the_grouped_path(family, routed):
    """bf16: the pass on the batched_mm model gives the very logits it gives on the same
    model with grouped_mm (bit for bit), with the routed experts fused or left: the
    rewrite produces transformers' grouped spelling, nothing else."""
    from coda_rewrite.options import Options
    model, _ = moe_model(family)
    ids = torch.randint(3, 128, (2, 32))
    patterns = Options().patterns if routed else \
        tuple(p for p in Options().patterns if p != "routed_experts")
    got = {}
    for impl in ("grouped_mm", "batched_mm"):
        m = copy.deepcopy(model)
        m.set_experts_implementation(impl)
        with torch.no_grad():
            fast = coda_rewrite.optimize(m, patterns=patterns)
            got[impl] = fast(ids).logits
    if family in _HASH_ROUTED:  # nothing rewritten: eager's batched GEMVs against torch's
        assert _refused_as_hash_routed(fast.report, 2), str(fast.report)  # grouped GEMM
        return
    assert torch.equal(got["grouped_mm"], got["batched_mm"])


def test_left_grouped_where_the_routed_experts_are_not_fused():
    """Where the routed experts' family does not fuse them (disabled here; on the GPU
    below its row threshold), the grouped spelling stays torch's grouped GEMMs, still
    without per-pair weight copies; float32: eager's numbers."""
    from coda_rewrite.options import Options
    model, _ = moe_model("qwen3_moe", torch.float32)
    model.set_experts_implementation("batched_mm")
    ids = torch.randint(3, 128, (2, 16))
    patterns = tuple(p for p in Options().patterns if p != "routed_experts")
    with torch.no_grad():
        fast = coda_rewrite.optimize(model, patterns=patterns)
        got, want = fast(ids).logits, model(ids).logits
    assert _statuses(fast.report, "batched_experts") == ["rewritten"] * 2
    assert codes(fast.report, "routed_experts") == {"disabled"}
    assert rel_err(got, want) <= 1e-5
    code = fast.report.graphs[0].rewritten_code
    assert code.count("expert_gemm(") == 4 and "bmm" not in code


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("via", ["optimize", pytest.param("inductor",
                                                          marks=pytest.mark.inductor)])
def test_training_step_matches_eager(family, via):
    """A float32 training step on the batched spelling (gpt-oss: biases, interleaved
    lanes, [E, K, N] weights): loss and every parameter's gradient equal eager's; the
    witness replays the gradients too."""
    model, _ = moe_model(family, torch.float32)
    model.set_experts_implementation("batched_mm")
    model.train()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 16))
    fast = coda_rewrite.optimize(model) if via == "optimize" else \
        torch.compile(model, backend="coda", options={"inductor": True})
    loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert rel_err(loss, want) <= 1e-5
    loss.backward()
    want.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-4, name
    if via == "optimize":
        rec = next(r for r in fast.report.records if r.pattern == "batched_experts")
        assert rec.status == "rewritten" and "gradients" in rec.decision.witness


@pytest.mark.parametrize("train", [False, True])
def test_dynamic_shapes(train):
    """torch.compile(dynamic=True): the token count symbolic; rewritten at two lengths
    with one graph, eager's numbers (float32)."""
    model, _ = moe_model("mixtral", torch.float32)
    model.set_experts_implementation("batched_mm")
    model.train(train)
    ref = copy.deepcopy(model)
    fast = torch.compile(model, backend="coda", dynamic=True, options={"inductor": False})
    before = len(coda_rewrite.last_report().records)
    with torch.set_grad_enabled(train):
        for length in (9, 14):
            ids = torch.randint(3, 128, (2, length))
            got, want = fast(ids).logits, ref(ids).logits
            assert rel_err(got, want) <= 1e-5
            if train:
                got.sum().backward()
                want.sum().backward()
    records = coda_rewrite.last_report().records[before:]
    assert {r.status for r in records if r.pattern == "batched_experts"} == {"rewritten"}
    if train:
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if q.grad is not None:
                assert rel_err(p.grad, q.grad) <= 1e-4, name


class Batched(torch.nn.Module):
    """transformers' batched_mm experts spelled out, with the variants the look-alikes
    and the property test change (``case``), behind a top-k router."""

    def __init__(self, case="canonical", experts=4, top_k=2, k=32, inter=16,
                 weight_first=True, bias=False, lanes=False, act="silu", seed=0, gated=True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.case, self.e, self.top_k, self.weight_first = case, experts, top_k, weight_first
        self.lanes, self.act, self.gated = lanes, act, gated
        width = 2 * inter if gated else inter
        gu = (experts, width, k) if weight_first else (experts, k, width)
        dn = (experts, k, inter) if weight_first else (experts, inter, k)
        self.router = torch.nn.Parameter(torch.randn(experts, k, generator=g) * 3)
        self.gate_up = torch.nn.Parameter(torch.randn(gu, generator=g) / k ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(dn, generator=g) / inter ** 0.5)
        self.gu_bias = torch.nn.Parameter(torch.randn(experts, width, generator=g)) \
            if bias else None
        self.d_bias = torch.nn.Parameter(torch.randn(experts, k, generator=g)) \
            if bias else None

    def _gemv(self, x, w, ids, bias, add_bias=True):
        wi = w[ids]
        out = torch.bmm(wi, x.unsqueeze(-1)).squeeze(-1) if self.weight_first else \
            torch.bmm(x.unsqueeze(1), wi).squeeze(1)
        if bias is not None and add_bias:
            out.add_(bias[ids.flip(0) if self.case == "bias_other_ids" else ids])
        return out

    def forward(self, h):
        case, k = self.case, self.top_k
        t = h.shape[0]
        values, index = torch.topk(F.linear(h, self.router.to(h.dtype)).float().softmax(-1),
                                   k, dim=-1)
        weights = (values if case == "weights_float32" else values.to(h.dtype)).reshape(-1)
        ids = index.reshape(-1)
        ids = {"unclamped": ids, "clamp_past_e": ids.clamp(0, self.e),
               "clamp_negative": ids.clamp(-1, self.e - 1),
               "ids_of_argmax": h.argmax(-1).repeat_interleave(k, 0) % self.e}.get(
                   case, ids.clamp(0, self.e - 1))
        rows = h.repeat(k, 1) if case == "copies_repeated" else h.repeat_interleave(k, dim=0)
        late_bias = case == "bias_after_split"  # added in place once the halves are views
        p = self._gemv(rows, self.gate_up, ids, self.gu_bias, add_bias=not late_bias)
        if case == "gate_up_summed":
            summed = p.sum()
        act = {"silu": F.silu, "gelu": F.gelu, "relu2": lambda v: torch.square(F.relu(v))}[
            self.act]
        if case == "mixes_rows":  # relu, then a softmax over the pairs: not row-local
            y = F.relu(p).softmax(dim=0)
        elif not self.gated:  # an expert without a gate: act(x·W_up) (Nemotron-H)
            y = act(p)
        else:
            gate, up = (p[..., ::2], p[..., 1::2]) if self.lanes else p.chunk(2, dim=-1)
            if late_bias:  # eager's halves see it (views of p)
                p.add_(self.gu_bias[ids])
            y = act(gate) + up if case == "not_gated" else act(gate) * up
        down_ids = ids.flip(0) if case == "down_other_ids" else ids
        o = self._gemv(y, self.down, down_ids, self.d_bias)
        weighted = o * weights.unsqueeze(-1)
        if case == "sum_over_pairs":
            out = weighted.view(t, k, -1).sum(0)
        else:
            out = weighted.view(t, k, -1).sum(dim=1)
        if case == "tokens_updated":
            h.mul_(2)
        if case == "gate_up_returned":
            return out, p
        if case == "gate_up_summed":
            return out, summed
        return out


# look-alike → the code it is left with (None: rewritten)
LOOK_ALIKES = {
    "canonical": None,
    "unclamped": None,                     # top-k indices over E: in range all the same
    "weights_float32": None,               # the combine promotes the rows to float32
    "clamp_past_e": "moe.batched_ids",     # an id of E reaches W[ids]: eager raises there
    "clamp_negative": "moe.batched_ids",   # −1 wraps to E − 1 in eager
    "ids_of_argmax": "moe.batched_ids",    # ids from elsewhere, bounded by nothing proved
    "copies_repeated": "moe.batched_rows",  # h.repeat(k, 1): pair s is token s % T
    "down_other_ids": "moe.batched_ids",   # the down GEMM gathers other experts
    "bias_other_ids": "moe.batched_ids",   # each pair's bias of another expert
    "not_gated": "moe.not_gated",
    "mixes_rows": "moe.not_halves",        # a softmax over the pairs between the GEMMs
    "sum_over_pairs": "moe.batched_output",
    "gate_up_returned": "moe.intermediate_read",
    "tokens_updated": "moe.in_place",
    "gate_up_summed": "moe.intermediate_read",  # p read besides its halves
    "bias_after_split": "moe.in_place",    # p's bias added in place after its halves
}


@pytest.mark.parametrize("case", list(LOOK_ALIKES))
def test_look_alikes(case):
    """Each look-alike's outputs equal eager's (no worse against float64); the spellings
    the rewrite takes are rewritten, the others left with their code."""
    model = Batched(case, gated=case != "mixes_rows",
                    bias=case in ("bias_other_ids", "bias_after_split")).bfloat16()
    torch.manual_seed(0)
    h = torch.randn(64, 32).bfloat16()
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        got, want, truth = fast(h.clone()), ref(h.clone()), exact(h.double())
    got, want, truth = (x if isinstance(x, tuple) else (x,) for x in (got, want, truth))
    for a, b, c in zip(got, want, truth):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a.double(), c) <= 1.5 * rel_err(b.double(), c) + 1e-6, case
    if LOOK_ALIKES[case] is None:
        assert _statuses(fast.report, "batched_experts") == ["rewritten"], str(fast.report)
    else:
        assert LOOK_ALIKES[case] in codes(fast.report, "batched_experts"), str(fast.report)
        assert "rewritten" not in _statuses(fast.report, "batched_experts")


@pytest.mark.provokes_pass_bug
def test_witness_refuses_a_recipe_that_loses_the_pairing(monkeypatch):
    """The float64 replay runs the pattern's own recipe: one that sums each token's rows
    in the sorted order (no inverse permutation) disagrees and the rewrite is refused."""
    from coda_rewrite import routing
    from coda_rewrite.algebra import statements
    statements.prove_batched_experts()  # proved (and cached) first: the match's own
    monkeypatch.setattr(routing, "inverse_permutation",  # replay is what must refuse
                        lambda perm: torch.arange(perm.shape[0]))
    with torch.no_grad():
        fast = coda_rewrite.optimize(Batched())
        fast(torch.randn(16, 32))
    assert codes(fast.report, "batched_experts") == {"witness.disagrees"}, str(fast.report)


@settings(max_examples=25, deadline=None)
@given(experts=st.integers(1, 6), top_k=st.integers(1, 3), tokens=st.integers(1, 40),
       weight_first=st.booleans(), bias=st.booleans(), lanes=st.booleans(),
       act=st.sampled_from(["silu", "gelu", "relu2"]), gated=st.booleans(),
       dtype=st.sampled_from(["bf16", "f32"]), seed=st.integers(0, 2 ** 16))
def test_property_batched_spellings(experts, top_k, tokens, weight_first, bias, lanes, act,
                                    gated, dtype, seed):
    """Drawn routings and spellings (weight orientation, biases, halves or lanes or no
    gate, the activation, the dtype): rewritten, and eager's numbers (float32: outputs and
    every parameter's gradient to rounding, in a graph that trains; bf16: no worse than
    eager against float64 at 64 or more tokens)."""
    top_k = min(top_k, experts)
    act = "silu" if gated and act == "relu2" else act  # (relu² gating: no op of the IR)
    model = Batched(experts=experts, top_k=top_k, weight_first=weight_first, bias=bias,
                    lanes=lanes, act=act, seed=seed, gated=gated)
    bf16 = dtype == "bf16"
    tokens = max(tokens, 64) if bf16 else tokens
    h = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(seed))
    h, model = (h.bfloat16(), model.bfloat16()) if bf16 else (h, model)
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        got, want = fast(h), ref(h)
        truth = exact(h.double())
    assert _statuses(fast.report, "batched_experts") == ["rewritten"], str(fast.report)
    if bf16:
        assert rel_err(got.double(), truth) <= 1.5 * rel_err(want.double(), truth) + 1e-6
        return
    assert rel_err(got, want) <= 1e-5
    torch._dynamo.reset()
    trained = coda_rewrite.optimize(model)
    r = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1))
    (trained(h) * r).sum().backward()
    (ref(h) * r).sum().backward()
    assert _statuses(trained.report, "batched_experts") == ["rewritten"], str(trained.report)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-4, name


@pytest.mark.parametrize("model_type,cells", [
    ("nemotron_h", ("1/1", "0/1 (moe.not_halves)")),  # experts without a gate: relu²
    ("qwen3_moe", ("2/2", "2/2"))])
def test_coverage_rows(model_type, cells):
    """tools/coverage.py --experts batched_mm on two architectures: the batched experts
    rewritten (Nemotron-H's non-gated ones too, which the routed experts then leave), the
    logits eager's (float32)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from coverage import experts_row
    row = [c.strip() for c in experts_row(model_type, "batched_mm").strip("|").split("|")]
    assert row[0] == model_type and tuple(row[1:3]) == cells, row
    assert float(row[3]) <= 1e-5, row
