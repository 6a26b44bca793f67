"""``ropestep heads``' report recomputed from its raw dump (docs/protocol.md section 13),
independently of the code that wrote it.

Written from docs/protocol.md section 13 alone, one head at a time in plain numpy float64 (the
SVD is LAPACK's through ``numpy.linalg.svd``) and mpmath for the scalar transcendental values
(the frequency axis, the suggested base).  Its input is the directory ``ropestep heads
--dump-raw DIR`` writes: per reported layer ``layer{L}.safetensors`` (``w_q (m, H, d)``,
``w_k (m, H_kv, d)``, ``rope_bases (H,)`` and, when the model has them, its RoPE tables
``cos``/``sin`` ``(P, d/2)``) and ``heads_raw.json`` (the report's command, config and model
echo, the base range and each layer's sizes, pairing layout and score family).

:func:`recompute` returns a report-shaped dict of every field the report has except the run's
circumstances (schema, definitions text, environment, timings, memory).  The per-matrix
helpers (:func:`matrix_diagnostics` and the W_q/W_k diagnostics shared with the
train-families reference, :mod:`ropestep.reference.families`) follow the definitions of
section 13, including their non-finite cases.

Imports: numpy, mpmath, safetensors' numpy reader and other reference modules; nothing else
of ropestep and not torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mpmath
import numpy as np
from safetensors.numpy import load_file

from . import families as fam  # pair_of, band fractions, sketch, stats: the same definitions

RAW_SCHEMA = "ropestep.heads-raw/1"
RAW_MANIFEST = "heads_raw.json"
N_COARSE = 4  # coarse bands: the pair index cut into 4 contiguous blocks
COND_SMALL = 10.0  # the per-head-base document's "well conditioned" mark
HALF = 0.5  # fraction_barycenter_below_half
SOURCE_TABLES = "the model's own RoPE tables (position 1)"
SOURCE_ANALYTIC = "analytic base^(-2l/d)"
MATRIX_CHECKS = (  # (diagnostic key, check name) in the order the verdict lists them
    ("cond", "cond(W_{m})"), ("effective_rank", "effective rank(W_{m})"),
    ("sigma_max", "sigma_max(W_{m})"), ("sigma_min", "sigma_min(W_{m})"),
    ("frobenius", "||W_{m}||_F"), ("band_energy_fraction", "band energy(W_{m})"),
    ("coarse_band_fraction", "band energy(W_{m})"))
HEAD_CHECKS = ("barycenter", "barycenter_base", "sketch_barycenter")


# ---------------------------------------------------------------------------------------------
# the dump
# ---------------------------------------------------------------------------------------------
@dataclass
class Layer:
    """One dumped layer: ``w_q (m, H, d)``, ``w_k (m, H_kv, d)`` float64, ``rope_bases (H,)``,
    the model's RoPE tables ``cos``/``sin`` ``(P, d/2)`` or None, and its manifest entry."""

    index: int
    w_q: np.ndarray
    w_k: np.ndarray
    rope_bases: np.ndarray
    cos: np.ndarray | None
    sin: np.ndarray | None
    facts: dict

    @property
    def n_heads(self) -> int:
        return int(self.w_q.shape[1])

    @property
    def n_kv_heads(self) -> int:
        return int(self.w_k.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.w_q.shape[2])

    @property
    def hidden(self) -> int:
        return int(self.w_q.shape[0])

    def kv_head(self, h: int) -> int:
        """Query head ``h`` reads KV head ``h // (H / H_kv)``."""
        return h // (self.n_heads // self.n_kv_heads)

    def q(self, h: int) -> np.ndarray:
        return self.w_q[:, h, :]

    def k(self, g: int) -> np.ndarray:
        return self.w_k[:, g, :]


