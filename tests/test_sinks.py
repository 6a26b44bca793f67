"""Attention sinks (gpt-oss): the identity with a learned per-head logit in the denominator
(docs/math.md section 13, "Attention sinks").

A sink adds ``e^(sigma_h)`` to the softmax denominator and nothing to the numerator:
``y_i = sum_j e^(s_ij) v_j / (Z_i + e^(sigma_h))``.  The statement: this is the softmax over the
permitted keys plus one more key with score ``sigma_h`` (independent of the query) and value 0, so
the identity holds with ``N_i + 1`` keys, feature ``a_sink = sigma_h e_(m+1)`` (``u_i . a_sink =
sigma_h`` since ``u``'s last entry is 1), uniform mean ``N_i mu_i / (N_i + 1)`` and positive
weights ``c_ij = rho(s_ij) / Z'_i``.  Verified here

* in mpmath at 50 digits: the sink softmax computed directly against ``mu' + u^T dM'`` built from
  the oracle's own features, scores and values plus the sink key;
* in the fast layer: the same virtual key (a zero key and value, the logit as an additive bias in
  the augmented coordinate) through :func:`ropestep.fast.step`, against the direct mpmath sink
  softmax -- and without the sink (power) the output is another one.

* through the head description (``HeadSpec.sinks``): the fast layer's per-query path
  (:func:`ropestep.fast.step`, the sink appended as the last key by
  :func:`ropestep.kernel.with_sink`) and its streamed path (:mod:`ropestep.scale`, the kernel's
  own sink column) against the oracle's (:func:`ropestep.exact.build`, the same virtual key at 50
  digits), in both key gauges, the matrices included; a description without the sink, or with
  another logit, misses.

The layer paths (``atlas``, ``validate``) read a model's sink logits from the parameter its eager
call is handed (``models.conventions``) and run on this form (gpt-oss in the architecture
matrix).
"""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
import torch

from ropestep import exact, fast, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

N, M, H, HK, D = 7, 5, 4, 2, 4
F64 = torch.float64


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    spec = HeadSpec(n_heads=H, n_kv_heads=HK, head_dim=D, rope=RoPESpec(base=30.0), scale=0.9)
    w = HeadWeights(w_q=r(M, H, D), w_k=r(M, HK, D), w_v=r(M, HK, D), b_q=r(H, D) * 0.5)
    sinks = r(H) * 2.0  # one logit per query head
    return spec, w, r(N, M), sinks


def _direct(E, sinks) -> np.ndarray:
    """``sum_j e^(s_ij) v_j / (Z_i + e^(sigma_h))`` at the oracle's precision, (H, N, r)."""
    out = np.empty((H, N, D), dtype=object)
    with mp.workprec(E.prec):
        for h in range(H):
            sig = mp.mpf(float(sinks[h]))
            for i in range(N):
                js = np.flatnonzero(E.mask[i])
                den = mp.fsum([mp.exp(E.s[h, i, j]) for j in js]) + mp.exp(sig)
                for c in range(D):
                    out[h, i, c] = mp.fsum([mp.exp(E.s[h, i, j]) * E.v[h, j][c] for j in js]) / den
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_the_sink_identity_in_mpmath(seed):
    spec, w, x, sinks = _case(seed)
    pos = np.arange(N)
    E = exact.build(spec, w, x.numpy(), pos, x.numpy(), pos, "causal", dps=50)
    want = _direct(E, sinks)
    with mp.workprec(E.prec):
        for h in range(H):
            sig = mp.mpf(float(sinks[h]))
            for i in range(N):
                js = list(np.flatnonzero(E.mask[i]))
                feats = [list(E.feats[h, i, j]) for j in js] + [[0] * M + [sig]]
                vals = [list(E.v[h, j]) for j in js] + [[mp.mpf(0)] * D]
                u = list(E.u[h, i])
                s = [mp.fsum(a * b for a, b in zip(u, f)) for f in feats]
                assert abs(s[-1] - sig) <= mp.mpf(10) ** -40 * (1 + abs(sig))
                Z = mp.fsum([mp.exp(t) for t in s])
                mu = [mp.fsum([v[c] for v in vals]) / len(vals) for c in range(D)]
                c = [exact.phi1(t) / Z for t in s]  # rho(s) / Z'

                assert min(c) > 0
                y = [mu[k] + mp.fsum([c[j] * s[j] * (vals[j][k] - mu[k]) for j in range(len(s))])
                     for k in range(D)]  # u^T dM' = sum_j c_j (u . a_j)(v_j - mu')
                for k in range(D):
                    assert abs(y[k] - want[h, i, k]) <= mp.mpf(10) ** -45 * (1 + abs(want[h, i, k]))
                    # the uniform mean over N_i + 1 keys is N_i mu_i / (N_i + 1)
                    assert abs(mu[k] - len(js) * E.mu[h, i][k] / (len(js) + 1)) <= mp.mpf(10) ** -45


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fast_layer_reads_a_sink_as_one_more_key(seed):
    spec, w, x, sinks = _case(seed)
    pos = np.arange(N)
    E = exact.build(spec, w, x.numpy(), pos, x.numpy(), pos, "causal", dps=50)
    want = torch.tensor(exact.to_float(_direct(E, sinks)), dtype=F64)
    # the virtual key: a zero input (no k/v biases: a zero key and value), always permitted, with
    # the logit in the additive bias; its position is irrelevant (a zero key rotates to zero)
    xk = torch.cat((x, torch.zeros(1, M, dtype=F64)))
    pk = np.concatenate((pos, [0]))
    mask = np.concatenate((np.tril(np.ones((N, N), dtype=bool)), np.ones((N, 1), dtype=bool)), 1)
    bias = torch.zeros(H, N, N + 1, dtype=F64)
    bias[:, :, -1] = sinks[:, None]
    st = fast.step(spec, w, x, pos, xk, pk, mask, bias=bias, dtype=F64)
    tol = tolerances.agreement_rel_tol(F64, N + 1, D, M) * float(want.abs().max())
    assert float((st.y - want).abs().max()) <= tol
    assert float((st.readout - want).abs().max()) <= tol  # mu' + q T' + b': the identity
    assert float(st.c.masked_fill(~torch.as_tensor(mask)[None], 1.0).min()) > 0
    plain = fast.step(spec, w, x, pos, x, pos, "causal", dtype=F64)
    assert float((plain.y - want).abs().max()) > 1e3 * tol  # power: the sink matters


