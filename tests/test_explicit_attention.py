"""Explicit softmax attention → SDPA (patterns/explicit_attention.py), then the
attention-inputs family makes the mask is_causal and the repeat enable_gqa: the
reference Llama's non-flash path and Hugging Face's "eager" attention."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import coda_rewrite
from coda_rewrite.numerics import low_precision_errors, rel_err

from conftest import codes, grads_match, hf_model, module_step_matches_eager, tokens

NAME = "explicit_attention"


class Explicit(nn.Module):
    """The reference Llama's attention without flash: repeat_kv before the transpose, a
    float mask added to the scores, the softmax in float32 and cast back. ``variant``
    bends it into a look-alike."""

    def __init__(self, variant: str = ""):
        super().__init__()
        self.variant = variant
        self.wq = nn.Linear(32, 32, bias=False)
        self.wk = nn.Linear(32, 16, bias=False)
        self.wv = nn.Linear(32, 16, bias=False)
        self.temperature = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = (w(x).view(b, n, 2, 8)[:, :, :, None, :].expand(b, n, 2, 2, 8)
                .reshape(b, n, 4, 8).transpose(1, 2) for w in (self.wk, self.wv))
        mask = torch.full((n, n), float("-inf")).triu(1)
        scores = torch.matmul(q, k.transpose(2, 3))
        scores = scores * self.temperature if self.variant == "tensor scale" \
            else scores / math.sqrt(8)
        p = F.softmax((scores + mask).float(), dim=2 if self.variant == "dim" else -1)
        p = p.type_as(q)
        if self.variant == "bf16 weights":  # an fp32 model rounding its weights
            p = p.to(torch.bfloat16).to(torch.float32)
        if self.variant == "dropout":
            p = F.dropout(p, p=0.1, training=True)
        out = torch.matmul(p, v).transpose(1, 2).reshape(b, n, 32)
        return (out, p) if self.variant == "weights returned" else out


def test_explicit_attention_becomes_causal_gqa_sdpa():
    torch.manual_seed(0)
    report = module_step_matches_eager(Explicit(), torch.randn(2, 6, 32))
    done = {r.pattern: r.status for r in report.records}
    assert done == {NAME: "rewritten", "attention_inputs": "rewritten"}, str(report)
    code = report.graphs[0].rewritten_code
    assert "scaled_dot_product_attention" in code and "softmax" not in code
    assert "is_causal = True" in code and "enable_gqa = True" in code, code


@pytest.mark.parametrize("variant,code", [
    ("weights returned", "explicit_attention.weights_read"),
    ("dropout", "explicit_attention.dropout"),
    ("dim", "explicit_attention.softmax_dim"),
    ("tensor scale", "explicit_attention.scale_tensor"),
    ("bf16 weights", "explicit_attention.narrowing_cast"),
])
def test_look_alikes_stay_explicit(variant, code):
    torch.manual_seed(0)
    model = Explicit(variant).eval()
    x = torch.randn(2, 6, 32)
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    torch.manual_seed(1)  # the dropout's draw
    with torch.no_grad():
        got = fast(x)
    torch.manual_seed(1)
    with torch.no_grad():
        want = model(x)
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        assert rel_err(a, b) <= 1e-6
    assert codes(fast.report, NAME) == {code}, str(fast.report)


@pytest.mark.parametrize("padding", [False, True])
def test_hugging_face_eager_attention_trains_like_eager(padding):
    model = hf_model("llama", attn_implementation="eager").train()
    ref = copy.deepcopy(model)
    ids = tokens()
    kw = {}
    if padding:
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        kw["attention_mask"] = mask
    fast = coda_rewrite.optimize(model)
    loss, ref_loss = fast(ids, labels=ids, **kw).loss, ref(ids, labels=ids, **kw).loss
    assert rel_err(loss, ref_loss) <= 1e-5
    loss.backward()
    ref_loss.backward()
    grads_match(model, ref)
    recs = [r for r in fast.report.records if r.pattern == NAME]
    assert len(recs) == 2, str(fast.report)
    if padding:  # a padded row is fully masked: SDPA and the explicit softmax differ there
        assert codes(fast.report, NAME) == {"explicit_attention.mask_not_causal"}
    else:
        assert all(r.status == "rewritten" for r in recs), str(fast.report)


def test_hugging_face_eager_attention_returning_weights_is_left_alone():
    model = hf_model("llama", attn_implementation="eager").eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        got = fast(ids, output_attentions=True)
        want = model(ids, output_attentions=True)
    assert rel_err(got.logits, want.logits) <= 1e-5
    for a, b in zip(got.attentions, want.attentions):
        assert rel_err(a, b) <= 1e-6
    assert codes(fast.report, NAME) == {"explicit_attention.weights_read"}, str(fast.report)


def test_bfloat16_no_worse_than_eager():
    errs = low_precision_errors(
        lambda seed: hf_model("llama", seed=seed, attn_implementation="eager"),
        (tokens(),), coda_rewrite.optimize, seeds=(0, 1, 2))
    assert errs["ok"], errs


@pytest.mark.provokes_pass_bug
def test_a_training_match_carries_a_gradient_replay_that_refuses_other_gradients(monkeypatch):
    """Where the attention trains, the witness replays the gradients to q, k and v too: the
    record says so, and a stand-in for SDPA with eager's values and another gradient (v's
    cut) makes it refuse the rewrite (witness.gradients_disagree), the model left eager."""
    torch.manual_seed(0)
    model, x = Explicit().train(), torch.randn(2, 6, 32)
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    fast(x).sum().backward()
    (rec,) = [r for r in fast.report.records if r.pattern == NAME]
    assert rec.status == "rewritten" and "gradient replay on the gradients to q, k and v" \
        in str(rec), str(rec)

    from coda_rewrite.algebra import explicit_attention as legality

    class CutV:  # SDPA's values, no gradient to v
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def scaled_dot_product_attention(q, k, v, **kw):
            return F.scaled_dot_product_attention(q, k, v.detach(), **kw)
    monkeypatch.setattr(legality, "F", CutV())
    torch._dynamo.reset()
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    got = fast(x)
    assert codes(fast.report, NAME) == {"witness.gradients_disagree"}, str(fast.report)
    assert torch.equal(got, model(x))
