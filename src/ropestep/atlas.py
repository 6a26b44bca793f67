"""``ropestep atlas``: every layer, head and query of a real model against the model's own output.

One forward pass per context captures, for every requested layer, the attention input (after the
block's input norm) and each head's output (the ``o_proj`` input) in the model's dtype
(:func:`ropestep.models.capture`).  Then, per layer, on the causal bank exactly as the model
computes it, the streamed all-query path (:mod:`ropestep.scale`, one kernel) evaluates in
float64 and in the model's dtype:

* the identity ``y_i = mu_i + u_i^T Delta M_i`` (query-space readout ``mu_i + q_i T_i``) against
  the recomputed softmax output and against the model's own head output;
* the readout condition number ``kappa`` in the original gauge (float64) and in the max-key
  gauge (as the model-dtype readout evaluates it), the score spread, the attention-sink mass on
  the first key;
* the gradient-step diagnostics of docs/math.md section 3 in both parametrisations, each as a
  ``d x d`` problem: query space (features ``a_j = k~_j * scale``, the public replication's) with
  ``H^q = scale^2 G_i`` and input space (the paper's, features ``a_j = L_i k~_j^T``) with
  ``lambda_max(G^{1/2} L^T L G^{1/2})``, ``G_i = sum_j c_ij k~_j^T k~_j``; and whether the unit
  step increases ``E`` (``E(step) - E(0) = 1/2 tr(X^T G X) - tr(T^T X)`` with ``X = M T``,
  ``M = scale^2 I`` or ``L^T L``: no cancelling ``E(0)`` is formed);
* frozen reuse across queries of one context: the matrix ``Delta M_a`` of the anchor ``a`` (every
  ``k``-th position) applied to the later queries of its window, ``y_fr_i = mu_a + u_i^T Delta M_a``,
  against the constant anchor output ``y_a`` and the query's own cache mean ``mu_i`` (rRMSE,
  pooled squared errors), and its relative error against the total-variation distance of the
  two attention rows.

Nothing of size ``N x N x layers`` is held: chunks are reduced as they stream, per-query
statistics are ``(H, N)`` per layer.  Results: ``report.json`` first, then ``report.md`` and
figures.  The replication-style descent statistic (query space, final query, causal bank
including its own key) is reported apart and never set beside an input-space number.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import api, layercheck, scale
from .dist import (broadcast_from_rank0, exit_worker, finish, gather_to_rank0,
                   init_distributed, launcher_command, shard_contiguous,
                   under_launcher)
from .provenance import portable_command, portable_config, portable_name
from .runstate import Progress, peak_rss_mib
from .layercheck import PER_QUERY, AtlasError, LayerResult
from .spec import HeadSpec
from .verdict import device_problem, input_error, output_and_threads_problem

SCHEMA = "ropestep.atlas/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}



# ---------------------------------------------------------------------------------------------
# the run: model, contexts, capture, every layer
# ---------------------------------------------------------------------------------------------
@dataclass
class AtlasConfig:
    """Everything a run depends on (recorded verbatim in the report)."""

    model: str
    revision: str | None = None
    gguf: str | None = None
    corpus: str = "default"
    corpus_revision: str | None = None
    contexts: int = 4
    length: int = 512
    layers: str = "all"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 1
    anchor_every: int = 64
    max_bytes: int = scale.DEFAULT_MAX_BYTES
    replication_only: bool = False


def check_config(cfg: AtlasConfig) -> None:
    if cfg.dtype not in DTYPES:
        raise AtlasError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    for name in ("contexts", "length", "anchor_every"):
        if int(getattr(cfg, name)) < 1:
            raise AtlasError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.length < 2:
        raise AtlasError(f"--len must be >= 2, got {cfg.length}")
    dev = str(cfg.device)
    if dev.startswith("mps"):
        raise AtlasError("--device mps has no float64, and the atlas's reference passes are "
                         "float64: use cpu or cuda")
    problem = device_problem(dev)
    if problem is not None:
        raise AtlasError(problem)
    if cfg.max_bytes < 1 << 20:
        raise AtlasError(f"--max-bytes must be at least 1 MiB, got {cfg.max_bytes}")


def _progress(total: int, enabled: bool, desc: str) -> Progress:
    return Progress(total, enabled, desc)


# ---------------------------------------------------------------------------------------------
# the run directory: finished items kept as they complete (--run-dir, --resume)
# ---------------------------------------------------------------------------------------------
RUN_SCHEMA = "ropestep.atlas-run/1"
_SCALARS = ("value_scale", "native_scale", "qk_max")


def _item_key(context: int, layer: int) -> str:
    return f"context{context}_layer{layer}"


def _result_to_arrays(res: LayerResult, context: int, m: int) -> tuple[dict, dict]:
    arrays = {f"arrays.{k}": v for k, v in res.arrays.items()}
    arrays.update({k: getattr(res, k) for k in _SCALARS})
    return arrays, {"context": context, "layer": res.layer, "errors": list(res.errors), "m": m}


def _result_from_arrays(arrays: dict, meta: dict) -> tuple[LayerResult, int]:
    per_query = {k[len("arrays."):]: v for k, v in arrays.items() if k.startswith("arrays.")}
    if sorted(per_query) != sorted(PER_QUERY) or any(k not in arrays for k in _SCALARS):
        raise AtlasError(f"run directory item of context {meta.get('context')} layer "
                         f"{meta.get('layer')} holds other statistics than this version "
                         "computes: start without --resume")
    return LayerResult(int(meta["layer"]), per_query, *(arrays[k] for k in _SCALARS),
                       errors=list(meta["errors"])), int(meta["m"])


def _open_run_dir(path: Path, resume: bool, cfg: AtlasConfig, prov: dict, items: list,
                  rank: int, world: int):
    """Open the run directory on every rank: rank 0 first (it starts it afresh or checks the
    fingerprint), then the others join the run it opened.  The fingerprint: the configuration,
    the model's provenance (its files' sha256), the work list and ropestep's version."""
    from . import __version__
    from .runstate import RunStateError, open_run_on_ranks

    fp = {"schema": RUN_SCHEMA, "config": asdict(cfg), "model": _portable(prov),
          "items": [list(it) for it in items], "ropestep": __version__}
    fp = json.loads(json.dumps(fp, default=str))
    try:
        return open_run_on_ranks(path, fp, resume=resume, rank=rank, world=world,
                                 broadcast=broadcast_from_rank0)
    except RunStateError as err:
        raise AtlasError(str(err)) from None


