"""Low-rank pairwise gauge (ropestep.lowrank): the node-count bound, and agreement with the exact
pairwise evaluation (dense kernel here, ``fast.step(gauge="pairwise")`` and mpmath elsewhere).
"""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
import torch

from ropestep import exact, fast, lowrank, scale
from ropestep import tolerances as tl

from oracle import gl_rule_errors
from test_scale import make_layer, rel

pytestmark = pytest.mark.usefixtures("one_thread")


SPREADS = [0.5, 1, 2, 5, 10, 20, 40, 60, 80]


def rule_error(n: int, spread: float) -> float:
    """Relative error of the float64 n-point rule for int_0^1 e^{t spread} dt, in mpmath."""
    t, w = lowrank.gl_nodes(n)
    with mp.workdps(50):
        q = mp.fsum(mp.mpf(float(wi)) * mp.exp(mp.mpf(float(ti)) * spread) for ti, wi in zip(t, w))
        exact_val = mp.expm1(mp.mpf(spread)) / spread
        return float(abs(q - exact_val) / exact_val)


@pytest.mark.parametrize("tol", [1e-4, 1e-8, 1e-12])
def test_node_count_meets_tolerance(tol):
    for spread in SPREADS:
        n = lowrank.choose_nodes(spread, tol)
        err = rule_error(n, spread)
        # also the other sign (exp[z_j, z_k] with z_j < z_k): e^{-t spread}
        t, w = lowrank.gl_nodes(n)
        neg = abs(sum(float(wi) * math.exp(-float(ti) * spread) for ti, wi in zip(t, w))
                  - (-math.expm1(-spread)) / spread) / ((-math.expm1(-spread)) / spread)
        print(tol, spread, n, f"{err:.1e} {neg:.1e} bound {lowrank.gl_error_bound(n, spread):.1e}")
        # neg is a float64 sum of n products w e^{-t spread}: the rule's error (<= tol, by the
        # same bound: the rule is symmetric under t -> 1 - t) plus the shipped rule's distance
        # from the exact one and the float64 evaluation, in any order (gl_rule_rel)
        na, wr, _ = gl_rule_errors(n)
        assert err <= tol and neg <= tl.gl_rule_rel(tol, spread, n, na, wr)
        assert lowrank.gl_error_bound(n, spread) <= tol
        assert n == 1 or lowrank.gl_error_bound(n - 1, spread) > tol  # smallest such n


def test_bound_is_an_upper_bound_and_not_vacuous():
    """The stated bound dominates the true error (above the float64 floor: the shipped nodes,
    a few ulps from the exact ones, move ``e^{t spread}`` by ``spread`` times a few ulps)."""
    for spread in (1, 10, 40, 80):
        for n in (2, 4, 8, 12, 16, 24):
            err, bound = rule_error(n, spread), lowrank.gl_error_bound(n, spread)
            na, wr, _ = gl_rule_errors(n)  # the shipped rule's distance from the exact one
            assert err <= tl.gl_rule_rel(bound, spread, n, na, wr), (spread, n, err, bound)
    # too few nodes at a large spread really is wrong: the tolerance test can fail
    assert rule_error(8, 40) > tl.DETECT_REL


def test_rule_basics():
    for n in (1, 2, 7, 40):
        t, w = lowrank.gl_nodes(n)
        node_abs, _, weight_l1 = gl_rule_errors(n)
        assert abs(w.sum() - 1) <= tl.gl_moment_abs(n, node_abs, weight_l1)  # the moment k = 0
        assert (t > 0).all() and (t < 1).all() and (w > 0).all()
        for deg in range(2 * n):  # exact for polynomials of degree <= 2n - 1
            assert abs(float((w * t ** deg).sum()) - 1 / (deg + 1)) <= \
                tl.gl_moment_abs(n, node_abs, weight_l1)
    assert lowrank.gl_error_bound(5, 0.0) == 0.0 and lowrank.choose_nodes(0.0, 1e-14) == 1
    with pytest.raises(ValueError, match="more than"):
        lowrank.choose_nodes(5000.0, 1e-14)
    with pytest.raises(ValueError, match="tol"):
        lowrank.choose_nodes(10.0, 0.0)
    with pytest.raises(ValueError, match="spread"):
        lowrank.gl_error_bound(3, -1.0)


