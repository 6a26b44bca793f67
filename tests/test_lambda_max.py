"""``fast.lambda_max``: the certified Lanczos value against LAPACK's full spectrum and mpmath.

The atlas reports medians of ``lambda_max`` of two ``d x d`` positive semidefinite matrices per
head and query (docs/math.md section 3).  :func:`ropestep.fast.lambda_max` takes them from a few
Lanczos steps and keeps a value only where its certified interval is narrower than
``tolerances.LAMBDA_CERT_REL``; elsewhere it falls back to ``torch.linalg.eigvalsh``.  These
tests compare it with ``eigvalsh`` and with mpmath at 40 digits on spectra chosen to defeat the
Lanczos steps (a top eigenvector orthogonal to the start vector, a double top eigenvalue, a flat
spectrum, rank one, zero) and on spectra like the atlas's (a dominant direction), and check that
the certificate is what decides: with the certificate's unexplored part dropped, the blind start
returns the wrong eigenvalue and a test fails.
"""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
import torch

from ropestep import fast
from ropestep import tolerances as tl


def _psd(eigs: np.ndarray, rng: np.random.Generator, V: np.ndarray | None = None) -> torch.Tensor:
    d = len(eigs)
    if V is None:
        V, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return torch.tensor((V * eigs) @ V.T, dtype=torch.float64)


def _blind(d: int, rng: np.random.Generator) -> torch.Tensor:
    """Top eigenvector ``e_1 - e_2`` (eigenvalue 10), exactly orthogonal to the all-ones start
    vector in floating point too: rows 1 and 2 are mirror images, so every Lanczos vector keeps
    equal first two entries and the Krylov space never meets ``e_1 - e_2``.  Lanczos alone
    returns the largest eigenvalue of the rest (9)."""
    A = np.zeros((d, d))
    A[:2, :2] = [[5.5, -4.5], [-4.5, 5.5]]  # eigenvalues 10 (e_1 - e_2) and 1 (e_1 + e_2)
    if d > 2:
        A[2:, 2:] = _psd(9.0 * 0.5 ** np.arange(d - 2), rng).numpy()
    return torch.tensor(A, dtype=torch.float64)


def _cases() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(20261202)
    out = {}
    for d in (4, 16, 64, 128):
        out[f"decaying-{d}"] = _psd(np.exp(-0.3 * np.arange(d)) * 7.0, rng)  # lambda_2/lambda_1 0.74
        out[f"steep-{d}"] = _psd(np.exp(-0.7 * np.arange(d)) * 7.0, rng)  # 0.5, like the atlas's
        out[f"flat-{d}"] = _psd(1.0 + 1e-3 * rng.random(d), rng)
        out[f"double-top-{d}"] = _psd(np.concatenate(([5.0, 5.0], rng.random(d - 2))), rng)
        out[f"rank-one-{d}"] = _psd(np.concatenate(([3.0], np.zeros(d - 1))), rng)
        out[f"blind-start-{d}"] = _blind(d, rng)
        X = rng.standard_normal((3 * d, d)) + 2.0  # a Gram matrix with a dominant mean direction
        out[f"gram-{d}"] = torch.tensor(X.T @ X / (3 * d), dtype=torch.float64)
    return out


CASES = _cases()


def _tol(value: torch.Tensor) -> torch.Tensor:
    """Certified width plus eigvalsh's own backward error (both <= LAMBDA_CERT_REL relative)."""
    return 2 * tl.LAMBDA_CERT_REL * value.abs() + 1e-300


@pytest.mark.parametrize("name", sorted(CASES))
def test_lambda_max_agrees_with_eigvalsh(name):
    A = CASES[name]
    got = fast.lambda_max(A)
    ref = torch.linalg.eigvalsh(A)[-1]
    assert torch.isfinite(got) and abs(got - ref) <= _tol(ref), (name, float(got), float(ref))


@pytest.mark.parametrize("name", ["decaying-16", "steep-16", "blind-start-16", "double-top-16",
                                  "gram-16"])
def test_lambda_max_against_mpmath(name):
    """An oracle that shares nothing with LAPACK: mpmath's Jacobi eigenvalues at 40 digits."""
    A = CASES[name]
    with mp.workdps(40):
        ev = mp.eigsy(mp.matrix(A.tolist()), eigvals_only=True)
        ref = max(float(e) for e in ev)
    got = float(fast.lambda_max(A))
    assert abs(got - ref) <= 2 * tl.LAMBDA_CERT_REL * abs(ref), (name, got, ref)


