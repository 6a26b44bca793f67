# %% [markdown]
# # 04 · Gauges: many matrices, one readout — and which one to compute in
#
# **Claim** (docs/math.md §4).  Fix any $g \in \mathbb R^{m+1}$ and put $\sigma_i = u_i^\top g$.  With
#
# $$c^g_{ij} = \frac{e^{\sigma_i}\rho(s_{ij}-\sigma_i)}{Z_i}, \qquad
# \Delta M^g_i = \sum_j c^g_{ij}\,(a_{ij}-g)(v_j-\mu_i)^\top ,$$
#
# the readout is unchanged: $y_i = \mu_i + u_i^\top\Delta M^g_i$.
#
# **Proof.** $u_i^\top(a_{ij}-g) = s_{ij}-\sigma_i$ and
# $e^{\sigma}\rho(s-\sigma)(s-\sigma) = e^{s}-e^{\sigma}$, so
# $u_i^\top\Delta M^g_i = \frac1{Z_i}\sum_j (e^{s_{ij}} - e^{\sigma_i})(v_j-\mu_i)$; the
# $e^{\sigma_i}$ term multiplies $\sum_j (v_j-\mu_i) = 0$, and what is left is $y_i-\mu_i$. $\square$
#
# Three gauges matter:
# * **original**, $g=0$ (the paper's);
# * **max-key**, $g = a_{ij^*}$ with $j^* = \arg\max_j s_{ij}$: $c^g_{ij} = \rho(s_{ij}-s_{\max})/\bar Z_i$,
#   $\bar Z_i = \sum_j e^{s_{ij}-s_{\max}} \in [1, N_i]$.  Every coefficient lies in $(0, 1]$: nothing
#   overflows and nothing cancels, however negative the scores;
# * **pairwise**, the average of the key gauges $g = a_{ik}$ over $k$.  Symmetrising the double sum
#   gives $\Delta M^{\rm pair}_i = \frac{1}{2N_iZ_i}\sum_{j,k}\exp[s_{ij},s_{ik}](a_{ij}-a_{ik})(v_j-v_k)^\top$,
#   which is invariant under translating every feature by the same vector.
#
# The matrices differ from gauge to gauge; only the readout is gauge-free, so matrices are always
# compared within one declared gauge.
#
# **Why the gauge matters numerically.** In the original gauge $u_i^\top\Delta M_i =
# \frac1{Z_i}\sum_j (e^{s_{ij}}-1)(v_j-\mu_i)$: when every score is very negative, each term is
# about $-(v_j-\mu_i)/Z_i$ with $1/Z_i \approx e^{-s_{\max}}$, and the terms cancel to leave an
# $O(1)$ result.  The condition number of that sum as it is evaluated (`Step.kappa`; see
# `ropestep.tolerances`), $\kappa = \sum_j|c_{ij}|\,(|q_i|\cdot|\tilde k_j-k_o|+|\beta_j-\beta_o|)
# \,(\|v_j-\mu_i\|_\infty+\|v_j\|_\infty)/\max_j\|v_j\|_\infty$, is about $N e^{-s_{\max}}$ here,
# and the float error is $\approx \kappa\,\varepsilon$.  In the max-key gauge the coefficients are
# bounded, $|c_j(s_j-s^*)| \le 1/\bar Z$, and $\kappa$ stays moderate.

# %% include _setup.py

# %% [markdown]
# ## Symbolic
#
# `symbolic.gauge_weights` for a symbolic gauge vector $g$, the readout invariance
# (`gauge_residual`, two keys), the max-key form of the weights for *every* key gauge
# (`maxkey_gauge_residuals`, three keys), and the pairwise matrix: same readout
# (`pairwise_residual`) and translation invariance (`pairwise_translation_residual`).

# %%
g_sym = sp.Matrix(sp.symbols("g_0 g_1", real=True))
h2 = symbolic.symbolic_head(2, dim=2, r=1)
h3 = symbolic.symbolic_head(3, dim=2, r=1)
show(r"c^g_0", symbolic.gauge_weights(h2.u, h2.a, g_sym)[0])
gauge_reduced = {
    "readout, any g (N=2)": symbolic.reduce_exact(symbolic.gauge_residual(h2.u, h2.a, h2.v, g_sym)),
    "max-key weights (N=3, every k)": symbolic.reduce_exact(symbolic.maxkey_gauge_residuals(h3.u, h3.a)),
    "pairwise readout (N=2)": symbolic.reduce_exact(symbolic.pairwise_residual(h2.u, h2.a, h2.v)),
    "pairwise translation (N=2)": symbolic.reduce_exact(
        symbolic.pairwise_translation_residual(h2.u, h2.a, h2.v, g_sym)),
}
for name, r in gauge_reduced.items():
    print(f"{name:32s} -> {list(r)}")

