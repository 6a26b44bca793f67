"""``ropestep atlas``: every layer, head and query of a real model against the model's own output.

One forward pass per context captures, for every requested layer, the attention input (after the
block's input norm) and each head's output (the ``o_proj`` input) in the model's dtype
(:func:`ropestep.models.capture`).  Then, per layer, on the causal bank exactly as the model
computes it, the streamed all-query path (:mod:`ropestep.scale`, one kernel) evaluates in
float64 and in the model's dtype:

* the identity ``y_i = mu_i + u_i^T Delta M_i`` (query-space readout ``mu_i + q_i T_i``) against
  the recomputed softmax output and against the model's own head output;
* the readout condition number ``kappa`` in the original gauge (float64) and in the max-key
  gauge (as the model-dtype readout evaluates it), the score spread, the attention-sink mass on
  the first key;
* the gradient-step diagnostics of docs/math.md section 3 in both parametrisations, each as a
  ``d x d`` problem: query space (features ``a_j = k~_j * scale``, the public replication's) with
  ``H^q = scale^2 G_i`` and input space (the paper's, features ``a_j = L_i k~_j^T``) with
  ``lambda_max(G^{1/2} L^T L G^{1/2})``, ``G_i = sum_j c_ij k~_j^T k~_j``; and whether the unit
  step increases ``E`` (``E(step) - E(0) = 1/2 tr(X^T G X) - tr(T^T X)`` with ``X = M T``,
  ``M = scale^2 I`` or ``L^T L``: no cancelling ``E(0)`` is formed);
* frozen reuse across queries of one context: the matrix ``Delta M_a`` of the anchor ``a`` (every
  ``k``-th position) applied to the later queries of its window, ``y_fr_i = mu_a + u_i^T Delta M_a``,
  against the constant anchor output ``y_a`` and the query's own cache mean ``mu_i`` (rRMSE,
  pooled squared errors), and its relative error against the total-variation distance of the
  two attention rows.

Nothing of size ``N x N x layers`` is held: chunks are reduced as they stream, per-query
statistics are ``(H, N)`` per layer.  Results: ``report.json`` first, then ``report.md`` and
figures.  The replication-style descent statistic (query space, final query, causal bank
including its own key) is reported apart and never set beside an input-space number.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import fast, scale, tolerances
from .dist import (broadcast_from_rank0, exit_worker, finish, gather_to_rank0,
                   init_distributed, launcher_command, shard_contiguous,
                   under_launcher)
from .kernel import augment, transform
from .provenance import portable_command, portable_config, portable_name
from .runstate import Progress, peak_rss_mib
from .rope import apply_rope
from .spec import HeadSpec, HeadWeights, RoPESpec
from .verdict import device_problem, input_error, output_and_threads_problem

SCHEMA = "ropestep.atlas/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    if spec.alibi_slopes is not None:
        raise AtlasError(f"layer {layer}: the atlas covers RoPE heads without ALiBi biases")
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
        q_unrot = scale.project_layer(replace(spec, rope=ident), w_unrot, x, positions,
                                      dtype=torch.float64, device=device).q
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
    features have no bias coordinate: not with a soft-cap, not with attention sinks."""
    return spec.softcap is None and spec.sinks is None


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


# ---------------------------------------------------------------------------------------------
# the run: model, contexts, capture, every layer
# ---------------------------------------------------------------------------------------------
@dataclass
class AtlasConfig:
    """Everything a run depends on (recorded verbatim in the report)."""

    model: str
    revision: str | None = None
    gguf: str | None = None
    corpus: str = "default"
    corpus_revision: str | None = None
    contexts: int = 4
    length: int = 512
    layers: str = "all"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 1
    anchor_every: int = 64
    max_bytes: int = scale.DEFAULT_MAX_BYTES
    replication_only: bool = False


def check_config(cfg: AtlasConfig) -> None:
    if cfg.dtype not in DTYPES:
        raise AtlasError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    for name in ("contexts", "length", "anchor_every"):
        if int(getattr(cfg, name)) < 1:
            raise AtlasError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.length < 2:
        raise AtlasError(f"--len must be >= 2, got {cfg.length}")
    dev = str(cfg.device)
    if dev.startswith("mps"):
        raise AtlasError("--device mps has no float64, and the atlas's reference passes are "
                         "float64: use cpu or cuda")
    problem = device_problem(dev)
    if problem is not None:
        raise AtlasError(problem)
    if cfg.max_bytes < 1 << 20:
        raise AtlasError(f"--max-bytes must be at least 1 MiB, got {cfg.max_bytes}")


def _progress(total: int, enabled: bool, desc: str) -> Progress:
    return Progress(total, enabled, desc)


# ---------------------------------------------------------------------------------------------
# the run directory: finished items kept as they complete (--run-dir, --resume)
# ---------------------------------------------------------------------------------------------
RUN_SCHEMA = "ropestep.atlas-run/1"
_SCALARS = ("value_scale", "native_scale", "qk_max")


def _item_key(context: int, layer: int) -> str:
    return f"context{context}_layer{layer}"


def _result_to_arrays(res: LayerResult, context: int, m: int) -> tuple[dict, dict]:
    arrays = {f"arrays.{k}": v for k, v in res.arrays.items()}
    arrays.update({k: getattr(res, k) for k in _SCALARS})
    return arrays, {"context": context, "layer": res.layer, "errors": list(res.errors), "m": m}


