"""``ropestep heads``: spectral and RoPE-band diagnostics of every head's W_q and W_k.

The per-head-base document asks whether RoPE squeezes attention heads into a few frequency bands
(high condition numbers, low effective rank of W_q/W_k) and proposes to give each head its own
RoPE base, chosen from a "barycenter" of its projection norms.  This command measures, for every
requested layer of a loaded model (or for any :class:`~ropestep.spec.HeadSpec` /
:class:`~ropestep.spec.HeadWeights` pair, :func:`diagnose_weights`):

* **condition number** ``cond(W) = sigma_max / sigma_min`` of the head's projection ``W`` in math
  layout, ``(m, d)`` (``q = x @ W_q + b_q``; column ``c`` is head dimension ``c``, one row of the
  PyTorch ``Linear``), from a float64 SVD of the weights (:func:`singular_values`).  The bias row of the augmented
  ``W^_q = [W_q; b_q^T]`` of docs/math.md section 1 is *not* included.  ``sigma_min = 0`` gives
  ``inf`` (and an all-zero matrix ``nan``): a failed check.
* **effective rank** (Roy & Vetterli, "The effective rank: a measure of effective
  dimensionality", EUSIPCO 2007): with the singular values normalised to ``p_k = sigma_k /
  sum_j sigma_j``, ``erank = exp(-sum_k p_k log p_k)`` (``0 log 0 = 0``).  It lies in ``[1, d]``:
  ``d`` for equal singular values, ``r`` for ``r`` equal non-zero ones.
* **band energy** per RoPE pair ``E_l = sum_{c: l(c) = l} ||W[:, c]||^2``
  (:func:`ropestep.rope.band_energy`), reported as fractions of ``||W||_F^2`` per pair and in
  four coarse bands, the quartiles of the pair index ``l`` (``numpy.array_split`` of
  ``0..d/2-1`` into four contiguous blocks).
* the **barycenter** ``t`` in ``[0, 1]`` of query head ``h`` (:func:`ropestep.rope.barycenter` of
  ``W_q[h]`` and the ``W_k`` of its KV head) and the base the document's geometric interpolation
  suggests, ``b(t) = b_min^(1-t) b_max^t`` (:func:`ropestep.rope.barycenter_base`, default range
  ``[1e3, 1e6]``).  Beside it, ``sketch_barycenter`` evaluates the document's pseudocode
  literally (``[W_q; W_k]`` rows indexed ``0..2d-1`` on ``linspace(0, 1, 2d)``), which puts every
  key row on the slow half of the axis and ignores the pairing; it is reported only to show how
  far it is from ``t``.

**Which way the frequency axis runs** (docs/math.md section 10).  Pair ``l`` turns at
``omega_l = base^(-2l/d)``: ``l = 0`` is the *fastest* pair (one radian per position, whatever the
base), ``l = d/2 - 1`` the slowest (about ``1/base`` radians per position).  Pair ``l`` is made of
dimensions ``(l, l + d/2)`` in the split-half layout (Hugging Face ``rotate_half``, every model
``ropestep.models`` loads) and ``(2l, 2l + 1)`` interleaved.  So ``t = 0`` (and the first coarse
band) means energy in the fast, most positional pairs; ``t = 1`` (the last band) in the slow,
nearly position-free pairs.  The report also reads ``omega_l`` back from the model's own
float32 RoPE tables and records whether it decreases with ``l``.

**Grouped-query attention.**  ``W_q`` is reported per query head and ``W_k`` per KV head (it is
shared): query head ``h`` reads KV head ``h // (n_heads / n_kv_heads)`` (``repeat_kv``), and the
barycenter of query head ``h`` pairs its own ``W_q`` with that KV head's ``W_k``.

Output: ``report.json`` first, then ``report.md`` (tables rendered from it) and ``figures/``
(heatmaps layer x head of ``cond(W_q)``, ``cond(W_k)`` (layer x KV head), effective rank and
barycenter; the band-energy profiles).  Exit status 0 when every number is finite, 1 when one is
NaN or inf (each named on stderr), 2 on bad input (one line, no traceback).  ``--dump-raw DIR``
also writes what every number of the report is computed from (per layer ``W_q``, ``W_k``, the
RoPE bases and tables; docs/protocol.md section 13), for the independent recomputation
:mod:`ropestep.reference.heads`; the report is the same with or without it.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import rope
from .provenance import model_files, portable_command, portable_name, sha256_file
from .runstate import peak_rss_mib
from .spec import HeadSpec, HeadWeights
from .verdict import Failure, input_error, output_and_threads_problem, print_failures

SCHEMA = "ropestep.heads/1"
BASE_RANGE = (1e3, 1e6)  # the document's default [base_min, base_max]
N_COARSE = 4  # coarse bands: quartiles of the pair index
COND_SMALL = 10.0  # the document's "well conditioned" mark (condition numbers < 10)

DEFINITIONS = {
    "matrix": "W is one head's projection in math layout (m, d): q = x @ W_q + b_q; column c is "
              "head dimension c (one row of the PyTorch Linear); the bias row is not included",
    "cond": "sigma_max / sigma_min of W from a float64 SVD (torch.linalg.svdvals; inf when "
            "sigma_min = 0)",
    "effective_rank": "Roy & Vetterli (2007): exp(-sum_k p_k log p_k), p_k = sigma_k / sum_j "
                      "sigma_j; in [1, d]",
    "band_energy": "E_l = sum over the two dimensions c of RoPE pair l of ||W[:, c]||^2, as a "
                   "fraction of ||W||_F^2; pair l = dims (l, l + d/2) split-half, (2l, 2l + 1) "
                   "interleaved",
    "coarse_bands": "the pair index 0..d/2-1 split into 4 contiguous blocks (numpy.array_split): "
                    "band 0 = fastest pairs, band 3 = slowest",
    "frequency_axis": "omega_l = base^(-2l/d): l = 0 fastest (1 rad/position), l = d/2-1 slowest "
                      "(~1/base rad/position) (docs/math.md section 10)",
    "barycenter": "t = sum_c w_c l(c)/(d/2-1) / sum_c w_c, w_c = ||W_q[:, c]|| + ||W_k[:, c]|| "
                  "(W_k of the query head's KV head); t = 0 fast pairs, t = 1 slow pairs",
    "barycenter_base": "b(t) = base_min^(1-t) * base_max^t (the document's geometric "
                       "interpolation): a head in the fast pairs gets the smaller base",
    "sketch_barycenter": "the document's pseudocode taken literally: rows of [W_q; W_k] "
                         "(Linear layout) weighted by their norms on linspace(0, 1, 2d), "
                         "+1e-8 in the denominator; key rows always sit in [d/(2d-1), 1]",
    "grouping": "query head h reads KV head h // (n_heads / n_kv_heads) (repeat_kv); W_k is "
                "reported per KV head",
}


class HeadsError(ValueError):
    """Bad input to ``ropestep heads`` (layers out of range, bad base range, ...): exit 2."""


# ---------------------------------------------------------------------------------------------
# one matrix
# ---------------------------------------------------------------------------------------------
def _f64(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        return a.detach().to("cpu", torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def singular_values(w: Any) -> np.ndarray:
    """Singular values of ``w`` in float64 (``torch.linalg.svdvals``, LAPACK), largest first.

    Torch rather than numpy: both call LAPACK, but numpy's OpenBLAS threads cannot be limited
    without an extra package, and on a shared machine they make a 896 x 64 SVD 40-80x slower;
    torch's follow ``torch.set_num_threads`` (the command uses one: the matrices are small).
    A matrix with a NaN or inf entry has no SVD (LAPACK refuses it): all NaN, a failed check."""
    arr = _f64(w)
    if not np.all(np.isfinite(arr)):
        return np.full(min(arr.shape), math.nan)
    return torch.linalg.svdvals(torch.as_tensor(arr)).numpy()


def condition_number(sv: np.ndarray) -> float:
    """``sigma_max / sigma_min``; ``inf`` when ``sigma_min = 0 < sigma_max``, ``nan`` when all
    are 0 (a zero matrix has no condition number) or when any is not finite."""
    sv = np.asarray(sv, dtype=np.float64)
    if sv.size == 0 or not np.all(np.isfinite(sv)):
        return math.nan
    hi, lo = float(sv.max()), float(sv.min())
    if hi == 0.0:
        return math.nan
    if lo == 0.0:
        return math.inf
    return hi / lo


def effective_rank(sv: np.ndarray) -> float:
    """Roy & Vetterli's effective rank ``exp(H(p))``, ``p = sigma / sum(sigma)`` (``nan`` for a
    zero matrix or non-finite singular values)."""
    sv = np.asarray(sv, dtype=np.float64)
    total = float(sv.sum())
    if sv.size == 0 or not np.all(np.isfinite(sv)) or total <= 0.0:
        return math.nan
    p = sv[sv > 0] / total
    return float(math.exp(-float(np.sum(p * np.log(p)))))


def coarse_bands(fractions: Sequence[float], n: int = N_COARSE) -> list[float]:
    """Per-pair fractions summed over ``n`` contiguous blocks of the pair index."""
    f = np.asarray(fractions, dtype=np.float64)
    return [float(b.sum()) for b in np.array_split(f, n)]


def band_fractions(w: Any, layout: str) -> list[float]:
    """:func:`ropestep.rope.band_energy` of ``w (m, d)`` divided by ``||w||_F^2`` (``nan`` for a
    zero matrix)."""
    e = rope.band_energy(torch.as_tensor(_f64(w)), layout).numpy()
    total = float(e.sum())
    if not total > 0.0:
        return [math.nan] * int(e.size)
    return [float(x) for x in e / total]


def matrix_diagnostics(w: Any, layout: str) -> dict:
    """Condition number, effective rank, singular-value extremes, Frobenius norm and band
    energy fractions (per pair and coarse) of one head's ``(m, d)`` projection."""
    arr = _f64(w)
    if arr.ndim != 2:
        raise ValueError(f"expected one head's (m, d) projection, got shape {arr.shape}")
    sv = singular_values(arr)
    frac = band_fractions(arr, layout)
    return {"cond": condition_number(sv), "effective_rank": effective_rank(sv),
            "sigma_max": float(sv.max()), "sigma_min": float(sv.min()),
            "frobenius": float(np.linalg.norm(arr)),
            "band_energy_fraction": frac, "coarse_band_fraction": coarse_bands(frac)}


