"""``ropestep validate``'s ``reconstruction``, ``reuse``, ``calibration``, ``descent`` and
``fast`` sections and its ``verdict`` recomputed from its ``--dump-raw`` directory
(docs/protocol.md section 12), independently of the code that wrote them.

Written from that section alone, one head and one query at a time, in the paper's form wherever
there is a choice, so that nothing is shared with the fast layer (which works in query space,
batched over heads and queries):

* the softmax outputs ``y_i`` (prefix bank), ``y^F_i`` (full bank) and the self mass ``pi_i`` are
  the oracle: mpmath at ``dps`` digits from the float64 scores and values (the only rounding left
  in them is that of the float64 projections, far below every tolerance they are compared under);
* the input-space features ``a_j = tau W^_q rot(k~_j, -N)^T`` are formed explicitly in
  ``R^(m+1)``, ``Delta M_i = sum_j c_ij a_j (v_j - mu)^T`` is materialised, and every frozen
  prediction is ``mu + u_i^T Delta M_a``;
* ``lambda_max`` comes from the ``n x n`` Gram matrix of the weighted features
  (:func:`ropestep.reference.atlas.unit_step`), not from a ``(d+1) x (d+1)`` factor form;
* the statistics (medians, quantiles, average ranks, bins, pooling) follow the section's
  definitions with plain loops and sorts.

The identity-type fields of ``reconstruction`` (readout against softmax output, the relation,
the means, the projected writes) and the ``checks`` of ``calibration`` that compare two
evaluations of one quantity are rounding errors: their exact value, which is what a reference
can give, is 0 (and every pass flag resting on them true).

The ``fast`` section's numbers are float32 roundings in an order no reference can reproduce:
the reference gives their exact values, those of the same expressions with the fast path's
outputs replaced by the exact output of its own rounded problem (:class:`FastRows`: the inputs
and weights rounded to the storage dtype, so bfloat16's own effect is recomputed, not
tolerated), and the sizes that bound the float32 rounding around them.  The ``verdict`` pools
the recomputed checks; ``real_heads`` (not recomputed) is not among them, so it is the verdict
of a run whose real-head checks pass.

Besides the report (:attr:`Reference.report`) the per-query values behind it are kept
(:attr:`Reference.rows`, :class:`HeadRows`, :class:`WriteRows`): the tolerances of a comparison
are derived from them (``tests/test_reference_validate.py``).

Limits: float32 runs only (the dump of a bfloat16 model holds bf16 tensors, which numpy cannot
read); the ``"dot"`` score family (the only one ``ropestep validate`` accepts).

Imports: numpy, mpmath, safetensors' numpy reader and :mod:`ropestep.reference.atlas`'s helpers;
nothing else of ropestep and not torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mpmath as mp
import numpy as np

from .atlas import Dump, augmented, rho, rotate, softmax_output, unit_step  # the same dump layout

MANIFEST, SCHEMA = "validate_raw.json", "ropestep.validate-raw/1"
PREDICTORS = ("constant", "mean", "frozen", "linear")
DISTANCES = ("score_sup", "tv", "input")
N_BINS = 5
# the constants of docs/protocol.md section 12.1 (section 5's pass criteria)
TOLERANCES = {"identity_head": [2e-9, 2e-8], "identity_write": [3e-9, 3e-8],
              "native": {"float32": {"atol": 3e-5, "rtol": 3e-4},
                         "bfloat16": {"normwise": 0.125}}}
FLOAT32_NATIVE = (3e-5, 3e-4)
VIOLATION_REL, VIOLATION_ABS = 1e-9, 1e-12  # the slack of a reuse-bound violation


# ---------------------------------------------------------------------------------------------
# the dump
# ---------------------------------------------------------------------------------------------
def load(path: str | Path) -> Dump:
    """Open a dump; refuse what this reference does not cover (another schema, a bf16 run, a
    score family other than ``"dot"``, or a window, chunks, soft-cap, clip, sinks, ALiBi, a
    query temperature or an output gate)."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a validate raw dump (schema {manifest.get('schema')!r})")
    if manifest["config"]["dtype"] != "float32":
        raise ValueError(f"{path}: the reference covers float32 runs, this one is "
                         f"{manifest['config']['dtype']}")
    bad = [L for L, f in manifest["layers"].items() if f["family"] != "dot"]
    if bad:
        raise ValueError(f"{path}: layer {bad[0]} is not of the 'dot' family")
    for L, f in manifest["layers"].items():  # a causal, uncapped, unbiased, ungated score
        extra = [k for k in ("window", "chunk", "softcap", "clip", "query_temperature",
                             "output_gate") if f.get(k) is not None]
        extra += [k for k in ("sinks", "alibi") if f.get(k)]
        if extra:
            raise ValueError(f"{path}: layer {L} has {', '.join(extra)}; the validate "
                             "reference covers plain causal heads only")
    return Dump(path, manifest)


# ---------------------------------------------------------------------------------------------
# one head of one (context, layer) item
# ---------------------------------------------------------------------------------------------
@dataclass
class HeadRows:
    """Everything one head of one item contributes (float64; ``Q`` queries, ``N`` bank keys).

    Outputs: ``y``, ``yF`` (``Q x r``), ``mu`` (``r``), ``pi`` (``Q``), ``frozen`` (``Q x Q x r``,
    ``[a, i]`` = anchor ``a``'s prediction of query ``i``), ``linear`` (``Q x r``), ``g``
    (``u_i^T Delta M_0``, ``Q x r``), ``bound`` (``Q``), the distances (``Q`` each) and the
    descent rows.  The model's numbers: ``native`` (``Q x r``), ``observed`` (``r``), ``pi_native``
    (``Q``, or None).  Sizes for tolerances: ``tau``, ``lq2``, ``V`` (the largest ``|v|`` of the full bank),
    ``kappa_P``/``kappa_F`` (the readouts' condition numbers, docs/protocol.md section 11's
    ``kappa``, prefix and full bank), ``sigma_P``/``sigma_F`` (largest ``|s|``), ``kappa_fr``
    (``Q x Q``: anchor ``a``'s coefficients read with query ``i``'s query), ``kappa_tok`` (the
    tokenwise sum's), ``qk`` (``Q x N``: ``sum_l |q_il| |k~_jl|``), ``w_o`` (``r x D``).
    """

    head: int
    y: np.ndarray
    yF: np.ndarray
    mu: np.ndarray
    pi: np.ndarray
    frozen: np.ndarray
    linear: np.ndarray
    g: np.ndarray
    bound: np.ndarray
    dist: dict[str, np.ndarray]
    descent: dict[str, np.ndarray]
    native: np.ndarray
    observed: np.ndarray
    pi_native: np.ndarray | None
    V: float
    kappa_P: np.ndarray
    kappa_F: np.ndarray
    sigma_P: np.ndarray
    sigma_F: np.ndarray
    kappa_fr: np.ndarray
    kappa_tok: np.ndarray
    qk: np.ndarray
    w_o: np.ndarray
    tau: float
    lq2: float  # tau^2 |W^_q|_F^2: with 1 added, |[L | e_(m+1)]|_F^2 of the input-space form
    fast: dict[str, FastRows] = field(default_factory=dict)  # per storage dtype (section 12.5)


