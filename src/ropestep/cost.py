"""The work an atlas run must do, counted, and the rate this machine does it at.

:func:`atlas_flops` counts the floating-point operations of each phase of one (context, layer)
item of ``ropestep atlas`` (docs/protocol.md section 11, `cost`, states the counts per query and head):
a multiply-add is 2 operations, an ``n x k`` by ``k x p`` product ``2 n k p``, a symmetric
``s x s`` eigenvalue problem ``4/3 s^3`` (the tridiagonal reduction; the QR sweeps on the
tridiagonal matrix are ``O(s^2)``), a largest eigenvalue by ``fast.lambda_max``
:func:`lambda_max_flops`, and element-wise work (exponentials, masks, maxima) is not counted: it
is linear in the inputs, so the counts are a floor the run cannot go below.
:func:`matmul_rate` measures this machine's GEMM rate in a dtype, with the threads the run uses,
so that a report can say what fraction of it each phase achieved, and ``--plan`` can say what a
run will cost before any weight is loaded (:func:`plan`).
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from .spec import first_permitted

PHASES = ("project", "float64_original", "lowp_maxkey", "float64_maxkey")
LANCZOS_STEPS = 8  # fast.LANCZOS_STEPS (tests/test_lambda_max.py checks that they agree)
ATLAS_LANCZOS_STEPS = 5  # fast.LANCZOS_STEPS_STARTED: the atlas's steps from its start vectors


def lambda_max_flops(d: int, k: int = LANCZOS_STEPS, started: bool = False) -> float:
    """Operations of one certified ``lambda_max`` of a ``d x d`` matrix (``fast.lambda_max``):
    ``k`` Lanczos steps, each a matrix-vector product ``2 d^2``, its Rayleigh coefficient
    ``2d``, the residual norm ``2d`` and two reorthogonalisations against the ``j`` basis
    vectors so far (``2 * 4 d j``), so ``k (2 d^2 + 4 d) + 4 d k (k + 1)``; the Frobenius norm
    ``2 d^2``; the two ``(k+1) x (k+1)`` eigenvalue problems ``2 * 4/3 (k+1)^3``; with a
    caller's start vector (``started``) its norm ``2d`` (the vector itself is the caller's
    count).  (A matrix the steps do not certify -- retried with more steps, then LAPACK's full
    spectrum -- is not counted beyond them: the floor is the certified path.)"""
    k = min(int(k), int(d))
    return (k * (2 * d * d + 4 * d) + 4 * d * k * (k + 1) + 2 * d * d + 8 / 3 * (k + 1) ** 3
            + (2 * d if started else 0))


def prefix_sums(N: int, window: int | None, chunk: int | None = None) -> tuple[int, int]:
    """``(sum_i n_i, Q)`` over the ``N`` queries of a causal context, ``n_i = i + 1`` keys (at
    most ``window`` of them under a sliding window; ``i - (i // chunk) chunk + 1`` under chunked
    attention: :func:`ropestep.spec.first_permitted`)."""
    if chunk is not None and chunk < N:
        return sum(i - first_permitted(i, window, chunk) + 1 for i in range(N)), N
    if window is None or window >= N:
        return N * (N + 1) // 2, N
    w = int(window)
    return w * (w + 1) // 2 + (N - w) * w, N


def atlas_flops(*, N: int, d: int, r: int, m: int, H: int, H_kv: int, affine: bool = True,
                softcap: bool = False, window: int | None = None,
                chunk: int | None = None) -> dict[str, float]:
    """Floating-point operations of each atlas phase on one (context, layer) item of ``N``
    tokens (docs/protocol.md section 11, `cost`).  Per head and query ``i`` with ``n = n_i`` keys:

    * every streamed pass: scores ``2 n d``, the coefficient-weighted sum ``T_i``
      (``sum_j c_ij k^_j v^_j^T``, one GEMM row) ``2 n d r``, the output ``2 n r``;
    * the float64 original-gauge pass besides (unless the scores are soft-capped, where the
      step statistics are not defined): the Gram matrix ``G_i`` ``2 n d^2``, the start
      vector of its Lanczos steps ``g_i = sum_j c_ij k~_j`` ``2 n d``, its largest eigenvalue
      :func:`lambda_max_flops` (``ATLAS_LANCZOS_STEPS`` steps, started), the step's quadratic
      test in query space ``2 d^2 r + 4 d r`` (``G_i T_i``, then ``<T, G T>`` and ``||T||^2``);
      on affine heads the input-space problem ``M_i = B_i^T G_i B_i`` ``4 d^3``, its start
      vector ``B_i^T g_i`` ``2 d^2``, its largest eigenvalue, the test ``4 d^2 r + 4 d r``
      (``Y_i = B_i^T T_i``, ``M_i Y_i``, ``<Y, M Y>``, ``||Y||^2``); frozen reuse
      ``2 (m + 1) d + 2 d r``;
    * the projections, once per item: ``2 N (m + 1) (H d + H_kv d + H_kv r)``.
    """
    S, Q = prefix_sums(N, window, chunk)
    streamed = H * (2 * S * d + 2 * S * d * r + 2 * S * r)
    extra = 0.0
    if not softcap:
        lam = lambda_max_flops(d, ATLAS_LANCZOS_STEPS, started=True)
        extra += H * (2 * S * d * d + 2 * S * d + Q * (lam + 2 * d * d * r + 4 * d * r))
        if affine:
            extra += H * Q * (4 * d ** 3 + 2 * d * d + lam + 4 * d * d * r + 4 * d * r)
    extra += H * Q * (2 * (m + 1) * d + 2 * d * r)
    return {"project": 2.0 * N * (m + 1) * (H * d + H_kv * d + H_kv * r),
            "float64_original": float(streamed + extra),
            "lowp_maxkey": float(streamed), "float64_maxkey": float(streamed)}


def matmul_rate(dtype: torch.dtype = torch.float64, n: int = 512, seconds: float = 0.3,
                device: Any = "cpu") -> float:
    """This machine's GEMM rate in ``dtype`` (operations per second; ``n x n`` products, the
    best of repeated timings over about ``seconds``, with torch's current thread count)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    torch.mm(a, b)  # warm-up
    sync()
    best, spent = math.inf, 0.0
    while spent < seconds or best == math.inf:
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return 2.0 * n ** 3 / best


def phase_report(flops: dict[str, float], seconds: dict[str, float], rates: dict[str, float],
                 lowp: str, forward_seconds: float | None) -> dict:
    """Per phase the counted work, its time, the achieved rate and its fraction of this
    machine's GEMM rate in the phase's dtype; overall the same, and the work's time against
    the model's own forwards over the same tokens."""
    dt = {"project": "float64", "float64_original": "float64", "lowp_maxkey": lowp,
          "float64_maxkey": "float64"}
    names = {"lowp_maxkey": f"{lowp}_maxkey"}
    out: dict[str, Any] = {"phases": {}}
    floor = 0.0
    for ph in PHASES:
        f, s = flops.get(ph, 0.0), seconds.get(names.get(ph, ph))
        if s is None:
            continue
        rate = rates[dt[ph]]
        floor += f / rate
        out["phases"][names.get(ph, ph)] = {
            "flops": f, "seconds": s, "dtype": dt[ph],
            "achieved_flops_per_s": f / s if s > 0 else math.nan,
            "fraction_of_matmul": (f / s) / rate if s > 0 else math.nan}
    work_s = sum(p["seconds"] for p in out["phases"].values())
    out["matmul_flops_per_s"] = dict(rates)
    out["work_seconds"] = work_s
    out["floor_seconds"] = floor  # every phase at this machine's GEMM rate
    out["fraction_of_matmul"] = floor / work_s if work_s > 0 else math.nan
    if forward_seconds:
        out["model_forward_seconds"] = forward_seconds
        out["work_over_model_forward"] = work_s / forward_seconds
        out["floor_over_model_forward"] = floor / forward_seconds
    return out
