"""``ropestep validate``'s ``report.json``, leaf by leaf, against
:mod:`ropestep.reference.validate`, the independent recomputation from the raw dump
(``--dump-raw``; docs/protocol.md section 12).

Every leaf of the report is accounted for: the leaves of a layer's ``reconstruction``, ``reuse``,
``calibration``, ``descent`` and ``fast`` sections (and its ``contexts``, the model's and the
protocol's sizes, and the ``verdict``) are recomputed by the reference and compared under a
tolerance derived for their kind of statistic (:class:`Derived`, :data:`FIELDS`); the run's
description is an echo of the dump's manifest (equal to it); a few leaves are exempt
(``EXEMPT``, ``LABELS``, ``VERDICT_LABELS``); the top-level ``contexts`` and each layer's
``real_heads`` are compared leaf by leaf by the modules that own their references
(``DELEGATED``: tests/test_reference_contexts.py, tests/test_reference_real_heads.py,
tests/test_reference_positional.py), called from here on the same run, and the verdict is
recomputed over every check, the real-head ones included.  A leaf that is none of these fails,
so a field added to the report without a reference fails -- a new real-head check too.  Counts and flags must be equal, which needs
every decision behind them to lie clear of its threshold by more than the two sides' rounding:
:func:`undecided` checks that on the data.  Planted one-line bugs (``MUTANTS``) must each turn
the comparison red; the verdict's failure path, which the passing data never take, is
exercised by planting one failing check in both the report and the reference (``FLIPS``).

The model: a tiny seeded Qwen2 (4 query heads on 2 KV heads, head_dim 16, hidden 64, q/k/v
biases) whose key weights are scaled up (scores spread over several units, far from uniform
attention), so that the unit step increases ``E`` on some rows and not on others in both
spaces, and the replication's query-space count differs from the input-space flag it must not
take.
"""
from __future__ import annotations

import fnmatch
import functools
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

from ropestep import cli, protocol
from ropestep import reuse_stats as rs
from ropestep import tolerances as tl
from ropestep.reference import validate as reference
from ropestep.report import dumps, load
from ropestep.verdict import loads
from reference_walk import missing_from, agrees, save_bpe_tokenizer, leaves, at, has, field_key, matches
from reference_walk import one_torch_thread  # noqa: F401  (autouse, module scope)
from reference_walk import assert_refuses_each

pytestmark = pytest.mark.model

HEAD_DIM, HIDDEN, HEADS, KV_HEADS = 16, 64, 4, 2
# weight scales (std) of q/k/v/o and of the q/k/v biases: keys 3x the queries' scale spread the
# scores (and the key Gram matrix, hence lambda_max) without saturating the softmax
WEIGHT_STD = {"q_proj": 0.15, "k_proj": 0.5, "v_proj": 0.2, "o_proj": 0.1}
BIAS_STD = {"q_proj": 0.3, "k_proj": 0.5, "v_proj": 0.2}
# 7 queries: (n - 1) k / 5 is never an integer for the bins' sets (12, 48 rows), see undecided()
TINY_ARGS = ["--corpus", "default", "--contexts", "2", "--queries", "7", "--prefix-len", "48",
             "--layers", "all", "--heads", "all", "--seed", "1", "--exact-rows", "0"]
F64 = torch.float64


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
            for name, std in WEIGHT_STD.items():
                getattr(blk.self_attn, name).weight.normal_(0.0, std, generator=g)
            for name, std in BIAS_STD.items():
                getattr(blk.self_attn, name).bias.normal_(0.0, std, generator=g)
    model.save_pretrained(path)
    return path


@dataclass
class Case:
    argv: list[str]  # the validate options (model included; without --out and --dump-raw)
    out: Path  # the report directory
    report: dict
    ref: reference.Reference
    seconds: dict
    contexts: Any = None  # reference.contexts.Contexts of the run (tests/test_reference_contexts)


def run_case(root: Path, args: list[str]) -> Case:
    """``ropestep validate`` with ``--dump-raw``, then the reference on the dump."""
    argv = [*args, "--quiet", "--no-figures"]
    t0 = time.perf_counter()
    assert cli.main(["validate", *argv, "--out", str(root / "validate"),
                     "--dump-raw", str(root / "raw")]) == 0
    t1 = time.perf_counter()
    ref = reference.recompute(root / "raw")
    from test_reference_contexts import contexts_reference

    ctx = contexts_reference(root / "raw", args[args.index("--model") + 1])
    t2 = time.perf_counter()
    return Case(argv, root / "validate", load(root / "validate" / "report.json"), ref,
                {"validate": t1 - t0, "reference": t2 - t1}, ctx)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("reference_validate")
    return run_case(root, ["--model", str(build_model(root / "model")), *TINY_ARGS])


# ---------------------------------------------------------------------------------------------
# the leaves and their classes
# ---------------------------------------------------------------------------------------------


EXEMPT = {  # leaves not computed from the data, with the reason
    ("schema",): "the format's name, a constant of the code",
    ("created_utc",): "the time the report was written",
    ("versions",): "package versions of the machine that ran it",
    ("hardware",): "the machine that ran it",
    ("timings",): "wall-clock timings",
    ("run",): "how the run was carried out: processes, which contexts each computed, where the "
              "model's modules were placed (the numbers do not depend on it: "
              "tests/test_distributed.py, tests/test_placement.py)",
    ("paper",): "the paper's published setup and numbers (constants), null off its setup",
}
LABELS = ("descent/space", "descent/rule", "descent/query_space/space",  # section-relative text
          "descent/query_space/rule", "descent/replication_style/space",
          "descent/replication_style/query", "calibration/distances/*",
          "reuse/heads_below_constant/rule")
DELEGATED = {  # sections compared leaf by leaf by another module's comparison (one reference)
    ("contexts",): "tests/test_reference_contexts.py::compare_contexts (section 12.8)",
    ("layers", "*", "real_heads"): "tests/test_reference_real_heads.py::compare_claims "
                                   "(section 12.9) and tests/test_reference_positional.py::"
                                   "compare_positional (section 12.10), each for its checks",
}
ECHOES = ("command", "config", "model", "corpus", "protocol", "seeds")  # the dump's manifest
SIZES = {"model": ("n_heads", "n_kv_heads", "head_dim", "hidden"),  # from the dumped shapes
         "protocol": ("contexts", "queries", "prefix_len", "query_position", "layers")}
SECTIONS = ("reconstruction", "reuse", "calibration", "descent", "fast", "contexts")
# a failure's description: its tolerance and text, and the value it failed with (the reference
# recomputes which checks fail, where; docs/protocol.md section 12.6)
VERDICT_LABELS = ("failures/*/value", "failures/*/tol", "failures/*/detail")


def leaf_class(path: tuple, delegated_checks: frozenset = frozenset()) -> str:
    """``exempt``, ``delegated``, ``label``, ``echo`` or ``recomputed``, else ``unknown``.  A
    ``real_heads`` leaf is delegated only under a check another comparison covered
    (``delegated_checks``, its names; the per-context ``context`` index too)."""
    if any(matches(path, p) for p in EXEMPT):
        return "exempt"
    if path[0] == "contexts":
        return "delegated"
    if matches(path, ("layers", "*", "real_heads")) and len(path) >= 4:
        name = path[5] if path[3] == "per_context" and len(path) >= 6 else path[3]
        return "delegated" if name in delegated_checks or (
            path[3] == "per_context" and name == "context" and delegated_checks) else "unknown"
    if path[0] == "layers" and len(path) >= 3 and path[2] in SECTIONS:
        key = field_key(path[2:])
        return "label" if any(fnmatch.fnmatchcase(key, p) for p in LABELS) else "recomputed"
    if path[0] in SIZES and len(path) >= 2 and path[1] in SIZES[path[0]]:
        return "recomputed"
    if path[0] == "verdict":
        key = field_key(path[1:])
        return "label" if any(fnmatch.fnmatchcase(key, p) for p in VERDICT_LABELS) else \
            "recomputed"
    if path[0] in ECHOES:
        return "echo"
    return "unknown"


# ---------------------------------------------------------------------------------------------
# tolerances, derived per kind of statistic
# ---------------------------------------------------------------------------------------------
def icheck(kappa, n: int, d: int, sigma) -> np.ndarray:
    """``identity_check_tol`` in float64: two readout-type sums of condition ``kappa`` over ``n``
    keys compared, relative to the value scale (tolerances.py)."""
    return np.asarray(tl.identity_check_tol(F64, kappa, n, d, sigma), dtype=np.float64)


