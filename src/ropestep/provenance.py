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