@dataclass
class Projected:
    """One head's projections of one item (float64)."""

    u_b: np.ndarray  # (N, m+1) bank inputs
    u_q: np.ndarray  # (Q, m+1) query inputs
    x_q: np.ndarray  # (Q, m)
    q: np.ndarray  # (Q, d) effective queries at position N
    k: np.ndarray  # (N, d) rotated bank keys
    v: np.ndarray  # (N, r) bank values
    k_self: np.ndarray  # (Q, d) each query's own rotated key at position N
    v_self: np.ndarray  # (Q, r) each query's own value
    a: np.ndarray  # (N, m+1) input-space features a_j
    tau: float
    wq: np.ndarray  # (m+1, d) W^_q


def project(item: dict, lay: dict, facts: dict, h: int) -> Projected:
    """Project head ``h`` of one item as docs/protocol.md section 12 says (float64)."""
    x_b, x_q = item["x_bank"].astype(np.float64), item["x_query"].astype(np.float64)
    N = x_b.shape[0]
    if not (np.array_equal(item["positions_bank"], np.arange(N))
            and np.all(item["positions_query"] == N)):
        raise ValueError("positions: the bank must be 0..N-1 and every query at N")
    g = h // (facts["n_heads"] // facts["n_kv_heads"])
    u_b = np.hstack((x_b, np.ones((N, 1))))
    u_q = np.hstack((x_q, np.ones((x_q.shape[0], 1))))
    cos, sin, layout = lay["cos"], lay["sin"], facts["layout"]
    tau = float(lay["score_scale"][h])
    wq = augmented(lay["w_q"], lay.get("b_q"), h)
    wk = augmented(lay["w_k"], lay.get("b_k"), g)
    wv = augmented(lay["w_v"], lay.get("b_v"), g)
    k = rotate(np.einsum("jm,ml->jl", u_b, wk), cos[:N], sin[:N], layout)
    q = tau * rotate(np.einsum("im,ml->il", u_q, wq), cos[N], sin[N], layout)
    k_self = rotate(np.einsum("im,ml->il", u_q, wk), cos[N], sin[N], layout)
    a = tau * np.einsum("jl,ml->jm", rotate(k, cos[N], -sin[N], layout), wq)
    return Projected(u_b, u_q, x_q, q, k, np.einsum("jm,ml->jl", u_b, wv), k_self,
                     np.einsum("im,ml->il", u_q, wv), a, tau, wq)


def self_mass(s: np.ndarray, sigma: float, dps: int) -> float:
    """``pi = e^sigma / (sum_j e^(s_j) + e^sigma)`` in mpmath at ``dps`` digits."""
    with mp.workdps(dps):
        top = mp.mpf(float(max(np.max(s), sigma)))
        z = mp.fsum(mp.exp(mp.mpf(float(x)) - top) for x in s)
        e = mp.exp(mp.mpf(float(sigma)) - top)
        return float(e / (z + e))


def coefficients(s: np.ndarray) -> np.ndarray:
    """Original-gauge ``c_j = rho(s_j) / Z``, ``Z = sum_j e^(s_j)`` (computed as
    ``rho(s_j) e^(-top) / sum_j e^(s_j - top)``)."""
    top = float(np.max(s))
    return rho(s) * np.exp(-top) / np.sum(np.exp(s - top))


def condition(c: np.ndarray, qk: np.ndarray, v: np.ndarray, mu: np.ndarray) -> float:
    """``sum_j |c_j| qk_j (|v_j - mu|_inf + |v_j|_inf) / max_j |v_j|_inf`` (docs/protocol.md
    section 11's ``kappa``)."""
    vn = np.abs(v - mu).max(axis=1) + np.abs(v).max(axis=1)
    return float(np.sum(np.abs(c) * qk * vn) / np.abs(v).max())


def op_norm(M: np.ndarray) -> float:
    """The largest singular value of ``M`` (``(m+1) x r``): the square root of the largest
    eigenvalue of the ``r x r`` matrix ``M^T M`` (the largest singular value keeps its relative
    accuracy through the squaring; a full SVD of the tall matrix costs far more)."""
    return math.sqrt(max(float(np.linalg.eigvalsh(np.einsum("mr,ms->rs", M, M))[-1]), 0.0))


def descent_row(a: np.ndarray, c: np.ndarray, t: np.ndarray) -> dict[str, float]:
    """The unit step of one query (:func:`ropestep.reference.atlas.unit_step`): ``lam``,
    ``flag``, ``delta = E(B) - E(0)``; for the rounding of a decision its size ``quad + |B|^2``,
    the step's condition number ``cond``, ``e0 = E(0)`` and ``trace = tr H``."""
    st = unit_step(a, c, t)
    quad = 0.5 * float(np.sum(c * np.sum(np.einsum("jl,lr->jr", a, st.B) ** 2, axis=1)))
    norm = float(np.sum(st.B * st.B))
    return {"lam": st.lam, "flag": st.flag, "delta": quad - norm, "size": quad + norm,
            "cond": st.cond, "e0": 0.5 * float(np.sum(c * np.sum(t * t, axis=1))),
            "trace": float(np.sum(c * np.sum(a * a, axis=1)))}


