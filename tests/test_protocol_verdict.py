"""``protocol``'s verdict and summary helpers on small hand-built inputs.

Every expected value below is written by hand from the inputs the test builds (a few pooled
numbers of ``summarize_layer`` are recomputed with numpy from the modified frozen inputs, never
by the function under test).  Whole outputs are compared where possible: the full list of
``Failure.as_dict()`` of :func:`ropestep.protocol.verdict`, the whole dict of
:func:`~ropestep.protocol.summarize_real_checks`, exact tolerance texts, exact paths.
``summarize_layer`` is fed the frozen inputs of ``tests/data/validate_tiny_summaries.pt``
(see ``tests/test_protocol_summaries.py``) with one value changed per test.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from ropestep import contextcheck, protocol

NAN, INF = math.nan, math.inf
from test_protocol_summaries import DATA  # the frozen tiny run (one owner of the file)


def plain(x):
    """Comparable form: NaN (which is != itself) becomes the string "NaN", tuples lists."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    return x


def F(where, check, value=None, detail=""):
    return {"where": where, "check": check, "value": value, "tol": None, "detail": detail}


# ---------------------------------------------------------------------------------------------
# native_ok
# ---------------------------------------------------------------------------------------------
def t64(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_native_ok_bfloat16_is_normwise_with_an_inclusive_boundary():
    # max|native| = 8, 0.125 * 8 = 1: a max error of exactly 1 passes, anything above fails
    native = t64(8.0, -4.0, 0.5)
    assert contextcheck.native_ok(t64(9.0, -4.0, 0.5), native, "bfloat16") is True
    assert contextcheck.native_ok(t64(8.0, -3.0, 0.5), native, "bfloat16") is True
    assert contextcheck.native_ok(t64(8.0, -4.0, 0.5), native, "bfloat16") is True
    assert contextcheck.native_ok(t64(8.0, -4.0, 1.5000001), native, "bfloat16") is False
    assert contextcheck.native_ok(t64(9.0000001, -4.0, 0.5), native, "bfloat16") is False
    # a relative error of 1/9 at every entry is within the normwise bound, though it would be
    # far outside float32's atol/rtol
    assert contextcheck.native_ok(t64(8.0, -4.0, 0.5) * (10 / 9), native, "bfloat16") is True


def test_native_ok_float32_is_atol_rtol_with_an_inclusive_boundary():
    # |native| = 0: the bound is atol = 3e-5 exactly
    zero = np.zeros(1)
    assert contextcheck.native_ok(np.array([3e-5]), zero, "float32") is True
    assert contextcheck.native_ok(np.array([-3e-5]), zero, "float32") is True
    assert contextcheck.native_ok(np.array([np.nextafter(3e-5, 1.0)]), zero, "float32") is False
    # |native| = 1000: the bound is 3e-5 + 0.3, dominated by rtol
    big = np.array([1000.0, 0.0])
    assert contextcheck.native_ok(np.array([1000.3, 0.0]), big, "float32") is True
    assert contextcheck.native_ok(np.array([1000.31, 0.0]), big, "float32") is False
    assert contextcheck.native_ok(np.array([1000.0, 4e-5]), big, "float32") is False
    # float32 is elementwise, not normwise: an error of 1 next to |native| = 8 fails
    assert contextcheck.native_ok(t64(9.0, -4.0), t64(8.0, -4.0), "float32") is False
    assert contextcheck.native_ok(t64(8.0, -4.0), t64(8.0, -4.0), "float32") is True


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def test_err_is_mse_and_max_abs():
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    b = np.array([[1.0, 0.0], [4.0, 4.0]])
    # differences 0, 2, -1, 0: mse (0 + 4 + 1 + 0) / 4, max_abs 2
    assert contextcheck._err(a, b) == {"mse": 1.25, "max_abs": 2.0}
    assert contextcheck._err(b, a) == {"mse": 1.25, "max_abs": 2.0}
    assert contextcheck._err(torch.tensor([0.5, -1.5]), torch.tensor([0.0, 1.5])) == \
        {"mse": (0.25 + 9.0) / 2, "max_abs": 3.0}


def test_mean_and_r6():
    assert protocol._mean([1.0, 2.0, 6.0]) == 3.0
    assert protocol._r6(np.array([[1.23456789, -0.000123456789], [1234567.0, 2.0]])) == \
        [1.23457, -0.000123457, 1234570.0, 2.0]
    assert protocol._r6([1, None]) == [1.0, pytest.approx(NAN, nan_ok=True)]
    assert math.isnan(protocol._r6([1, None])[1])
    assert protocol._r6(["1.5", "2"]) == [1.5, 2.0]
    out = protocol._r6([INF, -INF, 3])
    assert out == [INF, -INF, 3.0]


def test_nonfinite_paths_name_every_non_finite_float():
    x = {"a": 1.0, "b": [0.0, NAN, {"c": [INF, 2.0, -INF]}],
         "d": {"e": {"f": NAN}, "g": "nan", "h": 7}, "i": [[1.0, [INF]]]}
    got = protocol._nonfinite_paths(x)
    assert plain(got) == [["b[1]", "NaN"], ["b[2].c[0]", INF], ["b[2].c[2]", -INF],
                          ["d.e.f", "NaN"], ["i[0][1][0]", INF]]
    assert plain(protocol._nonfinite_paths([1.0, [NAN]])) == [["[1][0]", "NaN"]]
    assert plain(protocol._nonfinite_paths([1.0, NAN], "top")) == [["top[1]", "NaN"]]
    assert protocol._nonfinite_paths({"a": [1.0, 2.0], "b": {"c": 3.0}}) == []
    assert protocol._nonfinite_paths(NAN, "x") == [("x", pytest.approx(NAN, nan_ok=True))]


def test_at_walks_a_path():
    row = {"a": {"b": {"c": 5}}, "d": 2}
    assert protocol._at(row, ("a", "b", "c")) == 5
    assert protocol._at(row, ("d",)) == 2
    assert protocol._at(row, ()) is row


# ---------------------------------------------------------------------------------------------
# tolerance texts and rows
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check,head,dtype,want", [
    ("identity", 0, "float32", "atol/rtol 2e-09/2e-08"),
    ("identity", 3, "bfloat16", "atol/rtol 2e-09/2e-08"),
    ("identity", "combined", "float32", "atol/rtol 3e-09/3e-08"),
    ("identity", "combined", "bfloat16", "atol/rtol 3e-09/3e-08"),
    ("relation", 1, "float32", "atol/rtol 3e-09/3e-08"),
    ("relation", "combined", "bfloat16", "atol/rtol 3e-09/3e-08"),
    ("projected_write", 2, "float32", "atol/rtol 3e-09/3e-08"),
    ("projected_write", 2, "bfloat16", "atol/rtol 3e-09/3e-08"),
    ("native", 0, "float32", "atol/rtol 3e-05/0.0003"),
    ("native", "combined", "float32", "atol/rtol 3e-05/0.0003"),
    ("native", 0, "bfloat16", "normwise 0.125 max|native|"),
    ("native", "combined", "bfloat16", "normwise 0.125 max|native|"),
    ("self_mass", 1, "float32", "atol/rtol 3e-05/0.0003"),
    ("self_mass", 1, "bfloat16", "normwise 0.125 max|native|"),
])
def test_tol_text(check, head, dtype, want):
    assert protocol._tol_text({"head": head}, check, dtype) == want


