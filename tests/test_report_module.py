"""ropestep.report's own pieces, each against values written out by hand: number formatting
(``fmt``, ``fmt6``), Markdown tables, index ranges, the verdict block, the JSON encoding of
non-finite numbers, and the atomic directory writers.  The whole renderers are checked against
the committed reports (tests/test_committed_reports_render.py, tests/test_committed_figures.py)
and their numbers against the reference (tests/test_reference_validate.py).
"""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from ropestep import report

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("x, digits, want", [
    (None, 3, "—"), (True, 3, "yes"), (np.bool_(False), 3, "no"), (7, 3, "7"),
    (np.int64(-12), 3, "-12"), (0.0, 3, "0"), (-0.0, 3, "0"), (math.nan, 3, "nan"),
    (math.inf, 3, "inf"), (-math.inf, 3, "-inf"),
    (0.5, 3, "0.5"), (0.123456, 3, "0.1235"), (0.001, 3, "0.001"), (0.00099, 3, "9.90e-04"),
    (1.0, 3, "1"), (12.3456, 3, "12.3"), (9999.0, 3, "1e+04"), (10000.0, 3, "1.00e+04"),
    (-2.5e-7, 3, "-2.50e-07"), (123456.0, 2, "1.2e+05"), (0.123456, 5, "0.123456"),
    (3.14159, 5, "3.1416"),
])
def test_fmt_by_hand(x, digits, want):
    assert report.fmt(x, digits) == want


@pytest.mark.parametrize("x, want", [
    (None, "—"), (math.nan, "nan"), (-math.inf, "-inf"), (0.0123456, "0.012346"),
    (1.5, "1.500000"), (1e-4, "0.000100"), (9.99e-5, "9.990e-05"), (-3e-6, "-3.000e-06"),
])
def test_fmt6_by_hand(x, want):
    assert report.fmt6(x) == want


def test_table_aligns_the_first_column_left_and_the_rest_right():
    assert report._table(["a", "b", "c"], [["1", "2", "3"], ["x", "y", "z"]]) == [
        "| a | b | c |", "| --- | ---: | ---: |", "| 1 | 2 | 3 |", "| x | y | z |"]
    assert report._table(["a", "b"], [], align="rl") == ["| a | b |", "| ---: | --- |"]


@pytest.mark.parametrize("xs, want", [([], "none"), ([4], "4"), ([0, 1], "0, 1"),
                                      ([0, 1, 2], "0–2"), ([3, 4, 5, 6], "3–6"),
                                      ([0, 2, 3], "0, 2, 3")])
def test_ranges_by_hand(xs, want):
    assert report._ranges(xs) == want


def test_native_tolerance_text():
    assert report._native_tol({"normwise": 2.5e-6}) == "2.5e-06 max|native| (normwise)"
    assert report._native_tol({"atol": 1e-5, "rtol": 3e-4}) == "atol/rtol 1e-05/0.0003"


def test_verdict_block_lists_at_most_fifty_failures():
    assert report._verdict_md(None) == []
    ok = report._verdict_md({"pass": True, "failures": [], "failed_checks": 0})
    assert ok[0] == "## Verdict: PASS" and ok[-1] == ""
    f = {"where": "layer 3 head 1", "check": "native", "value": 2.0, "tol": 1.0}
    bad = report._verdict_md({"pass": False, "failed_checks": 53, "failures": [f] * 53})
    assert bad[0] == "## Verdict: FAIL"
    assert bad[2] == "**53 failed check(s)** (`ropestep validate` exits with status 1):"
    items = [ln for ln in bad if ln.startswith("- `")]
    assert len(items) == report.VERDICT_LINES == 50
    assert items[0] == "- `FAIL layer 3 head 1: native = 2 (tolerance 1)`"
    assert bad[-2] == "- … and 3 more (`report.json`, `verdict.failures`)" and bad[-1] == ""
    exact = report._verdict_md({"pass": False, "failed_checks": 50, "failures": [f] * 50})
    assert not any(ln.startswith("- …") for ln in exact)


