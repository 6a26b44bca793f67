"""One context at one layer of the paper's protocol (``ropestep validate``): the shared-position
setting, every candidate next token at the block's last position on the prefix bank.

:class:`ContextCapture` holds what the model says about one block (the library's
:meth:`ropestep.api.Attached.run_candidates` captures it, :func:`context_capture` takes it in as
float32 rows); :func:`evaluate_layer` computes every measurement of one layer on it -- the
identity on the prefix bank and on the full bank (self included) against the model's own writes,
the fast path in float32 and bfloat16, frozen reuse from every anchor, the calibration at anchor
0 and the descent statistics -- as a :class:`LayerContext` that ``validate`` pools over its
contexts (:func:`ropestep.protocol.summarize_layer`).  What each number is: docs/protocol.md.

Layering: below the public API (which computes through it: :meth:`ropestep.api.CandidateRun.evaluate`)
and so below the commands; above the fast paths and the reuse statistics (import-linter contract
in pyproject.toml).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from . import fast
from . import reuse_stats as rs
from .corpus import Block

# notebook tolerances (docs/protocol.md, "Reconstruction results"), numpy.allclose form
# (atol, rtol): identity 2e-9 / 2e-8 per head and 3e-9 / 3e-8 for the summed write (the
# notebook's projected check), native head vs float64 formula 3e-5 / 3e-4.  A bfloat16 model
# rounds q, k, v, the scores, the probabilities and the output to 8 significant bits (unit
# roundoff u = 2^-9); a score s carries an absolute rounding of ~|s| u, which the softmax turns
# into a *relative* change of the weights, so elementwise float32-style tolerances do not
# apply.  The bf16 criterion is normwise: max |formula - native| <= 2^-3 max |native| (64 u;
# SmolLM2 measures up to 7% at |s| ~ 30), which a wrong formula (normwise errors O(1)) fails.
TOLERANCES = {
    "identity_head": (2e-9, 2e-8),
    "identity_write": (3e-9, 3e-8),
    # the notebook's further float64 assertions: the prefix/full relation
    # y_full = (1 - pi) y_prefix + pi v_self, and each head's own projected write y_h W_o,h
    # against the projection of its identity readout; both at the summed write's tolerance
    "relation": (3e-9, 3e-8),
    "projected_write": (3e-9, 3e-8),
    "native": {"float32": {"atol": 3e-5, "rtol": 3e-4},
               "bfloat16": {"normwise": 0.125}},
}


def native_ok(actual: Any, native: Any, model_dtype: str) -> bool:
    """The native-write pass criterion of :data:`TOLERANCES` for the model's dtype."""
    t = TOLERANCES["native"][model_dtype]
    if "normwise" in t:
        a, b = np.asarray(_f64(actual)), np.asarray(_f64(native))
        return bool(np.abs(a - b).max() <= t["normwise"] * np.abs(b).max())
    return rs.allclose_report(actual, native, t["atol"], t["rtol"])


@dataclass
class Rows:
    """Activations of one layer over some token rows (float32, CPU)."""

    x: torch.Tensor  # (n, m) input_layernorm output = head input
    heads: torch.Tensor  # (n, H, r) per-head attention output = o_proj input
    o: torch.Tensor  # (n, hidden) o_proj output (in head space where a norm or gate sits
    # between the heads and o_proj: the concatenated heads)
    self_mass: torch.Tensor | None = None  # (n, H) the model's own probability on its own key
    write: torch.Tensor | None = None  # (n, hidden) the o_proj output where o is in head space


@dataclass
class ContextCapture:
    """Everything the model says about one block, for the requested layers."""

    block: Block
    observed: int
    candidates: list[int]  # Q token ids, [observed] + Q-1 highest-logit alternatives
    logits: np.ndarray  # (vocab,) float32 at the last prefix position
    prefix: dict  # layer -> Rows over positions 0..L-2 (the bank)
    queries: dict  # layer -> Rows, Q rows at position L-1 (single-token steps on the prefix cache)
    observed_full: dict  # layer -> (heads (H, r), o (hidden,)) of the full forward over the block
    # layer -> (x (m,), write (hidden,)) of the observed token in that forward, where o is in head
    # space (a norm or gate in between): the model's own write, for a read output gate
    observed_write: dict = field(default_factory=dict)


