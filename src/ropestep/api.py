"""ropestep as a library: the gradient step of any prompt, on a model already loaded.

Three calls take a researcher from a loaded Hugging Face ``*ForCausalLM`` to the objects of the
identity ``y_i = mu_i + u_i^T Delta M_i`` for their own tokens (docs/api.md)::

    lab = ropestep.attach(model, tokenizer)        # conventions read and proven, once
    run = lab.run("The cat sat. The cat", layers=[3])  # one forward, the layer's tensors kept
    st = run[3].step(head=2, query=-1)              # c_ij, mu_i, T_i, Delta M_i, readout, bound

:func:`attach` reads every softmax-attention layer's conventions from the model and checks the
reading against the model's own tensors (:func:`ropestep.models.describe_model`, the reading
every command makes); a model that the adapter does not model is refused with one
:class:`~ropestep.models.UnsupportedModelError` line naming what is not modelled.  A model
loaded with another attention implementation (SDPA, flash) is switched to ``eager`` for
ropestep's forwards only and switched back after each.

:meth:`Attached.run` makes one batch-1 forward (:func:`ropestep.models.capture`) and keeps, per
requested layer, the head input ``x`` and the model's own per-head outputs.  Nothing else is
computed until asked: :class:`LayerRun` gives, lazily,

* :meth:`LayerRun.step` -- one head and query: scores, softmax weights, ``c_ij``, ``mu_i``,
  ``T_i``, ``Delta M_i`` (input space for affine heads, the query-space step otherwise, with the
  reason), the readout against the softmax output and against the model's own output, each with
  its derived bound, ``kappa``, ``lambda_max`` and descent in both spaces;
  cost: one head's projection of the query's keys (one GEMM), not a layer's;
* :meth:`LayerRun.reuse` -- frozen reuse of one anchor's matrix for other queries, at their own
  positions (the atlas's measure) or placed at the anchor's position and bank (the paper's
  setting, with the tokenwise formula and the operator-norm bound);
* :meth:`LayerRun.check` -- every head and query of the layer through the atlas's own evaluation
  (:func:`ropestep.layercheck.evaluate_layer`, :func:`ropestep.layercheck.summarise_layer`): the same
  numbers and the same verdict rules as ``ropestep atlas`` on these tokens;
* :meth:`LayerRun.position_derivative` -- ``d y_i / d p_i`` by the RoPE generator against the
  model's own attention (:func:`ropestep.realchecks.position_derivative`).

:meth:`Attached.run_candidates` is the paper's shared-position setting (what ``ropestep
validate`` measures): a block, then candidate next tokens at its last position on the prefix's
cache; :meth:`CandidateRun.evaluate` gives every measurement of one layer on it
(:func:`ropestep.contextcheck.evaluate_layer`).  :meth:`Attached.head_description` is a layer's
description without a forward.

Tables (:meth:`LayerCheck.rows`, :meth:`LayerCheck.to_pandas`) and figures
(:mod:`ropestep.api` ``plot_*``) come from these results.  Bad input (a layer out of range or not
softmax attention, a head or query out of range, a prompt longer than the model's context, a
string prompt without a tokenizer, a model in training mode) raises :class:`ApiError` naming the
problem.  A verdict is never silent: a check that fails raises :class:`VerdictError` from
``assert_passed``, and NaN or inf is a failure.

Layering: this module sits above the layer evaluation (:mod:`ropestep.layercheck`) and the
real-model checks (:mod:`ropestep.realchecks`), and below the commands, which compute through it:
``ropestep atlas`` (:meth:`Attached.run`, :meth:`LayerRun.evaluate`), ``ropestep validate``
(:meth:`Attached.run_candidates`, :meth:`Attached.head_description`) and ``ropestep heads``
(:meth:`Attached.head_description`) -- import-linter contract in pyproject.toml.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from . import contextcheck, fast, layercheck, models, scale, tolerances
from .corpus import Block
from .kernel import augment, transform
from .realchecks import one_head
from .spec import HeadSpec, HeadWeights, first_permitted

__all__ = ["ApiError", "Attached", "CandidateRun", "HeadStep", "LayerCheck", "LayerRun",
           "ReuseResult", "Run", "VerdictError", "attach", "load", "plot_coefficients",
           "plot_lambda", "plot_reuse"]

F64 = torch.float64


class ApiError(ValueError):
    """Bad input to the library (layer, head or query out of range, prompt too long, ...)."""


class VerdictError(AssertionError):
    """A check of the identity failed (``assert_passed``); the message names every failure."""


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------
def _int(x: Any, what: str) -> int:
    """One integer (Python, numpy or a one-element integer tensor), else :class:`ApiError`."""
    if torch.is_tensor(x) and x.numel() == 1 and not x.dtype.is_floating_point and \
            not x.dtype.is_complex and x.dtype != torch.bool:
        return int(x.item())
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ApiError(f"{what} is an int, got {x!r}")
    return int(x)


def _ints(xs: Any, what: str) -> list[int]:
    """Integers from one integer or a sequence / 1-D integer tensor or array of them (``what``:
    the singular noun, "layer", "query")."""
    if torch.is_tensor(xs) or isinstance(xs, np.ndarray):
        t = torch.as_tensor(xs)
        if t.ndim > 1:
            raise ApiError(f"the {what} indices must be one int or a 1-D sequence, got shape "
                           f"{tuple(t.shape)}")
        return [_int(v, f"a {what}") for v in t.reshape(-1)]
    if isinstance(xs, (int, np.integer)) and not isinstance(xs, (bool, np.bool_)):
        return [int(xs)]
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        raise ApiError(f"the {what} indices must be one int or a sequence of ints, got {xs!r}")
    return [_int(v, f"a {what}") for v in xs]


# ---------------------------------------------------------------------------------------------
# attaching to a model
# ---------------------------------------------------------------------------------------------
def _impl_tree(config: Any) -> Any:
    """A config's attention implementation, with its sub-configs' where they differ (the dict
    form ``set_attn_implementation`` takes: ``{"": top, "text_config": ..., ...}``), so that a
    composite model's mixed implementations are restored as they were, not as one string."""
    impl = getattr(config, "_attn_implementation", None)
    subs = {}
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            subs[key] = _impl_tree(sub)
    if all(v == impl for v in subs.values()):
        return impl
    return {"": impl, **subs}


@contextmanager
def _eager(model: Any) -> Iterator[None]:
    """The model's attention implementation set to ``eager`` inside (every sub-config's too),
    restored on exit exactly as it was (:func:`_impl_tree`)."""
    impl = _impl_tree(model.config)
    if impl == "eager":
        yield
        return
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise ApiError(f"{models.structure.model_name(model)} uses attention implementation "
                       f"{impl!r} and cannot be switched to 'eager'; load it with "
                       "attn_implementation='eager'")
    model.set_attn_implementation("eager")
    try:
        if _impl_tree(model.config) != "eager":
            raise ApiError(f"{models.structure.model_name(model)} uses attention implementation "
                           f"{impl!r} and did not switch to 'eager'; load it with "
                           "attn_implementation='eager'")
        yield
    finally:
        model.set_attn_implementation(impl)


