"""Projection layouts: how an attention module's linear maps hold its query, key and value heads.

This is the one convention that cannot be read off a module's attributes (a fused ``nn.Linear``
does not say how its rows split), so each layout known to transformers is one entry here:

* ``separate`` -- ``q_proj``, ``k_proj``, ``v_proj`` (Llama, Qwen, Mistral, Gemma, Phi, ...);
* ``fused`` -- one ``qkv_proj`` (``query_key_value``, ``Wqkv``) whose rows are ``[q heads; k
  heads; v heads]`` (Phi-3, Falcon's multi-query form);
* ``grouped`` -- one fused map whose rows are, KV group by KV group, ``[its q heads; k_g; v_g]``
  (Falcon's new decoder architecture);
* ``model_parallel`` -- CodeGen's ``qkv_proj`` in ``mp_num`` shards of ``[q; v; k]`` rows;
* ``per_head`` -- one ``query_key_value`` whose rows are, head by head, ``[q_h; k_h; v_h]``
  (GPT-NeoX: ``view(..., -1, 3 d).chunk(3)``);
* ``gated`` -- ``q_proj`` rows, head by head, ``[q_h; g_h]``: the query and an output gate
  (Qwen3-Next), keys and values separate; the gate's rows are its ``"g"`` part.

Every layout that fits a module's attributes is a *candidate*; :mod:`ropestep.models.conventions`
keeps the one whose queries, keys and values reproduce the module's own (the tensors its eager
attention receives, :mod:`ropestep.models.probe`), and refuses the layer when none does.  Each
returns ``{"q": (W, b), "k": (W, b), "v": (W, b)}`` in ``nn.Linear`` layout (``W: (heads * d,
m)``, head-major rows), views of the module's parameters.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn


def _lin(attn: Any, name: str) -> Any:
    mod = getattr(attn, name, None)
    return mod if isinstance(mod, nn.Linear) else None


def _wb(lin: Any, rows: slice | None = None, idx: Any = None) -> tuple[Any, Any]:
    w, b = lin.weight, lin.bias
    if idx is not None:
        return w[idx], (None if b is None else b[idx])
    return w[rows], (None if b is None else b[rows])


def separate(attn: Any, H: int, Hk: int, d: int, r: int) -> dict | None:
    q, k, v = _lin(attn, "q_proj"), _lin(attn, "k_proj"), _lin(attn, "v_proj")
    if q is None or k is None or v is None:
        return None
    if (q.out_features, k.out_features, v.out_features) != (H * d, Hk * d, Hk * r):
        return None
    return {"q": _wb(q, slice(None)), "k": _wb(k, slice(None)), "v": _wb(v, slice(None))}


def gated(attn: Any, H: int, Hk: int, d: int, r: int) -> dict | None:
    """``q_proj`` holding, head by head, the query and an output gate ``[q_h; g_h]`` (Qwen3-Next:
    ``view(..., -1, 2 d).chunk(2)``); keys and values as ``separate``."""
    import torch

    q, k, v = _lin(attn, "q_proj"), _lin(attn, "k_proj"), _lin(attn, "v_proj")
    if q is None or k is None or v is None:
        return None
    if (q.out_features, k.out_features, v.out_features) != (2 * H * d, Hk * d, Hk * r):
        return None
    rows = (torch.arange(H)[:, None] * 2 * d + torch.arange(d)[None]).reshape(-1)
    return {"q": _wb(q, idx=rows), "k": _wb(k, slice(None)), "v": _wb(v, slice(None)),
            "g": _wb(q, idx=rows + d)}  # the gate's rows: the output gate the reading checks


FUSED_NAMES = ("qkv_proj", "query_key_value", "Wqkv")


def _fused_lin(attn: Any) -> Any:
    return next((lin for lin in (_lin(attn, n) for n in FUSED_NAMES) if lin is not None), None)


def fused(attn: Any, H: int, Hk: int, d: int, r: int) -> dict | None:
    lin = _fused_lin(attn)
    if lin is None or lin.out_features != H * d + Hk * d + Hk * r:
        return None
    a, b = H * d, H * d + Hk * d
    return {"q": _wb(lin, slice(0, a)), "k": _wb(lin, slice(a, b)),
            "v": _wb(lin, slice(b, None))}


def per_head(attn: Any, H: int, Hk: int, d: int, r: int) -> dict | None:
    import torch

    lin = _lin(attn, "query_key_value")
    if lin is None or H != Hk or r != d or lin.out_features != 3 * H * d:
        return None
    base = torch.arange(H)[:, None] * 3 * d + torch.arange(d)[None]  # (H, d) rows of q_h
    return {"q": _wb(lin, idx=base.reshape(-1)), "k": _wb(lin, idx=(base + d).reshape(-1)),
            "v": _wb(lin, idx=(base + 2 * d).reshape(-1))}


def grouped(attn: Any, H: int, Hk: int, d: int, r: int) -> dict | None:
    """One fused map whose rows are, KV group by KV group, ``[q heads of the group; k_g; v_g]``
    (Falcon's new decoder architecture: ``view(..., H_kv, H/H_kv + 2, d)``)."""
    import torch

    lin = _fused_lin(attn)
    if lin is None or r != d or H % Hk or lin.out_features != (H + 2 * Hk) * d:
        return None
    G = H // Hk
    base = torch.arange(Hk)[:, None] * (G + 2) * d  # (Hk, 1): each group's first row
    q = (base[:, None] + torch.arange(G)[None, :, None] * d
         + torch.arange(d)[None, None]).reshape(-1)  # group g's heads, head by head
    k = (base + G * d + torch.arange(d)[None]).reshape(-1)
    v = (base + (G + 1) * d + torch.arange(d)[None]).reshape(-1)
    return {"q": _wb(lin, idx=q), "k": _wb(lin, idx=k), "v": _wb(lin, idx=v)}


def model_parallel(attn: Any, H: int, Hk: int, d: int, r: int) -> dict | None:
    """CodeGen's ``qkv_proj`` split for ``mp_num`` model-parallel shards: rows, shard by shard,
    ``[q part; v part; k part]`` (each ``H d / mp_num`` rows; note v before k), the shards' q
    parts concatenated giving the heads in order."""
    import torch

    lin, mp = _lin(attn, "qkv_proj"), getattr(attn, "mp_num", None)
    if lin is None or not isinstance(mp, int) or mp < 1 or H != Hk or r != d or \
            lin.out_features != 3 * H * d or (H * d) % mp:
        return None
    loc = H * d // mp
    base = torch.arange(mp)[:, None] * 3 * loc + torch.arange(loc)[None]  # (mp, loc)
    return {"q": _wb(lin, idx=base.reshape(-1)), "v": _wb(lin, idx=(base + loc).reshape(-1)),
            "k": _wb(lin, idx=(base + 2 * loc).reshape(-1))}


def project(part: tuple, x: Any, heads: int) -> tuple[Any, Any]:
    """One part ``(W, b)`` applied to ``x (n, m)`` in float64 on the CPU: ``z = x W^T + b`` and
    its rounding terms ``A = |x| |W|^T + |b|``, each ``(n, heads, dim)``."""
    import torch

    f64 = torch.float64
    W = part[0].detach().to("cpu", f64)
    x = x.to("cpu", f64)
    z, A = x @ W.T, x.abs() @ W.abs().T
    if part[1] is not None:
        b = part[1].detach().to("cpu", f64)
        z, A = z + b, A + b.abs()
    n = x.shape[0]
    return z.view(n, heads, -1), A.view(n, heads, -1)


LAYOUTS: dict[str, Callable[..., dict | None]] = {
    "separate": separate, "fused": fused, "per_head": per_head, "gated": gated,
    "grouped": grouped, "model_parallel": model_parallel}


def candidates(attn: Any, H: int, Hk: int, d: int, r: int) -> dict[str, dict]:
    """Every layout whose modules exist with the right sizes, by name."""
    out = {}
    for name, fn in LAYOUTS.items():
        got = fn(attn, H, Hk, d, r)
        if got is not None:
            out[name] = got
    return out