def _result_from_arrays(arrays: dict, meta: dict) -> tuple[LayerResult, int]:
    per_query = {k[len("arrays."):]: v for k, v in arrays.items() if k.startswith("arrays.")}
    if sorted(per_query) != sorted(PER_QUERY) or any(k not in arrays for k in _SCALARS):
        raise AtlasError(f"run directory item of context {meta.get('context')} layer "
                         f"{meta.get('layer')} holds other statistics than this version "
                         "computes: start without --resume")
    return LayerResult(int(meta["layer"]), per_query, *(arrays[k] for k in _SCALARS),
                       errors=list(meta["errors"])), int(meta["m"])


def _open_run_dir(path: Path, resume: bool, cfg: AtlasConfig, prov: dict, items: list,
                  rank: int, world: int):
    """Open the run directory on every rank: rank 0 first (it starts it afresh or checks the
    fingerprint), then the others join the run it opened.  The fingerprint: the configuration,
    the model's provenance (its files' sha256), the work list and ropestep's version."""
    from . import __version__
    from .runstate import RunStateError, open_run_on_ranks

    fp = {"schema": RUN_SCHEMA, "config": asdict(cfg), "model": _portable(prov),
          "items": [list(it) for it in items], "ropestep": __version__}
    fp = json.loads(json.dumps(fp, default=str))
    try:
        return open_run_on_ranks(path, fp, resume=resume, rank=rank, world=world,
                                 broadcast=broadcast_from_rank0)
    except RunStateError as err:
        raise AtlasError(str(err)) from None


def run(cfg: AtlasConfig, *, progress: bool = True, command: Sequence[str] | None = None,
        loaded: tuple | None = None, dist_info: tuple[int, int] | None = None,
        dump_raw: Path | None = None, run_dir: Path | None = None,
        resume: bool = False, placement: dict | None = None) -> dict | None:
    """Run the atlas and return the report (a JSON-ready dict; the report is not written here).

    ``loaded`` may pass an already loaded ``(model, tokenizer, provenance)`` (tests).
    ``dist_info = (rank, world)`` under torchrun (:func:`ropestep.dist.init_distributed`):
    every rank computes its share of the (context, layer) items, rank 0 gathers them and
    returns the report; the other ranks return None.  ``dump_raw``: a directory that receives
    the raw tensors every statistic is computed from (:func:`ropestep.protocol.dump_layer`,
    :func:`dump_item`, :func:`write_raw_manifest`; docs/protocol.md section 11).
    ``run_dir``: every finished (context, layer) item is kept there as it completes
    (:mod:`ropestep.runstate`); with ``resume`` the items already there (of a run with the same
    configuration and model files) are read back instead of recomputed, so a killed run continues
    where it stopped and gives the report an uninterrupted run gives (:func:`same_report`).
    ``placement``: accelerate's big-model placement of the model (:func:`ropestep.models.placement`),
    recorded in the report's ``run`` section with where each module went.
    """
    from . import models, protocol
    from .corpus import load_corpus, select_blocks, tokenizer_fn

    check_config(cfg)
    timers: dict[str, float] = {}
    t0 = time.perf_counter()
    if loaded is None:
        pc = protocol.Config(model=cfg.model, revision=cfg.revision, gguf=cfg.gguf,
                             dtype=cfg.dtype, device=cfg.device)
        loaded = protocol.load(pc, placement)
    model, tok, prov = loaded
    timers["load_model"] = time.perf_counter() - t0
    info = models.describe_model(model)
    layers = protocol.parse_indices(cfg.layers, info.n_layers, "layer", info.softmax_layers,
                                    dict(info.others))
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.length > int(max_pos):
        raise AtlasError(f"--len {cfg.length} exceeds the model's max_position_embeddings "
                         f"{max_pos}")
    corpus = load_corpus(cfg.corpus, cfg.corpus_revision)
    blocks = select_blocks(corpus.articles, tokenizer_fn(tok), cfg.contexts, cfg.length,
                           cfg.seed, corpus_name=str(cfg.corpus))
    lp = DTYPES[cfg.dtype]
    # work items (context, layer), context-major, in contiguous blocks over torchrun's
    # processes (one process: all of them), so that a context's forward runs on as few ranks as
    # possible; every item is computed from its own inputs alone, so the report does not depend
    # on the number of processes
    rank, world = dist_info if dist_info is not None else (0, 1)
    items = [(c, L) for c in range(len(blocks)) for L in layers]
    mine = shard_contiguous(items, rank, world)
    done: list[tuple[int, int, LayerResult]] = []
    specs: dict[int, tuple[HeadSpec, int]] = {}
    state = None if run_dir is None else _open_run_dir(run_dir, resume, cfg, prov, items,
                                                       rank, world)
    kept: dict[tuple[int, int], LayerResult] = {}
    if state is not None:
        for c, L in mine:
            got = state.load(_item_key(c, L))
            if got is not None:
                kept[(c, L)], m = _result_from_arrays(*got)
                if L not in specs:  # the layer's description, from the model (no capture)
                    specs[L] = (models.layer_head(model, L, cfg.length, dtype=torch.float64,
                                                  device=cfg.device)[0], m)
    report_item = _progress(len(mine), progress and rank == 0, "atlas")
    report_item.skipped(len(kept))
    if dump_raw is not None:
        dump_raw.mkdir(parents=True, exist_ok=True)
    for c in sorted({c for c, _ in mine}):
        done += [(c, L, kept[(c, L)]) for cc, L in mine if cc == c and (c, L) in kept]
        my_layers = [L for cc, L in mine if cc == c and (c, L) not in kept]
        if not my_layers:
            continue
        ids = torch.tensor(blocks[c].ids)
        ts = time.perf_counter()
        caps = models.capture(model, ids, my_layers, stop_early=False)
        timers["model_forward"] = timers.get("model_forward", 0.0) + time.perf_counter() - ts
        for L in my_layers:
            cap = caps[L]
            spec, w = models.layer_head(model, L, ids.numel(), dtype=torch.float64,
                                        device=cfg.device)
            specs[L] = (spec, int(cap.x.shape[1]))
            if dump_raw is not None:
                protocol.dump_layer(dump_raw, L, spec, w)  # once per layer
                dump_item(dump_raw, c, L, cap)
            if cfg.replication_only:
                res = _final_query_only(spec, w, cap, L, cfg, timers)
            else:
                res = evaluate_layer(spec, w, cap.x, cap.positions, cap.heads, layer=L,
                                     lp_dtype=lp, anchor_every=cfg.anchor_every,
                                     max_bytes=cfg.max_bytes, device=cfg.device, timers=timers)
            done.append((c, L, res))
            if state is not None:
                state.save(_item_key(c, L), *_result_to_arrays(res, c, specs[L][1]))
            report_item(context=c, layer=L)
        del caps
    report_item.close()
    done.sort(key=lambda t: (t[0], t[1]))
    parts = gather_to_rank0({"rank": rank, "done": done, "specs": specs, "timers": timers,
                             "resumed": len(kept)}, rank, world)
    if rank != 0:
        return None
    done = sorted((d for p in parts for d in p["done"]), key=lambda t: (t[0], t[1]))
    if [(c, L) for c, L, _ in done] != sorted(items):
        raise RuntimeError("the gathered atlas items do not cover the work list exactly once")
    for p in parts:
        specs.update(p["specs"])
    out_layers, replication, failed = pool(done, specs, layers, cfg.length, lp,
                                           cfg.replication_only)
    timers["total"] = time.perf_counter() - t0
    cost_section = None if cfg.replication_only else _cost(done, specs, parts, lp, cfg.device)
    src = getattr(corpus, "source", None) or {}
    corpus_prov = {"argument": portable_name(cfg.corpus), "sha256": src.get("sha256"),
                   "name": portable_name(getattr(corpus, "name", None))}
    env = protocol.environment(cfg.device)
    result = {
        "schema": SCHEMA,
        "command": portable_command(list(command) if command is not None else None),
        "config": portable_config(asdict(cfg)),
        "model": {"name": portable_name(info.name), "n_layers": info.n_layers, "n_heads": info.n_heads,
                  "n_kv_heads": info.n_kv_heads, "head_dim": info.head_dim,
                  "hidden": info.hidden, **_portable(prov),
                  # a hybrid's layers that are not softmax attention, with the reason
                  **({"not_softmax_attention": {str(L): why for L, why in info.others}}
                     if info.others else {})},
        "corpus": corpus_prov,
        "contexts": [{"article": b.article, "start": b.start, "n_tokens": b.n_tokens}
                     for b in blocks],
        "environment": env,
        "timing_seconds": timers,
        "cost": cost_section,
        "run": {"world_size": world,
                "resumed_items": sum(p.get("resumed", 0) for p in parts),
                "placement": models.placement_record(model, placement),
                "rank_items": {str(p["rank"]): [[c, L] for c, L, _ in p["done"]] for p in parts},
                "rank_timing_seconds": {str(p["rank"]): p["timers"] for p in parts}},
        "peak_rss_mib": peak_rss_mib(),
        "layers": out_layers,
        "replication_style_descent": replication,
        "verdict": {"passed": not failed, "failed": failed},
    }
    if dump_raw is not None:
        write_raw_manifest(dump_raw, result, specs, items)
    return result


