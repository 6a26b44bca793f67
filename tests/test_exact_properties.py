"""The identities of docs/math.md at 60 digits, on hypothesis-generated heads (issue 2).

Each property is evaluated by the exact layer (mpmath) and must hold to
``tolerances.exact_tol(60)`` = 1e-50 relative to the scale of the quantities involved: 60
working digits minus at most 10 lost to the sums (N <= 16 terms, d <= 8, each a handful of
roundings), with the oracle's guard digits covering the original gauge's ``1/Z``
amplification.  (A separation threshold, not a tolerance: correct identities measure
<= 1e-78, a false one >= 1e-6.)
"""
from __future__ import annotations

import mpmath as mp
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from ropestep import exact
from ropestep import tolerances as tl
from oracle import gauge_name, gauges_for, mat_scale, out_scale
from strategies import make_problem, pins, problems

DPS = 60
REL = mp.mpf(tl.exact_tol(DPS))


def _pairs(E, sel, k):
    """Up to k (head, query) pairs, chosen by the drawn integer ``sel``."""
    H, Q = E.u.shape[:2]
    allp = [(h, i) for h in range(H) for i in range(Q)]
    if len(allp) <= k:
        return allp
    idx = np.random.default_rng(sel).choice(len(allp), size=k, replace=False)
    return [allp[n] for n in idx]


@pins
@given(p=problems())
def test_identity_every_gauge(p):
    E = exact.build(*p.args(), bias=p.bias, dps=DPS)
    H, Q = E.u.shape[:2]
    m = p.x_q.shape[1]
    worst = {}
    for g in gauges_for(p.spec, m):
        if gauge_name(g) == "pairwise" and p.x_kv.shape[0] > 8:
            pairs = [(0, Q - 1), (H - 1, 0)]  # O(N^2) per query: spot-check two
        else:
            pairs = [(h, i) for h in range(H) for i in range(Q)]
        for h, i in pairs:
            M = exact.delta_m(E, h, i, g)
            ro = exact.readout(E, h, i, M)
            err = max(abs(ro[q] - E.y[h, i, q]) for q in range(p.spec.r)) / out_scale(E, h, i)
            worst[gauge_name(g)] = max(worst.get(gauge_name(g), 0), err)
    # the features reproduce the directly computed scores: s_ij = u_i . a_ij
    with mp.workdps(E.dps):
        sc = max(abs(exact._dot(E.u[h, i], E.feats[h, i, j]) - E.s[h, i, j]) /
                 (1 + abs(E.s[h, i, j])) for h in range(H) for i in range(Q)
                 for j in np.flatnonzero(E.mask[i]))
    print({k: mp.nstr(v, 3) for k, v in worst.items()}, "scores", mp.nstr(sc, 3))
    assert sc <= REL
    for g, err in worst.items():
        assert err <= REL, (g, err)


def test_uniform_mean_is_the_only_mean():
    """Negative test: replacing mu by the softmax mean y breaks the identity."""
    p = make_problem(N=6, seed=11, amp=1.5)
    E = exact.build(*p.args(), dps=DPS)
    h, i = 0, 5
    with mp.workdps(E.dps):
        c, _ = exact.coefficients(E, h, i)
        M = mp.zeros(len(E.u[h, i]), p.spec.r)
        for j, cj in c.items():
            for a in range(M.rows):
                for q in range(M.cols):
                    M[a, q] += cj * E.feats[h, i, j][a] * (E.v[h, j, q] - E.y[h, i, q])
        wrong = [E.y[h, i, q] + mp.fsum(E.u[h, i][a] * M[a, q] for a in range(M.rows))
                 for q in range(M.cols)]
        err = max(abs(wrong[q] - E.y[h, i, q]) for q in range(p.spec.r)) / out_scale(E, h, i)
    print("softmax-mean variant error", mp.nstr(err, 3))
    assert err > tl.DETECT_REL_FINE


@pins(only=lambda p: p.spec.affine, sel=0)
@given(p=problems(families=("dot",)), sel=st.integers(0, 2**16))
def test_gradient_step(p, sel):
    """grad E_i(0) = -Delta M_i (central differences are exact on a quadratic); the change of E
    under the unit step is -||Delta M||^2 + 1/2 tr(Delta M^T H Delta M); lam_max(H) < 2 implies
    descent."""
    E = exact.build(*p.args(), bias=p.bias, dps=DPS)
    for h, i in _pairs(E, sel, 2):
        for g in ("original", "maxkey"):
            M = exact.delta_m(E, h, i, g)
            Z0 = mp.zeros(M.rows, M.cols)
            G = exact.numeric_gradient(E, h, i, Z0, g)
            sc = mat_scale(M) + out_scale(E, h, i)
            err = max(abs(G[a, q] + M[a, q]) for a in range(M.rows) for q in range(M.cols)) / sc
            assert err <= REL, (g, err)
            Ga = exact.gradient(E, h, i, Z0, g)
            assert max(abs(Ga[a, q] - G[a, q]) for a in range(M.rows) for q in range(M.cols)) \
                <= REL * sc
            Hm = exact.hessian(E, h, i, g)
            with mp.workdps(E.dps):
                change = exact.objective(E, h, i, M, g) - exact.objective(E, h, i, Z0, g)
                pred = -mp.fsum(x * x for x in M) + mp.fsum(
                    (M.T * Hm * M)[q, q] for q in range(M.cols)) / 2
                lam = exact.lam_max(E, h, i, g)
            assert abs(change - pred) <= REL * (abs(pred) + sc ** 2 + mat_scale(M) ** 2 * (1 + lam))
            if lam < 2 and mat_scale(M) > 0:
                assert change <= 0


