"""Checks of the identity's conventions and claims on a real model's heads.

Every function takes what a capture of a pretrained model provides -- the loaded Hugging Face
model (any the adapter reads, :mod:`ropestep.models`), a layer index, the layer's head input ``x``
(the ``input_layernorm`` output), positions and, where useful, the per-head attention outputs the
model computed -- and returns a JSON-ready dict: the measured value(s), the tolerance, where the
tolerance comes from (``tolerance_from``: a function of :mod:`ropestep.tolerances` and the
quantities it was given) and ``ok``.  A NaN or inf anywhere is a failure (``ok`` False): every
reduction goes through :func:`ropestep.verdict.worst` / :func:`~ropestep.verdict.least` and every
pass predicate through :func:`~ropestep.verdict.within`.

* :func:`conventions` -- the model's own ``q_proj``/``k_proj``/``v_proj`` (and ``q_norm``/
  ``k_norm``), its ``apply_rotary_pos_emb`` with its own ``rotary_emb`` tables and its
  ``repeat_kv``, against what ropestep builds from the head description (docs/math.md section
  1).  Independent of :mod:`ropestep.spec`'s conventions, so a wrong pairing, GQA map or norm
  that the exact and the fast layers would share is caught here.
* :func:`sample_rows`, :func:`exact_reference`, :func:`exact_rows` -- a seeded sample of
  (head, query) rows evaluated with the mpmath oracle (:mod:`ropestep.exact`, 50 digits) on the
  captured inputs and weights, against the float64 fast path (docs/math.md sections 3 and 9).
* :func:`positive_coefficients`, :func:`delta_m_rank`, :func:`no_global_readout`,
  :func:`position_derivative`, :func:`position_shift` -- the paper's claims on real heads:
  ``c_ij > 0`` (section 3), ``rank(Delta M_i W_o) <= d`` (section 3), no global affine readout
  (section 7), and the positional derivative and exact finite differences through the RoPE
  generator and ``phi_1(delta A)`` against the model's own attention function (section 5).

Score families ``"dot"`` (affine in the layer input ``u``: Llama, Qwen2, ...) and ``"qknorm"``
(an RMSNorm on q and k before RoPE: per head for Qwen3 and Gemma 3 -- whose gain acts as
``1 + w`` --, over the whole projection for OLMo 2, ``HeadSpec.norm_scope == "all"``).  For
QK-norm heads the identity holds in query space, ``y_i = mu_i + z_i^T Delta M^q_i`` with
``z_i = [q~_i; 1]`` the normalised rotated query: :func:`exact_rows` compares ``Delta M^q_i``
there (``"space": "query"``), :func:`conventions` and the positional checks include the model's
own norms and ropestep's (the norms do not depend on positions), and their tolerances add the
norm's roundings (:func:`_normalised_abs`, :func:`_norm_terms`).  The input-space claims --
:func:`delta_m_rank` and :func:`no_global_readout` -- are not defined for a score that is not
affine in ``u`` and refuse it; any other family (``"cosine"``) raises ``ValueError``.
Imports :mod:`ropestep.models` and the layers below it, never the experiments above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import mpmath as mp
import numpy as np
import torch

from . import exact, fast, kernel, models, rope
from . import tolerances as tl
from .models.conventions import _qk_norm_reading, qk_norms
from .models.structure import onloaded
from .spec import (HeadSpec, HeadWeights, RoPESpec, _positions, first_permitted,
                   query_temperature as _query_temperature)
from .verdict import finite, least, within, worst

F64 = torch.float64
U64 = 2.0 ** -53

__all__ = [
    "conventions", "sample_rows", "ExactReference", "exact_reference", "exact_rows",
    "positive_coefficients", "delta_m_rank", "no_global_readout", "position_derivative",
    "position_shift",
]


# ---------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------
def _f64(a: Any, name: str) -> torch.Tensor:
    """A float tensor (numpy or torch) as float64 on the CPU; rejects non-float and non-finite."""
    if a is None:
        raise ValueError(f"{name} is missing")
    t = a.detach().cpu() if torch.is_tensor(a) else torch.as_tensor(np.asarray(a))
    if not (t.is_floating_point()):
        raise ValueError(f"{name} must hold floats, got dtype {t.dtype}")
    t = t.to(F64)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return t


def _x(x: Any, m: int | None, name: str = "x") -> torch.Tensor:
    t = _f64(x, name)
    if t.ndim != 2 or t.shape[0] < 1:
        raise ValueError(f"{name} must have shape (tokens, m), got {tuple(t.shape)}")
    if m is not None and t.shape[1] != m:
        raise ValueError(f"{name} has width {t.shape[1]}, the layer's input width is {m}")
    return t


def _pos(p: Any, n: int, name: str = "positions", increasing: bool = False) -> torch.Tensor:
    try:
        arr = _positions(p, name)
    except TypeError as err:
        raise ValueError(str(err)) from None
    if arr.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {arr.shape}")
    if n and int(arr.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(arr.min())}")
    if increasing and n > 1 and not bool(np.all(np.diff(arr) > 0)):
        raise ValueError(f"{name} must be strictly increasing (the model masks by sequence "
                         "order, so positions must follow it)")
    return torch.as_tensor(arr)


FAMILIES = ("dot", "qknorm", "latent")
"""The score families the checks cover: ``"dot"`` (Llama, Qwen2, ...), ``"qknorm"`` (Qwen3,
Gemma 3 per head; OLMo 2 over the whole projection) and ``"latent"`` (multi-head latent
attention in its absorbed form: the checks stated on the head description -- coefficients,
oracle rows, rank -- not those that rebuild the model's per-head projections)."""


def _supported(spec: HeadSpec) -> None:
    if not isinstance(spec, HeadSpec):
        raise ValueError(f"spec must be a HeadSpec, got {type(spec).__name__}")
    if spec.family not in FAMILIES:
        raise ValueError(f"score family {spec.family!r} is not covered by realchecks (they cover "
                         "'dot': Llama, Qwen2; 'qknorm': Qwen3, Gemma 3, OLMo 2; and 'latent')")


def _affine(spec: HeadSpec, check: str) -> None:
    """The input-space claims (``Delta M_i`` of ``u_i``) need a score affine in ``u``."""
    _supported(spec)
    if not spec.affine:
        raise ValueError(f"{check}: the claim is stated in input space (Delta M_i of u_i = "
                         f"[x_i; 1]) and is not defined for a non-affine score (family "
                         f"{spec.family!r}: q and k are normalised before RoPE)")


def _bank(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any, x_kv: Any,
          pos_kv: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Queries ``x``/``positions`` and keys (``x_kv``/``pos_kv``, default the queries themselves);
    the permitted sets are causal in positions (``pos_kv <= pos_q``).  Returns float64 tensors."""
    _supported(spec)
    if not isinstance(weights, HeadWeights):
        raise ValueError(f"weights must be HeadWeights, got {type(weights).__name__}")
    m = weights.check(spec)
    xq = _x(x, m)
    pq = _pos(positions, xq.shape[0])
    if (x_kv is None) != (pos_kv is None):
        raise ValueError("give both x_kv and pos_kv, or neither")
    if x_kv is None:
        xk, pk = xq, pq
    else:
        xk = _x(x_kv, m, "x_kv")
        pk = _pos(pos_kv, xk.shape[0], "pos_kv")
    mask = pk[None, :] <= pq[:, None]
    empty = torch.nonzero(~mask.any(1)).flatten()
    if empty.numel():
        raise ValueError(f"queries {empty[:8].tolist()} have no key at or before their position")
    if spec.rope.cos is not None:
        P = int(np.asarray(spec.rope.cos).shape[0])
        hi = max(int(pq.max()), int(pk.max()))
        if hi >= P:
            raise ValueError(f"positions up to {hi} but the RoPE tables cover [0, {P})")
    return xq, pq, xk, pk, m


def _rows(rows: Any, n_heads: int, n_queries: int) -> list[tuple[int, int]]:
    try:
        out = [(int(h), int(i)) for h, i in rows]
    except (TypeError, ValueError):
        raise ValueError("rows must be a sequence of (head, query) pairs") from None
    if not out:
        raise ValueError("no rows given")
    for h, i in out:
        if not (0 <= h < n_heads and 0 <= i < n_queries):
            raise ValueError(f"row (head {h}, query {i}) out of range: {n_heads} heads, "
                             f"{n_queries} queries")
    return list(dict.fromkeys(out))


def _model_parts(model: Any, layer: Any) -> tuple[models.ModelInfo, Any, dict]:
    """``(info, the layer's conventions, its projections)`` after the adapter's reading."""
    # the adapter names what it cannot read (no config, no RoPE, ...); an AttributeError from
    # inside the reading (a transformers release it does not know) propagates as is
    info = models.describe_model(model)
    if info.family not in FAMILIES:
        raise ValueError(f"{info.name}: score family {info.family!r} is not covered by "
                         "realchecks (they cover 'dot' and 'qknorm')")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise ValueError(f"layer must be an int, got {type(layer).__name__}")
    if not 0 <= int(layer) < info.n_layers:
        raise ValueError(f"{info.name}: layer {layer} out of range 0..{info.n_layers - 1}")
    _, conv, _, parts, _ = models.attention.layer_parts(model, int(layer), info)
    return info.for_layer(int(layer)), conv, parts


def _head(model: Any, layer: int, n_positions: int, head: Any) -> tuple[HeadSpec, HeadWeights]:
    if head is None:
        return models.layer_head(model, layer, n_positions)
    spec, weights = head
    _supported(spec)
    if not isinstance(weights, HeadWeights):
        raise ValueError(f"weights must be HeadWeights, got {type(weights).__name__}")
    try:
        weights.check(spec)
    except TypeError as err:
        raise ValueError(str(err)) from None
    if spec.rope.cos is not None and int(np.asarray(spec.rope.cos).shape[0]) < n_positions:
        raise ValueError(f"the given head's RoPE tables cover {np.asarray(spec.rope.cos).shape[0]} "
                         f"positions, {n_positions} are needed")
    return spec, weights


def _device_dtype(model: Any) -> tuple[Any, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


# ---------------------------------------------------------------------------------------------
# QK-norm: the layer's own norms, and what they do to the rounding bounds
# ---------------------------------------------------------------------------------------------
def _model_norms(model: Any, layer: int, info: models.ModelInfo, conv: Any) -> dict | None:
    """The layer's own ``q_norm``/``k_norm`` as the model applies them, or None without QK-norm:
    ``{"scope": "head" | "all", "q": (g, eps), "k": (g, eps), "bias": {"q": beta, "k": beta}}``
    (``beta`` a LayerNorm's bias, None for an RMS norm) with the gain ``g`` in the
    model's head-dim order, float64 -- ``(d,)`` for a norm over each head's features after the
    projection's reshape (Qwen3, Gemma 3), ``(heads, d)`` for one over the whole projection of a
    token before it (OLMo 2: ``heads * d`` features).  ``g`` is probed from the module's action
    (:func:`ropestep.models.conventions._qk_norm_reading`: Gemma's ``x (1 + w)`` is read as it
    acts), ``eps`` is the module's own; nothing comes from the head description under check."""
    if not conv.qk_norm:
        return None
    _, _, attn, _, _ = models.attention.layer_parts(model, int(layer), info)
    info = info.for_layer(int(layer))
    H, Hk, d = info.n_heads, info.n_kv_heads, info.head_dim
    full = conv.norm_scope == "all"
    out: dict = {"scope": conv.norm_scope, "bias": {}}
    with onloaded(attn):
        for nm, nh, mod in zip(("q", "k"), (H, Hk), qk_norms(attn)):
            # an RMS norm, or a LayerNorm with a bias (Persimmon: beta not None)
            g, eps, _, beta = _qk_norm_reading(mod, nh * d if full else d,
                                               f"{info.name}: layer {layer} {nm} norm")
            out[nm] = (g.view(nh, d) if full else g, float(eps))
            out["bias"][nm] = beta
    return out


def _apply_model_norm(z: torch.Tensor, g: torch.Tensor, eps: float, scope: str,
                      beta: torch.Tensor | None = None) -> torch.Tensor:
    """``g z / sqrt(mean(z^2) + eps)`` of ``z (n, heads, d)`` (model head-dim order, float64) the
    way the layer applies its norm: over each head's ``d`` features (``scope="head"``: Qwen3's
    and Gemma 3's norm after ``view(..., -1, head_dim)``), or over all ``heads * d`` features of
    a token (``"all"``: OLMo 2's norm of ``q_proj(x)`` before the reshape).  With ``beta``, the
    layer's LayerNorm: ``g (z - mean z) / sqrt(mean (z - mean z)^2 + eps) + beta`` per head."""
    if beta is not None:
        zc = z - z.mean(-1, keepdim=True)
        return zc * torch.rsqrt(zc.pow(2).mean(-1, keepdim=True) + eps) * g + beta
    if scope == "all":
        flat = z.reshape(z.shape[0], -1)
        return (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)).view_as(z) * g
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * g


def _normalised_abs(dtype: torch.dtype, z: torch.Tensor, A: torch.Tensor, n_terms: int,
                    g: torch.Tensor, eps: float, scope: str, roundings: int,
                    beta: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise bound, before the rotation pair's sum, of a QK-normalised rotated query or key
    that one side computes in ``dtype``, against exact arithmetic on the same inputs and table
    values: ``z = x W^T + b`` (``z``, ``A = |x| |W|^T + |b|``: ``(n, heads, d)``, model head-dim
    order, float64), ``y = g z / r(z)`` with ``r(z) = sqrt(mean(z^2) + eps)`` over the norm's
    ``n`` features (one head's ``d``, or every head's of a token for ``scope="all"``), then
    rotated.  The caller sums the result over the rotation pair and multiplies it by the tables'
    amplitude ``max(a, 1)``, as :func:`ropestep.tolerances.rotated_projection_abs` is used::

        E    = rotated_projection_abs(dtype, A, n_terms)        (the projection's error)
        rho  = rms(E),  r = r(z),  r_lo = r - rho               (over the norm's features)
        Y    = |g| (|z| + E) / r_lo                             (bounds |y| on both sides)
        E_n  = |g| (E / r_lo + |z| rho / (r r_lo)) + ((HM_LAMBDA sqrt(n) + 8) u_acc + 2 u_store) Y
        out  = E_n + roundings * u_store * Y

    Derivation.  The side normalises ``z^ = z + e``, ``|e| <= E`` entrywise
    (:func:`~ropestep.tolerances.rotated_projection_abs`'s projection and store; its ``3 u_store
    A`` for a rotation that this projection does not yet make is margin).  Since ``r(z)`` is the
    Euclidean norm of ``[z / sqrt(n), sqrt(eps)]``, the triangle inequality gives ``|r(z^) -
    r(z)| <= ||e||_2 / sqrt(n) = rms(e) <= rho``, so ``r(z^) >= r_lo`` and
    ``z^/r(z^) - z/r(z) = e / r(z^) + z (r(z) - r(z^)) / (r(z) r(z^))`` is entrywise at most
    ``E / r_lo + |z| rho / (r r_lo)`` (not first order: exact), times ``|g|``.  The norm's own
    arithmetic in ``u_acc`` (transformers' RMSNorms compute in float32, or wider): ``n`` rounded
    squares and their non-negative sum (``HM_LAMBDA sqrt(n) u_acc`` relative, the probabilistic
    bound of ``HM_LAMBDA``), the division by ``n``, ``+ eps``, the reciprocal square root (half
    its argument's relative error, plus two ulps of its own), the products with ``z`` and with
    the gain (and Gemma's ``1 + w``): at most ``(HM_LAMBDA sqrt(n) + 8) u_acc`` relative to
    ``|y|``, plus two stores to the storage dtype (the normalised vector and the weighted one;
    ``2 u_store``).  The rotation rounds two products and a sum, ``3 u_store (|y_c| + |y_c'|)``
    (``roundings = 3``; fast.project's multiplication by the score scale and the check's division
    by it add two: ``roundings = 5``).  A bound that cannot be stated (``r_lo <= 0``: an error as
    large as the vector's RMS) is NaN, a failure.

    A LayerNorm with a bias ``beta`` (Persimmon: ``y = g (z - mean z) / r(z - mean z) + beta``,
    per head): the side centres ``z^`` with its own computed mean, whose error is at most
    ``mean(E)`` (the inputs') plus ``(HM_LAMBDA sqrt(n) + 1) u_acc max(|z| + E)`` (the rounded
    sum of ``n`` terms and the division), and rounds the subtraction (at most
    ``2 u_acc max(|z| + E)``: the difference of two such numbers); so the centred vector carries
    ``E_c = E + mean(E) + (HM_LAMBDA sqrt(n) + 3) u_acc max(|z| + E)``
    and the RMS step above applies to ``z - mean z`` with ``E_c``.  The bias's addition rounds
    once more and is stored: ``(u_acc + u_store) Y'`` with ``Y' = Y + |beta|`` bounding the
    output, which also carries the rotation's roundings.
    """
    u_acc = tl.unit_roundoff(dtype)
    u_store = tl.STORAGE_ROUNDOFF.get(dtype, u_acc)
    red = (-1,) if scope == "head" else (-2, -1)
    n = z.shape[-1] if scope == "head" else z.shape[-1] * z.shape[-2]
    E = tl.rotated_projection_abs(dtype, A, n_terms)
    if beta is not None:  # LayerNorm: centred by the side's own mean (docstring)
        zE = (z.abs() + E).amax(red, keepdim=True)
        E = E + E.mean(red, keepdim=True) + (tl.HM_LAMBDA * math.sqrt(n) + 3.0) * u_acc * zE
        z = z - z.mean(red, keepdim=True)
    rho = E.pow(2).mean(red, keepdim=True).sqrt()
    r = (z.pow(2).mean(red, keepdim=True) + eps).sqrt()
    r_lo = torch.where(r > rho, r - rho, torch.full_like(r, math.nan))
    ga = g.abs()
    Y = ga * (z.abs() + E) / r_lo
    En = ga * (E / r_lo + z.abs() * rho / (r * r_lo)) \
        + ((tl.HM_LAMBDA * math.sqrt(n) + 8.0) * u_acc + 2.0 * u_store) * Y
    if beta is not None:  # the bias's addition and store
        Y = Y + beta.abs()
        En = En + (u_acc + u_store) * Y
    return En + roundings * u_store * Y


def centring_gain(z: torch.Tensor) -> float:
    """``max |z| / rms(z - mean z)`` over the rows of raw per-head projections ``z (..., d)``
    (at least 1): how much a LayerNorm's centring magnifies an error relative to ``|z|`` (a
    common offset of the entries cancels in ``z - mean z``, their rounding does not)."""
    zc = z - z.mean(-1, keepdim=True)
    r = zc.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(tl.SCALE_GUARD)
    return max(1.0, float((z.abs().amax(-1, keepdim=True) / r).max()))


def _head_centring_gain(spec: HeadSpec, weights: HeadWeights, x64: torch.Tensor) -> float:
    """:func:`centring_gain` of a LayerNorm head description's raw queries and keys on
    ``x64 (n, m)`` (1 for every other head)."""
    if spec.family != "qknorm" or spec.norm_kind != "layer":
        return 1.0

    def raw(w: Any, b: Any) -> torch.Tensor:
        z = torch.einsum("nm,mhd->hnd", x64, torch.as_tensor(w).to("cpu", F64))
        return z if b is None else z + torch.as_tensor(b).to("cpu", F64)[:, None]

    return max(centring_gain(raw(weights.w_q, weights.b_q)),
               centring_gain(raw(weights.w_k, weights.b_k)))


def _norm_terms(info: models.ModelInfo, conv: Any, spec: HeadSpec | None,
                gain: float = 1.0) -> int:
    """The ``hidden`` count handed to :func:`ropestep.tolerances.agreement_rel_tol` (and
    :func:`~ropestep.tolerances.position_eval_abs`, :func:`~ropestep.tolerances.native_rel_tol`)
    for this layer: ``m`` for an affine head; ``2 m + n + 8`` where either side normalises q and
    k (``n`` the norm's features: ``d``, or ``H d`` over the whole projection).

    Derivation, first order as :func:`~ropestep.tolerances.agreement_rel_tol`'s: a projected
    entry carries ``gamma_m`` relative to its absolute terms; :func:`_normalised_abs` shows the
    normalised entry carries that error divided by the RMS (the same relative size) plus the
    entry times the error's RMS over the RMS (a second ``gamma_m`` of the normalised entry) plus
    the norm's own ``n`` squares summed, the square root and the products (``n / 2 + 4`` roundings
    first order, counted as ``n + 8``): ``m + (m + n + 8)`` in all, per side, each side's errors
    inside the margin as before.

    A LayerNorm (``norm_kind "layer"``) first centres each head's projection: the centred
    entry's error is the projected entries' (``gamma_m`` of ``|z|``) plus the mean's ``n``
    roundings, now relative to ``rms(z - mean z)``, which a common offset of the entries can make
    far smaller than ``|z|``.  So the norm's part is magnified by ``gain`` =
    :func:`centring_gain` (``max |z| / rms(z - mean z)``, measured on the layer's own
    projections) and counts the centring's ``n + 2`` roundings too:
    ``m + ceil(gain (m + 2 n + 10))``."""
    qk = conv.qk_norm or (spec is not None and spec.family == "qknorm")
    if not qk:
        return int(conv.input_dim or info.hidden)
    full = conv.norm_scope == "all" or (spec is not None and spec.norm_scope == "all")
    n = info.n_heads * info.head_dim if full else info.head_dim
    layer = conv.norm_kind == "layer" or (spec is not None and spec.norm_kind == "layer")
    return _qk_norm_count(int(conv.input_dim or info.hidden), n, gain if layer else None)


def _qk_norm_count(m: int, n: int, gain: float | None = None) -> int:
    """:func:`_norm_terms` of a QK-norm layer: ``2 m + n + 8`` for ``m`` inputs and an RMS norm
    over ``n`` features; ``m + ceil(gain (m + 2 n + 10))`` for a LayerNorm whose centring
    magnifies errors by ``gain`` (:func:`centring_gain`)."""
    if gain is not None:
        return int(m) + int(math.ceil(gain * (int(m) + 2 * int(n) + 10)))
    return 2 * int(m) + int(n) + 8


# ---------------------------------------------------------------------------------------------
# 1. conventions: the model's own projections, RoPE and GQA against ropestep's
# ---------------------------------------------------------------------------------------------
def conventions(model: Any, layer: int, x: Any, positions: Any, *,
                head: tuple[HeadSpec, HeadWeights] | None = None,
                record: dict | None = None) -> dict:
    """Rotated queries, rotated keys and values per query head: the model's way against ropestep's
    (docs/math.md section 1).

    Model side, in the model's dtype on its device, nothing from :mod:`ropestep.spec` or
    :mod:`ropestep.rope`: the layer's own ``q_proj``/``k_proj``/``v_proj`` modules (and its own
    ``q_norm``/``k_norm``, applied by its forward: per head after the reshape, or over the whole
    projection for OLMo 2, before RoPE), its rotary module's tables
    (``model.model.rotary_emb(x, positions)``), the modeling module's ``apply_rotary_pos_emb``
    and ``repeat_kv`` (taken from ``sys.modules`` of the attention class).  Ropestep side, float64, from the head description (``head``, default
    :func:`ropestep.models.layer_head`): two routes, both must agree --

    * ``"spec"``: ``x @ w_q + b_q`` (for family ``"qknorm"`` normalised by
      :func:`ropestep.kernel.qk_norm` with ``weights.q_norm``/``k_norm`` (and, for a LayerNorm,
      ``q_norm_bias``/``k_norm_bias``), ``spec.norm_eps``, ``spec.norm_scope`` and
      ``spec.norm_kind``) rotated by :func:`ropestep.rope.apply_rope` with
      :func:`ropestep.rope.rope_cos_sin` and ``spec.rope.layout``; keys and values of query head
      ``h`` taken from KV head ``spec.kv_head(h)`` (the map :mod:`ropestep.exact` uses);
    * ``"fast.project"``: :func:`ropestep.fast.project`'s rotated queries (divided by the score
      scale), keys and values per query head (the GQA map and rotation the fast layer uses).

    Per query head, ``q_rel``/``k_rel``/``v_rel`` are the normwise relative differences
    ``max|model - ropestep| / max|model|`` (worst route).  Tolerance ``q_tol`` etc.: the
    elementwise bound :func:`ropestep.tolerances.rotated_projection_abs` of the model's
    ``dtype`` computation plus that of ropestep's float64 one, each with ``A = |x| |W|^T + |b|``
    summed over the rotation pair (the pair the *model* rotates together: ``|rotate_half(A)|``
    is the partner's) and mapped to query heads by the model's ``repeat_kv``, reduced as
    ``max(bound) / max|model|``.  A layer with QK-norm bounds its normalised rotated queries and
    keys by :func:`_normalised_abs` instead (the same projection error carried through the norm,
    exactly, plus the norm's own roundings; the model's norm gains ``g`` as its modules act), the
    model's side with 3 rotation roundings and ropestep's float64 side with 5 (fast.project's
    score scale and the division by it), summed over the rotation pair as above.  Both sides
    read the same ``dtype``-rounded ``x`` and the same RoPE table values
    (:func:`ropestep.models.layer_head` takes the model's own tables).  The
    score scale ``spec.score_scale(h)`` is compared with the module's ``scaling`` (relative,
    ``nonnegative_ops_rel(8)``: each side is a square root and a quotient, or a power faithful
    to an ulp -- two roundings of a positive number each -- and the model's side is further
    multiplied by the tables' amplitude squared (YaRN/LongRoPE's ``a``: two more roundings), so
    the two differ by at most ``gamma_4 + gamma_4 <= gamma_8``, in any order of evaluation).
    The amplitude is read where it is exact whatever the positions: ``cos`` at position 0 of
    the layer's own rotary call (``cos 0 = 1``, so the entry is ``a`` as the tables store it,
    the value :mod:`ropestep.models.conventions` read for the head description); the call's
    own tables start at ``positions[0]``.  A wrong pairing moves a rotated vector by O(1) at every position but
    0, a wrong GQA map by O(1) on the heads it misroutes.

    ``record``: a dict that receives what the model side computed (for ``--dump-raw``; the
    result is the same without it): the module's own rotated ``query (H, n, d)`` and ``key
    (H_kv, n, d)`` and its ``value (H_kv, n, r)`` (model dtype, model head-dim order), the tables
    it was handed (``rotary_cos``/``rotary_sin``, ``(n, R)``), the ``scaling`` it passed,
    ``head_order`` (model head-dim order to ropestep's), and the layer's ``amplitude``,
    ``softcap`` and ``window`` (0 for none).
    """
    info, conv, parts = _model_parts(model, layer)
    xt = _x(x, conv.input_dim or info.hidden)
    n = xt.shape[0]
    pos = _pos(positions, n)
    spec, weights = _head(model, int(layer), int(pos.max()) + 1, head)
    H, Hk, d, r = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.r
    if (H, Hk, d) != (info.n_heads, info.n_kv_heads, info.head_dim):
        raise ValueError(f"head description has (H, H_kv, d) = {(H, Hk, d)}, the model "
                         f"{(info.n_heads, info.n_kv_heads, info.head_dim)}")
    dev, mdt = _device_dtype(model)
    xm = xt.to(dev, mdt)  # what the model reads; ropestep reads the same rounded values
    x64 = xm.to("cpu", F64)
    group = info.group
    perm = models.attention.head_order(conv, d)  # model head-dim order -> ropestep's
    a = conv.amplitude  # the model's tables are a (cos, sin); ropestep's are unit

    # -- model side: the layer's own attention module on x (models.attention.run_attention) --
    rec = models.attention.run_attention(model, int(layer), xm, pos, info)
    q_mod = rec.query[0].to("cpu", F64)[..., perm]  # (H, n, d)
    # query head h reads KV head h // group: the map the layer's eager attention was checked to
    # use on its own output (models.conventions.read_layer)
    k_mod = rec.key[0].to("cpu", F64).repeat_interleave(group, 0)[..., perm]
    v_mod = rec.value[0].to("cpu", F64).repeat_interleave(group, 0)

    # elementwise bounds A = |x| |W|^T + |b| (float64), summed over the model's rotation pair
    def abs_terms(part: tuple, nh: int, rotated: bool) -> torch.Tensor:
        A = models.layouts.project(part, x64, nh)[1].transpose(0, 1)
        if rotated:
            A = models.attention.pair_sum(A, conv)[..., perm] * max(a, 1.0)
        return A

    kterms = (conv.input_dim or info.hidden) + (parts["q"][1] is not None)
    norms = _model_norms(model, int(layer), info, conv)

    def normed_bound(part: tuple, nh: int, name: str) -> torch.Tensor:
        """QK-norm: the model's side in its dtype plus ropestep's in float64 (_normalised_abs),
        summed over the model's rotation pair, (nh, n, d) in ropestep's head-dim order."""
        z, A = models.layouts.project(part, x64, nh)
        g, eps = norms[name]
        beta = norms["bias"].get(name)
        if conv.norm_after_rope:  # the norm acts on the rotated vector (Hunyuan): the rotated
            # projection's terms, summed over the pair, carried through the norm of R z
            cs_, sn_ = models.attention.per_pair_tables(model, conv, pos)
            zr = models.attention.rotate_as_model(z.transpose(0, 1), cs_.to("cpu", F64),
                                                  sn_.to("cpu", F64), conv).transpose(0, 1)
            Ar = models.attention.pair_sum(A, conv) * max(a, 1.0)
            both = (_normalised_abs(mdt, zr, Ar, kterms, g, eps, "head", 3)
                    + _normalised_abs(F64, zr, Ar, kterms, g, eps, "head", 5))
            return both[..., perm].transpose(0, 1)
        both = (_normalised_abs(mdt, z, A, kterms, g, eps, norms["scope"], 3, beta)
                + _normalised_abs(F64, z, A, kterms, g, eps, norms["scope"], 5, beta))
        return (models.attention.pair_sum(both, conv)[..., perm] * max(a, 1.0)).transpose(0, 1)

    Av = abs_terms(parts["v"], Hk, False).repeat_interleave(group, 0) * abs(conv.value_scale)
    if norms is None:
        Aq = abs_terms(parts["q"], H, True)
        Ak = abs_terms(parts["k"], Hk, True).repeat_interleave(group, 0)
        bound = {name: (tl.rotated_projection_abs(mdt, A_, kterms)
                        + tl.rotated_projection_abs(F64, A_, kterms))
                 for name, A_ in (("q", Aq), ("k", Ak), ("v", Av))}
    else:
        bound = {"q": normed_bound(parts["q"], H, "q"),
                 "k": normed_bound(parts["k"], Hk, "k").repeat_interleave(group, 0),
                 "v": (tl.rotated_projection_abs(mdt, Av, kterms)
                       + tl.rotated_projection_abs(F64, Av, kterms))}
    # values are not rotated: their A is not paired, and the bound's rotation roundings
    # (3 of its 4 u_store) are then margin
    if spec.query_temperature is not None:  # the model's q times its tau (log1p, a product and
        # a sum, then the product with q: 4 roundings of the model's dtype) against ropestep's
        tq = torch.tensor([_query_temperature(*spec.query_temperature, int(p))
                           for p in pos], dtype=F64)[None, :, None]
        bound["q"] = bound["q"] * tq + 4 * tl.unit_roundoff(mdt) * q_mod.abs()

    # -- ropestep side, route "spec" --
    wq, wk, wv = (torch.as_tensor(getattr(weights, k)).to("cpu", F64)
                  for k in ("w_q", "w_k", "w_v"))

    def bias(b: Any, nh: int, dim: int) -> torch.Tensor:
        return torch.zeros(nh, dim, dtype=F64) if b is None else torch.as_tensor(b).to("cpu", F64)

    q0 = kernel.clipped(torch.einsum("nm,mhd->hnd", x64, wq) + bias(weights.b_q, H, d)[:, None],
                        spec.clip)
    k0 = kernel.clipped(torch.einsum("nm,mhd->hnd", x64, wk) + bias(weights.b_k, Hk, d)[:, None],
                        spec.clip)
    v0 = kernel.clipped(torch.einsum("nm,mhd->hnd", x64, wv) + bias(weights.b_v, Hk, r)[:, None],
                        spec.clip)
    after = spec.norm_after_rope  # the description's norms act on the rotated vectors
    if spec.family == "qknorm" and not after:  # the description's norms, before RoPE
        def f64(a: Any) -> torch.Tensor | None:
            return None if a is None else torch.as_tensor(a).to("cpu", F64)

        q0 = kernel.qk_norm(q0, f64(weights.q_norm), spec.norm_eps, spec.norm_scope,
                            spec.norm_kind, f64(weights.q_norm_bias))
        k0 = kernel.qk_norm(k0, f64(weights.k_norm), spec.norm_eps, spec.norm_scope,
                            spec.norm_kind, f64(weights.k_norm_bias))
    cs, sn = rope.rope_cos_sin(spec, pos, F64)  # (H or 1, n, d/2)

    def post(z: torch.Tensor, w: Any) -> torch.Tensor:  # norm after the rotation (Hunyuan)
        return kernel.rms_norm(z, torch.as_tensor(w).to("cpu", F64), spec.norm_eps) * a if \
            after else z * a

    cq, sq = rope.query_cos_sin(spec, pos, F64)  # a query temperature folded in
    qs = post(rope.apply_rope(q0, cq, sq, spec.rope.layout), weights.q_norm)
    kv_map = [spec.kv_head(h) for h in range(H)]
    for h, g in enumerate(kv_map):
        if not 0 <= g < Hk:
            raise ValueError(f"spec.kv_head({h}) = {g} is not a KV head (0..{Hk - 1})")
    hb = [min(h, cs.shape[0] - 1) for h in range(H)]  # the table row of head h's base
    ks = torch.stack([post(rope.apply_rope(k0[g], cs[hb[h]], sn[hb[h]], spec.rope.layout),
                           weights.k_norm) for h, g in enumerate(kv_map)])
    vs = torch.stack([v0[g] for g in kv_map])

    # -- ropestep side, route "fast.project" --
    P = fast.project(spec, weights, x64, pos, x64, pos, dtype=F64)
    qf = P.q / P.scale[:, None, None] * a
    Pk = P.k * a

    def rel(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:  # per head, normwise
        den = ref.abs().flatten(1).max(1).values.clamp_min(tl.SCALE_GUARD)
        return (a - ref).abs().flatten(1).max(1).values / den

    def tol(b: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        den = ref.abs().flatten(1).max(1).values.clamp_min(tl.SCALE_GUARD)
        return b.flatten(1).max(1).values / den

    routes = {"spec": (qs, ks, vs), "fast.project": (qf, Pk, P.v)}
    refs = {"q": q_mod, "k": k_mod, "v": v_mod}
    tols = {nm: tol(bound[nm], refs[nm]) for nm in refs}
    rels = {rt: {nm: rel(t, refs[nm]) for nm, t in zip(("q", "k", "v"), ts)}
            for rt, ts in routes.items()}
    heads = []
    for h in range(H):
        row: dict = {"head": h, "kv_head_spec": kv_map[h]}
        ok = True
        for nm in ("q", "k", "v"):
            vals = [float(rels[rt][nm][h]) for rt in routes]
            row[f"{nm}_rel"] = worst(vals)
            row[f"{nm}_tol"] = float(tols[nm][h])
            ok = ok and within(vals, row[f"{nm}_tol"])
        row["ok"] = ok
        heads.append(row)
    route_sum = {rt: {**{f"{nm}_rel_max": worst(rels[rt][nm]) for nm in refs},
                      "ok": all(within(rels[rt][nm][h], float(tols[nm][h]))
                                for nm in refs for h in range(H))} for rt in routes}
    sc_spec = [float(spec.score_scale(h)) for h in range(H)]
    # the model's score multiplier: the scaling its eager attention received, times the square
    # of its tables' amplitude: cos at position 0 of the layer's own rotary call (this call's
    # tables start at pos[0], where cos is a cos(theta), not a, unless pos[0] is 0)
    a_run = 1.0
    if conv.rotary:
        c0, _ = models.conventions.layer_tables(model, conv, torch.zeros(1, dtype=torch.long))
        a_run = float(c0[0, 0])
    sc_run = rec.kwargs.get("scaling")
    sc_model = float(d ** -0.5 if sc_run is None else sc_run) * a_run * a_run
    sc_rel = worst([abs(s - sc_model) / sc_model for s in sc_spec])
    sc_tol = tl.nonnegative_ops_rel(8)  # two roundings a side, and a^2 (docstring)
    scale = {"model": sc_model, "spec": sc_spec, "rel": sc_rel,
             "tolerance": sc_tol, "ok": within(sc_rel, sc_tol)}
    ok = all(r_["ok"] for r_ in heads) and scale["ok"]
    if record is not None:
        def scalar(v: float, dt: torch.dtype = F64) -> torch.Tensor:
            return torch.tensor([v], dtype=dt)

        record.update(query=rec.query[0], key=rec.key[0], value=rec.value[0],
                      scaling=scalar(float(d ** -0.5 if sc_run is None else sc_run)),
                      head_order=perm.to(torch.int64), amplitude=scalar(float(a)),
                      softcap=scalar(float(conv.softcap or 0.0)),
                      window=scalar(int(conv.window or 0), torch.int64),
                      chunk=scalar(int(conv.chunk or 0), torch.int64))
        if conv.rotary:
            record.update(rotary_cos=rec.cos.reshape(-1, rec.cos.shape[-1]),
                          rotary_sin=rec.sin.reshape(-1, rec.sin.shape[-1]))
    out = {
        "check": "conventions", "layer": int(layer), "model_dtype": str(mdt).replace("torch.", ""),
        "tokens": n, "positions": [int(pos.min()), int(pos.max())],
        "layout": spec.rope.layout,
        "q_rel_max": worst(r_["q_rel"] for r_ in heads),
        "k_rel_max": worst(r_["k_rel"] for r_ in heads),
        "v_rel_max": worst(r_["v_rel"] for r_ in heads),
        "tolerance_max": worst(r_[f"{nm}_tol"] for r_ in heads for nm in ("q", "k", "v")),
        "tolerance_from": (f"tolerances.rotated_projection_abs({str(mdt).replace('torch.', '')}) "
                           f"+ (float64) with n_terms={kterms}, A = |x||W|^T + |b| summed over "
                           "the model's rotation pair, mapped by the model's repeat_kv; "
                           "max(bound)/max|model| per head"),
        "heads": heads, "routes": route_sum, "scale": scale, "ok": ok,
    }
    if norms is not None:  # queries and keys normalised before the rotation
        out["tolerance_from"] = (
            f"q, k: realchecks._normalised_abs({str(mdt).replace('torch.', '')}, 3 rotation "
            f"roundings) + (float64, 5) with n_terms={kterms}: the projection's "
            "rotated_projection_abs carried through the layer's RMSNorm (scope "
            f"{norms['scope']!r}, the model's gains) plus the norm's roundings, summed over the "
            "model's rotation pair, mapped by the model's repeat_kv; v: rotated_projection_abs; "
            "max(bound)/max|model| per head")
    return out


# ---------------------------------------------------------------------------------------------
# 2. exact rows
# ---------------------------------------------------------------------------------------------
def sample_rows(n_heads: int, queries: int | Sequence[int], k: int, seed: int
                ) -> list[tuple[int, int]]:
    """``k`` distinct ``(head, query)`` rows drawn uniformly without replacement from
    ``range(n_heads) x queries`` (``queries`` an int ``Q`` for ``range(Q)``, or the eligible query
    indices) with ``numpy.random.default_rng(seed)``; sorted.  ``k`` larger than the grid takes
    every row."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    qs = (list(range(queries)) if isinstance(queries, (int, np.integer))
          else [int(q) for q in queries])
    if not qs or min(qs) < 0:
        raise ValueError("no eligible queries (or a negative query index)")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    grid = [(h, q) for h in range(int(n_heads)) for q in sorted(set(qs))]
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(grid), size=min(int(k), len(grid)), replace=False)
    return sorted(grid[int(t)] for t in pick)


@dataclass
class ExactReference:
    """The oracle's values for a set of rows (:func:`exact_reference`), float64 where rounded.

    Per row ``(h, i)``: ``y`` (r,), ``delta_m`` ((m+1, r), original gauge), ``dm_scale`` ((m+1, r):
    ``sum_j |c_ij a_ijp| (|v_jq - mu_iq| + |v_jq|)``), ``c`` (N_i,) over the permitted keys in
    bank order, ``keys`` (their indices in the bank), ``value_scale`` (``max_j |v_j|_inf``),
    ``kappa`` (the readout's condition number, :func:`ropestep.exact.kappa`), ``score_max``
    (``max_j |s_ij|``).  Exact values are rounded to float64 once (relative ``2^-53``).

    ``space``: ``"input"`` for an affine head; ``"query"`` for a QK-norm head, whose score is not
    affine in ``u`` (no input-space ``Delta M``): ``delta_m`` is then the query-space step
    ``Delta M^q_i = [scale T_i; b_i^T]`` ((d+1, r), :func:`ropestep.exact.query_space_delta_m`,
    input ``z_i = [q~_i; 1]``) and ``dm_scale`` the same sum with the query-space features
    ``a^_j = [scale k~_j; beta_ij]`` (:func:`ropestep.exact.query_space_features`).
    """

    rows: list
    digits: int
    y: dict
    delta_m: dict
    dm_scale: dict
    c: dict
    keys: dict
    value_scale: dict
    kappa: dict
    score_max: dict
    seconds: float
    space: str = "input"


def one_head(spec: HeadSpec, weights: HeadWeights, h: int) -> tuple[HeadSpec, HeadWeights]:
    """Query head ``h`` alone, with its KV head ``spec.kv_head(h)`` (GQA resolved here), as a
    one-head description (float64 weights on the CPU)."""
    g = spec.kv_head(h)
    base = spec.rope.bases(spec.n_heads)[h]
    rs = RoPESpec(base=base, layout=spec.rope.layout, cos=spec.rope.cos, sin=spec.rope.sin)
    if spec.family == "qknorm" and spec.norm_scope != "head":
        raise ValueError("a norm over every head of a token needs every head: build the whole "
                         "layer (exact_reference does)")
    if spec.family == "latent":  # its pairs' frequencies and the latent go along
        rs = replace(rs, freqs=spec.rope.freqs)
    s1 = HeadSpec(n_heads=1, n_kv_heads=1, head_dim=spec.head_dim, v_dim=spec.v_dim, rope=rs,
                  family=spec.family, scale=spec.score_scale(h), softcap=spec.softcap,
                  alibi_slopes=None if spec.alibi_slopes is None else (spec.alibi_slopes[h],),
                  norm_eps=spec.norm_eps, latent=spec.latent, clip=spec.clip,
                  sinks=None if spec.sinks is None else (spec.sinks[h],), window=spec.window,
                  chunk=spec.chunk, norm_after_rope=spec.norm_after_rope,
                  norm_kind=spec.norm_kind, query_temperature=spec.query_temperature)

    def sl(a: Any, i: int, axis: int) -> Any:
        if a is None:
            return None
        t = torch.as_tensor(a) if not isinstance(a, np.ndarray) else torch.from_numpy(a)
        return t.narrow(axis, i, 1).to("cpu", F64)

    def gain(a: Any) -> Any:  # a per-head norm's gain or bias (d,): shared by every head
        if spec.family != "qknorm" or a is None:
            return None
        return torch.as_tensor(a).to("cpu", F64)  # numpy or torch, any float dtype

    if spec.family == "latent":  # one head's query and value maps; the key is shared
        def full(a: Any) -> Any:
            return None if a is None else torch.as_tensor(np.asarray(a) if isinstance(
                a, np.ndarray) else a).to("cpu", F64)

        return s1, HeadWeights(
            w_q=sl(weights.w_q, h, 1), w_k=None, w_v=None, b_q=sl(weights.b_q, h, 0),
            w_uv=sl(weights.w_uv, h, 1), b_uv=sl(weights.b_uv, h, 0),
            **{k: full(getattr(weights, k)) for k in ("w_kr", "b_kr", "w_kc", "b_kc", "kv_norm",
                                                      "w_qa", "b_qa", "qa_norm")})
    w1 = HeadWeights(w_q=sl(weights.w_q, h, 1), w_k=sl(weights.w_k, g, 1),
                     w_v=sl(weights.w_v, g, 1), b_q=sl(weights.b_q, h, 0),
                     b_k=sl(weights.b_k, g, 0), b_v=sl(weights.b_v, g, 0),
                     q_norm=gain(weights.q_norm), k_norm=gain(weights.k_norm),
                     q_norm_bias=gain(weights.q_norm_bias), k_norm_bias=gain(weights.k_norm_bias))
    return s1, w1


def exact_reference(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any,
                    rows: Sequence[tuple[int, int]], digits: int = 50, *, x_kv: Any = None,
                    pos_kv: Any = None) -> ExactReference:
    """The mpmath oracle (:func:`ropestep.exact.build` at ``digits`` digits plus its guard
    digits) on each row ``(head, query)``: query ``x[query]`` at ``positions[query]`` reading the
    keys ``x_kv`` (default ``x``) at or before its position (docs/math.md sections 1 and 3).

    Each row runs on a one-head description (query head ``h`` with KV head ``spec.kv_head(h)``)
    and only its permitted keys: the inputs and weights are converted to mpf exactly, so the
    values are the exact function of the captured float numbers to ``digits`` digits.  Cost:
    about ``4 N_i d (m + 1)`` mpf products per row (seconds per row at ``N_i ~ 16``, ``m ~ 900``).
    The permitted keys are those of the description's mask: causal in positions, and within
    ``spec.window`` of the query where it has one.

    QK-norm heads (family ``"qknorm"``): a norm per head goes with its head (the gain is shared);
    a norm over every head of a token (``spec.norm_scope == "all"``, OLMo 2) needs every head's
    projection, so the row's query is built with the whole layer (every head, about ``H`` times
    the cost; rows that share a query share the build).  The matrix kept is the query-space
    ``Delta M^q_i`` (``space = "query"``, see :class:`ExactReference`).
    """
    import time

    t0 = time.perf_counter()
    xq, pq, xk, pk, m = _bank(spec, weights, x, positions, x_kv, pos_kv)
    if isinstance(digits, bool) or not isinstance(digits, (int, np.integer)) or digits < 16:
        raise ValueError(f"digits must be an int >= 16, got {digits!r}")
    rows = _rows(rows, spec.n_heads, xq.shape[0])
    space = "input" if spec.affine else "query"
    ref = ExactReference(rows=rows, digits=int(digits), y={}, delta_m={}, dm_scale={}, c={},
                         keys={}, value_scale={}, kappa={}, score_max={}, seconds=0.0,
                         space=space)
    whole = spec.family == "qknorm" and spec.norm_scope == "all"
    built: dict = {}  # query -> the whole layer's build ("all" scope)
    for h, i in rows:
        near = (pk <= pq[i]) & (pk >= first_permitted(int(pq[i]), spec.window, spec.chunk))
        # (the description's window and chunks: fast.step's causal mask)
        keys = torch.nonzero(near).flatten()
        args = (xq[i:i + 1].numpy(), pq[i:i + 1].numpy(), xk[keys].numpy(), pk[keys].numpy(),
                np.ones((1, keys.numel()), bool))
        if whole:
            if i not in built:
                built[i] = exact.build(spec, weights, *args, dps=int(digits))
            E, he = built[i], h
        else:
            s1, w1 = one_head(spec, weights, h)
            E, he = exact.build(s1, w1, *args, dps=int(digits)), 0
        nk = keys.numel()
        with mp.workprec(E.prec):
            c, _ = exact.coefficients(E, he, 0, "original")
            if spec.affine:
                M = exact.delta_m(E, he, 0, "original")
                fe = [E.feats[he, 0, j] for j in range(nk)]  # (N_i, m+1)
            else:
                M = exact.query_space_delta_m(E, he, 0, "original")
                _, qf = exact.query_space_features(E, he, 0, "original")
                fe = [qf[j] for j in range(nk)]  # (N_i, d+1): [scale k~_j; beta_ij]
            kap = exact.kappa(E, he, 0, "original")
            smax = max(abs(E.s[he, 0, j]) for j in range(nk))
        cf = np.array([float(c[j]) for j in range(nk)])
        feats = exact.to_float(np.stack([np.asarray(f, dtype=object) for f in fe]))
        v = exact.to_float(np.stack([np.asarray(E.v[he, j], dtype=object)
                                     for j in range(nk)]))  # (N_i, r)
        mu = exact.to_float(np.asarray(E.mu[he, 0], dtype=object))
        # sum-of-absolute-terms scale of every entry: sum_j |c_j a_jp| (|v_jq - mu_q| + |v_jq|)
        scale = (np.abs(cf)[:, None] * np.abs(feats)).T @ (np.abs(v - mu) + np.abs(v))
        ref.y[h, i] = exact.to_float(np.asarray(E.y[he, 0], dtype=object))
        ref.delta_m[h, i] = exact.to_float(np.array(M.tolist(), dtype=object))
        ref.dm_scale[h, i] = scale
        ref.c[h, i] = cf
        ref.keys[h, i] = keys.numpy()
        ref.value_scale[h, i] = float(np.abs(v).max())
        ref.kappa[h, i] = float(kap)
        ref.score_max[h, i] = float(smax)
    ref.seconds = time.perf_counter() - t0
    return ref


def exact_rows(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any,
               rows: Sequence[tuple[int, int]], digits: int = 50, *, x_kv: Any = None,
               pos_kv: Any = None, reference: ExactReference | None = None) -> dict:
    """The float64 fast path (:func:`ropestep.fast.step`, original gauge, materialised
    ``Delta M``) against the mpmath oracle on the given rows (docs/math.md sections 3 and 9).

    Per row ``(head, query)``, with ``S = max_j |v_j|_inf`` the value scale of its keys:

    * ``y_rel = max|y_fast - y_exact| / S``;
    * ``delta_m_rel = max_pq |dM_fast - dM_exact| / max_pq S_pq`` with the sum-of-absolute-terms
      scale ``S_pq = sum_j |c_ij a_ijp| (|v_jq - mu_iq| + |v_jq|)`` (a matrix whose terms
      cancel has no relative accuracy to keep; the centred value ``v - mu`` is itself rounded at
      ``ulp(|v|)``, hence the ``+ |v_jq|``) -- the scale of :func:`ropestep.exact.delta_m_abs`;
      ``delta_m_rel_entrywise`` divides entry by entry instead (reported, not judged: the fast
      path forms ``dM = L T`` in query space, whose rounding scale can exceed an entry's own);
    * ``c_rel = max_j |c_fast - c_exact| / c_exact`` (every coefficient is positive);
    * ``readout_rel = max|mu + q T + b - y_exact| / S`` (the identity through the fast readout).

    Tolerance of the first three: ``tolerances.FLOAT64_REL`` (1e-12; the acceptance bar: the
    first-order count ``(N + d + m + 8 + max|s|) u`` is reported as ``first_order``); of the
    readout: ``max(FLOAT64_REL, tolerances.readout_bound(float64, kappa_exact, N, d, max|s|))``.
    ``reference`` reuses an :func:`exact_reference` of the same rows (it is checked to match).

    QK-norm heads (score not affine in ``u``: no input-space ``Delta M``): ``y``, ``c``, the
    readout and ``kappa`` as above, and in place of ``Delta M_i`` the query-space step
    ``Delta M^q_i = [scale T_i; b_i^T]`` (:func:`ropestep.fast.query_delta_m` against
    :func:`ropestep.exact.query_space_delta_m`; input ``z_i = [q~_i; 1]``, the normalised rotated
    query) with its own sum-of-absolute-terms scale (features ``a^_j = [scale k~_j; beta_ij]``),
    under the same fields and tolerance; rows and result say ``"space": "query"``.  The
    reported ``first_order`` count adds the norm's ``m + n + 8`` (:func:`_norm_terms`).
    """
    xq, pq, xk, pk, m = _bank(spec, weights, x, positions, x_kv, pos_kv)
    rws = _rows(rows, spec.n_heads, xq.shape[0])
    if reference is None:
        reference = exact_reference(spec, weights, xq, pq, rws, digits, x_kv=xk, pos_kv=pk)
    elif [tuple(r_) for r_ in reference.rows] != rws:
        raise ValueError(f"reference holds rows {reference.rows[:4]}..., not the requested rows")
    space = "input" if spec.affine else "query"
    if reference.space != space:
        raise ValueError(f"reference holds {reference.space}-space matrices, this head's "
                         f"Delta M is in {space} space")
    qidx = sorted({i for _, i in rws})
    col = {i: n for n, i in enumerate(qidx)}
    st = fast.step(spec, weights, xq[qidx], pq[qidx], xk, pk, mask="causal", gauge="original",
                   dtype=F64, delta_m=spec.affine)
    # Delta M_i (input space, affine heads) or Delta M^q_i (query space, every family)
    dms = st.delta_m if spec.affine else fast.query_delta_m(st)
    d = spec.head_dim
    m_first = m
    if not spec.affine:  # the norm's roundings (first order, _norm_terms)
        m_first = _qk_norm_count(m, d * (spec.n_heads if spec.norm_scope == "all" else 1),
                                 _head_centring_gain(spec, weights, xk.to("cpu", F64))
                                 if spec.norm_kind == "layer" else None)
    out_rows = []
    for h, i in rws:
        q = col[i]
        keys = reference.keys[h, i]
        S = max(reference.value_scale[h, i], tl.SCALE_GUARD)
        y_rel = float(np.abs(st.y[h, q].numpy() - reference.y[h, i]).max() / S)
        dm_err = np.abs(dms[h, q].numpy() - reference.delta_m[h, i])
        sc = reference.dm_scale[h, i]
        dm_rel = float(dm_err.max() / max(float(sc.max()), tl.SCALE_GUARD))
        dm_rel_ent = float((dm_err / np.maximum(sc, tl.SCALE_GUARD)).max())
        cf = st.c[h, q].numpy()[keys]
        ce = reference.c[h, i]
        c_rel = float((np.abs(cf - ce) / np.maximum(np.abs(ce), tl.SCALE_GUARD)).max())
        ro_rel = float(np.abs(st.readout[h, q].numpy() - reference.y[h, i]).max() / S)
        N = int(keys.size)
        smax = reference.score_max[h, i]
        ro_tol = max(tl.FLOAT64_REL, float(tl.readout_bound(F64, reference.kappa[h, i], N, d,
                                                             smax)))
        first = (N + d + m_first + 8 + smax) * U64
        ok = (within(y_rel, tl.FLOAT64_REL) and within(dm_rel, tl.FLOAT64_REL)
              and within(c_rel, tl.FLOAT64_REL) and within(ro_rel, ro_tol))
        out_rows.append({"head": h, "query": i, "position": int(pq[i]), "keys": N,
                         "y_rel": y_rel, "delta_m_rel": dm_rel,
                         "delta_m_rel_entrywise": dm_rel_ent, "c_rel": c_rel,
                         "readout_rel": ro_rel, "readout_tol": ro_tol,
                         "kappa": reference.kappa[h, i], "score_max": smax,
                         "c_min_exact": float(ce.min()), "first_order": first, "ok": ok})
        if not spec.affine:
            out_rows[-1]["space"] = space
    ok = all(r_["ok"] for r_ in out_rows)
    out = {
        "check": "exact_rows", "digits": reference.digits, "rows": out_rows,
        "y_rel_max": worst(r_["y_rel"] for r_ in out_rows),
        "delta_m_rel_max": worst(r_["delta_m_rel"] for r_ in out_rows),
        "c_rel_max": worst(r_["c_rel"] for r_ in out_rows),
        "readout_rel_max": worst(r_["readout_rel"] for r_ in out_rows),
        "tolerance": tl.FLOAT64_REL,
        "tolerance_from": ("tolerances.FLOAT64_REL for y (vs the value scale), Delta M (vs its "
                           "sum-of-absolute-terms scale) and c (relative); the readout against "
                           "tolerances.readout_bound(float64, kappa_exact, N, d, max|s|)"),
        "exact_seconds": reference.seconds, "ok": ok,
    }
    if not spec.affine:  # the query-space step Delta M^q_i = [scale T_i; b_i^T], (d+1) x r
        out["space"] = space
        out["tolerance_from"] = out["tolerance_from"].replace(
            "Delta M (vs", "the query-space Delta M^q = [scale T; b^T] (vs")
    return out


# ---------------------------------------------------------------------------------------------
# 3a. c_ij > 0
# ---------------------------------------------------------------------------------------------
def positive_coefficients(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any, *,
                          x_kv: Any = None, pos_kv: Any = None,
                          reference: ExactReference | None = None) -> dict:
    """``min c_ij > 0`` over every head, query and permitted key (docs/math.md section 3:
    ``c_ij = rho(s_ij)/Z_i`` and ``rho > 0``, section 2), from the float64 fast path in the
    original gauge; with ``reference`` also the oracle's minimum on its rows.

    A float64 coefficient is within ``FLOAT64_REL`` (relative) of the exact one (checked on
    sampled rows by :func:`exact_rows`), so a computed ``c > 0`` certifies the exact ``c > 0``;
    the claim fails on a zero, a negative, a NaN or an inf.
    """
    xq, pq, xk, pk, _ = _bank(spec, weights, x, positions, x_kv, pos_kv)
    st = fast.step(spec, weights, xq, pq, xk, pk, mask="causal", gauge="original", dtype=F64,
                   keep=("c",))
    c = torch.where(st.mask[None], st.c, torch.full_like(st.c, math.inf))
    cmin = least(c)
    flat = int(torch.argmin(torch.nan_to_num(c, nan=-math.inf)))
    H, Q, N = c.shape
    where = {"head": flat // (Q * N), "query": (flat // N) % Q, "key": flat % N}
    per_head = [least(c[h]) for h in range(H)]
    out = {"check": "positive_coefficients", "gauge": "original", "min_c": cmin, "argmin": where,
           "per_head_min": per_head, "coefficients": int(st.mask.sum()) * H,
           "tolerance": 0.0,
           "tolerance_from": ("strict: c > 0; float64 c is within FLOAT64_REL relative of the "
                              "exact value, so its sign is the exact sign"),
           "ok": bool(finite(cmin) and cmin > 0)}
    if reference is not None:
        ex = least([reference.c[r_].min() for r_ in reference.rows])
        out["exact"] = {"rows": len(reference.rows), "min_c": ex,
                        "ok": bool(finite(ex) and ex > 0)}
        out["ok"] = out["ok"] and out["exact"]["ok"]
    return out


# ---------------------------------------------------------------------------------------------
# 3b. rank(Delta M_i W_o) <= d
# ---------------------------------------------------------------------------------------------
def delta_m_rank(spec: HeadSpec, weights: HeadWeights, x: Any, positions: Any,
                 rows: Sequence[tuple[int, int]], *, x_kv: Any = None, pos_kv: Any = None) -> dict:
    """Numerical rank of ``Delta M_i W_o,h`` ((m+1) x hidden) for each row (docs/math.md
    section 3: ``Delta M_i = L_i T_i`` with ``L_i`` of ``d`` columns, so the rank is at most
    ``d``).  ``Delta M_i`` from the float64 fast path, ``W_o,h`` the head's slice of ``o_proj``
    (``weights.w_o``); the product is formed in float64 and its singular values counted above
    :func:`ropestep.tolerances.rank_threshold` (numpy's ``max(shape) eps sigma_max`` plus the
    product's rounding ``gamma_r ||Delta M||_F ||W_o||_F``).

    The centred values ``v_j - mu_i`` sum to zero, so they span at most ``N_i - 1`` dimensions:
    the rank is at most ``bound = min(d, r, N_i - 1)``, and that sharper bound is what is judged
    (it implies ``<= d``).  With attention sinks the sink is one more key whose feature is the
    bias coordinate: ``bound = min(d + 1, r, N_i)``.  Reported per row: ``rank``, ``bound``, ``d``, ``sigma_ratio_after_d``
    (``sigma_{d+1} / sigma_1``, 0 when the matrix has at most ``d`` singular values) and
    ``threshold_ratio`` (threshold / ``sigma_1``).  When ``r <= d`` (every Llama/Qwen head:
    ``r = d``) the claim ``<= d`` also follows from the shapes alone; the check then certifies
    that the computed product carries no spurious rank, and the ``N_i - 1`` part is not implied
    by shapes.

    An input-space claim: a head whose score is not affine in ``u`` (QK-norm) has no
    ``Delta M_i`` and is refused (``ValueError``).
    """
    _affine(spec, "delta_m_rank")
    xq, pq, xk, pk, m = _bank(spec, weights, x, positions, x_kv, pos_kv)
    if weights.w_o is None:
        raise ValueError("delta_m_rank needs weights.w_o (the output projection)")
    rws = _rows(rows, spec.n_heads, xq.shape[0])
    qidx = sorted({i for _, i in rws})
    col = {i: n for n, i in enumerate(qidx)}
    st = fast.step(spec, weights, xq[qidx], pq[qidx], xk, pk, mask="causal", dtype=F64,
                   delta_m=True, keep=())
    wo = torch.as_tensor(weights.w_o).to("cpu", F64)
    d, r = spec.head_dim, spec.r
    out_rows = []
    for h, i in rws:
        dm = st.delta_m[h, col[i]]
        prod = dm @ wo[h]
        sv = torch.linalg.svdvals(prod)
        smax = float(sv[0]) if sv.numel() else 0.0
        thr = tl.rank_threshold(tuple(prod.shape), smax, r,
                                float(torch.linalg.norm(dm) * torch.linalg.norm(wo[h])))
        rank = int((sv > thr).sum())
        after = float(sv[d] / sv[0]) if sv.numel() > d and smax > 0 else 0.0
        n_keys = int((pk <= pq[i]).sum())
        # a sink is one more key, whose feature is the bias coordinate: d + 1 directions of
        # L_i T_i + e b_i^T, and N_i + 1 centred values (docs/math.md section 13)
        sink = int(spec.sinks is not None)
        bound = min(d + sink, r, n_keys - 1 + sink)
        ok = bool(finite(sv) and rank <= bound)
        out_rows.append({"head": h, "query": i, "keys": n_keys, "rank": rank, "bound": bound,
                         "d": d,
                         "sigma_max": smax, "sigma_ratio_after_d": after,
                         "threshold_ratio": thr / smax if smax > 0 else float(thr), "ok": ok})
    return {"check": "delta_m_rank", "rows": out_rows,
            "rank_max": max(r_["rank"] for r_ in out_rows), "d": d,
            "sigma_ratio_after_d_max": worst(r_["sigma_ratio_after_d"] for r_ in out_rows),
            "tolerance_from": ("tolerances.rank_threshold: max(shape) eps sigma_max + "
                               "gamma_r ||dM||_F ||W_o||_F"),
            "ok": all(r_["ok"] for r_ in out_rows)}


# ---------------------------------------------------------------------------------------------
# 3c. no global affine readout
# ---------------------------------------------------------------------------------------------
def no_global_readout(spec: HeadSpec, weights: HeadWeights, x_q: Any, pos_q: Any, x_kv: Any,
                      pos_kv: Any) -> dict:
    """No single affine readout ``y(u) = mu + u^T M`` serves the queries of a context
    (docs/math.md section 7), certified per head and for the projected write.

    The ``Q`` queries share one position and bank (the protocol's setting, so ``mu`` and the
    features are shared).  With ``Q <= m + 1`` independent inputs the ``Q`` observed outputs
    alone can always be interpolated by some ``M``; the refutation needs inputs with an affine
    dependency.  For every pair ``a, b`` the midpoint ``u_c = (u_a + u_b)/2`` (an augmented
    input: its last entry is 1) gives, for *every* ``M`` with errors ``e_k = y_k - mu - u_k^T M``,

        e_c - (e_a + e_b)/2 = y_c - (y_a + y_b)/2     so     max(|e_a|, |e_b|, |e_c|)
                                                             >= |y_c - (y_a + y_b)/2|_2 / 2,

    a lower bound on the error of the best common readout over the ``Q`` queries and their
    midpoints (the three-point system of section 7's proof, ``symbolic.affine_three_point_system``).
    ``lower_computed`` is the largest such bound over the pairs, from float64 outputs
    (:func:`ropestep.fast.step`); each output entry is within ``FLOAT64_REL * S`` of the exact one
    (``S = max_j |v_j|_inf``), which moves the bound by at most ``sqrt(r) FLOAT64_REL S``:
    ``lower_certified = lower_computed - that``, and the claim holds where it is > 0.  For the
    write ``o = sum_h y_h W_o,h`` the float64 error is ``sqrt(D) max_c sum_h S_h |W_o,h[:, c]|_1``
    times ``FLOAT64_REL``, plus the product's rounding.

    ``upper``: the largest error over the same inputs of one actual common readout (the
    least-squares ``M``, minimum norm), so ``lower_certified <= min_M max_k |e_k| <= upper``.
    ``hull``: section 7's constructive witness for that ``M`` (its ``x``-part is non-zero): at
    ``x = t l_1`` (``l_1`` the top left singular vector of ``M_x``) the readout leaves the values'
    hull by ``certified >= 1``; ``t_over_input_norm`` compares that input's norm with the queries'.

    An input-space claim (a readout affine in ``u``): a head whose score is not affine in ``u``
    (QK-norm) is refused (``ValueError``).
    """
    _affine(spec, "no_global_readout")
    m = weights.check(spec)
    xq = _x(x_q, m, "x_q")
    Q = xq.shape[0]
    if Q < 2:
        raise ValueError("no_global_readout needs at least 2 queries")
    pq = _pos(pos_q, Q, "pos_q")
    if not bool((pq == pq[0]).all()):
        raise ValueError("no_global_readout: every query must sit at one position (shared bank)")
    xk = _x(x_kv, m, "x_kv")
    pk = _pos(pos_kv, xk.shape[0], "pos_kv")
    if bool((pk > pq[0]).any()):
        raise ValueError("no_global_readout: bank keys must not lie after the query position")
    ia, ib = torch.triu_indices(Q, Q, 1)
    xm = (xq[ia] + xq[ib]) / 2  # exact in float64 for float32 inputs
    X = torch.cat((xq, xm))
    Pn = X.shape[0]
    st = fast.step(spec, weights, X, torch.full((Pn,), int(pq[0])), xk, pk, mask="bank",
                   dtype=F64, keep=())
    y, mu = st.y, st.mu[:, 0]  # (H, P, r), (H, r)
    v = st.extras["projected"].v  # (H, N, r)
    H, r = spec.n_heads, spec.r
    S = v.abs().flatten(1).max(1).values  # (H,)
    gap = y[:, Q:] - (y[:, ia] + y[:, ib]) / 2  # (H, pairs, r)
    lower = torch.linalg.vector_norm(gap, dim=-1) / 2  # (H, pairs)
    best, arg = lower.max(1)
    err = math.sqrt(r) * tl.FLOAT64_REL * S + 4 * U64 * best

    # one actual common readout: least squares over all P inputs (minimum norm)
    U = torch.cat((X, torch.ones(Pn, 1, dtype=F64)), 1)
    Uq = U[:Q]
    heads = []
    for h in range(H):
        Z = torch.linalg.lstsq(_barycentric(Q, ia, ib), y[h] - mu[h], driver="gelsd").solution
        M = torch.linalg.pinv(Uq) @ Z  # (m+1, r): U_Q M = Z
        e = y[h] - mu[h] - U @ M
        upper = worst(torch.linalg.vector_norm(e, dim=-1))
        hull = _hull_witness(M, v[h], mu[h], xq)
        cert = float(best[h] - err[h])
        heads.append({"head": h, "pair": [int(ia[arg[h]]), int(ib[arg[h]])],
                      "lower_computed": float(best[h]), "float64_error": float(err[h]),
                      "lower_certified": cert, "upper": upper, "hull": hull,
                      "ok": bool(finite([best[h], err[h]]) and cert > 0)})
    comb = None
    if weights.w_o is not None:
        wo = torch.as_tensor(weights.w_o).to("cpu", F64)  # (H, r, D)
        o = torch.einsum("hpr,hrd->pd", y, wo)
        og = o[Q:] - (o[ia] + o[ib]) / 2
        lo = torch.linalg.vector_norm(og, dim=-1) / 2
        ob, oarg = lo.max(0)
        D = wo.shape[-1]
        colsum = (S[:, None] * wo.abs().sum(1)).sum(0)  # (D,): sum_h S_h |W_o,h[:, c]|_1
        prod_round = H * r * U64 * float((torch.einsum("hpr,hrd->pd", y.abs(), wo.abs())).max())
        oerr = (math.sqrt(D) * (tl.FLOAT64_REL * float(colsum.max()) + 2 * prod_round)
                + 4 * U64 * float(ob))
        comb = {"pair": [int(ia[oarg]), int(ib[oarg])], "lower_computed": float(ob),
                "float64_error": oerr, "lower_certified": float(ob) - oerr,
                "ok": bool(finite([float(ob), oerr]) and float(ob) - oerr > 0)}
    ok = all(h_["ok"] for h_ in heads) and (comb is None or comb["ok"])
    return {"check": "no_global_readout", "queries": Q, "pairs": int(ia.numel()),
            "inputs": Pn, "heads": heads, "combined": comb,
            "lower_certified_min": least(h_["lower_certified"] for h_ in heads),
            "tolerance": 0.0,
            "tolerance_from": ("certified = computed - sqrt(r) FLOAT64_REL max|v| (the float64 "
                               "outputs' error); the claim: certified > 0"),
            "ok": ok}


def _barycentric(Q: int, ia: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    """Rows ``e_k`` for the queries, ``(e_a + e_b)/2`` for the midpoints: ``u_k = B_k U_Q``."""
    B = torch.zeros(Q + ia.numel(), Q, dtype=F64)
    B[torch.arange(Q), torch.arange(Q)] = 1
    rows = Q + torch.arange(ia.numel())
    B[rows, ia] = 0.5
    B[rows, ib] = 0.5
    return B


def _hull_witness(M: torch.Tensor, v: torch.Tensor, mu: torch.Tensor, xq: torch.Tensor) -> dict:
    """docs/math.md section 7's witness for a readout ``M`` ((m+1) x r)."""
    Mx, M0 = M[:-1], M[-1]
    Uu, sv, _ = torch.linalg.svd(Mx, full_matrices=False)
    sig = float(sv[0])
    R = float(torch.linalg.vector_norm(v - mu, dim=-1).max())
    last = float(torch.linalg.vector_norm(M0))
    if not sig > 0:
        return {"x_part_zero": True}
    t = 1.01 * (last + R + 1.0) / sig
    grow = float(torch.linalg.vector_norm((t * Uu[:, 0]) @ Mx))
    return {"x_part_zero": False, "t": t, "certified": grow - last - R,
            "t_over_input_norm": t / float(torch.linalg.vector_norm(xq, dim=-1).median())}


# ---------------------------------------------------------------------------------------------
# 3d/3e. positional derivative and exact finite differences against the model's own attention
# ---------------------------------------------------------------------------------------------
class _Attention64:
    """The layer's attention as the model computes it, in float64, at any (fractional) positions.

    The layer's own projections (float64 copies of its weights, in the layout the adapter read
    and checked), its rotation (its pairing and rotary width, its tables' amplitude), query
    head ``h`` reading KV head ``h // group``, its own ``q_norm``/``k_norm`` where it has them
    (:func:`_model_norms`, applied before the rotation as the layer applies them: per head after
    the projection's reshape, or over the whole projection of a token for OLMo 2; in float64,
    where transformers' norms would round to float32), its score multiplier and causal order (by
    sequence index, as Hugging Face masks); the softmax runs in float64 (the eager kernel's
    float32 softmax would cap the accuracy at ``2^-24``).  Causal order by sequence index is what
    a whole-model forward with moved position ids does *given an attention mask*: without one
    (and without a cache) transformers reads non-consecutive ids as packed sequences
    (``masking_utils.find_packed_sequence_indices``) and the moved token attends to itself alone
    (tests/models/test_realchecks.py shows both).  RoPE angles ``p * inv_freq`` with the rotary
    module's own ``inv_freq`` evaluated in float64 -- its float32 tables cannot resolve a
    derivative (their rounding, ~``p u32``, moves a score by ~1e-5); they are used for the
    anchor (:meth:`heads_with_model_tables`).
    """

    def __init__(self, model: Any, info: models.ModelInfo, conv: Any, parts: dict,
                 x: torch.Tensor):
        self.model, self.info, self.conv = model, info, conv
        self.H, self.Hk, self.d = info.n_heads, info.n_kv_heads, info.head_dim
        # attention sinks: the module's own logits (the parameter its eager call is handed)
        self.sinks = None
        if conv.sinks:
            _, _, attn, _, _ = models.attention.layer_parts(model, conv.layer, info)
            with onloaded(attn):
                self.sinks = getattr(attn, conv.sink_param).detach().to("cpu", F64).reshape(-1)
        self.group = info.group
        self.scaling = conv.scaling
        n = x.shape[0]

        self.norms = _model_norms(model, conv.layer, info, conv)
        # how much a LayerNorm's centring magnifies the projections' errors (_norm_terms)
        self.centring_gain = 1.0

        def proj(part: tuple, nh: int, norm: str | None = None) -> torch.Tensor:  # (nh, n, d)
            z = models.layouts.project(part, x, nh)[0]  # (n, nh, d), float64
            if conv.clip is not None:  # the module's clip_qkv (DBRX), as its forward
                z = z.clamp(-conv.clip, conv.clip)
            if norm is not None and self.norms is not None and \
                    self.norms["bias"].get(norm) is not None:
                self.centring_gain = max(self.centring_gain, centring_gain(z))
            if norm is not None and self.norms is not None and not conv.norm_after_rope:
                z = _apply_model_norm(z, *self.norms[norm], self.norms["scope"],
                                      self.norms["bias"].get(norm))
            return z.transpose(0, 1)

        with torch.no_grad():
            self.q, self.k = proj(parts["q"], self.H, "q"), proj(parts["k"], self.Hk, "k")
            # the module's own value scale (MiMo-V2's v_scale; 1 elsewhere), as its forward
            self.v = proj(parts["v"], self.Hk).repeat_interleave(self.group, 0) * conv.value_scale
        self.n = n
        # the adapter's reading of the layer's rotary module (its inv_freq buffer, or the buffer
        # of this layer's type where the module holds one per type: Gemma 3)
        inv_freq = tuple(conv.inv_freq or ())
        if conv.rotary_dim and len(inv_freq) != conv.rotary_dim // 2:
            raise models.UnsupportedModelError(
                f"{info.name}: layer {conv.layer}'s rotary module has no inv_freq "
                             f"buffer of {conv.rotary_dim // 2} frequencies to evaluate exact "
                             f"angles with (read {len(inv_freq)})")
        self.inv_freq = torch.tensor(inv_freq, dtype=F64)

    def _heads(self, cos: torch.Tensor, sin: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """``cos``/``sin``: per-pair tables ``(n, R/2)`` (amplitude included)."""
        with torch.no_grad():
            rot = models.attention.rotate_as_model
            q, k = rot(self.q, cos, sin, self.conv), rot(self.k, cos, sin, self.conv)
            if self.conv.norm_after_rope and self.norms is not None:  # Hunyuan: then the norm
                q = _apply_model_norm(q.transpose(0, 1), *self.norms["q"], "head").transpose(0, 1)
                k = _apply_model_norm(k.transpose(0, 1), *self.norms["k"], "head").transpose(0, 1)
            k = k.repeat_interleave(self.group, 0)
            out = []
            for i in rows:  # the window and chunks, by sequence index
                lo = first_permitted(i, self.conv.window, self.conv.chunk)
                s = (q[:, i:i + 1] @ k[:, lo: i + 1].transpose(-1, -2)) * self.scaling
                w = _softmax_sinks(_phi(s, self.conv.softcap), self.sinks)  # (H, 1, keys)
                out.append((w @ self.v[:, lo: i + 1])[:, 0])  # (H, r)
            return torch.stack(out)  # (rows, H, r)

    def heads_at(self, positions: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Per-head outputs of ``rows`` with every token at ``positions`` (float64)."""
        ang = positions.to(F64)[:, None] * self.inv_freq[None]
        a = self.conv.amplitude
        return self._heads(a * ang.cos(), a * ang.sin(), rows)

    def heads_with_model_tables(self, positions: torch.Tensor) -> torch.Tensor:
        if not self.conv.rotary:
            empty = torch.zeros(self.n, 0, dtype=F64)
            return self._heads(empty, empty, range(self.n))
        c, s = models.attention.per_pair_tables(self.model, self.conv, positions)
        return self._heads(c.to("cpu", F64), s.to("cpu", F64), range(self.n))


def _anchor(att: _Attention64, pos: torch.Tensor, heads: Any, mdt: torch.dtype) -> dict | None:
    """The float64 composition with the model's own tables against the captured heads."""
    if heads is None:
        return None
    cap = heads.detach().cpu() if torch.is_tensor(heads) else torch.as_tensor(np.asarray(heads))
    if not cap.is_floating_point() or tuple(cap.shape) != (att.n, att.H, att.d):
        raise ValueError(f"heads must be a float array of shape {(att.n, att.H, att.d)}, got "
                         f"{cap.dtype} {tuple(cap.shape)}")
    cap = cap.to(F64)  # a NaN/inf the model produced is a failed check, not bad input
    mine = att.heads_with_model_tables(pos)
    den = cap.abs().amax((0, 2)).clamp_min(tl.SCALE_GUARD)
    rel = (mine - cap).abs().amax((0, 2)) / den  # per head
    m = _norm_terms(att.info, att.conv, None, att.centring_gain)  # m, or 2m + n + 8 with QK-norm
    if mdt in (F64, torch.float32):
        # a float64 model's heads carry float32 rounding too: transformers' eager attention takes
        # its softmax in float32 whatever the model's dtype (softmax(..., dtype=torch.float32)),
        # so the float32 bound holds for both (the float64 projections lie inside it)
        tol = tl.native_rel_tol(att.n, att.d, m)
        src = "native_rel_tol" + (" (a float64 model's softmax runs in float32)"
                                  if mdt == F64 else "")
    else:
        with torch.no_grad():
            qn = torch.linalg.vector_norm(att.q, dim=-1).max()
            kn = torch.linalg.vector_norm(att.k, dim=-1).max()
        # QK-norm: each normalised entry within 4 u_lp relative instead of u_lp -- the stored
        # projection's rounding |e| <= u_lp |z| through the norm is at most 2 u_lp |y|
        # (_normalised_abs with E = u_lp |z|, rho <= u_lp r), then two stores -- so the scores'
        # Cauchy-Schwarz term 2 u_lp |q~||k~| scale becomes 8 u_lp |q~||k~| scale
        qk = float(qn * kn) * att.scaling * (4.0 if att.norms is not None else 1.0)
        tol = tl.native_rel_tol_lowp(mdt, qk)
        src = "native_rel_tol_lowp" + (" (QK-norm: 4 |q~||k~| scale)" if att.norms else "")
    return {"rel_max": worst(rel), "tolerance": tol,
            "tolerance_from": f"tolerances.{src}: the captured heads against this float64 "
                              "composition of the model's attention with its own tables",
            "ok": within(rel, tol)}


def _setup_positional(model: Any, layer: int, x: Any, positions: Any, queries: Any, head: Any):
    info, conv, parts = _model_parts(model, layer)
    xt = _x(x, conv.input_dim or info.hidden)
    n = xt.shape[0]
    pos = _pos(positions, n, increasing=True)
    try:
        qs = [int(i) for i in queries]
    except TypeError:
        raise ValueError("queries must be a sequence of token indices") from None
    if not qs or min(qs) < 0 or max(qs) >= n:
        raise ValueError(f"queries must be token indices in [0, {n}), got {qs}")
    qs = sorted(set(qs))
    spec, weights = _head(model, int(layer), int(pos.max()) + 1, head)
    if (spec.n_heads, spec.n_kv_heads, spec.head_dim) != (info.n_heads, info.n_kv_heads,
                                                          info.head_dim):
        raise ValueError("head description and model disagree on (H, H_kv, d)")
    if spec.rope.per_head:
        raise ValueError("per-head RoPE bases: the model has one rotary table")
    dev, mdt = _device_dtype(model)
    x64 = xt.to(dev, mdt).to("cpu", F64)  # the values the model reads
    # ropestep's side with exact angles (no tables): the same spec otherwise
    spec_an = replace(spec, rope=RoPESpec(base=spec.rope.base, layout=spec.rope.layout,
                                          freqs=spec.rope.freqs))
    return info, conv, parts, x64, pos, qs, spec_an, weights, mdt


def _row_terms(spec: HeadSpec, P: fast.Projected, qn: int, i: int, h: int):
    """Ropestep's pieces of row ``(h, i)``: effective query, keys and values of the permitted
    ``j <= i`` (within the sliding window or chunk, by sequence index as the model masks), generator, the
    derivative bounds ``G_n = max_{j != i} sum_l omega_l^n |q_l| |k_jl|``, and the row of the
    query's own key among them."""
    q = P.q[h, qn]  # scaled rotated query
    lo = first_permitted(i, spec.window, spec.chunk)
    K, V = P.k[h, lo: i + 1], P.v[h, lo: i + 1]
    own = i - lo
    A = rope.rope_generator(spec, h)
    d = spec.head_dim
    om = rope.spec_frequencies(spec, h)
    li = rope.frequency_index(d, spec.rope.layout)
    qp = torch.zeros(d // 2, dtype=F64).index_add_(0, li, q * q).sqrt()
    kp = torch.zeros(K.shape[0], d // 2, dtype=F64).index_add_(1, li, K * K).sqrt()
    G = {}
    for nn in (0, 1, 2, 3):
        g = (kp * qp[None] * om[None] ** nn).sum(1)
        g[own] = 0.0  # the query's own key moves with it: no dependence
        G[nn] = float(g.max())
    return q, K, V, A, G, own


def _softmax_sinks(z: torch.Tensor, sinks: Any) -> torch.Tensor:
    """Softmax over the last dim of ``z``; with attention sinks (a logit per head of ``z``'s
    first dim, or one logit for a 1-D ``z``) each row's denominator holds ``e^sink`` as well
    (a key with that score and value 0: docs/math.md section 13)."""
    if sinks is None:
        return torch.softmax(z, -1)
    sk = torch.as_tensor(sinks, dtype=z.dtype).reshape(-1)
    col = (sk.reshape(-1, *([1] * (z.dim() - 1))) if z.dim() > 1 else sk).expand(
        *z.shape[:-1], 1)
    return torch.softmax(torch.cat((z, col), -1), -1)[..., :-1]


def _phi(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The layer's score transform: ``c tanh(s / c)`` (identity without a soft-cap)."""
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def _capped(G: dict, softcap: float | None) -> dict:
    """Bounds on the derivatives of the transformed scores ``z = c tanh(s / c)`` from those of
    ``s`` (Faa di Bruno: ``z^(1) = phi^(1) s^(1)``, ``z^(2) = phi^(2) (s^(1))^2 + phi^(1)
    s^(2)``, ``z^(3) = phi^(3) (s^(1))^3 + 3 phi^(2) s^(1) s^(2) + phi^(1) s^(3)``), with
    ``|phi^(1)| <= 1``, ``|phi^(2)| <= 4 / (3 sqrt(3) c)`` (the maximum of ``2 tanh sech^2``) and
    ``|phi^(3)| <= 2 / c^2`` (``2 sech^2 |1 - 3 tanh^2| <= 2``)."""
    if softcap is None:
        return G
    c = float(softcap)
    k2, k3 = 4.0 / (3.0 * math.sqrt(3.0) * c), 2.0 / (c * c)
    return {0: G[0], 1: G[1], 2: k2 * G[1] ** 2 + G[2],
            3: k3 * G[1] ** 3 + 3.0 * k2 * G[1] * G[2] + G[3]}


def _derivative_bounds(V: torch.Tensor, G: dict) -> tuple[torch.Tensor, ...]:
    """Per value component: ``B1 >= |y'|``, ``B2 >= |y''|``, ``B3 >= |y'''|`` (cumulant bounds)."""
    rng_v = V.max(0).values - V.min(0).values  # (r,)
    D1, D2, D3 = 2 * G[1], 2 * G[2], 2 * G[3]
    return rng_v * D1, rng_v * (D2 + D1 ** 2), rng_v * (D3 + 3 * D1 * D2 + 4 * D1 ** 3)


def _positional_result(check: str, layer: int, rows: list[dict], anchor: dict | None,
                       tolerance_from: str, **extra: Any) -> dict:
    """The result of a positional check: its rows, their worst error / relative error / ratio
    (NaN-keeping), and ok when every row and the anchor pass."""
    ok = all(r_["ok"] for r_ in rows) and (anchor is None or anchor["ok"])
    return {"check": check, "layer": int(layer), **extra, "rows": rows,
            "err_max": worst(r_["err_max"] for r_ in rows),
            "rel_max": worst(r_["rel"] for r_ in rows),
            "ratio_max": worst(r_["ratio"] for r_ in rows),
            "tolerance_from": tolerance_from, "anchor": anchor, "ok": ok}


def position_derivative(model: Any, layer: int, x: Any, positions: Any, queries: Sequence[int],
                        *, heads: Any = None,
                        head: tuple[HeadSpec, HeadWeights] | None = None) -> dict:
    """``d y_i / d p_i`` by the RoPE generator against a central difference of the model's own
    attention (docs/math.md section 5).

    Moving token ``i``'s position id moves its query *and* its own key: ``s_ij = q~_i . k~_j``
    depends on ``p_j - p_i``, so ``ds_ij/dp_i = q~_i A^T . k~_j`` for ``j < i`` and, for the self
    term, ``q~_i A^T . k~_i + q~_i . k~_i A^T = q~_i (A^T + A) k~_i^T = 0`` (``A`` is
    antisymmetric; computed, not assumed).  Then ``y_i' = sum_j w_ij (s_ij' - sum_k w_ik s_ik')
    v_j`` with the softmax weights ``w``; ropestep's side uses :func:`ropestep.fast.project`
    (rotated queries and keys, exact angles) and :func:`ropestep.rope.rope_generator`.

    Model side: :class:`_Attention64` (the model's projections, ``apply_rotary_pos_emb``,
    ``repeat_kv``, float64 softmax) with only token ``i``'s position id at ``p_i +- h``; ``FD =
    (y_i(p_i + h) - y_i(p_i - h)) / 2h``.  Tolerance per value component (all bounds hold
    uniformly in the position, from ``G_n = max_{j != i} sum_l omega_l^n |q~_l| |k~_jl|``, which
    bounds ``|s_ij^(n)|``, and ``R = max_j v_j - min_j v_j``; the joint cumulants of the softmax
    distribution are bounded by products of ranges):

        |y'| <= B1 = R D1,  |y''| <= B2 = R (D2 + D1^2),  |y'''| <= B3 = R (D3 + 3 D1 D2 + 4 D1^3),
        D_n = 2 G_n;
        tol = central_difference_abs(h, B3, eps_y) + eps_d,
        eps_y = position_eval_abs(N, d, m, S, p_i + h, B1),
        eps_d = position_eval_abs(N, d, m, D1 S, p_i, 2 B2)

    (``S = max|v|``; ``D1 S`` bounds the derivative's summed terms, ``2 B2`` its sensitivity to
    the angles' rounding).  ``h = 2^round(log2 (3 eps_y / B3)^(1/3))`` minimises the bound; a power
    of two keeps ``p_i +- h`` exact.  ``heads`` (the captured per-head outputs over ``x``) adds
    the anchor: this float64 composition, with the model's own float32 tables, reproduces them.

    QK-norm heads: the norms act on q and k before the rotation and do not depend on positions,
    so ``s_ij = q^_i R(p_j - p_i) k^_j^T scale`` with the normalised ``q^``, ``k^`` and every
    formula above holds with the normalised rotated vectors (:func:`ropestep.fast.project`'s
    ``q``/``k``, and :class:`_Attention64`'s model-side ones); ``m`` in the tolerances is then
    :func:`_norm_terms`'s ``2 m + n + 8`` (the norm's roundings).
    """
    info, conv, parts, x64, pos, qs, spec_an, weights, mdt = _setup_positional(
        model, layer, x, positions, queries, head)
    att = _Attention64(model, info, conv, parts, x64)
    P = fast.project(spec_an, weights, x64[qs], pos[qs], x64, pos, dtype=F64)
    m, d = _norm_terms(info, conv, spec_an, att.centring_gain), info.head_dim  # with QK-norm
    rows = []
    for qn, i in enumerate(qs):
        pi = int(pos[i])
        an_h, tol_h, hs = [], [], []
        for h in range(spec_an.n_heads):
            q, K, V, A, G, own = _row_terms(spec_an, P, qn, i, h)
            s = K @ q
            qA = q @ A.T  # d q~ / dp = q~ A^T
            ds = K @ qA
            ds[own] = ds[own] + q @ (K[own] @ A.T)  # the own key moves too: ~0
            if spec_an.softcap is not None:  # z = phi(s), z' = phi'(s) s'
                th = torch.tanh(s / spec_an.softcap)
                s, ds = spec_an.softcap * th, (1 - th * th) * ds
                G = _capped(G, spec_an.softcap)
            # the weights (a sink's logit in the denominator; its own score does not move)
            w = _softmax_sinks(s, None if spec_an.sinks is None else spec_an.sinks[h])
            dbar = (w * ds).sum()
            an = (w * (ds - dbar)) @ V
            B1, B2, B3 = _derivative_bounds(V, G)
            S = float(V.abs().max())
            N = K.shape[0]
            e_y = tl.position_eval_abs(N, d, m, S, pi + 1.0, B1)
            b3 = float(B3.max())
            e_max = float(torch.as_tensor(e_y).max())
            hh = 2.0 ** -2 if b3 <= 0 else 2.0 ** float(np.clip(
                np.round(np.log2((3 * e_max / b3) ** (1 / 3))), -30, -2))
            e_y = tl.position_eval_abs(N, d, m, S, pi + hh, B1)
            # the derivative's terms w_j (s_j' - bar) v_j add up to at most D1 max|v|
            e_d = tl.position_eval_abs(N, d, m, 2 * G[1] * S, pi, 2 * B2)
            tol = tl.central_difference_abs(hh, B3, e_y) + e_d
            an_h.append(an)
            tol_h.append(torch.as_tensor(tol))
            hs.append(hh)
        # the model's central difference, one step per head (the step depends on the head)
        fd_at: dict = {}
        for hh in sorted(set(hs)):
            pp, pm = pos.to(F64).clone(), pos.to(F64).clone()
            pp[i] += hh
            pm[i] -= hh
            fd_at[hh] = (att.heads_at(pp, [i])[0] - att.heads_at(pm, [i])[0]) / (2 * hh)
        fd_h = [fd_at[hh][h] for h, hh in enumerate(hs)]
        for h in range(spec_an.n_heads):
            err = (fd_h[h] - an_h[h]).abs()
            ratio = err / tol_h[h]
            rows.append({"head": h, "query": i, "position": pi, "h": hs[h],
                         "err_max": worst(err), "rel": worst(err) / max(float(an_h[h].abs().max()),
                                                                       tl.SCALE_GUARD),
                         "tol_max": worst(tol_h[h]), "ratio": worst(ratio),
                         "derivative_max": float(an_h[h].abs().max()),
                         "ok": within(ratio, 1.0)})
    return _positional_result("position_derivative", layer, rows, _anchor(att, pos, heads, mdt),
                              "per component: tolerances.central_difference_abs(h, B3, eps_y) + "
                              "eps_d, eps = tolerances.position_eval_abs; ok when err/tol <= 1")


def position_shift(model: Any, layer: int, x: Any, positions: Any, queries: Sequence[int],
                   deltas: Sequence[int] = (1, 7), *, heads: Any = None,
                   head: tuple[HeadSpec, HeadWeights] | None = None) -> dict:
    """``y_i(p_i + delta) - y_i(p_i)`` through ``phi_1(delta A)`` against the model's own attention
    at token ``i``'s position id ``p_i + delta`` (docs/math.md section 5), integer ``delta``.

    Ropestep's side: the rotated query and the query's own key move exactly,
    ``z(p + delta) - z(p) = delta A phi_1(delta A) z(p)``
    (:func:`ropestep.rope.rope_finite_difference`, column form), the other keys stay; the
    shifted row's softmax output minus the unshifted one.  Model side: :class:`_Attention64` at
    the shifted and the original positions.  Both sides are float64 evaluations of one function
    at positions ``<= p_i + |delta|``: each output within
    ``tolerances.position_eval_abs(N, d, m, S, p_i + |delta|, B1)`` of the other, so the
    difference of differences within twice that (``S = max|v|``, ``B1 = R D1`` as in
    :func:`position_derivative`).  ``rel`` relates the error to the size of the difference.
    QK-norm heads as in :func:`position_derivative` (normalised rotated vectors; ``m`` is
    :func:`_norm_terms`'s count).
    """
    info, conv, parts, x64, pos, qs, spec_an, weights, mdt = _setup_positional(
        model, layer, x, positions, queries, head)
    try:
        ds_ = [int(t) for t in deltas]
    except TypeError:
        raise ValueError("deltas must be a sequence of integers") from None
    if not ds_ or any(t != float(dt) for t, dt in zip(ds_, deltas)):
        raise ValueError(f"deltas must be non-empty integers, got {list(deltas)}")
    att = _Attention64(model, info, conv, parts, x64)
    P = fast.project(spec_an, weights, x64[qs], pos[qs], x64, pos, dtype=F64)
    m, d = _norm_terms(info, conv, spec_an, att.centring_gain), info.head_dim  # with QK-norm
    y0 = att.heads_at(pos.to(F64), qs)  # (Qs, H, r)
    rows = []
    for delta in ds_:
        for qn, i in enumerate(qs):
            pi = int(pos[i])
            pp = pos.to(F64).clone()
            pp[i] += delta
            ym = att.heads_at(pp, [i])[0]  # (H, r)
            for h in range(spec_an.n_heads):
                q, K, V, A, G, own = _row_terms(spec_an, P, qn, i, h)
                dq = rope.rope_finite_difference(spec_an, q[:, None], float(delta), h)[:, 0]
                dk = rope.rope_finite_difference(spec_an, K[own][:, None], float(delta), h)[:, 0]
                q2 = q + dq
                K2 = K.clone()
                K2[own] = K[own] + dk
                sk = None if spec_an.sinks is None else spec_an.sinks[h]
                y_new = _softmax_sinks(_phi(K2 @ q2, spec_an.softcap), sk) @ V
                y_old = _softmax_sinks(_phi(K @ q, spec_an.softcap), sk) @ V
                G = _capped(G, spec_an.softcap)
                D_rs = y_new - y_old
                D_m = ym[h] - y0[qn, h]
                B1, _, _ = _derivative_bounds(V, G)
                S = float(V.abs().max())
                tol = 2 * tl.position_eval_abs(K.shape[0], d, m, S, pi + abs(delta), B1)
                err = (D_m - D_rs).abs()
                ratio = err / torch.as_tensor(tol)
                rows.append({"head": h, "query": i, "position": pi, "delta": delta,
                             "err_max": worst(err),
                             "rel": worst(err) / max(float(D_m.abs().max()), tl.SCALE_GUARD),
                             "difference_max": float(D_m.abs().max()),
                             "tol_max": worst(torch.as_tensor(tol)), "ratio": worst(ratio),
                             "ok": within(ratio, 1.0)})
    return _positional_result("position_shift", layer, rows, _anchor(att, pos, heads, mdt),
                              "per component: 2 tolerances.position_eval_abs(N, d, m, max|v|, "
                              "p_i + |delta|, B1); ok when err/tol <= 1", deltas=ds_)
