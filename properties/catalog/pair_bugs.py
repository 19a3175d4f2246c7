"""Bugs that need a pair of classes: exact on every problem that holds only one of the two, wrong on the problems that
hold both (SPEC.md, "Problems at kernel scale, kernels with limits, coverage").

Each is a line or two away from a correct kernel of the catalog (``correct.StepwiseAttention``, the steps of the
SDPA contract; ``tiled.TiledAttention``, FlashAttention-2 in tiles of 64), written the way real kernels get such
things wrong, and each is wrong on an input its contract accepts: tests/test_pair_bugs.py computes, for each, a
problem holding both classes on which the bug departs from the float64 oracle (or changes the caller's tensor, or
drops independently of nothing), and problems holding each class alone on which it is exact. The covering schedule
(properties/kernel/schedule.py) poses every pair of its clauses' classes, so the default profile catches every one
of them, with no example pinned for it::

    pytest properties/ --kernel properties.catalog.pair_bugs:query_tiles_from_key_length

=================================== =========================================== ==================================
bug                                 the pair                                    caught by
=================================== =========================================== ==================================
query_tiles_from_key_length         L > S, at tile scale                        ATTN-ORACLE
causal_positions_in_input_dtype     is_causal, L = S past 256, bfloat16         CAUSAL-ALIGNMENT, CAUSAL-NO-FUTURE
causal_dropped_for_head_size_256    is_causal, E = 256                          CAUSAL-NO-FUTURE, CAUSAL-ALIGNMENT
float_mask_rows_fixed_in_place      a float mask row of −∞, half precision      ATTN-INPUTS-UNCHANGED
grouped_kv_memoized_by_address      grouped heads, inputs written in place       ATTN-HISTORY, ATTN-OUTPUT-FRESH
keys_memoized_by_address_past_64    S ≥ 64, inputs written in place              ATTN-HISTORY, ATTN-OUTPUT-FRESH
rows_without_key_nan_in_half        a row that admits no key, half precision     MASK-FULLY-MASKED, ATTN-ORACLE
scale_ignored_at_head_size_256      E = 256, an explicit scale                  SCALE-EXPLICIT
dropout_repeats_per_tile            dropout, L or S past a 64 tile               DROPOUT-INDEPENDENT
strided_tail_tile_read_contiguous   strided inputs, a partial last key tile      ATTN-LAYOUT
split_keys_without_empty_guard      S ≥ 1024, is_causal                         ATTN-ORACLE, CAUSAL-ALIGNMENT
accumulator_sized_by_e_at_256       E = 256, Ev ≠ E                              ATTN-SHAPE, ATTN-ORACLE
mask_heads_read_by_kv_head          grouped heads, a per-head mask               ATTN-ORACLE
tile_skipped_by_its_first_row       whole masked key tiles, L > 1                MASK-BOOL, MASK-BOOL-FLOAT
=================================== =========================================== ==================================
"""
from __future__ import annotations

import math

import torch

from properties.catalog.correct import StepwiseAttention
from properties.catalog.registry import bug
from properties.catalog.tiled import TiledAttention

__all__ = ["query_tiles_from_key_length", "causal_positions_in_input_dtype",
           "causal_dropped_for_head_size_256", "float_mask_rows_fixed_in_place", "grouped_kv_memoized_by_address",
           "keys_memoized_by_address_past_64", "rows_without_key_nan_in_half", "scale_ignored_at_head_size_256",
           "dropout_repeats_per_tile",
           "strided_tail_tile_read_contiguous", "split_keys_without_empty_guard", "accumulator_sized_by_e_at_256",
           "mask_heads_read_by_kv_head", "tile_skipped_by_its_first_row"]

_HALF = (torch.float16, torch.bfloat16)


class _Noting(StepwiseAttention):
    """StepwiseAttention that keeps the call's input dtype, head size and group at hand for the steps."""

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        self.dtype, self.e = query.dtype, query.shape[-1]
        self.group = query.shape[-3] // key.shape[-3] if enable_gqa and query.dim() >= 3 else 1
        return super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# ------------------------------------------------------------------------------------------------- lengths
@bug("ATTN-ORACLE", instance="query_tiles_from_key_length",
     mechanism="query tiles counted from S: queries past S's tiles stay 0 (needs L > S at tile scale)")