@pins(only=lambda p: p.bank)
@given(p=problems(bank=True, max_n=12))
def test_frozen_reuse_tokenwise_and_refresh(p):
    """Shared bank and position: e_i = y_i - (mu + u_i^T dM_0) equals the tokenwise formula;
    dM_i - dM_0 = L sum_j (c_ij - c_0j) k~_j^T (v_j - mu) (+ the bias row); and the
    operator-norm bound ||e_i|| <= ||u_i|| ||dM_i - dM_0||."""
    E = exact.build(*p.args(), bias=p.bias, dps=DPS)
    H, Q = E.u.shape[:2]
    d, r = p.spec.head_dim, p.spec.r
    for h in range(H):
        M0 = exact.delta_m(E, h, 0)
        c0, _ = exact.coefficients(E, h, 0)
        for i in range(1, Q):
            Mi = exact.delta_m(E, h, i)
            with mp.workdps(E.dps):
                fr = exact.readout(E, h, i, M0)
                meas = [E.y[h, i, q] - fr[q] for q in range(r)]
                tok = exact.tokenwise_reuse_error(E, h, i, 0)
                sc = out_scale(E, h, i)
                assert max(abs(a - b) for a, b in zip(meas, tok)) <= REL * sc
                ci, _ = exact.coefficients(E, h, i)
                if p.spec.affine:
                    L = E.extras["L"][h, i]
                    Lc = E.extras["L"][h, 0]
                    assert max(abs(x) for x in (L - Lc)) == 0  # same position: same L
                    T = mp.zeros(d, r)
                    brow = [mp.mpf(0)] * r
                    for j in ci:
                        w = ci[j] - c0[j]
                        for q in range(r):
                            vq = E.v[h, j, q] - E.mu[h, i, q]
                            brow[q] += w * E.beta[h, i, j] * vq
                            for a in range(d):
                                T[a, q] += w * E.k[h, j][a] * vq
                    R = L * T
                    for q in range(r):
                        R[R.rows - 1, q] += brow[q]
                    D = Mi - M0
                    # relative to the sum-of-absolute-terms scale: Mi - M0 can cancel to ~0
                    sc_m = exact.delta_m_abs(E, h, i) + exact.delta_m_abs(E, h, 0)
                    assert max(abs(x) for x in (D - R)) <= REL * sc_m
                    D = Mi - M0
                    nu = mp.sqrt(mp.fsum(x * x for x in E.u[h, i]))
                    op = max(mp.svd_r(D, compute_uv=False)) if D.rows and D.cols else 0
                    ne = mp.sqrt(mp.fsum(x * x for x in meas))
                    assert ne <= nu * op * (1 + REL) + REL * sc


@pins(only=lambda p: p.bank and p.bias is None)
@given(p=problems(bank=True, max_n=12))
def test_prefix_full_relation(p):
    """Adding the query's own key: y_full = (1 - pi) y_prefix + pi v_self, and the full-bank
    mean is (N mu + v_self)/(N + 1); the identity holds on the full bank too."""
    E = exact.build(*p.args(), bias=None, dps=DPS)
    N = p.x_kv.shape[0]
    for i in range(p.x_q.shape[0]):
        xf = np.concatenate([p.x_kv, p.x_q[i:i + 1]])
        pf = np.concatenate([p.pos_kv, p.pos_q[i:i + 1]])
        Ef = exact.build(p.spec, p.weights, p.x_q[i:i + 1], p.pos_q[i:i + 1], xf, pf,
                         np.ones((1, N + 1), bool), dps=DPS)
        with mp.workdps(max(E.dps, Ef.dps)):
            for h in range(p.spec.n_heads):
                vs = [Ef.v[h, N, q] for q in range(p.spec.r)]
                rel = exact.prefix_full(E, h, i, Ef.s[h, 0, N], vs)
                sc = out_scale(Ef, h, 0)
                assert max(abs(rel[q] - Ef.y[h, 0, q]) for q in range(p.spec.r)) <= REL * sc
                mf = [(N * E.mu[h, i, q] + vs[q]) / (N + 1) for q in range(p.spec.r)]
                assert max(abs(mf[q] - Ef.mu[h, 0, q]) for q in range(p.spec.r)) <= REL * sc
                ro = exact.readout(Ef, h, 0, exact.delta_m(Ef, h, 0))
                assert max(abs(ro[q] - Ef.y[h, 0, q]) for q in range(p.spec.r)) <= REL * sc


@given(base=st.sampled_from([2.0, 10.0, 1e4, 1e6]), d=st.sampled_from([2, 4, 6, 8]),
       layout=st.sampled_from(["half", "interleaved"]), p=st.integers(0, 4096),
       delta=st.one_of(st.integers(-64, 64), st.floats(-5, 5, allow_nan=False)))
@example(base=10.0, d=2, layout="half", p=0, delta=0)
@example(base=1e6, d=8, layout="interleaved", p=511, delta=1)
@example(base=2.0, d=8, layout="half", p=4096, delta=-64)
def test_rope_finite_difference(base, d, layout, p, delta):
    """R(p + delta) - R(p) = delta A phi_1(delta A) R(p), exactly."""
    with mp.workdps(DPS + 10):
        res = exact.rope_finite_difference_residual(base, d, layout, mp.mpf(p), mp.mpf(delta))
    print("residual", mp.nstr(res, 3))
    assert res <= REL
