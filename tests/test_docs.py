"""The repository carries its own documents (``docs/``).

(a) Every citation of a numbered section -- ``docs/<name>.md section N``, ``§N``, ``sections N-M``,
    ``sections N and M``, ``§N, §M`` -- names an existing document with a heading ``## N.``; a
    citation of a quoted heading (``docs/<name>.md, "Title"``) names an existing heading; every
    ``docs/<name>.md`` mentioned exists.
(b) Nothing cites a document kept outside the repository: the shared notes by their bare file
    names, the old name of the protocol document, or a path into the shared folder.

Both checks are small pure functions over text (:func:`citation_problems`,
:func:`outside_citations`), so a deliberately bad citation can be shown to fail them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("src/ropestep/*.py", "proofs/src/*.py", "tests/**/*.py", "README.md",
           "CONTRIBUTING.md", "docs/*.md")

_ITEM = r"\d+(?:\s*[-–]\s*\d+)?"  # "3" or a range "2-8" / "2–8"
# docs/<name>.md (perhaps closing a code span), then a section list or a quoted heading.  The look-behind keeps
# "some/other/docs/x.md" out; plural leads ("sections", "§§") take bare numbers after a comma or
# "and", singular leads only further "§N" items (so "section 3, 16 contexts" cites section 3).
DOC = re.compile(r"(?<![\w./-])docs/(?P<doc>[\w-]+)\.md")
SECTIONS = re.compile(
    r"(?<![\w./-])docs/(?P<doc>[\w-]+)\.md`{0,2},?\s*(?:"
    rf"(?:sections\s+|§§\s?)(?P<many>{_ITEM}(?:\s*(?:,|and|&)\s*(?:§\s?)?{_ITEM})*)"
    rf"|(?:section\s+|§\s?)(?P<one>{_ITEM}(?:\s*,\s*§\s?{_ITEM})*)"
    r")")
TITLE = re.compile(r"(?<![\w./-])docs/(?P<doc>[\w-]+)\.md`{0,2},?\s*\"(?P<title>[^\"\n]+)\"")
# Documents outside the repository.  Upper-case bare names preceded by a non-path character (so
# docs/math.md never matches: it is lower case and preceded by "/"), the protocol document's old
# name, and any path into the shared folder.
OUTSIDE = re.compile(r"(?<![\w./\\-])(?:MATH|PAPER_PROTOCOL|STYLE)\.md"
                     r"|(?<![\w.-])docs/validation\.md"
                     r"|(?<![\w.-])(?:/work/)?shared/[\w./-]+\.(?:md|txt)")
HEADING = re.compile(r"^## (?P<num>\d+)\.\s+(?P<title>.+?)\s*$", re.M)


def _numbers(spec: str) -> list[int]:
    """``"2-8"`` -> 2..8, ``"3 and 4"`` -> 3, 4, ``"§1, §5"`` -> 1, 5."""
    out: list[int] = []
    for item in re.findall(_ITEM, spec):
        ends = [int(x) for x in re.findall(r"\d+", item)]
        out += list(range(ends[0], ends[-1] + 1)) if len(ends) == 2 else ends
    return out


def headings(doc: Path) -> dict[int, str]:
    """``{N: title}`` of the ``## N. Title`` headings of a Markdown file."""
    return {int(m["num"]): m["title"] for m in HEADING.finditer(doc.read_text(encoding="utf-8"))}


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def citation_problems(text: str, where: str = "<text>", root: Path = ROOT) -> list[str]:
    """Check (a): every ``docs/`` reference in ``text`` resolves; one message per problem."""
    problems: list[str] = []
    for m in DOC.finditer(text):
        if not (root / "docs" / f"{m['doc']}.md").is_file():
            problems.append(f"{where}:{_line(text, m.start())}: docs/{m['doc']}.md does not exist")
    for m in SECTIONS.finditer(text):
        path = root / "docs" / f"{m['doc']}.md"
        if not path.is_file():
            continue  # reported above
        have = headings(path)
        for n in _numbers(m["many"] or m["one"]):
            if n not in have:
                problems.append(f"{where}:{_line(text, m.start())}: {m.group(0)!r} cites section "
                                f"{n}, but docs/{m['doc']}.md has no heading '## {n}.'")
    for m in TITLE.finditer(text):
        path = root / "docs" / f"{m['doc']}.md"
        if path.is_file() and not any(m["title"].lower() in t.lower()
                                      for t in headings(path).values()):
            problems.append(f"{where}:{_line(text, m.start())}: docs/{m['doc']}.md has no "
                            f"numbered heading containing {m['title']!r}")
    return problems


def outside_citations(text: str, where: str = "<text>") -> list[str]:
    """Check (b): references to documents kept outside the repository; one message each."""
    return [f"{where}:{_line(text, m.start())}: cites {m.group(0)!r}, which is not in the "
            f"repository (cite docs/math.md or docs/protocol.md)" for m in OUTSIDE.finditer(text)]


