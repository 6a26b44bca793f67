"""Planted errors behind checks the suite once let through, and the named defaults, each against
a hand-worked value or an independent computation (issue 42's surviving mutants):

* the atlas's model-dtype pass compares the *readout* with the model (a readout error planted in
  that pass alone must fail ``model_dtype_vs_native`` and show in ``model_dtype_identity_rel``,
  while every float64 check still passes);
* ``scale.identity_check``'s relative errors divide by ``max|y|`` and ``max|y - mu|``
  respectively (checked against ``fast.step``'s own ``y`` and ``mu`` on data where the two
  differ by a factor > 2);
* ``lowrank.default_tol`` is 16 units of roundoff (``eps``, not ``finfo.resolution``);
* a Cosine-RoPE head's default temperature is ``sqrt(d)``;
* the report encoder keeps a float64 tensor's value (a kappa of 1e198 is not written as inf).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ropestep import fast, layercheck, lowrank, scale
from ropestep.spec import HeadSpec, HeadWeights
from ropestep.verdict import encode


def test_lowrank_default_tolerance_is_sixteen_units_of_roundoff():
    assert lowrank.default_tol(torch.float64) == 16 * 2.0 ** -52
    assert lowrank.default_tol(torch.float32) == 16 * 2.0 ** -23


def test_cosine_default_temperature_is_sqrt_d():
    spec = HeadSpec(n_heads=3, n_kv_heads=1, head_dim=64, family="cosine")
    assert spec.temperatures() == (8.0, 8.0, 8.0)
    assert spec.score_scale(2) == 0.125


def test_encoder_keeps_float64_tensors():
    t = torch.tensor([1e198, 1.0 / 3.0, -2.5e-310], dtype=torch.float64)
    assert encode(t) == [1e198, 1.0 / 3.0, -2.5e-310]
    assert encode(t[0]) == 1e198 and encode(np.float64(1e198)) == 1e198
    assert encode(torch.tensor(math.inf)) == "inf"


def _layer(seed: int = 0, N: int = 24, m: int = 16, H: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    spec = HeadSpec(n_heads=H, n_kv_heads=1, head_dim=d)
    w = HeadWeights(w_q=torch.randn(m, H, d, generator=g, dtype=torch.float64) * 0.6,
                    w_k=torch.randn(m, 1, d, generator=g, dtype=torch.float64) * 0.6,
                    # values with a large common offset: max|y| >> max|y - mu|
                    w_v=torch.randn(m, 1, d, generator=g, dtype=torch.float64),
                    b_v=torch.full((1, d), 40.0, dtype=torch.float64))
    x = torch.randn(N, m, generator=g, dtype=torch.float64)
    return spec, w, x


def test_identity_check_relative_errors_divide_by_their_own_scales():
    spec, w, x = _layer()
    res = scale.identity_check(spec, w, x, dtype=torch.float32)
    pos = np.arange(x.shape[0])
    st = fast.step(spec, w, x, pos, x, pos, "causal", dtype=torch.float64, keep=())
    for h in range(spec.n_heads):
        ymax = float(st.y[h].abs().max())
        dmax = float((st.y[h] - st.mu[h]).abs().max())
        assert ymax > 2 * dmax  # the two scales differ: a swapped divisor shows
        assert res.max_abs[h] > 0
        # the float32 y and mu the check divides by are within 1e-5 of the float64 ones
        assert res.max_rel[h] == pytest.approx(res.max_abs[h] / ymax, rel=1e-4)
        assert res.max_rel_dev[h] == pytest.approx(res.max_abs[h] / dmax, rel=1e-4)


def test_model_dtype_pass_compares_the_readout(monkeypatch):
    """A readout error planted in the model-dtype pass only: ``model_dtype_vs_native`` fails,
    ``model_dtype_identity_rel`` shows it, the float64 checks pass.  A model-dtype pass that
    compared ``y`` with the model, or wrote its identity error as 0, would not see it."""
    spec, w, x = _layer(1)
    pos = torch.arange(x.shape[0])
    st = fast.step(spec, w, x, pos, x, pos, "causal", dtype=torch.float64, keep=())
    native = st.y.transpose(0, 1).float()  # (N, H, r): a float32 "model" output
    clean = layercheck.evaluate_layer(spec, w, x, pos, native, lp_dtype=torch.float32,
                                 anchor_every=8)
    ok = layercheck.summarise_layer([clean], spec, x.shape[1], x.shape[0], torch.float32)
    assert ok["passed"]
    delta = 0.05
    real = scale.stream

    def planted(*a, **k):
        for ch in real(*a, **k):
            if k.get("dtype", torch.float64) == torch.float32:
                ch.readout_c = ch.readout_c + delta
            yield ch

    monkeypatch.setattr(scale, "stream", planted)
    res = layercheck.evaluate_layer(spec, w, x, pos, native, lp_dtype=torch.float32, anchor_every=8)
    out = layercheck.summarise_layer([res], spec, x.shape[1], x.shape[0], torch.float32)
    for h in out["heads"]:
        assert h["checks"]["model_dtype_vs_native"] is False
        assert all(v for k, v in h["checks"].items() if k != "model_dtype_vs_native"), h["checks"]
        assert h["model_dtype_identity_rel"] >= 0.9 * delta / h["value_scale"]
