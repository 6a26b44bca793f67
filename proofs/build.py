r"""Generate, execute and save the proof notebooks in ``proofs/``.

Each notebook is written as a plain Python file ``proofs/src/NN_name.py`` in the "percent"
cell format (the one jupytext and VS Code read):

    # %% [markdown]
    # Prose, with $\LaTeX$ ...        (each line starts with "# ", which is removed)
    # %%
    code ...
    # %% include _setup.py            (a code cell whose text is proofs/src/_setup.py)

Files starting with ``_`` are shared snippets, not notebooks.  ``python proofs/build.py`` turns
every source into ``proofs/NN_name.ipynb``, executes it with nbclient (kernel ``python3``, working
directory ``proofs/``) and writes it with its outputs.  Cell ids are derived from the notebook
name and cell index, and timing metadata is dropped, so rebuilding unchanged sources changes
only outputs that really changed.

    python proofs/build.py                 # build and execute all notebooks
    python proofs/build.py 02 gauges       # only notebooks whose name contains one of these
    python proofs/build.py tutorial        # docs/tutorial.ipynb from docs/src/tutorial.py
    python proofs/build.py --check         # exit 1 if a committed notebook is out of date
    python proofs/build.py --no-execute    # write the notebooks without outputs
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
DOCS_SRC = HERE.parent / "docs" / "src"  # the tutorial(s): docs/src/NAME.py -> docs/NAME.ipynb
KERNEL = "python3"
TIMEOUT = 300  # seconds per cell

_MARK = re.compile(r"^# %%(?P<rest>.*)$")


def sources() -> list[Path]:
    """The notebook sources, in order (``proofs/src/NN_*.py``)."""
    return sorted(p for p in SRC.glob("[0-9][0-9]_*.py"))


def tutorial_sources() -> list[Path]:
    """The tutorial sources (``docs/src/*.py``), built the same way into ``docs/``."""
    return sorted(DOCS_SRC.glob("[a-z]*.py"))


def notebook_path(src: Path) -> Path:
    """``proofs/src/NN_name.py -> proofs/NN_name.ipynb``, ``docs/src/x.py -> docs/x.ipynb``."""
    return src.parent.parent / (src.stem + ".ipynb")


def parse_cells(src: Path) -> list[tuple[str, str]]:
    """``[(cell_type, source), ...]`` from a percent-format file."""
    cells: list[tuple[str, list[str]]] = []
    kind, buf = None, []

    def flush():
        if kind is not None:
            cells.append((kind, buf))

    for line in src.read_text().splitlines():
        m = _MARK.match(line)
        if m:
            flush()
            rest = m.group("rest").strip()
            if rest == "[markdown]":
                kind, buf = "markdown", []
            elif rest.startswith("include "):
                name = rest.split(None, 1)[1].strip()
                cells.append(("code", (src.parent / name).read_text().splitlines()))
                kind, buf = None, []
            elif rest == "":
                kind, buf = "code", []
            else:
                raise ValueError(f"{src.name}: unknown cell marker {line!r}")
            continue
        if kind is None:
            if line.strip():
                raise ValueError(f"{src.name}: text outside a cell: {line!r}")
            continue
        if kind == "markdown":
            if line.startswith("# "):
                line = line[2:]
            elif line.rstrip() in ("#", ""):
                line = ""
            else:
                raise ValueError(f"{src.name}: markdown line must start with '# ': {line!r}")
        buf.append(line)
    flush()
    out = []
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines = lines[:-1]
        while lines and not lines[0].strip():
            lines = lines[1:]
        if lines:
            out.append((kind, "\n".join(lines)))
    return out


def make_notebook(src: Path) -> nbformat.NotebookNode:
    """The unexecuted notebook of one source file (deterministic ids and metadata)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                       "name": KERNEL},
        "language_info": {"name": "python"},
    }
    for n, (kind, text) in enumerate(parse_cells(src)):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(text)
        cell.id = f"{src.stem[:2]}-{n:02d}"
        nb.cells.append(cell)
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = TIMEOUT, cwd: Path = HERE
            ) -> nbformat.NotebookNode:
    """Run every cell in a fresh ``python3`` kernel with ``cwd`` (``proofs/``, or ``docs/`` for
    the tutorial) as the working directory.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first failing cell.
    """
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def cell_sources(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """``[(cell_type, source)]``: what the up-to-date check compares (outputs ignored)."""
    return [(c.cell_type, c.source) for c in nb.cells]


def stale(src: Path) -> str | None:
    """Why the committed notebook of ``src`` is out of date, or None when it is current."""
    path = notebook_path(src)
    if not path.exists():
        return f"{path.name} is missing"
    have = cell_sources(nbformat.read(path, as_version=4))
    want = cell_sources(make_notebook(src))
    if have == want:
        return None
    for n, (h, w) in enumerate(zip(have, want)):
        if h != w:
            return f"{path.name}: cell {n} differs from {src.name}"
    return f"{path.name}: {len(have)} cells, {src.name} makes {len(want)}"


def build(src: Path, run: bool = True, timeout: int = TIMEOUT) -> float:
    nb = make_notebook(src)
    t0 = time.perf_counter()
    try:
        if run:
            execute(nb, timeout, notebook_path(src).parent)
    finally:  # a failing notebook is written too, with the traceback in its outputs
        nbformat.validate(nb)
        nbformat.write(nb, notebook_path(src))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="build only notebooks whose name contains one of these")
    ap.add_argument("--check", action="store_true", help="report out-of-date notebooks, build nothing")
    ap.add_argument("--no-execute", action="store_true", help="write the notebooks without outputs")
    ap.add_argument("--timeout", type=int, default=TIMEOUT, help="seconds per cell")
    args = ap.parse_args(argv)
    todo = [s for s in sources() + tutorial_sources()
            if not args.names or any(n in s.stem for n in args.names)]
    if not todo:
        print("no notebook sources matched", file=sys.stderr)
        return 2
    if args.check:
        bad = [why for why in map(stale, todo) if why]
        for why in bad:
            print(why)
        print(f"{len(todo) - len(bad)}/{len(todo)} notebooks up to date")
        return 1 if bad else 0
    total = 0.0
    for s in todo:
        dt = build(s, run=not args.no_execute, timeout=args.timeout)
        total += dt
        print(f"{notebook_path(s).relative_to(HERE.parent)}  {dt:5.1f} s")
    print(f"{len(todo)} notebooks, {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
