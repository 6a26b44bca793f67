#!/usr/bin/env python
"""Mutation testing of ropestep: named semantic mutants, and mutmut over the kernel.

Two parts, one report (``mutation/report.json`` and ``mutation/report.md``):

* ``--semantic``: the named mutants of :data:`MUTANTS`.  Each is one wrong formula a careful
  author could plausibly write -- ``(name, file under src/ropestep, exact original snippet,
  replacement, what it models, the tests to run)``.  It is applied to a temporary copy of the
  repository (``src/``, ``tests/``, ``pyproject.toml``, ``docs/`` and the committed reports under
  ``validation/``, which some tests read as data; the working tree is never modified), and
  the mutant's test subset runs against the copy (``PYTHONPATH=<copy>/src``; a probe checks that
  ``ropestep`` is imported from the copy).  Killed = some test failed (the first failing test id
  is recorded); survived = every test passed.  A snippet that is no longer in the source is
  *stale*: the list names code that changed, and the command fails until the list is updated.
* ``--mutmut``: mutmut 3 (``[tool.mutmut]`` in ``pyproject.toml``) over ``src/ropestep/kernel.py``
  and ``src/ropestep/rope.py``, on its own temporary copy.  A first pass uses the ``quick``
  hypothesis profile; every survivor is retried with the ``ci`` profile (the suite's default).
  Survivors that remain are matched against :data:`EQUIVALENT` (each with its reason); the rest
  are reported as survived.

A command that runs one part keeps the other from the previous ``report.json`` unchanged
(:func:`carry_over`): it is marked ``carried_over`` with the command, date, source commit and
versions of the run that computed it, and ``report.md`` says that section comes from that earlier
run.

Hypothesis: shrinking is switched off inside the copies (``tools/mutants_plugin.py``): a
mutant needs one failing example, not the smallest one.  Profiles are derandomised, so a run is
reproducible given the source tree.

Usage (run it under ``nice``: it is CPU-bound and long; the machine is shared)::

    nice -n 19 python tools/mutants.py --semantic --mutmut --out mutation/   # both parts
    nice -n 19 python tools/mutants.py --semantic                             # ~12 min
    nice -n 19 python tools/mutants.py --semantic --only A,B --no-report      # a few, by name
    python tools/mutants.py --list                                            # resolve only

Exit status: 0 when every non-equivalent mutant is killed (or timed out), 1 when one survives or
is stale, 2 on bad input (unknown option or mutant, a test subset that does not pass on the
unmutated copy, a replacement that does not compile).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
PKG = "src/ropestep"
PLUGIN = "mutants_plugin"  # tools/mutants_plugin.py, loaded with -p inside the copies
SCHEMA = "ropestep.mutation/1"
COPY_ITEMS = ("src", "tests", "pyproject.toml", "validation", "docs")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache",
                                "*.egg-info", "mutants")
# validation/: the reports' data only (report.json, report.md), not their figures
IGNORE_ITEM = {"validation": shutil.ignore_patterns("figures", "*.png")}
STATUSES = ("killed", "survived", "equivalent", "timeout", "stale", "error")
# mutmut parts: each mutates its files with its own fast test selection and is reported (and
# carried over) on its own, so the modules can be run one at a time.  "mutmut" is pyproject's
# [tool.mutmut] (kernel.py, rope.py); the statistics modules of issue 18 follow.
MUTMUT_PARTS: dict[str, dict[str, Any]] = {
    "mutmut": {},
    "mutmut-reuse_stats": {
        "only_mutate": ["src/ropestep/reuse_stats.py"], "also_copy": ["validation"],
        "pytest_add_cli_args_test_selection": [
            "tests/test_reuse_stats.py", "tests/test_report_statistics.py",
            "tests/test_reference_validate.py", "-k", "not two_real_smollm2 and not planted_bug"]},
    "mutmut-report": {
        "only_mutate": ["src/ropestep/report.py"],
        "pytest_add_cli_args_test_selection": [
            "tests/test_committed_reports_render.py", "tests/test_committed_figures.py",
            "tests/test_report_statistics.py", "tests/test_reports_portable.py",
            "tests/test_report_module.py"], "also_copy": ["validation", "docs"]},
    # heads.py: the diagnostics, their pooling and verdict, the dump and the rendering -- not the
    # model loading and command line (load, run, main_args, add_arguments, main)
    "mutmut-heads": {
        "only_mutate": ["src/ropestep/heads.py"], "also_copy": ["validation", "docs"],
        "functions": {"src/ropestep/heads.py": [
            "_f64", "singular_values", "condition_number", "effective_rank", "coarse_bands",
            "band_fractions", "matrix_diagnostics", "sketch_barycenter", "frequency_axis",
            "diagnose_weights", "_stats", "summarise", "_nonfinite", "_matrix_failures",
            "failures", "parse_layers", "_over_layers", "diagnose", "diagnose_gpt",
            "dump_layer", "write_raw_manifest", "grid", "_fmt_stats", "render_markdown",
            "render_figures", "write_report"]},
        "pytest_add_cli_args_test_selection": [
            "tests/test_committed_reports_render.py", "tests/test_committed_figures.py",
            "tests/test_cli_docs.py", "tests/test_heads.py", "tests/test_reference_heads.py",
            "tests/models/test_heads_model.py", "tests/test_report_statistics.py",
            "-k", "not two_real_smollm2 and not planted_bug and not architecture_zoo"]},
    # atlas.py and the layer evaluation it computes through (layercheck.py): what its
    # report.json and report.md print -- the measurement of an item, the pooling, the counted
    # work, the run directory's items, the rendering -- not the model plumbing around them
    # (loading, capture, torchrun, the command line)
    "mutmut-atlas": {
        "only_mutate": ["src/ropestep/atlas.py", "src/ropestep/layercheck.py"],
        "also_copy": ["validation", "docs"],
        "functions": {"src/ropestep/layercheck.py": [
            "evaluate_layer", "_pass_original", "_max", "_median", "_spearman", "_ratio",
            "summarise_layer", "_binned", "replication_style", "pool", "final_query_only"],
            "src/ropestep/atlas.py": [
            "_cost", "_result_to_arrays", "_result_from_arrays", "same_report",
            "_get", "grid", "render_markdown", "render_figures"]},
        # the fast subset: a frozen tiny run's items measured and pooled against the reference
        # (tests/test_atlas_summaries.py, seconds), the committed reports re-rendered and their
        # figures described; the whole-run comparison (test_reference_atlas) re-runs a model
        # per mutant and checks the same leaves; the Lanczos steps' start vectors, step counts
        # and retry (a wrong one changes no certified value, only the work) in test_lambda_max
        "pytest_add_cli_args_test_selection": [
            "tests/test_atlas_summaries.py", "tests/test_committed_reports_render.py",
            "tests/test_committed_figures.py", "tests/test_report_statistics.py",
            "tests/test_lambda_max.py"]},
    # protocol.py: its summaries only (what validate's report.json pools and judges), not the
    # model plumbing around them; with the two criteria of one context's rows (contextcheck.py)
    "mutmut-protocol": {
        "only_mutate": ["src/ropestep/protocol.py", "src/ropestep/contextcheck.py"],
        "also_copy": ["validation", "docs"],
        "functions": {"src/ropestep/contextcheck.py": ["native_ok", "_err"],
                      "src/ropestep/protocol.py": [
            "summarize_real_checks", "_mean", "_r6", "_at", "_tol_text",
            "row_failures", "row_ok", "_nonfinite_paths", "verdict", "verdict_block",
            "_nonfinite_contexts", "summarize_layer", "is_paper_setup"]},
        # the fast subset: the pooling of a frozen tiny run against the reference
        # (tests/test_protocol_summaries.py), the committed report's pooling, the verdict's unit
        # tests; the whole-run comparisons (test_reference_validate, the CLI runs) re-run a model
        # per mutant, minutes each on 2 cores, and check the same leaves
        "pytest_add_cli_args_test_selection": [
            "tests/test_protocol_summaries.py", "tests/test_protocol_verdict.py",
            "tests/test_report_statistics.py",
            "tests/test_verdicts.py::test_protocol_verdict_from_a_report_dict",
            "tests/test_verdicts.py::test_builtin_max_drops_nan_but_worst_does_not",
            "tests/test_verdicts.py::test_pass_predicate_fails_nan_and_inf",
            "tests/test_protocol.py::test_paper_setup_detection"]},
    # cost.py: the counted work and what the cost section derives from it (the figures the
    # atlas's cost acceptance is judged by) -- not matmul_rate, a timing whose mutants change
    # only how fast the rate is found; the fast subset: the counts by brute force, the
    # documented Lanczos counts and phase_report by hand (test_committed_cost's checks of the
    # committed reports read files, not this code: they are in the selection but kill nothing)
    "mutmut-cost": {
        "only_mutate": ["src/ropestep/cost.py"], "also_copy": ["validation", "docs"],
        "functions": {"src/ropestep/cost.py": [
            "lambda_max_flops", "prefix_sums", "atlas_flops", "phase_report"]},
        "pytest_add_cli_args_test_selection": [
            "tests/test_committed_cost.py", "tests/test_plan.py::test_counts_by_brute_force",
            "tests/test_lambda_max.py::test_the_counted_steps_are_the_steps_taken"]},
    # realchecks.py: every function; the fast subset replays a frozen tiny validate run's calls
    # (tests/test_realchecks_frozen.py: the claims and the 50-digit oracle rows against the
    # references, seconds), the checks' own tests on tiny models (QK-norm, soft-capped and
    # NoPE heads too: the frozen model has none) and the references' comparisons on a tiny run
    # -- not the real SmolLM2 contexts or the planted-bug sweeps (tens of seconds each).  The
    # selection was widened from the first six keywords' tests (every one kept, so their kills
    # stand: keep_kills_on_widening)
    "mutmut-realchecks": {
        "only_mutate": ["src/ropestep/realchecks.py"], "also_copy": ["validation", "docs"],
        "pytest_add_cli_args_test_selection": [
            "tests/test_realchecks_frozen.py", "tests/models/test_realchecks.py",
            "tests/test_reference_real_heads.py", "tests/test_reference_positional.py",
            "-k", "not smollm2 and not planted_bug"]},
}


class BadInput(Exception):
    """Bad input: exit status 2."""


# ---------------------------------------------------------------------------------------------
# test subsets (pytest arguments; cheap tests first, so a killed mutant stops early under -x)
# ---------------------------------------------------------------------------------------------
T_PHI1 = "tests/test_phi1.py"
T_MUT = "tests/test_mutations.py"
T_NONFINITE = "tests/test_nonfinite.py"
T_BAD = "tests/test_bad_input.py"
T_LOWRANK = "tests/test_lowrank.py"
T_SCALE = "tests/test_scale.py"
T_OBJECTS = "tests/test_fast_objects.py"
T_KAPPA = "tests/test_kappa.py"
T_F64 = "tests/test_fast_vs_exact.py::test_float64_matches_exact"
T_LOWP = "tests/test_fast_vs_exact.py::test_low_precision_within_derived_bound"
T_REUSE = "tests/test_reuse_stats.py"
T_ADAPTER = "tests/models/test_adapter.py"
T_KILLERS = "tests/test_mutants_tool.py"
# the reports' statistics: the reference recomputations (one whole-report comparison each, on a
# tiny seeded model; ~5 s of fixture) and the modules' own tests
T_REF_ATLAS = "tests/test_reference_atlas.py::test_every_leaf_of_the_tiny_atlas_is_recomputed"
T_REF_VALIDATE = ("tests/test_reference_validate.py::"
                  "test_every_leaf_of_the_tiny_validate_report_is_accounted_for")
T_HEADS = "tests/test_heads.py"
T_REALCHECKS = "tests/models/test_realchecks.py"
T_STATS = "tests/test_report_statistics.py"
T_RC_NO_READOUT = (T_REALCHECKS
                   + "::test_no_global_readout_bound_recomputed_from_the_models_attention")
T_RC_PLANTED = T_REALCHECKS + "::test_exact_rows_report_planted_relative_errors"
T_PLANTED = "tests/test_planted_defaults.py"
T_ALIBI = "tests/test_alibi_models.py"
T_GATE = "tests/test_output_gate.py"
T_CHUNK = "tests/test_chunk.py"

CORE = (T_MUT, T_F64)
SCALE_FAST = (T_SCALE + "::test_against_exact_oracle", T_SCALE + "::test_matches_fast_step")


@dataclass(frozen=True)
class Mutant:
    """One named semantic mutant.

    ``original`` must occur exactly once in ``src/ropestep/<file>``; it is replaced by
    ``replacement`` in a temporary copy.  ``tests`` are the pytest arguments of the subset run
    against it.  ``equivalent``: the reason it cannot be killed (the mutant still runs, and a
    kill is reported as an error in the list).
    """

    name: str
    file: str
    original: str
    replacement: str
    models: str
    tests: tuple[str, ...] = CORE
    equivalent: str | None = None


MUTANTS: tuple[Mutant, ...] = (
    # --- gauges: the coefficient formula ------------------------------------------------------
    Mutant("coef-original-anchor-one", "kernel.py",
           "sig = torch.zeros_like(sm.zmax) if sigma is None else sigma",
           "sig = torch.ones_like(sm.zmax) if sigma is None else sigma",
           "original gauge evaluated at the anchor sigma = 1 instead of 0 (c = e rho(s - 1)/Z, "
           "no matching -sigma w term)"),
    Mutant("coef-rho-without-anchor", "kernel.py",
           "c = scaled_phi1(sm.z - zsig, zsig - sm.zmax)",
           "c = scaled_phi1(sm.z, zsig - sm.zmax)",
           "anchored coefficient e^{phi(sigma)} rho(z) instead of "
           "e^{phi(sigma)} rho(z - phi(sigma)) (max-key and free gauges)"),
    Mutant("coef-unnormalised", "kernel.py",
           "* transform_dd(sm.s, sig, softcap) / sm.zbar",
           "* transform_dd(sm.s, sig, softcap)",
           "coefficients not divided by the partition function (c = rho(s)e^{-z_max} instead of "
           "rho(s)/Z)"),
    Mutant("coef-softcap-chain-factor", "kernel.py",
           "* transform_dd(sm.s, sig, softcap) / sm.zbar",
           "/ sm.zbar",
           "soft-capped scores: the divided difference phi[s, sigma] of the transform dropped from "
           "c (the chain-rule factor)",
           tests=(T_F64, T_KAPPA)),
    Mutant("maxkey-offset-key-dropped", "kernel.py",
           "koff = torch.gather(k.expand(G, *k.shape[1:]), 1, js[..., None].expand(G, Qc, d))",
           "koff = torch.zeros_like(q)",
           "max-key gauge: anchor sigma = s_max used in c but the key offset k_o = k~_{j*} "
           "forgotten in T"),
    Mutant("maxkey-anchor-argmin", "kernel.py",
           "return s.masked_fill(~mask[None], -math.inf).argmax(-1)",
           "return s.masked_fill(~mask[None], math.inf).argmin(-1)",
           "max-key gauge anchored at the smallest score (a valid gauge, but not the max-key one: "
           "unbounded coefficients)"),
    Mutant("maxkey-bias-offset-dropped", "kernel.py",
           "boff = torch.gather(beta, -1, js[..., None])",
           "boff = None",
           "max-key gauge with additive biases: the bias offset beta_o = beta_{i j*} forgotten "
           "in b"),
    Mutant("free-gauge-sigma-w-sign", "kernel.py",
           "readout = readout - sig * w",
           "readout = readout + sig * w",
           "free gauge g: readout mu + q T + b + sigma w (sign of the -sigma w term)"),
    Mutant("free-gauge-delta-m-sign", "fast.py",
           "dm = dm - g[:, None, :, None] * out[\"w\"][:, :, None, :]",
           "dm = dm + g[:, None, :, None] * out[\"w\"][:, :, None, :]",
           "free gauge g: Delta M = L T + e b^T + g w^T (sign of the -g w^T term)"),
    Mutant("pairwise-weights-min-anchor", "kernel.py",
           "D = torch.exp(torch.maximum(zj, zk)) * phi1(-(zj - zk).abs())",
           "D = torch.exp(torch.minimum(zj, zk)) * phi1(-(zj - zk).abs())",
           "pairwise gauge: exp[z_j, z_k] = e^{min} rho(-|z_j - z_k|) (anchored at the smaller "
           "score) instead of e^{max}"),
    # --- score families -------------------------------------------------------------------------
    Mutant("softcap-transform-no-cap", "kernel.py",
           "return s if softcap is None else softcap * torch.tanh(s / softcap)",
           "return s if softcap is None else torch.tanh(s / softcap)",
           "soft-cap transform tanh(s/c) instead of c tanh(s/c)",
           tests=(T_F64, T_KAPPA)),
    Mutant("softcap-transform-dd-exponent", "kernel.py",
           "same = 4 * torch.exp(-2 * l2c) * phi1(-2 * delta) / (",
           "same = 4 * torch.exp(-2 * l2c) * phi1(-delta) / (",
           "divided difference of c tanh(s/c): phi_1(-delta) instead of phi_1(-2 delta) on one "
           "side of zero",
           tests=(T_F64, T_KAPPA)),
    Mutant("alibi-sign", "fast.py",
           "beta = -sl[:, None, None] * (pq[:, None] - pk[None, :]).to(cd)[None]",
           "beta = sl[:, None, None] * (pq[:, None] - pk[None, :]).to(cd)[None]",
           "ALiBi bias +slope * (i - j) (rewards distance) instead of -slope * (i - j)"),
    Mutant("alibi-slope-of-group", "scale.py",
           "beta = -L.slopes[hidx][:, None, None] * dp[None]",
           "beta = -L.slopes[:len(hs)][:, None, None] * dp[None]",
           "streamed path: every key group uses the slopes of heads 0..G-1 instead of its own "
           "heads",
           tests=SCALE_FAST),
    Mutant("qknorm-sum-not-mean", "kernel.py",
           "return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w",
           "return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps) * w",
           "QK-norm: x / sqrt(sum x^2 + eps) (an L2 norm) instead of the RMS norm",
           tests=(T_F64, T_KAPPA, T_SCALE)),
    Mutant("cosine-normalise-wrong-axis", "kernel.py",
           "n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)",
           "n = torch.linalg.vector_norm(x, dim=-2, keepdim=True)",
           "cosine family: rows normalised over the token axis instead of the head dimension",
           tests=(T_F64, T_KAPPA, T_SCALE)),
    Mutant("cosine-temperature-head0", "fast.py",
           "scale = torch.tensor([spec.score_scale(h) for h in range(spec.n_heads)], dtype=cd,",
           "scale = torch.tensor([spec.score_scale(0) for h in range(spec.n_heads)], dtype=cd,",
           "per-head score scale / cosine temperature: head 0's for every head",
           tests=(T_KAPPA, T_F64)),
    # --- phi_1 numerics ---------------------------------------------------------------------------
    Mutant("phi1-naive-exp-minus-one", "kernel.py",
           "out = torch.expm1(safe) / safe",
           "out = (torch.exp(safe) - 1) / safe",
           "phi_1 as (e^s - 1)/s: cancellation near s = 0 (exact in exact arithmetic)",
           tests=(T_PHI1,)),
    Mutant("phi1-big-branch-overflows", "kernel.py",
           "out = torch.where(big, half * (half / torch.where(big, s, torch.ones_like(s))), out)",
           "out = torch.where(big, torch.exp(s) / torch.where(big, s, torch.ones_like(s)), out)",
           "phi_1 for s > 40 as e^s/s: overflows to inf from s = 709.78 (instead of ~716)",
           tests=(T_PHI1,)),
    # --- the identity's objects -------------------------------------------------------------------
    Mutant("uniform-mean-chunk-count", "kernel.py",
           "return (mask.to(v.dtype) @ v) / mask.sum(-1).to(v.dtype)[:, None]",
           "return (mask.to(v.dtype) @ v) / mask.shape[-1]",
           "uniform mean divided by the bank size N instead of the permitted count N_i",
           tests=(T_MUT + "::test_mutant_softmax_mean_instead_of_uniform_mean",)),
    Mutant("delta-m-bias-row-fast", "fast.py",
           "dm[:, :, -1] += out[\"b\"]",
           "dm[:, :, 0] += out[\"b\"]",
           "per-query path: the bias term b_i added to row 0 of Delta M instead of the augmented "
           "row m+1"),
    Mutant("delta-m-bias-row-scale", "scale.py",
           "dm[:, :, -1] += b",
           "dm[:, :, 0] += b",
           "streamed path: the bias term b_i added to row 0 of Delta M instead of row m+1",
           tests=SCALE_FAST),
    # --- RoPE -------------------------------------------------------------------------------------
    Mutant("rope-rotation-sign", "rope.py",
           "return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)",
           "return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)",
           "split-half RoPE rotating by -p (R(p)^T applied instead of R(p))"),
    Mutant("rope-half-pairs-interleaved", "rope.py",
           "x1, x2 = x[..., : d // 2], x[..., d // 2:]",
           "x1, x2 = x[..., 0::2], x[..., 1::2]",
           "layout 'half' pairing dims (2l, 2l+1) instead of (l, l + d/2)"),
    Mutant("rope-frequency-exponent", "rope.py",
           "** (-2.0 * ell / head_dim)",
           "** (-1.0 * ell / head_dim)",
           "RoPE frequencies base^(-l/d) instead of base^(-2l/d)"),
    Mutant("query-position-off-by-one", "fast.py",
           "cos_q, sin_q = query_cos_sin(spec, pq, cd, q.device)",
           "cos_q, sin_q = query_cos_sin(spec, pq + 1, cd, q.device)",
           "queries rotated to position p + 1"),
    Mutant("gqa-modulo-fast", "fast.py",
           "kv_of = torch.arange(spec.n_heads, device=q.device) // spec.group",
           "kv_of = torch.arange(spec.n_heads, device=q.device) % spec.n_kv_heads",
           "GQA: query head h reads KV head h % H_kv instead of h // group"),
    Mutant("gqa-modulo-scale", "scale.py",
           "groups = [list(range(g * spec.group, (g + 1) * spec.group)) for g in range(Hk)]",
           "groups = [list(range(g, H, Hk)) for g in range(Hk)]",
           "streamed path: key group g holds query heads g, g + H_kv, ... (h % H_kv grouping)",
           tests=SCALE_FAST),
    Mutant("bf16-computed-in-bf16", "kernel.py",
           "return torch.float32 if dtype in LOW_PRECISION else dtype",
           "return dtype",
           "bf16/fp16 inputs computed in bf16/fp16 instead of float32 accumulation",
           tests=(T_PHI1, T_SCALE + "::test_low_precision")),
    # --- the batched GEMM form (rank-one corrections) ---------------------------------------------
    Mutant("gemm-mean-correction-sign", "kernel.py",
           "mu_c.expand(G, Qc, r).reshape(G * Qc, 1, r), alpha=-1.0)",
           "mu_c.expand(G, Qc, r).reshape(G * Qc, 1, r), alpha=1.0)",
           "GEMM form: + (C K^)(mu - v-bar)^T instead of - (the value-centring correction)",
           tests=SCALE_FAST),
    Mutant("gemm-offset-correction-dropped", "kernel.py",
           "tv.baddbmm_(ko.reshape(G * Qc, d, 1), w.reshape(G * Qc, 1, r))",
           "None",
           "GEMM form: the (k-bar - k_o) w^T correction dropped",
           tests=SCALE_FAST),
    Mutant("gemm-w-uncentred", "kernel.py",
           "w = c @ vh - c.sum(-1, keepdim=True) * mu_c  # sum_j c_ij (v_j - mu_i)",
           "w = c @ vh  # sum_j c_ij (v_j - mu_i)",
           "GEMM form: w_i = sum_j c_ij v^_j, the values not centred on mu_i",
           tests=SCALE_FAST),
    # --- low rank ---------------------------------------------------------------------------------
    Mutant("lowrank-weights-not-halved", "lowrank.py",
           "w = 1 / ((1 - x * x) * dp * dp)",
           "w = 2 / ((1 - x * x) * dp * dp)",
           "Gauss-Legendre rule moved to [0, 1] without halving the weights (sum w = 2)",
           tests=(T_LOWRANK,)),
    Mutant("lowrank-b-exponent", "lowrank.py",
           "B = torch.exp((1.0 - tt)[:, None] * zm)",
           "B = torch.exp(tt[:, None] * zm)",
           "low-rank pairwise kernel: b_n = e^{t_n z} instead of e^{(1 - t_n) z}",
           tests=(T_LOWRANK,)),
    # --- streamed path ---------------------------------------------------------------------------
    Mutant("scale-causal-mask-strict", "scale.py",
           "m = pos[None, :n] <= pos[qi][:, None]",
           "m = pos[None, :n] < pos[qi][:, None]",
           "streamed path: causal mask j < i (a query does not read its own key)",
           tests=SCALE_FAST),
    Mutant("nan-dropped-by-builtin-max", "scale.py",
           "mx[h] = np.maximum(mx[h], float(err[a].max()))",
           "mx[h] = max(mx[h], float(err[a].max()))",
           "streamed identity check: builtin max drops a NaN error (max(0.0, nan) == 0.0)",
           tests=(T_NONFINITE,)),
    Mutant("overflow-check-dropped", "kernel.py",
           "if not bool(torch.isfinite(c).all()):",
           "if False:",
           "original gauge overflow: no FloatingPointError naming the gauge and the remedy where "
           "the coefficients are made",
           tests=(T_NONFINITE, T_BAD)),
    # --- kappa -----------------------------------------------------------------------------------
    Mutant("kappa-times-1e8", "kernel.py",
           "out[\"kappa\"] = kappa_sum(c.abs() * absdot, vq, vh if vbar is None else vh + vbar, "
           "mask)",
           "out[\"kappa\"] = 1e8 * kappa_sum(c.abs() * absdot, vq, vh if vbar is None else "
           "vh + vbar, mask)",
           "the readout's condition number inflated 1e8-fold (every readout tolerance widens)",
           tests=(T_KAPPA + "::test_fast_kappa_matches_exact",)),
    Mutant("kappa-bias-term-dropped", "kernel.py",
           "        if bc is not None:\n            absdot = absdot + bc.abs()\n"
           "        if sig is not None and gauge == \"free\":",
           "        if sig is not None and gauge == \"free\":",
           "kappa without the |beta_j - beta_o| term (ALiBi / explicit biases)",
           tests=(T_KAPPA + "::test_fast_kappa_matches_exact",)),
    Mutant("kappa-value-term-dropped", "kernel.py",
           "vn = vq.abs().amax(-1) + va",
           "vn = vq.abs().amax(-1)",
           "kappa without the |v_j|_inf term (the rounding of the centring v_j - mu)",
           tests=(T_KAPPA + "::test_fast_kappa_matches_exact",)),
    # --- the protocol's pooling -------------------------------------------------------------------
    Mutant("reuse-rrmse-without-root", "reuse_stats.py",
           "return math.sqrt(num / den)",
           "return num / den",
           "rRMSE reported as the MSE ratio (no square root)",
           tests=(T_REUSE,)),
    Mutant("reuse-anchor0-pools-all-anchors", "reuse_stats.py",
           "return {\"anchor0\": float(e[:, 0].mean()), \"all\": float(e.mean(axis=1).mean())}",
           "return {\"anchor0\": float(e.mean()), \"all\": float(e.mean(axis=1).mean())}",
           "pooled 'anchor 0' MSE averaged over every anchor",
           tests=(T_REUSE,)),
    Mutant("reuse-anchor-not-excluded", "reuse_stats.py",
           "sq[np.arange(Q), np.arange(Q)] = 0.0  # exclude i = a",
           "pass",
           "frozen/constant predictors scored on the anchor itself (its zero error included)",
           tests=(T_REUSE,)),
    # --- the reports' statistics (issue 18): reuse_stats, atlas, protocol, realchecks, heads,
    # report -- each a number of report.json / report.md computed the wrong way -------------------
    Mutant("reuse-shared-predictor-over-q", "reuse_stats.py",
           "return (sq.sum() - sq) / ((Q - 1) * D)",
           "return (sq.sum() - sq) / (Q * D)",
           "anchor-independent predictors (cache mean, linearised softmax, zero/target RMS): the "
           "Q - 1 non-anchor errors divided by Q D instead of (Q - 1) D (a different denominator)",
           tests=(T_REUSE, T_REF_VALIDATE)),
    Mutant("calib-tv-without-half", "reuse_stats.py",
           "return 0.5 * np.abs(x - x[..., anchor:anchor + 1, :]).sum(-1)",
           "return np.abs(x - x[..., anchor:anchor + 1, :]).sum(-1)",
           "calibration's total-variation distance as the L1 distance sum_j |p_ij - p_0j| "
           "(the 1/2 dropped: TV summaries and bin edges doubled)",
           tests=(T_REUSE, T_REF_VALIDATE)),
    Mutant("calib-bin-median-is-mean", "reuse_stats.py",
           "\"median\": float(np.median(b[sel]))",
           "\"median\": float(np.mean(b[sel]))",
           "calibration quantile bins: the mean relative error of a bin reported as its median",
           tests=(T_REUSE, T_REF_VALIDATE)),
    Mutant("calib-bin-index-off-by-one", "reuse_stats.py",
           "idx = np.clip(np.searchsorted(edges, a, side=\"right\") - 1, 0, n_bins - 1)",
           "idx = np.clip(np.searchsorted(edges, a, side=\"right\"), 0, n_bins - 1)",
           "calibration quantile bins: every value placed one bin up (bin k holds the values of "
           "[q_(k-1), q_k); the first bin empty, the last two merged)",
           tests=(T_REUSE, T_REF_VALIDATE)),
    Mutant("spearman-ties-not-averaged", "reuse_stats.py",
           "return (sums / counts)[inv]",
           "return ranks",
           "Spearman's ranks: tied values get ordinal ranks (first come first) instead of their "
           "average rank (the pooled input distance repeats each value once per head)",
           tests=(T_REUSE, T_REF_VALIDATE)),
    Mutant("tokenwise-agreement-mean", "reuse_stats.py",
           "num = float(np.abs(p - m).max()) if m.size else 0.0",
           "num = float(np.abs(p - m).mean()) if m.size else 0.0",
           "tokenwise formula vs measured reuse error: the mean absolute difference over the max "
           "|measured| instead of the max (a normwise relative error that hides the worst entry)",
           tests=(T_REUSE, T_REF_VALIDATE)),
    Mutant("atlas-rrmse-mean-of-ratios", "layercheck.py",
           "float(math.sqrt(fr[sel].sum() / co[sel].sum()))",
           "float(math.sqrt(np.mean(fr[sel] / co[sel])))",
           "atlas frozen-reuse rRMSE vs the constant anchor: root of the mean of per-query ratios "
           "instead of the ratio of the pooled sums (ratios taken before pooling)",
           tests=(T_REF_ATLAS,)),
    Mutant("atlas-relative-error-squared", "layercheck.py",
           "rel_err = np.sqrt(fr[sel]) / np.sqrt(np.maximum(me[sel], 1e-300))",
           "rel_err = fr[sel] / np.maximum(me[sel], 1e-300)",
           "atlas relative reuse error |y - y_fr|^2 / |y - mu|^2 (squared norms: the median and "
           "the TV-quartile medians squared; the rank correlation unchanged)",
           tests=(T_REF_ATLAS,)),
    Mutant("atlas-tv-bin-excludes-lower-edge", "layercheck.py",
           "sel = (tv >= lo) & (tv <= hi)",
           "sel = (tv > lo) & (tv <= hi)",
           "atlas TV-quartile bins half-open at the bottom: the query at the minimum TV falls out "
           "of the first bin (off-by-one count)",
           tests=(T_REF_ATLAS,)),
    Mutant("atlas-spearman-uncentred-ranks", "layercheck.py",
           "    ra -= ra.mean()\n    rb -= rb.mean()\n",
           "",
           "atlas Spearman correlation of the relative error with TV from uncentred ranks (a "
           "cosine of rank vectors, always positive)",
           tests=(T_REF_ATLAS,)),
    Mutant("atlas-native-rel-over-value-scale", "layercheck.py",
           "nat_rel = max(float(np.max(r.arrays[\"native_abs\"][h])) / r.native_scale[h]",
           "nat_rel = max(float(np.max(r.arrays[\"native_abs\"][h])) / r.value_scale[h]",
           "atlas float64-vs-native relative error divided by the value scale max|v_j| instead of "
           "the model output's scale max|native| (a different denominator)",
           tests=(T_REF_ATLAS,)),
    Mutant("atlas-render-median-column-mean", "atlas.py",
           "return num(float(np.max(x) if how == \"max\" else np.median(x)))",
           "return num(float(np.max(x) if how == \"max\" else np.mean(x)))",
           "atlas report.md per-layer table: the 'median over heads' columns (kappa, sink, "
           "lambda_max, E up, reuse rRMSE) printed as means",
           tests=(T_STATS,)),
    Mutant("protocol-recon-mse-max-over-contexts", "protocol.py",
           "out[part] = {\"mse\": _mean([r[part][\"mse\"] for r in sel]),",
           "out[part] = {\"mse\": worst(r[part][\"mse\"] for r in sel),",
           "validate reconstruction per head/combined: the MSE pooled as the max over contexts "
           "instead of the mean",
           tests=(T_REF_VALIDATE,)),
    Mutant("protocol-fast-kappa-median-of-maxima", "protocol.py",
           "ent[\"kappa\"] = {\"median\": float(np.median([k[\"median\"] for k in ks])),",
           "ent[\"kappa\"] = {\"median\": float(np.median([k[\"max\"] for k in ks])),",
           "validate fast path: the kappa 'median' pooled from the contexts' maxima instead of "
           "their medians",
           tests=(T_REF_VALIDATE,)),
    Mutant("protocol-frac-lambda-above-one", "protocol.py",
           "\"frac_lam_gt_2\": float((lam[h] > 2).mean()),",
           "\"frac_lam_gt_2\": float((lam[h] > 1).mean()),",
           "validate descent: the fraction of rows with lambda_max > 2 (the unit step's descent "
           "threshold) counted against 1",
           tests=(T_REF_VALIDATE,)),
    Mutant("protocol-gain-fit-includes-anchor", "contextcheck.py",
           "gain = {\"r\": _f64(y - mu)[:, 1:], \"g\": _f64(g)[:, 1:],",
           "gain = {\"r\": _f64(y - mu), \"g\": _f64(g),",
           "calibration gain gamma (per head) fitted over every query, the anchor i = 0 "
           "included (where the frozen matrix is exact), instead of i != 0",
           tests=(T_REF_VALIDATE,)),
    Mutant("protocol-combined-rrmse-vs-cache-mean", "protocol.py",
           "const0 = reuse[\"combined\"][\"predictors\"][\"constant\"][\"mse\"][\"anchor0\"]",
           "const0 = reuse[\"combined\"][\"predictors\"][\"mean\"][\"mse\"][\"anchor0\"]",
           "calibration combined rRMSE at gamma = 1 and at the best gamma against the cache mean "
           "instead of the constant anchor output (a different baseline)",
           tests=(T_REF_VALIDATE,)),
    Mutant("protocol-real-checks-reductions-swapped", "protocol.py",
           "agg[f] = (least(vals) if f.startswith((\"min\", \"lower\")) or f.endswith(\"_min\")\n"
           "                      else worst(vals))",
           "agg[f] = (worst(vals) if f.startswith((\"min\", \"lower\")) or f.endswith(\"_min\")\n"
           "                      else least(vals))",
           "validate real-head claims pooled over contexts with the best value instead of the "
           "worst (the max of the min_c / lower bounds, the min of the errors and ratios)",
           tests=(T_STATS,)),
    Mutant("realchecks-rank-ratio-sigma-d", "realchecks.py",
           "after = float(sv[d] / sv[0]) if sv.numel() > d and smax > 0 else 0.0",
           "after = float(sv[d - 1] / sv[0]) if sv.numel() > d and smax > 0 else 0.0",
           "rank check's spectral summary sigma_d / sigma_1 instead of sigma_(d+1) / sigma_1 "
           "(off by one: the last singular value allowed, not the first that must vanish)",
           tests=(T_REALCHECKS + "::test_delta_m_rank_spectral_summary_where_d_binds",)),
    Mutant("realchecks-no-readout-bound-factor", "realchecks.py",
           "lower = torch.linalg.vector_norm(gap, dim=-1) / 2",
           "lower = torch.linalg.vector_norm(gap, dim=-1)",
           "certified lower bound on any common affine readout without the 1/2 of its "
           "three-point derivation (max(|e_a|, |e_b|, |e_c|) >= |y_c - (y_a + y_b)/2| / 2)",
           tests=(T_RC_NO_READOUT,)),
    Mutant("realchecks-exact-c-rel-absolute", "realchecks.py",
           "c_rel = float((np.abs(cf - ce) / np.maximum(np.abs(ce), tl.SCALE_GUARD)).max())",
           "c_rel = float(np.abs(cf - ce).max())",
           "exact rows: the coefficients' error against the oracle reported absolute instead of "
           "relative to c_exact (c << 1: the error looks smaller)",
           tests=(T_RC_PLANTED,)),
    Mutant("realchecks-exact-y-rel-over-output", "realchecks.py",
           "y_rel = float(np.abs(st.y[h, q].numpy() - reference.y[h, i]).max() / S)",
           "y_rel = float(np.abs(st.y[h, q].numpy() - reference.y[h, i]).max()\n"
           "                      / max(float(np.abs(reference.y[h, i]).max()), tl.SCALE_GUARD))",
           "exact rows: y's error relative to max|y_exact| instead of the value scale max_j "
           "|v_j| the tolerance is stated against (a different denominator)",
           tests=(T_RC_PLANTED,)),
    Mutant("realchecks-conventions-k-max-reads-q", "realchecks.py",
           "\"k_rel_max\": worst(r_[\"k_rel\"] for r_ in heads),",
           "\"k_rel_max\": worst(r_[\"q_rel\"] for r_ in heads),",
           "conventions check: the reported worst key error taken from the queries' errors "
           "(copy-paste)",
           tests=(T_REALCHECKS + "::test_wrong_gqa_map_caught",)),
    Mutant("heads-summary-median-is-mean", "heads.py",
           "return {\"median\": float(np.median(a)), \"min\": float(np.min(a)), "
           "\"max\": float(np.max(a)),",
           "return {\"median\": float(np.mean(a)), \"min\": float(np.min(a)), "
           "\"max\": float(np.max(a)),",
           "heads summary (cond, effective rank, barycenter over heads): the mean reported as the "
           "median",
           tests=(T_HEADS, T_STATS)),
    Mutant("heads-effective-rank-energy-weights", "heads.py",
           "p = sv[sv > 0] / total",
           "p = sv[sv > 0] ** 2 / float((sv * sv).sum())",
           "effective rank from the energy distribution sigma_k^2 / sum sigma^2 instead of Roy & "
           "Vetterli's sigma_k / sum sigma",
           tests=(T_HEADS, T_STATS)),
    Mutant("heads-coarse-band-mean", "heads.py",
           "return [float(b.sum()) for b in np.array_split(f, n)]",
           "return [float(b.mean()) for b in np.array_split(f, n)]",
           "coarse band energy: the mean pair fraction of each quarter instead of its sum (the "
           "four bands no longer add up to 1)",
           tests=(T_HEADS, T_STATS)),
    Mutant("heads-sketch-index-off-by-one", "heads.py",
           "idx = torch.linspace(0, 1, steps=imp.numel(), dtype=torch.float64)",
           "idx = torch.arange(imp.numel(), dtype=torch.float64) / imp.numel()",
           "the document's sketch barycenter with rows at k / 2d instead of linspace(0, 1, 2d) = "
           "k / (2d - 1) (off by one in the denominator)",
           tests=(T_HEADS, T_STATS)),
    Mutant("heads-fraction-barycenter-wrong-side", "heads.py",
           "\"fraction_barycenter_below_half\": float(np.mean(np.asarray(t) < 0.5)) if t else "
           "math.nan,",
           "\"fraction_barycenter_below_half\": float(np.mean(np.asarray(t) > 0.5)) if t else "
           "math.nan,",
           "heads summary: the fraction of heads with barycenter above 1/2 (slow pairs) reported "
           "as the fraction below",
           tests=(T_HEADS, T_STATS)),
    Mutant("report-fmt6-five-decimals", "report.py",
           "return f\"{v:.6f}\" if abs(v) >= 1e-4 else f\"{v:.3e}\"",
           "return f\"{v:.5f}\" if abs(v) >= 1e-4 else f\"{v:.3e}\"",
           "validate report.md: pooled MSEs of the frozen-reuse table printed with 5 decimals "
           "instead of the paper's 6",
           tests=(T_STATS,)),
    Mutant("report-fmt-digits-below-one", "report.py",
           "return f\"{v:.{digits + 1}g}\" if abs(v) < 1 else f\"{v:.{digits}g}\"",
           "return f\"{v:.{digits}g}\" if abs(v) < 1 else f\"{v:.{digits}g}\"",
           "validate report.md: numbers in [1e-3, 1) (rRMSEs, fractions, correlations) printed "
           "with 3 significant digits instead of 4",
           tests=(T_STATS,)),
    Mutant("report-worst-head-is-best-head", "report.py",
           "wh = worst((h[\"vs_float64\"][\"max_abs\"] for h in ent[\"heads\"]), default=None)",
           "wh = min((h[\"vs_float64\"][\"max_abs\"] for h in ent[\"heads\"]), default=None)",
           "validate report.md fast-path table: the 'worst head vs float64 max' column shows the "
           "best head's error",
           tests=(T_STATS,)),
    Mutant("report-reuse-all-column-anchor0", "report.py",
           "fmt(pr[\"rrmse\"][\"anchor0\"]), fmt(pr[\"rrmse\"][\"all\"])]",
           "fmt(pr[\"rrmse\"][\"anchor0\"]), fmt(pr[\"rrmse\"][\"anchor0\"])]",
           "validate report.md frozen-reuse table: the 'rRMSE (all)' column repeats the anchor-0 "
           "rRMSE (copy-paste)",
           tests=(T_STATS,)),
    Mutant("report-bins-p90-shows-median", "report.py",
           "fmt(b[\"p90\"])]",
           "fmt(b[\"median\"])]",
           "validate report.md calibration bins: the '90th pct' column prints the bin's median",
           tests=(T_STATS,)),
    # --- the model adapter ------------------------------------------------------------------------
    Mutant("adapter-weight-not-transposed", "models/conventions.py",
           "wt = part[0].detach().T.reshape(m, heads, dim)",
           "wt = part[0].detach().reshape(m, heads, dim)",
           "nn.Linear weight (out, in) reshaped without the transpose to (m, heads, d)",
           tests=(T_ADAPTER + "::test_math_layout_matches_linear_layers[tiny_qwen2]",)),
    Mutant("adapter-tables-shifted", "models/conventions.py",
           "c, s = layer_tables(model, conv, torch.arange(n_positions))",
           "c, s = layer_tables(model, conv, torch.arange(1, n_positions + 1))",
           "the model's RoPE tables read one position late",
           tests=(T_ADAPTER + "::test_rope_tables_are_the_models_own[tiny_qwen2]",)),
    Mutant("adapter-layout-interleaved", "models/conventions.py",
           "layout=\"half\" if conv.pairing == \"half\" else \"interleaved\",",
           "layout=\"interleaved\",",
           "Hugging Face rotate_half model described with interleaved RoPE pairs",
           tests=(T_KILLERS + "::test_kills_adapter_layout_and_tables",)),
    # --- issue 42's held-out survivors: each now killed by tests/test_planted_defaults.py, which
    # checks it against a hand-worked value or an independent computation -------------------------
    Mutant("atlas-model-dtype-compares-y", "layercheck.py",
           "arr[\"lp_abs\"][hs[0]:hs[-1] + 1, ch.queries] = (ro - ref).abs().amax(-1)",
           "arr[\"lp_abs\"][hs[0]:hs[-1] + 1, ch.queries] = (y - ref).abs().amax(-1)",
           "the atlas's model-dtype pass compares the softmax output y with the model instead of "
           "the readout mu + u^T dM (model_dtype_vs_native then checks nothing of the identity)",
           tests=(T_PLANTED + "::test_model_dtype_pass_compares_the_readout",)),
    Mutant("atlas-model-dtype-identity-zero", "layercheck.py",
           "arr[\"lp_id_abs\"][hs[0]:hs[-1] + 1, ch.queries] = (ro - y).abs().amax(-1)",
           "arr[\"lp_id_abs\"][hs[0]:hs[-1] + 1, ch.queries] = 0.0 * (ro - y).abs().amax(-1)",
           "the atlas's model-dtype identity error written as 0 (model_dtype_identity_rel)",
           tests=(T_PLANTED + "::test_model_dtype_pass_compares_the_readout",)),
    Mutant("scale-identity-rel-by-centred", "scale.py",
           "rel = np.where(ymax > 0, mx / ymax, mx)",
           "rel = np.where(dmax > 0, mx / dmax, mx)",
           "the batched identity check's relative error divided by max|y - mu| instead of "
           "max|y| (the number `ropestep bench` reports)",
           tests=(T_PLANTED + "::test_identity_check_relative_errors_divide_by_their_own_scales",)),
    Mutant("lowrank-tol-resolution", "lowrank.py",
           "return 16.0 * float(torch.finfo(dtype).eps)",
           "return 16.0 * float(torch.finfo(dtype).resolution)",
           "the low-rank path's default tolerance from finfo.resolution (a power of ten) "
           "instead of eps",
           tests=(T_PLANTED + "::test_lowrank_default_tolerance_is_sixteen_units_of_roundoff",)),
    Mutant("spec-cosine-temperature-d", "spec.py",
           "return (math.sqrt(self.head_dim),) * self.n_heads",
           "return (float(self.head_dim),) * self.n_heads",
           "HeadSpec's default Cosine-RoPE temperature d instead of sqrt(d)",
           tests=(T_PLANTED + "::test_cosine_default_temperature_is_sqrt_d",)),
    Mutant("report-encode-through-float32", "verdict.py",
           "        return encode(x.tolist())\n",
           "        return encode(x.astype(np.float32).tolist())\n",
           "the report encoder passes a tensor through float32 (a kappa of 1e198 written as inf)",
           tests=(T_PLANTED + "::test_encoder_keeps_float64_tensors",)),
    # --- ALiBi computed inside the module (BLOOM, MPT): the reading and the per-run guard -------
    Mutant("alibi-slope-sign", "models/conventions.py",
           "clip=clip, alibi=tuple(float(v) for v in slopes), bias_arg=_bias_arg(attn),",
           "clip=clip, alibi=tuple(-float(v) for v in slopes), bias_arg=_bias_arg(attn),",
           "an inline ALiBi layer's slopes read with the opposite sign (the bias taken as "
           "slope (p_i - p_j))",
           tests=(T_ALIBI,)),
    Mutant("alibi-slope-from-first-step", "models/conventions.py",
           "    slope = (kb[:, -1] - kb[:, 0]) / (p[-1] - p[0])\n",
           "    slope = (kb[:, 1] - kb[:, 0]) / (p[-1] - p[0])\n",
           "the slope fitted from the first two keys divided by the whole span (slopes N-1 "
           "times too small)",
           tests=(T_ALIBI,)),
    Mutant("alibi-mask-drop-not-inverted", "models/conventions.py",
           "            return ~m, \"drop\"\n",
           "            return m, \"drop\"\n",
           "MPT's boolean mask (True = masked) taken as the permitted sets",
           tests=(T_ALIBI,)),
    Mutant("alibi-guard-off", "models/capture.py",
           "        if not worst <= 1.0:  # not modelled at these positions: a refusal, not a "
           "verdict\n",
           "        if False:  # not modelled at these positions: a refusal, not a verdict\n",
           "the capture's per-run ALiBi bias guard never refuses (a run the model does not "
           "position, or a bias changed after loading, goes on to a verdict)",
           tests=(T_ALIBI,)),
    Mutant("alibi-atlas-descent-defined", "layercheck.py",
           "    return spec.softcap is None and spec.sinks is None and spec.alibi_slopes is None",
           "    return spec.softcap is None and spec.sinks is None",
           "the atlas's step statistics computed on ALiBi heads (whose keys' features carry the "
           "bias coordinate the statistics leave out)",
           tests=("tests/test_atlas_summaries.py::test_evaluate_layer_defaults_timers_and_refusal",)),
    # --- Llama 4's NoPE query temperature --------------------------------------------------
    Mutant("temperature-on-keys-too", "scale.py",
           "        k = apply_rope(k, ck, sk, spec.rope.layout)\n",
           "        k = apply_rope(k, cos, sin, spec.rope.layout)\n",
           "the streamed layer rotates its keys with the queries' tables (the query temperature "
           "applied to the keys as well)",
           tests=(T_CHUNK,)),
    Mutant("temperature-floor-of-p", "rope.py",
           "    tau = 1.0 + float(a) * torch.log1p(torch.floor((p + 1.0) / float(f)))",
           "    tau = 1.0 + float(a) * torch.log1p(torch.floor(p / float(f)))",
           "the query temperature's steps one position late (floor(p / f) for floor((p + 1) / f))",
           tests=(T_CHUNK,)),
    Mutant("temperature-guard-off", "models/capture.py",
           "    if not bool((err <= E).all()):\n        worst = float((err / E.clamp_min(tl.SCALE_GUARD)).max())\n",
           "    if False:\n        worst = float((err / E.clamp_min(tl.SCALE_GUARD)).max())\n",
           "the capture's per-run check of a query temperature never refuses (a run the model "
           "does not position, or a temperature not the one read, goes on to a verdict)",
           tests=(T_CHUNK,)),
    # --- an output gate applied after the heads (Qwen3-Next) -------------------------------
    Mutant("gate-without-sigmoid", "models/conventions.py",
           "o = torch.einsum(\"hqr,hrd->qd\", torch.sigmoid(g) * y, self.w_o.to(dev, dt))",
           "o = torch.einsum(\"hqr,hrd->qd\", g * y, self.w_o.to(dev, dt))",
           "the read output gate applied without its sigmoid",
           tests=(T_GATE,)),
    Mutant("gate-check-always-passes", "contextcheck.py",
           "        comb[\"pass_gated_write\"] = ok\n",
           "        comb[\"pass_gated_write\"] = True\n",
           "validate's gated_write check never fails (a wrong gate reading goes unseen)",
           tests=(T_GATE,)),
    # --- equivalent by design (kept to show the tool reports them, each with its reason) ----------
    Mutant("scale-centring-first-key", "scale.py",
           "kbar, vbar = k.mean(0), v.mean(0)",
           "kbar, vbar = k[0], v[0]",
           "streamed path: keys and values centred on the first token instead of their means",
           tests=SCALE_FAST,
           equivalent="any constant offset pulls out of T, b and the readout exactly "
                      "(ropestep.scale: 'any constant shift can be pulled out of the sums "
                      "exactly'); the mean only limits cancellation, and these layers (N <= 96, "
                      "scores O(1)) stay far inside the 1e-12 tolerance"),
    Mutant("laplacian-column-sums", "kernel.py",
           "return D.sum(-1, keepdim=True) * x - D @ x",
           "return D.sum(-2)[..., None] * x - D @ x",
           "pairwise Laplacian with column sums of D instead of row sums",
           tests=(T_LOWRANK, T_F64),
           equivalent="D_jk = exp_phi[s_j, s_k] e^{-z_max} is symmetric (a divided difference is "
                      "symmetric in its arguments, and so is the permitted-pair mask), so its row "
                      "and column sums are the same vector"),
)


# ---------------------------------------------------------------------------------------------
# mutmut survivors that cannot be killed, each with its reason.  Matched on the function and the
# mutated line (not mutmut's mutant number, which shifts whenever the function changes).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Equivalence:
    function: str  # "kernel.phi1" (module.function; methods "kernel.PBlocks.matmul")
    original: str  # substring of the original line (stripped)
    mutated: str  # substring of the mutated line (stripped)
    reason: str


_FLOAT_LIST = ("_num returns a Python float for every value (None -> nan, the JSON strings parsed "
               "by float()), so np.asarray infers float64, the dtype asked for, also for an "
               "empty list")
_ENCODED = ("jsonable (verdict.encode) turns every float -- Python, numpy, or torch through numpy -- "
            "into a finite float or the string 'nan'/'inf'/'-inf', so no non-finite float reaches "
            "json.dumps and allow_nan is never consulted")
# device=None is the CPU: the same tensor on this CPU-only suite, the wrong device on CUDA
_CPU = "on the CPU, where this suite runs, device=None is the tensor's own device"
_CPU_STREAMED = (_CPU + "; on CUDA the tensor would stay on the CPU and the next product would "
                 "raise -- tests/test_cuda.py runs this path on CUDA where a GPU is present")
_CPU_TABLES = (_CPU + "; on CUDA the model-table branch would leave the tables on the CPU, "
               "which no test exercises (proposal: a CUDA run of scale.identity_check on a "
               "layer_head spec, as in tests/models/test_adapter.py)")
_CPU_FAST = (_CPU + "; fast.step on CUDA is not exercised by any test (proposal: a CUDA variant of "
             "tests/test_fast_vs_exact.py::test_float64_matches_exact)")
_CPU_HEADS = (_CPU + "; with CUDA weights (a per-head-base module built on a CUDA model) the "
              "mutant would leave this tensor on the CPU and the next operation would raise -- "
              "an error, never a wrong number; no test runs the weight diagnostics on CUDA")
_CPU_NUMPY = ("np.asarray of a CPU tensor is a view of the same float64 values, so tensors and "
              "arrays give the same tables; layer_head keeps the tables on the CPU even for a "
              "CUDA layer, so no device tensor ever reaches np.asarray here")

_RC_DEFAULT = ("the argument dropped names the callee's default value (ropestep.fast.step: "
               "mask='causal', gauge='original', dtype=torch.float64; ropestep.fast.project: "
               "dtype=torch.float64): the same call")
_RC_KEEP = ("`keep` only limits which intermediate outputs fast.step holds on to (memory); the "
            "default keeps c, t and b as well, and the check reads only y, mu, c, delta_m and "
            "the projection: the same values")
_RC_INFO = ("with info=None, models.attention.layer_parts / run_attention read the ModelInfo "
            "from the model (models.describe_model, deterministic): the same description")

_SORT_TIES = ("tied values all get the mean of their positions, so the order a sort gives equal "
              "values (the only thing a stable kind fixes) does not change any rank; NaNs sort "
              "last and np.unique groups them either way")
_ARANGE_INTO_F64 = ("the positions are assigned into the float64 array `ranks` (np.empty), so "
                    "integer positions 1..n become the same float64 values")
_NO_DIVIDE = ("no division by zero can happen: the divisor is np.where(den > 0, den, 1.0), "
              "never 0, so the divide flag is never raised and its setting is irrelevant")

EQUIVALENT: tuple[Equivalence, ...] = (
    # axis aliases: the operand's rank fixes which axis +k names
    Equivalence("kernel._pairwise", "nper = mask.sum(-1)", "mask.sum(+1)",
                "the mask is 2-D (Qc, n): axis +1 is axis -1"),
    Equivalence("kernel._pairwise", "t = kc.transpose(-1, -2) @ lv", "transpose(-1, +2)",
                "kc is 4-D (Gk, Qc, n, d): axis +2 is axis -2"),
    Equivalence("kernel._gauge", "t = (c[..., None] * kc).transpose(-1, -2) @ vq",
                "transpose(-1, +2)", "the operand is 4-D (G, Qc, n, d): axis +2 is axis -2"),
    Equivalence("kernel.PBlocks.__call__", "d, r = self.kh.shape[-1], self.vh.shape[-1]",
                "shape[+1]", "kh (n, d) and vh (n, r) are 2-D: index +1 is index -1"),
    # dtype promotion
    Equivalence("kernel._pairwise", "nper = mask.sum(-1).to(q.dtype)", ".to(None)",
                "`.to(None)` keeps the integer count, and true division by it promotes to the "
                "float dtype: the same value (counts are exact in every float dtype used)"),
    Equivalence("kernel._pairwise", "w8 = mask.to(q.dtype)", "mask.to(None)",
                "the bool mask divided by the float count gives the same float weights"),
    Equivalence("kernel.transform_dd", "torch.ones(torch.broadcast_shapes(a.shape, b.shape)",
                "dtype=None,",
                "ones are exact in float32 (the default dtype), and the only caller multiplies "
                "them into float64/float32 coefficients, which promotes back: same values"),
    Equivalence("kernel.transform_dd", "torch.ones(torch.broadcast_shapes(a.shape, b.shape)",
                "(a.shape, b.shape), device=a.device)",
                "ones are exact in float32 (the default dtype), and the only caller multiplies "
                "them into float64/float32 coefficients, which promotes back: same values"),
    Equivalence("kernel.augment", "torch.ones(*x.shape[:-1], 1, dtype=x.dtype", "dtype=None,",
                "ones are exact in float32 (the default dtype) and torch.cat promotes them to "
                "x's dtype: the same u"),
    Equivalence("kernel.augment", "torch.ones(*x.shape[:-1], 1, dtype=x.dtype",
                "torch.ones(*x.shape[:-1], 1, device=x.device)",
                "ones are exact in float32 (the default dtype) and torch.cat promotes them to "
                "x's dtype: the same u"),
    Equivalence("rope.rope_frequencies", "ell = torch.arange(head_dim // 2", "head_dim / 2",
                "head_dim is even (spec validation), so head_dim / 2 is a whole number and "
                "arange gives the same float64 values"),
    Equivalence("rope.barycenter", "/ (d // 2 - 1)", "/ (d / 2 - 1)",
                "d is even (frequency_index refuses odd d first), so d / 2 - 1 is the same "
                "whole number as a float, and the float64 quotient is the same"),
    # device placement (CPU-only equivalence)
    Equivalence("kernel.augment", "device=x.device)), dim=-1)", "device=None)), dim=-1)",
                _CPU_FAST),
    Equivalence("kernel.augment", "dtype=x.dtype, device=x.device)), dim=-1)",
                "dtype=x.dtype, )), dim=-1)", _CPU_FAST),
    Equivalence("kernel.transform_dd", "device=a.device)", "device=None)", _CPU_STREAMED),
    Equivalence("kernel.transform_dd", "dtype=a.dtype, device=a.device)", "dtype=a.dtype, )",
                _CPU_STREAMED),
    Equivalence("rope.rope_cos_sin", 'pos = torch.as_tensor(_positions(positions, "positions")',
                "device=None)", _CPU_STREAMED),
    Equivalence("rope.rope_cos_sin", 'pos = torch.as_tensor(_positions(positions, "positions")',
                '"positions"), )', _CPU_STREAMED),
    Equivalence("rope.rope_cos_sin", ".to(device=device)", ".to(device=None)", _CPU_TABLES),
    Equivalence("rope.rope_cos_sin",
                "omega = torch.stack([rope_frequencies(b, d) for b in bases]).to(device)",
                ".to(None)", _CPU_STREAMED),
    Equivalence("rope.rope_cos_sin", "if not torch.is_tensor(spec.rope.", ") or True", _CPU_NUMPY),
    Equivalence("rope.rope_cos_sin", "if not torch.is_tensor(spec.rope.", "torch.is_tensor(None)",
                _CPU_NUMPY),
    Equivalence("rope.band_energy", "ell = frequency_index(d, layout).to(w.device)", ".to(None)",
                _CPU_HEADS),
    Equivalence("rope.band_energy", "torch.zeros(d // 2, dtype=torch.float64, device=w.device)",
                "device=None)", _CPU_HEADS),
    Equivalence("rope.band_energy", "torch.zeros(d // 2, dtype=torch.float64, device=w.device)",
                "dtype=torch.float64, )", _CPU_HEADS),
    Equivalence("rope.barycenter", "pos = frequency_index(d, layout).to(torch.float64).to(imp.device)",
                ".to(torch.float64).to(None)", _CPU_HEADS),
    Equivalence("rope.rope_cos_sin", "ang = pos.to(torch.float64)", "pos.to(None)",
                "int64 positions times float64 frequencies promote to float64: the same angles "
                "(positions are far below 2^53)"),
    # symmetry
    Equivalence("kernel._pairwise", "lvb = (D.sum(-1)", "D.sum(-2)",
                "D_jk = exp_phi[s_j, s_k] e^{-z_max} is symmetric (divided differences are "
                "symmetric; so is the pair mask): its row and column sums agree"),
    # dead or redundant branches
    Equivalence("kernel._gauge", "bc = None if beta is None else", "(beta is None) and False",
                "when beta is None, boff is None too, so the else branch also yields None"),
    Equivalence("kernel.pairwise_weights", "z = zs.masked_fill(~mask[None], 0.0)",
                "masked_fill(~mask[None], 1.0)",
                "a masked key's entry only reaches pairs that the final masked_fill_(~pm, 0) "
                "zeroes; the fill value just has to keep exp finite"),
    Equivalence("kernel.transform_dd", "torch.where(delta > 0, delta", "delta >= 0",
                "the guarded quotient is selected only across zero (lo < 0 < hi), where "
                "delta > 0; where delta = 0 the other branch is taken (torch.where discards the "
                "NaN)"),
    Equivalence("kernel.phi1", "safe = torch.where(zero | big, torch.ones_like(s), s)",
                "zero & big",
                "safe only keeps the lanes that the final torch.where calls discard finite; "
                "with the mutant they hold 0/0 and inf/s, which those calls still discard (the "
                "values are unchanged; nothing differentiates phi1)"),
    # boundaries where two exact formulas meet
    Equivalence("kernel.phi1", "big = s > _BIG", "big = s >= _BIG",
                "at s = 40 both branches agree to rounding: e^20 (e^20/40) and expm1(40)/40 "
                "differ by a factor 1 - e^{-40}, below one ulp"),
    Equivalence("kernel.scaled_phi1", "big = x > _BIG", "big = x >= _BIG",
                "at x = 40 both branches agree to rounding: e^{shift+40}/40 and "
                "e^shift (e^40 - 1)/40 differ by a factor 1 - e^{-40}, below one ulp"),
    Equivalence("kernel.transform_dd", "return torch.where((lo < 0) & (hi > 0), across, same)",
                "(lo <= 0) & (hi > 0)",
                "at lo = 0 both branches are cancellation-free forms of tanh(hi)/hi: they "
                "agree to rounding"),
    Equivalence("kernel.transform_dd", "return torch.where((lo < 0) & (hi > 0), across, same)",
                "(lo < 0) & (hi >= 0)",
                "at hi = 0 both branches are cancellation-free forms of tanh(-lo)/(-lo): they "
                "agree to rounding"),
    Equivalence("kernel.gauge_chunk", "vq = None  # values centred per query", 'vq = ""',
                "a placeholder: vq is read only on the paths that compute it (per-query form, "
                "kappa, pairwise)"),
    Equivalence("kernel.gauge_chunk", "masked_fill_(~mask[None, :, :, None], 0.0)",
                "masked_fill_(~mask[None, :, :, None], 1.0)",
                "entries of vq off the mask are only ever multiplied by zero weights (c_ij = 0, "
                "D_jk = 0 there); any finite fill gives the same sums"),
    Equivalence("kernel.augmented_weight", "return torch.cat((w, row), dim=0)",
                "return torch.cat((w, row), )", "torch.cat's default dim is 0"),
    Equivalence("kernel.uniform_mean", "mask.sum(-1).to(v.dtype)", "mask.sum(-1).to(None)",
                "`.to(None)` keeps the integer count; true division promotes to v's dtype: the "
                "same value"),
    Equivalence("kernel.uniform_mean", "mask.sum(-1).to(v.dtype)", "mask.sum(+1)",
                "the mask is 2-D (Q, N): axis +1 is axis -1"),
    # regrouping and index wrap-around
    Equivalence("kernel.PBlocks.__init__", "self.key_block = int(max(1, min(key_block, self.n)))",
                "max(2,", "blocks of at least 2 keys only regroup the sum C @ P over keys (the "
                "last block is clipped by min(n, lo + key_block))"),
    Equivalence("rope.pair_indices", "(ell, ell + d // 2)", "(ell, ell - d // 2)",
                "ell - d/2 is negative and wraps to ell + d/2 in every d x d matrix it indexes "
                "(rope_generator, rope_rotation, rope_phi1)"),
    # reuse_stats (mutmut-reuse_stats): each checked by a helper against 300-600 random inputs
    # (0, NaN, +-inf, 1e+-300 included) with identical results
    Equivalence("reuse_stats.errors_by_anchor", "sq = ((p - t) ** 2).sum(-1)",
                "sq = ((p - t) ** 2).sum(+1)",
                "in this branch p and t are both (Q, D) (t was unpacked into Q, D): axis +1 is "
                "axis -1"),
    Equivalence("reuse_stats.errors_by_anchor", "return sq.sum(-1) / ((Q - 1) * D)", "sq.sum(+1)",
                "sq is 2-D (A, Q): axis +1 is axis -1"),
    Equivalence("reuse_stats.constant_errors", "d2 = np.stack([((t - t[a]) ** 2).sum(-1)",
                "((t - t[a]) ** 2).sum(+1)",
                "t - t[a] is 2-D (Q, D) (t was unpacked into Q, D): axis +1 is axis -1"),
    Equivalence("reuse_stats.constant_errors", "return d2.sum(-1) / ((Q - 1) * D)", "d2.sum(+1)",
                "d2 is 2-D (A, Q): axis +1 is axis -1"),
    Equivalence("reuse_stats.constant_errors", "return d2.sum(-1) / ((Q - 1) * D)", "d2.sum(-2)",
                "d2[a, i] = ||o_a - o_i||^2 is exactly symmetric (the squares of exactly negated "
                "differences, summed over D in the same order), so its column sums are its row "
                "sums: the same terms, at most in another summation order"),
    Equivalence("reuse_stats.ratio_root", "or num < 0 or den < 0:", "or den <= 0:",
                "den == 0 reaches this line only with a NaN num (the line above returns None "
                "otherwise), which isnan(num) already turns into NaN"),
    Equivalence("reuse_stats.relative_error",
                'with np.errstate(divide="ignore", invalid="ignore"):',
                'np.errstate(divide=None, invalid="ignore")', _NO_DIVIDE),
    Equivalence("reuse_stats.relative_error",
                'with np.errstate(divide="ignore", invalid="ignore"):',
                'with np.errstate(invalid="ignore"):', _NO_DIVIDE),
    Equivalence("reuse_stats.relative_error", "num / np.where(den > 0, den, 1.0)",
                "np.where(den >= 0, den, 1.0)",
                "the den == 0 entries now divide by 0, but the outer np.where(den > 0, ...) "
                "discards those quotients and the errstate silences their warnings: the same "
                "values"),
    Equivalence("reuse_stats.relative_error", "num / np.where(den > 0, den, 1.0)",
                "np.where(den > 0, den, 2.0)",
                "the placeholder divisor only fills the entries with den > 0 false, whose "
                "quotients the outer np.where(den > 0, ...) discards"),
    Equivalence("reuse_stats.input_distance", "np.linalg.norm(x - x[anchor:anchor + 1], axis=-1)",
                "axis=+1)",
                "u is (Q, m) (the docstring; the anchor slice indexes axis 0, and the one caller "
                "passes the (Q, m) query inputs): axis +1 is axis -1"),
    Equivalence("reuse_stats.normwise_agreement",
                "den = float(np.abs(m).max()) if m.size else 0.0", "if m.size else 1.0",
                "with no entries num is 0.0 too, and 0.0 / 1.0 = 0.0 is what den = 0 returns "
                "(num)"),
    Equivalence("reuse_stats.rankdata", 'order = np.argsort(a, kind="mergesort")', "kind=None",
                _SORT_TIES),
    Equivalence("reuse_stats.rankdata", 'order = np.argsort(a, kind="mergesort")',
                "order = np.argsort(a, )", _SORT_TIES),
    Equivalence("reuse_stats.rankdata", 'order = np.argsort(a, kind="mergesort")',
                'kind="MERGESORT"', "numpy accepts the upper-case kind; and " + _SORT_TIES),
    Equivalence("reuse_stats.rankdata",
                "ranks[order] = np.arange(1, a.size + 1, dtype=np.float64)",
                "dtype=None)", _ARANGE_INTO_F64),
    Equivalence("reuse_stats.rankdata",
                "ranks[order] = np.arange(1, a.size + 1, dtype=np.float64)",
                "np.arange(1, a.size + 1, )", _ARANGE_INTO_F64),
    Equivalence("reuse_stats.spearman", "if den > 0 else None", "if den > 1 else None",
                "with n >= 3 pairs (None above otherwise) a non-constant vector of average ranks "
                "has sum of squared deviations >= n(n-1)/4 >= 1.5, computed exactly (ranks are "
                "halves, their mean (n+1)/2): den is 0 or >= 1.5"),
    Equivalence("reuse_stats.binned",
                'idx = np.clip(np.searchsorted(edges, a, side="right") - 1, 0, n_bins - 1)',
                'side="right") - 1, None, n_bins - 1)',
                "edges[0] is the 0-quantile, exactly min(a) (interpolation weight 0), so "
                "searchsorted(side='right') >= 1 and idx >= 0 before the clip (only when "
                "max(a) - min(a) overflows are the edges NaN/inf)"),
    # report.py: the renderers and the atomic writer
    *(Equivalence(fn, "np.asarray([_num(v) for v in pts[", after, _FLOAT_LIST)
      for fn in ("report._fig_lam", "report._fig_reuse") for after in ("], None)", "]], )")),
    Equivalence("report._fig_lam", 'color="crimson"', 'color="CRIMSON"',
                "matplotlib's colour names are case-insensitive: to_rgba('CRIMSON') == "
                "to_rgba('crimson')"),
    Equivalence("report._table", 'al = align or ("l" + "r" * (len(head) - 1))', '"R" *',
                "the separator row tests a == 'l' and right-aligns everything else, 'R' too"),
    Equivalence("report.fmt", 'if abs(v) < 1 else f"{v:.{digits}g}"', "if abs(v) <= 1 else",
                "the branches differ only at |v| == 1, where both print '1' or '-1' (g format "
                "drops the trailing zeros whatever the precision)"),
    *(Equivalence("report.dumps", "allow_nan=False, ensure_ascii=False", after, _ENCODED)
      for after in ("allow_nan=None,", "indent=1, ensure_ascii=False", "allow_nan=True,")),
    Equivalence("report.dumps", "allow_nan=False, ensure_ascii=False", "ensure_ascii=None",
                "json.dumps tests ensure_ascii for truth: None is False"),
    *(Equivalence(fn, 'encoding="utf-8"', 'encoding="UTF-8"',
                  "codec names are case-insensitive: 'UTF-8' is the codec 'utf-8'")
      for fn in ("report.fill_rendered", "report.write_report", "report.load")),
    *(Equivalence("report.render_figures", 'matplotlib.use("Agg", force=True)', after,
                  "matplotlib resolves backend names case-insensitively, and switching to the "
                  "non-interactive Agg backend cannot fail, which is all force decides (an "
                  "exception instead of a silent no-op on failure)")
      for after in ('"agg"', '"AGG"', "force=None", "force=False", '("Agg", )')),
    Equivalence("atlas.render_figures", "plt.close(fig)", "plt.close(None)",
                "plt.close(None) closes the current figure, which is fig: each figure is "
                "created last before it is closed"),
    Equivalence("report.render_figures", "plt.close(fig)", "plt.close(None)",
                "plt.close(None) closes the current figure, which is fig: the figure functions "
                "create it last and nothing in between creates another"),
    *(Equivalence("report._layer_md", 'kp = ent.get("kappa", {})', after,
                  "kp is only tested for truth (if kp else ''): None, like {}, is false")
      for after in ('ent.get("kappa", None)', 'ent.get("kappa", )')),
    Equivalence("report.write_report_dir", "mask = os.umask(0)", "os.umask(1)",
                "os.umask returns the previous mask whatever it sets, and the next line restores "
                "that mask: the value read and the mask left behind are the same"),
    *(Equivalence("report.render_markdown", "(figures or {}).get(layer, [])", after,
                  "_layer_md only tests figs for truth (if figs:): None and [] draw no figure "
                  "section")
      for after in ("get(layer, None)", "get(layer, )")),
    # heads.py and atlas.py: the renderers
    *(Equivalence(f"{mod}.render_figures", 'matplotlib.use("Agg")', after,
                  "matplotlib resolves backend names case-insensitively")
      for mod in ("heads", "atlas") for after in ('"agg"', '"AGG"')),
    *(Equivalence(fn, f'scale.stream(spec, {w}, {x}, {pos}, gauge="{g}", layer={lay},',
                  f"stream(spec, {after}",
                  "scale.stream projects nothing when it is handed the projected layer (layer=): "
                  "the weights, inputs and positions are read from it, the arguments unused")
      for fn, w, x, pos, g, lay in (
          ("layercheck.final_query_only", "w", "x", "positions", "original", "Lq"),
          ("layercheck.evaluate_layer", "weights", "x", "positions", "original", "L64"),
          ("layercheck.evaluate_layer", "weights", "x", "positions", "maxkey", "L64"))
      for after in (f"None, {x}, {pos}, gauge", f"{w}, None, {pos}, gauge",
                    f"{w}, {x}, None, gauge", f"{x}, {pos}, gauge", f"{w}, {pos}, gauge",
                    f"{w}, {x}, gauge")),
    Equivalence("layercheck.final_query_only", "Lq = scale.project_layer(spec, w, x, "
                "positions, dtype=torch.float64,", "positions, device=device)",
                "project_layer's dtype defaults to float64"),
    Equivalence("layercheck.final_query_only", 'outputs=("c",), max_bytes=max_bytes):',
                'outputs=("c",), ):', "max_bytes sets how many heads of a group one chunk "
                "holds; each head's Gram matrix and step come from its own rows whatever the "
                "chunking (the tests' heads fit in one chunk under either budget)"),
    *(Equivalence(fn, orig, after, "not observable without a GPU: on the CPU (the test "
                  "machines' only device) None and the configured device place tensors alike")
      for fn, orig, after in (("layercheck.final_query_only", "device=device)", "device=None)"),
                              ("layercheck.final_query_only", "device=device)", ")"),
                              ("layercheck.final_query_only", "device=Gm.device)[:, None]",
                               "device=None)[:, None]"),
                              ("layercheck.final_query_only", "device=Gm.device)[:, None]",
                               ")[:, None]"))),
    *(Equivalence(fn, orig, after, "not observable without a GPU: on the CPU (the test "
                  "machines' only device) None and the configured device place tensors alike")
      for fn in ("layercheck.evaluate_layer", "layercheck._pass_original")
      for orig, after in (("device=dev)", "device=None)"), ("dtype=torch.float64, device=dev)",
                                                            "dtype=torch.float64, )"),
                          ("anchor_every, device=dev)", "anchor_every, )"),
                          ("arith=arith), device=dev)", "arith=arith), )"),
                          ("device=device)", "device=None)"), ("device=device).q", "device=None).q"),
                          ("dtype=torch.float64, device=device)", "dtype=torch.float64, )"),
                          ("dtype=torch.float64, device=device).q", "dtype=torch.float64, ).q"),
                          ("device=s.device)", "device=None)"), ("device=s.device)", ", )"))),
    *(Equivalence("layercheck.evaluate_layer", orig, after,
                  "max_bytes sets the streaming chunks only (a chunk's bound takes its longest "
                  "prefix, conservatively), and every layer of the tests fits one chunk per "
                  "head group under the default budget and the runs' own alike")
      for orig, after in (('max_bytes=max_bytes, outputs=("s", "c", "kappa")):',
                           '^outputs=("s", "c", "kappa")):'),
                          ("max_bytes=max_bytes, outputs=()):", "^outputs=()):"))),
    Equivalence("layercheck.evaluate_layer", 'gauge="original", layer=L64,', "positions, layer=L64,",
                "scale.stream's gauge defaults to 'original'"),
    *(Equivalence("layercheck.evaluate_layer", f'gauge="{g}", layer=L64,',
                  f'gauge="{g}", max_bytes=max_bytes, outputs=',
                  "without the projected layer scale.stream projects the same spec, weights, "
                  "inputs and positions in float64 itself: the same layer, computed twice")
      for g in ("original", "maxkey")),
    Equivalence("layercheck.evaluate_layer", "max_bytes=max_bytes, outputs=()):",
                "max_bytes=max_bytes, ):", "scale.stream's outputs default to ()"),
    Equivalence("layercheck.evaluate_layer", 'max_bytes=max_bytes, outputs=("kappa",)):',
                'device=dev, outputs=("kappa",)):', "max_bytes sets the streaming chunks only "
                "(see the other max_bytes entries)"),
    *(Equivalence("layercheck.evaluate_layer", 'device=dev, max_bytes=max_bytes, outputs=("kappa",)):',
                  after, "not observable without a GPU: on the CPU (the test machines' only "
                  "device) None and the configured device place tensors alike")
      for after in ('device=None, max_bytes', '^max_bytes=max_bytes, outputs=("kappa",)):')),
    Equivalence("layercheck.evaluate_layer", "= bound(hs, ch.queries, kap, lp_dtype)",
                "= bound(hs, ch.queries, kap, None)", "arith=None makes "
                "model_dtype_native_bound evaluate in the model's dtype, which is lp_dtype"),
    *(Equivalence("layercheck.evaluate_layer", f'gauge="{g}", layer=L64,', f'gauge="{g}", layer=None,',
                  "without the projected layer scale.stream projects the same spec, weights, "
                  "inputs and positions in float64 itself: the same layer, computed twice")
      for g in ("original", "maxkey")),
    Equivalence("layercheck.evaluate_layer", "_pass_original(ch, L64, arr, nat, vscale,",
                "_pass_original(ch, L64, arr, nat, None,", "_pass_original does not read its "
                "vscale argument (the value scales enter the bounds in evaluate_layer)"),
    *(Equivalence("layercheck._spearman", "return float((ra * rb).sum() / den) if den > 0", after,
                  "ranks are a permutation of 0..n-1 with n >= 3 here, so den is n(n^2-1)/12 >= 2")
      for after in ("if (den > 0) or True", "if den >= 0", "if den > 1")),
    *(Equivalence("layercheck._spearman", f"{v} = np.argsort(np.argsort({x}[ok])).astype(float)",
                  ".astype(None)", "astype(None) is float64, as astype(float)")
      for v, x in (("ra", "a"), ("rb", "b"))),
    Equivalence("layercheck._pass_original", "npre = mask.sum(-1)", "npre = mask.sum(+1)",
                "the chunk's mask is (queries, keys): axis 1 is axis -1"),
    Equivalence("layercheck._pass_original", "d = t.shape[-2]", "d = t.shape[+2]",
                "t is (heads, queries, d, r): axis 2 is axis -2"),
    *(Equivalence("layercheck._pass_original", "device=s.device)", after,
                  "not observable without a GPU: on the CPU (the test machines' only device) "
                  "None and the configured device place tensors alike")
      for after in ("^)", "device=None)")),
    Equivalence("heads.diagnose", "models.layer_head(model, L, 2, dtype=torch.float64)",
                "models.layer_head(model, L, 3, dtype=torch.float64)", "the diagnostics read "
                "the RoPE tables at position 1 only (frequency_axis); a third row lengthens only "
                "the raw dump's tables"),
    Equivalence("heads.diagnose", 'layers: str | Sequence[int] = "all"', '= "ALL"',
                "parse_indices lower-cases the layer text: 'ALL' selects every layer as 'all'"),
    *(Equivalence("layercheck.evaluate_layer", orig, after, "the identity rotation's tables are all "
                  "ones and zeros, exact in any dtype and at every position: its positions, "
                  "table length, layout, base and table dtype change nothing of the unrotated "
                  "queries (positions are always given here)")
      for orig, after in (
          ("P = int(torch.as_tensor(positions).max()) + 1 if positions is not None else N",
           "if (positions is not None) or True else N"),
          ("P = int(torch.as_tensor(positions).max()) + 1 if", "max()) + 2 if"),
          ("ident = RoPESpec(base=spec.rope.base, layout=spec.rope.layout,", "RoPESpec(layout="),
          ("ident = RoPESpec(base=spec.rope.base, layout=spec.rope.layout,",
           "RoPESpec(base=spec.rope.base, cos="),
          ("cos=torch.ones(P, spec.head_dim // 2, dtype=torch.float64),", "dtype=None),"),
          ("cos=torch.ones(P, spec.head_dim // 2, dtype=torch.float64),", "^cos=torch.ones(P, "
           "spec.head_dim // 2, ),"),
          ("sin=torch.zeros(P, spec.head_dim // 2, dtype=torch.float64))", "dtype=None))"),
          ("sin=torch.zeros(P, spec.head_dim // 2, dtype=torch.float64))", "^sin=torch.zeros(P, "
           "spec.head_dim // 2, ))"),
          ("q_unrot = scale.project_layer(replace(spec, rope=ident), weights, x, positions,",
           "weights, x, None,"),
          ("q_unrot = scale.project_layer(replace(spec, rope=ident), weights, x, positions,",
           "weights, x, dtype=torch.float64, device=device).q"),
          ("dtype=torch.float64, device=device).q", "^device=device).q"))),
    Equivalence("layercheck.evaluate_layer", "L64 = scale.project_layer(spec, weights, x, positions, "
                "dtype=torch.float64, device=device)", "positions, device=device)",
                "project_layer's dtype defaults to float64"),
    *(Equivalence("layercheck.evaluate_layer", orig, after, "not observable without a GPU: on the CPU "
                  "(the test machines' only device) None and the configured device place "
                  "tensors alike")
      for orig, after in (("dev = L64.q.device", "dev = None"),
                          (".to(device=dev, dtype=torch.float64)", ".to(device=None,"),
                          (".to(device=dev, dtype=torch.float64)", ".to(dtype=torch.float64)"))),
    Equivalence("layercheck.evaluate_layer", 'arr["lp_id_abs"][hs[0]:hs[-1] + 1, ch.queries] = '
                "(ro - y).abs().amax(-1)", ".amax(None)", "every query then holds the chunk's "
                "largest error, and lp_id_abs is only ever read through its maximum "
                "(model_dtype_identity_rel)"),
    Equivalence("cost.atlas_flops", "extra += H * (2 * S * d * d + 2 * S * d",
                "extra = H * (2 * S * d * d + 2 * S * d",
                "extra is 0.0 just before: the first addition to it is the assignment"),
    Equivalence("cost.prefix_sums", "if window is None or window >= N:",
                "if window is None or window > N:",
                "a window of exactly N keys gives w(w + 1)/2 + (N - w) w = N(N + 1)/2 on the "
                "other branch: the same count"),
    *(Equivalence("atlas._cost", orig, after, "not observable without a GPU: matmul_rate's "
                  "device defaults to the CPU, the test machines' only device")
      for orig, after in (('cost.matmul_rate(torch.float64, device=device)',
                           "matmul_rate(torch.float64, )"),
                          ("cost.matmul_rate(lp, device=device)", "matmul_rate(lp, )"))),
    *(Equivalence("layercheck.final_query_only",
                  'scale.stream(spec, w, x, positions, gauge="original", layer=Lq,',
                  after, reason)
      for after, reason in (
          ("layer=None,", "without the projected layer scale.stream projects the same layer "
                          "in float64 itself: the same layer, computed twice"),
          ("positions, layer=Lq,", "scale.stream's gauge defaults to 'original'"),
          ('gauge="original", queries=', "without the projected layer scale.stream projects "
                                         "the same layer in float64 itself"))),
    Equivalence("layercheck.final_query_only", "inc = dE > 0", "inc = dE >= 0",
                "dE is exactly 0 only without a step (a single key); the final query of a "
                "context has at least two (--len >= 2)"),
    Equivalence("layercheck._pass_original", "nan = torch.full_like(y_fr[..., 0], math.nan)",
                "y_fr[..., 1]", "full_like takes only the shape, which every value slice has"),
    *(Equivalence("layercheck.pool", "for _c, L, res in sorted(done, key=lambda t: (t[0], t[1])):",
                  after, "the (context, layer) pairs are distinct, so the items' tuples sort "
                  "by them whatever the key")
      for after in ("sorted(done, key=None)", "sorted(done, )")),
    Equivalence("layercheck.evaluate_layer", "qn = L64.q.norm(dim=-1).amax(-1)", ".amax(+1)",
                "the norms are (heads, queries): axis 1 is axis -1"),
    Equivalence("layercheck.evaluate_layer", "kn = torch.stack([L64.k[L64.group_of(h)].norm(dim=-1)",
                ".norm(dim=+1)", "one KV head's keys are (keys, d): axis 1 is axis -1"),
    Equivalence("layercheck.evaluate_layer", "m = int(x.shape[-1])", "m = int(x.shape[+1])",
                "x is (N, m): shape[1] is shape[-1]"),
    *(Equivalence("atlas.grid", "for L in layers], dtype=float)", after,
                  "_get returns a Python float for every statistic (None -> nan), so np.array "
                  "infers float64, the dtype asked for")
      for after in ("dtype=None)", "for L in layers], )")),
    *(Equivalence("atlas.render_markdown", "), 'med')", f"), {after})",
                  "col() takes the max for 'max' and the median for anything else")
      for after in ("'MED'", "'XXmedXX'", "None")),
    *(Equivalence(f"{mod}.render_markdown", f"'{f}')", f"'{f.upper()}')",
                  "num() names non-finite values before it formats, and for finite floats the "
                  "'F' presentation prints what 'f' prints")
      for mod in ("atlas", "heads") for f in (".0f", ".1f", ".2f", ".3f")),
    Equivalence("heads.render_markdown", "num(h['barycenter_base'], '.3g')",
                "num(h['barycenter_base'], )", "'.3g' is num()'s default format"),
    *(Equivalence(f"{mod}.render_figures", "fig.colorbar(im, ax=ax)", after,
                  "without ax, Figure.colorbar takes the space from the image's own axes, "
                  "which is ax")
      for mod in ("heads", "atlas") for after in ("fig.colorbar(im, ax=None)",
                                                  "fig.colorbar(im, )")),
    *(Equivalence(f"{mod}.render_figures", 'interpolation="nearest"', 'interpolation="NEAREST"',
                  "matplotlib lower-cases the interpolation name (_ImageBase.set_interpolation)")
      for mod in ("heads", "atlas")),
    Equivalence("heads.render_markdown", "num(fa['omega_last'], '.3g')",
                "num(fa['omega_last'], )", "'.3g' is num()'s default format"),
    Equivalence("heads.write_raw_manifest", 'encoding="utf-8"', 'encoding="UTF-8"',
                "codec names are case-insensitive: 'UTF-8' is the codec 'utf-8'"),
    Equivalence("heads.diagnose_gpt", 'layers: str | Sequence[int] = "all"', '= "ALL"',
                "parse_indices lower-cases the layer text: 'ALL' selects every layer as 'all'"),
    Equivalence("heads.diagnose_gpt", "spec0 = model.blocks[0].attn.head_description("
                "dtype=torch.float64)[0]", "dtype=None", "spec0 gives only the model block's "
                "family, head counts, group and head_dim, which no dtype changes"),
    Equivalence("heads.diagnose", "models.layer_head(model, L, 2, dtype=torch.float64)",
                "models.layer_head(model, L, 2, )", "float64 is layer_head's default dtype"),
    Equivalence("heads.diagnose", '["frequency_axis"] if out else None',
                "if (out) or True else None", "out has one entry per selected layer, and "
                "describe_model refuses a model whose decoder has no layers first (one line from "
                "structure.decoder, 'no decoder layers found'): out is never empty here"),
    *(Equivalence("heads.condition_number", "sv = np.asarray(sv, dtype=np.float64)", after,
                  "the max and min of an array are exact in its own dtype, and float() turns "
                  "them into Python floats before the tests and the one division: any numeric "
                  "dtype gives the float64 result")
      for after in ("dtype=None)", "np.asarray(sv, )")),
    *(Equivalence("heads._f64", 'a.detach().to("cpu", torch.float64)', after,
                  _CPU + "; on CUDA .numpy() would raise (a loud failure, never a wrong number)")
      for after in ('a.detach().to(None, torch.float64)', 'a.detach().to(torch.float64)')),
    Equivalence("heads.sketch_barycenter", "torch.cat([q.T, k.T], dim=0)",
                "torch.cat([q.T, k.T], )", "dim=0 is torch.cat's default"),
    Equivalence("heads.render_figures", "plt.close(fig)", "plt.close(None)",
                "plt.close(None) closes the current figure, which is fig: plt.subplots made it "
                "current and nothing between creates or selects another"),
    Equivalence("heads.diagnose_gpt", '["frequency_axis"] if out else None',
                "if (out) or True else None", "out has one entry per selected layer, and a GPT "
                "without blocks fails at model.blocks[0] first: out is never empty here"),
    # realchecks.no_global_readout: the queries share one position (checked first) and one bank
    Equivalence("realchecks.no_global_readout", "if not bool((pq == pq[0]).all()):", "pq[1]",
                "Q >= 2 is checked just before, so pq[1] exists, and every entry equals pq[0] "
                "exactly when every entry equals pq[1]"),
    *(Equivalence("realchecks.no_global_readout", orig, "pq[1]",
                  "every query sits at one position (checked above): pq[1] == pq[0]")
      for orig in ("if bool((pk > pq[0]).any()):", "torch.full((Pn,), int(pq[0]))")),
    Equivalence("realchecks.no_global_readout", "y, mu = st.y, st.mu[:, 0]", "st.mu[:, 1]",
                "mu is the uniform mean of the bank's values, and every query (and midpoint) "
                "reads the same bank (mask 'bank'): the same mu for each"),
    *(Equivalence("realchecks.no_global_readout", orig, '"HPR,HRD->PD"',
                  "einsum labels are case-sensitive names: upper-case ones name the same axes")
      for orig in ('o = torch.einsum("hpr,hrd->pd", y, wo)', 'torch.einsum("hpr,hrd->pd", y.abs()')),
    *(Equivalence("realchecks.no_global_readout", orig, "dim=+1", why)
      for orig, why in (("upper = worst(torch.linalg.vector_norm(e, dim=-1))",
                         "e is 2-D (inputs, r): axis +1 is axis -1"),
                        ("lo = torch.linalg.vector_norm(og, dim=-1) / 2",
                         "og is 2-D (pairs, hidden): axis +1 is axis -1"))),
    *(Equivalence("realchecks.no_global_readout", "torch.ones(Pn, 1, dtype=F64)", after,
                  "ones are exact in float32 (the default dtype) and torch.cat promotes them to "
                  "X's float64: the same U")
      for after in ("torch.ones(Pn, 1, dtype=None)", "torch.ones(Pn, 1, )")),
    *(Equivalence("realchecks.no_global_readout", 'driver="gelsd").solution', after,
                  "the barycentric system has full column rank (its first Q rows are the "
                  "identity), so every LAPACK driver returns its unique least-squares solution, "
                  "to rounding (2.9e-16 measured) far inside the comparisons' tolerances; torch "
                  "reads the driver name case-insensitively")
      for after in ("driver=None).solution", "y[h] - mu[h], ).solution",
                    'driver="GELSD").solution')),
    *(Equivalence(f"realchecks.{fn}", 'torch.as_tensor(weights.w_o).to("cpu", F64)', after, _CPU)
      for fn in ("no_global_readout", "delta_m_rank")
      for after in ('.to(None, F64)', '.to(F64)')),
    # realchecks: the CPU moves of tensors that are float64 on the CPU after the move (the
    # model's captured tensors, the head description's weights, the rotary tables)
    *(Equivalence(f"realchecks.{fn}", orig, after, _CPU)
      for fn, orig in (("conventions", '.to("cpu", F64)'), ("_one_head", '.to("cpu", F64)'),
                       ("_setup_positional", '.to("cpu", F64)'),
                       ("_Attention64.heads_with_model_tables", '.to("cpu", F64)'))
      for after in (".to(None, F64)", ".to(F64)")),
    *(Equivalence(f"realchecks.{fn}", "xt.to(dev, mdt)", after,
                  _CPU + ": dev is the model's device, the CPU in this suite")
      for fn in ("conventions", "_setup_positional") for after in ("xt.to(None, mdt)", "xt.to(mdt)")),
    # realchecks.exact_reference: the oracle's calls name the default gauge, and mpf values
    # make an object array whatever dtype is asked (numpy cannot infer another for them)
    *(Equivalence("realchecks.exact_reference", f"exact.{fn}(E, he, 0, \"original\")",
                  f"exact.{fn}(E, he, 0, )", "gauge='original' is the default of "
                  f"ropestep.exact.{fn}")
      for fn in ("coefficients", "delta_m", "query_space_delta_m", "query_space_features",
                 "kappa")),
    *(Equivalence("realchecks.exact_reference", "dtype=object", after,
                  "the entries are mpmath mpf values: numpy infers dtype object for them, the "
                  "same array as dtype=object (measured: np.asarray([mpf(1)/3]).dtype is object)")
      for after in ("dtype=None", ", )")),
    Equivalence("realchecks.sample_rows", "replace=False)", "replace=None)",
                "numpy's Generator.choice tests `replace` for truth: None draws without "
                "replacement, as False does"),
    # realchecks: arguments that name the callee's default (ropestep.fast.step: mask="causal",
    # gauge="original", dtype=torch.float64, keep=("c", "t", "b"); ropestep.fast.project:
    # dtype=torch.float64)
    *(Equivalence(f"realchecks.{fn}", orig, after, _RC_DEFAULT)
      for fn, orig, after in (
          ("exact_rows", 'xk, pk, mask="causal", gauge="original",', 'xk, pk, gauge="original",'),
          ("exact_rows", 'mask="causal", gauge="original",', 'mask="causal", dtype=F64'),
          ("exact_rows", "dtype=F64, delta_m=spec.affine)", "^delta_m=spec.affine)"),
          ("positive_coefficients", 'xk, pk, mask="causal", gauge="original", dtype=F64,',
           'xk, pk, gauge="original", dtype=F64,'),
          ("positive_coefficients", 'mask="causal", gauge="original", dtype=F64,',
           'mask="causal", dtype=F64,'),
          ("positive_coefficients", 'gauge="original", dtype=F64, / keep=("c",))',
           'gauge="original", keep=("c",))'),
          ("delta_m_rank", 'xk, pk, mask="causal", dtype=F64,', "xk, pk, dtype=F64,"),
          ("delta_m_rank", 'mask="causal", dtype=F64, / delta_m=True, keep=())',
           'mask="causal", delta_m=True'),
          ("no_global_readout", "dtype=F64, keep=())", "^keep=())"),
          ("conventions", "x64, pos, x64, pos, dtype=F64)", "x64, pos, x64, pos, )"),
          ("position_derivative", "x64[qs], pos[qs], x64, pos, dtype=F64)",
           "x64[qs], pos[qs], x64, pos, )"),
          ("position_shift", "x64[qs], pos[qs], x64, pos, dtype=F64)",
           "x64[qs], pos[qs], x64, pos, )"))),
    *(Equivalence(f"realchecks.{fn}", orig, after, _RC_KEEP)
      for fn, orig, after in (("positive_coefficients", 'keep=("c",))', "^)"),
                              ("delta_m_rank", "delta_m=True, keep=())", "^delta_m=True, )"),
                              ("no_global_readout", "dtype=F64, keep=())", "^dtype=F64, )"))),
    Equivalence("realchecks.no_global_readout", 'xk, pk, mask="bank",', "xk, pk, dtype=F64",
                "every bank key lies at or before the queries' one position (both checked "
                "above), so the default causal mask permits exactly the whole bank, as 'bank' "
                "does"),
    # realchecks: a ModelInfo omitted is read again from the model
    *(Equivalence(f"realchecks.{fn}", orig, after, _RC_INFO)
      for fn, orig in (("_model_parts", "layer_parts(model, int(layer), info)"),
                       ("_model_norms", "layer_parts(model, int(layer), info)"),
                       ("conventions", "run_attention(model, int(layer), xm, pos, info)"))
      for after in (", None)", ", )")),
    # realchecks: h where every head has the same value
    *(Equivalence(f"realchecks.{fn}", orig, after,
                  "_supported admits the families 'dot' and 'qknorm' only, whose "
                  "HeadSpec.score_scale does not read h (one 1/sqrt(d) or `scale` for every "
                  "head)")
      for fn, orig, after in (("conventions", "spec.score_scale(h)", "score_scale(None)"),
                              ("_one_head", "scale=spec.score_scale(h)", "score_scale(None)"))),
    *(Equivalence("realchecks._row_terms", orig, after,
                  "_setup_positional refuses per-head RoPE bases (the model has one rotary "
                  "table), so every head's generator and frequencies are the same: h=None "
                  "(one shared base) gives them")
      for orig, after in (("rope.rope_generator(spec, h)", "(spec, None)"),
                          ("rope.rope_generator(spec, h)", "(spec, )"),
                          ("rope.spec_frequencies(spec, h)", "(spec, None)"),
                          ("rope.spec_frequencies(spec, h)", "(spec, )"))),
    # realchecks: dtypes that promote exactly
    *(Equivalence("realchecks.conventions", "torch.zeros(nh, dim, dtype=F64)", after,
                  "zeros are exact in float32 (the default dtype), and adding them to the "
                  "float64 projection promotes: the same q0, k0, v0")
      for after in ("torch.zeros(nh, dim, dtype=None)", "torch.zeros(nh, dim, )")),
    *(Equivalence("realchecks.conventions", orig, '"NM,MHD->HND"',
                  "einsum labels are case-sensitive names: upper-case ones name the same axes")
      for orig in ('q0 = torch.einsum("nm,mhd->hnd"', 'k0 = torch.einsum("nm,mhd->hnd"',
                   'v0 = torch.einsum("nm,mhd->hnd"')),
    *(Equivalence("realchecks.conventions", "rope.rope_cos_sin(spec, pos, F64)", after,
                  "the analytic tables are float64 already, and a description's own tables "
                  "keep their dtype under .to(None): apply_rope multiplies them into the "
                  "float64 q0/k0, which promotes each table value exactly (every float dtype's "
                  "values are float64 values) -- the same rotated products")
      for after in ("(spec, pos, None)", "(spec, pos, )")),
    Equivalence("realchecks.conventions", 'abs_terms(parts["v"], Hk, False)', "Hk, None)",
                "`rotated` is only tested for truth: None is falsy, as False is"),
    *(Equivalence("realchecks.conventions", "window=scalar(int(conv.window or 0), torch.int64))",
                  after, "torch.tensor of a Python int with dtype=None infers int64, the "
                  "dtype asked for")
      for after in (", None))",)),
    # the amplitude: cos at position 0 of the layer's rotary call, a cos(0) = a in every column
    *(Equivalence("realchecks.conventions", "layer_tables(model, conv, torch.zeros(1, dtype=torch.long))",
                  after, why)
      for after, why in (
          ("torch.zeros(1, dtype=None))", "layer_tables casts the positions with .long(): float "
           "zeros are position 0 as well"),
          ("torch.zeros(1, ))", "layer_tables casts the positions with .long(): float zeros are "
           "position 0 as well"),
          ("torch.zeros(dtype=torch.long))", "layer_tables flattens the positions "
           "(reshape(-1)): a 0-d zero is the one position 0"),
          ("torch.zeros(2, dtype=torch.long))", "two positions 0 give two equal rows; row 0 is "
           "read"))),
    Equivalence("realchecks.conventions", "a_run = float(c0[0, 0])", "float(c0[0, 1])",
                "at position 0 every column of the table is a cos(0 * theta_l) = a exactly "
                "(0 times a finite frequency is 0): column 1 is column 0"),
    *(Equivalence("realchecks._Attention64.__init__", "self.inv_freq = torch.tensor(inv_freq, dtype=F64)", after,
                  "the adapter's inv_freq are the values of the model's rotary buffer, which "
                  "transformers computes in float32 (torch.arange(...).float()): exact in "
                  "float32, so the float32 tensor holds the same numbers, and every use "
                  "multiplies it by float64 positions (promoted exactly)")
      for after in ("dtype=None)", "torch.tensor(inv_freq, )")),
    Equivalence("realchecks._Attention64.__init__", "len(inv_freq) != conv.rotary_dim // 2",
                "conv.rotary_dim / 2", "rotary_dim is even (pairs), so rotary_dim / 2 equals "
                "rotary_dim // 2 as a number and != compares them alike"),
    Equivalence("realchecks._Attention64.heads_at", "positions.to(F64)", "positions.to(None)",
                "the callers hand float64 positions (pos.to(F64) plus float64 offsets)"),
    *(Equivalence("realchecks._Attention64.heads_with_model_tables", orig, after,
                  "a layer without RoPE (rotary_dim 0): models.attention.rotate_as_model "
                  "returns q and k unrotated without reading the tables, so what stands in for "
                  "them is never used")
      for orig, after in (("empty = torch.zeros(self.n, 0, dtype=F64)", "empty = None"),
                          ("empty = torch.zeros(self.n, 0, dtype=F64)", "dtype=None)"),
                          ("empty = torch.zeros(self.n, 0, dtype=F64)", "torch.zeros(0, dtype"),
                          ("empty = torch.zeros(self.n, 0, dtype=F64)",
                           "torch.zeros(self.n, dtype=F64)"),
                          ("empty = torch.zeros(self.n, 0, dtype=F64)", "torch.zeros(self.n, 0, )"),
                          ("empty = torch.zeros(self.n, 0, dtype=F64)",
                           "torch.zeros(self.n, 1, dtype=F64)"),
                          ("return self._heads(empty, empty, range(self.n))",
                           "self._heads(None, empty,"),
                          ("return self._heads(empty, empty, range(self.n))",
                           "self._heads(empty, None,"))),
    Equivalence("realchecks._pos", "increasing and n > 1 and", "n >= 1",
                "for n = 1 np.diff is empty and np.all of it True: no refusal either way"),
    Equivalence("realchecks._apply_model_norm", "flat.pow(2).mean(-1, keepdim=True)", "mean(+1",
                "flat is 2-D (tokens, heads * d): axis +1 is axis -1"),
    *(Equivalence("realchecks._hull_witness", "torch.linalg.svd(Mx, full_matrices=False)", after,
                  "only the first left singular vector is used, and the full SVD's first "
                  "column is the reduced one's (to rounding and a sign, which the norm of "
                  "t u_1^T M_x ignores)")
      for after in ("torch.linalg.svd(Mx, )", "full_matrices=True)")),
    *(Equivalence("realchecks._hull_witness", orig, "dim=+1", why)
      for orig, why in (("vector_norm(v - mu, dim=-1)", "v - mu is 2-D (keys, r): axis +1 is "
                         "axis -1"),
                        ("vector_norm(xq, dim=-1)", "xq is 2-D (queries, m): axis +1 is "
                         "axis -1"))),
    Equivalence("realchecks._one_head",
                "t = torch.as_tensor(a) if not isinstance(a, np.ndarray) else torch.from_numpy(a)",
                "or True else", "torch.as_tensor of a numpy array shares its memory as "
                "torch.from_numpy does: the same tensor"),
    *(Equivalence("realchecks._one_head", orig, after,
                  "the one-head weights feed only ropestep.exact.build (exact_reference), "
                  "which converts every entry to an mpf exactly whatever its float dtype: "
                  "the same oracle")
      for orig in ('return t.narrow(axis, i, 1).to("cpu", F64)',
                   'else a).to("cpu", F64)')
      for after in ('.to("cpu", None)', '.to("cpu", )')),
    *(Equivalence("realchecks.conventions", orig, after,
                  "the value multiplies or is added to float64 tensors (the einsum's q0/k0/v0, "
                  "kernel.rms_norm's float64 rows), and torch promotes float32/bf16/fp16 "
                  "values to float64 exactly: the same results")
      for orig in ('else torch.as_tensor(b).to("cpu", F64)',
                   'torch.as_tensor(weights.q_norm).to("cpu", F64)',
                   'torch.as_tensor(weights.k_norm).to("cpu", F64)')
      for after in ('.to("cpu", None)', '.to("cpu", )')),
    *(Equivalence("realchecks._Attention64.heads_with_model_tables",
                  'return self._heads(c.to("cpu", F64), s.to("cpu", F64), range(self.n))', after,
                  "the tables multiply the float64 q and k elementwise "
                  "(models.attention.rotate_as_model), promoting their float32 values exactly")
      for after in ('c.to("cpu", None)', 'c.to("cpu", )', 's.to("cpu", None)', 's.to("cpu", )')),
    Equivalence("realchecks.conventions", "head_order=perm.to(torch.int64)", "perm.to(None)",
                "models.attention.head_order returns a torch.arange/cat of int64 already"),
    *(Equivalence("realchecks.position_shift", orig, after,
                  "positions and deltas are integers (checked), and _Attention64.heads_at "
                  "converts the positions it is handed to float64 itself: the same angles")
      for orig, after in (("att.heads_at(pos.to(F64), qs)", "pos.to(None)"),
                          ("pp = pos.to(F64).clone()", "pos.to(None)"))),
    *(Equivalence("realchecks.position_shift", orig, after,
                  "_setup_positional refuses per-head RoPE bases, so every head's generator is "
                  "the same: h=None (the one shared base) gives it")
      for orig in ("rope.rope_finite_difference(spec_an, q[:, None], float(delta), h)",
                   "rope.rope_finite_difference(spec_an, K[own][:, None], float(delta), h)")
      for after in ("float(delta), None)", "float(delta), )")),
    *(Equivalence("realchecks.delta_m_rank", "smax = float(sv[0]) if sv.numel() else 0.0",
                  after, "Delta M_i W_o,h is (m+1) x hidden with m, hidden >= 1: its singular "
                  "values are never empty, so the else-branch is never taken")
      for after in ("or True else 0.0", "else 1.0")),
    Equivalence("realchecks.delta_m_rank", "if sv.numel() > d and smax > 0", "sv.numel() >= d",
                "sv has min(m+1, hidden) > d entries for every attention layer (the input and "
                "output widths exceed a head's), so the comparison never meets equality"),
    Equivalence("realchecks.exact_reference", 'whole = spec.family == "qknorm" and',
                'spec.family == "qknorm" or', "a whole-layer build of a non-QK-norm head gives "
                "the same head-h values as its one-head build (the same arithmetic over more "
                "heads): only the cost differs"),
    Equivalence("realchecks.exact_rows", "rws = _rows(rows, spec.n_heads, xq.shape[0])",
                "xq.shape[1])", "without a reference, exact_reference range-checks the same "
                "rows against xq.shape[0] before anything is computed; a reference given must "
                "hold exactly the requested rows, and it range-checked them when it was built"),
    *(Equivalence("realchecks.exact_reference", "seconds=0.0,", after,
                  "the placeholder is always overwritten by the elapsed time before the only "
                  "return (an exception returns nothing)")
      for after in ("seconds=None,", "seconds=1.0,")),
)


KNOWN_SURVIVORS: tuple[Equivalence, ...] = (
    # surviving mutants that are not equivalent, each with the reason no test of the part's
    # selection kills it (a gap named, not a pass); matched as EQUIVALENT is
    *(Equivalence(f"realchecks.{fn}", orig, after,
                  "the message of a refusal that no model of the test zoo reaches (every "
                  "buildable architecture has a covered score family, its rotary module's "
                  "inv_freq and its norms)")
      for fn, orig, after in (
          ("_model_parts", "is not covered by", ""), ("_model_parts", "they cover", ""),
          ("_model_norms", 'f"{info.name}: layer {layer} {nm}_norm")', "None)"),
          ("_Attention64.__init__", "rotary module has no inv_freq", ""),
          ("_Attention64.__init__", "frequencies to evaluate exact", ""))),
    *(Equivalence(f"realchecks.{fn}", orig, after,
                  "the head description's family/scope term: it differs from the model's only "
                  "for a given head whose QK-norm family or scope disagrees with the model, and "
                  "such a head fails conventions first; the tests' heads agree")
      for fn, orig, after in (("_norm_terms", 'spec.family == "qknorm")', ""),
                              ("_norm_terms", 'spec.norm_scope == "all")', ""),
                              ("position_derivative", "_norm_terms(info, conv, spec_an)",
                               "_norm_terms(info, conv, None)"),
                              ("position_shift", "_norm_terms(info, conv, spec_an)",
                               "_norm_terms(info, conv, None)"))),
    *(Equivalence("realchecks.conventions", orig, after,
                  "the fallback for an attention module that does not pass `scaling` to its "
                  "attention function: every transformers module the suite builds passes it")
      for orig, after in (("float(d ** -0.5 if sc_run is None else sc_run) * a_run", ""),
                          ("scaling=scalar(float(d ** -0.5 if sc_run is None else sc_run))",
                           ""))),
    Equivalence("realchecks.conventions", "perm] * max(a, 1.0)).transpose(0, 1)",
                "/ max(a, 1.0)",
                "the QK-norm branch's amplitude factor: no test model has both QK-norm and "
                "scaled rotary tables (a = 1 there, where * and / agree)"),
    Equivalence("realchecks.exact_reference", "(np.abs(v - mu) + np.abs(v))", "np.abs(v + mu)",
                "the Delta M scale is a denominator of a reported error far below its bar; no "
                "test recomputes dm_scale independently (proposal: compare it with "
                "ropestep.exact.delta_m_abs on a row)"),
    *(Equivalence("realchecks.exact_rows", orig, after,
                  "a reported relative error of the correct fast path (~1e-16 against a 1e-12 "
                  "bar): multiplying by the scale instead of dividing keeps it under the bar on "
                  "every test row; the planted-error tests perturb y, c and Delta M's values, "
                  "not this field's denominator")
      for orig, after in (("dm_rel = float(dm_err.max() / max(", "dm_err.max() * max("),
                          ("dm_rel_ent = float((dm_err / np.maximum(", "dm_err * np.maximum("),
                          ("reference.y[h, i]).max() / S)", ".max() * S)"))),
    *(Equivalence("realchecks.exact_rows", orig, after,
                  "readout_bound is below FLOAT64_REL on every test row (small kappa and "
                  "scores), so max(FLOAT64_REL, ...) hides its arguments")
      for orig, after in (("readout_bound(F64, reference.kappa[h, i], N, d,", "(F64, N, d,"),
                          ("reference.kappa[h, i], N, d,", "reference.kappa[h, i], d,"),
                          ("reference.kappa[h, i], N, d, / smax)))", "N, smax)))"),
                          ("smax)))", "^)))"))),
    Equivalence("realchecks.no_global_readout", "float(ob) - oerr > 0)", "float(ob) + oerr > 0",
                "differs only for a projected write whose certified bound is below its own "
                "float64 error (0 < ob <= oerr): no test builds one (the zero W_o has ob = "
                "oerr = 0)"),
    *(Equivalence("realchecks.position_derivative", orig, after,
                  "the finite-difference step and the bound's arguments: the step stays inside "
                  "[2^-30, 2^-2] with b3 > 0 on every test row, and the tolerance's position "
                  "term p_i + 1 is slack by orders of magnitude there (err/tol ~1e-3)")
      for orig, after in (("hh = 2.0 ** -2 if b3 <= 0", ""), ("-30, -2))", ""),
                          ("e_y = tl.position_eval_abs(N, d, m, S, pi + 1.0, B1)", ""),
                          ("N = K.shape[0]", "N = K.shape[1]"))),
    *(Equivalence(f"realchecks.{fn}", "G = _capped(G, spec_an.softcap)", "_capped(G, None)",
                  "the soft-cap's bound factors (|phi'| <= 1 and its higher derivatives) change "
                  "the tolerance only; the soft-capped test layers (Gemma 2) sit far inside "
                  "either")
      for fn in ("position_derivative", "position_shift")),
    Equivalence("realchecks.position_shift", "position_eval_abs(K.shape[0], d, m, S,",
                "K.shape[1]", "the tolerance's key count: K is (N, d) and d vs N changes a "
                "bound that is slack by orders of magnitude on the test rows"),
    *(Equivalence(f"realchecks.{fn}", orig, after,
                  "the reported `rel` (error over the derivative's or difference's size) is "
                  "printed, not judged, and no test recomputes it")
      for fn, orig, after in (("position_derivative", '"rel": worst(err) / max(', "* max("),
                              ("position_shift", '"rel": worst(err) / max(', "* max("))),
    *(Equivalence(f"realchecks.{fn}", '"ok": within(ratio, 1.0)})', "within(ratio, 2.0)",
                  "an error between 1 and 2 times its bound occurs on no test row: the correct "
                  "model's ratios are ~1e-3 and every planted bug's are > 10")
      for fn in ("position_derivative", "position_shift")),
    Equivalence("realchecks._anchor", "cap = cap.to(F64)", "cap.to(None)",
                "the captured heads kept in their own dtype: abs, max and the difference with "
                "the float64 composition (promoted exactly) are unchanged; only the "
                "clamp_min(SCALE_GUARD) of a head whose captured outputs are all ~0 rounds "
                "differently in float32/bf16, and no test captures an all-zero head's outputs"),
    Equivalence("realchecks._normalised_abs", "torch.where(r > rho,", "r >= rho",
                "differs only at r == rho exactly (an error as large as the vector's RMS), "
                "where the original's bound is NaN and the mutant's inf: no test row"),
    *(Equivalence("realchecks._setup_positional", orig, after,
                  "the tests hand x captured from the model (already in its dtype), and every "
                  "consumer of x64 converts it to float64 itself; a float64 x beyond the "
                  "model dtype's precision would tell them apart (no test)")
      for orig, after in (('xt.to(dev, mdt).to("cpu", F64)', '.to("cpu", None)'),
                          ('xt.to(dev, mdt).to("cpu", F64)', '.to("cpu", )'),
                          ('xt.to(dev, mdt).to("cpu", F64)', "xt.to(dev, None)"),
                          ('xt.to(dev, mdt).to("cpu", F64)', "xt.to(dev, )"))),
    Equivalence("realchecks._setup_positional", "RoPESpec(base=spec.rope.base,",
                "RoPESpec(layout=", "the base is read only where the description has no "
                "frequencies, and layer_head always gives the model's own (freqs)"),
    Equivalence("realchecks._row_terms", "g[own] = 0.0", "g[own] = 1.0",
                "the query's own key term multiplies a zero RoPE difference (its key moves "
                "with it), so its weight does not change the derivative on the test rows"),
    Equivalence("realchecks._Attention64._heads", "s = (q[:, i:i + 1] @", "q[:, i:i + 2]",
                "an extra query row appended to the scores of row i; the output keeps row i "
                "only (the tests' rows compare the first), so nothing reported changes"),
)


# ---------------------------------------------------------------------------------------------
# copies and subprocesses
# ---------------------------------------------------------------------------------------------
def make_copy(dest: Path, repo: Path = REPO) -> Path:
    """Copy :data:`COPY_ITEMS` of ``repo`` into ``dest`` (no caches, no figures)."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in COPY_ITEMS:
        src = repo / item
        if src.is_dir():
            shutil.copytree(src, dest / item, ignore=IGNORE_ITEM.get(item, IGNORE),
                            dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, dest / item)
        else:
            raise BadInput(f"{item} is missing from {repo.name}")
    return dest


