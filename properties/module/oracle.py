"""fp64 oracles for the module clauses (SPEC.md, "Modules"), each with a derived error bound.

Every oracle is written here from the paper's formulas, reading only the module's parameters; it does not
call ``zoo``.  It returns an :class:`Approx`: the exact result evaluated in float64 and, elementwise, a
bound on |module output - result| for a module that computes in ``dtype``.  The bound follows the module's
computation step by step in the standard model of floating-point arithmetic (SPEC.md, "Tolerance model"):
inputs and parameters are exact in ``dtype``; every operation rounds with unit roundoff at most u; a
result that carries error e into a function with Lipschitz constant L carries L·e after it.  The oracle's
own float64 rounding is bounded by the same model with u = 2^-53; since gamma(n, u) is superadditive in u,
evaluating every step with u_eff = u(dtype) + u(float64) bounds the sum of both errors.  The rules
(``gamma`` and ``unit_roundoff`` are ``properties.core.tolerance``'s):

- linear   y = x Wᵀ + b with fan-in n:  e_y = e_x |W|ᵀ + gamma(n + 1)·((|x| + e_x)|W|ᵀ + |b|)
- activation f with max |f'| = L:       e_y = L·e_x + (evaluation error of f at |x| + e_x)
- product  a ⊙ b:                        e_y = |a| e_b + e_a (|b| + e_b) + u·(|a| + e_a)(|b| + e_b)
- attention: score errors Δ per query row (propagated from q, k, plus the kernel's gamma(E + 5) and the
  2u of the max subtraction, as in SPEC step 2) change each weight by a factor within e^{±2Δ} (softmax
  of scores moved by at most Δ each); evaluating the softmax adds the factor 1 ± gamma(2S + 6)
  (``properties.core.tolerance.evaluation_error``), underflow ±tiny; the weighted sum adds gamma(S + 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from properties.core.flash import flash_allowed
from properties.core.oracle import reference_attention, softmax_rows, to_float64
from properties.core.tolerance import evaluation_error, gamma, unit_roundoff

__all__ = ["Approx", "exact", "effective_u", "angle_u", "linear", "activation", "product", "LIPSCHITZ",
           "Projections", "projections", "module_options", "multihead_oracle", "single_head_oracle", "ffn_layers", "ffn_oracle",
           "layer_norm_oracle", "rms_norm_oracle", "sinusoid_table", "sinusoid_error", "rotary_pair_error"]

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


def _vector(t) -> torch.Tensor | None:
    return None if t is None else to_float64(t)


def linear(a: Approx, weight, bias, u: float) -> Approx:
    w = to_float64(weight)
    b = _vector(bias)
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


# ------------------------------------------------------------------------------------ multi-head attention
@dataclass(frozen=True)
class Projections:
    """The four projections of a multi-head attention module, float64 on the CPU (bias None = 0)."""
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None


PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "out_proj")


def projections(module) -> tuple[Projections | None, str]:
    """The module's ``q_proj, k_proj, v_proj, out_proj`` (each with a 2-D ``weight`` (out, in) and a
    ``bias`` that may be None), or (None, the reason)."""
    found = []
    for name in PROJECTION_NAMES:
        part = getattr(module, name, None)
        weight = getattr(part, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None, (f"{type(module).__qualname__} has no {name}.weight (a 2-D tensor): the oracle reads "
                          f"{', '.join(PROJECTION_NAMES)} (each .weight (out, in) and .bias or None)")
        bias = getattr(part, "bias", None)
        found += [weight.detach(), None if bias is None else bias.detach()]
    return Projections(*found), ""


def _project(x: torch.Tensor, w, b, u: float) -> Approx:
    return linear(exact(x), w, b, u)


def _admissible(b: int, l: int, s: int, key_padding_mask, is_causal: bool, window: int | None = None) -> torch.Tensor:
    """(b, 1, l, s) bool: key j is visible to query i.  ``window`` W (self-attention, l == s): |i - j| < W,
    Mistral's sliding window (i - W < j <= i under the causal mask)."""
    visible = torch.ones(b, 1, l, s, dtype=torch.bool)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.detach().to("cpu", torch.bool)[:, None, None, :]
    if is_causal:
        visible = visible & torch.ones(l, s, dtype=torch.bool).tril()
    if window is not None:   # flash-attn's window_size (W - 1, W - 1), query i at position i
        visible = visible & flash_allowed(l, s, window_size=(window - 1, window - 1), offset=0)
    return visible


def _soft_cap(scores: torch.Tensor, delta: torch.Tensor, softcap: float | None, u: float):
    """Gemma 2's X·tanh(s / X) and its error bound: the cap is 1-Lipschitz, so the score's error passes
    through unchanged; evaluating it adds the rounding of s / X (at most u|s| after the cap's slope <= 1),
    of tanh (at most 4 ulp, the accuracy of the libm tanh the kernels call) and of the product (u)."""
    if not softcap:
        return scores, delta
    capped = softcap * torch.tanh(scores / softcap)
    return capped, delta + u * scores.abs() + gamma(5, u) * capped.abs()


