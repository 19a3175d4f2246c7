"""Broken attention kernels (SDPA signature), one realistic bug each.

Each is ``properties.catalog.correct.StepwiseAttention`` (or ``flash_attention``) with one step replaced;
the docstring says what goes wrong and why such code gets written, and the ``@bug`` above it declares the catalog
entry: the mechanism in a line and the clauses expected to catch it. Plug one in as a user would:

    pytest properties/ --kernel properties.catalog.kernels:softmax_over_queries
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from properties.catalog.correct import StepwiseAttention, flash_attention
from properties.catalog.registry import bug

__all__ = [
    "softmax_over_queries", "scale_missing", "scale_inverted", "scale_applied_twice", "scale_by_model_width",
    "scale_by_value_width", "scale_by_head_count", "scale_argument_ignored", "causal_off_by_one",
    "causal_ignored", "causal_bottom_right", "bool_mask_inverted", "float_mask_ignored", "mask_after_softmax",
    "fully_masked_rows_nan", "finite_mask_fill", "mask_added_in_input_dtype", "masked_fill_minus_1e9", "softmax_without_max", "scores_in_input_dtype",
    "dropout_always_on", "dropout_not_rescaled", "dropout_mask_shared", "dropout_mask_shared_across_heads",
    "batch_and_heads_mixed", "flash_attention_tiles_dropped",
    "gqa_heads_tiled", "output_in_compute_dtype",
]


# ---------------------------------------------------------------------------------------------- softmax
@bug("ATTN-ROWSUM", "ATTN-ORACLE", instance="softmax_over_queries",
     mechanism="softmax normalizes over the query axis (dim=-2), not the keys")
class _SoftmaxOverQueries(StepwiseAttention):
    """Normalizes over the query axis (dim=-2) instead of the key axis: the "softmax(dim=1)" of code written
    for (L, S) score matrices, applied to batched (..., L, S) scores."""

    def softmax(self, scores, allowed):
        return super().softmax(scores.transpose(-1, -2), allowed).transpose(-1, -2)


@bug("ATTN-LARGE-SCORES", "ATTN-SHIFT-INVARIANT", instance="softmax_without_max",
     mechanism="exp(s)/sum exp(s) without subtracting the row max: overflow to inf/inf = NaN")
class _SoftmaxWithoutMax(StepwiseAttention):
    """exp(s) / Σ exp(s) without subtracting the row maximum: exp overflows to inf for scores above ~88
    (float32) and the row becomes inf/inf = NaN."""

    def softmax(self, scores, allowed):
        unnormalized = torch.exp(scores)
        total = unnormalized.sum(dim=-1, keepdim=True)
        return unnormalized / torch.where(total > 0, total, torch.ones_like(total))


@bug("MASK-FULLY-MASKED", instance="fully_masked_rows_nan",
     mechanism="plain softmax over an all -inf row: NaN instead of zeros")
class _FullyMaskedRowsNaN(StepwiseAttention):
    """The textbook softmax over −inf-filled scores: a query whose keys are all masked gets
    exp(−inf − (−inf)) = NaN (the behaviour of PyTorch's SDPA before 2.5 and of many hand-written kernels)."""

    def softmax(self, scores, allowed):
        return torch.softmax(scores, dim=-1)


# ---------------------------------------------------------------------------------------------- scaling
@bug("SCALE-DEFAULT", "SCALE-VARIANCE", "ATTN-ORACLE", instance="scale_missing",
     mechanism="the 1/sqrt(d_k) factor forgotten (scale=None treated as 1)")
class _ScaleMissing(StepwiseAttention):
    """Plain dot-product attention: the 1/√d_k factor forgotten (scale=None treated as 1)."""

    def scale(self, query, key, value, scale):
        return 1.0 if scale is None else scale


@bug("SCALE-DEFAULT", "SCALE-VARIANCE", "ATTN-ORACLE", instance="scale_inverted",
     mechanism="multiplies by sqrt(d_k) instead of dividing")
class _ScaleInverted(StepwiseAttention):
    """Multiplies by √d_k instead of dividing (``scale = math.sqrt(E)``)."""

    def scale(self, query, key, value, scale):
        return math.sqrt(query.shape[-1]) if scale is None else scale


@bug("SCALE-DEFAULT", "SCALE-EXPLICIT", "SCALE-VARIANCE", "ATTN-ORACLE", instance="scale_applied_twice",
     mechanism="q pre-scaled and the scores scaled again: sigma^2 = 1/d_k")
class _ScaleAppliedTwice(StepwiseAttention):
    """Divides by √d_k twice (σ² = 1/E): the query is pre-scaled, as in fairseq/HF code that scales q at
    projection time, and the kernel scales the scores again."""

    def scores(self, query, key, sigma, ct):
        return super().scores(query, key, sigma, ct) * sigma


@bug("SCALE-DEFAULT", "ATTN-ORACLE", instance="scale_by_model_width",
     mechanism="divides by sqrt(d_model) = sqrt(H*E) instead of sqrt(d_k)")
class _ScaleByModelWidth(StepwiseAttention):
    """Divides by √d_model = √(H·E) instead of √d_k: the paper's d_k read as the model width."""

    def scale(self, query, key, value, scale):
        heads = query.shape[-3] if query.dim() >= 3 else 1
        return 1.0 / math.sqrt(heads * query.shape[-1]) if scale is None else scale


@bug("SCALE-DEFAULT", "ATTN-ORACLE", instance="scale_by_value_width",
     mechanism="divides by sqrt(d_v) (value.size(-1)) instead of sqrt(d_k)")
class _ScaleByValueWidth(StepwiseAttention):
    """Divides by √d_v (``value.size(-1)``) instead of √d_k: the two are equal in most models, so it goes
    unnoticed until E ≠ Ev."""

    def scale(self, query, key, value, scale):
        return 1.0 / math.sqrt(value.shape[-1]) if scale is None else scale


@bug("SCALE-DEFAULT", "ATTN-ORACLE", instance="scale_by_head_count",
     mechanism="head size read from dim 1, the head count in (B, H, L, E)")
class _ScaleByHeadCount(StepwiseAttention):
    """Reads the head size from dim 1 (``query.size(1)``), which in the (B, H, L, E) layout is the head
    count: code written for an unbatched (L, E) or a (B, E, ...) layout."""

    def scale(self, query, key, value, scale):
        return 1.0 / math.sqrt(query.shape[1]) if scale is None else scale


@bug("SCALE-EXPLICIT", instance="scale_argument_ignored",
     mechanism="the scale= keyword accepted and ignored (always 1/sqrt(E))")
class _ScaleArgumentIgnored(StepwiseAttention):
    """Accepts ``scale=`` but always uses 1/√E (the keyword added to the signature, not to the body)."""

    def scale(self, query, key, value, scale):
        return 1.0 / math.sqrt(query.shape[-1])


@bug("ATTN-LARGE-SCORES", instance="scores_in_input_dtype",
     mechanism="(q @ k^T) * scale in the input dtype, no upcast: the unscaled product overflows")
class _ScoresInInputDtype(StepwiseAttention):
    """Scores computed as (q @ kᵀ) · σ in the input dtype, with no upcast: the unscaled product of
    half-precision inputs overflows to inf where the scaled score is in range (and the SDPA docs'
    pseudo-code does exactly this)."""

    def compute_dtype(self, dtype):
        return dtype

    def scores(self, query, key, sigma, ct):
        return (query @ key.transpose(-1, -2)) * sigma


# ---------------------------------------------------------------------------------------------- masking
@bug("MASK-LOW-PRECISION", instance="mask_added_in_input_dtype",
     mechanism="float mask added after casting the scores back to float16: score + finfo.min overflows to -inf")
class _MaskAddedInInputDtype(StepwiseAttention):
    """Scores computed in float32 but cast back to the input dtype before the float mask is added (eager code
    of the form ``attn_weights.to(query.dtype) + causal_mask``): in float16 a negative score plus finfo.min
    overflows to −inf, so a row masked with finfo.min everywhere loses every key and outputs zeros instead of
    the softmax of its finite scores."""

    def admissible(self, scores, attn_mask, is_causal):
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            scores = (scores.to(attn_mask.dtype) + attn_mask).to(scores.dtype)
            attn_mask = None
        return super().admissible(scores, attn_mask, is_causal)


@bug("CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", "CAUSAL-ALIGNMENT", instance="causal_off_by_one",
     mechanism="causal mask tril(diagonal=1): each query also sees the next key")
class _CausalOffByOne(StepwiseAttention):
    """``tril(diagonal=1)``: every query also sees the next key (an off-by-one in the diagonal)."""

    def causal(self, l, s, device):
        return torch.ones(l, s, dtype=torch.bool, device=device).tril(diagonal=1)


@bug("CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", "CAUSAL-ALIGNMENT", instance="causal_ignored",
     mechanism="is_causal accepted and never applied")
class _CausalIgnored(StepwiseAttention):
    """``is_causal`` accepted and never used: only an explicit mask is applied."""

    def causal(self, l, s, device):
        return torch.ones(l, s, dtype=torch.bool, device=device)


@bug("CAUSAL-ALIGNMENT", "CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", instance="causal_bottom_right",
     mechanism="causal diagonal aligned bottom-right (FlashAttention >= 2.1) under PyTorch's top-left contract")
class _CausalBottomRight(StepwiseAttention):
    """Aligns the causal diagonal bottom-right (j ≤ i + S − L, FlashAttention ≥ 2.1) while claiming
    PyTorch's top-left semantics: differs whenever L ≠ S (decoding with a cache, chunked prefill)."""

    def causal(self, l, s, device):
        return torch.ones(l, s, dtype=torch.bool, device=device).tril(diagonal=s - l)


@bug("MASK-BOOL", "MASK-BOOL-FLOAT", "MASK-NO-INFLUENCE", "MASK-BROADCAST", instance="bool_mask_inverted",
     mechanism="bool mask read as True = masked (nn.MultiheadAttention's polarity)")
class _BoolMaskInverted(StepwiseAttention):
    """Treats a bool mask as True = masked out (the convention of nn.MultiheadAttention's masks) instead of
    SDPA's True = may attend."""

    def mask(self, scores, attn_mask, is_causal):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask
        return super().mask(scores, attn_mask, is_causal)


@bug("MASK-FLOAT-ADDITIVE", "MASK-BOOL-FLOAT", "MASK-LOW-PRECISION", "MASK-BROADCAST", instance="float_mask_ignored",
     mechanism="only bool masks handled: an additive float mask is dropped")
class _FloatMaskIgnored(StepwiseAttention):
    """Handles only bool masks: an additive float mask (ALiBi, relative bias, −inf padding) is dropped."""

    def mask(self, scores, attn_mask, is_causal):
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = None
        return super().mask(scores, attn_mask, is_causal)


@bug("MASK-BOOL", "MASK-BOOL-FLOAT", "ATTN-ROWSUM", "CAUSAL-ALIGNMENT", "MASK-BROADCAST", instance="mask_after_softmax",
     mechanism="masked weights zeroed after the softmax: rows no longer sum to 1")
class _MaskAfterSoftmax(StepwiseAttention):
    """Zeroes masked weights after the softmax instead of masking the scores before it: the remaining
    weights no longer sum to 1 (and masked keys still shrink every other weight)."""

    def mask(self, scores, attn_mask, is_causal):
        return self.admissible(scores, attn_mask, is_causal)  # nothing set to -inf

    def softmax(self, scores, allowed):
        return super().softmax(scores, allowed).masked_fill(~allowed, 0.0)


@bug("MASK-NO-INFLUENCE", "CAUSAL-NO-FUTURE", "MASK-FULLY-MASKED", instance="finite_mask_fill",
     mechanism="-1e4 added to masked scores (BERT's extended mask) instead of -inf: masked keys keep weight")
class _FiniteMaskFill(StepwiseAttention):
    """Masks by adding a finite "large negative" constant, ``scores + (1 − mask)·(−10⁴)`` (BERT's extended
    attention mask), instead of setting −inf: a masked key whose score exceeds the others by 10⁴ still
    dominates its row, and a fully masked row averages every value instead of giving zeros."""

    def mask(self, scores, attn_mask, is_causal):
        scores, allowed = self.admissible(scores, attn_mask, is_causal)
        return scores + (~allowed).to(scores.dtype) * -1e4, allowed


@bug("MASK-FULLY-MASKED", "MASK-NO-INFLUENCE", instance="masked_fill_minus_1e9",
     mechanism="masked_fill(mask == 0, -1e9) (The Annotated Transformer): fully masked rows average the values")
class _MaskedFillMinus1e9(StepwiseAttention):
    """``scores.masked_fill(mask == 0, -1e9)`` (The Annotated Transformer): masked scores replaced by a finite
    constant instead of −inf, so a query whose keys are all masked averages every value instead of giving
    zeros (and admissible scores below −1e9 would lose to masked keys)."""

    def mask(self, scores, attn_mask, is_causal):
        scores, allowed = self.admissible(scores, attn_mask, is_causal)
        return scores.masked_fill(~allowed, -1e9), allowed


# ---------------------------------------------------------------------------------------------- dropout
@bug("DROPOUT-OFF", "DROPOUT-RATE", "ATTN-ORACLE", instance="dropout_always_on",
     mechanism="dropout with a fixed p = 0.1 whatever dropout_p says (also at inference)")
class _DropoutAlwaysOn(StepwiseAttention):
    """Applies dropout with a fixed p = 0.1 (a module default baked into the kernel) whatever dropout_p
    says, so inference (dropout_p = 0) is random too."""

    def dropout(self, weights, p):
        return F.dropout(weights, p=0.1, training=True)


@bug("DROPOUT-EXPECTATION", instance="dropout_not_rescaled",
     mechanism="kept weights not rescaled by 1/(1 - p): the expected output shrinks")
class _DropoutNotRescaled(StepwiseAttention):
    """Drops weights with probability p but does not rescale the kept ones by 1/(1 − p): the expected
    output shrinks by (1 − p) in training."""

    def dropout(self, weights, p):
        if p == 0.0:
            return weights
        return weights * (torch.rand(weights.shape, device=weights.device) >= p)


@bug("DROPOUT-EXPECTATION", "DROPOUT-RATE", "DROPOUT-INDEPENDENT", instance="dropout_mask_shared",
     mechanism="one (L, S) dropout mask broadcast over batch and heads: drops not independent")
class _DropoutMaskShared(StepwiseAttention):
    """Draws one (L, S) dropout mask and broadcasts it over batch and heads (random numbers generated per
    attention-matrix position only, as a kernel that seeds its RNG by (row, column) without the batch and head
    offsets): every slice drops the same weights, so the drops are not independent."""

    def dropout(self, weights, p):
        if p == 0.0:
            return weights
        keep = torch.rand(weights.shape[-2:], device=weights.device) >= p
        return weights * keep / (1.0 - p)


@bug("DROPOUT-INDEPENDENT", instance="dropout_mask_shared_across_heads",
     mechanism="4-D dropout whose RNG offset advances per batch entry, not per head: every head drops the same weights")
class _DropoutMaskSharedAcrossHeads(StepwiseAttention):
    """A 4-D (B, H, L, S) kernel whose dropout RNG offset advances per batch entry but not per head (the head's
    offset left out of the Philox counter): every head of a batch entry drops the same weights. Rate and mean are
    right, and the copies of a problem stacked on the batch axis are independent."""

    def dropout(self, weights, p):
        if p == 0.0:
            return weights
        shape = (*weights.shape[:-3], 1, *weights.shape[-2:]) if weights.dim() == 4 else weights.shape
        keep = torch.rand(shape, device=weights.device) >= p
        return weights * keep / (1.0 - p)


# ------------------------------------------------------------------------------------- layout and heads
@bug("ATTN-SLICE-INDEPENDENT", "ATTN-ORACLE", instance="batch_and_heads_mixed",
     mechanism="k, v flattened head-major, q batch-major: slices attend to other slices' keys")
class _BatchAndHeadsMixed(StepwiseAttention):
    """Keys and values flattened head-major, queries batch-major: (B, H, S, E) → ``transpose(0, 1)`` →
    ``reshape(B, H, S, E)`` (a view of the (H, B) order read as (B, H)), so slice (b, h) attends to another
    slice's keys when B > 1 and H > 1."""

    def expand_heads(self, query, key, value, enable_gqa):
        key, value = super().expand_heads(query, key, value, enable_gqa)
        if key.dim() == 4:
            key = key.transpose(0, 1).reshape(key.shape)
            value = value.transpose(0, 1).reshape(value.shape)
        return key, value


@bug("GQA-HEADS", instance="gqa_heads_tiled",
     mechanism="kv heads expanded with repeat (head i mod H_kv), not repeat_interleave")
class _GqaHeadsTiled(StepwiseAttention):
    """Grouped-query heads expanded with ``repeat`` (tiling: query head i reads key/value head i mod H_kv)
    instead of ``repeat_interleave`` (head i // (H / H_kv))."""

    def expand_heads(self, query, key, value, enable_gqa):
        if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            reps = [1] * (key.dim() - 3) + [groups, 1, 1]
            return key.repeat(*reps), value.repeat(*reps)
        return key, value


@bug("ATTN-SHAPE", instance="output_in_compute_dtype",
     mechanism="the float32 accumulator returned for half inputs (cast back forgotten)")
class _OutputInComputeDtype(StepwiseAttention):
    """Returns the float32 accumulator for float16/bfloat16 inputs: the final cast back to the input dtype
    forgotten."""

    def finish(self, out, query):
        return out


@bug("ATTN-ORACLE", "ATTN-ROWSUM",
     mechanism="tiled online softmax with S // block key tiles: the last partial tile is lost")
def flash_attention_tiles_dropped(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                  scale=None, enable_gqa=False):
    """FlashAttention with the number of key tiles computed as S // block instead of ceil(S / block):
    the last, partial tile of keys is never visited when S is not a multiple of the block size."""
    return flash_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                           _key_tiles=lambda s, block: s // block)


softmax_over_queries = _SoftmaxOverQueries()
softmax_without_max = _SoftmaxWithoutMax()
fully_masked_rows_nan = _FullyMaskedRowsNaN()
scale_missing = _ScaleMissing()
scale_inverted = _ScaleInverted()
scale_applied_twice = _ScaleAppliedTwice()
scale_by_model_width = _ScaleByModelWidth()
scale_by_value_width = _ScaleByValueWidth()
scale_by_head_count = _ScaleByHeadCount()
scale_argument_ignored = _ScaleArgumentIgnored()
scores_in_input_dtype = _ScoresInInputDtype()
causal_off_by_one = _CausalOffByOne()
causal_ignored = _CausalIgnored()
causal_bottom_right = _CausalBottomRight()
bool_mask_inverted = _BoolMaskInverted()
float_mask_ignored = _FloatMaskIgnored()
mask_after_softmax = _MaskAfterSoftmax()
finite_mask_fill = _FiniteMaskFill()
mask_added_in_input_dtype = _MaskAddedInInputDtype()
masked_fill_minus_1e9 = _MaskedFillMinus1e9()
dropout_always_on = _DropoutAlwaysOn()
dropout_not_rescaled = _DropoutNotRescaled()
dropout_mask_shared = _DropoutMaskShared()
dropout_mask_shared_across_heads = _DropoutMaskSharedAcrossHeads()
batch_and_heads_mixed = _BatchAndHeadsMixed()
gqa_heads_tiled = _GqaHeadsTiled()
output_in_compute_dtype = _OutputInComputeDtype()
