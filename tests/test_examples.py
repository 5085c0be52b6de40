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
