"""Attention conventions read from the model itself, and checked against its own tensors.

:func:`describe_model` runs one short eager forward with :mod:`ropestep.models.probe` recording
every layer's attention call, and reads per layer (:class:`LayerConventions`):

* **RoPE tables**: the ``position_embeddings`` the layer was given, matched (bit for bit) to a
  call of one of the model's rotary modules -- which covers every ``rope_type`` transformers has
  (``default``, ``linear``, ``dynamic``, ``yarn``, ``llama3``, ``longrope``, ...) and per-layer
  rotary embeddings (Gemma 3's local/global bases).  Their width is the rotary dimension ``R``
  (partial rotary: ``R < d``), their pairing ``half`` (``l`` with ``l + R/2``) or
  ``interleaved`` (``2l`` with ``2l+1``) is read from which halves repeat, and their amplitude
  ``a = cos(0)`` (YaRN's and LongRoPE's ``attention_factor``) is folded into the score scale
  (``s = scaling a^2 q R k``, with unit tables ``cos / a``).
* **score**: ``scaling``, ``softcap``, ``sliding_window`` and attention sinks (``s_aux``) as the
  layer's eager attention receives them, and the permitted sets from its additive mask: causal,
  a causal window, or causal chunks (Llama 4), checked against the ``sliding_window`` and
  ``attention_chunk_size`` the layer names.
* **projections**: the layout (:mod:`ropestep.models.layouts`) and the rotation (or none, for a
  layer that does not rotate) that reproduce the layer's own rotated queries and keys and its
  values, on the probe's tokens, within a derived rounding bound -- a reading no candidate
  reproduces is refused, naming the tensor and its difference.
* **QK-norm**: per-head norms ``q_norm``/``k_norm`` read as ``g * z / sqrt(mean(z^2) + eps)``
  with ``g`` probed from the module (so Gemma's ``1 + w`` is read as it acts), or -- where the
  module acts so on probe vectors -- as a LayerNorm with a bias,
  ``g * (z - mean z) / sqrt(var z + eps) + beta`` (Persimmon; ``HeadSpec.norm_kind "layer"``).
* and the score itself: the layer's own queries, keys and values through the read scale,
  soft-cap, mask and sinks reproduce its eager output (float64 against the model's dtype).

What the exact layer does not model is refused with one line (:class:`UnsupportedModelError`):
additive biases in the mask, permitted sets that are neither causal, a causal window nor causal
chunks, a position-dependent query temperature at the run's positions (Llama 4's NoPE layers).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from .. import tolerances as tl
from ..spec import (HeadSpec, HeadWeights, LatentSpec, RoPESpec, first_permitted,
                    query_temperature)
from .errors import UnsupportedModelError, adapter_errors
from .layouts import candidates as layout_candidates
from .layouts import project as project_part
from .probe import (INLINE_BIAS_ARGS, AttentionRecord, inline_bias_arg, probe_forward,
                    probe_layers, tables)
from .structure import (attention_module, attention_modules, layer_modules, model_name,
                        onloaded, output_projection, rotary_modules)

F64 = torch.float64
PROBE_TOKENS = 24  # tokens of the reading forward (windows below it are checked on the mask)
# a sliding window (or chunk) the layers name but the reading forward is too short to show is
# checked on a second forward of window + 1 tokens (its masks only) up to this width; a wider
# one is taken as named, and a mask that disagrees fails the native comparisons of runs longer
# than it
WINDOW_PROBE_MAX = 1024


@dataclass(frozen=True)
class LayerConventions:
    """One decoder layer's attention, as read from the model (see the module docstring)."""

    layer: int
    attention: str  # the attention module's class
    layout: str  # projection layout (ropestep.models.layouts)
    output: str  # the output projection's attribute name
    rotary: str | None  # the rotary call that reproduces the layer's tables; None: no rotation
    rotary_dim: int  # R (0: no rotation)
    pairing: str  # "half" | "interleaved": which dims the layer rotates together
    tables: str  # how its tables hold one angle per pair: "dup_half", "dup_pairs", "single"
    amplitude: float  # a = cos(0) of the model's tables (1 unless YaRN/LongRoPE scale them)
    scaling: float  # the multiplier the eager attention applies to q.k
    softcap: float | None
    window: int | None  # permitted keys j of query i: j <= i and i - j < window
    qk_norm: bool  # RMS norms on q and k before RoPE
    norm_eps: float
    qkv_bias: bool
    o_bias: bool
    sinks: bool  # a learned per-head sink logit in the softmax denominator
    inv_freq: tuple[float, ...] = ()  # the rotary module's angular frequencies (R/2 of them)
    norm_scope: str = "head"  # QK-norm over each head ("head") or every head of a token ("all")
    # the output projection's input is the heads' output itself (False: a norm, gate or scale
    # sits between them -- BitNet's attn_sub_norm, Qwen3-Next's output gate -- so the heads'
    # output is taken from the attention function and W_o's statements are not defined)
    output_direct: bool = True
    output_between: str = ""  # what sits between, where output_direct is False
    sizes: tuple = ()  # (heads, KV heads, head_dim, value dim) of this layer, as read
    # +1: the pair (a, b) turns as (a cos - b sin, b cos + a sin) (HF's rotate_half); -1: by the
    # opposite angle (nanochat's rotate_half is cat(x2, -x1)) -- ropestep then swaps each pair's
    # two dims in its head-dim order (:func:`_perm`), which turns it the usual way
    sign: int = 1
    # how the layer is handed its tables: "cos_sin" (HF), "sin_cos" (GPT-J, CodeGen), "complex"
    # (Llama 4: one complex tensor), or "none" (a layer given no position_embeddings at all)
    order: str = "cos_sin"
    input_dim: int | None = None  # width m of the attention's input (None: the model's hidden)
    call_args: tuple = ()  # plain arguments the module was called with (Zamba 2's layer_idx)
    # multi-head latent attention (layout "latent", docs/math.md section 14): (rank, rope_dim,
    # nope_dim, q_rank (0: none), kv_eps, q_eps, how the rotated part is laid out before the
    # rotation: "" or "deinterleave" (transformers' rope_interleave))
    latent: tuple = ()
    sink_param: str = ""  # the attention module's parameter its eager call is handed as sinks
    value_scale: float = 1.0  # a constant the module multiplies its values by (MiMo-V2's v_scale)
    clip: float | None = None  # projections clipped to [-clip, clip] (DBRX's clip_qkv)
    norm_after_rope: bool = False  # QK-norm acting on the rotated vectors (Hunyuan)
    chunk: int | None = None  # chunked attention: j // chunk == i // chunk besides j <= i
    # the first position whose query temperature is not 1 (Llama 4's NoPE layers), or None
    temperature_from: int | None = None
    # that temperature's (floor_scale, attn_scale) (HeadSpec.query_temperature), or ()
    temperature: tuple = ()
    # QK-norm's form: "rms" (g z / rms z) or "layer" (LayerNorm with a bias: Persimmon)
    norm_kind: str = "rms"
    # an output gate between the heads and the output projection, read and proven on the layer's
    # own tensors: "sigmoid" (Qwen3-Next: o_proj(y * sigmoid(x W_g + b_g)), W_g the gated
    # layout's "g" rows), or "" (none, or something else sits there: output_between says what)
    output_gate: str = ""
    # ALiBi (an inline module handed a key-position bias: BLOOM, MPT): one slope per query head,
    # the bias slope_h p_j (a row shift of -slope_h (p_i - p_j)); () without
    alibi: tuple = ()
    bias_arg: str = ""  # the module's parameter that hands it the bias ("alibi", "position_bias")
    # how the module reads its mask: "additive" (0 / the dtype's min), "keep" (bool, True =
    # permitted) or "drop" (bool, True = masked: MPT's masked_fill)
    mask_form: str = "additive"

    @property
    def score_scale(self) -> float:
        return self.scaling * self.amplitude ** 2

    def row(self) -> dict:
        """The reading as plain data (reports)."""
        d = {k: getattr(self, k) for k in (
            "layer", "attention", "layout", "output", "rotary", "rotary_dim", "pairing", "tables",
            "amplitude", "scaling", "softcap", "window", "qk_norm", "norm_scope", "norm_eps",
            "norm_kind", "qkv_bias",
            "o_bias", "sinks", "output_direct", "sign", "order", "value_scale", "clip",
            "norm_after_rope", "chunk", "temperature_from", "temperature", "alibi",
            "output_gate")}
        d["score_scale"] = self.score_scale
        return d


@dataclass(frozen=True)
class ModelInfo:
    """What the exact layer needs to know about a model's attention."""

    name: str
    model_type: str
    family: str  # score family of ropestep.spec: "dot" or "qknorm"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float  # the config's base (nan where the config names none at top level)
    rms_eps: float
    qkv_bias: bool
    o_bias: bool
    max_positions: int
    rope_type: str = "default"
    # per decoder layer: its conventions, or None for a layer that is not softmax attention
    # (a hybrid's linear-attention, convolution or state-space layer; `others` says why)
    layers: tuple[LayerConventions | None, ...] = field(default=(), compare=False)
    others: tuple[tuple[int, str], ...] = field(default=(), compare=False)
    v_dim: int | None = None  # value head dim r (None: head_dim)

    @property
    def group(self) -> int:
        """Query heads per KV head (HF ``num_key_value_groups``); head h reads KV h // group."""
        return self.n_heads // self.n_kv_heads

    @property
    def r(self) -> int:
        return self.head_dim if self.v_dim is None else self.v_dim

    @property
    def softmax_layers(self) -> tuple[int, ...]:
        """The decoder layers whose attention is read (every layer but a hybrid's others)."""
        if not self.layers:
            return tuple(range(self.n_layers))
        return tuple(L for L, c in enumerate(self.layers) if c is not None)

    def conventions(self) -> list[LayerConventions]:
        """The read layers' conventions, in layer order."""
        return [c for c in self.layers if c is not None]

    def for_layer(self, layer: int) -> "ModelInfo":
        """This description with layer ``layer``'s own sizes (KV heads, head_dim, value dim
        may differ by layer: MiMo-V2-Flash, Gemma 4)."""
        c = self.layers[layer] if self.layers and 0 <= layer < len(self.layers) else None
        if c is None or not c.sizes:
            return self
        _, Hk, d, r = c.sizes
        if (Hk, d, r) == (self.n_kv_heads, self.head_dim, self.r):
            return self
        return replace(self, n_kv_heads=Hk, head_dim=d, v_dim=None if r == d else r)


# ---------------------------------------------------------------------------------------------
# the config
# ---------------------------------------------------------------------------------------------
def _rope_parameters(config: Any) -> dict:
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        rp = getattr(config, "rope_scaling", None)  # transformers < 5
    return dict(rp or {})


# config attributes that say a model rotates (one of them, without a rope_theta, is enough to
# read the model: its rotary module is then read from the model's own calls)
ROPE_HINTS = ("rope_theta", "rope_parameters", "rotary_dim", "rotary_pct", "rotary_emb_base",
              "partial_rotary_factor", "rope_scaling")


