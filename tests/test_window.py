"""Sliding windows (``HeadSpec.window``): the permitted set ``{j : p_j <= p_i, p_i - p_j < W}``.

The window is a property of the head, so every path applies it to every mask: the exact oracle
(:func:`ropestep.exact.build`), the per-query fast path (:func:`ropestep.fast.step`) and the
streamed layer (:func:`ropestep.scale.stream`).  Each is compared with an independent
construction: the same head *without* a window given the windowed permitted sets as an explicit
boolean mask, and the mpmath oracle at 50 digits.  A window that is ignored moves the outputs by
O(1) (the power check).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ropestep import exact, fast, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec, resolve_mask

N, M, H, HK, D, W = 12, 6, 2, 1, 4, 4
F64 = torch.float64


def _head(window):
    g = torch.Generator().manual_seed(7)
    spec = HeadSpec(n_heads=H, n_kv_heads=HK, head_dim=D, rope=RoPESpec(base=100.0),
                    window=window)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    w = HeadWeights(w_q=r(M, H, D) * 0.8, w_k=r(M, HK, D) * 0.8, w_v=r(M, HK, D),
                    b_q=r(H, D) * 0.3, b_k=r(HK, D) * 0.3, b_v=r(HK, D) * 0.1)
    x = torch.randn(N, M, generator=g, dtype=F64)
    return spec, w, x


def _windowed(n: int, window: int) -> np.ndarray:
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    return (j <= i) & (i - j < window)


def test_resolve_mask_applies_the_window_to_every_mask():
    pos = np.arange(N)
    assert np.array_equal(resolve_mask("causal", pos, pos, N, N, W), _windowed(N, W))
    bank = resolve_mask("bank", np.full(2, N), pos, 2, N, W)
    assert bank.sum(-1).tolist() == [W - 1, W - 1]  # keys N-W+1 .. N-1
    t = resolve_mask(torch.ones(N, N, dtype=torch.bool), pos, pos, N, N, W)
    assert torch.is_tensor(t) and int(t.sum()) == int((np.arange(N)[:, None] - np.arange(N)
                                                        < W).sum())
    with pytest.raises(ValueError, match="window"):
        HeadSpec(n_heads=1, n_kv_heads=1, head_dim=2, window=0)


def test_fast_and_exact_with_a_window():
    spec, w, x = _head(W)
    spec0, _, _ = _head(None)
    pos = torch.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, "causal", delta_m=True)
    st0 = fast.step(spec0, w, x, pos, x, pos, torch.as_tensor(_windowed(N, W)), delta_m=True)
    assert torch.equal(st.mask, st0.mask)
    tol = tolerances.agreement_rel_tol(F64, W, D, M)
    vs = float(st0.y.abs().max())
    assert float((st.y - st0.y).abs().max()) <= tol * vs
    assert float((st.readout - st0.readout).abs().max()) <= tol * vs
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=50)
    y_ex = torch.as_tensor(exact.to_float(E.y))
    assert float((st.y - y_ex).abs().max()) <= tol * vs
    # power: the same head without its window is a different function
    stc = fast.step(spec0, w, x, pos, x, pos, "causal")
    assert float((stc.y - st.y).abs().max()) > 1e3 * tol * vs


def test_streamed_layer_with_a_window():
    spec, w, x = _head(W)
    pos = torch.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, "causal")
    ro = torch.zeros(H, N, D, dtype=F64)
    for ch in scale.stream(spec, w, x, pos, gauge="maxkey", max_bytes=1 << 16):
        ro[ch.heads[0]:ch.heads[-1] + 1, ch.queries] = ch.readout
    tol = tolerances.agreement_rel_tol(F64, W, D, M)
    assert float((ro - st.y).abs().max()) <= tol * float(st.y.abs().max())
