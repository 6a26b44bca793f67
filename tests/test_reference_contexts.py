"""``ropestep validate``'s top-level ``contexts``, leaf by leaf, against
:mod:`ropestep.reference.contexts`, the independent recomputation from the raw dump (the block's
ids and the model's logits, ``context{c}.safetensors``), the corpus file and the model's
tokenizer (docs/protocol.md sections 3 and 12.8).

:func:`compare_contexts` walks every leaf of the report's ``contexts``: a leaf the reference does
not have fails, as does a leaf of the reference missing from the report.  Indices, ids, counts
and texts must be equal; the logits are the dumped float32 values converted to float64 on both
sides (exact), so they must be equal too; only the probability mass has a tolerance
(:func:`mass_tol`, derived from the report's float64 softmax).  It also checks that the dumped
block is the recomputed one (the logits belong to it), and that the special ids and the
article count the run recorded are the reference's.  Planted one-line bugs in the code that
writes the section (``MUTANTS``) must each turn the comparison red.  In the tiny runs no two
top logits tie and the special id ranks far below the candidates, so the candidates' tie and
exclusion rules are compared on planted logits
(:func:`test_ties_and_special_ids_on_planted_logits`).

``tests/test_reference_validate.py`` can run the same comparison on its own cases:
``compare_contexts(case.report, contexts_reference(case.out.parent / "raw", model))``.

The model: the tiny seeded Qwen2 of ``tests/test_reference_validate.py`` (a 512-token byte-level
BPE trained on the bundled text), run with its options.
"""
from __future__ import annotations

import importlib
import math
import re
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ropestep import cli, contextcheck, corpus, models, protocol
from ropestep import tolerances as tl
from ropestep.reference import contexts as reference
from ropestep.report import dumps, load
from ropestep.verdict import loads
from reference_walk import agrees, at, has, leaves, missing_from
from reference_walk import one_torch_thread  # noqa: F401  (autouse, module scope)
from test_reference_validate import TINY_ARGS, build_model

pytestmark = pytest.mark.model

DOCS = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


@dataclass
class Case:
    argv: list[str]  # the validate options (model included; without --out and --dump-raw)
    out: Path  # the report directory
    report: dict
    ref: reference.Contexts
    seconds: dict


def contexts_reference(raw: Path, model: str) -> reference.Contexts:
    """The reference on the dump ``raw`` of a run with ``--model model`` (``smollm2``: the
    packaged GGUF's tokenizer; else the model's directory or ``.gguf`` file), on the corpus the
    run read (the bundled one; pass another's path to :func:`reference.recompute`)."""
    tokenizer = models.locate_smollm2_gguf() if model.lower() == "smollm2" else Path(model)
    return reference.recompute(raw, tokenizer)


def run_case(root: Path, args: list[str]) -> Case:
    """``ropestep validate`` with ``--dump-raw``, then the reference on the dump."""
    argv = [*args, "--quiet", "--no-figures"]
    t0 = time.perf_counter()
    assert cli.main(["validate", *argv, "--out", str(root / "validate"),
                     "--dump-raw", str(root / "raw")]) == 0
    t1 = time.perf_counter()
    ref = contexts_reference(root / "raw", args[args.index("--model") + 1])
    t2 = time.perf_counter()
    return Case(argv, root / "validate", load(root / "validate" / "report.json"), ref,
                {"validate": t1 - t0, "reference": t2 - t1})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("reference_contexts")
    model = build_model(root / "model")
    return run_case(root, ["--model", str(model), *TINY_ARGS])


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------
def mass_tol(logits, q: int, mass: float) -> float:
    """The tolerance of ``candidate_probability_mass``: the report's float64 softmax against the
    reference's mpmath value (30 digits, rounded once to float64).

    The report computes ``e_v = exp(l_v - max l)`` (the subtraction rounds by at most ``u`` of
    ``|l_v - max l| <= s``, which moves ``exp`` by a relative ``s u``, i.e. at most ``ceil(s)``
    roundings; ``exp`` itself errs by at most 1 ulp = 2 roundings), sums the ``V`` terms
    (``V - 1`` roundings), divides each by the sum (2: a reciprocal and a product), and sums the
    ``Q`` candidates' ``p`` (``Q - 1``).  Everything is non-negative, so the relative error is
    at most ``gamma_n`` with ``n`` the count of those roundings in the numerator and the
    denominator together (:func:`ropestep.tolerances.nonnegative_ops_rel`), plus 1 for the
    reference's own final rounding."""
    top = max(float(v) for v in logits)
    s = math.ceil(max(top - float(v) for v in logits))
    n = 2 * (s + 2) + (len(logits) - 1) + 2 + (q - 1) + 1
    return tl.nonnegative_ops_rel(n) * abs(mass)