def sketch_barycenter(w_q: Any, w_k: Any) -> float:
    """The document's initializer, literally: rows of ``cat([Wq_h, Wk_h])`` (``Linear`` layout
    ``(d, m)``, i.e. the columns of the math-layout ``(m, d)`` arrays given here), weighted by
    their norms, placed at ``linspace(0, 1, 2d)``; ``t = sum(imp * idx) / (sum(imp) + 1e-8)``."""
    q, k = torch.as_tensor(_f64(w_q)), torch.as_tensor(_f64(w_k))
    W = torch.cat([q.T, k.T], dim=0)  # [2 d, m]
    imp = W.norm(dim=1)
    idx = torch.linspace(0, 1, steps=imp.numel(), dtype=torch.float64)
    return float((imp * idx).sum() / (imp.sum() + 1e-8))


# ---------------------------------------------------------------------------------------------
# one layer (any head description)
# ---------------------------------------------------------------------------------------------
def frequency_axis(spec: HeadSpec) -> dict:
    """``omega_l`` of the layer: read back from the spec's cos/sin tables at position 1 when it
    carries a model's own tables (``atan2(sin, cos)``, exact for ``omega <= 1 < pi``), else the
    analytic ``base^(-2l/d)`` of head 0; and whether it decreases with ``l``."""
    d = spec.head_dim
    base = spec.rope.bases(spec.n_heads)[0]
    analytic = rope.rope_frequencies(base, d).numpy()
    if spec.rope.cos is not None and np.asarray(_f64(spec.rope.cos)).shape[0] >= 2:
        c, s = _f64(spec.rope.cos)[1], _f64(spec.rope.sin)[1]
        omega, source = np.arctan2(s, c), "the model's own RoPE tables (position 1)"
    else:
        omega, source = analytic, "analytic base^(-2l/d)"
    return {"source": source, "omega": [float(x) for x in omega],
            "omega_pair0": float(omega[0]), "omega_last": float(omega[-1]),
            "decreasing": bool(np.all(np.diff(omega) < 0)),
            "fastest_pair": int(np.argmax(omega)), "slowest_pair": int(np.argmin(omega)),
            "max_abs_diff_to_analytic": float(np.max(np.abs(omega - analytic)))}