def good_row(head, **over):
    """A passing reconstruction row (per-head rows carry projected_write and self_mass)."""
    row = {"head": head,
           "prefix": {"mse": 1e-31, "max_abs": 1e-15}, "full": {"mse": 2e-31, "max_abs": 2e-15},
           "relation_max_abs": 1e-15, "mean_max_abs": 1e-16,
           "native": {"mse": 1e-13, "max_abs": 1e-6},
           "native_observed_full_forward": {"mse": 2e-13, "max_abs": 2e-6},
           "cache_vs_full_forward_max_abs": 1e-7,
           "pass_identity": True, "pass_relation": True, "pass_native": True}
    if head != "combined":
        row.update({"projected_prefix": {"mse": 1e-32, "max_abs": 1e-16},
                    "projected_full": {"mse": 3e-32, "max_abs": 3e-16},
                    "self_mass_mean": 0.003, "self_mass_vs_native_max_abs": 2e-8,
                    "pass_projected_write": True, "pass_self_mass": True})
    row.update(over)
    return row


def test_row_failures_defaults_and_row_ok():
    assert protocol.row_failures(good_row(0)) == []
    assert protocol.row_ok(good_row(0)) and protocol.row_ok(good_row("combined"))
    # native outside: the largest max_abs field (here the second one) is named, with the
    # default dtype's (float32) tolerance and an empty ``where``
    row = good_row(2, pass_native=False, native={"mse": 4e-10, "max_abs": 5e-5},
                   native_observed_full_forward={"mse": 1e-9, "max_abs": 7e-5})
    got = [f.as_dict() for f in protocol.row_failures(row)]
    assert got == [F("", "native", 7e-5,
                     "native_observed_full_forward max_abs outside atol/rtol 3e-05/0.0003")]
    assert not protocol.row_ok(row)
    got = [f.as_dict() for f in protocol.row_failures(row, "here", "bfloat16")]
    assert got == [F("here", "native", 7e-5,
                     "native_observed_full_forward max_abs outside normwise 0.125 max|native|")]
    # the relation and self-mass checks: one field each
    row = good_row(1, pass_relation=False, relation_max_abs=4e-8, pass_self_mass=False,
                   self_mass_vs_native_max_abs=0.5, pass_projected_write=False,
                   projected_prefix={"mse": 1e-17, "max_abs": 6e-9},
                   projected_full={"mse": 1e-18, "max_abs": 5e-9})
    got = [f.as_dict() for f in protocol.row_failures(row, "w")]
    assert got == [F("w", "relation", 4e-8, "relation_max_abs outside atol/rtol 3e-09/3e-08"),
                   F("w", "projected_write", 6e-9,
                     "projected_prefix max_abs outside atol/rtol 3e-09/3e-08"),
                   F("w", "self_mass", 0.5,
                     "self_mass_vs_native_max_abs outside atol/rtol 3e-05/0.0003")]