def run(cfg: AtlasConfig, *, progress: bool = True, command: Sequence[str] | None = None,
        loaded: tuple | None = None, dist_info: tuple[int, int] | None = None,
        dump_raw: Path | None = None, run_dir: Path | None = None,
        resume: bool = False, placement: dict | None = None) -> dict | None:
    """Run the atlas and return the report (a JSON-ready dict; the report is not written here).

    ``loaded`` may pass an already loaded ``(model, tokenizer, provenance)`` (tests).
    ``dist_info = (rank, world)`` under torchrun (:func:`ropestep.dist.init_distributed`):
    every rank computes its share of the (context, layer) items, rank 0 gathers them and
    returns the report; the other ranks return None.  ``dump_raw``: a directory that receives
    the raw tensors every statistic is computed from (:func:`ropestep.protocol.dump_layer`,
    :func:`dump_item`, :func:`write_raw_manifest`; docs/protocol.md section 11).
    ``run_dir``: every finished (context, layer) item is kept there as it completes
    (:mod:`ropestep.runstate`); with ``resume`` the items already there (of a run with the same
    configuration and model files) are read back instead of recomputed, so a killed run continues
    where it stopped and gives the report an uninterrupted run gives (:func:`same_report`).
    ``placement``: accelerate's big-model placement of the model (:func:`ropestep.models.placement`),
    recorded in the report's ``run`` section with where each module went.
    """
    from . import models, protocol
    from .corpus import load_corpus, select_blocks, tokenizer_fn

    check_config(cfg)
    timers: dict[str, float] = {}
    t0 = time.perf_counter()
    if loaded is None:
        pc = protocol.Config(model=cfg.model, revision=cfg.revision, gguf=cfg.gguf,
                             dtype=cfg.dtype, device=cfg.device)
        loaded = protocol.load(pc, placement)
    model, tok, prov = loaded
    timers["load_model"] = time.perf_counter() - t0
    # the library's door (conventions read and proven on the model's tensors); every capture,
    # head description and layer evaluation below goes through it
    try:
        lab = api.attach(model, tok)
    except api.ApiError as err:
        raise AtlasError(str(err)) from None
    info = lab.info
    layers = protocol.parse_indices(cfg.layers, info.n_layers, "layer", info.softmax_layers,
                                    dict(info.others))
    ctx = lab._context()  # max_position_embeddings, or MPT's max_seq_len, ...
    if ctx is not None and cfg.length > ctx:
        raise AtlasError(f"--len {cfg.length} exceeds the model's context ({ctx} positions)")
    corpus = load_corpus(cfg.corpus, cfg.corpus_revision)
    blocks = select_blocks(corpus.articles, tokenizer_fn(tok), cfg.contexts, cfg.length,
                           cfg.seed, corpus_name=str(cfg.corpus))
    lp = DTYPES[cfg.dtype]
    # work items (context, layer), context-major, in contiguous blocks over torchrun's
    # processes (one process: all of them), so that a context's forward runs on as few ranks as
    # possible; every item is computed from its own inputs alone, so the report does not depend
    # on the number of processes
    rank, world = dist_info if dist_info is not None else (0, 1)
    items = [(c, L) for c in range(len(blocks)) for L in layers]
    mine = shard_contiguous(items, rank, world)
    done: list[tuple[int, int, LayerResult]] = []
    specs: dict[int, tuple[HeadSpec, int]] = {}
    state = None if run_dir is None else _open_run_dir(run_dir, resume, cfg, prov, items,
                                                       rank, world)
    kept: dict[tuple[int, int], LayerResult] = {}
    if state is not None:
        for c, L in mine:
            got = state.load(_item_key(c, L))
            if got is not None:
                kept[(c, L)], m = _result_from_arrays(*got)
                if L not in specs:  # the layer's description, from the model (no capture)
                    specs[L] = (lab.head_description(L, cfg.length)[0], m)
    report_item = _progress(len(mine), progress and rank == 0, "atlas")
    report_item.skipped(len(kept))
    if dump_raw is not None:
        dump_raw.mkdir(parents=True, exist_ok=True)
    for c in sorted({c for c, _ in mine}):
        done += [(c, L, kept[(c, L)]) for cc, L in mine if cc == c and (c, L) in kept]
        my_layers = [L for cc, L in mine if cc == c and (c, L) not in kept]
        if not my_layers:
            continue
        ids = torch.tensor(blocks[c].ids)
        ts = time.perf_counter()
        try:
            caps = lab.run(ids, layers=my_layers, stop_early=False)
        except api.ApiError as err:
            raise AtlasError(str(err)) from None
        timers["model_forward"] = timers.get("model_forward", 0.0) + time.perf_counter() - ts
        for L in my_layers:
            lr = caps[L]
            spec, w = lr.head_description
            specs[L] = (spec, int(lr.x.shape[1]))
            if dump_raw is not None:
                protocol.dump_layer(dump_raw, L, spec, w)  # once per layer
                dump_item(dump_raw, c, L, lr)
            try:
                res = lr.evaluate(dtype=lp, anchor_every=cfg.anchor_every,
                                  max_bytes=cfg.max_bytes, device=cfg.device, timers=timers,
                                  final_query_only=cfg.replication_only)
            except api.ApiError as err:
                raise AtlasError(str(err)) from None
            done.append((c, L, res))
            if state is not None:
                state.save(_item_key(c, L), *_result_to_arrays(res, c, specs[L][1]))
            report_item(context=c, layer=L)
        del caps
    report_item.close()
    done.sort(key=lambda t: (t[0], t[1]))
    parts = gather_to_rank0({"rank": rank, "done": done, "specs": specs, "timers": timers,
                             "resumed": len(kept)}, rank, world)
    if rank != 0:
        return None
    done = sorted((d for p in parts for d in p["done"]), key=lambda t: (t[0], t[1]))
    if [(c, L) for c, L, _ in done] != sorted(items):
        raise RuntimeError("the gathered atlas items do not cover the work list exactly once")
    for p in parts:
        specs.update(p["specs"])
    out_layers, replication, failed = layercheck.pool(done, specs, layers, cfg.length, lp,
                                                      cfg.replication_only)
    timers["total"] = time.perf_counter() - t0
    cost_section = None if cfg.replication_only else _cost(done, specs, parts, lp, cfg.device)
    src = getattr(corpus, "source", None) or {}
    corpus_prov = {"argument": portable_name(cfg.corpus), "sha256": src.get("sha256"),
                   "name": portable_name(getattr(corpus, "name", None))}
    env = protocol.environment(cfg.device)
    result = {
        "schema": SCHEMA,
        "command": portable_command(list(command) if command is not None else None),
        "config": portable_config(asdict(cfg)),
        "model": {"name": portable_name(info.name), "n_layers": info.n_layers, "n_heads": info.n_heads,
                  "n_kv_heads": info.n_kv_heads, "head_dim": info.head_dim,
                  "hidden": info.hidden, **_portable(prov),
                  # a hybrid's layers that are not softmax attention, with the reason
                  **({"not_softmax_attention": {str(L): why for L, why in info.others}}
                     if info.others else {})},
        "corpus": corpus_prov,
        "contexts": [{"article": b.article, "start": b.start, "n_tokens": b.n_tokens}
                     for b in blocks],
        "environment": env,
        "timing_seconds": timers,
        "cost": cost_section,
        "run": {"world_size": world,
                "resumed_items": sum(p.get("resumed", 0) for p in parts),
                "placement": models.placement_record(model, placement),
                "rank_items": {str(p["rank"]): [[c, L] for c, L, _ in p["done"]] for p in parts},
                "rank_timing_seconds": {str(p["rank"]): p["timers"] for p in parts}},
        "peak_rss_mib": peak_rss_mib(),
        "layers": out_layers,
        "replication_style_descent": replication,
        "verdict": {"passed": not failed, "failed": failed},
    }
    if dump_raw is not None:
        write_raw_manifest(dump_raw, result, specs, items)
    return result


