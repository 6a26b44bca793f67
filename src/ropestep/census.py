"""The census: every text causal-LM model type of the installed transformers, as a tiny model.

Where :mod:`ropestep.archzoo` lists hand-made configurations of 28 architectures, the census
enumerates what transformers itself ships: every model type of its causal-LM auto mapping
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), so that a new release's architectures are covered the
day it is installed.  For each type :func:`entry` decides what is built:

* a **text model** -- the type's own configuration class;
* a **multimodal** type (its configuration holds a ``text_config``) -- its text model: when the
  text configuration's own type is in the mapping the entry is a *duplicate* of that type
  (counted once, there); otherwise the mapped class is built on the text configuration alone.

:func:`tiny_config` builds the configuration from the class's own defaults, shrunk: every size
field the class has among :data:`SIZES` (through its ``attribute_map``: GPT-J's ``n_embd`` is
``hidden_size``) is set to the tiny value, the depth is the fewest layers (at least
:data:`MIN_LAYERS`) whose ``layer_types`` still hold every kind of layer the default depth
holds (a hybrid keeps its softmax layers: Qwen3-Next's one in four), per-layer lists are cut to
that depth, and token ids are moved into the tiny vocabulary.  Where a default cannot be shrunk
that way, :data:`OVERRIDES` holds the few keyword arguments that make it buildable, each with
its reason.  A configuration or model transformers refuses to build is *not buildable*, with
transformers' own error (:class:`NotBuildable`).

:func:`build` makes the seeded model (eager attention, float32, eval mode) and redraws its
attention weights as :func:`ropestep.archzoo.redraw` does, so that scores are far from uniform.

Torch and transformers are imported inside the functions.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from . import archzoo

MIN_LAYERS = 2
MAX_LAYERS = 12  # a layer pattern longer than this is cut (its kinds are then checked)

# Standard sizes of a tiny model (hidden 128, 4 heads of 32 on 2 KV heads, byte vocabulary),
# and the sizes of the other mixers and experts a type may have; each is set only where the
# configuration class has the field (directly or through its attribute_map).
SIZES: dict[str, Any] = {
    "vocab_size": archzoo.VOCAB, "hidden_size": archzoo.HIDDEN, "intermediate_size": 256,
    "num_attention_heads": archzoo.HEADS, "num_key_value_heads": archzoo.KV_HEADS,
    "head_dim": archzoo.HEAD_DIM, "max_position_embeddings": 1024,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "output_router_logits": False,
    # multi-head latent attention
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    # linear attention (Qwen3-Next, Kimi-Linear, ...)
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    # state-space mixers (Mamba 2 blocks of Bamba, Falcon-H1, Granite 4, Zamba, ...)
    "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_expand": 2, "mamba_d_state": 16,
    "mamba_n_groups": 1, "mamba_chunk_size": 16, "ssm_state_size": 16, "mamba_d_ssm": 256,
    # per-layer input embeddings (Gemma 3n, Gemma 4)
    "vocab_size_per_layer_input": archzoo.VOCAB, "hidden_size_per_layer_input": 16,
    # partial rotary given in dimensions (GPT-J, CodeGen): half of head_dim
    "rotary_dim": archzoo.HEAD_DIM // 2,
}

UNSET = object()  # an override value: leave the keyword out (the class's default stands)

# model_type -> (keyword arguments, why the shrunk defaults alone do not build)
OVERRIDES: dict[str, tuple[dict, str]] = {
    "bamba": ({"attn_layer_indices": [1]},
              "the default names no attention layer (attn_layer_indices None): layer 1 is one"),
    "granitemoehybrid": ({"layer_types": ["linear_attention", "full_attention"]},
                         "the default's layers are all Mamba (layer_types all linear_attention): "
                         "layer 1 is attention"),
    "lfm2": ({"layer_types": ["conv", "full_attention"]},
             "the default is attention in every layer; the published LFM2 models interleave "
             "short convolutions: layer 0 is one"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"]},
                 "the default leaves layer_types None, which the model indexes per layer"),
    "dbrx": ({"attn_config": {"rope_theta": 10_000.0, "kv_n_heads": archzoo.KV_HEADS,
                              "clip_qkv": 8.0}},
             "the default attn_config names no rope_theta, which the model reads (transformers' "
             "default does not build): base 1e4 given, and DBRX's clip_qkv at 8"),
    "llama4_text": ({"attention_chunk_size": 16, "floor_scale": 8},
                    "the default chunk of 8192 positions is longer than any census context: 16 "
                    "cuts the reading forward and the 40-token runs of its chunked layers; the "
                    "NoPE layers' query temperature, 1 below floor_scale - 1 = 8191 by default, "
                    "acts from position 7 with floor_scale 8"),
    "dots3_note_text": ({"num_key_value_heads": archzoo.HEADS},
                        "its validator requires one KV head per query head"),
}


class NotBuildable(RuntimeError):
    """transformers refused to build the tiny configuration or model; its own error, one line."""


@dataclass(frozen=True)
class Entry:
    """One model type of the causal-LM mapping and what the census builds for it."""

    model_type: str
    causal_class: str  # the mapping's class name
    text_type: str  # the configuration type that is built (the type itself for text models)
    duplicate_of: str | None = None  # a multimodal type whose text model is another entry

    @property
    def multimodal(self) -> bool:
        return self.text_type != self.model_type


def causal_types() -> dict[str, str]:
    """``{model_type: causal-LM class name}`` of the installed transformers, sorted by type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def entry(model_type: str) -> Entry:
    """What the census builds for ``model_type`` (see the module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    types = causal_types()
    if model_type not in types:
        raise KeyError(f"{model_type}: not a causal-LM model type of this transformers")
    cls = CONFIG_MAPPING[model_type]
    text = _text_type(cls)
    if text is None or text == model_type:
        return Entry(model_type, types[model_type], model_type)
    dup = text if text in types and CONFIG_MAPPING[text] is not cls else None
    return Entry(model_type, types[model_type], text, dup)


def _text_type(cls: Any) -> str | None:
    """The model type of a multimodal configuration's ``text_config`` (None: not multimodal)."""
    sub = getattr(cls, "sub_configs", None) or {}
    if "text_config" not in sub:
        return None
    t = getattr(sub["text_config"], "model_type", None)
    if t:
        return str(t)
    try:  # an AutoConfig slot: the default text configuration says its type
        tc = cls().text_config
    except Exception:  # noqa: BLE001 - a default that cannot be built: not multimodal-resolved
        return None
    return None if tc is None else str(getattr(tc, "model_type", None) or "") or None


