"""Model adapter: Hugging Face causal LMs in, head descriptions and captured activations out.

The only part of :mod:`ropestep` that touches ``transformers`` (imported lazily, inside
functions, so ``import ropestep`` stays light).  One concern per file:

* :mod:`~ropestep.models.loading` -- :func:`load_model` (hub id, local directory, ``.gguf``
  file; float32, eager attention, TF32 off; one-line :class:`ModelLoadError`);
* :mod:`~ropestep.models.structure` -- where the decoder layers, attention modules, output
  projections and rotary modules are, found by walking the modules;
* :mod:`~ropestep.models.probe` -- the model's own intermediate tensors of attention (rotated
  queries and keys, values, mask, score arguments, output), recorded during a forward;
* :mod:`~ropestep.models.layouts` -- the projection layouts (separate, fused, per-head fused):
  the one convention a module's attributes do not state;
* :mod:`~ropestep.models.conventions` -- :func:`describe_model` reads every layer's conventions
  from those tensors and checks the reading against them; :func:`layer_head` converts a layer
  to the math layout of :mod:`ropestep.spec` with the model's own RoPE tables;
* :mod:`~ropestep.models.capture` -- :func:`capture`, :func:`capture_continuations`,
  :func:`capture_block`: the head inputs, per-head outputs and output projections of chosen
  layers, with a guard that every hook fired.

* :mod:`~ropestep.models.attention` -- one layer's attention module run on given inputs and
  positions, and the layer's rotation, for the checks of :mod:`ropestep.realchecks`.

What the exact layer does not model is refused with one :class:`UnsupportedModelError` line.
Imports inside the package run one way, errors -> structure -> probe / layouts -> conventions
-> loading / attention -> capture (an import-linter layers contract in pyproject.toml).
"""
from __future__ import annotations

from . import attention  # noqa: F401  (models.attention: the layer run for the checks)
from .capture import (BlockCapture, ContinuationCapture, LayerCapture, capture, capture_block,
                      capture_continuations, top_candidates)
from .conventions import (LayerConventions, ModelInfo, OutputGate, check_config,
                          check_layer_index, describe_model, layer_gate, layer_head, rope_tables)
from .errors import CaptureError, ModelLoadError, UnsupportedModelError
from .loading import (CACHE_MARKER, SMOLLM2_DISTRIBUTION, SMOLLM2_GGUF, SMOLLM2_PACKAGE,
                      add_model_arguments, add_placement_arguments, disable_tf32,
                      gguf_cache_dir, gguf_cache_root, load_model, locate_smollm2_gguf,
                      meta_model, placement, placement_record, read_config)

__all__ = [
    "BlockCapture", "CACHE_MARKER", "CaptureError", "ContinuationCapture", "LayerCapture", "LayerConventions",
    "ModelInfo", "ModelLoadError", "OutputGate", "SMOLLM2_DISTRIBUTION", "SMOLLM2_GGUF", "SMOLLM2_PACKAGE",
    "UnsupportedModelError", "add_model_arguments", "add_placement_arguments", "capture",
    "capture_block",
    "capture_continuations", "check_config", "check_layer_index", "describe_model",
    "disable_tf32", "gguf_cache_dir", "gguf_cache_root", "layer_gate", "layer_head", "load_model",
    "locate_smollm2_gguf", "meta_model", "placement", "placement_record", "read_config", "rope_tables", "top_candidates",
]