def _cost(done: list, specs: dict, parts: list, lp: torch.dtype, device: Any) -> dict:
    """The counted work of every item (:func:`ropestep.cost.atlas_flops`), the phases' seconds
    summed over the processes, and this machine's GEMM rates measured now, in this process."""
    from . import cost

    flops: dict[str, float] = {}
    for _c, L, res in done:
        spec, m = specs[L]
        N = int(next(iter(res.arrays.values())).shape[1])
        for k, v in cost.atlas_flops(N=N, d=spec.head_dim, r=spec.r, m=m, H=spec.n_heads,
                                     H_kv=spec.n_kv_heads, affine=spec.affine,
                                     softcap=spec.softcap is not None,
                                     window=spec.window, chunk=spec.chunk).items():
            flops[k] = flops.get(k, 0.0) + v
    seconds: dict[str, float] = {}
    for p in parts:
        for k, v in p["timers"].items():
            seconds[k] = seconds.get(k, 0.0) + v
    low = str(lp).replace("torch.", "")
    rates = {"float64": cost.matmul_rate(torch.float64, device=device),
             low: cost.matmul_rate(lp, device=device)}
    return cost.phase_report(flops, seconds, rates, low, seconds.get("model_forward"))


def plan(cfg: AtlasConfig, budget: int | None = None) -> dict:
    """What a run of ``cfg`` will need, from the model's config alone (no weight is read): the
    weights' memory (all of them, and what stays resident under a ``--max-memory`` budget),
    the captured activations of one context, the streamed evaluation's budget, and per phase the
    counted work (:func:`ropestep.cost.atlas_flops`, plain causal heads: a window, soft-cap or
    QK-norm only lowers it) with its time at this machine's GEMM rates, measured now -- a floor:
    the committed runs reach a fraction of it (their ``cost.fraction_of_matmul``)."""
    from . import cost, models, protocol

    source = cfg.model
    if str(source).strip().lower() == protocol.SMOLLM2_ALIAS:
        source = str(models.locate_smollm2_gguf())
    config = models.read_config(source, revision=cfg.revision, gguf_file=cfg.gguf)
    info = models.describe_model(config)
    layers = protocol.parse_indices(cfg.layers, info.n_layers, "layer")
    lp = DTYPES[cfg.dtype]
    meta = models.meta_model(config, lp)
    nbytes = torch.tensor([], dtype=lp).element_size()
    params = sum(p.numel() for p in meta.parameters())  # shared (tied) weights once
    from .models.structure import attention_module, decoder, layer_list

    attn = [sum(p.numel() for p in attention_module(ly, info.name, i).parameters())
            for i, ly in enumerate(layer_list(decoder(meta)))]
    N, C, m = cfg.length, cfg.contexts, info.hidden
    d = info.head_dim
    H, Hk = info.n_heads, info.n_kv_heads
    flops = {k: 0.0 for k in cost.PHASES}
    one = cost.atlas_flops(N=N, d=d, r=d, m=m, H=H, H_kv=Hk)
    for k, v in one.items():
        flops[k] = v * C * len(layers)
    low = cfg.dtype
    rates = {"float64": cost.matmul_rate(torch.float64, device=cfg.device),
             low: cost.matmul_rate(lp, device=cfg.device)}
    dt = {"project": "float64", "float64_original": "float64", "lowp_maxkey": low,
          "float64_maxkey": "float64"}
    phases = {k.replace("lowp", low): {"flops": v, "seconds_at_matmul_rate": v / rates[dt[k]]}
              for k, v in flops.items()}
    weights = params * nbytes
    resident = weights if budget is None else min(weights, int(budget))
    # the forward's own work, for scale: 2 operations per parameter and token besides the
    # embedding lookup, and the attention scores and outputs
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    fwd = C * (2.0 * (params - vocab * m) * N
               + info.n_layers * H * 2 * N * (N + 1) * d)
    return {
        "model": {"name": portable_name(info.name), "n_layers": info.n_layers, "n_heads": H,
                  "n_kv_heads": Hk, "head_dim": d, "hidden": m, "parameters": params,
                  "largest_attention_parameters": max(attn)},
        "run": {"contexts": C, "length": N, "layers": len(layers), "dtype": cfg.dtype},
        "memory_bytes": {
            "weights": weights, "weights_resident": resident,
            "one_attention_float64": 8 * max(attn),
            "captured_activations_per_context": nbytes * len(layers) * N * (m + H * d),
            "streamed_budget": cfg.max_bytes,
            "estimated_peak": resident + 8 * max(attn) + cfg.max_bytes
            + nbytes * len(layers) * N * (m + H * d)},
        "matmul_flops_per_s": rates,
        "phases": phases,
        "floor_seconds": sum(p["seconds_at_matmul_rate"] for p in phases.values()),
        "model_forward_flops": fwd,
        "model_forward_seconds_at_matmul_rate": fwd / rates[low],
    }