def _cost(done: list, specs: dict, parts: list, lp: torch.dtype, device: Any) -> dict:
    """The counted work of every item (:func:`ropestep.cost.atlas_flops`), the phases' seconds
    summed over the processes, and this machine's GEMM rates measured now, in this process."""
    from . import cost

    flops: dict[str, float] = {}
    for _c, L, res in done:
        spec, m = specs[L]
        N = int(next(iter(res.arrays.values())).shape[1])
        for k, v in cost.atlas_flops(N=N, d=spec.head_dim, r=spec.r, m=m, H=spec.n_heads,
                                     H_kv=spec.n_kv_heads, affine=spec.affine,
                                     softcap=spec.softcap is not None,
                                     window=spec.window, chunk=spec.chunk).items():
            flops[k] = flops.get(k, 0.0) + v
    seconds: dict[str, float] = {}
    for p in parts:
        for k, v in p["timers"].items():
            seconds[k] = seconds.get(k, 0.0) + v
    low = str(lp).replace("torch.", "")
    rates = {"float64": cost.matmul_rate(torch.float64, device=device),
             low: cost.matmul_rate(lp, device=device)}
    return cost.phase_report(flops, seconds, rates, low, seconds.get("model_forward"))


def plan(cfg: AtlasConfig, budget: int | None = None) -> dict:
    """What a run of ``cfg`` will need, from the model's config alone (no weight is read): the
    weights' memory (all of them, and what stays resident under a ``--max-memory`` budget),
    the captured activations of one context, the streamed evaluation's budget, and per phase the
    counted work (:func:`ropestep.cost.atlas_flops`, plain causal heads: a window, soft-cap or
    QK-norm only lowers it) with its time at this machine's GEMM rates, measured now -- a floor:
    the committed runs reach a fraction of it (their ``cost.fraction_of_matmul``)."""
    from . import cost, models, protocol

    source = cfg.model
    if str(source).strip().lower() == protocol.SMOLLM2_ALIAS:
        source = str(models.locate_smollm2_gguf())
    config = models.read_config(source, revision=cfg.revision, gguf_file=cfg.gguf)
    info = models.describe_model(config)
    layers = protocol.parse_indices(cfg.layers, info.n_layers, "layer")
    lp = DTYPES[cfg.dtype]
    meta = models.meta_model(config, lp)
    nbytes = torch.tensor([], dtype=lp).element_size()
    params = sum(p.numel() for p in meta.parameters())  # shared (tied) weights once
    from .models.structure import attention_module, decoder, layer_list

    attn = [sum(p.numel() for p in attention_module(ly, info.name, i).parameters())
            for i, ly in enumerate(layer_list(decoder(meta)))]
    N, C, m = cfg.length, cfg.contexts, info.hidden
    d = info.head_dim
    H, Hk = info.n_heads, info.n_kv_heads
    flops = {k: 0.0 for k in cost.PHASES}
    one = cost.atlas_flops(N=N, d=d, r=d, m=m, H=H, H_kv=Hk)
    for k, v in one.items():
        flops[k] = v * C * len(layers)
    low = cfg.dtype
    rates = {"float64": cost.matmul_rate(torch.float64, device=cfg.device),
             low: cost.matmul_rate(lp, device=cfg.device)}
    dt = {"project": "float64", "float64_original": "float64", "lowp_maxkey": low,
          "float64_maxkey": "float64"}
    phases = {k.replace("lowp", low): {"flops": v, "seconds_at_matmul_rate": v / rates[dt[k]]}
              for k, v in flops.items()}
    weights = params * nbytes
    resident = weights if budget is None else min(weights, int(budget))
    # the forward's own work, for scale: 2 operations per parameter and token besides the
    # embedding lookup, and the attention scores and outputs
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    fwd = C * (2.0 * (params - vocab * m) * N
               + info.n_layers * H * 2 * N * (N + 1) * d)
    return {
        "model": {"name": portable_name(info.name), "n_layers": info.n_layers, "n_heads": H,
                  "n_kv_heads": Hk, "head_dim": d, "hidden": m, "parameters": params,
                  "largest_attention_parameters": max(attn)},
        "run": {"contexts": C, "length": N, "layers": len(layers), "dtype": cfg.dtype},
        "memory_bytes": {
            "weights": weights, "weights_resident": resident,
            "one_attention_float64": 8 * max(attn),
            "captured_activations_per_context": nbytes * len(layers) * N * (m + H * d),
            "streamed_budget": cfg.max_bytes,
            "estimated_peak": resident + 8 * max(attn) + cfg.max_bytes
            + nbytes * len(layers) * N * (m + H * d)},
        "matmul_flops_per_s": rates,
        "phases": phases,
        "floor_seconds": sum(p["seconds_at_matmul_rate"] for p in phases.values()),
        "model_forward_flops": fwd,
        "model_forward_seconds_at_matmul_rate": fwd / rates[low],
    }


