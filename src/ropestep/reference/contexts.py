"""The top-level ``contexts`` of ``ropestep validate``'s ``report.json`` recomputed from its
``--dump-raw`` directory, the corpus file and the model's tokenizer (docs/protocol.md sections
3 and 12.8), independently of the code that wrote them.

What is recomputed, and from what:

* the corpus' articles (the heading splitter of section 3, reimplemented with :mod:`re`) and the
  block selection (the rng walk of section 3 with the run's seed, context count and prefix
  length, tokenizing with the model's tokenizer): ``article``, ``start``, ``article_tokens`` and
  the block's token ids, hence ``observed`` (the block's last id) and ``block_sha256`` (the
  ids as 8-byte little-endian two's complement integers, packed here with :meth:`int.to_bytes`);
* from the model's next-token logits in the dump (``context{c}.safetensors``): the candidates
  (a plain sort by logit, then id), the observed token's rank (a count), the candidates' logits
  and their probability mass (the softmax over the whole vocabulary in mpmath);
* the texts, decoding each token alone with the model's tokenizer.

The logits themselves are the model's (the reference cannot run the model); what is checked
about them is that they belong to the block (the dump's ``ids`` equal the recomputed block) and
that every field derived from them follows the definitions.

Imports: numpy (its generator *is* the definition of the walk), mpmath, safetensors' numpy
reader, and the tokenizer through ``transformers.AutoTokenizer``; nothing of ropestep and not
torch.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import mpmath as mp
import numpy as np
from safetensors.numpy import load_file

MANIFEST, SCHEMA = "validate_raw.json", "ropestep.validate-raw/1"
HEADING = re.compile(r"=\s+[^=]+?\s+=")  # a top-level heading, ` = Title = ` (section 3)
# where ``--corpus default`` lives: the package's bundled text (docs/protocol.md section 8)
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data"
MASS_DPS = 30  # digits of the probability mass' softmax (the float64 result rounds it once)


# ---------------------------------------------------------------------------------------------
# the corpus
# ---------------------------------------------------------------------------------------------
def split_articles(lines: Sequence[str]) -> list[str]:
    """Section 3, step 1: an article starts at each line whose stripped text fully matches
    :data:`HEADING` and runs to the next one; its lines are joined with ``"\\n"``; lines before
    the first heading belong to no article."""
    starts = [i for i, line in enumerate(lines) if HEADING.fullmatch(line.strip())]
    bounds = list(zip(starts, starts[1:] + [len(lines)]))
    return ["\n".join(lines[a:b]) for a, b in bounds]


def text_articles(text: str) -> list[str]:
    """A ``.txt`` corpus (section 3, step 5): its lines with their line ends, split as WikiText's
    rows; a text with no heading is one article, a blank one none."""
    lines = text.splitlines(keepends=True)
    if not any(HEADING.fullmatch(line.strip()) for line in lines):
        return [text] if text.strip() else []
    return split_articles(lines)


def jsonl_articles(text: str) -> list[str]:
    """A ``.jsonl`` corpus: the ``text`` field of the object on each non-blank line."""
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]


def corpus_articles(manifest: dict, corpus: str | Path | None = None) -> list[str]:
    """The run's articles.  ``corpus``: the file the run read (the manifest keeps only its
    name); ``None`` for the bundled ``default`` and for WikiText-2 from the hub (``datasets``).
    A file's sha256 must be the one the run recorded."""
    src = manifest["corpus"]
    kind = src.get("kind")
    if kind == "hub":
        from datasets import load_dataset

        ds = load_dataset(src["path"], src["name"], split=src["split"], revision=src["revision"])
        return split_articles(list(ds["text"]))
    if corpus is None:
        if kind != "bundled":
            raise ValueError(f"the run read the corpus file {src.get('path')!r}: pass its path")
        corpus = BUNDLED_DIR / src["path"]
    raw = Path(corpus).read_bytes()
    if hashlib.sha256(raw).hexdigest() != src.get("sha256"):
        raise ValueError(f"{corpus}: not the corpus file the run read (sha256 differs)")
    # read as Python's text mode reads it: UTF-8, universal newlines
    text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    return jsonl_articles(text) if kind == "jsonl" else text_articles(text)


# ---------------------------------------------------------------------------------------------
# the blocks
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    article: int
    start: int
    article_tokens: int
    ids: tuple[int, ...]


