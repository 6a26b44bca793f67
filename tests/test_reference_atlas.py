"""``ropestep atlas``'s ``report.json``, leaf by leaf, against :mod:`ropestep.reference.atlas`,
the independent recomputation from the raw dump (``--dump-raw``; docs/protocol.md section 11).

Every leaf of the report is accounted for: recomputed by the reference and compared under a
tolerance derived for its kind of statistic (``HEAD_FIELDS`` and :class:`Derived`), an echo of the
dumped run description (equal to it), or one of the few leaves of ``EXEMPT``, each with its
reason.  A leaf that is none of these fails, so a field added to the report without a reference
fails.  Counts and flags must be equal, which needs every decision behind them to lie clear of
its threshold by more than the two sides' rounding: :func:`undecided` checks that on the data
(a rank correlation instead gets the tolerance of the ranks that may swap).
Planted one-line bugs in atlas's statistics (``MUTANTS``) must each turn the comparison red.

The model: a tiny seeded Qwen2 (4 query heads on 2 KV heads, head_dim 16, hidden 64, q/k/v
biases) with weights drawn so that attention is far from uniform, and one planted head: head 0's
scores all sit near -23 (a large key bias against a small query bias in the slowest RoPE pair), so
its original-gauge kappa straddles the level where the float64 readout stops resolving the
model's output and ``original_gauge_unresolved_queries`` is neither 0 nor everything.
"""
from __future__ import annotations

import functools
import json
import math
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from ropestep import atlas, layercheck, tolerances as tol
from ropestep.reference import atlas as reference
from ropestep.report import load
from reference_walk import save_bpe_tokenizer, leaves, at, has, field_key, differences
from reference_walk import assert_refuses_each

pytestmark = pytest.mark.model

HEAD_DIM, HIDDEN, HEADS, KV_HEADS = 16, 64, 4, 2
SLOW = HEAD_DIM // 2 - 1  # the slowest RoPE pair's first dimension (split-half layout)
# head 0's planted bias (slowest pair): score offset -Q_BIAS * K_BIAS / sqrt(d) = -23, and its
# content weights scaled down so that the offset, not the content, sets its scores' level
Q_BIAS, K_BIAS, HEAD0_CONTENT = 2.3, 40.0, 0.1
TINY_ARGS = ["--contexts", "2", "--len", "48", "--layers", "all", "--anchor-every", "16",
             "--seed", "3"]


# ---------------------------------------------------------------------------------------------
# the model and the runs
# ---------------------------------------------------------------------------------------------
def build_model(path: Path, seed: int = 0) -> Path:
    """Save a byte-level BPE tokenizer (trained on the bundled text) and the seeded Qwen2 of the
    module docstring to ``path``."""
    transformers = pytest.importorskip("transformers")
    vocab = save_bpe_tokenizer(path)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for blk in model.model.layers:
            a = blk.self_attn
            for lin, std in ((a.q_proj, 0.25), (a.k_proj, 0.25), (a.v_proj, 0.2),
                             (a.o_proj, 0.1)):
                lin.weight.normal_(0.0, std, generator=g)
            for lin, std in ((a.q_proj, 0.5), (a.k_proj, 0.5), (a.v_proj, 0.2)):
                lin.bias.normal_(0.0, std, generator=g)
            a.q_proj.weight[:HEAD_DIM] *= HEAD0_CONTENT
            a.q_proj.bias[SLOW], a.k_proj.bias[SLOW] = -Q_BIAS, K_BIAS
            # head 1 shares KV head 0: keep it off the planted key dimension
            a.q_proj.weight[HEAD_DIM + SLOW], a.q_proj.bias[HEAD_DIM + SLOW] = 0.0, 0.0
    model.save_pretrained(path)
    return path


@dataclass
class Case:
    argv: list[str]  # the atlas command line (without --out and --dump-raw)
    out: Path  # the report directory
    report: dict
    ref: reference.Reference
    seconds: dict


def run_case(root: Path, args: list[str]) -> Case:
    """Atlas with ``--dump-raw``, then the reference on the dump."""
    argv = [*args, "--quiet", "--no-figures"]
    t0 = time.perf_counter()
    assert atlas.main([*argv, "--out", str(root / "atlas"), "--dump-raw", str(root / "raw")]) == 0
    t1 = time.perf_counter()
    ref = reference.recompute(root / "raw", maxkey_tie=tol.MAXKEY_TIE_LOWP)
    t2 = time.perf_counter()
    return Case(argv, root / "atlas", load(root / "atlas" / "report.json"), ref,
                {"atlas": t1 - t0, "reference": t2 - t1})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("reference_atlas")
    return run_case(root, ["--model", str(build_model(root / "model")), *TINY_ARGS])


# ---------------------------------------------------------------------------------------------
# the leaves and their classes
# ---------------------------------------------------------------------------------------------


EXEMPT = {  # leaves not computed from the data, with the reason
    ("schema",): "the format's name, a constant of the code",
    ("environment",): "versions and hardware of the machine that ran it",
    ("timing_seconds",): "wall-clock timings",
    ("peak_rss_mib",): "the process's peak resident memory",
    ("run",): "the process layout: world size, each rank's items and timings",
    ("cost", "matmul_flops_per_s"): "this machine's GEMM rates, measured (what is derived "
                                    "from them and the timers: COST_DERIVED)",
    ("replication_style_descent", "space"): "a label",
    ("replication_style_descent", "query"): "a label",
}
SHAPES = ("n_heads", "n_kv_heads", "head_dim", "hidden")  # model sizes: the dumped weights' shapes
ECHOES = ("command", "config", "model", "corpus", "contexts")  # equal to the dump's manifest
RECOMPUTED = ("layers", "replication_style_descent", "verdict")


COST_FLOPS = ("cost", "phases", "*", "flops")  # section 11, `cost`: reference.counted_flops
# every other leaf of `cost` (the phases' seconds summed over the processes' timers, rates,
# fractions, the floor, the forwards' time and the ratios): reference.cost_section, from the
# report's own timers (`run`), rates and counts; equal up to the order of a few float64 sums
COST_DERIVED = ("cost",)


def leaf_class(path: tuple) -> str:
    """``exempt``, ``echo``, ``counted`` or ``recomputed`` (the reference has the leaf), else
    ``unknown``."""
    if len(path) == 4 and all(p in ("*", q) for p, q in zip(COST_FLOPS, path)):
        return "counted"
    if any(path[:len(p)] == p for p in EXEMPT):
        return "exempt"
    if path[:1] == COST_DERIVED:
        return "cost"
    if path[0] == "model" and path[1] in SHAPES or path[0] in RECOMPUTED:
        return "recomputed"
    if path[0] in ECHOES:
        return "echo"
    return "unknown"


def head_field(path: tuple) -> Callable | None:
    """The tolerance of a head leaf: its own field's, else its parent's ``*`` entry
    (``kappa_original/*`` for ``kappa_original/median``)."""
    key = field_key(path)
    return HEAD_FIELDS.get(key, HEAD_FIELDS.get(key.rpartition("/")[0] + "/*"))


# ---------------------------------------------------------------------------------------------
# tolerances, derived per kind of statistic
# ---------------------------------------------------------------------------------------------
class Derived:
    """The tolerances of one (layer, head): from :mod:`ropestep.tolerances`, the run's sizes and
    the reference's per-query rows (docs/protocol.md section 11 names every symbol used)."""

    def __init__(self, ref: reference.Reference, layer: int, head: int | None = None):
        facts = ref.manifest["layers"][str(layer)]
        self.N = ref.manifest["config"]["length"]
        self.d, self.m, self.r = facts["head_dim"], facts["hidden"], facts["r"]
        # two evaluations of the same quantity from the same inputs, one of them forming its
        # terms in the augmented input space: the whole-layer agreement level (kappa = O(1))
        self.a64 = tol.agreement_rel_tol(torch.float64, self.N, self.d, self.m)
        self.a32 = tol.agreement_rel_tol(torch.float32, self.N, self.d, self.m)
        heads = [head] if head is not None else range(facts["n_heads"])
        self.R = {k: np.concatenate([ref.rows[(layer, h)][k] for h in heads])
                  for k in reference.ROW_FIELDS}

    # -- errors of the fast side's readouts against the exact values (per query, absolute) --
    def readout(self, kind: str) -> np.ndarray:
        """The fast side's max-key (``nat``), original-gauge (``orig``) or model-dtype (``lp``)
        readout against the exact output, per query: its own rounding, a sum of condition
        ``kappa`` (tolerances.identity_check_tol, relative to the value scale), plus the
        rounding of its projections and scores, which moves the output as a condition-1
        function (the agreement level of its arithmetic, hidden = m)."""
        R = self.R
        dtype, level, kap = {"nat": (torch.float64, self.a64, R["kappa_mk_hi"]),
                             "orig": (torch.float64, self.a64, R["kappa"]),
                             "lp": (torch.float32, self.a32, R["kappa_mk_hi"])}[kind]
        return (tol.identity_check_tol(dtype, kap, R["n"], self.d, R["sigma"]) + level) * R["V"]

    def identity(self, dtype: torch.dtype) -> np.ndarray:
        """``e^id`` / ``e^lpid`` per query, relative to the value scale: two sums of one
        arithmetic compared (tolerances.identity_check_tol), exact value 0."""
        R = self.R
        kap = R["kappa"] if dtype == torch.float64 else R["kappa_mk_hi"]
        return tol.identity_check_tol(dtype, kap, R["n"], self.d, R["sigma"])

    def bound(self, kind: str) -> np.ndarray:
        """The reference's bound of each query (``kappa*`` at its smallest candidate)."""
        return reference.bounds(self.R, self.R["kappa_mk_lo"], self.d, self.m)[kind]

    # -- per kind of field --
    def native_rel(self, kind: str) -> float:
        """``max_c max_i e_i / Y_c``: each ``e_i`` within the readout's error of the exact one."""
        return float(np.max(self.readout(kind) / self.R["Y"]))

    def ratio(self, kind: str) -> float:
        """``max_i e_i / b_i``: the numerator within the readout's error, the bound within its
        kappa's agreement level (kappa* is evaluated in float32 by atlas: a32; kappa in float64)."""
        b, e = self.bound(kind), self.R["e_nat"]
        eps_b = self.a64 if kind == "orig" else self.a32
        return float(np.max(self.readout(kind) / b + e / b * eps_b))

    def stat(self, field: str, level: float) -> float:
        """A max, median or mean of per-query float64 values that each agree within ``level``
        relative to the set's largest magnitude (order statistics are 1-Lipschitz in the sup
        norm; a mean too)."""
        return level * float(np.max(np.abs(self.R[field])))

    def eigen(self, value: float) -> float:
        """A largest eigenvalue of ``H = sum_j c_j a_j a_j^T`` (rank <= d), or a median or max of
        them: entry ``(j, k)`` of either side's matrix (atlas's ``d x d`` form, the reference's
        Gram matrix of the weighted features) errs by at most the agreement level times
        ``sqrt(H_jj H_kk)``, so the matrix by at most that level times its trace, which is at
        most ``d lambda_max``; by Weyl ``lambda_max`` moves by at most ``d a64`` relative to
        itself, and a median or max of values known to a relative level is known to it too."""
        return self.d * self.a64 * abs(value)

    def reuse_rows(self) -> dict[str, np.ndarray]:
        """The non-anchor rows with the 2-norm error bounds of ``y_i - y^fr_i`` (``dfr``) and of
        ``y_i - y_a``, ``y_i - mu_i`` (``dy``): softmax outputs and means are condition-1 sums
        (a64 V per component), the frozen readout has its own kappa; sqrt(r) turns a componentwise
        bound into a Euclidean one."""
        sel = self.R["anchor"] == 0
        R = {k: v[sel] for k, v in self.R.items()}
        root_r = math.sqrt(self.r)
        R["dy"] = root_r * 2 * self.a64 * R["V"]
        R["dfr"] = root_r * (self.a64 * R["V"]
                             + self.a64 * np.maximum(1.0, R["kappa_fr"]) * R["V"])
        return R

    def rrmse(self, den: str) -> float:
        """``sqrt(sum fr / sum den)``: norms of the stacked error vectors, each within the
        stacked bounds; plus both sides' rounding of the sums, square root and quotient
        (non-negative operands: nonnegative_ops_rel, as tests/test_atlas.py derives)."""
        R = self.reuse_rows()
        num, dn = math.sqrt(R["fr"].sum()), math.sqrt(R[den].sum())
        value = num / dn
        d_num, d_den = float(np.linalg.norm(R["dfr"])), float(np.linalg.norm(R["dy"]))
        own = 2 * tol.nonnegative_ops_rel(int(R["fr"].size) + 2)
        return (d_num + value * d_den) / dn + own * value

    def eps_err(self, R: dict[str, np.ndarray]) -> np.ndarray:
        """``eps_i = |y - y^fr| / |y - mu|`` per row: both norms within their bounds, plus both
        sides' rounding of the r-term sums of squares, two square roots and the quotient."""
        den = np.sqrt(R["me"])
        own = 2 * tol.nonnegative_ops_rel(self.r + 3) * R["eps"]
        return (R["dfr"] + R["eps"] * R["dy"]) / den + own

    def eps_median(self) -> float:
        return float(np.max(self.eps_err(self.reuse_rows())))

    def bin_rows(self, k: int) -> dict[str, np.ndarray]:
        R = self.reuse_rows()
        q = np.quantile(R["tv"], [0.0, 0.25, 0.5, 0.75, 1.0])
        inside = (R["tv"] >= q[k]) & (R["tv"] <= q[k + 1])
        return {key: v[inside] for key, v in R.items()}

    def bin_median(self, k: int) -> float:
        return float(np.max(self.eps_err(self.bin_rows(k))))

    def tv_quantile(self) -> float:
        """``tv_i = 1/2 sum_j |p_ij - p_aj|``: every weight within a64 of its value, the rows
        summing to 1, so ``|d tv| <= a64``; a linear interpolation ``x_k + f (x_k+1 - x_k)``
        moves by at most 3 times the largest change of its data."""
        return 3 * self.a64

    def spearman(self, value: float) -> float:
        """Pearson correlation of ordinal ranks: ``sum_i ra_i rb_i`` over the fixed
        ``sqrt(sum ra^2 sum rb^2)`` (a permutation's).  A row's rank can move by at most the
        number ``k_i`` of rows whose value may swap with it within the two sides' errors, and a
        centred rank is at most ``(n - 1)/2``, so the numerator moves by at most
        ``sum_i ((ka_i + kb_i)(n - 1)/2 + ka_i kb_i)``; with equal ranks both sides are the same
        quotient of exact integer sums, each rounded twice (square root, quotient)."""
        R = self.reuse_rows()
        ka = swappable(R["eps"], self.eps_err(R))
        kb = swappable(R["tv"], np.full(R["tv"].size, self.a64))
        n = R["tv"].size
        moved = float(np.sum((ka + kb) * (n - 1) / 2 + ka * kb))
        return moved / (n * (n * n - 1) / 12) + 2 * tol.nonnegative_ops_rel(2) * abs(value)