def diagnose_weights(spec: HeadSpec, weights: HeadWeights, *,
                     base_range: tuple[float, float] = BASE_RANGE) -> dict:
    """Diagnostics of every head of one layer given as a head description.

    ``W_q`` per query head, ``W_k`` per KV head, the barycenter per query head (with the ``W_k``
    of its KV head ``h // group``).  Pure: nothing is loaded or written.  Any module exposing a
    ``head_description() -> (HeadSpec, HeadWeights)`` can be passed through it.
    """
    weights.check(spec)
    bmin, bmax = float(base_range[0]), float(base_range[1])
    if not (0.0 < bmin <= bmax and math.isfinite(bmax)):
        raise HeadsError(f"base range must satisfy 0 < base_min <= base_max < inf, got "
                         f"[{bmin}, {bmax}]")
    H, Hk, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    lay = spec.rope.layout
    wq, wk = _f64(weights.w_q), _f64(weights.w_k)  # (m, H, d), (m, Hk, d)
    kv_heads = []
    for g in range(Hk):
        kv_heads.append({"kv_head": g, "query_heads": [h for h in range(H) if spec.kv_head(h) == g],
                         "w_k": matrix_diagnostics(wk[:, g, :], lay)})
    query_heads = []
    for h in range(H):
        g = spec.kv_head(h)
        q_t, k_t = torch.as_tensor(wq[:, h, :]), torch.as_tensor(wk[:, g, :])
        try:
            t = rope.barycenter(q_t, k_t, lay)
            base = rope.barycenter_base(t, bmin, bmax)
        except ValueError:  # zero or non-finite weights: no barycenter (a failed check)
            t = base = math.nan
        query_heads.append({"head": h, "kv_head": g, "w_q": matrix_diagnostics(wq[:, h, :], lay),
                            "barycenter": t, "barycenter_base": base,
                            "sketch_barycenter": sketch_barycenter(q_t, k_t)})
    return {"n_heads": H, "n_kv_heads": Hk, "group": spec.group, "head_dim": d, "layout": lay,
            "family": spec.family, "rope_bases": list(spec.rope.bases(H)),
            "base_range": [bmin, bmax], "frequency_axis": frequency_axis(spec),
            "query_heads": query_heads, "kv_heads": kv_heads,
            "summary": summarise([{"query_heads": query_heads, "kv_heads": kv_heads}])}


# ---------------------------------------------------------------------------------------------
# summaries and checks
# ---------------------------------------------------------------------------------------------
def _stats(x: Sequence[float]) -> dict:
    a = np.asarray(list(x), dtype=np.float64)
    if a.size == 0:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": float(np.median(a)), "min": float(np.min(a)), "max": float(np.max(a)),
            "n": int(a.size)}  # numpy propagates NaN: a failed head is never hidden


def summarise(layers: Sequence[dict]) -> dict:
    """Medians and ranges over all the heads of ``layers`` (each with ``query_heads`` and
    ``kv_heads``), the fraction of matrices with ``cond < 10`` and the mean coarse bands."""
    qh = [h for L in layers for h in L["query_heads"]]
    kh = [g for L in layers for g in L["kv_heads"]]
    cq = [h["w_q"]["cond"] for h in qh]
    ck = [g["w_k"]["cond"] for g in kh]
    t = [h["barycenter"] for h in qh]
    return {
        "cond_w_q": _stats(cq), "cond_w_k": _stats(ck),
        "effective_rank_w_q": _stats(h["w_q"]["effective_rank"] for h in qh),
        "effective_rank_w_k": _stats(g["w_k"]["effective_rank"] for g in kh),
        "barycenter": _stats(t), "barycenter_base": _stats(h["barycenter_base"] for h in qh),
        "sketch_barycenter": _stats(h["sketch_barycenter"] for h in qh),
        "fraction_cond_w_q_below_10": float(np.mean(np.asarray(cq) < COND_SMALL)) if cq else math.nan,
        "fraction_cond_w_k_below_10": float(np.mean(np.asarray(ck) < COND_SMALL)) if ck else math.nan,
        "fraction_barycenter_below_half": float(np.mean(np.asarray(t) < 0.5)) if t else math.nan,
        "coarse_band_fraction_w_q_mean": (np.mean([h["w_q"]["coarse_band_fraction"] for h in qh], 0)
                                          .tolist() if qh else []),
        "coarse_band_fraction_w_k_mean": (np.mean([g["w_k"]["coarse_band_fraction"] for g in kh], 0)
                                          .tolist() if kh else []),
    }


