"""Verdicts that are never silent: reductions that keep NaN and inf, pass predicates that a NaN
fails, failure lines, exit codes, and JSON that keeps non-finite floats.

Python's builtin ``max``/``min`` drop a NaN depending on the order of their arguments
(``max(0.0, nan) == 0.0`` but ``max(nan, 0.0)`` is nan), and ``not err > tol`` is True for a NaN
error.  Every reduction of an error in ``ropestep`` goes through :func:`worst` / :func:`least`
(NaN if any entry is NaN, else the ordinary max/min, so ``inf`` stays ``inf``), and every pass
predicate through :func:`within` (``err <= tol``: False for NaN, False for ``inf`` unless the
tolerance itself is ``inf``).

JSON has no NaN: :func:`dumps` writes non-finite floats as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (strict JSON, ``allow_nan=False``); :func:`loads` / :func:`decode` turn those strings
back into floats, except under keys that hold text (:data:`TEXT_KEYS` and keys ending in
``_text``: a decoded token may well be the word "nan").

Exit codes of the commands (:data:`EXIT_PASS`, :data:`EXIT_FAIL`, :data:`EXIT_INPUT`): 0 when
every check passed, 1 when a check failed (each failure printed on its own line on stderr by
:func:`print_failures`), 2 on bad input (one line on stderr, no traceback).

:class:`OneLineParser` is the commands' argparse parser: a usage error is one line on stderr and
exit status 2.  This module imports nothing from ``ropestep``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterable, TextIO

import numpy as np

EXIT_PASS, EXIT_FAIL, EXIT_INPUT = 0, 1, 2

NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
TEXT_KEYS = frozenset({"command", "error", "rule", "argument", "source", "name", "model"})

_MISSING = object()


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------
def _array(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):  # torch tensor (any dtype, any device)
        v = v.detach().to("cpu").double().numpy()
    if v is None:
        raise TypeError("a None value in an error reduction (an error that was never computed)")
    return np.asarray(v, dtype=np.float64).ravel()


def _entries(values: Any) -> np.ndarray:
    if isinstance(values, (int, float, np.number, np.ndarray)) or hasattr(values, "detach"):
        return _array(values)
    parts = [_array(v) for v in values]
    return np.concatenate(parts) if parts else np.zeros(0)


def worst(values: Any, default: Any = _MISSING) -> float:
    """Largest entry of ``values`` (numbers, arrays, tensors, or an iterable of them), NaN if
    any entry is NaN; ``inf`` propagates.  ``default`` is returned for no entries at all (else
    ``ValueError``).  A ``None`` entry raises ``TypeError``: an error that was never computed
    cannot pass."""
    a = _entries(values)
    if a.size == 0:
        if default is _MISSING:
            raise ValueError("worst() of no values")
        return default
    return float(np.max(a))  # numpy's max propagates NaN


def least(values: Any, default: Any = _MISSING) -> float:
    """Smallest entry, NaN if any entry is NaN (the counterpart of :func:`worst`)."""
    a = _entries(values)
    if a.size == 0:
        if default is _MISSING:
            raise ValueError("least() of no values")
        return default
    return float(np.min(a))


def finite(values: Any) -> bool:
    """True when every entry is finite (no NaN, no +-inf)."""
    return bool(np.isfinite(_entries(values)).all())


def within(err: Any, tol: float) -> bool:
    """The pass predicate ``err <= tol`` for every entry of ``err``: False for NaN (any NaN
    comparison is False) and for an infinite error under a finite tolerance."""
    a = _entries(err)
    return bool(a.size > 0 and np.all(a <= tol))


# ---------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------
def nonfinite_name(x: float) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a non-finite float, else None."""
    v = float(x)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return None


def num(x: Any, spec: str = ".3g") -> str:
    """A number for a message: non-finite as ``nan``/``inf``/``-inf``, never blank."""
    if x is None:
        return "none"
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    v = float(x)
    return nonfinite_name(v) or format(v, spec)


