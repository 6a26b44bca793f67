# %% [markdown]
# # 05 · RoPE: derivatives and exact positional finite differences
#
# RoPE rotates a vector $z_0$ to position $p$ by $z(p) = R(p)z_0$, $R(p) = e^{pA}$, with the
# block-diagonal generator $A = \operatorname{diag}_\ell\,\omega_\ell J_2$,
# $J_2 = \left(\begin{smallmatrix}0&-1\\ 1&0\end{smallmatrix}\right)$, $\omega_\ell = \text{base}^{-2\ell/d}$
# (docs/math.md §1, §5).
#
# **Claims.**
# 1. $\partial_p^n z(p) = A^n z(p)$, $R(p)^\top R(p) = I$ and $R(p_i)^\top R(p_j) = R(p_j-p_i)$.
# 2. The *same* $\varphi_1$ that keeps the softmax exact turns the derivative into an exact finite
#    difference: for every step $\delta$,
#    $$z(p+\delta) - z(p) = (e^{\delta A}-I)\,z(p) = \delta A\,\varphi_1(\delta A)\,z(p),$$
#    since $e^{X}-I = X\varphi_1(X)$ for every square $X$ (the power series of notebook 01).
# 3. Per $2\times2$ block, with $\alpha = \omega\delta$ and $J_2^2 = -I$:
#    $$\varphi_1(\alpha J_2) = \int_0^1 e^{t\alpha J_2}dt = \frac{\sin\alpha}{\alpha}\,I + \frac{1-\cos\alpha}{\alpha}\,J_2 .$$
#
# **Use.** $L_i = \hat W_q R(p_i)^\top/\tau$ built at position $p$ and used at $p+\delta$ needs the
# exact correction $L(p+\delta) - L(p) = \delta\,L(p)\,\bigl(A\varphi_1(\delta A)\bigr)^{\!\top}$
# (transpose claim 2; $A$ and $\varphi_1(\delta A)$ commute).

# %% include _setup.py

# %% [markdown]
# ## Symbolic
#
# `symbolic.phi1_rot` is the closed form of claim 3; `symbolic.rope_facts()` returns the residuals of
# claims 1–3 for a generator with two symbolic frequencies $\omega_1, \omega_2$ (the matrix
# exponential and the integral are SymPy's own).

# %%
alpha = sp.Symbol("alpha", real=True, nonzero=True)
show(r"\varphi_1(\alpha J_2)", symbolic.phi1_rot(alpha))
omegas = sp.symbols("omega_1 omega_2", positive=True)
show(r"A", symbolic.rope_generator(omegas))
rope_reduced = {name: symbolic.reduce_exact(res) for name, res in symbolic.rope_facts().items()}
for name, r in rope_reduced.items():
    print(f"{name:18s} -> {'0' if all(e == 0 for e in r) else r}")

# %% [markdown]
# ## Numeric: the finite-difference identity at 60 digits
#
# `exact.rope_finite_difference_residual` builds $R(p)$ pair by pair from exact cosines and sines,
# $A$ from the frequencies and $\varphi_1(\delta A)$ from its power series, and returns
# $\max|R(p+\delta) - R(p) - \delta A\varphi_1(\delta A)R(p)|$; both pair layouts (HF split halves,
# GPT-J interleaved), including the position-511 case the models use.

# %%
fd_residuals = {}
for layout in ("half", "interleaved"):
    for p, delta in ((3, 1), (511, 1), (100, -5), (0, 2)):
        with mp.workdps(DPS):
            fd_residuals[(layout, p, delta)] = exact.rope_finite_difference_residual(
                10000, 4, layout, p, delta)
        print(f"{layout:11s} p = {p:3d}, delta = {delta:+d}: residual {mp.nstr(fd_residuals[(layout, p, delta)], 3)}")

# %% [markdown]
# The derivative $\partial_p z = Az$, by mpmath's numerical differentiation of the exact rotation:

# %%
z0 = mp.matrix([0.3, -1.2, 0.7, 2.0])
with mp.workdps(DPS):
    A4 = exact.generator(10000, 4, "half")
    p0 = mp.mpf(17)
    deriv_err = max(
        abs(mp.diff(lambda p: (exact.rotation(p, 10000, 4, "half") * z0)[k], p0)
            - (A4 * exact.rotation(p0, 10000, 4, "half") * z0)[k]) for k in range(4))