def _config_value(config: Any, name: str) -> Any:
    """``config.<name>``, or None where the config has none or refuses to give one value for
    every layer (transformers' per-layer attributes: Gemma 4's head_dim): the layers' own
    tensors say it then (:func:`_sizes`)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and the like
        return None


# the config attributes a model's context is kept under (MPT's max_seq_len, GPT-2's n_positions)
CONTEXT_NAMES = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")


def context_length(config: Any) -> tuple[str, int] | None:
    """``(attribute, length)`` of a model's context as its (text) config names it, or None."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    for name in CONTEXT_NAMES:
        v = _config_value(cfg, name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return name, int(v)
    return None


def check_config(config: Any, name: str | None = None) -> ModelInfo:
    """Sizes from a transformers config, and what can be refused before any weight loads; a
    config that refuses to give one of them (a per-layer attribute read globally) is one
    :class:`UnsupportedModelError` line."""
    with adapter_errors(model_name(config, name), "reading the config"):
        return _check_config(config, name)


def _check_config(config: Any, name: str | None = None) -> ModelInfo:
    who = model_name(config, name)
    mt = getattr(config, "model_type", None)
    rp = _rope_parameters(config)
    per_type = {k: v for k, v in rp.items() if isinstance(v, dict)}
    if per_type:  # per-layer-type RoPE parameters (Gemma 3): read per layer from the model
        first = per_type.get("full_attention") or next(iter(per_type.values()))
        theta, rope_type = first.get("rope_theta"), first.get("rope_type", "default")
    else:
        theta = rp.get("rope_theta", getattr(config, "rope_theta", None))
        rope_type = rp.get("rope_type", rp.get("type", "default"))
    if theta is None:
        # a rotary module that keeps its base to itself (GPT-J, CodeGen), or no rotation at all
        # (ALiBi: BLOOM, MPT): the model's own calls are read, not the config; a model that
        # neither rotates nor adds an ALiBi bias is refused after that reading (_read_model)
        theta = math.nan
        if not any(getattr(config, a, None) is not None for a in ROPE_HINTS):
            rope_type = "none"
            if not _may_carry_alibi(config):  # refused before any weight loads
                raise UnsupportedModelError(
                    f"{who}: model_type={mt!r} names no RoPE parameters ({', '.join(ROPE_HINTS)})"
                    " and its attention modules take no ALiBi bias "
                    f"({', '.join(INLINE_BIAS_ARGS)}): not a rotary or ALiBi attention model")
    hidden = getattr(config, "hidden_size", None)
    H = getattr(config, "num_attention_heads", None)
    nl = getattr(config, "num_hidden_layers", None)
    if hidden is None or H is None or nl is None:
        raise UnsupportedModelError(f"{who}: model_type={mt!r} lacks hidden_size, "
                                    "num_attention_heads or num_hidden_layers")
    hidden, H = int(hidden), int(H)
    Hk = int(_config_value(config, "num_key_value_heads") or H)
    hd = _config_value(config, "head_dim")  # may vary by layer (Gemma 4): read from the layers
    if hd is None:
        if hidden % H:
            raise UnsupportedModelError(
                f"{who}: hidden_size={hidden} is not num_attention_heads={H} times a head_dim")
        hd = hidden // H
    hd = int(hd)
    # head counts, head_dim and their parity are read from the attention's own tensors
    # (_sizes): a config attribute the architecture ignores must not refuse it
    eps = next((getattr(config, a) for a in ("rms_norm_eps", "layer_norm_eps", "norm_eps",
                                             "layer_norm_epsilon")
                if getattr(config, a, None) is not None), math.nan)
    bias = getattr(config, "attention_bias", None)
    qkv_bias = bool(bias) if bias is not None else mt == "qwen2"
    return ModelInfo(
        name=who, model_type=str(mt), family="dot", n_layers=int(nl), hidden=hidden,
        n_heads=H, n_kv_heads=Hk, head_dim=hd, rope_theta=float(theta), rms_eps=float(eps),
        qkv_bias=qkv_bias, o_bias=bool(bias) if bias is not None else False,
        max_positions=(context_length(config) or ("", 0))[1],
        rope_type=str(rope_type))


def _may_carry_alibi(config: Any) -> bool:
    """Whether a model type without RoPE parameters may add an ALiBi bias, read from its
    config (an ``alibi`` flag, MPT's ``attn_config.alibi``) or from transformers' own code for
    the type: an attention class of its modeling module whose ``forward`` is handed a bias
    (:data:`ropestep.models.probe.INLINE_BIAS_ARGS`).  True where the code cannot be found (the
    model is then read, and refused there if it is neither)."""
    import importlib

    if getattr(config, "alibi", False):
        return True
    ac = getattr(config, "attn_config", None)
    if (ac.get("alibi") if isinstance(ac, dict) else getattr(ac, "alibi", False)):
        return True
    mt = str(getattr(config, "model_type", "") or "").replace("-", "_")
    try:
        mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    except Exception:  # noqa: BLE001 - no modeling module of that name: read the model
        return True
    for name, obj in vars(mod).items():
        if isinstance(obj, type) and name.endswith("Attention") and callable(
                getattr(obj, "forward", None)):
            try:
                params = inspect.signature(obj.forward).parameters
            except (TypeError, ValueError):
                continue
            if any(a in params for a in INLINE_BIAS_ARGS):
                return True
    return False


# ---------------------------------------------------------------------------------------------
# reading one layer
# ---------------------------------------------------------------------------------------------
def _rotate(z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """The model's rotation of the first ``R = cos.shape[-1]`` dims (HF's two conventions):
    ``z cos + rot(z) sin``, ``rot`` = ``rotate_half`` or its interleaved form."""
    R = cos.shape[-1]
    if R == 0:
        return z
    zr, zp = z[..., :R], z[..., R:]
    if pairing == "half":
        rot = torch.cat([-zr[..., R // 2:], zr[..., :R // 2]], -1)
    else:
        rot = torch.stack([-zr[..., 1::2], zr[..., 0::2]], -1).flatten(-2)
    return torch.cat([zr * cos + rot * sin, zp], -1)


def _per_pair(c: torch.Tensor, form: str) -> torch.Tensor:
    """One angle's entry per rotated pair from a table stored in ``form``."""
    w = c.shape[-1]
    return {"dup_half": lambda: c[..., :w // 2], "dup_pairs": lambda: c[..., 0::2],
            "single": lambda: c}[form]()


def _table_forms(cos: torch.Tensor, sin: torch.Tensor, d: int) -> list[tuple[str, int]]:
    """The ways ``(form, R)`` a layer's tables can hold one angle per pair: duplicated halves
    (HF ``cat(freqs, freqs)``), duplicated pairs (``repeat_interleave``), or one entry per pair
    (gpt-oss); the first two only where the tables do repeat, the last where it fits ``d``."""
    w = int(cos.shape[-1])
    out = []
    if w % 2 == 0 and torch.equal(cos[:, :w // 2], cos[:, w // 2:]) and \
            torch.equal(sin[:, :w // 2], sin[:, w // 2:]):
        out.append(("dup_half", w))
    if w % 2 == 0 and torch.equal(cos[:, 0::2], cos[:, 1::2]) and \
            torch.equal(sin[:, 0::2], sin[:, 1::2]):
        out.append(("dup_pairs", w))
    if 2 * w <= d:
        out.append(("single", 2 * w))
    return out


def _layout_tables(pc: torch.Tensor, pairing: str) -> torch.Tensor:
    """Per-pair tables ``(..., R/2)`` laid out over the ``R`` rotated dims as ``pairing`` reads
    them (``cat(t, t)`` for split halves, ``repeat_interleave`` for adjacent pairs)."""
    return torch.cat([pc, pc], -1) if pairing == "half" else pc.repeat_interleave(2, -1)


def _rotations(forms: list[tuple[str, int]], cos: torch.Tensor, sin: torch.Tensor):
    """Every (form, pairing, sign, R, cos, sin) a layer could rotate with -- each table form
    with each pairing, tables laid out as that pairing reads them, turning by the tables' angle
    (sign +1) or its opposite (-1: ``sin`` negated) -- then no rotation at all."""
    for sign in (1, -1):
        for form, R in forms:
            pc, ps = _per_pair(cos, form), _per_pair(sin, form) * sign
            for pairing in ("half", "interleaved"):
                yield form, pairing, sign, R, _layout_tables(pc, pairing), \
                    _layout_tables(ps, pairing)
    empty = cos[:, :0]
    yield "none", "half", 1, 0, empty, empty


def _partner(A: torch.Tensor, R: int, pairing: str) -> torch.Tensor:
    """``A_c + A_c'`` with ``c'`` the coordinate rotated together with ``c`` (pass dims: A)."""
    if R == 0:
        return A
    Ar, Ap = A[..., :R], A[..., R:]
    if pairing == "half":
        p = torch.cat([Ar[..., R // 2:], Ar[..., :R // 2]], -1)
    else:
        p = torch.stack([Ar[..., 1::2], Ar[..., 0::2]], -1).flatten(-2)
    return torch.cat([Ar + p, Ap], -1)


# the attribute names transformers gives per-head query/key norms, in pairs
QK_NORM_NAMES = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"),
                 ("query_layernorm", "key_layernorm"), ("qk_norm", "qk_norm"))


def qk_norms(attn: Any) -> tuple[Any, Any]:
    """``(query norm, key norm)`` modules of an attention module (None where absent)."""
    import torch.nn as nn

    for qn, kn in QK_NORM_NAMES:
        q, k = getattr(attn, qn, None), getattr(attn, kn, None)
        if isinstance(q, nn.Module) or isinstance(k, nn.Module):
            return q, k
    return None, None


def _norm_size(norm: Any) -> int | None:
    """How many values a norm's weight scales (None: a weightless norm)."""
    p = next(norm.parameters(), None)
    return None if p is None else int(p.numel())


def _probe_norm(norm: Any, d: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm's output on four fixed probe vectors of ``d`` entries (magnitudes 0.5..1.5,
    random signs) given in ``like``'s dtype and device, and those inputs as the module saw them;
    both float64 on the CPU."""
    gen = torch.Generator().manual_seed(0)
    z = (torch.rand(4, d, generator=gen, dtype=F64) + 0.5) * torch.where(
        torch.rand(4, d, generator=gen) < 0.5, -1.0, 1.0).to(F64)
    with torch.no_grad():
        got = norm(z.to(like.device, like.dtype)).to("cpu", F64)
    return got, z.to(like.dtype).to(F64)


def _norm_weight(norm: Any, d: int, what: str) -> tuple[torch.Tensor, float]:
    """``(g, eps)`` of a per-head RMS norm, probed: ``norm(z) = g z / sqrt(mean(z^2) + eps)``."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise UnsupportedModelError(f"{what}: RMSNorm without an eps attribute")
    p = next(norm.parameters(), None)
    if p is None:  # a weightless norm (nanochat, Llama 4): read as g = 1 on probe vectors
        ref = next(iter(norm.buffers()), None)
        like = ref if ref is not None and ref.is_floating_point() else torch.zeros(
            (), dtype=torch.get_default_dtype())
        p = torch.ones(d, dtype=like.dtype, device=like.device)
    if p.numel() != d:  # a reading whose norm scope the module does not have
        raise UnsupportedModelError(f"{what}: the module normalises {p.numel()} values, the "
                                    f"reading {d} (norm scope read wrong)")
    got, zz = _probe_norm(norm, d, p)
    r = torch.sqrt(zz.pow(2).mean(-1, keepdim=True) + float(eps))
    g_rows = got * r / zz  # (4, d): the same g in every row for an RMS norm
    w = p.detach().to("cpu", F64).reshape(-1)
    # the arithmetic's rounding (float32 for bf16/fp16 modules) over the d squares, the root and
    # the products, and -- in a bf16/fp16 module -- the stored normalised value and the stored
    # product (two roundings of the storage dtype, doubled for the division by zz above)
    u = tl.unit_roundoff(p.dtype) if p.dtype != F64 else 2.0 ** -53
    u_store = tl.STORAGE_ROUNDOFF.get(p.dtype, 0.0)
    for g in (w, 1.0 + w):  # the two forms transformers uses: w z / rms, (1 + w) z / rms
        tol = ((d + 8) * u + 4 * u_store) * (g.abs().max() + 1.0)
        if g.shape[0] == d and torch.allclose(g_rows, g.expand_as(g_rows), rtol=0,
                                              atol=float(tol)):
            return g, float(eps)
    raise UnsupportedModelError(f"{what}: is not weight * z / rms(z) (RMSNorm convention)")


def _layer_norm_weight(norm: Any, d: int, what: str
                       ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(g, beta, eps)`` of a per-head LayerNorm with a bias (Persimmon), probed:
    ``norm(z) = g (z - mean z) / sqrt(mean (z - mean z)^2 + eps) + beta`` on probe vectors, with
    ``g`` and ``beta`` the module's own ``weight`` and ``bias``; None when the module has no
    such weight and bias or does not act so (then it is read as an RMS norm, or refused)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    w, b = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if eps is None or not isinstance(w, torch.Tensor) or not isinstance(b, torch.Tensor) \
            or w.numel() != d or b.numel() != d:
        return None
    got, zz = _probe_norm(norm, d, w)
    zc = zz - zz.mean(-1, keepdim=True)
    zh = zc / torch.sqrt(zc.pow(2).mean(-1, keepdim=True) + float(eps))
    g, beta = w.detach().to("cpu", F64).reshape(-1), b.detach().to("cpu", F64).reshape(-1)
    # the RMS norm's rounding (see _norm_weight) once more for the mean, and the bias's addition
    u = tl.unit_roundoff(w.dtype) if w.dtype != F64 else 2.0 ** -53
    u_store = tl.STORAGE_ROUNDOFF.get(w.dtype, 0.0)
    tol = ((2 * d + 10) * u + 4 * u_store) * (float((g.abs() * zh.abs()).max())
                                             + float(beta.abs().max()) + 1.0)
    if torch.allclose(got, g * zh + beta, rtol=0, atol=tol):
        return g, beta, float(eps)
    return None


def _qk_norm_reading(norm: Any, d: int, what: str
                     ) -> tuple[torch.Tensor, float, str, torch.Tensor | None]:
    """``(g, eps, kind, beta)`` of a query/key norm: a LayerNorm with a bias (``"layer"``,
    :func:`_layer_norm_weight`) or an RMS norm (``"rms"``, :func:`_norm_weight`, beta None)."""
    layer = _layer_norm_weight(norm, d, what)
    if layer is not None:
        return layer[0], layer[2], "layer", layer[1]
    g, eps = _norm_weight(norm, d, what)
    return g, eps, "rms", None


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(tl.SCALE_GUARD))


def _table_call(model: Any, positions: torch.Tensor, like: torch.Tensor, name: str,
                layer_type: str | None, order: str = "cos_sin"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of one call of a rotary module (``order="sin_cos"``: a module that returns
    them the other way round, as GPT-J's does)."""
    mod = dict(rotary_modules(model))[name]
    kw = {} if layer_type is None else {"layer_type": layer_type}
    with torch.no_grad():
        c, s = tables(mod(like, positions[None].to(like.device), **kw))
    if order == "sin_cos":
        c, s = s, c
    return c.reshape(-1, c.shape[-1]), s.reshape(-1, s.shape[-1])


def layer_tables(model: Any, conv: "LayerConventions", positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's raw tables at ``positions`` -- its rotary call (``conv.rotary``: a module
    name, with ``(layer_type='...')`` where it takes one), amplitude included -- ``(n, width)``
    on the model's device in its dtype."""
    p = next(model.parameters())
    like = torch.zeros(1, 1, 1, dtype=p.dtype, device=p.device)
    name, _, rest = (conv.rotary or "").partition("(layer_type=")
    lt = rest[1:-2] if rest else None
    return _table_call(model, positions.reshape(-1).long(), like, name, lt, conv.order)


def _match_rotary(model: Any, cos: torch.Tensor, sin: torch.Tensor, n: int, *,
                  like_dtype: torch.dtype, device: Any, order: str
                  ) -> tuple[str, str | None] | None:
    """The rotary call (module name, ``layer_type``) that reproduces the layer's tables
    (``cos``/``sin`` as read, float64; ``order``: how the layer was handed them)."""
    pos = torch.arange(n)
    like = torch.zeros(1, 1, 1, dtype=like_dtype, device=device)
    lts = sorted({str(t) for t in (getattr(model.config, "layer_types", None) or [])})
    for name, mod in rotary_modules(model):
        takes_type = "layer_type" in inspect.signature(mod.forward).parameters
        for lt in ([None] + lts if takes_type else [None]):
            try:
                c, s = _table_call(model, pos, like, name, lt, order)
            except Exception:  # a layer type this module does not know
                continue
            c, s = c.to("cpu", F64), s.to("cpu", F64)
            if c.shape == cos.shape and torch.equal(c, cos) and torch.equal(s, sin):
                return name, lt
    return None


def _permitted(r: AttentionRecord, n: int, who: str, L: int) -> torch.Tensor:
    """``(n, N)`` permitted sets from the layer's additive mask (0 or the dtype's min)."""
    N = r.key.shape[-2]
    if r.mask is None:
        return torch.ones(n, N, dtype=torch.bool)
    m = r.mask.reshape(-1, *r.mask.shape[-2:])
    if m.shape[0] != 1:
        if m.dtype != torch.bool and bool(((m != 0) & (m > torch.finfo(m.dtype).min / 2)).any()):
            last = m[:, -1, :N].to("cpu", F64)  # the last query reads every key (causal)
            affine = bool(torch.isfinite(last).all()) and \
                alibi_fit(last, torch.arange(N), m.dtype)[1] <= 1.0
            raise UnsupportedModelError(
                f"{who}: layer {L} adds a per-head score bias through its attention mask ("
                + ("affine in the key position: ALiBi folded into the mask, as Falcon's alibi "
                   "does -- a bias it builds from bfloat16 products, not slope * position to "
                   "the model's precision" if affine else
                   "not affine in the key position: a data-dependent mask") + "): not modelled")
        raise UnsupportedModelError(f"{who}: layer {L} has a per-head attention mask")
    m = m[0, :, :N].to("cpu")
    if m.dtype == torch.bool:
        return m
    m = m.to(F64)
    lo = torch.finfo(r.mask.dtype).min / 2
    finite_bias = (m != 0) & (m > lo)
    if bool(finite_bias.any()):
        raise UnsupportedModelError(
            f"{who}: layer {L}'s attention mask carries additive score biases (not modelled)")
    return m == 0


def _temperature_from(attn: Any) -> int | None:
    """The first position at which a layer's query temperature differs from 1, or None.

    Llama 4's NoPE layers (``attn_temperature_tuning`` on a layer with ``use_rope`` off) scale
    the query at position ``p`` by ``1 + attn_scale log(1 + floor((p + 1) / floor_scale))``:
    exactly 1 below ``p = floor_scale - 1``, so a run shorter than that is the plain head, and a
    longer one is refused (:func:`layer_head`).  A temperature under other names is not read
    here: the reading forward's queries then disagree with the projection and the layer is
    refused, and a run's own queries are compared with the reading in every run."""
    if not getattr(attn, "attn_temperature_tuning", False) or getattr(attn, "use_rope", True):
        return None
    f, a = getattr(attn, "floor_scale", None), getattr(attn, "attn_scale", None)
    if not a:  # attn_scale 0: the temperature is 1 everywhere
        return None
    if not f or not math.isfinite(float(f)) or float(f) <= 0:
        return 0
    return max(0, math.ceil(float(f)) - 1)


def _temperature(attn: Any) -> tuple[float, float] | None:
    """``(floor_scale, attn_scale)`` of a layer's position-dependent query temperature
    (Llama 4's NoPE layers, :func:`ropestep.spec.query_temperature`), or None where it is 1
    everywhere (no temperature tuning, a rotary layer, ``attn_scale`` 0)."""
    if _temperature_from(attn) is None:
        return None
    f, a = getattr(attn, "floor_scale", None), getattr(attn, "attn_scale", None)
    try:
        f, a = float(f), float(a)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(f) and f > 0 and math.isfinite(a)):
        return None
    return f, a


def tempered(z: torch.Tensor, E: torch.Tensor, temp: tuple, positions: Any, u: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Projected queries ``z (n, H, d)`` (float64) at ``positions`` -- the sequence indices the
    model counts -- times the query temperature ``temp = (floor_scale, attn_scale)``, and their
    bound ``E`` carried along: ``tau E`` plus the model's own roundings of ``tau`` and of the
    product (log1p, a product and a sum, the final product: ``4 u`` of the result)."""
    tq = torch.tensor([query_temperature(*temp, int(p)) for p in positions],
                      dtype=F64)[:, None, None]
    zt = z * tq
    return zt, E * tq + 4 * u * zt.abs()


def _temperature_text(attn: Any) -> str:
    return (f"attn_temperature_tuning, floor_scale {getattr(attn, 'floor_scale', None)}, "
            f"attn_scale {getattr(attn, 'attn_scale', None)}")


def _permitted_sets(n: int, window: int | None, chunk: int | None) -> torch.Tensor:
    """``(n, n)`` causal permitted sets by sequence index under a window and/or chunks
    (:func:`ropestep.spec.first_permitted`)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    first = torch.tensor([first_permitted(t, window, chunk) for t in range(n)])[:, None]
    return (j <= i) & (j >= first)


def _named_chunk(model: Any, attn: Any, L: int) -> int | None:
    """The chunk size a layer's configuration names for it (Llama 4: ``attention_chunk_size``
    on the layers ``layer_types`` calls ``chunked_attention``), or None.  The mask is the
    reading; this is the name it is checked against (and taken from where the reading forward
    is shorter than one chunk)."""
    size = getattr(attn, "attention_chunk_size", None)
    if size is None:
        cfg = getattr(attn, "config", None) or getattr(model, "config", None)
        size = getattr(cfg, "attention_chunk_size", None)
        types = getattr(cfg, "layer_types", None)
        if size is None or types is None or L >= len(types) or "chunk" not in str(types[L]):
            return None
    return int(size) if size else None


def _eager_probabilities(r: AttentionRecord, allowed: torch.Tensor, scaling: float,
                         softcap: float | None, group: int) -> torch.Tensor:
    """The layer's attention probabilities recomputed in float64 from its own q, k (and sink
    logits, in the denominator): ``(H, n, N)``."""
    q = r.query[0].to("cpu", F64)
    k = r.key[0].to("cpu", F64).repeat_interleave(group, 0)
    s = (q @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed[None], -math.inf)
    sink = r.kwargs.get("s_aux")
    if sink is not None:
        sk = torch.as_tensor(sink).to("cpu", F64).reshape(-1, 1, 1).expand(-1, s.shape[1], 1)
        return torch.softmax(torch.cat([s, sk], -1), -1)[..., :-1]
    return torch.softmax(s, -1)


def _eager_reference(r: AttentionRecord, allowed: torch.Tensor, scaling: float,
                     softcap: float | None, group: int) -> torch.Tensor:
    """The layer's eager output recomputed in float64 from its own q, k, v: ``(n, H, r)``."""
    p = _eager_probabilities(r, allowed, scaling, softcap, group)
    v = r.value[0].to("cpu", F64).repeat_interleave(group, 0)
    return (p @ v).transpose(0, 1)


def read_layer(model: Any, info: ModelInfo, L: int, r: AttentionRecord) -> LayerConventions:
    """Read and check one layer's conventions from its probe record (module docstring); the
    layer's offloaded weights, if any, are brought in for the reading (:class:`onloaded`)."""
    with onloaded(attention_module(layer_modules(model)[L], info.name, L)):
        return _read_layer(model, info, L, r)


def _read_layer(model: Any, info: ModelInfo, L: int, r: AttentionRecord) -> LayerConventions:
    who = info.name
    attn = attention_module(layer_modules(model)[L], who, L)
    out_name, out_lin = output_projection(attn, who, L)
    if r.inline:
        return _read_inline(info, L, r, attn, out_name, out_lin)
    H, Hk, d = info.n_heads, info.n_kv_heads, info.head_dim
    if r.hidden is None or r.query is None:
        raise UnsupportedModelError(f"{who}: layer {L}'s attention input was not recorded")
    n = r.hidden.shape[-2]
    if tuple(r.query.shape) != (1, H, n, d) or tuple(r.key.shape[:2]) != (1, Hk) or \
            r.key.shape[-1] != d:
        raise UnsupportedModelError(
            f"{who}: layer {L} attention queries {tuple(r.query.shape)} / keys "
            f"{tuple(r.key.shape)}, expected (1, {H}, n, {d}) / (1, {Hk}, N, {d})")
    rv = int(r.value.shape[-1])
    mdt = r.hidden.dtype
    temp_from = _temperature_from(attn)
    temp = _temperature(attn)
    if temp_from is not None and temp is None:
        raise UnsupportedModelError(
            f"{who}: layer {L} multiplies its queries by a position-dependent temperature from "
            f"position {temp_from} on ({_temperature_text(attn)}) whose parameters cannot be "
            "read: not modelled")
    order = "cos_sin"
    if r.cos is None:  # a layer handed no tables (a NoPE layer): only "no rotation" can fit
        cos = sin = torch.ones(n, 0, dtype=F64)
        a, forms, match, rot_name = 1.0, [], None, None
    else:
        cos = r.cos.reshape(-1, r.cos.shape[-1]).to("cpu", F64)
        sin = r.sin.reshape(-1, r.sin.shape[-1]).to("cpu", F64)
        if bool((cos[0] == 0).all()) and bool((sin[0] > 0).all()) and \
                bool((sin[0] == sin[0, 0]).all()):  # handed as (sin, cos): GPT-J, CodeGen
            cos, sin, order = sin, cos, "sin_cos"
        R = int(cos.shape[-1])
        if R > d or R % 2 or cos.shape[0] != n:
            raise UnsupportedModelError(
                f"{who}: layer {L}'s RoPE tables have shape {tuple(cos.shape)} for head_dim {d}")
        a = float(cos[0, 0])
        if not (a > 0 and bool((cos[0] == cos[0, 0]).all()) and bool((sin[0] == 0).all())):
            raise UnsupportedModelError(
                f"{who}: layer {L}'s RoPE tables at position 0 are not a * (1, 0) (cos "
                f"{cos[0, :4]})")
        forms = _table_forms(cos, sin, d)
        if not forms:
            raise UnsupportedModelError(
                f"{who}: layer {L}'s RoPE tables of width {R} repeat neither their halves nor "
                f"their pairs, and are too wide to hold one entry per pair of head_dim {d}")
        match = _match_rotary(model, cos, sin, n, like_dtype=r.hidden.dtype,
                              device=r.hidden.device, order=order)
        if match is None:
            raise UnsupportedModelError(f"{who}: layer {L}'s RoPE tables are not produced by any "
                                        "rotary module of the model")
        rot_name = match[0] + ("" if match[1] is None else f"(layer_type={match[1]!r})")
    # QK-norm
    norms = qk_norms(attn)
    qk_norm, eps, scope, norm_kind = False, math.nan, "head", "rms"
    gq = gk = bq = bk = None
    if any(nm is not None for nm in norms):
        if any(nm is None for nm in norms):
            raise UnsupportedModelError(f"{who}: layer {L} normalises only one of q and k")
        sizes = tuple(_norm_size(nm) for nm in norms)
        if sizes == (d, d) or sizes == (None, None):  # weightless: one head (checked below)
            scope = "head"
        elif sizes == (H * d, Hk * d):
            scope = "all"  # one RMS over every head of a token, before the head split
        else:
            raise UnsupportedModelError(
                f"{who}: layer {L}'s q/k norms act on {sizes} features: neither one head "
                f"({d}) nor every head ({H * d}, {Hk * d})")
        (gq, eq, kq, bq), (gk, ek, kk, bk) = (
            _qk_norm_reading(nm, d if sz is None else sz, f"{who}: layer {L} {w}")
            for nm, sz, w in zip(norms, sizes, ("q norm", "k norm")))
        if eq != ek:
            raise UnsupportedModelError(f"{who}: layer {L} q_norm eps {eq} != k_norm eps {ek}")
        if kq != kk:
            raise UnsupportedModelError(f"{who}: layer {L}: its q norm is a {kq} norm, its k "
                                        f"norm a {kk} norm (not modelled)")
        if kq == "layer" and scope != "head":
            raise UnsupportedModelError(f"{who}: layer {L}: a LayerNorm over every head of a "
                                        "token (not modelled: per-head LayerNorm only)")
        qk_norm, eps, norm_kind = True, eq, kq
        if scope == "all":
            gq, gk = gq.view(H, d), gk.view(Hk, d)
    # projections: the (layout, rotation) that reproduces the layer's own tensors
    x64 = r.hidden.reshape(n, -1).to("cpu", F64)
    m = x64.shape[-1]
    u = tl.unit_roundoff(mdt) if mdt != F64 else 2.0 ** -53
    model_q = r.query[0].transpose(0, 1).to("cpu", F64)  # (n, H, d)
    model_k = r.key[0, :, -n:].transpose(0, 1).to("cpu", F64)
    model_v = r.value[0, :, -n:].transpose(0, 1).to("cpu", F64)
    tries: list[str] = []
    chosen = None
    norm_after = False
    latent = ()
    vscale = _value_scale(attn)
    clip = _clip(attn)
    if is_latent(attn):  # multi-head latent attention: read in the absorbed form (section 14)
        chosen, latent = _read_latent(attn, x64, model_q, model_k, model_v, forms, cos, sin, a,
                                      mdt, H, d, rv, who, L)
    orders = (False, True) if gq is not None and scope == "head" and norm_kind == "rms" \
        else (False,)
    for lname, parts in ({} if latent else layout_candidates(attn, H, Hk, d, rv)).items():
        for (form, pairing, sgn, Rr, ct, st), after in (
                (rot_, o) for o in orders for rot_ in _rotations(forms, cos, sin)):
            ok, worst = True, []
            for nm, heads, dim, ref, g, beta in (("q", H, d, model_q, gq, bq),
                                                 ("k", Hk, d, model_k, gk, bk),
                                                 ("v", Hk, rv, model_v, None, None)):
                W, b = parts[nm]
                if nm == "v" and vscale != 1.0:  # the module scales its values (MiMo-V2)
                    W, b = W * vscale, (None if b is None else b * vscale)
                if tuple(W.shape) != (heads * dim, m):
                    ok = False
                    worst.append(f"{nm} rows {tuple(W.shape)} != {(heads * dim, m)}")
                    break
                z, A = project_part((W, b), x64, heads)
                if clip is not None:  # 1-Lipschitz: the bound carries over unchanged
                    z = z.clamp(-clip, clip)
                E = tl.rotated_projection_abs(mdt, A, m + 1) + tl.rotated_projection_abs(
                    F64, A, m + 1)
                if nm != "v" and after:  # the norm acts on the rotated vector (Hunyuan)
                    z = _rotate(z, ct[:, None], st[:, None], pairing)
                    E = _partner(E, Rr, pairing) * max(a, 1.0)
                if g is not None:  # RMS norm (per head, or over every head of a token):
                    # first-order propagation of E
                    red = (-1,) if scope == "head" else (-2, -1)
                    nn_ = dim if scope == "head" else dim * heads
                    reps = 1
                    if beta is not None:  # LayerNorm: centred first (|d(z - mean z)| <=
                        # |dz| + max |dz|), its mean one more rounded reduction
                        z = z - z.mean(red, keepdim=True)
                        E = E + E.amax(red, keepdim=True)
                        reps = 2
                    rms = torch.sqrt(z.pow(2).mean(red, keepdim=True) + eps)
                    zh = z / rms
                    E = g.abs() * (E / rms + zh.abs() * (E.amax(red, keepdim=True) / rms)) \
                        + (reps * math.sqrt(nn_) * tl.HM_LAMBDA + 8) * u * (g.abs() * zh.abs())
                    z = g * zh
                    if beta is not None:  # the bias, and the rounding of its addition
                        z = z + beta
                        E = E + 2 * u * z.abs()
                if nm != "v" and not after:
                    z = _rotate(z, ct[:, None], st[:, None], pairing)
                    E = _partner(E, Rr, pairing) * max(a, 1.0)
                if nm == "q" and temp is not None:  # the query temperature at the probe's
                    # positions (the sequence index)
                    z, E = tempered(z, E, temp, range(n), u)
                err = (z - ref).abs()
                worst.append(f"{nm} {float(err.max()):.2e} (bound {float(E.max()):.2e})")
                if not bool((err <= E).all()):
                    ok = False
            how = (pairing + ("" if sgn > 0 else " reversed")) if Rr else "unrotated"
            how += ", norm after RoPE" if after else ""
            tries.append(f"{lname}/{how}: " + ", ".join(worst))
            if ok:
                chosen = (lname, pairing, Rr, parts, form, sgn)
                norm_after = after
                break
        if chosen:
            break
    if chosen is None:
        raise UnsupportedModelError(
            f"{who}: layer {L}: no projection layout and rotation reproduces the module's own "
            f"rotated queries, keys and values ({'; '.join(tries) or 'no known layout fits'})")
    lname, pairing, Rr, parts, form, sgn = chosen
    if temp is not None and (Rr or qk_norm or latent):
        raise UnsupportedModelError(
            f"{who}: layer {L} scales a rotated, normalised or latent query by a "
            f"position-dependent temperature ({_temperature_text(attn)}): not modelled (the "
            "temperature is read on plain queries, Llama 4's NoPE layers)")
    # score: scale, soft-cap, window, sinks -- read from the eager call, checked on its output
    kw = r.kwargs
    scaling = kw.get("scaling")
    scaling = float(d ** -0.5 if scaling is None else scaling)
    softcap = kw.get("softcap")
    softcap = None if softcap is None else float(softcap)
    sinks = kw.get("s_aux") is not None
    allowed = _permitted(r, n, who, L)
    N = allowed.shape[1]
    if N != n:
        raise UnsupportedModelError(f"{who}: layer {L} read {N} keys for {n} queries")
    i, j = torch.arange(n)[:, None], torch.arange(N)[None]
    causal = j <= i
    named = kw.get("sliding_window", getattr(attn, "sliding_window", None))
    named_chunk = _named_chunk(model, attn, L)
    window = chunk = None
    if not torch.equal(allowed, causal):  # a window or chunks, read from the mask
        first = torch.where(allowed, j.expand(n, N), N).amin(1)  # earliest permitted key
        # chunks: the first row after 0 that reads only itself opens the second chunk
        opens = [t for t in range(1, n) if int(first[t]) == t]
        if opens and named is None and torch.equal(allowed, _permitted_sets(n, None, opens[0])):
            chunk = opens[0]
        else:  # a window: the widest row
            window = int((torch.arange(n) - first + 1).max())
    if window is not None and named is not None and int(named) != window:
        raise UnsupportedModelError(
            f"{who}: layer {L}'s mask is a window of {window} keys, its attention names "
            f"sliding_window={named}")
    if chunk is not None and named_chunk is not None and named_chunk != chunk:
        raise UnsupportedModelError(
            f"{who}: layer {L}'s mask is chunks of {chunk} positions, its config names "
            f"attention_chunk_size={named_chunk}")
    if window is None and chunk is None:
        for what, v in (("sliding_window", named), ("attention_chunk_size", named_chunk)):
            if v is not None and int(v) < n:
                raise UnsupportedModelError(
                    f"{who}: layer {L} names {what}={v} but its mask over {n} tokens is causal")
        # named, and wider than the probe: the mask cannot show it (checked on a longer forward)
        window = None if named is None else int(named)
        chunk = named_chunk
    if not torch.equal(allowed, _permitted_sets(n, window, chunk)):
        raise UnsupportedModelError(
            f"{who}: layer {L}'s permitted sets are neither causal, a causal window nor causal "
            "chunks")
    # eager attention takes its softmax in float32 for every storage dtype wider than it;
    # below float32 (bf16/fp16) its scores and probabilities are stored in that dtype
    if mdt in (torch.float32, F64):
        tol = tl.agreement_rel_tol(torch.float32, n, d, 0)
    else:
        q64, k64 = r.query.to("cpu", F64), r.key.to("cpu", F64)
        qk = float(q64.norm(dim=-1).max() * k64.norm(dim=-1).max()) * scaling
        tol = tl.native_rel_tol_lowp(mdt, qk)
    if r.output is not None:
        ref = _eager_reference(r, allowed, scaling, softcap, H // Hk)
        got = r.output[0].to("cpu", F64)
        rel = _rel(got, ref)
        if not rel <= tol:
            raise UnsupportedModelError(
                f"{who}: layer {L}'s eager output differs from softmax(scaling q k^T"
                f"{', soft-capped' if softcap else ''}, masked{', with sinks' if sinks else ''})"
                f" v by {rel:.2e} relative (bound {tol:.2e}): its score is not the one read")
    direct, between = _output_path(r, who, L)
    gate = ""
    if not direct and parts is not None and "g" in parts:
        gate = _output_gate(r, parts["g"], x64, H, rv, who, L)
        if gate:
            between = (f"an output gate {gate}(x W_g + b_g) on the heads (the gate rows of "
                       f"{lname} q_proj), read and applied after the heads")
    sink_param = _sink_parameter(attn, kw.get("s_aux"), H, who, L) if sinks else ""
    if sinks and r.weights is not None:  # the probabilities it returns must carry the sink's
        # share (validate compares each candidate's own-key probability with the model's)
        p = _eager_probabilities(r, allowed, scaling, softcap, H // Hk)
        w = r.weights[0].to("cpu", F64)
        if tuple(w.shape) != tuple(p.shape) or not _rel(w, p) <= tol:
            raise UnsupportedModelError(
                f"{who}: layer {L}'s attention returns probabilities without its sink's share "
                "(the sink rescales the output after the softmax), so the model's own "
                "probabilities cannot be read against the identity's")
    inv = ()
    rmod = dict(rotary_modules(model)).get(match[0]) if match is not None else None
    fr = getattr(rmod, "inv_freq", None)
    if fr is None and match is not None and match[1] is not None:  # one per layer type (Gemma 3)
        fr = getattr(rmod, f"{match[1]}_inv_freq", None)
    if torch.is_tensor(fr) and fr.numel() == Rr // 2 and Rr:
        inv = tuple(float(v) for v in fr.detach().to("cpu", F64))
    elif Rr and match is not None and a == 1.0:  # a module that keeps only its tables (GPT-J)
        inv = _frequencies_from_tables(model, match, order, form, Rr, r.hidden)
    return LayerConventions(
        layer=L, attention=type(attn).__name__, layout=lname, output=out_name,
        rotary=rot_name if Rr else None, rotary_dim=Rr, pairing=pairing, tables=form,
        amplitude=a,
        scaling=scaling, softcap=softcap, window=window, chunk=chunk, qk_norm=qk_norm,
        norm_scope=scope, norm_eps=eps, temperature_from=temp_from, norm_kind=norm_kind,
        temperature=() if temp is None else temp,
        qkv_bias=(parts["q"][1] is not None if parts is not None
                  else attn.kv_a_proj_with_mqa.bias is not None),
        o_bias=out_lin.bias is not None, sinks=sinks,
        inv_freq=inv, output_direct=direct, output_between=between, sign=sgn, latent=latent,
        value_scale=vscale, clip=clip, norm_after_rope=norm_after,
        order="none" if r.cos is None else "complex" if r.complex_tables else order,
        input_dim=m, call_args=tuple(sorted(r.call.items())), sink_param=sink_param,
        output_gate=gate)


def _output_gate(r: AttentionRecord, part: tuple, x64: torch.Tensor, H: int, rv: int, who: str,
                 L: int) -> str:
    """``"sigmoid"`` where the output projection's input is the heads' output times
    ``sigmoid(x W_g + b_g)`` (the gated layout's gate rows ``part``) within rounding, else ``""``.

    Bound, elementwise: the gate's projection carries ``E_g`` (the projection's rounding,
    :func:`ropestep.tolerances.rotated_projection_abs`, model dtype plus float64), which moves
    ``sigmoid`` by at most ``E_g / 4`` (its slope is at most 1/4); the model rounds the sigmoid
    and the product (two roundings of its dtype, ``2 u`` of each side's magnitude); the heads'
    output is the model's own tensor on both sides."""
    if r.o_in is None or r.output is None:
        return ""
    n = x64.shape[0]
    W = part[0]
    if tuple(W.shape) != (H * rv, x64.shape[-1]):
        return ""
    mdt = r.hidden.dtype
    u = tl.storage_roundoff(mdt)
    z, A = project_part(part, x64, H)  # (n, H, r)
    E = tl.rotated_projection_abs(mdt, A, x64.shape[-1] + 1) + tl.rotated_projection_abs(
        F64, A, x64.shape[-1] + 1)
    y = r.output.reshape(n, H, rv).to("cpu", F64)
    got = r.o_in.reshape(n, H, rv).to("cpu", F64)
    want = y * torch.sigmoid(z)
    bound = y.abs() * (E / 4 + 2 * u) + 2 * u * got.abs() + tl.SCALE_GUARD
    return "sigmoid" if bool(((got - want).abs() <= bound).all()) else ""


# ---------------------------------------------------------------------------------------------
# inline attention with an ALiBi bias (BLOOM, MPT)
# ---------------------------------------------------------------------------------------------
INLINE_TEXT = "inline attention (scores computed in the module, an ALiBi bias handed to it)"
# the module attributes an inline module keeps its score scale under (BLOOM's inv_norm_factor,
# MPT's softmax_scale); without one, 1/sqrt(d) -- whichever, the reading proves it
INLINE_SCALE_NAMES = ("scaling", "softmax_scale", "inv_norm_factor")
ALIBI_FIT_ULPS = 4  # the slope-fit residual bound, in units of the bias dtype's roundoff


def alibi_key_bias(bias: Any, H: int, N: int, who: str, L: int) -> torch.Tensor:
    """``(H, N)`` float64: the key-position bias an inline module was handed, per head, for its
    last ``N`` keys (BLOOM hands ``(B H, 1, N)``, MPT ``(H, 1, max_seq_len)`` and uses its last
    ``N`` columns).  A bias that varies with the query, or differs between the batch's rows, is
    not a key-position bias and is refused."""
    if not torch.is_tensor(bias):
        raise UnsupportedModelError(f"{who}: layer {L}'s {INLINE_TEXT} was handed no bias tensor")
    t = bias.detach().to("cpu", F64)
    K = int(t.shape[-1])
    if t.dim() < 2 or t.shape[-2] != 1 or K < N or t.numel() % (H * K):
        raise UnsupportedModelError(
            f"{who}: layer {L}'s position bias has shape {tuple(bias.shape)}: not one row of "
            f"key biases per head ({H} heads, {N} keys)")
    t = t.reshape(-1, H, K)
    if not bool((t == t[:1]).all()):
        raise UnsupportedModelError(f"{who}: layer {L}'s position bias differs between the "
                                    "batch's rows (not modelled)")
    return t[0, :, K - N:]


def alibi_fit(kb: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, float]:
    """``(slopes (H,), worst)``: the slope of each head's key bias ``kb (H, N)`` over the key
    positions (from its first and last key), and the worst residual of the affine form
    ``kb[h, j] = kb[h, 0] + slope_h (p_j - p_0)`` over its bound (``<= 1``: ALiBi).

    Bound: each entry is the model's ``dtype`` rounding of ``slope p_j`` (plus a constant), so
    ``|e_j| <= u |kb_j|``; the slope from the two end keys carries ``(|e_0| + |e_last|)`` over
    the span, which moves the fitted value at key ``j`` by at most that much; the residual is
    then at most ``u (|kb_j| + 2 |kb_0| + 2 |kb_last|)``, taken ``ALIBI_FIT_ULPS`` times as
    margin for an order of evaluation that rounds twice."""
    p = key_pos.to("cpu", F64)
    if kb.shape[-1] < 2 or float(p[-1] - p[0]) == 0:
        return torch.zeros(kb.shape[0], dtype=F64), 0.0
    slope = (kb[:, -1] - kb[:, 0]) / (p[-1] - p[0])
    fit = kb[:, :1] + slope[:, None] * (p - p[0])[None]
    u = tl.storage_roundoff(dtype)
    bound = ALIBI_FIT_ULPS * u * (kb.abs() + 2 * kb[:, :1].abs() + 2 * kb[:, -1:].abs())
    err = (kb - fit).abs()
    worst = float((err / bound.clamp_min(tl.SCALE_GUARD)).max())
    return slope, worst


def alibi_check(kb: torch.Tensor, key_pos: torch.Tensor, slopes: Sequence[float],
                dtype: torch.dtype) -> float:
    """The worst ratio, over heads and keys, of ``|kb[h, j] - kb[h, 0] - slope_h (p_j - p_0)|``
    to its bound, for a run's key bias ``kb (H, N)`` against the slopes read on loading
    (``<= 1``: the run's bias is the one read).  Bound: :func:`alibi_fit`'s entry roundings
    ``u (|kb_j| + |kb_0|)``, plus the read slope's own error (at most ``2 u |slope|`` per unit
    of position), times ``ALIBI_FIT_ULPS``."""
    p = key_pos.to("cpu", F64)
    s = torch.as_tensor(list(slopes), dtype=F64)[:, None]
    u = tl.storage_roundoff(dtype)
    dp = (p - p[0])[None]
    err = (kb - kb[:, :1] - s * dp).abs()
    bound = ALIBI_FIT_ULPS * u * (kb.abs() + kb[:, :1].abs() + 2 * (s * dp).abs())
    return float((err / bound.clamp_min(tl.SCALE_GUARD)).max()) if err.numel() else 0.0


def _inline_mask(r: AttentionRecord, n: int, N: int, who: str, L: int
                 ) -> tuple[torch.Tensor, str]:
    """``(allowed (n, N), form)`` from the mask an inline module was handed: additive (0 or the
    dtype's min), or boolean -- True permitted ("keep") or True masked ("drop": MPT's
    ``masked_fill``), told apart by the diagonal (a query always reads its own key)."""
    if r.mask is None:
        return torch.ones(n, N, dtype=torch.bool), "additive"
    m = r.mask.reshape(-1, *r.mask.shape[-2:])
    if m.shape[0] != 1:
        raise UnsupportedModelError(f"{who}: layer {L} has a per-head attention mask")
    m = m[0, -n:, -N:].to("cpu")
    if m.dtype == torch.bool:
        diag = m[torch.arange(n), N - n + torch.arange(n)]
        if bool(diag.all()):
            return m, "keep"
        if not bool(diag.any()):
            return ~m, "drop"
        raise UnsupportedModelError(f"{who}: layer {L}'s boolean mask neither keeps nor masks "
                                    "every query's own key")
    m = m.to(F64)
    lo = torch.finfo(r.mask.dtype).min / 2
    if bool(((m != 0) & (m > lo)).any()):
        raise UnsupportedModelError(
            f"{who}: layer {L}'s attention mask carries additive score biases (not modelled)")
    return m == 0, "additive"


def _inline_scale(attn: Any, d: int) -> float:
    for name in INLINE_SCALE_NAMES:
        v = getattr(attn, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            return float(v)
    return d ** -0.5


def _read_inline(info: ModelInfo, L: int, r: AttentionRecord, attn: Any, out_name: str,
                 out_lin: Any) -> LayerConventions:
    """Read an inline ALiBi layer (BLOOM, MPT): its key bias (``slope_h p_j``, checked affine in
    the key position to the bias dtype's rounding), its mask (causal), its score scale (a named
    attribute) and the projection layout whose queries, keys and values -- through that scale,
    bias and mask -- reproduce the probabilities the module returns and its heads' output (the
    output projection's input), within the projections' rounding carried through the softmax."""
    who = info.name
    H, d = info.n_heads, info.head_dim
    if r.hidden is None or r.weights is None or r.output is None:
        raise UnsupportedModelError(f"{who}: layer {L}'s {INLINE_TEXT}: its input, "
                                    "probabilities or heads' output was not recorded")
    n = r.hidden.shape[-2]
    P_model = r.weights[0].to("cpu", F64)  # (H, n, N)
    N = int(P_model.shape[-1])
    if tuple(P_model.shape) != (H, n, N) or N != n:
        raise UnsupportedModelError(f"{who}: layer {L} returned probabilities of shape "
                                    f"{tuple(r.weights.shape)} for {n} tokens")
    O_model = r.output[0].to("cpu", F64)  # (n, H, d)
    mdt = r.hidden.dtype
    kb = alibi_key_bias(r.bias, H, N, who, L)
    key_pos = torch.arange(N)
    slopes, worst = alibi_fit(kb, key_pos, r.bias.dtype)
    if not worst <= 1.0:
        raise UnsupportedModelError(
            f"{who}: layer {L}'s position bias is not affine in the key position (worst "
            f"residual {worst:.2e} of its rounding bound): not an ALiBi bias")
    allowed, form = _inline_mask(r, n, N, who, L)
    if not torch.equal(allowed, _permitted_sets(n, None, None)):
        raise UnsupportedModelError(f"{who}: layer {L}'s {INLINE_TEXT} permits other keys than "
                                    "the causal ones (not modelled)")
    scaling = _inline_scale(attn, d)
    clip = _clip(attn)
    x64 = r.hidden.reshape(n, -1).to("cpu", F64)
    m = x64.shape[-1]
    agree = tl.agreement_rel_tol(torch.float32, N, d, 0)
    tries = []
    chosen = None
    for lname, parts in layout_candidates(attn, H, H, d, d).items():
        zs, Es = {}, {}
        for nm in ("q", "k", "v"):
            W, _ = parts[nm]
            if tuple(W.shape) != (H * d, m):
                break
            z, A = project_part(parts[nm], x64, H)  # (n, H, d)
            if clip is not None:  # 1-Lipschitz: the bound carries over
                z = z.clamp(-clip, clip)
            zs[nm] = z.transpose(0, 1)
            Es[nm] = (tl.rotated_projection_abs(mdt, A, m + 1)
                      + tl.rotated_projection_abs(F64, A, m + 1)).transpose(0, 1)
        if len(zs) < 3:
            tries.append(f"{lname}: shapes")
            continue
        q, k, v = zs["q"], zs["k"], zs["v"]
        s = scaling * (q @ k.transpose(-1, -2)) + kb[:, None, :]
        p = torch.softmax(s.masked_fill(~allowed[None], -math.inf), -1)
        out = (p @ v).transpose(0, 1)  # (n, H, d)
        # the model's scores differ from these by its projections' rounding: per row at most
        # delta = scaling max_j sum_l (Eq |k| + |q| Ek + Eq Ek), which moves each probability
        # by a factor within e^(+-2 delta)
        Eq, Ek = Es["q"], Es["k"]
        ds = scaling * (Eq @ k.abs().transpose(-1, -2) + q.abs() @ Ek.transpose(-1, -2)
                        + Eq @ Ek.transpose(-1, -2))
        grow = math.expm1(2 * float(ds.masked_fill(~allowed[None], 0).max()))
        err_p = float((P_model - p).abs().max())
        bound_p = agree * float(p.abs().max()) + grow
        err_o = float((O_model - out).abs().max())
        bound_o = (agree * float(out.abs().max()) + grow * float(v.abs().max())
                   + float(Es["v"].max()))
        tries.append(f"{lname}: probabilities {err_p:.2e} (bound {bound_p:.2e}), output "
                     f"{err_o:.2e} (bound {bound_o:.2e})")
        if err_p <= bound_p and err_o <= bound_o:
            chosen = (lname, parts)
            break
    if chosen is None:
        raise UnsupportedModelError(
            f"{who}: layer {L}: no projection layout, with scale {scaling:.6g} and the ALiBi "
            f"bias it was handed, reproduces the module's own probabilities and output "
            f"({'; '.join(tries) or 'no known layout fits'})")
    lname, parts = chosen
    return LayerConventions(
        layer=L, attention=type(attn).__name__, layout=lname, output=out_name, rotary=None,
        rotary_dim=0, pairing="half", tables="single", amplitude=1.0, scaling=scaling,
        softcap=None, window=None, qk_norm=False, norm_eps=math.nan,
        qkv_bias=parts["q"][1] is not None, o_bias=out_lin.bias is not None, sinks=False,
        output_direct=True, order="none", input_dim=m, call_args=tuple(sorted(r.call.items())),
        clip=clip, alibi=tuple(float(v) for v in slopes), bias_arg=_bias_arg(attn),
        mask_form=form)


def _bias_arg(attn: Any) -> str:
    return inline_bias_arg(attn) or ""


def _sink_parameter(attn: Any, s_aux: Any, H: int, who: str, L: int) -> str:
    """The name of the attention module's own parameter (or buffer) that its eager call was
    handed as the sink logits (``s_aux``): one per query head, the same values."""
    got = torch.as_tensor(s_aux).detach().reshape(-1)
    if got.numel() != H:
        raise UnsupportedModelError(f"{who}: layer {L}'s sink logits are {got.numel()} values, "
                                    f"not one per query head ({H})")
    for name, t in (*attn.named_parameters(recurse=False), *attn.named_buffers(recurse=False)):
        if t.numel() == H and torch.equal(t.detach().reshape(-1).to(got.device, got.dtype), got):
            return name
    raise UnsupportedModelError(f"{who}: layer {L}'s sink logits are not a parameter of its "
                                f"{type(attn).__name__}")


def is_latent(attn: Any) -> bool:
    """Multi-head latent attention as transformers writes it (DeepSeek-V2/V3 and the models
    built on their module: MiniCPM3, Kimi, LongCat, GLM-4-MoE-Lite, ...): a shared
    ``kv_a_proj_with_mqa`` (latent and rotated key part) and a per-head ``kv_b_proj``."""
    import torch.nn as nn

    return isinstance(getattr(attn, "kv_a_proj_with_mqa", None), nn.Linear) and \
        isinstance(getattr(attn, "kv_b_proj", None), nn.Linear)


def _deinterleave(n: int) -> torch.Tensor:
    """``[0, 2, 4, ..., 1, 3, 5, ...]``: adjacent pairs to split halves (rope_interleave)."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def latent_rope_order(pairing: str, pre: str, rho: int) -> torch.Tensor:
    """The order ``Pi`` of a latent layer's raw rotated dims that makes its rotation ropestep's
    adjacent-pair rotation: split-half pairs (l, l + rho/2) interleaved; already adjacent pairs
    (an interleaved rotation, or transformers' ``rope_interleave``, which de-interleaves before a
    split-half rotation) kept."""
    if pairing == "half" and pre != "deinterleave":
        h = rho // 2
        return torch.stack([torch.arange(h), h + torch.arange(h)], -1).reshape(-1)
    return torch.arange(rho)


def _latent_parts(attn: Any, H: int, d: int, rv: int, who: str, L: int) -> dict:
    """The linear maps and norms of a latent attention module, their sizes read from the
    module's own tensors: ``rank`` (the latent norm's width), ``rope`` (the rest of
    ``kv_a_proj_with_mqa``), ``nope = d - rope``, ``q_rank`` (0 without a query latent)."""
    import torch.nn as nn

    kva, kvb = attn.kv_a_proj_with_mqa, attn.kv_b_proj
    knorm = getattr(attn, "kv_a_layernorm", None)
    if not isinstance(knorm, nn.Module) or _norm_size(knorm) is None:
        raise UnsupportedModelError(f"{who}: layer {L}: latent attention without a weighted "
                                    "kv_a_layernorm")
    rank = int(_norm_size(knorm))
    rope = int(kva.out_features) - rank
    nope = d - rope
    if rope < 0 or rope % 2 or nope < 0 or kvb.in_features != rank or \
            kvb.out_features != H * (nope + rv):
        raise UnsupportedModelError(
            f"{who}: layer {L}: latent attention sizes do not fit (kv_a_proj_with_mqa "
            f"{kva.out_features} = rank {rank} + rope {rope}; kv_b_proj {kvb.out_features} != "
            f"{H} heads x (nope {nope} + value {rv}))")
    qa, qb = getattr(attn, "q_a_proj", None), getattr(attn, "q_b_proj", None)
    if isinstance(qa, nn.Linear) and isinstance(qb, nn.Linear):
        qnorm = getattr(attn, "q_a_layernorm", None)
        if not isinstance(qnorm, nn.Module):
            raise UnsupportedModelError(f"{who}: layer {L}: a query latent without its norm")
        q_rank, q_lin = int(qa.out_features), qb
    elif isinstance(getattr(attn, "q_proj", None), nn.Linear):
        qnorm, q_rank, q_lin = None, 0, attn.q_proj
    else:
        raise UnsupportedModelError(f"{who}: layer {L}: latent attention with neither q_proj nor "
                                    "q_a_proj/q_b_proj")
    if q_lin.out_features != H * d:
        raise UnsupportedModelError(f"{who}: layer {L}: the query projection gives "
                                    f"{q_lin.out_features} values, not {H} heads x {d}")
    return {"kva": kva, "kvb": kvb, "knorm": knorm, "qa": qa if q_rank else None,
            "qnorm": qnorm, "q": q_lin, "rank": rank, "rope": rope, "nope": nope,
            "q_rank": q_rank}


def _normed64(z: torch.Tensor, E: torch.Tensor, g: torch.Tensor, eps: float, u: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g z / sqrt(mean z^2 + eps)`` over the last dim and the first-order propagation of an
    elementwise bound ``E`` on ``z`` through it, plus the norm's own rounding (as for QK-norm)."""
    n = z.shape[-1]
    rms = torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    zh = z / rms
    E = g.abs() * (E / rms + zh.abs() * (E.amax(-1, keepdim=True) / rms)) \
        + (math.sqrt(n) * tl.HM_LAMBDA + 8) * u * (g.abs() * zh.abs())
    return g * zh, E


def _lin64(part: tuple, z: torch.Tensor, E: torch.Tensor | None, mdt: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``z W^T + b`` in float64 with its bound against the model's ``mdt`` evaluation: the
    product's own rounding on both sides (:func:`ropestep.tolerances.rotated_projection_abs`
    with the terms ``|z| |W|^T + |b|``) plus ``|W| E`` carried from ``z``'s bound."""
    W = part[0].detach().to("cpu", F64)
    b = None if part[1] is None else part[1].detach().to("cpu", F64)
    out, A = z @ W.T, z.abs() @ W.abs().T
    if b is not None:
        out, A = out + b, A + b.abs()
    k = W.shape[1] + (b is not None)
    bound = tl.rotated_projection_abs(mdt, A, k) + tl.rotated_projection_abs(F64, A, k)
    if E is not None:
        bound = bound + E @ W.abs().T
    return out, bound


def _read_latent(attn: Any, x64: torch.Tensor, model_q: torch.Tensor, model_k: torch.Tensor,
                 model_v: torch.Tensor, forms: list, cos: torch.Tensor, sin: torch.Tensor,
                 a: float, mdt: torch.dtype, H: int, d: int, rv: int, who: str, L: int
                 ) -> tuple[tuple, tuple]:
    """Read a latent attention layer (docs/math.md section 14) from its own tensors: the model's
    queries, keys and values recomputed in float64 from the module's maps -- the latent and
    the query latent through their norms -- must reproduce the eager function's within the
    propagated rounding bound, the rotated part with one of the rotations the tables allow.
    Returns the reading's ``(layout, pairing, R, parts, form, sign)`` and the ``latent`` tuple
    of :class:`LayerConventions`."""
    P = _latent_parts(attn, H, d, rv, who, L)
    rank, rope, nope = P["rank"], P["rope"], P["nope"]
    u = tl.unit_roundoff(mdt) if mdt != F64 else 2.0 ** -53
    n = x64.shape[0]
    with torch.no_grad():
        g_kv, e_kv = _norm_weight(P["knorm"], rank, f"{who}: layer {L} kv_a_layernorm")
        kv, E_kv = _lin64((P["kva"].weight, P["kva"].bias), x64, None, mdt)
        c, E_c = _normed64(kv[:, :rank], E_kv[:, :rank], g_kv, float(e_kv), u)
        kr, E_kr = kv[:, rank:], E_kv[:, rank:]
        knv, E_knv = _lin64((P["kvb"].weight, P["kvb"].bias), c, E_c, mdt)
        knv, E_knv = knv.view(n, H, nope + rv), E_knv.view(n, H, nope + rv)
        e_q = 0.0
        if P["q_rank"]:
            g_q, e_q = _norm_weight(P["qnorm"], P["q_rank"], f"{who}: layer {L} q_a_layernorm")
            z, E_z = _lin64((P["qa"].weight, P["qa"].bias), x64, None, mdt)
            z, E_z = _normed64(z, E_z, g_q, float(e_q), u)
        else:
            z, E_z = x64, None
        q, E_q = _lin64((P["q"].weight, P["q"].bias), z, E_z, mdt)
        q, E_q = q.view(n, H, d), E_q.view(n, H, d)
    worst = []

    def within(name: str, got: torch.Tensor, E: torch.Tensor, ref: torch.Tensor) -> bool:
        err = (got - ref).abs()
        worst.append(f"{name} {float(err.max()):.2e} (bound {float(E.max()):.2e})")
        return bool((err <= E).all())

    ok = within("q nope", q[..., :nope], E_q[..., :nope], model_q[..., :nope])
    ok &= within("k nope", knv[..., :nope], E_knv[..., :nope], model_k[..., :nope])
    ok &= within("v", knv[..., nope:], E_knv[..., nope:], model_v)
    chosen = None
    for form, pairing, sgn, R, ct, st in _rotations(forms, cos, sin):
        if R != rope or sgn < 0:
            continue
        for pre in (("", "deinterleave") if pairing == "half" else ("",)):
            order = _deinterleave(rope) if pre else torch.arange(rope)
            good = True
            for name, raw, E_raw, ref in (("q rope", q[..., nope:], E_q[..., nope:],
                                           model_q[..., nope:]),
                                          ("k rope", kr[:, None], E_kr[:, None],
                                           model_k[..., nope:])):
                rot = _rotate(raw[..., order], ct[:, None], st[:, None], pairing)
                E = _partner(E_raw[..., order], R, pairing) * max(a, 1.0)
                good &= within(f"{name}/{pairing}{'+' + pre if pre else ''}",
                               rot.expand_as(ref), E.expand_as(ref), ref)
            if good and ok:
                chosen = ("latent", pairing, R, None, form, 1)
                latent = (rank, rope, nope, P["q_rank"], float(e_kv), float(e_q), pre)
                return chosen, latent
    raise UnsupportedModelError(
        f"{who}: layer {L}: the latent attention's queries, keys and values recomputed from its "
        f"maps do not reproduce the module's own ({', '.join(worst)})")


def _clip(attn: Any) -> float | None:
    """The bound an attention module clips its projections to (a float ``clip_qkv``: DBRX),
    or None."""
    v = getattr(attn, "clip_qkv", None)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


VALUE_SCALE_NAMES = ("v_scale", "value_scale")


def _value_scale(attn: Any) -> float:
    """The constant an attention module multiplies its values by, where it names one (a float
    attribute ``v_scale``: MiMo-V2-Flash); 1 otherwise.  The reading then reproduces the
    module's own values only with it, so a wrong one is refused there."""
    for name in VALUE_SCALE_NAMES:
        v = getattr(attn, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return 1.0


FREQ_PROBE = 64  # positions the frequencies read from a rotary module's tables must reproduce
FREQ_ULPS = 8  # how far (in units of the tables' dtype) from the estimate a frequency is sought


def _frequencies_from_tables(model: Any, match: tuple, order: str, form: str, R: int,
                             like: torch.Tensor) -> tuple[float, ...]:
    """The angular frequencies of a rotary module that keeps no ``inv_freq`` (GPT-J's and
    CodeGen's keep a table of sines and cosines): estimated from its own tables at positions 1
    and ``FREQ_PROBE - 1`` (the angle unwrapped), rounded to the tables' dtype and its nearest
    neighbours, and kept only where ``sin``/``cos`` of ``position * frequency``, computed in that
    dtype, reproduce the module's tables at every position ``0 .. FREQ_PROBE - 1`` bit for bit.
    Empty when any pair has no such frequency (the checks that need exact angles then say so)."""
    name, lt = match
    P = FREQ_PROBE
    pos = torch.arange(P)
    lk = torch.zeros(1, 1, 1, dtype=like.dtype, device=like.device)
    try:
        c, s = _table_call(model, pos, lk, name, lt, order)
    except Exception:  # noqa: BLE001 - tables this module cannot give at these positions
        return ()
    c, s = _per_pair(c.detach().cpu(), form), _per_pair(s.detach().cpu(), form)  # (P, R/2)
    dt = c.dtype
    c64, s64 = c.to(F64), s.to(F64)
    w1 = torch.atan2(s64[1], c64[1])
    th = torch.atan2(s64[P - 1], c64[P - 1])
    k = torch.round(((P - 1) * w1 - th) / (2 * math.pi))
    est = ((th + 2 * math.pi * k) / (P - 1)).to(dt)
    pf = pos.to(dt)[:, None]
    out = []
    for l in range(R // 2):
        up = down = est[l:l + 1]
        cands = [up]
        for _ in range(FREQ_ULPS):  # the estimate's neighbours in the tables' dtype, both ways
            up = torch.nextafter(up, torch.full_like(up, math.inf))
            down = torch.nextafter(down, torch.full_like(down, -math.inf))
            cands += [up, down]
        found = next((w for w in cands
                      if torch.equal(torch.cos(pf * w)[:, 0], c[:, l])
                      and torch.equal(torch.sin(pf * w)[:, 0], s[:, l])), None)
        if found is None:
            return ()
        out.append(float(found[0]))
    return tuple(out)


def _output_path(r: AttentionRecord, who: str, L: int) -> tuple[bool, str]:
    """Whether the output projection's input is the attention function's output itself
    (bit for bit, as ``reshape`` leaves it), and if not, what differs."""
    if r.output is None or r.o_in is None:
        raise UnsupportedModelError(f"{who}: layer {L}'s output projection did not run on the "
                                    "attention's output in the reading forward")
    out, o_in = r.output.reshape(-1), r.o_in.reshape(-1)
    if out.numel() == o_in.numel() and torch.equal(out, o_in):
        return True, ""
    if out.numel() != o_in.numel():
        return False, (f"the output projection reads {o_in.numel() // max(1, r.output.shape[1])}"
                       f" values per token, the heads give {r.output[0, 0].numel()}")
    rel = _rel(o_in.to("cpu", F64), out.to("cpu", F64))
    return False, ("a norm, gate or scale sits between the heads' output and the output "
                   f"projection (its input differs by {rel:.2e} relative)")


def _state(mod: Any) -> tuple:
    """What a module's behaviour depends on, cheaply: its plain attributes (by value or
    identity) and its own parameters and buffers (storage, in-place version, dtype, device)."""
    attrs = []
    for k, v in sorted(vars(mod).items()):
        if k.startswith("_"):
            continue
        attrs.append((k, v if isinstance(v, (int, float, str, bool, type(None), tuple))
                      else id(v)))
    tensors = [(k, t.data_ptr(), t._version, t.dtype, str(t.device), tuple(t.shape))
               for k, t in (*mod._parameters.items(), *mod._buffers.items()) if t is not None]
    return (type(mod), tuple(attrs), tuple(tensors))


def _fingerprint(model: Any) -> tuple:
    """The attention modules (and their children), rotary modules, modeling modules' eager
    functions, the attention implementation and the configuration (the masks a model builds --
    its window, its chunks -- follow it) -- what :func:`describe_model` reads."""
    import sys

    try:
        cfg = str(model.config.to_dict())
    except Exception:  # noqa: BLE001 -- a configuration that cannot be listed: never cached
        cfg = object()
    parts: list = [getattr(model.config, "_attn_implementation", None), model.training, cfg]
    for layer in layer_modules(model):
        parts.append(id(layer.forward) if "forward" in vars(layer) else None)
        for _, attn in attention_modules(layer):
            parts.extend(_state(m) for m in attn.modules())
            mm = sys.modules.get(type(attn).__module__)
            parts.append(id(getattr(mm, "eager_attention_forward", None)))
    parts.extend(_state(m) for _, r in rotary_modules(model) for m in r.modules())
    return tuple(parts)


def describe_model(model_or_config: Any, *, fresh: bool = False) -> ModelInfo:
    """Conventions of a model (or, from a bare config, its sizes only); with a model, every
    layer is read and checked on one short forward (:func:`read_layer`).

    The reading is kept on the model with a fingerprint of everything it read (the attention
    and rotary modules' attributes and tensors, the eager functions, the configuration); any
    change there -- or
    ``fresh=True`` -- reads again.  Whatever goes wrong inside the reading is one
    :class:`UnsupportedModelError` line naming the model and the reason (never a traceback).
    """
    config = getattr(model_or_config, "config", model_or_config)
    with adapter_errors(model_name(config), "reading the config"):
        info = check_config(config)
    if config is model_or_config:
        return info
    model = model_or_config
    if model.training:
        raise RuntimeError(f"{info.name}: call model.eval() before reading conventions (dropout)")
    with adapter_errors(info.name, "reading the attention conventions"):
        fp = _fingerprint(model)
        cached = model.__dict__.get("_ropestep_conventions")
        if not fresh and cached is not None and cached[0] == fp and cached[1].name == info.name:
            return cached[1]
        out = _read_model(model, info)
    model.__dict__["_ropestep_conventions"] = (fp, out)
    return out


def _sizes(info: ModelInfo, recs: dict[int, AttentionRecord]
           ) -> tuple[ModelInfo, dict[int, tuple[int, int, int, int]]]:
    """Head count, KV head count, head_dim and value dim from the tensors each softmax layer's
    attention function received -- not from config attributes an architecture may ignore.
    The query head count must be the same in every read layer (heads are named across layers);
    KV heads, head_dim and value dim may differ by layer (MiMo-V2-Flash, Gemma 4): the model's
    are the first read layer's, each layer's its own (:meth:`ModelInfo.for_layer`)."""
    got = {}
    for L, r in recs.items():
        if r.inline:  # heads from the probabilities it returns, their width from the output
            # projection's input; one KV head per query head and values as wide as the queries
            # (the layouts that fit an inline module; its reading proves them)
            if r.weights is None or r.weights.dim() != 4 or r.output is None:
                raise UnsupportedModelError(
                    f"{info.name}: layer {L}'s {INLINE_TEXT} returned no (batch, heads, tokens, "
                    "keys) probabilities, or its output projection did not run on its heads")
            H = int(r.weights.shape[1])
            d = int(r.output.shape[-1])
            got[L] = (H, H, d, d)
            continue
        if r.query is None or r.key is None or r.value is None or r.query.dim() != 4:
            raise UnsupportedModelError(f"{info.name}: layer {L}'s attention function was not "
                                        "given (batch, heads, tokens, dim) queries, keys, values")
        H, Hk, d, rv = (int(r.query.shape[1]), int(r.key.shape[1]), int(r.query.shape[-1]),
                        int(r.value.shape[-1]))
        if H % Hk:
            raise UnsupportedModelError(f"{info.name}: layer {L}'s attention has {Hk} KV heads "
                                        f"for {H} query heads (not a divisor)")
        if d % 2:
            raise UnsupportedModelError(f"{info.name}: RoPE needs an even head_dim, layer {L} "
                                        f"has {d}")
        got[L] = (H, Hk, d, rv)
    heads = {v[0] for v in got.values()}
    if len(heads) != 1:
        raise UnsupportedModelError(
            f"{info.name}: the softmax layers differ in query head count: "
            + ", ".join(f"layer {L} {v[0]}" for L, v in got.items()))
    H, Hk, d, r = next(iter(got.values()))
    return replace(info, n_heads=H, n_kv_heads=Hk, head_dim=d, v_dim=None if r == d else r), got


def _read_model(model: Any, info: ModelInfo) -> ModelInfo:
    n = len(layer_modules(model))
    if n != info.n_layers:  # the model's own list (LongCat's config counts two per layer)
        info = replace(info, n_layers=n)
    if model.training:
        raise RuntimeError(f"{info.name}: call model.eval() before reading conventions (dropout)")
    recs, others = probe_layers(model, PROBE_TOKENS)
    if not recs:
        L, why = next(iter(others.items()))
        raise UnsupportedModelError(
            f"{info.name}: no layer computes softmax attention the adapter can read (layer {L}: "
            f"{why})")
    if info.rope_type == "none" and not any(r.cos is not None or r.inline
                                             for r in recs.values()):
        raise _no_positions(info)  # nothing rotated nor biased: refused before any reading
    info, sizes = _sizes(info, recs)
    read: dict[int, LayerConventions] = {}
    for L, r in recs.items():
        H, Hk, d, rv = sizes[L]
        mine = replace(info, n_kv_heads=Hk, head_dim=d, v_dim=None if rv == d else rv)
        with adapter_errors(info.name, f"reading layer {L} "
                            f"({type(attention_module(layer_modules(model)[L], info.name, L)).__name__})"):
            read[L] = replace(read_layer(model, mine, L, r), sizes=sizes[L])
    layers = tuple(read.get(L) for L in range(n))
    unseen = [c for c in read.values() if max(c.window or 0, c.chunk or 0) >= PROBE_TOKENS]
    wide = max((max(c.window or 0, c.chunk or 0) for c in unseen), default=0)
    if unseen and wide <= WINDOW_PROBE_MAX:
        n2 = wide + 1
        recs2 = probe_forward(model, n2, layers=[c.layer for c in unseen],
                              keep=("key", "mask", "kwargs"))
        for c in unseen:
            got = _permitted(recs2[c.layer], n2, info.name, c.layer)
            if not torch.equal(got, _permitted_sets(n2, c.window, c.chunk)):
                named = (f"sliding_window={c.window}" if c.window is not None else "") + \
                    (" and " if c.window is not None and c.chunk is not None else "") + \
                    (f"attention_chunk_size={c.chunk}" if c.chunk is not None else "")
                raise UnsupportedModelError(
                    f"{info.name}: layer {c.layer} names {named} but its mask over {n2} tokens "
                    "is not that")
    convs = list(read.values())
    if info.rope_type == "none" and not any(c.rotary or c.alibi for c in convs):
        raise _no_positions(info)
    return replace(info, family="qknorm" if any(c.qk_norm for c in convs) else "dot",
                   qkv_bias=any(c.qkv_bias for c in convs),
                   o_bias=any(c.o_bias for c in convs), layers=layers,
                   others=tuple(others.items()),
                   rms_eps=next((c.norm_eps for c in convs if c.qk_norm), info.rms_eps))


def _no_positions(info: ModelInfo) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{info.name}: model_type={info.model_type!r} names no RoPE parameters "
        f"({', '.join(ROPE_HINTS)}) and no layer adds an ALiBi bias: not a rotary or ALiBi "
        "attention model")


def check_layer_index(info: ModelInfo, layer: int) -> int:
    """``layer`` as a valid index of a read layer: an int in range, and -- once the model is
    read -- a softmax-attention layer (a hybrid's other layers are refused, with the reason)."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if not 0 <= layer < info.n_layers:
        raise IndexError(f"{info.name}: layer {layer} out of range; valid layers are "
                         f"0..{info.n_layers - 1}")
    if info.layers and info.layers[layer] is None:
        raise UnsupportedModelError(
            f"{info.name}: layer {layer} is not softmax attention ({dict(info.others)[layer]}); "
            f"softmax-attention layers: {_ranges(info.softmax_layers)}")
    return layer


def _ranges(ls: Sequence[int]) -> str:
    """``0-3, 7, 9-11``."""
    out, run = [], []
    for L in ls:
        if run and L == run[-1] + 1:
            run.append(L)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
        run = [L]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------
# one layer's head description
# ---------------------------------------------------------------------------------------------
def _perm(conv: LayerConventions, d: int) -> torch.Tensor:
    """Head-dim order that makes the layer's rotation ropestep's: for ``half`` pairing with
    ``R < d``, the rotary halves and the pass-through halves are interleaved so that dim ``l``
    pairs with ``l + d/2`` (pass-through pairs rotate by angle 0); a layer that turns by the
    opposite angle (``sign = -1``) has each rotated pair's two dims swapped, since turning
    ``(b, a)`` by ``theta`` is turning ``(a, b)`` by ``-theta``; otherwise the identity."""
    R = conv.rotary_dim
    rev = conv.sign < 0 and R > 0  # swap each rotated pair's two dims (the opposite angle)
    if conv.pairing != "half":
        if not rev:
            return torch.arange(d)
        out = torch.arange(d)
        out[:R] = torch.arange(R).view(-1, 2).flip(-1).reshape(-1)
        return out
    if R == 0:
        return torch.arange(d)
    first, second = torch.arange(R // 2), R // 2 + torch.arange(R // 2)
    if rev:
        first, second = second, first
    P = d - R
    return torch.cat([first, R + torch.arange(P // 2), second, R + P // 2 + torch.arange(P // 2)])


def rope_tables(model: Any, n_positions: int, layer: int = 0, *,
                info: ModelInfo | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own RoPE tables of ``layer`` for positions ``0..n_positions-1`` as ropestep's
    ``(P, d/2)`` unit tables (cos, sin), in the model's dtype on the CPU.

    They come from the rotary call that reproduced the layer's tables (any ``rope_type``), run on
    the model's device and dtype as a forward does; the amplitude ``a`` is divided out (it is in
    the score scale), and pass-through pairs of a partial rotary are ``(1, 0)``.
    """
    info = info if info is not None and info.layers else describe_model(model)
    check_layer_index(info, layer)
    info = info.for_layer(layer)
    if n_positions < 1:
        raise ValueError(f"n_positions must be >= 1, got {n_positions}")
    conv = info.layers[layer]
    p = next(model.parameters())
    h = info.head_dim // 2
    if conv.rotary is None:
        one = torch.ones(n_positions, h, dtype=p.dtype)
        return one, torch.zeros_like(one)
    c, s = layer_tables(model, conv, torch.arange(n_positions))
    c, s = c.detach().cpu(), s.detach().cpu()
    R = conv.rotary_dim
    width = R // 2 if conv.tables == "single" else R
    if tuple(c.shape) != (n_positions, width):
        raise UnsupportedModelError(
            f"{info.name}: layer {layer} rotary call returned cos of shape {tuple(c.shape)}")
    if conv.tables != "single" and (conv.tables, R) not in _table_forms(c, s, info.head_dim):
        raise UnsupportedModelError(f"{info.name}: layer {layer} rotary tables are no longer "
                                    f"stored as {conv.tables} at {n_positions} positions")
    c, s = _per_pair(c, conv.tables), _per_pair(s, conv.tables)
    if conv.amplitude != 1.0:
        c, s = (c.double() / conv.amplitude).to(p.dtype), (s.double() / conv.amplitude).to(p.dtype)
    pad = h - R // 2
    if pad:
        c = torch.cat([c, torch.ones(n_positions, pad, dtype=c.dtype)], -1)
        s = torch.cat([s, torch.zeros(n_positions, pad, dtype=s.dtype)], -1)
    return c.contiguous(), s.contiguous()


def layer_head(model: Any, layer: int, n_positions: int, *, dtype: torch.dtype = torch.float64,
               device: str | torch.device = "cpu", info: ModelInfo | None = None
               ) -> tuple[HeadSpec, HeadWeights]:
    """Head description of decoder layer ``layer``: all its heads, math layout, model's tables.

    Weights go from ``nn.Linear`` layout ``(out, in)`` (``y = x W^T + b``) to ``w_q: (m, H, d)``,
    ``b_q: (H, d)``, ``w_k``/``w_v``: ``(m, H_kv, d)``, ``w_o: (H, r, hidden)``, ``b_o:
    (hidden,)`` (``None`` where the model has no bias), as ``dtype`` tensors on ``device``
    (float64 by default: the conversion from the model's weights is exact), in the head-dim
    order of :func:`_perm` (partial rotary).  Where a norm or gate sits between the heads and the
    output projection (``conv.output_direct`` False: BitNet, Qwen3-Next) ``w_o`` is the identity
    on the concatenated heads ``(H, r, H r)`` and ``b_o`` None: the write is taken in head space
    (:func:`ropestep.models.capture` then gives the concatenated heads as the write ``o``).
    RoPE: :func:`rope_tables`; the score scale is the
    layer's ``scaling`` times ``a^2``; soft-capping, the sliding window (``spec.window``:
    keys at distance ``>= window`` leave every permitted set) and chunked attention
    (``spec.chunk``: keys outside the query's chunk leave it) as the layer's; attention sinks
    (``spec.sinks``) are the module's own logits, read from the parameter its eager call is
    handed.
    """
    info = info if info is not None and info.layers else describe_model(model)
    check_layer_index(info, layer)
    info = info.for_layer(layer)
    conv = info.layers[layer]
    who = info.name
    attn = attention_module(layer_modules(model)[layer], who, layer)
    if conv.layout == "latent":
        with onloaded(attn):
            return _latent_head(model, info, conv, attn, n_positions, dtype, device)
    H, Hk, d, r = info.n_heads, info.n_kv_heads, info.head_dim, info.r
    m = conv.input_dim or info.hidden  # Zamba 2's attention reads [h; embeddings]: 2 hidden
    with onloaded(attn):  # offloaded weights (accelerate) are read in, for this layer only
        parts = layout_candidates(attn, H, Hk, d, r)[conv.layout]
        _, out = output_projection(attn, who, layer)
        cos, sin = rope_tables(model, n_positions, layer, info=info)
        perm = _perm(conv, d)

        def w(part: tuple, heads: int, dim: int, rotated: bool) -> torch.Tensor:
            wt = part[0].detach().T.reshape(m, heads, dim)  # (out, in) -> (m, heads, dim)
            if rotated:
                wt = wt[..., perm]
            return wt.to(device=device, dtype=dtype).contiguous()

        def b(part: tuple, heads: int, dim: int, rotated: bool) -> torch.Tensor | None:
            if part[1] is None:
                return None
            bt = part[1].detach().reshape(heads, dim)
            if rotated:
                bt = bt[..., perm]
            return bt.to(device=device, dtype=dtype).contiguous()

        direct = conv.output_direct
        weights = HeadWeights(
            w_q=w(parts["q"], H, d, True), w_k=w(parts["k"], Hk, d, True),
            w_v=w(parts["v"], Hk, r, False) * conv.value_scale,
            b_q=b(parts["q"], H, d, True), b_k=b(parts["k"], Hk, d, True),
            b_v=(None if parts["v"][1] is None else
                 b(parts["v"], Hk, r, False) * conv.value_scale),
            # W_o where its input is the heads' output; where a norm or gate sits in between,
            # the write is taken in head space: W_o the identity on the concatenated heads
            w_o=(out.weight.detach().T.reshape(H, r, -1).to(device=device, dtype=dtype)
                 .contiguous() if direct else
                 torch.eye(H * r, dtype=dtype, device=device).reshape(H, r, H * r)),
            b_o=(out.bias.detach().to(device=device, dtype=dtype)
                 if direct and out.bias is not None else None),
        )
        norm_eps = 1e-6
        if conv.qk_norm:
            full = conv.norm_scope == "all"
            qn, kn = qk_norms(attn)
            gq, _, kq, bq = _qk_norm_reading(qn, H * d if full else d,
                                             f"{who}: layer {layer} q norm")
            gk, _, kk, bk = _qk_norm_reading(kn, Hk * d if full else d,
                                             f"{who}: layer {layer} k norm")
            if (kq, kk) != (conv.norm_kind,) * 2:
                raise UnsupportedModelError(f"{who}: layer {layer}'s q/k norms read as {kq}/{kk}, "
                                            f"described as {conv.norm_kind}")
            if full:
                gq, gk = gq.view(H, d), gk.view(Hk, d)
            weights.q_norm = gq[..., perm].to(device=device, dtype=dtype)
            weights.k_norm = gk[..., perm].to(device=device, dtype=dtype)
            if conv.norm_kind == "layer":  # LayerNorm's bias, in the same head-dim order
                weights.q_norm_bias = bq[..., perm].to(device=device, dtype=dtype)
                weights.k_norm_bias = bk[..., perm].to(device=device, dtype=dtype)
            norm_eps = conv.norm_eps
    freqs = None  # the rotary module's own frequencies (0 on pass-through pairs)
    if conv.rotary_dim == 0 or conv.inv_freq:
        freqs = tuple(conv.inv_freq) + (0.0,) * (d // 2 - len(conv.inv_freq))
    spec = HeadSpec(
        sinks=_sinks(attn, conv), clip=conv.clip, norm_after_rope=conv.norm_after_rope,
        n_heads=H, n_kv_heads=Hk, head_dim=d,
        v_dim=None if r == d else r,
        rope=RoPESpec(base=info.rope_theta if math.isfinite(info.rope_theta) else 10000.0,
                      layout="half" if conv.pairing == "half" else "interleaved",
                      cos=cos.to(dtype), sin=sin.to(dtype), freqs=freqs),
        family="qknorm" if conv.qk_norm else "dot", scale=conv.score_scale,
        softcap=conv.softcap, norm_eps=norm_eps, window=conv.window, chunk=conv.chunk,
        alibi_slopes=tuple(conv.alibi) if conv.alibi else None,
        query_temperature=tuple(conv.temperature) if conv.temperature else None,
        norm_scope=conv.norm_scope if conv.qk_norm else "head",
        norm_kind=conv.norm_kind if conv.qk_norm else "rms")
    weights.check(spec, m)
    return spec, weights


@dataclass(frozen=True)
class OutputGate:
    """A layer's output gate, as read (:attr:`LayerConventions.output_gate`): the model's write
    of a token is ``sum_h (act(x W_g[:, h] + b_g[h]) * y_h) W_o[h] + b_o`` with ``y_h`` the
    heads' output.  ``w_g (m, H, r)``, ``b_g (H, r)`` or None, ``w_o (H, r, hidden)``, ``b_o
    (hidden,)`` or None (float64 unless asked otherwise)."""

    kind: str  # "sigmoid"
    w_g: torch.Tensor
    b_g: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None

    def write(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(Q, hidden)``: the gated write of heads' outputs ``y (H, Q, r)`` of inputs ``x (Q,
        m)``, in ``y``'s dtype and device."""
        dt, dev = y.dtype, y.device
        g = torch.einsum("qm,mhr->hqr", x.to(dev, dt), self.w_g.to(dev, dt))
        if self.b_g is not None:
            g = g + self.b_g.to(dev, dt)[:, None]
        o = torch.einsum("hqr,hrd->qd", torch.sigmoid(g) * y, self.w_o.to(dev, dt))
        return o if self.b_o is None else o + self.b_o.to(dev, dt)


def layer_gate(model: Any, layer: int, *, dtype: torch.dtype = torch.float64,
               info: ModelInfo | None = None) -> OutputGate | None:
    """The output gate of decoder layer ``layer`` where one was read and proven on its tensors
    (:attr:`LayerConventions.output_gate`), else None."""
    info = info if info is not None and info.layers else describe_model(model)
    check_layer_index(info, layer)
    info = info.for_layer(layer)
    conv = info.layers[layer]
    if not conv.output_gate:
        return None
    H, r, m = info.n_heads, info.r, conv.input_dim or info.hidden
    attn = attention_module(layer_modules(model)[layer], info.name, layer)
    with onloaded(attn):
        W, b = layout_candidates(attn, H, info.n_kv_heads, info.head_dim, r)[conv.layout]["g"]
        _, out = output_projection(attn, info.name, layer)
        return OutputGate(
            kind=conv.output_gate,
            w_g=W.detach().T.reshape(m, H, r).to("cpu", dtype).contiguous(),
            b_g=None if b is None else b.detach().reshape(H, r).to("cpu", dtype).contiguous(),
            w_o=out.weight.detach().T.reshape(H, r, -1).to("cpu", dtype).contiguous(),
            b_o=None if out.bias is None else out.bias.detach().to("cpu", dtype))


def _sinks(attn: Any, conv: LayerConventions) -> tuple[float, ...] | None:
    """The layer's sink logits (its module's own parameter, read), or None without sinks."""
    if not conv.sinks:
        return None
    with onloaded(attn):
        t = getattr(attn, conv.sink_param).detach().to("cpu", torch.float64).reshape(-1)
    return tuple(float(v) for v in t)


def _latent_head(model: Any, info: ModelInfo, conv: LayerConventions, attn: Any,
                 n_positions: int, dtype: torch.dtype, device: Any) -> tuple[HeadSpec, HeadWeights]:
    """The absorbed form of a latent attention layer (docs/math.md section 14) as a
    ``"latent"`` head description: per head ``h`` the query map ``[W_rope,h[Pi]; W_uk,h^T
    W_nope,h]`` (the rotated dims in ropestep's adjacent-pair order ``Pi``, then the latent), the
    shared key ``[x W_kr[Pi] + b; kv_norm * RMS(x W_kc + b)]``, the value map ``W_uv,h``, the query
    latent and its norm where the model has one; the model's own tables on the rotated pairs
    and angle 0 on the latent ones.  The absorbed query map is a float64 product of the model's
    ``q`` and ``kv_b`` weights (the only step that is not an exact copy of a weight); the score
    scale is the module's ``scaling`` (YaRN's mscale in it), and a table amplitude ``a`` != 1
    multiplies the query's rotated columns by ``a^2`` (it turns those dims only)."""
    H, d, r = info.n_heads, info.head_dim, info.r
    who, L = info.name, conv.layer
    rank, rope, nope, q_rank, kv_eps, q_eps, pre = conv.latent
    P = _latent_parts(attn, H, d, r, who, L)
    f64 = torch.float64
    Pi = latent_rope_order(conv.pairing, pre, rope)

    def t(w: Any) -> torch.Tensor | None:
        return None if w is None else w.detach().to("cpu", f64)

    Wq = t(P["q"].weight).view(H, d, -1)  # (H, nope + rope, q_in)
    bq = t(P["q"].bias)
    bq = None if bq is None else bq.view(H, d)
    kvb = t(P["kvb"].weight).view(H, nope + r, rank)
    Wuk, Wuv = kvb[:, :nope], kvb[:, nope:]  # (H, nope, rank), (H, r, rank)
    bkvb = t(P["kvb"].bias)
    if bkvb is not None and bool((bkvb.view(H, nope + r)[:, :nope] != 0).any()):
        raise UnsupportedModelError(f"{who}: layer {L}: kv_b_proj has a key bias, which the "
                                    "absorbed form does not carry")
    # the tables' amplitude a (YaRN, LongRoPE) turns only the rotated dims: a^2 goes into the
    # query's rotated columns, not into the score scale every dim shares (docs/math.md s. 14)
    a2 = conv.amplitude ** 2
    w_q = torch.cat([Wq[:, nope:][:, Pi].transpose(1, 2) * a2,  # (H, q_in, rope)
                     Wq[:, :nope].transpose(1, 2) @ Wuk], -1)  # (H, q_in, rank)
    b_q = None if bq is None else torch.cat(
        [bq[:, nope:][:, Pi] * a2, (Wuk.transpose(1, 2) @ bq[:, :nope, None])[..., 0]], -1)
    kva_w, kva_b = t(P["kva"].weight), t(P["kva"].bias)
    g_kv, _ = _norm_weight(P["knorm"], rank, f"{who}: layer {L} kv_a_layernorm")
    kw = {}
    if q_rank:
        g_q, _ = _norm_weight(P["qnorm"], q_rank, f"{who}: layer {L} q_a_layernorm")
        kw = {"w_qa": t(P["qa"].weight).T, "b_qa": t(P["qa"].bias), "qa_norm": g_q}
    out = output_projection(attn, who, L)[1]
    dev = {"device": device, "dtype": dtype}

    def put(x: Any) -> Any:
        return None if x is None else x.to(**dev).contiguous()

    weights = HeadWeights(
        w_q=put(w_q.permute(1, 0, 2)), w_k=None, w_v=None, b_q=put(b_q),
        w_kr=put(kva_w[rank:][Pi].T), b_kr=put(None if kva_b is None else kva_b[rank:][Pi]),
        w_kc=put(kva_w[:rank].T), b_kc=put(None if kva_b is None else kva_b[:rank]),
        kv_norm=put(g_kv), w_uv=put(Wuv.permute(2, 0, 1)),
        b_uv=put(None if bkvb is None else bkvb.view(H, nope + r)[:, nope:]),
        **{k: put(v) for k, v in kw.items()},
        w_o=(put(out.weight.detach().T.reshape(H, r, -1)) if conv.output_direct else
             torch.eye(H * r, **dev).reshape(H, r, H * r)),
        b_o=put(out.bias.detach()) if conv.output_direct and out.bias is not None else None)
    c, s_ = layer_tables(model, conv, torch.arange(n_positions))
    c = _per_pair(c.detach().to("cpu", f64), conv.tables) / conv.amplitude
    s_ = _per_pair(s_.detach().to("cpu", f64), conv.tables) / conv.amplitude
    pad = rank // 2
    p_dtype = next(model.parameters()).dtype
    cos = torch.cat([c, torch.ones(n_positions, pad, dtype=f64)], -1).to(p_dtype)
    sin = torch.cat([s_, torch.zeros(n_positions, pad, dtype=f64)], -1).to(p_dtype)
    freqs = tuple(conv.inv_freq) + (0.0,) * pad if len(conv.inv_freq) == rope // 2 else None
    if freqs is None:
        raise UnsupportedModelError(f"{who}: layer {L}: the rotary module has no inv_freq of "
                                    f"{rope // 2} frequencies")
    spec = HeadSpec(
        n_heads=H, n_kv_heads=H, head_dim=rope + rank, v_dim=None if r == rope + rank else r,
        rope=RoPESpec(base=info.rope_theta if math.isfinite(info.rope_theta) else 10000.0,
                      layout="interleaved", cos=cos.to(dtype), sin=sin.to(dtype), freqs=freqs),
        family="latent", scale=conv.scaling, softcap=conv.softcap, window=conv.window,
        chunk=conv.chunk,
        latent=LatentSpec(rank, rope, q_rank or None, kv_eps, q_eps), sinks=_sinks(attn, conv))
    weights.check(spec, int(kva_w.shape[1]))
    return spec, weights
