"""Hypothesis strategies, built bottom-up: dimensions -> GQA-consistent shapes -> bounded tensors
-> whole attention problems.  Sizes are capped so shrinking stays fast.

Every problem is plain float64 numpy data plus a :class:`HeadSpec`, so the exact oracle and the
fast layer read exactly the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from hypothesis import example
from hypothesis import strategies as st

from ropestep.spec import HeadSpec, HeadWeights, RoPESpec, alibi_slopes, causal_mask

MAX_SPREAD = 1400.0  # largest score spread the suite promises (issue 2)
BASES = (2.0, 10.0, 100.0, 1e4, 1e6)


@dataclass
class Problem:
    spec: HeadSpec
    weights: HeadWeights
    x_q: np.ndarray
    pos_q: np.ndarray
    x_kv: np.ndarray
    pos_kv: np.ndarray
    mask: np.ndarray
    bias: np.ndarray | None = None
    label: str = ""
    bank: bool = False  # all queries share one position and the whole bank
    extras: dict = field(default_factory=dict)

    def args(self) -> tuple:
        return (self.spec, self.weights, self.x_q, self.pos_q, self.x_kv, self.pos_kv, self.mask)

    def __repr__(self) -> str:  # hypothesis prints this on failure
        s = self.spec
        return (f"Problem({self.label or 'drawn'}: family={s.family} H={s.n_heads} "
                f"Hk={s.n_kv_heads} d={s.head_dim} r={s.r} m={self.x_q.shape[1]} "
                f"Q={self.x_q.shape[0]} N={self.x_kv.shape[0]} layout={s.rope.layout} "
                f"base={s.rope.base} softcap={s.softcap} alibi={s.alibi_slopes is not None} "
                f"bias={self.bias is not None} bank={self.bank} "
                f"spread={self.extras.get('spread', float('nan')):.3g})")


# ---------------------------------------------------------------------------------------------
# construction helpers (also used for the @example pins)
# ---------------------------------------------------------------------------------------------
def make_problem(*, seed: int = 0, m: int = 3, H: int = 2, Hk: int = 1, d: int = 4, r: int = 2,
                 N: int = 5, Q: int | None = None, family: str = "dot", layout: str = "half",
                 base: Any = 100.0, softcap: float | None = None, alibi: bool = False,
                 biases: bool = True, amp: float = 1.0, bank: bool = False,
                 mask_kind: str = "causal", spread: float | None = None,
                 scale: float | None = None, zero_query: bool = False, bias_only: bool = False,
                 const_bias: float | None = None, equal_keys: bool = False,
                 temperature: Any = None, label: str = "") -> Problem:
    rng = np.random.default_rng(seed)
    spec = HeadSpec(H, Hk, d, v_dim=r, rope=RoPESpec(base=base, layout=layout), family=family,
                    scale=scale, temperature=temperature, softcap=softcap,
                    alibi_slopes=alibi_slopes(H) if alibi else None)
    w = HeadWeights(
        w_q=rng.standard_normal((m, H, d)) * amp, w_k=rng.standard_normal((m, Hk, d)) * amp,
        w_v=rng.standard_normal((m, Hk, r)),
        b_q=rng.standard_normal((H, d)) * amp if biases else None,
        b_k=rng.standard_normal((Hk, d)) * amp if biases else None,
        b_v=rng.standard_normal((Hk, r)) if biases else None,
        q_norm=rng.uniform(0.5, 1.5, d) if family == "qknorm" else None,
        k_norm=rng.uniform(0.5, 1.5, d) if family == "qknorm" else None)
    if zero_query:
        w.w_q = np.zeros_like(w.w_q)
        w.b_q = None
    x_kv = rng.standard_normal((N, m))
    if equal_keys:
        x_kv[:] = x_kv[0]
    pos_kv = np.arange(N)
    if bank or mask_kind == "bank":
        Q = Q or 3
        x_q = rng.standard_normal((Q, m))
        pos_q = np.full(Q, N)
        mask = np.ones((Q, N), bool)
        bank = True
    else:
        x_q, pos_q = x_kv.copy(), pos_kv.copy()
        Q = N
        if mask_kind == "causal":
            mask = causal_mask(pos_q, pos_kv)
        else:  # random mask with a non-empty permitted set per query
            mask = rng.random((Q, N)) < 0.5
            mask[np.arange(Q), rng.integers(0, N, Q)] = True
    if bias_only:
        x_q = np.zeros_like(x_q)
        if not bank:
            x_kv = x_q
    bias = None if const_bias is None else np.full((H, Q, N), float(const_bias))
    p = Problem(spec, w, x_q, pos_q, x_kv, pos_kv, mask, bias, label=label, bank=bank)
    if spread is not None:
        p = rescale_to_spread(p, spread)
    p.extras["spread"] = score_spread(p)
    return p


def raw_scores(p: Problem) -> np.ndarray:
    """Float64 scores (H, Q, N) by a plain independent computation (for sizing only)."""
    from ropestep import fast

    P = fast.project(p.spec, p.weights, p.x_q, p.pos_q, p.x_kv, p.pos_kv, bias=p.bias)
    s = P.q @ P.k.transpose(-1, -2)
    if P.beta is not None:
        s = s + P.beta
    return np.where(p.mask[None], s.numpy(), np.nan)


def score_spread(p: Problem) -> float:
    s = raw_scores(p)
    return float(np.nanmax(s) - np.nanmin(s))


def rescale_to_spread(p: Problem, target: float) -> Problem:
    """Scale the query weights of a dot head so the score spread is about ``target``."""
    if p.spec.family != "dot":
        return p
    cur = score_spread(p)
    if cur == 0 or not np.isfinite(cur):
        return p
    f = target / cur
    w = replace(p.weights, w_q=p.weights.w_q * f,
                b_q=None if p.weights.b_q is None else p.weights.b_q * f)
    return replace(p, weights=w)


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
@st.composite
def dims(draw) -> dict:
    Hk = draw(st.integers(1, 2))
    group = draw(st.integers(1, 2))
    return dict(m=draw(st.integers(1, 8)), Hk=Hk, H=Hk * group, d=draw(st.sampled_from([2, 4, 6, 8])),
                r=draw(st.integers(1, 3)))


@st.composite
def problems(draw, families=("dot", "qknorm", "cosine"), max_n: int = 16, bank: bool | None = None,
             masks=("causal", "bank", "random"), spread: bool = True) -> Problem:
    """A whole attention problem: every family, both layouts, per-head bases, GQA, biases on
    or off, soft-caps, ALiBi, causal/bank/arbitrary masks, score spreads up to 1400."""
    dm = draw(dims())
    family = draw(st.sampled_from(families))
    per_head = draw(st.booleans())
    base = (tuple(draw(st.sampled_from(BASES)) for _ in range(dm["H"])) if per_head
            else draw(st.sampled_from(BASES)))
    mask_kind = "bank" if bank else draw(st.sampled_from([mk for mk in masks
                                                          if not (bank is False and mk == "bank")]))
    N = draw(st.integers(1, max_n))
    kw: dict = dict(seed=draw(st.integers(0, 2**31 - 1)), N=N, family=family,
                    layout=draw(st.sampled_from(["half", "interleaved"])), base=base,
                    softcap=draw(st.one_of(st.none(), st.sampled_from([1.0, 5.0, 30.0]))),
                    alibi=draw(st.booleans()), biases=draw(st.booleans()),
                    amp=draw(st.sampled_from([0.3, 1.0, 3.0])), mask_kind=mask_kind,
                    equal_keys=draw(st.booleans()) if N > 1 else False, **dm)
    if mask_kind == "bank":
        kw["Q"] = draw(st.integers(2, 4))
    if family == "cosine":
        kw["temperature"] = tuple(draw(st.sampled_from([0.05, 0.5, 2.0])) for _ in range(dm["H"]))
    if family == "dot" and spread:
        kw["spread"] = draw(st.sampled_from([None, 1.0, 30.0, 200.0, 700.0, MAX_SPREAD]))
    return make_problem(**kw)


# ---------------------------------------------------------------------------------------------
# the hard cases, pinned with @example
# ---------------------------------------------------------------------------------------------
def pinned() -> list[Problem]:
    return [
        make_problem(label="score exactly 0", zero_query=True, N=4),
        make_problem(label="|s| <= 1e-12", scale=1e-13, N=5),
        make_problem(label="scores near +-700", spread=1400.0, N=6, seed=3),
        make_problem(label="single key", N=1),
        make_problem(label="single key bank", N=1, bank=True, Q=3),
        make_problem(label="all scores very negative", const_bias=-800.0, N=5, amp=0.3),
        make_problem(label="all scores <= -30, bank", const_bias=-40.0, N=6, bank=True, amp=0.3),
        make_problem(label="bias-only queries", bias_only=True, N=5),
        make_problem(label="equal scores", equal_keys=True, N=4, bank=True),
        make_problem(label="softcap spread 1400", softcap=30.0, spread=MAX_SPREAD, N=6, seed=5),
        make_problem(label="interleaved per-head bases ALiBi", layout="interleaved",
                     base=(10.0, 1e4), alibi=True, N=7),
        make_problem(label="cosine tiny tau", family="cosine", temperature=(0.02, 0.05), N=6),
        make_problem(label="qknorm GQA", family="qknorm", H=4, Hk=2, N=6),
    ]


def pins(f=None, only=None, **extra):
    """Decorator: pin the hard cases of :func:`pinned` (those passing ``only``) as @example
    inputs ``p=...`` (plus fixed values ``extra`` for the test's other arguments)."""
    def deco(f):
        for p in pinned():
            if only is None or only(p):
                f = example(p=p, **extra)(f)
        return f
    return deco(f) if f is not None else deco
