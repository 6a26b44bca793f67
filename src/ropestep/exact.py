"""Exact layer: the oracle.  Arbitrary-precision (mpmath) evaluation of every formula.

Written as the paper writes it, one head and one query at a time, with explicit objects:
the d x d rotation ``R(p)`` built pair by pair, the map ``L_i = W^_q R(p_i)^T * scale``, the
features ``a_ij = L_i k~_j^T + beta_ij e_{m+1}`` in the augmented input space, and
``Delta M_i = sum_j c_ij (a_ij - g)(v_j - mu_i)^T`` summed key by key.  No code is shared with
:mod:`ropestep.fast` beyond the head description in :mod:`ropestep.spec`, so comparing the two
is a real test.  Float inputs are converted to mpf exactly (every float64/float32 is a dyadic
rational), so the only rounding is at the working precision.

For the families whose score is not affine in ``u`` (``qknorm``, ``cosine``) the same
construction runs in query space: ``u~_i = [q_i; 1]``, ``a~_ij = [k~_j; beta_ij]``.  The
gradient step in the query-space parametrisation of docs/math.md sections 3 and 11 (input
``[q~_i; 1]`` without the score scale, features ``[scale k~_j; beta_ij]``), for every family, is
``query_space_delta_m``, ``query_space_objective``, ``query_space_hessian`` and
``query_space_lam_max``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mpmath as mp
import numpy as np

from .spec import HeadSpec, HeadWeights, check_inputs, resolve_mask, _positions

DEFAULT_DPS = 60


# ---------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------
def to_mp(a: Any) -> np.ndarray:
    """Exact conversion of a float array (numpy or torch, any float dtype) to an mpf array."""
    if a is None:
        return None
    if hasattr(a, "detach"):
        a = a.detach().cpu()
        if str(a.dtype) in ("torch.bfloat16", "torch.float16"):
            a = a.float()
        a = a.numpy()
    arr = np.asarray(a)
    if arr.dtype == object:
        return np.vectorize(mp.mpf, otypes=[object])(arr) if arr.size else arr
    arr = arr.astype(np.float64)  # exact for float16/32/64
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for n, x in enumerate(arr.reshape(-1)):
        flat[n] = mp.mpf(float(x))
    return out


def to_float(a: Any) -> np.ndarray:
    """mpf array -> float64 array (rounded once)."""
    arr = np.asarray(a, dtype=object)
    return np.vectorize(float, otypes=[np.float64])(arr) if arr.size else arr.astype(np.float64)


def _zeros(*shape: int) -> np.ndarray:
    out = np.empty(shape, dtype=object)
    out.reshape(-1)[:] = [mp.mpf(0)] * out.size
    return out


def _dot(a: Sequence, b: Sequence):
    """``sum_k a_k b_k``: exact products, summed exactly and rounded once (``mp.fdot``; about
    twice as fast as an ``fsum`` of products, which rounds every product first)."""
    return mp.fdot(a, b)


def _seqsum(terms) -> mp.mpf:
    """Left-to-right sum rounded after every addition (the working precision's), as a float
    implementation adds -- unlike ``mp.fsum``, which rounds a sum once."""
    tot = mp.mpf(0)
    for t in terms:
        tot = tot + t
    return tot


def _seqdot(a: Sequence, b: Sequence):
    return _seqsum(x * y for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# phi_1
# ---------------------------------------------------------------------------------------------
def phi1(s: Any) -> mp.mpf:
    """``rho(s) = (e^s - 1)/s`` (``rho(0) = 1``) at the working precision."""
    s = mp.mpf(s)
    if s == 0:
        return mp.mpf(1)
    return mp.expm1(s) / s


def exp_dd(a: Any, b: Any) -> mp.mpf:
    """``exp[a, b] = (e^a - e^b)/(a - b)``, ``= e^a`` when ``a == b``; via ``e^b rho(a - b)``."""
    a, b = mp.mpf(a), mp.mpf(b)
    return mp.exp(b) * phi1(a - b)


def score_transform(s: Any, softcap: float | None) -> mp.mpf:
    return s if softcap is None else mp.mpf(softcap) * mp.tanh(s / mp.mpf(softcap))


def transform_dd(a: Any, b: Any, softcap: float | None) -> mp.mpf:
    """``(phi(a) - phi(b))/(a - b)`` by the plain difference quotient at raised precision.

    ``tanh`` saturates: two scores far out on the same side differ in ``tanh`` by only
    ``~e^{-2 min(|a|,|b|)/c}``, so the quotient runs with that many extra digits on top of a
    doubled working precision (no cancellation survives).
    """
    if softcap is None:
        return mp.mpf(1)
    c = mp.mpf(softcap)
    if a == b:
        return mp.sech(a / c) ** 2
    extra = int(2 * max(abs(mp.mpf(a)), abs(mp.mpf(b))) / c / mp.log(10))
    with mp.workdps(2 * mp.mp.dps + 20 + extra):
        val = (score_transform(mp.mpf(a), softcap) - score_transform(mp.mpf(b), softcap)) / (
            mp.mpf(a) - mp.mpf(b))
    return +val


def exp_phi_dd(a: Any, b: Any, softcap: float | None) -> mp.mpf:
    """``(e^{phi(a)} - e^{phi(b)})/(a - b)``: the weight function of a transformed head."""
    za, zb = score_transform(a, softcap), score_transform(b, softcap)
    return mp.exp(zb) * phi1(za - zb) * transform_dd(a, b, softcap)


# ---------------------------------------------------------------------------------------------
# RoPE, explicitly
# ---------------------------------------------------------------------------------------------
def _pairs(d: int, layout: str) -> list[tuple[int, int]]:
    if layout == "half":
        return [(l, l + d // 2) for l in range(d // 2)]
    return [(2 * l, 2 * l + 1) for l in range(d // 2)]


def frequencies(base: Any, d: int) -> list:
    """``omega_l = base^(-2l/d)``, or, for a tuple of ``d/2`` values, those frequencies."""
    if isinstance(base, (tuple, list)):
        return [mp.mpf(float(w)) for w in base]
    return [mp.power(mp.mpf(base), -mp.mpf(2 * l) / d) for l in range(d // 2)]


def rotation(p: Any, base: Any, d: int, layout: str, cos_row: Any = None,
             sin_row: Any = None) -> mp.matrix:
    """``R(p)`` (d x d, column convention), from exact angles or from one table row."""
    R = mp.zeros(d, d)
    om = frequencies(base, d)
    for l, (i, j) in enumerate(_pairs(d, layout)):
        if cos_row is not None:
            c, s = mp.mpf(cos_row[l]), mp.mpf(sin_row[l])
        else:
            c, s = mp.cos(p * om[l]), mp.sin(p * om[l])
        R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R


def pair_rotation(p: Any, base: Any, d: int, layout: str, cos_row: Any = None,
                  sin_row: Any = None) -> list[tuple[int, int, mp.mpf, mp.mpf]]:
    """``R(p)`` kept per pair, ``[(i, j, cos, sin), ...]``: the angles of :func:`rotation`
    without its ``d x d`` matrix (``O(d)`` to build and to apply, where the dense matrix costs
    ``d^2`` mpf entries -- 65,536 at head_dim 256)."""
    om = frequencies(base, d)
    out = []
    for l, (i, j) in enumerate(_pairs(d, layout)):
        if cos_row is not None:
            c, s = mp.mpf(cos_row[l]), mp.mpf(sin_row[l])
        else:
            c, s = mp.cos(p * om[l]), mp.sin(p * om[l])
        out.append((i, j, c, s))
    return out


def rotate(rot: list, vec: Sequence) -> list:
    """``R v`` for a :func:`pair_rotation` ``R`` (column convention, as ``rotation(...) * v``):
    ``v'_i = c v_i - s v_j``, ``v'_j = s v_i + c v_j`` on every pair ``(i, j)``."""
    out = list(vec)
    for i, j, c, s in rot:
        out[i] = c * vec[i] - s * vec[j]
        out[j] = s * vec[i] + c * vec[j]
    return out


def generator(base: Any, d: int, layout: str) -> mp.matrix:
    """``A = diag_l omega_l J_2`` on the layout's pairs (``R(p) = expm(p A)``)."""
    A = mp.zeros(d, d)
    for l, (i, j) in enumerate(_pairs(d, layout)):
        w = frequencies(base, d)[l]
        A[i, j], A[j, i] = -w, w
    return A


def phi1_matrix(X: mp.matrix, terms: int | None = None) -> mp.matrix:
    """``phi_1(X) = sum_k X^k/(k+1)!`` by its power series (converges for every X).

    The terms grow to about ``e^{||X||}`` before they decay, so the sum runs with
    ``||X||/ln 10`` extra digits and is rounded back to the working precision.
    """
    n = X.rows
    nrm = mp.mnorm(X, 1)
    with mp.workdps(mp.mp.dps + int(nrm / mp.log(10)) + 10):
        out, term = mp.eye(n), mp.eye(n)
        k = 1
        while True:
            term = term * X / (k + 1)
            out += term
            k += 1
            if (terms is not None and k > terms) or (terms is None and k > 4 and
                                                     mp.mnorm(term, 1) < mp.eps * 1e-5):
                break
    return out * 1  # round to the caller's precision


def rope_finite_difference_residual(base: Any, d: int, layout: str, p: Any, delta: Any) -> mp.mpf:
    """``max |R(p+delta) - R(p) - delta A phi_1(delta A) R(p)|`` with exact rotations."""
    A = generator(base, d, layout)
    lhs = rotation(p + delta, base, d, layout) - rotation(p, base, d, layout)
    rhs = delta * A * phi1_matrix(delta * A) * rotation(p, base, d, layout)
    return max(abs(x) for x in (lhs - rhs))


# ---------------------------------------------------------------------------------------------
# one layer, explicitly
# ---------------------------------------------------------------------------------------------
@dataclass
class ExactHead:
    """All per-(head, query) objects; arrays of mpf with ``object`` dtype."""

    spec: HeadSpec
    mask: np.ndarray  # (Q, N) bool
    u: np.ndarray  # (H, Q, D) input vectors: u_i (affine) or [q_i; 1] (query space)
    feats: np.ndarray  # (H, Q, N, D) a_ij
    q: np.ndarray  # (H, Q, d) effective queries
    k: np.ndarray  # (H, N, d) rotated keys
    v: np.ndarray  # (H, N, r)
    beta: np.ndarray  # (H, Q, N)
    s: np.ndarray  # (H, Q, N) raw scores (bias included), computed from q . k + beta
    y: np.ndarray  # (H, Q, r) softmax output
    mu: np.ndarray  # (H, Q, r)
    Z: np.ndarray  # (H, Q) sum_j e^{phi(s_ij)}
    prec: int  # working precision in bits
    extras: dict = field(default_factory=dict)

    @property
    def dps(self) -> int:
        return mp.libmp.prec_to_dps(self.prec)


GUARD_DPS = 20


def build(spec: HeadSpec, weights: HeadWeights, x_q: Any, pos_q: Any, x_kv: Any, pos_kv: Any,
          mask: Any = "causal", bias: Any = None, dps: int = DEFAULT_DPS) -> ExactHead:
    """Evaluate projections, rotations, features, scores, softmax output and means exactly.

    The result is accurate to ``dps`` digits relative to the outputs' scale: the work runs with
    ``GUARD_DPS`` guard digits, plus ``-z_max/ln 10`` more when every score of some query is very
    negative -- then the original gauge's ``1/Z`` multiplies rounding errors by ``e^{-z_max}``
    (docs/math.md section 2), and the oracle pays for it in digits instead of losing them.
    """
    d2p = mp.libmp.dps_to_prec
    E = _build(spec, weights, x_q, pos_q, x_kv, pos_kv, mask, bias, d2p(dps + GUARD_DPS))
    with mp.workprec(E.prec):
        worst = min(score_transform(E.s[h, i, j], spec.softcap)
                    for h in range(E.s.shape[0]) for i in range(E.s.shape[1])
                    for j in np.flatnonzero(E.mask[i]))
    extra = int(mp.ceil(-worst / mp.log(10))) if worst < 0 else 0
    if extra > 2:
        E = _build(spec, weights, x_q, pos_q, x_kv, pos_kv, mask, bias,
                   d2p(dps + GUARD_DPS + extra))
    E.extras["target_dps"] = dps
    return E


def build_rounded(spec: HeadSpec, weights: HeadWeights, x_q: Any, pos_q: Any, x_kv: Any,
                  pos_kv: Any, mask: Any = "causal", bias: Any = None, prec: int = 24) -> ExactHead:
    """The same direct computation carried out with ``prec``-bit rounding (24: float32-like,
    53: float64-like; no exponent limit, no guard digits).

    This is the *naive same-precision computation* the tolerances of the fast layer are
    measured against: the paper's explicit formula, rounded at every operation like a float
    implementation would be.
    """
    return _build(spec, weights, x_q, pos_q, x_kv, pos_kv, mask, bias, int(prec), rounded=True)


def _build(spec: HeadSpec, weights: HeadWeights, x_q: Any, pos_q: Any, x_kv: Any, pos_kv: Any,
           mask: Any, bias: Any, prec: int, rounded: bool = False) -> ExactHead:
    # the oracle sums exactly and rounds once (mp.fsum); the rounded reference adds term by
    # term, rounding after every addition, as float32/float64 code does
    fsum = _seqsum if rounded else mp.fsum
    _dot_ = _seqdot if rounded else _dot
    Qn, Nn = int(np.shape(x_q)[0]), int(np.shape(x_kv)[0])
    mask = resolve_mask(mask, pos_q, pos_kv, Qn, Nn, spec.window, spec.chunk)
    Q, N, m = check_inputs(spec, weights, x_q, pos_q, x_kv, pos_kv, mask, bias)
    mask = np.asarray(mask.detach().cpu().numpy() if hasattr(mask, "detach") else mask, bool)
    sinks = spec.sinks
    Nx = N  # keys from x_kv; with sinks one more, the last: a zero key and value whose score is
    if sinks is not None:  # the head's logit (an additive bias), permitted to every query
        N = Nx + 1
        mask = np.concatenate([mask, np.ones((Q, 1), bool)], 1)
    H, Hk, d, r = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.r
    pq, pk = _positions(pos_q, "pos_q"), _positions(pos_kv, "pos_kv")
    with mp.workprec(prec):
        X, Xk = to_mp(x_q), to_mp(x_kv)
        U = np.concatenate([X, np.full((Q, 1), mp.mpf(1), dtype=object)], 1)
        Uk = np.concatenate([Xk, np.full((Nx, 1), mp.mpf(1), dtype=object)], 1)

        def aug(w, b, heads, dim):
            W = to_mp(w)
            B = _zeros(heads, dim) if b is None else to_mp(b)
            return np.concatenate([W, B[None]], 0)  # (m+1, heads, dim)

        latent = spec.family == "latent"
        Wq = aug(weights.w_q, weights.b_q, H, d)
        if latent:  # the absorbed form (docs/math.md section 14): shared keys, per-head values
            lat = _latent_inputs(spec, weights, X, Xk, fsum, _dot_)
        else:
            Wk, Wv = aug(weights.w_k, weights.b_k, Hk, d), aug(weights.w_v, weights.b_v, Hk, r)
        bases = spec.rope.bases(H)
        if spec.rope.freqs is not None:  # the spec's own pair frequencies replace the base
            bases = [tuple(spec.rope.freqs)] * H
        tab = spec.rope.cos is not None
        cos_t = None if not tab else np.asarray(_np(spec.rope.cos), dtype=np.float64)
        sin_t = None if not tab else np.asarray(_np(spec.rope.sin), dtype=np.float64)
        qn = None if weights.q_norm is None else to_mp(weights.q_norm)
        kn = None if weights.k_norm is None else to_mp(weights.k_norm)
        qnb = None if weights.q_norm_bias is None else to_mp(weights.q_norm_bias)
        knb = None if weights.k_norm_bias is None else to_mp(weights.k_norm_bias)
        slopes = spec.alibi_slopes
        extra = None if bias is None else to_mp(bias)
        if extra is not None and extra.ndim == 2:
            extra = np.stack([extra] * H)

        def clip(vec):  # DBRX's clip_qkv: every projected entry into [-c, c]
            if spec.clip is None:
                return vec
            c_ = mp.mpf(spec.clip)
            return [max(-c_, min(c_, x)) for x in vec]

        def rot(p, h):  # R(p) per pair (pair_rotation): O(d), not a dense d x d matrix
            if tab:
                return pair_rotation(p, bases[h], d, spec.rope.layout, cos_t[p], sin_t[p])
            return pair_rotation(p, bases[h], d, spec.rope.layout)

        def rms(vec, w, beta=None):
            if spec.norm_kind == "layer":  # LayerNorm: centred, then scaled, then shifted
                mean = fsum(vec) / len(vec)
                vec = [x - mean for x in vec]
            ms = fsum(x * x for x in vec) / len(vec)
            inv = 1 / mp.sqrt(ms + mp.mpf(spec.norm_eps))
            out = [x * inv * wi for x, wi in zip(vec, w)]
            return out if beta is None else [o + b_ for o, b_ in zip(out, beta)]

        def unit(vec):
            n = mp.sqrt(fsum(x * x for x in vec))
            if n == 0:
                raise ValueError("cosine family: a vector has zero norm and cannot be normalised")
            return [x / n for x in vec]

        all_scope = spec.family == "qknorm" and spec.norm_scope == "all"

        def token_inv(Urow, W, heads):
            """1/sqrt(mean over every head's raw projection of one token + eps) ("all")."""
            raw = [_dot_(Urow, W[:, g_, c]) for g_ in range(heads) for c in range(d)]
            return 1 / mp.sqrt(fsum(x * x for x in raw) / len(raw) + mp.mpf(spec.norm_eps))

        inv_q = [token_inv(U[i], Wq, H) for i in range(Q)] if all_scope else None
        inv_k = [token_inv(Uk[j], Wk, Hk) for j in range(Nx)] if all_scope else None

        def normed(vec, w, inv=None, beta=None):
            if all_scope:
                return [x * inv * wi for x, wi in zip(vec, w)]
            if spec.family == "qknorm":
                return rms(vec, w, beta)
            if spec.family == "cosine":
                return unit(vec)
            return list(vec)

        affine = spec.affine
        D = m + 1 if affine else d + 1
        Lmaps: dict = {}
        u_all = np.empty((H, Q, D), dtype=object)
        feats = np.empty((H, Q, N, D), dtype=object)
        q_all = np.empty((H, Q, d), dtype=object)
        k_all = np.empty((H, N, d), dtype=object)
        v_all = np.empty((H, N, r), dtype=object)
        beta = _zeros(H, Q, N)
        s = _zeros(H, Q, N)
        y = _zeros(H, Q, r)
        mu = _zeros(H, Q, r)
        Z = _zeros(H, Q)
        qtemp = spec.query_temperature

        def tau(p):  # Llama 4's NoPE query temperature (spec.query_temperature), or 1
            if qtemp is None:
                return mp.mpf(1)
            f, a = mp.mpf(float(qtemp[0])), mp.mpf(float(qtemp[1]))
            return 1 + a * mp.log(1 + mp.floor((p + 1) / f))

        for h in range(H):
            g = spec.kv_head(h)
            sc_h = score_scale(spec, h)
            # keys and values of this head's KV group, rotated with this head's base
            Rk = {}
            for j in range(N):
                if j == Nx:  # the sink key (sinks only): zero key, zero value
                    k_all[h, j] = [mp.mpf(0)] * d
                    v_all[h, j] = [mp.mpf(0)] * r
                    continue
                if latent:
                    kraw = lat["k"][j]
                else:
                    kraw = clip([_dot_(Uk[j], Wk[:, g, c]) for c in range(d)])
                Rk.setdefault(pk[j], rot(int(pk[j]), h))
                if spec.norm_after_rope:  # the norm acts on the rotated key (Hunyuan)
                    k_all[h, j] = normed(rotate(Rk[pk[j]], kraw), kn)
                else:
                    kvec = normed(kraw, kn[g] if all_scope else kn,
                                  inv_k[j] if all_scope else None, knb)
                    k_all[h, j] = rotate(Rk[pk[j]], kvec)  # column form: k~^T = R(p) k^T
                v_all[h, j] = (lat["v"](h, j) if latent else
                               clip([_dot_(Uk[j], Wv[:, g, c]) for c in range(r)]))
            for i in range(Q):
                Rq = rot(int(pq[i]), h)
                sc = sc_h * tau(int(pq[i]))  # the query temperature, where the spec has one
                qin = lat["zq"][i] if latent else U[i]  # [z_i; 1] (latent) or u_i
                qraw = clip([_dot_(qin, Wq[:, h, c]) for c in range(d)])
                if spec.norm_after_rope:
                    qt = normed(rotate(Rq, qraw), qn)
                else:
                    qt = rotate(Rq, normed(qraw, qn[h] if all_scope else qn,
                                           inv_q[i] if all_scope else None, qnb))
                q_all[h, i] = [qt[c] * sc for c in range(d)]
                if affine:
                    # L_i = W^_q,h R(p_i)^T * scale   ((m+1) x d): row a is (R W^_a^T)^T
                    L = mp.matrix([[x * sc for x in rotate(Rq, [Wq[a, h, c] for c in range(d)])]
                                   for a in range(Wq.shape[0])])
                    Lmaps[h, i] = L
                    u_all[h, i] = list(U[i])
                else:
                    u_all[h, i] = list(q_all[h, i]) + [mp.mpf(1)]
                for j in range(N):
                    bij = mp.mpf(0)
                    if j == Nx:  # the sink: its logit, and nothing position-dependent
                        bij = mp.mpf(float(sinks[h]))
                    elif slopes is not None:
                        bij += -mp.mpf(slopes[h]) * (int(pq[i]) - int(pk[j]))
                    if extra is not None and j < Nx:
                        bij += extra[h, i, j]
                    beta[h, i, j] = bij
                    s[h, i, j] = _dot_(q_all[h, i], k_all[h, j]) + bij
                    if affine:
                        a = L * mp.matrix(list(k_all[h, j]))
                        feats[h, i, j] = [a[c] for c in range(m + 1)]
                        feats[h, i, j][-1] += bij
                    else:
                        feats[h, i, j] = list(k_all[h, j]) + [bij]
                perm = np.flatnonzero(mask[i])
                z = {j: score_transform(s[h, i, j], spec.softcap) for j in perm}
                Zi = fsum(mp.exp(z[j]) for j in perm)
                Z[h, i] = Zi
                for c in range(r):
                    y[h, i, c] = fsum(mp.exp(z[j]) * v_all[h, j, c] for j in perm) / Zi
                    mu[h, i, c] = fsum(v_all[h, j, c] for j in perm) / len(perm)
        return ExactHead(spec, mask, u_all, feats, q_all, k_all, v_all, beta, s, y, mu, Z, prec,
                         extras={"L": Lmaps, "rounded": rounded})


def _latent_inputs(spec: HeadSpec, weights: HeadWeights, X: np.ndarray, Xk: np.ndarray,
                   fsum: Any, dot: Any) -> dict:
    """The absorbed form's per-token pieces (docs/math.md section 14), at the working precision:
    ``k[j]`` the shared key ``[x W_kr + b_kr; g_kv RMS(x W_kc + b_kc)]`` of every key token,
    ``zq[i]`` the query input ``[z_i; 1]`` (``z = x`` or ``g_qa RMS(x W_qa + b_qa)``) of every
    query token, and ``v(h, j)`` head ``h``'s value ``c_j W_uv[h] + b_uv[h]``."""
    lt = spec.latent
    H, r = spec.n_heads, spec.r

    def lin(row, w, b, width):
        W = to_mp(w)
        B = None if b is None else to_mp(b)
        return [dot(row, W[:, c]) + (0 if B is None else B[c]) for c in range(width)]

    def rms(vec, g, eps):
        inv = 1 / mp.sqrt(fsum(x * x for x in vec) / len(vec) + mp.mpf(eps))
        return [x * inv * gi for x, gi in zip(vec, g)]

    gkv = to_mp(weights.kv_norm)
    keys, lats = [], []
    for j in range(Xk.shape[0]):
        c = rms(lin(Xk[j], weights.w_kc, weights.b_kc, lt.rank), gkv, lt.kv_eps)
        kr = [] if lt.rope_dim == 0 else lin(Xk[j], weights.w_kr, weights.b_kr, lt.rope_dim)
        keys.append(kr + c)
        lats.append(c)
    zq = []
    for i in range(X.shape[0]):
        if lt.q_rank is None:
            z = list(X[i])
        else:
            z = rms(lin(X[i], weights.w_qa, weights.b_qa, int(lt.q_rank)),
                    to_mp(weights.qa_norm), lt.q_eps)
        zq.append(z + [mp.mpf(1)])
    Wuv = to_mp(weights.w_uv)
    Buv = None if weights.b_uv is None else to_mp(weights.b_uv)

    def value(h: int, j: int) -> list:
        return [dot(lats[j], Wuv[:, h, c]) + (0 if Buv is None else Buv[h, c]) for c in range(r)]

    return {"k": keys, "zq": zq, "v": value}


def score_scale(spec: HeadSpec, h: int) -> mp.mpf:
    """The score scale of head ``h`` at the working precision: ``1/tau_h`` (cosine), else
    ``1/sqrt(d)`` or the spec's ``scale``."""
    if spec.family == "cosine":
        return mp.mpf(1) / mp.mpf(spec.temperatures()[h])
    return mp.mpf(1) / mp.sqrt(spec.head_dim) if spec.scale is None else mp.mpf(spec.scale)


def _np(a: Any) -> np.ndarray:
    return a.detach().cpu().double().numpy() if hasattr(a, "detach") else np.asarray(a)


# ---------------------------------------------------------------------------------------------
# coefficients, Delta M, readouts
# ---------------------------------------------------------------------------------------------
def max_key(E: ExactHead, h: int, i: int) -> int:
    """``j* = argmax_j s_ij`` over the permitted set (first on ties).  The transform ``phi`` is
    increasing, so this is also the argmax of ``phi(s)``, without a saturating tanh's ties."""
    perm = list(np.flatnonzero(E.mask[i]))
    best = max(E.s[h, i, j] for j in perm)
    return [j for j in perm if E.s[h, i, j] == best][0]


def coefficients(E: ExactHead, h: int, i: int, gauge: Any = "original") -> tuple[dict, list]:
    """``c^g_ij = (e^{phi(s_ij)} - e^{phi(sigma_i)}) / ((s_ij - sigma_i) Z_i)`` and the offset g.

    ``sigma_i = u_i . g``; original ``g = 0``; max-key ``g = a_{i j*}``; a vector ``g``.
    Returns ({j: c_ij}, g as a list).
    """
    with mp.workprec(E.prec):
        perm = list(np.flatnonzero(E.mask[i]))
        D = len(E.u[h, i])
        if isinstance(gauge, str) and gauge == "original":
            g = [mp.mpf(0)] * D
        elif isinstance(gauge, str) and gauge == "maxkey":
            js = max_key(E, h, i)
            g = list(E.feats[h, i, js])
        elif isinstance(gauge, str):
            raise ValueError(f"unknown gauge {gauge!r}")
        else:
            if not E.spec.affine:
                raise ValueError("free gauges need an affine head")
            gv = to_mp(gauge)
            gv = gv[h] if gv.ndim == 2 else gv
            if len(gv) != D:
                raise ValueError(f"gauge vector must have length {D}")
            g = list(gv)
        sig = _dot(E.u[h, i], g)
        c = {j: exp_phi_dd(E.s[h, i, j], sig, E.spec.softcap) / E.Z[h, i] for j in perm}
        return c, g


def delta_m(E: ExactHead, h: int, i: int, gauge: Any = "original") -> mp.matrix:
    """``Delta M^g_i = sum_j c^g_ij (a_ij - g)(v_j - mu_i)^T`` ((m+1) x r, or (d+1) x r)."""
    with mp.workprec(E.prec):
        D, r = len(E.u[h, i]), E.spec.r
        if isinstance(gauge, str) and gauge == "pairwise":
            return pairwise_delta_m(E, h, i)
        c, g = coefficients(E, h, i, gauge)
        feats = {j: [a - gp for a, gp in zip(E.feats[h, i, j], g)] for j in c}
        return _outer_sum(c, feats, E, h, i, D, r)


def _outer_sum(c: dict, feats: dict, E: ExactHead, h: int, i: int, D: int, r: int) -> mp.matrix:
    """``M[p, q] = sum_j (c_j a_jp) (v_jq - mu_iq)`` over the keys of ``c``, entry by entry: the
    ``N`` products of each entry summed exactly and rounded once (:func:`_dot`), ``O(D r N)``
    without indexing an mpmath matrix in the inner loop."""
    js = list(c)
    vc = [[E.v[h, j, q] - E.mu[h, i, q] for j in js] for q in range(r)]  # (r, N)
    rows = []
    for p in range(D):
        w = [c[j] * feats[j][p] for j in js]
        rows.append([_dot(w, vc[q]) for q in range(r)])
    return mp.matrix(rows)


def delta_m_abs(E: ExactHead, h: int, i: int, gauge: Any = "original") -> mp.mpf:
    """Scale of ``Delta M^g_i`` as a sum: ``max_{p,q} sum_j |c_j (a_jp - g_p)| (|v_jq - mu_q| +
    |v_jq|)`` (pairwise: the double sum's absolute terms, likewise).  Errors of a computed matrix
    are measured relative to this: a matrix whose terms cancel to ~0 has no relative accuracy
    to keep, and a centred value ``v - mu`` cannot be computed to better than ``ulp(|v|)``."""
    with mp.workprec(E.prec):
        D, r = len(E.u[h, i]), E.spec.r
        perm = list(np.flatnonzero(E.mask[i]))
        best = mp.mpf(0)
        if isinstance(gauge, str) and gauge == "pairwise":
            pre = 1 / (2 * len(perm) * E.Z[h, i])
            wjk = {(j, k): abs(pre * exp_phi_dd(E.s[h, i, j], E.s[h, i, k], E.spec.softcap))
                   for j in perm for k in perm if j != k}
            for p in range(D):
                for q in range(r):
                    tot = mp.fsum(wjk[j, k] * abs(E.feats[h, i, j][p] - E.feats[h, i, k][p])
                                  * (abs(E.v[h, j, q] - E.v[h, k, q]) + abs(E.v[h, j, q])
                                     + abs(E.v[h, k, q]))
                                  for j in perm for k in perm if j != k)
                    best = max(best, tot)
            return best
        c, g = coefficients(E, h, i, gauge)
        for p in range(D):
            for q in range(r):
                tot = mp.fsum(abs(cj * (E.feats[h, i, j][p] - g[p])) *
                              (abs(E.v[h, j, q] - E.mu[h, i, q]) + abs(E.v[h, j, q]))
                              for j, cj in c.items())
                best = max(best, tot)
        return best


def pairwise_delta_m(E: ExactHead, h: int, i: int) -> mp.matrix:
    """``1/(2 N Z) sum_{j,k} exp_phi[s_j, s_k] (a_j - a_k)(v_j - v_k)^T`` (double sum)."""
    with mp.workprec(E.prec):
        perm = list(np.flatnonzero(E.mask[i]))
        D, r = len(E.u[h, i]), E.spec.r
        M = mp.zeros(D, r)
        pre = 1 / (2 * len(perm) * E.Z[h, i])
        for j in perm:
            for k in perm:
                if j == k:
                    continue
                w = pre * exp_phi_dd(E.s[h, i, j], E.s[h, i, k], E.spec.softcap)
                for p in range(D):
                    da = w * (E.feats[h, i, j][p] - E.feats[h, i, k][p])
                    for q in range(r):
                        M[p, q] += da * (E.v[h, j, q] - E.v[h, k, q])
        return M


def readout(E: ExactHead, h: int, i: int, M: mp.matrix) -> list:
    """``mu_i + u_i^T M``."""
    with mp.workprec(E.prec):
        add = _seqsum if E.extras.get("rounded") else mp.fsum
        return [E.mu[h, i, q] + add(E.u[h, i][p] * M[p, q] for p in range(M.rows))
                for q in range(M.cols)]


def t_matrix(E: ExactHead, h: int, i: int, gauge: str = "original") -> mp.matrix:
    """Query-space ``T_i = sum_j c_ij (k~_j - k_o)^T (v_j - mu_i)`` (d x r) for original/max-key."""
    with mp.workprec(E.prec):
        c, _ = coefficients(E, h, i, gauge)
        d, r = E.spec.head_dim, E.spec.r
        ko = [mp.mpf(0)] * d
        if gauge == "maxkey":
            ko = list(E.k[h, max_key(E, h, i)])
        T = mp.zeros(d, r)
        for j, cj in c.items():
            for p in range(d):
                w = cj * (E.k[h, j][p] - ko[p])
                for q in range(r):
                    T[p, q] += w * (E.v[h, j, q] - E.mu[h, i, q])
        return T


def all_delta_m(E: ExactHead, gauge: Any = "original") -> np.ndarray:
    """Every ``Delta M_i`` as an object array ``(H, Q, D, r)``."""
    H, Q = E.u.shape[:2]
    D, r = E.u.shape[2], E.spec.r
    out = np.empty((H, Q, D, r), dtype=object)
    for h in range(H):
        for i in range(Q):
            M = delta_m(E, h, i, gauge)
            for p in range(D):
                for q in range(r):
                    out[h, i, p, q] = M[p, q]
    return out


# ---------------------------------------------------------------------------------------------
# condition number of the readout
# ---------------------------------------------------------------------------------------------
def kappa(E: ExactHead, h: int, i: int, gauge: Any = "original", anchor: int | None = None
          ) -> mp.mpf:
    """Condition number ``kappa_i`` of the readout sum ``y_i = mu_i + q_i T_i + b_i`` as the
    fast layer evaluates it, relative to the value scale ``S = max_{j in I_i} ||v_j||_inf``.

    Key gauges (original ``k_o = 0, beta_o = 0, sigma = 0``; max-key ``k_o = k~_{j*}``,
    ``beta_o = beta_{i j*}``, ``sigma = 0`` in this formula; a free vector ``g``:
    ``k_o = 0, beta_o = 0, sigma_i = u_i . g``), with the gauge's own coefficients
    ``c_ij = (e^{phi(s_ij)} - e^{phi(sigma)}) / ((s_ij - sigma) Z_i)`` (:func:`coefficients`)::

        kappa_i = sum_{j in I_i} |c_ij| (|q_i| . |k~_j - k_o| + |beta_ij - beta_o| + |sigma_i|)
                                 (||v_j - mu_i||_inf + ||v_j||_inf) / S

    Pairwise gauge, ``kbar_i``/``betabar_i`` the permitted-set means of the rotated keys and
    biases, ``D_jk = exp_phi[s_ij, s_ik] / Z_i`` (diagonal included), ``N_i = |I_i|`` and
    ``vab_j = ||v_j - mu_i||_inf + ||v_j||_inf``::

        lvb_j   = (sum_k D_jk vab_j + sum_k D_jk vab_k) / N_i
        kappa_i = sum_{j in I_i} (|q_i| . |k~_j - kbar_i| + |beta_ij - betabar_i|) lvb_j / S

    ``|a| . |b|`` is ``sum_c |a_c| |b_c|``; ``q_i`` is the effective query (rotated, normalised
    for qknorm/cosine, times the score scale), ``k~_j`` the rotated key of the query head's KV
    group, ``beta`` the additive bias (ALiBi and/or explicit); all are this layer's own
    mpmath quantities, not the fast layer's tensors.

    Why this is the sum's condition number: in a key gauge the readout is
    ``mu_i + sum_j c_ij (q_i . (k~_j - k_o) + beta_ij - beta_o - sigma_i) (v_j - mu_i)``,
    evaluated as ``mu + sum_c q_c T_c + b - sigma w`` with ``T_c = sum_j c_j (k~_jc - k_oc)
    (v_j - mu)``.  A relative perturbation ``eps`` of every factor of every term -- each rounded
    product, each partial sum of the contraction ``q . T`` (which meets ``|q_c| |k~_jc - k_oc|``,
    not the possibly cancelled ``|q . (k~_j - k_o)|``), the coefficients, and the centred value
    ``v_j - mu`` (whose rounding is absolute, ``eps |v_j|``) -- moves the result by at most
    ``eps * sum_j |c_j| (|q| . |k~_j - k_o| + |beta_j - beta_o| + |sigma|) (|v_j - mu| + |v_j|)``
    in the inf-norm, and perturbations whose signs follow the terms' attain it up to the choice
    of one value component per key (a factor at most ``r``).  Divided by ``S`` this is the
    componentwise (Higham, section 3.1) condition number of the evaluated sum relative to the
    value scale: the readout keeps about ``-log10(kappa u)`` digits of ``S``.  The pairwise
    gauge evaluates ``sum_j (q . (k~_j - kbar) + beta_j - betabar) lv_j`` with
    ``lv_j = (1/N) sum_k D_jk ((v_j - mu) - (v_k - mu))`` (the Laplacian form), and ``lvb_j``
    is the same absolute bound of each ``lv_j``.

    ``anchor`` (max-key gauge only) replaces ``j*`` by another permitted key: at a (near-)tie of
    the largest scores the max-key gauge is ambiguous, and a caller may evaluate every candidate.
    Returns an ``mpf`` at the head's working precision (0 when every permitted value is 0).
    """
    with mp.workprec(E.prec):
        perm = list(np.flatnonzero(E.mask[i]))
        r = E.spec.r
        q = E.q[h, i]
        S = max(abs(E.v[h, j, c]) for j in perm for c in range(r))
        if S == 0:
            return mp.mpf(0)
        vab = {j: max(abs(E.v[h, j, c] - E.mu[h, i, c]) for c in range(r))
               + max(abs(E.v[h, j, c]) for c in range(r)) for j in perm}

        def absdot(ko: Sequence, j: int) -> mp.mpf:
            return mp.fsum(abs(qc) * abs(kc - oc) for qc, kc, oc in zip(q, E.k[h, j], ko))

        if isinstance(gauge, str) and gauge == "pairwise":
            n = len(perm)
            kbar = [mp.fsum(E.k[h, j][c] for j in perm) / n for c in range(len(q))]
            bbar = mp.fsum(E.beta[h, i, j] for j in perm) / n
            Dm = {}
            for a, j in enumerate(perm):
                for k in perm[a:]:
                    Dm[j, k] = Dm[k, j] = exp_phi_dd(E.s[h, i, j], E.s[h, i, k],
                                                     E.spec.softcap) / E.Z[h, i]
            tot = mp.fsum((absdot(kbar, j) + abs(E.beta[h, i, j] - bbar))
                          * (mp.fsum(Dm[j, k] for k in perm) * vab[j]
                             + mp.fsum(Dm[j, k] * vab[k] for k in perm)) / n
                          for j in perm)
            return tot / S
        ko, bo, sig = [mp.mpf(0)] * len(q), mp.mpf(0), mp.mpf(0)
        if isinstance(gauge, str) and gauge == "maxkey":
            js = max_key(E, h, i) if anchor is None else int(anchor)
            if js not in perm:
                raise ValueError(f"anchor {js} is not in query {i}'s permitted set")
            ko, bo = list(E.k[h, js]), E.beta[h, i, js]
            if anchor is None:
                c, _ = coefficients(E, h, i, gauge)
            else:  # the max-key coefficients, anchored at the given key
                c = {j: exp_phi_dd(E.s[h, i, j], E.s[h, i, js], E.spec.softcap) / E.Z[h, i]
                     for j in perm}
        else:
            if anchor is not None:
                raise ValueError("anchor is only meaningful in the max-key gauge")
            c, g = coefficients(E, h, i, gauge)
            if not isinstance(gauge, str):  # a free gauge vector: sigma_i = u_i . g
                sig = _dot(E.u[h, i], g)
        tot = mp.fsum(abs(cj) * (absdot(ko, j) + abs(E.beta[h, i, j] - bo) + abs(sig)) * vab[j]
                      for j, cj in c.items())
        return tot / S


def all_kappa(E: ExactHead, gauge: Any = "original") -> np.ndarray:
    """:func:`kappa` for every head and query, an object array ``(H, Q)`` of mpf."""
    H, Q = E.u.shape[:2]
    out = np.empty((H, Q), dtype=object)
    for h in range(H):
        for i in range(Q):
            out[h, i] = kappa(E, h, i, gauge)
    return out


# ---------------------------------------------------------------------------------------------
# gradient step
# ---------------------------------------------------------------------------------------------
def objective(E: ExactHead, h: int, i: int, B: mp.matrix, gauge: Any = "original") -> mp.mpf:
    """``E_i(B) = 1/2 sum_j c_ij ||(a_ij - g)^T B - (v_j - mu_i)||^2``."""
    with mp.workprec(E.prec):
        c, g = coefficients(E, h, i, gauge)
        tot = mp.mpf(0)
        for j, cj in c.items():
            a = [E.feats[h, i, j][p] - g[p] for p in range(B.rows)]
            for q in range(B.cols):
                res = mp.fsum(a[p] * B[p, q] for p in range(B.rows)) - (E.v[h, j, q] - E.mu[h, i, q])
                tot += cj * res * res
        return tot / 2


def gradient(E: ExactHead, h: int, i: int, B: mp.matrix, gauge: Any = "original") -> mp.matrix:
    """``grad E_i(B) = sum_j c_ij a_j (a_j^T B - (v_j - mu))^T`` (analytic)."""
    with mp.workprec(E.prec):
        c, g = coefficients(E, h, i, gauge)
        G = mp.zeros(B.rows, B.cols)
        for j, cj in c.items():
            a = [E.feats[h, i, j][p] - g[p] for p in range(B.rows)]
            for q in range(B.cols):
                res = mp.fsum(a[p] * B[p, q] for p in range(B.rows)) - (E.v[h, j, q] - E.mu[h, i, q])
                for p in range(B.rows):
                    G[p, q] += cj * a[p] * res
        return G


def numeric_gradient(E: ExactHead, h: int, i: int, B: mp.matrix, gauge: Any = "original"
                     ) -> mp.matrix:
    """Gradient of :func:`objective` by central differences with step 1.

    ``E`` is quadratic in ``B``, so ``(E(B + e) - E(B - e))/2`` is its exact partial derivative:
    an independent check of :func:`gradient` with no truncation error, only rounding.
    """
    with mp.workprec(E.prec):
        G = mp.zeros(B.rows, B.cols)
        for p in range(B.rows):
            for q in range(B.cols):
                Bp, Bm = B.copy(), B.copy()
                Bp[p, q] += 1
                Bm[p, q] -= 1
                G[p, q] = (objective(E, h, i, Bp, gauge) - objective(E, h, i, Bm, gauge)) / 2
        return G


def hessian(E: ExactHead, h: int, i: int, gauge: Any = "original") -> mp.matrix:
    """``H_i = sum_j c_ij a_ij a_ij^T``."""
    with mp.workprec(E.prec):
        c, g = coefficients(E, h, i, gauge)
        D = len(E.u[h, i])
        Hm = mp.zeros(D, D)
        for j, cj in c.items():
            a = [E.feats[h, i, j][p] - g[p] for p in range(D)]
            for p in range(D):
                for q in range(D):
                    Hm[p, q] += cj * a[p] * a[q]
        return Hm


def lam_max(E: ExactHead, h: int, i: int, gauge: Any = "original") -> mp.mpf:
    with mp.workprec(E.prec):
        ev = mp.eigsy(hessian(E, h, i, gauge), eigvals_only=True)
        return max(ev)


# ---------------------------------------------------------------------------------------------
# the gradient step in query space (docs/math.md sections 3 and 11)
# ---------------------------------------------------------------------------------------------
def query_space_features(E: ExactHead, h: int, i: int, gauge: str = "original"
                         ) -> tuple[dict, dict]:
    """Coefficients and query-space features of one query: ``({j: c_ij}, {j: a^_j})`` with
    ``a^_j = [scale (k~_j - k_o); beta_ij - beta_o]`` (``d + 1`` mpf; original or max-key gauge).

    The input is ``z_i = [q~_i; 1]`` (:func:`query_space_input`), so ``s_ij = z_i . a^_j``; for a
    cosine head ``k~_j`` is the rotated unit key and ``scale = 1/tau_h``.  Built from this
    layer's own keys, biases and coefficients, not from the fast layer's.
    """
    if gauge not in ("original", "maxkey"):
        raise ValueError(f"query-space features are defined in the original and max-key gauges, "
                         f"not {gauge!r}")
    with mp.workprec(E.prec):
        c, _ = coefficients(E, h, i, gauge)
        sc = score_scale(E.spec, h)
        d = E.spec.head_dim
        ko, bo = [mp.mpf(0)] * d, mp.mpf(0)
        if gauge == "maxkey":
            js = max_key(E, h, i)
            ko, bo = list(E.k[h, js]), E.beta[h, i, js]
        feats = {j: [sc * (E.k[h, j][p] - ko[p]) for p in range(d)] + [E.beta[h, i, j] - bo]
                 for j in c}
        return c, feats


def query_space_input(E: ExactHead, h: int, i: int) -> list:
    """``z_i = [q~_i; 1]``: the rotated (normalised) query without the score scale."""
    with mp.workprec(E.prec):
        sc = score_scale(E.spec, h)
        return [qc / sc for qc in E.q[h, i]] + [mp.mpf(1)]


def query_space_delta_m(E: ExactHead, h: int, i: int, gauge: str = "original") -> mp.matrix:
    """``Delta M^q_i = sum_j c_ij a^_j (v_j - mu_i)^T`` ((d+1) x r), summed key by key."""
    with mp.workprec(E.prec):
        c, a = query_space_features(E, h, i, gauge)
        return _outer_sum(c, a, E, h, i, E.spec.head_dim + 1, E.spec.r)


def query_space_objective(E: ExactHead, h: int, i: int, B: mp.matrix, gauge: str = "original"
                          ) -> mp.mpf:
    """``E^q_i(B) = 1/2 sum_j c_ij ||a^_j^T B - (v_j - mu_i)||^2`` for ``B`` of size (d+1) x r."""
    with mp.workprec(E.prec):
        c, a = query_space_features(E, h, i, gauge)
        tot = mp.mpf(0)
        for j, cj in c.items():
            for q in range(B.cols):
                res = (mp.fsum(a[j][p] * B[p, q] for p in range(B.rows))
                       - (E.v[h, j, q] - E.mu[h, i, q]))
                tot += cj * res * res
        return tot / 2


def query_space_hessian(E: ExactHead, h: int, i: int, gauge: str = "original") -> mp.matrix:
    """``H^q_i = sum_j c_ij a^_j a^_j^T`` ((d+1) x (d+1)); ``scale^2 G_i`` bordered by the bias
    coordinate (docs/math.md section 3)."""
    with mp.workprec(E.prec):
        c, a = query_space_features(E, h, i, gauge)
        D = E.spec.head_dim + 1
        Hm = mp.zeros(D, D)
        for j, cj in c.items():
            for p in range(D):
                for q in range(D):
                    Hm[p, q] += cj * a[j][p] * a[j][q]
        return Hm


def query_space_lam_max(E: ExactHead, h: int, i: int, gauge: str = "original") -> mp.mpf:
    with mp.workprec(E.prec):
        return max(mp.eigsy(query_space_hessian(E, h, i, gauge), eigvals_only=True))


# ---------------------------------------------------------------------------------------------
# frozen reuse, prefix/full
# ---------------------------------------------------------------------------------------------
def tokenwise_reuse_error(E: ExactHead, h: int, i: int, anchor: int) -> list:
    """``e_i = sum_j (c_ij - c_aj)(u_i . a_j)(v_j - mu)`` (shared features and bank)."""
    with mp.workprec(E.prec):
        if not (E.mask[i] == E.mask[anchor]).all():
            raise ValueError("tokenwise reuse error needs the anchor's permitted set")
        ci, _ = coefficients(E, h, i)
        ca, _ = coefficients(E, h, anchor)
        r = E.spec.r
        out = [mp.mpf(0)] * r
        for j in ci:
            w = (ci[j] - ca[j]) * _dot(E.u[h, i], E.feats[h, i, j])
            for q in range(r):
                out[q] += w * (E.v[h, j, q] - E.mu[h, i, q])
        return out


def prefix_full(E_prefix: ExactHead, h: int, i: int, s_self: Any, v_self: Sequence) -> list:
    """``y_full = (1 - pi) y_prefix + pi v_self``, ``pi = e^{z_self}/(Z + e^{z_self})``."""
    with mp.workprec(E_prefix.prec):
        es = mp.exp(score_transform(mp.mpf(s_self), E_prefix.spec.softcap))
        pi = es / (E_prefix.Z[h, i] + es)
        return [(1 - pi) * E_prefix.y[h, i, q] + pi * mp.mpf(v_self[q])
                for q in range(E_prefix.spec.r)]


# ---------------------------------------------------------------------------------------------
# no global affine readout
# ---------------------------------------------------------------------------------------------
@dataclass
class Witness:
    u: list  # the query input [x; 1] where the readout fails
    error: mp.mpf  # ||y(u) - mu - u^T M||_2, evaluated exactly
    certified: mp.mpf  # a lower bound on error from the hull argument (0 when not used)
    how: str


def readout_witness(spec: HeadSpec, weights: HeadWeights, x_kv: Any, pos_kv: Any, pos_query: int,
                    M: Any, head: int = 0, dps: int = DEFAULT_DPS) -> Witness:
    """Given a head with a finite bank and any ``M`` ((m+1) x r), return a query ``u`` where
    ``y(u) != mu + u^T M`` and the error there (docs/math.md section 7).

    If ``M``'s x-part is non-zero, move ``x`` along its top left singular direction
    until ``||u^T M|| > ||M_last|| + max_j ||v_j - mu|| + 1``: since ``y(u)`` stays in the hull
    of the values, the error is then certified >= 1.  Otherwise the readout is constant and any
    two queries with different outputs refute it.
    """
    if not spec.affine:
        raise ValueError("the no-global-affine-readout witness is stated for affine heads")
    Mx = to_mp(M)
    m = int(np.shape(x_kv)[1])
    if Mx.shape != (m + 1, spec.r):
        raise ValueError(f"M must have shape ({m + 1}, {spec.r}), got {Mx.shape}")
    N = int(np.shape(x_kv)[0])
    with mp.workdps(dps):
        M_mp = mp.matrix(Mx.tolist())

        def evaluate(x):
            E = build(spec, weights, np.asarray([x], dtype=np.float64), [pos_query], x_kv, pos_kv,
                      np.ones((1, N), bool), dps=dps)
            u = list(E.u[head, 0])
            ro = readout(E, head, 0, M_mp)
            err = mp.sqrt(mp.fsum((E.y[head, 0, q] - ro[q]) ** 2 for q in range(spec.r)))
            return E, u, err

        E0, u0, err0 = evaluate(np.zeros(m))
        radius = max(mp.sqrt(mp.fsum((E0.v[head, j, q] - E0.mu[head, 0, q]) ** 2
                                     for q in range(spec.r))) for j in range(N))
        Mpart = np.array([[float(M_mp[p, q]) for q in range(spec.r)] for p in range(m)])
        last = mp.sqrt(mp.fsum(M_mp[m, q] ** 2 for q in range(spec.r)))
        if np.abs(Mpart).max() > 0:
            Uu, S, _ = np.linalg.svd(Mpart)
            direction, sigma = Uu[:, 0], S[0]
            t = float((last + radius + 1) / mp.mpf(sigma)) * 1.01 + 1e-12
            x = direction * t
            E, u, err = evaluate(x)
            grow = mp.sqrt(mp.fsum(mp.fsum(u[p] * M_mp[p, q] for p in range(m)) ** 2
                                   for q in range(spec.r)))
            cert = grow - last - radius
            return Witness(u, err, cert, "x-part non-zero: the readout leaves the convex hull")
        # constant readout: find a query with a different output
        rng = np.random.default_rng(0)
        best = (err0, u0)
        for _ in range(16):
            x = rng.standard_normal(m) * 4
            _, u, err = evaluate(x)
            if err > best[0]:
                best = (err, u)
        return Witness(best[1], best[0], mp.mpf(0),
                       "x-part zero: the readout is constant; this query's output differs")
