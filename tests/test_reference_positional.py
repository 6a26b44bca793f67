"""``ropestep validate``'s ``real_heads`` checks ``conventions``, ``position_derivative`` and
``position_shift``, leaf by leaf, against :mod:`ropestep.reference.positional`, the independent
recomputation from the raw dump (``--dump-raw``; docs/protocol.md sections 12.7 and 12.10).

Every leaf of the three checks -- per context under ``real_heads/per_context/*/<check>`` and
pooled under ``real_heads/<check>`` -- is compared with the reference's value: labels, counts,
integers and flags equal, numbers within the width the reference derives for them (its
docstrings and section 12.10 give each derivation: both sides' float64 rounding where the
reference recomputes the same quantity from the same dumped float32 tensors, the report's own
rounding bound where the report's value is a rounding error whose exact value is 0 or a
truncation error).  A leaf the reference does not know, and a leaf of the reference the report
lacks, are failures; so is a decision (the step ``h``, an ``ok``) that the widths leave open.
Planted one-line bugs in :mod:`ropestep.realchecks` (``MUTANTS``) must each turn the comparison
red.  The tolerance formulas the reference re-implements from the section are checked against
:mod:`ropestep.tolerances` (the reference may not import it: it imports torch).

:func:`compare_positional` is what tests/test_reference_validate.py can call for these checks.
"""
from __future__ import annotations

import math
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ropestep
from ropestep import cli, protocol
from ropestep import realchecks as rc
from ropestep import tolerances as tl
from ropestep.reference import positional as reference
from ropestep.report import dumps, load
from ropestep.verdict import loads
from reference_walk import agrees, at, has, leaves
from reference_walk import one_torch_thread  # noqa: F401  (autouse, module scope)
from test_reference_validate import TINY_ARGS, build_model

pytestmark = pytest.mark.model

CHECKS = set(reference.CHECKS)


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------
def _check_of(path: tuple) -> str | None:
    """The check a ``real_heads`` leaf belongs to, if one of the three."""
    if path and path[0] == "per_context" and len(path) >= 3:
        return path[2] if path[2] in CHECKS else None
    return path[0] if path and path[0] in CHECKS else None


def compare_positional(report: dict, ref: reference.Positional) -> tuple[list[str], set[str]]:
    """Every leaf of ``conventions``, ``position_derivative`` and ``position_shift`` under each
    layer's ``real_heads`` against the reference: ``(problems, the check names covered)``.

    A report leaf with no reference value fails (unknown), as does a reference leaf the report
    lacks (missing) and a layer either side lacks; a value outside the reference's width fails;
    a decision the widths leave open (``ref.undecided``) is a problem too.  Leaves of the other
    checks (and ``per_context/*/context``) are not looked at."""
    problems = list(ref.undecided)
    covered: set[str] = set()
    layers = report.get("layers", {})
    for L in sorted(set(layers) | set(ref.values)):
        where = f"layers/{L}/real_heads"
        if L not in layers or L not in ref.values:
            problems.append(f"{where}: the layer is in only one of report and reference")
            continue
        rh, want, wid = layers[L].get("real_heads") or {}, ref.values[L], ref.widths[L]
        for path, value in leaves(rh):
            check = _check_of(path)
            if check is None:
                continue
            key = f"{where}/{'/'.join(map(str, path))}"
            if not has(want, path) or isinstance(at(want, path), (dict, list)):
                problems.append(f"{key}: no reference for this leaf")
                continue
            covered.add(check)
            w = at(wid, path)
            if not agrees(value, at(want, path), 0.0 if w is None else w):
                problems.append(f"{key}: report {value!r}, reference {at(want, path)!r} "
                                f"within {w!r}")
        for path, value in leaves(want):
            if not has(rh, path):
                problems.append(f"{where}/{'/'.join(map(str, path))}: the reference has "
                                f"{value!r}, the report has no such leaf")
    return problems, covered


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def run_case(root: Path, args: list[str]) -> tuple[dict, reference.Positional, dict]:
    """``ropestep validate --dump-raw``, then the reference on the dump: ``(report, reference,
    seconds)``."""
    t0 = time.perf_counter()
    assert cli.main(["validate", *args, "--quiet", "--no-figures", "--out",
                     str(root / "validate"), "--dump-raw", str(root / "raw")]) == 0
    t1 = time.perf_counter()
    ref = reference.recompute(root / "raw")
    t2 = time.perf_counter()
    return load(root / "validate" / "report.json"), ref, {"validate": t1 - t0,
                                                           "reference": t2 - t1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_positional")
    model = build_model(root / "model")
    report, ref, seconds = run_case(root, ["--model", str(model), *TINY_ARGS])
    return types.SimpleNamespace(root=root, model=model, report=report, ref=ref, seconds=seconds)


def leaf_count(report: dict) -> int:
    return sum(1 for lr in report["layers"].values()
               for path, _ in leaves(lr["real_heads"]) if _check_of(path))


def check(report: dict, ref: reference.Positional, seconds: dict) -> None:
    problems, covered = compare_positional(report, ref)
    print("leaves:", leaf_count(report), "seconds:", seconds)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])
    assert covered == CHECKS


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_every_leaf_of_the_three_checks_agrees(tiny):
    check(tiny.report, tiny.ref, tiny.seconds)
    assert leaf_count(tiny.report) > 800
    for lr in tiny.report["layers"].values():
        rh = lr["real_heads"]
        assert all(rh[c]["ok"] for c in CHECKS)
        # the rows are the seeded ones, and the steps are not all the clip's
        rows = rh["per_context"][0]["position_derivative"]["rows"]
        assert len({r["query"] for r in rows}) == protocol.POSITIONAL_QUERIES
        assert all(2.0 ** -30 < r["h"] < 2.0 ** -2 for r in rows)


