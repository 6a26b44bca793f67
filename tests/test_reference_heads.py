"""``ropestep heads``' ``report.json``, leaf by leaf, against :mod:`ropestep.reference.heads`,
the independent recomputation from the raw dump (``--dump-raw``; docs/protocol.md section 13).

Every leaf of the report is accounted for: recomputed by the reference and compared under a
tolerance derived for its kind of quantity (:func:`tolerance_tree`, one tolerance per numeric
leaf, in the report's shape), an echo of the dump's manifest (``command``, ``config`` and the
model's description: equal), or one of the leaves of ``EXEMPT``, each with its reason.  A leaf
that is none of these fails, and so does a leaf the reference has and the report lacks.
Integers, flags and labels must be equal; the two fractions that count decisions (``cond < 10``,
``t < 1/2``) and the orientation of the frequency axis are compared exactly after
:func:`undecided` has checked that every decision lies clear of its threshold by more than the
two sides' tolerance.  Planted one-line bugs in ``ropestep.heads`` and ``ropestep.rope``
(``MUTANTS``) must each turn the comparison red.

The model: a tiny seeded Qwen2 (4 query heads on 2 KV heads, head_dim 16, hidden 64), float32,
whose W_q/W_k heads are made to differ (in every layer, :func:`plant`): query head 0 has
singular values spread geometrically over five decades (cond ~1e5), query head 1 is rank 3 plus
1e-6 noise (cond ~1e6, effective rank ~3-4), query head 2 keeps its energy in the two slowest
RoPE pairs (band 3, ``t`` near 1) and KV head 0 in the two fastest (band 0); query head 3 and
KV head 1 stay Gaussian.  The same comparison runs on the real SmolLM2-135M (two layers; skipped
without its packaged GGUF file), on tiny models of other architectures (``ZOO``: scaled RoPE,
partial rotary, interleaved pairing, QK-norm) and on train-families checkpoints (no model
tables; per-head bases).
"""
from __future__ import annotations

import math
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ropestep import cli, heads, rope
from ropestep import tolerances as tl
from ropestep.reference import heads as reference
from ropestep.report import dumps, load
from ropestep.verdict import loads
from reference_walk import agrees, at, has, leaves, missing_from
from reference_walk import one_torch_thread  # noqa: F401  (autouse, module scope)

pytestmark = pytest.mark.model

HEAD_DIM, HIDDEN, HEADS, KV_HEADS, LAYERS = 16, 64, 4, 2, 2
PAIRS = HEAD_DIM // 2
U = tl.unit_roundoff(torch.float64)  # 2^-53


# ---------------------------------------------------------------------------------------------
# the model and the runs
# ---------------------------------------------------------------------------------------------
def with_spectrum(rng: np.random.Generator, sigma: np.ndarray) -> np.ndarray:
    """An ``(m, d)`` matrix with singular values ``sigma`` (orthonormal factors from QR)."""
    u, _ = np.linalg.qr(rng.standard_normal((HIDDEN, HEAD_DIM)))
    v, _ = np.linalg.qr(rng.standard_normal((HEAD_DIM, HEAD_DIM)))
    return u @ np.diag(sigma) @ v.T


def in_pairs(rng: np.random.Generator, pairs: tuple[int, ...], inside: float = 1.0,
             outside: float = 0.02) -> np.ndarray:
    """Gaussian ``(m, d)`` columns scaled by ``inside`` on the split-half RoPE pairs ``pairs``
    (dims ``l`` and ``l + d/2``), by ``outside`` elsewhere."""
    w = rng.standard_normal((HIDDEN, HEAD_DIM)) * outside
    for ell in pairs:
        for c in (ell, ell + PAIRS):
            w[:, c] *= inside / outside
    return w


def plant(a: Any, seed: int) -> None:
    """Give one attention module the heads of the module docstring (math layout ``(m, d)``
    written into the ``Linear`` rows of each head)."""
    rng = np.random.default_rng(seed)
    q = {0: with_spectrum(rng, np.geomspace(1.0, 1e-5, HEAD_DIM)),
         1: with_spectrum(rng, np.r_[1.0, 0.7, 0.4, np.full(HEAD_DIM - 3, 1e-6)]),
         2: in_pairs(rng, (PAIRS - 2, PAIRS - 1)),
         3: 0.2 * rng.standard_normal((HIDDEN, HEAD_DIM))}
    k = {0: in_pairs(rng, (0, 1)), 1: 0.2 * rng.standard_normal((HIDDEN, HEAD_DIM))}
    for lin, mats in ((a.q_proj, q), (a.k_proj, k)):
        for h, w in mats.items():
            lin.weight[h * HEAD_DIM:(h + 1) * HEAD_DIM] = torch.as_tensor(w.T, dtype=torch.float32)


