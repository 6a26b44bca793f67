"""Batched all-query machinery: a whole causal layer (every query, every head) as matrix products.

docs/math.md section 3, cheap form.  For query ``i`` of head ``h`` with effective query ``q_i``
(rotated, normalised where the family says so, times the score scale), rotated keys ``k~_j`` and
values ``v_j`` of its KV head, and coefficients ``c_ij`` of the gauge,

    T_i  = sum_j c_ij (k~_j - k_o)^T (v_j - mu_i)                     (d x r)
    b_i  = sum_j c_ij (beta_ij - beta_o)(v_j - mu_i)                  (r, additive biases only)
    y_i  = mu_i + q_i T_i + b_i                                       (the identity, query space)
    dM_i = L_i T_i + e_{m+1} b_i^T,   L_i = W^_q R(p_i)^T * scale     ((m+1) x r, affine heads)

Evaluated for all queries at once, per key group (the query heads reading one KV head, which share
rotated keys unless RoPE bases differ per head) and per chunk of queries:

* values and keys are pre-centred by their global means ``v-bar``, ``k-bar`` (any constant shift
  can be pulled out of the sums exactly), which limits cancellation;
* the main term ``sum_j c_ij k^_j (v^_j)^T`` is ONE GEMM ``C @ P`` with ``C`` the
  ``(G*Qc, N)`` coefficient rows of the chunk (all ``G`` heads of the group stacked) and
  ``P_j = vec(k^_j v^_j^T)`` (``N x d*r``, shared by the group), chunked over keys when ``P`` does
  not fit the budget; the corrections ``-(C K^) (mu - v-bar)^T`` and ``(k-bar - k_o) w^T`` with
  ``w_i = sum_j c_ij (v_j - mu_i)`` are rank-one per query;
* causality: a chunk of queries only reads the key prefix up to its last query;
* ``dM_i = W^_q (R(p_i)^T T_i) * scale`` is one GEMM per head over the chunk
  (``(Qc*r, d) @ (d, m+1)``, into a reused buffer): ``T`` is rotated back, not ``L_i`` formed;
* queries whose prefix holds at most ``DIRECT_KEYS`` keys are centred per query instead (short
  prefixes: ``v_j - mu_i`` small while ``c`` may be large);
* the identity check ``y_i`` vs ``mu_i + q_i T_i + b_i`` is streamed: nothing of size
  ``Q x d x r`` is kept (per-head max/mean errors are returned).

Gauges: ``"original"`` (paper; ``c = phi1(s)/Z``, overflows when every score is below ~-700),
``"maxkey"`` (``c = phi1(s - s_max)/Z-bar``, the right gauge for float32/bf16), ``"pairwise"``
(``T^pair``, low-rank or exact: :mod:`ropestep.lowrank`).  Score families ``dot`` (affine: ``dM``
exists), ``qknorm`` and ``cosine`` (query space only), soft-cap transforms and ALiBi slopes are
supported in the first two gauges; the pairwise gauge takes every family but soft-cap.  Explicit
per-call bias arrays are not (use :func:`ropestep.fast.step`).  Self-attention over one causal
sequence only: queries are the sequence's tokens (or a subset), keys its prefix.  Precision:
float64, float32, and bfloat16/float16 inputs rounded once to that dtype and computed with
float32 accumulation (as :mod:`ropestep.fast`).

Memory: ``max_bytes`` bounds the projected layer plus ``P`` plus the work tensors of one chunk
(:func:`plan`, 10% headroom); a budget too small for one query raises ``ValueError``.  The slow explicit
reference beside this path is :func:`ropestep.direct.direct_query` (features ``a_ij`` in the augmented input
space, one query at a time); the independent oracle the tests compare with is :mod:`ropestep.exact`
(mpmath at raised precision).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from . import lowrank
from .direct import direct_query  # noqa: F401  (the paper-form reference beside this path)
from .kernel import (FLOAT_DTYPES, LATENT_FIELDS, PBlocks, augmented_weight,  # noqa: F401
                     clipped, compute_dtype, gauge_chunk, latent_qkv, qk_norm, rms_norm, softmax,
                     uniform_mean, unit_rows)
from .rope import apply_rope, query_cos_sin, rope_cos_sin
from .spec import HeadSpec, HeadWeights, _positions

GAUGES = ("original", "maxkey", "pairwise")
DEFAULT_MAX_BYTES = 1 << 30
DIRECT_KEYS = 64  # queries with at most this many permitted keys are centred per query
HEADROOM = 0.10  # share of max_bytes left to the allocator (freed blocks it keeps) and BLAS


def usable_bytes(max_bytes: int) -> int:
    """The part of ``max_bytes`` the plan fills: ``(1 - HEADROOM) max_bytes``.

    Measured on CPU (glibc malloc, MKL), the resident-set peak exceeds the live tensors of the
    plan by up to ~8%: blocks the allocator keeps after they are freed, GEMM packing buffers.
    """
    return int(max_bytes * (1.0 - HEADROOM))


# ---------------------------------------------------------------------------------------------
# projection (compact: keys and values per key group, not per query head)
# ---------------------------------------------------------------------------------------------
@dataclass
class Layer:
    """One causal layer projected into query space, in the compute dtype.

    ``k`` is stored once per *key group*: per KV head, or per query head when RoPE bases differ
    per head (then keys of one KV head are rotated differently for each query head).
    """

    spec: HeadSpec
    x: torch.Tensor  # (N, m) layer input (compute dtype)
    pos: torch.Tensor  # (N,) int64, non-decreasing
    q: torch.Tensor  # (H, N, d) effective queries (rotated, normalised, times scale)
    k: torch.Tensor  # (Hg, N, d) rotated keys per key group
    v: torch.Tensor  # (Hk, N, r) values per KV head
    groups: list[list[int]]  # query heads of each key group
    kv_of_group: list[int]  # KV head of each key group
    cos: torch.Tensor  # (Hb, N, d/2) the queries' RoPE tables at the positions (Hb = 1 or H;
    # a query temperature folded in: rope.query_cos_sin)
    sin: torch.Tensor
    lw: torch.Tensor | None  # (H, m+1, d) W^_q * scale (affine heads), so L_i = lw R(p_i)^T
    lwt: torch.Tensor | None  # (H, d, m+1) its transpose, contiguous
    slopes: torch.Tensor | None  # (H,) ALiBi slopes

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    @property
    def m(self) -> int:
        return int(self.x.shape[1])

    def group_of(self, h: int) -> int:
        for g, hs in enumerate(self.groups):
            if h in hs:
                return g
        raise IndexError(h)

    def lmap(self, i: int) -> torch.Tensor:
        """``L_i = W^_q R(p_i)^T * scale`` of every head, ``(H, m+1, d)`` (affine heads)."""
        if self.lw is None:
            raise ValueError(f"family {self.spec.family!r} is not affine in u: Delta M does not exist")
        c, s = self.cos[:, i, None, :], self.sin[:, i, None, :]
        return apply_rope(self.lw, c, s, self.spec.rope.layout)


def _as_tensor(a: Any, dtype: torch.dtype, device: Any) -> torch.Tensor | None:
    if a is None:
        return None
    t = a if torch.is_tensor(a) else torch.as_tensor(np.asarray(a))
    return t.to(device=device, dtype=dtype)


def project_layer(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any = None, *,
                  dtype: torch.dtype = torch.float64, device: Any = None) -> Layer:
    """Project, normalise and rotate one layer's queries/keys/values for causal self-attention.

    ``x (N, m)`` is the layer input; ``positions`` default to ``0..N-1`` and must be
    non-decreasing (the causal permitted set of query ``i`` is then the key prefix
    ``{j : p_j <= p_i}``).  Inputs are rounded once to ``dtype`` and computed in
    :func:`ropestep.fast.compute_dtype` (float32 for bf16/fp16).
    """
    if not isinstance(spec, HeadSpec):
        raise TypeError(f"spec must be a HeadSpec, got {type(spec).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}: use float64, float32, bfloat16 or float16")
    cd = compute_dtype(dtype)
    if not hasattr(x, "shape") or len(x.shape) != 2:
        raise ValueError(f"x must be a 2-D array (tokens, m), got shape {getattr(x, 'shape', None)}")
    N, m = int(x.shape[0]), int(x.shape[1])
    if N < 1:
        raise ValueError("empty sequence: x has no tokens")
    weights.check(spec, m)
    pos = np.arange(N) if positions is None else _positions(positions, "positions")
    if pos.shape != (N,):
        raise ValueError(f"positions must have shape ({N},), got {pos.shape}")
    if N > 1 and bool((np.diff(pos) < 0).any()):
        raise ValueError("positions must be non-decreasing (causal prefix structure)")
    if spec.rope.cos is not None:
        P = np.asarray(spec.rope.cos).shape[0]
        if pos.min() < 0 or pos.max() >= P:
            raise ValueError(f"positions must lie in [0, {P}) to index the RoPE tables, "
                             f"got [{pos.min()}, {pos.max()}]")

    def cast(a: Any) -> torch.Tensor | None:
        t = _as_tensor(a, dtype, device)
        return None if t is None else t.to(cd)

    xc = cast(x)
    if not bool(torch.isfinite(xc).all()):
        raise ValueError("x contains NaN or inf")
    H, Hk, d, r = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.r

    def proj(w: Any, b: Any, heads: int, dim: int) -> torch.Tensor:
        out = xc @ cast(w).reshape(m, heads * dim)
        if b is not None:
            out = out + cast(b).reshape(heads * dim)
        return out.reshape(N, heads, dim).transpose(0, 1).contiguous()  # (heads, N, dim)

    if spec.family == "latent":  # the absorbed form (kernel.latent_qkv); Hk = H
        q, k, v = latent_qkv(xc, {f: cast(getattr(weights, f)) for f in LATENT_FIELDS}, H,
                             spec.latent.kv_eps, spec.latent.q_eps)
    else:
        q = clipped(proj(weights.w_q, weights.b_q, H, d), spec.clip)
        k = clipped(proj(weights.w_k, weights.b_k, Hk, d), spec.clip)
        v = clipped(proj(weights.w_v, weights.b_v, Hk, r), spec.clip)
    after = spec.norm_after_rope  # the norms act on the rotated vectors (Hunyuan)
    if spec.family == "qknorm" and not after:
        q = qk_norm(q, cast(weights.q_norm), spec.norm_eps, spec.norm_scope, spec.norm_kind,
                    cast(weights.q_norm_bias))
        k = qk_norm(k, cast(weights.k_norm), spec.norm_eps, spec.norm_scope, spec.norm_kind,
                    cast(weights.k_norm_bias))
    elif spec.family == "cosine":
        q, k = unit_rows(q, "query"), unit_rows(k, "key")
    pt = torch.as_tensor(pos, device=xc.device)
    ck, sk = rope_cos_sin(spec, pt, cd, xc.device)  # (Hb, N, d/2): the keys' tables
    # the queries' (a query temperature folded in; Layer.cos/sin are the queries' tables)
    cos, sin = query_cos_sin(spec, pt, cd, xc.device)
    q = apply_rope(q, cos, sin, spec.rope.layout)
    if ck.shape[0] == 1:
        k = apply_rope(k, ck, sk, spec.rope.layout)
        groups = [list(range(g * spec.group, (g + 1) * spec.group)) for g in range(Hk)]
        kv_of = list(range(Hk))
    else:  # per-head bases: one key group per query head
        k = apply_rope(k[torch.arange(H) // spec.group], ck, sk, spec.rope.layout)
        groups = [[h] for h in range(H)]
        kv_of = [h // spec.group for h in range(H)]
    if after:
        q = rms_norm(q, cast(weights.q_norm), spec.norm_eps)
        k = rms_norm(k, cast(weights.k_norm), spec.norm_eps)
    scale = torch.tensor([spec.score_scale(h) for h in range(H)], dtype=cd, device=xc.device)
    q = q * scale[:, None, None]
    lw = lwt = None
    if spec.affine:
        wq = augmented_weight(cast(weights.w_q), cast(weights.b_q))  # (m+1, H, d)
        lw = (wq.permute(1, 0, 2) * scale[:, None, None]).contiguous()
        lwt = lw.transpose(-1, -2).contiguous()
    slopes = None
    if spec.alibi_slopes is not None:
        slopes = torch.tensor(spec.alibi_slopes, dtype=cd, device=xc.device)
    return Layer(spec, xc, pt, q, k, v, groups, kv_of, cos, sin, lw, lwt, slopes)


# ---------------------------------------------------------------------------------------------
# memory plan
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Chunk sizes chosen under a byte budget, and the byte counts they were derived from."""

    query_chunk: int  # queries per chunk
    key_block: int  # keys per block of P (== N when P is kept whole per key group)
    fixed_bytes: int  # projected layer
    p_bytes: int  # P (or one block of it)
    per_query_bytes: int  # work per query of a chunk, at the full key count
    max_bytes: int

    @property
    def bytes(self) -> int:
        """Planned peak: fixed + P + one chunk."""
        return self.fixed_bytes + self.p_bytes + self.query_chunk * self.per_query_bytes