def test_row_failures_non_finite_fields_and_scalars():
    row = good_row(0, prefix={"mse": 1e-31, "max_abs": INF}, full={"mse": NAN, "max_abs": NAN},
                   pass_identity=True, mean_max_abs=NAN, cache_vs_full_forward_max_abs=-INF)
    got = plain([f.as_dict() for f in protocol.row_failures(row, "w")])
    assert got == [F("w", "identity", INF, "non-finite prefix max_abs"),
                   F("w", "mean_max_abs", "NaN", "non-finite"),
                   F("w", "cache_vs_full_forward_max_abs", -INF, "non-finite")]
    # a row without a check's flag is not held to it (no fields needed)
    row = good_row("combined", pass_native=False, native={"mse": 4.5, "max_abs": 3.0})
    del row["native_observed_full_forward"], row["pass_relation"], row["relation_max_abs"]
    del row["pass_native"]
    assert protocol.row_failures(row) == []


# ---------------------------------------------------------------------------------------------
# summarize_real_checks
# ---------------------------------------------------------------------------------------------
def test_summarize_real_checks_whole_dict():
    per_ctx = [
        {"context": 0,
         "conventions": {"ok": True, "q_rel_max": 1e-3, "k_rel_max": 2e-3, "v_rel_max": 0.5},
         "positive_coefficients": {"ok": True, "min_c": 0.2},
         "rank": None,
         "no_global_readout": {"ok": False, "lower_certified_min": 0.3},
         "not_defined": {"position_derivative": "reason A"}},
        {"context": 1,
         "conventions": {"ok": True, "q_rel_max": 5e-3, "k_rel_max": 1e-3, "v_rel_max": 0.1},
         "positive_coefficients": {"ok": 1, "min_c": 0.1},
         "no_global_readout": {"ok": True, "lower_certified_min": 0.7},
         "exact_rows": {"ok": True, "y_rel_max": 1e-12, "delta_m_rel_max": 2e-12,
                        "c_rel_max": NAN, "readout_rel_max": 1e-13},
         "not_defined": {"exact_rows": "reason B"}},
        {"context": 2, "not_defined": None},
    ]
    got = protocol.summarize_real_checks(per_ctx)
    want = {"per_context": per_ctx,
            "not_defined": {"position_derivative": "reason A", "exact_rows": "reason B"},
            "conventions": {"contexts": 2, "ok": True, "q_rel_max": 5e-3, "k_rel_max": 2e-3,
                            "v_rel_max": 0.5},
            "positive_coefficients": {"contexts": 2, "ok": True, "min_c": 0.1},
            "no_global_readout": {"contexts": 2, "ok": False, "lower_certified_min": 0.3},
            "exact_rows": {"contexts": 1, "ok": True, "y_rel_max": 1e-12,
                           "delta_m_rel_max": 2e-12, "c_rel_max": NAN,
                           "readout_rel_max": 1e-13}}
    assert plain(got) == plain(want)
    assert list(got) == list(want)
    assert got["per_context"] is per_ctx
    # nothing not-defined: no such key
    assert protocol.summarize_real_checks([{"context": 0}]) == {"per_context": [{"context": 0}]}


