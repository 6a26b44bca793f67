"""Test-side helpers to compare the fast layer with the exact oracle (no library math here)."""
from __future__ import annotations

import mpmath as mp
import numpy as np

from ropestep import exact


def out_scale(E: exact.ExactHead, h: int, i: int) -> mp.mpf:
    """Scale of head h's output at query i: max |v_j| over the permitted set (>= |y|, |mu|)."""
    js = np.flatnonzero(E.mask[i])
    return max([abs(E.v[h, j, q]) for j in js for q in range(E.spec.r)] + [mp.mpf(1e-300)])


def mat_scale(M) -> mp.mpf:
    return max([abs(x) for x in M] + [mp.mpf(1e-300)])


def gauges_for(spec, m: int):
    gs = ["original", "maxkey", "pairwise"]
    if spec.affine:
        rng = np.random.default_rng(m)
        gs.append(rng.standard_normal(m + 1) * 0.3)
    return gs


def gauge_name(g) -> str:
    return g if isinstance(g, str) else "free"


def top2_gap(E: exact.ExactHead, h: int, i: int) -> float:
    """Gap between the two largest transformed scores (max-key gauge ties make j* ambiguous)."""
    js = np.flatnonzero(E.mask[i])
    z = sorted((float(exact.score_transform(E.s[h, i, j], E.spec.softcap)) for j in js),
               reverse=True)
    return z[0] - z[1] if len(z) > 1 else np.inf
