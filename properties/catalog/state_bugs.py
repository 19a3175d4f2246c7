"""Online-softmax state bugs: ``properties.catalog.tiled.TiledAttention`` (FlashAttention-2 in plain torch, tiles of
64) with its running state (maximum, row sum, accumulator) kept wrong in a way that only some problems show.

- ``running_max_sentinel``: the running maximum starts at the finite sentinel -1e4 instead of -inf (Triton
  tutorials and hand-written kernels start it at -1e4, -1e6 or finfo.min to avoid inf - inf); exact while some
  admissible score of a row exceeds about -1e4, wrong (a zero row) where a row's admissible scores are all below it.
- ``masked_tile_resets_max``: a key tile in which a row admits no key is skipped for that row, but its maximum
  (-inf) is stored as the running maximum: the next admissible tile then rescales the earlier tiles' sum and
  accumulator by exp(-inf) = 0. Exact unless a whole 64-key tile of a row is masked before an admissible one.
- ``running_max_sentinel_flash``: the same sentinel in a ``flash_attn_func`` (FlashAttention's API; the window
  clauses' extreme draws catch it).
- ``state_rounded_per_tile``: the accumulator and the row sum are stored in the input dtype between key tiles (a
  kernel that keeps its running state in registers of the input type): exact in float32 and float64, in half
  precision one more rounding of the whole running state per key tile, an error that grows with S.

    pytest properties/ --kernel properties.catalog.state_bugs:running_max_sentinel
    pytest properties/ --kernel-api flash --kernel properties.catalog.state_bugs:running_max_sentinel_flash
"""
from __future__ import annotations

import torch

from properties.catalog.flash_bugs import FlashBase
from properties.catalog.registry import bug
from properties.catalog.tiled import TiledAttention

__all__ = ["running_max_sentinel", "masked_tile_resets_max", "state_rounded_per_tile",
           "running_max_sentinel_flash"]

SENTINEL = -1e4


# MASK-LOW-PRECISION's rows of finfo.min catch it too; the entry lists the clauses whose drawn extreme scores catch it,
# so that the catalog's run shows them doing it.
@bug("MASK-BOOL", "CAUSAL-ALIGNMENT", instance="running_max_sentinel",
     mechanism=("online softmax: the running max starts at the sentinel -1e4, not -inf: a row whose admissible "
                "scores all lie below it outputs zeros"))
class _RunningMaxSentinel(TiledAttention):
    """The running maximum starts at -1e4: a row whose admissible scores all lie below it sums exp(s + 1e4),
    which underflows to 0, and outputs zeros."""

    def update(self, acc, row_max, row_sum, scores, v):
        return super().update(acc, torch.clamp_min(row_max, SENTINEL), row_sum, scores, v)


@bug("MASK-BOOL", "MASK-BOOL-FLOAT", instance="masked_tile_resets_max",
     mechanism=("online softmax: a row's fully masked 64-key tile is skipped but its max (-inf) overwrites the "
                "running max, erasing the earlier tiles"))
class _MaskedTileResetsMax(TiledAttention):
    """A row's fully masked key tile is skipped, but the tile's maximum (-inf) overwrites the running maximum."""

    def update(self, acc, row_max, row_sum, scores, v):
        acc, new_max, row_sum = super().update(acc, row_max, row_sum, scores, v)
        tile_max = scores.amax(-1, keepdim=True)
        return acc, torch.where(tile_max == -torch.inf, tile_max, new_max), row_sum


@bug("ATTN-ORACLE", instance="state_rounded_per_tile",
     mechanism=("online softmax: accumulator and row sum stored in the input dtype between key tiles (half precision "
                "loses accuracy with S)"))
class _StateRoundedPerTile(TiledAttention):
    """The running accumulator and row sum are rounded to the input dtype after every key tile."""

    def __call__(self, query, key, value, *args, **kwargs):
        self.state_dtype = query.dtype
        return super().__call__(query, key, value, *args, **kwargs)

    def update(self, acc, row_max, row_sum, scores, v):
        acc, row_max, row_sum = super().update(acc, row_max, row_sum, scores, v)
        stored = lambda t: t.to(self.state_dtype).to(t.dtype)  # noqa: E731
        return stored(acc), row_max, stored(row_sum)


@bug("WINDOW-BOUNDS", api="flash", instance="running_max_sentinel_flash",
     mechanism=("flash_attn_func whose row max starts at the sentinel -1e4: rows of very negative scores inside a "
                "sliding window output zeros"))
class _RunningMaxSentinelFlash(FlashBase):
    """``flash_attn_func`` whose row maximum is taken with the sentinel -1e4 as its starting value."""

    def softmax(self, scores):
        return super().softmax(torch.cat([scores, torch.full_like(scores[..., :1], SENTINEL)], -1))[..., :-1]


running_max_sentinel = _RunningMaxSentinel()
masked_tile_resets_max = _MaskedTileResetsMax()
state_rounded_per_tile = _StateRoundedPerTile()
running_max_sentinel_flash = _RunningMaxSentinelFlash()