def attention_core(q: Approx, k: Approx, v: Approx, visible: torch.Tensor, dtype: torch.dtype,
                   value: torch.Tensor | None = None, softcap: float | None = None) -> Approx:
    """softmax(q kᵀ/√E) v per head, q (b, l, h, E), k and v (b, s, h, E) already mapped to query heads,
    ``visible`` (b, 1 or h, l, s); scores capped to X·tanh(score / X) under ``softcap`` X.  Returns
    (b, l, h, E).  ``value`` replaces the float64 result (the single-head clause computes it with
    ``properties.core.oracle.reference_attention``)."""
    u = effective_u(dtype)
    e, s = q.value.shape[-1], k.value.shape[1]
    sigma = 1.0 / math.sqrt(e)
    scores = torch.einsum("blhe,bshe->bhls", q.value, k.value) * sigma
    propagated = sigma * (torch.einsum("blhe,bshe->bhls", q.error, k.magnitude)
                          + torch.einsum("blhe,bshe->bhls", q.value.abs(), k.error))
    rounding = gamma(e + 5, u) * sigma * torch.einsum("blhe,bshe->bhls", q.magnitude, k.magnitude)
    scores, errors = _soft_cap(scores, propagated + rounding, softcap, u)
    visible = visible.expand_as(scores)
    zero = torch.zeros_like(scores)
    delta = torch.where(visible, errors, zero)
    masked = torch.where(visible, scores, torch.full_like(scores, -math.inf))
    row_max = masked.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    argument = 2 * u * ((scores - row_max).abs() + delta + delta.amax(-1, keepdim=True))
    spread = torch.where(visible, delta + argument, zero).amax(-1, keepdim=True)   # Δ per row, (b, h, l, 1)
    weights = softmax_rows(masked)
    rho = torch.exp(2 * spread) * (1 + evaluation_error(s, dtype)) - 1            # relative weight error
    rho = rho.permute(0, 2, 1, 3)                                                    # (b, l, h, 1)
    tiny = torch.finfo(dtype).tiny
    w_abs = torch.einsum("bhls,bshe->blhe", weights, v.value.abs())
    w_err = torch.einsum("bhls,bshe->blhe", weights, v.error)
    underflow = tiny * torch.einsum("bhls,bshe->blhe", visible.to(_F64), v.magnitude)
    error = (rho * w_abs + (1 + rho) * w_err + underflow
             + gamma(s + 2, u) * ((1 + rho) * (w_abs + w_err) + underflow))
    if value is None:
        value = torch.einsum("bhls,bshe->blhe", weights, v.value)
    return Approx(value, error)


def multihead_oracle(p: Projections, x: torch.Tensor, memory: torch.Tensor | None, heads: int, kv_heads: int,
                     *, key_padding_mask=None, is_causal: bool = False, dtype: torch.dtype,
                     window: int | None = None, softcap: float | None = None) -> Approx:
    """MultiHead(x, m) = concat(head_1, ..., head_h) W_O + b_O with head_i = Attention(Q_i, K_g(i), V_g(i)):
    Q_i the features [iE, (i+1)E) of x W_Qᵀ + b_Q, E = d_q/h, g(i) = i // (h/k) for k key/value heads.
    ``window`` (self-attention only) and ``softcap``: the FlashAttention options of the module (see
    ``module_options``)."""
    u = effective_u(dtype)
    source = x if memory is None else memory
    q, k, v = _project(x, p.wq, p.bq, u), _project(source, p.wk, p.bk, u), _project(source, p.wv, p.bv, u)
    b, l, width = q.value.shape
    s, e = k.value.shape[1], width // heads
    group = torch.arange(heads) // (heads // kv_heads)   # query head i -> key/value head i // (h/k)
    q = q.map(lambda t: t.reshape(b, l, heads, e))
    k = k.map(lambda t: t.reshape(b, s, kv_heads, e)[:, :, group])
    v = v.map(lambda t: t.reshape(b, s, kv_heads, e)[:, :, group])
    visible = _admissible(b, l, s, key_padding_mask, is_causal, window if memory is None else None)
    heads_out = attention_core(q, k, v, visible, dtype, softcap=softcap)
    concat = heads_out.map(lambda t: t.reshape(b, l, heads * e))
    return linear(concat, p.wo, p.bo, u)


