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

A module that computes its scores *inline* (BLOOM's and MPT's attention: no such function, an
ALiBi bias handed to the module as ``alibi`` or ``position_bias``) is recorded around the module
instead (:func:`inline_bias_arg`): its input, the bias and mask it was handed, the probabilities
it returns, and the heads' output as the output projection's input.  Its queries, keys and
values are never handed to a function, so they are not recorded: the reading proves the layout,
scale and slopes it reads by reproducing those probabilities and that output.

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
from .structure import attention_module, attention_modules, layer_modules, model_name

EAGER = "eager_attention_forward"
# the parameters by which an attention module that computes its scores inline is handed an
# additive position bias (ALiBi: BLOOM's ``alibi``, MPT's ``position_bias``)
INLINE_BIAS_ARGS = ("alibi", "position_bias")


def inline_bias_arg(attn: Any) -> str | None:
    """The parameter of ``attn.forward`` that hands it an additive position bias, for a module
    whose modeling module has no :data:`EAGER` function (it computes its scores inline), or
    None."""
    if eager_module(attn) is not None:
        return None
    try:
        params = inspect.signature(attn.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((n for n in INLINE_BIAS_ARGS if n in params), None)


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
    complex_tables: bool = False  # position_embeddings was one complex tensor (Llama 4)
    # the module's plain (int/float/str/bool) call arguments besides its inputs (Zamba 2's
    # layer_idx): what a second call of the module on other inputs must be given too
    call: dict = field(default_factory=dict)
    o_in: torch.Tensor | None = None  # the output projection's input (kept on request)
    o_out: torch.Tensor | None = None  # the output projection's output (kept on request)
    # an inline module (:func:`inline_bias_arg`): the additive position bias it was handed (as
    # passed: BLOOM ``(B H, 1, N)``, MPT ``(H, 1, max_seq_len)``); ``output`` is then the output
    # projection's input viewed as ``(B, n, H, r)`` and ``query``/``key``/``value`` stay None
    bias: torch.Tensor | None = None
    inline: bool = False


def tables(pe: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of a layer's ``position_embeddings``: the usual pair, or one complex tensor
    ``e^{i p omega}`` (Llama 4's ``freqs_cis``: one entry per rotated pair), split into its real
    and imaginary parts."""
    if torch.is_tensor(pe):
        if not pe.is_complex():
            raise UnsupportedModelError("position_embeddings is one real tensor, neither a "
                                        "(cos, sin) pair nor complex rotations")
        return pe.real.detach(), pe.imag.detach()
    return pe[0].detach(), pe[1].detach()


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
        "hidden", "cos", "sin", "query", "key", "value", "mask", "kwargs", "output", "weights"),
              keep_query: Sequence[int] = ()) -> Iterator[dict[int, list[AttentionRecord]]]:
    """Record every attention call of ``layers`` (one :class:`AttentionRecord` per call).

    Only the fields named in ``keep`` are kept (the others stay ``None``/empty), so a capture over
    a long sequence does not hold every layer's probabilities; ``"o_in"``/``"o_out"`` (not kept
    by default) add a hook on the layer's output projection that keeps its input/output;
    ``keep_query`` names layers whose queries are kept whatever ``keep`` says (a capture's
    per-run check of a query temperature).  The modeling modules' globals and the hooks are
    restored on exit, whatever happens inside.
    """
    who = model_name(model)
    mods = layer_modules(model)
    rec: dict[int, list[AttentionRecord]] = {int(L): [] for L in layers}
    owner: dict[int, int] = {}
    modules: dict[str, Any] = {}
    inline: dict[int, str] = {}  # layer -> its bias parameter, for inline modules
    handles = []
    for L in rec:
        attn = attention_module(mods[L], who, L)
        owner[id(attn)] = L
        name = type(attn).__module__
        mm = sys.modules.get(name)
        if mm is None or not callable(getattr(mm, EAGER, None)):
            arg = inline_bias_arg(attn)
            if arg is None:
                raise UnsupportedModelError(
                    f"{who}: the attention of layer {L} ({type(attn).__name__}) does not compute "
                    f"its scores in {name}.{EAGER} and is handed no ALiBi bias "
                    f"({', '.join(INLINE_BIAS_ARGS)}), so its intermediate tensors cannot be read")
            inline[L] = arg
            continue
        modules[name] = mm

    def pre_hook(L: int, attn: Any):
        def hook(mod: Any, args: tuple, kwargs: dict) -> None:
            a = _bind(mod.forward, args, kwargs)
            r = AttentionRecord()
            hs = a.get("hidden_states", args[0] if args else None)
            if "hidden" in keep and torch.is_tensor(hs):
                r.hidden = hs.detach()
            r.call = {k: v for k, v in a.items() if isinstance(v, (int, float, str, bool))
                      and not isinstance(v, type(None)) and k not in ("use_cache",
                                                                      "output_attentions")}
            pe = a.get("position_embeddings")
            if pe is not None and ("cos" in keep or "sin" in keep):
                r.cos, r.sin = tables(pe)
                r.complex_tables = torch.is_tensor(pe)
            if L in inline:
                r.inline = True
                b, mk = a.get(inline[L]), a.get("attention_mask")
                if torch.is_tensor(b):
                    r.bias = b.detach()
                if "mask" in keep and torch.is_tensor(mk):
                    r.mask = mk.detach()
            rec[L].append(r)
        return hook

    def post_hook(L: int):
        """An inline module's return: ``(output, probabilities, ...)``; its heads' output is the
        output projection's input (recorded by ``o_hook`` during the call)."""
        def hook(mod: Any, args: tuple, out: Any) -> None:
            if not rec[L]:
                return
            r = rec[L][-1]
            if r.kwargs.get("_seen"):
                raise RuntimeError(f"{who}: layer {L}'s attention module returned twice for one "
                                   "call")
            w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if torch.is_tensor(w) and w.dim() == 4:
                r.kwargs["n_keys"] = int(w.shape[-1])  # the bias guard's key count
                if "weights" in keep:
                    r.weights = w.detach()
                if r.o_in is not None and "output" in keep:
                    B, H, nq = w.shape[:3]
                    r.output = r.o_in.reshape(B, nq, H, -1)
            if "o_in" not in keep:
                r.o_in = None
            r.kwargs["_seen"] = True
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
                if "query" in keep or L in keep_query:
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

    def o_hook(L: int):
        def hook(mod: Any, args: tuple, out: Any) -> None:
            if not rec[L]:
                return
            r = rec[L][-1]
            if ("o_in" in keep or L in inline) and args and torch.is_tensor(args[0]):
                r.o_in = args[0].detach()
            if "o_out" in keep and torch.is_tensor(out):
                r.o_out = out.detach()
        return hook

    try:
        for name, mm in modules.items():
            setattr(mm, EAGER, wrapper_for(originals[name]))
        for L in rec:
            attn = attention_module(mods[L], who, L)
            handles.append(attn.register_forward_pre_hook(pre_hook(L, attn), with_kwargs=True))
            if L in inline:
                handles.append(attn.register_forward_hook(post_hook(L)))
            if "o_in" in keep or "o_out" in keep or L in inline:
                from .structure import output_projection

                try:
                    out_lin = output_projection(attn, who, L)[1]
                except UnsupportedModelError:
                    continue  # the reading refuses the layer, naming what it found
                handles.append(out_lin.register_forward_hook(o_hook(L)))
        yield rec
    finally:
        for h in handles:
            h.remove()
        for name, mm in modules.items():
            setattr(mm, EAGER, originals[name])


def eager_module(attn: Any) -> Any:
    """The modeling module of ``attn``'s class when it defines ``eager_attention_forward``."""
    mm = sys.modules.get(type(attn).__module__)
    return mm if mm is not None and callable(getattr(mm, EAGER, None)) else None


def _forward(model: Any, n_tokens: int, seed: int) -> None:
    vocab = int(model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n_tokens), generator=g)
    dev = next(model.parameters()).device
    who = model_name(model)
    try:
        model(input_ids=ids.to(dev), position_ids=torch.arange(n_tokens, device=dev)[None],
              use_cache=False)
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            AssertionError) as err:
        text = " ".join(str(err).split())[:200]
        raise UnsupportedModelError(
            f"{who}: the forward that reads the conventions failed: "
            f"{type(err).__name__}: {text}") from None


