"""Broken kernels with FlashAttention's API (flash-attn 2.x keywords): one realistic bug each, every one correct on
the plain case (no window, softcap or ALiBi; one packed sequence; a cache read whole with nothing appended), so
that only the feature clauses can catch it (SPEC.md, "The FlashAttention API").

    pytest properties/ --kernel-api flash --kernel properties.catalog.flash_bugs:window_left_off_by_one
    pytest properties/ --kernel-api flash-varlen --kernel properties.catalog.flash_bugs:varlen_causal_global_offset
    pytest properties/ --kernel-api flash-kvcache --kernel properties.catalog.flash_bugs:kvcache_seqlens_off_by_one

The correct bases are written from the docstrings in plain torch (only the band of admissible keys is the zoo's
one definition, zoo.nn.flash_dense.band_allowed), so that the catalog does not change when the zoo's kernels do:
``FlashBase`` (``flash_attn_func``, flash_func_bugs.py), ``varlen_base`` (flash_varlen_bugs.py) and
``KVCacheBase`` (flash_kvcache_bugs.py); each bug overrides one step. This module gathers them all under one
name (``properties.catalog.flash_bugs:NAME``); ``BUGS`` maps every name to its API and mechanism
(properties/catalog/__init__.py registers them).
"""
from __future__ import annotations

from properties.catalog.flash_func_bugs import (
    FlashBase, alibi_batch_row_ignored, alibi_distance_top_left, alibi_sign_flipped, alibi_without_abs,
    backward_without_window, causal_top_left, flash_base, fully_masked_rows_nan_flash, gqa_heads_tiled_flash,
    softcap_after_alibi, softcap_after_mask, softcap_backward_as_uncapped, softcap_before_scale, window_left_off_by_one,
    window_right_off_by_one, window_sides_swapped, window_top_left)
from properties.catalog.flash_kvcache_bugs import (
    KVCacheBase, kvcache_append_off_by_one, kvcache_base, kvcache_batch_idx_ignored_on_read, kvcache_causal_top_left,
    kvcache_leftpad_ignored, kvcache_paged_block_table_ignored, kvcache_seqlens_off_by_one,
    kvcache_stale_slots_attended)
from properties.catalog.flash_varlen_bugs import (
    varlen_alibi_row0, varlen_backward_across_sequences, varlen_base, varlen_causal_global_offset,
    varlen_cross_sequence_leak, varlen_reads_one_key_past_the_end)

__all__ = ["BUGS", "FlashBase", "KVCacheBase", "flash_base", "varlen_base", "kvcache_base",
           "alibi_batch_row_ignored", "alibi_distance_top_left", "alibi_sign_flipped", "alibi_without_abs",
           "backward_without_window", "causal_top_left", "fully_masked_rows_nan_flash", "gqa_heads_tiled_flash",
           "softcap_after_alibi", "softcap_after_mask", "softcap_backward_as_uncapped", "softcap_before_scale",
           "window_left_off_by_one", "window_right_off_by_one", "window_sides_swapped", "window_top_left",
           "kvcache_append_off_by_one", "kvcache_batch_idx_ignored_on_read", "kvcache_causal_top_left",
           "kvcache_leftpad_ignored", "kvcache_paged_block_table_ignored", "kvcache_seqlens_off_by_one",
           "kvcache_stale_slots_attended", "varlen_alibi_row0", "varlen_backward_across_sequences",
           "varlen_causal_global_offset", "varlen_cross_sequence_leak", "varlen_reads_one_key_past_the_end"]


