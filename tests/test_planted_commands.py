"""Planted errors that one check alone can see: that check fails, and nothing else does.

Each test starts from a run that passes, plants one error in the place only the check under
test reads, and requires that check -- and no other -- to fail, with its name where the verdict
names it:

* atlas: ``finite`` (a context's output scale of zero, the arrays unchanged) and a float64
  max-key pass's overflow error (the pass's own error entry, its arrays complete);
* heads: the non-finite quantities of one query head's ``W_q`` (``sigma_max(W_q)``,
  ``sigma_min(W_q)``, ``||W_q||_F``) and ``sketch_barycenter``, each named for that head only;
* architectures (the census and the zoo): a crash while building the model, a crash while
  reading its conventions, a command's exit without a clean refusal or a report, and a type the
  census cannot shrink (*not buildable*: an outcome, not a failure).

Where the planted error cannot be isolated from the data alone (a non-finite weight is refused
by the input check before any diagnostic; an overflowing column norm reaches every norm-based
diagnostic), the test says which checks see it and plants the isolated case one level down (the
layer dict the verdict reads).
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ropestep import atlas, layercheck, exact, heads
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec, causal_mask
from test_atlas import N as _ATLAS_N
from test_atlas import layer as _layer  # the small causal GQA layer of tests/test_atlas.py

# ---------------------------------------------------------------------------------------------
# atlas
# ---------------------------------------------------------------------------------------------
N, ANCHOR, LAYER = _ATLAS_N, 4, 3
ATLAS_CHECKS = ("identity_float64", "float64_vs_native", "float64_original_gauge_vs_native",
                "model_dtype_vs_native", "finite")


@pytest.fixture(scope="module")
def atlas_case():
    """The layer, the oracle's output (mpmath, 50 digits) as the "native" capture, and the
    atlas's result on it -- every check of every head passes, no pass errors."""
    spec, w, x = _layer()
    pos = np.arange(N)
    E = exact.build(spec, w, x.numpy(), pos, x.numpy(), pos, causal_mask(pos, pos), dps=50)
    native = torch.as_tensor(exact.to_float(E.y)).permute(1, 0, 2)  # (N, H, r)
    res = layercheck.evaluate_layer(spec, w, x, torch.arange(N), native, layer=LAYER,
                               anchor_every=ANCHOR)
    out = layercheck.summarise_layer([res], spec, x.shape[1], N, torch.float32)
    assert out["passed"] and not res.errors, (out, res.errors)
    return spec, w, x, native, res


def _failed_checks(summary: dict) -> dict[int, list[str]]:
    return {h["head"]: [k for k, v in h["checks"].items() if not v] for h in summary["heads"]
            if not h["passed"]}


def _pool(res: layercheck.LayerResult, spec: HeadSpec, m: int) -> list[str]:
    return layercheck.pool([(0, LAYER, res)], {LAYER: (spec, m)}, [LAYER], N, torch.float32)[2]


@pytest.mark.parametrize("head", [0, 3])
def test_atlas_finite_alone_sees_a_zero_output_scale(atlas_case, head):
    """Planted: one head's ``native_scale`` set to 0 in a copy of the result, every per-query
    array unchanged.  The relative errors against the model's output (``nat_rel``, ``lp_rel``)
    divide by that scale and become inf (or NaN); of the checks only ``finite`` reads them --
    the identity check is relative to the *value* scale and the three native comparisons are
    per-query ratios to their absolute bounds, which did not change.  So ``finite`` of that head
    fails and nothing else: the other heads pass every check, there is no pass error, and the
    verdict's list names that head's ``finite`` only."""
    spec, w, x, native, res = atlas_case
    m = x.shape[1]
    bad = copy.deepcopy(res)
    bad.native_scale[head] = 0.0
    assert all(np.array_equal(bad.arrays[k], res.arrays[k], equal_nan=True) for k in res.arrays)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = layercheck.summarise_layer([bad], spec, m, N, torch.float32)
        failed = _pool(bad, spec, m)
    assert _failed_checks(out) == {head: ["finite"]}
    assert not math.isfinite(out["heads"][head]["float64_vs_native_rel"])
    assert not math.isfinite(out["heads"][head]["model_dtype_vs_native_rel"])
    assert out["errors"] == [] and out["passed"] is False
    assert failed == [f"layer {LAYER} head {head}: finite"]
    # the original result is untouched and still passes
    assert layercheck.summarise_layer([res], spec, m, N, torch.float32)["passed"]


