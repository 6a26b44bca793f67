"""The adapter's two one-line errors, and the guard that turns anything else raised while a
model is read into the second."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class ModelLoadError(RuntimeError):
    """A model could not be loaded (hub unreachable, unknown id, missing path); one-line message."""


class UnsupportedModelError(ValueError):
    """The model uses an attention convention the exact layer does not model; one-line message."""


class CaptureError(RuntimeError):
    """A capture's own guard: a layer's attention did not run as the reading says it does."""


@contextmanager
def adapter_errors(who: str, doing: str) -> Iterator[None]:
    """``with adapter_errors(name, "reading layer 3 (FooAttention)"):`` -- an exception raised
    inside (a module that breaks an assumption of the adapter: a norm without a weight, an
    attribute that is not where transformers usually keeps it) becomes one
    :class:`UnsupportedModelError` line naming the model, what was being done and the original
    error, so that a command refuses the model (exit 2) instead of printing a traceback.  The
    adapter's own errors, and ``KeyboardInterrupt``/``MemoryError``, pass unchanged."""
    try:
        yield
    except (UnsupportedModelError, ModelLoadError, CaptureError, KeyboardInterrupt, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - every other failure is a refusal, named
        text = " ".join(str(err).split())[:240] or "(no message)"
        raise UnsupportedModelError(
            f"{who}: {doing} failed: {type(err).__name__}: {text}") from err