def render_plan(p: dict) -> str:
    """``--plan``'s text: memory, then the work per phase and its floor time."""
    def gib(b: float) -> str:
        return f"{b / 2 ** 30:.2f} GiB"

    mem, mdl, run_ = p["memory_bytes"], p["model"], p["run"]
    lines = [f"{mdl['name']}: {mdl['parameters'] / 1e9:.2f} B parameters, {mdl['n_layers']} "
             f"layers, {mdl['n_heads']} heads on {mdl['n_kv_heads']} KV heads, head_dim "
             f"{mdl['head_dim']}, hidden {mdl['hidden']}",
             f"run: {run_['contexts']} contexts x {run_['length']} tokens, {run_['layers']} "
             f"layers, model in {run_['dtype']}",
             f"memory: weights {gib(mem['weights'])} ({gib(mem['weights_resident'])} resident), "
             f"one layer's attention in float64 {gib(mem['one_attention_float64'])}, captured "
             "activations "
             f"{gib(mem['captured_activations_per_context'])} per context, streamed budget "
             f"{gib(mem['streamed_budget'])}; estimated peak {gib(mem['estimated_peak'])}",
             "work (counted; docs/protocol.md section 11, cost) and its time at this machine's "
             "GEMM rate ("
             + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in
                         p["matmul_flops_per_s"].items()) + "):"]
    for k, v in p["phases"].items():
        lines.append(f"  {k:18s} {v['flops'] / 1e12:10.3f} TFLOP  "
                     f"{v['seconds_at_matmul_rate']:10.1f} s")
    lines.append(f"  {'floor':18s} {'':10s}        {p['floor_seconds']:10.1f} s  (the model's "
                 f"own forwards: {p['model_forward_flops'] / 1e12:.3f} TFLOP, "
                 f"{p['model_forward_seconds_at_matmul_rate']:.1f} s at the same rate)")
    return "\n".join(lines)


