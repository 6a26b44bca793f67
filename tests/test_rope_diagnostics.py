"""The frequency-axis helpers of :mod:`ropestep.rope` (docs/math.md section 10) against oracles
written here from their definitions, not from the code: ``frequency_index``, ``band_energy``,
``barycenter`` and ``barycenter_base``, their values and dtypes, and every refusal by its message.

Oracles: the RoPE pair of head dimension ``c`` is ``c mod d/2`` (``"half"``) or ``c // 2``
(``"interleaved"``), written as Python integers; energies and importances are evaluated by mpmath
at 40 digits on the very same (float32 or float64) weights.  The tolerances are
``tolerances.nonnegative_ops_rel`` with the operation counts derived below (every operand is
non-negative: nothing cancels) and ``tolerances.exp_of_sum_rel``; float32 inputs make a computation
that stays in float32 miss them by orders of magnitude.
"""
from __future__ import annotations

import math
import re

import mpmath as mp
import pytest
import torch

from ropestep import rope
from ropestep import tolerances as tl

LAYOUTS = ("half", "interleaved")


def pair_of(c: int, d: int, layout: str) -> int:
    return c % (d // 2) if layout == "half" else c // 2


def rel(got: float, want) -> float:
    """``|got - want| / want`` evaluated in mpmath (the oracle is never rounded to float64 first,
    which would add up to one more ulp)."""
    with mp.workdps(40):
        return float(abs(mp.mpf(got) - want) / abs(want))


def weights(m: int, d: int, seed: int, dtype=torch.float64, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(m, d, generator=g, dtype=torch.float64)).to(dtype)


# ---------------------------------------------------------------------------------------------
# frequency_index
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", [2, 4, 6, 8, 64])
def test_frequency_index_is_the_rope_pair(d, layout):
    got = rope.frequency_index(d, layout)
    assert got.dtype == torch.int64 and got.shape == (d,)
    assert got.tolist() == [pair_of(c, d, layout) for c in range(d)]


def test_frequency_index_refusals():
    for d in (1, 3, 7):
        with pytest.raises(ValueError, match=f"RoPE needs an even head_dim, got {d}"):
            rope.frequency_index(d, "half")
    with pytest.raises(ValueError, match="unknown RoPE layout 'HALF'"):
        rope.frequency_index(8, "HALF")


# ---------------------------------------------------------------------------------------------
# band_energy: E_l = sum over the two dimensions c of pair l of sum_i w[i, c]^2
# ---------------------------------------------------------------------------------------------
def band_energy_oracle(w: torch.Tensor, layout: str) -> list:
    m, d = w.shape
    a = w.to(torch.float64).tolist()  # float32 -> float64 is exact
    with mp.workdps(40):
        out = [mp.mpf(0)] * (d // 2)
        for c in range(d):
            out[pair_of(c, d, layout)] += mp.fsum(mp.mpf(a[i][c]) ** 2 for i in range(m))
        return out


def band_energy_ops(m: int) -> int:
    """Roundings on any one term's path to ``E_l``: its square, at most ``m - 1`` additions
    within its column, one addition of the pair's two columns."""
    return m + 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m, d", [(3, 8), (5, 4), (2, 12)])
def test_band_energy_against_the_oracle(m, d, layout, dtype):
    w = weights(m, d, seed=10 * m + d, dtype=dtype)
    got = rope.band_energy(w, layout)
    assert got.dtype == torch.float64 and got.shape == (d // 2,)
    want = band_energy_oracle(w, layout)
    tol = tl.nonnegative_ops_rel(band_energy_ops(m))
    for ell in range(d // 2):
        assert rel(float(got[ell]), want[ell]) <= tol, ell


def test_band_energy_of_one_pair_is_one_hot():
    w = torch.zeros(3, 8, dtype=torch.float64)
    w[:, 5] = torch.tensor([1.0, -2.0, 3.0])  # pair 1 ("half") or pair 2 ("interleaved")
    assert rope.band_energy(w, "half").tolist() == [0.0, 14.0, 0.0, 0.0]
    assert rope.band_energy(w, "interleaved").tolist() == [0.0, 0.0, 14.0, 0.0]


def test_band_energy_refusals():
    msg = r"band_energy: expected one head's \(m, d\) projection, got "
    with pytest.raises(ValueError, match=msg + r"\(8,\)"):
        rope.band_energy(torch.ones(8), "half")
    with pytest.raises(ValueError, match=msg + r"\(2, 3, 8\)"):
        rope.band_energy(torch.ones(2, 3, 8), "half")


# ---------------------------------------------------------------------------------------------
# barycenter: t = sum_c imp_c l(c) / (d/2 - 1) / sum_c imp_c, imp_c = ||w_q[:, c]|| + ||w_k[:, c]||
# ---------------------------------------------------------------------------------------------
def barycenter_oracle(w_q: torch.Tensor, w_k: torch.Tensor, layout: str):
    m, d = w_q.shape
    q, k = w_q.to(torch.float64).tolist(), w_k.to(torch.float64).tolist()
    with mp.workdps(40):
        imp = [mp.sqrt(mp.fsum(mp.mpf(q[i][c]) ** 2 for i in range(m)))
               + mp.sqrt(mp.fsum(mp.mpf(k[i][c]) ** 2 for i in range(m))) for c in range(d)]
        pos = [mp.mpf(pair_of(c, d, layout)) / (d // 2 - 1) for c in range(d)]
        return mp.fsum(a * b for a, b in zip(imp, pos)) / mp.fsum(imp)


def barycenter_ops(m: int, d: int) -> int:
    """Roundings behind ``t``: an importance takes ``m + 1`` per norm (squares, ``m - 1``
    additions, the root) and one to add the two norms; the numerator one more for the position
    ``l / (d/2 - 1)``, one for the product and ``d - 1`` additions (``m + d + 3``); the
    denominator ``d - 1`` additions (``m + d + 1``); the quotient one: ``2m + 2d + 5``."""
    return 2 * m + 2 * d + 5


def barycenter_tol(m: int, d: int) -> float:
    return tl.nonnegative_ops_rel(barycenter_ops(m, d))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m, d", [(3, 8), (4, 4), (2, 16)])
def test_barycenter_against_the_oracle(m, d, layout, dtype):
    w_q = weights(m, d, seed=m + d, dtype=dtype)
    w_k = weights(m, d, seed=m + d + 100, dtype=dtype, scale=0.5)  # keys and queries differ
    got = rope.barycenter(w_q, w_k, layout)
    want = barycenter_oracle(w_q, w_k, layout)
    assert isinstance(got, float) and 0.0 < got < 1.0
    assert rel(got, want) <= barycenter_tol(m, d)


def test_barycenter_of_small_weights_and_of_the_extreme_pairs():
    # a head with tiny weights (total importance far below 1) is a head like any other
    w_q, w_k = weights(3, 8, seed=1, scale=1e-4), weights(3, 8, seed=2, scale=1e-4)
    assert rel(rope.barycenter(w_q, w_k, "half"), barycenter_oracle(w_q, w_k, "half")) \
        <= barycenter_tol(3, 8)
    # all energy in the fastest pair: t = 0; in the slowest: t = 1 (both layouts)
    for layout, (fast, slow) in (("half", ((0, 4), (3, 7))), ("interleaved", ((0, 1), (6, 7)))):
        for cols, t in ((fast, 0.0), (slow, 1.0)):
            w = torch.zeros(2, 8, dtype=torch.float64)
            w[:, list(cols)] = 1.0
            assert rope.barycenter(w, 2 * w, layout) == t


def test_barycenter_refusals():
    good = weights(3, 8, seed=5)
    shape_msg = r"barycenter: W_q \(3, 8\) and W_k \(3, 6\) must be one head's \(m, d\) projections"
    with pytest.raises(ValueError, match=shape_msg):
        rope.barycenter(good, weights(3, 6, seed=6), "half")
    with pytest.raises(ValueError, match=r"barycenter: W_q \(2, 3, 8\) and W_k \(2, 3, 8\) must be"):
        rope.barycenter(torch.ones(2, 3, 8), torch.ones(2, 3, 8), "half")
    with pytest.raises(ValueError, match="barycenter needs head_dim >= 4 \\(two RoPE pairs\\), got 2"):
        rope.barycenter(torch.ones(3, 2), torch.ones(3, 2), "half")
    assert 0.0 <= rope.barycenter(torch.ones(3, 4), torch.ones(3, 4), "half") <= 1.0  # d = 4 is fine
    bad = good.clone()
    bad[1, 2] = math.nan
    with pytest.raises(ValueError, match="^barycenter: W_q/W_k contain NaN or inf$"):
        rope.barycenter(bad, good, "half")
    bad[1, 2] = math.inf
    with pytest.raises(ValueError, match="^barycenter: W_q/W_k contain NaN or inf$"):
        rope.barycenter(good, bad, "half")
    zero = torch.zeros(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="^barycenter: W_q and W_k of this head are zero$"):
        rope.barycenter(zero, zero, "half")


# ---------------------------------------------------------------------------------------------
# barycenter_base: b(t) = b_min^(1 - t) b_max^t
# ---------------------------------------------------------------------------------------------
def base_tol(t: float, base_min: float, base_max: float) -> float:
    """``exp`` of the two-term sum ``(1 - t) log b_min + t log b_max``:
    :func:`ropestep.tolerances.exp_of_sum_rel` of its absolute terms.  Each term carries the
    log's <= 4 ulp, the product's and ``1 - t``'s rounding (6 ulp), the sum one more and ``exp``
    its own: 9 ulp of the absolute sum, within the function's ``(2 + 8) u``."""
    return tl.exp_of_sum_rel((1 - t) * abs(math.log(base_min)) + t * abs(math.log(base_max)), 2)


@pytest.mark.parametrize("t", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_barycenter_base_defaults_are_1e3_and_1e6(t):
    got = rope.barycenter_base(t)  # the defaults: the document's [1e3, 1e6]
    want = mp.power(10, 3 + 3 * mp.mpf(t))
    assert rel(got, want) <= base_tol(t, 1e3, 1e6)


@pytest.mark.parametrize("lo, hi", [(1e3, 1e6), (0.5, 4.0), (1e4, 1e4), (2.0, 3e7)])
@pytest.mark.parametrize("t", [0.0, 0.3, 0.77, 1.0])
def test_barycenter_base_is_the_geometric_interpolation(lo, hi, t):
    got = rope.barycenter_base(t, lo, hi)
    with mp.workdps(40):
        want = mp.power(mp.mpf(lo), 1 - mp.mpf(t)) * mp.power(mp.mpf(hi), mp.mpf(t))
    assert rel(got, want) <= base_tol(t, lo, hi)


def test_barycenter_base_refusals():
    for t in (-1e-12, 1.0 + 1e-12, 1.5, -3.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"barycenter t must lie in \[0, 1\], got "):
            rope.barycenter_base(t)
    msg = r"base range must satisfy 0 < base_min <= base_max < inf, got "
    for lo, hi in ((0.0, 1e6), (-1.0, 1e6), (2e3, 1e3), (1e3, math.inf), (math.nan, 1e6)):
        with pytest.raises(ValueError, match=msg + re.escape(f"[{lo}, {hi}]")):
            rope.barycenter_base(0.5, lo, hi)