def _elt(dtype: torch.dtype) -> int:
    return torch.finfo(compute_dtype(dtype)).bits // 8


def fixed_bytes(spec: HeadSpec, N: int, m: int, dtype: torch.dtype) -> int:
    """Bytes of the projected layer (:class:`Layer`) and the largest projection temporary."""
    H, Hk, d, r = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.r
    Hg = H if spec.rope.per_head else Hk
    Hb = H if spec.rope.per_head else 1
    e = _elt(dtype)
    words = (N * m  # x in the compute dtype
             + 3 * H * N * d  # q, and two RoPE temporaries
             + 3 * Hg * N * d  # keys, centred keys, one temporary
             + 3 * Hk * N * r  # values, centred values, one temporary
             + 2 * Hb * N * d  # cos, sin (d/2 each) and one temporary
             + (2 * H * (m + 1) * d if spec.affine else 0))
    return int(words * e + 8 * N)


def per_query_bytes(spec: HeadSpec, n_keys: int, m: int, dtype: torch.dtype, *, delta_m: bool,
                    gauge: str = "original", pairwise: str = "lowrank", node_block: int = 8,
                    heads_per_group: int | None = None, outputs: Sequence[str] = ()) -> int:
    """Work bytes per query of a chunk reading ``n_keys`` keys (one key group at a time).

    Counted generously: ~12 score-sized temporaries (scores, transform, exponentials, phi_1
    internals, coefficients, the coefficient block handed to the GEMM), T and its rotated copy,
    ``Delta M`` when materialised, and the gauge's extra terms.
    """
    d, r = spec.head_dim, spec.r
    G = heads_per_group or (1 if spec.rope.per_head else spec.group)
    e = _elt(dtype)
    n = n_keys
    words = 12 * n
    if spec.alibi_slopes is not None:
        words += 3 * n
    if spec.softcap is not None:
        words += 3 * n
    # values centred per query: up to DIRECT_KEYS keys (short prefixes), every key with sinks
    # (the sink's key is outside the shared P: kernel.gauge_chunk)
    words += 3 * d * r + 4 * (d + r) + 16 + (
        n + 1 if spec.sinks is not None else min(n, DIRECT_KEYS)) * (d + r)
    if delta_m and spec.affine:
        words += (m + 1) * r + 2 * d * r
    words += len(outputs) * n + (n * (r + d) if "kappa" in outputs else 0)  # kept s/c; kappa's terms
    if gauge == "pairwise":
        if pairwise == "exact":
            words += 5 * n * n + 2 * n * r
        else:
            words += 4 * node_block * n + 2 * node_block * (d + r) + 2 * n
    return int(G * words * e + 2 * n)  # + the boolean and float masks' share