def compare_contexts(report: dict, ref: reference.Contexts) -> list[str]:
    """Every leaf of ``report["contexts"]`` against the reference (a problem per disagreement,
    per report leaf the reference does not have and per reference leaf the report lacks), the
    dumped blocks against the recomputed ones, and the run's special ids and article count
    against the reference's.

    Tolerances: 0 for every leaf but ``candidate_probability_mass`` (ids, indices, counts and
    texts are exact; a logit is the dumped float32 value converted to float64 on both sides,
    which is exact, and written to JSON with a round-trip repr), :func:`mass_tol` for that."""
    problems: list[str] = []
    sub = {"contexts": report.get("contexts", [])}
    for path, value in leaves(sub):
        where = "/".join(map(str, path))
        if not has(ref.report, path):
            problems.append(f"{where}: no reference for this leaf")
            continue
        want = at(ref.report, path)
        t = 0.0
        if path[-1] == "candidate_probability_mass":
            t = mass_tol(ref.logits[path[1]], len(ref.report["contexts"][path[1]]["candidates"]),
                         want)
        if not agrees(value, want, t):
            problems.append(f"{where}: validate {value!r}, reference {want!r}, tolerance {t:.3g}")
    problems += missing_from(sub, ref.report)
    for c, (blk, ids) in enumerate(zip(ref.blocks, ref.dumped_ids)):
        if list(blk.ids) != ids:
            problems.append(f"context {c}: the dumped block is not the recomputed one")
    if report.get("protocol", {}).get("special_tokens_excluded") != ref.excluded:
        problems.append(f"protocol/special_tokens_excluded: the tokenizer's are {ref.excluded}")
    if report.get("corpus", {}).get("n_articles") != ref.n_articles:
        problems.append(f"corpus/n_articles: the reference splits {ref.n_articles} articles")
    return problems


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_every_leaf_of_the_contexts_agrees(tiny):
    problems = compare_contexts(tiny.report, tiny.ref)
    print("seconds:", tiny.seconds)
    assert not problems, "\n".join(problems)
    n = sum(1 for _ in leaves(tiny.report["contexts"]))
    q = tiny.report["config"]["queries"]
    assert len(tiny.report["contexts"]) == tiny.report["config"]["contexts"] == 2
    assert n == 2 * (9 + 3 * q)  # 9 scalar fields and 3 lists of Q per context
    # the mass is not trivially 0 or 1, and its tolerance is far below its size
    for rec, lg in zip(tiny.ref.report["contexts"], tiny.ref.logits):
        m = rec["candidate_probability_mass"]
        assert 0.0 < m < 1.0 and mass_tol(lg, q, m) < 1e-12 * m


def test_the_comparison_flags_unknown_and_missing_leaves(tiny):
    """A field the reference does not know, a field the report lost, a context too many and a
    dumped block that is not the recomputed one are all failures."""
    grown = loads(dumps(tiny.report))
    grown["contexts"][1]["new_field"] = 3
    del grown["contexts"][0]["observed_rank"]
    grown["contexts"].append(dict(grown["contexts"][1], context=2))
    problems = compare_contexts(grown, tiny.ref)
    text = "\n".join(problems)
    assert "contexts/1/new_field: no reference" in text
    assert "contexts/0/observed_rank: the reference has" in text
    assert "contexts/2/context: no reference" in text
    shifted = reference.Contexts(**{**vars(tiny.ref),
                                    "dumped_ids": [ids[1:] + ids[:1]
                                                   for ids in tiny.ref.dumped_ids]})
    assert "context 0: the dumped block is not the recomputed one" in \
        "\n".join(compare_contexts(tiny.report, shifted))


def test_the_reference_reads_the_corpus_it_was_given(tiny, tmp_path):
    """A corpus file other than the one the run read (its sha256 differs) is refused, and so is
    a run on a local file whose path is not given."""
    other = tmp_path / "python_reference.txt"
    other.write_text(corpus.default_corpus_path().read_text(encoding="utf-8") + "\n",
                     encoding="utf-8")
    with pytest.raises(ValueError, match="sha256 differs"):
        reference.corpus_articles(tiny.ref.manifest, other)
    local = {**tiny.ref.manifest, "corpus": {**tiny.ref.manifest["corpus"], "kind": "txt"}}
    with pytest.raises(ValueError, match="pass its path"):
        reference.corpus_articles(local, None)


