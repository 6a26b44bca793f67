"""The paper's pretrained experiment on any local model and corpus (docs/protocol.md).

For each of ``C`` blocks of ``L`` tokens (:func:`ropestep.corpus.select_blocks`), the prefix is
the first ``L-1`` tokens and the observed next token the last one.  ``Q`` continuations are
scored at position ``L-1``: anchor 0 is the observed token, the rest the model's ``Q-1``
highest-logit distinct non-special tokens at the last prefix position (observed excluded).
Each query's layer input ``u_i`` (the head input: the layer's ``input_layernorm`` output, plus
the augmented 1) reads the same *prefix-only* bank (positions ``0..L-2``, its own key
excluded); the native full attention (self included) is checked through the prefix/full
relation and the full-bank matrix.  Per layer and head this module measures

1. reconstruction: the float64 identity ``y = mu + u^T dM`` on the prefix and full banks, per
   head and for the projected write ``o = sum_h y_h W_o,h``; the float64 formula against the
   model's native write (per-head ``o_proj`` input and ``o_proj`` output of the candidate's
   forward, plus a full forward over the block for the observed token); the fast path in
   float32 and bfloat16;
2. frozen reuse: the four-predictor table pooled as the paper does (:mod:`ropestep.reuse_stats`);
3. calibration (docs/math.md section 6) and the descent check (``lambda_max(H)``, unit step).

:func:`run` returns a JSON-ready dict (schema in ``docs/protocol.md``); :mod:`ropestep.report`
writes it.  Bad input raises :class:`ProtocolError` (or the loader's/corpus's one-line errors).

The verdict (:func:`verdict`, stored as ``result["verdict"]``) lists every failed check with its
layer, context and head: a reconstruction row outside its tolerance, any non-finite error
(NaN/inf is a failure, never a pass, never dropped by a reduction: :mod:`ropestep.verdict`), a
violated reuse bound, a frozen cross-check or refresh identity outside the float64 tolerance.
"""
from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import contextlib
import functools
import json
import math
import os
import pickle
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import __version__
from . import reuse_stats as rs
from .verdict import Failure, device_problem, encode, finite, least, worst
from .provenance import model_files, portable_command, portable_config, portable_name
from .runstate import Progress
from .dist import gather_to_rank0, shard_contiguous
from .corpus import Block, CorpusError, load_corpus, select_blocks, tokenizer_fn
# one context at one layer (computed through the library: ropestep.api.CandidateRun)
from .contextcheck import TOLERANCES, ContextCapture, LayerContext
from .contextcheck import Rows  # noqa: F401 -- earlier runs' pickles name ropestep.protocol.Rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SMOLLM2_ALIAS = "smollm2"

# Pass criteria of a context/head row.  The float64 and float32-native values are the paper's

# The paper's setup and numbers (docs/protocol.md), reported beside ours when it is run.
PAPER = {
    "model": "Qwen/Qwen2.5-0.5B",
    "revision": "060db6499f32faf8b98477b0a26969ef7d8b9987",
    "corpus_revision": "b08601e04326c79dfdd32d625aee71d232d685c3",
    "n_heads": 14,
    "layers": [23],
    "contexts": 16, "queries": 32, "prefix_len": 512, "seed": 1, "corpus": "wikitext2",
    "reconstruction": {"rows_passed": 240, "rows_total": 240,
                       "prefix_write_mse": 9.78e-30, "full_write_mse": 9.62e-30,
                       "native_write_mse": 7.01e-14, "native_write_max_abs": 1.4e-5},
    "reuse": {"constant": {"anchor0": 0.047787, "all": 0.045672},
              "mean": {"anchor0": 0.124573, "all": 0.124513},
              "frozen": {"anchor0": 0.324970, "all": 0.356763},
              "linear": {"anchor0": 0.161842, "all": 0.162068},
              "target_rms": {"anchor0": 0.670545, "all": 0.670824},
              "frozen_rrmse": {"anchor0": 2.608, "all": 2.795}, "frozen_rrmse_vs_mean": 1.615,
              "heads_all_anchor_rrmse_range": [0.728, 0.933], "heads_in_range": 13},
    "descent_replication": {"heads_increasing": "3 of 28", "lam_max_median": 0.51,
                            "lam_max_max": 109.56},
}


def quiet_libraries() -> None:
    """Keep library chatter (hub/tokenizer warnings, progress bars) off the terminal: stderr
    carries the commands' errors and failed checks only."""
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"transformers|torch")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - transformers missing: the loader will say so
        pass


class ProtocolError(ValueError):
    """Bad input to the experiment (layer/head out of range, prefix too long, ...); one line."""


@dataclass
class Config:
    """Everything a run depends on (recorded verbatim in the report)."""

    model: str
    revision: str | None = None
    gguf: str | None = None
    corpus: str = "default"
    corpus_revision: str | None = None
    contexts: int = 16
    queries: int = 32
    prefix_len: int = 512
    layers: str = "last"
    heads: str = "all"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 1
    exact_rows: int = 4  # (context, head, query) rows checked against the 50-digit oracle


# ---------------------------------------------------------------------------------------------
# input parsing
# ---------------------------------------------------------------------------------------------
def parse_indices(text: str | Sequence[int], n: int, what: str,
                  allowed: Sequence[int] | None = None,
                  refused: dict[int, str] | None = None) -> list[int]:
    """``"all"``, ``"last"`` (layers), ``"7"`` or ``"0,3,5"`` -> sorted distinct indices in ``[0, n)``.

    ``allowed`` (a hybrid model's softmax-attention layers): ``"all"`` and ``"last"`` mean those,
    and an index outside them is refused with its reason from ``refused``."""
    ok = None if allowed is None else sorted(int(i) for i in allowed)
    if not isinstance(text, str):
        items = [int(x) for x in text]
    else:
        t = text.strip().lower()
        if t == "all":
            return list(range(n)) if ok is None else list(ok)
        if t == "last":
            return [n - 1] if ok is None else [ok[-1]]
        try:
            items = [int(x) for x in t.split(",") if x.strip() != ""]
        except ValueError:
            raise ProtocolError(f"--{what}s must be 'all', 'last' or comma-separated integers, got "
                                f"{text!r}") from None
    if not items:
        raise ProtocolError(f"no {what}s given")
    bad = [i for i in items if not 0 <= i < n]
    if bad:
        raise ProtocolError(f"{what} {bad[0]} out of range: the model has {n} {what}s "
                            f"(valid: 0..{n - 1})")
    other = [] if ok is None else [i for i in items if i not in ok]
    if other:
        why = (refused or {}).get(other[0], "not read")
        raise ProtocolError(f"{what} {other[0]} is not softmax attention ({why}); the "
                            f"softmax-attention {what}s are {', '.join(map(str, ok))}")
    return sorted(set(items))


def check_sizes(cfg: Config) -> None:
    """Model-independent checks of the sizes and choices in ``cfg``."""
    if cfg.contexts < 1:
        raise ProtocolError(f"--contexts must be >= 1, got {cfg.contexts}")
    if cfg.queries < 2:
        raise ProtocolError(f"--queries must be >= 2 (the observed token and at least one "
                            f"alternative), got {cfg.queries}")
    if cfg.prefix_len < 2:
        raise ProtocolError(f"--prefix-len must be >= 2 (a bank of >= 1 token plus the query), "
                            f"got {cfg.prefix_len}")
    if cfg.dtype not in DTYPES:
        raise ProtocolError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    if cfg.exact_rows < 0:
        raise ProtocolError(f"--exact-rows must be >= 0, got {cfg.exact_rows}")
    dev = str(cfg.device)
    problem = device_problem(dev)
    if problem is not None:
        raise ProtocolError(problem)


# ---------------------------------------------------------------------------------------------
# model and provenance
# ---------------------------------------------------------------------------------------------
def load(cfg: Config, placement: dict | None = None) -> tuple[Any, Any, dict]:
    """Load ``(model, tokenizer, provenance)``; ``cfg.model == "smollm2"`` is the packaged GGUF.
    ``placement``: accelerate's ``device_map``/``max_memory``/``offload_folder``
    (:func:`ropestep.models.placement`; None: the whole model on ``cfg.device``)."""
    from . import models

    source, gguf = cfg.model, cfg.gguf
    if source.lower() == SMOLLM2_ALIAS:
        if gguf is not None:
            raise ProtocolError("--gguf cannot be combined with --model smollm2 "
                                "(the alias names the packaged GGUF file)")
        source = str(models.locate_smollm2_gguf())
    with _quiet_gguf_progress():
        model, tok = models.load_model(source, revision=cfg.revision, gguf_file=gguf,
                                       dtype=DTYPES[cfg.dtype], device=cfg.device,
                                       **(placement or {}))
    if tok is None:
        raise ProtocolError(f"{cfg.model}: no tokenizer was found with the model")
    prov: dict = {"argument": portable_name(cfg.model), "source": portable_name(source),
                  "revision": cfg.revision,
                  "commit_hash": getattr(model.config, "_commit_hash", None),
                  **model_files(source, gguf)}
    return model, tok, prov


