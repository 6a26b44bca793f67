"""One layer of one context, every head and query, against the model's own output: the
evaluation behind ``ropestep atlas`` and the library's :meth:`ropestep.api.LayerRun.check`.

:func:`evaluate_layer` takes the captured head input ``x (N, m)`` (after the block's input norm),
the positions and the model's own per-head outputs ``native (N, H, r)`` and returns the per-query
arrays (:class:`LayerResult`); :func:`summarise_layer` pools them over contexts into per-head
statistics and checks, :func:`pool` into the atlas report's sections and verdict.  What each
statistic is, and the gradient-step diagnostics in both parametrisations, is the atlas's module
docstring (:mod:`ropestep.atlas`) and docs/math.md section 3.

Layering: below the public API (:mod:`ropestep.api`, which computes through it) and so below
the commands that compute through the API (atlas, validate, heads); above the fast paths
(import-linter contract in pyproject.toml).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from . import fast, scale, tolerances
from .kernel import augment, transform
from .rope import apply_rope
from .spec import HeadSpec, HeadWeights, RoPESpec


class AtlasError(ValueError):
    """Bad input to the atlas (layer out of range, context too long, ...): one line, exit 2."""


# ---------------------------------------------------------------------------------------------
# one layer of one context
# ---------------------------------------------------------------------------------------------
PER_QUERY = ("id_abs", "native_abs", "native_bound", "native_orig_abs", "native_orig_bound",
             "lp_abs", "lp_id_abs", "id_bound", "lp_bound", "score_abs", "kappa_original", "kappa_maxkey", "spread", "sink", "lam_query",
             "lam_input", "inc_query", "inc_input", "reuse_frozen", "reuse_const", "reuse_mean",
             "tv")


@dataclass
class LayerResult:
    """Per-head, per-query statistics of one layer in one context (float64 numpy, ``(H, N)``).

    ``*_abs`` are max-over-value-dims absolute errors; ``native_*`` the float64 readout in the
    max-key gauge against the model's output, ``native_orig_*`` the float64 readout in the
    original (paper's) gauge against it, each with its absolute kappa-aware bound;
    ``id_bound`` the float64 readout bound of each query (relative to the head's value scale);
    ``lp_bound`` the absolute bound on
    ``lp_abs`` (:func:`ropestep.tolerances.model_dtype_native_bound`, with the query's max-key
    kappa); ``score_abs`` the query's largest ``|s_ij|``; ``reuse_*`` squared errors of the frozen,
    constant-anchor and cache-mean predictors (NaN at the anchors themselves; the cache-mean
    error is ``|y_i - mu_i|^2``, the deviation the relative reuse error is measured against);
    ``tv`` the total-variation distance to the anchor's row.
    """

    layer: int
    arrays: dict[str, np.ndarray]
    value_scale: np.ndarray  # (H,) max |v_j| over the context
    native_scale: np.ndarray  # (H,) max |native| over the context
    qk_max: np.ndarray  # (H,) max_ij |q~_i| |k~_j| * scale (bounds |s|)
    errors: list[str] = field(default_factory=list)  # overflow or other failures, named


def evaluate_layer(spec: HeadSpec, weights: HeadWeights, x: torch.Tensor, positions: torch.Tensor,
                   native: torch.Tensor, *, layer: int = 0, lp_dtype: torch.dtype = torch.float32,
                   anchor_every: int = 64, max_bytes: int = scale.DEFAULT_MAX_BYTES,
                   device: Any = None, timers: dict | None = None) -> LayerResult:
    """All statistics of one captured layer: ``x (N, m)`` inputs, ``native (N, H, r)`` outputs."""
    H, d, r = spec.n_heads, spec.head_dim, spec.r
    N = int(x.shape[0])
    tm = timers if timers is not None else {}
    t0 = time.perf_counter()
    L64 = scale.project_layer(spec, weights, x, positions, dtype=torch.float64, device=device)
    tm["project"] = tm.get("project", 0.0) + time.perf_counter() - t0
    dev = L64.q.device
    nat = torch.as_tensor(native).to(device=dev, dtype=torch.float64)  # (N, H, r)
    arr = {k: torch.full((H, N), math.nan, dtype=torch.float64, device=dev) for k in PER_QUERY}
    errors: list[str] = []
    sc = torch.tensor([spec.score_scale(h) for h in range(H)], dtype=torch.float64, device=dev)
    vscale = torch.stack([L64.v[L64.kv_of_group[L64.group_of(h)]].abs().max() for h in range(H)])
    qn = L64.q.norm(dim=-1).amax(-1)  # (H,) max |q_eff| (scale included)
    kn = torch.stack([L64.k[L64.group_of(h)].norm(dim=-1).max() for h in range(H)])
    qk_max = qn * kn
    # input-space metric A_h = W^_q^T W^_q scale^2 (L_i^T L_i = R_i A_h R_i^T), its square root;
    # a head whose score is not affine in u (QK-norm) has no input-space step: query space only
    Ah = q_unrot = post_gain = None
    if spec.affine:
        A = L64.lwt @ L64.lw  # (H, d, d)
        ev, U = torch.linalg.eigh(A)
        Ah = U @ torch.diag_embed(ev.clamp_min(0).sqrt()) @ U.transpose(-1, -2)
    else:  # the effective queries before rotation (normalised, scaled): the same projection
        # with the identity rotation, so frozen reuse rotates each query once, to the anchor
        P = int(torch.as_tensor(positions).max()) + 1 if positions is not None else N
        ident = RoPESpec(base=spec.rope.base, layout=spec.rope.layout,
                         cos=torch.ones(P, spec.head_dim // 2, dtype=torch.float64),
                         sin=torch.zeros(P, spec.head_dim // 2, dtype=torch.float64))
        w_unrot = weights
        if spec.norm_after_rope:  # the gain acts after the rotation: rotate g-less, then gain
            w_unrot = replace(weights, q_norm=torch.ones(spec.head_dim, dtype=torch.float64))
            post_gain = torch.as_tensor(weights.q_norm).to(L64.q.device, torch.float64)
        # (no query temperature either: frozen reuse applies the anchor's, with its rotation)
        q_unrot = scale.project_layer(replace(spec, rope=ident, query_temperature=None), w_unrot,
                                      x, positions, dtype=torch.float64, device=device).q
    anchors = torch.arange(0, N, anchor_every, device=dev)
    na = int(anchors.numel())
    T_a = torch.zeros(H, na, d, r, dtype=torch.float64, device=dev)
    mu_a = torch.zeros(H, na, r, dtype=torch.float64, device=dev)
    b_a = torch.zeros(H, na, r, dtype=torch.float64, device=dev)  # the bias row (sinks)
    y_a = torch.zeros(H, na, r, dtype=torch.float64, device=dev)
    p_a = torch.zeros(H, na, N, dtype=torch.float64, device=dev)
    lay = spec.rope.layout
    u_all = augment(L64.x)  # (N, m+1)

    nscale = nat.abs().amax(dim=(0, 2))  # (H,)
    m = int(x.shape[-1])

    def bound(hs, qi, kap: torch.Tensor, arith: torch.dtype) -> torch.Tensor:
        """The kappa-aware absolute bound on |readout - native| (per query of a chunk)."""
        # causal: keys 0..i (and the sink's)
        npre = (qi + 1 + (spec.sinks is not None)).double()[None].expand_as(kap)
        return torch.as_tensor(tolerances.model_dtype_native_bound(
            lp_dtype, kap.double().cpu().numpy(), npre.cpu().numpy(), d, m,
            arr["score_abs"][hs[0]:hs[-1] + 1, qi].cpu().numpy(),
            qk_max[hs].cpu().numpy()[:, None], vscale[hs].cpu().numpy()[:, None],
            nscale[hs].cpu().numpy()[:, None], arith=arith), device=dev)

    # pass A: float64, original gauge (the paper's), with s, c and kappa
    t0 = time.perf_counter()
    work = _Work()  # buffers the chunks share
    try:
        for ch in scale.stream(spec, weights, x, positions, gauge="original", layer=L64,
                               max_bytes=max_bytes, outputs=("s", "c", "kappa")):
            _pass_original(ch, L64, arr, nat, vscale, sc, Ah, q_unrot, anchors, anchor_every,
                           T_a, mu_a, y_a, p_a, u_all, lay, work, b_a, post_gain)
            hs = ch.heads
            arr["native_orig_bound"][hs[0]:hs[-1] + 1, ch.queries] = bound(
                hs, ch.queries, ch.extra["kappa"], torch.float64)
    except FloatingPointError as err:
        errors.append(f"layer {layer}: float64 original gauge: {err}")
    tm["float64_original"] = tm.get("float64_original", 0.0) + time.perf_counter() - t0

    # pass B: the model's dtype, max-key gauge (the right gauge below float64), with the
    # max-key kappa of that evaluation (a condition number needs no more than float32 digits)
    t0 = time.perf_counter()
    try:
        for ch in scale.stream(spec, weights, x, positions, gauge="maxkey", dtype=lp_dtype,
                               device=dev, max_bytes=max_bytes, outputs=("kappa",)):
            hs = ch.heads
            ref = nat[ch.queries][:, hs].transpose(0, 1)  # (G, Qc, r)
            ro, y = ch.readout.double(), ch.y.double()
            arr["lp_abs"][hs[0]:hs[-1] + 1, ch.queries] = (ro - ref).abs().amax(-1)
            arr["lp_id_abs"][hs[0]:hs[-1] + 1, ch.queries] = (ro - y).abs().amax(-1)
            kap = ch.extra["kappa"].double()
            arr["kappa_maxkey"][hs[0]:hs[-1] + 1, ch.queries] = kap
            arr["lp_bound"][hs[0]:hs[-1] + 1, ch.queries] = bound(hs, ch.queries, kap, lp_dtype)
    except FloatingPointError as err:
        errors.append(f"layer {layer}: {lp_dtype} max-key gauge: {err}")
    tm[f"{str(lp_dtype).replace('torch.', '')}_maxkey"] = \
        tm.get(f"{str(lp_dtype).replace('torch.', '')}_maxkey", 0.0) + time.perf_counter() - t0

    # pass C: float64, max-key gauge, readout only -- the float64 reconstruction of the model's
    # output where the original gauge's kappa (up to 1e198 on Qwen2.5's sink heads) leaves
    # float64 no digits; bounded with the max-key kappa of pass B
    t0 = time.perf_counter()
    try:
        for ch in scale.stream(spec, weights, x, positions, gauge="maxkey", layer=L64,
                               max_bytes=max_bytes, outputs=()):
            hs, qi = ch.heads, ch.queries
            ref = nat[qi][:, hs].transpose(0, 1)
            arr["native_abs"][hs[0]:hs[-1] + 1, qi] = (ch.readout - ref).abs().amax(-1)
            arr["native_bound"][hs[0]:hs[-1] + 1, qi] = bound(
                hs, qi, arr["kappa_maxkey"][hs[0]:hs[-1] + 1, qi], torch.float64)
    except FloatingPointError as err:
        errors.append(f"layer {layer}: float64 max-key gauge: {err}")
    tm["float64_maxkey"] = tm.get("float64_maxkey", 0.0) + time.perf_counter() - t0
    return LayerResult(layer, {k: v.cpu().numpy() for k, v in arr.items()},
                       vscale.cpu().numpy(), nscale.cpu().numpy(), qk_max.cpu().numpy(), errors)


@dataclass
class _Work:
    """Work buffers the float64 original-gauge chunks of one layer share: the key group whose
    outer products ``vec(k~_j^T k~_j)`` are held (:func:`ropestep.fast.key_outer`), and the
    buffers of the chunks' ``G_i`` and ``M_i``, by shape."""
    group: int = -1
    outer: torch.Tensor | None = None
    descent: dict = field(default_factory=dict)


def _pass_original(ch, L64, arr, nat, vscale, sc, Ah, q_unrot, anchors, anchor_every, T_a, mu_a,
                   y_a, p_a, u_all, lay, work: _Work, b_a: torch.Tensor,
                   post_gain: torch.Tensor | None = None) -> None:
    """Reduce one float64 original-gauge chunk into the per-query arrays (see evaluate_layer)."""
    hs, qi = ch.heads, ch.queries
    h0, h1 = hs[0], hs[-1] + 1
    G_, Qc = len(hs), int(qi.numel())
    s, c = ch.extra["s"], ch.extra["c"]  # (G, Qc, n)
    n = s.shape[-1]
    mask = scale.causal_chunk_mask(L64.pos, qi, n, L64.spec.window, L64.spec.chunk)  # as the chunk was computed
    y, ro, mu, t = ch.y, ch.readout, ch.mu, ch.t  # (G, Qc, r), (Qc, r), (G, Qc, d, r)
    ref = nat[qi][:, hs].transpose(0, 1)
    arr["id_abs"][h0:h1, qi] = (ro - y).abs().amax(-1)
    arr["native_orig_abs"][h0:h1, qi] = (ro - ref).abs().amax(-1)
    kap = ch.extra["kappa"]
    arr["kappa_original"][h0:h1, qi] = kap
    smax = s.masked_fill(~mask[None], -math.inf).amax(-1)
    smin = s.masked_fill(~mask[None], math.inf).amin(-1)
    arr["spread"][h0:h1, qi] = smax - smin
    smag = torch.maximum(smax.abs(), smin.abs())
    arr["score_abs"][h0:h1, qi] = smag
    # float64 readout bound of each query, relative to the value scale (tolerances)
    npre = (mask.sum(-1).double() + (L64.spec.sinks is not None))[None].expand(G_, Qc)
    d = t.shape[-2]
    b = tolerances.readout_bound(torch.float64, kap.cpu().numpy(), npre.cpu().numpy(), d,
                                 smag.cpu().numpy())
    arr["id_bound"][h0:h1, qi] = torch.as_tensor(np.maximum(b, tolerances.FLOAT64_REL),
                                                 device=s.device)
    z = transform(s, L64.spec.softcap)  # the softmax acts on phi(s)
    zm = z.masked_fill(~mask[None], -math.inf)
    if L64.spec.sinks is not None:  # a learned sink takes its share of every row's mass
        sk = torch.tensor([L64.spec.sinks[h] for h in hs], dtype=z.dtype, device=z.device)
        p = torch.softmax(torch.cat((zm, sk[:, None, None].expand(G_, Qc, 1)), -1), -1)[..., :-1]
    else:
        p = torch.softmax(zm, -1)  # (G, Qc, n)
    arr["sink"][h0:h1, qi] = p[..., 0]
    g = L64.group_of(hs[0])
    cb = L64.cos[:, qi] if L64.cos.shape[0] == 1 else L64.cos[hs][:, qi]
    sb = L64.sin[:, qi] if L64.sin.shape[0] == 1 else L64.sin[hs][:, qi]
    if _descent_defined(L64.spec):  # the descent statistics are derived for phi = id
        # gradient step: G_i = sum_j c_ij k~_j^T k~_j, query and input space as d x d problems;
        # input space: with B_i^T = A_h^(1/2) R_i^T (one rotation of A_h^(1/2) per query), the
        # input-space Hessian's nonzero spectrum is that of M_i = B_i^T G_i B_i (d x d), and
        # the unit step's quadratic test reads, with Y_i = B_i^T T_i,  0.5 <Y, M Y> > <Y, Y>
        # (docs/math.md section 3; L_i^T L_i = R_i A_h R_i^T = B_i B_i^T).  G and M of the
        # chunk share one buffer, so that one lambda_max call certifies both; the products run
        # one head at a time (d x d operands that stay in cache).  The Lanczos steps start from
        # g_i = sum_j c_ij k~_j (the keys' common direction dominates G_i) and B_i^T g_i for M_i
        shape = (1 if Ah is None else 2, G_, Qc, d, d)
        if shape not in work.descent:
            work.descent[shape] = s.new_empty(shape)
        sym = work.descent[shape]
        if work.group != g:  # vec(k~_j^T k~_j) of the group's keys, once per group
            work.group, work.outer = g, fast.key_outer(L64.k[g])
        Gm = fast.gram(c, None, outer=work.outer[:n], out=sym[0])  # (G, Qc, d, d)
        start = s.new_empty(shape[:-1])  # (spaces, G, Qc, d)
        torch.matmul(c, L64.k[g][:n], out=start[0])
        cbh, sbh = cb.expand(G_, -1, -1), sb.expand(G_, -1, -1)  # a group's rows, or its heads'
        for gi, h in enumerate(hs):
            arr["inc_query"][h, qi] = (fast.query_step_change(Gm[gi], t[gi], sc[h]) > 0).double()
            if Ah is not None:
                Bt = apply_rope(Ah[h][None], cbh[gi][:, None, :], sbh[gi][:, None, :], lay)
                M = torch.matmul(Bt @ Gm[gi], Bt.transpose(-1, -2), out=sym[1, gi])
                torch.matmul(Bt, start[0, gi, :, :, None], out=start[1, gi, :, :, None])
                Y = Bt @ t[gi]  # (Qc, d, r)
                inc = 0.5 * (Y * (M @ Y)).sum((-1, -2)) > (Y * Y).sum((-1, -2))
                arr["inc_input"][h, qi] = inc.double()
        lam = fast.lambda_max(sym, fast.LANCZOS_STEPS_STARTED, start=start,
                              retry=fast.LANCZOS_STEPS)  # one certified call: G's, then M's
        if Ah is None:
            (lam_q,) = lam
        else:
            lam_q, lam_in = lam
            arr["lam_input"][h0:h1, qi] = lam_in
        arr["lam_query"][h0:h1, qi] = fast.query_lambda(lam_q, sc[hs][:, None])
    # frozen reuse: anchors of this chunk first, then every query of the chunk
    q_list = qi.tolist()
    for a_idx, a in enumerate(anchors.tolist()):
        if a in q_list:
            j = q_list.index(a)
            T_a[h0:h1, a_idx] = t[:, j]
            if ch.b is not None:  # the bias row (attention sinks): u_i^T dM_a carries it too
                b_a[h0:h1, a_idx] = ch.b[:, j]
            mu_a[h0:h1, a_idx] = mu[j]
            y_a[h0:h1, a_idx] = y[:, j]
            p_a[h0:h1, a_idx, :n] = p[:, j]
    aidx = torch.div(qi, anchor_every, rounding_mode="floor")  # (Qc,)
    apos = anchors[aidx]
    if L64.lw is not None:
        lw = L64.lw[hs]  # (G, m+1, d) W^_q * scale
        uq = u_all[qi] @ lw  # (G, Qc, d) unrotated queries
    else:  # query space: query i's effective query before rotation (QK-norm: normalised)
        uq = q_unrot[hs][:, qi]
    ca = L64.cos[:, apos] if L64.cos.shape[0] == 1 else L64.cos[hs][:, apos]
    sa = L64.sin[:, apos] if L64.sin.shape[0] == 1 else L64.sin[hs][:, apos]
    q_at_a = apply_rope(uq, ca, sa, lay)  # u_i^T L_a (query space: R(p_a) q_i)
    if post_gain is not None:  # a norm after the rotation (Hunyuan): g R(p_a) q^_i
        q_at_a = q_at_a * post_gain
    ya, pa = y_a[h0:h1, aidx], p_a[h0:h1, aidx, :n]
    # mu_a + u_i^T L_a T_a, one product per anchor of the chunk (T_a is not gathered per query)
    y_fr = torch.empty_like(ya)
    for a_idx in torch.unique(aidx).tolist():
        sel = aidx == a_idx
        y_fr[:, sel] = (mu_a[h0:h1, a_idx, None] + q_at_a[:, sel] @ T_a[h0:h1, a_idx]
                        + b_a[h0:h1, a_idx, None])
    not_anchor = (qi != apos)[None].expand(G_, Qc)
    nan = torch.full_like(y_fr[..., 0], math.nan)

    def sq(e: torch.Tensor) -> torch.Tensor:
        return torch.where(not_anchor, (e * e).sum(-1), nan)

    arr["reuse_frozen"][h0:h1, qi] = sq(y - y_fr)
    arr["reuse_const"][h0:h1, qi] = sq(y - ya)
    arr["reuse_mean"][h0:h1, qi] = sq(y - mu[None])
    arr["tv"][h0:h1, qi] = torch.where(not_anchor, 0.5 * (p - pa).abs().sum(-1), nan)


# ---------------------------------------------------------------------------------------------
# pooling over contexts: per (layer, head) summaries and the verdict
# ---------------------------------------------------------------------------------------------
def _max(a: np.ndarray) -> float:
    """Max of computed values; a NaN among them propagates (a failed pass is never hidden)."""
    return float(np.max(a)) if a.size else math.nan


def _median(a: np.ndarray) -> float:
    return float(np.median(a)) if a.size else math.nan


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3:
        return math.nan
    ra = np.argsort(np.argsort(a[ok])).astype(float)
    rb = np.argsort(np.argsort(b[ok])).astype(float)
    ra -= ra.mean()
    rb -= rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else math.nan


def _ratio(err: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """``err / bound`` elementwise, quietly: a zero bound gives inf (or NaN for 0/0), which the
    checks count as failures (``<= 1`` is false for both) and the report prints as such."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return err / bound


def _descent_defined(spec: HeadSpec) -> bool:
    """The atlas's step statistics (docs/math.md section 3) assume ``phi = id`` and keys whose
    features have no bias coordinate: not with a soft-cap, attention sinks or ALiBi biases."""
    return spec.softcap is None and spec.sinks is None and spec.alibi_slopes is None


def summarise_layer(results: Sequence[LayerResult], spec: HeadSpec, m: int, N: int,
                    lp_dtype: torch.dtype) -> dict:
    """Pool one layer's per-context results into per-head statistics and checks."""
    H, d = spec.n_heads, spec.head_dim
    descent = _descent_defined(spec)  # the step statistics assume phi = id, no sink
    descent_in = descent and spec.affine
    heads = []
    for h in range(H):
        def cat(key: str) -> np.ndarray:
            return np.concatenate([r.arrays[key][h] for r in results])

        vs = np.array([r.value_scale[h] for r in results])
        ns = np.array([r.native_scale[h] for r in results])
        id_rel = np.concatenate([r.arrays["id_abs"][h] / r.value_scale[h] for r in results])
        id_bnd = cat("id_bound")
        nat_rel = max(float(np.max(r.arrays["native_abs"][h])) / r.native_scale[h]
                      for r in results)
        orig_rel = max(float(np.max(r.arrays["native_orig_abs"][h])) / r.native_scale[h]
                       for r in results)
        nat_ratio = _ratio(cat("native_abs"), cat("native_bound"))
        orig_ratio = _ratio(cat("native_orig_abs"), cat("native_orig_bound"))
        # queries whose original-gauge float64 readout cannot resolve the model's output: its
        # rounding bound exceeds the max-key one by more than the model's own float32 level
        # (both bounds share the model-side term)
        orig_unresolved = int(np.sum(cat("native_orig_bound") - cat("native_bound")
                                     > tolerances.native_rel_tol(N, d, m)
                                     * np.repeat(ns, [r.arrays["native_abs"].shape[1]
                                                      for r in results])))
        lp_rel = max(float(np.max(r.arrays["lp_abs"][h])) / r.native_scale[h] for r in results)
        lp_id = max(float(np.max(r.arrays["lp_id_abs"][h])) / r.value_scale[h] for r in results)
        qk = max(float(r.qk_max[h]) for r in results)
        nat_tol = tolerances.native_rel_tol(N, d, m)
        # kappa-blind reference level (reported), and the per-query kappa-aware bound (checked)
        lp_tol = (tolerances.agreement_rel_tol(torch.float32, N, d, m) if lp_dtype == torch.float32
                  else tolerances.native_rel_tol_lowp(lp_dtype, qk))
        lp_ratio = _ratio(cat("lp_abs"), cat("lp_bound"))
        ratio = id_rel / id_bnd
        fr, co, me = (cat(k) for k in ("reuse_frozen", "reuse_const", "reuse_mean"))
        tv = cat("tv")
        sel = ~np.isnan(fr)  # anchors excluded (NaN by construction)
        rel_err = np.sqrt(fr[sel]) / np.sqrt(np.maximum(me[sel], 1e-300))
        checks = {
            "identity_float64": bool(np.all(id_rel <= id_bnd)),
            "float64_vs_native": bool(np.all(nat_ratio <= 1.0)),
            "float64_original_gauge_vs_native": bool(np.all(orig_ratio <= 1.0)),
            "model_dtype_vs_native": bool(np.all(lp_ratio <= 1.0)),
            "finite": bool(np.all(np.isfinite(id_rel)) and math.isfinite(nat_rel)
                           and math.isfinite(lp_rel) and np.all(np.isfinite(lp_ratio))
                           and np.all(np.isfinite(nat_ratio))),
        }
        heads.append({
            "head": h, "checks": checks, "passed": all(checks.values()),
            "identity_float64_rel_max": float(np.max(id_rel)),
            "identity_float64_bound_ratio_max": float(np.max(ratio)),
            "float64_vs_native_rel": nat_rel, "float64_vs_native_tol": nat_tol,
            "float64_vs_native_bound_ratio_max": _max(nat_ratio),
            "float64_original_gauge_vs_native_rel": orig_rel,
            "float64_original_gauge_bound_ratio_max": _max(orig_ratio),
            "original_gauge_unresolved_queries": orig_unresolved,
            "model_dtype_vs_native_rel": lp_rel, "model_dtype_vs_native_kappa_blind_tol": lp_tol,
            "model_dtype_vs_native_bound_ratio_max": _max(lp_ratio),
            "model_dtype_identity_rel": lp_id,
            "kappa_original": {"median": _median(cat("kappa_original")),
                               "max": _max(cat("kappa_original"))},
            "kappa_maxkey": {"median": _median(cat("kappa_maxkey")),
                             "max": _max(cat("kappa_maxkey"))},
            "spread": {"median": _median(cat("spread")), "max": _max(cat("spread"))},
            "sink_mass": {"mean": float(np.mean(cat("sink"))), "median": _median(cat("sink"))},
            "lambda_max_query_space": ({"median": _median(cat("lam_query")),
                                        "max": _max(cat("lam_query"))} if descent
                                       else {"median": None, "max": None}),
            "lambda_max_input_space": ({"median": _median(cat("lam_input")),
                                        "max": _max(cat("lam_input"))} if descent_in
                                       else {"median": None, "max": None}),
            "step_increases_E_query_space": (float(np.mean(cat("inc_query"))) if descent
                                             else None),
            "step_increases_E_input_space": (float(np.mean(cat("inc_input"))) if descent_in
                                             else None),
            "reuse": {
                "n_queries": int(sel.sum()),
                "rrmse_vs_constant_anchor": float(math.sqrt(fr[sel].sum() / co[sel].sum()))
                if co[sel].sum() > 0 else math.nan,
                "rrmse_vs_cache_mean": float(math.sqrt(fr[sel].sum() / me[sel].sum()))
                if me[sel].sum() > 0 else math.nan,
                "relative_error_median": _median(rel_err),
                "spearman_error_vs_tv": _spearman(rel_err, tv[sel]),
                "by_tv_quartile": _binned(rel_err, tv[sel]),
            },
            "value_scale": float(vs.max()), "native_scale": float(ns.max()),
        })
    errors = [e for r in results for e in r.errors]
    out = {"heads": heads, "errors": errors,
           "passed": not errors and all(h["passed"] for h in heads)}
    if not descent and spec.softcap is not None:  # said, not left as NaN
        out["descent"] = (f"not defined: soft-capped scores (softcap {spec.softcap}); the unit "
                          "step's descent statistics are derived for phi = id (docs/math.md "
                          "section 3); the identity, gauges and frozen reuse hold as measured")
    elif not descent:
        out["descent"] = ("not defined here: attention sinks -- the sink key's feature lies in "
                          "the bias coordinate, which the atlas's d x d step problems do not "
                          "carry (docs/math.md section 13); the identity, gauges and frozen "
                          "reuse (with the sink's bias row) hold as measured")
    if not spec.affine:  # said, not left as NaN: the input-space statistics do not exist here
        out["input_space"] = (f"not defined: the {spec.family!r} score is not affine in u, so "
                              "no input-space Delta M or Hessian exists (docs/math.md section "
                              "8); frozen reuse is measured in query space: R(p_a) applied to query i's "
                              "normalised, unrotated query")
    return out


def _binned(err: np.ndarray, tv: np.ndarray) -> list[dict]:
    """Median relative reuse error in the quartile bins of the TV distance."""
    if err.size < 4:
        return []
    qs = np.quantile(tv, [0, 0.25, 0.5, 0.75, 1.0])
    out = []
    for lo, hi in zip(qs[:-1], qs[1:]):
        sel = (tv >= lo) & (tv <= hi)
        out.append({"tv_lo": float(lo), "tv_hi": float(hi), "n": int(sel.sum()),
                    "relative_error_median": _median(err[sel])})
    return out


def replication_style(final: dict[int, list[np.ndarray]], lam: dict[int, list[np.ndarray]]
                      ) -> dict:
    """"X of Y heads" whose final query's unit step increases E, in query space, per layer and
    pooled; ``final[layer]`` holds one boolean array (H,) per context."""
    per = {}
    tx = ty = 0
    lams = []
    for layer in sorted(final):
        inc = np.concatenate(final[layer])
        la = np.concatenate(lam[layer])
        x, y = int(inc.sum()), int(inc.size)
        per[str(layer)] = {"increase": x, "heads": y, "lambda_max_median": _median(la),
                           "lambda_max_max": _max(la)}
        tx, ty = tx + x, ty + y
        lams.append(la)
    allla = np.concatenate(lams) if lams else np.array([])
    return {"space": "query (features a_j = k~_j * scale; the public replication's)",
            "query": "final position of each context, causal bank including its own key",
            "per_layer": per, "pooled": {"increase": tx, "heads": ty,
                                         "lambda_max_median": _median(allla),
                                         "lambda_max_max": _max(allla)}}


def pool(done: Sequence[tuple[int, int, LayerResult]], specs: dict[int, tuple[HeadSpec, int]],
         layers: Sequence[int], length: int, lp_dtype: torch.dtype, replication_only: bool = False
         ) -> tuple[dict, dict, list[str]]:
    """The report's pooled sections from every finished ``(context, layer, result)`` item
    (``specs[layer] = (spec, m)``): the per-layer summaries (none under ``replication_only``),
    the replication-style count (the final query of each context, layers whose scores are not
    soft-capped) and the verdict's list of failed checks and errors."""
    per_layer: dict[int, list[LayerResult]] = {L: [] for L in layers}
    rep_inc: dict[int, list[np.ndarray]] = {L: [] for L in layers}
    rep_lam: dict[int, list[np.ndarray]] = {L: [] for L in layers}
    for _c, L, res in sorted(done, key=lambda t: (t[0], t[1])):
        per_layer[L].append(res)
        if _descent_defined(specs[L][0]):  # the step statistics assume phi = id, no sink
            rep_inc[L].append(res.arrays["inc_query"][:, -1] > 0)
            rep_lam[L].append(res.arrays["lam_query"][:, -1])
    rep_inc = {L: v for L, v in rep_inc.items() if v}
    rep_lam = {L: v for L, v in rep_lam.items() if v}
    out_layers = {}
    if not replication_only:
        for L in layers:
            spec, m = specs[L]
            out_layers[str(L)] = summarise_layer(per_layer[L], spec, m, length, lp_dtype)
    failed = [f"layer {L} head {h['head']}: " + ", ".join(k for k, v in h["checks"].items()
                                                         if not v)
              for L, lr in out_layers.items() for h in lr["heads"] if not h["passed"]]
    failed += [e for lr in out_layers.values() for e in lr["errors"]]
    return out_layers, replication_style(rep_inc, rep_lam), failed


def final_query_only(spec: HeadSpec, w: HeadWeights, x: torch.Tensor, positions: torch.Tensor,
                     layer: int, *, device: Any = None,
                     max_bytes: int = scale.DEFAULT_MAX_BYTES, timers: dict | None = None
                     ) -> LayerResult:
    """The replication's measurement alone: the final query of the context, query space."""
    n = int(x.shape[0])
    H = spec.n_heads
    arr = {k: np.full((H, n), math.nan) for k in PER_QUERY}
    t0 = time.perf_counter()
    Lq = scale.project_layer(spec, w, x, positions, dtype=torch.float64,
                             device=device)
    for ch in scale.stream(spec, w, x, positions, gauge="original", layer=Lq,
                           queries=[n - 1], outputs=("c",), max_bytes=max_bytes):
        hs = ch.heads
        c, t = ch.extra["c"], ch.t  # (G, 1, n), (G, 1, d, r)
        Gm = fast.gram(c, Lq.k[Lq.group_of(hs[0]), :c.shape[-1]])
        sc = torch.tensor([spec.score_scale(h) for h in hs], dtype=torch.float64,
                          device=Gm.device)[:, None]
        lam, dE = fast.query_space_step(Gm, t, sc)
        inc = dE > 0
        arr["lam_query"][hs[0]:hs[-1] + 1, -1] = lam[:, 0].cpu().numpy()
        arr["inc_query"][hs[0]:hs[-1] + 1, -1] = inc[:, 0].double().cpu().numpy()
    timers = timers if timers is not None else {}
    timers["replication_descent"] = timers.get("replication_descent", 0.0) + \
        time.perf_counter() - t0
    return LayerResult(layer, arr, np.ones(H), np.ones(H), np.zeros(H))