def oracle_outputs(P: Projected, s: np.ndarray, sig: np.ndarray,
                   dps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The oracle's ``y_i`` (prefix bank), ``y^F_i`` (full bank) and ``pi_i`` of every query."""
    Q, r = s.shape[0], P.v.shape[1]
    cols = [[mp.mpf(float(e)) for e in col] for col in P.v.T]
    y, yF, pi = np.zeros((Q, r)), np.zeros((Q, r)), np.zeros(Q)
    for i in range(Q):
        y[i] = softmax_output(s[i], cols, dps)
        full = [col + [mp.mpf(float(P.v_self[i, l]))] for l, col in enumerate(cols)]
        yF[i] = softmax_output(np.append(s[i], sig[i]), full, dps)
        pi[i] = self_mass(s[i], sig[i], dps)
    return y, yF, pi


def readout_conditions(P: Projected, s: np.ndarray, sig: np.ndarray, c: np.ndarray,
                       qk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``kappa`` of every query's readout on the prefix bank and on the full bank."""
    mu = P.v.mean(axis=0)
    kP, kF = np.zeros(len(s)), np.zeros(len(s))
    for i in range(len(s)):
        vF = np.vstack((P.v, P.v_self[i]))
        kP[i] = condition(c[i], qk[i], P.v, mu)
        kF[i] = condition(coefficients(np.append(s[i], sig[i])),
                          np.append(qk[i], np.abs(P.q[i]) @ np.abs(P.k_self[i])), vF,
                          vF.mean(axis=0))
    return kP, kF


def descent_rows(P: Projected, s: np.ndarray, sig: np.ndarray,
                 c: np.ndarray) -> dict[str, np.ndarray]:
    """Every query's unit step in input space (``*_in``) and query space (``*_q``) on the
    prefix bank, and the replication's (``*_rep``, query 0 on the full bank)."""
    t = P.v - P.v.mean(axis=0)
    rows: dict[str, list] = {}
    for i in range(len(s)):
        for space, feats in (("in", P.a), ("q", P.tau * P.k)):
            for key, val in descent_row(feats, c[i], t).items():
                rows.setdefault(f"{key}_{space}", []).append(val)
    out = {k: np.asarray(v) for k, v in rows.items()}
    out.update({f"{k}_rep": np.asarray(v) for k, v in replication_row(P, s[0], sig[0]).items()})
    return out


def distances(P: Projected, s: np.ndarray) -> dict[str, np.ndarray]:
    """Each query's distances from the anchor (query 0): scores (sup norm), attention rows
    (total variation), layer inputs (Euclidean)."""
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return {"score_sup": np.abs(s - s[0]).max(axis=1), "tv": 0.5 * np.abs(p - p[0]).sum(axis=1),
            "input": np.linalg.norm(P.x_q - P.x_q[0], axis=1)}


# ---------------------------------------------------------------------------------------------
# the fast path's problems (section 12.5)
# ---------------------------------------------------------------------------------------------
FAST_DTYPES = ("float32", "bfloat16")
GAUGES = ("original", "maxkey")
U32 = 2.0 ** -24  # float32's unit roundoff: the fast path's arithmetic for both storage dtypes
ROUNDED_INPUTS = ("x_bank", "x_query")
ROUNDED_WEIGHTS = ("w_q", "w_k", "w_v", "b_q", "b_k", "b_v")


def round_bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (round to nearest, ties to even, from its float32 value: every
    input here is a float32 number) and returned as float64."""
    b = np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def stored(tensors: dict, names: tuple[str, ...], dtype: str) -> dict:
    """A copy of ``tensors`` with ``names`` (where present) rounded to the storage ``dtype``:
    float32 leaves the captured values (already float32) as they are."""
    if dtype == "float32":
        return tensors
    return {k: round_bf16(v) if k in names else v for k, v in tensors.items()}


@dataclass
class FastRows:
    """One head of one item in one storage dtype of the fast path (section 12.5), from the
    inputs and weights rounded to that dtype, in float64.

    ``yF`` (``Q x r``): the full-bank output of the rounded problem; ``V``: its value scale
    (``max |v|`` over the full banks), ``sigma`` (``Q``): ``max_j |s_ij|`` over the full bank.
    Per gauge (``kappa[g]``, ``Q``): the readout's condition number (max key: at the float64
    argmax; ``kappa_hi[g]`` the largest and ``kappa_spread[g]`` the largest distance from it
    over the keys within ``2 ds`` of the top, any of which a float32 evaluation may take).  For
    the float32 rounding of that number (the largest over those keys): ``k_dA[g]`` =
    ``sum_j |c_j| V_j dA_j / S`` and ``k_A[g]`` = ``sum_j |c_j| A_j / S``, ``dA_j`` the bound of
    ``A_j``'s error, ``ds`` (``Q``) that of a float32 score's, ``dv`` that of a float32 value's
    (each from the absolute terms of the products: ``(m + 4) u`` per projection, rotation and
    scale, ``(d + 2) u`` per score), ``S`` (``Q``) the largest ``|v|``; ``top_gap`` (``Q``) the
    largest score minus the runner-up.
    """

    yF: np.ndarray
    V: float
    sigma: np.ndarray
    kappa: dict[str, np.ndarray]
    kappa_hi: dict[str, np.ndarray]
    kappa_spread: dict[str, np.ndarray]
    k_dA: dict[str, np.ndarray]
    k_A: dict[str, np.ndarray]
    ds: np.ndarray
    dv: float
    S: np.ndarray
    top_gap: np.ndarray  # (Q,) the largest score minus the second largest (the max key's margin)


def abs_projection(u: np.ndarray, w: np.ndarray, layout: str) -> np.ndarray:
    """``|u| |W^|`` with each rotation pair's two components added (a bound of the absolute
    terms of a projected, rotated component: ``|cos|, |sin| <= 1``)."""
    a = np.abs(u) @ np.abs(w)
    if layout == "half":
        h = a.shape[-1] // 2
        pair = a[..., :h] + a[..., h:]
        return np.concatenate((pair, pair), axis=-1)
    pair = a[..., 0::2] + a[..., 1::2]
    return np.repeat(pair, 2, axis=-1)


def fast_rows(item: dict, lay: dict, facts: dict, h: int) -> FastRows:
    """The rounded problem of head ``h`` (docs/protocol.md section 12.5)."""
    P = project(item, lay, facts, h)
    Q, d = P.q.shape
    m = P.u_b.shape[1] - 1
    g = h // (facts["n_heads"] // facts["n_kv_heads"])
    wq = augmented(lay["w_q"], lay.get("b_q"), h)
    wk = augmented(lay["w_k"], lay.get("b_k"), g)
    wv = augmented(lay["w_v"], lay.get("b_v"), g)
    layout = facts["layout"]
    qa = P.tau * abs_projection(P.u_q, wq, layout)  # (Q, d) >= |q_i| componentwise
    ka_b = abs_projection(P.u_b, wk, layout)  # (N, d)
    ka_s = abs_projection(P.u_q, wk, layout)  # (Q, d) own keys
    gp = (m + 4) * U32  # one float32 projection, rotation and scale: relative to |.| terms
    gd = (d + 2) * U32
    dv = float((m + 2) * U32 * max(np.max(np.abs(P.u_b) @ np.abs(wv)),
                                   np.max(np.abs(P.u_q) @ np.abs(wv))))
    yF = np.zeros((Q, P.v.shape[1]))
    sigma, ds, S, gap = (np.zeros(Q) for _ in range(4))
    kap = {gg: np.zeros(Q) for gg in GAUGES}
    kdA = {gg: np.zeros(Q) for gg in GAUGES}
    kA = {gg: np.zeros(Q) for gg in GAUGES}
    spread = {gg: np.zeros(Q) for gg in GAUGES}
    khi = {gg: np.zeros(Q) for gg in GAUGES}
    for i in range(Q):
        keys, vals = np.vstack((P.k, P.k_self[i])), np.vstack((P.v, P.v_self[i]))
        ka = np.vstack((ka_b, ka_s[i]))
        s = keys @ P.q[i]
        top = float(np.max(s))
        e = np.exp(s - top)
        yF[i] = (e @ vals) / np.sum(e)
        sigma[i] = float(np.max(np.abs(s)))
        srt = np.sort(s)
        gap[i] = srt[-1] - srt[-2]
        # a float32 score: q and k~ each within gp of their absolute terms, the d-term product
        dsj = gp * (qa[i] @ ka.T) * 2 + gd * (np.abs(P.q[i]) @ np.abs(keys).T)
        ds[i] = float(np.max(dsj))
        S[i] = float(np.abs(vals).max())
        vn = np.abs(vals - vals.mean(axis=0)).max(axis=1) + np.abs(vals).max(axis=1)
        jstar = int(np.argmax(s))
        # the keys the float32 evaluation may take as the max key: within 2 ds of the top
        tied = [jstar, *[j for j in np.flatnonzero(s >= top - 2 * ds[i]) if j != jstar]]
        for gg in GAUGES:
            vals_k, vals_dA, vals_A = [], [], []
            for j in (tied if gg == "maxkey" else [None]):
                if j is None:
                    c = coefficients(s)
                    kc, kca = keys, ka
                else:
                    c = rho(s - s[j]) * np.exp(s[j] - top) / np.sum(e)
                    kc, kca = keys - keys[j], ka + ka[j]
                A = np.abs(kc) @ np.abs(P.q[i])
                dA = (gp * (qa[i] @ kca.T) + gp * (np.abs(kc) @ qa[i])
                      + gd * (np.abs(kc) @ np.abs(P.q[i])))
                vals_k.append(float(np.sum(np.abs(c) * A * vn) / S[i]))
                vals_dA.append(float(np.sum(np.abs(c) * dA * vn) / S[i]))
                vals_A.append(float(np.sum(np.abs(c) * A) / S[i]))
            kap[gg][i] = vals_k[0]  # at the float64 argmax
            spread[gg][i] = max(abs(k - vals_k[0]) for k in vals_k)
            khi[gg][i] = max(vals_k)
            kdA[gg][i], kA[gg][i] = max(vals_dA), max(vals_A)
    return FastRows(yF=yF, V=float(max(np.abs(P.v).max(), np.abs(P.v_self).max())),
                    sigma=sigma, kappa=kap, kappa_hi=khi, kappa_spread=spread, k_dA=kdA,
                    k_A=kA, ds=ds, dv=dv, S=S, top_gap=gap)


def head_rows(item: dict, lay: dict, facts: dict, h: int, dps: int) -> HeadRows:
    """Every per-query quantity of head ``h`` of one item (docs/protocol.md section 12)."""
    P = project(item, lay, facts, h)
    N, Q = P.k.shape[0], P.q.shape[0]
    mu = P.v.mean(axis=0)
    s = np.einsum("il,jl->ij", P.q, P.k)  # (Q, N)
    sig = np.einsum("il,il->i", P.q, P.k_self)
    qk = np.einsum("il,jl->ij", np.abs(P.q), np.abs(P.k))
    c = np.stack([coefficients(s[i]) for i in range(Q)])
    dm = np.einsum("jm,ij,jr->imr", P.a, c, P.v - mu)  # Delta M_i, (Q, m+1, r)
    frozen = mu + np.einsum("im,amr->air", P.u_q, dm)  # (A, Q, r)
    y, yF, pi = oracle_outputs(P, s, sig, dps)
    kappa_P, kappa_F = readout_conditions(P, s, sig, c, qk)
    vn = np.abs(P.v - mu).max(axis=1) + np.abs(P.v).max(axis=1)
    S = np.abs(P.v).max()
    sm = item.get("native_self_mass")
    return HeadRows(
        head=h, y=y, yF=yF, mu=mu, pi=pi, frozen=frozen,
        linear=mu + np.einsum("ij,jr->ir", s, P.v - mu) / N, g=frozen[0] - mu,
        bound=np.linalg.norm(P.u_q, axis=1) * np.array([op_norm(dm[i] - dm[0])
                                                        for i in range(Q)]),
        dist=distances(P, s), descent=descent_rows(P, s, sig, c),
        native=item["native_heads"][:, h].astype(np.float64),
        observed=item["observed_heads"][h].astype(np.float64),
        pi_native=None if sm is None else sm[:, h].astype(np.float64),
        V=float(max(np.abs(P.v).max(), np.abs(P.v_self).max())), kappa_P=kappa_P,
        kappa_F=kappa_F, sigma_P=np.abs(s).max(axis=1),
        sigma_F=np.maximum(np.abs(s).max(axis=1), np.abs(sig)),
        kappa_fr=np.einsum("aj,ij,j->ai", np.abs(c), qk, vn) / S,
        kappa_tok=np.einsum("ij,ij,j->i", np.abs(c) + np.abs(c[0]), qk, vn) / S,
        qk=qk, w_o=lay["w_o"][h].astype(np.float64), tau=P.tau,
        lq2=P.tau ** 2 * float(np.sum(P.wq * P.wq)))


def replication_row(P: Projected, s0: np.ndarray, sig0: float) -> dict[str, float]:
    """Query 0 (the observed token) on the full bank, query space: the replication's step."""
    keys = np.vstack((P.k, P.k_self[0]))
    vals = np.vstack((P.v, P.v_self[0]))
    c = coefficients(np.append(s0, sig0))
    return descent_row(P.tau * keys, c, vals - vals.mean(axis=0))


