"""The pairwise gauge in low rank: Gauss-Legendre quadrature of the exponential divided difference.

docs/math.md section 4.  For one query with shifted scores ``z_j = s_j - s_max <= 0`` (``s_max`` over
the permitted set), ``N`` permitted keys and ``Z = e^{s_max} Z-bar``,

    dM^pair = 1/(2 N Z) sum_{j,k} exp[s_j, s_k] (a_j - a_k)(v_j - v_k)^T,
    T^pair  = 1/(N Z-bar) K~^T (diag(D 1) - D) V,    D_jk = exp[z_j, z_k] = int_0^1 e^{t z_j + (1-t) z_k} dt

(the factor ``e^{s_max}`` of ``exp[s_j, s_k]`` cancels against ``Z``).  The readout is
``y = mu + q T^pair + b^pair`` with ``b^pair = 1/(N Z-bar) beta^T (diag(D 1) - D) V``.

Exact evaluation forms ``D`` (``N x N``) for every query: ``O(N^2 r)`` per query.  The
``n``-point Gauss-Legendre rule on ``[0, 1]`` (nodes ``t_n``, weights ``w_n > 0``) gives

    D ~ sum_n w_n a_n b_n^T,   a_n = e^{t_n z},  b_n = e^{(1 - t_n) z}      (entries in (0, 1])

so with ``delta = D 1 = sum_n w_n a_n (b_n^T 1)``

    K^T (diag(D 1) - D) V ~ K^T diag(delta) V - sum_n w_n (K^T a_n)(V^T b_n)^T,

``O(N d r + n N (d + r))`` per query: the first term is the same ``C @ P`` GEMM as the factored
path (:class:`ropestep.kernel.PBlocks`), the second ``2 n`` matrix-vector products per query
batched as GEMMs.  Keys and values may be shifted by any constant first (the Laplacian
``diag(D 1) - D`` annihilates constants on both sides), so the callers pass them centred.

Node count (:func:`choose_nodes`): the smallest ``n`` whose error bound (:func:`gl_error_bound`)
is below ``tol`` at the chunk's score spread ``Delta = max s - min s``.  Only the identity score
family (``phi = id``) is supported; transformed scores (soft-cap) raise ``NotImplementedError``.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from .kernel import PBlocks, laplacian_apply, pairwise_weights

N_MAX = 512  # largest rule offered (spread ~ 700 needs ~ 270 nodes at 1e-15)


# ---------------------------------------------------------------------------------------------
# the rule and its error bound
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def gl_nodes(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Legendre nodes and weights on ``[0, 1]`` (float64, ``sum w = 1``, ``0 < t < 1``).

    numpy's ``leggauss`` roots are polished by Newton's method on the three-term recurrence of
    ``P_n`` in extended precision (``np.longdouble``: 64-bit mantissa on x86), and the weights
    ``2 / ((1 - x^2) P_n'(x)^2)`` and nodes ``(x + 1)/2`` formed there before the one rounding to
    float64: ``leggauss``'s own end weights are off by ~u/(1 - |x|) relative (1e-10 at n ~ 360),
    enough for the rule to miss its per-entry tolerance at large spreads.
    """
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"the rule needs n >= 1 nodes, got {n!r}")
    n = int(n)
    x0, _ = np.polynomial.legendre.leggauss(n)
    x = x0.astype(np.longdouble)

    def legendre(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p0, p1 = np.ones_like(x), x.copy()  # P_0, P_1
        for k in range(2, n + 1):
            p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
        dp = n * (x * p1 - p0) / (x * x - 1)  # P_n'
        return (p1, dp) if n > 1 else (x.copy(), np.ones_like(x))

    for _ in range(3):
        p, dp = legendre(x)
        x = x - p / dp
    _, dp = legendre(x)
    w = 1 / ((1 - x * x) * dp * dp)  # 2 / (...) on [-1, 1], halved for [0, 1]
    t, w = ((x + 1) / 2).astype(np.float64), w.astype(np.float64)
    t.setflags(write=False)
    w.setflags(write=False)
    return t, w


def gl_error_bound(n: int, spread: float) -> float:
    """Relative error bound of the ``n``-point rule for ``exp[z_j, z_k]``, ``|z_j - z_k| <= spread``.

    Gauss-Legendre on ``[0, 1]``: ``int f - Q_n f = f^(2n)(xi) (n!)^4 / ((2n+1) ((2n)!)^3)`` for
    some ``xi`` in ``(0, 1)``.  With ``exp[z_j, z_k] = e^{z_k} int_0^1 e^{t delta} dt``,
    ``delta = z_j - z_k``, and ``f(t) = e^{t delta}``: ``f^(2n)(xi) = delta^{2n} e^{xi delta}``,
    so the error is at most ``|delta|^{2n} e^{max(delta, 0)} C_n`` with
    ``C_n = (n!)^4 / ((2n+1)((2n)!)^3)``, against the integral ``(e^delta - 1)/delta``:

        |error| / integral <= |delta|^{2n+1} C_n / (1 - e^{-|delta|})

    (the same for both signs of ``delta``), increasing in ``|delta|``, hence bounded by its value
    at ``|delta| = spread``.  Computed in logs (``lgamma``) so it never overflows.
    Every weight is positive, so the rule's value is positive too.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    spread = float(spread)
    if not math.isfinite(spread) or spread < 0:
        raise ValueError(f"spread must be finite and >= 0, got {spread}")
    if spread == 0.0:
        return 0.0
    lg = ((2 * n + 1) * math.log(spread) + 4 * math.lgamma(n + 1) - math.log(2 * n + 1)
          - 3 * math.lgamma(2 * n + 1) - math.log(-math.expm1(-spread)))
    return math.exp(lg) if lg < 700 else math.inf


def choose_nodes(spread: float, tol: float, n_max: int = N_MAX) -> int:
    """Smallest ``n`` with :func:`gl_error_bound` ``(n, spread) <= tol``."""
    if not (tol > 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be finite and > 0, got {tol}")
    for n in range(1, n_max + 1):
        if gl_error_bound(n, spread) <= tol:
            return n
    raise ValueError(f"score spread {spread:.4g} needs more than {n_max} Gauss-Legendre nodes "
                     f"for tol={tol:.3g}; use the exact pairwise evaluation")


def default_tol(dtype: torch.dtype) -> float:
    """Per-entry kernel tolerance: 16 units of roundoff of the compute dtype."""
    return 16.0 * float(torch.finfo(dtype).eps)


# ---------------------------------------------------------------------------------------------
# one chunk of queries: K^T (diag(D 1) - D) V and beta^T (diag(D 1) - D) V
# ---------------------------------------------------------------------------------------------
def spread_of(zs: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest score spread ``max_j s_j - min_j s_j`` over the permitted sets of ``zs (G, Q, N)``."""
    return float((-zs.masked_fill(~mask, 0.0)).amax()) if zs.numel() else 0.0


def laplacian_terms_exact(zs: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          beta: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense reference: ``K^T L V`` ``(G, Q, d, r)`` and ``beta^T L V`` ``(G, Q, r)``.

    ``L = diag(D 1) - D`` with the kernel's ``D_jk = exp[z_j, z_k]`` on permitted pairs
    (:func:`ropestep.kernel.pairwise_weights`).  ``zs (G, Q, N)`` shifted scores (<= 0 where
    permitted), ``mask (Q, N)``, ``k (N, d)``, ``v (N, r)``, ``beta (G, Q, N)``.  ``O(N^2 r)`` per
    query.
    """
    D = pairwise_weights(zs, mask)  # (G, Q, N, N)
    lv = laplacian_apply(D, v)  # (G, Q, N, r)  L V
    del D
    t = (lv.transpose(-1, -2) @ k).transpose(-1, -2)  # (G, Q, d, r) = K^T L V
    b = None if beta is None else (beta[..., None, :] @ lv)[..., 0, :]
    return t, b


def laplacian_terms_lowrank(zs: torch.Tensor, mask: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, n: int, *, beta: torch.Tensor | None = None,
                            p: Any = None, node_block: int = 8
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Low-rank ``K^T L V`` and ``beta^T L V`` with the ``n``-point rule (same arguments as exact).

    ``p``: a :class:`ropestep.kernel.PBlocks` over ``k, v`` for the ``delta`` term's GEMM
    (built here when absent).  Nodes are processed ``node_block`` at a time, so memory does not
    grow with ``n``.
    """
    G, Q, N = zs.shape
    d, r = k.shape[-1], v.shape[-1]
    cd = zs.dtype
    tn, wn = gl_nodes(n)
    tn = torch.as_tensor(np.array(tn), dtype=cd, device=zs.device)
    wn = torch.as_tensor(np.array(wn), dtype=cd, device=zs.device)
    zm = zs.masked_fill(~mask, -math.inf)[..., None, :]  # (G, Q, 1, N); e^{t * -inf} = 0
    delta = torch.zeros(G, Q, 1, N, dtype=cd, device=zs.device)
    t2 = torch.zeros(G, Q, d, r, dtype=cd, device=zs.device)
    b2 = None if beta is None else torch.zeros(G, Q, r, dtype=cd, device=zs.device)
    for lo in range(0, n, node_block):
        tt, ww = tn[lo: lo + node_block], wn[lo: lo + node_block]
        A = torch.exp(tt[:, None] * zm)  # (G, Q, nb, N)  a_n = e^{t_n z}
        B = torch.exp((1.0 - tt)[:, None] * zm)  # b_n = e^{(1 - t_n) z}
        delta += (ww * B.sum(-1))[..., None, :] @ A  # sum_n w_n (b_n^T 1) a_n
        vb = B @ v  # (G, Q, nb, r)  V^T b_n
        del B
        ka = (A @ k) * ww[:, None]  # (G, Q, nb, d)  w_n K^T a_n
        t2 += ka.transpose(-1, -2) @ vb
        if beta is not None:
            ab = (A @ beta[..., None])[..., 0] * ww  # (G, Q, nb)  w_n beta^T a_n
            b2 += (ab[..., None, :] @ vb)[..., 0, :]
        del A
    delta = delta[..., 0, :]  # (G, Q, N)
    pb = p if p is not None else PBlocks(k, v, None, N)
    t1 = pb.matmul(delta).view(G, Q, d, r)  # K^T diag(delta) V
    t = t1 - t2
    b = None
    if beta is not None:
        b = ((delta * beta)[..., None, :] @ v)[..., 0, :] - b2
    return t, b


def pairwise_chunk(zs: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   beta: torch.Tensor | None = None, method: str = "lowrank",
                   tol: float | None = None, n: int | None = None, node_block: int = 8,
                   p: Any = None) -> tuple[torch.Tensor, torch.Tensor | None, int | None, float]:
    """``(K^T L V, beta^T L V, nodes, spread)`` for one chunk; divide by ``N_i Z-bar_i`` for ``T^pair``.

    ``method="lowrank"`` picks ``n`` by :func:`choose_nodes` at the chunk's largest spread
    (unless ``n`` is given); ``"exact"`` forms ``D``.
    """
    spread = spread_of(zs, mask)
    if method == "exact":
        t, b = laplacian_terms_exact(zs, mask, k, v, beta)
        return t, b, None, spread
    if method != "lowrank":
        raise ValueError(f"method must be 'lowrank' or 'exact', got {method!r}")
    if n is None:
        n = choose_nodes(spread, default_tol(zs.dtype) if tol is None else tol)
    t, b = laplacian_terms_lowrank(zs, mask, k, v, n, beta=beta, p=p, node_block=node_block)
    return t, b, n, spread
