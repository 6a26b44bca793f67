"""``ropestep architectures``: the architecture matrix as a report (validation/architectures/).

Three architectures (plain, fused/partial-rotary, refused) through the command into tmp_path:
the report's structure, outcomes that agree with the matrix test's EXPECTED_REFUSALS, exit 0;
then a forced failed check and a crash give exit 1, and a bad ``--only`` exit 2.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

pytest.importorskip("transformers")

from ropestep import architectures, archzoo, cli  # noqa: E402
from ropestep.models import LayerConventions  # noqa: E402

from test_architecture_matrix import ATLAS, EXPECTED_REFUSALS, VALIDATE  # noqa: E402

PLAIN, FUSED = "llama", "phi3"  # separate q/k/v; fused qkv_proj with partial rotary 0.5
REFUSED = "qwen3" if "qwen3" in EXPECTED_REFUSALS else sorted(EXPECTED_REFUSALS)[0]
ROW_KEYS = set(LayerConventions(0, "A", "separate", "o_proj", None, 0, "half", "none", 1.0, 1.0,
                                None, None, False, float("nan"), False, False, False).row())


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = cli.main(argv)
    return rc, buf.getvalue()


def test_the_arguments_are_the_matrix_tests():
    assert architectures.ATLAS_ARGS == ATLAS and architectures.VALIDATE_ARGS == VALIDATE


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> tuple[int, str, Path]:
    assert not EXPECTED_REFUSALS.get(PLAIN) and not EXPECTED_REFUSALS.get(FUSED)
    out = tmp_path_factory.mktemp("arch") / "architectures"
    rc, text = _run(["architectures", "--only", f"{PLAIN},{FUSED},{REFUSED}", "--out", str(out)])
    return rc, text, out


def test_three_architectures_report(three):
    rc, text, out = three
    assert rc == 0, text[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]  # no weights
    rep = json.loads((out / "report.json").read_text())
    assert rep["schema"] == "ropestep.architectures/1"
    assert rep["command"][:2] == ["ropestep", "architectures"]
    assert rep["config"]["seed"] == 0
    assert rep["config"]["architectures"] == [n for n in archzoo.ARCHITECTURES
                                              if n in (PLAIN, FUSED, REFUSED)]
    v = rep["environment"]["versions"]
    assert v["torch"] and v["transformers"] and v["ropestep"]
    assert rep["environment"]["hardware"]["torch_threads"] == 1
    assert rep["verdict"] == {"passed": True, "failed": []}
    s = rep["summary"]
    assert sorted(s["passed"]) == sorted([PLAIN, FUSED]) and s["refused"] == [REFUSED]
    assert s["failed"] == []
    for name, r in rep["architectures"].items():
        arch = archzoo.ARCHITECTURES[name]
        assert r["model_type"] == arch.model_type and r["what"] == arch.what
        # the outcome agrees with the matrix test's table
        assert (r["outcome"] == "refused") == bool(EXPECTED_REFUSALS.get(name)), r
        conv = r["conventions"]
        if conv["refused"] is None:
            assert len(conv["layers"]) == conv["n_layers"]
            assert all(set(row) == ROW_KEYS for row in conv["layers"])
            assert set(architectures.SUMMARY_FIELDS) <= set(conv["summary"])
        for cmd in ("atlas", "validate"):
            res = r[cmd]
            assert res["command"][:4] == ["ropestep", cmd, "--model", f"models/{name}"]
            if r["outcome"] == "pass":
                assert res["exit"] == 0 and res["refusal"] is None
                assert res["checks"] and all(c["passed"] for c in res["checks"].values())
                assert res["worst"]["ratio"] <= 1.0
                for c in res["checks"].values():  # ratios the checks compare with 1 are <= 1
                    if c["kind"] == architectures.EXACT:
                        assert 0.0 <= c["ratio"] <= 1.0
        _agrees_with_the_matrix(name, r)
    atlas_checks = rep["architectures"][PLAIN]["atlas"]["checks"]
    assert set(architectures.ATLAS_RATIOS) <= set(atlas_checks)
    val = rep["architectures"][PLAIN]["validate"]["checks"]
    assert {"identity", "native", "conventions", "position_derivative", "rank"} <= set(val)
    fused = rep["architectures"][FUSED]["conventions"]["summary"]
    assert fused["layout"] == "fused" and fused["rotary_dim"] == fused["head_dim"] // 2
    md = (out / "report.md").read_text()
    for name in (PLAIN, FUSED, REFUSED):
        assert f"| `{name}` | `{archzoo.ARCHITECTURES[name].model_type}` |" in md
    assert "refused" in md and "/tmp" not in md


def _agrees_with_the_matrix(name: str, r: dict) -> None:
    """The outcomes of ``name`` are the matrix test's: EXPECTED_REFUSALS maps an architecture to
    the words of its refusal, for both commands (a string) or per command (a dict: a command
    not named passes)."""
    expected = EXPECTED_REFUSALS.get(name) or {}
    why = {c: r[c]["refusal"] for c in ("atlas", "validate") if r[c]["refusal"]}
    assert all("\n" not in w and "/tmp" not in w for w in why.values()), why
    if isinstance(expected, str):
        assert r["atlas"]["exit"] == r["validate"]["exit"] == 2, r
        assert any(expected in w for w in why.values()), why
        return
    for cmd in ("atlas", "validate"):
        if cmd in expected:
            assert r[cmd]["exit"] == 2 and expected[cmd] in why[cmd], (cmd, r[cmd])
        else:
            assert r[cmd]["exit"] == 0 and r[cmd]["outcome"] == "pass", (cmd, r[cmd])


def test_a_failed_check_or_a_crash_fails_the_command(tmp_path, monkeypatch):
    real = cli.main
    mode = {"atlas": "crash", "validate": "fail"}

    def forced(argv):  # what architectures runs, through ropestep.cli.main
        if argv[0] == "validate" and mode["validate"] == "fail":
            real(argv)  # the real run and its report, then the exit of a failed check
            return 1
        if argv[0] == "atlas" and mode["atlas"] == "crash":
            raise RuntimeError("boom")
        return real(argv)

    monkeypatch.setattr(cli, "main", forced)
    rc, text = _run_real(real, ["architectures", "--only", PLAIN, "--out",
                                str(tmp_path / "out"), "--quiet"])
    assert rc == 1, text[-2000:]
    assert f"FAIL {PLAIN}: validate exit 1" in text
    assert f"FAIL {PLAIN}: atlas crashed: RuntimeError: boom" in text
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    r = rep["architectures"][PLAIN]
    assert r["outcome"] == "fail" and rep["summary"]["failed"] == [PLAIN]
    assert r["atlas"]["outcome"] == "crash" and r["atlas"]["crash"]
    assert r["validate"]["exit"] == 1 and r["validate"]["checks"]  # its report was read
    assert rep["verdict"]["passed"] is False and len(rep["verdict"]["failed"]) == 2
    assert "**FAIL**" in (tmp_path / "out" / "report.md").read_text()


def _run_real(real, argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = real(argv)
    return rc, buf.getvalue()


def test_bad_input_is_one_line(tmp_path):
    rc, text = _run(["architectures", "--only", "llama,nope", "--out", str(tmp_path / "x")])
    assert rc == 2 and text.count("\n") == 1 and "unknown architecture(s) nope" in text
    assert not (tmp_path / "x").exists()
