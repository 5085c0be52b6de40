"""Codegen: generated QuACK sources (golden text), programs no pattern produces yet,
the layout-contract checker, and an sm_90a compile of every kernel the test models
produce, on a machine with no GPU (PTX checked for wgmma and TMA)."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import coda_rewrite
from coda_rewrite.codegen.program import ACC, Kind, ProgramBuilder, ProgramError
from coda_rewrite.codegen.quack_source import Unlowerable, generate
from coda_rewrite.codegen import dgated_source
from coda_rewrite.patterns import routed_experts
from coda_rewrite.kernels.quack_path import contract_violation
from coda_rewrite.patterns.layernorm import centred_program

from coda_rewrite.numerics import rel_err
from conftest import ROOT, hf_model, plain_llama, tokens

GOLDEN = Path(__file__).parent / "golden"


def program_of(name, body, operands=(), outputs=None):
    p = ProgramBuilder(name, gemm=True)
    ops = {n: p.operand(n, k) for n, k in operands}
    outs = body(p, ops)
    for value, kind, dtype in outs:
        p.output(value, kind, dtype)
    return p.build()


def residual_rmsnorm():
    def body(p, o):
        z = p.add(ACC, o["residual"], name="z")
        h2 = p.mul(z, o["gamma"], name="h2")
        r = p.rsqrt(p.add(p.div(p.row_sum(p.square(z), name="ss"), 4096.0), 1e-6), name="r")
        return [(z, Kind.TILE, "bfloat16"), (h2, Kind.TILE, "bfloat16"),
                (r, Kind.PER_ROW, "float32")]
    return program_of("residual_rmsnorm", body,
                      [("residual", Kind.TILE), ("gamma", Kind.PER_FEATURE)])


def rowscale_bias():
    def body(p, o):
        return [(p.add(p.mul(ACC, o["r"], name="y"), o["bias"], name="y_b"), Kind.TILE,
                 "bfloat16")]
    return program_of("rowscale", body, [("r", Kind.PER_ROW), ("bias", Kind.PER_FEATURE)])


# Programs no pattern produces yet: each is a new kernel without new kernel code.
def gemma_offset_scaled_residual():
    """Gemma's (1 + γ), a GEMM-output scale and eps read at run time, a bias on a
    second output."""
    def body(p, o):
        z = p.add(p.mul(ACC, o["alpha"]), o["residual"], name="z")
        h2 = p.mul(z, p.add(o["gamma"], 1.0), name="h2")
        ss = p.row_sum(p.square(z), name="ss")
        r = p.rsqrt(p.add(p.div(ss, 2048.0), o["eps"]), name="r")
        return [(z, Kind.TILE, "bfloat16"), (h2, Kind.TILE, "bfloat16"),
                (p.add(z, o["bias"], name="zb"), Kind.TILE, "bfloat16"),
                (r, Kind.PER_ROW, "float32")]
    return program_of("gemma_residual", body, [
        ("alpha", Kind.SCALAR), ("bias", Kind.PER_FEATURE), ("residual", Kind.TILE),
        ("gamma", Kind.PER_FEATURE), ("eps", Kind.SCALAR)])


def activations_and_two_tiles():
    """Transcendentals, a second tile input (TileLoad), a max reduce, a plain sum."""
    def body(p, o):
        y = p.mul(p.silu(p.add(p.mul(ACC, o["r"]), o["res"])), o["gate"], name="y")
        g = p.gelu_tanh(p.sub(y, p.sigmoid(o["gate"])), name="g")
        e = p.exp(p.neg(p.div(g, 4.0)), name="e")
        # a plain (not product) sum of a value that is 0 on the padding: silu(0) = 0
        s = p.row_sum(p.silu(p.mul(p.mul(y, y), o["r"]), name="sy"), name="ysum")
        return [(e, Kind.TILE, "float32"), (y, Kind.TILE, "bfloat16"),
                (p.row_max(g, name="gmax"), Kind.PER_ROW, "float32"),
                (p.sqrt(p.add(s, 1.0)), Kind.PER_ROW, "float32")]
    return program_of("mixed", body, [("r", Kind.PER_ROW), ("res", Kind.TILE),
                                      ("gate", Kind.TILE)])


def ce_softmax_grad():
    """The cross-entropy backward's recomputing GEMM: exp(r·acc − lse)·dsm·r."""
    from coda_rewrite.kernels.backward.cross_entropy import softmax_grad_program
    return softmax_grad_program(True, False, "bfloat16")


def residual_multiplier():
    """What the norm pattern produces for Granite / Phi-3: z = c·acc + residual, a
    constant multiplier (c = 0.25) between the GEMM and the residual add."""
    def body(p, o):
        z = p.add(p.mul(ACC, 0.25), o["residual"], name="z")
        h2 = p.mul(z, o["gamma"], name="h2")
        r = p.rsqrt(p.add(p.div(p.row_sum(p.square(z), name="ss"), 4096.0), 1e-6), name="r")
        return [(z, Kind.TILE, "bfloat16"), (h2, Kind.TILE, "bfloat16"),
                (r, Kind.PER_ROW, "float32")]
    return program_of("residual_rmsnorm", body, [("residual", Kind.TILE),
                                                 ("gamma", Kind.PER_FEATURE)])


SOFT_CAP = (("div", 30.0), ("tanh", None), ("mul", 30.0))


def ce_soft_capped():
    """Gemma 2's LM head: z = 30·tanh(y / 30) before the online log-sum-exp, z stored."""
    from coda_rewrite.patterns.cross_entropy import ce_program
    return ce_program(True, False, torch.bfloat16, "float32", SOFT_CAP)


def ce_soft_capped_softmax_grad():
    """Its logits-free backward: exp(z − lse)·dsm·(1 − (z / 30)²)·r."""
    from coda_rewrite.kernels.backward.cross_entropy import softmax_grad_program
    return softmax_grad_program(True, False, "bfloat16", SOFT_CAP)


NEW_PROGRAMS = [gemma_offset_scaled_residual, activations_and_two_tiles, ce_softmax_grad,
                residual_multiplier, ce_soft_capped, ce_soft_capped_softmax_grad]


def rowscale_gated(op: str = "swiglu"):
    """Class 2: the deferred rstd, then a gated pair over interleaved gate/up columns."""
    def body(p, o):
        y = p.emit(op, p.mul(ACC, o["r"], name="y"), name="act")
        return [(y, Kind.PAIR, "bfloat16")]
    return program_of(f"rowscale_{op}", body, [("r", Kind.PER_ROW)])


def lse_target():
    """Class 6: logits stored, online log-sum-exp and the target logit per row."""
    def body(p, o):
        lse = p.row_logsumexp(ACC, name="lse")
        tl = p.select_column(ACC, o["target"], name="tl")
        return [(ACC, Kind.TILE, "bfloat16"), (p.sub(lse, tl, name="loss"), Kind.PER_ROW,
                                               "float32")]
    return program_of("lse_target", body, [("target", Kind.PER_ROW)])


def rowscale_geglu():
    return rowscale_gated("geglu")


def gated_training():
    """What the gated-MLP pattern emits for a training graph: rstd, a bias, SwiGLU, and
    the pre-activation kept for the backward (full width, as D)."""
    from coda_rewrite.patterns.gated_mlp import gated_program
    return gated_program("swiglu", True, True, torch.bfloat16, keep_preact=True)


def geglu_erf_plain():
    """Exact-erf GeGLU straight off a GEMM (no norm in front)."""
    from coda_rewrite.patterns.gated_mlp import gated_program
    return gated_program("geglu_erf", False, False, torch.bfloat16, keep_preact=False)


def ce_logits_kept():
    """What the cross-entropy pattern emits when the logits are read: the final norm's
    rstd, the logits stored, lse and the target logit."""
    from coda_rewrite.patterns.cross_entropy import ce_program
    return ce_program(True, False, torch.bfloat16)


def ce_no_logits():
    """... and when nothing reads them: no tile is stored at all (reductions only)."""
    from coda_rewrite.patterns.cross_entropy import ce_program
    return ce_program(True, False, None)


def rope_qkv():
    """What the RoPE pattern emits for Llama's q/k/v: the input norm's rstd, then the
    rotation by θ = pos·f (frequency 0 on v's columns)."""
    from coda_rewrite.patterns.rope import rope_program
    return rope_program(True, False, False, torch.bfloat16)


def rope_bias_scaled():
    """Qwen2-style biases and a YaRN attention scaling, no norm in front."""
    from coda_rewrite.patterns.rope import rope_program
    return rope_program(False, True, True, torch.bfloat16)


def rope_table_qk():
    """The complex (TorchTitan) form: q and k rotated by rows of the model's table."""
    from coda_rewrite.patterns.rope import rope_table_program
    return rope_table_program(True, False, torch.bfloat16)


def rope_table_qkv():
    """A table rotation with v passing through under a per-column 0 flag."""
    from coda_rewrite.patterns.rope import rope_table_program
    return rope_table_program(True, True, torch.bfloat16, passthrough=True)


