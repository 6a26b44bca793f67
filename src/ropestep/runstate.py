"""Run plumbing: progress that reaches a log (:class:`Progress`), and a run directory that
outlives its process -- finished work items, kept as they complete, so that a killed run can be
resumed (``--run-dir``, ``--resume`` of ``ropestep atlas``).

A run directory holds ``run.json`` -- the run's *fingerprint*: its schema, the full configuration
and the model's provenance with the sha256 of its files -- and one pair of files per finished
work item: ``<key>.npz`` (the item's float64 arrays, bit for bit) and ``<key>.json`` (its other
values), the JSON written last.  Both are written under a temporary name and renamed into place
(``os.replace`` is atomic on POSIX), so a process killed at any instant leaves each item either
complete or absent: an item counts as done when its JSON exists and its arrays load.

:func:`open_run` starts a fresh run (any earlier items in the directory are removed) or, with
``resume=True``, continues one: a directory whose fingerprint differs from the new run's is
refused with one line naming the first field that differs (:class:`RunStateError`, exit 2 at
the command line), and no item of another configuration or model is ever read.

Numbers only round-trip exactly: ``.npz`` stores the float64 arrays as they are and the JSON
side holds strings, integers and lists of those (floats there must go through the arrays).
Imports nothing of ropestep (the bottom layer of the import contract).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "run.json"
_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")


class RunStateError(ValueError):
    """A run directory that cannot serve this run (another configuration or model, not a run
    directory, unreadable): one line, exit 2."""


def _atomic_write(path: Path, write) -> None:
    """``write(file_object)`` into a temporary sibling, flushed to disk, then renamed to ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _canonical(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """The first path where two JSON trees differ, with both values (for the refusal's line)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b or _canonical(a[k]) != _canonical(b[k]):
                if k in a and k in b:
                    return _first_difference(a[k], b[k], f"{path}.{k}" if path else k)
                return f"{path}.{k}" if path else k
    return f"{path or 'fingerprint'}: {_canonical(a)[:80]} in the run directory, now {_canonical(b)[:80]}"


@dataclass
class RunDir:
    """An open run directory (see the module docstring)."""

    path: Path
    fingerprint: dict
    resumed: bool

    def _check_key(self, key: str) -> None:
        if not _KEY.match(key):
            raise ValueError(f"item key {key!r}: letters, digits, '_', '.', '-' only")

    def save(self, key: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Keep one finished item: its float64 (or integer) arrays and its JSON values."""
        self._check_key(key)
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        _atomic_write(self.path / f"{key}.npz", lambda f: np.savez(f, **arrays))
        text = _canonical({"key": key, "arrays": sorted(arrays), "meta": meta}).encode()
        _atomic_write(self.path / f"{key}.json", lambda f: f.write(text))

    def load(self, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
        """A finished item's ``(arrays, meta)``, or None when it is not (completely) there."""
        self._check_key(key)
        js, npz = self.path / f"{key}.json", self.path / f"{key}.npz"
        if not js.exists():
            return None
        try:
            rec = json.loads(js.read_text())
            with np.load(npz, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as err:
            raise RunStateError(f"run directory {self.path}: item {key} is unreadable ({err}); "
                                "start without --resume") from None
        if sorted(arrays) != rec.get("arrays"):
            raise RunStateError(f"run directory {self.path}: item {key}'s arrays do not match "
                                "its record; start without --resume")
        return arrays, rec["meta"]

    def save_tree(self, key: str, tree: Any, classes: dict[str, type] | None = None) -> None:
        """Keep one finished item that is a tree of dicts, lists, tuples, numbers, strings,
        arrays, tensors and the dataclasses of ``classes`` (:func:`encode_tree`)."""
        meta, arrays = encode_tree(tree, classes or {})
        self.save(key, arrays, {"tree": meta})

    def load_tree(self, key: str, classes: dict[str, type] | None = None) -> Any:
        """A tree :meth:`save_tree` kept, equal to the one saved (None when not there)."""
        got = self.load(key)
        return None if got is None else decode_tree(got[1]["tree"], got[0], classes or {})

    def done(self) -> list[str]:
        """Keys of the items whose record is there (sorted)."""
        return sorted(p.stem for p in self.path.glob("*.json") if p.name != MANIFEST)

    def remove(self) -> None:
        """Delete the run directory (after the final report is published)."""
        shutil.rmtree(self.path, ignore_errors=True)


def encode_tree(tree: Any, classes: dict[str, type]) -> tuple[Any, dict[str, np.ndarray]]:
    """``(JSON tree, arrays)`` that :func:`decode_tree` turns back into ``tree`` exactly: every
    node carries its type (dict keys of any JSON-able type, tuples apart from lists, floats as
    their ``repr`` -- NaN, infinities and -0.0 kept -- numpy scalars with their dtype), arrays
    and tensors go to ``arrays`` bit for bit (a tensor keeps its dtype, on the CPU), and a
    dataclass instance of ``classes`` (name -> class) by its fields."""
    import dataclasses

    arrays: dict[str, np.ndarray] = {}

    def enc(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, np.generic):  # before float and int: np.float64 is a float
            return {"np": x.dtype.str, "value": enc(x.item())}
        if isinstance(x, int):
            return {"int": str(int(x))}
        if isinstance(x, float):
            return {"float": float.__repr__(x)}
        if isinstance(x, np.ndarray):
            k = f"a{len(arrays)}"
            arrays[k] = x
            return {"ndarray": k}
        if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
            k = f"a{len(arrays)}"
            t = x.detach().cpu()
            dt = str(t.dtype).replace("torch.", "")
            arrays[k] = (t.view(torch_int16()) if dt == "bfloat16" else t).numpy()
            return {"tensor": k, "dtype": dt}
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [enc(v) for v in x]}
        if isinstance(x, dict):
            return {"dict": [[enc(k), enc(v)] for k, v in x.items()]}
        if dataclasses.is_dataclass(x) and type(x).__name__ in classes:
            return {"dataclass": type(x).__name__,
                    "fields": {f.name: enc(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        raise TypeError(f"cannot keep a {type(x).__name__} in a run directory")

    return enc(tree), arrays


def torch_int16() -> Any:
    import torch

    return torch.int16


def decode_tree(meta: Any, arrays: dict[str, np.ndarray], classes: dict[str, type]) -> Any:
    """The inverse of :func:`encode_tree`."""
    def dec(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if "int" in x:
            return int(x["int"])
        if "float" in x:
            return float(x["float"])
        if "np" in x:
            return np.dtype(x["np"]).type(dec(x["value"]))
        if "ndarray" in x:
            return arrays[x["ndarray"]]
        if "tensor" in x:
            import torch

            t = torch.from_numpy(np.array(arrays[x["tensor"]]))
            return t.view(torch.bfloat16) if x["dtype"] == "bfloat16" else t
        if "list" in x:
            return [dec(v) for v in x["list"]]
        if "tuple" in x:
            return tuple(dec(v) for v in x["tuple"])
        if "dict" in x:
            return {dec(k): dec(v) for k, v in x["dict"]}
        if "dataclass" in x:
            return classes[x["dataclass"]](**{k: dec(v) for k, v in x["fields"].items()})
        raise ValueError(f"not a kept tree node: {str(x)[:80]}")

    return dec(meta)


def open_run(path: str | Path, fingerprint: dict, *, resume: bool) -> RunDir:
    """Open ``path`` for a run with this ``fingerprint`` (a JSON-ready dict).

    Fresh (``resume=False``): the directory is created, or emptied of an earlier run's items.
    ``resume=True``: the directory must hold a run with an equal fingerprint (else
    :class:`RunStateError`); a missing directory starts fresh (nothing was done yet)."""
    path = Path(path)
    try:
        _canonical(fingerprint)
    except (TypeError, ValueError) as err:
        raise ValueError(f"a run's fingerprint must be finite JSON: {err}") from None
    if path.exists() and not path.is_dir():
        raise RunStateError(f"--run-dir {path}: exists and is not a directory")
    man = path / MANIFEST
    if resume and man.exists():
        try:
            old = json.loads(man.read_text())
        except (OSError, ValueError) as err:
            raise RunStateError(f"run directory {path}: {MANIFEST} is unreadable ({err})") from None
        if _canonical(old) != _canonical(fingerprint):
            raise RunStateError(f"--resume: run directory {path} belongs to another run "
                                f"(differs at {_first_difference(old, fingerprint)}); start "
                                "without --resume or choose another --run-dir")
        return RunDir(path, fingerprint, resumed=True)
    if path.exists():
        if any(path.iterdir()) and not man.exists():
            raise RunStateError(f"--run-dir {path}: not empty and not a run directory (no "
                                f"{MANIFEST}); refusing to clear it")
        for p in path.iterdir():  # an earlier run's items: this run starts over
            if p.is_file() and (p.suffix in (".npz", ".json", ".tmp")):
                p.unlink()
    path.mkdir(parents=True, exist_ok=True)
    text = _canonical(fingerprint).encode()
    _atomic_write(man, lambda f: f.write(text))
    return RunDir(path, fingerprint, resumed=False)


class Progress:
    """Progress over the work items: a tqdm bar on a terminal; off a terminal (CI, batch jobs,
    ``nohup``) one line per finished item on stderr, with the elapsed time and an estimate of
    what remains (the mean time per item computed so far, times the items left).  Disabled
    (``--quiet``, ranks other than 0): nothing."""

    def __init__(self, total: int, enabled: bool, desc: str, stream: Any = None,
                 unit: str = "item"):
        self.total, self.desc, self.count, self.skip, self.unit = total, desc, 0, 0, unit
        self.stream = sys.stderr if stream is None else stream
        self.t0 = time.perf_counter()
        self.bar = None
        self.lines = False
        if not enabled:
            return
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                                dynamic_ncols=True, leave=False)
                return
            except ImportError:  # pragma: no cover - tqdm is in the model extra
                pass
        self.lines = True

    def skipped(self, n: int) -> None:
        """``n`` items read back from a run directory (counted done, not timed)."""
        self.skip += n
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines and n:
            self.stream.write(f"{self.desc}: {n} of {self.total} {self.unit}s read back from "
                              "the run directory\n")
            self.stream.flush()

    def __call__(self, **where: Any) -> None:
        """One more item done; ``where`` names it (``context=c, layer=L``)."""
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(**where)
        elif self.lines:
            el = time.perf_counter() - self.t0
            computed = self.count - self.skip
            left = el / computed * (self.total - self.count)
            name = " ".join(f"{k} {v}" for k, v in where.items())
            self.stream.write(f"{self.desc}: {name} done ({self.count}/{self.total}), "
                              f"{el:.1f} s elapsed, ~{left:.0f} s left\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB: the kernel's high-water mark of the current
    address space (``VmHWM`` of ``/proc/self/status``), which starts afresh at ``exec``.
    ``getrusage``'s ``ru_maxrss`` does not: Linux carries it over from the parent across fork and
    exec, so a run started from a large process (a test worker, a notebook) would report that
    process's peak as its own.  ``ru_maxrss`` is the fallback where ``/proc`` is absent."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def open_run_on_ranks(path: str | Path, fingerprint: dict, *, resume: bool, rank: int,
                      world: int, broadcast: Any) -> RunDir:
    """:func:`open_run` under torchrun: rank 0 first (it starts the directory afresh or checks
    the fingerprint), then the others join the run it opened.  ``broadcast(obj, rank, world)``
    hands rank 0's outcome to every rank (:func:`ropestep.dist.broadcast_from_rank0`), so that
    a refusal is raised on every rank alike (:class:`RunStateError`)."""
    err, state = None, None
    if rank == 0:
        try:
            state = open_run(path, fingerprint, resume=resume)
        except RunStateError as e:
            err = str(e)
    err = broadcast(err, rank, world)
    if err is not None:
        raise RunStateError(err)
    return state if rank == 0 else open_run(path, fingerprint, resume=True)

