"""The architecture matrix: every configuration of :mod:`ropestep.archzoo` through ``ropestep
atlas`` and ``ropestep validate`` against its own forward, and the adapter's reading of each
convention shown to matter (a wrong reading fails the run).

Each tiny model is built offline (weights redrawn so that scores are far from uniform, sinks
visible) and saved with a byte-level tokenizer; ``atlas`` and ``validate`` run on it as a user
would run them.  Supported architectures must pass every check (exit 0); the others must be
refused with one line naming the reason (exit 2) -- ``EXPECTED_REFUSALS`` says which and why,
and a configuration that starts passing (or failing) without this table changing is a failure.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

from ropestep import archzoo, cli, models, tolerances  # noqa: E402

# what is not modelled yet: per command, the words its one-line refusal must contain (a
# command not named here must pass every check)
EXPECTED_REFUSALS: dict[str, dict[str, str]] = {
    "doge": {"atlas": "per-head score bias through its attention mask (not affine",
             "validate": "per-head score bias through its attention mask (not affine"},
}
ATLAS = ["--contexts", "1", "--len", "40", "--layers", "all", "--anchor-every", "16",
         "--seed", "3", "--no-figures"]
VALIDATE = ["--corpus", "default", "--contexts", "1", "--queries", "5", "--prefix-len", "40",
            "--layers", "all", "--heads", "all", "--seed", "1", "--exact-rows", "0",
            "--quiet", "--no-figures"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, buf.getvalue()


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(archzoo.ARCHITECTURES))
def test_atlas_and_validate_on_every_architecture(name, zoo):
    d = archzoo.save(name, zoo / name)
    rc_a, out_a = _run(["atlas", "--model", str(d), *ATLAS, "--out", str(zoo / name / "atlas")])
    rc_v, out_v = _run(["validate", "--model", str(d), *VALIDATE,
                        "--out", str(zoo / name / "validate")])
    print(name, rc_a, rc_v, out_a.strip().splitlines()[-1:], out_v.strip().splitlines()[-1:])
    refused = EXPECTED_REFUSALS.get(name, {})
    for cmd, rc, out in (("atlas", rc_a, out_a), ("validate", rc_v, out_v)):
        assert "Traceback" not in out, out[-3000:]
        if cmd in refused:
            errors = [ln for ln in out.splitlines() if ": error: " in ln]
            assert rc == 2 and len(errors) == 1 and refused[cmd] in errors[0], out[-2000:]
        else:
            assert rc == 0, out[-3000:]


def test_at_least_twenty_architectures_pass():
    both = [n for n in archzoo.ARCHITECTURES if not EXPECTED_REFUSALS.get(n)]
    assert len(both) >= 20
    assert set(EXPECTED_REFUSALS) <= set(archzoo.ARCHITECTURES)


# ---------------------------------------------------------------------------------------------
# a wrong reading of each convention fails the run
# ---------------------------------------------------------------------------------------------
def _validate_fails(model_dir: Path, out: Path) -> str:
    """A failed check (exit 1) or a refusal naming what disagrees (exit 2) -- never a pass."""
    rc, text = _run(["validate", "--model", str(model_dir), *VALIDATE, "--out", str(out)])
    assert rc in (1, 2) and "Traceback" not in text, text[-3000:]
    return text


WRONG = {  # reading -> (architecture that uses it, how a layer's reading is corrupted, given
    # the model's first rotated layer)
    "scale": ("granite", lambda c, r: {"scaling": c.scaling * 1.01}),
    "amplitude": ("llama_yarn", lambda c, r: {"amplitude": 1.0}),
    "pairing": ("cohere", lambda c, r: {"pairing": "half"}),
    "rotary_fraction": ("stablelm", lambda c, r: {"rotary_dim": c.rotary_dim * 2,
                                                  "inv_freq": c.inv_freq * 2}),
    "softcap": ("gemma2", lambda c, r: {"softcap": None}),
    "window": ("mistral", lambda c, r: {"window": None}),
    "window_width": ("gemma2", lambda c, r: {} if c.window is None else {"window": c.window + 1}),
    "no_rope_layer": ("smollm3", lambda c, r: {k: getattr(r, k) for k in (
        "rotary", "rotary_dim", "tables", "inv_freq")} if c.rotary_dim == 0 else {}),
    "qk_norm": ("qwen3", lambda c, r: {"qk_norm": False}),  # validate in input space, unnormalised
    "norm_scope": ("olmo2", lambda c, r: {"norm_scope": "head"}),  # per head, not over all heads
}


@pytest.mark.parametrize("what", sorted(WRONG))
def test_a_wrong_reading_fails_validate(what, zoo, monkeypatch):
    from dataclasses import replace

    from ropestep.models import conventions as conv_mod

    name, corrupt = WRONG[what]
    d = archzoo.save(name, zoo / f"wrong-{what}")
    real = conv_mod._read_model

    def wrong(model, info):
        out = real(model, info)
        rotated = next(c for c in out.layers if c.rotary_dim)
        layers = [replace(c, **corrupt(c, rotated)) for c in out.layers]
        return replace(out, layers=tuple(layers))

    monkeypatch.setattr(conv_mod, "_read_model", wrong)
    text = _validate_fails(d, zoo / f"wrong-{what}" / "validate")
    assert "FAIL" in text or ": error: " in text


def test_a_wrong_layout_is_refused(zoo, monkeypatch):
    """Phi-3's fused rows read as [k; q; v]: no candidate reproduces the layer's queries."""
    from ropestep.models import layouts

    d = archzoo.save("phi3", zoo / "wrong-layout")

    def swapped(attn, H, Hk, dd, r):
        got = layouts.fused(attn, H, Hk, dd, r)
        return None if got is None else {"q": got["k"], "k": got["q"], "v": got["v"]}

    monkeypatch.setitem(layouts.LAYOUTS, "fused", swapped)
    rc, text = _run(["validate", "--model", str(d), *VALIDATE, "--out", str(zoo / "wl")])
    assert rc == 2 and "no projection layout and rotation reproduces" in text, text[-2000:]


def test_query_space_reuse_is_the_input_space_reuse(monkeypatch):
    """The atlas's frozen reuse for QK-norm heads (query space: query i's effective query
    before rotation -- normalised and scaled -- rotated to the anchor's position) is, on an
    affine head, the input-space form ``u_i^T L_a`` of docs/math.md section 6: run one layer
    both ways and compare every reuse error (and check the input-space statistics are left out).
    """
    from ropestep import layercheck, scale
    from ropestep.spec import HeadSpec

    model = archzoo.build("llama")
    n = 40
    ids = torch.randint(0, archzoo.VOCAB, (n,), generator=torch.Generator().manual_seed(2))
    cap = models.capture(model, ids, [1])[1]
    spec, w = models.layer_head(model, 1, n)
    x, pos = cap.x.double(), torch.arange(n)
    kw = dict(layer=1, anchor_every=8)
    ref = layercheck.evaluate_layer(spec, w, x, pos, cap.heads, **kw)
    real_project = scale.project_layer

    def no_lw(*a, **k):
        L = real_project(*a, **k)
        L.lw = L.lwt = None
        return L

    monkeypatch.setattr(scale, "project_layer", no_lw)
    monkeypatch.setattr(HeadSpec, "affine", property(lambda self: False))
    qs = layercheck.evaluate_layer(spec, w, x, pos, cap.heads, **kw)
    assert np.isnan(qs.arrays["lam_input"]).all()
    for key in ("reuse_frozen", "reuse_const", "reuse_mean", "tv"):
        a, b = ref.arrays[key], qs.arrays[key]
        fin = np.isfinite(a)
        assert np.array_equal(fin, np.isfinite(b))
        scale_ = float(np.abs(a[fin]).max())
        tol = 8 * tolerances.agreement_rel_tol(torch.float64, n, spec.head_dim, x.shape[1])
        assert float(np.abs(a[fin] - b[fin]).max()) <= tol * scale_, key
    assert float(np.nanmax(ref.arrays["reuse_frozen"])) > 0


def test_soft_capped_atlas_says_what_is_not_defined(zoo):
    """Gemma 2's soft-capped layers: the identity, gauges, native comparisons and reuse are
    checked; the unit step's descent statistics (derived for ``phi = id``) are reported as not
    defined, with the reason, and left out of the replication-style count."""
    import json

    d = archzoo.save("gemma2", zoo / "gemma2-atlas")
    rc, out = _run(["atlas", "--model", str(d), *ATLAS, "--out", str(zoo / "g2a")])
    assert rc == 0, out[-3000:]
    rep = json.loads((zoo / "g2a" / "report.json").read_text())
    for L, lay in rep["layers"].items():
        assert "phi = id" in lay["descent"]
        for h in lay["heads"]:
            assert h["lambda_max_query_space"] == {"median": None, "max": None}
            assert h["step_increases_E_query_space"] is None
            assert h["checks"]["identity_float64"] and h["checks"]["float64_vs_native"]
    assert rep["replication_style_descent"]["pooled"]["heads"] == 0


@pytest.mark.parametrize("name", ["phi3", "gpt_neox", "cohere", "mistral", "gemma2", "qwen3",
                                  "olmo2", "llama_yarn"])
def test_heads_and_sweep_accept_the_architectures(name, zoo):
    """``ropestep heads`` (weights) and ``ropestep sweep`` (the identity and the model's own
    output on captured layers) open what the adapter opens: every layout, rotary fraction,
    pairing, window, soft-cap and QK-norm scope."""
    d = archzoo.save(name, zoo / f"hs-{name}")
    rc, out = _run(["heads", "--model", str(d), "--layers", "all", "--no-figures", "--quiet",
                    "--out", str(zoo / f"hs-{name}" / "heads")])
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    rc, out = _run(["sweep", "--model", str(d), "--contexts", "40", "--layers", "0", "1",
                    "--out", str(zoo / f"hs-{name}" / "sweep")])
    assert rc == 0 and "PASS" in out, out[-3000:]


@pytest.mark.parametrize("name", ["llama3", "llama_linear", "qwen2_yarn"])
def test_a_wrong_rope_type_fails_validate(name, zoo, monkeypatch):
    """The RoPE tables read as the unscaled ``base^(-2l/d)`` ones (the rope type ignored) while
    everything else is read right: the run fails on the model's own outputs."""
    from ropestep.models import conventions as conv_mod

    d = archzoo.save(name, zoo / f"wrong-rope-{name}")
    real = conv_mod.rope_tables

    def default_tables(model, n_positions, layer=0, *, info=None):
        c, s = real(model, n_positions, layer, info=info)
        hd = c.shape[-1] * 2
        theta = float(model.config.rope_parameters["rope_theta"])
        inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv[None]
        return ang.cos().to(c.dtype), ang.sin().to(s.dtype)

    monkeypatch.setattr(conv_mod, "rope_tables", default_tables)
    text = _validate_fails(d, zoo / f"wrong-rope-{name}" / "validate")
    assert "FAIL" in text or ": error: " in text


def test_a_window_wider_than_the_first_forward_is_read_from_a_second():
    """Mistral with a 40-key window: the 24-token reading forward cannot show it, so the layers'
    masks over 41 tokens are read too."""
    from transformers import AutoModelForCausalLM

    from ropestep.models import conventions as conv_mod

    config = archzoo.ARCHITECTURES["mistral"].config()
    config.sliding_window = 40
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert 40 > conv_mod.PROBE_TOKENS
    info = models.describe_model(model)
    assert [c.window for c in info.layers] == [40, 40]
    spec, _ = models.layer_head(model, 0, 64, info=info)
    assert spec.window == 40  # (a named window the masks do not apply: test_adapter)