def _planted_stream(monkeypatch, *, after_chunks: bool) -> list[str]:
    """``atlas.scale.stream`` replaced by one that raises FloatingPointError in pass C only: the
    call with ``gauge="maxkey"`` and a ``layer=`` given (pass B has the max-key gauge but no
    ``layer``, pass A a ``layer`` but the original gauge).  ``after_chunks``: the pass yields
    every chunk first (its arrays complete), then raises; otherwise it raises before the first.
    Returns the list of the calls' gauges (and whether each was the planted one)."""
    real = atlas.scale.stream
    calls: list[str] = []

    def stream(*args, **kw):
        planted = kw.get("gauge") == "maxkey" and kw.get("layer") is not None
        calls.append(f"{kw.get('gauge')}{' (planted)' if planted else ''}")
        if not planted:
            yield from real(*args, **kw)
            return
        if after_chunks:
            yield from real(*args, **kw)
        raise FloatingPointError("planted overflow in the float64 max-key readout")

    monkeypatch.setattr(atlas.scale, "stream", stream)
    return calls


def test_atlas_float64_maxkey_pass_error_alone(atlas_case, monkeypatch):
    """Planted: pass C (float64, max-key gauge, readout only) raises FloatingPointError after
    its last chunk, so every per-query array is the same as the passing run's.  Only the pass's
    error entry can see it: ``res.errors`` holds exactly that error (passes A and B add none),
    every head passes every check, and the verdict's failed list is that one line."""
    spec, w, x, native, good = atlas_case
    m = x.shape[1]
    calls = _planted_stream(monkeypatch, after_chunks=True)
    res = layercheck.evaluate_layer(spec, w, x, torch.arange(N), native, layer=LAYER,
                               anchor_every=ANCHOR)
    assert calls == ["original", "maxkey", "maxkey (planted)"]
    want = (f"layer {LAYER}: float64 max-key gauge: planted overflow in the float64 max-key "
            "readout")
    assert res.errors == [want]
    for k in layercheck.PER_QUERY:  # the pass finished its arrays: the same as the clean run's
        assert np.array_equal(res.arrays[k], good.arrays[k], equal_nan=True), k
    out = layercheck.summarise_layer([res], spec, m, N, torch.float32)
    assert _failed_checks(out) == {} and all(h["passed"] for h in out["heads"])
    assert out["errors"] == [want] and out["passed"] is False
    assert _pool(res, spec, m) == [want]


def test_atlas_float64_maxkey_pass_error_before_its_first_chunk(atlas_case, monkeypatch):
    """Planted: pass C raises before its first chunk.  Not isolable to the error entry: the
    pass's arrays (``native_abs``, ``native_bound``) stay NaN, so ``float64_vs_native`` and
    ``finite`` of every head fail with it -- and nothing else: passes A and B add no error, the
    identity, original-gauge and model-dtype checks still pass (they never read pass C)."""
    spec, w, x, native, good = atlas_case
    m = x.shape[1]
    _planted_stream(monkeypatch, after_chunks=False)
    res = layercheck.evaluate_layer(spec, w, x, torch.arange(N), native, layer=LAYER,
                               anchor_every=ANCHOR)
    want = (f"layer {LAYER}: float64 max-key gauge: planted overflow in the float64 max-key "
            "readout")
    assert res.errors == [want]
    for k in ("native_abs", "native_bound"):
        assert np.all(np.isnan(res.arrays[k])), k
    for k in set(layercheck.PER_QUERY) - {"native_abs", "native_bound"}:
        assert np.array_equal(res.arrays[k], good.arrays[k], equal_nan=True), k
    out = layercheck.summarise_layer([res], spec, m, N, torch.float32)
    H = spec.n_heads
    assert _failed_checks(out) == {h: ["float64_vs_native", "finite"] for h in range(H)}
    assert _pool(res, spec, m) == [f"layer {LAYER} head {h}: float64_vs_native, finite"
                                   for h in range(H)] + [want]


