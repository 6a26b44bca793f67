"""The paper-form reference in torch: one query at a time, features in the augmented input space.

This is the slow, explicit evaluation beside the batched paths, written as the paper writes it
(docs/math.md section 3): features ``a_ij = L_i k~_j^T`` (``(N_i, m+1)`` per head), scores
``s_ij = u_i^T a_ij``, coefficients ``c_ij = phi_1(s_ij)/Z_i`` and
``Delta M_i = sum_j c_ij a_ij (v_j - mu_i)^T``.  It deliberately shares nothing with
:mod:`ropestep.kernel` but ``phi_1`` itself, so tests and benchmarks can set the two side by side.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .kernel import phi1

if TYPE_CHECKING:  # the projected layer type only; no runtime import of the scale path
    from .scale import Layer


def direct_query(L: "Layer", i: int, heads: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The paper's evaluation of query ``i`` (original gauge), vectorised over keys.

    Features ``a_ij = L_i k~_j^T + beta_ij e_{m+1}`` are formed explicitly (``(N_i, m+1)`` per
    head), ``s_ij = u_i^T a_ij``, ``c_ij = phi1(s_ij)/Z_i`` and
    ``Delta M_i = sum_j c_ij a_ij (v_j - mu_i)^T``.  Returns ``delta_m (G, m+1, r)``,
    ``y, mu, readout (G, r)`` and ``s (G, N_i)`` for the selected heads (default all).
    """
    spec = L.spec
    if L.lw is None:
        raise ValueError(f"family {spec.family!r} is not affine in u: no features a_ij")
    if spec.softcap is not None:
        raise NotImplementedError("direct_query implements the identity family phi = id")
    hs = list(range(spec.n_heads)) if heads is None else list(heads)
    n = int(torch.searchsorted(L.pos, L.pos[i], right=True))
    u = torch.cat((L.x[i], torch.ones(1, dtype=L.x.dtype, device=L.x.device)))  # (m+1,)
    Li = L.lmap(i)[hs]  # (G, m+1, d)
    gi = [L.group_of(h) for h in hs]
    k = L.k[gi, :n]  # (G, n, d)
    v = L.v[[L.kv_of_group[g] for g in gi], :n]  # (G, n, r)
    a = k @ Li.transpose(-1, -2)  # (G, n, m+1)  features a_ij
    if L.slopes is not None:
        a[..., -1] += -L.slopes[hs][:, None] * (L.pos[i] - L.pos[:n]).to(a.dtype)[None]
    s = a @ u  # (G, n)  s_ij = u_i^T a_ij
    sm = s.amax(-1, keepdim=True)
    zbar = torch.exp(s - sm).sum(-1, keepdim=True)
    c = torch.exp(-sm) * phi1(s) / zbar  # phi1(s)/Z
    if not bool(torch.isfinite(c).all()):
        raise FloatingPointError(
            f"direct_query: phi1(s)/Z overflows in {c.dtype} at query {i} (every score is "
            f"below {float(sm.max()):.0f}; the original gauge's 1/Z leaves the float range)")
    mu = v.mean(1)  # (G, r)
    vc = v - mu[:, None]
    dm = a.transpose(-1, -2) @ (c[..., None] * vc)  # (G, m+1, r)
    y = (torch.softmax(s, -1)[:, None] @ v)[:, 0]
    readout = mu + (u @ dm)
    return {"delta_m": dm, "y": y, "mu": mu, "readout": readout, "s": s}
