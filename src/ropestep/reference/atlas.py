"""``ropestep atlas``'s report recomputed from its ``--dump-raw`` directory (docs/protocol.md
section 11), independently of the code that wrote it.

Written from that section alone.  One query at a time, in the paper's form wherever there is a
choice, so that nothing is shared with the fast layer (which works in query space, streamed over
chunks of queries):

* the head output ``y_i`` is the oracle: mpmath at ``dps`` digits from the float64 scores and
  values (the only rounding left in it is that of the float64 projections, far below every
  tolerance it is compared under);
* the input-space features ``a_ij = tau L_i k~_j^T`` are formed explicitly in ``R^(m+1)``,
  ``Delta M_i = sum_j c_ij a_ij (v_j - mu_i)^T`` is materialised, and the frozen readout is
  ``mu_a + u_i^T Delta M_a``;
* ``lambda_max`` of ``H = sum_j c_j a_j a_j^T`` is the largest eigenvalue of the ``n x n`` Gram
  matrix ``sqrt(c_j c_k) a_j . a_k`` (the same non-zero spectrum), not of a ``d x d`` form;
* the condition numbers, bounds and statistics follow the section's formulas in float64.

Per-query products are written with ``np.einsum`` (its own loops, one thread): these matrices are
small, and a threaded BLAS on a shared machine spends longer waiting than computing them.

The readouts' own errors ``e^id`` and ``e^lpid`` are rounding errors; their exact value, which is
what a reference can give, is 0.  ``e^nat``, ``e^orig`` and ``e^lp`` all have the exact value
``max_l |y_il - y^_il|``.  ``kappa*`` is evaluated in float64; where the largest score of a row
is within ``maxkey_tie`` of another, the model-dtype evaluation may have taken either key as
``j*``, so :func:`recompute` also summarises with the smallest and the largest ``kappa*`` over
those candidates (``Reference.low`` and ``Reference.high``).

Limits: float32 runs only (the dump of a bfloat16 model holds bf16 tensors, which numpy cannot
read); a row whose original-gauge coefficients leave the float64 range raises ``ValueError``
(the atlas then records a partial pass whose extent depends on its chunking).

Imports: numpy, mpmath and safetensors' numpy reader; nothing of ropestep and not torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import mpmath as mp
import numpy as np
from safetensors.numpy import load_file

MANIFEST, SCHEMA = "atlas_raw.json", "ropestep.atlas-raw/1"
U64, U32 = 2.0 ** -53, 2.0 ** -24  # unit roundoffs of float64 and float32
LN_F32_MAX = math.log(3.4028234663852886e38)  # ln of float32's largest finite number
ID_FLOOR = 1e-12  # floor of b^id
ME_FLOOR = 1e-300  # floor of me_i under the square root of eps_i
DIRECT_KEYS, MIN_CHUNK = 64, 32  # the stream's chunk rule (N')
CHECKS = ("identity_float64", "float64_vs_native", "float64_original_gauge_vs_native",
          "model_dtype_vs_native", "finite")


# ---------------------------------------------------------------------------------------------
# the dump
# ---------------------------------------------------------------------------------------------
@dataclass
class Dump:
    """A ``--dump-raw`` directory: the manifest and the tensors, read on demand."""

    path: Path
    manifest: dict

    def layer(self, layer: int) -> dict[str, np.ndarray]:
        return load_file(str(self.path / f"layer{layer}.safetensors"))

    def item(self, context: int, layer: int) -> dict[str, np.ndarray]:
        return load_file(str(self.path / f"context{context}_layer{layer}.safetensors"))


def load(path: str | Path) -> Dump:
    """Open a dump; refuse what this reference does not cover (another schema, a bf16 run)."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an atlas raw dump (schema {manifest.get('schema')!r})")
    if manifest["config"]["dtype"] != "float32":
        raise ValueError(f"{path}: the reference covers float32 runs, this one is "
                         f"{manifest['config']['dtype']}")
    # the projections below have no QK-norm, latent, clip or sink step: the plain dot-product
    # score only (a dump of another family would be recomputed as a plain head and disagree)
    bad = [L for L, f in manifest["layers"].items() if f.get("family") != "dot"]
    if bad:
        raise ValueError(f"{path}: layer {bad[0]} is of the "
                         f"{manifest['layers'][bad[0]].get('family')!r} family; the atlas "
                         "reference covers the 'dot' family only")
    for L, f in manifest["layers"].items():  # a causal, uncapped, sink-free, unclipped score
        extra = [k for k in ("window", "chunk", "softcap", "clip", "query_temperature")
                 if f.get(k) is not None]
        extra += [k for k in ("sinks", "alibi") if f.get(k)]
        if extra:
            raise ValueError(f"{path}: layer {L} has {', '.join(extra)}; the atlas reference "
                             "covers plain causal heads only")
    return Dump(path, manifest)


