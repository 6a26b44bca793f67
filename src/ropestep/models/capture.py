"""Capture: the activations of chosen decoder layers in batch-1 eager forward passes.

Per layer, the recording of :mod:`ropestep.models.probe` keeps the head input ``x`` (the
attention module's own input ``hidden_states``, whatever norm or parallel branch produced it),
the per-head attention output as the attention function returns it (not the output projection's
input, which a norm or gate may change: BitNet, Qwen3-Next) and the output projection's output;
a guard proves every layer's attention ran once per pass.  :func:`capture_continuations` and :func:`capture_block` add the protocol's
candidate next tokens, run on the prefix's KV cache.
"""
from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import tolerances as tl
from . import conventions
from .conventions import ModelInfo, check_layer_index, describe_model
from .errors import CaptureError, UnsupportedModelError, adapter_errors
from .loading import disable_tf32
from .probe import recording
from .structure import decoder, layer_modules

F64 = torch.float64


@dataclass
class LayerCapture:
    """Activations of one decoder layer over ``n`` tokens (model dtype, CPU, detached).

    The model's dtype is float32 for :func:`load_model`'s default; a model cast to float64
    gives float64 captures (nothing is rounded on the way out).
    """

    layer: int
    positions: torch.Tensor  # (n,) int64
    x: torch.Tensor  # (n, m)  the attention module's input = head input
    heads: torch.Tensor  # (n, H, r)  per-head attention output (the attention function's)
    # (n, hidden) the output projection's output; where a norm or gate sits between the heads
    # and it (LayerConventions.output_direct False), the concatenated heads (n, H r): the write
    # in head space, as layer_head's identity W_o takes it; None from capture(..., write=False)
    o: torch.Tensor | None
    # (n, H): the model's own attention probability on each row's own key (the last key it
    # sees), from the eager attention's returned weights; only where requested
    self_mass: torch.Tensor | None = None
    # (n, hidden): the output projection's output where ``o`` is taken in head space (a norm or
    # gate in between): the model's own write, which a read output gate applied after the
    # heads must reproduce (ropestep.contextcheck); None elsewhere
    write: torch.Tensor | None = None


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
def _hooks(model: Any, layers: Sequence[int], self_mass: bool = False,
           write: bool = True) -> Iterator[dict]:
    """Record each layer's attention input ``hidden_states``, the heads' output as the attention
    function returns it (:func:`ropestep.models.probe.recording`: the output itself, not the
    output projection's input, which a norm or gate may have changed), the output projection's
    output and, with ``self_mass``, the attention's own probabilities on the last key (each
    query's own key in a single-token step); every hook is removed on exit."""
    keep = ("hidden", "output") + (("o_out",) if write else ()) + (
        ("weights",) if self_mass else ())
    info = describe_model(model)
    tempered = [L for L in layers if info.layers and info.layers[L] is not None
                and info.layers[L].temperature]  # their queries: _temperature_guard
    with recording(model, layers, keep=keep, keep_query=tempered) as rec:
        yield rec


def _alibi_guard(rs: list, info: ModelInfo, L: int, key_pos: torch.Tensor | None) -> None:
    """Every call of an ALiBi layer was handed the bias read on loading: ``slope_h p_j`` (up to
    a constant) at this run's key positions -- ``key_pos``, or ``0..N-1`` -- within rounding
    (the model derives its positions itself: BLOOM from the attention mask, MPT from the key
    count; a run whose positions it does not follow is refused, not given a wrong verdict)."""
    conv = info.layers[L]
    for t in rs:
        if t.bias is None:
            raise CaptureError(f"{info.name}: layer {L}'s attention was handed no ALiBi bias")
        N = t.kwargs.get("n_keys")
        if not isinstance(N, int):
            raise CaptureError(f"{info.name}: layer {L}'s attention returned no probabilities "
                               "(their key count places its ALiBi bias)")
        kb = conventions.alibi_key_bias(t.bias, info.n_heads, N, info.name, L)
        kp = torch.arange(N) if key_pos is None or key_pos.numel() != N else key_pos
        worst = conventions.alibi_check(kb, kp, conv.alibi, t.bias.dtype)
        if not worst <= 1.0:  # not modelled at these positions: a refusal, not a verdict
            raise UnsupportedModelError(
                f"{info.name}: layer {L}'s ALiBi bias in this run is not slope * position at the "
                f"run's key positions (worst {worst:.2e} of its rounding bound): the model does "
                "not follow these positions, or its bias changed since it was read")