def render_plan(p: dict) -> str:
    """``--plan``'s text: memory, then the work per phase and its floor time."""
    def gib(b: float) -> str:
        return f"{b / 2 ** 30:.2f} GiB"

    mem, mdl, run_ = p["memory_bytes"], p["model"], p["run"]
    lines = [f"{mdl['name']}: {mdl['parameters'] / 1e9:.2f} B parameters, {mdl['n_layers']} "
             f"layers, {mdl['n_heads']} heads on {mdl['n_kv_heads']} KV heads, head_dim "
             f"{mdl['head_dim']}, hidden {mdl['hidden']}",
             f"run: {run_['contexts']} contexts x {run_['length']} tokens, {run_['layers']} "
             f"layers, model in {run_['dtype']}",
             f"memory: weights {gib(mem['weights'])} ({gib(mem['weights_resident'])} resident), "
             f"one layer's attention in float64 {gib(mem['one_attention_float64'])}, captured "
             "activations "
             f"{gib(mem['captured_activations_per_context'])} per context, streamed budget "
             f"{gib(mem['streamed_budget'])}; estimated peak {gib(mem['estimated_peak'])}",
             "work (counted; docs/protocol.md section 11, cost) and its time at this machine's "
             "GEMM rate ("
             + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in
                         p["matmul_flops_per_s"].items()) + "):"]
    for k, v in p["phases"].items():
        lines.append(f"  {k:18s} {v['flops'] / 1e12:10.3f} TFLOP  "
                     f"{v['seconds_at_matmul_rate']:10.1f} s")
    lines.append(f"  {'floor':18s} {'':10s}        {p['floor_seconds']:10.1f} s  (the model's "
                 f"own forwards: {p['model_forward_flops'] / 1e12:.3f} TFLOP, "
                 f"{p['model_forward_seconds_at_matmul_rate']:.1f} s at the same rate)")
    return "\n".join(lines)


def _portable(prov: dict) -> dict:
    """Provenance without absolute machine paths: file names and sha256 only."""
    out = dict(prov)
    for key in ("source", "argument"):
        out[key] = portable_name(out.get(key))
    return out