def select_blocks(articles: Sequence[str], encode: Callable[[str], Sequence[int]], n: int,
                  length: int, seed: int) -> list[Block]:
    """Section 3, steps 2-3: ``rng = default_rng(seed)``; visit the articles in
    ``rng.permutation`` order; skip one shorter than ``length`` tokens; else draw
    ``start = rng.integers(len - length + 1)``; stop after ``n`` blocks."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(articles))
    out: list[Block] = []
    for a in order:
        ids = [int(t) for t in encode(articles[int(a)])]
        if len(ids) < length:
            continue
        start = int(rng.integers(len(ids) - length + 1))
        out.append(Block(int(a), start, len(ids), tuple(ids[start:start + length])))
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} articles have {length} tokens, {n} blocks requested")


def block_sha256(ids: Sequence[int]) -> str:
    """sha256 of the ids, each as 8 little-endian bytes (two's complement)."""
    return hashlib.sha256(b"".join(int(t).to_bytes(8, "little", signed=True)
                                   for t in ids)).hexdigest()


# ---------------------------------------------------------------------------------------------
# the fields derived from the logits
# ---------------------------------------------------------------------------------------------
def candidates(logits: np.ndarray, observed: int, k: int, excluded: Sequence[int]) -> list[int]:
    """``[observed]`` and the ``k`` tokens of highest logit, ties by lower id, among the tokens
    other than the observed one and the excluded (special) ids."""
    banned = set(excluded) | {observed}
    eligible = [t for t in range(len(logits)) if t not in banned]
    eligible.sort(key=lambda t: (-float(logits[t]), t))
    if len(eligible) < k:
        raise ValueError(f"{len(eligible)} eligible tokens, {k} alternatives requested")
    return [observed] + eligible[:k]


def rank(logits: np.ndarray, token: int) -> int:
    """The number of tokens whose logit is strictly greater than ``token``'s (0 = the top)."""
    return sum(1 for v in logits.tolist() if v > float(logits[token]))


def probability_mass(logits: np.ndarray, tokens: Sequence[int], dps: int = MASS_DPS) -> float:
    """``sum_{t in tokens} e^(l_t) / sum_{v} e^(l_v)`` over the whole vocabulary, in mpmath at
    ``dps`` digits on the float64 logits (exact: they are float32 values), rounded once."""
    with mp.workdps(dps):
        top = max(logits.tolist())
        e = [mp.exp(mp.mpf(v) - top) for v in logits.tolist()]
        return float(mp.fsum(e[t] for t in tokens) / mp.fsum(e))


def decode(tokenizer: Any, token: int) -> str | None:
    """The tokenizer's text of the single token (``None`` when it cannot decode it)."""
    try:
        return tokenizer.decode([token])
    except Exception:
        return None


def special_ids(tokenizer: Any, vocab: int) -> list[int]:
    """The tokenizer's special token ids inside the vocabulary, ascending."""
    return sorted({int(t) for t in (tokenizer.all_special_ids or []) if 0 <= int(t) < vocab})


def load_tokenizer(source: str | Path) -> Any:
    """The model's tokenizer: a model directory, or a ``.gguf`` file (the GGUF's own)."""
    from transformers import AutoTokenizer

    p = Path(source)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


# ---------------------------------------------------------------------------------------------
# the whole section
# ---------------------------------------------------------------------------------------------
@dataclass
class Contexts:
    """The recomputed ``contexts`` and what the comparison needs besides."""

    report: dict  # {"contexts": [record per context]}, the report's layout
    blocks: list[Block]
    logits: list[np.ndarray]  # per context, the dumped logits (float64, exact)
    dumped_ids: list[list[int]]  # per context, the block ids the run dumped
    excluded: list[int]  # the special ids, from the tokenizer
    n_articles: int
    manifest: dict = field(default_factory=dict)


def record(c: int, blk: Block, logits: np.ndarray, q: int, excluded: Sequence[int],
           tokenizer: Any) -> dict:
    """Context ``c``'s record (docs/protocol.md section 12.8)."""
    observed = blk.ids[-1]
    cand = candidates(logits, observed, q - 1, excluded)
    return {"context": c, "article": blk.article, "start": blk.start,
            "article_tokens": blk.article_tokens, "block_sha256": block_sha256(blk.ids),
            "observed": observed, "observed_text": decode(tokenizer, observed),
            "observed_rank": rank(logits, observed), "candidates": cand,
            "candidates_text": [decode(tokenizer, t) for t in cand],
            "candidate_logits": [float(logits[t]) for t in cand],
            "candidate_probability_mass": probability_mass(logits, cand)}


def recompute(dump: str | Path, tokenizer: str | Path | Any,
              corpus: str | Path | None = None) -> Contexts:
    """The ``contexts`` of the run dumped in ``dump``.  ``tokenizer``: the model's directory or
    ``.gguf`` file (or a loaded tokenizer); ``corpus``: see :func:`corpus_articles`."""
    dump = Path(dump)
    manifest = json.loads((dump / MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("schema") != SCHEMA:
        raise ValueError(f"{dump}: not a validate raw dump (schema {manifest.get('schema')!r})")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    cfg = manifest["config"]
    articles = corpus_articles(manifest, corpus)

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    blocks = select_blocks(articles, encode, int(cfg["contexts"]), int(cfg["prefix_len"]),
                           int(cfg["seed"]))
    items = [load_file(str(dump / f"context{c}.safetensors")) for c in range(len(blocks))]
    logits = [np.asarray(it["logits"], dtype=np.float64) for it in items]
    excluded = special_ids(tok, len(logits[0]))
    recs = [record(c, b, lg, int(cfg["queries"]), excluded, tok)
            for c, (b, lg) in enumerate(zip(blocks, logits))]
    return Contexts(report={"contexts": recs}, blocks=blocks, logits=logits,
                    dumped_ids=[[int(t) for t in it["ids"]] for it in items], excluded=excluded,
                    n_articles=len(articles), manifest=manifest)
