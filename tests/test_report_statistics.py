"""The numbers the reports print, against independent recomputations (issue 18).

The reference recomputations (``tests/test_reference_*.py``) check every leaf of ``report.json``;
these tests cover what they do not reach:

* ``report.md`` of ``validate`` and ``atlas``: every number of the frozen-reuse table, the fast-path
  table's worst head, the calibration bins and the atlas's per-layer columns (a max, a sum or a
  median over heads) is read back from the rendered Markdown and compared with the value
  recomputed here from ``report.json`` (numpy), to the precision the report prints;
* ``heads``' summaries (medians and ranges over heads, the fractions of well-conditioned matrices
  and of barycenters below 1/2, the mean coarse bands), recomputed with the ``statistics``
  module and plain Python from the per-head diagnostics;
* the pooling of the real-head claims over contexts (``protocol.summarize_real_checks``): the
  worst value of each field, by hand.

The inputs are the committed reports under ``validation/`` (real models: SmolLM2-135M and its
atlas and heads diagnostics), read as data: the renderers and the summaries are re-run on them
here, so each test checks today's code (no model is loaded; each test takes well under a second).
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from ropestep import atlas, heads, protocol, report
from ropestep import reuse_stats as rs
from ropestep.verdict import loads

REPO = Path(__file__).resolve().parents[1]
VALIDATION = REPO / "validation"
VALIDATE_REPORTS = ("smollm2", "qwen2.5-coder-0.5b")
U = 2.0 ** -53  # float64 unit roundoff


# ---------------------------------------------------------------------------------------------
# reading report.md
# ---------------------------------------------------------------------------------------------
def table(md: str, *header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first Markdown table whose header cells start
    with ``header``."""
    lines = md.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[:len(header)] == list(header):
            rows = []
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                rows.append([c.strip() for c in body.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"no table headed {header!r} in the report")


def printed(cell: str) -> float:
    """A printed number back as a float (``nan``/``inf`` included)."""
    return float(cell)


def half_unit(v: float, significant: int) -> float:
    """Half a unit in the last place of ``v`` printed with ``significant`` significant digits
    (plus the rounding of the decimal conversion itself)."""
    return 0.5 * 10.0 ** (math.floor(math.log10(abs(v))) - (significant - 1)) + 4 * U * abs(v)


def fmt_precision(v: float) -> float:
    """How far ``report.fmt(v)`` (three digits) may lie from ``v``: four significant digits in
    ``[1e-3, 1)``, three in ``[1, 1e4)`` and in scientific notation (``d.dde±xx``)."""
    if v == 0:
        return 0.0
    return half_unit(v, 4 if 1e-3 <= abs(v) < 1 else 3)


def fmt6_precision(v: float) -> float:
    """``report.fmt6``: six decimals from ``1e-4`` on (the paper's style), else ``d.ddde±xx``."""
    if v == 0:
        return 0.0
    return 0.5e-6 + 4 * U * abs(v) if abs(v) >= 1e-4 else half_unit(v, 4)


def agrees(cell: str, v: float | None, precision) -> bool:
    if v is None:
        return cell == "—"
    if not math.isfinite(v):
        return cell == ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
    return abs(printed(cell) - v) <= precision(v)


@pytest.fixture(scope="module", params=VALIDATE_REPORTS)
def validate_report(request):
    result = report.load(VALIDATION / request.param / "report.json")
    return result, report.render_markdown(result)


# ---------------------------------------------------------------------------------------------
# validate: report.md
# ---------------------------------------------------------------------------------------------
def test_validate_reuse_table_prints_the_pooled_numbers(validate_report):
    """Frozen-reuse table: pooled MSEs in the paper's six-decimal style, rRMSEs to four
    significant digits below 1 (three above), each in its own column."""
    result, md = validate_report
    (layer, lr), = result["layers"].items()
    tab = lr["reuse"]["combined"]
    rows = table(md, "Predictor (pooled MSE)")
    assert [r[0] for r in rows] == [rs.PREDICTOR_LABELS[k] for k in rs.PREDICTORS] + \
        ["Target RMS"]
    bad = []
    for k, row in zip(rs.PREDICTORS, rows):
        p = tab["predictors"][k]
        for cell, v, prec in ((row[1], p["mse"]["anchor0"], fmt6_precision),
                              (row[2], p["mse"]["all"], fmt6_precision),
                              (row[3], p["rrmse"]["anchor0"], fmt_precision),
                              (row[4], p["rrmse"]["all"], fmt_precision)):
            if not agrees(cell, v, prec):
                bad.append((k, cell, v))
    for cell, v in zip(rows[-1][1:3], (tab["target_rms"]["anchor0"], tab["target_rms"]["all"])):
        if not agrees(cell, v, fmt6_precision):
            bad.append(("target_rms", cell, v))
    # the per-head table: four pooled MSEs at anchor 0, then three rRMSEs
    per_head = table(md, "Head", "constant a0")
    assert [int(r[0]) for r in per_head] == [ph["head"] for ph in lr["reuse"]["per_head"]]
    for row, ph in zip(per_head, lr["reuse"]["per_head"]):
        p = ph["predictors"]
        want = ([(p[k]["mse"]["anchor0"], fmt6_precision)
                 for k in ("constant", "mean", "frozen", "linear")]
                + [(p["frozen"]["rrmse"]["anchor0"], fmt_precision),
                   (p["frozen"]["rrmse"]["all"], fmt_precision),
                   (p["mean"]["rrmse"]["all"], fmt_precision)])
        bad += [(ph["head"], c, v) for c, (v, prec) in zip(row[1:], want) if not agrees(c, v, prec)]
    assert not bad, bad


def test_validate_fast_table_names_the_worst_head(validate_report):
    """The fast-path table's 'worst head vs float64 max' is the largest per-head error."""
    result, md = validate_report
    (layer, lr), = result["layers"].items()
    rows = {r[0]: r for r in table(md, "dtype/gauge")}
    assert set(rows) == set(lr["fast"])
    for key, ent in lr["fast"].items():
        errs = np.array([h["vs_float64"]["max_abs"] for h in ent["heads"]], dtype=float)
        worst = float(np.max(errs))
        assert worst > float(np.min(errs))  # the heads differ: best and worst are told apart
        cb = ent["combined"]
        want = (cb["vs_float64"]["mse"], cb["vs_float64"]["max_abs"], cb["vs_native"]["mse"],
                cb["vs_native"]["max_abs"], worst)
        got = rows[key][1:6]
        assert all(agrees(c, v, fmt_precision) for c, v in zip(got, want)), (key, got, want)


def test_validate_calibration_bins_print_median_and_90th_percentile(validate_report):
    """The pooled TV bins: count, median and 90th percentile of each bin, as ``report.json``
    holds them (the reference recomputes those)."""
    result, md = validate_report
    (layer, lr), = result["layers"].items()
    bins = lr["calibration"]["pooled_heads"]["distances"]["tv"]["bins"]
    rows = table(md, "TV range")
    assert len(rows) == len(bins) >= 4
    for row, b in zip(rows, bins):
        assert int(row[1]) == b["n"]
        assert agrees(row[2], b["median"], fmt_precision), (row, b)
        assert agrees(row[3], b["p90"], fmt_precision), (row, b)
        assert b["p90"] > b["median"]  # the two columns are different statistics


# ---------------------------------------------------------------------------------------------
# atlas: report.md
# ---------------------------------------------------------------------------------------------
ATLAS_COLUMNS = (  # (column of the per-layer table, head field path, reduction over heads)
    ("identity f64 (rel)", ("identity_float64_rel_max",), "max"),
    ("f64 vs native", ("float64_vs_native_rel",), "max"),
    ("orig. gauge unresolved queries", ("original_gauge_unresolved_queries",), "sum"),
    ("dtype vs native", ("model_dtype_vs_native_rel",), "max"),
    ("bound ratio", ("model_dtype_vs_native_bound_ratio_max",), "max"),
    ("kappa maxkey (med)", ("kappa_maxkey", "median"), "median"),
    ("sink (mean)", ("sink_mass", "mean"), "median"),
    ("lambda q (med)", ("lambda_max_query_space", "median"), "median"),
    ("lambda in (med)", ("lambda_max_input_space", "median"), "median"),
    ("E up q", ("step_increases_E_query_space",), "median"),
    ("E up in", ("step_increases_E_input_space",), "median"),
    ("reuse rRMSE vs const", ("reuse", "rrmse_vs_constant_anchor"), "median"),
    ("vs mean", ("reuse", "rrmse_vs_cache_mean"), "median"),
)


def _field(h: dict, path: tuple) -> float:
    for p in path:
        h = h[p]
    return float(h)


@pytest.mark.parametrize("name", ["atlas-smollm2", "atlas-qwen2.5-coder-0.5b"])
def test_atlas_per_layer_columns_are_max_sum_or_median_over_heads(name):
    """Each column of the atlas's per-layer table, recomputed from the per-head statistics:
    the worst head (max), the count over heads (sum) or the median over heads (the middle
    value, or the mean of the two middle values: ``statistics.median``), three significant
    digits as printed."""
    result = loads((VALIDATION / name / "report.json").read_text(encoding="utf-8"))
    md = atlas.render_markdown(result)
    lines = [ln for ln in md.splitlines() if ln.startswith("| layer | pass |")]
    assert len(lines) == 1
    header = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    rows = {int(r[0]): r for r in table(md, "layer", "pass")}
    assert sorted(rows) == sorted(int(L) for L in result["layers"])
    bad = []
    for L, lr in result["layers"].items():
        row = dict(zip(header, rows[int(L)]))
        for col, path, how in ATLAS_COLUMNS:
            vals = [_field(h, path) for h in lr["heads"]]
            if how == "sum":
                if int(row[col]) != int(sum(vals)):
                    bad.append((L, col, row[col], sum(vals)))
                continue
            v = max(vals) if how == "max" else statistics.median(vals)
            if not (v == 0 and printed(row[col]) == 0) and not agrees(
                    row[col], v, lambda x: half_unit(x, 3)):
                bad.append((L, col, row[col], v))
    assert not bad, bad[:10]


# ---------------------------------------------------------------------------------------------
# heads: summaries over heads
# ---------------------------------------------------------------------------------------------
def _stats_by_hand(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _close(a: float, b: float, n: int) -> bool:
    """Equal up to the rounding of a sum of ``n`` non-negative terms and one division."""
    return abs(a - b) <= (n + 2) * U * max(abs(a), abs(b))


@pytest.fixture(scope="module")
def heads_report():
    return loads((VALIDATION / "heads-smollm2" / "report.json").read_text(encoding="utf-8"))


def summary_problems(summary: dict, layers: list[dict]) -> list:
    qh = [h for L in layers for h in L["query_heads"]]
    kh = [g for L in layers for g in L["kv_heads"]]
    want_stats = {
        "cond_w_q": [h["w_q"]["cond"] for h in qh], "cond_w_k": [g["w_k"]["cond"] for g in kh],
        "effective_rank_w_q": [h["w_q"]["effective_rank"] for h in qh],
        "effective_rank_w_k": [g["w_k"]["effective_rank"] for g in kh],
        "barycenter": [h["barycenter"] for h in qh],
        "barycenter_base": [h["barycenter_base"] for h in qh],
        "sketch_barycenter": [h["sketch_barycenter"] for h in qh],
    }
    bad = []
    for key, xs in want_stats.items():
        want, got = _stats_by_hand(xs), summary[key]
        if got["n"] != want["n"] or any(not _close(got[s], want[s], 2)
                                        for s in ("median", "min", "max")):
            bad.append((key, got, want))
    fractions = {
        "fraction_cond_w_q_below_10": sum(x < 10 for x in want_stats["cond_w_q"]) / len(qh),
        "fraction_cond_w_k_below_10": sum(x < 10 for x in want_stats["cond_w_k"]) / len(kh),
        "fraction_barycenter_below_half":
            sum(x < 0.5 for x in want_stats["barycenter"]) / len(qh),
    }
    bad += [(k, summary[k], v) for k, v in fractions.items() if summary[k] != v]
    for key, rows in (("coarse_band_fraction_w_q_mean", [h["w_q"] for h in qh]),
                      ("coarse_band_fraction_w_k_mean", [g["w_k"] for g in kh])):
        want = [math.fsum(r["coarse_band_fraction"][b] for r in rows) / len(rows)
                for b in range(heads.N_COARSE)]
        if len(summary[key]) != len(want) or any(
                not _close(g, w, len(rows)) for g, w in zip(summary[key], want)):
            bad.append((key, summary[key], want))
    return bad


def test_heads_summaries_recomputed_by_hand(heads_report):
    """``heads.summarise`` over each layer and over the whole model, on SmolLM2's per-head
    diagnostics: medians and ranges (``statistics``), the fractions ``cond < 10`` and
    ``barycenter < 1/2`` (counts over the number of matrices) and the mean coarse bands
    (``math.fsum``)."""
    layers = [heads_report["layers"][L] for L in sorted(heads_report["layers"], key=int)]
    bad = []
    for L, lr in zip(sorted(heads_report["layers"], key=int), layers):
        bad += [(L, *p) for p in summary_problems(heads.summarise([lr]), [lr])]
    bad += [("model", *p) for p in summary_problems(heads.summarise(layers), layers)]
    assert not bad, bad[:6]
    # the data can tell the statistics apart: medians differ from means, and both sides of 1/2
    # and of cond 10 are populated
    s = heads.summarise(layers)
    cond = [h["w_q"]["cond"] for L in layers for h in L["query_heads"]]
    assert abs(s["cond_w_q"]["median"] - statistics.fmean(cond)) > 1.0
    assert 0 < s["fraction_barycenter_below_half"] < 0.5 < 1 - s["fraction_barycenter_below_half"]
    assert 0 < s["fraction_cond_w_q_below_10"] < 1


# ---------------------------------------------------------------------------------------------
# validate: the real-head claims pooled over contexts
# ---------------------------------------------------------------------------------------------
def test_real_checks_pool_the_worst_value_of_each_field():
    """``summarize_real_checks``: per check, the number of contexts that ran it, whether all
    passed, and per field the worst context -- the smallest ``min_c`` and certified lower bound
    (a claim ``> 0``), the largest error, ratio and rank; a NaN in any context is the pooled
    value.  Three contexts, values by hand."""
    nan = math.nan

    def ctx(c, min_c, lower, rank, ratio, y_rel, ok=True):
        return {"context": c,
                "positive_coefficients": {"min_c": min_c, "ok": ok},
                "no_global_readout": {"lower_certified_min": lower, "ok": ok},
                "rank": {"rank_max": rank, "ok": ok},
                "position_derivative": {"ratio_max": ratio, "ok": ok},
                "exact_rows": {"y_rel_max": y_rel, "delta_m_rel_max": 2 * y_rel,
                               "c_rel_max": 3 * y_rel, "readout_rel_max": 4 * y_rel, "ok": ok}}

    per = [ctx(0, 0.25, 0.5, 3, 0.125, 1e-16), ctx(1, 0.125, 0.75, 5, 0.5, 4e-16, ok=False),
           ctx(2, 0.5, 0.25, 4, 0.25, 2e-16)]
    per[2].pop("rank")  # a check that ran in two contexts only
    got = protocol.summarize_real_checks(per)
    assert got["per_context"] is per
    assert got["positive_coefficients"] == {"contexts": 3, "ok": False, "min_c": 0.125}
    assert got["no_global_readout"] == {"contexts": 3, "ok": False, "lower_certified_min": 0.25}
    assert got["rank"] == {"contexts": 2, "ok": False, "rank_max": 5}
    assert got["position_derivative"] == {"contexts": 3, "ok": False, "ratio_max": 0.5}
    assert got["exact_rows"] == {"contexts": 3, "ok": False, "y_rel_max": 4e-16,
                                 "delta_m_rel_max": 8e-16, "c_rel_max": 12e-16,
                                 "readout_rel_max": 16e-16}
    assert "conventions" not in got  # no context ran it
    per[1]["positive_coefficients"]["min_c"] = nan
    per[0]["position_derivative"]["ratio_max"] = nan
    got = protocol.summarize_real_checks(per)
    assert math.isnan(got["positive_coefficients"]["min_c"])
    assert math.isnan(got["position_derivative"]["ratio_max"])


def test_real_checks_pooled_in_the_committed_smollm2_report():
    """The same pooling re-run on SmolLM2's per-context records (16 contexts of c_ij > 0, four
    of oracle rows): the minimum and the maxima over the contexts."""
    result = report.load(VALIDATION / "smollm2" / "report.json")
    per = result["layers"]["29"]["real_heads"]["per_context"]
    got = protocol.summarize_real_checks(per)
    pc = [r["positive_coefficients"]["min_c"] for r in per if r.get("positive_coefficients")]
    ex = [r["exact_rows"] for r in per if r.get("exact_rows")]
    assert len(pc) == 16 and len(ex) == 4 and len(set(pc)) == 16
    assert got["positive_coefficients"]["min_c"] == min(pc)
    for f in ("y_rel_max", "delta_m_rel_max", "c_rel_max", "readout_rel_max"):
        assert got["exact_rows"][f] == max(r[f] for r in ex), f
