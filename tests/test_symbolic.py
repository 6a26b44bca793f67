"""Tests of :mod:`ropestep.symbolic`: every derivation reduces to exactly 0, the deliberately
wrong statements do not, and each derivation evaluated through ``sympy.lambdify`` agrees with
mpmath at 60 digits (to 1e-40), with numpy/torch in float64, and with the exact (mpmath) and
fast (torch) layers of the library.

Tolerances.  At 60 digits an expression of a few hundred operations on inputs of size ~1 carries
rounding of order 1e-58 times its condition; 1e-40 leaves 18 digits for cancellation in the
residuals (e.g. ``(e^s - 1)/s`` at ``|s| = 1e-12`` loses 12).  Float64 comparisons use
``tolerances.FLOAT64_REL`` (1e-12, derived there).
"""
from __future__ import annotations

import functools
import random

import mpmath as mp
import numpy as np
import pytest
import sympy as sp
import torch

from ropestep import symbolic as S
from ropestep.tolerances import FLOAT64_REL, nonnegative_ops_rel

DPS = 60
TOL_MP = mp.mpf("1e-40")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def entries(x) -> list:
    if isinstance(x, sp.MatrixBase):
        return list(x)
    if isinstance(x, (list, tuple)):
        out = []
        for e in x:
            out += entries(e)
        return out
    return [x]


def assert_exact_zero(expr, label: str = "") -> None:
    red = S.reduce_exact(expr)
    bad = [e for e in entries(red) if e != 0]
    print(f"{label}: {len(entries(red))} entries, {len(bad)} non-zero after exact reduction")
    assert not bad, f"{label}: not reduced to 0: {bad[0]}"


def rand_values(syms, seed: int, lo: float = -1.5, hi: float = 1.5) -> list:
    """Random mpf values (at the current precision), one per symbol."""
    rng = random.Random(seed)
    return [mp.mpf(lo) + (mp.mpf(hi) - mp.mpf(lo)) * mp.mpf(rng.random()) for _ in syms]


def mp_eval(expr, syms, values) -> list:
    """Lambdify to mpmath and evaluate at 60 digits; returns a flat list of mpf."""
    f = sp.lambdify(syms, entries(expr), modules="mpmath")
    with mp.workdps(DPS):
        return [mp.mpf(x) for x in f(*values)]


def max_abs(xs) -> mp.mpf:
    return max([abs(x) for x in xs] + [mp.mpf(0)])


def nonzero_somewhere(expr, syms, seeds=(1, 2, 3)) -> mp.mpf:
    """Largest |value| over a few random points at 60 digits (a wrong statement must be far from 0)."""
    best = mp.mpf(0)
    with mp.workdps(DPS):
        for seed in seeds:
            best = max(best, max_abs(mp_eval(expr, syms, rand_values(syms, seed))))
    return best


@functools.lru_cache(maxsize=None)
def head(n: int, dim: int, r: int) -> S.SymbolicHead:
    return S.symbolic_head(n, dim, r)


# ---------------------------------------------------------------------------------------------
# the reduction itself
# ---------------------------------------------------------------------------------------------
def test_reduce_exact_sound_and_not_vacuous():
    x, y, z = sp.symbols("x y z", real=True)
    assert_exact_zero(sp.exp(x + y) - sp.exp(x) * sp.exp(y), "exp(x+y)")
    assert_exact_zero(sp.exp(x / 2) ** 2 - sp.exp(x), "half exponents")
    assert_exact_zero(sp.sin(x) ** 2 + sp.cos(x) ** 2 - 1, "sin^2+cos^2")
    assert_exact_zero(sp.tanh(x) - (sp.exp(2 * x) - 1) / (sp.exp(2 * x) + 1), "tanh")
    assert_exact_zero(sp.cos(x - y) - sp.cos(x) * sp.cos(y) - sp.sin(x) * sp.sin(y), "cos(x-y)")
    assert S.is_exactly_zero(sp.Matrix([[sp.exp(2 * x) - sp.exp(x) ** 2, 0]]))
    assert not S.is_exactly_zero([sp.Integer(0), sp.exp(x) - x])
    # non-identities must survive the reduction
    for e in (sp.exp(x) - 1 - x, sp.exp(x * y) - sp.exp(x) * sp.exp(y), sp.sin(x) - x,
              1 / (x - y) - 1 / (y - x), (sp.exp(x) - 1) / x - sp.exp(x)):
        assert S.reduce_exact(e) != 0, e
    # the replacement is an identity: substituting the exponentials back gives the input
    e = sp.exp(x - z) * sp.exp(2 * y) + sp.exp(x + y / 3)
    rep, mapping = S.exp_to_symbols(e)
    back = rep.xreplace({k: sp.exp(v) for k, v in mapping.items()})
    assert sp.simplify(sp.powsimp(back - e, combine="exp")) == 0
    assert len(mapping) <= 3


# ---------------------------------------------------------------------------------------------
# section 2: rho
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["integral", "series", "series_sum", "limit_at_0", "expm1",
                                  "expm1_integral", "two_point", "reflection"])
def test_rho_facts(name):
    facts = rho_facts_cached()
    assert_exact_zero(facts[name], f"rho {name}")


@functools.lru_cache(maxsize=None)
def rho_facts_cached():
    return S.rho_facts()


def test_rho_positivity_argument():
    facts = S.rho_positivity()
    print(facts)
    assert all(v is True for v in facts.values()), facts
    s = sp.Symbol("s", real=True, nonzero=True)
    assert S.rho(sp.Integer(0)) == 1 and S.exp_dd(s, s) == sp.exp(s)


def test_rho_bridge_mpmath_and_exact():
    """Lambdified rho / exp_dd at 60 digits against exact.phi1 / exp_dd, mp.quad of the integral
    and the series; |s| from 1e-12 to 700."""
    from ropestep import exact

    s, a, b = sp.symbols("s a b", real=True)
    f_rho = sp.lambdify(s, S.rho(s), modules="mpmath")
    f_dd = sp.lambdify((a, b), S.exp_dd(a, b), modules="mpmath")
    f_series = sp.lambdify(s, S.rho_series(s, 60), modules="mpmath")
    worst = mp.mpf(0)
    with mp.workdps(DPS):
        pts = [mp.mpf(x) for x in ("1e-12", "-1e-12", "3e-5", "0.5", "-0.5", "2", "-7", "40",
                                   "-200", "700", "-745.5")]
        for x in pts:
            ref = exact.phi1(x)
            worst = max(worst, abs(f_rho(x) - ref) / ref)
            if abs(x) <= 2:
                quad = mp.quad(lambda t: mp.exp(t * x), [0, 1])
                worst = max(worst, abs(quad - ref) / ref)
            if abs(x) <= mp.mpf("0.5"):
                worst = max(worst, abs(f_series(x) - ref) / ref)
        rng = random.Random(7)
        for _ in range(20):
            x, y = mp.mpf(rng.uniform(-30, 30)), mp.mpf(rng.uniform(-30, 30))
            ref = exact.exp_dd(x, y)
            worst = max(worst, abs(f_dd(x, y) - ref) / ref)
    print(f"rho/exp_dd vs exact, 60 digits: max rel err {mp.nstr(worst, 5)}")
    assert worst <= TOL_MP


