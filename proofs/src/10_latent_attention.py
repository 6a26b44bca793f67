# %% [markdown]
# # 10 · Multi-head latent attention: the identity in the absorbed space
#
# **The model** (DeepSeek-V2/V3, Kimi-K2, MiniCPM3, LongCat; docs/math.md §14), rows as in the
# code.  Per token $j$, shared by every head: the normed latent
# $c_j = g_{kv}\odot\mathrm{RMS}(x_jW_{kc}+b_{kc})$ (width `rank`) and a rotated key part
# $\tilde k^r_j = (x_jW_{kr}+b_{kr})R(p_j)^\top$ (width `rope_dim`).  Per head $h$: the key
# $k_{jh} = [c_jW_{uk}[h],\ \tilde k^r_j]$ (`nope` dims, then `rope_dim`), the value
# $v_{jh} = c_jW_{uv}[h]$, the query $q_{ih} = [q^n_{ih},\ q^r_{ih}R(p_i)^\top]$ with
# $[q^n_{ih}, q^r_{ih}] = z_iW_q[h] + b_q[h]$, where $z_i = x_i$, or a query latent
# $z_i = g_{qa}\odot\mathrm{RMS}(x_iW_{qa}+b_{qa})$.  Score $s_{ijh} = \lambda\, q_{ih}\cdot k_{jh}$.
#
# **Absorption.** $q^n\cdot(cW_{uk}) = (q^nW_{uk}^\top)\cdot c$, so with the absorbed query
# $q'_{ih} = [q^r_{ih}R(p_i)^\top,\ q^n_{ih}W_{uk}[h]^\top]$ (`rope_dim + rank` dims) and the key
# $k'_j = [\tilde k^r_j,\ c_j]$ shared by all heads, $s_{ijh} = \lambda\, q'_{ih}\cdot k'_j$.
# The latent pairs of $k'_j$ turn by angle 0: it is an ordinary RoPE key whose last `rank/2`
# frequencies are zero.
#
# **Identity.** The proof of notebook 02 uses only a softmax of scores bilinear in (query, key)
# and values that do not depend on the query.  Both hold here, so with
# $c_{ijh} = \rho(s_{ijh})/Z_{ih}$ and $\mu_{ih}$ the uniform mean of head $h$'s permitted values,
#
# $$y_{ih} = \mu_{ih} + q'_{ih}\,T_{ih},\qquad
# T_{ih} = \lambda\sum_j c_{ijh}\,k'^\top_j(v_{jh}-\mu_{ih})\in\mathbb R^{(\mathrm{rope\_dim}+\mathrm{rank})\times r}.$$
#
# **Input space.** Without a query latent, $q'_{ih} = u_i^\top L_{ih}$ with
# $L_{ih} = [\hat W_{qr}[h]R(p_i)^\top,\ \hat W_{qn}[h]W_{uk}[h]^\top]$, the score is
# $u_i^\top a_{ijh}$ with $a_{ijh} = \lambda L_{ih}k'^\top_j$, and $\Delta M_{ih} = L_{ih}T_{ih}$.
# With a query latent the RMS norm bounds the query, so a score affine in $u$ would be constant
# (at $\varepsilon = 0$ it is even constant along every ray in $x$): the score is not affine in
# $u$, and there is no input-space $\Delta M$.
#
# `ropestep.symbolic` works with columns: there $W_{uk}[h]$ is `nope × rank` (transformers'
# `kv_b_proj` layout) and the absorbed query is $[R(p_i)q^r;\ W_{uk}[h]^\top q^n]$.

# %% include _setup.py

# %% [markdown]
# ## Symbolic: absorption
#
# `symbolic.latent_heads` builds one query of a layer with every entry a symbol: two heads,
# three keys, `rank = rope_dim = nope = 2`; first with rotation blocks
# $[[\gamma, -\sigma], [\sigma, \gamma]]$ of free symbols (nothing below uses
# $\gamma^2+\sigma^2 = 1$), then with $R(p) = e^{pA}$ at symbolic positions and frequencies.
# `symbolic.latent_absorption_residual` is the matrix of model minus absorbed scores.  Two wrong
# absorptions must not vanish: $W_{uk}$ in place of $W_{uk}^\top$, and the absorbed query's blocks
# in the other order than the shared key's.

