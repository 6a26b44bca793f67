"""Attention-variant modules and the suite run on their heads (docs/math.md section 11).

Three causal RoPE-softmax attention variants as PyTorch modules, a small GPT built from them, a
replacement of the attention of Hugging Face Llama/Qwen2 models, and :func:`check_module`, which
runs the identity, the gradient step, frozen reuse and the cosine bound on every head of a module
against the module's *own* forward -- the native check of the cosine and per-head-base
conventions of :mod:`ropestep.spec`.

Variants (``variant=``):

* ``"standard"``: ``s = q~ k~^T / sqrt(d)`` (GQA, optional q/k/v biases), spec family ``"dot"``;
* ``"cosine"``: whole-head unit vectors ``q^ = q/||q||``, ``k^ = k/||k||``, rotated,
  ``s = q^ R(p_j - p_i) k^^T / tau_h`` with ``tau_h = exp(log_tau_h)`` learned per head
  (initial value ``tau_init``, default ``sqrt(d)``), spec family ``"cosine"``;
* ``"perhead"``: ``"standard"`` with one RoPE base per head, ``base_h = exp(clamp(log_base_h,
  log b_min, log b_max))`` (default range ``[1e3, 1e6]``), initialised by the barycenter of the
  head's W_q/W_k (:meth:`RoPEAttention.init_bases_from_barycenter`, docs/math.md section 10);
  frequencies ``omega_l = base_h^(-2l/d)``, pair ``l = 0`` the fastest.

Public API
----------
``VARIANTS``
    ``("standard", "cosine", "perhead")``.
``AttentionConfig(d_model, n_heads, n_kv_heads=None, head_dim=None, variant="standard",
qkv_bias=False, o_bias=False, rope_base=10000.0, layout="half", tau_init=None,
base_range=(1e3, 1e6), attn_impl="math")``
    Sizes and variant of one attention layer (validated on construction).
``RoPEAttention(config, *, q_proj=None, k_proj=None, v_proj=None, o_proj=None, tables=None)``
    ``forward(x, positions=None, mask=None, return_heads=False)`` -> ``(B, T, d_model)`` (and the
    per-head outputs ``(B, H, T, r)`` before ``o_proj`` with ``return_heads=True``);
    ``head_outputs(x, positions=None, mask=None)``; ``head_description(dtype=torch.float64,
    n_positions=None) -> (HeadSpec, HeadWeights)``; ``temperatures()``, ``set_temperatures(tau)``
    (cosine); ``bases()``, ``frequencies()``, ``set_bases(bases)``,
    ``init_bases_from_barycenter()`` (perhead).
``GPTConfig(vocab_size=50257, n_layers=3, n_heads=4, d_model=128, seq_len=128, ...)``,
``GPT(config)``
    ``forward(idx, positions=None) -> logits``; ``lm_loss(idx)`` (next-token cross entropy);
    ``capture(idx, positions=None) -> GPTCapture`` (logits and, per layer, the attention input
    after the block's input norm and the per-head outputs: :class:`LayerCapture`).
``replace_attention(model, variant, *, tau_init=None, base_range=(1e3, 1e6),
use_model_tables=True) -> list[HFAttention]``
    Swap every decoder layer's ``self_attn`` of a HF Llama/Qwen2 model for the variant, reusing
    the original q/k/v/o ``nn.Linear`` modules; :class:`HFAttention` (a :class:`RoPEAttention`)
    keeps the HF forward signature ``forward(hidden_states, position_embeddings,
    attention_mask, cache=None, **kwargs) -> (attn_output, attn_weights)``.
``check_module(module, x, positions=None, *, n_reuse=4, float32=True) -> dict``
    The suite on every head of one module (see its docstring); ``check_gpt(model, idx,
    positions=None, **kw) -> dict`` runs it on every layer of a :class:`GPT`.
``check_frequency_ordering(head_dim=8, layout="half", base_range=(1e3, 1e6)) -> dict``
    The documented orientation: ``omega_l`` decreasing, barycenter 0 for a head living in pair
    0 and 1 in the last pair, and the initialiser mapping them to ``b_min`` / ``b_max``.
``cosine_bound_ratio(y, mu, v, mask) -> (H, Q)``, ``cosine_bound(tau) -> e^{2/tau} - 1``
    ``||y_i - mu_i|| / max_j ||v_j - mu_i||``, the quantity of the cosine bound, and the bound.
``RMSNorm``, ``Block``, ``LayerCapture``, ``GPTCapture``
    The GPT's parts and its capture records.

Layer: model plumbing (beside :mod:`ropestep.models`); ``transformers`` is imported lazily, only
inside :func:`replace_attention`.  Tolerances come from :mod:`ropestep.tolerances`; verdicts
never pass a NaN (:mod:`ropestep.verdict`).
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import fast, kernel, rope, scale
from . import tolerances as tl
from .spec import HeadSpec, HeadWeights, RoPESpec
from .verdict import Failure, worst

VARIANTS = ("standard", "cosine", "perhead")
LAYOUTS = ("half", "interleaved")
ATTN_IMPLS = ("math", "sdpa")


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionConfig:
    """Sizes and variant of one attention layer (docs/math.md section 11).

    ``n_kv_heads`` defaults to ``n_heads`` (no GQA), ``head_dim`` to ``d_model // n_heads``,
    ``tau_init`` (cosine) to ``sqrt(head_dim)``.  ``rope_base`` is the base of the standard and
    cosine variants and the starting point of the per-head bases before the barycenter
    initialiser.  ``attn_impl``: ``"math"`` (explicit softmax, returns the weights) or
    ``"sdpa"`` (``F.scaled_dot_product_attention``, for training).
    """

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    variant: str = "standard"
    qkv_bias: bool = False
    o_bias: bool = False
    rope_base: float = 10000.0
    layout: str = "half"
    tau_init: float | None = None
    base_range: tuple[float, float] = (1e3, 1e6)
    attn_impl: str = "math"

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"AttentionConfig.{name} must be an int >= 1, got {v!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown attention variant {self.variant!r}: one of {VARIANTS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"RoPE layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"GQA: n_kv_heads={self.kv_heads} must divide n_heads={self.n_heads}")
        d = self.dim
        if d < 2 or d % 2:
            raise ValueError(f"RoPE needs an even head_dim >= 2, got {d}")
        if self.variant == "perhead" and d < 4:
            raise ValueError(f"per-head bases need head_dim >= 4 (two RoPE pairs), got {d}")
        if not (math.isfinite(float(self.rope_base)) and float(self.rope_base) > 0):
            raise ValueError(f"rope_base must be finite and > 0, got {self.rope_base}")
        if self.tau_init is not None and not (math.isfinite(float(self.tau_init))
                                              and float(self.tau_init) > 0):
            raise ValueError(f"tau_init must be finite and > 0, got {self.tau_init}")
        lo, hi = (float(b) for b in self.base_range)
        if not (0.0 < lo <= hi and math.isfinite(hi)):
            raise ValueError(f"base_range must satisfy 0 < b_min <= b_max < inf, got "
                             f"{self.base_range}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else int(self.n_kv_heads)

    @property
    def dim(self) -> int:
        if self.head_dim is not None:
            return int(self.head_dim)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                             "give head_dim")
        return self.d_model // self.n_heads

    @property
    def tau0(self) -> float:
        return math.sqrt(self.dim) if self.tau_init is None else float(self.tau_init)


# ---------------------------------------------------------------------------------------------
# the attention module
# ---------------------------------------------------------------------------------------------
def _linear(fan_in: int, fan_out: int, bias: bool, given: nn.Linear | None, name: str
            ) -> nn.Linear:
    if given is None:
        return nn.Linear(fan_in, fan_out, bias=bias)
    if not isinstance(given, nn.Linear):
        raise TypeError(f"{name} must be an nn.Linear, got {type(given).__name__}")
    if (given.in_features, given.out_features) != (fan_in, fan_out):
        raise ValueError(f"{name} must map {fan_in} -> {fan_out} features, got "
                         f"{given.in_features} -> {given.out_features}")
    return given


def _set_log(param: torch.Tensor, values: Any, n: int, what: str) -> None:
    """``param <- log(values)`` for a per-head log-parametrised quantity (one value or ``n``),
    each finite and > 0."""
    v = torch.as_tensor(values, dtype=torch.float64).expand(n)
    if not bool(torch.isfinite(v).all() and (v > 0).all()):
        raise ValueError(f"{what} must be finite and > 0, got {v.tolist()}")
    param.copy_(torch.log(v).to(param.dtype))


class RoPEAttention(nn.Module):
    """Causal RoPE-softmax attention, one of :data:`VARIANTS` (docs/math.md section 11).

    Projections are ``nn.Linear`` modules (``q = x W^T + b``; pass existing ones to share them).
    ``tables`` (optional, not for ``"perhead"``): a callable ``tables(positions (B', T) int64,
    dtype, device) -> (cos, sin)`` of shape ``(B', T, d/2)`` that replaces the analytic rotation
    (a Hugging Face model's own float32 tables, see :func:`replace_attention`).

    The analytic rotation is ``rope.rope_cos_sin``'s: angles ``p * omega_l`` in float64, rounded
    once to the module's dtype, so a float64 module rotates bit for bit as the suite does.
    The score scale is evaluated in float64 too (``1/sqrt(d)`` or ``1/tau_h``) and rounded once.
    """

    def __init__(self, config: AttentionConfig, *, q_proj: nn.Linear | None = None,
                 k_proj: nn.Linear | None = None, v_proj: nn.Linear | None = None,
                 o_proj: nn.Linear | None = None,
                 tables: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        super().__init__()
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        if tables is not None and config.variant == "perhead":
            raise ValueError("per-head bases replace the rotation: they cannot use a model's "
                             "precomputed cos/sin tables")
        self.config = config
        self.variant = config.variant
        self.d_model, self.n_heads = config.d_model, config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = d = config.dim
        self.group = self.n_heads // self.n_kv_heads
        self.layout = config.layout
        self.rope_base = float(config.rope_base)
        self.base_range = (float(config.base_range[0]), float(config.base_range[1]))
        H, Hk, m = self.n_heads, self.n_kv_heads, self.d_model
        self.q_proj = _linear(m, H * d, config.qkv_bias, q_proj, "q_proj")
        self.k_proj = _linear(m, Hk * d, config.qkv_bias, k_proj, "k_proj")
        self.v_proj = _linear(m, Hk * d, config.qkv_bias, v_proj, "v_proj")
        self.o_proj = _linear(H * d, m, config.o_bias, o_proj, "o_proj")
        self._tables = tables
        dt = self.q_proj.weight.dtype
        if self.variant == "cosine":
            self.log_tau = nn.Parameter(torch.full((H,), math.log(config.tau0), dtype=dt))
        if self.variant == "perhead":
            lo, hi = self.base_range
            b0 = min(max(self.rope_base, lo), hi)
            self.log_base = nn.Parameter(torch.full((H,), math.log(b0), dtype=dt))
            self.init_bases_from_barycenter()

    # -- learned quantities -----------------------------------------------------------------
    def temperatures(self) -> torch.Tensor:
        """``tau_h = exp(log_tau_h)`` in float64, ``(H,)`` (cosine variant)."""
        if self.variant != "cosine":
            raise ValueError(f"variant {self.variant!r} has no temperature (cosine only)")
        return torch.exp(self.log_tau.double())

    @torch.no_grad()
    def set_temperatures(self, tau: Any) -> None:
        """Set ``log_tau = log(tau)`` (one value or one per head, each finite and > 0)."""
        if self.variant != "cosine":
            raise ValueError(f"variant {self.variant!r} has no temperature (cosine only)")
        _set_log(self.log_tau, tau, self.n_heads, "temperatures")

    def bases(self) -> torch.Tensor:
        """RoPE base per query head in float64, ``(H,)``: ``exp(clamp(log_base, log b_min,
        log b_max))`` for ``"perhead"``, else ``rope_base`` repeated."""
        if self.variant == "perhead":
            lo, hi = self.base_range
            return torch.exp(torch.clamp(self.log_base.double(), math.log(lo), math.log(hi)))
        return torch.full((self.n_heads,), self.rope_base, dtype=torch.float64)

    @torch.no_grad()
    def set_bases(self, bases: Any) -> None:
        """Set the per-head bases (``"perhead"``; values outside ``base_range`` are clamped when
        used, as the learned ones are)."""
        if self.variant != "perhead":
            raise ValueError(f"variant {self.variant!r} has one base, not one per head")
        _set_log(self.log_base, bases, self.n_heads, "RoPE bases")

    def frequencies(self) -> torch.Tensor:
        """``omega_{h,l} = base_h^(-2l/d)``, float64 ``(H, d/2)``: decreasing in ``l``,
        ``omega_{h,0} = 1`` (docs/math.md section 10)."""
        ell = torch.arange(self.head_dim // 2, dtype=torch.float64)
        return self.bases()[:, None] ** (-2.0 * ell / self.head_dim)

    def head_weights(self, h: int, dtype: torch.dtype = torch.float64
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``h``'s ``W_q`` and ``W_k`` (its KV head's) in math layout ``(m, d)``."""
        d = self.head_dim
        g = h // self.group
        wq = self.q_proj.weight.detach()[h * d:(h + 1) * d].to(dtype).T
        wk = self.k_proj.weight.detach()[g * d:(g + 1) * d].to(dtype).T
        return wq, wk

    @torch.no_grad()
    def init_bases_from_barycenter(self) -> torch.Tensor:
        """Per-head bases from the barycenter initialiser (docs/math.md sections 10 and 11):
        ``t_h = rope.barycenter(W_q^h, W_k^h)``, ``base_h = rope.barycenter_base(t_h, b_min,
        b_max)``.  Sets ``log_base`` and returns the barycenters ``t`` (float64, ``(H,)``)."""
        if self.variant != "perhead":
            raise ValueError(f"variant {self.variant!r} has no per-head bases")
        lo, hi = self.base_range
        ts = []
        for h in range(self.n_heads):
            wq, wk = self.head_weights(h)
            ts.append(rope.barycenter(wq, wk, self.layout))
        b = torch.tensor([rope.barycenter_base(t, lo, hi) for t in ts], dtype=torch.float64)
        self.log_base.copy_(torch.log(b).to(self.log_base.dtype))
        return torch.tensor(ts, dtype=torch.float64)

    # -- the pieces of the forward (mutation tests override single ones) ----------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, d).transpose(1, 2)
        return q, k, v

    def _normalise(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine variant: the whole head vector to unit L2 norm (a zero vector stays 0)."""
        if self.variant != "cosine":
            return q, k
        tiny = torch.finfo(q.dtype).tiny
        qn = torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min(tiny)
        kn = torch.linalg.vector_norm(k, dim=-1, keepdim=True).clamp_min(tiny)
        return q / qn, k / kn

    def _rotation_frequencies(self) -> torch.Tensor:
        """``omega`` the forward rotates with, float64 ``(Hb, d/2)`` (``Hb`` = 1 or H)."""
        if self.variant == "perhead":
            return self.frequencies()
        return rope.rope_frequencies(self.rope_base, self.head_dim)[None]

    def _cos_sin(self, pos: torch.Tensor, dtype: torch.dtype, device: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape ``(B', Hb, T, d/2)`` for positions ``pos (B', T)``."""
        if self._tables is not None:
            cos, sin = self._tables(pos, dtype, device)
            return cos[:, None].to(dtype), sin[:, None].to(dtype)
        om = self._rotation_frequencies().to(device)
        ang = pos.to(torch.float64)[:, None, :, None] * om[None, :, None, :]
        return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope.apply_rope(x, cos, sin, self.layout)

    def _score_scale(self, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """Multiplier of ``q~ . k~`` per head, ``(H,)``: ``1/sqrt(d)`` or ``1/tau_h``."""
        if self.variant == "cosine":
            return (1.0 / self.temperatures()).to(device=device, dtype=dtype)
        return torch.full((self.n_heads,), 1.0 / math.sqrt(self.head_dim), dtype=dtype,
                          device=device)

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """KV heads to query heads (``h // group``, Hugging Face ``repeat_kv``)."""
        return t if self.group == 1 else t.repeat_interleave(self.group, dim=1)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   allowed: torch.Tensor | None, additive: torch.Tensor | None = None,
                   want_probs: bool = False, fill: float = -math.inf
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Softmax attention of rotated ``q (B,H,T,d)`` over ``k, v (B,H,L,.)``; scores off the
        boolean ``allowed`` mask are set to ``fill`` (``-inf``: weight exactly 0)."""
        sc = self._score_scale(q.dtype, q.device)
        if self.config.attn_impl == "sdpa" and not want_probs:
            m = allowed if additive is None else additive
            out = F.scaled_dot_product_attention(q * sc[:, None, None], k, v, attn_mask=m,
                                                 scale=1.0)
            return out, None
        s = (q @ k.transpose(-1, -2)) * sc[:, None, None]
        if additive is not None:
            s = s + additive
        if allowed is not None:
            s = s.masked_fill(~allowed, fill)
        sd = torch.promote_types(s.dtype, torch.float32)
        p = torch.softmax(s.to(sd), dim=-1).to(q.dtype)
        return p @ v, p

    # -- forward -------------------------------------------------------------------------------
    def _check_x(self, x: Any) -> torch.Tensor:
        if not torch.is_tensor(x):
            raise TypeError(f"x must be a torch tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (batch, tokens, {self.d_model}), got "
                             f"{tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"x must be floating point, got dtype {x.dtype}")
        if x.shape[1] < 1:
            raise ValueError("x has no tokens")
        return x

    def _positions(self, positions: Any, B: int, T: int, device: Any) -> torch.Tensor:
        if positions is None:
            return torch.arange(T, device=device)[None]
        p = torch.as_tensor(positions, device=device)
        if p.is_floating_point() or p.dtype == torch.bool:
            raise ValueError(f"positions must be integers, got dtype {p.dtype}")
        p = p.to(torch.int64)
        if p.dim() == 1:
            p = p[None]
        if p.dim() != 2 or p.shape[1] != T or p.shape[0] not in (1, B):
            raise ValueError(f"positions must have shape ({T},) or ({B}, {T}), got "
                             f"{tuple(torch.as_tensor(positions).shape)}")
        return p

    def _mask(self, mask: Any, pos: torch.Tensor, B: int, T: int, device: Any) -> torch.Tensor:
        """Boolean ``(B', 1, T, T)``: the given permitted sets, or causal by position."""
        if mask is None:
            return (pos[:, None, :] <= pos[:, :, None])[:, None]
        mk = torch.as_tensor(mask, device=device)
        if mk.dtype != torch.bool:
            raise ValueError(f"mask must be boolean (True = key permitted), got {mk.dtype}")
        if mk.dim() == 2:
            mk = mk[None]
        if mk.dim() != 3 or mk.shape[1:] != (T, T) or mk.shape[0] not in (1, B):
            raise ValueError(f"mask must have shape ({T}, {T}) or ({B}, {T}, {T}), got "
                             f"{tuple(torch.as_tensor(mask).shape)}")
        if not bool(mk.any(-1).all()):
            raise ValueError("mask: some query attends to no key (empty permitted set)")
        return mk[:, None]

    def _core(self, x: torch.Tensor, positions: Any, mask: Any, want_probs: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self._check_x(x)
        B, T, _ = x.shape
        pos = self._positions(positions, B, T, x.device)
        allowed = self._mask(mask, pos, B, T, x.device)
        q, k, v = self._project(x)
        q, k = self._normalise(q, k)
        cos, sin = self._cos_sin(pos, q.dtype, q.device)
        q = self._rotate(q, cos, sin)
        if cos.shape[1] == 1:
            k = self._expand_kv(self._rotate(k, cos, sin))
        else:  # per-head bases: the keys of one KV head are rotated per query head
            k = self._rotate(self._expand_kv(k), cos, sin)
        return self._attention(q, k, self._expand_kv(v), allowed, want_probs=want_probs)

    def head_outputs(self, x: torch.Tensor, positions: Any = None, mask: Any = None
                     ) -> torch.Tensor:
        """Per-head softmax outputs ``(B, H, T, r)`` (the ``o_proj`` input), causal by position
        unless ``mask`` (boolean ``(T, T)`` or ``(B, T, T)``, True = permitted) is given."""
        return self._core(x, positions, mask)[0]

    def forward(self, x: torch.Tensor, positions: Any = None, mask: Any = None,
                return_heads: bool = False):
        """``x (B, T, d_model)`` -> ``(B, T, d_model)``; with ``return_heads=True`` also the
        per-head outputs ``(B, H, T, r)`` before ``o_proj``.  ``positions``: ``(T,)`` or
        ``(B, T)`` integers (default ``0..T-1``)."""
        heads, _ = self._core(x, positions, mask)
        B, H, T, r = heads.shape
        out = self.o_proj(heads.transpose(1, 2).reshape(B, T, H * r))
        return (out, heads) if return_heads else out

    # -- the suite's description -----------------------------------------------------------------
    def head_description(self, dtype: torch.dtype = torch.float64,
                         n_positions: int | None = None) -> tuple[HeadSpec, HeadWeights]:
        """``(HeadSpec, HeadWeights)`` in the suite's conventions (docs/math.md sections 1, 8
        and 11): math layout ``w_q (m, H, d)``, family ``"dot"`` (standard, per-head base) or
        ``"cosine"`` with ``temperature`` = the learned ``tau_h``; ``RoPESpec(base=...)`` one
        float or one per head; ``w_o (H, r, d_model)``.  A module rotating with a model's own
        tables (``tables``) needs ``n_positions``: the tables of positions ``0..n-1`` go into
        the spec."""
        H, Hk, d, m = self.n_heads, self.n_kv_heads, self.head_dim, self.d_model

        def w(lin: nn.Linear, heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            W = lin.weight.detach().to(dtype).T.reshape(m, heads, d)
            b = None if lin.bias is None else lin.bias.detach().to(dtype).reshape(heads, d)
            return W.contiguous(), b

        wq, bq = w(self.q_proj, H)
        wk, bk = w(self.k_proj, Hk)
        wv, bv = w(self.v_proj, Hk)
        wo = self.o_proj.weight.detach().to(dtype).T.reshape(H, d, m).contiguous()
        bo = None if self.o_proj.bias is None else self.o_proj.bias.detach().to(dtype)
        cos = sin = None
        if self._tables is not None:
            if n_positions is None or int(n_positions) < 1:
                raise ValueError("this module rotates with a model's own tables: give "
                                 "n_positions (the positions the description must cover)")
            pos = torch.arange(int(n_positions), device=self.q_proj.weight.device)[None]
            c, s = self._tables(pos, self.q_proj.weight.dtype, pos.device)
            cos, sin = c[0].detach().cpu().double(), s[0].detach().cpu().double()
        if self.variant == "perhead":
            base: float | tuple[float, ...] = tuple(float(b) for b in self.bases().detach())
        else:
            base = self.rope_base
        rs = RoPESpec(base=base, layout=self.layout, cos=cos, sin=sin)
        if self.variant == "cosine":
            spec = HeadSpec(H, Hk, d, rope=rs, family="cosine",
                            temperature=tuple(float(t) for t in self.temperatures().detach()))
        else:
            spec = HeadSpec(H, Hk, d, rope=rs, family="dot")
        return spec, HeadWeights(w_q=wq, w_k=wk, w_v=wv, b_q=bq, b_k=bk, b_v=bv, w_o=wo, b_o=bo)


# ---------------------------------------------------------------------------------------------
# a small GPT (the Cosine-RoPE document's 3 layers x 4 heads x d_model 128, seq 128)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    """The document's model by default: 3 layers, 4 heads, ``d_model`` 128, sequences of 128
    tokens, GPT-2's 50257-token vocabulary with an untied LM head (~13.5M parameters)."""

    vocab_size: int = 50257
    n_layers: int = 3
    n_heads: int = 4
    d_model: int = 128
    seq_len: int = 128
    n_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_ratio: float = 4.0
    variant: str = "standard"
    rope_base: float = 10000.0
    layout: str = "half"
    tau_init: float | None = None
    base_range: tuple[float, float] = (1e3, 1e6)
    qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    init_std: float = 0.02
    attn_impl: str = "math"

    def attention(self) -> AttentionConfig:
        """The :class:`AttentionConfig` of every layer."""
        return AttentionConfig(d_model=self.d_model, n_heads=self.n_heads,
                               n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                               variant=self.variant, qkv_bias=self.qkv_bias, o_bias=False,
                               rope_base=self.rope_base, layout=self.layout,
                               tau_init=self.tau_init, base_range=self.base_range,
                               attn_impl=self.attn_impl)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GPTConfig.{name} must be an int >= 1, got {v!r}")
        if not (self.mlp_ratio > 0 and math.isfinite(self.mlp_ratio)):
            raise ValueError(f"mlp_ratio must be finite and > 0, got {self.mlp_ratio}")
        if not (self.norm_eps >= 0 and math.isfinite(self.norm_eps)):
            raise ValueError(f"norm_eps must be finite and >= 0, got {self.norm_eps}")
        self.attention()  # validates the attention fields


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * w`` over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    """Pre-norm block: ``h + attn(norm1(h))``, then ``h + mlp(norm2(h))`` (GELU MLP)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = RoPEAttention(config.attention())
        self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        hidden = max(1, int(round(config.mlp_ratio * config.d_model)))
        self.mlp = nn.Sequential(nn.Linear(config.d_model, hidden, bias=False), nn.GELU(),
                                 nn.Linear(hidden, config.d_model, bias=False))

    def forward(self, h: torch.Tensor, positions: Any = None, capture: list | None = None
                ) -> torch.Tensor:
        a = self.norm1(h)
        if capture is None:
            h = h + self.attn(a, positions)
        else:
            out, heads = self.attn(a, positions, return_heads=True)
            capture.append(LayerCapture(len(capture), a.detach(), heads.detach(), out.detach()))
            h = h + out
        return h + self.mlp(self.norm2(h))


@dataclass
class LayerCapture:
    """One layer of one forward: the attention input ``x`` after the block's input norm
    ``(B, T, d_model)``, the per-head outputs ``(B, H, T, r)`` and the attention output after
    ``o_proj`` ``(B, T, d_model)``."""

    layer: int
    x: torch.Tensor
    heads: torch.Tensor
    out: torch.Tensor


@dataclass
class GPTCapture:
    logits: torch.Tensor  # (B, T, vocab)
    layers: list[LayerCapture] = field(default_factory=list)
    positions: torch.Tensor | None = None


class GPT(nn.Module):
    """Token embedding, pre-RMSNorm blocks of one attention variant, final norm, LM head.

    RoPE is the only position signal.  Weights are drawn ``N(0, init_std^2)`` (biases 0); the
    per-head bases are initialised from the barycenters of the drawn weights.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if config.variant == "perhead":
            for b in self.blocks:
                b.attn.init_bases_from_barycenter()

    def _init(self, mod: nn.Module) -> None:
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            nn.init.normal_(mod.weight, std=self.config.init_std)
            if getattr(mod, "bias", None) is not None:
                nn.init.zeros_(mod.bias)

    def _check_idx(self, idx: Any) -> torch.Tensor:
        if not torch.is_tensor(idx) or idx.dim() != 2:
            raise ValueError(f"idx must be a (batch, tokens) integer tensor, got "
                             f"{getattr(idx, 'shape', type(idx).__name__)}")
        if idx.is_floating_point() or idx.dtype == torch.bool:
            raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        if idx.shape[1] < 1:
            raise ValueError("idx has no tokens")
        if bool((idx < 0).any()) or bool((idx >= self.config.vocab_size).any()):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return idx

    def _run(self, idx: torch.Tensor, positions: Any, capture: list | None) -> torch.Tensor:
        h = self.tok_emb(self._check_idx(idx))
        for b in self.blocks:
            h = b(h, positions, capture)
        return self.lm_head(self.norm_f(h))

    def forward(self, idx: torch.Tensor, positions: Any = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of token ids ``idx (B, T)``."""
        return self._run(idx, positions, None)

    def lm_loss(self, idx: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of ``idx (B, T)`` (``T >= 2``)."""
        if idx.dim() != 2 or idx.shape[1] < 2:
            raise ValueError("lm_loss needs idx of shape (batch, tokens >= 2)")
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               idx[:, 1:].reshape(-1))

    @torch.no_grad()
    def capture(self, idx: torch.Tensor, positions: Any = None) -> GPTCapture:
        """One forward, keeping every layer's attention input and per-head outputs."""
        layers: list[LayerCapture] = []
        logits = self._run(idx, positions, layers)
        pos = None if positions is None else torch.as_tensor(positions)
        return GPTCapture(logits, layers, pos)


# ---------------------------------------------------------------------------------------------
# Hugging Face Llama / Qwen2: replacing the attention
# ---------------------------------------------------------------------------------------------
class HFAttention(RoPEAttention):
    """A :class:`RoPEAttention` with the Hugging Face attention forward signature
    ``forward(hidden_states, position_embeddings, attention_mask, cache=None, **kwargs) ->
    (attn_output, attn_weights)``; ``head_outputs``/``head_description`` as the base class.

    ``attention_mask``: ``None`` (causal, with the cache offset), a boolean mask (True =
    permitted) or HF's additive float mask, shape ``(B, 1, T, L)``.  With a cache, keys are
    cached after rotation (per KV head; per query head for per-head bases, which needs a
    dynamic cache).
    """

    def __init__(self, config: AttentionConfig, layer_idx: int, hf_config: Any = None,
                 **kw: Any) -> None:
        super().__init__(config, **kw)
        self.layer_idx = int(layer_idx)
        self.hf_config = hf_config
        self.is_causal = True
        self.num_key_value_groups = self.group
        self.scaling = 1.0 / math.sqrt(self.head_dim)
        self.attention_dropout = 0.0

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None,
                past_key_values: Any = None, **kwargs: Any):
        x = self._check_x(hidden_states)
        cache = cache if cache is not None else past_key_values
        B, T, _ = x.shape
        past = int(cache.get_seq_length(self.layer_idx)) if cache is not None else 0
        pid = kwargs.get("position_ids")
        pos = (torch.arange(past, past + T, device=x.device)[None] if pid is None
               else self._positions(pid, B, T, x.device))
        q, k, v = self._project(x)
        q, k = self._normalise(q, k)
        if self._tables is not None and position_embeddings is not None:
            h = self.head_dim // 2
            cos = position_embeddings[0][..., :h][:, None].to(q.dtype)
            sin = position_embeddings[1][..., :h][:, None].to(q.dtype)
        else:
            cos, sin = self._cos_sin(pos, q.dtype, q.device)
        q = self._rotate(q, cos, sin)
        per_head = cos.shape[1] != 1
        k = self._rotate(self._expand_kv(k), cos, sin) if per_head else self._rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        L = k.shape[-2]
        if not per_head:
            k = self._expand_kv(k)
        v = self._expand_kv(v)
        allowed = additive = None
        if attention_mask is None:
            i = torch.arange(T, device=x.device)[:, None]
            allowed = (torch.arange(L, device=x.device)[None, :] <= i + (L - T))[None, None]
        elif attention_mask.dtype == torch.bool:
            allowed = attention_mask[..., :L]
        else:
            additive = attention_mask[..., :L].to(q.dtype)
        # a padded query row may have no permitted key: the dtype's most negative number
        # (as HF's own masks) keeps it finite; every other row is unchanged (e^(min - max) = 0)
        heads, probs = self._attention(q, k, v, allowed, additive, want_probs=True,
                                       fill=torch.finfo(q.dtype).min)
        out = self.o_proj(heads.transpose(1, 2).reshape(B, T, -1))
        return out, probs


def _submodule(model: Any, paths: tuple[str, ...], missing: str) -> Any:
    """The first of the dotted attribute ``paths`` that ``model`` has; ``ValueError(missing)``."""
    for path in paths:
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise ValueError(f"{type(model).__name__}: {missing}")


def _decoder_layers(model: Any) -> Any:
    return _submodule(model, ("model.layers", "layers"), "no decoder layers found (expected a "
                      "Hugging Face Llama/Qwen2 model with model.layers)")


def _rotary(model: Any) -> Any:
    return _submodule(model, ("model.rotary_emb", "rotary_emb"), "no rotary_emb module found")


def _model_tables(rotary: Any, head_dim: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``tables(pos (B', T), dtype, device)`` from the model's own rotary embedding: its
    duplicated-half tables, one half kept (checked equal)."""
    h = head_dim // 2

    def tables(pos: torch.Tensor, dtype: torch.dtype, device: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(1, 1, head_dim, dtype=dtype, device=device)
        with torch.no_grad():
            cos, sin = rotary(x, pos.to(device))
        if cos.shape[-1] != head_dim or not (torch.equal(cos[..., :h], cos[..., h:])
                                             and torch.equal(sin[..., :h], sin[..., h:])):
            raise ValueError("the model's rotary tables are not duplicated halves of width "
                             f"head_dim={head_dim} (rotate_half layout expected)")
        return cos[..., :h], sin[..., :h]

    return tables


def replace_attention(model: Any, variant: str, *, tau_init: float | None = None,
                      base_range: tuple[float, float] = (1e3, 1e6),
                      use_model_tables: bool = True) -> list[HFAttention]:
    """Swap every decoder layer's ``self_attn`` of a Hugging Face Llama/Qwen2 model for an
    :class:`HFAttention` of ``variant`` that reuses the layer's q/k/v/o ``nn.Linear`` modules
    (the same objects, biases included) and keeps the HF forward signature
    (docs/math.md section 11).

    ``"standard"`` and ``"cosine"`` rotate with the model's own float32 tables
    (``use_model_tables=True``, so ``"standard"`` reproduces the model) or with analytic tables of
    the config's ``rope_theta``; ``"perhead"`` replaces the rotation itself (per-head learned
    bases in ``base_range``, initialised from each head's barycenter).  Returns the new modules in
    layer order.  Refuses (ValueError) QK-norm attention, sliding windows, and rope scaling types
    other than ``"default"`` where the analytic rotation is used.
    """
    import transformers  # noqa: F401  (model plumbing: imported lazily)

    if variant not in VARIANTS:
        raise ValueError(f"unknown attention variant {variant!r}: one of {VARIANTS}")
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"{type(model).__name__} has no config: expected a Hugging Face model")
    layers = _decoder_layers(model)
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    rtype = rp.get("rope_type", "default")
    analytic = variant == "perhead" or not use_model_tables
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    if analytic and rtype != "default":
        raise ValueError(f"rope_type {rtype!r}: the analytic rotation of variant {variant!r} "
                         "covers only 'default' RoPE (use the model's tables)")
    H = int(cfg.num_attention_heads)
    Hk = int(getattr(cfg, "num_key_value_heads", None) or H)
    m = int(cfg.hidden_size)
    d = int(getattr(cfg, "head_dim", None) or m // H)
    tables = None if analytic else _model_tables(_rotary(model), d)
    new = []
    for idx, layer in enumerate(layers):
        old = layer.self_attn
        if getattr(old, "q_norm", None) is not None or getattr(old, "k_norm", None) is not None:
            raise ValueError(f"layer {idx}: QK-norm attention is not one of the variants")
        if getattr(old, "sliding_window", None) is not None:
            raise ValueError(f"layer {idx}: sliding-window attention is not supported")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(old, name, None), nn.Linear):
                raise ValueError(f"layer {idx}: self_attn.{name} is not an nn.Linear")
        qb = old.q_proj.bias is not None
        if (old.k_proj.bias is not None) != qb or (old.v_proj.bias is not None) != qb:
            raise ValueError(f"layer {idx}: q/k/v must all carry a bias or none")
        ac = AttentionConfig(m, H, Hk, d, variant, qkv_bias=qb, o_bias=old.o_proj.bias is not None,
                             rope_base=float(theta), layout="half", tau_init=tau_init,
                             base_range=base_range)
        att = HFAttention(ac, idx, cfg, q_proj=old.q_proj, k_proj=old.k_proj,
                          v_proj=old.v_proj, o_proj=old.o_proj, tables=tables)
        p = old.q_proj.weight
        att.to(device=p.device, dtype=p.dtype)
        layer.self_attn = att
        new.append(att)
    return new


# ---------------------------------------------------------------------------------------------
# the suite on a module's heads
# ---------------------------------------------------------------------------------------------
def cosine_bound_ratio(y: torch.Tensor, mu: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                       ) -> torch.Tensor:
    """``||y_i - mu_i||_2 / max_{j in I_i} ||v_j - mu_i||_2`` per head and query, ``(H, Q)``
    (``y, mu (H, Q, r)``, ``v (H, N, r)``, ``mask (Q, N)``); 0 where both are 0 (one key), inf
    where only the denominator is (docs/math.md sections 8 and 11)."""
    num = torch.linalg.vector_norm(y - mu, dim=-1)
    dev = torch.linalg.vector_norm(v[:, None] - mu[:, :, None], dim=-1)  # (H, Q, N)
    den = dev.masked_fill(~mask[None], 0.0).amax(-1)
    out = num / den
    return torch.where((num == 0) & (den == 0), torch.zeros_like(out), out)


def cosine_bound(tau: Any) -> torch.Tensor:
    """``e^{2/tau} - 1``: the bound on :func:`cosine_bound_ratio` of a cosine head."""
    return torch.expm1(2.0 / torch.as_tensor(tau, dtype=torch.float64))


def check_frequency_ordering(head_dim: int = 8, layout: str = "half",
                             base_range: tuple[float, float] = (1e3, 1e6)) -> dict:
    """The documented orientation of the frequency axis (docs/math.md sections 10 and 11).

    * ``omega_l = base^(-2l/d)`` strictly decreasing in ``l`` with ``omega_0 = 1``, for
      ``b_min``, ``b_max`` and their geometric mean (``rope.rope_frequencies`` and a per-head
      module's :meth:`RoPEAttention.frequencies`);
    * a head whose W_q/W_k live only in pair 0 (dimensions from ``rope.pair_indices``) has
      barycenter 0, one living only in the last pair has barycenter 1;
    * a per-head-base module built on those two heads initialises them to ``b_min`` and ``b_max``
      (within ``tolerances.exp_of_sum_rel`` of the log/exp round trips).

    Returns ``{"passed", "failures", "omega_decreasing", "barycenters", "bases"}``.
    """
    lo, hi = (float(b) for b in base_range)
    fails: list[Failure] = []
    d, m = int(head_dim), 3
    dec = True
    for b in (lo, math.sqrt(lo * hi), hi):
        om = rope.rope_frequencies(b, d)
        ok = bool((om[1:] < om[:-1]).all()) and float(om[0]) == 1.0
        dec = dec and ok
        if not ok:
            fails.append(Failure(f"base {b:.4g}", "omega_l = base^(-2l/d) decreasing, omega_0 = 1"))
    att = RoPEAttention(AttentionConfig(m, 2, 2, d, "perhead", layout=layout,
                                        base_range=(lo, hi))).double()
    om = att.frequencies()
    if not (bool((om[:, 1:] < om[:, :-1]).all()) and bool((om[:, 0] == 1.0).all())):
        dec = False
        fails.append(Failure("per-head module", "frequencies() decreasing with omega_0 = 1"))
    wq = torch.zeros(2 * d, m, dtype=torch.float64)
    for h, ell in ((0, 0), (1, d // 2 - 1)):
        for c in rope.pair_indices(ell, d, layout):
            wq[h * d + c] = torch.arange(1, m + 1, dtype=torch.float64)
    with torch.no_grad():
        att.q_proj.weight.copy_(wq)
        att.k_proj.weight.copy_(wq)
    t = att.init_bases_from_barycenter()
    bases = att.bases().detach()
    want_t, want_b = (0.0, 1.0), (lo, hi)
    labels = ("pair 0 (fastest)", f"pair {d // 2 - 1} (slowest)")
    for h in range(2):
        # t = sum_l l E_l / ((d/2 - 1) sum_l E_l) of non-negative terms: exactly 0 for pair 0,
        # within gamma_n of 1 for the last pair, n = 2m + 2d + 5 roundings (the count of
        # tests/test_rope_diagnostics.py::barycenter_ops), in any order of the sums
        if abs(float(t[h]) - want_t[h]) > tl.nonnegative_ops_rel(2 * m + 2 * d + 5):
            fails.append(Failure(f"head living in {labels[h]}", "barycenter", float(t[h]),
                                 detail=f"expected {want_t[h]} ({layout} layout)"))
        rel = abs(float(bases[h]) / want_b[h] - 1.0)
        tol = (tl.exp_of_sum_rel(abs(math.log(lo)) + abs(math.log(hi)), 2)
               + tl.exp_of_sum_rel(abs(math.log(want_b[h])), 1))
        if not rel <= tol:
            fails.append(Failure(f"head living in {labels[h]}", "initial base relative to "
                                 f"{want_b[h]:g}", rel, tol))
    return {"passed": not fails, "failures": [f.as_dict() for f in fails],
            "omega_decreasing": dec, "barycenters": t.tolist(), "bases": bases.tolist()}


def _copy(module: RoPEAttention, dtype: torch.dtype) -> RoPEAttention:
    """A detached copy of the module in ``dtype`` on the CPU (the tables callable is shared)."""
    c = copy.deepcopy(module)
    return c.to(device="cpu", dtype=dtype).eval()


def _per_query(v: torch.Tensor, s: torch.Tensor, mask: torch.Tensor
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (head, query): value scale ``S_i = max_{j in I_i} |v_j|_inf``, ``max|s|`` over
    ``I_i`` and ``N_i``, float64 numpy."""
    va = v.abs().amax(-1).double()  # (H, N)
    S = (va[:, None, :] * mask[None].double()).amax(-1)
    sm = s.double().abs().masked_fill(~mask[None], 0.0).amax(-1)
    n = mask.sum(-1).double()[None].expand_as(S)
    return (S.clamp_min(tl.SCALE_GUARD).numpy(), sm.numpy(), n.numpy())


class _Checks:
    """Per-check, per-head worst ratio ``err / tol`` (NaN-keeping) and the failures."""

    def __init__(self, H: int) -> None:
        self.H = H
        self.ratios: dict[str, list[float]] = {}
        self.failures: list[Failure] = []

    def add(self, name: str, err: Any, tol: Any, doc: str = "") -> None:
        """Record ``err <= tol`` (arrays ``(H, ...)``); a repeated name keeps the worst ratio."""
        e = np.asarray(err, dtype=np.float64)
        t = np.broadcast_to(np.asarray(tol, dtype=np.float64), e.shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(e == 0, 0.0, e / t)
        r = np.where(np.isnan(e) | np.isnan(t) | (t < 0), np.nan, r)
        per = []
        for h in range(self.H):
            rh = r[h].ravel()
            w = worst(rh, default=0.0)
            per.append(w)
            if not w <= 1.0:  # NaN and inf fail
                k = int(np.flatnonzero(np.isnan(rh))[0]) if np.isnan(w) else int(np.argmax(rh))
                self.failures.append(Failure(f"head {h}", name, float(e[h].ravel()[k]),
                                             float(t[h].ravel()[k]), doc))
        old = self.ratios.get(name)
        self.ratios[name] = per if old is None else [worst([a, b]) for a, b in zip(old, per)]

    def flag(self, name: str, ok: bool, where: str = "module", detail: str = "") -> None:
        self.ratios[name] = [0.0 if ok else math.inf] * self.H
        if not ok:
            self.failures.append(Failure(where, name, detail=detail))


def _identity(ch: _Checks, name: str, readout: torch.Tensor, native: torch.Tensor,
              v: torch.Tensor, s: torch.Tensor, mask: torch.Tensor, kappa: torch.Tensor,
              dtype: torch.dtype, d: int, m: int) -> np.ndarray:
    """``|readout - native| / S_i`` against ``readout_bound(dtype, max(1, kappa), N_i, d, max|s|)
    + agreement_rel_tol(dtype, N, d, m)`` (docs/math.md sections 9 and 11)."""
    S, sm, n = _per_query(v, s, mask)
    err = (readout.double() - native.double()).abs().amax(-1).numpy() / S
    kap = np.maximum(1.0, kappa.double().numpy())
    N = int(mask.shape[1])
    tol = (tl.readout_bound(dtype, kap, n, d, sm) + tl.agreement_rel_tol(dtype, N, d, m))
    ch.add(name, err, tol, "y_native vs mu + q T + b (docs/math.md section 11)")
    return err


def check_module(module: RoPEAttention, x: Any, positions: Any = None, *, n_reuse: int = 4,
                 float32: bool = True) -> dict:
    """Run the suite on every head of ``module`` against the module's own forward
    (docs/math.md section 11).

    ``x``: the attention input ``(T, d_model)`` (or ``(1, T, d_model)``), i.e. after the block's
    input norm; ``positions`` ``(T,)`` non-decreasing integers (default ``0..T-1``).

    (a) identity: ``mu_i + q_i T_i + b_i`` through :func:`ropestep.fast.step` and
        :mod:`ropestep.scale` in float64 (original gauge) and float32 (max-key gauge) against the
        module's own per-head output in the same dtype, per query within
        ``readout_bound(dtype, max(1, kappa), N_i, d, max|s|) + agreement_rel_tol(dtype, N, d, m)``
        relative to ``S_i = max_{j in I_i} |v_j|_inf``;
    (b) gradient step (float64, original gauge): ``grad E(0) = -Delta M`` from explicit
        features, ``E(Delta M) - E(0) <= (lambda_max/2 - 1) ||Delta M||_F^2``, in query space for
        every variant and in input space for the affine ones, plus the two spaces' sandwich
        ``sigma_min(W^_q)^2 <= lambda_in / lambda_q <= sigma_max(W^_q)^2`` (docs/math.md
        section 3); reports ``lambda_max`` and the descent fraction per head and space;
    (c) frozen reuse: the last ``n_reuse`` tokens as queries at one position reading the prefix
        bank, the module's own output with that bank (a boolean mask) against the anchor's
        frozen readout: measured error = tokenwise formula (``identity_check_tol``), and for
        affine heads ``||e_i|| <= ||u_i|| ||Delta M_i - Delta M_a||_op`` (docs/math.md section 6);
    (d) cosine heads: ``max_i ||y_i - mu_i|| / max_j ||v_j - mu_i|| <= e^{2/tau_h} - 1`` at the
        learned ``tau_h``, and its tightness ratio (docs/math.md sections 8 and 11);
    (e) the frequency orientation (:func:`check_frequency_ordering`) and the module's own
        ``omega_l`` decreasing.

    Returns ``{"variant", "n_heads", "n_tokens", "passed", "failures" (list of
    :class:`ropestep.verdict.Failure` dicts), "checks" ({name: per-head worst err/tol, <= 1
    passes}), "heads" (per-head numbers)}``.  Check names: ``identity_float64_fast``,
    ``identity_float64_scale``, ``identity_float64_self`` (softmax output vs readout),
    ``identity_float32_fast``, ``identity_float32_scale``, ``descent_inequality_query``,
    ``gradient_query``, ``query_space_readout``, for affine heads ``descent_inequality_input``,
    ``gradient_input``, ``hessian_sandwich``, ``reuse_bound``; ``reuse_tokenwise``,
    ``reuse_native``, ``cosine_bound`` (cosine), ``frequencies_decreasing``,
    ``frequency_orientation`` (per-head bases).  Per-head numbers: ``identity_float64_rel``,
    ``identity_float32_rel``, ``lambda_max_{query,input}_{median,max}``,
    ``descends_{query,input}_fraction``, ``lambda_below_2_{query,input}_fraction``,
    ``reuse_rel_error_{median,max}``, ``base``, and for cosine heads ``tau``,
    ``cosine_ratio_max``, ``cosine_bound``, ``cosine_tightness``, ``cosine_two_key_reach``
    (``1/(1 + e^{2/tau})``).  A NaN or inf anywhere fails (:mod:`ropestep.verdict`).
    """
    if not isinstance(module, RoPEAttention):
        raise TypeError(f"module must be a RoPEAttention, got {type(module).__name__}")
    if not torch.is_tensor(x):
        raise TypeError(f"x must be a torch tensor, got {type(x).__name__}")
    if x.dim() == 3:
        if x.shape[0] != 1:
            raise ValueError(f"x must be one sequence (T, d_model) or (1, T, d_model), got "
                             f"{tuple(x.shape)}")
        x = x[0]
    if x.dim() != 2 or x.shape[1] != module.d_model:
        raise ValueError(f"x must have shape (T, {module.d_model}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got dtype {x.dtype}")
    x64 = x.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(x64).all()):
        raise ValueError("x contains NaN or inf")
    T = int(x64.shape[0])
    if T < 2:
        raise ValueError("check_module needs at least 2 tokens")
    pos = (torch.arange(T) if positions is None
           else torch.as_tensor(positions).detach().cpu())
    if pos.is_floating_point() or pos.dtype == torch.bool or pos.shape != (T,):
        raise ValueError(f"positions must be ({T},) integers, got {tuple(pos.shape)} {pos.dtype}")
    pos = pos.to(torch.int64)
    if bool((torch.diff(pos) < 0).any()) or bool((pos < 0).any()):
        raise ValueError("positions must be non-negative and non-decreasing")
    if not (isinstance(n_reuse, int) and n_reuse >= 2):
        raise ValueError(f"n_reuse must be an int >= 2, got {n_reuse!r}")

    m64 = _copy(module, torch.float64)
    spec, w = m64.head_description(torch.float64, n_positions=int(pos.max()) + 1)
    H, d, m = spec.n_heads, spec.head_dim, module.d_model
    ch = _Checks(H)
    heads_info: list[dict] = [{"head": h} for h in range(H)]
    with torch.no_grad():
        native64 = m64.head_outputs(x64[None], pos)[0]  # (H, T, r)

    # (a) identity, float64: fast path (original gauge) and scale path
    st = fast.step(spec, w, x64, pos, x64, pos, "causal", gauge="original",
                   keep=("c", "t", "b"), delta_m=spec.affine)
    P: fast.Projected = st.extras["projected"]
    mask = st.mask
    err64 = _identity(ch, "identity_float64_fast", st.readout, native64, P.v, st.s, mask,
                      st.kappa, torch.float64, d, m)
    ro_sc, kap_sc = _scale_readout(spec, w, x64, pos, "original", torch.float64)
    _identity(ch, "identity_float64_scale", ro_sc, native64, P.v, st.s, mask, kap_sc,
              torch.float64, d, m)
    # the identity in the suite's own arithmetic: softmax output vs readout
    S, sm, n = _per_query(P.v, st.s, mask)
    own = (st.y - st.readout).abs().amax(-1).numpy() / S
    ch.add("identity_float64_self", own,
           tl.identity_check_tol(torch.float64, st.kappa.numpy(), n, d, sm))
    for h in range(H):
        heads_info[h]["identity_float64_rel"] = worst(err64[h])

    # (a) float32: the module's own float32 forward against both paths (max-key gauge)
    if float32:
        m32 = _copy(module, torch.float32)
        x32 = x64.to(torch.float32)
        spec32, w32 = m32.head_description(torch.float64, n_positions=int(pos.max()) + 1)
        with torch.no_grad():
            native32 = m32.head_outputs(x32[None], pos)[0]
        st32 = fast.step(spec32, w32, x32, pos, x32, pos, "causal", gauge="maxkey",
                         dtype=torch.float32, keep=())
        P32: fast.Projected = st32.extras["projected"]
        err32 = _identity(ch, "identity_float32_fast", st32.readout, native32, P32.v, st32.s,
                          mask, st32.kappa, torch.float32, d, m)
        ro32, kap32 = _scale_readout(spec32, w32, x32, pos, "maxkey", torch.float32)
        _identity(ch, "identity_float32_scale", ro32, native32, P32.v, st32.s, mask, kap32,
                  torch.float32, d, m)
        for h in range(H):
            heads_info[h]["identity_float32_rel"] = worst(err32[h])

    # (b) the gradient step and descent
    _gradient_checks(ch, heads_info, st, spec, w, x64, sm, n)

    # (c) frozen reuse against the module's own output on the prefix bank
    _reuse_checks(ch, heads_info, m64, spec, w, x64, pos, n_reuse)

    # (d) the cosine bound at the learned temperatures
    if spec.family == "cosine":
        taus = torch.tensor(spec.temperatures(), dtype=torch.float64)
        bound = cosine_bound(taus)
        num = torch.linalg.vector_norm(native64 - st.mu, dim=-1)
        dev = torch.linalg.vector_norm(P.v[:, None] - st.mu[:, :, None], dim=-1)
        den = dev.masked_fill(~mask[None], 0.0).amax(-1)
        # queries reading one key, or keys whose values are all equal (a repeated token in
        # layer 0), have y = mu exactly: the module's y differs from the suite's mu only by
        # rounding, over a zero denominator.  The ratio is reported over the other queries
        # (the bound's check below still covers them all)
        ratio = cosine_bound_ratio(native64, st.mu, P.v, mask)  # (H, Q)
        ratio = torch.where((mask.sum(-1)[None] >= 2) & (den > 0), ratio,
                            torch.zeros_like(ratio))
        excess = (num - bound[:, None] * den).clamp_min(0.0).numpy()
        # the module's y is within agreement_rel_tol * S_i of the exact head per component,
        # sqrt(r) times that in the 2-norm (docs/math.md section 11)
        num_tol = math.sqrt(spec.r) * tl.agreement_rel_tol(torch.float64, T, d, m) * S
        ch.add("cosine_bound", excess, num_tol,
               "||y - mu|| - (e^{2/tau} - 1) max_j ||v_j - mu|| (docs/math.md section 11)")
        for h in range(H):
            rmax = worst(ratio[h])
            heads_info[h].update(tau=float(taus[h]), cosine_ratio_max=rmax,
                                 cosine_bound=float(bound[h]),
                                 cosine_tightness=rmax / float(bound[h]),
                                 cosine_two_key_reach=_two_key_reach(float(taus[h])))

    # (e) frequency orientation
    om = m64.frequencies()
    ok = bool((om[:, 1:] < om[:, :-1]).all()) and bool((om[:, 0] == 1.0).all())
    ch.flag("frequencies_decreasing", ok, detail="omega_l = base^(-2l/d) must decrease with l")
    if spec.rope.per_head:
        fo = check_frequency_ordering(max(4, d), module.layout, module.base_range)
        ch.flag("frequency_orientation", fo["passed"],
                detail="; ".join(Failure(**f).line() for f in fo["failures"]))
    for h, b in enumerate(spec.rope.bases(H)):
        heads_info[h]["base"] = b

    fails = [f.as_dict() for f in ch.failures]
    return {"variant": module.variant, "n_heads": H, "n_tokens": T, "passed": not fails,
            "failures": fails, "checks": ch.ratios, "heads": heads_info}


def _two_key_reach(tau: float) -> float:
    """``1 / (1 + e^{2/tau})``: the tightness two keys at ``+-q^`` reach (docs/math.md section
    11), written with ``e^{-2/tau}`` so that it never overflows."""
    e = math.exp(-2.0 / tau)
    return e / (1.0 + e)


def _scale_readout(spec: HeadSpec, w: HeadWeights, x: torch.Tensor, pos: torch.Tensor,
                   gauge: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The streamed path's readout ``(H, T, r)`` and its kappa ``(H, T)``."""
    H, T = spec.n_heads, int(x.shape[0])
    ro = torch.full((H, T, spec.r), math.nan, dtype=torch.float64)
    kap = torch.full((H, T), math.nan, dtype=torch.float64)
    for c in scale.stream(spec, w, x, pos, gauge=gauge, dtype=dtype, outputs=("kappa",)):
        hs = torch.tensor(c.heads)
        ro[hs[:, None], c.queries[None]] = c.readout.double()
        kap[hs[:, None], c.queries[None]] = c.extra["kappa"].double()
    return ro, kap


def _gradient_checks(ch: _Checks, info: list[dict], st: fast.Step, spec: HeadSpec,
                     w: HeadWeights, x: torch.Tensor, sm: np.ndarray, n: np.ndarray) -> None:
    """(b) of :func:`check_module`: the gradient step in both parametrisations."""
    P: fast.Projected = st.extras["projected"]
    H, Q, N = st.c.shape
    d, m, r = spec.head_dim, int(x.shape[1]), spec.r
    multi = torch.as_tensor(n[0] >= 2)  # queries with a step (one key: Delta M = 0)
    spaces = [("query", fast.query_delta_m(st), fast.query_descent(st))]
    if spec.affine:
        spaces.append(("input", st.delta_m, fast.descent(st)))
    lam = {}
    vc = P.v[:, None] - st.mu[:, :, None]  # (H, Q, N, r)
    for name, dm, dc in spaces:
        lam[name] = dc.lam_max
        nrm2 = (dm * dm).sum((-1, -2))
        # E(step) - E(0) = -||dM||^2 + 1/2 tr(dM^T H dM) <= (lam/2 - 1) ||dM||^2; the evaluated
        # terms have size 2 lam ||dM||^2 + 4 E(0) + E(step) (docs/math.md section 3)
        size = (2 * dc.lam_max.abs() * nrm2 + 4 * dc.e0 + dc.e1).numpy()
        hid = m if name == "input" else 0
        slack = (dc.e1 - dc.e0 - (dc.lam_max / 2 - 1) * nrm2).numpy()
        tol = tl.descent_bound(torch.float64, size, N, d, hid, float(sm.max()))
        ch.add(f"descent_inequality_{name}", np.maximum(slack, 0.0), tol,
               "E(dM) - E(0) - (lambda/2 - 1)||dM||^2 (docs/math.md section 3)")
        # grad E(0) = -Delta M from explicit features, at the last query and a middle one
        for h in range(H):
            for i in sorted({Q - 1, Q // 2}):
                mk = st.mask[i]
                a = (fast.query_features(st, h, i) if name == "query"
                     else fast.features(st, h, i))[mk]
                c, t = st.c[h, i, mk], vc[h, i, mk]
                _, g = fast.objective(a, c, t, torch.zeros(a.shape[1], r, dtype=a.dtype))
                scale_abs = (c.abs()[:, None, None] * _abs_feature(st, h, i, name)[mk][:, :, None]
                             * t.abs()[:, None, :]).sum(0)
                err = ((g + dm[h, i]).abs() / scale_abs.clamp_min(tl.SCALE_GUARD)).max()
                ch.add(f"gradient_{name}",
                       np.where(np.arange(H) == h, float(err), 0.0)[:, None], tl.FLOAT64_REL,
                       "grad E(0) + Delta M relative to its terms (docs/math.md section 9)")
        for h in range(H):
            sel = multi & torch.isfinite(dc.e0[h])
            info[h][f"lambda_max_{name}_median"] = float(dc.lam_max[h][sel].median()) \
                if bool(sel.any()) else math.nan
            info[h][f"lambda_max_{name}_max"] = worst(dc.lam_max[h][sel], default=math.nan)
            info[h][f"descends_{name}_fraction"] = float(dc.descends[h][sel].double().mean()) \
                if bool(sel.any()) else math.nan
            info[h][f"lambda_below_2_{name}_fraction"] = float(
                (dc.lam_max[h][sel] < 2).double().mean()) if bool(sel.any()) else math.nan
    # query-space readout: mu + z^T Delta M^q = mu + q T + b
    z = fast.query_input(st)
    roq = st.mu + (z[:, :, None] @ fast.query_delta_m(st))[:, :, 0]
    S, _, _ = _per_query(P.v, st.s, st.mask)
    ch.add("query_space_readout", (roq - st.readout).abs().amax(-1).numpy() / S,
           tl.readout_bound(torch.float64, np.maximum(1.0, st.kappa.numpy()), n, d, sm),
           "mu + z^T Delta M^q vs mu + q T + b (docs/math.md section 11)")
    if spec.affine:
        # sigma_min(W^_q)^2 <= lambda_in / lambda_q <= sigma_max(W^_q)^2 (docs/math.md section 3)
        G = torch.einsum("hqn,hnd,hne->hqde", st.c, P.k, P.k)
        trG = torch.diagonal(G, dim1=-2, dim2=-1).sum(-1)  # (H, Q)
        for h in range(H):
            bq = torch.zeros(d, dtype=torch.float64) if w.b_q is None else \
                torch.as_tensor(w.b_q[h], dtype=torch.float64)
            W = torch.cat((torch.as_tensor(w.w_q[:, h], dtype=torch.float64), bq[None]), 0)
            sv = torch.linalg.svdvals(W)
            s2 = float(P.scale[h]) ** 2
            li, lq = lam["input"][h], lam["query"][h]
            size_in = (s2 * float((W * W).sum()) + 1.0) * trG[h]
            smh = float(sm[h].max())
            eps = (tl.descent_bound(torch.float64, size_in.numpy(), N, d, m, smh) / li.numpy()
                   + tl.descent_bound(torch.float64, (s2 * trG[h]).numpy(), N, d, 0, smh)
                   / lq.numpy())
            ratio = (li / lq).numpy()  # = lambda_max(G^1/2 R W^T W R^T G^1/2) / lambda_max(G)
            lo, hi = float(sv[-1]) ** 2, float(sv[0]) ** 2
            out = np.maximum(np.maximum(lo - ratio, ratio - hi), 0.0)
            # G = 0 (every permitted key zero): both spaces have lambda = 0, nothing to compare
            null = ((li == 0) & (lq == 0)).numpy()
            out = np.where(multi.numpy() & ~null, out, 0.0)
            ch.add("hessian_sandwich", np.where(np.arange(H)[:, None] == h, out[None], 0.0),
                   np.where(np.arange(H)[:, None] == h, (hi * eps)[None], 1.0),
                   "lambda_in / lambda_q outside [sigma_min^2, sigma_max^2] of W^_q "
                   "(docs/math.md section 3)")
            info[h]["sigma_wq_sq"] = (lo, hi)


def _abs_feature(st: fast.Step, h: int, i: int, space: str) -> torch.Tensor:
    """``|L| |k~_j|`` (input space) or ``|a^_j|`` (query space): the size of each feature's
    terms, ``(N, D)``."""
    P: fast.Projected = st.extras["projected"]
    if space == "query":
        return fast.query_features(st, h, i).abs()
    L = P.lmap(slice(i, i + 1))[h, 0]  # (m+1, d)
    return P.k[h].abs() @ L.abs().T


def _reuse_checks(ch: _Checks, info: list[dict], m64: RoPEAttention, spec: HeadSpec,
                  w: HeadWeights, x: torch.Tensor, pos: torch.Tensor, n_reuse: int) -> None:
    """(c) of :func:`check_module`: frozen reuse on the prefix bank, against the module."""
    T = int(x.shape[0])
    R = min(n_reuse, T - 1)
    n0 = T - R
    H, d, m, r = spec.n_heads, spec.head_dim, int(x.shape[1]), spec.r
    pstar = int(pos[n0])
    xq, xb = x[n0:], x[:n0]
    pq = torch.full((R,), pstar, dtype=torch.int64)
    st = fast.step(spec, w, xq, pq, xb, pos[:n0], "bank", gauge="original",
                   keep=("c", "t", "b"))
    ru = fast.frozen_reuse(st, anchor=0, bound=spec.affine)
    P: fast.Projected = st.extras["projected"]
    # the module's own output with the prefix bank: each query appended at position p*, its
    # own key masked out (docs/math.md section 6)
    seq = torch.cat((xb[None].expand(R, n0, m), xq[:, None]), 1)  # (R, n0+1, m)
    ps = torch.cat((pos[:n0], torch.tensor([pstar])))
    mk = torch.ones(n0 + 1, n0 + 1, dtype=torch.bool).tril()
    mk[n0, n0] = False
    with torch.no_grad():
        y_nat = m64.head_outputs(seq, ps, mk)[:, :, n0].transpose(0, 1)  # (H, R, r)
    S, sm, n = _per_query(P.v, st.s, st.mask)
    # kappa of the frozen readout mu + q_i T_a: sum_j |c_aj| |q_i| . |k~_j| (...) / S
    vq = (P.v[:, None] - st.mu[:, :, None]) * st.mask[None, :, :, None]
    wa = st.c[:, :1].abs() * (P.q.abs() @ P.k.abs().transpose(-1, -2))
    kap_fr = kernel.kappa_sum(wa, vq, P.v, st.mask)
    kap = (st.kappa + kap_fr).numpy()
    tol = tl.identity_check_tol(torch.float64, kap, n, d, sm)
    tok = ru.tokenwise
    ch.add("reuse_tokenwise", (ru.error - tok).abs().amax(-1).numpy() / S, tol,
           "measured frozen-reuse error vs the tokenwise formula (docs/math.md section 6)")
    e_nat = y_nat - ru.frozen
    tol_n = tol + tl.agreement_rel_tol(torch.float64, n0 + 1, d, m)
    ch.add("reuse_native", (e_nat - tok).abs().amax(-1).numpy() / S, tol_n,
           "the module's prefix-bank output minus the frozen readout vs the tokenwise formula")
    if ru.bound is not None:
        en = torch.linalg.vector_norm(e_nat, dim=-1).numpy()
        slack = math.sqrt(r) * tol_n * S + ru.bound.numpy() * tl.FLOAT64_REL
        ch.add("reuse_bound", np.maximum(en - ru.bound.numpy(), 0.0), slack,
               "||e_i|| <= ||u_i|| ||Delta M_i - Delta M_a||_op (docs/math.md section 6)")
    dev = torch.linalg.vector_norm(y_nat - st.mu, dim=-1)
    rel = torch.linalg.vector_norm(e_nat, dim=-1) / dev.clamp_min(tl.SCALE_GUARD)
    for h in range(H):
        info[h]["reuse_rel_error_median"] = float(rel[h, 1:].median()) if R > 1 else math.nan
        info[h]["reuse_rel_error_max"] = worst(rel[h, 1:], default=math.nan)


def check_gpt(model: GPT, idx: torch.Tensor, positions: Any = None, **kw: Any) -> dict:
    """:func:`check_module` on every layer of ``model``, with the attention inputs of one forward
    of ``idx`` (its first sequence).  Returns ``{"passed", "layers": [...]}``."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT, got {type(model).__name__}")
    cap = model.capture(idx[:1], positions)
    res = [check_module(b.attn, c.x[0], positions, **kw)
           for b, c in zip(model.blocks, cap.layers)]
    return {"passed": all(r["passed"] for r in res), "layers": res}


__all__ = [
    "VARIANTS", "AttentionConfig", "RoPEAttention", "HFAttention", "GPTConfig", "GPT", "Block",
    "RMSNorm", "LayerCapture", "GPTCapture", "replace_attention", "check_module", "check_gpt",
    "check_frequency_ordering", "cosine_bound", "cosine_bound_ratio",
]


# ---------------------------------------------------------------------------------------------
# checkpoints (written by ropestep train-families)
# ---------------------------------------------------------------------------------------------
CHECKPOINT_SCHEMA = "ropestep.train_families.checkpoint/1"


def is_checkpoint(path: Any) -> bool:
    """``path`` is one file of a ``<variant>.safetensors`` + ``<variant>.json`` checkpoint pair."""
    p = Path(str(path)).expanduser()
    js = p.with_suffix(".json")
    if p.suffix not in (".safetensors", ".json") or not js.is_file():
        return False
    try:
        import json

        return json.loads(js.read_text()).get("schema") == CHECKPOINT_SCHEMA
    except (OSError, ValueError):
        return False


def load_checkpoint(path: Any, device: str = "cpu") -> "GPT":
    """A :class:`GPT` from ``<variant>.json`` or ``<variant>.safetensors`` (the other file of
    the pair beside it), in eval mode."""
    import json

    from safetensors.torch import load_model

    js = Path(str(path)).expanduser().with_suffix(".json")
    info = json.loads(js.read_text())
    if info.get("schema") != CHECKPOINT_SCHEMA:
        raise ValueError(f"{js.name} is not a train-families checkpoint config")
    gc = dict(info["gpt_config"])
    gc["base_range"] = tuple(gc["base_range"])
    model = GPT(GPTConfig(**gc))
    load_model(model, str(js.parent / info["weights"]), device=str(device))
    return model.to(device).eval()