def build_model(path: Path, seed: int = 0) -> Path:
    """Save the seeded tiny Qwen2 of the module docstring to ``path`` (no tokenizer: heads
    reads weights only)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for L, blk in enumerate(model.model.layers):
            plant(blk.self_attn, seed + 10 * L)
    model.save_pretrained(path)
    return path


@dataclass
class Case:
    argv: list[str]  # the heads options (model included; without --out and --dump-raw)
    out: Path
    raw: Path
    report: dict
    ref: dict
    seconds: dict


def run_case(root: Path, args: list[str]) -> Case:
    """``ropestep heads`` with ``--dump-raw``, then the reference on the dump."""
    argv = [*args, "--quiet", "--no-figures"]
    t0 = time.perf_counter()
    assert cli.main(["heads", *argv, "--out", str(root / "heads"),
                     "--dump-raw", str(root / "raw")]) == 0
    t1 = time.perf_counter()
    ref = reference.recompute(root / "raw")
    t2 = time.perf_counter()
    return Case(argv, root / "heads", root / "raw", load(root / "heads" / "report.json"), ref,
                {"heads": t1 - t0, "reference": t2 - t1})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("reference_heads")
    return run_case(root, ["--model", str(build_model(root / "model")), "--layers", "all",
                           "--base-min", "500", "--base-max", "2e6"])


# ---------------------------------------------------------------------------------------------
# the leaves and their classes
# ---------------------------------------------------------------------------------------------
EXEMPT = {  # leaves not computed from the data, with the reason
    ("schema",): "the format's name, a constant of the code",
    ("definitions",): "the code's fixed text of the definitions (docs/protocol.md section 13)",
    ("environment",): "versions and hardware of the machine that ran it",
    ("timing_seconds",): "wall-clock timings",
    ("peak_rss_mib",): "the process's peak resident memory",
    ("run",): "which process diagnosed which layers under torchrun (the numbers do not depend "
              "on it: tests/test_distributed.py)",
}
ECHOES = ("command", "config", "model")  # equal to the dump's manifest
SIZES = ("n_heads", "n_kv_heads", "group", "head_dim", "hidden")  # model: from dumped shapes


def leaf_class(path: tuple) -> str:
    if any(path[:len(p)] == p for p in EXEMPT):
        return "exempt"
    if path[0] in ECHOES and not (path[0] == "model" and path[1] in SIZES):
        return "echo"
    return "recomputed"


# ---------------------------------------------------------------------------------------------
# tolerances, derived per kind of quantity
# ---------------------------------------------------------------------------------------------
def gamma(n: int) -> float:
    """``gamma_n`` of ``n`` roundings of non-negative operands (tolerances.nonnegative_ops_rel)."""
    return tl.nonnegative_ops_rel(n)


def svd_delta(w: np.ndarray, sv: np.ndarray) -> float:
    """How far the report's and the reference's singular values of ``w`` may lie apart.

    Each side's LAPACK SVD is backward stable: its singular values are exact for ``W + E`` with
    ``||E||_2 <= max(m, d) eps sigma_max`` (``eps = 2u``; Golub & Van Loan, Matrix
    Computations, section 8.6; the threshold numpy's ``matrix_rank`` uses, here
    :func:`ropestep.tolerances.rank_threshold` with no product term), and by Weyl's inequality
    every singular value moves by at most ``||E||_2``: between the two sides twice that, an
    absolute bound for every ``sigma_k``."""
    return 2.0 * tl.rank_threshold(w.shape, float(sv[0]), 0, 0.0)


def entropy_spread(p: np.ndarray, dp: np.ndarray) -> float:
    """``max |H(p') - H(p)|`` over ``|p'_k - p_k| <= dp_k``, ``H = sum_k f(p_k)``, ``f(x) = -x
    log x``: per term the oscillation of the concave ``f`` on ``[p_k - dp_k, p_k + dp_k]``
    (clipped to ``[0, 1]``; its maximum at ``1/e`` when inside), summed."""
    def f(x):
        return 0.0 if x <= 0.0 else -x * math.log(x)

    total = 0.0
    for pk, d in zip(p, dp):
        lo, hi = max(0.0, pk - d), min(1.0, pk + d)
        vals = [f(lo), f(hi), f(pk)] + ([f(1 / math.e)] if lo < 1 / math.e < hi else [])
        total += max(vals) - min(vals)
    return total


def matrix_tol(w: np.ndarray, layout: str, diag: dict) -> dict:
    """Tolerances of one ``w_q``/``w_k`` record (its reference values in ``diag``).

    * ``sigma_max``, ``sigma_min``: :func:`svd_delta`;
    * ``cond = s_max/s_min``: with both ends within ``delta``, ``|c' - c| <= c (delta/s_min +
      delta/s_max) / (1 - delta/s_min)``, plus each side's rounding of the quotient (``u c``);
    * ``effective_rank``: ``p_k = s_k / S`` moves by at most ``(delta + p_k d delta) / (S - d
      delta)``; the entropy by :func:`entropy_spread`, plus both sides' rounding of the d-term
      entropy sum of logs (``gamma_{d+4} (H + 1)`` each); ``exp`` turns an absolute error ``e``
      of ``H`` into ``erank (e^e - 1)``, plus its own ulp;
    * ``frobenius``, band fractions: sums of squares, no subtraction: ``gamma_n`` relative per
      side with ``n`` their operations (``2 m d + 1`` for the norm; ``4m`` for a pair's
      energy, ``2 m d + d`` for the total and one quotient for a fraction; a coarse band adds
      its ``ceil(d/8)`` additions)."""
    m, d = w.shape
    sv = reference.singular_values(w)
    delta = svd_delta(w, sv)
    smax, smin = float(sv[0]), float(sv[-1])
    assert delta < smin, "a singular value within rounding of 0: cond is undetermined"
    c = smax / smin
    cond = c * (delta / smin + delta / smax) / (1.0 - delta / smin) + 2 * U * c
    S = float(sv.sum())
    p = sv / S
    dp = (delta + p * d * delta) / (S - d * delta)
    H = math.log(diag["effective_rank"])
    e = entropy_spread(p, dp) + 2 * gamma(d + 4) * (H + 1.0)
    erank = diag["effective_rank"] * (math.expm1(e) + 2 * U)
    n_frac = 4 * m + 2 * m * d + d + 1
    frac = [2 * gamma(n_frac) * f for f in diag["band_energy_fraction"]]
    n_coarse = n_frac + math.ceil(d / 2 / reference.N_COARSE)
    coarse = [2 * gamma(n_coarse) * f for f in diag["coarse_band_fraction"]]
    return {"cond": cond, "effective_rank": erank, "sigma_max": delta, "sigma_min": delta,
            "frobenius": 2 * gamma(2 * m * d + 1) * diag["frobenius"],
            "band_energy_fraction": frac, "coarse_band_fraction": coarse}


def barycenter_tol(m: int, d: int, t: float) -> float:
    """``t = num/den``: both sums of non-negative terms (column norms: ``2m`` operations, their
    sum and the position's quotient: 3 more, then ``d`` additions), ``gamma_{4m + 2d + 5}``
    relative per side, both sides."""
    return 2 * gamma(4 * m + 2 * d + 5) * t


def base_tol(t: float, dt: float, lo: float, hi: float, b: float) -> float:
    """``b(t) = lo^(1-t) hi^t``: ``db/dt = b log(hi/lo)`` carries the barycenter's tolerance;
    the report evaluates ``exp((1-t) log lo + t log hi)`` (tolerances.exp_of_sum_rel of its two
    logs' terms), the reference rounds an mpmath value once (``u``)."""
    own = tl.exp_of_sum_rel(abs((1 - t) * math.log(lo)) + abs(t * math.log(hi)), 2) + U
    return b * math.log(hi / lo) * dt + own * b


def sketch_tol(m: int, d: int, s: float) -> float:
    """The sketch ``sum imp idx / (sum imp + 1e-8)``: ``2d`` row norms (``2m`` operations each),
    positions ``i/(2d-1)`` (``linspace``: 3 roundings), their products and sums, and the
    denominator's sum and constant: non-negative throughout, ``gamma_{4m + 4d + 6}`` per side."""
    return 2 * gamma(4 * m + 4 * d + 6) * s


def frequency_tol(fa: dict, base0: float, d: int, tables: bool) -> dict:
    """``omega_l`` read from the tables: both sides take ``atan2`` of the same float64 values
    (the dump holds them exactly).  The report's numpy ``arctan2`` is within 4 ulp (the bound
    numpy states for its vectorised float64 kernels; glibc's is within 1), an ulp is at most
    ``2u`` relative, and the reference rounds a 30-digit mpmath value once (``u``): ``9u
    omega_l``.  The analytic ``base^(-2l/d)``, on the report's side ``pow`` of a rounded
    exponent: the exponent's rounding moves the power by ``u |2l/d log base|`` relative,
    ``pow`` adds at most 1 ulp (``2u``), the reference's rounding ``u``; without tables this is
    also the tolerance of ``omega_l``.  ``max_abs_diff_to_analytic``: both operands within their
    tolerances, plus each side's rounding of the difference (``u`` each)."""
    om = fa["omega"]
    ana = reference.analytic_frequencies(base0, d)
    t_ana = [(abs(2 * ell / d * math.log(base0)) + 3) * U * a for ell, a in enumerate(ana)]
    t_om = [9 * U * abs(w) for w in om] if tables else t_ana
    diff = max(a + b for a, b in zip(t_om, t_ana)) + 2 * U * fa["max_abs_diff_to_analytic"]
    return {"omega": t_om, "omega_pair0": t_om[0], "omega_last": t_om[-1],
            "max_abs_diff_to_analytic": diff if tables else 0.0}


def stats_tol(vals: list[float], tols: list[float], value: dict) -> dict:
    """Order statistics are 1-Lipschitz in the sup norm: median, min and max move by at most the
    largest per-head tolerance; an even count's median is a mean of two (one add, one halving:
    ``2u``)."""
    t = max(tols)
    return {"median": t + 2 * U * abs(value["median"]), "min": t, "max": t}


def mean_tol(rows: list[list[float]], tols: list[list[float]], means: list[float]) -> list[float]:
    """A column mean of ``n`` non-negative values each within its tolerance: the largest of them,
    plus both sides' rounding of the ``n``-term sum and the quotient (``gamma_{n+1}`` each)."""
    n = len(rows)
    return [max(col) + 2 * gamma(n + 1) * mu for col, mu in zip(zip(*tols), means)]


def summary_tol(blocks: list[dict], tols: list[dict], summary: dict) -> dict:
    qh = [h for b in blocks for h in b["query_heads"]]
    kh = [g for b in blocks for g in b["kv_heads"]]
    tq = [h for b in tols for h in b["query_heads"]]
    tk = [g for b in tols for g in b["kv_heads"]]
    out = {}
    for key, rows, trows, get in (
            ("cond_w_q", qh, tq, lambda r: r["w_q"]["cond"]),
            ("cond_w_k", kh, tk, lambda r: r["w_k"]["cond"]),
            ("effective_rank_w_q", qh, tq, lambda r: r["w_q"]["effective_rank"]),
            ("effective_rank_w_k", kh, tk, lambda r: r["w_k"]["effective_rank"]),
            ("barycenter", qh, tq, lambda r: r["barycenter"]),
            ("barycenter_base", qh, tq, lambda r: r["barycenter_base"]),
            ("sketch_barycenter", qh, tq, lambda r: r["sketch_barycenter"])):
        out[key] = stats_tol([get(r) for r in rows], [get(r) for r in trows], summary[key])
    for key, rows, trows, w in (("coarse_band_fraction_w_q_mean", qh, tq, "w_q"),
                                ("coarse_band_fraction_w_k_mean", kh, tk, "w_k")):
        out[key] = mean_tol([r[w]["coarse_band_fraction"] for r in rows],
                            [r[w]["coarse_band_fraction"] for r in trows], summary[key])
    return out


def tolerance_tree(raw: Path, ref: dict) -> dict:
    """The tolerance of every non-exact numeric leaf, in the report's shape (a leaf absent here
    is compared exactly)."""
    manifest, layers = reference.load(raw)
    lo, hi = (float(b) for b in manifest["base_range"])
    out: dict = {"layers": {}}
    for L, lay in layers.items():
        blk = ref["layers"][str(L)]
        lay_out, m, d = lay.facts["layout"], lay.hidden, lay.head_dim
        kv = [{"w_k": matrix_tol(lay.k(g), lay_out, blk["kv_heads"][g]["w_k"])}
              for g in range(lay.n_kv_heads)]
        qh = []
        for h, rec in enumerate(blk["query_heads"]):
            dt = barycenter_tol(m, d, rec["barycenter"])
            qh.append({"w_q": matrix_tol(lay.q(h), lay_out, rec["w_q"]), "barycenter": dt,
                       "barycenter_base": base_tol(rec["barycenter"], dt, lo, hi,
                                                   rec["barycenter_base"]),
                       "sketch_barycenter": sketch_tol(m, d, rec["sketch_barycenter"])})
        t = {"query_heads": qh, "kv_heads": kv,
             "frequency_axis": frequency_tol(blk["frequency_axis"], float(lay.rope_bases[0]), d,
                                             lay.cos is not None)}
        t["summary"] = summary_tol([blk], [t], blk["summary"])
        out["layers"][str(L)] = t
    if layers:
        out["frequency_axis"] = next(iter(out["layers"].values()))["frequency_axis"]
        out["summary"] = summary_tol([ref["layers"][k] for k in out["layers"]],
                                     list(out["layers"].values()), ref["summary"])
    return out


def undecided(ref: dict, tols: dict) -> list[str]:
    """Decisions behind the exactly compared leaves that lie within tolerance of their
    threshold: ``cond < 10`` of every matrix, ``t < 1/2`` of every query head, the order of
    neighbouring ``omega_l`` (``decreasing``, the fastest and slowest pairs)."""
    out = []
    for L, blk in ref["layers"].items():
        tb = tols["layers"][L]
        for rec, tr in zip(blk["query_heads"], tb["query_heads"]):
            if abs(rec["w_q"]["cond"] - reference.COND_SMALL) <= tr["w_q"]["cond"]:
                out.append(f"layer {L} query head {rec['head']}: cond(W_q) undecided at 10")
            if abs(rec["barycenter"] - reference.HALF) <= tr["barycenter"]:
                out.append(f"layer {L} query head {rec['head']}: t undecided at 1/2")
        for rec, tr in zip(blk["kv_heads"], tb["kv_heads"]):
            if abs(rec["w_k"]["cond"] - reference.COND_SMALL) <= tr["w_k"]["cond"]:
                out.append(f"layer {L} KV head {rec['kv_head']}: cond(W_k) undecided at 10")
        om, to = blk["frequency_axis"]["omega"], tb["frequency_axis"]["omega"]
        for ell in range(len(om) - 1):  # equal values known exactly (0 tolerance) are decided
            if 0 < to[ell] + to[ell + 1] and abs(om[ell] - om[ell + 1]) <= to[ell] + to[ell + 1]:
                out.append(f"layer {L}: omega_{ell} and omega_{ell + 1} undecided")
    return out


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------
def compare(report: dict, ref: dict, tols: dict) -> tuple[list[str], dict[str, int]]:
    """Every leaf of ``report`` against ``ref`` (within its tolerance of ``tols``, else exactly),
    each counted by class; a leaf neither exempt nor recomputed, and a recomputed leaf the report
    lacks, are problems."""
    problems: list[str] = []
    counts = {"recomputed": 0, "echo": 0, "exempt": 0}
    for path, value in leaves(report):
        kind = leaf_class(path)
        name = "/".join(map(str, path))
        if kind == "exempt":
            counts[kind] += 1
            continue
        if not has(ref, path):
            problems.append(f"{name}: neither recomputed nor exempt (no reference for {value!r})")
            continue
        want = at(ref, path)
        tol = at(tols, path) if has(tols, path) else 0.0
        if isinstance(tol, (dict, list)):
            problems.append(f"{name}: a leaf where the reference has a subtree")
            continue
        counts[kind] += 1
        if not agrees(value, want, tol):
            problems.append(f"{name}: report {value!r}, reference {want!r}, tolerance {tol:.3g}")
    return problems + missing_from(report, ref), counts


def check_case(case: Case) -> dict[str, int]:
    tols = tolerance_tree(case.raw, case.ref)
    open_ = undecided(case.ref, tols)
    problems, counts = compare(case.report, case.ref, tols)
    print("leaves:", counts, "seconds:", case.seconds)
    assert not open_, "\n".join(open_)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])
    return counts


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_every_leaf_of_the_tiny_heads_report_is_accounted_for(tiny):
    counts = check_case(tiny)
    assert counts["recomputed"] > 400 and counts["echo"] > 20
    # the planted heads make the statistics non-trivial in every layer
    for lr in tiny.report["layers"].values():
        q = lr["query_heads"]
        assert q[0]["w_q"]["cond"] > 1e4 and q[1]["w_q"]["cond"] > 1e5
        assert q[1]["w_q"]["effective_rank"] < 5 and q[3]["w_q"]["effective_rank"] > 14
        assert q[2]["w_q"]["coarse_band_fraction"][-1] > 0.9
        assert lr["kv_heads"][0]["w_k"]["coarse_band_fraction"][0] > 0.9
        assert 0 < lr["summary"]["fraction_cond_w_q_below_10"] < 1
        ts = [h["barycenter"] for h in q]
        assert min(ts) < 0.5 < max(ts)
    assert tiny.report["frequency_axis"]["decreasing"] is True


