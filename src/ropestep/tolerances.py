"""Tolerances, derived -- one table for the whole suite.

Notation: ``u`` is the unit roundoff of the dtype arithmetic is carried out in (float64:
2^-53; float32 and bf16/fp16 inputs, which accumulate in float32: 2^-24).  ``gamma_n = n u``
is the classical first-order bound for a sum/product chain of n rounded operations (Higham,
Accuracy and Stability of Numerical Algorithms, section 3.1).

* float64 outputs and matrices against the exact oracle: ``FLOAT64_REL = 1e-12``.  The
  softmax output and each Delta M entry is a sum of at most N <= 16 products whose factors
  carry ``gamma_{d+m+8}`` relative error, plus the exponential of a score with absolute error
  ``gamma_d |q||k|``, which at |s| <= 1400/2 costs at most ``700 u = 8e-14`` relative: all
  below ``1e-12`` with a margin of 10 for unlucky accumulation.
* The readout ``mu + u^T Delta M = mu + q . T + b`` is a sum whose terms can be much larger
  than the result (the original gauge with every score very negative: terms ~ e^{-z_max}; the
  max-key gauge under an attention sink: ~N terms that nearly cancel).  Its forward error is
  bounded by ``(gamma_{N+d+8} + u max|s|) * kappa * S`` (scores of size |s| carry an absolute
  rounding error ``u |s|`` into ``e^s``) with ``S = max_j |v_j|_inf`` the value scale and

      kappa = sum_j |c_j| (|q| . |k~_j - k_o| + |beta_j - beta_o| + |sigma|) (|v_j - mu| + |v_j|) / S

  the condition number of the sum as it is evaluated (returned by ``fast.step`` as
  ``Step.kappa``): the contraction ``q . T`` rounds at the size of ``|q| . |k~_j - k_o|``
  (>= ``|s_j - sigma|``), and the centred value ``v_j - mu`` is itself rounded at ``u |v_j|``.
  The pairwise gauge has the analogous sum over its Laplacian form.
* float32/bfloat16: ``err(fast) <= K_LOW * err(naive) + (FLOOR_LOW + max|s|) * u * max(1, kappa)``
  (readouts, relative to the value scale; matrices relative to their sum-of-absolute-terms
  scale with floor ``(FLOOR_LOW + max|s|) * u``: the ``u |s|`` rounding of a score reaches
  ``e^s``, and both computations carry an independent draw of it), the naive computation being the paper's direct formula with every operation rounded
  to 24 bits (``exact.build_rounded``) on the same dtype-rounded inputs.  Both are first-order
  error propagations of the same sums; the fast path routes through query space (T_i, then
  ``L_i T_i``), which adds at most ``d + 2`` roundings per term to the naive path's ``m + d``
  -- a factor below 2 -- and evaluates phi_1 to a few ulp instead of 0.5 ulp: hence K = 4.
  The floor is one rounding of every term that is summed: ``(N + d + m + 8) u`` at the test
  sizes (N, d, m <= 16, 8, 8), i.e. 40 u, times the sum's condition number ``kappa`` for the
  readout (one rounding of terms of total size ``kappa S``) -- it covers the case where the
  naive error cancels by luck.
"""
from __future__ import annotations

import numpy as np
import torch

