"""The attention-variant modules of :mod:`ropestep.families` against the suite (docs/math.md
section 11).

* every variant's head outputs (the module's own forward) against the identity's readout through
  ``fast``/``scale``, float64 and float32, and against the mpmath oracle on a few queries;
* the query-space gradient step (``fast.query_delta_m``, ``fast.query_descent``)
  against its oracle counterpart (``exact.query_space_*``), cosine heads included;
* the frequency ordering ``omega_l = base^(-2l/d)`` and the barycenter orientation, both layouts;
* the Hugging Face replacement (tiny Llama/Qwen2 from a config, no network);
* mutations -- query-only normalisation, per-pair normalisation, ``* tau`` for ``/ tau``, another
  head's base, a reversed frequency index -- each turning a check red while the correct module
  passes the same check.

Tolerances come from :mod:`ropestep.tolerances` (see :func:`ropestep.families.check_module` for
how they are composed); nothing numeric is inlined.
"""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
import torch

from ropestep import exact, fast, families as fm, rope
from ropestep import tolerances as tl
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec
from oracle import out_scale

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
DPS = 40
IDENTITY_CHECKS = ("identity_float64_fast", "identity_float64_scale", "identity_float32_fast",
                   "identity_float32_scale")
CFGS = {  # small: m = 16, 4 query heads over 2 KV heads, d = 8
    "standard": fm.AttentionConfig(16, 4, 2, 8, "standard", qkv_bias=True, o_bias=True),
    "cosine": fm.AttentionConfig(16, 4, 2, 8, "cosine"),
    "perhead": fm.AttentionConfig(16, 4, 2, 8, "perhead"),
}


def make(variant: str, seed: int = 0, layout: str = "half", cls=fm.RoPEAttention,
         **kw) -> fm.RoPEAttention:
    """A float64 module of the variant with seeded weights (learned parameters spread out)."""
    cfg = CFGS[variant]
    if layout != cfg.layout or kw:
        from dataclasses import replace
        cfg = replace(cfg, layout=layout, **kw)
    torch.manual_seed(seed)
    att = cls(cfg).double()
    if variant == "cosine":
        att.set_temperatures([0.5, 1.0, 2.0, math.sqrt(8)])
    if variant == "perhead":
        att.set_bases([1e3, 1e4, 1e5, 1e6])
    return att


def inputs(m: int = 16, T: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, m, generator=g, dtype=F64)


def log_round_trip(x: float) -> float:
    """Relative error of ``exp(log x)`` (a learned ``log_tau``/``log_base`` read back):
    ``tolerances.exp_of_sum_rel`` of one term of size ``|log x|``."""
    return tl.exp_of_sum_rel(abs(math.log(x)), 1)


def ratio(res: dict, name: str) -> float:
    return max(res["checks"][name])


# ---------------------------------------------------------------------------------------------
# the identity on every variant, against the module's own forward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("variant", fm.VARIANTS)
def test_identity_vs_own_forward(variant, layout):
    att = make(variant, layout=layout)
    x = inputs()
    pos = torch.tensor([0, 1, 2, 3, 3, 5, 8, 9, 10, 11, 13, 20])  # gaps and a repeat
    res = fm.check_module(att, x, pos)
    for name in IDENTITY_CHECKS:
        print(variant, layout, name, ratio(res, name))
    assert res["passed"], res["failures"]
    # float64: within the suite's float64 agreement level, as for the other families
    e64 = max(h["identity_float64_rel"] for h in res["heads"])
    assert e64 <= tl.FLOAT64_REL, e64
    for name in IDENTITY_CHECKS:
        assert 0.0 <= ratio(res, name) <= 1.0


