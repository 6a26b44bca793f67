"""``ropestep architectures``: the architecture matrix as a report (``validation/architectures/``).

For each tiny random-weight model of :mod:`ropestep.archzoo` (``--only NAME,...``; default all of
:data:`ropestep.archzoo.ARCHITECTURES`), built with weight seed ``--seed`` and saved into
``models/<name>`` under a temporary directory (removed at the end: no weights are kept), this
command

1. reads the model's attention conventions as the adapter reads them
   (:func:`ropestep.models.load_model`, then ``describe_model(model).layers``: one
   :meth:`~ropestep.models.LayerConventions.row` per layer, and a per-architecture summary);
2. runs ``ropestep atlas`` and ``ropestep validate`` on it in-process, through the console entry
   point ``ropestep.cli.main``, with the small arguments of ``tests/test_architecture_matrix.py``
   (:data:`ATLAS_ARGS`, :data:`VALIDATE_ARGS`), their stdout/stderr captured;
3. reads each command's ``report.json`` and collects every check's worst ratio (see
   :func:`atlas_checks` and :func:`validate_checks` for which ratio each check has), each
   command's exit code, and the one-line refusal where a command refused the model.

and writes ``<out>/report.json`` (schema ``ropestep.architectures/1``: the command, the versions
and hardware of :func:`ropestep.protocol.environment`, the seed, per architecture its conventions,
outcomes and ratios) and ``<out>/report.md`` (the table) atomically.  Everything but timings and
the hardware block is deterministic for a given numerical environment.

Outcomes: an architecture *passes* when both commands exit 0; it is *refused* when a command
exits 2 with one ``error`` line and no traceback (what the exact layer does not model: an expected
outcome, recorded, not a failure of this command); it *fails* when a command exits 1 (a check
failed), crashes (a traceback), or exits 2 with anything but one clean line.  Exit status: 0 when
no architecture fails, 1 when one does (one ``FAIL`` line each on stderr, the report still
written), 2 on bad input (unknown ``--only`` name, ``--out`` a file, transformers missing).

Layering: this module sits with ``bench`` and ``sweep`` below ``ropestep.cli``; it reaches the
commands it runs through ``ropestep.cli.main`` looked up by name when it runs (as ``cli`` looks up
its subcommand modules), so that ``cli`` stays the only module that imports every command.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from .verdict import EXIT_FAIL, EXIT_INPUT, EXIT_PASS, input_error, num, worst

SCHEMA = "ropestep.architectures/1"
PROG = "ropestep architectures"
DEFAULT_OUT = "validation/architectures"

# The arguments of tests/test_architecture_matrix.py (that test checks they are the same).
ATLAS_ARGS = ["--contexts", "1", "--len", "40", "--layers", "all", "--anchor-every", "16",
              "--seed", "3", "--no-figures"]
VALIDATE_ARGS = ["--corpus", "default", "--contexts", "1", "--queries", "5", "--prefix-len", "40",
                 "--layers", "all", "--heads", "all", "--seed", "1", "--exact-rows", "0",
                 "--quiet", "--no-figures"]
COMMAND_ARGS = {"atlas": ATLAS_ARGS, "validate": VALIDATE_ARGS}

# LayerConventions fields summarised per architecture (one value, or one per layer where the
# layers differ), in the order of the report's table
SUMMARY_FIELDS = ("attention", "layout", "output", "rotary", "rotary_dim", "pairing", "tables",
                  "amplitude", "scaling", "score_scale", "softcap", "window", "chunk", "qk_norm",
                  "norm_kind",
                  "qkv_bias", "o_bias", "sinks", "alibi", "output_gate", "temperature")

# atlas: per-head check -> the report field holding its worst measured/bound ratio
ATLAS_RATIOS = {
    "identity_float64": "identity_float64_bound_ratio_max",
    "float64_vs_native": "float64_vs_native_bound_ratio_max",
    "float64_original_gauge_vs_native": "float64_original_gauge_bound_ratio_max",
    "model_dtype_vs_native": "model_dtype_vs_native_bound_ratio_max",
}
EXACT = "exact"  # the ratio the check itself compares with 1
ATOL_BOUND = "max_abs/atol"  # allclose checks: >= the ratio |a-b| / (atol + rtol |b|)


class ArchitecturesInputError(ValueError):
    """Bad input to the command (unknown architecture, ...): one line, exit 2."""


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=None, metavar="NAME,...",
                   help="architectures of ropestep.archzoo to run [all]")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"report directory (report.json, report.md); replaced atomically "
                        f"[{DEFAULT_OUT}]")
    p.add_argument("--seed", type=int, default=0,
                   help="weight seed of every tiny model (ropestep.archzoo.build) [0]")
    p.add_argument("--all", action="store_true",
                   help="also the census: every text causal-LM model type of the installed "
                        "transformers, as a tiny model (ropestep.census)")
    p.add_argument("--types", default=None, metavar="TYPE,...",
                   help="the census of these model types only (no zoo unless --only is given)")
    p.add_argument("--every", type=int, default=1, metavar="K",
                   help="with --all: every K-th model type of the census, from --offset [1]")
    p.add_argument("--offset", type=int, default=0, metavar="J",
                   help="with --every: the first model type taken, 0..K-1 [0]")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for every run (fixed: the summation order, hence "
                        "the numbers, depend on it) [1]")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ropestep.architectures ...``; the same as ``ropestep architectures``."""
    from .verdict import module_main

    return module_main("architectures", __doc__, add_arguments, main_args, argv)


