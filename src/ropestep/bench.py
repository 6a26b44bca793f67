"""``ropestep bench``: time and size the all-query identity on a Qwen2.5-0.5B-shaped layer.

One configuration = one dtype and one context length N, measured in its own subprocess (so that
its peak memory is its own) on ONE set of inputs: a seeded random layer of Qwen2.5-0.5B's
attention shape (hidden 896, 14 query heads on 2 KV heads, head_dim 64, q/k/v biases, RoPE base
1e6, no o_proj needed) and seeded inputs ``x (N, 896)``.  Projection (``q, k, v``) is done once
and shared; then, in this order:

1. ``factored``: :func:`ropestep.scale.identity_check` over every query and head (causal), with
   ``Delta M_i = L_i T_i`` materialised per chunk and dropped (the sampled queries' matrices are
   copied out for the comparison in 3).  Peak memory is measured around projection + this run.
2. ``sdpa``: the model's own attention forward, ``torch.nn.functional.scaled_dot_product_attention``
   (causal) on the same rotated, scaled ``q`` and the GQA-expanded ``k, v``.
3. ``direct``: the paper's per-query evaluation (:func:`ropestep.scale.direct_query`: features
   ``a_ij`` formed explicitly in the 897-dimensional augmented input space), one query at a time,
   all heads, vectorised over keys, on ``S`` stratified queries ``i_k = floor((k + 1/2) N / S)``.
   Its cost is linear in ``N_i = i + 1``, and the strata have mean ``N_i`` equal to the all-query
   mean, so the all-query time is extrapolated as ``N x`` the mean sampled time.
4. ``matmul``: plain ``torch.matmul`` of the factored path's main GEMM shape
   ``(G*Qc, N) @ (N, d*r)`` in the same dtype -- the machine's attainable GEMM rate.
5. ``pairwise`` (heads ``--pairwise-heads``): the low-rank pairwise gauge for all queries (its
   time is fitted against N), and low-rank against exact (dense ``N x N`` kernel) on ``S2``
   stratified queries: time per query and the relative error of ``T^pair``.  The exact path's
   all-query time is extrapolated with its ``N_i^2`` cost.
6. ``spreads`` (once, ``--spread-n``): layers whose query weights are rescaled so head 0's
   largest score spread is 1 ... 80; low-rank against exact on sampled queries.

FLOP counts are analytic (:func:`ropestep.scale.flops_factored`, :func:`ropestep.scale.flops_direct`):
matrix products over the causal triangle only.  Memory: on CPU the process's resident-set high
water mark (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; where that is not
allowed, ``resource.getrusage().ru_maxrss``, valid because the factored run is the first work
after setup) minus the resident set before projection; on CUDA
``torch.cuda.max_memory_allocated`` minus the allocation before.  Only the factored run is
sized.  ``--budget-sizes`` adds configurations that run the factored path alone under
``--max-bytes`` and report whether the measured peak stayed under it.

The JSON records the command, versions, hardware, seeds, dtype, threads and load average.
``--render`` turns JSON files into the Markdown tables of ``benchmarks/README.md``.

Verdict (:func:`checks`, the JSON's ``verdict``): every agreement the benchmark measures -- the
factored identity ``y`` vs ``mu + q T + b``, ``Delta M`` factored vs direct, the direct path's
identity, SDPA vs the direct ``y``, low-rank vs exact pairwise (``T``, readout, both identities)
and every row of the spread sweep -- must be finite and within
:func:`ropestep.tolerances.agreement_rel_tol` for its dtype and sizes.  Exit status: 0 when all
hold; 1 when one does not (one ``FAIL`` line per failed check on stderr; the JSON is still
written) or a worker crashed; 2 on bad input (one line on stderr).  ``--render`` re-derives the
verdict from the JSON it renders and exits the same way.  The peak-memory figures are
measurements, not checks (``under_budget`` is reported, not judged).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .verdict import (EXIT_FAIL, EXIT_INPUT, EXIT_PASS, Failure, device_problem, least, loads, num,
                      print_failures, worst)

SCHEMA = "ropestep.bench/1"
PROG = "python -m ropestep.bench"


class BenchInputError(ValueError):
    """Bad input to the benchmark (sizes, budget, heads, files): one line, exit status 2."""
QWEN_SHAPE = dict(hidden=896, n_heads=14, n_kv_heads=2, head_dim=64, rope_theta=1e6)
# weight scales as the tiny-Qwen test fixture: scores of order 1-10, non-zero biases
QK_STD, V_STD, QK_BIAS_STD, V_BIAS_STD = 0.08, 0.05, 0.5, 0.1
GIB = 1 << 30


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def _bytes(text: str) -> int:
    t = text.strip().lower()
    for suf, mul in (("gib", GIB), ("mib", 1 << 20), ("kib", 1 << 10), ("gb", 10 ** 9),
                     ("mb", 10 ** 6), ("kb", 10 ** 3), ("b", 1)):
        if t.endswith(suf):
            return int(float(t[: -len(suf)]) * mul)
    return int(float(t))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``ropestep bench`` (shared by the CLI hook and ``python -m ropestep.bench``)."""
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096],
                   help="context lengths N (causal, all queries)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"],
                   help="storage dtype (bfloat16 computes with float32 accumulation)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:k]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads in every worker (default: torch's default)")
    p.add_argument("--max-bytes", type=_bytes, default=2 * GIB,
                   help="memory budget of the factored path, e.g. 1.5GiB (default 2GiB)")
    p.add_argument("--budget-sizes", type=int, nargs="*", default=[],
                   help="extra sizes that run only the factored path under --max-bytes")
    p.add_argument("--direct-queries", type=int, default=8, help="sampled queries, direct path")
    p.add_argument("--pairwise-heads", type=int, nargs="*", default=[0],
                   help="heads of the pairwise-gauge timing (none: skip)")
    p.add_argument("--pairwise-queries", type=int, default=4,
                   help="sampled queries of the exact pairwise comparison")
    p.add_argument("--spreads", type=float, nargs="*", default=[1, 5, 10, 20, 40, 80],
                   help="target score spreads of the low-rank accuracy sweep (none: skip)")
    p.add_argument("--spread-n", type=int, default=512, help="context length of the spread sweep")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default: stdout)")
    p.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON",
                   help="render these JSON results as Markdown (to --markdown or stdout) and exit")
    p.add_argument("--markdown", type=Path, default=None, help="Markdown output of --render")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``argparse`` subparsers object (the ``ropestep`` CLI hook)."""
    sp = subparsers.add_parser(
        "bench", help="benchmark the batched all-query identity (JSON + Markdown)",
        description=(__doc__ or "").split("\n\n")[0])
    add_arguments(sp)
    sp.set_defaults(func=run, _handler=lambda args, argv=None: run(args, prog="ropestep bench"))
    return sp


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    import numpy
    import torch

    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "numpy": numpy.__version__, "platform": platform.platform(),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "torch_threads_default": torch.get_num_threads(),
        "gpu": None, "cuda": torch.version.cuda,
    }
    try:
        from . import __version__
        env["ropestep"] = __version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        env["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak extra memory of a block: RSS high-water (CPU) or the CUDA allocator's peak."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.method = ""
        self.peak = None

    def __enter__(self) -> "PeakMemory":
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
            self.method = "torch.cuda.max_memory_allocated - memory_allocated before"
            return self
        self.before = (_status_kb("VmRSS") or 0) * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
            self.method = "VmHWM (reset via /proc/self/clear_refs) - VmRSS before"
            self.hwm = True
        except OSError:
            self.method = "getrusage ru_maxrss after - VmRSS before (first work in the process)"
            self.hwm = False
        if not self.before:
            self.before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = int(torch.cuda.max_memory_allocated() - self.before)
            return
        if self.hwm and _status_kb("VmHWM") is not None:
            after = _status_kb("VmHWM") * 1024
        else:
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = int(max(0, after - self.before))


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: Any, min_total: float = 1.0, max_reps: int = 5) -> tuple[float, Any]:
    """Best wall time of ``fn()``: repeated while the total stays under ``min_total`` seconds."""
    best, out, total, reps = math.inf, None, 0.0, 0
    while reps < max_reps and (reps == 0 or total < min_total):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        el = time.perf_counter() - t0
        best, total, reps = min(best, el), total + el, reps + 1
    return best, out


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------
def qwen_layer(N: int, seed: int, q_scale: float = 1.0) -> tuple[Any, Any, Any]:
    """Seeded Qwen2.5-0.5B-shaped layer and inputs: ``(spec, weights, x)`` in float64 (CPU)."""
    import torch

    from .spec import HeadSpec, HeadWeights, RoPESpec

    m, H, Hk, d = (QWEN_SHAPE[k] for k in ("hidden", "n_heads", "n_kv_heads", "head_dim"))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    spec = HeadSpec(n_heads=H, n_kv_heads=Hk, head_dim=d,
                    rope=RoPESpec(base=QWEN_SHAPE["rope_theta"], layout="half"))
    w = dict(w_q=rnd(m, H, d, std=QK_STD), w_k=rnd(m, Hk, d, std=QK_STD),
             w_v=rnd(m, Hk, d, std=V_STD), b_q=rnd(H, d, std=QK_BIAS_STD),
             b_k=rnd(Hk, d, std=QK_BIAS_STD), b_v=rnd(Hk, d, std=V_BIAS_STD))
    w["w_q"], w["b_q"] = w["w_q"] * q_scale, w["b_q"] * q_scale
    gx = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(N, m, generator=gx, dtype=torch.float64)  # RMSNorm-like rows
    return spec, HeadWeights(**w), x


def stratified(n: int, s: int) -> list[int]:
    """``s`` queries ``floor((k + 1/2) n / s)`` (distinct, sorted)."""
    s = max(1, min(n, s))
    return sorted({min(n - 1, int((k + 0.5) * n / s)) for k in range(s)})


def _dtype(name: str) -> Any:
    import torch

    return {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _rel(a: Any, b: Any) -> float:
    import torch

    a, b = a.to(torch.float64), b.to(torch.float64)
    den = float(b.abs().max())
    return float((a - b).abs().max()) / den if den > 0 else float((a - b).abs().max())


# ---------------------------------------------------------------------------------------------
# one configuration (runs in a worker subprocess)
# ---------------------------------------------------------------------------------------------
def measure(cfg: dict) -> dict:
    """Measure one (dtype, N) configuration; see the module docstring for the order and methods."""
    import torch
    import torch.nn.functional as F

    from . import lowrank, scale

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32 GEMMs on CUDA
    torch.backends.cudnn.allow_tf32 = False
    N, dev, seed = int(cfg["n"]), cfg["device"], int(cfg["seed"])
    dt = _dtype(cfg["dtype"])
    budget = int(cfg["max_bytes"])
    spec, w, x = qwen_layer(N, seed)
    m, H, d, r = x.shape[1], spec.n_heads, spec.head_dim, spec.r
    x = x.to(dt)
    out: dict[str, Any] = {"n": N, "dtype": cfg["dtype"], "threads": torch.get_num_threads(),
                           "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg")
                           else None}
    log = cfg.get("log", True)

    def say(msg: str) -> None:
        if log:
            print(f"[bench {cfg['dtype']} N={N}] {msg}", file=sys.stderr, flush=True)

    warm_up(dt, dev)
    # 1. projection + factored path (sized)
    sample = [] if cfg.get("factored_only") else stratified(N, int(cfg.get("direct_queries", 8)))
    # the sampled Delta M are copied into buffers allocated (and touched) before the memory
    # measurement starts, so the benchmark's own bookkeeping is not in the measured peak
    captured = {i: torch.full((H, m + 1, r), math.nan, dtype=torch.float64) for i in sample}

    nonfinite = [False]  # a NaN/inf in y or the readout (kept whatever the streamed maxima do)

    def grab(ch: Any) -> None:
        if not nonfinite[0] and not bool(torch.isfinite(ch.y_c - ch.readout_c).all()):
            nonfinite[0] = True
        if ch.delta_m is None:
            return
        for a, qi in enumerate(ch.queries.tolist()):
            if qi in captured:
                captured[qi][ch.heads] = ch.delta_m[:, a].to("cpu", torch.float64)

    timers: dict = {}
    with PeakMemory(dev) as mem:
        _sync(dev)
        t0 = time.perf_counter()
        layer = scale.project_layer(spec, w, x, dtype=dt, device=dev)
        _sync(dev)
        t1 = time.perf_counter()
        res = scale.identity_check(spec, w, x, dtype=dt, device=dev, max_bytes=budget,
                                   delta_m=True, layer=layer, on_chunk=grab, timers=timers)
        _sync(dev)
        t2 = time.perf_counter()
    pl = res.plan
    fl = scale.flops_factored(spec, N, m, delta_m=True)
    fl_t = scale.flops_factored(spec, N, m, delta_m=False)
    tdm = timers.get("delta_m_seconds", 0.0)
    out["factored"] = {
        "seconds": t2 - t1, "projection_seconds": t1 - t0, "flops": fl,
        "gflops_per_s": fl / (t2 - t1) / 1e9,
        "delta_m_seconds": tdm, "t_only_seconds": t2 - t1 - tdm, "t_only_flops": fl_t,
        "t_only_gflops_per_s": fl_t / max(t2 - t1 - tdm, 1e-12) / 1e9,
        "identity_max_rel": math.nan if nonfinite[0] else worst(res.max_rel),
        "identity_max_abs": math.nan if nonfinite[0] else worst(res.max_abs),
        "identity_per_head_max_rel": [float(v) for v in res.max_rel],
        "plan": {"query_chunk": pl.query_chunk, "key_block": pl.key_block,
                 "planned_bytes": pl.bytes, "fixed_bytes": pl.fixed_bytes,
                 "p_bytes": pl.p_bytes, "per_query_bytes": pl.per_query_bytes},
        "max_bytes": budget, "peak_bytes": mem.peak, "memory_method": mem.method,
        "under_budget": bool(mem.peak is not None and mem.peak <= budget),
    }
    say(f"factored {t2 - t1:.2f} s, identity max rel {out['factored']['identity_max_rel']:.2e}, "
        f"peak {mem.peak / 2**20:.0f} MiB")
    if cfg.get("factored_only"):
        out["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        return out

    # 2. SDPA on the same projected q, k, v (GQA expanded outside the timer)
    gi = [layer.group_of(h) for h in range(H)]
    qs = layer.q[None]  # (1, H, N, d), already scaled
    ks = layer.k[gi][None].contiguous()
    vs = layer.v[[layer.kv_of_group[g] for g in gi]][None].contiguous()

    def sdpa() -> Any:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1.0)

    ts, ysd = _timed(sdpa, dev)
    # sanity: SDPA output equals the identity's y on the sampled queries
    sdpa_vs_direct = []
    out["sdpa"] = {"seconds": ts, "flops": int(4 * H * (N * (N + 1) // 2) * d)}
    say(f"sdpa {ts:.4f} s")

    # 3. direct per-query evaluation on stratified queries
    times, errs, rerr = [], [], []
    for i in sample:
        _sync(dev)
        t0 = time.perf_counter()
        dq = scale.direct_query(layer, i)
        _sync(dev)
        times.append(time.perf_counter() - t0)
        ref = dq["delta_m"].to("cpu", torch.float64)
        errs.append(_rel(captured[i], ref))
        rerr.append(_rel(dq["readout"], dq["y"]))
        sdpa_vs_direct.append(_rel(ysd[0, :, i], dq["y"]))
    per_q = sum(times) / len(times)
    fd = sum(scale.flops_direct(spec, i + 1, m) for i in range(N))
    out["direct"] = {
        "queries": sample, "seconds_per_query": times, "mean_seconds_per_query": per_q,
        "extrapolated_seconds": per_q * N, "flops": fd,
        "gflops_per_s": sum(scale.flops_direct(spec, i + 1, m) for i in sample) / sum(times) / 1e9,
        "delta_m_rel_vs_factored": worst(errs), "identity_max_rel": worst(rerr),
    }
    out["sdpa"]["y_rel_vs_direct"] = worst(sdpa_vs_direct)
    out["speedup_factored_vs_direct"] = per_q * N / out["factored"]["seconds"]
    out["speedup_t_only_vs_direct"] = per_q * N / out["factored"]["t_only_seconds"]
    say(f"direct {per_q:.3f} s/query -> {per_q * N:.1f} s; speedup "
        f"{out['speedup_factored_vs_direct']:.1f}x (T only {out['speedup_t_only_vs_direct']:.1f}x),"
        f" dM rel {num(worst(errs), '.1e')}")

    # 4. plain matmul of the main GEMM's shape
    rows = min(pl.query_chunk, N) * spec.group
    a = torch.randn(rows, N, dtype=layer.q.dtype, device=dev)
    b = torch.randn(N, d * r, dtype=layer.q.dtype, device=dev)
    tm, _ = _timed(lambda a=a, b=b: a @ b, dev)
    mm = 2 * rows * N * d * r / tm / 1e9
    out["matmul"] = {"shape": [rows, N, d * r], "seconds": tm, "gflops_per_s": mm,
                     "dtype": str(layer.q.dtype).replace("torch.", "")}
    out["throughput_ratio"] = out["factored"]["gflops_per_s"] / mm
    out["throughput_ratio_t_only"] = out["factored"]["t_only_gflops_per_s"] / mm
    del a, b
    say(f"matmul {mm:.1f} GFLOP/s; factored/matmul {out['throughput_ratio']:.2f}")

    # 5. pairwise gauge: low rank all queries, exact vs low rank on sampled queries
    heads = cfg.get("pairwise_heads") or []
    if heads:
        tl, rl = _timed(lambda: scale.identity_check(
            spec, w, x, dtype=dt, device=dev, max_bytes=budget, gauge="pairwise",
            heads=heads, layer=layer), dev, min_total=0.5, max_reps=3)
        ps = stratified(N, int(cfg.get("pairwise_queries", 4)))
        kw = dict(dtype=dt, device=dev, max_bytes=budget, heads=heads, queries=ps, layer=layer)
        te, ex = _timed(lambda: scale.pairwise_layer(spec, w, x, method="exact", **kw), dev,
                        min_total=0.5, max_reps=3)
        tls, lo = _timed(lambda: scale.pairwise_layer(spec, w, x, method="lowrank", **kw), dev,
                         min_total=0.5, max_reps=3)
        sq = sum((i + 1) ** 2 for i in ps)
        out["pairwise"] = {
            "heads": heads, "lowrank_all_seconds": tl, "lowrank_nodes_max": rl.extras.get("nodes_max"),
            # only the timed heads were computed (the others are NaN by construction)
            "lowrank_identity_max_rel": worst(rl.max_rel[list(heads)]),
            "sample_queries": ps, "exact_sample_seconds": te, "lowrank_sample_seconds": tls,
            "exact_extrapolated_all_seconds": te * sum((i + 1) ** 2 for i in range(N)) / sq,
            "t_rel_lowrank_vs_exact": _rel(lo["t"][heads], ex["t"][heads]),
            "readout_rel_lowrank_vs_exact": _rel(lo["readout"][heads], ex["readout"][heads]),
            "exact_identity_max_rel": _rel(ex["readout"][heads], ex["y"][heads]),
        }
        say(f"pairwise lowrank all {tl:.2f} s (n<={rl.extras.get('nodes_max')}); sample exact "
            f"{te:.2f} s vs lowrank {tls:.3f} s, T rel {out['pairwise']['t_rel_lowrank_vs_exact']:.1e}")

    # 6. accuracy against the score spread (once)
    if cfg.get("spreads"):
        out["spreads"] = spread_sweep(cfg, dt, dev, budget)
    out["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return out


def warm_up(dt: Any, dev: Any) -> None:
    """Run every measured code path once on a tiny layer (library code pages, kernels, JIT)."""
    import gc

    import torch
    import torch.nn.functional as F

    from . import lowrank, scale

    spec, w, x = qwen_layer(80, 12345)
    x = x.to(dt)
    L = scale.project_layer(spec, w, x, dtype=dt, device=dev)
    scale.identity_check(spec, w, x, dtype=dt, device=dev, delta_m=True, layer=L)
    scale.direct_query(L, 79)
    for method in ("lowrank", "exact"):
        scale.pairwise_layer(spec, w, x, method=method, dtype=dt, device=dev, heads=[0],
                               queries=[40, 79], layer=L)
    F.scaled_dot_product_attention(L.q[None], L.k[[0] * spec.n_heads][None],
                                   L.v[[0] * spec.n_heads][None], is_causal=True)
    a = torch.randn(64, 80, dtype=L.q.dtype, device=dev)
    _ = a @ a.T
    del L, a
    gc.collect()


def spread_sweep(cfg: dict, dt: Any, dev: Any, budget: int) -> list[dict]:
    """Low rank vs exact pairwise ``T`` on layers rescaled to a target score spread (head 0)."""
    import torch

    from . import lowrank, scale

    N, seed = int(cfg["spread_n"]), int(cfg["seed"])
    spec, w, x = qwen_layer(N, seed)
    L = scale.project_layer(spec, w, x.to(dt), dtype=dt, device=dev)
    # head 0's largest spread over all queries at q_scale = 1 (the spread is linear in q_scale)
    s = L.q[0] @ L.k[L.group_of(0)].T
    mask = torch.ones(N, N, dtype=torch.bool, device=s.device).tril()
    hi = s.masked_fill(~mask, -math.inf).amax(-1)
    lo = s.masked_fill(~mask, math.inf).amin(-1)
    base = float((hi - lo).max())
    qs = stratified(N, int(cfg.get("pairwise_queries", 4))) + [N - 1]
    qs = sorted(set(qs))
    rows = []
    for target in cfg["spreads"]:
        spec, w, x = qwen_layer(N, seed, q_scale=target / base)
        kw = dict(dtype=dt, device=dev, max_bytes=budget, heads=[0], queries=qs)
        ex = scale.pairwise_layer(spec, w, x.to(dt), method="exact", **kw)
        lr_ = scale.identity_check(spec, w, x.to(dt), gauge="pairwise", **kw)
        lo_ = scale.pairwise_layer(spec, w, x.to(dt), method="lowrank", **kw)
        rows.append({"target_spread": target, "n": N, "nodes": lr_.extras.get("nodes_max"),
                     "t_rel_lowrank_vs_exact": _rel(lo_["t"][[0]], ex["t"][[0]]),
                     "readout_rel_lowrank_vs_exact": _rel(lo_["readout"][[0]], ex["readout"][[0]]),
                     "lowrank_identity_max_rel": float(lr_.max_rel[0])})
    return rows


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def _worker(cfg: dict) -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "ropestep.bench", "--worker", json.dumps(cfg)],
                          stdout=subprocess.PIPE, stderr=None, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed (exit {proc.returncode}) for {cfg}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit_exponent(ns: Sequence[float], ts: Sequence[float]) -> float | None:
    """Least-squares slope of ``log t`` against ``log N``."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(ns, ts) if t and t > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx > 0 else None