def qk_norm_programs():
    """The RoPE pattern's QK-norm programs (heads of 128): before the rotation (Qwen3,
    Gemma 3) and after it, by angles and by a table."""
    from coda_rewrite.patterns.rope import rope_program, rope_table_program
    bf = torch.bfloat16
    return [rope_program(True, False, False, bf, norm=(128, 1e-6, True, False)),
            rope_program(False, True, True, bf, norm=(128, 1e-5, False, True)),
            rope_table_program(True, False, bf, passthrough=True, norm=(128, 1e-6, True, False)),
            rope_table_program(True, False, bf, passthrough=True, norm=(128, 1e-6, True, True))]


def rowscale_swiglu_clamp():
    """DeepSeek-V4's clamped SwiGLU (literal limit) after the deferred rstd."""
    def body(p, o):
        y = p.emit("swiglu_clamp", p.mul(ACC, o["r"], name="y"), 7.0, name="act")
        return [(y, Kind.PAIR, "bfloat16")]
    return program_of("rowscale_swiglu_clamp", body, [("r", Kind.PER_ROW)])


# Pair mode and stateful sinks: N must be even (pairs) and the index operand is an int
PAIR_AND_STATEFUL = [rowscale_gated, rowscale_geglu, rowscale_swiglu_clamp, gated_training,
                     geglu_erf_plain, lse_target, ce_logits_kept, ce_no_logits, rope_qkv,
                     rope_bias_scaled, rope_table_qk, rope_table_qkv]


@pytest.mark.parametrize("make", [residual_rmsnorm, rowscale_bias], ids=lambda f: f.__name__)
def test_golden_source(make):
    ks = generate(make())
    path = GOLDEN / f"{make.__name__}.py.txt"
    if os.environ.get("CODA_UPDATE_GOLDEN"):
        path.write_text(ks.source)
    assert ks.source == path.read_text(), f"regenerate with CODA_UPDATE_GOLDEN=1: {path}"


def test_new_combinations_generate_new_kernels():
    ks = generate(gemma_offset_scaled_residual())
    src = ks.source
    assert 'ops={"o_alpha": Scalar("o_alpha"), "o_bias": RowVecLoad("o_bias"), ' \
           '"o_gamma": RowVecLoad("o_gamma")}' in src, src
    assert "o_eps" not in src  # eps is read by the row stage only
    assert "v_t1 = acc * o_alpha" in src and "o_gamma + 1.0" in src
    assert [i.op for i in ks.row_stage] == ["div", "add", "rsqrt"]
    ks2 = generate(activations_and_two_tiles())
    src2 = ks2.source
    for needle in ('"o_gate": TileLoad("o_gate")', "silu(", "gelu_tanh_approx(", "sigmoid(",
                   "pexp(", 'ColVecReduce("red1_gmax", combine="max")',
                   'ColVecReduce("red0_ysum")', "outputs=('out1_y',)"):
        assert needle in src2, (needle, src2)
    assert [i.op for i in ks2.row_stage] == ["add", "sqrt"]
    assert ks.module_name != ks2.module_name


def test_pair_mode_source_and_contract():
    ks = generate(rowscale_gated())
    src = ks.source
    for needle in ('mode="acc_pair"', "outputs=('postact',)", "unpack(v_y)",
                   "silu(v_act_gate) * v_act_up", 'return {"postact": v_act}'):
        assert needle in src, (needle, src)
    text = ks.contract.render()
    assert "[M, N/2]" in text and "interleave gate and up" in text
    assert "gelu_tanh_approx(v_act_gate)" in generate(rowscale_gated("geglu")).source
    train = generate(gated_training()).source
    for needle in ('"o_bias": RowVecLoad("o_bias")', "v_y_b_lo, v_y_b_hi = unpack(v_y_b)",
                   '"D": pack(v_y_b_lo, v_y_b_hi), "postact": v_act'):
        assert needle in train, (needle, train)
    assert "gelu_erf(v_act_gate) * v_act_up" in generate(geglu_erf_plain()).source
    for bad, why in ((lambda p, o: [(p.swiglu(ACC), Kind.PAIR, "bfloat16"),
                                    (p.row_sum(ACC), Kind.PER_ROW, "float32")], "reductions"),
                     (lambda p, o: [(p.swiglu(ACC), Kind.PAIR, "bfloat16"),
                                    (ACC, Kind.TILE, "bfloat16"),
                                    (p.mul(ACC, 2.0), Kind.TILE, "bfloat16")], "at most one")):
        with pytest.raises(Unlowerable, match=why):
            generate(program_of("bad", bad))


def test_rotation_source_and_contract():
    ks = generate(rope_qkv())
    src = ks.source
    for needle in ('mode="acc_pair"', '"o_pos": ColVecLoad("o_pos")',
                   '"o_freq": RowVecLoad("o_freq")', '"o_r": ColVecLoad("o_r")',
                   "from quack.epilogue.rotary import _angle_turns, _sincos_turns",
                   "v_rot_x1, v_rot_x2 = unpack(v_y)",
                   "v_rot_sin, v_rot_cos = _sincos_turns(*_angle_turns(o_pos, o_freq))",
                   "pack(v_rot_x1 * v_rot_cos - v_rot_x2 * v_rot_sin, "
                   "v_rot_x1 * v_rot_sin + v_rot_x2 * v_rot_cos)"):
        assert needle in src, (needle, src)
    assert "postact" not in src  # full width: the rotated tile is D
    assert "rotation pair" in ks.contract.render()
    scaled = generate(rope_bias_scaled()).source
    assert "v_y_s = v_y_b * o_colscale" in scaled and "unpack(v_y_s)" in scaled, scaled
    assert "_angle_turns" not in generate(rowscale_gated()).source  # imported only for rope
    table = generate(rope_table_qk()).source
    for needle in ('"o_cs": rotary_cos_sin_load("o_cs")',
                   "from quack.epilogue.rotary import rotary_cos_sin_load",
                   "v_rot_cos, v_rot_sin = unpack(o_cs)"):
        assert needle in table, (needle, table)
    assert "_angle_turns" not in table
    flagged = generate(rope_table_qkv())
    for needle in ("v_rot_on, _ = unpack(o_on)",
                   "v_rot_cos = v_rot_on * v_rot_cos + (1.0 - v_rot_on)",
                   "v_rot_sin = v_rot_on * v_rot_sin"):
        assert needle in flagged.source, (needle, flagged.source)
    assert "1 on rotated columns, 0 on pass-through" in flagged.contract.render()
    with pytest.raises(ProgramError, match="per-feature rotate-or-not"):
        program_of("bad", lambda p, o: [(p.rope_table(ACC, o["cs"], o["r"]), Kind.TILE,
                                         "bfloat16")], [("cs", Kind.COS_SIN), ("r", Kind.PER_ROW)])
    with pytest.raises(ProgramError, match="positions from a per-row operand"):
        program_of("bad", lambda p, o: [(p.rope(ACC, o["f"], o["f"]), Kind.TILE, "bfloat16")],
                   [("f", Kind.PER_FEATURE)])


def test_stateful_sinks_source_and_contract():
    ks = generate(lse_target())
    src = ks.source
    for needle in ('_index_o_target = ColVecLoad("o_target")',
                   'OnlineLSEReduce("lse0_lse")',
                   'ColVecSelect("sel1_tl", idx_op=_index_o_target)',
                   "extra_ops=(_index_o_target,)", "def epilogue(acc):"):
        assert needle in src, (needle, src)
    assert "reduces=" not in src
    assert [i.op for i in ks.row_stage] == ["sub"]
    assert "ColVecLoad (index of a ColVecSelect)" in ks.contract.render()


def test_programs_that_differ_in_the_row_stage_share_a_kernel():
    def with_eps(eps):
        def body(p, o):
            z = p.add(ACC, o["residual"], name="z")
            r = p.rsqrt(p.add(p.div(p.row_sum(p.square(z)), 64.0), eps), name="r")
            return [(z, Kind.TILE, "bfloat16"), (r, Kind.PER_ROW, "float32")]
        return program_of("n", body, [("residual", Kind.TILE)])
    a, b = with_eps(1e-5), with_eps(1e-6)
    assert a.digest != b.digest
    assert generate(a).module_name == generate(b).module_name


def test_a_sum_that_counts_the_padding_is_not_lowered():
    """QuACK's add-reduce folds the padding lanes of a ragged last tile: a sum is only
    lowered when its value is 0 there (exp(0) = 1 is not; a bias lane is not loaded)."""
    for bad in (lambda p, o: p.exp(ACC), lambda p, o: p.add(ACC, o["bias"]),
                lambda p, o: p.add(ACC, 1.0)):
        def body(p, o, bad=bad):
            return [(ACC, Kind.TILE, "bfloat16"),
                    (p.row_sum(bad(p, o)), Kind.PER_ROW, "float32")]
        with pytest.raises(Unlowerable, match="padding"):
            generate(program_of("bad", body, [("bias", Kind.PER_FEATURE)]))
    # the same values are fine inside a product with the accumulator, or from tiles
    def good(p, o):
        z = p.add(ACC, o["res"])
        return [(z, Kind.TILE, "bfloat16"),
                (p.row_sum(p.mul(p.exp(ACC), z)), Kind.PER_ROW, "float32"),
                (p.row_sum(p.mul(z, o["bias"])), Kind.PER_ROW, "float32")]
    generate(program_of("good", good, [("bias", Kind.PER_FEATURE), ("res", Kind.TILE)]))