def gamma(n: int) -> float:
    """``gamma_n`` in float64: ``n`` rounded operations on non-negative operands."""
    return tl.nonnegative_ops_rel(n)


def mse_tol(mse: float, delta: float, n: int) -> float:
    """A mean square of ``n`` entries each within ``delta`` of the exact difference:
    ``mean(2 |e| delta + delta^2) <= 2 sqrt(mse) delta + delta^2`` (Cauchy-Schwarz), plus both
    sides' rounding of the ``n + 2`` non-negative operations."""
    return 2 * math.sqrt(mse) * delta + delta ** 2 + 2 * gamma(n + 2) * mse


def ratio_tol(x: float, tx: float, y: float, ty: float) -> float:
    """``sqrt(x / y)`` with ``x`` within ``tx`` and ``y`` within ``ty``: the farthest end of the
    interval, plus both sides' rounding of a quotient and a square root."""
    v = math.sqrt(x / y)
    hi = math.sqrt((x + tx) / (y - ty)) if y > ty else math.inf
    lo = math.sqrt(max(x - tx, 0.0) / (y + ty))
    return max(hi - v, v - lo) + 2 * gamma(2) * v


def root_tol(x: float, tx: float) -> float:
    """``sqrt(x)`` with ``x`` within ``tx``, plus both sides' rounding of the root."""
    v = math.sqrt(x)
    return max(math.sqrt(x + tx) - v, v - math.sqrt(max(x - tx, 0.0))) + 2 * gamma(1) * v


def quotient_tol(num: np.ndarray, dn: np.ndarray, den: np.ndarray, dd: np.ndarray) -> np.ndarray:
    """``num / den`` (norms, non-negative) with ``num`` within ``dn`` and ``den`` within ``dd``,
    per row: the interval's farthest end (inf where ``dd`` reaches ``den``)."""
    v = num / den
    with np.errstate(divide="ignore"):
        hi = np.where(den > dd, (num + dn) / np.maximum(den - dd, 1e-300), np.inf)
    lo = np.maximum(num - dn, 0.0) / (den + dd)
    return np.maximum(hi - v, v - lo)


