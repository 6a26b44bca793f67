"""Provenance: content hashes of the files a run reads (model weights, GGUF files, corpora).

Reports name files by their file name and sha256, never by an absolute path of the machine
that ran them.  Imports nothing of ropestep.
"""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (corpus and model provenance)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def portable_name(source: str | Path | None) -> str | None:
    """How a report names a model or file: a local path becomes its file (or directory) name,
    a hub id or alias stays as it is -- never an absolute path of the machine that ran it."""
    if source is None:
        return None
    s = str(source)
    p = Path(s).expanduser()
    if s.startswith(("/", "./", "../", "~")) or p.exists():
        return p.name or s
    return s


def portable_command(argv: list[str] | tuple[str, ...] | None) -> list[str] | None:
    """A recorded command line with every absolute or home-relative path replaced by its name."""
    if argv is None:
        return None
    return [portable_name(a) if str(a).startswith(("/", "~")) else str(a) for a in argv]


def portable_config(cfg: dict, keys: tuple[str, ...] = ("model", "corpus", "gguf")) -> dict:
    """A recorded configuration with the path-valued ``keys`` reduced to names."""
    out = dict(cfg)
    for k in keys:
        if k in out and out[k] is not None:
            out[k] = portable_name(out[k])
    return out
