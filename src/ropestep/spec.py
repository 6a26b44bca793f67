"""One set of definitions shared by the exact (mpmath) and fast (torch) layers.

A *head description* is pure data: the configuration (:class:`HeadSpec`: sizes, RoPE, score
family) and the weights (:class:`HeadWeights`, math layout ``x @ w``).  Inputs to a head are
the layer inputs ``x`` (the hidden states after the block's input norm), integer positions, and
a permitted-set mask.  Nothing here computes attention; :mod:`ropestep.exact` and
:mod:`ropestep.fast` do, independently.

Conventions (docs/math.md section 1):

* ``u_j = [x_j; 1]`` is the augmented input, ``m = x.shape[-1]``.
* ``w_q`` has shape ``(m, n_heads, head_dim)``; ``b_q`` ``(n_heads, head_dim)`` or ``None``.
  ``w_k``/``b_k`` and ``w_v``/``b_v`` are per KV head.  Query head ``h`` reads KV head
  ``h // (n_heads // n_kv_heads)`` (Hugging Face ``repeat_kv`` grouping).
* RoPE acts on row vectors: ``q~ = q R(p)^T``, ``R(p) = exp(p A)``, with pairs either split
  halves (``layout="half"``: dim ``l`` with ``l + d/2``, HF ``rotate_half``) or interleaved
  (``layout="interleaved"``: ``2l`` with ``2l+1``, GPT-J / Meta).  For a pair ``(x1, x2)``:
  ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin``, angle ``p * omega_l``,
  ``omega_l = base^(-2l/d)``.  Keys of query head ``h`` are rotated with head ``h``'s base.
* Score families (docs/math.md section 8):
    - ``"dot"``: ``s = q~ k~^T * scale`` (``scale`` defaults to ``1/sqrt(d)``);
    - ``"qknorm"``: q and k pass a per-head RMSNorm (weights ``q_norm``/``k_norm``, eps
      ``norm_eps``) before RoPE (Qwen3), then as ``"dot"``;
    - ``"cosine"``: ``s = q^ R k^^T / tau_h`` with unit ``q^, k^`` and a per-head temperature;
    - ``"latent"``: multi-head latent attention (DeepSeek-V2/V3) in its absorbed form
      (docs/math.md section 14, :class:`LatentSpec`): every head's key is the token's shared
      ``[k_rope; c]`` -- a rotated part ``k_rope = x W_kr + b_kr`` and the normed latent
      ``c = g_kv * RMS(x W_kc + b_kc)`` -- its value ``c W_uv[h] + b_uv[h]``, its query
      ``z W_q[h] + b_q[h]`` with ``z = x`` or a normed query latent ``g_qa * RMS(x W_qa + b_qa)``;
      ``head_dim = rope_dim + rank``, the rotated pairs first.
  Optional on top of any family: additive biases ``beta_ij`` (ALiBi slopes
  ``beta_ij = -slope_h * (p_i - p_j)``, and/or an explicit bias array passed at call time) and a
  score transform ``phi(s) = softcap * tanh(s / softcap)`` (``phi(0) = 0``); softmax acts on
  ``phi(s + beta)``.
* Masks: ``mask[i, j]`` is True when key ``j`` is in query ``i``'s permitted set ``I_i``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

Layout = Literal["half", "interleaved"]
Family = Literal["dot", "qknorm", "cosine", "latent"]
GaugeName = Literal["original", "maxkey", "pairwise"]


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoPESpec:
    """Rotary embedding of one layer.

    ``base`` is one float (per model) or one float per query head (per-head bases).
    ``cos``/``sin`` are optional precomputed tables of shape ``(P, d/2)`` indexed by integer
    position (a model's own float32 tables; HF duplicates the half tables, pass one half).
    When given, they replace the analytic ``cos(p*omega)``/``sin(p*omega)`` for every position
    (per-head bases cannot be combined with tables).
    """

    base: float | tuple[float, ...] = 10000.0
    layout: Layout = "half"
    cos: Any = None
    sin: Any = None
    # the angular frequency of each pair (d/2 of them), replacing base^(-2l/d): a model's own
    # (scaled RoPE: llama3, YaRN, ...; 0 on the pass-through pairs of a partial rotary)
    freqs: tuple[float, ...] | None = None

    def bases(self, n_heads: int) -> tuple[float, ...]:
        if isinstance(self.base, (int, float, np.floating, np.integer)):
            return (float(self.base),) * n_heads
        b = tuple(float(x) for x in self.base)
        if len(b) != n_heads:
            raise ValueError(f"RoPE: {len(b)} per-head bases given for {n_heads} query heads")
        return b

    @property
    def per_head(self) -> bool:
        return not isinstance(self.base, (int, float, np.floating, np.integer))


@dataclass(frozen=True)
class LatentSpec:
    """Multi-head latent attention (family ``"latent"``; docs/math.md section 14).

    ``rank`` (``kv_lora_rank``, the latent ``c``'s width), ``rope_dim`` (the shared rotated key
    part's width), ``q_rank`` (the query latent's width, or None where the query is a plain
    projection of ``x``: the score is then affine in ``u``), and the two RMS norms' ``eps``.
    The head's dims are ``[rope (rope_dim, rotated pairs); latent (rank, pairs at angle 0)]``.
    """

    rank: int
    rope_dim: int
    q_rank: int | None = None
    kv_eps: float = 1e-6
    q_eps: float = 1e-6


@dataclass(frozen=True)
class HeadSpec:
    """Sizes, RoPE and score family of one attention layer (all its heads)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_dim: int | None = None  # defaults to head_dim
    rope: RoPESpec = field(default_factory=RoPESpec)
    family: Family = "dot"
    scale: float | None = None  # "dot"/"qknorm": default 1/sqrt(head_dim)
    temperature: float | tuple[float, ...] | None = None  # "cosine": tau_h > 0 per head
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    # sliding window: key j is permitted to query i only when p_i - p_j < window (Mistral,
    # Gemma 2/3 local layers); None: no window.  Applied to every mask (resolve_mask).
    window: int | None = None
    # chunked attention: key j is permitted to query i only when p_j // chunk == p_i // chunk
    # (Llama 4's chunked layers: the context is cut into blocks of `chunk` positions and each
    # query reads its own block only); None: no chunks.  Applied to every mask (resolve_mask).
    chunk: int | None = None
    norm_eps: float = 1e-6
    # "qknorm": one RMS per head over its d dims ("head", Qwen3, Gemma 3), or one over all heads'
    # H d (resp. H_kv d) dims of a token ("all", OLMo 2); weights (d,) or (heads, d)
    norm_scope: str = "head"
    latent: LatentSpec | None = None  # family "latent": multi-head latent attention
    # attention sinks (gpt-oss): one learned logit per query head in every softmax denominator,
    # a virtual key with score sigma_h (independent of the query: an additive bias) and value 0
    # (docs/math.md section 13); never soft-capped
    sinks: tuple[float, ...] | None = None
    # projections clipped to [-clip, clip] before any norm or rotation (DBRX's clip_qkv): the
    # score is then not affine in u, and the identity is measured in query space
    clip: float | None = None
    # "qknorm": the per-head norms act after the rotation (Hunyuan: RMSNorm of R(p) q with a
    # per-dim gain, which does not commute with the rotation), not before it (Qwen3)
    norm_after_rope: bool = False
    # "qknorm": the norm's form -- "rms": g z / sqrt(mean z^2 + eps) (Qwen3, Gemma 3, ...);
    # "layer": LayerNorm, g (z - mean z) / sqrt(var z + eps) + beta with a per-dim bias beta
    # (weights q_norm_bias/k_norm_bias; Persimmon), per head, before the rotation
    norm_kind: str = "rms"
    # a position-dependent query temperature (Llama 4's NoPE layers): the query at position p
    # is multiplied by tau(p) = 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
    # (:func:`query_temperature`); (floor_scale, attn_scale), or None
    query_temperature: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        validate_spec(self)

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def r(self) -> int:
        return self.head_dim if self.v_dim is None else self.v_dim

    def kv_head(self, h: int) -> int:
        return h // self.group

    def score_scale(self, h: int) -> float:
        """Multiplier of the bilinear score of head ``h`` (1/sqrt(d), ``scale``, or 1/tau_h)."""
        if self.family == "cosine":
            return 1.0 / self.temperatures()[h]
        return (1.0 / math.sqrt(self.head_dim)) if self.scale is None else float(self.scale)

    def temperatures(self) -> tuple[float, ...]:
        t = self.temperature
        if t is None:
            return (math.sqrt(self.head_dim),) * self.n_heads
        if isinstance(t, (int, float, np.floating, np.integer)):
            return (float(t),) * self.n_heads
        return tuple(float(x) for x in t)

    @property
    def affine(self) -> bool:
        """True when the score is affine in the augmented input u (so Delta M_i exists): a
        plain dot product of projections, or latent attention whose query is a plain projection
        (the keys' norm does not matter: they are fixed features of the query's step)."""
        if self.clip is not None:  # a clipped projection is not affine in u
            return False
        return self.family == "dot" or (self.family == "latent" and self.latent is not None
                                        and self.latent.q_rank is None)


def validate_spec(spec: HeadSpec) -> None:
    """Raise a ValueError/TypeError naming the problem in a head configuration."""
    for name in ("n_heads", "n_kv_heads", "head_dim"):
        v = getattr(spec, name)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"HeadSpec.{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"HeadSpec.{name} must be >= 1, got {v}")
    if spec.head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got head_dim={spec.head_dim}")
    if spec.v_dim is not None and spec.v_dim < 1:
        raise ValueError(f"HeadSpec.v_dim must be >= 1, got {spec.v_dim}")
    if spec.n_heads % spec.n_kv_heads:
        raise ValueError(
            f"GQA: n_kv_heads={spec.n_kv_heads} does not divide n_heads={spec.n_heads}")
    if spec.rope.layout not in ("half", "interleaved"):
        raise ValueError(f"RoPE layout must be 'half' or 'interleaved', got {spec.rope.layout!r}")
    for b in spec.rope.bases(spec.n_heads):
        if not (math.isfinite(b) and b > 0):
            raise ValueError(f"RoPE base must be finite and > 0, got {b}")
    if spec.rope.freqs is not None:
        fr = spec.rope.freqs
        if spec.rope.per_head or len(fr) != spec.head_dim // 2 or not all(
                math.isfinite(float(f)) and float(f) >= 0 for f in fr):
            raise ValueError(f"RoPE freqs must be head_dim/2={spec.head_dim // 2} finite values "
                             ">= 0 for one shared base")
    if spec.rope.per_head and spec.rope.cos is not None:
        raise ValueError("RoPE: per-head bases cannot be combined with precomputed cos/sin tables")
    if (spec.rope.cos is None) != (spec.rope.sin is None):
        raise ValueError("RoPE: give both cos and sin tables, or neither")
    if spec.rope.cos is not None:
        c, s = np.asarray(spec.rope.cos), np.asarray(spec.rope.sin)
        if c.ndim != 2 or c.shape != s.shape or c.shape[1] != spec.head_dim // 2:
            raise ValueError(
                f"RoPE tables must both have shape (P, head_dim/2={spec.head_dim // 2}), "
                f"got cos {c.shape} and sin {s.shape}")
        if not (np.isfinite(c).all() and np.isfinite(s).all()):
            raise ValueError("RoPE tables contain NaN or inf")
    if spec.norm_after_rope and not (spec.family == "qknorm" and spec.norm_scope == "head"):
        raise ValueError("norm_after_rope: per-head QK-norm (family 'qknorm', scope 'head') only")
    if spec.clip is not None:
        if not (math.isfinite(spec.clip) and spec.clip > 0):
            raise ValueError(f"clip must be finite and > 0, got {spec.clip}")
        if spec.family == "latent":
            raise ValueError("clip: a latent head's projections are not clipped (not modelled)")
    if spec.sinks is not None:
        if len(spec.sinks) != spec.n_heads or not all(math.isfinite(float(x))
                                                      for x in spec.sinks):
            raise ValueError(f"sinks: one finite logit per query head ({spec.n_heads}), got "
                             f"{len(spec.sinks)}")
        if spec.softcap is not None:
            raise ValueError("sinks with a soft-cap: a sink logit is not capped, the kernel would "
                             "cap it as a score (not modelled)")
    if spec.family not in ("dot", "qknorm", "cosine", "latent"):
        raise ValueError(f"unknown score family {spec.family!r} (dot, qknorm, cosine, latent)")
    if (spec.family == "latent") != (spec.latent is not None):
        raise ValueError("family 'latent' and a LatentSpec go together (latent=LatentSpec(...))")
    if spec.latent is not None:
        lt = spec.latent
        for name in ("rank", "rope_dim"):
            v = getattr(lt, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"LatentSpec.{name} must be an int >= 0, got {v!r}")
        if lt.rank < 1 or lt.rope_dim % 2 or lt.rank % 2:
            raise ValueError(f"LatentSpec: rank >= 1 and both widths even, got rank {lt.rank}, "
                             f"rope_dim {lt.rope_dim}")
        if lt.rank + lt.rope_dim != spec.head_dim:
            raise ValueError(f"latent attention: head_dim must be rope_dim + rank = "
                             f"{lt.rope_dim + lt.rank}, got {spec.head_dim}")
        if lt.q_rank is not None and (isinstance(lt.q_rank, bool) or int(lt.q_rank) < 1):
            raise ValueError(f"LatentSpec.q_rank must be None or >= 1, got {lt.q_rank!r}")
        for name in ("kv_eps", "q_eps"):
            v = getattr(lt, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"LatentSpec.{name} must be finite and >= 0, got {v}")
        if spec.n_kv_heads != spec.n_heads:
            raise ValueError("latent attention: every query head has its own value map "
                             f"(n_kv_heads = n_heads), got {spec.n_kv_heads} of {spec.n_heads}")
        # the latent pairs never turn: the rotation is the first rope_dim dims' (adjacent pairs)
        if spec.rope.layout != "interleaved":
            raise ValueError("latent attention: RoPE layout must be 'interleaved' (the rotated "
                             "pairs are the first rope_dim dims, adjacent)")
        if spec.rope.per_head:
            raise ValueError("latent attention: one RoPE base for every head")
        h0 = lt.rope_dim // 2
        if spec.rope.cos is not None:
            c, s_ = np.asarray(spec.rope.cos)[:, h0:], np.asarray(spec.rope.sin)[:, h0:]
            if not (np.all(c == 1) and np.all(s_ == 0)):
                raise ValueError("latent attention: the RoPE tables must hold angle 0 "
                                 "(cos 1, sin 0) on the latent pairs")
        elif spec.rope.freqs is None:
            raise ValueError("latent attention needs RoPESpec.freqs with 0 on the latent pairs "
                             "(or tables with angle 0 there)")
        if spec.rope.freqs is not None and any(float(f) != 0 for f in spec.rope.freqs[h0:]):
            raise ValueError("latent attention: RoPESpec.freqs must be 0 on the latent pairs")
    if spec.family != "cosine" and spec.temperature is not None:
        raise ValueError("a temperature is only used by the 'cosine' family; use scale")
    if spec.family == "cosine" and spec.scale is not None:
        raise ValueError("the 'cosine' family is scaled by its temperature, not by scale")
    if spec.scale is not None and not (math.isfinite(spec.scale) and spec.scale > 0):
        raise ValueError(f"score scale must be finite and > 0, got {spec.scale}")
    if spec.family == "cosine":
        t = spec.temperatures()
        if len(t) != spec.n_heads:
            raise ValueError(f"{len(t)} temperatures given for {spec.n_heads} heads")
        for x in t:
            if not (math.isfinite(x) and x > 0):
                raise ValueError(f"temperature tau_h must be finite and > 0, got {x}")
    if spec.window is not None and (isinstance(spec.window, bool) or int(spec.window) != spec.window
                                    or spec.window < 1):
        raise ValueError(f"window must be a positive integer or None, got {spec.window!r}")
    if spec.chunk is not None and (isinstance(spec.chunk, bool) or int(spec.chunk) != spec.chunk
                                   or spec.chunk < 1):
        raise ValueError(f"chunk must be a positive integer or None, got {spec.chunk!r}")
    if spec.softcap is not None and not (math.isfinite(spec.softcap) and spec.softcap > 0):
        raise ValueError(f"softcap must be finite and > 0, got {spec.softcap}")
    if spec.alibi_slopes is not None:
        if len(spec.alibi_slopes) != spec.n_heads:
            raise ValueError(
                f"{len(spec.alibi_slopes)} ALiBi slopes given for {spec.n_heads} heads")
        if not all(math.isfinite(float(x)) for x in spec.alibi_slopes):
            raise ValueError("ALiBi slopes must be finite")
    if spec.norm_scope not in ("head", "all"):
        raise ValueError(f"norm_scope must be 'head' or 'all', got {spec.norm_scope!r}")
    if spec.norm_kind not in ("rms", "layer"):
        raise ValueError(f"norm_kind must be 'rms' or 'layer', got {spec.norm_kind!r}")
    if spec.norm_kind == "layer" and not (spec.family == "qknorm" and spec.norm_scope == "head"
                                          and not spec.norm_after_rope):
        raise ValueError("norm_kind 'layer': per-head QK LayerNorm before the rotation (family "
                         "'qknorm', scope 'head') only")
    if not (spec.norm_eps >= 0 and math.isfinite(spec.norm_eps)):
        raise ValueError(f"norm_eps must be finite and >= 0, got {spec.norm_eps}")
    if spec.query_temperature is not None:
        qt = tuple(spec.query_temperature)
        if len(qt) != 2 or not all(isinstance(v, (int, float, np.floating, np.integer))
                                   and not isinstance(v, bool) and math.isfinite(float(v))
                                   for v in qt) or not float(qt[0]) > 0:
            raise ValueError("query_temperature must be (floor_scale > 0, attn_scale), both "
                             f"finite; got {spec.query_temperature!r}")
        if spec.norm_after_rope:  # the norm would act on (and cancel) the temperature
            raise ValueError("query_temperature with a QK-norm after the rotation is not "
                             "modelled (the paths fold the temperature into the rotation)")