def test_rho_bridge_float64_fast():
    """numpy/torch lambdify of rho and exp_dd in float64 against mpmath and against fast.phi1 /
    fast.exp_dd.  The naive (e^s - 1)/s is compared only for |s| >= 0.1 (it loses ~|log10 s|
    digits near 0, docs/math.md section 2); fast.* on the full range."""
    from ropestep import exact, fast

    s, a, b = sp.symbols("s a b", real=True)
    f_np = sp.lambdify(s, S.rho(s), modules="numpy")
    f_t = sp.lambdify(s, S.rho(s), modules="torch")
    g_np = sp.lambdify((a, b), S.exp_dd(a, b), modules="numpy")
    rng = np.random.default_rng(3)
    xs = np.concatenate([rng.uniform(-30, 30, 200), [0.1, -0.1, 1.0, 5.0, -50.0, 300.0]])
    with mp.workdps(DPS):
        ref = np.array([float(exact.phi1(mp.mpf(float(x)))) for x in xs])
        small = np.array([1e-300, 1e-12, -3e-9, 1e-5, 0.0, 700.0, -700.0])
        ref_small = np.array([float(exact.phi1(mp.mpf(float(x)))) for x in small])
        aa, bb = rng.uniform(-20, 20, 100), rng.uniform(-20, 20, 100)
        ref_dd = np.array([float(exact.exp_dd(mp.mpf(float(x)), mp.mpf(float(y))))
                           for x, y in zip(aa, bb)])
    err_np = np.max(np.abs(f_np(xs) - ref) / ref)
    err_t = np.max(np.abs(f_t(torch.tensor(xs, dtype=torch.float64)).numpy() - ref) / ref)
    err_fast = np.max(np.abs(fast.phi1(torch.tensor(xs)).numpy() - ref) / ref)
    err_fast_small = np.max(np.abs(fast.phi1(torch.tensor(small)).numpy() - ref_small) / ref_small)
    err_dd = np.max(np.abs(g_np(aa, bb) - ref_dd) / ref_dd)
    err_fast_dd = np.max(np.abs(fast.exp_dd(torch.tensor(aa), torch.tensor(bb)).numpy() - ref_dd) / ref_dd)
    print(f"float64 rel err: numpy {err_np:.2e} torch {err_t:.2e} fast {err_fast:.2e} "
          f"fast(small/huge) {err_fast_small:.2e} exp_dd numpy {err_dd:.2e} fast {err_fast_dd:.2e}")
    for e in (err_np, err_t, err_fast, err_fast_small, err_dd, err_fast_dd):
        assert e <= FLOAT64_REL


# ---------------------------------------------------------------------------------------------
# section 3: the identity
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,dim,r", [(1, 2, 1), (1, 3, 2), (2, 2, 1), (2, 3, 2), (3, 3, 2), (4, 3, 2)])
def test_identity_exact(n, dim, r):
    h = head(n, dim, r)
    assert_exact_zero(S.identity_residual(h.u, h.a, h.v), f"identity N={n} D={dim} r={r}")


@pytest.mark.parametrize("step", [s.name for s in S.general_identity_proof()])
def test_identity_general_n_proof(step):
    st = {s.name: s for s in S.general_identity_proof()}[step]
    res = S.check_proof_step(st)
    print(f"{step} ({st.reason}): residual {res}")
    assert res == 0


def test_identity_general_n_proof_chains():
    """The steps compose: each right side is the next left side (up to the common 1/Z and the
    definition s_j = sum_l u_l a_lj), and the chain runs from y - mu to u^T delta_m."""
    st = {s.name: s for s in S.general_identity_proof()}
    j, l = sp.symbols("j l", integer=True, positive=True)
    n, d = sp.symbols("N D", integer=True, positive=True)
    s_, u, a = sp.IndexedBase("s"), sp.IndexedBase("u"), sp.IndexedBase("a")
    z = sp.Sum(sp.exp(s_[j]), (j, 1, n))
    assert st["weights_sum_to_one"].rhs * z == st["subtract_zero"].lhs
    assert st["subtract_zero"].rhs / z == st["expm1_is_s_rho"].lhs
    score = sp.Sum(u[l] * a[l, j], (l, 1, d))
    assert st["score_is_linear"].lhs.xreplace({score: s_[j]}) == st["expm1_is_s_rho"].rhs


def test_identity_general_n_proof_rejects_a_wrong_step():
    """Mutation: replacing s rho(s) by s e^s, or subtracting s_j instead of 1, breaks a step."""
    steps = {s.name: s for s in S.general_identity_proof()}
    st = steps["expm1_is_s_rho"]
    j = sp.Symbol("j", integer=True, positive=True)
    s_ = sp.IndexedBase("s")
    wrong = S.ProofStep(st.name, st.lhs, st.rhs.replace(sp.exp(s_[j]) - 1, s_[j] * sp.exp(s_[j])), st.reason)
    assert S.check_proof_step(wrong) != 0
    st = steps["subtract_zero"]  # subtracting a non-constant s_j instead of 1 is not free
    wrong = S.ProofStep(st.name, st.lhs, st.rhs.replace(sp.exp(s_[j]) - 1, sp.exp(s_[j]) - s_[j]), st.reason)
    assert S.check_proof_step(wrong) != 0


@pytest.mark.parametrize("fn", [S.wrong_identity_softmax_mean, S.wrong_identity_exp_weights])
def test_wrong_identities_do_not_vanish(fn):
    h = head(2, 2, 1)
    res = fn(h.u, h.a, h.v)
    assert S.reduce_exact(res) != sp.zeros(1, 1)
    big = nonzero_somewhere(res, h.symbols())
    print(f"{fn.__name__}: max |residual| at random points {mp.nstr(big, 5)}")
    assert big > mp.mpf("1e-3")