def test_the_comparison_flags_unknown_and_missing_leaves(tiny):
    """A field the reference does not know, and a field the report lost, are both failures."""
    tols = tolerance_tree(tiny.raw, tiny.ref)
    grown = loads(dumps(tiny.report))
    grown["layers"]["0"]["query_heads"][1]["w_q"]["new_statistic"] = 0.5
    grown["summary"]["new_block"] = {"x": 1}
    del grown["layers"]["1"]["kv_heads"][1]["w_k"]["sigma_min"]
    problems, _ = compare(grown, tiny.ref, tols)
    text = "\n".join(problems)
    assert "query_heads/1/w_q/new_statistic: neither recomputed" in text
    assert "summary/new_block/x: neither recomputed" in text
    assert "kv_heads/1/w_k/sigma_min: the reference has" in text
    assert len(problems) == 3


MUTANTS = [  # (the planted bug, the module, its line, the mutation, a leaf that must disagree)
    ("effective rank with p_k = sigma_k^2 / sum sigma^2", "heads",
     "    p = sv[sv > 0] / total\n", "    p = sv[sv > 0] ** 2 / float((sv ** 2).sum())\n",
     "w_q/effective_rank"),
    ("the coarse bands shifted by one pair", "heads",
     "return [float(b.sum()) for b in np.array_split(f, n)]",
     "return [float(b.sum()) for b in np.array_split(np.roll(f, 1), n)]",
     "coarse_band_fraction"),
    ("the interleaved pairing on a split-half model", "rope",
     "        return c % (head_dim // 2)\n", "        return c // 2\n",
     "band_energy_fraction"),
    ("the barycenter's base interpolation reversed", "rope",
     "return float(math.exp((1.0 - t) * math.log(base_min) + t * math.log(base_max)))",
     "return float(math.exp(t * math.log(base_min) + (1.0 - t) * math.log(base_max)))",
     "/barycenter_base"),
    ("cond from the wrong end: sigma_max / sigma_{d-1}", "heads",
     "    hi, lo = float(sv.max()), float(sv.min())\n",
     "    hi, lo = float(sv.max()), float(np.sort(sv)[1])\n", "w_q/cond"),
    ("the barycenter of a query head with KV head 0's W_k", "heads",
     "q_t, k_t = torch.as_tensor(wq[:, h, :]), torch.as_tensor(wk[:, g, :])",
     "q_t, k_t = torch.as_tensor(wq[:, h, :]), torch.as_tensor(wk[:, 0, :])",
     "query_heads/3/barycenter"),
    ("the frequency axis read at position 0", "heads",
     "c, s = _f64(spec.rope.cos)[1], _f64(spec.rope.sin)[1]",
     "c, s = _f64(spec.rope.cos)[0], _f64(spec.rope.sin)[0]", "frequency_axis/decreasing"),
    ("the summaries' median replaced by the mean", "heads",
     '"median": float(np.median(a))', '"median": float(np.mean(a))', "/median"),
    ("sigma_min read as the second smallest", "heads",
     '"sigma_max": float(sv.max()), "sigma_min": float(sv.min()),',
     '"sigma_max": float(sv.max()), "sigma_min": float(np.sort(sv)[1]),', "w_k/sigma_min"),
    ("the sketch without the key rows", "heads",
     "W = torch.cat([q.T, k.T], dim=0)  # [2 d, m]", "W = torch.cat([q.T, 0 * k.T], dim=0)",
     "/sketch_barycenter"),
    ("the fraction of well-conditioned W_k counted over W_q", "heads",
     '"fraction_cond_w_k_below_10": float(np.mean(np.asarray(ck) < COND_SMALL))',
     '"fraction_cond_w_k_below_10": float(np.mean(np.asarray(cq) < COND_SMALL))',
     "fraction_cond_w_k_below_10"),
]


