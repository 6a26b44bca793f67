# %% [markdown]
# # 02 · The identity $y_i = \mu_i + u_i^\top \Delta M_i$
#
# **Setting** (docs/math.md §1).  One head, one query $i$ with permitted keys $I_i$,
# $N_i = |I_i| \ge 1$.  The query's augmented input is $u_i = [x_i; 1] \in \mathbb R^{m+1}$;
# biases sit in the last row of $\hat W_q = [W_q; b_q^\top]$.  With RoPE rotations
# $R(p) = e^{pA}$, $\tau = \sqrt d$ and $L_i = \hat W_q R(p_i)^\top/\tau$, the score is
# $s_{ij} = u_i^\top a_{ij}$ with feature $a_{ij} = L_i \tilde k_j^\top$.
# The head output is $y_i = \sum_j e^{s_{ij}} v_j / Z_i$, $Z_i = \sum_j e^{s_{ij}}$, and
# $\mu_i = \frac1{N_i}\sum_j v_j$ is the *uniform* mean.
#
# **Theorem** (exact; the softmax is not linearised).  With $c_{ij} = \rho(s_{ij})/Z_i > 0$,
#
# $$\Delta M_i = \sum_{j\in I_i} c_{ij}\, a_{ij}\,(v_j-\mu_i)^\top \in \mathbb R^{(m+1)\times r},
# \qquad y_i = \mu_i + u_i^\top \Delta M_i .$$
#
# **Proof.**  The centred values sum to zero, and $\sum_j e^{s_{ij}}/Z_i = 1$, so
# $$y_i-\mu_i = \frac1{Z_i}\sum_j e^{s_{ij}}(v_j-\mu_i) = \frac1{Z_i}\sum_j (e^{s_{ij}}-1)(v_j-\mu_i)
# = \sum_j \frac{s_{ij}\,\rho(s_{ij})}{Z_i}(v_j-\mu_i) = u_i^\top\sum_j c_{ij}a_{ij}(v_j-\mu_i)^\top,$$
# using $e^{s}-1 = s\rho(s)$ (notebook 01) and $s_{ij} = u_i^\top a_{ij}$. $\square$
#
# **Cheap form.** $\Delta M_i = L_i T_i$ with $T_i = \tilde K^\top \mathrm{diag}(c_i)(V-\mu_i)$
# ($d\times r$), so $\operatorname{rank}\Delta M_i \le d$.
#
# **Only the uniform mean works.** Repeating the computation with any other centre $\mu'$ gives
# $\mu' + u_i^\top\Delta M_i(\mu') = y_i - \frac{N_i}{Z_i}(\mu_i - \mu')$.

# %% include _setup.py

# %% [markdown]
# ## Symbolic: the identity for $N = 1, \dots, 4$ keys
#
# Every entry of $u$, $a_j$, $v_j$ is an independent real symbol; `symbolic.identity_residual`
# builds $y - \mu - u^\top\Delta M$ and `symbolic.reduce_exact` reduces it to $0$.  For two keys,
# the matrix itself:

# %%
head2 = symbolic.symbolic_head(2, dim=2, r=1)
show(r"\Delta M", symbolic.delta_m(head2.u, head2.a, head2.v))

cases = [(n, 2, 1) for n in (1, 2, 3, 4)] + [(3, 3, 2)]
identity_reduced = {}
for n, dim, r in cases:
    h = symbolic.symbolic_head(n, dim=dim, r=r)
    identity_reduced[(n, dim, r)] = symbolic.reduce_exact(symbolic.identity_residual(h.u, h.a, h.v))
    print(f"N = {n}, m + 1 = {dim}, r = {r}:  y - mu - u^T dM reduces to "
          f"{list(identity_reduced[(n, dim, r)])}")

# %% [markdown]
# ## Symbolic: the proof for general $N$
#
# `symbolic.general_identity_proof()` states the chain above over symbolic sums
# $\sum_{j=1}^N$, one equality per step, each with its justification;
# `symbolic.check_proof_step` reduces each step's residual to zero.

# %%
proof = symbolic.general_identity_proof()
proof_checks = {}
for step in proof:
    proof_checks[step.name] = symbolic.check_proof_step(step)
    show(r"\text{%s:}\quad " % step.name.replace("_", r"\_") + sp.latex(step.lhs) + " = "
         + sp.latex(step.rhs) + r"\qquad\text{(%s)}" % step.reason.replace("_", r"\_"))
print({name: str(r) for name, r in proof_checks.items()})

# %% [markdown]
# Two deliberately wrong statements must *not* reduce to zero: centring on the softmax output $y$
# instead of $\mu$, and weights $e^{s_j}/Z$ instead of $\rho(s_j)/Z$.  A non-zero numerator is not
# a proof of non-vanishing, so each is also evaluated at a rational point to 30 digits.

# %%
head3 = symbolic.symbolic_head(3, dim=2, r=1)
point = {x: sp.Rational(k % 7 - 3, 3) for k, x in enumerate(head3.symbols())}
wrong_values = {}
for wrong in (symbolic.wrong_identity_softmax_mean, symbolic.wrong_identity_exp_weights):
    res = wrong(head3.u, head3.a, head3.v)
    wrong_values[wrong.__name__] = (symbolic.reduce_exact(res)[0], sp.N(res.subs(point)[0], 30))
    print(f"{wrong.__name__:28s} reduced == 0: {wrong_values[wrong.__name__][0] == 0};"
          f"  value at the point: {wrong_values[wrong.__name__][1]}")

