"""The readout's condition number ``Step.kappa`` against the oracle's (:func:`ropestep.exact.kappa`).

``kappa`` scales every readout tolerance of the suite (``tolerances.readout_bound``, the
low-precision floor), so a wrong kappa would widen a bound without any test noticing.  Here the
fast layer's float64 kappa is compared, per head and query, with the exact kappa computed from
the oracle's own coefficients, rotated keys, biases and values, in every gauge (original,
max-key, a free vector g, pairwise) and every family (dot, qknorm, cosine; soft-cap, ALiBi,
explicit biases, GQA, per-head bases, both layouts): agreement to ``tolerances.KAPPA_REL``
(1e-11) relative to ``max(kappa, tolerances.KAPPA_FLOOR)`` (both derived there).  And the
comparison can fail: a kappa inflated by 1e8 (or deflated, or off by one part in 1e8) is
caught.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, example, given

from ropestep import exact, fast, tolerances
from oracle import check_kappa_agreement, gauge_name, gauges_for
from strategies import make_problem, pins, problems

KAPPA_REL = tolerances.KAPPA_REL
U64 = tolerances.unit_roundoff(torch.float64)

# largest disagreement seen per gauge (printed with -s; read by the report of this change)
WORST: dict = {}


def check_kappa(p, g, E=None) -> np.ndarray:
    """Fast float64 kappa vs exact kappa on problem ``p`` in gauge ``g``; returns the relative
    disagreement ``(H, Q)`` after asserting it is <= KAPPA_REL (None when fast refused)."""
    E = exact.build(*p.args(), bias=p.bias, dps=30) if E is None else E
    name = gauge_name(g)
    try:
        st_ = fast.step(*p.args(), bias=p.bias, gauge=g)
    except FloatingPointError:
        # documented refusal: the original/free gauge's coefficients overflow float64.  Then the
        # exact condition number must certify that no float64 readout could mean anything there
        assert name in ("original", "free"), name
        ke = exact.all_kappa(E, g)
        worst = max(ke.reshape(-1))
        assert worst * U64 >= tolerances.KAPPA_OVERFLOW_CERT, (name, worst)  # kappa ~ e^{-z_max}
        event(f"fast refused ({name}): exact kappa certifies overflow")
        return None
    rel, _ = check_kappa_agreement(E, st_, g)  # asserts rel <= KAPPA_REL (oracle.checked_kappa)
    key = (name, p.spec.family)
    WORST[key] = max(WORST.get(key, 0.0), float(rel.max()))
    return rel


def _saturated_softcap(seed: int):
    """A soft-cap of 1 at score spread 1400: two scores far out on the same side have
    tanh-equal transforms, so a max-key coefficient is ~e^{-1400} -- below float64's range
    (seed 6: exact kappa 7e-439, fast 0) or subnormal (seed 7: 5.2e-310)."""
    return make_problem(seed=seed, m=1, H=2, Hk=1, d=2, r=2, N=3, softcap=1.0, spread=1400.0,
                        biases=False, base=2.0, label=f"saturated soft-cap, seed {seed}")


@pins
@example(p=_saturated_softcap(6))
@example(p=_saturated_softcap(7))
@given(p=problems(max_n=10))
def test_fast_kappa_matches_exact(p):
    """Every gauge the head admits, every head and query: |kappa_fast - kappa_exact| <=
    KAPPA_REL * max(kappa_exact, KAPPA_FLOOR)."""
    E = exact.build(*p.args(), bias=p.bias, dps=30)
    for g in gauges_for(p.spec, p.x_q.shape[1]):
        rel = check_kappa(p, g, E)
        if rel is not None:
            event(f"{gauge_name(g)}/{p.spec.family}")


# ---------------------------------------------------------------------------------------------
# the comparison can fail
# ---------------------------------------------------------------------------------------------
_CASES = {
    "dot, ALiBi, GQA": dict(seed=7, m=4, H=4, Hk=2, d=4, r=3, N=6, alibi=True),
    "dot, soft-cap, spread 200": dict(seed=8, m=3, H=2, Hk=1, d=6, r=2, N=7, softcap=5.0,
                                      spread=200.0),
    "qknorm, interleaved": dict(seed=9, family="qknorm", layout="interleaved", N=6),
    "cosine, per-head tau": dict(seed=10, family="cosine", temperature=(0.05, 2.0), N=6),
}


def _gauges_of(p):
    return gauges_for(p.spec, p.x_q.shape[1])


@pytest.mark.parametrize("factor", [1e8, 1e-8, 1 + 1e-8])
@pytest.mark.parametrize("case", list(_CASES))
def test_wrong_kappa_is_caught(case, factor, monkeypatch):
    """``fast.step`` wrapped so its kappa is multiplied by ``factor``: the check that passes on
    the true kappa turns red in every gauge (1 + 1e-8: the tolerance is tight, not just loose
    enough to miss nothing but a factor 1e8)."""
    p = make_problem(label=case, **_CASES[case])
    E = exact.build(*p.args(), bias=p.bias, dps=30)
    for g in _gauges_of(p):
        rel = check_kappa(p, g, E)  # the true kappa passes ...
        assert rel is not None and rel.max() <= KAPPA_REL
    real_step = fast.step

    def inflated(*a, **kw):
        res = real_step(*a, **kw)
        res.kappa = res.kappa * factor
        return res

    monkeypatch.setattr(fast, "step", inflated)
    for g in _gauges_of(p):  # ... the wrong one fails, in every gauge
        assert float(fast.step(*p.args(), bias=p.bias, gauge=g).kappa.abs().max()) > 0
        with pytest.raises(AssertionError, match="fast kappa disagrees with exact kappa"):
            check_kappa(p, g, E)


def test_zero_kappa_is_exact_zero():
    """No term at all (one key: the max-key and pairwise sums are empty; q = 0): exact kappa 0,
    and the fast layer's is exactly 0 too -- while an original-gauge single key is not."""
    p = make_problem(label="single key", N=1)
    E = exact.build(*p.args(), bias=p.bias, dps=30)
    for g in ("maxkey", "pairwise"):
        assert float(exact.all_kappa(E, g).max()) == 0.0
        assert float(fast.step(*p.args(), gauge=g).kappa.abs().max()) == 0.0
    assert float(exact.all_kappa(E, "original").min()) > 0
    check_kappa(p, "original", E)


