"""benchmarks/plot.py draws the benchmark CSVs as PNGs on a machine without a GPU."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("matplotlib")  # the bench extra; CI installs it


def test_plot_draws_the_latest_figures(tmp_path):
    results, plots = tmp_path / "results", tmp_path / "plots"
    results.mkdir()
    rows = [("2026-11-30", "old", "fig A", "eager", "ms", "9.0"),
            ("2026-12-01", "new", "fig A", "eager", "ms", "2.0"),
            ("2026-12-01", "new", "fig A", 'backend="coda"', "ms", "1.5"),
            ("2026-12-01", "new", "fig B", "only one variant", "ms", "1.0")]
    with open(results / "x.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["date", "environment", "figure", "variant", "metric", "value"])
        w.writerows(rows)
    env = {**os.environ, "CODA_BENCH_RESULTS": str(results), "CODA_BENCH_PLOTS": str(plots)}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot.py")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [p.name for p in plots.iterdir()] == ["fig_a.png"]  # one variant: no plot
    assert (plots / "fig_a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2026-12-01" in run.stdout  # the latest date only