def test_json_keeps_non_finite_numbers_and_full_precision(tmp_path):
    r = {"a": math.nan, "b": [math.inf, -math.inf, 0.1 + 0.2], "c": np.float64(1 / 3),
         "d": np.array([1.0, math.nan]), "e": "x", "f": None, "g": np.int64(5)}
    text = report.dumps(r)
    assert text.endswith("\n") and text.startswith("{\n \"a\"")
    raw = json.loads(text)
    assert raw["a"] == "nan" and raw["b"][:2] == ["inf", "-inf"] and raw["d"][1] == "nan"
    assert raw["b"][2] == 0.1 + 0.2 and raw["c"] == 1 / 3 and raw["g"] == 5 and raw["f"] is None
    p = tmp_path / "report.json"
    p.write_text(text, encoding="utf-8")
    back = report.load(p)
    assert math.isnan(back["a"]) and back["b"][:2] == [math.inf, -math.inf]
    assert back["b"][2] == 0.1 + 0.2 and back["c"] == 1 / 3 and math.isnan(back["d"][1])
    assert json.loads(report.dumps({"é": 1}))["é"] == 1 and "é" in report.dumps({"é": 1})


def test_write_report_dir_is_atomic(tmp_path):
    out = tmp_path / "sub" / "rep"
    assert report.write_report_dir(out, lambda d: (d / "a.txt").write_text("1")) == out
    assert (out / "a.txt").read_text() == "1"
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())

    def boom(d):
        (d / "a.txt").write_text("2")
        raise RuntimeError("half-written")

    with pytest.raises(RuntimeError):
        report.write_report_dir(out, boom)
    assert (out / "a.txt").read_text() == "1"  # the old report stands
    assert sorted(p.name for p in out.parent.iterdir()) == ["rep"]  # no temporary left
    report.write_report_dir(out, lambda d: (d / "b.txt").write_text("3"))
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]  # replaced, not merged
    assert sorted(p.name for p in out.parent.iterdir()) == ["rep"]
    new_parent = tmp_path / "fresh" / "rep"
    with pytest.raises(RuntimeError):
        report.write_report_dir(new_parent, boom)
    assert not (tmp_path / "fresh").exists()  # the parent this call made is removed again
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(FileExistsError) as err:
        report.write_report_dir(f, lambda d: None)
    assert str(err.value) == f"--out {str(f)!r} exists and is not a directory"


def test_write_report_dir_works_beside_out(tmp_path, monkeypatch):
    """The new report is filled in a hidden sibling (same file system: the renames are atomic)
    and the old one is moved to a hidden sibling before it is removed; missing parents are
    made, several levels deep."""
    out = tmp_path / "a" / "b" / "rep"
    seen = []
    report.write_report_dir(out, lambda d: seen.append(d))
    assert seen[0].parent == out.parent and seen[0].name.startswith(".rep.tmp-")
    renames = []
    real = os.rename
    monkeypatch.setattr(report.os, "rename", lambda a, b: (renames.append((Path(a), Path(b))),
                                                           real(a, b))[1])
    report.write_report_dir(out, lambda d: seen.append(d))
    (old_from, old_to), (new_from, new_to) = renames
    assert old_from == out and old_to.parent == out.parent and old_to.name.startswith(".rep.old-")
    assert new_from == seen[1] and new_to == out and not old_to.exists()
    rel = Path("rel-rep")
    monkeypatch.chdir(tmp_path)
    report.write_report_dir(rel, lambda d: (d / "x").write_text("1"))
    assert (tmp_path / "rel-rep" / "x").read_text() == "1"


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_write_rendered_and_fill_rendered(tmp_path):
    drawn = []

    def figs(result, d):
        assert result is res  # the figures are drawn from the result written
        drawn.append(d.name)
        d.mkdir()
        (d / "f.png").write_text("png")

    res = {"layers": {"1": {}}, "x": math.nan}
    out = report.write_rendered(tmp_path / "r", res, lambda r: f"# {len(r)}\n", figs)
    assert (out / "report.md").read_text() == "# 2\n"
    assert math.isnan(report.load(out / "report.json")["x"])
    assert drawn == ["figures"] and (out / "figures" / "f.png").is_file()
    report.write_rendered(tmp_path / "r2", res, lambda r: "m\n", figs, figures=False)
    report.write_rendered(tmp_path / "r3", {"layers": {}}, lambda r: "m\n", figs)
    assert drawn == ["figures"]  # not asked, or nothing to draw
    assert sorted(p.name for p in (tmp_path / "r2").iterdir()) == ["report.json", "report.md"]
    d = tmp_path / "own"
    d.mkdir()
    report.fill_rendered(d, {"a": 1}, lambda r: "md\n")
    assert (d / "report.md").read_text() == "md\n"
    assert json.loads((d / "report.json").read_text()) == {"a": 1}


