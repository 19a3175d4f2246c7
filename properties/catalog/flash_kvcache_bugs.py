"""Broken kernels with ``flash_attn_with_kvcache``'s API (a KV cache appended in place, paged, batch-indexed,
left-padded): ``KVCacheBase``, the correct kernel in overridable steps, and one realistic bug each as a subclass
that overrides one step, declared a catalog entry by the ``@bug`` above it.

    pytest properties/ --kernel-api flash-kvcache --kernel properties.catalog.flash_kvcache_bugs:kvcache_seqlens_off_by_one
"""
from __future__ import annotations

import torch

from properties.catalog.flash_bugs import causal_top_left, flash_base
from properties.catalog.registry import bug

__all__ = ["KVCacheBase", "kvcache_base", "kvcache_seqlens_off_by_one", "kvcache_stale_slots_attended",
           "kvcache_append_off_by_one", "kvcache_paged_block_table_ignored", "kvcache_batch_idx_ignored_on_read",
           "kvcache_leftpad_ignored", "kvcache_causal_top_left"]


class KVCacheBase:
    """A correct ``flash_attn_with_kvcache``: append in place, gather each entry's range, ``flash_base`` on it."""

    flash = flash_base

    def write_positions(self, seqlen, lnew):
        return range(seqlen, seqlen + lnew)

    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, seqlen + lnew

    def locate(self, index, row, p, block_table, block_size, max_blocks):
        if block_table is None:
            return row, p
        return int(block_table[index, p // block_size]), p % block_size

    def read_row(self, index, rows):
        return rows[index]

    def __call__(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                 cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                 window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                 return_softmax_lse=False):
        if rotary_cos is not None or return_softmax_lse:
            raise NotImplementedError("rotary and return_softmax_lse are not implemented")
        b = q.shape[0]
        block_size = k_cache.shape[1]
        max_blocks = 1 if block_table is None else block_table.shape[1]
        capacity = block_size * max_blocks
        if cache_seqlens is None:
            seqlens = [capacity] * b
        elif isinstance(cache_seqlens, int):
            seqlens = [cache_seqlens] * b
        else:
            seqlens = [int(x) for x in cache_seqlens.tolist()]
        pads = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
        rows = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
        lnew = 0 if k is None else k.shape[1]
        with torch.no_grad():
            for index in range(b):
                for t, p in enumerate(self.write_positions(seqlens[index], lnew)):
                    where = self.locate(index, rows[index], p, block_table, block_size, max_blocks)
                    k_cache[where], v_cache[where] = k[index, t], v[index, t]
        outs = []
        for index in range(b):
            start, end = self.attended(pads[index], seqlens[index], lnew, capacity)
            row = self.read_row(index, rows)
            where = [self.locate(index, row, p, block_table, block_size, max_blocks) for p in range(start, end)]
            ks = torch.stack([k_cache[w] for w in where]) if where else k_cache.new_zeros(0, *k_cache.shape[2:])
            vs = torch.stack([v_cache[w] for w in where]) if where else v_cache.new_zeros(0, *v_cache.shape[2:])
            slopes = alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[index]
            outs.append(self.flash(q[index:index + 1], ks[None], vs[None], softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=slopes))
        return torch.cat(outs)


kvcache_base = KVCacheBase()


@bug("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX", "KVCACHE-LEFTPAD",
     api="flash-kvcache", instance="kvcache_seqlens_off_by_one",
     mechanism="attends cache_seqlens + Lnew + 1 positions: one stale slot")
class _SeqlensOffByOne(KVCacheBase):
    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, min(seqlen + lnew + 1, capacity)


@bug("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX", "KVCACHE-LEFTPAD",
     api="flash-kvcache", instance="kvcache_stale_slots_attended",
     mechanism="cache_seqlens ignored when attending: the whole cache is read")
class _StaleSlotsAttended(KVCacheBase):
    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, capacity


@bug("KVCACHE-APPEND", "KVCACHE-EQUALS-FULL", api="flash-kvcache", instance="kvcache_append_off_by_one",
     mechanism="new keys written from cache_seqlens - 1: the last cached key is overwritten")
class _AppendOffByOne(KVCacheBase):
    def write_positions(self, seqlen, lnew):     # cache_seqlens read as the index of the last filled slot
        return range(max(seqlen - 1, 0), max(seqlen - 1, 0) + lnew)

    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, max(seqlen - 1, 0) + lnew if lnew else seqlen


@bug("KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-APPEND", api="flash-kvcache",
     instance="kvcache_paged_block_table_ignored",
     mechanism="paged position p read from block b*max_blocks + p//size (the table assumed to be the identity)")
class _PagedBlockTableIgnored(KVCacheBase):
    def locate(self, index, row, p, block_table, block_size, max_blocks):
        if block_table is None:
            return row, p
        return index * max_blocks + p // block_size, p % block_size


@bug("KVCACHE-BATCH-IDX", api="flash-kvcache", instance="kvcache_batch_idx_ignored_on_read",
     mechanism="appends to row cache_batch_idx[b] but attends row b")
class _BatchIdxIgnoredOnRead(KVCacheBase):
    def read_row(self, index, rows):
        return index


@bug("KVCACHE-LEFTPAD", api="flash-kvcache", instance="kvcache_leftpad_ignored",
     mechanism="cache_leftpad ignored: the pad slots are attended")
class _LeftpadIgnored(KVCacheBase):
    def attended(self, leftpad, seqlen, lnew, capacity):
        return 0, seqlen + lnew


@bug("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX", "KVCACHE-LEFTPAD",
     api="flash-kvcache", instance="kvcache_causal_top_left",
     mechanism="decode causal mask aligned to the cache start (j <= i), not its end")
class _DecodeCausalTopLeft(KVCacheBase):
    flash = causal_top_left


kvcache_seqlens_off_by_one = _SeqlensOffByOne()
kvcache_stale_slots_attended = _StaleSlotsAttended()
kvcache_append_off_by_one = _AppendOffByOne()
kvcache_paged_block_table_ignored = _PagedBlockTableIgnored()
kvcache_batch_idx_ignored_on_read = _BatchIdxIgnoredOnRead()
kvcache_leftpad_ignored = _LeftpadIgnored()
kvcache_causal_top_left = _DecodeCausalTopLeft()
