"""QK-norm after the rotation (Hunyuan: ``HeadSpec.norm_after_rope``): ``q~ = g RMS(R(p) q)``.

With a per-dim gain ``g`` the norm does not commute with the rotation (``g R q != R g q``), so
this is another head than QK-norm before RoPE (Qwen3); the identity holds in query space with
the normed rotated vectors.  The fast layer's per-query and streamed paths against the mpmath
oracle (which normalises the rotated vectors at 40 digits), and the power: the same weights read
with the norm before the rotation give another head.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from ropestep import exact, fast, scale, tolerances
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

H, HK, D, M, N = 2, 1, 4, 5, 7


def _case(seed: int):
    rng = np.random.default_rng(seed)
    spec = HeadSpec(H, HK, D, rope=RoPESpec(base=30.0), family="qknorm", norm_after_rope=True)
    w = HeadWeights(w_q=rng.standard_normal((M, H, D)), w_k=rng.standard_normal((M, HK, D)),
                    w_v=rng.standard_normal((M, HK, D)), b_k=rng.standard_normal((HK, D)),
                    q_norm=rng.uniform(0.5, 1.5, D), k_norm=rng.uniform(0.5, 1.5, D))
    return spec, w, rng.standard_normal((N, M)), np.arange(N)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_norm_after_rope_against_the_oracle(seed):
    spec, w, x, pos = _case(seed)
    E = exact.build(spec, w, x, pos, x, pos, "causal", dps=40)
    y_ex = exact.to_float(E.y)
    vs = np.abs(exact.to_float(E.v)).max()
    for g in ("original", "maxkey"):
        st = fast.step(spec, w, x, pos, x, pos, "causal", gauge=g)
        assert np.abs(st.y.numpy() - y_ex).max() / vs <= tolerances.FLOAT64_REL
        tol = np.maximum(tolerances.FLOAT64_REL, tolerances.readout_bound(
            torch.float64, st.kappa.numpy(), N, D, np.abs(st.s.numpy()).max(-1)))
        assert (np.abs(st.readout.numpy() - y_ex).max(-1) / vs <= tol).all()
        got = scale.materialise(spec, w, x, pos, gauge=g)
        assert float((got["y"] - st.y).abs().max()) / vs <= tolerances.FLOAT64_REL
    before = fast.step(replace(spec, norm_after_rope=False), w, x, pos, x, pos, "causal")
    assert np.abs(before.y.numpy() - y_ex).max() / vs > 1e6 * tolerances.FLOAT64_REL


def test_norm_after_rope_is_for_per_head_qk_norm_only():
    spec, *_ = _case(0)
    with pytest.raises(ValueError, match="norm_after_rope"):
        replace(spec, family="dot")
    with pytest.raises(ValueError, match="norm_after_rope"):
        replace(spec, norm_scope="all")
