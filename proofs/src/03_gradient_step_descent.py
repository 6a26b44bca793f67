# %% [markdown]
# # 03 · $\Delta M_i$ is one gradient step — and when that step descends
#
# Hold the features $a_{ij}$, the targets $v_j-\mu_i$ and the weights $c_{ij}$ of one query
# fixed and define the weighted least-squares energy of a matrix $B \in \mathbb R^{(m+1)\times r}$,
#
# $$E_i(B) = \tfrac12\sum_{j} c_{ij}\,\bigl\|a_{ij}^\top B - (v_j-\mu_i)^\top\bigr\|^2 .$$
#
# **Claim 1** (docs/math.md §3). $\nabla E_i(B) = \sum_j c_{ij}a_{ij}(a_{ij}^\top B - (v_j-\mu_i)^\top)$,
# so $\nabla E_i(0) = -\Delta M_i$ and $\Delta M_i = 0 - 1\cdot\nabla E_i(0)$: the head output is
# the readout of one unit gradient step from $B=0$.
#
# **Claim 2.** $E_i$ is quadratic with Hessian $H_i\otimes I_r$, $H_i = \sum_j c_{ij}a_{ij}a_{ij}^\top
# \succeq 0$ (the $c_{ij}$ are positive), hence exactly
#
# $$E_i(\Delta M_i) - E_i(0) = -\|\Delta M_i\|_F^2 + \tfrac12\operatorname{tr}(\Delta M_i^\top H_i
# \Delta M_i) \;\le\; \Bigl(\tfrac{\lambda_{\max}(H_i)}{2}-1\Bigr)\|\Delta M_i\|_F^2 .$$
#
# So $\lambda_{\max}(H_i) < 2$ guarantees descent (whenever $\Delta M_i \neq 0$).  The condition is sufficient, not necessary:
# the quadratic form only sees the part of $\Delta M_i$ along the large eigenvectors.  When
# $\lambda_{\max}(H_i) > 2$ the unit step *can* increase $E_i$ — the identity is a statement about
# the gradient, not about minimising $E_i$.

# %% include _setup.py

# %% [markdown]
# ## Symbolic: gradient, Hessian, exact change of $E$
#
# Three keys, $m+1 = 2$, $r = 2$, all entries symbolic.  `gradient_residual` is
# $\nabla E(0) + \Delta M$ (with the paper's weights, and with arbitrary positive weights
# $c_j$); `hessian_residual` is $\operatorname{Hess}E - H\otimes I_r$; `descent_residual` is the
# change of $E$ minus the closed form above; `trace_bound_residuals` proves
# $\operatorname{tr}(G^\top H G) \le \lambda_{\max}\|G\|_F^2$ for a symmetric $2\times2$ $H$ by the
# spectral theorem.

# %%
head = symbolic.symbolic_head(3, dim=2, r=2)
u, a, v = head.u, head.a, head.v
grad_reduced = {
    "gradient (paper weights)": symbolic.reduce_exact(symbolic.gradient_residual(u, a, v)),
    "gradient (any weights)": symbolic.reduce_exact(
        symbolic.gradient_residual(u, a, v, generic_weights=True)),
    "hessian": symbolic.reduce_exact(symbolic.hessian_residual(a, v)),
    "descent change": symbolic.reduce_exact(symbolic.descent_residual(u, a, v)),
}
grad_reduced.update({f"trace bound: {k}": symbolic.reduce_exact(r)
                     for k, r in symbolic.trace_bound_residuals().items()})
for name, r in grad_reduced.items():
    print(f"{name:32s} -> {list(r) if isinstance(r, sp.MatrixBase) else r}")

wrong = symbolic.wrong_gradient_without_half(u, a, v)
wrong_is_minus_dm = symbolic.is_exactly_zero(wrong + symbolic.delta_m(u, a, v))
print("without the 1/2 in E:  grad E(0) + dM reduces to -dM, not 0:", wrong_is_minus_dm)

# %% [markdown]
# ### A two-key counterexample in closed form
#
# `symbolic.descent_counterexample`: $u = [1]$, $a_{1,2} = \pm\alpha$, $v_{1,2} = \pm1$.  Then
# $\Delta M = \tanh\alpha$, $H = \alpha\tanh\alpha$ and the change of $E$ after the unit step is

# %%
ce = symbolic.descent_counterexample()
show(r"E(\Delta M) - E(0)", ce["closed_change"])
ce_reduced = {k: symbolic.reduce_exact(val) for k, val in ce.items() if k.endswith("_residual")}
print({k: str(val) for k, val in ce_reduced.items()})
ce_values = {}
for alpha in (1, 3):
    sub = {ce["alpha"]: alpha}
    ce_values[alpha] = (sp.N(ce["H"].subs(sub), 20), sp.N(ce["closed_change"].subs(sub), 20))
    print(f"alpha = {alpha}:  H = {ce_values[alpha][0]:.6f},  E(dM) - E(0) = {ce_values[alpha][1]:+.6f}")

# %% [markdown]
# ## Numeric: a random head with one ascending and one descending query
#
# One layer with two query heads (one KV head), $m = 3$, $d = 4$, $r = 2$, six tokens, causal.
# `fast.descent` gives $\lambda_{\max}(H_i)$, $E_i(0)$ and $E_i(\Delta M_i)$ for every head and query;
# the first query (a single key, $\Delta M = 0$) is skipped.  Two queries are then checked in the
# exact oracle: the analytic `exact.gradient` at $B = 0$ against $-\Delta M_i$, against mpmath's
# numerical differentiation of `exact.objective`, and `exact.lam_max`.

