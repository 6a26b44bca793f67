"""No verdict is ever silent: NaN/inf fail, failures exit 1 and are named, bad input exits 2.

For each command -- ``ropestep validate``, ``ropestep sweep`` (and ``python -m ropestep.sweep``
under torchrun), ``ropestep bench`` -- a pass exits 0, an injected failure (a NaN or inf error, a
tolerance of 0) exits 1 with one ``FAIL`` line per failed check naming where it failed, and bad
input exits 2 with one line.  The reductions themselves (:mod:`ropestep.verdict`) keep NaN in
any argument order, and the reports print ``nan``/``inf``, never 0, blank or "—".
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ropestep import cli, verdict
from ropestep import tolerances as tl
from ropestep.verdict import Failure, finite, least, within, worst

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = math.nan, math.inf


def _fail_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ": FAIL " in ln]


# ---------------------------------------------------------------------------------------------
# the helper module
# ---------------------------------------------------------------------------------------------
def test_builtin_max_drops_nan_but_worst_does_not():
    assert max(0.0, NAN) == 0.0  # the bug: a NaN error became a pass
    for vals in ([0.0, NAN], [NAN, 0.0], [1.0, NAN, 2.0], [INF, NAN], [NAN, INF]):
        assert math.isnan(worst(vals)) and math.isnan(least(vals))
    assert worst([1.0, INF, 2.0]) == INF and least([1.0, -INF]) == -INF
    assert worst([np.array([1.0, 3.0]), torch.tensor([2.0, NAN])]) != worst([1.0, 3.0])
    assert math.isnan(worst(torch.tensor([[1.0, NAN]])))
    assert worst(x for x in (1.0, 2.0)) == 2.0 and worst(5) == 5.0
    assert worst([], default=None) is None
    with pytest.raises(ValueError):
        worst([])
    with pytest.raises(TypeError):
        worst([1.0, None])  # an error never computed cannot pass
    assert not finite([1.0, NAN]) and not finite(INF) and finite([0.0, 1e308])


def test_pass_predicate_fails_nan_and_inf():
    assert within(1e-13, 1e-12) and within([0.0, 1e-12], 1e-12)
    assert not within(NAN, 1e-12) and not within([0.0, NAN], 1.0)
    assert not within(INF, 1e300) and not within(2e-12, 1e-12)
    assert not within([], 1.0)  # nothing checked is not a pass
    assert (not NAN > 1.0) is True  # why the predicate is never written `not err > tol`


def test_json_keeps_nonfinite_floats():
    obj = {"a": NAN, "b": [INF, -INF, 1.5], "c": np.float32("nan"), "d": torch.tensor([1.0, NAN]),
           "candidates_text": ["nan", "inf"], "command": ["ropestep", "--x", "nan"], "n": 3}
    text = verdict.dumps(obj)
    raw = json.loads(text)  # strict JSON: no NaN literal anywhere
    assert "NaN" not in text and "Infinity" not in text
    assert raw["a"] == "nan" and raw["b"] == ["inf", "-inf", 1.5] and raw["d"] == [1.0, "nan"]
    back = verdict.loads(text)
    assert math.isnan(back["a"]) and back["b"][:2] == [INF, -INF] and math.isnan(back["c"])
    assert back["candidates_text"] == ["nan", "inf"]  # text stays text
    assert back["command"] == ["ropestep", "--x", "nan"] and back["n"] == 3


def test_failure_lines_and_exit_code(capsys):
    fl = [Failure("layer 1 context 0 head 3", "identity", NAN, 2e-9, detail="non-finite"),
          Failure("x", "y", INF)]
    verdict.print_failures("prog", fl)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("prog: FAIL layer 1 context 0 head 3: identity = nan (tolerance 2e-09) "
                      "[non-finite]")
    assert err[1] == "prog: FAIL x: y = inf"
    assert verdict.exit_code(fl) == 1 and verdict.exit_code([]) == 0
    verdict.print_failures("prog", [f.as_dict() for f in fl], limit=1)
    assert "1 more" in capsys.readouterr().err


def test_report_numbers_print_nan_not_a_dash():
    from ropestep import report

    assert report.fmt(NAN) == "nan" and report.fmt(INF) == "inf" and report.fmt(-INF) == "-inf"
    assert report.fmt6(NAN) == "nan" and report.fmt(None) == "—" and report.fmt(0.0) == "0"
    assert report.jsonable({"x": NAN})["x"] == "nan"


def test_verdict_module_imports_nothing_from_ropestep():
    src = (ROOT / "src" / "ropestep" / "verdict.py").read_text()
    assert "from ." not in src and "import ropestep" not in src


# ---------------------------------------------------------------------------------------------
# ropestep validate (tiny random Qwen2, local; a few seconds per run)
# ---------------------------------------------------------------------------------------------
SMALL = ["--contexts", "1", "--queries", "3", "--prefix-len", "16", "--layers", "last",
         "--exact-rows", "1", "--no-figures", "--quiet"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from test_protocol import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("verdict_tiny"))


def _validate(model: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = cli.main(["validate", "--model", str(model), *SMALL, *extra, "--out", str(out)])
    return rc, capsys.readouterr().err


@pytest.mark.model
def test_validate_pass_exits_0(tiny_model, tmp_path, capsys):
    rc, err = _validate(tiny_model, tmp_path / "ok", capsys)
    assert rc == 0 and not _fail_lines(err)
    r = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert r["verdict"] == {"pass": True, "failed_checks": 0, "failures": []}
    assert "## Verdict: PASS" in (tmp_path / "ok" / "report.md").read_text()


@pytest.mark.model
def test_validate_nan_row_error_fails_and_shows_nan(tiny_model, tmp_path, capsys, monkeypatch):
    """A NaN in one row's errors (context 0, head 0, prefix bank): exit 1, the row named on
    stderr, ``nan`` in report.md's table and verdict, "nan" in report.json."""
    from ropestep import contextcheck, report

    orig, calls = contextcheck._err, [0]

    def err_with_nan(a, b):
        calls[0] += 1
        return {"mse": NAN, "max_abs": NAN} if calls[0] == 1 else orig(a, b)

    monkeypatch.setattr(contextcheck, "_err", err_with_nan)
    out = tmp_path / "nan"
    rc, err = _validate(tiny_model, out, capsys)
    print(err)
    assert rc == 1
    lines = _fail_lines(err)
    assert lines == ["ropestep validate: FAIL layer 1 context 0 head 0: identity = nan "
                     "[non-finite prefix mse]"]
    r = report.load(out / "report.json")  # written although a check failed
    rec = r["layers"]["1"]["reconstruction"]
    assert rec["rows_passed"] == rec["rows_total"] - 1 and rec["rows_passed_native"] == 8
    assert math.isnan(rec["per_head"][0]["prefix"]["max_abs"])  # pooled: NaN kept, not dropped
    assert math.isnan(rec["rows"][0]["prefix"]["mse"])
    raw = json.loads((out / "report.json").read_text())
    assert raw["layers"]["1"]["reconstruction"]["per_head"][0]["prefix"]["mse"] == "nan"
    assert raw["verdict"]["pass"] is False and raw["verdict"]["failed_checks"] == 1
    md = (out / "report.md").read_text()
    assert "## Verdict: FAIL" in md and "identity = nan" in md
    row0 = next(ln for ln in md.splitlines() if ln.startswith("| 0 |"))
    assert row0.split(" | ")[1:3] == ["nan", "nan"] and "—" not in row0  # prefix MSE and max