@dataclass
class Failure:
    """One failed check: ``where`` (e.g. ``layer 23 context 4 head 7``), the check's name, the
    value that failed and the tolerance it was held to (None for a count or a flag)."""

    where: str
    check: str
    value: Any = None
    tol: Any = None
    detail: str = ""

    def line(self) -> str:
        s = f"FAIL {self.where}: {self.check}"
        if self.value is not None:
            s += f" = {num(self.value)}"
        if self.tol is not None:
            s += f" (tolerance {num(self.tol)})"
        if self.detail:
            s += f" [{self.detail}]"
        return s

    def as_dict(self) -> dict:
        return asdict(self)


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status :data:`EXIT_INPUT`."""

    def error(self, message: str) -> None:  # type: ignore[override]
        one = " ".join(message.split())
        sys.stderr.write(f"{self.prog}: error: {one} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_INPUT)


def input_error(prog: str, err: BaseException) -> int:
    """Bad input, said in one line on stderr (``<prog>: error: <message>``, whitespace folded,
    the exception's type when it has no message); returns :data:`EXIT_INPUT`.  Every command's
    handler reports its input errors through this."""
    msg = " ".join(str(err).split()) or type(err).__name__
    sys.stderr.write(f"{prog}: error: {msg}\n")
    return EXIT_INPUT


def output_and_threads_problem(out: Any, threads: int | None) -> ValueError | None:
    """The input checks every report command shares, before any work: ``--out`` names a
    directory or nothing yet, ``--threads`` (None: not given) is at least 1.  Returns the error
    to report (:func:`input_error`), or None."""
    from pathlib import Path

    if Path(out).exists() and not Path(out).is_dir():
        return FileExistsError(f"--out {str(out)!r} exists and is not a directory")
    if threads is not None and threads < 1:
        return ValueError(f"--threads must be >= 1, got {threads}")
    return None


def device_problem(device: Any) -> str | None:
    """What is wrong with a ``--device`` argument, or None: it must be ``cpu``, ``cuda`` or
    ``cuda:N``, and CUDA must then be available.  Each command raises it as its own input error."""
    dev = str(device)
    if not (dev in ("cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        return f"--device must be 'cpu' or 'cuda[:N]', got {dev!r}"
    if dev.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return "--device cuda requested but no CUDA device is available"
    return None


def module_main(command: str, doc: str | None, add_arguments: Any, main_args: Any,
                argv: Iterable[str] | None = None) -> int:
    """``python -m ropestep.<module> ...`` for a subcommand module: parse ``argv`` (default
    ``sys.argv[1:]``) with its ``add_arguments`` under ``prog = "ropestep <command>"`` and hand
    the result to its ``main_args(args, [command, *argv])``; ``--help`` exits 0, a usage error 2
    (one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = OneLineParser(prog=f"ropestep {command}", description=(doc or "").split("\n")[0])
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    return main_args(args, [command, *argv])


def exit_code(failures: Iterable[Any]) -> int:
    """:data:`EXIT_FAIL` when there is any failure, else :data:`EXIT_PASS`."""
    return EXIT_FAIL if any(True for _ in failures) else EXIT_PASS


def print_failures(prog: str, failures: Iterable[Any], stream: TextIO | None = None,
                   limit: int | None = None) -> None:
    """One line per failure on ``stream`` (stderr): ``PROG: FAIL where: check = value ...``.

    Entries are :class:`Failure` objects or their dicts.  ``limit`` caps the lines (the rest is
    counted on one more line)."""
    out = sys.stderr if stream is None else stream
    fl = [f if isinstance(f, Failure) else Failure(**f) for f in failures]
    shown = fl if limit is None else fl[:limit]
    for f in shown:
        out.write(f"{prog}: {f.line()}\n")
    if len(shown) < len(fl):
        out.write(f"{prog}: ... and {len(fl) - len(shown)} more failed checks\n")
    out.flush()


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------
def encode(x: Any) -> Any:
    """JSON-ready copy: numpy/torch scalars and arrays to Python, non-finite floats to the
    strings ``"nan"``/``"inf"``/``"-inf"``, tuples to lists, keys to strings."""
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return encode(x.tolist())
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return nonfinite_name(v) or v
    return x


def decode(x: Any, _key: str | None = None) -> Any:
    """Inverse of :func:`encode` for non-finite floats: ``"nan"``/``"inf"``/``"-inf"`` back to
    floats, except under text keys (:data:`TEXT_KEYS`, ``*_text``)."""
    if isinstance(x, dict):
        return {k: decode(v, k) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v, _key) for v in x]
    if isinstance(x, str) and x in NONFINITE:
        if _key is not None and (_key in TEXT_KEYS or _key.endswith("_text")):
            return x  # text that happens to spell "nan"
        return NONFINITE[x]
    return x


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (``allow_nan=False``) of :func:`encode` ``(obj)``."""
    kw.setdefault("allow_nan", False)
    return json.dumps(encode(obj), **kw)


def loads(text: str) -> Any:
    """:func:`decode` ``(json.loads(text))``."""
    return decode(json.loads(text))


def leaf_differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every leaf where two JSON-like trees differ, as ``"path: a != b"`` (empty when they are
    equal): dict keys and list lengths must match, numbers compare exactly (bitwise for floats,
    NaN equal to NaN) -- the test that a command's report is the library's numbers.

    >>> leaf_differences({"x": [1.0, float("nan")]}, {"x": [1.0, float("nan")]})
    []
    >>> leaf_differences({"x": [1.0, 2.0]}, {"x": [1.0, 2.5], "y": 0})
    ['/: keys differ: only in the second: y']
    >>> leaf_differences({"x": [1.0, 2.0]}, {"x": [1.0, 2.5]})
    ['/x/1: 2.0 != 2.5']
    """
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            only_a, only_b = sorted(set(a) - set(b), key=str), sorted(set(b) - set(a), key=str)
            what = "; ".join(s for s in (
                only_a and "only in the first: " + ", ".join(map(str, only_a)),
                only_b and "only in the second: " + ", ".join(map(str, only_b))) if s)
            return [f"{where or '/'}: keys differ: {what}"]
        return [d for k in a for d in leaf_differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where or '/'}: lengths differ: {len(a)} != {len(b)}"]
        return [d for k, (x, y) in enumerate(zip(a, b)) for d in leaf_differences(x, y,
                                                                                f"{where}/{k}")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                       and not isinstance(a, bool) and not isinstance(b, bool)):
        return [f"{where or '/'}: {a!r} != {b!r} (types {type(a).__name__}, {type(b).__name__})"]
    return [] if a == b else [f"{where or '/'}: {a!r} != {b!r}"]
