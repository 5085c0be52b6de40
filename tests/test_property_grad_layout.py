"""An adversary for attention_grad_layout.canonical_grad: hypothesis draws [b, h, s, d]
gradients in every layout (any dim order, padded rows, any storage offset, size-1 dims).
(Apart from tests/test_attention_grad_layout.py, whose model the GPU tests import: the
GPU image has no hypothesis.)"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda_rewrite import attention_grad_layout as guard


def _any_layout(shape, order, pad, offset):
    """A [b, h, s, d] tensor whose memory runs in ``order`` (a permutation of its dims,
    outermost first), each row padded by ``pad`` elements, starting ``offset`` elements
    into its storage."""
    inner = [shape[i] for i in order]
    inner[-1] += pad
    flat = torch.randn(offset + int(torch.tensor(inner).prod()))
    base = flat[offset:].view(inner)[..., :shape[order[-1]]]
    return base.permute([order.index(i) for i in range(4)])


@settings(max_examples=200, deadline=None)
@given(shape=st.tuples(*[st.integers(1, 5)] * 4), order=st.permutations(range(4)),
       pad=st.integers(0, 3), offset=st.integers(0, 9))
def test_canonical_grad_on_any_layout(shape, order, pad, offset):
    """Whatever the layout (any dim order, padded rows, any storage offset, size-1 dims),
    the result holds the same values, dense [b, s, h, d] and 16-byte aligned; and it is
    left as is (None) exactly when it already was."""
    grad = _any_layout(shape, order, pad, offset)
    assert tuple(grad.shape) == shape
    out = guard.canonical_grad(grad)
    b, h, s, d = shape
    want = (s * h * d, d, h * d, 1)

    def canonical(t):
        return all(n == 1 or st_ == w for st_, w, n in zip(t.stride(), want, t.shape)) and \
            t.data_ptr() % 16 == 0
    if out is None:
        assert canonical(grad)
    else:
        assert not canonical(grad) and canonical(out) and torch.equal(out, grad)