# ---------------------------------------------------------------------------------------------
# one head of one (context, layer) item: every per-query quantity
# ---------------------------------------------------------------------------------------------
def rotate(z: np.ndarray, cos: np.ndarray, sin: np.ndarray, layout: str) -> np.ndarray:
    """``rot(z, p)`` of rows ``z (..., d)`` with table rows ``cos``/``sin (..., d/2)``."""
    if layout == "half":
        h = z.shape[-1] // 2
        z1, z2 = z[..., :h], z[..., h:]
        return np.concatenate((z1 * cos - z2 * sin, z2 * cos + z1 * sin), axis=-1)
    z1, z2 = z[..., 0::2], z[..., 1::2]
    return np.stack((z1 * cos - z2 * sin, z2 * cos + z1 * sin), axis=-1).reshape(z.shape)


def rho(s: np.ndarray) -> np.ndarray:
    """``(e^s - 1)/s`` with ``rho(0) = 1``."""
    safe = np.where(s == 0, 1.0, s)
    return np.where(s == 0, 1.0, np.expm1(safe) / safe)


def augmented(w: np.ndarray, b: np.ndarray | None, head: int) -> np.ndarray:
    """``W^ = [W; b^T]`` of one head, ``(m+1, d)``; a missing bias is a zero row."""
    row = np.zeros(w.shape[-1]) if b is None else b[head]
    return np.vstack((w[:, head], row))


def softmax_output(s: np.ndarray, v_columns: list[list], dps: int) -> np.ndarray:
    """The oracle ``y_i = sum_j e^(s_j) v_j / Z`` in mpmath at ``dps`` digits, as float64."""
    n = len(s)
    with mp.workdps(dps):
        top = mp.mpf(float(np.max(s)))
        w = [mp.exp(mp.mpf(float(x)) - top) for x in s]
        z = mp.fsum(w)
        return np.array([float(mp.fdot(w, col[:n]) / z) for col in v_columns])


@dataclass
class Step:
    """The unit step of one query in one parametrisation."""

    lam: float  # lambda_max(H)
    flag: float  # 1.0 when E(B) - E(0) > 0
    margin: float  # (quad - |B|^2)/(quad + |B|^2); inf for B = 0, which no rounding moves
    cond: float  # sum_j c_j |a_j| |t_j| / |B|_F: the condition number of the sum B (0 for B = 0)
    B: np.ndarray


def unit_step(a: np.ndarray, c: np.ndarray, t: np.ndarray) -> Step:
    """One gradient step of ``E(B) = 1/2 sum_j c_j |a_j^T B - t_j|^2`` from ``B = 0``:
    ``lambda_max`` of ``H = sum_j c_j a_j a_j^T`` (from the ``n x n`` Gram matrix of the weighted
    features), and whether ``E(B) - E(0) = 1/2 sum_j c_j |a_j^T B|^2 - |B|^2_F > 0`` for
    ``B = sum_j c_j a_j t_j^T``."""
    wa = np.sqrt(c)[:, None] * a
    lam = float(np.linalg.eigvalsh(np.einsum("jl,kl->jk", wa, wa))[-1])
    B = np.einsum("jl,jr->lr", a, c[:, None] * t)
    quad = 0.5 * float(np.sum(c * np.sum(np.einsum("jl,lr->jr", a, B) ** 2, axis=1)))
    norm = float(np.sum(B * B))
    if norm == 0.0:
        return Step(lam, 0.0, math.inf, 0.0, B)
    terms = np.sum(c * np.linalg.norm(a, axis=1) * np.linalg.norm(t, axis=1))
    return Step(lam, float(quad > norm), (quad - norm) / (quad + norm), terms / math.sqrt(norm), B)


