"""What Hypothesis draws, and the tensors a drawn case seeds.

Hypothesis draws only structure: shapes, the dtype, flags, magnitudes and one integer seed.  Bulk
tensors come from a ``torch.Generator`` seeded with that integer, always on the CPU in float64 and then
rounded to the case's dtype and moved to the device, so a counterexample is a short, readable line such
as ``Case(lead=(), l=1, s=2, e=1, ev=1, dtype=torch.float32, seed=0)`` and replays identically on every
device.  The dtypes drawn are the ones selected on the command line (``--dtype``); ``properties.plugin`` sets
them with :func:`select_dtypes` before any test module is imported.
"""
from __future__ import annotations

import contextlib
import inspect

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from properties.core.tiles import (TILE_HEAD_SIZES, TILE_LENGTHS, TILE_SHARE, drawn_head_size, head_sizes_up_to,
                                   kernel_limits, problem_budget, tile_shape)
from properties.core.dtypes import dtype_supported, select_dtypes, selected_dtypes
from zoo.config.options import DTYPES

__all__ = ["DTYPES", "derived_generator", "seeded_rng", "dtype_supported", "require_dtype", "select_dtypes", "selected_dtypes", "dtypes", "Case", "cases",
           "pinned_cases", "tile_pins", "tile_shape", "kernel_limits", "drawn_head_size", "head_sizes_up_to", "TILE_SHARE", "problem_budget", "TILE_LENGTHS", "TILE_HEAD_SIZES", "with_pinned_cases", "PinnedData", "could_draw", "seeds", "gaussian", "on", "identity_values",
           "random_bool_mask", "scale_partial_sums", "rescale_keys", "huge_values", "REALISTIC_SCORE", "score_limit",
           "pinned_property", "required"]


def derived_generator(seed: int, stream: int = 0) -> torch.Generator:
    """The CPU generator of an example's ``stream``-th independent draw: the one seed formula of the suite."""
    return torch.Generator().manual_seed(seed * 1009 + stream)

@st.composite
def _steered_dtype(draw) -> torch.dtype:
    return draw(st.sampled_from(kernel_limits().dtypes_among(selected_dtypes())))


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """The selected dtypes, float32 first, among those the kernel under test accepts (properties/core/limits.py).
    Read at each draw: the plugin selects them after this module loads."""
    return _steered_dtype()


seeds = st.integers(min_value=0, max_value=2**32 - 1)


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


def pinned_cases(n_lead: int = 2, tiles: bool = True, axes: int = 0) -> list[Case]:
    """Shapes every property also runs on, in the first selected dtype: L = 1, S = 1, odd head sizes, and
    B == L (a kernel that swaps the batch and query axes raises no shape error there, so the values are
    what catch it); with ``tiles``, the kernel-scale ones (``TILE_PINS``).  ``n_lead`` keeps that many leading dims."""
    dtype = selected_dtypes()[0]
    shapes = [((1, 1), 1, 1, 1, 1), ((1, 1), 1, 5, 3, 2), ((1, 1), 4, 1, 5, 3),
              ((1, 2), 3, 7, 7, 5), ((3, 2), 3, 4, 4, 4)]
    small = [Case(lead=lead[:n_lead], l=l, s=s, e=e, ev=ev, dtype=dtype, seed=0, axes=axes)
             for lead, l, s, e, ev in shapes]
    return small + (tile_pins(n_lead, axes) if tiles else [])


def tile_pins(n_lead: int = 2, axes: int = 0) -> list[Case]:
    """The kernel-scale shapes pinned in every kernel clause: L = S = 65 (one query and one key past a 64-tile:
    partial last tiles on both axes, causal in the causal clauses); L = 65, S = 130 with E = 128 (L != S, a
    two-row last key tile of 64, a head size past 64; the mask clauses add their float mask); S = 1024 in
    bfloat16 (long rows: 16 full tiles of 64, 8 of 128); L = S = 129 with E = 96 (one past a 128-tile, for kernels
    whose query tiles are 128 rows; a head size that is no power of two)."""
    first = selected_dtypes()[0]
    return [Case(lead=(1, 1)[:n_lead], l=l, s=s, e=e, ev=ev, dtype=dtype, seed=0, axes=axes)
            for l, s, e, ev, dtype in ((65, 65, 64, 64, first), (65, 130, 128, 64, first),
                                       (3, 1024, 64, 64, torch.bfloat16), (129, 129, 96, 96, first))]


