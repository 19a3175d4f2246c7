"""Partial attention states and their merge: the one home of the log-sum-exp (LSE) arithmetic that split attention is
built from (flash-decoding, cascade attention, chunked prefill, ring attention).

Attention of a query over a block of keys is the state (o, λ): o = Σ_j w_j v_j with the block's own softmax weights
and λ = log Σ_j exp(s_j), the block's log-sum-exp (natural log). Two states over disjoint key blocks A and B merge
into the state over A ∪ B exactly:

    λ = log(exp λ_A + exp λ_B)        o = exp(λ_A − λ) o_A + exp(λ_B − λ) o_B

A block with no admissible key for a query is the empty state (0, −∞): it has no weight in any merge, and merging only
empty states gives (0, −∞), the output the kernel contract asks of a query without an admissible key. Everything is
computed in the accumulation dtype (float32 for float16/bfloat16 inputs), max-subtracted so that no exponent
overflows, and no exp(−∞ − (−∞)) is ever formed (NaN).

Shapes (axis letters as in zoo/nn/kernel.py): q (b, h, l, e), k (b, k, s, e), v (b, k, s, v) with h = k·g (query head
i reads key/value head i // g); a state's output (..., l, v) and its LSE (..., l). ``merge_state`` and
``merge_states`` have FlashInfer's signatures (``flashinfer.cascade``): v (seq, heads, dim), s (seq, heads), and the
many-state form v (seq, states, heads, dim), s (seq, states, heads).

``attention_with_lse`` is the whole computation as a kernel with the SDPA signature that returns its LSE too, (out,
lse): what ``pytest properties/ --kernel zoo.nn.partial:attention_with_lse --returns-lse`` verifies, and the state a
caller merges with ``merge_state``.
"""
from __future__ import annotations

import math

import torch
from einops import einsum, reduce, repeat

from zoo.nn.flash_dense import compute_dtype
from zoo.nn.kernel import matched_key_value

__all__ = ["expand_heads", "block_attention", "attention_with_lse", "attention_delta",
           "block_attention_backward", "merge", "merge_stacked", "merge_state", "merge_states"]


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: (b, k, s, x) -> (b, h, s, x), query head i reading key/value head i // (h / k)."""
    kv_heads = t.shape[-3]
    if kv_heads == heads:
        return t
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    return repeat(t, "b k s x -> b (k g) s x", g=heads // kv_heads)


def _scores(q, k, scale, q_positions, k_positions, ct):
    """Scaled scores (b, h, l, s) in ``ct``; −inf where a key's position lies after the query's (causal)."""
    scores = einsum(q.to(ct) * scale, k.to(ct), "b h l e, b h s e -> b h l s")
    if q_positions is not None:
        scores = scores.masked_fill(k_positions[None, :] > q_positions[:, None], -math.inf)
    return scores


def _finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _state_of_scores(scores: torch.Tensor, v: torch.Tensor):
    """The state (out (..., l, v), lse (..., l)) of scores (..., l, s) in the accumulation dtype (−inf where a key is
    not admissible) over values (..., s, v) of that dtype; a query with no admissible key gets (0, −∞). Differentiable
    at every query (no inf − inf is formed): the row maximum is detached, on which neither depends."""
    row_max = _finite_or_zero(scores.amax(-1, keepdim=True)).detach()
    p = torch.exp(scores - row_max)
    total = p.sum(-1, keepdim=True)
    some = total > 0
    safe_total = torch.where(some, total, torch.ones_like(total))
    out = einsum(p, v, "... l s, ... s v -> ... l v") / safe_total
    lse = torch.where(some, row_max + torch.log(safe_total), torch.full_like(total, -math.inf))
    return out, lse.squeeze(-1)


def block_attention(q, k, v, *, scale: float, q_positions=None, k_positions=None):
    """The partial state (out (b, h, l, v), lse (b, h, l)) of q over one block of keys, in the accumulation dtype.

    With positions (1-D integer tensors, the global positions of q's rows and of the block's keys), key j is
    admissible for query i iff k_positions[j] <= q_positions[i] (causal); a query with none gets (0, −∞).
    Differentiable with autograd, also at such queries (no inf − inf is formed)."""
    ct = compute_dtype(q.dtype)
    heads = q.shape[-3]
    if k.shape[-2] == 0:   # no keys at all: the empty state
        out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=ct) + 0 * q.sum().to(ct)   # stays in the graph
        return out, torch.full(q.shape[:-1], -math.inf, dtype=ct, device=q.device)
    scores = _scores(q, expand_heads(k, heads), scale, q_positions, k_positions, ct)
    return _state_of_scores(scores, expand_heads(v, heads).to(ct))