# ---------------------------------------------------------------------------------------------
# the writes of one item (all heads)
# ---------------------------------------------------------------------------------------------
@dataclass
class WriteRows:
    """The combined write of one item: targets and predictions summed over all ``H`` heads
    (``Q x D``; ``frozen`` ``Q x Q x D``), without ``b_o`` for reuse and calibration; the full
    bank's write ``writeF`` with ``b_o`` (``bias``, zero where the model has none); the model's
    ``native`` (``Q x D``) and ``observed``."""

    o: np.ndarray
    mean: np.ndarray
    frozen: np.ndarray
    linear: np.ndarray
    g: np.ndarray
    writeF: np.ndarray
    native: np.ndarray
    observed: np.ndarray
    bias: np.ndarray


def write_rows(heads: list[HeadRows], item: dict, lay: dict) -> WriteRows:
    """Project every head's outputs with its ``W_o,h`` and sum over heads."""
    def proj(get) -> np.ndarray:
        return sum(np.einsum("...r,rd->...d", get(hr), hr.w_o) for hr in heads)

    b_o = lay.get("b_o")
    bias = np.zeros(heads[0].w_o.shape[1]) if b_o is None else b_o.astype(np.float64)
    writeF = proj(lambda hr: hr.yF) + bias
    return WriteRows(o=proj(lambda hr: hr.y), mean=proj(lambda hr: hr.mu),
                     frozen=proj(lambda hr: hr.frozen), linear=proj(lambda hr: hr.linear),
                     g=proj(lambda hr: hr.g), writeF=writeF,
                     native=item["native_write"].astype(np.float64),
                     observed=item["observed_write"].astype(np.float64), bias=bias)


