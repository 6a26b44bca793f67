"""Shared by the field-by-field reference tests (tests/test_reference_atlas.py,
tests/test_reference_validate.py, tests/test_reference_families.py): walking a report's JSON
tree -- every leaf with its path, paths matched by prefix -- and the tiny models' tokenizer."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread for a reference test module (small problems: two threads thrash when
    the 2 cores are shared; ``ROPESTEP_TEST_THREADS`` overrides it), restored afterwards.
    Autouse where it is imported."""
    import os

    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("ROPESTEP_TEST_THREADS") or 1))
    yield
    torch.set_num_threads(n)


def frozen_run(path: Path, generate: Callable[[Path], dict], tmp_path_factory: Any) -> dict:
    """A frozen run's data (``tests/data/*.pt``): with ``ROPESTEP_REGEN_GOLDEN`` set, made anew
    by ``generate(a fresh directory)`` and saved to ``path`` first; then read back."""
    import os

    import torch

    if os.environ.get("ROPESTEP_REGEN_GOLDEN"):
        data = generate(tmp_path_factory.mktemp(path.stem))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, path)
    return torch.load(path, weights_only=False)


def leaves(x: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, value)`` of every leaf (a number, bool, string or None) of a JSON tree."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from leaves(v, (*path, i))
    else:
        yield path, x


def decisions(x: Any) -> Any:
    """``x`` with each finite float replaced by ``"float"``: what of a report does not depend on
    the summation order a BLAS picks (its structure, counts, flags, labels, and where a value is
    NaN, infinite or absent).  Two runs of the same code on different machines agree in it
    where their decisions lie clear of their thresholds (the reference tests' ``undecided``)."""
    if isinstance(x, dict):
        return {k: decisions(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decisions(v) for v in x]
    if isinstance(x, float) and math.isfinite(x):
        return "float"
    return repr(x) if isinstance(x, float) else x


def at(tree: Any, path: tuple) -> Any:
    """The subtree at ``path``."""
    for p in path:
        tree = tree[p]
    return tree


def has(tree: Any, path: tuple) -> bool:
    """``tree`` has a subtree at ``path``."""
    try:
        at(tree, path)
    except (KeyError, IndexError, TypeError):
        return False
    return True


def field_key(path: tuple) -> str:
    """A path with list indices as ``*``: ``rows/*/native/mse``."""
    return "/".join("*" if isinstance(p, int) else str(p) for p in path)


def matches(path: tuple, pattern: tuple) -> bool:
    """``pattern`` is a prefix of ``path``, ``"*"`` matching any one key or index."""
    return len(path) >= len(pattern) and all(p == "*" or p == q for p, q in zip(pattern, path))


def save_bpe_tokenizer(path: Path) -> int:
    """Train a 512-token byte-level BPE on the bundled text, save it to ``path`` as a Hugging
    Face tokenizer (``<|endoftext|>`` its end of text) and return its vocabulary size."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from ropestep.corpus import default_corpus_path

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train([str(default_corpus_path())], tokenizers.trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>") \
        .save_pretrained(path)
    return bpe.get_vocab_size()


NONFINITE = ("nan", "inf", "-inf")  # how report.json writes a non-finite number


def agrees(value: Any, want: Any, tol: float) -> bool:
    """A report leaf ``value`` against the reference's ``want``: numbers within ``tol``; NaN only
    against NaN (the report writes a non-finite number as the string ``"nan"``, ``"inf"`` or
    ``"-inf"``); strings, None and bools equal, a bool never equal to a number."""
    if value in NONFINITE and isinstance(want, float):
        value = float(value)
    if isinstance(value, (str, type(None), bool)) or isinstance(want, (str, type(None), bool)):
        return value == want and type(value) is type(want)
    a, b = float(value), float(want)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tol


def missing_from(report: Any, reference: Any) -> list[str]:
    """One problem per leaf the reference computed that the report does not have (a field the
    report lost is a failure, as is one it gained without a reference)."""
    return [f"{'/'.join(map(str, path))}: the reference has {value!r}, the report has no such "
            "leaf" for path, value in leaves(reference) if not has(report, path)]


def differences(got: Any, want: Any, rel: float) -> list[str]:
    """Every leaf where two JSON trees (NaN as float NaN: ``ropestep.report.load``) differ: in
    structure, in a string or bool, or in a number by more than ``rel`` relative; NaN equals
    only NaN."""
    g, w = dict(leaves(got)), dict(leaves(want))
    out = [f"{field_path(p)}: only in the first" for p in g.keys() - w.keys()]
    out += [f"{field_path(p)}: only in the second" for p in w.keys() - g.keys()]
    return out + [f"{field_path(p)}: {g[p]!r} against {w[p]!r}"
                  for p in sorted(g.keys() & w.keys(), key=field_path)
                  if not same_leaf(g[p], w[p], rel)]


def same_leaf(a: Any, b: Any, rel: float) -> bool:
    """Two leaves agree: numbers within ``rel`` relative (NaN only with NaN), anything else
    (strings, bools, None) equal."""
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rel * max(abs(a), abs(b))


def field_path(path: tuple) -> str:
    return "/".join(map(str, path))


def assert_refuses_each(reference: Any, base: dict, cases: dict, tmp_path: Path) -> None:
    """For each ``field: (value, message)`` a dump manifest (``reference.SCHEMA``, float32)
    whose layer 1 is ``base`` with that field set must be refused by ``reference.load`` naming
    layer 1 and the message; the same manifest with layer 0 alone (``base``) loads."""
    import json

    for k, (v, msg) in cases.items():
        d = tmp_path / k
        d.mkdir()
        manifest = {"schema": reference.SCHEMA, "config": {"dtype": "float32"},
                    "layers": {"0": base, "1": {**base, k: v}}}
        (d / reference.MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match=f"layer 1 .*{msg}"):
            reference.load(d)
    d = tmp_path / "plain"
    d.mkdir()
    (d / reference.MANIFEST).write_text(json.dumps(
        {"schema": reference.SCHEMA, "config": {"dtype": "float32"}, "layers": {"0": base}}))
    assert reference.load(d).manifest["layers"]["0"]["family"] == "dot"
