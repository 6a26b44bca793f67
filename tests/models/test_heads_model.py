"""``ropestep heads`` on the tiny random Qwen2 saved to disk (fixture ``tiny_qwen2``).

The report's numbers are checked against the model's own ``nn.Linear`` weights read here
(``q_proj``/``k_proj`` rows, PyTorch layout ``(out, in)``) with numpy alone: SVD per head, band
energy per RoPE pair of the split-half layout (rows ``l`` and ``l + d/2``), the barycenter with
KV head ``h // 7``.  Exit codes: 0 on the model, 1 when a head's W_q is zero (its condition
number is NaN), 2 on a missing model or bad ``--layers``.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from ropestep import heads  # noqa: E402
from ropestep import tolerances as tl  # noqa: E402
from test_reports_portable import absolute_paths  # noqa: E402

pytestmark = pytest.mark.model


def _linear_heads(lin: torch.nn.Linear, n: int, d: int) -> np.ndarray:
    """``(n, d, m)``: the Linear rows of each head (float64)."""
    return lin.weight.detach().double().numpy().reshape(n, d, -1)


def test_tiny_qwen2_report_against_the_linear_weights(tiny_qwen2, tmp_path, one_thread):
    out = tmp_path / "heads"
    code = heads.main(["--model", str(tiny_qwen2.path), "--out", str(out), "--quiet"])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert md.startswith("# Heads") and "| layer | head | KV |" in md
    assert sorted(p.name for p in (out / "figures").iterdir()) == sorted(
        [f"heatmap_{n}.png" for n, _, _ in heads.HEATMAPS] + ["band_energy.png"])
    assert rep["verdict"] == {"passed": True, "failed": []}
    assert absolute_paths((out / "report.json").read_text() + md) == []
    assert rep["model"]["config_sha256"] and rep["model"]["weights_sha256"]
    fa = rep["frequency_axis"]
    assert fa["decreasing"] and fa["fastest_pair"] == 0
    # read back from the model's float32 tables: one rounding of cos and sin each
    assert abs(fa["omega_pair0"] - 1.0) <= 2 * tl.unit_roundoff(torch.float32)
    H, Hk, d = 14, 2, 64
    group = H // Hk
    built = tiny_qwen2.built
    for L in (0, 1):
        attn = built.model.layers[L].self_attn
        q, k = _linear_heads(attn.q_proj, H, d), _linear_heads(attn.k_proj, Hk, d)
        lr = rep["layers"][str(L)]
        assert [g["query_heads"] for g in lr["kv_heads"]] == [list(range(7)), list(range(7, 14))]
        for g in range(Hk):
            sv = np.linalg.svd(k[g], compute_uv=False)
            got = lr["kv_heads"][g]["w_k"]
            assert abs(got["cond"] / (sv[0] / sv[-1]) - 1) <= tl.FLOAT64_REL
        for h in range(H):
            got = lr["query_heads"][h]
            sv = np.linalg.svd(q[h], compute_uv=False)
            p = sv / sv.sum()
            assert abs(got["w_q"]["cond"] / (sv[0] / sv[-1]) - 1) <= tl.FLOAT64_REL
            assert abs(got["w_q"]["effective_rank"] / np.exp(-(p * np.log(p)).sum()) - 1) \
                <= tl.FLOAT64_REL
            rows2 = (q[h] ** 2).sum(1)
            band = rows2[: d // 2] + rows2[d // 2:]  # split halves: rows l and l + d/2
            assert np.max(np.abs(np.array(got["w_q"]["band_energy_fraction"])
                                 - band / band.sum())) <= tl.FLOAT64_REL
            imp = np.linalg.norm(q[h], axis=1) + np.linalg.norm(k[h // group], axis=1)
            ell = np.arange(d) % (d // 2)
            t = float((imp * ell).sum() / imp.sum()) / (d // 2 - 1)
            assert got["kv_head"] == h // group
            assert abs(got["barycenter"] - t) <= tl.FLOAT64_REL
            assert abs(got["barycenter_base"] / (1e3 ** (1 - t) * 1e6 ** t) - 1) <= tl.FLOAT64_REL


def test_a_zero_query_head_exits_1_naming_it(build_tiny, tmp_path, capsys, one_thread):
    model = build_tiny("qwen2", seed=0)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[3 * 64:4 * 64] = 0.0
    path = tmp_path / "zero_head"
    model.save_pretrained(path)
    out = tmp_path / "heads"
    assert heads.main(["--model", str(path), "--layers", "1", "--out", str(out), "--quiet",
                       "--no-figures"]) == 1
    err = capsys.readouterr().err
    print(err)
    assert "FAIL layer 1 query head 3: cond(W_q) = nan" in err
    assert "query head 2" not in err
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"]["passed"] is False and sorted(rep["layers"]) == ["1"]


@pytest.mark.parametrize("args, what", [
    (["--layers", "5"], "layer 5 out of range"),
    (["--layers", "one"], "--layers must be"),
    (["--base-min", "1e6", "--base-max", "1e3"], "base_min <= base_max"),
])
def test_bad_input_exits_2_with_one_line(tiny_qwen2, tmp_path, capsys, args, what):
    out = tmp_path / "bad"
    assert heads.main(["--model", str(tiny_qwen2.path), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    print(err)
    ours = [line for line in err.splitlines() if line.startswith("ropestep heads")]
    assert len(ours) == 1 and what in ours[0] and "Traceback" not in err
    assert not out.exists()


def test_missing_model_exits_2(tmp_path, capsys):
    out = tmp_path / "bad"
    assert heads.main(["--model", str(tmp_path / "no_such_model"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("ropestep heads")]
    assert len(ours) == 1 and "does not exist" in ours[0] and "Traceback" not in err
    assert not out.exists()
