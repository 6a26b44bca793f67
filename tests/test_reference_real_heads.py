"""``ropestep validate``'s ``real_heads`` claims -- ``positive_coefficients``, ``rank``,
``no_global_readout``, ``exact_rows`` and their pooled fields -- leaf by leaf against
:mod:`ropestep.reference.real_heads`, the independent recomputation from the raw dump
(docs/protocol.md section 12.9).

:func:`compare_claims` walks every leaf of those checks (``real_heads/per_context/*/<check>``,
``real_heads/<check>``, and ``per_context/*/context``): a leaf the reference does not compute
fails, as does a leaf the reference computed that the report lacks.  Counts, indices, ranks,
flags and labels are equal (which needs each decision behind them clear of its threshold by more
than both sides' rounding: :func:`undecided` checks that on the data); floats are within
tolerances derived from :mod:`ropestep.tolerances` and the sizes the reference keeps
(:class:`Tolerances`, each method says where its bound comes from); the leaves that are rounding
errors of the report's own float64 arithmetic (``sigma_ratio_after_d``, the oracle rows'
relative errors) are compared against a derived bound that both sides must lie below, with the
``ok`` decision equal.  ``EXEMPT`` names the leaves that are not computed from the data.
Planted one-line bugs (``MUTANTS``) in :mod:`ropestep.realchecks` and :mod:`ropestep.protocol`
must each turn the comparison red.

The model: the tiny seeded Qwen2 of tests/test_reference_validate.py, run with ``--exact-rows
2`` so that the oracle rows exist (one row in each of the two contexts).
"""
from __future__ import annotations

import math
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ropestep
from ropestep import cli, protocol, realchecks
from ropestep import tolerances as tl
from ropestep.reference import real_heads as reference
from ropestep.report import dumps, load
from ropestep.verdict import loads
from reference_walk import agrees, at, has, leaves
from reference_walk import one_torch_thread  # noqa: F401  (autouse, module scope)
from test_reference_validate import TINY_ARGS, build_model

pytestmark = pytest.mark.model

F64 = torch.float64
U = tl.unit_roundoff(F64)
ARGS = [*TINY_ARGS[:TINY_ARGS.index("--exact-rows")], "--exact-rows", "2"]
CHECKS = reference.CHECKS
EXEMPT = {  # leaves not computed from the data, with the reason
    "tolerance_from": "the report's description of its own tolerance (text of the code)",
    "exact_seconds": "wall-clock time of the oracle",
}
BOUNDED = {  # rounding errors of one side's float64 arithmetic: both sides below the bound
    "rank": ("sigma_ratio_after_d", "sigma_ratio_after_d_max"),
    "exact_rows": ("y_rel", "delta_m_rel", "delta_m_rel_entrywise", "c_rel", "readout_rel",
                   "y_rel_max", "delta_m_rel_max", "c_rel_max", "readout_rel_max"),
}
EXACT = ("check", "gauge", "argmin", "coefficients", "tolerance", "ok", "head", "query", "key",
         "keys", "rank", "bound", "d", "rank_max", "queries", "pairs", "inputs", "pair",
         "x_part_zero", "digits", "position", "contexts", "context")


def runner_up(x: np.ndarray) -> float:
    """The second largest value (``-inf`` for a single one: nothing to swap with)."""
    return float(np.sort(x)[-2]) if len(x) > 1 else -math.inf


def gamma(n: int) -> float:
    """``gamma_n`` in float64: ``n`` rounded operations on non-negative operands."""
    return tl.nonnegative_ops_rel(n)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    root: Path
    report: dict
    ref: reference.Claims
    seconds: dict


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    """The tiny model's validate run with ``--dump-raw`` (oracle rows inline: no side process
    to spawn), then the reference on the dump."""
    root = tmp_path_factory.mktemp("reference_real_heads")
    model = build_model(root / "model")
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("ROPESTEP_ORACLE_INLINE", "1")
        assert cli.main(["validate", "--model", str(model), *ARGS, "--quiet", "--no-figures",
                         "--out", str(root / "validate"), "--dump-raw", str(root / "raw")]) == 0
    t1 = time.perf_counter()
    ref = reference.recompute(root / "raw")
    t2 = time.perf_counter()
    return Case(root, load(root / "validate" / "report.json"), ref,
                {"validate": t1 - t0, "reference": t2 - t1})