def _nonfinite(x: Any) -> list[float]:
    """The NaN and infinite floats of a nested diagnostic (dicts, lists, tuples), in order."""
    if isinstance(x, dict):
        return [v for y in x.values() for v in _nonfinite(y)]
    if isinstance(x, (list, tuple)):
        return [v for y in x for v in _nonfinite(y)]
    return [x] if isinstance(x, float) and not math.isfinite(x) else []


_NAMES = {"cond": "cond(W_{m})", "effective_rank": "effective rank(W_{m})",
          "band_energy_fraction": "band energy(W_{m})", "coarse_band_fraction": "band energy(W_{m})",
          "sigma_max": "sigma_max(W_{m})", "sigma_min": "sigma_min(W_{m})",
          "frobenius": "||W_{m}||_F"}


def _matrix_failures(where: str, diag: dict, which: str) -> list[Failure]:
    """Non-finite entries of one matrix's diagnostics, one failure per named quantity."""
    out, seen = [], set()
    for key, v in diag.items():
        bad = _nonfinite(v)
        name = _NAMES.get(key, key).format(m=which)
        if bad and name not in seen:
            seen.add(name)
            out.append(Failure(where, name, bad[0]))
    return out


def failures(layers: dict[str, dict]) -> list[Failure]:
    """One :class:`~ropestep.verdict.Failure` per head quantity that is NaN or inf (the only
    checks of this command: every diagnostic must be a finite number)."""
    out: list[Failure] = []
    for L, lr in layers.items():
        for h in lr["query_heads"]:
            where = f"layer {L} query head {h['head']}"
            out += _matrix_failures(where, h["w_q"], "q")
            out += [Failure(where, key, h[key]) for key in
                    ("barycenter", "barycenter_base", "sketch_barycenter") if _nonfinite(h[key])]
        for g in lr["kv_heads"]:
            out += _matrix_failures(f"layer {L} KV head {g['kv_head']}", g["w_k"], "k")
    return out


# ---------------------------------------------------------------------------------------------
# a loaded model
# ---------------------------------------------------------------------------------------------
def parse_layers(text: str | Sequence[int], n_layers: int, allowed: Sequence[int] | None = None,
                 refused: dict[int, str] | None = None) -> list[int]:
    """``"all"``, ``"last"``, ``"7"`` or ``"0,3,5"`` (or a sequence) -> sorted distinct layers
    (:func:`ropestep.protocol.parse_indices`, its errors as :class:`HeadsError`)."""
    from .protocol import ProtocolError, parse_indices

    try:
        return parse_indices(text, n_layers, "layer", allowed, refused)
    except ProtocolError as err:
        raise HeadsError(str(err)) from None


def _over_layers(Ls: Sequence[int], head_of: Any, dump: Path | None,
                 base_range: tuple[float, float], dist_info: tuple[int, int] | None
                 ) -> tuple[dict, dict, dict] | None:
    """The diagnostics of the layers ``Ls`` (``head_of(L) -> (spec, weights)``; ``dump``: each
    layer's inputs to :func:`dump_layer`); under torchrun (``dist_info = (rank, world)``) each
    rank takes a contiguous share and rank 0 gathers them in layer order (the other ranks get
    None).  Returns ``(out, raw, rank_layers)``."""
    from .dist import gather_to_rank0, shard_contiguous

    def one(L: int) -> tuple[dict, dict | None]:
        spec, w = head_of(L)
        raw = dump_layer(dump, L, spec, w) if dump is not None else None
        return diagnose_weights(spec, w, base_range=base_range), raw

    rank, world = dist_info if dist_info is not None else (0, 1)
    mine = {str(L): one(L) for L in shard_contiguous(list(Ls), rank, world)}
    parts = gather_to_rank0(mine, rank, world)
    if rank != 0:
        return None
    got = {k: v for p in parts for k, v in p.items()}
    out = {str(L): got[str(L)][0] for L in Ls}
    raw = {str(L): got[str(L)][1] for L in Ls if got[str(L)][1] is not None}
    return out, raw, {str(r): shard_contiguous(list(Ls), r, world) for r in range(world)}


def diagnose(model: Any, layers: str | Sequence[int] = "all", *,
             base_range: tuple[float, float] = BASE_RANGE, dump: Path | None = None,
             dist_info: tuple[int, int] | None = None) -> dict | None:
    """Diagnostics of the requested decoder layers of a loaded Hugging Face model
    (:func:`ropestep.models.layer_head`, float64, the model's own RoPE tables); ``dump``: a
    directory that receives each layer's inputs (:func:`dump_layer`); ``dist_info``: the
    layers shared out under torchrun (:func:`_over_layers`; None on ranks other than 0).
    The model is read through the library (:func:`ropestep.api.attach`,
    :meth:`ropestep.api.Attached.head_description`)."""
    from . import api

    try:
        lab = api.attach(model)
    except api.ApiError as err:
        raise HeadsError(str(err)) from None
    info = lab.info
    Ls = parse_layers(layers, info.n_layers, info.softmax_layers, dict(info.others))
    res = _over_layers(Ls, lambda L: lab.head_description(L, 2), dump, base_range, dist_info)
    if res is None:
        return None
    out, raw, rank_layers = res
    summary = summarise(list(out.values()))
    return {"model": {"name": portable_name(info.name), "model_type": info.model_type,
                      "family": info.family, "n_layers": info.n_layers, "n_heads": info.n_heads,
                      "n_kv_heads": info.n_kv_heads, "group": info.group,
                      "head_dim": info.head_dim, "hidden": info.hidden,
                      "rope_theta": info.rope_theta, "qkv_bias": info.qkv_bias},
            "layers": out, "summary": summary, "raw_layers": raw, "rank_layers": rank_layers,
            "frequency_axis": next(iter(out.values()))["frequency_axis"] if out else None}