def summarise(results: list[dict]) -> dict:
    """Acceptance figures derived from the per-configuration results."""
    full = [r for r in results if "direct" in r]
    s: dict[str, Any] = {}
    at = {r["n"]: r for r in full}
    if 1024 in at:
        s["speedup_vs_direct_at_1024"] = at[1024]["speedup_factored_vs_direct"]
        s["speedup_t_only_vs_direct_at_1024"] = at[1024]["speedup_t_only_vs_direct"]
        s["delta_m_rel_vs_direct_at_1024"] = at[1024]["direct"]["delta_m_rel_vs_factored"]
    big = [r for r in full if r["n"] >= 1024]
    if big:
        s["throughput_ratio_min_n_ge_1024"] = least(r["throughput_ratio"] for r in big)
        s["throughput_ratio_by_n"] = {str(r["n"]): r["throughput_ratio"] for r in big}
        s["throughput_ratio_t_only_by_n"] = {str(r["n"]): r["throughput_ratio_t_only"]
                                             for r in big}
    pw = [(r["n"], r["pairwise"]["lowrank_all_seconds"]) for r in full
          if "pairwise" in r and 512 <= r["n"] <= 4096]
    if len(pw) >= 2:
        s["pairwise_lowrank_time_exponent_512_4096"] = fit_exponent(*zip(*pw))
    pr = [r["pairwise"]["t_rel_lowrank_vs_exact"] for r in full if "pairwise" in r]
    for r in full:
        if "spreads" in r:
            pr += [x["t_rel_lowrank_vs_exact"] for x in r["spreads"]]
            s["spread_sweep_max_t_rel"] = worst(x["t_rel_lowrank_vs_exact"] for x in r["spreads"])
    if pr:
        s["pairwise_t_rel_max"] = worst(pr)
    bud = [r for r in results if "direct" not in r]
    if bud:
        s["budget_runs"] = [{"n": r["n"], "max_bytes": r["factored"]["max_bytes"],
                             "peak_bytes": r["factored"]["peak_bytes"],
                             "under_budget": r["factored"]["under_budget"]} for r in bud]
    return s