# ---------------------------------------------------------------------------------------------
# statistics, from their definitions (docs/protocol.md section 12.3)
# ---------------------------------------------------------------------------------------------
def median(x: np.ndarray) -> float:
    """The middle value (the mean of the two middle ones for an even count); NaN if empty or
    a NaN is present."""
    x = np.sort(np.asarray(x, dtype=np.float64).ravel())
    if x.size == 0 or np.isnan(x).any():
        return math.nan
    n = x.size
    return float(x[n // 2]) if n % 2 else float((x[n // 2 - 1] + x[n // 2]) / 2)


def quantile(x: np.ndarray, p: float) -> float:
    """Linear interpolation at position ``(n - 1) p`` of the sorted values."""
    x = np.sort(np.asarray(x, dtype=np.float64).ravel())
    pos = (x.size - 1) * p
    lo = int(math.floor(pos))
    hi = min(lo + 1, x.size - 1)
    return float(x[lo] + (pos - lo) * (x[hi] - x[lo]))


def summary(x: np.ndarray) -> dict:
    """``n``, ``nonfinite``, ``median``, ``mean``, ``min``, ``max`` of a set (section 12.3)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    if x.size == 0:
        return {"n": 0, "nonfinite": 0, "median": None, "mean": None, "min": None, "max": None}
    bad = int(np.sum(~np.isfinite(x)))
    if np.isnan(x).any():
        return {"n": int(x.size), "nonfinite": bad, **dict.fromkeys(
            ("median", "mean", "min", "max"), math.nan)}
    return {"n": int(x.size), "nonfinite": bad, "median": median(x),
            "mean": float(np.sum(x) / x.size), "min": float(np.min(x)), "max": float(np.max(x))}


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of their positions:
    ``1 + #{x_j < x_i} + (#{x_j = x_i} - 1) / 2``."""
    return np.array([1 + np.sum(x < v) + (np.sum(x == v) - 1) / 2 for v in x], dtype=np.float64)


def spearman(d: np.ndarray, rel: np.ndarray) -> float | None:
    """Pearson correlation of the average ranks; NaN with a NaN, None with fewer than 3 pairs or
    a zero rank variance."""
    d, rel = np.asarray(d, dtype=np.float64).ravel(), np.asarray(rel, dtype=np.float64).ravel()
    if np.isnan(d).any() or np.isnan(rel).any():
        return math.nan
    if d.size < 3:
        return None
    ra, rb = average_ranks(d), average_ranks(rel)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float(np.sum(ra * ra)) * float(np.sum(rb * rb)))
    return float(np.sum(ra * rb) / den) if den > 0 else None


def bin_members(d: np.ndarray, edges: list[float], k: int) -> np.ndarray:
    """Bin ``k``: ``e_k <= d < e_(k+1)``, the last bin closed at both ends."""
    if k == len(edges) - 2:
        return (d >= edges[k]) & (d <= edges[k + 1])
    return (d >= edges[k]) & (d < edges[k + 1])


def bins(d: np.ndarray, rel: np.ndarray) -> list[dict]:
    """The quantile bins of a distance with the median and 0.9 quantile of ``rel`` in each."""
    d, rel = np.asarray(d, dtype=np.float64).ravel(), np.asarray(rel, dtype=np.float64).ravel()
    ok = np.isfinite(d) & np.isfinite(rel)
    d, rel = d[ok], rel[ok]
    if d.size == 0:
        return []
    edges = [quantile(d, k / N_BINS) for k in range(N_BINS + 1)]
    out = []
    for k in range(N_BINS):
        inside = bin_members(d, edges, k)
        if inside.any():
            out.append({"x_lo": edges[k], "x_hi": edges[k + 1], "n": int(inside.sum()),
                        "median": median(rel[inside]), "p90": quantile(rel[inside], 0.9)})
    return out


def calibration_stats(rel: np.ndarray, distances: dict[str, np.ndarray]) -> dict:
    """``relative_error`` and, per distance, ``summary``, ``spearman`` and ``bins``."""
    return {"relative_error": summary(rel),
            "distances": {name: {"summary": summary(d), "spearman": spearman(d, rel),
                                 "bins": bins(d, rel)} for name, d in distances.items()}}


def relative_errors(e: np.ndarray, dev: np.ndarray) -> np.ndarray:
    """``|e_i| / |dev_i|`` row by row (Euclidean); inf where ``dev_i = 0 != e_i``, 0 where both
    are 0, NaN where ``e_i`` holds a NaN or ``dev_i`` a NaN or inf."""
    num, den = np.linalg.norm(e, axis=-1), np.linalg.norm(dev, axis=-1)
    out = np.where(num > 0, np.inf, 0.0)
    nz = den > 0
    out[nz] = num[nz] / den[nz]
    out[np.isnan(num) | ~np.isfinite(den)] = np.nan
    return out


def gain_fit(r: np.ndarray, g: np.ndarray) -> tuple[float, float, float]:
    """``gamma = sum <r, g> / sum |g|^2`` (0 without a direction, NaN for a non-finite one),
    and the mean squares of ``r - g`` and ``r - gamma g``."""
    gg = float(np.sum(g * g))
    gamma = float(np.sum(r * g)) / gg if math.isfinite(gg) and gg > 0 else (
        0.0 if gg == 0 else math.nan)
    return gamma, float(np.mean((r - g) ** 2)), float(np.mean((r - gamma * g) ** 2))


def ratio_root(num: float, den: float) -> float | None:
    """``sqrt(num / den)``: None for ``den = 0`` (num not NaN), NaN for a NaN, a negative or
    ``inf / inf``."""
    if den == 0 and not math.isnan(num):
        return None
    if math.isnan(num) or math.isnan(den) or num < 0 or den < 0 or (
            math.isinf(num) and math.isinf(den)):
        return math.nan
    return math.sqrt(num / den)


def round6(x: np.ndarray) -> list[float]:
    """Values to 6 significant digits (the report's scatter points)."""
    return [float(f"{v:.6g}") for v in np.asarray(x, dtype=np.float64).ravel()]


def worst(values) -> float:
    """The largest value, NaN if any is NaN."""
    a = np.asarray(list(values), dtype=np.float64).ravel()
    return float(np.max(a))


# ---------------------------------------------------------------------------------------------
# reconstruction (section 12.1)
# ---------------------------------------------------------------------------------------------
def err(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    return {"mse": float(np.mean((a - b) ** 2)), "max_abs": float(np.max(np.abs(a - b)))}


def native_ok(a: np.ndarray, b: np.ndarray) -> bool:
    """The float32 model's native criterion: ``|a - b| <= 3e-5 + 3e-4 |b|`` entrywise."""
    atol, rtol = FLOAT32_NATIVE
    return bool(np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


ZERO = {"mse": 0.0, "max_abs": 0.0}  # an identity-type error: exactly 0


def head_row(c: int, hr: HeadRows) -> dict:
    """The reconstruction row of one (context, head)."""
    row = {"context": c, "head": hr.head, "prefix": ZERO, "full": ZERO,
           "relation_max_abs": 0.0, "mean_max_abs": 0.0, "projected_prefix": ZERO,
           "projected_full": ZERO, "self_mass_mean": float(np.mean(hr.pi)),
           "self_mass_vs_native_max_abs": (math.nan if hr.pi_native is None
                                           else float(np.max(np.abs(hr.pi - hr.pi_native)))),
           "native": err(hr.yF, hr.native),
           "native_observed_full_forward": err(hr.yF[0], hr.observed),
           "cache_vs_full_forward_max_abs": float(np.max(np.abs(hr.native[0] - hr.observed))),
           "pass_identity": True, "pass_relation": True, "pass_projected_write": True}
    row["pass_self_mass"] = hr.pi_native is not None and native_ok(hr.pi, hr.pi_native)
    row["pass_native"] = native_ok(hr.yF, hr.native) and native_ok(hr.yF[0], hr.observed)
    return row


def combined_row(c: int, wr: WriteRows) -> dict:
    """The reconstruction row of one context's combined write."""
    row = {"context": c, "head": "combined", "prefix": ZERO, "full": ZERO,
           "relation_max_abs": 0.0, "native": err(wr.writeF, wr.native),
           "native_observed_full_forward": err(wr.writeF[0], wr.observed),
           "cache_vs_full_forward_max_abs": float(np.max(np.abs(wr.native[0] - wr.observed))),
           "pass_identity": True, "pass_relation": True}
    row["pass_native"] = native_ok(wr.writeF, wr.native) and native_ok(wr.writeF[0], wr.observed)
    return row


CHECK_FIELDS = {  # the error fields behind each pass flag (section 12.1)
    "identity": (("prefix", "mse"), ("prefix", "max_abs"), ("full", "mse"), ("full", "max_abs")),
    "relation": (("relation_max_abs",),),
    "projected_write": tuple((p, k) for p in ("projected_prefix", "projected_full")
                             for k in ("mse", "max_abs")),
    "self_mass": (("self_mass_vs_native_max_abs",),),
    "native": tuple((p, k) for p in ("native", "native_observed_full_forward")
                    for k in ("mse", "max_abs")),
}


def failed_checks(row: dict) -> set[str]:
    """The checks a row fails: its flag false or one of its errors not finite."""
    out = set()
    for check, paths in CHECK_FIELDS.items():
        if f"pass_{check}" not in row:
            continue
        vals = [row[p[0]] if len(p) == 1 else row[p[0]][p[1]] for p in paths]
        if not row[f"pass_{check}"] or not all(math.isfinite(v) for v in vals):
            out.add(check)
    for k in ("mean_max_abs", "cache_vs_full_forward_max_abs"):
        if k in row and not math.isfinite(row[k]):
            out.add(k)
    return out


def pool_rows(rows: list[dict]) -> dict:
    """A head's (or the combined write's) rows over the contexts."""
    out = {}
    for part in ("prefix", "full", "native", "native_observed_full_forward"):
        out[part] = {"mse": float(np.mean([r[part]["mse"] for r in rows])),
                     "max_abs": worst(r[part]["max_abs"] for r in rows)}
    for k in ("relation_max_abs", "cache_vs_full_forward_max_abs"):
        out[k] = worst(r[k] for r in rows)
    out["pass"] = sum(not failed_checks(r) for r in rows)
    out["rows"] = len(rows)
    return out


def reconstruction(rows: list[dict], heads: list[int]) -> dict:
    """``layers[L].reconstruction``."""
    failed = [failed_checks(r) for r in rows]
    return {"tolerances": TOLERANCES,
            "rows_passed": sum(not f for f in failed), "rows_total": len(rows),
            "rows_passed_identity": sum("identity" not in f for f in failed),
            "rows_passed_native": sum("native" not in f for f in failed),
            "per_head": [{"head": h, **pool_rows([r for r in rows if r["head"] == h])}
                         for h in heads],
            "combined": pool_rows([r for r in rows if r["head"] == "combined"]),
            "rows": rows}


# ---------------------------------------------------------------------------------------------
# reuse (section 12.2)
# ---------------------------------------------------------------------------------------------
def anchor_errors(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``E_a = 1/((Q-1) D) sum_{i != a} |pred_ai - target_i|^2`` for every anchor ``a``;
    ``pred`` is ``(Q, Q, D)`` (``[a, i]``)."""
    Q, D = target.shape
    out = np.zeros(Q)
    for a in range(Q):
        out[a] = sum(float(np.sum((pred[a, i] - target[i]) ** 2))
                     for i in range(Q) if i != a) / ((Q - 1) * D)
    return out


def predictions(f: str, target: np.ndarray, mean: np.ndarray, frozen: np.ndarray,
                linear: np.ndarray) -> np.ndarray:
    """Predictor ``f``'s ``[a, i]`` predictions (``Q x Q x D``) of a target ``(Q, D)``."""
    Q = target.shape[0]
    return {"constant": np.repeat(target[:, None], Q, axis=1),
            "mean": np.broadcast_to(mean, target.shape)[None].repeat(Q, axis=0),
            "frozen": frozen, "linear": linear[None].repeat(Q, axis=0)}[f]


def context_errors(target: np.ndarray, mean: np.ndarray, frozen: np.ndarray,
                   linear: np.ndarray) -> dict[str, np.ndarray]:
    """Per predictor (and ``"target"``, the zero predictor) the ``Q`` anchors' ``E_a``."""
    out = {f: anchor_errors(predictions(f, target, mean, frozen, linear), target)
           for f in PREDICTORS}
    out["target"] = anchor_errors(np.zeros((target.shape[0],) + target.shape), target)
    return out


def pooled(E: list[np.ndarray]) -> dict[str, float]:
    """``anchor0`` and ``all`` pooling over contexts (``E[c]`` the anchors' errors)."""
    return {"anchor0": float(np.mean([e[0] for e in E])),
            "all": float(np.mean([np.mean(e) for e in E]))}


def reuse_table(per_context: list[dict[str, np.ndarray]]) -> dict:
    """The four-predictor table from each context's errors."""
    pools = {f: pooled([e[f] for e in per_context]) for f in (*PREDICTORS, "target")}
    table = {"predictors": {f: {
        "mse": pools[f],
        "rrmse": {s: ratio_root(pools[f][s], pools["constant"][s]) for s in pools[f]},
        "rrmse_vs_mean": {s: ratio_root(pools[f][s], pools["mean"][s]) for s in pools[f]}}
        for f in PREDICTORS}}
    table["target_rms"] = {s: math.sqrt(v) for s, v in pools["target"].items()}
    return table


def head_target(hr: HeadRows) -> dict[str, np.ndarray]:
    """Head ``h``'s projected target and predictions."""
    def p(z):
        return np.einsum("...r,rd->...d", z, hr.w_o)

    return {"target": p(hr.y), "mean": p(hr.mu), "frozen": p(hr.frozen), "linear": p(hr.linear)}


def below_constant(per_head: list[dict]) -> dict:
    """``heads_below_constant``: all-anchor frozen rRMSE against the head's own constant < 1."""
    vals = [(r["head"], r["predictors"]["frozen"]["rrmse"]["all"]) for r in per_head]
    num = [(h, math.nan if v is None else v) for h, v in vals]
    below = [(h, v) for h, v in num if math.isfinite(v) and v < 1.0]
    return {"predictor": "frozen", "anchors": "all", "heads": [h for h, _ in below],
            "count": len(below), "of": len(vals),
            "range": [min(v for _, v in below), max(v for _, v in below)] if below else None,
            "nonfinite": [h for h, v in num if not math.isfinite(v)]}


def reuse(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int]) -> dict:
    """``layers[L].reuse``."""
    comb = [context_errors(wr.o, wr.mean, wr.frozen, wr.linear) for _, wr in items]
    per_head = []
    for h in heads:
        errs = []
        for hrs, _ in items:
            t = head_target(hrs[h])
            errs.append(context_errors(t["target"], t["mean"], t["frozen"], t["linear"]))
        per_head.append({"head": h, **reuse_table(errs)})
    return {"combined": reuse_table(comb), "per_head": per_head,
            "per_context": {f: {"anchor0": [float(e[f][0]) for e in comb],
                                "all": [float(np.mean(e[f])) for e in comb]}
                            for f in PREDICTORS},
            "heads_below_constant": below_constant(per_head)}


# ---------------------------------------------------------------------------------------------
# calibration (section 12.3)
# ---------------------------------------------------------------------------------------------
def head_calibration(hr: HeadRows) -> dict[str, np.ndarray]:
    """Rows ``i >= 1`` of one head: ``rel``, the distances, the gain fit's ``r`` and ``g``, the
    tokenwise agreement (0) and the bound violations."""
    e = hr.y - hr.frozen[0]
    norm_e = np.linalg.norm(e, axis=1)
    slack = hr.bound * (1 + VIOLATION_REL) + VIOLATION_ABS * float(np.max(np.abs(hr.y)))
    return {"rel": relative_errors(e, hr.y - hr.mu)[1:],
            **{d: hr.dist[d][1:] for d in DISTANCES},
            "r": (hr.y - hr.mu)[1:], "g": hr.g[1:],
            "violations": int(np.sum(norm_e[1:] > slack[1:]))}


def per_head_calibration(h: int, parts: list[dict[str, np.ndarray]]) -> dict:
    """One reported head's calibration over the contexts."""
    def cat(k):
        return np.concatenate([p[k] for p in parts])

    gamma, mse1, mseg = gain_fit(cat("r"), cat("g"))
    return {"head": h, "gamma": gamma, "mse_frozen": mse1, "mse_after_gain": mseg,
            "mse_mean": float(np.mean(cat("r") ** 2)), "tokenwise_max_rel": 0.0,
            "bound_violations": sum(p["violations"] for p in parts),
            **calibration_stats(cat("rel"), {d: cat(d) for d in DISTANCES})}


def combined_calibration(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int],
                         const0: float) -> tuple[dict, dict[str, np.ndarray]]:
    """``calibration.combined`` and its per-row values (``rel``, ``input``)."""
    r = np.concatenate([(wr.o - wr.mean)[1:] for _, wr in items])
    g = np.concatenate([wr.g[1:] for _, wr in items])
    rel = np.concatenate([relative_errors(wr.o - wr.frozen[0], wr.o - wr.mean)[1:]
                          for _, wr in items])
    inp = np.concatenate([hrs[0].dist["input"][1:] for hrs, _ in items])
    tv = np.concatenate([np.mean([hrs[h].dist["tv"][1:] for h in heads], axis=0)
                         for hrs, _ in items])
    gamma, mse1, mseg = gain_fit(r, g)
    out = {"gamma": gamma, "mse_frozen": mse1, "mse_after_gain": mseg,
           "rrmse_frozen": ratio_root(mse1, const0), "rrmse_after_gain": ratio_root(mseg, const0),
           **calibration_stats(rel, {"input": inp, "tv_mean_over_heads": tv})}
    return out, {"rel": rel, "input": inp}


def checks(items: list[tuple[list[HeadRows], WriteRows]]) -> dict:
    """``calibration.checks`` over all heads: the rounding-error fields are 0, their flags true,
    the bound violations counted."""
    per_context = []
    for c, (hrs, _) in enumerate(items):
        per_context.append({
            "context": c, "heads": [hr.head for hr in hrs], "tokenwise_rel": [0.0] * len(hrs),
            "bound_violations": [head_calibration(hr)["violations"] for hr in hrs],
            "frozen_crosscheck_max_abs": 0.0, "frozen_crosscheck_pass": True,
            "refresh_identity_max_abs": 0.0, "refresh_identity_pass": True})
    return {"tokenwise_max_rel": 0.0, "frozen_crosscheck_max_abs": 0.0,
            "refresh_identity_max_abs": 0.0,
            "bound_violations": sum(sum(pc["bound_violations"]) for pc in per_context),
            "per_context": per_context}


def calibration(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int],
                const0: float) -> dict:
    """``layers[L].calibration`` (the ``distances`` labels are left to the report)."""
    parts = {h: [head_calibration(hrs[h]) for hrs, _ in items] for h in heads}
    pooled_parts = [head_calibration(hrs[h]) for hrs, _ in items for h in heads]  # c, h, i

    def cat(k):
        return np.concatenate([p[k] for p in pooled_parts])

    comb, comb_rows = combined_calibration(items, heads, const0)
    Qm1 = len(items[0][0][0].y) - 1
    return {"anchor": 0,
            "per_head": [per_head_calibration(h, parts[h]) for h in heads],
            "pooled_heads": calibration_stats(cat("rel"), {d: cat(d) for d in DISTANCES}),
            "combined": comb, "checks": checks(items),
            "points": {"head": [h for _ in items for h in heads for _ in range(Qm1)],
                       **{k: round6(cat(k)) for k in ("rel", *DISTANCES)},
                       "rel_combined": round6(comb_rows["rel"]),
                       "input_combined": round6(comb_rows["input"])}}


# ---------------------------------------------------------------------------------------------
# descent (section 12.4)
# ---------------------------------------------------------------------------------------------
def space_block(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int],
                space: str) -> dict:
    """One parametrisation's block (``"in"`` or ``"q"``), rows of each head ordered context,
    query."""
    def rows(h, key):
        return np.concatenate([hrs[h].descent[f"{key}_{space}"] for hrs, _ in items])

    per_head = [{"head": h, "lam_max": summary(rows(h, "lam")),
                 "frac_lam_gt_2": float(np.mean(rows(h, "lam") > 2)),
                 "frac_rows_increase": float(np.mean(rows(h, "flag"))),
                 "increases": bool(median(rows(h, "delta")) > 0)} for h in heads]
    lam = np.concatenate([rows(h, "lam") for h in heads])
    n_inc = sum(p["increases"] for p in per_head)
    return {"per_head": per_head, "heads_increasing": n_inc, "heads": len(heads),
            "fraction_heads_increasing": n_inc / len(heads),
            "fraction_rows_increasing": float(np.mean(np.concatenate(
                [rows(h, "flag") for h in heads]))),
            "lam_max": summary(lam),
            "points": {"head": [h for h in heads for _ in range(rows(h, "lam").size)],
                       "lam_max": round6(lam)}}