class Derived:
    """The tolerances of one layer, from :mod:`ropestep.tolerances`, the run's sizes and the
    reference's per-query values (docs/protocol.md section 12 names every symbol used).

    The report evaluates in float64 from its own float64 projections of the captured inputs;
    the reference's outputs are exact (mpmath) from its own projections.  The base errors,
    per component, of the report's values against the exact ones:

    * ``ey = a64 V``: a softmax output, a mean, a self mass (times ``V``): two evaluations of a
      condition-1 mean whose scores and values come from ``m``-term projections -- the
      whole-layer agreement level ``a64 = agreement_rel_tol(float64, N + 1, d, m)``;
    * ``eP``/``eF``: the materialised readout ``mu + u^T Delta M`` against the report's own
      softmax output, prefix/full bank: ``max(a64, identity_check_tol(kappa))`` times ``V``
      (as tests/test_protocol.py derives it: the readout's ``m``-term products are inside the
      agreement level with ``hidden = m``, its condition number in ``identity_check_tol``);
    * ``eFx = eF + a64 V``: that readout against the exact output (the two sides' projections
      differ by the agreement level);
    * ``efr = (identity_check_tol(kappa_fr) + a64) V``: a frozen prediction ``mu + q_i T_a``,
      a readout of the anchor's terms read with query ``i``'s query;
    * ``elin = a64 V (1 + 3 max_j qk_ij)``: the linearised predictor, whose scores carry the
      agreement level times ``qk_ij = sum_l |q_il| |k~_jl|`` (>= |s_ij|), entering through
      ``s v`` and ``mu s`` (each value ``<= V``);
    * a projection ``z W_o,h`` adds ``ey w1`` to ``err(z) w1`` per component
      (``w1 = max_D sum_l |W_o,h[l, D]|``), and a sum over heads adds the heads' bounds; a
      Euclidean norm over ``D`` (``r``) components is within ``sqrt(D)`` (``sqrt(r)``) times a
      componentwise bound.
    """

    def __init__(self, ref: reference.Reference, layer: int):
        facts = ref.manifest["layers"][str(layer)]
        self.L = layer
        self.d, self.m, self.r, self.H = (facts[k] for k in ("head_dim", "hidden", "r",
                                                              "n_heads"))
        self.D = facts["out"]
        self.contexts = sorted(c for (L, c) in ref.rows if L == layer)
        self.items = [ref.rows[(layer, c)] for c in self.contexts]
        self.heads = list(ref.manifest["protocol"]["heads"])
        hr0 = self.items[0][0][0]
        self.Q, self.N = hr0.y.shape[0], hr0.qk.shape[1]
        self.a64 = tl.agreement_rel_tol(F64, self.N + 1, self.d, self.m)
        self.report = ref.report["layers"][str(layer)]

    # -- base errors of one head of one context --
    @functools.lru_cache(maxsize=None)
    def base(self, c: int, h: int) -> dict[str, Any]:
        hr = self.items[c][0][h]
        V, N, d = hr.V, self.N, self.d
        ey = self.a64 * V
        return {
            "hr": hr, "V": V, "ey": ey, "w1": float(np.abs(hr.w_o).sum(axis=0).max()),
            "Z": max(float(np.max(np.abs(z))) for z in (hr.y, hr.yF, hr.mu, hr.frozen,
                                                        hr.linear)),
            "eP": np.maximum(self.a64, icheck(hr.kappa_P, N, d, hr.sigma_P)) * V,
            "eF": np.maximum(self.a64, icheck(hr.kappa_F, N + 1, d, hr.sigma_F)) * V,
            "eFx": (np.maximum(self.a64, icheck(hr.kappa_F, N + 1, d, hr.sigma_F))
                    + self.a64) * V,
            "efr": (icheck(hr.kappa_fr, N, d, hr.sigma_P[None, :]) + self.a64) * V,
            "elin": ey * (1 + 3 * hr.qk.max(axis=1)),
            "etok": icheck(np.maximum(hr.kappa_tok, hr.kappa_fr[0]), N, d, hr.sigma_P) * V,
        }

    def proj(self, c: int, h: int, err) -> np.ndarray:
        """Componentwise bound of ``z W_o,h`` from that of ``z``."""
        b = self.base(c, h)
        return (np.asarray(err) + b["ey"]) * b["w1"]

    def write(self, c: int, err: Callable[[int], Any]) -> np.ndarray:
        """Componentwise bound of the summed write ``sum_h z_h W_o,h`` (all heads) from the
        heads' bounds ``err(h)`` (``sum_h err(h) w1_h``), plus the rounding of the projection
        and the head sum, ``H r`` products and additions on each side: ``2 gamma_(H r + 1)``
        times the write's scale ``max_D sum_h Z_h sum_l |W_o[h, l, D]|`` (a bound of the sum of
        its terms' absolute values; ``Z_h`` the largest entry of any per-head vector that is
        projected: ``y``, ``y^F``, ``mu``, the frozen and linear predictions)."""
        hrs = self.items[c][0]
        wscale = float(np.max(sum(self.base(c, h)["Z"] * np.abs(hr.w_o).sum(axis=0)
                                  for h, hr in enumerate(hrs))))
        return sum(np.asarray(err(h)) * self.base(c, h)["w1"] for h in range(self.H)) \
            + 2 * gamma(self.H * self.r + 1) * wscale

    # -- reconstruction --
    def recon(self, c: int, h: int | str, fld: tuple, row: dict) -> float:
        """A row's field (``("native", "mse")``, ``("relation_max_abs",)``, ...): an
        identity-type error (exact value 0) within its bound, or a difference with the model's
        own numbers within the readout's error against the exact output."""
        name, kind = fld[0], fld[-1]
        if name in ("cache_vs_full_forward_max_abs",):
            return 0.0  # a difference of two captured float32 numbers: exact in float64
        if name in ("self_mass_mean", "self_mass_vs_native_max_abs"):
            return self.a64  # a softmax weight, condition 1
        comb = h == "combined"
        if comb:
            hd = {"prefix": lambda g: np.max(self.base(c, g)["eP"]),
                  "full": lambda g: np.max(self.base(c, g)["eF"]),
                  "relation_max_abs": lambda g: self.base(c, g)["ey"],
                  "native": lambda g: np.max(self.base(c, g)["eFx"]),
                  "native_observed_full_forward": lambda g: self.base(c, g)["eFx"][0]}[name]
            delta = float(self.write(c, hd))
            n = self.Q * self.D if name == "native" else self.D
        else:
            b = self.base(c, h)
            delta = float({"prefix": np.max(b["eP"]), "full": np.max(b["eF"]),
                           "relation_max_abs": b["ey"], "mean_max_abs": b["ey"],
                           "projected_prefix": self.proj(c, h, np.max(b["eP"])),
                           "projected_full": self.proj(c, h, np.max(b["eF"])),
                           "native": np.max(b["eFx"]),
                           "native_observed_full_forward": b["eFx"][0]}[name])
            n = {"native": self.Q * self.r, "native_observed_full_forward": self.r}.get(
                name, self.Q * self.D)
        if kind != "mse":
            return delta
        if name.startswith("native"):
            return mse_tol(row[name]["mse"], delta, n)  # against the model: a real difference
        return delta ** 2  # a rounding error: mse <= max_abs^2

    def recon_rows(self, h: int | str, fld: tuple) -> float:
        """A pooled field of ``per_head``/``combined``: the worst of its rows' tolerances (a
        mean or max of values each within its tolerance), plus the mean's rounding."""
        rows = self.report["reconstruction"]["rows"]
        tols = [self.recon(r["context"], h, fld, r) for r in rows if r["head"] == h]
        vals = [at(r, fld) for r in rows if r["head"] == h]
        return max(tols) + 2 * gamma(len(vals) + 1) * max(vals)

    # -- reuse --
    @functools.lru_cache(maxsize=None)
    def reuse_errors(self, c: int, h: int | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per predictor (and ``target``) the anchors' ``E_a`` and their tolerances
        ``sum_{i != a} (2 |f - o| delta + delta^2) / ((Q-1) D)``, ``delta`` the Euclidean
        bound of ``f_ai - o_i`` (the predictor's and the target's bounds, projected), plus both
        sides' rounding of the sum."""
        hrs, wr = self.items[c]
        Q, D = self.Q, self.D
        if h is None:
            t = {"target": wr.o, "mean": wr.mean, "frozen": wr.frozen, "linear": wr.linear}
        else:
            t = reference.head_target(hrs[h])

        def projected(f: str) -> np.ndarray:  # componentwise bound of f's projected prediction
            if h is None:
                return self.write(c, lambda g: self.errors(c, g)[f])
            return self.proj(c, h, self.errors(c, h)[f])

        out = {}
        for f in (*reference.PREDICTORS, "target"):
            if f == "target":  # the zero predictor: only the target's own error
                pred, bound = np.zeros((Q, Q, D)), projected("target")
            else:
                pred = reference.predictions(f, t["target"], t["mean"], t["frozen"],
                                             t["linear"])
                bound = projected(f) + projected("target")
            delta = math.sqrt(D) * np.broadcast_to(bound, (Q, Q))
            dist = np.linalg.norm(pred - t["target"][None], axis=-1)  # (A, Q)
            off = ~np.eye(Q, dtype=bool)
            E = reference.anchor_errors(pred, t["target"])
            tol = np.sum(np.where(off, 2 * dist * delta + delta ** 2, 0.0), axis=1) / (
                (Q - 1) * D) + 2 * gamma((Q - 1) * D + 2) * E
            out[f] = (E, tol)
        return out

    def errors(self, c: int, h: int) -> dict[str, np.ndarray]:
        """Componentwise bounds (in ``R^r``) of each predictor's ``[a, i]`` prediction."""
        b = self.base(c, h)
        Q, ey = self.Q, b["ey"]
        return {"target": np.full((Q, Q), ey), "constant": np.full((Q, Q), ey),
                "mean": np.full((Q, Q), ey), "frozen": b["efr"],
                "linear": np.broadcast_to(b["elin"], (Q, Q))}

    def pooled(self, f: str, s: str, h: int | None) -> tuple[float, float]:
        """The pooled ``E(f)`` (``anchor0`` or ``all``) and its tolerance: a mean of values
        each within its tolerance, plus the mean's rounding."""
        parts = [self.reuse_errors(c, h)[f] for c in range(len(self.items))]
        pick = (lambda a: a[0]) if s == "anchor0" else np.mean
        E = float(np.mean([pick(e) for e, _ in parts]))
        return E, float(np.mean([pick(t) for _, t in parts])) + 2 * gamma(
            self.Q + len(parts) + 2) * E

    def reuse(self, rest: tuple, h: int | None) -> float:
        """``predictors/f/{mse, rrmse, rrmse_vs_mean}/s`` and ``target_rms/s``."""
        if rest[0] == "target_rms":
            return root_tol(*self.pooled("target", rest[1], h))
        f, kind, s = rest[1], rest[2], rest[3]
        if kind == "mse":
            return self.pooled(f, s, h)[1]
        base = "constant" if kind == "rrmse" else "mean"
        return ratio_tol(*self.pooled(f, s, h), *self.pooled(base, s, h))

    def per_context(self, f: str, s: str, c: int) -> float:
        _, tol = self.reuse_errors(c, None)[f]
        return float(tol[0] if s == "anchor0" else np.mean(tol) + 2 * gamma(self.Q) * tol.max())

    # -- calibration --
    @functools.lru_cache(maxsize=None)
    def calib_rows(self, c: int, h: int | str) -> dict[str, np.ndarray]:
        """Per row ``i >= 1`` the values and tolerances of ``rel`` and the distances, and the
        gain fit's ``r``, ``g`` with componentwise bounds ``dr``, ``dg`` (``R^r``; ``R^D`` for
        the combined write, ``h = "combined"``)."""
        hrs, wr = self.items[c]
        if h == "combined":
            e, dev = (wr.o - wr.frozen[0])[1:], (wr.o - wr.mean)[1:]
            de = self.write(c, lambda g: self.base(c, g)["ey"] + self.base(c, g)["efr"][0])[1:]
            dd = self.write(c, lambda g: 2 * self.base(c, g)["ey"])
            n, root = self.D, math.sqrt(self.D)
            tv = np.mean([hrs[g].dist["tv"][1:] for g in self.heads], axis=0)
            out = {"input": hrs[0].dist["input"][1:], "tv_mean_over_heads": tv,
                   "d_tv_mean_over_heads": np.full(tv.shape, self.a64 + 2 * gamma(
                       len(self.heads) + 1) * tv.max())}
            g_ = wr.g[1:]
        else:
            b = self.base(c, h)
            hr = b["hr"]
            e, dev = (hr.y - hr.frozen[0])[1:], (hr.y - hr.mu)[1:]
            de, dd = (b["ey"] + b["efr"][0])[1:], 2 * b["ey"]
            n, root = self.r, math.sqrt(self.r)
            qmax = hr.qk.max(axis=1)
            out = {k: hr.dist[k][1:] for k in reference.DISTANCES}
            out.update(d_score_sup=self.a64 * (qmax[1:] + qmax[0]),
                       d_tv=np.full(self.Q - 1, self.a64))
            g_ = hr.g[1:]
        out["d_input"] = 2 * gamma(self.m + 4) * out["input"]
        ne, nd = np.linalg.norm(e, axis=1), np.linalg.norm(dev, axis=1)
        dd = np.broadcast_to(dd, ne.shape)
        out["rel"] = ne / nd
        out["d_rel"] = quotient_tol(ne, root * de, nd, root * dd) + 2 * gamma(n + 3) * out["rel"]
        out.update(r=dev, g=g_, dr=np.broadcast_to(dd, ne.shape)[:, None],
                   dg=np.broadcast_to(de, ne.shape)[:, None])
        return out

    def calib_set(self, key: str, h: int | str) -> tuple[np.ndarray, np.ndarray]:
        """The values and tolerances of a set in report order: one head's rows over the
        contexts, ``"pooled"`` (context, head, query) or ``"combined"``."""
        if h == "pooled":
            parts = [self.calib_rows(c, g) for c in range(len(self.items)) for g in self.heads]
        else:
            parts = [self.calib_rows(c, h) for c in range(len(self.items))]
        return (np.concatenate([p[key] for p in parts]),
                np.concatenate([p[f"d_{key}"] for p in parts]))

    def stat(self, key: str, h: int | str) -> float:
        """A median, mean, min, max or quantile of a set: the worst tolerance of its values
        (order statistics and linear interpolations are 1-Lipschitz in the sup norm; a mean
        too), plus the mean's rounding."""
        v, t = self.calib_set(key, h)
        return float(t.max() + 2 * gamma(v.size + 1) * np.abs(v).max())

    def gain(self, h: int | str) -> dict[str, float]:
        """Tolerances of ``gamma = sum <r, g> / sum |g|^2`` and the three mean squares, from the
        componentwise bounds of ``r`` and ``g``, plus both sides' rounding of the sums."""
        parts = [self.calib_rows(c, h) for c in range(len(self.items))]
        r, g = (np.concatenate([p[k] for p in parts]) for k in ("r", "g"))
        dr, dg = (np.broadcast_to(np.concatenate([p[k] for p in parts]), r.shape)
                  for k in ("dr", "dg"))
        K = r.size
        den, num = float(np.sum(g * g)), float(np.sum(r * g))
        gam = num / den
        num_err = float(np.sum(dr * np.abs(g) + np.abs(r) * dg + dr * dg)) \
            + 2 * gamma(K) * float(np.sum(np.abs(r * g)))
        den_err = float(np.sum(2 * np.abs(g) * dg + dg * dg)) + 2 * gamma(K) * den
        t_gam = (num_err + abs(gam) * den_err) / (den - den_err)

        def ms(z, dz):  # a mean square of K entries, each within dz
            return float(np.mean(2 * np.abs(z) * dz + dz * dz)) + 2 * gamma(K + 2) * float(
                np.mean(z * z))

        return {"gamma": t_gam, "mse_frozen": ms(r - g, dr + dg),
                "mse_after_gain": ms(r - gam * g, dr + abs(gam) * dg + t_gam * np.abs(g)),
                "mse_mean": ms(r, dr), "values": {"mse_frozen": float(np.mean((r - g) ** 2)),
                                                  "mse_after_gain": float(
                                                      np.mean((r - gam * g) ** 2))}}

    def tokenwise(self, c: int, h: int) -> float:
        """``max |t - e| / max |e|`` (exact value 0): both are float64 sums of the tokenwise
        terms and of ``y`` minus the frozen readout, each within its readout bound, over the
        smallest the denominator can be."""
        b = self.base(c, h)
        hr = b["hr"]
        emax = float(np.max(np.abs(hr.y - hr.frozen[0])[1:]))
        num = float(np.max(b["etok"][1:]))
        return num / (emax - num)

    def crosscheck(self, c: int) -> float:
        """Two float64 evaluations of ``mu + q_i T_0``: each within its readout bound."""
        return max(float(np.max(icheck(self.base(c, h)["hr"].kappa_fr[0], self.N, self.d,
                                       self.base(c, h)["hr"].sigma_P))) * self.base(c, h)["V"]
                   for h in range(self.H))

    def refresh(self, c: int) -> float:
        """``frozen + tokenwise - y``: the tokenwise sum's and the frozen readout's bounds and
        ``y``'s rounding."""
        return max(float(np.max(self.base(c, h)["etok"])) + self.base(c, h)["ey"]
                   for h in range(self.H))

    # -- descent --
    @functools.lru_cache(maxsize=None)
    def descent_rows(self, c: int, h: int, space: str) -> dict[str, np.ndarray]:
        """``lam`` with its tolerance and the guard of each flag (docs: :func:`undecided`).

        ``lambda_max``: the report's factor form within ``descent_bound`` of its size
        (``|[L | e]|_F^2 tr G`` in input space, ``tau^2 tr G`` in query space) plus the
        agreement level of its projections times that size; the reference's Gram matrix
        within the agreement level of its entries, ``d a64 lambda`` (rank <= d: the trace is
        at most ``d lambda``, by Weyl).  A flag compares ``E(B)`` with ``E(0)``: both within that
        relative level of ``E(0) + quad + |B|^2``, and ``B`` within ``a64 cond`` of itself."""
        hr = self.items[c][0][h]
        d = {k: np.atleast_1d(v) for k, v in hr.descent.items()}
        n = self.N + (1 if space == "rep" else 0)
        sigma = float(hr.sigma_F[0] if space == "rep" else np.max(hr.sigma_P))
        # the size of the evaluated terms: tr H = tau^2 tr G in query space, and
        # |[L | e]|_F^2 tr G = (tau^2 |W^_q|_F^2 + 1) tr G in input space
        size = d["trace_q"] * (hr.lq2 + 1) / hr.tau ** 2 if space == "in" \
            else d[f"trace_{space}"]
        rel = tl.descent_bound(F64, 1.0, n, self.d, self.m, sigma) + self.a64
        lam = d[f"lam_{space}"]
        guard = 3 * rel * np.maximum(1.0, d[f"cond_{space}"]) * (
            d[f"e0_{space}"] + d[f"size_{space}"])
        return {"lam": lam, "d_lam": rel * size + self.d * self.a64 * lam,
                "delta": d[f"delta_{space}"], "guard": guard}

    def lam_set(self, space: str, h: int | None) -> tuple[np.ndarray, np.ndarray]:
        """``lambda`` and its tolerances over a head's rows (context, query), or all reported
        heads' (head, context, query); ``rep``: the replication's pairs."""
        heads = self.heads if h is None else [h]
        parts = [self.descent_rows(c, g, space) for g in heads for c in range(len(self.items))]
        return (np.concatenate([p["lam"] for p in parts]),
                np.concatenate([p["d_lam"] for p in parts]))

    def lam_stat(self, space: str, h: int | None) -> float:
        v, t = self.lam_set(space, h)
        return float(t.max() + 2 * gamma(v.size + 1) * np.abs(v).max())

    # -- fast --
    def fast_base(self, c: int, h: int, dt: str, gauge: str) -> dict[str, Any]:
        """The fast path's readout in ``dt`` and ``gauge`` against the exact output of its own
        rounded problem (``FastRows.yF``), per query: ``efast = (a32 + identity_check_tol(
        float32, kappa, N + 1, d, max|s|)) V`` -- the float32 projections of the rounded
        inputs (the whole-layer agreement level with ``hidden = m``) plus the readout sum's
        error at the gauge's condition number -- and ``eid``, the fast path's softmax output
        against its own readout (shared projections: ``identity_check_tol`` alone)."""
        f = self.items[c][0][h].fast[dt]
        a32 = tl.agreement_rel_tol(torch.float32, self.N + 1, self.d, self.m)
        ic = np.asarray(tl.identity_check_tol(torch.float32, f.kappa_hi[gauge], self.N + 1,
                                              self.d, f.sigma), dtype=np.float64)
        return {"f": f, "efast": (a32 + ic) * f.V, "eid": ic * f.V}

    def fast_delta(self, c: int, h: int | str, dt: str, gauge: str, part: str) -> float:
        """Componentwise bound of the report's difference minus the exact one (per context):
        ``vs_float64``: the fast readout's ``efast``, the report's float64 ``y^F`` (``eFx``) and
        the reference's float64 evaluation of the rounded problem (``a64 V``); ``vs_native``:
        ``efast`` and ``a64 V``; ``identity`` (exact value 0): ``eid``.  The combined write
        sums the heads' bounds times ``w1`` (:meth:`write`)."""
        def head(g: int) -> float:
            fb, b = self.fast_base(c, g, dt, gauge), self.base(c, g)
            if part == "identity":
                return float(np.max(fb["eid"]))
            extra = float(np.max(b["eFx"])) if part == "vs_float64" else 0.0
            return float(np.max(fb["efast"])) + extra + self.a64 * fb["f"].V

        if h == "combined":
            return float(self.write(c, head))
        return head(h)

    def fast_tol(self, dt: str, gauge: str, h: int | str, part: str, kind: str) -> float:
        """A pooled field (``mse``: the mean over contexts, ``max_abs``: the max): each
        context's value within its bound (``mse_tol`` around the exact mean square, or the
        bound squared for the identity), plus the mean's rounding."""
        tols, vals = [], []
        for c in range(len(self.items)):
            delta = self.fast_delta(c, h, dt, gauge, part)
            if kind == "max_abs":
                tols.append(delta)
                continue
            hrs, wr = self.items[c]
            if part == "identity":
                tols.append(delta ** 2)
                continue
            if h == "combined":
                w = sum(x.fast[dt].yF @ x.w_o for x in hrs) + wr.bias
                other, n = (wr.writeF if part == "vs_float64" else wr.native), self.Q * self.D
            else:
                w, x = hrs[h].fast[dt].yF, hrs[h]
                other, n = (x.yF if part == "vs_float64" else x.native), self.Q * self.r
            mse = float(np.mean((w - other) ** 2))
            vals.append(mse)
            tols.append(mse_tol(mse, delta, n))
        return max(tols) + (2 * gamma(len(vals) + 1) * max(vals) if vals else 0.0)

    def fast_kappa(self, dt: str, gauge: str) -> float:
        """``kappa`` (median of the contexts' lower medians, max) over every head and query:
        the worst error of one query's float32 condition number (order statistics and a mean
        are 1-Lipschitz), ``sum_j |c_j| A_j V_j / S`` with each factor's float32 error: the
        coefficients ``e^(3 ds) - 1`` relative plus a few ulp (each score within ``ds``, the
        coefficient 1-Lipschitz in each score in log scale, ``Z`` too), ``A_j`` within ``dA_j``
        (``k_dA``), ``V_j`` within ``3 dv + 2 gamma_(N+1) S`` (``k_A``), ``S`` within ``dv``, the
        sum ``gamma_(N+r+8)`` in float32; for the max key, also the spread of ``kappa`` over the
        keys within ``2 ds`` of the top (``kappa_spread``), any of which float32 may take."""
        worst_err = 0.0
        u = tl.unit_roundoff(torch.float32)
        for hrs, _ in self.items:
            for hr in hrs:
                f = hr.fast[dt]
                e = (f.kappa_spread[gauge] + f.k_dA[gauge]
                     + f.kappa_hi[gauge] * (np.expm1(3 * f.ds) + 8 * u)
                     + f.k_A[gauge] * (3 * f.dv + 2 * (self.N + 1) * u * f.S)
                     + f.kappa_hi[gauge] * (f.dv / f.S + (self.N + self.r + 8) * u))
                worst_err = max(worst_err, float(np.max(e)))
        return worst_err + 2 * gamma(len(self.items) + 1) * worst_err


def exact(D: Derived, rest: tuple, value: Any) -> float:
    """Counts, flags, indices, constants, fractions of counts (one correctly rounded division
    on both sides): equal."""
    return 0.0


def rounded6(tol: float, value: Any) -> float:
    """A value rounded to 6 significant digits on both sides: within the unrounded values'
    tolerance plus one unit of the 6th digit (at most ``1e-5 |v|``)."""
    return tol + 1e-5 * abs(float(value))


def head_of(D: Derived, section: str, k: int) -> int:
    return D.report[section]["per_head"][k]["head"]


def recon_field(D: Derived, rest: tuple, value: Any) -> float:
    """``reconstruction``: a row's field (context and head from the reference's row), a head's
    pooled field or the combined one's."""
    part = rest[1]
    if part == "rows":
        row = D.report["reconstruction"]["rows"][rest[2]]
        return D.recon(row["context"], row["head"], rest[3:], row)
    h = "combined" if part == "combined" else head_of(D, "reconstruction", rest[2])
    fld = rest[2:] if part == "combined" else rest[3:]
    return D.recon_rows(h, fld)


def reuse_field(D: Derived, rest: tuple, value: Any) -> float:
    """``reuse``: the table (combined or a head's), ``per_context`` and the range of
    ``heads_below_constant``."""
    part = rest[1]
    if part == "combined":
        return D.reuse(rest[2:], None)
    if part == "per_head":
        return D.reuse(rest[3:], head_of(D, "reuse", rest[2]))
    if part == "per_context":
        return D.per_context(rest[2], rest[3], rest[4])
    # heads_below_constant/range/k: one of the heads' all-anchor frozen rRMSE
    return max(D.reuse(("predictors", "frozen", "rrmse", "all"), h) for h in D.heads)


def calib_block(D: Derived, rest: tuple, h: int | str, value: Any) -> float:
    """A ``relative_error``/``distances`` block of ``calibration``: statistics of the set,
    Spearman (ranks equal on both sides: :func:`undecided`; an exact quotient of integer sums
    rounded by a square root, a product and a division), bin edges (a linear interpolation of
    the sorted values: 3 times their worst tolerance), bin counts (exact), bin medians and 0.9
    quantiles of ``rel`` (order statistics of a subset)."""
    if rest[0] == "relative_error":
        return exact(D, rest, None) if rest[1] in ("n", "nonfinite") else D.stat("rel", h)
    name, what = rest[1], rest[2]
    if what == "spearman":
        return 2 * gamma(3) * abs(value)
    if what == "summary":
        return 0.0 if rest[3] in ("n", "nonfinite") else D.stat(name, h)
    kind = rest[4]  # bins/k/kind
    if kind == "n":
        return 0.0
    if kind in ("x_lo", "x_hi"):
        return 3 * D.stat(name, h)
    return D.stat("rel", h)


def calib_field(D: Derived, rest: tuple, value: Any) -> float:
    part = rest[1]
    if part == "anchor":
        return 0.0
    if part == "per_head":
        h = head_of(D, "calibration", rest[2])
        fld = rest[3]
        if fld in ("head", "bound_violations"):
            return 0.0
        if fld in ("gamma", "mse_frozen", "mse_after_gain", "mse_mean"):
            return D.gain(h)[fld]
        if fld == "tokenwise_max_rel":
            return max(D.tokenwise(c, h) for c in range(len(D.items)))
        return calib_block(D, rest[3:], h, value)
    if part == "pooled_heads":
        return calib_block(D, rest[2:], "pooled", value)
    if part == "combined":
        return combined_calib(D, rest[2:], value)
    if part == "checks":
        return checks_field(D, rest[2:])
    return points_field(D, rest[2:], value)


def combined_calib(D: Derived, rest: tuple, value: Any) -> float:
    """``calibration.combined``: the write-space gain fit, its rRMSEs against the pooled
    constant-output error, and the statistics of ``rel^o``."""
    if rest[0] in ("gamma", "mse_frozen", "mse_after_gain"):
        return D.gain("combined")[rest[0]]
    if rest[0] in ("rrmse_frozen", "rrmse_after_gain"):
        kind = rest[0].replace("rrmse", "mse")
        g = D.gain("combined")
        return ratio_tol(g["values"][kind], g[kind], *D.pooled("constant", "anchor0", None))
    return calib_block(D, rest, "combined", value)


def checks_field(D: Derived, rest: tuple) -> float:
    """``calibration.checks``: rounding errors (exact value 0) within their bounds, counts and
    flags equal."""
    C = range(len(D.items))
    if rest[0] == "tokenwise_max_rel":
        return max(D.tokenwise(c, h) for c in C for h in range(D.H))
    if rest[0] == "frozen_crosscheck_max_abs":
        return max(D.crosscheck(c) for c in C)
    if rest[0] == "refresh_identity_max_abs":
        return max(D.refresh(c) for c in C)
    if rest[0] == "per_context":
        c, fld = rest[1], rest[2]
        return {"tokenwise_rel": lambda: D.tokenwise(c, rest[3]),
                "frozen_crosscheck_max_abs": lambda: D.crosscheck(c),
                "refresh_identity_max_abs": lambda: D.refresh(c)}.get(fld, lambda: 0.0)()
    return 0.0


def points_field(D: Derived, rest: tuple, value: Any) -> float:
    """``calibration.points``: each point's own tolerance, then 6 significant digits."""
    name, k = rest[0], rest[1]
    if name == "head":
        return 0.0
    if name in ("rel_combined", "input_combined"):
        _, t = D.calib_set(name.split("_")[0], "combined")
    else:
        _, t = D.calib_set(name, "pooled")
    return rounded6(float(t[k]), value)


def descent_field(D: Derived, rest: tuple, value: Any) -> float:
    """``descent`` and ``descent.query_space``: ``lambda`` statistics within the worst row
    tolerance, points rounded to 6 digits; ``replication_style``'s over its pairs; counts,
    fractions of counts and flags equal."""
    rest = rest[1:]
    space = "in"
    if rest[0] == "query_space":
        space, rest = "q", rest[1:]
    if rest[0] == "replication_style":
        return D.lam_stat("rep", None) if rest[1].startswith("lam_max") else 0.0
    if rest[0] == "per_head":
        h = D.heads[rest[1]]
        if rest[2] == "lam_max" and rest[3] not in ("n", "nonfinite"):
            return D.lam_stat(space, h)
        return 0.0
    if rest[0] == "lam_max":
        return 0.0 if rest[1] in ("n", "nonfinite") else D.lam_stat(space, None)
    if rest[0] == "points" and rest[1] == "lam_max":
        return rounded6(float(D.lam_set(space, None)[1][rest[2]]), value)
    return 0.0


def fast_field(D: Derived, rest: tuple, value: Any) -> float:
    """``fast["<dtype>/<gauge>"]``: ``heads[k].{vs_float64, vs_native, identity}.{mse,
    max_abs}``, ``combined.{vs_float64, vs_native}.{...}`` and ``kappa.{median, max}``.

    What is checked, and why nothing stronger is possible: the fast path rounds in float32
    (bfloat16: float32 arithmetic on inputs and weights rounded to bfloat16), in an order no
    reference can reproduce, so its errors are not recomputable to the last digit.  Each is
    ``|fast - other|`` (or its mean square) with ``other`` an exact quantity or the model's own
    number; the reference computes the exact value of the same expression with ``fast``
    replaced by the exact output of the fast path's own rounded problem (``FastRows.yF``, the
    bf16 rounding of the inputs included), and the report's number must lie within the
    derived bound of the fast path's arithmetic (:meth:`Derived.fast_delta`; triangle
    inequality for ``max_abs``, ``mse_tol`` for ``mse``).  That is the report's number pinned
    to an interval whose width is the rounding the fast path may do and no more: a comparison
    against the wrong tensor, a wrong bank, gauge or write moves it far outside (the float32
    bound is ~1e-4 of the value scale; bf16's own effect, ~1e-2, is predicted, not allowed)."""
    key = rest[1]
    dt, gauge = key.split("/")
    if rest[2] == "kappa":
        return D.fast_kappa(dt, gauge)
    if rest[2] == "heads":
        h = D.report["fast"][key]["heads"][rest[3]]["head"]
        return D.fast_tol(dt, gauge, h, rest[4], rest[5])
    return D.fast_tol(dt, gauge, "combined", rest[3], rest[4])


SECTION_FIELDS: dict[str, Callable[[Derived, tuple, Any], float]] = {
    "reconstruction": recon_field, "reuse": reuse_field, "calibration": calib_field,
    "descent": descent_field, "fast": fast_field, "contexts": exact,
}
EXACT_RECON = ("tolerances", "rows_passed", "rows_total", "rows_passed_identity",
               "rows_passed_native")
EXACT_LEAVES = ("head", "context", "pass", "rows", "heads", "count", "of", "nonfinite",
                "predictor", "anchors", "increase", "pairs", "increases", "frac_lam_gt_2",
                "frac_rows_increase", "heads_increasing", "fraction_heads_increasing",
                "fraction_rows_increasing", "bound_violations", "n")


def is_exact(rest: tuple, value: Any) -> bool:
    """Counts, flags, indices, labels and constants: compared for equality."""
    last = next((p for p in reversed(rest) if isinstance(p, str)), "")
    return (isinstance(value, (bool, str)) or value is None or last.startswith("pass")
            or last.endswith("_pass") or last in EXACT_LEAVES
            or (rest[0] == "reconstruction" and rest[1] in EXACT_RECON))


def tolerance(D: Derived, path: tuple, value: Any) -> float:
    """The absolute tolerance of a recomputed layer leaf (``path`` from ``layers``)."""
    rest = path[2:]
    return 0.0 if is_exact(rest, value) else SECTION_FIELDS[rest[0]](D, rest, value)


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------

def delegated(report: dict, ref: reference.Reference, contexts_ref: Any
              ) -> tuple[list[str], frozenset]:
    """The sections other modules compare (``DELEGATED``): their problems, and the real-head
    checks they covered (imported here: those modules import this one's model and arguments)."""
    from test_reference_contexts import compare_contexts
    from test_reference_positional import compare_positional
    from test_reference_real_heads import compare_claims
    from test_reference_real_heads import undecided as claims_undecided

    p1, n1 = compare_claims(report, ref.claims)
    p2, n2 = compare_positional(report, ref.positional)
    problems = p1 + p2 + claims_undecided(ref.claims)
    if contexts_ref is not None:
        problems += compare_contexts(report, contexts_ref)
    elif report.get("contexts"):
        problems.append("contexts: no reference given for them")
    return problems, frozenset(n1) | frozenset(n2)


def compare(report: dict, ref: reference.Reference, contexts_ref: Any = None
            ) -> tuple[list[str], dict[str, int]]:
    """Every leaf of ``report`` against the reference: the problems, and how many leaves of each
    class there were."""
    problems, covered = delegated(report, ref, contexts_ref)
    counts = {k: 0 for k in ("recomputed", "echo", "exempt", "label", "delegated")}
    derived = functools.lru_cache(maxsize=None)(lambda L: Derived(ref, L))
    for path, value in leaves(report):
        kind = leaf_class(path, covered)
        where = "/".join(map(str, path))
        if kind == "unknown":
            problems.append(f"{where}: neither recomputed, an echo, exempt nor delegated")
            continue
        counts[kind] += 1
        if kind == "echo":
            dumped = at(ref.manifest, path) if has(ref.manifest, path) else "(absent)"
            if dumped != value:
                problems.append(f"{where}: {value!r} is not the dumped run's {dumped!r}")
        elif kind == "recomputed":
            if not has(ref.report, path):
                problems.append(f"{where}: no reference for this leaf")
                continue
            expected = at(ref.report, path)
            t = tolerance(derived(int(path[1])), path, value) if path[0] == "layers" else 0.0
            if not agrees(value, expected, t):
                problems.append(f"{where}: validate {value!r}, reference {expected!r}, "
                                f"tolerance {t:.3g}")
    problems += missing_from(report, ref.report)
    return problems, counts


# ---------------------------------------------------------------------------------------------
# decisions the comparison needs clear of their thresholds
# ---------------------------------------------------------------------------------------------
def near_ties(v: np.ndarray, t: np.ndarray) -> bool:
    """Two values that may swap within their tolerances (exactly equal ones aside: the only
    exact ties are structural -- the input distance repeated for every head, which both sides
    repeat)."""
    close = np.abs(v[:, None] - v[None, :]) <= t[:, None] + t[None, :]
    return bool(np.any(close & (v[:, None] != v[None, :])))


def edges_undecided(v: np.ndarray, t: np.ndarray) -> bool:
    """A bin edge (``k/5`` quantile) that may change a value's bin: an interior edge at an
    integer position (the report's ``numpy.linspace`` puts 0.6 a rounding above 3/5, which can
    move the edge's own value to the bin below), or one within the tolerances of a neighbour."""
    x = np.sort(v)
    order = np.argsort(v)
    ts = t[order]
    for k in range(1, reference.N_BINS):
        pos = (x.size - 1) * k / reference.N_BINS
        lo = int(math.floor(pos))
        f = pos - lo
        gap = x[min(lo + 1, x.size - 1)] - x[lo]
        if gap == 0:  # between equal values (structural ties): the edge is that value exactly
            continue
        if abs(f) < 1e-9 or abs(f - 1) < 1e-9:
            return True
        if min(f, 1 - f) * gap <= 2 * max(ts[lo], ts[lo + 1]) + 4 * tl.unit_roundoff(F64) * x[
                lo + 1]:
            return True
    return False


def undecided_calibration(D: Derived) -> list[str]:
    """Spearman ranks and bin memberships that rounding may change."""
    out = []
    sets = [(h, k) for h in (*D.heads, "pooled") for k in ("rel", *reference.DISTANCES)] + [
        ("combined", k) for k in ("rel", "input", "tv_mean_over_heads")]
    for h, key in sets:
        v, t = D.calib_set(key, h)
        if near_ties(v, t):
            out.append(f"layer {D.L} calibration {h} {key}: values that may swap ranks")
        if key != "rel" and edges_undecided(v, t):
            out.append(f"layer {D.L} calibration {h} {key}: a bin edge within rounding")
    for c in range(len(D.items)):
        for h in range(D.H):
            hr, b = D.base(c, h)["hr"], D.base(c, h)
            e = np.linalg.norm(hr.y - hr.frozen[0], axis=1)[1:]
            slack = (hr.bound * (1 + reference.VIOLATION_REL) + reference.VIOLATION_ABS
                     * float(np.max(np.abs(hr.y))))[1:]
            if np.any(np.abs(slack - e) <= math.sqrt(D.r) * (b["ey"] + b["efr"][0][1:])
                      + 1e-6 * slack):
                out.append(f"layer {D.L} context {c} head {h}: a reuse-bound decision")
    return out


def clear(err, z: np.ndarray, atol: float, rtol: float) -> bool:
    """``allclose``'s criterion ``|a - b| <= atol + rtol |b|`` holds for every error up to
    ``err`` wherever ``b`` is within ``err`` of ``z``: the flag is true on both sides."""
    err = np.asarray(err, dtype=np.float64)
    return bool(np.all(err <= atol + rtol * np.maximum(np.abs(z) - err, 0.0)))


def native_room(a: np.ndarray, nat: np.ndarray, err) -> bool:
    """The float32 native criterion is decided: no entry within ``err`` of its threshold."""
    atol, rtol = reference.FLOAT32_NATIVE
    return bool(np.all(np.abs(atol + rtol * np.abs(nat) - np.abs(a - nat)) > err))


def undecided_flags(D: Derived) -> list[str]:
    """Pass flags whose criterion the two sides' errors may straddle: the identity-type flags
    (exact value true) need their rounding bound inside the criterion, the native ones the
    readout's error inside the room between the model's difference and the criterion."""
    out = []
    ti, tw = reference.TOLERANCES["identity_head"], reference.TOLERANCES["identity_write"]
    for c in range(len(D.items)):
        hrs, wr = D.items[c]
        for h in range(D.H):
            b, hr = D.base(c, h), hrs[h]
            ident = (clear(b["eP"][:, None], hr.y, *ti) and clear(b["eF"][:, None], hr.yF, *ti)
                     and clear(b["ey"], hr.yF, *tw)
                     and clear(D.proj(c, h, b["eF"][:, None]), hr.yF @ hr.w_o, *tw)
                     and clear(D.crosscheck(c), hr.frozen[0], *ti)
                     and clear(D.refresh(c), hr.y, *ti))
            if not ident:
                out.append(f"layer {D.L} context {c} head {h}: an identity flag within rounding")
            native = native_room(hr.yF, hr.native, b["eFx"][:, None]) and native_room(
                hr.yF[0], hr.observed, b["eFx"][0])
            if hr.pi_native is not None:
                native = native and native_room(hr.pi, hr.pi_native, D.a64)
            if not native:
                out.append(f"layer {D.L} context {c} head {h}: a native flag within rounding")
        w = {k: D.write(c, lambda g: np.max(D.base(c, g)[k])) for k in ("eP", "eF", "eFx")}
        if not (clear(w["eP"], wr.o + wr.bias, *tw) and clear(w["eF"], wr.writeF, *tw)
                and clear(D.write(c, lambda g: D.base(c, g)["ey"]), wr.writeF, *tw)
                and native_room(wr.writeF, wr.native, w["eFx"])
                and native_room(wr.writeF[0], wr.observed, w["eFx"])):
            out.append(f"layer {D.L} context {c}: a combined flag within rounding")
    return out


def undecided_descent(D: Derived) -> list[str]:
    """Unit-step flags, head medians and ``lambda > 2`` within rounding."""
    out = []
    for space in ("in", "q", "rep"):
        for h in D.heads:
            rows = [D.descent_rows(c, h, space) for c in range(len(D.items))]
            delta = np.concatenate([r["delta"] for r in rows])
            guard = np.concatenate([r["guard"] for r in rows])
            lam, dlam = (np.concatenate([r[k] for r in rows]) for k in ("lam", "d_lam"))
            if np.any(np.abs(delta) <= guard):
                out.append(f"layer {D.L} head {h}: a {space}-space step flag within rounding")
            if space != "rep" and abs(reference.median(delta)) <= guard.max():
                out.append(f"layer {D.L} head {h}: a {space}-space median within rounding")
            if np.any(np.abs(lam - 2) <= dlam):
                out.append(f"layer {D.L} head {h}: a {space}-space lambda near 2")
    return out


def undecided(ref: reference.Reference) -> list[str]:
    """Decisions behind counts and flags that lie within the two sides' rounding of their
    thresholds: there the counts cannot be compared exactly (choose other data)."""
    out = []
    for L in sorted({L for L, _ in ref.rows}):
        D = Derived(ref, L)
        out += undecided_calibration(D) + undecided_flags(D) + undecided_descent(D)
        for h in D.heads:
            v = ref.report["layers"][str(L)]["reuse"]["per_head"][D.heads.index(h)][
                "predictors"]["frozen"]["rrmse"]["all"]
            if abs(v - 1) <= D.reuse(("predictors", "frozen", "rrmse", "all"), h):
                out.append(f"layer {L} head {h}: a frozen rRMSE at 1")
    return out


def check_case(case: Case) -> dict[str, int]:
    problems, counts = compare(case.report, case.ref, case.contexts)
    open_ = undecided(case.ref)
    print("leaves:", counts, "seconds:", case.seconds)
    assert not open_, "\n".join(open_)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])
    return counts


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_every_leaf_of_the_tiny_validate_report_is_accounted_for(tiny):
    counts = check_case(tiny)
    assert counts["recomputed"] > 3000 and counts["echo"] > 50
    # the data exercise the decisions: some rows' steps increase E and some do not, in both
    # spaces, and the replication's query-space count is neither 0 nor every pair in layer 0
    for lr in tiny.report["layers"].values():
        for block in (lr["descent"], lr["descent"]["query_space"]):
            assert 0 < block["fraction_rows_increasing"] < 1
    rep = tiny.report["layers"]["0"]["descent"]["replication_style"]
    assert 0 < rep["increase"] < rep["pairs"]
    # scores far from uniform: the attention rows differ from the anchor's by a good fraction
    tv = tiny.report["layers"]["0"]["calibration"]["pooled_heads"]["distances"]["tv"]["summary"]
    assert tv["max"] > 0.1