def mutated(name: str, old: str, new: str, monkeypatch) -> types.ModuleType:
    """``ropestep.<name>`` with one line replaced, as a module of its own."""
    orig = {"heads": heads, "rope": rope}[name]
    src = Path(orig.__file__).read_text(encoding="utf-8")
    assert src.count(old) == 1, f"the planted line is not in {name}.py exactly once: {old!r}"
    mod = types.ModuleType(f"ropestep._{name}_mutant")
    mod.__file__, mod.__package__ = orig.__file__, "ropestep"
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    exec(compile(src.replace(old, new), orig.__file__, "exec"), mod.__dict__)
    return mod


@pytest.fixture(scope="module")
def loaded(tiny):
    """The tiny model as ``heads.run`` loads it."""
    return heads.load(str(tiny.out.parent / "model"))


def rerun(case: Case, loaded_model, module: types.ModuleType = heads) -> dict:
    """The case's run again in process (``module.run`` on the loaded model), as ``report.json``
    reads back."""
    c = case.report["config"]
    result = module.run(str(case.out.parent / "model"), layers=c["layers"],
                        base_range=(c["base_min"], c["base_max"]), loaded=loaded_model,
                        command=case.report["command"])
    result["config"] = c  # the model's path as the command line named it
    return loads(dumps(result))