def plan(spec: HeadSpec, N: int, m: int, dtype: torch.dtype, max_bytes: int, *,
         n_queries: int | None = None, delta_m: bool = False, gauge: str = "original",
         pairwise: str = "lowrank", chunk: int | None = None, node_block: int = 8,
         heads_per_group: int | None = None, outputs: Sequence[str] = ()) -> Plan:
    """Choose the query chunk and the key block of ``P`` so that the planned peak fits.

    Peak = :func:`fixed_bytes` + ``P`` (``N x d*r`` per key group, or a block of ``key_block``
    keys) + ``query_chunk`` x :func:`per_query_bytes`.  ``P`` is kept whole when that still leaves
    room for a useful chunk; otherwise keys are blocked.  The plan fills
    :func:`usable_bytes` (``HEADROOM`` = 10% of ``max_bytes`` is left to the allocator and
    library buffers).  ``chunk`` fixes the query chunk (it is still checked against the budget).
    Raises ``ValueError`` when one query does not fit.
    """
    if not isinstance(max_bytes, (int, np.integer)) or isinstance(max_bytes, bool):
        raise TypeError(f"max_bytes must be an int, got {type(max_bytes).__name__}")
    Q = N if n_queries is None else int(n_queries)
    d, r = spec.head_dim, spec.r
    e = _elt(dtype)
    fx = fixed_bytes(spec, N, m, dtype)
    pq = per_query_bytes(spec, N, m, dtype, delta_m=delta_m, gauge=gauge, pairwise=pairwise,
                         node_block=node_block, heads_per_group=heads_per_group, outputs=outputs)
    row = d * r * e  # one key's row of P
    need = fx + row + pq
    usable = usable_bytes(int(max_bytes))
    if usable < need:
        raise ValueError(
            f"max_bytes={max_bytes} is too small for one query: the projected layer needs "
            f"{fx} bytes and one query over {N} keys needs {pq + row} more "
            f"(at least {math.ceil(need / (1 - HEADROOM))} bytes with the "
            f"{HEADROOM:.0%} headroom, dtype {dtype})")
    avail = usable - fx
    # large chunks feed the GEMM; beyond ~N/16 queries the causal waste inside a chunk grows
    if chunk is not None:
        chunk = min(int(chunk), Q)  # a chunk never needs more queries than there are
    cap = Q if chunk is not None else min(Q, max(32, -(-N // 16)))
    want = min(cap, chunk) if chunk is not None else cap
    full_p = N * row
    if avail - full_p >= pq * min(want, 64):  # P whole, chunk from the rest
        qc = min(want, (avail - full_p) // pq)
        kb, pb = N, full_p
    else:  # block the keys: at most half of what is left goes to P, and one query always fits
        kb = int(max(1, min(N, min(avail // 2, avail - pq) // row)))
        pb = kb * row
        qc = min(want, (avail - pb) // pq)
    qc = int(max(1, qc))
    if chunk is not None and qc < chunk:
        raise ValueError(f"chunk={chunk} queries do not fit max_bytes={max_bytes} "
                         f"(at most {qc} do)")
    return Plan(qc, kb, fx, pb, pq, int(max_bytes))


# ---------------------------------------------------------------------------------------------
# the streamed all-query evaluation
# ---------------------------------------------------------------------------------------------
@dataclass
class Chunk:
    """Results of one key group on one chunk of queries.  All in the compute dtype.

    Centred quantities are relative to the group's global value mean ``vbar``
    (``y = vbar + y_c``); ``t``/``b``/``delta_m`` are gauge objects as in :mod:`ropestep.fast`.
    A chunk is valid until the next one is requested: :func:`stream` then releases its ``t``
    and ``delta_m`` (copy out what you keep), so two chunks never hold memory at once.
    """

    heads: list[int]  # G query heads
    queries: torch.Tensor  # (Qc,) query indices
    vbar: torch.Tensor  # (r,)
    y_c: torch.Tensor  # (G, Qc, r) softmax output minus vbar
    mu_c: torch.Tensor  # (Qc, r) uniform mean minus vbar
    readout_c: torch.Tensor  # (G, Qc, r) mu + q T + b, minus vbar
    t: torch.Tensor  # (G, Qc, d, r)
    b: torch.Tensor | None  # (G, Qc, r)
    delta_m: torch.Tensor | None = None  # (G, Qc, m+1, r)
    nodes: int | None = None  # pairwise low rank: quadrature nodes used
    spread: float | None = None  # pairwise: max score spread in the chunk
    plan: Plan | None = None  # the memory plan the chunk was computed under
    extra: dict = field(default_factory=dict)  # outputs asked for: "s", "c" (G, Qc, n), "kappa" (G, Qc)

    def release(self) -> None:
        """Drop the large per-query tensors (``t``, ``delta_m``, extras); :func:`stream` calls it."""
        self.t = None  # type: ignore[assignment]
        self.delta_m = None
        self.extra = {}

    @property
    def y(self) -> torch.Tensor:
        return self.y_c + self.vbar

    @property
    def mu(self) -> torch.Tensor:
        return self.mu_c + self.vbar

    @property
    def readout(self) -> torch.Tensor:
        return self.readout_c + self.vbar


def _rot_back(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """``(R(p_i)^T T_i)^T`` for ``t (G, Qc, d, r)``: rows of ``T^T`` times ``R = R(-p)^T``."""
    return apply_rope(t.transpose(-1, -2), cos[..., None, :], -sin[..., None, :], layout)


def stream(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any = None, *,
           gauge: str = "original", dtype: torch.dtype = torch.float64, device: Any = None,
           max_bytes: int = DEFAULT_MAX_BYTES, delta_m: bool = False,
           queries: Sequence[int] | None = None, heads: Sequence[int] | None = None,
           chunk: int | None = None, pairwise: str = "lowrank", tol: float | None = None,
           node_block: int = 8, direct_keys: int = DIRECT_KEYS,
           layer: Layer | None = None, timers: dict | None = None,
           outputs: Sequence[str] = ()) -> Iterator[Chunk]:
    """Yield :class:`Chunk` results covering every (head, query) of a causal layer.

    ``queries``/``heads`` restrict the work to sorted subsets (default all).  ``delta_m=True``
    also materialises ``Delta M_i`` per chunk (affine heads).  ``pairwise``: ``"lowrank"``
    (Gauss-Legendre, ``tol`` relative per kernel entry) or ``"exact"`` (dense ``N x N`` per query).
    Queries whose permitted prefix holds at most ``direct_keys`` keys are evaluated with values
    centred per query, ``(c_i * (K~ - k_o))^T (V - mu_i)`` (batched, no shared ``P``): with a
    short prefix ``v_j - mu_i`` is much smaller than ``v_j - v-bar``, and in the original gauge
    ``c`` can be large (``~e^{-s}`` when every score is negative), so the shared-``P`` form would
    lose digits there.  A precomputed :class:`Layer` may be passed as ``layer`` (its spec must be
    ``spec``).  ``timers``: a dict that receives the seconds spent forming ``Delta M`` (key
    ``"delta_m_seconds"``; CUDA is synchronised around it).
    """
    if gauge not in GAUGES:
        raise ValueError(f"unknown gauge {gauge!r}: use one of {GAUGES}")
    outputs = tuple(outputs)
    if not set(outputs) <= {"s", "c", "kappa"}:
        raise ValueError(f"outputs must be among 's', 'c', 'kappa', got {outputs}")
    if gauge == "pairwise" and set(outputs) & {"c", "kappa"}:
        raise ValueError("the pairwise gauge has no per-key coefficients c_ij or kappa on the "
                         "scale path (use ropestep.fast.step(gauge='pairwise'))")
    if pairwise not in ("lowrank", "exact"):
        raise ValueError(f"pairwise must be 'lowrank' or 'exact', got {pairwise!r}")
    if delta_m and not spec.affine:
        raise ValueError(f"family {spec.family!r} is not affine in u: Delta M is undefined "
                         "(use the query-space readout y = mu + q T + b)")
    if gauge == "pairwise" and spec.softcap is not None:
        raise NotImplementedError(
            "pairwise gauge on the scale path: transformed scores (softcap) are not supported; "
            "the low-rank kernel assumes phi = id (use ropestep.fast.step(gauge='pairwise'))")
    L = layer if layer is not None else project_layer(spec, weights, x, positions, dtype=dtype,
                                                      device=device)
    N, m = L.n, L.m
    H = spec.n_heads
    qsel = torch.arange(N, device=L.q.device) if queries is None else \
        torch.as_tensor(np.asarray(queries, dtype=np.int64), device=L.q.device)
    if qsel.ndim != 1 or qsel.numel() < 1:
        raise ValueError("queries must be a non-empty 1-D list of indices")
    if bool((qsel < 0).any()) or bool((qsel >= N).any()):
        raise ValueError(f"query indices must lie in [0, {N})")
    if qsel.numel() > 1 and bool((torch.diff(qsel) <= 0).any()):
        raise ValueError("query indices must be strictly increasing")
    hsel = list(range(H)) if heads is None else sorted(set(int(h) for h in heads))
    if any(h < 0 or h >= H for h in hsel) or not hsel:
        raise ValueError(f"heads must be a non-empty subset of 0..{H - 1}")
    gmax = max(len([h for h in hs if h in hsel]) for hs in L.groups)
    pl = plan(spec, N, m, L.q.dtype, max_bytes, n_queries=int(qsel.numel()), delta_m=delta_m,
              gauge=gauge, pairwise=pairwise, chunk=chunk, node_block=node_block,
              heads_per_group=gmax, outputs=outputs)
    if gauge == "pairwise":
        if tol is None:
            tol = lowrank.default_tol(L.q.dtype)
    cd = L.q.dtype
    d, r = spec.head_dim, spec.r
    # chunk bounds: queries whose prefix holds <= direct_keys keys first (centred per query)
    npre = torch.searchsorted(L.pos, L.pos[qsel], right=True)
    qd = int((npre <= direct_keys).sum()) if gauge != "pairwise" else 0
    bounds = [(lo, min(qd, lo + pl.query_chunk), True) for lo in range(0, qd, pl.query_chunk)]
    bounds += [(lo, min(int(qsel.numel()), lo + pl.query_chunk), False)
               for lo in range(qd, int(qsel.numel()), pl.query_chunk)]
    bufs: dict = {}  # work buffers reused across chunks
    for g, hs_all in enumerate(L.groups):
        hs = [h for h in hs_all if h in hsel]
        if not hs:
            continue
        kv = L.kv_of_group[g]
        k, v = L.k[g], L.v[kv]  # (N, d), (N, r)
        kbar, vbar = k.mean(0), v.mean(0)
        kh, vh = k - kbar, v - vbar  # centred by global means
        pfull = None
        if pl.key_block >= N:
            pfull = (kh[:, :, None] * vh[:, None, :]).reshape(N, d * r)  # P_j = vec(k^ v^^T)
        hidx = torch.tensor(hs, device=L.q.device)
        qg_all = L.q[hidx]  # (G, N, d)
        for lo, hi, direct in bounds:
            qi = qsel[lo:hi]
            n_hi = int(torch.searchsorted(L.pos, L.pos[qi[-1]], right=True))
            ch = _chunk(L, hs, hidx, qi, n_hi, qg_all[:, qi], k[:n_hi], kh[:n_hi], vh[:n_hi],
                        kbar, vbar, pfull, pl.key_block, gauge, delta_m, pairwise, tol,
                        node_block, cd, d, r, direct, timers, bufs, outputs)
            ch.plan = pl
            yield ch
            ch.release()  # the consumer is done with it: free T and Delta M before the next
            del ch


def _chunk(L: Layer, hs: list[int], hidx: torch.Tensor, qi: torch.Tensor, n_hi: int,
           qg: torch.Tensor, k: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
           kbar: torch.Tensor,
           vbar: torch.Tensor, pfull: torch.Tensor | None, key_block: int, gauge: str,
           delta_m: bool, pairwise: str, tol: float | None, node_block: int,
           cd: torch.dtype, d: int, r: int, direct: bool, timers: dict | None,
           bufs: dict, outputs: tuple = ()) -> Chunk:
    """One key group on one chunk of queries: the kernel (or the low-rank pairwise kernel)."""
    spec = L.spec
    mask = causal_chunk_mask(L.pos, qi, n_hi, spec.window, spec.chunk)  # (Qc, n) permitted sets
    beta = None
    if L.slopes is not None:
        dp = (L.pos[qi][:, None] - L.pos[None, :n_hi]).to(cd)
        beta = -L.slopes[hidx][:, None, None] * dp[None]  # (G, Qc, n)
    nodes = spread = None
    if gauge == "pairwise":
        s = qg @ k.T  # (G, Qc, n) raw scores q_i . k~_j
        if beta is not None:
            s = s + beta
        sm = softmax(s, mask, None)
        y_c = (sm.e @ vh) / sm.zbar  # (G, Qc, r)  y - vbar
        mu_c = uniform_mean(vh[None], mask)[0]  # (Qc, r)  mu - vbar
        t, b, nodes, spread = lowrank.pairwise_chunk(
            sm.z - sm.zmax, mask, kh, vh, beta=beta, method=pairwise, tol=tol,
            node_block=node_block, p=PBlocks(kh, vh, pfull, key_block))
        den = mask.sum(-1).to(cd)[None, :, None] * sm.zbar  # (G, Qc, 1): N_i Z-bar_i
        t = t / den[..., None]
        b = None if b is None else b / den
        readout_c = mu_c[None] + (qg[:, :, None] @ t)[:, :, 0]
        if b is not None:
            readout_c = readout_c + b
        if not bool(torch.isfinite(readout_c).all()):
            raise FloatingPointError(f"pairwise gauge: the readout is not finite in {cd} "
                                     f"(heads {hs}, queries {int(qi[0])}..{int(qi[-1])})")
    else:
        # short prefixes: values centred per query; long ones: one GEMM over the shared P
        v = L.v[L.kv_of_group[L.group_of(hs[0])], :n_hi]  # (n, r) uncentred values
        sink = None if spec.sinks is None else torch.tensor(
            [spec.sinks[h] for h in hs], dtype=cd, device=qg.device)  # one more key (kernel)
        out = gauge_chunk(qg, k[None], v[None], mask, gauge=gauge, beta=beta,
                          softcap=spec.softcap, kbar=kbar[None, None], vbar=vbar[None, None],
                          pblocks=None if direct or sink is not None else
                          PBlocks(kh, vh, pfull, key_block),
                          coeffs="c" in outputs, kappa="kappa" in outputs,
                          query_offset=int(qi[0]), heads=hs, sink=sink)
        y_c, mu_c, readout_c, t, b = (out["y_c"], out["mu_c"][0], out["readout_c"], out["t"],
                                      out.get("b"))
        s = out["s"]
    dm = None
    if delta_m:
        if timers is not None:
            _sync(t.device)
            t0 = time.perf_counter()
        dm = _delta_m(L, hidx, qi, t, b, cd, bufs)
        if timers is not None:
            _sync(t.device)
            timers["delta_m_seconds"] = timers.get("delta_m_seconds", 0.0) + \
                time.perf_counter() - t0
    extra = {key: (s if key == "s" else out[key]) for key in outputs}
    return Chunk(hs, qi, vbar, y_c, mu_c, readout_c, t, b, dm, nodes, spread, extra=extra)


def causal_chunk_mask(pos: torch.Tensor, qi: torch.Tensor, n: int,
                      window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """``mask[i, j] = p_j <= p_{q_i}`` for the chunk's queries ``qi`` over keys ``0..n-1``: the
    causal bank as the model computes it (the query's own key included); with a sliding
    ``window`` also ``p_{q_i} - p_j < window``, with chunked attention (``chunk``, the head's
    blocks of positions -- not the streamed chunk of queries) also ``p_{q_i} // chunk == p_j //
    chunk``."""
    m = pos[None, :n] <= pos[qi][:, None]
    if window is not None:
        m = m & ((pos[qi][:, None] - pos[None, :n]) < int(window))
    if chunk is not None:
        m = m & ((pos[qi][:, None] // int(chunk)) == (pos[None, :n] // int(chunk)))
    return m


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _delta_m(L: Layer, hidx: torch.Tensor, qi: torch.Tensor, t: torch.Tensor,
             b: torch.Tensor | None, cd: torch.dtype, bufs: dict) -> torch.Tensor:
    """``Delta M_i = W^_q R(p_i)^T T_i * scale (+ e_{m+1} b_i^T)``: one GEMM per head.

    Computed transposed, ``(R^T T)^T (W^_q scale)^T`` = ``(Qc*r, d) @ (d, m+1)`` per head (plain
    ``mm`` calls: faster than ``bmm`` on CPU), and returned as a ``(G, Qc, m+1, r)`` view of
    a buffer reused by every chunk of the stream (fresh pages for each chunk would cost as much
    as the product: the kernel zeroes them on first touch).
    """
    G, Qc, d, r = t.shape
    cos, sin = L.cos[:, qi], L.sin[:, qi]  # (Hb, Qc, d/2)
    if cos.shape[0] > 1:
        cos, sin = cos[hidx], sin[hidx]
    tr = _rot_back(t, cos, sin, L.spec.rope.layout).reshape(G, Qc * r, d)  # rows of (R^T T)^T
    need = G * Qc * r * (L.m + 1)
    buf = bufs.get("delta_m")
    if buf is None or buf.numel() < need:
        buf = bufs["delta_m"] = torch.empty(need, dtype=cd, device=t.device)
    out = buf[:need].view(G, Qc * r, L.m + 1)
    for a, h in enumerate(hidx.tolist()):
        torch.mm(tr[a], L.lwt[h], out=out[a])
    dm = out.view(G, Qc, r, L.m + 1).transpose(-1, -2)  # (G, Qc, m+1, r)
    if b is not None:
        dm[:, :, -1] += b
    return dm


# ---------------------------------------------------------------------------------------------
# consumers: identity check (streamed), materialisation (small layers)
# ---------------------------------------------------------------------------------------------
@dataclass
class LayerErrors:
    """Per-head identity errors ``|y_i - (mu_i + q_i T_i + b_i)|`` over all checked queries."""

    max_abs: np.ndarray  # (H,)
    mean_abs: np.ndarray  # (H,) mean over queries and value dims
    max_rel: np.ndarray  # (H,) max_abs / max|y|
    max_rel_dev: np.ndarray  # (H,) max_abs / max|y - mu|
    n_queries: int
    plan: Plan
    extras: dict = field(default_factory=dict)

    checked: np.ndarray | None = None  # (H,) bool: heads that were evaluated (others are NaN)

    @property
    def finite(self) -> bool:
        """False when any error of a checked head is NaN or inf (a failure, never a pass)."""
        sel = np.ones(len(self.max_abs), bool) if self.checked is None else self.checked
        return bool(np.isfinite(self.max_abs[sel]).all() and np.isfinite(self.max_rel[sel]).all())

    def as_dict(self) -> dict:
        return {"max_abs": self.max_abs.tolist(), "mean_abs": self.mean_abs.tolist(),
                "max_rel": self.max_rel.tolist(), "max_rel_dev": self.max_rel_dev.tolist(),
                "n_queries": self.n_queries}


def identity_check(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any = None, *,
                   on_chunk: Callable[[Chunk], None] | None = None, **kw: Any) -> LayerErrors:
    """Stream :func:`stream` and reduce the identity errors per head (nothing per query kept).

    ``on_chunk`` is called with every :class:`Chunk` (e.g. to copy out sampled ``Delta M_i``).
    Keyword arguments go to :func:`stream`.
    """
    H = spec.n_heads
    mx, sm, cnt, ymax, dmax = (np.zeros(H) for _ in range(5))
    pl = None
    nodes = []
    for ch in stream(spec, weights, x, positions, **kw):
        pl = ch.plan
        err = (ch.y_c - ch.readout_c).abs().to(torch.float64)  # (G, Qc, r)
        ya = ch.y.abs().to(torch.float64)
        dv = (ch.y_c - ch.mu_c[None]).abs().to(torch.float64)
        for a, h in enumerate(ch.heads):  # np.maximum and tensor max propagate NaN
            mx[h] = np.maximum(mx[h], float(err[a].max()))
            sm[h] += float(err[a].sum())
            cnt[h] += err[a].numel()
            ymax[h] = np.maximum(ymax[h], float(ya[a].max()))
            dmax[h] = np.maximum(dmax[h], float(dv[a].max()))
        if ch.nodes is not None:
            nodes.append(ch.nodes)
        if on_chunk is not None:
            on_chunk(ch)
    sel = cnt > 0
    nq = int(x.shape[0]) if kw.get("queries") is None else len(kw["queries"])
    mean = np.where(sel, sm / np.maximum(cnt, 1), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(ymax > 0, mx / ymax, mx)
        rdev = np.where(dmax > 0, mx / dmax, mx)
    nan = np.nan
    out = LayerErrors(np.where(sel, mx, nan), mean, np.where(sel, rel, nan),
                      np.where(sel, rdev, nan), nq, pl, checked=sel)
    if nodes:
        out.extras["nodes_max"] = max(nodes)
    return out


def materialise(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any = None,
                **kw: Any) -> dict[str, torch.Tensor]:
    """Every per-query object of the selected heads/queries as full tensors (small layers).

    Returns ``y, mu, readout (H, Q, r)``, ``t (H, Q, d, r)``, ``b (H, Q, r)`` when biases
    exist, and ``delta_m (H, Q, m+1, r)`` with ``delta_m=True``; unselected heads/queries are NaN
    (for ``queries``, Q is the number selected, in order).  Queries are still computed in chunks
    under ``max_bytes``; the result itself is not counted.
    """
    H = spec.n_heads
    qs = kw.get("queries")
    Q = int(x.shape[0]) if qs is None else len(qs)
    qpos = None if qs is None else {int(q): n for n, q in enumerate(qs)}
    out: dict[str, torch.Tensor] = {}

    def put(name: str, val: torch.Tensor, heads: list[int], rows: torch.Tensor) -> None:
        if name not in out:
            out[name] = torch.full((H, Q, *val.shape[2:]), math.nan, dtype=val.dtype)
        idx = rows if qpos is None else torch.tensor([qpos[int(i)] for i in rows])
        out[name][torch.tensor(heads)[:, None], idx[None, :]] = val.detach().cpu()

    for ch in stream(spec, weights, x, positions, **kw):
        rows = ch.queries.cpu()
        put("y", ch.y, ch.heads, rows)
        put("mu", ch.mu[None].expand(len(ch.heads), *ch.mu.shape), ch.heads, rows)
        put("readout", ch.readout, ch.heads, rows)
        put("t", ch.t, ch.heads, rows)
        if ch.b is not None:
            put("b", ch.b, ch.heads, rows)
        if ch.delta_m is not None:
            put("delta_m", ch.delta_m, ch.heads, rows)
    return out


def pairwise_layer(spec: Any, weights: Any, x: Any, positions: Any = None, *,
                   method: str = "lowrank", tol: float | None = None,
                   heads: Sequence[int] | None = None, queries: Sequence[int] | None = None,
                   **kw: Any) -> dict[str, torch.Tensor]:
    """``T^pair`` (and ``y``, ``mu``, readout, ``b``) of a causal layer, every (head, query).

    A thin wrapper of :func:`materialise` with ``gauge="pairwise"``; keyword
    arguments (``dtype``, ``max_bytes``, ``delta_m``, ...) pass through.  Soft-capped heads raise
    ``NotImplementedError``.
    """
    if getattr(spec, "softcap", None) is not None:
        raise NotImplementedError(
            "low-rank pairwise gauge: transformed scores (softcap) are not supported -- the "
            "quadrature is for exp[s_j, s_k] with phi = id; use ropestep.fast.step(gauge='pairwise')")
    return materialise(spec, weights, x, positions, gauge="pairwise", pairwise=method, tol=tol,
                       heads=heads, queries=queries, **kw)


# ---------------------------------------------------------------------------------------------
# analytic FLOP counts (matrix products over the causal triangle)
# ---------------------------------------------------------------------------------------------
def flops_factored(spec: HeadSpec, N: int, m: int, *, delta_m: bool = True,
                   n_queries: int | None = None) -> int:
    """FLOPs of the factored path's matrix products, counted analytically.

    Per head and query ``i`` with ``N_i`` permitted keys (causal: ``N_i = i + 1``):
    scores ``2 N_i d``, softmax output and mean ``4 N_i r``, ``C @ P`` ``2 N_i d r``, ``C K``
    and ``C V`` ``2 N_i (d + r)``, readout ``2 d r``, and with ``delta_m`` ``2 (m+1) d r``;
    per key group ``N d r`` for ``P``.  Elementwise work (exp, phi_1, masks) and the masked zeros
    inside a chunk are not counted.  ``n_queries`` (default N) counts the last queries only.
    """
    H, d, r = spec.n_heads, spec.head_dim, spec.r
    Q = N if n_queries is None else n_queries
    tri = sum(range(N - Q + 1, N + 1))  # sum of N_i over the counted queries
    per_key = 2 * d + 4 * r + 2 * d * r + 2 * (d + r)
    per_q = 2 * d * r + (2 * (m + 1) * d * r if delta_m else 0)
    Hg = H if spec.rope.per_head else spec.n_kv_heads
    return int(H * (tri * per_key + Q * per_q) + Hg * N * d * r)


def flops_direct(spec: HeadSpec, n_keys: int, m: int) -> int:
    """FLOPs of :func:`direct_query` for one query with ``n_keys`` keys, all heads.

    Features ``2 N (m+1) d``, scores ``2 N (m+1)``, ``Delta M`` ``2 N (m+1) r``, output and
    mean ``3 N r``, plus ``L_i`` (``~6 (m+1) d``, RoPE on W).
    """
    H, d, r = spec.n_heads, spec.head_dim, spec.r
    n, D = n_keys, m + 1
    return int(H * (2 * n * D * d + 2 * n * D + 2 * n * D * r + 3 * n * r + 6 * D * d))