def test_unlowerable_programs_say_why():
    p = ProgramBuilder("cast", gemm=True)  # the kernel rounds to 16-bit dtypes only
    p.output(p.cast(ACC, dtype="float32"), Kind.TILE, "float32")
    with pytest.raises(Unlowerable, match="cast to float32"):
        generate(p.build())
    q = ProgramBuilder("rows", gemm=False)
    q.output(q.operand("x", Kind.TILE), Kind.TILE, "float32")
    with pytest.raises(Unlowerable, match="no GEMM"):
        generate(q.build())


# ---- the layout contract ---------------------------------------------------------------

def _tensors(m=64, k=64, n=64, dtype=torch.bfloat16):
    return (torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype),
            [torch.randn(m, n, dtype=dtype), torch.randn(n, dtype=dtype)])


def test_contract_accepts():
    prog = residual_rmsnorm()
    assert contract_violation(prog, *_tensors()) is None
    assert contract_violation(prog, *_tensors(m=5, k=72, n=200)) is None  # ragged M and N
    assert contract_violation(prog, *_tensors(dtype=torch.float16)) is None


@pytest.mark.parametrize("bend,why", [
    (lambda a, b, o: (a.float(), b.float(), o), "bf16/fp16"),
    (lambda a, b, o: (a, b.half(), o), "bf16/fp16"),
    (lambda a, b, o: (a[:, :60], b[:, :60], o), "multiple of 8"),
    (lambda a, b, o: (a.t().contiguous().t(), b, o), "K-contiguous"),
    (lambda a, b, o: (a, b, [o[0][:, :32], o[1]]), "shape"),
    (lambda a, b, o: (a, b, [o[0].double(), o[1]]), "float64"),
    (lambda a, b, o: (a, b, [o[0].t().contiguous().t(), o[1]]), "unit-stride"),
    (lambda a, b, o: (a[:0], b, [o[0][:0], o[1]]), "empty"),
])
def test_contract_rejects(bend, why):
    a, b, ops = bend(*_tensors())
    got = contract_violation(residual_rmsnorm(), a, b, ops)
    assert got is not None and why in got, got


def test_cpu_calls_fall_back_and_say_why():
    from coda_rewrite.kernels import ops
    before = dict(ops.runtime_counts())
    prog = rowscale_bias()
    a, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    ops.fused_linear(prog.to_text(), a, b, torch.rand(8, 1), torch.randn(24, dtype=torch.bfloat16))
    new = {k: v for k, v in ops.runtime_counts().items() if before.get(k) != v}
    assert list(new) == [(prog.key, "reference", "device cpu (generated kernels are CUDA only)")]


# ---- sm_90a compile with no GPU ------------------------------------------------------

def _model_programs() -> list[str]:
    texts = set()
    models = [hf_model(f).to(torch.bfloat16) for f in ("llama", "qwen2", "mistral", "gemma")]
    models.append(plain_llama().to(torch.bfloat16))
    for model in models:
        # an inference graph, and a training one (its programs differ: the gated MLP keeps
        # its pre-activation, RoPE reads its angles as a table)
        for mode in (model.eval, model.train):
            torch._dynamo.reset()
            report = coda_rewrite.explain(mode(), tokens())
            assert report.count() == 5
            texts |= {p.to_text() for r in report.records for p in r.programs if p.gemm}
    return sorted(texts)


@pytest.mark.skipif(importlib.util.find_spec("quack") is None,
                    reason="needs the gpu extra (quack-kernels, nvidia-cutlass-dsl)")
def test_every_kernel_compiles_for_sm90a_without_a_gpu(tmp_path):
    from coda_rewrite.codegen import fp8  # the FP8 GEMMs, e4m3 operands
    texts = _model_programs() + [f().to_text() for f in NEW_PROGRAMS + PAIR_AND_STATEFUL] + \
        [fp8.gate_up_program("swiglu").to_text(), fp8.down_program(torch.bfloat16).to_text(),
         fp8.scaled_program(torch.bfloat16, bias=True).to_text(),
         fp8.rowwise_program(torch.bfloat16).to_text(),
         fp8.rowwise_program(torch.bfloat16, bias=True).to_text()] + \
        [p.to_text() for p in qk_norm_programs()] + \
        [centred_program(bias, "bfloat16", act).to_text()
         for bias, act in ((True, None), (False, None), (True, "gelu_erf"), (True, "relu_sq"))]
    kernels = {generate(coda_rewrite.codegen.program.parse(t)).module_name for t in texts}
    # the gated backward's dgrad kernels (kernels/dgated.py), one per pairwise op
    dgated_ops = ["swiglu", "geglu", "geglu_erf"]
    kernels |= {dgated_source.generate(op).module_name for op in dgated_ops}
    texts = texts + [{"dgated": op} for op in dgated_ops]
    # the routed experts' grouped GEMMs (kernels/grouped.py): variable-length, the gather
    # and the [gate; up] halves read interleaved; one config each
    grouped = [routed_experts.gated_program(op, torch.bfloat16).to_text()
               for op in ("swiglu", "geglu")] + \
        [routed_experts.down_program(True, torch.bfloat16).to_text()]
    # gpt-oss's: the clamped SwiGLU with each expert's bias, pairs stored interleaved, the
    # [E, K, N] weights read N-contiguous; the down GEMM's bias before the combine weight
    oai = [{"grouped": routed_experts.gated_program(
        "swiglu_oai", torch.bfloat16, True, (1.702, 7.0), True).to_text(),
        "interleaved": True, "n_major": True},
        {"grouped": routed_experts.down_program(True, torch.bfloat16, True).to_text(),
         "n_major": True}]
    # DeepSeek-V4's clamped SwiGLU over [gate; up] halves, its pre-activation kept
    oai.append({"grouped": routed_experts.gated_program(
        "swiglu_clamp", torch.bfloat16, True, (7.0,)).to_text()})
    grouped += [t["grouped"] for t in oai]
    kernels |= {generate(coda_rewrite.codegen.program.parse(t)).module_name for t in grouped}
    texts = texts + [{"grouped": t} for t in grouped[:3]] + oai
    # the routed experts' backward dgrad kernels (kernels/grouped_dgated.py): the combine
    # weight per row and its gradient as a reduction, under variable-length groups
    routed = [("swiglu", ()), ("swiglu_oai", (1.702, 7.0))]
    routed_modules = {dgated_source.generate(op, params, True).module_name
                      for op, params in routed}
    kernels |= routed_modules
    texts = texts + [{"grouped_dgated": op, "params": list(params)} for op, params in routed]
    (tmp_path / "programs.json").write_text(json.dumps(texts))
    env = {**os.environ, "QUACK_CACHE_DIR": str(tmp_path / "cache"),  # a cache hit would
           "CODA_KERNEL_DIR": str(tmp_path / "kernels"),              # skip compilation
           "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "coda_rewrite.kernels.aot",
                          str(tmp_path / "programs.json"), "--keep-ptx", str(tmp_path / "ptx")],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    compiled = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(compiled) == len(texts)
    assert {c["module"] for c in compiled} == kernels
    ptx = sorted((tmp_path / "ptx").glob("*.ptx"))
    # one compile per kernel and tile config: every config the size policy can launch it
    # with (quack_path.ROW_CLASSES), so no first call at run time meets an untried one
    per_kernel = {c["module"]: len(c["configs"]) for c in compiled}
    grouped_modules = {generate(coda_rewrite.codegen.program.parse(t)).module_name
                       for t in grouped} | routed_modules
    assert all(n >= 3 for m, n in per_kernel.items() if m not in grouped_modules), per_kernel
    assert len(ptx) == len(kernels), [p.name for p in ptx]  # the dump names no config
    objects = list((tmp_path / "cache").glob("**/*.o"))     # QuACK's cache: one each
    assert len(objects) >= sum(per_kernel.values()), (len(objects), per_kernel)
    for p in ptx:
        text = p.read_text()
        assert ".target sm_90a" in text, p.name
        assert "wgmma.mma_async" in text, p.name
        assert "cp.async.bulk.tensor" in text, p.name