@pytest.mark.parametrize("variant", fm.VARIANTS)
def test_against_the_exact_oracle(variant):
    """The module's float64 head outputs, the fast readout and the query-space step against
    mpmath (:mod:`ropestep.exact`, built from the module's head description) on two queries."""
    att = make(variant)
    x = inputs(T=10)
    pos = torch.arange(10)
    spec, w = att.head_description(F64)
    qs = [4, 9]
    E = exact.build(spec, w, x[qs], pos[qs], x, pos, "causal", dps=DPS)
    with torch.no_grad():
        nat = att.head_outputs(x[None], pos)[0][:, qs]  # (H, 2, r)
    st = fast.step(spec, w, x[qs], pos[qs], x, pos, "causal", keep=("c", "t", "b"))
    y_ex = torch.as_tensor(exact.to_float(E.y))
    vs = float(np.abs(exact.to_float(E.v)).max())
    S = torch.tensor([[float(out_scale(E, h, a)) for a in range(len(qs))]
                      for h in range(spec.n_heads)], dtype=F64)[..., None]  # per-query scale
    e_nat = float(((nat - y_ex).abs() / S).max())
    e_ro = float(((st.readout - y_ex).abs() / S).max())
    print(variant, "native", e_nat, "readout", e_ro)
    assert e_nat <= tl.agreement_rel_tol(F64, 10, spec.head_dim, x.shape[1])
    assert e_ro <= tl.FLOAT64_REL
    # the query-space step: Delta M^q, lambda_max, E before and after, against the oracle
    dmq = fast.query_delta_m(st)
    dc = fast.query_descent(st)
    smax = float(st.s.abs().max())
    for h in range(spec.n_heads):
        for a, i in enumerate(qs):
            with mp.workdps(DPS):
                M = exact.query_space_delta_m(E, h, a)
                c, feats = exact.query_space_features(E, h, a)
                mabs = [[mp.fsum(abs(c[j] * feats[j][p]) * (abs(E.v[h, j, q] - E.mu[h, a, q])
                                                            + abs(E.v[h, j, q])) for j in c)
                         for q in range(spec.r)] for p in range(spec.head_dim + 1)]
                err = max(abs(mp.mpf(float(dmq[h, a, p, q])) - M[p, q])
                          / max(mabs[p][q], tl.SCALE_GUARD)
                          for p in range(spec.head_dim + 1) for q in range(spec.r))
                assert err <= tl.FLOAT64_REL, (h, i, float(err))
                # the identity in query space, exactly: y = mu + z^T Delta M^q
                z = exact.query_space_input(E, h, a)
                for q in range(spec.r):
                    ro = E.mu[h, a, q] + mp.fsum(z[p] * M[p, q] for p in range(spec.head_dim + 1))
                    assert abs(ro - E.y[h, a, q]) <= tl.exact_tol(DPS) * vs
                lam = exact.query_space_lam_max(E, h, a)
                trH = mp.fsum(c[j] * mp.fsum(x_ * x_ for x_ in feats[j]) for j in c)
                assert abs(mp.mpf(float(dc.lam_max[h, a])) - lam) <= tl.descent_bound(
                    F64, trH, 10, spec.head_dim, 0, smax), (h, i)
                e0 = exact.query_space_objective(E, h, a, mp.zeros(spec.head_dim + 1, spec.r))
                e1 = exact.query_space_objective(E, h, a, M)
                size = mp.fsum(c[j] * mp.fsum((abs(E.v[h, j, q] - E.mu[h, a, q]) + abs(E.v[h, j, q])
                                               + abs(E.mu[h, a, q])) ** 2 for q in range(spec.r))
                               for j in c)
                size = size + 2 * lam * mp.fsum(x_ * x_ for x_ in M)
                for got, want in ((dc.e0[h, a], e0), (dc.e1[h, a], e1)):
                    assert abs(mp.mpf(float(got)) - want) <= tl.descent_bound(
                        F64, size, 10, spec.head_dim, 0, smax), (h, i, float(got), float(want))


def test_query_space_step_is_the_dot_familys_with_keys_over_tau():
    """docs/math.md section 11: for a cosine head the query-space Hessian is the dot family's
    with keys k^~_j / tau, i.e. lambda_max(H^q) = lambda_max(G)/tau^2 with G the Gram matrix of
    the rotated unit keys; the input-space step does not exist and is refused by name."""
    att = make("cosine")
    x, pos = inputs(), torch.arange(12)
    spec, w = att.head_description(F64)
    st = fast.step(spec, w, x, pos, x, pos, "causal", keep=("c", "t", "b"))
    P = st.extras["projected"]
    G = torch.einsum("hqn,hnd,hne->hqde", st.c, P.k, P.k)
    taus = torch.tensor(spec.temperatures(), dtype=F64)
    want = torch.linalg.eigvalsh(G)[..., -1] / taus[:, None] ** 2
    got = fast.query_descent(st).lam_max
    assert float(((got - want).abs() / want).max()) <= tl.FLOAT64_REL
    unit = torch.linalg.vector_norm(P.k, dim=-1)
    # |k / |k|| - 1: a norm of d squares, its root and d quotients, then the norm again -- no
    # subtraction, so gamma_{2d + 4} relative, in any order of the sums
    assert float((unit - 1).abs().max()) <= tl.nonnegative_ops_rel(2 * spec.head_dim + 4)
    with pytest.raises(ValueError, match="not affine"):
        fast.descent(st)
    with pytest.raises(ValueError, match="Delta M"):
        fast.step(spec, w, x, pos, x, pos, "causal", delta_m=True)
    stp = fast.step(spec, w, x, pos, x, pos, "causal", gauge="pairwise")
    with pytest.raises(ValueError, match="original and max-key"):
        fast.query_delta_m(stp)