def test_summarize_real_checks_least_for_min_and_lower_fields(monkeypatch):
    """Fields named min*, lower* or *_min pool to the least value, the rest to the worst."""
    monkeypatch.setattr(protocol, "REAL_CHECKS", {
        "a": ("lower_bound",), "b": ("gap_min",), "c": ("min_x",), "d": ("x_max",),
        "e": ("lowermost_min",)})
    recs = [{n: {"ok": True, f: v} for n, f in
             (("a", "lower_bound"), ("b", "gap_min"), ("c", "min_x"), ("d", "x_max"),
              ("e", "lowermost_min"))} for v in (0.7, 0.3, 0.5)]
    got = protocol.summarize_real_checks(recs)
    assert got == {"per_context": recs,
                   "a": {"contexts": 3, "ok": True, "lower_bound": 0.3},
                   "b": {"contexts": 3, "ok": True, "gap_min": 0.3},
                   "c": {"contexts": 3, "ok": True, "min_x": 0.3},
                   "d": {"contexts": 3, "ok": True, "x_max": 0.7},
                   "e": {"contexts": 3, "ok": True, "lowermost_min": 0.3}}


# ---------------------------------------------------------------------------------------------
# verdict
# ---------------------------------------------------------------------------------------------
def failing_layer() -> dict:
    """A layer with one failure of every kind (and non-finite pooled numbers that the safety net
    must NOT report, since finer checks already failed)."""
    row_a = good_row(1, context=0, pass_identity=False, pass_native=False,
                     prefix={"mse": 1e-20, "max_abs": 4e-9}, full={"mse": 2e-20, "max_abs": 5e-9},
                     native={"mse": 4.5, "max_abs": 3.0},
                     native_observed_full_forward={"mse": 0.5, "max_abs": 1.0})
    row_b = good_row("combined", context=1, pass_identity=False, pass_relation=False,
                     prefix={"mse": 1e-20, "max_abs": 7e-9}, full={"mse": 2e-20, "max_abs": 6e-9},
                     relation_max_abs=8e-8, mean_max_abs=NAN, cache_vs_full_forward_max_abs=INF)
    row_c = good_row(2, context=0, prefix={"mse": 1e-31, "max_abs": NAN},
                     full={"mse": INF, "max_abs": 1e-15})
    ok_row = good_row(0, context=1)
    return {
        "reconstruction": {"rows": [row_a, ok_row, row_b, row_c],
                           "per_head": [{"head": 0, "prefix": {"mse": NAN}}]},
        "calibration": {"checks": {
            "tokenwise_max_rel": NAN,
            "per_context": [
                {"context": 0, "heads": [0, 1, 2], "tokenwise_rel": [1e-16, NAN, 2e-16],
                 "bound_violations": [0, 0, 3],
                 "frozen_crosscheck_max_abs": 1e-15, "frozen_crosscheck_pass": True,
                 "refresh_identity_max_abs": 5e-8, "refresh_identity_pass": False},
                {"context": 1, "heads": [0, 1, 2], "tokenwise_rel": [1e-16, INF, 2e-16],
                 "bound_violations": [1, 0, 0],
                 "frozen_crosscheck_max_abs": INF, "frozen_crosscheck_pass": True,
                 "refresh_identity_max_abs": 1e-15, "refresh_identity_pass": True},
                {"context": 2, "heads": [0, 1, 2], "tokenwise_rel": [0.0, 0.0, 0.0],
                 "bound_violations": [0, 0, 0],
                 "frozen_crosscheck_max_abs": 2e-15, "frozen_crosscheck_pass": False,
                 "refresh_identity_max_abs": NAN, "refresh_identity_pass": False},
            ]}},
        "fast": {
            "float32/original": {
                "heads": [{"head": 0, "nonfinite_contexts": [], "vs_native": {"mse": NAN}},
                          {"head": 2, "nonfinite_contexts": [1, 2]}],
                "combined": {"nonfinite_contexts": [0]}},
            "bfloat16/maxkey": {"error": "no bfloat16 on this device"},
            "bfloat16/original": {"heads": [{"head": 1}], "combined": {}},
        },
        "real_heads": {"per_context": [
            {"context": 0,
             "conventions": {"ok": False, "q_rel_max": 0.5, "k_rel_max": NAN, "v_rel_max": INF,
                             "tolerance_from": "float32 eps"},
             "positive_coefficients": {"ok": False, "min_c": -0.25},
             "rank": {"ok": True, "rank_max": 99},
             "no_global_readout": None},
            {"context": 1,
             "position_shift": {"ok": False, "ratio_max": 2.5, "tolerance_from": "eval bound"},
             "exact_rows": {"ok": False, "y_rel_max": None, "delta_m_rel_max": "n/a",
                            "tolerance_from": "oracle"}},
        ]},
        "reuse": {"combined": {"rrmse": INF}},
        "descent": {"lam_max": NAN},
    }


