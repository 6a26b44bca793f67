"""Smoke-run every configuration of ``ropestep.archzoo``: build it, run one eager forward over 48
tokens, and print one line per architecture with the conventions as the modules hold them.

For each architecture: name, model_type, build OK / error; the attention module's class, its
``nn.Linear`` attributes, ``scaling`` and per-layer ``sliding_window``; every rotary module
(where it lives, ``rope_type``, ``attention_scaling``, ``inv_freq`` length — per layer type where
the module keeps several); norms inside the attention module and their weight shapes; and, from
the model's own ``eager_attention_forward`` (wrapped for the forward, restored afterwards): how
many layers called it, the keyword arguments it received, the ``scaling``/``softcap``/
``sliding_window`` values, the max |score| over the permitted keys (before soft-capping), the
mean over rows of the largest attention probability (1/n for uniform rows) and, with ``s_aux``,
the mean share of the softmax mass the sink takes.

    nice -n 19 python tools/archzoo_smoke.py [name ...]
"""
from __future__ import annotations

import logging
import sys
import traceback
import warnings

import torch
from torch import nn

from ropestep import archzoo

N_TOKENS = 48


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in x) + "]"
    return str(x)


def _rotary_summary(model) -> list[str]:
    out = []
    for path, mod in model.named_modules():
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        rt = getattr(mod, "rope_type", None)
        if isinstance(rt, dict):  # one table per layer type (Gemma 3)
            parts = [f"{lt}:{t}/as={_fmt(float(getattr(mod, f'{lt}_attention_scaling')))}"
                     f"/inv={getattr(mod, f'{lt}_inv_freq').numel()}" for lt, t in rt.items()]
            out.append(f"{path}{{{' '.join(parts)}}}")
        else:
            inv = getattr(mod, "inv_freq", None)
            as_ = getattr(mod, "attention_scaling", None)
            out.append(f"{path}{{{rt}/as={_fmt(float(as_)) if as_ is not None else None}"
                       f"/inv={inv.numel() if inv is not None else None}}}")
    return out


def _scores_stats(rec) -> dict:
    """max |score| over permitted keys, mean row max-probability, mean sink share."""
    q, k = rec["query"].float(), rec["key"].float()
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * rec["scaling"]
    t = scores.shape[-1]
    mask = rec["mask"]
    if mask is not None:
        m = mask[..., :t]
        if m.dtype == torch.bool:
            allowed = m
        else:
            allowed = m > torch.finfo(m.dtype).min / 2
    else:
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = allowed.expand_as(scores)
    max_abs = scores.abs().masked_fill(~allowed, 0).max().item()
    capped = scores
    if rec["softcap"]:
        capped = torch.tanh(scores / rec["softcap"]) * rec["softcap"]
    logits = capped.masked_fill(~allowed, float("-inf"))
    sink_share = None
    if rec["s_aux"] is not None:
        sinks = rec["s_aux"].float().reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)
        sink_share = probs[..., -1].mean().item()
        probs = probs[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return dict(max_abs=max_abs, row_max_p=probs.max(-1).values.mean().item(),
                sink_share=sink_share, keys_per_row=allowed[0, 0].sum(-1).float().mean().item())


def smoke(name: str) -> str:
    spec = archzoo.ARCHITECTURES[name]
    head = f"{name} [{spec.model_type}]"
    try:
        model = archzoo.build(name)
    except Exception as err:  # noqa: BLE001 - reported, one line
        return f"{head} build ERROR {type(err).__name__}: {str(err).splitlines()[0]}"
    layers = archzoo.decoder_layers(model)
    attns = [archzoo.attention_module(layer) for layer in layers]
    a0 = attns[0]
    modeling = sys.modules[type(a0).__module__]
    linears = [n for n, m in a0.named_children() if isinstance(m, nn.Linear)]
    bias = [n for n in linears if getattr(a0, n).bias is not None]
    norms = {n: tuple(getattr(m, "weight").shape) if getattr(m, "weight", None) is not None
             else None for n, m in a0.named_modules() if n and archzoo.is_norm(m)}
    own = {n: tuple(p.shape) for n, p in a0.named_parameters(recurse=False)}
    scaling = getattr(a0, "scaling", None)
    windows = [getattr(a, "sliding_window", "-") for a in attns]
    attr_rope = [getattr(a, "use_rope", None) for a in attns]
    records: list[dict] = []
    original = getattr(modeling, "eager_attention_forward", None)

    def wrapped(module, query, key, value, attention_mask, *args, **kwargs):
        records.append(dict(
            layer=getattr(module, "layer_idx", None), query=query.detach(), key=key.detach(),
            mask=attention_mask.detach() if isinstance(attention_mask, torch.Tensor) else None,
            scaling=kwargs.get("scaling", args[1] if len(args) > 1 else None),
            softcap=kwargs.get("softcap"), sliding_window=kwargs.get("sliding_window", "absent"),
            s_aux=kwargs.get("s_aux"), kw=sorted(kwargs)))
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    ids = torch.randint(0, archzoo.VOCAB, (1, N_TOKENS), generator=torch.Generator().manual_seed(7))
    try:
        if original is None:
            raise RuntimeError(f"{modeling.__name__} has no eager_attention_forward")
        modeling.eager_attention_forward = wrapped
        with torch.no_grad():
            out = model(ids)
        ok = bool(torch.isfinite(out.logits).all())
    except Exception as err:  # noqa: BLE001
        return f"{head} forward ERROR {type(err).__name__}: {str(err).splitlines()[0]}"
    finally:
        if original is not None:
            modeling.eager_attention_forward = original
    for rec in records:
        if rec["scaling"] is None:
            rec["scaling"] = a0.head_dim ** -0.5
    stats = [_scores_stats(r) for r in records]
    kw = sorted({k for r in records for k in r["kw"]})
    parts = [
        f"{head} OK",
        f"attn={type(a0).__name__}",
        f"linear={','.join(linears)} bias={','.join(bias) or '-'}",
        f"scaling={_fmt(float(scaling)) if scaling is not None else None}",
        f"sliding_window={_fmt(windows)}",
        *(["use_rope=" + _fmt(attr_rope)] if any(v is not None for v in attr_rope) else []),
        "rotary=" + " ".join(_rotary_summary(model)),
        f"attn_norms={norms or '-'}",
        *([f"own_params={own}"] if own else []),
        f"eager_calls={len(records)}/{len(layers)}",
        f"eager_kw={','.join(kw)}",
        "eager(scaling,softcap,window)=" + " ".join(
            f"L{r['layer']}:({_fmt(float(r['scaling']))},{r['softcap']},{r['sliding_window']})"
            for r in records),
        "keys/row=" + _fmt([s["keys_per_row"] for s in stats]),
        "max|score|=" + _fmt([s["max_abs"] for s in stats]),
        "row_max_p=" + _fmt([s["row_max_p"] for s in stats]),
        *(["sink_share=" + _fmt([s["sink_share"] for s in stats])]
          if any(s["sink_share"] is not None for s in stats) else []),
        f"finite={ok}",
    ]
    return " | ".join(parts)


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass
    torch.set_num_threads(1)
    names = argv or list(archzoo.ARCHITECTURES)
    bad = 0
    for name in names:
        try:
            line = smoke(name)
        except Exception:  # noqa: BLE001 - a bug in this tool, not in the zoo
            line = f"{name} TOOL ERROR {traceback.format_exc().splitlines()[-1]}"
        bad += " OK |" not in line
        print(line, flush=True)
    for name, why in archzoo.NOT_BUILDABLE.items():
        print(f"{name} NOT BUILDABLE: {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
