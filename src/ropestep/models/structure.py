"""Where a causal LM keeps its decoder layers, attention modules, output projections and rotary
modules -- found by walking the modules, not from a per-architecture table.

* the decoder stack is ``model.base_model`` (transformers' own pointer: ``model.model`` for
  Llama-likes, ``model.gpt_neox`` for GPT-NeoX) and its layers are the one ``nn.ModuleList`` of
  decoder layers it holds (``layers`` or ``h``);
* a layer's attention is its one child whose class name ends in ``Attention``;
* the output projection is the attention's ``nn.Linear`` that maps heads to the hidden size and
  is not an input projection (``o_proj``, ``dense``): found as the one linear child whose input
  dimension is the heads' and that is applied *after* the scores (checked by the capture, whose
  hook on it must fire with the eager function's output);
* rotary modules are the decoder's children with a class name containing ``Rotary``
  (``rotary_emb``; Gemma 3 and others keep a second, local one).
"""
from __future__ import annotations

from typing import Any

from .errors import UnsupportedModelError

OUTPUT_NAMES = ("o_proj", "dense", "out_proj", "c_proj")


def model_name(model_or_config: Any, name: str | None = None) -> str:
    if name:
        return name
    config = getattr(model_or_config, "config", model_or_config)
    return str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
               or getattr(config, "model_type", "model"))


def decoder(model: Any) -> Any:
    """The decoder stack of a ``*ForCausalLM`` (or the bare model)."""
    base = getattr(model, "base_model", None) or getattr(model, "model", None) or model
    if layer_list(base) is None:
        raise UnsupportedModelError(
            f"{model_name(model)}: no decoder layers found (expected a ModuleList `layers` or "
            f"`h` on {type(base).__name__})")
    return base


def layer_list(base: Any) -> Any:
    import torch.nn as nn

    for nm in ("layers", "h"):
        ls = getattr(base, nm, None)
        if isinstance(ls, nn.ModuleList) and len(ls):
            return ls
    return None


def layer_modules(model: Any) -> Any:
    return layer_list(decoder(model))


def attention_module(layer: Any, who: str, L: int) -> Any:
    """The one child of a decoder layer whose class name ends in ``Attention``."""
    found = [(n, c) for n, c in layer.named_children() if type(c).__name__.endswith("Attention")]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{who}: layer {L} has {len(found)} attention children "
            f"({[n for n, _ in found]}); expected exactly one")
    return found[0][1]


def output_projection(attn: Any, who: str, L: int) -> tuple[str, Any]:
    """``(name, module)`` of the attention's output projection."""
    import torch.nn as nn

    found = [(n, getattr(attn, n)) for n in OUTPUT_NAMES
             if isinstance(getattr(attn, n, None), nn.Linear)]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{who}: layer {L} attention {type(attn).__name__} has no single output projection "
            f"among {OUTPUT_NAMES} (found {[n for n, _ in found]})")
    return found[0]


def rotary_modules(model: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of the decoder's rotary embeddings (in definition order)."""
    base = decoder(model)
    return [(n, c) for n, c in base.named_children() if "Rotary" in type(c).__name__]


def offloaded(module: Any) -> bool:
    """True when some parameter of ``module`` (or of a child) lives off the module, offloaded by
    accelerate's big-model inference (``device_map`` with ``max_memory``: on the ``meta`` device,
    its data in a CPU or disk weights map, brought in by a hook only for the forward)."""
    return any(getattr(getattr(m, "_hf_hook", None), "offload", False) for m in module.modules())


class onloaded:
    """``with onloaded(module):`` every offloaded parameter of ``module`` and its children is
    brought in (accelerate's ``align_module_device``: the same hook the forward uses) and put
    back afterwards, so a layer's weights are read as the model holds them -- and held only for
    that layer.  A module without offloaded parameters is left as it is."""

    def __init__(self, module: Any):
        self.module = module
        self.stack = None

    def __enter__(self) -> Any:
        import contextlib

        self.stack = contextlib.ExitStack()
        if offloaded(self.module):
            from accelerate.utils import align_module_device

            for m in self.module.modules():
                if getattr(getattr(m, "_hf_hook", None), "offload", False):
                    self.stack.enter_context(align_module_device(m))
        return self.module

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()