print(f"max |d/dp z(p) - A z(p)| at p = 17: {mp.nstr(deriv_err, 3)}")

# %% [markdown]
# ## Numeric: torch against mpmath, per-head bases
#
# A layer with two heads with different RoPE bases (10000 and 500, per-head bases as in
# `seeds/per-head-rope-base.txt`) and $d = 8$.  `fast.rope_phi1` (closed form, with
# $(1-\cos\alpha)/\alpha = 2\sin^2(\alpha/2)/\alpha$ to avoid cancellation) against
# `exact.phi1_matrix` (power series at 60 digits) for a moderate, a tiny and a negative step; then
# `fast.rope_finite_difference` against a difference of `fast.rope_rotation`s up to $\delta = 1000$,
# where the closed form is evaluated directly.

# %%
spec = HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8,
                rope=RoPESpec(base=(10000.0, 500.0), layout="half"))
phi_err, fd_err = {}, {}
for h in range(2):
    base = spec.rope.bases(2)[h]
    for delta in (1.0, 1e-9, -7.0):
        with mp.workdps(DPS):
            ref = exact.phi1_matrix(delta * exact.generator(base, 8, "half"))
        phi_err[(h, delta)] = float(mp_max_abs_diff(fast.rope_phi1(spec, delta, head=h), ref))
    z = torch.tensor(np.random.default_rng(4).standard_normal((8, 3)))  # three column vectors
    for p, delta in ((0, 1.0), (511, 1.0), (40, 1000.0), (1000, -999.0)):
        zp = fast.rope_rotation(spec, p, head=h) @ z
        step_ = fast.rope_rotation(spec, p + delta, head=h) @ z - zp
        fd_err[(h, p, delta)] = float((fast.rope_finite_difference(spec, zp, delta, head=h) - step_).abs().max())
print("fast.rope_phi1 vs exact series:  max error", f"{max(phi_err.values()):.1e}")
print("fast finite difference vs R(p+delta) z - R(p) z:  max error", f"{max(fd_err.values()):.1e}")

# %% [markdown]
# ## The exact correction of $L_i$
#
# `fast.project` computes $L_i$ (via `Projected.lmap`) for queries at $p$ and $p+\delta$; the
# correction $\delta\,L(p)\,(A\varphi_1(\delta A))^\top$ built from `fast.rope_generator` and
# `fast.rope_phi1` closes the gap to rounding.  A first-order guess $\delta L(p)A^\top$ does not.

# %%
hspec, hweights = random_head(8, m=5, d=8, r=3, n_heads=2,
                              rope=RoPESpec(base=(10000.0, 500.0), layout="half"))
x = np.random.default_rng(9).standard_normal((1, 5))
p, delta = 30, 5
L_p = fast.project(hspec, hweights, x, [p], x, [p]).lmap()[:, 0]  # (H, m+1, d)
L_pd = fast.project(hspec, hweights, x, [p + delta], x, [p + delta]).lmap()[:, 0]
corr_err, first_order_err = [], []
for h in range(2):
    A = fast.rope_generator(hspec, head=h)
    step_map = delta * A @ fast.rope_phi1(hspec, delta, head=h)
    corr_err.append(float((L_p[h] + L_p[h] @ step_map.T - L_pd[h]).abs().max()))
    first_order_err.append(float((L_p[h] + delta * L_p[h] @ A.T - L_pd[h]).abs().max()))
print(f"exact correction: max error {max(corr_err):.1e};  first-order correction: {max(first_order_err):.1e}")

# %% [markdown]
# ## Assertions

# %%
assert all(all(e == 0 for e in r) for r in rope_reduced.values()), rope_reduced
tiny = mp.mpf(10) ** (-DPS + 5)
assert all(r < tiny for r in fd_residuals.values()), fd_residuals
assert deriv_err < mp.mpf(10) ** (-DPS // 2)
assert max(phi_err.values()) < 8 * EPS64, phi_err
# |z| <= 3, angles up to ~1000 rad: cos/sin of the float64 angle p*omega carry ~ulp(angle) error
assert max(fd_err.values()) < 3 * 1000 * 8 * EPS64, fd_err
assert max(corr_err) < 1e-13 and min(first_order_err) > 1e-3, (corr_err, first_order_err)
print("all assertions passed")