# ---------------------------------------------------------------------------------------------
# tolerances
# ---------------------------------------------------------------------------------------------
class Tolerances:
    """The tolerances of one layer's claims, from :mod:`ropestep.tolerances`, the run's sizes and
    the reference's support (docs/protocol.md section 12.9 names the symbols).

    Base errors.  Outputs, as tests/test_reference_validate.py derives them: the two sides'
    float64 evaluations of one softmax output (a value, a mean) agree to the whole-layer agreement
    level ``a64 = agreement_rel_tol(float64, N + 1, d, m)`` relative to the value scale ``V``:
    within ``ey = a64 V`` per component.  Scores, to first order in ``u`` from their absolute
    terms: a rotated query component is an ``m+1``-term product, a rotation (two products and a
    sum) and a scale, within ``gamma_(m+5)`` of its absolute terms ``Qabs`` (``tau |u| |W^_q|``,
    the rotation pair's two components summed); a rotated key within ``gamma_(m+4)`` of ``Kabs``;
    the ``d``-term score adds ``gamma_d``: one side's score is within ``ds = gamma_(2m+d+9)
    qk_ij`` of the exact one, ``qk_ij = sum_l Qabs_il Kabs_jl`` (``gamma_a + gamma_b <=
    gamma_(a+b)``).  A coefficient ``c_ij = rho(s_ij)/Z_i`` then moves by a factor within
    ``e^(+-2 max_j ds_ij)`` per side (``log rho`` and ``log Z_i`` are each 1-Lipschitz in the
    scores), plus the rounding of ``rho`` and of ``Z``'s ``N``-term sum, ``gamma_(N+4)``.
    """

    def __init__(self, ref: reference.Claims, layer: str):
        f = ref.manifest["layers"][layer]
        self.d, self.m, self.r, self.H, self.D = (f[k] for k in ("head_dim", "hidden", "r",
                                                                 "n_heads", "out"))
        self.L = layer
        self.ref = ref
        self.sup = {c: s for (L, c), s in ref.support.items() if str(L) == layer}
        self.contexts = sorted(self.sup)
        self.N = self.sup[self.contexts[0]]["positive_coefficients"]["c"].shape[2]
        self.a64 = tl.agreement_rel_tol(F64, self.N + 1, self.d, self.m)

    def ds(self, qk_max: float) -> float:
        """One side's score error bound, ``gamma_(2m+d+9) max_j qk_ij``."""
        return gamma(2 * self.m + self.d + 9) * qk_max

    def ref_rec(self, c: int, name: str) -> Any:
        """The reference's record of check ``name`` in context ``c`` (None where absent)."""
        recs = self.ref.report["layers"][self.L]["real_heads"]["per_context"]
        return next(r for r in recs if r["context"] == c).get(name)

    def c_rel(self, qk_max: float, n: int, sides: int = 2) -> float:
        """The relative tolerance of a coefficient whose row has ``max_j qk_ij = qk_max``: of one
        side against the exact value (``sides = 1``), or of the two sides' difference."""
        return math.expm1(sides * 2 * self.ds(qk_max)) + sides * gamma(n + 4)

    # -- positive coefficients --
    def positive(self, c: int) -> float:
        """Relative tolerance of every coefficient of context ``c`` (the worst row's); a
        minimum of values each within it is within it."""
        qk = self.sup[c]["positive_coefficients"]["qk"]
        return self.c_rel(float(qk.max()), self.N)

    # -- rank --
    def dm_parts(self, qk_max: float, n: int, sides: int = 2) -> tuple[float, float]:
        """``(e_c, e_ops)``: ``Delta M_i = sum_j c_ij a_j t_j^T`` differs entrywise by at most
        ``e_c Sact_pq + e_ops Sabs_pq`` -- the coefficients' tolerance ``e_c`` against the terms'
        own size ``Sact_pq = sum_j |c_ij| |a_jp| |t_jq|``, and ``e_ops`` (the roundings of the
        ``m+1``-term projections, the rotation, the ``d``-term contraction, the ``n``-term sum and
        the centring, ``gamma_(n+d+m+8)`` per side, times ``1 + e_c``) against their absolute
        terms ``Sabs_pq = sum_j |c_ij| A_jp (|u_j||W^_v| + max_j |u_j||W^_v|)_q``."""
        e_c = self.c_rel(qk_max, n, sides)
        return e_c, sides * gamma(n + self.d + self.m + 8) * (1 + e_c)

    def sigma(self, s: dict) -> float:
        """Tolerance of a singular value of ``Delta M W_o,h``: the 2-norm (<= Frobenius) of the
        difference of the two sides' products -- ``(e_c Sact + e_ops Sabs) |W_o|`` plus each
        side's product rounding ``gamma_r |Delta M| |W_o|`` -- (Weyl), plus each side's SVD
        backward error, numpy's ``max(shape) eps sigma_max`` (the rank threshold's own model)."""
        e_c, e_ops = self.dm_parts(s["qk_max"], self.N)
        return (e_c * s["sact_w"] + e_ops * s["sabs_w"] + 2 * gamma(self.r) * s["abs_prod"]
                + 2 * max(s["shape"]) * 2 * U * float(s["sv"][0]))

    def threshold_ratio(self, s: dict) -> float:
        """``thr / sigma_max = max(shape) eps + r u |Delta M|_F |W_o|_F / sigma_max``: the
        norms' relative tolerance (``dm_rel |Sabs|_F / |Delta M|_F`` plus both sides' rounding of
        the two Frobenius norms and their product) and sigma_max's, plus 4 roundings."""
        smax = float(s["sv"][0])
        rs = self.sigma(s) / smax
        e_c, e_ops = self.dm_parts(s["qk_max"], self.N)
        rn = ((e_c * s["sact_F"] + e_ops * s["sabs_F"]) / s["dm_F"]
              + 2 * gamma((self.m + 1) * self.r + self.r * self.D + 2))
        part = self.r * U * s["norms"] / smax
        return part * (rn + rs) / (1 - rs) + 4 * gamma(4) * (s["thr"] / smax)

    # -- no global readout --
    def ey(self, V: float) -> float:
        return self.a64 * V

    def ngr_head(self, c: int, k: int) -> dict[str, float]:
        """Per field of ``heads[k]`` of ``no_global_readout``, from the outputs' base error
        ``ey = a64 V`` per component:

        * ``lower_computed``: ``|y_c - (y_a + y_b)/2|/2`` with each component within ``2 ey``:
          ``sqrt(r) ey``, plus both sides' rounding of the norm;
        * ``float64_error = sqrt(r) FLOAT64_REL S + 4 u best``: ``S = max|v|`` within ``ey``;
        * ``upper`` (the largest row of the least-squares residual ``(I - P_B)(Y - mu)``): the
          residual is 1-Lipschitz in ``Y - mu`` (Frobenius), whose entries differ by ``2 ey``:
          ``sqrt(P r) 2 ey``; plus the report's own rounding of ``U M``, ``max|u_k| |dM|``
          (below), and of the products, ``gamma_(m+2) max|u_k| |M|_F``;
        * the hull witness from ``M``: ``|dM|`` bounds the difference of the two sides' ``M``
          (the report's own pseudo-inverse and least squares, Wedin's and Higham's (20.1)
          perturbation bounds with a backward error ``2 max(shape) u`` of each SVD, plus the
          difference of the ``Y``'s through ``|U_Q^+| |B^+| sqrt(P r) 2 ey``); ``sig =
          |M_x|_2`` within ``|dM|`` plus both SVDs' backward error; ``last = |M_0|`` within
          ``|dM|``; ``R = max_j |v_j - mu|`` within ``sqrt(r) 2 ey``; ``t = 1.01 (last + R + 1) /
          sig`` by interval arithmetic; ``certified = t |l_1^T M_x| - last - R``, which is
          ``0.01 (last + R) + 1.01`` up to the singular vector's backward error:
          ``0.01 (d last + d R)`` plus ``1.01 (last + R + 1)`` times that error on each side.
        """
        sup = self.sup[c]["no_global_readout"]
        s = sup["heads"][k]
        r, P, Q, m = self.r, sup["P"], len(sup["sv_U"]), self.m
        ey = self.ey(s["V"])
        best = float(np.max(s["lower"]))
        t_lower = math.sqrt(r) * ey + 2 * gamma(r + 3) * best
        t_err = (math.sqrt(r) * tl.FLOAT64_REL * ey + 4 * U * t_lower
                 + 4 * gamma(4) * (math.sqrt(r) * tl.FLOAT64_REL * s["V"] + 4 * U * best))
        dY = math.sqrt(P * r) * 2 * ey
        svU, svB = sup["sv_U"], sup["B_sv"]
        pinv = 1 / svU[-1]
        kB = svB[0] / svB[-1]
        eU, eB = 2 * max(Q, m + 1) * U, 2 * max(P, Q) * U
        # Higham (20.1): |dZ| <= eps kB/(1 - eps kB) (2 |Z| + (kB + 1) |res| / |B|_2)
        dZ_own = eB * kB / (1 - eB * kB) * (2 * s["Z"] + (kB + 1) * s["res"] / svB[0])
        dpinv = math.sqrt(2) * pinv ** 2 * eU * svU[0]  # Wedin: sqrt2 |A+| |A'+| |E|
        dM_own = pinv * dZ_own + dpinv * s["Z"] + gamma(Q) * math.sqrt(Q) * pinv * s["Z"]
        dM = dM_own + pinv * dY / svB[-1] + s["M_own"]
        t_upper = (dY + sup["u_max"] * dM_own + gamma(m + 2) * sup["u_max"] * s["M"]
                   + 2 * gamma(r + 1) * s["M"] * sup["u_max"])
        out = {"lower_computed": t_lower, "float64_error": t_err,
               "lower_certified": t_lower + t_err, "upper": t_upper, "best": best,
               "second": runner_up(s["lower"])}
        if "sig" not in s:  # M_x = 0: the report's hull holds x_part_zero alone
            return out
        e_svd = 2 * max(m, r) * U
        d_sig = dM + 2 * e_svd * s["sig"]
        d_R = math.sqrt(r) * 2 * ey + 2 * gamma(r + 1) * s["R"]
        base = s["last"] + s["R"] + 1
        t_t = s["t"] * ((dM + d_R) / base + d_sig / (s["sig"] - d_sig)) + 2 * gamma(4) * s["t"]
        t_cert = (0.01 * (dM + d_R) + 2 * 1.01 * base * (e_svd + gamma(m + 3))
                  + 2 * gamma(4) * base)
        return {**out, "t": t_t, "certified": t_cert,
                "t_over_input_norm": (t_t / s["t"] + 2 * gamma(m + 3)) * s["t"] / s["med"]}

    def ngr_combined(self, c: int) -> dict[str, float]:
        """``combined``: the write's components each within ``eo = sum_h ey_h w1_h`` plus both
        sides' rounding of the head sum, ``2 gamma_(H r + 1) max |y||W_o|``; then as per head
        with ``sqrt(D)``; ``float64_error``'s ``colsum`` within ``sum_h ey_h w1_h``,
        ``prod_round``'s size within ``H r u`` times ``eo``."""
        sup = self.sup[c]["no_global_readout"]
        sc, hs = sup["combined"], sup["heads"]
        eo = (sum(self.ey(h["V"]) * w for h, w in zip(hs, sc["w1"]))
              + 2 * gamma(self.H * self.r + 1) * sc["absw"])
        best = float(np.max(sc["lower"]))
        D = self.D
        t_lower = math.sqrt(D) * eo + 2 * gamma(D + 3) * best
        colsum = sum(h["V"] * w for h, w in zip(hs, sc["w1"]))
        d_col = sum(self.ey(h["V"]) * w for h, w in zip(hs, sc["w1"])) + gamma(self.H * self.r) \
            * colsum
        val = math.sqrt(D) * (tl.FLOAT64_REL * colsum + 2 * self.H * self.r * U * sc["absw"])
        t_err = (math.sqrt(D) * (tl.FLOAT64_REL * d_col + 2 * self.H * self.r * U * eo)
                 + 4 * U * t_lower + 4 * gamma(4) * (val + 4 * U * best))
        return {"lower_computed": t_lower, "float64_error": t_err,
                "lower_certified": t_lower + t_err, "best": best,
                "second": runner_up(sc["lower"])}

    # -- the oracle rows --
    def oracle(self, c: int, k: int) -> dict[str, float]:
        """Row ``k`` of context ``c``'s ``exact_rows``.  Exact quantities (``kappa``,
        ``score_max``, ``c_min_exact``): each side rounds an mpmath value (50 digits, of which
        ``exact_tol(50)`` are trusted) once, so they agree to ``2 u + exact_tol(50)`` relative;
        ``readout_tol`` and ``first_order`` are formulas of those (4 more roundings).  Bounds of
        the rounding-level errors of one side against the exact row (comments below):
        ``c_rel`` the coefficients' one-side tolerance; ``delta_m_rel`` :meth:`dm_parts`'s
        ``e_c`` (``Sact`` is at most section 12.9's ``scale``) plus ``e_ops`` times ``max Sabs /
        max scale``, ``_entrywise`` times the largest entrywise ratio.  These worst-case bounds
        ignore all cancellation of rounding errors and lie above the report's 1e-12 criterion
        on this data, so they cannot decide the rows' ``ok``; that flag is compared equal."""
        o = self.sup[c]["exact_rows"][k]
        n = len(o.c)
        ex = 2 * U + tl.exact_tol(50)
        ds = self.ds(o.qk_max)
        crel = self.c_rel(o.qk_max, n, sides=1)
        e_c, e_ops = self.dm_parts(o.qk_max, n, sides=1)
        # the softmax output: values within gamma_(m+1) of their absolute terms, the weights'
        # factors within 2 ds each (numerator and Z) plus the N-term sums
        yb = gamma(self.m + 1) * o.vabs_ratio + math.expm1(4 * ds) + gamma(n + 6)
        # the readout mu + q T: the sum's rounding on float inputs (readout_bound), the
        # projections' through q and k (absolute terms: kappa_abs) and the values', and the
        # coefficients' factors
        ro = (float(tl.readout_bound(F64, max(1.0, o.kappa), n, self.d, o.smax))
              + gamma(2 * self.m + 9) * o.kappa_abs + math.expm1(2 * ds) * o.kappa
              + gamma(self.m + 1) * o.vabs_ratio * (1 + o.kappa))
        return {"kappa": ex * o.kappa, "score_max": ex * o.smax,
                "c_min_exact": ex * float(o.c.min()),
                "readout_tol": (ex + 4 * U) * max(tl.FLOAT64_REL, (n + self.d + 8 + o.smax)
                                                  * U * o.kappa),
                "first_order": U * ex * o.smax + 4 * U * (n + self.d + self.m + 8 + o.smax) * U,
                "y_rel": yb, "c_rel": crel, "delta_m_rel": e_c + e_ops * o.sabs_norm_ratio,
                "delta_m_rel_entrywise": e_c + e_ops * o.sabs_ratio, "readout_rel": ro}


