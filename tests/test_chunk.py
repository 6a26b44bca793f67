"""Chunked attention (``HeadSpec.chunk``, Llama 4's chunked layers): the permitted set
``{j : p_j <= p_i, p_j // C == p_i // C}``, and the query temperature of Llama 4's NoPE layers.

The chunk is a property of the head, so every path applies it to every mask, as the window is
(tests/test_window.py): the exact oracle, the per-query fast path and the streamed layer, each
compared with an independent construction -- the same head *without* chunks given the chunked
permitted sets as an explicit boolean mask -- and the mpmath oracle at 50 digits.  On a tiny
Llama 4 the chunk is read from the layer's own mask and checked against the
``attention_chunk_size`` its configuration names (on a longer forward where the reading forward
is shorter than one chunk); the NoPE layers' query temperature ``1 + a log(1 + floor((p+1)/f))``
is read from the module, proven on the reading forward's own queries and carried in
``HeadSpec.query_temperature`` through every path (the oracle included).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ropestep import census, cli, exact, fast, models, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec, first_permitted, resolve_mask

N, M, H, HK, D, C = 13, 6, 2, 1, 4, 5
F64 = torch.float64


def _head(chunk, window=None):
    g = torch.Generator().manual_seed(11)
    spec = HeadSpec(n_heads=H, n_kv_heads=HK, head_dim=D, rope=RoPESpec(base=100.0),
                    chunk=chunk, window=window)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    w = HeadWeights(w_q=r(M, H, D) * 0.8, w_k=r(M, HK, D) * 0.8, w_v=r(M, HK, D),
                    b_q=r(H, D) * 0.3, b_k=r(HK, D) * 0.3, b_v=r(HK, D) * 0.1)
    x = torch.randn(N, M, generator=g, dtype=F64)
    return spec, w, x


def _chunked(n: int, chunk: int) -> np.ndarray:
    """The permitted sets written out directly from the definition (not through ropestep)."""
    out = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for j in range(n):
            out[i, j] = j <= i and j // chunk == i // chunk
    return out


def test_masks_and_first_key_follow_the_definition():
    pos = np.arange(N)
    assert np.array_equal(resolve_mask("causal", pos, pos, N, N, None, C), _chunked(N, C))
    assert [first_permitted(i, None, C) for i in range(N)] == [i - i % C for i in range(N)]
    # a window and chunks together: the later of the two starts
    both = resolve_mask("causal", pos, pos, N, N, 3, C)
    assert np.array_equal(both, _chunked(N, C) & (pos[:, None] - pos[None] < 3))
    assert [first_permitted(i, 3, C) for i in range(N)] == \
        [max(i - 2, i - i % C, 0) for i in range(N)]
    t = resolve_mask(torch.ones(N, N, dtype=torch.bool), pos, pos, N, N, None, C)
    assert torch.is_tensor(t) and np.array_equal(t.numpy(), np.equal.outer(pos // C, pos // C))
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="chunk"):
            HeadSpec(n_heads=1, n_kv_heads=1, head_dim=2, chunk=bad)


def test_fast_streamed_and_exact_with_chunks():
    spec, w, x = _head(C)
    spec0, _, _ = _head(None)
    pos = torch.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, "causal", delta_m=True)
    st0 = fast.step(spec0, w, x, pos, x, pos, torch.as_tensor(_chunked(N, C)), delta_m=True)
    assert torch.equal(st.mask, st0.mask)
    tol = tolerances.agreement_rel_tol(F64, C, D, M)
    vs = float(st0.y.abs().max())
    assert float((st.y - st0.y).abs().max()) <= tol * vs
    assert float((st.readout - st0.readout).abs().max()) <= tol * vs
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=50)
    assert np.array_equal(np.asarray(E.mask, dtype=bool), _chunked(N, C))
    y_ex = torch.as_tensor(exact.to_float(E.y))
    assert float((st.y - y_ex).abs().max()) <= tol * vs
    ro = torch.zeros(H, N, D, dtype=F64)
    for ch in scale.stream(spec, w, x, pos, gauge="maxkey", max_bytes=1 << 16):
        ro[ch.heads[0]:ch.heads[-1] + 1, ch.queries] = ch.readout
    assert float((ro - y_ex).abs().max()) <= tol * vs
    # power: the same head without its chunks is a different function from the first query of
    # the second chunk on (before it the two coincide)
    stc = fast.step(spec0, w, x, pos, x, pos, "causal")
    assert float((stc.y[:, :C] - st.y[:, :C]).abs().max()) <= tol * vs
    assert float((stc.y[:, C:] - st.y[:, C:]).abs().max()) > 1e3 * tol * vs


def test_a_tiny_llama4s_chunks_are_read_from_its_masks():
    model = census.build("llama4_text")  # attention_chunk_size 16 (census.OVERRIDES)
    info = models.describe_model(model)
    kinds = model.config.layer_types
    for c in info.conventions():
        chunked = kinds[c.layer] == "chunked_attention"
        assert c.chunk == (16 if chunked else None) and c.window is None
        assert (c.temperature_from is None) == chunked  # the NoPE layers (census: from 7)
    L = kinds.index("chunked_attention")
    spec, _ = models.layer_head(model, L, 40)
    assert spec.chunk == 16


def test_a_chunk_longer_than_the_reading_is_checked_on_a_longer_forward(monkeypatch):
    """A chunk the mask of the 24-token reading cannot show is taken as named and checked on a
    forward one token longer than it: a wrong name is refused there."""
    conv = models.conventions
    model = census.build("llama4_text")
    model.config.attention_chunk_size = 30  # the mask follows the configuration
    info = models.describe_model(model)
    assert {c.chunk for c in info.conventions()} == {30, None}
    monkeypatch.setattr(conv, "_named_chunk", lambda model, attn, L: 28 if
                        model.config.layer_types[L] == "chunked_attention" else None)
    with pytest.raises(models.UnsupportedModelError, match="attention_chunk_size=28 but its mask "
                       "over 29 tokens is not that"):
        models.describe_model(model, fresh=True)


def test_a_named_chunk_the_mask_contradicts_is_refused(monkeypatch):
    conv = models.conventions
    model = census.build("llama4_text")
    monkeypatch.setattr(conv, "_named_chunk", lambda model, attn, L: 12 if
                        model.config.layer_types[L] == "chunked_attention" else None)
    with pytest.raises(models.UnsupportedModelError, match="mask is chunks of 16 positions, its "
                       "config names attention_chunk_size=12"):
        models.describe_model(model)


def _with_floor_scale(floor: int):
    model = census.build("llama4_text")
    model.config.floor_scale, model.config.attn_scale = floor, 0.5  # saved with the model
    for layer in model.model.layers:
        layer.self_attn.floor_scale, layer.self_attn.attn_scale = floor, 0.5
    return model


def test_the_nope_temperature_is_read_and_modelled(tmp_path):
    """Llama 4's NoPE layers scale the query at position p by 1 + a log(1 + floor((p+1)/f)):
    read from the module and proven on the reading forward's own queries (f = 8: it reaches
    the temperature), carried in HeadSpec.query_temperature through every path; atlas and
    validate pass on runs past f - 1, and each wrong reading of it fails the library's check."""
    from dataclasses import replace

    from ropestep import api, archzoo

    model = _with_floor_scale(8)
    info = models.describe_model(model)
    nope = [c.layer for c in info.conventions() if c.temperature_from is not None]
    assert nope and all(info.layers[L].temperature == (8.0, 0.5) for L in nope)
    assert all(info.layers[L].temperature_from == 7 for L in nope)
    spec, _ = models.layer_head(model, nope[0], 40)
    assert spec.query_temperature == (8.0, 0.5)
    lab = api.attach(model)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    lr = lab.run(ids, layers=nope[0])[nope[0]]
    assert lr.check(anchor_every=8).passed and lr.step(0, -1).passed
    spec, w = lr.head_description
    for what, wrong in {"no temperature": None, "attn_scale off by 10%": (8.0, 0.55),
                        "floor_scale one position off": (9.0, 0.5)}.items():
        lr._spec, lr._head_cache, lr._check = (replace(spec, query_temperature=wrong), w), {}, {}
        assert not lr.check(anchor_every=8).passed, what
    with pytest.raises(api.ApiError, match="index in the sequence"):
        lab.run(ids[:20], layers=nope[0], positions=torch.arange(20) + 3)
    archzoo.save_model(model, tmp_path / "m")
    for cmd, extra in (("atlas", ["--contexts", "1", "--len", "40", "--layers", "all"]),
                       ("validate", ["--corpus", "default", "--contexts", "1", "--queries", "4",
                                     "--prefix-len", "24", "--layers", "all", "--exact-rows",
                                     "2"])):
        rc = cli.main([cmd, "--model", str(tmp_path / "m"), *extra, "--no-figures", "--quiet",
                       "--out", str(tmp_path / cmd)])
        assert rc == 0, cmd


