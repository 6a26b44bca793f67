"""Test-side helpers to compare the fast layer with the exact oracle (no library math here)."""
from __future__ import annotations

import mpmath as mp
import numpy as np

from ropestep import exact, lowrank
from ropestep import tolerances as tl


def out_scale(E: exact.ExactHead, h: int, i: int) -> mp.mpf:
    """Scale of head h's output at query i: max |v_j| over the permitted set (>= |y|, |mu|)."""
    js = np.flatnonzero(E.mask[i])
    return max([abs(E.v[h, j, q]) for j in js for q in range(E.spec.r)] + [mp.mpf(tl.SCALE_GUARD)])


def mat_scale(M) -> mp.mpf:
    return max([abs(x) for x in M] + [mp.mpf(tl.SCALE_GUARD)])


def gauges_for(spec, m: int):
    gs = ["original", "maxkey", "pairwise"]
    if spec.affine:
        rng = np.random.default_rng(m)
        gs.append(rng.standard_normal(m + 1) * 0.3)
    return gs


def gauge_name(g) -> str:
    return g if isinstance(g, str) else "free"


def top2_gap(E: exact.ExactHead, h: int, i: int) -> float:
    """Gap between the two largest raw scores (max-key gauge ties make j* ambiguous)."""
    js = np.flatnonzero(E.mask[i])
    z = sorted((float(E.s[h, i, j]) for j in js), reverse=True)
    return z[0] - z[1] if len(z) > 1 else np.inf


def verify_against_exact(p, gauge="original") -> dict:
    """Max errors of the fast float64 layer against the oracle on problem ``p``:
    ``y`` (softmax output), ``readout`` (mu + u^T dM vs the exact y) and ``matrix`` (dM, relative
    to its sum-of-absolute-terms scale).  The suite demands each <= ``tolerances.FLOAT64_REL``."""
    from ropestep import fast

    E = exact.build(*p.args(), bias=p.bias, dps=40)
    st_ = fast.step(*p.args(), bias=p.bias, gauge=gauge, delta_m=p.spec.affine)
    y_ex = exact.to_float(E.y)
    vs = np.abs(exact.to_float(E.v)).max()
    out = {"y": float(np.abs(st_.y.numpy() - y_ex).max() / vs),
           "readout": float(np.abs(st_.readout.numpy() - y_ex).max() / vs)}
    if p.spec.affine:
        Me = exact.to_float(exact.all_delta_m(E, gauge))
        H, Q = Me.shape[:2]
        mabs = np.array([[float(exact.delta_m_abs(E, h, i, gauge)) for i in range(Q)]
                         for h in range(H)])
        out["matrix"] = float((np.abs(st_.delta_m.numpy() - Me).max(axis=(2, 3))
                               / np.maximum(mabs, tl.SCALE_GUARD)).max())
        # the identity through the materialised matrix: mu + u^T Delta M against the exact y
        u = np.concatenate([p.x_q, np.ones((p.x_q.shape[0], 1))], 1)
        ro = st_.mu.numpy() + np.einsum("qa,hqar->hqr", u, st_.delta_m.numpy())
        out["identity_dm"] = float(np.abs(ro - y_ex).max() / vs)
    return out


def pairwise_route_abs(E: exact.ExactHead, h: int, i: int) -> float:
    """Absolute-term scale of the pairwise matrix as the fast layer evaluates it: the Laplacian
    form ``sum_j (a_j - a_bar) [sum_k D_jk ((v_j - mu) - (v_k - mu))] / (N Z)`` with features
    centred on their permitted mean (``fast._pairwise_chunk``).  Its rounding is relative to
    this, which can exceed the double sum's own scale (:func:`exact.delta_m_abs`)."""
    with mp.workprec(E.prec):
        perm = list(np.flatnonzero(E.mask[i]))
        D_, r = len(E.u[h, i]), E.spec.r
        n = len(perm)
        abar = [mp.fsum(E.feats[h, i, j][t] for j in perm) / n for t in range(D_)]
        w = {(j, k): exact.exp_phi_dd(E.s[h, i, j], E.s[h, i, k], E.spec.softcap) / (n * E.Z[h, i])
             for j in perm for k in perm if j != k}
        best = mp.mpf(0)
        for t in range(D_):
            for q in range(r):
                vb = {j: abs(E.v[h, j, q] - E.mu[h, i, q]) + abs(E.v[h, j, q]) for j in perm}
                tot = mp.fsum(abs(E.feats[h, i, j][t] - abar[t]) *
                              mp.fsum(w[j, k] * (vb[j] + vb[k]) for k in perm if k != j)
                              for j in perm)
                best = max(best, tot)
        return float(best)