def tolerance(T: Tolerances, rest: tuple, value: Any) -> tuple[str, float]:
    """``("exact", 0)``, ``("abs", tol)`` or ``("bound", B)`` of a leaf at ``rest`` (from
    ``real_heads``): ``per_context/k/<check>/...`` or ``<check>/<field>``."""
    last = next((p for p in reversed(rest) if isinstance(p, str)), "")
    if last in EXACT or isinstance(value, (bool, str)) or value is None:
        return "exact", 0.0
    if rest[0] == "per_context":
        c = T.contexts[rest[1]]
        return field_tolerance(T, c, rest[2], rest[3:], last)
    return pooled_tolerance(T, rest[0], last)


def field_tolerance(T: Tolerances, c: int, name: str, rest: tuple, last: str
                    ) -> tuple[str, float]:
    if name == "positive_coefficients":  # min_c, per_head_min: relative
        v = abs(float(at(T.ref_rec(c, name), rest)))
        return "abs", T.positive(c) * v
    if name == "rank":
        sups = T.sup[c]["rank"]
        if rest[0] == "rows":
            s = sups[rest[1]]
            if last == "sigma_max":
                return "abs", T.sigma(s)
            ratio = s["thr"] / float(s["sv"][0])
            if last == "threshold_ratio":
                return "abs", T.threshold_ratio(s)
            return "bound", ratio + T.threshold_ratio(s)  # sigma_ratio_after_d
        return "bound", max(s["thr"] / float(s["sv"][0]) + T.threshold_ratio(s) for s in sups)
    if name == "no_global_readout":
        if rest[0] == "heads":
            return "abs", T.ngr_head(c, rest[1])[last]
        if rest[0] == "combined":
            return "abs", T.ngr_combined(c)[last]
        # lower_certified_min
        return "abs", max(T.ngr_head(c, k)["lower_certified"]
                          for k in range(len(T.sup[c]["no_global_readout"]["heads"])))
    # exact_rows
    if rest[0] == "rows":
        tol = T.oracle(c, rest[1])[last]
        return ("bound" if last in BOUNDED["exact_rows"] else "abs"), tol
    key = last[:-len("_max")]
    return "bound", max(T.oracle(c, k)[key] for k in range(len(T.sup[c]["exact_rows"])))


