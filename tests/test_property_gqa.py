"""An adversary for the grouped-query half of the attention rewrite (patterns/attention.py:
a key/value that is repeat_kv of fewer heads becomes SDPA's ``enable_gqa=True`` on the
unrepeated tensor, which maps query head h to key head h // n_rep). Hypothesis draws the
head counts and how the keys and the values are repeated (Hugging Face's expand + reshape,
repeat_interleave, TorchTitan's repeat on [b, s, h, d] before the transpose, and the
look-alikes that tile instead: ``Tensor.repeat``, an expand in front of the head dim; one
spelling for the keys and another for the values; a second reader of the repeated keys;
a mask or none) and checks that the attention is eager's, that the repeat_kv spellings
become enable_gqa, and that every match left carries a reason."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import coda_rewrite

HD = 8  # head_dim

GQA = ("expand", "repeat_interleave", "titan")      # head g serves query heads g·r .. g·r+r−1
TILED = ("repeat", "expand in front")                # head g serves query heads g, g+G, ...


def repeated(how: str, t: torch.Tensor, r: int) -> torch.Tensor:
    """[b, G, s, d] → [b, G·r, s, d] the way ``how`` spells it."""
    b, g, s, d = t.shape
    if how == "none":
        return t
    if how == "expand":  # Hugging Face's repeat_kv
        return t[:, :, None, :, :].expand(b, g, r, s, d).reshape(b, g * r, s, d)
    if how == "repeat_interleave":
        return t.repeat_interleave(r, dim=1)
    if how == "titan":  # TorchTitan: on [b, s, G, d], then heads before the sequence
        x = t.transpose(1, 2)
        x = x[:, :, :, None, :].expand(b, s, g, r, d).reshape(b, s, g * r, d)
        return x.transpose(1, 2)
    if how == "repeat":
        return t.repeat(1, r, 1, 1)
    if how == "expand in front":
        return t[:, None].expand(b, r, g, s, d).reshape(b, r * g, s, d)
    raise ValueError(how)


class Attention(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        h, g = case["heads"]
        self.q = nn.Linear(16, h * HD, bias=False)
        self.k = nn.Linear(16, g * HD, bias=False)
        self.v = nn.Linear(16, g * HD, bias=False)

    def forward(self, x):
        c = self.case
        b, s, _ = x.shape
        h, g = c["heads"]
        q = self.q(x).view(b, s, h, HD).transpose(1, 2)
        k = self.k(x).view(b, s, g, HD).transpose(1, 2)
        v = self.v(x).view(b, s, g, HD).transpose(1, 2)
        kr, vr = repeated(c["k"], k, h // g), repeated(c["v"], v, h // g)
        mask = None
        if c["mask"]:
            i = torch.arange(s)
            mask = i[None, :] <= i[:, None]
        out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        return (out, kr) if c["second_reader"] else out


cases = st.fixed_dictionaries({
    "heads": st.sampled_from([(4, 2), (4, 1), (6, 3), (6, 2), (4, 4)]),
    "spelling": st.one_of(st.sampled_from(GQA + TILED).map(lambda s: (s, s)),
                          st.sampled_from(GQA + TILED).map(lambda s: (s, s)),
                          st.tuples(st.sampled_from(GQA + TILED),
                                    st.sampled_from(GQA + TILED))),
    "mask": st.booleans(),
    "second_reader": st.sampled_from([False, False, True]),
}).map(lambda c: {**c, "k": c["spelling"][0], "v": c["spelling"][1]})


def _run(case, note=event):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Attention(case).eval()
    x = torch.randn(2, 5, 16)
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    with torch.no_grad():
        want, got = model(x), fast(x)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{case}: {m}\n{fast.report}")
    code = "\n".join(g.rewritten_code for g in fast.report.graphs)
    gqa = "enable_gqa = True" in code
    note(f"enable_gqa: {gqa}")
    records = [r for r in fast.report.records if r.pattern == "attention_inputs"]
    assert all(r.code for r in records if r.status != "rewritten"), str(fast.report)
    h, g = case["heads"]
    if case["k"] in GQA and case["v"] in GQA and h > g:  # the mask drawn is causal:
        assert gqa, (case, str(fast.report))               # dropped, so GQA applies
    if case["k"] in TILED or case["v"] in TILED:
        assert not gqa or h == g, (case, code)


@seed(20261201)
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_generated_repeats_keep_eagers_attention(case):
    _run(case)