@contextlib.contextmanager
def _quiet_gguf_progress():
    """Silence the progress bar transformers' GGUF de-quantizer draws on every load."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gg
    except Exception:  # pragma: no cover - no transformers / gguf: the loader reports it
        yield
        return
    orig = getattr(gg, "tqdm", None)
    if orig is None:  # pragma: no cover - another transformers layout
        yield
        return
    gg.tqdm = functools.partial(orig, disable=True)
    try:
        yield
    finally:
        gg.tqdm = orig


def environment(device: str) -> dict:
    """Package versions and hardware."""
    import importlib.metadata as md

    def ver(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    hw = {"cpu_model": cpu, "cpu_cores": os.cpu_count(),
          "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
          "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
          "platform": platform.platform(), "device": str(device), "gpu_name": None,
          # what decides the float rounding besides the CPU: torch's kernel dispatch and MKL's
          # code-path selection (CONTRIBUTING.md, "Numerical configurations"); numbers are
          # bitwise reproducible only where these, the versions and the CPU model agree
          "cpu_capability": torch.backends.cpu.get_cpu_capability(),
          "numeric_env": {k: os.environ.get(k) for k in ("MKL_CBWR", "ATEN_CPU_CAPABILITY",
                                                          "OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
    if torch.cuda.is_available():
        hw["gpu_name"] = torch.cuda.get_device_name(0)
    return {"versions": {"python": platform.python_version(), "ropestep": __version__,
                         "torch": torch.__version__, "transformers": ver("transformers"),
                         "numpy": np.__version__, "tokenizers": ver("tokenizers"),
                         "gguf": ver("gguf"), "datasets": ver("datasets")},
            "hardware": hw}


def special_ids(tokenizer: Any) -> list[int]:
    return sorted({int(t) for t in (getattr(tokenizer, "all_special_ids", None) or [])})


# ---------------------------------------------------------------------------------------------
# capture, through the library
# ---------------------------------------------------------------------------------------------
def candidates_run(model: Any, block: Block, layers: Sequence[int], n_queries: int,
                   exclude: Sequence[int]) -> Any:
    """One full forward over the block, then the ``Q`` candidates -- the observed token first,
    then the ``Q - 1`` most likely others at the prefix's prediction -- in one batched step,
    through the library (:meth:`ropestep.api.Attached.run_candidates` over
    :func:`ropestep.models.capture_block`, the only capture code); ``model``: an
    :class:`ropestep.api.Attached` or a loaded model (attached here).  Returns the
    :class:`ropestep.api.CandidateRun`.

    The full forward gives the bank (positions ``0..L-2``), the observed token's native write at
    ``L-1`` and the logits at ``L-2``; every candidate runs at position ``L-1`` on the prefix
    cache, so each query sees exactly the prefix and itself.
    """
    from . import api, models

    lab = model if isinstance(model, api.Attached) else _attach(model)
    observed = int(block.ids[-1])
    try:
        return lab.run_candidates(block, lambda logits: models.top_candidates(
            logits, observed, n_queries - 1, exclude=exclude), layers=list(layers))
    except api.ApiError as err:
        raise ProtocolError(str(err)) from None


def capture_context(model: Any, block: Block, layers: Sequence[int], n_queries: int,
                    exclude: Sequence[int]) -> ContextCapture:
    """:func:`candidates_run`'s float32 rows (:class:`ropestep.contextcheck.ContextCapture`)."""
    return candidates_run(model, block, layers, n_queries, exclude).context


def _attach(model: Any, tokenizer: Any = None) -> Any:
    """:func:`ropestep.api.attach`, its refusals as :class:`ProtocolError`."""
    from . import api

    try:
        return api.attach(model, tokenizer)
    except api.ApiError as err:
        raise ProtocolError(str(err)) from None


def time_forward(model: Any, ids: Sequence[int]) -> float:
    """Seconds of one plain forward of ``model`` over ``ids`` (no hooks, no cache, last logits
    only): what the model itself costs on these tokens."""
    import inspect

    dev = next(model.parameters()).device
    x = torch.as_tensor(list(ids), dtype=torch.long, device=dev)[None]
    kw = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=x, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t



# ---------------------------------------------------------------------------------------------
# conventions, the oracle on real rows, and the paper's claims on the real heads
# ---------------------------------------------------------------------------------------------
EXACT_BANK = (4, 12)  # oracle rows: causal queries at these block positions (50 digits is slow)
POSITIONAL_QUERIES = 3  # prefix tokens per context for d y/d p and the exact shift


def real_checks(model: Any, spec, weights, cap: ContextCapture, layer: int, context: int,
                seed: int, *, claims: bool = True, raw: dict | None = None) -> dict:
    """:mod:`ropestep.realchecks` on one context at one layer (docs/math.md sections 1, 3, 5, 7).
    Always (every context of a run): ``positive_coefficients``, ``min c_ij > 0`` over every
    head, candidate and bank key.  With ``claims`` (the run's first context, once per layer
    run):

    * ``conventions``: the model's own projections, ``apply_rotary_pos_emb`` and ``repeat_kv``
      against ropestep's head description, on the bank;
    * ``rank``: ``rank(Delta M_i W_o,h) <= d`` for every head at the observed token and one
      seeded candidate;
    * ``no_global_readout``: a certified lower bound on the error of any single affine readout
      serving the ``Q`` candidates;
    * ``position_derivative`` / ``position_shift``: ``d y_i / d p_i`` by the RoPE generator and
      ``y_i(p_i + delta) - y_i(p_i)`` through ``phi_1(delta A)`` against the model's own attention
      at shifted position ids, on seeded prefix tokens;

    The oracle rows (``exact_rows``) are :func:`oracle_job`'s, which :func:`run` schedules.
    ``raw`` (with ``claims``): a dict that receives the model's side of ``conventions`` and the
    frequencies of the positional checks (:func:`dump_model_item`).
    """
    from . import realchecks as rc

    pre, qry = cap.prefix[layer], cap.queries[layer]
    xp, xq = pre.x.double(), qry.x.double()
    N, Q = xp.shape[0], xq.shape[0]
    pos_kv, pos_q = np.arange(N), np.full(Q, N)
    rng = np.random.default_rng([seed, context, layer])
    head = (spec, weights)
    out = {"context": context,
           "positive_coefficients": rc.positive_coefficients(spec, weights, xq, pos_q, x_kv=xp,
                                                             pos_kv=pos_kv)}
    if not claims:
        return out
    if spec.family == "latent":  # the model side of these needs a standard projection layout
        out["conventions"] = out["position_derivative"] = out["position_shift"] = None
        out["not_defined"] = {k: NOT_LAYOUT_LATENT for k in ("conventions",
                                                              "position_derivative",
                                                              "position_shift")}
    elif spec.alibi_slopes is not None:  # an inline ALiBi module: no eager call to record
        out["conventions"] = out["position_derivative"] = out["position_shift"] = None
        out["not_defined"] = {k: NOT_INLINE_ALIBI for k in ("conventions",
                                                             "position_derivative",
                                                             "position_shift")}
    else:
        out["conventions"] = rc.conventions(model, layer, xp, pos_kv, head=head, record=raw)
    if raw is not None and spec.rope.freqs is not None:
        raw["inv_freq"] = torch.tensor(spec.rope.freqs, dtype=torch.float64)
    other = int(rng.integers(1, Q)) if Q > 1 else 0
    if spec.affine:
        out["rank"] = rc.delta_m_rank(
            spec, weights, xq, pos_q,
            [(h, i) for h in range(spec.n_heads) for i in sorted({0, other})],
            x_kv=xp, pos_kv=pos_kv)
        out["no_global_readout"] = (rc.no_global_readout(spec, weights, xq, pos_q, xp, pos_kv)
                                    if Q >= 2 else None)
    else:  # input-space claims (rank of Delta M W_o, one affine readout in u): not defined
        out["rank"] = out["no_global_readout"] = None
        out.setdefault("not_defined", {}).update(
            {"rank": not_affine_reason(spec), "no_global_readout": not_affine_reason(spec)})
    if spec.family == "latent" or spec.alibi_slopes is not None:
        return out
    if spec.norm_after_rope or spec.query_temperature is not None:  # the derivative formulas
        # assume the rotation acts last, and the position alone moves the query
        out["position_derivative"] = out["position_shift"] = None
        out.setdefault("not_defined", {}).update(
            {k: NOT_ROTATION_LAST if spec.norm_after_rope else NOT_TEMPERATURE
             for k in ("position_derivative", "position_shift")})
        return out
    qs = sorted(int(i) for i in rng.choice(np.arange(1, N), size=min(POSITIONAL_QUERIES, N - 1),
                                           replace=False))
    out["position_derivative"] = rc.position_derivative(model, layer, xp, pos_kv, qs, head=head)
    out["position_shift"] = rc.position_shift(model, layer, xp, pos_kv, qs, head=head)
    return out


