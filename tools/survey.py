"""Does every causal LM compute what eager computes through optimize()? The adversarial
check behind the coverage table: the same tiny configs (tools/coverage.py), a training
forward + backward and an eval forward, each against eager.

    python tools/survey.py [model_type ...]

One line per architecture:

    train   loss relative to eager's; the largest gradient difference, relative to the
            model's largest gradient norm (a gradient that is zero in exact arithmetic,
            a key bias under softmax attention, say, is noise either way)
    eval    logits relative to eager's, and dynamo's own capture
            (torch.compile(backend="eager")) beside it: where both differ from eager
            alike, the graph dynamo captured computes something else, not the pass

Dropout is drawn alike (the same seed before each forward). A line is flagged DIFFERS
where training is off by more than 1e-5 (loss) / 1e-4 (gradients) or the eval logits by
more than 1e-5, and PASS-ONLY where dynamo's capture agrees with eager and the pass does
not: the one a bug report belongs to.
"""

from __future__ import annotations

import copy
import os
import sys

import torch


def _coverage_tool():
    """This folder's coverage.py (the tiny configs), by path: the name is also a PyPI
    package's."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "coverage.py")
    spec = importlib.util.spec_from_file_location("coda_coverage_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


coverage = _coverage_tool()


def check(model_type: str) -> str:
    import coda_rewrite
    from coda_rewrite.numerics import rel_err

    torch._dynamo.reset()
    try:
        model = coverage.build(model_type)
        ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        ref = copy.deepcopy(model)
        torch.manual_seed(1)
        want = ref(ids, labels=ids, use_cache=False).loss
    except Exception as e:  # the tiny config itself does not run: not the pass's doing
        return f"{model_type}: skipped (eager: {type(e).__name__})"
    fast = coda_rewrite.optimize(model)
    torch.manual_seed(1)
    loss = fast(ids, labels=ids, use_cache=False).loss
    loss.backward()
    want.backward()
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(),
                                                     ref.parameters()) if q.grad is not None]
    scale = max(g.norm().item() for _, _, g in pairs)
    grad, where = max(((a - b).norm().item() / scale if a is not None else float("inf"), n)
                      for n, a, b in pairs)
    loss_err = abs(loss.item() - want.item()) / abs(want.item())
    rewrites = fast.report.count(pattern=None)

    plain = copy.deepcopy(ref).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        logits = plain(ids, use_cache=False).logits
        ours = rel_err(coda_rewrite.optimize(copy.deepcopy(plain))(ids, use_cache=False)
                       .logits, logits)
        torch._dynamo.reset()
        dynamo = rel_err(torch.compile(copy.deepcopy(plain), backend="eager")(
            ids, use_cache=False).logits, logits)
    bad = loss_err > 1e-5 or grad > 1e-4 or ours > 1e-5
    flag = ("PASS-ONLY" if dynamo <= 1e-5 else "DIFFERS") if bad else "ok"
    return (f"{model_type}: {flag} | {rewrites} rewrites | train: loss {loss_err:.1e}, "
            f"gradients {grad:.1e} ({where}) | eval logits {ours:.1e}, dynamo's capture "
            f"{dynamo:.1e}")


def main(argv: list[str]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = argv or sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                           if t not in coverage.SKIP)
    for t in types:
        try:
            print(check(t), flush=True)
        except Exception as e:  # the pass raised: the worst outcome, say it loudly
            print(f"{t}: PASS RAISED {type(e).__name__}: {str(e).splitlines()[0][:120]}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
