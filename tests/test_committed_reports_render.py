"""Every committed ``report.md`` under ``validation/`` is exactly what its command's renderer
makes of the committed ``report.json`` beside it.

The Markdown is what a reader quotes; the JSON is what the reference recomputations check
(tests/test_reference_*.py).  This closes the gap between them: a renderer that prints another
field, another precision, another column order, a wrong label or a figure under another name
turns this red, and so does a committed report.md edited by hand or left stale after a
renderer change (rerun the command, or re-render with the module's ``render_markdown``).

The renderer is chosen by the report's ``schema``; a committed report of a schema this test
does not know is a failure, not a skip.  ``validate`` reports link their three figures per
layer by name.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from ropestep import architectures, atlas, heads, report, train_families

ROOT = Path(__file__).resolve().parents[1]
REPORTS = sorted(p.parent for p in (ROOT / "validation").glob("*/report.json"))


def _validate(result: dict, tmp: Path) -> str:
    # the figures validate writes per layer (drawn and named by report.render_figures, checked
    # in tests/test_committed_figures.py and tests/test_report_module.py)
    figs = {layer: [f"figures/{f}_L{layer}.png" for f in
                    ("reconstruction", "reuse_vs_distance", "lam_max")]
            for layer in result["layers"]}
    return report.render_markdown(result, figs)


RENDERERS = {
    "ropestep.validate/1": _validate,
    "ropestep.atlas/1": lambda r, tmp: atlas.render_markdown(r),
    "ropestep.heads/1": lambda r, tmp: heads.render_markdown(r),
    "ropestep.train_families/1": lambda r, tmp: train_families.render_markdown(r),
    "ropestep.architectures/1": lambda r, tmp: architectures.render_markdown(r),
}


def test_every_command_has_a_committed_report():
    schemas = {json.loads((d / "report.json").read_text(encoding="utf-8")).get("schema")
               for d in REPORTS}
    assert schemas == set(RENDERERS), f"committed report schemas {sorted(map(str, schemas))}"


@pytest.mark.parametrize("d", REPORTS, ids=[d.name for d in REPORTS])
def test_committed_markdown_is_its_json_rendered(d, tmp_path):
    result = json.loads((d / "report.json").read_text(encoding="utf-8"))
    schema = result.get("schema")
    assert schema in RENDERERS, f"{d.name}: no renderer known for schema {schema!r}"
    rendered = RENDERERS[schema](result, tmp_path)
    committed = (d / "report.md").read_text(encoding="utf-8")
    diff = "".join(list(difflib.unified_diff(committed.splitlines(True), rendered.splitlines(True),
                                             "committed", "rendered", n=1))[:40])
    assert rendered == committed, f"{d.name}/report.md is not its report.json rendered:\n{diff}"


def test_the_paper_setup_branch_against_its_golden_page():
    """validate prints the paper's numbers beside ours only on the paper's own setup, which no
    committed run is (Qwen2.5-0.5B, layer 23, WikiText-2).  The committed SmolLM2 result with
    the paper's numbers attached renders to ``tests/golden/validate_paper_setup.md`` (reviewed
    once: every paper column reads docs/protocol.md's values).  Rewrite it after a deliberate
    change with ``ROPESTEP_REGEN_GOLDEN=1``."""
    import os

    from ropestep.protocol import PAPER

    result = json.loads((ROOT / "validation" / "smollm2" / "report.json").read_text(
        encoding="utf-8"))
    result["paper"] = PAPER
    rendered = _validate(result, Path("."))
    golden = ROOT / "tests" / "golden" / "validate_paper_setup.md"
    if os.environ.get("ROPESTEP_REGEN_GOLDEN"):
        golden.write_text(rendered, encoding="utf-8")
    assert "This is the paper's setup" in rendered
    for v in (PAPER["reconstruction"]["rows_total"],):
        assert str(v) in rendered
    assert rendered == golden.read_text(encoding="utf-8")