def with_pinned_cases(argname: str = "case", n_lead: int = 2, tiles: bool = True, axes: int = 0, **other_args):
    """Decorator: run the test on :func:`pinned_cases` as explicit examples (``axes``: as in ``cases``);
    ``other_args`` give the test's other drawn arguments."""
    def decorate(test):
        for case in pinned_cases(n_lead, tiles, axes):
            test = example(**{argname: case}, **other_args)(test)
        return test
    return decorate


def pinned_property(settings, drawn: dict, *pinned: dict):
    """Decorator: the stack that a family of properties shares, so that each test names only its clause:
    ``settings`` (a ``hypothesis.settings``), an ``@example(**p)`` for each ``p`` of ``pinned`` (run in that
    order, before anything drawn) and ``@given(**drawn)``."""
    def decorate(test):
        test = given(**drawn)(test)
        for p in reversed(pinned):
            test = example(**p)(test)
        return settings(test)
    return decorate


def required(value, reason: str):
    """``value``, once the test is skipped with ``reason`` where it is None (an option this run was not given)."""
    if value is None:
        pytest.skip(reason)
    return value


class PinnedData:
    """``st.data()`` in an ``@example``: each ``data.draw(strategy, label=L)`` in the test's body returns
    ``values[L]``, so the shapes a test draws inside its body are pinned as well as its arguments::

        @example(p=Tokens(...), data=PinnedData({"sample": 1, "position": 2}))

    A value the strategy could not have drawn there (:func:`could_draw`: outside an integer range that depends
    on the subject, say) rejects the example as ``assume`` does, so a pin never checks what the clause does not
    claim.  ``checks`` maps the name of a composite strategy to ``check(value, *args, **kwargs) -> bool``.  A
    callable value is a shape that depends on the subject: it is called with the strategy's arguments
    (``{"length": lambda low, high: high}`` pins ``st.integers(1, s.max_len)`` to max_len)."""

    def __init__(self, values: dict, checks: dict | None = None):
        self.values, self.checks = dict(values), dict(checks or {})

    def draw(self, strategy, label=None):
        if label not in self.values:
            raise KeyError(f"the pinned example gives no value for the draw {label!r} (it gives {sorted(self.values)})")
        value = self.values[label]
        if callable(value):
            args, kwargs = _arguments(strategy)
            value = value(*args, **kwargs)
        assume(could_draw(strategy, value, self.checks))
        return value

    def __repr__(self) -> str:
        def show(v):   # a subject-dependent value by its docstring: <max_len>
            return f"<{(v.__doc__ or v.__name__).strip()}>" if callable(v) else repr(v)
        return "PinnedData({" + ", ".join(f"{k!r}: {show(v)}" for k, v in self.values.items()) + "})"

    def _repr_pretty_(self, printer, cycle):  # one line in Hypothesis' report of a failing example
        printer.text(repr(self))


def _arguments(strategy) -> tuple[tuple, dict]:
    """The arguments a lazily built strategy (``st.integers(1, 8)``, a composite's call) was given."""
    if getattr(strategy, "function", None) is None:
        raise TypeError(f"a pinned value that depends on the strategy needs its arguments; {strategy!r} has none")
    return strategy._LazyStrategy__args, strategy._LazyStrategy__kwargs


def could_draw(strategy, value, checks: dict | None = None) -> bool:
    """Whether ``strategy`` could draw ``value``, as far as can be told: the bounds of ``integers``, the items of
    ``permutations`` and ``sampled_from``, every ``filter``, and ``checks[name]`` for a composite strategy of
    that name; anything else is taken on trust.  (It reads the arguments Hypothesis keeps in its lazily built
    strategies: private attributes of Hypothesis 6, read nowhere else in the suite.)"""
    if not all(t[1](value) for t in getattr(strategy, "_transformations", ()) if t[0] == "filter"):
        return False
    if isinstance(getattr(strategy, "elements", None), (tuple, list, range)):   # sampled_from
        return value in strategy.elements
    function = getattr(strategy, "function", None)          # a lazily built strategy: its function and arguments
    if function is None:
        return True
    args, kwargs = _arguments(strategy)
    name = function.__name__
    if name in (checks or {}):
        return bool(checks[name](value, *args, **kwargs))
    if name not in ("integers", "permutations"):
        return True
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if name == "integers":
        return ((a["min_value"] is None or value >= a["min_value"]) and
                (a["max_value"] is None or value <= a["max_value"]))
    return sorted(value) == sorted(a["values"])


