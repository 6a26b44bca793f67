"""The census: every causal-LM model type of the installed transformers, as a tiny model, through
``ropestep atlas`` and ``ropestep validate`` (:mod:`ropestep.census`,
:func:`ropestep.architectures.run_type`).

Every type must end as *pass*, *refused* (one line naming what is not modelled), *not buildable*
(transformers' own error) or *duplicate* -- never a traceback, never a FAIL verdict on a model that
is right.  The default run takes every third type of the mapping (a representative third, the
same slice ``ropestep architectures --all --every 3`` takes); the rest is marked ``slow``.

The census's own verdict has power: a model whose attention is perturbed (so that no correct
reading can reproduce it) ends as FAIL or refused, never as pass, and a wrong reading of each
convention the census opened (the output gate's rows, the rotation's direction, the heads'
output before a norm, the tables' order, a hybrid's softmax layers) fails the run.
"""
from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

from ropestep import architectures, census, cli, models  # noqa: E402

TYPES = list(census.causal_types())
DEFAULT = set(TYPES[::3])  # the representative third of the default run

# Types that pass today: each must keep passing (a new refusal or a FAIL is a regression; a type
# that starts passing is welcome -- add it here).  Among them the frontier architectures the
# census opened: hybrids of linear and softmax layers (Qwen3-Next, Qwen3.5, LFM2, Falcon-H1,
# Granite 4, Bamba, OLMo hybrid, Zamba 2), BitNet's sub-norm, nanochat's reversed rotation and
# weightless norms, Llama 4's complex tables.
PASSING = {
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "bailing_hybrid",
    "bamba", "bitnet", "bloom", "codegen", "cohere", "cohere2", "cohere2_moe", "cwm", "dbrx",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "emu3", "ergo", "ernie4_5",
    "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon", "falcon_h1", "flex_olmo",
    "flint", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm_moe_dsa", "gpt_neox", "gpt_oss", "gptj", "granite", "granitemoe", "granitemoehybrid",
    "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4",
    "hyperclovax", "internlm3", "iquestcoder", "jais2", "kolibri1", "laguna", "lara_mini",
    "lfm2", "lfm2_moe", "lfm3", "llama", "llama4_text", "mellum", "mimo_v2_flash", "minicpm3",
    "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
    "mixtral", "mllama", "modernbert-decoder", "mpt", "nanochat", "nemotron", "olmo", "olmo2",
    "olmo3", "olmo_hybrid", "olmoe", "param2moe", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2",
    "vaultgemma", "youtu", "zamba2",
}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _check_outcome(name: str, rec: dict) -> None:
    """What every census record must satisfy, whatever its outcome."""
    assert rec["outcome"] in architectures.CENSUS_OUTCOMES, rec["outcome"]
    assert rec["outcome"] != "fail", f"{name}: {rec['failures']}"
    assert not rec["failures"], rec["failures"]
    for cmd in ("atlas", "validate"):
        res = rec.get(cmd)
        if res is None:
            continue
        assert res["outcome"] != "crash", res.get("crash")
        if res["outcome"] == "refused":
            line = res["refusal"]
            assert line and "\n" not in line and "Traceback" not in line
            assert f"models/{name}" in line or name in line, line  # names the model
    if rec["outcome"] == "not buildable":
        assert rec["why"] and "\n" not in rec["why"]
    if rec["outcome"] == "duplicate":
        assert rec["duplicate_of"] in TYPES


@pytest.mark.parametrize("name", [
    pytest.param(t, marks=() if t in DEFAULT else pytest.mark.slow) for t in TYPES])
def test_every_model_type_passes_or_is_refused_in_one_line(name, tmp_path):
    rec = architectures.run_type(name, tmp_path, 0, cli.main)
    _check_outcome(name, rec)
    if name in PASSING:
        assert rec["outcome"] == "pass", (rec.get("atlas", {}).get("refusal"),
                                          rec.get("validate", {}).get("refusal"), rec["failures"])