def test_a_temperature_beyond_the_reading_forward_is_checked_in_every_run():
    """floor_scale 30: the reading forward (24 tokens) never reaches the temperature, so every
    run that does checks its queries against the projection times tau at the run's positions
    (models.capture._temperature_guard): a 40-token run passes; the same tokens at positions
    5..44 -- which the model does not follow (it counts from the first token) -- are refused."""
    from ropestep import api

    model = _with_floor_scale(30)
    info = models.describe_model(model)
    nope = [c.layer for c in info.conventions() if c.temperature_from is not None]
    assert info.layers[nope[0]].temperature == (30.0, 0.5)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))
    assert api.attach(model).run(ids, layers=nope[0])[nope[0]].check(anchor_every=8).passed
    with pytest.raises(models.UnsupportedModelError, match="counts them from the first token"):
        models.capture(model, ids, [nope[0]], position_ids=torch.arange(40) + 5)
    models.capture(model, ids[:20], [nope[0]], position_ids=torch.arange(20) + 5)  # tau 1


def test_the_temperature_matches_the_oracle():
    """fast.step (y, readout, input-space Delta M), the streamed layer and the 50-digit oracle
    with a query temperature, on positions that cross two of its steps (f = 4: tau = 1, then
    1 + a log 2, 1 + a log 3); L_i = tau(p_i) W R(p_i) in Delta M."""
    g = torch.Generator().manual_seed(5)
    spec = HeadSpec(n_heads=H, n_kv_heads=HK, head_dim=D, rope=RoPESpec(base=100.0),
                    query_temperature=(4.0, 0.7))
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    w = HeadWeights(w_q=r(M, H, D), w_k=r(M, HK, D), w_v=r(M, HK, D), b_q=r(H, D))
    x, pos = r(N, M), torch.arange(N)
    st = fast.step(spec, w, x, pos, x, pos, "causal", delta_m=True)
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=50)
    y_ex = torch.as_tensor(exact.to_float(E.y))
    tol = tolerances.agreement_rel_tol(F64, N, D, M)
    vs = float(y_ex.abs().max())
    assert float((st.y - y_ex).abs().max()) <= tol * vs
    assert float((st.readout - y_ex).abs().max()) <= tol * vs
    # Delta M_i against the oracle's, key by key (docs/math.md section 3) at a tempered query
    dmm = exact.delta_m(E, 0, N - 1)
    dm_ex = torch.tensor([[float(dmm[a, b]) for b in range(dmm.cols)] for a in range(dmm.rows)],
                         dtype=F64)
    dm = st.delta_m[0, N - 1]
    assert float((dm - dm_ex).abs().max()) <= tol * float(dm_ex.abs().max())
    ro = torch.zeros(H, N, D, dtype=F64)
    for ch in scale.stream(spec, w, x, pos, gauge="maxkey", max_bytes=1 << 16):
        ro[ch.heads[0]:ch.heads[-1] + 1, ch.queries] = ch.readout
    assert float((ro - y_ex).abs().max()) <= tol * vs
    # power: without the temperature the head is another function from position f - 1 = 3 on
    from dataclasses import replace

    st0 = fast.step(replace(spec, query_temperature=None), w, x, pos, x, pos, "causal")
    assert float((st0.y[:, :3] - st.y[:, :3]).abs().max()) <= tol * vs
    assert float((st0.y[:, 3:] - st.y[:, 3:]).abs().max()) > 1e3 * tol * vs


def test_power_the_temperature_is_real_beyond_it():
    """The temperature is real: past floor_scale - 1 the module's queries are not the
    projection's, so the plain head (no temperature) would be wrong there."""
    from ropestep.models.probe import probe_forward

    model = _with_floor_scale(8)
    L = model.config.layer_types.index("full_attention")
    attn = model.model.layers[L].self_attn
    rec = probe_forward(model, 12, layers=[L], keep=("hidden", "query"))[L]
    q_proj = attn.q_proj(rec.hidden[0]).view(12, -1, attn.head_dim).transpose(0, 1)
    q_mod = rec.query[0]
    assert torch.allclose(q_mod[:, :7], q_proj[:, :7])
    assert not torch.allclose(q_mod[:, 7:], q_proj[:, 7:])


def test_census_llama4_passes_with_cut_contexts(tmp_path):
    from ropestep import architectures

    rec = architectures.run_type("llama4_text", tmp_path, 0, cli.main)
    assert rec["outcome"] == "pass", rec
