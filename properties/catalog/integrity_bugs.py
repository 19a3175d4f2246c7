"""Bugs of integrity, history and layout (issue 33): kernels exact on every problem called first on fresh contiguous
inputs, and a model exact on every input it sees first. Each is caught by its clause on pinned cases
(SPEC.md, "Integrity, history and layouts")::

    pytest properties/ --kernel properties.catalog.integrity_bugs:query_scaled_in_place
    pytest properties/ -m model --model properties.catalog.integrity_bugs:dynamic_ntk_base_kept

The kernels are ``correct.StepwiseAttention`` with one step replaced; ``query_rescaled_in_backward`` has its own
autograd function (an exact backward that rescales the saved query in place); ``dynamic_ntk_base_kept`` is
``scale_bugs.ScaleLM`` with Hugging Face's dynamic NTK rotary scaling, the enlarged base kept.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from properties.catalog.correct import StepwiseAttention
from properties.catalog.registry import bug
from properties.catalog.scale_bugs import E, ScaleLM, scale_subject
from properties.core.subject import Subject

__all__ = ["query_scaled_in_place", "output_buffer_reused", "output_memoized_by_address", "single_key_returns_value",
           "causal_mask_cached_by_query_length", "assumes_contiguous_strides", "expanded_kv_tail_dropped",
           "query_rescaled_in_backward", "dynamic_ntk_base_kept"]


# ------------------------------------------------------------------------------------------ integrity
@bug("ATTN-INPUTS-UNCHANGED", instance="query_scaled_in_place",
     mechanism="q *= scale on the caller's query before the scores")
class _QueryScaledInPlace(StepwiseAttention):
    """``query *= scale`` before the scores (fairseq's and Hugging Face's attention code scale q in place, on a
    tensor the module made itself; a kernel that does it changes the caller's query)."""

    def scores(self, query, key, sigma, ct):
        q = query.to(ct)   # a copy only where the dtype changes (half precision); else the caller's own tensor
        q *= sigma
        return q @ key.to(ct).transpose(-1, -2)


@bug("ATTN-OUTPUT-FRESH", instance="output_buffer_reused",
     mechanism="every output written into one buffer per shape and returned: the next call overwrites it")
class _OutputBufferReused(StepwiseAttention):
    """Writes every output into one preallocated buffer per shape and returns it (a workspace handed back to the
    caller): the next call of that shape overwrites the output the caller holds."""

    buffers: dict = {}

    def finish(self, out, query):
        shape = (tuple(out.shape), query.dtype, str(query.device))
        buffer = self.buffers.setdefault(shape, torch.empty(out.shape, dtype=query.dtype, device=query.device))
        with torch.no_grad():
            buffer.copy_(out)
        return buffer


@bug("ATTN-OUTPUT-FRESH", instance="output_memoized_by_address",
     mechanism="outputs memoized by the inputs' data_ptr: inputs written in place get the stale output")
class _OutputMemoizedByAddress(StepwiseAttention):
    """Memoizes outputs keyed on the inputs' addresses and shapes, as caches of constant tensors (rotary tables,
    masks) are keyed: a caller that writes new values into the same tensors (a static KV cache) gets the stale
    output back."""

    memo: dict = {}

    def __call__(self, query, key, value, attn_mask=None, **kwargs):
        address = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (query, key, value)
                        if isinstance(t, torch.Tensor))
        memo_key = (address, None if attn_mask is None else attn_mask.data_ptr(), tuple(sorted(kwargs.items())))
        if memo_key not in self.memo:
            self.memo[memo_key] = super().__call__(query, key, value, attn_mask=attn_mask, **kwargs)
        return self.memo[memo_key].clone()


@bug("ATTN-OUTPUT-FRESH", instance="single_key_returns_value",
     mechanism="with one key, value.expand over the queries returned: the output aliases value")
class _SingleKeyReturnsValue(StepwiseAttention):
    """With one key the softmax is exactly 1, so the output is the value row: returned as ``value.expand`` over
    the queries, a view of the caller's value (an output that aliases an input)."""

    def __call__(self, query, key, value, attn_mask=None, **kwargs):
        if key.shape[-2] == 1 and attn_mask is None and not kwargs.get("dropout_p") and value.shape[:-2] == \
                query.shape[:-2]:
            return value.expand(*query.shape[:-1], value.shape[-1])
        return super().__call__(query, key, value, attn_mask=attn_mask, **kwargs)


# -------------------------------------------------------------------------------------------- history
@bug("ATTN-HISTORY", instance="causal_mask_cached_by_query_length",
     mechanism="the causal bias cached per L alone, padded with zeros for a larger S")
class _CausalMaskCachedByQueryLength(StepwiseAttention):
    """The additive causal bias (0 on and below the diagonal, −inf above) cached per query length L only, and
    fitted to the next call's key count S by cropping or by padding with zeros, the bias's neutral value: a call
    with more keys than the first call of its L admits the keys past the first call's S."""

    def __init__(self):
        self.biases: dict = {}

    def causal(self, l, s, device):
        bias = self.biases.get((l, str(device)))
        if bias is None:
            bias = torch.zeros(l, s, device=device).masked_fill(~super().causal(l, s, device), float("-inf"))
            self.biases[(l, str(device))] = bias
        bias = bias[:, :s] if bias.shape[-1] >= s else F.pad(bias, (0, s - bias.shape[-1]))
        return bias == 0


# --------------------------------------------------------------------------------------------- layouts
@bug("ATTN-LAYOUT", instance="assumes_contiguous_strides",
     mechanism="q, k, v read with as_strided and contiguous strides")