def _cli_main() -> Callable[[Sequence[str]], int]:
    """The console entry point, looked up when the command runs (module docstring)."""
    return importlib.import_module("ropestep.cli").main


def main_args(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Handler of ``ropestep architectures``: 0 none fails, 1 one fails, 2 bad input."""
    from .verdict import output_and_threads_problem

    out = Path(args.out)
    problem = output_and_threads_problem(out, args.threads)
    if problem is not None:
        return input_error(PROG, problem)
    if importlib.util.find_spec("transformers") is None:
        return input_error(PROG, ArchitecturesInputError(
            "needs transformers: pip install -e '.[model]'"))
    from . import archzoo, census

    try:
        names = ([] if args.types is not None and args.only is None
                 else selected(args.only, list(archzoo.ARCHITECTURES)))
        types = census_selection(args.all, args.types, args.every, args.offset,
                                 list(census.causal_types()))
    except ArchitecturesInputError as err:
        return input_error(PROG, err)
    import torch

    from .protocol import quiet_libraries

    quiet_libraries()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = run(names, seed=args.seed, command=["ropestep", *argv], progress=not args.quiet,
                     types=types)
    finally:
        torch.set_num_threads(threads)
    from .report import write_report_dir

    try:
        write_report_dir(out, lambda tmp: fill(tmp, result))
    except (FileExistsError, PermissionError) as err:
        return input_error(PROG, err)
    failed = result["verdict"]["failed"]
    for line in failed:
        sys.stderr.write(f"{PROG}: FAIL {line}\n")
    if not args.quiet:
        s = result["summary"]
        print(f"{len(s['passed'])} passed, {len(s['refused'])} refused, {len(s['failed'])} "
              f"failed of {s['architectures']}; wrote {out}/report.json and report.md in "
              f"{result['timing_seconds']['total']:.0f} s")
        if result.get("census") is not None:
            print(census_line(result["census_summary"]))
    return EXIT_FAIL if failed else EXIT_PASS


def census_selection(every_type: bool, types: str | None, every: int, offset: int,
                     known: list[str]) -> list[str] | None:
    """The census's model types: ``--types`` (in the mapping's order), or with ``--all`` every
    ``every``-th type from ``offset``; None when neither is given (no census)."""
    if every < 1 or not 0 <= offset < every:
        raise ArchitecturesInputError(f"--every must be >= 1 and --offset in 0..--every - 1, got "
                                      f"--every {every} --offset {offset}")
    if types is not None:
        if every_type:
            raise ArchitecturesInputError("--types and --all: give one of them")
        want = [w.strip() for w in types.split(",") if w.strip()]
        unknown = [w for w in want if w not in known]
        if unknown or not want:
            raise ArchitecturesInputError(
                f"--types: unknown model type(s) {', '.join(unknown) or '(none given)'} (the "
                "causal-LM model types of the installed transformers)")
        return [k for k in known if k in want]
    if not every_type:
        if every != 1 or offset:
            raise ArchitecturesInputError("--every/--offset take a slice of the census: with --all")
        return None
    return known[offset::every]


def selected(only: str | None, known: list[str]) -> list[str]:
    """The architectures ``--only`` names (in the zoo's order), or all of them."""
    if only is None:
        return list(known)
    want = [w.strip() for w in only.split(",") if w.strip()]
    unknown = [w for w in want if w not in known]
    if unknown or not want:
        raise ArchitecturesInputError(
            f"--only: unknown architecture(s) {', '.join(unknown) or '(none given)'}; known: "
            f"{', '.join(known)}")
    return [k for k in known if k in want]


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------
def run(names: Sequence[str], *, seed: int = 0, command: Sequence[str] | None = None,
        progress: bool = False, run_command: Callable[[Sequence[str]], int] | None = None,
        types: Sequence[str] | None = None) -> dict:
    """The report (a dict) for the zoo's ``names`` and the census's model ``types`` (None: no
    census); models live in a temporary directory removed on return.  ``run_command`` runs one
    ``ropestep`` command line (default: ``ropestep.cli.main``)."""
    from . import archzoo
    from .protocol import environment
    from .provenance import portable_command

    t0 = time.perf_counter()
    archs = {}
    with tempfile.TemporaryDirectory(prefix="ropestep-architectures-") as tmp:
        root = Path(tmp)
        for name in names:
            t = time.perf_counter()
            rec = run_architecture(name, archzoo.ARCHITECTURES[name], root, seed,
                                   run_command or _cli_main())
            rec["seconds"] = time.perf_counter() - t
            archs[name] = rec
            if progress:
                print(f"{name}: {rec['outcome']} (atlas {rec['atlas']['exit']}, validate "
                      f"{rec['validate']['exit']}; {rec['seconds']:.1f} s)", flush=True)
        cens = None if types is None else {}
        for mt in types or ():
            t = time.perf_counter()
            rec = run_type(mt, root, seed, run_command or _cli_main())
            rec["seconds"] = time.perf_counter() - t
            cens[mt] = rec
            if progress:
                print(f"census {mt}: {rec['outcome']} ({rec['seconds']:.1f} s)", flush=True)
    seconds = {n: r.pop("seconds") for n, r in archs.items()}
    failed = [f"{n}: {why}" for n, r in archs.items() for why in r["failures"]]
    census_seconds = None
    if cens is not None:
        census_seconds = {n: r.pop("seconds") for n, r in cens.items()}
        failed += [f"census {n}: {why}" for n, r in cens.items() for why in r["failures"]]
    by = {k: [n for n, r in archs.items() if r["outcome"] == k]
          for k in ("pass", "refused", "fail")}
    out = {
        "schema": SCHEMA,
        "command": portable_command(list(command) if command is not None else None),
        "config": {"architectures": list(names), "seed": seed,
                   "atlas_args": list(ATLAS_ARGS), "validate_args": list(VALIDATE_ARGS),
                   "census_types": None if types is None else list(types)},
        "environment": environment("cpu"),
        "summary": {"architectures": len(archs), "passed": by["pass"], "refused": by["refused"],
                    "failed": by["fail"]},
        "architectures": archs,
        "census": cens,
        "census_summary": None if cens is None else census_summary(cens),
        "timing_seconds": {"total": time.perf_counter() - t0, "per_architecture": seconds,
                           "per_census_type": census_seconds},
        "verdict": {"passed": not failed, "failed": failed},
    }
    return out


CENSUS_OUTCOMES = ("pass", "refused", "not buildable", "duplicate", "fail")


def census_summary(cens: dict) -> dict:
    """Counts of the census's outcomes, over every type and over the rotary ones (a built model
    with a rotary embedding module), and the types of each outcome."""
    built = {n: r for n, r in cens.items() if r["outcome"] not in ("duplicate", "not buildable")}
    rotary = {n: r for n, r in built.items() if r.get("rotary")}
    return {
        "types": len(cens),
        "by_outcome": {k: sorted(n for n, r in cens.items() if r["outcome"] == k)
                       for k in CENSUS_OUTCOMES},
        "built": len(built),
        "rotary": len(rotary),
        "rotary_by_outcome": {k: sum(r["outcome"] == k for r in rotary.values())
                              for k in ("pass", "refused", "fail")},
    }


def census_line(s: dict) -> str:
    """One line of census counts."""
    b = s["by_outcome"]
    return (f"census: {s['types']} model types: {len(b['pass'])} pass, {len(b['refused'])} "
            f"refused, {len(b['not buildable'])} not buildable, {len(b['duplicate'])} "
            f"duplicates, {len(b['fail'])} fail; of the {s['rotary']} built with a rotary "
            f"embedding: {s['rotary_by_outcome']['pass']} pass, "
            f"{s['rotary_by_outcome']['refused']} refused, {s['rotary_by_outcome']['fail']} fail")


def _captured(fn: Callable[[], Any]) -> tuple[Any, str, str | None]:
    """``(value, output, traceback)`` of ``fn()`` with stdout and stderr captured; a raised
    exception (SystemExit included) is caught and its traceback returned instead of a value."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            return fn(), buf.getvalue(), None
        except BaseException as err:  # noqa: BLE001 - a crash is an outcome to record
            if isinstance(err, KeyboardInterrupt):
                raise
            if isinstance(err, SystemExit) and isinstance(err.code, int):
                return err.code, buf.getvalue(), None
            return None, buf.getvalue(), traceback.format_exc()


def _portable(text: str, root: Path) -> str:
    """A message without the temporary directory: ``<tmp>/models/llama`` -> ``models/llama``."""
    return text.replace(f"{root}/", "").replace(str(root), ".")


def _tail(text: str, root: Path, n: int = 12) -> list[str]:
    return [_portable(ln, root) for ln in text.strip().splitlines()[-n:]]


def run_architecture(name: str, arch: Any, root: Path, seed: int,
                     run_command: Callable[[Sequence[str]], int]) -> dict:
    """One architecture of the zoo: build and save, read its conventions, run atlas and
    validate."""
    from . import archzoo

    rec: dict = {"model_type": arch.model_type, "what": arch.what, "failures": []}
    return run_model(rec, lambda d: archzoo.save(name, d, seed), name, root, run_command)


def run_type(model_type: str, root: Path, seed: int,
             run_command: Callable[[Sequence[str]], int]) -> dict:
    """One model type of the census (:mod:`ropestep.census`): a duplicate of another type, not
    buildable (transformers' own error), or built, saved and run as :func:`run_model`."""
    from . import archzoo, census

    ent = census.entry(model_type)
    rec: dict = {"model_type": model_type, "causal_class": ent.causal_class,
                 "text_type": ent.text_type, "duplicate_of": ent.duplicate_of,
                 "override": census.OVERRIDES.get(model_type, (None, None))[1],
                 "rotary": None, "failures": []}
    if ent.duplicate_of is not None:
        rec.update(outcome="duplicate", why=f"its text model is {ent.duplicate_of!r}, counted "
                                            "there")
        return rec

    def make(directory: Path) -> Any:
        try:
            model = census.build(model_type, seed)
        except census.NotBuildable as err:
            return err
        rec["rotary"] = census.has_rotary(model)
        archzoo.save_model(model, directory)
        return None

    return run_model(rec, make, model_type, root, run_command)


def run_model(rec: dict, make: Callable[[Path], Any], key: str, root: Path,
              run_command: Callable[[Sequence[str]], int]) -> dict:
    """``make(directory)`` saves a model there (or returns a :class:`ropestep.census.NotBuildable`:
    the outcome is then *not buildable*); then its conventions are read and ``atlas`` and
    ``validate`` run on it.  Outcome: *fail* on any crash or exit 1 (``rec["failures"]``), *pass*
    when both commands pass, *refused* otherwise (module docstring)."""
    model_dir = root / "models" / key
    got, text, tb = _captured(lambda: make(model_dir))
    if tb is not None:
        rec.update(outcome="fail", conventions=None,
                   atlas=_not_run("model not built"), validate=_not_run("model not built"))
        rec["build_crash"] = _tail(tb, root)
        rec["failures"].append(f"building the model crashed: {_tail(tb, root, 1)[0]}")
        return rec
    if isinstance(got, Exception):
        rec.update(outcome="not buildable", why=_portable(str(got), root), conventions=None,
                   atlas=_not_run("not buildable"), validate=_not_run("not buildable"))
        return rec
    rec["conventions"] = read_conventions(model_dir, root)
    if rec["conventions"].get("crash"):
        rec["failures"].append(f"reading its conventions crashed: "
                               f"{rec['conventions']['crash'][-1]}")
    for cmd in ("atlas", "validate"):
        out = root / "runs" / key / cmd
        argv = [cmd, "--model", str(model_dir), *COMMAND_ARGS[cmd], "--out", str(out)]
        rec[cmd] = run_one(cmd, argv, out, root, run_command, rec["failures"])
    outcomes = {rec["atlas"]["outcome"], rec["validate"]["outcome"]}
    rec["outcome"] = ("fail" if rec["failures"] else "pass" if outcomes == {"pass"}
                      else "refused")
    return rec


def run_one(cmd: str, argv: list[str], out: Path, root: Path,
            run_command: Callable[[Sequence[str]], int], failures: list[str]) -> dict:
    """One command on a saved model: its exit, outcome (pass, fail, refused, crash), refusal
    line and checks; a crash, an exit 1 or an unclean exit 2 is added to ``failures``."""
    rc, text, tb = _captured(lambda: run_command(argv))
    res: dict = {"command": ["ropestep", *(_portable(a, root) for a in argv)], "exit": rc,
                 "outcome": None, "refusal": None, "checks": {}, "worst": None}
    errors = [ln for ln in text.splitlines() if ": error: " in ln]
    if tb is not None:
        res["outcome"] = "crash"
        res["crash"] = _tail(tb, root)
        failures.append(f"{cmd} crashed: {res['crash'][-1]}")
    elif rc == EXIT_INPUT and len(errors) == 1 and "Traceback" not in text:
        res["outcome"] = "refused"
        res["refusal"] = _portable(errors[0].split(": error: ", 1)[1], root)
    elif rc in (EXIT_PASS, EXIT_FAIL) and (out / "report.json").is_file():
        res["outcome"] = "pass" if rc == EXIT_PASS else "fail"
        report = _load(out / "report.json")
        res["checks"] = (atlas_checks if cmd == "atlas" else validate_checks)(report)
        res["worst"] = worst_check(res["checks"])
        if rc == EXIT_FAIL:
            res["failed_lines"] = [_portable(ln, root) for ln in text.splitlines()
                                   if ": FAIL " in ln][:20]
            failures.append(f"{cmd} exit 1: " + (res["failed_lines"][:1] or ["?"])[0])
    else:
        res["outcome"] = "fail"
        res["output_tail"] = _tail(text, root)
        failures.append(f"{cmd} exit {rc} without a clean refusal or a report")
    return res


def _not_run(why: str) -> dict:
    return {"command": None, "exit": None, "outcome": "not run", "refusal": None, "checks": {},
            "worst": None, "why": why}


def _load(path: Path) -> dict:
    from .verdict import loads

    return loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# conventions
# ---------------------------------------------------------------------------------------------
def read_conventions(model_dir: Path, root: Path) -> dict:
    """The adapter's reading of a saved model: per-layer rows and a summary, or the refusal."""
    from . import models

    def read() -> Any:
        try:
            model, _ = models.load_model(model_dir, tokenizer=False)
            return models.describe_model(model)
        except (models.UnsupportedModelError, models.ModelLoadError) as err:
            return err

    info, text, tb = _captured(read)
    if tb is not None:
        return {"crash": _tail(tb, root), "layers": [], "summary": None}
    if isinstance(info, Exception):
        return {"refused": _portable(" ".join(str(info).split()), root), "layers": [],
                "summary": None}
    rows = [c.row() for c in info.conventions()]
    return {"refused": None, "family": info.family, "rope_type": info.rope_type,
            "rope_theta": info.rope_theta, "head_dim": info.head_dim, "n_heads": info.n_heads,
            "n_kv_heads": info.n_kv_heads, "n_layers": info.n_layers,
            "summary": summarise(rows, info.head_dim), "layers": rows}


def summarise(rows: list[dict], head_dim: int) -> dict:
    """Per field of :data:`SUMMARY_FIELDS`: the one value every layer shares, or the per-layer
    list where layers differ; and ``head_dim``."""
    out: dict = {}
    for f in SUMMARY_FIELDS:
        vals = [r[f] for r in rows]
        same = all(_same(v, vals[0]) for v in vals)
        out[f] = vals[0] if same and vals else vals
    out["head_dim"] = head_dim
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# ---------------------------------------------------------------------------------------------
# checks and their worst ratios
# ---------------------------------------------------------------------------------------------
def _check(ratio: Any, passed: bool, kind: str | None, value: Any = None) -> dict:
    return {"ratio": ratio, "kind": kind, "passed": bool(passed), "value": value}


def _merge(checks: dict, name: str, ratios: list, passed: bool, kind: str | None,
           values: list | None = None, reduce_value: Callable = worst) -> None:
    """Pool one more observation of check ``name`` into ``checks`` (worst ratio, all passed)."""
    old = checks.get(name)
    rs = [r for r in ratios if r is not None] + ([old["ratio"]] if old and old["ratio"] is not None
                                                 else [])
    vs = [v for v in (values or []) if v is not None] + ([old["value"]] if old and
                                                         old["value"] is not None else [])
    checks[name] = _check(worst(rs) if rs else None, passed and (old is None or old["passed"]),
                          kind, reduce_value(vs) if vs else None)


def atlas_checks(report: dict) -> dict:
    """Every per-head check of an atlas report, worst over layers and heads: its measured/bound
    ratio (:data:`ATLAS_RATIOS`; ``finite`` has none) and whether every head passed; plus the
    layers' ``errors`` (their count)."""
    checks: dict = {}
    for lr in (report.get("layers") or {}).values():
        for h in lr.get("heads", []):
            for name, ok in h["checks"].items():
                field = ATLAS_RATIOS.get(name)
                _merge(checks, name, [h.get(field)] if field else [], ok,
                       EXACT if field else None)
        _merge(checks, "errors", [], not lr.get("errors"), None, [len(lr.get("errors") or [])],
               reduce_value=sum)
    return checks


def _atol(check: str, row: dict, tolerances: dict, model_dtype: str) -> float | None:
    if check == "identity":
        return tolerances["identity_write" if row["head"] == "combined" else "identity_head"][0]
    if check in ("relation", "projected_write"):
        return tolerances[check][0]
    native = tolerances["native"].get(model_dtype, {})
    return native.get("atol")  # None under a normwise (bfloat16) criterion


def _at(row: dict, path: tuple) -> Any:
    for k in path:
        row = row[k]
    return row


def validate_checks(report: dict) -> dict:
    """Every check of a validate report's verdict, worst over layers (and contexts, heads):

    * reconstruction rows (``identity``, ``relation``, ``projected_write``, ``self_mass``,
      ``native``, and ``gated_write`` on a layer with an output gate) and the calibration's ``frozen_crosscheck`` / ``refresh_identity``: allclose
      criteria ``|a - b| <= atol + rtol |b|``; report.json keeps ``max|a - b|`` but not ``|b|``,
      so the ratio given is ``max_abs / atol`` (kind ``max_abs/atol``), an upper bound of the
      check's own ratio (above 1 only where the rtol term carried the pass);
    * the real-head checks' own ratios (kind ``exact``): ``conventions`` (q, k, v against their
      per-head bounds, and the score scale), ``position_derivative`` and ``position_shift``
      (``ratio_max``), ``exact_rows`` (each error over its tolerance);
    * checks with no ratio (kind None): ``rank`` (value: the largest rank of ``dM_i W_o``; it
      must not exceed ``min(d, r, keys - 1)``, which generic heads attain),
      ``positive_coefficients`` (value: min c, must be > 0), ``no_global_readout`` (value: the
      certified lower bound, must be > 0), ``reuse_bound`` (value: violations), ``fast`` and
      ``tokenwise`` (finite).
    """
    from .protocol import ROW_FIELDS, TOLERANCES

    md = (report.get("model") or {}).get("dtype", "float32")
    checks: dict = {}
    for lr in (report.get("layers") or {}).values():
        for row in lr["reconstruction"]["rows"]:
            for check, fields in ROW_FIELDS.items():
                if f"pass_{check}" not in row:
                    continue
                atol = _atol(check, row, TOLERANCES, md)
                mx = [_at(row, f) for f in fields if f[-1].endswith("max_abs")]
                _merge(checks, check, [worst(mx) / atol] if atol else [],
                       row[f"pass_{check}"], ATOL_BOUND if atol else None)
        ck = lr["calibration"]["checks"]
        for pc in ck.get("per_context", []):
            for name in ("frozen_crosscheck", "refresh_identity"):
                _merge(checks, name, [pc[f"{name}_max_abs"] / TOLERANCES["identity_head"][0]],
                       pc[f"{name}_pass"], ATOL_BOUND)
            bv = sum(int(b) for b in pc["bound_violations"])
            _merge(checks, "reuse_bound", [], bv == 0, None, [bv], reduce_value=sum)
            _merge(checks, "tokenwise", [], _finite(pc["tokenwise_rel"]), None)
        for key, ent in lr["fast"].items():
            bad = [c for hd in ent.get("heads", []) for c in hd.get("nonfinite_contexts", [])]
            bad += ent.get("combined", {}).get("nonfinite_contexts", [])
            _merge(checks, "fast", [], "error" not in ent and not bad, None)
        for rec in (lr.get("real_heads") or {}).get("per_context", []):
            for name, r in rec.items():
                if not isinstance(r, dict) or "ok" not in r:
                    continue
                ratios, kind, values = _real_ratio(name, r)
                _merge(checks, name, ratios, r["ok"], kind, values,
                       reduce_value=_least if name in ("positive_coefficients",
                                                       "no_global_readout") else worst)
    return checks


def _least(values: list) -> float:
    from .verdict import least

    return least(values)


def _finite(v: Any) -> bool:
    from .verdict import finite

    return finite(v)


def _real_ratio(name: str, r: dict) -> tuple[list, str | None, list | None]:
    """``(ratios, kind, values)`` of one real-head check record (:func:`validate_checks`)."""
    if name == "conventions":
        ratios = [h[f"{nm}_rel"] / h[f"{nm}_tol"] for h in r.get("heads", [])
                  for nm in ("q", "k", "v")]
        sc = r.get("scale") or {}
        if sc.get("tolerance"):
            ratios.append(sc["rel"] / sc["tolerance"])
        return ratios, EXACT, None
    if name == "rank":  # an exact integer bound that generic heads attain: no error ratio
        return [], None, [r.get("rank_max")]
    if "ratio_max" in r:
        return [r["ratio_max"]], EXACT, None
    if name == "exact_rows":
        tol = r.get("tolerance")
        ratios = []
        for row in r.get("rows", []):
            ratios += [row[k] / tol for k in ("y_rel", "delta_m_rel", "c_rel") if tol]
            if row.get("readout_tol"):
                ratios.append(row["readout_rel"] / row["readout_tol"])
        return ratios, EXACT, None
    if name == "positive_coefficients":
        return [], None, [r.get("min_c")]
    if name == "no_global_readout":
        return [], None, [r.get("lower_certified_min")]
    return [], None, None


def worst_check(checks: dict) -> dict | None:
    """The check with the largest ratio (a NaN ratio is the worst), or None without ratios."""
    rated = [(n, c["ratio"]) for n, c in checks.items() if c["ratio"] is not None]
    if not rated:
        return None
    nan = [(n, r) for n, r in rated if isinstance(r, float) and math.isnan(r)]
    n, r = nan[0] if nan else max(rated, key=lambda t: t[1])
    return {"check": n, "ratio": r, "kind": checks[n]["kind"]}


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
def fill(directory: Path, result: dict) -> None:
    from .verdict import dumps

    (directory / "report.json").write_text(dumps(result, indent=1) + "\n", encoding="utf-8")
    (directory / "report.md").write_text(render_markdown(result), encoding="utf-8")


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return num(v, ".4g")
    if isinstance(v, (tuple, list)):  # one value per head (ALiBi slopes), or a pair; the
        # JSON's lists render as the tuples they were
        return "(" + ", ".join(_fmt(x) for x in v) + ")" if v else "–"
    return str(v)


def _field(s: dict, f: str) -> str:
    v = s[f]
    return "(" + ", ".join(_fmt(x) for x in v) + ")" if isinstance(v, list) else _fmt(v)


def conventions_text(conv: dict | None) -> str:
    """One table cell: what the adapter read (values that differ by layer in parentheses)."""
    if not conv:
        return "not read"
    if conv.get("refused"):
        return f"not read: {conv['refused']}"
    if conv.get("crash"):
        return "reading crashed"
    s = conv["summary"]
    parts = [f"{_field(s, 'layout')} layout", f"{_field(s, 'pairing')} pairs",
             f"R {_field(s, 'rotary_dim')}/{s['head_dim']}", f"tables {_field(s, 'tables')}",
             f"rope {conv['rope_type']}"]
    if s["amplitude"] != 1.0:
        parts.append(f"a {_field(s, 'amplitude')}")
    parts.append(f"scaling {_field(s, 'scaling')}")
    if s["score_scale"] != s["scaling"]:
        parts.append(f"score scale {_field(s, 'score_scale')}")
    def present(f: str) -> bool:
        v = s[f]
        return any(x not in (None, False) for x in (v if isinstance(v, list) else [v]))

    kinds = s.get("norm_kind", "rms")  # absent from reports before the LayerNorm form
    layer_norm = "layer" in (kinds if isinstance(kinds, list) else [kinds])
    for f, label in (("softcap", "softcap"), ("window", "window"), ("chunk", "chunk"),
                     ("qk_norm", "QK LayerNorm" if layer_norm else "QK-norm"),
                     ("sinks", "sinks"), ("qkv_bias", "qkv bias"), ("o_bias", "o bias")):
        if present(f):
            parts.append(label if s[f] is True else f"{label} {_field(s, f)}")
    if s.get("alibi"):  # absent from reports before the ALiBi reading
        parts.append(f"ALiBi slopes {_field(s, 'alibi')}")
    if s.get("output_gate"):  # absent from reports before the gate reading
        parts.append(f"output gate {_field(s, 'output_gate')}")
    t = s.get("temperature")  # absent from reports before the temperature was modelled
    if t and (not isinstance(t, list) or any(t)):
        parts.append(f"query temperature {_field(s, 'temperature')}")
    parts.append(f"out `{_field(s, 'output')}`")
    parts.append(f"`{_field(s, 'attention')}`")
    return ", ".join(parts)


def _cmd_cell(res: dict) -> str:
    if res["outcome"] == "refused":
        return f"{res['exit']}: refused"
    if res["outcome"] in ("crash", "not run"):
        return res["outcome"]
    w = res.get("worst")
    return f"{res['exit']}: " + ("–" if w is None else f"{num(w['ratio'])} ({w['check']})")


def refusal_text(rec: dict) -> str:
    """``atlas: why``, ``validate: why``, or ``atlas and validate: why`` when the same."""
    why = {c: rec[c]["refusal"] for c in ("atlas", "validate") if rec[c].get("refusal")}
    if len(set(why.values())) == 1 and len(why) == 2:
        return f"atlas and validate: {why['atlas']}"
    return "; ".join(f"{c}: {w}" for c, w in why.items())


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def table_lines(result: dict, exercises: bool = True) -> list[str]:
    """The main table: architecture, model_type, what it exercises (``exercises=False``: not
    that column), conventions read, atlas and validate (exit: worst ratio (check)), refusal."""
    lines = ["| architecture | model_type | " + ("exercises | " if exercises else "")
             + "conventions read | atlas | validate | refusal |",
             "|---|---|" + ("---|" if exercises else "") + "---|---|---|---|"]
    for name, r in result["architectures"].items():
        refusal = refusal_text(r)
        if r["outcome"] == "fail":
            refusal = "**FAIL**: " + "; ".join(r["failures"])
        lines.append(f"| `{name}` | `{r['model_type']}` | "
                     + (f"{_esc(r['what'])} | " if exercises else "")
                     + f"{_esc(conventions_text(r['conventions']))} | {_cmd_cell(r['atlas'])} | "
                     f"{_cmd_cell(r['validate'])} | {_esc(refusal)} |")
    return lines


def render_markdown(result: dict) -> str:
    env = result["environment"]
    v, hw = env["versions"], env["hardware"]
    s = result["summary"]
    archs = result["architectures"]
    lines = [
        "# Architecture matrix: `ropestep atlas` and `ropestep validate` on tiny models of "
        "every architecture", "",
        "```bash", " ".join(result["command"] or ["ropestep", "architectures"]), "```", "",
        f"Versions: ropestep {v['ropestep']}, torch {v['torch']}, transformers "
        f"{v['transformers']}, python {v['python']}.  Hardware: {hw['cpu_model']} "
        f"({hw['torch_threads']} torch thread(s)), {hw['device']}.  Weight seed "
        f"{result['config']['seed']}.", "",
        f"**{len(s['passed'])} pass, {len(s['refused'])} refused (one line, exit 2), "
        f"{len(s['failed'])} fail** of {s['architectures']} architectures "
        f"(`ropestep.archzoo`: hidden 128, head_dim 32, 2-3 layers, weights redrawn so that "
        f"scores are far from uniform).  Each command ran as `ropestep atlas --model DIR "
        f"{' '.join(result['config']['atlas_args'])}` and `ropestep validate --model DIR "
        f"{' '.join(result['config']['validate_args'])}`.", "",
        "Columns `atlas` and `validate`: exit status, then the worst ratio of any check "
        "(measured error over its tolerance or bound; a check passes at ratio <= 1) and that "
        "check; per-check ratios below.  `conventions read`: what the adapter read from the "
        "model (`describe_model`), one value per layer in parentheses where layers differ: "
        "`R` rotary dimension / head_dim, `a` the tables' amplitude (YaRN, LongRoPE), "
        "`score scale` = scaling a^2 where it differs from `scaling`.", "",
        *table_lines(result),
    ]
    for cmd in ("atlas", "validate"):
        names = sorted({c for r in archs.values() for c, x in r[cmd]["checks"].items()
                        if x["ratio"] is not None}, key=lambda c: _CHECK_ORDER.get(c, 99))
        if not names:
            continue
        kinds = {c: next(r[cmd]["checks"][c]["kind"] for r in archs.values()
                         if c in r[cmd]["checks"]) for c in names}
        lines += ["", f"## `{cmd}`: worst ratio per check", "",
                  "| architecture | " + " | ".join(
                      f"{c}{' ¹' if kinds[c] == ATOL_BOUND else ''}" for c in names) + " |",
                  "|---|" + "---|" * len(names)]
        for name, r in archs.items():
            ch = r[cmd]["checks"]
            if not ch:
                continue
            cells = [("–" if c not in ch or ch[c]["ratio"] is None else
                      num(ch[c]["ratio"]) + ("" if ch[c]["passed"] else " **FAIL**"))
                     for c in names]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        if any(k == ATOL_BOUND for k in kinds.values()):
            lines += ["", "¹ allclose checks (`|a - b| <= atol + rtol |b|`): `max|a - b| / atol`, "
                          "an upper bound of the check's own ratio (report.json keeps no `|b|`)."]
        unrated = sorted({c for r in archs.values() for c, x in r[cmd]["checks"].items()
                          if x["ratio"] is None})
        if unrated:
            lines += ["", "Checks without a ratio (flags, counts, signs), passed wherever the "
                          "command exited 0: " + ", ".join(f"`{c}`" for c in unrated) + "."]
    if result.get("census") is not None:
        lines += ["", *census_lines(result)]
    lines += ["", f"Runtime: {result['timing_seconds']['total']:.0f} s.", ""]
    return "\n".join(lines)


def census_lines(result: dict) -> list[str]:
    """The census section of report.md: the counts, then one row per model type."""
    v = result["environment"]["versions"]
    s = result["census_summary"]
    lines = [f"## Census: every causal-LM model type of transformers {v['transformers']}", "",
             "Every model type of transformers' causal-LM auto mapping, built as a tiny model "
             "from its own configuration defaults (`ropestep.census`: hidden 128, 4 heads of 32 "
             "on 2 KV heads, the fewest layers that keep every kind of layer, weights redrawn "
             "so that scores are far from uniform) and run through `atlas` and `validate` with "
             "the arguments above.  A multimodal type is its text model; where that is another "
             "type of the mapping it is counted there (*duplicate*).", "",
             f"**{census_line(s)}.**", "",
             "| model type | class | rotary | outcome | conventions read, or why not |",
             "|---|---|---|---|---|"]
    for name, r in result["census"].items():
        out = r["outcome"]
        if out == "pass":
            why = conventions_text(r.get("conventions"))
        elif out == "refused":
            why = refusal_text(r)
        elif out in ("not buildable", "duplicate"):
            why = r.get("why") or ""
        else:
            why = "**FAIL**: " + "; ".join(r["failures"])
            out = "**fail**"
        rot = "–" if r.get("rotary") is None else ("yes" if r["rotary"] else "no")
        built = r["causal_class"] + ("" if r["text_type"] == name else
                                      f" (text model `{r['text_type']}`)")
        lines.append(f"| `{name}` | `{_esc(built)}` | {rot} | {out} | {_esc(why)} |")
    over = [(name, r["override"]) for name, r in result["census"].items() if r.get("override")]
    if over:
        lines += ["", "Types built with a configuration entry of their own "
                  "(`census.OVERRIDES`), and why:", ""]
        lines += [f"- `{name}`: {_esc(why)}" for name, why in over]
    return lines


_CHECK_ORDER = {c: i for i, c in enumerate((
    "identity_float64", "float64_vs_native", "float64_original_gauge_vs_native",
    "model_dtype_vs_native", "identity", "relation", "projected_write", "self_mass", "native",
    "frozen_crosscheck", "refresh_identity", "conventions", "rank", "position_derivative",
    "position_shift", "exact_rows"))}


if __name__ == "__main__":
    sys.exit(main())