def _fields(cls: Any) -> dict[str, Any]:
    """The configuration class's own fields (dataclass fields, or ``__init__`` parameters)."""
    try:
        return {f.name: f for f in dataclasses.fields(cls)}
    except TypeError:
        return {k: p for k, p in inspect.signature(cls.__init__).parameters.items()
                if k not in ("self", "kwargs")}


def _own_name(cls: Any, fields: dict, name: str) -> str | None:
    """The field that holds the standard attribute ``name`` (attribute_map), or None."""
    if name in fields:
        return name
    own = (getattr(cls, "attribute_map", None) or {}).get(name)
    return own if own in fields else None


def _allows_none(field: Any) -> bool:
    t = getattr(field, "type", None)
    return t is None or "None" in str(t) or "Optional" in str(t)


def _default(field: Any) -> Any:
    if isinstance(field, dataclasses.Field):
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            return field.default_factory()  # type: ignore[misc]
        return None
    d = getattr(field, "default", None)
    return None if d is inspect.Parameter.empty else d


def _depth(default_types: list | None, n_default: int) -> tuple[int, list | None]:
    """The tiny depth and its layer types: the shortest prefix (at least MIN_LAYERS) of the
    default pattern that holds every kind of layer the default depth holds."""
    if not default_types:
        return MIN_LAYERS, None
    kinds = set(default_types)
    for L in range(MIN_LAYERS, min(len(default_types), MAX_LAYERS) + 1):
        if set(default_types[:L]) == kinds:
            return L, list(default_types[:L])
    # the pattern's kinds do not all appear early: take the first layer of each kind, in order
    picked = sorted({default_types.index(k) for k in kinds})
    types = [default_types[i] for i in picked]
    while len(types) < MIN_LAYERS:
        types.append(types[-1])
    return len(types), types