def attention_with_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """SDPA's contract (zoo/nn/kernel.py), returning (out, lse): out (..., l, v) in the query's dtype and lse (..., l),
    the natural log-sum-exp of each query's scores σ q·k + mask over its admissible keys, in the accumulation dtype
    (float32 for half-precision inputs); a query with no admissible key gets (0, −∞). Zero, one or two leading dims;
    ``is_causal`` top-left aligned; differentiable in query, key, value and a float mask, lse included. Dropout is
    declined (the LSE does not depend on it, but the state a merge reads would)."""
    if dropout_p > 0.0:
        raise NotImplementedError("attention_with_lse does not support dropout_p > 0")
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True cannot be combined with an explicit attn_mask")
    l, s, e = query.shape[-2], key.shape[-2], query.shape[-1]
    key, value = matched_key_value(query, key, value, enable_gqa)
    ct = compute_dtype(query.dtype)
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    scores = einsum(query.to(ct) * scale, key.to(ct), "... l e, ... s e -> ... l s")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.to(ct)
    elif attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    if is_causal:
        future = torch.ones(l, s, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    out, lse = _state_of_scores(scores, value.to(ct))
    return out.to(query.dtype), lse


def attention_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO ∘ O) (b, h, l) of the whole output: the softmax's backward term (FlashAttention-2, Alg. 2)."""
    return einsum(grad_out.to(out.dtype), out, "b h l v, b h l v -> b h l")


def block_attention_backward(q, k, v, grad_out, lse, delta, *, scale: float, q_positions=None, k_positions=None):
    """One block's share of the backward pass, from the whole output's LSE and ``attention_delta``: (dq (b, h, l, e),
    dk (b, k, s, e), dv (b, k, s, v)) in the accumulation dtype, dk and dv summed over each key/value head's query
    group. The weights are recomputed as exp(s − lse); a query whose LSE is −inf (no admissible key anywhere) has
    weight 0 on every key, never exp(−inf − (−inf)).

        w = exp(s − lse)     dv = wᵀ dO     dS = w ∘ (dO vᵀ − D)     dq = σ dS k     dk = σ dSᵀ q
    """
    ct = compute_dtype(q.dtype)
    heads, kv_heads = q.shape[-3], k.shape[-3]
    kx, vx = expand_heads(k, heads).to(ct), expand_heads(v, heads).to(ct)
    scores = _scores(q, kx, scale, q_positions, k_positions, ct)
    finite = torch.isfinite(lse)[..., None]
    w = torch.where(finite, torch.exp(scores - _finite_or_zero(lse)[..., None]), torch.zeros_like(scores))
    do = grad_out.to(ct)
    ds = w * (einsum(do, vx, "b h l v, b h s v -> b h l s") - delta[..., None])
    dq = scale * einsum(ds, kx, "b h l s, b h s e -> b h l e")
    dk = scale * einsum(ds, q.to(ct), "b h l s, b h l e -> b h s e")
    dv = einsum(w, do, "b h l s, b h l v -> b h s v")
    group = heads // kv_heads
    return (dq, reduce(dk, "b (k g) s e -> b k s e", "sum", g=group),
            reduce(dv, "b (k g) s v -> b k s v", "sum", g=group))


def merge(out_a, lse_a, out_b, lse_b):
    """The state over A ∪ B from the states over disjoint key blocks A and B (module docstring); outputs (..., v),
    LSEs (...), in the dtype they come in."""
    top = _finite_or_zero(torch.maximum(lse_a, lse_b))
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)   # exp(−inf − finite) = 0: an empty state weighs 0
    total = w_a + w_b
    some = total > 0
    safe_total = torch.where(some, total, torch.ones_like(total))
    out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / safe_total[..., None]
    lse = torch.where(some, top + torch.log(safe_total), torch.full_like(total, -math.inf))
    return out, lse


def merge_stacked(out, lse, dim: int):
    """Merge the states stacked along ``dim`` of ``lse`` (and the same axis of ``out``, which has one more, trailing
    axis): one rescale per state, from the largest LSE."""
    dim = dim % lse.dim()
    top = _finite_or_zero(lse.amax(dim, keepdim=True))
    w = torch.exp(lse - top)
    total = w.sum(dim, keepdim=True)
    some = total > 0
    safe_total = torch.where(some, total, torch.ones_like(total))
    merged = (w[..., None] * out).sum(dim) / safe_total.squeeze(dim)[..., None]
    merged_lse = torch.where(some, top + torch.log(safe_total), torch.full_like(total, -math.inf))
    return merged, merged_lse.squeeze(dim)


def _merge_dtype(v: torch.Tensor, s: torch.Tensor) -> torch.dtype:
    return torch.promote_types(compute_dtype(v.dtype), s.dtype if s.dtype.is_floating_point else torch.float32)


def merge_state(v_a, s_a, v_b, s_b):
    """FlashInfer's ``merge_state``: v (seq, heads, dim) in any float dtype, s (seq, heads) float32 (natural log) ->
    (v merged in v_a's dtype, s merged in float32, or float64 for float64 states)."""
    ct = _merge_dtype(v_a, s_a)
    v, s = merge(v_a.to(ct), s_a.to(ct), v_b.to(ct), s_b.to(ct))
    return v.to(v_a.dtype), s.to(torch.promote_types(s_a.dtype, torch.float32))


def merge_states(v, s):
    """FlashInfer's ``merge_states``: v (seq, states, heads, dim), s (seq, states, heads) -> (v (seq, heads, dim),
    s (seq, heads)), dtypes as ``merge_state``."""
    ct = _merge_dtype(v, s)
    merged, lse = merge_stacked(v.to(ct), s.to(ct), dim=1)
    return merged.to(v.dtype), lse.to(torch.promote_types(s.dtype, torch.float32))
