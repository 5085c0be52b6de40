"""An adversary for the attention-mask prover (algebra/mask.py): hypothesis builds the
mask an attention reads from position comparisons the way models spell them (arange
indices, ``k <= q`` and its off-by-one look-alikes, strict and anti-causal orders,
sliding windows shorter, equal to and longer than the sequence, terms that always hold,
a padding term read from an input, conjunctions, disjunctions and negations, ``tril``
with a diagonal, boolean or additive (−inf / finfo.min) masks, a cache offset so that
the query rows sit at the end of the keys, the indices read through a positions tensor as
transformers 5.25 does: arange positions, scaled or reversed, an index one early that
wraps around, positions given as an input) and checks that the rewritten model's
attention is eager's (NaN where eager's is: a fully masked row), that the plain causal
spellings become ``is_causal=True``, and that every mask left carries a reason.

Seed 20261201 (200 examples) found, against the code of 2026-12-01 (b1de1fe), two
causal spellings the prover left as masks (slower attention, never a wrong one):
``k < q + 1`` (a strict comparison of integers: now read as k ≤ q,
algebra/mask._nonstrict) and ``tril(ones(n, n, dtype=bool))`` (a boolean grid of ones
was not modelled). test_found_causal_spellings keeps them.

A session's probe of 2026-12-07 found a wrong result the generator could not make: one
arange read along both dims (``i = arange(s); i[None, :] <= i[:, None]``, the common
hand-written spelling) was one index symbol on two dims, so every comparison of q with k
was ``x <= x``, true everywhere, and a sliding window ``(k <= q) & (q - k < 3)`` was
"proved" causal: the window dropped, attention wrong by 0.4 (an anti-causal ``k >= q``
would have been made causal too). Each dim's index is now its own symbol
(algebra/mask.MaskInterpreter._broadcast); ``index`` "one", "unsqueeze" and "expand"
generate that spelling three ways."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import coda_rewrite

D, HEADS = 16, 2

# a comparison between the query index q and the key index k (k runs over the past too,
# when there is a cache: q is then offset by its length p)
TERMS = {
    "k<=q": lambda q, k, s: k <= q,
    "q>=k": lambda q, k, s: q >= k,
    "k<q+1": lambda q, k, s: k < q + 1,
    "not k>q": lambda q, k, s: ~(k > q),
    "k<q": lambda q, k, s: k < q,                  # strictly causal: row 0 empty
    "k<=q+1": lambda q, k, s: k <= q + 1,          # one key of the future
    "k<=q-1": lambda q, k, s: k <= q - 1,
    "q<=k": lambda q, k, s: q <= k,                # anti-causal
    "window 2": lambda q, k, s: k > q - 2,
    "window s": lambda q, k, s: k > q - s,         # as long as the sequence: no-op
    "window s+3": lambda q, k, s: k > q - (s + 3),
    "k>=0": lambda q, k, s: k >= 0,
    "pad": lambda q, k, s: None,                   # the padding mask (an input)
}
CAUSAL = ("k<=q", "q>=k", "k<q+1", "not k>q")


class Attention(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def mask(self, s, p, pad, given_positions):
        c = self.case
        q = (torch.arange(s) + p)[:, None]
        k = torch.arange(s + p)[None, :]
        if c.get("index", "two") != "two" and not p:  # one arange read along both dims
            i = torch.arange(s)
            q, k = {"one": lambda: (i[:, None], i[None, :]),
                    "unsqueeze": lambda: (i.unsqueeze(1), i.unsqueeze(0)),
                    "expand": lambda: (i[:, None].expand(s, s), i[None, :].expand(s, s)),
                    }[c["index"]]()
        if c["positions"] is not None:  # transformers 5.25: positions gathered by index
            q, k = self.positions(s + p, given_positions, q, k)
        if c["tril"] == "float":  # a look-alike: tril of float ones is an additive 0/1
            grid = torch.tril(torch.ones(s + p, s + p))  # bias, not a mask
            return grid[p:] if p else grid
        if c["tril"] is not None:
            allowed = torch.tril(torch.ones(s + p, s + p, dtype=torch.bool),
                                 diagonal=c["tril"])
            allowed = allowed[p:] if p else allowed  # the rows of the new queries
        else:
            allowed = None
            for i, name in enumerate(c["terms"]):
                t = pad[:, None, None, :] if name == "pad" else TERMS[name](q, k, s)
                t = ~t if i in c["negate"] else t
                allowed = t if allowed is None else (
                    allowed | t if c["join"] == "or" else allowed & t)
        if c["additive"] is None:
            return allowed
        fill = float("-inf") if c["additive"] == "-inf" else torch.finfo(torch.float32).min
        return torch.zeros(allowed.shape).masked_fill(~allowed, fill)

    def positions(self, n, given, q, k):
        """(positions[b, q], positions[b, k]) as [2, 1, s, 1] and [2, 1, 1, n]: the
        positions arange(n) (the plain spelling, its scaled and reversed look-alikes),
        read one index early (``shift``: index −1 wraps around to the last position), or
        given as an input (values unknown when compiling)."""
        how = self.case["positions"]
        pos = given if how == "input" else torch.arange(n)[None].expand(2, -1)
        if how == "scaled":
            pos = pos * 2
        elif how == "reversed":
            pos = (n - 1) - pos
        if how == "shift":
            q, k = q - 1, k - 1
        b = torch.arange(2)[:, None, None, None]
        return pos[b, q[None, None]], pos[b, k[None, None]]

    def forward(self, x, past, pad, given_positions):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        p = past.shape[2] if self.case["cache"] else 0
        if p:
            k, v = torch.cat((past, k), dim=2), torch.cat((past, v), dim=2)
        m = self.mask(s, p, pad, given_positions)
        m = m if m.dim() == 4 else m[None, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


cases = st.fixed_dictionaries({
    "terms": st.one_of(st.sampled_from(CAUSAL).map(lambda t: [t]),
                       st.lists(st.sampled_from(sorted(TERMS)), min_size=1, max_size=3)),
    "negate": st.sets(st.integers(0, 2), max_size=1),
    "join": st.sampled_from(["and", "and", "or"]),
    "tril": st.one_of(st.none(), st.none(), st.sampled_from([0, 1, -1, "float"])),
    "additive": st.sampled_from([None, None, "-inf", "finfo.min"]),
    "cache": st.sampled_from([False, False, True]),
    "seq": st.sampled_from([1, 3, 6]),
    "positions": st.sampled_from([None, None, "arange", "scaled", "reversed", "shift",
                                  "input"]),
    "index": st.sampled_from(["two", "one", "unsqueeze", "expand"]),
})


def _is_plain_causal(case) -> bool:
    """Spellings the prover must turn into is_causal: k ≤ q alone (in any of its four
    spellings) or a tril of ones with diagonal 0, no cache, boolean or additive."""
    plain = case["tril"] == 0 or (case["tril"] is None and len(case["terms"]) == 1 and
                                  case["terms"][0] in CAUSAL and not case["negate"] and
                                  case["positions"] in (None, "arange", "scaled"))
    return plain and not case["cache"]


def _run(case, note=event):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Attention(case).eval()
    s = case["seq"]
    x = torch.randn(2, s, D)
    past = torch.randn(2, HEADS, 2, D // HEADS)
    pad = torch.ones(2, s + (2 if case["cache"] else 0), dtype=torch.bool)
    pad[1, 0] = False
    given = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4][:s + 2]] * 2)  # two packed sequences
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    with torch.no_grad():
        want = model(x, past, pad, given)
        got = fast(x, past, pad, given)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True,
                               msg=lambda m: f"{case}: {m}\n{fast.report}")
    records = [r for r in fast.report.records if r.pattern == "attention_inputs"]
    causal = "is_causal = True" in str(fast.report)  # the rewritten graph's SDPA call
    note(f"made causal: {causal}")
    assert all(r.code for r in records if r.status != "rewritten"), str(fast.report)
    if _is_plain_causal(case):
        assert causal, (case, str(fast.report))


@seed(20261201)
@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_generated_masks_keep_eagers_attention(case):
    _run(case)


BASE = {"terms": ["k<=q"], "negate": set(), "join": "and", "tril": None, "additive": None,
        "cache": False, "seq": 6, "positions": None, "index": "two"}


@pytest.mark.parametrize("change", [{"terms": ["k<q+1"]}, {"tril": 0},
                                    {"tril": 0, "additive": "finfo.min"},
                                    {"terms": ["k<q+1"], "additive": "-inf"},
                                    {"positions": "arange"}, {"positions": "scaled"},
                                    {"positions": "arange", "terms": ["k<q+1"]},
                                    {"index": "one"}, {"index": "one", "terms": ["q>=k"]},
                                    {"index": "one", "terms": ["k<=q", "window s"]},
                                    {"index": "unsqueeze"}, {"index": "expand"}])
def test_found_causal_spellings(change):
    seen = []
    _run({**BASE, **change}, note=seen.append)
    assert seen == ["made causal: True"]


@pytest.mark.parametrize("change", [{"terms": ["k<q"]}, {"tril": 1}, {"tril": -1},
                                    {"tril": "float"},
                                    {"tril": 0, "cache": True}, {"terms": ["k<=q+1"]},
                                    {"positions": "reversed"}, {"positions": "shift"},
                                    {"positions": "input"},
                                    {"positions": "arange", "cache": True},
                                    {"index": "one", "terms": ["q<=k"]},
                                    {"index": "one", "terms": ["k<=q", "window 2"]},
                                    {"index": "one", "terms": ["k<q"]},
                                    {"index": "unsqueeze", "terms": ["k<=q", "window 2"]},
                                    {"index": "expand", "terms": ["k<=q", "window 2"]}])
def test_their_look_alikes_keep_the_mask(change):
    seen = []
    _run({**BASE, **change}, note=seen.append)
    assert seen == ["made causal: False"]