# %% [markdown]
# ## Numeric: four gauges, one readout (exact and float64)
#
# A bank of six keys read by three queries at one position (every query sees the whole bank),
# two query heads, q/k/v biases.  In the exact oracle: the original, max-key and pairwise matrices
# and a random gauge vector; the readout of each against $y$; how far apart the matrices are; and
# the pairwise matrix against the average of the $N$ key-gauge matrices.  Then `fast.step` in
# each gauge against the exact matrix of the same gauge.

# %%
m, N, Q = 5, 6, 3
spec, weights = random_head(11, m=m, d=4, r=3)
rng = np.random.default_rng(12)
xk, xq = rng.standard_normal((N, m)), rng.standard_normal((Q, m))
pk, pq = np.arange(N), np.full(Q, N)
g_vec = rng.standard_normal(m + 1)
E = exact.build(spec, weights, xq, pq, xk, pk, "bank", dps=DPS)

h, i = 1, 2
gauges = {"original": "original", "maxkey": "maxkey", "pairwise": "pairwise", "random g": g_vec}
dms = {name: exact.delta_m(E, h, i, g) for name, g in gauges.items()}
with mp.workdps(DPS):
    readout_err = {name: max(abs(a - b) for a, b in zip(exact.readout(E, h, i, M), E.y[h, i]))
                   for name, M in dms.items()}
    key_gauges = [exact.delta_m(E, h, i, list(E.feats[h, i, k])) for k in range(N)]
    avg = sum(key_gauges[1:], key_gauges[0]) / N
    pairwise_vs_avg = mp_max_abs_diff(dms["pairwise"], avg)
spread = {name: float(mp_max_abs_diff(M, dms["original"])) for name, M in dms.items()}
for name in gauges:
    print(f"{name:9s} |y - mu - u^T dM^g| = {mp.nstr(readout_err[name], 3):>10s}"
          f"    max |dM^g - dM^orig| = {spread[name]:.3f}")
print(f"pairwise matrix vs mean of the {N} key-gauge matrices: {mp.nstr(pairwise_vs_avg, 3)}")

fast_vs_exact = {}
for name, g in gauges.items():
    st = fast.step(spec, weights, xq, pq, xk, pk, "bank", gauge=g, delta_m=True)
    fast_vs_exact[name] = (float(mp_max_abs_diff(st.delta_m[h, i], dms[name])),
                           float(mp_max_abs_diff(st.readout, E.y)))
    print(f"fast float64, {name:9s}: dM^g vs exact {fast_vs_exact[name][0]:.1e};"
          f"  readout vs exact y {fast_vs_exact[name][1]:.1e}")

# %% [markdown]
# ## All scores $\le -30$: float32 in the original and max-key gauges
#
# One ALiBi head (slope $1/2$) whose query sits far from the bank: the bias
# $-\tfrac12(p_i-p_j)$ pushes every score below $-30$.  The query position is the first one at which
# that holds.  The exact output is unaffected (softmax ignores a common shift, and the oracle works
# at 60 digits); the float readouts are compared with it, relative to the value scale, next to the
# derived bound `tolerances.readout_bound` ($\propto\kappa\,\varepsilon$).

# %%
from ropestep import tolerances

spec1, weights1 = random_head(21, m=m, d=4, r=3, n_heads=1, n_kv_heads=1, alibi_slopes=(0.5,))
far = next(p for p in range(N, 400)
           if float(fast.step(spec1, weights1, xq, np.full(Q, p), xk, pk, "bank").s.max()) <= -30)
pq_far = np.full(Q, far)
E_far = exact.build(spec1, weights1, xq, pq_far, xk, pk, "bank", dps=DPS)
scores = exact.to_float(E_far.s)
v_scale = float(np.abs(exact.to_float(E_far.v)).max())
print(f"query position {far}: scores in [{scores.min():.1f}, {scores.max():.1f}]")


def gauge_errors(spec_, weights_, pq_, E_ref, dtype, gauge):
    """Relative readout error vs the exact y, the derived bound, and kappa (nan on overflow)."""
    try:
        st = fast.step(spec_, weights_, xq, pq_, xk, pk, "bank", gauge=gauge, dtype=dtype)
    except FloatingPointError as exc:
        return float("nan"), float("nan"), float("inf"), str(exc)
    err = float(mp_max_abs_diff(st.readout, E_ref.y)) / v_scale
    smax = st.s.abs().amax(-1).numpy()
    bound = float(tolerances.readout_bound(dtype, st.kappa.numpy(), N, spec_.head_dim, smax).max())
    return err, bound, float(st.kappa.max()), None


far_table = {}
print(f"{'dtype':8s} {'gauge':9s} {'rel. error':>10s} {'bound':>9s} {'kappa':>8s}")
for dtype in (torch.float32, torch.float64):
    for gauge in ("original", "maxkey", "pairwise"):
        far_table[(dtype, gauge)] = gauge_errors(spec1, weights1, pq_far, E_far, dtype, gauge)
        err, bound, kappa, _ = far_table[(dtype, gauge)]
        print(f"{str(dtype)[6:]:8s} {gauge:9s} {err:10.1e} {bound:9.1e} {kappa:8.1e}")