def pooled_tolerance(T: Tolerances, name: str, last: str) -> tuple[str, float]:
    """A pooled field: the worst of its contexts' tolerances (a min or max of values each within
    its own)."""
    recs = [(c, T.ref_rec(c, name)) for c in T.contexts if T.ref_rec(c, name) is not None]
    if name == "positive_coefficients":
        return "abs", max(T.positive(c) * abs(r["min_c"]) for c, r in recs)
    if name == "no_global_readout":
        return "abs", max(field_tolerance(T, c, name, ("lower_certified_min",), last)[1]
                          for c, _ in recs)
    return "bound", max(field_tolerance(T, c, name, (last,), last)[1] for c, _ in recs)


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------
def mine(rest: tuple) -> bool:
    """A leaf of ``real_heads`` this comparison covers."""
    if rest[0] == "per_context":
        return len(rest) >= 3 and (rest[2] in CHECKS or rest[2] == "context")
    return rest[0] in CHECKS


def compare_claims(report: dict, ref: reference.Claims) -> tuple[list[str], set[str]]:
    """Every leaf of ``report``'s ``real_heads`` claims (all layers) against the reference: the
    problems, and the check names covered."""
    problems: list[str] = []
    for L, lr in report["layers"].items():
        rh = lr.get("real_heads") or {}
        if L not in ref.report["layers"]:
            problems += [f"layers/{L}/real_heads/{'/'.join(map(str, rest))}: no reference for "
                         "this layer" for rest, _ in leaves(rh) if mine(rest)]
            continue
        want = ref.report["layers"][L]["real_heads"]
        T = Tolerances(ref, L)
        for rest, value in leaves(rh):
            if not mine(rest):
                continue
            where = f"layers/{L}/real_heads/" + "/".join(map(str, rest))
            if rest[-1] in EXEMPT:
                continue
            if not has(want, rest):
                problems.append(f"{where}: no reference for this leaf")
                continue
            expected = at(want, rest)
            kind, tol = tolerance(T, rest, value)
            if kind == "bound":
                if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                        and 0 <= value <= tol and 0 <= expected <= tol):
                    problems.append(f"{where}: validate {value!r} and reference {expected!r} "
                                    f"must both lie in [0, {tol:.3g}]")
            elif not agrees(value, expected, tol):
                problems.append(f"{where}: validate {value!r}, reference {expected!r}, "
                                f"tolerance {tol:.3g}")
        for rest, value in leaves(want):
            if mine(rest) and rest[-1] not in EXEMPT and not has(rh, rest):
                problems.append(f"layers/{L}/real_heads/{'/'.join(map(str, rest))}: the "
                                f"reference has {value!r}, the report has no such leaf")
    return problems, set(CHECKS)