def net_layer() -> dict:
    """A layer whose only problems are non-finite pooled numbers (the safety net's)."""
    return {
        "reconstruction": {"rows": [good_row(0, context=0), good_row("combined", context=0)],
                           "per_head": [{"head": 0, "full": {"mse": 1.0, "max_abs": INF}}],
                           "combined": {"prefix": {"mse": NAN, "max_abs": 0.0}}},
        "calibration": {"checks": {"tokenwise_max_rel": NAN, "bound_violations": None}},
        "fast": {"float32/original": {
            "heads": [{"head": 0, "nonfinite_contexts": [], "vs_native": {"mse": 1.0,
                                                                          "max_abs": -INF}}],
            "combined": {"nonfinite_contexts": []}, "kappa": {"median": 1.0, "max": NAN}}},
        "reuse": {"combined": {"predictors": {"frozen": {"rrmse": {"anchor0": 0.5, "all": INF}}}},
                  "per_context": {"mean": {"anchor0": [0.1, NAN], "all": [0.2, 0.3]}}},
        "descent": {"lam_max": NAN},  # not a section the verdict reads
        "contexts": 1,
    }


def clean_layer() -> dict:
    lr = net_layer()
    lr["reconstruction"] = {"rows": [good_row(0, context=0)]}
    lr["calibration"]["checks"] = {"per_context": [
        {"context": 0, "heads": [0], "tokenwise_rel": [1e-16], "bound_violations": [0],
         "frozen_crosscheck_max_abs": 1e-15, "frozen_crosscheck_pass": True,
         "refresh_identity_max_abs": 1e-15, "refresh_identity_pass": True}]}
    lr["fast"] = {"float32/original": {"heads": [{"head": 0, "nonfinite_contexts": []}],
                                       "combined": {"nonfinite_contexts": []}}}
    lr["reuse"] = {"combined": {"x": 1.0}}
    lr["real_heads"] = {"per_context": [{"context": 0, "rank": {"ok": True, "rank_max": 3}}]}
    return lr


LAYER3_FAILURES = [
    F("layer 3 context 0 head 1", "identity", 5e-9, "full max_abs outside atol/rtol 2e-09/2e-08"),
    F("layer 3 context 0 head 1", "native", 3.0,
      "native max_abs outside normwise 0.125 max|native|"),
    F("layer 3 context 1 head combined", "identity", 7e-9,
      "prefix max_abs outside atol/rtol 3e-09/3e-08"),
    F("layer 3 context 1 head combined", "relation", 8e-8,
      "relation_max_abs outside atol/rtol 3e-09/3e-08"),
    F("layer 3 context 1 head combined", "mean_max_abs", NAN, "non-finite"),
    F("layer 3 context 1 head combined", "cache_vs_full_forward_max_abs", INF, "non-finite"),
    F("layer 3 context 0 head 2", "identity", NAN, "non-finite prefix max_abs"),
    F("layer 3 context 0 head 1", "tokenwise", NAN, "non-finite"),
    F("layer 3 context 0 head 2", "reuse_bound", 3,
      "queries with ||e_i|| > ||u_i|| ||dM_i - dM_0||_op"),
    F("layer 3 context 0", "refresh_identity", 5e-8, "max_abs outside atol/rtol 2e-09/2e-08"),
    F("layer 3 context 1 head 0", "reuse_bound", 1,
      "queries with ||e_i|| > ||u_i|| ||dM_i - dM_0||_op"),
    F("layer 3 context 1 head 1", "tokenwise", INF, "non-finite"),
    F("layer 3 context 1", "frozen_crosscheck", INF, "non-finite"),
    F("layer 3 context 2", "frozen_crosscheck", 2e-15, "max_abs outside atol/rtol 2e-09/2e-08"),
    F("layer 3 context 2", "refresh_identity", NAN, "non-finite"),
    F("layer 3 context 1 head 2", "fast float32/original", None, "non-finite error"),
    F("layer 3 context 2 head 2", "fast float32/original", None, "non-finite error"),
    F("layer 3 context 0 head combined", "fast float32/original", None, "non-finite error"),
    F("layer 3 context 0", "conventions", NAN,
      "q_rel_max=0.5 k_rel_max=nan v_rel_max=inf; tolerance from float32 eps"),
    F("layer 3 context 0", "positive_coefficients", -0.25, "min_c=-0.25; tolerance from ?"),
    F("layer 3 context 1", "position_shift", 2.5, "ratio_max=2.5; tolerance from eval bound"),
    F("layer 3 context 1", "exact_rows", NAN,
      "y_rel_max=None delta_m_rel_max=n/a c_rel_max=None readout_rel_max=None; "
      "tolerance from oracle"),
]

