"""The `cost` section of the atlas reports (docs/protocol.md section 11): the figures issue 17's
acceptance is judged by, recomputed.

* ``cost.phase_report`` against numbers worked by hand;
* every committed atlas report's `cost`, leaf for leaf, against
  :func:`ropestep.reference.atlas.cost_section`, which recomputes it from the report's own
  measurements (each process's phase timers in ``run.rank_timing_seconds``, the GEMM rates) and
  the counted operations; and the report's ``timing_seconds`` are process 0's timers;
* the committed repeats of the two-process Qwen2.5 atlas are the same report as the committed
  run, number for number (their seconds and rates are the machine's, their counted work is
  the same).

Tolerance of the comparison: both sides evaluate the same sums and quotients in IEEE-754
float64, in possibly different orders: a phase's seconds sum ``P`` processes' timers, the work
and the floor sum at most four phases, and a figure is at most two quotients of those, so the
two sides differ by at most about ``(P + 6) * 2**-53`` relative (positive terms: no
cancellation).  ``1e-12`` relative is that for any ``P`` below several thousand, and far below
any change of a formula (a factor of ``1 + 1e-9`` on a fraction fails it).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ropestep import atlas, cost
from ropestep.reference import atlas as reference
from ropestep.report import load as load_json
from reference_walk import at, differences as tree_differences

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-12  # see the module docstring
ATLASES = [p.parent for p in sorted((ROOT / "validation").glob("*/report.json"))
           if json.loads(p.read_text(encoding="utf-8")).get("schema") == "ropestep.atlas/1"]
TWO_PROCESS = "atlas-qwen2.5-coder-0.5b-2proc"


def load(d: Path) -> dict:
    return load_json(d / "report.json")  # "nan" and "inf" strings back to floats


def differences(got: dict, want: dict) -> list[str]:
    """Every leaf where the report's `cost` and the recomputation differ beyond REL."""
    return tree_differences(got, want, REL)


def test_phase_report_by_hand():
    """Four phases at float64 100 and float32 400 operations per second: 300 operations in
    6 s, 800 in 4 s and 200 in 1 s are rates 50, 200 and 200, fractions 0.5, 0.5 and 2; the
    projections' second, timed with no count, is no work at rate 0; 12 s of work, a floor of
    3 + 2 + 2 = 7 s, overall 7/12; forwards of 2 s make 6x and 3.5x.  A count with no timer
    is absent."""
    rates = {"float64": 100.0, "float32": 400.0}
    got = cost.phase_report({"float64_original": 300.0, "lowp_maxkey": 800.0,
                             "float64_maxkey": 200.0, "untimed": 7.0},
                            {"float64_original": 6.0, "float32_maxkey": 4.0, "project": 1.0,
                             "float64_maxkey": 1.0}, rates, "float32", 2.0)
    assert got["phases"] == {
        "project": {"flops": 0.0, "seconds": 1.0, "dtype": "float64",
                    "achieved_flops_per_s": 0.0, "fraction_of_matmul": 0.0},
        "float64_original": {"flops": 300.0, "seconds": 6.0, "dtype": "float64",
                             "achieved_flops_per_s": 50.0, "fraction_of_matmul": 0.5},
        "float32_maxkey": {"flops": 800.0, "seconds": 4.0, "dtype": "float32",
                           "achieved_flops_per_s": 200.0, "fraction_of_matmul": 0.5},
        "float64_maxkey": {"flops": 200.0, "seconds": 1.0, "dtype": "float64",
                           "achieved_flops_per_s": 200.0, "fraction_of_matmul": 2.0}}
    assert (got["work_seconds"], got["floor_seconds"], got["fraction_of_matmul"]) == \
        (12.0, 7.0, 7.0 / 12.0)
    assert (got["model_forward_seconds"], got["work_over_model_forward"],
            got["floor_over_model_forward"]) == (2.0, 6.0, 3.5)
    assert got["matmul_flops_per_s"] == rates
    short = cost.phase_report({"float64_original": 30.0}, {"float64_original": 0.5}, rates,
                              "float32", None)  # under a second of work in all
    assert short["fraction_of_matmul"] == 0.6


def test_phase_report_without_time():
    """A phase of zero seconds has NaN rates and the overall fraction is NaN (never a
    division that passes for a number); without the forwards' time there are no ratios."""
    got = cost.phase_report({"float64_original": 3.0}, {"float64_original": 0.0},
                            {"float64": 100.0, "float32": 400.0}, "float32", None)
    p = got["phases"]["float64_original"]
    assert math.isnan(p["achieved_flops_per_s"]) and math.isnan(p["fraction_of_matmul"])
    assert math.isnan(got["fraction_of_matmul"]) and got["floor_seconds"] == 0.03
    assert not {"model_forward_seconds", "work_over_model_forward",
                "floor_over_model_forward"} & got.keys()