def undecided(ref: reference.Claims) -> list[str]:
    """Decisions behind the compared counts, indices and flags that lie within the two sides'
    rounding of their thresholds: the argmin of ``c`` (runner-up within the tolerances), the rank
    counts (one of the first ``min(d, r, n - 1)`` singular values within its tolerance of the
    threshold, ``n`` the number of distinct bank inputs; the others are exactly 0 -- ``Delta M``
    has ``r`` columns and its centred values ``(u_j - mean u) W^_v`` span at most ``n - 1``
    dimensions (repeated tokens have equal inputs at layer 0) -- and their computed values are each side's
    rounding, which the threshold is built to exceed: there the counts are compared, not
    guaranteed by a bound), the pairs of
    ``no_global_readout`` (runner-up within twice the tolerance), its ``ok`` (``certified``
    within its tolerance of 0).  (The oracle rows' flags: :meth:`Tolerances.oracle`.)"""
    out = []
    for L in ref.report["layers"]:
        T = Tolerances(ref, L)
        for c in T.contexts:
            sup = T.sup[c]
            cc = np.sort(sup["positive_coefficients"]["c"].ravel())
            rel = T.positive(c)
            if cc[1] * (1 - rel) <= cc[0] * (1 + rel):
                out.append(f"layer {L} context {c}: the argmin of c within rounding")
            for k, s in enumerate(sup.get("rank", [])):
                tol, thr = T.sigma(s), s["thr"]
                t_thr = T.threshold_ratio(s) * float(s["sv"][0])
                bound = min(T.d, T.r, s["distinct"] - 1)
                if any(abs(x - thr) <= tol + t_thr for x in s["sv"][:bound]):
                    out.append(f"layer {L} rank row {k}: a singular value at the threshold")
            if sup.get("no_global_readout"):
                for k in range(len(sup["no_global_readout"]["heads"])):
                    t = T.ngr_head(c, k)
                    if t["best"] - t["second"] <= 2 * t["lower_computed"]:
                        out.append(f"layer {L} head {k}: no_global_readout's pair within rounding")
                    cert = at(T.ref_rec(c, "no_global_readout"), ("heads", k, "lower_certified"))
                    if abs(cert) <= t["lower_certified"]:
                        out.append(f"layer {L} head {k}: certified bound at 0")
                t = T.ngr_combined(c)
                if t["best"] - t["second"] <= 2 * t["lower_computed"]:
                    out.append(f"layer {L}: the combined pair within rounding")
    return out