@pytest.mark.parametrize("bug, name, old, new, leaf", MUTANTS, ids=[m[0][:40] for m in MUTANTS])
def test_a_planted_bug_turns_the_comparison_red(tiny, loaded, monkeypatch, bug, name, old, new,
                                                leaf):
    mod = mutated(name, old, new, monkeypatch)
    if name == "rope":
        monkeypatch.setattr(heads, "rope", mod)
        result = rerun(tiny, loaded)
    else:
        result = rerun(tiny, loaded, mod)
    problems, _ = compare(result, tiny.ref, tolerance_tree(tiny.raw, tiny.ref))
    print(bug, len(problems), problems[:3])
    assert any(leaf in p for p in problems), f"{bug}: no disagreement at {leaf}"


def test_the_unmutated_rerun_agrees(tiny, loaded):
    """The in-process rerun the mutants use agrees with the reference when nothing is planted
    (so each mutant's disagreement is its own)."""
    problems, _ = compare(rerun(tiny, loaded), tiny.ref, tolerance_tree(tiny.raw, tiny.ref))
    assert not problems, "\n".join(problems[:20])


def test_non_finite_diagnostics_reach_both_verdicts(tiny):
    """The data are all finite, so the verdict's failure path is exercised on planted heads, each
    side computing its own records: in layer 0 query head 2 gets a zero W_q (NaN cond,
    effective rank, band energies, barycenter and base) and KV head 1 an infinite condition
    number; in layer 1 KV head 0's W_k gets an inf entry (no SVD: every spectral quantity NaN,
    ``||W||_F`` inf).  The report's :func:`ropestep.heads.failures` and the reference's list
    the same (where, check, value) in the same order."""
    import copy

    _, dumped = reference.load(tiny.raw)
    zero = np.zeros_like(dumped[0].q(2))
    bad = dumped[1].k(0).copy()
    bad[3, 5] = math.inf
    trees = []
    for side in (heads, reference):
        layers = copy.deepcopy(tiny.ref["layers"])
        q2 = layers["0"]["query_heads"][2]
        q2["w_q"] = side.matrix_diagnostics(zero, "half")
        q2["barycenter"] = reference.barycenter(zero, zero, "half")
        q2["barycenter_base"] = math.nan
        layers["0"]["kv_heads"][1]["w_k"]["cond"] = math.inf
        with np.errstate(invalid="ignore"):
            layers["1"]["kv_heads"][0]["w_k"] = side.matrix_diagnostics(bad, "half")
        trees.append(layers)
    got = [f.as_dict() for f in heads.failures(trees[0])]
    want = reference.failures(trees[1])
    assert [(f["where"], f["check"]) for f in got] == [(f["where"], f["check"]) for f in want]
    assert all(a["value"] == b["value"] or math.isnan(a["value"]) and math.isnan(b["value"])
               for a, b in zip(got, want))
    q2, k01, k10 = "layer 0 query head 2", "layer 0 KV head 1", "layer 1 KV head 0"
    assert [(f["where"], f["check"]) for f in want] == [
        (q2, "cond(W_q)"), (q2, "effective rank(W_q)"), (q2, "band energy(W_q)"),
        (q2, "barycenter"), (q2, "barycenter_base"), (k01, "cond(W_k)"),
        (k10, "cond(W_k)"), (k10, "effective rank(W_k)"), (k10, "sigma_max(W_k)"),
        (k10, "sigma_min(W_k)"), (k10, "||W_k||_F"), (k10, "band energy(W_k)")]
    assert want[5]["value"] == math.inf and want[10]["value"] == math.inf