def test_write_report_renders_the_committed_smollm2_run(tmp_path):
    """write_report: report.json round-trips, report.md is render_markdown with the figure
    links, figures/ holds the three figures per layer -- and without figures, no links."""
    r = report.load(ROOT / "validation" / "smollm2" / "report.json")
    out = report.write_report(r, tmp_path / "v")
    assert (out / "report.json").read_text() == report.dumps(r)
    names = sorted(p.name for p in (out / "figures").iterdir())
    want = sorted(f"{f}_L{L}.png" for L in r["layers"] for f in report.FIGURES)
    assert names == want
    md = (out / "report.md").read_text()
    assert md == (ROOT / "validation" / "smollm2" / "report.md").read_text()
    plain = report.write_report(r, tmp_path / "nofig", figures=False)
    assert not (plain / "figures").exists() and "### Figures" not in (
        plain / "report.md").read_text()


def test_non_finite_statistics_print_as_nan_in_the_markdown():
    r = copy.deepcopy(report.load(ROOT / "validation" / "smollm2" / "report.json"))
    layer = next(iter(r["layers"]))
    rec = r["layers"][layer]["reconstruction"]
    rec["combined"]["prefix"]["max_abs"] = math.nan
    md = report.render_markdown(r)
    assert "nan" in md and md != report.render_markdown(
        report.load(ROOT / "validation" / "smollm2" / "report.json"))


# ---------------------------------------------------------------------------------------------
# render_markdown's branches the committed runs do not reach
# ---------------------------------------------------------------------------------------------
def _smollm2() -> dict:
    return report.load(ROOT / "validation" / "smollm2" / "report.json")


def test_run_section_branches():
    from ropestep.protocol import PAPER

    r = _smollm2()
    base = report.render_markdown(r)
    assert "## Run" in base and f"sha256 `{r['corpus']['sha256']}`" in base
    assert f"sha256 `{r['model']['gguf_sha256']}`" in base and "revision `" not in base
    assert "This is the paper's setup" not in base
    v = copy.deepcopy(r)
    v["command"] = None
    v["corpus"]["revision"] = "abc123"
    v["corpus"].pop("sha256")
    v["model"].pop("gguf_sha256")
    v["protocol"]["layers"] = [3, 29]
    v["layers"] = {"3": r["layers"]["29"], "29": r["layers"]["29"]}
    md = report.render_markdown(v)
    assert "- Command: `(API call)`" in md
    assert "revision `abc123`)" in md and ", sha256 `" not in md.split("- Corpus:")[1].split("\n")[0]
    assert "(GGUF `" not in md
    assert md.splitlines()[0].endswith("layer(s) 3, 29")
    p = copy.deepcopy(r)
    p["paper"] = PAPER
    mdp = report.render_markdown(p)
    assert "This is the paper's setup: its numbers (docs/protocol.md) stand beside ours." in mdp
    assert mdp != base


# ---------------------------------------------------------------------------------------------
# the figure functions on small synthetic layers
# ---------------------------------------------------------------------------------------------
def test_pos_and_num():
    assert report._pos(0.0) == 1e-40 and report._pos(-3.0) == 1e-40 and report._pos(2.5) == 2.5
    assert math.isnan(report._pos(math.nan)) and report._pos(math.inf) == math.inf
    assert math.isnan(report._num(None)) and report._num("inf") == math.inf
    assert report._num(3) == 3.0


@pytest.fixture()
def plt():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def _rec(heads):
    row = lambda h, v: {"head": h, "prefix": {"max_abs": v}, "full": {"max_abs": 2 * v},
                        "native": {"max_abs": 0.0}}
    return {"reconstruction": {"per_head": [row(h, 1e-15 * (h + 1)) for h in heads],
                               "combined": row("x", 1e-14)}}


def test_reconstruction_figure_small(plt):
    fig = report._fig_reconstruction(plt, 7, _rec([0, 1]))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "all"]
    assert list(fig.get_size_inches()) == [6.0, 4.0]  # max(6, 0.6 * 3 + 3)
    bars = [p.get_height() for p in ax.patches]
    assert bars[:3] == [1e-15, 2e-15, 1e-14] and bars[-3:] == [1e-40] * 3  # 0 drawn at 1e-40
    assert ax.get_legend().get_texts()[0].get_fontsize() == 8
    assert ax.get_title() == "Layer 7: reconstruction error per head"


