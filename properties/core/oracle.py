"""The fp64 oracle: softmax(Q K^T * scale + mask) V, written here from the definition.

It does not call ``zoo.nn.kernel``: a reference that shares code with the implementation under test shares
its bugs.  Every input is converted to float64 on the CPU (exactly: every tested dtype embeds in float64)
and evaluated there, whatever device the kernel ran on.

Semantics (SPEC.md): a bool mask says True = may attend; a float mask is added to the scores;
``is_causal`` keeps key j for query i iff j <= i + offset, offset 0 (top-left, PyTorch) or S - L
(bottom-right, FlashAttention); with ``enable_gqa`` query head i reads key/value head i // (H / H_kv);
a query with no admissible key has all-zero weights and outputs zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from properties.core.options import ALIGNMENTS

__all__ = ["Reference", "causal_allowed", "default_scale", "expand_kv_heads",
           "reference_scores", "softmax_rows", "reference_attention", "to_float64"]


def default_scale(e: int) -> float:
    """The paper's 1/sqrt(d_k) (3.2.1)."""
    return 1.0 / math.sqrt(e)


def to_float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def causal_allowed(l: int, s: int, alignment: str = "top-left") -> torch.Tensor:
    """(l, s) bool matrix: key j is admissible for query i iff j <= i + offset."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"causal alignment {alignment!r}: expected one of {ALIGNMENTS}")
    offset = 0 if alignment == "top-left" else s - l
    return torch.ones(l, s, dtype=torch.bool).tril(diagonal=offset)


def expand_kv_heads(t: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Grouped-query attention: query head i reads key/value head i // (query_heads / kv_heads)."""
    kv_heads = t.shape[-3]
    if query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of key/value heads ({kv_heads})")
    return t.repeat_interleave(query_heads // kv_heads, dim=-3)


def reference_scores(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                     causal_alignment="top-left") -> torch.Tensor:
    """fp64 scores (..., l, s): q k^T * scale plus the float mask, -inf where a key is not admissible."""
    q, k = to_float64(query), to_float64(key)
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = expand_kv_heads(k, q.shape[-3])
    scale = default_scale(q.shape[-1]) if scale is None else scale
    # Scaling q first keeps every partial sum at the size of the scaled scores, so scores within the
    # dtype's range never overflow here (SPEC.md, ATTN-LARGE-SCORES).
    scores = (q * scale) @ k.transpose(-1, -2)
    if attn_mask is not None:
        mask = attn_mask.detach().to("cpu")
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(torch.float64)
    if is_causal:
        scores = scores.masked_fill(~causal_allowed(q.shape[-2], k.shape[-2], causal_alignment),
                                    float("-inf"))
    return scores


def softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis; a row that is all -inf (no admissible key) becomes all zeros."""
    row_max = scores.amax(dim=-1, keepdim=True)
    no_key = row_max == float("-inf")
    unnormalized = torch.exp(scores - torch.where(no_key, torch.zeros_like(row_max), row_max))
    total = unnormalized.sum(dim=-1, keepdim=True)
    return torch.where(no_key, torch.zeros_like(unnormalized),
                       unnormalized / torch.where(no_key, torch.ones_like(total), total))


@dataclass(frozen=True)
class Reference:
    scores: torch.Tensor   # (..., l, s) float64, -inf where not admissible
    weights: torch.Tensor  # (..., l, s) float64; rows with no admissible key are all zero
    output: torch.Tensor   # (..., l, v) float64

    @property
    def no_key_rows(self) -> torch.Tensor:
        """(..., l) bool: queries with no admissible key."""
        return (self.scores == float("-inf")).all(dim=-1)


def reference_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                        causal_alignment="top-left") -> Reference:
    """The oracle, called with the kernel contract's arguments (float64, CPU); ``value`` None is V = I."""
    scores = reference_scores(query, key, attn_mask, is_causal, scale, enable_gqa, causal_alignment)
    weights = softmax_rows(scores)
    if value is None:   # V = I: the output is the weight matrix
        return Reference(scores, weights, weights)
    v = to_float64(value)
    if enable_gqa and v.dim() >= 3 and v.shape[-3] != scores.shape[-3]:
        v = expand_kv_heads(v, scores.shape[-3])
    return Reference(scores, weights, weights @ v)