@pytest.mark.parametrize("n", [1, 3, 4])
def test_identity_bridge_mpmath(n):
    """Lambdified y and mu + u^T dM agree to 1e-40 at 60 digits, and y matches a direct mpmath
    softmax written here."""
    h = head(n, 3, 2)
    syms = h.symbols()
    mu = S.uniform_mean(h.v)
    y = S.softmax_output(h.u, h.a, h.v)
    ro = S.readout(h.u, S.delta_m(h.u, h.a, h.v), mu)
    worst = mp.mpf(0)
    with mp.workdps(DPS):
        for seed in range(3):
            vals = rand_values(syms, seed, -3, 3)
            yv, rv = mp_eval(y, syms, vals), mp_eval(ro, syms, vals)
            d = 3
            u = vals[:d]
            a = [vals[d + j * d: d + (j + 1) * d] for j in range(n)]
            v = [vals[d + n * d + j * 2: d + n * d + (j + 1) * 2] for j in range(n)]
            e = [mp.exp(mp.fsum(x * w for x, w in zip(u, aj))) for aj in a]
            direct = [mp.fsum(ej * vj[q] for ej, vj in zip(e, v)) / mp.fsum(e) for q in range(2)]
            scale = max_abs([x for vj in v for x in vj])
            worst = max(worst, max_abs([p - q for p, q in zip(yv, rv)]) / scale,
                        max_abs([p - q for p, q in zip(yv, direct)]) / scale)
    print(f"identity N={n}, 60 digits: max rel |y - readout|, |y - direct| = {mp.nstr(worst, 5)}")
    assert worst <= TOL_MP


@functools.lru_cache(maxsize=None)
def exact_problem(n: int = 4, seed: int = 11, bank: bool = False):
    from strategies import make_problem

    from ropestep import exact

    p = make_problem(seed=seed, m=1, H=1, Hk=1, d=2, r=2, N=n, base=10.0, layout="interleaved",
                     bank=bank)
    return p, exact.build(*p.args(), bias=p.bias, dps=DPS)


def _features(E, i: int):
    perm = list(np.flatnonzero(E.mask[i]))
    u = list(E.u[0, i])
    a = [list(E.feats[0, i, j]) for j in perm]
    v = [list(E.v[0, j]) for j in perm]
    return u, a, v


def test_identity_bridge_exact_layer():
    """Symbolic y and delta_m, lambdified at 60 digits on the exact layer's own u_i, a_ij, v_j,
    equal exact.build's y and exact.delta_m (original, max-key and pairwise gauges)."""
    from ropestep import exact

    p, E = exact_problem()
    n = E.feats.shape[2]
    h = head(n, 2, 2)
    syms = h.symbols()
    y = S.softmax_output(h.u, h.a, h.v)
    dm = S.delta_m(h.u, h.a, h.v)
    pair = S.pairwise_delta_m(h.u, h.a, h.v)
    worst = {}
    with mp.workdps(DPS):
        i = n - 1
        u, a, v = _features(E, i)
        vals = [*u, *[x for aj in a for x in aj], *[x for vj in v for x in vj]]
        s = [mp.fsum(x * w for x, w in zip(u, aj)) for aj in a]
        jstar = max(range(n), key=lambda j: s[j])
        dm_max = S.gauge_delta_m(h.u, h.a, h.v, h.a[jstar])
        ex = {"y": list(E.y[0, i]), "original": list(exact.delta_m(E, 0, i, "original")),
              "maxkey": list(exact.delta_m(E, 0, i, "maxkey")),
              "pairwise": list(exact.delta_m(E, 0, i, "pairwise"))}
        sym = {"y": y, "original": dm, "maxkey": dm_max, "pairwise": pair}
        for k in ex:
            got = mp_eval(sym[k], syms, vals)
            worst[k] = max_abs([g - e for g, e in zip(got, ex[k])]) / max(max_abs(ex[k]), mp.mpf(1))
    print("symbolic vs exact layer, 60 digits:", {k: mp.nstr(w, 3) for k, w in worst.items()})
    assert all(w <= TOL_MP for w in worst.values())


def test_identity_bridge_fast_float64():
    """The same symbolic delta_m and y lambdified with numpy and torch (float64) at the exact
    layer's features, against fast.step (float64)."""
    from ropestep import fast

    p, E = exact_problem()
    st = fast.step(*p.args(), bias=p.bias, delta_m=True)
    n = E.feats.shape[2]
    h = head(n, 2, 2)
    syms = h.symbols()
    u, a, v = _features(E, n - 1)
    vals = [float(x) for x in [*u, *[x for aj in a for x in aj], *[x for vj in v for x in vj]]]
    exprs = entries(S.delta_m(h.u, h.a, h.v)) + entries(S.softmax_output(h.u, h.a, h.v))
    f_np = sp.lambdify(syms, exprs, modules="numpy")
    f_t = sp.lambdify(syms, exprs, modules="torch")
    got_np = np.array(f_np(*vals), dtype=float)
    got_t = np.array([float(x) for x in f_t(*[torch.tensor(x, dtype=torch.float64) for x in vals])])
    ref = np.concatenate([st.delta_m[0, n - 1].numpy().ravel(), st.y[0, n - 1].numpy().ravel()])
    scale = max(np.abs(ref).max(), 1.0)
    e_np, e_t = np.abs(got_np - ref).max() / scale, np.abs(got_t - ref).max() / scale
    print(f"symbolic (numpy, torch) vs fast.step float64: {e_np:.2e}, {e_t:.2e}")
    assert e_np <= FLOAT64_REL and e_t <= FLOAT64_REL


# ---------------------------------------------------------------------------------------------
# section 3: the gradient step
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("generic", [False, True])
def test_gradient_is_minus_delta_m(generic):
    h = head(3, 2, 2)
    assert_exact_zero(S.gradient_residual(h.u, h.a, h.v, generic_weights=generic), f"grad generic={generic}")


def test_gradient_without_half_is_wrong():
    h = head(2, 2, 1)
    res = S.wrong_gradient_without_half(h.u, h.a, h.v)
    assert S.reduce_exact(res) != sp.zeros(2, 1)
    # it is exactly -delta_m: the factor 2 is the whole error
    assert_exact_zero(res + S.delta_m(h.u, h.a, h.v), "no-half gradient = -2 dM")
    assert nonzero_somewhere(res, h.symbols()) > mp.mpf("1e-3")


def test_hessian_is_kron_h_identity():
    h = head(3, 2, 2)
    assert_exact_zero(S.hessian_residual(h.a, h.v), "Hessian = H (x) I_r")
    paper = S.step_weights(h.u, h.a)
    assert_exact_zero(S.hessian_residual(h.a, h.v, weights=paper), "Hessian, paper weights")


@pytest.mark.parametrize("generic", [True, False])
def test_descent_change_formula(generic):
    h = head(2, 2, 2) if not generic else head(3, 2, 2)
    assert_exact_zero(S.descent_residual(h.u, h.a, h.v, generic_weights=generic), "E(-grad)-E(0)")


