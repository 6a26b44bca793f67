#!/usr/bin/env python
"""Run a pytest selection under several numerical configurations; one Markdown table of outcomes.

The suite's float64/float32 tolerances assume some BLAS and vector code path; this tool runs the
same pytest selection once per *configuration* -- a set of environment variables on the pytest
subprocess -- and records, per configuration, pytest's summary line, exit status, wall time and
the failed test ids, next to what the configuration actually did on this machine:

* ``default``: nothing set.
* ``MKL_CBWR=COMPATIBLE|SSE4_2|AVX|AVX2|AVX512``: MKL's conditional-numerical-reproducibility
  branch.  A branch whose instruction set is missing from ``/proc/cpuinfo`` (flags ``sse4_2``,
  ``avx``, ``avx2``, ``avx512f``) is not run; the table says "not supported by this CPU".
* ``ATEN_CPU_CAPABILITY=default``: ATen's scalar (non-vectorised) kernels.
* ``ROPESTEP_TEST_THREADS=1|2``: that variable plus ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``
  set to the same number.  ``ROPESTEP_TEST_THREADS`` is read by ``tests/conftest.py``.

Every controlled variable (:data:`CONTROLLED`) is first removed from the inherited environment,
so ``default`` really sets nothing.  Whether a configuration took effect is checked, not
assumed: in the same environment plus ``MKL_VERBOSE=1`` a probe (``python -c``) prints
``torch.backends.cpu.get_cpu_capability()`` and runs one float64 64x64 ``torch.mm``, whose
MKL_VERBOSE line (``MKL_VERBOSE DGEMM(...) 220.89us CNR:OFF Dyn:1 FastMM:1 TID:0  NThr:1``)
gives the branch MKL used (``CNR:...``) and its thread count (``NThr:...``).  MKL replaces a
branch it does not support on the CPU by ``AUTO`` (so does an unknown value); the column
"took effect" compares what was asked with what was reported.

Usage (from the repository root; pytest runs there, so paths in ``--pytest-args`` are relative
to it)::

    python tools/blas_paths.py                                   # all configurations, -n 2
    python tools/blas_paths.py --configs default,MKL_CBWR=COMPATIBLE \\
        --pytest-args "tests/test_phi1.py -q -p no:cacheprovider" --out /tmp/bp.md
    python tools/blas_paths.py --list                            # configurations, CPU support

``--pytest-args`` is split like a shell would (``shlex``); ``-rfE`` is appended so the short
summary names every failed (and erroring) test.  A value that is a single option needs the
``=`` form: ``--pytest-args=-q``.  ``--timeout`` bounds each pytest run (the process group is
killed).  The report (default ``docs/blas-paths.md``) is a complete Markdown file: what was run,
the tool's command line, date, CPU, torch/numpy/MKL versions, then the table.

Dependencies: the standard library; torch (and numpy, for its version) only inside the probe.

Exit status: 0 when every configuration that ran passed, 1 when one failed or timed out, 2 on
bad input (unknown configuration name, unparsable ``--pytest-args``, arguments pytest rejects,
an unwritable ``--out``), one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
PROG = "tools/blas_paths.py"
DEFAULT_PYTEST_ARGS = "-n 2"  # the README's test command: python -m pytest -n 2
REPORT_CHARS = "-rfE"  # short summary: FAILED and ERROR lines
CONTROLLED = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ROPESTEP_TEST_THREADS", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "MKL_VERBOSE")
PROBE_TIMEOUT_S = 300.0
PROBE_TAG = "BLAS_PATHS_PROBE "
NOT_SUPPORTED = "not supported by this CPU"


class BadInput(Exception):
    """Bad input: exit status 2."""


@dataclass(frozen=True)
class Config:
    """One configuration: the variables set on the pytest subprocess."""
    name: str
    env: dict[str, str]
    cpu_flag: str | None = None  # /proc/cpuinfo flag the configuration needs

    def expected(self) -> str:
        """What the probe should report when the configuration took effect."""
        if "MKL_CBWR" in self.env:
            return f"CNR:{self.env['MKL_CBWR']}"
        if "ATEN_CPU_CAPABILITY" in self.env:
            return f"capability {self.env['ATEN_CPU_CAPABILITY'].upper()}"
        if "ROPESTEP_TEST_THREADS" in self.env:
            return f"NThr:{self.env['ROPESTEP_TEST_THREADS']}"
        return "CNR:OFF"


def _threads(n: int) -> Config:
    v = str(n)
    return Config(f"ROPESTEP_TEST_THREADS={v}",
                  {"ROPESTEP_TEST_THREADS": v, "OMP_NUM_THREADS": v, "MKL_NUM_THREADS": v})


CONFIGS: tuple[Config, ...] = (
    Config("default", {}),
    Config("MKL_CBWR=COMPATIBLE", {"MKL_CBWR": "COMPATIBLE"}),
    Config("MKL_CBWR=SSE4_2", {"MKL_CBWR": "SSE4_2"}, "sse4_2"),
    Config("MKL_CBWR=AVX", {"MKL_CBWR": "AVX"}, "avx"),
    Config("MKL_CBWR=AVX2", {"MKL_CBWR": "AVX2"}, "avx2"),
    Config("MKL_CBWR=AVX512", {"MKL_CBWR": "AVX512"}, "avx512f"),
    Config("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}),
    _threads(1),
    _threads(2),
)
BY_NAME = {c.name: c for c in CONFIGS}


@dataclass
class Probe:
    """What one environment reports: ATen capability, MKL's verbose line, versions."""
    capability: str | None = None
    torch_threads: int | None = None
    mkl_call: str | None = None  # e.g. "DGEMM"
    cnr: str | None = None  # e.g. "CNR:AUTO"
    nthr: int | None = None
    mkl_banner: str | None = None  # MKL_VERBOSE's version line
    versions: dict[str, str | None] = field(default_factory=dict)
    error: str | None = None

    def branch(self) -> str:
        if self.error:
            return f"probe failed: {self.error}"
        if not self.cnr:
            return "no MKL_VERBOSE line"
        return f"{self.cnr} NThr:{self.nthr} ({self.mkl_call})"


