"""fp64 oracles for the module clauses (SPEC.md, "Modules"), each with a derived error bound.

Every oracle is written here from the paper's formulas, reading only the module's parameters; it does not
call ``zoo``.  It returns an :class:`Approx`: the exact result evaluated in float64 and, elementwise, a
bound on |module output - result| for a module that computes in ``dtype``.  The bound follows the module's
computation step by step in the standard model of floating-point arithmetic (SPEC.md, "Tolerance model"):
inputs and parameters are exact in ``dtype``; every operation rounds with unit roundoff at most u; a
result that carries error e into a function with Lipschitz constant L carries L·e after it.  The oracle's
own float64 rounding is bounded by the same model with u = 2^-53; since gamma(n, u) is superadditive in u,
evaluating every step with u_eff = u(dtype) + u(float64) bounds the sum of both errors.  The rules:
properties/module/approx.py; the attention oracles: properties/module/attention_oracle.py.
"""
from __future__ import annotations

import math

import torch

from properties.core.oracle import to_float64
from properties.core.tolerance import gamma, unit_roundoff
from properties.module.approx import Approx, activation, angle_u, effective_u, exact, linear, product, vector

__all__ = ["ffn_layers", "ffn_oracle", "layer_norm_stats", "layer_norm_oracle", "rms_norm_oracle",
           "sinusoid_table", "angle_relative_error", "sinusoid_error", "rotary_pair_error"]


# ---------------------------------------------------------------------------------------- feed-forward
def ffn_layers(module, activation_name: str) -> tuple[dict | None, str]:
    """The FFN's linear maps: ``up`` (W1, b1), ``down`` (W2, b2) and for swiglu ``gate`` (W_gate, b_gate)."""
    names = ("up", "down", "gate") if activation_name == "swiglu" else ("up", "down")
    found = {}
    for name in names:
        weight = getattr(getattr(module, name, None), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None, (f"{type(module).__qualname__} has no {name}.weight (a 2-D tensor): the oracle reads "
                          f"{', '.join(names)} (each .weight (out, in) and .bias or None)")
        bias = getattr(getattr(module, name), "bias", None)
        found[name] = (weight.detach(), None if bias is None else bias.detach())
    return found, ""


def ffn_oracle(layers: dict, activation_name: str, x: torch.Tensor, dtype: torch.dtype,
               gated: bool | None = None) -> Approx:
    """relu: max(0, xW1 + b1)W2 + b2; gelu/gelu_tanh: GELU(xW1 + b1)W2 + b2 (erf or tanh form);
    swiglu: (SiLU(xW_gate + b_gate) ⊙ (xW1 + b1))W2 + b2 (weights as (out, in) matrices, applied as xWᵀ).
    ``gated`` True: (f(xW_gate + b_gate) ⊙ (xW1 + b1))W2 + b2 with f the activation ``activation_name`` (GeGLU for
    gelu_tanh, as Gemma's; swiglu is silu gated)."""
    u = effective_u(dtype)
    a = exact(x)
    hidden = linear(a, *layers["up"], u)
    gated = activation_name == "swiglu" if gated is None else gated
    if gated:
        gate_activation = "silu" if activation_name == "swiglu" else activation_name
        hidden = product(activation(linear(a, *layers["gate"], u), gate_activation, u), hidden, u)
    else:
        hidden = activation(hidden, activation_name, u)
    return linear(hidden, *layers["down"], u)


# ------------------------------------------------------------------------------------------------ norms
def _affine(n: Approx, weight, bias, u: float) -> Approx:
    g = to_float64(weight) if weight is not None else None
    b = vector(bias)
    if g is None:
        return n
    value = n.value * g + (0.0 if b is None else b)
    error = g.abs() * n.error + gamma(2, u) * (g.abs() * n.magnitude + (0.0 if b is None else b.abs()))
    return Approx(value, error)


def _inverse_root(a: torch.Tensor, error_a: torch.Tensor, u: float) -> torch.Tensor:
    """Relative error of fl(1/sqrt(â)) when |â - a| <= error_a before the rounding of â itself: the
    perturbation ρ = error_a/a + u(1 + error_a/a) moves a^{-1/2} by at most ρ/(1 - ρ) relatively; sqrt and
    the division (or an rsqrt within 2 ulps) add gamma(3)."""
    rho = error_a / a + u * (1 + error_a / a)
    rel = torch.where(rho < 1, rho / (1 - rho), torch.full_like(rho, math.inf))
    return rel + gamma(3, u) + rel * gamma(3, u)


def layer_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centered c, biased variance v, normalized n = c/√(v + eps)) per token over the last axis, float64."""
    x = to_float64(x)
    mu = x.mean(-1, keepdim=True)
    c = x - mu
    v = (c * c).mean(-1, keepdim=True)
    return c, v, c / torch.sqrt(v + eps)


def layer_norm_oracle(x: torch.Tensor, eps: float, weight, bias, dtype: torch.dtype) -> tuple[Approx, Approx]:
    """(normalized n, output g ⊙ n + b) for LayerNorm over the last axis of x (d features).

    Mean: gamma(d + 1)·mean|x|.  Variance: any of the standard algorithms (two-pass, Welford, or the
    one-pass E[x²] - μ², whose bound dominates the others, Chan, Golub & LeVeque 1983):
    |v̂ - v| <= gamma(d + 4)(mean x² + μ²) + (2|μ| + e_μ) e_μ + mean((2|c| + e_c) e_c) with
    e_c = e_μ(1 + u) + u|c| the error of a centered entry."""
    u = effective_u(dtype)
    xd = to_float64(x)
    d = xd.shape[-1]
    c, v, n = layer_norm_stats(xd, eps)
    mu = xd.mean(-1, keepdim=True)
    e_mu = gamma(d + 1, u) * xd.abs().mean(-1, keepdim=True)
    e_c = e_mu * (1 + u) + u * c.abs()
    e_v = (gamma(d + 4, u) * ((xd * xd).mean(-1, keepdim=True) + mu * mu) + (2 * mu.abs() + e_mu) * e_mu
           + ((2 * c.abs() + e_c) * e_c).mean(-1, keepdim=True))
    r = 1 / torch.sqrt(v + eps)
    rel_r = _inverse_root(v + eps, e_v, u)
    e_n = r * (e_c + (c.abs() + e_c) * rel_r) * (1 + u) + u * c.abs() * r
    normalized = Approx(n, e_n)
    return normalized, _affine(normalized, weight, bias, u)


def rms_norm_oracle(x: torch.Tensor, eps: float, weight, dtype: torch.dtype) -> tuple[Approx, Approx]:
    """(normalized n = x/√(mean x² + eps), output g ⊙ n) for RMSNorm over the last axis."""
    u = effective_u(dtype)
    xd = to_float64(x)
    d = xd.shape[-1]
    ms = (xd * xd).mean(-1, keepdim=True)
    e_ms = gamma(d + 2, u) * ms
    r = 1 / torch.sqrt(ms + eps)
    rel_r = _inverse_root(ms + eps, e_ms, u)
    n = xd * r
    e_n = xd.abs() * r * rel_r * (1 + u) + u * xd.abs() * r
    normalized = Approx(n, e_n)
    return normalized, _affine(normalized, weight, None, u)


# ------------------------------------------------------------------------------------------- positions
def sinusoid_table(positions, d: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), from Python's math
    (independent of torch), float64, shape (len(positions), d)."""
    rows = []
    for pos in positions:
        row = []
        for j in range(d):
            angle = pos / 10000.0 ** (2 * (j // 2) / d)
            row.append(math.sin(angle) if j % 2 == 0 else math.cos(angle))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), d)