NET_FAILURES = [
    F("layer 7", "reconstruction.per_head[0].full.max_abs", INF, "non-finite"),
    F("layer 7", "reconstruction.combined.prefix.mse", NAN, "non-finite"),
    F("layer 7", "fast.float32/original.heads[0].vs_native.max_abs", -INF, "non-finite"),
    F("layer 7", "fast.float32/original.kappa.max", NAN, "non-finite"),
    F("layer 7", "calibration.checks.tokenwise_max_rel", NAN, "non-finite"),
    F("layer 7", "reuse.combined.predictors.frozen.rrmse.all", INF, "non-finite"),
    F("layer 7", "reuse.per_context.mean.anchor0[1]", NAN, "non-finite"),
]


def test_verdict_every_failure_kind_two_layers():
    result = {"model": {"dtype": "bfloat16", "name": "x"},
              "layers": {"3": failing_layer(), "7": net_layer(), "9": clean_layer()}}
    got = [f.as_dict() for f in protocol.verdict(result)]
    assert plain(got) == plain(LAYER3_FAILURES + NET_FAILURES)
    block = protocol.verdict_block(result)
    assert plain(block) == plain({"pass": False, "failed_checks": 29,
                                  "failures": LAYER3_FAILURES + NET_FAILURES})
    assert list(block) == ["pass", "failed_checks", "failures"]


def test_verdict_block_of_a_passing_result():
    result = {"model": {"dtype": "float32"}, "layers": {"0": clean_layer(), "1": clean_layer()}}
    assert protocol.verdict(result) == []
    assert protocol.verdict_block(result) == {"pass": True, "failed_checks": 0, "failures": []}


def native_layer() -> dict:
    lr = clean_layer()
    lr["reconstruction"]["rows"].append(
        good_row(1, context=4, pass_native=False, native={"mse": 1e-9, "max_abs": 8e-5}))
    return lr


@pytest.mark.parametrize("model", ["absent", None, {}, {"name": "m"}, {"dtype": "float32"}])
def test_verdict_model_dtype_defaults_to_float32(model):
    result = {"layers": {"5": native_layer()}}
    if model != "absent":
        result["model"] = model
    got = [f.as_dict() for f in protocol.verdict(result)]
    assert got == [F("layer 5 context 4 head 1", "native", 8e-5,
                     "native max_abs outside atol/rtol 3e-05/0.0003")]


def test_verdict_bfloat16_model_uses_the_normwise_text():
    result = {"model": {"dtype": "bfloat16"}, "layers": {"5": native_layer()}}
    got = [f.as_dict() for f in protocol.verdict(result)]
    assert got == [F("layer 5 context 4 head 1", "native", 8e-5,
                     "native max_abs outside normwise 0.125 max|native|")]


def test_verdict_safety_net_only_when_the_layer_has_no_other_failure():
    # the same non-finite pooled number: reported in a layer with no finer failure, not in one
    # that has a row failure
    lr = net_layer()
    lr["reconstruction"]["rows"][0]["pass_relation"] = False
    lr["reconstruction"]["rows"][0]["relation_max_abs"] = 1e-7
    got = [f.as_dict() for f in protocol.verdict({"layers": {"2": lr, "7": net_layer()}})]
    assert plain(got) == plain(
        [F("layer 2 context 0 head 0", "relation", 1e-7,
           "relation_max_abs outside atol/rtol 3e-09/3e-08")] + NET_FAILURES)


# ---------------------------------------------------------------------------------------------
# is_paper_setup
# ---------------------------------------------------------------------------------------------
def paper_cfg(**over) -> protocol.Config:
    p = protocol.PAPER
    kw = dict(model=p["model"], revision=p["revision"], corpus=p["corpus"],
              corpus_revision=p["corpus_revision"], contexts=16, queries=32, prefix_len=512,
              seed=1, dtype="float32", heads="all")
    kw.update(over)
    return protocol.Config(**kw)


def test_is_paper_setup():
    assert protocol.is_paper_setup(paper_cfg(), [23]) is True
    assert protocol.is_paper_setup(paper_cfg(heads=",".join(map(str, range(14)))), [23]) is True
    assert protocol.is_paper_setup(paper_cfg(heads="0,1"), [23]) is False
    assert protocol.is_paper_setup(paper_cfg(heads="0,1"), [23], list(range(14))) is True
    assert protocol.is_paper_setup(paper_cfg(), [23], [0, 1]) is False
    assert protocol.is_paper_setup(paper_cfg(gguf="m.gguf"), [23]) is False
    assert protocol.is_paper_setup(paper_cfg(dtype="bfloat16"), [23]) is False
    # the head selection is parsed against the paper's 14 heads, with the usual messages
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.is_paper_setup(paper_cfg(heads="3,14"), [23])
    assert str(e.value) == "head 14 out of range: the model has 14 heads (valid: 0..13)"
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.is_paper_setup(paper_cfg(heads="x"), [23])
    assert str(e.value) == "--heads must be 'all', 'last' or comma-separated integers, got 'x'"


