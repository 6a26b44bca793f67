"""Committed reports name models and files by file name and sha256, never by an absolute path
of the machine that ran them (validation/, benchmarks/, mutation/)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ropestep.provenance import portable_command, portable_config, portable_name

ROOT = Path(__file__).resolve().parents[1]
ABSOLUTE = re.compile(r"(?<![\w.])(/tmp/|/home/|/root/|/work/|/Users/|site-packages/|[A-Z]:\\\\)")


def absolute_paths(text: str) -> list[str]:
    return [m.group(0) for m in ABSOLUTE.finditer(text)]


@pytest.mark.parametrize("folder", ["validation", "benchmarks", "mutation"])
def test_committed_reports_carry_no_absolute_paths(folder):
    bad = []
    for p in sorted((ROOT / folder).rglob("*")):
        if p.suffix in (".json", ".md", ".txt") and p.is_file():
            hits = absolute_paths(p.read_text(errors="replace"))
            if hits:
                bad.append(f"{p.relative_to(ROOT)}: {sorted(set(hits))}")
    assert not bad, "\n".join(bad)


def test_the_scan_can_fail():
    assert absolute_paths('"source": "/root/.cache/x.gguf"') == ["/root/"]
    assert absolute_paths("see validation/smollm2/report.md") == []


def test_portable_names(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_text("x")
    assert portable_name(str(f)) == "model.gguf"
    assert portable_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id stays
    assert portable_name("smollm2") == "smollm2"
    assert portable_command(["ropestep", "atlas", "--model", str(f)]) == \
        ["ropestep", "atlas", "--model", "model.gguf"]
    assert portable_config({"model": str(f), "seed": 1}) == {"model": "model.gguf", "seed": 1}