def test_gram_psd_and_trace_bound():
    h = head(3, 2, 1)
    x = sp.Matrix(sp.symbols("x_0 x_1", real=True))
    assert_exact_zero(S.gram_psd_residual(h.a, x), "x^T H x = sum c (a.x)^2")
    for k, res in S.trace_bound_residuals(r=2).items():
        assert_exact_zero(res, f"trace bound {k}")
    p, q, w = sp.symbols("p q w", real=True)
    hm = sp.Matrix([[p, q], [q, w]])
    lam = S.lambda_max_2x2(hm)
    assert sp.expand((lam * sp.eye(2) - hm).det()) == 0  # lam is an eigenvalue
    assert (lam - (p + w) / 2).is_nonnegative  # lam = mean + sqrt(...) >= lambda_min


def test_descent_bound_numeric():
    """Random PSD H and G at 60 digits: descent_change <= (lambda_max/2 - 1)||G||^2, so negative
    when lambda_max < 2."""
    g = sp.Matrix(3, 2, lambda i, k: sp.Symbol(f"G{i}{k}", real=True))
    hs = sp.Matrix(3, 3, lambda i, k: sp.Symbol(f"H{min(i, k)}{max(i, k)}", real=True))
    change = S.descent_change(g, hs)
    syms = sorted(change.free_symbols, key=str)
    f = sp.lambdify(syms, change, modules="mpmath")
    rng = random.Random(5)
    with mp.workdps(DPS):
        for trial in range(30):
            b = mp.matrix([[rng.uniform(-1, 1) for _ in range(3)] for _ in range(3)])
            hm = b * b.T * mp.mpf(rng.uniform(0.1, 1.5))
            lam = max(mp.eigsy(hm)[0])
            gm = mp.matrix([[rng.uniform(-1, 1) for _ in range(2)] for _ in range(3)])
            val = {str(sy): None for sy in syms}
            for i in range(3):
                for k in range(2):
                    val[f"G{i}{k}"] = gm[i, k]
                for k in range(i, 3):
                    val[f"H{i}{k}"] = hm[i, k]
            ch = f(*[val[str(sy)] for sy in syms])
            frob = mp.fsum(x**2 for x in gm)
            assert ch <= (lam / 2 - 1) * frob + TOL_MP
            if lam < 2:
                assert ch < 0


def test_descent_counterexample():
    ce = S.descent_counterexample()
    for k in ("H_residual", "delta_m_residual", "identity_residual", "change_residual", "formula_residual"):
        assert_exact_zero(ce[k], k)
    alpha = ce["alpha"]
    with mp.workdps(DPS):
        f_h = sp.lambdify(alpha, ce["H"], modules="mpmath")
        f_c = sp.lambdify(alpha, ce["change"], modules="mpmath")
        h3, c3, h1, c1 = f_h(3), f_c(3), f_h(1), f_c(1)
        closed = sp.lambdify(alpha, ce["closed_change"], modules="mpmath")(3)
    print(f"alpha=3: lambda_max={mp.nstr(h3, 8)} change={mp.nstr(c3, 8)}; alpha=1: "
          f"lambda_max={mp.nstr(h1, 8)} change={mp.nstr(c1, 8)}")
    assert h3 > 2 and c3 > mp.mpf("0.4")  # the unit step increases E
    assert h1 < 2 and c1 < 0  # ... and decreases it when lambda_max < 2
    assert abs(c3 - closed) <= TOL_MP


# ---------------------------------------------------------------------------------------------
# section 4: gauges
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,dim,r", [(1, 3, 2), (2, 3, 2), (3, 3, 2)])
def test_gauge_readout_invariant(n, dim, r):
    h = head(n, dim, r)
    g = sp.Matrix(dim, 1, sp.symbols(f"g_0:{dim}", real=True))
    assert_exact_zero(S.gauge_residual(h.u, h.a, h.v, g), f"gauge N={n}")


def test_maxkey_gauge_weights():
    h = head(3, 3, 1)
    assert_exact_zero(S.maxkey_gauge_residuals(h.u, h.a), "max-key weights")


@pytest.mark.parametrize("n", [2, 3])
def test_pairwise_readout_and_translation(n):
    h = head(n, 3, 2)
    t = sp.Matrix(3, 1, sp.symbols("t_0:3", real=True))
    assert_exact_zero(S.pairwise_residual(h.u, h.a, h.v), f"pairwise readout N={n}")
    assert_exact_zero(S.pairwise_translation_residual(h.u, h.a, h.v, t), f"pairwise translation N={n}")
    # the original-gauge matrix is NOT translation invariant (mutation guard, at 60 digits)
    moved = tuple(aj + t for aj in h.a)
    change = S.delta_m(h.u, moved, h.v) - S.delta_m(h.u, h.a, h.v)
    assert nonzero_somewhere(change, h.symbols() + list(t)) > mp.mpf("1e-4")


# ---------------------------------------------------------------------------------------------
# section 5: RoPE
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def rope_facts_cached():
    return S.rope_facts()


@pytest.mark.parametrize("name", ["phi1_integral", "phi1_series", "phi1_secant", "rotation_is_exp",
                                  "finite_difference", "position_step", "relative_position",
                                  "orthogonal", "derivative_1", "derivative_2", "derivative_3"])
def test_rope_facts(name):
    assert_exact_zero(rope_facts_cached()[name], f"rope {name}")


def test_rope_mutations_fail():
    al = sp.Symbol("alpha", real=True, nonzero=True)
    j2 = sp.Matrix(S.J2)
    wrong = sp.sin(al) / al * sp.eye(2) + (1 + sp.cos(al)) / al * j2
    assert S.reduce_exact(al * j2 * wrong - ((al * j2).exp() - sp.eye(2))) != sp.zeros(2, 2)
    w, p, q = sp.symbols("omega p q", positive=True)
    r = S.rope_rotation
    assert S.reduce_exact(r(p, [w]).T * r(q, [w]) - r(p - q, [w])) != sp.zeros(2, 2)