def descent(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int]) -> dict:
    """``layers[L].descent`` (labels left to the report)."""
    out = space_block(items, heads, "in")
    out["query_space"] = space_block(items, heads, "q")
    flags = np.array([hrs[h].descent["flag_rep"] for h in heads for hrs, _ in items])
    lam = np.array([hrs[h].descent["lam_rep"] for h in heads for hrs, _ in items])
    out["replication_style"] = {"increase": int(flags.sum()), "pairs": int(flags.size),
                                "lam_max_median": median(lam), "lam_max_max": worst(lam)}
    return out


# ---------------------------------------------------------------------------------------------
# fast (section 12.5)
# ---------------------------------------------------------------------------------------------
def median_low(x: np.ndarray) -> float:
    """The lower of the two middle values for an even count (``torch.median``'s)."""
    x = np.sort(np.asarray(x, dtype=np.float64).ravel())
    return float(x[(x.size - 1) // 2])


def fast_entry(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int], dt: str,
               gauge: str) -> dict:
    """``layers[L].fast["<dt>/<gauge>"]``: the exact values of the fast path's errors.

    ``vs_float64`` and ``vs_native`` compare the exact output of the problem rounded to ``dt``
    (``FastRows.yF``: for float32 the captured problem itself, so the exact value is 0) with
    the exact full-bank output ``y^F`` and with the model's ``y^``; ``identity`` (the fast
    path's softmax output against its own readout) is a rounding error, exact value 0.  The
    gauge enters only through ``kappa``."""
    def pool(parts: list[dict]) -> dict:
        return {"mse": float(np.mean([p["mse"] for p in parts])),
                "max_abs": worst(p["max_abs"] for p in parts)}

    ent: dict[str, Any] = {"heads": []}
    for h in heads:
        hr = [hrs[h] for hrs, _ in items]
        ent["heads"].append({"head": h,
                             "vs_float64": pool([err(x.fast[dt].yF, x.yF) for x in hr]),
                             "vs_native": pool([err(x.fast[dt].yF, x.native) for x in hr]),
                             "identity": ZERO})
    wlp = []
    for hrs, wr in items:
        wlp.append(sum(np.einsum("qr,rd->qd", x.fast[dt].yF, x.w_o) for x in hrs) + wr.bias)
    ent["combined"] = {"vs_float64": pool([err(w, wr.writeF) for w, (_, wr) in zip(wlp, items)]),
                       "vs_native": pool([err(w, wr.native) for w, (_, wr) in zip(wlp, items)])}
    ks = [np.concatenate([x.fast[dt].kappa[gauge] for x in hrs]) for hrs, _ in items]
    ent["kappa"] = {"median": float(np.median([median_low(k) for k in ks])),
                    "max": worst(np.max(k) for k in ks)}
    return ent


def fast_section(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int]) -> dict:
    """``layers[L].fast``."""
    return {f"{dt}/{g}": fast_entry(items, heads, dt, g) for dt in FAST_DTYPES for g in GAUGES}