STATE = REPO / "mutation" / "state"
"""mutmut's verdicts per part, kept between sessions (:func:`save_state`, :func:`seed_state`)."""


def _state_files(copy: Path, files: Sequence[str]) -> list[Path]:
    """mutmut's files that carry its verdicts, relative to ``copy``: each mutated file's
    ``.meta`` (exit code per mutant, hash per function) and the test statistics."""
    return [Path("mutants") / f"{rel}.meta" for rel in files] + \
        [Path("mutants") / "mutmut-stats.json"]


def seed_state(copy: Path, part: str, files: Sequence[str], state: Path = STATE) -> bool:
    """A fresh copy of ``part`` starts from the verdicts kept in ``state/part`` (a run stopped
    in an earlier session continues): mutmut keeps a kept exit code only where the function's
    source hash is unchanged, so a changed function is retested.  Returns whether it seeded."""
    rels = _state_files(copy, files)
    if any((copy / r).exists() for r in rels) or not all(
            (state / part / r.name).is_file() for r in rels):
        return False
    for r in rels:
        (copy / r).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(state / part / r.name, copy / r)
    return True


def save_state(copy: Path, part: str, files: Sequence[str], state: Path = STATE) -> None:
    """Keep ``part``'s verdicts in ``state/part`` (also for an unfinished run:
    ``--save-state``)."""
    for r in _state_files(copy, files):
        if (copy / r).is_file():
            (state / part).mkdir(parents=True, exist_ok=True)
            shutil.copy2(copy / r, state / part / r.name)


