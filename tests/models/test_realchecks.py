"""ropestep.realchecks on a tiny random Qwen2 and on SmolLM2-135M: every check passes on the
correct model, and each deliberate mistake fails the check meant to catch it.

Mutations (each must turn ``ok`` False):

* a wrong RoPE pairing (a head description with the interleaved layout) -- caught by
  :func:`conventions`, while the mpmath oracle and the fast layer, sharing the mistake, still
  agree (:func:`exact_rows` passes with it);
* a wrong GQA map, in the description (``HeadSpec.kv_head``) and in the fast layer's projection;
* a query position off by one in the fast layer's projection -- caught by
  :func:`position_derivative` and :func:`position_shift`;
* a perturbed ``Delta M`` -- caught by :func:`exact_rows`.

QK-norm heads (tiny random Qwen3, OLMo 2 and Gemma 3 from :mod:`ropestep.archzoo`, 24 tokens):
every check of the query-space identity passes, :func:`exact_rows` compares the query-space
``Delta M^q`` (and catches it perturbed), the input-space claims refuse the heads, and

* the model's ``q_norm`` left out on ropestep's side (its gain set to ones, or the head
  described as family ``"dot"``), Gemma 3's gain read as ``w`` instead of ``1 + w``, and the norm
  scope read wrong (OLMo 2's norm over the whole projection taken per head; Qwen3's per-head norm
  taken over the whole projection) are caught by :func:`conventions`, the positional checks and,
  for the scope, :func:`exact_rows`.

Sizes are small (64-token contexts, rows with at most 6 keys for the oracle) so the file runs in
well under two minutes on two loaded cores.
"""
from __future__ import annotations

from dataclasses import replace

import math
import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from ropestep import fast, models, realchecks as rc  # noqa: E402
from ropestep import tolerances as tl  # noqa: E402
from ropestep.spec import HeadSpec  # noqa: E402
from ropestep.verdict import dumps, loads  # noqa: E402

pytestmark = pytest.mark.model

N_CTX = 64  # tokens per test context
LAYER = 1  # the tiny model's last layer


def _json(res: dict) -> dict:
    """Every result is JSON-ready (strict JSON, non-finite numbers as strings)."""
    return loads(dumps(res))


@pytest.fixture(scope="module")
def tiny(tiny_qwen2):
    """Layer 1 of the tiny Qwen2 over 64 tokens: capture, head description, and a block capture
    with 5 candidate continuations (queries at position 63 reading the prefix bank)."""
    model = tiny_qwen2.model
    ids = tiny_qwen2.ids[:N_CTX]
    cap = models.capture(model, ids, [LAYER])[LAYER]
    spec, w = models.layer_head(model, LAYER, N_CTX)
    bc = models.capture_block(model, ids, [LAYER], [3, 17, 40, 99, 200])
    return {"model": model, "x": cap.x, "pos": cap.positions, "heads": cap.heads, "spec": spec,
            "w": w, "xq": bc.queries[LAYER].x, "xb": bc.full[LAYER].x[:-1]}


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    """The oracle on one seeded row with few keys (shared by the exact-row tests)."""
    rows = rc.sample_rows(tiny["spec"].n_heads, range(2, 6), 1, seed=3)
    return rows, rc.exact_reference(tiny["spec"], tiny["w"], tiny["x"], tiny["pos"], rows)


# ---------------------------------------------------------------------------------------------
# 1. conventions
# ---------------------------------------------------------------------------------------------
def test_conventions_pass(tiny):
    res = rc.conventions(tiny["model"], LAYER, tiny["x"], tiny["pos"])
    print("conventions: q/k/v rel", res["q_rel_max"], res["k_rel_max"], res["v_rel_max"],
          "tolerance", res["tolerance_max"])
    assert res["ok"], res
    assert len(res["heads"]) == tiny["spec"].n_heads and set(res["routes"]) == {"spec",
                                                                                 "fast.project"}
    assert all(h["q_rel"] <= h["q_tol"] and h["k_rel"] <= h["k_tol"] for h in res["heads"])
    assert res["scale"]["ok"]
    assert _json(res)["ok"] is True


def test_wrong_pairing_caught_by_conventions_though_exact_and_fast_agree(tiny):
    """The interleaved layout on a split-half model: exact and fast share the mistake (they
    agree to 1e-12), only the comparison with the model's own rotation sees it."""
    spec, w = tiny["spec"], tiny["w"]
    bad = replace(spec, rope=replace(spec.rope, layout="interleaved"))
    res = rc.conventions(tiny["model"], LAYER, tiny["x"], tiny["pos"], head=(bad, w))
    print("wrong pairing: q_rel", res["q_rel_max"], "k_rel", res["k_rel_max"])
    assert not res["ok"]
    assert res["q_rel_max"] > tl.DETECT_FACTOR * res["tolerance_max"]
    assert res["k_rel_max"] > tl.DETECT_REL
    assert res["v_rel_max"] <= res["tolerance_max"]  # values are not rotated: still right
    shared = rc.exact_rows(bad, w, tiny["x"], tiny["pos"], [(0, 3)])
    print("exact vs fast under the wrong pairing:", shared["y_rel_max"], shared["delta_m_rel_max"])
    assert shared["ok"], shared