def test_rope_bridge_exact_and_fast():
    """phi1(alpha J2) closed form (lambdified) vs exact.phi1_matrix at 60 digits, and the
    symbolic R(p), A, phi_1(delta A) vs exact.rotation / exact.generator (interleaved pairs,
    omega_l = base^(-2l/d)) and fast.rope_rotation / fast.rope_phi1 in float64."""
    from ropestep import exact, fast
    from ropestep.spec import HeadSpec, RoPESpec

    al, p, delta = sp.symbols("alpha p delta", real=True)
    f_phi = sp.lambdify(al, entries(S.phi1_rot(al)), modules="mpmath")
    base, d = 10.0, 4
    with mp.workdps(DPS):
        om = exact.frequencies(base, d)
        worst = mp.mpf(0)
        for x in ("0.3", "-1.7", "2.5", "40"):
            a = mp.mpf(x)
            ref = exact.phi1_matrix(a * mp.matrix([[0, -1], [1, 0]]))
            worst = max(worst, max_abs([g - e for g, e in zip(f_phi(a), ref)]))
        oms = sp.symbols("w_1 w_2", positive=True)
        f_rot = sp.lambdify((p, *oms), entries(S.rope_rotation(p, oms)), modules="mpmath")
        f_gen = sp.lambdify(oms, entries(S.rope_generator(oms)), modules="mpmath")
        f_fd = sp.lambdify((delta, *oms), entries(S.phi1_rope(delta, oms)), modules="mpmath")
        for pp in (mp.mpf(3), mp.mpf("17.25")):
            ref = exact.rotation(pp, base, d, "interleaved")
            worst = max(worst, max_abs([g - e for g, e in zip(f_rot(pp, *om), ref)]))
        ref = exact.generator(base, d, "interleaved")
        worst = max(worst, max_abs([g - e for g, e in zip(f_gen(*om), ref)]))
        dl = mp.mpf(5)
        ref_fd = exact.phi1_matrix(dl * exact.generator(base, d, "interleaved"))
        worst = max(worst, max_abs([g - e for g, e in zip(f_fd(dl, *om), ref_fd)]))
    spec = HeadSpec(1, 1, d, rope=RoPESpec(base=base, layout="interleaved"))
    omf = [float(x) for x in om]
    g_rot = sp.lambdify((p, *oms), entries(S.rope_rotation(p, oms)), modules="numpy")
    g_fd = sp.lambdify((delta, *oms), entries(S.phi1_rope(delta, oms)), modules="numpy")
    e64 = max(np.abs(np.array(g_rot(17.25, *omf)) - fast.rope_rotation(spec, 17.25).numpy().ravel()).max(),
              np.abs(np.array(g_fd(5.0, *omf)) - fast.rope_phi1(spec, 5.0).numpy().ravel()).max())
    print(f"RoPE symbolic vs exact (60 digits) {mp.nstr(worst, 3)}; vs fast (float64) {e64:.2e}")
    assert worst <= TOL_MP and e64 <= FLOAT64_REL


# ---------------------------------------------------------------------------------------------
# section 6: frozen reuse
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_frozen_reuse_tokenwise(n):
    h = head(n, 2, 2)
    u0 = sp.Matrix(2, 1, sp.symbols("w_0:2", real=True))
    err = S.frozen_reuse_error(h.u, u0, h.a, h.v)
    assert_exact_zero(err - S.frozen_reuse_tokenwise(h.u, u0, h.a, h.v), f"tokenwise N={n}")
    # reuse is not free: the error itself is not identically zero
    assert nonzero_somewhere(err, h.symbols() + list(u0)) > mp.mpf("1e-4")


def test_frozen_refresh():
    h = head(2, 2, 2)
    u0 = sp.Matrix(2, 1, sp.symbols("w_0:2", real=True))
    lm = sp.Matrix(2, 2, lambda i, k: sp.Symbol(f"L_{i}{k}", real=True))
    k = [sp.Matrix(1, 2, sp.symbols(f"k{j}_0:2", real=True)) for j in range(2)]
    direct, refresh = S.frozen_refresh(h.u, u0, lm, k, h.v)
    assert_exact_zero(direct - refresh, "refresh")


def test_prefix_full():
    h = head(2, 2, 2)
    a_self = sp.Matrix(2, 1, sp.symbols("as_0:2", real=True))
    v_self = sp.Matrix(1, 2, sp.symbols("vs_0:2", real=True))
    res = S.prefix_full_residuals(h.u, h.a, h.v, a_self, v_self)
    for k in ("mixture", "full_mean", "full_identity"):
        assert_exact_zero(res[k], k)
    syms = h.symbols() + list(a_self) + list(v_self)
    assert nonzero_somewhere(res["wrong_prefix_mean"], syms) > mp.mpf("1e-4")


def test_frozen_bridge_exact_layer():
    """Lambdified tokenwise error on a bank problem (shared features) vs exact.tokenwise_reuse_error,
    and the prefix/full mixture vs exact.prefix_full, at 60 digits."""
    from ropestep import exact

    p, E = exact_problem(n=3, seed=4, bank=True)
    n = E.feats.shape[2]
    h = head(n, 2, 2)
    u0 = sp.Matrix(2, 1, sp.symbols("w_0:2", real=True))
    tok = S.frozen_reuse_tokenwise(h.u, u0, h.a, h.v)
    err = S.frozen_reuse_error(h.u, u0, h.a, h.v)
    syms = h.symbols() + list(u0)
    with mp.workdps(DPS):
        u1, a, v = _features(E, 1)
        u0v, a0, _ = _features(E, 0)
        assert all(x == y for aj, bj in zip(a, a0) for x, y in zip(aj, bj))  # shared features
        vals = [*u1, *[x for aj in a for x in aj], *[x for vj in v for x in vj], *u0v]
        ref = exact.tokenwise_reuse_error(E, 0, 1, 0)
        e1 = max_abs([g - r for g, r in zip(mp_eval(tok, syms, vals), ref)])
        e2 = max_abs([g - r for g, r in zip(mp_eval(err, syms, vals), ref)])
        # prefix/full: the bank plus one more key (s_self, v_self)
        a_self = sp.Matrix(2, 1, sp.symbols("as_0:2", real=True))
        v_self = sp.Matrix(1, 2, sp.symbols("vs_0:2", real=True))
        y_full = S.softmax_output(h.u, tuple(h.a) + (a_self,), tuple(h.v) + (v_self,))
        asv, vsv = [mp.mpf("0.7"), mp.mpf("-0.2")], [mp.mpf("1.25"), mp.mpf("-3")]
        s_self = mp.fsum(x * y for x, y in zip(u1, asv))
        ref_full = exact.prefix_full(E, 0, 1, s_self, vsv)
        got = mp_eval(y_full, syms[:-2] + list(a_self) + list(v_self), [*vals[:-2], *asv, *vsv])
        e3 = max_abs([g - r for g, r in zip(got, ref_full)])
    print(f"frozen reuse vs exact: tokenwise {mp.nstr(e1, 3)} error {mp.nstr(e2, 3)} "
          f"prefix/full {mp.nstr(e3, 3)}")
    assert max(e1, e2, e3) <= TOL_MP


# ---------------------------------------------------------------------------------------------
# section 7: no global affine readout
# ---------------------------------------------------------------------------------------------
def test_convex_combination():
    h = head(3, 2, 2)
    res = S.convex_combination_residuals(h.u, h.a, h.v)
    assert res["positive"] == [True, True, True]
    for k in ("weights_sum", "combination", "above_min"):
        assert_exact_zero(res[k], k)


def test_affine_readout_limits():
    lim = S.affine_readout_limits()
    fam = S.two_key_family()
    print(lim)
    assert_exact_zero(lim["logistic_form"], "logistic form")
    assert lim["y_plus"] == fam["v_1"] and lim["y_minus"] == fam["v_2"]
    assert lim["slope"] == -fam["m_1"]  # m1 must vanish
    assert sp.expand(lim["jump"] - (fam["v_1"] - fam["v_2"])) == 0  # and then v1 = v2 is forced
    assert lim["affine_growth"] == sp.oo  # a non-zero x-part is unbounded along its direction


