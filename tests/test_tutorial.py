"""The tutorial notebook (docs/tutorial.ipynb) is generated from docs/src/tutorial.py and runs
top to bottom on the packaged SmolLM2 (its last cell asserts what the text claims)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "docs" / "src" / "tutorial.py"


def _build():
    spec = importlib.util.spec_from_file_location("proofs_build", ROOT / "proofs" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tutorial_up_to_date():
    b = _build()
    assert b.tutorial_sources() == [SRC]
    assert b.notebook_path(SRC) == ROOT / "docs" / "tutorial.ipynb"
    why = b.stale(SRC)
    assert why is None, f"{why}: regenerate with `python proofs/build.py tutorial`"


@pytest.mark.notebook
@pytest.mark.model
def test_tutorial_executes():
    from ropestep import models

    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    import nbformat

    b = _build()
    nb = b.execute(b.make_notebook(SRC), b.TIMEOUT, SRC.parent.parent)
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    assert "all assertions passed" in text
    assert isinstance(nb, nbformat.NotebookNode)
