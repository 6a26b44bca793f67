"""Fast layer: batched PyTorch evaluation of every object of the identity.

Works in float64, float32 and bfloat16/float16 (low-precision inputs are upcast and computed
with float32 accumulation), on CPU or CUDA, batched over heads and queries, with no Python
loop over keys.  Memory is bounded by chunking queries under a byte budget.

Everything is written in *query space* first (docs/math.md section 3, cheap form): with the
effective query ``q_i`` (rotated, normalised where the family says so, times the score scale)
and rotated keys ``k~_j``, the raw score is ``s_ij = q_i . k~_j + beta_ij`` and, in a gauge
with key offset ``k_o`` and bias offset ``beta_o``,

    T_i = sum_j c_ij (k~_j - k_o)^T (v_j - mu_i)        (d x r)
    b_i = sum_j c_ij (beta_ij - beta_o)(v_j - mu_i)     (r)
    y_i = mu_i + q_i T_i + b_i                          (readout)

For affine heads (family ``"dot"``) ``q_i = u_i^T L_i`` with ``L_i = W^_q R(p_i)^T * scale`` and
``Delta M_i = L_i T_i + e_{m+1} b_i^T`` (minus ``g w_i^T`` in a free gauge ``g``).
Every coefficient, ``T``, ``b``, readout and condition number comes from the one kernel
(:func:`ropestep.kernel.gauge_chunk`); this module adds the per-query API around it: projection
of arbitrary query/bank pairs, ``Delta M``, the gradient step and descent (in input space for
affine heads, in query space -- ``query_delta_m``, ``query_descent`` -- for every family, the
cosine family included: docs/math.md section 11), frozen reuse and the prefix/full relation.
The slow, explicit references with the same definitions are :mod:`ropestep.exact` (mpmath) and
:mod:`ropestep.direct` (the paper's form in torch).
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from .kernel import (FLOAT_DTYPES, LOW_PRECISION, augment, augmented_weight, compute_dtype,  # noqa: F401
                     exp_dd, ftensor, gauge_chunk, latent_qkv, LATENT_FIELDS, phi1, qk_norm,
                     rms_norm, scaled_phi1, transform, transform_dd, uniform_mean, unit_rows,
                     with_sink, clipped)
from .rope import (apply_rope, query_cos_sin, rope_cos_sin, rope_derivative, rope_finite_difference,  # noqa: F401
                   rope_frequencies, rope_generator, rope_phi1, rope_rotation)
from .spec import HeadSpec, HeadWeights, check_inputs, resolve_mask, _positions

# ---------------------------------------------------------------------------------------------
# projections
# ---------------------------------------------------------------------------------------------
def _t(a: Any, dtype: torch.dtype, device: Any) -> torch.Tensor | None:
    if a is None:
        return None
    if not torch.is_tensor(a):
        a = torch.as_tensor(np.asarray(a))
    return a.to(device=device, dtype=dtype)


@dataclass
class Projected:
    """Query-space quantities of one layer (all heads), in the compute dtype."""

    spec: HeadSpec
    u_q: torch.Tensor  # (Q, m+1)
    q: torch.Tensor  # (H, Q, d) effective query: rotated (normalised) query times the scale
    k: torch.Tensor  # (H, N, d) rotated (normalised) keys, per query head
    v: torch.Tensor  # (H, N, r) values, per query head
    cos_q: torch.Tensor  # (H or 1, Q, d/2)
    sin_q: torch.Tensor
    wq_hat: torch.Tensor  # (H, m+1, d)  [W_q; b_q^T] per head
    scale: torch.Tensor  # (H,)
    beta: torch.Tensor | None  # (H, Q, N) additive biases, or None
    pos_q: torch.Tensor
    pos_kv: torch.Tensor

    def lmap(self, idx: Any = slice(None)) -> torch.Tensor:
        """``L_i = W^_q R(p_i)^T * scale`` for the selected queries: ``(H, Qc, m+1, d)``."""
        if not self.spec.affine:
            raise ValueError(
                f"family {self.spec.family!r} is not affine in u: Delta M does not exist; "
                "use the query-space form y = mu + q T + b")
        cos, sin = self.cos_q[:, idx, None, :], self.sin_q[:, idx, None, :]
        L = apply_rope(self.wq_hat[:, None], cos, sin, self.spec.rope.layout)
        return L * self.scale[:, None, None, None]


def project(spec: HeadSpec, weights: HeadWeights, x_q: Any, pos_q: Any, x_kv: Any, pos_kv: Any,
            dtype: torch.dtype = torch.float64, device: Any = None, bias: Any = None) -> Projected:
    """Project, normalise and rotate queries/keys/values of every head."""
    cd = compute_dtype(dtype)

    def cast(a: Any) -> torch.Tensor | None:
        t = _t(a, dtype, device)  # round once to the requested storage dtype ...
        return None if t is None else t.to(cd)  # ... then compute in cd

    xq, xk = cast(x_q), cast(x_kv)
    u_q, u_k = augment(xq), augment(xk)
    wq = augmented_weight(cast(weights.w_q), cast(weights.b_q))  # (m+1, H, d)
    if spec.family == "latent":  # the absorbed form (kernel.latent_qkv); n_kv_heads = H
        lw = {f: cast(getattr(weights, f)) for f in LATENT_FIELDS}
        lt = spec.latent
        q = latent_qkv(xq, lw, spec.n_heads, lt.kv_eps, lt.q_eps)[0]
        _, k, v = latent_qkv(xk, lw, spec.n_heads, lt.kv_eps, lt.q_eps)
    else:
        wk = augmented_weight(cast(weights.w_k), cast(weights.b_k))
        wv = augmented_weight(cast(weights.w_v), cast(weights.b_v))
        q = clipped(torch.einsum("qm,mhd->hqd", u_q, wq), spec.clip)
        k = clipped(torch.einsum("nm,mhd->hnd", u_k, wk), spec.clip)
        v = clipped(torch.einsum("nm,mhd->hnd", u_k, wv), spec.clip)
    after = spec.norm_after_rope  # the norms act on the rotated vectors (Hunyuan)
    if spec.family == "qknorm" and not after:
        q = qk_norm(q, cast(weights.q_norm), spec.norm_eps, spec.norm_scope, spec.norm_kind,
                    cast(weights.q_norm_bias))
        k = qk_norm(k, cast(weights.k_norm), spec.norm_eps, spec.norm_scope, spec.norm_kind,
                    cast(weights.k_norm_bias))
    elif spec.family == "cosine":
        q, k = unit_rows(q, "query"), unit_rows(k, "key")
    kv_of = torch.arange(spec.n_heads, device=q.device) // spec.group
    k, v = k[kv_of], v[kv_of]
    pq = torch.as_tensor(_positions(pos_q, "pos_q"), device=q.device)
    pk = torch.as_tensor(_positions(pos_kv, "pos_kv"), device=q.device)
    cos_q, sin_q = query_cos_sin(spec, pq, cd, q.device)  # a query temperature folded in
    cos_k, sin_k = rope_cos_sin(spec, pk, cd, q.device)
    q = apply_rope(q, cos_q, sin_q, spec.rope.layout)
    k = apply_rope(k, cos_k, sin_k, spec.rope.layout)
    if after:
        q = rms_norm(q, cast(weights.q_norm), spec.norm_eps)
        k = rms_norm(k, cast(weights.k_norm), spec.norm_eps)
    scale = torch.tensor([spec.score_scale(h) for h in range(spec.n_heads)], dtype=cd,
                         device=q.device)
    q = q * scale[:, None, None]
    beta = None
    if spec.alibi_slopes is not None:
        sl = torch.tensor(spec.alibi_slopes, dtype=cd, device=q.device)
        beta = -sl[:, None, None] * (pq[:, None] - pk[None, :]).to(cd)[None]
    if bias is not None:
        bb = cast(bias)
        bb = bb.expand(spec.n_heads, *bb.shape[-2:]) if bb.dim() == 2 else bb
        beta = bb if beta is None else beta + bb
    return Projected(spec, u_q, q, k, v, cos_q, sin_q, wq.permute(1, 0, 2), scale, beta, pq, pk)


# ---------------------------------------------------------------------------------------------
# the identity
# ---------------------------------------------------------------------------------------------
@dataclass
class Step:
    """Result of :func:`step`.  Shapes: H heads, Q queries, N keys, d head dim, r value dim."""

    gauge: Any
    mask: torch.Tensor  # (Q, N) bool
    s: torch.Tensor  # (H, Q, N) raw scores (bias included, before the transform)
    y: torch.Tensor  # (H, Q, r) softmax output computed directly
    mu: torch.Tensor  # (H, Q, r) uniform mean of permitted values
    readout: torch.Tensor  # (H, Q, r) mu + q T + b (- sigma w): the identity's right side
    c: torch.Tensor | None = None  # (H, Q, N) coefficients (0 off the mask)
    t: torch.Tensor | None = None  # (H, Q, d, r)
    b: torch.Tensor | None = None  # (H, Q, r) bias-row term
    w: torch.Tensor | None = None  # (H, Q, r) sum_j c_ij (v_j - mu_i) (free gauges)
    sigma: torch.Tensor | None = None  # (H, Q) u_i . g (free gauges)
    delta_m: torch.Tensor | None = None  # (H, Q, m+1, r)
    kappa: torch.Tensor | None = None  # (H, Q) condition number of the readout sum (vs max|v|)
    extras: dict = field(default_factory=dict)

    def identity_error(self) -> torch.Tensor:
        """``|y - (mu + u^T Delta M)|`` elementwise, ``(H, Q, r)``."""
        return (self.y - self.readout).abs()


def _gauge_kind(gauge: Any) -> str:
    if isinstance(gauge, str):
        if gauge not in ("original", "maxkey", "pairwise"):
            raise ValueError(f"unknown gauge {gauge!r}: original, maxkey, pairwise or a vector g")
        return gauge
    return "free"


def default_chunk(spec: HeadSpec, N: int, m: int, elt: int, max_bytes: int,
                  with_delta_m: bool) -> int:
    """Queries per chunk so that the per-chunk work tensors stay under ``max_bytes``."""
    d, r, H = spec.head_dim, spec.r, spec.n_heads
    per_q = H * (N * (d + r + 6) + d * r + (m + 1) * (d + r if with_delta_m else 0)) * elt
    return max(1, int(max_bytes // max(per_q, 1)))


def step(spec: HeadSpec, weights: HeadWeights, x_q: Any, pos_q: Any, x_kv: Any, pos_kv: Any,
         mask: Any = "causal", *, bias: Any = None, gauge: Any = "original",
         dtype: torch.dtype = torch.float64, device: Any = None, delta_m: bool = False,
         keep: Iterable[str] = ("c", "t", "b"), max_bytes: int = 1 << 30,
         chunk: int | None = None) -> Step:
    """Evaluate one layer's heads on queries ``x_q`` reading the bank ``x_kv``.

    With attention sinks (``spec.sinks``) the bank holds one more key, the last: a zero key and
    value whose score is the head's sink logit (:func:`ropestep.kernel.with_sink`); ``s``,
    ``c`` and ``mask`` then have ``N + 1`` columns and ``mu`` counts the sink's zero value.

    ``mask``: ``"causal"``, ``"bank"`` or a boolean ``(Q, N)`` array.  ``gauge``: ``"original"``
    (``g = 0``), ``"maxkey"`` (``g = a_{i j*}``), ``"pairwise"`` or a vector ``g`` of shape
    ``(m+1,)`` or ``(H, m+1)`` (affine heads only).  ``delta_m=True`` also materialises
    ``Delta M_i`` (affine heads).  ``keep`` names the per-query tensors returned
    (``c``, ``t``, ``b``); drop them to stream large layers.  Queries are processed in chunks
    so that work tensors stay under ``max_bytes``.
    """
    if not isinstance(spec, HeadSpec):
        raise TypeError(f"spec must be a HeadSpec, got {type(spec).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}: use float64, float32, bfloat16 or float16")
    kind = _gauge_kind(gauge)
    Qn = int(np.shape(x_q)[0]) if hasattr(x_q, "shape") else len(x_q)
    Nn = int(np.shape(x_kv)[0]) if hasattr(x_kv, "shape") else len(x_kv)
    mask = resolve_mask(mask, pos_q, pos_kv, Qn, Nn, spec.window, spec.chunk)
    Q, N, m = check_inputs(spec, weights, x_q, pos_q, x_kv, pos_kv, mask, bias)
    if (delta_m or kind == "free") and not spec.affine:
        raise ValueError(f"family {spec.family!r} is not affine in u: Delta M and free gauges "
                         "are undefined (use the query-space readout)")
    P = project(spec, weights, x_q, pos_q, x_kv, pos_kv, dtype, device, bias)
    cd = P.q.dtype
    mk = torch.as_tensor(np.asarray(mask) if not torch.is_tensor(mask) else mask,
                         device=P.q.device).to(torch.bool)
    if spec.sinks is not None:  # one more key: zero key and value, the logit as its bias (last)
        sk = torch.tensor(spec.sinks, dtype=cd, device=P.q.device)
        P.k, P.v, mk, P.beta = with_sink(P.k, P.v, mk, P.beta, sk, Q)
    g = None
    if kind == "free":
        g = torch.as_tensor(np.asarray(gauge) if not torch.is_tensor(gauge) else gauge)
        g = g.to(device=P.q.device, dtype=cd)
        if g.shape not in ((m + 1,), (spec.n_heads, m + 1)):
            raise ValueError(f"gauge vector must have shape ({m + 1},) or ({spec.n_heads}, {m + 1}),"
                             f" got {tuple(g.shape)}")
        if not bool(torch.isfinite(g).all()):
            raise ValueError("gauge vector contains NaN or inf")
        g = g.expand(spec.n_heads, m + 1)
    keep = set(keep)
    elt = torch.finfo(cd).bits // 8
    cs = chunk or default_chunk(spec, N, m, elt, max_bytes, delta_m)
    parts: dict[str, list] = {}
    for lo in range(0, Q, cs):
        idx = slice(lo, min(Q, lo + cs))
        out = _step_chunk(P, mk[idx], idx, kind, g, delta_m, spec.softcap)
        for key, val in out.items():
            if key in ("s", "y", "mu", "readout", "w", "sigma", "kappa") or key in keep or \
                    (key == "delta_m" and delta_m):
                parts.setdefault(key, []).append(val)
    cat = {k: torch.cat(v, dim=1) for k, v in parts.items()}
    res = Step(gauge=gauge, mask=mk, **cat)
    res.extras["projected"] = P
    return res


def _step_chunk(P: Projected, mk: torch.Tensor, idx: slice, kind: str, g: torch.Tensor | None,
                want_dm: bool, softcap: float | None) -> dict[str, torch.Tensor]:
    """One chunk of queries through the kernel, plus ``Delta M_i = L_i T_i + e_{m+1} b_i^T``."""
    sigma = None
    if kind == "free":  # sigma_i = u_i . g
        sigma = (P.u_q[idx] @ g.T).T  # (H, Qc)
    beta = None if P.beta is None else P.beta[:, idx]
    out = gauge_chunk(P.q[:, idx], P.k, P.v, mk, gauge=kind, beta=beta, softcap=softcap,
                      sigma=sigma, kappa=True, query_offset=idx.start)
    res = {"s": out["s"], "y": out["y_c"], "mu": out["mu_c"].expand_as(out["y_c"]),
           "readout": out["readout_c"], "t": out["t"], "kappa": out["kappa"]}
    for key in ("c", "b"):
        if key in out:
            res[key] = out[key]
    if kind == "free":
        res.update(w=out["w"], sigma=sigma)
    if want_dm:
        dm = P.lmap(idx) @ out["t"]  # (H, Qc, m+1, r)
        if "b" in out:
            dm[:, :, -1] += out["b"]
        if kind == "free":
            dm = dm - g[:, None, :, None] * out["w"][:, :, None, :]
        res["delta_m"] = dm
    return res


# ---------------------------------------------------------------------------------------------
# gradient step
# ---------------------------------------------------------------------------------------------
def features(st: Step, head: int, query: int) -> torch.Tensor:
    """Explicit features ``a_ij = L_i k~_j^T + beta_ij e_{m+1}`` of one query: ``(N, m+1)``.

    Rows off the permitted set are included (callers select with ``st.mask[query]``).
    """
    P: Projected = st.extras["projected"]
    L = P.lmap(slice(query, query + 1))[head, 0]  # (m+1, d)
    a = P.k[head] @ L.T  # (N, m+1)
    if P.beta is not None:
        a[:, -1] += P.beta[head, query]
    return a


def objective(a: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
              B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``E(B) = 1/2 sum_j c_j ||a_j^T B - t_j||^2`` and its gradient ``H B - sum_j c_j a_j t_j^T``.

    ``a (N, m+1)``, ``c (N,)``, ``targets (N, r)``, ``B (m+1, r)``.
    """
    res = a @ B - targets
    E = 0.5 * (c[:, None] * res * res).sum()
    grad = a.T @ (c[:, None] * res)
    return E, grad


