"""pytest plugin used by ``tools/mutants.py`` inside its temporary copies (``-p mutants_plugin``).

Two jobs, both switched on by environment variables so the plugin is inert elsewhere:

* ``ROPESTEP_MUTANTS_RECORD=<dir>``: write the node id of the first failing test (or the first
  collection error) of the run to ``<dir>/<name>``, where ``<name>`` is mutmut's
  ``MUTANT_UNDER_TEST`` (or ``run`` outside mutmut).  This is the mutant's ``killed_by``.
* ``ROPESTEP_MUTANTS_NO_SHRINK=1``: load a hypothesis profile derived from the one the suite's
  conftest chose (``HYPOTHESIS_PROFILE``: same example counts, derandomisation, deadline) minus
  the ``shrink``/``explain`` phases and the example database.  A mutant only needs *a* failing
  example; shrinking it can take minutes of mpmath calls, which mutation testing would otherwise
  report as a timeout.  The examples tried before the first failure are unchanged.
"""
from __future__ import annotations

import os

_SKIP = ("", "fail", "stats", "mutant_generation", "list_all_tests")


def _record(what: str) -> None:
    out = os.environ.get("ROPESTEP_MUTANTS_RECORD")
    if not out:
        return
    name = os.environ.get("MUTANT_UNDER_TEST", "run") or "run"
    if name in _SKIP and name != "run":
        return
    path = os.path.join(out, name)
    if os.path.exists(path):  # the first failure wins
        return
    os.makedirs(out, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(what)


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook
    if os.environ.get("ROPESTEP_MUTANTS_NO_SHRINK") != "1":
        return
    try:
        from hypothesis import Phase, settings
    except ImportError:  # pragma: no cover - hypothesis is a dev dependency
        return
    settings.register_profile("ropestep-mutants", parent=settings.default, database=None,
                              phases=[Phase.explicit, Phase.generate])
    settings.load_profile("ropestep-mutants")


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 - pytest hook
    if report.failed:
        _record(report.nodeid)


def pytest_collectreport(report) -> None:  # noqa: ANN001 - pytest hook
    if report.failed:
        _record(f"collection error: {report.nodeid or '<session>'}")
