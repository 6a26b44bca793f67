"""A zoo of tiny random-weight RoPE-softmax models, one per transformers architecture.

Each entry of :data:`ARCHITECTURES` is a tiny configuration of one transformers configuration
class (built with ``AutoConfig.for_model``; hidden 128, 2 layers — 3 where layer types alternate
— 4 query heads on 2 KV heads where the architecture has GQA, head_dim 32, vocabulary 256) that
exercises the conventions named in its ``what`` line: the RoPE scaling type, partial rotary
fraction, pair layout, sliding window, QK-norm, soft-capping, score scale, attention sink,
projection layout, residual form.  Configurations that transformers cannot build offline on a
CPU in float32 are listed in :data:`NOT_BUILDABLE` with the reason instead.

:func:`build` makes a seeded ``*ForCausalLM`` (eager attention, eval mode) and redraws its
attention weights so that scores are far from uniform: transformers' own initialisation
(N(0, 0.02), zero biases, neutral norms) gives scores of order 0.01 and near-uniform attention
rows, under which almost any wrong reading of a convention would go unnoticed.  The redraw is
generic — it reads each decoder layer's attention module (the child whose class name ends in
``Attention``), its ``scaling`` and ``head_dim``, and redraws what it finds there:

* every ``nn.Linear`` weight, with the standard deviation that gives scores of standard deviation
  about :data:`SCORE_STD` for unit-RMS inputs (whatever the layout: separate, fused ``qkv_proj``,
  per-head-interleaved ``query_key_value``), and every bias non-zero;
* every norm inside the attention module (QK-norm per head or over the whole projection) to a
  gain that gives the same score scale, since a normalised query's size no longer follows the
  projection's;
* every parameter held directly by the attention module (gpt-oss's per-head sink logits) to
  values at which the sink takes a visible share of the softmax mass;
* every other norm weight of the model is perturbed around its neutral value (its value after
  transformers' initialisation: 1 for ``x * w`` norms, 0 for Gemma's ``x * (1 + w)``), and every
  norm bias drawn small and non-zero.

Embeddings, MLPs and experts keep transformers' initialisation.  Everything is seeded by
``seed`` alone (``torch.Generator``; the global RNG is forked, not disturbed).

:func:`save` writes a built model and a 256-token byte-level tokenizer into a directory that
``AutoModelForCausalLM.from_pretrained``/``AutoTokenizer.from_pretrained`` open offline.

Torch and transformers (and tokenizers, which transformers requires) are imported inside the
functions; the decoder layers and attention modules are found as the adapter finds them
(:mod:`ropestep.models.structure`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .models.structure import attention_modules, layer_modules

VOCAB = 256  # one token per byte (see `save`)
HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 128, 32, 4, 2
SCORE_STD = 3.0  # target standard deviation of the pre-softmax scores (|score| up to ~10)
NORM_JITTER = 0.1  # std of the perturbation of norm weights around their (neutral) init value
NORM_BIAS_STD = 0.05  # std of norm biases (LayerNorm) outside attention
BIAS_FRACTION = 0.5  # std of a projection bias, as a fraction of the RMS of its outputs
SINK_STD = 0.5  # spread of the sink logits around their mean (see `_sink_mean`)
WINDOW = 16  # sliding window, in tokens, of every sliding-window configuration


@dataclass(frozen=True)
class Arch:
    """One tiny configuration: ``AutoConfig.for_model(model_type, **kwargs)``; ``what`` names the
    conventions it exercises."""

    model_type: str
    what: str
    kwargs: dict = field(default_factory=dict)

    def config(self) -> Any:
        """The transformers configuration object (nothing is built)."""
        import copy

        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **copy.deepcopy(self.kwargs))


# Sizes shared by every configuration; an entry's own kwargs override them.
_BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
             max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)  # the byte tokenizer of `save` has no special tokens
# The same without key/value heads, for the architectures with one key/value head per query head.
_MHA = {k: v for k, v in _BASE.items() if k != "num_key_value_heads"}
_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}
_MOE = dict(num_experts_per_tok=2, output_router_logits=False)

# A non-trivial short_factor (16 = HEAD_DIM // 2 entries) for LongRoPE, growing with wavelength.
_LONGROPE_SHORT = [round(1.0 + 0.1 * i, 2) for i in range(HEAD_DIM // 2)]
_LONGROPE_LONG = [round(1.0 + 0.5 * i, 2) for i in range(HEAD_DIM // 2)]


def _arch(model_type: str, what: str, base: dict | None = None, **kwargs: Any) -> Arch:
    return Arch(model_type, what, {**(_BASE if base is None else base), **kwargs})


ARCHITECTURES: dict[str, Arch] = {
    "llama": _arch(
        "llama", "plain RoPE (rotate-half pairs, theta 1e4), separate q/k/v/o, RMSNorm, GQA 2:1",
        rope_parameters=dict(_ROPE)),
    "llama3": _arch(
        "llama", "llama3 RoPE scaling (factor 8, low/high freq 1/4, original context 64: "
        "all three frequency bands present at head_dim 32)",
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "llama_linear": _arch(
        "llama", "linear RoPE scaling (position interpolation, factor 4)",
        rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}),
    "llama_dynamic": _arch(
        "llama", "dynamic-NTK RoPE (factor 4); max_position_embeddings 128 so that sequences "
        "longer than 128 tokens change the base (the tables then depend on the sequence length)",
        max_position_embeddings=128,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 4.0}),
    "llama_yarn": _arch(
        "llama", "YaRN RoPE (factor 4 over an original context of 256, attention factor "
        "0.1 ln 4 + 1 on cos/sin)",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256}),
    "llama_longrope": _arch(
        "llama", "LongRoPE (per-frequency short/long factors, switch above 256 tokens, "
        "attention factor sqrt(1 + ln 4 / ln 256))",
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                         "short_factor": _LONGROPE_SHORT, "long_factor": _LONGROPE_LONG,
                         "original_max_position_embeddings": 256, "factor": 4.0}),
    "qwen2_yarn": _arch(
        "qwen2", "Qwen2.5 long-context form: YaRN (factor 4, original 256), q/k/v biases",
        rope_parameters={"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256}),
    "mistral": _arch(
        "mistral", f"sliding window {WINDOW} on every layer, plain RoPE",
        sliding_window=WINDOW, rope_parameters=dict(_ROPE)),
    "mixtral": _arch(
        "mixtral", "MoE MLP (4 experts, top 2) with standard attention, no sliding window",
        sliding_window=None, num_local_experts=4, rope_parameters=dict(_ROPE), **_MOE),
    "qwen2_moe": _arch(
        "qwen2_moe", "MoE with a shared expert; q/k/v biases, no sliding window",
        num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **_MOE),
    "qwen3": _arch(
        "qwen3", "QK-norm per head (RMSNorm over head_dim, before RoPE), explicit head_dim",
        head_dim=HEAD_DIM, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3_moe": _arch(
        "qwen3_moe", "QK-norm per head, MoE MLP (4 experts, top 2)",
        head_dim=HEAD_DIM, num_experts=4, moe_intermediate_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **_MOE),
    "gemma": _arch(
        "gemma", "Gemma RMSNorm x*(1+w), embeddings scaled by sqrt(hidden), GELU",
        head_dim=HEAD_DIM, rope_parameters=dict(_ROPE)),
    "gemma2": _arch(
        "gemma2", f"attention logit soft-capping 20, query_pre_attn_scalar 48 != head_dim 32, "
        f"sliding window {WINDOW} on layers 0 and 2, final-logit soft-capping, sandwich norms",
        num_hidden_layers=3, head_dim=HEAD_DIM, query_pre_attn_scalar=48,
        attn_logit_softcapping=20.0, final_logit_softcapping=30.0, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(_ROPE)),
    "gemma3": _arch(
        "gemma3_text", f"QK-norm per head (x*(1+w)), per-layer-type RoPE (local theta 1e4 on "
        f"sliding layers, linear-scaled x8 theta 1e6 on full ones), window {WINDOW}, "
        "query_pre_attn_scalar 24",
        num_hidden_layers=3, head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": _arch(
        "phi3", "fused qkv_proj (q|k|v blocks), fused gate_up_proj, partial rotary 0.5",
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "partial_rotary_factor": 0.5}),
    "phi": _arch(
        "phi", "partial rotary 0.5, biased q/k/v and dense output, LayerNorm, parallel "
        "attention/MLP block sharing one input norm",
        partial_rotary_factor=0.5, rope_parameters=dict(_ROPE)),
    "stablelm": _arch(
        "stablelm", "partial rotary 0.25, q/k/v biases, LayerNorm, sequential residual",
        partial_rotary_factor=0.25, use_qkv_bias=True, rope_parameters=dict(_ROPE)),
    "gpt_neox": _arch(
        "gpt_neox", "fused per-head-interleaved query_key_value ([h][q|k|v]), rotary_pct 0.25, "
        "parallel residual, biases, LayerNorm, no GQA",
        base=_MHA, rotary_pct=0.25, rope_parameters=dict(_ROPE)),
    "olmo": _arch(
        "olmo", "non-parametric LayerNorm (no weight, no bias), no biases",
        rope_parameters=dict(_ROPE)),
    "olmo2": _arch(
        "olmo2", "QK-norm over the whole projection (RMSNorm over heads*head_dim, before the "
        "head split and RoPE), post-norms",
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
    "cohere": _arch(
        "cohere", "interleaved RoPE pairs (2i, 2i+1), parallel attention/MLP block, bias-free "
        "LayerNorm, logit_scale",
        rope_parameters=dict(_ROPE)),
    "glm": _arch(
        "glm", "interleaved RoPE pairs on the first half (partial rotary 0.5), q/k/v biases",
        head_dim=HEAD_DIM, partial_rotary_factor=0.5, rope_parameters=dict(_ROPE)),
    "granite": _arch(
        "granite", "score scale attention_multiplier 1/32 (not head_dim^-1/2), embedding/"
        "residual/logit multipliers",
        attention_multiplier=1.0 / 32, embedding_multiplier=4.0, residual_multiplier=0.5,
        logits_scaling=2.0, rope_parameters=dict(_ROPE)),
    "helium": _arch(
        "helium", "Llama-like with explicit head_dim, theta 1e5",
        head_dim=HEAD_DIM, rope_parameters={"rope_type": "default", "rope_theta": 100_000.0}),
    "smollm3": _arch(
        "smollm3", "NoPE layer: layer 0 rotary, layer 1 without RoPE (no_rope_layers [1, 0])",
        no_rope_layers=[1, 0], rope_parameters=dict(_ROPE)),
    "starcoder2": _arch(
        "starcoder2", "biases on q/k/v and o_proj, LayerNorm, no sliding window",
        use_bias=True, sliding_window=None, rope_parameters=dict(_ROPE)),
    "gpt_oss": _arch(
        "gpt_oss", f"learned attention sink per head (s_aux), sliding window {WINDOW} on layers "
        "0 and 2, YaRN (factor 4, original 256), biases, MoE (4 experts, top 2)",
        num_hidden_layers=3, head_dim=HEAD_DIM, intermediate_size=128, num_local_experts=4,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 256},
        **_MOE),
}

_MLA = dict(num_key_value_heads=HEADS, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=32, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64,
            first_k_dense_replace=1, n_group=1, topk_group=1, **_MOE)
ARCHITECTURES.update({
    "deepseek_v3": _arch(
        "deepseek_v3", "multi-head latent attention (latent rank 32, rotated part 16 of each "
        "head's 32, query latent 48, rope_interleave), MoE from layer 1",
        base=_MHA, **_MLA, rope_parameters=dict(_ROPE)),
    "deepseek_v3_yarn": _arch(
        "deepseek_v3", "latent attention with YaRN (factor 4 over 256, mscale 1 on every dim: "
        "the module's scaling carries mscale^2)",
        base=_MHA, **_MLA,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
    "deepseek_v2_lite": _arch(
        "deepseek_v2", "latent attention without a query latent (q_lora_rank None: the score is "
        "affine in u, the input-space step exists), split-half rotation",
        base=_MHA, **{**_MLA, "q_lora_rank": None}, rope_parameters=dict(_ROPE)),
})

ARCHITECTURES.update({
    "falcon": _arch(
        "falcon", "multi-query attention in one fused query_key_value ([q heads; k; v]), "
        "parallel attention/MLP, LayerNorm, no biases",
        base=_MHA, multi_query=True, new_decoder_architecture=False, alibi=False,
        rope_parameters=dict(_ROPE)),
    "falcon_grouped": _arch(
        "falcon", "Falcon's new decoder architecture: query_key_value grouped per KV head "
        "([its 2 q heads; k_g; v_g] for each of 2 groups)",
        base=_MHA, num_kv_heads=KV_HEADS, new_decoder_architecture=True, alibi=False,
        rope_parameters=dict(_ROPE)),
})

ARCHITECTURES.update({
    "dbrx": _arch(
        "dbrx", "one fused Wqkv with DBRX's clip_qkv at 2 (active: projections of RMS ~1.7 "
        "clipped to [-2, 2], so the score is not affine in u), GQA 2:1, MoE",
        base={k: v for k, v in _MHA.items() if k not in (
            "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "max_position_embeddings")},
        d_model=HIDDEN, n_heads=HEADS, n_layers=2, max_seq_len=1024,
        attn_config={"rope_theta": 10_000.0, "kv_n_heads": KV_HEADS, "clip_qkv": 2.0},
        ffn_config={"ffn_hidden_size": 256, "moe_num_experts": 4, "moe_top_k": 2}),
    "persimmon": _arch(
        "persimmon", "per-head LayerNorm QK-norm with a bias (qk_layernorm: mean removed, not "
        "an RMS norm; HeadSpec.norm_kind 'layer'), fused per-head query_key_value, partial "
        "rotary 0.5, in query space",
        base=_MHA, qk_layernorm=True, partial_rotary_factor=0.5, rope_parameters=dict(_ROPE)),
    "bloom": _arch(
        "bloom", "ALiBi computed inside the module (no rotary embedding, no score function): "
        "the bias slope_h p_j handed as `alibi`, per-head fused query_key_value, scale "
        "inv_norm_factor, LayerNorm, residual added inside the attention",
        base=_MHA),
    "mpt": _arch(
        "mpt", "ALiBi computed inside the module: the bias handed as `position_bias` "
        "(max_seq_len columns, the last N used), fused Wqkv [q; k; v], a boolean mask whose "
        "True entries are masked, scale softmax_scale, no biases",
        base=_MHA, expansion_ratio=2),
    "doge": _arch(
        "doge", "a data-dependent additive mask per head and key (Doge's dynamic mask, computed "
        "from the values): refused with one line (not modelled; the zoo's refused outcome)",
        rope_parameters=dict(_ROPE)),
})

# name -> why transformers 5.24 cannot build it offline on CPU in float32 (filled in only for
# configurations that were tried and failed; see the module docstring).
NOT_BUILDABLE: dict[str, str] = {}


def _head_dim(attn: Any, config: Any) -> int:
    for name in ("head_dim", "head_size"):
        value = getattr(attn, name, None)
        if isinstance(value, int):
            return value
    try:
        explicit = getattr(config, "head_dim", None)
        return int(explicit or config.hidden_size // config.num_attention_heads)
    except Exception:  # noqa: BLE001 - no head count to read (RWKV): the default 32 stands
        return HEAD_DIM


def _sink_mean(window: int) -> float:
    """Mean sink logit at which a sink takes a visible share (roughly a fifth to a half) of the
    mass of a row of ``window`` keys whose scores have standard deviation SCORE_STD: one below
    the row's expected log-sum-exp, log n + s^2/2."""
    return math.log(window) + SCORE_STD ** 2 / 2 - 1.0


