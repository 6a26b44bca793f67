"""The commands are the library rendered: ``ropestep validate``'s report holds the numbers the
library (:mod:`ropestep.api`) gives on the same tokens, leaf for leaf, bitwise in the same
process (the atlas's counterpart is ``tests/models/test_api.py::
test_check_is_the_atlas_on_the_same_tokens``).

``validate`` runs on a tiny seeded Qwen2 (2 contexts, 5 candidates, every layer and head); the
library then attaches to the same model object, takes the same corpus blocks, captures each
block's candidates with :meth:`ropestep.api.Attached.run_candidates` and evaluates every layer
with :meth:`ropestep.api.CandidateRun.evaluate`; validate's own pooling
(:func:`ropestep.protocol.summarize_layer`) of those per-context results must equal the report's
layer sections in every leaf (the real-model checks aside: they run the model's own forwards,
not the library's objects).  A planted difference -- one candidate swapped, one context's
result perturbed in its last digit -- must show, so the comparison can fail.
"""
from __future__ import annotations

import doctest

import pytest
import torch

from ropestep import api, protocol, verdict
from ropestep.corpus import load_corpus, select_blocks, tokenizer_fn
from ropestep.report import dumps
from ropestep.verdict import leaf_differences, loads

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_protocol import build_tiny_qwen2

    d = build_tiny_qwen2(tmp_path_factory.mktemp("api_validate") / "m")
    cfg = protocol.Config(model=str(d), contexts=2, queries=5, prefix_len=32, layers="all",
                          heads="all", exact_rows=0)
    model, tok, prov = protocol.load(cfg)
    report = loads(dumps(protocol.run(cfg, progress=False, loaded=(model, tok, prov))))
    return model, tok, cfg, report


def _library(model, tok, cfg, report, plant=None):
    """The per-context results of every layer, computed by the library alone, pooled by
    validate's summaries; ``plant(c, L, ctx)`` may alter one context's result."""
    lab = api.attach(model, tok)
    corpus = load_corpus(cfg.corpus)
    blocks = select_blocks(corpus.articles, tokenizer_fn(tok), cfg.contexts, cfg.prefix_len,
                           cfg.seed, corpus.name)
    ctxs: dict[int, list] = {L: [] for L in lab.layers}
    for c, blk in enumerate(blocks):
        cands = report["contexts"][c]["candidates"]
        cr = lab.run_candidates(blk, cands, layers="all")
        assert cr.candidates.tolist() == cands
        for L in lab.layers:
            ctx = cr.evaluate(L, model_dtype=cfg.dtype)
            ctxs[L].append(ctx if plant is None else plant(c, L, ctx))
    heads = list(range(lab.info.n_heads))
    return {str(L): loads(dumps(protocol.summarize_layer(v, heads, lab.info.n_heads)))
            for L, v in ctxs.items()}


def _report_layers(report):
    return {L: {k: v for k, v in sec.items() if k != "real_heads"}
            for L, sec in report["layers"].items()}


def test_validate_report_is_the_librarys_numbers(tiny):
    model, tok, cfg, report = tiny
    assert protocol.verdict(report) == []  # what the command judges: every check passed
    lib = _library(model, tok, cfg, report)
    assert sorted(lib) == sorted(report["layers"]) == ["0", "1"]
    assert leaf_differences(lib, _report_layers(report)) == []


def test_a_planted_difference_shows(tiny):
    """One context's prefix-bank identity error nudged by one unit in the last place at one
    layer: the comparison names that leaf (and only that layer's)."""
    model, tok, cfg, report = tiny

    def plant(c, L, ctx):
        if (c, L) == (1, 1):
            row = ctx.rows[0]
            row["prefix"] = {**row["prefix"],
                             "max_abs": float(torch.nextafter(torch.tensor(
                                 row["prefix"]["max_abs"], dtype=torch.float64),
                                 torch.tensor(1.0, dtype=torch.float64)))}
        return ctx

    diffs = leaf_differences(_library(model, tok, cfg, report, plant), _report_layers(report))
    assert diffs and all(d.startswith("/1/") for d in diffs), diffs


def test_the_leaf_comparison_doctests():
    res = doctest.testmod(verdict, extraglobs={}, optionflags=doctest.ELLIPSIS, verbose=False)
    assert res.attempted >= 3 and res.failed == 0
