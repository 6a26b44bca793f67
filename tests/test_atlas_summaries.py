"""``atlas``'s statistics against the reference, from the captured layers, without a model.

``atlas.run`` captures each (context, layer) item's inputs with one forward of the model,
measures it with :func:`ropestep.layercheck.evaluate_layer` (the per-query arrays: the identity's and
the readouts' errors against the model's own output and their bounds, kappa in both gauges, the
sink mass, lambda_max and the unit step's test in both spaces, the frozen-reuse errors and the
TV distances), and pools the items with :func:`ropestep.layercheck.pool` (per-head summaries, the
replication-style count, the verdict's failures) and :func:`ropestep.atlas._cost` (the counted
work).  ``tests/test_reference_atlas.py`` checks every leaf of a whole tiny run against the
reference recomputation (``ropestep.reference.atlas``, written from docs/protocol.md alone).

Here the same run is frozen: ``tests/data/atlas_tiny_items.pt`` holds, for the seeded model and
command of that test, the arguments each ``evaluate_layer`` call received (the layer's float64
description and weights, the captured inputs, positions and the model's own per-head outputs),
the report the run wrote and the reference's recomputation from the run's ``--dump-raw`` dump.
The test measures and pools the frozen items with today's code, puts the result in place of the
report's layers, replication count, verdict and counted work, and compares every leaf with the
reference under the tolerances and leaf classes of ``test_reference_atlas`` (the expected values
come from the reference, never from the code under test).  Planted failures exercise the
verdict's failure path.

It takes about a second, which makes it the test mutation testing runs first on ``atlas``'s
statistics (``tools/mutants.py``, part ``mutmut-atlas``).  After a deliberate change to what an
item measures or to the reference, rebuild the file with
``ROPESTEP_REGEN_GOLDEN=1 pytest tests/test_atlas_summaries.py`` and review the printed counts.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ropestep import atlas, layercheck, tolerances
from ropestep.report import dumps
from ropestep.verdict import loads
from reference_walk import decisions, frozen_run
from reference_walk import one_torch_thread  # noqa: F401  (autouse, module scope)
from test_reference_atlas import TINY_ARGS, build_model, compare, run_case, undecided

pytestmark = pytest.mark.model

DATA = Path(__file__).resolve().parent / "data" / "atlas_tiny_items.pt"


def _generate(root: Path) -> dict:
    """The tiny run of test_reference_atlas, recording each item's inputs and the pooling's."""
    calls: dict[int, tuple] = {}
    seen: dict = {}
    evaluate, pool = layercheck.evaluate_layer, layercheck.pool

    def rec_evaluate(*args, **kwargs):
        res = evaluate(*args, **kwargs)
        kw = {k: v for k, v in kwargs.items() if k != "timers"}
        calls[id(res)] = (args, kw)
        return res

    def rec_pool(done, specs, layers, length, lp_dtype, replication_only=False):
        seen.update(items=[(c, L, *calls[id(res)]) for c, L, res in done], specs=specs,
                    layers=list(layers), length=length, lp_dtype=lp_dtype)
        return pool(done, specs, layers, length, lp_dtype, replication_only)

    layercheck.evaluate_layer, layercheck.pool = rec_evaluate, rec_pool
    try:
        case = run_case(root, ["--model", str(build_model(root / "model")), *TINY_ARGS])
    finally:
        layercheck.evaluate_layer, layercheck.pool = evaluate, pool
    assert len(seen["items"]) == len(case.report["contexts"]) * len(case.report["layers"])
    return {**seen, "report": case.report, "ref": case.ref,
            "timers": case.report["timing_seconds"]}


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> dict:
    return frozen_run(DATA, _generate, tmp_path_factory)


@pytest.fixture(scope="module")
def measured(frozen) -> list:
    """Today's ``evaluate_layer`` on every frozen item: ``(context, layer, LayerResult)`` (the
    tests that plant a value copy what they change)."""
    return [(c, L, layercheck.evaluate_layer(*args, **kw)) for c, L, args, kw in frozen["items"]]


def pooled(frozen: dict, done: list, cost: bool = False) -> dict:
    """The frozen run's report with the measured items ``done`` pooled by today's code (and,
    with ``cost``, their counted work: that measures this machine's GEMM rates, ~1 s), read
    back as ``report.json`` is."""
    rep = loads(dumps(frozen["report"]))
    layers, replication, failed = layercheck.pool(done, frozen["specs"], frozen["layers"],
                                             frozen["length"], frozen["lp_dtype"])
    rep["layers"], rep["replication_style_descent"] = layers, replication
    rep["verdict"] = {"passed": not failed, "failed": failed}
    if cost:
        rep["cost"] = atlas._cost(done, frozen["specs"], [{"timers": frozen["timers"]}],
                                  frozen["lp_dtype"], "cpu")
    return loads(dumps(rep))


def test_the_frozen_items_measure_and_pool_to_the_reference(frozen, measured):
    assert not undecided(frozen["ref"]), "the frozen run has decisions at their thresholds"
    rep = pooled(frozen, measured, cost=True)
    problems, counts = compare(rep, frozen["ref"])
    print("leaves:", counts)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])
    assert counts["recomputed"] > 300 and counts["counted"] > 0
    assert rep["verdict"] == {"passed": True, "failed": []}
    # the planted head's original gauge is resolved for some queries and not for others
    unresolved = [h["original_gauge_unresolved_queries"] for lr in rep["layers"].values()
                  for h in lr["heads"]]
    assert any(unresolved) and not all(unresolved)


def test_the_committed_run_wrote_what_the_frozen_items_pool_to(frozen, measured):
    """The frozen report is the pooling of the frozen items (the file is one run's): the same
    sections, counts, flags and verdict, and the same counted work (the floats themselves are
    this machine's rounding, compared with the reference above)."""
    rep = pooled(frozen, measured, cost=True)
    written = loads(dumps(frozen["report"]))
    for k in ("layers", "replication_style_descent", "verdict"):
        assert decisions(rep[k]) == decisions(written[k]), k
    assert {k: v["flops"] for k, v in rep["cost"]["phases"].items()} == \
        {k: v["flops"] for k, v in written["cost"]["phases"].items()}


def _planted(done: list, layer: int, head: int, key: str, value: float) -> list:
    """``done`` with ``key`` of one head's final query set to ``value`` in every context."""
    out = []
    for c, L, res in done:
        if L == layer:
            res = copy.deepcopy(res)
            res.arrays[key][head, -1] = value
        out.append((c, L, res))
    return out


PLANTS = {  # the per-query array scaled at one query of one head, the check it must fail
    "identity": ("id_abs", "id_bound", "identity_float64"),
    "float64 readout": ("native_abs", "native_bound", "float64_vs_native"),
    "original gauge": ("native_orig_abs", "native_orig_bound",
                       "float64_original_gauge_vs_native"),
    "model dtype": ("lp_abs", "lp_bound", "model_dtype_vs_native"),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_a_planted_failure_reaches_the_verdict(frozen, measured, name):
    """One query's error pushed past its bound fails exactly that check of that head, and the
    verdict names it; a NaN error fails the check and ``finite`` where that is checked."""
    err, bound, check = PLANTS[name]
    done = measured
    L, h = frozen["layers"][-1], 1
    res = next(r for _c, LL, r in done if LL == L)
    b = res.arrays[bound][h, -1]
    if err == "id_abs":  # the identity's bound is relative to the value scale
        b = b * res.value_scale[h]
    rep = pooled(frozen, _planted(done, L, h, err, 4.0 * b))
    head = rep["layers"][str(L)]["heads"][h]
    assert [k for k, v in head["checks"].items() if not v] == [check]
    assert rep["verdict"] == {"passed": False, "failed": [f"layer {L} head {h}: {check}"]}
    others = [hh["passed"] for LL, lr in rep["layers"].items() for hh in lr["heads"]
              if (LL, hh["head"]) != (str(L), h)]
    assert all(others)
    nan = pooled(frozen, _planted(done, L, h, err, math.nan))
    failed = [k for k, v in nan["layers"][str(L)]["heads"][h]["checks"].items() if not v]
    assert check in failed and (err == "native_orig_abs" or "finite" in failed), failed


def test_an_item_error_reaches_the_verdict(frozen, measured):
    done = measured
    c, L, res = done[0]
    res = copy.deepcopy(res)
    res.errors.append(f"layer {L}: planted overflow")
    rep = pooled(frozen, [(c, L, res), *done[1:]])
    assert rep["layers"][str(L)]["errors"] == [f"layer {L}: planted overflow"]
    assert rep["layers"][str(L)]["passed"] is False
    assert rep["verdict"] == {"passed": False, "failed": [f"layer {L}: planted overflow"]}


def test_the_replication_count_takes_each_contexts_final_query(frozen, measured):
    """The replication-style count from the measured items by hand: the final query's flag and
    lambda_max of each head, per layer and pooled."""
    done = measured
    rep = pooled(frozen, done)["replication_style_descent"]
    total_inc = total_heads = 0
    lams = []
    for L in frozen["layers"]:
        inc = np.concatenate([r.arrays["inc_query"][:, -1] for _c, LL, r in done if LL == L])
        lam = np.concatenate([r.arrays["lam_query"][:, -1] for _c, LL, r in done if LL == L])
        got = rep["per_layer"][str(L)]
        assert (got["increase"], got["heads"]) == (int((inc > 0).sum()), inc.size)
        assert got["lambda_max_median"] == pytest.approx(float(np.median(lam)), rel=1e-15)
        assert got["lambda_max_max"] == pytest.approx(float(lam.max()), rel=1e-15)
        total_inc, total_heads = total_inc + int((inc > 0).sum()), total_heads + inc.size
        lams.append(lam)
    allla = np.concatenate(lams)
    assert (rep["pooled"]["increase"], rep["pooled"]["heads"]) == (total_inc, total_heads)
    assert rep["pooled"]["lambda_max_median"] == pytest.approx(float(np.median(allla)),
                                                               rel=1e-15)
    assert rep["pooled"]["lambda_max_max"] == pytest.approx(float(allla.max()), rel=1e-15)


def test_replication_only_pools_no_layers(frozen, measured):
    done = measured
    layers, replication, failed = layercheck.pool(done, frozen["specs"], frozen["layers"],
                                             frozen["length"], frozen["lp_dtype"], True)
    assert layers == {} and failed == []
    assert replication["pooled"]["heads"] == len(done) * frozen["specs"][0][0].n_heads


def test_the_file_is_one_run_of_the_reference_test(frozen):
    """The frozen inputs are those of test_reference_atlas's command (so that file's leaf
    classes and tolerances apply)."""
    assert frozen["report"]["config"]["contexts"] == int(TINY_ARGS[1])
    assert frozen["report"]["config"]["length"] == int(TINY_ARGS[3])
    assert frozen["report"]["config"]["anchor_every"] == int(TINY_ARGS[7])


def test_replication_only_measures_what_the_full_run_measures(frozen, measured):
    """``--replication-only`` measures the final query alone (``final_query_only``): its
    lambda_max and unit-step flag are the full measurement's at that query (which the first
    test checks against the reference), and nothing else is measured."""
    kw = {"device": "cpu", "max_bytes": frozen["items"][0][3]["max_bytes"]}
    (c0, L0, args0, kw0), = frozen["items"][:1]
    spec0, w0, x0, pos0, native0 = args0
    # the same on sparse positions (the analytic RoPE tables: the run's stop at its length),
    # where the queries' positions matter beyond their order
    sparse = replace(spec0, rope=replace(spec0.rope, cos=None, sin=None))
    pos3 = 3 * torch.as_tensor(pos0)
    full3 = layercheck.evaluate_layer(sparse, w0, x0, pos3, native0, **kw0)
    cases = [(L, args, full) for (c, L, args, _kw), (_c, _L, full) in zip(frozen["items"],
                                                                          measured)]
    cases.append((L0, (sparse, w0, x0, pos3), full3))
    for L, args, full in cases:
        spec, w, x, positions = args[:4]
        timers: dict = {}
        t0 = time.perf_counter()
        got = layercheck.final_query_only(spec, w, x, positions, L, timers=timers, **kw)
        spent = time.perf_counter() - t0
        assert got.layer == L and 0 < timers["replication_descent"] <= spent
        timers = {"replication_descent": 5.0}  # accumulated over the run's items
        layercheck.final_query_only(spec, w, x, positions, L, timers=timers, **kw)
        assert 5.0 < timers["replication_descent"] <= 5.0 + 2 * spent + 1.0
        # the scales are placeholders (nothing of them is pooled) that keep the item savable
        H = spec.n_heads
        assert [a.tolist() for a in (got.value_scale, got.native_scale, got.qk_max)] == \
            [[1.0] * H, [1.0] * H, [0.0] * H]
        np.testing.assert_array_equal(got.arrays["inc_query"][:, -1],
                                      full.arrays["inc_query"][:, -1])
        # each is a certified lower end within LAMBDA_CERT_REL of lambda_max (fast.lambda_max)
        # of Gram matrices that differ by their summation order (n u ||G||, far below it)
        np.testing.assert_allclose(got.arrays["lam_query"][:, -1],
                                   full.arrays["lam_query"][:, -1],
                                   rtol=2 * tolerances.LAMBDA_CERT_REL, atol=0)
        assert sorted(got.arrays) == sorted(layercheck.PER_QUERY)
        for k, v in got.arrays.items():
            rest = v if k not in ("inc_query", "lam_query") else v[:, :-1]
            assert np.isnan(rest).all(), k
        assert got.errors == []


def test_an_item_round_trips_through_the_run_directory(measured):
    """``--run-dir`` keeps each item as ``_result_to_arrays`` lays it out; ``--resume`` reads it
    back with ``_result_from_arrays``: bit for bit, and an item of another version's statistics
    (one missing, one added, a scale missing) is refused, not half read."""
    items = [*measured, (7, 1, copy.deepcopy(measured[-1][2]))]
    items[-1][2].errors.append("layer 1: float64 original gauge: planted overflow")
    for c, L, res in items:
        arrays, meta = atlas._result_to_arrays(res, c, 64)
        assert meta == {"context": c, "layer": L, "errors": list(res.errors), "m": 64}
        back, m = atlas._result_from_arrays(arrays, meta)
        assert (m, back.layer, back.errors) == (64, L, res.errors)
        assert sorted(back.arrays) == sorted(res.arrays) == sorted(layercheck.PER_QUERY)
        for k, v in res.arrays.items():
            assert back.arrays[k].tobytes() == v.tobytes(), k
        for k in ("value_scale", "native_scale", "qk_max"):
            assert getattr(back, k).tobytes() == getattr(res, k).tobytes(), k
    for change in ({"drop": "arrays.tv"}, {"drop": "qk_max"}, {"drop": "value_scale"},
                   {"add": "arrays.new_statistic"}):
        bad = dict(arrays)
        if "drop" in change:
            del bad[change["drop"]]
        else:
            bad[change["add"]] = arrays["arrays.tv"]
        with pytest.raises(atlas.AtlasError, match=f"context {c} layer {L} holds other "
                           "statistics than this version computes: start without --resume"):
            atlas._result_from_arrays(bad, meta)


def test_same_report_compares_every_number_but_the_machines(frozen):
    """``same_report`` (the distributed and resume tests' criterion): timings, the process
    layout, the environment, memory, the command line and the cost's seconds and rates may
    differ; any statistic, the verdict or a counted flop may not."""
    a = loads(dumps(frozen["report"]))
    b = copy.deepcopy(a)
    for k in ("run", "timing_seconds", "environment", "peak_rss_mib", "command"):
        b[k] = "another machine"
    ph = next(iter(b["cost"]["phases"]))
    for k in b["cost"]["phases"][ph]:
        if k != "flops":
            b["cost"]["phases"][ph][k] = -1.0
    for k in b["cost"]:
        if k != "phases":
            b["cost"][k] = "another machine"
    assert atlas.same_report(a, b) and atlas.same_report(b, a)
    changes = {
        "a counted flop": ("cost", "phases", ph, "flops"),
        "a statistic": ("layers", "0", "heads", 0, "spread", "max"),
        "the replication count": ("replication_style_descent", "pooled", "increase"),
        "a context": ("contexts", 0, "start"),
    }
    for name, path in changes.items():
        c = copy.deepcopy(a)
        node = c
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = node[path[-1]] + 1
        assert not atlas.same_report(a, c), name
        assert not atlas.same_report(c, a), name
    c = copy.deepcopy(a)
    c["verdict"] = {"passed": False, "failed": ["layer 0 head 0: finite"]}
    assert not atlas.same_report(a, c)
    c = copy.deepcopy(a)
    c["cost"] = None
    assert not atlas.same_report(a, c) and not atlas.same_report(c, a)
    c = copy.deepcopy(a)
    del c["cost"]  # an old report without the section: nothing counted on either side
    d = copy.deepcopy(c)
    assert atlas.same_report(c, d)


def _line(md: str, prefix: str) -> str:
    return next(ln for ln in md.splitlines() if ln.startswith(prefix))


def test_the_markdown_prints_cost_time_model_and_verdict_as_written_here(frozen):
    """The frozen report with hand-set numbers at rounding boundaries (0.75 prints 0.8 at one
    decimal, 1.5 prints 2 at none, 0.125 prints 0.12 at two), expected lines written out."""
    r = loads(dumps(frozen["report"]))
    r["timing_seconds"] = {"model_forward": 0.75}
    r["peak_rss_mib"] = 2.5
    r["cost"]["matmul_flops_per_s"] = {"float64": 0.75e9, "float32": 2.25e9}
    r["cost"]["phases"] = {"project": {"flops": 1.5e9, "seconds": 0.75, "dtype": "float64",
                                       "achieved_flops_per_s": 0.75e9,
                                       "fraction_of_matmul": 0.125}}
    r["cost"].update(work_seconds=0.75, floor_seconds=0.75, fraction_of_matmul=0.125,
                     model_forward_seconds=0.75, work_over_model_forward=0.75,
                     floor_over_model_forward=0.75)
    md = atlas.render_markdown(r)
    assert "| model_forward | 0.8 |" in md.splitlines()
    assert _line(md, "Peak resident memory: ").startswith("Peak resident memory: 2 MiB. ")
    assert "this machine's GEMM rate measured in the same run (float64 0.8, float32 2.2 " \
           "GFLOP/s)." in " ".join(md.split())
    assert "| project | 2 | 0.8 | 0.8 | 0.12 |" in md.splitlines()
    assert _line(md, "Overall: ") == (
        "Overall: 0.8 s of work against a floor of 0.8 s at the GEMM rate (fraction 0.12); "
        "0.8x the model's own forwards (0.8 s; the floor 0.8x).")
    assert "**Verdict: PASS**" in md.splitlines()
    gg = copy.deepcopy(r)
    gg["model"].update(gguf_file="m.Q4_1.gguf", gguf_sha256="abc123", source="m-dir")
    assert _line(atlas.render_markdown(gg), "Model: ").endswith(
        "; file `m.Q4_1.gguf` sha256 `abc123`.")
    ck = copy.deepcopy(r)
    ck["model"].update(gguf_file=None, gguf_sha256=None, source="my-checkpoint")
    assert _line(atlas.render_markdown(ck), "Model: ").endswith(
        "; file `my-checkpoint` sha256 `None`.")
    bad = copy.deepcopy(r)
    bad["verdict"] = {"passed": False, "failed": [f"layer {i} head 0: finite" for i in range(11)]}
    assert _line(atlas.render_markdown(bad), "**Verdict: ") == (
        "**Verdict: FAIL** (11 failed: " + "; ".join(f"layer {i} head 0: finite"
                                                       for i in range(10)) + ")")


@pytest.mark.parametrize("family,Hk", [("dot", 2), ("cosine", 2), ("dot", 6)])
def test_replication_only_with_three_heads_per_kv_head(family, Hk):
    """A seeded layer with three query heads per KV head, or one (and, for the Cosine family,
    one temperature per head): the replication-only measurement of every head's final query is
    the full measurement's."""

    from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

    g = torch.Generator().manual_seed(5)
    m, H, d, n = 16, 6, 8, 12
    spec = HeadSpec(n_heads=H, n_kv_heads=Hk, head_dim=d, rope=RoPESpec(base=100.0),
                    family=family,
                    temperature=(0.3, 0.5, 0.7, 0.9, 1.1, 1.3) if family == "cosine" else None)
    w = HeadWeights(w_q=torch.randn(m, H, d, generator=g, dtype=torch.float64),
                    w_k=torch.randn(m, Hk, d, generator=g, dtype=torch.float64),
                    # small values: the step's change of E is then below 1 where it is up
                    w_v=1e-3 * torch.randn(m, Hk, d, generator=g, dtype=torch.float64))
    x = torch.randn(n, m, generator=g, dtype=torch.float64)
    pos = torch.arange(n)
    full = layercheck.evaluate_layer(spec, w, x, pos, torch.zeros(n, H, d, dtype=torch.float64),
                                anchor_every=4)
    got = layercheck.final_query_only(spec, w, x, pos, 0, device="cpu", max_bytes=1 << 20,
                                      timers={})
    np.testing.assert_array_equal(got.arrays["inc_query"][:, -1], full.arrays["inc_query"][:, -1])
    np.testing.assert_allclose(got.arrays["lam_query"][:, -1], full.arrays["lam_query"][:, -1],
                               rtol=2 * tolerances.LAMBDA_CERT_REL, atol=0)
    assert np.isfinite(got.arrays["lam_query"][:, -1]).all()
    if Hk < H:  # these draws have heads on both sides of the unit step's test
        assert 0 < got.arrays["inc_query"][:, -1].sum() < H
    # the heads differ (so that a head read for another is seen)
    assert len(set(np.round(got.arrays["lam_query"][:, -1], 6))) == H


def _seeded_layer(family: str, Hk: int = 2, n: int = 12, value_scale: float = 1.0,
                  softcap: float | None = None, window: int | None = None,
                  base: float | tuple = 100.0):
    from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

    g = torch.Generator().manual_seed(5)
    m, H, d = 16, 6, 8
    spec = HeadSpec(n_heads=H, n_kv_heads=Hk, head_dim=d, rope=RoPESpec(base=base),
                    family=family, softcap=softcap, window=window,
                    temperature=(0.3, 0.5, 0.7, 0.9, 1.1, 1.3) if family == "cosine" else None)
    w = HeadWeights(w_q=torch.randn(m, H, d, generator=g, dtype=torch.float64),
                    w_k=torch.randn(m, Hk, d, generator=g, dtype=torch.float64),
                    w_v=value_scale * torch.randn(m, Hk, d, generator=g, dtype=torch.float64))
    x = torch.randn(n, m, generator=g, dtype=torch.float64)
    return spec, w, x


@pytest.mark.parametrize("family,softcap,window", [("dot", None, None), ("cosine", None, None),
                                                   ("dot", 2.0, None), ("dot", None, 7)])
def test_frozen_reuse_against_the_per_query_api(family, softcap, window):
    """The atlas's frozen-reuse, constant-anchor and cache-mean errors and TV distances of every
    query, against the fast layer's per-query API (``fast.step`` on each query's own causal
    prefix; ``fast.frozen_reuse`` with the anchor and the query both at the anchor's position,
    the paper's setting) -- for a dot layer and for a Cosine one, whose score is not affine in
    the input (query space: the anchor's rotation applied to the query's unrotated, normalised
    query), for soft-capped scores (the softmax of ``cap tanh(s / cap)``) and for a sliding
    window (7 positions: 3 keys at this spacing).  Anchors every 5 of 12 positions, on positions
    0, 2, 4, ... (the analytic RoPE tables); the sink mass is the first key's probability."""
    from ropestep import fast

    spec, w, x = _seeded_layer(family, softcap=softcap, window=window)
    n, H = x.shape[0], spec.n_heads
    pos = 2 * torch.arange(n)
    got = layercheck.evaluate_layer(spec, w, x, pos, torch.zeros(n, H, spec.head_dim,
                                                            dtype=torch.float64),
                               anchor_every=5)
    V = float(w.w_v.abs().max() * x.abs().sum(-1).max())  # bounds every |v_j|
    tol = 8 * tolerances.agreement_rel_tol(torch.float64, n, spec.head_dim, x.shape[1]) * V

    def own(i: int):
        return fast.step(spec, w, x[i:i + 1], pos[i:i + 1], x[:i + 1], pos[:i + 1])

    for i in range(n):
        a = 5 * (i // 5)
        if i == a:  # the anchors themselves: not measured
            for k in ("reuse_frozen", "reuse_const", "reuse_mean", "tv"):
                assert np.isnan(got.arrays[k][:, i]).all(), (k, i)
            continue
        yi, ya = own(i), own(a)
        st = fast.step(spec, w, x[[a, i]], pos[[a, a]], x[:a + 1], pos[:a + 1])
        fr = fast.frozen_reuse(st, anchor=0, bound=False).frozen[:, 1]  # (H, r)
        want = {"reuse_frozen": (yi.y[:, 0] - fr).norm(dim=-1),
                "reuse_const": (yi.y[:, 0] - ya.y[:, 0]).norm(dim=-1),
                "reuse_mean": (yi.y[:, 0] - yi.mu[:, 0]).norm(dim=-1)}
        for k, v in want.items():
            np.testing.assert_allclose(np.sqrt(got.arrays[k][:, i]), v.numpy(), rtol=0,
                                       atol=tol, err_msg=f"{k} at query {i}")
        # against a zero "model output" the readouts' errors are the outputs' sizes: the float64
        # readouts to float64 rounding, the float32 one within its own bound
        ymax = yi.y[:, 0].abs().amax(-1).numpy()
        for k in ("native_abs", "native_orig_abs"):
            np.testing.assert_allclose(got.arrays[k][:, i], ymax, rtol=0, atol=tol,
                                       err_msg=f"{k} at query {i}")
        assert (np.abs(got.arrays["lp_abs"][:, i] - ymax) <= got.arrays["lp_bound"][:, i]).all()
        # the attention rows: the softmax of each query's (capped) scores over its permitted keys
        def probs(st_):
            z = st_.s[:, 0] if softcap is None else softcap * torch.tanh(st_.s[:, 0] / softcap)
            return torch.softmax(z.masked_fill(~st_.mask[0], -math.inf), -1)

        pi = probs(yi)
        pa = torch.zeros(H, i + 1, dtype=torch.float64)
        pa[:, :a + 1] = probs(ya)
        tv = 0.5 * (pi - pa).abs().sum(-1)
        np.testing.assert_allclose(got.arrays["sink"][:, i], pi[:, 0].numpy(), rtol=0,
                                   atol=1e-13, err_msg=f"sink at query {i}")
        # probabilities carry ~(N + score range) u each: 1e-12 bounds a sum of 12 of them
        np.testing.assert_allclose(got.arrays["tv"][:, i], tv.numpy(), rtol=0, atol=1e-12)


def test_evaluate_layer_defaults_timers_and_refusal():
    """Called with its defaults: layer 0, anchors every 64 positions, float32 as the model's
    dtype; each phase's seconds are added to ``timers`` (accumulated over calls); an ALiBi
    layer is refused naming the layer."""
    spec, w, x = _seeded_layer("dot", n=70)
    n = x.shape[0]
    native = torch.zeros(n, spec.n_heads, spec.head_dim, dtype=torch.float64)
    timers: dict = {}
    t0 = time.perf_counter()
    res = layercheck.evaluate_layer(spec, w, x, torch.arange(n), native, timers=timers)
    spent = time.perf_counter() - t0
    assert res.layer == 0
    assert np.isnan(res.arrays["reuse_frozen"]).all(0).nonzero()[0].tolist() == [0, 64]
    phases = ["project", "float64_original", "float32_maxkey", "float64_maxkey"]
    assert sorted(timers) == sorted(phases)
    assert all(timers[k] > 0 for k in phases) and sum(timers.values()) <= spent
    timers = {k: 100.0 for k in phases}  # a run's earlier items
    t0 = time.perf_counter()
    layercheck.evaluate_layer(spec, w, x, torch.arange(n), native, timers=timers)
    spent = time.perf_counter() - t0
    assert all(0 < timers[k] - 100.0 <= spent for k in phases)
    # float64 numpy throughout, as the LayerResult says (a float32 model output included)
    res32 = layercheck.evaluate_layer(spec, w, x, torch.arange(n), native.float())
    assert all(a.dtype == np.float64 for a in res32.arrays.values())
    assert [a.dtype for a in (res32.value_scale, res32.native_scale, res32.qk_max)] == \
        [np.float64] * 3
    # qk_max bounds every |score|: max |q~_i| max |k~_j| / sqrt(d), rotations kept norms
    g = spec.n_heads // spec.n_kv_heads
    xq = np.einsum("nm,mhd->nhd", x.numpy(), w.w_q.numpy())
    xk = np.einsum("nm,mgd->ngd", x.numpy(), w.w_k.numpy())
    want = [np.linalg.norm(xq[:, h], axis=-1).max() * np.linalg.norm(xk[:, h // g], axis=-1).max()
            / math.sqrt(spec.head_dim) for h in range(spec.n_heads)]
    np.testing.assert_allclose(res.qk_max, want, rtol=1e-12, atol=0)
    assert (res.arrays["score_abs"] <= res.qk_max[:, None] * (1 + 1e-12)).all()
    # ALiBi: the step statistics (phi = id, no bias coordinate) are not defined, the rest is
    ali = replace(spec, alibi_slopes=(0.5,) * spec.n_heads)
    res_a = layercheck.evaluate_layer(ali, w, x, torch.arange(n), native)
    assert not layercheck._descent_defined(ali) and layercheck._descent_defined(spec)
    assert np.isnan(res_a.arrays["lam_query"]).all()
    assert np.isfinite(res_a.arrays["id_abs"]).all()


@pytest.mark.parametrize("lp", [torch.float32, torch.bfloat16])
def test_each_querys_bounds_are_its_own_heads(lp):
    """The kappa-aware bounds of every (head, query) are ``model_dtype_native_bound`` of that
    head's own measurements -- its kappa in the gauge the readout used, its causal prefix, its
    largest score, its qk and value and output scales -- on a layer with three query heads per
    KV head (heads of one chunk that could be paired wrongly).  This checks the wiring of the
    bound's arguments; the bound's formula is tests/test_tolerance_power.py's."""
    spec, w, x = _seeded_layer("dot", n=20)
    n, H, d, m = x.shape[0], spec.n_heads, spec.head_dim, x.shape[1]
    g = torch.Generator().manual_seed(9)
    native = torch.randn(n, H, d, generator=g, dtype=torch.float64)
    res = layercheck.evaluate_layer(spec, w, x, torch.arange(n), native, anchor_every=8,
                               lp_dtype=lp)
    A = res.arrays
    for key, kap, arith in (("native_orig_bound", "kappa_original", torch.float64),
                            ("native_bound", "kappa_maxkey", torch.float64),
                            ("lp_bound", "kappa_maxkey", lp)):
        for h in range(H):  # one chunk holds every query of a head here (20 of them):
            # the model-side term takes the chunk's longest prefix, as the bound says
            want = tolerances.model_dtype_native_bound(
                lp, A[kap][h][None], np.arange(1.0, n + 1)[None], d, m,
                A["score_abs"][h][None], np.array([[res.qk_max[h]]]),
                np.array([[res.value_scale[h]]]), np.array([[res.native_scale[h]]]),
                arith=arith)
            np.testing.assert_allclose(A[key][h], np.asarray(want)[0], rtol=1e-13, atol=0,
                                       err_msg=f"{key} head {h}")
    # the identity's float64 bound, relative to the value scale: the query's kappa, its causal
    # prefix, the head dimension and its largest score, at least float64's floor
    for h in range(H):
        want = np.maximum(tolerances.readout_bound(
            torch.float64, A["kappa_original"][h][None], np.arange(1.0, n + 1)[None], d,
            A["score_abs"][h][None]), tolerances.FLOAT64_REL)
        np.testing.assert_allclose(A["id_bound"][h], np.asarray(want)[0], rtol=1e-13, atol=0,
                                   err_msg=f"id_bound head {h}")


def test_an_overflowing_original_gauge_is_an_error_naming_the_layer():
    """Scores ~1e4 below the original gauge's anchor: its coefficients overflow float64, which
    the item records as an error naming the layer and the pass (never a silent NaN); the
    max-key passes still measure."""
    from ropestep.spec import HeadWeights

    spec, w, x = _seeded_layer("dot", n=10)
    w = HeadWeights(w_q=30.0 * w.w_q, w_k=30.0 * w.w_k, w_v=w.w_v)
    res = layercheck.evaluate_layer(spec, w, x, torch.arange(10),
                               torch.zeros(10, spec.n_heads, spec.head_dim, dtype=torch.float64),
                               layer=3)
    assert len(res.errors) == 1
    assert res.errors[0].startswith("layer 3: float64 original gauge: gauge 'original' "
                                    "overflows in torch.float64")
    assert np.isfinite(res.arrays["native_abs"]).all() and np.isfinite(res.arrays["lp_abs"]).all()


def test_the_markdown_per_layer_rows_say_n_a_and_no(frozen):
    """A layer whose input-space statistics are not defined (QK-norm) prints n/a in their two
    columns; one whose descent statistics are not defined (soft-capped scores) in all four
    lambda / E columns; a failed layer says **NO**; the cost line without the model's forwards
    ends after the fraction."""
    r = loads(dumps(frozen["report"]))
    L0, L1 = sorted(r["layers"])[:2]
    r["layers"][L0]["input_space"] = "not defined: the 'qknorm' score is not affine in u"
    r["layers"][L1]["descent"] = "not defined: soft-capped scores"
    r["layers"][L1]["passed"] = False
    for k in ("work_over_model_forward", "model_forward_seconds", "floor_over_model_forward"):
        del r["cost"][k]
    md = atlas.render_markdown(r)

    def row(L: str) -> list[str]:  # the per-layer table's row (the replication's has 5 cells)
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
                for ln in md.splitlines() if ln.startswith(f"| {L} | ")]
        return next(c for c in rows if len(c) == 15)

    # columns: layer, pass, identity, f64 vs native, unresolved, dtype vs native, bound ratio,
    # kappa, sink, lambda q, lambda in, E up q, E up in, rRMSE vs const, vs mean
    a, b = row(L0), row(L1)
    assert [a[i] == "n/a" for i in range(15)] == [i in (10, 12) for i in range(15)]
    assert [b[i] == "n/a" for i in range(15)] == [i in (9, 10, 11, 12) for i in range(15)]
    assert (a[1], b[1]) == ("yes", "**NO**")
    assert _line(md, "Overall: ").endswith(" at the GEMM rate (fraction "
                                           f"{r['cost']['fraction_of_matmul']:.2f}).")


def test_overflowing_readouts_are_errors_naming_the_layer_and_pass():
    """Values near the float range: the model-dtype readout overflows first (1e37), then all
    three passes (1e307); each is an error naming the layer, the pass and its gauge."""
    from ropestep.spec import HeadWeights

    spec, w, x = _seeded_layer("dot", n=10)
    native = torch.zeros(10, spec.n_heads, spec.head_dim, dtype=torch.float64)
    passes = {"o": "layer 2: float64 original gauge: gauge 'original': the readout",
              "l": "layer 2: torch.float32 max-key gauge: gauge 'maxkey': the readout",
              "m": "layer 2: float64 max-key gauge: gauge 'maxkey': the readout"}
    for f, want in ((1e37, "l"), (1e307, "olm")):
        w2 = HeadWeights(w_q=w.w_q, w_k=w.w_k, w_v=f * w.w_v)
        res = layercheck.evaluate_layer(spec, w2, x, torch.arange(10), native, layer=2)
        assert len(res.errors) == len(want), res.errors
        for e, k in zip(res.errors, want):
            assert e.startswith(passes[k]), e


@pytest.mark.parametrize("base", [100.0, (20.0, 50.0, 100.0, 300.0, 1e3, 1e4)])
def test_descent_statistics_against_the_per_query_api(base):
    """lambda_max and the unit step's test of every query, in input space (the paper's) and in
    query space (the replication's), against ``fast.descent`` and ``fast.query_descent`` on each
    query's own causal prefix -- one RoPE base, and one per head (its own tables per head).
    Small values, so that the step's change of E lies below 1 where it is up."""
    from ropestep import fast

    spec, w, x = _seeded_layer("dot", n=16, value_scale=1e-3, base=base)
    n, H = x.shape[0], spec.n_heads
    pos = torch.arange(n)
    got = layercheck.evaluate_layer(spec, w, x, pos, torch.zeros(n, H, spec.head_dim,
                                                            dtype=torch.float64),
                               anchor_every=4).arrays
    ups = {"input": 0, "query": 0}
    for i in range(n):
        st = fast.step(spec, w, x[i:i + 1], pos[i:i + 1], x[:i + 1], pos[:i + 1])
        for space, dc in (("input", fast.descent(st)), ("query", fast.query_descent(st))):
            # two float64 routes to lambda_max of the same matrix (certified Lanczos on d x d
            # against the factor-space problem): agreement to ~d n u cond, 1e-9 relative
            np.testing.assert_allclose(got[f"lam_{space}"][:, i], dc.lam_max[:, 0].numpy(),
                                       rtol=1e-9, atol=0, err_msg=f"{space} query {i}")
            # the flags compared exactly: every change of E lies clear of the rounding (the
            # first query has one key: no step, E = 0 before and after)
            dE = (dc.e1 - dc.e0).abs()
            assert ((dE > 1e-8 * dc.e0.abs()) | (i == 0)).all(), (space, i)
            up = (dc.e1 > dc.e0)[:, 0].double().numpy()
            np.testing.assert_array_equal(got[f"inc_{space}"][:, i], up,
                                          err_msg=f"{space} query {i}")
            ups[space] += int(up.sum())
    assert ups["input"] > 0 and ups["query"] > 0


def test_spearman_by_hand():
    nan = math.nan
    # pairs with a non-finite side dropped: ranks (0,1,2) against (1,0,2): 1/2
    assert layercheck._spearman(np.array([1.0, 2.0, nan, 4.0, 5.0]),
                           np.array([2.0, 1.0, 3.0, 5.0, np.inf])) == pytest.approx(0.5)
    # ranks (0,1,2,3) against (1,0,3,2): 3/5
    assert layercheck._spearman(np.array([1.0, 2.0, 4.0, 5.0]),
                           np.array([2.0, 1.0, 5.0, 4.0])) == pytest.approx(0.6)
    # three pairs are enough, two are not
    assert layercheck._spearman(np.array([1.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0])) == \
        pytest.approx(0.5)
    assert math.isnan(layercheck._spearman(np.array([1.0, 2.0, nan]), np.array([1.0, 3.0, 2.0])))


def test_ratio_is_quiet_about_zero_bounds():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = layercheck._ratio(np.array([1.0, 0.0, 2.0]), np.array([0.0, 0.0, 4.0]))
    assert got[0] == math.inf and math.isnan(got[1]) and got[2] == 0.5


def test_cost_counts_each_items_work_and_sums_the_ranks_seconds(monkeypatch):
    """``_cost`` on hand-made items: each item's work is ``cost.atlas_flops`` of its own sizes
    and score family (a windowed, soft-capped Cosine layer; a plain one), the seconds are the
    processes' sums, the GEMM rates are measured for float64 and the model's dtype on the run's
    device, and the model's forwards come from the timers."""
    from ropestep import cost

    rates = []

    def rate(dtype, device="cpu"):
        rates.append((dtype, device))
        return 1e9 if dtype == torch.float64 else 4e9

    monkeypatch.setattr(cost, "matmul_rate", rate)
    plain = _seeded_layer("dot")[0]
    odd = _seeded_layer("cosine")[0]  # not affine
    capped = _seeded_layer("dot", softcap=2.0, window=7)[0]
    specs = {0: (plain, 16), 1: (odd, 16), 2: (capped, 16)}

    def item(L, N):
        arrays = {k: np.zeros((6, N)) for k in layercheck.PER_QUERY}
        return layercheck.LayerResult(L, arrays, np.ones(6), np.ones(6), np.zeros(6))

    done = [(0, 0, item(0, 12)), (0, 1, item(1, 12)), (0, 2, item(2, 12)), (1, 0, item(0, 9))]
    parts = [{"timers": {"project": 1.0, "float64_original": 2.0, "float32_maxkey": 0.5,
                         "float64_maxkey": 0.25, "model_forward": 3.0}},
             {"timers": {"project": 0.5, "float64_original": 1.0, "model_forward": 1.5}}]
    got = atlas._cost(done, specs, parts, torch.float32, "cpu")
    want: dict = {}
    for N, sp in ((12, plain), (12, odd), (12, capped), (9, plain)):
        for k, v in cost.atlas_flops(N=N, d=8, r=8, m=16, H=6, H_kv=2, affine=sp.affine,
                                     softcap=sp.softcap is not None, window=sp.window).items():
            want[k] = want.get(k, 0.0) + v
    assert got["phases"]["project"]["flops"] == want["project"]
    assert got["phases"]["float32_maxkey"]["flops"] == want["lowp_maxkey"]
    assert {k: v["seconds"] for k, v in got["phases"].items()} == {
        "project": 1.5, "float64_original": 3.0, "float32_maxkey": 0.5, "float64_maxkey": 0.25}
    assert rates == [(torch.float64, "cpu"), (torch.float32, "cpu")]
    assert got["matmul_flops_per_s"] == {"float64": 1e9, "float32": 4e9}
    assert got["model_forward_seconds"] == 4.5  # both processes' forwards
    rates.clear()  # the model's dtype names its phase, its rate and the timer read
    bf = atlas._cost(done, specs, [{"timers": {"bfloat16_maxkey": 2.0, "float32_maxkey": 9.0}}],
                     torch.bfloat16, "cpu")
    assert rates == [(torch.float64, "cpu"), (torch.bfloat16, "cpu")]
    assert bf["phases"] == {"bfloat16_maxkey": {
        "flops": want["lowp_maxkey"], "seconds": 2.0, "dtype": "bfloat16",
        "achieved_flops_per_s": want["lowp_maxkey"] / 2.0,
        "fraction_of_matmul": want["lowp_maxkey"] / 2.0 / 4e9}}
    # the odd layer's family, cap and window change its count (so each is read)
    base = cost.atlas_flops(N=12, d=8, r=8, m=16, H=6, H_kv=2)
    assert cost.atlas_flops(N=12, d=8, r=8, m=16, H=6, H_kv=2, affine=False) != base
    assert cost.atlas_flops(N=12, d=8, r=8, m=16, H=6, H_kv=2, softcap=True) != base
    assert cost.atlas_flops(N=12, d=8, r=8, m=16, H=6, H_kv=2, window=7) != base
    for k in want:
        assert got["phases"].get(k.replace("lowp", "float32"), {"flops": want[k]})["flops"] \
            == want[k]


def _hand_results(seed: int = 3, H: int = 2, N: int = 8):
    """Two contexts' per-query arrays drawn by hand, scales far from 1 (4 and 1/2, 8 and 1/4),
    a few exact boundaries: head 0's identity error at its bound, its float64 and original-gauge
    errors at theirs, head 1's original-gauge excess at exactly the model's level, anchors (NaN
    reuse) at queries 0 and 4."""
    rng = np.random.default_rng(seed)
    out = []
    for c, (vs, ns) in enumerate((([4.0, 0.5], [8.0, 0.25]), ([2.0, 1.0], [16.0, 0.5]))):
        A = {k: rng.uniform(0.1, 1.0, (H, N)) for k in layercheck.PER_QUERY}
        # the original gauge resolves the model's output (its bound within the model's level
        # of the max-key one) but at query 1 (1e3 above); at query 2 of head 0, context 0 its
        # excess 6 x the level lies between the value scale's 4 and the output scale's 8
        A["native_orig_bound"] = A["native_bound"].copy()
        A["native_orig_bound"][:, 1] += 1e3
        if c == 0:
            A["native_orig_bound"][0, 2] += 6.0 * tolerances.native_rel_tol(N, 8, 16)
        else:  # head 1, query 3: an excess of exactly the level, which is not "more than" it
            # (p = level x output scale; 2p and 2p - p = p are exact: Sterbenz)
            p = tolerances.native_rel_tol(N, 8, 16) * ns[1]
            A["native_bound"][1, 3], A["native_orig_bound"][1, 3] = p, 2.0 * p
        A["id_bound"] = rng.uniform(0.2, 0.4, (H, N))
        A["id_abs"] = A["id_bound"] * np.array(vs)[:, None] * rng.uniform(0.1, 0.9, (H, N))
        for k, b in (("native_abs", "native_bound"), ("native_orig_abs", "native_orig_bound"),
                     ("lp_abs", "lp_bound")):
            A[k] = A[b] * rng.uniform(0.1, 0.9, (H, N))
        if c == 0:  # exact boundaries: an error at its bound passes
            A["id_abs"][0, 3] = A["id_bound"][0, 3] * vs[0]
            A["native_abs"][0, 2] = A["native_bound"][0, 2]
            A["native_orig_abs"][0, 5] = A["native_orig_bound"][0, 5]
            A["lp_abs"][0, 6] = A["lp_bound"][0, 6]
        A["inc_query"] = (A["inc_query"] > 0.5).astype(float)
        A["inc_input"] = (A["inc_input"] > 0.4).astype(float)
        for k in ("reuse_frozen", "reuse_const", "reuse_mean", "tv"):
            A[k][:, [0, 4]] = np.nan
        out.append(layercheck.LayerResult(1, A, np.array(vs), np.array(ns),
                                     rng.uniform(1.0, 9.0, H)))
    return out


def _ranks_spearman(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_summarise_layer_by_hand():
    """Every per-head statistic of ``summarise_layer`` recomputed here from its definition in
    docs/protocol.md (the relative errors against their own context's scale, the bound ratios,
    the pooled medians, means and maxima, the reuse rRMSEs and quartile bins), on hand-drawn
    arrays whose scales are far from 1 -- where a wrong denominator shows."""
    from ropestep.spec import HeadSpec

    res = _hand_results()
    N, d, m, H = 8, 8, 16, 2
    spec = HeadSpec(n_heads=H, n_kv_heads=1, head_dim=d)
    out = layercheck.summarise_layer(res, spec, m, N, torch.float32)
    assert out["errors"] == [] and out["passed"] is True
    ntol = tolerances.native_rel_tol(N, d, m)
    for h, got in enumerate(out["heads"]):
        cat = {k: np.concatenate([r.arrays[k][h] for r in res]) for k in layercheck.PER_QUERY}
        vs = np.concatenate([np.full(N, r.value_scale[h]) for r in res])
        ns = np.concatenate([np.full(N, r.native_scale[h]) for r in res])
        sel = ~np.isnan(cat["reuse_frozen"])
        fr, co, me, tv = (cat[k][sel] for k in ("reuse_frozen", "reuse_const", "reuse_mean",
                                                  "tv"))
        rel = np.sqrt(fr / me)
        want = {
            "identity_float64_rel_max": np.max(cat["id_abs"] / vs),
            "identity_float64_bound_ratio_max": np.max(cat["id_abs"] / vs / cat["id_bound"]),
            "float64_vs_native_rel": np.max(cat["native_abs"] / ns),
            "float64_vs_native_tol": ntol,
            "float64_vs_native_bound_ratio_max": np.max(cat["native_abs"] / cat["native_bound"]),
            "float64_original_gauge_vs_native_rel": np.max(cat["native_orig_abs"] / ns),
            "float64_original_gauge_bound_ratio_max":
                np.max(cat["native_orig_abs"] / cat["native_orig_bound"]),
            "original_gauge_unresolved_queries": 2,
            "model_dtype_vs_native_rel": np.max(cat["lp_abs"] / ns),
            "model_dtype_vs_native_kappa_blind_tol":
                tolerances.agreement_rel_tol(torch.float32, N, d, m),
            "model_dtype_vs_native_bound_ratio_max": np.max(cat["lp_abs"] / cat["lp_bound"]),
            "model_dtype_identity_rel": np.max(cat["lp_id_abs"] / vs),
            "kappa_original": {"median": np.median(cat["kappa_original"]),
                               "max": np.max(cat["kappa_original"])},
            "kappa_maxkey": {"median": np.median(cat["kappa_maxkey"]),
                             "max": np.max(cat["kappa_maxkey"])},
            "spread": {"median": np.median(cat["spread"]), "max": np.max(cat["spread"])},
            "sink_mass": {"mean": np.mean(cat["sink"]), "median": np.median(cat["sink"])},
            "lambda_max_query_space": {"median": np.median(cat["lam_query"]),
                                       "max": np.max(cat["lam_query"])},
            "lambda_max_input_space": {"median": np.median(cat["lam_input"]),
                                       "max": np.max(cat["lam_input"])},
            "step_increases_E_query_space": np.mean(cat["inc_query"]),
            "step_increases_E_input_space": np.mean(cat["inc_input"]),
            "value_scale": max(r.value_scale[h] for r in res),
            "native_scale": max(r.native_scale[h] for r in res),
        }
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-12), (h, k)
        r = got["reuse"]
        assert r["n_queries"] == int(sel.sum()) == 12
        assert r["rrmse_vs_constant_anchor"] == pytest.approx(np.sqrt(fr.sum() / co.sum()),
                                                              rel=1e-12)
        assert r["rrmse_vs_cache_mean"] == pytest.approx(np.sqrt(fr.sum() / me.sum()), rel=1e-12)
        assert r["relative_error_median"] == pytest.approx(np.median(rel), rel=1e-12)
        assert r["spearman_error_vs_tv"] == pytest.approx(_ranks_spearman(rel, tv), rel=1e-12)
        q = np.quantile(tv, [0, 0.25, 0.5, 0.75, 1])
        assert [(b["tv_lo"], b["tv_hi"], b["n"]) for b in r["by_tv_quartile"]] == [
            (q[i], q[i + 1], int(((tv >= q[i]) & (tv <= q[i + 1])).sum())) for i in range(4)]
        for i, b in enumerate(r["by_tv_quartile"]):
            inbin = (tv >= q[i]) & (tv <= q[i + 1])
            assert b["relative_error_median"] == pytest.approx(np.median(rel[inbin]), rel=1e-12)
        assert got["checks"] == {"identity_float64": True, "float64_vs_native": True,
                                 "float64_original_gauge_vs_native": True,
                                 "model_dtype_vs_native": True, "finite": True}


@pytest.mark.parametrize("key,bound,check", [
    ("id_abs", "id_bound", "identity_float64"),
    ("native_abs", "native_bound", "float64_vs_native"),
    ("native_orig_abs", "native_orig_bound", "float64_original_gauge_vs_native"),
    ("lp_abs", "lp_bound", "model_dtype_vs_native")])
def test_summarise_layer_fails_an_error_past_its_bound(key, bound, check):
    """One query's error at 1.5 times its bound fails exactly that check of that head."""
    from ropestep.spec import HeadSpec

    res = _hand_results()
    A = res[1].arrays
    A[key][1, 7] = 1.5 * A[bound][1, 7] * (res[1].value_scale[1] if key == "id_abs" else 1.0)
    out = layercheck.summarise_layer(res, HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8), 16, 8,
                                torch.float32)
    assert [k for k, v in out["heads"][1]["checks"].items() if not v] == [check]
    assert out["heads"][0]["passed"] and not out["heads"][1]["passed"] and not out["passed"]


def test_summarise_layer_kappa_blind_level_for_bfloat16_and_undefined_statistics():
    """Below float32 the kappa-blind level is native_rel_tol_lowp at the head's largest qk; a
    soft-capped layer says its descent statistics are not defined (None, with the reason); a
    layer whose score is not affine (QK-norm) says so of its input-space statistics only."""
    from ropestep.spec import HeadSpec

    res = _hand_results()
    out = layercheck.summarise_layer(res, HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8), 16, 8,
                                torch.bfloat16)
    for h in range(2):
        qk = max(r.qk_max[h] for r in res)
        assert out["heads"][h]["model_dtype_vs_native_kappa_blind_tol"] == \
            tolerances.native_rel_tol_lowp(torch.bfloat16, qk)
    capped = layercheck.summarise_layer(res, HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8,
                                                 softcap=30.0), 16, 8, torch.float32)
    assert capped["descent"].startswith("not defined: soft-capped scores (softcap 30.0)")
    assert "input_space" not in capped
    for hd in capped["heads"]:
        assert hd["lambda_max_query_space"] == {"median": None, "max": None}
        assert hd["lambda_max_input_space"] == {"median": None, "max": None}
        assert hd["step_increases_E_query_space"] is None
        assert hd["step_increases_E_input_space"] is None
    qk = layercheck.summarise_layer(res, HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8,
                                             family="qknorm"), 16, 8, torch.float32)
    assert "descent" not in qk and qk["input_space"].startswith("not defined: the 'qknorm'")
    for hd in qk["heads"]:
        assert hd["lambda_max_query_space"]["max"] is not None
        assert hd["lambda_max_input_space"] == {"median": None, "max": None}
        assert hd["step_increases_E_query_space"] is not None
        assert hd["step_increases_E_input_space"] is None


def test_small_helpers_by_hand():
    assert layercheck._binned(np.array([1.0, 2.0, 3.0]), np.array([0.1, 0.2, 0.3])) == []
    four = layercheck._binned(np.array([4.0, 3.0, 2.0, 1.0]), np.array([0.1, 0.2, 0.3, 0.4]))
    # quartiles of the TV 0.1 .. 0.4 at 0.175, 0.25, 0.325: one query per bin
    assert [(b["n"], b["relative_error_median"]) for b in four] == \
        [(1, 4.0), (1, 3.0), (1, 2.0), (1, 1.0)]
    assert four[0]["tv_lo"] == 0.1 and four[-1]["tv_hi"] == 0.4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(layercheck._max(np.array([]))) and math.isnan(layercheck._median(np.array([])))
    assert layercheck._max(np.array([1.0, np.nan])) != layercheck._max(np.array([1.0, np.nan]))  # NaN
    assert math.isnan(atlas._get({"a": {"b": None}}, ("a", "b")))
    assert atlas._get({"a": {"b": 3}}, ("a", "b")) == 3.0
    layers, vals = atlas.grid({"layers": {"1": {"heads": [{"x": None}, {"x": 2.0}]},
                                          "0": {"heads": [{"x": 1.0}, {"x": 0.5}]}}}, ("x",))
    assert layers == [0, 1] and vals[0].tolist() == [1.0, 0.5] and math.isnan(vals[1, 0])
    empty = layercheck.replication_style({}, {})
    assert empty["per_layer"] == {} and (empty["pooled"]["increase"],
                                         empty["pooled"]["heads"]) == (0, 0)
    assert math.isnan(empty["pooled"]["lambda_max_median"])
    assert math.isnan(empty["pooled"]["lambda_max_max"])


def test_pool_by_hand():
    """The replication count takes each context's final query (not the one before); a head
    failing two checks is one verdict line naming both; the items' order does not matter (the
    errors are listed in context order)."""
    from ropestep.spec import HeadSpec

    res = _hand_results()
    for c, r in enumerate(res):
        r.arrays["inc_query"][:, -1] = [1.0, 1.0]
        r.arrays["inc_query"][:, -2] = [0.0, 0.0]
        r.errors.append(f"layer 1: planted error of context {c}")
    r = res[1]
    r.arrays["id_abs"][0, 7] = 2 * r.arrays["id_bound"][0, 7] * r.value_scale[0]
    r.arrays["native_abs"][0, 6] = math.inf
    spec = HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8)
    done = [(0, 1, res[0]), (1, 1, res[1])]
    layers, rep, failed = layercheck.pool(done, {1: (spec, 16)}, [1], 8, torch.float32)
    assert rep["per_layer"]["1"]["increase"] == 4 and rep["per_layer"]["1"]["heads"] == 4
    assert failed == ["layer 1 head 0: identity_float64, float64_vs_native, finite",
                      "layer 1: planted error of context 0", "layer 1: planted error of context 1"]
    again = layercheck.pool(done[::-1], {1: (spec, 16)}, [1], 8, torch.float32)
    assert again[2] == failed and again[1] == rep


def test_summarise_layer_texts_and_reuse_denominators():
    """The not-defined texts as written; the rRMSEs with denominators below 1 (still computed)
    and zero (NaN, never a division by zero)."""
    from ropestep.spec import HeadSpec

    res = _hand_results()
    for r in res:
        for k in ("reuse_const", "reuse_mean"):
            r.arrays[k] *= 1e-3
    sp = HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8)
    out = layercheck.summarise_layer(res, sp, 16, 8, torch.float32)
    for h, hd in enumerate(out["heads"]):
        fr, co, me = (np.concatenate([r.arrays[k][h] for r in res])
                      for k in ("reuse_frozen", "reuse_const", "reuse_mean"))
        ok = ~np.isnan(fr)
        assert co[ok].sum() < 1 and me[ok].sum() < 1
        assert hd["reuse"]["rrmse_vs_constant_anchor"] == pytest.approx(
            np.sqrt(fr[ok].sum() / co[ok].sum()), rel=1e-12)
        assert hd["reuse"]["rrmse_vs_cache_mean"] == pytest.approx(
            np.sqrt(fr[ok].sum() / me[ok].sum()), rel=1e-12)
    for r in res:
        for k in ("reuse_const", "reuse_mean"):
            r.arrays[k] *= 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero = layercheck.summarise_layer(res, sp, 16, 8, torch.float32)
    for hd in zero["heads"]:
        assert math.isnan(hd["reuse"]["rrmse_vs_constant_anchor"])
        assert math.isnan(hd["reuse"]["rrmse_vs_cache_mean"])
    capped = layercheck.summarise_layer(res, HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8,
                                                 softcap=30.0), 16, 8, torch.float32)
    assert capped["descent"] == (
        "not defined: soft-capped scores (softcap 30.0); the unit step's descent statistics "
        "are derived for phi = id (docs/math.md section 3); the identity, gauges and frozen "
        "reuse hold as measured")
    qk = layercheck.summarise_layer(res, HeadSpec(n_heads=2, n_kv_heads=1, head_dim=8,
                                             family="qknorm"), 16, 8, torch.float32)
    assert qk["input_space"] == (
        "not defined: the 'qknorm' score is not affine in u, so no input-space Delta M or "
        "Hessian exists (docs/math.md section 8); frozen reuse is measured in query space: "
        "R(p_a) applied to query i's normalised, unrotated query")


def test_atlas_figures_on_layers_that_skip(tmp_path):
    """The per-layer figure's x axis is the layers' own numbers (3 and 7 here, not 0 and 1);
    the figures' directory is made with its parents."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from ropestep.report import load as load_report

    r = load_report(Path(__file__).resolve().parents[1] / "validation" / "atlas-smollm2"
                    / "report.json")
    r["layers"] = {"3": r["layers"]["3"], "7": r["layers"]["7"]}
    drawn = {}
    orig = Figure.savefig

    def capture(self, fname, *a, **k):
        drawn[Path(fname).name] = self
        return orig(self, fname, *a, **k)

    Figure.savefig = capture
    try:
        atlas.render_figures(r, tmp_path / "a" / "b" / "figures")
    finally:
        Figure.savefig = orig
    axs = drawn["per_layer.png"].axes
    data = [ln for ax in axs[:3] for ln in ax.get_lines() if ln.get_marker() == "o"]
    assert len(data) >= 3  # (reference lines such as lambda = 2 span the axes instead)
    for line in data:
        assert list(line.get_xdata()) == [3, 7]
    assert (tmp_path / "a" / "b" / "figures" / "per_layer.png").is_file()
