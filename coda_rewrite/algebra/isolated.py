"""Run a witness away from the caller's thread-local torch state.

Rewrites are decided while dynamo compiles, which can happen inside a user's
activation-checkpointed forward (``torch.utils.checkpoint``, non-reentrant): its
saved-tensor hooks are installed for the thread, so a witness that differentiates (the
gated backward's gradient replay, a statement's autograd check) would have its saved
tensors packed by them, and unpacking them would try to recompute the user's region
(seen: ``_StopRecomputationError`` inside the decision). Saved-tensor hooks, grad mode,
autocast and dispatch modes are thread-local, so a fresh thread runs the witness on
plain float64 tensors with none of them; the caller waits for it (nothing runs
concurrently)."""

from __future__ import annotations

import threading


def off_thread(fn, *args):
    """``fn(*args)`` on a fresh thread: its result, or its exception re-raised here."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller, who decides
            box["error"] = e

    worker = threading.Thread(target=run, name="coda-witness")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
