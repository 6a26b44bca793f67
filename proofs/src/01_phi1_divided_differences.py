# %% [markdown]
# # 01 · $\varphi_1$, the exponential divided difference
#
# Every result in this suite rests on one scalar function,
#
# $$\rho(s) \;=\; \varphi_1(s) \;=\; \exp[0, s] \;=\; \frac{e^{s}-1}{s} \;=\; \int_0^1 e^{ts}\,dt,
# \qquad \rho(0) = 1 .$$
#
# **Claims** (docs/math.md §2).
# 1. The three expressions agree, the singularity at $0$ is removable with $\rho(0)=1$, and
#    $\rho(s) = \sum_{k\ge 0} s^k/(k+1)!$.
# 2. $e^{s}-1 = s\,\rho(s)$ — the step that turns the softmax into a gradient step.
# 3. $\rho(s) > 0$ for every real $s$.
# 4. Two-point form: $\exp[a,b] = \dfrac{e^{a}-e^{b}}{a-b} = e^{b}\rho(a-b)$, symmetric in $a, b$.
#
# **Numerics.** $(e^s-1)/s$ loses about $|\log_{10}|s||$ digits near $0$ (cancellation in the
# numerator); `expm1(s)/s` is accurate to an ulp or two.  `expm1` overflows above
# $s \approx 709.78$ in float64 although $\rho$ itself is finite up to $s \approx 716$;
# `ropestep.fast.phi1` evaluates $e^{s/2}\cdot(e^{s/2}/s)$ there.
#
# The symbolic part calls `ropestep.symbolic`; the numeric part compares `ropestep.fast`
# (torch) with `ropestep.exact` (mpmath at 60 digits).

# %% include _setup.py

# %% [markdown]
# ## Symbolic facts
#
# `symbolic.rho_facts()` returns each claim as a *residual* (left side minus right side);
# `symbolic.reduce_exact` rewrites exponentials as monomials in fresh symbols and expands the
# numerator over a common denominator, so a returned $0$ is a proof, not a numerical coincidence.

# %%
s, t = sp.symbols("s t", real=True)
show(r"\rho(s)", symbolic.rho(s))
show(r"\int_0^1 e^{ts}\,dt", sp.integrate(sp.exp(t * s), (t, 0, 1)))
show(r"\rho(s)", symbolic.rho_series(s, 6) + sp.O(s**6))
show(r"\exp[a,b]", symbolic.exp_dd(*sp.symbols("a b")))

facts = symbolic.rho_facts()
reduced = {name: symbolic.reduce_exact(res) for name, res in facts.items()}
for name, res in facts.items():
    print(f"{name:15s} residual reduces to {reduced[name]}")

# %% [markdown]
# Positivity: $\rho(s) = \int_0^1 e^{ts}dt$ integrates a positive function over an interval of
# length one; independently, for $s>0$ every term of the series is positive (and the first is
# $1$), and for $s<0$ the reflection $\rho(s) = e^{s}\rho(-s)$ (a residual above) reduces to the
# positive case.  `symbolic.rho_positivity()` asks SymPy's assumption system for each sign.

# %%
positivity = symbolic.rho_positivity()
for name, ok in positivity.items():
    print(f"{name:24s} {ok}")

# %% [markdown]
# ## Numeric cross-check: torch against mpmath
#
# A grid that includes the hard cases: $s = 0$, $|s| \le 10^{-12}$, the float64 `expm1`
# overflow edge, and very negative scores.  The reference is `exact.phi1` at 60 digits
# evaluated at the *same* (rounded) input; errors are in ulps of the result.

# %%
grid = [0.0, 1e-300, -1e-300, 1e-12, -1e-12, 1e-8, -1e-8, 1e-4, -1e-4, 0.5, -0.5, 1.0, -1.0,
        10.0, -10.0, 40.0, 40.5, -30.0, -100.0, 100.0, -745.0, -1e4, -1e300, 700.0, 709.0,
        715.0, 716.0]


def ulp_errors(values, dtype):
    x = torch.tensor(values, dtype=dtype)
    got = fast.phi1(x)
    out = []
    with mp.workdps(DPS):
        for xi, gi in zip(x.tolist(), got.tolist()):  # xi: the rounded input, exactly
            ref = exact.phi1(xi)
            out.append(float(abs(mp.mpf(gi) - ref) / ref) / torch.finfo(dtype).eps)
    return x, got, out


x64, rho64, ulp64 = ulp_errors(grid, torch.float64)
grid32 = [v for v in grid if -1e30 < v < 85]  # float32 range of rho: below ~88.7
x32, rho32, ulp32 = ulp_errors(grid32, torch.float32)
print(f"{'s':>10s} {'fast.phi1 (float64)':>24s} {'err64/ulp':>9s}")
for s_, r_, e_ in zip(x64.tolist(), rho64.tolist(), ulp64):
    print(f"{s_:10.3g} {r_:24.17g} {e_:9.2f}")
