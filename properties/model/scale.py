"""Where models break at scale, and the draws that reach there (SPEC.md, "Models": long draws).

Real model bugs hide below a length: a rotary angle computed in bfloat16 is exact while positions are integers that
bfloat16 holds (to 256) and wrong by radians past a few hundred; a sliding window that admits one key too many
changes nothing until a sequence is longer than the window; a cache that keeps only its last N positions is exact
until prompt plus generation pass N. The clauses that can see such bugs (MODEL-SHIFT, MODEL-WINDOW, MODEL-KV-CACHE
at length) draw lengths and positions just below, at and just above the model's *edges*:

- positions 64, 256 and 1024 (tile sizes of fused kernels, the last integer spacing bfloat16 keeps exact, a common
  trained length) and max_len - 1, the last position the model accepts;
- each sliding window W the subject declares (``Subject.window``, read from the config by ``hf_subject``) and the
  *horizon* it implies (how far back the last layer's output can see, through every windowed layer);
- further lengths the subject declares (``Subject.edges``: a cache block, a chunk size).

Every other model clause keeps its short draws (checks.DRAW_LEN): long draws cost whole forward passes over
thousands of positions, so only the clauses that need them take them.
"""
from __future__ import annotations

from hypothesis import strategies as st

from properties.core.subject import Subject

__all__ = ["MILESTONES", "SLACK", "horizon", "length_edges", "position_edges", "near", "fits_near"]

MILESTONES = (64, 256, 1024)
SLACK = 2   # how far below and above an edge the draws go


def horizon(s: Subject) -> int | None:
    """Σ (W_l - 1) over the layers: the farthest distance at which a token can reach an output through windowed
    self-attention; None without a window, or when a layer attends every position."""
    if not s.window or any(w is None for w in s.window):
        return None
    return sum(w - 1 for w in s.window)


def length_edges(s: Subject) -> tuple[int, ...]:
    """Sequence lengths in [2, max_len] where a model's behaviour may change, sorted: the first length whose last
    position passes each milestone, max_len itself, each declared window W, the horizon's first unreachable length
    (h + 2: the last position's output no longer sees the first token) and Subject.edges."""
    lengths = {m + 1 for m in MILESTONES} | {s.max_len} | set(s.edges)
    lengths |= {w for w in s.window or () if w is not None}
    h = horizon(s)
    if h is not None:
        lengths.add(h + 2)
    return tuple(sorted(n for n in lengths if 2 <= n <= s.max_len))


def position_edges(s: Subject) -> tuple[int, ...]:
    """Positions in [1, max_len - 1] where position arithmetic may break: each milestone, and max_len - 1."""
    return tuple(sorted(p for p in {*MILESTONES, s.max_len - 1} if 1 <= p <= s.max_len - 1))


@st.composite
def near(draw, edges: tuple[int, ...], low: int, high: int) -> int:
    """An int in [low, high] at most SLACK away from one of ``edges`` (clipped into the range); ``high`` when no
    edge lies in the range. A pinned example names it by a function of (edges, low, high)."""
    inside = [e for e in edges if low - SLACK <= e <= high + SLACK]
    if not inside:
        return high
    edge = draw(st.sampled_from(inside))
    return min(max(edge + draw(st.integers(-SLACK, SLACK)), low), high)


def fits_near(value: int, edges: tuple[int, ...], low: int, high: int) -> bool:
    """Whether ``near(edges, low, high)`` could draw ``value`` (PinnedData's check of a pinned example)."""
    return low <= value <= high