def test_the_dump_changes_nothing_in_the_report(tiny, loaded, tmp_path, capsys):
    """Without ``--dump-raw`` the report is the same (timings, memory and the machine record
    aside: the in-process rerun keeps the test's torch threads, the command set its own); a
    ``--dump-raw`` that names a file is bad input (exit 2, one line, no report)."""
    plain = rerun(tiny, loaded)
    skip = {"timing_seconds", "peak_rss_mib", "environment"}
    assert {k: v for k, v in plain.items() if k not in skip} == \
        {k: v for k, v in tiny.report.items() if k not in skip}
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert cli.main(["heads", *tiny.argv, "--out", str(tmp_path / "bad"),
                     "--dump-raw", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_two_real_smollm2_layers(tmp_path):
    """The same comparison on the real SmolLM2-135M (no biases, 9 heads on 3 KV heads, head_dim
    64, hidden 576), layers 0 and 29, skipped when its packaged GGUF file is absent."""
    from ropestep import models

    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    case = run_case(tmp_path, ["--model", "smollm2", "--layers", "0,29"])
    counts = check_case(case)
    assert counts["recomputed"] > 1000


ZOO = {  # architectures of ropestep.archzoo and what each exercises
    "llama3": "scaled RoPE: the model's tables differ from base^(-2l/d)",
    "phi3": "partial rotary (split-half): pass-through pairs at omega = 0",
    "glm": "partial rotary with interleaved pairing",
    "cohere": "interleaved pairing",
    "qwen3": "QK-norm (family qknorm)",
    "gemma2": "soft-capping and a sliding window (neither enters the diagnostics)",
}


@pytest.mark.parametrize("name", list(ZOO))
def test_the_architecture_zoo(name, tmp_path):
    """The same comparison on tiny random models of other layouts and RoPE forms."""
    from ropestep import archzoo

    d = archzoo.save(name, tmp_path / name)
    case = run_case(tmp_path, ["--model", str(d), "--layers", "all"])
    check_case(case)
    lay = case.report["layers"]["0"]
    assert lay["layout"] == ("interleaved" if name in ("glm", "cohere") else "half")
    assert lay["frequency_axis"]["decreasing"] is (name not in ("phi3", "glm"))


def save_gpt(root: Path, variant: str) -> Path:
    """A seeded ``ropestep.families`` GPT (4 heads on 2 KV heads, head_dim 16, interleaved
    pairing) saved as a train-families checkpoint; the per-head variant gets four distinct bases
    in its range."""
    from ropestep.families import GPT, GPTConfig
    from ropestep.train_families import save_checkpoint

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS,
                          d_model=HIDDEN, head_dim=HEAD_DIM, seq_len=16, variant=variant,
                          layout="interleaved")).eval()
    if variant == "perhead":
        for blk in model.blocks:
            blk.attn.set_bases([2e3, 3e4, 4e5, 9e5])
    save_checkpoint(model, root, {})
    return root / f"{variant}.json"


@pytest.mark.parametrize("variant", ["standard", "cosine", "perhead"])
def test_train_families_checkpoints(variant, tmp_path):
    """``heads`` on a train-families checkpoint: no model tables (the analytic axis of head 0's
    base), the variant's own bases and family."""
    case = run_case(tmp_path, ["--model", str(save_gpt(tmp_path / "ck", variant)),
                               "--layers", "all"])
    check_case(case)
    lay = case.report["layers"]["0"]
    assert lay["frequency_axis"]["source"] == reference.SOURCE_ANALYTIC
    assert lay["family"] == ("cosine" if variant == "cosine" else "dot")
    assert len(set(lay["rope_bases"])) == (4 if variant == "perhead" else 1)
