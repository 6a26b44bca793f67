"""Pooling of the four-predictor frozen-reuse table and the calibration statistics.

Every expected number below is worked out by hand in the comments (C = 2 contexts, Q = 3
queries, D = 2), so a change to the pooling rule -- the anchor's exclusion, the (Q-1) D
normaliser, equal context weights, anchors averaged within a context, ratios after pooling --
turns a test red.

The inputs are small integers and quarters: every difference, square and sum of them, the
division by ``(Q-1) D = 4``, the ranks and their centring are exact in float64 in any order, so
those results are compared with ``==``.  The pooled numbers divide by 3 and take square roots:
they are compared within ``tolerances.nonnegative_ops_rel`` of the roundings counted beside each
(every operand is non-negative), those of the pooled number and of the hand expression together.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from ropestep import reuse_stats as rs
from ropestep import tolerances as tl

# context 0 targets o_0i and context 1 targets o_1i, rows i = 0, 1, 2
O0 = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
O1 = np.array([[1.0, 1.0], [1.0, 1.0], [3.0, 1.0]])

# roundings of a pooled number of a (C, A) = (2, 3) array: "all" sums A = 3 anchors (2), divides
# by 3, sums C = 2 contexts (1) and halves; "anchor0" needs 2 of them
POOL = 5
# a ratio of two pooled numbers (rrmse): both chains, the quotient and the square root
RATIO = 2 * POOL + 2


def hand(want, ops: int):
    """``want`` (a number or a dict of them) to ``gamma_ops`` relative, nothing absolute."""
    return pytest.approx(want, rel=tl.nonnegative_ops_rel(ops), abs=0)


def test_constant_anchor_output_by_hand():
    # D = 4.  Context 0: ||o0-o1||^2 = 1, ||o0-o2||^2 = 4, ||o1-o2||^2 = 5
    #   a=0: (1+4)/4 = 1.25   a=1: (1+5)/4 = 1.5   a=2: (4+5)/4 = 2.25
    np.testing.assert_array_equal(rs.constant_errors(O0), [1.25, 1.5, 2.25])
    # Context 1: rows 0 and 1 coincide, row 2 is 4 away (squared) from both
    #   a=0: (0+4)/4 = 1   a=1: (0+4)/4 = 1   a=2: (4+4)/4 = 2
    np.testing.assert_array_equal(rs.constant_errors(O1), [1.0, 1.0, 2.0])
    # the same through the general (A, Q, D) path: pred[a] = o_a for every query
    pred = np.broadcast_to(O0[:, None, :], (3, 3, 2))
    np.testing.assert_array_equal(rs.errors_by_anchor(pred, O0), [1.25, 1.5, 2.25])


def test_anchor_independent_predictor_excludes_the_anchor():
    # context 0, f_i = (0, 1): squared errors per query 1, 2, 1 (total 4) -> E_a = (4 - sq_a)/4
    f0 = np.tile([0.0, 1.0], (3, 1))
    np.testing.assert_array_equal(rs.errors_by_anchor(f0, O0), [0.75, 0.5, 0.75])
    for a, want in enumerate([0.75, 0.5, 0.75]):
        assert rs.anchor_mse(f0, O0, a) == want
    # context 1, f_i = (2, 1): squared errors 1, 1, 1 -> E_a = 2/4
    f1 = np.tile([2.0, 1.0], (3, 1))
    np.testing.assert_array_equal(rs.errors_by_anchor(f1, O1), [0.5, 0.5, 0.5])


def test_anchor_dependent_predictor():
    # pred[a] = o + a: every entry of every non-anchor query is off by a -> E_a = 2*2a^2/4 = a^2
    pred = np.stack([O0 + a for a in range(3)])
    np.testing.assert_array_equal(rs.errors_by_anchor(pred, O0), [0.0, 1.0, 4.0])
    # and a wrong anchor row is ignored: corrupt pred[a][a] and nothing changes
    bad = pred.copy()
    for a in range(3):
        bad[a, a] += 100.0
    np.testing.assert_array_equal(rs.errors_by_anchor(bad, O0), [0.0, 1.0, 4.0])


def test_target_rms_by_hand():
    # zero predictor: context 0 squared norms 0, 1, 4 (total 5) -> (5 - sq_a)/4 = 1.25, 1, 0.25
    #                 context 1 squared norms 2, 2, 10 (total 14) -> 3, 3, 1
    np.testing.assert_array_equal(rs.target_ms(O0), [1.25, 1.0, 0.25])
    np.testing.assert_array_equal(rs.target_ms(O1), [3.0, 3.0, 1.0])


def test_pool_and_the_table_by_hand():
    const = np.stack([rs.constant_errors(O0), rs.constant_errors(O1)])  # [[1.25,1.5,2.25],[1,1,2]]
    mean = np.stack([rs.errors_by_anchor(np.tile([0.0, 1.0], (3, 1)), O0),
                     rs.errors_by_anchor(np.tile([2.0, 1.0], (3, 1)), O1)])  # [[.75,.5,.75],[.5]*3]
    frozen = np.stack([rs.errors_by_anchor(np.stack([O0 + a for a in range(3)]), O0),
                       rs.errors_by_anchor(np.stack([O1 + 2 * a for a in range(3)]), O1)])
    # context 1 frozen: offsets 0, 2, 4 -> E_a = (2a)^2 = 0, 4, 16
    np.testing.assert_array_equal(frozen, [[0, 1, 4], [0, 4, 16]])
    linear = np.full((2, 3), 0.5)
    target = np.stack([rs.target_ms(O0), rs.target_ms(O1)])

    # anchor 0: mean over contexts of column 0;  all: per-context anchor mean, then contexts
    assert rs.pool(const) == hand({"anchor0": (1.25 + 1.0) / 2,
                                   "all": (5 / 3 + 4 / 3) / 2}, POOL + 3)
    assert rs.pool(mean) == hand({"anchor0": 0.625, "all": (2 / 3 + 0.5) / 2}, POOL + 3)
    assert rs.pool(frozen) == hand({"anchor0": 0.0, "all": (5 / 3 + 20 / 3) / 2}, POOL + 3)

    tab = rs.reuse_table({"constant": const, "mean": mean, "frozen": frozen, "linear": linear},
                         target)
    p = tab["predictors"]
    assert p["constant"]["rrmse"] == hand({"anchor0": 1.0, "all": 1.0}, RATIO)
    # ratios after pooling: sqrt(E_f / E_const), never a mean of per-context ratios
    assert p["mean"]["rrmse"]["anchor0"] == hand(math.sqrt(0.625 / 1.125), RATIO + 2)
    assert p["frozen"]["rrmse"]["all"] == hand(math.sqrt((25 / 6) / 1.5), RATIO + 3)
    assert p["frozen"]["rrmse_vs_mean"]["all"] == hand(
        math.sqrt((25 / 6) / (7 / 12)), RATIO + 4)
    assert p["linear"]["mse"] == hand({"anchor0": 0.5, "all": 0.5}, POOL)
    # target RMS: sqrt of the pooled zero-predictor error
    assert tab["target_rms"]["anchor0"] == hand(math.sqrt((1.25 + 3.0) / 2), POOL + 1 + 3)
    assert tab["target_rms"]["all"] == hand(math.sqrt((2.5 / 3 + 7 / 3) / 2), POOL + 1 + 5)


def test_ratio_after_pooling_differs_from_mean_of_ratios():
    # two contexts with unequal baselines tell the rules apart
    f = np.array([[1.0, 1.0], [9.0, 9.0]])
    c = np.array([[1.0, 1.0], [1.0, 1.0]])
    tab = rs.reuse_table({"constant": c, "frozen": f}, c)
    assert tab["predictors"]["frozen"]["rrmse"]["anchor0"] == hand(math.sqrt(5.0), RATIO + 1)
    assert tab["predictors"]["frozen"]["rrmse"]["anchor0"] != hand((1 + 3) / 2, RATIO + 1)


def test_all_anchor_order_nested_means():
    # anchors are averaged inside each context first, then contexts with equal weights;
    # check against explicit nested loops on an irregular array
    rng = np.random.default_rng(3)
    E = rng.random((4, 5))
    nested = sum(sum(E[c, a] for a in range(5)) / 5 for c in range(4)) / 4
    # two orders of the same non-negative sums: 4 + 1 + 3 + 1 roundings on each side for "all",
    # 3 + 1 for "anchor0"
    assert rs.pool(E)["all"] == hand(nested, 2 * 9)
    assert rs.pool(E)["anchor0"] == hand(E[:, 0].mean(), 2 * 4)


def test_best_gain_by_hand():
    # r = y - mu, g = u^T dM_0:  gamma = sum<r,g>/sum||g||^2 = (2 + 4)/(4 + 4) = 0.75
    r = np.array([[1.0, 0.0], [0.0, 2.0]])
    g = np.array([[2.0, 0.0], [0.0, 2.0]])
    gamma, at1, atg = rs.best_gain(r, g)
    assert gamma == 0.75
    assert at1 == 1.0 / 4  # (1-2)^2 over 4 entries
    assert atg == (0.25 + 0.25) / 4  # r - 0.75 g = [[-.5, 0], [0, .5]]
    assert rs.best_gain(r, np.zeros_like(g))[0] == 0.0
    # the gain minimises: perturbing it never helps
    for d in (-1e-3, 1e-3):
        assert ((r - (gamma + d) * g) ** 2).mean() > atg


def test_distances_by_hand():
    s = np.array([[0.0, 1.0, 2.0], [0.5, 1.0, -1.0]])  # two queries over three keys
    np.testing.assert_array_equal(rs.score_distance(s), [0.0, 3.0])  # max |(.5, 0, -3)|
    p = np.array([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    np.testing.assert_array_equal(rs.tv_distance(p), [0.0, 0.5])  # (.25 + .25 + .5)/2
    u = np.array([[0.0, 0.0], [3.0, 4.0]])
    np.testing.assert_array_equal(rs.input_distance(u), [0.0, 5.0])  # sqrt(25) is exact
    e = np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
    y = np.array([[0.0, 10.0], [1.0, 1.0], [1.0, 1.0]])
    mu = np.array([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    rel = rs.relative_error(e, y, mu)
    assert rel[0] == 0.5 and rel[1] == 0.0 and rel[2] == np.inf  # 5 / 10
    sm = rs.softmax(np.array([[0.0, math.log(3.0)]]))
    # e^{-log 3} = 1/3 through the rounded log 3 (exp_of_sum_rel, one term), then z + 1 and the
    # quotient, whose sensitivity to z's relative error is below 1 (non-negative: 2 roundings)
    np.testing.assert_allclose(sm, [[0.25, 0.75]], atol=0, rtol=tl.exp_of_sum_rel(
        math.log(3.0), 1) + tl.nonnegative_ops_rel(2))


def test_spearman_and_bins():
    x = np.arange(10.0)
    # ranks 1..10 centred at 5.5: every product and sum exact, and sqrt(82.5^2) = 82.5
    assert rs.spearman(x, x ** 3) == 1.0
    assert rs.spearman(x, -x) == -1.0
    assert rs.spearman([1, 2], [2, 1]) is None
    np.testing.assert_array_equal(rs.rankdata([10, 20, 20, 5]), [2, 3.5, 3.5, 1])
    b = rs.binned(x, 2 * x, n_bins=2)
    assert [bb["n"] for bb in b] == [5, 5]
    assert b[0]["median"] == 4.0 and b[1]["median"] == 14.0
    cal = rs.calibration(2 * x, {"d": x})
    assert cal["distances"]["d"]["spearman"] == 1.0
    assert cal["relative_error"]["max"] == 18.0


def test_normwise_agreement_and_errors():
    m = np.array([1.0, -2.0, 4.0])
    # m + 2^-40 is exact (|m| <= 4 needs 42 bits), so are the difference, max and / 4
    assert rs.normwise_agreement(m + 2.0 ** -40, m) == 2.0 ** -42
    # the largest difference, not a typical one: one entry off by 2^-40, the others exact
    assert rs.normwise_agreement(m + np.array([2.0 ** -40, 0.0, 0.0]), m) == 2.0 ** -42
    assert rs.normwise_agreement(np.zeros(2), np.zeros(2)) == 0.0
    assert rs.mse([1.0, 3.0], [0.0, 0.0]) == 5.0
    assert rs.max_abs([1.0, -3.0], [0.0, 0.0]) == 3.0
    assert rs.allclose_report([1.0], [1.0 + 1e-9], 2e-9, 0.0)
    assert not rs.allclose_report([1.0], [1.0 + 1e-8], 2e-9, 0.0)


def test_shape_errors():
    with pytest.raises(ValueError):
        rs.errors_by_anchor(np.zeros((2, 3, 2)), np.zeros((3, 2)))
    with pytest.raises(ValueError):
        rs.constant_errors(np.zeros((1, 2)))
    with pytest.raises(ValueError):
        rs.anchor_mse(np.zeros((3, 2)), np.zeros((3, 2)), 3)
    with pytest.raises(ValueError):
        rs.reuse_table({"frozen": np.ones((1, 1))}, np.ones((1, 1)))


def test_nonfinite_values_propagate():
    """A NaN or inf error reaches every pooled number: never None, 0 or dropped."""
    nan, inf = math.nan, math.inf
    assert math.isnan(rs.ratio_root(nan, 1.0)) and math.isnan(rs.ratio_root(1.0, nan))
    assert rs.ratio_root(inf, 1.0) == inf and rs.ratio_root(1.0, 0.0) is None  # undefined ratio
    assert math.isnan(rs.ratio_root(inf, inf)) and rs.ratio_root(4.0, 1.0) == 2.0
    s = rs.summarize([1.0, nan, 3.0])
    assert s["n"] == 3 and s["nonfinite"] == 1 and math.isnan(s["max"]) and math.isnan(s["median"])
    s = rs.summarize([1.0, inf])
    assert s["max"] == inf and s["min"] == 1.0 and s["nonfinite"] == 1
    assert rs.summarize([1.0, 2.0])["nonfinite"] == 0
    assert math.isnan(rs.spearman([1.0, 2.0, nan, 4.0], [1.0, 2.0, 3.0, 4.0]))
    assert rs.spearman([1.0, 2.0, inf], [1.0, 2.0, 3.0]) == 1.0  # ranked
    gamma, _, _ = rs.best_gain(np.ones((2, 2)), np.array([[1.0, nan], [0.0, 1.0]]))
    assert math.isnan(gamma)
    tab = rs.reuse_table({"constant": np.array([[1.0, 1.0]]), "frozen": np.array([[nan, 1.0]])},
                         np.ones((1, 2)))
    fz = tab["predictors"]["frozen"]
    assert math.isnan(fz["mse"]["anchor0"]) and math.isnan(fz["rrmse"]["anchor0"])
    assert math.isnan(fz["mse"]["all"])  # the anchor average keeps it too
    assert math.isnan(rs.max_abs([1.0, nan], [0.0, 0.0])) and math.isnan(rs.mse([nan], [0.0]))
    assert not rs.allclose_report([nan], [nan], 1.0, 1.0)


def test_heads_beating_constant_counts_only_defined_ratios_below_one():
    """Head 0 beats its baseline, head 1 does not, head 2's ratio is NaN and head 3's constant
    baseline is exactly 0 (rRMSE undefined: None).  Only head 0 counts; the others are named."""
    def row(h, frozen, const):
        return {"head": h, **rs.reuse_table({"constant": np.array([[const]]),
                                             "frozen": np.array([[frozen]])}, np.array([[1.0]]))}
    per_head = [row(0, 0.25, 1.0), row(1, 4.0, 1.0), row(2, math.nan, 1.0), row(3, 1.0, 0.0)]
    got = rs.heads_beating_constant(per_head, which="anchor0")
    assert got["heads"] == [0] and got["count"] == 1 and got["of"] == 4
    assert got["range"] == [0.5, 0.5]  # sqrt(0.25 / 1), exact
    assert got["nonfinite"] == [2] and got["undefined"] == [3]