def test_affine_three_point_system():
    eqs, sol = S.affine_three_point_system()
    print(eqs, sol)
    assert sol == sp.EmptySet
    # the choice of points matters: symmetric points around the sigmoid's centre are collinear
    assert S.affine_three_point_system((-1, 0, 1))[1] != sp.EmptySet


@pytest.mark.parametrize("m_entries,kind", [
    ((2, 0), "unbounded"), ((-sp.Rational(1, 3), 5), "unbounded"),
    ((0, sp.Rational(1, 3)), "non_constant"), ((0, 0), "non_constant")])
def test_no_affine_readout_witness(m_entries, kind):
    a = (sp.Matrix([1, 0]), sp.Matrix([0, sp.Rational(1, 2)]), sp.Matrix([-2, 0]))
    v = (sp.Matrix([[1, 0]]), sp.Matrix([[0, 2]]), sp.Matrix([[-1, 1]]))
    m = sp.Matrix([[m_entries[0], 0], [m_entries[1], 1]])
    w = S.no_affine_readout_witness(a, v, m)
    with mp.workdps(DPS):
        gap = abs(mp.mpf(str(sp.N(w.y[0, w.coord] - w.affine[0, w.coord], DPS))))
    print(f"M x-part {m_entries[0]}: {w.kind} at u={list(w.u)}, |y - affine| = {mp.nstr(gap, 8)}")
    assert w.kind == kind
    if kind == "unbounded":
        assert w.affine[0, w.coord] == max(vj[0, w.coord] for vj in v) + 1  # exactly outside the hull
        assert gap >= 1 - TOL_MP
    else:
        assert gap > mp.mpf("1e-10")


def test_no_affine_readout_witness_constant_head_raises():
    a = (sp.Matrix([1, 0]), sp.Matrix([1, 1]))  # same x-part: y does not depend on x
    v = (sp.Matrix([[1]]), sp.Matrix([[0]]))
    y0 = S.softmax_output(sp.Matrix([0, 1]), a, v)[0, 0]
    m = sp.Matrix([[0], [y0 - sp.Rational(1, 2)]])  # the affine readout that does exist
    with pytest.raises(ValueError):
        S.no_affine_readout_witness(a, v, m)


# ---------------------------------------------------------------------------------------------
# section 8: Cosine-RoPE bound
# ---------------------------------------------------------------------------------------------
def test_cosine_bound_steps():
    h = head(3, 2, 2)
    res = S.cosine_bound_residuals(h.u, h.a, h.v)
    for k in ("centred", "ratio_form", "two_sided"):
        assert_exact_zero(res[k], k)