@pytest.mark.model
def test_validate_inf_check_and_tolerance_zero_fail(tiny_model, tmp_path, capsys, monkeypatch):
    from ropestep import contextcheck, protocol
    from ropestep import reuse_stats as rs

    # an infinite tokenwise agreement (calibration check of head 0)
    orig, calls = rs.normwise_agreement, [0]

    def inf_once(p, m):
        calls[0] += 1
        return INF if calls[0] == 1 else orig(p, m)

    with monkeypatch.context() as mp:
        mp.setattr(rs, "normwise_agreement", inf_once)
        rc, err = _validate(tiny_model, tmp_path / "inf", capsys)
    assert rc == 1
    assert _fail_lines(err) == ["ropestep validate: FAIL layer 1 context 0 head 0: tokenwise = "
                                "inf [non-finite]"]
    md = (tmp_path / "inf" / "report.md").read_text()
    assert "max normwise relative difference **inf**" in md
    # every row outside a zero tolerance: one line per failed row, naming the check
    mp_tol = dict(contextcheck.TOLERANCES, identity_head=(0.0, 0.0), identity_write=(0.0, 0.0))
    monkeypatch.setattr(protocol, "TOLERANCES", mp_tol)
    monkeypatch.setattr(contextcheck, "TOLERANCES", mp_tol)
    rc, err = _validate(tiny_model, tmp_path / "zero", capsys)
    assert rc == 1
    lines = _fail_lines(err)
    assert len(lines) >= 8 and all(": identity = " in ln and "outside atol/rtol 0/0" in ln
                                   for ln in lines[:8])
    assert "layer 1 context 0 head combined: identity" in err