class _AssumesContiguousStrides(StepwiseAttention):
    """Reads q, k, v through ``as_strided`` with the contiguous strides of their shapes (as a kernel that takes
    ``data_ptr`` and indexes row-major does): right for contiguous inputs, wrong for transposed, sliced or expanded
    ones."""

    def __call__(self, query, key, value, *args, **kwargs):
        def assume_contiguous(t):
            strides = [1] * t.dim()
            for d in range(t.dim() - 2, -1, -1):
                strides[d] = strides[d + 1] * t.shape[d + 1]
            return t.as_strided(t.shape, strides, t.storage_offset())
        return super().__call__(*(assume_contiguous(t) for t in (query, key, value)), *args, **kwargs)


@bug("ATTN-LAYOUT", instance="expanded_kv_tail_dropped",
     mechanism="the stride-0 K/V path drops the last key when S ≡ 1 (mod 32)")
class _ExpandedKvTailDropped(StepwiseAttention):
    """A fast path for key and value broadcast over heads or batch (a zero stride, as ``expand`` gives) that walks
    the keys in tiles of 32 and runs its remainder loop only for remainders of two keys or more: with S ≡ 1 (mod 32)
    the last key is dropped (the class of pytorch/pytorch#191937)."""

    def __call__(self, query, key, value, attn_mask=None, **kwargs):
        broadcast = any(stride == 0 and size > 1 for stride, size in zip(key.stride()[:-2], key.shape[:-2]))
        if broadcast and key.shape[-2] % 32 == 1:
            key, value = key[..., :-1, :], value[..., :-1, :]
            attn_mask = None if attn_mask is None else attn_mask[..., :-1]
        return super().__call__(query, key, value, attn_mask=attn_mask, **kwargs)


# ---------------------------------------------------------------------------------- backward integrity
class _RescaledInBackward(torch.autograd.Function):
    """softmax(σ q kᵀ + m) v with the exact backward; the backward scales the saved query in place (to reuse its
    memory for dK = σ dSᵀ q) and so changes the caller's query."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        ct = torch.promote_types(q.dtype, torch.float32)
        w = StepwiseAttention()
        scores, allowed = w.mask((q.to(ct) * scale) @ k.to(ct).transpose(-1, -2), mask, is_causal)
        weights = w.softmax(scores, allowed)
        ctx.save_for_backward(q, k, v, weights)
        ctx.scale = scale
        return (weights @ v.to(ct)).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, weights = ctx.saved_tensors
        ct = weights.dtype
        do = grad_out.to(ct)
        dv = weights.transpose(-1, -2) @ do
        dw = do @ v.to(ct).transpose(-1, -2)
        ds = weights * (dw - (dw * weights).sum(-1, keepdim=True))
        dq = ds @ k.to(ct) * ctx.scale
        q = q.to(ct)   # the caller's own tensor where no cast is needed
        q.mul_(ctx.scale)   # the bug: σ q formed in place, in the saved query's memory
        dk = ds.transpose(-1, -2) @ q
        return dq.to(grad_out.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@bug("ATTN-INPUTS-UNCHANGED", mechanism="an exact backward that scales the saved query (the caller's) in place")
def query_rescaled_in_backward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False):
    if dropout_p or (enable_gqa and key.shape[-3] != query.shape[-3]) or (
            attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.requires_grad):
        raise NotImplementedError("dropout, grouped-query heads and mask gradients are not supported")
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True cannot be combined with an explicit attn_mask")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _RescaledInBackward.apply(query, key, value, attn_mask, is_causal, scale)


# ------------------------------------------------------------------------------------------ the model
ORIGINAL_LENGTH, FACTOR = 64, 2.0


class _DynamicNtkBaseKept(ScaleLM):
    """Dynamic NTK rotary scaling (Hugging Face's ``dynamic`` rope type): past the trained length the base grows
    with the sequence length, base·((f·n/n₀) − (f − 1))^(E/(E−2)). The frequencies are computed at the longest
    length seen and kept, without the reset to the original ones for shorter inputs that Hugging Face's
    ``dynamic_rope_update`` does: after one long call, every short call rotates with the enlarged base."""

    def angles(self, positions):
        length = int(positions.max()) + 1
        if length > getattr(self, "longest", ORIGINAL_LENGTH):
            self.longest = length
            base = 10000.0 * ((FACTOR * length / ORIGINAL_LENGTH) - (FACTOR - 1)) ** (E / (E - 2))
            self.inverse = base ** (-torch.arange(0, E, 2, dtype=torch.float32, device=positions.device) / E)
        if not hasattr(self, "inverse"):
            return super().angles(positions)
        return positions.float()[..., None] * self.inverse


# ----------------------------------------------------------------------------------------- factories
query_scaled_in_place = _QueryScaledInPlace()
output_buffer_reused = _OutputBufferReused()
output_memoized_by_address = _OutputMemoizedByAddress()
single_key_returns_value = _SingleKeyReturnsValue()
causal_mask_cached_by_query_length = _CausalMaskCachedByQueryLength()
assumes_contiguous_strides = _AssumesContiguousStrides()
expanded_kv_tail_dropped = _ExpandedKvTailDropped()


@bug("MODEL-HISTORY", level="model", mechanism="dynamic NTK rotary scaling keeps the enlarged base after one long call")
def dynamic_ntk_base_kept() -> Subject:
    return scale_subject(_DynamicNtkBaseKept, "rotary")


