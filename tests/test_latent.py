"""Multi-head latent attention (family ``"latent"``, docs/math.md section 14) in the fast layer
against the exact oracle.

The fast layer's absorbed form (:func:`ropestep.kernel.latent_qkv`: one key ``[k_rope; c]`` per
token shared by every head, per-head values ``c W_uv[h]``, the query a plain projection or a
normed query latent) against the mpmath oracle's (:func:`ropestep.exact.build`, which sums the
same definitions key by key at 60 digits): the softmax output, the readout ``mu + u^T dM``
(affine: no query latent) or ``mu + q T`` (query space), and the matrices, in every gauge, to
:data:`ropestep.tolerances.FLOAT64_REL` -- and the readout within the kappa-aware bound, as for
every other family (tests/test_fast_vs_exact.py).  The streamed layer path agrees with the
per-query one.  A wrong absorption (the latent normed with the rotated part, the value map of
another head, the key's two parts swapped) fails the comparison.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropestep import exact, fast, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, LatentSpec, RoPESpec
from oracle import checked_kappa, top2_gap

F64_REL = tolerances.FLOAT64_REL


def latent_head(*, seed: int = 0, H: int = 2, rank: int = 4, rope: int = 4, r: int = 3,
                m: int = 5, q_rank: int | None = None, N: int = 6, biases: bool = True,
                amp: float = 0.6, freqs: tuple | None = None):
    """A seeded latent head and its inputs: ``(spec, weights, x, positions)``."""
    rng = np.random.default_rng(seed)
    d = rank + rope
    fr = freqs or tuple([0.9 ** (2 * i) for i in range(rope // 2)] + [0.0] * (rank // 2))
    spec = HeadSpec(n_heads=H, n_kv_heads=H, head_dim=d, v_dim=r, family="latent",
                    latent=LatentSpec(rank, rope, q_rank, kv_eps=1e-6, q_eps=1e-5),
                    rope=RoPESpec(layout="interleaved", freqs=fr))
    q_in = m if q_rank is None else q_rank
    R = rng.standard_normal
    w = HeadWeights(
        w_q=R((q_in, H, d)) * amp, w_k=None, w_v=None,
        b_q=R((H, d)) * amp if biases else None,
        w_kr=R((m, rope)) * amp, b_kr=R(rope) * amp if biases else None,
        w_kc=R((m, rank)), b_kc=R(rank) if biases else None,
        kv_norm=rng.uniform(0.5, 1.5, rank) * amp, w_uv=R((rank, H, r)),
        b_uv=R((H, r)) if biases else None,
        w_qa=None if q_rank is None else R((m, q_rank)),
        b_qa=None if q_rank is None or not biases else R(q_rank),
        qa_norm=None if q_rank is None else rng.uniform(0.5, 1.5, q_rank))
    x = R((N, m))
    return spec, w, x, np.arange(N)


def _matrices(st_: fast.Step, spec) -> np.ndarray:
    if spec.affine:
        return st_.delta_m.numpy()
    b = st_.b if st_.b is not None else torch.zeros_like(st_.t[:, :, 0])
    return torch.cat((st_.t, b[:, :, None]), 2).numpy()


def _compare(spec, w, x, pos, gauges=("original", "maxkey")) -> dict:
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=60)
    y_ex = exact.to_float(E.y)
    vs = np.abs(exact.to_float(E.v)).max(axis=(1, 2))[:, None]
    out = {}
    for g in gauges:
        st_ = fast.step(spec, w, x, pos, x, pos, "causal", gauge=g, delta_m=spec.affine)
        ey = (np.abs(st_.y.numpy() - y_ex).max(-1) / vs).max()
        er = np.abs(st_.readout.numpy() - y_ex).max(-1) / vs
        kap = checked_kappa(E, st_, g)
        smax = np.where(E.mask[None], np.abs(st_.s.numpy()), 0).max(-1)
        tol_r = np.maximum(F64_REL, tolerances.readout_bound(torch.float64, kap, x.shape[0],
                                                             spec.head_dim, smax))
        Me = exact.to_float(exact.all_delta_m(E, g))
        H, Q = Me.shape[:2]
        mabs = np.array([[float(exact.delta_m_abs(E, h, i, g)) for i in range(Q)]
                         for h in range(H)])
        em = np.abs(_matrices(st_, spec) - Me).max(axis=(2, 3)) / np.maximum(
            mabs, tolerances.SCALE_GUARD)
        if g == "maxkey":  # j* is ambiguous at (near-)ties: compare only clear maxima
            clear = np.array([[top2_gap(E, h, i) > tolerances.MAXKEY_TIE for i in range(Q)]
                              for h in range(H)])
            em = np.where(clear, em, 0.0)
        out[g] = (float(ey), float((er / tol_r).max()), float(em.max()))
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), H=st.integers(1, 3), rank=st.sampled_from([2, 4, 6]),
       rope=st.sampled_from([0, 2, 4]), r=st.integers(1, 4), m=st.integers(2, 6),
       q_rank=st.sampled_from([None, 3, 5]), N=st.integers(1, 7), biases=st.booleans())
def test_float64_matches_exact(seed, H, rank, rope, r, m, q_rank, N, biases):
    spec, w, x, pos = latent_head(seed=seed, H=H, rank=rank, rope=rope, r=r, m=m, q_rank=q_rank,
                                  N=N, biases=biases)
    for g, (ey, ratio, em) in _compare(spec, w, x, pos).items():
        assert ey <= F64_REL, (g, ey)
        assert ratio <= 1.0, (g, ratio)
        assert em <= F64_REL, (g, em)


def test_affine_exactly_without_a_query_latent():
    a, _, _, _ = latent_head(q_rank=None)
    b, _, _, _ = latent_head(q_rank=4)
    assert a.affine and not b.affine
    # input space: dM_i = L_i T_i exists and reads y_i = mu_i + u_i^T dM_i
    spec, w, x, pos = latent_head(q_rank=None, N=5)
    st_ = fast.step(spec, w, x, pos, x, pos, "causal", delta_m=True)
    u = np.concatenate([x, np.ones((5, 1))], 1)
    rd = st_.mu.numpy() + np.einsum("qa,hqar->hqr", u, st_.delta_m.numpy())
    assert np.abs(rd - st_.y.numpy()).max() <= 1e-12 * np.abs(st_.y.numpy()).max()
    spec, w, x, pos = latent_head(q_rank=3, N=5)
    with pytest.raises(ValueError, match="not affine"):
        fast.step(spec, w, x, pos, x, pos, "causal", delta_m=True)


def test_the_streamed_layer_is_the_per_query_step():
    for q_rank in (None, 3):
        spec, w, x, pos = latent_head(seed=3, H=3, q_rank=q_rank, N=9)
        st_ = fast.step(spec, w, x, pos, x, pos, "causal", gauge="maxkey")
        got = scale.materialise(spec, w, x, pos, gauge="maxkey")
        for name in ("y", "readout"):
            a = getattr(st_, name).numpy()
            b = got[name].numpy() if isinstance(got, dict) else getattr(got, name).numpy()
            assert np.abs(a - b).max() <= 1e-13 * np.abs(a).max(), (q_rank, name)
        L = scale.project_layer(spec, w, x, pos)
        assert L.k.shape == (3, 9, spec.head_dim) and L.v.shape == (3, 9, spec.r)
        assert torch.equal(L.k[0], L.k[2])  # one key shared by every head


def test_keys_are_the_rotated_part_then_the_normed_latent():
    spec, w, x, pos = latent_head(seed=5, q_rank=None, N=4, rope=4, rank=4)
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=30)
    k0 = exact.to_float(E.k)[0, 0]  # position 0: no rotation
    kr = x[0] @ w.w_kr + w.b_kr
    cr = x[0] @ w.w_kc + w.b_kc
    c = cr / np.sqrt((cr ** 2).mean() + 1e-6) * w.kv_norm
    assert np.allclose(k0, np.concatenate([kr, c]), rtol=1e-13, atol=0)


def _norm_both(orig):
    """A mutant of the absorbed form: the key normalised as a whole (its rotated part with the
    latent) instead of the latent alone."""
    def mutant(xx, ww, heads, kv_eps, q_eps):
        q, k, v = orig(xx, ww, heads, kv_eps, q_eps)
        return q, k / torch.sqrt((k * k).mean(-1, keepdim=True) + kv_eps), v
    return mutant


@pytest.mark.parametrize("what", ["other_head_values", "swapped_parts", "norm_both"])
def test_a_wrong_absorption_fails_the_comparison(what, monkeypatch):
    spec, w, x, pos = latent_head(seed=11, H=2, q_rank=None, N=5)
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=40)
    y_ex = exact.to_float(E.y)
    w2 = replace(w)
    if what == "other_head_values":  # each head given the other head's value map
        w2.w_uv = np.roll(w.w_uv, 1, axis=1)
    elif what == "swapped_parts":  # the query's two parts in the other order
        rope = spec.latent.rope_dim
        w2.w_q = np.concatenate([w.w_q[..., rope:], w.w_q[..., :rope]], -1)
        w2.b_q = np.concatenate([w.b_q[..., rope:], w.b_q[..., :rope]], -1)
    else:
        monkeypatch.setattr(fast, "latent_qkv", _norm_both(fast.latent_qkv))
    st_ = fast.step(spec, w2, x, pos, x, pos, "causal")
    vs = np.abs(exact.to_float(E.v)).max()
    assert np.abs(st_.y.numpy() - y_ex).max() / vs > 1e3 * F64_REL