def angle_relative_error(exponent: torch.Tensor | float, log_base: float, ua: float):
    """Relative error of an angle pos·base^(-exponent) (exponent 2i/d in [0, 1)) computed in precision ua:
    the exponent's rounding is multiplied by ln(base) in exp/pow, pow/exp itself 2 ulps, the product or
    quotient with pos one more: gamma(4)(2 + exponent·ln base)."""
    return gamma(4, ua) * (2 + exponent * log_base)


def sinusoid_error(positions: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |PE_module(pos, j) - PE(pos, j)| (len(positions), d): the angle's error (above), sin/cos
    within 2 ulps of their value (|.| <= 1), the rounding to the dtype."""
    ua = angle_u(dtype)
    pair = torch.arange(d, dtype=torch.float64) // 2
    exponent = 2 * pair / d
    omega = 10000.0 ** (-exponent)
    angle = positions.to(torch.float64)[:, None] * omega[None, :]
    return (angle_relative_error(exponent, math.log(10000.0), ua)[None, :] * angle + gamma(2, ua)
            + unit_roundoff(dtype))


def rotary_pair_error(positions: torch.Tensor, pair_norm: torch.Tensor, log_base: float,
                      dtype: torch.dtype, scaling_roundings: int = 0) -> torch.Tensor:
    """Bound on the Euclidean norm of the error of one rotated feature pair (a, b) -> R(pos·θ)(a, b) with
    |θ| <= 1: the angle's error (relative ``angle_relative_error`` with exponent < 1) times |(a, b)|, cos
    and sin within gamma(2) each (a matrix error of norm <= 2·gamma(2)), the two products and the sum
    gamma(2) per component (√2·gamma(2) in norm), the rounding to the dtype √2·u.  ``positions`` broadcast
    against ``pair_norm``.  ``scaling_roundings``: the roundings a frequency scaling adds to each frequency (a
    division by the factor, YaRN's or Llama 3's blend), each a relative error of the angle."""
    ua = angle_u(dtype)
    angle_error = (angle_relative_error(1.0, log_base, ua) + gamma(scaling_roundings, ua)) * positions.to(torch.float64)
    return pair_norm * (angle_error + 2 * gamma(2, ua) + math.sqrt(2) * gamma(2, ua)
                        + math.sqrt(2) * unit_roundoff(dtype))
