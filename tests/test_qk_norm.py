"""QK-norm (an RMSNorm over each head of q and k before the rotation: Qwen3, Gemma 3) in
the q/k/v GEMM's epilogue with the rotation: the models that spell it, through optimize()
and the backend, in inference and training; the program, its kernel source and backward;
the witness on a wrong weight layout."""

from __future__ import annotations

import copy

import pytest
import torch

import coda_rewrite
from coda_rewrite.numerics import rel_err
from conftest import grads_match, hf_model, step_matches_eager, tokens

FAMILIES = ("qwen3", "gemma3")


def rope_records(report, status="rewritten"):
    return [r for r in report.records if r.pattern == "rope" and r.status == status]


@pytest.mark.parametrize("family", FAMILIES)
def test_qk_norm_goes_into_the_rotating_gemm(family):
    model = hf_model(family, head_dim=16).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
    done = rope_records(fast.report)
    assert len(done) == 2, str(fast.report)
    for r in done:
        assert r.programs[0].name == "rowscale_qknorm_rope", r.programs[0].name
        assert len(r.consumers) == 3 and "frequency 0" in r.consumers[2]  # v in the GEMM
        text = r.decision.render()
        assert "rms_head(x·P)" in text and "QK-norm" in text and "witness replay" in text
    # the norms' own records point at the rotation's
    left = [r for r in fast.report.records if r.code == "row_scale.over_projection"]
    assert len(left) == 4 and all("rope family" in r.reason for r in left)
    code = "\n".join(g.rewritten_code for g in fast.report.graphs)
    sandwich = [r for r in fast.report.records if r.code == "row_scale.post_sublayer"]
    assert code.count("torch.rsqrt(") == len(sandwich)  # no QK-norm left as graph ops


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_matches_eager(family):
    report = step_matches_eager(family, model=hf_model(family, head_dim=16))
    assert len(rope_records(report)) == 2, str(report)