FLOAT64_REL = 1e-12
K_LOW = 4.0
FLOOR_LOW = 40.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of the arithmetic dtype (bf16/fp16 inputs compute in float32)."""
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        return 2.0 ** -24
    if dtype == torch.float64:
        return 2.0 ** -53
    raise TypeError(f"no tolerance for dtype {dtype}")


def readout_bound(dtype: torch.dtype, kappa, n_keys: int, head_dim: int, score_max=0.0):
    """``(N + d + 8 + max|s| + |sigma|) u kappa``: relative forward error bound of the readout.

    ``gamma_{N+d+8}`` for the rounded sums and products, plus the relative error of
    ``c_j = e^{...} phi_1(z_j - sigma)``, which inherits the absolute error ``u |s|`` of each
    rounded score through the exponential; both multiply the sum's terms, of total size
    ``kappa`` times the value scale.
    """
    n = n_keys + head_dim + 8 + np.asarray(score_max)
    return n * unit_roundoff(dtype) * np.asarray(kappa)


def low_precision_bound(dtype: torch.dtype) -> tuple[float, float]:
    """``(k, floor)`` in ``err(fast) <= k * err(naive) + floor`` (relative to the value scale)."""
    return K_LOW, FLOOR_LOW * unit_roundoff(dtype)


# ---------------------------------------------------------------------------------------------
# the condition number itself: fast.Step.kappa (float64) against exact.kappa (mpmath)
# ---------------------------------------------------------------------------------------------
# kappa = sum_j |c_j| A_j V_j / S is a sum of non-negative terms, so it has no cancellation:
# its relative error is at most the largest relative error of one term (plus gamma_N for the
# summation).  Per term, in float64 (u = 2^-53), at the suite's sizes (N, d, m <= 16, 8, 8):
#   * |c_j| (and the pairwise D_jk): the score s_j = q . k~_j + beta_j carries an absolute error
#     delta_s <= gamma_{d+2} A, A = max_j (|q| . |k~_j| + |beta_j|); c_j = e^{phi(s_j) - ...}
#     rho(...)/Z is 1-Lipschitz in each score in log scale (phi' <= 1, (log rho)' in [0, 1)),
#     and only differences of scores enter (the shift z_max cancels between e^{z_j - z_max}
#     and Zbar): relative error <= 3 delta_s + a few ulp of phi_1/exp.
#   * A_j = |q| . |k~_j - k_o| + |beta_j - beta_o| + |sigma|: q and k~ come from an (m+1)-term
#     projection, a norm, a rotation and a scale: gamma_{m+d+12} relative to the components'
#     absolute-value sums -- a few 1e-15 times the projection's cancellation ratio (O(1)-O(10)
#     on the drawn Gaussian weights).
#   * V_j = |v_j - mu|_inf + |v_j|_inf >= |v_j|_inf: the centring's absolute error gamma_N S
#     relative to V_j >= max(|v_j|, |mu|) -- again a few 1e-15 on the drawn data.
# The first term dominates.  At the promised score spread (|s| <= 1400, A <= ~4500 after the
# dot product's cancellation) its worst case 3 gamma_10 A is 1.5e-11; the strategies also draw
# unscaled heads with A up to ~4e4 (measured over 3000 random problems), where the worst case
# 1.3e-10 is reached only if all d + 2 roundings of two scores align -- their probabilistic size
# (Higham & Mary 2019: sqrt(n) u instead of n u) is 3 sqrt(10) u A ~ 4e-11 there.  Hence
# KAPPA_REL = 1e-10.  Measured (tests/test_kappa.py, ci profile and 3000 random problems):
# <= 9.5e-13 in every gauge and family, the largest from the constant-bias -800 pin, where the
# pairwise weights inherit the ~ulp(800) rounding of every score.  A kappa wrong by more than
# 1e-10 relative -- a dropped term, a missing |sigma| or bias, another anchor, a factor 1e8 or
# (1 + 1e-8) -- cannot hide behind rounding.
# Tiny kappas: the agreement is relative to max(kappa_exact, KAPPA_FLOOR).  A term of kappa can
# underflow in float64 (a saturated soft-cap's max-key coefficient ~ e^{-1400}, an empty sum
# of the max-key/pairwise gauge at one key is exactly 0), with an absolute error of at most
# N * (A V / S) * tiny <= 16 * 1e5 * 2.2e-308 ~ 4e-302 -- i.e. KAPPA_REL relative to 4e-292.
# KAPPA_FLOOR = 1e-280 sits above that, and a kappa below it moves no tolerance of the suite
# (the readout bound (N + d + 8 + max|s|) u kappa is then < 1e-290, against floors >= 1e-12).
KAPPA_REL = 1e-10
KAPPA_FLOOR = 1e-280


# ---------------------------------------------------------------------------------------------
# whole-layer agreement checks (ropestep sweep, ropestep bench)
# ---------------------------------------------------------------------------------------------
AGREE_MARGIN = 10.0
"""Margin of :func:`agreement_rel_tol` over its first-order bound: covers a readout condition
number ``kappa`` (see the module docstring) up to about 10 together with unlucky accumulation,
as ``FLOAT64_REL`` keeps a margin of 10 over its own first-order bound.

