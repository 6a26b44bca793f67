# %% [markdown]
# # 07 · No global affine readout
#
# The identity $y_i = \mu_i + u_i^\top\Delta M_i$ is exact *per query*: $\Delta M_i$ depends on $u_i$
# through the coefficients $c_{ij}$.  Could one fixed matrix serve every query?
#
# **Theorem** (docs/math.md §7).  Fix a finite bank (features $a_j$, values $v_j$, mean $\mu$) and let
# $y(u)$ be the head output for the query $u = [x;1]$.  If $y$ is not constant in $x$, there is no
# $M \in \mathbb R^{(m+1)\times r}$ with $y(u) = \mu + u^\top M$ for all $x \in \mathbb R^m$.
#
# **Proof.**  $y(u) = \sum_j p_j(u)\,v_j$ with $p_j = e^{s_j}/Z > 0$ and $\sum_j p_j = 1$: $y$ lies in
# the convex hull of the values, so it is bounded.  Stack $M = [M_x;\, m_0^\top]$ (the $x$-rows, then the
# bias row); then $\mu + u^\top M = \mu + m_0 + M_x^\top x$ is bounded on $\mathbb R^m$ only
# if $M_x = 0$, in which case it is the constant $\mu + m_0$.  A non-constant $y$ cannot equal
# either. $\square$
#
# **Witness.**  Given any $M$: if $M_x \ne 0$, move $x$ along a direction where $M_x^\top x$ grows
# until the affine readout leaves the hull (the error is then certified by the hull alone); if
# $M_x = 0$, any query whose output differs from the constant refutes it.  In particular the query's
# *own* matrix $\Delta M_0$, exact at $u_0$, fails far from $u_0$.

# %% include _setup.py

# %% [markdown]
# ## Symbolic
#
# The convex-combination facts (`convex_combination_residuals`, three keys), then the two-key family
# of `symbolic.two_key_family` with one-dimensional $x$: its limits at $x\to\pm\infty$ are the two
# values, the slope of the residual forces $m_1 = 0$, and the remaining jump $v_1 - v_2$ refutes
# every $M$ (`affine_readout_limits`).  For the concrete sigmoid head, asking for an affine readout
# at three points gives an inconsistent linear system (`affine_three_point_system`).

# %%
h3 = symbolic.symbolic_head(3, dim=2, r=1)
convex = symbolic.convex_combination_residuals(h3.u, h3.a, h3.v)
convex_ok = {k: (val if k == "positive" else symbolic.is_exactly_zero(val)) for k, val in convex.items()}
print(convex_ok)

family = symbolic.two_key_family()
show(r"y(x)", family["y"])
limits = symbolic.affine_readout_limits()
for name, val in limits.items():
    if name.endswith("_form"):
        print(f"{name}: reduces to {symbolic.reduce_exact(val)}")
    else:
        show(r"\text{%s}" % name.replace("_", r"\_"), val)
equations, solutions = symbolic.affine_three_point_system()
for eq in equations:
    show(sp.latex(eq))
print("solutions (m_1, m_0):", solutions)

# %% [markdown]
# An exact witness for a concrete three-key bank with rational features and values, refuting the
# matrix $\Delta M(u_0)$ that *is* exact at $u_0 = [\tfrac12; 1]$ (`no_affine_readout_witness`):

# %%
a_bank = (sp.Matrix([1, 0]), sp.Matrix([-1, sp.Rational(1, 2)]), sp.Matrix([sp.Rational(1, 3), -1]))
v_bank = (sp.Matrix([[1, 0]]), sp.Matrix([[0, 1]]), sp.Matrix([[-1, 2]]))
u0 = sp.Matrix([sp.Rational(1, 2), 1])
M_own = symbolic.delta_m(u0, a_bank, v_bank)
own_exact = symbolic.is_exactly_zero(
    symbolic.softmax_output(u0, a_bank, v_bank)
    - symbolic.readout(u0, M_own, symbolic.uniform_mean(v_bank)))
witness_sym = symbolic.no_affine_readout_witness(a_bank, v_bank, M_own)
gap_sym = sp.N(witness_sym.affine - witness_sym.y, 30)
print(f"dM(u0) is exact at u0: {own_exact};  witness kind: {witness_sym.kind}")
print(f"at x = {sp.N(witness_sym.u[0], 12)}:  y = {list(sp.N(witness_sym.y, 12))},"
      f"  mu + u^T M = {list(sp.N(witness_sym.affine, 12))}")

