"""Clipped projections (DBRX's ``clip_qkv``, ``HeadSpec.clip``): every projected query, key and
value entry clamped to ``[-clip, clip]`` before any norm or rotation.

The clamp is piecewise linear, so the score is not affine in ``u`` and the identity is measured
in query space (docs/math.md section 13).  The fast layer's per-query and streamed paths against
the mpmath oracle (which clamps the same entries at 40 digits), and the power: a description
without the clip misses a head whose projections reach it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from ropestep import exact, fast, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

H, HK, D, M, N = 2, 1, 4, 5, 7


def _case(seed: int, clip: float = 1.0):
    rng = np.random.default_rng(seed)
    spec = HeadSpec(H, HK, D, rope=RoPESpec(base=30.0), clip=clip)
    w = HeadWeights(w_q=rng.standard_normal((M, H, D)), w_k=rng.standard_normal((M, HK, D)),
                    w_v=rng.standard_normal((M, HK, D)), b_q=rng.standard_normal((H, D)),
                    b_v=rng.standard_normal((HK, D)))
    return spec, w, rng.standard_normal((N, M)), np.arange(N)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clipped_heads_against_the_oracle(seed):
    spec, w, x, pos = _case(seed)
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=40)
    y_ex = exact.to_float(E.y)
    vs = np.abs(exact.to_float(E.v)).max()
    assert vs <= spec.clip  # the values are clipped too
    assert not spec.affine
    for g in ("original", "maxkey"):
        st = fast.step(spec, w, x, pos, x, pos, "causal", gauge=g)
        assert np.abs(st.y.numpy() - y_ex).max() / vs <= tolerances.FLOAT64_REL
        tol = np.maximum(tolerances.FLOAT64_REL, tolerances.readout_bound(
            torch.float64, st.kappa.numpy(), N, D,
            np.abs(st.s.numpy()).max(-1)))
        assert (np.abs(st.readout.numpy() - y_ex).max(-1) / vs <= tol).all()
        got = scale.materialise(spec, w, x, pos, gauge=g)
        assert float((got["y"] - st.y).abs().max()) / vs <= tolerances.FLOAT64_REL
    # power: the clip is active here, so a description without it is another head
    st0 = fast.step(replace(spec, clip=None), w, x, pos, x, pos, "causal")
    assert np.abs(st0.y.numpy() - y_ex).max() / vs > 1e6 * tolerances.FLOAT64_REL


def test_clip_is_a_positive_bound():
    spec, *_ = _case(0)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="clip must be finite and > 0"):
            replace(spec, clip=bad)
