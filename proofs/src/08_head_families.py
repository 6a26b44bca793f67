# %% [markdown]
# # 08 · Head families: ALiBi, soft-caps, per-head RoPE bases, QK-norm, Cosine-RoPE
#
# The proof of notebook 02 uses only three facts: the output is a softmax-weighted mean of the
# values, the centred values sum to zero, and the score is $u^\top a_j$.  Each family below keeps
# the first two and changes the third in a way the identity absorbs (docs/math.md §8).
#
# * **ALiBi** (additive biases $\beta_{ij}$): $s_{ij} = u_i^\top a_{ij}$ with $\beta_{ij}$ added to
#   the augmented coordinate of $a_{ij}$ (the one multiplied by $u_{m+1} = 1$).  Nothing else changes.
# * **Soft-caps** and any score transform $\varphi$ with $\varphi(0) = 0$: the softmax acts on
#   $\varphi(s_{ij})$, and the same chain gives $y_i = \mu_i + u_i^\top\Delta M_i$ with
#   $c_{ij} = \rho_\varphi(s_{ij})/Z^\varphi_i$, $\rho_\varphi(s) = (e^{\varphi(s)}-1)/s$,
#   $Z^\varphi_i = \sum_j e^{\varphi(s_{ij})}$.  If $\varphi$ is increasing (the soft-cap
#   $\varphi(s) = c\tanh(s/c)$ is), $\varphi(s)$ has the sign of $s$ and $\rho_\varphi > 0$.
# * **Per-head RoPE bases**: $A = A_h$; $L_i$ changes per head, the identity does not.
# * **QK-norm** (Qwen3) and **Cosine-RoPE** (unit $\hat q, \hat k$, per-head temperature $\tau_h$,
#   $s = \hat q R\hat k^\top/\tau_h$): the score is no longer affine in $u$, so no $\Delta M_i$
#   exists in input space.  The identity holds in query space with the normalised rotated query
#   $\tilde q_i$: $y_i = \mu_i + \tilde q_i S_i$, $S_i = \frac1\tau\sum_j c_{ij}\hat{\tilde k}_j^\top
#   (v_j-\mu_i)$ — the same theorem with $u_i \to [\tilde q_i; 1]$ and $a_{ij} \to [\hat{\tilde k}_j;
#   \beta_{ij}]$.
# * **Cosine bound.** $|s_{ij}| \le 1/\tau_h$, so each attention weight lies in
#   $[e^{-2/\tau}/N, e^{2/\tau}/N]$, $|p_j - 1/N| \le (e^{2/\tau}-1)/N$ and
#   $$\|y_i-\mu_i\| = \Bigl\|\sum_j (p_j-\tfrac1N)(v_j-\mu_i)\Bigr\| \le (e^{2/\tau_h}-1)\max_j\|v_j-\mu_i\| .$$
#   At the default $\tau_h = \sqrt d$ the head is within a factor $e^{2/\sqrt d}-1$ of uniform.

# %% include _setup.py

# %% [markdown]
# ## Symbolic
#
# *Any* score transform: with an undefined SymPy function $\varphi$, the output
# $\sum_j e^{\varphi(s_j)}v_j/Z^\varphi$ against $\mu + u^\top\Delta M$ built by `symbolic.delta_m` with
# the weights $\rho_\varphi(s_j)/Z^\varphi$.  ALiBi needs no separate check: the features $a_j$ of
# `symbolic.symbolic_head` are free symbols, their last coordinate included, so a bias is already
# covered by the identity of notebook 02.  The cosine bound's algebraic steps come from
# `symbolic.cosine_bound_residuals`.

# %%
h3 = symbolic.symbolic_head(3, dim=2, r=1)
phi = sp.Function("varphi")
s_sym = symbolic.scores(h3.u, h3.a)
z_phi = sp.Add(*[sp.exp(phi(x)) for x in s_sym])
y_phi = sp.Add(*[sp.exp(phi(x)) * vj[0, 0] for x, vj in zip(s_sym, h3.v)]) / z_phi
c_phi = [(sp.exp(phi(x)) - 1) / (x * z_phi) for x in s_sym]
mu_sym = symbolic.uniform_mean(h3.v)
transform_residual = symbolic.reduce_exact(
    y_phi - symbolic.readout(h3.u, symbolic.delta_m(h3.u, h3.a, h3.v, mu=mu_sym, weights=c_phi), mu_sym)[0, 0])
show(r"c_0", c_phi[0])
print("identity with an arbitrary score transform phi reduces to:", transform_residual)

cos_res = symbolic.cosine_bound_residuals(h3.u, h3.a, h3.v)
cosine_reduced = {name: symbolic.is_exactly_zero(r) for name, r in cos_res.items()}
tau = sp.Symbol("tau", positive=True)
show(r"\|y-\mu\| \le " + sp.latex(symbolic.cosine_bound(tau, sp.Symbol("D")))
     + r",\qquad D = \max_j\|v_j-\mu\|")
print(cosine_reduced)

# %% [markdown]
# ## Numeric: every family, exact and float64
#
# Two query heads, one KV head, $m = 5$, $d = 4$, $r = 3$, six tokens, causal mask, q/k/v biases,
# query/key gain $1.5$ (scores of a few units).  For each family: the exact identity at 60 digits
# (`exact.delta_m` + `exact.readout`, in input space for affine families, in query space otherwise),
# the float64 readout of `fast.step` against the exact output, the float64 matrix ($\Delta M$ or the
# query-space $T$) against the exact one, and the smallest coefficient on the permitted set.

# %%
from ropestep.spec import alibi_slopes