def _check_eager(model: Any) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise UnsupportedModelError(
            f"{model_name(model)}: reading conventions needs attn_implementation='eager', the "
            f"model uses {impl!r}")


def probe_forward(model: Any, n_tokens: int = 12, *, layers: Sequence[int] | None = None,
                  seed: int = 0, keep: Sequence[str] | None = None
                  ) -> dict[int, AttentionRecord]:
    """One batch-1 eager forward over ``n_tokens`` seeded token ids at positions ``0..n-1``,
    every requested layer's first attention call recorded (each must run its attention once)."""
    _check_eager(model)
    who = model_name(model)
    Ls = list(range(len(layer_modules(model)))) if layers is None else [int(L) for L in layers]
    kw = {} if keep is None else {"keep": tuple(keep)}
    with recording(model, Ls, **kw) as rec, torch.no_grad():
        _forward(model, n_tokens, seed)
    out = {}
    for L, rs in rec.items():
        if len(rs) != 1 or not rs[0].kwargs.get("_seen"):
            raise UnsupportedModelError(
                f"{who}: layer {L}'s attention ran {len(rs)} times in one forward "
                f"({'with' if rs and rs[0].kwargs.get('_seen') else 'without'} {EAGER}); expected once")
        out[L] = rs[0]
    return out