# %%
lh = symbolic.latent_heads()
show(r"s^{\mathrm{model}}_{00}", symbolic.latent_model_scores(lh, 0)[0])
show(r"q'_{0}", symbolic.latent_absorbed_query(lh, 0))
show(r"k'_{0}", symbolic.latent_absorbed_keys(lh)[0])
absorption_reduced = {}
for name, kw in {"free rotation": {}, "R(p) = e^{pA}": dict(trig=True),
                 "3 heads, rank 4, rope 4, nope 3": dict(n_heads=3, n_keys=2, rank=4, rope_dim=4,
                                                         nope=3, trig=True)}.items():
    absorption_reduced[name] = symbolic.is_exactly_zero(
        symbolic.latent_absorption_residual(symbolic.latent_heads(**kw)))
    print(f"absorption, {name}: reduces to 0: {absorption_reduced[name]}")

point = {x: sp.Rational(k % 7 - 3, 4) for k, x in enumerate(lh.symbols())}
wrong_absorptions = {}
for wrong in (symbolic.wrong_latent_absorption_untransposed,
              symbolic.wrong_latent_absorption_misordered):
    res = wrong(lh)
    wrong_absorptions[wrong.__name__] = (symbolic.is_exactly_zero(res),
                                         max(abs(e) for e in res.subs(point)))
    print(f"{wrong.__name__:38s} reduces to 0: {wrong_absorptions[wrong.__name__][0]};"
          f"  max |residual| at a rational point: {wrong_absorptions[wrong.__name__][1]}")

# %% [markdown]
# ## Symbolic: the identity with shared keys and per-head values
#
# `symbolic.latent_identity_residual` takes the softmax over the **model's** per-head scores and
# values and subtracts $\mu_{ih} + q'_{ih}T_{ih}$ built only from the absorbed query, the shared
# keys and head $h$'s values.  Giving each head the other head's value map must fail.

# %%
identity_reduced = {}
for r_ in (1, 2):
    lh_r = symbolic.latent_heads(r=r_)
    identity_reduced[r_] = symbolic.reduce_exact(symbolic.latent_identity_residual(lh_r))
    print(f"2 heads, 3 keys, r = {r_}: y - mu - q'T reduces to {list(identity_reduced[r_])}")
lh2 = symbolic.latent_heads(n_keys=2)
swapped = symbolic.wrong_latent_identity_swapped_values(lh2)
point2 = {x: sp.Rational(k % 5 - 2, 3) for k, x in enumerate(lh2.symbols())}
swapped_value = max(abs(sp.N(e, 30)) for e in swapped.subs(point2))
print(f"swapped value maps: reduces to 0: {symbolic.is_exactly_zero(swapped)};"
      f"  max |residual| at a rational point: {swapped_value}")

# %% [markdown]
# ## Symbolic: input space without a query latent, and why a query latent leaves it
#
# With the query a projection of $u$ (`m` given), `symbolic.latent_input_space_residuals`
# checks $q' = L^\top u$, that every model score is $u^\top a_{jh}$, the identity of section 3 on
# these features, and $\Delta M = LT$ (for any weights $c_j$).  With a query latent at
# $\varepsilon = 0$, `symbolic.latent_query_latent_ray` shows $z(tx) = z(x)$ for $t > 0$ and an
# odd score: an affine function constant on rays is constant, and an odd non-zero one is not.

# %%
input_space = {}
for m_, n_ in ((2, 2), (1, 3)):
    res = symbolic.latent_input_space_residuals(symbolic.latent_heads(n_heads=1, n_keys=n_, m=m_))
    input_space[(m_, n_)] = {k: symbolic.is_exactly_zero(v) for k, v in res.items()}
    print(f"m = {m_}, N = {n_}: {input_space[(m_, n_)]}")
ray = symbolic.latent_query_latent_ray()
ray_reduced = {k: symbolic.is_exactly_zero(ray[k]) for k in ("ray", "score_ray", "odd")}
ray_point = {x: sp.Rational(k % 5 + 1, 3) for k, x in enumerate(sorted(ray["s"].free_symbols, key=str))}
ray_score = sp.N(ray["s"].subs(ray_point), 30)
print(f"query latent: {ray_reduced};  s at a rational point = {ray_score}")