def _portable(prov: dict) -> dict:
    """Provenance without absolute machine paths: file names and sha256 only."""
    out = dict(prov)
    for key in ("source", "argument"):
        out[key] = portable_name(out.get(key))
    return out


# ---------------------------------------------------------------------------------------------
# --dump-raw: the tensors every statistic is computed from (docs/protocol.md section 11)
# ---------------------------------------------------------------------------------------------
RAW_SCHEMA = "ropestep.atlas-raw/1"
RAW_MANIFEST = "atlas_raw.json"



def dump_item(out: Path, context: int, layer: int, lr: api.LayerRun) -> None:
    """``context{c}_layer{L}.safetensors``: the layer's attention input ``x (N, m)`` (after the
    input norm), the positions ``(N,)`` and the model's own per-head attention outputs
    ``native (N, H, r)`` (the ``o_proj`` input, what the atlas compares with), as captured
    (:class:`ropestep.api.LayerRun`): in the model's dtype."""
    from .protocol import save_tensors

    save_tensors(out / f"context{context}_layer{layer}.safetensors",
                  {"x": lr.x, "positions": lr.positions, "native": lr.native})


def write_raw_manifest(out: Path, result: dict, specs: dict[int, tuple[HeadSpec, int]],
                       items: Sequence[tuple[int, int]]) -> None:
    """``atlas_raw.json``: the run's config, command, model, corpus and contexts exactly as the
    report records them, the (context, layer) items dumped, and each layer's head layout."""
    layers = {str(L): {"n_heads": sp.n_heads, "n_kv_heads": sp.n_kv_heads,
                       "head_dim": sp.head_dim, "r": sp.r, "hidden": m,
                       "layout": sp.rope.layout, "family": sp.family,
                       # what else shapes the score (a reference that models none must refuse)
                       "window": sp.window, "chunk": sp.chunk, "softcap": sp.softcap,
                       "sinks": sp.sinks is not None, "clip": sp.clip,
                       "alibi": sp.alibi_slopes is not None,
                       "query_temperature": (None if sp.query_temperature is None
                                             else list(sp.query_temperature))}
              for L, (sp, m) in sorted(specs.items())}
    manifest = {"schema": RAW_SCHEMA, **{k: result[k] for k in
                                         ("command", "config", "model", "corpus", "contexts")},
                "items": [list(it) for it in items], "layers": layers}
    (out / RAW_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")



# ---------------------------------------------------------------------------------------------
# report: JSON first, then Markdown and figures rendered from it
# ---------------------------------------------------------------------------------------------
HEATMAPS = (  # (key path, title, log10)
    (("float64_vs_native_rel",), "float64 readout vs the model's own output (rel.)", True),
    (("model_dtype_vs_native_rel",), "model-dtype readout vs the model's own output (rel.)", True),
    (("kappa_maxkey", "median"), "kappa, max-key gauge (median)", True),
    (("kappa_original", "median"), "kappa, original gauge (median)", True),
    (("sink_mass", "mean"), "attention mass on the first key (mean)", False),
    (("spread", "median"), "score spread (median)", False),
    (("lambda_max_query_space", "median"), "lambda_max, query space (median)", True),
    (("lambda_max_input_space", "median"), "lambda_max, input space (median)", True),
    (("step_increases_E_query_space",), "unit step increases E, query space (fraction)", False),
    (("step_increases_E_input_space",), "unit step increases E, input space (fraction)", False),
    (("reuse", "rrmse_vs_constant_anchor"), "frozen reuse rRMSE vs constant anchor", False),
    (("reuse", "rrmse_vs_cache_mean"), "frozen reuse rRMSE vs cache mean", False),
)


def _get(h: dict, path: tuple) -> float:
    """One statistic of a head; ``None`` (not defined for the head's score family) is NaN."""
    v: Any = h
    for p in path:
        v = v[p]
    return math.nan if v is None else float(v)


def grid(result: dict, path: tuple) -> tuple[list[int], np.ndarray]:
    """``(layers, values (n_layers, H))`` of one per-head statistic."""
    layers = sorted(int(k) for k in result["layers"])
    vals = np.array([[_get(h, path) for h in result["layers"][str(L)]["heads"]]
                     for L in layers], dtype=float)
    return layers, vals


def render_markdown(result: dict) -> str:
    from .verdict import num

    cfg, mod = result["config"], result["model"]
    lines = [f"# Atlas: {mod['name']}", "",
             f"Command: `{' '.join(result['command'] or [])}`", "",
             f"Model: {mod['name']} ({mod['n_layers']} layers, {mod['n_heads']} heads on "
             f"{mod['n_kv_heads']} KV heads, head dim {mod['head_dim']}); file "
             f"`{mod.get('gguf_file') or mod.get('source')}` sha256 `{mod.get('gguf_sha256')}`.",
             f"Corpus: {result['corpus']['argument']} (sha256 `{result['corpus']['sha256']}`), "
             f"{cfg['contexts']} contexts x {cfg['length']} tokens, seed {cfg['seed']}; model "
             f"dtype {cfg['dtype']}, device {cfg['device']}; frozen-reuse anchors every "
             f"{cfg['anchor_every']} positions.", ""]
    v = result["verdict"]
    lines += [f"**Verdict: {'PASS' if v['passed'] else 'FAIL'}**"
              + ("" if v["passed"] else f" ({len(v['failed'])} failed: "
                 + "; ".join(v["failed"][:10]) + ")"), ""]
    tm = result["timing_seconds"]
    lines += ["## Time", "", "| phase | seconds |", "|---|---:|"]
    lines += [f"| {k} | {num(t, '.1f')} |" for k, t in tm.items()]
    lines += ["", f"Peak resident memory: {num(result['peak_rss_mib'], '.0f')} MiB. "
              "`model_forward` is the model's own forward passes over the same tokens "
              "(capture hooks on).", ""]
    cost = result.get("cost")
    if cost:
        rates = cost["matmul_flops_per_s"]
        lines += ["## Cost", "", "Counted work per phase (docs/protocol.md section 11, `cost`) "
                  "against this machine's GEMM rate measured in the same run ("
                  + ", ".join(f"{k} {num(r / 1e9, '.1f')}" for k, r in rates.items())
                  + " GFLOP/s).", "", "| phase | GFLOP | seconds | GFLOP/s | fraction of GEMM rate |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {k} | {num(p['flops'] / 1e9, '.0f')} | {num(p['seconds'], '.1f')} | "
                  f"{num(p['achieved_flops_per_s'] / 1e9, '.1f')} | "
                  f"{num(p['fraction_of_matmul'], '.2f')} |" for k, p in cost["phases"].items()]
        lines += ["", f"Overall: {num(cost['work_seconds'], '.1f')} s of work against a floor of "
                  f"{num(cost['floor_seconds'], '.1f')} s at the GEMM rate (fraction "
                  f"{num(cost['fraction_of_matmul'], '.2f')})"
                  + (f"; {num(cost['work_over_model_forward'], '.1f')}x the model's own "
                     f"forwards ({num(cost['model_forward_seconds'], '.1f')} s; the floor "
                     f"{num(cost['floor_over_model_forward'], '.1f')}x)"
                     if "work_over_model_forward" in cost else "") + ".", ""]
    rep = result["replication_style_descent"]
    lines += ["## Descent as the public replication measured it", "",
              f"Space: {rep['space']}; {rep['query']}. Unit step increases E in "
              f"**{rep['pooled']['increase']} of {rep['pooled']['heads']}** (head, context) "
              f"pairs pooled over layers; lambda_max median "
              f"{num(rep['pooled']['lambda_max_median'])}, max "
              f"{num(rep['pooled']['lambda_max_max'])}.", "",
              "| layer | increases E | of | lambda_max median | max |", "|---:|---:|---:|---:|---:|"]
    for L, r in rep["per_layer"].items():
        lines.append(f"| {L} | {r['increase']} | {r['heads']} | {num(r['lambda_max_median'])} "
                     f"| {num(r['lambda_max_max'])} |")
    if result["layers"]:
        lines += ["", "## Per layer (worst head, or median over heads)", "",
                  "Input-space numbers (the paper's parametrisation) are never compared with "
                  "the replication's query-space statistic above.", "",
                  "| layer | pass | identity f64 (rel) | f64 vs native | orig. gauge unresolved "
                  "queries | dtype vs native | bound ratio | "
                  "kappa maxkey (med) | sink (mean) | lambda q (med) | lambda in (med) | "
                  "E up q | E up in | reuse rRMSE vs const | vs mean |",
                  "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for L, lr in result["layers"].items():
            hs = lr["heads"]

            def col(path: tuple, how: str) -> str:
                if ("input_space" in lr and path[0].endswith("_input_space")) or (
                        "descent" in lr and path[0].startswith(("lambda_max", "step_"))):
                    return "n/a"  # not defined for this layer's score (the layer says why)
                x = np.array([_get(h, path) for h in hs])
                return num(float(np.max(x) if how == "max" else np.median(x)))

            lines.append(
                f"| {L} | {'yes' if lr['passed'] else '**NO**'} | "
                f"{col(('identity_float64_rel_max',), 'max')} | "
                f"{col(('float64_vs_native_rel',), 'max')} | "
                f"{int(sum(h['original_gauge_unresolved_queries'] for h in hs))} | "
                f"{col(('model_dtype_vs_native_rel',), 'max')} | "
                f"{col(('model_dtype_vs_native_bound_ratio_max',), 'max')} | "
                f"{col(('kappa_maxkey', 'median'), 'med')} | {col(('sink_mass', 'mean'), 'med')} | "
                f"{col(('lambda_max_query_space', 'median'), 'med')} | "
                f"{col(('lambda_max_input_space', 'median'), 'med')} | "
                f"{col(('step_increases_E_query_space',), 'med')} | "
                f"{col(('step_increases_E_input_space',), 'med')} | "
                f"{col(('reuse', 'rrmse_vs_constant_anchor'), 'med')} | "
                f"{col(('reuse', 'rrmse_vs_cache_mean'), 'med')} |")
        lines += ["", "Tolerances: the float64 identity per query against the readout bound "
                  "`(N + d + 8 + max|s|) u kappa` (docs/math.md section 9); float64 vs the "
                  "model's own float32 output in the max-key gauge (and in the original gauge, whose "
                  "kappa can leave float64 no digits: such queries are counted as unresolved), "
                  "per query against `tolerances.model_dtype_native_bound`; the model-dtype "
                  "max-key readout, per query, against `tolerances.model_dtype_native_bound` (the "
                  "model's own rounding, `agreement_rel_tol` in float32 or `native_rel_tol_lowp` "
                  "in bf16, plus the readout's `identity_check_tol` with that query's max-key "
                  "kappa). The `dtype vs native` column is the worst error relative to the "
                  "head's output scale; `bound ratio` the worst error over its bound.",
                  "", "## Figures", ""]
        for i, (_, title, _) in enumerate(HEATMAPS):
            lines.append(f"![{title}](figures/heatmap_{i:02d}.png)")
        lines.append("![per-layer curves](figures/per_layer.png)")
    env = result["environment"]
    lines += ["", "## Environment", "", f"`{env}`", ""]
    return "\n".join(lines)


def render_figures(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for i, (path, title, log) in enumerate(HEATMAPS):
        layers, vals = grid(result, path)
        show = np.log10(np.maximum(vals, 1e-300)) if log else vals
        fig, ax = plt.subplots(figsize=(6, 0.25 * len(layers) + 1.5))
        im = ax.imshow(show, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(L) for L in layers], fontsize=6)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(("log10 " if log else "") + title, fontsize=8)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / f"heatmap_{i:02d}.png", dpi=110)
        plt.close(fig)
    fig, axs = plt.subplots(1, 3, figsize=(12, 3.2))
    for path, lab in ((("lambda_max_query_space", "median"), "lambda_max query"),
                      (("lambda_max_input_space", "median"), "lambda_max input")):
        layers, vals = grid(result, path)
        axs[0].semilogy(layers, np.median(vals, 1), marker="o", label=lab)
    axs[0].axhline(2.0, color="k", lw=0.8, ls="--")
    axs[0].set_title("median over heads (2: descent threshold)", fontsize=8)
    axs[0].legend(fontsize=7)
    for path, lab in ((("step_increases_E_query_space",), "query space"),
                      (("step_increases_E_input_space",), "input space")):
        layers, vals = grid(result, path)
        axs[1].plot(layers, np.mean(vals, 1), marker="o", label=lab)
    axs[1].set_title("fraction of queries whose unit step increases E", fontsize=8)
    axs[1].legend(fontsize=7)
    for path, lab in ((("reuse", "rrmse_vs_constant_anchor"), "vs constant anchor"),
                      (("reuse", "rrmse_vs_cache_mean"), "vs cache mean")):
        layers, vals = grid(result, path)
        axs[2].plot(layers, np.median(vals, 1), marker="o", label=lab)
    axs[2].set_title("frozen reuse rRMSE (median over heads)", fontsize=8)
    axs[2].legend(fontsize=7)
    for a in axs:
        a.set_xlabel("layer")
    fig.tight_layout()
    fig.savefig(out / "per_layer.png", dpi=110)
    plt.close(fig)


def write_report(result: dict, out: Path, *, figures: bool = True) -> None:
    """``report.json``, then ``report.md`` and ``figures/`` into ``out`` (replaced atomically:
    :func:`ropestep.report.write_rendered`)."""
    from .report import write_rendered

    write_rendered(out, result, render_markdown, render_figures, figures)


# ---------------------------------------------------------------------------------------------
# command line (registered as ``ropestep atlas`` in ropestep.cli)
# ---------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    from .models import add_model_arguments, add_placement_arguments

    add_model_arguments(p)
    add_placement_arguments(p)
    p.add_argument("--corpus", default="default", metavar="wikitext2|PATH|default",
                   help="text the contexts are drawn from [default: the bundled text]")
    p.add_argument("--contexts", type=int, default=4, metavar="C", help="contexts [4]")
    p.add_argument("--len", dest="length", type=int, default=512, metavar="N",
                   help="tokens per context [512]")
    p.add_argument("--layers", default="all", metavar="all|a,b|last", help="layers [all]")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="dtype the model runs in [float32]")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda", help="device [cpu]")
    p.add_argument("--max-bytes", type=int, default=scale.DEFAULT_MAX_BYTES, metavar="B",
                   help="memory budget of the streamed evaluation [1 GiB]")
    p.add_argument("--anchor-every", type=int, default=64, metavar="K",
                   help="frozen-reuse anchors every K positions [64]")
    p.add_argument("--seed", type=int, default=1, help="context-selection seed [1]")
    p.add_argument("--replication", action="store_true",
                   help="only the replication-style descent statistic (query space, final "
                        "query, bank including its own key)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    p.add_argument("--dump-raw", metavar="DIR", default=None,
                   help="also write the raw tensors every statistic is computed from "
                        "(inputs, weights, RoPE tables, the model's own head outputs) and the "
                        "run's config into DIR (docs/protocol.md section 11)")
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="where each finished (context, layer) item is kept as it completes, "
                        "removed once the report is written [OUT.run, beside --out]")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run from its run directory: items already there "
                        "are read back, not recomputed (same configuration and model files "
                        "only; another run's directory is refused)")
    p.add_argument("--plan", action="store_true",
                   help="print the memory and the counted work this run will need, and its "
                        "floor time at this machine's GEMM rate, from the model's config alone "
                        "(no weight is loaded); nothing is written")
    p.add_argument("--out", metavar="DIR", help="report directory (required unless --plan)")


