"""``ropestep validate``'s ``real_heads`` checks ``conventions``, ``position_derivative`` and
``position_shift`` recomputed from its ``--dump-raw`` directory (docs/protocol.md section 12.10),
independently of the code that wrote them.

Written from that section alone:

* ``conventions``: the suite's projections ``u^T W^`` of the dumped bank inputs, rotated by the
  dumped tables (numpy, float64), against the model's own rotated queries and keys and its values
  (``context{c}_layer{L}_model.safetensors``), and the tolerance formula evaluated on
  ``A = |x| |W| + |b|``;
* the positional checks: each score is written in relative-position form,
  ``s_ij = tau sum_l (P_l cos(Delta omega_l) + Q_l sin(Delta omega_l))`` with the unrotated
  pair products ``P_l = q_1 k_1 + q_2 k_2``, ``Q_l = q_2 k_1 - q_1 k_2`` and ``Delta = p_j - p_i``
  (a query and its own key move together: ``Delta = 0``), and every output, derivative and
  central difference is evaluated in mpmath at :data:`DPS` digits from the float64 projections;
  the derivative is differentiated by hand (``ds_ij/dp_i = tau sum_l omega_l (P_l sin - Q_l
  cos)``), not through a generator matrix;
* the seeded choice of rows, the step ``h``, the tolerance formulas and the pooling follow the
  section in plain float64.

What a reference can give of a rounding error is its exact value: the exact difference of the
two sides of ``position_shift`` is 0 (the reference evaluates both, the relative-position form
and the rotated query and own key moved through ``phi_1(delta A)``, which agree to its working
precision), and that of ``position_derivative`` is the central difference's truncation error
alone.  So next to every value the reference returns the width
within which the report's value must lie (:class:`Positional`), derived in the section from the
rounding of both sides: for a rounding-level value (``err_max`` of the positional checks) that
width is the report's own rounding bound, and the comparison is against that bound, not a
recomputation digit for digit.  Decisions (the step ``h``, every ``ok``) whose inputs' widths
straddle their threshold are listed in :attr:`Positional.undecided`.

Limits: float32 runs (as :mod:`ropestep.reference.validate`); layers without a soft-cap or a
sliding window (Llama, Qwen2: the models ``validate`` runs).

Imports: numpy, mpmath, safetensors' numpy reader and :mod:`ropestep.reference.validate`'s and
:mod:`ropestep.reference.atlas`'s dump helpers; nothing else of ropestep and not torch.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mpmath as mp
import numpy as np
from safetensors.numpy import load_file

from .atlas import Dump, rotate
from .validate import load as load_dump

U64, U32 = 2.0 ** -53, 2.0 ** -24
HM_LAMBDA = 8.0  # the probabilistic dot-product bound's multiplier (section 12.10)
AGREE_MARGIN, FLOAT64_REL = 10.0, 1e-12
SCORE_LIMIT = math.log(sys.float_info.max)  # 709.78: the largest exponentiable float64 score
SCALE_GUARD = 1e-300
POSITIONAL_QUERIES, DELTAS = 3, (1, 7)
DPS = 40
CHECKS = ("conventions", "position_derivative", "position_shift")
POOLED = {"conventions": ("q_rel_max", "k_rel_max", "v_rel_max"),
          "position_derivative": ("ratio_max",), "position_shift": ("ratio_max",)}
TOL_FROM = {
    "position_derivative": "per component: tolerances.central_difference_abs(h, B3, eps_y) + "
                           "eps_d, eps = tolerances.position_eval_abs; ok when err/tol <= 1",
    "position_shift": "per component: 2 tolerances.position_eval_abs(N, d, m, max|v|, "
                      "p_i + |delta|, B1); ok when err/tol <= 1",
}


# ---------------------------------------------------------------------------------------------
# the tolerance formulas of section 12.10
# ---------------------------------------------------------------------------------------------
def gamma(n: int, u: float = U64) -> float:
    """``gamma_n = n u / (1 - n u)``: ``n`` rounded operations on non-negative operands."""
    return n * u / (1.0 - n * u)


def rotated_projection_abs(u_acc: float, u_store: float, A: Any, n_terms: int) -> Any:
    """``(HM_LAMBDA sqrt(n_terms) u_acc + 4 u_store) A``."""
    return (HM_LAMBDA * math.sqrt(n_terms) * u_acc + 4.0 * u_store) * np.asarray(A)


def agreement64(n_keys: int, d: int, m: int) -> float:
    """``max(1e-12, 10 (N + d + m + 8 + 709.78) u64)``."""
    return max(FLOAT64_REL, AGREE_MARGIN * (n_keys + d + m + 8 + SCORE_LIMIT) * U64)


def position_eval_abs(n_keys: int, d: int, m: int, scale: Any, position: float, slope: Any
                      ) -> Any:
    """``agreement64(N, d, m) scale + 12 u64 position slope``."""
    return (agreement64(n_keys, d, m) * np.asarray(scale)
            + 12.0 * U64 * float(position) * np.asarray(slope))


def central_difference_abs(h: float, third: Any, eval_abs: Any) -> Any:
    """``h^2/6 third + eval_abs / h``."""
    return h * h / 6.0 * np.asarray(third) + np.asarray(eval_abs) / h


def choose_step(e_max: float, b3: float) -> float:
    """``h = 2^clip(round(log2((3 e / B3)^(1/3))), -30, -2)``, ``2^-2`` when ``B3 = 0``
    (``round``: half to even)."""
    if b3 <= 0:
        return 2.0 ** -2
    return 2.0 ** float(np.clip(np.round(np.log2((3 * e_max / b3) ** (1 / 3))), -30, -2))


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class Positional:
    """Per layer (``str(L)``): ``values``, the reference's tree of the three checks as they sit
    under ``layers[L].real_heads`` (``per_context`` holds one record per context, empty for the
    contexts without the claims), ``widths``, the same tree with the width each numeric leaf of
    the report must lie within (``None``: equal), and ``undecided``, decisions too close to their
    threshold for the widths."""

    values: dict = field(default_factory=dict)
    widths: dict = field(default_factory=dict)
    undecided: list = field(default_factory=list)


def _pair_partner(d: int, layout: str) -> np.ndarray:
    """Index of the coordinate rotated together with each coordinate."""
    c = np.arange(d)
    return (c + d // 2) % d if layout == "half" else c ^ 1


def _pairs(z: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """The two coordinates of each pair ``l`` of rows ``z (..., d)``: ``(..., d/2)`` each."""
    if layout == "half":
        h = z.shape[-1] // 2
        return z[..., :h], z[..., h:]
    return z[..., 0::2], z[..., 1::2]


def _proj(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, g: int) -> np.ndarray:
    out = np.einsum("nm,mc->nc", x, w[:, g])
    return out if b is None else out + b[g]


def _abs_terms(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, g: int) -> np.ndarray:
    """``A = |x| |W| + |b|`` of head ``g``, ``(n, width)``."""
    out = np.einsum("nm,mc->nc", np.abs(x), np.abs(w[:, g]))
    return out if b is None else out + np.abs(b[g])


# ---------------------------------------------------------------------------------------------
# conventions
# ---------------------------------------------------------------------------------------------
def conventions(lay: dict, item: dict, mod: dict, facts: dict, layer: int,
                undecided: list) -> tuple[dict, dict]:
    """The ``conventions`` record of one layer and its widths (section 12.10)."""
    x = item["x_bank"].astype(np.float64)
    N, m = x.shape
    H, Hk, d, layout = facts["n_heads"], facts["n_kv_heads"], facts["head_dim"], facts["layout"]
    grp = H // Hk
    a = float(mod["amplitude"][0])
    k = m + (1 if "b_q" in lay else 0)
    perm = mod["head_order"]
    partner = _pair_partner(d, layout)
    model = {"q": mod["query"].astype(np.float64)[..., perm],
             "k": mod["key"].astype(np.float64)[..., perm],
             "v": mod["value"].astype(np.float64)}
    cos, sin = lay["cos"][:N], lay["sin"][:N]
    rows, rel, tol, wrel, wtol = [], {}, {}, {}, {}
    for nm in ("q", "k", "v"):
        w, b = lay[f"w_{nm}"], lay.get(f"b_{nm}")
        rel[nm], tol[nm], wrel[nm], wtol[nm] = [], [], [], []
        for h in range(H):
            g = h if nm == "q" else h // grp
            z = _proj(x, w, b, g)
            A = _abs_terms(x, w, b, g)
            if nm != "v":
                z = rotate(z, cos, sin, layout) * a
                A = (A + A[:, partner]) * max(a, 1.0)
            ref = model[nm][g]
            den = max(float(np.max(np.abs(ref))), SCALE_GUARD)
            r_ = float(np.max(np.abs(ref - z))) / den
            bound = rotated_projection_abs(U32, U32, A, k) + rotated_projection_abs(U64, U64, A, k)
            t_ = float(np.max(bound)) / den
            rel[nm].append(r_)
            tol[nm].append(t_)
            # each float64 side within gamma_(k+6) A of the exact rotated projection
            wrel[nm].append(2 * gamma(k + 6) * float(np.max(A)) / den + 2 * gamma(2) * r_)
            wtol[nm].append(2 * gamma(2 * k + 12) * t_)
    for h in range(H):
        row = {"head": h, "kv_head_spec": h // grp}
        ok = True
        for nm in ("q", "k", "v"):
            row[f"{nm}_rel"], row[f"{nm}_tol"] = rel[nm][h], tol[nm][h]
            ok = ok and _decide(rel[nm][h], wrel[nm][h], tol[nm][h], wtol[nm][h], undecided,
                                f"layer {layer} conventions head {h} {nm}")
        row["ok"] = ok
        rows.append(row)
    wrows = [{**{f"{nm}_{f}": (wrel if f == "rel" else wtol)[nm][h] for nm in ("q", "k", "v")
                 for f in ("rel", "tol")}, "head": None, "kv_head_spec": None, "ok": None}
             for h in range(H)]
    maxes = {f"{nm}_rel_max": max(rel[nm]) for nm in ("q", "k", "v")}
    wmax = {f"{nm}_rel_max": max(wrel[nm]) for nm in ("q", "k", "v")}
    routes_ok = all(r_["ok"] for r_ in rows)
    a_run = float(mod["rotary_cos"][0, 0]) if "rotary_cos" in mod else 1.0
    sc_model = float(mod["scaling"][0]) * a_run * a_run
    sc_spec = [float(s) for s in lay["score_scale"]]
    sc_rel = max(abs(s - sc_model) / sc_model for s in sc_spec)
    sc_tol = gamma(8)
    scale = {"model": sc_model, "spec": sc_spec, "rel": sc_rel, "tolerance": sc_tol,
             "ok": sc_rel <= sc_tol}
    # the same correctly rounded operations on the same float64 inputs: equal up to the
    # order of the product a a s (gamma_2)
    wscale = {"model": gamma(2) * sc_model, "spec": [0.0] * H, "rel": gamma(4) * sc_model,
              "tolerance": 0.0, "ok": None}
    _decide(sc_rel, wscale["rel"] / sc_model, sc_tol, 0.0, undecided, f"layer {layer} scale")
    rec = {"check": "conventions", "layer": layer, "model_dtype": "float32", "tokens": N,
           "positions": [0, N - 1], "layout": layout, **maxes,
           "tolerance_max": max(max(tol[nm]) for nm in tol),
           "tolerance_from": ("tolerances.rotated_projection_abs(float32) + (float64) with "
                              f"n_terms={k}, A = |x||W|^T + |b| summed over the model's rotation "
                              "pair, mapped by the model's repeat_kv; max(bound)/max|model| "
                              "per head"),
           "heads": rows,
           "routes": {rt: {**maxes, "ok": routes_ok} for rt in ("spec", "fast.project")},
           "scale": scale, "ok": routes_ok and scale["ok"]}
    wrec = {"check": None, "layer": None, "model_dtype": None, "tokens": None,
            "positions": [None, None], "layout": None, **wmax,
            "tolerance_max": max(max(wtol[nm]) for nm in wtol), "tolerance_from": None,
            "heads": wrows,
            "routes": {rt: {**wmax, "ok": None} for rt in ("spec", "fast.project")},
            "scale": wscale, "ok": None}
    return rec, wrec


def _decide(value: float, wv: float, limit: float, wl: float, undecided: list, where: str
            ) -> bool:
    """``value <= limit``; listed as undecided when the widths straddle the threshold."""
    if not (value + wv < limit - wl or value - wv > limit + wl):
        undecided.append(f"{where}: {value:.3e} +- {wv:.1e} against {limit:.3e} +- {wl:.1e}")
    return value <= limit


# ---------------------------------------------------------------------------------------------
# the positional checks
# ---------------------------------------------------------------------------------------------
def positional_queries(seed: int, context: int, layer: int, n_bank: int, n_queries: int
                       ) -> list[int]:
    """The seeded rows: ``default_rng([seed, c, L])`` draws the rank check's candidate
    (``integers(1, Q)`` when ``Q > 1``) first, then ``min(3, N - 1)`` distinct bank tokens of
    ``1 .. N-1`` (``choice`` without replacement), sorted."""
    rng = np.random.default_rng([seed, context, layer])
    if n_queries > 1:
        rng.integers(1, n_queries)
    return sorted(int(i) for i in rng.choice(np.arange(1, n_bank),
                                             size=min(POSITIONAL_QUERIES, n_bank - 1),
                                             replace=False))


class _Head:
    """One query head's float64 projections and their rounding widths, and its mpmath outputs
    at any position of one query token (section 12.10)."""

    def __init__(self, lay: dict, x: np.ndarray, h: int, grp: int, layout: str,
                 omega: np.ndarray, trig: dict):
        g = h // grp
        m = x.shape[1]
        kq = m + 1
        self.tau = float(lay["score_scale"][h])
        q0 = _proj(x, lay["w_q"], lay.get("b_q"), h)
        k0 = _proj(x, lay["w_k"], lay.get("b_k"), g)
        self.v = _proj(x, lay["w_v"], lay.get("b_v"), g)
        Aq = _abs_terms(x, lay["w_q"], lay.get("b_q"), h)
        Ak = _abs_terms(x, lay["w_k"], lay.get("b_k"), g)
        Av = _abs_terms(x, lay["w_v"], lay.get("b_v"), g)
        q1, q2 = _pairs(q0, layout)
        k1, k2 = _pairs(k0, layout)
        self.qn = self.tau * np.hypot(q1, q2)  # |q~_l|: a rotation keeps a pair's norm
        self.kn = np.hypot(k1, k2)
        # the pair norms' widths: both sides' projections (gamma_(m+1) A), rotations, scale and
        # norm (7 more roundings), over the pair (sqrt 2)
        a1, a2 = _pairs(Aq, layout)
        b1, b2 = _pairs(Ak, layout)
        self.dqn = 2 * math.sqrt(2) * gamma(kq + 8) * self.tau * (a1 + a2)
        self.dkn = 2 * math.sqrt(2) * gamma(kq + 8) * (b1 + b2)
        self.dv = 2 * gamma(kq + 1) * Av  # values: both sides' projections
        self.omega = omega
        self.trig = trig
        self.mp_v = [[mp.mpf(float(c)) for c in row] for row in self.v]
        self.q1, self.q2, self.k1, self.k2 = q1, q2, k1, k2
        self._pq: dict = {}

    def pair_products(self, i: int) -> list[tuple[list, list]]:
        """``(P_l, Q_l)`` of query ``i`` with every key ``j <= i`` (mpmath, exact products)."""
        if i not in self._pq:
            qa = [mp.mpf(float(c)) for c in self.q1[i]]
            qb = [mp.mpf(float(c)) for c in self.q2[i]]
            out = []
            for j in range(i + 1):
                ka = [mp.mpf(float(c)) for c in self.k1[j]]
                kb = [mp.mpf(float(c)) for c in self.k2[j]]
                out.append(([x * y + z * w for x, y, z, w in zip(qa, ka, qb, kb)],
                            [z * y - x * w for x, y, z, w in zip(qa, ka, qb, kb)]))
            self._pq[i] = out
        return self._pq[i]

    def _cs(self, delta: float, l_: int) -> tuple:
        key = (delta, l_)
        if key not in self.trig:
            t = mp.mpf(delta) * mp.mpf(float(self.omega[l_]))
            self.trig[key] = (mp.cos(t), mp.sin(t))
        return self.trig[key]

    def scores(self, i: int, p: float, deriv: bool = False) -> tuple[list, list]:
        """Scores ``s_ij`` (``j <= i``) with token ``i`` at position ``p`` and, with ``deriv``,
        ``ds_ij/dp`` (0 for the own key, whose offset stays 0)."""
        s, ds = [], []
        tau = mp.mpf(self.tau)
        for j, (P, Q) in enumerate(self.pair_products(i)):
            delta = 0.0 if j == i else float(j) - p
            acc, dacc = mp.mpf(0), mp.mpf(0)
            for l_ in range(len(P)):
                c, sn = self._cs(delta, l_)
                acc += P[l_] * c + Q[l_] * sn
                if deriv and j != i:
                    dacc += mp.mpf(float(self.omega[l_])) * (P[l_] * sn - Q[l_] * c)
            s.append(tau * acc)
            ds.append(tau * dacc)
        return s, ds

    def output(self, i: int, p: float, deriv: bool = False) -> tuple[list, list | None]:
        """``y_i`` (and ``y_i'``) with token ``i`` at position ``p``: mpmath, ``r`` components."""
        s, ds = self.scores(i, p, deriv)
        y = self._mix(s, i)
        if not deriv:
            return y, None
        top = max(s)
        w = [mp.exp(x - top) for x in s]
        Z = mp.fsum(w)
        w = [x / Z for x in w]
        r = len(self.mp_v[0])
        bar = mp.fsum(a * b for a, b in zip(w, ds))
        dy = [mp.fsum(w[j] * (ds[j] - bar) * self.mp_v[j][c] for j in range(i + 1))
              for c in range(r)]
        return y, dy

    def shift_phi1(self, i: int, p: float, delta: int) -> list:
        """``y_i(p + delta) - y_i(p)`` the other way (docs/math.md section 5): the query and its
        own key rotated to ``p`` and moved by ``delta A phi_1(delta A) z`` -- per pair
        ``delta omega ((sin a / a) J z - ((1 - cos a) / a) z)``, ``a = delta omega``,
        ``1 - cos a = 2 sin^2(a/2)`` -- the other keys rotated to their positions and kept."""
        tau, dl = mp.mpf(self.tau), mp.mpf(delta)
        L = len(self.omega)

        def rot(a: np.ndarray, b: np.ndarray, pos: float) -> list[tuple]:
            out = []
            for l_ in range(L):
                c, sn = self._cs(pos, l_)
                z1, z2 = mp.mpf(float(a[l_])), mp.mpf(float(b[l_]))
                out.append((z1 * c - z2 * sn, z2 * c + z1 * sn))
            return out

        def moved(z: list[tuple]) -> list[tuple]:
            out = []
            for l_, (z1, z2) in enumerate(z):
                w = mp.mpf(float(self.omega[l_]))
                a = dl * w
                if a == 0:
                    out.append((z1, z2))
                    continue
                sa, ca = mp.sin(a) / a, 2 * mp.sin(a / 2) ** 2 / a
                out.append((z1 + dl * w * (-sa * z2 - ca * z1), z2 + dl * w * (sa * z1 - ca * z2)))
            return out

        def dot(q: list[tuple], k: list[tuple]) -> Any:
            return tau * mp.fsum(a * c + b * e for (a, b), (c, e) in zip(q, k))

        q = rot(self.q1[i], self.q2[i], p)
        keys = [rot(self.k1[j], self.k2[j], float(j) if j != i else p) for j in range(i + 1)]
        s_old = [dot(q, k) for k in keys]
        q2, keys[i] = moved(q), moved(keys[i])
        s_new = [dot(q2, k) for k in keys]
        y_new, y_old = self._mix(s_new, i), self._mix(s_old, i)
        return [a - b for a, b in zip(y_new, y_old)]

    def _mix(self, s: list, i: int) -> list:
        """The softmax output of scores ``s`` over the values of ``j <= i``."""
        top = max(s)
        w = [mp.exp(x - top) for x in s]
        Z = mp.fsum(w)
        return [mp.fsum(w[j] * self.mp_v[j][c] for j in range(i + 1)) / Z
                for c in range(len(self.mp_v[0]))]

    def bounds(self, i: int) -> dict[str, dict]:
        """``G_n`` (``n = 1, 2, 3``), ``R`` (per component) and ``S`` of row ``i``, at the
        reference's values (``mid``) and at both ends of their widths (``lo``, ``hi``)."""
        own = i
        others = [j for j in range(i + 1) if j != own]
        V, dV = self.v[: i + 1], self.dv[: i + 1]
        out = {}
        for end in ("mid", "lo", "hi"):
            sgn = {"mid": 0.0, "lo": -1.0, "hi": 1.0}[end]
            qn = np.maximum(self.qn[i] + sgn * self.dqn[i], 0.0)
            kn = np.maximum(self.kn[others] + sgn * self.dkn[others], 0.0)
            G = {}
            for n in (1, 2, 3):
                g = (kn * qn[None] * self.omega[None] ** n).sum(1) if others else np.zeros(1)
                G[n] = float(g.max()) * (1.0 + sgn * 2 * gamma(len(self.omega) + 4))
            R = V.max(0) - V.min(0) + sgn * 2 * dV.max(0)
            S = float(np.abs(V).max()) + sgn * float(dV.max())
            out[end] = {"G": G, "R": np.maximum(R, 0.0), "S": max(S, 0.0)}
        return out


def _derivative_tol(b: dict, N: int, d: int, m: int, p: float, hh: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tol, eps_y, eps_d)`` per component of ``position_derivative`` at step ``hh``."""
    D1, D2, D3 = (2 * b["G"][n] for n in (1, 2, 3))
    R, S = b["R"], b["S"]
    B1, B2, B3 = R * D1, R * (D2 + D1 ** 2), R * (D3 + 3 * D1 * D2 + 4 * D1 ** 3)
    e_y = position_eval_abs(N, d, m, S, p + hh, B1)
    e_d = position_eval_abs(N, d, m, D1 * S, p, 2 * B2)
    return central_difference_abs(hh, B3, e_y) + e_d, e_y, e_d


def _step_inputs(b: dict, N: int, d: int, m: int, p: float) -> tuple[float, float]:
    """``(max eps_y at p + 1, max B3)``: the step rule's inputs."""
    D1, D2, D3 = (2 * b["G"][n] for n in (1, 2, 3))
    R, S = b["R"], b["S"]
    B3 = R * (D3 + 3 * D1 * D2 + 4 * D1 ** 3)
    return float(np.max(position_eval_abs(N, d, m, S, p + 1.0, R * D1))), float(np.max(B3))


def _quotient_width(num: float, wn: float, den: float, wd: float) -> float:
    v = num / den
    hi = (num + wn) / (den - wd) if den > wd else math.inf
    lo = max(num - wn, 0.0) / (den + wd)
    return max(hi - v, v - lo) + 2 * gamma(1) * v


def _ratio(err: np.ndarray, werr: np.ndarray, tol: np.ndarray, tlo: np.ndarray,
           thi: np.ndarray) -> tuple[float, float, float]:
    """``max_c err_c / tol_c`` and the ends of its interval."""
    r = float(np.max(err / tol))
    hi = float(np.max((err + werr) / tlo)) * (1 + 2 * gamma(1))
    lo = float(np.max(np.maximum(err - werr, 0.0) / thi)) * (1 - 2 * gamma(1))
    return r, lo, hi


def positional(lay: dict, item: dict, mod: dict, facts: dict, layer: int, context: int,
               seed: int, undecided: list) -> dict[str, tuple[dict, dict]]:
    """The ``position_derivative`` and ``position_shift`` records of one layer, with widths."""
    if float(mod["softcap"][0]) != 0.0 or int(mod["window"][0]) != 0 or \
            ("chunk" in mod and int(mod["chunk"][0]) != 0):
        raise ValueError(f"layer {layer}: soft-capped, windowed or chunked layer; this reference "
                         "covers none of these")
    x = item["x_bank"].astype(np.float64)
    N, m = x.shape
    H, Hk, d, layout = facts["n_heads"], facts["n_kv_heads"], facts["head_dim"], facts["layout"]
    qs = positional_queries(seed, context, layer, N, item["x_query"].shape[0])
    omega = mod["inv_freq"].astype(np.float64)
    trig: dict = {}
    heads = [_Head(lay, x, h, H // Hk, layout, omega, trig) for h in range(H)]
    drows, wdrows, srows, wsrows = [], [], [], []
    with mp.workdps(DPS):
        for i in qs:
            p = float(i)
            Nk = i + 1
            for h, hd in enumerate(heads):
                b = hd.bounds(i)
                # the step: its rule on the reference's inputs, decided on both ends
                e_mid, b3_mid = _step_inputs(b["mid"], Nk, d, m, p)
                e_lo, b3_lo = _step_inputs(b["lo"], Nk, d, m, p)
                e_hi, b3_hi = _step_inputs(b["hi"], Nk, d, m, p)
                hh = choose_step(e_mid, b3_mid)
                ends = {choose_step(e_lo * (1 - 1e-12), b3_hi * (1 + 1e-12)),
                        choose_step(e_hi * (1 + 1e-12), b3_lo * (1 - 1e-12))}
                if ends != {hh}:
                    undecided.append(f"layer {layer} position_derivative head {h} query {i}: "
                                     f"the step is {sorted(ends)} within the widths")
                tol, e_y, e_d = _derivative_tol(b["mid"], Nk, d, m, p, hh)
                tlo = _derivative_tol(b["lo"], Nk, d, m, p, hh)[0] * (1 - gamma(40))
                thi, ey_hi, ed_hi = _derivative_tol(b["hi"], Nk, d, m, p, hh)
                thi = thi * (1 + gamma(40))
                _, an = hd.output(i, p, deriv=True)
                yp, _ = hd.output(i, p + hh)
                ym, _ = hd.output(i, p - hh)
                fd = [(a - c) / (2 * mp.mpf(hh)) for a, c in zip(yp, ym)]
                an_f = np.array([float(z) for z in an])
                err = np.array([float(abs(a - c)) for a, c in zip(fd, an)])
                # the report's central difference: each evaluation within eps_y of the exact
                # one, so eps_y / h; its derivative and the reference's: eps_d each, and the
                # reference's float64 projections a further eps_d
                werr = ey_hi / hh + 3 * ed_hi
                der = float(np.max(np.abs(an_f)))
                wder = 2 * float(np.max(ed_hi))
                err_max = float(np.max(err))
                ratio, rlo, rhi = _ratio(err, werr, tol, tlo, thi)
                ok = ratio <= 1.0
                if not (rhi < 1.0 or rlo > 1.0):
                    undecided.append(f"layer {layer} position_derivative head {h} query {i}: "
                                     f"err/tol in [{rlo:.3e}, {rhi:.3e}]")
                rel = err_max / max(der, SCALE_GUARD)
                drows.append({"head": h, "query": i, "position": i, "h": hh,
                              "err_max": err_max, "rel": rel, "tol_max": float(np.max(tol)),
                              "ratio": ratio, "derivative_max": der, "ok": ok})
                tm = float(np.max(tol))
                wdrows.append({"head": None, "query": None, "position": None, "h": None,
                               "err_max": float(np.max(werr)),
                               "rel": _quotient_width(err_max, float(np.max(werr)), der, wder),
                               "tol_max": max(float(np.max(thi)) - tm, tm - float(np.max(tlo))),
                               "ratio": max(rhi - ratio, ratio - rlo),
                               "derivative_max": wder, "ok": None})
        for delta in DELTAS:
            for i in qs:
                p = float(i)
                Nk = i + 1
                for h, hd in enumerate(heads):
                    b = hd.bounds(i)

                    def tol_of(bb: dict) -> np.ndarray:
                        B1 = bb["R"] * 2 * bb["G"][1]
                        return 2 * position_eval_abs(Nk, d, m, bb["S"], p + abs(delta), B1)

                    tol = tol_of(b["mid"])
                    tlo = tol_of(b["lo"]) * (1 - gamma(20))
                    thi = tol_of(b["hi"]) * (1 + gamma(20))
                    y1, _ = hd.output(i, p + delta)
                    y0, _ = hd.output(i, p)
                    Dm = [a - c for a, c in zip(y1, y0)]
                    D = np.array([float(z) for z in Dm])
                    diff = float(np.max(np.abs(D)))
                    # the two ways agree to the working precision (the report's err is
                    # rounding, whose exact value is 0): the report's err lies within its own
                    # tolerance
                    err = np.array([float(abs(a - c)) for a, c in
                                    zip(Dm, hd.shift_phi1(i, p, delta))])
                    werr = float(np.max(thi))
                    tm = float(np.max(tol))
                    ratio = float(np.max(err / tol))
                    srows.append({"head": h, "query": i, "position": i, "delta": delta,
                                  "err_max": float(np.max(err)),
                                  "rel": float(np.max(err)) / max(diff, SCALE_GUARD),
                                  "difference_max": diff, "tol_max": tm, "ratio": ratio,
                                  "ok": ratio <= 1.0})  # the exact err (~0) is far below
                    wsrows.append({"head": None, "query": None, "position": None,
                                   "delta": None, "err_max": werr,
                                   "rel": _quotient_width(0.0, werr, diff, werr),
                                   "difference_max": werr,
                                   "tol_max": max(float(np.max(thi)) - tm,
                                                  tm - float(np.max(tlo))),
                                   "ratio": float(np.max(thi / tlo)), "ok": None})
    out = {}
    for check, rows, wrows, extra in (("position_derivative", drows, wdrows, {}),
                                      ("position_shift", srows, wsrows,
                                       {"deltas": list(DELTAS)})):
        rec = {"check": check, "layer": layer, **extra, "rows": rows,
               "err_max": max(r_["err_max"] for r_ in rows),
               "rel_max": max(r_["rel"] for r_ in rows),
               "ratio_max": max(r_["ratio"] for r_ in rows),
               "tolerance_from": TOL_FROM[check], "anchor": None,
               "ok": all(r_["ok"] for r_ in rows)}
        wrec = {"check": None, "layer": None, **({"deltas": [None] * len(DELTAS)} if extra
                                                 else {}),
                "rows": wrows, "err_max": max(w["err_max"] for w in wrows),
                "rel_max": max(w["rel"] for w in wrows),
                "ratio_max": max(w["ratio"] for w in wrows), "tolerance_from": None,
                "anchor": None, "ok": None}
        out[check] = (rec, wrec)
    return out


# ---------------------------------------------------------------------------------------------
# the whole dump
# ---------------------------------------------------------------------------------------------
def model_item(dump: Dump, context: int, layer: int) -> dict[str, np.ndarray]:
    return load_file(str(dump.path / f"context{context}_layer{layer}_model.safetensors"))


def recompute(path: str | Path, checks: tuple[str, ...] = CHECKS) -> Positional:
    """The three checks of every dumped layer (the claims run on the run's first context, 0),
    per context and pooled (``contexts``, ``ok``, the worst of each pooled field)."""
    dump = load_dump(path)
    man = dump.manifest
    seed = int(man["protocol"]["seed"])
    contexts = sorted({int(c) for c, _ in man["items"]})
    layers = sorted({int(L) for _, L in man["items"]})
    out = Positional()
    claims = 0
    for L in layers:
        facts = man["layers"][str(L)]
        lay, item, mod = dump.layer(L), dump.item(claims, L), model_item(dump, claims, L)
        recs: dict[str, tuple[dict, dict]] = {}
        if "conventions" in checks:
            recs["conventions"] = conventions(lay, item, mod, facts, L, out.undecided)
        if {"position_derivative", "position_shift"} & set(checks):
            recs.update(positional(lay, item, mod, facts, L, claims, seed, out.undecided))
        per_ctx = [{name: r for name, (r, _) in recs.items()} if c == claims else {}
                   for c in contexts]
        wper = [{name: w for name, (_, w) in recs.items()} if c == claims else {}
                for c in contexts]
        vals: dict[str, Any] = {"per_context": per_ctx}
        wid: dict[str, Any] = {"per_context": wper}
        for name, (r, w) in recs.items():
            vals[name] = {"contexts": 1, "ok": r["ok"], **{f: r[f] for f in POOLED[name]}}
            wid[name] = {"contexts": None, "ok": None, **{f: w[f] for f in POOLED[name]}}
        out.values[str(L)], out.widths[str(L)] = vals, wid
    return out