def test_routes_are_memoised_per_metadata_class_and_bounded(monkeypatch):
    """The op decides its route once per program and tensor-metadata class: a tensor of
    another shape, stride or alignment is a new class; the table is bounded."""
    import torch
    from coda_rewrite.kernels import ops
    monkeypatch.setattr(ops, "_routes", {})
    monkeypatch.setattr(ops, "_MAX_ROUTES", 3)
    prog = rowscale_bias().to_text()
    a, b = torch.randn(4, 8), torch.randn(6, 8)
    r, bias = torch.randn(4), torch.randn(6)
    want = ops.execute(prog, a, b, [r, bias])
    assert len(ops._routes) == 1
    again = ops.execute(prog, a.clone(), b, [r, bias])       # same class: no new entry
    assert len(ops._routes) == 1 and torch.equal(again[0], want[0])
    ops.execute(prog, a.t().contiguous().t(), b, [r, bias])  # other strides: a new class
    ops.execute(prog, torch.randn(5, 8), b, [torch.randn(5), bias])
    assert len(ops._routes) == 3
    ops.execute(prog, torch.randn(7, 8), b, [torch.randn(7), bias])
    assert len(ops._routes) == 1                             # the bound cleared the table


# ---- the launch path's host-side decisions (no GPU needed) -----------------------------

def test_norm_row_stage_goes_to_quack_finaliser_only_for_the_exact_rstd():
    """r = rsqrt(ss / d + eps) with constant d and eps runs as QuACK's rms_final_reduce
    (scale 1/d); eps read at run time, another row stage, or a second per-row output keep
    the generic finaliser."""
    found = generate(residual_rmsnorm()).norm_stage
    assert found is not None
    sink, value, scale, eps = found
    assert value == "r" and scale == 1 / 4096 and eps == 1e-6 and sink.endswith("_ss")
    # eps as a run-time scalar: the kernel takes eps by value, so the generic stage stays
    assert generate(gemma_offset_scaled_residual()).norm_stage is None

    def sqrt_not_rsqrt(p, o):
        z = p.add(ACC, o["residual"], name="z")
        r = p.emit("sqrt", p.add(p.div(p.row_sum(p.square(z), name="ss"), 64.0), 1e-6),
                   name="r")
        return [(z, Kind.TILE, "bfloat16"), (r, Kind.PER_ROW, "float32")]

    def ss_returned_too(p, o):
        z = p.add(ACC, o["residual"], name="z")
        ss = p.row_sum(p.square(z), name="ss")
        r = p.rsqrt(p.add(p.div(ss, 64.0), 1e-6), name="r")
        return [(z, Kind.TILE, "bfloat16"), (r, Kind.PER_ROW, "float32"),
                (ss, Kind.PER_ROW, "float32")]

    for body in (sqrt_not_rsqrt, ss_returned_too):
        prog = program_of("residual_rmsnorm", body, [("residual", Kind.TILE)])
        assert generate(prog).norm_stage is None, body.__name__
    assert generate(rowscale_bias()).norm_stage is None


@pytest.mark.skipif(importlib.util.find_spec("quack") is None,
                    reason="needs the gpu extra (quack-kernels, nvidia-cutlass-dsl)")
def test_tile_config_by_row_class():
    """The size policy's configs: 64-row tiles at decode sizes (64 x 256 for wide outputs
    up to 16 rows), 128 x 64 for narrow outputs up to 256 rows, 128 x 128 below 4096 rows
    except vocabulary-wide outputs, QuACK's default above; a cos/sin table keeps a tile
    width of at most 128 (its heads must tile it)."""
    from coda_rewrite.kernels.quack_path import config_for, configs_of, row_class_lines
    from coda_rewrite.patterns.rope import rope_table_program
    plain, table = rowscale_bias(), rope_table_program(True, False, torch.bfloat16)

    def tile(prog, m, n):
        c = config_for(prog, m, n)
        return None if c is None else (c.tile_m, c.tile_n, c.cluster_m)
    assert tile(plain, 1, 4096) == (64, 128, 1)
    assert tile(plain, 8, 28672) == (64, 256, 1)
    assert tile(table, 8, 28672) == (64, 128, 1)
    assert tile(plain, 64, 128256) == (64, 128, 1)
    assert tile(plain, 200, 4096) == (128, 64, 1)
    assert tile(plain, 200, 16384) == (128, 128, 2)
    assert tile(plain, 2048, 16384) == (128, 128, 2)
    assert tile(plain, 2048, 128256) is None
    assert tile(plain, 8192, 4096) is None
    assert tile(table, 8192, 6144) == (128, 128, 2)
    # past the row classes a table of 64-wide heads takes three heads a tile; heads of
    # 128 or 256 (and an unknown head: AOT's) keep 128; the row classes are unchanged
    def table_tile(m, n, head_dim):
        c = config_for(table, m, n, head_dim)
        return c.tile_m, c.tile_n, c.cluster_m
    assert table_tile(4096, 3072, 64) == (128, 192, 2)
    assert table_tile(8192, 6144, 128) == table_tile(8192, 6144, 256) == (128, 128, 2)
    assert table_tile(8192, 6144, None) == (128, 128, 2)
    assert table_tile(2048, 3072, 64) == (128, 128, 2) and table_tile(8, 3072, 64)[1] == 128
    normed = rope_table_program(True, False, torch.bfloat16, passthrough=True,
                                norm=(64, 1e-6, True, False))
    assert config_for(normed, 8192, 3072, 64).tile_n == 192  # whole 64-wide groups too
    # a launch reads the head from its table's width; a program writing row partials
    # keeps the width a traced graph computes without it (partial_columns)
    from coda_rewrite.kernels.quack_path import _table_head_dim
    operands = [torch.ones(1) if o.kind != Kind.COS_SIN else torch.ones(8, 64)
                for o in table.operands]
    assert _table_head_dim(table, operands) == 64
    assert _table_head_dim(plain, [torch.ones(1)] * len(plain.operands)) is None
    b = ProgramBuilder("table_partials", gemm=True, family="rope")
    rot = b.rope_table(ACC, b.operand("cs", Kind.COS_SIN), name="rot")
    b.output(rot, Kind.TILE, "bfloat16")
    b.output(b.row_sum(b.square(rot), name="ss"), Kind.ROW_PARTIALS, "float32")
    assert _table_head_dim(b.build(), [torch.ones(8, 64)]) is None
    # past the row classes a norm producer up to N = 4096 takes 128 x 256 cooperative
    # tiles (cluster 2); wider producers, and other programs, QuACK's default
    producer = dataclasses.replace(residual_rmsnorm(), family="residual_rmsnorm")
    wide = config_for(producer, 8192, 4096)
    assert (wide.tile_m, wide.tile_n, wide.cluster_m, wide.pingpong) == (128, 256, 2, False)
    assert config_for(producer, 4096, 2048) == wide
    assert config_for(producer, 8192, 8192) is None and tile(plain, 8192, 2048) is None
    assert tile(producer, 4095, 2048) == (128, 128, 2)  # the row classes come first
    assert len(row_class_lines()) == 7 and "default" in row_class_lines()[-1]
    assert "cooperative" in row_class_lines()[-2]
    every = configs_of(producer)
    assert wide in every and all(config_for(producer, m, n) in every
                                 for m in (1, 64, 4095, 4096, 8192) for n in (512, 4096, 8192))
    # what AOT compiles: every config either program can get, each once
    assert [None if c is None else (c.tile_m, c.tile_n, c.cluster_m)
            for c in configs_of(plain)] == [(64, 128, 1), (64, 256, 1), (128, 64, 1),
                                             (128, 128, 2), None]
    assert [(c.tile_m, c.tile_n, c.cluster_m) for c in configs_of(table)] == [
        (64, 128, 1), (128, 64, 1), (128, 128, 2)]


def test_fp8_programs_take_their_own_tile_configs():
    """e4m3 GEMMs accumulate fast (torchao's inference recipe; QuACK's second float32
    accumulator would double the registers) on ping-pong tiles: 64 x 128 up to 64 rows,
    128 x 128 (cluster 2) below 4096 rows and above it up to N = 2048 (the training
    step's narrow GEMMs), 128 x 192 above it for wider outputs."""
    from coda_rewrite.codegen import fp8
    from coda_rewrite.kernels.quack_path import config_for, configs_of, fast_accum
    down, gate_up = fp8.down_program(torch.bfloat16), fp8.gate_up_program("swiglu")

    def tile(prog, m, n):
        c = config_for(prog, m, n)
        return (c.tile_m, c.tile_n, c.cluster_m, c.pingpong, fast_accum(c))
    assert tile(down, 1, 4096) == (64, 128, 1, True, True)
    assert tile(gate_up, 64, 28672) == (64, 128, 1, True, True)
    assert tile(down, 256, 4096) == (128, 128, 2, True, True)
    assert tile(gate_up, 4095, 28672) == (128, 128, 2, True, True)
    assert tile(gate_up, 8192, 28672) == (128, 192, 2, True, True)
    assert tile(down, 8192, 4096) == (128, 192, 2, True, True)
    assert tile(down, 8192, 2048) == (128, 128, 2, True, True)
    rowwise = fp8.rowwise_program(torch.bfloat16)
    assert tile(rowwise, 8192, 512) == (128, 128, 2, True, True)
    assert tile(rowwise, 8192, 8192) == (128, 192, 2, True, True)
    every = configs_of(down)
    assert [(c.tile_m, c.tile_n) for c in every] == [(64, 128), (128, 128), (128, 192)]
    # what AOT compiles covers every size's pick (a class's bound on either side)
    assert all(config_for(down, m, n) in every for m in (1, 64, 65, 4095, 4096, 8192)
               for n in (512, 2048, 2049, 8192))
    assert all(fast_accum(c) for c in every)
    for c in every:  # the accumulator's registers per thread (a warp group per tile)
        assert c.tile_m * c.tile_n // 128 <= 192