def main_args(args, argv: Sequence[str]) -> int:
    """Handler of ``ropestep atlas``: 0 pass, 1 a check failed, 2 bad input."""
    from . import models, protocol
    from .corpus import CorpusError
    prog = "ropestep atlas"

    def bad(err: BaseException) -> int:
        return input_error(prog, err)

    if args.plan:
        return _plan_main(args, bad)
    if args.out is None:
        return bad(AtlasError("--out DIR is required (unless --plan)"))
    out = Path(args.out)
    problem = output_and_threads_problem(out, args.threads)
    if problem is not None:
        return bad(problem)
    dump_raw = None if args.dump_raw is None else Path(args.dump_raw)
    if dump_raw is not None and dump_raw.exists() and not dump_raw.is_dir():
        return bad(AtlasError(f"--dump-raw {args.dump_raw}: exists and is not a directory"))
    if dump_raw is not None and args.resume:
        return bad(AtlasError("--dump-raw writes the inputs of every item as it computes them: "
                              "not with --resume (run without it)"))
    run_dir = Path(args.run_dir) if args.run_dir is not None else \
        out.parent / (out.name + ".run")
    if run_dir.resolve() == out.resolve():
        return bad(AtlasError("--run-dir must not be the report directory (--out)"))
    try:
        place = models.placement(args.device_map, args.max_memory, args.offload_folder)
    except models.ModelLoadError as err:
        return bad(err)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = AtlasConfig(model=args.model, revision=args.revision, gguf=args.gguf,
                      corpus=args.corpus, contexts=args.contexts, length=args.length,
                      layers=args.layers, dtype=args.dtype, device=args.device, seed=args.seed,
                      anchor_every=args.anchor_every, max_bytes=args.max_bytes,
                      replication_only=args.replication)
    try:  # before the process group: a bad --device must not reach torch.device()
        check_config(cfg)
    except AtlasError as err:
        return bad(err)
    synced = False
    scratch = None
    if place is not None and place["device_map"] == "auto" and "offload_folder" not in place:
        scratch = tempfile.mkdtemp(prefix="ropestep-offload-")  # removed below, whatever happens
        place["offload_folder"] = scratch
    try:
        rank, world, _ = init_distributed(None, "cpu" if args.device == "cpu" else args.device)
        try:
            result = run(cfg, progress=not args.quiet,
                         command=launcher_command(["ropestep", *argv]),
                         dist_info=(rank, world), dump_raw=dump_raw, run_dir=run_dir,
                         resume=args.resume, placement=place)
        except (AtlasError, protocol.ProtocolError, CorpusError, models.ModelLoadError,
                models.UnsupportedModelError) as err:
            return bad(err)
        code = 0
        if rank == 0:
            write_report(result, out, figures=not args.no_figures)
            shutil.rmtree(run_dir, ignore_errors=True)  # the report holds it all now
            code = 0 if result["verdict"]["passed"] else 1
        code = broadcast_from_rank0(code, rank, world)
        synced = True
        if rank != 0:
            return code
    finally:
        finish(barrier=synced)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if not args.quiet:
        rep = result["replication_style_descent"]
        for L, r in rep["per_layer"].items():
            print(f"layer {L}: unit step increases E (query space, final query) in "
                  f"{r['increase']} of {r['heads']} heads")
        print(f"pooled: {rep['pooled']['increase']} of {rep['pooled']['heads']} heads; wrote "
              f"{out}/report.json and report.md")
    if not result["verdict"]["passed"]:
        for f in result["verdict"]["failed"]:
            sys.stderr.write(f"{prog}: FAIL {f}\n")
        return 1
    return 0