# ---------------------------------------------------------------------------------------------
# weights and inputs
# ---------------------------------------------------------------------------------------------
@dataclass
class HeadWeights:
    """Projection weights of one layer in math layout (``q = x @ w_q + b_q``).

    Arrays may be numpy or torch; ``None`` biases mean no bias (Llama/SmolLM2).  ``w_o`` (output
    projection, ``(n_heads, v_dim, hidden)``) is optional and only used by readers of the
    projected write ``o = sum_h y_h @ w_o[h]``.
    """

    w_q: Any  # (m, H, d)
    w_k: Any  # (m, Hk, d)
    w_v: Any  # (m, Hk, r)
    b_q: Any = None  # (H, d)
    b_k: Any = None  # (Hk, d)
    b_v: Any = None  # (Hk, r)
    q_norm: Any = None  # (d,) qknorm family
    k_norm: Any = None  # (d,)
    q_norm_bias: Any = None  # (d,) qknorm family with norm_kind "layer" (LayerNorm's beta)
    k_norm_bias: Any = None  # (d,)
    w_o: Any = None  # (H, r, hidden)
    b_o: Any = None  # (hidden,)
    # family "latent" (LatentSpec; w_q is then (q_in, H, d) with q_in = q_rank or m, and w_k,
    # w_v, b_k, b_v are unused): the shared key's rotated part and latent, the latent's norm,
    # the per-head value maps, and the optional query latent with its norm
    w_kr: Any = None  # (m, rope_dim)
    b_kr: Any = None  # (rope_dim,)
    w_kc: Any = None  # (m, rank)
    b_kc: Any = None  # (rank,)
    kv_norm: Any = None  # (rank,)
    w_uv: Any = None  # (rank, H, r)
    b_uv: Any = None  # (H, r)
    w_qa: Any = None  # (m, q_rank)
    b_qa: Any = None  # (q_rank,)
    qa_norm: Any = None  # (q_rank,)

    def check(self, spec: HeadSpec, m: int | None = None) -> int:
        """Validate shapes and finiteness against ``spec``; return the input width m."""
        if spec.family == "latent":
            return self._check_latent(spec, m)
        H, Hk, d, r = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.r
        wq = _shape(self.w_q, "w_q")
        if len(wq) != 3:
            raise ValueError(f"w_q must have shape (m, n_heads, head_dim), got {wq}")
        mm = wq[0]
        if m is not None and mm != m:
            raise ValueError(f"w_q expects inputs of width {mm}, but x has width {m}")
        want = {"w_q": (mm, H, d), "w_k": (mm, Hk, d), "w_v": (mm, Hk, r),
                "b_q": (H, d), "b_k": (Hk, d), "b_v": (Hk, r)}
        for name, shp in want.items():
            a = getattr(self, name)
            if a is None:
                continue
            got = _shape(a, name)
            if got != shp:
                raise ValueError(f"{name} must have shape {shp}, got {got}")
            _finite(a, name)
        if spec.family == "qknorm":
            for name, heads in (("q_norm", H), ("k_norm", spec.n_kv_heads)):
                a = getattr(self, name)
                shp = (d,) if spec.norm_scope == "head" else (heads, d)
                if a is None:
                    raise ValueError(f"family 'qknorm' needs {name} weights of shape {shp}")
                if _shape(a, name) != shp:
                    raise ValueError(f"{name} must have shape {shp}, got {_shape(a, name)}")
                _finite(a, name)
        for name in ("q_norm_bias", "k_norm_bias"):
            a = getattr(self, name)
            if a is None:
                continue
            if spec.norm_kind != "layer":
                raise ValueError(f"{name} is a LayerNorm's bias: only with norm_kind 'layer'")
            if _shape(a, name) != (d,):
                raise ValueError(f"{name} must have shape {(d,)}, got {_shape(a, name)}")
            _finite(a, name)
        self._check_w_o(H, r)
        return mm


    def _check_w_o(self, H: int, r: int) -> None:
        """The output projection, where given: ``(H, r, hidden)``."""
        if self.w_o is not None:
            got = _shape(self.w_o, "w_o")
            if len(got) != 3 or got[:2] != (H, r):
                raise ValueError(f"w_o must have shape ({H}, {r}, hidden), got {got}")

    def _check_latent(self, spec: HeadSpec, m: int | None) -> int:
        lt = spec.latent
        H, d, r = spec.n_heads, spec.head_dim, spec.r
        if self.w_kc is None:
            raise ValueError("family 'latent' needs w_kc (m, rank): the latent's projection")
        mm = _shape(self.w_kc, "w_kc")[0]
        if m is not None and mm != m:
            raise ValueError(f"w_kc expects inputs of width {mm}, but x has width {m}")
        q_in = mm if lt.q_rank is None else int(lt.q_rank)
        want: dict[str, tuple[int, ...] | None] = {
            "w_kc": (mm, lt.rank), "b_kc": (lt.rank,), "kv_norm": (lt.rank,),
            "w_kr": (mm, lt.rope_dim), "b_kr": (lt.rope_dim,), "w_uv": (lt.rank, H, r),
            "b_uv": (H, r), "w_q": (q_in, H, d), "b_q": (H, d),
            "w_qa": (mm, q_in) if lt.q_rank is not None else None,
            "b_qa": (q_in,) if lt.q_rank is not None else None,
            "qa_norm": (q_in,) if lt.q_rank is not None else None}
        required = {"kv_norm", "w_uv", "w_q"} | ({"w_kr"} if lt.rope_dim else set()) | (
            {"w_qa", "qa_norm"} if lt.q_rank is not None else set())
        for name, shp in want.items():
            a = getattr(self, name)
            if a is None:
                if name in required:
                    raise ValueError(f"family 'latent' needs {name} of shape {shp}")
                continue
            if shp is None:
                raise ValueError(f"{name} is given but the LatentSpec has no query latent "
                                 "(q_rank None)")
            got = _shape(a, name)
            if got != shp:
                raise ValueError(f"{name} must have shape {shp}, got {got}")
            _finite(a, name)
        self._check_w_o(H, r)
        return mm


