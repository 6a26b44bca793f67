"""The de-quantised GGUF cache: a second load reads safetensors keyed by the file's sha256.

The cached model must be the same model: every tensor of the state dict equal, the same
config, the same tokenizer ids, the same forward output.  The cache can be switched off, and a
cache that cannot be written never breaks a load.
"""
from __future__ import annotations

import time

import pytest
import torch

from ropestep import models
from ropestep import tolerances as tl
from ropestep.provenance import sha256_file

pytestmark = pytest.mark.model


def same_model_tol(model, n_tokens: int) -> float:
    """Two float64 forwards of the same weights whose matmuls may sum in other orders, relative
    to the logits' max: the cached model's weights are memory-mapped at other alignments than
    the de-quantised ones, and a BLAS may pick its code path by alignment (MKL does outside its
    CNR mode).  Per residual block the whole-layer agreement bound, the MLP's GEMMs adding
    ``m + I`` terms; the logits one block more (the ``m``-term output head) -- as
    tests/models/test_adapter.py's ``forward_tol``."""
    info = models.describe_model(model)
    inter = int(model.config.intermediate_size)
    return (info.n_layers + 1) * tl.agreement_rel_tol(torch.float64, n_tokens, info.head_dim,
                                                      info.hidden + inter)


def _load(monkeypatch, root, **env):
    monkeypatch.setenv("ROPESTEP_CACHE", str(root))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.perf_counter()
    m, tok = models.load_model(models.locate_smollm2_gguf())
    return m, tok, time.perf_counter() - t0


def test_second_load_reads_the_cache_and_is_the_same_model(monkeypatch, tmp_path):
    m1, tok1, t1 = _load(monkeypatch, tmp_path)
    dirs = list((tmp_path / "gguf").iterdir())
    assert len(dirs) == 1 and (dirs[0] / models.CACHE_MARKER).is_file()
    sha = sha256_file(models.locate_smollm2_gguf())
    assert dirs[0].name.startswith(sha)
    m2, tok2, t2 = _load(monkeypatch, tmp_path)
    print(f"first load {t1:.1f} s, cached load {t2:.1f} s")
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    text = "def f(x):\n    return x + 1\n"
    assert tok1(text)["input_ids"] == tok2(text)["input_ids"]
    ids = torch.tensor([tok1(text)["input_ids"]])
    with torch.no_grad():  # in float64: the tolerance is then far below any change of model
        l1, l2 = m1.double()(ids).logits, m2.double()(ids).logits
    err = float((l1 - l2).abs().max() / l1.abs().max())
    print("cached vs first load, logits:", err, "tolerance", same_model_tol(m1, ids.shape[1]))
    assert err <= same_model_tol(m1, ids.shape[1])
    assert t2 < t1


def test_cache_can_be_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv("ROPESTEP_CACHE", str(tmp_path))
    assert models.gguf_cache_root() == tmp_path / "gguf"
    monkeypatch.setenv("ROPESTEP_GGUF_CACHE", "0")
    assert models.gguf_cache_root() is None
    assert models.gguf_cache_dir(models.locate_smollm2_gguf(), torch.float32) is None


def test_a_cache_written_without_the_tokenizer_still_gives_the_ggufs_tokenizer(monkeypatch,
                                                                               tmp_path):
    """A first load with ``tokenizer=False`` caches the weights only; a later load that asks for
    the tokenizer must get the GGUF's own (it used to get an empty one from the cache directory,
    which tokenised every text to no tokens), and the cache then keeps it."""
    monkeypatch.setenv("ROPESTEP_CACHE", str(tmp_path))
    gguf = models.locate_smollm2_gguf()
    models.load_model(gguf, tokenizer=False)
    (cache,) = list((tmp_path / "gguf").iterdir())
    assert not (cache / "tokenizer_config.json").exists()
    _, tok = models.load_model(gguf)
    monkeypatch.setenv("ROPESTEP_GGUF_CACHE", "0")
    _, ref = models.load_model(gguf)  # straight from the GGUF
    text = "def f(x):\n    return x + 1\n"
    assert len(ref(text)["input_ids"]) > 5
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert (cache / "tokenizer_config.json").is_file()