# ---------------------------------------------------------------------------------------------
# heads
# ---------------------------------------------------------------------------------------------
HM, HH, HK, HD = 12, 4, 2, 8  # rows, query heads, KV heads, head_dim
BAD_HEAD = 2  # reads KV head 1 (group 2)


def _weights(wq: np.ndarray | None = None) -> tuple[HeadSpec, HeadWeights]:
    rng = np.random.default_rng(11)
    q = rng.standard_normal((HM, HH, HD))
    k, v = rng.standard_normal((HM, HK, HD)), rng.standard_normal((HM, HK, HD))
    spec = HeadSpec(n_heads=HH, n_kv_heads=HK, head_dim=HD, rope=RoPESpec(base=1e4))
    return spec, HeadWeights(torch.as_tensor(q if wq is None else wq), torch.as_tensor(k),
                             torch.as_tensor(v))


@pytest.fixture(scope="module")
def clean_heads():
    spec, w = _weights()
    res = heads.diagnose_weights(spec, w)
    assert heads.failures({"5": res}) == []
    return spec, w, res


def _named(fl) -> list[tuple[str, str]]:
    return [(f.where, f.check) for f in fl]


def test_heads_an_inf_entry_in_w_q_is_refused_before_any_diagnostic(clean_heads):
    """Planted: an inf entry in query head 2's ``W_q``, given to ``diagnose_weights`` as is.
    The inventory's "inf entry -> sigma_max/sigma_min/Frobenius failures" does not reach the
    diagnostics this way: the head description's own input check (``HeadWeights.check``) sees
    it first and refuses the layer in one line naming ``w_q``."""
    spec, w, _ = clean_heads
    wq = w.w_q.numpy().copy()
    wq[4, BAD_HEAD, 5] = math.inf
    with pytest.raises(ValueError, match="w_q contains NaN or inf"):
        heads.diagnose_weights(spec, HeadWeights(torch.as_tensor(wq), w.w_k, w.w_v))


def test_heads_inf_entry_past_the_input_check_is_named_for_that_head_only(clean_heads,
                                                                           monkeypatch):
    """Planted: the same inf entry with the input check stood down (``HeadWeights.check`` a
    no-op), so the diagnostics themselves meet it.  LAPACK has no SVD of a non-finite matrix
    (all singular values NaN), the Frobenius norm is inf, the band energies inf/inf, the column
    norms of both barycenters inf: every non-finite quantity is named -- ``sigma_max(W_q)``,
    ``sigma_min(W_q)`` and ``||W_q||_F`` among them -- and all for query head 2 only.  The other
    query heads, and both KV heads (head 2's KV head 1 included: its ``W_k`` is clean), are not
    named."""
    spec, w, clean = clean_heads
    wq = w.w_q.numpy().copy()
    wq[4, BAD_HEAD, 5] = math.inf
    monkeypatch.setattr(HeadWeights, "check", lambda self, spec: None)
    with np.errstate(over="ignore", invalid="ignore"):
        res = heads.diagnose_weights(spec, HeadWeights(torch.as_tensor(wq), w.w_k, w.w_v))
        fl = heads.failures({"5": res})
    where = f"layer 5 query head {BAD_HEAD}"
    assert {f.where for f in fl} == {where}
    assert [c for _, c in _named(fl)] == [
        "cond(W_q)", "effective rank(W_q)", "sigma_max(W_q)", "sigma_min(W_q)", "||W_q||_F",
        "band energy(W_q)", "barycenter", "barycenter_base", "sketch_barycenter"]
    got = {f.check: f.value for f in fl}
    assert math.isnan(got["sigma_max(W_q)"]) and math.isnan(got["sigma_min(W_q)"])
    assert got["||W_q||_F"] == math.inf
    assert res["kv_heads"] == clean["kv_heads"]  # the W_k side is untouched
    for h in set(range(HH)) - {BAD_HEAD}:
        assert res["query_heads"][h] == clean["query_heads"][h]