def context_capture(block: Block, bc: Any, layers: Sequence[int]) -> ContextCapture:
    """The protocol's float32 rows of a :class:`ropestep.models.BlockCapture` of ``block``:
    the bank (positions ``0..L-2``), the observed token's native write at ``L-1`` (full
    forward) and every candidate's row at ``L-1`` (on the prefix cache)."""
    def rows(c: Any, sl: slice = slice(None)) -> Rows:
        sm = None if c.self_mass is None else c.self_mass[sl].float()
        wr = None if getattr(c, "write", None) is None else c.write[sl].float()
        return Rows(x=c.x[sl].float(), heads=c.heads[sl].float(), o=c.o[sl].float(),
                    self_mass=sm, write=wr)

    prefix = {L: rows(bc.full[L], slice(None, -1)) for L in layers}
    obs = {L: (bc.full[L].heads[-1].float().clone(), bc.full[L].o[-1].float().clone())
           for L in layers}
    queries = {L: rows(bc.queries[L]) for L in layers}
    ow = {L: (bc.full[L].x[-1].float().clone(), bc.full[L].write[-1].float().clone())
          for L in layers if getattr(bc.full[L], "write", None) is not None}
    return ContextCapture(block=block, observed=int(block.ids[-1]),
                          candidates=bc.candidates.tolist(), logits=bc.logits.float().numpy(),
                          prefix=prefix, queries=queries, observed_full=obs, observed_write=ow)


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


def _err(a: Any, b: Any) -> dict:
    return {"mse": rs.mse(a, b), "max_abs": rs.max_abs(a, b)}