def gaussian(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def on(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Round to ``dtype`` on the CPU (the same rounding on every device), then move."""
    return t.to(dtype).to(device)


def identity_values(lead: tuple[int, ...], s: int, dtype: torch.dtype, device) -> torch.Tensor:
    """V = I_S for every leading index: attention is linear in V, so the output is the weight matrix."""
    return torch.eye(s, dtype=dtype, device=device).expand(*lead, s, s).contiguous()


def random_bool_mask(generator: torch.Generator, shape, density: float, *, keep_one: bool = True):
    """Bernoulli(density) bool mask (True = may attend); ``keep_one`` gives every query a random key."""
    mask = torch.rand(*shape, generator=generator, dtype=torch.float64) < density
    if keep_one:
        pick = torch.randint(shape[-1], (*shape[:-1], 1), generator=generator)
        mask = mask | torch.zeros(shape, dtype=torch.bool).scatter(-1, pick, True)
    return mask


def _largest_partial_sum(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    return (abs(scale) * (q.abs() @ k.abs().transpose(-1, -2))).max().item()


# The largest scaled attention score (and partial sum of one) that real activations reach. Trained models keep
# scores within a few hundred; the unstable runs that QK-normalisation was introduced for (ViT-22B, Dehghani
# et al. 2023) saw attention logits grow to about 5·10^4 before diverging. 2^16 covers that; beyond it a
# model has already failed, so a kernel is not required to compute there.
REALISTIC_SCORE = 2.0 ** 16


def score_limit(dtype: torch.dtype) -> float:
    """Largest scaled partial sum drawn for ``dtype``: the realistic range, and at most finfo.max/4 (room for
    the max subtraction, a difference of two scores, and rounding)."""
    return min(REALISTIC_SCORE, torch.finfo(dtype).max / 4)


def scale_partial_sums(q: torch.Tensor, k: torch.Tensor, scale: float, target: float):
    """Rescale q and k (float64) by one factor so that max_ij scale * sum_e |q_ie k_je| == target.

    Every partial sum of every scaled score is then at most ``target`` in magnitude, whatever order a
    kernel adds in: the precondition of ATTN-LARGE-SCORES.  (Square roots taken apart: target/current
    itself may overflow.)"""
    current = _largest_partial_sum(q, k, scale)
    if current == 0:
        return q, k
    factor = math.sqrt(target) / math.sqrt(current)
    return q * factor, k * factor


def rescale_keys(q: torch.Tensor, k: torch.Tensor, scale: float, target: float, limit: float) -> torch.Tensor:
    """k (float64) rescaled so that max_ij scale * sum_e |q_ie k_je| reaches ``target`` against these
    queries (keys as large as the dtype allows, ATTN-LARGE-SCORES' precondition), with no entry above
    ``limit`` (small queries would otherwise need keys beyond the dtype's range)."""
    current, largest = _largest_partial_sum(q, k, scale), k.abs().max().item()
    if current == 0 or largest == 0:
        return k
    log_factor = min(math.log2(target) - math.log2(current), math.log2(limit) - math.log2(largest))
    half = log_factor / 2  # tiny keys may need a factor beyond float64's range; its square root is not
    return k * 2.0**half * 2.0**half


def huge_values(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of magnitude finfo(dtype).max / 4 with v's signs: as large as a convex combination can
    carry without rounding up to Inf."""
    return torch.where(v < 0, -1.0, 1.0).to(torch.float64) * (torch.finfo(dtype).max / 4)


def require_dtype(device: str, dtype: torch.dtype) -> None:
    """Discard an example whose dtype the device cannot compute in, or that the run did not select (an
    ``@example`` pinned in float16 is skipped under ``--dtype float32``)."""
    assume(dtype in selected_dtypes() and dtype_supported(device, dtype))


@contextlib.contextmanager
def seeded_rng(device: str, seed: int):
    """Dropout draws from the global generators: seed them from the case (so a failure replays) and
    restore them afterwards."""
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield
