"""``ropestep train-families``' ``report.json``, leaf by leaf, against
:mod:`ropestep.reference.families`, the independent recomputation from the run's checkpoints
(docs/math.md section 12).

Every leaf of the report is accounted for: recomputed by the reference and compared under a
tolerance derived for its kind of statistic (:func:`tolerance`), an echo of what the checkpoints
record (equal to it), or a record -- a loss, a timing, the environment, a trajectory's interior --
exempt with its reason (``RECORDS``).  A leaf that is none of these fails, so a field added to
the report without a reference fails.  Counts and flags must be equal, which needs every decision
behind them to lie clear of its threshold by more than the two sides' rounding: :func:`undecided`
checks that on the data.  Planted one-line bugs (``MUTANTS``) must each turn the comparison red.

The inputs of the suite's statistics.  The suite reads each layer's attention input from the
trained model's float32 forward; the reference recomputes that forward in float64 from the
held-out token ids in the checkpoint (``reference.capture``).  The two differ by the float32
rounding of the forward, which no statistic's tolerance should have to absorb, so the comparison
runs the reference's statistics on the float32 inputs the suite read (captured here from the
checkpoint with ``GPT.capture``), and :func:`test_the_float32_inputs_are_the_checkpoints_forward`
checks, separately, that the model computes the reference's forward: its float32 inputs within a
first-order bound of the float32 forward's error (:func:`forward_bound`; tight for the first
layer, a worst case far above the measured error after it), and the same model run in float64
within the float64 instance of that bound, which stays meaningful in every layer (planted bugs
in the forward, ``FORWARD_MUTANTS``, exceed it by 10^5 to 10^14).
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

pytest.importorskip("safetensors")

import ropestep  # noqa: E402
from ropestep import families as fm  # noqa: E402
from ropestep import models  # noqa: E402
from ropestep import tolerances as tl  # noqa: E402
from ropestep import train_families as tf  # noqa: E402
from ropestep.corpus import default_corpus_path  # noqa: E402
from ropestep.reference import families as reference  # noqa: E402
from reference_walk import missing_from, agrees, leaves, at, has, matches

U64 = 2.0 ** -53
F64, F32 = torch.float64, torch.float32


def _have_smollm2() -> bool:
    try:
        models.locate_smollm2_gguf()
        import transformers  # noqa: F401
    except (models.ModelLoadError, ImportError):
        return False
    return True


TOKENIZER = "smollm2" if _have_smollm2() else "bytes"
# the --tiny run (5 steps of 2 x 16 tokens) with two layers of four heads of dimension 8, so
# that the deeper layers' inputs, medians over heads and head-index bugs are visible
RUN_ARGS = ["--tiny", "--layers", "2", "--heads", "4", "--tokenizer", TOKENIZER, "--quiet",
            "--no-figures"]


# ---------------------------------------------------------------------------------------------
# the run, the float32 inputs the suite read, the reference
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    out: Path  # the run directory
    report: dict
    ref: reference.Reference
    x32: dict  # x32[variant][sequence][layer]: the suite's inputs (float32 values, float64 arrays)
    seconds: dict


def capture32(out: Path, report: dict, families: types.ModuleType = fm) -> dict:
    """Every layer's attention input as the suite read it: the checkpoint's float32 forward of
    the held-out windows, with the run's thread count (the same arithmetic as the run's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(report["config"]["threads"]))
    try:
        out32 = {}
        for v in fm.VARIANTS:
            info = json.loads((out / "checkpoints" / f"{v}.json").read_text())
            model = families.load_checkpoint(out / "checkpoints" / f"{v}.safetensors")
            seqs = []
            for ids in info["suite_inputs"]["token_ids"]:
                cap = model.capture(torch.tensor([ids], dtype=torch.int64))
                seqs.append([lc.x[0].double().numpy() for lc in cap.layers])
            out32[v] = seqs
        return out32
    finally:
        torch.set_num_threads(threads)


def run_case(root: Path, text: Path, main: Callable = tf.main) -> Case:
    """A tiny train-families run into ``root/families``, then the reference on it."""
    out = root / "families"
    t0 = time.perf_counter()
    code = main([*RUN_ARGS, "--text", str(text), "--out", str(out)])
    assert code in (0, 1)
    t1 = time.perf_counter()
    report = json.loads((out / "report.json").read_text())
    x32 = capture32(out, report)
    ref = reference.recompute(out, report, inputs=x32, maxkey_tie=tl.MAXKEY_TIE_LOWP)
    t2 = time.perf_counter()
    return Case(out, report, ref, x32, {"train_families": t1 - t0, "reference": t2 - t1})


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """The first 20,000 characters of the bundled text: a few thousand tokens."""
    p = tmp_path_factory.mktemp("text") / "slice.txt"
    p.write_text(default_corpus_path().read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, text_file) -> Case:
    return run_case(tmp_path_factory.mktemp("reference_families"), text_file)


# ---------------------------------------------------------------------------------------------
# the leaves and their classes
# ---------------------------------------------------------------------------------------------


RECORDS = {  # leaves that no checkpoint determines, with the reason
    ("schema",): "the format's name, a constant of the code",
    ("command",): "the command line as typed",
    ("config", "optimiser"): "a description of the optimiser, a constant of the code",
    ("config", "attention"): "a description of the attention, a constant of the code",
    ("environment",): "versions and hardware of the machine that ran it",
    ("load_average",): "the machine's load while it ran",
    ("wall_seconds",): "wall-clock timings",
    ("peak_rss_mib",): "the process's peak resident memory",
    ("data",): "the text's and the token streams' provenance (sizes, sha256): a function of the "
               "text and the tokenizer, not of the checkpoints (the held-out windows the suite "
               "read are compared as echoes, data/check_windows)",
    ("variants", "*", "train_loss"): "per-step training losses: a function of every step's "
                                     "weights and batch, which no checkpoint holds",
    ("variants", "*", "val_loss"): "validation losses: of the initial and intermediate weights "
                                   "(not saved) and of the whole held-out stream (whose ids the "
                                   "run does not save, only their sha256)",
    ("variants", "*", "wall_seconds"): "wall-clock timings",
    ("variants", "*", "load_average"): "the machine's load while it ran",
    ("variants", "*", "checkpoint", "reload_identical_logits"):
        "torch's reload of the checkpoint reproducing the trained model's logits bit for bit",
    ("variants", "perhead", "barycenter_init", "t"):
        "the barycenters of the initial weights, which no checkpoint holds (base_initial is "
        "recomputed from them)",
    ("variants", "perhead", "barycenter_init", "reinitialised_identically"):
        "a record of the initialiser's idempotence on the initial weights (not saved)",
    ("drift", "document"): "the Cosine-RoPE document's claim, a constant string",
}
TRAJECTORY_INTERIOR = "the learned quantities between the first and the last step (no checkpoint)"
DATA_ECHO = ("data", "check_windows")  # the held-out windows' offsets: the checkpoints' own


def exempt_reason(path: tuple, report: dict) -> str | None:
    if matches(path, DATA_ECHO):
        return None
    for pattern, why in RECORDS.items():
        if matches(path, pattern):
            return why
    if len(path) > 3 and path[2] in ("tau_trajectory", "base_trajectory"):
        last = len(at(report, path[:3])) - 1
        if path[3] not in (0, last):
            return TRAJECTORY_INTERIOR
    return None


