"""torch.compile(backend="coda"): the string path with and without the import, full
graphs, graph breaks, per-block compiles (TorchTitan style, with activation
checkpointing), and one Inductor end-to-end run per model family."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import coda_rewrite
from coda_rewrite.numerics import rel_err

from conftest import ROOT, hf_model, plain_llama, step_matches_eager, tokens

_SNIPPET = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import plain_llama, tokens
{imports}
model = plain_llama().eval()
ids = tokens()
with torch.no_grad():
    got = torch.compile(model, backend="coda", options={{"inductor": False}})(ids)
    want = model(ids)
assert ((got - want).norm() / want.norm()).item() <= 1e-5
import coda_rewrite
n = coda_rewrite.last_report().count()
assert n == 5, n
print("OK", n)
"""


@pytest.mark.parametrize("imports", ["", "import coda_rewrite"], ids=["entry_point", "import"])
def test_backend_by_name_in_a_fresh_process(imports):
    """Without the import, dynamo finds "coda" through the entry point; with it, the
    name must not be registered twice ("duplicate name")."""
    code = _SNIPPET.format(tests=os.path.join(ROOT, "tests"), imports=imports)
    env = {**os.environ, "PYTHONPATH": ""}  # the installed package, as TorchTitan sees it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd="/", timeout=600)
    assert out.returncode == 0 and "OK 5" in out.stdout, out.stderr[-3000:]


def test_fullgraph():
    model = hf_model("llama").eval()
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
    with torch.no_grad():
        got = torch.compile(model, backend=backend, fullgraph=True)(tokens()).logits
        want = model(tokens()).logits
    assert rel_err(got, want) <= 1e-5
    assert len(backend.report.graphs) == 1 and backend.report.count() == 5


class BrokenLlama(torch.nn.Module):
    """The plain Llama (three blocks) with a graph break after every block. Unrolled:
    a break inside a loop would make dynamo give up on the whole frame."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        m = self.inner
        h = m.tok_embeddings(ids)
        freqs = m.freqs[: ids.shape[1]]
        h = m.layers[0](h, freqs)
        torch._dynamo.graph_break()
        h = m.layers[1](h, freqs)
        torch._dynamo.graph_break()
        h = m.layers[2](h, freqs)
        torch._dynamo.graph_break()
        return m.output(m.norm(h))


def test_graph_breaks_rewrite_every_graph():
    model = BrokenLlama(plain_llama(layers=3)).eval()
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(tokens())
        want = model(tokens())
    assert rel_err(got, want) <= 1e-5
    report = backend.report
    assert len(report.graphs) == 4, str(report)
    # each block's graph starts at a graph input: both of its norms are rewritten, the
    # first without a producing GEMM; the last graph has the final norm
    per_graph = [sum(r.status == "rewritten" and r.pattern == "residual_rmsnorm_gemm"
                     for r in g.records) for g in report.graphs]
    assert per_graph == [2, 2, 2, 1]
    assert report.count() == 7


@pytest.mark.parametrize("checkpointed", [False, True])
def test_per_block_compile(checkpointed):
    """TorchTitan compiles each block on its own (optionally under activation
    checkpointing); a norm whose input is a graph input is handled like the first
    layer's."""
    model = plain_llama(layers=3).train()
    ref = copy.deepcopy(model)
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
    for i, block in enumerate(model.layers):
        compiled = torch.compile(block, backend=backend)
        if checkpointed:
            compiled = _Checkpointed(compiled)
        model.layers[i] = compiled
    ids = tokens()
    loss = model(ids).float().pow(2).mean()
    want = ref(ids).float().pow(2).mean()
    assert abs(loss.item() - want.item()) <= 1e-5 * want.item()
    loss.backward()
    want.backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        name = name.replace("._orig_mod", "").replace(".block", "")
        assert rel_err(p.grad, grads[name].grad) <= 1e-4, name
    # the three blocks share one code object: dynamo may reuse one graph for all
    assert backend.report.count() == 2 * len(backend.report.graphs) >= 2
    kinds = {r.programs[0].name for r in backend.report.records if r.programs}
    assert kinds == {"rmsnorm_rowscale", "residual_rmsnorm", "rowscale_swiglu",
                     "rowscale_rope_table"}
    # a block's down projection feeds no norm in its graph: it takes the fused backward,
    # decided (a float64 gradient replay) inside the checkpointed forward where dynamo
    # compiles it (algebra/isolated.py)
    downs = [d for r in backend.report.records if r.pattern == "gated_mlp" for _, d in r.notes]
    assert downs and all(d.accepted for d in downs), str(backend.report)