def check(report: dict, ref: reference.Claims) -> None:
    problems, covered = compare_claims(report, ref)
    open_ = undecided(ref)
    assert covered == set(CHECKS)
    assert not open_, "\n".join(open_)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_every_claim_leaf_of_the_tiny_report_agrees(case):
    print("seconds:", case.seconds)
    check(case.report, case.ref)
    n = sum(1 for L in case.report["layers"].values()
            for rest, _ in leaves(L["real_heads"]) if mine(rest))
    assert n > 300
    # every check exists, and the oracle rows in both contexts
    for lr in case.report["layers"].values():
        rh = lr["real_heads"]
        assert all(name in rh for name in CHECKS)
        assert rh["exact_rows"]["contexts"] == 2 and rh["positive_coefficients"]["contexts"] == 2


def test_the_comparison_flags_unknown_and_missing_leaves(case):
    grown = loads(dumps(case.report))
    rh = grown["layers"]["0"]["real_heads"]
    rh["per_context"][0]["rank"]["rows"][1]["new_statistic"] = 0.5
    rh["no_global_readout"]["extra"] = 1.0
    del rh["per_context"][1]["exact_rows"]["rows"][0]["kappa"]
    problems, _ = compare_claims(grown, case.ref)
    text = "\n".join(problems)
    assert "rows/1/new_statistic: no reference" in text
    assert "real_heads/no_global_readout/extra: no reference" in text
    assert "per_context/1/exact_rows/rows/0/kappa: the reference has" in text


