"""Packed rows: several sequences laid end to end in each row of a batch (flash-attn's varlen semantics), so that
short sequences cost no padding in training and scoring (zoo/tasks/data.py: ``pack``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Packing"]


@dataclass(frozen=True)
class Packing:
    """Several sequences packed end to end into each row (flash-attn's varlen semantics, row by row): a token
    attends only to tokens of its own sequence, and positions restart at 0 with every sequence, so each one is
    computed exactly as if it were alone.

    segments (b, l) int: the index of each token's sequence within its row, non-decreasing, -1 for padding
    after the last one. positions (b, l): each token's position within its sequence (0 on padding)."""
    segments: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def from_segments(cls, segments: torch.Tensor) -> "Packing":
        if segments.dim() != 2 or segments.dtype.is_floating_point or segments.dtype == torch.bool:
            raise ValueError(f"segments must be an integer (batch, length) tensor, got {segments.dtype} "
                             f"{tuple(segments.shape)}")
        real = segments >= 0
        ordered = (segments[:, 1:] >= segments[:, :-1]) | ~real[:, 1:]
        if not bool((real[:, 1:] <= real[:, :-1]).all() & ordered.all()):
            raise ValueError("segments: each row must hold non-decreasing sequence indices, then -1 (padding) only")
        index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
        starts = torch.ones_like(real)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        return cls(segments, torch.where(real, index - first, torch.zeros_like(index)))
