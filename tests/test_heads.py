"""``ropestep.heads`` diagnostics against independent computations on hand-made weights.

* condition number and effective rank of ``W = U diag(sigma) V^T`` with orthonormal ``U``, ``V``
  built here: the known ``sigma`` gives ``cond = sigma_1/sigma_d`` and Roy & Vetterli's effective
  rank ``exp(H(sigma/sum sigma))`` without any SVD;
* band energy and barycenter of heads whose energy lies in one RoPE pair ``l``: one-hot at ``l``
  and ``t = l/(d/2 - 1)`` in both layouts (pairs written out here, not taken from ropestep);
* the GQA grouping ``h // group`` and the document's literal sketch;
* mutations of the frequency axis (reversed pair index, the other layout's pairing) are caught.

Tolerances come from :mod:`ropestep.tolerances` (``FLOAT64_REL``: a float64 SVD of a matrix with
condition number 100 carries relative errors of order ``d u cond ~ 1e-13``).
"""
from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from ropestep import heads, rope
from ropestep import tolerances as tl
from ropestep.report import load
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

M = 12


def orthonormal(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q * np.sign(np.diag(r))


def with_singular_values(sigma: np.ndarray, seed: int = 0) -> np.ndarray:
    """An ``(m, d)`` matrix, ``m = max(M, d + 4)``, with exactly these singular values."""
    rng = np.random.default_rng(seed)
    d = sigma.size
    m = max(M, d + 4)
    return orthonormal(rng, m, d) @ np.diag(sigma) @ orthonormal(rng, d, d).T


def roy_vetterli(sigma: np.ndarray) -> float:
    p = sigma[sigma > 0] / sigma.sum()
    return math.exp(-sum(float(x) * math.log(float(x)) for x in p))


def pair_columns(ell: int, d: int, layout: str) -> tuple[int, int]:
    """RoPE pair ``ell``'s two dimensions, written out (docs/math.md section 1)."""
    return (ell, ell + d // 2) if layout == "half" else (2 * ell, 2 * ell + 1)


def in_pair(ell: int, d: int, layout: str, rng: np.random.Generator, m: int = M) -> np.ndarray:
    w = np.zeros((m, d))
    for c in pair_columns(ell, d, layout):
        w[:, c] = rng.standard_normal(m)
    return w


@pytest.mark.parametrize("sigma", [
    np.array([100.0, 50, 20, 10, 5, 3, 2, 1]),
    np.geomspace(1.0, 1e3, 16)[::-1],
    np.ones(8),
])
def test_condition_number_and_effective_rank_of_known_spectra(sigma, one_thread):
    w = with_singular_values(sigma)
    got = heads.matrix_diagnostics(w, "half")
    cond, erank = sigma.max() / sigma.min(), roy_vetterli(sigma)
    print(f"cond {got['cond']:.15g} (want {cond:.15g}), erank {got['effective_rank']:.15g} "
          f"(want {erank:.15g})")
    assert abs(got["cond"] / cond - 1) <= tl.FLOAT64_REL
    assert abs(got["effective_rank"] / erank - 1) <= tl.FLOAT64_REL
    assert abs(got["cond"] / np.linalg.cond(w) - 1) <= tl.FLOAT64_REL  # numpy's own 2-norm cond
    assert abs(got["frobenius"] / math.sqrt(float((sigma ** 2).sum())) - 1) <= tl.FLOAT64_REL
    assert 1.0 <= got["effective_rank"] <= sigma.size * (1 + tl.FLOAT64_REL)


def test_effective_rank_counts_equal_singular_values():
    for r in (1, 3, 8):
        sigma = np.concatenate([np.full(r, 2.5), np.zeros(8 - r)])
        got = heads.effective_rank(heads.singular_values(with_singular_values(sigma, seed=r)))
        print(r, got)
        assert abs(got - r) <= r * tl.FLOAT64_REL
    assert heads.effective_rank(np.array([3.0, 3.0, 3.0])) == pytest.approx(3.0, rel=tl.FLOAT64_REL)
    assert heads.condition_number(np.array([2.0, 0.0])) == math.inf
    assert math.isnan(heads.condition_number(np.zeros(3)))
    assert math.isnan(heads.effective_rank(np.zeros(3)))


def _head(layout: str, d: int, wq: np.ndarray, wk: np.ndarray) -> tuple[HeadSpec, HeadWeights]:
    H, Hk = wq.shape[1], wk.shape[1]
    spec = HeadSpec(n_heads=H, n_kv_heads=Hk, head_dim=d, rope=RoPESpec(layout=layout))
    return spec, HeadWeights(w_q=wq, w_k=wk, w_v=np.ones((wq.shape[0], Hk, d)))


def one_hot_problems(layout: str, d: int = 16) -> list[str]:
    """Every pair ``l``: a head whose W_q and W_k live only in pair ``l``.  Returns what differs
    from the expected one-hot band energy at ``l``, coarse band ``l // (d/8)`` and barycenter
    ``l/(d/2 - 1)`` (empty when everything agrees)."""
    rng = np.random.default_rng(3)
    half = d // 2
    problems = []
    for ell in range(half):
        wq = in_pair(ell, d, layout, rng)[:, None, :]
        wk = in_pair(ell, d, layout, rng)[:, None, :]
        spec, w = _head(layout, d, wq, wk)
        res = heads.diagnose_weights(spec, w)
        want = np.eye(half)[ell]
        coarse = np.eye(heads.N_COARSE)[ell // (half // heads.N_COARSE)]
        qh, kh = res["query_heads"][0], res["kv_heads"][0]
        for name, got in (("W_q bands", qh["w_q"]["band_energy_fraction"]),
                          ("W_k bands", kh["w_k"]["band_energy_fraction"])):
            if np.max(np.abs(np.asarray(got) - want)) > tl.FLOAT64_REL:
                problems.append(f"{layout} l={ell}: {name} {np.round(got, 3).tolist()}")
        if np.max(np.abs(np.asarray(qh["w_q"]["coarse_band_fraction"]) - coarse)) > tl.FLOAT64_REL:
            problems.append(f"{layout} l={ell}: coarse {qh['w_q']['coarse_band_fraction']}")
        if abs(qh["barycenter"] - ell / (half - 1)) > tl.FLOAT64_REL:
            problems.append(f"{layout} l={ell}: barycenter {qh['barycenter']}")
    return problems


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_energy_in_one_pair_is_one_hot_and_places_the_barycenter(layout, one_thread):
    problems = one_hot_problems(layout)
    print(problems)
    assert problems == []


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_reversed_frequency_index_is_caught(layout, monkeypatch, one_thread):
    orig = rope.frequency_index
    monkeypatch.setattr(rope, "frequency_index",
                        lambda d, lay: (d // 2 - 1) - orig(d, lay))  # pair 0 made the slowest
    problems = one_hot_problems(layout)
    print(problems[:4])
    assert len(problems) >= 8  # every pair l of d = 16 is misplaced (no fixed point)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_other_layouts_pairing_is_caught(layout, monkeypatch, one_thread):
    orig = rope.frequency_index
    other = "interleaved" if layout == "half" else "half"
    monkeypatch.setattr(rope, "frequency_index", lambda d, lay: orig(d, other))
    problems = one_hot_problems(layout)
    print(problems[:4])
    assert problems


def test_gqa_grouping_and_per_kv_head_reporting(one_thread):
    """4 query heads on 2 KV heads, d = 8: W_q of head h in pair h, W_k of KV head g in pair
    b_g, unit columns.  Then t_h = (h + b_{h // 2}) / 2 / 3; reading KV head h % 2 would not."""
    d, H, Hk, b = 8, 4, 2, (3, 0)
    wq, wk = np.zeros((M, H, d)), np.zeros((M, Hk, d))
    rng = np.random.default_rng(4)
    for h in range(H):
        for c in pair_columns(h, d, "half"):
            v = rng.standard_normal(M)
            wq[:, h, c] = v / np.linalg.norm(v)
    for g in range(Hk):
        for c in pair_columns(b[g], d, "half"):
            v = rng.standard_normal(M)
            wk[:, g, c] = v / np.linalg.norm(v)
    spec, w = _head("half", d, wq, wk)
    res = heads.diagnose_weights(spec, w)
    got = [qh["barycenter"] for qh in res["query_heads"]]
    want = [(h + b[h // 2]) / 2 / (d // 2 - 1) for h in range(H)]
    wrong = [(h + b[h % 2]) / 2 / (d // 2 - 1) for h in range(H)]
    print(got, want, wrong)
    assert np.max(np.abs(np.array(got) - want)) <= tl.FLOAT64_REL
    assert np.max(np.abs(np.array(want) - wrong)) > 0.1  # the check can tell the groupings apart
    assert [g["query_heads"] for g in res["kv_heads"]] == [[0, 1], [2, 3]]
    assert [qh["kv_head"] for qh in res["query_heads"]] == [0, 0, 1, 1]
    assert len(res["kv_heads"]) == Hk and res["group"] == 2
    # W_k is reported once per KV head: its band energy is one-hot at b_g
    for g in range(Hk):
        assert np.argmax(res["kv_heads"][g]["w_k"]["band_energy_fraction"]) == b[g]
    # the suggested base is the geometric interpolation of [1e3, 1e6] at t
    for qh in res["query_heads"]:
        want_b = 10 ** (3 + 3 * qh["barycenter"])
        assert abs(qh["barycenter_base"] / want_b - 1) <= tl.FLOAT64_REL


def test_the_documents_sketch_puts_every_key_row_in_the_slow_half(one_thread):
    """The pseudocode indexes [W_q; W_k] rows 0..2d-1: a head whose energy is in the keys alone
    gets t >= d/(2d-1) > 1/2 whatever pair it uses, and its value is the literal formula."""
    d = 8
    rng = np.random.default_rng(5)
    for layout in ("half", "interleaved"):
        for ell in range(d // 2):
            wk = np.zeros((M, d))
            for c in pair_columns(ell, d, layout):
                v = rng.standard_normal(M)
                wk[:, c] = v / np.linalg.norm(v)
            t = heads.sketch_barycenter(np.zeros((M, d)), wk)
            cols = pair_columns(ell, d, layout)
            literal = sum((d + c) / (2 * d - 1) for c in cols) / (2 + 1e-8)
            print(layout, ell, t, literal)
            assert abs(t - literal) <= tl.FLOAT64_REL
            assert t >= d / (2 * d - 1) - tl.FLOAT64_REL
            assert heads.sketch_barycenter(wk, np.zeros((M, d))) <= (d - 1) / (2 * d - 1)


def test_frequency_axis_runs_from_fast_to_slow():
    spec = HeadSpec(n_heads=2, n_kv_heads=1, head_dim=16, rope=RoPESpec(base=1e4))
    fa = heads.frequency_axis(spec)
    assert fa["decreasing"] and fa["fastest_pair"] == 0 and fa["slowest_pair"] == 7
    # base^0 = 1 exactly; base^(-14/16) by torch's (vectorised) pow against Python's: each at
    # worst exp of the rounded exponent (14/16) log(base), one log term (exp_of_sum_rel)
    pow_rel = tl.exp_of_sum_rel(14 / 16 * math.log(1e4), 1)
    assert fa["omega_pair0"] == 1.0
    assert fa["omega_last"] == pytest.approx(1e4 ** (-14 / 16), rel=2 * pow_rel, abs=0)
    # from tables: the same axis read back through atan2 at position 1
    ang = torch.arange(2, dtype=torch.float64)[:, None] * rope.rope_frequencies(1e4, 16)[None]
    spec_t = HeadSpec(n_heads=2, n_kv_heads=1, head_dim=16,
                      rope=RoPESpec(base=1e4, cos=torch.cos(ang), sin=torch.sin(ang)))
    fb = heads.frequency_axis(spec_t)
    assert "tables" in fb["source"] and fb["max_abs_diff_to_analytic"] <= tl.FLOAT64_REL


def test_non_finite_diagnostics_are_failures_named_per_head(one_thread):
    d, rng = 8, np.random.default_rng(6)
    wq = rng.standard_normal((M, 2, d))
    wq[:, 1, :] = 0.0  # query head 1 has no W_q: cond and effective rank are undefined
    spec, w = _head("half", d, wq, rng.standard_normal((M, 1, d)))
    res = heads.diagnose_weights(spec, w)
    fl = heads.failures({"0": res})
    lines = [f.line() for f in fl]
    print(lines)
    assert any("layer 0 query head 1: cond(W_q) = nan" in s for s in lines)
    assert any("effective rank(W_q)" in s for s in lines)
    assert not any("query head 0" in s or "KV head" in s for s in lines)
    assert math.isfinite(res["query_heads"][1]["barycenter"])  # W_k alone still places it


def test_torch_and_numpy_weights_agree(one_thread):
    rng = np.random.default_rng(7)
    spec, w = _head("interleaved", 8, rng.standard_normal((M, 2, 8)),
                    rng.standard_normal((M, 1, 8)))
    wt = HeadWeights(w_q=torch.as_tensor(w.w_q), w_k=torch.as_tensor(w.w_k),
                     w_v=torch.as_tensor(w.w_v))
    a, b = heads.diagnose_weights(spec, w), heads.diagnose_weights(spec, wt)
    assert a["query_heads"] == b["query_heads"] and a["kv_heads"] == b["kv_heads"]


def test_bad_input_is_a_heads_error():
    spec, w = _head("half", 8, np.ones((M, 1, 8)), np.ones((M, 1, 8)))
    with pytest.raises(heads.HeadsError, match="base range"):
        heads.diagnose_weights(spec, w, base_range=(1e6, 1e3))
    for text, what in (("x", "comma-separated"), ("3", "out of range"), ("", "no layers"),
                       ("-1", "out of range")):
        with pytest.raises(heads.HeadsError, match=what):
            heads.parse_layers(text, 3)
    assert heads.parse_layers("all", 3) == [0, 1, 2] and heads.parse_layers("last", 3) == [2]
    assert heads.parse_layers("2,0,2", 3) == [0, 2]


# ---------------------------------------------------------------------------------------------
# the corners the whole-run tests do not reach: the trained variants' diagnostics called
# directly, the torchrun share of the layers, the grids the figures draw, the figures'
# directory and warnings, the raw manifest's encoding (expected values written out by hand;
# the numbers themselves meet the reference in tests/test_reference_heads.py)
# ---------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "validation" / "heads-smollm2" / "report.json"


def gpt(n_layers: int = 2, variant: str = "standard"):
    from ropestep.families import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                          d_model=64, head_dim=16, seq_len=16, variant=variant,
                          layout="interleaved")).eval()
    if variant == "perhead":
        for blk in model.blocks:
            blk.attn.set_bases([2e3, 3e4, 4e5, 9e5])
    return model


@pytest.mark.parametrize("variant", ["standard", "cosine", "perhead"])
def test_diagnose_gpt_describes_the_model_by_hand(variant):
    """Every layer by default; the model block written out; the frequency axis is layer 0's."""
    out = heads.diagnose_gpt(gpt(2, variant))
    assert out["model"] == {
        "name": f"ropestep.families GPT ({variant})", "model_type": "families",
        "family": "cosine" if variant == "cosine" else "dot", "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "group": 2, "head_dim": 16, "hidden": 64, "rope_theta": None,
        "qkv_bias": False, "variant": variant}
    assert list(out["layers"]) == ["0", "1"]
    assert out["frequency_axis"] == out["layers"]["0"]["frequency_axis"]
    assert out["raw_layers"] == {} and out["rank_layers"] == {"0": [0, 1]}
    assert out["summary"] == heads.summarise(list(out["layers"].values()))


def test_diagnose_gpt_of_a_one_layer_model():
    out = heads.diagnose_gpt(gpt(1))
    assert out["model"]["n_layers"] == 1 and list(out["layers"]) == ["0"]


def test_the_diagnostics_see_float64_heads(monkeypatch):
    """Both entry points describe each layer's heads in float64 (the diagnostics' singular
    values and spectra are computed from the float64 projections, as the reference's)."""
    seen = []
    inner = heads.diagnose_weights

    def rec(spec, w, **kw):
        seen.append((w.w_q.dtype, w.w_k.dtype))
        return inner(spec, w, **kw)

    monkeypatch.setattr(heads, "diagnose_weights", rec)
    heads.diagnose_gpt(gpt(2))
    assert seen == [(torch.float64, torch.float64)] * 2


@pytest.mark.parametrize("entry", ["diagnose", "diagnose_gpt"])
def test_under_torchrun_a_rank_other_than_0_returns_none(entry, monkeypatch, tmp_path):
    """``dist_info=(rank, world)`` shares the layers out; only rank 0 gathers a report.  With
    the gather replaced by a one-process stand-in, rank 1 of 2 computes its share (the second
    half of the layers) and returns None."""
    from ropestep import dist

    shares, parts = [], {}

    def gather(mine, rank, world):  # rank 0 receives rank 1's share from its earlier call
        shares.append((rank, world, sorted(mine)))
        parts[rank] = mine
        return [parts[r] for r in range(world)] if rank == 0 else None

    monkeypatch.setattr(dist, "gather_to_rank0", gather)
    if entry == "diagnose":
        from test_reference_heads import build_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "m"),
                                                     attn_implementation="eager")
        fn = heads.diagnose
    else:
        model, fn = gpt(2), heads.diagnose_gpt
    assert fn(model, "all", dist_info=(1, 2)) is None
    assert shares == [(1, 2, ["1"])]
    got = fn(model, "all", dist_info=(0, 2))
    assert shares[1:] == [(0, 2, ["0"])] and list(got["layers"]) == ["0", "1"]
    assert got["rank_layers"] == {"0": [0], "1": [1]}
    assert got["layers"] == fn(model, "all")["layers"]


def test_grids_are_float_arrays_in_layer_order():
    r = load(COMMITTED)
    small = {"layers": {k: r["layers"][k] for k in ("3", "0", "1")}}
    for what in ("cond_q", "cond_k", "erank_q", "erank_k", "barycenter"):
        layers, vals = heads.grid(small, what)
        assert layers == [0, 1, 3] and vals.dtype == np.float64
    # integer-valued statistics (as JSON may give them back) still give floats
    lr = copy.deepcopy(small)
    for L in lr["layers"].values():
        for h in L["query_heads"]:
            h["barycenter"] = 1
    assert heads.grid(lr, "barycenter")[1].dtype == np.float64
    with pytest.raises(KeyError):
        heads.grid(small, "base")


def test_figures_into_a_new_nested_directory_without_warnings(tmp_path):
    """A zero and a negative condition number (log10 of them: -inf and NaN) are drawn without
    a floating-point warning, and the figures' directory is made with its parents."""
    pytest.importorskip("matplotlib")
    r = load(COMMITTED)
    small = {"layers": {k: copy.deepcopy(r["layers"][k]) for k in ("0", "1")}}
    small["layers"]["0"]["query_heads"][0]["w_q"]["cond"] = 0.0
    small["layers"]["1"]["query_heads"][1]["w_q"]["cond"] = -1.0
    out = tmp_path / "a" / "b" / "figures"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heads.render_figures(small, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"heatmap_{n}.png" for n, _t, _l in heads.HEATMAPS] + ["band_energy.png"])


def test_the_raw_manifest_is_utf8_under_an_ascii_locale(tmp_path, ascii_locale):
    result = {"command": ["ropestep", "heads", "--model", "modèle-ß"],
              "config": {"model": "modèle-ß", "base_min": 500.0, "base_max": 2e6},
              "model": {"name": "modèle-ß"}}
    heads.write_raw_manifest(tmp_path, result, {"0": {"n_heads": 4}})
    got = json.loads((tmp_path / heads.RAW_MANIFEST).read_bytes().decode("utf-8"))
    assert got["model"] == {"name": "modèle-ß"} and got["base_range"] == [500.0, 2e6]
    assert got["layers"] == {"0": {"n_heads": 4}} and got["schema"] == heads.RAW_SCHEMA


def test_fmt_stats_uses_the_format_for_every_number():
    s = {"median": 1.234567, "min": 0.000123456, "max": 98765.4321}
    assert heads._fmt_stats(s, ".5g") == "1.2346 [0.00012346, 98765]"
    assert heads._fmt_stats(s) == "1.23 [0.000123, 9.88e+04]"


def _model_line(md: str) -> str:
    return next(ln for ln in md.splitlines() if ln.startswith("Model: "))


def test_markdown_names_the_models_file_and_hash_gguf_or_not():
    """The model line names the GGUF file and its sha256, or, for a checkpoint, its source and
    its weights' sha256; a failed verdict says FAIL with the non-finite diagnostics."""
    r = load(COMMITTED)
    line = _model_line(heads.render_markdown(r))
    assert line.endswith("; file `SmolLM2-135M-Instruct.Q4_1.gguf` sha256 "
                         "`b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53`.")
    ck = copy.deepcopy(r)
    ck["model"].update(gguf_file=None, gguf_sha256=None, source="my-checkpoint",
                       weights_sha256={"model.safetensors": "abc123"})
    line = _model_line(heads.render_markdown(ck))
    assert line.endswith("; file `my-checkpoint` sha256 `{'model.safetensors': 'abc123'}`.")
    assert "**Verdict: PASS** (every diagnostic finite)" in heads.render_markdown(r)
    bad = copy.deepcopy(r)
    bad["verdict"] = {"passed": False, "failed": [{"where": "layer 3 head 1", "check": "cond"}]}
    assert ("**Verdict: FAIL** (every diagnostic finite); 1 non-finite: layer 3 head 1: cond"
            in heads.render_markdown(bad))
    bad["verdict"]["failed"] = [{"where": f"layer {i} head 0", "check": "cond"}
                                for i in range(11)]
    assert ("**Verdict: FAIL** (every diagnostic finite); 11 non-finite: "
            + "; ".join(f"layer {i} head 0: cond" for i in range(10))) \
        in heads.render_markdown(bad).splitlines()


def test_markdown_prints_the_frequency_axis_to_six_digits():
    r = load(COMMITTED)
    r["frequency_axis"]["omega_pair0"] = 1.23456789e-5
    md = " ".join(heads.render_markdown(r).split())
    assert "omega_0 = 1.23457e-05 rad/position" in md


def test_write_report_draws_the_figures_unless_told_not_to(tmp_path):
    pytest.importorskip("matplotlib")
    r = load(COMMITTED)
    small = copy.deepcopy(r)
    small["layers"] = {k: r["layers"][k] for k in ("0", "1")}
    heads.write_report(small, tmp_path / "with")
    assert (tmp_path / "with" / "figures" / "band_energy.png").is_file()
    heads.write_report(small, tmp_path / "without", figures=False)
    assert (tmp_path / "without" / "report.json").is_file()
    assert not (tmp_path / "without" / "figures").exists()


def test_the_module_command_line_is_ropestep_heads(capsys):
    """``python -m ropestep.heads``: its usage names ``ropestep heads`` and its help starts
    with the module's first line."""
    assert heads.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ropestep heads ")
    assert " ".join(heads.__doc__.split("\n")[0].split()) in " ".join(out.split())
    assert heads.main(["--layers"]) == 2
    assert "ropestep heads: error:" in capsys.readouterr().err


def test_markdown_prints_the_base_range_in_g_format():
    r = load(COMMITTED)
    r["config"].update(base_min=1e7, base_max=12345.678)
    assert "| suggested base b(t) in [1e+07, 12345.7]" in heads.render_markdown(r)


def test_matrix_failures_name_each_quantity_once_with_its_first_bad_value():
    nan, inf = math.nan, math.inf
    diag = {"cond": inf, "sigma_max": 2.0, "band_energy_fraction": [0.5, nan, inf],
            "coarse_band_fraction": [nan], "new_statistic": {"a": [1.0, (2.0, -inf)]}}
    got = heads._matrix_failures("layer 2 KV head 1", diag, "k")
    assert [(f.where, f.check) for f in got] == [
        ("layer 2 KV head 1", "cond(W_k)"), ("layer 2 KV head 1", "band energy(W_k)"),
        ("layer 2 KV head 1", "new_statistic")]
    assert got[0].value == inf and math.isnan(got[1].value) and got[2].value == -inf
    assert heads._matrix_failures("x", {"cond": 3.0, "frobenius": [1.0, 2.0]}, "q") == []


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """The seeded tiny Qwen2 of tests/test_reference_heads.py, saved to a directory ``tiny-qwen2``
    and loaded back (eager attention, float32)."""
    from test_reference_heads import build_model
    from transformers import AutoModelForCausalLM

    path = build_model(tmp_path_factory.mktemp("hf") / "tiny-qwen2")
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def test_diagnose_describes_a_hub_model_by_hand(hf_tiny, monkeypatch):
    """Every layer by default, each described in float64; the model block written out (its
    name is the checkpoint directory's, never a path of this machine)."""
    seen = []
    inner = heads.diagnose_weights

    def rec(spec, w, **kw):
        seen.append(w.w_q.dtype)
        return inner(spec, w, **kw)

    monkeypatch.setattr(heads, "diagnose_weights", rec)
    out = heads.diagnose(hf_tiny)
    assert list(out["layers"]) == ["0", "1"] and seen == [torch.float64] * 2
    assert out["model"] == {"name": "tiny-qwen2", "model_type": "qwen2", "family": "dot",
                            "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "group": 2,
                            "head_dim": 16, "hidden": 64, "rope_theta": 1e4, "qkv_bias": True}
    assert out["frequency_axis"] == out["layers"]["0"]["frequency_axis"]


def test_markdown_prints_time_and_memory_in_fixed_point():
    r = load(COMMITTED)
    r["peak_rss_mib"] = 1536.55
    r["timing_seconds"].update(load_model=123.45, diagnose=0.75)
    md = " ".join(heads.render_markdown(r).split())
    assert "Time: load 123.5 s, diagnostics 0.8 s; peak resident memory 1537 MiB." in md


# ---------------------------------------------------------------------------------------------
# the helpers' contracts at their edges (each expected value written out by hand): float64
# whatever the input's type, one-element and empty inputs, the strict inequalities of the
# summaries and the base range, the frequency axis read from tables of one pair or one position
# ---------------------------------------------------------------------------------------------
F32_TIE = np.array([1.0, 2.0 ** -30], dtype=np.float32)  # 1 + 2^-30 and (1 + 2^-30) / 2: exact
                                                          # in float64, rounded away in float32


def test_f64_gives_float64_numpy_from_any_input():
    t = torch.tensor([[1.5, -2.0]], dtype=torch.float32, requires_grad=True)
    a = heads._f64(t)  # a tensor that requires grad has no .numpy() of its own
    assert isinstance(a, np.ndarray) and a.dtype == np.float64 and a.tolist() == [[1.5, -2.0]]
    for x in ([1, 2], np.array([1, 2], dtype=np.int32), F32_TIE):
        assert heads._f64(x).dtype == np.float64
    assert heads._f64(F32_TIE).tolist() == [1.0, 2.0 ** -30]


def test_stats_of_empty_one_and_float32_inputs():
    e = heads._stats([])
    assert list(e) == ["median", "min", "max", "n"] and e["n"] == 0
    assert all(math.isnan(e[k]) for k in ("median", "min", "max"))
    assert heads._stats([3.0]) == {"median": 3.0, "min": 3.0, "max": 3.0, "n": 1}
    assert heads._stats(F32_TIE)["median"] == 0.5 + 2.0 ** -31  # taken in float64


def test_condition_number_and_effective_rank_at_their_edges():
    assert heads.condition_number([2.0]) == 1.0 and heads.effective_rank([2.0]) == 1.0
    for bad in ([], [math.inf, 1.0], [math.nan, 1.0]):
        assert math.isnan(heads.condition_number(bad)) and math.isnan(heads.effective_rank(bad))
    assert heads.condition_number([3.0, 0.0]) == math.inf
    # a zero singular value adds nothing to the entropy (0 log 0 = 0): rank one
    assert heads.effective_rank([1.0, 0.0]) == 1.0
    # two equal singular values summing below 1: exp(log 2) = 2 (not undefined)
    assert heads.effective_rank([0.25, 0.25]) == pytest.approx(2.0, rel=4 * tl.FLOAT64_REL)
    sv = np.array([1.0, 0.7, 0.3, 0.1], dtype=np.float32)
    assert heads.effective_rank(sv) == heads.effective_rank(sv.astype(np.float64))


def test_bands_in_float64_and_a_zero_matrix_without_warnings():
    assert heads.coarse_bands(F32_TIE, 1) == [1.0 + 2.0 ** -30]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 0/0 would warn: the zero matrix is caught before
        fr = heads.band_fractions(np.zeros((4, 8)), "half")
    assert len(fr) == 4 and all(math.isnan(x) for x in fr)


def test_matrix_diagnostics_names_a_wrong_shape():
    with pytest.raises(ValueError, match=r"one head's \(m, d\) projection, got shape \(2, 3, 4\)"):
        heads.matrix_diagnostics(np.ones((2, 3, 4)), "half")


def test_the_base_range_is_open_at_zero_and_closed_at_its_ends():
    rng = np.random.default_rng(11)
    spec, w = _head("half", 8, rng.standard_normal((M, 1, 8)), rng.standard_normal((M, 1, 8)))
    for ok in ((0.5, 10.0), (5e3, 5e3)):
        assert heads.diagnose_weights(spec, w, base_range=ok)["base_range"] == list(ok)
    for bad in ((0.0, 10.0), (-1.0, 10.0), (10.0, math.inf)):
        with pytest.raises(heads.HeadsError, match="base range"):
            heads.diagnose_weights(spec, w, base_range=bad)


def test_a_head_without_weights_has_a_nan_barycenter_not_none():
    spec, w = _head("half", 8, np.zeros((M, 1, 8)), np.zeros((M, 1, 8)))
    h = heads.diagnose_weights(spec, w)["query_heads"][0]
    for k in ("barycenter", "barycenter_base"):
        assert isinstance(h[k], float) and math.isnan(h[k])


def _tables(omega: list[float], n_pos: int) -> RoPESpec:
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * torch.tensor(omega, dtype=torch.float64)[None]
    return RoPESpec(base=1e4, cos=torch.cos(ang), sin=torch.sin(ang))


@pytest.mark.parametrize("omega, decreasing, fastest, slowest", [
    ([0.1, 0.5, 0.3], False, 1, 0),   # rising by less than 1 is not decreasing
    ([0.5, 0.5, 0.3], False, 0, 2),   # a tie is not decreasing
    ([0.9, 0.5, 0.3], True, 0, 2),
    ([0.3], True, 0, 0),              # one pair: the tables' second axis has length 1
])
def test_frequency_axis_read_from_the_tables(omega, decreasing, fastest, slowest):
    d = 2 * len(omega)
    fa = heads.frequency_axis(HeadSpec(n_heads=1, n_kv_heads=1, head_dim=d,
                                       rope=_tables(omega, 2)))
    assert "tables" in fa["source"]
    # sin and cos each rounded once, then atan2's own rounding: a few units of the last place
    assert fa["omega"] == pytest.approx(omega, rel=4 * tl.FLOAT64_REL, abs=0)
    assert (fa["decreasing"], fa["fastest_pair"], fa["slowest_pair"]) == \
        (decreasing, fastest, slowest)


def test_frequency_axis_of_a_one_position_table_is_the_analytic_one():
    spec = HeadSpec(n_heads=1, n_kv_heads=1, head_dim=6, rope=_tables([0.9, 0.5, 0.3], 1))
    fa = heads.frequency_axis(spec)
    assert fa["source"] == "analytic base^(-2l/d)" and fa["omega_pair0"] == 1.0


def _summary_entry(cond: float, t: float) -> tuple[dict, dict]:
    diag = {"cond": cond, "effective_rank": 1.0, "coarse_band_fraction": [0.25] * 4}
    return ({"w_q": diag, "barycenter": t, "barycenter_base": 1e4, "sketch_barycenter": t},
            {"w_k": diag})


def test_summarise_counts_strictly_below_its_marks_and_no_heads_without_warnings():
    q0, k0 = _summary_entry(heads.COND_SMALL, 0.5)  # exactly at both marks: not below
    q1, k1 = _summary_entry(2.0, 0.25)
    s = heads.summarise([{"query_heads": [q0, q1], "kv_heads": [k0, k1]}])
    assert (s["fraction_cond_w_q_below_10"], s["fraction_cond_w_k_below_10"],
            s["fraction_barycenter_below_half"]) == (0.5, 0.5, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mean of no heads would warn
        e = heads.summarise([{"query_heads": [], "kv_heads": []}])
    assert e["coarse_band_fraction_w_q_mean"] == [] and e["coarse_band_fraction_w_k_mean"] == []
    assert all(math.isnan(e[k]) for k in ("fraction_cond_w_q_below_10",
                                          "fraction_cond_w_k_below_10",
                                          "fraction_barycenter_below_half"))


def test_the_band_energy_figure_colours_two_layers_from_first_to_last(monkeypatch, tmp_path):
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.use("Agg")
    seen = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: seen.__setitem__(
        Path(path).name, [[ln.get_color() for ln in ax.lines] for ax in fig.axes]))
    heads.render_figures(heads.diagnose_gpt(gpt(2)), tmp_path)
    cmap = matplotlib.colormaps["viridis"]
    first, last = matplotlib.colors.to_hex(cmap(0.0)), matplotlib.colors.to_hex(cmap(1.0))
    for panel in seen["band_energy.png"][:2]:
        assert [matplotlib.colors.to_hex(c) for c in panel] == [first, last]


def test_markdown_names_the_gguf_file_before_the_source():
    r = copy.deepcopy(load(COMMITTED))
    r["model"].update(source="some-other-source")
    assert "; file `SmolLM2-135M-Instruct.Q4_1.gguf` sha256 " in _model_line(heads.render_markdown(r))