def test_prefix_sums_are_exact_integers():
    """The key counts are integers (exact at any length), causal and under a sliding window."""
    N = 10 ** 9 + 7
    for window, want in ((None, N * (N + 1) // 2), (1000, 1000 * 1001 // 2 + (N - 1000) * 1000)):
        got = cost.prefix_sums(N, window)
        assert got == (want, N) and type(got[0]) is int


def test_the_reference_recomputes_the_documented_cost_by_hand():
    """The reference's reading of section 11 on a two-process report worked by hand: seconds
    summed over the processes, the forwards too."""
    report = {"config": {"dtype": "bfloat16"},
              "cost": {"matmul_flops_per_s": {"float64": 10.0, "bfloat16": 40.0},
                       "phases": {"float64_original": {"flops": 60.0},
                                  "bfloat16_maxkey": {"flops": 80.0}}},
              "run": {"rank_timing_seconds": {
                  "1": {"float64_original": 4.0, "bfloat16_maxkey": 1.0, "model_forward": 1.5},
                  "0": {"float64_original": 8.0, "bfloat16_maxkey": 3.0,
                        "model_forward": 0.5}}}}
    got = reference.cost_section(report)
    assert got["phases"] == {
        "float64_original": {"flops": 60.0, "seconds": 12.0, "dtype": "float64",
                             "achieved_flops_per_s": 5.0, "fraction_of_matmul": 0.5},
        "bfloat16_maxkey": {"flops": 80.0, "seconds": 4.0, "dtype": "bfloat16",
                            "achieved_flops_per_s": 20.0, "fraction_of_matmul": 0.5}}
    assert (got["work_seconds"], got["floor_seconds"], got["fraction_of_matmul"]) == \
        (16.0, 8.0, 0.5)
    assert (got["model_forward_seconds"], got["work_over_model_forward"],
            got["floor_over_model_forward"]) == (2.0, 8.0, 4.0)


def test_nan_is_equal_only_to_nan():
    assert differences({"a": math.nan, "b": 1.0}, {"a": math.nan, "b": 1.0}) == []
    assert differences({"a": math.nan}, {"a": 1.0}) == ["a: nan against 1.0"]
    assert differences({"a": "float32"}, {"a": "float64"}) == ["a: 'float32' against 'float64'"]
    assert differences({"a": 1.0}, {"b": 1.0}) == ["a: only in the first", "b: only in the second"]


def test_the_committed_atlas_reports_are_found():
    names = {d.name for d in ATLASES if load(d).get("cost")}
    assert {"atlas-qwen2.5-coder-0.5b", "atlas-qwen2.5-coder-0.5b-offload", TWO_PROCESS,
            f"{TWO_PROCESS}-repeat1", f"{TWO_PROCESS}-repeat2"} <= names, names


@pytest.mark.parametrize("name", [d.name for d in ATLASES])
def test_committed_cost_is_recomputed(name):
    """Every leaf of the committed report's `cost` is the reference's recomputation from the
    report's timers, rates and counts; `timing_seconds` are process 0's timers."""
    r = load(ROOT / "validation" / name)
    if r.get("cost") is None:
        pytest.skip(f"{name}: no cost section (a report of an earlier schema, or --replication)")
    problems = differences(r["cost"], reference.cost_section(r))
    assert not problems, "\n".join(problems)
    rank0 = r["run"]["rank_timing_seconds"]["0"]
    assert {k: v for k, v in r["timing_seconds"].items() if k != "total"} == \
        {k: v for k, v in rank0.items() if k != "total"}
    assert r["run"]["world_size"] == len(r["run"]["rank_timing_seconds"])


@pytest.mark.parametrize("k", [1, 2])
def test_committed_two_process_repeats_are_the_same_report(k):
    """The repeats of the committed two-process atlas give its numbers bit for bit, with the
    same counted work (only the machine's seconds and rates may differ)."""
    base = load(ROOT / "validation" / TWO_PROCESS)
    rep = load(ROOT / "validation" / f"{TWO_PROCESS}-repeat{k}")
    assert rep["run"]["world_size"] == base["run"]["world_size"] == 2
    assert rep["verdict"]["passed"] and atlas.same_report(base, rep)


def test_a_changed_cost_figure_is_caught():
    """The comparison's power: a fraction, a ratio to the forwards or a phase's seconds moved
    by one part in 1e9 in the committed two-process report each show as a difference."""
    r = load(ROOT / "validation" / TWO_PROCESS)
    want = reference.cost_section(r)
    for path in (("fraction_of_matmul",), ("work_over_model_forward",),
                 ("phases", "float64_original", "seconds"),
                 ("phases", "float32_maxkey", "fraction_of_matmul")):
        bad = json.loads(json.dumps(r["cost"]))
        node = at(bad, path[:-1])
        node[path[-1]] *= 1 + 1e-9
        assert differences(bad, want) == [f"{'/'.join(path)}: {node[path[-1]]!r} against "
                                          f"{at(want, path)!r}"]