@pytest.mark.parametrize("key,name", [("sigma_max", "sigma_max(W_q)"),
                                      ("sigma_min", "sigma_min(W_q)"),
                                      ("frobenius", "||W_q||_F")])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_heads_one_matrix_quantity_alone(clean_heads, key, name, value):
    """Planted: one quantity of query head 2's ``W_q`` diagnostics set non-finite in the layer
    dict the verdict reads (no weight can do it alone: an SVD that fails fails every singular
    value, and an overflowing entry overflows every norm).  ``failures`` names exactly that
    quantity of that head, with the planted value; nothing on the W_k side."""
    _, _, clean = clean_heads
    res = copy.deepcopy(clean)
    res["query_heads"][BAD_HEAD]["w_q"][key] = value
    fl = heads.failures({"5": res})
    assert _named(fl) == [(f"layer 5 query head {BAD_HEAD}", name)]
    assert fl[0].value is value


def test_heads_sketch_barycenter_alone(clean_heads):
    """Planted: query head 2's ``sketch_barycenter`` set NaN in the layer dict.  No weight
    makes the sketch NaN on its own: its importances are the column norms of ``W_q`` and
    ``W_k``, so a non-finite one (an overflowing column) is also non-finite in the barycenter's
    importances and in ``||W_q||_F`` (see the next test); finite norms give a finite quotient
    (``+1e-8`` in the denominator).  ``failures`` names ``sketch_barycenter`` of that head and
    nothing else."""
    _, _, clean = clean_heads
    res = copy.deepcopy(clean)
    res["query_heads"][BAD_HEAD]["sketch_barycenter"] = math.nan
    fl = heads.failures({"5": res})
    assert _named(fl) == [(f"layer 5 query head {BAD_HEAD}", "sketch_barycenter")]
    assert math.isnan(fl[0].value)


def test_heads_overflowing_w_q_makes_the_sketch_nan_for_that_head_only(clean_heads):
    """Planted: query head 2's ``W_q`` scaled by 1e155 -- finite, so the input check lets it
    through, but every column norm overflows (torch and numpy norms are not scaled).  The
    sketch's importances are inf and its quotient inf/inf NaN: ``sketch_barycenter`` is named
    for that head.  It is not alone -- the same overflow reaches the other norm-based numbers
    (``||W_q||_F``, the band energies, the barycenter and its base) -- while LAPACK's SVD, which
    scales, keeps ``cond``, the effective rank, ``sigma_max`` and ``sigma_min`` finite.  Nothing
    is named for another query head or on the W_k side."""
    spec, w, clean = clean_heads
    wq = w.w_q.numpy().copy()
    wq[:, BAD_HEAD, :] *= 1e155
    with np.errstate(over="ignore", invalid="ignore"):
        res = heads.diagnose_weights(spec, HeadWeights(torch.as_tensor(wq), w.w_k, w.w_v))
        fl = heads.failures({"5": res})
    assert _named(fl) == [(f"layer 5 query head {BAD_HEAD}", c) for c in (
        "||W_q||_F", "band energy(W_q)", "barycenter", "barycenter_base", "sketch_barycenter")]
    d = res["query_heads"][BAD_HEAD]["w_q"]
    assert all(math.isfinite(d[k]) for k in ("cond", "effective_rank", "sigma_max", "sigma_min"))
    assert res["kv_heads"] == clean["kv_heads"]


# ---------------------------------------------------------------------------------------------
# architectures: the census (run_type) and the zoo (run_architecture)
# ---------------------------------------------------------------------------------------------
TYPE = "llama"  # a census type and a zoo architecture that pass


def _transformers():
    pytest.importorskip("transformers")
    from ropestep import architectures, archzoo, census, models

    return architectures, archzoo, census, models


class Commands:
    """A stand-in for ``ropestep.cli.main``: a clean run of each command (exit 0 and a report
    with no layers: no checks, none failing), or, for the commands in ``plant``, what the planted
    function does.  Records every command line it is given."""

    def __init__(self, plant: dict | None = None):
        self.plant = plant or {}
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(list(argv))
        if argv[0] in self.plant:
            return self.plant[argv[0]](argv)
        return clean_run(argv)


def _out(argv) -> Path:
    return Path(argv[argv.index("--out") + 1])


def clean_run(argv) -> int:
    out = _out(argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"layers": {}}), encoding="utf-8")
    return 0


def _one_line(s: str) -> bool:
    return "\n" not in s and "Traceback" not in s