class _QueryTilesFromKeyLength(TiledAttention):
    """The query tiles are counted from the keys' length (``range(0, S, 64)``, the loop bound of the key tiles):
    where L > S spans more tiles than S, the queries of the extra tiles are never computed and stay 0. Exact for
    L ≤ S, and for L > S inside one tile."""

    def forward(self, q, k, v, mask, is_causal, sigma):
        self.keys = k.shape[-2]
        return super().forward(q, k, v, mask, is_causal, sigma)

    def query_tiles(self, l):
        keys = getattr(self, "keys", l)
        return [(i, min(i + self.block, l)) for i in range(0, keys, self.block) if i < l] or [(0, min(self.block, l))]


@bug("CAUSAL-ALIGNMENT", "CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", instance="causal_positions_in_input_dtype",
     mechanism="causal mask from positions cast to the input dtype (needs L = S past 256 in bfloat16, is_causal)")
class _CausalPositionsInInputDtype(_Noting):
    """The causal mask compares positions cast to the input dtype (``arange(L).to(q.dtype)``): exact up to 256 in
    bfloat16 (2048 in float16), past it key 257 rounds to 256 and query 256 sees it. Needs is_causal, bfloat16 and
    positions past 256 in both the queries and the keys."""

    def causal(self, l, s, device):
        rows = torch.arange(l, device=device).to(self.dtype)
        cols = torch.arange(s, device=device).to(self.dtype)
        return cols[None, :] <= rows[:, None]


@bug("CAUSAL-NO-FUTURE", "CAUSAL-ALIGNMENT", "CAUSAL-ZERO-ABOVE", "ATTN-ORACLE",
     instance="causal_dropped_for_head_size_256",
     mechanism="the head-size-256 path never applies is_causal (needs E = 256, is_causal)")
class _CausalDroppedForHeadSize256(_Noting):
    """Head size 256 goes down a split-head path (two 128-wide halves, as kernels without a 256-wide register tile
    do) that was written for the encoder and never applies is_causal."""

    def admissible(self, scores, attn_mask, is_causal):
        return super().admissible(scores, attn_mask, is_causal and self.e != 256)


# ------------------------------------------------------------------------------------------------- masks
@bug("ATTN-INPUTS-UNCHANGED", instance="float_mask_rows_fixed_in_place",
     mechanism="half precision: float-mask rows of −∞ set to 0 in the caller's mask "
               "(needs a float-mask row of −∞, float16 or bfloat16)")
class _FloatMaskRowsFixedInPlace(_Noting):
    """The half-precision path sets float-mask rows that are all −∞ to 0 in the caller's mask (its fused softmax
    would give NaN), then zeroes those rows' outputs: the output is right, the caller's mask is not."""

    def __call__(self, query, key, value, attn_mask=None, *args, **kwargs):
        empty = None
        if attn_mask is not None and attn_mask.dtype in _HALF and query.dtype in _HALF:
            empty = torch.isneginf(attn_mask).all(-1, keepdim=True)
            attn_mask.masked_fill_(empty, 0.0)
        out = super().__call__(query, key, value, attn_mask, *args, **kwargs)
        return out if empty is None else out.masked_fill(torch.broadcast_to(empty, out.shape[:-1] + (1,)), 0.0)


@bug("ATTN-ORACLE", instance="mask_heads_read_by_kv_head",
     mechanism="grouped heads read the mask's head axis as the keys' (needs grouped heads, a per-head mask)")
class _MaskHeadsReadByKvHead(_Noting):
    """Under grouped heads the mask's head axis is read like the keys' (head h // group, repeated), so the query
    heads of a group share their first head's mask. Exact without grouped heads, and for masks without a head axis."""

    def admissible(self, scores, attn_mask, is_causal):
        if attn_mask is not None and self.group > 1 and attn_mask.dim() >= 3 and attn_mask.shape[-3] > 1:
            attn_mask = attn_mask[..., ::self.group, :, :].repeat_interleave(self.group, dim=-3)
        return super().admissible(scores, attn_mask, is_causal)


@bug("MASK-BOOL", "MASK-BOOL-FLOAT", instance="tile_skipped_by_its_first_row",
     mechanism="a masked key tile skipped for a query tile by its first row (needs whole masked key tiles, L > 1)")