def test_ties_and_special_ids_on_planted_logits(tiny):
    """The report's record (``protocol._context_record`` on the candidates of
    ``models.top_candidates``) against the reference's on planted logits: half-unit steps (many
    ties, the observed token's among them), the special id 0 on top, one logit 80 below the
    rest (a wide softmax)."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.out.parent / "model"))
    rng = np.random.default_rng(0)
    lg = (rng.integers(-3, 4, size=512) * 0.5).astype(np.float32)
    lg[0], lg[5] = 10.0, -80.0
    ids = tuple(int(t) for t in rng.integers(1, 512, size=12))
    observed = ids[-1]
    lg[observed] = 1.0
    excl, q = [0], 7
    blk = corpus.Block(article=3, start=4, n_tokens=40, ids=ids)
    cap = contextcheck.ContextCapture(
        block=blk, observed=observed, prefix={}, queries={}, observed_full={}, logits=lg,
        candidates=models.top_candidates(torch.from_numpy(lg), observed, q - 1, exclude=excl))
    report = {"contexts": [protocol._context_record(0, blk, cap, tok)],
              "protocol": {"special_tokens_excluded": excl}, "corpus": {"n_articles": 9}}
    rblk = reference.Block(3, 4, 40, ids)
    rec = reference.record(0, rblk, lg.astype(np.float64), q, excl, tok)
    ref = reference.Contexts(report={"contexts": [rec]}, blocks=[rblk],
                             logits=[lg.astype(np.float64)], dumped_ids=[list(ids)],
                             excluded=excl, n_articles=9)
    assert compare_contexts(report, ref) == []
    # the planted data exercise the rules: ties above the observed token and among the picked
    # alternatives, the special id left out, a mass far from 0 and 1
    assert rec["observed_rank"] > 1 and 0 not in rec["candidates"]
    assert len(set(rec["candidate_logits"][1:])) < q - 1
    assert 0.0 < rec["candidate_probability_mass"] < 0.5


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_the_reference_splits_corpus_files_as_the_run(tmp_path, suffix):
    """Section 3's step 5 on a file with a preamble, sub-headings, CRLF and CR line ends, a
    Unicode line separator and a blank record: the reference's articles are the run's."""
    import hashlib
    import json

    text = ("preamble\r\n = First = \r\n body\u2028 more\r = = Sub = = \n x\n"
            " = Second = \n\n y = z\n = Third = \n")
    path = tmp_path / f"c{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join([json.dumps({"text": text}), "", json.dumps({"text": "b"})]),
                        encoding="utf-8", newline="")
    else:
        path.write_text(text, encoding="utf-8", newline="")
    want = corpus.load_text_file(path).articles
    manifest = {"corpus": {"kind": suffix[1:], "path": path.name,
                           "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}
    got = reference.corpus_articles(manifest, path)
    assert got == want and len(want) == (2 if suffix == ".jsonl" else 3)


MUTANTS = [  # (the planted bug, the module, its line, the mutation, a leaf that must disagree)
    ("the observed token's rank counted from 1, itself included", "protocol",
     '"observed_rank": int((lg > lg[cap.observed]).sum()),',
     '"observed_rank": int((lg >= lg[cap.observed]).sum()),', "/observed_rank"),
    ("the probability mass normalised over the candidates only", "protocol",
     '"candidate_probability_mass": float(p[cand].sum())}',
     '"candidate_probability_mass": float(torch.softmax(lg[cand], -1).sum())}',
     "/candidate_probability_mass"),
    ("the softmax in float32", "protocol",
     "lg = torch.as_tensor(cap.logits, dtype=torch.float64)",
     "lg = torch.as_tensor(cap.logits, dtype=torch.float32)", "/candidate_probability_mass"),
    ("the candidates listed without the observed token", "protocol",
     '"candidates": cand, "candidates_text": [dec(t) for t in cand],',
     '"candidates": cand[1:], "candidates_text": [dec(t) for t in cand],', "/candidates/"),
    ("the texts of the candidates in id order", "protocol",
     '"candidates": cand, "candidates_text": [dec(t) for t in cand],',
     '"candidates": cand, "candidates_text": [dec(t) for t in sorted(cand)],',
     "/candidates_text/"),
    ("the alternatives taken from the lowest logits", "capture",
     "order = torch.argsort(-lg.double(), stable=True).tolist()",
     "order = torch.argsort(lg.double(), stable=True).tolist()", "/candidate_logits/"),
    ("the block starting one token late", "corpus",
     "start = int(rng.integers(len(ids) - length + 1))",
     "start = int(rng.integers(len(ids) - length)) + 1", "/start"),
    ("the articles visited in file order, not the permutation's", "corpus",
     "for a in rng.permutation(len(articles)):", "for a in range(len(articles)):",
     "/article"),
    ("the block hashed as 32-bit ids", "corpus",
     'np.asarray(self.ids, dtype="<i8")', 'np.asarray(self.ids, dtype="<i4")',
     "/block_sha256"),
]
MODULES = {"protocol": protocol, "corpus": corpus,
           "capture": importlib.import_module("ropestep.models.capture")}


def mutated(name: str, old: str, new: str, monkeypatch) -> types.ModuleType:
    """``MODULES[name]`` with one line replaced, as a module of its own."""
    orig = MODULES[name]
    src = Path(orig.__file__).read_text(encoding="utf-8")
    assert src.count(old) == 1, f"the planted line is not in {name}.py exactly once: {old!r}"
    mod = types.ModuleType(f"{orig.__name__}_mutant")
    mod.__file__, mod.__package__ = orig.__file__, orig.__package__
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # dataclasses look their module up
    exec(compile(src.replace(old, new), orig.__file__, "exec"), mod.__dict__)
    return mod


@pytest.fixture(scope="module")
def loaded(tiny):
    """The tiny model as ``protocol.run`` loads it."""
    return protocol.load(run_config(tiny))


def run_config(case: Case) -> protocol.Config:
    """The case's configuration on layer 0 and head 0 only: ``contexts`` reads no layer (the
    capture of any layer carries the same logits), so the reruns skip the other layers' work."""
    c = case.report["config"]
    return protocol.Config(**{**c, "model": str(case.out.parent / "model"), "layers": "0",
                              "heads": "0"})