def test_runtime_summary_names_each_kernels_config_and_sizes(monkeypatch):
    """The report's runtime lines say which tile config each kernel launched with, at
    which problem sizes (a launch is a GPU object: built here without a plan)."""
    from coda_rewrite.kernels import ops, quack_path
    launch = object.__new__(quack_path.Launch)
    launch.ks, launch.m, launch.n, launch.config = generate(rowscale_bias()), 64, 4096, None
    other = object.__new__(quack_path.Launch)
    other.ks, other.m, other.n, other.config = launch.ks, 8192, 4096, None
    launch.calls, other.calls = 3, 2
    monkeypatch.setattr(ops, "_routes", {("p", 1): launch, ("p", 2): other,
                                         ("q", 3): "device cpu"})
    monkeypatch.setattr(ops, "RUNTIME", collections.Counter())
    lines = ops.launch_configs()
    assert lines == [f"kernel {launch.ks.program.key}: QuACK's default config (128 x 192 "
                     "tiles, cluster 2) for M x N in 64 x 4096, 8192 x 4096"], lines
    ran = f"{launch.ks.program.key}: kernel (generated QuACK epilogue) x5"
    assert lines[0] in ops.runtime_summary() and ran in ops.runtime_summary()


def test_each_launch_counts_its_calls_and_the_counts_outlive_the_route_table(monkeypatch):
    """A kernel's calls are counted by its Launch (no shared counter on the host path):
    every route to it (the op, the 2-D fast path, the model-shaped one) counts once per
    call; dropping the route table keeps the counts; reset_runtime forgets them."""
    from coda_rewrite.kernels import ops
    _stub_launches(monkeypatch)
    monkeypatch.setattr(ops, "RUNTIME", collections.Counter())
    prog = rowscale_bias()
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    r, bias = torch.randn(4), torch.randn(6, dtype=torch.bfloat16)
    kernel = (prog.key, "kernel", "generated QuACK epilogue")
    with torch.no_grad():
        ops.execute(prog.to_text(), a, b, [r, bias])                     # decided
        ops.execute(prog.to_text(), a, b, [r, bias])                     # _run_known
        ops.fused_linear(prog.to_text(), a, b, r, bias)                  # 2-D fast path
        ops.fused_linear(prog.to_text(), a.view(2, 2, 8), b, r.view(2, 2, 1), bias)
        ops.fused_linear(prog.to_text(), a.view(2, 2, 8), b, r.view(2, 2, 1), bias)
    assert ops.runtime_counts()[kernel] == 5
    ops.forget_routes()
    assert ops.runtime_counts()[kernel] == 5 and ops.RUNTIME[kernel] == 5
    with torch.no_grad():
        ops.execute(prog.to_text(), a, b, [r, bias])
    assert ops.runtime_counts()[kernel] == 6
    ops.reset_runtime()
    assert ops.runtime_counts()[kernel] == 0


_SPLIT_K_PLAN = """
import torch
from coda_rewrite.kernels import aot
aot._prepare_env(None)
aot._install_driver_stand_in()
from coda_rewrite.kernels.quack_path import Planned, load, tile_config
ks, module = load({program!r})
m = n = k = 256
a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
out = {{name: torch.empty(m, n, dtype=torch.bfloat16) for _, name in ks.contract.tile_outputs}}
c = torch.randn(m, n, dtype=torch.bfloat16)
gamma = {{b.param: torch.randn(n, dtype=torch.bfloat16) for b in ks.contract.operands
         if b.param != "c"}}
p = Planned(module.epilogue, a, b.t(), c, out, gamma, tile_config(128, 64, 1, 2))
sem, ws = p.split_buffers
print(p.gemm.split_k, tuple(sem), tuple(ws), sorted(p.scratch))
"""


@pytest.mark.skipif(importlib.util.find_spec("quack") is None,
                    reason="needs the gpu extra (quack-kernels, nvidia-cutlass-dsl)")
def test_a_split_k_config_compiles_and_plans_its_buffers(tmp_path):
    """A split-K config is planned through mod.gemm (EpiMod.plan drops split_k) and compiles
    for sm_90a: the norm producer at 256 × 256 on 128 × 64 tiles, split 2 — one semaphore
    per tile (2 × 4) and a float32 workspace of one tile each; the norm's partials are
    still the plan's scratch."""
    env = {**os.environ, "QUACK_CACHE_DIR": str(tmp_path / "cache"),
           "CODA_KERNEL_DIR": str(tmp_path / "kernels"), "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", _SPLIT_K_PLAN.format(
        program=residual_rmsnorm().to_text())], capture_output=True, text=True, env=env,
        timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "2 (1, 2, 4) (1, 2, 4, 8192) ['red0_ss']", out.stdout


def test_a_split_k_launch_gets_fresh_buffers_each_call(monkeypatch):
    """Each launch of a split plan hands QuACK a zeroed semaphore and a workspace of the
    planned shapes, made for that call (a buffer kept by the plan would be shared by calls
    on different streams); an unsplit plan passes none."""
    from coda_rewrite.kernels import quack_path
    seen = []
    monkeypatch.setattr(quack_path, "run_gemm_epi_plan",
                        lambda *a, **kw: seen.append(kw.get("split_k_buffers")))
    planned = object.__new__(quack_path.Planned)
    planned.gemm, planned.epi_plan, planned.scratch = object(), None, {}
    planned.device, planned.split_buffers = torch.device("cpu"), ((1, 2, 4), (1, 2, 4, 64))
    for _ in range(2):
        planned.launch(None, None, None, None, {})
    (sem1, ws1), (sem2, ws2) = seen
    assert sem1.dtype == torch.int32 and sem1.shape == (1, 2, 4) and not sem1.any()
    assert ws1.dtype == torch.float32 and ws1.shape == (1, 2, 4, 64)
    assert sem1 is not sem2 and ws1 is not ws2
    planned.split_buffers = None
    planned.launch(None, None, None, None, {})
    assert seen[-1] is None


def test_a_norm_producers_launch_returns_its_outputs_in_program_order(monkeypatch):
    """A launch's host side without a GPU (the plan and both kernels stubbed): the norm
    producer's outputs come back in the program's order, none of them a view (an op's
    output that is a view cannot be updated in place: kernels/ops._fresh), the rstd as
    the finaliser computes it from the GEMM's partials; QuACK gets the outputs and the
    partials, nothing else; a rowscale launch returns its one tile output."""
    from coda_rewrite.kernels import quack_path
    calls, cs = [], []

    def fake_gemm(plan, a, b, d, c, values):  # writes z and h2, and the partials
        calls.append(sorted(values))
        cs.append(c)
        d.fill_(1.0)
        for name, fill in (("out1_h2", 2.0), ("red0_ss", 3.0)):
            if name in values:
                values[name].fill_(fill)

    def fake_rstd(partials, rstd, scale, eps):
        rstd.copy_(partials.sum(-1) * scale + eps)

    monkeypatch.setattr(quack_path, "run_gemm_epi_plan", fake_gemm)

    def launch_of(program, m, n, scratch, norm):
        launch = object.__new__(quack_path.Launch)
        launch.ks = generate(program)
        launch.m, launch.n, launch.device, launch.calls = m, n, torch.device("cpu"), 0
        launch.out_dtypes = {o.value: torch.float32 if o.dtype == "float32"
                             else torch.bfloat16 for o in program.outputs}
        launch.outs = [(name, (m, n), launch.out_dtypes[value])
                       for value, name in launch.ks.contract.tile_outputs]
        planned = object.__new__(quack_path.Planned)
        planned.gemm, planned.epi_plan, planned.split_buffers = object(), None, None
        planned.scratch, planned.device = scratch, torch.device("cpu")
        launch.planned, launch.norm, launch.row_rstd = planned, norm, fake_rstd
        launch.tensor_params, launch.scalar_params = (), ()
        launch.c_index, launch.sinks = None, []
        launch.results = launch._result_sources()
        launch._bind()
        return launch

    m, n, tiles = 5, 48, 3
    a, b = torch.zeros(m, 8), torch.zeros(n, 8)
    # QuACK's partials for a 2-D problem are [M, T] already (no view); a batched
    # problem's [1, M, T] are viewed as [M, T]
    for scratch_shape, rows in (((m, tiles), None), ((1, m, tiles), (m, tiles))):
        norm = launch_of(residual_rmsnorm(), m, n, {"red0_ss": (torch.Size(scratch_shape),
                                                                torch.float32)},
                         ("red0_ss", rows, 0.5, 0.25))
        z, h2, r = norm(a, b, [])
        assert calls[-1] == ["D", "out1_h2", "red0_ss"]
        assert z.shape == h2.shape == (m, n) and (z == 1).all() and (h2 == 2).all()
        assert r.shape == (m,) and r.dtype == torch.float32
        assert torch.equal(r, torch.full((m,), 3.0 * tiles * 0.5 + 0.25))
        assert all(t._base is None for t in (z, h2, r))
    assert norm.calls == 1  # each call counts itself (ops.runtime_counts)
    plain = launch_of(rowscale_bias(), m, n, {}, None)
    (y,) = plain(a, b, [torch.ones(m), torch.ones(n)])
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and (y == 1).all()
    assert calls[-1] == ["D"]
    plain(a, b, [torch.ones(m), torch.ones(n)])
    assert plain.calls == 2
    # a producer handing on its norm's partials (deferred_rstd.py) returns its buffers as
    # the kernel left them, laid out once (Launch._bind: ``returned``), where they are
    # [M, T] with T within the readers' fold limit; a batched [1, M, T] buffer is viewed
    # and past the limit the partials are summed per call: the general path, same values
    from coda_rewrite import deferred_rstd
    producer, *_ = deferred_rstd._row_scale(residual_rmsnorm())
    limit = quack_path.READER_FOLDS_PARTIALS
    for shape, bound in (((m, tiles), True), ((1, m, tiles), False), ((m, limit + 8), False)):
        launch = launch_of(producer, m, n, {"red0_ss": (torch.Size(shape), torch.float32)},
                           None)
        names = [o.name for o in producer.operands]  # as Launch.__init__ binds them
        for bnd in launch.ks.contract.operands:  # the residual is QuACK's C
            if bnd.param == "c":
                launch.c_index = names.index(bnd.name)
            else:
                launch.tensor_params += ((bnd.param, names.index(bnd.name)),)
        launch._bind()
        assert (launch.returned is not None) == bound, shape
        z, h2, ss = launch(a, b, [torch.zeros(m, n), torch.ones(n)])
        assert calls[-1] == ["D", "o_gamma", "out1_h2", "red0_ss"] and cs[-1] is not None
        assert (z == 1).all() and (h2 == 2).all() and z.shape == h2.shape == (m, n)
        width = shape[-1] if shape[-1] <= limit else 1
        assert torch.equal(ss, torch.full((m, width), 3.0 * shape[-1] / width)), shape
        assert z._base is None and h2._base is None