def swappable(x: np.ndarray, err: np.ndarray) -> np.ndarray:
    """For each value, how many others lie within the two values' errors of it."""
    close = np.abs(x[:, None] - x[None, :]) <= err[:, None] + err[None, :]
    return close.sum(axis=1) - 1


def exact(D: Derived, path: tuple, value: Any) -> float:
    """Counts, flags, indices, fractions of counts (one correctly rounded division on both
    sides), and the maximum of the same float32 numbers: equal."""
    return 0.0


def formula(D: Derived, path: tuple, value: Any) -> float:
    """``A(N) = 10 (N + d + m + 8 + ln F) 2^-24``: four additions and two products of
    non-negative numbers and ``ln F`` (within an ulp), on each side: 2 gamma_7 apart."""
    return 2 * tol.nonnegative_ops_rel(7) * abs(value)


HEAD_FIELDS: dict[str, Callable[[Derived, tuple, Any], float]] = {
    "head": exact, "passed": exact, "checks/*": exact,
    "original_gauge_unresolved_queries": exact,
    "step_increases_E_query_space": exact, "step_increases_E_input_space": exact,
    "reuse/n_queries": exact, "reuse/by_tv_quartile/*/n": exact, "native_scale": exact,
    "float64_vs_native_tol": formula, "model_dtype_vs_native_kappa_blind_tol": formula,
    # rounding errors of the fast side: the reference's exact value is 0
    "identity_float64_rel_max": lambda D, p, v: float(np.max(D.identity(torch.float64))),
    "identity_float64_bound_ratio_max":
        lambda D, p, v: float(np.max(D.identity(torch.float64) / D.bound("id"))),
    "model_dtype_identity_rel": lambda D, p, v: float(np.max(D.identity(torch.float32))),
    # the model's own output against the readouts
    "float64_vs_native_rel": lambda D, p, v: D.native_rel("nat"),
    "float64_original_gauge_vs_native_rel": lambda D, p, v: D.native_rel("orig"),
    "model_dtype_vs_native_rel": lambda D, p, v: D.native_rel("lp"),
    "float64_vs_native_bound_ratio_max": lambda D, p, v: D.ratio("nat"),
    "float64_original_gauge_bound_ratio_max": lambda D, p, v: D.ratio("orig"),
    "model_dtype_vs_native_bound_ratio_max": lambda D, p, v: D.ratio("lp"),
    # float64 statistics of per-query values (kappa* in float32 by atlas)
    "kappa_original/*": lambda D, p, v: D.stat("kappa", D.a64),
    "kappa_maxkey/*": lambda D, p, v: D.stat("kappa_mk_hi", D.a32),
    "spread/*": lambda D, p, v: D.stat("spread", D.a64),
    "sink_mass/*": lambda D, p, v: D.stat("sink", D.a64),
    "lambda_max_query_space/*": lambda D, p, v: D.eigen(v),
    "lambda_max_input_space/*": lambda D, p, v: D.eigen(v),
    "value_scale": lambda D, p, v: D.stat("V", D.a64),
    # frozen reuse
    "reuse/rrmse_vs_constant_anchor": lambda D, p, v: D.rrmse("co"),
    "reuse/rrmse_vs_cache_mean": lambda D, p, v: D.rrmse("me"),
    "reuse/relative_error_median": lambda D, p, v: D.eps_median(),
    "reuse/spearman_error_vs_tv": lambda D, p, v: D.spearman(v),
    "reuse/by_tv_quartile/*/tv_lo": lambda D, p, v: D.tv_quantile(),
    "reuse/by_tv_quartile/*/tv_hi": lambda D, p, v: D.tv_quantile(),
    "reuse/by_tv_quartile/*/relative_error_median": lambda D, p, v: D.bin_median(p[-2]),
}
REPLICATION_FIELDS = {"increase": exact, "heads": exact,
                      "lambda_max_median": lambda D, p, v: D.eigen(v),
                      "lambda_max_max": lambda D, p, v: D.eigen(v)}