def _points(n_heads):
    heads, rel, sc, tv, inp = [], [], [], [], []
    for h in range(n_heads):
        heads += [h] * 4
        rel += [0.0, 0.5, math.nan, 0.25]
        sc += [1.0, 0.0, 2.0, 3.0]
        tv += [0.1, 0.2, 0.3, 0.4]
        inp += [1.0, 2.0, 3.0, 4.0]
    return {"calibration": {"points": {"head": heads, "rel": rel, "score_sup": sc, "tv": tv,
                                       "input": inp}}}


def test_reuse_figure_filters_and_legend(plt):
    fig = report._fig_reuse(plt, 2, _points(3))
    ax0, ax1, ax2 = fig.axes
    # rel = 0, NaN and score distance 0 are not drawn on log axes: one point of four per head
    assert [len(c.get_offsets()) for c in ax0.collections] == [1, 1, 1]
    assert [len(c.get_offsets()) for c in ax1.collections] == [2, 2, 2]
    assert ax0.get_shared_y_axes().joined(ax0, ax2)
    leg = ax2.get_legend()
    assert [t.get_text() for t in leg.get_texts()] == ["h0", "h1", "h2"]
    assert leg.get_texts()[0].get_fontsize() == 6 and leg._ncols == 2 and leg.markerscale == 2
    cols = [tuple(c.get_facecolors()[0]) for c in ax0.collections]
    assert cols == [tuple(plt.get_cmap("tab20")(k)[:3]) + (0.6,) for k in range(3)]
    assert [tuple(c.get_sizes()) for c in ax0.collections] == [(6.0,)] * 3
    many = report._fig_reuse(plt, 2, _points(21))
    assert many.axes[2].get_legend() is None  # more than 20 heads: no legend
    # colours cycle through tab20: the 21st head takes the first colour again
    assert tuple(many.axes[0].collections[20].get_facecolors()[0][:3]) == tuple(
        plt.get_cmap("tab20")(0)[:3])
    twenty = report._fig_reuse(plt, 2, _points(20))
    assert twenty.axes[2].get_legend() is not None
    assert tuple(twenty.axes[0].collections[19].get_facecolors()[0][:3]) == tuple(
        plt.get_cmap("tab20")(19)[:3])


def test_lambda_figure_in_query_space_and_small(plt):
    pts = {"head": [0, 0, 1, 1], "lam_max": [0.5, 3.0, 0.0, math.nan]}
    fig = report._fig_lam(plt, 4, {"descent": {"points": pts}})
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("λ_max(H_i), input space")
    assert list(fig.get_size_inches()) == [6.0, 4.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]
    meds = [ln for ln in ax.get_lines() if ln.get_color() != "crimson"]
    ydata = sorted(float(v) for ln in meds for v in ln.get_ydata())
    assert min(ydata) == 1e-12  # lambda = 0 clipped to 1e-12 on the log axis
    assert ax.get_legend().get_texts()[0].get_fontsize() == 8
    fliers = [ln for ln in ax.get_lines() if ln.get_marker() not in ("None", None, "")]
    assert fliers  # showfliers=True draws the flier markers
    q = report._fig_lam(plt, 4, {"descent": {"not_defined": "x", "points": {"head": [], "lam_max": []},
                                             "query_space": {"points": pts}}})
    assert q.axes[0].get_ylabel().startswith("λ_max(H_i), query space")


