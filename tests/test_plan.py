"""``ropestep atlas --plan``: memory and counted work from a model's config alone.

The configurations are Llama 3 8B and 70B (their published sizes, llama3 RoPE scaling) written
as bare ``config.json`` files: no weight exists, so a plan that tried to load one would fail.
The counts are :func:`ropestep.cost.atlas_flops` per item times the items; the parameter counts
are the model's own (built on the meta device), checked against the published 8.03 B and 70.55 B.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ropestep import atlas, cli, cost

pytestmark = pytest.mark.model
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0}
SHAPES = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32),
          "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64)}


def config_dir(root: Path, size: str) -> Path:
    transformers = pytest.importorskip("transformers")
    path = root / f"llama3-{size}"
    transformers.LlamaConfig(vocab_size=128256, num_key_value_heads=8,
                             max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE,
                             tie_word_embeddings=False, **SHAPES[size]).save_pretrained(path)
    assert not list(path.glob("*.safetensors"))
    return path


@pytest.mark.parametrize("size, params, layers", [("8b", 8.03e9, 32), ("70b", 70.55e9, 80)])
def test_plan_from_config_alone(tmp_path, capsys, size, params, layers):
    model = config_dir(tmp_path, size)
    assert cli.main(["atlas", "--plan", "--model", str(model), "--contexts", "4", "--len", "512",
                     "--max-memory", "cpu=16GiB"]) == 0
    out = capsys.readouterr().out
    assert f"{params / 1e9:.2f} B parameters, {layers} layers" in out
    assert "resident" in out and "estimated peak" in out and "floor" in out
    p = atlas.plan(atlas.AtlasConfig(model=str(model), contexts=4, length=512), 16 * 2 ** 30)
    assert abs(p["model"]["parameters"] - params) < 0.005e9
    assert p["memory_bytes"]["weights"] == 4 * p["model"]["parameters"]
    assert p["memory_bytes"]["weights_resident"] == min(16 * 2 ** 30, 4 * p["model"]["parameters"])
    head_dim = SHAPES[size]["hidden_size"] // SHAPES[size]["num_attention_heads"]
    one = cost.atlas_flops(N=512, d=head_dim, r=head_dim, m=SHAPES[size]["hidden_size"],
                           H=SHAPES[size]["num_attention_heads"], H_kv=8)
    for k, v in one.items():
        assert p["phases"][k.replace("lowp", "float32")]["flops"] == v * 4 * layers


def test_counts_by_brute_force():
    """The closed forms of :func:`ropestep.cost.atlas_flops` against a sum over every query of
    a causal context (and of a sliding window)."""
    N, d, r, m, H, Hk = 37, 8, 6, 20, 4, 2
    for window in (None, 5):
        n = [min(i + 1, window or N) for i in range(N)]
        # the atlas's five Lanczos steps from a start vector (d = 8 > 5), its norm 2d
        lam = cost.lambda_max_flops(d, cost.ATLAS_LANCZOS_STEPS, started=True)
        assert lam == 5 * (2 * 64 + 32) + 4 * 8 * 5 * 6 + 2 * 64 + 8 / 3 * 216 + 16
        streamed = H * sum(2 * k * d + 2 * k * d * r + 2 * k * r for k in n)
        # query space: G (2 k d^2), the start g = sum_j c_j k_j (2 k d), G T (2 d^2 r),
        # <T, G T> and ||T||^2 (2 d r each)
        step = H * sum(2 * k * d * d + 2 * k * d + lam + 2 * d * d * r + 4 * d * r for k in n)
        # input space: M (4 d^3), its start B^T g (2 d^2), Y = B^T T and M Y (2 d^2 r each),
        # <Y, M Y> and ||Y||^2
        inp = H * N * (4 * d ** 3 + 2 * d * d + lam + 4 * d * d * r + 4 * d * r)
        reuse = H * N * (2 * (m + 1) * d + 2 * d * r)
        got = cost.atlas_flops(N=N, d=d, r=r, m=m, H=H, H_kv=Hk, window=window)
        assert got["lowp_maxkey"] == got["float64_maxkey"] == streamed
        assert got["float64_original"] == pytest.approx(streamed + step + inp + reuse, rel=1e-14)
        capped = cost.atlas_flops(N=N, d=d, r=r, m=m, H=H, H_kv=Hk, window=window, softcap=True)
        assert capped["float64_original"] == pytest.approx(streamed + reuse, rel=1e-14)
        assert got["project"] == 2 * N * (m + 1) * (H * d + Hk * d + Hk * r)


def test_plan_bad_input(tmp_path, capsys):
    assert cli.main(["atlas", "--plan", "--model", str(tmp_path / "absent")]) == 2
    assert cli.main(["atlas", "--model", str(tmp_path / "absent")]) == 2  # no --out, no --plan
    err = capsys.readouterr().err
    assert "--out DIR is required" in err