def reference_path(path: tuple, report: dict) -> tuple:
    """Where the reference keeps a recomputed leaf: a trajectory's first and last entries are
    the initial and the final values."""
    if len(path) > 3 and path[2] in ("tau_trajectory", "base_trajectory"):
        key = path[2].split("_")[0]
        end = "initial" if path[3] == 0 else "final"
        return (*path[:2], f"{key}_{end}", *path[4:])
    return path


def echo_source(path: tuple, info: dict) -> tuple[bool, Any]:
    """The checkpoint JSON's record of an echoed leaf: ``(True, value)``, or ``(False, None)``
    for a leaf that is not an echo."""
    tc = info["train_config"]
    if path[0] == "config" and len(path) == 2 and path[1] in tc:
        return True, tc[path[1]]
    if path == ("seed",):
        return True, info["seed"]
    if path[0] == "tokenizer" and has(info["tokenizer"], path[1:]):
        return True, at(info["tokenizer"], path[1:])
    if matches(path, DATA_ECHO) and len(path) == 3:
        starts = info["suite_inputs"]["starts"]
        return True, starts[path[2]] if path[2] < len(starts) else "(absent)"
    return False, None


RECOMPUTED = ("variants", "drift", "verdict")


def leaf_class(path: tuple, report: dict, infos: dict) -> str:
    """``exempt``, ``echo``, ``recomputed`` or ``unknown``."""
    if exempt_reason(path, report) is not None:
        return "exempt"
    if echo_source(path, infos["standard"])[0]:
        return "echo"
    if path[0] in RECOMPUTED or path == ("config", "head_dim"):
        return "recomputed"
    return "unknown"


# ---------------------------------------------------------------------------------------------
# tolerances, derived per kind of statistic
# ---------------------------------------------------------------------------------------------
def exp_rel(x: float) -> float:
    """Two float64 evaluations of ``e^x`` from the same ``x`` (a learned ``log_tau`` or
    ``log_base``, exact in float64): each within ``tolerances.exp_of_sum_rel(|x|, 1)``."""
    return 2 * tl.exp_of_sum_rel(abs(x), 1)


def log_round_trip32(x: float) -> float:
    """Relative error of ``exp(log x)`` with ``log x`` stored in a float32 parameter (an initial
    ``log_tau``/``log_base``): the two sides' float64 ``log x`` may round to neighbouring
    float32 numbers; ``tolerances.exp_of_sum_rel`` of one term of size ``|log x|`` in float32
    (as tests/test_train_families.py derives it)."""
    return tl.exp_of_sum_rel(abs(math.log(x)), 1, F32)


def base_of_t_rel(lo: float, hi: float) -> float:
    """``b(t) = exp((1-t) log b_min + t log b_max)`` evaluated on two sides from the same ``t``:
    ``exp`` of a two-term sum of logs, each side ``tolerances.exp_of_sum_rel``."""
    return 2 * tl.exp_of_sum_rel(abs(math.log(lo)) + abs(math.log(hi)), 2)


def expm1_of_two_over_tau_rel(tau: float, tau_rel: float) -> float:
    """``e^{2/tau} - 1`` on two sides from temperatures ``tau_rel`` apart: the quotient ``z =
    2/tau`` inherits ``tau_rel`` plus a rounding a side, ``expm1`` has condition number ``z e^z /
    (e^z - 1) <= 1 + z`` and rounds once more a side (four non-negative operations in all)."""
    z = 2.0 / tau
    return (1 + z) * (tau_rel + 2 * U64) + tl.nonnegative_ops_rel(4)


def two_key_reach_rel(tau: float, tau_rel: float) -> float:
    """``e / (1 + e)``, ``e = e^{-2/tau}``: ``e`` carries ``(2/tau)(tau_rel + 2u)`` plus its own
    rounding, and the quotient has condition number ``1 / (1 + e) <= 1`` in ``e``; with the sum
    and the quotient, six non-negative operations over both sides."""
    return (2.0 / tau) * (tau_rel + 2 * U64) + tl.nonnegative_ops_rel(6)


def svd_abs(w: np.ndarray) -> float:
    """Absolute error of each singular value of a float64 ``(m, d)`` matrix from one LAPACK SVD:
    Householder bidiagonalisation is backward stable with ``||dW||_F <= gamma_{c m d} ||W||_F``
    (Higham, Accuracy and Stability, section 19.3; we take ``c = 1`` per reflected entry), the
    bidiagonal SVD is relatively accurate (``O(d u)`` per value, inside that), and Weyl's
    inequality moves every singular value by at most ``||dW||_2 <= ||dW||_F``."""
    m, d = w.shape
    return tl.nonnegative_ops_rel(m * d) * float(np.linalg.norm(w))


@dataclass
class MatrixTol:
    """The tolerances of one projection's diagnostics (two sides: ropestep.heads and the
    reference), absolute."""

    cond: float
    effective_rank: float
    sigma: float
    frobenius: float
    band: np.ndarray
    coarse: np.ndarray