# ---------------------------------------------------------------------------------------------
# --dump-raw: the tensors every statistic is computed from (docs/protocol.md section 11)
# ---------------------------------------------------------------------------------------------
RAW_SCHEMA = "ropestep.atlas-raw/1"
RAW_MANIFEST = "atlas_raw.json"



def dump_item(out: Path, context: int, layer: int, cap: Any) -> None:
    """``context{c}_layer{L}.safetensors``: the layer's attention input ``x (N, m)`` (after the
    input norm), the positions ``(N,)`` and the model's own per-head attention outputs
    ``native (N, H, r)`` (the ``o_proj`` input, what the atlas compares with), as captured:
    in the model's dtype."""
    from .protocol import save_tensors

    save_tensors(out / f"context{context}_layer{layer}.safetensors",
                  {"x": cap.x, "positions": cap.positions, "native": cap.heads})


def write_raw_manifest(out: Path, result: dict, specs: dict[int, tuple[HeadSpec, int]],
                       items: Sequence[tuple[int, int]]) -> None:
    """``atlas_raw.json``: the run's config, command, model, corpus and contexts exactly as the
    report records them, the (context, layer) items dumped, and each layer's head layout."""
    layers = {str(L): {"n_heads": sp.n_heads, "n_kv_heads": sp.n_kv_heads,
                       "head_dim": sp.head_dim, "r": sp.r, "hidden": m,
                       "layout": sp.rope.layout, "family": sp.family}
              for L, (sp, m) in sorted(specs.items())}
    manifest = {"schema": RAW_SCHEMA, **{k: result[k] for k in
                                         ("command", "config", "model", "corpus", "contexts")},
                "items": [list(it) for it in items], "layers": layers}
    (out / RAW_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def _final_query_only(spec, w, cap, L, cfg, timers) -> LayerResult:
    """The replication's measurement alone: the final query of the context, query space."""
    n = int(cap.x.shape[0])
    H = spec.n_heads
    arr = {k: np.full((H, n), math.nan) for k in PER_QUERY}
    t0 = time.perf_counter()
    Lq = scale.project_layer(spec, w, cap.x, cap.positions, dtype=torch.float64,
                             device=cfg.device)
    for ch in scale.stream(spec, w, cap.x, cap.positions, gauge="original", layer=Lq,
                           queries=[n - 1], outputs=("c",), max_bytes=cfg.max_bytes):
        hs = ch.heads
        c, t = ch.extra["c"], ch.t  # (G, 1, n), (G, 1, d, r)
        Gm = fast.gram(c, Lq.k[Lq.group_of(hs[0]), :c.shape[-1]])
        sc = torch.tensor([spec.score_scale(h) for h in hs], dtype=torch.float64,
                          device=Gm.device)[:, None]
        lam, dE = fast.query_space_step(Gm, t, sc)
        inc = dE > 0
        arr["lam_query"][hs[0]:hs[-1] + 1, -1] = lam[:, 0].cpu().numpy()
        arr["inc_query"][hs[0]:hs[-1] + 1, -1] = inc[:, 0].double().cpu().numpy()
    timers["replication_descent"] = timers.get("replication_descent", 0.0) + \
        time.perf_counter() - t0
    return LayerResult(L, arr, np.ones(H), np.ones(H), np.zeros(H))


# ---------------------------------------------------------------------------------------------
# report: JSON first, then Markdown and figures rendered from it
# ---------------------------------------------------------------------------------------------
HEATMAPS = (  # (key path, title, log10)
    (("float64_vs_native_rel",), "float64 readout vs the model's own output (rel.)", True),
    (("model_dtype_vs_native_rel",), "model-dtype readout vs the model's own output (rel.)", True),
    (("kappa_maxkey", "median"), "kappa, max-key gauge (median)", True),
    (("kappa_original", "median"), "kappa, original gauge (median)", True),
    (("sink_mass", "mean"), "attention mass on the first key (mean)", False),
    (("spread", "median"), "score spread (median)", False),
    (("lambda_max_query_space", "median"), "lambda_max, query space (median)", True),
    (("lambda_max_input_space", "median"), "lambda_max, input space (median)", True),
    (("step_increases_E_query_space",), "unit step increases E, query space (fraction)", False),
    (("step_increases_E_input_space",), "unit step increases E, input space (fraction)", False),
    (("reuse", "rrmse_vs_constant_anchor"), "frozen reuse rRMSE vs constant anchor", False),
    (("reuse", "rrmse_vs_cache_mean"), "frozen reuse rRMSE vs cache mean", False),
)


def _get(h: dict, path: tuple) -> float:
    """One statistic of a head; ``None`` (not defined for the head's score family) is NaN."""
    v: Any = h
    for p in path:
        v = v[p]
    return math.nan if v is None else float(v)


def grid(result: dict, path: tuple) -> tuple[list[int], np.ndarray]:
    """``(layers, values (n_layers, H))`` of one per-head statistic."""
    layers = sorted(int(k) for k in result["layers"])
    vals = np.array([[_get(h, path) for h in result["layers"][str(L)]["heads"]]
                     for L in layers], dtype=float)
    return layers, vals


def render_markdown(result: dict) -> str:
    from .verdict import num

    cfg, mod = result["config"], result["model"]
    lines = [f"# Atlas: {mod['name']}", "",
             f"Command: `{' '.join(result['command'] or [])}`", "",
             f"Model: {mod['name']} ({mod['n_layers']} layers, {mod['n_heads']} heads on "
             f"{mod['n_kv_heads']} KV heads, head dim {mod['head_dim']}); file "
             f"`{mod.get('gguf_file') or mod.get('source')}` sha256 `{mod.get('gguf_sha256')}`.",
             f"Corpus: {result['corpus']['argument']} (sha256 `{result['corpus']['sha256']}`), "
             f"{cfg['contexts']} contexts x {cfg['length']} tokens, seed {cfg['seed']}; model "
             f"dtype {cfg['dtype']}, device {cfg['device']}; frozen-reuse anchors every "
             f"{cfg['anchor_every']} positions.", ""]
    v = result["verdict"]
    lines += [f"**Verdict: {'PASS' if v['passed'] else 'FAIL'}**"
              + ("" if v["passed"] else f" ({len(v['failed'])} failed: "
                 + "; ".join(v["failed"][:10]) + ")"), ""]
    tm = result["timing_seconds"]
    lines += ["## Time", "", "| phase | seconds |", "|---|---:|"]
    lines += [f"| {k} | {num(t, '.1f')} |" for k, t in tm.items()]
    lines += ["", f"Peak resident memory: {num(result['peak_rss_mib'], '.0f')} MiB. "
              "`model_forward` is the model's own forward passes over the same tokens "
              "(capture hooks on).", ""]
    cost = result.get("cost")
    if cost:
        rates = cost["matmul_flops_per_s"]
        lines += ["## Cost", "", "Counted work per phase (docs/protocol.md section 11, `cost`) "
                  "against this machine's GEMM rate measured in the same run ("
                  + ", ".join(f"{k} {num(r / 1e9, '.1f')}" for k, r in rates.items())
                  + " GFLOP/s).", "", "| phase | GFLOP | seconds | GFLOP/s | fraction of GEMM rate |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {k} | {num(p['flops'] / 1e9, '.0f')} | {num(p['seconds'], '.1f')} | "
                  f"{num(p['achieved_flops_per_s'] / 1e9, '.1f')} | "
                  f"{num(p['fraction_of_matmul'], '.2f')} |" for k, p in cost["phases"].items()]
        lines += ["", f"Overall: {num(cost['work_seconds'], '.1f')} s of work against a floor of "
                  f"{num(cost['floor_seconds'], '.1f')} s at the GEMM rate (fraction "
                  f"{num(cost['fraction_of_matmul'], '.2f')})"
                  + (f"; {num(cost['work_over_model_forward'], '.1f')}x the model's own "
                     f"forwards ({num(cost['model_forward_seconds'], '.1f')} s; the floor "
                     f"{num(cost['floor_over_model_forward'], '.1f')}x)"
                     if "work_over_model_forward" in cost else "") + ".", ""]
    rep = result["replication_style_descent"]
    lines += ["## Descent as the public replication measured it", "",
              f"Space: {rep['space']}; {rep['query']}. Unit step increases E in "
              f"**{rep['pooled']['increase']} of {rep['pooled']['heads']}** (head, context) "
              f"pairs pooled over layers; lambda_max median "
              f"{num(rep['pooled']['lambda_max_median'])}, max "
              f"{num(rep['pooled']['lambda_max_max'])}.", "",
              "| layer | increases E | of | lambda_max median | max |", "|---:|---:|---:|---:|---:|"]
    for L, r in rep["per_layer"].items():
        lines.append(f"| {L} | {r['increase']} | {r['heads']} | {num(r['lambda_max_median'])} "
                     f"| {num(r['lambda_max_max'])} |")
    if result["layers"]:
        lines += ["", "## Per layer (worst head, or median over heads)", "",
                  "Input-space numbers (the paper's parametrisation) are never compared with "
                  "the replication's query-space statistic above.", "",
                  "| layer | pass | identity f64 (rel) | f64 vs native | orig. gauge unresolved "
                  "queries | dtype vs native | bound ratio | "
                  "kappa maxkey (med) | sink (mean) | lambda q (med) | lambda in (med) | "
                  "E up q | E up in | reuse rRMSE vs const | vs mean |",
                  "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for L, lr in result["layers"].items():
            hs = lr["heads"]

            def col(path: tuple, how: str) -> str:
                if ("input_space" in lr and path[0].endswith("_input_space")) or (
                        "descent" in lr and path[0].startswith(("lambda_max", "step_"))):
                    return "n/a"  # not defined for this layer's score (the layer says why)
                x = np.array([_get(h, path) for h in hs])
                return num(float(np.max(x) if how == "max" else np.median(x)))

            lines.append(
                f"| {L} | {'yes' if lr['passed'] else '**NO**'} | "
                f"{col(('identity_float64_rel_max',), 'max')} | "
                f"{col(('float64_vs_native_rel',), 'max')} | "
                f"{int(sum(h['original_gauge_unresolved_queries'] for h in hs))} | "
                f"{col(('model_dtype_vs_native_rel',), 'max')} | "
                f"{col(('model_dtype_vs_native_bound_ratio_max',), 'max')} | "
                f"{col(('kappa_maxkey', 'median'), 'med')} | {col(('sink_mass', 'mean'), 'med')} | "
                f"{col(('lambda_max_query_space', 'median'), 'med')} | "
                f"{col(('lambda_max_input_space', 'median'), 'med')} | "
                f"{col(('step_increases_E_query_space',), 'med')} | "
                f"{col(('step_increases_E_input_space',), 'med')} | "
                f"{col(('reuse', 'rrmse_vs_constant_anchor'), 'med')} | "
                f"{col(('reuse', 'rrmse_vs_cache_mean'), 'med')} |")
        lines += ["", "Tolerances: the float64 identity per query against the readout bound "
                  "`(N + d + 8 + max|s|) u kappa` (docs/math.md section 9); float64 vs the "
                  "model's own float32 output in the max-key gauge (and in the original gauge, whose "
                  "kappa can leave float64 no digits: such queries are counted as unresolved), "
                  "per query against `tolerances.model_dtype_native_bound`; the model-dtype "
                  "max-key readout, per query, against `tolerances.model_dtype_native_bound` (the "
                  "model's own rounding, `agreement_rel_tol` in float32 or `native_rel_tol_lowp` "
                  "in bf16, plus the readout's `identity_check_tol` with that query's max-key "
                  "kappa). The `dtype vs native` column is the worst error relative to the "
                  "head's output scale; `bound ratio` the worst error over its bound.",
                  "", "## Figures", ""]
        for i, (_, title, _) in enumerate(HEATMAPS):
            lines.append(f"![{title}](figures/heatmap_{i:02d}.png)")
        lines.append("![per-layer curves](figures/per_layer.png)")
    env = result["environment"]
    lines += ["", "## Environment", "", f"`{env}`", ""]
    return "\n".join(lines)


def render_figures(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for i, (path, title, log) in enumerate(HEATMAPS):
        layers, vals = grid(result, path)
        show = np.log10(np.maximum(vals, 1e-300)) if log else vals
        fig, ax = plt.subplots(figsize=(6, 0.25 * len(layers) + 1.5))
        im = ax.imshow(show, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(L) for L in layers], fontsize=6)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(("log10 " if log else "") + title, fontsize=8)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / f"heatmap_{i:02d}.png", dpi=110)
        plt.close(fig)
    fig, axs = plt.subplots(1, 3, figsize=(12, 3.2))
    for path, lab in ((("lambda_max_query_space", "median"), "lambda_max query"),
                      (("lambda_max_input_space", "median"), "lambda_max input")):
        layers, vals = grid(result, path)
        axs[0].semilogy(layers, np.median(vals, 1), marker="o", label=lab)
    axs[0].axhline(2.0, color="k", lw=0.8, ls="--")
    axs[0].set_title("median over heads (2: descent threshold)", fontsize=8)
    axs[0].legend(fontsize=7)
    for path, lab in ((("step_increases_E_query_space",), "query space"),
                      (("step_increases_E_input_space",), "input space")):
        layers, vals = grid(result, path)
        axs[1].plot(layers, np.mean(vals, 1), marker="o", label=lab)
    axs[1].set_title("fraction of queries whose unit step increases E", fontsize=8)
    axs[1].legend(fontsize=7)
    for path, lab in ((("reuse", "rrmse_vs_constant_anchor"), "vs constant anchor"),
                      (("reuse", "rrmse_vs_cache_mean"), "vs cache mean")):
        layers, vals = grid(result, path)
        axs[2].plot(layers, np.median(vals, 1), marker="o", label=lab)
    axs[2].set_title("frozen reuse rRMSE (median over heads)", fontsize=8)
    axs[2].legend(fontsize=7)
    for a in axs:
        a.set_xlabel("layer")
    fig.tight_layout()
    fig.savefig(out / "per_layer.png", dpi=110)
    plt.close(fig)


def write_report(result: dict, out: Path, *, figures: bool = True) -> None:
    """``report.json``, then ``report.md`` and ``figures/`` into ``out`` (replaced atomically:
    :func:`ropestep.report.write_rendered`)."""
    from .report import write_rendered

    write_rendered(out, result, render_markdown, render_figures, figures)


# ---------------------------------------------------------------------------------------------
# command line (registered as ``ropestep atlas`` in ropestep.cli)
# ---------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    from .models import add_model_arguments, add_placement_arguments

    add_model_arguments(p)
    add_placement_arguments(p)
    p.add_argument("--corpus", default="default", metavar="wikitext2|PATH|default",
                   help="text the contexts are drawn from [default: the bundled text]")
    p.add_argument("--contexts", type=int, default=4, metavar="C", help="contexts [4]")
    p.add_argument("--len", dest="length", type=int, default=512, metavar="N",
                   help="tokens per context [512]")
    p.add_argument("--layers", default="all", metavar="all|a,b|last", help="layers [all]")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="dtype the model runs in [float32]")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda", help="device [cpu]")
    p.add_argument("--max-bytes", type=int, default=scale.DEFAULT_MAX_BYTES, metavar="B",
                   help="memory budget of the streamed evaluation [1 GiB]")
    p.add_argument("--anchor-every", type=int, default=64, metavar="K",
                   help="frozen-reuse anchors every K positions [64]")
    p.add_argument("--seed", type=int, default=1, help="context-selection seed [1]")
    p.add_argument("--replication", action="store_true",
                   help="only the replication-style descent statistic (query space, final "
                        "query, bank including its own key)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    p.add_argument("--dump-raw", metavar="DIR", default=None,
                   help="also write the raw tensors every statistic is computed from "
                        "(inputs, weights, RoPE tables, the model's own head outputs) and the "
                        "run's config into DIR (docs/protocol.md section 11)")
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="where each finished (context, layer) item is kept as it completes, "
                        "removed once the report is written [OUT.run, beside --out]")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run from its run directory: items already there "
                        "are read back, not recomputed (same configuration and model files "
                        "only; another run's directory is refused)")
    p.add_argument("--plan", action="store_true",
                   help="print the memory and the counted work this run will need, and its "
                        "floor time at this machine's GEMM rate, from the model's config alone "
                        "(no weight is loaded); nothing is written")
    p.add_argument("--out", metavar="DIR", help="report directory (required unless --plan)")


