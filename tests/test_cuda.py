"""The GPU path: the same kernel on CUDA in float32 and bfloat16, against the CPU float64 result
and against the mpmath oracle's tolerances.  Runs wherever a CUDA device is present
(``@pytest.mark.cuda``; skipped with the reason elsewhere)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ropestep import layercheck, scale, tolerances
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
    # the softmax output against the readout on the GPU: two orders of the same sums, the
    # whole-layer agreement bound (as ropestep sweep holds it to), not FLOAT64_REL alone
    tol = tolerances.agreement_rel_tol(torch.float64, 200, spec.head_dim)
    assert float(a.max_rel.max()) <= tol and float(b.max_rel.max()) <= tol


def test_atlas_layer_on_cuda_matches_cpu():
    spec, w, x = make_layer(N=64, seed=4)
    out = scale.materialise(spec, w, x, gauge="original")
    native = out["y"].permute(1, 0, 2).float()  # a float32 'model output'
    a = layercheck.evaluate_layer(spec, w, x, torch.arange(64), native, anchor_every=16)
    b = layercheck.evaluate_layer(spec, w, x, torch.arange(64), native, anchor_every=16,
                             device="cuda")
    # CPU and GPU sum in different orders: each side is within its own bound of the exact
    # value, so they differ by up to twice it -- kappa: KAPPA_REL relative (its derivation);
    # lambda_max and tv: FLOAT64_REL (what tests/test_atlas.py holds each side to)
    per_side = {"lam_query": tolerances.FLOAT64_REL, "lam_input": tolerances.FLOAT64_REL,
                "kappa_original": tolerances.KAPPA_REL, "tv": tolerances.FLOAT64_REL}
    for k, tol in per_side.items():
        fa, fb = a.arrays[k], b.arrays[k]
        sel = ~np.isnan(fa)
        assert np.array_equal(sel, ~np.isnan(fb))
        assert np.max(np.abs(fa[sel] - fb[sel]) / np.maximum(np.abs(fa[sel]), 1)) <= 2 * tol, k
