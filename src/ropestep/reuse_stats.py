"""Pooling of the frozen-reuse table and the calibration statistics (pure numpy).

The paper's table (docs/protocol.md, "Frozen reuse"): for context ``c`` with ``Q`` queries and
anchor ``a``, a predictor ``f`` of the projected write ``o_ci in R^D`` scores

    E_ca(f) = 1/((Q-1) D) sum_{i != a} ||f_ci - o_ci||^2                      (the anchor excluded)

and is pooled with equal context weights, ratios taken after pooling:

    E(f)      = (1/C) sum_c E_c0(f)                                            ("anchor 0")
    E_all(f)  = (1/C) sum_c [ (1/Q) sum_a E_ca(f) ]                            ("all anchors":
                                                                                anchors first)
    rRMSE(f)  = sqrt(E(f) / E(o_ca))                 (against the constant-anchor-output baseline)

Target RMS is ``sqrt`` of the same pooling applied to the zero predictor.  Arrays may be numpy
or torch (converted with ``numpy.asarray``); everything is computed in float64.

Non-finite values are never dropped silently: a NaN or inf error propagates through every
pooled number (mean, max, ratio, summary) and shows up as ``nan``/``inf`` in the report; the
only functions that look at finite entries alone are the descriptive :func:`binned` (quantile
bins need finite values) -- and :func:`summarize` counts what is non-finite beside its
propagated statistics.

Calibration (docs/math.md section 6) measures how much correction a frozen anchor matrix needs as a
function of how far a query is from the anchor: the relative error ``||e_i|| / ||y_i - mu||``
against three distances (raw score vectors in the sup norm, total variation of the attention
rows, Euclidean distance of the layer inputs), the best scalar gain ``gamma`` of
``mu + gamma u_i^T dM_0``, and the agreement of the tokenwise formula with the measured error.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from .verdict import least, worst

PREDICTORS = ("constant", "mean", "frozen", "linear")
PREDICTOR_LABELS = {
    "constant": "Constant anchor output",
    "mean": "Cache mean (ΔM = 0)",
    "frozen": "Frozen anchor matrix",
    "linear": "Linearised softmax",
}


def _f64(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# per context
# ---------------------------------------------------------------------------------------------
def anchor_mse(pred: Any, target: Any, anchor: int) -> float:
    """``1/((Q-1) D) sum_{i != a} ||pred_i - target_i||^2`` for ``pred, target`` of shape (Q, D)."""
    p, t = _f64(pred), _f64(target)
    if p.shape != t.shape or p.ndim != 2:
        raise ValueError(f"pred and target must both be (Q, D), got {p.shape} and {t.shape}")
    Q, D = t.shape
    if Q < 2:
        raise ValueError("frozen reuse needs Q >= 2 queries (the anchor is excluded)")
    if not 0 <= anchor < Q:
        raise ValueError(f"anchor {anchor} out of range for Q={Q}")
    keep = np.arange(Q) != anchor
    return float(((p[keep] - t[keep]) ** 2).sum() / ((Q - 1) * D))


def errors_by_anchor(pred: Any, target: Any) -> np.ndarray:
    """``E_a`` for every anchor ``a = 0..Q-1`` of one context: shape ``(Q,)``.

    ``pred`` is ``(Q, D)`` for an anchor-independent predictor (cache mean, linearised softmax,
    zero) or ``(Q, Q, D)`` with ``pred[a]`` the predictions made from anchor ``a`` (frozen
    matrix, constant anchor output).
    """
    t = _f64(target)
    p = _f64(pred)
    Q, D = t.shape
    if Q < 2:
        raise ValueError("frozen reuse needs Q >= 2 queries (the anchor is excluded)")
    if p.shape == t.shape:
        sq = ((p - t) ** 2).sum(-1)  # (Q,) per-query squared error, shared by all anchors
        return (sq.sum() - sq) / ((Q - 1) * D)
    if p.shape != (Q, Q, D):
        raise ValueError(f"pred must be (Q, D) or (Q, Q, D) = {(Q, Q, D)}, got {p.shape}")
    sq = ((p - t[None]) ** 2).sum(-1)  # (A, Q)
    sq[np.arange(Q), np.arange(Q)] = 0.0  # exclude i = a
    return sq.sum(-1) / ((Q - 1) * D)


def constant_errors(target: Any) -> np.ndarray:
    """``E_a`` of the constant anchor output ``f_i = o_a``: ``1/((Q-1)D) sum_i ||o_a - o_i||^2``."""
    t = _f64(target)
    Q, D = t.shape
    if Q < 2:
        raise ValueError("frozen reuse needs Q >= 2 queries (the anchor is excluded)")
    d2 = np.stack([((t - t[a]) ** 2).sum(-1) for a in range(Q)])  # (A, Q): ||o_a - o_i||^2
    return d2.sum(-1) / ((Q - 1) * D)


def target_ms(target: Any) -> np.ndarray:
    """``E_a`` of the zero predictor (mean square of the target over ``i != a``), ``(Q,)``."""
    t = _f64(target)
    return errors_by_anchor(np.zeros_like(t), t)


# ---------------------------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------------------------
def pool(E: Any) -> dict[str, float]:
    """Pool a ``(C, A)`` array of per-context, per-anchor errors (column 0 is anchor 0).

    ``anchor0 = mean_c E[c, 0]``; ``all = mean_c mean_a E[c, a]`` (anchors averaged within each
    context first, then contexts with equal weights).
    """
    e = _f64(E)
    if e.ndim != 2 or e.shape[0] < 1 or e.shape[1] < 1:
        raise ValueError(f"pool() needs a (C, A) array, got shape {e.shape}")
    return {"anchor0": float(e[:, 0].mean()), "all": float(e.mean(axis=1).mean())}


def ratio_root(num: float, den: float) -> float | None:
    """``sqrt(num / den)``; None when the denominator is exactly zero (an undefined ratio, not
    an error).  A NaN on either side gives NaN, ``inf / finite`` gives inf (never None)."""
    num, den = float(num), float(den)
    if den == 0 and not math.isnan(num):
        return None
    if math.isnan(num) or math.isnan(den) or num < 0 or den < 0:
        return math.nan  # mean squares are >= 0: a negative one is an error, not a ratio
    if math.isinf(num) and math.isinf(den):
        return math.nan
    return math.sqrt(num / den)


def reuse_table(errors: Mapping[str, Any], target: Any) -> dict:
    """The four-predictor table from per-context, per-anchor errors.

    ``errors[name]`` is ``(C, A)`` for each predictor in :data:`PREDICTORS` (others are kept
    too); ``target`` is the ``(C, A)`` mean square of the target (:func:`target_ms`).  Returns
    ``{"predictors": {name: {"mse": {...}, "rrmse": {...}, "rrmse_vs_mean": {...}}},
    "target_rms": {...}}`` with keys ``anchor0`` and ``all`` in each inner dict; ``rrmse`` is
    against the constant anchor output, ``rrmse_vs_mean`` against the cache mean.
    """
    pooled = {k: pool(v) for k, v in errors.items()}
    if "constant" not in pooled:
        raise ValueError("the table needs the 'constant' baseline")
    out: dict = {"predictors": {}}
    for k, p in pooled.items():
        row = {"mse": p,
               "rrmse": {s: ratio_root(p[s], pooled["constant"][s]) for s in p}}
        if "mean" in pooled:
            row["rrmse_vs_mean"] = {s: ratio_root(p[s], pooled["mean"][s]) for s in p}
        out["predictors"][k] = row
    tp = pool(target)
    out["target_rms"] = {s: math.sqrt(tp[s]) for s in tp}
    return out


def heads_beating_constant(per_head: Sequence[Mapping[str, Any]], predictor: str = "frozen",
                           which: str = "all") -> dict:
    """The paper's per-head statistic: the heads whose ``which``-anchor rRMSE of ``predictor``
    against their OWN constant-anchor baseline is below 1, and the range of those rRMSEs.

    ``per_head`` holds ``{"head": h, **reuse_table(...)}`` rows.  A non-finite rRMSE is never
    counted below 1 (and is listed under ``nonfinite``); nor is an undefined one (``None``: the
    head's constant baseline is exactly 0, :func:`ratio_root`), listed under ``undefined``."""
    raw = [(int(r["head"]), r["predictors"][predictor]["rrmse"][which]) for r in per_head]
    undefined = [h for h, v in raw if v is None]
    vals = [(h, float(v)) for h, v in raw if v is not None]
    below = [(h, v) for h, v in vals if math.isfinite(v) and v < 1.0]
    return {"predictor": predictor, "anchors": which,
            "rule": f"{which}-anchor rRMSE of the {predictor} predictor against the head's own "
                    "constant-anchor output < 1",
            "heads": [h for h, _ in below], "count": len(below), "of": len(raw),
            "range": [min(v for _, v in below), max(v for _, v in below)] if below else None,
            "nonfinite": [h for h, v in vals if not math.isfinite(v)], "undefined": undefined}


# ---------------------------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------------------------
def relative_error(error: Any, y: Any, mu: Any) -> np.ndarray:
    """``||e_i|| / ||y_i - mu_i||`` row-wise over the last axis: inf where ``y_i = mu_i`` and
    ``e_i != 0``, 0 where both vanish, NaN where the error is NaN or the denominator is not
    finite (a NaN or inf in ``y`` or ``mu``) -- never a number that hides a non-finite input."""
    e, yy, m = _f64(error), _f64(y), _f64(mu)
    num = np.linalg.norm(e, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        den = np.linalg.norm(yy - m, axis=-1)
        q = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
    return np.where(np.isnan(num) | ~np.isfinite(den), np.nan, q)


def score_distance(s: Any, anchor: int = 0) -> np.ndarray:
    """``max_j |s_ij - s_aj|`` over the last (key) axis; ``s`` is ``(..., Q, N)``.

    The sup norm bounds the change of every attention log-weight: ``|log p_ij - log p_aj| <=
    2 ||s_i - s_a||_inf``.
    """
    x = _f64(s)
    return np.abs(x - x[..., anchor:anchor + 1, :]).max(-1)


def softmax(s: Any) -> np.ndarray:
    x = _f64(s)
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def tv_distance(p: Any, anchor: int = 0) -> np.ndarray:
    """Total variation ``(1/2) sum_j |p_ij - p_aj|`` of attention rows ``p (..., Q, N)``."""
    x = _f64(p)
    return 0.5 * np.abs(x - x[..., anchor:anchor + 1, :]).sum(-1)


def input_distance(u: Any, anchor: int = 0) -> np.ndarray:
    """``||u_i - u_a||_2`` of layer inputs ``u (Q, m)`` (the augmented 1 cancels)."""
    x = _f64(u)
    return np.linalg.norm(x - x[anchor:anchor + 1], axis=-1)


def best_gain(residual: Any, direction: Any) -> tuple[float, float, float]:
    """Best scalar gain ``gamma`` in ``y ~ mu + gamma g``: least squares over all rows.

    ``residual = y - mu`` and ``direction = g = u^T dM_0`` (same shapes, rows over the last
    axis).  ``gamma = sum <r, g> / sum ||g||^2``.  Returns ``(gamma, mse_at_1, mse_at_gamma)``
    with the mean square of ``r - g`` and ``r - gamma g`` over all entries.
    """
    r, g = _f64(residual), _f64(direction)
    if r.shape != g.shape:
        raise ValueError(f"residual and direction shapes differ: {r.shape} vs {g.shape}")
    gg = float((g * g).sum())
    if math.isfinite(gg) and gg > 0:
        gamma = float((r * g).sum()) / gg
    else:  # no direction: gain 0; a non-finite direction: the gain is NaN, not 0
        gamma = 0.0 if gg == 0 else math.nan
    return gamma, float(((r - g) ** 2).mean()), float(((r - gamma * g) ** 2).mean())


def normwise_agreement(pred: Any, measured: Any) -> float:
    """``max |pred - measured| / max |measured|`` (absolute when ``measured`` is all zero)."""
    p, m = _f64(pred), _f64(measured)
    den = float(np.abs(m).max()) if m.size else 0.0
    num = float(np.abs(p - m).max()) if m.size else 0.0
    return num / den if den > 0 else num


def rankdata(x: Any) -> np.ndarray:
    """Average ranks (1-based), ties sharing the mean rank."""
    a = _f64(x).ravel()
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(a.size)
    ranks[order] = np.arange(1, a.size + 1, dtype=np.float64)
    vals, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return (sums / counts)[inv]


def spearman(x: Any, y: Any) -> float | None:
    """Spearman rank correlation; None with fewer than 3 pairs or no spread.

    A NaN anywhere makes the correlation NaN (it is never computed over the survivors);
    infinite values are ranked like any other (they are the largest/smallest)."""
    a, b = _f64(x).ravel(), _f64(y).ravel()
    if a.size != b.size:
        raise ValueError(f"spearman: {a.size} x values but {b.size} y values")
    if np.isnan(a).any() or np.isnan(b).any():
        return math.nan
    if a.size < 3:
        return None
    ra, rb = rankdata(a), rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else None


def binned(x: Any, y: Any, n_bins: int = 5) -> list[dict]:
    """Quantile bins of ``x``: per bin the x-range, count and median / 90th percentile of ``y``.

    Quantile edges need finite numbers: the bins are over the finite pairs only (the caller's
    :func:`summarize` and :func:`spearman` report the non-finite ones)."""
    a, b = _f64(x).ravel(), _f64(y).ravel()
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if a.size == 0:
        return []
    edges = np.quantile(a, np.linspace(0, 1, n_bins + 1))
    idx = np.clip(np.searchsorted(edges, a, side="right") - 1, 0, n_bins - 1)
    out = []
    for k in range(n_bins):
        sel = idx == k
        if not sel.any():
            continue
        out.append({"x_lo": float(edges[k]), "x_hi": float(edges[k + 1]), "n": int(sel.sum()),
                    "median": float(np.median(b[sel])), "p90": float(np.quantile(b[sel], 0.9))})
    return out


def summarize(x: Any) -> dict:
    """Median / mean / max / min of all entries of ``x``, and how many are non-finite.

    Non-finite entries are kept: a NaN makes every statistic NaN, an inf reaches the max (and
    the mean); ``nonfinite`` counts them.  No entries at all: the statistics are None."""
    a = _f64(x).ravel()
    if a.size == 0:
        return {"n": 0, "nonfinite": 0, "median": None, "mean": None, "min": None, "max": None}
    bad = int((~np.isfinite(a)).sum())
    if np.isnan(a).any():
        nan = math.nan
        return {"n": int(a.size), "nonfinite": bad, "median": nan, "mean": nan, "min": nan,
                "max": nan}
    with np.errstate(invalid="ignore"):  # inf - inf inside mean/median of +-inf entries
        return {"n": int(a.size), "nonfinite": bad, "median": float(np.median(a)),
                "mean": float(a.mean()), "min": least(a), "max": worst(a)}


def calibration(rel_err: Any, distances: Mapping[str, Any], n_bins: int = 5) -> dict:
    """Spearman correlation and quantile-binned medians of the relative error per distance."""
    out = {"relative_error": summarize(rel_err), "distances": {}}
    for name, d in distances.items():
        out["distances"][name] = {"summary": summarize(d), "spearman": spearman(d, rel_err),
                                  "bins": binned(d, rel_err, n_bins)}
    return out


def mse(a: Any, b: Any) -> float:
    """Mean square difference over all entries."""
    x, y = _f64(a), _f64(b)
    return float(((x - y) ** 2).mean())


def max_abs(a: Any, b: Any) -> float:
    x, y = _f64(a), _f64(b)
    return float(np.abs(x - y).max()) if x.size else 0.0


def allclose_report(actual: Any, expected: Any, atol: float, rtol: float) -> bool:
    """``|actual - expected| <= atol + rtol |expected|`` everywhere (numpy.allclose semantics)."""
    x, y = _f64(actual), _f64(expected)
    return bool(np.all(np.abs(x - y) <= atol + rtol * np.abs(y)))


def stack_errors(per_context: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """``[{name: (A,)}, ...]`` over contexts -> ``{name: (C, A)}``."""
    if not per_context:
        raise ValueError("no contexts")
    keys = per_context[0].keys()
    return {k: np.stack([_f64(d[k]) for d in per_context]) for k in keys}
