"""The adapter's two one-line errors."""
from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be loaded (hub unreachable, unknown id, missing path); one-line message."""


class UnsupportedModelError(ValueError):
    """The model uses an attention convention the exact layer does not model; one-line message."""