def diagnose_gpt(model: Any, layers: str | Sequence[int] = "all", *,
                 base_range: tuple[float, float] = BASE_RANGE, dump: Path | None = None,
                 dist_info: tuple[int, int] | None = None) -> dict | None:
    """The same diagnostics for a :class:`ropestep.families.GPT` (a trained variant of
    ``ropestep train-families``): each block's attention module describes its own heads
    (``head_description``: the learned per-head bases or temperatures included)."""
    cfg = model.config
    Ls = parse_layers(layers, len(model.blocks))
    res = _over_layers(Ls, lambda L: model.blocks[L].attn.head_description(dtype=torch.float64),
                       dump, base_range, dist_info)
    if res is None:
        return None
    out, raw, rank_layers = res
    summary = summarise(list(out.values()))
    spec0 = model.blocks[0].attn.head_description(dtype=torch.float64)[0]
    return {"model": {"name": f"ropestep.families GPT ({cfg.variant})", "model_type": "families",
                      "family": spec0.family, "n_layers": len(model.blocks),
                      "n_heads": spec0.n_heads, "n_kv_heads": spec0.n_kv_heads,
                      "group": spec0.group, "head_dim": spec0.head_dim, "hidden": cfg.d_model,
                      "rope_theta": None, "qkv_bias": False, "variant": cfg.variant},
            "layers": out, "summary": summary, "raw_layers": raw, "rank_layers": rank_layers,
            "frequency_axis": next(iter(out.values()))["frequency_axis"] if out else None}


SMOLLM2_ALIAS = "smollm2"


def _quiet_loading():
    """The protocol's silencer of the GGUF de-quantizer's progress bar, when it has one."""
    try:
        from .protocol import _quiet_gguf_progress
    except ImportError:  # pragma: no cover - protocol without it
        return contextlib.nullcontext()
    return _quiet_gguf_progress()


def load(model: str, *, revision: str | None = None, gguf: str | None = None,
         placement: dict | None = None) -> tuple[Any, dict]:
    """Load ``model`` (``"smollm2"``, a local directory, a ``.gguf`` file or a hub id) in float32
    without a tokenizer; return ``(model, provenance)`` with file names and sha256 only.
    ``placement``: accelerate's big-model placement (:func:`ropestep.models.placement`)."""
    from . import families, models

    source = model
    if families.is_checkpoint(model):  # a trained variant of ropestep train-families
        p = Path(str(model)).expanduser()
        gpt = families.load_checkpoint(p)
        return gpt, {"argument": portable_name(model), "source": portable_name(p),
                     "revision": None, "commit_hash": None,
                     "gguf_file": None, "gguf_sha256": None,
                     "weights_sha256": {q.name: sha256_file(q) for q in
                                        (p.with_suffix(".safetensors"), p.with_suffix(".json"))}}
    if str(model).strip().lower() == SMOLLM2_ALIAS:
        if gguf is not None:
            raise HeadsError("--gguf cannot be combined with --model smollm2 (the alias names "
                             "the packaged GGUF file)")
        source = str(models.locate_smollm2_gguf())
    with _quiet_loading():
        m, _ = models.load_model(source, revision=revision, gguf_file=gguf, dtype=torch.float32,
                                 device="cpu", tokenizer=False, **(placement or {}))
    prov: dict = {"argument": portable_name(model), "source": portable_name(source),
                  "revision": revision,
                  "commit_hash": getattr(m.config, "_commit_hash", None),
                  **model_files(source, gguf)}
    return m, prov


def run(model: str, *, layers: str = "all", revision: str | None = None, gguf: str | None = None,
        base_range: tuple[float, float] = BASE_RANGE, command: Sequence[str] | None = None,
        loaded: tuple[Any, dict] | None = None, dump_raw: Path | None = None,
        placement: dict | None = None, dist_info: tuple[int, int] | None = None
        ) -> dict | None:
    """Load (unless ``loaded = (model, provenance)`` is given), diagnose, and return the report.
    ``dump_raw``: a directory that receives what every number of the report is computed from
    (:func:`dump_layer`, :func:`write_raw_manifest`; the report is the same without it)."""
    from . import models
    from .protocol import environment

    bmin, bmax = float(base_range[0]), float(base_range[1])
    if not (0.0 < bmin <= bmax and math.isfinite(bmax)):
        raise HeadsError(f"--base-min/--base-max must satisfy 0 < base_min <= base_max < inf, "
                         f"got [{bmin}, {bmax}]")
    if isinstance(layers, str) and layers.strip().lower() not in ("all", "last"):
        parse_layers(layers, sys.maxsize)  # the syntax, before a model is loaded
    t0 = time.perf_counter()
    m, prov = load(model, revision=revision, gguf=gguf, placement=placement) \
        if loaded is None else loaded
    t1 = time.perf_counter()
    from .families import GPT

    if dump_raw is not None:
        dump_raw.mkdir(parents=True, exist_ok=True)
    res = (diagnose_gpt if isinstance(m, GPT) else diagnose)(m, layers, base_range=(bmin, bmax),
                                                             dump=dump_raw, dist_info=dist_info)
    if res is None:  # a rank other than 0 under torchrun: its layers went to rank 0
        return None
    t2 = time.perf_counter()
    fl = failures(res["layers"])
    res["model"].update({k: v for k, v in prov.items() if k not in res["model"]})
    result = {
        "schema": SCHEMA,
        "command": portable_command(list(command) if command is not None else None),
        "config": {"model": portable_name(model), "revision": revision,
                   "gguf": portable_name(gguf), "layers": layers if isinstance(layers, str)
                   else list(layers), "base_min": bmin, "base_max": bmax},
        "model": res["model"],
        "definitions": DEFINITIONS,
        "frequency_axis": res["frequency_axis"],
        "summary": res["summary"],
        "layers": res["layers"],
        "environment": {**environment("cpu"),
                        "placement": models.placement_record(m, placement)},
        "timing_seconds": {"load_model": t1 - t0, "diagnose": t2 - t1},
        "peak_rss_mib": peak_rss_mib(),
        "run": {"world_size": len(res["rank_layers"]), "rank_layers": res["rank_layers"]},
        "verdict": {"passed": not fl, "failed": [f.as_dict() for f in fl]},
    }
    if dump_raw is not None:
        write_raw_manifest(dump_raw, result, res["raw_layers"])
    return result


