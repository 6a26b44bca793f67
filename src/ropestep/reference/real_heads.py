"""The claims of ``ropestep validate``'s ``real_heads`` section -- ``positive_coefficients``,
``rank``, ``no_global_readout``, ``exact_rows`` and their pooled fields -- recomputed from the
``--dump-raw`` directory (docs/protocol.md sections 12.7 and 12.9), independently of the code
that wrote them (:mod:`ropestep.realchecks`, :func:`ropestep.protocol.real_checks`).

Written from section 12.9 alone, one head and one query at a time, in the paper's form:

* the coefficients ``c_ij = rho(s_ij) / Z_i`` from float64 scores of the section-12 projections;
* ``Delta M_i = sum_j c_ij a_j (v_j - mu)^T`` materialised from the input-space features ``a_j``
  (not ``L_i T_i`` in query space); the singular values of ``Delta M_i W_o,h`` are those of
  ``R W_o,h`` (``R`` the ``r x r`` triangular factor of ``Delta M_i``) completed by exact zeros,
  not an SVD of the ``(m+1) x D`` product;
* the no-global-readout outputs are the oracle (mpmath softmax of the float64 scores); the
  least-squares residual and ``W = (U_Q U_Q^T)^(-1) Z`` of the minimum-norm readout
  ``M = U_Q^T W`` are solved in mpmath (normal equations of the exactly known barycentric
  matrix and the ``Q x Q`` Gram matrix of the queries), not by an SVD-based solver;
* the oracle rows are a fresh mpmath evaluation at 50 digits (plus guard digits) of the exact
  function of the dumped numbers, and the reference's own float64 evaluation of the same row
  (numpy, input space) stands in for the report's float64 fast path: its relative errors are
  the reference's rounding, comparable with the report's only through a bound.

Besides the report (:attr:`Claims.report`) the sizes that the tolerances of a comparison need are
kept (:attr:`Claims.support`, per ``(layer, context)``; tests/test_reference_real_heads.py).

Imports: numpy, mpmath, safetensors' numpy reader (through :mod:`ropestep.reference.validate`)
and the other reference modules' helpers; nothing else of ropestep and not torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import mpmath as mp
import numpy as np

from .atlas import augmented, rotate, softmax_output
from .validate import abs_projection, coefficients, load, project

U64 = 2.0 ** -53  # float64's unit roundoff
FLOAT64_REL = 1e-12  # the acceptance bar of section 12.9 (the suite's float64 agreement level)
SCALE_GUARD = 1e-300  # the floor of a denominator (section 12.9)
EXACT_BANK = (4, 12)  # the oracle rows' query range (section 12.9)
DIGITS = 50  # the oracle's digits
GUARD_DIGITS = 10
CHECKS = ("positive_coefficients", "rank", "no_global_readout", "exact_rows")
POOLED = {"positive_coefficients": ("min_c",), "rank": ("rank_max",),
          "no_global_readout": ("lower_certified_min",),
          "exact_rows": ("y_rel_max", "delta_m_rel_max", "c_rel_max", "readout_rel_max")}


def least(values) -> float:
    """The smallest value, NaN when any is NaN."""
    a = np.asarray(list(values), dtype=np.float64)
    return math.nan if np.isnan(a).any() else float(np.min(a))


def worst(values) -> float:
    """The largest value, NaN when any is NaN."""
    a = np.asarray(list(values), dtype=np.float64)
    return math.nan if np.isnan(a).any() else float(np.max(a))


def finite(*values) -> bool:
    return bool(all(np.all(np.isfinite(np.asarray(v, dtype=np.float64))) for v in values))


# ---------------------------------------------------------------------------------------------
# positive coefficients (every context)
# ---------------------------------------------------------------------------------------------
def positive_coefficients(Ps: list) -> tuple[dict, dict]:
    """``min c_ij`` over heads ``h``, queries ``i`` and bank keys ``j`` (``H x Q x N``), its first
    position in that order, the per-head minima and the count; support: ``c`` and the absolute
    terms of the scores, ``qk_ij = sum_l Qabs_il Kabs_jl`` (``H x Q x N``; :func:`_projected`)."""
    c = np.stack([np.stack([coefficients(s) for s in P.q @ P.k.T]) for P in Ps])
    qk = np.stack([P.Q_abs @ P.K_abs.T for P in Ps])
    H, Q, N = c.shape
    flat = int(np.argmin(np.where(np.isnan(c), -np.inf, c)))
    cmin = least(c.ravel())
    out = {"check": "positive_coefficients", "gauge": "original", "min_c": cmin,
           "argmin": {"head": flat // (Q * N), "query": (flat // N) % Q, "key": flat % N},
           "per_head_min": [least(c[h].ravel()) for h in range(H)],
           "coefficients": H * Q * N, "tolerance": 0.0, "ok": bool(finite(cmin) and cmin > 0)}
    return out, {"c": c, "qk": qk}


# ---------------------------------------------------------------------------------------------
# rank(Delta M_i W_o,h) (the run's first context)
# ---------------------------------------------------------------------------------------------
def rank_rows(seed: int, context: int, layer: int, H: int, Q: int) -> list[tuple[int, int]]:
    """Every head at query 0 and one seeded candidate: ``numpy.random.default_rng([seed,
    context, layer]).integers(1, Q)`` (its first draw; 0 when ``Q = 1``)."""
    other = int(np.random.default_rng([seed, context, layer]).integers(1, Q)) if Q > 1 else 0
    return [(h, i) for h in range(H) for i in sorted({0, other})]


def delta_m(P, c: np.ndarray) -> np.ndarray:
    """``Delta M_i = sum_j c_ij a_j (v_j - mu)^T`` (``(m+1) x r``)."""
    return np.einsum("jm,j,jr->mr", P.a, c, P.v - P.v.mean(axis=0))


def rank(Ps: list, lay: dict, facts: dict, rows: list[tuple[int, int]]) -> tuple[dict, list]:
    """The rank rows of section 12.9 and, per row, the sizes of its tolerances."""
    d, r = facts["head_dim"], facts["r"]
    out_rows, sup = [], []
    for h, i in dict.fromkeys(rows):
        P = Ps[h]
        N = P.k.shape[0]
        c = coefficients(P.q[i] @ P.k.T)
        dm = delta_m(P, c)
        wo = lay["w_o"][h].astype(np.float64)
        shape = (dm.shape[0], wo.shape[1])  # of the product Delta M W_o,h
        # the product has rank <= r: its singular values are those of R W_o,h (R the
        # triangular factor of Delta M = Q R) and min(m+1, D) - r exact zeros
        sv = np.linalg.svd(np.linalg.qr(dm, mode="r") @ wo, compute_uv=False)
        sv = np.concatenate((sv, np.zeros(max(min(shape) - sv.size, 0))))
        smax = float(sv[0]) if sv.size else 0.0
        norms = float(np.linalg.norm(dm) * np.linalg.norm(wo))
        thr = max(shape) * 2 * U64 * smax + r * U64 * norms
        rk = int(np.sum(sv > thr))
        after = float(sv[d] / sv[0]) if sv.size > d and smax > 0 else 0.0
        bound = min(d, r, N - 1)
        out_rows.append({"head": h, "query": i, "keys": N, "rank": rk, "bound": bound, "d": d,
                         "sigma_max": smax, "sigma_ratio_after_d": after,
                         "threshold_ratio": thr / smax if smax > 0 else thr,
                         "ok": bool(finite(sv) and rk <= bound)})
        t = P.v - P.v.mean(axis=0)
        vabs = np.abs(P.u_b) @ np.abs(P.wv)
        Sabs = np.einsum("j,jm,jr->mr", np.abs(c), P.A_abs, vabs + vabs.max(axis=0))
        Sact = np.einsum("j,jm,jr->mr", np.abs(c), np.abs(P.a), np.abs(t))
        sup.append({"sv": sv, "thr": thr, "norms": norms, "shape": shape,
                    "qk_max": float(np.max(P.Q_abs[i] @ P.K_abs.T)),
                    "sabs_w": float(np.linalg.norm(Sabs @ np.abs(wo))),
                    "abs_prod": float(np.linalg.norm(np.abs(dm) @ np.abs(wo))),
                    "sact_w": float(np.linalg.norm(Sact @ np.abs(wo))),
                    "sabs_F": float(np.linalg.norm(Sabs)), "sact_F": float(np.linalg.norm(Sact)),
                    "dm_F": float(np.linalg.norm(dm)),
                    "wo_F": float(np.linalg.norm(wo)),
                    "t_max": float(np.abs(t).max()),
                    "distinct": int(np.unique(P.u_b, axis=0).shape[0])})
    out = {"check": "delta_m_rank", "rows": out_rows,
           "rank_max": max(x["rank"] for x in out_rows), "d": d,
           "sigma_ratio_after_d_max": worst(x["sigma_ratio_after_d"] for x in out_rows),
           "ok": all(x["ok"] for x in out_rows)}
    return out, sup


# ---------------------------------------------------------------------------------------------
# no global affine readout (the run's first context)
# ---------------------------------------------------------------------------------------------
def pairs(Q: int) -> list[tuple[int, int]]:
    """``(a, b)``, ``a < b``, in row-major order."""
    return [(a, b) for a in range(Q) for b in range(a + 1, Q)]


def barycentric(Q: int, prs: list[tuple[int, int]]) -> np.ndarray:
    """``B`` with ``u_k = B_k U_Q``: unit rows for the queries, ``(e_a + e_b)/2`` per pair."""
    B = np.zeros((Q + len(prs), Q))
    B[np.arange(Q), np.arange(Q)] = 1.0
    for n, (a, b) in enumerate(prs):
        B[Q + n, a] = B[Q + n, b] = 0.5
    return B


def mp_solve(A: list[list], Bm: list[list]) -> list[list]:
    """``A X = B`` in mpmath (``A`` square and small: its inverse times ``B``)."""
    Ai = mp.inverse(mp.matrix(A))
    n = Ai.rows
    return [[mp.fdot([Ai[i, k] for k in range(n)], [row[j] for row in Bm])
             for j in range(len(Bm[0]))] for i in range(n)]


def least_squares(B: np.ndarray, Y: np.ndarray, dps: int) -> tuple[np.ndarray, np.ndarray]:
    """``Z = argmin ||B Z - Y||_F`` (``B`` of full column rank: the normal equations, exact
    ``B``) and the residual ``Y - B Z``, in mpmath, returned as float64."""
    with mp.workdps(dps):
        Bm = [[mp.mpf(float(x)) for x in row] for row in B]
        Ym = [[mp.mpf(float(x)) for x in row] for row in Y]
        n, q = len(Bm), len(Bm[0])
        G = [[mp.fsum(Bm[k][a] * Bm[k][b] for k in range(n)) for b in range(q)] for a in range(q)]
        R = [[mp.fsum(Bm[k][a] * Ym[k][l] for k in range(n)) for l in range(Y.shape[1])]
             for a in range(q)]
        Z = mp_solve(G, R)
        res = [[Ym[k][l] - mp.fsum(Bm[k][a] * Z[a][l] for a in range(q))
                for l in range(Y.shape[1])] for k in range(n)]
        return (np.array([[float(x) for x in row] for row in Z]),
                np.array([[float(x) for x in row] for row in res]))


def min_norm(U: np.ndarray, Z: np.ndarray, dps: int) -> tuple[np.ndarray, float]:
    """The minimum-norm ``M`` with ``U M = Z`` (``U`` of full row rank):
    ``M = U^T W``, ``W = (U U^T)^(-1) Z`` solved in mpmath and rounded to float64, the
    ``Q``-term product in float64; and the bound of that product's rounding,
    ``gamma_(Q+1) | |U|^T |W| |_F`` (W's own rounding included)."""
    with mp.workdps(dps):
        Um = [[mp.mpf(float(x)) for x in row] for row in U]
        q = len(Um)
        G = [[mp.fdot(Um[a], Um[b]) for b in range(q)] for a in range(q)]
        W = mp_solve(G, [[mp.mpf(float(x)) for x in row] for row in Z])
        Wf = np.array([[float(x) for x in row] for row in W])
    n = q + 1
    return U.T @ Wf, n * U64 / (1 - n * U64) * float(np.linalg.norm(np.abs(U).T @ np.abs(Wf)))


def outputs(P, Xq: np.ndarray, lay: dict, layout: str, N: int, dps: int) -> np.ndarray:
    """The oracle's softmax outputs of inputs ``Xq`` (``n x m``) at position ``N`` on the bank."""
    u = np.hstack((Xq, np.ones((Xq.shape[0], 1))))
    q = P.tau * rotate(u @ P.wq, lay["cos"][N], lay["sin"][N], layout)
    cols = [[mp.mpf(float(e)) for e in col] for col in P.v.T]
    return np.stack([softmax_output(q[k] @ P.k.T, cols, dps) for k in range(len(q))])


def hull(M: np.ndarray, v: np.ndarray, mu: np.ndarray, xq: np.ndarray) -> tuple[dict, dict]:
    """Section 7's witness for ``M`` (section 12.9), and its sizes."""
    Mx, M0 = M[:-1], M[-1]
    Uu, sv, _ = np.linalg.svd(Mx, full_matrices=False)
    sig = float(sv[0])
    R = float(np.max(np.linalg.norm(v - mu, axis=1)))
    last = float(np.linalg.norm(M0))
    if not sig > 0:
        return {"x_part_zero": True}, {}
    t = 1.01 * (last + R + 1.0) / sig
    grow = float(np.linalg.norm((t * Uu[:, 0]) @ Mx))
    norms = np.sort(np.linalg.norm(xq, axis=1))
    med = float(norms[(norms.size - 1) // 2])  # the lower median
    return ({"x_part_zero": False, "t": t, "certified": grow - last - R,
             "t_over_input_norm": t / med},
            {"sig": sig, "R": R, "last": last, "t": t, "med": med})


def no_global_readout(Ps: list, lay: dict, facts: dict, xq: np.ndarray,
                      dps: int) -> tuple[dict | None, dict]:
    """Section 12.9's ``no_global_readout`` (None for ``Q < 2``) and its sizes."""
    Q, m = xq.shape
    if Q < 2:
        return None, {}
    H, r, layout = facts["n_heads"], facts["r"], facts["layout"]
    N = Ps[0].k.shape[0]
    prs = pairs(Q)
    X = np.vstack((xq, np.array([(xq[a] + xq[b]) / 2 for a, b in prs])))
    Pn = X.shape[0]
    B = barycentric(Q, prs)
    Uq = np.hstack((xq, np.ones((Q, 1))))
    heads, sup_h, ys = [], [], []
    for h in range(H):
        P = Ps[h]
        y = outputs(P, X, lay, layout, N, dps)
        ys.append(y)
        mu = P.v.mean(axis=0)
        S = float(np.abs(P.v).max())
        lower = np.array([np.linalg.norm(y[Q + n] - (y[a] + y[b]) / 2) / 2
                          for n, (a, b) in enumerate(prs)])
        k = int(np.argmax(lower))
        best = float(lower[k])
        err = math.sqrt(r) * FLOAT64_REL * S + 4 * U64 * best
        Z, res = least_squares(B, y - mu, dps)
        M, M_own = min_norm(Uq, Z, dps)
        hl, hs = hull(M, P.v, mu, xq)
        cert = best - err
        heads.append({"head": h, "pair": list(prs[k]), "lower_computed": best,
                      "float64_error": err, "lower_certified": cert,
                      "upper": float(np.max(np.linalg.norm(res, axis=1))), "hull": hl,
                      "ok": bool(finite(best, err) and cert > 0)})
        sup_h.append({"V": S, "lower": lower, "Ymu": float(np.linalg.norm(y - mu)),
                      "Z": float(np.linalg.norm(Z)), "M": float(np.linalg.norm(M)),
                      "res": float(np.linalg.norm(res)), "M_own": M_own, **hs})
    comb, sup_c = None, {}
    if "w_o" in lay:
        wo = lay["w_o"].astype(np.float64)  # (H, r, D)
        o = sum(ys[h] @ wo[h] for h in range(H))
        lo = np.array([np.linalg.norm(o[Q + n] - (o[a] + o[b]) / 2) / 2
                       for n, (a, b) in enumerate(prs)])
        k = int(np.argmax(lo))
        ob = float(lo[k])
        D = wo.shape[-1]
        S = np.array([float(np.abs(P.v).max()) for P in Ps])
        colsum = (S[:, None] * np.abs(wo).sum(axis=1)).sum(axis=0)  # sum_h S_h |W_o,h[:, c]|_1
        absw = sum(np.abs(ys[h]) @ np.abs(wo[h]) for h in range(H))  # (Pn, D)
        prod_round = H * r * U64 * float(absw.max())
        oerr = math.sqrt(D) * (FLOAT64_REL * float(colsum.max()) + 2 * prod_round) + 4 * U64 * ob
        comb = {"pair": list(prs[k]), "lower_computed": ob, "float64_error": oerr,
                "lower_certified": ob - oerr, "ok": bool(finite(ob, oerr) and ob - oerr > 0)}
        sup_c = {"lower": lo, "w1": [float(np.abs(wo[h]).sum(axis=0).max()) for h in range(H)],
                 "absw": float(absw.max())}
    out = {"check": "no_global_readout", "queries": Q, "pairs": len(prs), "inputs": Pn,
           "heads": heads, "combined": comb,
           "lower_certified_min": least(x["lower_certified"] for x in heads),
           "tolerance": 0.0, "ok": all(x["ok"] for x in heads) and (comb is None or comb["ok"])}
    return out, {"heads": sup_h, "combined": sup_c, "sv_U": np.linalg.svd(Uq, compute_uv=False),
                 "B_sv": np.linalg.svd(B, compute_uv=False), "P": Pn, "m": m,
                 "u_max": float(np.max(np.linalg.norm(Uq, axis=1)))}


# ---------------------------------------------------------------------------------------------
# the oracle rows
# ---------------------------------------------------------------------------------------------
def oracle_sample(n_contexts: int, H: int, prefix_len: int, k: int, seed: int
                  ) -> dict[int, list[tuple[int, int]]]:
    """Section 12.9's seeded sample, grouped by context."""
    hi = min(EXACT_BANK[1], prefix_len - 1)
    lo = min(EXACT_BANK[0], hi - 1)
    grid = [(c, h, i) for c in range(n_contexts) for h in range(H) for i in range(lo, hi)]
    if not k:
        return {}
    pick = np.random.default_rng([seed, 9]).choice(len(grid), size=min(k, len(grid)),
                                                   replace=False)
    out: dict[int, list[tuple[int, int]]] = {}
    for j in sorted(int(t) for t in pick):
        c, h, i = grid[j]
        out.setdefault(c, []).append((h, i))
    return out


def _mpv(a) -> list:
    return [mp.mpf(float(x)) for x in np.asarray(a).ravel()]


def _rot_mp(z: list, cos: np.ndarray, sin: np.ndarray, layout: str) -> list:
    """``rot`` of one mpf vector with one table row (exact in mpmath)."""
    d = len(z)
    out = [None] * d
    for l in range(d // 2):
        a, b = (l, l + d // 2) if layout == "half" else (2 * l, 2 * l + 1)
        c, s = mp.mpf(float(cos[l])), mp.mpf(float(sin[l]))
        out[a], out[b] = z[a] * c - z[b] * s, z[b] * c + z[a] * s
    return out


@dataclass
class OracleRow:
    """One row's exact quantities (rounded once to float64) and the reference's float64 ones."""

    y: np.ndarray
    c: np.ndarray
    dm: np.ndarray
    scale: np.ndarray
    kappa: float
    smax: float
    S: float
    y64: np.ndarray
    c64: np.ndarray
    dm64: np.ndarray
    readout64: np.ndarray
    sabs_ratio: float  # max_pq Sabs_pq / scale_pq (absolute terms over the scale)
    sabs_norm_ratio: float  # max_pq Sabs_pq / max_pq scale_pq
    qk_max: float  # max_j sum_l Qabs_l Kabs_jl: the scores' absolute terms
    kappa_abs: float  # sum_j |c_j| qk_j (|v_j - mu|_inf + |v_j|_inf) / S
    vabs_ratio: float  # max_jq (|u_j| |W^_v|)_q / S: the values' absolute terms


def oracle_row(x: np.ndarray, lay: dict, facts: dict, h: int, i: int,
               digits: int = DIGITS) -> OracleRow:
    """Row ``(h, i)`` of the causal prefix: query ``i`` at position ``i``, keys ``j = 0 .. i`` at
    positions ``j``; exact in mpmath at ``digits + GUARD_DIGITS`` digits from the dumped numbers,
    and in float64 (numpy, input space)."""
    g = h // (facts["n_heads"] // facts["n_kv_heads"])
    layout, cos, sin = facts["layout"], lay["cos"], lay["sin"]
    n = i + 1
    u = np.hstack((x[:n].astype(np.float64), np.ones((n, 1))))
    wq = augmented(lay["w_q"], lay.get("b_q"), h)
    wk = augmented(lay["w_k"], lay.get("b_k"), g)
    wv = augmented(lay["w_v"], lay.get("b_v"), g)
    tau = float(lay["score_scale"][h])
    with mp.workdps(digits + GUARD_DIGITS):
        U = [_mpv(row) for row in u]
        cq, ck, cv = ([_mpv(col) for col in w.T] for w in (wq, wk, wv))
        T = mp.mpf(tau)
        q = [T * e for e in _rot_mp([mp.fdot(U[i], col) for col in cq], cos[i], sin[i], layout)]
        k = [_rot_mp([mp.fdot(U[j], col) for col in ck], cos[j], sin[j], layout)
             for j in range(n)]
        v = [[mp.fdot(U[j], col) for col in cv] for j in range(n)]
        s = [mp.fdot(q, kj) for kj in k]
        top = max(s)
        e = [mp.exp(sj - top) for sj in s]
        Z = mp.fsum(e)  # Z e^(-top)
        r = len(cv)
        y = [mp.fdot(e, [v[j][l] for j in range(n)]) / Z for l in range(r)]
        mu = [mp.fsum(v[j][l] for j in range(n)) / n for l in range(r)]
        c = [(mp.expm1(sj) / sj if sj != 0 else mp.mpf(1)) * mp.exp(-top) / Z for sj in s]
        # a_j = tau W^_q rot(k~_j, -i)^T: the transpose of query i's rotation
        rows_q = [_mpv(wq[p]) for p in range(wq.shape[0])]
        a = [[mp.fdot(row, kr) * T for row in rows_q]
             for kr in (_rot_mp(kj, cos[i], -sin[i], layout) for kj in k)]
        tt = [[v[j][l] - mu[l] for l in range(r)] for j in range(n)]
        D = wq.shape[0]
        dm = [[mp.fsum(c[j] * a[j][p] * tt[j][l] for j in range(n)) for l in range(r)]
              for p in range(D)]
        S = max(abs(x_) for row in v for x_ in row)
        kap = mp.fsum(abs(c[j]) * mp.fsum(abs(ql) * abs(kl) for ql, kl in zip(q, k[j]))
                      * (max(abs(x_) for x_ in tt[j]) + max(abs(x_) for x_ in v[j]))
                      for j in range(n)) / S
        smax = max(abs(sj) for sj in s)
        f = np.vectorize(float, otypes=[np.float64])
        yF, cF, dmF = f(np.array(y, object)), f(np.array(c, object)), f(np.array(dm, object))
        aF, vF = f(np.array(a, object)), f(np.array(v, object))
        muF = f(np.array(mu, object))
        kappa, smaxF, SF = float(kap), float(smax), float(S)
    scale = (np.abs(cF)[:, None] * np.abs(aF)).T @ (np.abs(vF - muF) + np.abs(vF))
    # the reference's float64 evaluation of the same row
    q64 = tau * rotate(u[i] @ wq, cos[i], sin[i], layout)
    k64 = rotate(u @ wk, cos[:n], sin[:n], layout)
    v64 = u @ wv
    s64 = k64 @ q64
    w = np.exp(s64 - s64.max())
    y64 = (w @ v64) / w.sum()
    c64 = coefficients(s64)
    a64 = tau * rotate(k64, cos[i], -sin[i], layout) @ wq.T
    mu64 = v64.mean(axis=0)
    dm64 = np.einsum("jm,j,jr->mr", a64, c64, v64 - mu64)
    kabs = abs_projection(u, np.abs(wk), layout)
    A = tau * kabs @ np.abs(wq).T
    vabs = np.abs(u) @ np.abs(wv)
    sabs = np.einsum("j,jm,jr->mr", np.abs(cF), A, vabs + vabs.max(axis=0))
    qabs = tau * abs_projection(u[i], np.abs(wq), layout)
    qkabs = kabs @ qabs
    vn = np.abs(vF - muF).max(axis=1) + np.abs(vF).max(axis=1)
    return OracleRow(y=yF, c=cF, dm=dmF, scale=scale, kappa=kappa, smax=smaxF, S=SF, y64=y64,
                     c64=c64, dm64=dm64, readout64=mu64 + u[i] @ dm64,
                     sabs_ratio=float(np.max(sabs / np.maximum(scale, SCALE_GUARD))),
                     sabs_norm_ratio=float(sabs.max() / max(float(scale.max()), SCALE_GUARD)),
                     qk_max=float(qkabs.max()),
                     kappa_abs=float(np.sum(np.abs(cF) * qkabs * vn) / SF),
                     vabs_ratio=float(vabs.max() / SF))


def exact_rows(x_prefix: np.ndarray, lay: dict, facts: dict, rows: list[tuple[int, int]],
               digits: int = DIGITS) -> tuple[dict, list[OracleRow]]:
    """Section 12.9's ``exact_rows`` of one context, the reference's float64 evaluation in the
    place of the report's, and the rows' exact quantities."""
    d, m = facts["head_dim"], facts["hidden"]
    out_rows, sup = [], []
    for h, i in dict.fromkeys(rows):
        o = oracle_row(x_prefix, lay, facts, h, i, digits)
        S = max(o.S, SCALE_GUARD)
        err = np.abs(o.dm64 - o.dm)
        N = i + 1
        ro_tol = max(FLOAT64_REL, (N + d + 8 + o.smax) * U64 * o.kappa)
        row = {"head": h, "query": i, "position": i, "keys": N,
               "y_rel": float(np.abs(o.y64 - o.y).max() / S),
               "delta_m_rel": float(err.max() / max(float(o.scale.max()), SCALE_GUARD)),
               "delta_m_rel_entrywise": float((err / np.maximum(o.scale, SCALE_GUARD)).max()),
               "c_rel": float((np.abs(o.c64 - o.c) / np.maximum(np.abs(o.c), SCALE_GUARD)).max()),
               "readout_rel": float(np.abs(o.readout64 - o.y).max() / S),
               "readout_tol": ro_tol, "kappa": o.kappa, "score_max": o.smax,
               "c_min_exact": float(o.c.min()), "first_order": (N + d + m + 8 + o.smax) * U64}
        row["ok"] = bool(all(finite(row[k]) and row[k] <= FLOAT64_REL
                             for k in ("y_rel", "delta_m_rel", "c_rel"))
                         and finite(row["readout_rel"]) and row["readout_rel"] <= ro_tol)
        out_rows.append(row)
        sup.append(o)
    out = {"check": "exact_rows", "digits": digits, "rows": out_rows,
           **{f"{k}_max": worst(x[k] for x in out_rows)
              for k in ("y_rel", "delta_m_rel", "c_rel", "readout_rel")},
           "tolerance": FLOAT64_REL, "ok": all(x["ok"] for x in out_rows)}
    return out, sup


# ---------------------------------------------------------------------------------------------
# the section
# ---------------------------------------------------------------------------------------------
def pool(per_ctx: list[dict]) -> dict:
    """Section 12.9's pooled fields of the four checks."""
    out: dict = {}
    for name, fields in POOLED.items():
        recs = [r[name] for r in per_ctx if r.get(name) is not None]
        if not recs:
            continue
        agg: dict = {"contexts": len(recs), "ok": all(bool(r["ok"]) for r in recs)}
        for f in fields:
            vals = [r[f] for r in recs]
            agg[f] = least(vals) if f.startswith(("min", "lower")) or f.endswith("_min") \
                else worst(vals)
        out[name] = agg
    return out


@dataclass
class Claims:
    """``report``: ``{"layers": {L: {"real_heads": {"per_context": [...], <check>: {...}}}}}``
    with the four checks only; ``support[(L, c)]``: per check the sizes behind its tolerances."""

    manifest: dict
    report: dict
    support: dict = field(default_factory=dict)


def _projected(item: dict, lay: dict, facts: dict, h: int):
    """Section 12's projections of head ``h`` (:func:`ropestep.reference.validate.project`) with
    the sizes the tolerances need: ``wk_abs = |W^_k|``, ``wv = W^_v``, the absolute terms of the
    rotated keys and effective queries ``K_abs`` (``|u_j| |W^_k|``, ``N x d``) and ``Q_abs``
    (``tau |u_i| |W^_q|``, ``Q x d``), each rotation pair's two components summed, and
    ``A_abs`` (``N x (m+1)``),
    ``A_jp = tau sum_l |W^_q[p, l]| K_jl``, ``K_jl`` the absolute terms of the rotated key's
    component (``|u_j| |W^_k|``, the rotation pair's two summed): a bound of the absolute terms
    behind ``a_jp`` in either side's evaluation."""
    P = project(item, lay, facts, h)
    g = h // (facts["n_heads"] // facts["n_kv_heads"])
    P.wk_abs = np.abs(augmented(lay["w_k"], lay.get("b_k"), g))
    P.wv = augmented(lay["w_v"], lay.get("b_v"), g)
    P.K_abs = abs_projection(P.u_b, P.wk_abs, facts["layout"])
    P.Q_abs = P.tau * abs_projection(P.u_q, np.abs(P.wq), facts["layout"])
    P.A_abs = P.tau * P.K_abs @ np.abs(P.wq).T
    return P


def recompute(path: str | Path, *, dps: int = 30, digits: int = DIGITS) -> Claims:
    """The four checks of every dumped ``(context, layer)`` item (section 12.9)."""
    dump = load(path)
    man = dump.manifest
    proto, cfg = man["protocol"], man["config"]
    seed = int(proto["seed"])
    items = [tuple(x) for x in man["items"]]
    contexts = sorted({c for c, _ in items})
    layers = sorted({L for _, L in items})
    any_facts = man["layers"][str(layers[0])]
    oracle = oracle_sample(len(contexts), any_facts["n_heads"], int(proto["prefix_len"]),
                           int(cfg["exact_rows"]), seed)
    report: dict = {"layers": {}}
    support: dict = {}
    for L in layers:
        lay, facts = dump.layer(L), dict(man["layers"][str(L)])
        per_ctx = []
        for c in contexts:
            item = dump.item(c, L)
            Ps = [_projected(item, lay, facts, h) for h in range(facts["n_heads"])]
            rec: dict = {"context": c}
            sup: dict = {}
            rec["positive_coefficients"], sup["positive_coefficients"] = \
                positive_coefficients(Ps)
            if c == contexts[0]:
                Q = Ps[0].q.shape[0]
                rows = rank_rows(seed, c, L, facts["n_heads"], Q)
                rec["rank"], sup["rank"] = rank(Ps, lay, facts, rows)
                rec["no_global_readout"], sup["no_global_readout"] = no_global_readout(
                    Ps, lay, facts, item["x_query"].astype(np.float64), dps)
            if oracle.get(c):
                rec["exact_rows"], sup["exact_rows"] = exact_rows(
                    item["x_bank"].astype(np.float64), lay, facts, oracle[c], digits)
            per_ctx.append(rec)
            support[(L, c)] = sup
        report["layers"][str(L)] = {"real_heads": {"per_context": per_ctx, **pool(per_ctx)}}
    return Claims(manifest=man, report=report, support=support)
