"""Every fast result against the independent oracle ("Trustworthy verdicts", item 4).

Each fast path is compared with :mod:`ropestep.exact` (mpmath at ``DPS`` digits, context
managers only) -- never with another fast path:

* the streamed layer :mod:`ropestep.scale` (``materialise``: ``y``, ``mu``, readout, ``T``,
  ``b``, ``Delta M``) in every gauge (original, max-key, pairwise low-rank and exact), every
  family (dot, QK-norm, cosine), soft-caps and ALiBi, in float64/float32/bfloat16, under byte
  budgets that split the queries into chunks and ``P`` into key blocks, with ``direct_keys``
  small and large (per-query form and key-block GEMM form);
* :mod:`ropestep.lowrank`: the Gauss-Legendre rule, its error bound and node count;
* frozen reuse (``fast.frozen_reuse``: the frozen readout, the measured and tokenwise errors,
  the refresh ``T_i - T_a``, the operator-norm bound) on banks with bias rows;
* the prefix/full relation (``fast.self_mass``, ``prefix_full``, ``full_bank_mean``);
* the descent diagnostics (``fast.descent``: ``lambda_max``, ``E`` before and after the step)
  in the original and max-key gauges (and its refusal elsewhere).

Tolerances (all from :mod:`ropestep.tolerances`): float64 ``FLOAT64_REL`` for quantities that
are well conditioned relative to the absolute size of their terms, the ``kappa``-scaled
``readout_bound`` where a sum cancels; float32/bfloat16 ``err(fast) <= K_LOW err(naive) +
floor`` with the naive computation the oracle's formulas rounded to 24 bits
(``exact.build_rounded``).  The condition numbers and term sizes are computed here from the
oracle's own quantities, for the route each path really takes (the streamed path centres keys
and values on their global means; see :func:`route_scales`).  Every check prints its largest
error / bound ratio before asserting, and the ``test_..._detects_...`` tests show that a wrong
formula in :mod:`ropestep.kernel` or :mod:`ropestep.lowrank` turns the checks red.
"""
from __future__ import annotations

import functools
import math

import mpmath as mp
import numpy as np
import pytest
import torch
from hypothesis import currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from ropestep import exact, fast, kernel, lowrank, scale
from ropestep import tolerances as tl
from strategies import (SCALE_GAUGES, ScaleRun, biased_problems, layers, lowrank_rules,
                        make_problem, pinned_layers, problems, reuse_banks, scale_runs,
                        with_bias)

pytestmark = pytest.mark.usefixtures("one_thread")

DPS = 40  # oracle digits (exact.build adds guard digits, and more when scores are very negative)
LOW = (torch.float32, torch.bfloat16)


def note(msg: str) -> None:
    """A hypothesis event inside a property, nothing outside one (the pinned cases)."""
    if currently_in_test_context():
        event(msg)


