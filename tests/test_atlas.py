"""The atlas's per-query statistics against the mpmath oracle, and its native check's power.

Every number :func:`ropestep.layercheck.evaluate_layer` produces for a small causal layer is
recomputed from :mod:`ropestep.exact` (50 digits, its own features, coefficients and matrices):
the identity, the input-space lambda_max (the paper's Hessian ``sum_j c_j a_j a_j^T``), the
query-space lambda_max (``scale^2 sum_j c_j k~_j k~_j^T``), whether the unit step increases E in
each space (``exact.objective`` before and after the step), the frozen-reuse predictions
``mu_a + u_i^T Delta M_a`` and the total-variation distances.  The "native" output fed to the
atlas here is the oracle's own softmax output, so the native comparison must pass; the capture
mutations then feed it a wrong capture and it must fail.
"""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
import torch

import oracle
from ropestep import exact, layercheck, fast, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec, causal_mask

N, ANCHOR = 11, 4


def layer(seed: int = 0, H: int = 4, Hk: int = 2, d: int = 4, m: int = 5, amp: float = 0.9):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, std=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * std

    spec = HeadSpec(H, Hk, d, rope=RoPESpec(base=100.0))
    w = HeadWeights(rnd(m, H, d, std=amp), rnd(m, Hk, d, std=amp), rnd(m, Hk, d),
                    rnd(H, d, std=0.5), rnd(Hk, d, std=0.5), rnd(Hk, d, std=0.3))
    return spec, w, rnd(N, m)


@pytest.fixture(scope="module")
def case():
    spec, w, x = layer()
    pos = np.arange(N)
    E = exact.build(spec, w, x.numpy(), pos, x.numpy(), pos, causal_mask(pos, pos), dps=50)
    native = torch.as_tensor(exact.to_float(E.y)).permute(1, 0, 2)  # (N, H, r)
    res = layercheck.evaluate_layer(spec, w, x, torch.arange(N), native, anchor_every=ANCHOR)
    return spec, w, x, E, res


def _rel(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), tolerances.SCALE_GUARD))


def test_identity_and_native_against_the_oracle(case):
    spec, w, x, E, res = case
    a = res.arrays
    vs = res.value_scale[:, None]
    print("identity", np.max(a["id_abs"] / vs), "native", np.max(a["native_abs"] / vs))
    assert np.all(a["id_abs"] / vs <= a["id_bound"])
    assert np.max(a["native_abs"] / vs) <= tolerances.FLOAT64_REL
    assert not res.errors


def test_lambda_max_both_spaces_against_the_oracle(case):
    spec, w, x, E, res = case
    H = spec.n_heads
    lam_in = np.array([[float(exact.lam_max(E, h, i)) for i in range(N)] for h in range(H)])
    with mp.workdps(50):
        lam_q = np.array([[float(oracle.query_space(E, h, i)[0])
                           for i in range(N)] for h in range(H)])
    e_in, e_q = _rel(res.arrays["lam_input"], lam_in), _rel(res.arrays["lam_query"], lam_q)
    print("lambda input", e_in, "query", e_q)
    assert e_in <= tolerances.FLOAT64_REL and e_q <= tolerances.FLOAT64_REL


