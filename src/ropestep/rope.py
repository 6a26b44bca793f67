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
        i, j = pair_indices(ell, d, spec.rope.layout)
        A[i, j], A[j, i] = -omega[ell], omega[ell]
    return A.to(dtype)


def rope_rotation(spec: HeadSpec, p: float, head: int = 0,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``R(p) = exp(p A)`` as a d x d matrix (column convention; rows rotate as ``x R^T``)."""
    d = spec.head_dim
    omega = rope_frequencies(spec.rope.bases(spec.n_heads)[head], d)
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
    omega = rope_frequencies(spec.rope.bases(spec.n_heads)[head], d)
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

