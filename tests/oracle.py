"""Test-side helpers to compare the fast layer with the exact oracle (no library math here)."""
from __future__ import annotations

import mpmath as mp
import numpy as np

from ropestep import exact


def out_scale(E: exact.ExactHead, h: int, i: int) -> mp.mpf:
    """Scale of head h's output at query i: max |v_j| over the permitted set (>= |y|, |mu|)."""
    js = np.flatnonzero(E.mask[i])
    return max([abs(E.v[h, j, q]) for j in js for q in range(E.spec.r)] + [mp.mpf(1e-300)])


def mat_scale(M) -> mp.mpf:
    return max([abs(x) for x in M] + [mp.mpf(1e-300)])


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
    to its sum-of-absolute-terms scale).  The suite demands each <= 1e-12."""
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
                               / np.maximum(mabs, 1e-300)).max())
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