def load(raw_dir: str | Path) -> tuple[dict, dict[int, Layer]]:
    """The manifest and the dumped layers (ascending), each checked against its entry."""
    raw_dir = Path(raw_dir)
    manifest = json.loads((raw_dir / RAW_MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("schema") != RAW_SCHEMA:
        raise ValueError(f"{raw_dir}: not a heads dump (schema {manifest.get('schema')!r})")
    layers = {}
    for key in sorted(manifest["layers"], key=int):
        t = load_file(str(raw_dir / f"layer{key}.safetensors"))
        lay = Layer(int(key), t["w_q"].astype(np.float64), t["w_k"].astype(np.float64),
                    t["rope_bases"].astype(np.float64),
                    t["cos"].astype(np.float64) if "cos" in t else None,
                    t["sin"].astype(np.float64) if "sin" in t else None,
                    manifest["layers"][key])
        f = lay.facts
        got = (lay.hidden, lay.n_heads, lay.n_kv_heads, lay.head_dim)
        if got != (f["hidden"], f["n_heads"], f["n_kv_heads"], f["head_dim"]):
            raise ValueError(f"{raw_dir}: layer {key} shapes {got} disagree with the manifest")
        layers[int(key)] = lay
    return manifest, layers


# ---------------------------------------------------------------------------------------------
# one matrix
# ---------------------------------------------------------------------------------------------
def singular_values(w: np.ndarray) -> np.ndarray:
    """All ``min(m, d)`` singular values of ``w`` (LAPACK through numpy), largest first; all NaN
    when an entry is not finite (no SVD)."""
    w = np.asarray(w, dtype=np.float64)
    if not np.all(np.isfinite(w)):
        return np.full(min(w.shape), math.nan)
    return np.linalg.svd(w, compute_uv=False)


def condition_number(sv: np.ndarray) -> float:
    """``sigma_max / sigma_min``: ``inf`` when ``sigma_min = 0 < sigma_max``; ``nan`` for a zero
    matrix or a non-finite singular value."""
    if sv.size == 0 or not np.all(np.isfinite(sv)) or sv.max() == 0.0:
        return math.nan
    return math.inf if sv.min() == 0.0 else float(sv.max() / sv.min())


def effective_rank(sv: np.ndarray) -> float:
    """Roy & Vetterli: ``exp(-sum_k p_k log p_k)``, ``p_k = sigma_k / sum_j sigma_j``, ``0 log 0
    = 0``; ``nan`` for a zero matrix or a non-finite singular value."""
    if sv.size == 0 or not np.all(np.isfinite(sv)) or not sv.sum() > 0.0:
        return math.nan
    return fam.effective_rank(sv)


def band_fractions(w: np.ndarray, layout: str) -> list[float]:
    """``E_l / ||W||_F^2`` per pair ``l`` (``nan`` for every pair of a zero matrix)."""
    d = w.shape[1]
    if not np.sum(w * w) > 0.0:
        return [math.nan] * (d // 2)
    return [float(x) for x in fam.band_fractions(w, layout)]


def coarse_bands(frac: list[float]) -> list[float]:
    """The per-pair fractions summed over the 4 contiguous blocks of ``numpy.array_split``: with
    ``n = d/2`` pairs, the first ``n mod 4`` blocks hold ``ceil(n/4)`` pairs, the rest
    ``floor(n/4)``."""
    n = len(frac)
    sizes = [n // N_COARSE + (1 if b < n % N_COARSE else 0) for b in range(N_COARSE)]
    out, start = [], 0
    for s in sizes:
        out.append(float(sum(frac[start:start + s])))
        start += s
    return out


def matrix_diagnostics(w: np.ndarray, layout: str) -> dict:
    """The ``w_q``/``w_k`` record of one ``(m, d)`` projection (docs/protocol.md section 13)."""
    sv = singular_values(w)
    frac = band_fractions(w, layout)
    finite = bool(np.all(np.isfinite(sv)))
    return {"cond": condition_number(sv), "effective_rank": effective_rank(sv),
            "sigma_max": float(sv.max()) if finite else math.nan,
            "sigma_min": float(sv.min()) if finite else math.nan,
            "frobenius": math.sqrt(float(np.sum(w * w))),
            "band_energy_fraction": frac, "coarse_band_fraction": coarse_bands(frac)}


def barycenter(wq: np.ndarray, wk: np.ndarray, layout: str) -> float:
    """``t = sum_c w_c l(c)/(d/2 - 1) / sum_c w_c``, ``w_c = ||W_q[:, c]|| + ||W_k[:, c]||``;
    ``nan`` when the weights are zero or not finite."""
    imp = np.linalg.norm(wq, axis=0) + np.linalg.norm(wk, axis=0)
    if not np.all(np.isfinite(imp)) or not imp.sum() > 0.0:
        return math.nan
    return fam.barycenter(wq, wk, layout)


def barycenter_base(t: float, lo: float, hi: float) -> float:
    """``b(t) = lo^(1-t) hi^t`` in mpmath at 30 digits, rounded once (``nan`` for a ``nan``
    ``t``)."""
    if not math.isfinite(t):
        return math.nan
    with mpmath.workdps(30):
        return float(mpmath.power(lo, 1 - mpmath.mpf(t)) * mpmath.power(hi, mpmath.mpf(t)))


# ---------------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------------
def analytic_frequencies(base: float, d: int) -> list[float]:
    """``omega_l = base^(-2l/d)``, ``l = 0 .. d/2 - 1``, in mpmath at 30 digits."""
    with mpmath.workdps(30):
        return [float(mpmath.power(base, -mpmath.mpf(2 * ell) / d)) for ell in range(d // 2)]


def frequency_axis(lay: Layer) -> dict:
    """``omega_l``: ``atan2(sin_1l, cos_1l)`` of the model's tables at position 1 when dumped,
    else the analytic axis of head 0's base; its orientation and distance to the analytic one."""
    d = lay.head_dim
    analytic = analytic_frequencies(float(lay.rope_bases[0]), d)
    if lay.cos is not None and lay.cos.shape[0] >= 2:
        with mpmath.workdps(30):
            omega = [float(mpmath.atan2(mpmath.mpf(float(s)), mpmath.mpf(float(c))))
                     for c, s in zip(lay.cos[1], lay.sin[1])]
        source = SOURCE_TABLES
    else:
        omega, source = list(analytic), SOURCE_ANALYTIC
    dec = all(omega[i + 1] < omega[i] for i in range(len(omega) - 1))
    return {"source": source, "omega": omega, "omega_pair0": omega[0], "omega_last": omega[-1],
            "decreasing": dec, "fastest_pair": omega.index(max(omega)),
            "slowest_pair": omega.index(min(omega)),
            "max_abs_diff_to_analytic": max(abs(a - b) for a, b in zip(omega, analytic))}


def layer_block(lay: Layer, base_range: tuple[float, float]) -> dict:
    """``layers[L]``: W_q per query head, W_k per KV head, each query head's barycenter with the
    W_k of its KV head, ``b(t)``, the document's sketch, and the layer's summary."""
    lo, hi = base_range
    H, Hk, lay_out = lay.n_heads, lay.n_kv_heads, lay.facts["layout"]
    kv = [{"kv_head": g, "query_heads": [h for h in range(H) if lay.kv_head(h) == g],
           "w_k": matrix_diagnostics(lay.k(g), lay_out)} for g in range(Hk)]
    qh = []
    for h in range(H):
        g = lay.kv_head(h)
        t = barycenter(lay.q(h), lay.k(g), lay_out)
        qh.append({"head": h, "kv_head": g, "w_q": matrix_diagnostics(lay.q(h), lay_out),
                   "barycenter": t, "barycenter_base": barycenter_base(t, lo, hi),
                   "sketch_barycenter": fam.sketch_barycenter(lay.q(h), lay.k(g))})
    return {"n_heads": H, "n_kv_heads": Hk, "group": H // Hk, "head_dim": lay.head_dim,
            "layout": lay_out, "family": lay.facts["family"],
            "rope_bases": [float(b) for b in lay.rope_bases], "base_range": [lo, hi],
            "frequency_axis": frequency_axis(lay), "query_heads": qh, "kv_heads": kv,
            "summary": summarise([{"query_heads": qh, "kv_heads": kv}])}


# ---------------------------------------------------------------------------------------------
# summaries and the verdict
# ---------------------------------------------------------------------------------------------
def stats(x: list[float]) -> dict:
    """Median, min, max and count; a NaN anywhere makes the three statistics NaN."""
    if not x:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    if any(math.isnan(v) for v in x):
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": len(x)}
    return fam.stats(x)


def fraction(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else math.nan


def column_means(rows: list[list[float]]) -> list[float]:
    return [sum(col) / len(rows) for col in zip(*rows)] if rows else []


def summarise(layers: list[dict]) -> dict:
    """Over every query head and KV head of ``layers``: the statistics of cond, effective rank,
    barycenter, b(t) and the sketch, the fractions of ``cond < 10`` and of ``t < 1/2`` (a NaN
    counts as not below), and the mean coarse bands."""
    qh = [h for lr in layers for h in lr["query_heads"]]
    kh = [g for lr in layers for g in lr["kv_heads"]]
    cq, ck = [h["w_q"]["cond"] for h in qh], [g["w_k"]["cond"] for g in kh]
    t = [h["barycenter"] for h in qh]
    return {
        "cond_w_q": stats(cq), "cond_w_k": stats(ck),
        "effective_rank_w_q": stats([h["w_q"]["effective_rank"] for h in qh]),
        "effective_rank_w_k": stats([g["w_k"]["effective_rank"] for g in kh]),
        "barycenter": stats(t), "barycenter_base": stats([h["barycenter_base"] for h in qh]),
        "sketch_barycenter": stats([h["sketch_barycenter"] for h in qh]),
        "fraction_cond_w_q_below_10": fraction([c < COND_SMALL for c in cq]),
        "fraction_cond_w_k_below_10": fraction([c < COND_SMALL for c in ck]),
        "fraction_barycenter_below_half": fraction([x < HALF for x in t]),
        "coarse_band_fraction_w_q_mean": column_means([h["w_q"]["coarse_band_fraction"]
                                                       for h in qh]),
        "coarse_band_fraction_w_k_mean": column_means([g["w_k"]["coarse_band_fraction"]
                                                       for g in kh]),
    }


def first_nonfinite(x) -> float | None:
    """The first NaN or infinite number of a number or a list, else None."""
    for v in (x if isinstance(x, list) else [x]):
        if not math.isfinite(v):
            return v
    return None


def failure(where: str, check: str, value: float) -> dict:
    return {"where": where, "check": check, "value": value, "tol": None, "detail": ""}


def failures(layers: dict[str, dict]) -> list[dict]:
    """Per layer (in order), per query head: one failure per W_q quantity that is not finite
    (the two band fields under one name), then the barycenter, b(t) and the sketch; then per KV
    head its W_k quantities (docs/protocol.md section 13, ``verdict``)."""
    out = []

    def matrix(where: str, diag: dict, m: str) -> None:
        seen = set()
        for key, name in MATRIX_CHECKS:
            name = name.format(m=m)
            bad = first_nonfinite(diag[key])
            if bad is not None and name not in seen:
                seen.add(name)
                out.append(failure(where, name, bad))

    for L, lr in layers.items():
        for h in lr["query_heads"]:
            where = f"layer {L} query head {h['head']}"
            matrix(where, h["w_q"], "q")
            out += [failure(where, key, h[key]) for key in HEAD_CHECKS
                    if not math.isfinite(h[key])]
        for g in lr["kv_heads"]:
            matrix(f"layer {L} KV head {g['kv_head']}", g["w_k"], "k")
    return out


# ---------------------------------------------------------------------------------------------
# the whole report
# ---------------------------------------------------------------------------------------------
def recompute(raw_dir: str | Path) -> dict:
    """The report's tree from the dump: ``command`` and ``config`` (echoes), ``model`` (its
    sizes from the dumped shapes, the rest echoed), ``frequency_axis`` (the first reported
    layer's), ``summary`` (over all reported layers), ``layers`` and ``verdict``."""
    manifest, layers = load(raw_dir)
    lo, hi = (float(b) for b in manifest["base_range"])
    blocks = {str(L): layer_block(lay, (lo, hi)) for L, lay in layers.items()}
    model = dict(manifest["model"])
    if layers:
        first = next(iter(layers.values()))
        model.update(n_heads=first.n_heads, n_kv_heads=first.n_kv_heads,
                     group=first.n_heads // first.n_kv_heads, head_dim=first.head_dim,
                     hidden=first.hidden)
    fl = failures(blocks)
    return {"command": manifest["command"], "config": manifest["config"], "model": model,
            "frequency_axis": next(iter(blocks.values()))["frequency_axis"] if blocks else None,
            "summary": summarise(list(blocks.values())), "layers": blocks,
            "verdict": {"passed": not fl, "failed": fl}}