def scanned_files() -> list[Path]:
    return sorted({p for pat in SCANNED for p in ROOT.glob(pat) if p.is_file()})


def _scan(check) -> list[str]:
    out: list[str] = []
    for p in scanned_files():
        out += check(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    return out


# ---------------------------------------------------------------------------------------------
# the checkers can fail
# ---------------------------------------------------------------------------------------------
# Built at run time, so this file never contains the citations it must reject.
_D = "docs" + "/"
_OUTSIDE_NAMES = ["MATH" + ".md", "PAPER_PROTOCOL" + ".md", "STYLE" + ".md", _D + "validation.md",
                  "/work/" + "shared/" + "MA" + "TH.md"]


def test_checker_accepts_good_citations():
    good = (f"see {_D}math.md section 3, 16 contexts; {_D}math.md sections 2-8; "
            f"({_D}math.md §1, §5); {_D}math.md sections 3 and 4; {_D}math.md §9;\n"
            f"{_D}protocol.md section 6 and {_D}protocol.md, \"Frozen reuse\"; "
            f"`{_D}math.md` section 2; ``{_D}protocol.md`` §8; {_D}README.md")
    assert len(SECTIONS.findall(good)) == 8 and len(TITLE.findall(good)) == 1  # all parsed
    assert citation_problems(good) == []
    assert outside_citations(good) == []


_LAST = max(headings(ROOT / "docs" / "math.md"))  # a range one past the last section


@pytest.mark.parametrize("bad, what", [
    (f"{_D}math.md section 99", "no heading '## 99.'"),
    (f"{_D}math.md sections {_LAST}-{_LAST + 1}", f"no heading '## {_LAST + 1}.'"),
    (f"{_D}math.md §1, §42", "no heading '## 42.'"),
    (f"{_D}protocol.md, \"No such heading\"", "no numbered heading containing"),
    (f"{_D}nonexistent.md section 1", "does not exist"),
    (f"`{_D}math.md` section 31", "no heading '## 31.'"),
])
def test_checker_flags_a_bad_citation(bad, what):
    problems = citation_problems(f"x = 1  # {bad}\n")
    print(problems)
    assert len(problems) == 1 and what in problems[0]


@pytest.mark.parametrize("name", _OUTSIDE_NAMES)
def test_checker_flags_an_outside_document(name):
    for text in (f"(see {name} section 3)", f"# {name}\n", f"`{name}`"):
        problems = outside_citations(text)
        print(problems)
        assert len(problems) == 1, text


def test_outside_pattern_spares_the_repository_documents():
    for text in (f"{_D}math.md section 3", f"{_D}protocol.md", "path/to/MATH" + ".md"):
        assert outside_citations(text) == [], text


# ---------------------------------------------------------------------------------------------
# the repository
# ---------------------------------------------------------------------------------------------
def test_math_and_protocol_are_numbered():
    """docs/math.md and docs/protocol.md are numbered 1..n without gaps."""
    math_ = sorted(headings(ROOT / "docs" / "math.md"))
    assert math_ == list(range(1, len(math_) + 1)) and len(math_) >= 10
    proto = sorted(headings(ROOT / "docs" / "protocol.md"))
    assert proto == list(range(1, len(proto) + 1)) and len(proto) >= 5


def test_scan_is_not_vacuous():
    files = scanned_files()
    rel = {str(p.relative_to(ROOT)) for p in files}
    assert {"README.md", "CONTRIBUTING.md", "src/ropestep/fast.py", "tests/test_docs.py",
            "docs/math.md"} <= rel
    assert any(SECTIONS.search(p.read_text(encoding="utf-8")) for p in files)


def test_every_docs_citation_resolves():
    problems = _scan(citation_problems)
    print("\n".join(problems))
    assert not problems, f"{len(problems)} unresolved docs/ citation(s)"


def test_no_citation_of_documents_outside_the_repository():
    problems = _scan(outside_citations)
    print("\n".join(problems))
    assert not problems, f"{len(problems)} citation(s) of documents outside the repository"


def test_contributing_names_tests_that_exist():
    """Every ``tests/<file>.py::<name>`` that CONTRIBUTING.md names (the table of checks and
    their planted errors) is a test function of that file; ``::name`` continues the previous
    file, ``{a,b}`` expands, ``*`` and ``[param]`` match a prefix."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    refs = re.findall(r"`(tests/[\w/]+\.py)?::([\w{},*\[\] .-]+)`", text)
    assert len(refs) >= 20
    missing, current = [], None
    for path, name in refs:
        current = path or current
        src = (ROOT / current).read_text()
        defs = set(re.findall(r"^def (test_\w+)", src, re.M))
        base = name.split("[")[0]
        m = re.match(r"(.*)\{(.*)\}(.*)", base)
        names = [m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [base]
        for n in names:
            ok = any(d.startswith(n.rstrip("*")) for d in defs) if n.endswith("*") else n in defs
            if not ok:
                missing.append(f"{current}::{n}")
    assert not missing, missing