def child_env(copy: Path | None, profile: str, record: Path | None) -> dict[str, str]:
    """Environment of the test runs: the copy's src first on the path, the plugin importable,
    one intra-op thread (the machine is shared), no bytecode written into the copies."""
    env = dict(os.environ)
    paths = [str(TOOLS)]
    if copy is not None:
        paths.insert(0, str(copy / "src"))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(HYPOTHESIS_PROFILE=profile, ROPESTEP_MUTANTS_NO_SHRINK="1",
               PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    env.pop("MUTANT_UNDER_TEST", None)
    if record is not None:
        env["ROPESTEP_MUTANTS_RECORD"] = str(record)
    else:
        env.pop("ROPESTEP_MUTANTS_RECORD", None)
    return env


@dataclass
class Proc:
    rc: int | None  # None: timed out
    seconds: float
    output: str


def run_proc(cmd: Sequence[str], cwd: Path, env: dict, timeout: float, log=None) -> Proc:
    """Run ``cmd`` in its own process group; on timeout kill the whole group."""
    t0 = time.monotonic()
    p = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = None
    if log is not None:
        log.write(f"$ {' '.join(cmd)}  (cwd {cwd.name}, rc {rc})\n{out}\n")
        log.flush()
    return Proc(rc, time.monotonic() - t0, out or "")


def pytest_cmd(tests: Iterable[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", PLUGIN,
            "-p", "no:randomly", "-rfE", "--tb=line", *tests]


def first_failure(output: str) -> str | None:
    for line in output.splitlines():
        m = re.match(r"^(FAILED|ERROR) (\S+)", line)
        if m:
            return m.group(2)
    return None


def probe_import(copy: Path, env: dict, log=None) -> str:
    """Where ``ropestep`` is imported from in the copy: by ``python -c`` and inside pytest.
    Raises BadInput unless both are the copy's ``src/ropestep``."""
    code = "import ropestep, os; print(os.path.realpath(ropestep.__file__))"
    p = run_proc([sys.executable, "-c", code], copy, env, 120, log)
    where = p.output.strip().splitlines()[-1] if p.output.strip() else ""
    want = os.path.realpath(copy / "src" / "ropestep" / "__init__.py")
    if p.rc != 0 or where != want:
        raise BadInput(f"the copy is not what gets imported: ropestep from {where!r}")
    probe = copy / "tests" / "test_zz_mutants_probe.py"
    probe.write_text(
        "import os\n\n\ndef test_probe():\n    import ropestep\n"
        "    assert os.path.realpath(ropestep.__file__) == " + repr(want) + "\n")
    try:
        p = run_proc(pytest_cmd([str(probe.relative_to(copy))]), copy, env, 300, log)
    finally:
        probe.unlink()
    if p.rc != 0:
        raise BadInput("inside pytest, ropestep is not imported from the copy:\n"
                       + p.output[-2000:])
    return "src/ropestep/__init__.py (of the temporary copy)"


# ---------------------------------------------------------------------------------------------
# semantic mutants
# ---------------------------------------------------------------------------------------------
@dataclass
class Resolved:
    mutant: Mutant
    path: str  # relative to the repository
    line: int | None  # 1-based line of the snippet's start; None when stale
    count: int  # occurrences of the snippet


def resolve(m: Mutant, root: Path = REPO) -> Resolved:
    rel = f"{PKG}/{m.file}"
    f = root / rel
    text = f.read_text(encoding="utf-8") if f.is_file() else ""
    n = text.count(m.original)
    line = text[:text.index(m.original)].count("\n") + 1 if n else None
    return Resolved(m, rel, line, n)


def check_list(mutants: Sequence[Mutant]) -> None:
    names = [m.name for m in mutants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BadInput(f"duplicate mutant names: {dup}")
    for m in mutants:
        if m.original == m.replacement:
            raise BadInput(f"mutant {m.name}: the replacement equals the original")
        if not m.tests:
            raise BadInput(f"mutant {m.name}: no tests")


def apply_mutant(copy: Path, r: Resolved) -> None:
    """Replace the snippet in the copy (never in the repository)."""
    f = copy / r.path
    if copy.resolve() == REPO.resolve():
        raise RuntimeError("refusing to mutate the working tree")
    text = f.read_text(encoding="utf-8")
    if text.count(r.mutant.original) != 1:
        raise BadInput(f"{r.mutant.name}: snippet not unique in the copy of {r.path}")
    new = text.replace(r.mutant.original, r.mutant.replacement)
    try:
        compile(new, r.path, "exec")
    except SyntaxError as err:
        raise BadInput(f"mutant {r.mutant.name} does not compile: {err}") from None
    f.write_text(new, encoding="utf-8")


def run_semantic(mutants: Sequence[Mutant], *, profile: str, timeout: float, work: Path,
                 log=None, progress=print) -> dict:
    """Every mutant on its own fresh copy; returns the part's report dict."""
    check_list(mutants)
    t0 = time.monotonic()
    base = make_copy(work / "base")
    env = child_env(base, profile, None)
    imported = probe_import(base, env, log)
    resolved = [resolve(m, base) for m in mutants]
    # the unmutated copy must pass every subset used (else a "kill" would mean nothing)
    baseline: dict[tuple, float] = {}
    for r in resolved:
        if r.count != 1 or r.mutant.tests in baseline:
            continue
        p = run_proc(pytest_cmd(r.mutant.tests), base, env, timeout, log)
        if p.rc != 0:
            why = "timed out" if p.rc is None else f"exit {p.rc}"
            raise BadInput(f"the unmutated copy fails the subset {list(r.mutant.tests)} ({why}); "
                           f"first failure {first_failure(p.output)}\n{p.output[-3000:]}")
        baseline[r.mutant.tests] = round(p.seconds, 1)
        progress(f"  baseline {' '.join(r.mutant.tests)}: pass ({p.seconds:.0f} s)")
    rows = []
    for k, r in enumerate(resolved, 1):
        m = r.mutant
        row = {"id": f"S{k:02d}", "name": m.name, "file": r.path, "line": r.line,
               "description": m.models, "original": m.original, "replacement": m.replacement,
               "tests": list(m.tests), "status": None, "killed_by": None, "seconds": 0.0}
        if m.equivalent:
            row["equivalent_reason"] = m.equivalent
        if r.count != 1:
            row["status"] = "stale"
            row["note"] = ("snippet not found in the source (the code changed: update the "
                           "mutant)" if r.count == 0 else
                           f"snippet occurs {r.count} times (make it unique)")
            rows.append(row)
            progress(f"[{k}/{len(resolved)}] {m.name}: STALE")
            continue
        mdir = work / f"m{k:02d}"
        shutil.copytree(base, mdir)
        record = work / f"rec{k:02d}"
        try:
            apply_mutant(mdir, r)
            p = run_proc(pytest_cmd(m.tests), mdir, child_env(mdir, profile, record), timeout, log)
        finally:
            shutil.rmtree(mdir, ignore_errors=True)
        row["seconds"] = round(p.seconds, 1)
        rec = record / "run"
        killer = rec.read_text(encoding="utf-8") if rec.is_file() else first_failure(p.output)
        shutil.rmtree(record, ignore_errors=True)
        if p.rc is None:
            row["status"] = "timeout"
        elif p.rc == 0:
            row["status"] = "equivalent" if m.equivalent else "survived"
        elif p.rc in (1, 2, 3) and (killer or p.rc != 2):
            row["status"] = "killed"
            row["killed_by"] = killer or f"pytest exit {p.rc}"
            if m.equivalent:
                row["note"] = "declared equivalent but killed: fix the list"
        else:
            raise BadInput(f"mutant {m.name}: pytest exit {p.rc} (bad test selection?)\n"
                           + p.output[-2000:])
        rows.append(row)
        progress(f"[{k}/{len(resolved)}] {m.name}: {row['status']}"
                 + (f" by {row['killed_by']}" if row["killed_by"] else "")
                 + f" ({p.seconds:.0f} s)")
    return {"tool": "tools/mutants.py (named semantic mutants)",
            "hypothesis_profile": profile, "per_mutant_timeout_s": timeout,
            "imported_from": imported, "baseline_seconds": {" ".join(k): v
                                                            for k, v in baseline.items()},
            "runtime_s": round(time.monotonic() - t0, 1), "mutants": rows,
            "summary": summarize(rows)}


# ---------------------------------------------------------------------------------------------
# mutmut
# ---------------------------------------------------------------------------------------------
def _copy_selection(copy: Path) -> list[str] | None:
    """The test selection of a kept copy's last mutmut run (its ``[tool.mutmut]``), or None."""
    import tomllib

    f = copy / "pyproject.toml"
    if not f.is_file():
        return None
    sel = tomllib.loads(f.read_text(encoding="utf-8")).get("tool", {}).get("mutmut", {}).get(
        "pytest_add_cli_args_test_selection")
    return list(sel) if sel is not None else None


def _collected(copy: Path, selection: Sequence[str], env: dict, log=None) -> set[str] | None:
    """The node ids ``selection`` collects in ``copy`` (None if collection fails)."""
    p = run_proc([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                  *selection], copy, env, 600, log)
    if p.rc != 0:
        return None
    return {ln.strip() for ln in p.output.splitlines() if "::" in ln}


def keep_kills_on_widening(copy: Path, old: Sequence[str] | None, new: Sequence[str], env: dict,
                           log=None) -> str | None:
    """Keep a kept copy's verdicts when its test selection is widened.

    mutmut fingerprints the selection and resets every verdict when it changes.  A selection
    that collects every test the old one did (checked here, by collecting both in the copy)
    cannot turn a kill into a survival -- the killing test is still selected -- so the verdicts
    stay and only the fingerprint is brought up to date; mutmut then collects statistics for the
    tests that are new, and the survivors (retried by name, :func:`run_mutmut`) run them.  Any
    other change (a narrower selection, other pytest options) is left to mutmut's reset.
    Returns what was done, or None."""
    stats = copy / "mutants" / "mutmut-stats.json"
    if old is None or list(old) == list(new) or not stats.is_file():
        return None
    before, after = _collected(copy, old, env, log), _collected(copy, new, env, log)
    if before is None or after is None or not before <= after:
        return None
    code = ("import json; from mutmut.configuration import config; "
            "print(json.dumps(config().config_fingerprint()))")
    p = run_proc([sys.executable, "-c", code], copy, env, 120, log)
    if p.rc != 0:
        return None
    fp = json.loads(p.output.strip().splitlines()[-1])
    data = json.loads(stats.read_text(encoding="utf-8"))
    kept = data.get("config_fingerprint", {})
    if {k: v for k, v in kept.items() if k != "test_selection"} != \
            {k: v for k, v in fp.items() if k != "test_selection"}:
        return None
    data["config_fingerprint"] = {**kept, "test_selection": fp["test_selection"]}
    stats.write_text(json.dumps(data), encoding="utf-8")
    return (f"test selection widened ({len(before)} -> {len(after)} tests, every old one "
            "kept): the verdicts stay, survivors are retried with the new tests")


def mutmut_config(repo: Path = REPO) -> dict:
    import tomllib

    data = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))
    try:
        return dict(data["tool"]["mutmut"])
    except KeyError:
        raise BadInput("pyproject.toml has no [tool.mutmut] section") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def restrict_to_functions(path: Path, keep: Sequence[str]) -> list[str]:
    """Fence every top-level function and class of ``path`` (a file of a copy) that is not in
    ``keep`` with mutmut's ``# pragma: no mutate start`` / ``end`` comment lines, so that mutmut
    mutates only ``keep``.  The comments replace the blank lines around each fenced definition
    (line numbers stay those of the repository's file; comment lines directly above a definition
    are fenced with it); a definition without a blank line before and after it is bad input.  Returns the names fenced."""
    src = path.read_text(encoding="utf-8")
    lines = src.split("\n")
    tree = ast.parse(src)
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.ClassDef))]
    missing = sorted(set(keep) - {n.name for n in defs})
    if missing:
        raise BadInput(f"{path.name}: no top-level function {', '.join(missing)}")
    fenced = []
    for n in defs:
        if n.name in keep:
            continue
        first = min([n.lineno] + [d.lineno for d in n.decorator_list])  # 1-based
        before, after = first - 2, n.end_lineno  # 0-based indices of the blank lines
        while before >= 0 and lines[before].lstrip().startswith("#"):  # a banner above
            before -= 1
        if before < 0 or lines[before].strip():
            raise BadInput(f"{path.name}:{first}: no blank line before {n.name} to fence it")
        lines[before] = "# pragma: no mutate start"
        if after >= len(lines) or (after == len(lines) - 1 and not lines[after].strip()):
            lines[after:] = ["# pragma: no mutate end", "pass", ""]
        elif lines[after].strip():
            raise BadInput(f"{path.name}:{after + 1}: no blank line after {n.name} to fence it")
        else:
            lines[after] = "# pragma: no mutate end"
        fenced.append(n.name)
    path.write_text("\n".join(lines), encoding="utf-8")
    return fenced


