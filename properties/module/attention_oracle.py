"""The multi-head attention oracles of the module clauses (properties/module/oracle.py; the rules of the error
bound in properties/module/approx.py):

- attention: score errors Δ per query row (propagated from q, k, plus the kernel's gamma(E + 5) and the
  2u of the max subtraction, as in SPEC step 2) change each weight by a factor within e^{±2Δ} (softmax
  of scores moved by at most Δ each); evaluating the softmax adds the factor 1 ± gamma(2S + 6)
  (``properties.core.tolerance.evaluation_error``), underflow ±tiny; the weighted sum adds gamma(S + 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from properties.kernel.flash import flash_allowed
from properties.core.oracle import reference_attention, softmax_rows
from properties.core.tolerance import evaluation_error, gamma
from properties.module.approx import Approx, effective_u, exact, linear

__all__ = ["Projections", "PROJECTION_NAMES", "projections", "admissible", "attention_core", "multihead_oracle",
           "single_head_oracle", "module_options"]


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


def admissible(b: int, l: int, s: int, key_padding_mask, is_causal: bool, window: int | None = None) -> torch.Tensor:
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
                   value: torch.Tensor | None = None, softcap: float | None = None,
                   scale: float | None = None) -> Approx:
    """softmax(σ q kᵀ) v per head, σ = ``scale`` (default 1/√E), q (b, l, h, E), k and v (b, s, h, E) already mapped
    to query heads, ``visible`` (b, 1 or h, l, s); scores capped to X·tanh(score / X) under ``softcap`` X.  Returns
    (b, l, h, E).  ``value`` replaces the float64 result (the single-head clause computes it with
    ``properties.core.oracle.reference_attention``)."""
    u = effective_u(dtype)
    e, s = q.value.shape[-1], k.value.shape[1]
    sigma = 1.0 / math.sqrt(e) if scale is None else scale
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
    underflow = tiny * torch.einsum("bhls,bshe->blhe", visible.to(torch.float64), v.magnitude)
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
    visible = admissible(b, l, s, key_padding_mask, is_causal, window if memory is None else None)
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
    visible = admissible(b, l, s, key_padding_mask, is_causal, window if memory is None else None)
    # The kernel oracle has no softcap: with one, the value is attention_core's own float64 result.
    attended = None if softcap else reference_attention(q.value, k.value, v.value,
                                                         attn_mask=visible[:, 0]).output[:, :, None]  # (b, l, 1, d)
    one_head = attention_core(q.map(lambda t: t[:, :, None]), k.map(lambda t: t[:, :, None]),
                              v.map(lambda t: t[:, :, None]), visible, dtype, value=attended, softcap=softcap)
    return linear(one_head.map(lambda t: t[:, :, 0]), p.wo, p.bo, u)


def module_options(module) -> dict:
    """The FlashAttention options an attention module declares (``window``, ``softcap``: the zoo's
    MultiHeadAttention attributes), as keywords of the oracles; a module without them has neither."""
    return {name: getattr(module, name) for name in ("window", "softcap") if getattr(module, name, None) is not None}