def test_underflowing_kappa_is_within_the_floor():
    """Where the exact kappa is below float64's range the fast layer returns 0 -- agreement
    relative to KAPPA_FLOOR (such a kappa scales no tolerance), not an exception to the check."""
    p = _saturated_softcap(6)
    E = exact.build(*p.args(), bias=p.bias, dps=30)
    ke = exact.all_kappa(E, "maxkey")
    assert 0 < ke[1, 1] < tolerances.KAPPA_FLOOR
    assert float(fast.step(*p.args(), gauge="maxkey").kappa[1, 1]) == 0.0
    assert check_kappa(p, "maxkey", E).max() <= KAPPA_REL


def test_kappa_reproduces_the_documented_regimes():
    """The exact kappa shows what README's Numerics says kappa measures: every score <= -30
    makes the original gauge ill-conditioned (kappa >~ e^{30}) and leaves the max-key gauge
    at O(1); the fast layer reports the same numbers."""
    p = make_problem(label="all scores <= -30, bank", const_bias=-40.0, N=6, bank=True, amp=0.3)
    E = exact.build(*p.args(), bias=p.bias, dps=30)
    ko = exact.to_float(exact.all_kappa(E, "original"))
    km = exact.to_float(exact.all_kappa(E, "maxkey"))
    assert ko.min() > tolerances.KAPPA_ILL_ORIGINAL and km.max() < tolerances.KAPPA_WELL_MAXKEY
    for g in ("original", "maxkey", "pairwise"):
        assert check_kappa(p, g, E).max() <= KAPPA_REL


