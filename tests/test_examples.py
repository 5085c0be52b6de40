"""The examples/ scripts run as a user runs them: no arguments, a tiny config without a
GPU (each well under two minutes on CI's 2 cores), and say what they did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

EXAMPLES = {
    "finetune_hf.py": "tokens/s over steps",
    "per_block_compile.py": "one training step: loss",
    "serve_generate.py": "same tokens as eager: True",
    "explain_and_dump.py": "graph_000/report.txt begins",
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(script, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, whatever the machine
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert EXAMPLES[script] in run.stdout, run.stdout[-3000:]
    assert "rewrite" in run.stdout


def test_coverage_script_reports_a_row_per_architecture():
    """tools/coverage.py (the README's coverage table) on three architectures: Llama fully
    rewritten, no experts, no LayerNorm; Qwen3-MoE's routed experts; GPT-2 (no RMSNorm,
    no RoPE, MHA; LayerNorms whose Conv1D GEMMs are not plain ones) with nothing to fuse
    but its loss."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "coverage.py"), "llama",
                          "qwen3_moe", "gpt2"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert "| llama | 2/2 | 5/5 | 2/2 | · | 2/2 | 1/1 | · |" in rows, run.stdout
    assert any(r.startswith("| qwen3_moe | 2/2 | ") and r.split(" | ")[4] == "2/2"
               for r in rows), run.stdout
    assert any(r.startswith("| gpt2 | ") and "PASS FAILED" not in r for r in rows), run.stdout


def _survey():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import survey
    return survey


def test_survey_gpu_check_judges_kernels_against_float64_and_names_top_k_flips():
    """tools/survey.py --gpu's check, run here on the CPU (the reference in place of the
    kernels): a Llama at the GPU widths is within the bar; and its flip detector tells a
    routing flip (one token's logits far off, the rest as eager's) from a systematic
    error (every token worse), which it must never excuse."""
    import torch
    survey = _survey()
    line = survey.check_gpu("llama", device="cpu")
    assert line.startswith("llama: cpu bf16 ok |") and "gradients" in line, line
    eager = torch.full((256,), 1e-2)
    one_off = eager.clone()
    one_off[17] = 0.6
    assert survey._flipped(one_off, eager).nonzero().flatten().tolist() == [17]
    assert not survey._flipped(eager * 3, eager).any()  # every token worse: judged
    eager_off = eager.clone()
    eager_off[5] = 0.4  # eager's own rounding flipped token 5 against the exact model
    assert survey._flipped(one_off, eager_off).nonzero().flatten().tolist() == [5, 17]
    # a training step: a few flipped tokens excuse a few times eager's error, never NaN
    # nor orders of magnitude (the shard-9 gradients were 1e2-4e5x), nor many tokens
    assert survey._step_excused(1, 256, 3.7, 1e-5)
    assert not survey._step_excused(1, 256, 386800.0, 1e-5)
    assert not survey._step_excused(1, 256, float("nan"), 1e-5)
    assert not survey._step_excused(40, 256, 2.0, 1e-5)
    assert not survey._step_excused(0, 256, 2.0, 1e-5)
    assert survey._kept_ratio(0.0, 0.0) == float("inf")  # no token left: judged, no raise
    assert survey._kept_ratio(1e-3, 2e-3) == 0.5
    if not torch.cuda.is_available():
        assert survey.check_gpu("llama").endswith("skipped (no CUDA device)")
