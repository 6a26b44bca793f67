"""The GPU path: the same kernel on CUDA in float32 and bfloat16, against the CPU float64 result
and against the mpmath oracle's tolerances.  Runs wherever a CUDA device is present
(``@pytest.mark.cuda``; skipped with the reason elsewhere)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ropestep import atlas, scale, tolerances
from test_scale import make_layer

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_identity_on_cuda(dtype):
    spec, w, x = make_layer(N=300, seed=2)
    cpu = scale.materialise(spec, w, x, gauge="maxkey")
    gpu = scale.materialise(spec, w, x, gauge="maxkey", dtype=dtype, device="cuda")
    ref = cpu["y"]
    err = float((gpu["readout"].double() - ref).abs().max() / ref.abs().max())
    tol = tolerances.agreement_rel_tol(dtype, 300, spec.head_dim, x.shape[1])
    print(dtype, err, tol)
    assert np.isfinite(err) and err <= tol


def test_float64_on_cuda_matches_cpu():
    spec, w, x = make_layer(N=200, seed=3)
    a = scale.identity_check(spec, w, x, gauge="original")
    b = scale.identity_check(spec, w, x, gauge="original", device="cuda")
    assert a.finite and b.finite
    assert float(b.max_rel.max()) <= tolerances.FLOAT64_REL


def test_atlas_layer_on_cuda_matches_cpu():
    spec, w, x = make_layer(N=64, seed=4)
    out = scale.materialise(spec, w, x, gauge="original")
    native = out["y"].permute(1, 0, 2).float()  # a float32 'model output'
    a = atlas.evaluate_layer(spec, w, x, torch.arange(64), native, anchor_every=16)
    b = atlas.evaluate_layer(spec, w, x, torch.arange(64), native, anchor_every=16,
                             device="cuda")
    for k in ("lam_query", "lam_input", "kappa_original", "tv"):
        fa, fb = a.arrays[k], b.arrays[k]
        sel = ~np.isnan(fa)
        assert np.array_equal(sel, ~np.isnan(fb))
        assert np.max(np.abs(fa[sel] - fb[sel]) / np.maximum(np.abs(fa[sel]), 1)) <= tolerances.FLOAT64_REL