def oracle_job(spec, weights, x_prefix: np.ndarray, rows: Sequence[tuple[int, int]]) -> dict:
    """The oracle rows of one context (:func:`ropestep.realchecks.exact_rows` on the causal
    prefix up to the last row's query).  A plain function of picklable arguments, so that
    :func:`run` can hand it to a side process and overlap the mpmath work with the torch work
    (mpmath is single-threaded pure Python; the torch passes release the interpreter)."""
    from . import realchecks as rc

    n = max(i for _, i in rows) + 1
    return rc.exact_rows(spec, weights, torch.as_tensor(x_prefix[:n]), np.arange(n), list(rows))


def _oracle_worker_init() -> None:
    torch.set_num_threads(1)  # the side process: mpmath, beside the main process's torch


def _oracle_job_from_bytes(blob: bytes) -> dict:
    return oracle_job(*pickle.loads(blob))


class _OraclePool:
    """At most one side process for the oracle rows (spawned: no fork of a threaded torch);
    ``inline=True`` (or no rows) computes them in this process instead (a finished future)."""

    def __init__(self, needed: bool, inline: bool = False):
        self.pool = None
        if needed and not inline:
            import multiprocessing

            self.pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_oracle_worker_init)

    def submit(self, *args: Any) -> concurrent.futures.Future:
        if self.pool is not None:
            # Serialised here, by the plain pickler, which copies tensors.  Handed over as they
            # are, the pool's feeder thread would pickle them with torch's multiprocessing
            # reductions, which move each tensor's storage into shared memory in place -- while
            # this thread goes on reading the same weights: a race, which in CI let the
            # conventions check read a W_q in mid-move and fail by 0.6%.
            return self.pool.submit(_oracle_job_from_bytes,
                                    pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(oracle_job(*args))
        return done

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _wait_for_oracle(pending: list, show: bool, t_eval: float) -> None:
    """Wait for the oracle jobs still running (``(layer, index, job, future, context)``), one
    line per finished job when ``show``: how many are done and, from their pace, about how long
    the rest will take (the 50-digit rows' cost grows with ``N d m``: head_dim 256 with a 640-wide
    input is seconds per row)."""
    if not pending:
        return
    futs = {item[3]: item for item in pending}
    left = [f for f in futs if not f.done()]
    if not left:
        return
    n = len(left)
    rows = sum(len(futs[f][2][3]) for f in left)
    t0 = time.perf_counter()
    if show:
        print(f"oracle: {n} job(s), {rows} row(s) at 50 digits still running after the "
              f"{t_eval:.0f} s of float work", file=sys.stderr, flush=True)
    for k, f in enumerate(concurrent.futures.as_completed(left), 1):
        if not show:
            continue
        el = time.perf_counter() - t0
        eta = el / k * (n - k)
        print(f"oracle: {k} of {n} job(s) done (layer {futs[f][0]}, context {futs[f][4]}), "
              f"{el:.0f} s so far, about {eta:.0f} s left", file=sys.stderr, flush=True)


def exact_sample(n_contexts: int, n_heads: int, prefix_len: int, k: int, seed: int
                 ) -> dict[int, list[tuple[int, int]]]:
    """The seeded oracle sample: ``k`` distinct ``(context, head, query)`` rows, queries in
    :data:`EXACT_BANK` (clipped to the bank), grouped by context."""
    lo, hi = EXACT_BANK[0], min(EXACT_BANK[1], prefix_len - 1)
    lo = min(lo, hi - 1)
    grid = [(c, h, i) for c in range(n_contexts) for h in range(n_heads) for i in range(lo, hi)]
    rng = np.random.default_rng([seed, 9])
    pick = sorted(rng.choice(len(grid), size=min(k, len(grid)), replace=False).tolist()) if k else []
    out: dict[int, list[tuple[int, int]]] = {}
    for j in pick:
        c, h, i = grid[j]
        out.setdefault(c, []).append((h, i))
    return out


# why the input-space statements are reported as not defined on QK-norm heads
NOT_AFFINE = ("the score is not affine in u (QK-norm normalises q and k before RoPE): there is "
              "no input-space Delta M, so this input-space statement is not defined; the "
              "identity, frozen reuse and the step are measured in query space "
              "(docs/math.md section 8)")
NOT_AFFINE_LATENT = ("the score is not affine in u (latent attention whose query passes the RMS "
                     "norm of a query latent): there is no input-space Delta M, so this "
                     "input-space statement is not defined; the identity, frozen reuse and the "
                     "step are measured in the absorbed query space (docs/math.md section 14)")
# why the real-head checks that rebuild the model's per-head queries and keys from a standard
# projection layout are not defined on a latent layer
NOT_LAYOUT_LATENT = (
    "latent attention: this check rebuilds the module's per-head queries and keys from a "
    "standard projection layout, which a latent layer does not have; its queries, keys and "
    "values are checked against the latent maps on every load (models.conventions, "
    "docs/math.md section 14), and every head's output against the model's by the rows above")


# why the real-head checks that read the module's own queries and keys, or move its positions,
# are not defined on an inline ALiBi layer (BLOOM, MPT)
NOT_INLINE_ALIBI = (
    "ALiBi attention computed inside the module (BLOOM, MPT): its queries and keys are never "
    "handed to a function, so the module's own per-head projections cannot be read for this "
    "check, and the model derives its key positions itself (from the attention mask or the key "
    "count) and ignores position ids, so the positional checks cannot move them; the layout, "
    "scale and slopes are proven on every load by reproducing the module's own probabilities "
    "and output, the bias is checked against the slopes in every capture, and every head's "
    "output against the model's by the rows above (docs/math.md section 13)")


# why the positional checks are not defined on a layer with a query temperature
NOT_TEMPERATURE = (
    "a position-dependent query temperature (Llama 4's NoPE layers): the model computes it from "
    "the token's index in the sequence, not from its position id, so moving the position ids "
    "does not move it and the positional checks' formulas (docs/math.md section 5) do not "
    "apply; the identity, frozen reuse and the step are measured with the temperature in the "
    "query (docs/math.md section 13)")


# why the positional checks are not defined where a per-dim norm acts after the rotation
NOT_ROTATION_LAST = (
    "QK-norm after RoPE with a per-dim gain (Hunyuan): the rotated query and key pass the norm, "
    "so d q~/dp is not A q~ and the positional checks' formulas (docs/math.md section 5, the "
    "rotation acting last) do not apply; the identity, frozen reuse and the step are measured")


def not_affine_reason(spec: Any) -> str:
    """Why a head's input-space statements are not defined (its family's reason)."""
    return NOT_AFFINE_LATENT if spec.family == "latent" else NOT_AFFINE
# which value of each real-head check the report pools and the verdict names
REAL_CHECKS = {
    "conventions": ("q_rel_max", "k_rel_max", "v_rel_max"),
    "positive_coefficients": ("min_c",),
    "rank": ("rank_max",),
    "no_global_readout": ("lower_certified_min",),
    "position_derivative": ("ratio_max",),
    "position_shift": ("ratio_max",),
    "exact_rows": ("y_rel_max", "delta_m_rel_max", "c_rel_max", "readout_rel_max"),
}


def summarize_real_checks(per_ctx: list[dict]) -> dict:
    """Pool the per-context real-head checks: for each, whether every context passed, the worst
    value of each reported field, and the per-context records (the verdict's data)."""
    out: dict = {"per_context": per_ctx}
    nd = {k: v for r in per_ctx for k, v in (r.get("not_defined") or {}).items()}
    if nd:  # checks whose statement does not apply to these heads, with the reason
        out["not_defined"] = nd
    for name, fields in REAL_CHECKS.items():
        recs = [r[name] for r in per_ctx if r.get(name) is not None]
        if not recs:
            continue
        agg = {"contexts": len(recs), "ok": all(bool(r.get("ok")) for r in recs)}
        for f in fields:
            vals = [r.get(f) for r in recs]
            agg[f] = (least(vals) if f.startswith(("min", "lower")) or f.endswith("_min")
                      else worst(vals))
        out[name] = agg
    return out


# ---------------------------------------------------------------------------------------------
# pooling over contexts
# ---------------------------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs))


def _r6(x: np.ndarray) -> list:
    """Compact JSON lists: 6 significant digits (figure data, not used for pass/fail); a
    non-finite value stays nan/inf (written as the string "nan"/"inf" in JSON)."""
    return [float(f"{v:.6g}") for v in np.asarray(x, float).ravel()]


# ---------------------------------------------------------------------------------------------
# the verdict
# ---------------------------------------------------------------------------------------------
# the error fields behind each pass flag of a reconstruction row
# (a check applies to a row when the row carries its ``pass_<check>`` flag: the combined row
# has no per-head projected write and no self mass of its own)
ROW_FIELDS = {
    "identity": (("prefix", "mse"), ("prefix", "max_abs"), ("full", "mse"), ("full", "max_abs")),
    "relation": (("relation_max_abs",),),
    "projected_write": (("projected_prefix", "mse"), ("projected_prefix", "max_abs"),
                        ("projected_full", "mse"), ("projected_full", "max_abs")),
    "self_mass": (("self_mass_vs_native_max_abs",),),
    "native": (("native", "mse"), ("native", "max_abs"),
               ("native_observed_full_forward", "mse"),
               ("native_observed_full_forward", "max_abs")),
    # a layer with an output gate: the gate applied after the reconstructed heads, projected,
    # against the model's own write (the combined row, native criterion)
    "gated_write": (("native_gated_write", "mse"), ("native_gated_write", "max_abs")),
}
# further errors of a row: no tolerance of their own in the paper, but never non-finite
ROW_SCALARS = ("mean_max_abs", "cache_vs_full_forward_max_abs")


def _at(row: dict, path: tuple) -> Any:
    for k in path:
        row = row[k]
    return row


def _tol_text(row: dict, check: str, model_dtype: str) -> str:
    if check == "identity":
        a, r = TOLERANCES["identity_write" if row["head"] == "combined" else "identity_head"]
        return f"atol/rtol {a:g}/{r:g}"
    if check in ("relation", "projected_write"):
        a, r = TOLERANCES[check]
        return f"atol/rtol {a:g}/{r:g}"
    t = TOLERANCES["native"][model_dtype]
    return (f"normwise {t['normwise']:g} max|native|" if "normwise" in t
            else f"atol/rtol {t['atol']:g}/{t['rtol']:g}")


def row_failures(row: dict, where: str = "", model_dtype: str = "float32") -> list[Failure]:
    """Failed checks of one reconstruction row: ``identity`` / ``native`` when the pass flag is
    False or any of its errors is non-finite, and any non-finite further error."""
    out = []
    for check, fields in ROW_FIELDS.items():
        if f"pass_{check}" not in row:
            continue
        vals = {" ".join(f): _at(row, f) for f in fields}
        bad = [k for k, v in vals.items() if not finite(v)]
        if bad:
            out.append(Failure(where, check, vals[bad[0]], detail=f"non-finite {bad[0]}"))
        elif not row[f"pass_{check}"]:
            mx = {k: v for k, v in vals.items() if k.endswith("max_abs")} or vals
            k = max(mx, key=lambda k: mx[k])
            out.append(Failure(where, check, mx[k],
                               detail=f"{k} outside {_tol_text(row, check, model_dtype)}"))
    for k in ROW_SCALARS:
        if k in row and not finite(row[k]):
            out.append(Failure(where, k, row[k], detail="non-finite"))
    return out


def row_ok(row: dict) -> bool:
    """A reconstruction row passes: both pass flags and every error finite."""
    return not row_failures(row)


def _nonfinite_paths(x: Any, path: str = "") -> list[tuple[str, float]]:
    """``(path, value)`` of every non-finite float in a nested report section."""
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in _nonfinite_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in _nonfinite_paths(v, f"{path}[{i}]")]
    if isinstance(x, float) and not np.isfinite(x):
        return [(path, x)]
    return []