def hessian(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``H = sum_j c_j a_j a_j^T`` (m+1 x m+1); the Hessian of ``E`` is ``H (x) I_r``."""
    return a.T @ (c[:, None] * a)


@dataclass
class DescentCheck:
    lam_max: torch.Tensor  # (H, Q) largest eigenvalue of H_i
    e0: torch.Tensor  # (H, Q) E_i(0)
    e1: torch.Tensor  # (H, Q) E_i(Delta M_i)  (after the unit step)

    @property
    def descends(self) -> torch.Tensor:
        return self.e1 < self.e0


def descent(st: Step) -> DescentCheck:
    """λ_max(H_i) and E before/after the unit step, for every head and query (affine heads).

    Computed in the (d+1)-dimensional factor space: ``a_j = L^_i k^_j`` with
    ``L^_i = [L_i | e_{m+1}]`` and ``k^_j = [k~_j - k_o, beta_j - beta_o]``, so
    ``H_i = L^ G L^^T`` with ``G = sum_j c_j k^_j k^_j^T`` and ``Delta M_i = L^ [T_i; b_i^T]``.
    Valid in the original and max-key gauges.  The query-space parametrisation (every family,
    the cosine family included; docs/math.md sections 3 and 11) is :func:`query_descent`.
    """
    if _gauge_kind(st.gauge) not in ("original", "maxkey"):
        raise ValueError("descent() is defined in the original and max-key gauges")
    if st.c is None or st.t is None:
        raise ValueError("descent() needs c and t: call step(..., keep=('c','t','b'))")
    P: Projected = st.extras["projected"]
    if not P.spec.affine:
        raise ValueError(
            f"descent(): family {P.spec.family!r} is not affine in u, so the input-space step does "
            "not exist; use query_descent(st) (docs/math.md section 11)")
    H, Q, N = st.c.shape
    k = P.k
    beta = P.beta if P.beta is not None else torch.zeros(H, Q, N, dtype=k.dtype, device=k.device)
    khat = torch.cat((k[:, None].expand(H, Q, N, k.shape[-1]), beta[..., None]), -1)
    if st.gauge == "maxkey":
        js = torch.where(st.mask[None], st.s, torch.full_like(st.s, -torch.inf)).argmax(-1)
        off = torch.gather(khat, 2, js[..., None, None].expand(H, Q, 1, khat.shape[-1]))
        khat = khat - off
    brow = torch.zeros_like(st.t[:, :, :1]) if st.b is None else st.b[:, :, None]
    tb = torch.cat((st.t, brow), 2)  # (H, Q, d+1, r): Delta M_i = L^_i tb_i
    L = P.lmap()  # (H, Q, m+1, d)
    e_last = torch.zeros_like(L[..., :1])
    e_last[..., -1, 0] = 1
    Lh = torch.cat((L, e_last), -1)  # (H, Q, m+1, d+1)
    Mm = Lh.transpose(-1, -2) @ Lh  # (H, Q, d+1, d+1)
    G = khat.transpose(-1, -2) @ (st.c[..., None] * khat)
    if not bool(torch.isfinite(G).all() and torch.isfinite(Mm).all()):
        bad = (~torch.isfinite(G)).flatten(-2).any(-1).nonzero()
        where = f" at head {int(bad[0, 0])}, query {int(bad[0, 1])}" if bad.numel() else ""
        raise FloatingPointError(
            f"descent(): the Hessian H_i = L G L^T leaves the {G.dtype} range{where} "
            "(lambda_max beyond the float range; docs/math.md section 3) -- use the max-key gauge "
            "or the exact layer")
    ev, U = torch.linalg.eigh(G)
    Gh = U @ torch.diag_embed(ev.clamp_min(0).sqrt()) @ U.transpose(-1, -2)
    prod = Gh @ Mm @ Gh
    if not bool(torch.isfinite(prod).all()):
        raise FloatingPointError(
            f"descent(): G^(1/2) L^T L G^(1/2) leaves the {prod.dtype} range (lambda_max beyond "
            "the float range; docs/math.md section 3) -- use the max-key gauge or the exact layer")
    lam = torch.linalg.eigvalsh(prod)[..., -1]
    mu = st.mu
    vc = P.v[:, None] - mu[:, :, None]
    e0 = 0.5 * (st.c * (vc * vc).sum(-1)).sum(-1)
    # a_j^T Delta M = k^_j L^^T (L^ tb): apply L^ first, so components of tb in the null space
    # of L^ (killed in Delta M) never meet a rounded Gram matrix
    pred = khat @ (Lh.transpose(-1, -2) @ (Lh @ tb))  # (H, Q, N, r)
    res = pred - vc
    e1 = 0.5 * (st.c * (res * res).sum(-1)).sum(-1)
    return DescentCheck(lam, e0, e1)


def key_outer(k: torch.Tensor) -> torch.Tensor:
    """``vec(k~_j^T k~_j)`` for keys ``k (..., n, d)``: ``(..., n, d^2)``, the right operand of
    :func:`gram` (computed once for keys that several Gram products share)."""
    return (k[..., :, :, None] * k[..., :, None, :]).flatten(-2)


def gram(c: torch.Tensor, k: torch.Tensor | None, *, outer: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``G_i = sum_j c_ij k~_j^T k~_j`` for coefficient rows ``c (..., Q, n)`` and keys
    ``k (..., n, d)`` (or one shared ``(n, d)``): one GEMM of the rows with ``vec(k~_j^T k~_j)``
    (``n x d^2``, :func:`key_outer`; pass it as ``outer`` instead of ``k`` where it is shared),
    returned as ``(..., Q, d, d)`` (written into ``out``, a contiguous ``(..., Q, d, d)``
    tensor, when given)."""
    kk = key_outer(k) if outer is None else outer
    d = math.isqrt(kk.shape[-1])
    if out is None:
        return (c @ kk).unflatten(-1, (d, d))
    torch.matmul(c, kk, out=out.view(*out.shape[:-2], d * d))
    return out


LANCZOS_STEPS = 8  # Krylov dimension of lambda_max: on SmolLM2's matrices (4 layers x 9 heads x 512
# queries, both spaces) 8 steps certify all but 65 of 36,864; fewer steps leave many to LAPACK
LANCZOS_BLOCK = 128  # matrices per block of lambda_max (8 MiB of 64 x 64 float64 operands)
LANCZOS_STEPS_STARTED = 5  # the steps from start vectors near the top eigenvectors (the atlas's
# c-weighted key sums), retried with LANCZOS_STEPS where they do not certify: on Qwen2.5's layers
# 0/5/12/23 (19,712 matrices, both spaces) 5 steps certify all but 13 (5 from the all-ones vector:
# all but 3,960); on SmolLM2's layers 0/8/18/29 (36,864) all but 10,446 (ones: 30,296), and 8
# steps from the same start all but 1 (8 from the all-ones vector: all but 147)


def lambda_max(A: torch.Tensor, steps: int = LANCZOS_STEPS, *, start: torch.Tensor | None = None,
               retry: int | None = None, stats: dict | None = None) -> torch.Tensor:
    """Largest eigenvalue of symmetric positive semidefinite matrices ``A (..., d, d)``, each
    certified to a relative interval of width at most ``tolerances.LAMBDA_CERT_REL``
    (docs/math.md section 3, "lambda_max without the spectrum").

    ``k = min(steps, d)`` Lanczos steps with full reorthogonalisation from a start vector (the
    all-ones vector, or the matrix's row of ``start (..., d)``; one that is zero or not finite is
    replaced by the all-ones vector) give an orthonormal basis ``Q_k`` and the tridiagonal
    ``T_k = Q_k^T A Q_k``; ``theta = lambda_max(T_k) <= lambda_max(A)``.  In the basis
    ``[Q_k, W]`` (``W`` the complement) ``A`` has the blocks ``T_k``, ``A_W`` and a coupling of
    norm ``beta_k`` (the last Lanczos residual), and
    ``||A||_F^2 = ||T_k||_F^2 + 2 beta_k^2 + ||A_W||_F^2``; with
    ``f = (||A||_F^2 - ||T_k||_F^2 - 2 beta_k^2)^(1/2) >= lambda_max(A_W)``

        lambda_max(A) <= lambda_max([[T_k, beta_k e_k], [beta_k e_k^T, f]])

    (for ``x = (x_1, x_2)``, ``x^T A x`` is at most the bordered matrix's quadratic form at
    ``(x_1, +-||x_2||)``).  Both ends are eigenvalues of ``(k+1) x (k+1)`` matrices.  Where the
    interval is wider than ``LAMBDA_CERT_REL`` times ``theta`` (a start vector blind to the top
    eigenvector, a top eigenvalue of multiplicity > 1, a flat spectrum), its recurrence is
    continued to ``retry`` steps in all (when ``retry > steps``), and where that does not certify
    either, the value comes from LAPACK's full spectrum (``torch.linalg.eigvalsh``).  The
    interval's ends carry the Lanczos recurrence's rounding, ``O(k u ||A||)`` (backward stable
    with full reorthogonalisation), the order of ``eigvalsh``'s own.  The certificate holds for
    any start vector: a better one (near the top eigenvector) only lets fewer steps certify.
    ``stats`` (a dict) receives the numbers of matrices, of retried ones and of fallbacks to
    LAPACK."""
    from .tolerances import LAMBDA_CERT_REL
    d = A.shape[-1]
    X = A.reshape(-1, d, d)
    S = None
    if start is not None:
        if tuple(start.shape) != tuple(A.shape[:-1]):
            raise ValueError(f"lambda_max: start vectors of shape {tuple(start.shape)} for "
                             f"matrices of shape {tuple(A.shape)} "
                             f"(expected {tuple(A.shape[:-1])})")
        S = start.reshape(-1, d)
    lo, hi, blocks = _interval(X, steps, S)
    bad = ~(hi - lo <= LAMBDA_CERT_REL * lo)  # NaN or a wide interval
    retried = 0
    if retry is not None and int(retry) > int(steps) and bool(bad.any()):  # more steps first
        idx = bad.nonzero()[:, 0]
        state = tuple(torch.cat(p)[idx] for p in zip(*blocks))
        lo[idx], hi[idx], _ = _interval(X[idx], int(retry), state=state)
        retried = int(idx.numel())
        bad = ~(hi - lo <= LAMBDA_CERT_REL * lo)
    if bool(bad.any()):  # the full spectrum
        lo[bad] = torch.linalg.eigvalsh(X[bad])[:, -1]
    if stats is not None:
        stats["matrices"] = stats.get("matrices", 0) + X.shape[0]
        stats["retried"] = stats.get("retried", 0) + retried
        stats["fallbacks"] = stats.get("fallbacks", 0) + int(bad.sum())
    return lo.reshape(A.shape[:-2])


def _interval(X: torch.Tensor, steps: int, S: torch.Tensor | None = None,
              state: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The certified interval ``[lambda_max(T_k), lambda_max(T^_k)]`` of every matrix of
    ``X (B, d, d)`` after ``steps`` Lanczos steps from the rows of ``S`` (:func:`lambda_max`), or
    continuing the recurrences of ``state`` (a previous call's blocks' states, joined, on the
    same matrices), in blocks of ``LANCZOS_BLOCK`` matrices that stay in cache; and each block's
    recurrence state (:func:`_lanczos`), joined only where a caller continues them."""
    lo, hi = X.new_empty(X.shape[0]), X.new_empty(X.shape[0])
    parts = []
    for b0 in range(0, X.shape[0], LANCZOS_BLOCK):
        sl = slice(b0, b0 + LANCZOS_BLOCK)
        Xb = X[sl]
        rec = _lanczos(Xb, steps, None if S is None else S[sl],
                       None if state is None else tuple(s[sl] for s in state))
        alpha, beta = rec[0], rec[1]
        tk2 = (alpha * alpha).sum(-1) + 2 * (beta[:, :-1] * beta[:, :-1]).sum(-1)
        bk = beta[:, -1]
        tail = ((Xb * Xb).sum((-1, -2)) - tk2 - 2 * bk * bk).clamp_min(0).sqrt()
        lo[sl], hi[sl] = _ends(alpha, beta, tail)
        parts.append(rec)
    return lo, hi, parts


def _lanczos(X: torch.Tensor, steps: int, start: torch.Tensor | None = None,
             state: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """``(alpha, beta, Q, q)`` of ``k = min(steps, d)`` Lanczos steps on every matrix of
    ``X (B, d, d)`` from the rows of ``start (B, d)`` (the all-ones vector where it is None, zero
    or not finite), with full reorthogonalisation (twice: "twice is enough"): the coefficients
    ``(B, k)``, the basis ``Q (B, k, d)`` and the next vector ``q (B, 1, d)``.  With ``state``
    (a previous call's four, on the same matrices) the recurrence continues from its step.

    The vectors are rows ``(B, 1, d)``: the product is ``q^T X`` (one batched row-times-matrix
    ``bmm``, faster on CPU than ``X q`` or an element-wise product and sum), i.e. the recurrence
    runs on ``X^T``, whose eigenvalues and Frobenius norm are exactly ``X``'s, so the transpose
    changes nothing in the certificate of :func:`lambda_max`.  (A computed ``X`` may depart from
    symmetry by the rounding of the products that formed it, ``O(u ||X||)``: the order of the
    recurrence's own rounding term, with either orientation.)"""
    B, d = X.shape[0], X.shape[-1]
    k = max(1, min(int(steps), d))
    j0 = 0 if state is None else int(state[0].shape[1])
    Q = X.new_zeros(B, k, d)
    alpha, beta = X.new_zeros(B, k), X.new_zeros(B, k)
    if state is not None:
        alpha[:, :j0], beta[:, :j0], Q[:, :j0], q = state
    elif start is not None:
        nrm = torch.linalg.vector_norm(start, dim=-1, keepdim=True)  # (B, 1)
        ok = (nrm > 0) & torch.isfinite(nrm)
        q = torch.where(ok, start / torch.where(ok, nrm, 1.0), d ** -0.5)[:, None, :]
    else:
        q = X.new_full((B, 1, d), d ** -0.5)
    for j in range(j0, k):
        Q[:, j:j + 1] = q
        w = torch.bmm(q, X)  # (B, 1, d): q^T X
        alpha[:, j] = (w * q).sum((-1, -2))
        Qj = Q[:, :j + 1]
        for _ in range(2):  # w - (w Q_j^T) Q_j
            w = torch.baddbmm(w, torch.bmm(w, Qj.transpose(1, 2)), Qj, alpha=-1.0)
        nrm = torch.linalg.vector_norm(w, dim=-1, keepdim=True)  # (B, 1, 1)
        beta[:, j] = nrm[:, 0, 0]
        q = torch.where(nrm > 0, w / nrm.clamp_min(1e-300), 0.0)
    return alpha, beta, Q, q


def _ends(alpha: torch.Tensor, beta: torch.Tensor, tail: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lambda_max(T_k), lambda_max(T^_k))``: the tridiagonal, and the tridiagonal bordered
    by the coupling ``beta_k`` and the unexplored block's bound ``tail`` (:func:`lambda_max`)."""
    B, k = alpha.shape
    T = alpha.new_zeros(B, k + 1, k + 1)
    ar = torch.arange(k, device=alpha.device)
    T[:, ar, ar] = alpha
    T[:, ar[:-1], ar[:-1] + 1] = beta[:, :-1]
    T[:, ar[:-1] + 1, ar[:-1]] = beta[:, :-1]
    Tb = T.clone()
    Tb[:, k - 1, k] = Tb[:, k, k - 1] = beta[:, -1]
    Tb[:, k, k] = tail
    ends = torch.linalg.eigvalsh(torch.cat((T, Tb)))[:, -1]  # T padded by a zero row: PSD
    return ends[:B], ends[B:]


def query_space_step(G: torch.Tensor, t: torch.Tensor, scale: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient step in query space (docs/math.md section 3): the variable is the rotated
    query, the features ``a_j = scale k~_j``, so ``H_i = scale^2 G_i`` and the step is
    ``scale T_i``.  Returns ``(lambda_max(H_i), E_i(step) - E_i(0))`` with

        E(step) - E(0) = scale^2 (0.5 scale^2 <T, G T> - ||T||^2),

    for ``G (..., Q, d, d)`` (:func:`gram`), ``T (..., Q, d, r)`` and ``scale`` broadcasting to
    ``(..., Q)``.  The unit step increases E exactly when ``0.5 scale^2 <T, G T> > ||T||^2``.
    The same holds for Cosine-RoPE heads (unit rotated keys, ``scale = 1/tau``).
    """
    return query_lambda(lambda_max(G), scale), query_step_change(G, t, scale)


def query_lambda(lam_g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``lambda_max(H_i) = scale^2 lambda_max(G_i)`` of the query-space step from the Gram
    matrix's largest eigenvalue ``lam_g`` (:func:`query_space_step`)."""
    return scale * scale * lam_g


def query_step_change(G: torch.Tensor, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``E_i(step) - E_i(0) = scale^2 (0.5 scale^2 <T, G T> - ||T||^2)`` of the query-space
    unit step (:func:`query_space_step`, which also returns ``lambda_max``)."""
    s2 = scale * scale
    quad = (t * (G @ t)).sum((-1, -2))
    return s2 * (0.5 * s2 * quad - (t * t).sum((-1, -2)))


def query_descent(st: Step) -> DescentCheck:
    """λ_max and E before/after the unit step in QUERY space (the public replication's
    parametrisation; the paper's is :func:`descent`), every head and query, original gauge.

    ``E_i(0) = 1/2 sum_j c_ij |v_j - mu_i|^2`` directly; ``E_i(step)`` from
    :func:`query_space_step`.  Defined for every family with a query-space form (dot, QK-norm,
    cosine: ``Projected.k`` holds the rotated, normalised keys and ``Projected.scale`` 1/tau).
    """
    if _gauge_kind(st.gauge) != "original":
        raise ValueError("query_descent() is defined in the original gauge")
    if st.c is None or st.t is None:
        raise ValueError("query_descent() needs c and t: call step(..., keep=('c','t'))")
    P: Projected = st.extras["projected"]
    G = gram(st.c, P.k)  # (H, Q, d, d)
    if not bool(torch.isfinite(G).all()):
        raise FloatingPointError("query_descent(): sum_j c_j k~_j k~_j^T leaves the "
                                 f"{G.dtype} range (docs/math.md section 3)")
    lam, delta = query_space_step(G, st.t, P.scale[:, None])
    vc = P.v[:, None] - st.mu[:, :, None]
    e0 = 0.5 * (st.c * (vc * vc).sum(-1)).sum(-1)
    return DescentCheck(lam, e0, e0 + delta)


# ---------------------------------------------------------------------------------------------
# the gradient step in query space (docs/math.md sections 3 and 11)
# ---------------------------------------------------------------------------------------------
def _query_gauge(st: Step, what: str) -> Projected:
    kind = _gauge_kind(st.gauge)
    if kind not in ("original", "maxkey"):
        raise ValueError(f"{what} is defined in the original and max-key gauges, not {kind!r} "
                         "(a free gauge vector lives in input space)")
    return st.extras["projected"]


def query_input(st: Step) -> torch.Tensor:
    """The query-space input ``z_i = [q~_i; 1]`` of every head and query, ``(H, Q, d+1)``.

    ``q~_i`` is the rotated (and, for the qknorm/cosine families, normalised) query *without*
    the score scale: the effective query ``q_i = scale * q~_i`` divided by its scale.
    """
    P = _query_gauge(st, "query_input()")
    qt = P.q / P.scale[:, None, None]
    return torch.cat((qt, torch.ones_like(qt[..., :1])), -1)


def query_features(st: Step, head: int, query: int) -> torch.Tensor:
    """Query-space features ``a^_j = [scale (k~_j - k_o); beta_ij - beta_o]`` of one query:
    ``(N, d+1)`` (rows off the permitted set included; ``k_o``, ``beta_o`` the gauge's offsets).

    The score is ``s_ij = z_i . a^_j`` (plus the gauge anchor); for a cosine head ``k~_j`` is the
    rotated unit key and ``scale = 1/tau_h`` (docs/math.md section 11).
    """
    P = _query_gauge(st, "query_features()")
    k = P.k[head] * P.scale[head]  # (N, d)
    beta = (P.beta[head, query] if P.beta is not None
            else torch.zeros(k.shape[0], dtype=k.dtype, device=k.device))
    a = torch.cat((k, beta[:, None]), -1)
    if st.gauge == "maxkey":
        js = int(torch.where(st.mask[query], st.s[head, query],
                             torch.full_like(st.s[head, query], -torch.inf)).argmax())
        a = a - a[js]
    return a


def query_delta_m(st: Step) -> torch.Tensor:
    """The query-space step ``Delta M^q_i = [scale T_i; b_i^T] = -grad E^q_i(0)``,
    ``(H, Q, d+1, r)``.

    With :func:`query_input` ``z_i``: ``y_i = mu_i + z_i^T Delta M^q_i`` -- the identity in
    query space, which holds for every family, the cosine family included (docs/math.md
    section 11); :func:`query_descent` gives the step's ``lambda_max`` and energies (without
    additive biases, whose coordinate it leaves out).  Needs ``t`` (``keep`` of :func:`step`).
    """
    P = _query_gauge(st, "query_delta_m()")
    if st.t is None:
        raise ValueError("query_delta_m() needs t: call step(..., keep=('c','t','b'))")
    top = st.t * P.scale[:, None, None, None]
    brow = torch.zeros_like(top[:, :, :1]) if st.b is None else st.b[:, :, None]
    return torch.cat((top, brow), 2)


# ---------------------------------------------------------------------------------------------
# frozen reuse and the prefix/full relation
# ---------------------------------------------------------------------------------------------
@dataclass
class Reuse:
    frozen: torch.Tensor  # (H, Q, r) mu + u_i^T Delta M_a
    error: torch.Tensor  # (H, Q, r) y_i - frozen_i (measured)
    tokenwise: torch.Tensor  # (H, Q, r) sum_j (c_ij - c_aj)(u_i . a_j)(v_j - mu)
    refresh_t: torch.Tensor  # (H, Q, d, r) T_i - T_a  (Delta M_i - Delta M_a = L (T_i - T_a))
    bound: torch.Tensor | None  # (H, Q) ||u_i|| ||Delta M_i - Delta M_a||_op


def frozen_reuse(st: Step, anchor: int = 0, bound: bool = True) -> Reuse:
    """Reuse query ``anchor``'s matrix for all queries of a shared bank at one position.

    All queries must share positions and permitted set (so ``a_j`` and ``mu`` are shared),
    which is the paper's setting: ``y_fr_i = mu + u_i^T Delta M_a = mu + q_i T_a + b_a``.
    """
    if _gauge_kind(st.gauge) != "original":
        raise ValueError("frozen_reuse() is stated in the original gauge")
    if st.c is None or st.t is None:
        raise ValueError("frozen_reuse() needs c and t: call step(..., keep=('c','t','b'))")
    P: Projected = st.extras["projected"]
    if not bool((st.mask == st.mask[anchor]).all()) or not bool((P.pos_q == P.pos_q[anchor]).all()):
        raise ValueError("frozen reuse needs every query at the anchor's position and bank")
    if P.beta is not None and not bool((P.beta == P.beta[:, anchor:anchor + 1]).all()):
        raise ValueError("frozen reuse needs query-independent additive biases")
    q = P.q  # (H, Q, d)
    ta = st.t[:, anchor:anchor + 1]
    ba = None if st.b is None else st.b[:, anchor:anchor + 1]
    frozen = st.mu + (q[:, :, None] @ ta)[:, :, 0] + (0 if ba is None else ba)
    err = st.y - frozen
    sc = q @ P.k.transpose(-1, -2)  # u_i . a_j without the bias ... add bias
    if P.beta is not None:
        sc = sc + P.beta
    dc = st.c - st.c[:, anchor:anchor + 1]
    vc = P.v[:, None] - st.mu[:, :, None]
    vc = torch.where(st.mask[None, :, :, None], vc, torch.zeros_like(vc))
    tok = ((dc * sc)[:, :, None] @ vc)[:, :, 0]
    rt = st.t - ta
    bnd = reuse_bound(st, anchor) if bound and P.spec.affine else None
    return Reuse(frozen, err, tok, rt, bnd)


def reuse_bound(st: Step, anchor: int = 0) -> torch.Tensor:
    """``||u_i|| ||dM_i - dM_a||_op`` for every head and query of a shared-position bank, (H, Q).

    All queries sit at one position, so they share ``L`` and ``dM_i - dM_a = L^ M_i`` with
    ``L^ = [L | e_{m+1}]`` ((m+1) x (d+1)) and ``M_i = [T_i - T_a; (b_i - b_a)^T]``; with the thin
    QR ``L^ = Q R`` the operator norm is ``||R M_i||_op`` -- a (d+1) x r matrix instead of an
    (m+1) x r one.

    A head whose score is not affine in ``u`` (QK-norm) has no ``dM_i``; its frozen readout is
    the query-space one (:func:`frozen_reuse`), with error ``e_i = z_i^T (dM^q_i - dM^q_a)``
    exactly (:func:`query_input`, :func:`query_delta_m`), so the bound is
    ``||z_i|| ||dM^q_i - dM^q_a||_op`` (docs/math.md section 8).
    """
    P: Projected = st.extras["projected"]
    if not P.spec.affine:
        dq = query_delta_m(st)
        op = torch.linalg.matrix_norm(dq - dq[:, anchor:anchor + 1], ord=2)  # (H, Q)
        return torch.linalg.vector_norm(query_input(st), dim=-1) * op
    L = P.lmap(slice(anchor, anchor + 1))[:, 0]  # (H, m+1, d)
    e = torch.zeros_like(L[..., :1])
    e[:, -1] = 1
    R = torch.linalg.qr(torch.cat((L, e), -1), mode="r").R  # (H, d+1, d+1)
    dt = st.t - st.t[:, anchor:anchor + 1]  # (H, Q, d, r)
    db = (torch.zeros_like(dt[:, :, :1]) if st.b is None
          else (st.b - st.b[:, anchor:anchor + 1])[:, :, None])
    op = torch.linalg.matrix_norm(R[:, None] @ torch.cat((dt, db), 2), ord=2)  # (H, Q)
    return torch.linalg.vector_norm(P.u_q, dim=-1)[None] * op


def prefix_full(y_prefix: torch.Tensor, v_self: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """``y_full = (1 - pi) y_prefix + pi v_self`` (``pi`` = softmax mass on the query's own key)."""
    return (1 - pi)[..., None] * y_prefix + pi[..., None] * v_self


def self_mass(s_self: torch.Tensor, s_prefix: torch.Tensor, softcap: float | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """``pi = e^{z_self} / (sum_j e^{z_j} + e^{z_self})`` computed stably (``z = phi(s)``), the
    sum over the permitted prefix keys (``mask (Q, N)``; all of them without one)."""
    zs, zp = transform(s_self, softcap), transform(s_prefix, softcap)
    if mask is not None:
        zp = zp.masked_fill(~mask.to(zp.device), -math.inf)
    return torch.softmax(torch.cat((zp, zs[..., None]), -1), -1)[..., -1]


def full_bank_mean(mu_prefix: torch.Tensor, v_self: torch.Tensor, n_prefix: Any) -> torch.Tensor:
    """Mean of the full bank (prefix plus self): ``(N mu + v_self)/(N + 1)``; ``n_prefix`` the
    number of permitted prefix keys (an int, or per query ``(Q,)``)."""
    n = torch.as_tensor(n_prefix, dtype=mu_prefix.dtype, device=mu_prefix.device)
    if n.ndim == 1:
        n = n[:, None]
    return (n * mu_prefix + v_self) / (n + 1)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ``max|x - ref| / max|ref|`` (absolute when ``ref`` is 0)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    ref = torch.as_tensor(ref, dtype=torch.float64)
    den = float(ref.abs().max()) if ref.numel() else 0.0
    num = float((x - ref).abs().max()) if ref.numel() else 0.0
    return num / den if den > 0 else num
