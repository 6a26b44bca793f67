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