def _temperature_guard(model: Any, rs: list, info: ModelInfo, L: int,
                       positions: torch.Tensor) -> None:
    """A layer with a query temperature (Llama 4's NoPE layers), in a run whose positions reach
    it: the queries its attention function received must be the projection's times
    ``tau(p)`` at the run's positions, within the reading's bound (the projection's rounding
    times ``tau``, plus four roundings of the model's ``tau`` and product) -- the model takes
    ``p`` from the token's index in the sequence, not from its position id, and the reading
    forward may be shorter than the temperature's first step (8191 on Llama 4)."""
    from .layouts import candidates as layout_candidates
    from .layouts import project as project_part
    from .structure import attention_module, layer_modules, onloaded

    mine = info.for_layer(L)
    conv = mine.layers[L]
    H, d = mine.n_heads, mine.head_dim
    attn = attention_module(layer_modules(model)[L], info.name, L)
    X = torch.cat([t.hidden.reshape(-1, t.hidden.shape[-1]) for t in rs]).to("cpu", F64)
    QM = torch.cat([t.query.permute(0, 2, 1, 3).reshape(-1, H, d) for t in rs]).to("cpu", F64)
    with onloaded(attn):
        part = layout_candidates(attn, H, mine.n_kv_heads, d, mine.r)[conv.layout]["q"]
        z, A = project_part(part, X, H)
    if conv.clip is not None:
        z = z.clamp(-conv.clip, conv.clip)
    mdt = rs[0].hidden.dtype
    m1 = X.shape[-1] + 1
    zt, E = conventions.tempered(
        z, tl.rotated_projection_abs(mdt, A, m1) + tl.rotated_projection_abs(F64, A, m1),
        conv.temperature, positions, tl.unit_roundoff(mdt))  # the reading's own bound
    err = (QM - zt).abs()
    if not bool((err <= E).all()):
        worst = float((err / E.clamp_min(tl.SCALE_GUARD)).max())
        raise UnsupportedModelError(
            f"{info.name}: layer {L}'s queries in this run are not the projection times the "
            f"query temperature at the run's positions (worst {worst:.2e} of the bound): the "
            "model counts them from the first token, or its temperature is not the one read")


