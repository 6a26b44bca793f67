"""Test configuration: hypothesis profiles chosen by environment.

* ``ci`` (default): derandomised, no deadline, >= 200 examples per property.
* ``fuzz``: 2000 examples, randomised -- for long runs: ``HYPOTHESIS_PROFILE=fuzz pytest``.
* ``quick``: 20 examples, for editing loops.

Threads: ``ROPESTEP_TEST_THREADS=N`` runs every test with N torch intra-op threads, including
those that otherwise pin one (``one_thread``), so a test whose result depends on how a kernel
splits its work over threads shows it (tools/blas_paths.py runs the suite with 1 and 2).
Without it, an xdist worker takes its share of the cores (2 cores, 2 workers: one thread each,
passed on to the commands and kernels it launches through OMP_NUM_THREADS/MKL_NUM_THREADS).
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much],
               print_blob=True)
settings.register_profile("ci", max_examples=200, derandomize=True, **_common)
settings.register_profile("fuzz", max_examples=2000, **_common)
settings.register_profile("quick", max_examples=20, derandomize=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_THREADS = os.environ.get("ROPESTEP_TEST_THREADS")
if _THREADS:
    torch.set_num_threads(int(_THREADS))
elif os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # under xdist: the cores shared out among the workers, for their subprocesses and notebook
    # kernels too (two workers of two intra-op threads each, plus the commands they launch,
    # oversubscribe two cores: each test then runs several times slower than alone)
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _share = max(1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_share))


@pytest.fixture
def one_thread():
    """Small problems: one intra-op thread (two threads thrash when the 2 cores are shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(int(_THREADS) if _THREADS else 1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests run wherever a CUDA device is present and are skipped,
    with the reason, where none is (this machine, CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none present)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ascii_locale():
    """This process's LC_CTYPE set to C (ASCII), where the C library has it: what ``open``
    falls back to without an ``encoding`` (outside Python's UTF-8 mode)."""
    import locale

    if sys.flags.utf8_mode:
        pytest.skip("Python's UTF-8 mode ignores the locale")
    old = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        if "utf" in locale.getpreferredencoding(False).lower().replace("-", ""):
            pytest.skip("the C locale is UTF-8 here")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