def test_the_comparison_flags_unknown_and_missing_leaves(tiny):
    """A field the reference does not know, and a field the report lost, are both failures."""
    grown = loads(dumps(tiny.report))  # a copy, read back as report.json is
    grown["layers"]["0"]["reuse"]["per_head"][1]["new_statistic"] = 0.5
    grown["new_block"] = {"x": 1}
    del grown["layers"]["1"]["descent"]["per_head"][2]["frac_lam_gt_2"]
    problems, _ = compare(grown, tiny.ref, tiny.contexts)
    text = "\n".join(problems)
    assert "per_head/1/new_statistic: no reference" in text
    assert "new_block/x: neither recomputed" in text
    assert "per_head/2/frac_lam_gt_2: the reference has" in text
    # a real-head check no comparison covers is unknown, not waved through
    grown = loads(dumps(tiny.report))
    grown["layers"]["0"]["real_heads"]["per_context"][0]["new_check"] = {"ok": True}
    problems, _ = compare(grown, tiny.ref, tiny.contexts)
    assert any("per_context/0/new_check/ok: neither recomputed" in p for p in problems), problems


MUTANTS = [  # (the planted bug, the module, its line, the mutation, a leaf that must disagree)
    ("the linearised predictor centred on the query's own output, not the bank mean",
     "protocol", "lin = mu + (stP.s @ P.v) / N - mu * stP.s.mean(-1, keepdim=True)",
     "lin = mu + (stP.s @ P.v) / N - y * stP.s.mean(-1, keepdim=True)", "predictors/linear/"),
    ("the calibration's relative error over |y_i| instead of |y_i - mu|",
     "reuse_stats", "den = np.linalg.norm(yy - m, axis=-1)", "den = np.linalg.norm(yy, axis=-1)",
     "calibration/per_head/"),
    ("the bins' upper quantile at 0.8 instead of 0.9", "reuse_stats",
     '"p90": float(np.quantile(b[sel], 0.9))', '"p90": float(np.quantile(b[sel], 0.8))',
     "/p90"),
    ("heads_below_constant pooling anchor 0 instead of all anchors", "protocol",
     'reuse["heads_below_constant"] = rs.heads_beating_constant(reuse["per_head"])',
     'reuse["heads_below_constant"] = rs.heads_beating_constant(reuse["per_head"], '
     'which="anchor0")', "heads_below_constant/range"),
    ("the replication-style count takes the input-space flag", "protocol",
     '"rep_increases": _f64(dr.e1[:, 0] > dr.e0[:, 0])}',
     '"rep_increases": _f64(fast.descent(stF).e1[:, 0] > fast.descent(stF).e0[:, 0])}',
     "replication_style/increase"),
    ("the native check against the prefix-bank readout, not the full bank's", "protocol",
     '"native": _err(rdF[h], native[h]),', '"native": _err(rdP[h], native[h]),',
     "reconstruction/rows/"),
    ("the fast path's float64 comparison against the prefix bank's output, not the full bank's",
     "protocol", '"heads": [{"head": h, "vs_float64": _err(rd[h], stF.y[h]),',
     '"heads": [{"head": h, "vs_float64": _err(rd[h], stP.y[h]),', "/vs_float64/"),
    ("the verdict counting a reuse bound with no violation as failed", "protocol",
     "                if bv:\n", "                if bv >= 0:\n", "verdict/pass"),
]


