"""ops.fused_linear's calls in the model's shapes under hypothesis (kernels/ops._EdgeRoute):
random leading shapes, inputs and operands in other layouts (permuted, padded rows,
sliced at an offset, 16-byte aligned or not), calls of several classes interleaved and
repeated, a weight that requires grad, calls under inference_mode on its tensors. Every
call gives the reference's outputs, bit for bit (NaN where the reference has NaN: a
square root of a negative sum), in the model's shapes, whichever path served it, and a
class is served only by a launch made for it. Kernel routes are stubbed
(test_codegen._stub_launches: the reference behind a launch's interface), so the fast
paths run here as they do on the GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from coda_rewrite.codegen import layouts
from coda_rewrite.kernels import ops, quack_path

from test_codegen import _stub_launches, activations_and_two_tiles, rowscale_bias

bf = torch.bfloat16
K, N = 16, 12
PROGRAMS = {"two tiles, per-row in and out": activations_and_two_tiles().to_text(),
            "row scale, bias": rowscale_bias().to_text()}


def _launch_class(a, b, operands) -> tuple:
    """quack_path.metadata_key less the storage offsets: a launch reads a tensor's offset
    only through its data pointer, whose 16-byte alignment the key keeps (the fast
    paths' guard checks no offset: kernels/ops._last)."""
    def drop(key):  # an entry (shape, strides, offset, ...), or a list argument's entries
        return tuple(k if k is None else k[:2] + k[3:] if k and isinstance(k[0], torch.Size)
                     else drop(k) for k in key)
    return drop(quack_path.metadata_key(a, b, list(operands)))


class _StrictStub(quack_path.Launch):
    """A launch that runs the reference, and only on tensors of the metadata class it
    was prepared for (what a planned launch assumes of its caller)."""

    def __init__(self, ks, a, b, operands):
        self.ks, self.key, self.calls = ks, _launch_class(a, b, operands), 0

    def __call__(self, a, b, operands):
        key = _launch_class(a, b, operands)
        assert key == self.key, f"a launch for {self.key} served {key}"
        return ops._run_reference(self.ks.program, a, b, list(operands))


def _laid_out(shape, how: str, dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` with the given memory layout (values from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    if how == "permuted" and len(shape) >= 2:  # last dim not contiguous
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).to(dtype)
        return t.transpose(-1, -2)
    if how == "padded rows":  # a view whose flattening keeps the rows' padding
        t = torch.randn(*shape[:-1], shape[-1] + 8, generator=g).to(dtype)
        return t[..., :shape[-1]]
    if how in ("offset, aligned", "offset, 2 bytes"):
        n = 1
        for s in shape:
            n *= s
        skip = 8 if how == "offset, aligned" else 1  # 16 bytes of bf16, or 2
        flat = torch.randn(n + skip, generator=g).to(dtype)
        return flat[skip:].view(shape)
    return torch.randn(*shape, generator=g).to(dtype)


LAYOUTS = ["contiguous", "permuted", "padded rows", "offset, aligned", "offset, 2 bytes"]
call = st.fixed_dictionaries({
    "lead": st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
    "x": st.sampled_from(LAYOUTS),
    "tiles": st.sampled_from(LAYOUTS),
    "seed": st.integers(0, 2**16),
    "inference_mode": st.booleans(),  # its tensors made, and the call made, inside it
})


def _arguments(program: str, spec: dict, weight: torch.Tensor):
    lead = spec["lead"]
    x = _laid_out((*lead, K), spec["x"], bf, spec["seed"])
    if program == PROGRAMS["row scale, bias"]:
        rest = [_laid_out((*lead, 1), "contiguous", torch.float32, spec["seed"] + 1),
                _laid_out((N,), "contiguous", bf, spec["seed"] + 2)]
    else:
        rest = [_laid_out((*lead, 1), "contiguous", torch.float32, spec["seed"] + 1),
                _laid_out((*lead, N), spec["tiles"], bf, spec["seed"] + 2),
                _laid_out((*lead, N), spec["tiles"], bf, spec["seed"] + 3)]
    return x, weight, rest


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(PROGRAMS)), calls=st.lists(call, min_size=1, max_size=3),
       order=st.lists(st.integers(0, 2), min_size=2, max_size=8),
       weight_requires_grad=st.booleans(), grad_mode=st.booleans())
def test_calls_in_the_models_shapes_give_the_references_results(name, calls, order,
                                                                 weight_requires_grad,
                                                                 grad_mode):
    program = PROGRAMS[name]
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(7)).to(bf)
    weight.requires_grad_(weight_requires_grad)
    with pytest.MonkeyPatch.context() as mp:
        _stub_launches(mp)
        mp.setattr(quack_path, "prepare",
                   lambda ks, module, a, b, operands: _StrictStub(ks, a, b, operands))
        for i in [0, *order, 0]:
            spec = calls[i % len(calls)]
            inference = spec["inference_mode"]
            # (inference_mode(False) would switch grad mode on: PyTorch's semantics)
            mode = torch.inference_mode if inference else contextlib.nullcontext
            with mode():
                x, w, rest = _arguments(program, spec, weight)
            with torch.no_grad():
                want = layouts.fused_linear_reference(program, x, w, *rest)
            with torch.set_grad_enabled(grad_mode), mode():
                got = ops.fused_linear(program, x, w, *rest)
            assert len(got) == len(want)
            for g, e in zip(got, want):
                assert g.shape == e.shape, (spec, i)
                torch.testing.assert_close(g.detach(), e, rtol=0, atol=0, equal_nan=True)
                # autograd records the call exactly where it could ask for a gradient
                recorded = grad_mode and weight_requires_grad and not inference
                assert (g.grad_fn is not None) == recorded
