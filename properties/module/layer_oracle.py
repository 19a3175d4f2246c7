"""The module oracles applied to a model's own parts, as its config composes them (SPEC.md, MODEL-LAYER-*; the
declarations: properties/core/declared.py). Each returns an ``Approx`` (the float64 value and an elementwise bound on
a correct computation in ``dtype``), composed from the module level's rules (properties/module/oracle.py,
attention_oracle.py, approx.py), the rotary formulas (properties/core/rotary.py) and the routing rule
(properties/core/routing.py); no formula is written twice.

- attention: q, k, v projected (``linear``), q and k normalised (``norm_output`` with the input's error carried),
  rotated (``rotate``), grouped, attended (``attention_core`` with the declared scale, soft cap and causal window),
  merged and projected;
- norms: ``rms_norm_oracle`` / ``layer_norm_oracle`` with g = 1 + w for a unit offset;
- feed-forward: ``ffn_oracle`` with the declared activation, gated or not;
- mixture of experts: router logits, the rule's choice and weights, each chosen expert's gated feed-forward network,
  the weighted sum, a shared expert and its sigmoid gate.
"""
from __future__ import annotations

import math

import torch

from properties.core.declared import Attention, Experts, FeedForward, Norm
from properties.core.oracle import to_float64
from properties.core.rotary import Rotary, attention_factor, effective_base, pairs, rotate as rotate_values
from properties.core.routing import route
from properties.core.tolerance import evaluation_error, gamma, unit_roundoff
from properties.module.approx import Approx, effective_u, exact, linear, product
from properties.module.attention_oracle import admissible, attention_core
from properties.module.oracle import ffn_oracle, layer_norm_oracle, rms_norm_oracle, rotary_pair_error

__all__ = ["norm_output", "rotate", "attention_layer", "feed_forward", "experts_block", "SCALING_ROUNDINGS"]

# Roundings a frequency scaling adds to each frequency, beyond base^(-2i/d) itself: a division by the factor, YaRN's
# and Llama 3's blend of two frequencies (a product, a difference, a sum), LongRoPE's product by its factor.
SCALING_ROUNDINGS = 6
# First-order propagation of an input error e through a norm: |Δn_i| <= e_i/r + |n_i|·max(e)/r (r the token's root
# mean square or standard deviation), doubled for the second-order terms while max(e) <= r/8.
NORM_PROPAGATION = 2.0


def _gain(norm: Norm) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    weight, bias = getattr(norm.module, "weight", None), getattr(norm.module, "bias", None)
    gain = None if weight is None else to_float64(weight) + (1.0 if norm.unit_offset else 0.0)
    return gain, None if bias is None else to_float64(bias)


def norm_output(norm: Norm, x, dtype: torch.dtype) -> Approx:
    """The declared norm of ``x`` (a tensor, exact in the dtype, or an Approx whose error is carried through)."""
    u = effective_u(dtype)
    given = x if isinstance(x, Approx) else exact(x)
    gain, bias = _gain(norm)
    if norm.kind == "rms":
        normalized, out = rms_norm_oracle(given.value, norm.eps, gain, dtype)
        root = torch.sqrt((given.value ** 2).mean(-1, keepdim=True) + norm.eps)
    else:
        normalized, out = layer_norm_oracle(given.value, norm.eps, gain, bias, dtype)
        root = torch.sqrt(given.value.var(-1, unbiased=False, keepdim=True) + norm.eps)
    # A model may round its input to the dtype it computes the statistics in first (transformers' norms cast to float32):
    # x_i(1 + δ_i), |δ_i| <= u, moves n_i by at most 2u|n_i| (the token's own rounding and that of its root mean square).
    error = out.error + 2 * u * normalized.magnitude * (1.0 if gain is None else gain.abs())
    if norm.unit_offset and gain is not None:   # 1 + w rounded once
        error = error + u * gain.abs() * normalized.magnitude
    if isinstance(x, Approx):
        worst = x.error.amax(-1, keepdim=True)
        carried = NORM_PROPAGATION * (x.error + normalized.value.abs() * worst) / root
        carried = torch.where(worst <= root / 8, carried, torch.full_like(carried, math.inf))
        error = error + (carried if gain is None else gain.abs() * carried)
    return Approx(out.value, error)


def rotate(a: Approx, r: Rotary, positions: torch.Tensor, length: int, dtype: torch.dtype) -> Approx:
    """``a`` (B, L, H, head_dim) rotated at ``positions`` (L,) as ``r`` declares: the value from the float64 formula
    (properties/core/rotary.py); the error of each rotated pair is the pair's incoming error (a rotation keeps norms,
    times the attention factor) plus ``rotary_pair_error`` for the angle, cos, sin and the products."""
    value = rotate_values(r, a.value, positions, length)
    first, second = pairs(r, a.value.shape[-1])
    factor = abs(attention_factor(r))
    incoming = a.error[..., first] + a.error[..., second]
    pair_norm = torch.sqrt(a.magnitude[..., first] ** 2 + a.magnitude[..., second] ** 2)
    rounding = rotary_pair_error(positions.to(torch.float64)[:, None, None], factor * pair_norm,
                                 math.log(effective_base(r, length)), dtype, SCALING_ROUNDINGS)
    rounding = rounding + unit_roundoff(dtype) * factor * pair_norm   # the product by the attention factor
    error = a.error.clone()
    error[..., first] = factor * incoming + rounding
    error[..., second] = factor * incoming + rounding
    return Approx(value, error)


def _heads(a: Approx, b: int, l: int, heads: int, head_dim: int) -> Approx:
    return a.map(lambda t: t.reshape(b, l, heads, head_dim))