# ---------------------------------------------------------------------------------------------
# the verdict
# ---------------------------------------------------------------------------------------------
# (section, key, hidden): hidden = m when one side forms its terms in the augmented input space
# (the direct path), 0 when both sides share the projected q, k, v
CHECKS = (
    ("factored", "identity_max_rel", 0),
    ("direct", "delta_m_rel_vs_factored", QWEN_SHAPE["hidden"]),
    ("direct", "identity_max_rel", QWEN_SHAPE["hidden"]),
    ("sdpa", "y_rel_vs_direct", QWEN_SHAPE["hidden"]),
    ("pairwise", "lowrank_identity_max_rel", 0),
    ("pairwise", "t_rel_lowrank_vs_exact", 0),
    ("pairwise", "readout_rel_lowrank_vs_exact", 0),
    ("pairwise", "exact_identity_max_rel", 0),
)
SPREAD_CHECKS = ("t_rel_lowrank_vs_exact", "readout_rel_lowrank_vs_exact",
                 "lowrank_identity_max_rel")


def tolerance(dtype: str, n: int, hidden: int) -> float:
    """:func:`ropestep.tolerances.agreement_rel_tol` for the benchmark layer's head dim."""
    from . import tolerances

    return tolerances.agreement_rel_tol(_dtype(dtype), n, QWEN_SHAPE["head_dim"], hidden)