def _step_error_bound(E, h: int, i: int, Lh, M, m: int) -> mp.mpf:
    """Bound on the error of a float64 ``E_i(step) - E_i(0)`` (original gauge), features ``a_j =
    hat L hat k_j`` with ``hat k_j = [k~_j; beta_ij]`` and the step ``M``: the errors of ``E(0)``
    and ``E(step)`` add, each ``tolerances.descent_bound`` of its evaluated terms' size, the
    sizes as tests/test_paths_vs_exact.py computes them (the keys' own sizes ``|k~_j|`` counted
    twice, as ``|k~_j - k_o| + |k~_j| + |k_o|`` with ``k_o = 0``)."""
    d, r = E.spec.head_dim, E.spec.r
    c, _ = exact.coefficients(E, h, i)
    perm = list(np.flatnonzero(E.mask[i]))
    smax = max(abs(E.s[h, i, j]) for j in perm)
    f = tolerances.descent_bound(torch.float64, 1.0, N, d, m, smax)  # per unit size, N keys
    mu = E.mu[h, i]
    kh = {j: list(E.k[h, j]) + [E.beta[h, i, j]] for j in perm}
    ka = {j: [2 * abs(x) for x in kh[j]] for j in perm}
    vabs = {j: [abs(E.v[h, j, x] - mu[x]) + abs(E.v[h, j, x]) + abs(mu[x]) for x in range(r)]
            for j in perm}
    b0 = f * mp.fsum(c[j] * mp.fsum(x * x for x in vabs[j]) for j in perm) / 2
    tabs = mp.matrix(d + 1, r)  # the terms' size of [T; b]
    for j in perm:
        for a in range(d + 1):
            for x in range(r):
                tabs[a, x] += abs(c[j]) * ka[j][a] * (abs(E.v[h, j, x] - mu[x]) + abs(E.v[h, j, x]))
    LL = mp.matrix([[abs(Lh[a, b]) for b in range(d + 1)] for a in range(Lh.rows)])
    G2 = LL.T * LL * tabs  # |hat L|^T |hat L| Tabs, (d+1) x r
    s1 = s2 = mp.mpf(0)
    for j in perm:
        a_j = [mp.fsum(Lh[a, b] * kh[j][b] for b in range(d + 1)) for a in range(Lh.rows)]
        for x in range(r):
            res = mp.fsum(a_j[a] * M[a, x] for a in range(Lh.rows)) - (E.v[h, j, x] - mu[x])
            rho = (mp.fsum(ka[j][a] * G2[a, x] for a in range(d + 1))
                   + abs(E.v[h, j, x]) + abs(mu[x]))
            s1 += c[j] * abs(res) * rho
            s2 += c[j] * rho * rho / 2
    return b0 + f * s1 + f * f * s2


def test_descent_verdicts_against_the_oracle(case):
    """The atlas's verdicts "the unit step increases E" in input and query space against the
    oracle's, wherever the exact gap ``E(step) - E(0)`` exceeds the derived bound on a float64
    evaluation's error (:func:`_step_error_bound`); below it rounding may decide, and there the
    fast layer's own gap (``fast.descent``, ``fast.query_descent``) must lie within twice the
    bound -- a near-tie in float64 too (as tests/test_query_descent.py)."""
    spec, w, x, E, res = case
    H, d, m = spec.n_heads, spec.head_dim, x.shape[1]
    pos = np.arange(N)
    st_ = fast.step(spec, w, x, pos, x, pos, "causal", delta_m=True)
    f_in, f_q = fast.descent(st_), fast.query_descent(st_)
    gaps = {"input": np.zeros((H, N)), "query": np.zeros((H, N))}
    bnds = {"input": np.zeros((H, N)), "query": np.zeros((H, N))}
    with mp.workdps(50):
        for h in range(H):
            sc = exact.score_scale(E.spec, h)
            Lq = mp.diag([sc] * d + [mp.mpf(1)])  # query space: a^_j = [scale k~_j; beta_ij]
            for i in range(N):
                M = exact.delta_m(E, h, i)
                e0 = exact.objective(E, h, i, M * 0)
                gaps["input"][h, i] = float(exact.objective(E, h, i, M) - e0)
                L = E.extras["L"][h, i]
                Lh = mp.matrix(m + 1, d + 1)  # input space: hat L = [L_i | e_{m+1}]
                for a in range(m + 1):
                    for b in range(d):
                        Lh[a, b] = L[a, b]
                Lh[m, d] = 1
                bnds["input"][h, i] = float(_step_error_bound(E, h, i, Lh, M, m))
                _, eq0, eq = oracle.query_space(E, h, i)
                gaps["query"][h, i] = float(eq - eq0)
                bnds["query"][h, i] = float(_step_error_bound(
                    E, h, i, Lq, exact.query_space_delta_m(E, h, i), m))
    fast_gap = {"input": (f_in.e1 - f_in.e0).numpy(), "query": (f_q.e1 - f_q.e0).numpy()}
    outcomes = set()
    for space in ("input", "query"):
        g, b = gaps[space], bnds[space]
        clear = np.abs(g) > b
        print(space, "space increases", (g > 0).mean(), "clear", clear.mean(),
              "max bound", b.max(), "min |gap|", np.abs(g).min())
        np.testing.assert_array_equal(res.arrays[f"inc_{space}"][clear], (g > 0)[clear])
        assert np.all(np.abs(fast_gap[space])[~clear] <= 2 * b[~clear]), space
        outcomes |= set((g > 0)[clear].tolist())
    assert outcomes == {True, False}  # the case has both outcomes where the verdict is decided


