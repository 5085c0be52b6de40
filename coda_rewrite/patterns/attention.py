"""Attention inputs: undo what capture did to SDPA's arguments.

Eager Hugging Face calls ``scaled_dot_product_attention(q, k, v, is_causal=True,
enable_gqa=True)``; under dynamo tracing (transformers 5.17) the same model materialises
the causal mask as a tensor and repeats the key/value heads to the query head count
(``repeat_kv``), which sends SDPA to a slower kernel (3x the attention time measured on
an H200). This pattern finds each SDPA call, and

* a key/value that is ``repeat_kv(x)`` (x[:, :, None].expand(b, kvh, n_rep, s, d)
  .reshape(b, kvh·n_rep, s, d), x.repeat_interleave(n_rep, dim=1), or TorchTitan's
  repeat on [b, s, h, d] then .transpose(1, 2)) is replaced by x
  with ``enable_gqa=True``: SDPA then maps query head h to key head h // n_rep, exactly
  repeat_kv's layout (head kvh·n_rep + rep comes from kv head kvh);
* a mask proved to be upper-left causal with q_len == kv_len (algebra/mask.py) is
  dropped for ``is_causal=True``; any other mask (padding, a window shorter than the
  sequence, a cache offset) is kept, and the report says why.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..algebra import mask as mask_prover
from ..algebra.decision import Decision, Proof, Rejection
from ..canonical import SDPA, foreign_subclass, meta
from ..capture import describe, model_path
from ..graph_utils import erase_if_dead
from .family import Context, Decided

NAME = "attention_inputs"


@dataclasses.dataclass
class AttentionMatch:
    sdpa: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    k_base: object             # the unrepeated key, when k = repeat_kv(k_base) (see
    v_base: object             # repeat_kv_base: a node, or ("transpose", node))
    mask: fx.Node | None
    gqa: Decision
    causal: Decision | None    # None: no mask to begin with
    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.sdpa)

    @property
    def changes(self) -> bool:
        return self.gqa.accepted or (self.causal is not None and self.causal.accepted)


def _sdpa_args(n: fx.Node):
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa"]
    vals = dict(zip(names, n.args))
    vals.update(n.kwargs)
    return vals


def _repeat_interleave(node, dims) -> fx.Node | None:
    """x if ``node`` is x.repeat_interleave(n, dim) (or torch.repeat_interleave(x,
    repeats=n, dim=dim): Mistral's reference) with an int n and dim in ``dims``."""
    if not (isinstance(node, fx.Node) and (
            node.op == "call_method" and node.target == "repeat_interleave" or
            node.op == "call_function" and node.target is torch.repeat_interleave)):
        return None
    reps = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    return node.args[0] if isinstance(reps, int) and dim in dims else None


def _unsqueezed_at(node, axis: int) -> fx.Node | None:
    """x if ``node`` is x with a new axis inserted at ``axis`` of the 5-d result:
    ``x.unsqueeze(axis)``, ``torch.unsqueeze(x, axis)`` or ``x[:, .., None]``."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name == "unsqueeze":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return node.args[0] if isinstance(dim, int) and dim % 5 == axis else None
    if name == "getitem":
        base, index = node.args
        full = slice(None, None, None)
        index = list(index) if isinstance(index, tuple) else [index]
        while index and index[-1] == full:
            index.pop()
        return base if index == [full] * axis + [None] else None
    return None


def _repeat_on(node, h: int) -> fx.Node | None:
    """x if ``node`` repeats each head of x n_rep times in place along dim ``h`` of a 4-d
    tensor (kv head g becomes heads g·n_rep … g·n_rep + n_rep − 1: GQA's h // n_rep):
    ``x.repeat_interleave(n_rep, dim=h)``, or x with an axis inserted after h, expanded
    to n_rep along it and reshaped back to 4 dims (Hugging Face's and the reference
    Llama's repeat_kv), or flattened back (torchtune's ``k.unsqueeze(2).expand(b, kvh,
    n_rep, s, d).flatten(1, 2)``)."""
    base = _repeat_interleave(node, (h, h - 4))
    if base is not None:
        return base
    if not (isinstance(node, fx.Node) and (
            node.op == "call_method" and node.target in ("reshape", "view")
            or _flattens(node, h))):
        return None
    exp = node.args[0]
    if not (isinstance(exp, fx.Node) and exp.op == "call_method" and exp.target == "expand"):
        return None
    base = _unsqueezed_at(exp.args[0], h + 1)
    if base is None or meta(base) is None or meta(base).dim() != 4 or meta(exp) is None:
        return None
    shape, expanded, out = list(meta(base).shape), list(meta(exp).shape), list(meta(node).shape)
    rep = expanded[h + 1]
    if expanded[:h + 1] + expanded[h + 2:] != shape or \
            out != shape[:h] + [shape[h] * rep] + shape[h + 1:]:
        return None
    return base


def _flattens(node: fx.Node, h: int) -> bool:
    """``node`` is ``x.flatten(h, h + 1)`` (or torch.flatten) of a 5-d x: axes h and h + 1
    merged into one."""
    if not (node.op == "call_method" and node.target == "flatten" or
            node.op == "call_function" and node.target is torch.flatten):
        return False
    x = node.args[0]
    start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
    end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
    return isinstance(x, fx.Node) and meta(x) is not None and meta(x).dim() == 5 and \
        isinstance(start, int) and isinstance(end, int) and (start % 5, end % 5) == (h, h + 1)


def repeat_kv_base(node) -> fx.Node | tuple | None:
    """The unrepeated key/value if ``node`` is repeat_kv of it along the head dim of
    [b, h, s, d]: a node, or ("transpose", x) when the repeat happened on x's [b, s, h, d]
    layout before the transpose to [b, h, s, d] (TorchTitan and the reference Llama).
    ``Tensor.repeat`` along the heads tiles them (query head h reads kv head h % n_kv):
    not GQA's layout, and not recognised."""
    if not isinstance(node, fx.Node) or meta(node) is None or meta(node).dim() != 4:
        return None
    base = _repeat_on(node, 1)
    if base is not None:
        return base
    if node.op == "call_method" and node.target == "transpose" and \
            sorted(a % 4 for a in node.args[1:3]) == [1, 2]:
        inner = _repeat_on(node.args[0], 2)
        if inner is not None:
            return ("transpose", inner)
    return None


def _heads(base) -> int:
    """Head count of an unrepeated key/value (dim 1 of [b, h, s, d], or dim 2 of the
    [b, s, h, d] tensor a transpose will bring there)."""
    if isinstance(base, tuple):
        return meta(base[1]).shape[2]
    return meta(base).shape[1]


def find(graph: fx.Graph) -> list[AttentionMatch]:
    out = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in SDPA:
            continue
        a = _sdpa_args(n)
        q, k, v = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask")
        if foreign_subclass(n) is not None:  # its SDPA is the subclass's (pipeline records it)
            continue
        kb, vb = repeat_kv_base(k), repeat_kv_base(v)
        if a.get("enable_gqa"):
            gqa = Rejection("SDPA already uses enable_gqa", describe(n),
                            code="attention.gqa_already")
        elif kb is None or vb is None:
            gqa = Rejection("key/value are not repeat_kv of fewer heads", describe(n),
                            code="attention.not_repeat_kv")
        elif _heads(kb) != _heads(vb) or meta(q).shape[1] % _heads(kb) != 0:
            gqa = Rejection("key and value head counts disagree", describe(n),
                            code="attention.kv_heads")
        else:
            n_rep = meta(q).shape[1] // _heads(kb)
            gqa = Proof("SDPA(q, repeat_kv(k), repeat_kv(v)) = SDPA(q, k, v, enable_gqa=True)",
                        (f"{meta(q).shape[1]} query heads, {_heads(kb)} key/value heads "
                         f"(n_rep = {n_rep})",
                         "repeat_kv puts kv head g at query heads g·n_rep … g·n_rep + n_rep − 1"),
                        ("enable_gqa maps query head h to key/value head h // n_rep: the same "
                         "head each query saw through repeat_kv",))
        causal = None
        if isinstance(mask, fx.Node):
            mm, mq = meta(mask), meta(q)
            if a.get("is_causal"):
                causal = Rejection("SDPA got both a mask and is_causal", describe(n),
                                   code="attention.mask_and_causal")
            elif mm is not None and mq is not None and \
                    mm.dtype not in (torch.bool, torch.float32, mq.dtype):
                # SDPA rejects it, and must go on rejecting it: the mask stays
                causal = Rejection(f"a {mm.dtype} mask with {mq.dtype} queries: eager's SDPA "
                                   "raises on it", describe(n), code="attention.mask_dtype")
            else:
                causal = mask_prover.prove_causal(mask, meta(q).shape[-2], meta(k).shape[-2])
        gqa = _fused_kernel_takes_gqa(gqa, mask, causal, q, n)
        out.append(AttentionMatch(n, q, k, v, kb, vb, mask, gqa, causal))
    return out


def _fused_kernel_takes_gqa(gqa, mask, causal, q, sdpa):
    """enable_gqa is a speed rewrite: it must leave SDPA a fused kernel. PyTorch's flash
    and memory-efficient kernels take it only without a mask tensor and with head_dim ≤
    256; otherwise SDPA falls back to its math kernel (the [s, s] scores materialised),
    which is slower than repeating the key/value heads (measured: decode with a kept
    cache mask ran at 0.71x torch.compile's tokens/s with it). So where the mask stays a
    tensor the repeat stays too."""
    if not gqa.accepted:
        return gqa
    if isinstance(mask, fx.Node) and not (causal is not None and causal.accepted):
        return Rejection("a mask tensor stays (not proved causal), and SDPA's fused kernels "
                         "take enable_gqa only without one (math-kernel fallback): the "
                         "key/value repeat stays", describe(sdpa),
                         code="attention.gqa_with_mask")
    if meta(q).shape[-1] > 256:
        return Rejection(f"head_dim {meta(q).shape[-1]} > 256: SDPA's fused kernels take "
                         "enable_gqa only up to 256 (math-kernel fallback): the key/value "
                         "repeat stays", describe(sdpa), code="attention.gqa_head_dim")
    return gqa


# ---- the family's protocol (patterns/family.py) ------------------------------------------

def describe_match(m: AttentionMatch) -> dict:
    notes = [("grouped-query heads", m.gqa)]
    if m.causal is not None:
        notes.append(("mask", m.causal))
    return {"notes": notes}


def decide(m: AttentionMatch, context: Context) -> Decided:
    """The proofs were made while finding (the mask prover, the repeat_kv layout): a
    match is applied when one of them holds; what does not hold is kept and said."""
    notes = describe_match(m)["notes"]
    if not m.changes:
        failed = [d for _, d in notes if not d.accepted]
        why = "; ".join(d.condition for d in failed)
        return Decided(None, None, Rejection(why, m.path, code=failed[0].code))
    kept = "; ".join(f"{label} kept: {d.condition}" for label, d in notes if not d.accepted)
    return Decided(None, m, None, {"reason": kept})


def apply(graph: fx.Graph, m: AttentionMatch, context: Context) -> dict:
    """Replace the SDPA call; the repeat and mask nodes go once dead."""
    _replace_sdpa(graph, m)
    erase_if_dead(graph, [m.k, m.v] + ([m.mask] if m.mask is not None else []))
    return {}


def _replace_sdpa(graph: fx.Graph, m: AttentionMatch) -> fx.Node:
    a = _sdpa_args(m.sdpa)
    use_gqa = m.gqa.accepted
    causal = m.causal is not None and m.causal.accepted
    kwargs = {
        "attn_mask": None if causal else a.get("attn_mask"),
        "dropout_p": a.get("dropout_p", 0.0),
        "is_causal": True if causal else a.get("is_causal", False),
        "scale": a.get("scale"),
        "enable_gqa": True if use_gqa else a.get("enable_gqa", False),
    }
    with graph.inserting_before(m.sdpa):
        k, v = m.k, m.v
        if use_gqa:
            k, v = (graph.call_method("transpose", (b[1], 1, 2)) if isinstance(b, tuple)
                    else b for b in (m.k_base, m.v_base))
        new = graph.call_function(torch.nn.functional.scaled_dot_product_attention,
                                  (m.q, k, v), kwargs)
    new.meta.update(m.sdpa.meta)
    m.sdpa.replace_all_uses_with(new)
    graph.erase_node(m.sdpa)
    return new