@pytest.mark.model
def test_validate_bad_input_exits_2(tiny_model, tmp_path, capsys):
    rc, err = _validate(tiny_model, tmp_path / "bad", capsys, "--heads", "9")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "head 9 out of range" in err
    assert not (tmp_path / "bad").exists()


def test_protocol_verdict_from_a_report_dict():
    """The verdict is recomputed from the report's data: a NaN anywhere in a row, a violated
    reuse bound, or a non-finite pooled number no row accounts for."""
    from ropestep import protocol

    e = {"mse": 1e-30, "max_abs": 1e-15}
    row = {"context": 2, "head": 5, "prefix": dict(e), "full": dict(e), "native": dict(e),
           "native_observed_full_forward": dict(e), "relation_max_abs": 0.0,
           "cache_vs_full_forward_max_abs": 0.0, "pass_identity": True, "pass_native": True}
    pc = {"context": 2, "heads": [5], "tokenwise_rel": [1e-15], "bound_violations": [0],
          "frozen_crosscheck_max_abs": 0.0, "frozen_crosscheck_pass": True,
          "refresh_identity_max_abs": 0.0, "refresh_identity_pass": True}
    layer = {"reconstruction": {"rows": [row], "combined": {"native": dict(e)}},
             "calibration": {"checks": {"per_context": [pc]}}, "fast": {}, "reuse": {}}
    res = {"model": {"dtype": "float32"}, "layers": {"7": layer}}
    assert protocol.verdict(res) == []
    bad = copy.deepcopy(res)
    bad["layers"]["7"]["reconstruction"]["rows"][0]["native"]["max_abs"] = INF
    bad["layers"]["7"]["calibration"]["checks"]["per_context"][0]["bound_violations"] = [3]
    fl = protocol.verdict(bad)
    assert [(f.where, f.check) for f in fl] == [("layer 7 context 2 head 5", "native"),
                                               ("layer 7 context 2 head 5", "reuse_bound")]
    assert fl[0].value == INF and fl[1].value == 3
    # the notebook's further checks are part of the verdict: each failed flag is named
    full = copy.deepcopy(res)
    full_row = full["layers"]["7"]["reconstruction"]["rows"][0]
    full_row.update({"projected_prefix": dict(e), "projected_full": dict(e),
                     "self_mass_vs_native_max_abs": 1e-9, "pass_relation": True,
                     "pass_projected_write": True, "pass_self_mass": True})
    assert protocol.verdict(full) == []
    for check in ("relation", "projected_write", "self_mass"):
        one = copy.deepcopy(full)
        one["layers"]["7"]["reconstruction"]["rows"][0][f"pass_{check}"] = False
        fl = protocol.verdict(one)
        assert [(f.where, f.check) for f in fl] == [("layer 7 context 2 head 5", check)], check
    nan_mass = copy.deepcopy(full)  # no native self mass captured: a failure, never a pass
    nan_mass["layers"]["7"]["reconstruction"]["rows"][0]["self_mass_vs_native_max_abs"] = NAN
    assert [f.check for f in protocol.verdict(nan_mass)] == ["self_mass"]
    # a failed claim on the real heads (or a NaN in one) is named with its layer and context
    for name, field, value in (("conventions", "q_rel_max", 2.1), ("exact_rows", "y_rel_max", NAN),
                               ("position_shift", "ratio_max", 1.9e11)):
        claim = copy.deepcopy(res)
        claim["layers"]["7"]["real_heads"] = {"per_context": [
            {"context": 3, "rank": {"rank_max": 40, "ok": True},
             name: {field: value, "ok": False, "tolerance_from": "t"}}]}
        fl = protocol.verdict(claim)
        assert [(f.where, f.check) for f in fl] == [("layer 7 context 3", name)], name
        assert (fl[0].value != fl[0].value) if value != value else fl[0].value == value
    pooled = copy.deepcopy(res)
    pooled["layers"]["7"]["reconstruction"]["combined"]["native"]["max_abs"] = NAN
    fl = protocol.verdict(pooled)
    assert len(fl) == 1 and fl[0].check == "reconstruction.combined.native.max_abs"
    assert protocol.verdict_block(pooled)["pass"] is False