def test_wrong_gqa_map_caught(tiny, monkeypatch):
    """Query head h reading KV head h % H_kv (instead of h // group): in the description (the
    map the oracle uses) and in the fast layer's projection."""
    ok = rc.conventions(tiny["model"], LAYER, tiny["x"], tiny["pos"])
    assert ok["ok"]
    with monkeypatch.context() as mp_:
        mp_.setattr(HeadSpec, "kv_head", lambda self, h: h % self.n_kv_heads)
        res = rc.conventions(tiny["model"], LAYER, tiny["x"], tiny["pos"])
    bad = [h["head"] for h in res["heads"] if not h["ok"]]
    print("kv_head mutant: failing heads", bad, "k_rel", res["k_rel_max"])
    assert not res["ok"] and not res["routes"]["spec"]["ok"] and res["routes"]["fast.project"]["ok"]
    assert res["k_rel_max"] > tl.DETECT_FACTOR * res["tolerance_max"]
    group = tiny["spec"].group
    moved = [h for h in range(tiny["spec"].n_heads) if h % tiny["spec"].n_kv_heads != h // group]
    assert set(bad) == set(moved)

    orig = fast.project

    def modulo_grouping(spec, weights, *a, **k):
        P = orig(spec, weights, *a, **k)
        Hk = spec.n_kv_heads
        src = torch.arange(spec.n_heads) // spec.group  # which KV head each row holds
        first = torch.stack([torch.nonzero(src == g)[0, 0] for g in range(Hk)])
        pick = first[torch.arange(spec.n_heads) % Hk]
        P.k, P.v = P.k[pick], P.v[pick]
        return P

    monkeypatch.setattr(fast, "project", modulo_grouping)
    res = rc.conventions(tiny["model"], LAYER, tiny["x"], tiny["pos"])
    print("fast.project grouping mutant: k_rel", res["k_rel_max"])
    assert not res["ok"] and not res["routes"]["fast.project"]["ok"] and res["routes"]["spec"]["ok"]


# ---------------------------------------------------------------------------------------------
# 2. exact rows
# ---------------------------------------------------------------------------------------------
def test_sample_rows_seeded():
    a = rc.sample_rows(14, 32, 5, seed=1)
    assert a == rc.sample_rows(14, 32, 5, seed=1) and len(set(a)) == 5
    assert a != rc.sample_rows(14, 32, 5, seed=2)
    assert all(0 <= h < 14 and 0 <= q < 32 for h, q in a) and a == sorted(a)
    assert rc.sample_rows(2, [4, 7], 10, seed=0) == [(0, 4), (0, 7), (1, 4), (1, 7)]
    with pytest.raises(ValueError):
        rc.sample_rows(0, 4, 1, seed=0)
    with pytest.raises(ValueError):
        rc.sample_rows(2, [], 1, seed=0)


def test_exact_rows_pass_and_perturbed_delta_m_caught(tiny, tiny_reference, monkeypatch):
    rows, ref = tiny_reference
    args = (tiny["spec"], tiny["w"], tiny["x"], tiny["pos"], rows)
    res = rc.exact_rows(*args, reference=ref)
    print("exact rows:", {k: res[k] for k in ("y_rel_max", "delta_m_rel_max", "c_rel_max",
                                              "readout_rel_max", "exact_seconds")})
    assert res["ok"], res
    assert res["tolerance"] == tl.FLOAT64_REL and res["digits"] == 50
    assert all(r["first_order"] < tl.FLOAT64_REL for r in res["rows"])
    _json(res)

    orig = fast.step

    def perturbed(*a, **k):
        st = orig(*a, **k)
        if st.delta_m is not None:  # a relative 1e-9 error in one entry per matrix
            st.delta_m[..., 0, 0] += 1e-9 * st.delta_m.abs().amax((-1, -2))
        return st

    monkeypatch.setattr(fast, "step", perturbed)
    bad = rc.exact_rows(*args, reference=ref)
    print("perturbed Delta M:", bad["delta_m_rel_max"])
    assert not bad["ok"] and bad["delta_m_rel_max"] > tl.FLOAT64_REL
    assert bad["y_rel_max"] <= tl.FLOAT64_REL  # only Delta M was touched
    with pytest.raises(ValueError, match="reference holds rows"):
        rc.exact_rows(tiny["spec"], tiny["w"], tiny["x"], tiny["pos"], [(0, 1)], reference=ref)


# ---------------------------------------------------------------------------------------------
# 3. claims
# ---------------------------------------------------------------------------------------------
def test_positive_coefficients(tiny, tiny_reference, monkeypatch):
    _, ref = tiny_reference
    res = rc.positive_coefficients(tiny["spec"], tiny["w"], tiny["x"], tiny["pos"], reference=ref)
    print("min c", res["min_c"], "at", res["argmin"], "exact", res["exact"])
    assert res["ok"] and res["min_c"] > 0 and res["exact"]["min_c"] > 0
    assert res["coefficients"] == tiny["spec"].n_heads * N_CTX * (N_CTX + 1) // 2
    orig = fast.step

    def nan_c(*a, **k):  # a NaN coefficient is a failure, never a pass
        st = orig(*a, **k)
        st.c[0, 5, 2] = float("nan")
        return st

    monkeypatch.setattr(fast, "step", nan_c)
    bad = rc.positive_coefficients(tiny["spec"], tiny["w"], tiny["x"], tiny["pos"])
    assert not bad["ok"] and np.isnan(bad["min_c"])
    assert bad["argmin"] == {"head": 0, "query": 5, "key": 2}
    assert _json(bad)["min_c"] != _json(bad)["min_c"]  # nan survives the JSON round trip


def test_delta_m_rank(tiny):
    res = rc.delta_m_rank(tiny["spec"], tiny["w"], tiny["x"], tiny["pos"], [(3, 63)])
    print("rank", res["rows"])
    assert res["ok"] and res["rank_max"] <= res["d"]
    r = res["rows"][0]
    assert r["bound"] == min(res["d"], N_CTX - 1) and r["rank"] == r["bound"]  # attained
    assert r["sigma_ratio_after_d"] < r["threshold_ratio"] < tl.FLOAT64_REL


def test_delta_m_rank_spectral_summary_where_d_binds(tiny_qwen2):
    """A row with more keys than ``d + 1`` (96 tokens, query 95: the bound is ``d = 64``, not
    ``N_i - 1``): the rank is ``d``, ``sigma_max`` is the product's largest singular value and
    ``sigma_ratio_after_d`` is ``sigma_(d+1) / sigma_1``, below the rank threshold -- while
    ``sigma_d / sigma_1`` (recomputed here: numpy's SVD of ``Delta M_i W_o,h``, with ``W_o,h``
    read from the model's own ``o_proj`` rows) lies far above it."""
    model, n, h = tiny_qwen2.model, 96, 3
    cap = models.capture(model, tiny_qwen2.ids[:n], [LAYER])[LAYER]
    spec, w = models.layer_head(model, LAYER, n)
    res = rc.delta_m_rank(spec, w, cap.x, cap.positions, [(h, n - 1)])
    row = res["rows"][0]
    d = spec.head_dim
    st = fast.step(spec, w, cap.x[n - 1:], cap.positions[n - 1:], cap.x, cap.positions,
                   mask="causal", dtype=torch.float64, delta_m=True, keep=())
    o = model.model.layers[LAYER].self_attn.o_proj.weight.detach().double().numpy()  # (D, H d)
    prod = st.delta_m[h, 0].numpy() @ o[:, h * d:(h + 1) * d].T
    sv = np.linalg.svd(prod, compute_uv=False)
    print("rank", row["rank"], "after d", row["sigma_ratio_after_d"], "threshold",
          row["threshold_ratio"], "sigma_d / sigma_1", sv[d - 1] / sv[0])
    assert row["keys"] == n and row["bound"] == d and row["rank"] == d
    assert abs(row["sigma_max"] - sv[0]) <= tl.FLOAT64_REL * sv[0]
    assert row["sigma_ratio_after_d"] < row["threshold_ratio"] < tl.FLOAT64_REL
    assert sv[d - 1] / sv[0] > 1e3 * row["threshold_ratio"]


def test_no_global_readout(tiny):
    Q = tiny["xq"].shape[0]
    res = rc.no_global_readout(tiny["spec"], tiny["w"], tiny["xq"], torch.full((Q,), N_CTX - 1),
                               tiny["xb"], torch.arange(N_CTX - 1))
    print("certified lower bound (min over heads)", res["lower_certified_min"],
          "combined", res["combined"]["lower_certified"])
    assert res["ok"] and res["pairs"] == Q * (Q - 1) // 2
    for h in res["heads"]:
        assert 0 < h["lower_certified"] <= h["upper"]
        assert h["float64_error"] < 1e-6 * h["lower_computed"]
        assert h["hull"]["certified"] >= 1
    _json(res)
    with pytest.raises(ValueError, match="one position"):
        rc.no_global_readout(tiny["spec"], tiny["w"], tiny["xq"], torch.arange(Q), tiny["xb"],
                             torch.arange(N_CTX - 1))


def _model_attention64(model, layer: int, x_q, pos_q: int, x_kv, pos_kv):
    """Per-head outputs ``(H, Q, r)`` of queries ``x_q`` at position ``pos_q`` reading the bank
    ``x_kv`` at ``pos_kv`` (every key), from the model's own modules in float64: float64 copies
    of ``q_proj``/``k_proj``/``v_proj``, the model's ``rotary_emb`` tables, its modeling module's
    ``apply_rotary_pos_emb`` and ``repeat_kv``, its ``scaling`` and a float64 softmax (nothing
    from ropestep's fast layer or from realchecks)."""
    import copy
    import sys

    attn = model.model.layers[layer].self_attn
    mod = sys.modules[type(attn).__module__]
    cfg = model.config
    H, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = attn.head_dim
    f64 = torch.float64
    with torch.no_grad():
        def proj(name, x, nh):
            lin = copy.deepcopy(getattr(attn, name)).to(f64)
            return lin(x.to(f64)[None]).view(1, x.shape[0], nh, d).transpose(1, 2)

        q, k, v = proj("q_proj", x_q, H), proj("k_proj", x_kv, Hk), proj("v_proj", x_kv, Hk)
        Q = x_q.shape[0]
        cq, sq = model.model.rotary_emb(q, torch.full((1, Q), int(pos_q)))
        ck, sk = model.model.rotary_emb(k, torch.as_tensor(pos_kv)[None])
        q, _ = mod.apply_rotary_pos_emb(q, q, cq, sq)
        _, k = mod.apply_rotary_pos_emb(k, k, ck, sk)
        k, v = mod.repeat_kv(k, H // Hk), mod.repeat_kv(v, H // Hk)
        w = torch.softmax((q @ k.transpose(-1, -2)) * float(attn.scaling), -1)
        return (w @ v)[0], v[0]  # (H, Q, r), (H, N, r)


def test_no_global_readout_bound_recomputed_from_the_models_attention(tiny):
    """The certified lower bound's two numbers per head, recomputed here from the model's own
    attention in float64 (:func:`_model_attention64`) at the queries and at every pairwise
    midpoint ``u_c = (u_a + u_b) / 2``:

    * ``lower_computed = max_(a < b) |y_c - (y_a + y_b)/2|_2 / 2`` (section 7's three-point bound:
      the 1/2 is part of the derivation) at the reported pair;
    * ``float64_error = sqrt(r) FLOAT64_REL max_j |v_j|_inf + 4 u lower_computed``.

    Both sides are float64 evaluations of the same outputs from the same float32 inputs and
    weights: each output within ``agreement_rel_tol(float64, N, d, m)`` of the value scale ``S``,
    so the bound within ``sqrt(r) a64 S`` (three outputs, weights 1/2, 1/4, 1/4 after the
    halving; Euclidean over r components), plus its own roundings."""
    import itertools
    import math

    xq, xb = tiny["xq"], tiny["xb"]
    Q, N = xq.shape[0], xb.shape[0]
    res = rc.no_global_readout(tiny["spec"], tiny["w"], xq, torch.full((Q,), N_CTX - 1), xb,
                               torch.arange(N))
    pairs = list(itertools.combinations(range(Q), 2))
    x64 = xq.double()
    X = torch.cat((x64, torch.stack([(x64[a] + x64[b]) / 2 for a, b in pairs])))
    y, v = _model_attention64(tiny["model"], LAYER, X, N_CTX - 1, xb, torch.arange(N))
    spec = tiny["spec"]
    d, r, m = spec.head_dim, spec.r, xq.shape[1]
    a64 = tl.agreement_rel_tol(torch.float64, N, d, m)
    U64 = 2.0 ** -53
    for h, row in enumerate(res["heads"]):
        gap = torch.stack([y[h, Q + c] - (y[h, a] + y[h, b]) / 2 for c, (a, b) in enumerate(pairs)])
        lower = torch.linalg.vector_norm(gap, dim=-1) / 2
        best = float(lower.max())
        S = float(v[h].abs().max())
        tol = math.sqrt(r) * a64 * S + 8 * U64 * best
        assert abs(row["lower_computed"] - best) <= tol, (h, row["lower_computed"], best, tol)
        a, b = row["pair"]
        assert abs(float(lower[pairs.index((a, b))]) - best) <= 2 * tol  # the reported pair
        err = math.sqrt(r) * tl.FLOAT64_REL * S + 4 * U64 * best
        assert abs(row["float64_error"] - err) <= 4 * a64 * err, (h, row["float64_error"], err)
        assert row["lower_certified"] == row["lower_computed"] - row["float64_error"]


def test_exact_rows_report_planted_relative_errors(tiny, tiny_reference, monkeypatch):
    """A relative error planted in the float64 side is reported as planted: every output moved
    by ``1e-6 S`` (``S = max_j |v_j|_inf`` over the row's keys, recomputed here from the model's
    own ``v_proj`` in float64) gives ``y_rel = 1e-6`` (the error relative to the value scale,
    as the tolerance is stated); every coefficient scaled by ``1 + 1e-6`` gives ``c_rel = 1e-6``
    (relative to ``c_exact``).  Each within the unplanted row's own error (triangle inequality)
    plus the agreement of the two value scales and the planted sums' roundings."""
    import copy

    rows, ref = tiny_reference
    (h, i), = rows
    args = (tiny["spec"], tiny["w"], tiny["x"], tiny["pos"], rows)
    clean = rc.exact_rows(*args, reference=ref)["rows"][0]
    model = tiny["model"]
    attn = model.model.layers[LAYER].self_attn
    Hk, d = model.config.num_key_value_heads, attn.head_dim
    g = h // (model.config.num_attention_heads // Hk)
    with torch.no_grad():
        v = copy.deepcopy(attn.v_proj).to(torch.float64)(tiny["x"][: i + 1].double())
    S = float(v.view(i + 1, Hk, d)[:, g].abs().max())
    n, dd, m = i + 1, tiny["spec"].head_dim, tiny["x"].shape[1]
    slack = tl.agreement_rel_tol(torch.float64, n, dd, m) + 8 * 2.0 ** -53
    planted = 1e-6
    orig = fast.step

    def moved(*a, **k):
        st = orig(*a, **k)
        st.y = st.y + planted * S
        st.c = st.c * (1 + planted)
        return st

    monkeypatch.setattr(fast, "step", moved)
    got = rc.exact_rows(*args, reference=ref)["rows"][0]
    print("planted 1e-6: y_rel", got["y_rel"], "c_rel", got["c_rel"], "clean", clean["y_rel"],
          clean["c_rel"])
    # the planted sums' own rounding: u |y| <= u S and u c <= u |c| in the reported units
    own = 4 * 2.0 ** -53
    assert abs(got["y_rel"] - planted) <= clean["y_rel"] + planted * slack + own
    assert abs(got["c_rel"] - planted) <= clean["c_rel"] + planted * slack + own
    assert not got["ok"]  # 1e-6 is far outside FLOAT64_REL


def _layer0_heads(model, ids, position_ids, attention_mask):
    """Per-head outputs (o_proj input) of layer 0 in one whole-model forward."""
    rec = []
    hook = model.model.layers[0].self_attn.o_proj.register_forward_hook(
        lambda mod, args, out: rec.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(input_ids=ids[None], position_ids=position_ids[None],
                  attention_mask=attention_mask, use_cache=False)
    finally:
        hook.remove()
    cfg = model.config
    return rec[0][0].reshape(ids.numel(), cfg.num_attention_heads, -1).double()


def test_shifted_position_id_is_what_the_whole_model_does(tiny_qwen2):
    """What the positional checks evaluate is what the model does when one token's position id
    moves -- given an attention mask.  At layer 0 (whose input does not depend on positions) the
    whole model's forward with token 40 at position id 47 and an all-ones attention mask gives
    the heads of the float64 composition at those positions (masking by sequence order, token
    40's query and key both moved), within ``native_rel_tol``.

    Without an attention mask (and without a cache) transformers reads position ids that are not
    consecutive as *packed sequences* (``masking_utils.find_packed_sequence_indices``): token 40
    then starts a sequence of its own and attends to itself only -- its head output is its own
    value.  The positional checks therefore run the attention with an explicit causal order."""
    model, ids = tiny_qwen2.model, tiny_qwen2.ids[:N_CTX]
    moved = torch.arange(N_CTX)
    moved[40] = 47
    ones = torch.ones(1, N_CTX, dtype=torch.long)
    heads = _layer0_heads(model, ids, moved, ones)
    base = _layer0_heads(model, ids, torch.arange(N_CTX), ones)
    x0 = models.capture(model, ids, [0])[0].x.double()
    info, conv, parts = rc._model_parts(model, 0)
    att = rc._Attention64(model, info, conv, parts, x0)
    mine = att.heads_with_model_tables(moved)
    tol = tl.native_rel_tol(N_CTX, info.head_dim, info.hidden)
    rel = float((mine - heads).abs().max() / heads.abs().max())
    effect = float((heads[40:] - base[40:]).abs().max() / base.abs().max())
    print("whole model, token 40 at id 47, vs composition:", rel, "tolerance", tol,
          "effect of the move", effect)
    assert rel <= tol and effect > tl.DETECT_FACTOR * tol
    # earlier tokens do not see token 40: two forwards of the same shapes in one process, the
    # same operations in the same order on rows < 40, where token 40's masked key weighs 0
    assert torch.equal(heads[:40], base[:40])

    packed = _layer0_heads(model, ids, moved, None)
    v40 = att.v[:, 40]  # (H, r): token 40's own value per query head
    own = float((packed[40] - v40).abs().max() / v40.abs().max())
    print("no attention mask: token 40's output vs its own value:", own)
    assert own <= tol  # packed: token 40 attends to itself alone


def _query_off_by_one(monkeypatch):
    orig = fast.project

    def shifted(spec, weights, x_q, pos_q, *a, **k):
        return orig(spec, weights, x_q, torch.as_tensor(pos_q) + 1, *a, **k)

    monkeypatch.setattr(fast, "project", shifted)


def test_position_derivative_and_off_by_one(tiny, monkeypatch):
    args = (tiny["model"], LAYER, tiny["x"], tiny["pos"], [9, 63])
    res = rc.position_derivative(*args, heads=tiny["heads"])
    print("d y/dp: err", res["err_max"], "rel", res["rel_max"], "err/tol", res["ratio_max"],
          "anchor", res["anchor"]["rel_max"])
    assert res["ok"] and res["anchor"]["ok"]
    _json(res)
    _query_off_by_one(monkeypatch)
    bad = rc.position_derivative(*args)
    print("off by one: err/tol", bad["ratio_max"])
    assert not bad["ok"] and bad["ratio_max"] > tl.DETECT_FACTOR


def test_position_shift_and_off_by_one(tiny, monkeypatch):
    args = (tiny["model"], LAYER, tiny["x"], tiny["pos"], [9, 63])
    res = rc.position_shift(*args, deltas=(1, 7), heads=tiny["heads"])
    print("shift: err", res["err_max"], "rel", res["rel_max"], "err/tol", res["ratio_max"])
    assert res["ok"] and res["deltas"] == [1, 7]
    assert len(res["rows"]) == 2 * 2 * tiny["spec"].n_heads
    _query_off_by_one(monkeypatch)
    bad = rc.position_shift(*args, deltas=(1, 7))
    print("off by one: err/tol", bad["ratio_max"])
    assert not bad["ok"] and bad["ratio_max"] > tl.DETECT_FACTOR


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_bad_input(tiny):
    m, x, pos, spec, w = tiny["model"], tiny["x"], tiny["pos"], tiny["spec"], tiny["w"]
    xn = x.clone()
    xn[3, 5] = float("nan")
    cosine = replace(spec, family="cosine", scale=None)  # a family the checks do not cover
    cases = [
        (lambda: rc.conventions(m, LAYER, xn, pos), "NaN"),
        (lambda: rc.conventions(m, LAYER, x[:, :10], pos), "width"),
        (lambda: rc.conventions(m, 7, x, pos), "out of range"),
        (lambda: rc.conventions(m, LAYER, x, pos.double() + 0.5), "integer"),
        (lambda: rc.position_derivative(m, LAYER, x, pos.flip(0), [3]), "increasing"),
        (lambda: rc.position_derivative(m, LAYER, x, pos, [N_CTX]), "token indices"),
        (lambda: rc.position_shift(m, LAYER, x, pos, [3], deltas=(0.5,)), "integers"),
        (lambda: rc.exact_rows(spec, w, x, pos, [(spec.n_heads, 0)]), "out of range"),
        (lambda: rc.exact_rows(spec, w, x, pos, [(0, 1)], digits=8), "digits"),
        (lambda: rc.positive_coefficients(spec, w, x[:5], pos), "shape"),
        (lambda: rc.delta_m_rank(spec, replace(w, w_o=None), x, pos, [(0, 1)]), "w_o"),
        (lambda: rc.conventions(torch.nn.Linear(2, 2), 0, x, pos), "lacks hidden_size"),
        (lambda: rc.positive_coefficients(cosine, w, x, pos), "'cosine' is not covered"),
        (lambda: rc.exact_rows(cosine, w, x, pos, [(0, 1)]), "'cosine' is not covered"),
        (lambda: rc.conventions(m, LAYER, x, pos, head=(cosine, w)), "'cosine' is not covered"),
        (lambda: rc.position_shift(m, LAYER, x, pos, [3], head=(cosine, w)), "not covered"),
        (lambda: rc.delta_m_rank(cosine, w, x, pos, [(0, 1)]), "not covered"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()


# ---------------------------------------------------------------------------------------------
# QK-norm heads: tiny random Qwen3 (per head), OLMo 2 (over the whole projection), Gemma 3 (per
# head, gain 1 + w; a sliding-window layer), built offline by ropestep.archzoo
# ---------------------------------------------------------------------------------------------
QK_N = 24  # tokens per QK-norm context
QK_LAYERS = {"qwen3": 1, "olmo2": 1, "gemma3": 0}  # gemma3's layer 0: window 16 < QK_N
QK_ROWS = {"qwen3": [(0, 3), (3, 5)], "olmo2": [(0, 4), (3, 4)],  # olmo2: one whole-layer build
           "gemma3": [(1, 3), (2, 5)]}


@pytest.fixture(scope="module")
def qk():
    """``qk(name)``: an archzoo model (seed 0) with QK-norm, its layer ``QK_LAYERS[name]`` over
    ``QK_N`` seeded tokens -- capture, head description -- built once per name."""
    from ropestep import archzoo

    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            model = archzoo.build(name, seed=0)
            L = QK_LAYERS[name]
            ids = torch.randint(0, archzoo.VOCAB, (QK_N,),
                                generator=torch.Generator().manual_seed(1))
            cap = models.capture(model, ids, [L])[L]
            spec, w = models.layer_head(model, L, QK_N)
            if spec.rope.freqs is None:
                # Gemma 3's rotary module holds one inv_freq buffer per layer type, which the
                # adapter does not read (layer_head then describes exact angles by the config's
                # top-level base): hand the description its layer type's frequencies, as the
                # positional checks' model side reads them
                info = models.describe_model(model)
                spec = replace(spec, rope=replace(spec.rope, freqs=tuple(
                    info.layers[L].inv_freq)))
            cache[name] = {"model": model, "layer": L, "x": cap.x, "pos": cap.positions,
                           "heads": cap.heads, "spec": spec, "w": w}
        return cache[name]

    return get


@pytest.fixture(scope="module")
def qk_reference(qk):
    """``qk_reference(name)``: the oracle on ``QK_ROWS[name]`` (shared by the exact-row tests)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            t = qk(name)
            cache[name] = rc.exact_reference(t["spec"], t["w"], t["x"], t["pos"], QK_ROWS[name])
        return cache[name]

    return get


def _qk_args(t: dict) -> tuple:
    return t["model"], t["layer"], t["x"], t["pos"]


def test_qknorm_heads_as_the_adapter_reads_them(qk):
    """The three QK-norm conventions the checks below exercise: Qwen3's per-head gain ``(d,)``,
    OLMo 2's over the whole projection (``norm_scope="all"``, ``(H, d)`` and ``(H_kv, d)``
    gains), Gemma 3's per-head gain read as it acts, ``1 + w`` (``w`` the module's weight)."""
    q3, o2, g3 = qk("qwen3"), qk("olmo2"), qk("gemma3")
    for t, scope in ((q3, "head"), (o2, "all"), (g3, "head")):
        assert t["spec"].family == "qknorm" and t["spec"].norm_scope == scope
    d, H, Hk = o2["spec"].head_dim, o2["spec"].n_heads, o2["spec"].n_kv_heads
    assert tuple(q3["w"].q_norm.shape) == (d,) and tuple(o2["w"].q_norm.shape) == (H, d)
    assert tuple(o2["w"].k_norm.shape) == (Hk, d)
    attn = g3["model"].model.layers[g3["layer"]].self_attn
    w = attn.q_norm.weight.detach().double()
    assert float(w.abs().max()) > 0.1  # not the neutral 0: 1 + w differs from w
    info = models.describe_model(g3["model"])
    perm = models.attention.head_order(info.layers[g3["layer"]], d)
    assert torch.allclose(torch.as_tensor(g3["w"].q_norm).double(), (1.0 + w)[perm],
                          rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(QK_LAYERS))
def test_qknorm_checks_pass(name, qk):
    """conventions, c > 0 and both positional checks on a QK-norm layer, with their derived
    tolerances (the norm's terms: realchecks._normalised_abs, realchecks._norm_terms)."""
    t = qk(name)
    head = (t["spec"], t["w"])
    conv = rc.conventions(*_qk_args(t), head=head)
    pc = rc.positive_coefficients(t["spec"], t["w"], t["x"], t["pos"])
    der = rc.position_derivative(*_qk_args(t), [9, QK_N - 1], heads=t["heads"], head=head)
    sh = rc.position_shift(*_qk_args(t), [9, QK_N - 1], deltas=(1, 7), heads=t["heads"],
                           head=head)
    print(f"{name}: conventions q/k/v rel {conv['q_rel_max']:.2e}/{conv['k_rel_max']:.2e}/"
          f"{conv['v_rel_max']:.2e} (tol {conv['tolerance_max']:.2e}); min c {pc['min_c']:.2e}; "
          f"dy/dp err/tol {der['ratio_max']:.1e} (anchor {der['anchor']['rel_max']:.1e} <= "
          f"{der['anchor']['tolerance']:.1e}); shift err/tol {sh['ratio_max']:.1e}")
    for res in (conv, pc, der, sh):
        assert res["ok"], (res["check"], res)
        _json(res)
    assert conv["routes"]["spec"]["ok"] and conv["routes"]["fast.project"]["ok"]
    assert der["anchor"]["ok"] and sh["anchor"]["ok"]
    assert pc["coefficients"] > 0 and pc["min_c"] > 0


@pytest.mark.parametrize("name", list(QK_LAYERS))
def test_qknorm_exact_rows_in_query_space(name, qk, qk_reference, monkeypatch):
    """The oracle against the fast path on QK-norm rows: y, c, the readout, and the query-space
    step ``Delta M^q = [scale T; b^T]`` ((d+1) x r) in place of the input-space one; a relative
    1e-9 error planted in ``fast.query_delta_m`` is caught there (and only there)."""
    t = qk(name)
    ref = qk_reference(name)
    args = (t["spec"], t["w"], t["x"], t["pos"], QK_ROWS[name])
    res = rc.exact_rows(*args, reference=ref)
    print(f"{name} exact rows:", {k: res[k] for k in ("y_rel_max", "delta_m_rel_max",
                                                      "c_rel_max", "readout_rel_max",
                                                      "exact_seconds")})
    assert res["ok"], res
    assert res["space"] == "query" and ref.space == "query"
    assert all(r["space"] == "query" for r in res["rows"])
    d, r = t["spec"].head_dim, t["spec"].r
    assert all(m_.shape == (d + 1, r) for m_ in ref.delta_m.values())
    # the first-order count adds the norm's 2m + n + 8 terms (n: the features one norm spans)
    m = t["x"].shape[1]
    n_norm = d * (t["spec"].n_heads if t["spec"].norm_scope == "all" else 1)
    for r_ in res["rows"]:
        assert r_["first_order"] == pytest.approx(
            (r_["keys"] + d + (2 * m + n_norm + 8) + 8 + r_["score_max"]) * 2.0 ** -53,
            rel=1e-15, abs=0)
    assert res["tolerance_from"] == (
        "tolerances.FLOAT64_REL for y (vs the value scale), the query-space Delta M^q = "
        "[scale T; b^T] (vs its sum-of-absolute-terms scale) and c (relative); the readout "
        "against tolerances.readout_bound(float64, kappa_exact, N, d, max|s|)")
    _json(res)

    orig = fast.query_delta_m

    def perturbed(st):
        dm = orig(st)
        dm[..., 0, 0] += 1e-9 * dm.abs().amax((-1, -2))
        return dm

    monkeypatch.setattr(fast, "query_delta_m", perturbed)
    bad = rc.exact_rows(*args, reference=ref)
    print(f"{name} perturbed Delta M^q:", bad["delta_m_rel_max"])
    assert not bad["ok"] and bad["delta_m_rel_max"] > tl.FLOAT64_REL
    assert bad["y_rel_max"] <= tl.FLOAT64_REL and bad["c_rel_max"] <= tl.FLOAT64_REL


def test_qknorm_input_space_claims_refused(qk):
    """rank(Delta M W_o) and the global affine readout are input-space claims: a QK-norm head
    (no Delta M of u) is refused with the reason, not checked."""
    t = qk("qwen3")
    spec, w, x, pos = t["spec"], t["w"], t["x"], t["pos"]
    with pytest.raises(ValueError, match="stated in input space .* not defined for a non-affine"):
        rc.delta_m_rank(spec, w, x, pos, [(0, 5)])
    with pytest.raises(ValueError, match="no_global_readout: the claim is stated in input space"):
        rc.no_global_readout(spec, w, x[:3], torch.full((3,), QK_N), x, torch.arange(QK_N))


def test_qknorm_skipped_on_ropesteps_side_caught(qk):
    """The model's q_norm left out of ropestep's description -- its gain replaced by ones, or the
    whole head described as family "dot" with the same weights -- fails conventions and the
    positional checks (the model side applies the layer's own norms)."""
    t = qk("qwen3")
    spec, w = t["spec"], t["w"]
    ones = replace(w, q_norm=torch.ones_like(torch.as_tensor(w.q_norm)))
    res = rc.conventions(*_qk_args(t), head=(spec, ones))
    print("q_norm gain ones: q_rel", res["q_rel_max"], "k_rel", res["k_rel_max"],
          "tolerance", res["tolerance_max"])
    assert not res["ok"] and res["q_rel_max"] > tl.DETECT_FACTOR * res["tolerance_max"]
    assert all(h["k_rel"] <= h["k_tol"] for h in res["heads"])  # k_norm untouched
    der = rc.position_derivative(*_qk_args(t), [9, QK_N - 1], head=(spec, ones))
    print("q_norm gain ones: dy/dp err/tol", der["ratio_max"])
    assert not der["ok"] and der["ratio_max"] > tl.DETECT_FACTOR

    dot = replace(spec, family="dot")  # no norm at all, the same projections
    res = rc.conventions(*_qk_args(t), head=(dot, w))
    print("family dot: q_rel", res["q_rel_max"], "k_rel", res["k_rel_max"])
    assert not res["ok"] and not res["routes"]["spec"]["ok"]
    assert not res["routes"]["fast.project"]["ok"]
    assert min(res["q_rel_max"], res["k_rel_max"]) > tl.DETECT_FACTOR * res["tolerance_max"]
    assert res["v_rel_max"] <= res["tolerance_max"]  # values are not normalised
    sh = rc.position_shift(*_qk_args(t), [9, QK_N - 1], deltas=(1, 7), head=(dot, w))
    print("family dot: shift err/tol", sh["ratio_max"])
    assert not sh["ok"] and sh["ratio_max"] > tl.DETECT_FACTOR


def test_gemma3_gain_read_as_w_caught(qk):
    """Gemma 3's norm multiplies by ``1 + w``: a description that takes ``w`` itself as the gain
    fails conventions on queries and keys."""
    t = qk("gemma3")
    w = t["w"]
    bare = replace(w, q_norm=torch.as_tensor(w.q_norm) - 1.0,
                   k_norm=torch.as_tensor(w.k_norm) - 1.0)
    res = rc.conventions(*_qk_args(t), head=(t["spec"], bare))
    print("gemma3 gain w: q_rel", res["q_rel_max"], "k_rel", res["k_rel_max"])
    assert not res["ok"]
    assert min(res["q_rel_max"], res["k_rel_max"]) > tl.DETECT_FACTOR * res["tolerance_max"]


def test_norm_scope_read_wrong_caught(qk, qk_reference, monkeypatch):
    """OLMo 2 normalises over the whole projection of a token: ropestep's RMSNorm taken per head
    instead (the scope ignored, in the fast layer and in the "spec" route) fails conventions,
    the positional derivative and the oracle rows (the oracle's own norm is over every head);
    and Qwen3's per-head norm described as one over the whole projection fails conventions."""
    from ropestep import kernel

    q3 = qk("qwen3")
    spec, w = q3["spec"], q3["w"]
    H, Hk = spec.n_heads, spec.n_kv_heads
    tiled = replace(w, q_norm=torch.as_tensor(w.q_norm).expand(H, -1).clone(),
                    k_norm=torch.as_tensor(w.k_norm).expand(Hk, -1).clone())
    res = rc.conventions(*_qk_args(q3), head=(replace(spec, norm_scope="all"), tiled))
    print("qwen3 read as 'all': q_rel", res["q_rel_max"], "k_rel", res["k_rel_max"])
    assert not res["ok"] and res["q_rel_max"] > tl.DETECT_FACTOR * res["tolerance_max"]

    o2 = qk("olmo2")
    ref = qk_reference("olmo2")
    ok = rc.conventions(*_qk_args(o2))
    assert ok["ok"]
    orig = kernel.rms_norm

    def per_head(x, g, eps, scope="head"):  # the scope read wrong: always per head
        return orig(x, g[:, None, :] if scope == "all" else g, eps, "head")

    monkeypatch.setattr(kernel, "rms_norm", per_head)
    monkeypatch.setattr(fast, "rms_norm", per_head)
    res = rc.conventions(*_qk_args(o2))
    print("olmo2 scope per head: q_rel", res["q_rel_max"], "k_rel", res["k_rel_max"],
          "tolerance", res["tolerance_max"])
    assert not res["ok"] and not res["routes"]["spec"]["ok"]
    assert not res["routes"]["fast.project"]["ok"]
    assert min(res["q_rel_max"], res["k_rel_max"]) > tl.DETECT_FACTOR * res["tolerance_max"]
    der = rc.position_derivative(*_qk_args(o2), [9, QK_N - 1])
    print("olmo2 scope per head: dy/dp err/tol", der["ratio_max"])
    assert not der["ok"] and der["ratio_max"] > tl.DETECT_FACTOR
    ex = rc.exact_rows(o2["spec"], o2["w"], o2["x"], o2["pos"], QK_ROWS["olmo2"], reference=ref)
    print("olmo2 scope per head: exact y_rel", ex["y_rel_max"])
    assert not ex["ok"] and ex["y_rel_max"] > tl.DETECT_REL_FINE


def test_normalised_bound_covers_float32_rms_norm():
    """realchecks._normalised_abs against a float32 projection and RMSNorm (as transformers'
    norms compute) of random inputs, per head and over the whole projection: every entry within
    the bound, and the bound not loose by more than 50x on the power cases (non-negative inputs
    and weights: the projection's partial sums as large as they can be) -- measured 0.04-0.05
    there; a bound 10x looser fails this test."""
    gen = torch.Generator().manual_seed(0)
    n, H, d, m, eps = 16, 4, 32, 128, 1e-6
    ratios = {}
    for scope in ("head", "all"):
        for trial in range(6):
            x = torch.randn(n, m, generator=gen).float()
            W = (torch.randn(H * d, m, generator=gen) * (0.1 if trial % 2 else 1.0)).float()
            power = trial % 3 == 0
            if power:
                x, W = x.abs(), W.abs()
            g = (1.0 + 0.3 * torch.randn(d if scope == "head" else H * d, generator=gen)).float()
            z32 = (x @ W.T).view(n, H, d)
            if scope == "head":
                y32 = z32 * torch.rsqrt(z32.pow(2).mean(-1, keepdim=True) + eps) * g
                g64 = g.double()
            else:
                f = z32.reshape(n, -1)
                y32 = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * g).view(n, H, d)
                g64 = g.double().view(H, d)
            z = (x.double() @ W.double().T).view(n, H, d)
            A = (x.double().abs() @ W.double().abs().T).view(n, H, d)
            y = rc._apply_model_norm(z, g64, eps, scope)
            bound = rc._normalised_abs(torch.float32, z, A, m, g64, eps, scope, 0)
            ratios[scope, trial, power] = float(((y32.double() - y).abs() / bound).max())
    print("err / bound:", {k: round(v, 4) for k, v in ratios.items()})
    assert max(ratios.values()) <= 1.0
    assert max(v for (_, _, p), v in ratios.items() if p) > 0.02



@pytest.mark.parametrize("dtype, u_acc, u_store", [(torch.float32, 2.0 ** -24, 2.0 ** -24),
                                                   (torch.bfloat16, 2.0 ** -24, 2.0 ** -8)])
@pytest.mark.parametrize("scope", ["head", "all"])
def test_normalised_bound_by_hand(dtype, u_acc, u_store, scope):
    """realchecks._normalised_abs recomputed here in numpy from its docstring's formula (the
    projection's error E from tolerances.rotated_projection_abs, its RMS rho over the norm's n
    features, r_lo = r - rho, Y, E_n and the rotation's roundings), on inputs whose sizes
    differ per head and per token, so that a wrong reduction axis, constant or term shows; and
    NaN where the error's RMS reaches the vector's."""
    rng = np.random.default_rng(5)
    n_tok, H, d, m, eps, rnd = 3, 2, 4, 16, 1e-3, 3
    z = rng.standard_normal((n_tok, H, d)) * np.array([1.0, 3.0])[None, :, None] \
        * np.array([0.5, 1.0, 4.0])[:, None, None]
    A = np.abs(z) * 2.0 + rng.uniform(0.1, 0.5, (n_tok, H, d))
    g = 1.0 + 0.3 * rng.standard_normal((d,) if scope == "head" else (H, d))
    E = tl.rotated_projection_abs(dtype, torch.as_tensor(A), m).numpy()
    ax = (-1,) if scope == "head" else (-2, -1)
    nf = d if scope == "head" else H * d
    rho = np.sqrt(np.mean(E ** 2, axis=ax, keepdims=True))
    r = np.sqrt(np.mean(z ** 2, axis=ax, keepdims=True) + eps)
    Y = np.abs(g) * (np.abs(z) + E) / (r - rho)
    En = np.abs(g) * (E / (r - rho) + np.abs(z) * rho / (r * (r - rho))) \
        + ((tl.HM_LAMBDA * np.sqrt(nf) + 8.0) * u_acc + 2.0 * u_store) * Y
    want = En + rnd * u_store * Y
    assert tl.unit_roundoff(dtype) == u_acc
    got = rc._normalised_abs(dtype, torch.as_tensor(z), torch.as_tensor(A), m,
                             torch.as_tensor(g), eps, scope, rnd).numpy()
    assert np.all(r > rho) and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    # one token whose projection error is as large as its RMS: no bound (NaN), the others kept
    A2 = A.copy()
    A2[1] *= 1e9
    got2 = rc._normalised_abs(dtype, torch.as_tensor(z), torch.as_tensor(A2), m,
                              torch.as_tensor(g), eps, scope, rnd).numpy()
    assert np.all(np.isnan(got2[1])) and np.all(np.isfinite(got2[[0, 2]]))
    np.testing.assert_allclose(got2[[0, 2]], want[[0, 2]], rtol=1e-12, atol=0)

# ---------------------------------------------------------------------------------------------
# SmolLM2-135M, last layer
# ---------------------------------------------------------------------------------------------
def test_smollm2_last_layer(smollm2):
    model, L = smollm2.model, 29
    ids = smollm2.ids[:N_CTX]
    cap = models.capture(model, ids, [L])[L]
    spec, w = models.layer_head(model, L, N_CTX)
    conv = rc.conventions(model, L, cap.x, cap.positions)
    rows = rc.sample_rows(spec.n_heads, range(2, 6), 1, seed=1)
    ex = rc.exact_rows(spec, w, cap.x, cap.positions, rows)
    pc = rc.positive_coefficients(spec, w, cap.x, cap.positions)
    der = rc.position_derivative(model, L, cap.x, cap.positions, [N_CTX - 1], heads=cap.heads)
    sh = rc.position_shift(model, L, cap.x, cap.positions, [N_CTX - 1], deltas=(1, 7))
    print(f"SmolLM2 layer {L}: conventions q/k/v rel {conv['q_rel_max']:.2e}/"
          f"{conv['k_rel_max']:.2e}/{conv['v_rel_max']:.2e} (tol {conv['tolerance_max']:.2e}); "
          f"exact y {ex['y_rel_max']:.1e} dM {ex['delta_m_rel_max']:.1e}; min c {pc['min_c']:.2e}; "
          f"dy/dp rel {der['rel_max']:.1e} (err/tol {der['ratio_max']:.1e}); shift rel "
          f"{sh['rel_max']:.1e} (err/tol {sh['ratio_max']:.1e})")
    for res in (conv, ex, pc, der, sh):
        assert res["ok"], res["check"]


# ---------------------------------------------------------------------------------------------
# each refusal names its argument and its rule; the edges of the rules are accepted
# ---------------------------------------------------------------------------------------------
def test_bad_input_messages_name_the_argument_and_the_rule(tiny, qk):
    import re

    m, x, pos, spec, w = tiny["model"], tiny["x"], tiny["pos"], tiny["spec"], tiny["w"]
    xq, xb = tiny["xq"], tiny["xb"]
    Q, Nb, hid = xq.shape[0], xb.shape[0], x.shape[1]
    at = torch.full((Q,), N_CTX - 1)
    bank = torch.arange(Nb)
    ngr = rc.no_global_readout
    other = qk("qwen3")  # a head description of another shape (H, H_kv, d)
    per_head = replace(spec, rope=replace(spec.rope, base=tuple(
        float(spec.rope.base) * (1 + k) for k in range(spec.n_heads)), cos=None, sin=None,
        freqs=None))
    cases = [
        (lambda: ngr(spec, w, xq[:1], at[:1], xb, bank),
         "no_global_readout needs at least 2 queries"),
        (lambda: ngr(spec, w, xq, torch.arange(Q), xb, bank),
         "no_global_readout: every query must sit at one position (shared bank)"),
        (lambda: ngr(spec, w, xq, at, x, torch.arange(N_CTX) + 1),
         "no_global_readout: bank keys must not lie after the query position"),
        (lambda: ngr(spec, w, xq[:, :10], at, xb, bank),
         f"x_q has width 10, the layer's input width is {hid}"),
        (lambda: ngr(spec, w, xq, at, xb[:, :10], bank),
         f"x_kv has width 10, the layer's input width is {hid}"),
        (lambda: ngr(spec, w, xq, at[:2], xb, bank), f"pos_q must have shape ({Q},)"),
        (lambda: ngr(spec, w, xq, at, xb, bank[:3]), f"pos_kv must have shape ({Nb},)"),
        (lambda: rc.delta_m_rank(spec, replace(w, w_o=None), x, pos, [(0, 1)]),
         "delta_m_rank needs weights.w_o (the output projection)"),
        (lambda: rc.delta_m_rank(spec, w, x, pos, [(0, N_CTX)]),
         f"row (head 0, query {N_CTX}) out of range: {spec.n_heads} heads, {N_CTX} queries"),
        (lambda: rc.delta_m_rank(replace(spec, family="qknorm"), w, x, pos, [(0, 1)]),
         "delta_m_rank: the claim is stated in input space"),
        (lambda: rc.sample_rows(0, 5, 1, 0), "n_heads must be a positive int, got 0"),
        (lambda: rc.sample_rows(2.5, 5, 1, 0), "n_heads must be a positive int, got 2.5"),
        (lambda: rc.sample_rows(True, 5, 1, 0), "n_heads must be a positive int, got True"),
        (lambda: rc.sample_rows(2, [], 1, 0), "no eligible queries (or a negative query index)"),
        (lambda: rc.sample_rows(2, [-1, 3], 1, 0),
         "no eligible queries (or a negative query index)"),
        (lambda: rc.sample_rows(2, 5, 0, 0), "k must be a positive int, got 0"),
        (lambda: rc.sample_rows(2, 5, 2.5, 0), "k must be a positive int, got 2.5"),
        (lambda: rc.sample_rows(2, 5, True, 0), "k must be a positive int, got True"),
        (lambda: rc.position_shift(m, LAYER, x, pos, 3), "queries must be a sequence of token "
                                                         "indices"),
        (lambda: rc.position_shift(m, LAYER, x, pos, []),
         f"queries must be token indices in [0, {N_CTX}), got []"),
        (lambda: rc.position_shift(m, LAYER, x, pos, [-1, 2]),
         f"queries must be token indices in [0, {N_CTX}), got [-1, 2]"),
        (lambda: rc.position_shift(m, LAYER, x, pos, [3], deltas=3),
         "deltas must be a sequence of integers"),
        (lambda: rc.position_shift(m, LAYER, x[:QK_N], pos[:QK_N], [3],
                                   head=(other["spec"], other["w"])),
         "head description and model disagree on (H, H_kv, d)"),
        (lambda: rc.position_derivative(m, LAYER, x, pos, [3], head=(per_head, w)),
         "per-head RoPE bases: the model has one rotary table"),
        (lambda: rc.position_shift(m, LAYER, x, pos, [3], heads=tiny["heads"][:, :2]),
         f"heads must be a float array of shape ({N_CTX}, {spec.n_heads}, {spec.head_dim}), "
         f"got {tiny['heads'].dtype} ({N_CTX}, 2, {spec.head_dim})"),
        (lambda: rc.position_shift(m, LAYER, x, pos, [3], heads=tiny["heads"].to(torch.int32)),
         f"heads must be a float array of shape ({N_CTX}, {spec.n_heads}, {spec.head_dim}), "
         f"got torch.int32"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            call()
    # the edges of the rules are accepted: two queries; bank keys at the query's own position;
    # one head; one row; query 0; the captured heads as a numpy array (the same anchor)
    assert ngr(spec, w, xq[:2], at[:2], x, torch.arange(N_CTX))["queries"] == 2
    assert rc.sample_rows(1, 5, 1, 0)[0][0] == 0 and len(rc.sample_rows(2, [0, 4], 1, 7)) == 1
    r0 = rc.position_shift(m, LAYER, x, pos, [0], deltas=(1,), heads=tiny["heads"])
    rn = rc.position_shift(m, LAYER, x, pos, [0], deltas=(1,), heads=tiny["heads"].numpy())
    assert r0["rows"][0]["query"] == 0 and r0["anchor"] == rn["anchor"] and r0["anchor"]["ok"]


def test_anchor_error_is_each_heads_own_relative_error(tiny):
    """The anchor's error is per head: head h's largest deviation over head h's own scale.  A
    planted deviation of 1e-2 of its scale on the largest-scale head alone must read 1e-2 over
    its grown scale, to within the unplanted reading (the model's own rounding); pooling the
    deviation over every head before dividing (the largest-scale head's error over the
    smallest head's scale) reads that times the ratio of the heads' scales (1.29 here), and
    dividing every head's error by the largest scale misreads a deviation on the smallest-scale
    head by the inverse ratio."""
    m, x, pos, heads = tiny["model"], tiny["x"], tiny["pos"], tiny["heads"]
    scale = heads.double().abs().amax((0, 2))
    assert float(scale.max() / scale.min()) > 1.05  # the fixture separates the two readings
    # the unplanted reading bounds the model's own rounding on every head: nat_h / S_h <= base,
    # and a planted head's reading is want + nat_h / S'_h with S'_h > S_h
    base = rc.position_shift(m, LAYER, x, pos, [3], deltas=(1,), heads=heads)["anchor"]
    assert base["ok"]
    # the largest-scale head catches pooling the deviations over heads; the smallest-scale head
    # catches dividing every head's deviation by the largest scale (1e-2 times the inverse ratio)
    for h in (int(scale.argmax()), int(scale.argmin())):
        planted = heads.double().clone()
        planted[:, h] += 1e-2 * float(scale[h]) * torch.sign(planted[:, h])  # |entries| + 1e-2 S
        want = 1e-2 * float(scale[h]) / float(planted[:, h].abs().max())  # head h's own reading
        # the misread lies 10 unplanted readings or more away from want
        assert base["rel_max"] < 0.1 * want * (float(scale.max() / scale.min()) - 1)
        a = rc.position_shift(m, LAYER, x, pos, [3], deltas=(1,), heads=planted)["anchor"]
        print("planted anchor, head", h, a["rel_max"], "want", want, "unplanted", base["rel_max"])
        assert abs(a["rel_max"] - want) <= base["rel_max"] and not a["ok"]


# ---------------------------------------------------------------------------------------------
# the anchor (the model's captured heads against the float64 composition): its tolerance in
# each model dtype, recomputed here from its stated formula and the model's own projections
# ---------------------------------------------------------------------------------------------
def _rms(z: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return z / (z.pow(2).mean(-1, keepdim=True) + eps).sqrt() * g


@pytest.mark.parametrize("name,dtype", [("qwen2", torch.float64), ("qwen2", torch.float32),
                                        ("qwen2", torch.bfloat16), ("qwen3", torch.float32),
                                        ("qwen3", torch.bfloat16), ("olmo2", torch.float32)])
def test_anchor_tolerance_in_every_model_dtype_qknorm_and_plain(name, dtype, tiny_qwen2):
    """``native_rel_tol`` (float32 and float64: transformers' eager softmax is float32) and, for bf16,
    ``native_rel_tol_lowp(bf16, |q~|max |k~|max scale)`` -- times 4 with QK-norm -- with ``m`` the
    layer's input width, or ``2 m + d + 8`` with a per-head QK-norm (docs/protocol.md's counts);
    ``|q~|`` is rotation-invariant, so the unrotated projections (and norms) of the values the
    model reads give it."""
    import copy

    from ropestep import archzoo

    base = tiny_qwen2.model if name == "qwen2" else archzoo.build(name, seed=0)
    model = copy.deepcopy(base).to(dtype)
    L, n = (LAYER, 24) if name == "qwen2" else (QK_LAYERS[name], QK_N)
    ids = torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(4))
    cap = models.capture(model, ids, [L])[L]
    res = rc.position_shift(model, L, cap.x, cap.positions, [n - 1], deltas=(1,), heads=cap.heads)
    a = res["anchor"]
    cfg = model.config
    H, Hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim if getattr(
        cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    hid = cfg.hidden_size
    if dtype in (torch.float64, torch.float32):  # a float64 model's softmax is float32's
        # m; with QK-norm 2 m + n + 8, n the norm's width: d per head, H d over the projection
        mm = {"qwen2": hid, "qwen3": 2 * hid + d + 8, "olmo2": 2 * hid + H * d + 8}[name]
        want = tl.native_rel_tol(n, d, mm)
        src = "native_rel_tol" + (" (a float64 model's softmax runs in float32)"
                                  if dtype == torch.float64 else "")
    else:
        attn = model.model.layers[L].self_attn
        x64 = cap.x.to(dtype).double()

        def proj(lin, nh):
            z = x64 @ lin.weight.detach().double().T
            if lin.bias is not None:
                z = z + lin.bias.detach().double()
            return z.view(n, nh, d)

        q, k = proj(attn.q_proj, H), proj(attn.k_proj, Hk)
        four = 1.0
        if name == "qwen3":
            q = _rms(q, attn.q_norm.weight.detach().double(), attn.q_norm.variance_epsilon)
            k = _rms(k, attn.k_norm.weight.detach().double(), attn.k_norm.variance_epsilon)
            four = 4.0
        qk_max = float(q.norm(dim=-1).max() * k.norm(dim=-1).max()) * attn.scaling * four
        want = tl.native_rel_tol_lowp(dtype, qk_max)
        src = "native_rel_tol_lowp" + (" (QK-norm: 4 |q~||k~| scale)" if name == "qwen3" else "")
    print(name, dtype, "anchor", a)
    assert a["tolerance"] == pytest.approx(want, rel=1e-9 if dtype != torch.bfloat16 else 1e-6)
    assert a["tolerance_from"] == (f"tolerances.{src}: the captured heads against this float64 "
                                   "composition of the model's attention with its own tables")
    assert a["ok"] and 0 < a["rel_max"] <= a["tolerance"]


# ---------------------------------------------------------------------------------------------
# soft-capped and NoPE layers (tiny random Gemma 2: soft-cap 20, layer 0 windowed; SmolLM3:
# layer 1 without RoPE), with the captured heads as the anchor
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo_layers():
    from ropestep import archzoo

    out = {}
    for name, L in (("gemma2", 0), ("gemma2", 1), ("smollm3", 1)):
        model = archzoo.build(name, seed=0)
        ids = torch.randint(0, archzoo.VOCAB, (QK_N,), generator=torch.Generator().manual_seed(1))
        out[(name, L)] = (model, models.capture(model, ids, [L])[L])
    return out


@pytest.mark.parametrize("name,L", [("gemma2", 0), ("gemma2", 1), ("smollm3", 1)])
def test_soft_capped_and_nope_layers_positional_checks(zoo_layers, name, L):
    model, cap = zoo_layers[(name, L)]
    info = models.describe_model(model)
    conv = info.layers[L]
    d, hid = info.head_dim, info.hidden
    qs = [5, QK_N - 1]
    for check in (rc.position_derivative, rc.position_shift):
        res = check(model, L, cap.x, cap.positions, qs, heads=cap.heads)
        a = res["anchor"]
        print(name, L, check.__name__, res["ratio_max"], a)
        assert res["ok"] and a["ok"], res
        assert a["tolerance"] == tl.native_rel_tol(QK_N, d, hid) and 0 < a["rel_max"]
        if not conv.rotary:  # no RoPE: nothing depends on the position, on either side
            key = "derivative_max" if check is rc.position_derivative else "difference_max"
            assert all(r["err_max"] == 0 and r[key] == 0 for r in res["rows"])
        else:
            assert all(r["ratio"] > 0 for r in res["rows"])
    if conv.softcap:
        # ropestep's side without the soft-cap: the model's side (its own attention) disagrees
        spec, w = models.layer_head(model, L, QK_N)
        for check in (rc.position_derivative, rc.position_shift):
            bad = check(model, L, cap.x, cap.positions, qs, head=(replace(spec, softcap=None), w))
            assert not bad["ok"] and bad["ratio_max"] > 10


def test_capped_derivative_bounds_against_the_transform_numerically():
    """``_capped``: the bounds on ``z^(n)`` of ``z = c tanh(s / c)`` from bounds ``G_n`` on
    ``|s^(n)|``, recomputed from the constants' maxima over a dense grid (``max|phi''|``,
    ``max|phi'''|``, here by central differences of ``phi'`` in float64) and Faa di Bruno."""
    c = 7.0
    t = np.linspace(-8 * c, 8 * c, 400_001)
    th = np.tanh(t / c)
    p1 = 1 - th ** 2
    p2 = -2 / c * th * p1
    p3 = -2 / c ** 2 * p1 * (1 - 3 * th ** 2)
    assert np.max(np.abs(np.gradient(p1, t) - p2)) < 1e-6  # the derivatives are right
    k1, k2, k3 = np.max(np.abs(p1)), np.max(np.abs(p2)), np.max(np.abs(p3))
    G = {0: 3.5, 1: 0.7, 2: 0.3, 3: 0.11}
    got = rc._capped(G, c)
    want = {0: G[0], 1: k1 * G[1], 2: k2 * G[1] ** 2 + k1 * G[2],
            3: k3 * G[1] ** 3 + 3 * k2 * G[1] * G[2] + k1 * G[3]}
    assert set(got) == {0, 1, 2, 3}
    for n in range(4):
        assert got[n] == pytest.approx(want[n], rel=1e-8), n
    assert rc._capped(G, None) is G
    s = torch.linspace(-30, 30, 7, dtype=torch.float64)
    assert torch.equal(rc._phi(s, None), s)
    assert torch.allclose(rc._phi(s, c), c * torch.tanh(s / c), rtol=0, atol=0)


def test_no_global_readout_flags_follow_their_certified_bounds(tiny):
    """A head whose values are zero has no refutation (lower bound 0: not ok, the whole check
    fails though the write may pass); a zero output projection fails the write alone; values
    scaled by 1e-3 keep every bound positive (certified below 1), and ok."""
    spec, w, xq, xb = tiny["spec"], tiny["w"], tiny["xq"], tiny["xb"]
    Q = xq.shape[0]
    args = (xq, torch.full((Q,), N_CTX - 1), xb, torch.arange(N_CTX - 1))
    wv = torch.as_tensor(w.w_v).clone()
    bv = None if w.b_v is None else torch.as_tensor(w.b_v).clone()
    wv[:, 0] = 0  # KV head 0: the query heads it serves have constant values
    if bv is not None:
        bv[0] = 0
    dead = rc.no_global_readout(spec, replace(w, w_v=wv, b_v=bv), *args)
    served = [h for h in range(spec.n_heads) if h // (spec.n_heads // spec.n_kv_heads) == 0]
    for h in dead["heads"]:
        assert h["ok"] == (h["head"] not in served), h
    assert dead["combined"]["ok"] and not dead["ok"]
    mute = rc.no_global_readout(spec, replace(w, w_o=torch.zeros_like(torch.as_tensor(w.w_o))),
                                *args)
    assert all(h["ok"] for h in mute["heads"]) and not mute["combined"]["ok"]
    assert mute["combined"]["lower_certified"] <= 0 and not mute["ok"]
    small = rc.no_global_readout(spec, replace(w, w_v=torch.as_tensor(w.w_v) * 1e-3,
                                               b_v=None if bv is None else
                                               torch.as_tensor(w.b_v) * 1e-3), *args)
    assert small["ok"] and all(0 < h["lower_certified"] < 1 for h in small["heads"])
    assert small["tolerance_from"] == (
        "certified = computed - sqrt(r) FLOAT64_REL max|v| (the float64 outputs' error); the "
        "claim: certified > 0")


def test_input_checks_name_the_argument_the_rule_and_the_value(tiny):
    """Each shared input check (floats, shapes, positions, the bank, rows, the head given, the
    layer) refuses with its own full message, the argument's name and the offending value; the
    numpy forms of the same inputs are accepted as the tensors are."""
    import re

    m, x, pos, spec, w = tiny["model"], tiny["x"], tiny["pos"], tiny["spec"], tiny["w"]
    hid = x.shape[1]
    rows = [(0, 3)]
    dmr = rc.delta_m_rank
    name = models.describe_model(m).name
    n_layers = models.describe_model(m).n_layers
    short_spec, _ = models.layer_head(m, LAYER, 32)  # RoPE tables of 32 positions
    late = torch.arange(N_CTX) + 10  # keys 10 positions later: queries 0..9 read nothing
    cosine = replace(spec)  # a family the checks do not cover (HeadSpec would refuse the
    object.__setattr__(cosine, "family", "cosine")  # unscaled cosine spec: set it after)
    cases = [
        (lambda: dmr(spec, w, None, pos, rows), "x is missing"),
        (lambda: dmr(spec, w, x.to(torch.int64), pos, rows),
         "x must hold floats, got dtype torch.int64"),
        (lambda: dmr(spec, w, np.full(x.shape, np.nan), pos, rows), "x contains NaN or inf"),
        (lambda: dmr(spec, w, x[0], pos, rows), f"x must have shape (tokens, m), got ({hid},)"),
        (lambda: dmr(spec, w, x[:0], pos[:0], rows), f"x must have shape (tokens, m), got (0, {hid})"),
        (lambda: dmr(spec, w, x[:, :10], pos, rows), f"x has width 10, the layer's input width is {hid}"),
        (lambda: dmr(spec, w, x, pos[:-1], rows),
         f"positions must have shape ({N_CTX},), got ({N_CTX - 1},)"),
        (lambda: dmr(spec, w, x, pos - 1, rows), "positions must be >= 0, got -1"),
        (lambda: dmr(spec, w, x, pos.double() + 0.5, rows),
         "positions must hold integer positions, got dtype float64"),
        (lambda: dmr(spec, "w", x, pos, rows), "weights must be HeadWeights, got str"),
        (lambda: dmr("spec", w, x, pos, rows), "spec must be a HeadSpec, got str"),
        (lambda: dmr(cosine, w, x, pos, rows),
         "score family 'cosine' is not covered by realchecks (they cover 'dot': Llama, Qwen2; "
         "'qknorm': Qwen3, Gemma 3, OLMo 2; and 'latent')"),
        (lambda: dmr(spec, w, x, pos, rows, x_kv=x), "give both x_kv and pos_kv, or neither"),
        (lambda: dmr(spec, w, x, pos, rows, x_kv=x[:, :10], pos_kv=pos),
         f"x_kv has width 10, the layer's input width is {hid}"),
        (lambda: dmr(spec, w, x, pos, rows, x_kv=x, pos_kv=pos - 1),
         "pos_kv must be >= 0, got -1"),
        (lambda: dmr(spec, w, x, pos, rows, x_kv=x, pos_kv=late),
         "queries [0, 1, 2, 3, 4, 5, 6, 7] have no key at or before their position"),
        (lambda: dmr(spec, w, x, pos + 1, rows),
         f"positions up to {N_CTX} but the RoPE tables cover [0, {N_CTX})"),
        (lambda: dmr(spec, w, x, pos, 5), "rows must be a sequence of (head, query) pairs"),
        (lambda: dmr(spec, w, x, pos, []), "no rows given"),
        (lambda: rc.conventions(m, LAYER, x, pos, head=(spec, "w")),
         "weights must be HeadWeights, got str"),
        (lambda: rc.conventions(m, LAYER, x, pos, head=(spec, replace(w, w_q="q"))),
         "w_q must be an array (numpy or torch), got str"),
        (lambda: rc.conventions(m, LAYER, x, pos, head=(short_spec, w)),
         f"the given head's RoPE tables cover 32 positions, {N_CTX} are needed"),
        (lambda: rc.conventions(m, True, x, pos), "layer must be an int, got bool"),
        (lambda: rc.conventions(m, "1", x, pos), "layer must be an int, got str"),
        (lambda: rc.conventions(m, n_layers, x, pos),
         f"{name}: layer {n_layers} out of range 0..{n_layers - 1}"),
        (lambda: rc.position_derivative(m, LAYER, x[:3], torch.tensor([0, 2, 1]), [1]),
         "positions must be strictly increasing (the model masks by sequence order, so "
         "positions must follow it)"),
        (lambda: rc.position_derivative(m, LAYER, x[:2], torch.tensor([0, 0]), [1]),
         "positions must be strictly increasing"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match="^" + re.escape(msg)):
            call()
    # the same inputs as numpy arrays, and the last layer and the first row, are accepted
    a = dmr(spec, w, x.numpy(), pos.numpy(), [(0, 0)])
    b = dmr(spec, w, x, pos, [(0, 0)])
    assert a == b
    assert rc.conventions(m, np.int64(n_layers - 1), x[:4], pos[:4])["ok"]


def test_conventions_on_a_yarn_model_carry_its_rotary_amplitude(build_tiny):
    """YaRN scales the rotary tables by an amplitude ``a = 0.1 ln(factor) + 1`` (1.139 at factor
    4), so the model's rotated q and k are ``a`` times the unscaled rotation and its score scale
    is ``scaling a^2``: the conventions check passes only with ``a`` carried on both sides and in
    the scale, and records the amplitude it read from the model's own cos table."""
    model = build_tiny("llama", seed=5, num_hidden_layers=1, hidden_size=256,
                       num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                        "original_max_position_embeddings": 256})
    a = float(model.model.rotary_emb.attention_scaling)
    assert a == pytest.approx(0.1 * np.log(4.0) + 1.0, rel=1e-6)  # the model's own amplitude
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    cap = models.capture(model, ids, [0])[0]
    record: dict = {}
    res = rc.conventions(model, 0, cap.x, cap.positions, record=record)
    assert res["ok"] and res["scale"]["ok"], res
    assert float(record["amplitude"]) == pytest.approx(a, rel=1e-6)
    cos = model.model.rotary_emb(cap.x[None].float(), cap.positions[None])[0][0]
    assert torch.equal(record["rotary_cos"].float(), cos.reshape(-1, cos.shape[-1]))
    # the score scale the model applies is scaling * a^2 (the head description's); the head
    # description reads a from the float32 cos table, so a agrees to float32's 2^-24 per factor
    spec, _ = models.layer_head(model, 0, 24)
    sc = model.model.layers[0].self_attn.scaling
    assert float(spec.score_scale(0)) == pytest.approx(sc * a * a, rel=4 * 2.0 ** -24)


def test_positive_coefficients_fail_on_a_zero_and_report_the_oracles_rows(tiny, tiny_reference,
                                                                          monkeypatch):
    """The claim is strict (``c > 0``): a zero coefficient fails it, in the fast path or on the
    oracle's rows; a NaN is located before any finite minimum; the exact part reports its rows
    and their minimum as the oracle holds them."""
    import copy

    rows, ref = tiny_reference
    spec, w, x, pos = tiny["spec"], tiny["w"], tiny["x"], tiny["pos"]
    res = rc.positive_coefficients(spec, w, x, pos, reference=ref)
    want = min(float(ref.c[r_].min()) for r_ in ref.rows)
    assert res["exact"] == {"rows": len(rows), "min_c": want, "ok": True}
    assert res["tolerance"] == 0.0 and res["tolerance_from"] == (
        "strict: c > 0; float64 c is within FLOAT64_REL relative of the exact value, so its "
        "sign is the exact sign")
    zero_ref = copy.copy(ref)
    zero_ref.c = {r_: ref.c[r_] * 0 for r_ in ref.rows}  # the oracle's coefficients all zero
    bad = rc.positive_coefficients(spec, w, x, pos, reference=zero_ref)
    assert bad["exact"]["min_c"] == 0.0 and not bad["exact"]["ok"] and not bad["ok"]
    orig = fast.step

    def planted(value, extra=None):
        def step(*a, **k):
            st = orig(*a, **k)
            st.c[1, 7, 3] = value
            if extra is not None:
                st.c[0, 9, 1] = extra
            return st
        return step

    monkeypatch.setattr(fast, "step", planted(0.0))
    z = rc.positive_coefficients(spec, w, x, pos)
    assert z["min_c"] == 0.0 and not z["ok"] and z["argmin"] == {"head": 1, "query": 7, "key": 3}
    monkeypatch.setattr(fast, "step", planted(float("nan"), extra=-1.0))
    n = rc.positive_coefficients(spec, w, x, pos)
    assert not n["ok"] and n["argmin"] == {"head": 1, "query": 7, "key": 3}  # the NaN first


def test_delta_m_rank_statistics_on_planted_matrices(tiny, monkeypatch):
    """The rank statistics recomputed on planted ``Delta M_i`` with a known spectrum: ``keys``
    counts the causal bank (the query's own key included), ``bound = min(d, r, N_i - 1)``, a
    rank above the bound fails the row, and a zero matrix reports ``sigma_max = 0``, the
    threshold itself as its ratio and 0 after d (no 0/0)."""
    spec, w, x, pos = tiny["spec"], tiny["w"], tiny["x"], tiny["pos"]
    d, r = spec.head_dim, spec.r
    m1 = x.shape[1] + 1
    orig = fast.step
    g = torch.Generator().manual_seed(4)
    U, _ = torch.linalg.qr(torch.randn(m1, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))
    spectrum = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.25] + [0.0] * (r - 5), dtype=torch.float64)
    planted = {(0, 3): U @ torch.diag(spectrum) @ V.T, (1, 20): torch.zeros(m1, r,
                                                                         dtype=torch.float64)}
    rows = sorted(planted)
    qidx = sorted({i for _, i in rows})

    def step(*a, **k):
        st = orig(*a, **k)
        for (h, i), dm in planted.items():
            st.delta_m[h, qidx.index(i)] = dm
        return st

    monkeypatch.setattr(fast, "step", step)
    # W_o,h = [I_r | 0]: the product's singular values are Delta M_i's own
    hidden = int(torch.as_tensor(w.w_o).shape[-1])
    wo = torch.zeros(spec.n_heads, r, hidden, dtype=torch.float64)
    wo[:, :, :r] = torch.eye(r, dtype=torch.float64)
    res = rc.delta_m_rank(spec, replace(w, w_o=wo), x, pos, rows)
    by = {(row["head"], row["query"]): row for row in res["rows"]}
    a, z = by[(0, 3)], by[(1, 20)]
    assert a["keys"] == 4 and a["bound"] == min(d, r, 3) == 3
    assert a["rank"] == 5 and not a["ok"] and not res["ok"]  # 5 directions from 4 keys: fails
    assert a["sigma_max"] == pytest.approx(4.0, rel=1e-14)
    thr = tl.rank_threshold((m1, hidden), a["sigma_max"], r, float(torch.linalg.norm(
        planted[(0, 3)]) * torch.linalg.norm(wo[0])))
    assert a["threshold_ratio"] == pytest.approx(thr / a["sigma_max"], rel=1e-12, abs=0)
    assert z["keys"] == 21 and z["bound"] == min(d, r, 20) and z["rank"] == 0 and z["ok"]
    assert z["sigma_max"] == 0.0 and z["sigma_ratio_after_d"] == 0.0
    assert z["threshold_ratio"] == tl.rank_threshold((m1, hidden), 0.0, r, 0.0)
    assert res["rank_max"] == 5 and res["d"] == d
    assert res["tolerance_from"] == ("tolerances.rank_threshold: max(shape) eps sigma_max + "
                                     "gamma_r ||dM||_F ||W_o||_F")


def test_no_global_readout_without_an_output_projection(tiny):
    """Without ``W_o`` there is no combined bound (``None``, not a placeholder) and the verdict is
    the heads' alone; the per-head bounds are those of the run with ``W_o`` (they never read it),
    and the stated tolerance is the certified bound's."""
    Q = tiny["xq"].shape[0]
    args = (tiny["xq"], torch.full((Q,), N_CTX - 1), tiny["xb"], torch.arange(N_CTX - 1))
    full = rc.no_global_readout(tiny["spec"], tiny["w"], *args)
    res = rc.no_global_readout(tiny["spec"], replace(tiny["w"], w_o=None), *args)
    assert res["combined"] is None and full["combined"] is not None
    assert res["ok"] is all(h["ok"] for h in res["heads"]) is True
    assert [h["lower_certified"] for h in res["heads"]] == \
        [h["lower_certified"] for h in full["heads"]]
    assert res["lower_certified_min"] == min(h["lower_certified"] for h in res["heads"])
    assert res["tolerance"] == 0.0 and res["tolerance_from"] == (
        "certified = computed - sqrt(r) FLOAT64_REL max|v| (the float64 outputs' error); the "
        "claim: certified > 0")
    assert res["queries"] == Q and res["inputs"] == Q + Q * (Q - 1) // 2


def test_one_head_keeps_every_field_of_its_head(tiny, qk):
    """``one_head`` (the oracle's per-row description) keeps head ``h``'s own RoPE base, score
    scale, soft-cap, ALiBi slope, value width, norm epsilon, window, chunk and norm order, slices its query head and its KV
    head's weights (numpy or torch), carries a per-head norm's gain, and refuses a norm over the
    whole projection (it needs every head)."""
    spec, w = tiny["spec"], tiny["w"]
    H = spec.n_heads
    bases = tuple(float(spec.rope.base) * (1 + k) for k in range(H))
    odd = replace(spec, rope=replace(spec.rope, base=bases, cos=None, sin=None, freqs=None),
                  softcap=30.0, alibi_slopes=tuple(0.1 * (k + 1) for k in range(H)),
                  scale=0.3, norm_eps=1e-5, window=5, chunk=7,
                  norm_after_rope=spec.family == "qknorm")  # every field off its default
    wn = replace(w, **{k: np.asarray(getattr(w, k)) for k in ("w_q", "w_k", "w_v", "b_q", "b_k",
                                                              "b_v")})
    h = H - 1
    g = spec.kv_head(h)
    s1, w1 = rc.one_head(odd, wn, h)
    assert (s1.n_heads, s1.n_kv_heads, s1.head_dim, s1.v_dim) == (1, 1, spec.head_dim,
                                                                  spec.v_dim)
    assert s1.rope.bases(1)[0] == bases[h] and s1.softcap == 30.0 and s1.norm_eps == 1e-5
    assert tuple(s1.alibi_slopes) == (odd.alibi_slopes[h],)
    assert s1.score_scale(0) == odd.score_scale(h) and s1.family == spec.family
    assert (s1.window, s1.chunk, s1.norm_after_rope) == (5, 7, odd.norm_after_rope)
    for name, idx, axis in (("w_q", h, 1), ("w_k", g, 1), ("w_v", g, 1), ("b_q", h, 0),
                            ("b_k", g, 0), ("b_v", g, 0)):
        got = getattr(w1, name)
        want = torch.as_tensor(np.asarray(getattr(w, name))).double().narrow(axis, idx, 1)
        assert got.dtype == torch.float64 and torch.equal(got, want), name
    assert w1.q_norm is None and w1.k_norm is None
    t = qk("qwen3")  # per-head QK-norm: the gains travel with the head
    sq, wq = rc.one_head(t["spec"], t["w"], 1)
    assert sq.family == "qknorm" and sq.norm_eps == t["spec"].norm_eps
    assert torch.equal(wq.q_norm, torch.as_tensor(t["w"].q_norm).double())
    assert torch.equal(wq.k_norm, torch.as_tensor(t["w"].k_norm).double())
    # numpy and bfloat16 gains read the same (the gains a capture or a user hands over)
    for conv in (np.asarray, lambda a: torch.as_tensor(a).to(torch.bfloat16)):
        wc = replace(t["w"], q_norm=conv(t["w"].q_norm), k_norm=conv(t["w"].k_norm))
        _, wcq = rc.one_head(t["spec"], wc, 1)
        for got, src in ((wcq.q_norm, wc.q_norm), (wcq.k_norm, wc.k_norm)):
            assert got.dtype == torch.float64 and torch.equal(got, torch.as_tensor(src).double())
    whole = replace(t["spec"], norm_scope="all")
    with pytest.raises(ValueError, match=r"^a norm over every head of a token needs every head: "
                                         r"build the whole layer \(exact_reference does\)$"):
        rc.one_head(whole, t["w"], 0)


# ---------------------------------------------------------------------------------------------
# the checks' arguments, stated tolerances and report fields, pinned (issue 18: a planted change
# to a message, a tolerance's formula or a field must turn a test red)
# ---------------------------------------------------------------------------------------------
def test_no_global_readout_refuses_bad_input_by_name(tiny):
    """Each input of no_global_readout is checked under its own name (the width against the
    weights' ``m``, the count of queries, one shared position, keys not after it), and the
    limiting cases are accepted: exactly 2 queries, a key at the query's own position."""
    spec, w, xq, xb = tiny["spec"], tiny["w"], tiny["xq"], tiny["xb"]
    Q, P = xq.shape[0], N_CTX - 1
    pq, pk = torch.full((Q,), P), torch.arange(P)
    m = xq.shape[1]
    cases = [
        ((xq[:, :-1], pq, xb, pk), f"x_q has width {m - 1}, the layer's input width is {m}"),
        ((xq[:1], pq[:1], xb, pk), "no_global_readout needs at least 2 queries"),
        ((xq, pq[:-1], xb, pk), rf"pos_q must have shape \({Q},\), got \({Q - 1},\)"),
        ((xq, torch.arange(Q), xb, pk),
         r"no_global_readout: every query must sit at one position \(shared bank\)"),
        ((xq, pq, xb[:, :-1], pk), f"x_kv has width {m - 1}, the layer's input width is {m}"),
        ((xq, pq, xb, pk[:-1]), rf"pos_kv must have shape \({P},\), got \({P - 1},\)"),
        ((xq, pq, xb, pk + 2),
         "no_global_readout: bank keys must not lie after the query position"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=f"^{msg}$"):
            rc.no_global_readout(spec, w, *args)
    two = rc.no_global_readout(spec, w, xq[:2], pq[:2], xb, pk)  # the least number of queries
    assert two["pairs"] == 1 and np.isfinite(two["lower_certified_min"])
    at = rc.no_global_readout(spec, w, xq[:2], pq[:2], xb, pk + 1)  # last key at P itself
    assert at["pairs"] == 1 and at["lower_certified_min"] != two["lower_certified_min"]
    # a float32 output projection (the model's own float32 values) is read as float64
    w32 = replace(w, w_o=torch.as_tensor(w.w_o).float())
    assert torch.equal(torch.as_tensor(w32.w_o).double(), torch.as_tensor(w.w_o).double())
    got = rc.no_global_readout(spec, w32, xq[:2], pq[:2], xb, pk)
    assert got["combined"]["lower_certified"] == two["combined"]["lower_certified"]


def test_exact_reference_arguments_window_and_timing(tiny, tiny_reference, qk, monkeypatch):
    """exact_reference: digits default 50, an int >= 16 (16 accepted; 15, 20.5 and True
    refused), passed to every oracle build (the whole-layer build of OLMo 2's norm too); the
    query index checked against the number of queries; a window keeps exactly the keys with
    ``p_i - p_j < window``; ``seconds`` is the wall time of the call."""
    import time

    from ropestep import exact

    assert tiny_reference[1].digits == 50
    spec, w, x, pos = tiny["spec"], tiny["w"], tiny["x"], tiny["pos"]
    for bad in (15, 20.5, True):
        with pytest.raises(ValueError, match=rf"^digits must be an int >= 16, got {bad!r}$"):
            rc.exact_reference(spec, w, x[:4], pos[:4], [(0, 1)], bad)
    n = 6  # fewer queries than the input width: a query index n is out of range
    assert x.shape[1] > n
    for fn in (rc.exact_reference, rc.exact_rows):
        with pytest.raises(ValueError, match=rf"^row \(head 0, query {n}\) out of range"):
            fn(spec, w, x[:n], pos[:n], [(0, n)])
    seen: list = []
    orig = exact.build

    def spy(*a, **k):
        seen.append(k.get("dps"))
        return orig(*a, **k)

    monkeypatch.setattr(exact, "build", spy)
    q3 = qk("qwen3")  # a small layer: the oracle's cost is ~ N d m per row
    t0 = time.perf_counter()
    r16 = rc.exact_reference(q3["spec"], q3["w"], q3["x"][:3], q3["pos"][:3], [(0, 1)], 16)
    wall = time.perf_counter() - t0
    assert r16.digits == 16 and seen == [16]
    assert 0 < r16.seconds <= wall
    ol = qk("olmo2")  # norm over the whole projection: one whole-layer build per query
    seen.clear()
    rc.exact_reference(ol["spec"], ol["w"], ol["x"][:3], ol["pos"][:3], [(0, 1), (1, 1)], 17)
    assert seen == [17]
    monkeypatch.undo()
    g3 = qk("gemma3")  # layer 0: sliding window of 16 over 24 tokens
    win = int(g3["spec"].window)
    i = QK_N - 1
    assert i >= win
    ref = rc.exact_reference(g3["spec"], g3["w"], g3["x"], g3["pos"], [(1, i)], 16)
    p = g3["pos"]
    want = torch.nonzero((p <= p[i]) & (p[i] - p < win)).flatten().numpy()
    assert np.array_equal(ref.keys[1, i], want) and want.size == win


def test_exact_rows_bank_and_the_references_checks(tiny, tiny_reference, qk):
    """exact_rows on a bank (``x_kv``/``pos_kv`` reach the fast path and the oracle: queries at
    a later position reading a 3-key prefix), and the reference's rows and space checked with
    their full messages."""
    from dataclasses import replace as dreplace

    t = qk("qwen3")
    x, p = t["x"], t["pos"]
    res = rc.exact_rows(t["spec"], t["w"], x[5:7], torch.full((2,), 9), [(0, 0), (2, 1)], 16,
                        x_kv=x[:3], pos_kv=p[:3])
    assert res["ok"], res
    assert [r_["keys"] for r_ in res["rows"]] == [3, 3]
    assert [r_["position"] for r_ in res["rows"]] == [9, 9]
    spec, w = tiny["spec"], tiny["w"]
    rows, ref = tiny_reference
    five = dreplace(ref, rows=[(0, q) for q in range(5)])  # not the rows requested
    msg = rf"^reference holds rows {re.escape(str(five.rows[:4]))}\.\.\., not the requested rows$"
    with pytest.raises(ValueError, match=msg):
        rc.exact_rows(spec, w, tiny["x"], tiny["pos"], rows, reference=five)
    with pytest.raises(ValueError, match=r"^reference holds query-space matrices, this head's "
                                         r"Delta M is in input space$"):
        rc.exact_rows(spec, w, tiny["x"], tiny["pos"], rows,
                      reference=dreplace(ref, space="query"))


def _check_stated_conventions_tolerances(model, layer: int, x, res: dict, record: dict) -> None:
    """conventions' per-head ``q_tol``/``k_tol``/``v_tol`` and ``tolerance_from`` recomputed from
    the formula its docstring states: per side (the model's dtype, ropestep's float64) the
    elementwise bound -- ``tolerances.rotated_projection_abs`` of ``A = |x||W|^T + |b|``, or
    with QK-norm ``realchecks._normalised_abs`` with 3 and 5 rotation roundings -- summed over
    the model's rotation pair, times ``max(a, 1)``, mapped by the model's ``repeat_kv``, reduced
    as ``max(bound) / max|model|`` per head."""
    info = models.describe_model(model)
    _, conv, _, parts, _ = models.attention.layer_parts(model, layer, info)
    mdt = next(model.parameters()).dtype
    x64 = torch.as_tensor(x).to(mdt).double()
    H, Hk, d = info.n_heads, info.n_kv_heads, info.head_dim
    group = H // Hk
    perm = models.attention.head_order(conv, d)
    norms = rc._model_norms(model, layer, info, conv)
    kterms = info.hidden + (parts["q"][1] is not None)
    f64 = torch.float64

    def rotated(part, nh: int, name: str) -> torch.Tensor:  # (nh, n, d), ropestep's order
        z, A = models.layouts.project(part, x64, nh)
        if norms is None:
            both = (tl.rotated_projection_abs(mdt, A, kterms)
                    + tl.rotated_projection_abs(f64, A, kterms))
        else:
            g, eps = norms[name]
            both = (rc._normalised_abs(mdt, z, A, kterms, g, eps, norms["scope"], 3)
                    + rc._normalised_abs(f64, z, A, kterms, g, eps, norms["scope"], 5))
        return (models.attention.pair_sum(both, conv)[..., perm]
                * max(conv.amplitude, 1.0)).transpose(0, 1)

    Av = models.layouts.project(parts["v"], x64, Hk)[1].transpose(0, 1)
    bound = {"q": rotated(parts["q"], H, "q"),
             "k": rotated(parts["k"], Hk, "k").repeat_interleave(group, 0),
             "v": (tl.rotated_projection_abs(mdt, Av, kterms)
                   + tl.rotated_projection_abs(f64, Av, kterms)).repeat_interleave(group, 0)}
    model_side = {"q": record["query"].double()[..., perm],
                  "k": record["key"].double().repeat_interleave(group, 0)[..., perm],
                  "v": record["value"].double().repeat_interleave(group, 0)}
    for h in range(H):
        for nm in ("q", "k", "v"):
            want = float(bound[nm][h].max() / model_side[nm][h].abs().max())
            assert res["heads"][h][f"{nm}_tol"] == pytest.approx(want, rel=1e-12, abs=0), (h, nm)
    dt = str(mdt).replace("torch.", "")
    if norms is None:
        assert res["tolerance_from"] == (
            f"tolerances.rotated_projection_abs({dt}) + (float64) with n_terms={kterms}, A = "
            "|x||W|^T + |b| summed over the model's rotation pair, mapped by the model's "
            "repeat_kv; max(bound)/max|model| per head")
    else:
        assert res["tolerance_from"] == (
            f"q, k: realchecks._normalised_abs({dt}, 3 rotation roundings) + (float64, 5) with "
            f"n_terms={kterms}: the projection's rotated_projection_abs carried through the "
            f"layer's RMSNorm (scope {norms['scope']!r}, the model's gains) plus the norm's "
            "roundings, summed over the model's rotation pair, mapped by the model's repeat_kv; "
            "v: rotated_projection_abs; max(bound)/max|model| per head")


def test_conventions_tolerances_are_the_stated_formula(qk, build_tiny):
    """The per-head tolerances of conventions on QK-norm layers (per head: Qwen3; the whole
    projection: OLMo 2) and on a YaRN layer (amplitude a > 1 in the pair sums) are the stated
    formula, and ``tolerance_from`` says which."""
    for name in ("qwen3", "olmo2"):
        t = qk(name)
        record: dict = {}
        res = rc.conventions(*_qk_args(t), head=(t["spec"], t["w"]), record=record)
        assert res["ok"], res
        _check_stated_conventions_tolerances(t["model"], t["layer"], t["x"], res, record)
    model = build_tiny("llama", seed=5, num_hidden_layers=1, hidden_size=128,
                       num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                        "original_max_position_embeddings": 256})
    ids = torch.randint(0, model.config.vocab_size, (12,),
                        generator=torch.Generator().manual_seed(1))
    cap = models.capture(model, ids, [0])[0]
    record = {}
    res = rc.conventions(model, 0, cap.x, cap.positions, record=record)
    assert res["ok"] and float(record["amplitude"]) > 1.1
    _check_stated_conventions_tolerances(model, 0, cap.x, res, record)
    sc = res["scale"]  # relative to the model's multiplier, worst over heads
    assert sc["rel"] == max(abs(s - sc["model"]) / sc["model"] for s in sc["spec"])
    for k in ("scaling", "amplitude", "softcap"):  # the record keeps float64 scalars
        assert record[k].dtype == torch.float64 and record[k].shape == (1,), k
    assert record["window"].dtype == torch.int64 and record["head_order"].dtype == torch.int64
    cos, sin = model.model.rotary_emb(cap.x[None].float(), cap.positions[None])
    for k, tab in (("rotary_cos", cos[0]), ("rotary_sin", sin[0])):
        assert torch.equal(record[k], tab.reshape(-1, tab.shape[-1])), k


def test_conventions_reads_float32_head_weights_as_float64(tiny, qk):
    """A head given with float32 weights (the model's own float32 values: exact in float64) is
    read as float64 on ropestep's side, so conventions reports the very numbers of the float64
    description -- plain and QK-norm (the norms' gains too)."""
    def as32(w):
        keys = ("w_q", "w_k", "w_v", "b_q", "b_k", "b_v", "w_o", "q_norm", "k_norm")
        return replace(w, **{k: torch.as_tensor(getattr(w, k)).float() for k in keys
                             if getattr(w, k, None) is not None})

    cases = [(tiny["model"], LAYER, tiny["x"][:16], tiny["pos"][:16], tiny["spec"], tiny["w"])]
    t = qk("qwen3")
    cases.append((t["model"], t["layer"], t["x"], t["pos"], t["spec"], t["w"]))
    for model, L, x, pos, spec, w in cases:
        assert next(model.parameters()).dtype == torch.float32
        assert all(torch.equal(torch.as_tensor(getattr(w, k)),
                               torch.as_tensor(getattr(as32(w), k)).double())
                   for k in ("w_q", "w_k", "w_v"))
        ref = rc.conventions(model, L, x, pos, head=(spec, w))
        got = rc.conventions(model, L, x, pos, head=(spec, as32(w)))
        assert got["ok"] and ref["ok"]
        for k in ("q_rel_max", "k_rel_max", "v_rel_max", "tolerance_max"):
            assert got[k] == ref[k], k


def test_delta_m_rank_where_r_differs_from_d(tiny, qk, monkeypatch):
    """On hand-made heads whose value width ``r`` is not ``d``: with ``r = 8 > d = 4`` a planted
    full-rank ``Delta M`` (spectrum 1/2, 1/4, ...) fails (rank 8 > bound 4) and reports
    ``sigma_{d+1} / sigma_1 = 2^-4`` exactly; with ``r = 2 < d`` the bound is ``r``.  Also:
    float32 ``w_o`` is read as float64, and the input checks name the check, ``w_o`` and the
    query range."""
    from ropestep.spec import HeadWeights, RoPESpec

    g = torch.Generator().manual_seed(11)
    m, D, n = 12, 16, 10
    x = torch.randn(n, m, generator=g, dtype=torch.float64)
    pos = torch.arange(n)
    orig = fast.step

    def head(d: int, r: int):
        spec = HeadSpec(1, 1, d, v_dim=r, rope=RoPESpec(base=100.0))
        w = HeadWeights(*(torch.randn(m, 1, k, generator=g, dtype=torch.float64)
                          for k in (d, d, r)),
                        w_o=torch.randn(1, r, D, generator=g, dtype=torch.float64))
        return spec, w

    def planted(dm):
        def step(*a, **k):
            st = orig(*a, **k)
            st.delta_m[0, 0] = dm
            return st
        return step

    # r = 8 > d = 4, W_o = [I | 0]: the product's singular values are the planted ones
    spec, w = head(4, 8)
    U, _ = torch.linalg.qr(torch.randn(m + 1, 8, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    spectrum = 0.5 ** torch.arange(1, 9, dtype=torch.float64)
    wo = torch.zeros(1, 8, D, dtype=torch.float64)
    wo[0, :, :8] = torch.eye(8, dtype=torch.float64)
    monkeypatch.setattr(fast, "step", planted(U @ torch.diag(spectrum) @ V.T))
    res = rc.delta_m_rank(spec, replace(w, w_o=wo), x, pos, [(0, n - 1)])
    row = res["rows"][0]
    assert row["bound"] == 4 and row["rank"] == 8 and not row["ok"] and not res["ok"]
    assert row["sigma_max"] == pytest.approx(0.5, rel=1e-14, abs=0)
    assert row["sigma_ratio_after_d"] == pytest.approx(2.0 ** -4, rel=1e-12, abs=0)
    assert res["sigma_ratio_after_d_max"] == row["sigma_ratio_after_d"]
    monkeypatch.undo()
    # r = 2 < d = 4: Delta M (m+1, 2) has rank <= 2, the bound is r
    spec, w = head(4, 2)
    res = rc.delta_m_rank(spec, w, x, pos, [(0, n - 1)])
    assert res["rows"][0]["bound"] == 2 and res["rows"][0]["rank"] == 2 and res["ok"]
    w32 = replace(w, w_o=torch.as_tensor(w.w_o).float())
    got = rc.delta_m_rank(spec, w32, x, pos, [(0, n - 1)])
    assert got["ok"] and got["rows"][0]["rank"] == 2
    with pytest.raises(ValueError, match=r"^delta_m_rank needs weights\.w_o \(the output "
                                         r"projection\)$"):
        rc.delta_m_rank(spec, replace(w, w_o=None), x, pos, [(0, 1)])
    with pytest.raises(ValueError, match=rf"^row \(head 0, query {n}\) out of range"):
        rc.delta_m_rank(spec, w, x, pos, [(0, n)])
    # the oracle's one-head description keeps r: exact_rows on the r = 2 head agrees
    ex = rc.exact_rows(spec, w, x, pos, [(0, 3)], 16)
    assert ex["ok"] and ex["y_rel_max"] <= tl.FLOAT64_REL
    t = qk("qwen3")
    with pytest.raises(ValueError, match=r"^delta_m_rank: the claim is stated in input space"):
        rc.delta_m_rank(t["spec"], t["w"], t["x"], t["pos"], [(0, 1)])


@pytest.fixture
def small_llama(build_tiny):
    """A one-layer Llama (hidden 128, 4 query heads over 2 KV heads, no biases) over 12 seeded
    tokens: cheap enough to rebuild with edited weights."""
    model = build_tiny("llama", seed=5, num_hidden_layers=1, hidden_size=128,
                       num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (12,),
                        generator=torch.Generator().manual_seed(1))
    cap = models.capture(model, ids, [0])[0]
    return model, cap


def test_conventions_zero_heads_kv_map_and_the_head_given(small_llama, zoo_layers, monkeypatch):
    """A query head and a KV head whose projections are zero compare 0 with 0 (relative error
    0, tolerance 0, no 0/0) and pass; a KV map outside ``0..H_kv-1`` and a head description of
    another shape are refused with their messages; a layer without RoPE (SmolLM3's NoPE layer)
    passes with score multiplier ``scaling`` (amplitude 1)."""
    import copy

    model, cap = small_llama
    zm = copy.deepcopy(model)
    attn = zm.model.layers[0].self_attn
    d = attn.head_dim
    with torch.no_grad():
        attn.q_proj.weight[:d] = 0  # query head 0
        attn.k_proj.weight[:d] = 0  # KV head 0 (serves query heads 0 and 1)
        attn.v_proj.weight[:d] = 0
    res = rc.conventions(zm, 0, cap.x, cap.positions)
    assert res["ok"], res
    h0 = res["heads"][0]
    assert h0["q_rel"] == 0.0 and h0["q_tol"] == 0.0
    assert h0["k_rel"] == 0.0 and h0["v_rel"] == 0.0 and res["heads"][1]["k_rel"] == 0.0
    assert res["heads"][2]["q_rel"] > 0  # the other heads compare non-zero rotations
    spec, w = models.layer_head(model, 0, 12)
    H, Hk = spec.n_heads, spec.n_kv_heads
    monkeypatch.setattr(HeadSpec, "kv_head", lambda self, h: Hk if h == 1 else h // 2)
    with pytest.raises(ValueError, match=rf"^spec\.kv_head\(1\) = {Hk} is not a KV head "
                                         rf"\(0\.\.{Hk - 1}\)$"):
        rc.conventions(model, 0, cap.x, cap.positions, head=(spec, w))
    monkeypatch.undo()
    # per-head bases: head H-1 described with another base fails alone (each head reads its own
    # table row)
    bases = (float(spec.rope.base),) * (H - 1) + (float(spec.rope.base) / 3,)
    per = replace(spec, rope=replace(spec.rope, base=bases, cos=None, sin=None, freqs=None))
    res = rc.conventions(model, 0, cap.x, cap.positions, head=(per, w))
    assert [h_["ok"] for h_ in res["heads"]] == [True] * (H - 1) + [False], res["heads"]
    # and both routes see head H-1's keys rotated by its own base (the spec route's key table
    # is head H-1's row, not a neighbour's that happens to hold the model's base)
    for rt in ("spec", "fast.project"):
        assert res["routes"][rt]["k_rel_max"] > tl.DETECT_FACTOR * res["heads"][H - 1]["k_tol"], rt
    half = (replace(spec, n_heads=Hk),
            replace(w, w_q=torch.as_tensor(w.w_q)[:, :Hk], w_o=torch.as_tensor(w.w_o)[:Hk]))
    with pytest.raises(ValueError, match=rf"^head description has \(H, H_kv, d\) = "
                                         rf"\({Hk}, {Hk}, {d}\), the model \({H}, {Hk}, {d}\)$"):
        rc.conventions(model, 0, cap.x, cap.positions, head=half)
    with pytest.raises(ValueError, match=r"^head description and model disagree on "
                                         r"\(H, H_kv, d\)$"):
        rc.position_derivative(model, 0, cap.x, cap.positions, [3], head=half)
    nope, ncap = zoo_layers[("smollm3", 1)]
    assert not models.describe_model(nope).layers[1].rotary
    res = rc.conventions(nope, 1, ncap.x, ncap.positions)
    assert res["ok"], res
    assert res["scale"]["model"] == pytest.approx(
        float(nope.model.layers[1].self_attn.scaling), rel=2.0 ** -52, abs=0)


def test_positional_checks_refuse_bad_arguments_by_message(small_llama):
    """The positional checks' own argument checks, with their full messages: ``queries`` and
    ``deltas`` not sequences, ``x`` of the wrong width, per-head bases, and a given head whose
    RoPE tables stop one position short of the context."""
    model, cap = small_llama
    x, pos = cap.x, cap.positions
    n, m = x.shape
    spec, w = models.layer_head(model, 0, n)
    with pytest.raises(ValueError, match=r"^queries must be a sequence of token indices$"):
        rc.position_derivative(model, 0, x, pos, 3)
    with pytest.raises(ValueError, match=r"^deltas must be a sequence of integers$"):
        rc.position_shift(model, 0, x, pos, [3], deltas=2)
    with pytest.raises(ValueError, match=rf"^x has width {m - 1}, the layer's input width is "
                                         rf"{m}$"):
        rc.position_shift(model, 0, x[:, :-1], pos, [3])
    per_head = replace(spec, rope=replace(spec.rope, base=(float(spec.rope.base),) * spec.n_heads,
                                          cos=None, sin=None, freqs=None))
    with pytest.raises(ValueError, match=r"^per-head RoPE bases: the model has one rotary "
                                         r"table$"):
        rc.position_derivative(model, 0, x, pos, [3], head=(per_head, w))
    short = replace(spec, rope=replace(spec.rope, cos=np.asarray(spec.rope.cos)[:n - 1],
                                       sin=np.asarray(spec.rope.sin)[:n - 1]))
    with pytest.raises(ValueError, match=rf"^the given head's RoPE tables cover {n - 1} "
                                         rf"positions, {n} are needed$"):
        rc.position_derivative(model, 0, x, pos, [3], head=(short, w))


def test_hull_witness_by_hand():
    """The section-7 witness on a readout with a known x-part: ``M_x = sigma e_1 f^T`` gives
    ``t = 1.01 (|m_0| + R + 1) / sigma`` along ``e_1``, certified ``t sigma - |m_0| - R`` and
    the input-norm ratio against the queries' median norm; a zero x-part says so alone."""
    m, r = 5, 3
    f = torch.tensor([0.6, 0.0, 0.8], dtype=torch.float64)
    M = torch.zeros(m + 1, r, dtype=torch.float64)
    M[0] = 2.5 * f  # sigma = 2.5 along e_1
    M[-1] = torch.tensor([0.3, -0.4, 0.0], dtype=torch.float64)  # |m_0| = 0.5
    v = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, -1.0]], dtype=torch.float64)
    mu = torch.tensor([0.0, 0.5, 0.0], dtype=torch.float64)
    R = float(torch.linalg.vector_norm(v - mu, dim=-1).max())  # 1.5
    xq = torch.tensor([[3.0, 4.0, 0, 0, 0], [1.0, 0, 0, 0, 0], [0, 0, 0, 0, 2.0]],
                      dtype=torch.float64)  # norms 5, 1, 2: median 2
    got = rc._hull_witness(M, v, mu, xq)
    t = 1.01 * (0.5 + R + 1.0) / 2.5
    assert got["x_part_zero"] is False
    assert got["t"] == pytest.approx(t, rel=1e-15, abs=0)
    assert got["certified"] == pytest.approx(t * 2.5 - 0.5 - R, rel=1e-14, abs=0)
    assert got["t_over_input_norm"] == pytest.approx(t / 2.0, rel=1e-15, abs=0)
    M[:-1] = 0
    assert rc._hull_witness(M, v, mu, xq) == {"x_part_zero": True}


def test_positional_checks_on_interleaved_rope():
    """Cohere rotates interleaved pairs ``(2l, 2l+1)``: both positional checks pass with the
    layout the adapter read (ropestep's exact-angle side keeps it)."""
    from ropestep import archzoo

    model = archzoo.build("cohere", seed=0)
    ids = torch.randint(0, archzoo.VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    cap = models.capture(model, ids, [0])[0]
    assert models.layer_head(model, 0, 12)[0].rope.layout == "interleaved"
    for check in (rc.position_derivative, rc.position_shift):
        res = check(model, 0, cap.x, cap.positions, [4, 11], heads=cap.heads)
        assert res["ok"], (check.__name__, res)


def test_sample_rows_arguments():
    """sample_rows refuses a non-int or non-positive ``n_heads`` or ``k`` and an empty or
    negative query set, each with its full message; ``n_heads = 1`` and ``k = 1`` are valid."""
    assert rc.sample_rows(1, 3, 1, seed=0) in ([(0, 0)], [(0, 1)], [(0, 2)])
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match=rf"^n_heads must be a positive int, got {bad!r}$"):
            rc.sample_rows(bad, 3, 1, seed=0)
        with pytest.raises(ValueError, match=rf"^k must be a positive int, got {bad!r}$"):
            rc.sample_rows(2, 3, bad, seed=0)
    for qs in ([], [2, -1]):
        with pytest.raises(ValueError, match=r"^no eligible queries \(or a negative query "
                                             r"index\)$"):
            rc.sample_rows(2, qs, 1, seed=0)


@pytest.mark.parametrize("yarn", [False, True], ids=["llama", "yarn"])
def test_conventions_at_positions_not_starting_at_zero(build_tiny, yarn):
    """The score multiplier's amplitude is read where the tables are exactly ``a`` -- cos at
    position 0 -- not at the call's first position: at positions 5..16 the call's first cos
    entry is ``a cos 5`` (-0.28 a), and reading it there turns a right model's scale check red
    (relative error ~11).  The check passes there with the stated ``nonnegative_ops_rel(8)``,
    and its multiplier is the module's ``scaling`` times the square of cos(0)."""
    kw = dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                               "original_max_position_embeddings": 256}) if yarn else {}
    model = build_tiny("llama", seed=5, num_hidden_layers=1, hidden_size=128,
                       num_attention_heads=4, num_key_value_heads=2, **kw)
    ids = torch.randint(0, model.config.vocab_size, (12,),
                        generator=torch.Generator().manual_seed(1))
    cap = models.capture(model, ids, [0])[0]
    pos = cap.positions + 5
    cos_call, _ = model.model.rotary_emb(cap.x[None].float(), pos[None])
    a_call = float(cos_call.reshape(-1, cos_call.shape[-1])[0, 0])
    cos0, _ = model.model.rotary_emb(cap.x[None].float(), torch.zeros(1, 1, dtype=torch.long))
    a = float(cos0.reshape(-1)[0])
    assert a_call == pytest.approx(a * math.cos(5.0), rel=1e-5)  # the first entry is not a
    res = rc.conventions(model, 0, cap.x, pos)
    assert res["ok"] and res["scale"]["ok"], res
    assert res["positions"] == [5, 16]
    sc = res["scale"]
    assert sc["tolerance"] == tl.nonnegative_ops_rel(8)
    assert sc["model"] == float(model.model.layers[0].self_attn.scaling) * a * a
    assert sc["rel"] <= sc["tolerance"]
    # the same check at positions 0..11 reports the same multiplier
    assert rc.conventions(model, 0, cap.x, cap.positions)["scale"]["model"] == sc["model"]


def test_conventions_scale_error_is_relative_to_the_models_multiplier(small_llama):
    """A head description whose score scale is off by a relative 1e-3 (q, k and v unchanged:
    fast.project's queries are divided by the scale) fails the scale check alone, with
    ``rel = |s - model| / model = 1e-3`` -- relative to the model's multiplier (1/sqrt(32) here,
    so a product or an absolute difference would read 5.5e-7 or 1.8e-4)."""
    model, cap = small_llama
    spec, w = models.layer_head(model, 0, 12)
    s0 = float(spec.score_scale(0))
    bad = replace(spec, scale=s0 * (1 + 1e-3))
    res = rc.conventions(model, 0, cap.x, cap.positions, head=(bad, w))
    sc = res["scale"]
    assert sc["model"] == s0 == 32 ** -0.5
    assert sc["rel"] == pytest.approx(1e-3, rel=1e-9, abs=0)
    assert not sc["ok"] and not res["ok"]
    assert all(h["ok"] for h in res["heads"]) and all(r_["ok"] for r_ in res["routes"].values())