def _value(x: Any) -> float:
    """A measured number from a result (None = missing: NaN, i.e. a failure)."""
    if x is None:
        return math.nan
    return float(x)  # also parses the JSON spellings "nan"/"inf"


def checks(results: list[dict], spread_n: int | None = None) -> list[dict]:
    """Every agreement check of the results: ``{"n", "dtype", "check", "value", "tol", "pass"}``.

    ``pass`` is ``value <= tol`` (False for NaN and inf); a section that ran but lacks a value
    counts as NaN."""
    out = []
    for r in results:
        dt, n = r["dtype"], int(r["n"])
        for sec, key, hidden in CHECKS:
            if sec not in r:
                continue
            v, tol = _value(r[sec].get(key)), tolerance(dt, n, hidden)
            out.append({"n": n, "dtype": dt, "check": f"{sec}.{key}", "value": v, "tol": tol,
                        "pass": v <= tol})
        for row in r.get("spreads") or []:
            sn = int(row.get("n") or spread_n or n)
            tol = tolerance(dt, sn, 0)
            for key in SPREAD_CHECKS:
                v = _value(row.get(key))
                name = f"spreads[{row['target_spread']:g}].{key}"
                out.append({"n": sn, "dtype": dt, "check": name, "value": v, "tol": tol,
                            "pass": v <= tol})
    return out