def test_batches_and_shapes():
    """Any leading shape; blocks of LANCZOS_BLOCK matrices give the same values as one by one."""
    rng = np.random.default_rng(7)
    mats = [_psd(np.exp(-rng.random() * np.arange(32)) * (1 + 9 * rng.random()), rng)
            for _ in range(fast.LANCZOS_BLOCK + 7)]
    A = torch.stack(mats).reshape(5, -1, 32, 32)
    got = fast.lambda_max(A)
    assert got.shape == (5, (fast.LANCZOS_BLOCK + 7) // 5)
    ref = torch.linalg.eigvalsh(A)[..., -1]
    assert bool((got - ref).abs().le(_tol(ref)).all())


def test_the_certificate_decides():
    """Atlas-like spectra are certified by the Lanczos steps (no fallback); the blind start, a
    double top eigenvalue and a flat spectrum are not, and fall back."""
    for name, expect in (("steep-64", 0), ("gram-64", 0), ("rank-one-64", 0),
                         ("blind-start-64", 1), ("double-top-64", 1), ("flat-64", 1)):
        st: dict = {}
        fast.lambda_max(CASES[name], stats=st)
        assert st == {"matrices": 1, "retried": 0, "fallbacks": expect}, (name, st)


def test_dropping_the_unexplored_part_is_caught(monkeypatch):
    """Power of the tests above: a certificate without the unexplored block (``f = 0``) accepts
    the blind start's second eigenvalue, which ``test_lambda_max_agrees_with_eigvalsh`` sees."""
    real = fast._ends

    def no_tail(alpha, beta, tail):
        lo, _ = real(alpha, beta, tail)
        return lo, lo  # every interval "certified" at width 0

    monkeypatch.setattr(fast, "_ends", no_tail)
    A = CASES["blind-start-64"]
    got, ref = fast.lambda_max(A), torch.linalg.eigvalsh(A)[-1]
    assert abs(got - ref) > _tol(ref)


def test_zero_and_nonfinite():
    """The zero matrix gives 0; a NaN entry is never certified, so it reaches LAPACK, which
    refuses it (a failure, never a number)."""
    assert float(fast.lambda_max(torch.zeros(8, 8, dtype=torch.float64))) == 0.0
    A = CASES["decaying-16"].clone()
    A[3, 5] = A[5, 3] = math.nan
    try:
        got = fast.lambda_max(A)
    except RuntimeError:
        return
    assert not bool(torch.isfinite(got))


def test_the_counted_steps_are_the_steps_taken():
    """``cost`` counts (and docs/protocol.md section 11 states) the Lanczos steps that
    ``fast.lambda_max`` takes."""
    from ropestep import cost
    assert cost.LANCZOS_STEPS == fast.LANCZOS_STEPS
    assert cost.ATLAS_LANCZOS_STEPS == fast.LANCZOS_STEPS_STARTED
    assert cost.lambda_max_flops(64) == 96152
    assert cost.lambda_max_flops(64, 5, started=True) == 58816


def test_start_vectors():
    """``start=``: the certificate holds for any start vector.  Near the top eigenvector five
    steps certify what five from the all-ones vector cannot; the blind start's mirror image of
    the all-ones vector (orthogonal to its top eigenvector) is caught by the certificate and
    falls back, and so is a start that is exactly an eigenvector (the steps break down at once);
    a zero or non-finite start is the all-ones vector's; a start of the wrong shape is refused.
    Every value agrees with ``eigvalsh``."""
    rng = np.random.default_rng(11)
    names = ("decaying-64", "steep-64", "gram-64", "blind-start-64", "double-top-64")
    A = torch.stack([CASES[n] for n in names])
    ref = torch.linalg.eigvalsh(A)[:, -1]
    top = torch.linalg.eigh(A)[1][..., -1]  # (5, d)
    near = top + 1e-6 * torch.tensor(rng.standard_normal(top.shape))  # ~1e-6 off the top vector
    k = fast.LANCZOS_STEPS_STARTED
    st_ones, st_near = {}, {}
    got_ones = fast.lambda_max(A, k, stats=st_ones)
    got_near = fast.lambda_max(A, k, start=near, stats=st_near)
    assert bool((got_near - ref).abs().le(_tol(ref)).all())
    assert bool((got_ones - ref).abs().le(_tol(ref)).all())
    # from the all-ones vector k steps certify only the Gram matrix; from near the top vector
    # all but the double top eigenvalue, which is never certified, whatever the start
    assert st_ones["fallbacks"] == 4 and st_near["fallbacks"] == 1, (st_ones, st_near)
    blind = torch.ones(1, 64, dtype=torch.float64)  # keeps the mirror rows equal: blind
    st: dict = {}
    got = fast.lambda_max(CASES["blind-start-64"][None], start=blind, stats=st)
    assert st["fallbacks"] == 1 and abs(float(got[0]) - 10.0) <= 1e-12
    exact_top = top[3:4]  # blind-start-64's own top eigenvector: beta_1 = 0, the steps stop
    got = fast.lambda_max(CASES["blind-start-64"][None], start=exact_top)
    assert abs(float(got[0]) - 10.0) <= 1e-12
    bad = near.clone()
    bad[0] = 0.0
    bad[1, 3] = math.nan
    bad[2, 5] = math.inf
    got_bad = fast.lambda_max(A, start=bad)
    plain = fast.lambda_max(A)
    assert torch.equal(got_bad[:3], plain[:3])  # replaced by the all-ones start, bit for bit
    with pytest.raises(ValueError, match="start vectors of shape"):
        fast.lambda_max(A, start=near[:, :-1])
    with pytest.raises(ValueError, match="start vectors of shape"):
        fast.lambda_max(A, start=near[:4])


@pytest.mark.parametrize("family", ["dot", "qknorm"])
def test_the_atlas_starts_its_lanczos_steps(monkeypatch, family):
    """The atlas passes ``fast.LANCZOS_STEPS_STARTED`` steps (the count of ``cost``) and start
    vectors ``g_i = sum_j c_ij k~_j`` (and ``B_i^T g_i``) that lie near the top eigenvectors
    when the keys share a direction, as a trained model's do (here a key bias): each start's
    Rayleigh quotient is within 10% of ``lambda_max``, and far fewer matrices fall back to LAPACK
    than from the all-ones vector in as many steps.  Both the affine heads' call (``G_i`` and
    ``M_i``) and the query-space-only heads' (QK-norm: ``G_i`` alone)."""
    from dataclasses import replace

    from ropestep import layercheck
    from test_atlas import N, layer
    calls: list = []
    ones: dict = {}
    real = fast.lambda_max

    def spy(A, steps=fast.LANCZOS_STEPS, *, start=None, retry=None, stats=None):
        st: dict = {}
        out = real(A, steps, start=start, stats=st)
        calls.append((A.clone(), steps, None if start is None else start.clone(), st, retry))
        real(A, steps, stats=ones)
        return out

    monkeypatch.setattr(layercheck.fast, "lambda_max", spy)
    spec, w, x = layer(seed=3, d=16)
    spec = replace(spec, family=family)
    w = replace(w, b_k=torch.full_like(torch.as_tensor(w.b_k), 8.0))
    if family == "qknorm":
        w = replace(w, q_norm=torch.ones(16, dtype=torch.float64),
                    k_norm=torch.ones(16, dtype=torch.float64))
    layercheck.evaluate_layer(spec, w, x, torch.arange(N), torch.zeros(N, spec.n_heads, spec.r,
                                                                   dtype=torch.float64))
    assert calls
    started = sum(c[3]["fallbacks"] for c in calls)
    assert 4 * started <= ones["fallbacks"], (started, ones)
    for A, steps, start, _st, retry in calls:
        assert steps == fast.LANCZOS_STEPS_STARTED and start is not None
        assert retry == fast.LANCZOS_STEPS
        d = A.shape[-1]
        X, v = A.reshape(-1, d, d), start.reshape(-1, d)
        v = v / v.norm(dim=-1, keepdim=True)
        rq = (v[:, None, :] @ X @ v[:, :, None])[:, 0, 0]
        lam = torch.linalg.eigvalsh(X)[:, -1]
        assert bool((rq >= 0.9 * lam).all()), float((rq / lam).min())


def test_retry_takes_more_steps_before_lapack():
    """``retry=``: the matrices ``steps`` Lanczos steps do not certify get ``retry`` steps from
    the same start, and only those that still do not certify reach LAPACK; the values agree
    with ``eigvalsh`` either way, and a ``retry`` not above ``steps`` is no second pass."""
    names = ("decaying-64", "steep-64", "gram-64", "double-top-64")
    A = torch.stack([CASES[n] for n in names])
    ref = torch.linalg.eigvalsh(A)[:, -1]
    st: dict = {}
    got = fast.lambda_max(A, 3, retry=fast.LANCZOS_STEPS, stats=st)
    assert bool((got - ref).abs().le(_tol(ref)).all())
    # 3 steps certify only the Gram matrix; 8 more the steep spectrum, not the slowly decaying
    # one (lambda_2/lambda_1 = 0.74) or the double top eigenvalue
    assert st == {"matrices": 4, "retried": 3, "fallbacks": 2}, st
    for retry in (None, 3, 2):
        st = {}
        fast.lambda_max(A, 3, retry=retry, stats=st)
        assert st == {"matrices": 4, "retried": 0, "fallbacks": 3}, (retry, st)


def test_a_continued_recurrence_is_the_longer_one():
    """The retry continues the first steps' recurrence: 3 steps and then 5 more give the
    coefficients of 8 steps from the same start, bit for bit, so a retried value is the value
    ``retry`` steps would have given."""
    A = torch.stack([CASES[n] for n in ("decaying-64", "steep-64", "gram-64")])
    start = torch.linspace(1.0, 2.0, 64, dtype=torch.float64).expand(3, 64).clone()
    a8, b8, Q8, q8 = fast._lanczos(A, 8, start)
    first = fast._lanczos(A, 3, start)
    a, b, Q, q = fast._lanczos(A, 8, None, first)
    assert torch.equal(a, a8) and torch.equal(b, b8) and torch.equal(Q, Q8) and torch.equal(q, q8)
    lo8, hi8, _ = fast._interval(A, 8, start)
    lo3, hi3, blocks = fast._interval(A, 3, start)
    lo, hi, _ = fast._interval(A, 8, state=tuple(torch.cat(p) for p in zip(*blocks)))
    assert torch.equal(lo, lo8) and torch.equal(hi, hi8) and not torch.equal(lo3, lo8)