def _take(rec: dict, info: ModelInfo, calls: int,
          positions: torch.Tensor, write: bool = True,
          key_pos: torch.Tensor | None = None, model: Any = None) -> dict[int, LayerCapture]:
    """Check that every layer's attention ran once per forward pass (its attention function
    and its output projection included), then stack the records per layer; an ALiBi layer's
    bias is checked against its reading (:func:`_alibi_guard`)."""
    out = {}
    for L, rs in rec.items():
        if info.layers and info.layers[L] is not None and info.layers[L].alibi:
            _alibi_guard(rs, info, L, key_pos)
        conv_l = info.layers[L] if info.layers else None
        if conv_l is not None and conv_l.temperature and \
                int(positions.max()) >= (conv_l.temperature_from or 0):
            if model is None or any(t.query is None for t in rs):
                raise CaptureError(f"{info.name}: layer {L}'s queries were not kept (its query "
                                   "temperature is checked in every run that reaches it)")
            _temperature_guard(model, rs, info, L, positions)
        H, r = info.n_heads, info.for_layer(L).r
        ok = [x for x in rs if x.kwargs.get("_seen") and x.hidden is not None
              and x.output is not None and (x.o_out is not None or not write)]
        if len(rs) != calls or len(ok) != calls:
            raise CaptureError(
                f"{info.name}: layer {L}'s attention ran {len(rs)} times ({len(ok)} complete: "
                f"input, attention function, output projection) for {calls} forward passes")
        x = torch.cat([t.hidden.reshape(-1, t.hidden.shape[-1]) for t in rs]).cpu()
        hd = torch.cat([t.output.reshape(-1, H, r) for t in rs]).cpu()
        conv = info.layers[L] if info.layers else None
        wr = None
        if not write:
            o = None
        elif conv is not None and not conv.output_direct:  # the write in head space (layer_head)
            o = hd.reshape(hd.shape[0], H * r).clone()
            wr = torch.cat([t.o_out.reshape(-1, t.o_out.shape[-1]) for t in rs]).cpu()
        else:
            o = torch.cat([t.o_out.reshape(-1, t.o_out.shape[-1]) for t in rs]).cpu()
        sm = None
        if rs and rs[0].weights is not None:  # (B, H, q, N): the last key's probability
            sm = torch.cat([t.weights[..., -1].transpose(1, 2).reshape(-1, H)
                            for t in rs]).cpu()
        if not (x.shape[0] == hd.shape[0] == (hd.shape[0] if o is None else o.shape[0])
                == positions.shape[0]) or (
                sm is not None and sm.shape[0] != x.shape[0]):
            raise CaptureError(f"{info.name}: layer {L} captured {x.shape[0]} rows, expected "
                               f"{positions.shape[0]}")
        out[L] = LayerCapture(layer=L, positions=positions.clone(), x=x, heads=hd, o=o,
                              self_mass=sm, write=wr)
    return out


def _take_self_mass(rec: dict, info: ModelInfo) -> None:
    """Every call of a self-mass capture must have returned its attention probabilities."""
    for L, rs in rec.items():
        if any(t.weights is None for t in rs):
            raise CaptureError(f"layer {L}: the attention returned no weights (eager "
                               "attention is required to read the model's own self mass)")


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
    return sorted({check_layer_index(info, L) for L in ls})


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


def _kv_only(cache: Any) -> bool:
    """Every layer of the cache holds keys and values only (transformers' dynamic or static
    attention layers): no recurrent state -- a linear-attention, convolution or state-space
    mixer's (transformers' ``LinearAttention*`` layers, or a hybrid cache of a model's own) --
    which would hold a token for good, so that the cache can be cut back and repeated."""
    from transformers import cache_utils as cu

    kv = tuple(getattr(cu, n) for n in ("DynamicLayer", "StaticLayer") if hasattr(cu, n))
    rec = tuple(getattr(cu, n) for n in ("LinearAttentionCacheLayerMixin",) if hasattr(cu, n))
    layers = getattr(cache, "layers", None)
    if not layers or not kv:
        return False
    return all(isinstance(ly, kv) and not (rec and isinstance(ly, rec)) for ly in layers)


def _repeatable(cache: Any) -> bool:
    """The cache can be repeated along the batch, layer by layer (a cache with recurrent state
    is not: each candidate then steps on its own copy)."""
    return hasattr(cache, "batch_repeat_interleave") and _kv_only(cache) and all(
        hasattr(ly, "batch_repeat_interleave") for ly in cache.layers)