def probe_layers(model: Any, n_tokens: int = 12, *, seed: int = 0
                 ) -> tuple[dict[int, AttentionRecord], dict[int, str]]:
    """Every decoder layer classified on one forward (:func:`probe_forward`'s tokens):
    ``(records, others)`` -- the record of each layer whose attention module computed softmax
    attention once in ``eager_attention_forward``, or inline with an ALiBi bias
    (:func:`inline_bias_arg`) (the output projection's input and output kept too), and for
    every other layer why it is not read: no attention module (a hybrid's
    linear-attention, convolution or state-space layer), an attention module whose scores are
    not computed by that function, or one that never called it (linear attention).  An
    attention module that called it more than once (differential attention) is refused."""
    _check_eager(model)
    who = model_name(model)
    mods = layer_modules(model)
    others: dict[int, str] = {}
    cand = []
    for L, layer in enumerate(mods):
        found = attention_modules(layer)
        if len(found) != 1:
            kids = ", ".join(f"{type(c).__name__}" for _, c in layer.named_children()
                             if not is_norm_like(c))
            others[L] = (f"no attention module ({kids})" if not found else
                         f"{len(found)} attention modules ({', '.join(n for n, _ in found)})")
            continue
        attn = found[0][1]
        if eager_module(attn) is None and inline_bias_arg(attn) is None:
            others[L] = (f"{type(attn).__name__} does not compute its scores in "
                         f"{type(attn).__module__}.{EAGER}")
            continue
        cand.append(L)
    keep = ("hidden", "cos", "sin", "query", "key", "value", "mask", "kwargs", "output",
            "weights", "o_in", "o_out")
    with recording(model, cand, keep=keep) as rec, torch.no_grad():
        _forward(model, n_tokens, seed)
    out = {}
    for L, rs in rec.items():
        seen = [r for r in rs if r.kwargs.get("_seen")]
        if not rs:  # bypassed: a layer that exists but did not run its attention at all
            raise UnsupportedModelError(
                f"{who}: layer {L}'s attention ran 0 times in one forward; expected once")
        if not seen:
            attn = attention_module(mods[L], who, L)
            others[L] = (f"{type(attn).__name__} ran without calling {EAGER} (not softmax "
                         "attention: linear or other attention)")
            continue
        if len(rs) != 1:
            raise UnsupportedModelError(
                f"{who}: layer {L}'s attention ran {len(rs)} times in one forward; expected once")
        out[L] = rs[0]
    return out, dict(sorted(others.items()))


def is_norm_like(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()
