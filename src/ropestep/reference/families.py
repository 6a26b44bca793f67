"""``ropestep train-families``' report recomputed from its checkpoints (docs/math.md section 12),
independently of the code that wrote it.

Written from docs/math.md sections 10-12 alone, one head and one query at a time in plain numpy
float64: nothing is shared with :mod:`ropestep.families`, :mod:`ropestep.heads` or the fast
layer.  Its inputs are a run directory's ``checkpoints/`` (per variant a safetensors file of
float32 weights and a JSON holding the GPT configuration, the training configuration and the
held-out token ids the suite ran on) and the report's own records (the per-step losses and the
barycenters of the initial weights, which no checkpoint holds).

* the learned quantities: ``tau_h = exp(log_tau_h)``, ``b_h = exp(clamp(log_base_h, log b_min,
  log b_max))``, their initial values (``tau``: ``sqrt(d)`` stored through the float32
  parameter; ``b``: ``b(t_h)`` of the recorded barycenters, stored likewise), the drift of the
  temperatures and the clamp flags;
* the GPT forward in float64 from the token ids (:func:`capture`: every layer's attention
  input), and on those inputs -- or on inputs the caller passes, such as the float32 captures
  the suite itself read -- the suite's per-head statistics: the cosine bound's ratio and
  tightness, ``lambda_max`` and the unit step's descent in query and input space, frozen reuse,
  and the exact values (0) of its rounding-error measurements;
* the W_q/W_k diagnostics of every layer (condition numbers, effective ranks, band energies,
  barycenters) from a float64 SVD of the checkpoint's weights.

:func:`recompute` returns a report-shaped dict of every recomputable field and the per-query
rows behind the statistics (for the comparison's tolerances).

Imports: numpy and safetensors' numpy reader; nothing of ropestep and not torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from ..provenance import sha256_file  # a file hash: no arithmetic of the suite
from . import atlas as atlas_ref  # one rotation for every reference

CHECKPOINT_SCHEMA = "ropestep.train_families.checkpoint/1"
VARIANTS = ("standard", "cosine", "perhead")
N_REUSE = 4  # frozen reuse: the last 4 tokens read the prefix bank (docs/math.md section 11)
N_COARSE = 4  # coarse bands: the pair index cut into 4 contiguous blocks
COND_SMALL = 10.0  # the per-head-base document's "well conditioned" mark
SKETCH_EPS = 1e-8  # the document's sketch adds it to its denominator
SCALE_GUARD = 1e-300  # frozen reuse: floor of ||y_i - mu|| under the relative error
CHECKS = {  # the suite's checks per variant (docs/math.md section 11)
    "all": ("identity_float64_fast", "identity_float64_scale", "identity_float64_self",
            "identity_float32_fast", "identity_float32_scale", "descent_inequality_query",
            "gradient_query", "query_space_readout", "reuse_tokenwise", "reuse_native",
            "frequencies_decreasing"),
    "affine": ("descent_inequality_input", "gradient_input", "hessian_sandwich", "reuse_bound"),
    "cosine": ("cosine_bound",),
    "perhead": ("frequency_orientation",),
}


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """One variant's checkpoint: the JSON and the weights (float32 as saved, read as float64,
    which is exact)."""

    variant: str
    info: dict
    weights: dict[str, np.ndarray] = field(repr=False)
    path: Path

    @property
    def cfg(self) -> dict:
        return self.info["gpt_config"]

    def w(self, name: str) -> np.ndarray:
        return self.weights[name]

    def attn(self, layer: int, name: str) -> np.ndarray:
        return self.weights[f"blocks.{layer}.attn.{name}"]


def load(run_dir: str | Path) -> dict[str, Checkpoint]:
    """The three checkpoints of a run directory (``checkpoints/<variant>.json`` and its
    safetensors file); refuses another schema."""
    out = {}
    for v in VARIANTS:
        js = Path(run_dir) / "checkpoints" / f"{v}.json"
        info = json.loads(js.read_text(encoding="utf-8"))
        if info.get("schema") != CHECKPOINT_SCHEMA or info.get("variant") != v:
            raise ValueError(f"{js}: not a train-families checkpoint of variant {v!r}")
        if "suite_inputs" not in info:
            raise ValueError(f"{js}: no suite_inputs (the held-out token ids the suite ran on): "
                             "written before they were saved, rerun train-families")
        st = js.parent / info["weights"]
        weights = {k: a.astype(np.float64) for k, a in load_file(str(st)).items()}
        out[v] = Checkpoint(v, info, weights, st)
    return out


# ---------------------------------------------------------------------------------------------
# sizes and learned quantities (docs/math.md sections 11 and 12)
# ---------------------------------------------------------------------------------------------
def n_heads(cfg: dict) -> int:
    return int(cfg["n_heads"])


def kv_heads(cfg: dict) -> int:
    return int(cfg["n_kv_heads"] or cfg["n_heads"])


def head_dim(cfg: dict) -> int:
    return int(cfg["head_dim"] or cfg["d_model"] // cfg["n_heads"])


def kv_head(cfg: dict, h: int) -> int:
    """The KV head query head ``h`` reads: ``h // (H / H_kv)``."""
    return h // (n_heads(cfg) // kv_heads(cfg))


