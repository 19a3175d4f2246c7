"""``flash_attn_with_kvcache`` in plain PyTorch (the API and its semantics: zoo/nn/flash.py): a contiguous or a
paged KV cache (block table), appended in place — ``kvcache_gather`` (the attended range gathered, then
``reference``) and ``kvcache_paged`` (an online softmax that walks the cache block by block).
"""
from __future__ import annotations

import math

import torch
from einops import rearrange

from zoo.nn.flash_dense import OnlineSoftmax, alibi_row, band_scores, compute_dtype, expand_kv, flash_attn_reference

__all__ = ["flash_attn_kvcache_gather", "flash_attn_kvcache_paged", "paged_slots"]


def _cache_plan(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table):
    """Per batch entry: (cache row or block list, start, end) of the attended range, and where new keys go."""
    b = q.shape[0]
    if block_table is not None and cache_batch_idx is not None:
        raise NotImplementedError("a paged cache (block_table) with cache_batch_idx is not supported")
    if block_table is not None:
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("k and v need cache_seqlens (where to append)")
        seqlens = [capacity] * b
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * b
    else:
        seqlens = [int(x) for x in cache_seqlens.reshape(-1).tolist()]
    leftpad = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    rows = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
    for index in range(b):
        if not 0 <= leftpad[index] <= seqlens[index] or seqlens[index] + new > capacity:
            raise ValueError(f"batch {index}: cache_leftpad {leftpad[index]}, cache_seqlens {seqlens[index]} "
                             f"and {new} new keys do not fit a cache of {capacity} positions")
    return seqlens, leftpad, rows, new


def paged_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int):
    """(physical block, slot within it) of logical cache ``positions`` through a block table (…, max_blocks):
    block_table[…, p // block_size] and p % block_size, so that cache[blocks, slots] reads them in place."""
    return block_table.to(positions.device).long()[..., positions // block_size], positions % block_size


def _locate(positions: torch.Tensor, row: int, index: int, block_table, block_size: int):
    """(cache index 0, cache index 1) tensors of ``positions`` of batch entry ``index``."""
    if block_table is None:
        return torch.full_like(positions, row), positions
    return paged_slots(block_table[index], positions, block_size)


def _append(k_cache, v_cache, k, v, seqlens, rows, block_table):
    """Write the new keys and values into the cache in place."""
    if k is None:
        return
    if v is None or v.shape[:2] != k.shape[:2]:
        raise ValueError("k and v must be given together, with the same batch and length")
    with torch.no_grad():
        for index, row in enumerate(rows):
            positions = torch.arange(seqlens[index], seqlens[index] + k.shape[1], device=k_cache.device)
            where = _locate(positions, row, index, block_table, k_cache.shape[1])
            k_cache[where] = k[index].to(k_cache.dtype)
            v_cache[where] = v[index].to(v_cache.dtype)


def _kvcache_unsupported(rotary_cos, return_softmax_lse):
    if rotary_cos is not None:
        raise NotImplementedError("rotary embedding in the kvcache kernels is not implemented")
    if return_softmax_lse:
        raise NotImplementedError("return_softmax_lse is not implemented")


def flash_attn_kvcache_gather(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                              cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """``flash_attn_with_kvcache``: append, gather each entry's range [leftpad, seqlen + new) into a contiguous
    tensor (through the block table when paged), and call ``flash_attn_reference`` on it."""
    _kvcache_unsupported(rotary_cos, return_softmax_lse)
    seqlens, leftpad, rows, new = _cache_plan(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad,
                                              block_table)
    _append(k_cache, v_cache, k, v, seqlens, rows, block_table)
    outs = []
    for index, row in enumerate(rows):
        positions = torch.arange(leftpad[index], seqlens[index] + new, device=k_cache.device)
        where = _locate(positions, row, index, block_table, k_cache.shape[1])
        outs.append(flash_attn_reference(q[index:index + 1], k_cache[where][None], v_cache[where][None],
                                         softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                         softcap=softcap, alibi_slopes=alibi_row(alibi_slopes, index)))
    return torch.cat(outs)


def flash_attn_kvcache_paged(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                             cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                             softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """``flash_attn_with_kvcache`` as a paged decode kernel: an online softmax over the cache blocks of each
    entry, read in place through the block table (a contiguous cache is one block per row)."""
    _kvcache_unsupported(rotary_cos, return_softmax_lse)
    seqlens, leftpad, rows, new = _cache_plan(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad,
                                              block_table)
    _append(k_cache, v_cache, k, v, seqlens, rows, block_table)
    b, l, h, e = q.shape
    block_size = k_cache.shape[1]
    scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
    ct, device = compute_dtype(q.dtype), q.device
    rows_q = torch.arange(l, device=device)[:, None]
    outs = []
    for index, row in enumerate(rows):
        start, end = leftpad[index], seqlens[index] + new
        offset = (end - start) - l
        slopes = alibi_row(alibi_slopes, index)
        softmax = OnlineSoftmax(1, h, l, v_cache.shape[-1], ct, device)
        for n in range(start // block_size, -(-end // block_size)):
            block = row if block_table is None else int(block_table[index, n])
            j0, j1 = max(start, n * block_size), min(end, (n + 1) * block_size)
            if j1 <= j0:
                continue
            kb = expand_kv(k_cache[block, j0 - n * block_size:j1 - n * block_size][None], h)
            vb = expand_kv(v_cache[block, j0 - n * block_size:j1 - n * block_size][None], h)
            cols = torch.arange(j0, j1, device=device)[None, :] - start
            scores = band_scores(q[index:index + 1], kb, scale, softcap,
                                  None if slopes is None else slopes.reshape(-1), 1, h, rows_q, cols, offset,
                                  causal, window_size, ct)
            softmax.add(scores, vb.to(ct))
        outs.append(softmax.result())
    return rearrange(torch.cat(outs), "b h l v -> b l h v").to(q.dtype)