def kappa(coef: np.ndarray, absdot: np.ndarray, vn: np.ndarray, S: float) -> float:
    """``sum_j |c_j| absdot_j vn_j / S`` (docs/math.md section 9)."""
    return float(np.sum(np.abs(coef) * absdot * vn) / S)


@dataclass
class HeadItem:
    """One head of one item, projected (float64)."""

    u: np.ndarray  # (N, m+1) augmented inputs
    pos: np.ndarray  # (N,) int
    wq: np.ndarray  # (m+1, d) W^_q of the head
    q: np.ndarray  # (N, d) effective queries (rotated, times tau)
    k: np.ndarray  # (N, d) rotated keys of its KV head
    v: np.ndarray  # (N, r) values
    native: np.ndarray  # (N, r) the model's own output of the head
    cos: np.ndarray  # (P, d/2)
    sin: np.ndarray
    tau: float
    layout: str


def head_item(item: dict, lay: dict, facts: dict, h: int) -> HeadItem:
    """Project one head of one item as docs/protocol.md section 11 says (float64)."""
    x = item["x"].astype(np.float64)
    pos = item["positions"].astype(np.int64)
    g = h // (facts["n_heads"] // facts["n_kv_heads"])
    u = np.hstack((x, np.ones((x.shape[0], 1))))
    cos, sin, tau = lay["cos"], lay["sin"], float(lay["score_scale"][h])
    wq = augmented(lay["w_q"], lay.get("b_q"), h)
    q = tau * rotate(np.einsum("im,ml->il", u, wq), cos[pos], sin[pos], facts["layout"])
    k = rotate(np.einsum("im,ml->il", u, augmented(lay["w_k"], lay.get("b_k"), g)), cos[pos],
               sin[pos], facts["layout"])
    v = np.einsum("im,ml->il", u, augmented(lay["w_v"], lay.get("b_v"), g))
    return HeadItem(u, pos, wq, q, k, v, item["native"][:, h].astype(np.float64), cos, sin, tau,
                    facts["layout"])


ROW_FIELDS = ("n", "n_chunk", "sigma", "kappa", "kappa_mk", "kappa_mk_lo", "kappa_mk_hi", "V",
              "Y", "e_nat", "spread", "sink", "lam_q", "f_q", "margin_q", "cond_q", "lam_in",
              "f_in", "margin_in", "cond_in", "anchor", "fr", "co", "me", "tv", "eps", "kappa_fr")
"""Per-query quantities of one head (docs/protocol.md section 11): ``n = N_i``, ``n_chunk =
N'``, ``sigma``, ``kappa``, ``kappa_mk`` (at the argmax; ``_lo``/``_hi`` over the near-tied
candidates), ``V``, ``Y``, ``e_nat`` (the exact value of ``e^nat``, ``e^orig`` and ``e^lp``),
``spread``, ``sink``, ``lam_*``, ``f_*`` with their relative ``margin_*`` and the step's
condition number ``cond_*`` (:class:`Step`), ``anchor`` (1 on the anchors' rows), ``fr``,
``co``, ``me``, ``tv``, ``eps`` (NaN on the anchors' rows), and, for tolerances, the frozen
readout's condition number ``kappa_fr`` (the anchor's terms, read with query ``i``'s input at
the anchor's position)."""