def _is_model(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and hasattr(obj, "config") and \
        callable(getattr(obj, "get_input_embeddings", None))


# what a wrapper's forward may differ from its model's by, in next-token log-probabilities: the
# gate that the Hugging Face model found inside a wrapper is the model the wrapper runs.  Another
# model's weights move log-probabilities by O(1); the same function evaluated with other float32
# roundings (TransformerLens's weight folding and centring, another kernel order) moves them by
# the float32 agreement level of the whole network, which TransformerLens documents as ~1e-3
# relative for a kernel change -- the gate takes 1e-3 of the log-probabilities' scale.
WRAPPER_LOGPROB_REL = 1e-3


def _unwrap(obj: Any, tokenizer: Any) -> tuple[Any, Any, str | None]:
    """``(model, tokenizer, via)``: a Hugging Face model as given, or the one inside an nnsight
    ``LanguageModel`` (its own module object: the wrapper's forward is the model's, hooks aside)
    or a TransformerLens ``TransformerBridge`` (``original_model``, checked against the bridge's
    own forward: :data:`WRAPPER_LOGPROB_REL`)."""
    inner = getattr(obj, "_orig_mod", None)  # torch.compile's wrapper: the module inside
    if isinstance(obj, torch.nn.Module) and _is_model(inner):
        obj = inner
    top = type(obj).__module__.split(".")[0]  # (a bridge has a config and embeddings too)
    if _is_model(obj) and top not in ("nnsight", "transformer_lens"):
        if any(BRIDGED in k for k in obj.state_dict()):  # rebuilt in place by a bridge
            return _from_bridge(obj), tokenizer, "TransformerLens (rebuilt in place)"
        return obj, tokenizer, None
    if top == "nnsight":
        inner = vars(obj).get("_module")
        if not _is_model(inner):
            raise ApiError(f"this nnsight {type(obj).__name__} wraps "
                           f"{type(inner).__name__}, not a Hugging Face causal LM")
        return inner, tokenizer if tokenizer is not None else getattr(obj, "tokenizer", None), \
            "nnsight"
    if top == "transformer_lens":
        inner = getattr(obj, "original_model", None)
        if not _is_model(inner):
            raise ApiError(
                f"a TransformerLens {type(obj).__name__} holds converted weights and no Hugging "
                "Face model: load it as a TransformerBridge (TransformerBridge.boot_transformers) "
                "or attach the Hugging Face model itself")
        tok = tokenizer if tokenizer is not None else getattr(obj, "tokenizer", None)
        model = _from_bridge(inner)
        _same_forward(obj, model)
        return model, tok, "TransformerLens"
    raise ApiError(f"attach() needs a Hugging Face causal LM (a torch module with a config "
                   f"and input embeddings), an nnsight LanguageModel or a TransformerLens "
                   f"TransformerBridge, got {type(obj).__name__}")


BRIDGED = "._original_component"


def _from_bridge(inner: Any) -> Any:
    """The Hugging Face model a TransformerBridge was built over, as a model of its own class:
    the bridge replaces the model's modules in place by its components (each keeping the
    original as ``_original_component``), so the adapter cannot read it as it is; a fresh model
    of the same configuration takes the original components' tensors (copied, by name)."""
    names = {k.replace(BRIDGED, ""): v for k, v in inner.state_dict().items()}
    if not any(BRIDGED in k for k in inner.state_dict()):
        return inner  # not bridged in place: the model itself
    from transformers import AutoModelForCausalLM

    p = next(inner.parameters())
    fresh = AutoModelForCausalLM.from_config(inner.config, attn_implementation="eager",
                                             dtype=p.dtype)
    want = fresh.state_dict()
    missing = [k for k in want if k not in names]
    if missing:
        raise ApiError(f"the TransformerBridge's model has no tensor for {missing[0]} (of "
                       f"{len(missing)}): its modules cannot be mapped back to "
                       f"{type(fresh).__name__}")
    fresh.load_state_dict({k: names[k] for k in want}, strict=True)
    return fresh.to(p.device).eval()


def _same_forward(wrapper: Any, model: Any, n: int = 8) -> None:
    """The wrapper's next-token log-probabilities on ``n`` seeded tokens against the model's."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    dev = next(model.parameters()).device
    with torch.no_grad():
        ref = torch.log_softmax(model(ids.to(dev)).logits.double(), -1)
        got = wrapper(ids.to(dev))
        got = torch.log_softmax(getattr(got, "logits", got).double(), -1)
    if tuple(got.shape) != tuple(ref.shape):
        raise ApiError(f"the wrapper's logits have shape {tuple(got.shape)}, its model's "
                       f"{tuple(ref.shape)}")
    err = float((got - ref).abs().max())
    tol = WRAPPER_LOGPROB_REL * max(1.0, float(ref.abs().max()))
    if not err <= tol:
        raise ApiError(f"the wrapper's forward differs from its Hugging Face model's by {err:.2e} "
                       f"in log-probability (gate {tol:.2e}): the model inside is not the one "
                       "the wrapper runs")


def attach(model: Any, tokenizer: Any = None) -> "Attached":
    """Read and prove the conventions of a loaded Hugging Face causal LM; return the handle
    whose :meth:`Attached.run` gives the identity's objects for any prompt.

    ``model``: a ``*ForCausalLM`` (any device, dtype or accelerate placement) in eval mode, or
    an nnsight ``LanguageModel`` / TransformerLens ``TransformerBridge`` over one (the Hugging
    Face model inside is used; a bridge's forward is checked to be the model's);
    ``tokenizer``: the model's tokenizer (needed for text prompts only; a wrapper's own is
    taken where none is given).

    >>> import ropestep, ropestep.archzoo as zoo
    >>> lab = ropestep.attach(zoo.build("llama"))
    >>> lab.layers
    (0, 1)
    """
    model, tokenizer, via = _unwrap(model, tokenizer)
    params = list(model.parameters())
    if params and all(p.is_meta for p in params) and not any(
            hasattr(m, "_hf_hook") for m in model.modules()):
        raise ApiError(f"{models.structure.model_name(model)}: its weights are not loaded (every "
                       "parameter is on the meta device, without an offload hook)")
    if model.training:
        raise ApiError(f"{models.structure.model_name(model)} is in training mode (dropout): "
                       "call model.eval() first")
    with _eager(model):
        info = models.describe_model(model)
    out = Attached(model, tokenizer, info)
    out.via = via
    return out


def load(source: str, *, gguf: str | None = None, revision: str | None = None,
         dtype: torch.dtype = torch.float32, device: str = "cpu", device_map: Any = None
         ) -> "Attached":
    """Load a model (hub id, local directory or ``.gguf`` file, as the commands do:
    :func:`ropestep.models.load_model`) with its tokenizer and attach to it.  ``"smollm2"`` is
    the packaged SmolLM2-135M-Instruct GGUF (Q4_1, de-quantised).

    >>> import ropestep
    >>> lab = ropestep.load("smollm2")
    >>> len(lab.layers), lab.info.n_heads, lab.info.n_kv_heads
    (30, 9, 3)
    """
    import os

    if not isinstance(source, (str, os.PathLike)):
        raise ApiError(f"load() takes a hub id, a directory or a GGUF path, got {source!r}")
    source = os.fspath(source)
    if source.lower() == "smollm2":
        if gguf is not None:
            raise ApiError("gguf= cannot be combined with 'smollm2' (the alias names the "
                           "packaged GGUF file)")
        source = str(models.locate_smollm2_gguf())
    model, tok = models.load_model(source, revision=revision, gguf_file=gguf, dtype=dtype,
                                   device=device, device_map=device_map)
    return attach(model, tok)


class Attached:
    """A loaded model whose conventions are read and proven (:func:`attach`)."""

    def __init__(self, model: Any, tokenizer: Any, info: models.ModelInfo) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.via: str | None = None  # the wrapper it was attached through (nnsight, ...)

    @property
    def layers(self) -> tuple[int, ...]:
        """The softmax-attention layers (a hybrid's other layers are in :attr:`others`)."""
        return tuple(self.info.softmax_layers)

    @property
    def others(self) -> dict[int, str]:
        """Layers that are not softmax attention, each with the reason (a hybrid's linear,
        convolution or state-space layers; empty for a plain transformer).

        >>> import ropestep, ropestep.archzoo as zoo
        >>> ropestep.attach(zoo.build("llama")).others
        {}
        """
        return dict(self.info.others)

    def conventions(self, layer: int) -> models.LayerConventions:
        """What was read for ``layer`` (rotary, pairing, scale, window, norms, ...)."""
        return self.info.layers[self._layer(layer)]

    def __repr__(self) -> str:
        i = self.info
        name = i.name.rstrip("/").rsplit("/", 1)[-1]  # a path's last part: portable output
        return (f"Attached({name}: {i.n_layers} layers, {len(self.layers)} softmax, "
                f"{i.n_heads} heads, {i.n_kv_heads} KV heads, head_dim {i.head_dim})")

    def _layer(self, layer: Any) -> int:
        L = _int(layer, "a layer")
        n = self.info.n_layers
        if L < 0:
            L += n
        if not 0 <= L < n:
            raise ApiError(f"layer {layer} out of range: the model has {n} layers "
                           f"(valid: 0..{n - 1})")
        if L not in self.info.softmax_layers:
            raise ApiError(f"layer {L} is not softmax attention "
                           f"({self.others.get(L, 'not read')})")
        return L

    def encode(self, prompt: Any) -> torch.Tensor:
        """Token ids ``(n,)`` of a text (tokenizer, no special tokens added) or of given ids.

        >>> import ropestep, ropestep.archzoo as zoo
        >>> ropestep.attach(zoo.build("llama")).encode([[3, 4, 5]])
        tensor([3, 4, 5])
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError("a text prompt needs a tokenizer: attach(model, tokenizer) or "
                               "pass token ids")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ids = torch.as_tensor(ids, dtype=torch.long)
        else:
            if hasattr(prompt, "keys") and "input_ids" in prompt.keys():  # a tokenizer's output
                prompt = prompt["input_ids"]
            try:
                ids = torch.as_tensor(prompt)
            except (TypeError, ValueError, RuntimeError):
                raise ApiError(f"a prompt is a text or token ids, got {type(prompt).__name__}"
                               ) from None
            if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex
                                or ids.dtype == torch.bool):
                raise ApiError(f"token ids must be integers, got {ids.dtype}")
            ids = ids.long()
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.numel() == 0:
            raise ApiError(f"a prompt is a non-empty 1-D sequence of token ids, got shape "
                           f"{tuple(ids.shape)}")
        vocab = int(self.model.get_input_embeddings().weight.shape[0])
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.numel():
            raise ApiError(f"token id {int(bad[0])} out of range: the vocabulary has {vocab} ids")
        return ids

    def head_description(self, layer: int, n_positions: int, *, device: Any = "cpu"
                         ) -> tuple[HeadSpec, HeadWeights]:
        """``(spec, weights)`` of ``layer`` in the math layout, float64 on ``device`` (the CPU
        by default, whatever device the model is on), with the model's own RoPE tables for
        positions ``0..n_positions-1``: the weights alone, no forward (what ``ropestep heads``
        diagnoses and every step and check computes from).

        >>> import ropestep, ropestep.archzoo as zoo
        >>> spec, w = ropestep.attach(zoo.build("llama")).head_description(0, 16)
        >>> spec.n_heads, tuple(w.w_q.shape)  # (hidden, heads, head_dim)
        (4, (128, 4, 32))
        """
        L = self._layer(layer)
        n = _int(n_positions, "n_positions")
        if n < 1:
            raise ApiError(f"n_positions must be >= 1, got {n_positions!r}")
        with _eager(self.model):
            return models.layer_head(self.model, L, n, dtype=F64, device=device)

    def _layer_list(self, layers: Any) -> list[int]:
        if isinstance(layers, str):
            if layers != "all":
                raise ApiError(f"layers must be 'all', an int or a list of ints, got {layers!r}")
            Ls = list(self.layers)
        else:
            Ls = sorted({self._layer(L) for L in _ints(layers, "layer")})
        if not Ls:
            raise ApiError("no layers requested")
        return Ls

    def _context(self) -> int | None:
        """The model's context (its text config's ``max_position_embeddings``, or MPT's
        ``max_seq_len``, ...: :func:`ropestep.models.conventions.context_length`), None if
        unset."""
        got = models.conventions.context_length(self.model.config)
        return None if got is None else got[1]

    def _not_training(self) -> None:
        if self.model.training:
            raise ApiError(f"{self.info.name} is in training mode (dropout): call model.eval()")

    def run(self, prompt: Any, *, layers: Any = "all", positions: Any = None,
            stop_early: bool = True) -> "Run":
        """One eager forward over ``prompt`` (text or token ids), keeping ``layers`` (``"all"``
        softmax layers, an int, or a list); ``positions`` default to ``0..n-1``.  The forward
        ends after the last kept layer (later layers cannot change what is kept);
        ``stop_early=False`` runs the whole model (``ropestep atlas`` does, so that its forward
        time is the model's)."""
        self._not_training()
        ids = self.encode(prompt)
        n = int(ids.numel())
        Ls = self._layer_list(layers)
        pos = torch.arange(n) if positions is None else self._positions(positions, n)
        chunked = [L for L in Ls if self.info.layers[L].chunk is not None]
        if chunked and int(pos[0]) != 0:
            raise ApiError(f"layer {chunked[0]} attends in chunks, which transformers counts "
                           "from the first token, not from its position: positions must start "
                           "at 0 on this model")
        tempered = [L for L in Ls if self.info.layers[L].temperature]
        if tempered and int(pos[0]) != 0:
            raise ApiError(f"layer {tempered[0]} scales its queries by a temperature of the "
                           "token's index in the sequence, not of its position: positions must "
                           "start at 0 on this model")
        top = int(pos.max()) + 1
        ctx = self._context()
        if ctx is not None and top > ctx:
            raise ApiError(f"the prompt reaches position {top - 1}, beyond the model's context "
                           f"({ctx} positions)")
        with _eager(self.model):
            info = models.describe_model(self.model)
            caps = models.capture(self.model, ids, Ls, position_ids=pos, write=False,
                                  stop_early=stop_early)
        self.info = info
        return Run(self, ids, pos, {L: LayerRun(self, caps[L], _weights_state(self.model, L))
                                    for L in Ls})

    def run_candidates(self, block: Any, candidates: Any, *, layers: Any = "all"
                       ) -> "CandidateRun":
        """The paper's shared-position setting (what ``ropestep validate`` measures): one
        forward over ``block`` (a prefix and the observed next token: text, token ids or a
        corpus :class:`~ropestep.corpus.Block`), then every candidate token at the block's last
        position on the prefix's KV cache, so each sees exactly the prefix and itself.
        ``candidates``: token ids, or a function of the prefix's logits returning them.
        The first candidate must be the block's own last token (the observed one): its row is
        checked against the block forward's write at that position.  Returns a
        :class:`CandidateRun`.

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lab = ropestep.attach(zoo.build("llama"))
        >>> cr = lab.run_candidates(torch.arange(10), [9, 3, 5], layers=1)
        >>> tuple(cr.capture.full[1].x.shape), tuple(cr.capture.queries[1].heads.shape)
        ((10, 128), (3, 4, 32))
        >>> ctx = cr.evaluate(1)  # validate's measurements of this block at layer 1
        >>> all(r["pass_identity"] for r in ctx.rows)
        True
        """
        self._not_training()
        # a corpus block (by its fields: a reloaded corpus module's Block is another class)
        is_block = all(hasattr(block, a) for a in ("ids", "article", "start", "n_tokens"))
        ids = self.encode(block.ids if is_block else block)
        if ids.numel() < 2:
            raise ApiError("a block needs at least 2 tokens (a prefix and the observed token)")
        Ls = self._layer_list(layers)
        observed = int(ids[-1])
        if not callable(candidates):
            cands = self.encode(candidates)
            if int(cands[0]) != observed:
                raise ApiError(f"the first candidate must be the block's last token {observed} "
                               f"(its row is checked against the block's own forward), got "
                               f"{int(cands[0])}")
            candidates = cands.tolist()
        ctx = self._context()
        if ctx is not None and ids.numel() > ctx:
            raise ApiError(f"the block has {ids.numel()} tokens, beyond the model's context "
                           f"({ctx} positions)")
        with _eager(self.model):
            self.info = models.describe_model(self.model)
            bc = models.capture_block(self.model, ids, Ls, candidates)
        if int(bc.candidates[0]) != observed:
            raise ApiError(f"the candidates function must put the block's last token {observed} "
                           f"first (its row is checked against the block's own forward), got "
                           f"{int(bc.candidates[0])}")
        src = block if is_block else Block(article=-1, start=0, n_tokens=int(ids.numel()),
                                           ids=tuple(int(t) for t in ids))
        return CandidateRun(self, src, bc, Ls)

    @staticmethod
    def _positions(positions: Any, n: int) -> torch.Tensor:
        """Consecutive integer positions ``p0, p0+1, ...`` (``p0 >= 0``): transformers starts a
        new packed sequence wherever position ids do not step by one, so any other sequence
        would make the model read other keys than a causal prefix."""
        try:
            pos = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError):
            raise ApiError(f"positions must be integers, got {positions!r}") from None
        if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
            raise ApiError(f"positions must be integers, got {pos.dtype}")
        pos = pos.long().reshape(-1)
        if tuple(pos.shape) != (n,):
            raise ApiError(f"positions has shape {tuple(pos.shape)} for {n} tokens")
        if int(pos[0]) < 0 or not torch.equal(pos, pos[0] + torch.arange(n)):
            raise ApiError("positions must be consecutive and non-negative (p0, p0+1, ...): "
                           "transformers treats any other step as the start of a new packed "
                           "sequence")
        return pos

    def runs(self, prompts: Sequence[Any], **kw: Any) -> list["Run"]:
        """:meth:`run` on each prompt of a batch (one batch-1 forward each).

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lab = ropestep.attach(zoo.build("llama"))
        >>> [r.ids.numel() for r in lab.runs([torch.arange(5), torch.arange(7)], layers=0)]
        [5, 7]
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ApiError("runs() takes a list of prompts; use run() for one")
        return [self.run(p, **kw) for p in prompts]


class CandidateRun:
    """One block in the paper's shared-position setting (:meth:`Attached.run_candidates`).

    ``capture``: the :class:`ropestep.models.BlockCapture` (``full[L]``: head input, per-head
    outputs and output projection at every position of the block; ``logits``: the prefix's
    prediction; ``candidates``; ``queries[L]``: one row per candidate, with the model's own
    self-attention mass); ``context``: the same as the protocol's float32 rows
    (:class:`ropestep.contextcheck.ContextCapture`); :meth:`evaluate`: every measurement of one
    layer, the numbers ``ropestep validate`` pools over its contexts."""

    def __init__(self, attached: Attached, block: Block, capture: models.BlockCapture,
                 layers: Sequence[int]) -> None:
        self.attached = attached
        self.block = block
        self.capture = capture
        self.layers = tuple(layers)
        self.candidates = capture.candidates
        self.context = contextcheck.context_capture(block, capture, self.layers)
        self._state = {L: _weights_state(attached.model, L) for L in self.layers}

    def __repr__(self) -> str:
        return (f"CandidateRun({len(self.block.ids)} tokens, {int(self.candidates.numel())} "
                f"candidates, layers {list(self.layers)})")

    def evaluate(self, layer: int, *, model_dtype: str = "float32", device: Any = "cpu",
                 head: tuple[HeadSpec, HeadWeights] | None = None) -> contextcheck.LayerContext:
        """Every measurement of ``layer`` on this block (:func:`ropestep.contextcheck.evaluate_layer`):
        the identity on the prefix and full banks against the model's writes (``model_dtype``:
        ``"float32"`` or ``"bfloat16"``, the native criterion's), the fast path in float32 and
        bfloat16, frozen reuse from every anchor, calibration and descent.  ``head``: the
        layer's :meth:`Attached.head_description` where the caller holds it already."""
        L = self.attached._layer(layer)
        if L not in self.layers:
            raise ApiError(f"layer {L} was not kept by this run (kept: {list(self.layers)})")
        if model_dtype not in contextcheck.TOLERANCES["native"]:
            raise ApiError(f"model_dtype must be one of "
                           f"{sorted(contextcheck.TOLERANCES['native'])}, got {model_dtype!r}")
        if _weights_state(self.attached.model, L) != self._state[L]:
            raise ApiError(f"layer {L}'s weights changed since this block ran: run it again")
        if head is None:
            head = self.attached.head_description(L, len(self.block.ids), device=device)
        gate = models.layer_gate(self.attached.model, L, info=self.attached.info)
        return contextcheck.evaluate_layer(*head, self.context, L, model_dtype, device, gate)


