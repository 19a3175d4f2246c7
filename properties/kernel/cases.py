"""Attention problems at the kernel level: a ``Case`` (shapes, dtype, seed), and ``cases``, a strategy of general use
that draws one inside the limits of the kernel under test (a property of a user's own writes ``@given(case=cases())``;
the suite's clauses draw from their covering schedule, properties/kernel/schedule.py). The bulk tensors follow the
suite's one seed formula (properties/core/strategies.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from properties.core.strategies import derived_generator, gaussian, on, require_dtype, seeds
from properties.core.dtypes import selected_dtypes
from properties.kernel.tiles import TILE_SHARE, drawn_head_size, kernel_limits, tile_shape

__all__ = ["dtypes", "Case", "cases"]


@st.composite
def _steered_dtype(draw) -> torch.dtype:
    return draw(st.sampled_from(kernel_limits().dtypes_among(selected_dtypes())))


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """The selected dtypes, float32 first, among those the kernel under test accepts (properties/kernel/limits.py).
    Read at each draw: the plugin selects them after this module loads."""
    return _steered_dtype()


@dataclass(frozen=True)
class Case:
    """One attention problem: leading (batch, head) dims, query/key lengths, head sizes, dtype, seed."""

    lead: tuple[int, ...]
    l: int
    s: int
    e: int
    ev: int
    dtype: torch.dtype
    seed: int
    axes: int = 0   # leading dims the test adds in front of ``lead`` (a head axis, a stack of draws): see Limits.fit

    def __repr__(self) -> str:
        return (f"Case(lead={self.lead}, l={self.l}, s={self.s}, e={self.e}, ev={self.ev}, dtype={self.dtype}, "
                f"seed={self.seed}{f', axes={self.axes}' if self.axes else ''})")

    def generator(self, stream: int = 0) -> torch.Generator:
        """A CPU generator for this case; ``stream`` gives independent draws for the same case."""
        return derived_generator(self.seed, stream)

    def qkv64(self, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Standard-normal query, key and value in float64 (CPU), before rounding to the dtype."""
        g = self.generator(stream)
        return (gaussian(g, *self.lead, self.l, self.e), gaussian(g, *self.lead, self.s, self.e),
                gaussian(g, *self.lead, self.s, self.ev))

    def qkv(self, device, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The case's query, key and value in its dtype on ``device`` (an example whose dtype the device cannot
        compute in is discarded)."""
        require_dtype(str(device), self.dtype)
        return tuple(on(t, self.dtype, device) for t in self.qkv64(stream))


@st.composite
def cases(draw, *, lead=None, min_lead=0, max_lead=2, max_dim=3, min_l=1, max_l=8, min_s=1, max_s=8,
          max_e=16, max_ev=8, dtype=None, tiles=True, weights=False, axes=0) -> Case:
    """Attention problems; ``lead`` fixes the number of leading dims (0, 1 or 2: batch and heads), ``axes`` counts
    those the test adds in front of them (then ``lead`` is the preferred number, moved into the kernel's ranks).
    With ``tiles``, one draw in TILE_SHARE is at kernel scale (``tile_shape``); ``weights``: the test reads the
    weights through V = I (its cost grows as L S^2). Every draw stays inside the limits of the kernel under test."""
    limits = kernel_limits()
    if lead is not None:
        n_lead = lead
        if limits.ranks is not None and lead + axes not in limits.ranks:
            n_lead = len(limits.fit(Case((1,) * lead, 1, 1, 1, 1, torch.float64, 0, axes)).lead)
    else:
        ranks = limits.ranks_with(axes, min_lead, max_lead)
        n_lead = draw(st.sampled_from(ranks)) if ranks else draw(st.integers(min_lead, max_lead))
    big = tiles and draw(st.integers(0, TILE_SHARE - 1)) == TILE_SHARE - 1
    dims = tuple(draw(st.integers(1, 2 if big else max_dim)) for _ in range(n_lead))
    if big:
        l, s, e, ev = draw(tile_shape(math.prod(dims), min_l=min_l, min_s=min_s, weights=weights))
    else:
        l, s = draw(st.integers(min_l, max_l)), draw(st.integers(min_s, max_s))
        e = draw(drawn_head_size(limits, 1, max_e))
        ev = e if limits.equal_head_sizes else draw(drawn_head_size(limits, 1, max_ev))
        if limits.equal_lengths:
            l = s = max(l, s)
        l, s = limits.length(l), limits.length(s)
    return Case(lead=dims, l=l, s=s, e=e, ev=ev, dtype=draw(dtype if dtype is not None else dtypes()),
                seed=draw(seeds), axes=axes)
