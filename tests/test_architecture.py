"""The architecture, enforced: import-linter's contracts (pyproject.toml) and the one kernel.

* ``lint-imports`` keeps every contract of ``[tool.importlinter]``: the layers run one way
  (definitions -> kernel and oracles -> paths -> model plumbing -> experiments -> commands), the
  fast layer never reaches the mpmath/SymPy oracles, the oracles never reach torch,
  ``transformers`` stays out of the core, and the reference recomputations
  (:mod:`ropestep.reference`) reach neither torch nor the code whose reports they check.
* The contracts can fail: the same configuration run on a copy of the package with one upward
  import injected reports the contract broken.
* ``c_ij`` is computed in one place: no module of the fast layer but :mod:`ropestep.kernel` (and
  the paper-form reference :mod:`ropestep.direct`, kept apart on purpose) evaluates
  ``phi_1``-based coefficients.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "ropestep"
LINT = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")


def _lint(config: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    return subprocess.run([LINT, "--config", str(config), "--no-cache"], cwd=config.parent,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def lint_available():
    if LINT is None:
        pytest.fail("lint-imports not found: pip install 'ropestep[dev]' (import-linter)")
    return LINT


def test_import_contracts_are_kept(lint_available):
    res = _lint(ROOT / "pyproject.toml", ROOT / "src")
    print(res.stdout[-3000:], res.stderr[-2000:])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


@pytest.mark.parametrize("module, injected", [
    ("kernel.py", "from . import fast  # injected upward import\n"),
    ("fast.py", "from . import exact  # injected: fast reaching the oracle\n"),
    ("spec.py", "import transformers  # injected: model plumbing in the core\n"),
    ("reference/atlas.py", "from .. import tolerances  # injected: the reference reaching torch\n"),
])
def test_an_injected_violation_breaks_a_contract(lint_available, tmp_path, module, injected):
    copy = tmp_path / "src" / "ropestep"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    src = (copy / module).read_text()
    head, sep, rest = src.partition("from __future__ import annotations\n")
    (copy / module).write_text(head + sep + injected + rest)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    res = _lint(tmp_path / "pyproject.toml", tmp_path / "src")
    print(module, res.stdout[-1500:])
    assert res.returncode != 0 and "BROKEN" in res.stdout


FAST_LAYER = ("fast.py", "scale.py", "lowrank.py", "bench.py", "sweep.py", "protocol.py",
              "reuse_stats.py", "atlas.py", "layercheck.py", "api.py", "realchecks.py",
              *sorted(str(p.relative_to(PKG)) for p in (PKG / "models").glob("*.py")))
# the primitives c_ij is built from; calling the kernel's own coefficients()/pairwise_weights() is
# the intended use and is not flagged
COEFFICIENT_FUNCS = {"phi1", "scaled_phi1", "exp_dd"}


def coefficient_calls(path: Path) -> list[str]:
    """Calls of the coefficient functions in one source file, as ``name@line``."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in COEFFICIENT_FUNCS:
                out.append(f"{name}@{node.lineno}")
    return out


def test_coefficients_are_computed_in_the_kernel_only():
    missing = [f for f in FAST_LAYER if not (PKG / f).exists()]
    assert not missing, f"files named here no longer exist: {missing}"
    found = {f: coefficient_calls(PKG / f) for f in FAST_LAYER}
    print(found)
    assert not any(found.values()), f"c_ij computed outside ropestep.kernel: {found}"
    assert coefficient_calls(PKG / "kernel.py"), "the kernel itself must compute them"


def test_the_coefficient_scan_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ropestep.kernel import phi1\nc = phi1(s) / z\n")
    assert coefficient_calls(bad) == ["phi1@2"]
