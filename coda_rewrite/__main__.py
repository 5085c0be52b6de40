"""Command line: ``python -m coda_rewrite demo`` and ``python -m coda_rewrite explain
module:factory``.

``factory`` is a callable returning a model, or a (model, example_inputs) pair; with a
model alone the inputs are random token ids of shape (2, --seq) drawn from the model's
vocabulary (``config.vocab_size`` or ``args.vocab_size``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch


def _load(spec: str):
    mod, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"expected module:factory, got {spec!r}")
    obj = getattr(importlib.import_module(mod), name)
    made = obj() if callable(obj) and not isinstance(obj, torch.nn.Module) else obj
    return made if isinstance(made, tuple) else (made, None)


def _vocab(model) -> int:
    for holder in (getattr(model, "config", None), getattr(model, "args", None)):
        if holder is not None and hasattr(holder, "vocab_size"):
            return holder.vocab_size
    raise SystemExit("the factory returned no example inputs and the model has no "
                     "config.vocab_size / args.vocab_size to draw token ids from")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coda_rewrite")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="rewrite, check and explain a small built-in Llama")
    d.add_argument("--device", default=None)
    d.add_argument("--layers", type=int, default=2)
    e = sub.add_parser("explain", help="print the report for module:factory")
    e.add_argument("factory")
    e.add_argument("--seq", type=int, default=16)
    e.add_argument("--dump", default=None, help="also write the report to this folder")
    e.add_argument("--code", action="store_true", help="print the rewritten graph too")
    a = p.parse_args(argv)

    if a.cmd == "demo":
        from .demo import run
        return run(device=a.device, layers=a.layers)

    from . import explain
    sys.path.insert(0, ".")
    model, inputs = _load(a.factory)
    model.eval()
    if inputs is None:
        inputs = (torch.randint(0, _vocab(model), (2, a.seq)),)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    report = explain(model, *inputs, dump_dir=a.dump)
    print(report if a.code else "\n\n".join(g.render(with_code=False) for g in report.graphs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
