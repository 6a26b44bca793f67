"""Corpora and the paper's block selection (docs/protocol.md, "Data").

A corpus is a list of *articles* (strings).  Three sources give one:

* ``"wikitext2"`` -- the paper's data: WikiText-2 raw, test split, from the ``datasets`` hub id
  ``Salesforce/wikitext`` (config ``wikitext-2-raw-v1``) at a pinned revision.  Needs the
  ``datasets`` package and the hub; anywhere else it fails with one line (:class:`CorpusError`).
* a local file: ``.txt`` (split into articles exactly like WikiText, below) or ``.jsonl`` (one
  article per record, its ``text`` field);
* ``"default"`` -- the bundled real text ``data/python_reference.txt`` (see ``data/README.md``).

Article splitting (the paper's recipe): the text is read as lines *with* their line ends (the
rows of the WikiText dataset are such lines); an article starts at each top-level heading, a
line whose stripped form fully matches ``=\\s+[^=]+?\\s+=`` (`` = Title = ``; sub-headings
`` = = Sub = = `` stay inside their article), and runs to the next one; the lines of an
article are joined with ``"\\n"``; lines before the first heading belong to no article.  A
``.txt`` file with no heading at all is one article.

Block selection (:func:`select_blocks`): ``rng = numpy.random.default_rng(seed)``; walk the
articles in ``rng.permutation(n_articles)`` order; tokenize each (no special tokens); skip one
with fewer than ``L`` tokens; else ``start = rng.integers(len - L + 1)`` and the block is
``ids[start:start + L]``; stop after ``C`` blocks.  The paper used ``seed = 1``, ``L = 512``,
``C = 16``.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .provenance import portable_name, sha256_file  # noqa: F401  (sha256_file re-exported)

HEADING = re.compile(r"=\s+[^=]+?\s+=")

WIKITEXT2 = {
    "path": "Salesforce/wikitext",
    "name": "wikitext-2-raw-v1",
    "split": "test",
    "revision": "b08601e04326c79dfdd32d625aee71d232d685c3",
}
DEFAULT_FILE = "python_reference.txt"


class CorpusError(ValueError):
    """A corpus could not be read, or is too short for the request; one-line message."""


@dataclass
class Corpus:
    """Articles plus where they came from."""

    name: str  # "wikitext2", "default" or the file path
    articles: list[str]
    source: dict = field(default_factory=dict)  # provenance recorded in the report

    def __len__(self) -> int:
        return len(self.articles)


@dataclass(frozen=True)
class Block:
    """One selected block of ``L`` token ids."""

    article: int  # index into Corpus.articles
    start: int  # token offset of the block in its article
    n_tokens: int  # tokens in the article
    ids: tuple[int, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(np.asarray(self.ids, dtype="<i8").tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# splitting
# ---------------------------------------------------------------------------------------------
def is_heading(line: str) -> bool:
    """True for a top-level WikiText heading line (`` = Title = ``), not a sub-heading."""
    return HEADING.fullmatch(line.strip()) is not None


def split_articles(lines: Iterable[str]) -> list[str]:
    """Group lines into articles at top-level headings; join each article's lines with ``\\n``.

    Lines before the first heading are dropped (they belong to no article).
    """
    articles: list[str] = []
    current: list[str] | None = None
    for line in lines:
        if is_heading(line):
            if current:
                articles.append("\n".join(current))
            current = [line]
        elif current is not None:
            current.append(line)
    if current:
        articles.append("\n".join(current))
    return articles


def split_text(text: str) -> list[str]:
    """Articles of a plain text: WikiText splitting of its lines (line ends kept).

    A text with no top-level heading is a single article (empty text: none).
    """
    lines = text.splitlines(keepends=True)
    if not any(is_heading(line) for line in lines):
        return [text] if text.strip() else []
    return split_articles(lines)


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------
def default_corpus_path() -> Path:
    """Path of the bundled default corpus."""
    return Path(__file__).resolve().parent / "data" / DEFAULT_FILE


def load_text_file(path: str | Path) -> Corpus:
    """A local ``.txt`` (WikiText splitting) or ``.jsonl`` (a ``text`` field per record)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise CorpusError(f"corpus file {str(path)!r} does not exist")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(f"corpus file {str(path)!r} is not UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise CorpusError(f"cannot read corpus file {str(path)!r}: {err.strerror}") from None
    if p.suffix.lower() == ".jsonl":
        articles = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise CorpusError(f"{p}: line {n} is not valid JSON ({err.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise CorpusError(f"{p}: line {n} has no string field 'text'")
            articles.append(rec["text"])
        kind = "jsonl"
    else:
        articles = split_text(raw)
        kind = "txt"
    return Corpus(name=str(p), articles=articles,
                  source={"kind": kind, "path": portable_name(p), "sha256": sha256_file(p)})


def load_default() -> Corpus:
    """The bundled real text (Python Language Reference topics, PSF License; see data/README.md)."""
    c = load_text_file(default_corpus_path())
    c.name = "default"
    c.source.update(kind="bundled", description="Python 3.11.7 Language Reference topics "
                    "(pydoc_data.topics), PSF License Version 2; see ropestep/data/README.md")
    return c


def load_wikitext2(revision: str | None = None) -> Corpus:
    """WikiText-2 raw test split from the hub (the paper's data); one-line error when unreachable."""
    rev = revision or WIKITEXT2["revision"]
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise CorpusError(
            "cannot load WikiText-2: --corpus wikitext2 needs the 'datasets' package and access "
            "to the dataset hub (pip install datasets); use --corpus default or --corpus PATH "
            "offline") from None
    from datasets import load_dataset

    try:
        ds = load_dataset(WIKITEXT2["path"], WIKITEXT2["name"], split=WIKITEXT2["split"],
                          revision=rev)
        lines = list(ds["text"])
    except Exception as err:  # network, offline mode, unknown revision: all one line
        msg = " ".join(str(err).split())[:160] or type(err).__name__
        raise CorpusError(
            f"cannot load WikiText-2 ({WIKITEXT2['path']}, {WIKITEXT2['name']}, revision {rev}): "
            f"the dataset hub is unreachable or refused the request ({msg}); use --corpus "
            f"default or --corpus PATH offline") from None
    return Corpus(name="wikitext2", articles=split_articles(lines),
                  source={"kind": "hub", **WIKITEXT2, "revision": rev,
                          "fingerprint": getattr(ds, "_fingerprint", None)})


def load_corpus(source: str | Path, revision: str | None = None) -> Corpus:
    """``"wikitext2"``, ``"default"`` or a path to a ``.txt``/``.jsonl`` file."""
    s = str(source)
    if s == "wikitext2":
        return load_wikitext2(revision)
    if s == "default":
        return load_default()
    return load_text_file(s)


# ---------------------------------------------------------------------------------------------
# block selection
# ---------------------------------------------------------------------------------------------
def tokenizer_fn(tokenizer) -> Callable[[str], list[int]]:
    """``text -> ids`` with ``add_special_tokens=False`` for a Hugging Face tokenizer."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode


def select_blocks(articles: Sequence[str], encode: Callable[[str], Sequence[int]],
                  n_blocks: int, length: int, seed: int = 1, corpus_name: str = "corpus"
                  ) -> list[Block]:
    """The paper's rng walk: at most one block of ``length`` tokens per article.

    Raises :class:`CorpusError` when fewer than ``n_blocks`` articles have ``length`` tokens.
    """
    if n_blocks < 1 or length < 1:
        raise ValueError(f"need n_blocks >= 1 and length >= 1, got {n_blocks} and {length}")
    rng = np.random.default_rng(seed)
    blocks: list[Block] = []
    for a in rng.permutation(len(articles)):
        ids = list(encode(articles[int(a)]))
        if len(ids) < length:
            continue
        start = int(rng.integers(len(ids) - length + 1))
        blocks.append(Block(article=int(a), start=start, n_tokens=len(ids),
                            ids=tuple(int(t) for t in ids[start:start + length])))
        if len(blocks) == n_blocks:
            return blocks
    raise CorpusError(
        f"corpus {corpus_name!r} is too short: {len(blocks)} of its {len(articles)} articles "
        f"have >= {length} tokens, {n_blocks} contexts were requested (lower --contexts or "
        f"--prefix-len, or use a longer corpus)")