def _shape(a: Any, name: str) -> tuple[int, ...]:
    if not hasattr(a, "shape"):
        raise TypeError(f"{name} must be an array (numpy or torch), got {type(a).__name__}")
    return tuple(int(x) for x in a.shape)


def _finite(a: Any, name: str) -> None:
    arr = a.detach().cpu().double().numpy() if hasattr(a, "detach") else np.asarray(a, dtype=float)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf")


def check_inputs(spec: HeadSpec, weights: HeadWeights, x_q: Any, pos_q: Any, x_kv: Any,
                 pos_kv: Any, mask: Any, bias: Any = None) -> tuple[int, int, int]:
    """Validate one call's inputs; return ``(Q, N, m)``.  ``mask`` must already be an array."""
    xq, xk = _shape(x_q, "x_q"), _shape(x_kv, "x_kv")
    if len(xq) != 2 or len(xk) != 2:
        raise ValueError(f"x_q and x_kv must be 2-D (tokens, m), got {xq} and {xk}")
    if xq[1] != xk[1]:
        raise ValueError(f"x_q has width {xq[1]} but x_kv has width {xk[1]}")
    Q, N, m = xq[0], xk[0], xq[1]
    if Q < 1:
        raise ValueError("no queries: x_q is empty")
    if N < 1:
        raise ValueError("empty bank: x_kv has no keys")
    weights.check(spec, m)
    _finite(x_q, "x_q")
    _finite(x_kv, "x_kv")
    pq, pk = _positions(pos_q, "pos_q"), _positions(pos_kv, "pos_kv")
    if pq.shape != (Q,):
        raise ValueError(f"pos_q must have shape ({Q},), got {pq.shape}")
    if pk.shape != (N,):
        raise ValueError(f"pos_kv must have shape ({N},), got {pk.shape}")
    if spec.rope.cos is not None:
        P = np.asarray(spec.rope.cos).shape[0]
        hi = max(int(pq.max()), int(pk.max()))
        if min(int(pq.min()), int(pk.min())) < 0 or hi >= P:
            raise ValueError(f"positions must lie in [0, {P}) to index the RoPE tables, got max {hi}")
    mk = _shape(mask, "mask")
    if mk != (Q, N):
        raise ValueError(f"mask must have shape ({Q}, {N}), got {mk}")
    mnp = mask.detach().cpu().numpy() if hasattr(mask, "detach") else np.asarray(mask)
    if mnp.dtype != np.bool_:
        raise TypeError(f"mask must be boolean, got dtype {mnp.dtype}")
    empty = np.flatnonzero(~mnp.any(axis=1))
    if empty.size:
        raise ValueError(f"empty permitted set: queries {empty[:8].tolist()} attend to no key")
    if bias is not None:
        bs = _shape(bias, "bias")
        if bs not in ((spec.n_heads, Q, N), (Q, N)):
            raise ValueError(f"bias must have shape ({spec.n_heads}, {Q}, {N}) or ({Q}, {N}), got {bs}")
        _finite(bias, "bias")
    return Q, N, m


