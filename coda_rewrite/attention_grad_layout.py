"""Attention's output gradient handed to SDPA's backward in one layout: dense
[b, s, h, d] (the [b, h, s, d] view of a contiguous [b, s, h, d] tensor), 16-byte aligned.

Why: PyTorch's cuDNN attention backward (the SDPA backend PyTorch picks on Hopper for
bf16/fp16) keeps the cuDNN graph it built in a cache keyed by q, k and v's shapes and
strides, but builds that graph with the first call's dO strides. A later call with the
same q, k, v and another dO layout runs the cached graph, which reads dO with the first
call's strides: wrong gradients, no error. Measured on the H200 (torch 2.11.0+cu130,
2026-12-04): a second call with dO contiguous [b, h, s, d] after one with dO [b, s, h, d]
returns dq, dk, dv 1.4 (relative) from the math backend's (2.9e-3 when it is the first
call); a padded dO after a dense one, 1.2; the other way, NaN (tools/cudnn_dO_layout.py
checks an installed PyTorch). PyTorch later keys the
cache on dO's strides too (pytorch/pytorch#191576); the releases this project supports
include ones without it.

The rewrites make this likelier than eager does: fused projections give q, k and v one
layout across models and layers, so graphs whose attention outputs are used differently
(a differential-attention model chunks its output; a standard one transposes it back)
share one cache entry. The survey on the GPU ran diffllama and then glm4_moe in one
process: glm4_moe's weight gradients came out 4e5x eager's error (NaN for others after
it); with SDPA's cuDNN backend off, or each model in a fresh process, every one was
within the bar.

So every SDPA call in a graph that may compute gradients on CUDA gets its output's
gradient re-laid, where it is not already, to the layout Hugging Face's and TorchTitan's
eager code hand it (the gradient of ``o.transpose(1, 2).contiguous()``) and the one
PyTorch's memory-efficient backward requires: cache entries our graphs make then agree
with each other and with the common eager spelling. It is a hook on the output tensor
(the output stays the same tensor: no view, no extra autograd node); AOTAutograd traces
it into the backward graph, so under Inductor the copy is a compiled kernel and the
backward's dO has that layout. The cost is one copy of dO ([b, s, h, d], far smaller
than the attention itself) where the layout differs, nothing where it does not.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .canonical import SDPA, meta
from .codegen.layouts import real
from .kernels import ops

# what the guard wraps: SDPA as dynamo records it, and the aten op a graph may call itself
GUARDED = SDPA | {torch.ops.aten.scaled_dot_product_attention.default}

REPORT_LINE = ("attention backward: each SDPA output's gradient is handed to SDPA's "
               "backward as dense [b, s, h, d], 16-byte aligned, re-laid where it is not "
               "(attention_grad_layout.py: PyTorch's cuDNN attention backward caches its "
               "graph without dO's strides; another layout under the same q, k, v gives "
               "wrong gradients)")


def canonical_grad(grad: torch.Tensor) -> torch.Tensor | None:
    """``grad`` re-laid as dense [b, s, h, d] (its [b, h, s, d] view), 16-byte aligned; None
    when it already is (autograd then keeps it as is). Strides of size-1 dims are not
    compared: no address depends on them."""
    if grad.dim() != 4:
        return None
    dense = grad.transpose(1, 2).is_contiguous()  # PyTorch's check skips size-1 dims
    aligned = grad.data_ptr() % 16 == 0 if real([grad]) else \
        grad.storage_offset() * grad.element_size() % 16 == 0  # traced: no pointer yet
    if dense and aligned:
        return None
    if real([grad]):
        ops.count("attention_grad_layout", "re-laid",
                  f"dO strides {tuple(grad.stride())} -> [b, s, h, d]")
    # a clone, not .contiguous(): a dense but misaligned gradient must move too
    return grad.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


def keep_grad_layout(out: torch.Tensor) -> torch.Tensor:
    """What the graph calls on an SDPA output: ``out`` itself, its gradient re-laid."""
    if out.requires_grad:
        out.register_hook(canonical_grad)
    return out


def at_risk(node: fx.Node) -> bool:
    """Whether an SDPA node's backward may run on cuDNN: its output (as dynamo traced it)
    4-D, on CUDA, in bf16 or fp16 and requiring grad. Unknown (no traced value): guarded;
    the hook checks requires_grad again."""
    out = meta(node)
    if out is None:
        return True
    return out.requires_grad and out.device.type == "cuda" and out.dim() == 4 and \
        out.dtype in (torch.bfloat16, torch.float16)


def guard(graph: fx.Graph) -> int:
    """Route each at-risk SDPA output through keep_grad_layout; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in GUARDED or not at_risk(node):
            continue
        users = list(node.users)
        with graph.inserting_after(node):
            kept = graph.call_function(keep_grad_layout, (node,))
        kept.meta.update(node.meta)
        for user in users:
            user.replace_input_with(node, kept)
        count += 1
    return count