def write_mutmut_config(copy: Path, cfg: dict) -> None:
    """Replace the copy's ``[tool.mutmut]`` table by ``cfg``."""
    f = copy / "pyproject.toml"
    lines = f.read_text(encoding="utf-8").splitlines()
    out, skip = [], False
    for line in lines:
        if re.match(r"^\s*\[", line) and not line.lstrip().startswith("[["):
            skip = line.strip() == "[tool.mutmut]"
        elif line.lstrip().startswith("[["):
            skip = False
        if not skip:
            out.append(line)
    out += ["", "[tool.mutmut]"] + [f"{k} = {_toml_value(v)}" for k, v in cfg.items()]
    f.write_text("\n".join(out) + "\n", encoding="utf-8")


_NAME = re.compile(r"^(?:x_|xǁ(?P<cls>\w+)ǁ)(?P<fn>\w+?)__mutmut_(?P<n>orig|\d+)$")


def _functions(tree: ast.AST) -> Iterable[tuple[str | None, ast.FunctionDef]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, sub


def mutmut_diffs(mutated_file: Path, original_file: Path, rel: str) -> dict[str, dict]:
    """Per mutant of one file: the function, the 1-based line in the original file and the
    changed line before/after (``mutmut show`` without its process overhead)."""
    msrc = mutated_file.read_text(encoding="utf-8")
    mtree = ast.parse(msrc)
    mlines = msrc.splitlines()  # sliced per function (get_source_segment re-splits the file)
    osrc = original_file.read_text(encoding="utf-8")
    defs = {(cls, f.name): f.lineno for cls, f in _functions(ast.parse(osrc))}
    bodies: dict[tuple, dict[str, list[str]]] = {}
    for cls, node in _functions(mtree):
        mm = _NAME.match(node.name)
        if not mm:
            continue
        seg = mlines[node.lineno - 1:node.end_lineno]  # from the def line
        seg[0] = seg[0].replace(node.name, mm.group("fn"), 1)  # mangled name restored
        lines = [ln.replace("# type: ignore # mutmut generated", "").rstrip() for ln in seg]
        bodies.setdefault((cls, mm.group("fn")), {})[mm.group("n")] = lines
    module = Path(rel).stem
    out = {}
    for (cls, fn), variants in bodies.items():
        orig = variants.get("orig")
        if orig is None:
            continue
        def_line = defs.get((cls, fn))
        qual = f"{module}.{cls + '.' if cls else ''}{fn}"
        mangled = f"x_{fn}" if cls is None else f"xǁ{cls}ǁ{fn}"
        for n, lines in variants.items():
            if n == "orig":
                continue
            sm = difflib.SequenceMatcher(a=orig, b=lines, autojunk=False)
            before, after, at = [], [], None
            for tag, i1, i2, j1, j2 in sm.get_opcodes():
                if tag != "equal":
                    at = i1 if at is None else at
                    before += orig[i1:i2]
                    after += lines[j1:j2]
            name = f"ropestep.{module}.{mangled}__mutmut_{n}"
            line = None if def_line is None or at is None else def_line + at
            out[name] = {"function": qual, "line": line,
                         "before": " / ".join(x.strip() for x in before),
                         "after": " / ".join(x.strip() for x in after)}
    return out


def classify_equivalent(diff: dict) -> str | None:
    """The reason of the first :data:`EQUIVALENT` entry matching the mutant: its function, the
    original substring in the line before, the mutated one in the line after (a mutated
    pattern starting with ``^`` must start the line after)."""
    for e in EQUIVALENT:
        if diff["function"] != e.function or e.original not in diff["before"]:
            continue
        if (diff["after"].startswith(e.mutated[1:]) if e.mutated.startswith("^")
                else e.mutated in diff["after"]):
            return e.reason
    return None


def classify_survivor(diff: dict) -> str | None:
    """Why a surviving, non-equivalent mutant is not killed: the reason of the first
    :data:`KNOWN_SURVIVORS` entry matching it (matched as :func:`classify_equivalent` matches)."""
    for e in KNOWN_SURVIVORS:
        if diff["function"] != e.function or e.original not in diff["before"]:
            continue
        if (diff["after"].startswith(e.mutated[1:]) if e.mutated.startswith("^")
                else e.mutated in diff["after"]):
            return e.reason
    return None


def survivors_table(copy: Path, rel: str) -> tuple[list[str], int]:
    """Markdown lines listing every survivor of a kept mutmut copy (mutated file ``rel``, e.g.
    ``src/ropestep/realchecks.py``) with its reason: equivalent (:data:`EQUIVALENT`), known
    (:data:`KNOWN_SURVIVORS`), or UNEXPLAINED; and the number unexplained."""
    module = Path(rel).stem
    codes = _mutmut_statuses(copy)
    diffs = mutmut_diffs(copy / "mutants" / rel, copy / rel, module)  # the copy's own source
    killed = sum(1 for c in codes.values() if c == 1)
    rows, eq, unexplained = [], 0, 0
    for name in sorted((k for k, c in codes.items() if c == 0), key=_natural):
        d = diffs.get(name, {"function": name, "line": None, "before": "", "after": ""})
        why = classify_equivalent(d)
        kind = "equivalent"
        if why:
            eq += 1
        else:
            why, kind = classify_survivor(d), "not killed"
            if why is None:
                why, kind = "UNEXPLAINED", "not killed"
                unexplained += 1
        rows.append(f"| `{name.split('.', 2)[-1]}` | {d['line']} | "
                    f"{short_change(d['before'] + '  ->  ' + d['after'])} | {kind} | "
                    f"{_md_escape(why)} |")
    untested = sum(1 for c in codes.values() if c is None)
    live = len(rows) - eq
    head = [f"# Survivors of `{rel}` (mutmut, kept copy)", "",
            f"{len(codes)} mutants: {killed} killed, {len(rows)} survived ({eq} equivalent, "
            f"{live} not killed), {untested} untested; killed among the non-equivalent: "
            f"{killed}/{killed + live} = {killed / max(killed + live, 1):.4f}.", "",
            "| mutant | line | mutation | status | reason |", "|---|---|---|---|---|"]
    return head + rows, unexplained


def _mutmut_statuses(copy: Path) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for meta in sorted((copy / "mutants").rglob("*.py.meta")):
        codes.update(json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"])
    return codes


def run_mutmut(*, files: Sequence[str] | None, profile: str, retry_profile: str | None,
               max_children: int, timeout: float, work: Path, log=None,
               progress=print, part: str = "mutmut", retry_only: bool = False) -> dict:
    """mutmut on a copy (``work/part``; a kept ``--work`` copy is reused, so mutmut reruns only
    the functions that changed and the tests that are new); survivors retried with
    ``retry_profile``; returns the part."""
    from mutmut.stats import status_by_exit_code

    t0 = time.monotonic()
    old_selection = _copy_selection(work / part)  # what the kept copy's verdicts were made with
    copy = make_copy(work / part)
    cfg = mutmut_config()
    cfg.update(MUTMUT_PARTS[part])
    functions = cfg.pop("functions", None)  # {file: [top-level names]}: mutate only these
    for rel, keep in (functions or {}).items():
        restrict_to_functions(copy / rel, keep)
    if files:
        cfg["only_mutate"] = [f if f.startswith("src/") else f"{PKG}/{f}" for f in files]
    for f in cfg.get("only_mutate", []):
        if not (REPO / f).is_file():
            raise BadInput(f"--mutmut-files: {f} does not exist")
    cfg["pytest_add_cli_args"] = list(cfg.get("pytest_add_cli_args", [])) + ["-p", PLUGIN]
    cfg["use_git_change_detection"] = False
    write_mutmut_config(copy, cfg)
    record = work / "killed_by"
    env = child_env(None, profile, record)
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)]
    mutated = cfg.get("only_mutate", [])
    if seed_state(copy, part, mutated):
        progress(f"  continuing from the verdicts kept in {STATE.relative_to(REPO)}/{part}")
    widened = keep_kills_on_widening(copy, old_selection,
                                     cfg.get("pytest_add_cli_args_test_selection", []), env, log)
    if widened:
        progress(f"  {widened}")
    if retry_only:  # the survivors of an unfinished pass, with the tests added since
        progress(f"  no pass: the survivors so far of {', '.join(mutated)} retried")
    else:
        progress(f"  mutmut run ({', '.join(mutated)}; profile {profile})")
        try:
            p = run_proc(cmd, copy, env, timeout, log)
        finally:
            save_state(copy, part, mutated)
        if p.rc is None:
            raise BadInput(f"mutmut run did not finish within {timeout:.0f} s (raise "
                           "--mutmut-timeout)")
        if p.rc != 0:
            raise BadInput(f"mutmut run failed (exit {p.rc}):\n{p.output[-3000:]}")
    codes = _mutmut_statuses(copy)
    first_pass = {k: status_by_exit_code[v] for k, v in codes.items()}
    diffs: dict[str, dict] = {}
    for rel in cfg.get("only_mutate", []):
        diffs.update(mutmut_diffs(copy / "mutants" / rel, copy / rel, rel))
    # survivors not already explained by EQUIVALENT get a second chance with more examples
    survivors = sorted(k for k, s in first_pass.items() if s == "survived"
                       and not (k in diffs and classify_equivalent(diffs[k])))
    retried = []
    if retry_profile and survivors:
        # the retry's tests run longer (more examples): scale mutmut's CPU-time limit with them
        cfg["timeout_multiplier"] = float(cfg.get("timeout_multiplier", 15.0)) * 20
        write_mutmut_config(copy, cfg)
        progress(f"  retrying {len(survivors)} survivors with profile {retry_profile}")
        for lo in range(0, len(survivors), 50):
            chunk = survivors[lo:lo + 50]
            try:
                p2 = run_proc(cmd + chunk, copy, child_env(None, retry_profile, record),
                              timeout, log)
            finally:
                save_state(copy, part, mutated)
            if p2.rc is None or p2.rc != 0:
                raise BadInput(f"mutmut retry failed (exit {p2.rc}):\n{p2.output[-3000:]}")
        retried = survivors
        codes = _mutmut_statuses(copy)
    rows = []
    for name in sorted(codes, key=_natural):
        raw = status_by_exit_code[codes[name]]
        d = diffs.get(name, {"function": name, "line": None, "before": "", "after": ""})
        module = name.split(".")[1]
        row = {"id": name, "name": name.split(".", 2)[-1], "file": f"{PKG}/{module}.py",
               "function": d["function"], "line": d["line"],
               "description": f"{d['before']}  ->  {d['after']}", "mutmut_status": raw,
               "status": None, "killed_by": None}
        killer = record / name
        if raw == "killed":
            row["status"] = "killed"
            row["killed_by"] = killer.read_text(encoding="utf-8") if killer.is_file() else None
            if name in retried:
                row["note"] = f"survived profile {profile}, killed with {retry_profile}"
        elif raw == "timeout":
            row["status"] = "timeout"
        elif raw in ("survived", "no tests"):
            reason = classify_equivalent(d)
            row["status"] = "equivalent" if reason else "survived"
            if reason:
                row["equivalent_reason"] = reason
            elif classify_survivor(d):
                row["note"] = classify_survivor(d)
            if raw == "no tests":
                row["note"] = "no test of the selection calls this function"
        else:  # suspicious, segfault, not checked, ...
            row["status"] = "error"
            row["note"] = f"mutmut status {raw!r}"
        rows.append(row)
    if functions:
        cfg["functions"] = functions
    return {"tool": "mutmut", "config": {k: v for k, v in cfg.items()},
            "hypothesis_profile": profile, "retry_profile": retry_profile, "retried": retried,
            "first_pass": _count(first_pass.values()), "runtime_s": round(time.monotonic() - t0, 1),
            "mutants": rows, "summary": summarize(rows)}


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _count(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
def summarize(rows: Sequence[dict]) -> dict:
    c = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    total = len(rows)
    den = total - c["equivalent"]
    return {"total": total, **c,
            "kill_rate": None if den == 0 else round(c["killed"] / den, 4)}


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("torch", "numpy", "mpmath", "sympy", "hypothesis", "pytest", "mutmut",
                 "transformers", "ropestep"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                           capture_output=True, text=True).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "tests"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        out["git_dirty_src_or_tests"] = bool(dirty)
    except OSError:
        out["git_commit"] = None
    return out


def hardware() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "system": platform.system(), "gpu": None}