# ---------------------------------------------------------------------------------------------
# --dump-raw: what every number of the report is computed from (docs/protocol.md section 13)
# ---------------------------------------------------------------------------------------------
RAW_SCHEMA = "ropestep.heads-raw/1"
RAW_MANIFEST = "heads_raw.json"


def dump_layer(out: Path, layer: int, spec: HeadSpec, weights: HeadWeights) -> dict:
    """``layer{L}.safetensors``: the head projections exactly as :func:`diagnose_weights` reads
    them, ``w_q (m, H, d)`` and ``w_k (m, H_kv, d)`` in math layout and float64 (the model's
    values, converted exactly), the per-query-head RoPE bases ``rope_bases (H,)`` (head 0's
    gives the analytic frequency axis) and, when the layer carries the model's own RoPE tables,
    ``cos``/``sin`` ``(P, d/2)`` (float64 of the model's float32 values; row ``p`` is position
    ``p``), from which the frequency axis is read.  Biases are not used by the diagnostics.
    Returns the layer's sizes, pairing layout and score family for the manifest."""
    from .protocol import save_tensors

    tensors = {"w_q": weights.w_q, "w_k": weights.w_k,
               "rope_bases": torch.tensor(spec.rope.bases(spec.n_heads), dtype=torch.float64)}
    if spec.rope.cos is not None:
        tensors.update(cos=torch.as_tensor(_f64(spec.rope.cos)),
                       sin=torch.as_tensor(_f64(spec.rope.sin)))
    save_tensors(out / f"layer{layer}.safetensors",
                 {k: torch.as_tensor(_f64(v)) for k, v in tensors.items()})
    return {"n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
            "hidden": int(weights.w_q.shape[0]), "layout": spec.rope.layout,
            "family": spec.family}