def failures(results: list[dict], spread_n: int | None = None) -> list[Failure]:
    """The failed :func:`checks`, as failure lines (``dtype N=n``, the check, value, tolerance)."""
    return [Failure(f"{c['dtype']} N={c['n']}", c["check"], c["value"], c["tol"])
            for c in checks(results, spread_n) if not c["pass"]]


def verdict_block(results: list[dict], spread_n: int | None = None) -> dict:
    cs = checks(results, spread_n)
    fl = failures(results, spread_n)
    return {"pass": not fl, "checks": len(cs), "failed_checks": len(fl),
            "failures": [f.as_dict() for f in fl]}


def check_args(args: argparse.Namespace) -> None:
    """Bad input raises :class:`BenchInputError` (before any worker starts)."""
    if getattr(args, "render", None):
        for p in args.render:
            if not Path(p).is_file():
                raise BenchInputError(f"--render {str(p)!r} does not exist")
        return
    H = QWEN_SHAPE["n_heads"]
    for name, vals, lo in (("--sizes", args.sizes, 2), ("--budget-sizes", args.budget_sizes, 2)):
        bad = [v for v in vals if v < lo]
        if bad:
            raise BenchInputError(f"{name} must all be >= {lo}, got {bad[0]}")
    if not args.sizes:
        raise BenchInputError("--sizes needs at least one context length")
    for name, v in (("--direct-queries", args.direct_queries),
                    ("--pairwise-queries", args.pairwise_queries), ("--spread-n", args.spread_n)):
        if v < (2 if name == "--spread-n" else 1):
            raise BenchInputError(f"{name} must be >= {2 if name == '--spread-n' else 1}, got {v}")
    bad = [h for h in args.pairwise_heads if not 0 <= h < H]
    if bad:
        raise BenchInputError(f"--pairwise-heads: head {bad[0]} out of range (the layer has {H} "
                              f"heads: 0..{H - 1})")
    bad = [x for x in args.spreads if not (x > 0 and math.isfinite(x))]
    if bad:
        raise BenchInputError(f"--spreads must be finite and > 0, got {bad[0]}")
    if args.max_bytes < 1:
        raise BenchInputError(f"--max-bytes must be > 0, got {args.max_bytes}")
    if args.threads is not None and args.threads < 1:
        raise BenchInputError(f"--threads must be >= 1, got {args.threads}")
    dev = str(args.device)
    problem = device_problem(dev)
    if problem is not None:
        raise BenchInputError(problem)
    if args.out is not None and Path(args.out).is_dir():
        raise BenchInputError(f"--out {str(args.out)!r} is a directory")


