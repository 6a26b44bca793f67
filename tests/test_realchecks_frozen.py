"""``validate``'s real-head checks (:mod:`ropestep.realchecks`) against the reference, replayed
on a frozen run: no corpus, tokenizer or capture per call.

``protocol.run`` captures each context once and hands every (context, layer) to
:func:`ropestep.protocol.real_checks` (``positive_coefficients`` everywhere; ``conventions``,
``rank``, ``no_global_readout``, ``position_derivative`` and ``position_shift`` on the first
context) and the sampled oracle rows to :func:`ropestep.protocol.oracle_job`
(:func:`ropestep.realchecks.exact_rows`, 50 digits).  ``tests/test_reference_real_heads.py`` and
``tests/test_reference_positional.py`` check every leaf those produce against the references
(``ropestep.reference.real_heads`` and ``.positional``, written from docs/protocol.md alone) on a
whole tiny run.

Here the same run is frozen: ``tests/data/realchecks_tiny_calls.pt`` holds, for the seeded
model and command of ``test_reference_real_heads`` (two oracle rows), the arguments of every
``real_checks`` and ``oracle_job`` call (the captured context, and the model's weights: the
replay rebuilds the model under today's transformers),
what the rest of the run pooled, the report the run wrote and the references' recomputation
from its ``--dump-raw`` dump.  The test replays the calls with today's ``realchecks``, pools the
records as the run does and compares every leaf with the references under the tolerances and
leaf classes of ``test_reference_validate`` (which delegates these sections to the two
reference test modules): the expected values come from the references, never from the code
under test.

It takes seconds, which makes it the first test mutation testing runs on ``realchecks``
(``tools/mutants.py``, part ``mutmut-realchecks``).  After a change to what the checks receive or
to a reference, rebuild the file with ``ROPESTEP_REGEN_GOLDEN=1 pytest
tests/test_realchecks_frozen.py`` and review the printed counts.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ropestep import cli, protocol
from ropestep.reference import positional
from ropestep.reference import validate as reference
from ropestep.report import dumps, load
from ropestep.verdict import loads
from reference_walk import decisions, frozen_run
from reference_walk import one_torch_thread  # noqa: F401  (autouse, module scope)
from test_reference_contexts import contexts_reference
from test_reference_real_heads import ARGS
from test_reference_validate import build_model, compare, undecided

pytestmark = pytest.mark.model

DATA = Path(__file__).resolve().parent / "data" / "realchecks_tiny_calls.pt"


def _generate(root: Path) -> dict:
    """The tiny run of test_reference_real_heads, recording the checks' calls."""
    seen: dict = {"per_layer": [], "checks": [], "oracle": []}
    real_checks, oracle_job = protocol.real_checks, protocol.oracle_job
    summarize_layer = protocol.summarize_layer

    def rec_checks(model, spec, weights, cap, layer, context, seed, *, claims=True, raw=None):
        out = real_checks(model, spec, weights, cap, layer, context, seed, claims=claims,
                          raw=raw)
        seen["checks"].append({"args": (spec, weights, cap, layer, context, seed),
                               "claims": claims, "record": out})  # exact_rows added later
        seen["model"] = model
        return out

    def rec_oracle(spec, weights, x_prefix, rows):
        seen["oracle"].append((spec, weights, x_prefix, list(rows)))
        return oracle_job(spec, weights, x_prefix, rows)

    def rec_layer(ctxs, heads, n_heads):
        seen["per_layer"].append((ctxs, list(heads), n_heads))
        return summarize_layer(ctxs, heads, n_heads)

    model = build_model(root / "model")
    argv = ["validate", "--model", str(model), *ARGS, "--quiet", "--no-figures",
            "--out", str(root / "validate"), "--dump-raw", str(root / "raw")]
    protocol.real_checks, protocol.oracle_job = rec_checks, rec_oracle
    protocol.summarize_layer = rec_layer
    old_inline = os.environ.get("ROPESTEP_ORACLE_INLINE")
    os.environ["ROPESTEP_ORACLE_INLINE"] = "1"  # the oracle rows in this process, recorded
    try:
        assert cli.main(argv) == 0
    finally:
        protocol.real_checks, protocol.oracle_job = real_checks, oracle_job
        protocol.summarize_layer = summarize_layer
        if old_inline is None:
            os.environ.pop("ROPESTEP_ORACLE_INLINE")
        else:
            os.environ["ROPESTEP_ORACLE_INLINE"] = old_inline
    report = load(root / "validate" / "report.json")
    assert len(seen["oracle"]) >= 2 * len(report["layers"]) // 2
    raw_files = {str(p.relative_to(root / "raw")): p.read_bytes()
                 for p in sorted((root / "raw").rglob("*")) if p.is_file()}
    state = {k: v.detach().clone() for k, v in seen.pop("model").state_dict().items()}
    return {**seen, "model_state": state, "layers": list(report["layers"]), "report": report,
            "raw_files": raw_files, "ref": reference.recompute(root / "raw"),
            "contexts": contexts_reference(root / "raw", str(model))}