def test_the_census_lists_every_causal_lm_type_once():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert TYPES == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert PASSING <= set(TYPES)
    assert len(PASSING) >= 100
    # a multimodal type is its text model; one the mapping lists itself is counted there
    ent = census.entry("gemma3")
    assert (ent.text_type, ent.duplicate_of) == ("gemma3_text", "gemma3_text")
    assert census.entry("llama").duplicate_of is None
    with pytest.raises(KeyError, match="not a causal-LM model type"):
        census.entry("bert-base-uncased")


def test_tiny_configs_shrink_and_keep_every_kind_of_layer():
    cfg = census.tiny_config("qwen3_next")  # one softmax layer in four by default
    assert cfg.num_hidden_layers == 4 and set(cfg.layer_types) == {"linear_attention",
                                                                   "full_attention"}
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (128, 4, 256)
    g = census.tiny_config("gptj")  # GPT-J's n_embd through its attribute_map
    assert (g.hidden_size, g.rotary_dim) == (128, 16)
    assert census._depth(["a", "a", "a", "b", "a"], 5) == (4, ["a", "a", "a", "b"])
    assert census._depth(["a"] * 20 + ["b"], 21) == (2, ["a", "b"])  # late kinds: first of each
    assert census._depth(None, 30) == (census.MIN_LAYERS, None)
    for name, (kw, why) in census.OVERRIDES.items():
        assert name in TYPES and kw and why, name


def test_a_model_the_census_cannot_shrink_is_not_buildable(monkeypatch):
    monkeypatch.setattr(census, "MAX_PARAMETERS", 1000)
    with pytest.raises(census.NotBuildable, match="parameters"):
        census.build("llama")


def test_the_command_runs_a_slice_of_the_census(tmp_path):
    out = tmp_path / "rep"
    rc = architectures.main(["--types", "gemma3,bitnet,bert", "--out", str(out), "--quiet"])
    assert rc == 0
    rep = architectures._load(out / "report.json")
    assert list(rep["census"]) == ["bert", "bitnet", "gemma3"] and rep["architectures"] == {}
    s = rep["census_summary"]
    assert s["by_outcome"]["pass"] == ["bitnet"] and s["by_outcome"]["duplicate"] == ["gemma3"]
    assert s["by_outcome"]["refused"] == ["bert"] and s["rotary_by_outcome"]["pass"] == 1
    md = (out / "report.md").read_text()
    assert "## Census" in md and "| `bitnet` |" in md
    assert architectures.census_selection(True, None, 3, 1, list("abcdefg")) == ["b", "e"]
    for bad in (["--types", "nope"], ["--all", "--types", "llama"], ["--every", "2"],
                ["--all", "--every", "2", "--offset", "2"]):
        assert architectures.main([*bad, "--out", str(tmp_path / "x"), "--quiet"]) == 2


# ---------------------------------------------------------------------------------------------
# the census's verdict has power
# ---------------------------------------------------------------------------------------------
def _perturbed_eager(monkeypatch, module: str, longer_than: int) -> None:
    """Perturb the eager attention's output of one modeling module on sequences longer than
    ``longer_than`` tokens (0: always): a model no correct reading reproduces there."""
    mm = sys.modules[module]
    orig = mm.eager_attention_forward

    def wrong(module_, query, key, value, attention_mask, *a, **k):
        out, w = orig(module_, query, key, value, attention_mask, *a, **k)
        if query.shape[-2] > longer_than:
            out = out.clone()
            out[..., 0, 0] += 1e-3 * out.abs().max()
        return out, w

    monkeypatch.setattr(mm, "eager_attention_forward", wrong)


@pytest.mark.parametrize("longer_than", [0, models.conventions.PROBE_TOKENS])
def test_a_perturbed_attention_is_never_a_pass(longer_than, tmp_path, monkeypatch):
    import transformers.models.llama.modeling_llama as ml

    _perturbed_eager(monkeypatch, ml.__name__, longer_than)
    rec = architectures.run_type("llama", tmp_path, 0, cli.main)
    # seen by the reading (refused), or only on the runs' longer sequences (a FAIL verdict)
    assert rec["outcome"] == ("refused" if longer_than == 0 else "fail"), rec
    if longer_than:
        assert rec["atlas"]["exit"] == 1 and rec["validate"]["exit"] == 1


