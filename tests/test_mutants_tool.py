"""Mutation testing: the tool (``tools/mutants.py``) and the tests that kill its survivors.

* ``test_tool_*``: the tool itself -- a mutant is applied to a temporary copy and never to the
  working tree, a stale snippet is detected, a cheap real mutant is killed (and the killing test
  recorded), the report renders without machine paths, bad input exits 2.  Deselected by the
  mutmut selection (``-k "not test_tool_"`` in ``[tool.mutmut]``): they test the tool, not the
  library.
* ``test_kills_*``: tests written to kill mutants that survived the rest of the suite (named in
  ``mutation/report.md``).  Each compares with an independent value -- the mpmath oracle, a
  hand-computed number or the model's own forward -- never with the fast code itself.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ropestep import tolerances

REPO = Path(__file__).resolve().parents[1]
U32 = 2.0 ** -24  # float32 unit roundoff


def _load_tool():
    spec = importlib.util.spec_from_file_location("ropestep_mutants_tool",
                                                  REPO / "tools" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool():
    return _load_tool()


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "src").rglob("*.py"))}


# ---------------------------------------------------------------------------------------------
# the tool
# ---------------------------------------------------------------------------------------------
def test_tool_every_named_mutant_resolves(tool):
    """Each snippet occurs exactly once in today's source: the list cannot rot silently."""
    bad = {}
    for m in tool.MUTANTS:
        r = tool.resolve(m)
        if r.count != 1:
            bad[m.name] = f"{r.path}: {r.count} occurrences"
    assert not bad, bad
    assert 30 <= len(tool.MUTANTS) <= 60
    tool.check_list(tool.MUTANTS)


def test_tool_apply_touches_the_copy_only(tool, tmp_path):
    before = _tree_digest(REPO)
    m = next(m for m in tool.MUTANTS if m.name == "uniform-mean-chunk-count")
    copy_ = tool.make_copy(tmp_path / "copy")
    r = tool.resolve(m, copy_)
    tool.apply_mutant(copy_, r)
    text = (copy_ / r.path).read_text()
    assert m.replacement in text and m.original not in text
    assert _tree_digest(REPO) == before  # the working tree is untouched
    with pytest.raises(RuntimeError, match="refusing"):
        tool.apply_mutant(REPO, tool.resolve(m))
    assert _tree_digest(REPO) == before


def test_tool_stale_and_ambiguous_snippets_are_detected(tool, capsys):
    stale = tool.Mutant("gone", "kernel.py", "this code was rewritten()", "x", "nothing")
    amb = tool.Mutant("twice", "kernel.py", "torch.", "np.", "nothing")
    assert tool.resolve(stale).count == 0 and tool.resolve(stale).line is None
    assert tool.resolve(amb).count > 1
    assert tool.main(["--list"], mutants=[stale]) == 1
    assert "STALE" in capsys.readouterr().out
    assert tool.main(["--list"], mutants=[amb]) == 1
    assert "AMBIGUOUS" in capsys.readouterr().out
    ok = next(m for m in tool.MUTANTS if m.name == "phi1-naive-exp-minus-one")
    assert tool.main(["--list"], mutants=[ok]) == 0


def test_tool_bad_input_exits_2(tool, capsys):
    assert tool.main(["--no-such-flag"]) == 2
    assert tool.main(["--list", "--only", "no-such-mutant"]) == 2
    assert tool.main(["--semantic", "--timeout", "0"]) == 2
    same = tool.Mutant("noop", "kernel.py", "a", "a", "nothing")
    assert tool.main(["--list"], mutants=[same]) == 2
    assert "tools/mutants.py:" in capsys.readouterr().err


