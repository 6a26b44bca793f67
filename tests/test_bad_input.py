"""Bad input raises a clear ValueError/TypeError that names the problem (issue 2)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ropestep import exact, fast
from ropestep.spec import HeadSpec, HeadWeights, RoPESpec
from strategies import make_problem


def _p():
    return make_problem(seed=1, m=3, H=2, Hk=1, d=4, r=2, N=4)


BOTH = [pytest.param(fast.step, id="fast"), pytest.param(exact.build, id="exact")]


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("what,val", [("x_q", np.nan), ("x_kv", np.inf), ("w_q", np.nan),
                                      ("b_k", -np.inf), ("w_v", np.nan)])
def test_nan_inf(fn, what, val):
    p = _p()
    args = list(p.args())
    if what in ("x_q", "x_kv"):
        i = 2 if what == "x_q" else 4
        args[i] = args[i].copy()
        args[i][1, 0] = val
    else:
        arr = getattr(p.weights, what).copy()
        arr.flat[0] = val
        setattr(p.weights, what, arr)
    with pytest.raises(ValueError, match=f"{what} contains NaN or inf"):
        fn(*args)


@pytest.mark.parametrize("fn", BOTH)
def test_empty_permitted_set(fn):
    p = _p()
    mask = p.mask.copy()
    mask[2] = False
    with pytest.raises(ValueError, match=r"empty permitted set: queries \[2\]"):
        fn(p.spec, p.weights, p.x_q, p.pos_q, p.x_kv, p.pos_kv, mask)


@pytest.mark.parametrize("fn", BOTH)
def test_empty_bank(fn):
    p = _p()
    with pytest.raises(ValueError, match="empty bank"):
        fn(p.spec, p.weights, p.x_q, p.pos_q, p.x_kv[:0], p.pos_kv[:0],
           np.ones((p.x_q.shape[0], 0), bool))
    with pytest.raises(ValueError, match="empty bank"):
        fn(p.spec, p.weights, p.x_q, p.pos_q, p.x_kv[:0], p.pos_kv[:0], "bank")


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("case", ["x_width", "x_q_1d", "pos_len", "mask_shape", "w_k_shape",
                                  "b_q_shape", "bias_shape"])
def test_mismatched_shapes(fn, case):
    p = _p()
    spec, w, xq, pq, xk, pk, mk = p.args()
    kw = {}
    if case == "x_width":
        xk = xk[:, :2]
        msg = "width"
    elif case == "x_q_1d":
        xq = xq[0]
        msg = "2-D"
    elif case == "pos_len":
        pq = pq[:-1]
        msg = "pos_q must have shape"
    elif case == "mask_shape":
        mk = mk[:, :-1]
        msg = "mask must have shape"
    elif case == "w_k_shape":
        w.w_k = w.w_k[:, :, :2]
        msg = "w_k must have shape"
    elif case == "b_q_shape":
        w.b_q = w.b_q[:1]
        msg = "b_q must have shape"
    else:
        kw["bias"] = np.zeros((3, 3))
        msg = "bias must have shape"
    with pytest.raises(ValueError, match=msg):
        fn(spec, w, xq, pq, xk, pk, mk, **kw)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(n_heads=2, n_kv_heads=1, head_dim=5), "even head_dim"),
    (dict(n_heads=3, n_kv_heads=2, head_dim=4), "does not divide"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, rope=RoPESpec(base=0.0)), "base must be"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, rope=RoPESpec(base=-3.0)), "base must be"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, rope=RoPESpec(base=(10.0,))), "per-head bases"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, family="cosine", temperature=0.0), "tau_h"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, family="cosine", temperature=(1.0, -1.0)), "tau_h"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, scale=0.0), "scale"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, softcap=-1.0), "softcap"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, family="flash"), "unknown score family"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, rope=RoPESpec(layout="zigzag")), "layout"),
    (dict(n_heads=2, n_kv_heads=1, head_dim=4, alibi_slopes=(1.0,)), "ALiBi"),
    (dict(n_heads=0, n_kv_heads=1, head_dim=4), "n_heads must be >= 1"),
])
def test_bad_spec(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        HeadSpec(**kwargs)


def test_type_errors():
    with pytest.raises(TypeError, match="n_heads must be an int"):
        HeadSpec(n_heads=2.0, n_kv_heads=1, head_dim=4)
    p = _p()
    with pytest.raises(TypeError, match="mask must be boolean"):
        fast.step(*p.args()[:6], p.mask.astype(int))
    with pytest.raises(TypeError, match="integer positions"):
        fast.step(p.spec, p.weights, p.x_q, p.pos_q + 0.5, p.x_kv, p.pos_kv, p.mask)
    with pytest.raises(TypeError, match="unsupported dtype"):
        fast.step(*p.args(), dtype=torch.int32)
    with pytest.raises(TypeError, match="spec must be a HeadSpec"):
        fast.step(None, *p.args()[1:])
    with pytest.raises(TypeError, match="w_q must be an array"):
        fast.step(p.spec, HeadWeights(w_q=[[1.0]], w_k=p.weights.w_k, w_v=p.weights.w_v),
                  *p.args()[2:])


def test_family_and_gauge_errors():
    p = make_problem(seed=2, family="cosine", temperature=1.0, N=4)
    with pytest.raises(ValueError, match="not affine"):
        fast.step(*p.args(), delta_m=True)
    with pytest.raises(ValueError, match="not affine"):
        fast.step(*p.args(), gauge=np.zeros(p.x_q.shape[1] + 1))
    q = _p()
    with pytest.raises(ValueError, match="gauge vector must have shape"):
        fast.step(*q.args(), gauge=np.zeros(2))
    with pytest.raises(ValueError, match="unknown gauge"):
        fast.step(*q.args(), gauge="minkey")
    with pytest.raises(ValueError, match="gauge vector contains NaN"):
        fast.step(*q.args(), gauge=np.full(q.x_q.shape[1] + 1, np.nan))
    with pytest.raises(ValueError, match="zero norm"):
        w = p.weights
        w.w_q, w.b_q = np.zeros_like(w.w_q), None
        fast.step(*p.args())


def test_qknorm_needs_norm_weights():
    p = make_problem(seed=3, family="qknorm", N=3)
    p.weights.q_norm = None
    with pytest.raises(ValueError, match="needs q_norm"):
        fast.step(*p.args())


def test_rope_tables_positions_out_of_range():
    p = _p()
    d = p.spec.head_dim
    spec = HeadSpec(2, 1, d, v_dim=2, rope=RoPESpec(cos=np.ones((3, d // 2)),
                                                    sin=np.zeros((3, d // 2))))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 3\)"):
        fast.step(spec, *p.args()[1:])
    with pytest.raises(ValueError, match="tables must both have shape"):
        HeadSpec(2, 1, d, rope=RoPESpec(cos=np.ones((3, d)), sin=np.ones((3, d))))


def test_original_gauge_overflow_is_an_error_not_a_number():
    p = make_problem(seed=4, const_bias=-800.0, N=4, amp=0.3)
    with pytest.raises(FloatingPointError, match="use gauge='maxkey'"):
        fast.step(*p.args(), bias=p.bias)
    st_ = fast.step(*p.args(), bias=p.bias, gauge="maxkey")
    assert bool(torch.isfinite(st_.readout).all())