@pytest.mark.parametrize("spread", [1, 5, 20, 40, 80])
def test_lowrank_matches_exact_pairwise_up_to_spread_80(spread):
    """T^pair low rank vs dense kernel, float64, every query of a layer rescaled to `spread`."""
    spec, w, x = make_layer(H=2, Hk=1, d=8, m=12, N=60, seed=11)
    L = scale.project_layer(spec, w, x)
    s = L.q @ L.k[0].T  # (H, N, N), one key group
    mask = torch.ones(60, 60, dtype=torch.bool).tril()
    cur = float((s.masked_fill(~mask, -math.inf).amax(-1)
                 - s.masked_fill(~mask, math.inf).amin(-1)).max())
    f = spread / cur
    w.w_q, w.b_q = w.w_q * f, w.b_q * f  # scores scale linearly with the query
    ex = scale.pairwise_layer(spec, w, x, method="exact")
    lo = scale.pairwise_layer(spec, w, x, method="lowrank")
    res = scale.identity_check(spec, w, x, gauge="pairwise")
    e_t = max(rel(lo["t"][h, i], ex["t"][h, i]) for h in range(2) for i in range(60))
    e_r = rel(lo["readout"], ex["readout"])
    print(spread, res.extras.get("nodes_max"), f"T per query {e_t:.1e} readout {e_r:.1e}")
    # the rule was chosen at (about) this spread, at the float64 default tolerance
    assert res.extras["nodes_max"] >= lowrank.choose_nodes(spread * (1 - tl.FLOAT64_REL),
                                                           lowrank.default_tol(torch.float64))
    # float64 agreement (the rule's own error, default_tol = 32 u, is far below it)
    assert e_t <= tl.FLOAT64_REL and e_r <= tl.FLOAT64_REL and res.max_rel.max() <= tl.FLOAT64_REL


def test_lowrank_matches_fast_and_mpmath():
    spec, w, x = make_layer(H=2, Hk=1, d=4, m=5, N=10, seed=12, alibi_slopes=(0.4, 0.1))
    st = fast.step(spec, w, x, np.arange(10), x, np.arange(10), "causal", gauge="pairwise",
                   delta_m=True)
    lo = scale.pairwise_layer(spec, w, x, delta_m=True)
    for k in ("t", "b", "delta_m", "readout"):
        assert rel(lo[k], getattr(st, k)) <= tl.FLOAT64_REL, k
    E = exact.build(spec, w, x, np.arange(10), x, np.arange(10), "causal", dps=40)
    ref = torch.tensor(exact.to_float(exact.all_delta_m(E, "pairwise")))
    print(rel(lo["delta_m"], ref))
    assert rel(lo["delta_m"], ref) <= tl.FLOAT64_REL


def test_kernel_terms_directly():
    """laplacian_terms_lowrank vs laplacian_terms_exact on random shifted scores (spread 60)."""
    g = torch.Generator().manual_seed(3)
    G, Q, N, d, r = 2, 5, 40, 6, 3
    zs = -60 * torch.rand(G, Q, N, generator=g, dtype=torch.float64)
    zs[..., 0] = 0.0  # the max-key
    mask = torch.rand(Q, N, generator=g) < 0.8
    mask[:, 0] = True
    k = torch.randn(N, d, generator=g, dtype=torch.float64)
    v = torch.randn(N, r, generator=g, dtype=torch.float64)
    beta = torch.randn(G, Q, N, generator=g, dtype=torch.float64)
    te, be = lowrank.laplacian_terms_exact(zs, mask, k, v, beta)
    n = lowrank.choose_nodes(lowrank.spread_of(zs, mask), 1e-14)
    tl_, bl = lowrank.laplacian_terms_lowrank(zs, mask, k, v, n, beta=beta, node_block=5)
    print(n, rel(tl_, te), rel(bl, be))
    assert rel(tl_, te) <= tl.FLOAT64_REL and rel(bl, be) <= tl.FLOAT64_REL
    t2, _ = lowrank.laplacian_terms_lowrank(zs, mask, k, v, 6, beta=beta)  # too few nodes
    assert rel(t2, te) > tl.DETECT_REL_FINE  # mutation: an under-resolved rule is detected


def test_float32_pairwise():
    spec, w, x = make_layer(H=2, Hk=1, d=8, m=12, N=50, seed=13)
    ref = scale.pairwise_layer(spec, w, x, method="exact")
    lo = scale.pairwise_layer(spec, w, x, dtype=torch.float32)
    e = rel(lo["readout"], ref["readout"])
    print(e)
    # float32 against float64, a whole-layer agreement check: the scores' float32 rounding
    # (|s| ~ 10) dominates
    assert e <= tl.agreement_rel_tol(torch.float32, x.shape[0], spec.head_dim)


def test_softcap_is_not_implemented():
    spec, w, x = make_layer(N=20, softcap=5.0)
    with pytest.raises(NotImplementedError, match="softcap"):
        scale.pairwise_layer(spec, w, x)