def _rebuild(state: dict, root: Path) -> Any:
    """The run's model under today's transformers: the seeded directory of ``build_model``,
    loaded as the command loads it, with the frozen weights put back (a pickled module would
    tie the file to the transformers release that wrote it; its init order is not ours)."""
    from ropestep.models import load_model

    model, _ = load_model(build_model(root / "model"), tokenizer=False)
    got = model.state_dict()
    model.load_state_dict(state, strict=True)  # refuses missing or unexpected keys
    assert all(torch.equal(got[k], state[k]) for k in state)  # put back, tied ones included
    return model


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> dict:
    data = frozen_run(DATA, _generate, tmp_path_factory)
    assert "model" not in data, "the frozen file pickles a model: rebuild it (module docstring)"
    data["model"] = _rebuild(data["model_state"], tmp_path_factory.mktemp("rebuilt"))
    return data


def _by_layer(frozen: dict, records: list[dict]) -> dict[int, list[dict]]:
    real: dict[int, list[dict]] = {}
    for call, rec in zip(frozen["checks"], records):
        real.setdefault(call["args"][3], []).append(rec)
    return real


def _with_rows(real: dict[int, list[dict]]) -> list[tuple[int, int]]:
    """The (layer, context index) of each record with oracle rows, in the order the run made
    the oracle jobs (context-major, then layer)."""
    n = max(len(v) for v in real.values())
    return [(L, k) for k in range(n) for L in sorted(real)
            if k < len(real[L]) and real[L][k].get("exact_rows") is not None]


@pytest.fixture(scope="module")
def replayed(frozen) -> tuple[dict, dict]:
    """Every ``real_checks`` call replayed with today's code: ``({layer: [record per
    context]}, {(context, layer): what conventions read of the model})``, with the run's own
    oracle rows (replayed on their own below: 50 digits cost ~1 s)."""
    records, raws = [], {}
    for call in frozen["checks"]:
        spec, w, cap, L, c, seed = call["args"]
        raw = {} if call["claims"] else None
        rec = protocol.real_checks(frozen["model"], spec, w, cap, L, c, seed,
                                   claims=call["claims"], raw=raw)
        if raw:
            raws[(c, L)] = raw
        if call["record"].get("exact_rows") is not None:
            rec["exact_rows"] = call["record"]["exact_rows"]
        records.append(rec)
    return _by_layer(frozen, records), raws


