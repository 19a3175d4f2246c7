"""The pair bugs of the catalog (properties/catalog/pair_bugs.py), shown directly: each is wrong on a problem that holds
both of its classes — against the float64 oracle and ATTN-ORACLE's bound, or by the symptom its clause measures (a
changed input, a stale output, drops that agree) — and bitwise equal to the correct kernel it comes from on problems
that hold one of the two classes only. That the covering schedule catches each of them is tests/test_catalog.py's
business (their catalog entries, at the pinned profile: the covering rows only)."""
from __future__ import annotations

import pytest
import torch

from properties.catalog import pair_bugs as bugs
from properties.catalog.correct import stepwise_attention
from properties.catalog.tiled import tiled_attention
from properties.core.oracle import to_float64
from properties.core.tolerance import output_bound, softmax_bounds

F32, BF16 = torch.float32, torch.bfloat16


def _qkv(l, s, e=16, ev=None, lead=(1, 1), kv_lead=None, dtype=F32, seed=0, mean=0.0):
    g = torch.Generator().manual_seed(seed)
    kv_lead = lead if kv_lead is None else kv_lead
    q = torch.randn(*lead, l, e, generator=g, dtype=torch.float64)
    k = torch.randn(*kv_lead, s, e, generator=g, dtype=torch.float64)
    v = mean + torch.randn(*kv_lead, s, ev or e, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v))


def _departure(fn, q, k, v, **kw) -> float:
    """max |out − oracle| / ATTN-ORACLE's bound (inf where the output is not finite)."""
    out = to_float64(fn(q, k, v, **kw))
    bounds = softmax_bounds(q, k, v, **{n: x for n, x in kw.items() if n in ("attn_mask", "is_causal", "scale",
                                                                             "enable_gqa")})
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float(((out - bounds.reference.output).abs() / output_bound(bounds, v)).nan_to_num(0.0).max())


def _same(fn, base, q, k, v, **kw) -> bool:
    return torch.equal(fn(q, k, v, **kw), base(q, k, v, **kw))


# ------------------------------------------------------------------------------------------------- lengths
def test_query_tiles_from_key_length():
    assert _departure(bugs.query_tiles_from_key_length, *_qkv(129, 65)) > 1          # L > S at tile scale
    assert _same(bugs.query_tiles_from_key_length, tiled_attention, *_qkv(65, 129))  # L < S at tile scale
    assert _same(bugs.query_tiles_from_key_length, tiled_attention, *_qkv(5, 3))     # L > S inside a tile


def test_causal_positions_in_input_dtype():
    q, k, _ = _qkv(300, 300, dtype=BF16)
    eye = torch.eye(300, dtype=BF16).expand(1, 1, 300, 300)
    weights = to_float64(bugs.causal_positions_in_input_dtype(q, k, eye, is_causal=True))
    assert bool((weights.triu(1) != 0).any())                                     # bfloat16, L = S past 256: a leak
    assert _same(bugs.causal_positions_in_input_dtype, stepwise_attention, *_qkv(200, 200, dtype=BF16),
                 is_causal=True)                                                  # bfloat16 below 256
    assert _same(bugs.causal_positions_in_input_dtype, stepwise_attention, *_qkv(300, 300), is_causal=True)


def test_causal_dropped_for_head_size_256():
    assert _departure(bugs.causal_dropped_for_head_size_256, *_qkv(4, 4, e=256), is_causal=True) > 1
    assert _same(bugs.causal_dropped_for_head_size_256, stepwise_attention, *_qkv(4, 4, e=256))
    assert _same(bugs.causal_dropped_for_head_size_256, stepwise_attention, *_qkv(4, 4, e=128), is_causal=True)


def test_split_keys_without_empty_guard():
    q, k, v = _qkv(3, 1024)
    assert _departure(bugs.split_keys_without_empty_guard, q, k, v, is_causal=True) == float("inf")  # NaN
    assert _departure(bugs.split_keys_without_empty_guard, q, k, v) <= 1            # S ≥ 1024, not causal
    assert _same(bugs.split_keys_without_empty_guard, stepwise_attention, *_qkv(3, 1000), is_causal=True)


def test_accumulator_sized_by_e_at_256():
    q, k, v = _qkv(3, 5, e=256, ev=64)
    with pytest.raises(RuntimeError):                                              # E = 256, Ev != E
        bugs.accumulator_sized_by_e_at_256(q, k, v)
    assert _same(bugs.accumulator_sized_by_e_at_256, stepwise_attention, *_qkv(3, 5, e=256))
    assert _same(bugs.accumulator_sized_by_e_at_256, stepwise_attention, *_qkv(3, 5, e=128, ev=64))


def test_scale_ignored_at_head_size_256():
    assert _departure(bugs.scale_ignored_at_head_size_256, *_qkv(3, 5, e=256), scale=0.5) > 1
    assert _same(bugs.scale_ignored_at_head_size_256, stepwise_attention, *_qkv(3, 5, e=256))
    assert _same(bugs.scale_ignored_at_head_size_256, stepwise_attention, *_qkv(3, 5, e=128), scale=0.5)


# ------------------------------------------------------------------------------------------------- masks
def test_float_mask_rows_fixed_in_place():
    def mask_changed(dtype, empty_row: bool) -> bool:
        q, k, v = _qkv(4, 5, dtype=dtype)
        mask = torch.zeros(1, 1, 4, 5, dtype=dtype)
        if empty_row:
            mask[..., 2, :] = float("-inf")
        kept = mask.clone()
        out = bugs.float_mask_rows_fixed_in_place(q, k, v, attn_mask=mask)
        assert _departure(lambda *a, **kw: out, q, k, v, attn_mask=kept) <= 1   # the output is right every time
        return not torch.equal(mask, kept)
    assert mask_changed(BF16, empty_row=True)                                       # half precision, a row of -inf
    assert not mask_changed(F32, empty_row=True)
    assert not mask_changed(BF16, empty_row=False)