def verdict(result: dict) -> list[Failure]:
    """Every failed check of a :func:`run` result (or its decoded ``report.json``).

    Per reconstruction row (layer, context, head): :func:`row_failures`.  Per layer and
    context: the reuse bound ``||e_i|| <= ||u_i|| ||dM_i - dM_0||_op`` violated on any query of
    a head, the frozen cross-check and the refresh identity outside the float64 identity
    tolerance, a non-finite tokenwise agreement; per fast-path entry and head, a non-finite
    error.  Finally any non-finite number left in the pooled ``reconstruction``, ``fast``,
    ``calibration.checks`` and ``reuse`` sections of a layer that no finer check has named.
    """
    md = (result.get("model") or {}).get("dtype", "float32")
    fails: list[Failure] = []
    for L, lr in result["layers"].items():
        mine: list[Failure] = []
        for row in lr["reconstruction"]["rows"]:
            mine += row_failures(row, f"layer {L} context {row['context']} head {row['head']}", md)
        ck = lr["calibration"]["checks"]
        for pc in ck.get("per_context", []):
            w = f"layer {L} context {pc['context']}"
            for h, tw, bv in zip(pc["heads"], pc["tokenwise_rel"], pc["bound_violations"]):
                if not finite(tw):
                    mine.append(Failure(f"{w} head {h}", "tokenwise", tw, detail="non-finite"))
                if bv:
                    mine.append(Failure(f"{w} head {h}", "reuse_bound", bv,
                                        detail="queries with ||e_i|| > ||u_i|| ||dM_i - dM_0||_op"))
            for name in ("frozen_crosscheck", "refresh_identity"):
                v = pc[f"{name}_max_abs"]
                if not finite(v) or not pc[f"{name}_pass"]:
                    a, r = TOLERANCES["identity_head"]
                    mine.append(Failure(w, name, v, detail=f"max_abs outside atol/rtol {a:g}/{r:g}"
                                        if finite(v) else "non-finite"))
        for key, ent in lr["fast"].items():
            for hd in ent.get("heads", []):
                for c in hd.get("nonfinite_contexts", []):
                    mine.append(Failure(f"layer {L} context {c} head {hd['head']}", f"fast {key}",
                                        detail="non-finite error"))
            for c in ent.get("combined", {}).get("nonfinite_contexts", []):
                mine.append(Failure(f"layer {L} context {c} head combined", f"fast {key}",
                                    detail="non-finite error"))
        for rec in (lr.get("real_heads") or {}).get("per_context", []):
            for name, fields in REAL_CHECKS.items():
                r = rec.get(name)
                if r is None or r.get("ok"):
                    continue
                vals = [r.get(f) for f in fields if isinstance(r.get(f), (int, float))]
                v = next((x for x in vals if not finite(x)), vals[0] if vals else math.nan)
                mine.append(Failure(f"layer {L} context {rec['context']}", name, v,
                                    detail=" ".join(f"{f}={r.get(f)}" for f in fields)
                                    + f"; tolerance from {r.get('tolerance_from', '?')}"))
        if not mine:  # a safety net: pooled numbers no finer check has accounted for
            for sec, sub in (("reconstruction", lr["reconstruction"]), ("fast", lr["fast"]),
                             ("calibration.checks", ck), ("reuse", lr["reuse"])):
                for path, v in _nonfinite_paths(sub):
                    mine.append(Failure(f"layer {L}", f"{sec}.{path}", v, detail="non-finite"))
        fails += mine
    return fails


def verdict_block(result: dict) -> dict:
    """``{"pass", "failed_checks", "failures"}`` for the report (from :func:`verdict`)."""
    fl = verdict(result)
    return {"pass": not fl, "failed_checks": len(fl), "failures": [f.as_dict() for f in fl]}


def _nonfinite_contexts(per_ctx: list[dict], parts: Sequence[str]) -> list[int]:
    """Contexts whose fast-path errors (any part, mse or max) hold a NaN or inf."""
    return [c for c, x in enumerate(per_ctx)
            if not finite([x[p][k] for p in parts for k in ("mse", "max_abs")])]