def matrix_tol(w: np.ndarray, layout: str) -> MatrixTol:
    """Per diagnostic of ``w (m, d)``:

    * singular values: two SVDs, each within :func:`svd_abs`;
    * ``cond = s_max / s_min``: first order ``cond (ds/s_max + ds/s_min)`` plus the quotient's
      rounding a side;
    * effective rank ``e^H``, ``H = -sum p_k log p_k``, ``p = s / sum s``: ``dH/ds_k = -(log p_k
      + H) / sum s``, so the singular values move ``H`` by ``sum_k |log p_k + H| ds / sum s``;
      each side's evaluation of ``H`` rounds ``p_k`` (``gamma_{d+1}``), ``log p_k`` (an ulp)
      and the ``d``-term sum of same-signed terms: at most ``gamma_{d+3} sum_k p_k (|log p_k| +
      1)`` absolute, and ``exp`` one more ulp;
    * Frobenius norm, band fractions ``E_l / ||W||_F^2`` and their coarse sums: non-negative
      operations (tolerances.nonnegative_ops_rel), counted for either order of the sums: the
      norm ``m d + 1``; a fraction ``2m`` for ``E_l`` (squares and sum), ``2m + d`` for the
      total, one quotient, ``4m + d + 2`` in all; a coarse band ``d/8`` more (rounded up).
    """
    m, d = w.shape
    sv = np.linalg.svd(w, compute_uv=False)
    ds = 2 * svd_abs(w)
    cond = float(sv.max() / sv.min())
    p = sv / sv.sum()
    H = -float(np.sum(p * np.log(p)))
    dH = float(np.sum(np.abs(np.log(p) + H))) * ds / float(sv.sum()) + 2 * (
        tl.nonnegative_ops_rel(d + 3) * float(np.sum(p * (np.abs(np.log(p)) + 1))))
    nb = 4 * m + d + 2
    frac = reference.band_fractions(w, layout)
    coarse = np.array([np.sum(b) for b in np.array_split(frac, reference.N_COARSE)])
    return MatrixTol(cond=cond * (ds / sv.max() + ds / sv.min()) + 4 * U64 * cond,
                     effective_rank=math.exp(H) * (dH + 4 * U64), sigma=ds,
                     frobenius=2 * tl.nonnegative_ops_rel(m * d + 1) * float(np.linalg.norm(w)),
                     band=2 * tl.nonnegative_ops_rel(nb) * frac,
                     coarse=2 * tl.nonnegative_ops_rel(nb + -(-d // 8)) * coarse)


class Derived:
    """The tolerances of one run: sizes, the reference's per-query rows and the checkpoints'
    weights (docs/math.md sections 9, 11 and 12 name every symbol used)."""

    def __init__(self, ref: reference.Reference):
        self.ref = ref
        cfg = ref.checkpoints["standard"].cfg
        self.d, self.m = reference.head_dim(cfg), int(cfg["d_model"])
        self.H, self.T = reference.n_heads(cfg), int(cfg["seq_len"])
        self.layout = cfg["layout"]
        # the module's own float64 evaluation of a head output, per component relative to the
        # value scale (the suite's own level for it, docs/math.md section 11); the reference's
        # float64 softmax output is a condition-1 sum of the same size
        self.a64 = tl.agreement_rel_tol(F64, self.T, self.d, self.m)
        self.a32 = tl.agreement_rel_tol(F32, self.T, self.d, self.m)
        self.root_r = math.sqrt(self.d)

    # -- the per-query rows --
    def causal(self, v: str, L: int, h: int) -> dict[str, np.ndarray]:
        """Head ``h``'s rows over every check sequence, queries with at least two keys."""
        keys = [k for k in self.ref.causal if k[:2] == (v, L) and k[3] == h]
        R = {f: np.concatenate([self.ref.causal[k][f] for k in keys])
             for f in reference.CAUSAL_FIELDS}
        sel = R["n"] >= 2
        return {f: a[sel] for f, a in R.items()}

    def reuse(self, v: str, L: int, h: int) -> dict[str, np.ndarray]:
        keys = [k for k in self.ref.reuse if k[:2] == (v, L) and k[3] == h]
        R = {f: np.concatenate([self.ref.reuse[k][f] for k in keys])
             for f in reference.REUSE_FIELDS}
        sel = np.isfinite(R["rel"])
        return {f: a[sel] for f, a in R.items()}

    def scale2(self, v: str, L: int, h: int) -> float:
        ck = self.ref.checkpoints[v]
        if v == "cosine":
            return float(reference.temperatures(ck, L)[h]) ** -2
        return 1.0 / self.d

    # -- learned quantities --
    def tau(self, v: str, L: int, h: int) -> float:
        return float(reference.temperatures(self.ref.checkpoints[v], L)[h])

    def tau_rel(self, tau: float) -> float:
        return exp_rel(math.log(tau))

    # -- the suite's per-head numbers --
    def identity(self, v: str, L: int, h: int, dtype: torch.dtype) -> float:
        """The identity errors' exact value is 0; the suite bounds each query's by
        ``readout_bound(dtype, max(1, kappa), N_i, d, max|s|) + agreement_rel_tol(dtype, N, d,
        m)`` (docs/math.md section 11).  float64: the original gauge's kappa, recomputed on the
        same inputs.  float32: the max-key gauge's kappa, which the suite evaluates in float32
        (within ``a32`` of the reference's, and the anchor may be any key within
        MAXKEY_TIE_LOWP of the top score: the reference takes the largest): taken twice."""
        R = self.causal(v, L, h)
        if dtype == F64:
            kap, level = np.maximum(1.0, R["kappa"]), self.a64
        else:
            kap, level = 2 * np.maximum(1.0, R["kappa_mk"]), self.a32
        return float(np.max(tl.readout_bound(dtype, kap, R["n"], self.d, R["sigma"]) + level))

    def lam(self, v: str, L: int, h: int, space: str) -> np.ndarray:
        """Per query: ``lambda_max`` of the query-space Hessian (``H^q = scale^2 G``) or of the
        input-space one, each side within ``tolerances.descent_bound`` of the terms' size: the
        suite states its own evaluation's error so (``scale^2 tr G`` in query space, ``(scale^2
        ||W_q||_F^2 + 1) tr G`` in input space, docs/math.md section 3), and the reference's
        Gram-matrix route is backward stable with no more roundings."""
        R = self.causal(v, L, h)
        s2 = self.scale2(v, L, h)
        if space == "query":
            size, hid = s2 * R["trG"], 0
        else:
            size, hid = (s2 * R["wq_frob2"] + 1) * R["trG"], self.m
        return 2 * descent_bounds(size, R["n"], self.d, hid, R["sigma"])

    def delta(self, v: str, L: int, h: int, space: str) -> np.ndarray:
        """Per query: the error of ``E(step) - E(0)`` on each side, ``descent_bound`` of the
        terms' size ``2 lambda |dM|^2 + 4 E(0) + E(step)`` (the suite's own count for its
        descent inequality, docs/math.md section 3), both sides."""
        R = self.causal(v, L, h)
        key = "q" if space == "query" else "in"
        e1 = R["e0"] + R[f"delta_{key}"]
        size = 2 * np.abs(R[f"lam_{key}"]) * R[f"norm_{key}"] + 4 * R["e0"] + np.abs(e1)
        return 2 * descent_bounds(size, R["n"], self.d, self.m if key == "in" else 0,
                                  R["sigma"])

    def ratio(self, v: str, L: int, h: int) -> np.ndarray:
        """Per query: ``||y_i - mu_i|| / max_j ||v_j - mu_i||``.  Each side's ``y_i`` is within
        ``a64 S_i`` per component of the exact head output, ``mu_i`` and ``v_j - mu_i`` within
        ``gamma_{n+2} S_i`` (a mean of ``n`` values, one subtraction), so in the 2-norm (sqrt(r)
        times) ``dnum = 2 sqrt(r) (a64 + 2 gamma_{n+2}) S_i`` and ``dden = 2 sqrt(r) 2
        gamma_{n+2} S_i`` over both sides; the quotient moves by ``(dnum + ratio dden) / (den -
        dden)``, plus both sides' rounding of the norms and the quotient (``r + 3`` non-negative
        operations each)."""
        R = self.causal(v, L, h)
        g = np.array([tl.nonnegative_ops_rel(int(n) + 2) for n in R["n"]])
        dnum = 2 * self.root_r * (self.a64 + 2 * g) * R["S"]
        dden = 2 * self.root_r * 2 * g * R["S"]
        own = 2 * tl.nonnegative_ops_rel(self.d + 3) * R["ratio"]
        return (dnum + R["ratio"] * dden) / np.maximum(R["den"] - dden, 0.0) + own

    def reuse_rel(self, v: str, L: int, h: int) -> np.ndarray:
        """Per non-anchor query: ``|y_i - y^fr_i| / |y_i - mu|``.  ``y_i`` (the module's output
        with the bank, and the reference's softmax) within ``a64 S`` per component a side; the
        frozen readout ``mu + q_i T_a`` within ``identity_check_tol(float64, kappa_fr, n, d,
        max|s|) S`` a side (a sum of condition ``kappa_fr``, docs/math.md section 9); in the
        2-norm sqrt(r) times.  The quotient as in :meth:`ratio`."""
        R = self.reuse(v, L, h)
        ic = tl.identity_check_tol(F64, R["kappa_fr"], R["n"], self.d, R["sigma"])
        derr = 2 * self.root_r * (self.a64 + ic) * R["S"]
        ddev = 2 * self.root_r * 2 * self.a64 * R["S"]
        own = 2 * tl.nonnegative_ops_rel(self.d + 3) * R["rel"]
        return (derr + R["rel"] * ddev) / np.maximum(R["dev"] - ddev, 0.0) + own

    def tightness(self, v: str, L: int, h: int, x: float) -> float:
        """``ratio / bound``: the ratio's error over the bound, plus the bound's relative error
        times the tightness, plus the quotient's rounding a side."""
        tau = self.tau(v, L, h)
        bound = math.expm1(2.0 / tau)
        return (float(np.max(self.ratio(v, L, h))) / bound
                + (expm1_of_two_over_tau_rel(tau, self.tau_rel(tau)) + 4 * U64) * abs(x))

    # -- W_q/W_k diagnostics --
    @functools.lru_cache(maxsize=None)
    def matrix(self, v: str, L: int, which: str, idx: int) -> MatrixTol:
        ck = self.ref.checkpoints[v]
        name = "q_proj" if which == "q" else "k_proj"
        return matrix_tol(reference.head_weights(ck, L, idx, name), self.layout)

    def barycenter(self, t: float) -> float:
        """``t``: non-negative operations, ``2m + 2d + 5`` a side (the count of
        tests/test_rope_diagnostics.py::barycenter_ops)."""
        return 2 * tl.nonnegative_ops_rel(2 * self.m + 2 * self.d + 5) * abs(t)

    def sketch(self, value: float) -> float:
        """The sketch: row norms (``2m``), the grid point (a quotient and a product, or a
        subtraction from 1 for the upper half: 3), the product, both ``2d``-term sums and the
        ``+ 1e-8``, the quotient: ``4m + 4d + 8`` non-negative operations a side."""
        return 2 * tl.nonnegative_ops_rel(4 * self.m + 4 * self.d + 8) * abs(value)

    def base_rel(self, v: str, L: int, h: int) -> float:
        """A head's RoPE base: ``rope_base`` itself (exact), or a learned ``exp(log_base)``."""
        if v != "perhead":
            return 0.0
        return exp_rel(math.log(float(reference.bases(self.ref.checkpoints[v], L)[h])))


def descent_bounds(size: np.ndarray, n: np.ndarray, d: int, hidden: int,
                   sigma: np.ndarray) -> np.ndarray:
    """``tolerances.descent_bound`` (float64) per query (it takes one largest score at a time)."""
    return np.array([tl.descent_bound(F64, float(z), int(k), d, hidden, float(s))
                     for z, k, s in zip(size, n, sigma)])


def exact(*_: Any) -> float:
    """Counts, flags, indices, sizes, copies of recorded numbers, and fractions of counts (one
    correctly rounded division on both sides): equal."""
    return 0.0


SUITE_HEAD: dict[str, Callable[[Derived, str, int, int, float], float]] = {
    "head": exact, "descends_query_fraction": exact, "descends_input_fraction": exact,
    "lambda_below_2_query_fraction": exact, "lambda_below_2_input_fraction": exact,
    "base": lambda D, v, L, h, x: D.base_rel(v, L, h) * abs(x),
    "identity_float64_rel": lambda D, v, L, h, x: D.identity(v, L, h, F64),
    "identity_float32_rel": lambda D, v, L, h, x: D.identity(v, L, h, F32),
    # a max of values each within its tolerance; a mean over sequences of medians likewise
    # (plus the mean's own rounding, a few ulps of the value)
    "lambda_max_query_max": lambda D, v, L, h, x: float(np.max(D.lam(v, L, h, "query"))),
    "lambda_max_query_median":
        lambda D, v, L, h, x: float(np.max(D.lam(v, L, h, "query"))) + 4 * U64 * abs(x),
    "lambda_max_input_max": lambda D, v, L, h, x: float(np.max(D.lam(v, L, h, "input"))),
    "lambda_max_input_median":
        lambda D, v, L, h, x: float(np.max(D.lam(v, L, h, "input"))) + 4 * U64 * abs(x),
    "reuse_rel_error_max": lambda D, v, L, h, x: float(np.max(D.reuse_rel(v, L, h))),
    "reuse_rel_error_median":
        lambda D, v, L, h, x: float(np.max(D.reuse_rel(v, L, h))) + 4 * U64 * abs(x),
    "cosine_ratio_max": lambda D, v, L, h, x: float(np.max(D.ratio(v, L, h))),
    "tau": lambda D, v, L, h, x: D.tau_rel(x) * x,
    "cosine_bound": lambda D, v, L, h, x: expm1_of_two_over_tau_rel(
        D.tau(v, L, h), D.tau_rel(D.tau(v, L, h))) * x,
    "cosine_two_key_reach": lambda D, v, L, h, x: two_key_reach_rel(
        D.tau(v, L, h), D.tau_rel(D.tau(v, L, h))) * x,
    "cosine_tightness": lambda D, v, L, h, x: D.tightness(v, L, h, x),
}


def learned_tol(D: Derived, path: tuple, value: float) -> float | None:
    """``tau_*``, ``base_*`` (and the trajectories' ends), ``base_clamped``."""
    key = path[2]
    if key == "base_clamped":
        return 0.0
    if key == "tau_initial":  # exp(float32(log sqrt d)) on both sides
        return log_round_trip32(value) * value
    if key == "base_initial":  # b(t) of the recorded t, then through the float32 log_base
        lo, hi = D.ref.checkpoints["perhead"].cfg["base_range"]
        return (log_round_trip32(value) + base_of_t_rel(lo, hi)) * value
    if key in ("tau_final", "base_final"):
        return exp_rel(math.log(value)) * value
    return None


def drift_tol(D: Derived, path: tuple, value: Any) -> float | None:
    """``final - initial`` per head: both within their tolerances, plus the subtraction's
    rounding; its extremes likewise; the spread ``max - min`` of the final values: two final
    values' tolerances plus a rounding."""
    if path[1] in ("steps", "heads", "down", "up"):
        return 0.0
    ck = D.ref.checkpoints["cosine"]
    fin = np.concatenate([reference.temperatures(ck, L) for L in range(int(ck.cfg["n_layers"]))])
    ini = reference.initial_tau(ck.cfg)[0]
    t_fin = float(np.max([exp_rel(math.log(x)) * x for x in fin]))
    t_ini = log_round_trip32(ini) * ini
    if path[1] in ("change_min", "change_max"):
        return t_fin + t_ini + 2 * U64 * abs(value)
    if path[1] == "spread_end":
        return 2 * t_fin + 2 * U64 * abs(value)
    return None


def suite_tol(D: Derived, path: tuple, value: Any) -> float | None:
    """``variants.v.suite...``: the checks' err/tol ratios (exact value 0; the ratio's own
    tolerance is 1, by its definition), the per-head numbers (``SUITE_HEAD``), counts."""
    v, rest = path[1], path[3:]
    if rest[0] in ("sequences", "sequence_starts", "passed"):
        return 0.0
    if rest[0] == "layers":
        L = int(rest[1])
        if rest[2] in ("layer", "passed"):
            return 0.0
        if rest[2] == "checks":
            return 1.0
        if rest[2] == "heads" and len(rest) == 5:
            fn = SUITE_HEAD.get(rest[4])
            return None if fn is None else fn(D, v, L, int(rest[3]), value)
    return None


def matrix_field_tol(T: MatrixTol, rest: tuple) -> float | None:
    """One entry of a ``w_q``/``w_k`` block."""
    f = rest[0]
    if f in ("cond", "effective_rank", "frobenius"):
        return getattr(T, f)
    if f in ("sigma_max", "sigma_min"):
        return T.sigma
    if f == "band_energy_fraction":
        return float(T.band[rest[1]])
    if f == "coarse_band_fraction":
        return float(T.coarse[rest[1]])
    return None


def diag_heads(D: Derived, v: str, layers: list[int]) -> list[tuple[int, int]]:
    return [(L, h) for L in layers for h in range(D.H)]


def summary_tol(D: Derived, v: str, layers: list[int], rest: tuple, value: Any) -> float | None:
    """A summary over the heads of ``layers``: a median, min or max of values each within its
    tolerance is within the largest (plus a rounding for the median's average of two); a mean
    of coarse bands within the largest plus the mean's ``H + 1`` non-negative operations;
    counts and fractions of decisions equal."""
    f = rest[0]
    if f.startswith("fraction_") or rest[-1] == "n":
        return 0.0
    heads = diag_heads(D, v, layers)
    if f.startswith("coarse_band_fraction_"):
        which = f.split("_")[-2][-1]
        t = max(float(D.matrix(v, L, which, h).coarse[rest[1]]) for L, h in heads)
        return t + 2 * tl.nonnegative_ops_rel(len(heads) + 1) * abs(value)
    per = {"cond_w_q": lambda L, h: D.matrix(v, L, "q", h).cond,
           "cond_w_k": lambda L, h: D.matrix(v, L, "k", h).cond,
           "effective_rank_w_q": lambda L, h: D.matrix(v, L, "q", h).effective_rank,
           "effective_rank_w_k": lambda L, h: D.matrix(v, L, "k", h).effective_rank,
           "barycenter": lambda L, h: barycenter_tol(D, v, L, h),
           "barycenter_base": lambda L, h: barycenter_base_tol(D, v, L, h),
           "sketch_barycenter": lambda L, h: D.sketch(sketch_value(D, v, L, h))}.get(f)
    if per is None:
        return None
    return max(per(L, h) for L, h in heads) + 4 * U64 * abs(value)


def _diag_layer(D: Derived, v: str, L: int) -> dict:
    return D.ref.report["variants"][v]["heads_diagnostics"]["layers"][str(L)]


def barycenter_tol(D: Derived, v: str, L: int, h: int) -> float:
    return D.barycenter(_diag_layer(D, v, L)["query_heads"][h]["barycenter"])


def barycenter_base_tol(D: Derived, v: str, L: int, h: int) -> float:
    """``b(t)``: ``t`` within its tolerance moves ``log b`` by ``log(b_max/b_min) dt``; plus
    :func:`base_of_t_rel`."""
    lo, hi = D.ref.checkpoints[v].cfg["base_range"]
    b = _diag_layer(D, v, L)["query_heads"][h]["barycenter_base"]
    return b * (math.log(hi / lo) * barycenter_tol(D, v, L, h) + base_of_t_rel(lo, hi))


def sketch_value(D: Derived, v: str, L: int, h: int) -> float:
    return _diag_layer(D, v, L)["query_heads"][h]["sketch_barycenter"]


def frequency_tol(D: Derived, v: str, L: int, rest: tuple, value: Any) -> float | None:
    """``omega_l = b^(-2l/d)`` of head 0's base: ``exp`` of a product of logs on each side
    (``tolerances.exp_of_sum_rel`` of ``|log omega|``, two terms), and the base's own relative
    error times ``2l/d``.  ``omega_0 = 1`` exactly; the orientation fields equal."""
    f = rest[0]
    if f in ("omega", "omega_last"):
        ell = rest[1] if f == "omega" else D.d // 2 - 1
        return abs(value) * (2 * tl.exp_of_sum_rel(abs(math.log(value)), 2)
                             + 2 * ell / D.d * D.base_rel(v, L, 0))
    return 0.0


def diagnostics_tol(D: Derived, path: tuple, value: Any) -> float | None:
    """``variants.v.heads_diagnostics...``."""
    v, rest = path[1], path[3:]
    if rest[0] == "summary":
        return summary_tol(D, v, list(range(len(D.ref.report["variants"][v]["heads_diagnostics"]
                                                ["layers"]))), rest[1:], value)
    if rest[0] != "layers":
        return None
    L, rest = int(rest[1]), rest[2:]
    if rest[0] == "summary":
        return summary_tol(D, v, [L], rest[1:], value)
    if rest[0] == "rope_bases":
        return D.base_rel(v, L, int(rest[1])) * abs(value)
    if rest[0] == "frequency_axis":
        return frequency_tol(D, v, L, rest[1:], value)
    if rest[0] in ("query_heads", "kv_heads"):
        idx, f = int(rest[1]), rest[2]
        if f in ("w_q", "w_k"):
            return matrix_field_tol(D.matrix(v, L, f[-1], idx), rest[3:])
        if f == "barycenter":
            return barycenter_tol(D, v, L, idx)
        if f == "barycenter_base":
            return barycenter_base_tol(D, v, L, idx)
        if f == "sketch_barycenter":
            return D.sketch(value)
    return 0.0  # sizes, layout, family, base range, head indices


def tolerance(D: Derived, path: tuple, value: Any) -> float | None:
    """The absolute tolerance of a recomputed leaf; None where none is derived."""
    if path[0] == "drift":
        return drift_tol(D, path, value)
    if path[0] in ("verdict", "config"):
        return 0.0
    key = path[2]
    if key == "suite":
        return suite_tol(D, path, value)
    if key == "heads_diagnostics":
        return diagnostics_tol(D, path, value)
    if key in ("tau_initial", "tau_final", "base_initial", "base_final", "base_clamped"):
        return learned_tol(D, path, value)
    if key == "train_loss_tail_mean":  # the mean of the same recorded losses (non-negative)
        return 2 * tl.nonnegative_ops_rel(
            int(D.ref.report["variants"][path[1]]["tail_steps"]) + 1) * abs(value)
    if key in ("variant", "parameters", "steps_done", "record_steps", "train_loss_last",
               "tail_steps", "val_loss_initial", "val_loss_end", "checkpoint", "passed",
               "barycenter_init"):
        return 0.0
    return None


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------

def compare(report: dict, ref: reference.Reference) -> tuple[list[str], dict[str, int]]:
    """Every leaf of ``report`` against the reference: the problems, and how many leaves of each
    class there were."""
    problems, counts = [], {"recomputed": 0, "echo": 0, "exempt": 0}
    infos = {v: ck.info for v, ck in ref.checkpoints.items()}
    D = Derived(ref)
    for path, value in leaves(report):
        kind = leaf_class(path, report, infos)
        where = "/".join(map(str, path))
        if kind == "unknown":
            problems.append(f"{where}: neither recomputed, an echo, nor a record")
            continue
        counts[kind] += 1
        if kind == "echo":
            for v, info in infos.items():
                want = echo_source(path, info)[1]
                if want != value:
                    problems.append(f"{where}: {value!r} is not checkpoint {v}'s {want!r}")
        elif kind == "recomputed":
            rp = reference_path(path, report)
            if not has(ref.report, rp):
                problems.append(f"{where}: no reference for this leaf")
                continue
            want = at(ref.report, rp)
            t = tolerance(D, rp, value)
            if t is None:
                problems.append(f"{where}: no tolerance derived for this leaf")
            elif not agrees(value, want, t):
                problems.append(f"{where}: report {value!r}, reference {want!r}, "
                                f"tolerance {t:.3g}")
    problems += missing_from(report, ref.report)
    return problems, counts


def undecided(ref: reference.Reference) -> list[str]:
    """Decisions behind counts and flags that lie within the two sides' rounding of their
    threshold: there a count cannot be compared exactly (choose other data)."""
    D = Derived(ref)
    out = []
    for v, ck in ref.checkpoints.items():
        for L in range(int(ck.cfg["n_layers"])):
            for h in range(D.H):
                R = D.causal(v, L, h)
                spaces = ("query",) if v == "cosine" else ("query", "input")
                for space in spaces:
                    key = "q" if space == "query" else "in"
                    if np.any(np.abs(R[f"delta_{key}"]) <= D.delta(v, L, h, space)):
                        out.append(f"{v} layer {L} head {h}: a {space}-space descent within "
                                   "rounding")
                    if np.any(np.abs(R[f"lam_{key}"] - 2) <= D.lam(v, L, h, space)):
                        out.append(f"{v} layer {L} head {h}: lambda_max within rounding of 2")
                g = np.array([tl.nonnegative_ops_rel(int(n) + 2) for n in R["n"]])
                if np.any(R["den"] <= 4 * D.root_r * g * R["S"]):
                    out.append(f"{v} layer {L} head {h}: a cosine-bound denominator within "
                               "rounding of 0 (keys with equal values)")
                for which in ("q", "k"):
                    T = D.matrix(v, L, which, h)
                    if abs(T_cond(D, v, L, which, h) - reference.COND_SMALL) <= T.cond:
                        out.append(f"{v} layer {L} {which} {h}: cond within rounding of 10")
                t = _diag_layer(D, v, L)["query_heads"][h]["barycenter"]
                if abs(t - 0.5) <= D.barycenter(t):
                    out.append(f"{v} layer {L} head {h}: barycenter within rounding of 1/2")
            if v == "perhead":
                lo, hi = reference.log_range(ck.cfg)
                for x in ck.attn(L, "log_base"):
                    if min(abs(x - lo), abs(x - hi)) <= 4 * U64 * max(abs(lo), abs(hi)):
                        out.append(f"perhead layer {L}: log_base within rounding of the range")
    dr = ref.report["drift"]
    P = ("drift", "change_min")
    if min(abs(dr["change_min"]), abs(dr["change_max"])) <= drift_tol(D, P, 0.0):
        out.append("drift: a temperature change within rounding of 0")
    return out


def T_cond(D: Derived, v: str, L: int, which: str, idx: int) -> float:
    key = "query_heads" if which == "q" else "kv_heads"
    return _diag_layer(D, v, L)[key][idx][f"w_{which}"]["cond"]


def check_case(case: Case) -> dict[str, int]:
    problems, counts = compare(case.report, case.ref)
    open_ = undecided(case.ref)
    print("leaves:", counts, "seconds:", case.seconds)
    assert not open_, "\n".join(open_)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])
    return counts


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_every_leaf_of_the_tiny_report_is_accounted_for(tiny):
    assert tiny.report["verdict"]["passed"], tiny.report["verdict"]
    counts = check_case(tiny)
    assert counts["recomputed"] > 1000 and counts["echo"] > 20
    cfg = tiny.ref.checkpoints["cosine"].cfg
    assert (cfg["n_layers"], cfg["n_heads"], cfg["d_model"]) == (2, 4, 32)
    # the statistics are not degenerate: the temperatures moved, the bases differ per head, and
    # the cosine ratio is a positive fraction of its bound
    d = tiny.report["drift"]
    assert d["down"] + d["up"] == d["heads"] == 8
    assert all(len(set(row)) == 4 for row in tiny.report["variants"]["perhead"]["base_final"])
    t = [h["cosine_tightness"] for lr in tiny.report["variants"]["cosine"]["suite"]["layers"]
         for h in lr["heads"]]
    assert all(0.0 < x < 1.0 for x in t), t


# ---------------------------------------------------------------------------------------------
# the forward's error bound (the inputs the suite read against the reference's forward)
# ---------------------------------------------------------------------------------------------
U32_64 = tl.unit_roundoff(F32) + tl.unit_roundoff(F64)  # the model in float32, the reference
U64_64 = 2 * tl.unit_roundoff(F64)  # the model in float64, the reference
GELU_LIPSCHITZ = 1.13  # max |d/dx x Phi(x)| = 1.1289... (at x = sqrt 2)


def gam(n: int, u: float) -> float:
    """``gamma_n`` at ``u``, the sum of both evaluations' unit roundoffs: the model's rounding
    and the reference's rounding of the same ``n`` operations add, each within its ``gamma_n``
    (first order)."""
    return n * u / (1.0 - n * u)


def rmsnorm_bound(h: np.ndarray, eh: np.ndarray, w: np.ndarray, eps: float, u: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``x / sqrt(mean(x^2) + eps) * w`` and a componentwise bound of its error, for inputs known
    within ``eh``: the inputs move ``r = (mean(x^2) + eps)^(-1/2)`` by ``sum |x| eh / (m (mean(x^2)
    + eps))`` relative (first order) and the output by ``|w| r eh`` directly; the evaluation
    itself is ``m + 7`` roundings of non-negative quantities apart from the sign of ``x`` (``m``
    squares summed, the division by ``m``, ``eps`` rounded and added, the square root and its
    reciprocal, two products; tolerances.nonnegative_ops_rel's argument)."""
    m = h.shape[-1]
    ms = np.mean(h * h, axis=-1, keepdims=True) + eps
    a = reference.rmsnorm(h, w, eps)
    moved = np.sum(np.abs(h) * eh, axis=-1, keepdims=True) / (m * ms)
    return a, np.abs(w) * eh / np.sqrt(ms) + np.abs(a) * moved + gam(m + 7, u) * np.abs(a)


def linear_bound(x: np.ndarray, ex: np.ndarray, W: np.ndarray, u: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``x W^T`` (a ``Linear``) and its error: the inputs' error through ``|W|``, and the
    ``K``-term dot products' ``gamma_K |x| |W|^T`` (Higham, section 3.1)."""
    aw = np.abs(W)
    return x @ W.T, ex @ aw.T + gam(W.shape[1], u) * (np.abs(x) @ aw.T)


def head_bound(ck: reference.Checkpoint, L: int, h: int, a: np.ndarray, ea: np.ndarray,
               u: float) -> np.ndarray:
    """A componentwise bound of the error of one head's causal softmax output ``(T, d)``.

    q, k, v: :func:`linear_bound`.  In 2-norms per token: normalising (cosine) turns an error
    ``e`` of ``q`` into ``2 e / |q|`` plus ``gamma_{d+2}`` (norm and quotient); the rotation
    keeps norms, its tables (rounded to the model's dtype) and two products add ``gamma_4 |q|``;
    a score ``scale q~ . k~`` moves by ``scale (e_q |k| + |q| e_k)`` plus ``gamma_{d+2} scale
    |q~| . |k~|`` (the ``d``-term dot and the scale, rounded once).  The softmax: score errors
    ``ds`` move ``p_j`` by ``p_j (ds_j + sum_k p_k ds_k)`` and these changes sum to 0, so ``y_i``
    by ``sum_j |dp_j| |v_j - y_i|``; evaluating ``p_j`` rounds ``gamma_{n+4}`` plus ``2 u
    max|s|`` (the shifted exponent) relative, the ``n``-term sum ``gamma_n``; the values' own
    errors pass with weights ``p_j``."""
    hd = reference.head_data(ck, L, h, a)
    d = hd.q0.shape[1]
    g = reference.kv_head(ck.cfg, h)
    wq = reference.head_weights(ck, L, h, "q_proj")
    wk, wv = (reference.head_weights(ck, L, g, n) for n in ("k_proj", "v_proj"))
    raw = {n: (a @ w, ea @ np.abs(w) + gam(a.shape[1], u) * (np.abs(a) @ np.abs(w)))
           for n, w in (("q", wq), ("k", wk), ("v", wv))}
    v, ev = raw["v"]
    norms = {}
    for n in ("q", "k"):
        z, ez = raw[n]
        nz, enz = np.linalg.norm(z, axis=1), np.linalg.norm(ez, axis=1)
        if ck.variant == "cosine":  # unit vectors: error 2 e / |z| + gamma_{d+2}, norm 1
            enz, nz = 2 * enz / nz + gam(d + 2, u), np.ones_like(nz)
        norms[n] = (nz, enz + gam(4, u) * nz)
    (nq, eq), (nk, ek) = norms["q"], norms["k"]
    q, k = hd.q(np.arange(hd.T)), hd.k()
    out = np.zeros_like(v)
    for i in range(hd.T):
        n = i + 1
        s = hd.scale * (k[:n] @ q[i])
        p = reference.softmax(s)
        y = p @ v[:n]
        ds = hd.scale * (eq[i] * nk[:n] + nq[i] * ek[:n]) + gam(d + 2, u) * hd.scale * (
            np.abs(k[:n]) @ np.abs(q[i]))
        dp = p * (ds + p @ ds)
        rp = p * (gam(n + 4, u) + 2 * u * float(np.max(np.abs(s))))
        out[i] = (dp @ np.abs(v[:n] - y) + rp @ np.abs(v[:n]) + p @ ev[:n]
                  + gam(n, u) * (p @ np.abs(v[:n])))
    return out


def block_bound(ck: reference.Checkpoint, L: int, h: np.ndarray, eh: np.ndarray, u: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One block's attention input ``a`` with its error bound, and its output with its bound:
    the norms (:func:`rmsnorm_bound`), the heads (:func:`head_bound`) through ``W_o``
    (:func:`linear_bound`), the residual sums (one rounding each), the MLP's linear maps and its
    GELU (Lipschitz constant :data:`GELU_LIPSCHITZ`, and ``gamma_8 |x|`` for the evaluation of
    ``x (1 + erf(x / sqrt 2)) / 2``: an ulp or two of ``erf``, the sum, the products -- absolute,
    since ``1 + erf`` cancels for negative ``x``)."""
    eps = float(ck.cfg["norm_eps"])
    H = reference.n_heads(ck.cfg)
    a, ea = rmsnorm_bound(h, eh, ck.w(f"blocks.{L}.norm1.weight"), eps, u)
    heads = [reference.head_output(reference.head_data(ck, L, i, a)) for i in range(H)]
    eheads = [head_bound(ck, L, i, a, ea, u) for i in range(H)]
    o, eo = linear_bound(np.concatenate(heads, axis=1), np.concatenate(eheads, axis=1),
                         ck.attn(L, "o_proj.weight"), u)
    h1 = h + o
    eh1 = eh + eo + u * np.abs(h1)
    z, ez = rmsnorm_bound(h1, eh1, ck.w(f"blocks.{L}.norm2.weight"), eps, u)
    g, eg = linear_bound(z, ez, ck.w(f"blocks.{L}.mlp.0.weight"), u)
    m2, em2 = linear_bound(reference.gelu(g), GELU_LIPSCHITZ * eg + gam(8, u) * np.abs(g),
                           ck.w(f"blocks.{L}.mlp.2.weight"), u)
    h2 = h1 + m2
    return a, ea, h2, eh1 + em2 + u * np.abs(h2)


def forward_bound(ck: reference.Checkpoint, ids: list[int], u: float
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every layer's attention input from the reference's forward, with a componentwise bound on
    its distance to the model's forward evaluated at the unit roundoff ``u`` less the
    reference's (first order; the embedding lookup is exact).  Each block's bound multiplies the
    one before by the worst case of its sums (``|x| |W|`` against ``|x W|``): it is tight for the
    first layer and grows by about three orders of magnitude per block."""
    h = ck.w("tok_emb.weight")[np.asarray(ids)]
    eh = np.zeros_like(h)
    out = []
    for L in range(int(ck.cfg["n_layers"])):
        a, ea, h, eh = block_bound(ck, L, h, eh, u)
        out.append((a, ea))
    return out


def capture64(out: Path, families: types.ModuleType = fm) -> dict:
    """Every layer's attention input from the checkpoint's model run in float64."""
    out64 = {}
    for v in fm.VARIANTS:
        info = json.loads((out / "checkpoints" / f"{v}.json").read_text())
        model = families.load_checkpoint(out / "checkpoints" / f"{v}.safetensors").double()
        out64[v] = [[lc.x[0].numpy() for lc in model.capture(
            torch.tensor([ids], dtype=torch.int64)).layers]
            for ids in info["suite_inputs"]["token_ids"]]
    return out64


def input_problems(ref: reference.Reference, xs: dict, u: float) -> list[str]:
    """Where the inputs ``xs[variant][sequence][layer]`` of a model evaluated at unit roundoff
    ``u`` less the reference's leave the reference's forward of the checkpoint's held-out token
    ids by more than :func:`forward_bound`."""
    out = []
    for v, ck in ref.checkpoints.items():
        for si, ids in enumerate(ck.info["suite_inputs"]["token_ids"]):
            for L, (a, ea) in enumerate(forward_bound(ck, ids, u)):
                worst = float(np.max(np.abs(xs[v][si][L] - a) / ea))
                print(f"{v} sequence {si} layer {L}: |x - x_ref| / bound <= {worst:.3g}")
                if not worst <= 1.0:
                    out.append(f"{v} sequence {si} layer {L}: |x - x_ref| = {worst:.3g} bounds")
    return out


def test_the_float32_inputs_are_the_checkpoints_forward(tiny):
    """The inputs the comparison evaluates the statistics on (the checkpoint's float32 forward,
    as the suite read it) are the rounding of the reference's own float64 forward of the held-out
    token ids, layer by layer within the float32 forward's error bound (:func:`forward_bound`,
    tight for the first layer, loose after); the model evaluated in float64 agrees with it within
    the float64 bound (the same propagation at ``2^-52``: the code computes the documented
    function, also in the deeper layers); and those token ids are the windows the report names."""
    for v, ck in tiny.ref.checkpoints.items():
        sin = ck.info["suite_inputs"]
        assert sin["starts"] == tiny.report["data"]["check_windows"]
        assert len(sin["token_ids"]) == tiny.report["variants"][v]["suite"]["sequences"]
        assert all(len(ids) == tiny.report["config"]["seq"] for ids in sin["token_ids"])
        for ids in sin["token_ids"]:
            x64 = reference.capture(ck, ids)
            assert all(np.array_equal(a, x) for (a, _), x in zip(forward_bound(ck, ids, 0), x64))
    problems = input_problems(tiny.ref, tiny.x32, U32_64)
    problems += input_problems(tiny.ref, capture64(tiny.out), U64_64)
    assert not problems, problems


def test_the_comparison_flags_unknown_and_missing_leaves(tiny):
    """A field the reference does not know, and a field the report lost, are both failures."""
    grown = json.loads(json.dumps(tiny.report))
    grown["variants"]["cosine"]["suite"]["layers"][0]["heads"][1]["new_statistic"] = 0.5
    grown["new_block"] = {"x": 1}
    del grown["variants"]["perhead"]["heads_diagnostics"]["layers"]["0"]["query_heads"][2][
        "barycenter"]
    problems, _ = compare(grown, tiny.ref)
    text = "\n".join(problems)
    assert "heads/1/new_statistic: no reference" in text
    assert "new_block/x: neither recomputed" in text
    assert "query_heads/2/barycenter: the reference has" in text


MUTANTS = [  # (the planted bug, module, the line, its mutation, a leaf that must disagree)
    ("the cosine variant's default temperature sqrt(d_model), not sqrt(d)", "families",
     "return math.sqrt(self.dim) if self.tau_init is None else float(self.tau_init)",
     "return math.sqrt(self.d_model) if self.tau_init is None else float(self.tau_init)",
     "cosine/tau_initial/"),
    ("the drift measured from the first recorded step, not from the initial temperatures",
     "train_families", 'drift = _drift(cos["tau_initial"], cos["tau_final"], cos["steps_done"])',
     'drift = _drift(cos["tau_trajectory"][1], cos["tau_final"], cos["steps_done"])',
     "drift/change_"),
    ("each head reported with another head's base", "families",
     'heads_info[h]["base"] = b', 'heads_info[h]["base"] = spec.rope.bases(H)[-1 - h]',
     "perhead/suite/layers/0/heads/0/base"),
    ("the cosine ratio's denominator over keys the query does not see", "families",
     "den = dev.masked_fill(~mask[None], 0.0).amax(-1)\n    out = num / den",
     "den = dev.amax(-1)\n    out = num / den", "cosine_ratio_max"),
    ("the two-key reach e^{2/tau} / (1 + e^{2/tau})", "families",
     "return e / (1.0 + e)", "return 1.0 / (1.0 + e)", "cosine_two_key_reach"),
    ("lambda_max's median taken as a mean", "families",
     'info[h][f"lambda_max_{name}_median"] = float(dc.lam_max[h][sel].median())',
     'info[h][f"lambda_max_{name}_median"] = float(dc.lam_max[h][sel].mean())',
     "lambda_max_query_median"),
    ("the frozen-reuse median over the anchor too", "families",
     'info[h]["reuse_rel_error_median"] = float(rel[h, 1:].median())',
     'info[h]["reuse_rel_error_median"] = float(rel[h, :].median())', "reuse_rel_error_median"),
    ("the clamp flags inverted", "train_families",
     "rec[\"base_clamped\"] = [[not (math.log(lo) <= x <= math.log(hi)) for x in row]",
     "rec[\"base_clamped\"] = [[(math.log(lo) <= x <= math.log(hi)) for x in row]",
     "perhead/base_clamped/"),
    ("the effective rank of the squared singular values", "heads",
     "p = sv[sv > 0] / total", "p = sv[sv > 0] ** 2 / float((sv * sv).sum())", "effective_rank"),
    ("the barycenter placing dimensions by the interleaved pairing", "rope",
     "pos = frequency_index(d, layout).to(torch.float64)",
     'pos = frequency_index(d, "interleaved").to(torch.float64)', "/barycenter"),
    ("a head summary's median taken as a mean", "heads",
     'return {"median": float(np.median(a))', 'return {"median": float(np.mean(a))',
     "summary/cond_w_q/median"),
    ("the training-loss tail one step longer", "train_families",
     "tail = losses[-max(1, min(20, len(losses) // 10)):]",
     "tail = losses[-max(2, min(20, len(losses) // 10)):]", "tail_steps"),
]
CHAIN = ("rope", "families", "heads", "train_families")  # each imports those before it


def mutated(name: str, old: str, new: str, monkeypatch, upto: str = "train_families"
            ) -> types.ModuleType:
    """``ropestep.<upto>`` running on ``ropestep.<name>`` with one line replaced: the mutated
    module, then every module of ``CHAIN`` after it up to ``upto``, executed afresh and registered
    in its place (restored after the test)."""
    out = None
    for mod_name in CHAIN[CHAIN.index(name):CHAIN.index(upto) + 1]:
        orig = sys.modules[f"ropestep.{mod_name}"]
        src = Path(orig.__file__).read_text(encoding="utf-8")
        if mod_name == name:
            assert src.count(old) == 1, f"the planted line is not in {name}.py once: {old!r}"
            src = src.replace(old, new)
        mod = types.ModuleType(orig.__name__)
        mod.__file__, mod.__package__ = orig.__file__, "ropestep"
        monkeypatch.setitem(sys.modules, orig.__name__, mod)  # dataclasses look it up
        monkeypatch.setattr(ropestep, mod_name, mod)
        exec(compile(src, orig.__file__, "exec"), mod.__dict__)
        out = mod
    if upto == "train_families":
        out._smollm2_tokenizer = tf._smollm2_tokenizer  # the loaded tokenizer, not a reload
    return out


@pytest.mark.parametrize("bug, name, old, new, leaf", MUTANTS,
                         ids=[m[0][:40] for m in MUTANTS])
def test_a_planted_bug_turns_the_comparison_red(text_file, tmp_path, monkeypatch, bug, name,
                                                old, new, leaf):
    mod = mutated(name, old, new, monkeypatch)
    case = run_case(tmp_path, text_file, mod.main)
    monkeypatch.undo()
    problems, _ = compare(case.report, case.ref)
    print(bug, len(problems), problems[:3])
    assert any(leaf in p for p in problems), f"{bug}: no disagreement at {leaf}"


FORWARD_MUTANTS = [  # (the planted bug in the model's forward, the line, its mutation, where)
    ("RMSNorm without its eps", "+ self.eps) * self.weight", ") * self.weight", "layer 0"),
    ("the capture keeps the block's input before its norm", "a.detach(), heads.detach()",
     "h.detach(), heads.detach()", "layer 0"),
    ("the attention output without W_o",
     "out = self.o_proj(heads.transpose(1, 2).reshape(B, T, H * r))",
     "out = heads.transpose(1, 2).reshape(B, T, H * r)", "layer 1"),
    ("the MLP's GELU in its tanh approximation", "nn.GELU(),", 'nn.GELU(approximate="tanh"),',
     "layer 1"),
    ("the MLP reading the attention's norm", "return h + self.mlp(self.norm2(h))",
     "return h + self.mlp(self.norm1(h))", "layer 1"),
]


@pytest.mark.parametrize("bug, old, new, where", FORWARD_MUTANTS,
                         ids=[m[0][:40] for m in FORWARD_MUTANTS])
def test_a_planted_forward_bug_fails_the_input_check(tiny, monkeypatch, bug, old, new, where):
    """A bug in the model's forward moves its inputs away from the reference's forward of the
    same checkpoint: the float64 model's by more than the float64 bound.  (The float32 bound of
    the second layer is a worst case some thousand times the measured error, which the last two
    bugs stay inside.)"""
    mod = mutated("families", old, new, monkeypatch, upto="families")
    x64 = capture64(tiny.out, mod)
    monkeypatch.undo()
    problems = input_problems(tiny.ref, x64, U64_64)
    print(bug, problems[:2])
    assert any(where in p for p in problems), f"{bug}: no disagreement at {where}"
