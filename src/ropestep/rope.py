"""RoPE definitions: frequencies, cos/sin tables, the rotation of row vectors, the generator,
``phi_1(delta A)`` and the exact positional finite difference (docs/math.md sections 1 and 5).

Torch, float64 by default.  Imported by the kernel, the fast paths and the model adapter; it
imports nothing of ropestep but :mod:`ropestep.spec`.  Pairing conventions: ``layout="half"``
pairs dim ``l`` with ``l + d/2`` (Hugging Face ``rotate_half``), ``"interleaved"`` pairs ``2l``
with ``2l + 1`` (GPT-J / Meta); frequency ``omega_l = base^(-2l/d)`` decreases with ``l``, so the
first pair rotates fastest.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .spec import HeadSpec, _positions

# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def rope_frequencies(base: float, head_dim: int) -> torch.Tensor:
    """``omega_l = base^(-2l/d)`` for ``l = 0..d/2-1`` in float64."""
    ell = torch.arange(head_dim // 2, dtype=torch.float64)
    return torch.as_tensor(float(base), dtype=torch.float64) ** (-2.0 * ell / head_dim)


def spec_frequencies(spec: HeadSpec, head: int = 0) -> torch.Tensor:
    """Head ``head``'s pair frequencies: ``spec.rope.freqs`` when given, else its base's."""
    if spec.rope.freqs is not None:
        return torch.tensor([float(f) for f in spec.rope.freqs], dtype=torch.float64)
    return rope_frequencies(spec.rope.bases(spec.n_heads)[head], spec.head_dim)


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
    if spec.rope.freqs is not None:
        omega = spec_frequencies(spec)[None].to(device)
    ang = pos.to(torch.float64)[None, :, None] * omega[:, None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def query_cos_sin(spec: HeadSpec, positions: Any, dtype: torch.dtype = torch.float64,
                  device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries' tables: :func:`rope_cos_sin` times the query temperature ``tau(p)`` where
    the spec has one (``HeadSpec.query_temperature``: Llama 4's NoPE layers), so that
    ``apply_rope`` with them gives ``tau(p) R(p) q`` -- and ``L_i = tau(p_i) W R(p_i)`` wherever
    a query's map is formed from its tables.  ``tau`` is computed in float64 and the products
    rounded once to ``dtype``; keys keep :func:`rope_cos_sin`."""
    if spec.query_temperature is None:
        return rope_cos_sin(spec, positions, dtype, device)
    cos, sin = rope_cos_sin(spec, positions, torch.float64, device)
    f, a = spec.query_temperature
    p = torch.as_tensor(_positions(positions, "positions"), device=device).to(torch.float64)
    tau = 1.0 + float(a) * torch.log1p(torch.floor((p + 1.0) / float(f)))
    return (cos * tau[None, :, None]).to(dtype), (sin * tau[None, :, None]).to(dtype)


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
    omega = spec_frequencies(spec, head)
    A = torch.zeros(d, d, dtype=torch.float64)
    for ell in range(d // 2):
        i, j = pair_indices(ell, d, spec.rope.layout)
        A[i, j], A[j, i] = -omega[ell], omega[ell]
    return A.to(dtype)


def rope_rotation(spec: HeadSpec, p: float, head: int = 0,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``R(p) = exp(p A)`` as a d x d matrix (column convention; rows rotate as ``x R^T``)."""
    d = spec.head_dim
    omega = spec_frequencies(spec, head)
    R = torch.zeros(d, d, dtype=torch.float64)
    for ell in range(d // 2):
        i, j = pair_indices(ell, d, spec.rope.layout)
        c, s = math.cos(p * float(omega[ell])), math.sin(p * float(omega[ell]))
        R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R.to(dtype)


def rope_phi1(spec: HeadSpec, delta: float, head: int = 0,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``phi_1(delta A)``: per block ``(sin a/a) I + ((1 - cos a)/a) J_2`` with ``a = omega delta``.

    Then ``R(p + delta) - R(p) = delta A phi_1(delta A) R(p)`` exactly (docs/math.md section 5).
    """
    d = spec.head_dim
    omega = spec_frequencies(spec, head)
    F = torch.zeros(d, d, dtype=torch.float64)
    for ell in range(d // 2):
        i, j = pair_indices(ell, d, spec.rope.layout)
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


def pair_indices(ell: int, d: int, layout: str) -> tuple[int, int]:
    return (ell, ell + d // 2) if layout == "half" else (2 * ell, 2 * ell + 1)



# ---------------------------------------------------------------------------------------------
# frequency bands and the per-head-base "barycenter" (docs/math.md section 10)
# ---------------------------------------------------------------------------------------------
def frequency_index(head_dim: int, layout: str) -> torch.Tensor:
    """The RoPE pair index ``l`` of every head dimension ``c = 0..d-1`` (int64, shape ``(d,)``).

    ``layout="half"``: ``l = c mod d/2``; ``"interleaved"``: ``l = c // 2``.  Pair ``l`` turns at
    ``omega_l = base^(-2l/d)``: ``l = 0`` is the *fastest* pair (one radian per position) and
    ``l = d/2 - 1`` the slowest, for every base.  Raising the base slows every pair but the first.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    c = torch.arange(head_dim)
    if layout == "half":
        return c % (head_dim // 2)
    if layout == "interleaved":
        return c // 2
    raise ValueError(f"unknown RoPE layout {layout!r}")


def band_energy(w: torch.Tensor, layout: str) -> torch.Tensor:
    """Squared Frobenius energy of a head's projection per RoPE pair, shape ``(d/2,)``.

    ``w`` is one head's projection in math layout ``(m, d)`` (column ``c`` is head dimension
    ``c``; a PyTorch ``Linear`` row).  Pair ``l`` collects its two dimensions.
    """
    if w.ndim != 2:
        raise ValueError(f"band_energy: expected one head's (m, d) projection, got {tuple(w.shape)}")
    d = w.shape[1]
    ell = frequency_index(d, layout).to(w.device)
    col = (w.to(torch.float64) ** 2).sum(0)
    return torch.zeros(d // 2, dtype=torch.float64, device=w.device).index_add_(0, ell, col)


def barycenter(w_q: torch.Tensor, w_k: torch.Tensor, layout: str) -> float:
    """Where a head "lives" along the frequency axis, ``t`` in ``[0, 1]``.

    The seed document's heuristic made precise: the importance of head dimension ``c`` is the sum
    of the norms of its W_q and W_k rows (``||w_q[:, c]|| + ||w_k[:, c]||``, math layout
    ``(m, d)``); each dimension sits at ``l(c) / (d/2 - 1)`` on the frequency axis, with ``l(c)``
    its RoPE pair (:func:`frequency_index`); ``t`` is the importance-weighted mean position.
    ``t = 0``: the head's energy is in the fast (high-frequency, short-range) pairs; ``t = 1``: in
    the slow (long-range) pairs.  (The document's sketch indexes the concatenated [W_q; W_k] rows
    0..2d-1 directly, which puts every key row on the slow half of the axis whatever the layout;
    here queries and keys share the axis and the layout decides the pairing.)
    """
    if w_q.shape != w_k.shape or w_q.ndim != 2:
        raise ValueError(f"barycenter: W_q {tuple(w_q.shape)} and W_k {tuple(w_k.shape)} must be "
                         f"one head's (m, d) projections of the same shape")
    d = w_q.shape[1]
    if d < 4:
        raise ValueError(f"barycenter needs head_dim >= 4 (two RoPE pairs), got {d}")
    imp = w_q.to(torch.float64).norm(dim=0) + w_k.to(torch.float64).norm(dim=0)
    if not torch.isfinite(imp).all():
        raise ValueError("barycenter: W_q/W_k contain NaN or inf")
    total = float(imp.sum())
    if total <= 0.0:
        raise ValueError("barycenter: W_q and W_k of this head are zero")
    pos = frequency_index(d, layout).to(torch.float64).to(imp.device) / (d // 2 - 1)
    return float((imp * pos).sum()) / total


def barycenter_base(t: float, base_min: float = 1e3, base_max: float = 1e6) -> float:
    """The document's geometric interpolation ``base_min^(1-t) * base_max^t`` (``t`` in [0, 1])."""
    if not (0.0 <= t <= 1.0) or not math.isfinite(t):
        raise ValueError(f"barycenter t must lie in [0, 1], got {t}")
    if not (0.0 < base_min <= base_max) or not math.isfinite(base_max):
        raise ValueError(f"base range must satisfy 0 < base_min <= base_max < inf, got "
                         f"[{base_min}, {base_max}]")
    return float(math.exp((1.0 - t) * math.log(base_min) + t * math.log(base_max)))
