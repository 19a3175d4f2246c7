"""Extreme scores and tile-covering masks for the mask, causal and window clauses (SPEC.md, "Masks", "Extreme
scores under masks").

``Scores`` reshapes a case's float64 queries and keys so that the scaled scores of every row are *peaked* (one key
far above the others: the row spans the whole drawn magnitude) or all *very negative* (every score near −T, so
the row's maximum is too), with the largest scaled partial sum T = 2^round(magnitude · log2 score_limit(dtype)):
the range of ATTN-LARGE-SCORES, within the dtype's. ``covered_tiles`` masks whole aligned 64- or 128-key tiles of
random rows, the blocks a fused kernel skips.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from properties.core.strategies import scale_partial_sums, score_limit

__all__ = ["Scores", "TYPICAL", "score_shapes", "covered_tiles"]

# Below a shared direction's weight of 1, the noise that keeps scores distinct (and rows not constant).
_NOISE = 0.1


@dataclass(frozen=True)
class Scores:
    """kind: ``typical`` (the case's gaussian q, k), ``peaked`` or ``negative``; magnitude in [0, 1]: the fraction of
    the dtype's realistic exponent range the largest scaled partial sum reaches."""

    kind: str = "typical"
    magnitude: float = 0.0

    def apply(self, q: torch.Tensor, k: torch.Tensor, scale: float, dtype: torch.dtype,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) in float64 with this profile's scores: every query near a shared direction u, key j near
        −(offset + r_j) u with r_j uniform on [0, 1), rescaled so that the largest scaled partial sum is T: scores
        σ q·k ≈ −(offset + r_j) T / max|offset + r|. ``peaked``: offset −1/2, a row spans about [−T, T] and its top
        key stands far above the rest; ``negative``: offset 1, the whole row in about [−T, −T/2]."""
        if self.kind == "typical":
            return q, k
        return scale_partial_sums(*self.directions(q, k, generator), scale, self.target(dtype))

    def directions(self, q: torch.Tensor, k: torch.Tensor, generator: torch.Generator):
        """(q, k) of this profile before the common rescaling (features on the last axis, any layout)."""
        u = torch.randn(q.shape[-1], generator=generator, dtype=torch.float64)
        u = u / u.norm()
        r = torch.rand(*k.shape[:-1], 1, generator=generator, dtype=torch.float64)
        offset = {"peaked": -0.5, "negative": 1.0}[self.kind]
        return (u + _NOISE * q / math.sqrt(q.shape[-1]),
                -(offset + r) * u + _NOISE * k / math.sqrt(k.shape[-1]))

    def target(self, dtype: torch.dtype) -> float:
        """T: the largest scaled partial sum of this profile in ``dtype``."""
        return 2.0 ** round(self.magnitude * math.log2(score_limit(dtype)))


TYPICAL = Scores()


def score_shapes() -> st.SearchStrategy[Scores]:
    """Typical scores half the time; otherwise peaked or very negative ones over the realistic magnitudes."""
    extreme = st.builds(Scores, st.sampled_from(["peaked", "negative"]), st.floats(0.0, 1.0))
    return st.one_of(st.just(TYPICAL), extreme)


def covered_tiles(shape, tile: int | None, generator: torch.Generator) -> torch.Tensor:
    """(..., L, S) bool, True where a key is inside a whole aligned ``tile``-key tile that is masked for its row:
    each full tile of each row is covered with probability 1/2 (none for ``tile`` None or S < tile)."""
    *lead, l, s = shape
    tiles = s // tile if tile else 0
    cover = torch.zeros(*lead, l, s, dtype=torch.bool)
    if tiles:
        chosen = torch.rand(*lead, l, tiles, generator=generator, dtype=torch.float64) < 0.5
        cover[..., :tiles * tile] = chosen.repeat_interleave(tile, dim=-1)
    return cover