def test_backend_training_step_matches_eager():
    torch._dynamo.reset()
    model = hf_model("qwen3", head_dim=16).train()
    ref = copy.deepcopy(model)
    ids = tokens()
    compiled = torch.compile(model, backend="coda")
    loss, want = compiled(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    loss.backward()
    want.backward()
    grads_match(model, ref)
    report = coda_rewrite.last_report()
    assert any(r.programs and "qknorm" in r.programs[0].name
               for r in rope_records(report)), str(report)


def test_decoding_with_a_cache_matches_eager():
    from conftest import decode_matches_eager
    model = hf_model("qwen3", head_dim=16).eval()
    decode_matches_eager(model, coda_rewrite.optimize(model), tokens())


def test_norm_over_the_whole_projection_is_left_with_its_reason():
    """OLMo 2 normalises all of q before the head split: a statistic across tiles."""
    report = coda_rewrite.explain(hf_model("olmo2").eval(), tokens(), use_cache=False)
    left = [r for r in report.records if r.pattern == "rope"]
    assert left and {r.code for r in left} == {"rope.norm_over_projection"}, str(report)


def test_norm_eps_differs_between_q_and_k():
    model = hf_model("qwen3", head_dim=16).eval()
    for layer in model.model.layers:
        layer.self_attn.k_norm.variance_epsilon = 1e-3
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
    codes = {r.code for r in fast.report.records if r.pattern == "rope"}
    assert codes == {"rope.qk_norm_eps"}, str(fast.report)


@pytest.mark.provokes_pass_bug
def test_witness_catches_a_weight_in_the_wrong_order(monkeypatch):
    """The replay compares the model's own norm nodes with the program: a norm weight
    laid out in eager's order instead of the pair order is refused, not rewritten."""
    from coda_rewrite.codegen import layouts

    def unpermuted_weight(layout, offsets, like, *weights):
        parts = []
        for s, off, w in zip(map(layouts.segment, layout), offsets, weights):
            n = s.hi - s.lo
            parts.append(torch.zeros(n, dtype=torch.float64) if off is None else
                         (w.double() + off).repeat(s.n_heads))
        return torch.cat(parts)

    monkeypatch.setattr(layouts, "rope_norm_weight", unpermuted_weight)
    report = coda_rewrite.explain(hf_model("qwen3", head_dim=16).eval(), tokens(),
                                  use_cache=False)
    codes = {r.code for r in report.records if r.pattern == "rope"}
    assert codes == {"witness.disagrees"}, str(report)


def test_program_kernel_source_and_backward():
    """The program lowers to a HeadRstd prepass (the statistic of the value the norm
    reads: r·acc + bias) before the rotation; the family's backward equals autograd
    through the reference."""
    from coda_rewrite.codegen import reference
    from coda_rewrite.codegen.quack_source import generate
    from coda_rewrite.kernels import backward
    from coda_rewrite.patterns.rope import rope_program

    prog = rope_program(True, True, True, torch.float64, norm=(8, 1e-5, True, False))
    ks = generate(prog)
    assert "HeadRstd(" in ks.source and "prepass=prepass" in ks.source
    assert "def prepass(acc, o_r, o_bias):" in ks.source
    assert ks.constants == (("grp0_n", 8),)
    assert "must divide the tile width and N" in ks.contract.render()
    torch.manual_seed(0)
    m, k, n = 6, 12, 32
    a, b = torch.randn(m, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
    values = {"r": torch.rand(m, dtype=torch.float64) + 0.5,
              "pos": torch.arange(m, dtype=torch.float32) * 3,
              "freq": torch.rand(n, dtype=torch.float32) * 0.1,
              "keep": torch.cat([torch.zeros(24), torch.ones(8)]).double()}
    operands = [values.get(o.name, torch.randn(n, dtype=torch.float64))
                for o in prog.operands]
    outs = reference.run_program(prog, a, b, operands)
    dout = [torch.randn_like(outs[0])]
    got = backward.vjp(prog, a, b, operands, outs, dout)
    want = backward._general_vjp(prog, a, b, operands, outs, dout)
    assert rel_err(got[0], want[0]) <= 1e-12 and rel_err(got[1], want[1]) <= 1e-12
    for spec, g, w in zip(prog.operands, got[2], want[2]):
        if spec.name in ("r", "bias", "g"):  # the rest are data: no gradient asked
            assert rel_err(g, w) <= 1e-12, spec.name


def test_group_statistic_reference_and_kind_rules():
    from coda_rewrite.codegen.op_table import head_rstd
    from coda_rewrite.codegen.program import Kind, ProgramBuilder, ProgramError
    x = torch.randn(3, 12, dtype=torch.float64)
    r = head_rstd(x, 4, 1e-6)
    want = torch.rsqrt(x.view(3, 3, 4).square().mean(-1) + 1e-6)
    assert torch.equal(r.view(3, 3, 4)[..., 0], want) and r.shape == x.shape
    p = ProgramBuilder("bad", gemm=True)
    p.output(p.head_rstd("acc", p.operand("w", Kind.PER_FEATURE), 1e-6), Kind.TILE,
             "float32")
    with pytest.raises(ProgramError, match="literal group width"):
        p.build()
    p = ProgramBuilder("bad", gemm=True)
    total = p.row_sum("acc")
    p.output(p.head_rstd(total, 4, 1e-6), Kind.PER_ROW, "float32")
    with pytest.raises(ProgramError, match="reads the columns of a tile"):
        p.build()


def test_config_holds_whole_heads():
    from coda_rewrite.kernels.quack_path import config_for
    from coda_rewrite.patterns.rope import rope_program
    pytest.importorskip("quack")
    prog = rope_program(True, False, False, torch.bfloat16, norm=(128, 1e-6, True, False))
    for m in (1, 16, 64, 256, 1024, 8192):
        cfg = config_for(prog, m, 6144)
        assert cfg is not None and cfg.tile_n % 128 == 0, (m, cfg)
    prog = rope_program(True, False, False, torch.bfloat16, norm=(256, 1e-6, True, False))
    assert all(config_for(prog, m, 8192).tile_n == 256 for m in (64, 256, 8192))


def test_norm_weights_kept_between_calls_follow_an_update():
    """Outside autograd the fused norm weight is kept between calls (on the weight, keyed
    by its version): an in-place update of a norm's weight is seen at the next call."""
    from coda_rewrite.patterns import rope
    model = hf_model("qwen3", head_dim=16).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    norm = model.model.layers[0].self_attn.q_norm.weight
    with torch.no_grad():
        fast(ids)
        kept = getattr(norm, rope._NORM_WEIGHT)[1]
        fast(ids)
        assert getattr(norm, rope._NORM_WEIGHT)[1] is kept  # a hit: not made again
        norm.mul_(1.5)
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
        assert getattr(norm, rope._NORM_WEIGHT)[1] is not kept


@pytest.mark.parametrize("norm_at", ["heads", "transposed", "after_rotation"])
def test_each_order_of_norm_and_rotation_in_training(norm_at):
    """The norm before the heads' transpose (Qwen3), after it (Gemma 3) or after the
    rotation: one program each, the output and every gradient eager's."""
    from conftest import module_step_matches_eager
    from test_property_qk_norm import HID, Attention
    case = {"norm_at": norm_at, "normed": "both", "weight": "gemma", "eps_k": "same",
            "upcast": True, "bias": True, "second": "none", "angles_no_grad": False,
            "stat": "features"}
    class Output(torch.nn.Module):  # the attention's output alone
        def __init__(self):
            super().__init__()
            self.inner = Attention(case)

        def forward(self, x):
            return self.inner(x)[0]

    torch.manual_seed(0)
    report = module_step_matches_eager(Output().train(), torch.randn(2, 6, HID))
    (done,) = rope_records(report)
    # a training graph: the angles read as one table (patterns/rope.angles_as_table)
    want = "rope_table_qknorm" if norm_at == "after_rotation" else "qknorm_rope_table"
    assert done.programs[0].name == want, done.programs[0].name
    if norm_at == "after_rotation":
        assert "rms_head(R(θ)·x) = rms_head(x)" in done.decision.render()


def test_hunyuan_norms_after_the_rotation():
    """HunYuan (dense v1) normalises q and k after the rotation: the other order's
    program, and a training step through it, against eager."""
    report = step_matches_eager("hunyuan", model=hf_model("hunyuan", head_dim=16))
    done = rope_records(report)
    assert len(done) == 2 and all(r.programs[0].name == "rowscale_rope_table_qknorm"
                                  for r in done), str(report)


def test_dynamic_true_runtime_eps_is_left_with_its_reason():
    """Under dynamic=True dynamo passes the norms' eps as a run-time scalar; the kernel's
    per-head statistic compiles its eps in, so the rotation is left with the reason.
    Automatic dynamic shapes (a recompile for a new length) keep the eps a constant."""
    from coda_rewrite import CodaBackend
    model = hf_model("qwen3", head_dim=16).eval()

    def rope_codes(**compile_kw):
        torch._dynamo.reset()
        backend = CodaBackend()
        compiled = torch.compile(model, backend=backend, **compile_kw)
        with torch.no_grad():
            for length in (8, 12):  # automatic dynamic: the second compile is symbolic
                ids = torch.randint(1, 256, (2, length))
                assert rel_err(compiled(ids, use_cache=False).logits,
                               model(ids, use_cache=False).logits) <= 1e-5
        return {r.code for r in backend.report.graphs[-1].records if r.pattern == "rope"}

    assert rope_codes() == {""}  # rewritten
    assert rope_codes(dynamic=True) == {"rope.qk_norm_eps"}


def _rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


class _HeadNorm(torch.nn.Module):  # Qwen3's spelling
    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width) * 0.3 + 1)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class PartialRotary(torch.nn.Module):
    """QK-norm over the whole head, the rotation over its first ``rot`` features (the
    rest passed through, concatenated back); separate or packed q/k/v projections."""

    H, KV, D, HID = 4, 2, 16, 32

    def __init__(self, packed: bool, rot: int):
        super().__init__()
        self.packed, self.rot = packed, rot
        widths = (self.H * self.D, self.KV * self.D, self.KV * self.D)
        if packed:
            self.qkv = torch.nn.Linear(self.HID, sum(widths), bias=False)
        else:
            self.q, self.k, self.v = (torch.nn.Linear(self.HID, w, bias=False) for w in widths)
        self.q_norm, self.k_norm = _HeadNorm(self.D), _HeadNorm(self.D)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, rot, 2) / rot)))

    def forward(self, x):
        b, s, _ = x.shape
        if self.packed:  # Phi-3's slices (a torch.split of the columns is not read yet)
            qkv, q_end = self.qkv(x), self.H * self.D
            q, k, v = qkv[..., :q_end], qkv[..., q_end:q_end + self.KV * self.D], \
                qkv[..., q_end + self.KV * self.D:]
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = self.q_norm(q.view(b, s, self.H, self.D)).transpose(1, 2)
        k = self.k_norm(k.view(b, s, self.KV, self.D)).transpose(1, 2)
        v = v.view(b, s, self.KV, self.D).transpose(1, 2)
        pos = torch.arange(s)[None].float()
        th = (self.inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2)
        emb = torch.cat((th, th), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]

        def rope(t):
            rotated, rest = t[..., :self.rot], t[..., self.rot:]
            return torch.cat([rotated * cos + _rotate_half(rotated) * sin, rest], -1)
        return torch.nn.functional.scaled_dot_product_attention(
            rope(q), rope(k), v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_partial_rotary_with_a_norm_over_the_whole_head(packed):
    """The statistic runs over the whole head (rotated and pass-through features), the
    rotation over its first half: one program, the step eager's."""
    from conftest import module_step_matches_eager
    torch.manual_seed(0)
    report = module_step_matches_eager(PartialRotary(packed, 8).train(),
                                       torch.randn(2, 6, PartialRotary.HID))
    (done,) = rope_records(report)
    # a training graph: the angles read as one table (patterns/rope.angles_as_table)
    assert done.programs[0].name == "qknorm_rope_table", done.programs[0].name


def test_a_norm_after_the_rotation_with_a_run_time_eps_says_so():
    """Under dynamic=True (a run-time eps) a norm after the rotation cannot join the
    epilogue; left as a graph op its weight would read the permuted heads, so the
    rotation alone would not pay either: the record says why (the eps), the output is
    eager's."""
    from coda_rewrite import CodaBackend
    torch._dynamo.reset()
    model = hf_model("hunyuan", head_dim=16).eval()
    backend = CodaBackend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    ids = tokens()
    with torch.no_grad():
        assert rel_err(compiled(ids, use_cache=False).logits,
                       model(ids, use_cache=False).logits) <= 1e-5
    codes = {r.code for r in backend.report.records if r.pattern == "rope"}
    assert codes == {"rope.qk_norm_eps"}, codes
