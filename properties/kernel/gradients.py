"""The backward pass: the float64 oracle of dQ, dK, dV (and of a float mask) and the bound a correct kernel meets.

Chain rule through softmax (SPEC.md, "Gradients"; FlashAttention-2, Algorithm 2), per batch and head slice,
with W = softmax(S), S = scale·Q K̄ᵀ + M, O = W V̄ (K̄, V̄: key/value heads expanded to the query heads) and
an upstream gradient dO:

    dV̄ = Wᵀ dO          dW = dO V̄ᵀ          D = rowsum(W ∘ dW) = rowsum(dO ∘ O)
    dS = W ∘ (dW − D)    dQ = scale·dS K̄     dK̄ = scale·dSᵀ Q      dM = dS
    dK, dV = dK̄, dV̄ summed over each key/value head's query group (grouped-query attention)

Dropout multiplies W by keep/(1 − p) after the softmax: then O = W̃ V̄ with W̃ = W ∘ keep/(1 − p), dV̄ = W̃ᵀ dO,
and dS = W ∘ (dW ∘ keep/(1 − p) − D) with D = rowsum(W̃ ∘ dW).

Bound: the same rounding model as the forward pass (core/tolerance.py), carried through these formulas
step by step to first order. The weights a kernel uses lie in [lower, upper] of ``softmax_bounds`` (whether
stored, recomputed tile by tile from the row log-sum-exp, or computed in a wider type); every product of n
terms and its rounding to the dtype add γ(n + 2) times the sum of the absolute terms; D is bounded for both
ways a kernel may form it (from its rounded output O, or from W and dW), and the larger bound is used.
Magnitudes are those of the exact quantities plus their own error bound, so the bound never relies on the
kernel's numbers. It is a worst case: a correct kernel cannot exceed it (no flaky failures).

The log-sum-exp λ = log Σ_j exp(S_j) a kernel returns beside its output (``lse_gradient_oracle``) has the weights as
its gradient: for an upstream gradient g (one number per query), dS = g ∘ W, dQ = scale·dS K̄, dK̄ = scale·dSᵀ Q,
and nothing reaches V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from properties.core.oracle import expand_kv_heads, to_float64
from properties.core.tolerance import SoftmaxBounds, gamma, output_bound, rounding_error, unit_roundoff

__all__ = ["Gradients", "gradient_oracle", "lse_gradient_oracle", "group_sum"]

_F64 = torch.float64


@dataclass(frozen=True)
class Gradients:
    """Oracle gradients (float64, CPU) and elementwise bounds on a correct kernel's error, by input name."""
    value: dict   # "query", "key", "value" (and "attn_mask") -> exact gradient
    bound: dict   # the same names -> bound on |kernel's gradient - exact|