# ---------------------------------------------------------------------------------------------
# the readout's condition number: fast's kappa, checked against the oracle's
# ---------------------------------------------------------------------------------------------
MAXKEY_TIE = tl.MAXKEY_TIE  # scores this close to the maximum may be fast's j* after rounding


def kappa_rel(kf: float, ke) -> float:
    """Disagreement of a float64 kappa ``kf`` with the exact ``ke`` (mpf), relative to
    ``max(ke, tolerances.KAPPA_FLOOR)`` (a kappa below the floor may underflow and moves no
    tolerance).  Both beyond float64's range (``kf`` = inf): 0.  NaN stays NaN (and fails every
    comparison)."""
    kf = float(kf)
    if np.isinf(kf) and kf > 0 and ke > mp.mpf(np.finfo(np.float64).max):
        return 0.0
    if not np.isfinite(kf):
        return float("nan") if np.isnan(kf) else float("inf")
    return float(abs(mp.mpf(kf) - ke) / max(ke, mp.mpf(tl.KAPPA_FLOOR)))


def exact_kappa_near(E: exact.ExactHead, h: int, i: int, gauge, kf: float):
    """The exact kappa of (h, i) in ``gauge`` -- in the max-key gauge, of the anchor among the
    near-maximal keys (within ``MAXKEY_TIE`` of the largest exact score) closest to ``kf``: at
    a near-tie rounding may let the fast layer pick any of them, each an equally valid gauge."""
    if gauge_name(gauge) != "maxkey":
        return exact.kappa(E, h, i, gauge)
    js = np.flatnonzero(E.mask[i])
    smax = max(E.s[h, i, j] for j in js)
    cands = [j for j in js if smax - E.s[h, i, j] <= MAXKEY_TIE]
    if len(cands) == 1:
        return exact.kappa(E, h, i, gauge)
    return min((exact.kappa(E, h, i, gauge, anchor=j) for j in cands),
               key=lambda ke: kappa_rel(kf, ke))


def kappa_agreement(E: exact.ExactHead, kappa_fast, gauge) -> tuple[np.ndarray, np.ndarray]:
    """``(rel, ke)``: per head and query the relative disagreement of the fast float64 kappa
    with the exact one (:func:`kappa_rel`) and the exact kappa as float64 (inf beyond range)."""
    kf = np.asarray(kappa_fast.detach().cpu().double().numpy() if hasattr(kappa_fast, "detach")
                    else kappa_fast, dtype=np.float64)
    H, Q = kf.shape
    rel, ke = np.zeros((H, Q)), np.zeros((H, Q))
    for h in range(H):
        for i in range(Q):
            k_ex = exact_kappa_near(E, h, i, gauge, kf[h, i])
            rel[h, i] = kappa_rel(kf[h, i], k_ex)
            ke[h, i] = float(k_ex)
    return rel, ke


def check_kappa_agreement(E: exact.ExactHead, st_, gauge) -> tuple[np.ndarray, np.ndarray]:
    """Assert that the fast float64 step ``st_`` (same gauge, same inputs as ``E``) returned the
    exact condition number to ``tolerances.KAPPA_REL`` at every head and query; return
    ``(rel, ke)`` as :func:`kappa_agreement`."""
    import torch

    if st_.kappa.dtype != torch.float64:
        raise TypeError("the kappa check compares a float64 step's kappa with the oracle")
    rel, ke = kappa_agreement(E, st_.kappa, gauge)
    bad = np.argwhere(~(rel <= tl.KAPPA_REL))
    assert bad.size == 0, (
        f"fast kappa disagrees with exact kappa ({gauge_name(gauge)} gauge) at (head, query) "
        f"{tuple(bad[0])}: fast {float(st_.kappa[tuple(bad[0])]):.6e}, exact "
        f"{ke[tuple(bad[0])]:.6e}, relative {rel[tuple(bad[0])]:.2e} > {tl.KAPPA_REL}")
    return rel, ke