def chunk_end(i: int, N: int) -> int:
    """``N'`` of query ``i``: the end of its chunk in the stream (docs/protocol.md section 11)."""
    D = min(N, DIRECT_KEYS)
    qc = min(N, max(MIN_CHUNK, -(-N // 16)))
    if i < D:
        return min(qc * (i // qc + 1), D)
    return min(D + qc * ((i - D) // qc + 1), N)


@dataclass
class Anchor:
    """What the later queries of an anchor's window read: its matrix, mean, output and row."""

    delta_m: np.ndarray  # (m+1, r)
    mu: np.ndarray
    y: np.ndarray
    p: np.ndarray  # (n_a,) attention row
    c: np.ndarray  # (n_a,) original-gauge coefficients
    vn: np.ndarray  # (n_a,) |v_j - mu|_inf + |v_j|_inf
    S: float
    pos: int


def head_rows(hi: HeadItem, anchor_every: int, maxkey_tie: float, dps: int,
              where: str) -> dict[str, np.ndarray]:
    """Every per-query quantity (:data:`ROW_FIELDS`) of one head of one item, query by query."""
    N, r = hi.v.shape
    if not np.array_equal(hi.pos, np.arange(N)):
        raise ValueError(f"{where}: positions are not 0..N-1")
    out = {name: np.full(N, np.nan) for name in ROW_FIELDS}
    out["V"][:], out["Y"][:] = np.abs(hi.v).max(), np.abs(hi.native).max()
    v_columns = [[mp.mpf(float(e)) for e in col] for col in hi.v.T]
    anchors: dict[int, Anchor] = {}
    for i in range(N):
        n = i + 1
        keys, vals = hi.k[:n], hi.v[:n]
        s = np.einsum("jl,l->j", keys, hi.q[i])
        top = float(s.max())
        e = np.exp(s - top)
        zbar = e.sum()  # Z_i = e^top zbar
        p = e / zbar
        y = softmax_output(s, v_columns, dps)
        mu = vals.mean(axis=0)
        t = vals - mu
        c = rho(s) * np.exp(-top) / zbar
        if not np.all(np.isfinite(c)):
            raise ValueError(f"{where}, query {i}: the original gauge's coefficients leave the "
                             "float64 range (not covered by the reference)")
        cmk = rho(s - top) / zbar
        S = float(np.abs(vals).max())
        vn = np.abs(t).max(axis=1) + np.abs(vals).max(axis=1)
        aq = np.abs(hi.q[i])
        candidates = {int(np.argmax(s)), *np.flatnonzero(s >= top - maxkey_tie).tolist()}
        kmk = {j: kappa(cmk, np.einsum("jl,l->j", np.abs(keys - keys[j]), aq), vn, S)
               for j in candidates}
        sq = unit_step(hi.tau * keys, c, t)
        unrot = rotate(keys, hi.cos[hi.pos[i]], -hi.sin[hi.pos[i]], hi.layout)
        si = unit_step(hi.tau * np.einsum("jl,ml->jm", unrot, hi.wq), c, t)
        row = dict(n=n, n_chunk=chunk_end(i, N), sigma=np.abs(s).max(),
                   kappa=kappa(c, np.einsum("jl,l->j", np.abs(keys), aq), vn, S),
                   kappa_mk=kmk[int(np.argmax(s))],
                   kappa_mk_lo=min(kmk.values()), kappa_mk_hi=max(kmk.values()),
                   e_nat=np.abs(y - hi.native[i]).max(), spread=top - s.min(), sink=p[0],
                   lam_q=sq.lam, f_q=sq.flag, margin_q=sq.margin, cond_q=sq.cond,
                   lam_in=si.lam, f_in=si.flag, margin_in=si.margin, cond_in=si.cond,
                   anchor=float(i % anchor_every == 0))
        if i % anchor_every == 0:
            anchors[i] = Anchor(si.B, mu, y, p, c, vn, S, int(hi.pos[i]))
        else:
            row.update(frozen_reuse(hi, hi.u[i], y, mu, p,
                                    anchors[anchor_every * (i // anchor_every)]))
        for name, value in row.items():
            out[name][i] = value
    return out


def frozen_reuse(hi: HeadItem, u_i: np.ndarray, y: np.ndarray, mu: np.ndarray, p: np.ndarray,
                 a: Anchor) -> dict[str, float]:
    """``fr, co, me, tv, eps`` of one non-anchor query, and its frozen readout's condition
    number ``kappa_fr`` (query ``i``'s input at the anchor's position, the anchor's terms)."""
    y_fr = a.mu + np.einsum("m,mr->r", u_i, a.delta_m)
    fr, co, me = (float(np.sum(z * z)) for z in (y - y_fr, y - a.y, y - mu))
    na = len(a.p)
    tv = 0.5 * (np.abs(p[:na] - a.p).sum() + np.abs(p[na:]).sum())
    q_at_a = hi.tau * rotate(np.einsum("m,ml->l", u_i, hi.wq), hi.cos[a.pos], hi.sin[a.pos],
                             hi.layout)
    return dict(fr=fr, co=co, me=me, tv=tv, eps=math.sqrt(fr) / math.sqrt(max(me, ME_FLOOR)),
                kappa_fr=kappa(a.c, np.einsum("jl,l->j", np.abs(hi.k[:na]), np.abs(q_at_a)),
                               a.vn, a.S))


# ---------------------------------------------------------------------------------------------
# bounds and per-head statistics
# ---------------------------------------------------------------------------------------------
def readout_bound(u: float, kap: np.ndarray, n: np.ndarray, d: int,
                  sigma: np.ndarray) -> np.ndarray:
    """``R(u, kappa, n, sigma) = (n + d + 8 + sigma) u kappa``."""
    return (n + d + 8 + sigma) * u * kap


def identity_tol(u: float, kap: np.ndarray, n: np.ndarray, d: int,
                 sigma: np.ndarray) -> np.ndarray:
    """``I = 2 R(u, max(1, kappa), n, sigma)``."""
    return 2.0 * readout_bound(u, np.maximum(1.0, kap), n, d, sigma)


def model_level(n, d: int, m: int):
    """``A(n) = 10 (n + d + m + 8 + ln F) 2^-24``: the model's own float32 rounding level."""
    return 10.0 * (n + d + m + 8 + LN_F32_MAX) * U32


def bounds(R: dict[str, np.ndarray], kappa_mk: np.ndarray, d: int,
           m: int) -> dict[str, np.ndarray]:
    """``b^id``, ``b^nat``, ``b^orig``, ``b^lp`` of every row."""
    n, sigma, V = R["n"], R["sigma"], R["V"]
    M = model_level(R["n_chunk"], d, m) * R["Y"]
    return {"id": np.maximum(readout_bound(U64, R["kappa"], n, d, sigma), ID_FLOOR),
            "nat": M + identity_tol(U64, kappa_mk, n, d, sigma) * V,
            "orig": M + identity_tol(U64, R["kappa"], n, d, sigma) * V,
            "lp": M + identity_tol(U32, kappa_mk, n, d, sigma) * V}


def quotient(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a / b`` with ``x/0 = inf`` and ``0/0 = NaN``, quietly."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return a / b


def vmax(a: np.ndarray) -> float:
    return float(np.max(a)) if a.size else math.nan


def median(a: np.ndarray) -> float:
    return float(np.median(a)) if a.size else math.nan


def ordinal_ranks(a: np.ndarray) -> np.ndarray:
    ranks = np.empty(a.size)
    ranks[np.argsort(a, kind="stable")] = np.arange(a.size)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of the ordinal ranks over the rows where both are finite."""
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3:
        return math.nan
    ra, rb = ordinal_ranks(a[ok]), ordinal_ranks(b[ok])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float(np.sum(ra * ra) * np.sum(rb * rb)))
    return float(np.sum(ra * rb) / den) if den > 0 else math.nan


def tv_quartiles(eps: np.ndarray, tv: np.ndarray) -> list[dict]:
    """Median ``eps`` in the four closed bins between the quartiles of ``tv``."""
    if eps.size < 4:
        return []
    q = np.quantile(tv, [0.0, 0.25, 0.5, 0.75, 1.0])
    out = []
    for lo, hi in zip(q[:-1], q[1:]):
        inside = (tv >= lo) & (tv <= hi)
        out.append({"tv_lo": float(lo), "tv_hi": float(hi), "n": int(inside.sum()),
                    "relative_error_median": median(eps[inside])})
    return out


def summary(a: np.ndarray, *stats: str) -> dict[str, float]:
    return {s: {"median": median, "max": vmax, "mean": lambda z: float(np.mean(z))}[s](a)
            for s in stats}


def reuse(R: dict[str, np.ndarray]) -> dict:
    """The frozen-reuse statistics over the non-anchor rows."""
    sel = R["anchor"] == 0
    fr, co, me, eps, tv = (R[k][sel] for k in ("fr", "co", "me", "eps", "tv"))
    def rrmse(den: np.ndarray) -> float:
        return math.sqrt(fr.sum() / den.sum()) if den.sum() > 0 else math.nan

    return {"n_queries": int(sel.sum()),
            "rrmse_vs_constant_anchor": rrmse(co), "rrmse_vs_cache_mean": rrmse(me),
            "relative_error_median": median(eps),
            "spearman_error_vs_tv": spearman(eps, tv),
            "by_tv_quartile": tv_quartiles(eps, tv)}


def head_record(h: int, R: dict[str, np.ndarray], kappa_mk: np.ndarray, d: int, m: int,
                N: int) -> dict:
    """``layers[L].heads[h]`` of the report (docs/protocol.md section 11)."""
    b = bounds(R, kappa_mk, d, m)
    e, V, Y = R["e_nat"], R["V"], R["Y"]
    id_rel = np.zeros_like(e) / V  # e^id: exactly 0
    nat_rel = vmax(e / Y)  # e^nat, e^orig and e^lp share the exact value e
    nat, orig, lp = quotient(e, b["nat"]), quotient(e, b["orig"]), quotient(e, b["lp"])
    level = model_level(N, d, m)
    checks = {"identity_float64": bool(np.all(id_rel <= b["id"])),
              "float64_vs_native": bool(np.all(nat <= 1.0)),
              "float64_original_gauge_vs_native": bool(np.all(orig <= 1.0)),
              "model_dtype_vs_native": bool(np.all(lp <= 1.0)),
              "finite": bool(np.all(np.isfinite(id_rel)) and math.isfinite(nat_rel)
                             and np.all(np.isfinite(lp)) and np.all(np.isfinite(nat)))}
    return {
        "head": h, "checks": checks, "passed": all(checks.values()),
        "identity_float64_rel_max": vmax(id_rel),
        "identity_float64_bound_ratio_max": vmax(id_rel / b["id"]),
        "float64_vs_native_rel": nat_rel, "float64_vs_native_tol": level,
        "float64_vs_native_bound_ratio_max": vmax(nat),
        "float64_original_gauge_vs_native_rel": nat_rel,
        "float64_original_gauge_bound_ratio_max": vmax(orig),
        "original_gauge_unresolved_queries": int(np.sum(b["orig"] - b["nat"] > level * Y)),
        "model_dtype_vs_native_rel": nat_rel, "model_dtype_vs_native_kappa_blind_tol": level,
        "model_dtype_vs_native_bound_ratio_max": vmax(lp),
        "model_dtype_identity_rel": vmax(id_rel),
        "kappa_original": summary(R["kappa"], "median", "max"),
        "kappa_maxkey": summary(kappa_mk, "median", "max"),
        "spread": summary(R["spread"], "median", "max"),
        "sink_mass": summary(R["sink"], "mean", "median"),
        "lambda_max_query_space": summary(R["lam_q"], "median", "max"),
        "lambda_max_input_space": summary(R["lam_in"], "median", "max"),
        "step_increases_E_query_space": float(np.mean(R["f_q"])),
        "step_increases_E_input_space": float(np.mean(R["f_in"])),
        "reuse": reuse(R),
        "value_scale": vmax(V), "native_scale": vmax(Y),
    }


def replication(rows: dict[tuple[int, int], dict[str, np.ndarray]], N: int) -> dict:
    """``replication_style_descent``: the final query of every context, query space."""
    per_layer, lams, total, count = {}, [], 0, 0
    for L in sorted({L for L, _ in rows}):
        heads = [R for (LL, _), R in sorted(rows.items()) if LL == L]
        f = np.concatenate([R["f_q"][N - 1::N] for R in heads])  # rows are N per context
        lam = np.concatenate([R["lam_q"][N - 1::N] for R in heads])
        per_layer[str(L)] = {"increase": int(f.sum()), "heads": int(f.size),
                             "lambda_max_median": median(lam), "lambda_max_max": vmax(lam)}
        total, count = total + int(f.sum()), count + int(f.size)
        lams.append(lam)
    every = np.concatenate(lams) if lams else np.array([])
    return {"per_layer": per_layer,
            "pooled": {"increase": total, "heads": count, "lambda_max_median": median(every),
                       "lambda_max_max": vmax(every)}}


# ---------------------------------------------------------------------------------------------
# the whole report
# ---------------------------------------------------------------------------------------------
@dataclass
class Reference:
    """The recomputed report (its data-dependent part) and the per-query rows behind it.

    ``report`` takes ``kappa*`` at the float64 argmax; ``low``/``high`` take the smallest and
    the largest ``kappa*`` over the near-tied candidates (equal to ``report`` without ties).
    ``rows[(L, h)]`` holds :data:`ROW_FIELDS` over the contexts' queries, context by context.
    """

    report: dict
    low: dict
    high: dict
    rows: dict[tuple[int, int], dict[str, np.ndarray]] = field(repr=False)
    manifest: dict = field(repr=False)


def layer_rows(dump: Dump, layer: int, contexts: list[int], maxkey_tie: float,
               dps: int) -> dict[int, dict[str, np.ndarray]]:
    """Every head's rows of one layer, the contexts concatenated in order."""
    cfg, facts = dump.manifest["config"], dump.manifest["layers"][str(layer)]
    lay = dump.layer(layer)
    parts: dict[int, list] = {h: [] for h in range(facts["n_heads"])}
    for c in contexts:
        item = dump.item(c, layer)
        for h in parts:
            parts[h].append(head_rows(head_item(item, lay, facts, h), cfg["anchor_every"],
                                      maxkey_tie, dps, f"layer {layer}, context {c}, head {h}"))
    return {h: {k: np.concatenate([p[k] for p in ps]) for k in ROW_FIELDS}
            for h, ps in parts.items()}


def model_shapes(dump: Dump, layer: int) -> dict[str, int]:
    """``n_heads``, ``n_kv_heads``, ``head_dim``, ``hidden`` from the dumped weights' shapes."""
    lay = dump.layer(layer)
    m, H, d = lay["w_q"].shape
    return {"n_heads": H, "n_kv_heads": lay["w_k"].shape[1], "head_dim": d, "hidden": m}


def assemble(dump: Dump, rows: dict[tuple[int, int], dict[str, np.ndarray]],
             kappa_key: str) -> dict:
    """The report's data-dependent blocks from the rows, ``kappa*`` taken from ``kappa_key``."""
    cfg = dump.manifest["config"]
    N = cfg["length"]
    layers = {}
    if not cfg["replication_only"]:
        for L in sorted({L for L, _ in rows}):
            facts = dump.manifest["layers"][str(L)]
            heads = [head_record(h, R, R[kappa_key], facts["head_dim"], facts["hidden"], N)
                     for (LL, h), R in sorted(rows.items()) if LL == L]
            layers[str(L)] = {"heads": heads, "errors": [],
                              "passed": all(h["passed"] for h in heads)}
    failed = [f"layer {L} head {h['head']}: " + ", ".join(k for k in CHECKS if not h["checks"][k])
              for L, lr in layers.items() for h in lr["heads"] if not h["passed"]]
    first = min(L for L, _ in rows)
    return {"model": model_shapes(dump, first), "layers": layers,
            "replication_style_descent": replication(rows, N),
            "verdict": {"passed": not failed, "failed": failed}}


def recompute(path: str | Path, *, maxkey_tie: float = 0.0, dps: int = 30) -> Reference:
    """Recompute every data-dependent number of the atlas report from the dump at ``path``.

    ``maxkey_tie``: scores within this of a row's largest count as candidates for the
    model-dtype evaluation's ``j*`` (see the module docstring); ``dps``: digits of the oracle.
    """
    dump = load(path)
    items = sorted(tuple(it) for it in dump.manifest["items"])
    rows = {}
    for L in sorted({L for _, L in items}):
        for h, R in layer_rows(dump, L, [c for c, LL in items if LL == L], maxkey_tie,
                               dps).items():
            rows[(L, h)] = R
    report, low, high = (assemble(dump, rows, k)
                         for k in ("kappa_mk", "kappa_mk_lo", "kappa_mk_hi"))
    return Reference(report, low, high, rows=rows, manifest=dump.manifest)


# ---------------------------------------------------------------------------------------------
# the counted work (docs/protocol.md section 11, `cost`)
# ---------------------------------------------------------------------------------------------
def counted_flops(manifest: dict) -> dict[str, float]:
    """Section 11's operation counts (`cost`) of every dumped item, summed per phase, from the dumped
    sizes: per head and query ``i`` with ``n = i + 1`` keys, ``2nd + 2ndr + 2nr`` in each
    streamed pass; in the float64 original-gauge pass besides ``2nd^2 + l + 2 d^2 r + 4 d r`` and
    (affine heads) ``4 d^3 + l + 4 d^2 r + 4 d r``, and ``2(m+1)d + 2dr`` for frozen reuse, with ``l``
    the certified largest eigenvalue's ``k(2d^2 + 4d) + 4dk(k+1) + 2d^2 + 8/3 (k+1)^3 + 2d`` at
    the section's ``k = 5`` Lanczos steps (``min(k, d)``) from a start vector (``2nd`` for
    ``g_i``, ``2d^2`` for ``B_i^T g_i``); the projections
    ``2N(m+1)(Hd + H_kv d + H_kv r)`` once per item.  Plain causal heads only (the atlas
    reference covers no window or soft-cap)."""
    N = int(manifest["config"]["length"])
    out = {"project": 0.0, "float64_original": 0.0, "lowp_maxkey": 0.0, "float64_maxkey": 0.0}
    for _c, L in manifest["items"]:
        f = manifest["layers"][str(L)]
        d, r, m, H, Hk = (f[k] for k in ("head_dim", "r", "hidden", "n_heads", "n_kv_heads"))
        per_query_keys = sum(i + 1 for i in range(N))
        streamed = H * per_query_keys * (2 * d + 2 * d * r + 2 * r)
        k = min(5, d)  # the documented Lanczos steps, from a start vector (its norm: 2d)
        lam = k * (2 * d * d + 4 * d) + 4 * d * k * (k + 1) + 2 * d * d + 8 * (k + 1) ** 3 / 3
        lam += 2 * d
        original = streamed + H * per_query_keys * (2 * d * d + 2 * d)  # G_i and g_i
        original += H * N * (lam + 2 * d * d * r + 4 * d * r)
        if f["family"] == "dot":  # M_i, B_i^T g_i, lambda_max, the test
            original += H * N * (4 * d ** 3 + 2 * d * d + lam + 4 * d * d * r + 4 * d * r)
        original += H * N * (2 * (m + 1) * d + 2 * d * r)
        out["project"] += 2 * N * (m + 1) * (H * d + Hk * d + Hk * r)
        out["float64_original"] += original
        out["lowp_maxkey"] += streamed
        out["float64_maxkey"] += streamed
    return out


def cost_section(report: dict) -> dict:
    """Section 11's `cost` recomputed from what the report measured: every process's phase
    timers (``run.rank_timing_seconds``), the GEMM rates (``cost.matmul_flops_per_s``, the
    only measurement taken as given) and the phases' counted operations (``cost.phases[p].flops``,
    which :func:`counted_flops` recomputes from a dump's sizes).

    A phase's ``seconds`` is the sum of its timer over the processes, ``dtype`` float64 but for
    the model-dtype max-key pass (``config.dtype``), ``achieved_flops_per_s = flops / seconds``
    and ``fraction_of_matmul`` that over the rate of the phase's dtype; ``work_seconds`` sums
    the phases' seconds, ``floor_seconds`` their ``flops / rate``, the overall fraction is
    floor over work; ``model_forward_seconds`` sums the processes' forward timers and, where
    it is positive, gives ``work_over_model_forward`` and ``floor_over_model_forward``.  Phases
    no process timed are absent."""
    given = report["cost"]
    rates = given["matmul_flops_per_s"]
    low = report["config"]["dtype"]
    ranks = [report["run"]["rank_timing_seconds"][k]
             for k in sorted(report["run"]["rank_timing_seconds"], key=int)]
    names = ("project", "float64_original", f"{low}_maxkey", "float64_maxkey")
    phases, work, floor = {}, 0.0, 0.0
    for name in names:
        timed = [t[name] for t in ranks if name in t]
        if not timed:
            continue
        seconds = math.fsum(timed)
        flops = float(given["phases"][name]["flops"])
        dtype = low if name == f"{low}_maxkey" else "float64"
        achieved = flops / seconds if seconds > 0 else math.nan
        phases[name] = {"flops": flops, "seconds": seconds, "dtype": dtype,
                        "achieved_flops_per_s": achieved,
                        "fraction_of_matmul": achieved / rates[dtype]}
        work += seconds
        floor += flops / rates[dtype]
    out = {"phases": phases, "matmul_flops_per_s": dict(rates), "work_seconds": work,
           "floor_seconds": floor,
           "fraction_of_matmul": floor / work if work > 0 else math.nan}
    forward = math.fsum(t.get("model_forward", 0.0) for t in ranks)
    if forward > 0:
        out.update(model_forward_seconds=forward, work_over_model_forward=work / forward,
                   floor_over_model_forward=floor / forward)
    return out
