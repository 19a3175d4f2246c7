"""Broken partial states: kernels that return their LSE (``--returns-lse``) and merge kernels (``--kernel-api merge``),
one realistic bug each, beside correct ones (SPEC.md, "Partial states and their merge").

``LseAttention`` is a correct SDPA-signature kernel returning (out, lse) and ``MergeBase`` a correct merge with
FlashInfer's ``merge_state`` (and ``merge_states``) signature, both in plain torch, written from the formulas (not
from the zoo, so that the catalog does not change when the zoo does), in overridable steps; each bug overrides one
step and is declared by the ``@bug`` above it.

    pytest properties/ --kernel-api merge --kernel properties.catalog.merge_bugs:merge_without_max_subtraction
    pytest properties/ --kernel properties.catalog.merge_bugs:lse_in_base_two --returns-lse
"""
from __future__ import annotations

import math

import torch

from properties.catalog._utils import compute_dtype
from properties.catalog.registry import bug, correct

__all__ = ["LseAttention", "lse_attention", "lse_zero_when_empty", "lse_in_base_two", "lse_unscaled",
           "lse_normalizer_detached", "MergeBase", "merge_base", "merge_base_two", "merged_in_bfloat16",
           "merge_nan_when_both_empty", "merge_empty_as_finite", "merge_in_base_two", "merge_without_max_subtraction"]

_RETURNS_LSE = ("--returns-lse",)


# ------------------------------------------------------------------------------------- kernels returning their LSE
@correct("lse_attention", mechanism="SDPA returning (out, lse), written from the definition in overridable steps",
         instance="lse_attention", extra=_RETURNS_LSE)
class LseAttention:
    """SDPA's contract returning (out, lse) in plain torch: scores, mask, max-subtracted exponentials, their sum."""

    def scores(self, q, k, scale, ct):
        return torch.einsum("...le,...se->...ls", q.to(ct) * scale, k.to(ct))

    def row_max(self, scores):
        top = scores.amax(-1, keepdim=True)
        return torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()

    def lse(self, scores, top, total, scale):
        """The log-sum-exp of each row from its maximum and its sum of exp(s − max); −∞ for a row without a key."""
        some = total > 0
        return torch.where(some, top + torch.log(torch.where(some, total, torch.ones_like(total))),
                           torch.full_like(total, -math.inf)).squeeze(-1)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if dropout_p > 0:
            raise NotImplementedError("dropout is not supported")
        l, s, e = query.shape[-2], key.shape[-2], query.shape[-1]
        if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
            group = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
        ct = compute_dtype(query.dtype)
        scale = 1.0 / math.sqrt(e) if scale is None else scale
        scores = self.scores(query, key, scale, ct)
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                      else scores + attn_mask.to(ct))
        if is_causal:
            scores = scores.masked_fill(torch.ones(l, s, dtype=torch.bool, device=query.device).triu(1), -math.inf)
        top = self.row_max(scores)
        p = torch.exp(scores - top)
        total = p.sum(-1, keepdim=True)
        out = (p @ value.to(ct)) / torch.where(total > 0, total, torch.ones_like(total))
        return out.to(query.dtype), self.lse(scores, top, total, scale)


lse_attention = LseAttention()


@bug("LSE-ORACLE", mechanism="the LSE buffer is zero-initialized and a query with no admissible key is never "
     "written: its LSE is 0, not −∞, and a merge weighs its output as attention (vllm PR #49294)",
     instance="lse_zero_when_empty", extra=_RETURNS_LSE)
class _LseZeroWhenEmpty(LseAttention):
    def lse(self, scores, top, total, scale):
        return torch.where(total > 0, top + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                           torch.zeros_like(total)).squeeze(-1)


lse_zero_when_empty = _LseZeroWhenEmpty()


@bug("LSE-ORACLE", mechanism="the LSE returned in base 2 (the exp2 form of the kernel's softmax) where the natural log "
     "is declared", instance="lse_in_base_two", extra=_RETURNS_LSE)
class _LseInBaseTwo(LseAttention):
    def lse(self, scores, top, total, scale):
        return super().lse(scores, top, total, scale) / math.log(2.0)


lse_in_base_two = _LseInBaseTwo()


@bug("LSE-ORACLE", mechanism="the LSE taken of the scores before the scale (log Σ exp(q·k)), the output right",
     instance="lse_unscaled", extra=_RETURNS_LSE)
class _LseUnscaled(LseAttention):
    def lse(self, scores, top, total, scale):
        return torch.logsumexp(scores / scale, dim=-1)


lse_unscaled = _LseUnscaled()


@bug("LSE-GRAD", mechanism="the row sum detached for stability and the row maximum not: d lse / d s is the one-hot of "
     "the row's maximum instead of the weights", instance="lse_normalizer_detached", extra=_RETURNS_LSE)
class _LseNormalizerDetached(LseAttention):
    def row_max(self, scores):
        top = scores.amax(-1, keepdim=True)
        return torch.where(torch.isfinite(top), top, torch.zeros_like(top))

    def lse(self, scores, top, total, scale):
        return super().lse(scores, top, total.detach(), scale)


