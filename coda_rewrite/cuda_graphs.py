"""CUDA graphs without Inductor (optimize(cudagraphs=True)): the rewritten graph through
AOTAutograd, replayed from PyTorch's cudagraph trees, its parameters and buffers static.

Dynamo's own "cudagraphs" backend does this, but counts as static (at a fixed address,
never copied) only the inputs AOTAutograd lifts: the parameters of modules dynamo did
not inline. Dynamo inlines nn.Modules by default (torch >= 2.5), so every parameter
reaches AOTAutograd as a plain graph input, and the trees copy each one into the graph's
own buffer before every replay: the 4-layer Llama at dim 2048 (41 parameters and
buffers, ~0.4 GB) replayed at 2 × 64 tokens in 1.34–1.36 ms, torch.compile's CUDA graphs
in 0.45 (H100, BENCHMARKS.md, forty-first session). Inductor reads the static inputs
from AOTAutograd's metadata instead (``compile_fx.get_static_input_idxs``: parameters
and buffers; the trees record again should one of them move), and so does this backend.
Everything else is dynamo's backend: the same checks that leave a graph unrecorded
(an input mutated, a CPU tensor, an op that cannot be captured; logged and counted as
the trees count their skips) and the same handling of the backward.
"""

from __future__ import annotations

import functools
import warnings

import torch


def cudagraphs(gm: torch.fx.GraphModule, example_inputs):
    """A compiled callable for ``gm`` that replays from cudagraph trees (a dynamo backend).
    A torch without the pieces this is built from gets dynamo's backend as it is (the
    same values; every weight copied per replay), with a warning that says so."""
    from torch._dynamo.backends import cudagraphs as dynamo
    try:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._inductor.compile_fx import get_static_input_idxs
        from torch._inductor.cudagraph_trees import cudagraphify_impl, get_manager
        from torch._inductor.cudagraph_utils import (get_placeholder_info,
                                                     log_cudagraph_skip_and_bump_counter)
        from torch._inductor.utils import count_tangents, num_fw_fixed_arguments
        checks = (dynamo.check_for_skip, dynamo.get_device_index, dynamo.get_stack_traces,
                  dynamo.find_input_mutations)
    except (ImportError, AttributeError) as e:
        warnings.warn(f"coda_rewrite: cudagraphs=True without Inductor falls back to "
                      f"dynamo's cudagraphs backend, which copies every parameter into "
                      f"the graph before each replay (this torch lacks {e.name or e}); "
                      f"inductor=True avoids it", stacklevel=2)
        return dynamo.cudagraphs(gm, example_inputs)
    check_for_skip, device_of, stack_traces, input_mutations = checks

    recorded = {"forward": True, "device": None}  # the forward's choice, for its backward

    def replayed(aot_model, aot_inputs, static, backward: bool, inference: bool):
        out = cudagraphify_impl(
            boxed_nop(aot_model, aot_inputs), aot_inputs, static,
            device_index=device_of(aot_model), is_backward=backward, is_inference=inference,
            stack_traces=stack_traces(aot_model),
            placeholders=get_placeholder_info(aot_model.graph),
            mutated_input_idxs=input_mutations(aot_model.graph))
        out._boxed_call = True
        return out

    def forward(aot_model, aot_inputs, is_inference: bool = False):
        fixed = num_fw_fixed_arguments(len(example_inputs), len(aot_inputs))
        skip = check_for_skip(aot_model, fixed)
        if skip:
            recorded["forward"] = False
            log_cudagraph_skip_and_bump_counter(f"skipping cudagraphs due to {skip}")
            return boxed_nop(aot_model, aot_inputs)
        recorded["device"] = device_of(aot_model)
        # where dynamo's backend passes range(fixed): the parameters and buffers
        return replayed(aot_model, aot_inputs, get_static_input_idxs(fixed), False,
                        is_inference)

    def backward(aot_model, aot_inputs):
        if not recorded["forward"]:
            return aot_model
        fixed = count_tangents(aot_model)  # the saved activations: the trees' own memory
        skip = check_for_skip(aot_model, fixed)
        if skip:  # the tree must be told its backward runs outside it
            log_cudagraph_skip_and_bump_counter(f"skipping cudagraphs due to {skip}")
            manager = get_manager(recorded["device"] or 0, create_if_none_exists=False)
            if manager is None:
                raise AssertionError("cudagraph manager must exist for backward")

            def run(inputs):
                manager.set_to_running_backward()
                return aot_model(inputs)
            run._boxed_call = True
            return run
        return replayed(aot_model, aot_inputs, range(fixed), True, False)

    return aot_autograd(
        fw_compiler=forward, bw_compiler=backward,
        inference_compiler=functools.partial(forward, is_inference=True),
        keep_inference_input_mutations=torch._dynamo.config.cudagraph_backend_keep_input_mutation,
    )(gm, example_inputs)