def summarize_layer(ctxs: list[LayerContext], heads: Sequence[int], n_heads: int,
                    not_affine: str = NOT_AFFINE) -> dict:
    """Pool one layer's contexts into the report's sections (``not_affine``: why its
    input-space descent is not defined, where it is not)."""
    C = len(ctxs)
    # reconstruction
    rows = []
    for c, lc in enumerate(ctxs):
        for r in lc.rows:
            if r["head"] == "combined" or r["head"] in heads:
                rows.append({"context": c, **r})

    def agg(sel: list[dict]) -> dict:
        out = {}
        for part in ("prefix", "full", "native", "native_observed_full_forward"):
            out[part] = {"mse": _mean([r[part]["mse"] for r in sel]),
                         "max_abs": worst(r[part]["max_abs"] for r in sel)}
        out["relation_max_abs"] = worst(r["relation_max_abs"] for r in sel)
        out["cache_vs_full_forward_max_abs"] = worst(r["cache_vs_full_forward_max_abs"]
                                                     for r in sel)
        gated = [r["native_gated_write"] for r in sel if "native_gated_write" in r]
        if gated:  # an output gate: the gated write against the model's own
            out["native_gated_write"] = {"mse": _mean([g["mse"] for g in gated]),
                                         "max_abs": worst(g["max_abs"] for g in gated)}
        out["pass"] = sum(row_ok(r) for r in sel)
        out["rows"] = len(sel)
        return out

    per_head = [{"head": h, **agg([r for r in rows if r["head"] == h])} for h in heads]
    combined = agg([r for r in rows if r["head"] == "combined"])
    npass = sum(row_ok(r) for r in rows)
    failed = [{f.check for f in row_failures(r)} for r in rows]
    recon = {"tolerances": {"identity_head": list(TOLERANCES["identity_head"]),
                            "identity_write": list(TOLERANCES["identity_write"]),
                            "native": TOLERANCES["native"]},
             "rows_passed": npass, "rows_total": len(rows),
             "rows_passed_identity": sum("identity" not in f for f in failed),
             "rows_passed_native": sum("native" not in f for f in failed),
             "per_head": per_head, "combined": combined, "rows": rows}

    # fast path
    fast_out = {}
    for key in ctxs[0].fast_rows:
        errs = [lc.fast_rows[key].get("error") for lc in ctxs]
        if any(errs):
            fast_out[key] = {"error": next(e for e in errs if e)}
            continue
        ent = {"heads": [], "combined": {}}
        parts_h = ("vs_float64", "vs_native", "identity")
        for h in heads:
            hr = [lc.fast_rows[key]["heads"][h] for lc in ctxs]
            ent["heads"].append({"head": h, **{
                part: {"mse": _mean([x[part]["mse"] for x in hr]),
                       "max_abs": worst(x[part]["max_abs"] for x in hr)}
                for part in parts_h}, "nonfinite_contexts": _nonfinite_contexts(hr, parts_h)})
        cr = [lc.fast_rows[key]["combined"] for lc in ctxs]
        ent["combined"] = {part: {"mse": _mean([x[part]["mse"] for x in cr]),
                                  "max_abs": worst(x[part]["max_abs"] for x in cr)}
                           for part in ("vs_float64", "vs_native")}
        ent["combined"]["nonfinite_contexts"] = _nonfinite_contexts(cr, ("vs_float64",
                                                                         "vs_native"))
        ks = [lc.fast_rows[key]["kappa"] for lc in ctxs]
        ent["kappa"] = {"median": float(np.median([k["median"] for k in ks])),
                        "max": worst(k["max"] for k in ks)}
        fast_out[key] = ent

    # frozen reuse: the table, combined and per head
    comb_err = rs.stack_errors([lc.reuse_errors["combined"] for lc in ctxs])  # name -> (C, A)
    comb_tgt = np.stack([lc.reuse_target["combined"] for lc in ctxs])
    reuse = {"combined": rs.reuse_table(comb_err, comb_tgt), "per_head": []}
    for h in heads:
        eh = {k: np.stack([lc.reuse_errors["heads"][k][h] for lc in ctxs])
              for k in rs.PREDICTORS}
        th = np.stack([lc.reuse_target["heads"][h] for lc in ctxs])
        reuse["per_head"].append({"head": h, **rs.reuse_table(eh, th)})
    reuse["per_context"] = {k: {"anchor0": v[:, 0].tolist(), "all": v.mean(1).tolist()}
                            for k, v in comb_err.items()}
    # the paper's per-head statistic (13 heads at 0.728-0.933 for Qwen2.5-0.5B layer 23)
    reuse["heads_below_constant"] = rs.heads_beating_constant(reuse["per_head"])

    # calibration
    def cat(key: str, h: int | None = None) -> np.ndarray:
        if h is None:
            return np.concatenate([lc.calib[key][list(heads), 1:].ravel() for lc in ctxs])
        return np.concatenate([lc.calib[key][h, 1:] for lc in ctxs])

    dnames = ("score_sup", "tv", "input")
    cal_heads = []
    for h in heads:
        r_ = np.concatenate([lc.gain["r"][h] for lc in ctxs])
        g_ = np.concatenate([lc.gain["g"][h] for lc in ctxs])
        gamma, mse1, mseg = rs.best_gain(r_, g_)
        cal_heads.append({
            "head": h, "gamma": gamma, "mse_frozen": mse1, "mse_after_gain": mseg,
            "mse_mean": float((r_ ** 2).mean()),
            "tokenwise_max_rel": worst(lc.checks["tokenwise_rel"][h] for lc in ctxs),
            "bound_violations": (None if ctxs[0].checks["bound_violations"] is None
                                 else sum(lc.checks["bound_violations"][h] for lc in ctxs)),
            **rs.calibration(cat("rel", h), {d: cat(d, h) for d in dnames})})
    r_o = np.concatenate([lc.gain["r_o"] for lc in ctxs])
    g_o = np.concatenate([lc.gain["g_o"] for lc in ctxs])
    gamma_o, mse1_o, mseg_o = rs.best_gain(r_o, g_o)
    const0 = reuse["combined"]["predictors"]["constant"]["mse"]["anchor0"]
    rel_c = np.concatenate([lc.calib["rel_combined"][1:] for lc in ctxs])
    input_c = np.concatenate([lc.calib["input"][0, 1:] for lc in ctxs])
    tv_c = np.concatenate([lc.calib["tv"][list(heads), 1:].mean(0) for lc in ctxs])
    calib = {
        "anchor": 0,
        "distances": {"score_sup": "max_j |s_ij - s_0j| (raw scores, per head)",
                      "tv": "(1/2) sum_j |p_ij - p_0j| (attention rows, per head)",
                      "input": "||u_i - u_0||_2 (layer inputs, shared by heads)"},
        "per_head": cal_heads,
        "pooled_heads": rs.calibration(cat("rel"), {d: cat(d) for d in dnames}),
        "combined": {"gamma": gamma_o, "mse_frozen": mse1_o, "mse_after_gain": mseg_o,
                     "rrmse_frozen": rs.ratio_root(mse1_o, const0),
                     "rrmse_after_gain": rs.ratio_root(mseg_o, const0),
                     **rs.calibration(rel_c, {"input": input_c, "tv_mean_over_heads": tv_c})},
        "checks": {
            "tokenwise_max_rel": worst(lc.checks["tokenwise_rel"] for lc in ctxs),
            "frozen_crosscheck_max_abs": worst(lc.checks["frozen_crosscheck_max_abs"]
                                               for lc in ctxs),
            "refresh_identity_max_abs": worst(lc.checks["refresh_identity_max_abs"]
                                              for lc in ctxs),
            "bound_violations": (None if ctxs[0].checks["bound_violations"] is None else
                                 sum(sum(lc.checks["bound_violations"]) for lc in ctxs)),
            # every head (the combined write reads them all), per context: the verdict's data
            "per_context": [{
                "context": c, "heads": list(range(n_heads)),
                "tokenwise_rel": list(lc.checks["tokenwise_rel"]),
                "bound_violations": ([0] * n_heads if lc.checks["bound_violations"] is None
                                     else list(lc.checks["bound_violations"])),
                **{f"{n}_{s}": lc.checks[f"{n}_{s}"]
                   for n in ("frozen_crosscheck", "refresh_identity") for s in ("max_abs", "pass")},
            } for c, lc in enumerate(ctxs)]},
        "points": {
            "head": np.concatenate([np.repeat(np.asarray(heads), lc.calib["rel"].shape[1] - 1)
                                    for lc in ctxs]).tolist(),
            "rel": _r6(cat("rel")), "score_sup": _r6(cat("score_sup")), "tv": _r6(cat("tv")),
            "input": _r6(cat("input")), "rel_combined": _r6(rel_c), "input_combined": _r6(input_c)},
    }

    # descent, in each parametrisation (never compared across them)
    def space(prefix: str, label: str) -> dict:
        lam = np.stack([lc.descent[f"{prefix}lam_max"] for lc in ctxs], 1)  # (H, C, Q)
        e0 = np.stack([lc.descent[f"{prefix}e0"] for lc in ctxs], 1)
        e1 = np.stack([lc.descent[f"{prefix}e1"] for lc in ctxs], 1)
        inc = e1 > e0
        d_heads = [{"head": h, "lam_max": rs.summarize(lam[h]),
                    "frac_lam_gt_2": float((lam[h] > 2).mean()),
                    "frac_rows_increase": float(inc[h].mean()),
                    "increases": bool(np.median(e1[h] - e0[h]) > 0)} for h in heads]
        nh = len(heads)
        return {
            "space": label,
            "rule": "a head 'increases E' when the median over its (context, query) rows of "
                    "E_i(step) - E_i(0) is > 0; rows are all Q queries of all C contexts on the "
                    "prefix bank",
            "per_head": d_heads,
            "heads_increasing": sum(d["increases"] for d in d_heads), "heads": nh,
            "fraction_heads_increasing": sum(d["increases"] for d in d_heads) / nh,
            "fraction_rows_increasing": float(inc[list(heads)].mean()),
            "lam_max": rs.summarize(lam[list(heads)]),
            "points": {"head": np.repeat(np.asarray(heads), lam.shape[1] * lam.shape[2]).tolist(),
                       "lam_max": _r6(lam[list(heads)])},
        }

    label = "input space (the paper's: u = [x; 1], H = sum_j c_j a_j a_j^T)"
    descent = (space("", label) if "lam_max" in ctxs[0].descent else
               {"space": label, "not_defined": not_affine})
    descent["query_space"] = space("q_", "query space (rotated query, a_j = scale k~_j)")
    rep_inc = np.stack([lc.descent["rep_increases"] for lc in ctxs], 1)[list(heads)]  # (H, C)
    rep_lam = np.stack([lc.descent["rep_lam_max"] for lc in ctxs], 1)[list(heads)]
    descent["replication_style"] = {
        "space": "query space (rotated query, a_j = scale k~_j), as the public replication",
        "query": "each context's final query (the observed token) on the full bank, its own "
                 "key included; one (head, context) pair per count",
        "increase": int(rep_inc.sum()), "pairs": int(rep_inc.size),
        "lam_max_median": float(np.median(rep_lam)), "lam_max_max": worst(rep_lam.ravel()),
    }
    return {"reconstruction": recon, "fast": fast_out, "reuse": reuse, "calibration": calib,
            "descent": descent, "contexts": C}


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def is_paper_setup(cfg: Config, layers: Sequence[int], heads: Sequence[int] | None = None) -> bool:
    """True only for the paper's exact setup: the pinned model revision, WikiText-2 at its
    pinned revision, layer 23, all 14 heads, 16 contexts x 32 queries x 512 tokens, seed 1,
    float32 (then the paper's numbers are set beside ours)."""
    all_heads = list(range(PAPER["n_heads"]))
    return (cfg.model == PAPER["model"] and cfg.revision == PAPER["revision"]
            and cfg.corpus == PAPER["corpus"] and cfg.corpus_revision == PAPER["corpus_revision"]
            and list(layers) == PAPER["layers"]
            and (list(heads) if heads is not None
                 else parse_indices(cfg.heads, PAPER["n_heads"], "head")) == all_heads
            and cfg.contexts == PAPER["contexts"] and cfg.queries == PAPER["queries"]
            and cfg.prefix_len == PAPER["prefix_len"] and cfg.seed == PAPER["seed"]
            and cfg.dtype == "float32" and cfg.gguf is None)