class _Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, freqs):
        return checkpoint(self.block, x, freqs, use_reentrant=False)


@pytest.mark.inductor
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "plain"])
def test_inductor_end_to_end(family):
    model = (plain_llama() if family == "plain" else hf_model(family)).train()
    ref = copy.deepcopy(model)
    ids = tokens()
    compiled = torch.compile(model, backend="coda")
    out = compiled(ids) if family == "plain" else compiled(ids, labels=ids)
    want = ref(ids) if family == "plain" else ref(ids, labels=ids)
    if family == "plain":
        loss, ref_loss = out.float().pow(2).mean(), want.float().pow(2).mean()
        assert rel_err(out, want) <= 1e-5
    else:
        loss, ref_loss = out.loss, want.loss
        assert rel_err(out.logits, want.logits) <= 1e-5
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name
    assert "residual_rmsnorm_gemm 5/5 rewritten" in coda_rewrite.last_report().graphs[-1].summary()


def test_explain_dump_and_env(tmp_path, monkeypatch):
    model = plain_llama().eval()
    report = coda_rewrite.explain(model, tokens(), dump_dir=str(tmp_path / "a"))
    text = str(report)
    for needle in ("layers.1.ffn_norm", "PROVED", "witness", "rewritten graph",
                   "P['rowscale#", "program residual_rmsnorm#", "layout contract of"):
        assert needle in text, needle
    files = sorted(p.name for p in (tmp_path / "a" / "graph_000").iterdir())
    assert files == ["canonical.txt", "kernels.txt", "programs.txt", "report.txt",
                     "rewritten.py"]
    kernels = (tmp_path / "a" / "graph_000" / "kernels.txt").read_text()
    assert "@gemm_epilogue(" in kernels and "layout contract of residual_rmsnorm#" in kernels
    assert "no kernel (no GEMM" in kernels  # the first norm's row-wise program
    assert "rms_norm(" in (tmp_path / "a" / "graph_000" / "canonical.txt").read_text()
    monkeypatch.setenv("CODA_DUMP_DIR", str(tmp_path / "b"))
    torch._dynamo.reset()
    coda_rewrite.explain(model, tokens())
    assert (tmp_path / "b" / "graph_000" / "report.txt").exists()