def write_raw_manifest(out: Path, result: dict, layers: dict[str, dict]) -> None:
    """``heads_raw.json``: the report's ``command``, ``config`` and ``model`` exactly as it
    records them, the base range, and per dumped layer what :func:`dump_layer` returned (its
    sizes, pairing layout and score family, from the layer's head description)."""
    from .report import dumps

    manifest = {"schema": RAW_SCHEMA, **{k: result[k] for k in ("command", "config", "model")},
                "base_range": [result["config"]["base_min"], result["config"]["base_max"]],
                "layers": layers}
    (out / RAW_MANIFEST).write_text(dumps(manifest), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# report: JSON first, then Markdown and figures rendered from it
# ---------------------------------------------------------------------------------------------
def grid(result: dict, what: str) -> tuple[list[int], np.ndarray]:
    """``(layers, values (n_layers, heads))`` for ``what`` in ``cond_q``, ``cond_k``,
    ``erank_q``, ``erank_k``, ``barycenter`` (the heatmaps of :data:`HEATMAPS`)."""
    layers = sorted(int(k) for k in result["layers"])
    get = {
        "cond_q": lambda lr: [h["w_q"]["cond"] for h in lr["query_heads"]],
        "cond_k": lambda lr: [g["w_k"]["cond"] for g in lr["kv_heads"]],
        "erank_q": lambda lr: [h["w_q"]["effective_rank"] for h in lr["query_heads"]],
        "erank_k": lambda lr: [g["w_k"]["effective_rank"] for g in lr["kv_heads"]],
        "barycenter": lambda lr: [h["barycenter"] for h in lr["query_heads"]],
    }[what]
    return layers, np.array([get(result["layers"][str(L)]) for L in layers], dtype=float)


def _fmt_stats(s: dict, spec: str = ".3g") -> str:
    from .verdict import num

    return f"{num(s['median'], spec)} [{num(s['min'], spec)}, {num(s['max'], spec)}]"


def render_markdown(result: dict) -> str:
    from .verdict import num

    mod, cfg, s, fa = result["model"], result["config"], result["summary"], result["frequency_axis"]
    d = mod["head_dim"]
    lines = [f"# Heads: {mod['name']}", "",
             f"Command: `{' '.join(result['command'] or [])}`", "",
             f"Model: {mod['name']} ({mod['model_type']}, {mod['n_layers']} layers, "
             f"{mod['n_heads']} query heads on {mod['n_kv_heads']} KV heads, head dim {d}, "
             f"hidden {mod['hidden']}, rope_theta {num(mod['rope_theta'], 'g')}); file "
             f"`{mod.get('gguf_file') or mod.get('source')}` sha256 "
             f"`{mod.get('gguf_sha256') or mod.get('weights_sha256')}`.", ""]
    v = result["verdict"]
    lines += [f"**Verdict: {'PASS' if v['passed'] else 'FAIL'}** (every diagnostic finite)"
              + ("" if v["passed"] else f"; {len(v['failed'])} non-finite: "
                 + "; ".join(f"{f['where']}: {f['check']}" for f in v["failed"][:10])), ""]
    lines += ["## Definitions", ""] + [f"* **{k}**: {t}" for k, t in result["definitions"].items()]
    lines += ["", "## Frequency axis", "",
              f"From {fa['source']}: omega_0 = {num(fa['omega_pair0'], '.6g')} rad/position "
              f"(pair 0), omega_{d // 2 - 1} = {num(fa['omega_last'], '.3g')}; decreasing in l: "
              f"**{fa['decreasing']}** (fastest pair {fa['fastest_pair']}, slowest "
              f"{fa['slowest_pair']}; max |omega - base^(-2l/d)| = "
              f"{num(fa['max_abs_diff_to_analytic'], '.2g')}).  Coarse band 0 holds the fastest "
              f"quarter of the pairs, band 3 the slowest.", ""]
    lines += ["## Summary over all heads", "", "| quantity | median [min, max] |", "|---|---|",
              f"| cond(W_q), {s['cond_w_q']['n']} query heads | {_fmt_stats(s['cond_w_q'])} |",
              f"| cond(W_k), {s['cond_w_k']['n']} KV heads | {_fmt_stats(s['cond_w_k'])} |",
              f"| effective rank W_q (of {d}) | {_fmt_stats(s['effective_rank_w_q'])} |",
              f"| effective rank W_k (of {d}) | {_fmt_stats(s['effective_rank_w_k'])} |",
              f"| barycenter t | {_fmt_stats(s['barycenter'])} |",
              f"| suggested base b(t) in [{num(cfg['base_min'], 'g')}, {num(cfg['base_max'], 'g')}]"
              f" | {_fmt_stats(s['barycenter_base'])} |",
              f"| the document's literal sketch t | {_fmt_stats(s['sketch_barycenter'])} |",
              f"| fraction cond(W_q) < 10 | {num(s['fraction_cond_w_q_below_10'])} |",
              f"| fraction cond(W_k) < 10 | {num(s['fraction_cond_w_k_below_10'])} |",
              f"| fraction t < 0.5 | {num(s['fraction_barycenter_below_half'])} |",
              "| mean coarse band energy W_q (fast → slow) | "
              + ", ".join(num(x) for x in s["coarse_band_fraction_w_q_mean"]) + " |",
              "| mean coarse band energy W_k (fast → slow) | "
              + ", ".join(num(x) for x in s["coarse_band_fraction_w_k_mean"]) + " |", ""]
    lines += ["## Per layer (median [min, max] over heads)", "",
              "| layer | cond W_q | cond W_k | erank W_q | erank W_k | barycenter t | base b(t) | "
              "W_q bands (fast → slow) | W_k bands |",
              "|---:|---|---|---|---|---|---|---|---|"]
    for L, lr in result["layers"].items():
        ls = lr["summary"]
        lines.append(
            f"| {L} | {_fmt_stats(ls['cond_w_q'])} | {_fmt_stats(ls['cond_w_k'])} | "
            f"{_fmt_stats(ls['effective_rank_w_q'])} | {_fmt_stats(ls['effective_rank_w_k'])} | "
            f"{_fmt_stats(ls['barycenter'])} | {_fmt_stats(ls['barycenter_base'])} | "
            + ", ".join(num(x, '.2f') for x in ls["coarse_band_fraction_w_q_mean"]) + " | "
            + ", ".join(num(x, '.2f') for x in ls["coarse_band_fraction_w_k_mean"]) + " |")
    lines += ["", "## Per query head", "",
              f"W_k is shared by the {mod['group']} query heads of a KV head (query head h reads "
              f"KV head h // {mod['group']}); its numbers repeat in their rows.", "",
              "| layer | head | KV | cond W_q | cond W_k | erank W_q | erank W_k | t | b(t) | "
              "sketch t | W_q bands (fast → slow) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for L, lr in result["layers"].items():
        for h in lr["query_heads"]:
            g = lr["kv_heads"][h["kv_head"]]["w_k"]
            lines.append(
                f"| {L} | {h['head']} | {h['kv_head']} | {num(h['w_q']['cond'])} | "
                f"{num(g['cond'])} | {num(h['w_q']['effective_rank'], '.1f')} | "
                f"{num(g['effective_rank'], '.1f')} | {num(h['barycenter'], '.3f')} | "
                f"{num(h['barycenter_base'], '.3g')} | {num(h['sketch_barycenter'], '.3f')} | "
                + ", ".join(num(x, '.2f') for x in h["w_q"]["coarse_band_fraction"]) + " |")
    if result["layers"]:
        lines += ["", "## Figures", ""]
        for name, title, _ in HEATMAPS:
            lines.append(f"![{title}](figures/heatmap_{name}.png)")
        lines.append("![band energy per RoPE pair](figures/band_energy.png)")
    env = result["environment"]
    lines += ["", "## Environment", "", f"`{env}`", "",
              f"Time: load {num(result['timing_seconds']['load_model'], '.1f')} s, diagnostics "
              f"{num(result['timing_seconds']['diagnose'], '.1f')} s; peak resident memory "
              f"{num(result['peak_rss_mib'], '.0f')} MiB.", ""]
    return "\n".join(lines)


HEATMAPS = (  # (grid name, title, log10)
    ("cond_q", "cond(W_q) per query head", True),
    ("cond_k", "cond(W_k) per KV head", True),
    ("erank_q", "effective rank of W_q", False),
    ("erank_k", "effective rank of W_k (per KV head)", False),
    ("barycenter", "barycenter t (0 = fast pairs, 1 = slow pairs)", False),
)


def render_figures(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for name, title, log in HEATMAPS:
        layers, vals = grid(result, name)
        with np.errstate(divide="ignore", invalid="ignore"):
            show = np.log10(vals) if log else vals
        fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * vals.shape[1] + 2.5),
                                        0.22 * len(layers) + 1.6))
        im = ax.imshow(show, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(L) for L in layers], fontsize=6)
        ax.set_xticks(range(vals.shape[1]), [str(i) for i in range(vals.shape[1])], fontsize=6)
        ax.set_xlabel("KV head" if name.endswith("_k") else "query head")
        ax.set_ylabel("layer")
        ax.set_title(("log10 " if log else "") + title, fontsize=8)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / f"heatmap_{name}.png", dpi=110)
        plt.close(fig)
    layers = sorted(int(k) for k in result["layers"])
    fig, axs = plt.subplots(1, 3, figsize=(13, 3.6))
    cmap = plt.get_cmap("viridis")
    for ax, key, which in ((axs[0], "query_heads", "w_q"), (axs[1], "kv_heads", "w_k")):
        for i, L in enumerate(layers):
            rows = [h[which]["band_energy_fraction"] for h in result["layers"][str(L)][key]]
            ax.plot(np.mean(rows, 0), color=cmap(i / max(1, len(layers) - 1)), lw=0.8)
        ax.set_xlabel("RoPE pair l (0 = fastest)")
        ax.set_ylabel("fraction of ||W||_F^2 (mean over heads)")
        ax.set_title(f"band energy of {which.replace('w_', 'W_')} per layer (dark = first)",
                     fontsize=8)
    ts = [h["barycenter"] for L in layers for h in result["layers"][str(L)]["query_heads"]]
    sk = [h["sketch_barycenter"] for L in layers for h in result["layers"][str(L)]["query_heads"]]
    axs[2].hist([ts, sk], bins=np.linspace(0, 1, 41), label=["barycenter t", "document's sketch"])
    axs[2].set_xlabel("t (0 = fast pairs, 1 = slow pairs)")
    axs[2].set_title("barycenters of all query heads", fontsize=8)
    axs[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "band_energy.png", dpi=110)
    plt.close(fig)