def tau0(cfg: dict) -> float:
    """The cosine variant's initial temperature: ``tau_init``, by default ``sqrt(d)``."""
    return math.sqrt(head_dim(cfg)) if cfg["tau_init"] is None else float(cfg["tau_init"])


def through_float32_log(x: float) -> float:
    """``exp(float32(log x))``: a positive value stored as the log in a float32 parameter and
    read back in float64 (how ``log_tau`` and ``log_base`` hold their initial values)."""
    return float(np.exp(np.float64(np.float32(math.log(x)))))


def initial_tau(cfg: dict) -> list[float]:
    """Every head's temperature at step 0 (they draw no random numbers)."""
    return [through_float32_log(tau0(cfg))] * n_heads(cfg)


def temperatures(ck: Checkpoint, layer: int) -> np.ndarray:
    """``tau_h = exp(log_tau_h)`` of one layer (cosine)."""
    return np.exp(ck.attn(layer, "log_tau"))


def log_range(cfg: dict) -> tuple[float, float]:
    lo, hi = cfg["base_range"]
    return math.log(float(lo)), math.log(float(hi))


def bases(ck: Checkpoint, layer: int) -> np.ndarray:
    """Every query head's RoPE base: ``exp(clamp(log_base_h, log b_min, log b_max))`` for the
    per-head variant, ``rope_base`` otherwise."""
    H = n_heads(ck.cfg)
    if ck.variant != "perhead":
        return np.full(H, float(ck.cfg["rope_base"]))
    lo, hi = log_range(ck.cfg)
    return np.exp(np.clip(ck.attn(layer, "log_base"), lo, hi))


def clamped(ck: Checkpoint, layer: int) -> list[bool]:
    """Whether each learned ``log_base_h`` lies outside ``[log b_min, log b_max]``."""
    lo, hi = log_range(ck.cfg)
    return [not (lo <= float(x) <= hi) for x in ck.attn(layer, "log_base")]


def barycenter_base(t: float, lo: float, hi: float) -> float:
    """``b(t) = b_min^(1-t) b_max^t`` (docs/math.md section 10)."""
    return math.exp((1.0 - t) * math.log(lo) + t * math.log(hi))


def initial_base(t: float, cfg: dict) -> float:
    """The per-head base at step 0 from the barycenter ``t`` of the initial weights: ``b(t)``
    stored through the float32 parameter ``log_base``, clamped to the range."""
    lo, hi = (float(b) for b in cfg["base_range"])
    llo, lhi = log_range(cfg)
    stored = np.float64(np.float32(math.log(barycenter_base(t, lo, hi))))
    return float(np.exp(np.clip(stored, llo, lhi)))


def drift(initial: list, final: list, steps: int) -> dict:
    """How the temperatures moved: ``final - initial`` per head, its extremes, how many went
    down and up, and the spread of the final temperatures."""
    ini, fin = np.asarray(initial, dtype=float), np.asarray(final, dtype=float)
    ch = fin - ini
    return {"steps": int(steps), "heads": int(ch.size), "down": int(np.sum(ch < 0)),
            "up": int(np.sum(ch > 0)), "change_min": float(np.min(ch)),
            "change_max": float(np.max(ch)), "spread_end": float(np.max(fin) - np.min(fin))}


