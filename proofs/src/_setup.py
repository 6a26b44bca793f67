# Setup shared by every notebook (generated from proofs/src/_setup.py): the library under test
# and a random small head.  Plumbing only -- every formula lives in ropestep.
import numpy as np
import torch
import mpmath as mp
import sympy as sp
from IPython.display import Math, display

from ropestep import exact, fast, symbolic
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec

DPS = 60  # working precision of the mpmath oracle
EPS64, EPS32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps


def random_head(seed, *, m=5, d=4, r=3, n_heads=2, n_kv_heads=1, biases=True, gain=1.0,
                **spec_kw):
    """HeadSpec and Gaussian HeadWeights (query/key weights scaled by ``gain``)."""
    rng = np.random.default_rng(seed)
    spec = HeadSpec(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=d, v_dim=r, **spec_kw)
    g = lambda *shape, s=1.0: s * rng.standard_normal(shape)
    w = HeadWeights(w_q=g(m, n_heads, d, s=gain), w_k=g(m, n_kv_heads, d, s=gain),
                    w_v=g(m, n_kv_heads, r),
                    b_q=g(n_heads, d, s=gain) if biases else None,
                    b_k=g(n_kv_heads, d, s=gain) if biases else None,
                    b_v=g(n_kv_heads, r) if biases else None)
    if spec.family == "qknorm":
        w.q_norm, w.k_norm = 1 + 0.1 * g(d), 1 + 0.1 * g(d)
    return spec, w


def as_mp(a):
    """An mpf object array from a tensor, a float/mpf array or list, or an mp.matrix (exact)."""
    if isinstance(a, mp.matrix):
        a = a.tolist()
    if isinstance(a, (list, tuple)):
        a = np.array(a, dtype=object)
    with mp.workdps(DPS):  # mpf(x) rounds to the working precision: keep it at DPS
        return exact.to_mp(a)


def mp_max_abs_diff(a, b):
    """max |a - b| over two arrays, evaluated at DPS digits (floats are converted exactly)."""
    a, b = as_mp(a), as_mp(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    with mp.workdps(DPS):
        return max((abs(x - y) for x, y in zip(a.reshape(-1), b.reshape(-1))), default=mp.mpf(0))


def show(lhs, expr=None):
    """Display ``lhs = latex(expr)`` (or a bare LaTeX string)."""
    display(Math(lhs if expr is None else lhs + " = " + sp.latex(expr)))