def mutated(name: str, old: str, new: str, monkeypatch) -> types.ModuleType:
    """``ropestep.<name>`` with one line replaced, as a module of its own.  A ``protocol`` line
    that lives in one context's evaluation (``ropestep.contextcheck``, which validate computes
    through via ``ropestep.api``) is planted there and the mutated module patched into the API;
    ``protocol`` itself is returned."""
    from ropestep import api, contextcheck

    orig = {"protocol": protocol, "reuse_stats": rs}[name]
    if name == "protocol" and Path(orig.__file__).read_text(encoding="utf-8").count(old) != 1:
        orig = contextcheck
    src = Path(orig.__file__).read_text(encoding="utf-8")
    assert src.count(old) == 1, f"the planted line is not in {name}.py exactly once: {old!r}"
    short = orig.__name__.rsplit(".", 1)[-1]
    mod = types.ModuleType(f"ropestep._{short}_mutant")
    mod.__file__, mod.__package__ = orig.__file__, "ropestep"
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # dataclasses look their module up
    exec(compile(src.replace(old, new), orig.__file__, "exec"), mod.__dict__)
    if orig is contextcheck:
        monkeypatch.setattr(api, "contextcheck", mod)
        return protocol
    return mod


@pytest.fixture(scope="module")
def loaded(tiny):
    """The tiny model as ``protocol.run`` loads it (the same provenance as the case's run)."""
    cfg = run_config(tiny)
    return protocol.load(cfg)


