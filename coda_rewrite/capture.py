"""Capture: where the graphs come from, and how a node is named in the report.

The pass works on dynamo's FX graphs. ``optimize()`` and the ``"coda"`` backend both
capture through ``torch.compile``, so graph breaks, dynamic shapes, guards (train/eval,
grad mode, autocast, dtypes) and parameters-as-graph-inputs come from dynamo itself:
every call reads the live parameters, and nothing derived from a weight is kept between
calls.

Dynamo records, per node, the stack of modules it was called from; ``model_path`` turns
that into the dotted path a user knows (``model.layers.3.post_attention_layernorm``).
"""

from __future__ import annotations

import re

import torch.fx as fx

_SOURCE_PREFIX = re.compile(r"^L\['self'\]\.?|^L\['[^']*'\]\.?")
# a submodule reached through its module's dict rather than by attribute: peft's
# PeftModel and LoraModel forward to their wrapped model by __getattr__, which dynamo
# records as ``.__dict__['_modules']['base_model']``
_MODULE_ACCESS = re.compile(r"(?:\.__dict__\['_modules'\]|\._modules)\['([^']*)'\]")


def _clean(path: str) -> str:
    path = _SOURCE_PREFIX.sub("", _MODULE_ACCESS.sub(r".\1", path))
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("']", "")


def model_path(node: fx.Node | None) -> str:
    """Dotted module path of ``node`` ('' at the top level)."""
    if node is None:
        return ""
    if node.op == "placeholder":
        return placeholder_path(node)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _clean(path)


def placeholder_path(node: fx.Node) -> str:
    """``model.layers.0.input_layernorm.weight`` for a parameter input, else its name."""
    name = node.target if isinstance(node.target, str) else node.name
    m = re.match(r"^[Ll]_self_(.*?)_?$", name)
    if not m:
        return re.sub(r"^[Ll]_(.*?)_?$", r"\1", name)
    inner = "_" + m.group(1) + "_"
    if inner.startswith("_dict_modules_"):  # a forwarding wrapper's (_MODULE_ACCESS), whose
        # inner wrappers forward alike; elsewhere "_dict_" may end a module's own name
        inner = inner.replace("_dict_modules_", "_modules_")
    return re.sub(r"_(modules|parameters|buffers)_", ".", inner) \
        .strip("._").replace("modules_", "")


def describe(node: fx.Node) -> str:
    """``node_name (model.path)`` for the report."""
    path = model_path(node)
    return f"{node.name} ({path})" if path else node.name