# name -> (API, mechanism, expected clauses)
BUGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "window_left_off_by_one": ("flash", "left window edge exclusive: j >= i + o - left + 1",
                               ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "window_right_off_by_one": ("flash", "right window edge one too far: j <= i + o + right + 1 (transformers #39408)",
                                ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "window_sides_swapped": ("flash", "window_size read as (right, left)", ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "window_top_left": ("flash", "window band aligned top-left (i - left <= j <= i + right), not at i + Lk - Lq",
                        ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "causal_top_left": ("flash", "causal mask tril(ones(Lq, Lk)) (PyTorch's top-left), not bottom-right",
                        ("CAUSAL-BOTTOM-RIGHT", "FLASH-ORACLE", "FLASH-FULLY-MASKED")),
    "softcap_after_mask": ("flash", "the cap applied after masking: c*tanh(-inf) = -c gives masked keys weight",
                           ("SOFTCAP-RANGE", "SOFTCAP-FORMULA", "FLASH-ORACLE")),
    "softcap_before_scale": ("flash", "c*tanh(q.k / c) * scale: the cap taken on the unscaled product",
                             ("SOFTCAP-FORMULA", "FLASH-ORACLE", "FLASH-SCALE")),
    "softcap_after_alibi": ("flash", "the cap applied to score + ALiBi bias instead of before the bias",
                            ("SOFTCAP-FORMULA", "ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_sign_flipped": ("flash", "+slope*|i + o - j|: far keys favoured", ("ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_distance_top_left": ("flash", "ALiBi distance |i - j| without the bottom-right offset Lk - Lq",
                                ("ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_without_abs": ("flash", "ALiBi bias -slope*(i + o - j) without the absolute value: later keys rewarded",
                          ("ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_batch_row_ignored": ("flash", "(B, H) slopes: row 0 used for every batch entry",
                                ("ALIBI-BIAS", "FLASH-ORACLE", "FLASH-SLICE-INDEPENDENT")),
    "gqa_heads_tiled_flash": ("flash", "kv heads expanded with repeat (head h reads h mod Hkv), not h // (H/Hkv)",
                              ("FLASH-GQA", "FLASH-ORACLE")),
    "fully_masked_rows_nan_flash": ("flash", "plain softmax over a row with no admissible key: NaN instead of 0",
                                    ("FLASH-FULLY-MASKED", "CAUSAL-BOTTOM-RIGHT", "FLASH-ORACLE")),
    "softcap_backward_as_uncapped": ("flash", "exact forward; the backward omits the cap's slope 1 - tanh^2",
                                     ("FLASH-GRAD",)),
    "backward_without_window": ("flash", "exact forward; the backward recomputes the weights without window and ALiBi",
                                ("FLASH-GRAD", "FLASH-GRAD-MASKED")),
    "varlen_reads_one_key_past_the_end": ("flash-varlen", "sequence b's keys sliced k[cu_k[b] : cu_k[b+1] + 1]: "
                                          "the next sequence's first key leaks in",
                                          ("VARLEN-EQUALS-PADDED", "VARLEN-INDEPENDENT")),
    "varlen_cross_sequence_leak": ("flash-varlen", "keys bounded by the end of the query's sequence only: earlier "
                                   "sequences leak in", ("VARLEN-INDEPENDENT", "VARLEN-EQUALS-PADDED")),
    "varlen_causal_global_offset": ("flash-varlen", "causal/window diagonal of the packed matrix (total_k - total_q), "
                                    "not each sequence's Lk_b - Lq_b", ("VARLEN-EQUALS-PADDED",)),
    "varlen_backward_across_sequences": ("flash-varlen", "exact forward; the backward differentiates one attention "
                                         "over the whole packed batch", ("VARLEN-GRAD",)),
    "varlen_alibi_row0": ("flash-varlen", "(B, H) slopes: row 0 used for every sequence", ("VARLEN-EQUALS-PADDED",)),
    "kvcache_seqlens_off_by_one": ("flash-kvcache", "attends cache_seqlens + Lnew + 1 positions: one stale slot",
                                   ("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX",
                                    "KVCACHE-LEFTPAD")),
    "kvcache_stale_slots_attended": ("flash-kvcache", "cache_seqlens ignored when attending: the whole cache is read",
                                     ("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX",
                                      "KVCACHE-LEFTPAD")),
    "kvcache_append_off_by_one": ("flash-kvcache", "new keys written from cache_seqlens - 1: the last cached key is "
                                  "overwritten", ("KVCACHE-APPEND", "KVCACHE-EQUALS-FULL")),
    "kvcache_paged_block_table_ignored": ("flash-kvcache", "paged position p read from block b*max_blocks + p//size "
                                          "(the table assumed to be the identity)",
                                          ("KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-APPEND")),
    "kvcache_batch_idx_ignored_on_read": ("flash-kvcache", "appends to row cache_batch_idx[b] but attends row b",
                                          ("KVCACHE-BATCH-IDX",)),
    "kvcache_leftpad_ignored": ("flash-kvcache", "cache_leftpad ignored: the pad slots are attended",
                                ("KVCACHE-LEFTPAD",)),
    "kvcache_causal_top_left": ("flash-kvcache", "decode causal mask aligned to the cache start (j <= i), not its end",
                                ("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX",
                                 "KVCACHE-LEFTPAD")),
}