def run_config(case: Case) -> protocol.Config:
    c = case.report["config"]
    return protocol.Config(**{**c, "model": str(case.out.parent / "model")})


def rerun(case: Case, loaded_model, module: types.ModuleType = protocol) -> dict:
    """The case's run again in process (``module.run``, the loaded model, the case's command
    line), as ``report.json`` reads back."""
    result = module.run(run_config(case), progress=False, loaded=loaded_model,
                        command=case.report["command"])
    result["config"] = case.report["config"]  # the model's path as the command line named it
    return loads(dumps(result))


@pytest.mark.parametrize("bug, name, old, new, leaf", MUTANTS, ids=[m[0][:40] for m in MUTANTS])
def test_a_planted_bug_turns_the_comparison_red(tiny, loaded, monkeypatch, bug, name, old, new,
                                                leaf):
    mod = mutated(name, old, new, monkeypatch)
    if name == "reuse_stats":
        from ropestep import contextcheck

        monkeypatch.setattr(protocol, "rs", mod)
        monkeypatch.setattr(contextcheck, "rs", mod)
        result = rerun(tiny, loaded)
    else:
        result = rerun(tiny, loaded, mod)
    problems, _ = compare(result, tiny.ref, tiny.contexts)
    print(bug, len(problems), problems[:3])
    assert any(leaf in p for p in problems), f"{bug}: no disagreement at {leaf}"