def tolerance(ref: reference.Reference, path: tuple, value: Any,
              derived: Callable[[int, int | None], Derived]) -> float | None:
    """The absolute tolerance of a recomputed leaf; None for a leaf with no derivation."""
    if path[0] == "layers" and path[2] == "heads":
        fn = head_field(path[4:])
        return None if fn is None else fn(derived(int(path[1]), path[3]), path, value)
    if path[0] == "replication_style_descent":
        fn = REPLICATION_FIELDS.get(path[-1])
        if fn is None or fn is exact:
            return None if fn is None else 0.0
        layers = [int(path[2])] if path[1] == "per_layer" else sorted({L for L, _ in ref.rows})
        return max(fn(derived(L, None), path, value) for L in layers)
    if path[0] in ("layers", "verdict", "model"):  # passed, errors, verdict, sizes: equal
        return 0.0
    return None


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------
def agrees(value: Any, candidates: list[Any], tolerance_abs: float) -> bool:
    """``value`` within ``tolerance_abs`` of the range of the reference's candidates (the
    argmax, smallest and largest kappa* summaries); NaN only against NaN; strings and None
    equal."""
    if any(isinstance(x, (str, type(None))) for x in (value, *candidates)):
        return value in candidates
    if isinstance(value, bool) or any(isinstance(c, bool) for c in candidates):
        return any(value is c for c in candidates)
    vals = [float(c) for c in candidates]
    if math.isnan(float(value)) or any(math.isnan(c) for c in vals):
        return math.isnan(float(value)) and all(math.isnan(c) for c in vals)
    return min(vals) - tolerance_abs <= float(value) <= max(vals) + tolerance_abs


