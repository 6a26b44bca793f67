"""``ropestep atlas`` on real models: a tiny Qwen2 saved to disk (every layer, head and query
against the model's own output; exit codes; one process against two) and SmolLM2-135M."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ropestep import atlas, tolerances

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from test_protocol import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_atlas"))


def _argv(model: str, out: Path, *extra: str) -> list[str]:
    return ["--model", model, "--contexts", "2", "--len", "48", "--layers", "all",
            "--anchor-every", "16", "--out", str(out), "--quiet", "--no-figures", *extra]


def test_tiny_qwen2_every_layer_head_and_query(tiny_dir, tmp_path):
    out = tmp_path / "atlas"
    assert atlas.main(_argv(str(tiny_dir), out)) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == {"passed": True, "failed": []}
    assert sorted(rep["layers"]) == ["0", "1"]
    for lr in rep["layers"].values():
        assert len(lr["heads"]) == 7
        for h in lr["heads"]:
            assert h["identity_float64_rel_max"] <= tolerances.FLOAT64_REL
            assert h["float64_vs_native_rel"] <= h["float64_vs_native_tol"]
            assert h["model_dtype_vs_native_bound_ratio_max"] <= 1.0
            # kappa = O(1) on this model: the kappa-blind level holds too (the bound is not slack
            # hiding a failure of the float32 evaluation)
            assert h["model_dtype_vs_native_rel"] <= h["model_dtype_vs_native_kappa_blind_tol"]
            assert h["reuse"]["n_queries"] == 2 * (48 - 3)  # 3 anchors per context
    rep_d = rep["replication_style_descent"]
    assert rep_d["pooled"]["heads"] == 2 * 2 * 7 and "query" in rep_d["space"]
    assert (out / "report.md").read_text().startswith("# Atlas")


def test_exit_codes(tiny_dir, tmp_path, monkeypatch, capsys):
    assert atlas.main(_argv(str(tiny_dir), tmp_path / "bad", "--len", "1")) == 2
    assert atlas.main(_argv(str(tmp_path / "missing"), tmp_path / "bad2")) == 2
    assert not (tmp_path / "bad").exists()
    capsys.readouterr()
    assert atlas.main(_argv(str(tiny_dir), tmp_path / "bad3", "--device", "mps")) == 2
    assert "no float64" in capsys.readouterr().err  # a device without float64: said, not crashed
    # a malformed device is refused before the process group is set up (it once reached
    # torch.device() there and crashed with a traceback)
    assert atlas.main(_argv(str(tiny_dir), tmp_path / "bad4", "--device", "cudax")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device must be 'cpu' or 'cuda[:N]', got 'cudax'" in err
    monkeypatch.setattr(tolerances, "model_dtype_native_bound",  # nothing can pass
                        lambda *a, **k: np.zeros(np.broadcast_shapes(np.shape(a[1]),
                                                                     np.shape(a[2]))))
    assert atlas.main(_argv(str(tiny_dir), tmp_path / "fail")) == 1
    err = capsys.readouterr().err
    assert "FAIL layer 0 head 0: float64_vs_native" in err
    rep = json.loads((tmp_path / "fail" / "report.json").read_text())
    assert rep["verdict"]["passed"] is False


def _launch(args: list[str], nproc: int | None, cwd: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    src = str(Path(atlas.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = cwd / f"atlas-{nproc or 1}"
    cmd = [sys.executable, "-m", "ropestep.atlas"] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(nproc), "-m", "ropestep.atlas"]
    proc = subprocess.run(cmd + args + ["--out", str(out), "--threads", "1"], cwd=cwd, env=env,
                          timeout=300, capture_output=True, text=True)
    print(proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.distributed
def test_two_processes_write_the_same_atlas(tiny_dir, tmp_path):
    args = ["--model", str(tiny_dir), "--contexts", "2", "--len", "40", "--layers", "all",
            "--anchor-every", "16", "--quiet", "--no-figures"]
    one, two = _launch(args, None, tmp_path), _launch(args, 2, tmp_path)
    assert one["run"]["world_size"] == 1 and two["run"]["world_size"] == 2
    assert all(two["run"]["rank_items"].values())  # both ranks worked
    assert atlas.same_report(one, two)


def test_smollm2_two_layers(tmp_path):
    out = tmp_path / "smol"
    argv = ["--model", "smollm2", "--contexts", "1", "--len", "96", "--layers", "0,29",
            "--anchor-every", "32", "--out", str(out), "--quiet", "--no-figures"]
    assert atlas.main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["model"]["n_heads"] == 9 and rep["verdict"]["passed"]
    assert "/" not in (rep["model"]["source"] or "")  # no absolute machine path
    for lr in rep["layers"].values():
        for h in lr["heads"]:
            assert h["identity_float64_rel_max"] <= tolerances.FLOAT64_REL