@dataclass
class Outcome:
    """One configuration's row."""
    config: Config
    skipped: str | None = None  # why it did not run
    probe: Probe | None = None
    summary: str | None = None
    rc: int | None = None  # None: timed out
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.skipped is not None or self.rc == 0


# ---------------------------------------------------------------------------------------------
# machine
# ---------------------------------------------------------------------------------------------
def cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, set[str], str]:
    """(model name, flags, vendor/family/model line) of the first CPU in /proc/cpuinfo."""
    model, flags, ident = "unknown", set(), {}
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or "unknown", set(), ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model == "unknown":
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
        elif key in ("vendor_id", "cpu family", "model") and key not in ident:
            ident[key] = value
    desc = ", ".join(f"{k} {v}" for k, v in ident.items())
    return model, flags, desc


def child_env(config: Config, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The inherited environment without :data:`CONTROLLED`, plus the configuration's."""
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLED}
    env.update(config.env)
    env.update(extra or {})
    return env


# ---------------------------------------------------------------------------------------------
# probe: capability and MKL branch in one environment
# ---------------------------------------------------------------------------------------------
PROBE_SRC = r"""
import json, torch
try:
    import numpy
    npv = numpy.__version__
except Exception:
    npv = None
mkl = [l.strip(" -") for l in torch.__config__.show().splitlines() if "Math Kernel Library" in l]
a = torch.ones(64, 64, dtype=torch.float64)
torch.mm(a, a)
print("%s" + json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                         "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "numpy": npv, "mkl": mkl[0] if mkl else None}), flush=True)
""" % PROBE_TAG
MKL_CALL = re.compile(r"^MKL_VERBOSE\s+([A-Z][A-Z0-9_]*)\(.*?\)\s.*?(CNR:\S+).*?NThr:(\d+)")
MKL_BANNER = re.compile(r"^MKL_VERBOSE\s+(.*?[Bb]uild \d+)")


def parse_probe(output: str) -> Probe:
    """Read the probe's JSON line and the first MKL_VERBOSE call line (and the banner)."""
    p = Probe()
    for line in output.splitlines():
        line = line.strip()
        if line.startswith(PROBE_TAG):
            d = json.loads(line[len(PROBE_TAG):])
            p.capability, p.torch_threads = d["capability"], d["threads"]
            p.versions = {"torch": d["torch"], "numpy": d["numpy"], "mkl": d["mkl"]}
        elif (m := MKL_CALL.match(line)) and p.cnr is None:
            p.mkl_call, p.cnr, p.nthr = m.group(1), m.group(2), int(m.group(3))
        elif (m := MKL_BANNER.match(line)) and p.mkl_banner is None:
            p.mkl_banner = m.group(1)
    return p


