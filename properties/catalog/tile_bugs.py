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

from properties.catalog.tiled import TiledAttention

__all__ = ["BUGS", "accumulator_not_rescaled", "row_sum_not_rescaled", "remainder_key_tile_dropped",
           "causal_row_inside_tile", "head_halves_one_unscaled", "query_remainder_unwritten",
           "mask_tile_local_columns", "lse_of_last_tile_saved", "dk_dv_last_partial_tile_dropped",
           "dq_overwritten_per_key_tile"]


class _AccumulatorNotRescaled(TiledAttention):
    """When a later key tile raises the running maximum, the running sum is rescaled but the output accumulator
    is not: the earlier tiles' values keep the weight of the old maximum."""

    def update(self, acc, row_max, row_sum, scores, v):
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(row_max - safe)
        p = torch.exp(scores - safe)
        return acc + p @ v, new_max, row_sum * correction + p.sum(-1, keepdim=True)


class _RowSumNotRescaled(TiledAttention):
    """The accumulator is rescaled when the maximum moves, the running sum (the softmax's denominator) is not."""

    def update(self, acc, row_max, row_sum, scores, v):
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(row_max - safe)
        p = torch.exp(scores - safe)
        return acc * correction + p @ v, new_max, torch.where(row_max > -torch.inf, row_sum, 0.0) + p.sum(-1, keepdim=True)


class _RemainderKeyTileDropped(TiledAttention):
    """S // BLOCK key tiles (at least one): the keys of a last partial tile are never read, forward or backward."""

    def key_tiles(self, s):
        return super().key_tiles(s)[:max(1, s // self.block)]


class _CausalRowInsideTile(TiledAttention):
    """The causal test compares the key position with the row's index inside its query tile, not its position:
    rows past the first tile see only the first keys."""

    def causal_rows(self, rows, i0):
        return rows - i0


class _HeadHalvesOneUnscaled(TiledAttention):
    """Head sizes above 64 are done in two halves (two 64-wide products, as register tiling does) and only the
    first half's partial product is scaled."""

    def scores(self, q, k, sigma):
        if q.shape[-1] <= 64:
            return super().scores(q, k, sigma)
        return ((q[..., :64] * sigma) @ k[..., :64].transpose(-1, -2)
                + q[..., 64:] @ k[..., 64:].transpose(-1, -2))


class _QueryRemainderUnwritten(TiledAttention):
    """L // BLOCK query tiles (at least one): the rows of a last partial query tile keep the zeros the output was
    allocated with (and get no gradient)."""

    def query_tiles(self, l):
        return super().query_tiles(l)[:max(1, l // self.block)]


class _MaskTileLocalColumns(TiledAttention):
    """The attn_mask tile is read at the key tile's local column offsets (columns 0..63 for every key tile)."""

    def mask_tile(self, mask, i0, i1, j0, j1):
        return mask[..., i0:i1, :j1 - j0]


class _LseOfLastTileSaved(TiledAttention):
    """The log-sum-exp saved for the backward is written inside the key loop: the last key tile's own, not the
    row's. The forward is exact; the backward recomputes wrong weights."""

    def saved_lse(self, row_max, row_sum, tile_lse):
        return tile_lse


class _DkDvLastPartialTileDropped(TiledAttention):
    """The backward writes dK and dV only for full key tiles (a store masked by the tile's size): the last
    partial tile of a longer sequence gets zero gradient."""

    def write_dk_dv(self, dk, dv, j0, j1, dk_tile, dv_tile):
        if j0 == 0 or j1 - j0 == self.block:
            super().write_dk_dv(dk, dv, j0, j1, dk_tile, dv_tile)


class _DqOverwrittenPerKeyTile(TiledAttention):
    """dQ is stored per key tile instead of accumulated: it holds only the last key tile's contribution."""

    def add_dq(self, dq, i0, i1, contribution):
        dq[..., i0:i1, :] = contribution


_KERNELS = {
    "accumulator_not_rescaled": _AccumulatorNotRescaled,
    "row_sum_not_rescaled": _RowSumNotRescaled,
    "remainder_key_tile_dropped": _RemainderKeyTileDropped,
    "causal_row_inside_tile": _CausalRowInsideTile,
    "head_halves_one_unscaled": _HeadHalvesOneUnscaled,
    "query_remainder_unwritten": _QueryRemainderUnwritten,
    "mask_tile_local_columns": _MaskTileLocalColumns,
    "lse_of_last_tile_saved": _LseOfLastTileSaved,
    "dk_dv_last_partial_tile_dropped": _DkDvLastPartialTileDropped,
    "dq_overwritten_per_key_tile": _DqOverwrittenPerKeyTile,
}
# name -> (mechanism, the clauses that catch it on the pinned problems)
BUGS = {
    "accumulator_not_rescaled": ("online softmax: the accumulator is not rescaled when a later key tile raises the "
                                 "running max", ("ATTN-ORACLE", "ATTN-CONVEX")),
    "row_sum_not_rescaled": ("online softmax: the running sum is not rescaled when a later key tile raises the max",
                             ("ATTN-ORACLE", "ATTN-ROWSUM")),
    "remainder_key_tile_dropped": ("S // 64 key tiles: the keys of a last partial tile are never read",
                                   ("ATTN-ORACLE", "ATTN-ROWSUM")),
    "causal_row_inside_tile": ("the causal test uses the row's index inside its 64-row query tile",
                               ("CAUSAL-ALIGNMENT", "ATTN-GRAD")),
    "head_halves_one_unscaled": ("head sizes above 64 in two 64-wide halves, the second one unscaled",
                                 ("ATTN-ORACLE", "SCALE-DEFAULT")),
    "query_remainder_unwritten": ("L // 64 query tiles: the rows of a last partial tile stay zero",
                                  ("ATTN-ORACLE", "ATTN-ROWSUM")),
    "mask_tile_local_columns": ("the attn_mask tile read at tile-local column offsets",
                                ("MASK-FLOAT-ADDITIVE", "MASK-BOOL")),
    "lse_of_last_tile_saved": ("backward: the log-sum-exp saved is the last key tile's, not the row's",
                               ("ATTN-GRAD",)),
    "dk_dv_last_partial_tile_dropped": ("backward: dK, dV of the last partial key tile are never written",
                                        ("ATTN-GRAD",)),
    "dq_overwritten_per_key_tile": ("backward: dQ stored per key tile instead of accumulated", ("ATTN-GRAD",)),
}

for _name, _cls in _KERNELS.items():
    globals()[_name] = _cls()
