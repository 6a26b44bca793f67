"""An output gate between the heads and the output projection (Qwen3-Next's
``o_proj(y * sigmoid(x W_g))``): read and proven on the layer's own tensors
(:func:`ropestep.models.conventions._output_gate`), then applied after the heads' output the
identity reconstructs and checked against the model's own write (validate's ``gated_write``).

Planted errors only these checks see: a gate applied without its sigmoid, with its rows taken
from the query's half of ``q_proj``, or not at all, fails ``gated_write`` while every head-space
check still passes; a gate that is not a sigmoid is not read as one; a norm in between (BitNet)
is not read as a gate.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ropestep import api, census, models, protocol
from ropestep.models.probe import AttentionRecord

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def qwen3_next():
    return census.build("qwen3_next")


def _candidate_rows(model, layer: int):
    lab = api.attach(model)
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
    cr = lab.run_candidates(ids, [int(ids[-1]), 5, 7, 9, 11], layers=[layer])
    return lab, cr


def test_the_gate_is_read_and_a_norm_is_not(qwen3_next):
    info = models.describe_model(qwen3_next)
    (L,) = info.softmax_layers
    conv = info.layers[L]
    assert conv.layout == "gated" and not conv.output_direct and conv.output_gate == "sigmoid"
    assert "output gate sigmoid" in conv.output_between
    g = models.layer_gate(qwen3_next, L)
    H, r = info.n_heads, info.r
    assert g.w_g.shape == (info.hidden, H, r) and g.w_o.shape == (H, r, info.hidden)
    bitnet = models.describe_model(census.build("bitnet"))
    assert all(not c.output_direct and c.output_gate == "" for c in bitnet.conventions())
    assert models.layer_gate(census.build("bitnet"), 0) is None


def test_the_gate_applied_after_the_identity_is_the_models_write(qwen3_next):
    lab, cr = _candidate_rows(qwen3_next, 3)
    comb = next(r for r in cr.evaluate(3).rows if r["head"] == "combined")
    assert comb["pass_gated_write"] and comb["pass_native"] and comb["pass_identity"]
    assert not protocol.row_failures(comb)
    gate = models.layer_gate(qwen3_next, 3)
    head = lab.head_description(3, len(cr.block.ids))
    wrong = {
        "no sigmoid": replace(gate, kind="none"),
        "gate rows from the query's half": None,
        "no gate (o_proj on the heads)": replace(gate, w_g=torch.zeros_like(gate.w_g),
                                                 b_g=None),
    }
    # the query's half of q_proj read as the gate
    q, _ = models.layouts.gated(models.structure.attention_module(
        models.structure.layer_modules(qwen3_next)[3], "m", 3), lab.info.n_heads,
        lab.info.for_layer(3).n_kv_heads, lab.info.for_layer(3).head_dim,
        lab.info.for_layer(3).r)["q"]
    wrong["gate rows from the query's half"] = replace(
        gate, w_g=q.detach().T.reshape(gate.w_g.shape).double())
    from ropestep import contextcheck

    for what, g in wrong.items():
        if what == "no sigmoid":  # the gate's pre-activation used as the factor
            class Linear(type(gate)):
                def write(self, x, y):
                    dt = y.dtype
                    z = torch.einsum("qm,mhr->hqr", x.to(dt), self.w_g.to(dt))
                    if self.b_g is not None:
                        z = z + self.b_g.to(dt)[:, None]
                    return torch.einsum("hqr,hrd->qd", z * y, self.w_o.to(dt))
            g = Linear(**{k: getattr(gate, k) for k in ("kind", "w_g", "b_g", "w_o", "b_o")})
        lc = contextcheck.evaluate_layer(*head, cr.context, 3, "float32", "cpu", g)
        comb = next(r for r in lc.rows if r["head"] == "combined")
        assert not comb["pass_gated_write"], what
        assert comb["pass_native"] and comb["pass_identity"], what  # head space unaffected
        assert [f.check for f in protocol.row_failures(comb)] == ["gated_write"], what


def _record(factor):
    n, H, r, m = 6, 2, 4, 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, m, generator=g)
    W = torch.randn(H * r, m, generator=g)
    y = torch.randn(1, n, H, r, generator=g)
    z = (x.double() @ W.double().T).view(n, H, r)
    rec = AttentionRecord(hidden=x[None], output=y,
                          o_in=(y.double() * factor(z)[None]).float().reshape(1, n, H * r))
    return rec, (W, None), x.double(), H, r


def test_only_a_sigmoid_gate_is_read_as_one():
    og = models.conventions._output_gate
    rec, part, x, H, r = _record(torch.sigmoid)
    assert og(rec, part, x, H, r, "m", 0) == "sigmoid"
    for other in (torch.tanh, lambda z: torch.sigmoid(1.01 * z), lambda z: torch.sigmoid(z + 1e-3)):
        rec, part, x, H, r = _record(other)
        assert og(rec, part, x, H, r, "m", 0) == ""