def n_examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile (200), scaled with the loaded profile's count
    (``fuzz``: 10 n, ``quick``: n / 10), at least 5."""
    return max(5, n * settings.default.max_examples // 200)


# ---------------------------------------------------------------------------------------------
# oracle-side helpers (mpmath, from the oracle's own quantities; no fast code)
# ---------------------------------------------------------------------------------------------
def rounded(p, dtype):
    """The problem's float inputs rounded once to ``dtype`` (what a model in that dtype holds),
    as float64 numpy: ``(weights, x_q, x_kv, bias)``."""
    def rnd(a):
        return None if a is None else torch.as_tensor(np.asarray(a)).to(dtype).double().numpy()
    w = p.weights
    wr = type(w)(**{k: rnd(getattr(w, k)) for k in w.__dataclass_fields__})
    return wr, rnd(p.x_q), rnd(p.x_kv), rnd(p.bias)


def perm_of(E, i):
    return [int(j) for j in np.flatnonzero(E.mask[i])]


def key_gauge(E, h, i, gauge, anchor=None):
    """``(c, k_o, beta_o)`` of a key gauge: the oracle's coefficients and offsets (max-key:
    ``anchor`` replaces ``j*`` -- any permitted key is a valid gauge, used at near-ties)."""
    d = E.spec.head_dim
    if gauge == "original":
        c, _ = exact.coefficients(E, h, i, "original")
        return c, [mp.mpf(0)] * d, mp.mpf(0)
    if anchor is None:
        c, _ = exact.coefficients(E, h, i, "maxkey")
        js = exact.max_key(E, h, i)
    else:
        js = anchor
        c = {j: exact.exp_phi_dd(E.s[h, i, j], E.s[h, i, js], E.spec.softcap) / E.Z[h, i]
             for j in perm_of(E, i)}
    return c, list(E.k[h, js]), E.beta[h, i, js]


def query_space(E, h, i, gauge) -> mp.matrix:
    """``[T_i; b_i^T]`` ((d+1) x r) from the oracle's rotated keys, biases and values.

    Key gauges: ``sum_j c_ij [k~_j - k_o; beta_ij - beta_o] (v_j - mu_i)^T``; pairwise:
    ``1/(2 N Z) sum_{j,k} exp_phi[s_j, s_k] [k~_j - k~_k; beta_j - beta_k] (v_j - v_k)^T``.
    (For the non-affine families this is the oracle's own ``exact.delta_m``.)"""
    with mp.workprec(E.prec):
        d, r = E.spec.head_dim, E.spec.r
        perm = perm_of(E, i)
        M = mp.zeros(d + 1, r)
        feat = {j: list(E.k[h, j]) + [E.beta[h, i, j]] for j in perm}
        if gauge == "pairwise":
            pre = 1 / (2 * len(perm) * E.Z[h, i])
            for j in perm:
                for k in perm:
                    if j == k:
                        continue
                    w = pre * exact.exp_phi_dd(E.s[h, i, j], E.s[h, i, k], E.spec.softcap)
                    for a in range(d + 1):
                        da = w * (feat[j][a] - feat[k][a])
                        for b in range(r):
                            M[a, b] += da * (E.v[h, j, b] - E.v[h, k, b])
            return M
        c, ko, bo = key_gauge(E, h, i, gauge)
        off = ko + [bo]
        for j, cj in c.items():
            for a in range(d + 1):
                w = cj * (feat[j][a] - off[a])
                for b in range(r):
                    M[a, b] += w * (E.v[h, j, b] - E.mu[h, i, b])
        return M


def mat_np(M) -> np.ndarray:
    return np.array([[float(M[a, b]) for b in range(M.cols)] for a in range(M.rows)])


def global_means(E, h):
    """The streamed path's centring constants: means of head ``h``'s rotated keys and values
    over the whole layer (``k-bar``, ``v-bar``), in mpmath."""
    with mp.workprec(E.prec):
        N = E.k.shape[1]
        kbar = [mp.fsum(E.k[h, j][p] for j in range(N)) / N for p in range(E.spec.head_dim)]
        vbar = [mp.fsum(E.v[h, j, c] for j in range(N)) / N for c in range(E.spec.r)]
        return kbar, vbar


def abs_lmap(spec, weights, h, pos) -> np.ndarray:
    """``|W^_q| |R(p)^T| * scale`` ((m+1) x d): the absolute size of the products the streamed
    path forms for ``Delta M_i = (W^_q scale) (R(p_i)^T T_i)`` (rotation first, then W)."""
    w = np.asarray(weights.w_q, dtype=np.float64)[:, h]
    b = np.zeros(w.shape[1]) if weights.b_q is None else np.asarray(weights.b_q, np.float64)[h]
    W = np.abs(np.vstack([w, b]))
    d = spec.head_dim
    rope = spec.rope
    with mp.workdps(20):
        if rope.cos is not None:
            R = exact.rotation(pos, rope.bases(spec.n_heads)[h], d, rope.layout,
                               np.asarray(rope.cos)[pos], np.asarray(rope.sin)[pos])
        else:
            R = exact.rotation(pos, rope.bases(spec.n_heads)[h], d, rope.layout)
        Ra = np.abs(mat_np(R))
    return W @ Ra.T * spec.score_scale(h)


def route_scales(E, h, i, gauge, route, kbar=None, vbar=None, labs=None, anchor=None) -> dict:
    """Condition number and absolute term sizes of the sums as a fast path evaluates them.

    Returns ``S`` (the value scale), ``kappa`` (the readout sum's condition number relative to
    ``S``), ``tabs`` (d x r), ``babs`` (r) and, given ``labs`` (``abs_lmap``), ``mabs``
    ((m+1) x r): entrywise sums of the absolute values of the terms each entry is summed from.

    ``route="direct"`` is the per-query form (``fast.step``, and the streamed path's short
    prefixes): terms ``|c_j| [|k~_j - k_o|; |beta_j - beta_o|] (|v_j - mu| + |v_j| + |v-bar|)``
    -- the oracle's ``exact.kappa`` (docs/math.md section 9), plus ``|v-bar|`` when the values
    are first centred on ``v-bar`` (pass ``vbar=None`` otherwise) -- and in every route plus
    the sizes of the keys and biases themselves (``|k~_j| + |k_o|``, ``|beta_j| + |beta_o|``):
    they are computed (projected, normalised, rotated) with an error relative to their own
    size, which a near-cancelling difference (equal keys at one position, a max-key near-tie)
    does not shrink -- as ``|v_j|`` accounts for the centred values.  ``route="gemm"`` is the
    streamed key-block form ``T = sum_j c_j k^_j v^_j^T - (C K^)(mu - v-bar)^T + (k-bar - k_o)
    w^T`` with ``k^ = k~ - k-bar``, ``v^ = v - v-bar``: every key factor is then at most
    ``|k~_j - k-bar| + |k-bar - k_o|`` and every value factor ``|v_j - v-bar| + |mu - v-bar|``,
    plus ``|v_j| + |v-bar|`` for the rounding of ``v^`` itself.  ``gauge="pairwise"`` is the
    streamed Laplacian form ``sum_j [k~_j - k-bar; beta_j] lv_j`` with ``lv_j = (1/N) sum_k
    D_jk (v^_j - v^_k)``, ``D_jk = exp_phi[s_j, s_k] / Z`` (diagonal included: it is summed
    too).  ``S = max(max_{j in I_i} |v_j|_inf, |v-bar|_inf)``: the streamed path adds ``v-bar``
    back to ``y``, ``mu`` and the readout, which rounds at ``u |v-bar|``.
    """
    with mp.workprec(E.prec):
        d, r = E.spec.head_dim, E.spec.r
        perm = perm_of(E, i)
        n = len(perm)
        q, mu = E.q[h, i], E.mu[h, i]
        zero = [mp.mpf(0)] * r
        vb = zero if vbar is None else [abs(x) for x in vbar]
        vbv = zero if vbar is None else vbar
        S = max([abs(E.v[h, j, c]) for j in perm for c in range(r)] + vb + [mp.mpf(0)])
        # terms: (weight, key factor (d), bias factor, value factor (r), the value factor at
        # unit weights).  Every weight (c_j, D_jk) may underflow: an absolute error of float64's
        # smallest normal number per weight, i.e. `tiny` times the terms' size at unit weights
        terms = []
        if gauge == "pairwise":
            a = {j: [abs(E.v[h, j, c] - vbv[c]) + abs(E.v[h, j, c]) + vb[c] for c in range(r)]
                 for j in perm}
            for j in perm:
                D = {k: exact.exp_phi_dd(E.s[h, i, j], E.s[h, i, k], E.spec.softcap) / E.Z[h, i]
                     for k in perm}
                W = [mp.fsum(D[k] * (a[j][c] + a[k][c]) for k in perm) / n for c in range(r)]
                W1 = [mp.fsum(a[j][c] + a[k][c] for k in perm) / n for c in range(r)]
                terms.append((mp.mpf(1), [abs(E.k[h, j][p] - kbar[p]) + abs(E.k[h, j][p])
                                          + abs(kbar[p]) for p in range(d)],
                              abs(E.beta[h, i, j]), W, W1))
        else:
            c, ko, bo = key_gauge(E, h, i, gauge, anchor)
            for j in perm:
                vj = E.v[h, j]
                # the keys, biases and values are themselves rounded at their own size
                own = [abs(E.k[h, j][p]) + abs(ko[p]) for p in range(d)]
                if route == "direct":
                    K = [abs(E.k[h, j][p] - ko[p]) + own[p] for p in range(d)]
                    V = [abs(vj[x] - mu[x]) + abs(vj[x]) + vb[x] for x in range(r)]
                else:
                    K = [abs(E.k[h, j][p] - kbar[p]) + abs(kbar[p] - ko[p]) + own[p]
                         + abs(kbar[p]) for p in range(d)]
                    V = [abs(vj[x] - vbv[x]) + abs(mu[x] - vbv[x]) + abs(vj[x]) + vb[x]
                         for x in range(r)]
                B = abs(E.beta[h, i, j] - bo) + abs(E.beta[h, i, j]) + abs(bo)
                terms.append((abs(c[j]), K, B, V, V))
        kap = mp.fsum(w * (mp.fsum(abs(q[p]) * K[p] for p in range(d)) + B) * max(V)
                      for w, K, B, V, _ in terms)
        tiny = mp.mpf(float(np.finfo(np.float64).tiny))
        tabs = np.array([[float(mp.fsum(w * K[p] * V[x] + tiny * K[p] * V1[x]
                                        for w, K, B, V, V1 in terms))
                          for x in range(r)] for p in range(d)])
        babs = np.array([float(mp.fsum(w * B * V[x] + tiny * B * V1[x]
                                       for w, K, B, V, V1 in terms)) for x in range(r)])
        out = {"S": float(S), "kappa": float(kap / S) if S > 0 else 0.0, "tabs": tabs,
               "babs": babs}
        if labs is not None:
            out["mabs"] = np.vstack([labs @ tabs, babs[None]])
        return out


def score_facts(E, h, i):
    """``(max|s|, spread, abs_dot, top-2 gap)`` over the permitted set, from the oracle:
    ``abs_dot = max_j |q| . |k~_j| + |beta_j|`` is the size of the products a score is summed
    from -- its rounding scale.  The checks pass it where the tolerances take the scores' size
    (``score_max``): ``abs_dot >= max|s|``, and a score's rounding is relative to it, which can
    exceed ``|s|`` many times when the products cancel (large weights, moderate scores)."""
    with mp.workprec(E.prec):
        perm = perm_of(E, i)
        s = sorted((E.s[h, i, j] for j in perm), reverse=True)
        absdot = max(mp.fsum(abs(a) * abs(b) for a, b in zip(E.q[h, i], E.k[h, j]))
                     + abs(E.beta[h, i, j]) for j in perm)
        gap = s[0] - s[1] if len(s) > 1 else mp.inf
        return (float(max(abs(s[0]), abs(s[-1]))), float(s[0] - s[-1]), float(absdot),
                float(gap))


def tie_threshold(dtype, E, abs_dot) -> float:
    """Two evaluations of one score agree to ``agreement_rel_tol`` of the size of its products:
    keys within that of the maximum may be either path's ``j*`` (equally valid gauges)."""
    N, d = E.mask.shape[1], E.spec.head_dim
    m = E.u.shape[2] - 1 if E.spec.affine else 0
    return tl.agreement_rel_tol(dtype, N, d, m) * abs_dot


def near_max(E, h, i, thr):
    perm = perm_of(E, i)
    smax = max(E.s[h, i, j] for j in perm)
    return [j for j in perm if float(smax - E.s[h, i, j]) <= thr]


def naive_readout(N24, h, i, M) -> np.ndarray:
    """``mu + u^T M`` at the naive reference's 24-bit precision."""
    with mp.workprec(N24.prec):
        return np.array([float(x) for x in exact.readout(N24, h, i, M)])


def vec(a) -> np.ndarray:
    return np.array([float(x) for x in a])


def report(name: str, ratios: dict) -> None:
    """Print the worst error / bound ratio of every compared quantity (before asserting)."""
    print(name, {k: f"{v:.2e}" for k, v in ratios.items()})


# ---------------------------------------------------------------------------------------------
# the Gauss-Legendre rule in mpmath (the oracle of ropestep.lowrank)
# ---------------------------------------------------------------------------------------------
RULE_DPS = 34  # digits of the mpmath rule: far below every tolerance the rule is held to


def _legendre(n: int, x):
    """``(P_n(x), P_{n-1}(x))`` by the three-term recurrence (mpmath)."""
    p0, p1 = mp.mpf(1), x
    if n == 0:
        return p0, mp.mpf(0)
    for k in range(2, n + 1):
        p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
    return p1, p0


@functools.lru_cache(maxsize=None)
def exact_rule(n: int) -> tuple:
    """The n-point Gauss-Legendre rule on ``[0, 1]`` in mpmath: the roots ``x_k`` of ``P_n``
    (Newton from the shipped float64 nodes, to ``RULE_DPS`` digits; checked to be distinct
    roots) and the weights ``1 / ((1 - x^2) P_n'(x)^2)`` (half of the ``[-1, 1]`` weights)."""
    t64, _ = lowrank.gl_nodes(n)
    with mp.workdps(RULE_DPS):
        half = {}
        for k in range((n + 1) // 2):  # the rule is symmetric about 1/2: t_{n-1-k} = 1 - t_k
            x = 2 * mp.mpf(float(t64[k])) - 1
            for _ in range(3):  # quadratic convergence from float64 accuracy: 16 -> 32 -> 64
                P, Pm = _legendre(n, x)
                x = x - P / (n * (x * P - Pm) / (x * x - 1))
            P, Pm = _legendre(n, x)
            dP = n * (x * P - Pm) / (x * x - 1)
            assert abs(P) <= mp.eps * abs(dP), (n, k)  # a root, to working precision
            half[k] = ((x + 1) / 2, 1 / ((1 - x * x) * dP * dP))
        ts = [half[k][0] if k in half else 1 - half[n - 1 - k][0] for k in range(n)]
        ws = [half[k][1] if k in half else half[n - 1 - k][1] for k in range(n)]
        assert all(b - a > 0 for a, b in zip(ts, ts[1:])), n  # n distinct roots, in order
        assert abs(mp.fsum(ws) - 1) <= mp.eps * n, n  # integrates 1 exactly
        return tuple(ts), tuple(ws)


@functools.lru_cache(maxsize=None)
def shipped_rule_errors(n: int) -> tuple[float, float]:
    """``(node_abs, weight_rel)``: how far the shipped float64 rule (``lowrank.gl_nodes``) is
    from :func:`exact_rule`."""
    t64, w64 = lowrank.gl_nodes(n)
    ts, ws = exact_rule(n)
    with mp.workdps(RULE_DPS):
        na = max(abs(mp.mpf(float(a)) - b) for a, b in zip(t64, ts))
        wr = max(abs(mp.mpf(float(a)) - b) / b for a, b in zip(w64, ws))
        return float(na), float(wr)


def gl_bound_mp(n: int, spread) -> mp.mpf:
    """The Gauss-Legendre remainder bound ``spread^{2n+1} (n!)^4 / ((2n+1) ((2n)!)^3
    (1 - e^{-spread}))`` in mpmath (0 at spread 0)."""
    with mp.workdps(RULE_DPS):
        s = mp.mpf(spread)
        if s == 0:
            return mp.mpf(0)
        return (s ** (2 * n + 1) * mp.factorial(n) ** 4
                / ((2 * n + 1) * mp.factorial(2 * n) ** 3 * -mp.expm1(-s)))


def rule_rel_error(ts, ws, delta) -> mp.mpf:
    """``|sum_n w_n e^{t_n delta} - (e^delta - 1)/delta| / ((e^delta - 1)/delta)`` in mpmath
    (nodes and weights as given: mpf, or the shipped floats converted exactly)."""
    with mp.workdps(RULE_DPS):
        dl = mp.mpf(delta)
        q = mp.fsum(mp.mpf(w) * mp.exp(mp.mpf(t) * dl) for t, w in zip(ts, ws))
        ex = exact.phi1(dl)
        return abs(q - ex) / ex


# ---------------------------------------------------------------------------------------------
# the streamed layer: ropestep.scale against the oracle
# ---------------------------------------------------------------------------------------------
def groups_of(spec):
    """Key groups of the streamed path: the query heads of one KV head, or one head each when
    the RoPE bases differ between heads (equal per-head bases share one rotation)."""
    if spec.rope.cos is None and len(set(spec.rope.bases(spec.n_heads))) > 1:
        return [[h] for h in range(spec.n_heads)]
    return [list(range(g * spec.group, (g + 1) * spec.group)) for g in range(spec.n_kv_heads)]


def budget(p, run: ScaleRun, dtype, outputs: tuple = ()) -> int:
    """``max_bytes`` for ``run.queries_per_chunk`` queries and ``run.key_rows`` rows of ``P``:
    the plan's own byte counts at an unlimited budget, plus the 10% headroom it leaves."""
    if run.budget == "default":
        return scale.DEFAULT_MAX_BYTES
    spec, (N, m) = p.spec, p.x_kv.shape
    heads = range(spec.n_heads) if run.heads is None else run.heads
    gmax = max(len([h for h in hs if h in heads]) for hs in groups_of(spec))
    nq = N if run.queries is None else len(run.queries)
    pl = scale.plan(spec, N, m, dtype, 1 << 40, n_queries=nq, delta_m=spec.affine,
                    gauge=run.base_gauge, pairwise=run.pairwise, heads_per_group=gmax,
                    outputs=outputs)
    row = spec.head_dim * spec.r * (torch.finfo(kernel.compute_dtype(dtype)).bits // 8)
    need = pl.fixed_bytes + run.queries_per_chunk * pl.per_query_bytes + run.key_rows * row
    return math.ceil(need / (1 - scale.HEADROOM)) + 16


def run_scale(p, run: ScaleRun, dtype, max_bytes: int) -> dict:
    """``scale.materialise`` of layer ``p`` under ``run`` (the path rounds its float64 inputs
    to ``dtype`` itself)."""
    return scale.materialise(p.spec, p.weights, p.x_kv, p.pos_kv, gauge=run.base_gauge,
                             dtype=dtype, max_bytes=max_bytes, delta_m=p.spec.affine,
                             queries=None if run.queries is None else list(run.queries),
                             heads=None if run.heads is None else list(run.heads),
                             chunk=run.chunk, pairwise=run.pairwise, tol=run.tol,
                             direct_keys=run.direct_keys)


def lowrank_entry_rel(E, spec, heads, queries, query_chunk, tol, dtype) -> dict:
    """Per (head, query) the relative error bound of its chunk's low-rank kernel entries
    (``tolerances.gl_rule_rel``): the chunk's node count is ``choose_nodes`` at the chunk's
    largest score spread (over its heads and queries, from the oracle's scores, widened by the
    two paths' score disagreement ``tie_threshold``), with the shipped rule's measured node and
    weight errors.  ``None`` for a chunk whose spread needs more than ``N_MAX`` nodes (the path
    must refuse it)."""
    out: dict = {}
    for hs in groups_of(spec):
        hs = [h for h in hs if h in heads]
        for lo in range(0, len(queries), query_chunk):
            chunk = queries[lo:lo + query_chunk]
            facts = [score_facts(E, h, i) for h in hs for i in chunk]
            if not facts:
                continue
            spread = max(f[1] for f in facts)
            slack = 2 * max(tie_threshold(dtype, E, f[2]) for f in facts)
            try:
                n_lo = lowrank.choose_nodes(max(0.0, spread - slack), tol)
            except ValueError:
                n_lo = None
            try:
                n_hi = lowrank.choose_nodes(spread + slack, tol)
            except ValueError:
                n_hi = lowrank.N_MAX
            e = None
            if n_lo is not None:
                errs = [shipped_rule_errors(n) for n in range(n_lo, n_hi + 1)]
                e = tl.gl_rule_rel(tol, spread + slack, n_hi, max(x[0] for x in errs),
                                   max(x[1] for x in errs), dtype)
            for h in hs:
                for i in chunk:
                    out[h, i] = e
    return out


def kappa_abs(E, h, i, gauge, anchor=None) -> mp.mpf:
    """``exact.kappa`` with every difference replaced by the sum of its absolute values:
    ``sum_j |c_j| (|q| . (|k~_j| + |k_o|) + |beta_j| + |beta_o|) (|v_j - mu| + |v_j|) / S``.

    The derivation of ``KAPPA_REL`` bounds each factor's rounding relative to the absolute sizes
    of the components it is computed from; where ``k~_j`` nearly equals the anchor's key
    (equal keys, the max-key gauge at a near-tie) the computed ``|k~_j - k_o|`` keeps only that
    absolute accuracy, so the agreement is measured relative to this sum (>= ``kappa``)."""
    with mp.workprec(E.prec):
        perm = perm_of(E, i)
        r = E.spec.r
        S = max(abs(E.v[h, j, c]) for j in perm for c in range(r))
        if S == 0:
            return mp.mpf(0)
        c, ko, bo = key_gauge(E, h, i, gauge, anchor)
        q = E.q[h, i]
        tot = mp.fsum(abs(c[j]) * (mp.fsum(abs(a) * (abs(b) + abs(o)) for a, b, o in
                                           zip(q, E.k[h, j], ko))
                                   + abs(E.beta[h, i, j]) + abs(bo))
                      * (max(abs(E.v[h, j, x] - E.mu[h, i, x]) for x in range(r))
                         + max(abs(E.v[h, j, x]) for x in range(r))) for j in perm)
        return tot / S


OUTPUTS = ("s", "c", "kappa")


def stream_outputs(p, run: ScaleRun, max_bytes: int, E, ratios: dict) -> None:
    """The per-chunk scores, coefficients and condition numbers ``scale.stream`` returns on
    request (``outputs=("s", "c", "kappa")``, key gauges, float64) against the oracle's: scores
    to ``agreement_rel_tol`` of the size of their products; coefficients to ``KAPPA_REL``
    relative (the derivation of ``KAPPA_REL`` bounds a coefficient's relative error first,
    ``<= 1.5e-11`` at the suite's scores) plus float64's smallest normal number (a coefficient
    may underflow); ``kappa`` to ``KAPPA_REL`` of ``max(kappa_abs, KAPPA_FLOOR)``
    (:func:`kappa_abs`) -- at a max-key near-tie, of the candidate anchor closest to it."""
    spec, (N, m) = p.spec, p.x_kv.shape
    g = run.base_gauge
    tiny = float(np.finfo(np.float64).tiny)
    for ch in scale.stream(spec, p.weights, p.x_kv, p.pos_kv, gauge=g, max_bytes=max_bytes,
                           queries=None if run.queries is None else list(run.queries),
                           heads=None if run.heads is None else list(run.heads),
                           chunk=run.chunk, direct_keys=run.direct_keys,
                           outputs=OUTPUTS):
        sc, cc, kc = (ch.extra[k].double().numpy() for k in ("s", "c", "kappa"))
        for a, h in enumerate(ch.heads):
            for b, i in enumerate(ch.queries.tolist()):
                perm = perm_of(E, i)
                smax, spread, absdot, gap = score_facts(E, h, i)
                thr = tie_threshold(torch.float64, E, absdot)
                s_ex = np.array([float(E.s[h, i, j]) for j in perm])
                ratios["s"] = max(ratios.get("s", 0.0), float(
                    np.abs(sc[a, b, perm] - s_ex).max() / (thr + tiny)))
                cands = near_max(E, h, i, thr) if g == "maxkey" else [None]
                if len(cands) == 1:
                    c_ex, _, _ = key_gauge(E, h, i, g)
                    c_ex = np.array([float(c_ex[j]) for j in perm])
                    ratios["c"] = max(ratios.get("c", 0.0), float(
                        (np.abs(cc[a, b, perm] - c_ex) / (tl.KAPPA_REL * np.abs(c_ex) + tiny))
                        .max()))
                    off = np.delete(cc[a, b], perm)  # zero off the permitted set
                    assert not off.size or np.abs(off).max() == 0, off
                rel = min(float(abs(mp.mpf(float(kc[a, b])) - exact.kappa(E, h, i, g, anchor=c))
                                / max(kappa_abs(E, h, i, g, c), mp.mpf(tl.KAPPA_FLOOR)))
                          for c in cands)
                ratios["kappa"] = max(ratios.get("kappa", 0.0), rel / tl.KAPPA_REL)


def check_scale(p, run: ScaleRun, dtype=torch.float64) -> dict:
    """``scale.materialise`` against the oracle on layer ``p``; returns the worst error / bound
    ratios (asserted <= 1).

    float64: ``y``, ``mu`` to ``FLOAT64_REL`` of the value scale; the readout to
    ``readout_bound`` with the route's condition number (:func:`route_scales`; plus ``e kappa``
    for the low-rank rule, ``e`` the chunk's per-entry kernel accuracy :func:`lowrank_entry_rel`:
    every kernel entry within ``e`` relative moves the Laplacian sum by at most ``e`` times its
    terms); ``T``, ``b``, ``Delta M`` to ``FLOAT64_REL`` (plus ``e``) of their absolute-term
    size.  float32/bfloat16: ``K_LOW`` times the naive 24-bit error plus the floor, on the same
    rounded inputs.  Max-key matrices only where ``j*`` is unambiguous.  Refusals are checked
    to be the documented ones (coefficient overflow, certified by the oracle's ``kappa``; a
    spread needing more than ``N_MAX`` nodes).  Key gauges in float64 also compare the
    per-chunk ``s``, ``c``, ``kappa`` outputs (:func:`stream_outputs`).
    """
    spec = p.spec
    N, m = p.x_kv.shape
    d, r = spec.head_dim, spec.r
    u = tl.unit_roundoff(dtype)
    low = dtype != torch.float64
    if low:
        w_in, _, x_in, _ = rounded(p, dtype)
    else:
        w_in, x_in = p.weights, p.x_kv
    E = exact.build(spec, w_in, x_in, p.pos_kv, x_in, p.pos_kv, "causal", dps=DPS)
    N24 = exact.build_rounded(spec, w_in, x_in, p.pos_kv, x_in, p.pos_kv, "causal") if low \
        else None
    g = run.base_gauge
    heads = list(range(spec.n_heads)) if run.heads is None else list(run.heads)
    queries = list(range(N)) if run.queries is None else list(run.queries)
    mb = budget(p, run, dtype)
    gmax = max(len([h for h in hs if h in heads]) for hs in groups_of(spec))
    pl = scale.plan(spec, N, m, dtype, mb, n_queries=len(queries), delta_m=spec.affine,
                    gauge=g, pairwise=run.pairwise, chunk=run.chunk, heads_per_group=gmax)
    note(f"query chunks > 1: {pl.query_chunk < len(queries)}; key blocks > 1: "
         f"{pl.key_block < N}")
    if run.budget == "tiny":  # the budget really splits: one query a chunk, few keys a block
        assert pl.query_chunk == 1 and pl.key_block <= run.key_rows + 1, pl
    rule = {}
    tol_rule = 0.0
    if run.gauge == "pairwise-lowrank":
        tol_rule = run.tol if run.tol is not None else lowrank.default_tol(
            kernel.compute_dtype(dtype))
        rule = lowrank_entry_rel(E, spec, heads, queries, pl.query_chunk, tol_rule, dtype)
    try:
        out = run_scale(p, run, dtype, mb)
    except ValueError as exc:
        # documented refusal: a chunk's spread needs more Gauss-Legendre nodes than N_MAX
        assert run.gauge == "pairwise-lowrank" and "Gauss-Legendre" in str(exc), exc
        assert any(e is None for e in rule.values()), (exc, rule)
        note(f"{dtype} lowrank: refused (spread needs > N_MAX nodes)")
        return {"refused": 1.0}
    except FloatingPointError:
        # documented refusal: the original gauge's coefficients overflow.  The oracle's
        # condition number certifies that no readout in this gauge and dtype keeps a digit
        assert g == "original", g
        worst = max(exact.kappa(E, h, i, "original") for h in heads for i in queries)
        print("refused; exact kappa", mp.nstr(worst, 5))
        assert worst * u >= 1, str(worst)
        note(f"{dtype} original: refused, certified by the exact kappa")
        return {"refused": 1.0}
    assert all(e is not None for e in rule.values()), rule  # else it must refuse
    K, floor = tl.low_precision_bound(dtype)
    ratios: dict = {}
    rows = []  # per (h, i) records for the low-precision bound (needs the global naive max)

    def worst(name, ratio):
        ratios[name] = max(ratios.get(name, 0.0), float(ratio))

    for h in heads:
        kbar, vbar = global_means(E, h)
        for a, i in enumerate(queries):
            perm = perm_of(E, i)
            _, spread, absdot, gap = score_facts(E, h, i)
            smax = absdot  # the scores' rounding scale (score_facts)
            route = "direct" if (g != "pairwise" and len(perm) <= run.direct_keys) else "gemm"
            labs = abs_lmap(spec, w_in, h, int(p.pos_kv[i])) if spec.affine else None
            thr = tie_threshold(dtype, E, absdot)
            cands = near_max(E, h, i, thr) if g == "maxkey" else [None]
            sc = [route_scales(E, h, i, g, route, kbar, vbar, labs, anchor=c) for c in cands]
            rs = sc[0] if g != "maxkey" else route_scales(E, h, i, g, route, kbar, vbar, labs)
            S = rs["S"]
            kap = max(x["kappa"] for x in sc)
            if g == "pairwise":
                smax = smax + spread  # the rule exponentiates shifted scores t (s_j - s_max)
            got = {k: out[k][h, a].double().numpy() for k in out}
            ex = {"y": vec(E.y[h, i]), "mu": vec(E.mu[h, i])}
            ex["readout"] = ex["y"]
            Mq = query_space(E, h, i, g)
            ex["t"], ex["b"] = mat_np(Mq)[:d], mat_np(Mq)[d]
            if spec.affine:
                ex["delta_m"] = mat_np(exact.delta_m(E, h, i, g))
            clear = g != "maxkey" or (gap > thr and (N24 is None or len(near_max(
                N24, h, i, thr)) == 1))
            mats = ["t"] + (["b"] if "b" in got else []) + (["delta_m"] if spec.affine else [])
            scl = {"t": float(rs["tabs"].max()), "b": float(rs["babs"].max()),
                   "delta_m": float(rs["mabs"].max()) if spec.affine else 0.0}
            err = {k: float(np.abs(got[k] - ex[k]).max()) for k in ["y", "mu", "readout"] + mats}
            e_rule = rule.get((h, i), 0.0)
            rec = {"err": err, "S": S, "kap": kap, "smax": smax, "clear": clear, "scl": scl,
                   "rule": e_rule}
            if not low:
                worst("y", err["y"] / (tl.FLOAT64_REL * S))
                worst("mu", err["mu"] / (tl.FLOAT64_REL * S))
                bnd = max(tl.FLOAT64_REL,
                          float(tl.readout_bound(dtype, kap, len(perm), d, smax))
                          + e_rule * kap) * S
                worst("readout", err["readout"] / bnd if bnd > 0 else
                      (0.0 if err["readout"] == 0 else math.inf))
                if clear:
                    for k in mats:
                        b_ = (tl.FLOAT64_REL + e_rule) * scl[k]
                        worst(k, err[k] / b_ if b_ > 0 else (0.0 if err[k] == 0 else math.inf))
            else:
                nv = {"y": vec(N24.y[h, i]), "mu": vec(N24.mu[h, i])}
                if clear or g != "maxkey":
                    Mn = query_space(N24, h, i, g)
                    nv["t"], nv["b"] = mat_np(Mn)[:d], mat_np(Mn)[d]
                    Mdn = exact.delta_m(N24, h, i, g) if spec.affine else Mn
                    if spec.affine:
                        nv["delta_m"] = mat_np(Mdn)
                else:
                    Mdn = exact.delta_m(N24, h, i, g) if spec.affine else query_space(N24, h, i, g)
                nv["readout"] = naive_readout(N24, h, i, Mdn)
                rec["naive"] = {k: float(np.abs(nv[k] - ex[k]).max()) for k in nv}
            rows.append(rec)
    if low:
        fi = torch.finfo(kernel.compute_dtype(dtype))
        en = {}  # the naive reference's worst error of each quantity, relative to its scale
        for rec in rows:
            for k, e in rec["naive"].items():
                s_ = rec["S"] if k in ("y", "mu", "readout") else max(rec["scl"][k],
                                                                       fi.tiny / fi.eps)
                en[k] = max(en.get(k, 0.0), e / s_ if s_ > 0 else 0.0)
        for rec in rows:
            S, smax = rec["S"], rec["smax"]
            for k in ("y", "mu", "readout"):
                kap = max(1.0, rec["kap"]) if k == "readout" else 1.0
                fl = (floor + u * (smax if k != "mu" else 0.0)) * kap + \
                    (rec["rule"] * rec["kap"] if k == "readout" else 0.0)
                worst(k, rec["err"][k] / (S * (K * en[k] + fl)) if S > 0 else 0.0)
            if rec["clear"]:
                for k, e in rec["err"].items():
                    if k in ("y", "mu", "readout"):
                        continue
                    s_ = max(rec["scl"][k], fi.tiny / fi.eps)
                    worst(k, e / (s_ * (K * en.get(k, 0.0) + floor + u * smax + rec["rule"])))
    if not low and g != "pairwise":
        stream_outputs(p, run, budget(p, run, dtype, OUTPUTS), E, ratios)
    ratios["chunks"] = float(pl.query_chunk)
    ratios["key_block"] = float(pl.key_block)
    report(f"scale {dtype} {run.gauge} {run.budget} dk={run.direct_keys}", ratios)
    for k, v in ratios.items():
        if k not in ("chunks", "key_block"):
            assert v <= 1.0, (k, v, ratios)
    return ratios


SCALE_PINS = [(q, ScaleRun(gauge=g, budget=b, key_rows=1, direct_keys=dk,
                           queries_per_chunk=1 if b == "tiny" else 2))
              for q in pinned_layers()
              for g, b, dk in (("original", "tiny", 0), ("maxkey", "tiny", 2),
                               ("pairwise-lowrank", "small", 64), ("pairwise-lowrank", "tiny", 0),
                               ("pairwise-exact", "tiny", 0))
              if not (g.startswith("pairwise") and q.spec.softcap is not None)]


@pytest.mark.parametrize("p,run", SCALE_PINS, ids=[f"{q.label}-{r.gauge}" for q, r in SCALE_PINS])
def test_scale_float64_pinned(p, run):
    """The hard cases (a single key, scores at 0, every score near -800 or -40, bias-only
    tokens, equal scores, spread 1400, repeated positions) in every gauge, tiny budgets."""
    check_scale(p, run, torch.float64)


def test_scale_fixed_chunk_larger_than_the_query_count():
    p = make_problem(N=1)
    out = scale.materialise(p.spec, p.weights, p.x_kv, p.pos_kv, chunk=2)
    E = exact.build(*p.args(), dps=DPS)
    assert np.abs(out["y"].numpy() - exact.to_float(E.y)).max() <= tl.FLOAT64_REL


@pytest.mark.parametrize("gauge", SCALE_GAUGES)
@settings(max_examples=n_examples(40))
@given(data=st.data())
def test_scale_float64_vs_exact(gauge, data):
    """Every gauge, family, budget and ``direct_keys`` of the streamed layer, float64 (soft-caps
    only in the key gauges: the streamed pairwise gauge refuses them)."""
    p = data.draw(layers(softcap=not gauge.startswith("pairwise")), label="p")
    check_scale(p, data.draw(scale_runs(p, gauges=(gauge,)), label="run"), torch.float64)


# ---------------------------------------------------------------------------------------------
# ropestep.lowrank: the rule, its bound and its node count against mpmath
# ---------------------------------------------------------------------------------------------
def check_rule(spread: float, tol: float) -> dict:
    """``choose_nodes``/``gl_error_bound``/``gl_nodes`` against the rule computed in mpmath.

    (a) ``gl_error_bound`` equals its closed form (mpmath) to ``FLOAT64_REL``; (b) the node
    count is the smallest whose (mpmath) bound meets ``tol``; (c) the exact n-point rule's error
    for ``exp[z_j, z_k]`` at ``|z_j - z_k| <= spread`` (both signs) is within the bound -- the
    mathematical claim; (d) the shipped float64 rule, summed exactly, is within
    ``tol + weight_rel + spread node_abs`` (its measured distance from the exact rule) and,
    summed in float64, within ``tolerances.gl_rule_rel``."""
    try:
        n = lowrank.choose_nodes(spread, tol)
    except ValueError:  # refused: more than N_MAX nodes needed
        b = gl_bound_mp(lowrank.N_MAX, spread)
        print(f"rule spread {spread:.4g} tol {tol:.0e}: refused, bound(N_MAX) {mp.nstr(b, 3)}")
        assert b > tol * (1 - tl.FLOAT64_REL)
        return {"refused": 1.0}
    ratios = {}
    b_mp = gl_bound_mp(n, spread)
    b_lib = lowrank.gl_error_bound(n, spread)
    # gl_error_bound is evaluated in logs: its error is relative to the logs' absolute sum
    with mp.workdps(RULE_DPS):
        logs = mp.fsum(abs(x) for x in (
            (2 * n + 1) * mp.log(spread) if spread > 0 else 0, 4 * mp.loggamma(n + 1),
            mp.log(2 * n + 1), 3 * mp.loggamma(2 * n + 1),
            mp.log(-mp.expm1(-mp.mpf(spread))) if spread > 0 else 0))
    tol_b = tl.exp_of_sum_rel(float(logs), 5)
    # (a bound below float64's smallest normal number may underflow: it meets any tol anyway)
    tiny = mp.mpf(float(np.finfo(np.float64).tiny))
    ratios["bound_formula"] = float(abs(mp.mpf(b_lib) - b_mp) / (tol_b * b_mp + tiny))
    ratios["meets_tol"] = float(b_mp / (tol * (1 + tl.FLOAT64_REL)))
    if n > 1:  # smallest: one node fewer misses tol
        ratios["minimal"] = float(tol * (1 - tl.FLOAT64_REL) / gl_bound_mp(n - 1, spread))
    ts, ws = exact_rule(n)
    t64, w64 = lowrank.gl_nodes(n)
    na, wr = shipped_rule_errors(n)
    shipped = tol + wr + spread * na
    floor64 = tl.gl_rule_rel(tol, spread, n, na, wr, torch.float64)
    for delta in {spread, -spread, spread / 2, -spread / 2}:
        e_exact = rule_rel_error(ts, ws, delta)
        with mp.workdps(RULE_DPS):  # the mpmath sum of n terms rounds at (n + 8) eps itself
            ratios["exact_rule"] = max(ratios.get("exact_rule", 0.0), float(
                e_exact / (b_mp * (1 + tl.FLOAT64_REL) + (n + 8) * mp.eps)))
        e_ship = rule_rel_error([float(t) for t in t64], [float(w) for w in w64], delta)
        ratios["shipped_exact_sum"] = max(ratios.get("shipped_exact_sum", 0.0),
                                          float(e_ship / shipped))
        # summed in float64 as the kernel does, on shifted scores z <= 0: e^{t z_j} with
        # z_j = -|delta| (z_k = 0), and e^{(1 - t) z_k} with z_k = -|delta| (z_j = 0)
        for q64 in (np.sum(w64 * np.exp(t64 * -abs(delta))),
                    np.sum(w64 * np.exp((1.0 - t64) * -abs(delta)))):
            with mp.workdps(RULE_DPS):
                ex = exact.phi1(-mp.mpf(abs(delta)))
                e64 = float(abs(mp.mpf(float(q64)) - ex) / ex)
            ratios["shipped_float64"] = max(ratios.get("shipped_float64", 0.0), e64 / floor64)
    print(f"rule spread {spread:.4g} tol {tol:.0e} n {n} node_abs {na:.1e} weight_rel {wr:.1e}",
          {k: f"{v:.2e}" for k, v in ratios.items()})
    for k, v in ratios.items():
        assert v <= 1.0, (k, v, spread, tol, n)
    return ratios


@settings(max_examples=n_examples(30))
@given(rule=lowrank_rules())
@example(rule=(0.0, 1e-14))
@example(rule=(1e-12, 1e-14))
@example(rule=(80.0, 1e-12))
@example(rule=(700.0, 1e-14))
@example(rule=(1400.0, 1e-14))
def test_lowrank_rule_vs_mpmath(rule):
    check_rule(*rule)


def test_lowrank_shipped_rule_meets_its_tolerance_at_large_spread():
    """The shipped float64 rule, summed exactly, against ``tol`` plus the float64 evaluation's
    own rounding (``gl_rule_rel`` with exact nodes and weights), at spread 200."""
    spread, tol = 200.0, lowrank.default_tol(torch.float64)
    n = lowrank.choose_nodes(spread, tol)
    t64, w64 = lowrank.gl_nodes(n)
    allowed = tl.gl_rule_rel(tol, spread, n, 0.0, 0.0, torch.float64)
    err = max(rule_rel_error([float(t) for t in t64], [float(w) for w in w64], dl)
              for dl in (spread, -spread))
    print(f"n {n}: shipped rule error {mp.nstr(err, 3)}, allowed {allowed:.2e}, "
          f"(node_abs, weight_rel) = {shipped_rule_errors(n)}")
    assert err <= allowed


LOW_PINS = [(q, ScaleRun(gauge=g, budget="tiny", key_rows=1, direct_keys=dk))
            for q in pinned_layers() if q.label != "every score near -800"
            for g, dk in (("original", 0), ("maxkey", 64), ("pairwise-lowrank", 0))
            if not (g.startswith("pairwise") and q.spec.softcap is not None)]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("p,run", LOW_PINS, ids=[f"{q.label}-{r.gauge}" for q, r in LOW_PINS])
def test_scale_low_precision_pinned(p, run, dtype):
    check_scale(p, run, dtype)


@pytest.mark.parametrize("gauge", SCALE_GAUGES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@settings(max_examples=n_examples(15))
@given(data=st.data())
def test_scale_low_precision_vs_exact(dtype, gauge, data):
    """float32/bfloat16: ``err(scale) <= K_LOW err(naive 24-bit) + floor`` in every gauge."""
    p = data.draw(layers(max_n=7, softcap=not gauge.startswith("pairwise")), label="p")
    check_scale(p, data.draw(scale_runs(p, gauges=(gauge,)), label="run"), dtype)


# ---------------------------------------------------------------------------------------------
# frozen reuse and its operator-norm bound (fast.frozen_reuse) against the oracle
# ---------------------------------------------------------------------------------------------
def refused_certified(E, heads, queries, gauge, dtype) -> None:
    """A documented refusal (``FloatingPointError``: the gauge's coefficients overflow): the
    oracle's condition number certifies that no readout in this gauge and dtype keeps a digit."""
    worst = max(exact.kappa(E, h, i, gauge) for h in heads for i in queries)
    print("refused; exact kappa", mp.nstr(worst, 5))
    assert worst * tl.unit_roundoff(dtype) >= 1, str(worst)


def op_norm(M) -> mp.mpf:
    """Spectral norm of an mpmath matrix: sqrt of the largest eigenvalue of ``M^T M``."""
    return mp.sqrt(max(mp.eigsy(M.T * M, eigvals_only=True)))


def check_reuse(p, anchor: int = 0) -> dict:
    """``fast.frozen_reuse`` (original gauge, a bank at one position) against the oracle.

    Per head and query, relative to the value scale ``S``: the frozen readout ``mu + u_i^T
    Delta M_a`` and the measured error ``y_i - frozen_i`` to ``readout_bound`` with the frozen
    sum's condition number (``sum_j |c_aj| (|q_i| . |k~_j| + |beta_j|)(|v_j - mu| + |v_j|) / S``:
    the anchor's coefficients met by query i); the tokenwise error ``sum_j (c_ij - c_aj)(u_i .
    a_j)(v_j - mu)`` likewise with ``|c_ij| + |c_aj|``; the refresh ``T_i - T_a`` to
    ``FLOAT64_REL`` of its terms' size; and, for affine heads, the bound ``||u_i|| ||Delta M_i
    - Delta M_a||_op`` to ``FLOAT64_REL ||u_i|| ||[L | e]||_F ||[T; b]-terms||_F`` (a norm moves
    by at most the perturbation's norm; the QR of ``[L | e]`` is backward stable).  The bound
    itself is checked as a theorem in mpmath, and the fast error against the fast bound."""
    spec = p.spec
    d, r = spec.head_dim, spec.r
    N = p.x_kv.shape[0]
    E = exact.build(*p.args(), bias=p.bias, dps=DPS)
    H, Q = E.u.shape[:2]
    try:
        st_ = fast.step(*p.args(), bias=p.bias, delta_m=spec.affine)
    except FloatingPointError:
        refused_certified(E, range(H), range(Q), "original", torch.float64)
        return {"refused": 1.0}
    ru = fast.frozen_reuse(st_, anchor=anchor)
    ratios: dict = {}

    def worst(name, err, bnd):
        ratios[name] = max(ratios.get(name, 0.0),
                           float(err / bnd) if bnd > 0 else (0.0 if err == 0 else math.inf))

    with mp.workprec(E.prec):
        for h in range(H):
            ca, _ = exact.coefficients(E, h, anchor)
            Ma = exact.delta_m(E, h, anchor)
            Ta = exact.t_matrix(E, h, anchor)
            for i in range(Q):
                perm = perm_of(E, i)
                ci, _ = exact.coefficients(E, h, i)
                S = max(abs(E.v[h, j, x]) for j in perm for x in range(r))
                smax = max(score_facts(E, h, i)[2], score_facts(E, h, anchor)[2])
                q = E.q[h, i]
                A = {j: mp.fsum(abs(a) * abs(b) for a, b in zip(q, E.k[h, j]))
                     + abs(E.beta[h, i, j]) for j in perm}
                V = {j: [abs(E.v[h, j, x] - E.mu[h, i, x]) + abs(E.v[h, j, x]) for x in range(r)]
                     for j in perm}
                k_fr = float(mp.fsum(abs(ca[j]) * A[j] * max(V[j]) for j in perm) / S)
                k_tok = float(mp.fsum((abs(ci[j]) + abs(ca[j])) * A[j] * max(V[j])
                                      for j in perm) / S)
                b_fr = max(tl.FLOAT64_REL, float(tl.readout_bound(torch.float64, k_fr, N, d,
                                                                  smax))) * float(S)
                b_tok = max(tl.FLOAT64_REL, float(tl.readout_bound(torch.float64, k_tok, N, d,
                                                                   smax))) * float(S)
                fr_mp = exact.readout(E, h, i, Ma)
                tok_mp = exact.tokenwise_reuse_error(E, h, i, anchor)
                fr, y, tok = vec(fr_mp), vec(E.y[h, i]), vec(tok_mp)
                worst("frozen", np.abs(ru.frozen[h, i].numpy() - fr).max(), b_fr)
                worst("error", np.abs(ru.error[h, i].numpy() - (y - fr)).max(),
                      b_fr + tl.FLOAT64_REL * float(S))
                worst("tokenwise", np.abs(ru.tokenwise[h, i].numpy() - tok).max(), b_tok)
                # the tokenwise formula is exact: it equals the measured error (in mpmath, to
                # half the working precision of the frozen sum's terms)
                worst("oracle_tokenwise=error",
                      max(abs(tok_mp[x] - (E.y[h, i, x] - fr_mp[x])) for x in range(r)),
                      (k_fr + k_tok + 1) * S * mp.mpf(2) ** (-E.prec // 2))
                Ti = exact.t_matrix(E, h, i)
                tabs = np.array([[float(mp.fsum((abs(ci[j]) + abs(ca[j])) * abs(E.k[h, j][c])
                                                * V[j][x] for j in perm)) for x in range(r)]
                                 for c in range(d)])
                worst("refresh_t", np.abs(ru.refresh_t[h, i].numpy() - mat_np(Ti - Ta)).max(),
                      tl.FLOAT64_REL * tabs.max())
                if not spec.affine:
                    assert ru.bound is None
                    continue
                Di = exact.delta_m(E, h, i) - Ma
                unorm = mp.sqrt(mp.fsum(x * x for x in E.u[h, i]))
                b_ex = unorm * op_norm(Di)
                e_ex = mp.sqrt(mp.fsum((E.y[h, i, x] - fr_mp[x]) ** 2 for x in range(r)))
                worst("theorem", e_ex, b_ex + (k_fr + 1) * S * mp.mpf(2) ** (-E.prec // 2))
                L = E.extras["L"][h, i]
                lhat_f = mp.sqrt(mp.fsum(x * x for x in L) + 1)
                babs = [mp.fsum((abs(ci[j]) + abs(ca[j])) * abs(E.beta[h, i, j]) * V[j][x]
                                for j in perm) for x in range(r)]
                mabs_f = mp.sqrt(mp.fsum(mp.mpf(x) ** 2 for x in tabs.reshape(-1))
                                 + mp.fsum(x * x for x in babs))
                tol_b = tl.FLOAT64_REL * float(unorm * lhat_f * mabs_f)
                worst("bound", abs(float(ru.bound[h, i]) - float(b_ex)), tol_b)
                ne = float(torch.linalg.vector_norm(ru.error[h, i]))
                worst("fast_error<=fast_bound", max(0.0, ne - float(ru.bound[h, i])),
                      tol_b + b_fr * math.sqrt(r))
    report(f"reuse {p.label or 'drawn'}", ratios)
    for k, v in ratios.items():
        assert v <= 1.0, (k, v, ratios)
    return ratios


@settings(max_examples=n_examples(30))
@given(p=reuse_banks())
@example(p=make_problem(label="single key bank", N=1, bank=True, Q=3))
@example(p=with_bias(make_problem(label="every score <= -30, per-key bias", N=6, bank=True,
                                  amp=0.3, seed=4), "const", amp=-40.0))
@example(p=with_bias(make_problem(label="every score < -709", N=5, bank=True, amp=0.3),
                     "const", amp=-800.0))
@example(p=with_bias(make_problem(label="ALiBi and per-key bias", N=6, bank=True, alibi=True,
                                  seed=7), "per_key", seed=3, amp=3.0))
@example(p=make_problem(label="bias-only queries", bias_only=True, N=5, bank=True))
@example(p=make_problem(label="scores near 0", scale=1e-13, N=5, bank=True))
def test_frozen_reuse_vs_exact(p):
    check_reuse(p)


# ---------------------------------------------------------------------------------------------
# the prefix/full relation (fast.self_mass, prefix_full, full_bank_mean) against the oracle
# ---------------------------------------------------------------------------------------------
def check_prefix_full(p) -> dict:
    """For every query of a bank: the fast prefix step's ``y``/``mu`` (max-key gauge) and the
    self-score and value of a fast step on the full bank (prefix plus the query's own key) go
    through ``self_mass``, ``prefix_full`` and ``full_bank_mean``; compared with the oracle's
    full-bank softmax output, uniform mean and self mass ``e^{phi(s_self)} / Z_full`` to
    ``FLOAT64_REL`` (outputs of the value scale, the mass absolutely: it lies in [0, 1])."""
    spec = p.spec
    N = p.x_kv.shape[0]
    st_ = fast.step(*p.args(), gauge="maxkey")
    ratios: dict = {}
    for i in range(p.x_q.shape[0]):
        xf = np.concatenate([p.x_kv, p.x_q[i:i + 1]])
        pf = np.concatenate([p.pos_kv, p.pos_q[i:i + 1]])
        sf = fast.step(spec, p.weights, p.x_q[i:i + 1], p.pos_q[i:i + 1], xf, pf, "bank",
                       gauge="maxkey")
        v_self = sf.extras["projected"].v[:, N]
        pi = fast.self_mass(sf.s[:, 0, N], st_.s[:, i], spec.softcap)
        y_full = fast.prefix_full(st_.y[:, i], v_self, pi)
        mu_full = fast.full_bank_mean(st_.mu[:, i], v_self, N)
        Ef = exact.build(spec, p.weights, p.x_q[i:i + 1], p.pos_q[i:i + 1], xf, pf, "bank",
                         dps=DPS)
        with mp.workprec(Ef.prec):
            for h in range(spec.n_heads):
                S = float(max(abs(x) for x in Ef.v[h].reshape(-1)))
                pi_ex = mp.exp(exact.score_transform(Ef.s[h, 0, N], spec.softcap)) / Ef.Z[h, 0]
                y_ex = vec(Ef.y[h, 0])
                for name, got, ex, sc in (("y_full", y_full[h], y_ex, S),
                                          ("mu_full", mu_full[h], vec(Ef.mu[h, 0]), S),
                                          ("pi", pi[h:h + 1], np.array([float(pi_ex)]), 1.0),
                                          ("v_self", v_self[h], vec(Ef.v[h, N]), S)):
                    e = float(np.abs(got.numpy() - ex).max())
                    ratios[name] = max(ratios.get(name, 0.0), e / (tl.FLOAT64_REL * sc)
                                       if sc > 0 else float(e > 0))
    report(f"prefix {p.label or 'drawn'}", ratios)
    for k, v in ratios.items():
        assert v <= 1.0, (k, v, ratios)
    return ratios


@settings(max_examples=n_examples(25))
@given(p=problems(max_n=7, bank=True))
@example(p=make_problem(label="single key bank", N=1, bank=True, Q=2))
@example(p=make_problem(label="scores near +-700", spread=1400.0, N=6, bank=True, seed=3))
@example(p=make_problem(label="softcap ALiBi", softcap=5.0, alibi=True, N=5, bank=True))
def test_prefix_full_vs_exact(p):
    check_prefix_full(p)


# ---------------------------------------------------------------------------------------------
# the descent diagnostics (fast.descent) against the oracle
# ---------------------------------------------------------------------------------------------
def check_descent(p, gauge) -> dict:
    """``fast.descent`` (lambda_max(H_i), E_i(0), E_i(Delta M_i)) against ``exact.lam_max``
    and ``exact.objective`` at every head and query, original and max-key gauges (max-key rows
    with an ambiguous ``j*`` skipped: another anchor is another, equally valid, gauge).

    Error sizes (first order, all from the oracle's quantities; ``hat k_j = [k~_j - k_o;
    beta_j - beta_o]``, ``hat L = [L_i | e_{m+1}]``; ``|hat k_j|`` counts the keys' and biases'
    own sizes as in :func:`route_scales`): ``lambda_max`` of ``hat L G hat L^T``
    (``G = sum_j c_j hat k_j hat k_j^T``) within ``descent_bound`` of ``||hat L||_F^2 tr |G|``
    (>= lambda_max); ``E(0) = 1/2 sum_j c_j ||v_j - mu||^2`` of ``1/2 sum_j c_j || |v_j - mu|
    + |v_j| + |mu| ||^2``; ``E(Delta M)`` of ``sum_j c_j sum_q |res_jq| rho_jq`` plus the
    second-order ``1/2 sum_j c_j ||rho_j||^2`` times the bound's factor squared, with ``res_j =
    a_j^T Delta M - (v_j - mu)`` and ``rho_j = |hat k_j|^T |hat L|^T |hat L| Tabs + |v_j| +
    |mu|`` the size of the computed residual (``Tabs`` the terms' size of ``[T; b]``).  A
    coefficient may underflow: plus float64's smallest normal number times each size at unit
    weights."""
    spec = p.spec
    (Q, m), N, d, r = p.x_q.shape, p.x_kv.shape[0], spec.head_dim, spec.r
    E = exact.build(*p.args(), bias=p.bias, dps=DPS)
    H = spec.n_heads
    try:
        st_ = fast.step(*p.args(), bias=p.bias, delta_m=True, gauge=gauge)
    except FloatingPointError:
        assert gauge == "original"
        refused_certified(E, range(H), range(Q), gauge, torch.float64)
        return {"refused": 1.0}
    fmax = mp.mpf(float(np.finfo(np.float64).max))
    try:
        dc = fast.descent(st_)
    except FloatingPointError:
        # lambda_max beyond float64's range: refused with a message -- accepted only there
        assert max(exact.lam_max(E, h, i, gauge) for h in range(H) for i in range(Q)) > fmax
        note("descent: lambda_max beyond float64, FloatingPointError")
        return {"refused": 1.0}
    ratios: dict = {}
    tiny = mp.mpf(float(np.finfo(np.float64).tiny))  # a coefficient may underflow

    def worst(name, err, bnd):
        ratios[name] = max(ratios.get(name, 0.0),
                           float(err / bnd) if bnd > 0 else (0.0 if err == 0 else math.inf))

    with mp.workprec(E.prec):
        for h in range(H):
            for i in range(Q):
                _, _, absdot, gap = score_facts(E, h, i)
                smax = absdot  # the scores' rounding scale (score_facts)
                if gauge == "maxkey" and gap <= tie_threshold(torch.float64, E, absdot):
                    continue
                perm = perm_of(E, i)
                c, ko, bo = key_gauge(E, h, i, gauge)
                kh = {j: [E.k[h, j][x] - ko[x] for x in range(d)] + [E.beta[h, i, j] - bo]
                      for j in perm}
                # their sizes, with the keys' and biases' own (route_scales)
                ka = {j: [abs(E.k[h, j][x] - ko[x]) + abs(E.k[h, j][x]) + abs(ko[x])
                          for x in range(d)]
                      + [abs(E.beta[h, i, j] - bo) + abs(E.beta[h, i, j]) + abs(bo)]
                      for j in perm}
                L = E.extras["L"][h, i]
                Lh = mp.matrix(m + 1, d + 1)
                for a in range(m + 1):
                    for b in range(d):
                        Lh[a, b] = L[a, b]
                Lh[m, d] = 1
                Lh_f2 = mp.fsum(x * x for x in Lh)
                trG = mp.fsum(c[j] * mp.fsum(x * x for x in ka[j]) for j in perm)
                trG1 = mp.fsum(mp.fsum(x * x for x in ka[j]) for j in perm)  # unit weights
                lam = exact.lam_max(E, h, i, gauge)
                if lam > fmax:  # beyond float64: inf or nan (reported, not a finite lie)
                    assert not math.isfinite(float(dc.lam_max[h, i])), float(dc.lam_max[h, i])
                    continue
                worst("lam_max", abs(mp.mpf(float(dc.lam_max[h, i])) - lam),
                      tl.descent_bound(torch.float64, Lh_f2 * trG, N, d, m, smax)
                      + tiny * Lh_f2 * trG1)
                mu = E.mu[h, i]
                vabs = {j: [abs(E.v[h, j, x] - mu[x]) + abs(E.v[h, j, x]) + abs(mu[x])
                            for x in range(r)] for j in perm}
                e0 = exact.objective(E, h, i, mp.zeros(m + 1, r), gauge)
                s0 = mp.fsum(c[j] * mp.fsum(x * x for x in vabs[j]) for j in perm) / 2
                s0_1 = mp.fsum(mp.fsum(x * x for x in vabs[j]) for j in perm) / 2
                worst("E0", abs(mp.mpf(float(dc.e0[h, i])) - e0),
                      tl.descent_bound(torch.float64, s0, N, d, m, smax) + tiny * s0_1)
                M = exact.delta_m(E, h, i, gauge)
                e1 = exact.objective(E, h, i, M, gauge)
                Vt = {j: [abs(E.v[h, j, x] - mu[x]) + abs(E.v[h, j, x]) for x in range(r)]
                      for j in perm}
                tabs = mp.matrix(d + 1, r)  # the terms' size of [T; b]
                for j in perm:
                    for a in range(d + 1):
                        for x in range(r):
                            tabs[a, x] += abs(c[j]) * ka[j][a] * Vt[j][x]
                LL = mp.matrix([[abs(Lh[a, b]) for b in range(d + 1)] for a in range(m + 1)])
                G2 = LL.T * LL * tabs  # |hat L|^T |hat L| Tabs, (d+1) x r
                s1 = s2 = s1_1 = mp.mpf(0)
                for j in perm:
                    a_j = [mp.fsum(L[a, b] * kh[j][b] for b in range(d)) + (kh[j][d] if a == m
                                                                             else 0)
                           for a in range(m + 1)]
                    for x in range(r):
                        res = mp.fsum(a_j[a] * M[a, x] for a in range(m + 1)) - (
                            E.v[h, j, x] - mu[x])
                        rho = mp.fsum(ka[j][a] * G2[a, x] for a in range(d + 1)) + \
                            abs(E.v[h, j, x]) + abs(mu[x])
                        s1 += c[j] * abs(res) * rho
                        s2 += c[j] * rho * rho / 2
                        s1_1 += (abs(res) + rho) * rho
                f = tl.descent_bound(torch.float64, 1.0, N, d, m, smax)
                b1 = f * s1 + f * f * s2 + tiny * s1_1
                if e1 > fmax:  # beyond float64: inf or nan (reported, not a finite lie)
                    assert not math.isfinite(float(dc.e1[h, i])), float(dc.e1[h, i])
                    continue
                if b1 > fmax:  # the bound is vacuous: any float, inf included, is within it
                    note("descent: vacuous E1 bound (the residual cancels beyond float64)")
                    continue
                worst("E1", abs(mp.mpf(float(dc.e1[h, i])) - e1), b1)
                if lam < 2:  # the unit step cannot increase E (a theorem, in mpmath)
                    worst("descends", max(mp.mpf(0), e1 - e0), mp.eps * (abs(e0) + 1))
    report(f"descent {gauge} {p.label or 'drawn'}", ratios)
    for k, v in ratios.items():
        assert v <= 1.0, (k, v, ratios)
    return ratios


@pytest.mark.parametrize("gauge", ["original", "maxkey"])
@settings(max_examples=n_examples(25))
@given(p=biased_problems(max_n=7))
@example(p=make_problem(seed=5, N=6, bank=True, amp=3.0, label="lambda_max > 2"))
@example(p=make_problem(seed=6, N=6, bank=True, amp=0.1, label="lambda_max < 2"))
@example(p=make_problem(label="single key", N=1))
@example(p=make_problem(label="bias-only queries", bias_only=True, N=5))
@example(p=with_bias(make_problem(label="very negative", N=5, amp=0.3), "const", amp=-800.0))
@example(p=with_bias(make_problem(N=1, H=1, Hk=1, zero_query=True, label="lambda ~ 1e309"),
                     "const", amp=-705.0))
def test_descent_vs_exact(p, gauge):
    check_descent(p, gauge)


def test_descent_overflow_is_reported_not_a_linalg_error():
    p = with_bias(make_problem(N=1, H=1, Hk=1, zero_query=True, label="single key, s = -705"),
                  "const", amp=-705.0)
    E = exact.build(*p.args(), bias=p.bias, dps=DPS)
    assert exact.lam_max(E, 0, 0) > mp.mpf(float(np.finfo(np.float64).max))
    st_ = fast.step(*p.args(), bias=p.bias, delta_m=True)
    try:
        dc = fast.descent(st_)
    except FloatingPointError:
        return
    assert float(dc.lam_max[0, 0]) == math.inf


def test_descent_and_reuse_refuse_other_gauges():
    """Where the diagnostics are not defined (pairwise, a free vector gauge) they are refused,
    not returned."""
    p = make_problem(N=5, bank=True)
    for g in ("pairwise", np.full(p.x_q.shape[1] + 1, 0.1)):
        st_ = fast.step(*p.args(), delta_m=True, gauge=g)
        with pytest.raises(ValueError):
            fast.descent(st_)
        with pytest.raises(ValueError):
            fast.frozen_reuse(st_)
    st_ = fast.step(*p.args(), delta_m=True, gauge="pairwise")
    with pytest.raises(ValueError, match="original and max-key"):
        fast.descent(st_)
    with pytest.raises(ValueError, match="original gauge"):
        fast.frozen_reuse(st_)


def test_descent_refuses_a_vector_gauge_by_name():
    p = make_problem(N=5, bank=True)
    st_ = fast.step(*p.args(), delta_m=True, gauge=np.full(p.x_q.shape[1] + 1, 0.1))
    with pytest.raises(ValueError, match="original and max-key"):
        fast.descent(st_)


# ---------------------------------------------------------------------------------------------
# the checks can fail: wrong formulas in the kernel turn them red
# ---------------------------------------------------------------------------------------------
def _unmasked_mean(v, mask):
    """The mean over every key of the chunk, ignoring the permitted sets."""
    return v.mean(-2, keepdim=True).expand(v.shape[0], mask.shape[0], v.shape[-1])


def _first_key_block_only(self, c):
    """``C @ P`` over the first key block only (a dropped accumulation)."""
    rows = c.reshape(-1, self.n)
    hi = min(self.n, self.key_block)
    return rows[:, :hi] @ self(0, hi)


_ORIG = {"laplacian_apply": lowrank.laplacian_apply, "choose_nodes": lowrank.choose_nodes,
         "phi1": kernel.phi1}

# name -> (module, attribute, replacement, layer, run)
SCALE_MUTANTS = {
    "phi1 is exp": (kernel, "phi1", lambda s: torch.exp(kernel.ftensor(s)),
                    make_problem(N=6, seed=1), ScaleRun(gauge="maxkey", direct_keys=2)),
    "soft-cap divided difference dropped": (
        kernel, "transform_dd", lambda a, b, softcap: torch.ones(
            torch.broadcast_shapes(a.shape, b.shape), dtype=a.dtype),
        make_problem(N=6, seed=2, softcap=5.0, spread=30.0),
        ScaleRun(gauge="original", direct_keys=0)),
    "mean over the unmasked chunk": (kernel, "uniform_mean", _unmasked_mean,
                                     make_problem(N=6, seed=3),
                                     ScaleRun(gauge="original", direct_keys=64)),
    "key blocks after the first dropped": (
        kernel.PBlocks, "matmul", _first_key_block_only, make_problem(N=6, seed=4),
        ScaleRun(gauge="maxkey", budget="tiny", key_rows=1, direct_keys=0)),
    "Laplacian sign flipped": (
        lowrank, "laplacian_apply", lambda D, x: -_ORIG["laplacian_apply"](D, x),
        make_problem(N=6, seed=5, alibi=True), ScaleRun(gauge="pairwise-exact")),
    "a quarter of the Gauss-Legendre nodes": (
        lowrank, "choose_nodes", lambda spread, tol, n_max=lowrank.N_MAX: max(
            1, _ORIG["choose_nodes"](spread, tol, n_max) // 4),
        make_problem(N=6, seed=6, spread=80.0), ScaleRun(gauge="pairwise-lowrank", tol=1e-10)),
}


@pytest.mark.parametrize("name", list(SCALE_MUTANTS))
def test_scale_check_detects_wrong_formulas(name, monkeypatch):
    """The streamed-layer check passes on the real kernel and fails on each mutant."""
    module, attr, repl, p, run = SCALE_MUTANTS[name]
    check_scale(p, run, torch.float64)
    monkeypatch.setattr(module, attr, repl)
    with pytest.raises(AssertionError):
        check_scale(p, run, torch.float64)


def _drop_bias_rows(gauge_chunk):
    def wrapped(*a, **k):
        out = gauge_chunk(*a, **k)
        out.pop("b", None)  # the bias-row term b_i lost on its way into Delta M
        return out
    return wrapped


REUSE_PROBLEM = with_bias(make_problem(label="ALiBi, per-key bias", N=6, bank=True, alibi=True,
                                       seed=7), "per_key", seed=3, amp=3.0)


@pytest.mark.parametrize("name", ["phi1 is exp", "bias rows dropped"])
def test_reuse_check_detects_wrong_formulas(name, monkeypatch):
    check_reuse(REUSE_PROBLEM)
    if name == "phi1 is exp":
        monkeypatch.setattr(kernel, "phi1", lambda s: torch.exp(kernel.ftensor(s)))
    else:
        monkeypatch.setattr(fast, "gauge_chunk", _drop_bias_rows(kernel.gauge_chunk))
    with pytest.raises(AssertionError):
        check_reuse(REUSE_PROBLEM)


@pytest.mark.parametrize("gauge", ["original", "maxkey"])
def test_descent_check_detects_wrong_coefficients(gauge, monkeypatch):
    """``c = rho(s)/Z`` replaced by the softmax weight ``e^s/Z``: lambda_max and E move."""
    p = make_problem(seed=5, N=6, bank=True, amp=1.0)
    check_descent(p, gauge)
    monkeypatch.setattr(kernel, "phi1", lambda s: torch.exp(kernel.ftensor(s)))
    with pytest.raises(AssertionError):
        check_descent(p, gauge)


def test_prefix_full_check_detects_a_wrong_mean(monkeypatch):
    """The prefix/full check fails when the prefix mean is taken over the wrong set."""
    p = make_problem(seed=8, N=5, bank=True)
    check_prefix_full(p)
    monkeypatch.setattr(kernel, "uniform_mean", lambda v, mask: _unmasked_mean(v, mask) * 0.5)
    with pytest.raises(AssertionError):
        check_prefix_full(p)


def test_rule_check_detects_an_understated_bound(monkeypatch):
    """A Gauss-Legendre bound understated by 1e3 picks too few nodes: red."""
    check_rule(40.0, 1e-12)
    orig = lowrank.gl_error_bound
    monkeypatch.setattr(lowrank, "gl_error_bound", lambda n, spread: orig(n, spread) * 1e-3)
    with pytest.raises(AssertionError):
        check_rule(40.0, 1e-12)
