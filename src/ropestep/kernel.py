"""The kernel: the one batched implementation of the identity's objects.

Every fast path (:mod:`ropestep.fast` per query, :mod:`ropestep.scale` streamed over a causal
layer, :mod:`ropestep.lowrank` for the pairwise gauge) computes the coefficients ``c_ij``, the
query-space matrix ``T_i``, the bias-row term ``b_i``, the readout and its condition number here,
and nowhere else (docs/math.md sections 3 and 4).  In query space, with effective queries ``q_i``
(rotated, normalised where the family says so, times the score scale), rotated keys ``k~_j``,
values ``v_j``, raw scores ``s_ij = q_i . k~_j + beta_ij`` and the transform ``z = phi(s)``:

    Z_i   = sum_j e^{z_ij},  y_i = sum_j e^{z_ij} v_j / Z_i,  mu_i = (1/N_i) sum_j v_j
    c_ij  = e^{phi(sigma_i)} rho(z_ij - phi(sigma_i)) phi[s_ij, sigma_i] / Z_i          (gauge anchor sigma_i)
    T_i   = sum_j c_ij (k~_j - k_o)^T (v_j - mu_i)                                      (d x r)
    b_i   = sum_j c_ij (beta_ij - beta_o)(v_j - mu_i)                                    (r)
    w_i   = sum_j c_ij (v_j - mu_i)                                                      (r)
    y_i   = mu_i + q_i T_i + b_i - sigma_i w_i                                           (the identity)

Gauges: ``"original"`` (``sigma = 0``, ``k_o = 0``), ``"maxkey"`` (``sigma = s_{i j*}``,
``k_o = k~_{j*}``, ``beta_o = beta_{i j*}``, ``j* = argmax_j s_ij``: no term exceeds ``1/Zbar``),
``"free"`` (``sigma_i = u_i . g`` for a fixed vector ``g``; ``k_o = 0``, the ``- sigma w`` term
carries ``g``) and the pairwise gauge (``D_jk = exp_phi[s_j, s_k]/Z``, :func:`pairwise_weights`).

Overflow is handled once: every coefficient is evaluated as ``e^{shift} rho(x)`` with the
shift ``phi(sigma) - z_max`` kept inside the exponential (:func:`scaled_phi1`), and a
non-finite coefficient or readout raises ``FloatingPointError`` naming the head, the query and
the remedy -- in every path, never a NaN that a later reduction could drop.

This module imports nothing of ropestep (it sits just above the definitions: ``spec``,
``rope``, ``tolerances``); it never imports ``transformers`` or the mpmath oracle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


LOW_PRECISION = (torch.bfloat16, torch.float16)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------------
# phi_1 and divided differences
# ---------------------------------------------------------------------------------------------
_BIG = 40.0  # above this, e^{-s} < ulp(1) in float64, so (e^s - 1)/s == e^s/s to rounding


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic is carried out in: bf16/fp16 inputs accumulate in float32."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}: use float64, float32, bfloat16 or float16")
    return torch.float32 if dtype in LOW_PRECISION else dtype


def ftensor(s: Any) -> torch.Tensor:
    """A floating tensor; Python numbers and lists become float64 (not torch's float32 default)."""
    if not torch.is_tensor(s) and not isinstance(s, np.ndarray) and not isinstance(s, np.generic):
        s = torch.as_tensor(s, dtype=torch.float64)
    t = torch.as_tensor(s)
    if not t.is_floating_point():
        t = t.to(torch.float64)
    return t.to(compute_dtype(t.dtype))


def phi1(s: Any) -> torch.Tensor:
    """``rho(s) = phi_1(s) = (e^s - 1)/s``, ``rho(0) = 1``; strictly positive on the real line.

    ``expm1(s)/s`` near 0 (accurate to a few ulp, no cancellation); for ``s > 40`` the
    ``-1`` is below rounding and ``e^{s/2} * (e^{s/2}/s)`` stays finite up to s ~ 716 in
    float64, where ``expm1`` alone overflows at 709.78.  bf16/fp16 inputs are evaluated in
    float32.
    """
    s = ftensor(s)
    zero = s == 0
    big = s > _BIG
    safe = torch.where(zero | big, torch.ones_like(s), s)
    out = torch.expm1(safe) / safe
    half = torch.exp(torch.where(big, s * 0.5, torch.zeros_like(s)))
    out = torch.where(big, half * (half / torch.where(big, s, torch.ones_like(s))), out)
    return torch.where(zero, torch.ones_like(s), out)


def scaled_phi1(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``e^{shift} * phi_1(x)`` without intermediate overflow.

    For ``x > 40``: ``e^{shift + x} / x`` (the ``-1`` of ``e^x - 1`` is below rounding);
    otherwise the plain product.  Used for ``c = e^{phi(sigma) - z_max} phi_1(z - phi(sigma))``.
    """
    big = x > _BIG
    xs = torch.where(big, x, torch.ones_like(x))
    return torch.where(big, torch.exp(shift + xs) / xs, torch.exp(shift) * phi1(x))


def exp_dd(a: Any, b: Any) -> torch.Tensor:
    """Exponential divided difference ``exp[a, b] = (e^a - e^b)/(a - b) = e^b rho(a - b)``.

    Evaluated with ``b`` the larger argument, so ``rho`` sees a non-positive argument.
    """
    a, b = torch.broadcast_tensors(ftensor(a), ftensor(b))
    hi, lo = torch.maximum(a, b), torch.minimum(a, b)
    return torch.exp(hi) * phi1(lo - hi)


def transform(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Score transform ``phi(s)``: identity, or ``softcap * tanh(s / softcap)``."""
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def transform_dd(a: torch.Tensor, b: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Divided difference ``phi[a, b] = (phi(a) - phi(b))/(a - b)`` (1 for the identity).

    Soft-cap ``phi(s) = c tanh(s/c)``: with ``A, B = a/c, b/c`` ordered ``hi >= lo`` and
    ``delta = hi - lo``, ``tanh x = (1 - e^{-2x})/(1 + e^{-2x})`` gives, for ``lo >= 0``,

        phi[a, b] = 4 e^{-2 lo} phi_1(-2 delta) / ((1 + e^{-2 hi})(1 + e^{-2 lo})),

    every factor positive and free of cancellation (mirror it for ``hi <= 0``); across zero
    ``(tanh hi - tanh lo)/delta`` has no cancellation either.
    """
    if softcap is None:
        return torch.ones(torch.broadcast_shapes(a.shape, b.shape), dtype=a.dtype, device=a.device)
    A, B = torch.broadcast_tensors(a / softcap, b / softcap)
    hi, lo = torch.maximum(A, B), torch.minimum(A, B)
    delta = hi - lo
    neg = hi <= 0  # mirror: (hi, lo) -> (-lo, -hi)
    h2 = torch.where(neg, -lo, hi)
    l2 = torch.where(neg, -hi, lo)
    l2c = l2.clamp_min(0)
    h2c = h2.clamp_min(0)
    same = 4 * torch.exp(-2 * l2c) * phi1(-2 * delta) / (
        (1 + torch.exp(-2 * h2c)) * (1 + torch.exp(-2 * l2c)))
    across = (torch.tanh(hi) - torch.tanh(lo)) / torch.where(delta > 0, delta,
                                                               torch.ones_like(delta))
    return torch.where((lo < 0) & (hi > 0), across, same)


# ---------------------------------------------------------------------------------------------
# projections (shared by the per-query and the streamed paths)
# ---------------------------------------------------------------------------------------------
def augment(x: torch.Tensor) -> torch.Tensor:
    """``u = [x; 1]``."""
    return torch.cat((x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)), dim=-1)


def augmented_weight(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``W^ = [W; b^T]``: ``(m+1, heads, dim)`` with a zero bias row when ``b`` is None."""
    row = torch.zeros_like(w[:1]) if b is None else b[None]
    return torch.cat((w, row), dim=0)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, scope: str = "head") -> torch.Tensor:
    """RMSNorm of ``x (heads, n, d)``: ``x / sqrt(mean(x^2) + eps) * w`` with the mean over each
    head's last dim (``scope="head"``, ``w (d,)``) or over all heads and dims of a token
    (``scope="all"``, ``w (heads, d)``; OLMo 2's norm before the head split)."""
    if scope == "all":
        return x * torch.rsqrt((x * x).mean((0, -1), keepdim=True) + eps) * w[:, None, :]
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def qk_norm(x: torch.Tensor, w: torch.Tensor, eps: float, scope: str = "head",
            kind: str = "rms", bias: torch.Tensor | None = None) -> torch.Tensor:
    """A head's query/key norm (``HeadSpec.norm_kind``): :func:`rms_norm` (``"rms"``), or
    LayerNorm over each head's last dim (``"layer"``, Persimmon):
    ``(x - mean x) / sqrt(mean (x - mean x)^2 + eps) * w + bias``."""
    if kind == "layer":  # per head only (HeadSpec refuses a LayerNorm over every head)
        if scope != "head":
            raise ValueError("a QK LayerNorm acts per head (norm_scope 'head')")
        xc = x - x.mean(-1, keepdim=True)
        out = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps) * w
        return out if bias is None else out + bias
    if bias is not None:
        raise ValueError("an RMS norm has no bias (norm_kind 'layer' for a LayerNorm)")
    return rms_norm(x, w, eps, scope)


def latent_qkv(x: torch.Tensor, w: dict, heads: int, kv_eps: float, q_eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-head latent attention in its absorbed form (``spec.family == "latent"``,
    docs/math.md section 14): for inputs ``x (N, m)`` and the weights ``w`` (the
    :class:`~ropestep.spec.HeadWeights` fields ``w_q, b_q, w_kr, b_kr, w_kc, b_kc, kv_norm,
    w_uv, b_uv, w_qa, b_qa, qa_norm``, cast; absent ones None) return the unrotated queries
    ``(H, N, d)``, the shared keys ``[k_rope; c]`` expanded over the heads ``(H, N, d)`` and the
    values ``c W_uv[h] + b_uv[h]`` ``(H, N, r)``, with ``c = kv_norm * RMS(x W_kc + b_kc)`` and
    the query input ``z = x`` or ``qa_norm * RMS(x W_qa + b_qa)``."""
    def lin(a: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = a @ wt
        return out if b is None else out + b

    c = rms_norm(lin(x, w["w_kc"], w["b_kc"]), w["kv_norm"], kv_eps)  # (N, rank)
    kr = (x[:, :0] if w["w_kr"] is None else lin(x, w["w_kr"], w["b_kr"]))  # (N, rope_dim)
    k = torch.cat((kr, c), -1)
    z = x if w["w_qa"] is None else rms_norm(lin(x, w["w_qa"], w["b_qa"]), w["qa_norm"], q_eps)
    q = torch.einsum("nq,qhd->hnd", z, w["w_q"])
    if w["b_q"] is not None:
        q = q + w["b_q"][:, None, :]
    v = torch.einsum("nl,lhr->hnr", c, w["w_uv"])
    if w["b_uv"] is not None:
        v = v + w["b_uv"][:, None, :]
    return q, k[None].expand(heads, *k.shape).contiguous(), v


def with_sink(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, beta: torch.Tensor | None,
              sink: torch.Tensor, n_queries: int) -> tuple[torch.Tensor, ...]:
    """Attention sinks as one more key (docs/math.md section 13): ``k (Gk, n, d)`` and ``v (Gk,
    n, r)`` with a zero key and a zero value appended (the last column), ``mask (Q, n)`` with
    that key permitted to every query, and the additive biases ``beta (G, Q, n)`` (None: zero)
    with the sink logits ``sink (G,)`` in that column -- the sink's score ``q . 0 + sigma_h`` is
    its logit, whatever the query.  Returns ``(k, v, mask, beta)``."""
    G = sink.shape[0]
    k = torch.cat((k, k.new_zeros(k.shape[0], 1, k.shape[-1])), 1)
    v = torch.cat((v, v.new_zeros(v.shape[0], 1, v.shape[-1])), 1)
    mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), 1)
    col = sink.to(k.dtype)[:, None, None].expand(G, n_queries, 1)
    if beta is None:
        beta = torch.cat((col.new_zeros(G, n_queries, mask.shape[1] - 1), col), -1)
    else:
        beta = torch.cat((beta, col.expand(beta.shape[0], n_queries, 1)), -1)
    return k, v, mask, beta


LATENT_FIELDS = ("w_q", "b_q", "w_kr", "b_kr", "w_kc", "b_kc", "kv_norm", "w_uv", "b_uv", "w_qa",
                 "b_qa", "qa_norm")


def clipped(x: torch.Tensor, clip: float | None) -> torch.Tensor:
    """A projection clipped to ``[-clip, clip]`` (DBRX's ``clip_qkv``), or as it is."""
    return x if clip is None else x.clamp(-clip, clip)


def unit_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x / ||x||`` over the last dim (cosine family); a zero row is an input error."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    if bool((n == 0).any()):
        raise ValueError(f"cosine family: a {name} vector has zero norm and cannot be normalised")
    return x / n


def uniform_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mu_i = (1/N_i) sum_{j in I_i} v_j``: ``v (Gk, N, r)``, ``mask (Q, N)`` -> ``(Gk, Q, r)``.

    The uniform mean: the only one that makes the identity hold (docs/math.md section 1).
    """
    return (mask.to(v.dtype) @ v) / mask.sum(-1).to(v.dtype)[:, None]


# ---------------------------------------------------------------------------------------------
# softmax, gauge anchors, coefficients
# ---------------------------------------------------------------------------------------------
@dataclass
class Softmax:
    """The softmax of one chunk, stably: ``e = exp(z - z_max)`` on the permitted set."""

    s: torch.Tensor  # (G, Qc, n) raw scores (bias included)
    z: torch.Tensor  # (G, Qc, n) transformed scores phi(s)
    zmax: torch.Tensor  # (G, Qc, 1) max of z over the permitted set
    e: torch.Tensor  # (G, Qc, n) exp(z - zmax), 0 off the mask
    zbar: torch.Tensor  # (G, Qc, 1) sum of e, in [1, N_i]


def softmax(s: torch.Tensor, mask: torch.Tensor, softcap: float | None) -> Softmax:
    """Stable softmax parts of raw scores ``s (G, Qc, n)`` on ``mask (Qc, n)``."""
    m3 = mask[None]
    z = transform(s, softcap)
    zmax = z.masked_fill(~m3, -math.inf).amax(-1, keepdim=True)
    e = torch.exp(z - zmax).masked_fill_(~m3, 0.0)
    return Softmax(s, z, zmax, e, e.sum(-1, keepdim=True))


def max_key(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``j* = argmax_j s_ij`` over the permitted set, ``(G, Qc)`` (raw score: no soft-cap ties)."""
    return s.masked_fill(~mask[None], -math.inf).argmax(-1)


def abs_offset_dots(q: torch.Tensor, k: torch.Tensor, js: torch.Tensor,
                    koff: torch.Tensor | None = None) -> torch.Tensor:
    """``|q_i| . |k~_j - k~_{j*_i}|`` for every row ``i`` of ``q (G, Qc, d)`` and key ``j`` of
    ``k (Gk, n, d)`` (``Gk`` 1 or ``G``), offset by the row's max key ``js (G, Qc)``: the max-key
    gauge's term of kappa (docs/math.md section 9), ``(G, Qc, n)``.

    Rows that share their max key share ``|K~ - k~_o|``: with a key group's keys (``Gk = 1``) the
    rows are grouped by ``j*`` and each group is one product ``|Q_u| |K~ - k~_u|^T``, so the
    element-wise work is ``n d`` per distinct max key instead of per row (on Qwen2.5's layers
    about 40 distinct keys for 7 heads x 32 queries).  Where most rows have a max key of their
    own, or the keys are per head, the sum is taken element-wise (``koff (G, Qc, d)``, the
    offset keys ``k~_{j*}``, when the caller has gathered them already)."""
    G, Qc, d = q.shape
    n = k.shape[-2]
    qa = q.abs()
    if k.shape[0] == 1:
        flat = js.reshape(-1)
        uniq, inv = torch.unique(flat, return_inverse=True)
        if 4 * uniq.numel() <= flat.numel():
            out = q.new_empty(G * Qc, n)
            rows = qa.reshape(G * Qc, d)
            order = torch.argsort(inv)
            for u, sel in zip(uniq.tolist(), torch.split(order, torch.bincount(inv).tolist())):
                out[sel] = rows[sel] @ (k[0] - k[0, u]).abs().T
            return out.view(G, Qc, n)
    if koff is None:
        koff = torch.gather(k.expand(G, n, d), 1, js[..., None].expand(G, Qc, d))
    return (qa[:, :, None, :] * (k[:, None] - koff[:, :, None]).abs()).sum(-1)


def coefficients(sm: Softmax, mask: torch.Tensor, sigma: torch.Tensor | None,
                 softcap: float | None, *, gauge: str = "original",
                 query_offset: int = 0, heads: Any = None) -> torch.Tensor:
    """``c_ij = e^{phi(sigma_i)} rho(z_ij - phi(sigma_i)) phi[s_ij, sigma_i] / Z_i``, ``(G, Qc, n)``.

    ``sigma (G, Qc, 1)`` is the gauge anchor in raw-score units (``None``: the original gauge,
    ``sigma = 0``).  With ``Z = e^{z_max} Zbar`` the factor is ``e^{phi(sigma) - z_max}``, kept
    inside the exponential (:func:`scaled_phi1`), so the coefficients stay finite whenever they
    are representable.  When they are not (the original gauge with every score below about -745
    in float64, -88 in float32) this raises ``FloatingPointError`` naming the head and query
    (``query_offset`` and ``heads`` translate chunk indices) -- never a silent inf or NaN.
    Zero off the mask.
    """
    sig = torch.zeros_like(sm.zmax) if sigma is None else sigma
    zsig = transform(sig, softcap)
    c = scaled_phi1(sm.z - zsig, zsig - sm.zmax) * transform_dd(sm.s, sig, softcap) / sm.zbar
    c = c.masked_fill_(~mask[None], 0.0)
    if not bool(torch.isfinite(c).all()):
        bad = (~torch.isfinite(c)).any(-1).nonzero()[0].tolist()
        head = bad[0] if heads is None else int(heads[bad[0]])
        raise FloatingPointError(
            f"gauge {gauge!r} overflows in {c.dtype} at head {head}, query "
            f"{query_offset + bad[1]}: the gauge anchor sits "
            f"{float((zsig - sm.zmax)[bad[0], bad[1], 0]):.0f} above every score, so its "
            "coefficients exceed the float range (docs/math.md section 2); use gauge='maxkey'")
    return c


def pairwise_weights(zs: torch.Tensor, mask: torch.Tensor, s: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """``D_jk = exp_phi[s_j, s_k] e^{-z_max}`` on permitted pairs, ``(G, Qc, n, n)``.

    ``zs = z - z_max <= 0`` (shifted transformed scores).  ``exp[z_j, z_k] = e^{max} rho(-|z_j -
    z_k|)`` times the transform's divided difference ``phi[s_j, s_k]`` (1 for ``phi = id``;
    then ``s`` may be omitted).  Dividing by ``Zbar`` gives the pairwise gauge's ``D/Z``.
    """
    z = zs.masked_fill(~mask[None], 0.0)
    zj, zk = z[..., :, None], z[..., None, :]
    D = torch.exp(torch.maximum(zj, zk)) * phi1(-(zj - zk).abs())
    if softcap is not None:
        D = D * transform_dd(s[..., :, None], s[..., None, :], softcap)
    pm = mask[None, :, :, None] & mask[None, :, None, :]
    return D.masked_fill_(~pm, 0.0)


def laplacian_apply(D: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(diag(D 1) - D) x`` for ``D (..., n, n)``, ``x (..., n, k)``."""
    return D.sum(-1, keepdim=True) * x - D @ x


# ---------------------------------------------------------------------------------------------
# the main term T = sum_j c_ij k^_j v^_j^T as one GEMM, in key blocks
# ---------------------------------------------------------------------------------------------
class PBlocks:
    """``P = [vec(k^_j v^_j^T)]_j`` (``n x d*r``) delivered in key blocks.

    Either slices of a whole ``P`` kept per key group, or blocks built on the fly (when ``P``
    does not fit the budget; the rebuild costs ``n d r`` per chunk, ``1/Qc`` of the GEMM).
    """

    def __init__(self, kh: torch.Tensor, vh: torch.Tensor, pfull: torch.Tensor | None,
                 key_block: int) -> None:
        self.kh, self.vh, self.pfull = kh, vh, pfull
        self.n = int(kh.shape[0])
        self.key_block = int(max(1, min(key_block, self.n)))

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        if self.pfull is not None:
            return self.pfull[lo:hi]
        d, r = self.kh.shape[-1], self.vh.shape[-1]
        return (self.kh[lo:hi, :, None] * self.vh[lo:hi, None, :]).reshape(hi - lo, d * r)

    def matmul(self, c: torch.Tensor) -> torch.Tensor:
        """``C @ P`` for ``c (..., n)``: ``(prod(...), d*r)``, accumulated over key blocks."""
        rows = c.reshape(-1, self.n)
        out = None
        for lo in range(0, self.n, self.key_block):
            hi = min(self.n, lo + self.key_block)
            pb = self(lo, hi)
            if out is None:
                out = rows[:, lo:hi] @ pb
            else:
                out.addmm_(rows[:, lo:hi], pb)
        return out


# ---------------------------------------------------------------------------------------------
# one chunk of queries, every gauge
# ---------------------------------------------------------------------------------------------
GAUGE_KINDS = ("original", "maxkey", "free", "pairwise")


def gauge_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                gauge: str = "original", beta: torch.Tensor | None = None,
                softcap: float | None = None, sigma: torch.Tensor | None = None,
                kbar: torch.Tensor | None = None, vbar: torch.Tensor | None = None,
                pblocks: PBlocks | None = None, kappa: bool = False, coeffs: bool = True,
                query_offset: int = 0, heads: Any = None,
                sink: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The identity's objects for ``G`` heads and ``Qc`` queries reading ``n`` keys.

    ``q (G, Qc, d)`` effective queries; ``k (Gk, n, d)``, ``v (Gk, n, r)`` rotated keys and values
    with ``Gk`` 1 (shared by the heads: a key group) or ``G``; ``mask (Qc, n)`` permitted sets;
    ``beta (G, Qc, n)`` additive biases; ``sigma (G, Qc)`` the anchor of a free gauge.

    ``kbar (Gk, 1, d)``/``vbar (Gk, 1, r)``: constant offsets the keys and values are centred by
    before the sums (any constant pulls out exactly; it limits cancellation in long prefixes).
    The outputs ``y_c``, ``mu_c``, ``readout_c`` are relative to ``vbar`` (equal to ``y``, ``mu``,
    ``readout`` when it is None).  ``pblocks`` (over the centred keys/values): evaluate
    ``T`` as one GEMM ``C @ P`` plus rank-one corrections instead of centring the values per
    query -- the same sum, regrouped for speed.  The pairwise gauge is evaluated densely
    (``O(n^2)`` per query); its low-rank form is :mod:`ropestep.lowrank`.

    Returns ``s, y_c, mu_c, readout_c, t`` and, where they exist, ``c`` (not for pairwise),
    ``b`` (biases), ``w`` (free gauge), ``kappa`` (when asked: the readout sum's condition
    number, docs/math.md section 9).

    ``sink (G,)``: attention sinks' logits -- one more key, zero key and value, the logit its
    bias (:func:`with_sink`), permitted to every query; the sums run over it (``pblocks``, which
    covers the given keys only, is then not used), and ``s``/``c`` come back without its column,
    the sink's coefficient as ``c_sink (G, Qc)``.
    """
    if gauge not in GAUGE_KINDS:
        raise ValueError(f"unknown gauge {gauge!r}: one of {GAUGE_KINDS}")
    G, Qc, d = q.shape
    n0 = k.shape[1]
    if sink is not None:
        if gauge == "pairwise":
            raise ValueError("attention sinks: the pairwise gauge is not evaluated with a sink")
        k, v, mask, beta = with_sink(k, v, mask, beta, sink, Qc)
        pblocks = None
    kh = k if kbar is None else k - kbar
    vh = v if vbar is None else v - vbar
    s = q @ k.transpose(-1, -2)  # (G, Qc, n) raw scores q_i . k~_j
    if beta is not None:
        s = s + beta
    sm = softmax(s, mask, softcap)
    y_c = (sm.e @ vh) / sm.zbar  # (G, Qc, r)
    mu_c = uniform_mean(vh, mask)  # (Gk, Qc, r)
    vq = None  # values centred per query (Gk, Qc, n, r): only where the form needs them
    if pblocks is None or kappa or gauge == "pairwise":
        vq = (vh[:, None] - mu_c[:, :, None]).masked_fill_(~mask[None, :, :, None], 0.0)
    out: dict[str, torch.Tensor] = {"s": s, "y_c": y_c, "mu_c": mu_c}
    if gauge == "pairwise":
        _pairwise(out, q, k, v, vq, sm, mask, beta, softcap, kappa)
    else:
        _gauge(out, q, k, kh, vh, vbar, kbar, vq, sm, mask, gauge, beta, softcap, sigma,
               pblocks, kappa, query_offset, heads)
        if not coeffs:
            del out["c"]
    if sink is not None:  # the sink's column out of the per-key outputs
        if "c" in out:
            out["c_sink"] = out["c"][..., n0]
            out["c"] = out["c"][..., :n0]
        out["s"] = out["s"][..., :n0]
    readout = out["readout_c"]
    if not bool(torch.isfinite(readout).all()):
        bad = (~torch.isfinite(readout)).any(-1).nonzero()[0].tolist()
        head = bad[0] if heads is None else int(heads[bad[0]])
        raise FloatingPointError(
            f"gauge {gauge!r}: the readout mu + q T + b is not finite in {readout.dtype} at "
            f"head {head}, query {query_offset + bad[1]} (its terms overflow the float range)")
    return out


def _gauge(out, q, k, kh, vh, vbar, kbar, vq, sm, mask, gauge, beta, softcap, sigma, pblocks,
           want_kappa, query_offset, heads) -> None:
    """Original, max-key and free-vector gauges (see :func:`gauge_chunk`)."""
    G, Qc, d = q.shape
    koff = boff = sig = None  # offsets k_o, beta_o and anchor sigma (None: zero)
    if gauge == "maxkey":
        js = max_key(sm.s, mask)  # (G, Qc)
        sig = torch.gather(sm.s, -1, js[..., None])
        koff = torch.gather(k.expand(G, *k.shape[1:]), 1, js[..., None].expand(G, Qc, d))
        if beta is not None:
            boff = torch.gather(beta, -1, js[..., None])
    elif gauge == "free":
        if sigma is None:
            raise ValueError("a free gauge needs its anchor sigma_i = u_i . g")
        sig = sigma[..., None]
    c = coefficients(sm, mask, sig, softcap, gauge=gauge, query_offset=query_offset,
                     heads=heads)
    bc = None if beta is None else (beta if boff is None else beta - boff)
    mu_c = out["mu_c"]
    if pblocks is None:  # values centred per query: T = (c * (k~ - k_o))^T (V - mu_i)
        kc = k[:, None] if koff is None else k[:, None] - koff[:, :, None]  # (G|Gk, Qc|1, n, d)
        t = (c[..., None] * kc).transpose(-1, -2) @ vq  # (G, Qc, d, r)
        w = (c[:, :, None] @ vq)[:, :, 0]  # (G, Qc, r)
        b = None if bc is None else ((c * bc)[:, :, None] @ vq)[:, :, 0]
    else:  # one GEMM over P = vec(k^ v^^T) plus rank-one corrections
        t = pblocks.matmul(c).view(G, Qc, d, -1)  # sum_j c_ij k^_j v^_j^T
        r = t.shape[-1]
        w = c @ vh - c.sum(-1, keepdim=True) * mu_c  # sum_j c_ij (v_j - mu_i)
        tv = t.view(G * Qc, d, r)
        tv.baddbmm_((c @ kh).reshape(G * Qc, d, 1),
                    mu_c.expand(G, Qc, r).reshape(G * Qc, 1, r), alpha=-1.0)
        off = torch.zeros_like(q[..., :1, :1]) if kbar is None else kbar  # k^ = k~ - kbar
        ko = (off if koff is None else off - koff).expand(G, Qc, d)  # kbar - k_o
        tv.baddbmm_(ko.reshape(G * Qc, d, 1), w.reshape(G * Qc, 1, r))
        b = None
        if bc is not None:
            cb = c * bc
            b = cb @ vh - cb.sum(-1, keepdim=True) * mu_c
    readout = mu_c + (q[:, :, None] @ t)[:, :, 0]
    if b is not None:
        readout = readout + b
        out["b"] = b
    if gauge == "free":
        readout = readout - sig * w
    out.update(c=c, t=t, w=w, readout_c=readout)
    if want_kappa:
        # kappa = sum_j |c_j| (|q| . |k~_j - k_o| + |beta_j - beta_o| + |sigma|)
        #               (|v_j - mu|_inf + |v_j|_inf) / max_j |v_j|_inf     (docs/math.md section 9)
        if koff is None:
            absdot = q.abs() @ k.abs().transpose(-1, -2)  # (G, Qc, n)
        else:
            absdot = abs_offset_dots(q, k, js, koff)
        if bc is not None:
            absdot = absdot + bc.abs()
        if sig is not None and gauge == "free":
            absdot = absdot + sig.abs()
        out["kappa"] = kappa_sum(c.abs() * absdot, vq, vh if vbar is None else vh + vbar, mask)


def _pairwise(out, q, k, v, vq, sm, mask, beta, softcap, want_kappa) -> None:
    """Pairwise gauge, dense: ``T = (1/(N Zbar)) K~c^T (diag(D 1) - D) (V - mu)``.

    ``D = exp_phi[s_j, s_k] e^{-z_max}`` (:func:`pairwise_weights`); the Laplacian annihilates
    constants, so keys and biases are centred on their permitted means first (a large common
    offset never enters the sums).
    """
    D = pairwise_weights(sm.z - sm.zmax, mask, sm.s, softcap) / sm.zbar[..., None]
    nper = mask.sum(-1).to(q.dtype)[None, :, None, None]  # (1, Qc, 1, 1)
    lv = laplacian_apply(D, vq) / nper  # (G, Qc, n, r)
    w8 = mask.to(q.dtype)[None, :, :, None] / nper  # (1, Qc, n, 1)
    kc = k[:, None] - (w8 * k[:, None]).sum(2, keepdim=True)  # (Gk, Qc, n, d)
    t = kc.transpose(-1, -2) @ lv  # (G, Qc, d, r)
    readout = out["mu_c"] + (q[:, :, None] @ t)[:, :, 0]
    bc = None
    if beta is not None:
        bc = beta - (w8[..., 0] * beta).sum(-1, keepdim=True)
        b = (bc[:, :, None] @ lv)[:, :, 0]
        readout = readout + b
        out["b"] = b
    out.update(t=t, readout_c=readout)
    if want_kappa:
        # the contraction q . T rounds at |q| . |kc_j| per key, and lv_j itself at
        # sum_k D_jk (|v_j - mu| + |v_j| + |v_k - mu| + |v_k|) / N
        m3 = mask[None]
        va = torch.where(m3, v.abs().amax(-1)[:, None, :], torch.zeros_like(sm.s))
        vab = vq.abs().amax(-1) + va  # (G, Qc, n)
        lvb = (D.sum(-1) * vab + (D @ vab[..., None])[..., 0]) / nper[..., 0]
        absdot = (q.abs()[:, :, None, :] * kc.abs()).sum(-1)
        if bc is not None:
            absdot = absdot + bc.abs()
        out["kappa"] = (absdot * lvb).sum(-1) / va.amax(-1).clamp_min(torch.finfo(q.dtype).tiny)


def kappa_sum(weight: torch.Tensor, vq: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
              ) -> torch.Tensor:
    """``sum_j weight_j (|v_j - mu|_inf + |v_j|_inf) / max_j |v_j|_inf`` over the permitted set.

    ``weight (G, Qc, n)``, ``vq (Gk, Qc, n, r)`` centred values (0 off the mask), ``v (Gk, n, r)``.
    """
    m3 = mask[None]
    va = torch.where(m3, v.abs().amax(-1)[:, None, :], torch.zeros_like(weight))  # (G, Qc, n)
    vn = vq.abs().amax(-1) + va
    return (weight * vn).sum(-1) / va.amax(-1).clamp_min(torch.finfo(vn.dtype).tiny)