@pytest.mark.model
def test_architectures_clean_baseline(tmp_path):
    """Without a plant the stand-in commands pass and the type passes: no failure line, both
    commands run, the conventions read (the baseline every planted test below departs from)."""
    architectures, *_ = _transformers()
    cmds = Commands()
    rec = architectures.run_type(TYPE, tmp_path, 0, cmds)
    assert rec["outcome"] == "pass" and rec["failures"] == [] and rec["rotary"] is True
    assert [c[0] for c in cmds.calls] == ["atlas", "validate"]
    assert rec["conventions"]["refused"] is None and rec["conventions"]["layers"]


@pytest.mark.model
@pytest.mark.parametrize("path", ["census", "zoo"])
def test_architectures_building_the_model_crashed(tmp_path, monkeypatch, path):
    """Planted: the builder raises RuntimeError -- ``census.build`` for the census's
    ``run_type``, ``archzoo.save`` for the zoo's ``run_architecture``.  Not a
    ``NotBuildable`` (transformers' refusal, an outcome), so only the build-crash check sees it:
    the outcome is fail with one line ``building the model crashed: RuntimeError: ...`` (the
    traceback's last line, never the traceback), no conventions are read and neither command
    runs (both *not run*, "model not built")."""
    architectures, archzoo, census, _ = _transformers()

    def crash(*a, **k):
        raise RuntimeError("planted build crash")

    cmds = Commands()
    if path == "census":
        monkeypatch.setattr(census, "build", crash)
        rec = architectures.run_type(TYPE, tmp_path, 0, cmds)
    else:
        monkeypatch.setattr(archzoo, "save", crash)
        rec = architectures.run_architecture(TYPE, archzoo.ARCHITECTURES[TYPE], tmp_path, 0,
                                             cmds)
    assert rec["outcome"] == "fail"
    assert rec["failures"] == ["building the model crashed: RuntimeError: planted build crash"]
    assert all(_one_line(f) for f in rec["failures"])
    assert rec["build_crash"][-1] == "RuntimeError: planted build crash"
    assert cmds.calls == [] and rec["conventions"] is None
    for cmd in ("atlas", "validate"):
        assert rec[cmd]["outcome"] == "not run" and rec[cmd]["why"] == "model not built"
    if path == "census":
        assert rec["rotary"] is None  # never built


@pytest.mark.model
def test_architectures_building_crashed_fails_the_verdict(tmp_path, monkeypatch):
    """The same planted build crash through ``architectures.run``: the verdict fails with that
    one line, prefixed by the census type; the census counts the type as fail."""
    architectures, _, census, _ = _transformers()

    def crash(*a, **k):
        raise RuntimeError("planted build crash")

    monkeypatch.setattr(census, "build", crash)
    rep = architectures.run([], types=[TYPE], run_command=Commands())
    assert rep["verdict"] == {"passed": False, "failed": [
        f"census {TYPE}: building the model crashed: RuntimeError: planted build crash"]}
    assert rep["census_summary"]["by_outcome"]["fail"] == [TYPE]
    assert "**FAIL**: building the model crashed" in "\n".join(architectures.census_lines(rep))


@pytest.mark.model
def test_architectures_reading_its_conventions_crashed(tmp_path, monkeypatch):
    """Planted: ``models.describe_model`` -- as ``read_conventions`` looks it up, after the
    model loaded (``load_model``'s own call goes through its module's name, so loading is
    unaffected) -- raises RuntimeError.  Only the conventions check sees it: the model was built
    and both commands ran and passed (the clean stand-in), and the one failure is ``reading its
    conventions crashed: RuntimeError: ...``; the outcome is fail."""
    architectures, _, _, models = _transformers()

    def crash(*a, **k):
        raise RuntimeError("planted conventions crash")

    monkeypatch.setattr(models, "describe_model", crash)
    cmds = Commands()
    rec = architectures.run_type(TYPE, tmp_path, 0, cmds)
    assert rec["outcome"] == "fail"
    assert rec["failures"] == ["reading its conventions crashed: RuntimeError: planted "
                               "conventions crash"]
    assert rec["conventions"]["layers"] == [] and rec["conventions"]["summary"] is None
    assert rec["conventions"]["crash"][-1] == "RuntimeError: planted conventions crash"
    assert architectures.conventions_text(rec["conventions"]) == "reading crashed"
    assert [c[0] for c in cmds.calls] == ["atlas", "validate"]
    assert rec["atlas"]["outcome"] == rec["validate"]["outcome"] == "pass"
    assert rec["rotary"] is True  # the build itself went through