def is_norm(module: Any) -> bool:
    """A normalisation layer: any module whose class name contains ``Norm``."""
    return "norm" in type(module).__name__.lower()


def _redraw_attention(attn: Any, config: Any, g: Any) -> None:
    """Redraw one attention module's weights in place (see the module docstring)."""
    from torch import nn

    hd = _head_dim(attn, config)
    scaling = getattr(attn, "scaling", None)
    scaling = float(scaling) if isinstance(scaling, (int, float)) else hd ** -0.5
    # Scores s * q.k over hd dimensions with q, k entries of RMS r have std ~ s * sqrt(hd) * r^2;
    # r = sigma * sqrt(d_in) for a unit-RMS input through a N(0, sigma^2) projection.
    r = math.sqrt(SCORE_STD / (scaling * math.sqrt(hd)))
    for _, mod in attn.named_modules():
        if isinstance(mod, nn.Linear):
            mod.weight.normal_(0.0, r / math.sqrt(mod.in_features), generator=g)
            if mod.bias is not None:
                mod.bias.normal_(0.0, BIAS_FRACTION * r, generator=g)
        elif is_norm(mod) and mod is not attn:
            # A normalised query/key has RMS |gain|, whatever the projection: give it r.
            _perturb_norm(mod, gain=r, g=g)
    kvb = getattr(attn, "kv_b_proj", None)
    nope, vd = getattr(attn, "qk_nope_head_dim", None), getattr(attn, "v_head_dim", None)
    if isinstance(kvb, nn.Linear) and isinstance(nope, int) and isinstance(vd, int):
        # latent attention: the latent c (RMS r after its norm) feeds both the keys and the
        # values; the value rows drawn 1/r smaller keep the values at the other architectures'
        # scale (the validate criterion's atol is absolute)
        w = kvb.weight.view(-1, nope + vd, kvb.in_features)
        w[:, nope:] /= r
    for _, p in attn.named_parameters(recurse=False):
        # Parameters held by the attention module itself: per-head sink logits (gpt-oss).
        window = getattr(attn, "sliding_window", None) or WINDOW
        p.normal_(_sink_mean(int(window)), SINK_STD, generator=g)