@pytest.mark.parametrize("gauge", ["original", "maxkey"])
def test_query_space_step_in_both_key_gauges(gauge):
    """mu + z^T Delta M^q reproduces the readout in either key gauge, and grad E^q(0) is
    -Delta M^q from the explicit features (a dot head with biases: the bias coordinate)."""
    att = make("standard")
    x, pos = inputs(), torch.arange(12)
    spec, w = att.head_description(F64)
    st = fast.step(spec, w, x, pos, x, pos, "causal", gauge=gauge, keep=("c", "t", "b"),
                   bias=torch.randn(4, 12, 12, dtype=F64,
                                    generator=torch.Generator().manual_seed(3)))
    z, dmq = fast.query_input(st), fast.query_delta_m(st)
    ro = st.mu + (z[:, :, None] @ dmq)[:, :, 0]
    vs = float(st.extras["projected"].v.abs().max())
    bound = tl.readout_bound(F64, np.maximum(1.0, st.kappa.numpy()), 12, 8,
                             float(st.s.abs().max()))
    assert ((ro - st.readout).abs().amax(-1).numpy() / vs <= bound).all()
    P = st.extras["projected"]
    for h, i in ((0, 11), (3, 6)):
        mk = st.mask[i]
        a = fast.query_features(st, h, i)[mk]
        t = (P.v[h] - st.mu[h, i])[mk]
        _, g = fast.objective(a, st.c[h, i, mk], t, torch.zeros(9, 8, dtype=F64))
        terms = (st.c[h, i, mk].abs()[:, None, None] * a.abs()[:, :, None]
                 * t.abs()[:, None, :]).sum(0)
        assert float(((g + dmq[h, i]).abs() / terms.clamp_min(tl.SCALE_GUARD)).max()) \
            <= tl.FLOAT64_REL


def test_cosine_bound_is_reached_within_its_stated_factor():
    """docs/math.md section 11: two keys at +-q^ with values +-w reach ||y - mu|| / max||v - mu||
    = tanh(1/tau), i.e. 1/(1 + e^{2/tau}) of the bound e^{2/tau} - 1 -- the measured tightness
    of a head can come near 1/2, so the check is not vacuous."""
    d, tau = 4, 1.5
    spec = HeadSpec(1, 1, d, rope=RoPESpec(base=1e4), family="cosine", temperature=tau)
    eye = torch.eye(d, dtype=F64)[:, None, :]
    w = HeadWeights(w_q=eye, w_k=eye, w_v=eye)
    e = torch.eye(d, dtype=F64)[0]
    xq, xkv = e[None], torch.stack([e, -e])
    st = fast.step(spec, w, xq, [0], xkv, [0, 0], "bank")
    P = st.extras["projected"]
    r = fm.cosine_bound_ratio(st.y, st.mu, P.v, st.mask)
    # two float64 evaluations of one two-key softmax output (the suite's against math.tanh):
    # the float64 agreement level of agreement_rel_tol, in any order
    tol = tl.agreement_rel_tol(F64, 2, d, d)
    assert abs(float(r[0, 0]) - math.tanh(1 / tau)) <= tol
    tight = float(r[0, 0]) / float(fm.cosine_bound(tau))
    assert abs(tight - 1 / (1 + math.exp(2 / tau))) <= tol