def test_rows_without_key_nan_in_half():
    def problem(dtype, empty_row: bool):
        q, k, v = _qkv(4, 5, dtype=dtype)
        mask = torch.ones(4, 5, dtype=torch.bool)
        if empty_row:
            mask[2] = False
        return q, k, v, mask
    q, k, v, mask = problem(BF16, True)
    assert bool(torch.isnan(bugs.rows_without_key_nan_in_half(q, k, v, attn_mask=mask)).any())
    q, k, v, mask = problem(F32, True)
    assert _same(bugs.rows_without_key_nan_in_half, stepwise_attention, q, k, v, attn_mask=mask)
    q, k, v, mask = problem(BF16, False)
    assert _departure(bugs.rows_without_key_nan_in_half, q, k, v, attn_mask=mask) <= 1


def test_mask_heads_read_by_kv_head():
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(3, 5, lead=(1, 4), kv_lead=(1, 2))
    per_head = torch.randn(1, 4, 3, 5, generator=g)
    assert _departure(bugs.mask_heads_read_by_kv_head, q, k, v, attn_mask=per_head, enable_gqa=True) > 1
    shared = torch.randn(3, 5, generator=g)                                         # grouped heads, no head axis
    assert _same(bugs.mask_heads_read_by_kv_head, stepwise_attention, q, k, v, attn_mask=shared, enable_gqa=True)
    q, k, v = _qkv(3, 5, lead=(1, 4))                                               # per-head mask, no groups
    assert _same(bugs.mask_heads_read_by_kv_head, stepwise_attention, q, k, v, attn_mask=per_head)


def test_tile_skipped_by_its_first_row():
    q, k, v = _qkv(2, 128)
    mask = torch.ones(2, 128, dtype=torch.bool)
    mask[0, :64] = False                                                            # tile 0 masked for query 0 only
    assert _departure(bugs.tile_skipped_by_its_first_row, q, k, v, attn_mask=mask) > 1
    assert _same(bugs.tile_skipped_by_its_first_row, tiled_attention, q[..., :1, :], k, v, attn_mask=mask[:1])
    everywhere = torch.ones(2, 128, dtype=torch.bool)
    everywhere[:, :64] = False                                                      # tile 0 masked for every query
    assert _same(bugs.tile_skipped_by_its_first_row, tiled_attention, q, k, v, attn_mask=everywhere)


# ------------------------------------------------------------------------------------------------- history
@pytest.mark.parametrize("bug, grouped, s", [("grouped_kv_memoized_by_address", True, 5),
                                              ("keys_memoized_by_address_past_64", False, 65)])
def test_memos_by_address_read_stale_inputs(bug, grouped, s):
    kernel = getattr(bugs, bug)

    def second_call_departs(grouped: bool, s: int, in_place: bool) -> bool:
        kv_lead = (1, 2) if grouped else (1, 4)
        q, k, v = _qkv(3, s, lead=(1, 4), kv_lead=kv_lead, seed=len(kernel.memo))
        kernel(q, k, v, enable_gqa=grouped)
        q2, k2, v2 = _qkv(3, s, lead=(1, 4), kv_lead=kv_lead, seed=100 + len(kernel.memo))
        if in_place:
            for t, new in zip((q, k, v), (q2, k2, v2)):
                t.copy_(new)
        else:
            q, k, v = q2, k2, v2
        return _departure(kernel, q, k, v, enable_gqa=grouped) > 1
    assert second_call_departs(grouped, s, in_place=True)                           # both classes
    assert not second_call_departs(grouped, s, in_place=False)                      # fresh tensors
    other = (False, s) if grouped else (False, 63)                                  # the other class away
    assert not second_call_departs(*other, in_place=True)


# ------------------------------------------------------------------------------------------------- layouts
def test_strided_tail_tile_read_contiguous():
    def transposed(t):   # the (B, L, H, E) storage of a projection seen as (B, H, L, E)
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    q, k, v = _qkv(3, 100, lead=(2, 3))
    assert _departure(bugs.strided_tail_tile_read_contiguous, q, transposed(k), transposed(v)) > 1
    assert _same(bugs.strided_tail_tile_read_contiguous, tiled_attention, q, k, v)  # contiguous, a tail tile
    q, k, v = _qkv(3, 64, lead=(2, 3))                                              # strided, one tile
    assert _same(bugs.strided_tail_tile_read_contiguous, tiled_attention, q, transposed(k), transposed(v))


# ------------------------------------------------------------------------------------------------- dropout
def test_dropout_repeats_per_tile():
    def kept(l, s, p=0.5, seed=0):
        torch.manual_seed(seed)
        q, k, _ = _qkv(l, s)
        return bugs.dropout_repeats_per_tile(q, k, torch.eye(s).expand(1, 1, s, s), dropout_p=p) != 0
    wide = kept(129, 129)
    assert torch.equal(wide[..., :65, :], wide[..., 64:, :]) and torch.equal(wide[..., :65], wide[..., 64:])
    one_tile = kept(64, 64)   # inside one tile: 64 x 64 independent draws, nothing repeats
    assert not any(torch.equal(one_tile[..., i, :], one_tile[..., j, :]) for i in range(8) for j in range(8, 16))
    q, k, v = _qkv(129, 129)                                                         # no dropout: the kernel's own
    assert _same(bugs.dropout_repeats_per_tile, stepwise_attention, q, k, v)