FLIPS = {  # one failing check planted in both the report and the reference: (path, value)
    "native": (("layers", "0", "reconstruction", "rows", 3, "pass_native"), False),
    "reuse_bound": (("layers", "1", "calibration", "checks", "per_context", 1,
                     "bound_violations", 2), 1),
    "refresh_identity": (("layers", "0", "calibration", "checks", "per_context", 0,
                          "refresh_identity_pass"), False),
    "positive_coefficients": (("layers", "1", "real_heads", "per_context", 1,
                               "positive_coefficients", "ok"), False),
    "position_shift": (("layers", "0", "real_heads", "per_context", 0, "position_shift", "ok"),
                       False),
}


def planted(tree: dict, path: tuple, value: Any) -> dict:
    out = loads(dumps(tree))
    at(out, path[:-1])[path[-1]] = value
    return out


def failing_verdicts(case: Case, verdict_block: Callable[[dict], dict], name: str):
    path, value = FLIPS[name]
    rep = planted(case.report, path, value)
    ref_layers = planted(case.ref.report, path, value)["layers"]
    return verdict_block(rep), reference.verdict(ref_layers)


@pytest.mark.parametrize("name", list(FLIPS))
def test_a_failing_check_reaches_both_verdicts(tiny, name):
    """The data pass every check, so the verdict's failure path is exercised by planting one
    failing check (a flag, a count) in both the report and the reference's sections: both
    verdicts fail, with the same count and the same (where, check) list."""
    got, want = failing_verdicts(tiny, protocol.verdict_block, name)
    assert not want["pass"] and want["failed_checks"] == 1
    assert (got["pass"], got["failed_checks"]) == (want["pass"], want["failed_checks"])
    assert [(f["where"], f["check"]) for f in got["failures"]] == \
        [(f["where"], f["check"]) for f in want["failures"]]