def test_a_reference_run_on_a_cuda_device_warns():
    """A fused op that falls back to its reference on a CUDA device (a rewrite slower than
    the graph it replaced) warns, once per kernel and reason; off CUDA it is only counted."""
    import warnings as w
    from coda_rewrite.kernels import ops
    before = dict(ops.runtime_counts())
    with w.catch_warnings(record=True) as seen:
        w.simplefilter("default")
        ops.count_reference("probe_kernel", "a reason", torch.device("cpu"))
        assert not seen
        for _ in range(3):
            ops.count_reference("probe_kernel", "a reason", torch.device("cuda", 0))
    assert len(seen) == 1 and issubclass(seen[0].category, RuntimeWarning)
    assert "probe_kernel" in str(seen[0].message) and "a reason" in str(seen[0].message)
    assert ops.runtime_counts()[("probe_kernel", "reference", "a reason")] - \
        before.get(("probe_kernel", "reference", "a reason"), 0) == 4


_FAST_ACCUM_PLAN = """
import torch
from coda_rewrite.kernels import aot
aot._prepare_env(None)
aot._install_driver_stand_in()
import quack.gemm_runtime.host as host
from coda_rewrite.codegen import fp8
from coda_rewrite.kernels.quack_path import Planned, config_name, load, tile_config
traced = []  # fp8_slow_accum of each GEMM object as it is traced
compile_gemm_kernel = host.compile_gemm_kernel
def spy(*args, post_init=None, **kwargs):
    def record(gemm):
        if post_init is not None:
            post_init(gemm)
        traced.append(gemm.fp8_slow_accum)
    return compile_gemm_kernel(*args, post_init=record, **kwargs)
host.compile_gemm_kernel = spy
ks, module = load(fp8.down_program(torch.bfloat16).to_text())
m, n, k = 256, 256, 512
e4 = torch.float8_e4m3fn
a, b = torch.randn(m, k).to(e4), torch.randn(n, k).to(e4)
out = {{name: torch.empty(m, n, dtype=torch.bfloat16) for _, name in ks.contract.tile_outputs}}
ws = {{b.param: torch.rand(n) for b in ks.contract.operands}}
cfg = tile_config(128, 128, 1, pingpong=False, fp8_fast_accum={fast})
p = Planned(module.epilogue, a, b.t(), None, out, ws, cfg)
print(config_name(cfg), p.epi_plan is None, traced)
"""


@pytest.mark.skipif(importlib.util.find_spec("quack") is None,
                    reason="needs the gpu extra (quack-kernels, nvidia-cutlass-dsl)")
