"""The library (ropestep.api) on tiny models: every object against an independent computation.

* ``Delta M_i``, ``c_ij``, ``mu_i``, ``y_i`` of :meth:`LayerRun.step` against the mpmath oracle
  (:func:`ropestep.realchecks.exact_reference`), input space (Llama, GQA) and query space
  (Qwen3's QK-norm), within ``tolerances.FLOAT64_REL`` of the oracle's sum-of-absolute-terms
  scale (the same bar as ``validate``'s exact rows);
* the step's readout against the model's own head output (the capture) within the derived bound,
  and a planted error behind each of the step's two checks that only that check sees;
* frozen reuse at the queries' own positions against ``mu_a + u_i^T Delta M_a`` built from the
  oracle's ``Delta M_a``;
* :meth:`LayerRun.check` against ``ropestep atlas`` on the same tokens, leaf for leaf;
* the model states a notebook has: bfloat16, SDPA attention (switched for ropestep's forwards
  and switched back), a sliding window shorter than the prompt;
* bad input: one :class:`ApiError` naming the problem.
"""
from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch

import ropestep
from ropestep import api, archzoo, fast, realchecks, tolerances
from ropestep.verdict import leaf_differences

pytestmark = pytest.mark.model

N = 24


def _ids(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, archzoo.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return api.attach(archzoo.build("llama"))


@pytest.fixture(scope="module")
def llama_run(llama):
    return llama.run(_ids(), layers=1)


@pytest.fixture(scope="module")
def qwen3_run():
    return api.attach(archzoo.build("qwen3")).run(_ids(), layers=[1])


def _against_oracle(lr: api.LayerRun, rows: list[tuple[int, int]]) -> None:
    spec, w = lr.head_description
    ref = realchecks.exact_reference(spec, w, lr.x.double(), lr.positions, rows, digits=30)
    for h, i in rows:
        st = lr.step(h, i)
        assert st.space == ref.space
        assert torch.equal(st.keys, torch.as_tensor(ref.keys[h, i]))
        S = ref.value_scale[h, i]
        tol = tolerances.FLOAT64_REL
        dm_err = np.abs(st.delta_m.numpy() - ref.delta_m[h, i]).max()
        assert dm_err <= tol * ref.dm_scale[h, i].max(), (h, i, dm_err)
        ce = ref.c[h, i]
        assert np.max(np.abs(st.c.numpy() - ce) / ce) <= tol
        assert np.abs(st.y.numpy() - ref.y[h, i]).max() <= tol * S
        ro_tol = max(tol, float(tolerances.readout_bound(torch.float64, ref.kappa[h, i],
                                                         ce.size, spec.head_dim,
                                                         ref.score_max[h, i])))
        assert np.abs(st.readout.numpy() - ref.y[h, i]).max() <= ro_tol * S
        # the identity, written out: mu + u^T Delta M is the readout the step reports
        assert torch.allclose(st.mu + st.u @ st.delta_m, st.readout, rtol=0, atol=1e-12 * S)
        assert abs(st.kappa - ref.kappa[h, i]) <= 1e-9 * ref.kappa[h, i]
        # the softmax weights and the step's positive coefficients
        assert bool((st.c > 0).all()) and math.isclose(float(st.softmax.sum()), 1.0,
                                                        rel_tol=1e-12)
        st.assert_passed()


def test_step_against_the_oracle_input_space(llama_run):
    lr = llama_run[1]
    assert lr.space == "input" and lr.input_space_reason is None
    # head 3 reads KV head 1 (GQA), query 0 reads itself only, -1 is the last token
    _against_oracle(lr, [(0, 0), (3, 7), (2, N - 1)])
    assert lr.step(2, -1).query == N - 1
    assert torch.equal(lr.delta_m(2, -1), lr.step(2, N - 1).delta_m)
    st = lr.step(3, 7)
    assert tuple(st.delta_m.shape) == (lr.x.shape[1] + 1, lr.spec.r)
    assert set(st.lambda_max) == {"query", "input"} and set(st.descends) == {"query", "input"}
    assert st.keys[-1] == 7 and st.self_mass == float(st.softmax[-1])


def test_step_against_the_oracle_query_space(qwen3_run):
    lr = qwen3_run[1]
    assert lr.space == "query" and "not affine" in lr.input_space_reason
    _against_oracle(lr, [(1, 5), (3, N - 1)])
    st = lr.step(1, 5)
    assert tuple(st.delta_m.shape) == (lr.spec.head_dim + 1, lr.spec.r)
    assert "input_space" in st.not_defined and set(st.lambda_max) == {"query"}
    with pytest.raises(api.ApiError, match="Delta M_i in input space is not defined: its "
                                           "'qknorm' score normalises the query"):
        lr.delta_m(1, 5)


def test_step_native_against_the_model_and_planted_errors(llama_run, monkeypatch):
    lr = llama_run[1]
    st = lr.step(1, 10)
    assert st.native_error <= st.native_bound and st.identity_error <= st.identity_bound
    assert torch.equal(st.native, lr.native[10, 1].double())
    # a wrong native capture (one value entry moved by 10x its bound): the native check only
    bad = api.LayerRun.__new__(api.LayerRun)
    bad.__dict__.update(lr.__dict__, _head_cache={}, _check={})
    nat = lr.native.clone()
    nat[10, 1, 0] += 10 * st.native_bound
    bad.native = nat
    sb = bad.step(1, 10)
    assert [f.split(":")[0] for f in sb.failures] == ["native"]
    with pytest.raises(api.VerdictError, match="layer 1 head 1 query 10: native: error"):
        sb.assert_passed()
    # a softmax output that drifts from the readout: the identity check only
    real = fast.step

    def drifted(*a, **k):
        out = real(*a, **k)
        out.y = out.y + 1e-9  # 100x the identity's bound, 1e-6 of the native one
        return out

    monkeypatch.setattr(fast, "step", drifted)
    sd = lr.step(1, 10)
    assert [f.split(":")[0] for f in sd.failures] == ["identity"]
    # NaN is a failure, said as such
    sd.identity_error = math.nan
    assert "not finite" in sd.failures[0]


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_reuse_against_the_oracle(arch, llama_run):
    """gpt-oss: the sink's logit lives in Delta M_a's bias row, which u_i's 1 reads."""
    lr = llama_run[1] if arch == "llama" else api.attach(archzoo.build(arch)).run(
        _ids(), layers=1)[1]
    spec, w = lr.head_description
    h, a, qs = 2, 4, [5, 9, N - 1]
    r = lr.reuse(h, a, qs)
    ref = realchecks.exact_reference(spec, w, lr.x.double(), lr.positions, [(h, a)], digits=30)
    u = torch.cat((lr.x[qs].double(), torch.ones(len(qs), 1, dtype=torch.float64)), 1)
    g = spec.kv_head(h)  # mu_a: the plain mean of the anchor's permitted values (and the
    v = lr.x[:a + 1].double() @ w.w_v[:, g] + (0 if w.b_v is None else w.b_v[g])  # sink's 0)
    mu_a = v.sum(0) / (a + 1 + (spec.sinks is not None))
    want = mu_a + u @ torch.as_tensor(ref.delta_m[h, a])  # mu_a + u_i^T Delta M_a
    S = ref.value_scale[h, a]
    assert torch.allclose(r.frozen, want, rtol=0, atol=1e-11 * S * ref.dm_scale[h, a].max())
    ys = torch.stack([lr.step(h, q).y for q in qs])
    assert torch.allclose(r.y, ys, rtol=0, atol=1e-13 * S)
    assert torch.allclose(r.error, (ys - r.frozen).norm(dim=-1), rtol=1e-12)
    assert bool(((r.tv >= 0) & (r.tv <= 1)).all())
    assert r.distance.tolist() == [q - a for q in qs]
    # at the anchor's position and bank: the bound is a theorem, the tokenwise formula exact
    ra = lr.reuse(h, a, qs, at="anchor")
    assert bool((ra.error <= ra.bound * (1 + 1e-9)).all())
    assert torch.allclose(ra.tokenwise.norm(dim=-1), ra.error, rtol=1e-9)
    assert len(ra.rows()) == 3 and "bound" in ra.rows()[0]


def test_check_is_the_atlas_on_the_same_tokens(tmp_path):
    """:meth:`LayerRun.check` against ``ropestep atlas`` (atlas.run on the same model and one
    context): every leaf of every layer's summary equal (NaN where NaN)."""
    from test_protocol import build_tiny_qwen2

    from ropestep import atlas, models
    from ropestep.corpus import load_corpus, select_blocks, tokenizer_fn

    d = build_tiny_qwen2(tmp_path / "m")
    model, tok = models.load_model(str(d))
    cfg = atlas.AtlasConfig(model=str(d), contexts=1, length=40, anchor_every=16, layers="all")
    rep = atlas.run(cfg, progress=False, loaded=(model, tok, {}))
    blocks = select_blocks(load_corpus("default").articles, tokenizer_fn(tok), 1, 40, cfg.seed)
    lab = api.attach(model, tok)
    run = lab.run(torch.tensor(blocks[0].ids))
    checks = run.check(anchor_every=16)

    for L, c in checks.items():
        assert leaf_differences(c.summary, rep["layers"][str(L)], f"layer {L}") == []
        assert c.passed
    rows = run.rows()
    assert len(rows) == 2 * 7 and rows[0]["layer"] == 0 and "checks.identity_float64" in rows[0]
    qrows = checks[0].rows("query")
    assert len(qrows) == 7 * 40 and set(qrows[0]) >= {"head", "query", "native_abs", "lam_query"}


def test_check_planted_native_error_fails():
    lab = api.attach(archzoo.build("llama"))
    lr = lab.run(_ids(), layers=0)[0]
    assert lr.check(anchor_every=8).passed
    nat = lr.native.clone()
    nat[13, 2] *= 1.001
    lr.native = nat
    lr._check = {}
    c = lr.check(anchor_every=8)
    assert not c.passed and c.failures == [
        "layer 0 head 2: float64_vs_native, float64_original_gauge_vs_native, "
        "model_dtype_vs_native"]
    with pytest.raises(api.VerdictError, match="layer 0 head 2"):
        c.assert_passed()


def test_bfloat16_sdpa_and_window():
    # bfloat16: the model's dtype is the low-precision pass's, the bounds are bf16's
    lab = api.attach(archzoo.build("llama", dtype=torch.bfloat16))
    lr = lab.run(_ids(), layers=1)[1]
    assert lr.x.dtype == torch.bfloat16
    lr.step(0, -1).assert_passed()
    lr.check(anchor_every=8).assert_passed()
    # SDPA: switched to eager for ropestep's forwards, switched back after
    m = archzoo.build("llama")
    m.set_attn_implementation("sdpa")
    lab = api.attach(m)
    assert m.config._attn_implementation == "sdpa"
    lab.run(_ids(), layers=0)[0].step(1, 5).assert_passed()
    assert m.config._attn_implementation == "sdpa"
    # a sliding window shorter than the prompt: the step reads the window only
    lab = api.attach(archzoo.build("mistral"))
    lr = lab.run(_ids(40), layers=1)[1]
    st = lr.step(0, 39)
    assert st.keys.tolist() == list(range(40 - archzoo.WINDOW, 40))
    st.assert_passed()
    _against_oracle(lr, [(0, 39)])


def test_bad_input(llama, llama_run):
    lr = llama_run[1]
    block = _ids()
    cands = llama.run_candidates(block, [int(block[-1]), 2, 3], layers=1)
    cases = [
        (lambda: llama.run(_ids(), layers=7), "layer 7 out of range: the model has 2 layers"),
        (lambda: llama.run("some text"), "a text prompt needs a tokenizer"),
        (lambda: llama.run(torch.tensor([], dtype=torch.long)), "non-empty 1-D sequence"),
        (lambda: llama.run(torch.tensor([1.0, 2.0])), "token ids must be integers"),
        (lambda: llama.run(torch.tensor([1, 999])), "token id 999 out of range"),
        (lambda: llama.run(_ids(), positions=[0] * 5), r"positions has shape \(5,\) for 24"),
        (lambda: llama.run(_ids(3), positions=[2, 1, 3]), "positions must be consecutive"),
        (lambda: llama.run(_ids(3), positions=[0, 1, 1]), "positions must be consecutive"),
        (lambda: llama.run(_ids(3), positions=[0, 1, 5]), "new packed sequence"),
        (lambda: llama.run(_ids(3), positions=[0.5, 1.5, 2.5]), "positions must be integers"),
        (lambda: llama.run(_ids(3), positions="abc"), "positions must be integers"),
        (lambda: llama.run(_ids(3), positions=[10 ** 7 + k for k in range(3)]),
         "beyond the model's context"),
        (lambda: llama.run(_ids(), layers=None), "the layer indices must be one int or a sequence"),
        (lambda: llama.run(_ids(), layers=1.0), "the layer indices must be one int or a sequence"),
        (lambda: llama.run(None), "a prompt is a text or token ids"),
        (lambda: llama.run(torch.tensor([1 + 1j])), "token ids must be integers"),
        (lambda: llama.runs(None), "runs\\(\\) takes a list"),
        (lambda: lr.position_derivative(5.0), "the query indices must be one int"),
        (lambda: lr.check(device="foo"), "device must be 'cpu' or 'cuda"),
        (lambda: lr.check(dtype="float32"), "dtype must be a torch.dtype"),
        (lambda: api.load(5), "load\\(\\) takes a hub id"),
        (lambda: llama.run(_ids(), layers="some"), "layers must be 'all'"),
        (lambda: llama_run[0], r"layer 0 was not kept by this run \(kept: \[1\]\)"),
        (lambda: lr.step(4, 0), "head 4 out of range: layer 1 has 4 heads"),
        (lambda: lr.step(0, N), f"query {N} out of range: the prompt has {N} tokens"),
        (lambda: lr.step(0, 1.5), r"a query \(a token index of the prompt\) is an int"),
        (lambda: lr.step(0, 1, gauge="pairwise"), "gauge must be 'original' or 'maxkey'"),
        (lambda: lr.reuse(0, N - 1), "no queries to reuse"),
        (lambda: lr.reuse(0, 1, at="elsewhere"), "at must be 'own' or 'anchor'"),
        (lambda: lr.check(anchor_every=0), "anchor_every must be a positive int"),
        (lambda: lr.check(dtype=torch.float64), "dtype must be a torch.dtype: torch.float32"),
        (lambda: api.attach(torch.nn.Linear(2, 2)), "attach\\(\\) needs a Hugging Face"),
        (lambda: llama.runs("one string"), "runs\\(\\) takes a list"),
        (lambda: llama.run_candidates(_ids(1), [1, 2]), "a block needs at least 2 tokens"),
        (lambda: llama.run_candidates(_ids(), [1, 999]), "token id 999 out of range"),
        (lambda: llama.run_candidates(_ids(), []), "non-empty 1-D sequence"),
        (lambda: llama.head_description(0, 0), "n_positions must be >= 1"),
        (lambda: llama.head_description(5, 4), "layer 5 out of range"),
        (lambda: cands.evaluate(0), r"layer 0 was not kept by this run \(kept: \[1\]\)"),
        (lambda: cands.evaluate(1, model_dtype="float16"), "model_dtype must be one of"),
        (lambda: llama.run_candidates(block, [(int(block[-1]) + 1) % 100, int(block[-1])]),
         "the first candidate must be the block's last token"),
        (lambda: llama.run_candidates(block, lambda logits: [(int(block[-1]) + 1) % 100]),
         "the candidates function must put the block's last token"),
        (lambda: lr.evaluate(anchor_every=0), "anchor_every must be a positive int"),
        (lambda: lr.evaluate(dtype=torch.int32), "dtype must be a torch.dtype"),
        (lambda: lr.evaluate(device="mps"), "device must be 'cpu' or 'cuda"),
    ]
    for call, msg in cases:
        with pytest.raises(api.ApiError, match=msg):
            call()
    m = archzoo.build("llama")
    m.train()
    with pytest.raises(api.ApiError, match="training mode"):
        api.attach(m)
    lab = api.attach(m.eval())
    m.train()  # after attach: the run says so too
    with pytest.raises(api.ApiError, match="training mode"):
        lab.run(_ids())
    m.eval()
    # integer tensors and numpy integers are indices too
    st = lr.step(torch.tensor(1), np.int64(5))
    assert (st.head, st.query) == (1, 5)
    assert lr.reuse(0, 3, torch.tensor([5, 6])).queries.tolist() == [5, 6]
    # a compiled model is attached through the module inside; weights not loaded are refused
    assert api.attach(torch.compile(m)).model is m
    with torch.device("meta"):
        meta = type(m)(m.config)
    with pytest.raises(api.ApiError, match="its weights are not loaded"):
        api.attach(meta)
    # a tokenizer's output is a prompt
    assert api.attach(m).encode({"input_ids": torch.tensor([[1, 2, 3]])}).tolist() == [1, 2, 3]


def test_positions_offset_and_weights_edited_after_the_run():
    """Consecutive positions from p0 > 0 give the model's own keys (the oracle agrees); a
    chunked model refuses an offset (transformers counts chunks from the first token); weights
    edited after the run are refused, never mixed with the capture."""
    lab = api.attach(archzoo.build("llama"))
    lr = lab.run(_ids(), layers=1, positions=torch.arange(N) + 5)[1]
    assert lr.step(2, 7).keys.tolist() == list(range(8))
    _against_oracle(lr, [(2, 7)])
    lr.check(anchor_every=8).assert_passed()
    assert lr.position_derivative([3, N - 1])["ok"]
    from ropestep import census

    l4 = api.attach(census.build("llama4_text"))
    L = next(L for L in l4.layers if l4.conventions(L).chunk is not None)
    with pytest.raises(api.ApiError, match="positions must start at 0 on this model"):
        l4.run(_ids(40), layers=L, positions=torch.arange(40) + 5)
    m = archzoo.build("llama")
    lab = api.attach(m)
    run = lab.run(_ids(), layers=[0, 1])
    run[0].step(0, 3)  # layer 0 read before the edit: it keeps the weights it was run with
    with torch.no_grad():
        m.model.layers[1].self_attn.v_proj.weight.mul_(3.0)
    with pytest.raises(api.ApiError, match="layer 1's weights changed since this prompt ran"):
        run[1].reuse(0, 5, [10, 15])
    run[0].step(0, 3).assert_passed()
    lab.run(_ids(), layers=1)[1].step(0, 10).assert_passed()  # a new run reads the new weights


def test_query_space_reuse_bound_and_refusals():
    lr = api.attach(archzoo.build("qwen3")).run(_ids(), layers=1)[1]
    ra = lr.reuse(1, 4, [6, 11], at="anchor")
    assert ra.bound is not None and bool((ra.error <= ra.bound * (1 + 1e-9)).all())
    ro = lr.reuse(1, 4)
    assert torch.allclose(ro.relative_error * ro.mean_error, ro.error, rtol=1e-12)
    ds = api.attach(archzoo.build("deepseek_v3")).run(_ids(), layers=1)[1]
    with pytest.raises(api.ApiError, match="the position derivative .* is not defined here"):
        ds.position_derivative([3])
    ds.step(0, -1).assert_passed()
    g2 = api.attach(archzoo.build("gemma2")).run(_ids(), layers=1)[1]  # soft-capped
    with pytest.raises(api.ApiError, match="lambda_max in query space is not defined"):
        api.plot_lambda(g2.check(anchor_every=8))
    with pytest.raises(api.ApiError, match="space must be 'query' or 'input'"):
        api.plot_lambda(g2.check(anchor_every=8), space="foo")


def test_public_names_and_doctests():
    from pathlib import Path

    assert ropestep.attach is api.attach and ropestep.load is api.load
    assert (Path(api.__file__).parent / "py.typed").is_file()  # type hints are public
    res = doctest.testmod(api, verbose=False)
    assert res.failed == 0 and res.attempted >= 2


def test_nnsight_and_transformer_lens_wrappers(tmp_path):
    """An nnsight LanguageModel and a TransformerLens TransformerBridge over a tiny Llama: the
    Hugging Face model inside is attached (the wrapper's tokenizer taken), and gives what the
    model itself gives; a bridge whose forward is not its model's is refused."""
    nnsight = pytest.importorskip("nnsight")
    tl_bridge = pytest.importorskip("transformer_lens.model_bridge")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = archzoo.save("llama", tmp_path / "llama")
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(d)
    direct = api.attach(model, tok).run("abc abd abe", layers=1)[1].step(2, -1)
    lm = nnsight.LanguageModel(model, tokenizer=tok)
    lab = api.attach(lm)
    assert lab.model is model and lab.tokenizer is tok and lab.via == "nnsight"
    st = lab.run("abc abd abe", layers=1)[1].step(2, -1)
    assert torch.equal(st.delta_m, direct.delta_m) and st.passed
    br = tl_bridge.TransformerBridge.boot_transformers(str(d), hf_model=model, tokenizer=tok,
                                                       device="cpu")
    # the bridge rebuilds the model's modules in place: the model is mapped back from them
    lab = api.attach(br)
    assert lab.via == "TransformerLens" and type(lab.model) is type(model)
    assert torch.equal(lab.run("abc abd abe", layers=1)[1].step(2, -1).delta_m, direct.delta_m)
    br.enable_compatibility_mode()  # folded, centred weights: the same function, accepted
    assert api.attach(br).run("abc abd abe", layers=1)[1].step(2, -1).passed
    other = archzoo.build("llama", seed=3)  # a bridge whose model is not the one it runs

    class Swapped(torch.nn.Module):
        __module__ = "transformer_lens.fake"

        def __init__(self):
            super().__init__()
            self.original_model = other

        def forward(self, ids):
            return model(ids).logits

    with pytest.raises(api.ApiError, match="the wrapper's forward differs from its Hugging "
                                           "Face model's"):
        api.attach(Swapped())


def test_offloaded_model_gives_the_in_memory_step(tmp_path):
    """A model placed by accelerate's device_map with a third of its weights' size as the CPU
    budget (the rest offloaded to disk): attach, run and step read each layer through the
    offload hooks and give the in-memory model's numbers, bit for bit."""
    pytest.importorskip("accelerate")
    from ropestep import models

    d = archzoo.save("llama", tmp_path / "llama")
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    whole = api.attach(*models.load_model(str(d)))
    off_model, tok = models.load_model(str(d), device_map="auto",
                                       max_memory={"cpu": size // 3},
                                       offload_folder=str(tmp_path / "off"))
    assert "disk" in set(getattr(off_model, "hf_device_map", {}).values())
    off = api.attach(off_model, tok)
    a = whole.run(_ids(), layers=[0, 1])
    b = off.run(_ids(), layers=[0, 1])
    for L in (0, 1):
        sa, sb = a[L].step(3, -1), b[L].step(3, -1)
        assert torch.equal(sa.delta_m, sb.delta_m) and torch.equal(sa.native, sb.native)
        assert sb.passed


def test_a_composite_models_mixed_attention_is_restored_exactly():
    """A multimodal config whose text and vision towers use different attention implementations
    (SDPA and eager) is switched to eager inside ropestep's forwards and restored per sub-config
    afterwards -- not flattened to the top-level string."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         vocab_size=300),
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)
    m = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    m.set_attn_implementation({"text_config": "sdpa", "vision_config": "eager"})

    def impls():
        c = m.config
        return (c._attn_implementation, c.text_config._attn_implementation,
                c.vision_config._attn_implementation)

    before = impls()
    assert before == ("sdpa", "sdpa", "eager")
    with api._eager(m):
        assert impls() == ("eager", "eager", "eager")
    assert impls() == before