# %% [markdown]
# ## Numeric: a random RoPE head
#
# A bank of six keys (positions $0..5$) read at position 6, two heads.  `exact.readout_witness`
# takes any $M$ and returns a query where the affine readout fails, with the error evaluated at 60
# digits and, when $M_x \neq 0$, a certified lower bound from the hull.  Two candidates: the exact
# matrix $\Delta M_0$ of a query $x_0$, and the same matrix with its $x$-part zeroed.

# %%
m, N = 4, 6
spec, weights = random_head(41, m=m, d=4, r=3, n_heads=2)
rng = np.random.default_rng(42)
xk, x0 = rng.standard_normal((N, m)), rng.standard_normal((1, m))
pk, p_query = np.arange(N), N
E0 = exact.build(spec, weights, x0, [p_query], xk, pk, "bank", dps=DPS)
head = 1
M0 = exact.delta_m(E0, head, 0)
with mp.workdps(DPS):
    at_x0 = max(abs(a - b) for a, b in zip(exact.readout(E0, head, 0, M0), E0.y[head, 0]))
M0_np = np.array(M0.tolist(), dtype=object)
M_flat = M0_np.copy()
M_flat[:m] = mp.mpf(0)  # x-part zero: a constant readout
witnesses = {"dM_0": exact.readout_witness(spec, weights, xk, pk, p_query, M0_np, head=head),
             "dM_0 with M_x = 0": exact.readout_witness(spec, weights, xk, pk, p_query, M_flat, head=head)}
print(f"at x_0 itself: |y - mu - u^T dM_0| = {mp.nstr(at_x0, 3)}")
for name, wit in witnesses.items():
    print(f"{name:18s}: {wit.how}\n{'':20s}error {mp.nstr(wit.error, 6)}, certified >= {mp.nstr(wit.certified, 6)},"
          f" |x| = {float(np.linalg.norm([float(t) for t in wit.u[:-1]])):.2f}")

# %% [markdown]
# ### Along a ray: bounded output, linear readout
#
# Queries $x_0 + t\,\xi$ at the same position; `fast.frozen_reuse` with the $t = 0$ query as anchor
# gives $\mu + u^\top\Delta M_0$ for all of them.  The output stays within the per-coordinate range of
# the values; the frozen readout leaves it.

# %%
import matplotlib.pyplot as plt

ts = np.linspace(0, 12, 49)
xi = rng.standard_normal(m)
xq = x0 + ts[:, None] * xi
st = fast.step(spec, weights, xq, np.full(len(ts), p_query), xk, pk, "bank")
frozen = fast.frozen_reuse(st, anchor=0).frozen  # (H, T, r)
v = st.extras["projected"].v  # (H, N, r)
vmin, vmax = v.amin(1, keepdim=True), v.amax(1, keepdim=True)
inside = bool(((st.y >= vmin - 1e-12) & (st.y <= vmax + 1e-12)).all())
frozen_out = bool(((frozen < vmin) | (frozen > vmax)).any(-1)[head, -1])
print(f"y inside the value range for every t: {inside};  frozen readout outside at t = {ts[-1]}: {frozen_out}")

fig, ax = plt.subplots(figsize=(5.5, 3.2))
for q in range(spec.r):
    ax.plot(ts, st.y[head, :, q], f"C{q}-", label=f"$y$ coord {q}")
    ax.plot(ts, frozen[head, :, q], f"C{q}--", lw=1)
    ax.axhspan(float(vmin[head, 0, q]), float(vmax[head, 0, q]), color=f"C{q}", alpha=0.06)
ax.set(xlabel=r"$t$ in $x_0 + t\,\xi$", ylabel="output", title=r"solid: $y(u)$; dashed: $\mu + u^\top\Delta M_0$")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Assertions

# %%
assert all(v is True or v == [True] * 3 for v in convex_ok.values()), convex_ok
fam = family
assert limits["y_plus"] == fam["v_1"] and limits["y_minus"] == fam["v_2"]
assert limits["slope"] == -fam["m_1"] and limits["jump"] == fam["v_1"] - fam["v_2"]
assert all(symbolic.reduce_exact(val) == 0 for name, val in limits.items() if name.endswith("_form"))
assert solutions == sp.EmptySet
assert own_exact and witness_sym.kind == "unbounded" and max(abs(g) for g in gap_sym) > 0.5
assert at_x0 < mp.mpf(10) ** (-DPS + 5)
w_own, w_flat = witnesses["dM_0"], witnesses["dM_0 with M_x = 0"]
assert w_own.certified >= 1 and w_own.error >= w_own.certified
assert w_flat.error > 1e-3
assert inside and frozen_out
print("all assertions passed")
