"""Exact SymPy derivations of the gradient-step identity (docs/math.md sections 2-8 and 14).

Every result is a small pure function that returns SymPy objects -- usually a *residual*, an
expression (or matrix) that is exactly zero when the statement holds.  ``tests/test_symbolic.py``
reduces each residual to 0 with :func:`reduce_exact`, and evaluates the same expressions at random
points through ``sympy.lambdify`` (mpmath at 60 digits, numpy and torch in float64).

Conventions (docs/math.md section 1): the augmented query ``u`` and the features ``a_j`` are column
matrices ``(D, 1)`` with ``D = m + 1``; values ``v_j`` are row matrices ``(1, r)``.  Then
``s_j = u^T a_j``, ``Z = sum_j e^{s_j}``, ``y = sum_j e^{s_j} v_j / Z`` (a ``(1, r)`` row),
``mu = (1/N) sum_j v_j`` and ``delta_m = sum_j c_j a_j (v_j - mu)`` (``(D, r)``), so the readout
``mu + u^T delta_m`` is a ``(1, r)`` row like ``y``.

The exact route.  :func:`reduce_exact` rewrites trigonometric and hyperbolic functions as
exponentials, replaces the exponentials by monomials in a few fresh symbols (a basis of the
exponents: ``e^{s_j - sigma} = X_j / X_sigma``; :func:`exp_to_symbols`), and evaluates the result
as a rational function in sparse polynomial arithmetic, with no gcd and no ``simplify``.  Each
replacement is an identity, so a zero numerator proves the expression is zero wherever it is
defined; the four-key identity takes well under a second.  The converse -- a non-zero numerator --
is not by itself a proof of non-vanishing: the tests show the deliberately wrong statements are
non-zero by evaluating them at 60 digits.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import lcm
from typing import Callable, Iterable, Sequence

import sympy as sp
from sympy.polys.domains import QQ, QQ_I
from sympy.polys.rings import PolyRing

__all__ = [
    # exact reduction
    "exp_to_symbols", "reduce_exact", "is_exactly_zero",
    # section 2
    "rho", "exp_dd", "rho_series", "rho_facts", "rho_positivity",
    # section 3
    "SymbolicHead", "symbolic_head", "scores", "partition", "softmax_output", "uniform_mean",
    "step_weights", "delta_m", "readout", "identity_residual",
    "wrong_identity_softmax_mean", "wrong_identity_exp_weights",
    "ProofStep", "general_identity_proof", "check_proof_step",
    "step_energy", "energy_gradient", "energy_hessian", "feature_gram", "descent_change",
    "gradient_residual", "wrong_gradient_without_half", "hessian_residual", "descent_residual",
    "gram_psd_residual", "trace_bound_residuals", "lambda_max_2x2", "descent_counterexample",
    # section 4
    "gauge_weights", "gauge_delta_m", "gauge_residual", "maxkey_gauge_residuals",
    "pairwise_delta_m", "pairwise_residual", "pairwise_translation_residual",
    # section 5
    "J2", "phi1_rot", "phi1_rot_series", "phi1_matrix_integral", "rope_generator",
    "rope_rotation", "phi1_rope", "rope_facts",
    # section 6
    "frozen_reuse_error", "frozen_reuse_tokenwise", "frozen_refresh", "prefix_full_residuals",
    # section 7
    "convex_combination_residuals", "two_key_family", "affine_readout_limits",
    "affine_three_point_system", "AffineWitness", "no_affine_readout_witness",
    # section 8
    "cosine_bound_residuals", "cosine_bound",
    # section 14
    "LatentHeads", "latent_heads", "latent_model_query", "latent_model_key", "latent_values",
    "latent_model_scores", "latent_absorbed_query", "latent_absorbed_keys",
    "latent_absorbed_scores", "latent_absorption_residual", "wrong_latent_absorption_untransposed",
    "wrong_latent_absorption_misordered", "latent_query_space_matrix", "latent_identity_residual",
    "wrong_latent_identity_swapped_values", "latent_query_map", "latent_input_space_residuals",
    "latent_query_latent_ray", "latent_per_head_form_residuals",
]


# =============================================================================================
# exact reduction
# =============================================================================================
_EXP_FAMILY = (sp.sin, sp.cos, sp.tan, sp.cot, sp.sinh, sp.cosh, sp.tanh, sp.coth)


def _split_exponent_term(term: sp.Expr) -> tuple[sp.Rational, tuple[sp.Expr, bool]]:
    """``c * m`` (``c`` rational) -> ``(c, (m, imaginary))``, with a factor ``I`` moved into the key."""
    coeff, mono = term.as_coeff_Mul()
    imaginary = False
    if mono.has(sp.I):
        mono, imaginary = sp.expand(mono / sp.I), True
        if mono.has(sp.I):
            raise ValueError(f"exp_to_symbols: cannot split exponent term {term}")
    if not coeff.is_Rational:  # a float coefficient would make the reduction inexact
        raise ValueError(f"exp_to_symbols: exponent term {term} has a non-rational coefficient")
    return sp.Rational(coeff), (mono, imaginary)


def exp_to_symbols(expr: sp.Expr) -> tuple[sp.Expr, dict[sp.Dummy, sp.Expr]]:
    """Replace every ``exp(arg)`` in ``expr`` by a Laurent monomial in a few fresh symbols.

    Each ``arg`` is expanded into a vector of rational coefficients over monomials (a factor ``I``
    makes a separate coordinate).  A basis ``b_1, b_2, ...`` of the rational span of all the
    arguments is picked greedily among the arguments themselves, shortest first (so ``s_j`` and
    ``sigma`` are kept and ``s_j - sigma`` is expressed through them), every argument is written
    ``arg = sum_t c_t b_t`` and ``exp(arg) = prod_t X_t^(c_t q_t)`` with ``X_t = exp(b_t / q_t)``,
    ``q_t`` the lcm of the denominators of the ``c_t``: integer exponents, and an identity.
    Returns the new expression and the map ``X_t -> b_t / q_t``.
    """
    expr = sp.sympify(expr)
    atoms = expr.atoms(sp.exp)
    if not atoms:
        return expr, {}
    vectors: dict[sp.Expr, dict[tuple[sp.Expr, bool], sp.Rational]] = {}
    for atom in atoms:
        if atom.args[0].has(sp.exp):
            raise ValueError(f"exp_to_symbols: nested exponential {atom}")
        vec: dict[tuple[sp.Expr, bool], sp.Rational] = {}
        for term in sp.Add.make_args(sp.expand(atom.args[0])):
            c, key = _split_exponent_term(term)
            vec[key] = vec.get(key, 0) + c
        vectors[atom] = {k: c for k, c in vec.items() if c != 0}
    keys = sorted({k for vec in vectors.values() for k in vec}, key=str)
    index = {k: i for i, k in enumerate(keys)}

    def dense(vec):
        col = [sp.Integer(0)] * len(keys)
        for k, c in vec.items():
            col[index[k]] = c
        return col

    order = sorted(vectors, key=lambda at: (len(vectors[at]), sp.default_sort_key(at)))
    basis: list[sp.Expr] = []  # atoms whose arguments form the basis
    basis_cols: list[list[sp.Expr]] = []
    for atom in order:
        col = dense(vectors[atom])
        if not any(col):
            continue
        trial = sp.Matrix.hstack(*[sp.Matrix(c) for c in basis_cols + [col]])
        if trial.rank() == len(basis_cols) + 1:
            basis.append(atom)
            basis_cols.append(col)
    bmat = sp.Matrix.hstack(*[sp.Matrix(c) for c in basis_cols]) if basis_cols else None
    coords: dict[sp.Expr, list[sp.Rational]] = {}
    for atom, vec in vectors.items():
        if not vec:
            coords[atom] = [sp.Integer(0)] * len(basis)
            continue
        sol, params = bmat.gauss_jordan_solve(sp.Matrix(dense(vec)))
        if params.shape[0]:
            raise AssertionError("exp_to_symbols: basis is not independent")
        coords[atom] = list(sol)
    denominators = [lcm(1, *[int(sp.Rational(coords[at][t]).q) for at in coords])
                    for t in range(len(basis))]
    symbols = [sp.Dummy(f"X{t}") for t in range(len(basis))]
    replacement = {
        atom: sp.Mul(*[x ** int(c * q) for x, c, q in zip(symbols, cs, denominators)])
        for atom, cs in coords.items()
    }
    mapping = {x: at.args[0] / q for x, at, q in zip(symbols, basis, denominators)}
    return expr.xreplace(replacement), mapping


class _Unsupported(Exception):
    """An expression node the polynomial-ring route does not handle (falls back to ``together``)."""


@dataclass
class _Frac:
    """``num / prod_f f^den[f]``: ring numerator, denominator kept as a multiset of ring factors."""

    num: object
    den: dict


def _frac_add(parts: list[_Frac], ring) -> _Frac:
    common: dict = {}
    for p in parts:
        for f, k in p.den.items():
            common[f] = max(common.get(f, 0), k)
    num = ring.zero
    for p in parts:
        term = p.num
        if term == 0:
            continue
        for f, k in common.items():
            extra = k - p.den.get(f, 0)
            if extra:
                term = term * f**extra
        num = num + term
    return _Frac(num, common)


def _frac_invert(x: _Frac, ring) -> _Frac:
    if x.num == 0:
        raise ZeroDivisionError("reduce_exact: division by an expression that is identically 0")
    num = ring.one
    for f, k in x.den.items():
        num = num * f**k
    lc = x.num.LC  # normalise the new factor to leading coefficient 1, so Z and -Z coincide
    inv = ring(ring.domain.quo(ring.domain.one, lc))
    if x.num.is_ground:
        return _Frac(num * inv, {})
    return _Frac(num * inv, {x.num.quo_ground(lc): 1})


def _frac_from_expr(e: sp.Expr, ring, gens: dict, cache: dict) -> _Frac:
    hit = cache.get(e)
    if hit is not None:
        return hit
    if e in gens:
        out = _Frac(gens[e], {})
    elif e.is_Rational or e is sp.I:
        out = _Frac(ring(ring.domain.from_sympy(e)), {})
    elif e.is_Add:
        out = _frac_add([_frac_from_expr(t, ring, gens, cache) for t in e.args], ring)
    elif e.is_Mul:
        num, den = ring.one, {}
        for t in e.args:
            x = _frac_from_expr(t, ring, gens, cache)
            num = num * x.num
            for f, k in x.den.items():
                den[f] = den.get(f, 0) + k
        out = _Frac(num, den)
    elif e.is_Pow and e.exp.is_Integer:
        base = _frac_from_expr(e.base, ring, gens, cache)
        k = int(e.exp)
        if k < 0:
            base, k = _frac_invert(base, ring), -k
        out = _Frac(base.num**k, {f: m * k for f, m in base.den.items()})
    else:
        raise _Unsupported(e)
    cache[e] = out
    return out


def _reduce_scalar(e: sp.Expr) -> sp.Expr:
    e = sp.sympify(e)
    if e == 0:
        return sp.Integer(0)
    e = e.rewrite(_EXP_FAMILY, sp.exp)
    e, _ = exp_to_symbols(e)
    symbols = sorted(e.free_symbols, key=sp.default_sort_key)
    try:
        ring = PolyRing(symbols, QQ_I if e.has(sp.I) else QQ) if symbols else None
        if ring is None:
            raise _Unsupported(e)
        frac = _frac_from_expr(e, ring, dict(zip(symbols, ring.gens)), {})
    except _Unsupported:  # e.g. sqrt or an unevaluated integral: the slower generic route
        numerator, denominator = sp.fraction(sp.together(e))
        numerator = sp.expand(numerator)
        return sp.Integer(0) if numerator == 0 else numerator / denominator
    if frac.num == 0:
        return sp.Integer(0)
    return frac.num.as_expr() / sp.Mul(*[f.as_expr() ** k for f, k in frac.den.items()])


def reduce_exact(expr):
    """Exact canonical form of ``expr``: ``0`` exactly when the reduction proves ``expr == 0``.

    Accepts an expression, a matrix (reduced entrywise) or a list/tuple.  Trig and hyperbolic
    functions are rewritten as exponentials, exponentials become monomials in a few symbols
    (:func:`exp_to_symbols`), and the result is evaluated in sparse polynomial arithmetic over
    the rationals (``QQ``, or ``QQ_I`` when ``I`` occurs) as numerator / product of denominator
    factors, combining sums over the least common multiple of the factors (no gcd).  Every step is
    an identity, so a zero numerator proves the expression zero wherever it is defined.  Nodes the
    ring cannot hold (a ``sqrt``, a float) fall back to ``together`` and ``expand``.  A non-zero
    result is returned as numerator / denominator in the new symbols.
    """
    if isinstance(expr, sp.MatrixBase):
        return expr.applyfunc(_reduce_scalar)
    if isinstance(expr, (list, tuple)):
        return type(expr)(reduce_exact(e) for e in expr)
    return _reduce_scalar(expr)


def is_exactly_zero(expr) -> bool:
    """True when :func:`reduce_exact` proves every entry of ``expr`` is zero."""
    r = reduce_exact(expr)
    if isinstance(r, sp.MatrixBase):
        return all(x == 0 for x in r)
    if isinstance(r, (list, tuple)):
        return all(x == 0 for x in r)
    return r == 0


# =============================================================================================
# section 2: phi_1 = rho, the exponential divided difference
# =============================================================================================
def rho(s: sp.Expr) -> sp.Expr:
    """``rho(s) = phi_1(s) = (e^s - 1)/s``; the removable singularity is filled: ``rho(0) = 1``
    when ``s`` is structurally zero (e.g. the max-key gauge's own key, ``s_j - s_j``)."""
    if sp.expand(s) == 0:
        return sp.Integer(1)
    return (sp.exp(s) - 1) / s


def exp_dd(a: sp.Expr, b: sp.Expr) -> sp.Expr:
    """Exponential divided difference ``exp[a, b] = (e^a - e^b)/(a - b)``; ``exp[a, a] = e^a``."""
    if sp.expand(a - b) == 0:
        return sp.exp(a)
    return (sp.exp(a) - sp.exp(b)) / (a - b)


def rho_series(s: sp.Expr, order: int) -> sp.Expr:
    """Taylor polynomial ``sum_{k < order} s^k / (k+1)!`` of ``rho`` at 0."""
    return sp.Add(*[s**k / sp.factorial(k + 1) for k in range(order)])


def rho_facts(order: int = 8) -> dict[str, sp.Expr]:
    """Residuals of the facts of docs/math.md section 2; each reduces to exactly 0.

    ``integral``     ``int_0^1 e^{ts} dt - rho(s)``            (sympy ``integrate``, ``s != 0``)
    ``series``       ``series(rho, s, 0, order) - sum_{k<order} s^k/(k+1)!``
    ``series_sum``   ``sum_{k>=0} s^k/(k+1)! - rho(s)``        (the full series, ``Sum(...).doit()``)
    ``limit_at_0``   ``lim_{s->0} rho(s) - 1``
    ``expm1``        ``e^s - 1 - s rho(s)``
    ``expm1_integral`` ``int_0^s e^t dt - (e^s - 1)``          (so ``expm1`` has the sign of ``s``)
    ``two_point``    ``exp[a,b] - e^b rho(a-b)``
    ``reflection``   ``rho(s) - e^s rho(-s)``                  (used for positivity at ``s < 0``)
    """
    s = sp.Symbol("s", real=True, nonzero=True)
    sp_pos = sp.Symbol("s", positive=True)
    t = sp.Symbol("t", real=True)
    k = sp.Symbol("k", integer=True, nonnegative=True)
    a, b = sp.symbols("a b", real=True)
    integral = sp.integrate(sp.exp(t * s), (t, 0, 1))
    return {
        "integral": integral - rho(s),
        "series": sp.expand(sp.series(rho(s), s, 0, order).removeO() - rho_series(s, order)),
        "series_sum": sp.Sum(sp_pos**k / sp.factorial(k + 1), (k, 0, sp.oo)).doit() - rho(sp_pos),
        "limit_at_0": sp.limit(rho(s), s, 0) - 1,
        "expm1": sp.exp(s) - 1 - s * rho(s),
        "expm1_integral": sp.integrate(sp.exp(t), (t, 0, s)) - (sp.exp(s) - 1),
        "two_point": exp_dd(a, b) - sp.exp(b) * rho(a - b),
        "reflection": rho(s) - sp.exp(s) * rho(-s),
    }


def rho_positivity() -> dict[str, bool | None]:
    """The positivity argument for ``rho`` as SymPy assumption queries; each must be ``True``.

    Two independent routes:

    * integral: ``rho(s) = int_0^1 e^{ts} dt`` (``rho_facts()['integral']``) integrates a
      positive function over an interval of length 1 (``integrand_positive``);
    * series + reflection: for ``s > 0`` every term of ``sum s^k/(k+1)!`` is positive
      (``series_terms_positive``) and the ``k = 0`` term is 1, so ``rho(s) >= 1``; for ``s < 0``,
      ``rho(s) = e^s rho(-s)`` (``rho_facts()['reflection']``) with ``e^s > 0``
      (``exp_positive``) and ``rho(-s) >= 1``.  Equivalently ``rho = expm1(s)/s`` with
      ``expm1(s) = int_0^s e^t dt`` of the sign of ``s`` (``expm1_sign_*``).
    """
    s = sp.Symbol("s", real=True)
    t = sp.Symbol("t", real=True)
    sp_pos = sp.Symbol("s", positive=True)
    sp_neg = sp.Symbol("s", negative=True)
    k = sp.Symbol("k", integer=True, nonnegative=True)
    # int_0^s e^t dt = s * int_0^1 e^{s w} dw: the integrand is positive, so the sign is sign(s).
    w = sp.Symbol("w", real=True)
    return {
        "integrand_positive": sp.exp(t * s).is_positive,
        "series_terms_positive": (sp_pos**k / sp.factorial(k + 1)).is_positive,
        "series_first_term_is_1": bool(rho_series(sp_pos, 1) == 1),
        "exp_positive": sp.exp(s).is_positive,
        "expm1_sign_positive": (sp_pos * sp.exp(sp_pos * w)).is_positive,
        "expm1_sign_negative": (sp_neg * sp.exp(sp_neg * w)).is_negative,
    }


# =============================================================================================
# section 3: the identity and the gradient step
# =============================================================================================
@dataclass(frozen=True)
class SymbolicHead:
    """One query of one head with symbolic entries: ``u`` (D,1), ``a_j`` (D,1), ``v_j`` (1,r)."""

    u: sp.Matrix
    a: tuple[sp.Matrix, ...]
    v: tuple[sp.Matrix, ...]

    @property
    def n_keys(self) -> int:
        return len(self.a)

    def symbols(self) -> list[sp.Symbol]:
        """All free symbols in a fixed order (query, then features, then values) for lambdify."""
        out = list(self.u)
        for aj in self.a:
            out += list(aj)
        for vj in self.v:
            out += list(vj)
        return out


def _column(name: str, dim: int) -> sp.Matrix:
    return sp.Matrix(dim, 1, [sp.Symbol(f"{name}_{i}", real=True) for i in range(dim)])


def _row(name: str, r: int) -> sp.Matrix:
    return sp.Matrix(1, r, [sp.Symbol(f"{name}_{i}", real=True) for i in range(r)])


def symbolic_head(n_keys: int, dim: int = 2, r: int = 1, *, query: str = "u",
                  feature: str = "a", value: str = "v") -> SymbolicHead:
    """A head with ``n_keys`` keys, augmented dimension ``dim = m + 1`` and value dimension ``r``,
    every entry an independent real symbol (``u_0``, ``a1_0``, ``v1_0``, ...)."""
    return SymbolicHead(
        u=_column(query, dim),
        a=tuple(_column(f"{feature}{j}", dim) for j in range(n_keys)),
        v=tuple(_row(f"{value}{j}", r) for j in range(n_keys)),
    )


def _dot(u: sp.Matrix, a: sp.Matrix) -> sp.Expr:
    return (u.T * a)[0, 0]


def scores(u: sp.Matrix, a: Sequence[sp.Matrix]) -> list[sp.Expr]:
    """``s_j = u^T a_j``."""
    return [_dot(u, aj) for aj in a]


def partition(u: sp.Matrix, a: Sequence[sp.Matrix]) -> sp.Expr:
    """``Z = sum_j e^{s_j}``."""
    return sp.Add(*[sp.exp(s) for s in scores(u, a)])


def _sum_rows(rows: Iterable[sp.Matrix], shape: tuple[int, int]) -> sp.Matrix:
    total = sp.zeros(*shape)
    for x in rows:
        total += x
    return total


def softmax_output(u: sp.Matrix, a: Sequence[sp.Matrix], v: Sequence[sp.Matrix]) -> sp.Matrix:
    """``y = sum_j e^{s_j} v_j / Z`` -- the head output, softmax intact.  ``(1, r)``"""
    s = scores(u, a)
    z = sp.Add(*[sp.exp(x) for x in s])
    return _sum_rows((sp.exp(x) * vj for x, vj in zip(s, v)), v[0].shape) / z


def uniform_mean(v: Sequence[sp.Matrix]) -> sp.Matrix:
    """``mu = (1/N) sum_j v_j`` -- the uniform mean.  ``(1, r)``"""
    return _sum_rows(v, v[0].shape) / len(v)


def step_weights(u: sp.Matrix, a: Sequence[sp.Matrix],
                 phi: Callable[[sp.Expr], sp.Expr] = rho) -> list[sp.Expr]:
    """``c_j = phi(s_j) / Z`` with ``phi = rho`` (the paper's weights)."""
    z = partition(u, a)
    return [phi(s) / z for s in scores(u, a)]


def delta_m(u: sp.Matrix, a: Sequence[sp.Matrix], v: Sequence[sp.Matrix], *,
            mu: sp.Matrix | None = None, weights: Sequence[sp.Expr] | None = None) -> sp.Matrix:
    """``delta_m = sum_j c_j a_j (v_j - mu)``, ``(D, r)``; defaults: uniform ``mu``, ``c_j = rho(s_j)/Z``."""
    mu = uniform_mean(v) if mu is None else mu
    c = step_weights(u, a) if weights is None else weights
    return _sum_rows((cj * aj * (vj - mu) for cj, aj, vj in zip(c, a, v)),
                     (a[0].shape[0], v[0].shape[1]))


def readout(u: sp.Matrix, dm: sp.Matrix, mu: sp.Matrix) -> sp.Matrix:
    """``mu + u^T delta_m``.  ``(1, r)``"""
    return mu + u.T * dm


def identity_residual(u: sp.Matrix, a: Sequence[sp.Matrix], v: Sequence[sp.Matrix]) -> sp.Matrix:
    """``y - mu - u^T delta_m`` -- exactly zero (docs/math.md section 3).  ``(1, r)``"""
    mu = uniform_mean(v)
    return softmax_output(u, a, v) - readout(u, delta_m(u, a, v, mu=mu), mu)


def wrong_identity_softmax_mean(u, a, v) -> sp.Matrix:
    """WRONG: centre on the softmax mean ``y`` instead of the uniform mean.  Not identically 0."""
    y = softmax_output(u, a, v)
    return y - readout(u, delta_m(u, a, v, mu=y), y)


def wrong_identity_exp_weights(u, a, v) -> sp.Matrix:
    """WRONG: weights ``e^{s_j}/Z`` in place of ``rho(s_j)/Z``.  Not identically 0."""
    mu = uniform_mean(v)
    dm = delta_m(u, a, v, mu=mu, weights=step_weights(u, a, phi=sp.exp))
    return softmax_output(u, a, v) - readout(u, dm, mu)


# ---------------------------------------------------------------------------------------------
# the general-N proof over symbolic sums
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProofStep:
    """One equality ``lhs == rhs`` of a stepwise proof, with the fact that justifies it."""

    name: str
    lhs: sp.Expr
    rhs: sp.Expr
    reason: str

    def residual(self) -> sp.Expr:
        return self.lhs - self.rhs


def _flatten_nested_sums(expr: sp.Expr) -> sp.Expr:
    """``Sum(f * Sum(g, inner), outer) -> Sum(f g, inner, outer)`` when ``f`` is free of the inner
    index (pulling a constant factor into a finite sum)."""

    def is_nested(e):
        return isinstance(e, sp.Sum) and any(isinstance(t, sp.Sum) for t in sp.Mul.make_args(e.function))

    def rule(e):
        inner = [t for t in sp.Mul.make_args(e.function) if isinstance(t, sp.Sum)]
        if len(inner) != 1:
            return e
        rest = e.function / inner[0]
        if any(lim[0] in rest.free_symbols for lim in inner[0].limits):
            raise ValueError("factor depends on the inner summation index")
        return sp.Sum(rest * inner[0].function, *inner[0].limits, *e.limits)

    return expr.replace(is_nested, rule)


def general_identity_proof() -> tuple[ProofStep, ...]:
    """The identity for any number of keys ``N`` and any dimension ``D``, over symbolic sums.

    Scalar values ``v_j`` (each value coordinate separately: the identity is coordinatewise), scores
    ``s_j``, ``E_j = e^{s_j}``, ``Z = sum_j E_j``, ``mu`` the uniform mean, ``c_j = rho(s_j)/Z``,
    ``s_j = sum_l u_l a_{lj}``, ``delta_m_l = sum_j c_j a_{lj} (v_j - mu)``.  The chain
    ``y - mu = ... = sum_l u_l delta_m_l`` is the composition of the steps; each step is checked by
    :func:`check_proof_step`.
    """
    j, l = sp.symbols("j l", integer=True, positive=True)
    n, d = sp.symbols("N D", integer=True, positive=True)
    v, s, u, a = (sp.IndexedBase(x) for x in ("v", "s", "u", "a"))
    mu = sp.Symbol("mu", real=True)
    e = sp.exp(s[j])
    z = sp.Sum(e, (j, 1, n))
    c = rho(s[j]) / z
    score_def = sp.Sum(u[l] * a[l, j], (l, 1, d))
    return (
        ProofStep("mean", mu, sp.Sum(v[j], (j, 1, n)) / n, "definition of the uniform mean"),
        ProofStep("centred_sum_zero", sp.Sum(v[j] - sp.Sum(v[j], (j, 1, n)) / n, (j, 1, n)), sp.Integer(0),
                  "the centred values sum to zero"),
        ProofStep("weights_sum_to_one", sp.Sum(e * v[j], (j, 1, n)) / z - mu,
                  sp.Sum(e * (v[j] - mu), (j, 1, n)) / z, "sum_j E_j / Z = 1"),
        ProofStep("subtract_zero", sp.Sum(e * (v[j] - mu), (j, 1, n)),
                  sp.Sum((e - 1) * (v[j] - mu), (j, 1, n)), "centred_sum_zero"),
        ProofStep("expm1_is_s_rho", sp.Sum((e - 1) * (v[j] - mu), (j, 1, n)) / z,
                  sp.Sum(s[j] * c * (v[j] - mu), (j, 1, n)), "e^s - 1 = s rho(s)"),
        ProofStep("score_is_linear", sp.Sum(score_def * c * (v[j] - mu), (j, 1, n)),
                  sp.Sum(u[l] * sp.Sum(c * a[l, j] * (v[j] - mu), (j, 1, n)), (l, 1, d)),
                  "s_j = u^T a_j; exchange of finite sums gives u^T delta_m"),
    )


def _normalize_sums(expr: sp.Expr) -> sp.Expr:
    """Linear normal form of finite sums: expand each summand, split it into one sum per term,
    and pull out every factor free of the summation indices (``free_symbols``, so a bound index
    inside a nested ``Z = Sum(...)`` does not count); ``Sum(c, (j, lo, hi)) -> (hi - lo + 1) c``."""

    def split(s: sp.Sum) -> sp.Expr:
        idx = {lim[0] for lim in s.limits}
        out = []
        for term in sp.Add.make_args(sp.expand(_normalize_sums(s.function))):
            inside, outside = [], []
            for f in sp.Mul.make_args(term):
                (inside if f.free_symbols & idx else outside).append(f)
            body = sp.Mul(*inside)
            if body == 1:
                count = sp.Mul(*[hi - lo + 1 for _, lo, hi in s.limits])
                out.append(sp.Mul(*outside) * count)
            else:
                out.append(sp.Mul(*outside) * sp.Sum(body, *s.limits))
        return sp.Add(*out)

    return expr.replace(lambda e: isinstance(e, sp.Sum), split)


def check_proof_step(step: ProofStep) -> sp.Expr:
    """Reduce ``step.residual()`` with the facts established before it; 0 when the step holds.

    Sums are put in a linear normal form (:func:`_normalize_sums`); ``mean`` holds by definition
    (``mu`` names the right side) and later steps use it as the rewriting ``sum_j v_j -> N mu``.
    ``score_is_linear`` first pulls the constant factor into the inner sum and exchanges the two
    finite sums (``Sum.reorder``).  The result is the expanded numerator of the residual.
    """
    j = sp.Symbol("j", integer=True, positive=True)
    n = sp.Symbol("N", integer=True, positive=True)
    v = sp.IndexedBase("v")
    mu = sp.Symbol("mu", real=True)
    if step.name == "mean":
        return sp.Integer(0) if step.lhs == mu else step.residual()
    if step.name == "score_is_linear":
        lhs = _flatten_nested_sums(step.lhs)
        rhs = _flatten_nested_sums(step.rhs)
        # rhs = Sum(., (j..), (l..)); exchanging the two finite sums puts it in lhs's order.
        residual = lhs - rhs.reorder((0, 1))
    else:
        residual = step.residual()
    r = _normalize_sums(residual)
    r = r.subs(sp.Sum(v[j], (j, 1, n)), n * mu)
    return sp.expand(sp.fraction(sp.together(r))[0])


# ---------------------------------------------------------------------------------------------
# the gradient step
# ---------------------------------------------------------------------------------------------
def step_energy(b: sp.Matrix, a: Sequence[sp.Matrix], v: Sequence[sp.Matrix], mu: sp.Matrix,
                weights: Sequence[sp.Expr], half: sp.Expr = sp.Rational(1, 2)) -> sp.Expr:
    """``E(B) = 1/2 sum_j c_j ||a_j^T B - (v_j - mu)||^2``; ``B`` is ``(D, r)``.

    ``half`` exists only so the wrong statement (no 1/2) can be built from the same code.
    """
    total = sp.Integer(0)
    for cj, aj, vj in zip(weights, a, v):
        res = aj.T * b - (vj - mu)  # (1, r)
        total += cj * (res * res.T)[0, 0]
    return half * total


def energy_gradient(energy: sp.Expr, b: sp.Matrix) -> sp.Matrix:
    """``dE/dB`` as a matrix of the shape of ``B``."""
    return b.applyfunc(lambda x: sp.diff(energy, x))


def energy_hessian(energy: sp.Expr, b: sp.Matrix) -> sp.Matrix:
    """Hessian of ``E`` on ``vec(B)``, ``vec`` stacking the rows of ``B`` (C order)."""
    flat = list(b)  # sympy Matrix iterates row-major
    return sp.hessian(energy, flat)


def feature_gram(a: Sequence[sp.Matrix], weights: Sequence[sp.Expr]) -> sp.Matrix:
    """``H = sum_j c_j a_j a_j^T``.  ``(D, D)``"""
    return _sum_rows((cj * aj * aj.T for cj, aj in zip(weights, a)), (a[0].shape[0],) * 2)


def descent_change(g: sp.Matrix, h: sp.Matrix) -> sp.Expr:
    """``E(0 - grad) - E(0)`` for ``grad = -G``: ``-||G||_F^2 + 1/2 tr(G^T H G)``.

    With ``G = delta_m`` the unit step decreases ``E`` iff this is negative; since
    ``tr(G^T H G) <= lambda_max(H) ||G||_F^2`` it is ``<= (lambda_max/2 - 1) ||G||_F^2``, negative
    when ``lambda_max(H) < 2`` (:func:`trace_bound_residuals`).
    """
    return -(g.T * g).trace() + sp.Rational(1, 2) * (g.T * h * g).trace()


def _b_matrix(dim: int, r: int) -> sp.Matrix:
    return sp.Matrix(dim, r, lambda i, k: sp.Symbol(f"B_{i}{k}", real=True))


def _generic_weights(n: int) -> list[sp.Symbol]:
    return [sp.Symbol(f"c_{j}", positive=True) for j in range(n)]


def gradient_residual(u, a, v, *, generic_weights: bool = False) -> sp.Matrix:
    """``grad E(0) + delta_m`` -- zero: ``delta_m = 0 - 1 * grad E(0)``.  ``(D, r)``

    ``generic_weights=True`` uses independent positive symbols for ``c_j`` (the statement holds for
    any weights); otherwise the paper's ``c_j = rho(s_j)/Z``.
    """
    mu = uniform_mean(v)
    c = _generic_weights(len(a)) if generic_weights else step_weights(u, a)
    b = _b_matrix(a[0].shape[0], v[0].shape[1])
    grad0 = energy_gradient(step_energy(b, a, v, mu, c), b).subs({x: 0 for x in b})
    return grad0 + delta_m(u, a, v, mu=mu, weights=c)


def wrong_gradient_without_half(u, a, v) -> sp.Matrix:
    """WRONG: ``E`` without the 1/2 has gradient ``-2 delta_m``.

    Returns ``grad + delta_m`` (``= -delta_m``, not identically 0)."""
    mu = uniform_mean(v)
    c = step_weights(u, a)
    b = _b_matrix(a[0].shape[0], v[0].shape[1])
    energy = step_energy(b, a, v, mu, c, half=sp.Integer(1))
    grad0 = energy_gradient(energy, b).subs({x: 0 for x in b})
    return grad0 + delta_m(u, a, v, mu=mu, weights=c)


def hessian_residual(a, v, *, weights: Sequence[sp.Expr] | None = None) -> sp.Matrix:
    """``Hess E - H (x) I_r`` on row-stacked ``vec(B)`` -- zero.  ``(D r, D r)``"""
    c = _generic_weights(len(a)) if weights is None else weights
    mu = uniform_mean(v)
    dim, r = a[0].shape[0], v[0].shape[1]
    b = _b_matrix(dim, r)
    hess = energy_hessian(step_energy(b, a, v, mu, c), b)
    return hess - sp.kronecker_product(feature_gram(a, c), sp.eye(r))


def descent_residual(u, a, v, *, generic_weights: bool = True) -> sp.Expr:
    """``E(-grad E(0)) - E(0) - descent_change(delta_m, H)`` -- zero (``E`` is quadratic in ``B``)."""
    mu = uniform_mean(v)
    c = _generic_weights(len(a)) if generic_weights else step_weights(u, a)
    b = _b_matrix(a[0].shape[0], v[0].shape[1])
    energy = step_energy(b, a, v, mu, c)
    grad0 = energy_gradient(energy, b).subs({x: 0 for x in b})
    at = dict(zip(list(b), list(-grad0)))
    change = energy.subs(at, simultaneous=True) - energy.subs({x: 0 for x in b})
    return change - descent_change(delta_m(u, a, v, mu=mu, weights=c), feature_gram(a, c))


def gram_psd_residual(a: Sequence[sp.Matrix], x: sp.Matrix) -> sp.Expr:
    """``x^T H x - sum_j c_j (a_j^T x)^2`` -- zero, so ``H`` is PSD when every ``c_j > 0``."""
    c = _generic_weights(len(a))
    quad = (x.T * feature_gram(a, c) * x)[0, 0]
    return quad - sp.Add(*[cj * _dot(x, aj) ** 2 for cj, aj in zip(c, a)])


def trace_bound_residuals(r: int = 2) -> dict[str, sp.Expr]:
    """``tr(G^T H G) <= lambda_max ||G||_F^2`` for a symmetric 2x2 ``H``, as identities.

    ``H = Q diag(l1, l2) Q^T`` with a rotation ``Q`` (spectral theorem; ``l1 = lambda_max``) and
    ``W = Q^T G``:

    ``spectral``    ``tr(G^T H G) - (l1 ||W_1||^2 + l2 ||W_2||^2)``
    ``orthogonal``  ``||W||_F^2 - ||G||_F^2``
    ``gap``         ``l1 ||G||_F^2 - tr(G^T H G) - (l1 - l2) ||W_2||^2``  (a sum of squares times
                    ``l1 - l2 >= 0``: the bound)
    ``descent``     ``descent_change(G, H) - (l1/2 - 1) ||G||_F^2 + 1/2 (l1 - l2) ||W_2||^2``
    All reduce to 0.  The same argument works in any dimension (rows of ``W`` per eigenvalue).
    """
    l1, l2, theta = sp.symbols("lambda_1 lambda_2 theta", real=True)
    q = sp.Matrix([[sp.cos(theta), -sp.sin(theta)], [sp.sin(theta), sp.cos(theta)]])
    h = q * sp.diag(l1, l2) * q.T
    g = sp.Matrix(2, r, lambda i, k: sp.Symbol(f"G_{i}{k}", real=True))
    w = q.T * g
    row_sq = [(w[i, :] * w[i, :].T)[0, 0] for i in range(2)]
    frob_g = (g.T * g).trace()
    quad = (g.T * h * g).trace()
    return {
        "spectral": quad - (l1 * row_sq[0] + l2 * row_sq[1]),
        "orthogonal": row_sq[0] + row_sq[1] - frob_g,
        "gap": l1 * frob_g - quad - (l1 - l2) * row_sq[1],
        "descent": descent_change(g, h) - (l1 / 2 - 1) * frob_g + (l1 - l2) * row_sq[1] / 2,
    }


def lambda_max_2x2(h: sp.Matrix) -> sp.Expr:
    """Largest eigenvalue of a symmetric 2x2 matrix: ``(p+w)/2 + sqrt(((p-w)/2)^2 + q^2)``."""
    p, q, w = h[0, 0], h[0, 1], h[1, 1]
    return (p + w) / 2 + sp.sqrt(((p - w) / 2) ** 2 + q**2)


def descent_counterexample(alpha: sp.Expr | None = None) -> dict[str, sp.Expr]:
    """A one-dimensional head whose unit step *increases* ``E`` (``lambda_max(H) > 2``).

    ``D = 1`` (``u = [1]``: bias coordinate only), two keys ``a_1 = alpha``, ``a_2 = -alpha``,
    values ``v_1 = 1``, ``v_2 = -1`` (``mu = 0``).  Then ``c_1 + c_2 = tanh(alpha)/alpha``,
    ``delta_m = tanh(alpha)``, ``H = alpha tanh(alpha)`` and
    ``E(delta_m) - E(0) = tanh(alpha)^2 (alpha tanh(alpha)/2 - 1)``: positive once
    ``alpha tanh(alpha) > 2`` (``alpha = 3``: ``H ~ 2.985``).  Returns the pieces and residuals
    (``*_residual`` reduce to 0).
    """
    alpha = sp.Symbol("alpha", positive=True) if alpha is None else alpha
    u = sp.Matrix([[1]])
    a = (sp.Matrix([[alpha]]), sp.Matrix([[-alpha]]))
    v = (sp.Matrix([[1]]), sp.Matrix([[-1]]))
    mu = uniform_mean(v)
    c = step_weights(u, a)
    b = _b_matrix(1, 1)
    energy = step_energy(b, a, v, mu, c)
    dm = delta_m(u, a, v, mu=mu, weights=c)
    h = feature_gram(a, c)
    change = energy.subs(b[0, 0], dm[0, 0]) - energy.subs(b[0, 0], 0)
    th = sp.tanh(alpha)
    closed = th**2 * (alpha * th / 2 - 1)
    return {
        "alpha": alpha, "H": h[0, 0], "delta_m": dm[0, 0], "change": change, "closed_change": closed,
        "H_residual": h[0, 0] - alpha * th,
        "delta_m_residual": dm[0, 0] - th,
        "identity_residual": identity_residual(u, a, v)[0, 0],
        "change_residual": change - closed,
        "formula_residual": change - descent_change(dm, h),
    }


# =============================================================================================
# section 4: gauges
# =============================================================================================
def gauge_weights(u, a, g: sp.Matrix) -> list[sp.Expr]:
    """``c^g_j = e^sigma rho(s_j - sigma) / Z``, ``sigma = u^T g``."""
    sigma = _dot(u, g)
    z = partition(u, a)
    return [sp.exp(sigma) * rho(s - sigma) / z for s in scores(u, a)]


def gauge_delta_m(u, a, v, g: sp.Matrix) -> sp.Matrix:
    """``delta_m^g = sum_j c^g_j (a_j - g)(v_j - mu)``.  ``(D, r)``"""
    mu = uniform_mean(v)
    c = gauge_weights(u, a, g)
    return _sum_rows((cj * (aj - g) * (vj - mu) for cj, aj, vj in zip(c, a, v)),
                     (a[0].shape[0], v[0].shape[1]))


def gauge_residual(u, a, v, g: sp.Matrix) -> sp.Matrix:
    """``u^T delta_m^g - u^T delta_m`` -- zero for every ``g``.  ``(1, r)``"""
    return u.T * gauge_delta_m(u, a, v, g) - u.T * delta_m(u, a, v)


def maxkey_gauge_residuals(u, a) -> list[sp.Expr]:
    """For ``g = a_k`` (each ``k``): ``c^g_j - rho(s_j - s_k)/Zbar_k``, ``Zbar_k = sum_j e^{s_j - s_k}``.

    The max-key gauge is ``k = argmax_j s_j`` (then ``Zbar in [1, N]``); the identity of weights
    holds for every ``k``.  Each entry reduces to 0.
    """
    s = scores(u, a)
    out = []
    for k, ak in enumerate(a):
        zbar = sp.Add(*[sp.exp(x - s[k]) for x in s])
        out += [cg - rho(x - s[k]) / zbar for cg, x in zip(gauge_weights(u, a, ak), s)]
    return out


def pairwise_delta_m(u, a, v) -> sp.Matrix:
    """``delta_m^pair = 1/(2 N Z) sum_{j,k} exp[s_j, s_k] (a_j - a_k)(v_j - v_k)``; ``j = k`` terms
    vanish (``a_j - a_j = 0``) and are skipped.  ``(D, r)``"""
    s = scores(u, a)
    n = len(a)
    z = partition(u, a)
    terms = (exp_dd(s[j], s[k]) * (a[j] - a[k]) * (v[j] - v[k])
             for j, k in itertools.permutations(range(n), 2))
    return _sum_rows(terms, (a[0].shape[0], v[0].shape[1])) / (2 * n * z)


def pairwise_residual(u, a, v) -> sp.Matrix:
    """``u^T delta_m^pair - u^T delta_m`` -- zero.  ``(1, r)``"""
    return u.T * pairwise_delta_m(u, a, v) - u.T * delta_m(u, a, v)


def pairwise_translation_residual(u, a, v, t: sp.Matrix) -> sp.Matrix:
    """``delta_m^pair(a + t) - delta_m^pair(a)`` -- zero: the pairwise matrix ignores a common
    translation of the features (``exp[s+c, s'+c] = e^c exp[s, s']`` and ``Z -> e^c Z``)."""
    moved = tuple(aj + t for aj in a)
    return pairwise_delta_m(u, moved, v) - pairwise_delta_m(u, a, v)


# =============================================================================================
# section 5: RoPE derivatives and exact positional finite differences
# =============================================================================================
J2 = sp.ImmutableMatrix([[0, -1], [1, 0]])


def phi1_rot(alpha: sp.Expr) -> sp.Matrix:
    """Closed form ``phi_1(alpha J2) = (sin a/a) I + ((1 - cos a)/a) J2`` (``alpha != 0``)."""
    return sp.sin(alpha) / alpha * sp.eye(2) + (1 - sp.cos(alpha)) / alpha * sp.Matrix(J2)


def phi1_rot_series(alpha: sp.Expr, order: int) -> sp.Matrix:
    """``sum_{k < order} (alpha J2)^k / (k+1)!`` -- the series of ``phi_1`` at the matrix."""
    m = alpha * sp.Matrix(J2)
    return _sum_rows((m**k / sp.factorial(k + 1) for k in range(order)), (2, 2))


def phi1_matrix_integral(m: sp.Matrix) -> sp.Matrix:
    """``phi_1(M) = int_0^1 e^{tM} dt`` via SymPy's matrix exponential and ``integrate``."""
    t = sp.Symbol("t", real=True)
    return (t * m).exp().applyfunc(lambda e: sp.integrate(e, (t, 0, 1)))


def rope_generator(omegas: Sequence[sp.Expr]) -> sp.Matrix:
    """``A = diag_l omega_l J2`` (interleaved pair layout).  ``(2L, 2L)``"""
    return sp.diag(*[w * sp.Matrix(J2) for w in omegas])


def rope_rotation(p: sp.Expr, omegas: Sequence[sp.Expr]) -> sp.Matrix:
    """``R(p) = e^{pA}``: 2x2 rotations by ``p omega_l`` on the diagonal.  ``(2L, 2L)``"""
    return sp.diag(*[sp.Matrix([[sp.cos(p * w), -sp.sin(p * w)], [sp.sin(p * w), sp.cos(p * w)]])
                     for w in omegas])


def phi1_rope(delta: sp.Expr, omegas: Sequence[sp.Expr]) -> sp.Matrix:
    """``phi_1(delta A)``, block ``l`` the closed form at ``alpha_l = omega_l delta``."""
    return sp.diag(*[phi1_rot(w * delta) for w in omegas])


def rope_facts(order: int = 10) -> dict[str, sp.Matrix]:
    """Residual matrices of docs/math.md section 5 (two frequencies ``omega_1, omega_2``); all reduce to 0.

    ``phi1_integral``     ``int_0^1 e^{t alpha J2} dt - phi1_rot(alpha)``
    ``phi1_series``       Taylor polynomial of ``phi1_rot`` minus ``sum_{k<order} (alpha J2)^k/(k+1)!``
    ``phi1_secant``       ``alpha J2 phi1_rot(alpha) - (e^{alpha J2} - I)``
    ``rotation_is_exp``   ``(pA).exp() - rope_rotation(p)``
    ``finite_difference`` ``e^{delta A} - I - delta A phi_1(delta A)``
    ``position_step``     ``z(p + delta) - z(p) - delta A phi_1(delta A) z(p)``, ``z(p) = R(p) z_0``
    ``derivative_1..3``   ``d^n/dp^n R(p) z_0 - A^n R(p) z_0``
    ``relative_position`` ``R(p_i)^T R(p_j) - R(p_j - p_i)``
    ``orthogonal``        ``R(p)^T R(p) - I``
    """
    alpha = sp.Symbol("alpha", real=True, nonzero=True)
    omegas = sp.symbols("omega_1 omega_2", positive=True)
    p, p_i, p_j = sp.symbols("p p_i p_j", real=True)
    delta = sp.Symbol("delta", real=True, nonzero=True)
    j2 = sp.Matrix(J2)
    a_mat = rope_generator(omegas)
    z0 = _column("z0", 2 * len(omegas))
    closed = phi1_rot(alpha)
    closed_taylor = closed.applyfunc(lambda e: sp.series(e, alpha, 0, order).removeO())
    rot = rope_rotation(p, omegas)
    fd = phi1_rope(delta, omegas)
    out = {
        "phi1_integral": phi1_matrix_integral(alpha * j2) - closed,
        "phi1_series": (closed_taylor - phi1_rot_series(alpha, order)).applyfunc(sp.expand),
        "phi1_secant": alpha * j2 * closed - ((alpha * j2).exp() - sp.eye(2)),
        "rotation_is_exp": (p * a_mat).exp() - rot,
        "finite_difference": rope_rotation(delta, omegas) - sp.eye(4) - delta * a_mat * fd,
        "position_step": rope_rotation(p + delta, omegas) * z0 - rot * z0 - delta * a_mat * fd * rot * z0,
        "relative_position": rope_rotation(p_i, omegas).T * rope_rotation(p_j, omegas)
        - rope_rotation(p_j - p_i, omegas),
        "orthogonal": rot.T * rot - sp.eye(4),
    }
    for n in (1, 2, 3):
        out[f"derivative_{n}"] = sp.diff(rot * z0, p, n) - a_mat**n * rot * z0
    return out


# =============================================================================================
# section 6: frozen reuse
# =============================================================================================
def frozen_reuse_error(u_i, u_0, a, v) -> sp.Matrix:
    """``e_i = y_i - (mu + u_i^T delta_m_0)``: the error of reusing the anchor's matrix.  ``(1, r)``"""
    mu = uniform_mean(v)
    return softmax_output(u_i, a, v) - readout(u_i, delta_m(u_0, a, v, mu=mu), mu)


def frozen_reuse_tokenwise(u_i, u_0, a, v) -> sp.Matrix:
    """``sum_j (c_ij - c_0j)(u_i^T a_j)(v_j - mu)`` -- equals :func:`frozen_reuse_error`.  ``(1, r)``"""
    mu = uniform_mean(v)
    ci, c0 = step_weights(u_i, a), step_weights(u_0, a)
    return _sum_rows(((x - y) * _dot(u_i, aj) * (vj - mu) for x, y, aj, vj in zip(ci, c0, a, v)),
                     v[0].shape)


def frozen_refresh(u_i, u_0, l_mat: sp.Matrix, k: Sequence[sp.Matrix],
                   v) -> tuple[sp.Matrix, sp.Matrix]:
    """``(delta_m_i - delta_m_0, L sum_j (c_ij - c_0j) k_j^T (v_j - mu))`` with ``a_j = L k_j^T``.

    ``L`` is ``(D, d)``, ``k_j`` rows ``(1, d)``.  The two ``(D, r)`` matrices are equal.
    """
    a = tuple(l_mat * kj.T for kj in k)
    mu = uniform_mean(v)
    ci, c0 = step_weights(u_i, a), step_weights(u_0, a)
    direct = delta_m(u_i, a, v, mu=mu) - delta_m(u_0, a, v, mu=mu)
    inner = _sum_rows(((x - y) * kj.T * (vj - mu) for x, y, kj, vj in zip(ci, c0, k, v)),
                      (l_mat.shape[1], v[0].shape[1]))
    return direct, l_mat * inner


def prefix_full_residuals(u, a, v, a_self: sp.Matrix, v_self: sp.Matrix) -> dict[str, sp.Matrix]:
    """Prefix bank ``(a, v)`` plus the query's own key ``(a_self, v_self)``; all reduce to 0.

    ``mixture``    ``y_full - ((1 - pi) y_prefix + pi v_self)``, ``pi = e^{s_self}/(Z_prefix + e^{s_self})``
    ``full_mean``  ``uniform_mean(full bank) - (N mu + v_self)/(N + 1)``
    ``full_identity`` ``y_full - (mu_full + u^T delta_m_full)`` with ``mu_full`` the full-bank mean
    (the prefix mean in its place fails: see ``wrong_prefix_mean`` in the tests).
    """
    n = len(a)
    full_a, full_v = tuple(a) + (a_self,), tuple(v) + (v_self,)
    s_self = _dot(u, a_self)
    pi = sp.exp(s_self) / (partition(u, a) + sp.exp(s_self))
    y_full = softmax_output(u, full_a, full_v)
    mu, mu_full = uniform_mean(v), uniform_mean(full_v)
    return {
        "mixture": y_full - ((1 - pi) * softmax_output(u, a, v) + pi * v_self),
        "full_mean": mu_full - (n * mu + v_self) / (n + 1),
        "full_identity": y_full - readout(u, delta_m(u, full_a, full_v, mu=mu_full), mu_full),
        "wrong_prefix_mean": y_full - readout(u, delta_m(u, full_a, full_v, mu=mu), mu),
    }


# =============================================================================================
# section 7: no global affine readout
# =============================================================================================
def convex_combination_residuals(u, a, v) -> dict[str, object]:
    """``y`` is a convex combination of the values: ``p_j = e^{s_j}/Z > 0``, ``sum p_j = 1``.

    ``weights_sum``  ``sum_j p_j - 1``                        (reduces to 0)
    ``combination``  ``y - sum_j p_j v_j``                    (reduces to 0)
    ``positive``     ``[p_j.is_positive]``                   (all True for real scores)
    ``above_min``    ``y - v_min - sum_j p_j (v_j - v_min)``  for a symbolic ``v_min`` (reduces to 0;
                     each summand is ``>= 0`` when ``v_min <= v_j``, so ``y >= min_j v_j``;
                     likewise ``y <= max_j v_j``)
    """
    s = scores(u, a)
    z = partition(u, a)
    p = [sp.exp(x) / z for x in s]
    y = softmax_output(u, a, v)
    r = v[0].shape[1]
    vmin = _row("vmin", r)
    return {
        "weights_sum": sp.Add(*p) - 1,
        "combination": y - _sum_rows((pj * vj for pj, vj in zip(p, v)), v[0].shape),
        "positive": [pj.is_positive for pj in p],
        "above_min": y - vmin - _sum_rows((pj * (vj - vmin) for pj, vj in zip(p, v)), v[0].shape),
    }


def two_key_family() -> dict[str, sp.Expr]:
    """One-dimensional ``x``, ``u = [x; 1]``, keys ``a_j = [alpha_j; beta_j]``, scalar values.

    ``alpha_1 - alpha_2 = d > 0`` (keys that separate along ``x``), ``v_1 != v_2``; a fixed
    affine readout ``mu + u^T M`` with ``M = [m1; m0]``.  Returns the symbols, ``y(x)`` and the
    residual ``y(x) - mu - x m1 - m0``.
    """
    x = sp.Symbol("x", real=True)
    alpha2, beta1, beta2, v1, v2, m1, m0 = sp.symbols("alpha_2 beta_1 beta_2 v_1 v_2 m_1 m_0", real=True)
    d = sp.Symbol("d", positive=True)
    u = sp.Matrix([x, 1])
    a = (sp.Matrix([alpha2 + d, beta1]), sp.Matrix([alpha2, beta2]))
    v = (sp.Matrix([[v1]]), sp.Matrix([[v2]]))
    y = softmax_output(u, a, v)[0, 0]
    mu = uniform_mean(v)[0, 0]
    return {"x": x, "d": d, "alpha_2": alpha2, "beta_1": beta1, "beta_2": beta2, "v_1": v1,
            "v_2": v2, "m_1": m1, "m_0": m0, "u": u, "a": a, "v": v, "y": y, "mu": mu,
            "residual": y - mu - x * m1 - m0}


def affine_readout_limits() -> dict[str, sp.Expr]:
    """Limits that refute every fixed ``M`` for the two-key family (:func:`two_key_family`).

    ``logistic_form``: ``y - (v_1 e^g + v_2)/(e^g + 1)``, ``g = s_1 - s_2 = d x + beta_1 - beta_2``
    (reduces to 0; the limits are taken on the right side, where the sign of ``d`` is known);
    ``y_plus``, ``y_minus``: ``lim y`` at ``x -> +oo, -oo`` (``v_1`` and ``v_2``: bounded);
    ``slope``: ``lim residual/x`` at ``+oo`` (``-m1``, so ``m1 = 0`` is forced);
    ``jump``: with ``m1 = 0``, ``lim_{+oo} residual - lim_{-oo} residual`` (``v_1 - v_2 != 0``),
    so the residual is not identically zero for any ``M``;
    ``affine_growth``: the general step -- along ``x = t m1`` (a direction where ``M``'s x-part is
    non-zero, ``m1 != 0``) the affine readout ``mu + m0 + t m1^2`` tends to ``+oo``, so it leaves
    every bounded set, while ``y`` stays in ``[min v, max v]``.
    """
    fam = two_key_family()
    x, y, m1, m0, mu = fam["x"], fam["y"], fam["m_1"], fam["m_0"], fam["mu"]
    g = fam["d"] * x + fam["beta_1"] - fam["beta_2"]
    logistic = (fam["v_1"] * sp.exp(g) + fam["v_2"]) / (sp.exp(g) + 1)
    res = logistic - mu - x * m1 - m0
    flat = res.subs(m1, 0)
    t = sp.Symbol("t", positive=True)
    m1x = sp.Symbol("m_1", real=True, nonzero=True)
    return {
        "logistic_form": y - logistic,
        "y_plus": sp.limit(logistic, x, sp.oo),
        "y_minus": sp.limit(logistic, x, -sp.oo),
        "slope": sp.limit(res / x, x, sp.oo),
        "jump": sp.limit(flat, x, sp.oo) - sp.limit(flat, x, -sp.oo),
        "affine_growth": sp.limit(mu + m0 + t * m1x * m1x, t, sp.oo),
    }


def affine_three_point_system(points: Sequence[int] = (0, 1, 2)):
    """Require ``y(x) = mu + x m1 + m0`` at three points of the concrete family
    (``a_1 = [1; 0]``, ``a_2 = [0; 0]``, ``v = (1, 0)``: ``y = sigmoid(x)``) and solve for
    ``(m1, m0)``: returns ``(equations, solution set)``; the set is empty (three values of a strictly
    convex-or-concave piece of the sigmoid are not collinear; the centre ``x = 0`` must not be the
    middle point)."""
    m1, m0 = sp.symbols("m_1 m_0", real=True)
    x = sp.Symbol("x", real=True)
    u = sp.Matrix([x, 1])
    a = (sp.Matrix([1, 0]), sp.Matrix([0, 0]))
    v = (sp.Matrix([[1]]), sp.Matrix([[0]]))
    y = softmax_output(u, a, v)[0, 0]
    mu = uniform_mean(v)[0, 0]
    eqs = [sp.Eq(y.subs(x, t), mu + t * m1 + m0) for t in points]
    return eqs, sp.linsolve(eqs, [m1, m0])


@dataclass(frozen=True)
class AffineWitness:
    """A query ``u`` at which ``y(u) != mu + u^T M``.

    ``kind``: ``"unbounded"`` (``M`` has a non-zero ``x``-part: the affine readout's coordinate
    ``coord`` equals ``max_j v_j[coord] + margin`` at ``u``, outside the hull that contains ``y``)
    or ``"non_constant"`` (zero ``x``-part: the affine readout is constant and ``y(u)`` differs).
    ``y`` and ``affine`` are exact SymPy rows ``(1, r)``.
    """

    kind: str
    u: sp.Matrix
    y: sp.Matrix
    affine: sp.Matrix
    coord: int


def no_affine_readout_witness(a: Sequence[sp.Matrix], v: Sequence[sp.Matrix], m: sp.Matrix, *,
                              margin: sp.Expr = sp.Integer(1), dps: int = 60) -> AffineWitness:
    """Given a bank (features ``a_j`` (D,1), values ``v_j`` (1,r), exact numbers) and any candidate
    ``M`` (D, r), return a query ``u = [x; 1]`` refuting ``y(u) = mu + u^T M`` (docs/math.md section 7).

    * ``x``-part of ``M`` non-zero in column ``k``: ``x = t M_x[:, k]`` with ``t`` chosen so the
      affine coordinate ``k`` equals ``max_j v_j[k] + margin`` exactly; ``y`` stays in the hull.
    * ``x``-part zero: the readout is the constant ``mu + M_0``; try ``x = 0`` and then
      ``x = +-T (a_j - a_k)_x``, ``T`` in ``1, 4, 16``, until ``y`` differs from the constant
      (decided at ``dps`` digits with a ``10^(-dps/2)`` margin).  A head that is constant on the
      hyperplane has an affine readout and raises ``ValueError``.
    """
    dim, r = a[0].shape[0], v[0].shape[1]
    m = sp.Matrix(m)
    mu = uniform_mean(v)
    mx, m0 = m[: dim - 1, :], m[dim - 1, :]

    def at(x: sp.Matrix) -> tuple[sp.Matrix, sp.Matrix, sp.Matrix]:
        u = sp.Matrix.vstack(x, sp.Matrix([[1]]))
        return u, softmax_output(u, a, v), readout(u, m, mu)

    for k in range(r):
        col = mx[:, k]
        norm2 = (col.T * col)[0, 0]
        if norm2 != 0:
            target = max(vj[0, k] for vj in v) + margin
            t = (target - mu[0, k] - m0[0, k]) / norm2
            u, y, aff = at(t * col)
            return AffineWitness("unbounded", u, y, aff, k)
    const = mu + m0
    tol = sp.Float(10) ** (-(dps // 2))
    candidates = [sp.zeros(dim - 1, 1)]
    for scale in (1, 4, 16):
        for aj, ak in itertools.combinations(a, 2):
            diff = (aj - ak)[: dim - 1, :]
            if any(e != 0 for e in diff):
                candidates += [scale * diff, -scale * diff]
    for x in candidates:
        u, y, aff = at(x)
        for k in range(r):
            if abs(sp.N(y[0, k] - const[0, k], dps)) > tol:
                return AffineWitness("non_constant", u, y, aff, k)
    raise ValueError("no witness: the head is constant on the hyperplane u_{m+1} = 1 "
                     "(an affine readout exists)")


# =============================================================================================
# section 8: the Cosine-RoPE bound
# =============================================================================================
def cosine_bound_residuals(u, a, v, tau: sp.Expr | None = None) -> dict[str, object]:
    """Steps of ``||y - mu|| <= (e^{2/tau} - 1) max_j ||v_j - mu||`` when ``|s_j| <= 1/tau``.

    ``p_j = e^{s_j}/Z``.  Reduce-to-0 residuals:
    ``centred``     ``y - mu - sum_j (p_j - 1/N)(v_j - mu)``   (``sum p_j = 1``, centred values sum to 0)
    ``ratio_form``  ``p_j - 1/sum_k e^{s_k - s_j}``           (each ``s_k - s_j in [-2/tau, 2/tau]``,
                    so ``N e^{-2/tau} <= sum_k e^{s_k - s_j} <= N e^{2/tau}``, i.e.
                    ``p_j in [e^{-2/tau}/N, e^{2/tau}/N]``)
    ``two_sided``   ``(e^{2/tau} - 1) - (1 - e^{-2/tau}) - (e^{1/tau} - e^{-1/tau})^2``  (the upper
                    deviation dominates, so ``|p_j - 1/N| <= (e^{2/tau} - 1)/N``)
    Then ``||y - mu|| <= sum_j |p_j - 1/N| ||v_j - mu|| <= (e^{2/tau} - 1) max_j ||v_j - mu||``
    (triangle inequality; checked numerically in the tests, with :func:`cosine_bound`).
    """
    tau = sp.Symbol("tau", positive=True) if tau is None else tau
    s = scores(u, a)
    z = partition(u, a)
    n = len(a)
    p = [sp.exp(x) / z for x in s]
    mu = uniform_mean(v)
    y = softmax_output(u, a, v)
    return {
        "centred": y - mu - _sum_rows(((pj - sp.Rational(1, n)) * (vj - mu) for pj, vj in zip(p, v)),
                                      v[0].shape),
        "ratio_form": [pj - 1 / sp.Add(*[sp.exp(sk - sj) for sk in s]) for pj, sj in zip(p, s)],
        "two_sided": (sp.exp(2 / tau) - 1) - (1 - sp.exp(-2 / tau))
        - (sp.exp(1 / tau) - sp.exp(-1 / tau)) ** 2,
    }


def cosine_bound(tau: sp.Expr, max_dev: sp.Expr) -> sp.Expr:
    """The bound ``(e^{2/tau} - 1) max_dev`` on ``||y - mu||`` (``max_dev = max_j ||v_j - mu||``)."""
    return (sp.exp(2 / tau) - 1) * max_dev


# =============================================================================================
# section 14: multi-head latent attention
# =============================================================================================
@dataclass(frozen=True)
class LatentHeads:
    """One query of a multi-head latent attention layer (docs/math.md section 14), every entry a
    symbol, in this module's column convention (vectors are columns, values are rows).

    Shared by all heads, per key ``j``: the normed latent ``c_j`` ``(rank, 1)``, the unrotated key
    part ``kr_j`` ``(rope_dim, 1)`` and its rotation ``rot_k[j] = R(p_j)``.  Per head ``h``: the
    query's nope part ``qn[h]`` ``(nope, 1)`` and unrotated rope part ``qr[h]`` ``(rope_dim, 1)``,
    the key map ``w_uk[h]`` ``(nope, rank)`` (``k^n_jh = W_uk[h] c_j``, the layout of
    transformers' ``kv_b_proj`` weight) and the value map ``w_uv[h]`` ``(r, rank)``
    (``v_jh = (W_uv[h] c_j)^T``).  ``rot_q = R(p_i)``; ``scale`` the score scale.

    When the query is a plain projection of the augmented input (no query latent), ``u``
    ``(m+1, 1)`` and ``w_q[h]`` ``(m+1, nope + rope_dim)`` are set and ``[qn; qr] = w_q[h]^T u``.
    How ``c_j`` and ``kr_j`` were computed (an RMS norm, biases) does not enter: they are
    functions of the key's token only, which is all the identity needs.
    """

    qn: tuple[sp.Matrix, ...]
    qr: tuple[sp.Matrix, ...]
    w_uk: tuple[sp.Matrix, ...]
    w_uv: tuple[sp.Matrix, ...]
    c: tuple[sp.Matrix, ...]
    kr: tuple[sp.Matrix, ...]
    rot_q: sp.Matrix
    rot_k: tuple[sp.Matrix, ...]
    scale: sp.Expr
    u: sp.Matrix | None = None
    w_q: tuple[sp.Matrix, ...] | None = None

    @property
    def n_heads(self) -> int:
        return len(self.w_uk)

    @property
    def n_keys(self) -> int:
        return len(self.c)

    def symbols(self) -> list[sp.Symbol]:
        """All free symbols, sorted by name (a fixed order for lambdify)."""
        mats = [*self.qn, *self.qr, *self.w_uk, *self.w_uv, *self.c, *self.kr, self.rot_q,
                *self.rot_k, sp.Matrix([[self.scale]])]
        if self.u is not None:
            mats += [self.u, *self.w_q]
        free: set = set()
        for mt in mats:
            free |= mt.free_symbols
        return sorted(free, key=sp.default_sort_key)


def _sym_matrix(name: str, rows: int, cols: int) -> sp.Matrix:
    return sp.Matrix(rows, cols, lambda i, k: sp.Symbol(f"{name}_{i}{k}", real=True))


def _rotation_blocks(tag: str, rope_dim: int, trig: bool, omegas) -> sp.Matrix:
    """``R(p)`` on ``rope_dim`` dims (adjacent pairs): trig (``rope_rotation`` at a symbolic
    position ``p_tag``) or free symbols ``gamma, sigma`` per pair, ``[[gamma, -sigma], [sigma,
    gamma]]`` (the absorption and the identity never use ``gamma^2 + sigma^2 = 1``)."""
    if rope_dim == 0:
        return sp.zeros(0, 0)
    if trig:
        return rope_rotation(sp.Symbol(f"p_{tag}", real=True), omegas)
    blocks = []
    for ell in range(rope_dim // 2):
        g, s = sp.symbols(f"gamma_{tag}{ell} sigma_{tag}{ell}", real=True)
        blocks.append(sp.Matrix([[g, -s], [s, g]]))
    return sp.diag(*blocks)


def latent_heads(n_heads: int = 2, n_keys: int = 3, *, rank: int = 2, rope_dim: int = 2,
                 nope: int = 2, r: int = 1, m: int | None = None,
                 trig: bool = False) -> LatentHeads:
    """A symbolic :class:`LatentHeads` (docs/math.md section 14).  ``m`` set: the query is the
    projection ``[qn; qr] = w_q[h]^T u`` of an augmented input ``u`` ``(m+1, 1)``; otherwise
    ``qn``, ``qr`` are free symbols (any query, a query latent included).  ``trig``: rotations
    ``R(p) = e^{pA}`` with symbolic positions and frequencies (no exponential of a score may then
    contain them: use it for score-level statements only); otherwise free rotation symbols."""
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even, got {rope_dim}")
    omegas = sp.symbols(f"omega_0:{rope_dim // 2}", positive=True) if trig else ()
    u = w_q = None
    if m is None:
        qn = tuple(_column(f"qn{h}", nope) for h in range(n_heads))
        qr = tuple(_column(f"qr{h}", rope_dim) for h in range(n_heads))
    else:
        u = _column("u", m + 1)
        w_q = tuple(_sym_matrix(f"Wq{h}", m + 1, nope + rope_dim) for h in range(n_heads))
        qn = tuple(w[:, :nope].T * u for w in w_q)
        qr = tuple(w[:, nope:].T * u for w in w_q)
    return LatentHeads(
        qn=qn, qr=qr,
        w_uk=tuple(_sym_matrix(f"Wuk{h}", nope, rank) for h in range(n_heads)),
        w_uv=tuple(_sym_matrix(f"Wuv{h}", r, rank) for h in range(n_heads)),
        c=tuple(_column(f"c{j}", rank) for j in range(n_keys)),
        kr=tuple(_column(f"kr{j}", rope_dim) for j in range(n_keys)),
        rot_q=_rotation_blocks("i", rope_dim, trig, omegas),
        rot_k=tuple(_rotation_blocks(f"k{j}", rope_dim, trig, omegas) for j in range(n_keys)),
        scale=sp.Symbol("lambda", positive=True), u=u, w_q=w_q)


def latent_model_query(lh: LatentHeads, h: int) -> sp.Matrix:
    """The model's query of head ``h``: ``[qn; R(p_i) qr]`` (nope dims, then rope dims)."""
    return sp.Matrix.vstack(lh.qn[h], lh.rot_q * lh.qr[h])


def latent_model_key(lh: LatentHeads, h: int, j: int) -> sp.Matrix:
    """The model's key of head ``h``, token ``j``: ``[W_uk[h] c_j; R(p_j) kr_j]``."""
    return sp.Matrix.vstack(lh.w_uk[h] * lh.c[j], lh.rot_k[j] * lh.kr[j])


def latent_values(lh: LatentHeads, h: int, *, value_head: int | None = None
                  ) -> tuple[sp.Matrix, ...]:
    """Head ``h``'s values ``v_jh = (W_uv[h] c_j)^T`` ``(1, r)`` (``value_head`` overrides which
    head's map is used: only for the wrong statements)."""
    w = lh.w_uv[h if value_head is None else value_head]
    return tuple((w * cj).T for cj in lh.c)


def latent_model_scores(lh: LatentHeads, h: int) -> list[sp.Expr]:
    """``s_jh = scale * q_ih . k_jh`` with the model's per-head query and key."""
    q = latent_model_query(lh, h)
    return [lh.scale * _dot(q, latent_model_key(lh, h, j)) for j in range(lh.n_keys)]


def latent_absorbed_query(lh: LatentHeads, h: int, *, transpose: bool = True,
                          latent_first: bool = False) -> sp.Matrix:
    """The absorbed query ``q'_ih = [R(p_i) qr; W_uk[h]^T qn]`` ``(rope_dim + rank, 1)``.

    ``transpose=False`` (``W_uk qn``, needs ``nope == rank``) and ``latent_first=True`` (the two
    blocks in the wrong order, needs ``rope_dim == rank``) build the wrong absorptions."""
    w = lh.w_uk[h].T if transpose else lh.w_uk[h]
    rope, lat = lh.rot_q * lh.qr[h], w * lh.qn[h]
    return sp.Matrix.vstack(lat, rope) if latent_first else sp.Matrix.vstack(rope, lat)


def latent_absorbed_keys(lh: LatentHeads) -> tuple[sp.Matrix, ...]:
    """The key shared by every head: ``k'_j = [R(p_j) kr_j; c_j]`` ``(rope_dim + rank, 1)``."""
    return tuple(sp.Matrix.vstack(rk * kr, cj) for rk, kr, cj in zip(lh.rot_k, lh.kr, lh.c))


def latent_absorbed_scores(lh: LatentHeads, h: int, **wrong) -> list[sp.Expr]:
    """``s'_jh = scale * q'_ih . k'_j``."""
    q = latent_absorbed_query(lh, h, **wrong)
    return [lh.scale * _dot(q, k) for k in latent_absorbed_keys(lh)]


def latent_absorption_residual(lh: LatentHeads) -> sp.Matrix:
    """Model score minus absorbed score, ``(H, N)`` -- exactly zero: ``qn . (W_uk c) =
    (W_uk^T qn) . c``, and the rope parts are the same products (docs/math.md section 14)."""
    return sp.Matrix([[a - b for a, b in zip(latent_model_scores(lh, h),
                                            latent_absorbed_scores(lh, h))]
                      for h in range(lh.n_heads)])


def wrong_latent_absorption_untransposed(lh: LatentHeads) -> sp.Matrix:
    """WRONG: the absorbed query with ``W_uk[h] qn`` in place of ``W_uk[h]^T qn``
    (``nope == rank``).  Not identically 0."""
    return sp.Matrix([[a - b for a, b in zip(latent_model_scores(lh, h),
                                            latent_absorbed_scores(lh, h, transpose=False))]
                      for h in range(lh.n_heads)])


def wrong_latent_absorption_misordered(lh: LatentHeads) -> sp.Matrix:
    """WRONG: the absorbed query's blocks as ``[latent; rope]`` against keys ``[rope; latent]``
    (``rope_dim == rank``).  Not identically 0."""
    return sp.Matrix([[a - b for a, b in zip(latent_model_scores(lh, h),
                                            latent_absorbed_scores(lh, h, latent_first=True))]
                      for h in range(lh.n_heads)])


def latent_query_space_matrix(lh: LatentHeads, h: int, *, value_head: int | None = None,
                              weights: Sequence[sp.Expr] | None = None) -> sp.Matrix:
    """``T_ih = scale * sum_j c_ijh k'_j (v_jh - mu_ih)`` ``(rope_dim + rank, r)`` with
    ``c_ijh = rho(s'_jh)/Z_ih`` on the absorbed scores (docs/math.md section 14), or the given
    ``weights``."""
    k = latent_absorbed_keys(lh)
    v = latent_values(lh, h, value_head=value_head)
    if weights is None:
        s = latent_absorbed_scores(lh, h)
        z = sp.Add(*[sp.exp(x) for x in s])
        weights = [rho(x) / z for x in s]
    mu = uniform_mean(v)
    return lh.scale * _sum_rows((cj * kj * (vj - mu) for cj, kj, vj in zip(weights, k, v)),
                                (k[0].shape[0], v[0].shape[1]))


def latent_identity_residual(lh: LatentHeads, *, value_head_shift: int = 0) -> sp.Matrix:
    """``y_ih - (mu_ih + q'_ih^T T_ih)`` per head, ``(H, r)`` -- exactly zero.

    ``y_ih`` is the softmax over the *model's* scores (per-head keys ``[W_uk c; R kr]``) of the
    model's values; the readout uses only the absorbed query, the shared keys ``k'_j`` and head
    ``h``'s values (docs/math.md section 14).  ``value_head_shift = s != 0`` builds the readout
    with head ``(h + s) mod H``'s value map (a wrong statement: not identically 0)."""
    rows = []
    for h in range(lh.n_heads):
        vh = (h + value_head_shift) % lh.n_heads
        s = latent_model_scores(lh, h)
        v = latent_values(lh, h)
        y = _sum_rows((sp.exp(x) * vj for x, vj in zip(s, v)), v[0].shape) / sp.Add(
            *[sp.exp(x) for x in s])
        mu = uniform_mean(latent_values(lh, h, value_head=vh))
        t = latent_query_space_matrix(lh, h, value_head=vh)
        rows.append(y - (mu + latent_absorbed_query(lh, h).T * t))
    return sp.Matrix.vstack(*rows)


def wrong_latent_identity_swapped_values(lh: LatentHeads) -> sp.Matrix:
    """WRONG: each head's readout built with the next head's value map.  Not identically 0."""
    return latent_identity_residual(lh, value_head_shift=1)


def latent_query_map(lh: LatentHeads, h: int) -> sp.Matrix:
    """``L_ih = [W_qr[h] R(p_i)^T, W_qn[h] W_uk[h]]`` ``(m+1, rope_dim + rank)``: the absorbed
    query is ``q'_ih = L_ih^T u`` when the query is a projection of ``u`` (no query latent)."""
    if lh.u is None:
        raise ValueError("latent_query_map needs a query that is a projection of u (m given)")
    nope = lh.qn[h].shape[0]
    w = lh.w_q[h]
    return sp.Matrix.hstack(w[:, nope:] * lh.rot_q.T, w[:, :nope] * lh.w_uk[h])


def latent_input_space_residuals(lh: LatentHeads, h: int = 0) -> dict[str, sp.Matrix]:
    """Head ``h`` of a layer whose query is a projection of ``u`` (docs/math.md section 14).
    With features ``a_jh = scale * L_ih k'_j`` ``(m+1, 1)``; all reduce to 0:

    ``query_map``     ``q'_ih - L_ih^T u``
    ``scores``        ``model score - u^T a_jh``   (the score is linear in ``u``)
    ``identity``      ``y_ih - (mu_ih + u^T delta_m_ih)``, ``delta_m`` of section 3 on ``a_jh``
    ``cheap_form``    ``delta_m_ih - L_ih T_ih`` for the same weights ``c_j`` (independent
                      symbols: the factorisation holds for any weights, and ``scores`` shows
                      both sides see the same scores, hence the same ``rho(s_j)/Z``)
    """
    lmap = latent_query_map(lh, h)
    a = tuple(lh.scale * lmap * k for k in latent_absorbed_keys(lh))
    v = latent_values(lh, h)
    c = _generic_weights(lh.n_keys)
    dm = delta_m(lh.u, a, v, weights=c)
    return {
        "query_map": latent_absorbed_query(lh, h) - lmap.T * lh.u,
        "scores": sp.Matrix([[x - _dot(lh.u, aj) for x, aj in zip(latent_model_scores(lh, h), a)]]),
        "identity": identity_residual(lh.u, a, v),
        "cheap_form": dm - lmap * latent_query_space_matrix(lh, h, weights=c),
    }


def _rms_normed(a: sp.Matrix, g: sp.Matrix) -> sp.Matrix:
    """``g * a / sqrt(mean(a^2))`` (``eps = 0``), the mean square factored so that a common
    positive factor leaves the root (``sqrt(t^2 P) = t sqrt(P)`` for ``t > 0``)."""
    ms = sp.factor(sp.Add(*[x**2 for x in a]) / a.shape[0])
    return sp.Matrix([gk * x for gk, x in zip(g, a)]) / sp.sqrt(ms)


def latent_query_latent_ray(m: int = 2, q_rank: int = 2, dim: int = 2) -> dict[str, object]:
    """Why a query latent leaves input space (docs/math.md section 14).

    ``z(x) = g * RMS(W_qa^T x)`` (``eps = 0``, no bias), an absorbed query ``q' = W^T z``
    ``(dim, 1)`` and a fixed key ``k`` give the score ``s(x) = q' . k``.  For ``t > 0``:

    ``ray``        ``z(t x) - z(x)``  (reduces to 0: the query is constant along every ray)
    ``score_ray``  ``s(t x) - s(x)``  (reduces to 0)
    ``odd``        ``s(-x) + s(x)``   (reduces to 0: ``s`` is odd)

    An affine ``s(x) = alpha . x + beta`` constant along every ray has ``t alpha . x = alpha . x``
    for all ``t > 0``, so ``alpha = 0``: it is constant.  An odd score that is non-zero somewhere
    is not constant, so it is not affine in ``x`` and no input-space ``delta_m`` exists.  (For
    any ``eps`` and biases the same follows from boundedness: ``|RMS(a)_k| <= sqrt(q_rank)``, and
    an affine function bounded on ``R^m`` is constant.)  Returns the residuals, ``x``, ``t``,
    ``s`` and ``odd``.
    """
    x = _column("x", m)
    t = sp.Symbol("t", positive=True)
    w_qa = _sym_matrix("Wqa", m, q_rank)
    g = _column("g", q_rank)
    w = _sym_matrix("Wabs", q_rank, dim)
    k = _column("k", dim)

    def z(xx):
        return _rms_normed(w_qa.T * xx, g)

    def score(xx):
        return _dot(w.T * z(xx), k)

    return {"ray": z(t * x) - z(x), "score_ray": score(t * x) - score(x), "x": x, "t": t,
            "s": score(x), "odd": score(-x) + score(x)}


def latent_per_head_form_residuals(lh: LatentHeads, h: int = 0) -> dict[str, sp.Matrix]:
    """The model's per-head form against the absorbed one (docs/math.md section 14), columns:
    ``P_h = [[0, W_uk[h]^T]; [I, 0]]`` (``(nope + rope_dim) x (rope_dim + rank)``, the transpose
    of the rows' ``Pi_h``) maps the shared key to head ``h``'s key.  All reduce to 0:

    ``key``      ``k_jh - P_h k'_j``        (every ``j``, stacked)
    ``query``    ``q'_ih - P_h^T q_ih``
    ``matrix``   ``T^model_ih - P_h T_ih`` with ``T^model_ih = scale sum_j c_j k_jh (v_jh - mu)``
                 for the same (generic) weights, so ``q_ih^T T^model_ih = q'_ih^T T_ih``
    """
    nope, rope_dim, rank = lh.qn[h].shape[0], lh.qr[h].shape[0], lh.c[0].shape[0]
    p = sp.zeros(nope + rope_dim, rope_dim + rank)
    p[:nope, rope_dim:] = lh.w_uk[h]
    p[nope:, :rope_dim] = sp.eye(rope_dim)
    keys = latent_absorbed_keys(lh)
    c = _generic_weights(lh.n_keys)
    v = latent_values(lh, h)
    mu = uniform_mean(v)
    t_model = lh.scale * _sum_rows((cj * latent_model_key(lh, h, j) * (vj - mu)
                                    for j, (cj, vj) in enumerate(zip(c, v))),
                                   (nope + rope_dim, v[0].shape[1]))
    return {
        "key": sp.Matrix.vstack(*[latent_model_key(lh, h, j) - p * k for j, k in enumerate(keys)]),
        "query": latent_absorbed_query(lh, h) - p.T * latent_model_query(lh, h),
        "matrix": t_model - p * latent_query_space_matrix(lh, h, weights=c),
    }
