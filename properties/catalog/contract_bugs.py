"""Kernels for the declared contracts KERNEL-DETERMINISTIC and KERNEL-BATCH-INVARIANT (--deterministic,
--batch-invariant): each is accurate (the default clauses pass on it), and two break one contract each.

``atomic_order_attention``     the weighted sum over keys accumulated block by block in an order that changes with
                               every call, as atomic adds from parallel key blocks land: repeats differ in the last
                               bits (KERNEL-DETERMINISTIC), and MASK-NO-INFLUENCE / CAUSAL-NO-FUTURE must not call
                               that a leak.
``split_by_batch_attention``   split-K over the keys with the split count chosen from B x H (fewer slices, more
                               splits, to fill the machine): a sequence's rows depend on what else is in its batch
                               (KERNEL-BATCH-INVARIANT). Deterministic.
``batch_invariant_attention``  the correct twin: every sequence computed on its own copy by the same plain-torch
                               operations on the same shapes, so one reduction order whatever the batch.

    pytest properties/kernel --kernel properties.catalog.contract_bugs:atomic_order_attention --deterministic
"""
from __future__ import annotations

import itertools
import math

import torch

from properties.catalog.correct import KEY_BLOCK, StepwiseAttention, block_size
from properties.catalog.registry import bug

__all__ = ["atomic_order_attention", "split_by_batch_attention", "batch_invariant_attention", "SPLIT_TARGET"]


def _blocked_sum(weights: torch.Tensor, value: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """sum over the key blocks ``bounds`` (in that order) of weights[..., block] @ value[..., block, :]."""
    out = None
    for start, stop in bounds:
        part = weights[..., start:stop] @ value[..., start:stop, :]
        out = part if out is None else out + part
    return out


@bug("KERNEL-DETERMINISTIC", extra=("--deterministic",), instance="atomic_order_attention",
     mechanism="key blocks' partial sums added in an order that changes with every call (atomic adds)")
class AtomicOrderAttention(StepwiseAttention):
    """Partial sums of key blocks added in a new order on every call (a counter seeds the order, so a run replays)."""

    _calls = itertools.count()

    def combine(self, weights, value, ct):
        s = weights.shape[-1]
        block = block_size(s, KEY_BLOCK)
        bounds = [(start, min(start + block, s)) for start in range(0, s, block)]
        order = torch.randperm(len(bounds), generator=torch.Generator().manual_seed(next(self._calls))).tolist()
        return _blocked_sum(weights, value.to(ct), [bounds[i] for i in order])


SPLIT_TARGET = 8   # the parallel work items the split-K kernel aims at: splits = SPLIT_TARGET // (B x H)


@bug("KERNEL-BATCH-INVARIANT", extra=("--batch-invariant",), instance="split_by_batch_attention",
     mechanism="split-K over the keys with the split count chosen from B x H")
class SplitByBatchAttention(StepwiseAttention):
    """Split-K over the keys, the split count from the number of (batch, head) slices."""

    def combine(self, weights, value, ct):
        s, slices = weights.shape[-1], math.prod(weights.shape[:-2])
        splits = max(1, min(s, SPLIT_TARGET // max(slices, 1)))
        chunk = math.ceil(s / splits)
        return _blocked_sum(weights, value.to(ct), [(i, min(i + chunk, s)) for i in range(0, s, chunk)])


class BatchInvariantAttention(StepwiseAttention):
    """StepwiseAttention on each sequence (the first axis of a 4-d query) separately, each on a fresh copy: the same
    operations on the same shapes, hence the same reduction order, whatever the batch holds."""

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if query.dim() < 4:
            return super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        batch = torch.broadcast_shapes(query.shape[:1], key.shape[:1], value.shape[:1])[0]
        mask = None if attn_mask is None else attn_mask.expand(batch, *attn_mask.shape[-3:]) \
            if attn_mask.dim() >= 3 else attn_mask

        def one(t, b):
            return t[b if t.shape[0] > 1 else 0].clone()
        rows = [super(BatchInvariantAttention, self).__call__(
            one(query, b), one(key, b), one(value, b), None if mask is None else
            (one(mask, b) if mask.dim() >= 3 else mask), dropout_p, is_causal, scale, enable_gqa)
            for b in range(batch)]
        return torch.stack(rows)


atomic_order_attention = AtomicOrderAttention()
split_by_batch_attention = SplitByBatchAttention()
batch_invariant_attention = BatchInvariantAttention()