def test_cosine_bound_numeric():
    """Unit q^, k^ rotated by RoPE, s = q^ R k^^T / tau, at 60 digits and in float64:
    ||y - mu|| <= (e^{2/tau} - 1) max_j ||v_j - mu||, and each |p_j - 1/N| <= (e^{2/tau} - 1)/N."""
    tau_s, dev = sp.symbols("tau dev", positive=True)
    f_bound = sp.lambdify((tau_s, dev), S.cosine_bound(tau_s, dev), modules="mpmath")
    rng = np.random.default_rng(9)
    worst_ratio = 0.0
    with mp.workdps(DPS):
        for trial in range(40):
            n, d, r = int(rng.integers(1, 9)), 4, 2
            tau = mp.mpf(float(rng.choice([0.5, 1.0, 2.0, 8.0])))
            q = rng.standard_normal(d)
            k = rng.standard_normal((n, d))
            q, k = q / np.linalg.norm(q), k / np.linalg.norm(k, axis=1, keepdims=True)
            ang = rng.uniform(0, 2 * np.pi, d // 2)
            rot = np.zeros((d, d))
            for l_, t in enumerate(ang):
                c, s_ = np.cos(t), np.sin(t)
                rot[2 * l_: 2 * l_ + 2, 2 * l_: 2 * l_ + 2] = [[c, -s_], [s_, c]]
            s = [mp.mpf(float(q @ rot @ kj)) / tau for kj in k]
            # |q^ R k^| <= 1 up to float64 rounding: |fl(x . y)| <= (1 + gamma_d) |x| . |y| for
            # the dot product, each unit vector's norm within gamma_{d+3} of 1 (d squares and
            # sums, the root, the quotient), R's rows within gamma_4 (cos, sin and their 2-term
            # sums) -- products of non-negative factors: gamma_{3d+10} (nonnegative_ops_rel)
            unit = 1 + mp.mpf(nonnegative_ops_rel(3 * d + 10))
            assert all(abs(x) <= 1 / tau * unit for x in s)
            v = [[mp.mpf(float(x)) for x in rng.standard_normal(r)] for _ in range(n)]
            e = [mp.exp(x) for x in s]
            z = mp.fsum(e)
            p = [x / z for x in e]
            mu = [mp.fsum(vj[c] for vj in v) / n for c in range(r)]
            y = [mp.fsum(pj * vj[c] for pj, vj in zip(p, v)) for c in range(r)]
            lhs = mp.sqrt(mp.fsum((y[c] - mu[c]) ** 2 for c in range(r)))
            maxdev = max(mp.sqrt(mp.fsum((vj[c] - mu[c]) ** 2 for c in range(r))) for vj in v)
            bound = f_bound(tau, maxdev)
            assert all(abs(pj - mp.mpf(1) / n) <= (mp.exp(2 / tau) - 1) / n for pj in p)
            assert lhs <= bound * (1 + mp.mpf("1e-30"))
            if bound > 0:
                worst_ratio = max(worst_ratio, float(lhs / bound))
    print(f"cosine bound: max ||y - mu|| / bound over 40 draws = {worst_ratio:.3f}")


# ---------------------------------------------------------------------------------------------
# section 14: multi-head latent attention
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def latent(**kw) -> S.LatentHeads:
    return S.latent_heads(**kw)


@pytest.mark.parametrize("kw", [
    dict(),                                                    # 2 heads, 3 keys, free rotation
    dict(trig=True),                                           # R(p) = e^{pA}, symbolic p, omega
    dict(n_heads=3, n_keys=2, rank=4, rope_dim=4, nope=3, trig=True),
    dict(n_heads=2, n_keys=2, m=2),                            # the query a projection of u
], ids=["free-rotation", "trig", "rank4-rope4-nope3", "projected-query"])
def test_latent_absorption_exact(kw):
    """Every head's model score scale * [qn; R qr] . [W_uk c; R kr] equals the absorbed
    scale * [R qr; W_uk^T qn] . [R kr; c], exactly."""
    lh = latent(**kw)
    res = S.latent_absorption_residual(lh)
    assert res.shape == (lh.n_heads, lh.n_keys)
    assert_exact_zero(res, f"MLA absorption {kw}")


@pytest.mark.parametrize("fn", [S.wrong_latent_absorption_untransposed,
                                S.wrong_latent_absorption_misordered])
def test_latent_wrong_absorptions_do_not_vanish(fn):
    """Mutations: W_uk in place of W_uk^T, and the absorbed query's blocks in the other order than
    the shared key's (latent first, rope second), change the scores."""
    lh = latent()
    res = fn(lh)
    assert S.reduce_exact(res) != sp.zeros(*res.shape)
    big = nonzero_somewhere(res, lh.symbols())
    print(f"{fn.__name__}: max |residual| at random points {mp.nstr(big, 5)}")
    assert big > mp.mpf("1e-3")
    assert S.is_exactly_zero(S.latent_absorption_residual(lh))  # the right one, same symbols


@pytest.mark.parametrize("r", [1, 2])
def test_latent_identity_exact(r):
    """y_ih (softmax over the model's per-head keys, model values) = mu_ih + q'_ih T_ih with the
    shared absorbed keys, for every head, exactly."""
    lh = latent(r=r)
    res = S.latent_identity_residual(lh)
    assert res.shape == (lh.n_heads, r)
    assert_exact_zero(res, f"MLA identity H={lh.n_heads} N={lh.n_keys} r={r}")
    t = S.latent_query_space_matrix(lh, 0)
    assert t.shape == (lh.rot_q.shape[0] + lh.c[0].shape[0], r)  # (rope_dim + rank) x r


def test_latent_identity_nope_differs_from_rank():
    """nope != rank: W_uk (nope x rank) is not square, and the absorbed query has rank dims."""
    lh = latent(n_heads=1, n_keys=2, rank=2, rope_dim=2, nope=3)
    assert S.latent_absorbed_query(lh, 0).shape == (4, 1)
    assert S.latent_model_query(lh, 0).shape == (5, 1)
    assert_exact_zero(S.latent_identity_residual(lh), "MLA identity nope=3 rank=2")


def test_latent_identity_swapped_values_is_wrong():
    """Mutation: giving each head the other head's value map breaks the identity."""
    lh = latent(n_keys=2)
    res = S.wrong_latent_identity_swapped_values(lh)
    assert S.reduce_exact(res) != sp.zeros(*res.shape)
    big = nonzero_somewhere(res, lh.symbols())
    print(f"swapped value maps: max |residual| at random points {mp.nstr(big, 5)}")
    assert big > mp.mpf("1e-3")


@pytest.mark.parametrize("m,n", [(2, 2), (1, 3)])
def test_latent_input_space(m, n):
    """No query latent: q'_ih = L_ih^T u, the score is u^T a_jh with a_jh = scale L_ih k'_j, the
    identity of section 3 holds on these features and delta_m_ih = L_ih T_ih."""
    lh = latent(n_heads=1, n_keys=n, m=m)
    res = S.latent_input_space_residuals(lh)
    assert res["cheap_form"].shape == (m + 1, 1)
    for k, v in res.items():
        assert_exact_zero(v, f"MLA input space m={m} N={n}: {k}")


@pytest.mark.parametrize("kw", [dict(), dict(n_heads=1, n_keys=2, rank=4, rope_dim=2, nope=3, r=2)])
def test_latent_per_head_form(kw):
    """The model's per-head key, query and query-space matrix are the images of the absorbed ones
    under one fixed map per head, so the two readouts coincide."""
    lh = latent(**kw)
    for k, v in S.latent_per_head_form_residuals(lh, lh.n_heads - 1).items():
        assert_exact_zero(v, f"MLA per-head form {kw}: {k}")


def test_latent_input_space_needs_a_projected_query():
    with pytest.raises(ValueError):
        S.latent_query_map(latent(), 0)


def test_latent_query_latent_leaves_input_space():
    """A query latent (RMS-normed, eps = 0) makes the score constant along rays and odd in x: not
    affine (an affine function constant on rays is constant), yet not constant."""
    ray = S.latent_query_latent_ray()
    for k in ("ray", "score_ray", "odd"):
        assert_exact_zero(ray[k], f"query latent {k}")
    s = ray["s"]
    syms = sorted(s.free_symbols, key=str)
    big = nonzero_somewhere(sp.Matrix([[s]]), syms)
    print(f"query-latent score: max |s| at random points {mp.nstr(big, 5)}")
    assert big > mp.mpf("1e-3")
    # concretely: an affine s has s(2x) + s(-x) = 2 s(x/2) (three collinear points with the
    # same weights); here s(2x) = s(x/2) = s(x) and s(-x) = -s(x), so the two sides differ by
    # -2 s(x), which is non-zero wherever s is
    x = ray["x"]
    at = lambda f: s.xreplace({xi: f * xi for xi in x})  # noqa: E731
    gap = at(2) + at(-1) - 2 * at(sp.Rational(1, 2))
    assert_exact_zero(gap + 2 * s, "s(2x) + s(-x) - 2 s(x/2) = -2 s(x)")


# the mpmath bridge: a model-form forward written here, independent of ropestep.kernel
def _mla_forward(seed: int, *, query_latent: bool, dps: int = 50):
    """A random MLA layer evaluated at ``dps`` digits in the model's own form (row vectors):
    c_j = g_kv * RMS(x_j W_kc + b_kc), k^r_j = (x_j W_kr + b_kr) R(p_j)^T, per-head key
    [c_j W_uk[h], k^r_j], value c_j W_uv[h], query [q^n, q^r R(p_i)^T] from z_i W_q[h] + b_q[h],
    causal softmax with a YaRN-like scale.  Returns the model's outputs and every ingredient."""
    rng = random.Random(seed)
    H, m, rank, rope, nope, r, N, q_rank = 3, 5, 4, 4, 3, 2, 5, 3
    eps = mp.mpf("1e-6")

    def mat(rows, cols, s=1.0):
        return mp.matrix([[mp.mpf(rng.gauss(0, s)) for _ in range(cols)] for _ in range(rows)])

    def row(cols, s=1.0):
        return mat(1, cols, s)

    def rms(a, g):
        ms = mp.fsum(a[0, k] ** 2 for k in range(a.cols)) / a.cols
        return mp.matrix([[g[0, k] * a[0, k] / mp.sqrt(ms + eps) for k in range(a.cols)]])

    def rot(p, freqs):  # R(p) on adjacent pairs, acting on rows as z R(p)^T
        R = mp.zeros(2 * len(freqs), 2 * len(freqs))
        for ell, w in enumerate(freqs):
            c, s = mp.cos(p * w), mp.sin(p * w)
            R[2 * ell, 2 * ell], R[2 * ell, 2 * ell + 1] = c, -s
            R[2 * ell + 1, 2 * ell], R[2 * ell + 1, 2 * ell + 1] = s, c
        return R

    def cat(*rows_):
        return mp.matrix([[x for rw in rows_ for x in rw]])

    with mp.workdps(dps):
        X = mat(N, m)
        freqs = [mp.mpf(10000) ** (-mp.mpf(2 * ell) / rope) for ell in range(rope // 2)]
        mscale = mp.mpf("0.1") * mp.log(40) + 1  # YaRN's mscale at factor 40
        scale = mscale**2 / mp.sqrt(nope + rope)
        W_kc, b_kc, g_kv = mat(m, rank, 0.6), row(rank, 0.3), row(rank, 0.3)
        g_kv = mp.matrix([[1 + x for x in g_kv]])
        W_kr, b_kr = mat(m, rope, 0.5), row(rope, 0.3)
        W_uk = [mat(rank, nope, 0.6) for _ in range(H)]  # row form: k^n = c W_uk[h]
        W_uv = [mat(rank, r) for _ in range(H)]
        q_in = q_rank if query_latent else m
        W_q = [mat(q_in, nope + rope, 0.5) for _ in range(H)]
        b_q = [row(nope + rope, 0.3) for _ in range(H)]
        W_qa, b_qa, g_qa = mat(m, q_rank, 0.6), row(q_rank, 0.3), row(q_rank, 0.3)
        g_qa = mp.matrix([[1 + x for x in g_qa]])
        xs = [X[j, :] for j in range(N)]
        c = [rms(xj * W_kc + b_kc, g_kv) for xj in xs]
        kr = [(xj * W_kr + b_kr) * rot(j, freqs).T for j, xj in enumerate(xs)]
        z = [rms(xj * W_qa + b_qa, g_qa) if query_latent else xj for xj in xs]
        out = {"y": {}, "q": {}, "s": {}}
        for h in range(H):
            for i in range(N):
                qh = z[i] * W_q[h] + b_q[h]
                qn, qr = qh[0, :nope], qh[0, nope:] * rot(i, freqs).T
                q = cat(qn, qr)
                s = [scale * mp.fsum(a * b for a, b in zip(q, cat(c[j] * W_uk[h], kr[j])))
                     for j in range(i + 1)]
                e = [mp.exp(x) for x in s]
                v = [c[j] * W_uv[h] for j in range(i + 1)]
                out["y"][h, i] = [mp.fsum(ej * vj[0, k] for ej, vj in zip(e, v)) / mp.fsum(e)
                                  for k in range(r)]
                out["q"][h, i] = (qn, qr)
                out["s"][h, i] = s
        out.update(dict(H=H, N=N, r=r, rope=rope, nope=nope, rank=rank, m=m, scale=scale,
                        x=xs, c=c, kr=kr, W_uk=W_uk, W_uv=W_uv, W_q=W_q, b_q=b_q, freqs=freqs,
                        rot=rot, cat=cat))
    return out


@pytest.mark.parametrize("query_latent", [False, True])
def test_latent_bridge_mpmath(query_latent):
    """The model-form softmax of a random MLA layer (3 heads, rank 4, rope 4, nope 3, r 2, causal
    over 5 tokens, YaRN-like scale; with and without a query latent) at 50 digits equals
    mu + q' T built in the absorbed form -- one shared key [R(p_j) k^r_j, c_j], the absorbed query
    [q^r R(p_i)^T, q^n W_uk^T] -- to 1e-40; the two forms' scores agree to 1e-40; and without a
    query latent also mu + u^T L T with the input-space map L = [W_qr R^T, W_qn W_uk^T]."""
    F = _mla_forward(7 + query_latent, query_latent=query_latent)
    cat, H, N, r = F["cat"], F["H"], F["N"], F["r"]
    worst_y = worst_s = worst_u = mp.mpf(0)
    with mp.workdps(50):
        keys = [cat(kr, c) for kr, c in zip(F["kr"], F["c"])]  # (1, rope + rank), shared
        for h in range(H):
            for i in range(N):
                qn, qr = F["q"][h, i]
                qa = cat(qr, qn * F["W_uk"][h].T)  # absorbed query
                s = [F["scale"] * mp.fsum(a * b for a, b in zip(qa, keys[j])) for j in range(i + 1)]
                worst_s = max(worst_s, max_abs([a - b for a, b in zip(s, F["s"][h, i])]))
                z = mp.fsum(mp.exp(x) for x in s)
                v = [F["c"][j] * F["W_uv"][h] for j in range(i + 1)]
                mu = [mp.fsum(vj[0, k] for vj in v) / (i + 1) for k in range(r)]
                T = mp.zeros(qa.cols, r)
                for j, x in enumerate(s):
                    cj = (mp.expm1(x) / x if x != 0 else mp.mpf(1)) / z
                    for a in range(qa.cols):
                        for k in range(r):
                            T[a, k] += F["scale"] * cj * keys[j][0, a] * (v[j][0, k] - mu[k])
                ro = [mu[k] + mp.fsum(qa[0, a] * T[a, k] for a in range(qa.cols)) for k in range(r)]
                scale_y = max(max_abs(F["y"][h, i]), mp.mpf(1))
                worst_y = max(worst_y, max_abs([a - b for a, b in zip(ro, F["y"][h, i])]) / scale_y)
                if not query_latent:  # input space: u = [x_i; 1], L = [W_qr R(p_i)^T, W_qn W_uk^T]
                    nope, m = F["nope"], F["m"]
                    Wh = mp.matrix(F["W_q"][h].tolist() + F["b_q"][h].tolist())  # (m+1, nope+rope)
                    R = F["rot"](i, F["freqs"])
                    L_r = Wh[:, nope:] * R.T
                    L_n = Wh[:, :nope] * F["W_uk"][h].T
                    L = mp.matrix([[*(L_r[row, k] for k in range(L_r.cols)),
                                    *(L_n[row, k] for k in range(L_n.cols))] for row in range(m + 1)])
                    u = cat(F["x"][i], mp.matrix([[1]]))
                    dm = L * T  # (m+1, r): the input-space Delta M_ih
                    ro_u = [mu[k] + mp.fsum(u[0, a] * dm[a, k] for a in range(m + 1))
                            for k in range(r)]
                    worst_u = max(worst_u, max_abs([a - b for a, b in zip(ro_u, F["y"][h, i])]) / scale_y)
    print(f"MLA at 50 digits (query latent {query_latent}): max |s_model - s_absorbed| "
          f"{mp.nstr(worst_s, 3)}, max rel |y - (mu + q'T)| {mp.nstr(worst_y, 3)}, input space "
          + ("n/a (not affine in u)" if query_latent else mp.nstr(worst_u, 3)))
    assert worst_s <= TOL_MP and worst_y <= TOL_MP and worst_u <= TOL_MP
