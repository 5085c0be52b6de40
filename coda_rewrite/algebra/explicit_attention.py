"""Legality of explicit softmax attention → SDPA (patterns/explicit_attention.py).

    softmax((q·kᵀ)·s + m, over keys)·v  =  scaled_dot_product_attention(q, k, v, m, s)

holds by SDPA's definition; what needs checking is the glue: that the matched nodes are
that formula (which operand is q, the transpose, the scale, the softmax's dim) and that
nothing else reads what the fused call never writes. The float64 witness replays the
matched nodes against SDPA on random inputs, an additive mask included; where the
attention trains, once more with q, k and v as float64 leaves, comparing the gradients
of both sides to them (witness.gradient_error: values can agree where gradients do not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..canonical import canon, meta
from ..capture import describe
from ..numerics import rel_err
from .decision import Decision, Proof, Rejection, Why
from .mask import prove_causal
from .witness import eval_nodes, gradient_error, guarded_with_gradients, verdict

_DROPOUT = {F.dropout, torch.dropout, "dropout"}


def side_conditions(m) -> tuple[list[str], str | None]:
    held = []
    for node in m.nodes:
        if node is m.out:
            continue
        readers = [u for u in node.users if u not in m.nodes]
        if readers:
            return held, Why(f"{describe(node)} is also read by {describe(readers[0])} (the "
                             "attention weights returned, say): SDPA never writes it",
                             "explicit_attention.weights_read")
    dtypes = {meta(n).dtype for n in (m.q, m.k, m.v, m.out) if meta(n) is not None}
    if len(dtypes) != 1:
        return held, Why(f"q, k, v and the output differ in dtype ({sorted(map(str, dtypes))})",
                         "explicit_attention.dtypes")
    dtype = dtypes.pop()
    for node in m.nodes:  # SDPA rounds nothing in between: nor may eager (the replay
        c, out = canon(node), meta(node)  # keeps float64 through casts, so it is a condition)
        if c is not None and c.name == "cast" and out is not None and \
                out.dtype.is_floating_point and \
                torch.finfo(out.dtype).eps > torch.finfo(dtype).eps:
            return held, Why(f"{describe(node)} rounds the scores or weights to {out.dtype} "
                             f"in a {dtype} attention: SDPA would skip that rounding",
                             "explicit_attention.narrowing_cast")
    held.append(f"q, k, v and the output in one dtype ({dtype}), no rounding coarser than "
                "it in between; the weights and scores are read only on the way to the "
                "output")
    if m.mask is not None:
        mm, mq = meta(m.mask), meta(m.q)
        if mm is None or not mm.is_floating_point() or \
                mm.dtype not in (torch.float32, mq.dtype):
            return held, Why(f"the mask {describe(m.mask)} is not a float mask SDPA takes "
                             "(float32 or q's dtype)", "explicit_attention.mask_dtype")
        causal = prove_causal(m.mask, meta(m.q).shape[-2], meta(m.k).shape[-2])
        if not causal.accepted:  # a row may be all masked (padding): the explicit softmax
            # and SDPA's kernels differ there (measured: the gradients)
            return held, Why(f"the mask is not proved causal ({causal.condition}): a row "
                             "may be fully masked, where the explicit softmax and SDPA "
                             "differ", "explicit_attention.mask_not_causal")
        held.append(f"the mask {describe(m.mask)} is added to the scores, as SDPA adds a "
                    "float attn_mask, and is causal: every row keeps its diagonal")
    return held, None


def decide(m) -> Decision:
    """Legality of replacing match ``m`` by one SDPA call. Pure."""
    held, failed = side_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    trains = [meta(n) for n in (m.q, m.k, m.v, m.out)]
    seen = guarded_with_gradients(_replay, m, any(t is None or t.requires_grad
                                                  for t in trains))  # unknown: replay
    if isinstance(seen, Rejection):
        return seen
    return Proof("softmax((q·kᵀ)·s + m)·v = SDPA(q, k, v, attn_mask=m, scale=s)",
                 (f"scale s = {m.scale:g}", *held),
                 ("SDPA's definition (the math it fuses, without the score tensor)",),
                 seen)


def _replay(m, gradients: bool = False) -> str | Rejection:
    """The matched nodes on random float64 q, k, v (and an additive mask) against SDPA;
    with ``gradients``, q, k and v are leaves and the gradients of both sides to them are
    compared instead."""
    gen = torch.Generator().manual_seed(1618)
    b, h = 1, int(meta(m.q).shape[1])
    sq = min(int(meta(m.q).shape[2]), 5)
    sk = min(int(meta(m.k).shape[2]), 5) if meta(m.k).shape[2] != meta(m.q).shape[2] else sq
    d = int(meta(m.q).shape[3])
    dv = int(meta(m.v).shape[3])

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    leaves = [rand(b, h, sq, d), rand(b, h, sk, d), rand(b, h, sk, dv)]
    if gradients:
        for t in leaves:
            t.requires_grad_()
    env = {"__gen__": gen, m.q: leaves[0], m.k: leaves[1], m.v: leaves[2]}
    mask = None
    if m.mask is not None:
        mask = rand(1, 1, sq, sk)
        env[m.mask] = mask
    for node in m.nodes:  # graph order; casts and the softmax's dtype keep float64:
        c = canon(node)      # the replay checks the math, not the roundings
        if c is not None and c.name == "cast":
            env[node] = env[node.args[0]]
        elif node is m.softmax:
            env[node] = torch.softmax(env[node.args[0]], dim=-1)
        elif node.target in _DROPOUT:  # an identity (the pattern took only those)
            env[node] = env[node.args[0]]
        else:
            eval_nodes([node], env)
    want = env[m.out]
    got = F.scaled_dot_product_attention(env[m.q], env[m.k], env[m.v], attn_mask=mask,
                                         scale=m.scale)
    if gradients:
        return verdict(gradient_error([got], [want], leaves),
                       f"the gradients to q, k and v, {sq} × {sk} positions", m.path,
                       tol=1e-5, gradients=True)
    return verdict(rel_err(got, want.double()), f"{sq} × {sk} positions", m.path, tol=1e-5)