lse_normalizer_detached = _LseNormalizerDetached()


# ------------------------------------------------------------------------------------------------- merge kernels
@correct("merge_base", mechanism="FlashInfer's merge_state and merge_states written from the merge formula",
         api="merge", instance="merge_base")
class MergeBase:
    """FlashInfer's ``merge_state(v_a, s_a, v_b, s_b)`` and ``merge_states(v, s)`` in plain torch: every state rescaled
    once by exp(s_i − max) in float32 (float64 for float64 states), an empty state (s = −∞) weighing 0, a merge of
    empty states only (0, −∞). ``base``: the LSE's base ("e", or 2 as FlashInfer's own kernels)."""

    base = "e"

    def compute_dtype(self, v):
        return torch.float64 if v.dtype == torch.float64 else torch.float32

    def exp(self, x):
        return torch.exp2(x) if self.base == "2" else torch.exp(x)

    def log(self, x):
        return torch.log2(x) if self.base == "2" else torch.log(x)

    def entering(self, s, ct):
        """The LSEs as the merge reads them."""
        return s.to(ct)

    def top(self, s, dim):
        top = s.amax(dim, keepdim=True)
        return torch.where(torch.isfinite(top), top, torch.zeros_like(top))

    def combine(self, v, s, dim):
        """Merge the states stacked on ``dim`` of s (and of v, which has one more trailing axis)."""
        ct = self.compute_dtype(v)
        s, v = self.entering(s, ct), v.to(ct)
        top = self.top(s, dim)
        w = self.exp(s - top)
        total = w.sum(dim, keepdim=True)
        some = total > 0
        out = (w[..., None] * v).sum(dim) / torch.where(some, total, torch.ones_like(total)).squeeze(dim)[..., None]
        lse = torch.where(some, top + self.log(torch.where(some, total, torch.ones_like(total))),
                          torch.full_like(total, -math.inf))
        return out, lse.squeeze(dim)

    def __call__(self, v_a, s_a, v_b, s_b):
        out, lse = self.combine(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1), 1)
        return out.to(v_a.dtype), lse.to(torch.promote_types(s_a.dtype, torch.float32))

    def merge_states(self, v, s):
        out, lse = self.combine(v, s, 1)
        return out.to(v.dtype), lse.to(torch.promote_types(s.dtype, torch.float32))


merge_base = MergeBase()


@correct("merge_base, base 2", mechanism="FlashInfer's merge with LSEs in base 2 (its exp2 kernels), declared",
         api="merge", instance="merge_base_two", extra=("--lse-base", "2"))
class _MergeBaseTwo(MergeBase):
    base = "2"


merge_base_two = _MergeBaseTwo()


@bug("MERGE-ORACLE", mechanism="partial outputs and LSEs merged in bfloat16 (the 16-bit accumulator of "
     "zhuzilin/ring-flash-attention#42): every merge rounds the state to 8 bits of mantissa", api="merge",
     instance="merged_in_bfloat16")
class _MergedInBfloat16(MergeBase):
    def compute_dtype(self, v):
        return torch.bfloat16


merged_in_bfloat16 = _MergedInBfloat16()


@bug("MERGE-EMPTY", "MERGE-ORACLE", mechanism="the maximum of the LSEs not guarded: where every state is empty, "
     "exp(−∞ − (−∞)) is NaN", api="merge", instance="merge_nan_when_both_empty")
class _MergeNanWhenBothEmpty(MergeBase):
    def top(self, s, dim):
        return s.amax(dim, keepdim=True)


merge_nan_when_both_empty = _MergeNanWhenBothEmpty()


@bug("MERGE-EMPTY", mechanism="−∞ LSEs replaced by finfo.min (torch.nan_to_num) to avoid NaN: a query whose states "
     "are all empty gets a finite LSE and the mean of their undefined outputs (vllm PR #49294)", api="merge",
     instance="merge_empty_as_finite")
class _MergeEmptyAsFinite(MergeBase):
    def entering(self, s, ct):
        return torch.nan_to_num(s.to(ct))


merge_empty_as_finite = _MergeEmptyAsFinite()


@bug("MERGE-ORACLE", mechanism="the LSEs read in base 2 (FlashInfer's exp2 convention) where the natural log is "
     "declared", api="merge", instance="merge_in_base_two")
class _MergeInBaseTwo(MergeBase):
    base = "2"


merge_in_base_two = _MergeInBaseTwo()


@bug("MERGE-ORACLE", "MERGE-EMPTY", mechanism="exp(s_i) without subtracting the largest LSE: overflow to inf (and "
     "NaN) once an LSE passes 88 in float32, underflow to 0/0 below −103", api="merge",
     instance="merge_without_max_subtraction")
class _MergeWithoutMaxSubtraction(MergeBase):
    def top(self, s, dim):
        return torch.zeros_like(s.amax(dim, keepdim=True))


merge_without_max_subtraction = _MergeWithoutMaxSubtraction()