def project(y: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Per-head projected writes ``y_h W_o,h``: ``(..., H, Q, r) -> (..., H, Q, D)``."""
    return torch.einsum("...hqr,hrd->...hqd", y, w_o)


def explicit_readout(st: fast.Step, x_q: torch.Tensor) -> torch.Tensor:
    """``mu_i + u_i^T dM_i`` with the materialised matrices: ``(H, Q, r)``.  A head whose score
    is not affine in ``u`` (QK-norm) has no ``dM_i``: its readout is the query-space one,
    ``mu_i + z_i^T dM^q_i`` (:func:`ropestep.fast.query_input`, :func:`~ropestep.fast.query_delta_m`;
    docs/math.md section 8)."""
    if st.delta_m is None:
        return st.mu + torch.einsum("hqd,hqdr->hqr", fast.query_input(st), fast.query_delta_m(st))
    u = fast.augment(x_q.to(st.delta_m.dtype))
    return st.mu + torch.einsum("qm,hqmr->hqr", u, st.delta_m)


@dataclass
class LayerContext:
    """Numbers of one context at one layer (arrays for pooling; dicts for the report)."""

    rows: list  # reconstruction rows (per head + combined)
    fast_rows: dict  # "<dtype>/<gauge>" -> {"heads": [...], "combined": {...}}
    reuse_errors: dict  # "combined" -> {pred: (A,)}, "heads" -> {pred: (H, A)}
    reuse_target: dict  # "combined" -> (A,), "heads" -> (H, A)
    calib: dict  # per-query arrays at anchor 0
    gain: dict  # residual/direction rows for the pooled gamma fit
    checks: dict  # tokenwise agreement, bound violations, anchor-0 cross-check
    descent: dict  # lam_max, e0, e1 (H, Q)


def evaluate_layer(spec, weights, cap: ContextCapture, layer: int, model_dtype: str,
                   device: Any = "cpu", gate: Any = None) -> LayerContext:
    """All measurements of one context at one layer (float64 unless stated).

    ``gate``: the layer's output gate (:func:`ropestep.models.layer_gate`) where the write is
    taken in head space because a gate sits between the heads and the output projection: the
    combined row then also carries ``native_gated_write``, the gate applied after the heads'
    output the identity reconstructs and projected, against the model's own write (every
    candidate's, and the observed token's in the block's forward), with its pass flag
    ``pass_gated_write`` (the native criterion)."""
    f64 = torch.float64
    pre, qry = cap.prefix[layer], cap.queries[layer]
    xp = pre.x.to(device, f64)  # (N, m)
    xq = qry.x.to(device, f64)  # (Q, m)
    N, Q = xp.shape[0], xq.shape[0]
    H = spec.n_heads
    pos_kv = torch.arange(N)
    pos_q = torch.full((Q,), N, dtype=torch.long)
    w_o = torch.as_tensor(weights.w_o).to(device, f64)  # (H, r, D)
    b_o = None if weights.b_o is None else torch.as_tensor(weights.b_o).to(device, f64)

    # -- prefix bank (the paper's conditional readout) and full bank (native: self included) --
    affine = spec.affine  # else (QK-norm) every matrix is the query-space one (section 8)
    stP = fast.step(spec, weights, xq, pos_q, xp, pos_kv, mask="bank", dtype=f64, device=device,
                    delta_m=affine)
    x_full = torch.cat((xp, xq))
    pos_full = torch.cat((pos_kv, pos_q))
    mask_full = torch.zeros(Q, N + Q, dtype=torch.bool)
    mask_full[:, :N] = True
    mask_full[torch.arange(Q), N + torch.arange(Q)] = True
    stF = fast.step(spec, weights, xq, pos_q, x_full, pos_full, mask=mask_full, dtype=f64,
                    device=device, delta_m=affine)
    rdP, rdF = explicit_readout(stP, xq), explicit_readout(stF, xq)

    PF = stF.extras["projected"]
    idx_self = N + torch.arange(Q, device=PF.v.device)
    v_self = PF.v[:, idx_self]  # (H, Q, r): head h's value of query i's own token
    s_self = stF.s[:, torch.arange(Q), idx_self]  # (H, Q)
    pi = fast.self_mass(s_self, stP.s, spec.softcap, stP.mask)
    y_rel = fast.prefix_full(stP.y, v_self, pi)
    mu_rel = fast.full_bank_mean(stP.mu, v_self, stP.mask.sum(-1))  # permitted prefix keys

    native = qry.heads.permute(1, 0, 2).to(device, f64)  # (H, Q, r)
    native_o = qry.o.to(device, f64)  # (Q, D)
    obs_h, obs_o = cap.observed_full[layer]
    obs_h, obs_o = obs_h.to(device, f64), obs_o.to(device, f64)

    def write(y: torch.Tensor) -> torch.Tensor:  # (H, Q, r) -> (Q, D), o_proj bias included
        o = project(y, w_o).sum(0)
        return o if b_o is None else o + b_o

    ti, tw = TOLERANCES["identity_head"], TOLERANCES["identity_write"]
    trel, tpw = TOLERANCES["relation"], TOLERANCES["projected_write"]
    # the model's own self-attention mass of each candidate (eager weights on its own key)
    pi_native = None if qry.self_mass is None else qry.self_mass.T.to(device, f64)  # (H, Q)
    pwP, pwPr = project(stP.y, w_o), project(rdP, w_o)  # (H, Q, D) each head's own write
    pwF, pwFr = project(stF.y, w_o), project(rdF, w_o)
    rows = []
    for h in range(H):
        r = {"head": h,
             "prefix": _err(stP.y[h], rdP[h]), "full": _err(stF.y[h], rdF[h]),
             "relation_max_abs": rs.max_abs(y_rel[h], stF.y[h]),
             "mean_max_abs": rs.max_abs(mu_rel[h], stF.mu[h]),
             "projected_prefix": _err(pwP[h], pwPr[h]), "projected_full": _err(pwF[h], pwFr[h]),
             "self_mass_mean": float(pi[h].mean()),
             "self_mass_vs_native_max_abs": (math.nan if pi_native is None
                                             else rs.max_abs(pi[h], pi_native[h])),
             "native": _err(rdF[h], native[h]),
             "native_observed_full_forward": _err(rdF[h, 0], obs_h[h]),
             "cache_vs_full_forward_max_abs": rs.max_abs(native[h, 0], obs_h[h])}
        r["pass_identity"] = (rs.allclose_report(rdP[h], stP.y[h], *ti)
                              and rs.allclose_report(rdF[h], stF.y[h], *ti))
        r["pass_relation"] = rs.allclose_report(y_rel[h], stF.y[h], *trel)
        r["pass_projected_write"] = (rs.allclose_report(pwPr[h], pwP[h], *tpw)
                                     and rs.allclose_report(pwFr[h], pwF[h], *tpw))
        r["pass_self_mass"] = (pi_native is not None
                               and native_ok(pi[h], pi_native[h], model_dtype))
        r["pass_native"] = (native_ok(rdF[h], native[h], model_dtype)
                            and native_ok(rdF[h, 0], obs_h[h], model_dtype))
        rows.append(r)
    oP, oPr, oF, oFr = write(stP.y), write(rdP), write(stF.y), write(rdF)
    comb = {"head": "combined", "prefix": _err(oP, oPr), "full": _err(oF, oFr),
            "relation_max_abs": rs.max_abs(write(y_rel), oF),
            "native": _err(oFr, native_o),
            "native_observed_full_forward": _err(oFr[0], obs_o),
            "cache_vs_full_forward_max_abs": rs.max_abs(native_o[0], obs_o)}
    comb["pass_identity"] = (rs.allclose_report(oPr, oP, *tw) and rs.allclose_report(oFr, oF, *tw))
    comb["pass_relation"] = rs.allclose_report(write(y_rel), oF, *trel)
    comb["pass_native"] = (native_ok(oFr, native_o, model_dtype)
                           and native_ok(oFr[0], obs_o, model_dtype))
    if gate is not None:  # the read gate applied after the reconstructed heads, then o_proj
        if qry.write is None:
            raise ValueError(f"layer {layer}: a gated layer's capture holds no model write")
        gw, mw = gate.write(xq, rdF), qry.write.to(device, f64)
        ok = native_ok(gw, mw, model_dtype)
        if layer in cap.observed_write:  # the observed token's write in the block's forward
            xo, wo = (t.to(device, f64) for t in cap.observed_write[layer])
            go = gate.write(xo[None], rdF[:, :1])
            ok = ok and native_ok(go, wo[None], model_dtype)
            gw, mw = torch.cat((gw, go)), torch.cat((mw, wo[None]))
        comb["native_gated_write"] = _err(gw, mw)
        comb["pass_gated_write"] = ok
    rows.append(comb)

    # -- fast path in float32 and bfloat16, both gauges, full bank --
    fast_rows = {}
    for dname, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        for gauge in ("original", "maxkey"):
            key = f"{dname}/{gauge}"
            try:
                st = fast.step(spec, weights, xq, pos_q, x_full, pos_full, mask=mask_full,
                               dtype=dt, device=device, gauge=gauge, keep=())
            except FloatingPointError as err:
                fast_rows[key] = {"error": " ".join(str(err).split())}
                continue
            rd = st.readout.to(f64)
            fast_rows[key] = {
                "heads": [{"head": h, "vs_float64": _err(rd[h], stF.y[h]),
                           "vs_native": _err(rd[h], native[h]),
                           "identity": _err(st.y[h].to(f64), rd[h])} for h in range(H)],
                "combined": {"vs_float64": _err(write(rd), oF),
                             "vs_native": _err(write(rd), native_o)},
                # the readout sum's condition number (fast.Step.kappa): digits it can lose
                "kappa": {"median": float(st.kappa.median()), "max": float(st.kappa.max())}}

    # -- frozen reuse on the prefix bank --
    y, mu = stP.y, stP.mu  # (H, Q, r)
    P = stP.extras["projected"]
    reuse0 = fast.frozen_reuse(stP, anchor=0, bound=False)
    bound0 = fast.reuse_bound(stP, anchor=0)  # (H, Q)
    tb = stP.t  # (H, Q, d, r)
    frozen_all = mu[None] + torch.einsum("hid,hadr->ahir", P.q, tb)  # (A, H, Q, r)
    if stP.b is not None:
        frozen_all = frozen_all + stP.b.permute(1, 0, 2)[:, :, None, :]
    # linearised softmax: mu + (1/N) sum_j s_ij (v_j - mu), raw scores s_ij = u_i . a_j
    lin = mu + (stP.s @ P.v) / N - mu * stP.s.mean(-1, keepdim=True)
    oh = project(y, w_o)  # (H, Q, D) per-head targets
    preds_h = {"mean": project(mu, w_o), "linear": project(lin, w_o),
               "frozen": project(frozen_all, w_o)}  # (H,Q,D) / (A,H,Q,D)
    errs_h: dict[str, np.ndarray] = {"constant": np.stack([rs.constant_errors(_f64(oh[h]))
                                                           for h in range(H)])}
    for k in ("mean", "linear"):
        errs_h[k] = np.stack([rs.errors_by_anchor(_f64(preds_h[k][h]), _f64(oh[h]))
                              for h in range(H)])
    errs_h["frozen"] = np.stack([rs.errors_by_anchor(_f64(preds_h["frozen"][:, h]), _f64(oh[h]))
                                 for h in range(H)])
    o = oh.sum(0)
    errs_c = {"constant": rs.constant_errors(_f64(o)),
              "mean": rs.errors_by_anchor(_f64(preds_h["mean"].sum(0)), _f64(o)),
              "linear": rs.errors_by_anchor(_f64(preds_h["linear"].sum(0)), _f64(o)),
              "frozen": rs.errors_by_anchor(_f64(preds_h["frozen"].sum(1)), _f64(o))}
    tgt_h = np.stack([rs.target_ms(_f64(oh[h])) for h in range(H)])
    tgt_c = rs.target_ms(_f64(o))

    # -- calibration at anchor 0 --
    e = reuse0.error  # (H, Q, r)
    rel = rs.relative_error(_f64(e), _f64(y), _f64(mu))  # (H, Q)
    p_attn = torch.softmax(stP.s, -1)
    dist = {"score_sup": rs.score_distance(_f64(stP.s)), "tv": rs.tv_distance(_f64(p_attn)),
            "input": np.broadcast_to(rs.input_distance(_f64(xq)), (H, Q)).copy()}
    e_o = project(e, w_o).sum(0)  # (Q, D)
    rel_c = rs.relative_error(_f64(e_o), _f64(o), _f64(preds_h["mean"].sum(0)))
    g = reuse0.frozen - mu  # u_i^T dM_0
    checks = {
        "tokenwise_rel": [rs.normwise_agreement(_f64(reuse0.tokenwise[h, 1:]), _f64(e[h, 1:]))
                          for h in range(H)],
        "frozen_crosscheck_max_abs": rs.max_abs(frozen_all[0], reuse0.frozen),
        # queries i != 0; slack for the rounding of e_i itself (the anchor's e_0 ~ 1e-15, bound 0)
        "bound_violations": [int((torch.linalg.vector_norm(e[h, 1:], dim=-1)
                                  > bound0[h, 1:] * (1 + 1e-9)
                                  + 1e-12 * float(y[h].abs().max())).sum())
                             for h in range(H)],
        "refresh_identity_max_abs": rs.max_abs(reuse0.frozen + reuse0.tokenwise, y),
        # both are float64 identities of the same terms as the reconstruction: same tolerance
        "frozen_crosscheck_pass": rs.allclose_report(frozen_all[0], reuse0.frozen, *ti),
        "refresh_identity_pass": rs.allclose_report(reuse0.frozen + reuse0.tokenwise, y, *ti),
    }
    calib = {"rel": rel, "rel_combined": rel_c, **dist}
    gain = {"r": _f64(y - mu)[:, 1:], "g": _f64(g)[:, 1:],  # (H, Q-1, r)
            "r_o": _f64(o - preds_h["mean"].sum(0))[1:], "g_o": _f64(project(g, w_o).sum(0))[1:]}

    # -- descent check: input space (the paper's), query space on the same prefix bank, and the
    # replication's measurement (query space, the context's final query = the observed token,
    # on the full bank including its own key)
    dq = fast.query_descent(stP)
    dr = fast.query_descent(stF)
    descent = {"q_lam_max": _f64(dq.lam_max), "q_e0": _f64(dq.e0), "q_e1": _f64(dq.e1),
               "rep_lam_max": _f64(dr.lam_max[:, 0]),
               "rep_increases": _f64(dr.e1[:, 0] > dr.e0[:, 0])}
    if affine:  # the paper's input-space step exists only where the score is affine in u
        dc = fast.descent(stP)
        descent.update(lam_max=_f64(dc.lam_max), e0=_f64(dc.e0), e1=_f64(dc.e1))

    return LayerContext(rows=rows, fast_rows=fast_rows,
                        reuse_errors={"combined": errs_c, "heads": errs_h},
                        reuse_target={"combined": tgt_c, "heads": tgt_h},
                        calib=calib, gain=gain, checks=checks, descent=descent)
