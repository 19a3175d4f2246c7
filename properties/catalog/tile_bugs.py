"""Tile-boundary bugs: ``properties.catalog.tiled.TiledAttention`` (FlashAttention-2 in plain torch, tiles of 64)
with one step wrong, forward or backward, the way fused kernels get them wrong.

Each is exact on any problem that fits one 64 x 64 tile with a head size of at most 64 (L, S, E <= 64): its wrong
step only acts past the first tile, so a suite that draws only small problems passes it; tests/test_tile_bugs.py
shows it, bitwise, forward and backward. The pinned kernel-scale problems (L = S = 65 causal; L = 65, S = 130 with
E = 128 and a float mask; S = 1024) catch every one of them.

    pytest properties/ --kernel properties.catalog.tile_bugs:accumulator_not_rescaled
"""
from __future__ import annotations

import torch

from properties.catalog.registry import bug
from properties.catalog.tiled import TiledAttention

__all__ = ["accumulator_not_rescaled", "row_sum_not_rescaled", "remainder_key_tile_dropped",
           "causal_row_inside_tile", "head_halves_one_unscaled", "query_remainder_unwritten",
           "mask_tile_local_columns", "lse_of_last_tile_saved", "dk_dv_last_partial_tile_dropped",
           "dq_overwritten_per_key_tile"]


@bug("ATTN-ORACLE", "ATTN-CONVEX", instance="accumulator_not_rescaled",
     mechanism="online softmax: the accumulator is not rescaled when a later key tile raises the running max")
class _AccumulatorNotRescaled(TiledAttention):
    """When a later key tile raises the running maximum, the running sum is rescaled but the output accumulator
    is not: the earlier tiles' values keep the weight of the old maximum."""

    def update(self, acc, row_max, row_sum, scores, v):
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(row_max - safe)
        p = torch.exp(scores - safe)
        return acc + p @ v, new_max, row_sum * correction + p.sum(-1, keepdim=True)


@bug("ATTN-ORACLE", "ATTN-ROWSUM", instance="row_sum_not_rescaled",
     mechanism="online softmax: the running sum is not rescaled when a later key tile raises the max")
class _RowSumNotRescaled(TiledAttention):
    """The accumulator is rescaled when the maximum moves, the running sum (the softmax's denominator) is not."""

    def update(self, acc, row_max, row_sum, scores, v):
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(row_max - safe)
        p = torch.exp(scores - safe)
        return acc * correction + p @ v, new_max, torch.where(row_max > -torch.inf, row_sum, 0.0) + p.sum(-1, keepdim=True)


@bug("ATTN-ORACLE", "ATTN-ROWSUM", instance="remainder_key_tile_dropped",
     mechanism="S // 64 key tiles: the keys of a last partial tile are never read")
class _RemainderKeyTileDropped(TiledAttention):
    """S // BLOCK key tiles (at least one): the keys of a last partial tile are never read, forward or backward."""

    def key_tiles(self, s):
        return super().key_tiles(s)[:max(1, s // self.block)]


@bug("CAUSAL-ALIGNMENT", "ATTN-GRAD", instance="causal_row_inside_tile",
     mechanism="the causal test uses the row's index inside its 64-row query tile")
class _CausalRowInsideTile(TiledAttention):
    """The causal test compares the key position with the row's index inside its query tile, not its position:
    rows past the first tile see only the first keys."""

    def causal_rows(self, rows, i0):
        return rows - i0


@bug("ATTN-ORACLE", "SCALE-DEFAULT", instance="head_halves_one_unscaled",
     mechanism="head sizes above 64 in two 64-wide halves, the second one unscaled")
class _HeadHalvesOneUnscaled(TiledAttention):
    """Head sizes above 64 are done in two halves (two 64-wide products, as register tiling does) and only the
    first half's partial product is scaled."""

    def scores(self, q, k, sigma):
        if q.shape[-1] <= 64:
            return super().scores(q, k, sigma)
        return ((q[..., :64] * sigma) @ k[..., :64].transpose(-1, -2)
                + q[..., 64:] @ k[..., 64:].transpose(-1, -2))


@bug("ATTN-ORACLE", "ATTN-ROWSUM", instance="query_remainder_unwritten",
     mechanism="L // 64 query tiles: the rows of a last partial tile stay zero")
class _QueryRemainderUnwritten(TiledAttention):
    """L // BLOCK query tiles (at least one): the rows of a last partial query tile keep the zeros the output was
    allocated with (and get no gradient)."""

    def query_tiles(self, l):
        return super().query_tiles(l)[:max(1, l // self.block)]


@bug("MASK-FLOAT-ADDITIVE", "MASK-BOOL", instance="mask_tile_local_columns",
     mechanism="the attn_mask tile read at tile-local column offsets")
class _MaskTileLocalColumns(TiledAttention):
    """The attn_mask tile is read at the key tile's local column offsets (columns 0..63 for every key tile)."""

    def mask_tile(self, mask, i0, i1, j0, j1):
        return mask[..., i0:i1, :j1 - j0]


@bug("ATTN-GRAD", instance="lse_of_last_tile_saved",
     mechanism="backward: the log-sum-exp saved is the last key tile's, not the row's")
class _LseOfLastTileSaved(TiledAttention):
    """The log-sum-exp saved for the backward is written inside the key loop: the last key tile's own, not the
    row's. The forward is exact; the backward recomputes wrong weights."""

    def saved_lse(self, row_max, row_sum, tile_lse):
        return tile_lse


@bug("ATTN-GRAD", instance="dk_dv_last_partial_tile_dropped",
     mechanism="backward: dK, dV of the last partial key tile are never written")
class _DkDvLastPartialTileDropped(TiledAttention):
    """The backward writes dK and dV only for full key tiles (a store masked by the tile's size): the last
    partial tile of a longer sequence gets zero gradient."""

    def write_dk_dv(self, dk, dv, j0, j1, dk_tile, dv_tile):
        if j0 == 0 or j1 - j0 == self.block:
            super().write_dk_dv(dk, dv, j0, j1, dk_tile, dv_tile)


@bug("ATTN-GRAD", instance="dq_overwritten_per_key_tile",
     mechanism="backward: dQ stored per key tile instead of accumulated")
class _DqOverwrittenPerKeyTile(TiledAttention):
    """dQ is stored per key tile instead of accumulated: it holds only the last key tile's contribution."""

    def add_dq(self, dq, i0, i1, contribution):
        dq[..., i0:i1, :] = contribution


accumulator_not_rescaled = _AccumulatorNotRescaled()
row_sum_not_rescaled = _RowSumNotRescaled()
remainder_key_tile_dropped = _RemainderKeyTileDropped()
causal_row_inside_tile = _CausalRowInsideTile()
head_halves_one_unscaled = _HeadHalvesOneUnscaled()
query_remainder_unwritten = _QueryRemainderUnwritten()
mask_tile_local_columns = _MaskTileLocalColumns()
lse_of_last_tile_saved = _LseOfLastTileSaved()
dk_dv_last_partial_tile_dropped = _DkDvLastPartialTileDropped()
dq_overwritten_per_key_tile = _DqOverwrittenPerKeyTile()