def test_cosine_tightness_is_reported_per_head():
    res = fm.check_module(make("cosine"), inputs())
    for h, info in enumerate(res["heads"]):
        # expm1 of a quotient, torch's against math's: two roundings and a libm call faithful
        # to an ulp a side, all of positive numbers (gamma_4 + gamma_4 <= gamma_8)
        assert info["cosine_bound"] == pytest.approx(math.expm1(2 / info["tau"]),
                                                     rel=tl.nonnegative_ops_rel(8))
        assert 0.0 <= info["cosine_tightness"] <= 1.0, info
    assert res["checks"]["cosine_bound"] and max(res["checks"]["cosine_bound"]) <= 1.0


# ---------------------------------------------------------------------------------------------
# frequency ordering and the barycenter orientation (docs/math.md section 10)
# ---------------------------------------------------------------------------------------------
def bary_tol(m: int, d: int) -> float:
    """A barycenter in [0, 1] of ``m``-row heads: a quotient of sums of non-negative terms,
    ``gamma_n`` with n = 2m + 2d + 5 roundings (tests/test_rope_diagnostics.py::barycenter_ops)
    -- absolute, the value being at most 1 -- in any order of the sums."""
    return tl.nonnegative_ops_rel(2 * m + 2 * d + 5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_frequency_ordering_and_barycenter_orientation(layout):
    d, m = 8, 5
    att = make("perhead", layout=layout)
    om = att.frequencies().detach()
    assert bool((om[:, 1:] < om[:, :-1]).all()) and bool((om[:, 0] == 1.0).all())
    for h, b in enumerate(att.bases().detach()):
        assert torch.equal(om[h], rope.rope_frequencies(float(b), d))  # omega_l = b^(-2l/d)
    # a unit vector in pair l turns by p * omega_l in the module's own rotation (its tables are
    # the suite's, bit for bit: angles in float64, rounded once)
    p = 7
    with torch.no_grad():
        cos, sin = att._cos_sin(torch.tensor([[p]]), F64, "cpu")
        spec, _ = att.head_description(F64)
        c_ref, s_ref = rope.rope_cos_sin(spec, [p])
        assert torch.equal(cos[0], c_ref) and torch.equal(sin[0], s_ref)
        for ell in range(d // 2):
            i, j = rope.pair_indices(ell, d, layout)
            v = torch.zeros(1, 4, 1, d, dtype=F64)
            v[..., i] = 1.0
            rv = att._rotate(v, cos, sin)[0, :, 0]
            assert torch.equal(rv[:, i], torch.cos(p * om[:, ell]))
            assert torch.equal(rv[:, j], torch.sin(p * om[:, ell]))
    # barycenter: a head living in pair 0 sits at 0, one living in the last pair at 1
    for ell, want in ((0, 0.0), (d // 2 - 1, 1.0)):
        w = torch.zeros(m, d, dtype=F64)
        for c in rope.pair_indices(ell, d, layout):
            w[:, c] = torch.arange(1.0, m + 1)
        assert abs(rope.barycenter(w, w, layout) - want) <= bary_tol(m, d)
    res = fm.check_frequency_ordering(d, layout)
    assert res["passed"], res["failures"]
    assert res["barycenters"] == pytest.approx([0.0, 1.0], abs=bary_tol(3, d))
    assert res["bases"][0] < res["bases"][1]  # the fast-pair head gets the smaller base


def test_head_description_round_trips_the_learned_parameters():
    att = make("perhead")
    spec, w = att.head_description(F64)
    assert spec.rope.bases(4) == tuple(float(b) for b in att.bases().detach())
    assert spec.rope.per_head and spec.family == "dot" and spec.rope.layout == "half"
    wq = att.q_proj.weight.detach().T.reshape(16, 4, 8)
    assert torch.equal(torch.as_tensor(w.w_q), wq)
    cos = make("cosine")
    spec, _ = cos.head_description(F64)
    assert spec.family == "cosine"
    for got, want in zip(spec.temperatures(), [0.5, 1, 2, 8 ** .5]):
        assert got == pytest.approx(want, rel=log_round_trip(want))
    # the per-head bases start from the barycenter initialiser and stay in the clamp range
    torch.manual_seed(5)
    fresh = fm.RoPEAttention(CFGS["perhead"]).double()
    t = fresh.init_bases_from_barycenter()
    for h in range(4):
        wq, wk = fresh.head_weights(h)
        want = rope.barycenter_base(rope.barycenter(wq, wk, "half"))
        assert float(fresh.bases().detach()[h]) == pytest.approx(want, rel=log_round_trip(want))
        assert 0.0 <= float(t[h]) <= 1.0
    fresh.set_bases([1.0, 1e9, 3e3, 3e5])  # out of range: clamped where used
    for got, want in zip(fresh.bases().detach().tolist(), [1e3, 1e6, 3e3, 3e5]):
        assert got == pytest.approx(want, rel=log_round_trip(want))


# ---------------------------------------------------------------------------------------------
# the small GPT
# ---------------------------------------------------------------------------------------------
def test_gpt_defaults_are_the_documents_model():
    cfg = fm.GPTConfig()
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.seq_len) == (3, 4, 128, 128)
    ac = cfg.attention()
    assert ac.dim == 32 and fm.AttentionConfig(128, 4, variant="cosine").tau0 == math.sqrt(32)


@pytest.mark.parametrize("variant", fm.VARIANTS)
def test_gpt_capture_and_check(variant):
    cfg = fm.GPTConfig(vocab_size=40, n_layers=2, n_heads=2, d_model=16, seq_len=10,
                       variant=variant, n_kv_heads=1)
    torch.manual_seed(2)
    model = fm.GPT(cfg).double()
    idx = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    cap = model.capture(idx)
    assert torch.equal(cap.logits, model(idx))
    assert len(cap.layers) == 2
    for blk, lc in zip(model.blocks, cap.layers):
        assert lc.x.shape == (2, 10, 16) and lc.heads.shape == (2, 2, 10, 8)
        out, heads = blk.attn(lc.x, return_heads=True)
        assert torch.equal(heads, lc.heads) and torch.equal(out, lc.out)
    loss = model.lm_loss(idx)
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    if variant == "cosine":
        assert model.blocks[0].attn.log_tau.grad is not None
    if variant == "perhead":
        assert model.blocks[0].attn.log_base.grad is not None
    res = fm.check_gpt(model, idx)
    assert res["passed"], [r["failures"] for r in res["layers"]]


def test_sdpa_and_math_agree():
    from dataclasses import replace

    for variant in fm.VARIANTS:
        att = make(variant)
        sd = fm.RoPEAttention(replace(att.config, attn_impl="sdpa")).double()
        sd.load_state_dict(att.state_dict())
        x = inputs()[None]
        with torch.no_grad():
            a, b = att(x), sd(x)
        assert float((a - b).abs().max() / a.abs().max()) <= tl.agreement_rel_tol(F64, 12, 8, 16)


# ---------------------------------------------------------------------------------------------
# bad input and non-finite values
# ---------------------------------------------------------------------------------------------
def test_bad_input_is_named():
    att = make("cosine")
    x = inputs()
    with pytest.raises(ValueError, match="variant"):
        fm.AttentionConfig(16, 4, variant="sine")
    with pytest.raises(ValueError, match="divide"):
        fm.AttentionConfig(16, 4, 3, 8)
    with pytest.raises(ValueError, match="even head_dim"):
        fm.AttentionConfig(16, 4, head_dim=5)
    with pytest.raises(ValueError, match="tau_init"):
        fm.AttentionConfig(16, 4, variant="cosine", tau_init=-1.0)
    with pytest.raises(ValueError, match="base_range"):
        fm.AttentionConfig(16, 4, variant="perhead", base_range=(1e6, 1e3))
    with pytest.raises(ValueError, match="shape"):
        att(x)  # 2-D: needs (batch, tokens, d_model)
    with pytest.raises(ValueError, match="positions"):
        att(x[None], positions=torch.arange(12.0))
    with pytest.raises(ValueError, match="no key"):
        att(x[None], mask=torch.zeros(12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN"):
        fm.check_module(att, torch.full_like(x, math.nan))
    with pytest.raises(ValueError, match="shape"):
        fm.check_module(att, x[:, :5])
    with pytest.raises(ValueError, match="non-decreasing"):
        fm.check_module(att, x, torch.arange(12).flip(0))
    with pytest.raises(ValueError, match="temperature"):
        make("standard").temperatures()
    with pytest.raises(ValueError, match="finite and > 0"):
        att.set_temperatures([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="tables"):
        fm.RoPEAttention(CFGS["perhead"], tables=lambda *a: None)


def test_a_nan_head_fails_never_passes(monkeypatch):
    """A NaN in the module's own output is a failure named after its check, never a pass."""
    att = make("standard")
    orig = fm.RoPEAttention.head_outputs

    def nan_head(self, *a, **k):
        out = orig(self, *a, **k).clone()
        out[:, 1, 3] = math.nan
        return out

    monkeypatch.setattr(fm.RoPEAttention, "head_outputs", nan_head)
    res = fm.check_module(att, inputs())
    assert not res["passed"]
    bad = [f for f in res["failures"] if f["where"] == "head 1"]
    assert any(f["check"] == "identity_float64_fast" and math.isnan(f["value"]) for f in bad)
    assert math.isnan(res["checks"]["identity_float64_fast"][1])


# ---------------------------------------------------------------------------------------------
# mutations: each deliberate error makes a check fail; the correct module passes the same check
# ---------------------------------------------------------------------------------------------
class QueryOnlyNorm(fm.RoPEAttention):
    def _normalise(self, q, k):
        return q / torch.linalg.vector_norm(q, dim=-1, keepdim=True), k


class PairNorm(fm.RoPEAttention):
    """Each rotary pair to unit length instead of the whole head vector."""

    def _normalise(self, q, k):
        d = self.head_dim

        def pairs(t):
            out = t.clone()
            for ell in range(d // 2):
                i, j = rope.pair_indices(ell, d, self.layout)
                n = torch.sqrt(t[..., i] ** 2 + t[..., j] ** 2)
                out[..., i], out[..., j] = t[..., i] / n, t[..., j] / n
            return out

        return pairs(q), pairs(k)


class TauTimes(fm.RoPEAttention):
    def _score_scale(self, dtype, device):
        return self.temperatures().to(device=device, dtype=dtype)


class OtherHeadsBase(fm.RoPEAttention):
    def _rotation_frequencies(self):
        return self.frequencies().roll(1, dims=0)


MUTANTS = [("cosine", QueryOnlyNorm, "identity_float64_fast"),
           ("cosine", PairNorm, "identity_float64_fast"),
           ("cosine", TauTimes, "identity_float64_fast"),
           ("perhead", OtherHeadsBase, "identity_float64_fast")]


@pytest.mark.parametrize("variant, cls, check", MUTANTS,
                         ids=[c.__name__ for _, c, _ in MUTANTS])
def test_mutation_is_detected(variant, cls, check):
    good = make(variant)
    bad = make(variant, cls=cls)
    bad.load_state_dict(good.state_dict())
    x = inputs()
    ok = fm.check_module(good, x, float32=False)
    res = fm.check_module(bad, x, float32=False)
    print(cls.__name__, check, ratio(ok, check), ratio(res, check))
    assert ok["passed"] and ratio(ok, check) <= 1.0
    assert not res["passed"]
    assert ratio(res, check) >= tl.DETECT_FACTOR  # the error is O(1), not a rounding excess
    assert any(f["check"] == check for f in res["failures"])


def test_reversed_frequency_index_is_detected(monkeypatch):
    """A barycenter that reads the frequency axis backwards (``l -> d/2 - 1 - l``) gives a
    fast-pair head the largest base: the orientation check and the module check turn red."""
    good = fm.check_frequency_ordering(8, "half")
    assert good["passed"]
    att = make("perhead")
    assert fm.check_module(att, inputs(), float32=False)["passed"]
    orig = rope.frequency_index

    def reversed_index(head_dim, layout):
        return head_dim // 2 - 1 - orig(head_dim, layout)

    monkeypatch.setattr(rope, "frequency_index", reversed_index)
    bad = fm.check_frequency_ordering(8, "half")
    print(bad["barycenters"], bad["bases"])
    assert not bad["passed"]
    assert bad["barycenters"] == pytest.approx([1.0, 0.0], abs=bary_tol(3, 8))
    assert bad["bases"][0] > bad["bases"][1]
    res = fm.check_module(att, inputs(), float32=False)
    assert not res["passed"]
    assert any(f["check"] == "frequency_orientation" for f in res["failures"])


# ---------------------------------------------------------------------------------------------
# Hugging Face Llama / Qwen2 (tiny, from a config; no network)
# ---------------------------------------------------------------------------------------------
def tiny_model(kind: str = "llama"):
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rope_theta=10000.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=8, **kw))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    with torch.no_grad():  # larger weights than the default init: attention that matters
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10)
    return model.double().eval()


def ids(T: int = 12):
    return torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(7))


def logits_tol(model, n_tokens: int = 12) -> float:
    """Same function, another evaluation order (SDPA against an explicit softmax, a cache against
    none) through ``n`` residual blocks and the output head, relative to the logits' max:
    ``(n + 1) agreement_rel_tol(float64, T, d, m + I)``.

    Derivation: each block is one attention layer -- the sums :func:`agreement_rel_tol` counts,
    with the ``m``-term projections -- and an MLP whose two GEMMs add ``m`` and ``I`` terms
    (``I`` the intermediate size); the output head is one more ``m``-term GEMM.  First order, the
    blocks' errors add, each passed on with O(1) gain (normalised inputs, residual sums), and
    the sums' condition numbers are inside its margin, as for one layer.  Any summation order
    (``gamma_n`` bounds), so it holds on every BLAS branch."""
    c = model.config
    d = c.hidden_size // c.num_attention_heads if getattr(c, "head_dim", None) is None else c.head_dim
    return (c.num_hidden_layers + 1) * tl.agreement_rel_tol(F64, n_tokens, d,
                                                            c.hidden_size + c.intermediate_size)


@pytest.mark.model
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_standard_replacement_reproduces_the_model(kind):
    """Logits of the replaced model equal the original's to float64 roundoff, with and without
    left padding (padded positions are not compared: no other token reads them).  The original
    runs SDPA: HF's eager attention rounds its softmax to float32 even in a float64 model."""
    model = tiny_model(kind)
    tok = ids()
    pad = torch.ones_like(tok)
    pad[0, :3] = 0
    with torch.no_grad():
        ref, ref_pad = model(tok).logits, model(tok, attention_mask=pad).logits
    new = fm.replace_attention(model, "standard")
    assert len(new) == 2 and all(isinstance(a, fm.HFAttention) for a in new)
    assert new[0].q_proj is model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        out, out_pad = model(tok).logits, model(tok, attention_mask=pad).logits
    err = float((out - ref).abs().max() / ref.abs().max())
    keep = pad.bool()
    err_pad = float((out_pad - ref_pad)[keep].abs().max() / ref_pad[keep].abs().max())
    print(kind, "logits rel", err, err_pad, "tol", logits_tol(model))
    assert err <= logits_tol(model) and err_pad <= logits_tol(model)
    assert bool(torch.isfinite(out_pad).all())


def _layer_input(model, layer: int, tokens):
    """The attention input of ``layer`` (after its input norm) for one forward."""
    got = {}

    def hook(mod, args, kwargs):
        got["x"] = kwargs["hidden_states"].detach()

    hnd = model.model.layers[layer].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        hnd.remove()
    return got["x"]


@pytest.mark.model
@pytest.mark.parametrize("variant", fm.VARIANTS)
def test_hf_replaced_layer_is_consistent_with_its_description(variant):
    model = tiny_model("llama")
    new = fm.replace_attention(model, variant)
    tok = ids()
    x = _layer_input(model, 1, tok)  # (2, T, m)
    res = fm.check_module(new[1], x[:1])
    assert res["passed"], res["failures"]
    spec, _ = new[1].head_description(F64, n_positions=12)
    if variant == "perhead":
        assert spec.rope.per_head and spec.rope.cos is None
        b = new[1].bases().detach()
        assert bool(((b >= 1e3 * (1 - log_round_trip(1e3)))
                     & (b <= 1e6 * (1 + log_round_trip(1e6)))).all())
    else:  # the model's own float32 tables
        assert spec.rope.cos is not None and spec.family == ("cosine" if variant == "cosine"
                                                             else "dot")
    # the HF forward (with its cache) agrees with the full forward
    with torch.no_grad():
        full = model(tok, use_cache=False).logits
        o1 = model(tok[:, :8], use_cache=True)
        o2 = model(tok[:, 8:], cache=o1.cache, use_cache=True)
    inc = torch.cat([o1.logits, o2.logits], 1)
    assert float((inc - full).abs().max() / full.abs().max()) <= logits_tol(model)


@pytest.mark.model
def test_hf_replacement_refuses_what_it_cannot_do():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="variant"):
        fm.replace_attention(model, "alibi")
    with pytest.raises(ValueError, match="config"):
        fm.replace_attention(torch.nn.Linear(2, 2), "standard")