def checked_kappa(E: exact.ExactHead, st_, gauge) -> np.ndarray:
    """The readout's condition number to scale a tolerance with, ``(H, Q)`` float64: the exact
    kappa of ``E`` (:func:`ropestep.exact.kappa`), after asserting that the fast float64 step
    ``st_`` returned the same value (:func:`check_kappa_agreement`) -- a wrong ``Step.kappa``
    fails here instead of silently widening a bound."""
    return check_kappa_agreement(E, st_, gauge)[1]


# ---------------------------------------------------------------------------------------------
# the Gauss-Legendre rule as shipped (lowrank.gl_nodes) against the exact rule
# ---------------------------------------------------------------------------------------------
def _legendre(n: int, x):
    """``(P_n(x), P_{n-1}(x))`` by the three-term recurrence (mpmath)."""
    p0, p1 = mp.mpf(1), x
    for k in range(2, n + 1):
        p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
    return (p1, p0) if n >= 1 else (mp.mpf(1), mp.mpf(0))


def exact_gl_rule(n: int, dps: int = 40) -> tuple[list, list]:
    """The ``n``-point Gauss-Legendre rule on ``[0, 1]`` in mpmath: the roots of ``P_n`` by
    Newton from the shipped float64 nodes, and the weights ``1 / ((1 - x^2) P_n'(x)^2)``."""
    t64, _ = lowrank.gl_nodes(n)
    with mp.workdps(dps):
        ts, ws = [], []
        for t in t64:
            x = 2 * mp.mpf(float(t)) - 1
            if n == 1:
                ts.append(mp.mpf(1) / 2)
                ws.append(mp.mpf(1))
                continue
            for _ in range(4):  # quadratic convergence from float64 accuracy
                P, Pm = _legendre(n, x)
                x = x - P / (n * (x * P - Pm) / (x * x - 1))
            P, Pm = _legendre(n, x)
            dP = n * (x * P - Pm) / (x * x - 1)
            ts.append((x + 1) / 2)
            ws.append(1 / ((1 - x * x) * dP * dP))
        return ts, ws


def gl_rule_errors(n: int) -> tuple[float, float, float]:
    """``(node_abs, weight_rel, weight_l1)``: the shipped float64 rule's distance from
    :func:`exact_gl_rule` -- the nodes' largest absolute error, the weights' largest relative
    error and the sum of their absolute errors (what ``tolerances.gl_rule_rel`` and
    ``gl_moment_abs`` take)."""
    t64, w64 = lowrank.gl_nodes(n)
    ts, ws = exact_gl_rule(n)
    with mp.workdps(40):
        na = max(abs(mp.mpf(float(a)) - b) for a, b in zip(t64, ts))
        wr = max(abs(mp.mpf(float(a)) - b) / b for a, b in zip(w64, ws))
        wa = mp.fsum(abs(mp.mpf(float(a)) - b) for a, b in zip(w64, ws))
        return float(na), float(wr), float(wa)


def query_space(E: exact.ExactHead, h: int, i: int) -> tuple:
    """The gradient step in query space from the oracle (docs/math.md section 3), without bias
    coordinates (every layer using it has none, so the bordered problem of
    :func:`ropestep.exact.query_space_hessian` has the same spectrum and step): returns
    ``(lambda_max(H), E(0), E(step))`` at the working precision of ``E``."""
    B = exact.query_space_delta_m(E, h, i)
    return (exact.query_space_lam_max(E, h, i), exact.query_space_objective(E, h, i, B * 0),
            exact.query_space_objective(E, h, i, B))
