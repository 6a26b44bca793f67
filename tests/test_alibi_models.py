"""ALiBi models whose attention is computed inside the module (BLOOM, MPT): the second recording
path of :mod:`ropestep.models.probe`, the reading of :mod:`ropestep.models.conventions`
(``_read_inline``: key bias affine in the key position, mask, scale and the layout proven by
reproducing the module's own probabilities and heads' output), the capture's per-run bias guard,
and the library's checks on them.

Each reading has a planted error only it can see: a slope read wrong (halved, heads reversed,
sign flipped) fails the library's check and step; a bias that is not ALiBi is refused on
loading; a layout that cannot reproduce the module is refused; a run whose positions the model
does not follow is refused, never given a verdict.  The oracle: the 50-digit rows of
:func:`ropestep.realchecks.exact_rows` on a real BLOOM layer (ALiBi biases in the score).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig

from ropestep import api, archzoo, models, realchecks, spec as spec_mod

pytestmark = pytest.mark.model

CONFIGS = {
    "bloom": dict(model_type="bloom", vocab_size=archzoo.VOCAB, hidden_size=128, n_layer=2,
                  n_head=4),
    "mpt": dict(model_type="mpt", vocab_size=archzoo.VOCAB, d_model=128, n_layers=2, n_heads=4,
                max_seq_len=256, expansion_ratio=2),
}


def _build(name: str, seed: int = 0):
    kw = dict(CONFIGS[name])
    return archzoo._built(AutoConfig.for_model(kw.pop("model_type"), **kw), seed)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, archzoo.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def alibi_model(request):
    return request.param, _build(request.param)


def test_inline_layers_are_read_as_alibi(alibi_model):
    name, model = alibi_model
    info = models.describe_model(model, fresh=True)
    expected = spec_mod.alibi_slopes(4)  # 2^(-8h/H): both models' slopes for 4 heads
    for c in info.conventions():
        assert c.alibi == pytest.approx(expected, rel=0, abs=0)
        assert c.rotary is None and c.rotary_dim == 0 and c.order == "none"
        assert c.layout == {"bloom": "per_head", "mpt": "fused"}[name]
        assert c.mask_form == {"bloom": "additive", "mpt": "drop"}[name]
        assert c.scaling == pytest.approx(32 ** -0.5)
    spec, _ = models.layer_head(model, 0, 8)
    assert spec.alibi_slopes == tuple(expected)


def test_the_library_passes_and_each_wrong_slope_fails(alibi_model):
    _, model = alibi_model
    lab = api.attach(model)
    lr = lab.run(_ids(40), layers=1)[1]
    spec, w = lr.head_description
    assert spec.alibi_slopes is not None
    assert lr.check(anchor_every=8).passed
    assert all(lr.step(h, -1).passed for h in range(spec.n_heads))
    assert "ALiBi" in lr.step(0, -1).not_defined["descent"]
    s = spec.alibi_slopes
    wrong = {
        "slopes halved": tuple(v / 2 for v in s),
        "heads' slopes reversed": tuple(reversed(s)),
        "sign flipped (the bias read as slope (p_i - p_j))": tuple(-v for v in s),
        "bias dropped": None,
    }
    for what, slopes in wrong.items():
        lr._spec, lr._head_cache, lr._check = (replace(spec, alibi_slopes=slopes), w), {}, {}
        assert not lr.check(anchor_every=8).passed, what
        assert not all(lr.step(h, -1).passed for h in range(spec.n_heads)), what
    with pytest.raises(api.ApiError, match="not defined"):
        lab.run(_ids(12), layers=0)[0].position_derivative([5])


def test_alibi_rows_match_the_oracle():
    """50-digit rows (mpmath) of a real BLOOM layer: y, Delta M, c and the readout, with the
    ALiBi bias in every score."""
    model = _build("bloom")
    lr = api.attach(model).run(_ids(20, 1), layers=0)[0]
    spec, w = lr.head_description
    got = realchecks.exact_rows(spec, w, lr.x.double(), lr.positions,
                                [(h, i) for h in range(spec.n_heads) for i in (3, 19)])
    assert got["ok"], got


def _bend_bias(model, how) -> None:
    """A pre-hook on every attention module that replaces the ALiBi bias it is handed by
    ``how(bias)`` (registered before ropestep's recording, so the module and the recording see
    the same replaced bias)."""
    for layer in models.structure.layer_modules(model):
        for _, attn in models.structure.attention_modules(layer):
            def hook(mod, args, kwargs):
                if torch.is_tensor(kwargs.get("alibi")):
                    kwargs = {**kwargs, "alibi": how(kwargs["alibi"])}
                return args, kwargs
            attn.register_forward_pre_hook(hook, with_kwargs=True)


def test_a_bias_that_is_not_alibi_is_refused():
    model = _build("bloom")
    _bend_bias(model, lambda a: a + 1e-3 * a * a)  # no longer affine in the key position
    with pytest.raises(models.UnsupportedModelError, match="not affine in the key position"):
        models.describe_model(model, fresh=True)


def test_a_layout_that_cannot_reproduce_the_module_is_refused(monkeypatch):
    """Without the per-head layout (and the grouped one, the same rows when every query head
    has its own KV head) BLOOM's fused query_key_value is read as [q; k; v] blocks, which
    reproduces neither its probabilities nor its output: refused, naming both."""
    monkeypatch.delitem(models.layouts.LAYOUTS, "per_head")
    monkeypatch.delitem(models.layouts.LAYOUTS, "grouped")
    with pytest.raises(models.UnsupportedModelError, match="reproduces the module's own "
                       "probabilities and output"):
        models.describe_model(_build("bloom"), fresh=True)


def test_a_run_the_model_does_not_position_is_refused(alibi_model):
    """BLOOM and MPT derive their key positions themselves (and ignore position ids): a run at
    other positions is refused by the capture's bias guard, not given a wrong verdict."""
    _, model = alibi_model
    models.describe_model(model)
    with pytest.raises(models.UnsupportedModelError, match="does not follow these positions"):
        models.capture(model, _ids(12), [0], position_ids=torch.arange(12) * 2)
    lab = api.attach(model)  # a shift: the same bias up to a constant per row
    assert lab.run(_ids(12), layers=0, positions=torch.arange(12) + 5)[0].check().passed