# %% [markdown]
# ## Numeric: a random head, exact and fast
#
# Two query heads sharing one KV head (GQA), $m = 7$, $d = 4$, $r = 6$, q/k/v biases, six tokens
# with a causal mask.  `exact.build` evaluates every object at 60 digits, key by key;
# `fast.step(..., delta_m=True)` evaluates the batched torch path in float64 and float32.

# %%
m, N = 7, 6
spec, weights = random_head(2, m=m, d=4, r=6, n_heads=2, n_kv_heads=1)
x = np.random.default_rng(3).standard_normal((N, m))
pos = np.arange(N)

E = exact.build(spec, weights, x, pos, x, pos, "causal", dps=DPS)
dm_exact = exact.all_delta_m(E)  # (H, Q, m+1, r) at 60 digits
with mp.workdps(DPS):
    exact_err = max(
        abs(exact.readout(E, h, i, mp.matrix(dm_exact[h, i].tolist()))[q] - E.y[h, i, q])
        for h in range(spec.n_heads) for i in range(N) for q in range(spec.r))
print(f"exact:  max |y - mu - u^T dM| at {DPS} digits = {mp.nstr(exact_err, 3)}")

st = fast.step(spec, weights, x, pos, x, pos, "causal", delta_m=True)
st32 = fast.step(spec, weights, x, pos, x, pos, "causal", delta_m=True, dtype=torch.float32)
scale = float(st.delta_m.abs().max()) * (np.abs(x).max() + 1) * (m + 1)  # size of u^T dM terms
fast_err = {
    "float64 |y - readout|": float(st.identity_error().max()),
    "float64 readout vs exact y": float(mp_max_abs_diff(st.readout, E.y)),
    "float64 dM vs exact dM": float(mp_max_abs_diff(st.delta_m, dm_exact)),
    "float32 readout vs exact y": float(mp_max_abs_diff(st32.readout, E.y)),
}
for name, v in fast_err.items():
    print(f"fast:   {name:28s} {v:.2e}")
print(f"size of the readout's terms: {scale:.1f};  max |dM| = {float(st.delta_m.abs().max()):.1f}")

# %% [markdown]
# ### Rank: $\Delta M_i = L_i T_i$ has rank at most $d = 4 < \min(m+1, r) = 6$
#
# Singular values of the exact $\Delta M$ of the last query of head 0, at 60 digits:

# %%
with mp.workdps(DPS):
    sv = sorted(mp.svd_r(mp.matrix(dm_exact[0, N - 1].tolist()), compute_uv=False), reverse=True)
print([mp.nstr(v, 4) for v in sv])

# %% [markdown]
# ### The uniform mean is the only centre
#
# Replace $\mu_i$ by the softmax output $\mu' = y_i$ (a tempting "centre") in the exact oracle and
# rebuild $\Delta M_i$: the readout misses $y_i$ by exactly $\frac{N_i}{Z_i}(\mu_i-\mu')$.

# %%
import dataclasses

E_wrong = dataclasses.replace(E, mu=E.y.copy())  # mu' = y, everything else unchanged
h, i = 0, N - 1
with mp.workdps(DPS):
    ro_wrong = exact.readout(E_wrong, h, i, exact.delta_m(E_wrong, h, i))
    miss = [E.y[h, i, q] - ro_wrong[q] for q in range(spec.r)]
    predicted = [(i + 1) / E.Z[h, i] * (E.mu[h, i, q] - E.y[h, i, q]) for q in range(spec.r)]
    miss_size = max(abs(v) for v in miss)
    miss_formula_err = max(abs(a - b) for a, b in zip(miss, predicted))
print(f"|y - readout| with mu' = y: {mp.nstr(miss_size, 6)}   "
      f"formula (N/Z)(mu - mu') matches to {mp.nstr(miss_formula_err, 3)}")

# %% [markdown]
# ## Assertions
#
# The float64 tolerance is a rounding budget: each readout is a sum of $m+1$ products whose
# entries carry a few ulps from sums over $N$ keys, so $|{\rm err}| \le 8N(m+1)\,\varepsilon\,
# \times$ (size of the terms).  float32 gets the same budget in its own $\varepsilon$.

# %%
assert all(all(e == 0 for e in r) for r in identity_reduced.values()), identity_reduced
assert all(r == 0 for r in proof_checks.values()), proof_checks
for name, (red, val) in wrong_values.items():
    assert red != 0 and abs(val) > 1e-3, (name, red, val)
assert exact_err < mp.mpf(10) ** (-DPS + 5)
tol64, tol32 = 8 * N * (m + 1) * EPS64 * scale, 8 * N * (m + 1) * EPS32 * scale
assert fast_err["float64 |y - readout|"] < tol64
assert fast_err["float64 readout vs exact y"] < tol64
assert fast_err["float64 dM vs exact dM"] < tol64
assert fast_err["float32 readout vs exact y"] < tol32
assert fast_err["float32 readout vs exact y"] > 100 * tol64  # the float32 run really ran in float32
assert sv[3] > 1e-6 * sv[0] and sv[4] < mp.mpf(10) ** (-DPS + 5), sv  # rank exactly d = 4
assert miss_size > 1e-3 and miss_formula_err < mp.mpf(10) ** (-DPS + 5)
print("all assertions passed")