def compare(report: dict, ref: reference.Reference) -> tuple[list[str], dict[str, int]]:
    """Every leaf of ``report`` against the reference: the problems, and how many leaves of each
    class were compared."""
    problems, counts = [], {"recomputed": 0, "echo": 0, "exempt": 0, "counted": 0, "cost": 0}
    counted = reference.counted_flops(ref.manifest)
    cost = reference.cost_section(report) if report.get("cost") is not None else {}
    if report.get("cost") is not None:  # every phase the report times has its count
        phases = report["cost"]["phases"]
        for ph in counted:
            name = ph.replace("lowp", report["config"]["dtype"])
            if name not in phases:
                problems.append(f"cost/phases/{name}: the reference counts {counted[ph]!r}, "
                                "the report has no such phase")
    variants = (ref.report, ref.low, ref.high)
    derived = functools.lru_cache(maxsize=None)(lambda L, h: Derived(ref, L, h))
    for path, value in leaves(report):
        kind = leaf_class(path)
        where = "/".join(map(str, path))
        if kind == "unknown":
            problems.append(f"{where}: neither recomputed, an echo, nor exempt")
            continue
        counts[kind] += 1
        if kind == "counted":  # the same count from the same sizes: equal up to the order of
            # the floating-point sums (at most a few ulps of the total: rel 1e-12 is ample)
            ph = path[2].replace(report["config"]["dtype"], "lowp")
            want = counted.get(ph)
            if want is None or abs(value - want) > 1e-12 * abs(want):
                problems.append(f"{where}: atlas counts {value!r}, reference {want!r}")
            continue
        if kind == "cost":  # compared as one section below
            continue
        if kind == "echo":
            dumped = at(ref.manifest, path) if has(ref.manifest, path) else "(absent)"
            if dumped != value:
                problems.append(f"{where}: {value!r} is not the dumped run's {dumped!r}")
        elif kind == "recomputed":
            if not has(ref.report, path):
                problems.append(f"{where}: no reference for this leaf")
                continue
            t = tolerance(ref, path, value, derived)
            cands = [at(v, path) for v in variants]
            if t is None:
                problems.append(f"{where}: no tolerance derived for this leaf")
            elif not agrees(value, cands, t):
                problems.append(f"{where}: atlas {value!r}, reference {cands[0]!r} "
                                f"(range {min(cands)!r}..{max(cands)!r}), tolerance {t:.3g}")
    if cost:  # the same sums and quotients in float64, maybe in another order: both ways
        problems += [f"cost/{p} (atlas against recomputed from its timers)"
                     for p in differences(report["cost"], cost, 1e-12)]
    for path, value in leaves({k: ref.report[k] for k in RECOMPUTED}):
        if not has(report, path):
            problems.append(f"{'/'.join(map(str, path))}: the reference has {value!r}, the "
                            "report has no such leaf")
    return problems, counts


def undecided(ref: reference.Reference) -> list[str]:
    """Rows where a decision behind a count lies within the two sides' rounding of its
    threshold: there the counts cannot be compared exactly (choose other data)."""
    out = []
    for (L, h) in sorted(ref.rows):
        D = Derived(ref, L, h)
        R = D.R
        for space in ("q", "in"):  # the unit-step flags: quad vs |B|^2, B with condition cond
            guard = 3 * D.a64 * np.maximum(1.0, R[f"cond_{space}"])
            if np.any(np.abs(R[f"margin_{space}"]) <= guard):
                out.append(f"layer {L} head {h}: a {space}-space step flag within rounding")
        # unresolved queries: b^orig - b^nat against A(N) Y, kappa within a64, kappa* within a32
        # and its tie range
        i64 = tol.identity_check_tol(torch.float64, R["kappa"], R["n"], D.d, R["sigma"]) * R["V"]
        lo, hi = (tol.identity_check_tol(torch.float64, R[k], R["n"], D.d, R["sigma"]) * R["V"]
                  for k in ("kappa_mk_lo", "kappa_mk_hi"))
        gap = np.abs(i64 - lo - reference.model_level(D.N, D.d, D.m) * R["Y"])
        if np.any(gap <= D.a64 * i64 + D.a32 * hi + (hi - lo)):
            out.append(f"layer {L} head {h}: an unresolved-query decision within rounding")
        Q = D.reuse_rows()
        q = np.quantile(Q["tv"], [0.25, 0.5, 0.75])
        near = np.abs(Q["tv"][:, None] - q[None]) <= 2 * D.tv_quantile()
        if np.any(near & (Q["tv"][:, None] != q[None])):
            out.append(f"layer {L} head {h}: a TV value at a quartile boundary")
    return out


