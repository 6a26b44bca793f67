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
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

SCHEMA = "ropestep.sweep/1"


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def under_launcher() -> bool:
    """True when started by torchrun (or any launcher setting the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(backend: str | None = None, device: str = "cpu") -> tuple[int, int, Any]:
    """Join the process group from torchrun's environment; ``(rank, world, device)``.

    ``backend`` defaults to ``nccl`` for CUDA devices and ``gloo`` otherwise.  Without a
    launcher environment this is a single process: ``(0, 1, device)`` and no group.
    """
    import torch
    import torch.distributed as dist

    if not under_launcher():
        return 0, 1, torch.device(device)
    dev = torch.device(device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    be = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend=be, init_method="env://")
    return dist.get_rank(), dist.get_world_size(), dev


def gather_to_rank0(obj: Any, rank: int, world: int) -> list[Any] | None:
    """``gather_object`` of one picklable object per rank; the list on rank 0, None elsewhere."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def shard(items: Sequence[Any], rank: int, world: int) -> list[Any]:
    """Round-robin share of ``items`` for ``rank`` (``items[rank::world]``)."""
    if not (0 <= rank < world):
        raise ValueError(f"rank {rank} outside world of size {world}")
    return list(items[rank::world])


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


def _errors(res: Any) -> dict:
    return {"max_abs": [float(v) for v in res.max_abs],
            "mean_abs": [float(v) for v in res.mean_abs],
            "max_rel": [float(v) for v in res.max_rel],
            "max_rel_dev": [float(v) for v in res.max_rel_dev],
            "n_queries": int(res.n_queries)}


def run_items(args: argparse.Namespace, items: list[dict], device: Any) -> list[dict]:
    """Compute this process's items (synthetic or model) and return their records."""
    import torch

    from . import scale

    dt = getattr(torch, args.dtype)
    out = []
    if args.model is None:
        for it in items:
            spec, w = synthetic_layer(args, it["layer"])
            x = synthetic_context(args, it["context"], it["length"])
            res = scale.identity_check(spec, w, x, dtype=dt, device=device, gauge=args.gauge,
                                       max_bytes=args.max_bytes)
            out.append(dict(it, heads=_errors(res), max_rel=float(max(res.max_rel))))
        return out
    from . import models

    model = load_sharded(args.model, device_map=args.device_map, revision=args.revision)
    info = models.describe_model(model)
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
            worst = [0.0]

            def versus_model(ch: Any, own: Any = own, worst: list = worst) -> None:
                ref = own[ch.queries.cpu()][:, ch.heads].transpose(0, 1)  # (G, Qc, r)
                worst[0] = max(worst[0], float((ch.y.cpu().double() - ref).abs().max()))

            res = scale.identity_check(spec, w, cap.x, cap.positions, dtype=dt, device=device,
                                       gauge=args.gauge, max_bytes=args.max_bytes,
                                       on_chunk=versus_model)
            out.append(dict(it, heads=_errors(res), max_rel=float(max(res.max_rel)),
                            y_vs_model_rel=worst[0] / float(own.abs().max()), model=info.name))
    return out


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ropestep.sweep",
                                description=(__doc__ or "").split("\n\n")[0])
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
    p.add_argument("--backend", default=None, help="gloo or nccl (default by device)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (fixed so results do not depend on it)")
    return p


def _config(args: argparse.Namespace) -> dict:
    keys = ("model", "revision", "contexts", "layers", "seed", "heads", "kv_heads", "head_dim",
            "hidden", "rope_base", "dtype", "gauge", "max_bytes", "threads")
    cfg = {k: getattr(args, k) for k in keys}
    if args.model is not None:
        for k in ("heads", "kv_heads", "head_dim", "hidden", "rope_base"):
            cfg.pop(k)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    rank, world, dev = init_distributed(args.backend, args.device)
    try:
        items = work_items(args)
        mine = shard(items, rank, world)
        done = run_items(args, mine, dev)
        parts = gather_to_rank0({"rank": rank, "items": done}, rank, world)
        if rank == 0:
            recs = sorted((r for p in parts for r in p["items"]), key=_item_key)
            if [_item_key(r) for r in recs] != [_item_key(i) for i in items]:
                raise RuntimeError("the gathered items do not cover the work list exactly once")
            import torch.distributed as dist

            report = {
                "schema": SCHEMA,
                "config": _config(args),
                "items": recs,
                "max_rel": max(r["max_rel"] for r in recs),
                "run": {"world_size": world,
                        "backend": dist.get_backend() if dist.is_initialized() else None,
                        "rank_items": {str(p["rank"]): [[r["context"], r["layer"]]
                                                        for r in p["items"]] for p in parts},
                        "seconds": time.time() - t0, "torch": torch.__version__,
                        "python": platform.python_version(),
                        "command": " ".join([os.path.basename(sys.argv[0])] + list(
                            sys.argv[1:] if argv is None else argv))},
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            print(f"ropestep.sweep: {len(recs)} items on {world} process(es), max identity "
                  f"error {report['max_rel']:.2e} (relative) -> {args.out}")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def same_report(a: dict, b: dict) -> bool:
    """True when two reports agree in everything but their ``run`` blocks."""
    strip = lambda r: {k: v for k, v in r.items() if k != "run"}  # noqa: E731
    return strip(a) == strip(b)


if __name__ == "__main__":
    sys.exit(main())