@pytest.fixture(scope="module")
def replayed_checks(frozen, replayed, tmp_path_factory) -> tuple[dict, Any]:
    """The replayed records, and the references with the model's side as this machine's
    float32 arithmetic computed it in the replay.

    ``conventions`` compares ropestep's float64 reading of a layer with the model's own float32
    projections; the reference recomputes it from the dumped model side.  Under another BLAS
    code path the replay's model side differs from the frozen run's by float32 rounding, so its
    reference is recomputed (``ropestep.reference.positional``) from the frozen dump with the
    replay's model side in place -- after checking that side against the frozen run's within
    the check's own float32 tolerance (a replay that read something else of the model fails
    there)."""
    real, raws = replayed
    root = tmp_path_factory.mktemp("raw")
    for rel, data in frozen["raw_files"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    dtype = protocol.DTYPES[frozen["report"]["config"]["dtype"]]
    for (c, L), raw in raws.items():
        item = root / f"context{c}_layer{L}_model.safetensors"
        before = load_file(str(item))
        rh = frozen["report"]["layers"][str(L)]["real_heads"]
        tol = rh["per_context"][c]["conventions"]["tolerance_max"]
        for k in ("query", "key", "value"):
            a, b = raw[k].to(dtype).double(), before[k].double()
            assert float((a - b).abs().max()) <= tol * float(b.abs().max()), (c, L, k)
        protocol.dump_model_item(root, c, L, raw, dtype)
    ref = dataclasses.replace(frozen["ref"], positional=positional.recompute(root))
    return real, ref


@pytest.fixture(scope="module")
def replayed_rows(frozen) -> dict:
    """The run's records with every oracle job replayed with today's code in place of its
    rows."""
    real = _by_layer(frozen, [dict(call["record"]) for call in frozen["checks"]])
    places = _with_rows(real)
    assert len(places) == len(frozen["oracle"]) >= 2
    for (L, k), job in zip(places, frozen["oracle"]):
        real[L][k]["exact_rows"] = protocol.oracle_job(*job)
    return real


def pooled(frozen: dict, real: dict) -> dict:
    rep = loads(dumps(frozen["report"]))
    for L, (ctxs, heads, n_heads) in zip(frozen["layers"], frozen["per_layer"]):
        rep["layers"][L] = protocol.summarize_layer(ctxs, heads, n_heads)
        rep["layers"][L]["real_heads"] = protocol.summarize_real_checks(real[int(L)])
    out = loads(dumps(rep))
    out["verdict"] = loads(dumps(protocol.verdict_block(out)))
    return out


def _agrees(frozen: dict, real: dict, ref: Any = None) -> dict:
    ref = frozen["ref"] if ref is None else ref
    assert not undecided(ref), "the frozen run has decisions at their thresholds"
    rep = pooled(frozen, real)
    problems, counts = compare(rep, ref, frozen["contexts"])
    print("leaves:", counts)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])
    assert counts["delegated"] > 300
    assert rep["verdict"]["pass"]
    # and what the references do not compare -- the records' texts (each check's
    # ``tolerance_from``, the conventions' routes), their structure and flags -- is what the frozen
    # run wrote: checked here too, in the test that first computes the replay (mutation testing
    # maps a function only to the tests during which it runs, and the replays are module fixtures)
    written = loads(dumps(frozen["report"]))
    for L in frozen["layers"]:
        assert decisions(rep["layers"][L]["real_heads"]) == \
            decisions(written["layers"][L]["real_heads"]), L
    return rep


def test_the_replayed_checks_agree_with_the_references(frozen, replayed_checks):
    rep = _agrees(frozen, *replayed_checks)
    for L in frozen["layers"]:
        first = rep["layers"][L]["real_heads"]["per_context"][0]
        for check in ("conventions", "rank", "no_global_readout", "position_derivative",
                      "position_shift", "positive_coefficients"):
            assert first[check] is not None, (L, check)


def test_the_replayed_oracle_rows_agree_with_the_reference(frozen, replayed_rows):
    rep = _agrees(frozen, replayed_rows)
    rows = [r for L in frozen["layers"]
            for r in rep["layers"][L]["real_heads"]["per_context"] if r.get("exact_rows")]
    assert len(rows) == len(frozen["oracle"])


@pytest.mark.parametrize("which", ["replayed_checks", "replayed_rows"])
def test_the_committed_run_wrote_what_the_replay_pools_to(frozen, which, request):
    """The frozen report is the pooling of the frozen calls (the file is one run's): the same
    sections, counts, flags and labels (the floats are this machine's rounding, compared with
    the references above)."""
    real = request.getfixturevalue(which)
    rep = pooled(frozen, real[0] if which == "replayed_checks" else real)
    written = loads(dumps(frozen["report"]))
    for L in frozen["layers"]:
        assert decisions(rep["layers"][L]["real_heads"]) == \
            decisions(written["layers"][L]["real_heads"])
