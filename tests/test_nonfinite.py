"""Nothing silent in the fast layer: a NaN or inf anywhere is a failure with a message, never a 0.

The review that opened this file found the streamed path reporting ``max_abs = 0`` for a layer
whose original-gauge coefficients had overflowed (``max(0.0, nan)`` is ``0.0``).  Here non-finite
values are injected into each path -- through the inputs, through scores that overflow the
gauge, and through a corrupted intermediate -- and each must raise or report ``nan``/``inf``.
(The protocol's and the sweep's verdicts are covered in ``tests/test_verdicts.py``.)
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ropestep import fast, kernel, lowrank, scale
from ropestep import tolerances as tl
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec


def negative_layer(score: float, N: int = 12, d: int = 4):
    """One head whose every score is ``score`` up to a relative 1e-3 (RoPE's slowest pair only).

    ``q`` and ``k`` point along dim 1, which pairs with dim 3 (half layout) at frequency
    ``1e6^(-1/2) = 1e-3``: over N positions the relative rotation changes the score by < 1e-3.
    """
    m = 2
    spec = HeadSpec(1, 1, d, rope=RoPESpec(base=1e6))
    w_q = torch.zeros(m, 1, d, dtype=torch.float64)
    w_k = torch.zeros(m, 1, d, dtype=torch.float64)
    w_v = torch.randn(m, 1, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = math.sqrt(abs(score) * math.sqrt(d))
    b_q = torch.zeros(1, d, dtype=torch.float64)
    b_k = torch.zeros(1, d, dtype=torch.float64)
    b_q[0, 1], b_k[0, 1] = a, -a if score < 0 else a
    w = HeadWeights(w_q, w_k, w_v, b_q, b_k, None)
    x = torch.randn(N, m, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return spec, w, x


def test_the_layer_has_the_scores_it_claims():
    spec, w, x = negative_layer(-636.0)
    st = fast.step(spec, w, x, np.arange(12), x, np.arange(12), gauge="maxkey")
    s = st.s[0][st.mask]
    assert float(s.max()) < -635 and float(s.min()) > -637


@pytest.mark.parametrize("dtype, score", [(torch.float32, -636.0), (torch.float64, -1075.0)])
def test_overflowing_original_gauge_raises_in_every_path(dtype, score):
    """The issue's reproduction: original gauge, every score far below zero."""
    spec, w, x = negative_layer(score)
    pos = np.arange(x.shape[0])
    with pytest.raises(FloatingPointError, match="overflows"):
        fast.step(spec, w, x, pos, x, pos, dtype=dtype)
    for dk in (0, 64):  # the GEMM form and the per-query form of the streamed path
        with pytest.raises(FloatingPointError, match="overflows"):
            scale.identity_check(spec, w, x, dtype=dtype, direct_keys=dk)
    # the max-key gauge is the remedy the message names: finite and correct, to the identity
    # check's derived tolerance at these scores (the max-key kappa, from a float64 step)
    ok = scale.identity_check(spec, w, x, dtype=dtype, gauge="maxkey")
    st = fast.step(spec, w, x, pos, x, pos, gauge="maxkey")
    tol = tl.identity_check_tol(dtype, float(st.kappa.max()), x.shape[0], spec.head_dim,
                                float(st.s[0][st.mask].abs().max()))
    print(dtype, float(ok.max_rel.max()), float(tol))
    assert ok.finite and float(ok.max_rel.max()) <= float(tol)


def test_nan_inputs_are_rejected_with_a_message():
    spec, w, x = negative_layer(-3.0)
    bad = x.clone()
    bad[3, 1] = math.nan
    pos = np.arange(x.shape[0])
    with pytest.raises(ValueError, match="NaN or inf"):
        fast.step(spec, w, bad, pos, bad, pos)
    with pytest.raises(ValueError, match="NaN or inf"):
        scale.identity_check(spec, w, bad)
    w.b_k[0, 0] = math.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        scale.identity_check(spec, w, x)


@pytest.mark.parametrize("gauge", ["original", "maxkey"])
def test_a_nan_coefficient_raises(monkeypatch, gauge):
    """A corrupted phi_1 (one NaN) inside the kernel is caught where the coefficients are made."""
    spec, w, x = negative_layer(-2.0)
    real = kernel.phi1

    def poisoned(s):
        out = real(s).clone()
        out.view(-1)[0] = math.nan
        return out

    monkeypatch.setattr(kernel, "phi1", poisoned)
    pos = np.arange(x.shape[0])
    with pytest.raises(FloatingPointError, match="overflows|not finite"):
        fast.step(spec, w, x, pos, x, pos, gauge=gauge)
    with pytest.raises(FloatingPointError, match="overflows|not finite"):
        scale.identity_check(spec, w, x, gauge=gauge)


def test_a_nan_in_the_lowrank_rule_raises(monkeypatch):
    spec, w, x = negative_layer(-2.0)
    t, wts = lowrank.gl_nodes(4)
    bad = np.array(wts)
    bad[1] = np.nan
    monkeypatch.setattr(lowrank, "gl_nodes", lambda n: (t, bad))
    with pytest.raises(FloatingPointError, match="not finite"):
        scale.identity_check(spec, w, x, gauge="pairwise", pairwise="lowrank", tol=1e-3)


def test_a_nan_output_is_reported_as_nan_not_zero(monkeypatch):
    """The reduction itself: a chunk whose softmax output is NaN yields NaN errors, not 0."""
    spec, w, x = negative_layer(-2.0, N=40)
    real_stream = scale.stream

    def corrupted(*a, **k):
        for n, ch in enumerate(real_stream(*a, **k)):
            if n == 0:
                ch.y_c = ch.y_c.clone()
                ch.y_c[0, 0, 0] = math.nan
            yield ch

    monkeypatch.setattr(scale, "stream", corrupted)
    res = scale.identity_check(spec, w, x, gauge="maxkey")
    print(res.as_dict())
    assert math.isnan(res.max_abs[0]) and math.isnan(res.max_rel[0])
    assert not res.finite


def test_unselected_heads_are_not_counted_as_non_finite():
    spec, w, x = negative_layer(-2.0, N=20)
    spec2 = HeadSpec(2, 1, spec.head_dim, rope=spec.rope)
    w2 = HeadWeights(w.w_q.repeat(1, 2, 1), w.w_k, w.w_v, w.b_q.repeat(2, 1), w.b_k, None)
    res = scale.identity_check(spec2, w2, x, heads=[1])
    assert math.isnan(res.max_abs[0]) and res.finite  # head 0 not checked: NaN by design
