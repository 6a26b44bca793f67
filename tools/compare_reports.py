"""How far two reports of the same command lie apart, leaf by leaf.

    python tools/compare_reports.py A/report.json B/report.json [--skip run,cost,...]

Walks both JSON reports together (the sections named by ``--skip`` aside: by default what a
machine, a launcher or a clock changes -- timing, run, environment, peak memory, command line and
the cost section's seconds) and prints the number of numeric leaves, how many differ, the
largest relative difference ``|a - b| / max(|a|, |b|)`` with the leaf where it occurs, and
whether the verdicts agree.  NaN equals NaN here (an unresolved entry in both); a NaN or
infinity against a finite number, a leaf of another type or a different structure is printed
as such.  Exit status: 0 when the structures and verdicts agree (numbers may differ: this tool
measures, it does not judge a tolerance), 1 when they do not, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

SKIP = ("run", "timing_seconds", "environment", "peak_rss_mib", "command", "cost")


def compare(a: Any, b: Any, skip: tuple[str, ...] = SKIP) -> dict:
    """``{"leaves", "differ", "worst_rel", "worst_at", "mismatch"}`` of two reports."""
    out: dict = {"leaves": 0, "differ": 0, "worst_rel": 0.0, "worst_at": None, "mismatch": []}

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            if set(x) != set(y):
                out["mismatch"].append(f"{path or '/'}: keys {sorted(set(x) ^ set(y))}")
            for k in sorted(set(x) & set(y)):
                if not (path == "" and k in skip):
                    walk(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                out["mismatch"].append(f"{path}: lengths {len(x)} and {len(y)}")
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}/{i}")
        elif isinstance(x, bool) or isinstance(y, bool) or not (
                isinstance(x, (int, float)) and isinstance(y, (int, float))):
            if x != y:
                out["mismatch"].append(f"{path}: {x!r} and {y!r}")
        else:
            out["leaves"] += 1
            if x == y or (math.isnan(x) and math.isnan(y)):
                return
            out["differ"] += 1
            if not (math.isfinite(x) and math.isfinite(y)):
                out["mismatch"].append(f"{path}: {x!r} and {y!r}")
                return
            rel = abs(x - y) / max(abs(x), abs(y))
            if rel > out["worst_rel"]:
                out["worst_rel"], out["worst_at"] = rel, path

    walk(a, b, "")  # a verdict that differs is a mismatch of its leaves, like any other
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--skip", default=",".join(SKIP),
                   help="top-level sections left out, comma-separated (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        a, b = (json.loads(f.read_text()) for f in (args.a, args.b))
    except (OSError, ValueError) as err:
        print(f"compare_reports: cannot read a report: {err}", file=sys.stderr)
        return 2
    if not (isinstance(a, dict) and isinstance(b, dict)):
        print("compare_reports: a report must be a JSON object", file=sys.stderr)
        return 2
    res = compare(a, b, tuple(s for s in args.skip.split(",") if s))
    print(f"numeric leaves: {res['leaves']}; differ: {res['differ']}; largest relative "
          f"difference: {res['worst_rel']:.3g}" + (f" at {res['worst_at']}" if res["worst_at"]
                                                     else ""))
    for m in res["mismatch"]:
        print(f"MISMATCH {m}")
    agree = a.get("verdict") == b.get("verdict")  # also where --skip leaves the verdict out
    print("verdicts agree" if agree else "verdicts DIFFER")
    return 1 if res["mismatch"] or not agree else 0


if __name__ == "__main__":
    sys.exit(main())