def run(cfg: Config, *, progress: bool = True, command: Sequence[str] | None = None,
        loaded: tuple[Any, Any, dict] | None = None,
        log: Callable[[str], None] | None = None, dump_raw: Path | None = None,
        dist_info: tuple[int, int] | None = None, placement: dict | None = None,
        run_dir: Path | None = None, resume: bool = False) -> dict | None:
    """Run the experiment and return the report dict (the report itself is not written here).

    ``dist_info = (rank, world)`` under torchrun (:func:`ropestep.dist.init_distributed`): the
    contexts are shared out in contiguous blocks, every rank computes its contexts (all layers,
    their real-head checks and oracle rows), rank 0 gathers them in context order and returns the
    report, the other ranks None.  Every context is computed from its own inputs alone, so the
    report does not depend on the number of processes (timings and ``run`` aside).
    ``placement``: accelerate's big-model placement (:func:`ropestep.models.placement`).
    ``run_dir``: every finished context (all its layers, real-head checks and oracle rows) is
    kept there as it completes (:mod:`ropestep.runstate`); with ``resume`` the contexts already
    there, of a run with the same configuration and model files, are read back, not recomputed.

    ``loaded`` may pass an already loaded ``(model, tokenizer, provenance)`` (tests).
    ``dump_raw``: a directory that receives the raw tensors the ``reconstruction``, ``reuse``,
    ``calibration``, ``descent`` and ``fast`` sections and the ``contexts`` are computed from
    (:func:`dump_layer`, :func:`dump_item`, :func:`dump_context`, :func:`write_raw_manifest`;
    docs/protocol.md section 12); the report is the same with or without it.  The model's
    side of the ``real_heads`` conventions and positional checks goes to
    :func:`dump_model_item` (section 12.10).
    """
    from . import models

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    check_sizes(cfg)
    t = time.perf_counter()
    corpus = load_corpus(cfg.corpus, cfg.corpus_revision)
    timings["corpus_load_s"] = time.perf_counter() - t
    if len(corpus) == 0:
        raise CorpusError(f"corpus {corpus.name!r} holds no article")

    t = time.perf_counter()
    model, tok, prov = loaded if loaded is not None else load(cfg, placement)
    timings["model_load_s"] = time.perf_counter() - t
    # the library's door: conventions read and proven once; captures and head descriptions
    # below go through it (ropestep.api)
    lab = _attach(model, tok)
    info = lab.info
    layers = parse_indices(cfg.layers, info.n_layers, "layer", info.softmax_layers,
                           dict(info.others))
    heads = parse_indices(cfg.heads, info.n_heads, "head")
    if info.max_positions and cfg.prefix_len > info.max_positions:
        raise ProtocolError(f"--prefix-len {cfg.prefix_len} exceeds the model's context "
                            f"({info.max_positions} positions)")
    if info.family not in ("dot", "qknorm"):
        raise ProtocolError(f"{info.name}: score family {info.family!r} has no statement of the "
                            "protocol (it covers plain and QK-norm RoPE heads)")
    vocab = int(model.get_output_embeddings().weight.shape[0])
    excl = [t_ for t_ in special_ids(tok) if 0 <= t_ < vocab]
    if cfg.queries - 1 > vocab - 1 - len(excl):
        raise ProtocolError(f"--queries {cfg.queries} needs {cfg.queries - 1} alternatives but the "
                            f"vocabulary has only {vocab - 1 - len(excl)} eligible tokens")

    t = time.perf_counter()
    blocks = select_blocks(corpus.articles, tokenizer_fn(tok), cfg.contexts, cfg.prefix_len,
                           cfg.seed, corpus.name)
    timings["block_selection_s"] = time.perf_counter() - t

    dev = cfg.device
    def head(L: int) -> tuple[Any, Any]:
        """Layer ``L``'s description and float64 weights, read when the layer's checks need
        them and dropped after: one layer's float64 weights at a time (a 70B model's 80 layers
        would hold ~100 GB), read through the offload hook when the layer is on disk."""
        return lab.head_description(L, cfg.prefix_len, device=dev)

    facts: dict[int, dict] = {}  # each layer's sizes and layout (the dump's manifest)
    if dump_raw is not None:
        dump_raw.mkdir(parents=True, exist_ok=True)
        for L in layers:
            spec, w = head(L)
            dump_layer(dump_raw, L, spec, w)
            facts[L] = layer_facts(spec, w, info.layers[L].output_gate if info.layers else "")
            del spec, w
    ctx_records, per_layer = [], {L: [] for L in layers}
    real = {L: [] for L in layers}
    oracle_rows = exact_sample(len(blocks), info.n_heads, cfg.prefix_len, cfg.exact_rows, cfg.seed)
    rank, world = dist_info if dist_info is not None else (0, 1)
    mine = shard_contiguous(list(range(len(blocks))), rank, world)
    oracle_rows = {c: rows for c, rows in oracle_rows.items() if c in mine}
    t_cap = t_eval = t_fwd = t_real = t_exact = t_inline = 0.0
    state = None if run_dir is None else _open_run_dir(run_dir, resume, cfg, prov, len(blocks),
                                                       rank, world)
    kept = {}
    if state is not None:
        for c in mine:
            got = state.load_tree(f"context{c}", RUN_CLASSES)
            if got is not None:
                kept[c] = got
    oracle = _OraclePool(bool({c for c in oracle_rows if c not in kept}),
                         inline=os.environ.get("ROPESTEP_ORACLE_INLINE") == "1")
    # (layer, index in real[layer], job, future, context)
    pending: list[tuple[int, int, tuple, Any, int]] = []
    unsaved: dict[int, dict] = {}  # finished contexts whose oracle rows may still be running

    def settle(wait: bool) -> None:
        """Put the oracle rows that are done (all, with ``wait``) into their records, then keep
        every finished context none of whose rows is still running (``--run-dir``)."""
        for item in list(pending):
            L, k, job, fut, _c = item
            if not (wait or fut.done()):
                continue
            try:
                real[L][k]["exact_rows"] = fut.result()
            except concurrent.futures.process.BrokenProcessPool:
                # the side process could not run (a starved or restricted machine): the same
                # rows in this process, never a skipped check
                real[L][k]["exact_rows"] = oracle_job(*job)
            pending.remove(item)
        busy = {p[4] for p in pending}
        for c in [c for c in unsaved if c not in busy]:
            if state is not None:
                state.save_tree(f"context{c}", unsaved[c], RUN_CLASSES)
            del unsaved[c]

    bar = _progress(len(mine), progress and rank == 0,
                    f"{Path(prov['source']).name} L={cfg.prefix_len}")
    bar.skipped(len(kept))
    try:
        for c in mine:
            if c in kept:  # read back from the run directory: not recomputed
                for L in layers:
                    per_layer[L].append(kept[c]["per_layer"][L])
                    real[L].append(kept[c]["real"][L])
                ctx_records.append(kept[c]["record"])
                continue
            blk = blocks[c]
            t_fwd += time_forward(model, blk.ids)
            t = time.perf_counter()
            crun = candidates_run(lab, blk, layers, cfg.queries, excl)
            cap = crun.context
            t_cap += time.perf_counter() - t
            if dump_raw is not None:
                dump_context(dump_raw, c, cap)
                for L in layers:
                    dump_item(dump_raw, c, L, cap, DTYPES[cfg.dtype])
            for L in layers:
                spec, w = head(L)
                t = time.perf_counter()
                per_layer[L].append(crun.evaluate(L, model_dtype=cfg.dtype, device=dev,
                                                  head=(spec, w)))
                t_eval += time.perf_counter() - t
                if oracle_rows.get(c):
                    t = time.perf_counter()
                    job = (spec, w, cap.prefix[L].x.double().numpy(), oracle_rows[c])
                    pending.append((L, len(real[L]), job, oracle.submit(*job), c))
                    t_inline += time.perf_counter() - t
                t = time.perf_counter()
                raw = {} if dump_raw is not None and c == 0 else None
                real[L].append(real_checks(model, spec, w, cap, L, c, cfg.seed,
                                           claims=(c == 0), raw=raw))
                t_real += time.perf_counter() - t
                if raw:
                    dump_model_item(dump_raw, c, L, raw, DTYPES[cfg.dtype])
                del spec, w
            ctx_records.append(_context_record(c, blk, cap, tok))
            unsaved[c] = {"per_layer": {L: per_layer[L][-1] for L in layers},
                          "real": {L: real[L][-1] for L in layers}, "record": ctx_records[-1]}
            settle(wait=False)
            bar(context=c)
        # the oracle rows: what is still running once the torch work is done is waited for here,
        # job by job, with a progress line and an estimate of what is left
        t = time.perf_counter()
        _wait_for_oracle(pending, progress and rank == 0, t_eval)
        settle(wait=True)
        t_exact = t_inline + time.perf_counter() - t
    finally:
        oracle.close()
        bar.close()
    timings["capture_s"], timings["evaluate_s"] = t_cap, t_eval
    parts = gather_to_rank0({"rank": rank, "contexts": mine, "per_layer": per_layer,
                             "real": real, "records": ctx_records, "t_fwd": t_fwd,
                             "resumed": sorted(kept)}, rank, world)
    if rank != 0:
        return None
    if sorted(c for p in parts for c in p["contexts"]) != list(range(len(blocks))):
        raise RuntimeError("the gathered contexts do not cover the blocks exactly once")
    parts.sort(key=lambda p: p["contexts"][0] if p["contexts"] else len(blocks))
    per_layer = {L: [x for p in parts for x in p["per_layer"][L]] for L in layers}
    real = {L: [x for p in parts for x in p["real"][L]] for L in layers}
    ctx_records = [x for p in parts for x in p["records"]]
    t_fwd = sum(p["t_fwd"] for p in parts)
    # exact_oracle_s: wall time the run spent on the oracle rows (computed inline, or waited for
    # from the side process); exact_oracle_cpu_s: the oracle's own time wherever it ran
    timings["real_checks_s"], timings["exact_oracle_s"] = t_real, t_exact
    timings["exact_oracle_cpu_s"] = sum(float(r.get("exact_rows", {}).get("exact_seconds") or 0.0)
                                        for recs in real.values() for r in recs)
    # the model's own forwards over the same tokens (one plain forward per block, no hooks),
    # measured in this run: the yardstick of the run's cost
    timings["model_forward_s"] = t_fwd

    layer_out = {}
    for L in layers:
        layer_out[str(L)] = summarize_layer(
            per_layer[L], heads, info.n_heads,
            NOT_AFFINE_LATENT if info.layers[L].layout == "latent" else NOT_AFFINE)
        layer_out[str(L)]["real_heads"] = summarize_real_checks(real[L])
    timings["total_s"] = time.perf_counter() - t_start
    work = timings["total_s"] - timings["model_load_s"] - t_fwd
    timings["work_s"] = work  # everything but the model load and the yardstick forwards
    timings["work_over_model_forward"] = work / t_fwd if t_fwd > 0 else math.nan
    # the same without the 50-digit oracle rows (their cost is mpmath's, fixed per row)
    timings["work_over_model_forward_without_oracle"] = ((work - t_exact) / t_fwd if t_fwd > 0
                                                         else math.nan)
    env = environment(dev)
    paper = is_paper_setup(cfg, layers, heads)
    head_space = {str(L): info.layers[L].output_between for L in layers
                  if info.layers and not info.layers[L].output_direct}
    result = {
        "schema": "ropestep.validate/1",
        "command": portable_command(list(command) if command is not None else None),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": portable_config(asdict(cfg)),
        **env,
        "model": {**prov, "model_type": info.model_type, "n_layers": info.n_layers,
                  "hidden": info.hidden, "n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads,
                  "head_dim": info.head_dim, "rope_theta": info.rope_theta,
                  "rms_eps": info.rms_eps, "qkv_bias": info.qkv_bias, "o_bias": info.o_bias,
                  "max_positions": info.max_positions, "vocab": vocab, "dtype": cfg.dtype,
                  # a hybrid's layers that are not softmax attention, with the reason
                  **({"not_softmax_attention": {str(L): why for L, why in info.others}}
                     if info.others else {}),
                  # layers whose heads pass a norm or gate before o_proj: their write (and
                  # W_o's statements) are taken in head space (models.layer_head)
                  **({"write_in_head_space": head_space} if head_space else {})},
        "corpus": {"name": corpus.name, **corpus.source, "n_articles": len(corpus)},
        "protocol": {"contexts": cfg.contexts, "queries": cfg.queries,
                     "prefix_len": cfg.prefix_len, "bank": f"positions 0..{cfg.prefix_len - 2}",
                     "query_position": cfg.prefix_len - 1, "layers": layers, "heads": heads,
                     "seed": cfg.seed, "anchor": 0, "special_tokens_excluded": excl,
                     "paper_setup": paper},
        "seeds": {"block_selection": cfg.seed,
                  "note": "block selection is the only random choice; the candidates are the "
                          "model's top logits and every computation is deterministic"},
        "timings": timings,
        "run": {"world_size": world,
                "rank_contexts": {str(p["rank"]): p["contexts"] for p in parts},
                "resumed_contexts": sorted(c for p in parts for c in p["resumed"]),
                "placement": models.placement_record(model, placement)},
        "contexts": ctx_records,
        "layers": layer_out,
        "paper": PAPER if paper else None,
    }
    result["verdict"] = verdict_block(result)
    if dump_raw is not None:
        write_raw_manifest(dump_raw, result, facts, len(blocks))
    return result