def check_case(case: Case) -> dict[str, int]:
    problems, counts = compare(case.report, case.ref)
    open_ = undecided(case.ref)
    print("leaves compared:", counts, "seconds:", case.seconds)
    assert not open_, "\n".join(open_)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])
    return counts


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_every_leaf_of_the_tiny_atlas_is_recomputed(tiny):
    counts = check_case(tiny)
    cfg = tiny.ref.manifest["config"]
    assert (cfg["contexts"], cfg["length"], cfg["anchor_every"], cfg["seed"]) == (2, 48, 16, 3)
    assert counts["recomputed"] > 2 * HEADS * 50  # every head's fields, both layers
    # cost: 4 phases x 4 derived leaves, the work, floor, fraction, forwards and 2 ratios
    assert counts["cost"] == 4 * 4 + 6 and counts["counted"] == 4
    # the planted head makes the unresolved count informative: neither none nor all rows
    unresolved = [lr["heads"][0]["original_gauge_unresolved_queries"]
                  for lr in tiny.report["layers"].values()]
    assert all(0 < u < 96 for u in unresolved), unresolved


def test_the_comparison_flags_unknown_and_missing_leaves(tiny):
    """A field the reference does not know, and a field the report lost, are both failures."""
    grown = json.loads(json.dumps(tiny.report))
    grown["layers"]["0"]["heads"][1]["new_statistic"] = 0.5
    grown["new_block"] = {"x": 1}
    del grown["layers"]["1"]["heads"][2]["spread"]
    problems, _ = compare(grown, tiny.ref)
    text = "\n".join(problems)
    assert "heads/1/new_statistic: no reference" in text
    assert "new_block/x: neither recomputed" in text
    assert "heads/2/spread/median: the reference has" in text


MUTANTS = [  # (the planted bug, the line of atlas.py or layercheck.py, its mutation, a leaf
    # that must disagree)
    ("the replication-style count takes the input-space flag",
     'rep_inc[L].append(res.arrays["inc_query"][:, -1] > 0)',
     'rep_inc[L].append(res.arrays["inc_input"][:, -1] > 0)',
     "replication_style_descent/per_layer/"),
    ("unresolved queries judged against the value scale, not the native scale",
     "* np.repeat(ns, [", "* np.repeat(vs, [", "original_gauge_unresolved_queries"),
    ("the max-key float64 readout compared with the recomputed softmax output, not the "
     "model's own", 'arr["native_abs"][hs[0]:hs[-1] + 1, qi] = (ch.readout - ref)',
     'arr["native_abs"][hs[0]:hs[-1] + 1, qi] = (ch.readout - ch.y)', "float64_vs_native_rel"),
    ("the 45th percentile for a median", "return float(np.median(a)) if a.size else math.nan",
     "return float(np.percentile(a, 45)) if a.size else math.nan", "/median"),
    ("an uncentred cache-mean baseline", 'arr["reuse_mean"][h0:h1, qi] = sq(y - mu[None])',
     'arr["reuse_mean"][h0:h1, qi] = sq(y)', "reuse/rrmse_vs_cache_mean"),
    ("the input-space step test without its 1/2", "inc = 0.5 * (Y * (M @ Y))",
     "inc = (Y * (M @ Y))", "step_increases_E_input_space"),
    ("the work counted for one token fewer per context",
     "N = int(next(iter(res.arrays.values())).shape[1])",
     "N = int(next(iter(res.arrays.values())).shape[1]) - 1", "cost/phases/"),
    ("the work counted without the input-space problem",
     "H_kv=spec.n_kv_heads, affine=spec.affine,", "H_kv=spec.n_kv_heads, affine=False,",
     "cost/phases/float64_original"),
]


