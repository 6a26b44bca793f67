"""Multi-process sweep (ropestep.sweep): torchrun with gloo on CPU gives the single-process report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ropestep import sweep
from ropestep import tolerances as tl

SYNTH = ["--contexts", "96", "150", "64", "--layers", "0", "1", "2", "--seed", "3"]


def _run(args: list[str], nproc: int | None, cwd: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    src = str(Path(sweep.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = cwd / f"report-{nproc or 1}.json"
    if nproc is None:
        cmd = [sys.executable, "-m", "ropestep.sweep"]
    else:  # torchrun, spelled as the module so the test's interpreter is used
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), "-m", "ropestep.sweep"]
    proc = subprocess.run(cmd + args + ["--out", str(out)], cwd=cwd, env=env, timeout=150,
                          capture_output=True, text=True)
    print(proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_shard_covers_every_item_once():
    items = list(range(11))
    for world in (1, 2, 3, 5):
        got = sorted(i for r in range(world) for i in sweep.shard(items, r, world))
        assert got == items
    with pytest.raises(ValueError):
        sweep.shard(items, 2, 2)
    assert sweep.hash_seed(0, "layer", 1) == sweep.hash_seed(0, "layer", 1)
    assert sweep.hash_seed(0, "layer", 1) != sweep.hash_seed(0, "context", 1)


@pytest.mark.distributed
def test_torchrun_two_ranks_gloo_same_report(tmp_path):
    one = _run(SYNTH, None, tmp_path)
    two = _run(SYNTH, 2, tmp_path)
    assert two["run"]["world_size"] == 2 and two["run"]["backend"] == "gloo"
    assert one["run"]["world_size"] == 1
    # both ranks really worked, on disjoint shares covering all 9 items
    shares = two["run"]["rank_items"]
    assert set(shares) == {"0", "1"} and all(shares.values())
    assert sorted(map(tuple, shares["0"] + shares["1"])) == [(c, l) for c in range(3)
                                                             for l in range(3)]
    assert [(i["context"], i["layer"]) for i in one["items"]] == \
        [(c, l) for c in range(3) for l in range(3)]
    # identical numbers, sorted by item: each item is computed by one process from its own
    # seeds, with the same shapes and the same thread count (--threads, default 1), so the same
    # operations in the same order -- bitwise equality is the claim, not a tolerance
    assert sweep.same_report(one, two)
    assert len(one["items"][0]["heads"]["max_rel"]) == 4
    assert one["pass"] and two["pass"] and one["failures"] == []  # the verdict is in the report
    d = one["config"]["head_dim"]
    for it in one["items"]:
        # float64 softmax output against the readout: two orders of the same sums
        tol = tl.agreement_rel_tol(torch.float64, it["length"], d)
        assert it["pass"] and it["tol_identity"] == tol and it["max_rel"] <= tol


@pytest.mark.model
@pytest.mark.distributed
def test_model_sweep_with_device_map(tmp_path):
    """A tiny random Qwen2 saved to disk, loaded with device_map, 1 and 2 processes."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen2", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.normal_(0, 0.2)
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "tiny")
    args = ["--model", str(tmp_path / "tiny"), "--device-map", "cpu", "--layers", "0", "1",
            "--contexts", "48", "80"]
    one = _run(args, None, tmp_path)
    two = _run(args, 2, tmp_path)
    assert sweep.same_report(one, two)
    d, m = cfg.hidden_size // cfg.num_attention_heads, cfg.hidden_size
    for it in one["items"]:
        # the recomputed softmax output is the model's own (float32 forward), the identity holds
        # to float64 agreement: both derived for the item's sizes, not read from the report
        n = it["length"]
        assert it["tol_native"] == tl.native_rel_tol(n, d, m)
        assert it["tol_identity"] == tl.agreement_rel_tol(torch.float64, n, d)
        assert it["pass"] and it["y_vs_model_rel"] <= it["tol_native"]
        assert it["max_rel"] <= it["tol_identity"]
