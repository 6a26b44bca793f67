"""Report files of ``ropestep validate``: ``report.json`` (the data), ``report.md`` (tables) and
``figures/*.png`` (matplotlib, Agg), all rendered from the result dict of
:func:`ropestep.protocol.run`.

:func:`write_report` writes everything into a temporary sibling directory and renames it into
place at the end, so a failure leaves no half-written report (an existing report directory is
replaced only after the new one is complete).

Non-finite numbers are never hidden: ``report.md`` prints them as ``nan``/``inf``/``-inf`` (``—``
means "no value", e.g. an undefined ratio), and ``report.json`` holds them as the strings
``"nan"``/``"inf"``/``"-inf"`` (JSON has no NaN); :func:`load` reads them back as floats.  The
verdict (``result["verdict"]``, :func:`ropestep.protocol.verdict`) opens ``report.md``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .reuse_stats import PREDICTOR_LABELS, PREDICTORS
from .verdict import Failure, encode, loads, nonfinite_name, worst

FIGURES = ("reconstruction", "reuse_vs_distance", "lam_max")


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------
def jsonable(x: Any) -> Any:
    """numpy/torch scalars and arrays to Python; non-finite floats to the strings ``"nan"``,
    ``"inf"``, ``"-inf"`` (strict JSON has no NaN; :func:`load` reads them back)."""
    return encode(x)


def dumps(result: dict) -> str:
    return json.dumps(jsonable(result), indent=1, allow_nan=False, ensure_ascii=False) + "\n"


def load(path: str | os.PathLike) -> dict:
    """Read a ``report.json`` back, the strings ``"nan"``/``"inf"``/``"-inf"`` as floats."""
    return loads(Path(path).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------
def fmt(x: Any, digits: int = 3) -> str:
    """Short number: fixed for moderate magnitudes, scientific for tiny/huge, ``nan``/``inf``/
    ``-inf`` for non-finite values, '—' for None (no value)."""
    if x is None:
        return "—"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    v = float(x)
    if not math.isfinite(v):
        return nonfinite_name(v)
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e4:
        return f"{v:.{digits + 1}g}" if abs(v) < 1 else f"{v:.{digits}g}"
    return f"{v:.{digits - 1}e}"


def fmt6(x: Any) -> str:
    """The paper's six-decimal style for pooled MSEs (scientific below 1e-4)."""
    if x is None:
        return "—"
    v = float(x)
    if not math.isfinite(v):
        return nonfinite_name(v)
    return f"{v:.6f}" if abs(v) >= 1e-4 else f"{v:.3e}"