# %% [markdown]
# ## Numeric: a small layer, model form against `kernel.latent_qkv`, at 60 digits and float64
#
# Two heads, $m = 6$, `rank = 4`, `rope_dim = 2`, `nope = 3`, $r = 2$, five tokens, a causal
# mask, biases on the key parts and the query, $\lambda = \mathrm{mscale}^2/\sqrt{\mathrm{nope} +
# \mathrm{rope\_dim}}$ with YaRN's $\mathrm{mscale} = 0.1\ln 40 + 1$; once with a plain query and
# once with a query latent of width 3.  The model form is written here in numpy (float64).  The
# absorbed weights $W'_q[h] = [W_{qr}[h],\ W_{qn}[h]W_{uk}[h]^\top]$ go through
# `kernel.latent_qkv`, whose queries and keys are rotated with `rope.apply_rope` (adjacent pairs;
# the latent pairs at angle 0).  Compared:
#
# * float64 scores of the two forms (different vectors, different rounding: a few ulp);
# * at 60 digits, on the model's own float64 ingredients converted exactly, the lambdified
#   symbolic $y$ (model form) against $\mu + q'T$ (absorbed form), for the last query (all keys);
# * the float64 absorbed readout (`kernel.phi1` for $\rho$) against that exact $y$.

# %%
from ropestep import kernel
from ropestep.rope import apply_rope

H, m_in, rank, rope_dim, nope, r_v, N_tok, q_rank = 2, 6, 4, 2, 3, 2, 5, 3
eps = 1e-6
omega = 0.7  # the one rotated pair's frequency
lam = (0.1 * np.log(40) + 1) ** 2 / np.sqrt(nope + rope_dim)


def rms(a, g):
    return g * a / np.sqrt((a * a).mean(-1, keepdims=True) + eps)


def rotate(a, angle):  # rows a (..., 2l) by R(p)^T, adjacent pairs, with cos/sin broadcast
    return apply_rope(torch.as_tensor(a), torch.as_tensor(np.cos(angle)),
                      torch.as_tensor(np.sin(angle)), "interleaved").numpy()