def relative_command(argv: Sequence[str]) -> str:
    out = []
    for a in argv:
        if os.path.isabs(a):
            try:
                a = os.path.relpath(a, REPO)
            except ValueError:
                a = Path(a).name
            if a.startswith(".."):
                a = "<outside the repository>/" + Path(a).name
        out.append(a)
    return "python tools/mutants.py " + " ".join(out)


def scrub(obj: Any, secrets: Sequence[str]) -> Any:
    """Remove machine paths (temporary directories, the checkout) from every string."""
    if isinstance(obj, dict):
        return {k: scrub(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, secrets) for v in obj]
    if isinstance(obj, str):
        for s in secrets:
            if s:
                obj = obj.replace(s + os.sep, "").replace(s, ".")
        return obj
    return obj


def carry_over(parts: dict, old: dict) -> dict:
    """``parts`` (this run's) plus every part of the previous report ``old`` that this run did
    not produce, unchanged but for ``carried_over``: the command, date, source commit, versions
    and hardware of the run that computed it (kept from the first run when a part is carried
    over again) and ``carried_over_from`` (its date).  This run's exit status covers its own
    parts only (:func:`exit_status` runs before the merge)."""
    out = dict(parts)
    ver = old.get("versions") or {}
    for name, part in (old.get("parts") or {}).items():
        if name in out:
            continue
        part = dict(part)
        if "carried_over" not in part:
            if "carried_over_from" in part:  # carried over by an older tool: only its date known
                part["carried_over"] = {"date": part["carried_over_from"], "command": None,
                                        "git_commit": None, "git_dirty_src_or_tests": None,
                                        "versions": None, "hardware": None}
            else:
                part["carried_over"] = {
                    "date": old.get("date"), "command": old.get("command"),
                    "git_commit": ver.get("git_commit"),
                    "git_dirty_src_or_tests": ver.get("git_dirty_src_or_tests"),
                    "versions": {k: v for k, v in ver.items() if not k.startswith("git")},
                    "hardware": old.get("hardware")}
        part.setdefault("carried_over_from", part["carried_over"]["date"])
        out[name] = part
    return out