def _table(head: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    al = align or ("l" + "r" * (len(head) - 1))
    sep = ["---" if a == "l" else "---:" for a in al]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def render_markdown(result: dict, figures: dict[str, list[str]] | None = None) -> str:
    r = result
    cfg, model, corpus, proto = r["config"], r["model"], r["corpus"], r["protocol"]
    hw, ver, tm = r["hardware"], r["versions"], r["timings"]
    paper = r.get("paper")
    L = [
        f"# ropestep validate: {Path(model['source']).name}, layer(s) "
        f"{', '.join(map(str, proto['layers']))}",
        "",
        "Exact identity `y_i = mu_i + u_i^T dM_i` with `c_ij = phi1(s_ij)/Z_i` checked on a "
        "pretrained model, and the paper's frozen-reuse table (docs/protocol.md).",
        "",
        "## Run",
        "",
        f"- Command: `{' '.join(r['command']) if r.get('command') else '(API call)'}`",
        f"- Model: `{model['argument']}` → `{model['source']}`"
        + (f" (GGUF `{model['gguf_file']}`, sha256 `{model['gguf_sha256']}`)"
           if model.get("gguf_sha256") else "")
        + (f", revision `{model['revision']}`" if model.get("revision") else "")
        + f"; {model['model_type']}, {model['n_layers']} layers, {model['n_heads']} heads on "
          f"{model['n_kv_heads']} KV heads, head_dim {model['head_dim']}, hidden {model['hidden']},"
          f" rope_theta {model['rope_theta']:g}, q/k/v bias {fmt(model['qkv_bias'])}; "
          f"loaded in {model['dtype']}",
        f"- Corpus: `{corpus['name']}` ({corpus.get('kind')}, {corpus['n_articles']} articles"
        + (f", sha256 `{corpus['sha256']}`" if corpus.get("sha256") else "")
        + (f", revision `{corpus['revision']}`" if corpus.get("revision") else "") + ")",
        f"- Protocol: {proto['contexts']} contexts × {proto['queries']} queries × "
        f"{proto['prefix_len']} tokens (bank = {proto['bank']}, queries at position "
        f"{proto['query_position']}), seed {proto['seed']}, heads "
        f"{_ranges(proto['heads'])}, device `{cfg['device']}`",
        f"- Runtime: {tm['total_s']:.1f} s total (model load {tm['model_load_s']:.1f} s, capture "
        f"{tm['capture_s']:.1f} s, evaluation {tm['evaluate_s']:.1f} s)"
        + (f"; the model's own plain forwards over the same blocks took "
           f"{tm['model_forward_s']:.1f} s in this run, and everything but the load and those "
           f"forwards {tm['work_s']:.1f} s = **{tm['work_over_model_forward']:.2f}×** them"
           if "model_forward_s" in tm else ""),
        f"- Versions: python {ver['python']}, torch {ver['torch']}, transformers "
        f"{ver['transformers']}, ropestep {ver['ropestep']}, numpy {ver['numpy']}",
        f"- Hardware: {hw['cpu_model']} ({hw['cpu_cores']} cores, {hw['torch_threads']} torch "
        f"threads)" + (f", GPU {hw['gpu_name']}" if hw.get("gpu_name") else "")
        + (f"; torch CPU capability {hw['cpu_capability']}" if hw.get("cpu_capability") else "")
        + "".join(f", {k}={v}" for k, v in (hw.get("numeric_env") or {}).items() if v),
        "",
    ]
    if paper:
        L += ["This is the paper's setup: its numbers (docs/protocol.md) stand beside ours.", ""]
    L += _verdict_md(r.get("verdict"))
    for layer, lr in r["layers"].items():
        L += _layer_md(int(layer), lr, r, paper, (figures or {}).get(layer, []))
    return "\n".join(L).rstrip() + "\n"


VERDICT_LINES = 50  # failed checks listed in report.md (all of them are in report.json)


def _verdict_md(v: dict | None) -> list[str]:
    if v is None:
        return []
    if v["pass"]:
        return ["## Verdict: PASS", "", "Every check passed (reconstruction rows, reuse bound, "
                "frozen cross-check, refresh identity; no non-finite error).", ""]
    fl = v["failures"]
    L = ["## Verdict: FAIL", "", f"**{v['failed_checks']} failed check(s)** "
         "(`ropestep validate` exits with status 1):", ""]
    L += [f"- `{Failure(**f).line()}`" for f in fl[:VERDICT_LINES]]
    if len(fl) > VERDICT_LINES:
        L.append(f"- … and {len(fl) - VERDICT_LINES} more (`report.json`, `verdict.failures`)")
    return L + [""]


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2:
        return f"{xs[0]}–{xs[-1]}"
    return ", ".join(map(str, xs))


def _native_tol(t: dict) -> str:
    if "normwise" in t:
        return f"{t['normwise']:g} max|native| (normwise)"
    return f"atol/rtol {t['atol']:g}/{t['rtol']:g}"


def _layer_md(layer: int, lr: dict, r: dict, paper: dict | None, figs: list[str]) -> list[str]:
    rec, reuse, cal, dsc = lr["reconstruction"], lr["reuse"], lr["calibration"], lr["descent"]
    md_dtype = r["model"]["dtype"]
    tol = rec["tolerances"]
    L = [f"## Layer {layer}", "", "### Reconstruction", "",
         f"Rows passing: **{rec['rows_passed']} / {rec['rows_total']}** "
         f"({lr['contexts']} contexts × ({len(r['protocol']['heads'])} heads + the combined "
         f"write)); identity {rec['rows_passed_identity']}, native "
         f"{rec['rows_passed_native']}. Pass = float64 identity within atol/rtol "
         f"{tol['identity_head'][0]:g}/{tol['identity_head'][1]:g} per head "
         f"({tol['identity_write'][0]:g}/{tol['identity_write'][1]:g} for the summed write) on "
         f"both banks, and the float64 formula within {_native_tol(tol['native'][md_dtype])} "
         f"of the native {md_dtype} write. MSE: mean over contexts; max: over contexts.",
         "",
         "Columns: float64 `y - (mu + u^T dM)` on the prefix bank and the full bank (self "
         "included); the prefix/full relation `(1-pi) y_prefix + pi v_self - y_full`; the "
         "float64 formula against the model's native write (every candidate's single-token "
         "forward on the prefix cache, and a full forward over the block for the observed "
         "token).", ""]
    rows = []
    for ph in rec["per_head"] + [dict(rec["combined"], head="combined")]:
        rows.append([str(ph["head"]), fmt(ph["prefix"]["mse"]), fmt(ph["prefix"]["max_abs"]),
                     fmt(ph["full"]["mse"]), fmt(ph["full"]["max_abs"]),
                     fmt(ph["relation_max_abs"]), fmt(ph["native"]["mse"]),
                     fmt(ph["native"]["max_abs"]),
                     fmt(ph["native_observed_full_forward"]["max_abs"]),
                     f"{ph['pass']}/{ph['rows']}"])
    L += _table(["Head", "prefix MSE", "prefix max", "full MSE", "full max", "relation max",
                 "native MSE", "native max", "native max (full fwd)", "pass"], rows)
    L.append("")
    gw = rec["combined"].get("native_gated_write")
    if gw is not None:
        L += [f"Output gate: the read gate applied after the float64 formula's heads and "
              f"projected, against the model's own write: MSE {fmt(gw['mse'])}, max "
              f"{fmt(gw['max_abs'])} (the native criterion; the rows above are in head space).",
              ""]
    if paper:
        p = paper["reconstruction"]
        c = rec["combined"]
        L += _table(["Combined write", "ours", "paper"], [
            ["rows passing", f"{rec['rows_passed']}/{rec['rows_total']}",
             f"{p['rows_passed']}/{p['rows_total']}"],
            ["prefix float64 MSE", fmt(c["prefix"]["mse"]), fmt(p["prefix_write_mse"])],
            ["full float64 MSE", fmt(c["full"]["mse"]), fmt(p["full_write_mse"])],
            ["native float32 MSE", fmt(c["native"]["mse"]), fmt(p["native_write_mse"])],
            ["native float32 max abs", fmt(c["native"]["max_abs"]), fmt(p["native_write_max_abs"])],
        ])
        L.append("")

    L += ["### Fast path (full bank, combined write)", "",
          "The torch fast path evaluated in float32 and bfloat16 (inputs rounded to the dtype, "
          "float32 accumulation) in the original and max-key gauges, against the float64 "
          "softmax output and against the native write. kappa is the readout sum's condition "
          "number (`fast.Step.kappa`, per head and query: median over contexts of the median, "
          "and the max): the readout can lose about log10(kappa) digits, so the better "
          "conditioned gauge is the more accurate one.", ""]
    rows = []
    for key, ent in lr["fast"].items():
        if "error" in ent:
            rows.append([key, "error: " + ent["error"][:60], "", "", "", "", ""])
            continue
        cb = ent["combined"]
        wh = worst((h["vs_float64"]["max_abs"] for h in ent["heads"]), default=None)
        kp = ent.get("kappa", {})
        kap = f"{fmt(kp['median'])} / {fmt(kp['max'])}" if kp else ""
        rows.append([key, fmt(cb["vs_float64"]["mse"]), fmt(cb["vs_float64"]["max_abs"]),
                     fmt(cb["vs_native"]["mse"]), fmt(cb["vs_native"]["max_abs"]), fmt(wh),
                     kap])
    L += _table(["dtype/gauge", "vs float64 MSE", "vs float64 max", "vs native MSE",
                 "vs native max", "worst head vs float64 max", "kappa median / max"], rows)
    L.append("")

    tab = reuse["combined"]
    L += ["### Frozen reuse", "",
          "Projected write `o_ci = sum_h y_cih W_o,h`; `E(f) = (1/C) sum_c 1/((Q-1) D) "
          "sum_{i != a} ||f_ci - o_ci||^2`, contexts weighted equally, ratios after pooling; "
          "\"all anchors\" averages over `a` within each context first. rRMSE is against the "
          "constant anchor output.", ""]
    head = ["Predictor (pooled MSE)", "Anchor 0", "All anchors", "rRMSE (a0)", "rRMSE (all)"]
    if paper:
        head += ["paper anchor 0", "paper all"]
    rows = []
    for k in PREDICTORS:
        pr = tab["predictors"][k]
        row = [PREDICTOR_LABELS[k], fmt6(pr["mse"]["anchor0"]), fmt6(pr["mse"]["all"]),
               fmt(pr["rrmse"]["anchor0"]), fmt(pr["rrmse"]["all"])]
        if paper:
            row += [fmt6(paper["reuse"][k]["anchor0"]), fmt6(paper["reuse"][k]["all"])]
        rows.append(row)
    tr = ["Target RMS", fmt6(tab["target_rms"]["anchor0"]), fmt6(tab["target_rms"]["all"]), "", ""]
    if paper:
        tr += [fmt6(paper["reuse"]["target_rms"]["anchor0"]),
               fmt6(paper["reuse"]["target_rms"]["all"])]
    rows.append(tr)
    L += _table(head, rows)
    fz = tab["predictors"]["frozen"]
    L += ["", f"Frozen anchor matrix: rRMSE {fmt(fz['rrmse']['anchor0'])} vs the constant anchor "
          f"output (anchor 0), {fmt(fz['rrmse_vs_mean']['anchor0'])} vs the cache mean, "
          f"{fmt(fz['rrmse']['all'])} all-anchor"
          + (f" (paper: {paper['reuse']['frozen_rrmse']['anchor0']}, "
             f"{paper['reuse']['frozen_rrmse_vs_mean']}, {paper['reuse']['frozen_rrmse']['all']})"
             if paper else "") + ".", ""]
    rows = []
    for ph in reuse["per_head"]:
        p = ph["predictors"]
        rows.append([str(ph["head"]), fmt6(p["constant"]["mse"]["anchor0"]),
                     fmt6(p["mean"]["mse"]["anchor0"]), fmt6(p["frozen"]["mse"]["anchor0"]),
                     fmt6(p["linear"]["mse"]["anchor0"]), fmt(p["frozen"]["rrmse"]["anchor0"]),
                     fmt(p["frozen"]["rrmse"]["all"]), fmt(p["mean"]["rrmse"]["all"])])
    L += ["Per head (each head's own projected write `y_h W_o,h`):", ""]
    L += _table(["Head", "constant a0", "mean a0", "frozen a0", "linear a0",
                 "frozen rRMSE a0", "frozen rRMSE all", "mean rRMSE all"], rows)
    L.append("")
    hb = reuse.get("heads_below_constant")
    if hb is not None:
        rng = ("" if hb["range"] is None
               else f", all-anchor rRMSE {fmt(hb['range'][0])}–{fmt(hb['range'][1])}")
        L += [f"Heads whose frozen matrix beats their own constant-anchor output ({hb['rule']}): "
              f"**{hb['count']} of {hb['of']}**{rng}"
              + (f" (paper: {paper['reuse']['heads_in_range']} heads, "
                 f"{paper['reuse']['heads_all_anchor_rrmse_range'][0]}–"
                 f"{paper['reuse']['heads_all_anchor_rrmse_range'][1]})" if paper else "")
              + (f"; non-finite: {hb['nonfinite']}" if hb["nonfinite"] else "") + ".", ""]

    ck = cal["checks"]
    L += ["### Calibration (anchor 0)", "",
          f"Tokenwise formula `e_i = sum_j (c_ij - c_0j)(u_i.a_j)(v_j - mu)` against the measured "
          f"reuse error: max normwise relative difference **{fmt(ck['tokenwise_max_rel'])}** "
          f"(float64; must be at rounding level). Bound `||e_i|| <= ||u_i|| "
          f"||dM_i - dM_0||_op` violated {fmt(ck['bound_violations'])} times; anchor plus "
          f"refresh reproduces `y` to {fmt(ck['refresh_identity_max_abs'])}.", "",
          "Relative error `||e_i|| / ||y_i - mu||` against the distance of query `i` from the "
          "anchor (Spearman rank correlation) and the best scalar gain `gamma` in "
          "`mu + gamma u_i^T dM_0` (least squares over all contexts and queries `i != 0`):", ""]
    rows = []
    for ph in cal["per_head"]:
        dd = ph["distances"]
        rows.append([str(ph["head"]), fmt(ph["relative_error"]["median"]),
                     fmt(dd["score_sup"]["spearman"]), fmt(dd["tv"]["spearman"]),
                     fmt(dd["input"]["spearman"]), fmt(ph["gamma"]),
                     fmt(ph["mse_frozen"]), fmt(ph["mse_after_gain"]), fmt(ph["mse_mean"]),
                     fmt(ph["tokenwise_max_rel"])])
    L += _table(["Head", "median rel. err", "ρ(score dist)", "ρ(TV)", "ρ(‖u_i−u_0‖)", "γ",
                 "MSE γ=1", "MSE best γ", "MSE γ=0", "tokenwise rel"], rows)
    cb = cal["combined"]
    L += ["", f"Combined write: γ = {fmt(cb['gamma'])}; rRMSE against the constant anchor "
          f"output {fmt(cb['rrmse_frozen'])} at γ = 1 and {fmt(cb['rrmse_after_gain'])} at the "
          f"best γ; ρ(rel. err, ‖u_i−u_0‖) = {fmt(cb['distances']['input']['spearman'])}.", ""]
    bins = cal["pooled_heads"]["distances"]["tv"]["bins"]
    if bins:
        L += ["Pooled over heads, relative error by total-variation distance (quantile bins):", ""]
        L += _table(["TV range", "n", "median rel. err", "90th pct"],
                    [[f"{fmt(b['x_lo'])}–{fmt(b['x_hi'])}", str(b["n"]), fmt(b["median"]),
                      fmt(b["p90"])] for b in bins])
        L.append("")

    qs, rep = dsc.get("query_space"), dsc.get("replication_style")
    L += ["### Descent check", "",
          "Each parametrisation is reported under its own label; numbers of one space are "
          "never set beside the other's.", ""]
    if "not_defined" in dsc:
        L += [f"**Input space**: not defined here — {dsc['not_defined']}.", ""]
    else:
        L += [f"**Input space** (the paper's: `u = [x; 1]`, `H_i = sum_j c_ij a_ij a_ij^T`, "
              f"unit step `dM_i`; a head counts when the median over its rows increases E): "
              f"**{dsc['heads_increasing']} of {dsc['heads']} heads** increase E "
              f"({fmt(dsc['fraction_heads_increasing'])}); rows increasing: "
              f"{fmt(dsc['fraction_rows_increasing'])}; lambda_max median "
              f"{fmt(dsc['lam_max']['median'])}, max {fmt(dsc['lam_max']['max'])}.", ""]
    if qs is not None:
        L += [f"**Query space** (variable: the rotated query; features `scale k~_j`), same rows: "
              f"**{qs['heads_increasing']} of {qs['heads']} heads** increase E; rows increasing "
              f"{fmt(qs['fraction_rows_increasing'])}; lambda_max median "
              f"{fmt(qs['lam_max']['median'])}, max {fmt(qs['lam_max']['max'])}.", ""]
    if rep is not None:
        L += [f"**Replication-style** ({rep['space']}; {rep['query']}): the unit step increases "
              f"E in **{rep['increase']} of {rep['pairs']}** (head, context) pairs; lambda_max "
              f"median {fmt(rep['lam_max_median'])}, max {fmt(rep['lam_max_max'])}"
              + (" — the public replication measured 3 of 28 (median 0.51, max 109.56) this way "
                 "on Qwen2.5-0.5B layer 23, with 2 short synthetic prompts" if paper else "")
              + ".", ""]
    ins = "not_defined" not in dsc
    rows = [([str(qd["head"])]
             + ([fmt(d["lam_max"]["median"]), fmt(d["lam_max"]["max"]), fmt(d["frac_lam_gt_2"]),
                 fmt(d["frac_rows_increase"]), fmt(d["increases"])] if ins else [])
             + ([fmt(qd["lam_max"]["median"]), fmt(qd["frac_rows_increase"]),
                 fmt(qd["increases"])] if qs is not None else []))
            for d, qd in zip((dsc if ins else qs)["per_head"], (qs or dsc)["per_head"])]
    L += _table(["Head"] + (["input λ_max median", "input λ_max max", "input frac λ>2",
                             "input frac rows E↑", "input E increases"] if ins else [])
                + (["query λ_max median", "query frac rows E↑", "query E increases"]
                   if qs is not None else []), rows)
    L.append("")
    rh = lr.get("real_heads")
    if rh:
        what = {
            "conventions": "model's own q/k/v projections, `apply_rotary_pos_emb`, `repeat_kv` "
                           "vs ropestep's head description (max rel. q / k / v)",
            "positive_coefficients": "min c_ij over every head, candidate and key (> 0)",
            "rank": "max numerical rank of ΔM_i W_o,h (≤ d)",
            "no_global_readout": "certified lower bound on any common affine readout's error "
                                 "(> 0)",
            "position_derivative": "∂y_i/∂p_i by the RoPE generator vs the model's attention at "
                                   "shifted position ids (error / tolerance)",
            "position_shift": "y_i(p_i+δ) − y_i(p_i) via φ₁(δA) vs the model at p_i+δ "
                              "(error / tolerance)",
            "exact_rows": "float64 path vs the 50-digit mpmath oracle on sampled real rows "
                          "(y / ΔM / c / readout, relative)",
        }
        rows = []
        for name, desc in what.items():
            a = rh.get(name)
            if not a:
                if name in (rh.get("not_defined") or {}):
                    rows.append([f"`{name}`", desc, "not defined: " + rh["not_defined"][name],
                                 "", ""])
                continue
            vals = " / ".join(fmt(a[f]) for f in a if f not in ("contexts", "ok"))
            rows.append([f"`{name}`", desc, vals, str(a["contexts"]),
                         "yes" if a["ok"] else "**NO**"])
        L += ["### Claims on the real heads", "",
              "docs/protocol.md, \"Reconstruction results\"; `ropestep.realchecks` (each check's "
              "tolerance and its derivation are in the JSON).", ""]
        L += _table(["check", "what", "worst value(s)", "contexts", "pass"], rows)
        L.append("")
    if figs:
        L += ["### Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figs] + [""]
    return L


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------
def render_figures(result: dict, fig_dir: Path) -> dict[str, list[str]]:
    """Write the PNG figures of every layer; return ``{layer: [relative paths]}``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[str]] = {}
    for layer, lr in result["layers"].items():
        paths = []
        for name, fn in (("reconstruction", _fig_reconstruction),
                         ("reuse_vs_distance", _fig_reuse),
                         ("lam_max", _fig_lam)):
            fig = fn(plt, int(layer), lr)
            p = fig_dir / f"{name}_L{layer}.png"
            fig.savefig(p, dpi=110)
            plt.close(fig)
            paths.append(f"figures/{p.name}")
        out[layer] = paths
    return out


def _num(x: Any) -> float:
    """A plotted number: None -> nan, the JSON strings "nan"/"inf" -> floats."""
    if x is None:
        return math.nan
    return float(x)  # float("nan"), float("inf") parse the JSON spellings too


def _pos(x: Any) -> float:
    """Log-scale plotting value: an exact zero is drawn at 1e-40 (below every real bar); a
    non-finite value stays non-finite (no bar, never a fake one)."""
    v = _num(x)
    return v if not math.isfinite(v) else max(v, 1e-40)


def _fig_reconstruction(plt, layer: int, lr: dict):
    rec = lr["reconstruction"]
    rows = rec["per_head"] + [dict(rec["combined"], head="all")]
    labels = [str(r["head"]) for r in rows]
    x = np.arange(len(rows))
    series = [("float64 identity, prefix bank", [r["prefix"]["max_abs"] for r in rows]),
              ("float64 identity, full bank", [r["full"]["max_abs"] for r in rows]),
              ("float64 formula vs native write", [r["native"]["max_abs"] for r in rows])]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 3), 4))
    w = 0.27
    for k, (lab, vals) in enumerate(series):
        ax.bar(x + (k - 1) * w, [_pos(v) for v in vals], w, label=lab)
    ax.set_yscale("log")
    ax.set_xticks(x, labels)
    ax.set_xlabel("head ('all' = combined write o = Σ_h y_h W_o,h)")
    ax.set_ylabel("max |error| over contexts and queries")
    ax.set_title(f"Layer {layer}: reconstruction error per head")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _fig_reuse(plt, layer: int, lr: dict):
    import matplotlib.ticker  # minor tick labels off: they collide on log axes

    pts = lr["calibration"]["points"]
    heads = np.asarray(pts["head"])
    rel = np.asarray([_num(v) for v in pts["rel"]], float)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    cmap = plt.get_cmap("tab20")
    uh = sorted(set(heads.tolist()))
    for ax, key, lab in zip(axes, ("score_sup", "tv", "input"),
                            ("score distance max_j |s_ij − s_0j|", "TV distance of attention rows",
                             "‖u_i − u_0‖")):
        d = np.asarray([_num(v) for v in pts[key]], float)
        for k, h in enumerate(uh):
            sel = (heads == h) & np.isfinite(rel) & (rel > 0) & np.isfinite(d) & (d > 0)
            ax.scatter(d[sel], rel[sel], s=6, alpha=0.6, color=cmap(k % 20), label=f"h{h}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(lab)
    axes[0].set_ylabel("relative reuse error ‖e_i‖ / ‖y_i − μ‖")
    if len(uh) <= 20:
        axes[-1].legend(fontsize=6, ncol=2, markerscale=2)
    fig.suptitle(f"Layer {layer}: frozen anchor-0 matrix, error against distance from the anchor")
    fig.tight_layout()
    return fig


def _fig_lam(plt, layer: int, lr: dict):
    dsc = lr["descent"]
    space = "query" if "not_defined" in dsc else "input"
    pts = (dsc["query_space"] if space == "query" else dsc)["points"]
    heads = np.asarray(pts["head"])
    lam = np.asarray([_num(v) for v in pts["lam_max"]], float)
    uh = sorted(set(heads.tolist()))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(uh) + 3), 4))
    data = [np.clip(lam[(heads == h) & np.isfinite(lam)], 1e-12, None) for h in uh]
    ax.boxplot(data, positions=np.arange(len(uh)), widths=0.6, showfliers=True)
    ax.set_xticks(np.arange(len(uh)), [str(h) for h in uh])
    ax.axhline(2.0, color="crimson", ls="--", lw=1, label="λ = 2 (unit step descends below)")
    ax.set_yscale("log")
    ax.set_xlabel("head")
    ax.set_ylabel(f"λ_max(H_i), {space} space, over contexts × queries")
    ax.set_title(f"Layer {layer}: curvature of the gradient-step objective")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def write_report_dir(out: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Create or replace the directory ``out`` atomically: ``fill(tmp)`` writes every file into
    a fresh sibling directory, which then takes ``out``'s place (the old one is removed only
    after).  A failure leaves ``out`` as it was (and removes a parent this call created).
    Every report command writes through this (``report.json`` first, then what is rendered)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} exists and is not a directory")
    parent = out.parent  # Path("rep").parent is Path(".")
    made_parent = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes 0700; a report directory is an ordinary one
    try:
        fill(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.rmdir(old)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_parent:
            try:
                parent.rmdir()  # only if still empty
            except OSError:
                pass
        raise
    return out


def write_rendered(out: str | os.PathLike, result: dict, render_md: Callable[[dict], str],
                   render_figs: Callable[[dict, Path], Any] | None = None,
                   figures: bool = True) -> Path:
    """``report.json`` (indented), then ``report.md = render_md(result)`` and, when asked and
    there is something to draw (``result["layers"]``), ``render_figs(result, out/figures)``:
    atomically into ``out`` (:func:`write_report_dir`).  The atlas, heads and train-families
    commands write through this."""
    draw = render_figs if figures and result.get("layers") else None
    return write_report_dir(out, lambda tmp: fill_rendered(tmp, result, render_md, draw))


def fill_rendered(directory: Path, result: dict, render_md: Callable[[dict], str],
                  render_figs: Callable[[dict, Path], Any] | None = None) -> None:
    """Write ``report.json``, ``report.md`` and, with ``render_figs``, ``figures/`` into an
    existing ``directory``: the files of :func:`write_rendered`, for a caller that builds the
    directory itself (train-families adds its checkpoints)."""
    (directory / "report.json").write_text(dumps(result), encoding="utf-8")
    (directory / "report.md").write_text(render_md(result), encoding="utf-8")
    if render_figs is not None:
        render_figs(result, directory / "figures")


def write_report(result: dict, out: str | os.PathLike, figures: bool = True) -> Path:
    """Write ``report.json``, ``report.md`` and ``figures/`` atomically into ``out``."""
    def fill(tmp: Path) -> None:
        (tmp / "report.json").write_text(dumps(result), encoding="utf-8")
        figs = render_figures(result, tmp / "figures") if figures else {}
        (tmp / "report.md").write_text(render_markdown(result, figs), encoding="utf-8")

    return write_report_dir(out, fill)