# ---------------------------------------------------------------------------------------------
# summarize_layer on the frozen inputs, one value changed per test
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def frozen_layer():
    data = torch.load(DATA, weights_only=False)
    ctxs, heads, n_heads = data["per_layer"][0]
    return ctxs, list(heads), n_heads


@pytest.fixture
def layer(frozen_layer):
    ctxs, heads, n_heads = frozen_layer
    return copy.deepcopy(ctxs), heads, n_heads


FAST_KEYS = ["float32/original", "float32/maxkey", "bfloat16/original", "bfloat16/maxkey"]
LABEL = "input space (the paper's: u = [x; 1], H = sum_j c_j a_j a_j^T)"


def test_summarize_layer_row_counts(layer):
    ctxs, heads, n_heads = layer
    assert heads == [0, 1, 2, 3] and n_heads == 4 and len(ctxs) == 2
    assert [r["head"] for r in ctxs[0].rows] == [0, 1, 2, 3, "combined"]
    ctxs[0].rows[1]["pass_identity"] = False
    ctxs[1].rows[4]["pass_native"] = False
    ctxs[1].rows[2]["pass_relation"] = False
    rec = protocol.summarize_layer(ctxs, heads, n_heads)["reconstruction"]
    assert (rec["rows_total"], rec["rows_passed"], rec["rows_passed_identity"],
            rec["rows_passed_native"]) == (10, 7, 9, 9)
    assert [p["pass"] for p in rec["per_head"]] == [2, 1, 1, 2]
    assert [p["rows"] for p in rec["per_head"]] == [2, 2, 2, 2]
    assert (rec["combined"]["pass"], rec["combined"]["rows"]) == (1, 2)
    # a head outside the selection is not a row
    rec = protocol.summarize_layer(ctxs, [0, 2], n_heads)["reconstruction"]
    assert (rec["rows_total"], rec["rows_passed"], rec["rows_passed_identity"],
            rec["rows_passed_native"]) == (6, 4, 6, 5)


def test_summarize_layer_fast_error_entries(layer):
    ctxs, heads, n_heads = layer
    ctxs[1].fast_rows["float32/original"] = {"error": "float32: out of memory"}
    ctxs[0].fast_rows["bfloat16/maxkey"] = {"error": "first"}
    ctxs[1].fast_rows["bfloat16/maxkey"] = {"error": "second"}
    ctxs[0].fast_rows["float32/maxkey"]["error"] = ""  # an empty error is no error
    fast = protocol.summarize_layer(ctxs, heads, n_heads)["fast"]
    assert list(fast) == FAST_KEYS
    assert fast["float32/original"] == {"error": "float32: out of memory"}
    assert fast["bfloat16/maxkey"] == {"error": "first"}
    for key in ("float32/maxkey", "bfloat16/original"):
        assert list(fast[key]) == ["heads", "combined", "kappa"]
        assert [h["head"] for h in fast[key]["heads"]] == heads


def test_summarize_layer_fast_keys_follow_the_first_context(layer):
    ctxs, heads, n_heads = layer
    ctxs[1].fast_rows = {k: ctxs[1].fast_rows[k] for k in reversed(FAST_KEYS)}
    ctxs[1].fast_rows["float64/extra"] = {"error": "only in context 1"}
    fast = protocol.summarize_layer(ctxs, heads, n_heads)["fast"]
    assert list(fast) == FAST_KEYS


def test_summarize_layer_one_context(layer):
    ctxs, heads, n_heads = layer
    ctxs[0].checks["bound_violations"] = [0, 2, 0, 1]
    out = protocol.summarize_layer(ctxs[:1], heads, n_heads)
    assert out["contexts"] == 1
    assert list(out["fast"]) == FAST_KEYS
    assert [p["bound_violations"] for p in out["calibration"]["per_head"]] == [0, 2, 0, 1]
    assert out["calibration"]["checks"]["bound_violations"] == 3
    assert out["descent"]["space"] == LABEL and "per_head" in out["descent"]
    assert out["reconstruction"]["rows_total"] == 5