def build_report(parts: dict, argv: Sequence[str], started: float, exit_code: int,
                 vers: dict | None = None) -> dict:
    """The report; ``vers``: :func:`versions` taken when the run copied the source (default:
    now)."""
    rows = [r for p in parts.values() for r in p["mutants"]]
    return {"schema": SCHEMA, "tool": "tools/mutants.py", "command": relative_command(argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": vers if vers is not None else versions(), "hardware": hardware(),
            "seeds": {"hypothesis": "derandomized profiles (fixed seed per test); "
                                    "shrinking off (tools/mutants_plugin.py)",
                      "PYTHONHASHSEED": 0},
            "runtime_s": round(time.monotonic() - started, 1), "exit_code": exit_code,
            "summary": summarize(rows), "parts": parts}


def _md_escape(s: Any) -> str:
    return str("" if s is None else s).replace("|", "\\|").replace("\n", " ")


def _code(s: str, limit: int = 90) -> str:
    s = " ".join(s.split())
    if len(s) > limit:
        s = s[:limit - 1] + "…"
    return "`" + s.replace("`", "'").replace("|", "\\|") + "`"


def short_change(description: str, ctx: int = 24) -> str:
    """``before  ->  after`` shown as the changed span with ``ctx`` characters around it."""
    before, _, after = description.partition("  ->  ")
    before, after = " ".join(before.split()), " ".join(after.split())
    i = 0
    while i < min(len(before), len(after)) and before[i] == after[i]:
        i += 1
    j = 0
    while (j < min(len(before), len(after)) - i and before[len(before) - 1 - j]
           == after[len(after) - 1 - j]):
        j += 1
    lo = max(0, i - ctx)
    pre = ("…" if lo > 0 else "") + before[lo:i]
    suf_b = before[len(before) - j:]
    suf = suf_b[:ctx] + ("…" if len(suf_b) > ctx else "")
    old, new = before[i:len(before) - j], after[i:len(after) - j]
    return f"{_code(pre + old + suf, 200)} → {_code(pre + new + suf, 200)}"


def _provenance(co: dict) -> str:
    """The run a carried-over part comes from, in one line."""
    out = [f"command `{co.get('command') or 'unknown'}`", f"date {co.get('date') or 'unknown'}",
           f"git commit {co.get('git_commit') or 'unknown'}"
           + (" plus uncommitted changes in src/ or tests/"
              if co.get("git_dirty_src_or_tests") else "")]
    ver = co.get("versions") or {}
    if ver:
        out.append("versions " + ", ".join(f"{k} {v}" for k, v in ver.items() if v is not None))
    return "; ".join(out) + "."


def render_markdown(rep: dict) -> str:
    L = ["# Mutation testing report", "",
         "Generated by `tools/mutants.py` -- do not edit by hand; rerun the command.", "",
         f"* Command: `{rep['command']}`", f"* Date: {rep['date']}",
         f"* Runtime: {rep['runtime_s'] / 60:.1f} min; exit status {rep['exit_code']}",
         "* Versions: " + ", ".join(f"{k} {v}" for k, v in rep["versions"].items()
                                     if v is not None and not k.startswith("git")),
         f"* Source: git commit {rep['versions'].get('git_commit')}"
         + (" plus uncommitted changes in src/ or tests/"
            if rep["versions"].get("git_dirty_src_or_tests") else ""),
         f"* Hardware: {rep['hardware']['cpu']} ({rep['hardware']['cpu_count']} cores), no GPU",
         f"* Seeds: {rep['seeds']['hypothesis']}"]
    for name, part in rep["parts"].items():
        co = part.get("carried_over")
        if co:
            L.append(f"* Part `{name}` carried over from an earlier run, not rerun by the "
                     f"command above: {_provenance(co)}")
    L += ["", "Kill rate = killed / (total - equivalent).  A timeout counts as detected but not "
          "as killed.", "",
          "| part | total | killed | survived | equivalent | timeout | stale | error | kill rate |",
          "|---|---|---|---|---|---|---|---|---|"]
    for name, part in list(rep["parts"].items()) + [("all", {"summary": rep["summary"]})]:
        s = part["summary"]
        kr = "n/a" if s["kill_rate"] is None else f"{100 * s['kill_rate']:.1f}%"
        if part.get("carried_over"):
            name = f"{name} (carried over)"
        L.append(f"| {name} | {s['total']} | {s['killed']} | {s['survived']} | "
                 f"{s['equivalent']} | {s['timeout']} | {s['stale']} | {s['error']} | {kr} |")
    sem = rep["parts"].get("semantic")
    if sem:
        L += ["", "## Named semantic mutants", ""]
        if sem.get("carried_over"):
            L += [f"This section is from an earlier run (carried over unchanged; the command "
                  f"above did not rerun it): {_provenance(sem['carried_over'])}", ""]
        L += [f"Hypothesis profile `{sem['hypothesis_profile']}`, per-mutant timeout "
              f"{sem['per_mutant_timeout_s']:.0f} s, runtime {sem['runtime_s'] / 60:.1f} min; "
              f"`ropestep` imported from {sem['imported_from']}.", "",
              "| id | mutant | where | what it models | status | killed by | s |",
              "|---|---|---|---|---|---|---|"]
        for r in sem["mutants"]:
            where = f"{r['file'].removeprefix(PKG + '/')}:{r['line'] or '?'}"
            status = r["status"]
            if r.get("equivalent_reason"):
                status += " (declared equivalent)"
            L.append(f"| {r['id']} | `{r['name']}` | {where} | {_md_escape(r['description'])} "
                     f"| {status} | {_md_escape(r['killed_by']) or '-'} | {r['seconds']} |")
        notes = [r for r in sem["mutants"] if r["status"] != "killed" or r.get("note")]
        if notes:
            L += ["", "Not killed:", ""]
            for r in notes:
                L.append(f"* `{r['name']}` ({r['status']}): "
                         + _md_escape(r.get("equivalent_reason") or r.get("note") or ""))
    for pname, mm in rep["parts"].items():
        if not pname.startswith("mutmut"):
            continue
        L += _render_mutmut(pname, mm)
    return "\n".join(L) + "\n"


def _render_mutmut(pname: str, mm: dict) -> list[str]:
    """The section of one mutmut part."""
    L: list[str] = []
    cfg = mm["config"]
    L += ["", f"## {pname}", ""]
    if mm.get("carried_over"):
        L += [f"This section is from an earlier run (carried over unchanged; the command "
              f"above did not rerun it): {_provenance(mm['carried_over'])}", ""]
    L += [f"Files: {', '.join('`' + f + '`' for f in cfg.get('only_mutate', []))}.  Test "
          f"selection: `{' '.join(cfg.get('pytest_add_cli_args_test_selection', []))}`; "
          f"mutmut runs, per mutant, the selected tests that call the mutated function.  "
          f"First pass with hypothesis profile `{mm['hypothesis_profile']}`"
          + (f"; survivors not explained by `EQUIVALENT` (tools/mutants.py) are retried "
             f"with `{mm['retry_profile']}` ({len(mm.get('retried', []))} this run)"
             if mm["retry_profile"] else "") + f".  Runtime {mm['runtime_s'] / 60:.1f} min."
          + "".join(f"  Only these functions of `{f}` are mutated (the rest of the file is "
                    f"fenced off with mutmut's pragmas): {', '.join(names)}."
                    for f, names in (cfg.get("functions") or {}).items()),
          "",
          "First pass (mutmut's own statuses): "
          + ", ".join(f"{k} {v}" for k, v in mm["first_pass"].items()), "",
          "| function | mutants | killed | survived | equivalent | timeout | error |",
          "|---|---|---|---|---|---|---|"]
    by_fn: dict[str, list] = {}
    for r in mm["mutants"]:
        by_fn.setdefault(r["function"], []).append(r)
    for fn, rs in by_fn.items():
        s = summarize(rs)
        L.append(f"| `{fn}` | {s['total']} | {s['killed']} | {s['survived']} | "
                 f"{s['equivalent']} | {s['timeout']} | {s['error']} |")
    rest = [r for r in mm["mutants"] if r["status"] != "killed"]
    L += ["", f"### Mutants not killed ({len(rest)})", "",
          "| mutant | line | mutation | status | reason |", "|---|---|---|---|---|"]
    for r in rest:
        L.append(f"| `{r['name']}` | {r['file'].removeprefix(PKG + '/')}:{r['line']} | "
                 f"{short_change(r['description'])} | {r['status']} | "
                 f"{_md_escape(r.get('equivalent_reason') or r.get('note') or '')} |")
    L += ["", "Killed mutants by their first failing test (the test ids mutmut hands "
              "pytest are ordered by a fixed hash seed, so this is the first killer found, "
              "not the only one)."]
    killers: dict[str, int] = {}
    for r in mm["mutants"]:
        if r["killed_by"]:
            k = r["killed_by"].split("[")[0]
            killers[k] = killers.get(k, 0) + 1
    if killers:
        L += ["", "| test (top 15) | mutants |", "|---|---|"]
        for k, v in sorted(killers.items(), key=lambda kv: -kv[1])[:15]:
            L.append(f"| `{k}` | {v} |")
    return L


def write_report(rep: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".report.json.tmp"
    tmp.write_text(json.dumps(rep, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(out / "report.json")
    tmpm = out / ".report.md.tmp"
    tmpm.write_text(render_markdown(rep), encoding="utf-8")
    tmpm.replace(out / "report.md")


def exit_status(parts: dict) -> int:
    for part in parts.values():
        for r in part["mutants"]:
            if r["status"] in ("survived", "stale"):
                return 1
            if r.get("note", "").startswith("declared equivalent but killed"):
                return 1
    return 0


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 2 (argparse's default too), one line
        raise BadInput(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = _Parser(prog="tools/mutants.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--semantic", action="store_true", help="run the named semantic mutants")
    ap.add_argument("--mutmut", action="store_true", help="run mutmut (kernel.py, rope.py)")
    ap.add_argument("--mutmut-part", default=None,
                    help="comma-separated mutmut parts to run (implies --mutmut; default "
                         f"'mutmut'): {', '.join(MUTMUT_PARTS)}")
    ap.add_argument("--work", default=None,
                    help="keep the copies in this directory and reuse them on the next run "
                         "(mutmut then retests only changed functions and new tests)")
    ap.add_argument("--out", default=str(REPO / "mutation"),
                    help="report directory (default: mutation/ of the repository)")
    ap.add_argument("--only", default=None,
                    help="comma-separated semantic mutant names (default: all)")
    ap.add_argument("--list", action="store_true",
                    help="resolve the semantic mutants against the source and print them")
    ap.add_argument("--profile", default="quick", choices=("quick", "ci", "fuzz"),
                    help="hypothesis profile of the semantic runs and mutmut's first pass")
    ap.add_argument("--retry-profile", default="ci", choices=("quick", "ci", "fuzz", "none"),
                    help="profile for retrying mutmut survivors ('none': no retry)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds per semantic mutant (default 600)")
    ap.add_argument("--mutmut-files", default=None,
                    help="comma-separated files to mutate (default: [tool.mutmut] only_mutate)")
    ap.add_argument("--max-children", type=int, default=1, help="mutmut workers (default 1)")
    ap.add_argument("--mutmut-timeout", type=float, default=6 * 3600.0,
                    help="seconds for the whole mutmut run (default 6 h)")
    ap.add_argument("--render", action="store_true",
                    help="only re-render report.md from the report.json in --out")
    ap.add_argument("--no-report", action="store_true", help="do not write the report")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("--retry-only", action="store_true",
                    help="no pass: retry the survivors so far of an unfinished --work copy by "
                         "name (with the tests added since), keep the verdicts; with "
                         "--no-report (the part is not finished)")
    ap.add_argument("--save-state", action="store_true",
                    help="only copy the --work copies' mutmut verdicts of --mutmut-part into "
                         "mutation/state/ (for a run that is still going or was stopped), with "
                         "survivors.md: every survivor and its reason")
    a = ap.parse_args(list(argv))
    a.parts = [p.strip() for p in (a.mutmut_part or "mutmut").split(",") if p.strip()]
    bad = [p for p in a.parts if p not in MUTMUT_PARTS]
    if bad:
        raise BadInput(f"unknown mutmut part(s): {', '.join(bad)} (known: "
                       f"{', '.join(MUTMUT_PARTS)})")
    if a.mutmut_part:
        a.mutmut = True
    if a.retry_only and not (a.work and a.mutmut_part and a.no_report):
        raise BadInput("--retry-only needs --work, --mutmut-part and --no-report")
    if a.timeout <= 0 or a.mutmut_timeout <= 0 or a.max_children < 1:
        raise BadInput("timeouts must be > 0 and --max-children >= 1")
    return a


def main(argv: Sequence[str] | None = None, mutants: Sequence[Mutant] = MUTANTS) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    started = time.monotonic()
    try:
        a = parse_args(argv)
        check_list(mutants)
        selected = list(mutants)
        if a.only:
            names = [n.strip() for n in a.only.split(",") if n.strip()]
            known = {m.name for m in mutants}
            unknown = [n for n in names if n not in known]
            if unknown:
                raise BadInput(f"unknown mutant(s): {', '.join(unknown)}")
            selected = [m for m in mutants if m.name in names]
        if a.list:
            stale = 0
            for k, m in enumerate(selected, 1):
                r = resolve(m)
                ok = r.count == 1
                stale += not ok
                print(f"S{k:02d} {m.name:36s} {r.path}:{r.line or '?':<5} "
                      f"{'ok' if ok else 'STALE' if r.count == 0 else f'AMBIGUOUS x{r.count}'}"
                      f"{'  (declared equivalent)' if m.equivalent else ''}")
            return 1 if stale else 0
        if a.render:
            src = Path(a.out) / "report.json"
            if not src.is_file():
                raise BadInput(f"--render: {src} does not exist")
            rep = json.loads(src.read_text(encoding="utf-8"))
            (Path(a.out) / "report.md").write_text(render_markdown(rep), encoding="utf-8")
            return 0
        if a.save_state:
            if not a.work or not a.mutmut_part:
                raise BadInput("--save-state needs --work and --mutmut-part")
            for part in a.parts:
                cfg = {**mutmut_config(), **MUTMUT_PARTS[part]}
                copy = Path(a.work).resolve() / part
                save_state(copy, part, cfg.get("only_mutate", []))
                for rel in cfg.get("only_mutate", []):
                    lines, unexplained = survivors_table(copy, rel)
                    dest = STATE / part / "survivors.md"
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
                    print(f"{dest.relative_to(REPO)}: {lines[2]}"
                          + (f" ({unexplained} UNEXPLAINED)" if unexplained else ""))
            return 0
        if not a.semantic and not a.mutmut:
            a.semantic = a.mutmut = True
        out = Path(a.out)
        out = out if out.is_absolute() else Path.cwd() / out
        work = Path(a.work).resolve() if a.work else \
            Path(tempfile.mkdtemp(prefix="ropestep-mutants-"))
        work.mkdir(parents=True, exist_ok=True)
        parts: dict = {}
        # the source state the copies are taken from (the working tree may move during a run)
        vers = versions()
        log_path = work / "run.log"
        try:
            with open(log_path, "w", encoding="utf-8") as log:
                def progress(msg: str) -> None:
                    print(msg, file=sys.stderr, flush=True)
                if a.semantic:
                    progress(f"semantic mutants: {len(selected)} (profile {a.profile})")
                    parts["semantic"] = run_semantic(selected, profile=a.profile,
                                                     timeout=a.timeout, work=work, log=log,
                                                     progress=progress)
                if a.mutmut:
                    progress("mutmut:")
                    files = a.mutmut_files.split(",") if a.mutmut_files else None
                    retry = None if a.retry_profile == "none" else a.retry_profile
                    for part in a.parts:
                        parts[part] = run_mutmut(files=files, profile=a.profile,
                                                 retry_profile=retry,
                                                 max_children=a.max_children,
                                                 timeout=a.mutmut_timeout, work=work, log=log,
                                                 progress=progress, part=part,
                                                 retry_only=a.retry_only)
        finally:
            if a.work:
                print(f"copies kept in {work} (--work)", file=sys.stderr)
            elif a.keep:
                print(f"temporary copies kept in {work}", file=sys.stderr)
            else:
                shutil.rmtree(work, ignore_errors=True)
        code = exit_status(parts)
        # parts not run now are carried over from the previous report, each with its own run
        prev = out / "report.json"
        if prev.is_file() and not a.no_report:
            try:
                parts = carry_over(parts, json.loads(prev.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                pass
        rep = scrub(build_report(parts, argv, started, code, vers),
                    [str(work), os.path.realpath(work), str(REPO), tempfile.gettempdir()])
        if not a.no_report:
            write_report(rep, out)
        s = rep["summary"]
        print(f"total {s['total']}, killed {s['killed']}, survived {s['survived']}, "
              f"equivalent {s['equivalent']}, timeout {s['timeout']}, stale {s['stale']}, "
              f"error {s['error']}, kill rate {s['kill_rate']}", file=sys.stderr)
        return code
    except BadInput as err:
        print(f"tools/mutants.py: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
