"""``validate``'s summaries and verdict against the reference, without running a model.

``protocol.run`` measures each (context, layer) into a ``LayerContext`` and then pools them:
``summarize_layer`` and ``summarize_real_checks`` build a layer's sections of ``report.json``,
``verdict_block`` its verdict.  ``tests/test_reference_validate.py`` checks every leaf of a whole
tiny run against the reference recomputation (``ropestep.reference.validate``, written from
docs/protocol.md alone); that needs the run, seconds to minutes on a loaded machine.

Here the pooling alone is checked, on a frozen run: ``tests/data/validate_tiny_summaries.pt``
holds, for the same tiny seeded model and command as that test, the inputs the pooling received
(``LayerContext`` lists and real-check records per layer), the report the run wrote, and the
reference's recomputation from the run's ``--dump-raw`` dump.  The test pools the frozen inputs
with today's code, puts the result in place of the report's layers and verdict, and compares
every leaf with the reference, with the tolerances and leaf classes of
``test_reference_validate`` (the expected values come from the reference, never from the code
under test).  A planted failure (``FLIPS``) exercises the verdict's failure path.

It takes well under a second, which makes it the first test mutation testing runs on
``protocol``'s summaries (``tools/mutants.py``, part ``mutmut-protocol``).  After a change to
what the run measures (``LayerContext``) or to the reference, rebuild the file with
``ROPESTEP_REGEN_GOLDEN=1 pytest tests/test_protocol_summaries.py`` and review the diff of the
printed counts.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ropestep import cli, protocol
from ropestep.reference import validate as reference
from ropestep.report import dumps, load
from ropestep.verdict import loads
from reference_walk import frozen_run
from test_reference_contexts import contexts_reference
from test_reference_validate import (FLIPS, TINY_ARGS, build_model, compare, planted,
                                     undecided)

DATA = Path(__file__).resolve().parent / "data" / "validate_tiny_summaries.pt"


def _generate(root: Path) -> dict:
    """The tiny run of test_reference_validate, recording what the pooling received."""
    seen: dict = {"per_layer": [], "real": []}
    summarize_layer, summarize_real = protocol.summarize_layer, protocol.summarize_real_checks

    def rec_layer(ctxs, heads, n_heads):
        seen["per_layer"].append((ctxs, list(heads), n_heads))
        return summarize_layer(ctxs, heads, n_heads)

    def rec_real(recs):
        seen["real"].append(recs)
        return summarize_real(recs)

    model = build_model(root / "model")
    argv = ["validate", "--model", str(model), *TINY_ARGS, "--quiet", "--no-figures",
            "--out", str(root / "validate"), "--dump-raw", str(root / "raw")]
    protocol.summarize_layer, protocol.summarize_real_checks = rec_layer, rec_real
    try:
        assert cli.main(argv) == 0
    finally:
        protocol.summarize_layer, protocol.summarize_real_checks = summarize_layer, summarize_real
    report = load(root / "validate" / "report.json")
    layers = list(report["layers"])
    assert len(seen["per_layer"]) == len(seen["real"]) == len(layers)
    return {"layers": layers, "per_layer": seen["per_layer"], "real": seen["real"],
            "report": report, "ref": reference.recompute(root / "raw"),
            "contexts": contexts_reference(root / "raw", str(model))}


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> dict:
    return frozen_run(DATA, _generate, tmp_path_factory)


def pooled(frozen: dict) -> dict:
    """The frozen run's report with its layers pooled by today's code, read back as
    ``report.json`` is."""
    rep = loads(dumps(frozen["report"]))
    for L, (ctxs, heads, n_heads), recs in zip(frozen["layers"], frozen["per_layer"],
                                              frozen["real"]):
        rep["layers"][L] = protocol.summarize_layer(ctxs, heads, n_heads)
        rep["layers"][L]["real_heads"] = protocol.summarize_real_checks(recs)
    out = loads(dumps(rep))
    out["verdict"] = loads(dumps(protocol.verdict_block(out)))
    return out


def test_the_frozen_inputs_pool_to_the_reference(frozen):
    assert not undecided(frozen["ref"]), "the frozen run has decisions at their thresholds"
    rep = pooled(frozen)
    problems, counts = compare(rep, frozen["ref"], frozen["contexts"])
    print("leaves:", counts)
    assert not problems, f"{len(problems)} leaves disagree:\n" + "\n".join(problems[:40])
    assert counts["recomputed"] > 3000
    # the frozen data pass: the verdict is recomputed by the reference too
    want = reference.verdict(frozen["ref"].report["layers"])
    assert rep["verdict"]["pass"] and want["pass"]
    assert rep["verdict"]["failed_checks"] == want["failed_checks"] == 0


def test_the_committed_run_wrote_what_the_frozen_inputs_pool_to(frozen):
    """The frozen report is the pooling of the frozen inputs (the file is one run's)."""
    rep = pooled(frozen)
    written = loads(dumps(frozen["report"]))
    assert rep["layers"] == written["layers"]


@pytest.mark.parametrize("name", list(FLIPS))
def test_a_planted_failure_reaches_both_verdicts(frozen, name):
    """One failing check planted in the pooled report and in the reference's sections: both
    verdicts fail once, at the same (where, check)."""
    path, value = FLIPS[name]
    got = protocol.verdict_block(planted(pooled(frozen), path, value))
    want = reference.verdict(planted(frozen["ref"].report, path, value)["layers"])
    assert not want["pass"] and want["failed_checks"] == 1
    assert (got["pass"], got["failed_checks"]) == (want["pass"], want["failed_checks"])
    assert [(f["where"], f["check"]) for f in got["failures"]] == \
        [(f["where"], f["check"]) for f in want["failures"]]
