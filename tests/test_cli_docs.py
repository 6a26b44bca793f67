"""docs/cli.md lists every option of every command exactly as the parsers define it.

The page is generated (``python -m ropestep.cli --options-markdown > docs/cli.md``); a parser
whose default, type, choices, metavar or help changed without the page following -- or a page
edited by hand -- turns this red.  The second test checks the generator against argparse
itself: every option string the parsers accept appears on the page, under its command.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ropestep import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_cli_md_is_current():
    assert DOC.read_text(encoding="utf-8") == cli.options_markdown(), (
        "docs/cli.md is stale: python -m ropestep.cli --options-markdown > docs/cli.md")


def test_every_option_is_listed_under_its_command():
    text = DOC.read_text(encoding="utf-8")
    sections = {s.split("`", 2)[1].split()[-1]: s for s in text.split("\n## ")[1:]}
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sections) == sorted(sub.choices) == sorted(cli.COMMANDS)
    for name, sp in sub.choices.items():
        for a in sp._actions:
            for o in a.option_strings:
                if o not in ("-h", "--help"):
                    assert f"`{o}`" in sections[name], f"{name}: {o} missing from docs/cli.md"
            if a.default not in (None, False, argparse.SUPPRESS) and not a.required:
                assert f"`{a.default}`" in sections[name], (name, a.dest, a.default)