def test_the_recomputed_leaves_are_pinned(tiny):
    """Where the reference recomputes the report's quantity (not a rounding error), its width is
    orders below the value: the float32-level differences of ``conventions`` to ~1e-6 of
    themselves, the tolerances and derivatives to ~1e-9."""
    for L, want in tiny.ref.values.items():
        wid = tiny.ref.widths[L]
        conv, wconv = want["per_context"][0]["conventions"], wid["per_context"][0]["conventions"]
        for row, wrow in zip(conv["heads"], wconv["heads"]):
            for f in ("q_rel", "k_rel", "v_rel"):
                assert 0 < wrow[f] < 1e-5 * row[f]
            for f in ("q_tol", "k_tol", "v_tol"):
                assert 0 < wrow[f] < 1e-9 * row[f]
        for name in ("position_derivative", "position_shift"):
            rec, wrec = want["per_context"][0][name], wid["per_context"][0][name]
            for row, wrow in zip(rec["rows"], wrec["rows"]):
                assert wrow["tol_max"] < 1e-9 * row["tol_max"]
                if name == "position_derivative":
                    assert wrow["derivative_max"] < 1e-6 * row["derivative_max"]


def test_unknown_and_missing_leaves_fail(tiny):
    grown = loads(dumps(tiny.report))
    rec = grown["layers"]["0"]["real_heads"]["per_context"][0]
    rec["position_shift"]["rows"][2]["new_statistic"] = 0.5
    del rec["conventions"]["heads"][1]["k_tol"]
    grown["layers"]["1"]["real_heads"]["position_derivative"]["extra"] = 1
    problems, _ = compare_positional(grown, tiny.ref)
    text = "\n".join(problems)
    assert "position_shift/rows/2/new_statistic: no reference" in text
    assert "conventions/heads/1/k_tol: the reference has" in text
    assert "layers/1/real_heads/position_derivative/extra: no reference" in text


def test_the_tolerance_formulas_are_the_documented_ones():
    """The reference's re-implementations (section 12.10) against :mod:`ropestep.tolerances`,
    on a grid of sizes (equal up to the rounding of the same few operations)."""
    F32, F64 = torch.float32, torch.float64
    for n in (1, 8, 65, 577):
        assert reference.gamma(n) == pytest.approx(tl.nonnegative_ops_rel(n), rel=1e-15)
        A = np.array([0.0, 1.0, 3.5])
        got = (reference.rotated_projection_abs(reference.U32, reference.U32, A, n)
               + reference.rotated_projection_abs(reference.U64, reference.U64, A, n))
        want = tl.rotated_projection_abs(F32, A, n) + tl.rotated_projection_abs(F64, A, n)
        np.testing.assert_allclose(got, want, rtol=1e-14)
    for N, d, m in ((1, 16, 64), (47, 64, 576), (2000, 128, 4096)):
        assert reference.agreement64(N, d, m) == pytest.approx(
            tl.agreement_rel_tol(F64, N, d, m), rel=1e-14)
        for p, slope in ((0.0, 1.0), (46.5, 3.0), (1e4, 0.1)):
            assert reference.position_eval_abs(N, d, m, 2.0, p, slope) == pytest.approx(
                tl.position_eval_abs(N, d, m, 2.0, p, slope), rel=1e-14)
    for h in (2.0 ** -20, 2.0 ** -5):
        assert reference.central_difference_abs(h, 3.0, 1e-12) == pytest.approx(
            tl.central_difference_abs(h, 3.0, 1e-12), rel=1e-15)
    assert reference.SCALE_GUARD == tl.SCALE_GUARD
    assert reference.POSITIONAL_QUERIES == protocol.POSITIONAL_QUERIES