# %% [markdown]
# ### The loss grows like $e^{-s_{\max}}$
#
# Sweep the query position (so $s_{\max}$ runs from about $0$ down to $-105$) and plot the
# relative readout error of both gauges in both dtypes.  The original gauge tracks
# $\kappa\varepsilon \approx N e^{-s_{\max}}\varepsilon$; below $s_{\max}\approx-88$ float32 cannot
# represent $1/Z_i$ at all and `fast.step` refuses with a `FloatingPointError` (no point is drawn).
# The max-key gauge stays at a few ulps throughout.

# %%
import matplotlib.pyplot as plt

sweep = []
for p in (6, 15, 25, 35, 45, 55, 70, 85, 100, 120, 140, 160, 180, 200, 220):
    pq_p = np.full(Q, p)
    E_p = exact.build(spec1, weights1, xq, pq_p, xk, pk, "bank", dps=DPS)
    smax = float(exact.to_float(E_p.s).max())
    row = {"smax": smax}
    for dtype in (torch.float32, torch.float64):
        for gauge in ("original", "maxkey"):
            row[(dtype, gauge)] = gauge_errors(spec1, weights1, pq_p, E_p, dtype, gauge)
    sweep.append(row)

fig, ax = plt.subplots(figsize=(6, 3.6))
xs = [r["smax"] for r in sweep]
styles = {(torch.float32, "original"): "C3o-", (torch.float32, "maxkey"): "C0o-",
          (torch.float64, "original"): "C3s--", (torch.float64, "maxkey"): "C0s--"}
for key, style in styles.items():
    ax.plot(xs, [max(r[key][0], 1e-17) for r in sweep], style, ms=4,
            label=f"{str(key[0])[6:]}, {key[1]}")
ax.axvline(-30, color="gray", lw=0.5)
ax.set(yscale="log", xlabel=r"$s_{\max}$ (largest score of the query)",
       ylabel="relative readout error vs mpmath")
ax.invert_xaxis()
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ### Below $-745$ the original gauge cannot even be formed in float64
#
# There $1/Z_i > e^{745}$ overflows; `fast.step` refuses in the original gauge and the max-key gauge
# is unaffected.

# %%
pq_very_far = np.full(Q, 1700)
overflow = gauge_errors(spec1, weights1, pq_very_far, exact.build(
    spec1, weights1, xq, pq_very_far, xk, pk, "bank", dps=DPS), torch.float64, "original")
maxkey_very_far = gauge_errors(spec1, weights1, pq_very_far, exact.build(
    spec1, weights1, xq, pq_very_far, xk, pk, "bank", dps=DPS), torch.float64, "maxkey")
print("original:", overflow[3])
print(f"max-key: relative error {maxkey_very_far[0]:.1e}, kappa {maxkey_very_far[2]:.1f}")

# %% [markdown]
# ## Assertions

# %%
assert all(all(e == 0 for e in r) for r in gauge_reduced.values()), gauge_reduced
tiny = mp.mpf(10) ** (-DPS + 5)
assert all(err < tiny for err in readout_err.values()), readout_err
assert min(v for k, v in spread.items() if k != "original") > 1e-3, spread  # the matrices differ
assert pairwise_vs_avg < tiny
assert all(dm_err < 1e-12 and ro_err < 1e-12 for dm_err, ro_err in fast_vs_exact.values())
# all scores <= -30: float32 loses (nearly) everything in the original gauge, not in max-key
assert scores.max() <= -30
err32_orig, err32_max = far_table[(torch.float32, "original")][0], far_table[(torch.float32, "maxkey")][0]
assert err32_orig > 1e3 * err32_max and err32_orig > 1e-2, (err32_orig, err32_max)
assert err32_max < 64 * EPS32
assert far_table[(torch.float32, "maxkey")][2] < 1e-6 * far_table[(torch.float32, "original")][2]
# every measured error (both dtypes, both gauges, all positions) sits inside the derived bound
for row in [far_table] + [{k: v for k, v in r.items() if k != "smax"} for r in sweep]:
    for key, (err, bound, kappa, why) in row.items():
        assert why is not None or err <= bound, (key, err, bound)
        if key[1] == "maxkey":
            assert why is None and err < 64 * (EPS32 if key[0] == torch.float32 else EPS64), (key, err)
assert overflow[3] is not None and "overflows" in overflow[3]
assert any(r[(torch.float32, "original")][3] for r in sweep if r["smax"] < -89)  # float32 refuses
assert maxkey_very_far[3] is None and maxkey_very_far[0] <= maxkey_very_far[1]
print("all assertions passed")
