"""One layer's attention as the model computes it, on any input and positions, for the checks.

:func:`run_attention` calls the layer's own attention module on given head inputs ``x`` at given
positions -- its own projections, norms, rotation with its own rotary call's tables, and eager
attention under a causal (or windowed) mask -- and returns what :mod:`ropestep.models.probe`
recorded: the rotated queries and keys, the values and the output.  :func:`layer_parts` gives
the layer's reading and its projections; :func:`rotate_as_model` and :func:`pair_sum` apply the
layer's rotation (its pairing, rotary width and amplitude) to any tensor in the model's
head-dim order, for float64 recompositions and rounding bounds.
"""
from __future__ import annotations

from typing import Any

import torch

from .conventions import (LayerConventions, ModelInfo, _layout_tables, _partner, _per_pair,
                          _perm, _permitted_sets, _rotate, check_layer_index, describe_model,
                          layer_tables)
from .layouts import candidates as layout_candidates
from .errors import adapter_errors
from .probe import AttentionRecord, recording
from .structure import attention_module, layer_modules, offloaded, onloaded, output_projection


def layer_parts(model: Any, layer: int, info: ModelInfo | None = None
                ) -> tuple[ModelInfo, LayerConventions, Any, dict, Any]:
    """``(info, conventions, attention module, {"q"|"k"|"v": (W, b)}, output projection)``."""
    info = info if info is not None and info.layers else describe_model(model)
    check_layer_index(info, layer)
    info = info.for_layer(layer)
    conv = info.layers[layer]
    attn = attention_module(layer_modules(model)[layer], info.name, layer)
    if offloaded(attn):  # copies, read in through the offload hook (accelerate)
        with onloaded(attn):
            parts = {k: tuple(None if t is None else t.detach().clone() for t in wb)
                     for k, wb in layout_candidates(attn, info.n_heads, info.n_kv_heads,
                                                    info.head_dim, info.r)[
                                                        conv.layout].items()}
    else:
        parts = layout_candidates(attn, info.n_heads, info.n_kv_heads, info.head_dim,
                                  info.r)[conv.layout]
    return info, conv, attn, parts, output_projection(attn, info.name, layer)[1]


def per_pair_tables(model: Any, conv: LayerConventions, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, R/2)`` model tables at ``positions``, one angle per rotated pair (amplitude in)."""
    c, s = layer_tables(model, conv, positions)
    return _per_pair(c, conv.tables), _per_pair(s, conv.tables)


def rotate_as_model(z: torch.Tensor, cos_pp: torch.Tensor, sin_pp: torch.Tensor,
                    conv: LayerConventions) -> torch.Tensor:
    """Rotate ``z (..., n, d)`` (model head-dim order) as the layer does, with per-pair tables
    ``(n, R/2)`` (amplitude included)."""
    if conv.rotary_dim == 0:
        return z
    return _rotate(z, _layout_tables(cos_pp, conv.pairing),
                   _layout_tables(sin_pp * conv.sign, conv.pairing), conv.pairing)


def pair_sum(A: torch.Tensor, conv: LayerConventions) -> torch.Tensor:
    """``A_c + A_c'`` with ``c'`` the coordinate the layer rotates together with ``c``."""
    return _partner(A, conv.rotary_dim, conv.pairing)


def handed_tables(cos: torch.Tensor, sin: torch.Tensor, order: str) -> Any:
    """Tables ``(n, w)`` as the layer's attention takes its ``position_embeddings`` (a batch of
    one): ``(cos, sin)``, ``(sin, cos)`` or one complex tensor ``cos + i sin``."""
    if order == "complex":
        return torch.complex(cos, sin)[None]
    if order == "sin_cos":
        return sin[None], cos[None]
    return cos[None], sin[None]


def head_order(conv: LayerConventions, d: int) -> torch.Tensor:
    """The permutation from the model's head-dim order to ropestep's (``layer_head``)."""
    return _perm(conv, d)


def run_attention(model: Any, layer: int, x: torch.Tensor, positions: torch.Tensor,
                  info: ModelInfo | None = None) -> AttentionRecord:
    """The layer's attention module on ``x (n, m)`` (model dtype and device) at ``positions``,
    causal by sequence index (and the layer's window), recorded."""
    info, conv, attn, _, _ = layer_parts(model, layer, info)
    n = x.shape[0]
    pos = positions.reshape(-1).long()
    # a layer that does not rotate is still handed tables by its model (any rotated layer's),
    # unless the model hands it none (order "none")
    pe = None
    if conv.order != "none":
        rot = conv if conv.rotary else next((c for c in info.conventions() if c.rotary), None)
        if rot is None:
            raise RuntimeError(f"{info.name}: no layer rotates, so no RoPE tables to hand layer "
                               f"{layer}")
        pe = handed_tables(*layer_tables(model, rot, pos), conv.order)
    ok = _permitted_sets(n, conv.window, conv.chunk)
    mask = torch.zeros(n, n, dtype=x.dtype).masked_fill(~ok, torch.finfo(x.dtype).min)
    with recording(model, [layer]) as rec, torch.no_grad(), \
            adapter_errors(info.name, f"running layer {layer}'s {type(attn).__name__}"):
        attn(hidden_states=x[None], position_embeddings=pe,
             attention_mask=mask[None, None].to(x.device), position_ids=pos[None].to(x.device),
             **dict(conv.call_args))
    if len(rec[layer]) != 1 or rec[layer][0].query is None:
        raise RuntimeError(f"{info.name}: layer {layer}'s attention did not run once")
    return rec[layer][0]
