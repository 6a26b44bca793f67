"""The model's own intermediate tensors of its attention layers, recorded during a forward pass.

Every attention module of transformers that this adapter opens computes its scores in a function
named ``eager_attention_forward`` of its modeling module (looked up by name at call time, through
``ALL_ATTENTION_FUNCTIONS.get_interface(..., eager_attention_forward)``), which receives the
*rotated* (and, where the model has them, normalised) queries and keys, the values, the additive
attention mask, and the keyword arguments that define the score: ``scaling``, ``softcap``,
``sliding_window``, ``s_aux`` (attention sinks).  :func:`recording` replaces that global for the
duration of a ``with`` block by a wrapper that calls the original unchanged and keeps what it
received and returned, per decoder layer; a forward pre-hook on the attention module keeps its
input ``hidden_states`` and the ``position_embeddings`` (the layer's RoPE tables) it was given.

Nothing here interprets the tensors: :mod:`ropestep.models.conventions` reads the conventions
from them and checks its reading against them.
"""
from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from .errors import UnsupportedModelError
from .structure import attention_module, layer_modules, model_name

EAGER = "eager_attention_forward"


@dataclass
class AttentionRecord:
    """What one attention call of one layer saw (tensors detached, on their device)."""

    hidden: torch.Tensor | None = None  # (B, n, m) the attention module's input
    cos: torch.Tensor | None = None  # (B, n, R) position_embeddings[0] as passed to the module
    sin: torch.Tensor | None = None
    query: torch.Tensor | None = None  # (B, H, n, d) as passed to eager_attention_forward
    key: torch.Tensor | None = None  # (B, H_kv, N, d) (the cache's keys included)
    value: torch.Tensor | None = None  # (B, H_kv, N, r)
    mask: torch.Tensor | None = None  # the additive mask as passed (None where there is none)
    kwargs: dict = field(default_factory=dict)  # scaling, softcap, sliding_window, s_aux, ...
    output: torch.Tensor | None = None  # (B, n, H, r) the eager function's output
    weights: torch.Tensor | None = None  # (B, H, n, N) its attention probabilities