def test_tool_cheap_real_mutant_is_killed_and_the_killer_recorded(tool, tmp_path):
    """The uniform mean divided by N instead of N_i, against one oracle test (~10 s)."""
    m = next(m for m in tool.MUTANTS if m.name == "uniform-mean-chunk-count")
    base = tool.make_copy(tmp_path / "base")
    mut = tool.make_copy(tmp_path / "mut")
    tool.apply_mutant(mut, tool.resolve(m, mut))
    rec = tmp_path / "rec"
    ok = tool.run_proc(tool.pytest_cmd(m.tests), base, tool.child_env(base, "quick", rec), 300)
    assert ok.rc == 0, ok.output[-2000:]
    assert not (rec / "run").exists()
    bad = tool.run_proc(tool.pytest_cmd(m.tests), mut, tool.child_env(mut, "quick", rec), 300)
    assert bad.rc == 1, bad.output[-2000:]
    assert (rec / "run").read_text() == m.tests[0]
    assert tool.first_failure(bad.output) == m.tests[0]


@pytest.mark.slow
def test_tool_semantic_run_end_to_end(tool, tmp_path):
    """The whole semantic path on two mutants: probe, baseline, run, report (~40 s)."""
    m = next(m for m in tool.MUTANTS if m.name == "uniform-mean-chunk-count")
    stale = tool.Mutant("gone", "kernel.py", "this code was rewritten()", "x", "nothing",
                        tests=m.tests)
    out = tmp_path / "out"
    code = tool.main(["--semantic", "--out", str(out)], mutants=[m, stale])
    assert code == 1  # the stale mutant fails the command
    rep = json.loads((out / "report.json").read_text())
    rows = {r["name"]: r for r in rep["parts"]["semantic"]["mutants"]}
    assert rows["uniform-mean-chunk-count"]["status"] == "killed"
    assert rows["uniform-mean-chunk-count"]["killed_by"] == m.tests[0]
    assert rows["gone"]["status"] == "stale"
    assert str(tmp_path) not in (out / "report.json").read_text().replace(str(out), "")
    assert "| semantic | 2 | 1 | 0 | 0 | 0 | 1 |" in (out / "report.md").read_text()


def _fake_parts():
    sem = [{"id": "S01", "name": "a", "file": "src/ropestep/kernel.py", "line": 3,
            "description": "wrong | thing", "status": "killed", "killed_by": "tests/t.py::x",
            "seconds": 1.0},
           {"id": "S02", "name": "b", "file": "src/ropestep/kernel.py", "line": 9,
            "description": "same thing", "status": "equivalent", "killed_by": None,
            "seconds": 2.0, "equivalent_reason": "symmetric"},
           {"id": "S03", "name": "c", "file": "src/ropestep/rope.py", "line": 1,
            "description": "sign", "status": "survived", "killed_by": None, "seconds": 2.0}]
    mm = [{"id": "ropestep.kernel.x_phi1__mutmut_1", "name": "kernel.x_phi1__mutmut_1",
           "file": "src/ropestep/kernel.py", "function": "kernel.phi1", "line": 70,
           "description": "a + b  ->  a - b", "mutmut_status": "killed", "status": "killed",
           "killed_by": "tests/test_phi1.py::test_x[1]"},
          {"id": "ropestep.kernel.x_phi1__mutmut_2", "name": "kernel.x_phi1__mutmut_2",
           "file": "src/ropestep/kernel.py", "function": "kernel.phi1", "line": 71,
           "description": "'x'  ->  'XXxXX'", "mutmut_status": "survived",
           "status": "equivalent", "killed_by": None, "equivalent_reason": "message text"}]
    return {"semantic": {"tool": "t", "hypothesis_profile": "quick", "per_mutant_timeout_s": 60,
                         "imported_from": "copy", "runtime_s": 3.0, "mutants": sem,
                         "summary": None},
            "mutmut": {"tool": "mutmut", "config": {"only_mutate": ["src/ropestep/kernel.py"]},
                       "hypothesis_profile": "quick", "retry_profile": "ci",
                       "first_pass": {"killed": 1, "survived": 1}, "runtime_s": 5.0,
                       "mutants": mm, "summary": None}}


