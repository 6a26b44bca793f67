"""Mutation checks: each deliberately wrong formula must be caught by the suite's own checks.

Every test first runs the check on the correct code (it passes: errors <= FLOAT64_REL), then swaps
one formula of the fast layer for a wrong one and shows the same check fails.  If a mutant
survived, the corresponding property tests could not fail either.
"""
from __future__ import annotations

import pytest
import torch

from ropestep import fast, kernel, tolerances
from oracle import verify_against_exact
from strategies import make_problem

TOL = tolerances.FLOAT64_REL


def _ok(errs: dict) -> bool:
    return all(v <= TOL for v in errs.values())


@pytest.fixture
def problem():
    # biases on, ALiBi on, GQA, distinct positions: every mutated ingredient matters
    return make_problem(seed=7, m=4, H=2, Hk=1, d=4, r=3, N=6, alibi=True, amp=1.0,
                        layout="half", base=100.0)


def _check_mutant_caught(p, monkeypatch, name, target, mutant, gauge="original", module=fast):
    good = verify_against_exact(p, gauge)
    assert _ok(good), good
    monkeypatch.setattr(module, target, mutant)
    bad = verify_against_exact(p, gauge)
    print(f"{name}: correct {good} -> mutant {bad}")
    assert not _ok(bad), f"mutant '{name}' survived: {bad}"


def test_mutant_softmax_mean_instead_of_uniform_mean(problem, monkeypatch):
    y_soft = fast.step(*problem.args(), bias=problem.bias).y  # the softmax mean of the values
    _check_mutant_caught(problem, monkeypatch, "mu = softmax mean", "uniform_mean",
                         lambda v, mk: y_soft, module=kernel)


def test_mutant_bias_row_dropped(problem, monkeypatch):
    orig = fast.Projected.lmap

    def lmap_without_bias_row(self, idx=slice(None)):
        L = orig(self, idx).clone()
        L[..., -1, :] = 0  # the augmented coordinate's row of L_i (and so of Delta M_i)
        return L

    good = verify_against_exact(problem)
    assert _ok(good)
    monkeypatch.setattr(fast.Projected, "lmap", lmap_without_bias_row)
    bad = verify_against_exact(problem)
    print("bias row dropped:", bad)
    assert not _ok(bad)


def test_mutant_wrong_rope_pairing(problem, monkeypatch):
    orig = fast.apply_rope

    def swapped(x, cos, sin, layout):
        return orig(x, cos, sin, "interleaved" if layout == "half" else "half")

    _check_mutant_caught(problem, monkeypatch, "wrong RoPE pairing", "apply_rope", swapped)


def test_mutant_query_position_off_by_one(problem, monkeypatch):
    orig = fast.project

    def shifted(spec, weights, x_q, pos_q, *a, **k):
        return orig(spec, weights, x_q, torch.as_tensor(pos_q) + 1, *a, **k)

    _check_mutant_caught(problem, monkeypatch, "query position + 1", "project", shifted)


def test_mutant_naive_phi1(monkeypatch):
    """(e^s - 1)/s: exact in exact arithmetic, wrong in floats near s = 0."""
    p = make_problem(seed=8, m=3, H=1, Hk=1, d=4, r=2, N=6, scale=1e-7)

    def naive(s):
        s = kernel.ftensor(s)
        return torch.where(s == 0, torch.ones_like(s), (torch.exp(s) - 1) / s)

    _check_mutant_caught(p, monkeypatch, "naive phi1", "phi1", naive, module=kernel)


def test_mutant_wrong_gqa_grouping(monkeypatch):
    """Query head h must read KV head h // group, not h % n_kv."""
    p = make_problem(seed=9, m=3, H=4, Hk=2, d=4, r=2, N=5)
    orig = fast.HeadSpec.group.fget
    good = verify_against_exact(p)
    assert _ok(good)
    real_project = fast.project

    def modulo_grouping(spec, weights, *a, **k):
        P = real_project(spec, weights, *a, **k)
        kv = torch.arange(spec.n_heads) % spec.n_kv_heads
        # rebuild keys/values with the wrong map from the group-expanded tensors
        first = torch.arange(spec.n_kv_heads) * spec.group
        P.k, P.v = P.k[first][kv], P.v[first][kv]
        return P

    monkeypatch.setattr(fast, "project", modulo_grouping)
    bad = verify_against_exact(p)
    print("h % n_kv grouping:", bad)
    assert orig is not None and not _ok(bad)
