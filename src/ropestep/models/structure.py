"""Where a causal LM keeps its decoder layers, attention modules, output projections and rotary
modules -- found by walking the modules, not from a per-architecture table.

* the decoder stack is ``model.base_model`` (transformers' own pointer: ``model.model`` for
  Llama-likes, ``model.gpt_neox`` for GPT-NeoX) and its layers are the one ``nn.ModuleList`` of
  decoder layers it holds (``layers``, ``h`` or ``blocks``);
* a layer's attention is its one outermost descendant whose class name ends in ``Attention``
  (hybrid models have layers with none: linear attention, convolutions, state-space mixers --
  which of the others compute softmax attention is read from a forward, in
  :mod:`ropestep.models.conventions`);
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

OUTPUT_NAMES = ("o_proj", "dense", "out_proj", "c_proj", "Wo")


def model_name(model_or_config: Any, name: str | None = None) -> str:
    if name:
        return name
    config = getattr(model_or_config, "config", model_or_config)
    return str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
               or getattr(config, "model_type", "model"))


def _has_layers(base: Any) -> bool:
    return base is not None and layer_list(base) is not None


def decoder(model: Any) -> Any:
    """The decoder stack of a ``*ForCausalLM`` (or the bare model): ``model.base_model`` (or
    ``model.model``, where ``base_model`` names an attribute the class does not have, as
    Llama 4's text model does), the first of them that holds a list of decoder layers."""
    for base in (getattr(model, "base_model", None), getattr(model, "model", None), model):
        if _has_layers(base):
            return base
    base = getattr(model, "base_model", None) or model
    raise UnsupportedModelError(
        f"{model_name(model)}: no decoder layers found (expected one ModuleList of decoder "
        f"layers `layers`, `h` or `blocks` on {type(base).__name__})")


LAYER_LISTS = ("layers", "h", "blocks")


def layer_list(base: Any) -> Any:
    import torch.nn as nn

    for nm in LAYER_LISTS:
        ls = getattr(base, nm, None)
        if isinstance(ls, nn.ModuleList) and len(ls):
            return ls
    return None


def layer_modules(model: Any) -> Any:
    return layer_list(decoder(model))


def is_attention(module: Any) -> bool:
    """An attention module: a class name ending in ``Attention`` (transformers' convention)."""
    return type(module).__name__.endswith("Attention")


def attention_modules(layer: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of a decoder layer's outermost attention modules: every descendant
    whose class name ends in ``Attention`` and that does not sit inside another one (a layer
    may nest its attention one level down, as DBRX's ``norm_attn_norm.attn`` does)."""
    found: list[tuple[str, Any]] = []
    inside: set[int] = set()
    for name, mod in layer.named_modules():
        if mod is layer or id(mod) in inside:
            continue
        if is_attention(mod):
            found.append((name, mod))
            inside.update(id(m) for m in mod.modules())
    return found


def attention_module(layer: Any, who: str, L: int) -> Any:
    """The one attention module of a decoder layer (:func:`attention_modules`)."""
    found = attention_modules(layer)
    if len(found) != 1:
        kids = [f"{n} ({type(c).__name__})" for n, c in layer.named_children()]
        what = ("no attention module: not an attention layer" if not found else
                f"{len(found)} attention modules {[n for n, _ in found]}; expected exactly one")
        raise UnsupportedModelError(f"{who}: layer {L} has {what} (children: {', '.join(kids)})")
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
