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


# ---------------------------------------------------------------------------------------------
# edge cases and boundaries (each expected value worked out by hand in the comments)
# ---------------------------------------------------------------------------------------------
def _raises(fn, message: str, *args):
    """``fn(*args)`` raises ValueError whose whole message is ``message``."""
    import re
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        fn(*args)


def test_bad_input_is_refused_with_the_problem_named():
    q_msg = "frozen reuse needs Q >= 2 queries (the anchor is excluded)"
    # pred (3, 1) would broadcast against target (3, 2): a shape mismatch is refused, not scored
    _raises(rs.anchor_mse, "pred and target must both be (Q, D), got (3, 1) and (3, 2)",
            np.zeros((3, 1)), np.zeros((3, 2)), 0)
    # equal shapes of the wrong rank are refused too
    _raises(rs.anchor_mse, "pred and target must both be (Q, D), got (3, 2, 1) and (3, 2, 1)",
            np.zeros((3, 2, 1)), np.zeros((3, 2, 1)), 0)
    _raises(rs.anchor_mse, q_msg, np.zeros((1, 2)), np.zeros((1, 2)), 0)
    _raises(rs.anchor_mse, "anchor 3 out of range for Q=3", np.zeros((3, 2)), np.zeros((3, 2)), 3)
    _raises(rs.anchor_mse, "anchor -1 out of range for Q=3", np.zeros((3, 2)), np.zeros((3, 2)),
            -1)
    _raises(rs.errors_by_anchor, q_msg, np.zeros((1, 2)), np.zeros((1, 2)))
    _raises(rs.errors_by_anchor, "pred must be (Q, D) or (Q, Q, D) = (3, 3, 2), got (2, 3, 2)",
            np.zeros((2, 3, 2)), np.zeros((3, 2)))
    _raises(rs.constant_errors, q_msg, np.zeros((1, 2)))
    _raises(rs.target_ms, q_msg, np.zeros((1, 2)))
    for shape in [(0, 3), (3, 0), (3,), (1, 2, 2)]:
        _raises(rs.pool, f"pool() needs a (C, A) array, got shape {shape}", np.zeros(shape))
    _raises(rs.reuse_table, "the table needs the 'constant' baseline",
            {"frozen": np.ones((1, 1))}, np.ones((1, 1)))
    _raises(rs.best_gain, "residual and direction shapes differ: (2, 2) vs (2, 1)",
            np.zeros((2, 2)), np.zeros((2, 1)))
    _raises(rs.spearman, "spearman: 3 x values but 2 y values", [1.0, 2.0, 3.0], [1.0, 2.0])
    _raises(rs.stack_errors, "no contexts", [])


def test_two_queries_is_the_smallest_valid_context():
    # Q = 2, D = 2: D = 2 and each anchor leaves the other query alone
    t = np.array([[0.0, 0.0], [1.0, 1.0]])
    p = np.array([[1.0, 2.0], [3.0, 5.0]])
    # per-query squared errors: row 0: 1 + 4 = 5, row 1: 2^2 + 4^2 = 20
    assert rs.anchor_mse(p, t, 0) == 20 / 2 and rs.anchor_mse(p, t, 1) == 5 / 2
    np.testing.assert_array_equal(rs.errors_by_anchor(p, t), [10.0, 2.5])
    # from anchor a the prediction is t + (a + 1): a = 0 scores row 1 off by 1 in both
    # components (2 / 2 = 1), a = 1 scores row 0 off by 2 (8 / 2 = 4)
    pa = np.stack([t + 1.0, t + 2.0])
    np.testing.assert_array_equal(rs.errors_by_anchor(pa, t), [1.0, 4.0])
    # ||o_0 - o_1||^2 = 2 from either anchor
    np.testing.assert_array_equal(rs.constant_errors(t), [1.0, 1.0])
    # zero predictor: squared norms 0 and 2 -> anchor 0 keeps row 1 (2/2), anchor 1 row 0 (0)
    np.testing.assert_array_equal(rs.target_ms(t), [1.0, 0.0])