def main_args(args, argv: Sequence[str]) -> int:
    """Handler of ``ropestep atlas``: 0 pass, 1 a check failed, 2 bad input."""
    from . import models, protocol
    from .corpus import CorpusError
    prog = "ropestep atlas"

    def bad(err: BaseException) -> int:
        return input_error(prog, err)

    if args.plan:
        return _plan_main(args, bad)
    if args.out is None:
        return bad(AtlasError("--out DIR is required (unless --plan)"))
    out = Path(args.out)
    problem = output_and_threads_problem(out, args.threads)
    if problem is not None:
        return bad(problem)
    dump_raw = None if args.dump_raw is None else Path(args.dump_raw)
    if dump_raw is not None and dump_raw.exists() and not dump_raw.is_dir():
        return bad(AtlasError(f"--dump-raw {args.dump_raw}: exists and is not a directory"))
    if dump_raw is not None and args.resume:
        return bad(AtlasError("--dump-raw writes the inputs of every item as it computes them: "
                              "not with --resume (run without it)"))
    run_dir = Path(args.run_dir) if args.run_dir is not None else \
        out.parent / (out.name + ".run")
    if run_dir.resolve() == out.resolve():
        return bad(AtlasError("--run-dir must not be the report directory (--out)"))
    try:
        place = models.placement(args.device_map, args.max_memory, args.offload_folder)
    except models.ModelLoadError as err:
        return bad(err)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = AtlasConfig(model=args.model, revision=args.revision, gguf=args.gguf,
                      corpus=args.corpus, contexts=args.contexts, length=args.length,
                      layers=args.layers, dtype=args.dtype, device=args.device, seed=args.seed,
                      anchor_every=args.anchor_every, max_bytes=args.max_bytes,
                      replication_only=args.replication)
    try:  # before the process group: a bad --device must not reach torch.device()
        check_config(cfg)
    except AtlasError as err:
        return bad(err)
    synced = False
    scratch = None
    if place is not None and place["device_map"] == "auto" and "offload_folder" not in place:
        scratch = tempfile.mkdtemp(prefix="ropestep-offload-")  # removed below, whatever happens
        place["offload_folder"] = scratch
    try:
        rank, world, _ = init_distributed(None, "cpu" if args.device == "cpu" else args.device)
        try:
            result = run(cfg, progress=not args.quiet,
                         command=launcher_command(["ropestep", *argv]),
                         dist_info=(rank, world), dump_raw=dump_raw, run_dir=run_dir,
                         resume=args.resume, placement=place)
        except (AtlasError, protocol.ProtocolError, CorpusError, models.ModelLoadError,
                models.UnsupportedModelError) as err:
            return bad(err)
        code = 0
        if rank == 0:
            write_report(result, out, figures=not args.no_figures)
            shutil.rmtree(run_dir, ignore_errors=True)  # the report holds it all now
            code = 0 if result["verdict"]["passed"] else 1
        code = broadcast_from_rank0(code, rank, world)
        synced = True
        if rank != 0:
            return code
    finally:
        finish(barrier=synced)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if not args.quiet:
        rep = result["replication_style_descent"]
        for L, r in rep["per_layer"].items():
            print(f"layer {L}: unit step increases E (query space, final query) in "
                  f"{r['increase']} of {r['heads']} heads")
        print(f"pooled: {rep['pooled']['increase']} of {rep['pooled']['heads']} heads; wrote "
              f"{out}/report.json and report.md")
    if not result["verdict"]["passed"]:
        for f in result["verdict"]["failed"]:
            sys.stderr.write(f"{prog}: FAIL {f}\n")
        return 1
    return 0