RUN_SCHEMA = "ropestep.validate-run/1"
RUN_CLASSES = {"LayerContext": LayerContext}


def _open_run_dir(path: Path, resume: bool, cfg: Config, prov: dict, n_blocks: int,
                  rank: int, world: int):
    """The run directory, opened by rank 0 first (a fresh start or a checked resume), then
    joined by the other ranks.  Fingerprint: the configuration, the model's provenance (its
    files' sha256), the number of contexts and ropestep's version."""
    from .dist import broadcast_from_rank0
    from .runstate import RunStateError, open_run_on_ranks

    fp = json.loads(json.dumps({"schema": RUN_SCHEMA, "config": asdict(cfg),
                                "model": {k: v for k, v in prov.items()
                                          if k not in ("argument", "source")},
                                "contexts": n_blocks, "ropestep": __version__}, default=str))
    try:
        return open_run_on_ranks(path, fp, resume=resume, rank=rank, world=world,
                                 broadcast=broadcast_from_rank0)
    except RunStateError as err:
        raise ProtocolError(str(err)) from None


def _context_record(c: int, blk: Block, cap: ContextCapture, tok: Any) -> dict:
    lg = torch.as_tensor(cap.logits, dtype=torch.float64)
    p = torch.softmax(lg, -1)
    cand = cap.candidates

    def dec(t: int) -> str | None:
        try:
            return tok.decode([t])
        except Exception:
            return None

    return {"context": c, "article": blk.article, "start": blk.start,
            "article_tokens": blk.n_tokens, "block_sha256": blk.sha256,
            "observed": cap.observed, "observed_text": dec(cap.observed),
            "observed_rank": int((lg > lg[cap.observed]).sum()),
            "candidates": cand, "candidates_text": [dec(t) for t in cand],
            "candidate_logits": [float(lg[t]) for t in cand],
            "candidate_probability_mass": float(p[cand].sum())}


