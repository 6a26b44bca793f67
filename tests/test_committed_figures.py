"""The figures of the committed reports: what they draw, checked against the report's numbers,
and how they draw it, against a committed description.

``render_figures`` of ``validate`` (:mod:`ropestep.report`), ``atlas`` and ``heads`` runs on
each committed ``report.json`` with ``Figure.savefig`` intercepted: each figure is drawn (Agg)
and described -- size, titles, axis labels and scales, fixed tick labels, the tick labels as
drawn, font sizes, each axes' aspect and position, legend entries, every artist's data and
style (lines, bars, scatter offsets, images), and what ``savefig`` was asked (its resolution) --
instead of written.  The figures are drawn with
matplotlib's image defaults set away from what the renderers ask for (``RC``), so that a
colour map, interpolation or aspect the renderer asks for shows in the description even where it
is matplotlib's default.

* **Data, independently:** the bars of a validate reconstruction figure are the report's
  ``max_abs`` per head; its scatter points are the calibration points of the report, per head;
  the atlas per-layer medians are recomputed from the per-head statistics with numpy.
* **Everything else, against ``tests/golden/figures.json``:** a change to a label, a scale, a
  colour or a file name turns the test red.  Floats are kept to 9 significant digits and long
  arrays as a digest, so the file stays small; it depends on the committed reports and on
  matplotlib's artists, not on pixels or fonts.  After a deliberate change, rewrite it with
  ``ROPESTEP_REGEN_GOLDEN=1 pytest tests/test_committed_figures.py`` and review the diff.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg", force=True)
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FixedFormatter  # noqa: E402

from ropestep import atlas, heads, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "figures.json"
MODULES = {"ropestep.validate/1": report, "ropestep.atlas/1": atlas,
           "ropestep.heads/1": heads}
# one committed report per command (the smallest: drawing every layer of every report takes
# minutes); the renderer code is the same for the others
REPORTS = [ROOT / "validation" / n for n in ("smollm2", "atlas-smollm2", "heads-smollm2")]


def _r(x) -> list:
    a = np.asarray(x, dtype=float).ravel()
    return [None if not np.isfinite(v) else float(f"{v:.9g}") for v in a]


def _arr(x) -> dict | list:
    """Short arrays as values, long ones as shape and digest of the rounded values."""
    a = np.ma.filled(np.ma.asarray(x, dtype=float), np.nan)
    vals = _r(a)
    if len(vals) <= 24:
        return vals
    h = hashlib.sha256(json.dumps(vals).encode()).hexdigest()[:16]
    return {"shape": list(a.shape), "sha256": h}


def _fixed(axis) -> list | None:
    f = axis.get_major_formatter()
    return list(f.seq) if isinstance(f, FixedFormatter) else None


def _ticks(axis) -> dict:
    """The tick labels as drawn (whatever formatter made them) and their font size."""
    labels = axis.get_ticklabels()
    return {"text": [t.get_text() for t in labels],
            "size": _r([labels[0].get_fontsize()])[0] if labels else None}


def _box(ax) -> dict:
    """Where the axes sit and how they are shaped: the aspect setting and the position after
    the layout (3 significant digits: enough to see an aspect or a colour bar change, not
    a font's hinting)."""
    return {"aspect": str(ax.get_aspect()),
            "position": [float(f"{v:.3g}") for v in ax.get_position().bounds]}


def _collection(c) -> dict:
    out = {"kind": type(c).__name__, "alpha": c.get_alpha(), "label": c.get_label(),
           "fc": sorted({to_hex(x, keep_alpha=True) for x in c.get_facecolors()}),
           "ec": sorted({to_hex(x, keep_alpha=True) for x in c.get_edgecolors()}),
           "lw": _r(c.get_linewidths())}
    if hasattr(c, "get_sizes"):
        out.update(offsets=_arr(c.get_offsets()), sizes=_r(c.get_sizes()))
    if hasattr(c, "get_segments"):
        out["segments"] = _arr(np.concatenate([np.asarray(s, float).ravel()
                                               for s in c.get_segments()] or [np.zeros(0)]))
    return out


def describe(fig) -> dict:
    fig.canvas.draw()
    out = {"size": _r(fig.get_size_inches()),
           "suptitle": fig._suptitle.get_text() if fig._suptitle is not None else None,
           "axes": []}
    for ax in fig.axes:
        leg = ax.get_legend()
        a = {"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
             "xscale": ax.get_xscale(), "yscale": ax.get_yscale(),
             "xticks": _fixed(ax.xaxis), "yticks": _fixed(ax.yaxis),
             "xticklabels": _ticks(ax.xaxis), "yticklabels": _ticks(ax.yaxis),
             "title_size": _r([ax.title.get_fontsize()])[0],
             "label_sizes": _r([ax.xaxis.label.get_fontsize(), ax.yaxis.label.get_fontsize()]),
             "box": _box(ax),
             "legend": [t.get_text() for t in leg.get_texts()] if leg else None,
             "legend_size": _r([leg.get_texts()[0].get_fontsize()])[0]
             if leg and leg.get_texts() else None,
             "lines": [{"x": _arr(ln.get_xdata()), "y": _arr(ln.get_ydata()),
                        "color": to_hex(ln.get_color()), "ls": ln.get_linestyle(),
                        "lw": float(ln.get_linewidth()), "marker": str(ln.get_marker()),
                        "label": ln.get_label()} for ln in ax.get_lines()],
             "patches": [{"xy": _r(p.get_xy()), "w": _r(p.get_width()),
                          "h": _r(p.get_height()), "fc": to_hex(p.get_facecolor())}
                         for p in ax.patches if hasattr(p, "get_width")],
             "collections": [_collection(c) for c in ax.collections],
             "images": [{"data": _arr(im.get_array()), "cmap": im.get_cmap().name,
                         "interpolation": im.get_interpolation()} for im in ax.get_images()]}
        out["axes"].append(a)
    return out


RC = {"image.cmap": "gray", "image.interpolation": "bilinear", "image.aspect": "equal"}


_DRAWN: dict[str, dict] = {}


def drawn(name: str) -> dict:
    """``{figure file name: description}`` of the committed report ``validation/<name>``, drawn
    once per test session (each report on its own: a test of one command's figures draws only
    that command's)."""
    if name not in _DRAWN:
        saved: dict = {}

        def capture(self, fname, *args, **kwargs):
            saved[Path(fname).name] = {**describe(self),
                                       "savefig": {k: kwargs[k] for k in sorted(kwargs)}}

        result = json.loads((ROOT / "validation" / name / "report.json").read_text(
            encoding="utf-8"))
        orig = Figure.savefig
        Figure.savefig = capture
        try:
            with matplotlib.rc_context(RC):
                MODULES[result["schema"]].render_figures(result, Path(os.devnull + "_unused"))
        finally:
            Figure.savefig = orig
        _DRAWN[name] = saved
    return _DRAWN[name]


def test_the_figures_cover_each_command():
    assert sorted(json.loads((d / "report.json").read_text(encoding="utf-8"))["schema"]
                  for d in REPORTS) == sorted(MODULES)


@pytest.mark.parametrize("name", [d.name for d in REPORTS])
def test_figures_against_the_golden_description(name):
    got_all = drawn(name)
    if os.environ.get("ROPESTEP_REGEN_GOLDEN"):
        golden = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.is_file() else {}
        golden[name] = got_all
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert sorted(golden) == sorted(d.name for d in REPORTS), "the reports with figures changed"
    assert sorted(got_all) == sorted(golden[name]), f"{name}: the figure files changed"
    for fig in golden[name]:
        got = json.loads(json.dumps(got_all[fig]))
        assert got == golden[name][fig], f"{name}/figures/{fig} draws something else"


def _validate_result(name: str) -> dict:
    return json.loads((ROOT / "validation" / name / "report.json").read_text(encoding="utf-8"))


def test_validate_figures_draw_the_reports_numbers():
    """Bars = the reconstruction table's max_abs; scatter = the calibration points."""
    for d in [d for d in REPORTS if _validate_result(d.name)["schema"] == "ropestep.validate/1"]:
        r = _validate_result(d.name)
        for layer, lr in r["layers"].items():
            rec = drawn(d.name)[f"reconstruction_L{layer}.png"]["axes"][0]
            rows = lr["reconstruction"]["per_head"] + [lr["reconstruction"]["combined"]]
            for k, key in enumerate(("prefix", "full", "native")):
                want = [max(float(row[key]["max_abs"]), 1e-300) for row in rows]
                got = [p["h"][0] for p in rec["patches"][k * len(rows):(k + 1) * len(rows)]]
                np.testing.assert_allclose(got, want, rtol=1e-8)
            pts = lr["calibration"]["points"]
            rel = np.array([np.nan if v is None else float(v) for v in pts["rel"]])
            heads_ = np.asarray(pts["head"])
            ax0 = drawn(d.name)[f"reuse_vs_distance_L{layer}.png"]["axes"][0]
            sc = np.array([np.nan if v is None else float(v) for v in pts["score_sup"]])
            for k, h in enumerate(sorted(set(heads_.tolist()))):
                sel = (heads_ == h) & np.isfinite(rel) & (rel > 0) & np.isfinite(sc) & (sc > 0)
                want = _arr(np.stack([sc[sel], rel[sel]], -1)) if sel.any() else _arr(
                    np.zeros((0, 2)))
                assert ax0["collections"][k]["offsets"] == want, (d.name, layer, h)
                assert ax0["collections"][k]["label"] == f"h{h}"


def test_atlas_per_layer_medians_recomputed():
    for d in [d for d in REPORTS if _validate_result(d.name)["schema"] == "ropestep.atlas/1"]:
        r = _validate_result(d.name)
        fig = drawn(d.name)["per_layer.png"]["axes"]
        layers = sorted(int(k) for k in r["layers"])

        def col(path, how):
            vals = []
            for L in layers:
                hs = r["layers"][str(L)]["heads"]
                v = []
                for h in hs:
                    x = h
                    for p in path:
                        x = x[p]
                    v.append(np.nan if x is None else float(x))
                vals.append(how(np.asarray(v)))
            return _arr(vals)

        assert fig[0]["lines"][0]["y"] == col(("lambda_max_query_space", "median"), np.median)
        assert fig[1]["lines"][1]["y"] == col(("step_increases_E_input_space",), np.mean)
        assert fig[2]["lines"][0]["y"] == col(("reuse", "rrmse_vs_constant_anchor"), np.median)
        assert fig[0]["lines"][0]["x"] == _arr(layers)