def _wrong_gate(attn, H, Hk, d, r):
    """Qwen3-Next's gated q_proj with the gate's rows read as the query's."""
    got = models.layouts.gated(attn, H, Hk, d, r)
    if got is None:
        return None
    q = models.layouts._lin(attn, "q_proj")
    rows = (torch.arange(H)[:, None] * 2 * d + d + torch.arange(d)[None]).reshape(-1)
    got["q"] = models.layouts._wb(q, idx=rows)
    return got


_PERM = models.conventions._perm


def _no_sign(conv, d):
    """The permutation of a layer read as turning the usual way."""
    from dataclasses import replace

    return _PERM(replace(conv, sign=1), d)


def _swapped_pairs(conv, d):
    """Each rotated pair's two dims swapped: the rotation turned the other way."""
    out = _PERM(conv, d)
    if conv.rotary_dim:
        out = out.view(2, -1).flip(0).reshape(-1) if conv.pairing == "half" else \
            out.view(-1, 2).flip(-1).reshape(-1)
    return out


def _split_moved(attn, H, d, rv, who, L):
    """A latent layer's parts with the latent/rope split read two dims off."""
    P = _LATENT_PARTS(attn, H, d, rv, who, L)
    return {**P, "rank": P["rank"] - 2, "rope": P["rope"] + 2, "nope": P["nope"] - 2}


_LATENT_PARTS = models.conventions._latent_parts


@pytest.mark.parametrize("name, what", [
    ("qwen3_next", "gate"), ("nanochat", "sign"), ("bitnet", "output"), ("gpt_neox", "pairs"),
    ("gptj", "order"), ("deepseek_v3", "latent_order"), ("deepseek_v2", "latent_split"),
    ("gpt_oss", "sink"), ("hunyuan_v1_dense", "norm_order"), ("llama4_text", "chunk"),
    ("bloom", "alibi_slope"), ("mpt", "alibi_sign"), ("qwen3_next", "gate_applied"),
    ("llama4_text", "temperature")])
def test_a_wrong_reading_of_each_new_convention_fails_the_run(name, what, tmp_path,
                                                              monkeypatch):
    conv = models.conventions
    if what == "gate":  # the output gate's rows of q_proj taken for the query's
        monkeypatch.setitem(models.layouts.LAYOUTS, "gated", _wrong_gate)
    elif what == "sign":  # nanochat's reversed rotation read as HF's
        monkeypatch.setattr(conv, "_perm", _no_sign)
    elif what == "output":  # BitNet: the heads' output taken where o_proj reads it (normed)
        monkeypatch.setattr(conv, "_output_path", lambda r, who, L: (True, ""))
    elif what == "pairs":  # the rotation's direction flipped after the reading
        monkeypatch.setattr(conv, "_perm", _swapped_pairs)
    elif what == "norm_order":  # Hunyuan's QK-norm (after RoPE) described as before it
        real_head = models.layer_head

        def norm_before(*a, **k):
            spec, w = real_head(*a, **k)
            return replace(spec, norm_after_rope=False), w

        monkeypatch.setattr(models, "layer_head", norm_before)
    elif what == "chunk":  # Llama 4's chunks read one position too long
        real_head = models.layer_head

        def longer_chunk(*a, **k):
            spec, w = real_head(*a, **k)
            return replace(spec, chunk=spec.chunk and spec.chunk + 1), w

        monkeypatch.setattr(models, "layer_head", longer_chunk)
    elif what == "temperature":  # Llama 4's NoPE query temperature read 10% too strong
        real_head = models.layer_head

        def stronger(*a, **k):
            spec, w = real_head(*a, **k)
            qt = spec.query_temperature
            return replace(spec, query_temperature=qt and (qt[0], 1.1 * qt[1])), w

        monkeypatch.setattr(models, "layer_head", stronger)
    elif what == "gate_applied":  # the output gate applied as 1 - sigmoid (its pre-activation
        # negated): the heads and head-space write are unaffected, the model's write is not
        real_gate = models.layer_gate

        def other_side(*a, **k):
            g = real_gate(*a, **k)
            return None if g is None else replace(
                g, w_g=-g.w_g, b_g=None if g.b_g is None else -g.b_g)

        monkeypatch.setattr(models, "layer_gate", other_side)
    elif what in ("alibi_slope", "alibi_sign"):  # ALiBi slopes read at half their value, or
        # with the sign of the bias reversed (slope (p_i - p_j))
        real_head = models.layer_head

        def wrong_slopes(*a, **k):
            spec, w = real_head(*a, **k)
            f = 0.5 if what == "alibi_slope" else -1.0
            return replace(spec, alibi_slopes=tuple(f * v for v in spec.alibi_slopes)), w

        monkeypatch.setattr(models, "layer_head", wrong_slopes)
    elif what == "sink":  # the sink logits read one unit off (a wrong sink logit)
        real_sinks = conv._sinks
        monkeypatch.setattr(conv, "_sinks", lambda attn, c: None if real_sinks(attn, c) is None
                            else tuple(v + 1.0 for v in real_sinks(attn, c)))
    elif what == "latent_order":  # the rotated dims of a latent layer in split-half order
        monkeypatch.setattr(conv, "latent_rope_order", lambda pairing, pre, rho: torch.cat(
            [torch.arange(0, rho, 2), torch.arange(1, rho, 2)]))
    elif what == "latent_split":  # the latent/rope split of kv_a_proj_with_mqa read off by 2
        monkeypatch.setattr(conv, "_latent_parts", _split_moved)
    elif what == "order":  # GPT-J's (sin, cos) taken as handed, for (cos, sin)
        orig_read = conv._read_layer

        def as_handed(model, info, L, r):
            if r.cos is not None:  # defeat the order's detection: position 0's cos no longer 0
                r.cos = r.cos.clone()
                r.cos[..., 0, :] += torch.finfo(r.cos.dtype).tiny
            return orig_read(model, info, L, r)

        monkeypatch.setattr(conv, "_read_layer", as_handed)
    rec = architectures.run_type(name, tmp_path, 0, cli.main)
    assert rec["outcome"] in ("fail", "refused"), (rec["outcome"], what)
    if what not in ("output", "gate_applied"):  # the atlas reads the heads only; the write
        # is validate's
        assert rec["atlas"]["outcome"] in ("fail", "refused"), (rec["atlas"], what)
    else:
        assert rec["validate"]["outcome"] == "fail"