def write_report(result: dict, out: Path, *, figures: bool = True) -> None:
    """``report.json``, then ``report.md`` and ``figures/`` into ``out`` (replaced atomically:
    :func:`ropestep.report.write_rendered`)."""
    from .report import write_rendered

    write_rendered(out, result, render_markdown, render_figures, figures)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    from .models import add_model_arguments, add_placement_arguments

    add_model_arguments(p)
    add_placement_arguments(p)
    p.add_argument("--layers", default="all", metavar="all|a,b|last", help="layers [all]")
    p.add_argument("--base-min", type=float, default=BASE_RANGE[0],
                   help="smallest suggested base b(0) [1e3]")
    p.add_argument("--base-max", type=float, default=BASE_RANGE[1],
                   help="largest suggested base b(1) [1e6]")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads [1: the matrices are small, more threads only contend]")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")
    p.add_argument("--out", required=True, metavar="DIR", help="report directory")
    p.add_argument("--dump-raw", metavar="DIR", default=None,
                   help="also write what every number is computed from (per layer W_q, W_k, "
                        "RoPE tables and bases; docs/protocol.md section 13) into DIR")


def main_args(args, argv: Sequence[str]) -> int:
    """Handler of ``ropestep heads``: 0 all finite, 1 a diagnostic is NaN/inf, 2 bad input."""
    from . import models
    from .verdict import num

    prog = "ropestep heads"

    def bad(err: BaseException) -> int:
        return input_error(prog, err)

    out = Path(args.out)
    problem = output_and_threads_problem(out, args.threads)
    if problem is not None:
        return bad(problem)
    dump_raw = None if args.dump_raw is None else Path(args.dump_raw)
    if dump_raw is not None and dump_raw.exists() and not dump_raw.is_dir():
        return bad(HeadsError(f"--dump-raw {args.dump_raw}: exists and is not a directory"))
    try:
        place = models.placement(args.device_map, args.max_memory, args.offload_folder)
    except models.ModelLoadError as err:
        return bad(err)
    scratch = None
    if place is not None and place["device_map"] == "auto" and "offload_folder" not in place:
        scratch = tempfile.mkdtemp(prefix="ropestep-offload-")  # removed below
        place["offload_folder"] = scratch
    from .dist import broadcast_from_rank0, finish, init_distributed, launcher_command

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    synced = False
    try:  # under torchrun the layers are shared between the processes (_over_layers)
        rank, world, _ = init_distributed(None, "cpu")
        try:
            result = run(args.model, layers=args.layers, revision=args.revision, gguf=args.gguf,
                         base_range=(args.base_min, args.base_max),
                         command=launcher_command(["ropestep", *argv]),
                         dump_raw=dump_raw, placement=place, dist_info=(rank, world))
            if rank == 0:
                write_report(result, out, figures=not args.no_figures)
        except (HeadsError, models.ModelLoadError, models.UnsupportedModelError) as err:
            return bad(err)
        code = broadcast_from_rank0(
            (0 if result["verdict"]["passed"] else 1) if rank == 0 else None, rank, world)
        synced = True
        if rank != 0:
            return code
    finally:
        finish(barrier=synced)
        torch.set_num_threads(threads)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if not args.quiet:
        s = result["summary"]
        print(f"{result['model']['name']}: cond(W_q) median {num(s['cond_w_q']['median'])}, "
              f"cond(W_k) median {num(s['cond_w_k']['median'])}, effective rank W_q median "
              f"{num(s['effective_rank_w_q']['median'])}, barycenter median "
              f"{num(s['barycenter']['median'])}; wrote {out}/report.json and report.md")
    if not result["verdict"]["passed"]:
        print_failures(prog, result["verdict"]["failed"], limit=50)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ropestep.heads ...``; the same as ``ropestep heads``."""
    from .verdict import module_main

    return module_main("heads", __doc__, add_arguments, main_args, argv)


if __name__ == "__main__":  # also what torchrun launches: -m ropestep.heads ...
    from .dist import exit_worker, under_launcher

    _code = main()
    if under_launcher():
        exit_worker(_code)
    sys.exit(_code)