MUTANTS = [  # (the planted bug, the module, its line, the mutation, a leaf that must disagree)
    ("c taken as the softmax weights", "realchecks",
     "c = torch.where(st.mask[None], st.c, torch.full_like(st.c, math.inf))",
     "c = torch.where(st.mask[None], torch.softmax(st.s, -1), torch.full_like(st.c, math.inf))",
     "positive_coefficients/min_c"),
    ("the argmin over the transposed (head, key, query) order", "realchecks",
     "flat = int(torch.argmin(torch.nan_to_num(c, nan=-math.inf)))",
     "flat = int(torch.argmin(torch.nan_to_num(c, nan=-math.inf).transpose(1, 2)))",
     "positive_coefficients/argmin"),
    ("the rank threshold 10x", "realchecks",
     "thr = tl.rank_threshold(tuple(prod.shape), smax, r,",
     "thr = 10 * tl.rank_threshold(tuple(prod.shape), smax, r,", "/threshold_ratio"),
    ("the no-global-readout bound without its 1/2", "realchecks",
     "lower = torch.linalg.vector_norm(gap, dim=-1) / 2  # (H, pairs)",
     "lower = torch.linalg.vector_norm(gap, dim=-1)  # (H, pairs)", "/lower_computed"),
    ("the float64 error without its sqrt(r)", "realchecks",
     "err = math.sqrt(r) * tl.FLOAT64_REL * S + 4 * U64 * best",
     "err = tl.FLOAT64_REL * S + 4 * U64 * best", "/float64_error"),
    ("the hull witness's t without its + 1", "realchecks",
     "t = 1.01 * (last + R + 1.0) / sig", "t = 1.01 * (last + R) / sig", "hull/t"),
    ("the oracle's smallest coefficient taken as its largest", "realchecks",
     '"c_min_exact": float(ce.min()), "first_order": first, "ok": ok})',
     '"c_min_exact": float(ce.max()), "first_order": first, "ok": ok})', "/c_min_exact"),
    ("the pooled minima taken as maxima", "protocol",
     "agg[f] = (least(vals) if f.startswith((\"min\", \"lower\")) or f.endswith(\"_min\")",
     "agg[f] = (worst(vals) if f.startswith((\"min\", \"lower\")) or f.endswith(\"_min\")",
     "real_heads/positive_coefficients/min_c"),
    ("the oracle sample drawn with another stream", "protocol",
     "rng = np.random.default_rng([seed, 9])", "rng = np.random.default_rng([seed, 8])",
     "exact_rows/rows/0/"),
]


