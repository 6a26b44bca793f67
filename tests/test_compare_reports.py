"""``tools/compare_reports.py``: the leaf-by-leaf distance between two reports that the README
quotes for the committed one- and two-process Qwen2.5 atlases -- its counts, its worst relative
difference, what it calls a mismatch, and its exit status."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("ropestep_compare_reports",
                                                  ROOT / "tools" / "compare_reports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def report(**over):
    r = {"layers": {"0": {"a": 1.0, "b": [2.0, math.nan, 4], "c": "x"}},
         "verdict": {"passed": True, "failed": []},
         "timing_seconds": {"total": 3.0}, "cost": {"work_seconds": 1.0}}
    r.update(over)
    return r


def test_counts_and_worst(tool):
    a = report()
    b = report(layers={"0": {"a": 1.0 + 1e-7, "b": [2.0, math.nan, 4], "c": "x"}},
               timing_seconds={"total": 9.0}, cost={"work_seconds": 7.0})
    res = tool.compare(a, b)
    assert res["leaves"] == 4 and res["differ"] == 1 and res["mismatch"] == []
    assert res["worst_at"] == "/layers/0/a"
    assert res["worst_rel"] == pytest.approx(1e-7 / (1 + 1e-7), rel=1e-9)
    assert tool.compare(a, a)["differ"] == 0
    # the skipped sections count once they are not skipped
    assert tool.compare(a, b, skip=())["differ"] == 3


@pytest.mark.parametrize("b, what", [
    (report(layers={"0": {"a": math.inf, "b": [2.0, math.nan, 4], "c": "x"}}), "inf"),
    (report(layers={"0": {"a": 1.0, "b": [2.0, 3.0, 4], "c": "x"}}), "nan"),
    (report(layers={"0": {"a": 1.0, "b": [2.0, math.nan], "c": "x"}}), "lengths"),
    (report(layers={"0": {"a": 1.0, "b": [2.0, math.nan, 4], "c": "y"}}), "'x'"),
    (report(layers={"0": {"a": 1.0, "b": [2.0, math.nan, 4]}}), "keys"),
    (report(verdict={"passed": False, "failed": ["x"]}), "verdict"),
])
def test_mismatches_are_named(tool, b, what):
    res = tool.compare(report(), b)
    assert res["mismatch"] and what in " ".join(res["mismatch"]), res


def test_exit_status(tool, tmp_path, capsys):
    a, b, c = (tmp_path / n for n in ("a.json", "b.json", "c.json"))
    a.write_text(json.dumps(report()))
    b.write_text(json.dumps(report(layers={"0": {"a": 2.0, "b": [2.0, math.nan, 4],
                                                  "c": "x"}})))
    c.write_text(json.dumps(report(verdict={"passed": False, "failed": ["x"]})))
    assert tool.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "differ: 1" in out and "0.5 at /layers/0/a" in out and "verdicts agree" in out
    assert tool.main([str(a), str(c)]) == 1
    assert "verdicts DIFFER" in capsys.readouterr().out
    assert tool.main([str(a), str(tmp_path / "missing.json")]) == 2
    (tmp_path / "list.json").write_text("[1]")
    assert tool.main([str(a), str(tmp_path / "list.json")]) == 2