def test_a_bias_changed_after_loading_is_refused_in_the_run():
    """The guard sees a bias that changes with the run (here: slopes doubled on sequences
    longer than the reading forward), which the reading itself could not."""
    model = _build("bloom")
    n0 = models.conventions.PROBE_TOKENS
    _bend_bias(model, lambda a: 2 * a if a.shape[-1] > n0 else a)
    lab = api.attach(model)
    assert lab.run(_ids(n0), layers=0)[0].check().passed
    with pytest.raises(models.UnsupportedModelError, match="ALiBi bias in this run"):
        lab.run(_ids(n0 + 8), layers=0)


def test_alibi_fit_bound():
    """The slope fit's residual bound holds for float32 products of an irrational slope and
    positions up to 4096; a curvature of 0.05 over that span, or a slope 0.1% off, is outside
    it."""
    p = torch.arange(4096)
    s32 = torch.tensor([2 ** -0.5, 2 ** -1.75, 0.3], dtype=torch.float32)
    kb = (s32[:, None] * p[None].float()).double()
    slopes, worst = models.conventions.alibi_fit(kb, p, torch.float32)
    assert worst <= 1.0 and torch.allclose(slopes, s32.double(), rtol=1e-6, atol=0)
    assert models.conventions.alibi_check(kb, p, tuple(slopes.tolist()), torch.float32) <= 1.0
    bent = kb + 0.05 * (p.double() / 4096) ** 2
    assert models.conventions.alibi_fit(bent, p, torch.float32)[1] > 1.0
    assert models.conventions.alibi_check(kb, p, tuple((1.001 * slopes).tolist()),
                                          torch.float32) > 1.0


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_the_census_passes_them_through_atlas_and_validate(name, tmp_path):
    """``ropestep atlas`` and ``ropestep validate`` on the census's tiny BLOOM and MPT (their
    own configurations' defaults, shrunk): both pass, every check with its ratio."""
    from ropestep import architectures, cli

    rec = architectures.run_type(name, tmp_path, 0, cli.main)
    assert rec["outcome"] == "pass", rec
    assert rec["conventions"]["summary"]["alibi"]
    for cmd in ("atlas", "validate"):
        assert rec[cmd]["exit"] == 0 and rec[cmd]["checks"], rec[cmd]


def test_mpts_context_is_read_from_max_seq_len():
    """MPT keeps its context as ``max_seq_len`` (its bias table's width): a longer prompt is
    refused by the library, naming the context, before any forward."""
    kw = dict(CONFIGS["mpt"], max_seq_len=32)
    model = archzoo._built(AutoConfig.for_model(kw.pop("model_type"), **kw), 0)
    lab = api.attach(model)
    assert lab._context() == 32
    with pytest.raises(api.ApiError, match=r"beyond the model's context \(32 positions\)"):
        lab.run(_ids(40), layers=0)
    assert lab.run(_ids(32), layers=0)[0].check(anchor_every=8).passed