def mutated(name: str, old: str, new: str, monkeypatch) -> types.ModuleType:
    """``ropestep.<name>`` with one line replaced, as a module of its own."""
    orig = {"protocol": protocol, "realchecks": realchecks}[name]
    src = Path(orig.__file__).read_text(encoding="utf-8")
    assert src.count(old) == 1, f"the planted line is not in {name}.py exactly once: {old!r}"
    mod = types.ModuleType(f"ropestep._{name}_mutant")
    mod.__file__, mod.__package__ = orig.__file__, "ropestep"
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # dataclasses look their module up
    exec(compile(src.replace(old, new), orig.__file__, "exec"), mod.__dict__)
    return mod


@pytest.fixture(scope="module")
def loaded(case):
    return protocol.load(run_config(case))


def run_config(case: Case) -> protocol.Config:
    return protocol.Config(**{**case.report["config"], "model": str(case.root / "model")})


def rerun(case: Case, loaded_model, module: types.ModuleType = protocol) -> dict:
    """The case's run again in process (oracle rows inline), as ``report.json`` reads back."""
    result = module.run(run_config(case), progress=False, loaded=loaded_model,
                        command=case.report["command"])
    result["config"] = case.report["config"]
    return loads(dumps(result))


@pytest.mark.parametrize("bug, name, old, new, leaf", MUTANTS, ids=[m[0][:40] for m in MUTANTS])
def test_a_planted_bug_turns_the_comparison_red(case, loaded, monkeypatch, bug, name, old, new,
                                                leaf):
    monkeypatch.setenv("ROPESTEP_ORACLE_INLINE", "1")
    mod = mutated(name, old, new, monkeypatch)
    if name == "realchecks":
        monkeypatch.setattr(ropestep, "realchecks", mod)  # protocol imports it at call time
        result = rerun(case, loaded)
    else:
        result = rerun(case, loaded, mod)
    problems, _ = compare_claims(result, case.ref)
    print(bug, len(problems), problems[:3])
    assert any(leaf in p for p in problems), f"{bug}: no disagreement at {leaf}"


def test_two_real_smollm2_contexts(tmp_path):
    """The same comparison on the real SmolLM2-135M (no biases, 9 heads on 3 KV heads, r = d =
    64), layers 0 and 20, two contexts of the bundled corpus, without oracle rows (50-digit rows
    at m = 576 cost seconds each; the tiny run covers them).  Layer 0's bank repeats tokens, so
    its centred values span fewer dimensions than ``N - 1`` and the rank stays below
    ``bound``: the reference's rank counts the same singular values."""
    from ropestep import models

    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("ROPESTEP_ORACLE_INLINE", "1")
        assert cli.main(["validate", "--model", "smollm2", "--contexts", "2", "--queries", "6",
                         "--prefix-len", "48", "--layers", "0,20", "--exact-rows", "0",
                         "--quiet", "--no-figures", "--out", str(tmp_path / "validate"),
                         "--dump-raw", str(tmp_path / "raw")]) == 0
    t1 = time.perf_counter()
    ref = reference.recompute(tmp_path / "raw")
    print("seconds:", {"validate": t1 - t0, "reference": time.perf_counter() - t1})
    report = load(tmp_path / "validate" / "report.json")
    check(report, ref)
    ranks = [row["rank"] for row in report["layers"]["0"]["real_heads"]["per_context"][0][
        "rank"]["rows"]]
    assert max(ranks) < min(64, 46)  # below min(d, r, N - 1): the repeated tokens