@pytest.mark.parametrize("fast", [True, False])
def test_an_fp8_fast_accumulation_config_reaches_the_compiled_gemm(tmp_path, fast):
    """A config with fast FP8 accumulation is planned through mod.gemm with QuACK's
    fp8_slow_accum switched off before the trace (EpiMod.plan takes no post-init
    attribute) and compiles for sm_90a; the plain config keeps the second accumulator."""
    env = {**os.environ, "QUACK_CACHE_DIR": str(tmp_path / "cache"),
           "CODA_KERNEL_DIR": str(tmp_path / "kernels"), "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", _FAST_ACCUM_PLAN.format(fast=fast)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    name = "128 x 128 tiles, cluster 1, cooperative" + (", fast FP8 accumulation" * fast)
    assert out.stdout.split("\n")[-2] == f"{name} {fast} [{not fast}]", out.stdout


def _stub_launches(monkeypatch) -> list:
    """Kernel routes without a GPU: every program selects its generated kernel, whose
    "launch" runs the reference; empty route tables. Returns the list each decision
    appends its metadata key to."""
    from coda_rewrite.kernels import ops, quack_path

    class Stub(quack_path.Launch):
        def __init__(self, ks):
            self.ks, self.calls = ks, 0

        def __call__(self, a, b, operands):
            self.calls += 1
            return ops._run_reference(self.ks.program, a, b, list(operands))

    decided = []

    def select(prog, program, a, b, operands):
        decided.append(quack_path.metadata_key(a, b, operands))
        return (generate(prog), None), None
    monkeypatch.setattr(ops, "_routes", {})
    monkeypatch.setattr(ops, "_last", {})
    monkeypatch.setattr(quack_path, "select", select)
    monkeypatch.setattr(quack_path, "prepare", lambda ks, module, a, b, operands: Stub(ks))
    return decided


def test_a_programs_last_metadata_classes_are_found_by_one_check(monkeypatch):
    """execute's fast path (ops._last_route): a call in a class the program launched in
    recently skips the key; another shape, stride, dtype, a gradient, or a pointer off
    16 bytes goes the full way (a new class, decided again); a replaced route table is
    never bypassed."""
    import torch
    from coda_rewrite.kernels import ops

    decided = _stub_launches(monkeypatch)
    monkeypatch.setattr(ops, "_LAST_CLASSES", 4)
    prog = rowscale_bias().to_text()
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    r, bias = torch.randn(4), torch.randn(6, dtype=torch.bfloat16)
    want = ops.execute(prog, a, b, [r, bias])
    assert len(decided) == 1 and len(ops._last[prog]) == 1
    key_built = []
    real_route_of = ops.route_of
    monkeypatch.setattr(ops, "route_of",
                        lambda key, decide: key_built.append(key) or real_route_of(key, decide))
    again = ops.execute(prog, a.clone(), b, [r, bias])       # same class: no key built
    assert not key_built and len(decided) == 1 and torch.equal(again[0], want[0])
    big = torch.randn(64, 8, dtype=torch.bfloat16)
    offset = big[8:12]                                       # another offset, 16-byte aligned
    assert offset.data_ptr() % 16 == 0
    ops.execute(prog, offset, b, [r, bias])
    assert not key_built
    others = [(a.t().contiguous().t(), b, r, bias),          # strides
              (a.float(), b.float(), r, bias.float()),        # dtypes
              (big.view(-1)[1:33].view(4, 8), b, r, bias)]    # a pointer 2 bytes off
    for x, w, rr, bb in others:
        ops.execute(prog, x, w, [rr, bb])
    assert len(key_built) == 3 and len(decided) == 4
    with torch.enable_grad():                                 # requires_grad: a miss (the
        ops.execute(prog, a.requires_grad_(), b, [r, bias])  # key's class, routed as is)
    a.requires_grad_(False)
    assert len(key_built) == 4 and len(decided) == 4
    ops.execute(prog, torch.randn(5, 8, dtype=torch.bfloat16), b, [torch.randn(5), bias])
    assert len(key_built) == 5 and len(decided) == 5
    assert len(ops._last[prog]) == ops._LAST_CLASSES         # the oldest class dropped
    monkeypatch.setattr(ops, "_routes", {})                  # a new table: decided again
    ops.execute(prog, a, b, [r, bias])
    assert len(decided) == 6 and len(ops._last[prog]) == 1


def test_the_formula_less_op_refuses_a_call_autograd_could_record(monkeypatch):
    """coda::gemm_epilogue_nograd (what Inductor's graphs call) goes straight to a known
    launch, but first refuses a call in grad mode with a tensor that requires grad
    (PyTorch's fallback would only warn, and the gradient would be missing), also in a
    metadata class it has launched in; under no_grad the same tensors run."""
    from coda_rewrite.kernels import ops
    _stub_launches(monkeypatch)
    prog = rowscale_bias().to_text()
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    r, bias = torch.randn(4), torch.randn(6, dtype=torch.bfloat16)
    w = b.clone().requires_grad_()
    with torch.no_grad():
        want = ops.gemm_epilogue_nograd(prog, a, w, [r, bias])
        again = ops.gemm_epilogue_nograd(prog, a, w, [r, bias])  # the known route
    assert torch.equal(want[0], again[0]) and ops._last_route(prog, a, w, [r, bias])
    with torch.enable_grad(), pytest.raises(RuntimeError, match="no autograd formula"):
        ops.gemm_epilogue_nograd(prog, a, w, [r, bias])
    with torch.enable_grad():  # nothing requires grad: nothing to record
        assert torch.equal(ops.gemm_epilogue_nograd(prog, a, b, [r, bias])[0], want[0])


def test_fused_linear_goes_straight_to_the_launch_only_where_autograd_has_nothing(monkeypatch):
    """fused_linear's fast path: a 2-D call in a remembered class skips _linear where
    autograd has nothing to record (grad mode off, or no tensor requires grad); a class
    remembered from tensors that require grad (the op's call inside its
    autograd.Function) never serves fused_linear in grad mode, whose autograd must
    record the call; a 3-D input is not the remembered (flattened) class."""
    import torch
    from coda_rewrite.kernels import ops

    _stub_launches(monkeypatch)
    slow = []
    real_linear = ops._linear
    monkeypatch.setattr(ops, "_linear", lambda *args: slow.append(1) or real_linear(*args))
    prog = rowscale_bias().to_text()
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    r, bias = torch.randn(4), torch.randn(6, dtype=torch.bfloat16)
    with torch.no_grad():
        want = ops.fused_linear(prog, a, b, r, bias)
        assert len(slow) == 1
        got = ops.fused_linear(prog, a.clone(), b, r, bias)
        assert len(slow) == 1 and isinstance(got, tuple) and torch.equal(got[0], want[0])
        ops.fused_linear(prog, a.reshape(2, 2, 8), b, r.reshape(2, 2, 1), bias)
        assert len(slow) == 2
    w = b.clone().requires_grad_()
    with torch.no_grad():  # the class with a weight that requires grad, remembered by execute
        ops.execute(prog, a, w, [r, bias])
    assert any(not entry[3] for entry in ops._last[prog])
    out = ops.fused_linear(prog, a, w, r, bias)  # grad mode: autograd records the call
    assert len(slow) == 3 and out[0].grad_fn is not None
    ops.fused_linear(prog, a, b, r, bias)         # grad mode, nothing requires grad: fast
    assert len(slow) == 3
    with torch.no_grad():                         # no grad mode: the class with w serves
        ops.fused_linear(prog, a, w, r, bias)
    assert len(slow) == 3
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode, torch.no_grad():  # traced: the guard's dispatch keys
        fake = ops.fused_linear(prog, *(mode.from_tensor(t) for t in (a, b, r, bias)))
    assert len(slow) == 4 and fake[0].shape == want[0].shape


def test_a_call_in_the_models_shapes_finds_its_launch_through_one_check(monkeypatch):
    """fused_linear at a chain's edge ([*lead, K] in, tile outputs [*lead, N] and per-row
    ones [*lead, 1] out): a call in a class a flattened call launched in skips _linear and
    gives the reference's results in the model's shapes; another lead with the same rows,
    a layout the flattening copies, a pointer off 16 bytes and a weight that requires grad
    in grad mode are other classes (the full way: autograd records the last);
    forget_routes drops the classes."""
    import torch
    from coda_rewrite.codegen import layouts
    from coda_rewrite.kernels import ops

    _stub_launches(monkeypatch)
    slow = []
    real_linear = ops._linear
    monkeypatch.setattr(ops, "_linear", lambda *args: slow.append(1) or real_linear(*args))
    prog = activations_and_two_tiles().to_text()
    bf = torch.bfloat16
    x, w = torch.randn(2, 4, 16, dtype=bf), torch.randn(12, 16, dtype=bf)
    rest = [torch.randn(2, 4, 1), torch.randn(2, 4, 12, dtype=bf),
            torch.randn(2, 4, 12, dtype=bf)]                  # r, res, gate

    def check(x, w, rest, calls):
        with torch.no_grad():
            want = layouts.fused_linear_reference(prog, x, w, *rest)
            for _ in range(2):
                got = ops.fused_linear(prog, x, w, *rest)
                assert isinstance(got, tuple) and len(got) == len(want)
                for g, e in zip(got, want):  # NaN where the reference's sqrt has one
                    assert g.shape == e.shape
                    torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
        assert len(slow) == calls, (len(slow), calls)

    check(x, w, rest, 1)                                       # the second call: fast
    check(x.clone(), w, [t.clone() for t in rest], 1)          # same class, new tensors
    check(x.reshape(1, 8, 16), w, [t.reshape(1, 8, -1) for t in rest], 2)  # another lead
    x_t = torch.randn(16, 2, 4, dtype=bf).permute(1, 2, 0)     # flattening copies it
    check(x_t, w, rest, 3)
    big = torch.randn(2 * 4 * 16 + 1, dtype=bf)
    off = big[1:].view(2, 4, 16)                               # a pointer 2 bytes off
    check(off, w, rest, 5)                                     # slow both times
    w_g = w.clone().requires_grad_()
    check(x, w_g, rest, 6)                                     # remembered under no_grad
    out = ops.fused_linear(prog, x, w_g, *rest)                # grad mode: recorded
    assert len(slow) == 7 and out[0].grad_fn is not None
    ops.forget_routes()
    assert not ops._last
    check(x, w, rest, 8)


def test_a_recorded_call_in_a_class_seen_before_records_the_launch_itself(monkeypatch):
    """fused_linear where autograd records (grad mode, a tensor that requires grad): the
    first call of a class goes the full way (_linear, FusedGemm); the next ones in that
    class record ops.KnownGemm around the launch it ran, in the op's 2-D form and in the
    model's shapes, with the same outputs and gradients, the weight's asked for exactly
    when it requires grad. Which tensors require grad is part of the class; a pointer off
    16 bytes and no_grad take the other paths; forget_routes drops the classes."""
    import torch
    from coda_rewrite.kernels import ops

    _stub_launches(monkeypatch)
    slow = []
    real_linear = ops._linear
    monkeypatch.setattr(ops, "_linear", lambda *args: slow.append(1) or real_linear(*args))
    prog = rowscale_bias().to_text()
    g = torch.Generator().manual_seed(0)
    x2, w = torch.randn(6, 8, generator=g), torch.randn(4, 8, generator=g)
    r2, bias = torch.randn(6, generator=g), torch.randn(4, generator=g)
    seed = torch.randn(6, 4, generator=g)

    def grads(x, w, r, bias, wants):
        leaves = [t.detach().clone().requires_grad_(want)
                  for t, want in zip((x, w, r, bias), wants)]
        (out,) = ops.fused_linear(prog, *leaves)
        (out * seed.reshape(out.shape)).sum().backward()
        node = out.grad_fn  # the fused node, under the model shapes' view
        while type(node).__name__ in ("ViewBackward0", "UnsafeViewBackward0"):
            node = node.next_functions[0][0]
        return out, [t.grad for t in leaves], type(node).__name__

    known, edge = "KnownGemmBackward", "KnownEdgeGemmBackward"
    cases = [((x2, w, r2, bias), (True, True, False, False), known),    # 2-D: in a chain
             ((x2, w, r2, bias), (False, True, False, True), known),    # another class
             ((x2, w, r2, bias), (True, False, True, False), known),    # no weight grad
             ((x2.reshape(2, 3, 8), w, r2.reshape(2, 3, 1), bias),      # a chain's edge
              (True, True, True, False), edge),
             ((x2, w, r2.reshape(6, 1), bias),                          # 2-D x, r [M, 1]:
              (True, True, True, False), edge)]                         # r alone reshaped
    for args, wants, want_node in cases:
        before = len(slow)
        want_out, want_grads, _ = grads(*args, wants)                   # the full way
        got_out, got_grads, node = grads(*args, wants)                  # the launch's
        assert len(slow) == before + 1, (wants, len(slow) - before)
        assert node == want_node and got_out.shape == want_out.shape
        assert torch.equal(got_out, want_out)
        for want_g, got_g, wanted in zip(want_grads, got_grads, wants):
            assert (got_g is None) == (not wanted)
            assert got_g is None or torch.equal(got_g, want_g)
    big = torch.randn(6 * 8 + 1, requires_grad=True)
    off = big[1:].view(6, 8)                                            # 4 bytes off
    before = len(slow)
    for _ in range(2):
        (out,) = ops.fused_linear(prog, off, w.requires_grad_(), r2, bias)
        assert out.grad_fn is not None
    assert len(slow) == before + 2
    with torch.no_grad():                                               # nothing recorded
        (out,) = ops.fused_linear(prog, x2, w.requires_grad_(), r2, bias)
    assert out.grad_fn is None
    ops.forget_routes()
    before = len(slow)
    grads(x2, w, r2, bias, (True, True, False, False))
    assert len(slow) == before + 1


def test_a_recorded_call_in_the_models_shapes_flattens_inside_its_node(monkeypatch):
    """A recorded call at a chain's edge in a class seen before (ops.KnownEdgeGemm): the
    flattening into the op's 2-D form and back happens inside the one node, so every
    output's grad_fn is that node (no view nodes around it) and no output is a view;
    outputs and gradients equal the full way's for a norm producer (two tile outputs, a
    per-row one, a residual saved for its dtype alone), also with outputs that get no
    gradient and after the model's code updates an output in place."""
    import torch
    from coda_rewrite.kernels import ops

    _stub_launches(monkeypatch)
    prog = residual_rmsnorm().to_text()
    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    x, w = torch.randn(2, 3, 16, generator=g).to(bf), torch.randn(8, 16, generator=g).to(bf)
    res, gamma = torch.randn(2, 3, 8, generator=g).to(bf), torch.randn(8, generator=g).to(bf)
    seeds = [torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g),
             torch.randn(2, 3, 1, generator=g)]

    def run(used, in_place):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, res, gamma)]
        outs = ops.fused_linear(prog, *leaves)
        nodes = {type(o.grad_fn).__name__ for o in outs}
        if in_place:
            outs[1].mul_(3)  # h2 updated in place by the model's code
        loss = sum((o.float() * s).sum() for i, (o, s) in enumerate(zip(outs, seeds))
                   if i in used)
        loss.backward()
        return outs, [t.grad for t in leaves], nodes

    for used, in_place in (((0, 1, 2), False), ((1,), False), ((0, 2), True),
                           ((1, 2), True)):
        ops.forget_routes()
        want_outs, want_grads, _ = run(used, in_place)                  # the full way
        got_outs, got_grads, nodes = run(used, in_place)                # the known launch
        assert nodes == {"KnownEdgeGemmBackward"}, nodes
        assert all(o._base is None for o in got_outs)
        for got, want in zip(got_outs, want_outs):
            assert got.shape == want.shape and torch.equal(got, want)
        for got, want in zip(got_grads, want_grads):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (got_grads[3] is None) == (1 not in used)  # γ reaches the loss through h2


