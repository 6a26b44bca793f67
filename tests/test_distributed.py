"""``validate``, ``atlas`` and ``heads`` under torchrun: 1, 2 and 3 processes (gloo on the CPU)
write the same report, number for number -- every work item is computed from its own inputs
alone, and rank 0 gathers them in order (:mod:`ropestep.dist`).  What may differ is named: the
timings, the time of writing, the ``run`` section (which rank did what) and the hardware record
(the thread count each process saw)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ropestep
from ropestep import atlas
from ropestep.reference import atlas as reference
from reference_walk import differences

pytestmark = [pytest.mark.model, pytest.mark.distributed]
SKIP = {"timings", "timing_seconds", "created_utc", "run", "hardware", "environment",
        "peak_rss_mib"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from test_protocol import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("distributed_model"))


def launch(module_args: list[str], nproc: int, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    src = str(Path(ropestep.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(nproc)]
    proc = subprocess.run(cmd + module_args + ["--out", str(out), "--threads", "1"],
                          cwd=out.parent, env=env, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def timeless(x):
    """``x`` without its wall-clock leaves (the oracle rows' ``exact_seconds``)."""
    if isinstance(x, dict):
        return {k: timeless(v) for k, v in x.items() if k != "exact_seconds"}
    if isinstance(x, list):
        return [timeless(v) for v in x]
    return x


def same(a: dict, b: dict) -> list[str]:
    """The top-level sections that differ (those of :data:`SKIP` aside, and the command line,
    whose ``--out`` differs by construction, compared without it)."""
    def argv(r: dict) -> list:
        c = list(r["command"])
        if r["run"]["world_size"] > 1:  # the torchrun line that reruns it (dist.launcher_command)
            assert c[:5] == ["torchrun", "--nnodes=1",
                             f"--nproc_per_node={r['run']['world_size']}", "-m",
                             "ropestep.cli"], c
            c = ["ropestep", *c[5:]]
        return c[:c.index("--out")] + c[c.index("--out") + 2:]

    diff = [k for k in sorted(set(a) | set(b)) if k not in SKIP | {"command"}
            and timeless(a.get(k)) != timeless(b.get(k))]
    return diff + (["command"] if argv(a) != argv(b) else [])


def test_the_recorded_command_names_the_launcher(monkeypatch):
    """A worker started by torchrun records the torchrun line that reruns it, nodes and
    processes per node from torchrun's environment; a plain process records its command."""
    from ropestep.dist import launcher_command

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE",
              "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    cmd = ["ropestep", "atlas", "--model", "m", "--out", "o"]
    assert launcher_command(cmd) == cmd
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launcher_command(cmd) == ["torchrun", "--nnodes=1", "--nproc_per_node=6", "-m",
                                     "ropestep.cli", *cmd[1:]]
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launcher_command(cmd)[:3] == ["torchrun", "--nnodes=3", "--nproc_per_node=2"]


def test_validate_with_one_two_and_three_processes(model_dir, tmp_path):
    args = ["-m", "ropestep.cli", "validate", "--model", str(model_dir), "--contexts", "3",
            "--queries", "4", "--prefix-len", "16", "--layers", "all", "--heads", "all",
            "--exact-rows", "1", "--seed", "5", "--quiet", "--no-figures"]
    # seed 5 draws the one oracle row in context 2 (query 5): the last rank's share
    reps = {n: launch(args, n, tmp_path / f"validate-{n}") for n in (1, 2, 3)}
    for n, rep in reps.items():
        assert rep["run"]["world_size"] == n
        assert sum(len(v) for v in rep["run"]["rank_contexts"].values()) == 3
        assert all(rep["run"]["rank_contexts"].values()), rep["run"]  # every rank worked
        assert rep["verdict"]["pass"], rep["verdict"]
    per_context = reps[3]["layers"]["0"]["real_heads"]["per_context"]
    assert any("exact_rows" in rec for rec in per_context[1:]), per_context
    assert same(reps[1], reps[2]) == [] and same(reps[1], reps[3]) == []


def test_atlas_with_three_processes(model_dir, tmp_path):
    args = ["-m", "ropestep.atlas", "--model", str(model_dir), "--contexts", "2", "--len", "40",
            "--layers", "all", "--anchor-every", "16", "--quiet", "--no-figures"]
    one, three = (launch(args, n, tmp_path / f"atlas-{n}") for n in (1, 3))
    assert three["run"]["world_size"] == 3 and all(three["run"]["rank_items"].values())
    assert same(one, three) == ["cost"]  # its seconds and rates are the machine's
    assert atlas.same_report(one, three)  # its counted work is the same
    for rep in (one, three):  # the seconds summed over the processes, the figures from them
        assert differences(rep["cost"], reference.cost_section(rep), 1e-12) == []


def test_heads_with_one_two_and_three_processes(model_dir, tmp_path):
    args = ["-m", "ropestep.heads", "--model", str(model_dir), "--quiet", "--no-figures"]
    reps = {n: launch(args, n, tmp_path / f"heads-{n}") for n in (1, 2, 3)}
    for n, rep in reps.items():
        assert rep["run"]["world_size"] == n
    assert same(reps[1], reps[2]) == [] and same(reps[1], reps[3]) == []