def test_a_planted_bug_in_the_verdict_ignoring_a_failing_check_is_caught(tiny, monkeypatch):
    """Planted: the verdict skips the reuse bound's violations.  The tiny data violate no
    bound, so the bug shows only with a violation planted (as above)."""
    mod = mutated("protocol", "                if bv:\n", "                if bv and False:\n",
                  monkeypatch)
    got, want = failing_verdicts(tiny, mod.verdict_block, "reuse_bound")
    assert got["pass"] != want["pass"]


def test_the_dump_changes_nothing_in_the_report(tiny, loaded, tmp_path, capsys):
    """Without ``--dump-raw`` the report is the same (timings and the time of writing aside), and
    the same comparison holds; a ``--dump-raw`` that names a file is bad input (exit 2, one
    line, no report)."""
    plain = rerun(tiny, loaded)
    skip = {"timings", "created_utc"}
    assert {k: v for k, v in plain.items() if k not in skip} == \
        {k: v for k, v in tiny.report.items() if k not in skip}
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert cli.main(["validate", *tiny.argv, "--out", str(tmp_path / "bad"),
                     "--dump-raw", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_two_real_smollm2_contexts(tmp_path):
    """The same comparison on the real SmolLM2-135M (no biases, 9 heads on 3 KV heads), layers
    0 and 20, two contexts of the bundled corpus.  (Layer 29's large output weights put the
    derived bound of its summed write's identity error above the ``3e-9`` criterion, so its
    pass flag cannot be compared exactly: :func:`undecided` says so there.)"""
    from ropestep import models

    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    case = run_case(tmp_path, ["--model", "smollm2", "--contexts", "2", "--queries", "6",
                               "--prefix-len", "48", "--layers", "0,20", "--exact-rows", "0"])
    check_case(case)


def test_the_reference_refuses_what_it_does_not_model(tmp_path):
    """A validate dump whose layer has a window, chunks, a soft-cap, sinks, clipped projections,
    ALiBi, a query temperature or an output gate (protocol.layer_facts records each) is refused
    in one line: the reference recomputes plain causal heads and would disagree for the wrong
    reason."""
    base = {"n_heads": 2, "n_kv_heads": 1, "head_dim": 4, "r": 4, "hidden": 8, "out": 8,
            "layout": "half", "family": "dot", "window": None, "chunk": None, "softcap": None,
            "sinks": False, "clip": None, "alibi": False, "query_temperature": None,
            "output_gate": None}
    cases = {"window": 16, "chunk": 8, "softcap": 30.0, "sinks": True, "clip": 2.0,
             "alibi": True, "query_temperature": [8.0, 0.1], "output_gate": "sigmoid"}
    assert_refuses_each(reference, base, {k: (v, f"has {k}") for k, v in cases.items()},
                        tmp_path)