def test_the_host_tables_per_program_rows_run_on_stub_launches(monkeypatch):
    """benchmarks/host_overhead.per_program (the GPU's host table) calls every column's
    variant, with and without gradients, on a small model's captured programs (the
    launches stubbed, the timing loop replaced by calling each variant twice): a table
    that fails after its first program costs a GPU call to find out."""
    import os
    import sys
    import torch
    from coda_rewrite.kernels import ops, quack_path
    from coda_rewrite.models import Llama, LlamaArgs

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "benchmarks"))
    import host_overhead

    class Stub(quack_path.Launch):
        def __init__(self, ks):
            self.ks, self.calls, self.norm = ks, 0, None

        def __call__(self, a, b, operands):
            self.calls += 1
            return ops._run_reference(self.ks.program, a, b, list(operands))

    monkeypatch.setattr(ops, "_routes", {})
    monkeypatch.setattr(ops, "_last", {})
    monkeypatch.setattr(quack_path, "select", lambda prog, program, a, b, operands:
                        ((generate(prog), None), None))
    monkeypatch.setattr(quack_path, "prepare", lambda ks, module, a, b, operands: Stub(ks))
    called = []

    def interleaved(fns, calls=None, rounds=None):
        for name, fn in fns.items():
            fn()
            fn()
            called.append(name)
        return {name: 1.0 for name in fns}
    monkeypatch.setattr(host_overhead, "interleaved", interleaved)
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            vocab_size=256, max_seq_len=64)).to(torch.bfloat16).eval()
    x = torch.randint(0, 256, (1, 16))
    calls = host_overhead.captured(coda_rewrite.optimize(model, min_fused_rows=0), x, ops,
                                   "execute")
    rows = host_overhead.per_program(calls)
    from coda_rewrite.codegen.program import parse
    gemms = sum(1 for program in calls if parse(program).gemm)
    assert gemms >= 3 and len(rows) >= 11 * gemms
    for column in ("graph", "chained", "kernel", "launch", "grad", "linear"):
        assert column in called, column
    assert all(us == 1.0 for _, _, us in rows if us == us)  # NaN: no backward


def test_a_training_step_records_the_launches_it_ran_before(monkeypatch):
    """optimize()'s training forward with every lowerable program on a (stub) kernel
    route: after the first call of each metadata class, fused calls are recorded around
    their launches (ops.KnownGemm: chains' 2-D calls and their edges), and both steps'
    losses and gradients are eager's."""
    import copy
    from coda_rewrite.kernels import ops, quack_path

    _stub_launches(monkeypatch)

    def select(prog, program, a, b, operands):
        try:
            return (generate(prog), None), None
        except Unlowerable as e:  # the reference route, as the real select says
            return None, str(e)
    monkeypatch.setattr(quack_path, "select", select)
    known, full = [], []
    real_apply, real_full = ops._apply_known, ops.gemm_with_grad
    monkeypatch.setattr(ops, "_apply_known", lambda *args: known.append(1) or
                        real_apply(*args))
    monkeypatch.setattr(ops, "gemm_with_grad", lambda *args: full.append(1) or
                        real_full(*args))
    model = hf_model("llama", layers=2).train()
    ref = copy.deepcopy(model)
    fast = coda_rewrite.optimize(model)
    ids = tokens()
    for step in range(2):
        known.clear()
        full.clear()
        loss, want = (m(ids, labels=ids).loss for m in (fast, ref))
        loss.backward()
        want.backward()
        assert rel_err(loss, want) <= 1e-5
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) <= 1e-4, (step, name)
            p.grad = q.grad = None
        # the first step's first call of each class goes the full way (a second layer's
        # call in that class is already known); the second step's every call is known
        assert known and bool(full) == (step == 0), (step, len(known), len(full))


def test_forgetting_routes_drops_the_fast_paths_classes_too(monkeypatch):
    """ops.forget_routes (and the table's bound): no call finds a dropped launch through
    the fast path afterwards."""
    import torch
    from coda_rewrite.kernels import ops

    decided = _stub_launches(monkeypatch)
    prog = rowscale_bias().to_text()
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    args = [torch.randn(4), torch.randn(6, dtype=torch.bfloat16)]
    ops.execute(prog, a, b, args)
    ops.execute(prog, a, b, args)
    assert len(decided) == 1
    ops.forget_routes()
    assert not ops._routes and not ops._last
    ops.execute(prog, a, b, args)
    assert len(decided) == 2


class _Product(torch.autograd.Function):
    """x·y with its backward, in the setup_context style of the project's Functions."""
    applied = 0

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, g * x


def test_record_is_function_apply_and_leaves_traced_calls_to_it(monkeypatch):
    """ops.record: the same outputs, graph and gradients as Function.apply on real
    tensors (through the Function's old-style twin, whose apply binds no arguments; its
    node keeps the Function's name); a call under a functorch transform, on fake tensors
    or under dynamo goes through Function.apply itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from coda_rewrite.kernels import ops

    real_apply = _Product.apply  # a classmethod through torch 2.13, autograd's C++ one after
    seen = []
    monkeypatch.setattr(_Product, "apply", staticmethod(
        lambda *args: seen.append(1) or real_apply(*args)))
    x, y = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    got = ops.record(_Product, x, y)
    assert not seen and type(got.grad_fn).__name__ == "_ProductBackward"
    got.sum().backward()
    assert torch.equal(x.grad, y.detach()) and torch.equal(y.grad, x.detach())
    assert torch.equal(ops.record(_Product, x, y.detach()), x * y) and not seen
    dx = torch.func.grad(lambda t: ops.record(_Product, t, y.detach()).sum())(x.detach())
    assert torch.equal(dx, y.detach()) and seen                    # the transform's path
    before = len(seen)
    with FakeTensorMode() as mode:
        ops.record(_Product, mode.from_tensor(x), mode.from_tensor(y))
    assert len(seen) == before + 1
    compiled = torch.compile(lambda a, b: ops.record(_Product, a, b), backend="eager",
                             fullgraph=True)
    assert torch.equal(compiled(x.detach(), y.detach()), x.detach() * y.detach())
    x.grad = y.grad = None
    compiled(x, y).sum().backward()                                # traced, with its backward
    assert torch.equal(x.grad, y.detach()) and torch.equal(y.grad, x.detach())
    assert ops._old_style(_Product) is ops._old_style(_Product)    # made once