def test_tool_report_renders_without_machine_paths(tool, tmp_path):
    parts = _fake_parts()
    for p in parts.values():
        p["summary"] = tool.summarize(p["mutants"])
    assert parts["semantic"]["summary"]["kill_rate"] == 0.5  # 1 killed / (3 - 1 equivalent)
    assert tool.exit_status(parts) == 1  # a survivor
    argv = ["--semantic", "--out", str(tool.REPO / "mutation")]
    rep = tool.scrub(tool.build_report(parts, argv, 0.0, 1), [str(tmp_path), str(tool.REPO)])
    assert rep["command"] == "python tools/mutants.py --semantic --out mutation"
    assert rep["summary"]["total"] == 5 and rep["summary"]["killed"] == 2
    assert rep["summary"]["kill_rate"] == round(2 / 3, 4)  # 2 killed / (5 - 2 equivalent)
    tool.write_report(rep, tmp_path / "out")
    text = (tmp_path / "out" / "report.json").read_text()
    assert str(tool.REPO) not in text and json.loads(text)["schema"] == tool.SCHEMA
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| semantic | 3 | 1 | 1 | 1 | 0 | 0 | 0 | 50.0% |" in md
    assert "| all | 5 | 2 | 1 | 2 | 0 | 0 | 0 | 66.7% |" in md
    assert "wrong \\| thing" in md and "`kernel.phi1`" in md and "message text" in md
    parts["semantic"]["mutants"][2]["status"] = "killed"
    assert tool.exit_status(parts) == 0


def test_tool_mutmut_config_and_diffs(tool, tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.mutmut]\nsource_paths = ["src"]\ndebug = true\n\n'
        '[tool.other]\na = 1\n')
    tool.write_mutmut_config(tmp_path, {"source_paths": ["src"], "timeout_multiplier": 300.0,
                                        "pytest_add_cli_args": ["-p", "x"], "debug": False})
    import tomllib

    cfg = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    assert cfg["tool"]["mutmut"] == {"source_paths": ["src"], "timeout_multiplier": 300.0,
                                     "pytest_add_cli_args": ["-p", "x"], "debug": False}
    assert cfg["tool"]["other"] == {"a": 1} and cfg["project"]["name"] == "x"
    orig = tmp_path / "kernel.py"
    orig.write_text("import math\n\n\ndef f(x):\n    y = x + 1\n    return y * 2\n")
    mutated = tmp_path / "kernel_mutated.py"
    mutated.write_text(
        "import math\n\n\ndef x_f__mutmut_orig(x):\n    y = x + 1\n    return y * 2\n\n\n"
        "def x_f__mutmut_1(x):\n    y = x - 1\n    return y * 2\n\n\n"
        "def x_f__mutmut_2(x):\n    y = x + 1\n    return y / 2\n")
    d = tool.mutmut_diffs(mutated, orig, "src/ropestep/kernel.py")
    assert d["ropestep.kernel.x_f__mutmut_1"] == {"function": "kernel.f", "line": 5,
                                                   "before": "y = x + 1", "after": "y = x - 1"}
    assert d["ropestep.kernel.x_f__mutmut_2"]["line"] == 6