def _error(prog: str, msg: str, code: int) -> int:
    sys.stderr.write(f"{prog}: error: {' '.join(str(msg).split())}\n")
    return code


def _render(args: argparse.Namespace, prog: str) -> int:
    reps = []
    for p in args.render:
        try:
            rep = loads(Path(p).read_text())  # "nan"/"inf" strings back to floats
            if rep.get("schema") != SCHEMA or not isinstance(rep.get("results"), list):
                raise ValueError(f"not a {SCHEMA} result")
        except (OSError, ValueError, AttributeError) as err:
            return _error(prog, f"--render {str(p)!r}: {err}", EXIT_INPUT)
        reps.append(rep)
    fl = []
    for rep in reps:  # the summary and the verdict are derived data: recompute them
        rep["summary"] = summarise(rep["results"])
        sn = (rep.get("config") or {}).get("spread_n")
        rep["verdict"] = verdict_block(rep["results"], sn)
        fl += failures(rep["results"], sn)
    md = render_markdown(reps)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md)
    else:
        print(md)
    if fl:
        print_failures(prog, fl)
        return EXIT_FAIL
    return EXIT_PASS


def run(args: argparse.Namespace, prog: str = PROG) -> int:
    """Run the benchmark (or ``--render``); returns the exit status (0 pass, 1 fail, 2 input)."""
    try:
        check_args(args)
    except BenchInputError as err:
        return _error(prog, str(err), EXIT_INPUT)
    if getattr(args, "render", None):
        return _render(args, prog)
    base = dict(device=args.device, seed=args.seed, dtype=args.dtype, threads=args.threads,
                max_bytes=args.max_bytes, direct_queries=args.direct_queries,
                pairwise_heads=args.pairwise_heads, pairwise_queries=args.pairwise_queries,
                spread_n=args.spread_n, log=not args.quiet)
    t0 = time.time()
    results = []
    try:
        for i, n in enumerate(args.sizes):
            cfg = dict(base, n=n, spreads=args.spreads if i == 0 else [])
            results.append(_worker(cfg))
        for n in args.budget_sizes:
            results.append(_worker(dict(base, n=n, factored_only=True, spreads=[])))
    except RuntimeError as err:  # a worker crashed: its traceback is above, on stderr
        return _error(prog, str(err), EXIT_FAIL)
    rep = {
        "schema": SCHEMA,
        "command": "ropestep bench " + " ".join(_argv_of(args)),
        "environment": environment(args.device),
        "config": {"layer": dict(QWEN_SHAPE, biases=True, qk_std=QK_STD, v_std=V_STD,
                                 qk_bias_std=QK_BIAS_STD, v_bias_std=V_BIAS_STD),
                   "seed": args.seed, "input_seed": args.seed + 1, "dtype": args.dtype,
                   "device": args.device, "threads": args.threads, "max_bytes": args.max_bytes,
                   "sizes": args.sizes, "budget_sizes": args.budget_sizes,
                   "direct_queries": args.direct_queries, "pairwise_heads": args.pairwise_heads,
                   "pairwise_queries": args.pairwise_queries, "spreads": args.spreads,
                   "spread_n": args.spread_n},
        "results": results,
        "summary": summarise(results),
        "verdict": verdict_block(results, args.spread_n),
        "wall_seconds": time.time() - t0,
    }
    from .verdict import dumps

    text = dumps(rep, indent=1)
    if args.out:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        except OSError as err:
            return _error(prog, f"cannot write --out {str(args.out)!r}: {err}", EXIT_INPUT)
        if not args.quiet:
            print(f"wrote {args.out} in {rep['wall_seconds']:.0f} s", file=sys.stderr)
    else:
        print(text)
    v = rep["verdict"]
    if not v["pass"]:
        print_failures(prog, v["failures"])
        sys.stderr.write(f"{prog}: {v['failed_checks']} of {v['checks']} agreement checks "
                         "failed\n")
        return EXIT_FAIL
    if not args.quiet:
        print(f"{prog}: all {v['checks']} agreement checks passed", file=sys.stderr)
    return EXIT_PASS