class _TileSkippedByItsFirstRow(TiledAttention):
    """Block-sparse skipping: a 64-key tile that the bool mask masks for the first query of the query tile is skipped
    for the whole query tile. Exact where whole masked tiles are masked for every query, or where L = 1."""

    def admissible(self, scores, mask, is_causal, i0, i1, j0, j1):
        scores = super().admissible(scores, mask, is_causal, i0, i1, j0, j1)
        if mask is not None and mask.dtype == torch.bool and j1 - j0 == self.block:
            first_row_skips = ~self.mask_tile(mask, i0, i1, j0, j1)[..., :1, :].any(-1, keepdim=True)
            scores = scores.masked_fill(first_row_skips, -math.inf)
        return scores


# ------------------------------------------------------------------------------------------------- history
@bug("ATTN-HISTORY", "ATTN-OUTPUT-FRESH", instance="grouped_kv_memoized_by_address",
     mechanism="grouped heads' expanded K, V memoized by address (needs grouped heads, inputs written in place)")
class _GroupedKvMemoizedByAddress(_Noting):
    """The keys and values repeated for grouped heads are memoized by the inputs' addresses and shapes (a KV cache's
    tensors are long lived: why expand them again?): written in place with new values, the cache is read stale."""

    memo: dict = {}

    def expand_heads(self, query, key, value, enable_gqa):
        if not (enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]):
            return super().expand_heads(query, key, value, enable_gqa)
        address = (key.data_ptr(), value.data_ptr(), tuple(key.shape), tuple(value.shape), key.dtype,
                   query.shape[-3])
        if address not in self.memo:
            self.memo[address] = super().expand_heads(query, key, value, enable_gqa)
        return self.memo[address]


@bug("ATTN-HISTORY", "ATTN-OUTPUT-FRESH", instance="keys_memoized_by_address_past_64",
     mechanism="past 64 keys, kᵀ memoized by address (needs S ≥ 64, inputs written in place)")
class _KeysMemoizedByAddressPast64(_Noting):
    """Past 64 keys the kernel keeps each key tensor transposed (kᵀ, contiguous, as its long-row path reads it),
    memoized by address and shape: written in place with new values (a static KV cache), the old keys are used."""

    memo: dict = {}

    def scores(self, query, key, sigma, ct):
        if key.shape[-2] < 64:
            return super().scores(query, key, sigma, ct)
        address = (key.data_ptr(), tuple(key.shape), tuple(key.stride()), key.dtype)
        if address not in self.memo:
            self.memo[address] = key.to(ct).transpose(-1, -2).contiguous()
        return (query.to(ct) * sigma) @ self.memo[address]


# ------------------------------------------------------------------------------------------------- precision
@bug("MASK-FULLY-MASKED", "ATTN-ORACLE", instance="rows_without_key_nan_in_half",
     mechanism="half precision: a plain softmax, NaN for a query without admissible key "
               "(needs a mask row that admits no key, float16 or bfloat16)")
class _RowsWithoutKeyNanInHalf(_Noting):
    """The half-precision path uses a plain softmax, without the guard for a row that admits no key: 0/0 = NaN where
    the float32 path gives the contract's zeros."""

    def softmax(self, scores, allowed):
        if self.dtype in _HALF:
            return torch.softmax(scores, dim=-1)
        return super().softmax(scores, allowed)


@bug("SCALE-EXPLICIT", instance="scale_ignored_at_head_size_256",
     mechanism="the head-size-256 path computes its scale and ignores scale= (needs E = 256, an explicit scale)")
class _ScaleIgnoredAtHeadSize256(_Noting):
    """The head-size-256 instantiation computes its scale from the head size and never reads ``scale=``."""

    def scale(self, query, key, value, scale):
        return super().scale(query, key, value, None if query.shape[-1] == 256 else scale)


@bug("ATTN-SHAPE", "ATTN-ORACLE", instance="accumulator_sized_by_e_at_256",
     mechanism="the head-size-256 path sizes its accumulator by E (needs E = 256, Ev ≠ E)")
class _AccumulatorSizedByEAt256(_Noting):
    """The head-size-256 path allocates its accumulator with E columns, not Ev: right when Ev = E = 256."""

    def combine(self, weights, value, ct):
        if self.e != 256:
            return super().combine(weights, value, ct)
        acc = torch.zeros(*weights.shape[:-1], self.e, dtype=ct, device=weights.device)
        return acc + weights @ value.to(ct)


@bug("ATTN-ORACLE", "CAUSAL-ALIGNMENT", instance="split_keys_without_empty_guard",
     mechanism="split-KV merge without a guard for an empty half (needs S ≥ 1024, is_causal)")