def run_probe(config: Config) -> Probe:
    cmd = [sys.executable, "-c", PROBE_SRC]
    try:
        r = subprocess.run(cmd, cwd=REPO, env=child_env(config, {"MKL_VERBOSE": "1"}),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Probe(error=f"timed out after {PROBE_TIMEOUT_S:.0f} s")
    p = parse_probe(r.stdout)
    if r.returncode != 0 or p.capability is None:
        last = r.stdout.strip().splitlines()[-1:] or [""]
        p.error = f"exit {r.returncode}: {last[0][:200]}"
    return p


def took_effect(config: Config, probe: Probe) -> str:
    """'yes' or 'NO (...)': the probe's report against what the configuration asks for."""
    if probe.error:
        return "unknown (probe failed)"
    exp = config.expected()
    if exp.startswith("capability "):
        got = f"capability {probe.capability}"
    elif exp.startswith("NThr:"):
        got = f"NThr:{probe.nthr}"
        if str(probe.torch_threads) != exp[5:]:
            got += f", torch threads {probe.torch_threads}"
    else:
        got = (probe.cnr or "no MKL_VERBOSE line").split(",")[0]
    return "yes" if got == exp else f"NO (asked {exp}, got {got})"


# ---------------------------------------------------------------------------------------------
# pytest runs
# ---------------------------------------------------------------------------------------------
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SUMMARY = re.compile(r"^(?:\d+ [a-z]+(?:, \d+ [a-z]+)*|no tests ran) in [\d.]+s\b.*$")


def parse_summary(output: str) -> str | None:
    """pytest's final line, e.g. '881 passed, 6 skipped in 461.23s (0:07:41)'."""
    for line in reversed(ANSI.sub("", output).splitlines()):
        line = line.strip().strip("=").strip()
        if SUMMARY.match(line):
            return line
    return None


def parse_failed(output: str) -> list[str]:
    """Test ids of the short summary's FAILED lines (ERROR lines marked as such)."""
    ids = []
    for line in ANSI.sub("", output).splitlines():
        for tag in ("FAILED ", "ERROR "):
            if line.startswith(tag):
                tid = line[len(tag):].split(" - ", 1)[0].strip()
                ids.append(tid if tag == "FAILED " else f"{tid} (error)")
    return list(dict.fromkeys(ids))


def pytest_command(pytest_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *pytest_args, REPORT_CHARS]


def run_pytest(config: Config, pytest_args: Sequence[str],
               timeout: float) -> tuple[int | None, str, float]:
    """(exit status or None on timeout, combined output, seconds); own process group."""
    t0 = time.monotonic()
    proc = subprocess.Popen(pytest_command(pytest_args), cwd=REPO, env=child_env(config),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        rc = None
    return rc, out, time.monotonic() - t0


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group (pytest and its xdist workers), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_config(config: Config, flags: set[str], pytest_args: Sequence[str],
               timeout: float) -> Outcome:
    if config.cpu_flag and config.cpu_flag not in flags:
        return Outcome(config, skipped=NOT_SUPPORTED)
    o = Outcome(config, probe=run_probe(config))
    o.rc, out, o.seconds = run_pytest(config, pytest_args, timeout)
    if o.rc == 4:  # pytest's usage error: the arguments, not the configuration
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or [""]
        raise BadInput(f"pytest rejected --pytest-args (exit 4): {last[0][:300]}")
    o.summary = parse_summary(out) or (f"timed out after {timeout:.0f} s" if o.rc is None
                                       else "no pytest summary line")
    o.failed = parse_failed(out)
    return o


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def fmt_seconds(s: float) -> str:
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s" if m else f"{s:.1f}s"


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_row(o: Outcome) -> str:
    env = " ".join(f"`{k}={v}`" for k, v in o.config.env.items()) or "(nothing set)"
    if o.skipped:
        return "| " + " | ".join([f"`{o.config.name}`", env, o.skipped, "–", "–", "–", "–",
                                  o.skipped, "–"]) + " |"
    p = o.probe or Probe(error="not run")
    rc = "timeout" if o.rc is None else str(o.rc)
    return "| " + " | ".join(cell(c) for c in [
        f"`{o.config.name}`", env, o.summary, rc, fmt_seconds(o.seconds), len(o.failed),
        p.capability or "?", p.branch(), took_effect(o.config, p)]) + " |"


def header(argv: Sequence[str], pytest_args: Sequence[str], timeout: float,
           versions: Probe) -> list[str]:
    model, flags, ident = cpuinfo()
    isa = " ".join(f for f in ("sse4_2", "avx", "avx2", "avx512f") if f in flags) or "none"
    v = versions.versions
    cmd = shlex.join(["python", PROG, *argv])
    pcmd = shlex.join(["python", "-m", "pytest", *pytest_args, REPORT_CHARS])
    return [
        "# BLAS and CPU code paths: the test selection per numerical configuration",
        "",
        f"Generated by `{PROG}`: the pytest selection below ran once per configuration, each "
        "with its environment variables set on the pytest subprocess (the controlled variables "
        f"{', '.join(f'`{c}`' for c in CONTROLLED)} removed from the inherited environment "
        "first).",
        "",
        f"* Command: `{cmd}`",
        f"* Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"* pytest, in the repository root: `{pcmd}`; timeout {timeout:.0f} s per run",
        f"* CPU: {model} ({ident}); {os.cpu_count()} logical CPUs; /proc/cpuinfo ISA flags: "
        f"{isa}",
        f"* Python {platform.python_version()}, torch {v.get('torch')}, numpy {v.get('numpy')}",
        f"* MKL (`torch.__config__.show()`): {v.get('mkl')}",
        f"* MKL (`MKL_VERBOSE` banner): {versions.mkl_banner}",
        "",
    ]


NOTES = [
    "Columns: *result* is pytest's summary line; *exit* its exit status; *failed* the number "
    "of FAILED/ERROR ids in the short summary (listed below); *ATen capability* is "
    "`torch.backends.cpu.get_cpu_capability()` in that environment; *MKL branch as reported* "
    "is the `CNR:` and `NThr:` fields of the `MKL_VERBOSE=1` line of a float64 64x64 "
    "`torch.mm` in that environment (`CNR:OFF`: no reproducibility mode; MKL reports `AUTO` "
    "for a branch it does not support on this CPU); *took effect* compares that with the "
    "configuration's request.",
    "",
]


def render(argv: Sequence[str], pytest_args: Sequence[str], timeout: float,
           outcomes: Sequence[Outcome]) -> str:
    probes = [o.probe for o in outcomes if o.probe and not o.probe.error]
    lines = header(argv, pytest_args, timeout, probes[0] if probes else Probe())
    lines += ["| configuration | environment | result | exit | wall | failed | ATen capability "
              "| MKL branch as reported | took effect |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [table_row(o) for o in outcomes]
    lines += ["", *NOTES, "## Failed tests", ""]
    bad = [o for o in outcomes if not o.ok]
    for o in bad:
        lines.append(f"* `{o.config.name}` ({'timed out' if o.rc is None else f'exit {o.rc}'})"
                     f"{':' if o.failed else ''}")
        lines += [f"  * `{t}`" for t in o.failed]
    if not bad:
        lines.append("None: every configuration that ran passed.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 2, one line
        raise BadInput(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(BY_NAME),
                    help="comma-separated configuration names (default: all; see --list)")
    ap.add_argument("--pytest-args", default=DEFAULT_PYTEST_ARGS,
                    help=f"pytest arguments, shell-split (default: {DEFAULT_PYTEST_ARGS!r}); "
                         f"{REPORT_CHARS} is appended")
    ap.add_argument("--out", default=None,
                    help="Markdown report (default: docs/blas-paths.md of the repository)")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds per pytest run (default 3600)")
    ap.add_argument("--list", action="store_true",
                    help="print the configurations and whether this CPU supports them")
    a = ap.parse_args(list(argv))
    if a.timeout <= 0:
        raise BadInput("--timeout must be > 0")
    return a


def select(spec: str) -> list[Config]:
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    if not names:
        raise BadInput("--configs: no configuration named")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise BadInput(f"unknown configuration(s) {', '.join(unknown)}; known: "
                       f"{', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names]


def split_pytest_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as err:
        raise BadInput(f"--pytest-args: {err}") from None


def out_path(out: str | None) -> Path:
    path = REPO / "docs" / "blas-paths.md" if out is None else Path(out)
    path = path if path.is_absolute() else Path.cwd() / path
    if path.is_dir() or not path.parent.is_dir():
        raise BadInput(f"--out {out}: not a file in an existing directory")
    return path


def list_configs(flags: set[str]) -> None:
    for c in CONFIGS:
        env = " ".join(f"{k}={v}" for k, v in c.env.items()) or "(nothing set)"
        ok = c.cpu_flag is None or c.cpu_flag in flags
        print(f"{c.name:28s} {env:60s} {'' if ok else NOT_SUPPORTED}".rstrip())


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        a = parse_args(argv)
        flags = cpuinfo()[1]
        if a.list:
            list_configs(flags)
            return 0
        configs = select(a.configs)
        pytest_args = split_pytest_args(a.pytest_args)
        out = out_path(a.out)
        outcomes = []
        for c in configs:
            print(f"{c.name} ...", file=sys.stderr, flush=True)
            o = run_config(c, flags, pytest_args, a.timeout)
            outcomes.append(o)
            rc = "timeout" if o.rc is None else f"exit {o.rc}"
            print(f"  {o.skipped}" if o.skipped else
                  f"  {o.summary} ({rc}, {fmt_seconds(o.seconds)})", file=sys.stderr, flush=True)
        try:
            out.write_text(render(argv, pytest_args, a.timeout, outcomes), encoding="utf-8")
        except OSError as err:
            raise BadInput(f"--out {a.out}: {err.strerror}") from None
        print(f"wrote {out}", file=sys.stderr)
        return 0 if all(o.ok for o in outcomes) else 1
    except BadInput as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