# ---------------------------------------------------------------------------------------------
# --dump-raw: the tensors the report's statistics are computed from (docs/protocol.md section 12)
# ---------------------------------------------------------------------------------------------
RAW_SCHEMA = "ropestep.validate-raw/1"
RAW_MANIFEST = "validate_raw.json"
RAW_ECHOES = ("command", "config", "model", "corpus", "protocol", "seeds")


def save_tensors(path: Path, tensors: dict[str, Any]) -> None:
    """One safetensors file of the raw dumps (``validate`` and ``atlas --dump-raw``), written
    under a temporary name and renamed into place (under torchrun several ranks share the
    directory)."""
    from safetensors.torch import save

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(save({k: torch.as_tensor(v).detach().cpu().contiguous()
                          for k, v in tensors.items()}))
    os.replace(tmp, path)


def dump_layer(out: Path, layer: int, spec: Any, w: Any) -> None:
    """``layer{L}.safetensors``: the layer's q/k/v/o weights and biases in the suite's math
    layout (``w_q (m, H, d)``, ``w_k``/``w_v (m, H_kv, d)``, ``b_q (H, d)``, ``b_k``/``b_v
    (H_kv, d)``, ``w_o (H, r, D)``, ``b_o (D,)``; a bias the model lacks is absent) in float64
    (exactly the model's values), the model's own RoPE tables ``cos``/``sin`` ``(P, d/2)``
    (``P`` = the prefix length, positions ``0 .. P-1``) and the per-head score scales.  Written
    once: a layer already dumped is left as it is (``atlas --dump-raw`` calls it per context)."""
    if (out / f"layer{layer}.safetensors").exists():
        return
    scales = torch.tensor([spec.score_scale(h) for h in range(spec.n_heads)],
                          dtype=torch.float64)
    tensors = {"w_q": w.w_q, "w_k": w.w_k, "w_v": w.w_v, "w_o": w.w_o,
               "cos": spec.rope.cos, "sin": spec.rope.sin, "score_scale": scales}
    tensors.update({k: b for k, b in (("b_q", w.b_q), ("b_k", w.b_k), ("b_v", w.b_v),
                                      ("b_o", w.b_o)) if b is not None})
    save_tensors(out / f"layer{layer}.safetensors", tensors)


def dump_item(out: Path, context: int, layer: int, cap: ContextCapture,
              model_dtype: torch.dtype) -> None:
    """``context{c}_layer{L}.safetensors``: what :func:`evaluate_layer` reads of one context at
    one layer, as captured, in the model's dtype: the bank's and the queries' layer inputs
    ``x_bank (N, m)``, ``x_query (Q, m)`` with their positions (``0 .. N-1``; every query at
    ``N``), the candidates' token ids, the model's own per-head outputs ``native_heads
    (Q, H, r)`` and writes ``native_write (Q, D)`` of the single-token steps, its attention
    probability on each candidate's own key ``native_self_mass (Q, H)`` (where captured), and
    the full forward's head outputs ``observed_heads (H, r)`` and write ``observed_write (D,)``
    for the observed token."""
    pre, qry = cap.prefix[layer], cap.queries[layer]
    N, Q = pre.x.shape[0], qry.x.shape[0]
    obs_h, obs_o = cap.observed_full[layer]
    tensors = {"x_bank": pre.x, "x_query": qry.x, "native_heads": qry.heads,
               "native_write": qry.o, "observed_heads": obs_h, "observed_write": obs_o}
    if qry.self_mass is not None:
        tensors["native_self_mass"] = qry.self_mass
    tensors = {k: v.to(model_dtype) for k, v in tensors.items()}
    tensors.update(positions_bank=torch.arange(N), positions_query=torch.full((Q,), N),
                   candidates=torch.as_tensor(cap.candidates, dtype=torch.long))
    save_tensors(out / f"context{context}_layer{layer}.safetensors", tensors)


def dump_context(out: Path, context: int, cap: ContextCapture) -> None:
    """``context{c}.safetensors``: what the report's ``contexts[c]`` is computed from besides
    the corpus and the tokenizer: the block's token ids ``ids (P,)`` (int64) and the model's
    next-token logits at the last prefix position ``logits (vocab,)``, float32 as
    :func:`_context_record` and the candidates' choice read them."""
    save_tensors(out / f"context{context}.safetensors",
                 {"ids": torch.as_tensor(cap.block.ids, dtype=torch.long),
                  "logits": torch.as_tensor(cap.logits, dtype=torch.float32)})


def dump_model_item(out: Path, context: int, layer: int, raw: dict,
                    model_dtype: torch.dtype) -> None:
    """``context{c}_layer{L}_model.safetensors`` (the context of the ``real_heads`` claims):
    what :func:`real_checks` read of the model itself -- its attention module's rotated
    ``query (H, N, d)``, ``key (H_kv, N, d)`` and ``value (H_kv, N, r)`` on the bank and the
    tables ``rotary_cos``/``rotary_sin`` it was handed, in the model's dtype and head-dim order;
    as float64 the ``scaling`` it passed, the tables' ``amplitude``, the rotary module's
    ``inv_freq`` (``d/2``, ropestep's pair order), ``softcap`` (0: none); as int64
    ``head_order`` (``d``: ropestep's dim ``c`` is the model's ``head_order[c]``) and
    ``window`` and ``chunk`` (0: none)."""
    floats = ("query", "key", "value", "rotary_cos", "rotary_sin")
    tensors = {k: (v.to(model_dtype) if k in floats else v) for k, v in raw.items()}
    save_tensors(out / f"context{context}_layer{layer}_model.safetensors", tensors)


def layer_facts(sp: Any, w: Any, output_gate: str = "") -> dict:
    """One layer's sizes and layout, as the dump's manifest records them, and what else shapes
    its score or write (a reference that models none of it must refuse the dump)."""
    qt = sp.query_temperature
    return {"n_heads": sp.n_heads, "n_kv_heads": sp.n_kv_heads, "head_dim": sp.head_dim,
            "r": sp.r, "hidden": int(w.w_q.shape[0]), "out": int(w.w_o.shape[-1]),
            "layout": sp.rope.layout, "family": sp.family,
            "window": sp.window, "chunk": sp.chunk, "softcap": sp.softcap,
            "sinks": sp.sinks is not None, "clip": sp.clip,
            "alibi": sp.alibi_slopes is not None,
            "query_temperature": None if qt is None else list(qt),
            "output_gate": output_gate or None}


def write_raw_manifest(out: Path, result: dict, facts: dict[int, dict],
                       n_contexts: int) -> None:
    """``validate_raw.json``: the report's ``command``, ``config``, ``model``, ``corpus``,
    ``protocol`` and ``seeds`` exactly as it records them, the ``(context, layer)`` items
    dumped, and each layer's head layout (:func:`layer_facts`)."""
    layers = {str(L): f for L, f in sorted(facts.items())}
    manifest = {"schema": RAW_SCHEMA, **{k: result[k] for k in RAW_ECHOES},
                "items": [[c, L] for c in range(n_contexts) for L in sorted(facts)],
                "layers": layers}
    (out / RAW_MANIFEST).write_text(json.dumps(encode(manifest), indent=1, allow_nan=False)
                                    + "\n", encoding="utf-8")


def _progress(n: int, enabled: bool, desc: str) -> Progress:
    """A bar on a terminal; off one, a line per finished context (:class:`ropestep.runstate.Progress`)."""
    return Progress(n, enabled, desc, unit="context")
