"""Which rows of the sequence each rank holds (--shard), written from the definitions here: the suite shards the
problem and reassembles the answers itself, and shares no code with the kernels it checks (zoo/nn/context_parallel.py
states the same layouts for its kernels).

    contiguous  rank r holds rows r·L/W … (r + 1)·L/W − 1
    zigzag      the rows cut into 2W chunks; rank r holds chunk r, then chunk 2W − 1 − r

A length W (or 2W) does not divide is cut as ``torch.tensor_split`` cuts it: the first pieces one row longer.
"""
from __future__ import annotations

import torch

from properties.core.options import SHARD_LAYOUTS

__all__ = ["rows_of", "divides", "shard", "unshard"]


def rows_of(length: int, world: int, layout: str) -> list[torch.Tensor]:
    """The rows (global positions, in the order the rank holds them) of each of ``world`` ranks."""
    if layout not in SHARD_LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {SHARD_LAYOUTS}")
    positions = torch.arange(length)
    if layout == "contiguous":
        return list(torch.tensor_split(positions, world))
    chunks = torch.tensor_split(positions, 2 * world)
    return [torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)]


def divides(length: int, world: int, layout: str) -> bool:
    """Whether the layout gives every rank the same number of rows (and the zigzag chunks are equal)."""
    return length % (world if layout == "contiguous" else 2 * world) == 0


def shard(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A rank's shard of (b, h, L, x): its rows, contiguous."""
    return t[..., rows, :].contiguous()


def unshard(shards, rows, length: int) -> torch.Tensor:
    """The whole (b, h, L, x) from each rank's shard and rows."""
    first = shards[0]
    out = first.new_zeros(*first.shape[:-2], length, first.shape[-1])
    for piece, where in zip(shards, rows):
        out[..., where, :] = piece
    return out