def test_cli_explain_and_demo(tmp_path):
    factory = tmp_path / "factories.py"
    factory.write_text(textwrap.dedent("""
        from coda_rewrite.models import Llama, LlamaArgs
        def tiny():
            return Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128))
    """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run([sys.executable, "-m", "coda_rewrite", "explain", "factories:tiny",
                          "--dump", str(tmp_path / "d")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "residual_rmsnorm_gemm 5/5 rewritten" in out.stdout
    assert "layers.0.attention_norm" in out.stdout
    assert (tmp_path / "d" / "graph_000" / "rewritten.py").exists()
    out = subprocess.run([sys.executable, "-m", "coda_rewrite", "demo"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rewritten norms: 5" in out.stdout and "ratio" in out.stdout and "OK in" in out.stdout
    seconds = float(out.stdout.rsplit("OK in", 1)[1].split()[0])
    assert seconds < 60


def test_modes_and_cudagraphs_options():
    """torch.compile's mode reaches the backend (reduce-overhead = CUDA graphs), an
    unknown mode or option raises, and cudagraphs=True with or without Inductor gives
    eager's numbers (on CPU the cudagraph trees skip themselves: a no-op here; replays
    are tested on the GPU)."""
    import coda_rewrite
    from coda_rewrite.options import Options
    from conftest import hf_model, tokens

    assert Options.make(mode="reduce-overhead").cudagraphs
    assert Options.make(mode="reduce-overhead").inductor_config() == {"triton.cudagraphs": True}
    assert not Options.make(mode="max-autotune-no-cudagraphs").cudagraphs
    with pytest.raises(ValueError, match="unknown torch.compile mode"):
        Options.make(mode="fastest")
    model = hf_model("llama").eval()
    ids = tokens()
    with torch.no_grad():
        want = model(ids).logits
        with pytest.raises(Exception, match="unknown torch.compile mode"):
            torch.compile(model, backend="coda", mode="fastest")(ids)
        torch._dynamo.reset()
        backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
        got = torch.compile(model, backend=backend, mode="reduce-overhead")(ids).logits
        assert backend.report.count() > 0 and backend.runs == 1
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        fast = coda_rewrite.optimize(model, cudagraphs=True)
        got = fast(ids).logits
        assert fast.report.count() > 0
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_cudagraphs_without_inductor_says_when_it_falls_back(monkeypatch):
    """cuda_graphs.py on a torch that lacks a piece it is built from: dynamo's own
    cudagraphs backend (the same values, every weight copied per replay), with a warning
    that says so, not silently."""
    import torch._inductor.compile_fx as compile_fx
    import coda_rewrite
    from conftest import hf_model, tokens

    monkeypatch.delattr(compile_fx, "get_static_input_idxs")
    model = hf_model("llama").eval()
    ids = tokens()
    torch._dynamo.reset()
    fast = coda_rewrite.optimize(model, cudagraphs=True)
    with torch.no_grad(), pytest.warns(UserWarning, match="falls back to dynamo's"):
        got = fast(ids).logits
    with torch.no_grad():
        want = model(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_small_gemms_are_left_to_cublas_on_the_gpu():
    """options.min_fused_rows: a match whose CUDA GEMMs all have fewer static rows is left
    unfused, with the reason; on CPU (the reference path) or at 0 every size is fused,
    and so is a symbolic row count (its size is unknown when the rewrite is decided)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from coda_rewrite.patterns import (attention, cross_entropy, gated_mlp,
                                       residual_rmsnorm, rope)
    from coda_rewrite.size_policy import too_few_rows

    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    lin = graph.call_function(torch.nn.functional.linear, (x, w))
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        w.meta["example_value"] = torch.empty(64, 32, device="cuda")
        for shape, device, min_rows, left in (((2, 64, 32), "cuda", 512, True),
                                              ((2, 256, 32), "cuda", 512, False),
                                              ((2, 64, 32), "cpu", 512, False),
                                              ((2, 64, 32), "cuda", 0, False),
                                              ((env.create_unbacked_symint(), 32), "cuda",
                                               512, False)):
            x.meta["example_value"] = torch.empty(shape, device=device)
            why = too_few_rows(gated_mlp, {"gemm": [lin]}, min_rows)
            assert bool(why) == left, (shape, device, min_rows, why)
            assert not too_few_rows(attention, {"gemm": [lin]}, min_rows)  # no GEMM fused
        x.meta["example_value"] = torch.empty(2, 64, 32, device="cuda")
        assert "128 rows, fewer than min_fused_rows = 512" in \
            too_few_rows(gated_mlp, [lin], 512)
        # no override: each family's measured threshold (size_policy.py) decides; RoPE's
        # by the model's width too (K: 32 here, then 4096) where CUDA graphs replay it
        def fused(rows, width=32, graphed=False):
            x.meta["example_value"] = torch.empty(2, rows // 2, width, device="cuda")
            return {f.NAME: not too_few_rows(f, [lin], None, graphed)
                    for f in (gated_mlp, rope, residual_rmsnorm, cross_entropy)}
        only_ce = {gated_mlp.NAME: False, rope.NAME: False, residual_rmsnorm.NAME: False,
                   cross_entropy.NAME: True}
        assert fused(128) == fused(512) == only_ce
        assert fused(1024) == {**only_ce, rope.NAME: True} == fused(1024, 4096)
        assert fused(64, graphed=True) == only_ce
        assert fused(128, graphed=True) == {**only_ce, rope.NAME: True}
        assert fused(512, 4096, graphed=True) == only_ce
        assert fused(512, 2048, graphed=True)[rope.NAME]
        assert not fused(512, 2049, graphed=True)[rope.NAME]
        x.meta["example_value"] = torch.empty(2, 256, env.create_unbacked_symint(),
                                              device="cuda")  # K unknown: 1024 rows
        assert too_few_rows(rope, [lin], None, graphed=True)
        wide = graph.call_function(torch.nn.functional.linear, (graph.placeholder("x2"), w))
        wide.args[0].meta["example_value"] = torch.empty(2, 256, 4096, device="cuda")
        x.meta["example_value"] = torch.empty(2, 256, 32, device="cuda")
        assert not too_few_rows(rope, [lin], None, graphed=True)
        assert too_few_rows(rope, [lin, wide], None, graphed=True)  # every GEMM narrow
        assert all(fused(2048).values()) and not any(fused(32, graphed=True).values())
        x.meta["example_value"] = torch.empty(2, 256, 32, device="cuda")
        assert "the rope fusion's measured threshold, 1024 rows" in \
            too_few_rows(rope, [lin], None)
        x.meta["example_value"] = torch.empty(2, 32, 32, device="cuda")
        assert "the rope fusion's measured threshold, 128 rows" in \
            too_few_rows(rope, [lin], None, graphed=True)

        class QkNormMatch(list):  # a RoPE match with a QK-norm in the same GEMM
            head_norm = (128, 1e-6)
        assert too_few_rows(rope, [lin], None) and not too_few_rows(rope, QkNormMatch([lin]),
                                                                    None)
        x.meta["example_value"] = torch.empty(2, 16, 32, device="cuda")
        assert "64 rows" in too_few_rows(rope, QkNormMatch([lin]), None)


def test_training_graphs_fuse_only_the_families_that_pay_there(monkeypatch):
    """options.fuse_in_training: in a graph whose CUDA GEMMs compute a gradient, a family
    that does not pay for itself in a training step (training_policy.py) is left, with
    the reason; the cross-entropy rewrite stays where the user asked for the logits-free
    loss (materialize_logits=False); True fuses every family, False none; inference
    graphs, CPU graphs and families without a GEMM are not affected."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_rewrite.options import Options
    from coda_rewrite.patterns import (attention, cross_entropy, gated_mlp, layernorm,
                                       residual_rmsnorm, rope)
    from coda_rewrite.training_policy import not_paying_in_training

    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    lin = graph.call_function(torch.nn.functional.linear, (x, w))
    gemm_families = (gated_mlp, rope, residual_rmsnorm, cross_entropy, layernorm)

    def left(grad, device="cuda", **options):
        with FakeTensorMode():
            lin.meta["example_value"] = torch.empty(8, 4, device=device, requires_grad=grad)
        opts = Options(**options)
        return {f: bool(not_paying_in_training(f, [lin], opts)) for f in gemm_families}

    monkeypatch.delenv("CODA_FUSE_IN_TRAINING", raising=False)
    assert Options().fuse_in_training is None
    # only the gated MLP pays in a training step (measured; its match is refused in
    # decide where its down projection does not take the fused backward: test_gated_backward)
    assert left(True) == {f: f is not gated_mlp for f in gemm_families}
    assert not left(True, materialize_logits=False)[cross_entropy]
    assert not any(left(False).values()) and not any(left(True, "cpu").values())
    # fuse_in_training=True on a CUDA training graph: every family fused, silently (the
    # GPU survey runs every family in training: tools/survey.py --gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not any(left(True, fuse_in_training=True).values())
    assert all(left(True, fuse_in_training=False, materialize_logits=False).values())
    with FakeTensorMode():
        lin.meta["example_value"] = torch.empty(8, 4, device="cuda", requires_grad=True)
    assert not not_paying_in_training(attention, [lin], Options())
    why = not_paying_in_training(rope, [lin], Options())
    assert "the rope fusion does not yet pay for itself in a training step" in why
    for value, want in (("1", True), ("0", False), ("", None)):
        monkeypatch.setenv("CODA_FUSE_IN_TRAINING", value)
        assert Options().fuse_in_training is want
    monkeypatch.setenv("CODA_FUSE_IN_TRAINING", "yes")
    with pytest.raises(ValueError, match="CODA_FUSE_IN_TRAINING"):
        Options()


@pytest.mark.parametrize("options,fused", [
    ({}, {"gated_mlp"}),
    ({"materialize_logits": False}, {"lm_head_cross_entropy", "gated_mlp"}),
    ({"backward_epilogues": False}, set()),
    ({"fuse_in_training": True}, {"residual_rmsnorm_gemm", "gated_mlp", "rope",
                                  "lm_head_cross_entropy"}),
])
def test_a_training_step_under_the_policy_matches_eager(monkeypatch, options, fused):
    """The pipeline wired to the training policy: a Llama training step (its GEMMs taken
    for CUDA ones, as the policy leaves CPU graphs alone) fuses only what the options
    ask, says ``training.does_not_pay`` for the rest, and computes eager's loss and
    gradients either way. The gated MLP pays only with its backward in the down
    projection's dgrad GEMM (not with backward_epilogues=False)."""
    from coda_rewrite import training_policy
    monkeypatch.delenv("CODA_FUSE_IN_TRAINING", raising=False)
    monkeypatch.setattr(training_policy, "computes_gradients", lambda m: any(
        meta.requires_grad for meta in (
            n.meta.get("example_value") for n in training_policy.gemms_of(m))
        if meta is not None))
    report = step_matches_eager("llama", **options)
    gemm_families = {"residual_rmsnorm_gemm", "gated_mlp", "rope", "lm_head_cross_entropy"}
    done = {r.pattern for r in report.records if r.status == "rewritten"} & gemm_families
    left = {r.pattern for r in report.records if r.code == "training.does_not_pay"}
    assert done == fused, str(report)
    assert left == gemm_families - fused, str(report)


def test_size_policy_from_the_environment_and_in_the_report(monkeypatch):
    """$CODA_MIN_FUSED_ROWS: unset or empty leaves each family's threshold, a number sets
    one for all; the report says which applied."""
    from coda_rewrite.options import Options
    from coda_rewrite.size_policy import threshold_lines
    monkeypatch.setenv("CODA_MIN_FUSED_ROWS", "")
    assert Options().min_fused_rows is None
    monkeypatch.setenv("CODA_MIN_FUSED_ROWS", "256")
    assert Options().min_fused_rows == 256
    monkeypatch.delenv("CODA_MIN_FUSED_ROWS")
    assert Options().min_fused_rows is None
    assert "rope fuses from 1024 rows; with a QK-norm: from 64; from CUDA graphs, a GEMM at " \
        "most 2048 wide (K): from 128" in threshold_lines(None)
    assert threshold_lines(0) == ["every family fuses from 0 rows (options.min_fused_rows)"]
    model = hf_model("llama", layers=1)
    fast = coda_rewrite.optimize(model, min_fused_rows=0)
    fast(tokens())
    assert "every family fuses from 0 rows" in str(fast.report)


@pytest.mark.parametrize("how", ["default", "cudagraphs", "reduce-overhead"])
def test_the_size_policy_knows_whether_cuda_graphs_replay_the_graph(how, monkeypatch):
    """Options.graphed (cudagraphs=True, or a mode that records CUDA graphs) reaches the
    size policy's decision for every match, where RoPE in a narrow model fuses from
    fewer rows (patterns/rope.fused_from_rows_of)."""
    from coda_rewrite import CodaBackend, Options, size_policy
    options = {"default": {}, "cudagraphs": {"cudagraphs": True},
               "reduce-overhead": {"mode": "reduce-overhead"}}[how]
    assert Options(**options).graphed == (how != "default")
    seen = []
    real = size_policy.too_few_rows

    def recorded(family, match, override, graphed=False):
        seen.append(graphed)
        return real(family, match, override, graphed)
    monkeypatch.setattr(size_policy, "too_few_rows", recorded)
    rewrite_only = Options(**options, inductor=False)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(hf_model("llama", layers=1), backend=CodaBackend(rewrite_only))(tokens())
    assert seen and set(seen) == {how != "default"}


def test_inductor_graphs_call_the_op_without_autograd(monkeypatch):
    """Under Inductor, a forward under no_grad calls coda::gemm_epilogue_nograd (no
    Python autograd kernel per call), and so does a training step's forward: AOTAutograd
    traces FusedGemm, whose backward (the family's rule) is in the backward graph; both
    compute what eager computes, gradients included."""
    from coda_rewrite.kernels import ops
    calls = {"nograd": 0, "direct": 0}
    decide, direct = ops._decide_and_run, ops._direct_call

    def counted(program, a, b, operands):  # on the CPU every call of the op runs it ...
        calls["nograd"] += type(a) is torch.Tensor  # a real call, not the fake's
        return decide(program, a, b, operands)

    def counted_direct(*args):  # ... and so does a call without the op, counted apart
        calls["direct"] += 1
        return direct(*args)
    monkeypatch.setattr(ops, "_decide_and_run", counted)
    monkeypatch.setattr(ops, "_direct_call", counted_direct)
    model = hf_model("llama", layers=2)
    ref = copy.deepcopy(model)
    ids = tokens()
    torch._dynamo.reset()
    fast = torch.compile(model, backend="coda")
    with torch.no_grad():
        assert rel_err(fast(ids).logits, ref(ids).logits) <= 1e-5
    assert calls["nograd"] > 0 and not calls["direct"]  # Inductor's compiled graph runs it
    calls["nograd"] = 0
    rules = {"calls": 0}
    real_backward = ops._backward

    def counted_backward(ctx, grads):
        rules["calls"] += 1
        return real_backward(ctx, grads)
    monkeypatch.setattr(ops, "_backward", counted_backward)
    torch._dynamo.reset()
    fast = torch.compile(model, backend="coda")
    loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
    loss.backward()
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert calls["nograd"] > 0 and rules["calls"] > 0  # traced once into the backward
    assert not calls["direct"]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4


def _compiled_code(model, ids):
    """The forward Inductor generates for ``model`` under backend="coda" (no cache: a
    graph cached by an earlier run would be loaded, not generated) and its logits."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    fast = torch.compile(model, backend="coda")
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        out, code = run_and_get_code(fast, ids)
    return out.logits, "\n".join(code)


def test_the_direct_call_with_a_symbolic_token_count(monkeypatch):
    """dynamic=True: Inductor's code calls the kernel with a symbolic row count (the norm
    keeps its finaliser there: ops._fake); one graph serves three prompt lengths, each
    as eager's."""
    from torch._inductor.graph import GraphLowering
    generated = []
    monkeypatch.setattr(GraphLowering, "save_output_code", generated.append)
    model = hf_model("llama", layers=1)
    torch._dynamo.reset()
    fast = torch.compile(model, backend="coda", dynamic=True)
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        for seq in (8, 13, 21):
            ids = tokens(seq=seq)
            assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5, seq
    assert len(generated) == 1, "compiled again for another length"
    assert "extern_kernels.coda_gemm_epilogue_nograd(" in generated[0]
    assert "torch.ops.coda.gemm_epilogue_nograd.default(" not in generated[0]


def test_inductors_code_calls_the_fused_ops_kernels_without_the_dispatcher(monkeypatch):
    """backend="coda"'s Inductor code calls each fused GEMM's kernel function itself
    (kernels/inductor_calls.py), not torch.ops.coda.gemm_epilogue_nograd: the same
    function the dispatcher reaches, so the same values and the same refusal of a call
    autograd could record; and where the hooks are missing the op is called as before."""
    from torch._inductor.select_algorithm import extern_kernels
    from coda_rewrite.kernels import inductor_calls, ops
    calls = {"n": 0}
    decide = ops._decide_and_run

    def counted(program, a, b, operands):
        calls["n"] += type(a) is torch.Tensor  # a real call, not the fake's
        return decide(program, a, b, operands)
    monkeypatch.setattr(ops, "_decide_and_run", counted)
    model = hf_model("llama", layers=1)
    ids = tokens()
    with torch.no_grad():
        want = model(ids).logits
    logits, code = _compiled_code(model, ids)
    assert inductor_calls.installed() is True
    assert "extern_kernels.coda_gemm_epilogue_nograd(" in code
    assert "torch.ops.coda.gemm_epilogue_nograd.default(" not in code  # (asserts name it)
    assert calls["n"] > 0 and rel_err(logits, want) <= 1e-5
    assert extern_kernels.coda_gemm_epilogue_nograd.__wrapped__ is ops._execute_nograd
    for op, (name, fn) in inductor_calls._KERNELS.items():  # each a formula-less op's kernel
        assert getattr(extern_kernels, name).__wrapped__ is fn
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("coda::gemm_epilogue", "Autograd")
    # a profiler's trace names each direct call as the dispatcher's record would
    compiled = torch.compile(model, backend="coda")
    with torch.no_grad():
        compiled(ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(ids)
    recorded = [e.name for e in prof.events() if e.name.startswith("coda::")]
    assert recorded.count("coda::gemm_epilogue_nograd") == code.count(
        "extern_kernels.coda_gemm_epilogue_nograd("), recorded
    # the kernel refuses, as the op does, a call whose gradient could be asked for
    program = re.search(r"extern_kernels\.coda_gemm_epilogue_nograd\('([^']*)'", code)[1]
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        extern_kernels.coda_gemm_epilogue_nograd(program, x, torch.randn(64, 64), [])
    # a torch whose Inductor lacks the hooks: nothing installed, the op called as before
    from torch._inductor import lowering
    for op in inductor_calls._KERNELS:
        if op in lowering.lowerings:
            monkeypatch.delitem(lowering.lowerings, op)
    monkeypatch.setattr(inductor_calls, "_installed", None)
    monkeypatch.setattr(inductor_calls, "_hooks_present", lambda: False)
    calls["n"] = 0
    logits, code = _compiled_code(model, ids)
    assert inductor_calls.installed() is False
    assert "torch.ops.coda.gemm_epilogue_nograd.default(" in code
    assert "extern_kernels.coda_" not in code
    assert calls["n"] > 0 and rel_err(logits, want) <= 1e-5
    assert any("through torch.ops" in line for line in ops.runtime_summary())