m, N = 5, 6
x = np.random.default_rng(52).standard_normal((N, m))
pos = np.arange(N)
families = {
    "ALiBi": dict(alibi_slopes=alibi_slopes(2)),
    "soft-cap 2": dict(softcap=2.0),
    "soft-cap 2 + ALiBi": dict(softcap=2.0, alibi_slopes=(0.5, 0.25)),
    "per-head bases": dict(rope=RoPESpec(base=(10000.0, 50.0))),
    "QK-norm": dict(family="qknorm"),
    "Cosine-RoPE": dict(family="cosine", temperature=(0.25, 2.0)),
}
family_results = {}
print(f"{'family':20s} {'exact identity':>14s} {'fast readout':>12s} {'fast matrix':>11s} {'min c_ij':>9s}")
for name, kw in families.items():
    spec, weights = random_head(51, m=m, d=4, r=3, n_heads=2, gain=1.5, **kw)
    E = exact.build(spec, weights, x, pos, x, pos, "causal", dps=DPS)
    dm = exact.all_delta_m(E)  # (H, Q, m+1 or d+1, r)
    with mp.workdps(DPS):
        ident = max(abs(exact.readout(E, h, i, mp.matrix(dm[h, i].tolist()))[q] - E.y[h, i, q])
                    for h in range(2) for i in range(N) for q in range(spec.r))
    st = fast.step(spec, weights, x, pos, x, pos, "causal", delta_m=spec.affine)
    readout_err = float(mp_max_abs_diff(st.readout, E.y))
    matrix_err = float(mp_max_abs_diff(st.delta_m, dm) if spec.affine
                       else mp_max_abs_diff(st.t, dm[:, :, :spec.head_dim]))
    c_min = float(st.c[:, st.mask].min())
    family_results[name] = (ident, readout_err, matrix_err, c_min, (spec, weights))
    print(f"{name:20s} {mp.nstr(ident, 3):>14s} {readout_err:12.1e} {matrix_err:11.1e} {c_min:9.1e}")

# %% [markdown]
# In query-space families there is no input-space matrix: `fast.step(..., delta_m=True)` refuses.

# %%
try:
    fast.step(*family_results["QK-norm"][4], x, pos, x, pos, "causal", delta_m=True)
    refused = None
except ValueError as exc:
    refused = str(exc)
print(refused)

# %% [markdown]
# ## Soft-cap weights stay positive
#
# $\rho_\varphi(s) = (e^{c\tanh(s/c)}-1)/s$ on scores from $-10^4$ to $10^4$ through `fast.step`'s
# coefficients: a soft-cap head with huge query/key gain, all coefficients on the permitted set.

# %%
spec_cap, weights_cap = random_head(53, m=m, d=4, r=3, n_heads=2, gain=20.0, softcap=5.0)
st_cap = fast.step(spec_cap, weights_cap, x, pos, x, pos, "causal")
cap_scores = st_cap.s[:, st_cap.mask]
cap_c = st_cap.c[:, st_cap.mask]
print(f"raw scores in [{float(cap_scores.min()):.0f}, {float(cap_scores.max()):.0f}];"
      f"  min c_ij = {float(cap_c.min()):.2e};  identity error {float(st_cap.identity_error().max()):.1e}")

# %% [markdown]
# ## The Cosine-RoPE bound
#
# Cosine heads with $d = 16$ and temperatures $\tau \in \{0.25, 1, \sqrt d = 4\}$; 64 random
# queries read a bank of 12 keys.  Scores stay within $\pm1/\tau$, and the ratio
# $\|y_i-\mu_i\| / \bigl((e^{2/\tau}-1)\max_j\|v_j-\mu_i\|\bigr)$ stays below 1.

# %%
rng = np.random.default_rng(54)
xk, xq = rng.standard_normal((12, m)), 3 * rng.standard_normal((64, m))
cosine_rows = {}
for tau_h in (0.25, 1.0, 4.0):
    spec_c, weights_c = random_head(55, m=m, d=16, r=3, n_heads=1, family="cosine", temperature=tau_h)
    st_c = fast.step(spec_c, weights_c, xq, np.full(64, 12), xk, np.arange(12), "bank")
    dev = torch.linalg.vector_norm(st_c.y - st_c.mu, dim=-1)  # (1, Q)
    vc = st_c.extras["projected"].v[:, None] - st_c.mu[:, :, None]  # (1, Q, N, r)
    bound = float(sp.N(symbolic.cosine_bound(sp.nsimplify(tau_h), 1))) * torch.linalg.vector_norm(vc, dim=-1).amax(-1)
    cosine_rows[tau_h] = (float(st_c.s.abs().max()) * tau_h, float((dev / bound).max()), float(dev.max()))
    print(f"tau = {tau_h:4}: max |s| * tau = {cosine_rows[tau_h][0]:.4f};  max ||y - mu|| / bound = "
          f"{cosine_rows[tau_h][1]:.2e};  max ||y - mu|| = {cosine_rows[tau_h][2]:.3f}")

# %% [markdown]
# ## Assertions

# %%
tiny = mp.mpf(10) ** (-DPS + 5)
assert transform_residual == 0
assert all(cosine_reduced.values()), cosine_reduced
for name, (ident, readout_err, matrix_err, c_min, _) in family_results.items():
    assert ident < tiny, (name, ident)
    assert readout_err < 1e-12 and matrix_err < 1e-12, (name, readout_err, matrix_err)
    assert c_min > 0, (name, c_min)
assert refused is not None and "not affine" in refused
assert float(cap_scores.abs().max()) > 1e3 and float(cap_c.min()) > 0
assert float(st_cap.identity_error().max()) < 1e-12
for tau_h, (s_tau, ratio, _) in cosine_rows.items():
    assert s_tau <= 1 + 1e-12 and ratio <= 1, (tau_h, s_tau, ratio)
print("all assertions passed")