class Run:
    """One prompt's forward: its tokens and the requested layers (:class:`LayerRun`)."""

    def __init__(self, attached: Attached, ids: torch.Tensor, positions: torch.Tensor,
                 layers: dict[int, "LayerRun"]) -> None:
        self.attached = attached
        self.ids = ids
        self.positions = positions
        self.layers = layers

    def __getitem__(self, layer: int) -> "LayerRun":
        L = self.attached._layer(layer)
        if L not in self.layers:
            raise ApiError(f"layer {L} was not kept by this run (kept: {sorted(self.layers)})")
        return self.layers[L]

    def __iter__(self) -> Iterator["LayerRun"]:
        return iter(self.layers[L] for L in sorted(self.layers))

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def tokens(self) -> list[str]:
        """The prompt's tokens as text (token ids as strings without a tokenizer)."""
        tok = self.attached.tokenizer
        if tok is None:
            return [str(int(t)) for t in self.ids]
        return [tok.decode([int(t)]) for t in self.ids]

    def check(self, **kw: Any) -> dict[int, "LayerCheck"]:
        """:meth:`LayerRun.check` of every kept layer."""
        return {L: lr.check(**kw) for L, lr in sorted(self.layers.items())}

    def rows(self, **kw: Any) -> list[dict]:
        """One row per layer and head of :meth:`check` (a tidy table)."""
        return [r for c in self.check(**kw).values() for r in c.rows()]


