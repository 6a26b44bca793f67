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


def model_files(source: str | Path, gguf: str | None = None) -> dict:
    """The files a model was loaded from, by name and sha256 (never by path): a ``.gguf`` file,
    a directory's ``gguf`` file, or a directory's weights (``*.safetensors``/``*.bin``) and
    ``config.json``.  A hub id (no local path) gives empty entries."""
    out: dict = {"gguf_file": None, "gguf_sha256": None, "weights_sha256": {}}
    p = Path(source).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        out["gguf_file"], out["gguf_sha256"] = p.name, sha256_file(p)
    elif p.is_dir():
        if gguf is not None:
            out["gguf_file"], out["gguf_sha256"] = gguf, sha256_file(p / gguf)
        else:
            for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")):
                out["weights_sha256"][f.name] = sha256_file(f)
            if (p / "config.json").is_file():
                out["config_sha256"] = sha256_file(p / "config.json")
    return out