def mla_layer(seed, query_latent):
    rng = np.random.default_rng(seed)
    g = lambda *shape, s=1.0: s * rng.standard_normal(shape)  # noqa: E731
    w = dict(W_kc=g(m_in, rank, s=0.6), b_kc=g(rank, s=0.3), g_kv=1 + g(rank, s=0.2),
             W_kr=g(m_in, rope_dim, s=0.5), b_kr=g(rope_dim, s=0.3),
             W_uk=g(H, rank, nope, s=0.6), W_uv=g(rank, H, r_v),
             W_q=g(q_rank if query_latent else m_in, H, nope + rope_dim, s=0.5),
             b_q=g(H, nope + rope_dim, s=0.3),
             W_qa=g(m_in, q_rank, s=0.6) if query_latent else None,
             b_qa=g(q_rank, s=0.3) if query_latent else None,
             g_qa=1 + g(q_rank, s=0.2) if query_latent else None)
    x = g(N_tok, m_in)
    pos = np.arange(N_tok, dtype=np.float64)
    # the model form (float64): per-head keys [c W_uk, k^r R^T], queries [q^n, q^r R^T]
    c = rms(x @ w["W_kc"] + w["b_kc"], w["g_kv"])
    kr = x @ w["W_kr"] + w["b_kr"]
    z = rms(x @ w["W_qa"] + w["b_qa"], w["g_qa"]) if query_latent else x
    qh = np.einsum("nq,qhd->hnd", z, w["W_q"]) + w["b_q"][:, None, :]
    qn, qr = qh[..., :nope], qh[..., nope:]
    kr_rot, qr_rot = rotate(kr, (pos * omega)[:, None]), rotate(qr, (pos * omega)[None, :, None])
    k_model = np.concatenate([np.einsum("nl,hld->hnd", c, w["W_uk"]),
                              np.broadcast_to(kr_rot, (H, N_tok, rope_dim))], -1)
    q_model = np.concatenate([qn, qr_rot], -1)
    s_model = lam * np.einsum("hid,hjd->hij", q_model, k_model)
    v = np.einsum("nl,lhr->hnr", c, w["W_uv"])
    # the absorbed form through kernel.latent_qkv: W'_q[h] = [W_qr[h], W_qn[h] W_uk[h]^T]
    w_abs = np.concatenate([w["W_q"][..., nope:], np.einsum("qhn,hln->qhl", w["W_q"][..., :nope],
                                                            w["W_uk"])], -1)
    b_abs = np.concatenate([w["b_q"][:, nope:], np.einsum("hn,hln->hl", w["b_q"][:, :nope],
                                                          w["W_uk"])], -1)
    t = lambda a: None if a is None else torch.as_tensor(a)  # noqa: E731
    lw = dict(w_q=t(w_abs), b_q=t(b_abs), w_kr=t(w["W_kr"]), b_kr=t(w["b_kr"]), w_kc=t(w["W_kc"]),
              b_kc=t(w["b_kc"]), kv_norm=t(w["g_kv"]), w_uv=t(w["W_uv"]), b_uv=None,
              w_qa=t(w["W_qa"]), b_qa=t(w["b_qa"]), qa_norm=t(w["g_qa"]))
    q_abs, k_abs, v_abs = (a.numpy() for a in kernel.latent_qkv(torch.as_tensor(x), lw, H, eps, eps))
    angles = pos[:, None] * np.array([omega] + [0.0] * (rank // 2))  # latent pairs at angle 0
    qa_rot, ka_rot = rotate(q_abs, angles[None]), rotate(k_abs, angles[None])
    s_abs = lam * np.einsum("hid,hjd->hij", qa_rot, ka_rot)
    return dict(s_model=s_model, s_abs=s_abs, v=v, v_abs=v_abs, qn=qn, qr=qr, c=c, kr=kr,
                W_uk=w["W_uk"], W_uv=w["W_uv"], pos=pos, qa_rot=qa_rot, ka_rot=ka_rot)


layers = {ql: mla_layer(101 + ql, ql) for ql in (False, True)}
causal = np.tril(np.ones((N_tok, N_tok), dtype=bool))
for ql, L_ in layers.items():
    d_s = np.abs(L_["s_model"] - L_["s_abs"])[:, causal].max() / np.abs(L_["s_model"]).max()
    d_v = np.abs(L_["v"] - L_["v_abs"]).max()
    L_["score_rel"], L_["value_diff"] = d_s, d_v
    print(f"query latent {ql!s:5}: scores in [{L_['s_model'][:, causal].min():.2f}, "
          f"{L_['s_model'][:, causal].max():.2f}];  max |s_model - s_absorbed| / max |s| = "
          f"{d_s:.1e} ({d_s / EPS64:.1f} eps);  values differ by {d_v:.1e}")

# %% [markdown]
# The exact check, on the last query $i = 4$ (all five keys): the symbolic layer with five keys
# and these sizes, its symbols bound to the float64 ingredients (exact binary fractions), the
# model-form $y$ and the absorbed $\mu + q'T$ lambdified to mpmath at 60 digits.

# %%
lh_num = symbolic.latent_heads(n_heads=H, n_keys=N_tok, rank=rank, rope_dim=rope_dim, nope=nope,
                               r=r_v)
y_sym = [symbolic.softmax_output(symbolic.latent_model_query(lh_num, h),
                                 [lh_num.scale * symbolic.latent_model_key(lh_num, h, j)
                                  for j in range(N_tok)], symbolic.latent_values(lh_num, h))
         for h in range(H)]
readout_sym = [symbolic.readout(symbolic.latent_absorbed_query(lh_num, h),
                                symbolic.latent_query_space_matrix(lh_num, h),
                                symbolic.uniform_mean(symbolic.latent_values(lh_num, h)))
               for h in range(H)]
syms_num = lh_num.symbols()
f_y = sp.lambdify(syms_num, [list(y) for y in y_sym], modules="mpmath")
f_ro = sp.lambdify(syms_num, [list(ro) for ro in readout_sym], modules="mpmath")


def bind(L_, i):
    """Symbol -> float64 value for query i (columns: W_uk[h] is W_uk^T of the rows' layout)."""
    val = {}

    def put(mat, arr):
        for sym, a in zip(mat, np.asarray(arr, dtype=np.float64).ravel()):
            val[sym] = a

    for h in range(H):
        put(lh_num.qn[h], L_["qn"][h, i]); put(lh_num.qr[h], L_["qr"][h, i])
        put(lh_num.w_uk[h], L_["W_uk"][h].T); put(lh_num.w_uv[h], L_["W_uv"][:, h, :].T)
    for j in range(N_tok):
        put(lh_num.c[j], L_["c"][j]); put(lh_num.kr[j], L_["kr"][j])
        put(lh_num.rot_k[j][:2, 0], [np.cos(L_["pos"][j] * omega), np.sin(L_["pos"][j] * omega)])
    put(lh_num.rot_q[:2, 0], [np.cos(L_["pos"][i] * omega), np.sin(L_["pos"][i] * omega)])
    val[lh_num.scale] = lam
    return [mp.mpf(float(val[s])) for s in syms_num]


exact_rows = {}
i_last = N_tok - 1
for ql, L_ in layers.items():
    with mp.workdps(DPS):
        args = bind(L_, i_last)
        y_exact, ro_exact = f_y(*args), f_ro(*args)
        ident = max(abs(a - b) for ya, ra in zip(y_exact, ro_exact) for a, b in zip(ya, ra))
    # the float64 absorbed readout from kernel.latent_qkv's (rotated) queries, keys and values
    s = torch.as_tensor(L_["s_abs"][:, i_last])  # (H, N)
    coef = kernel.phi1(s) / torch.exp(s).sum(-1, keepdim=True)
    v_ = torch.as_tensor(L_["v_abs"])
    mu = v_.mean(1, keepdim=True)  # (H, 1, r)
    T = lam * torch.einsum("hj,hjd,hjr->hdr", coef, torch.as_tensor(L_["ka_rot"]), v_ - mu)
    ro64 = mu[:, 0] + torch.einsum("hd,hdr->hr", torch.as_tensor(L_["qa_rot"][:, i_last]), T)
    fast_err = float(mp_max_abs_diff(ro64, y_exact))
    exact_rows[ql] = (ident, fast_err, T.shape, int(torch.linalg.matrix_rank(T[0])))
    print(f"query latent {ql!s:5}: 60 digits |y - (mu + q'T)| = {mp.nstr(ident, 3)};  float64 "
          f"absorbed readout vs exact y {fast_err:.1e};  T_ih {tuple(T.shape[1:])}, rank "
          f"{exact_rows[ql][3]}")

# %% [markdown]
# ## Sizes: DeepSeek-V3
#
# 128 heads, `kv_lora_rank` 512, `qk_rope_head_dim` 64, `qk_nope_head_dim` 128, `v_head_dim`
# 128, `q_lora_rank` 1536.  The model's per-head query and key have 192 dims; the absorbed query
# has 576 and meets one 576-dim key per token, shared by all 128 heads.  $T_{ih}$ is
# $576 \times 128$, so $\operatorname{rank} T_{ih} \le 128$.  With its query latent, the identity
# is stated in this query space only.  YaRN (factor 40, `mscale_all_dim` 1) puts
# $\mathrm{mscale}^2$ into the module's scale.

# %%
v3 = dict(heads=128, rank=512, rope=64, nope=128, v=128)
absorbed_dim = v3["rope"] + v3["rank"]
model_dim = v3["nope"] + v3["rope"]
mscale_v3 = 0.1 * 1.0 * np.log(40) + 1
scale_v3 = mscale_v3**2 / np.sqrt(model_dim)
print(f"absorbed head dim {absorbed_dim} (model per-head {model_dim});  T_ih {absorbed_dim} x {v3['v']},"
      f" rank <= {min(absorbed_dim, v3['v'])};  scale = mscale^2/sqrt({model_dim}) = {scale_v3:.6f}"
      f" (mscale = {mscale_v3:.6f})")

# %% [markdown]
# ## Assertions

# %%
assert all(absorption_reduced.values()), absorption_reduced
for name, (zero, value) in wrong_absorptions.items():
    assert not zero and value > 0, name
assert all(all(e == 0 for e in red) for red in identity_reduced.values())
assert not symbolic.is_exactly_zero(swapped) and swapped_value > 1e-3
assert all(all(v.values()) for v in input_space.values()), input_space
assert all(ray_reduced.values()) and abs(ray_score) > 1e-3
for ql, L_ in layers.items():
    assert L_["score_rel"] < 64 * EPS64 and L_["value_diff"] < 64 * EPS64, ql
    ident, fast_err, t_shape, t_rank = exact_rows[ql]
    assert ident < mp.mpf(10) ** (-50), (ql, ident)
    assert fast_err < 1e-12, (ql, fast_err)
    assert tuple(t_shape[1:]) == (rope_dim + rank, r_v) and t_rank <= min(rope_dim + rank, r_v)
assert absorbed_dim == 576 and model_dim == 192
print("all assertions passed")