def single_head_oracle(p: Projections, x: torch.Tensor, memory: torch.Tensor | None, *, key_padding_mask=None,
                       is_causal: bool = False, dtype: torch.dtype, window: int | None = None,
                       softcap: float | None = None) -> Approx:
    """h = 1: softmax((xW_Qᵀ + b_Q)(mW_Kᵀ + b_K)ᵀ/√d)(mW_Vᵀ + b_V) W_Oᵀ + b_O, the attention computed by the
    kernel oracle (``properties.core.oracle.reference_attention``) on the projections, no head reshaping."""
    u = effective_u(dtype)
    source = x if memory is None else memory
    q, k, v = _project(x, p.wq, p.bq, u), _project(source, p.wk, p.bk, u), _project(source, p.wv, p.bv, u)
    b, l, _ = q.value.shape
    s = k.value.shape[1]
    visible = _admissible(b, l, s, key_padding_mask, is_causal, window if memory is None else None)
    # The kernel oracle has no softcap: with one, the value is attention_core's own float64 result.
    attended = None if softcap else reference_attention(q.value, k.value, v.value,
                                                         attn_mask=visible[:, 0]).output[:, :, None]  # (b, l, 1, d)
    one_head = attention_core(q.map(lambda t: t[:, :, None]), k.map(lambda t: t[:, :, None]),
                              v.map(lambda t: t[:, :, None]), visible, dtype, value=attended, softcap=softcap)
    return linear(one_head.map(lambda t: t[:, :, 0]), p.wo, p.bo, u)


# ---------------------------------------------------------------------------------------- feed-forward
def module_options(module) -> dict:
    """The FlashAttention options an attention module declares (``window``, ``softcap``: the zoo's
    MultiHeadAttention attributes), as keywords of the oracles; a module without them has neither."""
    return {name: getattr(module, name) for name in ("window", "softcap") if getattr(module, name, None) is not None}


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


def ffn_oracle(layers: dict, activation_name: str, x: torch.Tensor, dtype: torch.dtype) -> Approx:
    """relu: max(0, xW1 + b1)W2 + b2; gelu/gelu_tanh: GELU(xW1 + b1)W2 + b2 (erf or tanh form);
    swiglu: (SiLU(xW_gate + b_gate) ⊙ (xW1 + b1))W2 + b2 (weights as (out, in) matrices, applied as xWᵀ)."""
    u = effective_u(dtype)
    a = exact(x)
    hidden = linear(a, *layers["up"], u)
    if activation_name == "swiglu":
        hidden = product(activation(linear(a, *layers["gate"], u), "silu", u), hidden, u)
    else:
        hidden = activation(hidden, activation_name, u)
    return linear(hidden, *layers["down"], u)


# ------------------------------------------------------------------------------------------------ norms
def _affine(n: Approx, weight, bias, u: float) -> Approx:
    g = to_float64(weight) if weight is not None else None
    b = _vector(bias)
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
    return torch.tensor(rows, dtype=_F64).reshape(len(rows), d)


def angle_relative_error(exponent: torch.Tensor | float, log_base: float, ua: float):
    """Relative error of an angle pos·base^(-exponent) (exponent 2i/d in [0, 1)) computed in precision ua:
    the exponent's rounding is multiplied by ln(base) in exp/pow, pow/exp itself 2 ulps, the product or
    quotient with pos one more: gamma(4)(2 + exponent·ln base)."""
    return gamma(4, ua) * (2 + exponent * log_base)


def sinusoid_error(positions: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |PE_module(pos, j) - PE(pos, j)| (len(positions), d): the angle's error (above), sin/cos
    within 2 ulps of their value (|.| <= 1), the rounding to the dtype."""
    ua = angle_u(dtype)
    pair = torch.arange(d, dtype=_F64) // 2
    exponent = 2 * pair / d
    omega = 10000.0 ** (-exponent)
    angle = positions.to(_F64)[:, None] * omega[None, :]
    return (angle_relative_error(exponent, math.log(10000.0), ua)[None, :] * angle + gamma(2, ua)
            + unit_roundoff(dtype))


def rotary_pair_error(positions: torch.Tensor, pair_norm: torch.Tensor, log_base: float,
                      dtype: torch.dtype) -> torch.Tensor:
    """Bound on the Euclidean norm of the error of one rotated feature pair (a, b) -> R(pos·θ)(a, b) with
    |θ| <= 1: the angle's error (relative ``angle_relative_error`` with exponent < 1) times |(a, b)|, cos
    and sin within gamma(2) each (a matrix error of norm <= 2·gamma(2)), the two products and the sum
    gamma(2) per component (√2·gamma(2) in norm), the rounding to the dtype √2·u.  ``positions`` broadcast
    against ``pair_norm``."""
    ua = angle_u(dtype)
    angle_error = angle_relative_error(1.0, log_base, ua) * positions.to(_F64)
    return pair_norm * (angle_error + 2 * gamma(2, ua) + math.sqrt(2) * gamma(2, ua)
                        + math.sqrt(2) * unit_roundoff(dtype))