@pytest.mark.parametrize("seed", [0, 1])
def test_a_head_description_with_sinks_is_the_oracles(seed):
    from dataclasses import replace

    from ropestep import scale

    spec, w, x, sinks = _case(seed)
    pos = np.arange(N)
    E0 = exact.build(spec, w, x.numpy(), pos, x.numpy(), pos, "causal", dps=50)
    want = exact.to_float(_direct(E0, sinks))
    s2 = replace(spec, sinks=tuple(float(v) for v in sinks))
    E = exact.build(s2, w, x.numpy(), pos, x.numpy(), pos, "causal", dps=50)
    assert np.abs(exact.to_float(E.y) - want).max() <= 1e-40  # the oracle's own sink key
    vs = np.abs(exact.to_float(E.v)).max()
    for g in ("original", "maxkey"):
        st = fast.step(s2, w, x, pos, x, pos, "causal", gauge=g, delta_m=True)
        assert st.c.shape == (H, N, N + 1) and bool((st.c[:, :, -1] > 0).all())  # the sink's c
        assert np.abs(st.y.numpy() - want).max() / vs <= tolerances.FLOAT64_REL
        kap = st.kappa.numpy()
        tol = np.maximum(tolerances.FLOAT64_REL, tolerances.readout_bound(
            F64, kap, N + 1, D, np.abs(st.s.numpy()).max(-1)))
        assert (np.abs(st.readout.numpy() - want).max(-1) / vs <= tol).all()
        Me = exact.to_float(exact.all_delta_m(E, g))
        mabs = np.array([[float(exact.delta_m_abs(E, h, i, g)) for i in range(N)]
                         for h in range(H)])
        em = np.abs(st.delta_m.numpy() - Me).max(axis=(2, 3)) / np.maximum(
            mabs, tolerances.SCALE_GUARD)
        assert em.max() <= tolerances.FLOAT64_REL, (g, em.max())
        got = scale.materialise(s2, w, x, pos, gauge=g)  # the streamed path, the kernel's sink
        assert float((got["y"] - st.y).abs().max()) / vs <= tolerances.FLOAT64_REL
        assert (np.abs(got["readout"].numpy() - want).max(-1) / vs <= tol).all()
    for wrong in (None, tuple(float(v) + 1.0 for v in sinks)):  # power: no sink, another logit
        st = fast.step(replace(spec, sinks=wrong), w, x, pos, x, pos, "causal")
        assert np.abs(st.y.numpy() - want).max() / vs > 1e6 * tolerances.FLOAT64_REL


def test_sinks_are_one_finite_logit_per_head_and_never_capped():
    spec, _, _, sinks = _case(0)
    from dataclasses import replace

    with pytest.raises(ValueError, match="one finite logit per query head"):
        replace(spec, sinks=(0.0,) * (H - 1))
    with pytest.raises(ValueError, match="one finite logit per query head"):
        replace(spec, sinks=(math.inf,) + (0.0,) * (H - 1))
    with pytest.raises(ValueError, match="soft-cap"):
        replace(spec, sinks=(0.0,) * H, softcap=30.0)