def group_sum(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(..., H, n, m) -> (..., kv_heads, n, m): the sum over each key/value head's query group."""
    if t.dim() < 3 or t.shape[-3] == kv_heads:
        return t
    return t.unflatten(-3, (kv_heads, t.shape[-3] // kv_heads)).sum(-3)


def _reduce_to(t: torch.Tensor, shape) -> torch.Tensor:
    """Sum a broadcast gradient back to the shape of the tensor that was broadcast (a mask)."""
    while t.dim() > len(shape):
        t = t.sum(0)
    for axis, size in enumerate(shape):
        if size == 1 and t.shape[axis] != 1:
            t = t.sum(axis, keepdim=True)
    return t


def _g(n: int, dtype: torch.dtype, stored: int | None = None) -> float:
    """γ(n) of the tested dtype plus the float64 oracle's; with ``stored``, n - stored of the n roundings are those
    of a float32 accumulation for float16/bfloat16 (core/tolerance.py, step 1)."""
    tested = gamma(n, unit_roundoff(dtype)) if stored is None else rounding_error(n - stored, stored, dtype)
    return tested + gamma(n, unit_roundoff(_F64))


def softcap_slope(query, key, *, scale: float, softcap: float, dtype: torch.dtype):
    """(c, e_c): the slope c = 1 − tanh²(r/X) of the soft cap X·tanh(r/X) at each raw score r = σ q·k (heads
    first, (..., h, l, s); grouped key heads are expanded to the query heads), and a bound on a kernel's own
    slope: its raw score is off by at most γ(E + 2)·σ·Σ|q_e k_e| (a dot product and the scale) and
    |dc/dr| ≤ 4/(3√3)/X, and 1 − t̂² with t̂ = tanh to 4 ulp adds at most 10u (|t| ≤ 1; a square, a subtraction)."""
    q, k = to_float64(query), to_float64(key)
    if k.shape[-3] != q.shape[-3]:
        k = expand_kv_heads(k, q.shape[-3])
    raw = scale * q @ k.transpose(-1, -2)
    c = 1.0 - torch.tanh(raw / softcap) ** 2
    e_raw = _g(q.shape[-1] + 2, dtype) * abs(scale) * (q.abs() @ k.abs().transpose(-1, -2))
    return c, (4.0 / (3.0 * 3.0 ** 0.5)) / softcap * e_raw + _g(10, dtype)


def gradient_oracle(bounds: SoftmaxBounds, query, key, value, grad_out, *, scale: float, attn_mask=None,
                    keep: torch.Tensor | None = None, p: float = 0.0, score_slope=None) -> Gradients:
    """Exact gradients of sum(out ∘ grad_out) and their bounds, from the forward's oracle and weight bounds.

    ``keep`` (bool, the weights' shape) is a realised dropout mask with probability ``p`` of a drop.
    ``score_slope`` (c, e_c): the scores are a function of the raw σ q·k with slope c (a soft cap, see
    ``softcap_slope``), known to within e_c: the chain rule multiplies the scores' gradient by it."""
    dtype = bounds.dtype
    w, upper = bounds.weights, bounds.upper
    dev = torch.maximum(upper - w, w - bounds.lower)            # |Ŵ - W| for any correct kernel
    q, k, v, do = (to_float64(t) for t in (query, key, value, grad_out))
    heads, kv_heads = q.shape[-3] if q.dim() >= 3 else None, k.shape[-3] if k.dim() >= 3 else None
    if heads is not None and kv_heads != heads:
        k, v = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    l, s, ev = q.shape[-2], k.shape[-2], v.shape[-1]
    tiny = torch.finfo(dtype).tiny
    factor = 1.0 / (1.0 - p)
    drop = torch.ones_like(w) if keep is None else keep.to(_F64) * factor
    w_used, upper_used, dev_used = w * drop, upper * drop, dev * drop   # the weights applied to V

    t = lambda x: x.transpose(-1, -2)  # noqa: E731
    out = w_used @ v
    d_v = t(w_used) @ do
    d_w = (do @ t(v)) * drop
    d_rowsum = (w * d_w).sum(-1, keepdim=True)
    d_s = w * (d_w - d_rowsum)
    d_q, d_k = scale * d_s @ k, scale * t(d_s) @ q

    # Bounds, step by step (names as above, e_ for an error bound, m_ for |exact| + its error bound).
    extra = 0 if keep is None else 1                               # the rescale by 1/(1 - p)
    e_dw = _g(ev + 1 + extra, dtype, stored=1) * ((do.abs() @ t(v.abs())) * drop) + ev * tiny
    m_dw = d_w.abs() + e_dw
    e_out = output_bound(bounds, value, extra_roundings=extra, weight_factor=factor if keep is not None else 1.0)
    if heads is not None and e_out.shape[-3] != heads:
        e_out = expand_kv_heads(e_out, heads)
    m_out = out.abs() + e_out
    from_output = (do.abs() * e_out).sum(-1, keepdim=True) + _g(ev + 1, dtype, stored=1) * (do.abs() * m_out).sum(-1, keepdim=True)
    from_weights = ((dev * m_dw + upper * e_dw).sum(-1, keepdim=True)
                    + _g(s + 1, dtype, stored=1) * (upper * m_dw).sum(-1, keepdim=True))
    e_rowsum = torch.maximum(from_output, from_weights) + s * tiny
    m_rowsum = d_rowsum.abs() + e_rowsum
    e_ds = dev * (m_dw + m_rowsum) + upper * (e_dw + e_rowsum) + _g(3, dtype) * upper * (m_dw + m_rowsum) + tiny
    m_ds = d_s.abs() + e_ds
    d_scores, e_scores, m_scores = d_s, e_ds, m_ds   # the gradient of an additive mask: after any cap
    if score_slope is not None:
        slope, e_slope = score_slope
        d_s = slope * d_s
        e_ds = slope * e_ds + e_slope * m_ds + _g(1, dtype) * (slope + e_slope) * m_ds
        m_ds = d_s.abs() + e_ds
        d_q, d_k = scale * d_s @ k, scale * t(d_s) @ q
    sigma = abs(scale)
    e_dq = sigma * (e_ds @ k.abs() + _g(s + 3, dtype, stored=2) * (m_ds @ k.abs())) + s * tiny
    e_dk = sigma * (t(e_ds) @ q.abs() + _g(l + 3, dtype, stored=2) * (t(m_ds) @ q.abs())) + l * tiny
    e_dv = t(dev_used) @ do.abs() + _g(l + 2 + extra, dtype, stored=1) * (t(upper_used) @ do.abs()) + l * tiny

    value_grads = {"query": d_q, "key": d_k, "value": d_v}
    bound = {"query": e_dq, "key": e_dk, "value": e_dv}
    if heads is not None and kv_heads != heads:
        group = heads // kv_heads
        for name, exact in (("key", d_k), ("value", d_v)):
            magnitude = exact.abs() + bound[name]
            value_grads[name] = group_sum(exact, kv_heads)
            bound[name] = group_sum(bound[name], kv_heads) + _g(group, dtype) * group_sum(magnitude, kv_heads)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        shape = tuple(attn_mask.shape)
        value_grads["attn_mask"] = _reduce_to(d_scores, shape)
        n = max(1, d_s.numel() // max(1, attn_mask.numel()))
        bound["attn_mask"] = _reduce_to(e_scores, shape) + _g(n + 1, dtype, stored=1) * _reduce_to(m_scores, shape)
    return Gradients(value_grads, bound)


def lse_gradient_oracle(bounds: SoftmaxBounds, query, key, upstream, *, scale: float) -> Gradients:
    """Exact gradients of sum(lse ∘ upstream) with respect to query and key (float64 autograd of torch.logsumexp over
    the admissible scores less their maximum; 0 from a query without an admissible key), and their bounds: dS = g ∘ W
    formed from weights within [lower, upper] (one rounded product), then dQ = scale·dS K̄ and dK̄ = scale·dSᵀ Q as in
    ``gradient_oracle`` (products of S and L terms, the scale, the rounding to the dtype), dK summed over each key/value
    head's group."""
    dtype = bounds.dtype
    w, upper = bounds.weights, bounds.upper
    dev = torch.maximum(upper - w, w - bounds.lower)
    no_key = bounds.reference.no_key_rows
    q = to_float64(query).requires_grad_()
    k = to_float64(key).requires_grad_()
    heads, kv_heads = q.shape[-3] if q.dim() >= 3 else None, k.shape[-3] if k.dim() >= 3 else None
    wide = expand_kv_heads(k, heads) if heads is not None and kv_heads != heads else k
    admissible = bounds.admissible
    finite_scores = torch.where(admissible, bounds.reference.scores, torch.zeros_like(w))
    raw = (q * scale) @ wide.transpose(-1, -2)
    # the scores as a function of q and k: the float mask (what the reference adds beyond σ q·k) held constant
    scores = (raw + (finite_scores - raw.detach())).masked_fill(~admissible, float("-inf"))
    scores = torch.where(no_key[..., None], torch.zeros_like(raw), scores)   # (their upstream is 0 here: no NaN)
    g = torch.where(no_key, torch.zeros_like(to_float64(upstream)), to_float64(upstream))
    # shifted by the row's maximum (a constant: the same gradient), so that the oracle's own LSE is rounded at the size
    # of log S, not at the size of the scores (an error of u·|λ| in every exp(s − λ) of its backward)
    top = scores.detach().amax(-1, keepdim=True)
    torch.logsumexp(scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top)), dim=-1).backward(g)
    d_q, d_k = q.grad, k.grad

    t = lambda x: x.transpose(-1, -2)  # noqa: E731
    x_q, x_k = to_float64(query).abs(), to_float64(wide).abs()
    g_abs = to_float64(upstream).abs().masked_fill(no_key, 0.0)[..., None]
    e_ds = g_abs * (dev + _g(1, dtype) * upper)
    m_ds = g_abs * (w + dev) * (1 + _g(1, dtype))
    l, s = q.shape[-2], wide.shape[-2]
    tiny = torch.finfo(dtype).tiny
    sigma = abs(scale)
    e_dq = sigma * (e_ds @ x_k + _g(s + 3, dtype, stored=2) * (m_ds @ x_k)) + s * tiny
    e_dk = sigma * (t(e_ds) @ x_q + _g(l + 3, dtype, stored=2) * (t(m_ds) @ x_q)) + l * tiny
    if heads is not None and kv_heads != heads:
        magnitude = sigma * (t(m_ds) @ x_q) + e_dk
        e_dk = group_sum(e_dk, kv_heads) + _g(heads // kv_heads, dtype) * group_sum(magnitude, kv_heads)
    return Gradients({"query": d_q.detach(), "key": d_k.detach()}, {"query": e_dq, "key": e_dk})