def _bind(fn: Any, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by parameter name, a ``**kwargs`` catch-all merged in."""
    try:
        sig = inspect.signature(fn)
        named = dict(sig.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(named.get(name), dict):
            named.update(named.pop(name))
    return named


@contextmanager
def recording(model: Any, layers: Sequence[int], *, keep: Sequence[str] = (
        "hidden", "cos", "sin", "query", "key", "value", "mask", "kwargs", "output", "weights")
              ) -> Iterator[dict[int, list[AttentionRecord]]]:
    """Record every attention call of ``layers`` (one :class:`AttentionRecord` per call).

    Only the fields named in ``keep`` are kept (the others stay ``None``/empty), so a capture over
    a long sequence does not hold every layer's probabilities.  The modeling modules' globals and
    the hooks are restored on exit, whatever happens inside.
    """
    who = model_name(model)
    mods = layer_modules(model)
    rec: dict[int, list[AttentionRecord]] = {int(L): [] for L in layers}
    owner: dict[int, int] = {}
    modules: dict[str, Any] = {}
    handles = []
    for L in rec:
        attn = attention_module(mods[L], who, L)
        owner[id(attn)] = L
        name = type(attn).__module__
        mm = sys.modules.get(name)
        if mm is None or not callable(getattr(mm, EAGER, None)):
            raise UnsupportedModelError(
                f"{who}: the attention of layer {L} ({type(attn).__name__}) does not compute its "
                f"scores in {name}.{EAGER}, so its intermediate tensors cannot be read")
        modules[name] = mm

    def pre_hook(L: int, attn: Any):
        def hook(mod: Any, args: tuple, kwargs: dict) -> None:
            a = _bind(mod.forward, args, kwargs)
            r = AttentionRecord()
            hs = a.get("hidden_states", args[0] if args else None)
            if "hidden" in keep and torch.is_tensor(hs):
                r.hidden = hs.detach()
            pe = a.get("position_embeddings")
            if pe is not None and ("cos" in keep or "sin" in keep):
                r.cos, r.sin = pe[0].detach(), pe[1].detach()
            rec[L].append(r)
        return hook

    originals = {name: getattr(mm, EAGER) for name, mm in modules.items()}

    def wrapper_for(orig: Any):
        def wrapper(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                    *args: Any, **kwargs: Any) -> Any:
            out = orig(module, query, key, value, attention_mask, *args, **kwargs)
            L = owner.get(id(module))
            if L is not None:
                if not rec[L]:
                    raise RuntimeError(f"{who}: layer {L} computed attention before its input "
                                       "was recorded (the module's forward was bypassed)")
                r = rec[L][-1]
                if r.kwargs.get("_seen"):
                    raise RuntimeError(f"{who}: layer {L} called {EAGER} twice in one forward")
                named = _bind(orig, (module, query, key, value, attention_mask, *args), kwargs)
                if "query" in keep:
                    r.query = query.detach()
                if "key" in keep:
                    r.key = key.detach()
                if "value" in keep:
                    r.value = value.detach()
                if "mask" in keep and torch.is_tensor(attention_mask):
                    r.mask = attention_mask.detach()
                if "kwargs" in keep:
                    r.kwargs = {k: (v.detach() if torch.is_tensor(v) else v)
                                for k, v in named.items()
                                if k not in ("module", "query", "key", "value", "attention_mask")}
                r.kwargs["_seen"] = True
                if isinstance(out, tuple) and out:
                    if "output" in keep:
                        r.output = out[0].detach()
                    if "weights" in keep and len(out) > 1 and torch.is_tensor(out[1]):
                        r.weights = out[1].detach()
            return out
        return wrapper

    try:
        for name, mm in modules.items():
            setattr(mm, EAGER, wrapper_for(originals[name]))
        for L in rec:
            attn = attention_module(mods[L], who, L)
            handles.append(attn.register_forward_pre_hook(pre_hook(L, attn), with_kwargs=True))
        yield rec
    finally:
        for h in handles:
            h.remove()
        for name, mm in modules.items():
            setattr(mm, EAGER, originals[name])


def probe_forward(model: Any, n_tokens: int = 12, *, layers: Sequence[int] | None = None,
                  seed: int = 0, keep: Sequence[str] | None = None
                  ) -> dict[int, AttentionRecord]:
    """One batch-1 eager forward over ``n_tokens`` seeded token ids at positions ``0..n-1``,
    every layer's first attention call recorded (the conventions are read from it)."""
    impl = getattr(model.config, "_attn_implementation", None)
    who = model_name(model)
    if impl != "eager":
        raise UnsupportedModelError(
            f"{who}: reading conventions needs attn_implementation='eager', the model uses "
            f"{impl!r}")
    Ls = list(range(len(layer_modules(model)))) if layers is None else [int(L) for L in layers]
    vocab = int(model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n_tokens), generator=g)
    dev = next(model.parameters()).device
    kw = {} if keep is None else {"keep": tuple(keep)}
    with recording(model, Ls, **kw) as rec, torch.no_grad():
        try:
            model(input_ids=ids.to(dev), position_ids=torch.arange(n_tokens, device=dev)[None],
                  use_cache=False)
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            text = " ".join(str(err).split())[:200]
            raise UnsupportedModelError(
                f"{who}: the forward that reads the conventions failed: "
                f"{type(err).__name__}: {text}") from None
    out = {}
    for L, rs in rec.items():
        if len(rs) != 1 or not rs[0].kwargs.get("_seen"):
            raise UnsupportedModelError(
                f"{who}: layer {L}'s attention ran {len(rs)} times in one forward "
                f"({'with' if rs and rs[0].kwargs.get('_seen') else 'without'} {EAGER}); expected once")
        out[L] = rs[0]
    return out