def mutated_module(old: str, new: str, monkeypatch) -> types.ModuleType:
    """``ropestep.atlas`` with one line replaced, as a module of its own -- or, where the line is
    in the layer evaluation the atlas computes through (``ropestep.layercheck``, reached via
    ``ropestep.api``), the atlas with a mutated ``layercheck`` patched into it and the API."""
    from ropestep import api

    owner = next((m for m in (atlas, layercheck)
                  if Path(m.__file__).read_text(encoding="utf-8").count(old) == 1), None)
    assert owner is not None, f"the planted line is not in atlas.py or layercheck.py exactly once: {old!r}"
    src = Path(owner.__file__).read_text(encoding="utf-8")
    mod = types.ModuleType(f"ropestep._{owner.__name__.rsplit('.', 1)[-1]}_mutant")
    mod.__file__, mod.__package__ = owner.__file__, "ropestep"
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # dataclasses look their module up
    exec(compile(src.replace(old, new), owner.__file__, "exec"), mod.__dict__)
    if owner is atlas:
        return mod
    monkeypatch.setattr(api, "layercheck", mod)
    monkeypatch.setattr(atlas, "layercheck", mod)
    return atlas


@pytest.mark.parametrize("bug, old, new, leaf", MUTANTS, ids=[m[0][:40] for m in MUTANTS])
def test_a_planted_bug_turns_the_comparison_red(tiny, tmp_path, monkeypatch, bug, old, new, leaf):
    mod = mutated_module(old, new, monkeypatch)
    # the same directory names as the original run, so that the command line echoes match
    out = [*tiny.argv, "--out", str(tmp_path / "atlas"), "--dump-raw", str(tmp_path / "raw")]
    assert mod.main(out) in (0, 1)
    problems, _ = compare(load(tmp_path / "atlas" / "report.json"), tiny.ref)
    print(bug, len(problems), problems[:3])
    assert any(leaf in p for p in problems), f"{bug}: no disagreement at {leaf}"


def test_two_real_smollm2_contexts(tmp_path):
    """The same comparison on the real SmolLM2-135M (no biases, 9 heads on 3 KV heads), first
    and last layer, two contexts of the bundled corpus."""
    from ropestep import models

    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    case = run_case(tmp_path, ["--model", "smollm2", "--contexts", "2", "--len", "64",
                               "--layers", "0,29", "--anchor-every", "16"])
    check_case(case)


def test_the_dump_changes_nothing_in_the_report(tiny, tmp_path, capsys):
    """Without ``--dump-raw`` the report is the same (command line aside); a ``--dump-raw`` that
    names a file is bad input (exit 2, one line)."""
    assert atlas.main([*tiny.argv, "--out", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert atlas.same_report(plain, json.loads((tiny.out / "report.json").read_text()))
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert atlas.main([*tiny.argv, "--out", str(tmp_path / "bad"),
                       "--dump-raw", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_the_reference_refuses_what_it_does_not_model(tmp_path):
    """A dump whose layer is of another score family, or whose score has a window, chunks, a
    soft-cap, sinks, clipped projections, ALiBi or a query temperature, is refused in one line: the reference's projections
    have none of these, so it would recompute another head and disagree for the wrong reason."""
    base = {"n_heads": 2, "n_kv_heads": 1, "head_dim": 4, "r": 4, "hidden": 8,
            "layout": "half", "family": "dot", "window": None, "chunk": None, "softcap": None,
            "sinks": False, "clip": None}
    cases = {"family": ("qknorm", "of the 'qknorm' family"), "window": (16, "has window"),
             "chunk": (8, "has chunk"), "softcap": (30.0, "has softcap"),
             "sinks": (True, "has sinks"), "clip": (2.0, "has clip"),
             "alibi": (True, "has alibi"), "query_temperature": ([8.0, 0.1],
                                                                 "has query_temperature")}
    assert_refuses_each(reference, base, cases, tmp_path)