def _out_cache(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the last requested layer has run."""


def capture(model: Any, input_ids: Any, layers: int | Sequence[int], *,
            position_ids: Any = None, stop_early: bool = True,
            write: bool = True) -> dict[int, LayerCapture]:
    """One batch-1 eager forward pass over ``input_ids`` recording the requested layers.

    ``position_ids`` defaults to ``0..n-1``.  With ``stop_early`` the pass ends after the last
    requested decoder layer (later layers cannot change what was recorded).  ``write=False``
    keeps no output-projection output (``LayerCapture.o`` is None: a third less to hold when
    only the heads are read).  Raises if any hook did not fire exactly once.
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

    with _hooks(model, Ls, write=write) as rec, torch.no_grad(), \
            adapter_errors(info.name, "the capture's forward"):
        h = layer_modules(model)[Ls[-1]].register_forward_hook(stop) if stop_early else None
        try:
            model(input_ids=ids[None], position_ids=pos[None].to(dev), use_cache=False)
        except _StopForward:
            pass
        finally:
            if h is not None:
                h.remove()
    return _take(rec, info, 1, pos, write, key_pos=pos, model=model)


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
    with torch.no_grad(), adapter_errors(info.name, "the capture's forwards"):
        with _hooks(model, Ls) as rec:
            out = model(input_ids=ids[None], position_ids=torch.arange(n1, device=dev)[None],
                        use_cache=True, **_last_logits_kw(model))
        prefix = _take(rec, info, 1, torch.arange(n1), model=model)
        logits = out.logits[0, -1].detach().cpu()
        cache = _out_cache(out)
        if cache is None:
            raise CaptureError(f"{info.name}: the prefix pass returned no KV cache")
        cands = candidates(logits) if callable(candidates) else candidates
        cand = torch.as_tensor(list(cands), dtype=torch.long).reshape(-1)
        if cand.numel() < 1:
            raise ValueError("no candidate tokens")
        vocab = logits.shape[0]
        if int(cand.min()) < 0 or int(cand.max()) >= vocab:
            raise ValueError(f"candidate token ids must lie in [0, {vocab})")
        Q = int(cand.numel())
        with _hooks(model, Ls, self_mass=True) as rec:
            if batched and _repeatable(cache):
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
        _take_self_mass(rec, info)
        queries = _take(rec, info, calls, torch.full((Q,), n1), model=model)
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
    base = decoder(model)
    ckw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    fkw = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        fkw["logits_to_keep"] = 2  # positions n-2 and n-1 only
    disable_tf32()
    with torch.no_grad(), adapter_errors(info.name, "the capture's forwards"):
        with _hooks(model, Ls) as rec:
            out = model(input_ids=ids[None], position_ids=torch.arange(n, device=dev)[None],
                        use_cache=True, **fkw)
        full = _take(rec, info, 1, torch.arange(n), model=model)
        logits = out.logits[0, -2].detach().cpu()
        cache = _out_cache(out)
        if cache is None:
            raise CaptureError(f"{info.name}: the forward pass returned no KV cache")
        rolled = False
        if _kv_only(cache):  # only keys and values: drop the observed token's
            try:
                cache.crop(-1)  # the prefix's cache, positions 0..n-2
                rolled = True
            except RuntimeError:  # a sliding-window cache that already dropped keys
                pass
        if not rolled:  # cannot roll back (that, or a hybrid's recurrent state, which holds the
            # observed token for good): the prefix's cache from a forward over the prefix alone
            out_p = base(input_ids=ids[None, :n - 1],
                         position_ids=torch.arange(n - 1, device=dev)[None], use_cache=True)
            cache = _out_cache(out_p)
        if cache.get_seq_length() != n - 1:
            raise CaptureError(f"{info.name}: cache holds {cache.get_seq_length()} positions "
                               f"after cropping, expected {n - 1}")
        cands = candidates(logits) if callable(candidates) else candidates
        cand = torch.as_tensor(list(cands), dtype=torch.long).reshape(-1)
        Q = int(cand.numel())
        if Q < 1:
            raise ValueError("no candidate tokens")
        if int(cand.min()) < 0 or int(cand.max()) >= logits.shape[0]:
            raise ValueError(f"candidate token ids must lie in [0, {logits.shape[0]})")
        with _hooks(model, Ls, self_mass=True) as rec:
            if batched and _repeatable(cache):
                cache.batch_repeat_interleave(Q)
                base(input_ids=cand.to(dev)[:, None],
                     position_ids=torch.full((Q, 1), n - 1, device=dev), use_cache=True,
                     **{ckw: cache})
                calls = 1
            else:
                for t in cand.tolist():  # each on its own copy of the prefix's cache
                    base(input_ids=torch.tensor([[t]], device=dev),
                         position_ids=torch.tensor([[n - 1]], device=dev), use_cache=True,
                         **{ckw: copy.deepcopy(cache)})
                calls = Q
        _take_self_mass(rec, info)
        queries = _take(rec, info, calls, torch.full((Q,), n - 1), model=model)
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