def _two_errors(argv) -> int:
    print("ropestep atlas: error: planted first refusal")
    print("ropestep atlas: error: planted second refusal")
    return 2


def _one_error(argv) -> int:
    print("ropestep atlas: error: planted refusal")
    return 2


def _no_report(argv) -> int:
    _out(argv).mkdir(parents=True, exist_ok=True)  # ran, wrote nothing
    return 0


def _fail_no_report(argv) -> int:
    return 1


@pytest.mark.model
@pytest.mark.parametrize("plant,rc", [(_two_errors, 2), (_no_report, 0), (_fail_no_report, 1)])
def test_architectures_exit_without_a_clean_refusal_or_a_report(tmp_path, plant, rc):
    """Planted: atlas's runner exits 2 after two ``: error:`` lines (a refusal is exactly one),
    or exits 0 (or 1) without writing report.json.  Only the command-outcome check sees it: the
    failure is ``atlas exit <rc> without a clean refusal or a report`` (atlas's outcome fail,
    its output's tail kept), validate passes, the conventions were read; the outcome is fail."""
    architectures, *_ = _transformers()
    rec = architectures.run_type(TYPE, tmp_path, 0, Commands({"atlas": plant}))
    assert rec["failures"] == [f"atlas exit {rc} without a clean refusal or a report"]
    assert rec["outcome"] == "fail"
    assert rec["atlas"]["exit"] == rc and rec["atlas"]["outcome"] == "fail"
    assert rec["atlas"]["refusal"] is None and rec["atlas"]["checks"] == {}
    if plant is _two_errors:
        assert rec["atlas"]["output_tail"] == ["ropestep atlas: error: planted first refusal",
                                               "ropestep atlas: error: planted second refusal"]
    assert rec["validate"]["outcome"] == "pass" and rec["conventions"]["refused"] is None


@pytest.mark.model
def test_architectures_one_error_line_is_a_clean_refusal(tmp_path):
    """The control of the two-line plant: exit 2 with one ``: error:`` line is a refusal (an
    outcome, not a failure) -- so the second line is what the check above sees."""
    architectures, *_ = _transformers()
    rec = architectures.run_type(TYPE, tmp_path, 0, Commands({"atlas": _one_error}))
    assert rec["failures"] == [] and rec["outcome"] == "refused"
    assert rec["atlas"]["outcome"] == "refused" and rec["atlas"]["refusal"] == "planted refusal"


@pytest.mark.model
def test_architectures_a_type_too_large_is_not_buildable(tmp_path, monkeypatch):
    """Planted: ``census.MAX_PARAMETERS`` at 1000, below any tiny model, so ``census.build``
    raises ``NotBuildable`` (the parameter count, read on the meta device).  That is an outcome,
    not a failure: *not buildable* with the reason in one line, no failure, neither command run,
    and through ``architectures.run`` the verdict passes with the type counted as not
    buildable (and not as built)."""
    architectures, _, census, _ = _transformers()
    monkeypatch.setattr(census, "MAX_PARAMETERS", 1000)
    cmds = Commands()
    rec = architectures.run_type(TYPE, tmp_path, 0, cmds)
    assert rec["outcome"] == "not buildable" and rec["failures"] == []
    assert rec["why"].startswith("the tiny configuration still has ") and "parameters" in rec["why"]
    assert _one_line(rec["why"])
    assert cmds.calls == [] and rec["conventions"] is None and rec["rotary"] is None
    for cmd in ("atlas", "validate"):
        assert rec[cmd]["outcome"] == "not run" and rec[cmd]["why"] == "not buildable"
    rep = architectures.run([], types=[TYPE], run_command=cmds)
    assert rep["verdict"] == {"passed": True, "failed": []}
    s = rep["census_summary"]
    assert s["by_outcome"]["not buildable"] == [TYPE] and s["built"] == 0
    assert cmds.calls == []