# ---------------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------------
@dataclass
class HeadStep:
    """The identity's objects for one head and query (float64; ``keys`` index the prompt).

    ``space`` is ``"input"`` (``u_i = [x_i; 1]``, ``Delta M_i`` is ``(m+1, r)``) for a head whose
    score is affine in ``u``, else ``"query"`` (``u`` is ``z_i = [q~_i; 1]``, the rotated,
    normalised query, and ``Delta M^q_i = [scale T_i; b_i^T]`` is ``(d+1, r)``;
    ``not_defined["input_space"]`` says why).  ``readout = mu + u^T delta_m``; ``y`` the softmax
    output recomputed in float64; ``native`` the model's own output.  ``identity_error`` and
    ``native_error`` are max-abs differences, each with its derived bound
    (:func:`ropestep.tolerances.readout_bound`, :func:`~ropestep.tolerances.model_dtype_native_bound`).
    """

    layer: int
    head: int
    query: int
    position: int
    space: str
    keys: torch.Tensor  # (N_i,) prompt indices of the permitted keys
    scores: torch.Tensor  # (N_i,) s_ij (bias included)
    softmax: torch.Tensor  # (N_i,) the attention weights
    c: torch.Tensor  # (N_i,) c_ij = phi_1(s_ij) / Z_i
    mu: torch.Tensor  # (r,)
    T: torch.Tensor  # (d, r)
    b: torch.Tensor | None  # (r,) bias row (attention sinks), else None
    u: torch.Tensor  # (m+1,) or (d+1,)
    delta_m: torch.Tensor  # (m+1, r) or (d+1, r)
    y: torch.Tensor  # (r,)
    readout: torch.Tensor  # (r,)
    native: torch.Tensor  # (r,)
    kappa: float
    identity_error: float
    identity_bound: float
    native_error: float
    native_bound: float
    lambda_max: dict = field(default_factory=dict)  # {"query": float, "input": float | None}
    descends: dict = field(default_factory=dict)  # {"query": bool, "input": bool | None}
    sink_weight: float | None = None  # the attention sink's share of the row, where one is
    not_defined: dict = field(default_factory=dict)  # statistic -> why it does not exist here

    @property
    def self_mass(self) -> float:
        """The attention weight on the query's own key (the last key it reads).

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> st = ropestep.attach(zoo.build("llama")).run(torch.arange(8), layers=0)[0].step(1, 5)
        >>> 0.0 < st.self_mass < 1.0, st.failures  # the step's checks: none failed
        (True, [])
        """
        return float(self.softmax[-1])

    @property
    def failures(self) -> list[str]:
        """Each failed check of the step (identity, native) with its error and bound; NaN or
        inf is a failure, said as such (example: :attr:`self_mass`)."""
        out = []
        for name, e, b in (("identity", self.identity_error, self.identity_bound),
                           ("native", self.native_error, self.native_bound)):
            if not (math.isfinite(e) and math.isfinite(b)):
                out.append(f"{name}: not finite (error {e}, bound {b})")
            elif e > b:
                out.append(f"{name}: error {e:.3e} exceeds its bound {b:.3e}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def assert_passed(self) -> None:
        if self.failures:
            raise VerdictError(f"layer {self.layer} head {self.head} query {self.query}: "
                               + "; ".join(self.failures))


@dataclass
class ReuseResult:
    """Frozen reuse of the anchor's matrix for ``queries`` (float64, one head).

    ``at="own"``: each query at its own position and causal bank, predicted by
    ``mu_a + q_i(p_a) T_a + b_a`` (``u_i^T Delta M_a``; the atlas's measure), against the softmax
    output ``y_i``; ``const_error``: the anchor's output ``y_a`` as the prediction,
    ``mean_error``: ``|y_i - mu_i|`` (what the relative error divides by); ``tv``: total
    variation between the two attention rows.  ``at="anchor"``: every query placed at the
    anchor's position reading the anchor's bank (the paper's setting), with the tokenwise
    formula of the error and the bound ``||u_i|| ||Delta M_i - Delta M_a||_op``
    (:func:`ropestep.fast.frozen_reuse`).
    """

    layer: int
    head: int
    anchor: int
    at: str
    queries: torch.Tensor  # (Q,)
    distance: torch.Tensor  # (Q,) p_i - p_a
    frozen: torch.Tensor  # (Q, r)
    y: torch.Tensor  # (Q, r)
    error: torch.Tensor  # (Q,) |y_i - frozen_i| (2-norm over the value dims)
    relative_error: torch.Tensor  # (Q,) error / |y_i - mu_i|
    mean_error: torch.Tensor | None = None  # (Q,) |y_i - mu_i|: what the relative error divides by
    const_error: torch.Tensor | None = None  # (Q,) |y_i - y_a| (at="own")
    tv: torch.Tensor | None = None  # (Q,) (at="own")
    tokenwise: torch.Tensor | None = None  # (Q, r) the error's tokenwise formula (at="anchor")
    bound: torch.Tensor | None = None  # (Q,) (at="anchor", affine heads)

    def rows(self) -> list[dict]:
        out = []
        for k in range(int(self.queries.numel())):
            row = {"layer": self.layer, "head": self.head, "anchor": self.anchor, "at": self.at,
                   "query": int(self.queries[k]), "distance": int(self.distance[k]),
                   "error": float(self.error[k]), "relative_error": float(self.relative_error[k]),
                   "mean_error": float(self.mean_error[k])}
            if self.tv is not None:
                row["tv"] = float(self.tv[k])
                row["const_error"] = float(self.const_error[k])
            if self.bound is not None:
                row["bound"] = float(self.bound[k])
            out.append(row)
        return out


class LayerCheck:
    """Every head and query of one layer through the atlas's evaluation (:meth:`LayerRun.check`):
    ``result`` the per-query arrays (:class:`ropestep.layercheck.LayerResult`, ``(H, n)`` each),
    ``summary`` the per-head statistics and checks (:func:`ropestep.layercheck.summarise_layer`)."""

    def __init__(self, layer: int, result: layercheck.LayerResult, summary: dict) -> None:
        self.layer = layer
        self.result = result
        self.summary = summary

    @property
    def failures(self) -> list[str]:
        """Each head whose checks failed, with the failed checks' names, then the layer's errors
        (overflow and the like).

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lr = ropestep.attach(zoo.build("llama")).run(torch.arange(12), layers=1)[1]
        >>> lr.check(anchor_every=4).failures
        []
        """
        out = [f"layer {self.layer} head {h['head']}: " + ", ".join(
            k for k, v in h["checks"].items() if not v) for h in self.summary["heads"]
            if not h["passed"]]
        return out + list(self.summary["errors"])

    @property
    def passed(self) -> bool:
        return bool(self.summary["passed"]) and not self.failures

    def assert_passed(self) -> None:
        if not self.passed:
            raise VerdictError("; ".join(self.failures))

    def rows(self, per: str = "head") -> list[dict]:
        """A tidy table: one row per head (``per="head"``: the atlas's per-head statistics and
        checks, nested values flattened with ``.``) or per head and query (``per="query"``:
        the per-query arrays, NaN where a statistic does not exist)."""
        if per == "head":
            out = []
            for h in self.summary["heads"]:
                row: dict = {"layer": self.layer}
                _flatten(h, "", row)
                out.append(row)
            return out
        if per != "query":
            raise ApiError(f"per must be 'head' or 'query', got {per!r}")
        arr = self.result.arrays
        H, n = next(iter(arr.values())).shape
        return [{"layer": self.layer, "head": h, "query": i,
                 **{k: float(v[h, i]) for k, v in arr.items()}}
                for h in range(H) for i in range(n)]

    def to_pandas(self, per: str = "head") -> Any:
        """:meth:`rows` as a pandas DataFrame (pandas is in the ``notebook`` extra).

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lr = ropestep.attach(zoo.build("llama")).run(torch.arange(12), layers=1)[1]
        >>> lr.check(anchor_every=4).to_pandas("query").shape[0]  # heads x queries
        48
        """
        try:
            import pandas as pd
        except ImportError:  # pragma: no cover - depends on the environment
            raise ApiError("to_pandas() needs pandas: pip install pandas") from None
        return pd.DataFrame(self.rows(per))


def _weights_state(model: Any, layer: int) -> tuple:
    """What identifies the attention weights of ``layer`` as they are now: each parameter's
    storage and in-place version counter (any edit bumps it)."""
    attn = models.structure.attention_module(
        models.structure.layer_modules(model)[layer], models.structure.model_name(model), layer)
    return tuple((n, p.data_ptr(), p._version) for n, p in attn.named_parameters())


def _flatten(d: dict, prefix: str, out: dict) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _flatten(v, key + ".", out)
        elif not isinstance(v, list):
            out[key] = v


class LayerRun:
    """One layer of one prompt: the captured head input and the model's own head outputs, and
    the identity's objects computed from them on request (module docstring)."""

    def __init__(self, attached: Attached, cap: Any, state: tuple = ()) -> None:
        self.attached = attached
        self._state = state  # the layer's weights when the prompt ran (_weights_state)
        self.layer = int(cap.layer)
        self.positions = cap.positions  # (n,) int64
        self.x = cap.x  # (n, m) the model's dtype
        self.native = cap.heads  # (n, H, r) the model's dtype
        self._spec: tuple[HeadSpec, HeadWeights] | None = None
        self._head_cache: dict[int, dict] = {}
        self._check: dict = {}

    # -- the layer's description -----------------------------------------------------------
    @property
    def head_description(self) -> tuple[HeadSpec, HeadWeights]:
        """``(spec, weights)`` of the layer in the math layout, float64 (built once), with the
        model's RoPE tables for the run's positions; :attr:`spec`, :attr:`weights` its parts.

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lr = ropestep.attach(zoo.build("qwen3")).run(torch.arange(6), layers=0)[0]
        >>> lr.spec.family, lr.space, lr.input_space_reason.split(",")[0]
        ('qknorm', 'query', "not defined: its 'qknorm' score normalises the query")
        """
        if self._spec is None:
            if self._state and _weights_state(self.attached.model, self.layer) != self._state:
                raise ApiError(f"layer {self.layer}'s weights changed since this prompt ran: "
                               "run it again (the captured inputs and outputs are the old "
                               "weights')")
            self._spec = self.attached.head_description(self.layer,
                                                        int(self.positions.max()) + 1)
        return self._spec

    @property
    def spec(self) -> HeadSpec:
        """The layer's :class:`~ropestep.spec.HeadSpec` (:attr:`head_description`)."""
        return self.head_description[0]

    @property
    def weights(self) -> HeadWeights:
        """The layer's float64 :class:`~ropestep.spec.HeadWeights` (:attr:`head_description`)."""
        return self.head_description[1]

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    @property
    def space(self) -> str:
        """``"input"`` where ``Delta M_i`` exists (the score is affine in ``u``), else ``"query"``."""
        return "input" if self.spec.affine else "query"

    @property
    def input_space_reason(self) -> str | None:
        """Why the input-space objects do not exist on this layer (None where they do; example:
        :attr:`head_description`)."""
        s = self.spec
        if s.affine:
            return None
        what = ("its projections are clipped (clip_qkv)" if s.clip is not None else
                f"its {s.family!r} score normalises the query" if s.family in ("qknorm", "cosine")
                else "its query passes a norm (latent attention with a query latent)")
        return (f"not defined: {what}, so the score is not affine in u = [x; 1] and no "
                "input-space Delta M or Hessian exists (docs/math.md section 8); the query-space "
                "step holds")

    def __repr__(self) -> str:
        return f"LayerRun(layer {self.layer}, {self.n} tokens, space {self.space!r})"

    def _head(self, head: Any) -> int:
        H = self.attached.info.n_heads
        h = _int(head, "a head")
        h += H if h < 0 else 0
        if not 0 <= h < H:
            raise ApiError(f"head {head} out of range: layer {self.layer} has {H} heads "
                           f"(valid: 0..{H - 1})")
        return h

    def _query(self, query: Any) -> int:
        i = _int(query, "a query (a token index of the prompt)")
        i += self.n if i < 0 else 0
        if not 0 <= i < self.n:
            raise ApiError(f"query {query} out of range: the prompt has {self.n} tokens "
                           f"(valid: 0..{self.n - 1})")
        return i

    def _one(self, h: int) -> tuple[HeadSpec, HeadWeights]:
        """Head ``h`` alone (with its KV head), or the whole layer where a norm spans every head
        (then the step's head index is ``h``, else 0)."""
        spec, w = self.head_description
        if spec.family == "qknorm" and spec.norm_scope != "head":
            return spec, w
        return one_head(spec, w, h)

    def _scales(self, h: int) -> dict:
        """The context-wide scales of head ``h`` the bounds use (as the atlas's): ``max|v|``,
        ``max|native|``, ``max |q_eff| max |k~|``."""
        if h not in self._head_cache:
            s1, w1 = self._one(h)
            hh = h if s1 is self.spec else 0
            P = fast.project(s1, w1, self.x, self.positions, self.x, self.positions, dtype=F64)
            self._head_cache[h] = {
                "vscale": float(P.v[hh].abs().max()),
                "nscale": float(self.native[:, h].double().abs().max()),
                "qk_max": float(P.q[hh].norm(dim=-1).max() * P.k[hh].norm(dim=-1).max()),
            }
        return self._head_cache[h]

    def _keys(self, i: int) -> torch.Tensor:
        """The prompt indices of query ``i``'s permitted keys (causal, window, chunks)."""
        p = int(self.positions[i])
        lo = first_permitted(p, self.spec.window, self.spec.chunk)
        return torch.nonzero((self.positions <= p) & (self.positions >= lo)).flatten()

    # -- one head and query ----------------------------------------------------------------
    def step(self, head: int, query: int = -1, *, gauge: str = "original") -> HeadStep:
        """The identity for ``head`` at ``query`` (a token index; ``-1`` the last): see
        :class:`HeadStep`.  ``gauge``: ``"original"`` (the paper's) or ``"maxkey"``."""
        if gauge not in ("original", "maxkey"):
            raise ApiError(f"gauge must be 'original' or 'maxkey', got {gauge!r}")
        h, i = self._head(head), self._query(query)
        spec = self.spec
        s1, w1 = self._one(h)
        hh = h if s1 is spec else 0
        keys = self._keys(i)
        xq, pq = self.x[i:i + 1], self.positions[i:i + 1]
        xk, pk = self.x[keys], self.positions[keys]
        affine = spec.affine
        st = fast.step(s1, w1, xq, pq, xk, pk, "causal", gauge=gauge, dtype=F64,
                       delta_m=affine, keep=("c", "t", "b"))
        nk = int(keys.numel())
        s_row = st.s[hh, 0, :nk]
        sinks = spec.sinks is not None
        p_row, p_sink = _rows_softmax(spec, s_row, torch.ones(nk, dtype=torch.bool), h)
        sink_w = None if p_sink is None else float(p_sink)
        if affine:
            u = augment(self.x[i:i + 1].to(F64))[0]
            dm = st.delta_m[hh, 0]
        else:
            u = fast.query_input(st)[hh, 0]
            dm = fast.query_delta_m(st)[hh, 0]
        # the readout: the kernel's mu + q T + b (gauge offsets included)
        ro, y, mu = st.readout[hh, 0], st.y[hh, 0], st.mu[hh, 0]
        nat = self.native[i, h].to(F64)
        sc = self._scales(h)
        kap = float(st.kappa[hh, 0])
        smax = float(s_row.abs().max())
        npre = nk + int(sinks)  # the keys the readout sums (as the atlas's id_bound)
        d, m = spec.head_dim, int(self.x.shape[1])
        id_bound = max(float(tolerances.readout_bound(F64, kap, npre, d, smax)),
                       tolerances.FLOAT64_REL) * sc["vscale"]
        mdt = self.x.dtype
        ncausal = i + 1 + int(sinks)  # the model's sums run over the causal row (as the atlas)
        nat_bound = float(tolerances.model_dtype_native_bound(
            mdt if mdt != F64 else torch.float32, np.array([kap]), np.array([ncausal]), d, m,
            np.array([smax]), np.array([sc["qk_max"]]), sc["vscale"], sc["nscale"],
            arith=F64)[0])
        lam: dict = {}
        desc: dict = {}
        nd: dict = {}
        if not affine:
            nd["input_space"] = self.input_space_reason
        if spec.softcap is not None or sinks or spec.alibi_slopes is not None:
            why = ("soft-capped scores: the unit step's descent statistics are derived for "
                   "phi = id (docs/math.md section 3)" if spec.softcap is not None else
                   "attention sinks: the sink key's feature lies in the bias coordinate "
                   "(docs/math.md section 13)" if sinks else
                   "ALiBi biases: every key's feature carries a bias coordinate, which the "
                   "descent statistics leave out (docs/math.md sections 8 and 13)")
            nd["descent"] = f"not defined: {why}"
        elif gauge == "original":
            qd = fast.query_descent(st)
            lam["query"] = float(qd.lam_max[hh, 0])
            desc["query"] = bool(qd.descends[hh, 0])
            if affine:
                dd = fast.descent(st)
                lam["input"] = float(dd.lam_max[hh, 0])
                desc["input"] = bool(dd.descends[hh, 0])
        else:
            nd["descent"] = "computed in the original gauge: call step(..., gauge='original')"
        return HeadStep(
            layer=self.layer, head=h, query=i, position=int(self.positions[i]),
            space="input" if affine else "query", keys=keys, scores=s_row, softmax=p_row,
            c=st.c[hh, 0, :nk], mu=mu, T=st.t[hh, 0], b=None if st.b is None else st.b[hh, 0],
            u=u, delta_m=dm, y=y, readout=ro, native=nat, kappa=kap,
            identity_error=float((ro - y).abs().max()), identity_bound=id_bound,
            native_error=float((ro - nat).abs().max()), native_bound=nat_bound,
            lambda_max=lam, descends=desc, sink_weight=sink_w, not_defined=nd)

    def delta_m(self, head: int, query: int = -1) -> torch.Tensor:
        """``Delta M_i`` of one head and query, ``(m+1, r)`` float64 (input space; a head whose
        score is not affine in ``u`` raises :class:`ApiError` with the reason -- use
        :meth:`step`, whose ``delta_m`` is then the query-space step).

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lr = ropestep.attach(zoo.build("llama")).run(torch.arange(12), layers=1)[1]
        >>> tuple(lr.delta_m(head=0, query=-1).shape)  # (m+1, r)
        (129, 32)
        """
        if not self.spec.affine:
            raise ApiError(f"layer {self.layer}: Delta M_i in input space is "
                           f"{self.input_space_reason}")
        return self.step(head, query).delta_m

    # -- frozen reuse ----------------------------------------------------------------------
    def reuse(self, head: int, anchor: int, queries: Any = None, *, at: str = "own"
              ) -> ReuseResult:
        """Frozen reuse of ``anchor``'s matrix for ``queries`` (default: every later token), at
        the queries' own positions (``at="own"``) or at the anchor's (``at="anchor"``): see
        :class:`ReuseResult`."""
        h, a = self._head(head), self._query(anchor)
        if queries is None:
            qs = list(range(a + 1, self.n))
        else:
            qs = [self._query(q) for q in _ints(queries, "query")]
        if not qs:
            raise ApiError(f"no queries to reuse anchor {a}'s matrix for")
        if at not in ("own", "anchor"):
            raise ApiError(f"at must be 'own' or 'anchor', got {at!r}")
        s1, w1 = self._one(h)
        hh = h if s1 is self.spec else 0
        qi = torch.tensor(qs)
        pa = int(self.positions[a])
        dist = self.positions[qi] - pa
        if at == "anchor":
            keys = self._keys(a)
            rows = torch.cat((torch.tensor([a]), qi))
            pos = torch.full((rows.numel(),), pa)
            st = fast.step(s1, w1, self.x[rows], pos, self.x[keys], self.positions[keys], "bank",
                           dtype=F64, keep=("c", "t", "b"))
            fr = fast.frozen_reuse(st, anchor=0, bound=True)
            err = fr.error[hh, 1:]
            base = (st.y[hh, 1:] - st.mu[hh, 1:]).norm(dim=-1)
            # the bound: ||u_i|| ||dM_i - dM_a||_op, or its query-space form (docs/math.md
            # section 8) where the score is not affine in u
            bnd = fr.bound if fr.bound is not None else fast.reuse_bound(st, 0)
            return ReuseResult(self.layer, h, a, at, qi, dist, fr.frozen[hh, 1:], st.y[hh, 1:],
                               err.norm(dim=-1), err.norm(dim=-1) / base, mean_error=base,
                               tokenwise=fr.tokenwise[hh, 1:], bound=bnd[hh, 1:])
        # own positions: the anchor's T_a, mu_a, b_a; query i's effective query at p_a
        top = int(max(qs + [a])) + 1
        ka = self._keys(a)
        sa = fast.step(s1, w1, self.x[a:a + 1], self.positions[a:a + 1], self.x[ka],
                       self.positions[ka], "causal", dtype=F64, keep=("c", "t", "b"))
        Pq = fast.project(s1, w1, self.x[qi], torch.full((len(qs),), pa), self.x[:1],
                          self.positions[:1], dtype=F64)
        qa = Pq.q[hh]  # (Q, d): q_i placed at the anchor's position
        ba = 0 if sa.b is None else sa.b[hh, 0]
        frozen = sa.mu[hh, 0] + qa @ sa.t[hh, 0] + ba
        st = fast.step(s1, w1, self.x[qi], self.positions[qi], self.x[:top],
                       self.positions[:top], "causal", dtype=F64, keep=("c",))
        y, mu = st.y[hh], st.mu[hh]
        # attention rows (softmax of phi(s), the sink's share included) for the TV distance;
        # the anchor's is its own step's row, placed on its keys among the first `top`
        rows_p = _rows_softmax(self.spec, st.s[hh, :, :top], st.mask[:, :top], h)[0]  # (sink column off)
        nka = int(ka.numel())
        pa_row = torch.zeros(1, top, dtype=F64)
        pa_row[:, ka] = _rows_softmax(self.spec, sa.s[hh, :, :nka], sa.mask[:, :nka], h)[0]
        err = (y - frozen).norm(dim=-1)
        base = (y - mu).norm(dim=-1)
        return ReuseResult(self.layer, h, a, at, qi, dist, frozen, y, err, err / base,
                           mean_error=base,
                           const_error=(y - sa.y[hh, 0]).norm(dim=-1),
                           tv=0.5 * (rows_p - pa_row).abs().sum(-1))

    # -- the whole layer, as the atlas --------------------------------------------------------
    def check(self, *, anchor_every: int = 64, dtype: torch.dtype | None = None,
              device: Any = None) -> LayerCheck:
        """Every head and query of the layer through :func:`ropestep.layercheck.evaluate_layer` and
        :func:`~ropestep.layercheck.summarise_layer` -- the numbers and verdict ``ropestep atlas``
        gives on these tokens.  ``dtype``: the low-precision pass's dtype (default: the model's,
        float32 for a float64 model)."""
        lp = dtype if dtype is not None else (self.x.dtype if self.x.dtype != F64
                                              else torch.float32)
        anchor_every, lp = self._evaluation_args(anchor_every, lp, device)
        key = (anchor_every, lp, str(device))
        if key not in self._check:
            res = self.evaluate(dtype=lp, anchor_every=anchor_every, device=device)
            summ = layercheck.summarise_layer([res], self.spec, int(self.x.shape[1]), self.n, lp)
            self._check[key] = LayerCheck(self.layer, res, summ)
        return self._check[key]

    @staticmethod
    def _evaluation_args(anchor_every: Any, lp: Any, device: Any) -> tuple[int, torch.dtype]:
        """The layer evaluation's arguments checked: one :class:`ApiError` naming a bad one."""
        if _int(anchor_every, "anchor_every") < 1:
            raise ApiError(f"anchor_every must be a positive int, got {anchor_every!r}")
        if device is not None:
            from .verdict import device_problem

            why = device_problem(device)
            if why is not None:
                raise ApiError(why.replace("--device", "device"))
        if lp not in (torch.float32, torch.bfloat16, torch.float16):
            raise ApiError(f"dtype must be a torch.dtype: torch.float32, torch.bfloat16 or "
                           f"torch.float16, got {lp!r}")
        return int(anchor_every), lp

    def evaluate(self, *, dtype: torch.dtype = torch.float32, anchor_every: int = 64,
                 max_bytes: int = scale.DEFAULT_MAX_BYTES, device: Any = None,
                 timers: dict | None = None, final_query_only: bool = False
                 ) -> layercheck.LayerResult:
        """The per-query arrays of every head (:func:`ropestep.layercheck.evaluate_layer`,
        ``(H, n)`` each) that :meth:`check` summarises and ``ropestep atlas`` pools over its
        contexts; ``final_query_only``: the replication's measurement alone (the last query's
        query-space step, :func:`ropestep.layercheck.final_query_only`).  ``timers`` receives
        the phases' seconds.

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lr = ropestep.attach(zoo.build("llama")).run(torch.arange(12), layers=1)[1]
        >>> res = lr.evaluate(anchor_every=4)
        >>> res.arrays["id_abs"].shape  # (heads, queries)
        (4, 12)
        """
        anchor_every, dtype = self._evaluation_args(anchor_every, dtype, device)
        spec, w = self.head_description
        if final_query_only:
            return layercheck.final_query_only(spec, w, self.x, self.positions, self.layer,
                                               device=device, max_bytes=max_bytes,
                                               timers=timers)
        return layercheck.evaluate_layer(spec, w, self.x, self.positions, self.native,
                                         layer=self.layer, lp_dtype=dtype,
                                         anchor_every=anchor_every, max_bytes=max_bytes,
                                         device=device, timers=timers)

    def position_derivative(self, queries: Sequence[int]) -> dict:
        """``d y_i / d p_i`` of every head at ``queries`` by the RoPE generator against a
        central difference of the model's own attention, with its derived tolerance, and the
        anchor that this float64 composition reproduces the captured head outputs
        (:func:`ropestep.realchecks.position_derivative`; its result dict, ``"ok"`` the verdict).

        >>> import torch, ropestep, ropestep.archzoo as zoo
        >>> lr = ropestep.attach(zoo.build("llama")).run(torch.arange(12), layers=1)[1]
        >>> lr.position_derivative([5, 11])["ok"]
        True
        """
        from . import realchecks

        qs = [self._query(q) for q in _ints(queries, "query")]
        if not qs:
            raise ApiError("no queries given")
        if self.spec.family == "latent" or self.spec.norm_after_rope \
                or self.spec.alibi_slopes is not None or self.spec.query_temperature is not None:
            raise ApiError(f"layer {self.layer}: the position derivative against the model's "
                           "attention is not defined here (its formulas assume the rotation "
                           "acts last on a plain or QK-normed projection, and an ALiBi model or "
                           "a query temperature reads the token's index, not its position id; "
                           "docs/math.md sections 5 and 13)")
        if self.attached.model.training:
            raise ApiError("the model is in training mode (dropout): call model.eval()")
        with _eager(self.attached.model), models.errors.adapter_errors(
                self.attached.info.name, f"the position derivative of layer {self.layer}"):
            return realchecks.position_derivative(
                self.attached.model, self.layer, self.x, self.positions, qs, heads=self.native,
                head=self.head_description)


def _rows_softmax(spec: HeadSpec, s: torch.Tensor, mask: torch.Tensor, h: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention rows ``softmax(phi(s))`` over the permitted keys and, with a sink, the sink's
    share of each row (its logit one more score, transformed as the kernel transforms it)."""
    z = s
    if spec.sinks is not None:
        z = torch.cat((z, torch.full((*z.shape[:-1], 1), float(spec.sinks[h]), dtype=z.dtype)), -1)
        mask = torch.cat((mask, torch.ones(*mask.shape[:-1], 1, dtype=torch.bool)), -1)
    p = torch.softmax(transform(z, spec.softcap).masked_fill(~mask.to(z.device), -math.inf), -1)
    return (p, None) if spec.sinks is None else (p[..., :-1], p[..., -1])


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------
def _axes(ax: Any) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(5, 3.5))[1]


def _points(ax: Any, plot: str, x: torch.Tensor, y: torch.Tensor, labels: tuple[str, str],
            title: str) -> Any:
    ax = _axes(ax)
    getattr(ax, plot)(x.numpy(), y.numpy(), ".", ms=3)
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title)
    return ax


def plot_coefficients(st: HeadStep, ax: Any = None) -> Any:
    """``c_ij`` against the softmax weights of one step (log-log), one point per key."""
    return _points(ax, "loglog", st.softmax, st.c, ("softmax weight p_ij",
                                                   "c_ij = phi_1(s_ij) / Z_i"),
                   f"layer {st.layer} head {st.head} query {st.query}")


def plot_reuse(r: ReuseResult, ax: Any = None) -> Any:
    """Relative frozen-reuse error against the distance to the anchor."""
    return _points(ax, "semilogy", r.distance, r.relative_error,
                   ("distance to the anchor p_i - p_a", "|y_i - y_fr_i| / |y_i - mu_i|"),
                   f"layer {r.layer} head {r.head}, anchor {r.anchor} ({r.at})")


def plot_lambda(check: LayerCheck, ax: Any = None, space: str = "query") -> Any:
    """``lambda_max`` of every head and query of a layer (:meth:`LayerRun.check`), with the
    line ``lambda_max = 2`` above which the unit step can overshoot."""
    if space not in ("query", "input"):
        raise ApiError(f"space must be 'query' or 'input', got {space!r}")
    arr = check.result.arrays["lam_query" if space == "query" else "lam_input"]
    if not np.isfinite(arr).any():
        why = check.summary.get("descent") or check.summary.get("input_space") or "no values"
        raise ApiError(f"layer {check.layer}: lambda_max in {space} space is {why}")
    ax = _axes(ax)
    H = arr.shape[0]
    for h in range(H):
        ax.semilogy(np.full(arr.shape[1], h), arr[h], ".", ms=2)
    ax.axhline(2.0, color="k", lw=0.8)
    ax.set_xlabel("head")
    ax.set_ylabel(f"lambda_max ({space} space)")
    ax.set_title(f"layer {check.layer}")
    return ax

