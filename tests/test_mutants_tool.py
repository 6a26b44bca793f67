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

import hashlib
import importlib.util
import json
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
    assert 30 <= len(tool.MUTANTS) <= 100
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
    # --only selects by name, in the list's order
    capsys.readouterr()
    assert tool.main(["--list", "--only", "tokenwise-agreement-mean,phi1-naive-exp-minus-one"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out] == ["phi1-naive-exp-minus-one",
                                                  "tokenwise-agreement-mean"]


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


def test_tool_a_part_not_rerun_is_carried_over_with_its_own_run(tool, tmp_path):
    """``--semantic`` alone keeps the previous report's mutmut part, unchanged but for the
    command, date, commit and versions of the run that computed it (also after a second
    carry-over), and report.md says so; this run's exit status is its own parts'."""
    parts = _fake_parts()
    for p in parts.values():
        p["summary"] = tool.summarize(p["mutants"])
    old = tool.build_report(parts, ["--semantic", "--mutmut", "--out", "mutation/"], 0.0, 1)
    old["date"], old["versions"]["git_commit"] = "2026-11-30T23:30:33+00:00", "1055ac8f"
    fresh = {"semantic": dict(parts["semantic"])}
    fresh["semantic"]["mutants"] = [dict(r, status="killed") for r in parts["semantic"]["mutants"]]
    fresh["semantic"]["summary"] = tool.summarize(fresh["semantic"]["mutants"])
    assert tool.exit_status(fresh) == 0
    merged = tool.carry_over(fresh, old)
    assert merged["semantic"] is fresh["semantic"] and "carried_over" not in merged["semantic"]
    mm = merged["mutmut"]
    assert {k: v for k, v in mm.items() if not k.startswith("carried_over")} == parts["mutmut"]
    co = mm["carried_over"]
    assert co["command"] == "python tools/mutants.py --semantic --mutmut --out mutation/"
    assert co["date"] == mm["carried_over_from"] == "2026-11-30T23:30:33+00:00"
    assert co["git_commit"] == "1055ac8f" and co["versions"]["python"]
    assert "carried_over" not in parts["mutmut"]  # the previous report is not modified
    rep = tool.build_report(merged, ["--semantic", "--out", "mutation/"], 0.0, 0)
    assert rep["summary"]["total"] == 5 and rep["exit_code"] == 0
    md = tool.render_markdown(rep)
    assert "| mutmut (carried over) | 2 | 1 | 0 | 1 |" in md and "| semantic | 3 | 3 | 0 |" in md
    assert ("This section is from an earlier run (carried over unchanged; the command above did "
            "not rerun it): command `python tools/mutants.py --semantic --mutmut --out mutation/`;"
            " date 2026-11-30T23:30:33+00:00; git commit 1055ac8f") in md
    assert "* Part `mutmut` carried over from an earlier run" in md
    # carried over a second time: still the first run's provenance
    again = tool.carry_over({"semantic": fresh["semantic"]}, rep)
    assert again["mutmut"]["carried_over"] == co


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


def test_tool_a_widened_selection_keeps_the_verdicts_a_narrowed_one_does_not(tool, tmp_path):
    """keep_kills_on_widening: the kept fingerprint is brought up to mutmut's own for the new
    selection only when every old test is still collected and nothing else changed."""
    pytest.importorskip("mutmut")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    old, wide, narrow = ["tests/test_a.py", "-k", "one"], ["tests/test_a.py"], \
        ["tests/test_a.py", "-k", "two"]
    env = tool.child_env(None, "quick", None)

    def setup(selection, kept_fp):
        (tmp_path / "pyproject.toml").write_text(
            '[project]\nname = "x"\n\n[tool.mutmut]\nsource_paths = ["src"]\n'
            f"pytest_add_cli_args_test_selection = {json.dumps(selection)}\n")
        (tmp_path / "mutants").mkdir(exist_ok=True)
        stats = tmp_path / "mutants" / "mutmut-stats.json"
        stats.write_text(json.dumps({"config_fingerprint": kept_fp, "duration_by_test": {}}))
        return stats

    code = ("import json; from mutmut.configuration import config; "
            "print(json.dumps(config().config_fingerprint()))")

    def fingerprint():
        p = tool.run_proc([sys.executable, "-c", code], tmp_path, env, 120)
        assert p.rc == 0, p.output
        return json.loads(p.output.strip().splitlines()[-1])

    setup(old, {})
    fp_old = fingerprint()
    stats = setup(wide, fp_old)
    fp_wide = fingerprint()
    assert fp_wide["test_selection"] != fp_old["test_selection"]
    said = tool.keep_kills_on_widening(tmp_path, old, wide, env)
    assert said and "1 -> 2 tests" in said
    assert json.loads(stats.read_text())["config_fingerprint"] == fp_wide
    for selection, before in ((narrow, old), (wide, wide)):  # narrower; unchanged
        stats = setup(selection, fp_old)
        assert tool.keep_kills_on_widening(tmp_path, before, selection, env) is None
        assert json.loads(stats.read_text())["config_fingerprint"] == fp_old
    stats = setup(wide, {**fp_old, "test_execution": "other"})  # other pytest options changed
    assert tool.keep_kills_on_widening(tmp_path, old, wide, env) is None
    assert tool._copy_selection(tmp_path) == wide and tool._copy_selection(tmp_path / "no") is None


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
    # frequencies of a base that float32 cannot hold, in float64
    base = 12345.678
    om = fast.rope_frequencies(base, 8)
    with mp.workdps(40):
        want = np.array([float(w) for w in exact.frequencies(base, 8)])
    assert om.dtype == torch.float64
    assert np.abs(om.numpy() - want).max() <= tolerances.FLOAT64_REL * want.max()


def _overflow_scores(G=2, Qc=3, n=4):
    """Scores of ``G`` heads, ``Qc`` queries, ``n`` keys: O(1) everywhere except head 1, query 2,
    whose scores are -800 - j (every one below -745: the original gauge's 1/Z overflows)."""
    s = 0.5 * torch.randn(G, Qc, n, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64)
    s[1, 2] = -800.0 - torch.arange(n, dtype=torch.float64)
    return s, torch.ones(Qc, n, dtype=torch.bool)


def test_kills_overflow_messages_name_gauge_head_and_query():
    """The overflow error names the gauge, the dtype, the head and the query (translated by
    ``heads`` and ``query_offset``) and how far the anchor sits above the scores -- the message
    the suite promises (docs/math.md section 2), compared character by character."""
    from ropestep import kernel

    s, mask = _overflow_scores()
    sm = kernel.softmax(s, mask, None)
    tail = (": the gauge anchor sits 800 above every score, so its coefficients exceed the "
            "float range (docs/math.md section 2); use gauge='maxkey'")
    with pytest.raises(FloatingPointError) as err:
        kernel.coefficients(sm, mask, None, None)  # every default
    assert str(err.value) == "gauge 'original' overflows in torch.float64 at head 1, query 2" + tail
    with pytest.raises(FloatingPointError) as err:
        kernel.coefficients(sm, mask, None, None, gauge="free", query_offset=10, heads=[4, 7])
    assert str(err.value) == "gauge 'free' overflows in torch.float64 at head 7, query 12" + tail
    # through the chunk kernel: scores as additive biases (q = 0), a free gauge at sigma = 0
    G, Qc, n = s.shape
    q = torch.zeros(G, Qc, 3, dtype=torch.float64)
    k = torch.randn(1, n, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    v = torch.randn(1, n, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with pytest.raises(FloatingPointError) as err:
        kernel.gauge_chunk(q, k, v, mask, gauge="free", beta=s, sigma=torch.zeros(G, Qc,
                           dtype=torch.float64), query_offset=10, heads=[4, 7])
    assert str(err.value) == "gauge 'free' overflows in torch.float64 at head 7, query 12" + tail
    with pytest.raises(ValueError) as err:
        kernel.gauge_chunk(q, k, v, mask, gauge="free", beta=s)
    assert str(err.value) == "a free gauge needs its anchor sigma_i = u_i . g"
    with pytest.raises(FloatingPointError) as err:
        kernel.gauge_chunk(q, k, v, mask, beta=s)  # defaults: original gauge, offset 0
    assert str(err.value) == "gauge 'original' overflows in torch.float64 at head 1, query 2" + tail


def test_kills_transform_dd_identity_shape_and_dtype():
    """``phi[a, b] = 1`` for the identity transform, broadcast over ``a`` and ``b``, in their
    dtype (by definition: ``(a - b)/(a - b)``)."""
    from ropestep import kernel

    a = torch.linspace(-1.0, 1.0, 3, dtype=torch.float64)[:, None]
    b = torch.zeros(1, 4, dtype=torch.float64)
    out = kernel.transform_dd(a, b, None)
    assert out.dtype == torch.float64 and out.shape == (3, 4)
    assert torch.equal(out, torch.ones(3, 4, dtype=torch.float64))
    assert kernel.transform_dd(b, a, None).shape == (3, 4)


@pytest.mark.parametrize("gauge", ["original", "maxkey"])
def test_kills_gemm_form_without_offsets_and_v_dim_not_head_dim(gauge, one_thread):
    """The kernel's GEMM form (``pblocks``: ``T = C @ P`` plus rank-one corrections) with no
    centring offsets (``kbar = vbar = None``), keys in blocks of 3, value dim 3 != head dim 4,
    ALiBi biases: ``T``, the bias term and the readout against the mpmath oracle (40 digits).
    ``fast.project`` only supplies the projected inputs; the comparison is with ``exact``."""
    from ropestep import exact, fast, kernel
    from strategies import make_problem

    p = make_problem(seed=11, m=3, H=2, Hk=1, d=4, r=3, N=7, alibi=True)
    E = exact.build(*p.args(), bias=p.bias, dps=40)
    P = fast.project(p.spec, p.weights, p.x_q, p.pos_q, p.x_kv, p.pos_kv, bias=p.bias)
    mask = torch.as_tensor(p.mask)
    k, v = P.k[:1], P.v[:1]  # one KV head read by both query heads
    kw = {} if gauge == "original" else {"gauge": gauge}  # the default gauge is the original
    out = kernel.gauge_chunk(P.q, k, v, mask, beta=P.beta,
                             pblocks=kernel.PBlocks(k[0], v[0], None, 3), **kw)
    assert "kappa" not in out  # computed only when asked
    H, Q = P.q.shape[:2]
    T = np.array([[np.array(exact.t_matrix(E, h, i, gauge).tolist(), dtype=float)
                   for i in range(Q)] for h in range(H)])
    y = exact.to_float(E.y)
    vs = float(np.abs(exact.to_float(E.v)).max())
    assert out["t"].shape == T.shape == (H, Q, 4, 3)
    assert float(np.abs(out["t"].numpy() - T).max()) <= tolerances.FLOAT64_REL * np.abs(T).max()
    assert float(np.abs(out["readout_c"].numpy() - y).max()) <= tolerances.FLOAT64_REL * vs
    assert float(np.abs(out["y_c"].numpy() - y).max()) <= tolerances.FLOAT64_REL * vs
    # kappa is the condition number of the readout of the values themselves: centring offsets
    # (kbar, vbar) change how the sums are evaluated, not kappa (checked against the oracle's)
    from oracle import kappa_agreement

    kbar, vbar = k.mean(1, keepdim=True), v.mean(1, keepdim=True) + 3.0
    for offsets in ({}, {"kbar": kbar, "vbar": vbar}):
        kh, vh = k - offsets.get("kbar", 0.0), v - offsets.get("vbar", 0.0)
        ko = kernel.gauge_chunk(P.q, k, v, mask, beta=P.beta, kappa=True, **offsets, **kw,
                                pblocks=kernel.PBlocks(kh[0], vh[0], None, 3))
        rel, _ = kappa_agreement(E, ko["kappa"], gauge)
        assert rel.max() <= tolerances.KAPPA_REL, (offsets.keys(), rel.max())
        shift = 0 if not offsets else vbar.numpy()
        assert float(np.abs(ko["readout_c"].numpy() + shift - y).max()) <= \
            tolerances.FLOAT64_REL * vs


def test_kills_augment_on_batched_rows():
    """``u = [x; 1]`` over the last axis of any batch of rows, in x's dtype (by definition)."""
    from ropestep import kernel

    x = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4)
    u = kernel.augment(x)
    assert u.shape == (2, 3, 5) and u.dtype == torch.float64
    assert torch.equal(u[..., :4], x) and torch.equal(u[..., 4], torch.ones(2, 3,
                                                                            dtype=torch.float64))


def test_kills_pairwise_ignores_pblocks(one_thread):
    """The pairwise gauge is evaluated densely whatever ``pblocks`` says: readout against the
    mpmath oracle's y (40 digits), with ALiBi biases."""
    from ropestep import exact, fast, kernel
    from strategies import make_problem

    p = make_problem(seed=12, m=3, H=2, Hk=1, d=4, r=3, N=6, alibi=True)
    E = exact.build(*p.args(), bias=p.bias, dps=40)
    P = fast.project(p.spec, p.weights, p.x_q, p.pos_q, p.x_kv, p.pos_kv, bias=p.bias)
    k, v = P.k[:1], P.v[:1]
    out = kernel.gauge_chunk(P.q, k, v, torch.as_tensor(p.mask), gauge="pairwise", beta=P.beta,
                             pblocks=kernel.PBlocks(k[0], v[0], None, 2))
    y = exact.to_float(E.y)
    vs = float(np.abs(exact.to_float(E.v)).max())
    assert float(np.abs(out["readout_c"].numpy() - y).max()) <= tolerances.FLOAT64_REL * vs


def test_kills_unknown_gauge_and_readout_overflow_messages():
    """``gauge_chunk`` names an unknown gauge, and a non-finite readout by gauge, dtype, head and
    query (translated by ``heads``/``query_offset``).  The readout overflows through the mean:
    two values of 1e308 in the permitted set of queries >= 2 (causal), none before."""
    from ropestep import kernel

    G, Qc, n, d, r = 2, 4, 4, 3, 2
    g = torch.Generator().manual_seed(6)
    q = 0.3 * torch.randn(G, Qc, d, generator=g, dtype=torch.float64)
    k = 0.3 * torch.randn(1, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, n, r, generator=g, dtype=torch.float64)
    v[0, 1:3] = 1e308
    mask = torch.ones(Qc, n, dtype=torch.bool).tril()
    with pytest.raises(ValueError) as err:
        kernel.gauge_chunk(q, k, v, mask, gauge="minkey")
    assert str(err.value) == ("unknown gauge 'minkey': one of ('original', 'maxkey', 'free', "
                              "'pairwise')")
    msg = ("gauge 'maxkey': the readout mu + q T + b is not finite in torch.float64 at head {}, "
           "query {} (its terms overflow the float range)")
    with pytest.raises(FloatingPointError) as err:
        kernel.gauge_chunk(q, k, v, mask, gauge="maxkey")
    assert str(err.value) == msg.format(0, 2)
    with pytest.raises(FloatingPointError) as err:
        kernel.gauge_chunk(q, k, v, mask, gauge="maxkey", query_offset=10, heads=[4, 7])
    assert str(err.value) == msg.format(4, 12)


def test_kills_ftensor_dtype_contract():
    """``phi_1`` of Python numbers, lists and integer arrays is float64 (not torch's float32
    default); float32 arrays and scalars stay float32.  Values against mpmath."""
    import mpmath as mp

    from ropestep import kernel

    want = float(mp.expm1(mp.mpf(0.5)) / mp.mpf(0.5))
    for x, dtype in (([0.5, 0.5], torch.float64), (0.5, torch.float64),
                     (np.array([1, 2]), torch.float64), (np.array([0.5]), torch.float64),
                     (np.array([0.5], dtype=np.float32), torch.float32),
                     (np.float32(0.5), torch.float32), (np.float64(0.5), torch.float64)):
        out = kernel.phi1(x)
        assert out.dtype == dtype, (x, out.dtype)
    assert abs(float(kernel.phi1([0.5])[0]) - want) <= 2 * tolerances.unit_roundoff(
        torch.float64) * want


def test_kills_input_error_messages():
    """Unsupported dtypes and RoPE layouts are refused with a message naming them."""
    from ropestep import kernel, rope

    with pytest.raises(TypeError) as err:
        kernel.compute_dtype(torch.int32)
    assert str(err.value) == ("unsupported dtype torch.int32: use float64, float32, bfloat16 "
                              "or float16")
    x = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError) as err:
        rope.apply_rope(x, x[:, :2], x[:, :2], "diagonal")
    assert str(err.value) == "unknown RoPE layout 'diagonal'"


def test_kills_rope_tables_contract():
    """A model's own tables are used as given -- lists, numpy arrays or tensors -- and rounded
    once to the requested dtype; positions must be integers (the error names them)."""
    from ropestep import rope
    from ropestep.spec import HeadSpec, RoPESpec

    P, d = 6, 4
    ang = np.arange(P)[:, None] * 100.0 ** (-2.0 * np.arange(d // 2) / d)
    cos, sin = np.cos(ang), np.sin(ang)  # float64 values float32 cannot hold
    pos = [1, 4]
    for tables in ((cos.tolist(), sin.tolist()), (cos, sin),
                   (torch.tensor(cos), torch.tensor(sin))):
        spec = HeadSpec(1, 1, d, rope=RoPESpec(base=100.0, cos=tables[0], sin=tables[1]))
        c, s = rope.rope_cos_sin(spec, pos)
        assert c.dtype == s.dtype == torch.float64 and c.shape == (1, 2, d // 2)
        assert np.array_equal(c[0].numpy(), cos[pos]) and np.array_equal(s[0].numpy(), sin[pos])
        c, s = rope.rope_cos_sin(spec, pos, dtype=torch.float32)
        assert c.dtype == s.dtype == torch.float32
        assert np.array_equal(c[0].numpy(), cos[pos].astype(np.float32))
        assert np.array_equal(s[0].numpy(), sin[pos].astype(np.float32))
    with pytest.raises(TypeError) as err:
        rope.rope_cos_sin(spec, [0.5])
    assert str(err.value) == "positions must hold integer positions, got dtype float64"


def test_tool_restrict_to_functions_fences_the_others(tool, tmp_path):
    """A part's ``functions``: the other definitions are fenced with mutmut's start/end
    pragmas on their blank lines (line numbers unchanged), and mutmut mutates only the kept."""
    src = ("import math\n\n\ndef keep(x):\n    return x + 1\n\n\n# banner\n"
           "def drop(x):\n    return x * 2\n\n\nclass C:\n    def m(self):\n        return 3 - 1\n")
    f = tmp_path / "m.py"
    f.write_text(src)
    assert tool.restrict_to_functions(f, ["keep"]) == ["drop", "C"]
    out = f.read_text()
    lines = out.split("\n")
    assert lines[:6] == src.split("\n")[:6]  # keep() where it was
    assert lines[6:10] == ["# pragma: no mutate start", "# banner", "def drop(x):",
                           "    return x * 2"]
    assert lines[10:13] == ["# pragma: no mutate end", "# pragma: no mutate start", "class C:"]
    assert lines[-3:] == ["# pragma: no mutate end", "pass", ""]
    with pytest.raises(tool.BadInput, match="no top-level function nope"):
        tool.restrict_to_functions(f, ["nope"])
    mutmut = pytest.importorskip("mutmut.__main__")  # a dev tool, not installed by CI
    mutants = mutmut.mutate_file_contents("m.py", out, None, None).mutant_names
    assert mutants and all(n.startswith("x_keep__mutmut_") for n in mutants)


def test_tool_verdicts_kept_between_sessions(tool, tmp_path):
    """``save_state`` keeps a part's mutmut files (the ``.meta`` of each mutated file and the
    test statistics); ``seed_state`` puts them into a fresh copy only, never over a copy that
    has its own, and not when one of them is missing."""
    files = ["src/ropestep/heads.py"]
    state, copy, fresh = tmp_path / "state", tmp_path / "copy", tmp_path / "fresh"
    meta = copy / "mutants" / "src" / "ropestep" / "heads.py.meta"
    stats = copy / "mutants" / "mutmut-stats.json"
    meta.parent.mkdir(parents=True)
    meta.write_text('{"exit_code_by_key": {"a": 1, "b": null}}')
    assert not tool.seed_state(fresh, "p", files, state)  # nothing kept yet
    tool.save_state(copy, "p", files, state)
    assert sorted(p.name for p in (state / "p").iterdir()) == ["heads.py.meta"]
    assert not tool.seed_state(fresh, "p", files, state)  # the statistics are missing
    stats.write_text('{"tests": 1}')
    tool.save_state(copy, "p", files, state)
    assert tool.seed_state(fresh, "p", files, state)
    assert (fresh / meta.relative_to(copy)).read_text() == meta.read_text()
    assert (fresh / stats.relative_to(copy)).read_text() == '{"tests": 1}'
    (fresh / meta.relative_to(copy)).write_text("its own")
    assert not tool.seed_state(fresh, "p", files, state)  # a copy's own verdicts win
    assert (fresh / meta.relative_to(copy)).read_text() == "its own"


def test_realchecks_state_its_survivor_list_and_the_readme_agree():
    """The saved realchecks verdicts (mutation/state/mutmut-realchecks), the survivor list
    written with them (``tools/mutants.py --save-state``: every survivor with its reason, none
    UNEXPLAINED) and the README's account give the same counts."""
    state = REPO / "mutation" / "state" / "mutmut-realchecks"
    codes = json.loads((state / "realchecks.py.meta").read_text(encoding="utf-8"))[
        "exit_code_by_key"]
    killed = sum(1 for c in codes.values() if c == 1)
    survived = sum(1 for c in codes.values() if c == 0)
    untested = sum(1 for c in codes.values() if c is None)
    lines = (state / "survivors.md").read_text(encoding="utf-8").splitlines()
    assert lines[2].startswith(f"{len(codes)} mutants: {killed} killed, {survived} survived (")
    assert f"{untested} untested" in lines[2]
    rows = [ln for ln in lines if ln.startswith("| `")]
    assert len(rows) == survived
    assert not [r for r in rows if "UNEXPLAINED" in r]
    eq = sum(1 for r in rows if "| equivalent |" in r)
    live = survived - eq
    assert f"({eq} equivalent, {live} not killed)" in lines[2]
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    frac = f"{killed}/{killed + live} = {killed / (killed + live):.4f}"
    assert frac in lines[2] and frac in readme
    assert f"{len(codes)} mutants" in readme and f"{eq} equivalent" in readme
    # the committed report's part counts the same verdicts
    s = json.loads((REPO / "mutation" / "report.json").read_text(encoding="utf-8"))[
        "parts"]["mutmut-realchecks"]["summary"]
    assert (s["total"], s["killed"], s["equivalent"], s["survived"]) == (
        len(codes), killed, eq, live)


def test_readme_mutation_table_is_the_committed_report():
    """Every row of the README's mutation table (part, mutants, killed, equivalent, survived)
    is the committed report's count for that part, and the table names every part the report
    holds: a rerun that changes a count without the README, or a README edited by hand, fails."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    head = lines.index("| part | module | mutants | killed | equivalent (each with its reason) "
                       "| survived |")
    rows = {}
    for ln in lines[head + 2:]:
        if not ln.startswith("| `"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0].strip("`")] = tuple(int(c) for c in cells[-4:])
    parts = json.loads((REPO / "mutation" / "report.json").read_text(encoding="utf-8"))["parts"]
    assert set(rows) == set(parts)
    for name, part in parts.items():
        s = part["summary"]
        assert rows[name] == (s["total"], s["killed"], s["equivalent"], s["survived"]), name