def test_pool_averages_anchors_within_a_context_first():
    # Per-context means (1 + 0)/2 = 1/2 and (2^-53 + 2^-53)/2 = 2^-53, then (1/2 + 2^-53)/2 =
    # 1/4 + 2^-54: every step is exact in float64 (1/2 + 2^-53 is one ulp above 1/2).  A flat
    # mean of the four entries is the same number in exact arithmetic, but adds 2^-53 to 1 (a tie,
    # rounded to 1) before the small context's second entry, and returns 1/4: the equal-weight
    # nested order of docs/protocol.md section 6 is what is computed.
    E = np.array([[1.0, 0.0], [2.0 ** -53, 2.0 ** -53]])
    nested = ((1.0 + 0.0) / 2 + (2.0 ** -53 + 2.0 ** -53) / 2) / 2
    assert nested == 0.25 + 2.0 ** -54
    assert rs.pool(E)["all"] == nested
    assert rs.pool(E)["anchor0"] == (1.0 + 2.0 ** -53) / 2
    # one context and one anchor are enough: both pools are that single number
    assert rs.pool(np.array([[0.75]])) == {"anchor0": 0.75, "all": 0.75}


def test_softmax_is_over_the_last_axis_and_shift_invariant():
    # equal scores give equal weights whatever their size: exp(x - max) never overflows
    # (exp(1000) or exp(2000) is inf) nor underflows a whole row (exp(-1000) is 0)
    x = np.array([[1000.0, 1000.0], [0.0, 0.0]])
    np.testing.assert_array_equal(rs.softmax(x), [[0.5, 0.5], [0.5, 0.5]])
    # each row normalised by its own sum: a masked key (-inf) gets weight exactly 0
    y = np.array([[0.0, 0.0], [0.0, -np.inf]])
    np.testing.assert_array_equal(rs.softmax(y), [[0.5, 0.5], [1.0, 0.0]])
    # leading axes (heads, queries) are batch axes: shape (1, 2, 3), rows of equal scores give
    # 1/3 each (one rounding of 1/3, the same on both sides)
    s = np.array([[[0.0, 0.0, 0.0], [1000.0, 1000.0, 1000.0]]])
    np.testing.assert_array_equal(rs.softmax(s), np.full((1, 2, 3), 1.0 / 3.0))
    np.testing.assert_array_equal(rs.softmax(np.array([7.0, 7.0])), [0.5, 0.5])  # one row


def test_relative_error_below_unit_distance_and_nonfinite():
    # ||e|| = 1/4, ||y - mu|| = 1/2: the ratio is 1/2 (exact), nothing special about den < 1
    rel = rs.relative_error([[0.25, 0.0]], [[0.5, 0.0]], [[0.0, 0.0]])
    np.testing.assert_array_equal(rel, [0.5])
    # inf / inf is NaN (never dropped, docs/protocol.md 12.3), computed without a RuntimeWarning
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rel = rs.relative_error([[np.inf, 0.0], [0.0, 0.0]], [[np.inf, 0.0], [1.0, 1.0]],
                                [[0.0, 0.0], [1.0, 1.0]])
    assert math.isnan(rel[0]) and rel[1] == 0.0


def test_normwise_agreement_relative_and_absolute():
    # max |p - m| = 1/8, max |m| = 1/2: relative 1/4 (exact), also when max |m| < 1
    m = np.array([0.5, -0.25])
    assert rs.normwise_agreement(m + np.array([0.125, 0.0]), m) == 0.25
    # measured all zero: the absolute difference
    assert rs.normwise_agreement(np.array([0.5, -0.75]), np.zeros(2)) == 0.75
    # no entries: nothing disagrees
    assert rs.normwise_agreement(np.zeros(0), np.zeros(0)) == 0.0