def _plan_main(args: Any, bad: Any) -> int:
    """``--plan``: the estimate, printed; 0, or 2 on bad input."""
    from . import models, protocol

    cfg = AtlasConfig(model=args.model, revision=args.revision, gguf=args.gguf,
                      contexts=args.contexts, length=args.length, layers=args.layers,
                      dtype=args.dtype, device=args.device, max_bytes=args.max_bytes)
    try:
        check_config(cfg)
        place = models.placement(args.device_map, args.max_memory, args.offload_folder)
        budget = None if place is None else (place.get("max_memory") or {}).get("cpu")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        print(render_plan(plan(cfg, budget)))
    except (AtlasError, protocol.ProtocolError, models.ModelLoadError,
            models.UnsupportedModelError) as err:
        return bad(err)
    return 0


def same_report(a: dict, b: dict) -> bool:
    """True when two atlas reports agree in every number (timing, run and environment aside;
    of ``cost``, the counted work only: its seconds and rates are the machine's)."""
    skip = {"run", "timing_seconds", "environment", "peak_rss_mib", "command", "cost"}

    def counted(r: dict) -> Any:
        c = r.get("cost")
        return None if c is None else {k: v["flops"] for k, v in c["phases"].items()}

    return {k: v for k, v in a.items() if k not in skip} == \
        {k: v for k, v in b.items() if k not in skip} and counted(a) == counted(b)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ropestep.atlas ...`` (what torchrun launches); same as ``ropestep atlas``."""
    from .verdict import module_main

    return module_main("atlas", __doc__, add_arguments, main_args, argv)


if __name__ == "__main__":
    _code = main()
    if under_launcher():
        exit_worker(_code)
    sys.exit(_code)