def test_summarize_layer_bound_violations_counted(layer):
    ctxs, heads, n_heads = layer
    ctxs[0].checks["bound_violations"] = [0, 2, 0, 1]
    ctxs[1].checks["bound_violations"] = [1, 0, 0, 0]
    cal = protocol.summarize_layer(ctxs, heads, n_heads)["calibration"]
    assert [p["bound_violations"] for p in cal["per_head"]] == [1, 2, 0, 1]
    assert cal["checks"]["bound_violations"] == 4
    assert [pc["bound_violations"] for pc in cal["checks"]["per_context"]] == \
        [[0, 2, 0, 1], [1, 0, 0, 0]]
    assert [pc["heads"] for pc in cal["checks"]["per_context"]] == [[0, 1, 2, 3]] * 2
    cal = protocol.summarize_layer(ctxs, [1, 3], n_heads)["calibration"]
    assert [p["bound_violations"] for p in cal["per_head"]] == [2, 1]
    assert cal["checks"]["bound_violations"] == 4


def test_summarize_layer_bound_violations_not_measured(layer):
    ctxs, heads, n_heads = layer
    for lc in ctxs:
        lc.checks["bound_violations"] = None
    cal = protocol.summarize_layer(ctxs, heads, n_heads)["calibration"]
    assert [p["bound_violations"] for p in cal["per_head"]] == [None] * 4
    assert cal["checks"]["bound_violations"] is None
    assert [pc["bound_violations"] for pc in cal["checks"]["per_context"]] == [[0, 0, 0, 0]] * 2


def test_summarize_layer_bound_violations_follow_the_first_context(layer):
    ctxs, heads, n_heads = layer
    ctxs[0].checks["bound_violations"] = None
    ctxs[1].checks["bound_violations"] = [0, 1, 0, 0]
    cal = protocol.summarize_layer(ctxs, heads, n_heads)["calibration"]
    assert [p["bound_violations"] for p in cal["per_head"]] == [None] * 4
    assert cal["checks"]["bound_violations"] is None
    assert [pc["bound_violations"] for pc in cal["checks"]["per_context"]] == \
        [[0, 0, 0, 0], [0, 1, 0, 0]]


def test_summarize_layer_combined_input_distance_is_row_0(layer):
    ctxs, heads, n_heads = layer
    for c, lc in enumerate(ctxs):
        lc.calib["input"] = lc.calib["input"].copy()
        lc.calib["input"][1:, 1:] = 100.0 + c  # rows other than 0 differ
    want = np.concatenate([lc.calib["input"][0, 1:] for lc in ctxs])
    assert want.max() < 100
    summ = protocol.summarize_layer(ctxs, heads, n_heads)["calibration"]["combined"][
        "distances"]["input"]["summary"]
    assert summ == {"n": want.size, "nonfinite": 0, "median": float(np.median(want)),
                    "mean": float(want.mean()), "min": float(want.min()),
                    "max": float(want.max())}


def test_summarize_layer_descent_ties(layer):
    ctxs, heads, n_heads = layer
    for lc in ctxs:
        lc.descent["e1"] = lc.descent["e0"].copy()  # E(step) == E(0): no increase
        lc.descent["lam_max"] = np.full_like(lc.descent["lam_max"], 2.0)  # not > 2
    d = protocol.summarize_layer(ctxs, heads, n_heads)["descent"]
    assert d["space"] == LABEL
    assert [(p["frac_lam_gt_2"], p["frac_rows_increase"], p["increases"])
            for p in d["per_head"]] == [(0.0, 0.0, False)] * 4
    assert (d["heads_increasing"], d["fraction_heads_increasing"],
            d["fraction_rows_increasing"]) == (0, 0.0, 0.0)
    assert d["lam_max"]["median"] == 2.0 and d["lam_max"]["max"] == 2.0


def test_summarize_layer_descent_not_defined_without_input_space(layer):
    ctxs, heads, n_heads = layer
    for lc in ctxs:
        for k in ("lam_max", "e0", "e1"):
            del lc.descent[k]
    d = protocol.summarize_layer(ctxs, heads, n_heads)["descent"]
    assert list(d) == ["space", "not_defined", "query_space", "replication_style"]
    assert d["space"] == LABEL and d["not_defined"] == protocol.NOT_AFFINE
    assert d["not_defined"].startswith("the score is not affine in u")


def test_summarize_layer_descent_follows_the_first_context(layer):
    ctxs, heads, n_heads = layer
    for k in ("lam_max", "e0", "e1"):
        del ctxs[0].descent[k]
    d = protocol.summarize_layer(ctxs, heads, n_heads)["descent"]
    assert (d["space"], d["not_defined"]) == (LABEL, protocol.NOT_AFFINE)
