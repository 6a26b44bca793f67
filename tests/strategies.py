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
                 temperature: Any = None, positions: Any = None, label: str = "") -> Problem:
    """A seeded problem.  ``positions``: the key positions (default ``0..N-1``; any
    non-decreasing integers, repeats allowed), shared by the queries unless ``bank``."""
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
    pos_kv = np.arange(N) if positions is None else np.asarray(positions, dtype=np.int64)
    if pos_kv.shape != (N,):
        raise ValueError(f"positions must have shape ({N},), got {pos_kv.shape}")
    if bank or mask_kind == "bank":
        Q = Q or 3
        x_q = rng.standard_normal((Q, m))
        pos_q = np.full(Q, int(pos_kv.max()) + 1)
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


def _rope_rows(x: np.ndarray, pos: np.ndarray, base: float, layout: str,
               cos_tab: Any = None, sin_tab: Any = None) -> np.ndarray:
    """Rotate rows ``x (n, d)`` at integer positions by ``R(p)`` (``x~ = x R(p)^T``), numpy.

    The spec's convention (:mod:`ropestep.spec`): pair ``(x1, x2)`` -> ``(x1 cos - x2 sin,
    x2 cos + x1 sin)`` at angle ``p * base^(-2l/d)``; pairs ``(l, l + d/2)`` ("half") or
    ``(2l, 2l+1)`` ("interleaved"); a model's own tables replace the angles when given.
    """
    d = x.shape[-1]
    if cos_tab is not None:
        c = np.asarray(cos_tab, dtype=np.float64)[pos]
        s = np.asarray(sin_tab, dtype=np.float64)[pos]
    else:
        ang = pos.astype(np.float64)[:, None] * float(base) ** (-2.0 * np.arange(d // 2) / d)
        c, s = np.cos(ang), np.sin(ang)
    i1 = np.arange(d // 2) if layout == "half" else np.arange(0, d, 2)
    i2 = i1 + d // 2 if layout == "half" else i1 + 1
    out = np.empty_like(x)
    out[:, i1] = x[:, i1] * c - x[:, i2] * s
    out[:, i2] = x[:, i2] * c + x[:, i1] * s
    return out


def raw_scores(p: Problem) -> np.ndarray:
    """Float64 scores (H, Q, N) by a plain numpy computation, for sizing the drawn problems.

    Independent of the code under test: projections, QK-norm / unit normalisation, RoPE and the
    additive biases are written out here from the spec's conventions (:mod:`ropestep.spec`).
    Entries off the permitted set are NaN.
    """
    spec, w = p.spec, p.weights
    H, d = spec.n_heads, spec.head_dim
    f = lambda a: None if a is None else np.asarray(a, dtype=np.float64)  # noqa: E731
    wq, wk, bq, bk = f(w.w_q), f(w.w_k), f(w.b_q), f(w.b_k)
    xq, xk = np.asarray(p.x_q, np.float64), np.asarray(p.x_kv, np.float64)
    pq, pk = np.asarray(p.pos_q).astype(np.int64), np.asarray(p.pos_kv).astype(np.int64)
    bases = spec.rope.bases(H)
    s = np.empty((H, xq.shape[0], xk.shape[0]))
    for h in range(H):
        g = spec.kv_head(h)
        q = xq @ wq[:, h] + (0.0 if bq is None else bq[h])
        k = xk @ wk[:, g] + (0.0 if bk is None else bk[g])
        if spec.family == "qknorm":
            q = q / np.sqrt((q * q).mean(-1, keepdims=True) + spec.norm_eps) * f(w.q_norm)
            k = k / np.sqrt((k * k).mean(-1, keepdims=True) + spec.norm_eps) * f(w.k_norm)
        elif spec.family == "cosine":
            q = q / np.linalg.norm(q, axis=-1, keepdims=True)
            k = k / np.linalg.norm(k, axis=-1, keepdims=True)
        qt = _rope_rows(q, pq, bases[h], spec.rope.layout, spec.rope.cos, spec.rope.sin)
        kt = _rope_rows(k, pk, bases[h], spec.rope.layout, spec.rope.cos, spec.rope.sin)
        s[h] = (qt @ kt.T) * spec.score_scale(h)
        if spec.alibi_slopes is not None:
            s[h] -= float(spec.alibi_slopes[h]) * (pq[:, None] - pk[None, :])
    if p.bias is not None:
        s = s + np.asarray(p.bias, dtype=np.float64)
    return np.where(np.asarray(p.mask, bool)[None], s, np.nan)


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


# ---------------------------------------------------------------------------------------------
# causal layers for the streamed path (ropestep.scale), and how to run it
# ---------------------------------------------------------------------------------------------
@st.composite
def positions(draw, n: int) -> np.ndarray:
    """Non-decreasing integer positions for ``n`` tokens: an offset, then steps of 1, 0 (a
    repeated position: both tokens read each other) or a jump."""
    start = draw(st.sampled_from([0, 3, 37]))
    steps = draw(st.lists(st.sampled_from([1, 1, 0, 2, 5]), min_size=n - 1, max_size=n - 1))
    return start + np.concatenate([[0], np.cumsum(steps, dtype=np.int64)]).astype(np.int64)


@st.composite
def layers(draw, families=("dot", "qknorm", "cosine"), max_n: int = 8, max_m: int = 6,
           softcap: bool = True, alibi: bool = True) -> Problem:
    """One causal self-attention layer as :mod:`ropestep.scale` takes it: the queries are the
    tokens themselves, each reading the keys at positions <= its own.  Every family, GQA,
    per-head bases, both layouts, ALiBi, soft-caps, offset and repeated positions, score spreads
    up to ``MAX_SPREAD``; no explicit bias arrays (the streamed path takes none).  Sizes capped
    (``N <= max_n``, ``m <= max_m``) so the mpmath oracle stays fast."""
    dm = draw(dims())
    dm["m"] = min(dm["m"], max_m)
    family = draw(st.sampled_from(families))
    per_head = draw(st.booleans())
    base = (tuple(draw(st.sampled_from(BASES)) for _ in range(dm["H"])) if per_head
            else draw(st.sampled_from(BASES)))
    N = draw(st.sampled_from(range(1, max_n + 1)))  # uniform: chunks need a few tokens
    kw: dict = dict(seed=draw(st.integers(0, 2**31 - 1)), N=N, family=family,
                    layout=draw(st.sampled_from(["half", "interleaved"])), base=base,
                    softcap=draw(st.one_of(st.none(), st.sampled_from([1.0, 5.0, 30.0])))
                    if softcap else None,
                    alibi=draw(st.booleans()) if alibi else False, biases=draw(st.booleans()),
                    amp=draw(st.sampled_from([0.3, 1.0, 3.0])), mask_kind="causal",
                    positions=draw(positions(N)), **dm)
    if family == "cosine":
        kw["temperature"] = tuple(draw(st.sampled_from([0.05, 0.5, 2.0])) for _ in range(dm["H"]))
    if family == "dot":
        kw["spread"] = draw(st.sampled_from([None, 1.0, 30.0, 200.0, 700.0, MAX_SPREAD]))
    return make_problem(**kw)


LOWRANK_TOLS = (None, 1e-6, 1e-10)  # requested per-entry kernel accuracy (None: the default)
SCALE_GAUGES = ("original", "maxkey", "pairwise-lowrank", "pairwise-exact")


@dataclass(frozen=True)
class ScaleRun:
    """How to run :func:`ropestep.scale.materialise` on a layer.

    ``budget``: ``"default"`` (the library's 1 GiB: one chunk at these sizes), ``"tiny"`` or
    ``"small"`` -- a ``max_bytes`` sized (by the test, from the plan's own byte counts) for
    ``queries_per_chunk`` queries and ``key_rows`` rows of ``P`` per key block, so the stream
    crosses query-chunk and key-block boundaries.  ``direct_keys``: queries with at most that
    many permitted keys take the per-query form, the rest the key-block GEMM form.
    """

    gauge: str  # one of SCALE_GAUGES
    budget: str = "default"
    queries_per_chunk: int = 1
    key_rows: int = 1
    direct_keys: int = 64
    chunk: int | None = None
    tol: float | None = None  # pairwise-lowrank only
    queries: tuple | None = None
    heads: tuple | None = None

    @property
    def base_gauge(self) -> str:
        return self.gauge.split("-")[0]

    @property
    def pairwise(self) -> str:
        return self.gauge.split("-")[1] if "-" in self.gauge else "lowrank"


@st.composite
def scale_runs(draw, p: Problem, gauges=SCALE_GAUGES) -> ScaleRun:
    """Run parameters for layer ``p``: gauge (no pairwise on soft-capped heads: the streamed
    path refuses them), byte budget, ``direct_keys`` small and large, a fixed query chunk, and
    subsets of queries and heads."""
    N, H = p.x_kv.shape[0], p.spec.n_heads
    ok = [g for g in gauges if not (g.startswith("pairwise") and p.spec.softcap is not None)]
    gauge = draw(st.sampled_from(ok))
    budget = draw(st.sampled_from(["default", "tiny", "small", "small"]))
    kw: dict = dict(gauge=gauge, budget=budget,
                    direct_keys=draw(st.sampled_from([0, 1, 2, max(1, N // 2), 64])))
    if gauge == "pairwise-lowrank":
        kw["tol"] = draw(st.sampled_from(LOWRANK_TOLS))
    if N > 1 and draw(st.booleans()):
        qs = draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=N, unique=True))
        kw["queries"] = tuple(sorted(qs))
    if H > 1 and draw(st.booleans()):
        hs = draw(st.lists(st.integers(0, H - 1), min_size=1, max_size=H, unique=True))
        kw["heads"] = tuple(sorted(hs))
    nq = N if "queries" not in kw else len(kw["queries"])
    if budget == "tiny":
        kw.update(queries_per_chunk=1, key_rows=draw(st.integers(1, 2)))
    elif budget == "small":
        kw.update(queries_per_chunk=draw(st.integers(2, 3)), key_rows=draw(st.integers(1, 3)))
    else:  # a fixed chunk of at most the selected queries (scale.plan refuses a larger one)
        kw["chunk"] = draw(st.sampled_from([None] + list(range(1, min(3, nq) + 1))))
    return ScaleRun(**kw)


def very_negative_layer(N: int = 6, level: float = -800.0, seed: int = 0, **kw) -> Problem:
    """A causal dot layer whose every score sits near ``level`` (all tokens at one position,
    keys close to a common ``b_k``, queries close to a multiple of it): the original gauge's
    ``1/Z`` overflows below about -709 (float64) / -88 (float32); the max-key gauge is fine."""
    p = make_problem(seed=seed, N=N, positions=np.full(N, 5), biases=True, **kw)
    spec, w = p.spec, p.weights
    d = spec.head_dim
    bk = np.asarray(w.b_k, dtype=np.float64)  # (Hk, d)
    bq = np.empty((spec.n_heads, d))
    for h in range(spec.n_heads):
        g = spec.kv_head(h)
        # the same rotation at one position leaves q . k unchanged: s = scale * b_q . b_k
        bq[h] = level * bk[g] / (float(bk[g] @ bk[g]) * spec.score_scale(h))
    w2 = replace(w, w_q=np.asarray(w.w_q) * 0.01, w_k=np.asarray(w.w_k) * 0.01, b_q=bq)
    out = replace(p, weights=w2, label=p.label or f"every score near {level:g}")
    out.extras = {"spread": score_spread(out)}
    return out


def pinned_layers() -> list[Problem]:
    """The hard cases of the streamed path: a single key, scores at or near 0, every score
    very negative, bias-only tokens, equal scores, the widest spread, repeated positions."""
    return [
        make_problem(label="single key", N=1),
        make_problem(label="score exactly 0", zero_query=True, N=5),
        make_problem(label="|s| <= 1e-12", scale=1e-13, N=6, H=2, Hk=2),
        very_negative_layer(N=6, level=-800.0, label="every score near -800"),
        very_negative_layer(N=5, level=-40.0, seed=2, label="every score near -40"),
        make_problem(label="bias-only tokens", bias_only=True, N=5),
        make_problem(label="equal scores", equal_keys=True, N=4, positions=np.zeros(4)),
        make_problem(label="spread 1400 ALiBi", spread=MAX_SPREAD, alibi=True, N=7, seed=3),
        make_problem(label="repeated positions, per-head bases", base=(10.0, 1e4), N=7,
                     positions=np.array([0, 0, 1, 1, 1, 4, 4]), layout="interleaved"),
        make_problem(label="qknorm GQA softcap", family="qknorm", H=4, Hk=2, N=6, softcap=5.0),
        make_problem(label="cosine tiny tau", family="cosine", temperature=(0.02, 0.05), N=6),
    ]


# ---------------------------------------------------------------------------------------------
# banks with query-independent biases (frozen reuse), biased problems (descent)
# ---------------------------------------------------------------------------------------------
def with_bias(p: Problem, kind: str, seed: int = 0, amp: float = 1.0) -> Problem:
    """``p`` with an explicit additive bias ``(H, Q, N)``: ``"none"``, ``"const"`` (``amp``
    everywhere), ``"per_key"`` (one Gaussian value per head and key, the same for every query:
    what frozen reuse allows) or ``"full"`` (independent per head, query and key)."""
    if kind == "none":
        return p
    H, Q, N = p.spec.n_heads, p.x_q.shape[0], p.x_kv.shape[0]
    rng = np.random.default_rng(seed)
    if kind == "const":
        b = np.full((H, Q, N), float(amp))
    elif kind == "per_key":
        b = np.broadcast_to(rng.standard_normal((H, 1, N)) * amp, (H, Q, N)).copy()
    elif kind == "full":
        b = rng.standard_normal((H, Q, N)) * amp
    else:
        raise ValueError(f"unknown bias kind {kind!r}")
    out = replace(p, bias=b, label=(p.label + " " if p.label else "") + f"bias={kind}")
    out.extras = {"spread": score_spread(out)}
    return out


@st.composite
def reuse_banks(draw, families=("dot", "qknorm", "cosine"), max_n: int = 8) -> Problem:
    """Bank problems (every query at one position, reading the whole bank) with ALiBi and/or a
    query-independent explicit bias -- the setting of frozen reuse."""
    p = draw(problems(families=families, max_n=max_n, bank=True))
    kind = draw(st.sampled_from(["none", "const", "per_key"]))
    amp = draw(st.sampled_from([1.0, 3.0])) if kind == "per_key" else \
        draw(st.sampled_from([-40.0, 2.0]))
    return with_bias(p, kind, seed=draw(st.integers(0, 2**31 - 1)), amp=amp)


@st.composite
def biased_problems(draw, families=("dot",), max_n: int = 8) -> Problem:
    """:func:`problems` (causal, bank and arbitrary masks) with an optional explicit bias."""
    p = draw(problems(families=families, max_n=max_n))
    kind = draw(st.sampled_from(["none", "none", "const", "full"]))
    amp = -40.0 if kind == "const" else 1.0
    return with_bias(p, kind, seed=draw(st.integers(0, 2**31 - 1)), amp=amp)


@st.composite
def lowrank_rules(draw) -> tuple[float, float]:
    """``(spread, tol)`` for the Gauss-Legendre rule: spreads from 0 to the suite's 1400 (the
    largest the rule offers nodes for at the tighter tolerances is smaller; the test skips
    what :func:`ropestep.lowrank.choose_nodes` refuses), tolerances from 1e-4 to 1e-14."""
    spread = draw(st.one_of(st.sampled_from([0.0, 1e-12, 1.0, 80.0, 700.0]),
                            st.floats(0.0, 200.0, allow_nan=False, allow_infinity=False)))
    tol = draw(st.sampled_from([1e-4, 1e-8, 1e-12, 1e-14]))
    return float(spread), tol