def _positions(p: Any, name: str) -> np.ndarray:
    arr = p.detach().cpu().numpy() if hasattr(p, "detach") else np.asarray(p)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            return arr.astype(np.int64)
        raise TypeError(f"{name} must hold integer positions, got dtype {arr.dtype}")
    return arr.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# permitted sets
# ---------------------------------------------------------------------------------------------
def causal_mask(pos_q: Sequence[int], pos_kv: Sequence[int]) -> np.ndarray:
    """``mask[i, j] = pos_kv[j] <= pos_q[i]`` (keys 0..i when queries and keys coincide)."""
    pq, pk = _positions(pos_q, "pos_q"), _positions(pos_kv, "pos_kv")
    return pk[None, :] <= pq[:, None]


def bank_mask(n_queries: int, n_keys: int) -> np.ndarray:
    """Every query reads the whole bank (prefix bank, or full bank with the query's own key)."""
    if n_keys < 1:
        raise ValueError("empty bank: a bank needs at least one key")
    return np.ones((n_queries, n_keys), dtype=bool)


def window_mask(pos_q: Sequence[int], pos_kv: Sequence[int], window: int | None,
                chunk: int | None = None) -> np.ndarray:
    """``mask[i, j] = pos_q[i] - pos_kv[j] < window`` and, with chunks, ``pos_q[i] // chunk ==
    pos_kv[j] // chunk`` (all True without either)."""
    pq, pk = _positions(pos_q, "pos_q"), _positions(pos_kv, "pos_kv")
    out = np.ones((pq.shape[0], pk.shape[0]), dtype=bool)
    if window is not None:
        out &= (pq[:, None] - pk[None, :]) < int(window)
    if chunk is not None:
        out &= (pq[:, None] // int(chunk)) == (pk[None, :] // int(chunk))
    return out


def first_permitted(i: int, window: int | None = None, chunk: int | None = None) -> int:
    """The earliest key a causal query at position (or sequence index) ``i`` reads: ``0``,
    ``i - window + 1`` under a sliding window, the start ``(i // chunk) chunk`` of its chunk
    under chunked attention (the latest of these).  The permitted set is ``first .. i``."""
    lo = 0
    if window is not None:
        lo = max(lo, int(i) - int(window) + 1)
    if chunk is not None:
        lo = max(lo, (int(i) // int(chunk)) * int(chunk))
    return lo


def resolve_mask(mask: Any, pos_q: Any, pos_kv: Any, n_q: int, n_kv: int,
                 window: int | None = None, chunk: int | None = None) -> np.ndarray | Any:
    """Accept ``"causal"``, ``"bank"`` (alias ``"prefix"``, ``"full"``) or a boolean array; with
    a sliding ``window`` (:attr:`HeadSpec.window`) every key at distance ``>= window`` from its
    query is removed from the permitted set, with a ``chunk`` (:attr:`HeadSpec.chunk`) every
    key outside the query's chunk -- whatever the mask."""
    if isinstance(mask, str):
        if mask == "causal":
            out = causal_mask(pos_q, pos_kv)
        elif mask in ("bank", "prefix", "full"):
            out = bank_mask(n_q, n_kv)
        else:
            raise ValueError(f"unknown mask {mask!r}: use 'causal', 'bank' or a boolean array")
    else:
        out = mask
    if window is None and chunk is None:
        return out
    w = window_mask(pos_q, pos_kv, window, chunk)
    if hasattr(out, "new_tensor"):  # a torch mask: combine on its device (no torch import)
        return out & out.new_tensor(w)
    return np.asarray(out, dtype=bool) & w


def query_temperature(floor_scale: float, attn_scale: float, p: int) -> float:
    """Llama 4's NoPE query temperature at position ``p``:
    ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` (exactly 1 below
    ``p = floor_scale - 1``)."""
    return 1.0 + float(attn_scale) * math.log1p(math.floor((int(p) + 1) / float(floor_scale)))


def alibi_slopes(n_heads: int) -> tuple[float, ...]:
    """The standard ALiBi slopes ``2^(-8 h / n)`` for ``h = 1..n`` (power-of-two head counts)."""
    return tuple(2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads))
