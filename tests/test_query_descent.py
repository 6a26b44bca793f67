"""``fast.query_descent`` (the gradient step in query space, the replication's parametrisation)
against the mpmath oracle: lambda_max, E before and after the unit step, and the verdict, for
dot-product heads with biases and GQA and for a Cosine-RoPE layer (docs/math.md section 3)."""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
import torch

import oracle
from ropestep import exact, fast, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec, causal_mask

N = 9


def _layer(family: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    H, Hk, d, m = 4, 2, 4, 5

    def rnd(*s, std=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * std

    kw = dict(family=family, temperature=(0.3, 0.5, 1.0, 2.0)) if family == "cosine" else {}
    spec = HeadSpec(H, Hk, d, rope=RoPESpec(base=100.0), **kw)
    w = HeadWeights(rnd(m, H, d, std=1.2), rnd(m, Hk, d, std=1.2), rnd(m, Hk, d),
                    rnd(H, d, std=0.5), rnd(Hk, d, std=0.5), rnd(Hk, d, std=0.3))
    return spec, w, rnd(N, m)


@pytest.mark.parametrize("family, seed", [("dot", 0), ("dot", 3), ("cosine", 1)])
def test_query_descent_against_the_oracle(family, seed):
    spec, w, x = _layer(family, seed)
    pos = np.arange(N)
    mask = causal_mask(pos, pos)
    st = fast.step(spec, w, x, pos, x, pos, mask=mask, dtype=torch.float64)
    dc = fast.query_descent(st)
    E = exact.build(spec, w, x.numpy(), pos, x.numpy(), pos, mask, dps=50)
    H = spec.n_heads
    lam, e0, e1 = (np.zeros((H, N)) for _ in range(3))
    with mp.workdps(50):
        for h in range(H):
            for i in range(N):
                lam[h, i], e0[h, i], e1[h, i] = (
                    float(v) for v in oracle.query_space(E, h, i))
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))  # noqa: E731
    errs = rel(dc.lam_max, lam), rel(dc.e0, e0), rel(dc.e1, e1)
    print(family, "lambda / E0 / E1 rel", errs, "increases", (e1 > e0).mean())
    assert max(errs) <= tolerances.FLOAT64_REL
    # the verdict E1 > E0: each side is within FLOAT64_REL of its scale (asserted above), so
    # the fast verdict is the oracle's wherever the exact gap exceeds both errors; below that
    # (exact ties: a query's only key gives E0 = E1 = 0) rounding may decide, within the bound
    f0, f1 = dc.e0.numpy(), dc.e1.numpy()
    tie = tolerances.FLOAT64_REL * (np.abs(e0).max() + np.abs(e1).max())
    clear = np.abs(e1 - e0) > tie
    np.testing.assert_array_equal((f1 > f0)[clear], (e1 > e0)[clear])
    assert np.all(np.abs(f1 - f0)[~clear] <= 2 * tie)
    if family == "dot" and seed == 0:
        assert 0 < (e1 > e0).mean() < 1  # both outcomes occur: the verdict is not vacuous


def test_query_descent_detects_a_wrong_scale(monkeypatch):
    """Dropping the score scale from the query-space Hessian changes lambda_max by 1/scale^2."""
    spec, w, x = _layer("dot", 0)
    pos = np.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, mask=causal_mask(pos, pos), dtype=torch.float64)
    good = fast.query_descent(st)
    orig = fast.query_space_step
    monkeypatch.setattr(fast, "query_space_step", lambda G, t, s: orig(G, t, torch.ones_like(s)))
    bad = fast.query_descent(st)
    assert float((bad.lam_max / good.lam_max).min()) > 1.9  # scale^2 = 1/4 here


def test_query_descent_refuses_other_gauges():
    spec, w, x = _layer("dot", 0)
    pos = np.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, mask=causal_mask(pos, pos), dtype=torch.float64,
                   gauge="maxkey")
    with pytest.raises(ValueError, match="original gauge"):
        fast.query_descent(st)


def test_gram_matrix_against_the_plain_sum_in_every_form():
    """``fast.gram`` (one GEMM of the coefficient rows with ``vec(k~_j^T k~_j)``) against the sum
    ``sum_j c_ij k~_j^T k~_j`` taken key by key in mpmath; the shared-outer-product and
    ``out=`` forms the atlas uses give the same matrices bit for bit.  The bound: the GEMM sums
    ``n`` products of non-negative weights and rounded outer products, so each entry is within
    ``gamma_(n+2) sum_j c_ij |k_ja| |k_jb|`` of the exact sum (Higham, Lemma 3.5)."""
    g = torch.Generator().manual_seed(3)
    G_, Q, n, d = 3, 5, 40, 6
    c = torch.rand(G_, Q, n, generator=g, dtype=torch.float64)
    k = torch.randn(n, d, generator=g, dtype=torch.float64) * 3
    got = fast.gram(c, k)
    outer = fast.key_outer(k)
    assert outer.shape == (n, d * d)
    assert torch.equal(fast.gram(c, None, outer=outer), got)
    buf = torch.full((G_, Q, d, d), math.nan, dtype=torch.float64)
    assert fast.gram(c, None, outer=outer, out=buf) is buf
    assert torch.equal(buf, got)
    assert torch.equal(fast.gram(c, None, outer=fast.key_outer(torch.cat([k, -k]))[:n]),
                       got)  # the atlas's slice of the group's outer products
    u = float(torch.finfo(torch.float64).eps) / 2
    gam = (n + 2) * u / (1 - (n + 2) * u)
    cn, kn = c.numpy(), k.numpy()
    with mp.workdps(40):
        for (h, i) in ((0, 0), (2, 4), (1, 3)):
            for a in range(d):
                for b in range(d):
                    exact = mp.fsum(mp.mpf(cn[h, i, j]) * mp.mpf(kn[j, a]) * mp.mpf(kn[j, b])
                                    for j in range(n))
                    mag = sum(abs(cn[h, i, j] * kn[j, a] * kn[j, b]) for j in range(n))
                    assert abs(float(got[h, i, a, b]) - float(exact)) <= gam * mag


def test_query_step_change_is_the_steps_second_value():
    """``fast.query_step_change`` is the ``E(step) - E(0)`` of ``fast.query_space_step``, and a
    dropped score scale in it changes the verdict's value (it is not the unscaled formula)."""
    g = torch.Generator().manual_seed(4)
    c = torch.rand(2, 4, 30, generator=g, dtype=torch.float64)
    k = torch.randn(30, 5, generator=g, dtype=torch.float64)
    t = torch.randn(2, 4, 5, 3, generator=g, dtype=torch.float64)
    G = fast.gram(c, k)
    sc = torch.tensor([0.5, 0.25], dtype=torch.float64)[:, None]
    lam, de = fast.query_space_step(G, t, sc)
    assert torch.equal(de, fast.query_step_change(G, t, sc))
    assert torch.allclose(lam, sc ** 2 * torch.linalg.eigvalsh(G)[..., -1], rtol=1e-13)
    s2 = sc ** 2
    quad = torch.einsum("hqab,hqac,hqbc->hq", G, t, t)  # <T, G T>, another summation order
    ref = s2 * (0.5 * s2 * quad - (t * t).sum((-1, -2)))
    assert torch.allclose(de, ref, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(fast.query_step_change(G, t, torch.ones_like(sc)), de)