def _argv_of(args: argparse.Namespace) -> list[str]:
    out = ["--sizes", *map(str, args.sizes), "--dtype", args.dtype, "--device", args.device,
           "--seed", str(args.seed), "--max-bytes", str(args.max_bytes)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.budget_sizes:
        out += ["--budget-sizes", *map(str, args.budget_sizes)]
    out += ["--direct-queries", str(args.direct_queries),
            "--pairwise-heads", *map(str, args.pairwise_heads),
            "--pairwise-queries", str(args.pairwise_queries),
            "--spreads", *[f"{s:g}" for s in args.spreads], "--spread-n", str(args.spread_n)]
    if args.out:
        out += ["--out", str(args.out)]
    return out


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------
def _g(x: Any, fmt: str = ".3g") -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, fmt)


def render_markdown(reports: list[dict]) -> str:
    """Markdown tables from benchmark JSON reports (one section per report)."""
    out = []
    for rep in reports:
        env, cfg = rep["environment"], rep["config"]
        out.append(f"### {cfg['device']} {cfg['dtype']} — {env['cpu']} ({env['cpu_count']} cores), "
                   f"torch {env['torch']}, GPU {env['gpu'] or 'none'}\n")
        out.append(f"`{rep['command']}`  \nseed {cfg['seed']}, threads "
                   f"{cfg['threads'] or env['torch_threads_default']}, wall {rep['wall_seconds']:.0f} s\n")
        full = [r for r in rep["results"] if "direct" in r]
        if full:
            out.append("| N | SDPA s | factored s (T + ΔM) | of which ΔM s | direct s (extrap.) | "
                       "speedup (T + ΔM) | speedup (T only) | factored GFLOP/s | matmul GFLOP/s | "
                       "ratio | peak MiB | ΔM rel vs direct | identity max rel | load avg |")
            out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in full:
                f = r["factored"]
                la = r.get("loadavg_start") or [None]
                out.append(
                    f"| {r['n']} | {_g(r['sdpa']['seconds'])} | {_g(f['seconds'])} | "
                    f"{_g(f['delta_m_seconds'])} | {_g(r['direct']['extrapolated_seconds'])} | "
                    f"{_g(r['speedup_factored_vs_direct'], '.1f')}× | "
                    f"{_g(r['speedup_t_only_vs_direct'], '.1f')}× | {_g(f['gflops_per_s'])} | "
                    f"{_g(r['matmul']['gflops_per_s'])} | {_g(r['throughput_ratio'], '.2f')} | "
                    f"{_g(f['peak_bytes'] / 2**20, '.0f')} | "
                    f"{_g(r['direct']['delta_m_rel_vs_factored'], '.1e')} | "
                    f"{_g(f['identity_max_rel'], '.1e')} | {_g(la[0], '.1f')} |")
            out.append("")
        pw = [r for r in full if "pairwise" in r]
        if pw:
            out.append("| N | low-rank all queries s | nodes | exact sample s | low-rank sample s | "
                       "exact all (extrap.) s | T rel (low rank vs exact) |")
            out.append("|---:|---:|---:|---:|---:|---:|---:|")
            for r in pw:
                p = r["pairwise"]
                out.append(f"| {r['n']} | {_g(p['lowrank_all_seconds'])} | "
                           f"{p['lowrank_nodes_max']} | {_g(p['exact_sample_seconds'])} | "
                           f"{_g(p['lowrank_sample_seconds'])} | "
                           f"{_g(p['exact_extrapolated_all_seconds'])} | "
                           f"{_g(p['t_rel_lowrank_vs_exact'], '.1e')} |")
            out.append("")
        for r in full:
            if r.get("spreads"):
                out.append("| target spread | nodes | T rel (low rank vs exact) | readout rel |")
                out.append("|---:|---:|---:|---:|")
                for x in r["spreads"]:
                    out.append(f"| {x['target_spread']:g} | {x['nodes']} | "
                               f"{_g(x['t_rel_lowrank_vs_exact'], '.1e')} | "
                               f"{_g(x['readout_rel_lowrank_vs_exact'], '.1e')} |")
                out.append("")
        bud = [r for r in rep["results"] if "direct" not in r]
        if bud:
            out.append("| N (budget run) | max bytes | measured peak | planned | factored s | "
                       "under budget | identity max rel |")
            out.append("|---:|---:|---:|---:|---:|:---:|---:|")
            for r in bud:
                f = r["factored"]
                out.append(f"| {r['n']} | {f['max_bytes'] / 2**20:.0f} MiB | "
                           f"{f['peak_bytes'] / 2**20:.0f} MiB | "
                           f"{f['plan']['planned_bytes'] / 2**20:.0f} MiB | {_g(f['seconds'])} | "
                           f"{'yes' if f['under_budget'] else 'NO'} | "
                           f"{_g(f['identity_max_rel'], '.1e')} |")
            out.append("")
        v = rep.get("verdict")
        if v is not None:
            out.append(f"Verdict: **{'PASS' if v['pass'] else 'FAIL'}** — "
                       f"{v['checks'] - v['failed_checks']} of {v['checks']} agreement checks "
                       "within `tolerances.agreement_rel_tol`"
                       + "".join(f"\n- `{Failure(**f).line()}`" for f in v["failures"]) + "\n")
        s = rep.get("summary", {})
        if s:
            out.append("Summary: " + "; ".join(
                f"{k} = {_g(v, '.3g') if isinstance(v, float) else v}" for k, v in s.items()
                if not isinstance(v, (list, dict))) + "\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# standalone
# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        res = measure(json.loads(argv[1]))
        print(json.dumps(res))
        return 0
    from .verdict import OneLineParser

    p = OneLineParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as stop:  # --help (0) or a one-line usage error (2)
        return int(stop.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
