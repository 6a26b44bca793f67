"""QK-norm over every head of a token (``HeadSpec.norm_scope="all"``, OLMo 2): one RMS over the
``H d`` (keys: ``H_kv d``) raw projections of a token, then per-head weights, then RoPE.

The fast path (:func:`ropestep.fast.step`) and the streamed layer
(:func:`ropestep.scale.stream`) against the mpmath oracle (:func:`ropestep.exact.build`, which
normalises with its own 50-digit sums); the per-head scope is a different function (power).
"""
from __future__ import annotations

import torch

from ropestep import exact, fast, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

N, M, H, HK, D = 9, 5, 4, 2, 4
F64 = torch.float64


def _head(scope: str):
    g = torch.Generator().manual_seed(11)
    spec = HeadSpec(n_heads=H, n_kv_heads=HK, head_dim=D, rope=RoPESpec(base=50.0),
                    family="qknorm", norm_scope=scope, scale=1.3)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    shp_q, shp_k = ((D,), (D,)) if scope == "head" else ((H, D), (HK, D))
    w = HeadWeights(w_q=r(M, H, D), w_k=r(M, HK, D), w_v=r(M, HK, D), b_q=r(H, D) * 0.5,
                    b_k=r(HK, D) * 0.5, q_norm=1 + 0.3 * r(*shp_q), k_norm=1 + 0.3 * r(*shp_k))
    w_head = HeadWeights(**{**w.__dict__, "q_norm": w.q_norm.reshape(-1)[:D] if scope == "all"
                            else w.q_norm, "k_norm": w.k_norm.reshape(-1)[:D] if scope == "all"
                            else w.k_norm})
    return spec, w, w_head, torch.randn(N, M, generator=g, dtype=F64)


def test_whole_projection_norm_matches_the_oracle():
    spec, w, _, x = _head("all")
    pos = torch.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, "causal")
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=50)
    y_ex = torch.as_tensor(exact.to_float(E.y))
    tol = tolerances.agreement_rel_tol(F64, N, D, M)
    vs = float(y_ex.abs().max())
    assert float((st.y - y_ex).abs().max()) <= tol * vs
    ro = torch.zeros(H, N, D, dtype=F64)
    for ch in scale.stream(spec, w, x, pos, gauge="maxkey"):
        ro[ch.heads[0]:ch.heads[-1] + 1, ch.queries] = ch.readout
    assert float((ro - y_ex).abs().max()) <= tol * vs
    # power: normalising each head on its own is another function
    spec_h = HeadSpec(**{**spec.__dict__, "norm_scope": "head"})
    _, _, w_h, _ = _head("all")
    st_h = fast.step(spec_h, HeadWeights(**{**w_h.__dict__, "q_norm": w.q_norm[0],
                                            "k_norm": w.k_norm[0]}), x, pos, x, pos, "causal")
    assert float((st_h.y - y_ex).abs().max()) > 1e3 * tol * vs


def test_norm_weights_have_the_scope_shape():
    import pytest

    spec, w, w_head, x = _head("all")
    with pytest.raises(ValueError, match=r"q_norm must have shape \(4, 4\)"):
        w_head.check(spec, M)