# ---------------------------------------------------------------------------------------------
# ropestep sweep (synthetic layers in process; a model and torchrun below)
# ---------------------------------------------------------------------------------------------
SWEEP = ["--contexts", "24", "40", "--layers", "0", "1", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "8", "--hidden", "12", "--seed", "4"]
SWEEP_HEAD_DIM = 8


@pytest.fixture
def no_launcher(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def _sweep(tmp_path: Path, capsys, *extra: str, name: str = "sweep.json") -> tuple[int, str, Path]:
    out = tmp_path / name
    rc = cli.main(["sweep", *SWEEP, *extra, "--out", str(out)])
    return rc, capsys.readouterr().err, out


def test_sweep_pass_exits_0(tmp_path, capsys, no_launcher, one_thread):
    rc, err, out = _sweep(tmp_path, capsys)
    assert rc == 0 and not _fail_lines(err)
    r = json.loads(out.read_text())
    assert r["pass"] is True and r["failures"] == [] and len(r["items"]) == 4
    for it in r["items"]:  # float64 softmax output against the readout: two orders of the sums
        tol = tl.agreement_rel_tol(torch.float64, it["length"], SWEEP_HEAD_DIM)
        assert it["pass"] and it["max_rel"] <= it["tol_identity"] == tol


@pytest.mark.parametrize("value", [NAN, INF])
def test_sweep_nonfinite_item_fails(tmp_path, capsys, no_launcher, one_thread, monkeypatch, value):
    """A NaN/inf in one chunk's output (context 1, layer 0, head 1): exit 1, the item named,
    the value in the report -- never 0."""
    from ropestep import scale

    orig = scale.stream

    def corrupted(spec, weights, x, *a, **k):  # one call per item
        first = int(x.shape[0]) == 40  # context 1
        for ch in orig(spec, weights, x, *a, **k):
            if first and 1 in ch.heads:
                ch.y_c[ch.heads.index(1), 0, 0] = value  # head 1, first query of the chunk
                first = False
            yield ch

    monkeypatch.setattr(scale, "stream", corrupted)
    rc, err, out = _sweep(tmp_path, capsys, "--layers", "0")
    print(err)
    assert rc == 1
    name = "nan" if math.isnan(value) else "inf"
    tol = verdict.num(tl.agreement_rel_tol(torch.float64, 40, SWEEP_HEAD_DIM))
    assert _fail_lines(err) == [
        f"ropestep sweep: FAIL context 1 (length 40) layer 0: identity max_rel = {name} "
        f"(tolerance {tol}) [heads [1]]"]
    raw = json.loads(out.read_text())
    bad = raw["items"][1]
    assert bad["max_rel"] == name and bad["heads"]["max_rel"][1] == name and not bad["pass"]
    assert raw["max_rel"] == name and raw["pass"] is False  # the report's max keeps it
    assert raw["items"][0]["pass"] and raw["failures"][0]["where"].startswith("context 1")


def test_sweep_tolerance_zero_and_floating_point_error(tmp_path, capsys, no_launcher, one_thread,
                                                       monkeypatch):
    from ropestep import scale, tolerances

    with monkeypatch.context() as mp:
        mp.setattr(tolerances, "agreement_rel_tol", lambda *a, **k: 0.0)
        rc, err, _ = _sweep(tmp_path, capsys, "--dtype", "float32")
    assert rc == 1 and len(_fail_lines(err)) == 4
    assert all("identity max_rel = " in ln and "(tolerance 0)" in ln for ln in _fail_lines(err))

    def overflow(*a, **k):
        raise FloatingPointError("gauge 'original' overflows in torch.float32 at head 0")

    monkeypatch.setattr(scale, "identity_check", overflow)
    rc, err, out = _sweep(tmp_path, capsys, "--contexts", "24", "--layers", "0")
    assert rc == 1 and "identity = nan" in err and "overflows" in err
    assert json.loads(out.read_text())["items"][0]["error"].startswith("gauge 'original'")


@pytest.mark.parametrize("extra, match", [
    (["--dtype", "float16"], "invalid choice"),
    (["--gauge", "cosine"], "invalid choice"),
    (["--model", "/nonexistent/model/dir"], "does not exist"),
    (["--heads", "3", "--kv-heads", "2"], "multiple of --kv-heads"),
    (["--contexts", "0"], "--contexts"),
    (["--layers", "-1"], "layer -1 out of range"),
    (["--device", "tpu"], "--device"),
])
def test_sweep_bad_input_exits_2(tmp_path, capsys, no_launcher, extra, match):
    out = tmp_path / "never.json"
    rc = cli.main(["sweep", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and match in err
    assert "Traceback" not in err and not out.exists()
    from ropestep import sweep

    assert sweep.main(["--out", str(out), *extra]) == 2  # the module entry point too
    assert capsys.readouterr().err.startswith("python -m ropestep.sweep: error: ")


@pytest.mark.model
def test_model_sweep_native_bound_and_bad_layer(tmp_path, capsys, no_launcher, one_thread,
                                                monkeypatch):
    """``y_vs_model_rel`` above its bound fails the item; a layer the model lacks exits 2."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from ropestep import tolerances

    cfg = AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").save_pretrained(
        tmp_path / "m")
    base = ["sweep", "--model", str(tmp_path / "m"), "--contexts", "20", "--layers", "0"]
    assert cli.main([*base, "--out", str(tmp_path / "ok.json")]) == 0
    ok = json.loads((tmp_path / "ok.json").read_text())["items"][0]
    assert ok["y_vs_model_rel"] <= ok["tol_native"] and ok["pass"]
    capsys.readouterr()
    monkeypatch.setattr(tolerances, "native_rel_tol", lambda *a, **k: 0.0)
    assert cli.main([*base, "--out", str(tmp_path / "bad.json")]) == 1
    assert "layer 0: y_vs_model_rel = " in capsys.readouterr().err
    rc = cli.main(["sweep", "--model", str(tmp_path / "m"), "--layers", "3", "--contexts", "8",
                   "--out", str(tmp_path / "never.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "layer 3 out of range" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "never.json").exists()


RANK_SCRIPT = """
import os, sys
from ropestep import sweep, tolerances
mode = os.environ["SWEEP_MODE"]
if mode == "fail":
    tolerances.agreement_rel_tol = lambda *a, **k: 0.0
elif mode == "input_on_rank1":
    orig = sweep.run_items
    def run_items(args, items, dev):
        if os.environ["RANK"] == "1":
            raise sweep.SweepInputError("rank 1 found bad input")
        return orig(args, items, dev)
    sweep.run_items = run_items
code = sweep.main(sys.argv[1:])
with open(os.path.join(os.environ["RC_DIR"], "rc" + os.environ["RANK"]), "w") as f:
    f.write(str(code))
sys.exit(code)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("mode, code", [("fail", 1), ("input_on_rank1", 2)])
def test_torchrun_ranks_agree_on_the_exit_code(tmp_path, mode, code):
    from ropestep import sweep

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    src = str(Path(sweep.__file__).parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", SWEEP_MODE=mode, RC_DIR=str(tmp_path),
               PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script), "--contexts", "24", "40",
                           "--layers", "0", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                           "--hidden", "12", "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    print(proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.returncode != 0
    assert (tmp_path / "rc0").read_text() == (tmp_path / "rc1").read_text() == str(code)
    if code == 1:
        assert len(_fail_lines(proc.stderr)) == 2 and json.loads(out.read_text())["pass"] is False
    else:
        assert "python -m ropestep.sweep: error: rank 1 found bad input" in proc.stderr
        assert not out.exists()


# ---------------------------------------------------------------------------------------------
# ropestep bench (one real small run in worker subprocesses; the rest on its results)
# ---------------------------------------------------------------------------------------------
BENCH = ["--sizes", "48", "--direct-queries", "2", "--pairwise-queries", "2", "--spreads", "5",
         "--spread-n", "48", "--threads", "1", "--quiet"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "b.json"
    rc = cli.main(["bench", *BENCH, "--out", str(out)])
    return rc, out, json.loads(out.read_text())


def test_bench_pass_exits_0(bench_run):
    rc, _, rep = bench_run
    assert rc == 0 and rep["verdict"]["pass"] and rep["verdict"]["failures"] == []
    # every agreement the benchmark measures is a check: 8 per size + 3 per spread row
    assert rep["verdict"]["checks"] == 8 + 3


@pytest.mark.parametrize("section, key", [("direct", "delta_m_rel_vs_factored"),
                                          ("pairwise", "t_rel_lowrank_vs_exact"),
                                          ("factored", "identity_max_rel")])
def test_bench_nonfinite_agreement_fails(bench_run, tmp_path, capsys, monkeypatch, section, key):
    from ropestep import bench

    _, _, rep = bench_run
    res = copy.deepcopy(rep["results"][0])
    res[section][key] = NAN
    monkeypatch.setattr(bench, "_worker", lambda cfg: copy.deepcopy(res))
    out = tmp_path / "b.json"
    assert cli.main(["bench", *BENCH, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    tol = verdict.num(bench.tolerance("float64", 48, 896 if section == "direct" else 0))
    assert _fail_lines(err) == [f"ropestep bench: FAIL float64 N=48: {section}.{key} = nan "
                                f"(tolerance {tol})"]
    raw = json.loads(out.read_text())
    assert raw["results"][0][section][key] == "nan" and raw["verdict"]["pass"] is False
    # --render re-derives the verdict from the JSON: exit 1 again, nan in the Markdown
    md = tmp_path / "b.md"
    assert cli.main(["bench", "--render", str(out), "--markdown", str(md)]) == 1
    assert "Verdict: **FAIL**" in md.read_text() and "= nan" in md.read_text()


def test_bench_tolerance_zero_spread_and_crash(bench_run, tmp_path, capsys, monkeypatch):
    from ropestep import bench

    _, path, rep = bench_run
    monkeypatch.setattr(bench, "_worker", lambda cfg: copy.deepcopy(rep["results"][0]))
    monkeypatch.setattr(bench, "tolerance", lambda *a: 0.0)
    assert cli.main(["bench", *BENCH]) == 1
    lines = _fail_lines(capsys.readouterr().err)
    assert len(lines) == 11 and any("spreads[5].t_rel_lowrank_vs_exact" in ln for ln in lines)
    monkeypatch.undo()
    assert cli.main(["bench", "--render", str(path)]) == 0  # the real results pass
    capsys.readouterr()

    def crash(cfg):
        raise RuntimeError(f"benchmark worker failed (exit 1) for {cfg['n']}")

    monkeypatch.setattr(bench, "_worker", crash)
    assert cli.main(["bench", *BENCH]) == 1
    assert "ropestep bench: error: benchmark worker failed" in capsys.readouterr().err


@pytest.mark.parametrize("extra, match", [
    (["--sizes", "1"], "--sizes must all be >= 2"),
    (["--pairwise-heads", "14"], "head 14 out of range"),
    (["--spreads", "0"], "--spreads must be finite and > 0"),
    (["--max-bytes", "lots"], "invalid"),
    (["--dtype", "float16"], "invalid choice"),
    (["--render", "/nonexistent/bench.json"], "does not exist"),
])
def test_bench_bad_input_exits_2(tmp_path, capsys, monkeypatch, extra, match):
    from ropestep import bench

    def never(cfg):
        raise AssertionError("no worker may start on bad input")

    monkeypatch.setattr(bench, "_worker", never)
    assert cli.main(["bench", *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err and "Traceback" not in err
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    assert cli.main(["bench", "--render", str(bad)]) == 2
