"""ropestep: exact gradient-step verification of RoPE-softmax attention.

The library's entry points are :func:`attach` (a loaded Hugging Face causal LM) and :func:`load`
(a hub id, directory or GGUF file): :mod:`ropestep.api`, imported on first use so that
``import ropestep`` stays light.
"""
__version__ = "0.1.0"

_API = ("attach", "load")


def __getattr__(name: str):
    if name in _API:  # by name: the package root itself imports nothing of its layers
        import importlib

        return getattr(importlib.import_module("ropestep.api"), name)
    raise AttributeError(f"module 'ropestep' has no attribute {name!r}")