print(f"max error: float64 {max(ulp64):.2f} ulp, float32 {max(ulp32):.2f} ulp "
      f"(over {len(grid)} and {len(grid32)} points)")
print("expm1(709.9) in float64:", torch.expm1(torch.tensor(709.9, dtype=torch.float64)).item(),
      "  fast.phi1(709.9) =", fast.phi1(torch.tensor(709.9, dtype=torch.float64)).item())

# %% [markdown]
# The naive quotient $(e^s-1)/s$ in float64 at small $|s|$: the relative error grows like
# $\varepsilon/|s|$, so about $|\log_{10}|s||$ digits are lost.

# %%
small = torch.tensor([1e-4, 1e-8, 1e-12, -1e-12], dtype=torch.float64)
naive = (torch.exp(small) - 1) / small
good = fast.phi1(small)
naive_err = []
with mp.workdps(DPS):
    for xi, ni, gi in zip(small.tolist(), naive.tolist(), good.tolist()):
        ref = exact.phi1(xi)
        e = float(abs(mp.mpf(ni) - ref) / ref)
        naive_err.append(e)
        print(f"s = {xi:8.0e}: naive rel. error {e:.1e} (~{max(0.0, np.log10(e / EPS64)):.1f} digits"
              f" lost);  fast.phi1 {float(abs(mp.mpf(gi) - ref) / ref):.1e}")

# %% [markdown]
# ## The two-point divided difference
#
# `fast.exp_dd(a, b)` evaluates $e^{\max}\,\rho(\min-\max)$ so that $\rho$ only sees
# non-positive arguments.  Against `exact.exp_dd`, including $a=b$ (where
# $\exp[a,a]=e^{a}$) and nearly equal arguments, where the naive quotient cancels.

# %%
rng = np.random.default_rng(1)
a = rng.uniform(-40, 10, 200)
b = np.concatenate([a[:50], a[50:100] + 1e-13, rng.uniform(-40, 10, 100)])  # equal, close, far
dd = fast.exp_dd(torch.tensor(a), torch.tensor(b))
dd_swapped = fast.exp_dd(torch.tensor(b), torch.tensor(a))
with mp.workdps(DPS):
    ref = [exact.exp_dd(x, y) for x, y in zip(a.tolist(), b.tolist())]
    dd_err = max(float(abs(mp.mpf(g) - r) / r) for g, r in zip(dd.tolist(), ref))
    equal_err = max(float(abs(exact.exp_dd(x, x) - mp.exp(x)) / mp.exp(x)) for x in a[:5].tolist())
naive_dd = (np.exp(a[50:100]) - np.exp(b[50:100])) / (a[50:100] - b[50:100])
naive_dd_err = max(abs(n - float(r)) / float(r) for n, r in zip(naive_dd, ref[50:100]))
print(f"fast.exp_dd vs exact: max rel. error {dd_err:.2e} = {dd_err / EPS64:.1f} ulp")
print(f"symmetry |exp[a,b] - exp[b,a]|: {float((dd - dd_swapped).abs().max()):.1e}")
print(f"exact.exp_dd(a, a) vs e^a at 60 digits: {equal_err:.1e}")
print(f"naive quotient at |a-b| = 1e-13: max rel. error {naive_dd_err:.1e}")

# %% [markdown]
# ## Assertions
#
# Tolerances: `fast.phi1` is one `expm1` and one division (or two `exp`s, a division and a
# product on the large branch), each correctly rounded to within an ulp, so a handful of ulps
# bounds it; `exp_dd` adds one `exp` and one product.

# %%
assert all(r == 0 for r in reduced.values()), reduced
assert all(v is True for v in positivity.values()), positivity
assert max(ulp64) <= 4 and max(ulp32) <= 4, (max(ulp64), max(ulp32))
assert bool((rho64 > 0).all()) and bool((rho32 > 0).all())
assert bool(torch.isfinite(rho64).all()), "phi1 must stay finite up to s = 716 in float64"
assert not np.isfinite(torch.expm1(torch.tensor(709.9, dtype=torch.float64)).item())
assert naive_err[2] > 1e4 * EPS64, "the naive quotient should lose >= 4 digits at s = 1e-12"
assert dd_err <= 8 * EPS64 and float((dd - dd_swapped).abs().max()) == 0.0
assert equal_err < mp.mpf(10) ** (-DPS + 5)
assert naive_dd_err > 1e-5
print("all assertions passed")