def _perturb_norm(mod: Any, gain: float, g: Any) -> None:
    """Set a norm's weight to ``gain`` times its neutral multiplier (plus NORM_JITTER * gain
    noise) and draw its bias.  The neutral value is the weight transformers initialised (1 for
    ``x * w``, 0 for ``x * (1 + w)``): the effective multiplier is ``w + 1 - w0``."""
    import torch

    w = getattr(mod, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        w0 = w.detach().clone()
        noise = torch.randn(w.shape, generator=g, dtype=w.dtype)
        w.copy_(w0 + (gain - 1.0) + NORM_JITTER * gain * noise)
    b = getattr(mod, "bias", None)
    if isinstance(b, torch.Tensor) and b.dim() == 1:
        b.normal_(0.0, NORM_BIAS_STD * gain, generator=g)


def build(name: str, seed: int = 0, dtype: Any = None) -> Any:
    """A seeded random ``*ForCausalLM`` of architecture ``name`` (a key of ARCHITECTURES), in
    eval mode with eager attention and scores far from uniform.  ``dtype`` defaults to
    ``torch.float32``; the redraw is done in float32 and the model cast afterwards."""
    import torch

    if name not in ARCHITECTURES:
        why = NOT_BUILDABLE.get(name)
        raise KeyError(f"{name}: " + (f"not buildable: {why}" if why else
                                      f"unknown; known: {', '.join(ARCHITECTURES)}"))
    model = _built(ARCHITECTURES[name].config(), seed)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    return model


def _built(config: Any, seed: int) -> Any:
    """A configuration built as the zoo builds it: seeded, eval mode, eager, redrawn."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                 dtype=torch.float32)
    model.eval()
    redraw(model, config, seed)
    return model


def redraw(model: Any, config: Any, seed: int) -> None:
    """Redraw a built model's attention weights and perturb its other norms in place (module
    docstring), seeded by ``seed + 1``; a hybrid's layers without an attention module keep
    their initialisation (and so does a model whose decoder layers the adapter cannot find)."""
    import torch

    from .models.errors import UnsupportedModelError

    g = torch.Generator().manual_seed(seed + 1)
    try:
        layers = list(layer_modules(model))
    except UnsupportedModelError:  # no decoder layers to find: the adapter refuses it anyway
        layers = []
    with torch.no_grad():
        attns = [a for layer in layers for _, a in attention_modules(layer)]
        inside = {id(m) for a in attns for m in a.modules()}
        for _, mod in model.named_modules():
            if is_norm(mod) and id(mod) not in inside:
                _perturb_norm(mod, gain=1.0, g=g)
        for attn in attns:
            _redraw_attention(attn, config, g)


def _byte_tokenizer() -> Any:
    """A byte-level tokenizer with one token per byte (id = byte value) and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def save(name: str, directory: str | Path, seed: int = 0) -> Path:
    """``build(name, seed)`` saved with ``save_pretrained`` into ``directory`` (created), with
    a 256-token byte-level tokenizer (token id = byte value, no special tokens); returns the
    directory.  (For ``qwen2`` transformers loads it as its ``Qwen2Tokenizer``, which also
    NFC-normalises the text first.)"""
    return save_model(build(name, seed), directory)


def save_model(model: Any, directory: str | Path) -> Path:
    """A built model saved with ``save_pretrained`` into ``directory`` (created), with the
    256-token byte-level tokenizer of :func:`save`; returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _byte_tokenizer().save_pretrained(path)
    # Say "no special tokens" explicitly: for some model types (qwen2) AutoTokenizer replaces the
    # saved class by the architecture's own, which would otherwise add <|endoftext|> as id 256.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({f"{k}_token": None for k in ("bos", "eos", "unk", "pad")})
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path