MUTANTS = [  # (the planted bug, its line in realchecks.py, the mutation, a disagreeing leaf)
    ("the derivative's sign", "            an = (w * (ds - dbar)) @ V\n",
     "            an = -((w * (ds - dbar)) @ V)\n", "position_derivative/rows/"),
    ("the finite-difference step halved",
     "            hh = 2.0 ** -2 if b3 <= 0 else 2.0 ** float(np.clip(",
     "            hh = 2.0 ** -2 if b3 <= 0 else 0.5 * 2.0 ** float(np.clip(", "/h: report"),
    ("the model side's shift off by one", "            pp[i] += delta\n",
     "            pp[i] += delta + 1\n", "position_shift/rows/"),
    ("the shift's own key left in place", "                K2[own] = K[own] + dk\n",
     "                K2[own] = K[own]\n", "position_shift/rows/"),
    ("the shift's tolerance at p_i instead of p_i + |delta|",
     "tl.position_eval_abs(K.shape[0], d, m, S, pi + abs(delta), B1)",
     "tl.position_eval_abs(K.shape[0], d, m, S, pi, B1)", "/tol_max: report"),
    ("q_rel relative to the Frobenius norm, not the largest entry",
     "        den = ref.abs().flatten(1).max(1).values.clamp_min(tl.SCALE_GUARD)\n"
     "        return (a - ref)",
     "        den = torch.linalg.vector_norm(ref.flatten(1), dim=1)\n        return (a - ref)",
     "conventions/heads/"),
    ("the conventions tolerance without the bias term",
     '    kterms = (conv.input_dim or info.hidden) + (parts["q"][1] is not None)\n',
     "    kterms = conv.input_dim or info.hidden\n", "conventions/tolerance_max"),
    # pooling: where the pooled values are pinned (the derivative's ratios are rounding-level,
    # all within their widths, so a min there is indistinguishable from the max)
    ("the heads pooled by min instead of max",
     '        "q_rel_max": worst(r_["q_rel"] for r_ in heads),',
     '        "q_rel_max": least(r_["q_rel"] for r_ in heads),', "conventions/q_rel_max"),
]


def mutated(old: str, new: str, monkeypatch) -> types.ModuleType:
    """``ropestep.realchecks`` with one line replaced, installed where ``protocol.real_checks``
    imports it from."""
    src = Path(rc.__file__).read_text(encoding="utf-8")
    assert src.count(old) == 1, f"the planted line is not in realchecks.py exactly once: {old!r}"
    mod = types.ModuleType("ropestep._realchecks_mutant")
    mod.__file__, mod.__package__ = rc.__file__, "ropestep"
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # dataclasses look their module up
    exec(compile(src.replace(old, new), rc.__file__, "exec"), mod.__dict__)
    monkeypatch.setattr(ropestep, "realchecks", mod)
    return mod


@pytest.fixture(scope="module")
def loaded(tiny):
    return protocol.load(protocol.Config(**{**tiny.report["config"], "model": str(tiny.model)}))


def rerun(tiny: Any, loaded_model: Any) -> dict:
    cfg = protocol.Config(**{**tiny.report["config"], "model": str(tiny.model)})
    result = protocol.run(cfg, progress=False, loaded=loaded_model,
                          command=tiny.report["command"])
    return loads(dumps(result))


def test_the_unmutated_rerun_agrees(tiny, loaded):
    """The in-process rerun the mutants use is itself in agreement (no false alarm)."""
    problems, _ = compare_positional(rerun(tiny, loaded), tiny.ref)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("bug, old, new, leaf", MUTANTS, ids=[m[0][:40] for m in MUTANTS])
def test_a_planted_bug_turns_the_comparison_red(tiny, loaded, monkeypatch, bug, old, new, leaf):
    mutated(old, new, monkeypatch)
    problems, _ = compare_positional(rerun(tiny, loaded), tiny.ref)
    print(bug, len(problems), problems[:3])
    assert any(leaf in p for p in problems), f"{bug}: no disagreement at {leaf}"


def test_two_real_smollm2_contexts(tmp_path):
    """The same comparison on the real SmolLM2-135M (no biases, 9 heads on 3 KV heads,
    ``d = 64``), layers 0 and 20."""
    from ropestep import models

    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    report, ref, seconds = run_case(tmp_path, [
        "--model", "smollm2", "--contexts", "2", "--queries", "6", "--prefix-len", "48",
        "--layers", "0,20", "--exact-rows", "0"])
    check(report, ref, seconds)
    assert math.isfinite(report["layers"]["20"]["real_heads"]["position_derivative"]["ratio_max"])