# %%
m, N = 3, 6
spec, weights = random_head(5, m=m, d=4, r=2, n_heads=2, n_kv_heads=1, gain=1.0)
x = np.random.default_rng(7).standard_normal((N, m))
pos = np.arange(N)
st = fast.step(spec, weights, x, pos, x, pos, "causal", delta_m=True)
dc = fast.descent(st)
print("lambda_max(H_i):\n", dc.lam_max.numpy().round(3))
print("unit step descends:\n", dc.descends.numpy())

# ascending: largest lambda_max among queries whose step increases E; descending: lambda_max < 2
grid = [(h, i) for h in range(spec.n_heads) for i in range(1, N)]
up = max((hi for hi in grid if not dc.descends[hi]), key=lambda hi: float(dc.lam_max[hi]))
down = min((hi for hi in grid if dc.descends[hi]), key=lambda hi: float(dc.lam_max[hi]))
surprise = [hi for hi in grid if dc.descends[hi] and dc.lam_max[hi] > 2]
print("ascending (head, query):", up, "  descending:", down,
      "  descending although lambda_max > 2:", surprise)

# %%
E = exact.build(spec, weights, x, pos, x, pos, "causal", dps=DPS)
checks = {}
for label, (h, i) in (("ascending", up), ("descending", down)):
    with mp.workdps(DPS):
        dm = exact.delta_m(E, h, i)
        zero = mp.zeros(m + 1, spec.r)
        g = exact.gradient(E, h, i, zero)
        g_num = exact.numeric_gradient(E, h, i, zero)
        lam = exact.lam_max(E, h, i)
        e0, e1 = exact.objective(E, h, i, zero), exact.objective(E, h, i, dm)
        res = {
            "|grad E(0) + dM|": mp_max_abs_diff(g, -dm),
            "|analytic - numerical grad|": mp_max_abs_diff(g, g_num),
            "lambda_max": lam, "E(0)": e0, "E(dM)": e1,
            "fast lambda_max rel err": abs(lam - dc.lam_max[h, i].item()) / lam,
            "fast E(dM) rel err": abs(e1 - dc.e1[h, i].item()) / e1,
        }
    checks[label] = res
    print(f"{label} (head {h}, query {i}):")
    for k, val in res.items():
        print(f"    {k:28s} {mp.nstr(val, 6)}")

# %% [markdown]
# ## The bound across many heads
#
# For heads with growing query/key gain, every query's exact change ratio
# $(E(\Delta M)-E(0))/\|\Delta M\|_F^2$ lies below the line $\lambda_{\max}/2-1$ (and above
# $-1$, since $H \succeq 0$).  Points in the upper-left quadrant would contradict Claim 2; points
# to the right of $\lambda_{\max}=2$ and above $0$ are ascending unit steps.

# %%
import matplotlib.pyplot as plt

lams, ratios = [], []
for seed, gain in enumerate(np.repeat([0.3, 0.7, 1.0, 1.4, 2.0], 3)):
    sp_, w_ = random_head(100 + seed, m=m, d=4, r=2, gain=gain)
    st_ = fast.step(sp_, w_, x, pos, x, pos, "causal", delta_m=True)
    dc_ = fast.descent(st_)
    fro2 = (st_.delta_m ** 2).sum((-1, -2))
    keep = fro2 > 0
    lams.append(dc_.lam_max[keep])
    ratios.append(((dc_.e1 - dc_.e0) / fro2)[keep])
lams, ratios = torch.cat(lams).numpy(), torch.cat(ratios).numpy()
slack = ratios - (lams / 2 - 1)
print(f"{lams.size} queries; max of ratio - (lambda_max/2 - 1) = {slack.max():.2e}; "
      f"ascending: {(ratios > 0).sum()}, all with lambda_max > 2: {bool((lams[ratios > 0] > 2).all())}")

fig, ax = plt.subplots(figsize=(5.5, 3.5))
grid_l = np.logspace(np.log10(lams.min()), np.log10(lams.max()), 200)
ax.plot(grid_l, grid_l / 2 - 1, "k-", lw=1, label=r"$\lambda_{\max}/2 - 1$")
ax.scatter(lams, ratios, s=10, c=np.where(ratios > 0, "C3", "C0"))
ax.axhline(0, color="gray", lw=0.5)
ax.axvline(2, color="gray", lw=0.5, ls="--")
ax.set(xscale="log", yscale="symlog", xlabel=r"$\lambda_{\max}(H_i)$",
       ylabel=r"$(E(\Delta M)-E(0))/\|\Delta M\|_F^2$")
ax.legend(loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Assertions

# %%
tiny = mp.mpf(10) ** (-DPS + 8)
for name, r in grad_reduced.items():
    assert (all(e == 0 for e in r) if isinstance(r, sp.MatrixBase) else r == 0), name
assert wrong_is_minus_dm
assert all(val == 0 for val in ce_reduced.values()), ce_reduced
assert ce_values[3][0] > 2 and ce_values[3][1] > 0, ce_values  # alpha = 3: H > 2, E increases
assert ce_values[1][0] < 2 and ce_values[1][1] < 0, ce_values  # alpha = 1: descends
for label, res in checks.items():
    assert res["|grad E(0) + dM|"] < tiny, label
    assert res["|analytic - numerical grad|"] < mp.mpf(10) ** (-DPS // 2), label
    assert res["fast lambda_max rel err"] < 1e-12 and res["fast E(dM) rel err"] < 1e-12, label
assert checks["ascending"]["lambda_max"] > 2 and checks["ascending"]["E(dM)"] > checks["ascending"]["E(0)"]
assert checks["descending"]["lambda_max"] < 2 and checks["descending"]["E(dM)"] < checks["descending"]["E(0)"]
assert slack.max() < 1e-9 and ratios.min() >= -1 - 1e-9
assert (ratios > 0).any() and (lams[ratios > 0] > 2).all()
print("all assertions passed")