# ---------------------------------------------------------------------------------------------
# verdict (section 12.6)
# ---------------------------------------------------------------------------------------------
FAILURE_KEYS = ("where", "check", "value", "tol", "detail")


def failure(where: str, check: str, value: Any = None, detail: str = "") -> dict:
    return {"where": where, "check": check, "value": value, "tol": None, "detail": detail}


# the real-head checks in the order the verdict names them (section 12.6)
REAL_CHECK_ORDER = ("conventions", "positive_coefficients", "rank", "no_global_readout",
                    "position_derivative", "position_shift", "exact_rows")


def layer_failures(L: str, lr: dict) -> list[dict]:
    """The failed checks of one recomputed layer, in the verdict's order (docs/protocol.md
    section 12.6): the reconstruction rows' checks, then per context the reuse bound, the
    frozen cross-check and the refresh identity, then per context of ``real_heads`` (where the
    layer has it: sections 12.9 and 12.10) each check whose ``ok`` is false.  The checks on
    non-finite numbers (a tokenwise agreement, the fast path's contexts, the pooled sections'
    safety net) never fail here: every exact value is finite.  A failure's ``value``, ``tol``
    and ``detail`` describe it; the reference leaves them empty."""
    out = []
    for row in lr["reconstruction"]["rows"]:
        for check in failed_checks(row):
            out.append(failure(f"layer {L} context {row['context']} head {row['head']}", check))
    for pc in lr["calibration"]["checks"]["per_context"]:
        w = f"layer {L} context {pc['context']}"
        for h, bv in zip(pc["heads"], pc["bound_violations"]):
            if bv:
                out.append(failure(f"{w} head {h}", "reuse_bound", bv))
        for name in ("frozen_crosscheck", "refresh_identity"):
            if not pc[f"{name}_pass"]:
                out.append(failure(w, name))
    for rec in (lr.get("real_heads") or {}).get("per_context", []):
        for name in REAL_CHECK_ORDER:
            if name in rec and not rec[name]["ok"]:
                out.append(failure(f"layer {L} context {rec['context']}", name))
    return out


