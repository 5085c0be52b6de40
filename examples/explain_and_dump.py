"""What was rewritten, and why: explain() and the dump folder.

    python examples/explain_and_dump.py [FOLDER]

explain() captures the model on example inputs and returns the report: every candidate
match with its model path, the proof (the identity, its side conditions, the float64
witness) or the rejection (its reason and code), the epilogue programs and the rewritten
graph. With ``dump_dir`` (or CODA_DUMP_DIR) each graph also goes to disk:

    graph_000/report.txt      matches, decisions, programs, runtime counters
    graph_000/canonical.txt   the captured graph in the canonical vocabulary
    graph_000/rewritten.py    the rewritten graph as Python
    graph_000/programs.txt    every epilogue program as math, and its JSON text
    graph_000/kernels.txt     each program's generated QuACK source and layout contract
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import torch

import coda_rewrite
from coda_rewrite.models import Llama, LlamaArgs


def main(folder: str | None = None) -> None:
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            vocab_size=256, max_seq_len=64)).eval()
    tokens = torch.randint(0, 256, (2, 16))
    folder = folder or tempfile.mkdtemp(prefix="coda_dump_")
    report = coda_rewrite.explain(model, tokens, dump_dir=folder)

    for record in report.records:  # the report as data
        what = record.status + (f" ({record.code})" if record.code else "")
        print(f"{record.pattern:24s} {record.path or '<top level>':40s} {what}")
    print(f"\n{report.count(pattern=None)} rewrites; the full text: print(report)")

    print(f"\nthe dump, in {folder}:")
    for path in sorted(pathlib.Path(folder).rglob("*.txt")) + \
            sorted(pathlib.Path(folder).rglob("*.py")):
        print(f"  {path.relative_to(folder)}  ({path.stat().st_size} bytes)")
    head = (pathlib.Path(folder) / "graph_000" / "report.txt").read_text().splitlines()[:12]
    print("\ngraph_000/report.txt begins:\n  " + "\n  ".join(head))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