def test_stack_errors_by_hand():
    # one context: every name becomes a (1, A) array of float64
    got = rs.stack_errors([{"frozen": [1, 2], "mean": np.array([3.0, 4.0])}])
    assert list(got) == ["frozen", "mean"]
    np.testing.assert_array_equal(got["frozen"], [[1.0, 2.0]])
    np.testing.assert_array_equal(got["mean"], [[3.0, 4.0]])
    assert got["frozen"].dtype == np.float64
    got = rs.stack_errors([{"frozen": [1, 2]}, {"frozen": [5, 6]}])
    np.testing.assert_array_equal(got["frozen"], [[1.0, 2.0], [5.0, 6.0]])


def test_ratio_root_by_hand():
    # sqrt(num / den) with den != 1 (a product num * den would give 1/2 here, not 2)
    assert rs.ratio_root(1.0, 0.25) == 2.0 and rs.ratio_root(0.25, 1.0) == 0.5
    assert rs.ratio_root(0.0, 4.0) == 0.0  # a perfect predictor
    assert rs.ratio_root(1.0, math.inf) == 0.0
    # a negative mean square on either side is an error: NaN (docs/protocol.md 12.2)
    assert math.isnan(rs.ratio_root(-1.0, 1.0)) and math.isnan(rs.ratio_root(1.0, -1.0))
    assert math.isnan(rs.ratio_root(-1.0, -4.0))
    # den = 0: undefined (None) unless num is NaN, which stays NaN
    assert rs.ratio_root(math.inf, 0.0) is None and rs.ratio_root(0.0, 0.0) is None
    assert math.isnan(rs.ratio_root(math.nan, 0.0))


def test_small_helpers_by_hand():
    # (1 - 2)^2 = 1, (3 - 0)^2 = 9: mean 5
    assert rs.mse([1.0, 3.0], [2.0, 0.0]) == 5.0
    # |1 - 2| = 1, |-3 - 1| = 4
    assert rs.max_abs([1.0, -3.0], [2.0, 1.0]) == 4.0
    assert rs.max_abs(np.zeros(0), np.zeros(0)) == 0.0
    # |3 - 2| = 1 against atol + rtol |2|: the boundary 1 <= 0 + 0.5 * 2 passes, 0.25 * 2 fails
    assert rs.allclose_report([3.0], [2.0], 0.0, 0.5)
    assert not rs.allclose_report([3.0], [2.0], 0.0, 0.25)
    assert rs.allclose_report([1.0], [1.0], 0.0, 0.0)  # equal values at zero tolerance


def test_inputs_are_converted_to_float64():
    torch = pytest.importorskip("torch")
    # a tensor that requires grad (numpy cannot read it directly) and a bfloat16 one
    t = torch.tensor([1.0, 3.0], requires_grad=True)
    assert rs.mse(t, torch.zeros(2)) == 5.0
    assert rs.max_abs(torch.tensor([1.5, -3.0], dtype=torch.bfloat16), [0.0, 0.0]) == 3.0
    # integers are converted before squaring: (2^32)^2 = 2^64 overflows int64, not float64
    assert rs.mse(np.array([2 ** 32]), np.array([0])) == 2.0 ** 64


def test_best_gain_small_and_overflowing_directions():
    # sum ||g||^2 = 1/4 < 1 is an ordinary direction: gamma = (1/4 * 1/2) / (1/4) = 1/2
    gamma, at1, atg = rs.best_gain([[0.25]], [[0.5]])
    assert gamma == 0.5 and at1 == 0.0625 and atg == 0.0  # (1/4 - 1/2)^2; r - g/2 = 0
    # sum ||g||^2 overflows to inf: not finite, so the gain is NaN (docs/protocol.md 12.3), even
    # though sum <r, g> = 1 is finite and 1 / inf would be 0
    with np.errstate(over="ignore"):  # (1e200)^2 overflows, as intended
        gamma, _, _ = rs.best_gain([[1e-200]], [[1e200]])
    assert math.isnan(gamma)


