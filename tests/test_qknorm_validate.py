"""QK-norm heads in ``validate``'s evaluation: the query-space identity, frozen reuse and its
bound (docs/math.md section 13, "QK-norm in `validate`"; docs/protocol.md section 12).

On the protocol's geometry (``Q`` candidates at one position ``N`` reading a prefix bank of
``N`` keys), for a per-head and an all-heads QK-norm head:

* :func:`ropestep.contextcheck.explicit_readout` (``mu + z_i^T dM^q_i``) against the mpmath oracle's
  softmax output at 50 digits;
* the frozen readout ``mu + z_i^T dM^q_0`` against the oracle's, built from its own query-space
  input and matrix (:func:`ropestep.exact.query_space_input`, ``query_space_delta_m``);
* :func:`ropestep.fast.reuse_bound`: every frozen error is inside it, and it equals the oracle's
  ``||z_i|| ||dM^q_i - dM^q_0||_op``;
* power: the unnormalised (``dot``) readout of the same weights misses the oracle's output.
"""
from __future__ import annotations

import mpmath as mp
import numpy as np
import pytest
import torch

from ropestep import contextcheck, exact, fast, tolerances
from ropestep.spec import HeadSpec, HeadWeights

from test_qknorm_scope import D, H, M, N, _head  # noqa: E402  (the suite's QK-norm heads)

Q = 4
F64 = torch.float64


def _case(scope: str):
    """A QK-norm layer (per head or over all heads) with its bank and ``Q`` candidates."""
    spec, w, _, xp = _head(scope)
    xq = torch.randn(Q, M, generator=torch.Generator().manual_seed(5), dtype=F64)
    return spec, w, xp, xq


def _oracle(spec, w, xp, xq):
    pos_kv, pos_q = np.arange(N), np.full(Q, N)
    mask = np.ones((Q, N), dtype=bool)
    E = exact.build(spec, w, xq.numpy(), pos_q, xp.numpy(), pos_kv, mask, dps=50)
    y = torch.as_tensor(exact.to_float(E.y))  # (H, Q, r)
    with mp.workdps(50):
        frozen = torch.zeros(H, Q, D, dtype=F64)
        bound = torch.zeros(H, Q, dtype=F64)
        for h in range(H):
            M0 = exact.query_space_delta_m(E, h, 0)
            for i in range(Q):
                z = mp.matrix(exact.query_space_input(E, h, i))
                Mi = exact.query_space_delta_m(E, h, i)
                f = [E.mu[h, i][c] + sum(z[k] * M0[k, c] for k in range(M0.rows))
                     for c in range(M0.cols)]
                frozen[h, i] = torch.tensor([float(v) for v in f], dtype=F64)
                dM = np.array((Mi - M0).tolist(), dtype=float)
                bound[h, i] = float(mp.norm(z, 2)) * float(np.linalg.norm(dM, 2))
    return y, frozen, bound


@pytest.mark.parametrize("scope", ["head", "all"])
def test_query_space_identity_reuse_and_bound_against_the_oracle(scope):
    spec, w, xp, xq = _case(scope)
    st = fast.step(spec, w, xq, torch.full((Q,), N), xp, torch.arange(N), mask="bank", dtype=F64)
    y_ex, fr_ex, bd_ex = _oracle(spec, w, xp, xq)
    tol = tolerances.agreement_rel_tol(F64, N, D, M) * float(y_ex.abs().max())
    assert float((contextcheck.explicit_readout(st, xq) - y_ex).abs().max()) <= tol
    reuse = fast.frozen_reuse(st, anchor=0, bound=False)
    assert float((reuse.frozen - fr_ex).abs().max()) <= tol
    bound = fast.reuse_bound(st, anchor=0)
    err = torch.linalg.vector_norm(reuse.error, dim=-1)
    assert bool((err[:, 1:] <= bound[:, 1:] * (1 + 1e-9)).all())
    # the same bound as the oracle's (a 2-norm of a rounded (d+1) x r matrix: agreement level)
    assert float((bound - bd_ex).abs().max()) <= tol * float(bd_ex.max()) / float(y_ex.abs().max()) \
        + tolerances.FLOAT64_REL * float(bd_ex.max())
    # power: the same weights without the norms are another head
    dot = HeadSpec(**{**spec.__dict__, "family": "dot", "norm_scope": "head"})
    st_dot = fast.step(dot, HeadWeights(**{**w.__dict__, "q_norm": None, "k_norm": None}), xq,
                       torch.full((Q,), N), xp, torch.arange(N), mask="bank", dtype=F64)
    assert float((st_dot.y - y_ex).abs().max()) > 1e3 * tol


def test_a_bound_without_the_query_norm_is_violated():
    """Power of the bound check: ``||dM^q_i - dM^q_0||_op`` alone (no ``||z_i||``) is smaller than
    some frozen error (``||z_i|| > 1`` on these heads: ``z_i = [q~_i; 1]``)."""
    spec, w, xp, xq = _case("head")
    st = fast.step(spec, w, xq, torch.full((Q,), N), xp, torch.arange(N), mask="bank", dtype=F64)
    dq = fast.query_delta_m(st)
    op = torch.linalg.matrix_norm(dq - dq[:, :1], ord=2)
    err = torch.linalg.vector_norm(fast.frozen_reuse(st, 0, bound=False).error, dim=-1)
    assert bool((err[:, 1:] > op[:, 1:]).any())
