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


def _load(monkeypatch, root, **kw):
    monkeypatch.setenv("ROPESTEP_CACHE", str(root))
    t0 = time.perf_counter()
    m, tok = models.load_model(models.locate_smollm2_gguf(), **kw)
    return m, tok, time.perf_counter() - t0


def test_the_cache_round_trip_is_the_same_model_and_the_ggufs_tokenizer(monkeypatch, tmp_path):
    """One de-quantisation, three loads.  The first (straight from the GGUF, weights only:
    ``tokenizer=False``) writes the cache, keyed by the file's sha256, without a tokenizer.  The
    second reads the weights from the cache and asks for the tokenizer: it must get the GGUF's
    own (it once got an empty one from the cache directory, which tokenised every text to no
    tokens), and the cache then keeps it; the third reads both from the cache.  The cached
    model is the first load's: every tensor equal, the same float64 forward within the bound
    of another summation order, and faster to load."""
    from transformers import AutoTokenizer

    gguf = models.locate_smollm2_gguf()
    m1, tok1, t1 = _load(monkeypatch, tmp_path, tokenizer=False)
    assert tok1 is None
    (cache,) = [p for p in (tmp_path / "gguf").iterdir() if p.is_dir()]  # (and its lock file)
    assert (cache / models.CACHE_MARKER).is_file()
    assert cache.name.startswith(sha256_file(gguf))
    assert not (cache / "tokenizer_config.json").exists()
    m2, tok2, t2 = _load(monkeypatch, tmp_path)
    assert (cache / "tokenizer_config.json").is_file()
    _, tok3, _ = _load(monkeypatch, tmp_path)
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)  # the GGUF's
    text = "def f(x):\n    return x + 1\n"
    want = ref(text)["input_ids"]
    assert len(want) > 5
    assert tok2(text)["input_ids"] == want and tok3(text)["input_ids"] == want
    print(f"first load {t1:.1f} s, cached load {t2:.1f} s")
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    ids = torch.tensor([want])
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


def test_a_missing_entry_is_built_by_one_process_at_a_time(tmp_path):
    """While one process holds a missing entry's lock (de-quantising), another process that
    loads the same file waits for it, and finds the entry complete when it gets the lock; a
    complete entry takes no lock at all."""
    import subprocess
    import sys

    from ropestep.models import loading

    entry = tmp_path / "gguf" / "0123-float32-tf"
    code = ("import sys, time; from pathlib import Path; from ropestep.models import loading; "
            "e = Path(sys.argv[1]); print('ready', flush=True); t = time.perf_counter()\n"
            "with loading._cache_lock(e): print(time.perf_counter() - t, "
            "(e / loading.CACHE_MARKER).is_file())")
    with loading._cache_lock(entry):
        p = subprocess.Popen([sys.executable, "-c", code, str(entry)], stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(3.0)  # the child is at the lock microseconds after "ready"
        entry.mkdir(parents=True)
        (entry / models.CACHE_MARKER).write_text("{}")
    waited, complete = p.communicate(timeout=60)[0].split()
    assert float(waited) >= 1.0 and complete == "True"
    with loading._cache_lock(entry):  # complete: no lock file is opened
        pass