def verdict(layers: dict[str, dict]) -> dict:
    """``verdict``: ``pass`` when no layer fails a check, ``failed_checks`` their number."""
    fails = [f for L, lr in layers.items() for f in layer_failures(L, lr)]
    return {"pass": not fails, "failed_checks": len(fails), "failures": fails}


# ---------------------------------------------------------------------------------------------
# the whole recomputation
# ---------------------------------------------------------------------------------------------
@dataclass
class Reference:
    """The recomputed sections (``report``: ``model`` sizes, ``protocol`` sizes and per layer
    ``reconstruction``, ``reuse``, ``calibration``, ``descent`` and ``contexts``) and the
    per-item values behind them: ``rows[(L, c)] = (heads, write)``."""

    report: dict
    rows: dict[tuple[int, int], tuple[list[HeadRows], WriteRows]] = field(repr=False)
    manifest: dict = field(repr=False)
    claims: Any = field(default=None, repr=False)  # reference.real_heads.Claims
    positional: Any = field(default=None, repr=False)  # reference.positional.Positional


def layer_items(dump: Dump, layer: int, contexts: list[int],
                dps: int) -> list[tuple[list[HeadRows], WriteRows]]:
    """Every head of every context of one layer."""
    facts, lay = dump.manifest["layers"][str(layer)], dump.layer(layer)
    out = []
    for c in contexts:
        item = dump.item(c, layer)
        hrs = [head_rows(item, lay, facts, h, dps) for h in range(facts["n_heads"])]
        for dt in FAST_DTYPES:
            it, ly = stored(item, ROUNDED_INPUTS, dt), stored(lay, ROUNDED_WEIGHTS, dt)
            for hr in hrs:
                hr.fast[dt] = fast_rows(it, ly, facts, hr.head)
        out.append((hrs, write_rows(hrs, item, lay)))
    return out


def layer_report(items: list[tuple[list[HeadRows], WriteRows]], heads: list[int]) -> dict:
    """The four sections of one layer, and ``contexts``."""
    rows = []
    for c, (hrs, wr) in enumerate(items):
        rows += [head_row(c, hrs[h]) for h in heads] + [combined_row(c, wr)]
    reu = reuse(items, heads)
    const0 = reu["combined"]["predictors"]["constant"]["mse"]["anchor0"]
    return {"reconstruction": reconstruction(rows, heads), "reuse": reu,
            "calibration": calibration(items, heads, const0),
            "descent": descent(items, heads), "fast": fast_section(items, heads),
            "contexts": len(items)}


def sizes(dump: Dump, layers: list[int], contexts: list[int]) -> tuple[dict, dict]:
    """The model's and the protocol's sizes, from the dumped tensors' shapes."""
    lay = dump.layer(layers[0])
    m, H, d = lay["w_q"].shape
    item = dump.item(contexts[0], layers[0])
    N, Q = item["x_bank"].shape[0], item["x_query"].shape[0]
    model = {"n_heads": H, "n_kv_heads": lay["w_k"].shape[1], "head_dim": d, "hidden": m}
    protocol = {"contexts": len(contexts), "queries": Q, "prefix_len": N + 1,
                "query_position": N, "layers": layers}
    return model, protocol


def merge_real_heads(claims: Any, positional: Any, layers: list[int]) -> dict[str, dict]:
    """Per layer, the ``real_heads`` section of both recomputations in one tree: each context's
    record holds the checks of both (sections 12.9, 12.10), and the pooled entries of both."""
    out = {}
    for L in layers:
        a = claims.report["layers"][str(L)]["real_heads"]
        b = positional.values[str(L)]
        per = [{**ra, **rb} for ra, rb in zip(a["per_context"], b["per_context"], strict=True)]
        out[str(L)] = {"per_context": per, **{k: v for k, v in a.items() if k != "per_context"},
                       **{k: v for k, v in b.items() if k != "per_context"}}
    return out


def recompute(path: str | Path, *, dps: int = 30) -> Reference:
    """Recompute the ``reconstruction``, ``reuse``, ``calibration``, ``descent`` and ``fast``
    sections of every dumped layer (``dps``: digits of the oracle), its ``real_heads``
    (:mod:`ropestep.reference.real_heads` and :mod:`ropestep.reference.positional`, which read
    this module's projections: imported here, when called) and the verdict over all of them."""
    from . import positional as pos_ref
    from . import real_heads as claims_ref

    dump = load(path)
    items = sorted(tuple(it) for it in dump.manifest["items"])
    layers = sorted({L for _, L in items})
    contexts = sorted({c for c, _ in items})
    heads = list(dump.manifest["protocol"]["heads"])
    report: dict[str, Any] = {"layers": {}}
    rows = {}
    for L in layers:
        its = layer_items(dump, L, [c for c, LL in items if LL == L], dps)
        rows.update({(L, c): it for c, it in zip(contexts, its)})
        report["layers"][str(L)] = layer_report(its, heads)
    report["model"], report["protocol"] = sizes(dump, layers, contexts)
    claims, positional = claims_ref.recompute(path, dps=dps), pos_ref.recompute(path)
    for L, rh in merge_real_heads(claims, positional, layers).items():
        report["layers"][L]["real_heads"] = rh
    report["verdict"] = verdict(report["layers"])
    return Reference(report, rows, dump.manifest, claims, positional)