def test_frozen_reuse_and_tv_against_the_oracle(case):
    spec, w, x, E, res = case
    H = spec.n_heads
    y = exact.to_float(E.y)
    fr = np.full((H, N), np.nan)
    tv = np.full((H, N), np.nan)
    for h in range(H):
        for i in range(N):
            a = (i // ANCHOR) * ANCHOR
            if a == i:
                continue
            M = exact.to_float(exact.delta_m(E, h, a)).reshape(x.shape[1] + 1, spec.r)
            u = exact.to_float(E.u[h, i])
            pred = exact.to_float(E.mu[h, a]) + u @ M
            fr[h, i] = float(((y[h, i] - pred) ** 2).sum())
            pi = np.array([float(mp.exp(E.s[h, i, j]) / E.Z[h, i]) if E.mask[i, j] else 0.0
                           for j in range(N)])
            pa = np.array([float(mp.exp(E.s[h, a, j]) / E.Z[h, a]) if E.mask[a, j] else 0.0
                           for j in range(N)])
            tv[h, i] = 0.5 * np.abs(pi - pa).sum()
    a = res.arrays
    assert np.array_equal(np.isnan(a["reuse_frozen"]), np.isnan(fr))
    sel = ~np.isnan(fr)
    e_fr, e_tv = _rel(a["reuse_frozen"][sel], fr[sel]), _rel(a["tv"][sel], tv[sel])
    print("frozen", e_fr, "tv", e_tv)
    assert e_fr <= tolerances.FLOAT64_REL and e_tv <= tolerances.FLOAT64_REL


def test_summary_and_replication_statistic(case):
    spec, w, x, E, res = case
    out = layercheck.summarise_layer([res], spec, x.shape[1], N, torch.float32)
    assert out["passed"], out
    h0 = out["heads"][0]
    fr, co = res.arrays["reuse_frozen"][0], res.arrays["reuse_const"][0]
    sel = ~np.isnan(fr)
    # sqrt of a quotient of two sums of n non-negative terms, both sides in their own order:
    # each within gamma_{n + 2} of the exact value (nonnegative_ops_rel), so twice that apart
    n = int(sel.sum())
    assert math.isclose(h0["reuse"]["rrmse_vs_constant_anchor"],
                        math.sqrt(fr[sel].sum() / co[sel].sum()),
                        rel_tol=2 * tolerances.nonnegative_ops_rel(n + 2))
    rep = layercheck.replication_style({0: [res.arrays["inc_query"][:, -1] > 0]},
                                  {0: [res.arrays["lam_query"][:, -1]]})
    assert rep["pooled"]["heads"] == spec.n_heads
    assert rep["pooled"]["increase"] == int(res.arrays["inc_query"][:, -1].sum())


# ---------------------------------------------------------------------------------------------
# the native comparison has power: capture mutations fail it
# ---------------------------------------------------------------------------------------------
def _native_rel(res) -> float:
    return float(np.max(res.arrays["native_abs"].max(1) / res.native_scale))


def test_capture_mutations_fail_the_native_comparison(case, monkeypatch):
    spec, w, x, E, res = case
    native = torch.as_tensor(exact.to_float(E.y)).permute(1, 0, 2)
    tol = tolerances.native_rel_tol(N, spec.head_dim, x.shape[1])
    assert _native_rel(res) <= tol
    # the wrong layer's input (another layer's hidden states, same width)
    _, _, x_other = layer(seed=5)
    wrong = layercheck.evaluate_layer(spec, w, x_other, torch.arange(N), native, anchor_every=ANCHOR)
    # an off-by-one position: the model's output of token i compared at token i + 1
    shifted = layercheck.evaluate_layer(spec, w, x, torch.arange(N), torch.roll(native, 1, 0),
                                   anchor_every=ANCHOR)
    # the bank excluding the query's own key
    monkeypatch.setattr(scale, "causal_chunk_mask",
                        lambda pos, qi, n, window=None, chunk=None:
                        pos[None, :n] < pos[qi][:, None] + (qi[:, None] == 0))
    noself = layercheck.evaluate_layer(spec, w, x, torch.arange(N), native, anchor_every=ANCHOR)
    for name, r in (("wrong layer", wrong), ("off by one", shifted), ("no self", noself)):
        print(name, _native_rel(r), "tol", tol)
        assert _native_rel(r) > tolerances.NATIVE_DETECT_FACTOR * tol, name


def test_capture_mutations_fail_the_model_dtype_comparison(case):
    """The per-query kappa-aware bound on the float32 max-key readout against the native output
    (``tolerances.model_dtype_native_bound``) holds on the oracle's output and is violated by a
    wrong capture (an off-by-one position, the wrong layer's input)."""
    spec, w, x, E, res = case
    m = x.shape[1]
    ok = layercheck.summarise_layer([res], spec, m, N, torch.float32)
    assert all(h["checks"]["model_dtype_vs_native"] for h in ok["heads"])
    native = torch.as_tensor(exact.to_float(E.y)).permute(1, 0, 2)
    _, _, x_other = layer(seed=5)
    for name, r in (
            ("off by one", layercheck.evaluate_layer(spec, w, x, torch.arange(N),
                                                torch.roll(native, 1, 0), anchor_every=ANCHOR)),
            ("wrong layer", layercheck.evaluate_layer(spec, w, x_other, torch.arange(N), native,
                                                 anchor_every=ANCHOR))):
        out = layercheck.summarise_layer([r], spec, m, N, torch.float32)
        ratios = [h["model_dtype_vs_native_bound_ratio_max"] for h in out["heads"]]
        print(name, ratios)
        assert not out["passed"] and max(ratios) > tolerances.NATIVE_DETECT_FACTOR, name
        assert not any(h["checks"]["model_dtype_vs_native"] for h in out["heads"]), name


def test_model_dtype_bound_grows_with_kappa():
    """The bound is kappa-aware: at kappa 1000 it is ~1000 times the readout part at kappa 1,
    while the model-side part (a convex combination, condition 1) does not move."""
    b1 = tolerances.model_dtype_native_bound(torch.float32, 1.0, 512, 64, 576, 10.0, 5.0, 1.0, 0.0)
    b2 = tolerances.model_dtype_native_bound(torch.float32, 1e3, 512, 64, 576, 10.0, 5.0, 1.0, 0.0)
    # each bound is 7 operations on non-negative numbers (readout_bound's 3 sums and 3 products,
    # the sum with the model side), the quotient one more: gamma_15
    assert math.isclose(float(b2 / b1), 1e3, rel_tol=tolerances.nonnegative_ops_rel(15))
    side = tolerances.model_dtype_native_bound(torch.float32, 1e3, 512, 64, 576, 10.0, 5.0, 0.0,
                                               1.0)
    # native_rel_tol times the scale 1 plus the readout part times 0: two operations
    assert math.isclose(float(side), tolerances.native_rel_tol(512, 64, 576),
                        rel_tol=tolerances.nonnegative_ops_rel(2))