class _SplitKeysWithoutEmptyGuard(_Noting):
    """From 1024 keys on, the keys are split in two halves computed apart and merged by their log-sum-exp (split-KV,
    flash-decoding): a half with no admissible key for a query gives 0/0 = NaN there, and 0·NaN stays NaN in the
    merge (the guard for a query without any key is there; the one for an empty half is not)."""

    def softmax(self, scores, allowed):
        s = scores.shape[-1]
        if s < 1024:
            return super().softmax(scores, allowed)
        halves = []
        for part in (scores[..., :s // 2], scores[..., s // 2:]):
            lse = torch.logsumexp(part, -1, keepdim=True)
            halves.append((lse, torch.exp(part - part.amax(-1, keepdim=True)) /
                           torch.exp(part - part.amax(-1, keepdim=True)).sum(-1, keepdim=True)))
        (lse1, w1), (lse2, w2) = halves
        top = torch.maximum(lse1, lse2)
        empty = torch.isneginf(top)
        top = torch.where(empty, torch.zeros_like(top), top)
        a, b = torch.exp(lse1 - top), torch.exp(lse2 - top)
        merged = torch.cat([a * w1, b * w2], -1) / torch.where(empty, torch.ones_like(a), a + b)
        return torch.where(empty, torch.zeros_like(merged), merged)


# ------------------------------------------------------------------------------------------------- dropout
@bug("DROPOUT-INDEPENDENT", instance="dropout_repeats_per_tile",
     mechanism="one 64 × 64 dropout tile per slice, repeated (needs dropout, L or S past 64)")
class _DropoutRepeatsPerTile(_Noting):
    """The dropout mask is drawn for one 64 × 64 tile per batch entry and head and reused for every tile of the slice
    (the random offset advanced per slice, not per tile): weights 64 rows or columns apart drop together."""

    def dropout(self, weights, p):
        if p == 0.0:
            return weights
        *lead, l, s = weights.shape
        tile = torch.rand(*lead, 64, 64, device=weights.device) >= p
        keep = tile.repeat(*(1,) * len(lead), -(-l // 64), -(-s // 64))[..., :l, :s]
        return weights * keep / (1.0 - p)


# ------------------------------------------------------------------------------------------------- layouts
@bug("ATTN-LAYOUT", instance="strided_tail_tile_read_contiguous",
     mechanism="a partial last key tile read with contiguous strides (needs strided inputs, S past a tile)")
class _StridedTailTileReadContiguous(TiledAttention):
    """The last, partial key tile of a sequence longer than one tile is read with the contiguous strides from the
    tensor's storage offset (a pointer and a row pitch of E, as a kernel written for contiguous inputs computes
    them): right for contiguous keys and values, wrong rows (or out of the storage) for strided ones."""

    def key_tile(self, t, j0, j1):
        if t.is_contiguous() or j0 == 0 or j1 - j0 == self.block:
            return super().key_tile(t, j0, j1)
        size = (*t.shape[:-2], j1 - j0, t.shape[-1])
        strides, step = [], 1
        for n in reversed(t.shape):
            strides.insert(0, step)
            step *= n
        return torch.as_strided(t, size, strides, t.storage_offset() + j0 * t.shape[-1])


# ------------------------------------------------------------------------------------------------- the kernels
query_tiles_from_key_length = _QueryTilesFromKeyLength()
causal_positions_in_input_dtype = _CausalPositionsInInputDtype()
causal_dropped_for_head_size_256 = _CausalDroppedForHeadSize256()
float_mask_rows_fixed_in_place = _FloatMaskRowsFixedInPlace()
grouped_kv_memoized_by_address = _GroupedKvMemoizedByAddress()
keys_memoized_by_address_past_64 = _KeysMemoizedByAddressPast64()
rows_without_key_nan_in_half = _RowsWithoutKeyNanInHalf()
scale_ignored_at_head_size_256 = _ScaleIgnoredAtHeadSize256()
dropout_repeats_per_tile = _DropoutRepeatsPerTile()
strided_tail_tile_read_contiguous = _StridedTailTileReadContiguous()
split_keys_without_empty_guard = _SplitKeysWithoutEmptyGuard()
accumulator_sized_by_e_at_256 = _AccumulatorSizedByEAt256()
mask_heads_read_by_kv_head = _MaskHeadsReadByKvHead()
tile_skipped_by_its_first_row = _TileSkippedByItsFirstRow()
