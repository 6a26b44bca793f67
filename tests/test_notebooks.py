"""The proof notebooks in ``proofs/`` execute cleanly and are generated from ``proofs/src``.

* ``test_notebook_executes``: run every committed ``proofs/*.ipynb`` top to bottom in a fresh
  ``python3`` kernel (CPU).  Each notebook ends with a cell of assertions, so a notebook that
  computes a wrong thing fails here.
* ``test_notebook_structure``: it imports ``ropestep`` and its last code cell asserts.
* ``test_notebook_up_to_date``: its cells (type and source, outputs ignored) are exactly what
  ``python proofs/build.py`` generates from ``proofs/src/NN_name.py``.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

# hard imports: the notebook extra is part of the test install; a missing kernel must fail
import ipykernel  # noqa: E402,F401
import nbclient  # noqa: E402
import nbformat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROOFS = ROOT / "proofs"
NOTEBOOKS = sorted(PROOFS.glob("[0-9][0-9]_*.ipynb"))


def _build_module():
    spec = importlib.util.spec_from_file_location("proofs_build", PROOFS / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build = _build_module()
ids = [p.stem for p in NOTEBOOKS]


def test_every_source_has_a_notebook():
    """One notebook per source and no orphans; at least the eight results of docs/math.md."""
    sources = {s.stem for s in build.sources()}
    assert sources == {p.stem for p in NOTEBOOKS}, "run: python proofs/build.py"
    assert len(sources) >= 8


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name=build.KERNEL,
                                     resources={"metadata": {"path": str(PROOFS)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    assert "all assertions passed" in text, f"{path.name}: the assertion cell did not finish"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_structure(path):
    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert any(re.search(r"^\s*(from ropestep\b|import ropestep\b)", src, re.M) for src in code), \
        f"{path.name} does not import ropestep"
    assert re.search(r"^assert ", code[-1], re.M), f"{path.name}: the last code cell must assert"
    assert nb.metadata.get("kernelspec", {}).get("name") == build.KERNEL


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_up_to_date(path):
    src = build.SRC / (path.stem + ".py")
    assert src.exists(), f"{path.name} has no source {src.relative_to(ROOT)}"
    why = build.stale(src)
    assert why is None, f"{why}: regenerate with `python proofs/build.py {path.stem[:2]}`"
