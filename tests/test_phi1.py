"""phi_1 = rho and the exponential divided difference: a few ulp across the real line (issue 2).

Oracle: mpmath at 50 digits.  Bound: ``tolerances.PHI1_ULPS`` = 4 ulp of the result (``expm1`` is
faithful to ~1 ulp, one division adds 0.5 ulp; the s > 40 branch multiplies two exponentials of
s/2, ~2.5 ulp); ``exp[a, b]`` within ``tolerances.exp_dd_rel`` (both derived there).
"""
from __future__ import annotations

import math

import mpmath as mp
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ropestep import exact, fast
from ropestep import tolerances as tl

ULPS = tl.PHI1_ULPS
POINTS64 = [0.0, 1e-300, -1e-300, 5e-324, 1e-16, -1e-16, 1e-8, -1e-8, 0.1, -0.1, 30.0, -30.0,
            700.0, -700.0, 709.0, 709.78, 710.0, 712.5, 715.0, 716.0, -745.0, -1e4, 40.0,
            40.0000001, 39.9999999]
POINTS32 = [0.0, 1e-30, -1e-30, 1e-16, -1e-16, 1e-8, -1e-8, 0.1, -0.1, 30.0, -30.0, 80.0,
            88.0, 90.0, -88.0, -700.0, -745.0, -1e4, -3e38]


def exact_rho(x: float) -> mp.mpf:
    with mp.workdps(50):
        return exact.phi1(mp.mpf(x))


def ulp_error(got: float, x: float, dtype: torch.dtype) -> float:
    """|got - rho(x)| in units of rho(x) * eps(dtype); 0 for a correct overflow to inf."""
    ref = exact_rho(x)
    fi = torch.finfo(dtype)
    if ref > fi.max:
        return 0.0 if math.isinf(got) else math.inf  # genuine overflow must give inf
    return float(abs(mp.mpf(got) - ref) / (abs(ref) * fi.eps))


@pytest.mark.parametrize("x", POINTS64)
def test_phi1_float64_points(x):
    got = float(fast.phi1(torch.tensor([x], dtype=torch.float64))[0])
    err = ulp_error(got, x, torch.float64)
    print(f"rho({x!r}) = {got!r}: {err:.2f} ulp")
    assert err <= ULPS


@pytest.mark.parametrize("x", POINTS32)
def test_phi1_float32_points_and_positive(x):
    t = torch.tensor([x], dtype=torch.float32)
    got = float(fast.phi1(t)[0])
    xr = float(t[0])  # the float32 input actually evaluated
    err = ulp_error(got, xr, torch.float32)
    print(f"rho({xr!r}) = {got!r}: {err:.2f} ulp")
    assert err <= ULPS
    assert got > 0


def test_phi1_float32_strictly_positive_everywhere():
    """A dense sweep of float32 inputs from -3e38 to 88: every value finite and > 0."""
    neg = -torch.logspace(-45, 38.5, 20000, dtype=torch.float64).to(torch.float32)
    pos = torch.linspace(-100, 88, 20000, dtype=torch.float32)
    vals = fast.phi1(torch.cat([neg, pos, torch.tensor([0.0, -0.0])]))
    assert vals.dtype == torch.float32
    assert bool((vals > 0).all()), vals[vals <= 0]
    assert bool(torch.isfinite(vals).all())


def test_phi1_bfloat16_inputs_accumulate_in_float32():
    x = torch.tensor([-1e4, -745.0, -30.0, -0.1, 0.0, 1e-8, 0.1, 30.0, 80.0], dtype=torch.bfloat16)
    got = fast.phi1(x)
    assert got.dtype == torch.float32
    for xi, gi in zip(x.float().tolist(), got.tolist()):
        assert ulp_error(gi, xi, torch.float32) <= ULPS


@given(x=st.floats(-1e4, 716.0, allow_nan=False))
@example(x=0.0)
@example(x=-0.0)
@example(x=1e-300)
@example(x=716.0)
@example(x=-745.1332191019411)
def test_phi1_float64_property(x):
    got = float(fast.phi1(torch.tensor([x], dtype=torch.float64))[0])
    assert ulp_error(got, x, torch.float64) <= ULPS


@given(a=st.floats(-700, 700, allow_nan=False), b=st.floats(-700, 700, allow_nan=False))
@example(a=0.0, b=0.0)
@example(a=1.0, b=1.0 + 1e-12)
@example(a=-700.0, b=700.0)
def test_exp_dd_float64(a, b):
    got = float(fast.exp_dd(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))
    with mp.workdps(50):
        ref = exact.exp_dd(mp.mpf(a), mp.mpf(b))
        # symmetric, and the two-point form agrees with the definition away from a == b
        assert abs(exact.exp_dd(b, a) - ref) <= ref * mp.mpf(tl.exact_tol(50, 5))
        if abs(a - b) > tl.DD_DIRECT_GAP:
            direct = (mp.exp(a) - mp.exp(b)) / (mp.mpf(a) - mp.mpf(b))
            assert abs(direct - ref) <= ref * mp.mpf(tl.exact_tol(50, 10))
        rel = abs(mp.mpf(got) - ref) / ref
    # e^{hi} phi_1(lo - hi): a few ulp, the argument's rounding at most one more (tolerances.py)
    assert rel <= tl.exp_dd_rel(a, b)


def test_naive_phi1_loses_digits_near_zero():
    """Why expm1: (e^s - 1)/s loses about |log10 s| digits (docs/math.md section 2)."""
    s = torch.tensor([1e-12, 1e-9, 1e-6], dtype=torch.float64)
    naive = torch.exp(s).sub(1) / s
    good = fast.phi1(s)
    ref = [exact_rho(float(x)) for x in s]
    e_naive = max(float(abs(mp.mpf(float(n)) - r) / r) for n, r in zip(naive, ref))
    e_good = max(float(abs(mp.mpf(float(g)) - r) / r) for g, r in zip(good, ref))
    print(f"naive rel err {e_naive:.2e}, expm1 form {e_good:.2e}")
    assert e_good <= ULPS * 2.0 ** -52 < tl.NAIVE_PHI1_LOST < e_naive
