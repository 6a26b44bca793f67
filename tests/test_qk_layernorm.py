"""QK LayerNorm with a bias (``HeadSpec.norm_kind="layer"``, Persimmon): each head's raw query
and key are centred, divided by ``sqrt(var + eps)``, scaled by ``g`` and shifted by ``beta``,
then rotated.

* The fast path (:func:`ropestep.fast.step`) and the streamed layer
  (:func:`ropestep.scale.stream`) against the mpmath oracle (:func:`ropestep.exact.build`, which
  centres and normalises with its own 50-digit sums), within
  :func:`ropestep.tolerances.agreement_rel_tol`; the query-space identity
  ``y_i = mu_i + z_i^T Delta M^q_i`` exact to the oracle's digits.
* Power: the same weights read as an RMS norm (no centring, no bias) or with the bias dropped
  are other functions, far outside that tolerance.
* The adapter (tiny Persimmon): the module's LayerNorm is read as such (``norm_kind "layer"``,
  its bias in the weights), the layer passes the library's step and check against the model's
  own output, and each wrong reading -- the LayerNorm described as an RMS norm, its bias dropped,
  its bias with the wrong sign -- fails that comparison.
* Bad input: a bias without ``norm_kind "layer"``, the LayerNorm form after the rotation.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ropestep import exact, fast, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

N, M, H, HK, D = 9, 5, 4, 2, 6
F64 = torch.float64


def _layer(kind: str = "layer"):
    g = torch.Generator().manual_seed(5)
    spec = HeadSpec(n_heads=H, n_kv_heads=HK, head_dim=D, rope=RoPESpec(base=50.0),
                    family="qknorm", norm_kind=kind, norm_eps=1e-5, scale=1.1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    w = HeadWeights(w_q=r(M, H, D), w_k=r(M, HK, D), w_v=r(M, HK, D), b_q=r(H, D) * 0.5,
                    b_k=r(HK, D) * 0.5, q_norm=1 + 0.3 * r(D), k_norm=1 + 0.3 * r(D),
                    q_norm_bias=0.7 * r(D), k_norm_bias=0.7 * r(D))
    return spec, w, torch.randn(N, M, generator=g, dtype=F64)


def test_layer_norm_heads_match_the_oracle():
    spec, w, x = _layer()
    pos = torch.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, "causal", delta_m=False, keep=("c", "t", "b"))
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=50)
    y_ex = torch.as_tensor(exact.to_float(E.y))
    tol = tolerances.agreement_rel_tol(F64, N, D, M) * float(y_ex.abs().max())
    assert float((st.y - y_ex).abs().max()) <= tol
    ro = torch.zeros(H, N, D, dtype=F64)
    for ch in scale.stream(spec, w, x, pos, gauge="maxkey"):
        ro[ch.heads[0]:ch.heads[-1] + 1, ch.queries] = ch.readout
    assert float((ro - y_ex).abs().max()) <= tol
    # the query-space readout mu + z^T dM^q of the oracle's own matrices: exact to its digits
    from mpmath import mp
    for h in (0, 3):
        for i in (2, N - 1):
            Mq = exact.query_space_delta_m(E, h, i)
            z = mp.matrix(exact.query_space_input(E, h, i))
            with mp.workdps(50):
                ro_i = [E.mu[h, i][c] + mp.fsum(z[a] * Mq[a, c] for a in range(Mq.rows))
                        for c in range(D)]
                assert max(abs(ro_i[c] - E.y[h, i][c]) for c in range(D)) < mp.mpf(10) ** -40
    # power: the RMS form of the same weights, or the bias dropped, is another function
    for wrong_spec, wrong_w in ((replace(spec, norm_kind="rms"),
                                 replace(w, q_norm_bias=None, k_norm_bias=None)),
                                (spec, replace(w, q_norm_bias=None, k_norm_bias=None))):
        st_w = fast.step(wrong_spec, wrong_w, x, pos, x, pos, "causal", delta_m=False, keep=())
        assert float((st_w.y - y_ex).abs().max()) > 1e6 * tol


def test_bad_layer_norm_descriptions():
    spec, w, _ = _layer()
    with pytest.raises(ValueError, match="q_norm_bias is a LayerNorm's bias"):
        w.check(replace(spec, norm_kind="rms"), M)
    with pytest.raises(ValueError, match="norm_kind 'layer': per-head QK LayerNorm"):
        replace(spec, norm_after_rope=True)
    with pytest.raises(ValueError, match="norm_kind must be 'rms' or 'layer'"):
        replace(spec, norm_kind="batch")
    with pytest.raises(ValueError, match=r"k_norm_bias must have shape \(6,\)"):
        replace(w, k_norm_bias=torch.zeros(5, dtype=F64)).check(spec, M)


@pytest.mark.model
def test_persimmon_is_read_as_a_layer_norm_and_each_wrong_reading_fails():
    from ropestep import api, archzoo

    lab = api.attach(archzoo.build("persimmon"))
    assert {lab.conventions(L).norm_kind for L in lab.layers} == {"layer"}
    ids = torch.randint(0, archzoo.VOCAB, (24,), generator=torch.Generator().manual_seed(0))
    lr = lab.run(ids, layers=1)[1]
    spec, w = lr.head_description
    assert spec.norm_kind == "layer" and w.q_norm_bias is not None
    assert lr.step(2, -1).passed and lr.check(anchor_every=8).passed
    wrong = {
        "read as an RMS norm": (replace(spec, norm_kind="rms"),
                                replace(w, q_norm_bias=None, k_norm_bias=None)),
        "bias dropped": (spec, replace(w, q_norm_bias=None, k_norm_bias=None)),
        "bias sign flipped": (spec, replace(w, q_norm_bias=-w.q_norm_bias,
                                            k_norm_bias=-w.k_norm_bias)),
    }
    for what, desc in wrong.items():
        lr._spec, lr._head_cache, lr._check = desc, {}, {}
        assert not lr.check(anchor_every=8).passed, what
        assert not lr.step(2, -1).passed, what