def test_exact_kappa_by_hand():
    """Two keys, r = 1, original gauge, worked out independently of exact.kappa's code path:
    sum_j c_j |q| . |k~_j| (|v_j - mu| + |v_j|) / max|v_j| with c_j = phi_1(s_j)/Z."""
    import mpmath as mp

    p = make_problem(seed=3, m=2, H=1, Hk=1, d=2, r=1, N=2, mask_kind="bank", Q=1,
                     biases=False)
    E = exact.build(*p.args(), bias=p.bias, dps=30)
    with mp.workprec(E.prec):
        q, k, v = E.q[0, 0], E.k[0], [E.v[0, j, 0] for j in range(2)]
        s = [q[0] * k[j][0] + q[1] * k[j][1] for j in range(2)]
        Z = mp.exp(s[0]) + mp.exp(s[1])
        mu = (v[0] + v[1]) / 2
        S = max(abs(v[0]), abs(v[1]))
        want = sum(mp.expm1(s[j]) / s[j] / Z * (abs(q[0] * k[j][0]) + abs(q[1] * k[j][1]))
                   * (abs(v[j] - mu) + abs(v[j])) for j in range(2)) / S
        got = exact.kappa(E, 0, 0, "original")
        assert abs(got - want) <= mp.mpf(tolerances.exact_tol(30, 5)) * want
    # and the fast layer
    assert check_kappa(p, "original", E).max() <= KAPPA_REL


def test_exact_kappa_rejects_bad_arguments():
    p = make_problem(seed=4, N=4, family="cosine")
    E = exact.build(*p.args(), bias=p.bias, dps=20)
    with pytest.raises(ValueError, match="free gauges need an affine head"):
        exact.kappa(E, 0, 0, np.zeros(p.x_q.shape[1] + 1))
    with pytest.raises(ValueError, match="only meaningful in the max-key gauge"):
        exact.kappa(E, 0, 3, "original", anchor=0)
    with pytest.raises(ValueError, match="not in query 0's permitted set"):
        exact.kappa(E, 0, 0, "maxkey", anchor=3)  # causal: query 0 sees key 0 only
    with pytest.raises(ValueError, match="unknown gauge"):
        exact.kappa(E, 0, 0, "nope")


@pytest.mark.parametrize("n_keys_used, Gk", [(3, 1), (40, 1), (5, 3)])
def test_abs_offset_dots_grouped_equals_the_elementwise_sum(n_keys_used, Gk):
    """The max-key kappa term ``|q_i| . |k_j - k_{j*_i}|``: grouped by max key (few distinct
    ``j*``, shared keys), element-wise (many, or per-head keys) -- both against the plain sum.
    Every term is non-negative, so each side is within ``gamma_d`` relative of the exact value
    and the two within ``2 gamma_d`` (Higham, Lemma 3.1): ``2 d u`` with ``d u`` << 1."""
    from ropestep.kernel import abs_offset_dots

    g = torch.Generator().manual_seed(n_keys_used)
    G, Qc, n, d = 3, 16, 50, 8
    q = torch.randn(G, Qc, d, generator=g, dtype=torch.float64)
    k = torch.randn(Gk, n, d, generator=g, dtype=torch.float64)
    js = torch.randint(0, n_keys_used, (G, Qc), generator=g)
    got = abs_offset_dots(q, k, js)
    kk = k.expand(G, n, d)
    want = torch.empty(G, Qc, n, dtype=torch.float64)
    for a in range(G):
        for i in range(Qc):
            ko = kk[a, int(js[a, i])]
            for j in range(n):
                want[a, i, j] = float(sum(abs(float(q[a, i, l])) * abs(float(kk[a, j, l] - ko[l]))
                                          for l in range(d)))
    u = torch.finfo(torch.float64).eps / 2
    assert torch.all((got - want).abs() <= 2 * d * u * want / (1 - d * u))
    assert torch.all(got[torch.arange(G)[:, None], torch.arange(Qc)[None], js] == 0)
