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


def test_normalised_bound_covers_float32_layer_norm():
    """realchecks._normalised_abs with a LayerNorm's bias against a float32 projection and
    ``torch.nn.functional.layer_norm`` (as Persimmon's module computes it) of random inputs, with
    a common offset of the projected entries up to 50x their spread: every entry within the
    bound, and the bound not loose by more than 100x on the power cases (non-negative inputs and
    weights: the projection's partial sums as large as they can be) -- measured 0.024-0.040
    there; a bound 10x looser fails this test."""
    from ropestep import realchecks as rc

    gen = torch.Generator().manual_seed(1)
    n, Hh, d, m, eps = 16, 4, 32, 128, 1e-5
    ratios = {}
    for offset in (0.0, 5.0, 50.0):
        for trial in range(4):
            x = torch.randn(n, m, generator=gen).float()
            W = (torch.randn(Hh * d, m, generator=gen) * (0.1 if trial % 2 else 1.0)).float()
            if trial % 2 == 0:  # power: non-negative terms, the partial sums as large as can be
                x, W = x.abs(), W.abs()
            b = (torch.full((Hh * d,), offset) + torch.randn(Hh * d, generator=gen)).float()
            g = (1.0 + 0.3 * torch.randn(d, generator=gen)).float()
            beta = (0.5 * torch.randn(d, generator=gen)).float()
            z32 = (x @ W.T + b).view(n, Hh, d)
            y32 = torch.nn.functional.layer_norm(z32, (d,), g, beta, eps)
            z = (x.double() @ W.double().T + b.double()).view(n, Hh, d)
            A = (x.double().abs() @ W.double().abs().T + b.double().abs()).view(n, Hh, d)
            y = rc._apply_model_norm(z, g.double(), eps, "head", beta.double())
            bound = rc._normalised_abs(torch.float32, z, A, m + 1, g.double(), eps, "head", 0,
                                       beta.double())
            ratios[offset, trial] = float(((y32.double() - y).abs() / bound).max())
    print("err / bound:", {k: round(v, 4) for k, v in ratios.items()})
    assert max(ratios.values()) <= 1.0
    assert max(v for (_, t), v in ratios.items() if t % 2 == 0) > 0.01


@pytest.mark.model
def test_a_common_offset_of_the_projections_is_no_false_failure():
    """Persimmon with every query and key bias shifted by 3e4 (a correct model: the LayerNorm
    centres the offset away, but the float32 projection's rounding of 3e4 stays): the real
    checks' count-based tolerances carry the centring's gain (realchecks.centring_gain), so the
    position derivative's anchor still passes; without a shift the tolerance stays at the RMS
    form's size (the check keeps its power)."""
    from ropestep import api, archzoo, realchecks as rc

    tols = {}
    for off in (0.0, 3e4):
        m = archzoo.build("persimmon")
        H, d = m.config.num_attention_heads, m.config.hidden_size // m.config.num_attention_heads
        with torch.no_grad():
            for blk in m.model.layers:
                bias = blk.self_attn.query_key_value.bias.view(H, 3, d)
                bias[:, :2] += off
        lr = api.attach(m).run(torch.randint(0, archzoo.VOCAB, (24,),
                                             generator=torch.Generator().manual_seed(0)),
                               layers=0)[0]
        res = rc.position_derivative(m, 0, lr.x, lr.positions, [5, 20], heads=lr.native)
        assert res["ok"] and res["anchor"]["ok"], (off, res["anchor"])
        tols[off] = res["anchor"]["tolerance"]
    assert tols[0.0] < 2e-3 < tols[3e4]
