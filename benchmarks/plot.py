"""Draw the benchmark CSVs (benchmarks/results/*.csv, written by regions.py and
layer_and_step.py through common.write_csv) as small PNGs in benchmarks/plots/, one per
figure and metric, the latest date of each: what BENCHMARKS.md shows beside its tables.

    pip install -e ".[bench]" && python benchmarks/plot.py

Runs on any machine (no GPU): it only reads the numbers. CODA_BENCH_RESULTS and
CODA_BENCH_PLOTS point it at other folders.
"""

from __future__ import annotations

import csv
import os
import re
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def latest_rows() -> dict:
    """(figure, metric) -> (date, environment, [(variant, value)]) of the latest date."""
    found: dict = {}
    folder = os.environ.get("CODA_BENCH_RESULTS") or os.path.join(HERE, "results")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".csv"):
            continue
        with open(os.path.join(folder, name), newline="") as f:
            for row in csv.DictReader(f):
                key = (row["figure"], row["metric"])
                date = row["date"]
                if key not in found or found[key][0] < date:
                    found[key] = (date, row["environment"], {})
                if found[key][0] == date:
                    found[key][2][row["variant"]] = float(row["value"])
    return found


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:60]


def main() -> None:
    out = os.environ.get("CODA_BENCH_PLOTS") or os.path.join(HERE, "plots")
    os.makedirs(out, exist_ok=True)
    for (figure, metric), (date, env, values) in sorted(latest_rows().items()):
        if len(values) < 2:
            continue
        names, nums = list(values), list(values.values())
        fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(names) + 0.9), dpi=80)
        colors = ["#d62728" if "coda" in n or n.startswith("optimize") else "#7f7f7f"
                  for n in names]
        ax.barh(names, nums, color=colors)
        ax.invert_yaxis()
        for y, v in enumerate(nums):
            ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)
        ax.set_xlabel(metric, fontsize=8)
        ax.set_title(figure + "\n" + "\n".join(textwrap.wrap(env, 80)), fontsize=7)
        ax.tick_params(labelsize=8)
        ax.set_xlim(0, max(nums) * 1.18)
        fig.tight_layout()
        path = os.path.join(out, f"{slug(figure)}.png")
        fig.savefig(path)
        plt.close(fig)
        print(path, f"({os.path.getsize(path)} bytes, {date})")


if __name__ == "__main__":
    main()