def _plan_main(args: Any, bad: Any) -> int:
    """``--plan``: the estimate, printed; 0, or 2 on bad input."""
    from . import models, protocol

    cfg = AtlasConfig(model=args.model, revision=args.revision, gguf=args.gguf,
                      contexts=args.contexts, length=args.length, layers=args.layers,
                      dtype=args.dtype, device=args.device, max_bytes=args.max_bytes)
    try:
        check_config(cfg)
        place = models.placement(args.device_map, args.max_memory, args.offload_folder)
        budget = None if place is None else (place.get("max_memory") or {}).get("cpu")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        print(render_plan(plan(cfg, budget)))
    except (AtlasError, protocol.ProtocolError, models.ModelLoadError,
            models.UnsupportedModelError) as err:
        return bad(err)
    return 0


def same_report(a: dict, b: dict) -> bool:
    """True when two atlas reports agree in every number (timing, run and environment aside;
    of ``cost``, the counted work only: its seconds and rates are the machine's)."""
    skip = {"run", "timing_seconds", "environment", "peak_rss_mib", "command", "cost"}

    def counted(r: dict) -> Any:
        c = r.get("cost")
        return None if c is None else {k: v["flops"] for k, v in c["phases"].items()}

    return {k: v for k, v in a.items() if k not in skip} == \
        {k: v for k, v in b.items() if k not in skip} and counted(a) == counted(b)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ropestep.atlas ...`` (what torchrun launches); same as ``ropestep atlas``."""
    from .verdict import module_main

    return module_main("atlas", __doc__, add_arguments, main_args, argv)


if __name__ == "__main__":
    _code = main()
    if under_launcher():
        exit_worker(_code)
    sys.exit(_code)
