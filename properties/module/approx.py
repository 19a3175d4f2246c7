"""The arithmetic of the module oracles (properties/module/oracle.py): :class:`Approx`, a float64 value with an
elementwise error bound, and the rules that carry the bound through each step of a computation
(``gamma`` and ``unit_roundoff`` are ``properties.core.tolerance``'s):

- linear   y = x Wᵀ + b with fan-in n:  e_y = e_x |W|ᵀ + gamma(n + 1)·((|x| + e_x)|W|ᵀ + |b|)
- activation f with max |f'| = L:       e_y = L·e_x + (evaluation error of f at |x| + e_x)
- product  a ⊙ b:                        e_y = |a| e_b + e_a (|b| + e_b) + u·(|a| + e_a)(|b| + e_b)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from properties.core.oracle import to_float64
from properties.core.tolerance import gamma, unit_roundoff

__all__ = ["vector", "Approx", "exact", "effective_u", "angle_u", "linear", "activation", "product", "LIPSCHITZ"]

_F64 = torch.float64


@dataclass(frozen=True)
class Approx:
    """A float64 value and an elementwise bound on how far a correct computation in the tested dtype is."""
    value: torch.Tensor
    error: torch.Tensor

    @property
    def magnitude(self) -> torch.Tensor:
        """|value| + error: a bound on the magnitude of the computed quantity."""
        return self.value.abs() + self.error

    def map(self, fn) -> "Approx":
        """Apply a pure re-indexing (reshape, permute, gather) to value and error alike."""
        return Approx(fn(self.value), fn(self.error))


def exact(t: torch.Tensor) -> Approx:
    """A tensor that is exact in the tested dtype (an input or a parameter)."""
    v = to_float64(t)
    return Approx(v, torch.zeros_like(v))


def effective_u(dtype: torch.dtype) -> float:
    """u(dtype) + u(float64): the implementation's and the oracle's rounding together."""
    return unit_roundoff(dtype) + unit_roundoff(_F64)


def angle_u(dtype: torch.dtype) -> float:
    """Unit roundoff of position angles: at most float32's even for float64 modules (SPEC, POS-*)."""
    return max(unit_roundoff(dtype), unit_roundoff(torch.float32)) + unit_roundoff(_F64)


def vector(t) -> torch.Tensor | None:
    return None if t is None else to_float64(t)


def linear(a: Approx, weight, bias, u: float) -> Approx:
    w = to_float64(weight)
    b = vector(bias)
    value = a.value @ w.T + (0.0 if b is None else b)
    magnitude = a.magnitude @ w.abs().T + (0.0 if b is None else b.abs())
    error = a.error @ w.abs().T + gamma(w.shape[-1] + 1, u) * magnitude
    return Approx(value, error)


def _lipschitz(fn) -> float:
    """max |f'| on a grid of step 1e-3 over [-12, 12] plus step·max|f''| (max|f''| <= 1 for GELU and SiLU;
    beyond 12 the derivative is within 1e-30 of 0 or 1)."""
    x = torch.arange(-12.0, 12.0, 1e-3, dtype=_F64, requires_grad=True)
    (grad,) = torch.autograd.grad(fn(x).sum(), x)
    return float(grad.abs().max()) + 1e-3


_GELU_TANH_C = math.sqrt(2.0 / math.pi)


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(_GELU_TANH_C * (x + 0.044715 * x ** 3)))


def _silu(x):
    return x / (1.0 + torch.exp(-x))


_FUNCTIONS = {"relu": torch.relu, "gelu": _gelu, "gelu_tanh": _gelu_tanh, "silu": _silu}
LIPSCHITZ = {"relu": 1.0, "gelu": _lipschitz(_gelu), "gelu_tanh": _lipschitz(_gelu_tanh), "silu": _lipschitz(_silu)}


def _evaluation(name: str, m: torch.Tensor, u: float) -> torch.Tensor:
    """Rounding error of evaluating f at an argument of magnitude <= m (absolute).

    relu is exact.  gelu = x/2 (1 + erf(x/√2)): the argument's rounding moves erf by at most
    max_t |t erf'(t)| u < u, erf itself 2u, the sum, the halving and the product 2u more: gamma(6)|x|.
    gelu_tanh: the same plus the inner polynomial √(2/π)(x + 0.044715x³) with relative error gamma(5),
    passed through tanh (1-Lipschitz) and multiplied by |x|/2.  silu = x/(1 + e^{-x}): exp 2u, the sum
    and the division, relative to |silu(x)| <= |x|: gamma(5)|x|."""
    if name == "relu":
        return torch.zeros_like(m)
    if name == "gelu":
        return gamma(6, u) * m
    if name == "gelu_tanh":
        return m * (gamma(6, u) + 0.5 * gamma(5, u) * _GELU_TANH_C * (m + 0.044715 * m ** 3))
    if name == "silu":
        return gamma(5, u) * m
    raise ValueError(f"no error model for activation {name!r}")


def activation(a: Approx, name: str, u: float) -> Approx:
    value = _FUNCTIONS[name](a.value)
    return Approx(value, LIPSCHITZ[name] * a.error + _evaluation(name, a.magnitude, u))


def product(a: Approx, b: Approx, u: float) -> Approx:
    return Approx(a.value * b.value,
                  a.value.abs() * b.error + a.error * b.magnitude + u * a.magnitude * b.magnitude)