def test_render_figures_writes_pngs_at_110_dpi(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    r = _smollm2()
    figs = report.render_figures(r, tmp_path / "a" / "figures")
    layer = next(iter(r["layers"]))
    assert figs == {layer: [f"figures/{f}_L{layer}.png" for f in report.FIGURES]}
    with Image.open(tmp_path / "a" / "figures" / f"lam_max_L{layer}.png") as im:
        assert im.info.get("dpi") and round(im.info["dpi"][0]) == 110


# ---------------------------------------------------------------------------------------------
# branches of _layer_md, render_markdown's run section, _pos, the figures and the writers that
# the committed runs leave alone (each expected line written out by hand from the input)
# ---------------------------------------------------------------------------------------------
def _one_layer() -> tuple[dict, int, dict]:
    r = _smollm2()
    layer = next(iter(r["layers"]))
    return r, int(layer), r["layers"][layer]


def test_fast_table_error_row_empty_heads_and_missing_kappa():
    """An entry that failed prints its error (first 60 characters) and empty cells, and the
    entries after it still print; no heads gives '—' for the worst head, no kappa an empty
    cell."""
    r, layer, lr = _one_layer()
    msg = "abcdefghijklmnopqrstuvwxyz" * 2 + "ABCDEFGHIJKLMNOPQR"  # 70 characters
    normal = {"combined": {"vs_float64": {"mse": 1e-10, "max_abs": 0.5},
                           "vs_native": {"mse": 2.0, "max_abs": 12.3456}},
              "heads": [{"vs_float64": {"max_abs": 0.25}}, {"vs_float64": {"max_abs": 0.125}}],
              "kappa": {"median": 5.0, "max": 270.0}}
    lr["fast"] = {"float32/original": {"error": msg},
                  "float32/maxkey": normal,
                  "bfloat16/original": dict(normal, heads=[]),
                  "bfloat16/maxkey": {k: v for k, v in normal.items() if k != "kappa"}}
    L = report._layer_md(layer, lr, r, None, [])
    i = L.index("| dtype/gauge | vs float64 MSE | vs float64 max | vs native MSE | vs native max "
                "| worst head vs float64 max | kappa median / max |")
    assert L[i + 1:i + 7] == [
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| float32/original | error: abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzABCDEFGH"
        " |  |  |  |  |  |",
        "| float32/maxkey | 1.00e-10 | 0.5 | 2 | 12.3 | 0.25 | 5 / 270 |",
        "| bfloat16/original | 1.00e-10 | 0.5 | 2 | 12.3 | — | 5 / 270 |",
        "| bfloat16/maxkey | 1.00e-10 | 0.5 | 2 | 12.3 | 0.25 |  |",
        ""]


def test_heads_below_constant_line_without_range_and_with_nonfinite_heads():
    r, layer, lr = _one_layer()
    lr["reuse"]["heads_below_constant"] = {"rule": "rule R", "count": 2, "of": 9,
                                           "range": None, "nonfinite": [4, 7]}
    L = report._layer_md(layer, lr, r, None, [])
    i = L.index("Heads whose frozen matrix beats their own constant-anchor output (rule R): "
                "**2 of 9**; non-finite: [4, 7].")
    assert L[i + 1] == ""
    lr["reuse"]["heads_below_constant"].update(range=[0.5, 0.75], nonfinite=[])
    L = report._layer_md(layer, lr, r, None, [])
    assert ("Heads whose frozen matrix beats their own constant-anchor output (rule R): "
            "**2 of 9**, all-anchor rRMSE 0.5–0.75.") in L


_IN_HEADS = [{"head": 0, "lam_max": {"median": 101.0, "max": 317.0}, "frac_lam_gt_2": 1.0,
              "frac_rows_increase": 0.875, "increases": True},
             {"head": 1, "lam_max": {"median": 4.5, "max": 26.0}, "frac_lam_gt_2": 0.5,
              "frac_rows_increase": 0.25, "increases": False}]
_Q_HEADS = [{"head": 0, "lam_max": {"median": 15.0, "max": 46.0}, "frac_rows_increase": 0.125,
             "increases": True},
            {"head": 1, "lam_max": {"median": 0.5, "max": 1.0}, "frac_rows_increase": 0.0,
             "increases": False}]
_DESCENT_INTRO = ["### Descent check", "",
                  "Each parametrisation is reported under its own label; numbers of one space "
                  "are never set beside the other's.", ""]
_IN_HEAD = ("| Head | input λ_max median | input λ_max max | input frac λ>2 | input frac rows E↑ "
            "| input E increases")
_Q_HEAD = "query λ_max median | query frac rows E↑ | query E increases |"


def test_descent_table_with_both_spaces_and_with_input_space_only():
    r, layer, lr = _one_layer()
    dsc = lr["descent"]
    dsc["per_head"] = copy.deepcopy(_IN_HEADS)
    dsc["query_space"]["per_head"] = copy.deepcopy(_Q_HEADS)
    L = report._layer_md(layer, lr, r, None, [])
    i = L.index(_IN_HEAD + " | " + _Q_HEAD)
    assert L[i + 1:i + 5] == ["| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                              "| 0 | 101 | 317 | 1 | 0.875 | yes | 15 | 0.125 | yes |",
                              "| 1 | 4.5 | 26 | 0.5 | 0.25 | no | 0.5 | 0 | no |", ""]
    del dsc["query_space"]  # no query space: the input columns alone
    L = report._layer_md(layer, lr, r, None, [])
    assert not any(ln.startswith("**Query space**") for ln in L)
    i = L.index(_IN_HEAD + " |")
    assert L[i + 1:i + 5] == ["| --- | ---: | ---: | ---: | ---: | ---: |",
                              "| 0 | 101 | 317 | 1 | 0.875 | yes |",
                              "| 1 | 4.5 | 26 | 0.5 | 0.25 | no |", ""]


def test_descent_section_when_the_input_space_is_not_defined():
    r, layer, lr = _one_layer()
    lr["descent"] = {"not_defined": "the model has no input-space form",
                     "query_space": {"heads_increasing": 1, "heads": 2,
                                     "fraction_rows_increasing": 0.0625,
                                     "lam_max": {"median": 1.5, "max": 46.0},
                                     "per_head": copy.deepcopy(_Q_HEADS)}}
    L = report._layer_md(layer, lr, r, None, [])
    assert L[:3] == [f"## Layer {layer}", "", "### Reconstruction"]  # what comes before stays
    i = L.index("### Descent check")
    assert L[i:i + 13] == _DESCENT_INTRO + [
        "**Input space**: not defined here — the model has no input-space form.", "",
        "**Query space** (variable: the rotated query; features `scale k~_j`), same rows: "
        "**1 of 2 heads** increase E; rows increasing 0.0625; lambda_max median 1.5, max 46.",
        "",
        "| Head | " + _Q_HEAD,
        "| --- | ---: | ---: | ---: |",
        "| 0 | 15 | 0.125 | yes |",
        "| 1 | 0.5 | 0 | no |",
        ""]


_CONVENTIONS = ("model's own q/k/v projections, `apply_rotary_pos_emb`, `repeat_kv` vs "
                "ropestep's head description (max rel. q / k / v)")


def test_real_heads_claims_not_defined_failing_and_passing():
    r, layer, lr = _one_layer()
    lr["real_heads"] = {"not_defined": {"conventions": "no rotary embedding"},
                        "positive_coefficients": {"contexts": 3, "ok": False, "min_c": -0.25},
                        "rank": {"contexts": 2, "ok": True, "rank_max": 64.0}}
    L = report._layer_md(layer, lr, r, None, [])
    i = L.index("| check | what | worst value(s) | contexts | pass |")
    assert L[i + 1:i + 6] == [
        "| --- | ---: | ---: | ---: | ---: |",
        f"| `conventions` | {_CONVENTIONS} | not defined: no rotary embedding |  |  |",
        "| `positive_coefficients` | min c_ij over every head, candidate and key (> 0) | -0.25 "
        "| 3 | **NO** |",
        "| `rank` | max numerical rank of ΔM_i W_o,h (≤ d) | 64 | 2 | yes |",
        ""]
    lr["real_heads"] = {"rank": {"contexts": 2, "ok": True, "rank_max": 64.0}}  # no not_defined
    L = report._layer_md(layer, lr, r, None, [])
    i = L.index("| check | what | worst value(s) | contexts | pass |")
    assert L[i + 1:i + 4] == ["| --- | ---: | ---: | ---: | ---: |",
                              "| `rank` | max numerical rank of ΔM_i W_o,h (≤ d) | 64 | 2 | yes |",
                              ""]


def _line(md: str, prefix: str) -> str:
    (ln,) = [ln for ln in md.splitlines() if ln.startswith(prefix)]
    return ln


_MODEL_TAIL = ("; llama, 30 layers, 9 heads on 3 KV heads, head_dim 64, hidden 576, rope_theta "
               "100000, q/k/v bias no; loaded in float32")


def test_run_section_lines_with_every_optional_field():
    v = _smollm2()
    v["model"].update(gguf_file="m.gguf", gguf_sha256="feed" * 4, revision="abc123")
    v["corpus"].update(sha256="c0ffee", revision="r9")
    v["timings"] = {"total_s": 10.0, "model_load_s": 1.5, "capture_s": 2.0, "evaluate_s": 3.0,
                    "model_forward_s": 4.0, "work_s": 8.0, "work_over_model_forward": 2.0}
    v["hardware"].update(gpu_name="H200", cpu_capability="AVX2",
                         numeric_env={"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "",
                                      "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    md = report.render_markdown(v)
    assert _line(md, "- Model:") == (
        "- Model: `smollm2` → `SmolLM2-135M-Instruct.Q4_1.gguf` (GGUF `m.gguf`, sha256 "
        "`feedfeedfeedfeed`), revision `abc123`" + _MODEL_TAIL)
    assert _line(md, "- Corpus:") == (
        "- Corpus: `default` (bundled, 79 articles, sha256 `c0ffee`, revision `r9`)")
    assert _line(md, "- Runtime:") == (
        "- Runtime: 10.0 s total (model load 1.5 s, capture 2.0 s, evaluation 3.0 s); the "
        "model's own plain forwards over the same blocks took 4.0 s in this run, and everything "
        "but the load and those forwards 8.0 s = **2.00×** them")
    assert _line(md, "- Hardware:") == (
        "- Hardware: AMD EPYC (2 cores, 2 torch threads), GPU H200; torch CPU capability AVX2, "
        "MKL_CBWR=COMPATIBLE, CUBLAS_WORKSPACE_CONFIG=:4096:8")


def test_run_section_lines_without_the_optional_fields():
    v = _smollm2()
    for k in ("gguf_sha256", "revision"):
        v["model"].pop(k)
    for k in ("sha256", "revision"):
        v["corpus"].pop(k, None)
    v["timings"] = {"total_s": 10.0, "model_load_s": 1.5, "capture_s": 2.0, "evaluate_s": 3.0}
    v["hardware"].update(gpu_name=None, numeric_env={"OMP_NUM_THREADS": ""})
    v["hardware"].pop("cpu_capability", None)
    md = report.render_markdown(v)
    assert _line(md, "- Model:") == (
        "- Model: `smollm2` → `SmolLM2-135M-Instruct.Q4_1.gguf`" + _MODEL_TAIL)
    assert _line(md, "- Corpus:") == "- Corpus: `default` (bundled, 79 articles)"
    assert _line(md, "- Runtime:") == (
        "- Runtime: 10.0 s total (model load 1.5 s, capture 2.0 s, evaluation 3.0 s)")
    assert _line(md, "- Hardware:") == "- Hardware: AMD EPYC (2 cores, 2 torch threads)"


def test_verdict_fail_block_opens_with_title_blank_count_blank():
    f = {"where": "layer 3 head 1", "check": "native", "value": 2.0, "tol": 1.0}
    bad = report._verdict_md({"pass": False, "failed_checks": 2, "failures": [f, f]})
    assert bad == ["## Verdict: FAIL", "",
                   "**2 failed check(s)** (`ropestep validate` exits with status 1):", "",
                   "- `FAIL layer 3 head 1: native = 2 (tolerance 1)`",
                   "- `FAIL layer 3 head 1: native = 2 (tolerance 1)`", ""]


def test_pos_keeps_minus_infinity():
    assert report._pos(-math.inf) == -math.inf and report._pos("-inf") == -math.inf


def test_lambda_figure_draws_fliers_whatever_the_rc_default(plt):
    import matplotlib

    # head 0: five values near 1 and an outlier at 100 (beyond Q3 + 1.5 IQR)
    pts = {"head": [0] * 6 + [1] * 2, "lam_max": [1.0, 1.1, 1.2, 1.3, 1.4, 100.0, 2.0, 3.0]}
    with matplotlib.rc_context({"boxplot.showfliers": False}):
        fig = report._fig_lam(plt, 4, {"descent": {"points": pts}})
    ax = fig.axes[0]
    fl = [sorted(float(y) for y in ln.get_ydata()) for ln in ax.get_lines()
          if ln.get_marker() not in ("None", None, "") and len(ln.get_ydata())]
    assert fl == [[100.0]]


def test_reuse_figure_panels_side_by_side(plt):
    fig = report._fig_reuse(plt, 2, _points(2))
    pos = [ax.get_position() for ax in fig.axes]
    assert len(pos) == 3
    assert pos[0].y0 == pytest.approx(pos[1].y0) == pytest.approx(pos[2].y0)
    assert pos[0].height == pytest.approx(pos[2].height)
    assert pos[0].x1 <= pos[1].x0 and pos[1].x1 <= pos[2].x0
    assert list(fig.get_size_inches()) == [13.0, 4.0]


def test_write_report_dir_replaces_an_old_report_that_cannot_be_removed(tmp_path, monkeypatch):
    """Removing the old copy is best effort: a file in it that cannot be unlinked leaves a
    hidden leftover beside ``out``, never an error after the new report is in place."""
    out = tmp_path / "rep"
    report.write_report_dir(out, lambda d: (d / "stuck").write_text("old"))
    real = os.unlink

    def unlink(path, *a, **kw):
        if os.fspath(path).endswith("stuck"):
            raise PermissionError(1, "Operation not permitted", os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    assert report.write_report_dir(out, lambda d: (d / "new.txt").write_text("2")) == out
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    left = [p for p in tmp_path.iterdir() if p.name != "rep"]
    assert len(left) == 1 and left[0].name.startswith(".rep.old-")
    assert (left[0] / "stuck").read_text() == "old"


def test_write_report_dir_reraises_the_fill_error_when_fill_removed_its_directory(tmp_path):
    import shutil

    out = tmp_path / "rep"
    report.write_report_dir(out, lambda d: (d / "a.txt").write_text("1"))

    def fill(d):
        (d / "a.txt").write_text("2")
        shutil.rmtree(d)
        raise ValueError("fill failed")

    with pytest.raises(ValueError, match="^fill failed$"):
        report.write_report_dir(out, fill)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]
    assert (out / "a.txt").read_text() == "1"


_C_LOCALE_SNIPPET = r"""
import json, locale, sys
from pathlib import Path
from ropestep import report
if locale.getpreferredencoding(False).lower().replace("-", "").replace("_", "") in ("utf8",):
    print("UTF-8 LOCALE")
    sys.exit(0)
src, out, own, lam = map(Path, sys.argv[1:5])
r = report.load(src)
report.write_report(r, out, figures=False)
own.mkdir()
report.fill_rendered(own, r, report.render_markdown)
print(json.dumps(report.load(lam)))
"""


def test_report_files_are_utf8_under_a_c_locale(tmp_path):
    """report.json / report.md are written and read as UTF-8 whatever the locale says: under
    LC_ALL=C (ASCII, no UTF-8 mode) the bytes are the same as here."""
    import subprocess
    import sys

    src = ROOT / "validation" / "smollm2" / "report.json"
    lam = tmp_path / "lam.json"
    lam.write_bytes('{"λ": ["μ", 1.5], "x": "-inf"}'.encode("utf-8"))
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("PYTHONIOENCODING", None)
    p = subprocess.run([sys.executable, "-c", _C_LOCALE_SNIPPET, str(src), str(tmp_path / "out"),
                        str(tmp_path / "own"), str(lam)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    if p.stdout.strip() == "UTF-8 LOCALE":
        pytest.skip("the C locale is UTF-8 here")
    assert json.loads(p.stdout) == {"λ": ["μ", 1.5], "x": -math.inf}
    r = _smollm2()
    md = report.render_markdown(r)
    js = report.dumps(r)
    assert "→" in md and "λ" in md  # the files hold non-ASCII text
    for d in ("out", "own"):
        assert (tmp_path / d / "report.md").read_bytes() == md.encode("utf-8")
        assert (tmp_path / d / "report.json").read_bytes() == js.encode("utf-8")


def test_report_files_are_utf8_in_an_ascii_locale_in_process(tmp_path, ascii_locale):
    """The same as above in this process (the locale switched here): write_report,
    write_rendered, fill_rendered and load name their encoding."""
    r = _smollm2()
    out = report.write_report(r, tmp_path / "a", figures=False)
    md, js = report.render_markdown(r), report.dumps(r)
    assert (out / "report.md").read_bytes() == md.encode("utf-8") and "λ" in md
    assert (out / "report.json").read_bytes() == js.encode("utf-8")
    assert report.load(out / "report.json") == report.load(ROOT / "validation" / "smollm2" /
                                                           "report.json")
    d = tmp_path / "own"
    d.mkdir()
    report.fill_rendered(d, {"λ": "μ"}, lambda res: "# λ → μ\n")
    assert (d / "report.md").read_bytes() == "# λ → μ\n".encode("utf-8")
    assert (d / "report.json").read_bytes() == report.dumps({"λ": "μ"}).encode("utf-8")