def rerun(case: Case, loaded_model, module: types.ModuleType = protocol) -> dict:
    """The case's run again in process, as ``report.json`` reads back."""
    result = module.run(run_config(case), progress=False, loaded=loaded_model,
                        command=case.report["command"])
    return loads(dumps(result))


def test_the_rerun_agrees(tiny, loaded):
    """The control of the planted bugs: the unmutated rerun (layer 0 only) agrees."""
    assert compare_contexts(rerun(tiny, loaded), tiny.ref) == []


@pytest.mark.parametrize("bug, name, old, new, leaf", MUTANTS, ids=[m[0][:40] for m in MUTANTS])
def test_a_planted_bug_turns_the_comparison_red(tiny, loaded, monkeypatch, bug, name, old, new,
                                                leaf):
    mod = mutated(name, old, new, monkeypatch)
    if name == "corpus":
        monkeypatch.setattr(protocol, "select_blocks", mod.select_blocks)
    elif name == "capture":
        monkeypatch.setattr(models, "top_candidates", mod.top_candidates)
    result = rerun(tiny, loaded, mod if name == "protocol" else protocol)
    problems = compare_contexts(result, tiny.ref)
    print(bug, len(problems), problems[:3])
    assert any(leaf in p for p in problems), f"{bug}: no disagreement at {leaf}"


def test_the_docs_define_every_field(tiny):
    """docs/protocol.md section 12.8 has one table row per field of a context record."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("### 12.8 `contexts`", 1)[1].split("\n### ", 1)[0]
    documented = set()
    for row in re.findall(r"^\| (.+?) \|", section, flags=re.M):
        documented |= set(re.findall(r"`([a-z_0-9]+)`", row))
    assert set(tiny.report["contexts"][0]) <= documented
    assert "context{c}.safetensors" in text.split("### 12.7", 1)[1].split("\n### ", 1)[0]


def test_two_real_smollm2_contexts(tmp_path):
    """The same comparison on the real SmolLM2-135M (its GGUF's own tokenizer, 49152 tokens,
    three special ids): two contexts of the bundled corpus, layer 0 and head 0 only (the
    section reads no layer)."""
    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    case = run_case(tmp_path, ["--model", "smollm2", "--contexts", "2", "--queries", "4",
                               "--prefix-len", "48", "--layers", "0", "--heads", "0",
                               "--exact-rows", "0"])
    print("seconds:", case.seconds)
    assert compare_contexts(case.report, case.ref) == []
    assert len(case.ref.logits[0]) == 49152
