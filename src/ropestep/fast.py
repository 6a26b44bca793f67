"""Fast layer: batched PyTorch evaluation of every object of the identity.

Works in float64, float32 and bfloat16/float16 (low-precision inputs are upcast and computed
with float32 accumulation), on CPU or CUDA, batched over heads and queries, with no Python
loop over keys.  Memory is bounded by chunking queries under a byte budget.

Everything is written in *query space* first (MATH.md section 3, cheap form): with the
effective query ``q_i`` (rotated, normalised where the family says so, times the score scale)
and rotated keys ``k~_j``, the raw score is ``s_ij = q_i . k~_j + beta_ij`` and, in a gauge
with key offset ``k_o`` and bias offset ``beta_o``,

    T_i = sum_j c_ij (k~_j - k_o)^T (v_j - mu_i)        (d x r)
    b_i = sum_j c_ij (beta_ij - beta_o)(v_j - mu_i)     (r)
    y_i = mu_i + q_i T_i + b_i                          (readout)

For affine heads (family ``"dot"``) ``q_i = u_i^T L_i`` with ``L_i = W^_q R(p_i)^T * scale`` and
``Delta M_i = L_i T_i + e_{m+1} b_i^T`` (minus ``g w_i^T`` in a free gauge ``g``).
The slow, explicit reference with the same definitions is :mod:`ropestep.exact`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from .spec import HeadSpec, HeadWeights, check_inputs, resolve_mask, _positions

LOW_PRECISION = (torch.bfloat16, torch.float16)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------------
# phi_1 and divided differences
# ---------------------------------------------------------------------------------------------
_BIG = 40.0  # above this, e^{-s} < ulp(1) in float64, so (e^s - 1)/s == e^s/s to rounding


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic is carried out in: bf16/fp16 inputs accumulate in float32."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}: use float64, float32, bfloat16 or float16")
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _ftensor(s: Any) -> torch.Tensor:
    """A floating tensor; Python numbers and lists become float64 (not torch's float32 default)."""
    if not torch.is_tensor(s) and not isinstance(s, np.ndarray) and not isinstance(s, np.generic):
        s = torch.as_tensor(s, dtype=torch.float64)
    t = torch.as_tensor(s)
    if not t.is_floating_point():
        t = t.to(torch.float64)
    return t.to(compute_dtype(t.dtype))


def phi1(s: Any) -> torch.Tensor:
    """``rho(s) = phi_1(s) = (e^s - 1)/s``, ``rho(0) = 1``; strictly positive on the real line.

    ``expm1(s)/s`` near 0 (accurate to a few ulp, no cancellation); for ``s > 40`` the
    ``-1`` is below rounding and ``e^{s/2} * (e^{s/2}/s)`` stays finite up to s ~ 716 in
    float64, where ``expm1`` alone overflows at 709.78.  bf16/fp16 inputs are evaluated in
    float32.
    """
    s = _ftensor(s)
    zero = s == 0
    big = s > _BIG
    safe = torch.where(zero | big, torch.ones_like(s), s)
    out = torch.expm1(safe) / safe
    half = torch.exp(torch.where(big, s * 0.5, torch.zeros_like(s)))
    out = torch.where(big, half * (half / torch.where(big, s, torch.ones_like(s))), out)
    return torch.where(zero, torch.ones_like(s), out)


def scaled_phi1(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``e^{shift} * phi_1(x)`` without intermediate overflow.

    For ``x > 40``: ``e^{shift + x} / x`` (the ``-1`` of ``e^x - 1`` is below rounding);
    otherwise the plain product.  Used for ``c = e^{phi(sigma) - z_max} phi_1(z - phi(sigma))``.
    """
    big = x > _BIG
    xs = torch.where(big, x, torch.ones_like(x))
    return torch.where(big, torch.exp(shift + xs) / xs, torch.exp(shift) * phi1(x))


def exp_dd(a: Any, b: Any) -> torch.Tensor:
    """Exponential divided difference ``exp[a, b] = (e^a - e^b)/(a - b) = e^b rho(a - b)``.

    Evaluated with ``b`` the larger argument, so ``rho`` sees a non-positive argument.
    """
    a, b = torch.broadcast_tensors(_ftensor(a), _ftensor(b))
    hi, lo = torch.maximum(a, b), torch.minimum(a, b)
    return torch.exp(hi) * phi1(lo - hi)


def transform(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Score transform ``phi(s)``: identity, or ``softcap * tanh(s / softcap)``."""
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def transform_dd(a: torch.Tensor, b: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Divided difference ``phi[a, b] = (phi(a) - phi(b))/(a - b)`` (1 for the identity).

    Soft-cap ``phi(s) = c tanh(s/c)``: with ``A, B = a/c, b/c`` ordered ``hi >= lo`` and
    ``delta = hi - lo``, ``tanh x = (1 - e^{-2x})/(1 + e^{-2x})`` gives, for ``lo >= 0``,

        phi[a, b] = 4 e^{-2 lo} phi_1(-2 delta) / ((1 + e^{-2 hi})(1 + e^{-2 lo})),

    every factor positive and free of cancellation (mirror it for ``hi <= 0``); across zero
    ``(tanh hi - tanh lo)/delta`` has no cancellation either.
    """
    if softcap is None:
        return torch.ones(torch.broadcast_shapes(a.shape, b.shape), dtype=a.dtype, device=a.device)
    A, B = torch.broadcast_tensors(a / softcap, b / softcap)
    hi, lo = torch.maximum(A, B), torch.minimum(A, B)
    delta = hi - lo
    neg = hi <= 0  # mirror: (hi, lo) -> (-lo, -hi)
    h2 = torch.where(neg, -lo, hi)
    l2 = torch.where(neg, -hi, lo)
    l2c = l2.clamp_min(0)
    h2c = h2.clamp_min(0)
    same = 4 * torch.exp(-2 * l2c) * phi1(-2 * delta) / (
        (1 + torch.exp(-2 * h2c)) * (1 + torch.exp(-2 * l2c)))
    across = (torch.tanh(hi) - torch.tanh(lo)) / torch.where(delta > 0, delta,
                                                               torch.ones_like(delta))
    return torch.where((lo < 0) & (hi > 0), across, same)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def rope_frequencies(base: float, head_dim: int) -> torch.Tensor:
    """``omega_l = base^(-2l/d)`` for ``l = 0..d/2-1`` in float64."""
    ell = torch.arange(head_dim // 2, dtype=torch.float64)
    return torch.as_tensor(float(base), dtype=torch.float64) ** (-2.0 * ell / head_dim)


def rope_cos_sin(spec: HeadSpec, positions: Any, dtype: torch.dtype = torch.float64,
                 device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the RoPE angles, shape ``(H or 1, P, d/2)``.

    From the spec's precomputed tables when present (a model's own float32 tables), else
    ``cos(p * omega_l)`` computed in float64 per head base and rounded once to ``dtype``.
    """
    pos = torch.as_tensor(_positions(positions, "positions"), device=device)
    d = spec.head_dim
    if spec.rope.cos is not None:
        cos = torch.as_tensor(np.asarray(spec.rope.cos) if not torch.is_tensor(spec.rope.cos)
                              else spec.rope.cos).to(device=device)
        sin = torch.as_tensor(np.asarray(spec.rope.sin) if not torch.is_tensor(spec.rope.sin)
                              else spec.rope.sin).to(device=device)
        return cos[pos].to(dtype)[None], sin[pos].to(dtype)[None]
    bases = spec.rope.bases(spec.n_heads)
    uniq = sorted(set(bases))
    if len(uniq) == 1:
        bases = bases[:1]
    omega = torch.stack([rope_frequencies(b, d) for b in bases]).to(device)  # (Hb, d/2)
    ang = pos.to(torch.float64)[None, :, None] * omega[:, None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate rows ``x (..., d)`` by ``R(p)``: ``x~ = x R(p)^T`` (pairs per ``layout``).

    ``cos``/``sin`` broadcast against ``x[..., :d/2]``.
    """
    d = x.shape[-1]
    if layout == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    raise ValueError(f"unknown RoPE layout {layout!r}")


def rope_generator(spec: HeadSpec, head: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The generator ``A`` (d x d, column convention ``R(p) = exp(p A)``) of head ``head``."""
    d = spec.head_dim
    omega = rope_frequencies(spec.rope.bases(spec.n_heads)[head], d)
    A = torch.zeros(d, d, dtype=torch.float64)
    for ell in range(d // 2):
        i, j = _pair(ell, d, spec.rope.layout)
        A[i, j], A[j, i] = -omega[ell], omega[ell]
    return A.to(dtype)


def rope_rotation(spec: HeadSpec, p: float, head: int = 0,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``R(p) = exp(p A)`` as a d x d matrix (column convention; rows rotate as ``x R^T``)."""
    d = spec.head_dim
    omega = rope_frequencies(spec.rope.bases(spec.n_heads)[head], d)
    R = torch.zeros(d, d, dtype=torch.float64)
    for ell in range(d // 2):
        i, j = _pair(ell, d, spec.rope.layout)
        c, s = math.cos(p * float(omega[ell])), math.sin(p * float(omega[ell]))
        R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R.to(dtype)


def rope_phi1(spec: HeadSpec, delta: float, head: int = 0,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``phi_1(delta A)``: per block ``(sin a/a) I + ((1 - cos a)/a) J_2`` with ``a = omega delta``.

    Then ``R(p + delta) - R(p) = delta A phi_1(delta A) R(p)`` exactly (MATH.md section 5).
    """
    d = spec.head_dim
    omega = rope_frequencies(spec.rope.bases(spec.n_heads)[head], d)
    F = torch.zeros(d, d, dtype=torch.float64)
    for ell in range(d // 2):
        i, j = _pair(ell, d, spec.rope.layout)
        a = float(omega[ell]) * delta
        if a == 0.0:
            sa, ca = 1.0, 0.0
        else:
            sa = math.sin(a) / a
            ca = 2.0 * math.sin(a / 2) ** 2 / a  # (1 - cos a)/a without cancellation
        F[i, i], F[j, j], F[i, j], F[j, i] = sa, sa, -ca, ca
    return F.to(dtype)


def rope_derivative(spec: HeadSpec, z0: Any, p: float, n: int = 1, head: int = 0) -> torch.Tensor:
    """``d^n/dp^n [R(p) z0] = A^n R(p) z0`` for column vectors ``z0`` (d, ...)."""
    if n < 0:
        raise ValueError(f"derivative order must be >= 0, got {n}")
    z = rope_rotation(spec, p, head) @ torch.as_tensor(z0, dtype=torch.float64)
    A = rope_generator(spec, head)
    for _ in range(n):
        z = A @ z
    return z


def rope_finite_difference(spec: HeadSpec, z: Any, delta: float, head: int = 0) -> torch.Tensor:
    """``z(p + delta) - z(p) = delta A phi_1(delta A) z(p)`` for column vectors ``z`` (d, ...)."""
    z = torch.as_tensor(z, dtype=torch.float64)
    A = rope_generator(spec, head)
    return delta * (A @ (rope_phi1(spec, delta, head) @ z))


def _pair(ell: int, d: int, layout: str) -> tuple[int, int]:
    return (ell, ell + d // 2) if layout == "half" else (2 * ell, 2 * ell + 1)


# ---------------------------------------------------------------------------------------------
# projections
# ---------------------------------------------------------------------------------------------
def _t(a: Any, dtype: torch.dtype, device: Any) -> torch.Tensor | None:
    if a is None:
        return None
    if not torch.is_tensor(a):
        a = torch.as_tensor(np.asarray(a))
    return a.to(device=device, dtype=dtype)


def augment(x: torch.Tensor) -> torch.Tensor:
    """``u = [x; 1]``."""
    return torch.cat((x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)), dim=-1)


def augmented_weight(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``W^ = [W; b^T]``: ``(m+1, heads, dim)`` with a zero bias row when ``b`` is None."""
    row = torch.zeros_like(w[:1]) if b is None else b[None]
    return torch.cat((w, row), dim=0)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _unit(x: torch.Tensor, name: str) -> torch.Tensor:
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    if bool((n == 0).any()):
        raise ValueError(f"cosine family: a {name} vector has zero norm and cannot be normalised")
    return x / n


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
    wk = augmented_weight(cast(weights.w_k), cast(weights.b_k))
    wv = augmented_weight(cast(weights.w_v), cast(weights.b_v))
    q = torch.einsum("qm,mhd->hqd", u_q, wq)
    k = torch.einsum("nm,mhd->hnd", u_k, wk)
    v = torch.einsum("nm,mhd->hnd", u_k, wv)
    if spec.family == "qknorm":
        q = _rms(q, cast(weights.q_norm), spec.norm_eps)
        k = _rms(k, cast(weights.k_norm), spec.norm_eps)
    elif spec.family == "cosine":
        q, k = _unit(q, "query"), _unit(k, "key")
    kv_of = torch.arange(spec.n_heads, device=q.device) // spec.group
    k, v = k[kv_of], v[kv_of]
    pq = torch.as_tensor(_positions(pos_q, "pos_q"), device=q.device)
    pk = torch.as_tensor(_positions(pos_kv, "pos_kv"), device=q.device)
    cos_q, sin_q = rope_cos_sin(spec, pq, cd, q.device)
    cos_k, sin_k = rope_cos_sin(spec, pk, cd, q.device)
    q = apply_rope(q, cos_q, sin_q, spec.rope.layout)
    k = apply_rope(k, cos_k, sin_k, spec.rope.layout)
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
    mask = resolve_mask(mask, pos_q, pos_kv, Qn, Nn)
    Q, N, m = check_inputs(spec, weights, x_q, pos_q, x_kv, pos_kv, mask, bias)
    if (delta_m or kind == "free") and not spec.affine:
        raise ValueError(f"family {spec.family!r} is not affine in u: Delta M and free gauges "
                         "are undefined (use the query-space readout)")
    P = project(spec, weights, x_q, pos_q, x_kv, pos_kv, dtype, device, bias)
    cd = P.q.dtype
    mk = torch.as_tensor(np.asarray(mask) if not torch.is_tensor(mask) else mask,
                         device=P.q.device).to(torch.bool)
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


def uniform_mean(v: torch.Tensor, mk: torch.Tensor) -> torch.Tensor:
    """``mu_i = (1/N_i) sum_{j in I_i} v_j``: the uniform mean, ``(H, Q, r)``.

    The only mean that makes the identity hold (MATH.md section 1).
    """
    return (mk.to(v.dtype)[None] @ v) / mk.sum(-1).to(v.dtype)[None, :, None]


def _kappa(weight: torch.Tensor, vc: torch.Tensor, v: torch.Tensor, m3: torch.Tensor
           ) -> torch.Tensor:
    """``sum_j weight_j (|v_j - mu|_inf + |v_j|_inf) / max_j |v_j|_inf`` over the permitted set."""
    va = torch.where(m3, v.abs().amax(-1)[:, None, :], torch.zeros_like(weight))  # (H, Qc, N)
    vn = vc.abs().amax(-1) + va
    return (weight * vn).sum(-1) / va.amax(-1).clamp_min(torch.finfo(vn.dtype).tiny)


def _step_chunk(P: Projected, mk: torch.Tensor, idx: slice, kind: str, g: torch.Tensor | None,
                want_dm: bool, softcap: float | None) -> dict[str, torch.Tensor]:
    q = P.q[:, idx]  # (H, Qc, d)
    k, v = P.k, P.v  # (H, N, d), (H, N, r)
    H, Qc, _ = q.shape
    s = q @ k.transpose(-1, -2)  # (H, Qc, N)
    beta = None if P.beta is None else P.beta[:, idx]
    if beta is not None:
        s = s + beta
    m3 = mk[None]  # (1, Qc, N)
    z = transform(s, softcap)
    neg = torch.finfo(s.dtype).min
    zmax = torch.where(m3, z, torch.full_like(z, neg)).amax(-1, keepdim=True)  # (H, Qc, 1)
    e = torch.where(m3, torch.exp(z - zmax), torch.zeros_like(z))
    zbar = e.sum(-1, keepdim=True)
    y = (e / zbar) @ v  # (H, Qc, r)
    mu = uniform_mean(v, mk)  # (H, Qc, r)
    vc = v[:, None] - mu[:, :, None]  # (H, Qc, N, r)
    vc = torch.where(m3[..., None], vc, torch.zeros_like(vc))
    out: dict[str, torch.Tensor] = {"s": s, "y": y, "mu": mu}

    if kind == "pairwise":
        return _pairwise_chunk(P, out, q, s, z, zmax, zbar, mk, vc, beta, softcap, idx, want_dm)

    # gauge anchor sigma (raw-score units) and offsets in query space
    koff = boff = None
    sigma = None
    if kind == "original":
        sig = torch.zeros_like(zmax)
    elif kind == "maxkey":
        # argmax of the raw score (phi is increasing): no ties from a saturated soft-cap
        jstar = torch.where(m3, s, torch.full_like(s, neg)).argmax(-1)  # (H, Qc)
        sig = torch.gather(s, -1, jstar[..., None])
        koff = torch.gather(k, 1, jstar[..., None].expand(H, Qc, k.shape[-1]))  # (H, Qc, d)
        if beta is not None:
            boff = torch.gather(beta, -1, jstar[..., None])  # (H, Qc, 1)
    else:  # free gauge g (H, m+1): sigma_i = u_i . g
        sig = (P.u_q[idx] @ g.T).T[..., None]  # (H, Qc, 1)
        sigma = sig[..., 0]
    zsig = transform(sig, softcap)
    c = scaled_phi1(z - zsig, zsig - zmax) * transform_dd(s, sig, softcap) / zbar
    c = torch.where(m3, c, torch.zeros_like(c))
    if not bool(torch.isfinite(c).all()):
        bad = (~torch.isfinite(c)).any(-1).nonzero()[0].tolist()
        raise FloatingPointError(
            f"gauge {kind!r} overflows in {s.dtype} at head {bad[0]}, query {idx.start + bad[1]}: "
            f"the gauge anchor sits {float((zsig - zmax)[bad[0], bad[1], 0]):.0f} above every "
            "score, so its coefficients exceed the float range (MATH.md section 2); "
            "use gauge='maxkey'")
    kc = k[:, None] if koff is None else k[:, None] - koff[:, :, None]  # (H, Qc|1, N, d)
    # condition number of the readout, relative to the value scale S = max_j |v_j|:
    #   kappa = sum_j |c_j| (|q| . |k~_j - k_o| + |beta_j - beta_o| + |sigma|) (|v_j - mu| + |v_j|) / S
    # -- the rounding of q . T scales with |q| . |k~_j - k_o| (>= |s_j - sigma|), and v_j - mu
    # itself carries a rounding error ~ u |v_j| that the sum then amplifies
    if koff is None:
        absdot = q.abs() @ k.abs().transpose(-1, -2)  # (H, Qc, N)
    else:
        absdot = (q.abs()[:, :, None, :] * kc.abs()).sum(-1)
    if beta is not None:
        absdot = absdot + (beta if boff is None else beta - boff).abs()
    if sigma is not None:
        absdot = absdot + sigma.abs()[..., None]
    out["kappa"] = _kappa(c.abs() * absdot, vc, v, m3)
    t = (c[..., None] * kc).transpose(-1, -2) @ vc  # (H, Qc, d, r)
    b = None
    if beta is not None:
        bc = beta if boff is None else beta - boff
        b = ((c * bc)[:, :, None] @ vc)[:, :, 0]  # (H, Qc, r)
    readout = mu + (q[:, :, None] @ t)[:, :, 0]
    if b is not None:
        readout = readout + b
    out.update(c=c, t=t, readout=readout)
    if b is not None:
        out["b"] = b
    if kind == "free":
        w = (c[:, :, None] @ vc)[:, :, 0]
        out["readout"] = readout - sigma[..., None] * w
        out.update(w=w, sigma=sigma)
    if want_dm:
        dm = P.lmap(idx) @ t  # (H, Qc, m+1, r)
        if b is not None:
            dm[:, :, -1] += b
        if kind == "free":
            dm = dm - g[:, None, :, None] * out["w"][:, :, None, :]
        out["delta_m"] = dm
    return out


def _pairwise_chunk(P, out, q, s, z, zmax, zbar, mk, vc, beta, softcap, idx, want_dm):
    """Pairwise gauge: ``T = (1/(N Z)) K~^T (diag(D 1) - D) V`` with ``D_jk = exp_phi[s_j, s_k]``.

    Exact O(N^2) per query; the entries are scaled by ``1/Z = e^{-z_max}/Zbar`` inside the
    exponentials so nothing overflows.
    """
    k = P.k
    m3 = mk[None]
    zj, zk = z[..., :, None], z[..., None, :]
    hi = torch.maximum(zj, zk)
    D = torch.exp(hi - zmax[..., None]) * phi1(-(zj - zk).abs())
    D = D * transform_dd(s[..., :, None], s[..., None, :], softcap)
    pm = (m3[..., :, None] & m3[..., None, :])
    D = torch.where(pm, D, torch.zeros_like(D)) / zbar[..., None]  # (H, Qc, N, N) = D/Zbar
    nper = mk.sum(-1).to(s.dtype)[None, :, None, None]
    lap = torch.diag_embed(D.sum(-1)) - D
    # (v - mu) in place of v is harmless: the Laplacian annihilates constants
    lv = lap @ vc / nper  # (H, Qc, N, r)
    # the Laplacian also annihilates constant keys/biases: centre them on the permitted mean so
    # a large common offset (e.g. a constant bias of -800) does not enter the sums at all
    w8 = mk.to(k.dtype)[None, :, :, None] / nper  # (1, Qc, N, 1)
    kc = k[:, None] - (w8 * k[:, None]).sum(2, keepdim=True)  # (H, Qc, N, d)
    t = kc.transpose(-1, -2) @ lv  # (H, Qc, d, r)
    readout = out["mu"] + (q[:, :, None] @ t)[:, :, 0]
    b = None
    if beta is not None:
        bc = beta - (w8[..., 0] * beta).sum(-1, keepdim=True)
        b = (bc[:, :, None] @ lv)[:, :, 0]
        readout = readout + b
        out["b"] = b
    # condition number: the contraction q . T rounds at |q| . |kc_j| per key, and lv_j itself
    # at sum_k D_jk (|v_j - mu| + |v_j| + |v_k - mu| + |v_k|) / N
    va = torch.where(m3, P.v.abs().amax(-1)[:, None, :], torch.zeros_like(s))
    vab = vc.abs().amax(-1) + va  # (H, Qc, N)
    lvb = (D.sum(-1) * vab + (D @ vab[..., None])[..., 0]) / nper[..., 0]
    absdot = (q.abs()[:, :, None, :] * kc.abs()).sum(-1)
    if beta is not None:
        absdot = absdot + bc.abs()
    out["kappa"] = (absdot * lvb).sum(-1) / va.amax(-1).clamp_min(torch.finfo(s.dtype).tiny)
    out.update(t=t, readout=readout)
    if want_dm:
        dm = P.lmap(idx) @ t
        if b is not None:
            dm[:, :, -1] += b
        out["delta_m"] = dm
    return out


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
    Valid in the original and max-key gauges.
    """
    if st.gauge not in ("original", "maxkey"):
        raise ValueError("descent() is defined in the original and max-key gauges")
    if st.c is None or st.t is None:
        raise ValueError("descent() needs c and t: call step(..., keep=('c','t','b'))")
    P: Projected = st.extras["projected"]
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
    ev, U = torch.linalg.eigh(G)
    Gh = U @ torch.diag_embed(ev.clamp_min(0).sqrt()) @ U.transpose(-1, -2)
    lam = torch.linalg.eigvalsh(Gh @ Mm @ Gh)[..., -1]
    mu = st.mu
    vc = P.v[:, None] - mu[:, :, None]
    e0 = 0.5 * (st.c * (vc * vc).sum(-1)).sum(-1)
    # a_j^T Delta M = k^_j L^^T (L^ tb): apply L^ first, so components of tb in the null space
    # of L^ (killed in Delta M) never meet a rounded Gram matrix
    pred = khat @ (Lh.transpose(-1, -2) @ (Lh @ tb))  # (H, Q, N, r)
    res = pred - vc
    e1 = 0.5 * (st.c * (res * res).sum(-1)).sum(-1)
    return DescentCheck(lam, e0, e1)


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
    if st.gauge != "original":
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
    """
    P: Projected = st.extras["projected"]
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


def self_mass(s_self: torch.Tensor, s_prefix: torch.Tensor, softcap: float | None = None
              ) -> torch.Tensor:
    """``pi = e^{z_self} / (sum_j e^{z_j} + e^{z_self})`` computed stably (``z = phi(s)``)."""
    zs, zp = transform(s_self, softcap), transform(s_prefix, softcap)
    return torch.softmax(torch.cat((zp, zs[..., None]), -1), -1)[..., -1]


def full_bank_mean(mu_prefix: torch.Tensor, v_self: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """Mean of the full bank (prefix plus self): ``(N mu + v_self)/(N + 1)``."""
    return (n_prefix * mu_prefix + v_self) / (n_prefix + 1)


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