def _normalised(a: Approx, norm: Norm | None, b: int, l: int, heads: int, head_dim: int, dtype) -> Approx:
    """q or k (B, L, heads·head_dim) normalised as declared, returned as (B, L, heads, head_dim): per head when the
    norm's weight is head_dim wide or (heads, head_dim), over the whole projection otherwise (OLMo 2, OLMoE)."""
    if norm is None:
        return _heads(a, b, l, heads, head_dim)
    weight = getattr(norm.module, "weight", None)
    if weight is not None and weight.dim() == 1 and weight.shape[0] == heads * head_dim and heads > 1:
        return _heads(norm_output(norm, a, dtype), b, l, heads, head_dim)
    return norm_output(norm, _heads(a, b, l, heads, head_dim), dtype)


def attention_layer(decl: Attention, x: torch.Tensor, dtype: torch.dtype) -> Approx:
    """The declared causal self-attention of ``x`` (B, L, D), every position real, positions 0 … L − 1."""
    u = effective_u(dtype)
    w = decl.weights()
    a = exact(x)
    b, l, _ = a.value.shape
    q = _normalised(linear(a, *w["q"], u), decl.q_norm, b, l, decl.heads, decl.head_dim, dtype)
    k = _normalised(linear(a, *w["k"], u), decl.k_norm, b, l, decl.kv_heads, decl.head_dim, dtype)
    v = _heads(linear(a, *w["v"], u), b, l, decl.kv_heads, decl.head_dim)
    if decl.rotary is not None:
        positions = torch.arange(l)
        q, k = rotate(q, decl.rotary, positions, l, dtype), rotate(k, decl.rotary, positions, l, dtype)
    group = torch.arange(decl.heads) // (decl.heads // decl.kv_heads)
    k, v = k.map(lambda t: t[:, :, group]), v.map(lambda t: t[:, :, group])
    visible = admissible(b, l, l, None, True, decl.window)
    out = attention_core(q, k, v, visible, dtype, softcap=decl.softcap, scale=decl.scale)
    return linear(out.map(lambda t: t.reshape(b, l, decl.heads * decl.head_dim)), *w["o"], u)


def feed_forward(decl: FeedForward, x: torch.Tensor, dtype: torch.dtype) -> Approx:
    return ffn_oracle(decl.weights(), decl.activation, x, dtype, gated=decl.gated)


def _sigmoid(a: Approx, u: float) -> Approx:
    """1/(1 + e^{-x}): 1/4-Lipschitz; exp, the sum and the division cost gamma(4) relative to the value."""
    value = torch.sigmoid(a.value)
    return Approx(value, a.error / 4 + gamma(4, u) * value)


def experts_block(decl: Experts, x: torch.Tensor, dtype: torch.dtype) -> tuple[Approx, torch.Tensor]:
    """(the declared block's output for tokens ``x`` (N, D), decided (N,)): a token is decided when no rounding of its
    router logits within their bound can change its experts (its choice margin exceeds four times the scores'
    error); the output of an undecided token is not claimed."""
    u = effective_u(dtype)
    a = exact(x)
    n = a.value.shape[0]
    logits = linear(a, *decl.router(), u)
    routed = route(logits.value, decl.rule)
    spread = logits.error.amax(-1)                                                   # Δ per token
    count = logits.value.shape[-1]
    if decl.rule.scoring == "softmax":   # scores moved by at most Δ each: a factor within e^{±2Δ}, as attention's weights
        relative = torch.exp(2 * spread) * (1 + evaluation_error(count, dtype)) - 1
        score_error = relative[:, None] * routed.scores                             # (N, E)
    else:                                # sigmoid: 1/4-Lipschitz, exp, the sum and the division gamma(4)
        score_error = spread[:, None] / 4 + gamma(4, u) * routed.scores
    decided = routed.margin > 4 * score_error.amax(-1)    # two scores each side of a gap (a group sums two)
    k = decl.rule.k
    chosen_error = score_error.gather(1, routed.chosen)
    chosen_relative = chosen_error / routed.scores.gather(1, routed.chosen).clamp_min(torch.finfo(torch.float64).tiny)
    if decl.rule.normalized:   # p_j / Σ p: the relative errors of a ratio add, the sum costs gamma(k)
        weight_error = (chosen_relative + chosen_relative.amax(-1, keepdim=True) + gamma(k + 2, u)) * routed.weights.abs()
    else:
        weight_error = chosen_error * abs(decl.rule.scale) + u * routed.weights.abs()
    gate_up, down = (to_float64(t) for t in decl.experts())
    inner = gate_up.shape[1] // 2
    value = torch.zeros_like(a.value)
    error = torch.zeros_like(a.value)
    magnitude = torch.zeros_like(a.value)
    for slot in range(k):
        for expert in routed.chosen[:, slot].unique().tolist():
            rows = (routed.chosen[:, slot] == expert).nonzero().flatten()
            layers = {"gate": (gate_up[expert, :inner], None), "up": (gate_up[expert, inner:], None),
                      "down": (down[expert], None)}
            out = ffn_oracle(layers, decl.activation, x[rows], dtype, gated=True)
            w = Approx(routed.weights[rows, slot, None], weight_error[rows, slot, None])
            term = product(w, out, u)
            value[rows] += term.value
            error[rows] += term.error
            magnitude[rows] += term.magnitude
    terms = k
    if decl.shared is not None:
        shared = feed_forward(decl.shared, x, dtype)
        if decl.shared_gate is not None:
            shared = product(_sigmoid(linear(a, *decl.shared_gate(), u), u), shared, u)
        value, error, magnitude = value + shared.value, error + shared.error, magnitude + shared.magnitude
        terms += 1
    return Approx(value, error + gamma(terms + 1, u) * magnitude), decided
