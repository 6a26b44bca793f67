"""Identity sweep over (context, layer) work items, sharded across processes with torch.distributed.

Each work item is one (context, layer) pair; its result is the per-head identity error
``|y_i - (mu_i + q_i T_i + b_i)|`` over every query of the causal context, computed by the
batched all-query path (:func:`ropestep.scale.identity_check`).  Items come from

* ``--synthetic`` (default): seeded random layers of a given shape (layer ``l``'s weights from
  seed ``(seed, l)``) read by seeded random contexts (context ``c``'s inputs from
  ``(seed, c)``), so any process can rebuild any item; or
* ``--model SOURCE``: a Hugging Face model (loaded through :func:`load_sharded`, which passes
  ``device_map`` through to ``from_pretrained``, so accelerate can spread a large model); the
  contexts are seeded random token sequences, the layer inputs are captured with forward hooks
  (:func:`ropestep.models.capture`) and the head description is the model's own
  (:func:`ropestep.models.layer_head`, model RoPE tables).  Each item also records
  ``y_vs_model_rel``: the recomputed softmax output against the model's own per-head output
  (float32 forward), proving the layer that was checked is the model's.

Launch::

    torchrun --standalone --nproc_per_node 2 -m ropestep.sweep --out sweep.json   # 2 ranks
    python -m ropestep.sweep --out sweep.json                                      # 1 process
    ropestep sweep --out sweep.json                                                # the same

Verdict and exit status: an item fails when its identity error (``max_rel``, the worst head's
``max|y - readout| / max|y|``) is non-finite or above :func:`ropestep.tolerances.agreement_rel_tol`
for the item's dtype and sizes, or -- model items -- when ``y_vs_model_rel`` is non-finite or
above :func:`ropestep.tolerances.native_rel_tol`.  Non-finite values are caught per chunk
(:func:`nonfinite_witness`), independently of the batched path's own reductions, and kept as
NaN/inf (written as the strings ``"nan"``/``"inf"`` in JSON).  Exit 0 when every item passes;
1 when an item fails (one ``FAIL`` line per failed check on stderr, the report still written);
2 on bad input (bad option, nonexistent model path, layer out of range, ...: one line on stderr,
no traceback, no report).  Under torchrun every rank reports to rank 0 (its items, or its
error), rank 0 decides and broadcasts the exit status, so every rank exits with the same one.

Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment) every rank joins a
process group (``gloo`` on CPU, ``nccl`` on CUDA; ``--backend`` overrides), takes items
``rank, rank + W, ...`` of the sorted item list, and rank 0 gathers the results with
``gather_object`` and writes ONE report.  Everything in the report except its ``run`` block
(world size, timing, which rank did what) is identical to the single-process run's: items are
sorted, each item is computed from its own seeds with the same thread count (``--threads``,
default 1, fixed in every process because the CPU GEMM's summation order depends on it), and
floats are written with ``repr`` precision.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .verdict import (EXIT_FAIL, EXIT_PASS, Failure, device_problem, input_error, num,
                      print_failures, worst)

SCHEMA = "ropestep.sweep/1"
PROG = "python -m ropestep.sweep"


class SweepInputError(ValueError):
    """Bad input to the sweep (options, model path, layer or context out of range): one line."""


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
# the process helpers live in ropestep.dist (shared with ropestep.atlas)
from .dist import (broadcast_from_rank0, exit_worker, finish, gather_to_rank0,  # noqa: E402,F401
                   init_distributed, shard, under_launcher)


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
def load_sharded(source: str, *, device_map: Any = "auto", dtype: Any = None,
                 revision: str | None = None) -> Any:
    """Load a (possibly large) model with accelerate's ``device_map`` passed to ``from_pretrained``.

    ``device_map="auto"`` lets accelerate place layers across the visible GPUs and the CPU;
    ``None`` loads onto the CPU.  The model is checked and put in eval mode by
    :func:`ropestep.models.load_model` (eager attention, TF32 off).
    """
    import torch

    from . import models

    if device_map is not None:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ImportError("device_map needs accelerate: pip install 'ropestep[model]'")
    model, _ = models.load_model(source, revision=revision, device_map=device_map,
                                 dtype=dtype or torch.float32, tokenizer=False)
    return model


# ---------------------------------------------------------------------------------------------
# work items
# ---------------------------------------------------------------------------------------------
def work_items(args: argparse.Namespace) -> list[dict]:
    """All (context, layer) items, sorted; a context is (index, length)."""
    return [{"context": c, "length": int(n), "layer": int(layer)}
            for c, n in enumerate(args.contexts) for layer in sorted(set(args.layers))]


def _item_key(it: dict) -> tuple:
    return (it["context"], it["layer"])


def synthetic_layer(args: argparse.Namespace, layer: int) -> tuple[Any, Any]:
    """Seeded random head description of layer ``layer`` (float64, q/k/v biases)."""
    import torch

    from .spec import HeadSpec, HeadWeights, RoPESpec

    H, Hk, d, m = args.heads, args.kv_heads, args.head_dim, args.hidden
    g = torch.Generator().manual_seed(hash_seed(args.seed, "layer", layer))

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    qk = 1.5 / (m ** 0.5)  # scores of order a few units
    spec = HeadSpec(n_heads=H, n_kv_heads=Hk, head_dim=d, rope=RoPESpec(base=args.rope_base))
    w = HeadWeights(w_q=rnd(m, H, d, std=qk), w_k=rnd(m, Hk, d, std=qk),
                    w_v=rnd(m, Hk, d, std=1.0 / m ** 0.5), b_q=rnd(H, d, std=0.3),
                    b_k=rnd(Hk, d, std=0.3), b_v=rnd(Hk, d, std=0.1))
    return spec, w


def synthetic_context(args: argparse.Namespace, context: int, length: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(hash_seed(args.seed, "context", context))
    return torch.randn(length, args.hidden, generator=g, dtype=torch.float64)


def hash_seed(seed: int, kind: str, index: int) -> int:
    """A deterministic 63-bit seed for (seed, kind, index) (no Python ``hash``: it is salted)."""
    import hashlib

    h = hashlib.sha256(f"{seed}:{kind}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class NonfiniteWitness:
    """Per head, the worst ``|y_i - readout_i|`` of every chunk, NaN and inf kept.

    The batched path reduces its errors with its own running maxima; this ``on_chunk`` hook
    reduces the same differences with :func:`ropestep.verdict.worst`, so a NaN or inf anywhere in
    ``y`` or the readout reaches the item's record whatever that reduction does with it.
    """

    def __init__(self) -> None:
        self.worst: dict[int, float] = {}

    def __call__(self, ch: Any) -> None:
        import torch

        d = (ch.y_c - ch.readout_c).detach()
        bad = ~torch.isfinite(d).flatten(1).all(1)  # (G,) heads with a non-finite entry
        if bool(bad.any()):
            for a in bad.nonzero().flatten().tolist():
                h = ch.heads[a]
                self.worst[h] = worst([self.worst.get(h, 0.0), d[a].abs().to(torch.float64)])

    def nonfinite(self) -> dict[int, float]:
        return {h: v for h, v in self.worst.items() if not math.isfinite(v)}


def nonfinite_witness() -> NonfiniteWitness:
    """A fresh :class:`NonfiniteWitness` (an ``on_chunk`` hook of ``identity_check``)."""
    return NonfiniteWitness()


def _errors(res: Any, nonfinite: dict[int, float] | None = None) -> dict:
    out = {"max_abs": [float(v) for v in res.max_abs],
           "mean_abs": [float(v) for v in res.mean_abs],
           "max_rel": [float(v) for v in res.max_rel],
           "max_rel_dev": [float(v) for v in res.max_rel_dev],
           "n_queries": int(res.n_queries)}
    for h, v in (nonfinite or {}).items():  # NaN stays NaN, an infinite error stays inf
        for k in ("max_abs", "mean_abs", "max_rel", "max_rel_dev"):
            out[k][h] = v
    return out


def _both(*hooks: Any) -> Any:
    def call(ch: Any) -> None:
        for f in hooks:
            f(ch)
    return call


def _nan_errors(n_heads: int, n_queries: int) -> dict:
    nan = [math.nan] * n_heads
    return {"max_abs": nan, "mean_abs": list(nan), "max_rel": list(nan), "max_rel_dev": list(nan),
            "n_queries": n_queries}


def _checked(check: Any, on_chunk: Any, n_heads: int, n_queries: int) -> tuple[dict, str | None]:
    """``(heads errors, error message)``: the check's per-head errors with the witness's
    non-finite values, or all NaN and the message when the fast path raised on a non-finite
    value (``FloatingPointError``: an overflowing gauge, a NaN input)."""
    wit = nonfinite_witness()
    try:
        res = check(on_chunk=_both(wit, on_chunk) if on_chunk is not None else wit)
    except FloatingPointError as err:
        return _nan_errors(n_heads, n_queries), " ".join(str(err).split())
    return _errors(res, wit.nonfinite()), None


def item_failures(rec: dict) -> list[Failure]:
    """Failed checks of one item record: identity (and, model items, the model's own output)."""
    where = f"context {rec['context']} (length {rec['length']}) layer {rec['layer']}"
    out = []
    if rec.get("error"):
        out.append(Failure(where, "identity", math.nan, rec["tol_identity"],
                           detail=rec["error"]))
    elif not (rec["max_rel"] <= rec["tol_identity"]):  # NaN fails
        heads = [h for h, v in enumerate(rec["heads"]["max_rel"])
                 if not (v <= rec["tol_identity"])]
        out.append(Failure(where, "identity max_rel", rec["max_rel"], rec["tol_identity"],
                           detail=f"heads {heads}"))
    if "y_vs_model_rel" in rec and not (rec["y_vs_model_rel"] <= rec["tol_native"]):
        out.append(Failure(where, "y_vs_model_rel", rec["y_vs_model_rel"], rec["tol_native"]))
    return out


def _check_layers(layers: Sequence[int], n_layers: int | None = None) -> None:
    bad = [x for x in layers if x < 0 or (n_layers is not None and x >= n_layers)]
    if bad:
        rng = ("" if n_layers is None
               else f": the model has {n_layers} layers (valid: 0..{n_layers - 1})")
        raise SweepInputError(f"layer {bad[0]} out of range{rng}")


def run_items(args: argparse.Namespace, items: list[dict], device: Any) -> list[dict]:
    """Compute this process's items (synthetic or model) and return their records.

    Each record carries its tolerances (``tol_identity``, and ``tol_native`` for model items)
    and ``pass``; non-finite errors are kept (:class:`NonfiniteWitness`)."""
    import torch

    from . import scale, tolerances

    dt = getattr(torch, args.dtype)
    out = []
    if args.model is None:
        for it in items:
            spec, w = synthetic_layer(args, it["layer"])
            x = synthetic_context(args, it["context"], it["length"])
            heads, error = _checked(
                lambda on_chunk: scale.identity_check(
                    spec, w, x, dtype=dt, device=device, gauge=args.gauge,
                    max_bytes=args.max_bytes, on_chunk=on_chunk),
                None, spec.n_heads, it["length"])
            rec = dict(it, heads=heads, max_rel=worst(heads["max_rel"]),
                       tol_identity=tolerances.agreement_rel_tol(dt, it["length"], spec.head_dim))
            if error:
                rec["error"] = error
            rec["pass"] = not item_failures(rec)
            out.append(rec)
        return out
    from . import models

    model = load_sharded(args.model, device_map=args.device_map, revision=args.revision)
    info = models.describe_model(model)
    _check_layers(args.layers, info.n_layers)  # all of them: every rank reaches the same verdict
    too_long = [n for n in args.contexts if info.max_positions and n > info.max_positions]
    if too_long:
        raise SweepInputError(f"context length {too_long[0]} exceeds the model's context "
                              f"(max_position_embeddings={info.max_positions})")
    by_ctx: dict[int, list[dict]] = {}
    for it in items:
        by_ctx.setdefault(it["context"], []).append(it)
    for c, its in sorted(by_ctx.items()):
        n = its[0]["length"]
        g = torch.Generator().manual_seed(hash_seed(args.seed, "tokens", c))
        ids = torch.randint(0, int(model.config.vocab_size), (n,), generator=g)
        caps = models.capture(model, ids, [it["layer"] for it in its])
        for it in its:
            cap = caps[it["layer"]]
            spec, w = models.layer_head(model, it["layer"], n, dtype=torch.float64, device=device)
            own = cap.heads.to(torch.float64)  # (n, H, r): the model's own head outputs
            vs_model = [0.0]

            def versus_model(ch: Any, own: Any = own, acc: list = vs_model) -> None:
                ref = own[ch.queries.cpu()][:, ch.heads].transpose(0, 1)  # (G, Qc, r)
                acc[0] = worst([acc[0], (ch.y.cpu().double() - ref).abs()])

            heads, error = _checked(
                lambda on_chunk, cap=cap, spec=spec, w=w: scale.identity_check(
                    spec, w, cap.x, cap.positions, dtype=dt, device=device, gauge=args.gauge,
                    max_bytes=args.max_bytes, on_chunk=on_chunk),
                versus_model, spec.n_heads, it["length"])
            if error:
                vs_model[0] = math.nan  # the chunks it saw are not the whole layer
            n, d, m = it["length"], spec.head_dim, int(cap.x.shape[-1])
            scale_own = float(own.abs().max())  # relative to the model's output (absolute if 0)
            rec = dict(it, heads=heads, max_rel=worst(heads["max_rel"]),
                       y_vs_model_rel=vs_model[0] / scale_own if scale_own > 0 else vs_model[0],
                       model=info.name,
                       tol_identity=tolerances.agreement_rel_tol(dt, n, d),
                       tol_native=tolerances.native_rel_tol(n, d, m))
            if error:
                rec["error"] = error
            rec["pass"] = not item_failures(rec)
            out.append(rec)
    return out


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of the sweep (``ropestep sweep`` and ``python -m ropestep.sweep``)."""
    p.add_argument("--out", type=Path, required=True, help="report JSON (written by rank 0)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--synthetic", action="store_true", help="seeded random layers (default)")
    src.add_argument("--model", default=None, help="hub id or local directory of a model")
    p.add_argument("--revision", default=None)
    p.add_argument("--device-map", default=None,
                   help="accelerate device_map for --model (e.g. auto); default: CPU")
    p.add_argument("--contexts", type=int, nargs="+", default=[96, 160, 64],
                   help="context lengths; context c is the c-th length (default 96 160 64)")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=48)
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"])
    p.add_argument("--gauge", default="original", choices=["original", "maxkey", "pairwise"])
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default=None, choices=["gloo", "nccl", "mpi", "ucc"],
                   help="gloo or nccl (default by device)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (fixed so results do not depend on it)")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from .verdict import OneLineParser

    p = OneLineParser(prog=prog, description=(__doc__ or "").split("\n\n")[0])
    add_arguments(p)
    return p


def _config(args: argparse.Namespace) -> dict:
    keys = ("model", "revision", "contexts", "layers", "seed", "heads", "kv_heads", "head_dim",
            "hidden", "rope_base", "dtype", "gauge", "max_bytes", "threads")
    cfg = {k: getattr(args, k) for k in keys}
    if args.model is not None:
        for k in ("heads", "kv_heads", "head_dim", "hidden", "rope_base"):
            cfg.pop(k)
    return cfg


def check_args(args: argparse.Namespace) -> None:
    """Model-independent checks of the options; :class:`SweepInputError` on bad input."""
    if any(n < 1 for n in args.contexts):
        raise SweepInputError(f"--contexts lengths must be >= 1, got {args.contexts}")
    _check_layers(args.layers)
    if args.threads < 1:
        raise SweepInputError(f"--threads must be >= 1, got {args.threads}")
    if args.max_bytes < 1:
        raise SweepInputError(f"--max-bytes must be >= 1, got {args.max_bytes}")
    if args.model is None:
        if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
            raise SweepInputError(f"--heads {args.heads} must be a positive multiple of "
                                  f"--kv-heads {args.kv_heads}")
        if args.head_dim < 2 or args.head_dim % 2:
            raise SweepInputError(f"--head-dim must be even and >= 2 (RoPE pairs), got "
                                  f"{args.head_dim}")
        if args.hidden < 1:
            raise SweepInputError(f"--hidden must be >= 1, got {args.hidden}")
        if not (args.rope_base > 1 and math.isfinite(args.rope_base)):
            raise SweepInputError(f"--rope-base must be finite and > 1, got {args.rope_base}")
    else:
        p = Path(args.model).expanduser()
        # a hub id is "name" or "org/name"; anything else names a local path
        looks_local = args.model.startswith((".", "/", "~")) or args.model.count("/") > 1
        if looks_local and not p.exists():
            raise SweepInputError(f"--model {args.model!r} does not exist")
    dev = str(args.device)
    problem = device_problem(dev)
    if problem is not None:
        raise SweepInputError(problem)
    out = Path(args.out)
    if out.is_dir():
        raise SweepInputError(f"--out {str(out)!r} is a directory")


def _input_errors() -> tuple:
    errs: tuple = (SweepInputError,)
    try:
        from . import models

        errs += (models.ModelLoadError, models.UnsupportedModelError)
    except ImportError:  # pragma: no cover - transformers missing: only synthetic sweeps
        pass
    return errs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ropestep.sweep``: parse, then :func:`run`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a one-line usage error (2)
        return int(stop.code or 0)
    return run(args, argv)


def run(args: argparse.Namespace, argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the sweep; the exit status (0 pass, 1 an item failed, 2 bad input) on every rank."""
    import torch

    try:
        check_args(args)
    except SweepInputError as err:  # the same on every rank: all exit 2 before any group
        return input_error(prog, err)
    torch.set_num_threads(args.threads)
    if args.model is not None:
        from .protocol import quiet_libraries

        quiet_libraries()  # no loader progress bars: stderr carries errors and failures
    t0 = time.time()
    try:
        rank, world, dev = init_distributed(args.backend, args.device)
    except (RuntimeError, ValueError) as err:
        return input_error(prog, err)
    code: int | None = None
    synced = False  # every rank holds the verdict: all collectives are done
    try:
        items = work_items(args)
        mine = shard(items, rank, world)
        status: dict = {"rank": rank, "items": []}
        try:
            status["items"] = run_items(args, mine, dev)
        except _input_errors() as err:
            status["input_error"] = " ".join(str(err).split()) or type(err).__name__
        except Exception as err:  # noqa: BLE001 - reported to rank 0 so no rank hangs
            import traceback

            traceback.print_exc()
            status["crash"] = f"{type(err).__name__}: {' '.join(str(err).split())}"
        parts = gather_to_rank0(status, rank, world)
        if rank == 0:
            try:
                code = _decide(args, argv, parts, items, world, t0, prog)
            except Exception:  # noqa: BLE001 - the other ranks still wait for the verdict
                import traceback

                traceback.print_exc()
                code = EXIT_FAIL
        code = int(broadcast_from_rank0(code, rank, world))
        synced = True
    finally:
        finish(barrier=synced)
    return code




def _decide(args: argparse.Namespace, argv: Sequence[str] | None, parts: list[dict],
            items: list[dict], world: int, t0: float, prog: str) -> int:
    """Rank 0: the report and the exit status from every rank's share."""
    import torch
    import torch.distributed as dist

    bad = [p for p in parts if "input_error" in p]
    if bad:
        return input_error(prog, SweepInputError(bad[0]["input_error"]))
    crashed = [p for p in parts if "crash" in p]
    if crashed:
        for p in crashed:
            sys.stderr.write(f"{prog}: error: rank {p['rank']} crashed: {p['crash']}\n")
        return EXIT_FAIL
    recs = sorted((r for p in parts for r in p["items"]), key=_item_key)
    if [_item_key(r) for r in recs] != [_item_key(i) for i in items]:
        sys.stderr.write(f"{prog}: error: the gathered items do not cover the work list "
                         "exactly once\n")
        return EXIT_FAIL
    failures = [f for r in recs for f in item_failures(r)]
    report = {
        "schema": SCHEMA,
        "config": _config(args),
        "items": recs,
        "max_rel": worst((r["max_rel"] for r in recs), default=math.nan),
        "pass": not failures,
        "failures": [f.as_dict() for f in failures],
        "run": {"world_size": world,
                "backend": dist.get_backend() if dist.is_initialized() else None,
                "rank_items": {str(p["rank"]): [[r["context"], r["layer"]]
                                                for r in p["items"]] for p in parts},
                "seconds": time.time() - t0, "torch": torch.__version__,
                "python": platform.python_version(),
                "command": " ".join([os.path.basename(sys.argv[0])] + list(
                    sys.argv[1:] if argv is None else argv))},
    }
    from .verdict import dumps

    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dumps(report, indent=1) + "\n")
    except OSError as err:
        return input_error(prog, SweepInputError(f"cannot write --out {str(args.out)!r}: {err}"))
    print(f"{prog}: {len(recs)} items on {world} process(es), max identity error "
          f"{num(report['max_rel'], '.2e')} (relative), "
          f"{'PASS' if not failures else f'FAIL ({len(failures)} failed checks)'} -> {args.out}")
    if failures:
        print_failures(prog, failures)
        return EXIT_FAIL
    return EXIT_PASS


def same_report(a: dict, b: dict) -> bool:
    """True when two reports agree in everything but their ``run`` blocks."""
    strip = lambda r: {k: v for k, v in r.items() if k != "run"}  # noqa: E731
    return strip(a) == strip(b)


if __name__ == "__main__":
    _code = main()
    if under_launcher():
        exit_worker(_code)
    sys.exit(_code)