# ---------------------------------------------------------------------------------------------
# the GPT forward, float64 (docs/math.md section 11; the GPT of ropestep.families' docstring)
# ---------------------------------------------------------------------------------------------
def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def gelu(x: np.ndarray) -> np.ndarray:
    """``x Phi(x) = x (1 + erf(x / sqrt 2)) / 2`` (the exact GELU)."""
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def frequencies(base: float, d: int) -> np.ndarray:
    """``omega_l = base^(-2l/d)``, ``l = 0..d/2-1``."""
    return float(base) ** (-2.0 * np.arange(d // 2) / d)


def rotate(z: np.ndarray, pos: np.ndarray, omega: np.ndarray, layout: str) -> np.ndarray:
    """RoPE: rows ``z (T, d)`` at positions ``pos (T,)`` turned by ``pos * omega_l`` in pair
    ``l`` (dimensions ``l, l + d/2`` split-half, ``2l, 2l+1`` interleaved)."""
    ang = np.asarray(pos, dtype=np.float64)[:, None] * omega[None, :]
    return atlas_ref.rotate(z, np.cos(ang), np.sin(ang), layout)


def unit_rows(z: np.ndarray) -> np.ndarray:
    """Rows to unit L2 norm (a zero row stays zero)."""
    n = np.sqrt(np.sum(z * z, axis=-1, keepdims=True))
    return np.where(n > 0, z / np.where(n > 0, n, 1.0), 0.0)


@dataclass
class HeadData:
    """One head of one layer on one sequence, float64: the unrotated queries and keys
    (normalised for the cosine variant), values, the head's frequencies and score scale."""

    q0: np.ndarray  # (T, d) unrotated (unit for cosine) queries
    k0: np.ndarray  # (T, d) unrotated (unit for cosine) keys of the head's KV head
    v: np.ndarray  # (T, d) values
    wq: np.ndarray  # (m, d) W_q of the head in math layout
    omega: np.ndarray  # (d/2,)
    scale: float  # 1/sqrt(d) or 1/tau_h
    layout: str

    @property
    def T(self) -> int:
        return self.q0.shape[0]

    def q(self, pos: np.ndarray) -> np.ndarray:
        return rotate(self.q0, pos, self.omega, self.layout)

    def k(self) -> np.ndarray:
        return rotate(self.k0, np.arange(self.T), self.omega, self.layout)


def head_weights(ck: Checkpoint, layer: int, h: int, name: str) -> np.ndarray:
    """Head ``h``'s projection ``(m, d)`` in math layout (``q = x W``): rows ``h d .. (h+1) d``
    of the ``Linear`` weight, transposed; ``name`` is ``q_proj``, ``k_proj`` or ``v_proj`` (the
    latter two indexed by KV head)."""
    d = head_dim(ck.cfg)
    return ck.attn(layer, f"{name}.weight")[h * d:(h + 1) * d].T


def head_data(ck: Checkpoint, layer: int, h: int, x: np.ndarray) -> HeadData:
    """Project ``x (T, m)`` onto head ``h`` of ``layer`` as the variant does."""
    cfg = ck.cfg
    g = kv_head(cfg, h)
    wq = head_weights(ck, layer, h, "q_proj")
    q, k = x @ wq, x @ head_weights(ck, layer, g, "k_proj")
    v = x @ head_weights(ck, layer, g, "v_proj")
    d = head_dim(cfg)
    if ck.variant == "cosine":
        q, k = unit_rows(q), unit_rows(k)
        scale = 1.0 / float(temperatures(ck, layer)[h])
    else:
        scale = 1.0 / math.sqrt(d)
    omega = frequencies(bases(ck, layer)[h], d)
    return HeadData(q, k, v, wq, omega, scale, cfg["layout"])


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - np.max(s))
    return e / np.sum(e)


def head_output(hd: HeadData) -> np.ndarray:
    """The causal softmax output ``y_i = sum_{j <= i} p_ij v_j``, ``(T, d)``."""
    pos = np.arange(hd.T)
    q, k = hd.q(pos), hd.k()
    return np.stack([softmax(hd.scale * (k[:i + 1] @ q[i])) @ hd.v[:i + 1]
                     for i in range(hd.T)])


def attention(ck: Checkpoint, layer: int, x: np.ndarray) -> np.ndarray:
    """The attention layer's output ``(T, m)``: every head's output, concatenated, times
    ``W_o``."""
    heads = [head_output(head_data(ck, layer, h, x)) for h in range(n_heads(ck.cfg))]
    return np.concatenate(heads, axis=-1) @ ck.attn(layer, "o_proj.weight").T


def block(ck: Checkpoint, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One pre-norm block: the attention input ``norm1(h)`` and the block's output
    ``h + attn(norm1(h))``, then ``+ W_2 gelu(W_1 norm2(.))``."""
    eps = float(ck.cfg["norm_eps"])
    a = rmsnorm(h, ck.w(f"blocks.{layer}.norm1.weight"), eps)
    h = h + attention(ck, layer, a)
    z = rmsnorm(h, ck.w(f"blocks.{layer}.norm2.weight"), eps)
    z = gelu(z @ ck.w(f"blocks.{layer}.mlp.0.weight").T) @ ck.w(f"blocks.{layer}.mlp.2.weight").T
    return a, h + z


def capture(ck: Checkpoint, ids: list[int]) -> list[np.ndarray]:
    """Every layer's attention input ``(T, m)`` (after the block's input norm) for one sequence of
    token ids: the inputs the suite reads."""
    h = ck.w("tok_emb.weight")[np.asarray(ids, dtype=np.int64)]
    out = []
    for L in range(int(ck.cfg["n_layers"])):
        a, h = block(ck, L, h)
        out.append(a)
    return out


# ---------------------------------------------------------------------------------------------
# one query's quantities (docs/math.md sections 3, 6, 8, 9 and 11)
# ---------------------------------------------------------------------------------------------
def rho(s: np.ndarray) -> np.ndarray:
    """``(e^s - 1)/s`` with ``rho(0) = 1``."""
    safe = np.where(s == 0, 1.0, s)
    return np.where(s == 0, 1.0, np.expm1(safe) / safe)


def coefficients(s: np.ndarray) -> np.ndarray:
    """The original gauge's ``c_j = rho(s_j) / Z``, ``Z = sum_k e^{s_k}``."""
    top = float(np.max(s))
    return rho(s) * math.exp(-top) / float(np.sum(np.exp(s - top)))


def kappa(coef: np.ndarray, absdot: np.ndarray, vn: np.ndarray, S: float) -> float:
    """``sum_j |c_j| absdot_j vn_j / S``: the readout's condition number (docs/math.md
    section 9)."""
    return float(np.sum(np.abs(coef) * absdot * vn) / S)


@dataclass
class UnitStep:
    """The unit gradient step ``B = sum_j c_j a_j t_j^T`` of ``E(B) = 1/2 sum_j c_j
    |a_j^T B - t_j|^2`` from ``B = 0``."""

    lam: float  # lambda_max(H), H = sum_j c_j a_j a_j^T
    delta: float  # E(B) - E(0) = 1/2 sum_j c_j |a_j^T B|^2 - |B|_F^2, exactly
    e0: float  # E(0) = 1/2 sum_j c_j |t_j|^2
    norm: float  # |B|_F^2


def unit_step(a: np.ndarray, c: np.ndarray, t: np.ndarray) -> UnitStep:
    """``lambda_max`` from the ``n x n`` Gram matrix ``sqrt(c_j c_k) a_j . a_k`` (the same
    non-zero spectrum as ``H``), and the energies of the unit step."""
    wa = np.sqrt(c)[:, None] * a
    lam = float(np.linalg.eigvalsh(wa @ wa.T)[-1])
    B = a.T @ (c[:, None] * t)
    quad = 0.5 * float(np.sum(c * np.sum((a @ B) ** 2, axis=1)))
    norm = float(np.sum(B * B))
    e0 = 0.5 * float(np.sum(c * np.sum(t * t, axis=1)))
    return UnitStep(lam, quad - norm, e0, norm)


CAUSAL_FIELDS = ("n", "S", "sigma", "kappa", "kappa_mk", "lam_q", "delta_q", "e0", "norm_q",
                 "trG", "lam_in", "delta_in", "norm_in", "wq_frob2", "num", "den", "ratio")
"""Per-query quantities of one head on one sequence (causal): ``n`` keys, value scale ``S =
max_j |v_j|_inf``, ``sigma = max_j |s_j|``, ``kappa`` (original gauge), ``kappa_mk`` (max-key
gauge, the largest over the keys within ``maxkey_tie`` of the top score), the unit step in query
space (``lam_q``, ``delta_q = E(B) - E(0)``, ``e0``, ``norm_q = |B|^2``) and input space
(``lam_in``, ``delta_in``, ``norm_in``; NaN for the cosine variant), ``trG = sum_j c_j |k~_j|^2``,
``wq_frob2 = |W_q|_F^2``, and the cosine bound's ``num = |y_i - mu_i|``, ``den = max_j |v_j -
mu_i|`` and ``ratio`` (0 for one key or a zero denominator)."""


def causal_rows(hd: HeadData, affine: bool, maxkey_tie: float) -> dict[str, np.ndarray]:
    """Every :data:`CAUSAL_FIELDS` quantity of every query of one head (keys ``j <= i``)."""
    T = hd.T
    pos = np.arange(T)
    q, k = hd.q(pos), hd.k()
    out = {name: np.full(T, np.nan) for name in CAUSAL_FIELDS}
    for i in range(T):
        n = i + 1
        K, V = k[:n], hd.v[:n]
        qe = hd.scale * q[i]  # the effective query
        s = K @ qe
        p = softmax(s)
        y, mu = p @ V, V.mean(axis=0)
        t = V - mu
        c = coefficients(s)
        S = float(np.abs(V).max())
        vn = np.abs(t).max(axis=1) + np.abs(V).max(axis=1)
        top = float(np.max(s))
        cmk = rho(s - top) / float(np.sum(np.exp(s - top)))
        ties = np.flatnonzero(s >= top - maxkey_tie)
        kmk = max(kappa(cmk, np.abs(K - K[j]) @ np.abs(qe), vn, S) for j in ties)
        sq = unit_step(hd.scale * K, c, t)
        row = dict(n=n, S=S, sigma=float(np.abs(s).max()),
                   kappa=kappa(c, np.abs(K) @ np.abs(qe), vn, S), kappa_mk=kmk,
                   lam_q=sq.lam, delta_q=sq.delta, e0=sq.e0, norm_q=sq.norm,
                   trG=float(np.sum(c * np.sum(K * K, axis=1))),
                   wq_frob2=float(np.sum(hd.wq * hd.wq)))
        if affine:  # a_j = scale W_q R(p_i)^T k~_j (the bias row of W^_q is zero)
            unrot = rotate(K, np.full(n, -pos[i]), hd.omega, hd.layout)
            si = unit_step(hd.scale * unrot @ hd.wq.T, c, t)
            row.update(lam_in=si.lam, delta_in=si.delta, norm_in=si.norm)
        num = float(np.linalg.norm(y - mu))
        den = float(np.max(np.linalg.norm(V - mu, axis=1)))
        row.update(num=num, den=den, ratio=num / den if n >= 2 and den > 0 else 0.0)
        for name, value in row.items():
            out[name][i] = value
    return out


REUSE_FIELDS = ("rel", "err", "dev", "S", "sigma", "kappa_fr", "n")
"""Per-query quantities of frozen reuse on the prefix bank (queries ``1..R-1``; the anchor's row
is NaN): ``rel = |y_i - y^fr_i| / max(|y_i - mu|, SCALE_GUARD)``, its numerator ``err`` and
denominator ``dev``, the bank's value scale ``S``, ``sigma = max_j |s_ij|``, the frozen
readout's condition number ``kappa_fr`` (the anchor's coefficients, query ``i``'s scores) and
the bank size ``n``."""


def reuse_rows(hd: HeadData, n_reuse: int = N_REUSE) -> dict[str, np.ndarray]:
    """Frozen reuse (docs/math.md section 6): the last ``R = min(n_reuse, T - 1)`` tokens, all at
    the position ``p* = T - R`` of the first of them, read the bank of the ``T - R`` earlier
    tokens (their own keys hidden); query 0 is the anchor, ``y^fr_i = mu + sum_j c_aj s_ij
    (v_j - mu)``."""
    T = hd.T
    R = min(n_reuse, T - 1)
    n0 = T - R
    K, V = hd.k()[:n0], hd.v[:n0]
    mu = V.mean(axis=0)
    t = V - mu
    qe = hd.scale * rotate(hd.q0[n0:], np.full(R, n0), hd.omega, hd.layout)  # (R, d)
    scores = qe @ K.T  # (R, n0)
    ca = coefficients(scores[0])
    S = float(np.abs(V).max())
    vn = np.abs(t).max(axis=1) + np.abs(V).max(axis=1)
    out = {name: np.full(R, np.nan) for name in REUSE_FIELDS}
    for i in range(1, R):
        y = softmax(scores[i]) @ V
        frozen = mu + (ca * scores[i]) @ t
        err, dev = float(np.linalg.norm(y - frozen)), float(np.linalg.norm(y - mu))
        row = dict(rel=err / max(dev, SCALE_GUARD), err=err, dev=dev, S=S,
                   sigma=float(np.abs(scores[i]).max()), n=n0,
                   kappa_fr=kappa(ca, np.abs(K) @ np.abs(qe[i]), vn, S))
        for name, value in row.items():
            out[name][i] = value
    return out


# ---------------------------------------------------------------------------------------------
# the suite's per-head numbers
# ---------------------------------------------------------------------------------------------
def lower_median(a: np.ndarray) -> float:
    """The ``ceil(n/2)``-th smallest value (``torch.median``'s convention: the lower of the
    two middle values); NaN for no values or a NaN among them."""
    a = np.asarray(a, dtype=float)
    if a.size == 0 or np.any(np.isnan(a)):
        return math.nan
    return float(np.sort(a)[(a.size - 1) // 2])


def vmax(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=float)
    return float(np.max(a)) if a.size else math.nan


def sequence_head(C: dict[str, np.ndarray], Rr: dict[str, np.ndarray], affine: bool,
                  cosine: bool) -> dict:
    """One head's numbers on one sequence (queries with at least two keys)."""
    sel = C["n"] >= 2
    out = {"identity_float64_rel": 0.0, "identity_float32_rel": 0.0}
    spaces = ("query", "input") if affine else ("query",)
    for space in spaces:
        key = "q" if space == "query" else "in"
        lam, delta = C[f"lam_{key}"][sel], C[f"delta_{key}"][sel]
        out[f"lambda_max_{space}_median"] = lower_median(lam)
        out[f"lambda_max_{space}_max"] = vmax(lam)
        out[f"descends_{space}_fraction"] = float(np.mean(delta < 0))
        out[f"lambda_below_2_{space}_fraction"] = float(np.mean(lam < 2))
    rel = Rr["rel"][1:]
    out["reuse_rel_error_median"] = lower_median(rel)
    out["reuse_rel_error_max"] = vmax(rel)
    if cosine:
        out["cosine_ratio_max"] = vmax(C["ratio"])
    return out


MAX_KEYS = ("identity_float64_rel", "identity_float32_rel", "lambda_max_query_max",
            "lambda_max_input_max", "reuse_rel_error_max", "cosine_ratio_max")
"""Per-head numbers summarised over the check sequences by their largest value; the others
(medians and fractions) by their mean."""


def two_key_reach(tau: float) -> float:
    """``1 / (1 + e^{2/tau})``: the tightness two keys at ``+-q^`` reach."""
    e = math.exp(-2.0 / tau)
    return e / (1.0 + e)


def suite_head(per_seq: list[dict], h: int, base: float, tau: float | None) -> dict:
    """``suite.layers[L].heads[h]``: the sequences' numbers summarised, the head's base, and for
    cosine heads the bound ``e^{2/tau} - 1``, the tightness ``ratio / bound`` and the two-key
    reach."""
    out: dict = {"head": h, "base": float(base)}
    for key in per_seq[0]:
        vals = np.array([r[key] for r in per_seq], dtype=float)
        out[key] = vmax(vals) if key in MAX_KEYS else float(np.mean(vals))
    if tau is not None:
        bound = math.expm1(2.0 / tau)
        out.update(tau=float(tau), cosine_bound=bound,
                   cosine_tightness=out["cosine_ratio_max"] / bound,
                   cosine_two_key_reach=two_key_reach(tau))
    return out


def check_names(variant: str) -> tuple[str, ...]:
    names = CHECKS["all"] + (CHECKS["cosine"] if variant == "cosine" else CHECKS["affine"])
    return names + (CHECKS["perhead"] if variant == "perhead" else ())


# ---------------------------------------------------------------------------------------------
# W_q/W_k diagnostics (docs/math.md section 10; the heads report's definitions)
# ---------------------------------------------------------------------------------------------
def pair_of(d: int, layout: str) -> np.ndarray:
    """The RoPE pair ``l(c)`` of every head dimension: ``c mod d/2`` split-half, ``c // 2``
    interleaved."""
    c = np.arange(d)
    return c % (d // 2) if layout == "half" else c // 2


def band_fractions(w: np.ndarray, layout: str) -> np.ndarray:
    """``E_l / ||W||_F^2`` with ``E_l`` the squared norm of pair ``l``'s two columns."""
    d = w.shape[1]
    col = np.sum(w * w, axis=0)
    e = np.array([np.sum(col[pair_of(d, layout) == ell]) for ell in range(d // 2)])
    return e / np.sum(col)


def effective_rank(sv: np.ndarray) -> float:
    """``exp(-sum_k p_k log p_k)``, ``p_k = sigma_k / sum_j sigma_j`` (``0 log 0 = 0``)."""
    p = sv[sv > 0] / np.sum(sv)
    return math.exp(-float(np.sum(p * np.log(p))))


def matrix_diagnostics(w: np.ndarray, layout: str) -> dict:
    """Condition number, effective rank, extreme singular values, Frobenius norm and band
    fractions (per pair and in four contiguous blocks of the pair index) of one ``(m, d)``
    projection."""
    sv = np.linalg.svd(w, compute_uv=False)
    frac = band_fractions(w, layout)
    return {"cond": float(sv.max() / sv.min()), "effective_rank": effective_rank(sv),
            "sigma_max": float(sv.max()), "sigma_min": float(sv.min()),
            "frobenius": float(math.sqrt(np.sum(w * w))),
            "band_energy_fraction": [float(x) for x in frac],
            "coarse_band_fraction": [float(np.sum(b)) for b in np.array_split(frac, N_COARSE)]}


def barycenter(wq: np.ndarray, wk: np.ndarray, layout: str) -> float:
    """``t = sum_c w_c l(c)/(d/2 - 1) / sum_c w_c`` with ``w_c = |W_q[:, c]| + |W_k[:, c]|``."""
    d = wq.shape[1]
    imp = np.linalg.norm(wq, axis=0) + np.linalg.norm(wk, axis=0)
    return float(np.sum(imp * pair_of(d, layout) / (d // 2 - 1)) / np.sum(imp))


def sketch_barycenter(wq: np.ndarray, wk: np.ndarray) -> float:
    """The document's sketch: the ``2d`` rows of ``[W_q^T; W_k^T]`` weighted by their norms at
    ``0, 1/(2d-1), ..., 1``, over the norms' sum plus ``1e-8``."""
    imp = np.linalg.norm(np.concatenate((wq.T, wk.T)), axis=1)
    idx = np.arange(imp.size) / (imp.size - 1)
    return float(np.sum(imp * idx) / (np.sum(imp) + SKETCH_EPS))


def stats(x: list[float]) -> dict:
    a = np.asarray(x, dtype=float)
    return {"median": float(np.median(a)), "min": float(np.min(a)), "max": float(np.max(a)),
            "n": int(a.size)}


def summarise(layers: list[dict]) -> dict:
    """Medians and ranges over the heads of ``layers``, the fractions of ``cond < 10`` and of
    barycenters below 1/2, and the mean coarse bands."""
    qh = [h for L in layers for h in L["query_heads"]]
    kh = [g for L in layers for g in L["kv_heads"]]
    cq, ck = [h["w_q"]["cond"] for h in qh], [g["w_k"]["cond"] for g in kh]
    t = [h["barycenter"] for h in qh]
    return {
        "cond_w_q": stats(cq), "cond_w_k": stats(ck),
        "effective_rank_w_q": stats([h["w_q"]["effective_rank"] for h in qh]),
        "effective_rank_w_k": stats([g["w_k"]["effective_rank"] for g in kh]),
        "barycenter": stats(t), "barycenter_base": stats([h["barycenter_base"] for h in qh]),
        "sketch_barycenter": stats([h["sketch_barycenter"] for h in qh]),
        "fraction_cond_w_q_below_10": float(np.mean(np.asarray(cq) < COND_SMALL)),
        "fraction_cond_w_k_below_10": float(np.mean(np.asarray(ck) < COND_SMALL)),
        "fraction_barycenter_below_half": float(np.mean(np.asarray(t) < 0.5)),
        "coarse_band_fraction_w_q_mean": [float(x) for x in np.mean(
            [h["w_q"]["coarse_band_fraction"] for h in qh], axis=0)],
        "coarse_band_fraction_w_k_mean": [float(x) for x in np.mean(
            [g["w_k"]["coarse_band_fraction"] for g in kh], axis=0)],
    }


def frequency_axis(base0: float, d: int) -> dict:
    """``omega_l`` of head 0's base (the analytic rotation) and its orientation."""
    om = frequencies(base0, d)
    return {"source": "analytic base^(-2l/d)", "omega": [float(x) for x in om],
            "omega_pair0": float(om[0]), "omega_last": float(om[-1]),
            "decreasing": bool(np.all(np.diff(om) < 0)), "fastest_pair": int(np.argmax(om)),
            "slowest_pair": int(np.argmin(om)), "max_abs_diff_to_analytic": 0.0}


def layer_diagnostics(ck: Checkpoint, layer: int) -> dict:
    """``heads_diagnostics.layers[L]``: W_q per query head, W_k per KV head, the barycenter of
    query head ``h`` with the W_k of its KV head, and ``b(t)`` over the variant's base range."""
    cfg = ck.cfg
    H, Hk, d, lay = n_heads(cfg), kv_heads(cfg), head_dim(cfg), cfg["layout"]
    lo, hi = (float(b) for b in cfg["base_range"])
    kv = [{"kv_head": g, "query_heads": [h for h in range(H) if kv_head(cfg, h) == g],
           "w_k": matrix_diagnostics(head_weights(ck, layer, g, "k_proj"), lay)}
          for g in range(Hk)]
    qh = []
    for h in range(H):
        wq, wk = head_weights(ck, layer, h, "q_proj"), head_weights(
            ck, layer, kv_head(cfg, h), "k_proj")
        t = barycenter(wq, wk, lay)
        qh.append({"head": h, "kv_head": kv_head(cfg, h), "w_q": matrix_diagnostics(wq, lay),
                   "barycenter": t, "barycenter_base": barycenter_base(t, lo, hi),
                   "sketch_barycenter": sketch_barycenter(wq, wk)})
    b = bases(ck, layer)
    return {"n_heads": H, "n_kv_heads": Hk, "group": H // Hk, "head_dim": d, "layout": lay,
            "family": "cosine" if ck.variant == "cosine" else "dot",
            "rope_bases": [float(x) for x in b], "base_range": [lo, hi],
            "frequency_axis": frequency_axis(float(b[0]), d), "query_heads": qh,
            "kv_heads": kv, "summary": summarise([{"query_heads": qh, "kv_heads": kv}])}


def heads_diagnostics(ck: Checkpoint) -> dict:
    layers = {str(L): layer_diagnostics(ck, L) for L in range(int(ck.cfg["n_layers"]))}
    return {"layers": layers, "summary": summarise(list(layers.values())), "failures": []}


# ---------------------------------------------------------------------------------------------
# the whole report
# ---------------------------------------------------------------------------------------------
@dataclass
class Reference:
    """The recomputed report (every field that can be recomputed, in the report's shape) and
    the rows behind the suite's statistics: ``causal[(variant, layer, sequence, head)]``
    (:data:`CAUSAL_FIELDS`) and ``reuse[...]`` (:data:`REUSE_FIELDS`)."""

    report: dict
    causal: dict[tuple, dict[str, np.ndarray]] = field(repr=False)
    reuse: dict[tuple, dict[str, np.ndarray]] = field(repr=False)
    checkpoints: dict[str, Checkpoint] = field(repr=False)


def suite(ck: Checkpoint, inputs: list[list[np.ndarray]], maxkey_tie: float,
          rows: tuple[dict, dict]) -> dict:
    """``variants[v].suite``: every layer's per-head numbers over the check sequences
    (``inputs[sequence][layer]``), the checks' exact values (0: every check compares two sides
    of an identity or an inequality that holds exactly, docs/math.md section 11)."""
    cfg, v = ck.cfg, ck.variant
    H = n_heads(cfg)
    causal, reuse = rows
    layers = []
    for L in range(int(cfg["n_layers"])):
        tau = temperatures(ck, L) if v == "cosine" else None
        heads = []
        for h in range(H):
            per = []
            for si, xs in enumerate(inputs):
                hd = head_data(ck, L, h, np.asarray(xs[L], dtype=np.float64))
                C = causal[(v, L, si, h)] = causal_rows(hd, v != "cosine", maxkey_tie)
                Rr = reuse[(v, L, si, h)] = reuse_rows(hd)
                per.append(sequence_head(C, Rr, v != "cosine", v == "cosine"))
            heads.append(suite_head(per, h, bases(ck, L)[h],
                                    None if tau is None else float(tau[h])))
        layers.append({"layer": L, "checks": {n: [0.0] * H for n in check_names(v)},
                       "heads": heads, "passed": True})
    sin = ck.info["suite_inputs"]
    return {"sequences": len(sin["token_ids"]), "sequence_starts": list(sin["starts"]),
            "passed": True, "failures": [], "layers": layers}


def record_steps(steps: int, done: int) -> list[int]:
    """The steps at which the learned quantities were recorded: 0, every ``max(1, steps //
    100)``-th step and the last one, up to the steps done."""
    every = max(1, steps // 100)
    return [0] + [s for s in range(1, done + 1) if s % every == 0 or s == steps]


def losses_summary(rec: dict) -> dict:
    """The loss fields derived from the report's own records (the per-step training losses and
    the validation losses, which no checkpoint can reproduce)."""
    losses = [float(x) for x in rec["train_loss"]]
    tail = losses[-max(1, min(20, len(losses) // 10)):]
    val = [float(x["loss"]) for x in rec["val_loss"]]
    return {"train_loss_last": losses[-1] if losses else math.nan,
            "train_loss_tail_mean": float(np.mean(tail)) if tail else math.nan,
            "tail_steps": len(tail), "val_loss_initial": val[0], "val_loss_end": val[-1]}


def finite_records(rec: dict) -> bool:
    return all(math.isfinite(float(x)) for x in rec["train_loss"]) and all(
        math.isfinite(float(x["loss"])) for x in rec["val_loss"])


def learned(ck: Checkpoint, rec: dict) -> dict:
    """The learned quantities' report fields: initial and final values (a trajectory's first
    and last entries are these; the entries between are records), the clamp flags."""
    cfg, L = ck.cfg, range(int(ck.cfg["n_layers"]))
    if ck.variant == "cosine":
        ini, fin = [initial_tau(cfg) for _ in L], [temperatures(ck, i).tolist() for i in L]
        return {"tau_initial": ini, "tau_final": fin}
    if ck.variant == "perhead":
        t = rec["barycenter_init"]["t"]
        ini = [[initial_base(float(x), cfg) for x in row] for row in t]
        fin = [bases(ck, i).tolist() for i in L]
        return {"base_initial": ini, "base_final": fin, "base_clamped": [clamped(ck, i) for i in L],
                "barycenter_init": {"base_range": [float(b) for b in cfg["base_range"]]}}
    return {}


def variant_block(ck: Checkpoint, rec: dict, inputs: list[list[np.ndarray]], maxkey_tie: float,
            rows: tuple[dict, dict]) -> dict:
    """``variants[v]``: every field recomputable from the checkpoint and the report's records."""
    info = ck.info
    steps, done = int(info["train_config"]["steps"]), int(info["steps"])
    out = {"variant": ck.variant, "parameters": int(sum(a.size for a in ck.weights.values())),
           "steps_done": done, "record_steps": record_steps(steps, done),
           **losses_summary(rec),
           "checkpoint": {"weights": f"checkpoints/{info['weights']}",
                          "config": f"checkpoints/{ck.variant}.json",
                          "weights_sha256": sha256_file(ck.path)},
           "suite": suite(ck, inputs, maxkey_tie, rows),
           "heads_diagnostics": heads_diagnostics(ck),
           "passed": finite_records(rec), **learned(ck, rec)}
    return out


def recompute(run_dir: str | Path, report: dict, *, inputs: dict | None = None,
              maxkey_tie: float = 0.0) -> Reference:
    """Recompute every recomputable field of ``report`` from ``run_dir``'s checkpoints.

    ``inputs[variant][sequence][layer]``: the attention inputs ``(T, m)`` the statistics are
    evaluated on; by default this module's own float64 forward of the checkpoint's held-out
    token ids (:func:`capture`).  ``maxkey_tie``: scores within it of a row's largest count as
    the max-key gauge's anchor when ``kappa_mk`` is taken.
    """
    cks = load(run_dir)
    causal: dict = {}
    reuse: dict = {}
    out = {"variants": {}}
    for v, ck in cks.items():
        xs = (inputs[v] if inputs is not None
              else [capture(ck, ids) for ids in ck.info["suite_inputs"]["token_ids"]])
        out["variants"][v] = variant_block(ck, report["variants"][v], xs, maxkey_tie,
                                           (causal, reuse))
    V = out["variants"]
    cos = V["cosine"]
    out["drift"] = drift(cos["tau_initial"], cos["tau_final"], cos["steps_done"])
    passed = all(r["passed"] for r in V.values())
    out["verdict"] = {"passed": passed, "failed": []}
    out["config"] = {"head_dim": head_dim(cks["standard"].cfg)}
    return Reference(out, causal, reuse, cks)