# ---------------------------------------------------------------------------------------------
# tests that kill specific mutants
# ---------------------------------------------------------------------------------------------
def _tiny_model():
    """A seeded one-layer Qwen2 (split-half RoPE, GQA 4 -> 2, biases) in float64, eager."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        a = model.model.layers[0].self_attn
        for lin, std in ((a.q_proj, 0.4), (a.k_proj, 0.4), (a.v_proj, 0.3)):
            lin.weight.normal_(0.0, std, generator=g)
            lin.bias.normal_(0.0, 0.5, generator=g)
    return model.double()


@pytest.mark.model
def test_kills_adapter_layout_and_tables():
    """``models.layer_head`` describes the model's own attention: the formula on its spec and
    weights reproduces the heads of the model's eager forward, run in float64.

    Tolerance: Hugging Face's eager attention takes the softmax in float32
    (``softmax(..., dtype=torch.float32)``) even in a float64 model, so each attention weight
    carries the rounding of its score to float32 (absolute ``u32 |s|`` in the exponent, twice
    through the normalisation) and a few roundings of its own, relative: ``|y_model - y| <=
    (4 + 2 max|s|) u32 max|v|``; we allow ``(8 + 2 max|s|) u32 max|v|`` with ``max|s|`` bounded
    by Cauchy-Schwarz on the model's own projections.  The rest is float64.  Kills an adapter that
    declares interleaved pairs for a ``rotate_half`` model, or reads its RoPE tables at shifted
    positions (errors of the order of max|v|)."""
    from ropestep import fast, models

    model = _tiny_model()
    n = 48
    ids = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(2))
    cap = models.capture(model, ids, [0])[0]
    spec, w = models.layer_head(model, 0, n)
    assert cap.x.dtype == torch.float64
    pos = np.arange(n)
    st = fast.step(spec, w, cap.x, pos, cap.x, pos, "causal", gauge="maxkey")
    heads = cap.heads.permute(1, 0, 2)  # (H, n, r)
    # values and a score bound from the model's own projections (nn.Linear, float64);
    # RoPE preserves norms, so |s_ij| <= scaling * max_i |q_i| * max_j |k_j| per head
    attn = model.model.layers[0].self_attn
    H, d = spec.n_heads, spec.head_dim
    with torch.no_grad():
        v = attn.v_proj(cap.x)
        qn = attn.q_proj(cap.x).view(n, H, d).norm(dim=-1).amax(0)  # (H,)
        kn = attn.k_proj(cap.x).view(n, H // spec.group, d).norm(dim=-1).amax(0)
    vmax = float(v.abs().max())
    smax = float((qn * kn.repeat_interleave(spec.group)).max()) * attn.scaling
    bound = (8 + 2 * smax) * U32 * vmax
    err = float((st.y - heads).abs().max())
    err_id = float((st.readout - heads).abs().max())
    print(f"formula vs model forward: y {err:.2e}, identity readout {err_id:.2e}, "
          f"bound {bound:.2e} (max|s| <= {smax:.1f})")
    assert err <= bound and err_id <= bound


def test_kills_rope_helper_arguments():
    """The RoPE helpers honour ``head`` (per-head bases), ``dtype``, the default derivative order
    1 and order 0, and convert any array-like input to float64 -- against the mpmath oracle
    (``exact.rotation``, ``exact.generator``, ``exact.phi1_matrix`` at 40 digits)."""
    import mpmath as mp

    from ropestep import exact, fast
    from ropestep.spec import HeadSpec, RoPESpec

    d, p, delta, head, base = 4, 7, 3, 1, 1000.0
    spec = HeadSpec(2, 1, d, rope=RoPESpec(base=(10.0, base), layout="half"))
    with mp.workdps(40):
        A = exact.generator(base, d, "half")
        R, F = exact.rotation(p, base, d, "half"), exact.phi1_matrix(delta * A)
    R, A, F = (np.array(M.tolist(), dtype=float) for M in (R, A, F))
    for dtype, tol in ((torch.float64, tolerances.FLOAT64_REL),
                       (torch.float32, 4 * float(torch.finfo(torch.float32).eps))):
        got = (fast.rope_rotation(spec, p, head, dtype), fast.rope_generator(spec, head, dtype),
               fast.rope_phi1(spec, delta, head, dtype))
        for g, ref in zip(got, (R, A, F)):
            assert g.dtype == dtype
            assert np.abs(g.double().numpy() - ref).max() <= tol * np.abs(ref).max()
    z0 = [1, -2, 3, 5]  # integers: converted to float64, not kept as int64
    zv = np.array(z0, dtype=float)
    for n in (0, 1, 2, None):
        got = (fast.rope_derivative(spec, z0, p, head=head) if n is None
               else fast.rope_derivative(spec, z0, p, n, head))
        want = np.linalg.matrix_power(A, 1 if n is None else n) @ R @ zv
        assert got.dtype == torch.float64
        assert np.abs(got.numpy() - want).max() <= tolerances.FLOAT64_REL * np.abs(want).max()
    fd = fast.rope_finite_difference(spec, zv.astype(np.float32), delta, head)
    want = delta * A @ F @ zv
    assert fd.dtype == torch.float64
    assert np.abs(fd.numpy() - want).max() <= tolerances.FLOAT64_REL * np.abs(want).max()
    with pytest.raises(ValueError, match=r"^derivative order must be >= 0, got -1$"):
        fast.rope_derivative(spec, z0, p, -1, head)