@pytest.mark.parametrize("name", ["lfm2", "qwen3_next"])
def test_a_hybrids_other_layers_are_listed_and_refused_by_name(name, tmp_path):
    model = census.build(name)
    info = models.describe_model(model)
    assert info.others and info.softmax_layers
    assert all(info.layers[L] is None for L, _ in info.others)
    L, why = info.others[0]
    assert "attention" in why or "conv" in why.lower()
    with pytest.raises(models.UnsupportedModelError, match=f"layer {L} is not softmax attention"):
        models.layer_head(model, L, 8)
    from ropestep.protocol import ProtocolError, parse_indices

    assert parse_indices("all", info.n_layers, "layer", info.softmax_layers,
                         dict(info.others)) == list(info.softmax_layers)
    with pytest.raises(ProtocolError, match=f"layer {L} is not softmax attention"):
        parse_indices(str(L), info.n_layers, "layer", info.softmax_layers, dict(info.others))


def test_a_clipped_projection_is_read_and_needed(tmp_path, monkeypatch):
    """DBRX's clip_qkv (active in the zoo's model: projections of RMS ~1.7 clipped at 2) is read
    from the module and carried by the head description (``HeadSpec.clip``); without it the
    reading refuses the layer, and a description without it misses the model."""
    from ropestep import archzoo

    model = archzoo.build("dbrx")
    info = models.describe_model(model)
    assert {c.clip for c in info.conventions()} == {2.0}
    spec, _ = models.layer_head(model, 0, 8)
    assert spec.clip == 2.0 and not spec.affine
    d = archzoo.save("dbrx", tmp_path / "dbrx")
    monkeypatch.setattr(models.conventions, "_clip", lambda attn: None)
    rc = cli.main(["atlas", "--model", str(d), "--contexts", "1", "--len", "40", "--layers", "all",
                   "--no-figures", "--quiet", "--out", str(tmp_path / "a")])
    assert rc == 2  # the module's own projections are not reproduced without the clip