def _shrunk(cls: Any, depth: bool) -> dict[str, Any]:
    """Keyword arguments that shrink configuration class ``cls``: the :data:`SIZES` it has, the
    depth (with ``depth``: :func:`_depth` of the default ``layer_types``; otherwise
    MIN_LAYERS), per-layer lists cut to it, token ids in the byte vocabulary, and every
    sub-configuration (other than a text configuration, which is built on its own) shrunk the
    same way."""
    fields = _fields(cls)
    kw: dict[str, Any] = {}
    for name, value in SIZES.items():
        own = _own_name(cls, fields, name)
        if own is not None:
            kw[own] = value
    if "qk_rope_head_dim" in fields:  # latent attention: its head_dim is the rotated part's
        kw.pop("head_dim", None)      # width, which the class derives (DeepSeek-V3), and
        own = _own_name(cls, fields, "num_key_value_heads")  # every head has its own keys
        if own is not None:
            kw[own] = SIZES["num_attention_heads"]
    nl = _own_name(cls, fields, "num_hidden_layers")
    try:
        base = cls()
    except Exception as err:  # noqa: BLE001 - transformers' own refusal of its defaults
        raise NotBuildable(f"the default configuration does not build: {_one_line(err)}") \
            from None
    try:
        n_default = int(getattr(base, "num_hidden_layers", 0) or 0)
    except Exception:  # noqa: BLE001 - a class that refuses the attribute (encoder-decoder)
        n_default = 0
    default_types = getattr(base, "layer_types", None)
    default_types = list(default_types) if isinstance(default_types, (list, tuple)) else None
    L, types = _depth(default_types if depth else None, n_default)
    if nl is not None:
        kw[nl] = L
    if types is not None and "layer_types" in fields:
        kw["layer_types"] = types
    for name in fields:  # per-layer lists of the default depth, cut to the tiny depth
        if name in kw or name == "layer_types":
            continue
        v = getattr(base, name, None)
        if isinstance(v, (list, tuple)) and n_default and len(v) == n_default and n_default != L:
            kw[name] = list(v[:L])
    for name, f in fields.items():  # token ids inside the byte vocabulary
        if not (name.endswith("_token_id") or name.endswith("_token_index")):
            continue
        v = getattr(base, name, None)
        if name in ("bos_token_id", "eos_token_id", "pad_token_id") and _allows_none(f):
            kw[name] = None
        elif isinstance(v, int) and v >= archzoo.VOCAB:
            kw[name] = archzoo.VOCAB - 1 - (sum(map(ord, name)) % 16)
        elif isinstance(v, list) and any(isinstance(x, int) and x >= archzoo.VOCAB for x in v):
            kw[name] = [archzoo.VOCAB - 1]
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if name == "text_config" or not isinstance(sub, type) or name not in fields:
            continue
        if getattr(sub, "model_type", None) in (None, ""):  # an AutoConfig slot
            continue
        try:
            kw[name] = _shrunk(sub, depth=False)
        except NotBuildable:
            continue  # its defaults are left to the outer class
    return kw


def tiny_config(model_type: str) -> Any:
    """The shrunk configuration the census builds for ``model_type`` (module docstring);
    raises :class:`NotBuildable` with transformers' error when it cannot be built."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    ent = entry(model_type)
    cls = CONFIG_MAPPING[ent.text_type]
    kw = _shrunk(cls, depth=True)
    over = OVERRIDES.get(model_type, ({}, ""))[0]
    for k, v in copy.deepcopy(over).items():
        if v is UNSET:
            kw.pop(k, None)
        else:
            kw[k] = v
    try:
        return cls(**kw)
    except Exception as err:  # noqa: BLE001 - transformers' own validation
        raise NotBuildable(_one_line(err)) from None


MAX_PARAMETERS = 20_000_000  # a tiny model is ~0.3-2 M; above this a default was not shrunk


def build(model_type: str, seed: int = 0, dtype: Any = None) -> Any:
    """The seeded tiny ``*ForCausalLM`` of ``model_type`` (eval mode, eager attention, scores far
    from uniform: :func:`ropestep.archzoo.redraw`); :class:`NotBuildable` with transformers'
    error when it cannot be built."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    ent = entry(model_type)
    config = tiny_config(model_type)
    make = (getattr(transformers, ent.causal_class)._from_config
            if ent.duplicate_of is None and ent.multimodal else AutoModelForCausalLM.from_config)
    try:
        with torch.device("meta"):  # count first: a default the census did not shrink
            n = sum(p.numel() for p in make(config, attn_implementation="eager").parameters())
    except Exception as err:  # noqa: BLE001 - transformers' own refusal
        raise NotBuildable(_one_line(err)) from None
    if n > MAX_PARAMETERS:
        raise NotBuildable(f"the tiny configuration still has {n:,} parameters (a size of this "
                           "type the census does not shrink: add it to ropestep.census.OVERRIDES)")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make(config, attn_implementation="eager", dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - transformers' own refusal
        raise NotBuildable(_one_line(err)) from None
    model.eval()
    archzoo.redraw(model, config, seed)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    return model


def has_rotary(model: Any) -> bool:
    """True when some module of the model is a rotary embedding (class name holds ``Rotary``)."""
    return any("Rotary" in type(m).__name__ for m in model.modules())


def save(model_type: str, directory: Any, seed: int = 0) -> Any:
    """:func:`build` saved with the byte tokenizer (:func:`ropestep.archzoo.save_model`)."""
    return archzoo.save_model(build(model_type, seed), directory)