Derivation: the whole-layer checks compare two evaluations of the same quantity from the same
inputs (the softmax output against the readout ``mu + q T + b``; ``Delta M`` factored against
direct; low-rank against exact pairwise; SDPA against the direct softmax) without the per-query
``kappa`` that :func:`readout_bound` needs.  The layers they run on -- seeded synthetic layers and
the benchmark's Qwen-shaped layer with scores of order 1-10, and real models in the max-key
gauge -- have ``kappa = O(1)``: measured errors sit 2-3 orders of magnitude below the bound (e.g.
float64 ``<= 3e-14`` against ``>= 1e-12``, float32 ``<= 5e-6`` against ``>= 1e-4`` in
``benchmarks/``).  A layer whose readout is worse conditioned than that fails the check: its
error is then shown, never hidden, and the per-query checks (``fast.step`` with its ``kappa``)
are the place to look at it."""


def score_limit(dtype: torch.dtype) -> float:
    """``log`` of the largest finite number of the arithmetic dtype (709.78 in float64, 88.72 in
    float32, which bf16/fp16 inputs compute in).

    Derivation: a score enters the sums through ``e^s`` (shifted by the gauge), and the absolute
    rounding ``u |s|`` of a score becomes a relative error ``u |s|`` of its weight (module
    docstring).  Any score the arithmetic can still exponentiate has ``|s|`` at most this
    (beyond it the weight is inf or 0 and the result non-finite -- a failure in itself), so
    ``u * score_limit`` bounds that term without knowing the scores.
    """
    unit_roundoff(dtype)  # raises for a dtype without a tolerance
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return float(np.log(torch.finfo(ct).max))


def agreement_rel_tol(dtype: torch.dtype, n_keys: int, head_dim: int, hidden: int = 0) -> float:
    """Tolerance of a whole-layer agreement check, relative to the larger side's max magnitude
    (``max|a - b| / max|b|``): ``AGREE_MARGIN * (N + d + m + 8 + score_limit) * u``, and at least
    ``FLOAT64_REL`` in float64.

    Derivation (first order, as :func:`readout_bound`): each side is a sum over ``N`` keys
    (``gamma_N``) of products of a weight ``e^s`` (relative error ``u |s| <= u score_limit``
    through the rounded score, plus ``gamma_d`` for the ``d``-term score itself) and a value or
    a ``d``-term contraction (``q . T``: ``gamma_d``), plus at most 8 further roundings
    (centring, mean, division by ``Z``, phi_1 to a few ulp, the final sum); when one side forms
    its terms in the ``m+1``-dimensional augmented input space (the direct ``Delta M_i`` and its
    readout, a model's own float32 projections ``x W``), the ``m``-term products add
    ``gamma_m``: pass ``hidden = m`` then, ``0`` when both sides share the projected ``q, k, v``.
    The two sides' errors add, each at most this size; the factor 2 and the sum's condition
    number (``kappa = O(1)`` on these layers) are inside :data:`AGREE_MARGIN`.  In float64 the
    tolerance is never tighter than ``FLOAT64_REL`` (the suite's float64 agreement level).
    bf16/fp16 inputs compute in float32: both sides see the same rounded inputs, so the
    float32 unit roundoff applies (:func:`unit_roundoff`).
    """
    n = int(n_keys) + int(head_dim) + int(hidden) + 8 + score_limit(dtype)
    tol = AGREE_MARGIN * n * unit_roundoff(dtype)
    return max(FLOAT64_REL, tol) if dtype == torch.float64 else tol


def native_rel_tol(n_keys: int, head_dim: int, hidden: int) -> float:
    """A float32 model's own attention output against its float64 recomputation
    (``ropestep sweep``'s ``y_vs_model_rel``, normwise relative): ``agreement_rel_tol(float32,
    N, d, m)``.

    Derivation: the model's eager float32 forward evaluates the same sums -- the ``m``-term
    projections of the captured float32 inputs, the ``d``-term scores, the softmax and the
    value sum over ``N`` keys -- rounded to float32, while the recomputation is float64 (its
    own error is ``2^-29`` times smaller); so the float32 instance of :func:`agreement_rel_tol`
    with ``hidden = m`` bounds the difference (the tiny test model measures ``<= 1e-5`` against
    ``1.5e-4``).
    """
    return agreement_rel_tol(torch.float32, n_keys, head_dim, hidden)


def native_rel_tol_lowp(dtype: torch.dtype, qk_max: float) -> float:
    """A bf16/fp16 model's own head output against this suite's readout computed from the same
    (already bf16) inputs and weights with float32 arithmetic (``ropestep atlas``), normwise
    relative: ``AGREE_MARGIN * u_lp * (8 + 2 * qk_max)``, with ``u_lp`` the storage dtype's unit
    roundoff (bf16 ``2^-8``, fp16 ``2^-11``) and ``qk_max = max_ij |q~_i| |k~_j| * scale``.

    Derivation (first order): the model rounds its q/k/v projections to the storage dtype
    (relative ``u_lp`` each), so each score carries an absolute error of at most
    ``2 u_lp |q~||k~| scale`` (Cauchy-Schwarz), which ``e^s`` turns into a relative error of
    the weights; it also rounds the probabilities and the output (``u_lp`` each, plus a few
    roundings of the value sum: 8 in all).  The float32 side's own error is ``2^-16`` times
    smaller.  :data:`AGREE_MARGIN` covers the sum's condition number and the factor 2 of two
    sides, as for :func:`agreement_rel_tol`.  The bound depends on the measured ``qk_max``; it
    is honest rather than tight -- a bf16 head with large scores can be far from its float
    recomputation, and this says how far is allowed.
    """
    if dtype == torch.bfloat16:
        u = 2.0 ** -8
    elif dtype == torch.float16:
        u = 2.0 ** -11
    else:
        raise TypeError(f"native_rel_tol_lowp is for bf16/fp16 models, got {dtype}")
    return AGREE_MARGIN * u * (8.0 + 2.0 * float(qk_max))


# ---------------------------------------------------------------------------------------------
# the low-rank pairwise kernel as shipped (tests/test_paths_vs_exact.py)
# ---------------------------------------------------------------------------------------------
def gl_rule_rel(tol: float, spread: float, n: int, node_abs: float, weight_rel: float,
                dtype: torch.dtype = torch.float64) -> float:
    """Relative error of one low-rank kernel entry as :mod:`ropestep.lowrank` evaluates it,
    ``D~_jk = sum_n w~_n e^{t~_n z_j} e^{(1 - t~_n) z_k}`` against ``exp[z_j, z_k]``
    (``z <= 0`` shifted scores, ``|z_j|, |z_k| <= spread``), with the ``n``-point rule chosen for
    ``tol`` and shipped with nodes ``t~_n`` within ``node_abs`` (absolute) and weights ``w~_n``
    within ``weight_rel`` (relative) of the exact Gauss-Legendre rule::

        tol + weight_rel + spread * node_abs + (3 spread + n + 4) u

    Derivation (first order).  The exact rule ``Q = sum_n w_n f(t_n)``, ``f(t) = e^{t z_j +
    (1-t) z_k} > 0``, is within ``gl_error_bound(n, spread) <= tol`` of the integral (what
    ``choose_nodes`` guarantees).  Perturbing a node moves ``f`` by the factor
    ``e^{delta_t (z_j - z_k)}``, i.e. by at most ``spread * node_abs`` relative, and a weight by
    ``weight_rel``; every term is positive, so the perturbed sum moves by at most the largest
    relative change of a term: ``weight_rel + spread * node_abs``.  Evaluating it in the
    arithmetic of ``dtype``: the exponents ``t~ z_j`` and ``(1 - t~) z_k`` carry absolute
    rounding ``u spread`` and ``2 u spread`` (the ``1 - t~`` is rounded too), the two
    exponentials and their product ``3 u``, the weight product ``u``, and the sum of ``n``
    positive terms ``gamma_n``.  ``node_abs`` and ``weight_rel`` are measured by the test against
    the rule computed in mpmath (Newton-polished roots of the Legendre polynomial), so the bound
    is what the shipped rule can deliver -- it exceeds ``tol`` where the shipped end weights are
    inaccurate (numpy's ``leggauss`` loses ~``u / (1 - |x|)`` relative at the end nodes: about
    1e-10 at n = 250), which tests/test_paths_vs_exact.py records as a strict xfail.
    """
    return float(tol + weight_rel + spread * node_abs
                 + (3.0 * spread + n + 4.0) * unit_roundoff(dtype))


def exp_of_sum_rel(abs_sum: float, n_terms: int, dtype: torch.dtype = torch.float64) -> float:
    """Relative error of ``e^L`` evaluated as ``exp`` of a rounded sum ``L`` of ``n_terms``
    terms (logs, ``lgamma``s, integer multiples of them) whose absolute values add up to
    ``abs_sum``: ``(n_terms + 8) u max(1, abs_sum)``.

    Derivation: each term is accurate to a few ulp of itself (``log``, ``lgamma``: <= 4 ulp,
    one more for an integer factor), the sum adds ``gamma_n`` of the absolute sum, so ``L``
    carries an absolute error ``<= (n_terms + 5) u abs_sum``, which ``exp`` turns into the same
    relative error, plus its own rounding (counted as the 3 left of the 8).  Used for
    :func:`ropestep.lowrank.gl_error_bound`, evaluated in logs: at ``n`` = 500 nodes its terms
    reach ~1e4, so it is only accurate to ~1e-12 relative -- ill-conditioned, not wrong.
    """
    return float((n_terms + 8) * unit_roundoff(dtype) * max(1.0, float(abs_sum)))


def descent_bound(dtype: torch.dtype, size, n_keys: int, head_dim: int, hidden: int,
                  score_max=0.0):
    """``(N + m + 4 (d+1)^2 + 3 (d+1) + 8 + 3 max|s|) u * size``: first-order error of a
    descent diagnostic of ``fast.descent`` (``lambda_max(H_i)``, ``E_i(0)``, ``E_i(Delta M_i)``)
    whose evaluated terms have total absolute size ``size`` (tests/test_paths_vs_exact.py
    computes it from the oracle's quantities for each diagnostic).

    Derivation, counting roundings relative to ``size`` (``D = d + 1``: the factor space
    ``hat k_j = [k~_j - k_o; beta_j - beta_o]``, ``hat L = [L_i | e_{m+1}]``):

    * coefficients ``c_j``: the scores' rounding reaches them through ``e^s`` twice (the key's
      and ``Z``'s) plus the gauge anchor: ``3 u max|s|`` (the suite's proxy for the score
      rounding, as in :func:`readout_bound`);
    * the sums over ``N`` keys (``G = sum_j c_j hat k_j hat k_j^T``, ``E``'s sums, ``T``):
      ``gamma_{N+8}`` with the centring and a few ulp of ``phi_1``; ``hat L^T hat L``:
      ``gamma_{m+1}``;
    * ``lambda_max`` is that of ``G^{1/2} (hat L^T hat L) G^{1/2}``.  The symmetric
      eigensolvers are backward stable (``D u ||.||`` each, twice); the clamp of ``G``'s
      rounded-negative eigenvalues is a perturbation of the same size; forming ``G^{1/2} = U
      Lambda^{1/2} U^T`` and the triple product rounds at ``gamma_D`` of products of
      absolute-value matrices whose 2-norms exceed the factors' by up to ``D``: ``4 D^2 u`` in
      all (two such products, each entering twice).  Weyl's inequality turns the perturbation of
      the symmetric matrix into that of its eigenvalue; ``||hat L||_F^2 tr G`` bounds
      ``||hat L^T hat L||_2 ||G||_2``;
    * ``E(Delta M)``: the residual ``hat k_j^T hat L^T (hat L [T; b]) - (v_j - mu)`` adds
      ``gamma_{2D + m + 1}`` -- below the eigenvalue's count.

    One factor covers the three diagnostics (each needs at most that many roundings).
    """
    n = n_keys + hidden + 4 * (head_dim + 1) ** 2 + 3 * (head_dim + 1) + 8 + 3 * float(score_max)
    return n * unit_roundoff(dtype) * size