def test_spearman_three_pairs_and_no_spread():
    # ranks (1, 2, 3) and (1, 3, 2), centred: (-1, 0, 1), (-1, 1, 0): sum of products 1, each
    # sum of squares 2 -> 1 / sqrt(4) = 1/2 (exact)
    assert rs.spearman([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == 0.5
    assert rs.spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == 1.0
    # a constant side has no rank variance: None, never NaN or 0
    assert rs.spearman([5.0, 5.0, 5.0], [1.0, 2.0, 3.0]) is None
    assert rs.spearman([1.0, 2.0, 3.0], [7.0, 7.0, 7.0]) is None


def test_heads_beating_constant_boundaries_and_rule():
    def row(h, frozen, const):
        return {"head": h, **rs.reuse_table({"constant": np.array([[const]]),
                                             "frozen": np.array([[frozen]])}, np.array([[1.0]]))}
    # rRMSE sqrt(1/1) = 1 (not below 1), sqrt(2.25/1) = 1.5, sqrt(0.25/1) = 0.5 (exact)
    got = rs.heads_beating_constant([row(4, 1.0, 1.0), row(5, 2.25, 1.0), row(6, 0.25, 1.0)])
    assert got["heads"] == [6] and got["count"] == 1 and got["of"] == 3
    assert got["range"] == [0.5, 0.5] and got["nonfinite"] == [] and got["undefined"] == []
    assert got["predictor"] == "frozen" and got["anchors"] == "all"
    assert got["rule"] == ("all-anchor rRMSE of the frozen predictor against the head's own "
                           "constant-anchor output < 1")
    none = rs.heads_beating_constant([row(0, 4.0, 1.0)])
    assert none["heads"] == [] and none["count"] == 0 and none["range"] is None


def test_calibration_bins_by_hand():
    x = np.arange(10.0)
    rel = 2 * x
    cal = rs.calibration(rel, {"d": x})
    d = cal["distances"]["d"]
    # 10 distances 0..9, median (4 + 5)/2, mean 45/10
    assert d["summary"] == {"n": 10, "nonfinite": 0, "median": 4.5, "mean": 4.5, "min": 0.0,
                            "max": 9.0}
    # the default is 5 quantile bins (docs/protocol.md 12.3): edges at positions 9 p =
    # 0, 1.8, 3.6, 5.4, 7.2, 9 of the sorted distances, so two distances per bin and the median
    # rel of the pair {2k, 2k + 1} is 2 (2k + 1/2) = 4k + 1
    assert [b["n"] for b in d["bins"]] == [2] * 5
    assert [b["median"] for b in d["bins"]] == [1.0, 5.0, 9.0, 13.0, 17.0]
    # an explicit bin count is used: 2 bins split at 4.5
    cal2 = rs.calibration(rel, {"d": x}, n_bins=2)
    b2 = cal2["distances"]["d"]["bins"]
    assert [(b["x_lo"], b["x_hi"], b["n"], b["median"]) for b in b2] == [
        (0.0, 4.5, 5, 4.0), (4.5, 9.0, 5, 14.0)]


def test_constant_errors_sum_per_query_squared_distances():
    # D = 4: o_0 = 0, o_1 = (1, 0, 0, 0), o_2 = 2^-27 (1, 1, 1, 1).  From anchor 0 the squared
    # distances are 0, 1 and 4 * 2^-54 = 2^-52, all exact, and so is their sum 1 + 2^-52 (one
    # ulp above 1) in any order: E_0 = (1 + 2^-52) / ((Q-1) D) = (1 + 2^-52) / 8, exactly.
    # (Summing each component over the queries first would add the 2^-54 pieces to 1 one at a
    # time and lose them: the same number in exact arithmetic, 1/8 in float64.)
    t = np.array([[0.0] * 4, [1.0, 0.0, 0.0, 0.0], [2.0 ** -27] * 4])
    assert rs.constant_errors(t)[0] == (1.0 + 2.0 ** -52) / 8


def test_binned_edges_and_bins_by_hand():
    x = np.arange(10.0)
    # the default is 5 bins (the distances 0..9 two to a bin, as in test_calibration_bins_by_hand)
    b = rs.binned(x, 2 * x)
    assert [bb["n"] for bb in b] == [2] * 5
    assert [bb["median"] for bb in b] == [1.0, 5.0, 9.0, 13.0, 17.0]
    # one pair: every edge is that distance; the last bin is closed (e_4 <= d <= e_5)
    assert rs.binned([3.0], [7.0]) == [{"x_lo": 3.0, "x_hi": 3.0, "n": 1, "median": 7.0,
                                        "p90": 7.0}]
    # empty bins are skipped, not the end of the list: distances 0, 0, 0, 1, 1, 2 have edges at
    # positions 5 p = 0, 1, 2, 3, 4, 5 of the sorted list: 0, 0, 0, 1, 1, 2.  The zeros satisfy
    # e_2 <= 0 < e_3 only (bin 2), the ones and the two fall in the closed last bin (e_4 = 1)
    y = np.array([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    got = rs.binned([0.0, 0.0, 0.0, 1.0, 1.0, 2.0], y)
    assert [(g["x_lo"], g["x_hi"], g["n"], g["median"]) for g in got] == [
        (0.0, 1.0, 3, 20.0), (1.0, 2.0, 3, 50.0)]
    # p90 of three values: position 0.9 * 2 = 1.8, 20 + 0.8 * 10 and 50 + 0.8 * 10
    assert [g["p90"] for g in got] == [hand(28.0, 4), hand(58.0, 4)]
    # only pairs with both sides finite are binned: (1, 10), (2, 20) and (4, 60) of these
    x6 = [1.0, 2.0, math.nan, 3.0, math.inf, 4.0]
    y6 = [10.0, 20.0, 30.0, math.nan, 50.0, 60.0]
    assert rs.binned(x6, y6, n_bins=1) == [{"x_lo": 1.0, "x_hi": 4.0, "n": 3, "median": 20.0,
                                            "p90": hand(52.0, 4)}]
    assert rs.binned([math.nan, 1.0], [1.0, math.inf]) == []


def test_summarize_one_entry_and_none():
    assert rs.summarize([3.0]) == {"n": 1, "nonfinite": 0, "median": 3.0, "mean": 3.0,
                                   "min": 3.0, "max": 3.0}
    assert rs.summarize(np.zeros((0, 2))) == {"n": 0, "nonfinite": 0, "median": None,
                                              "mean": None, "min": None, "max": None}


def test_summarize_nonfinite_entries_by_hand():
    # a NaN makes every statistic NaN (docs/protocol.md 12.3), the count stays exact
    s = rs.summarize([1.0, math.nan, math.inf])
    assert s["n"] == 3 and s["nonfinite"] == 2
    assert all(math.isnan(s[k]) for k in ("median", "mean", "min", "max"))
    assert set(s) == {"n", "nonfinite", "median", "mean", "min", "max"}
    # -inf and +inf: the extremes are themselves, the mean and the middle value inf - inf (NaN),
    # computed without a RuntimeWarning
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = rs.summarize([-math.inf, math.inf])
    assert s["min"] == -math.inf and s["max"] == math.inf and s["nonfinite"] == 2
    assert math.isnan(s["mean"]) and math.isnan(s["median"])


def test_relative_error_never_turns_a_non_finite_input_into_a_number():
    """A NaN error, or a NaN/inf in y or mu, is NaN -- not 0 or inf (found by mutation review:
    a NaN denominator used to fall into the y = mu branch)."""
    nan, inf = np.nan, np.inf
    got = rs.relative_error([[nan, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [3.0, 4.0],
                             [inf, 0.0], [0.0, 0.0]],
                            [[1.0, 1.0], [nan, 0.0], [nan, 0.0], [inf, 0.0], [1.0, 1.0],
                             [2.0, 0.0], [1.0, 1.0]],
                            [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [inf, 0.0], [1.0, 1.0],
                             [0.0, 0.0], [1.0, 1.0]])
    want = [nan, nan, nan, nan, inf, inf, 0.0]
    np.testing.assert_array_equal(got, want)
