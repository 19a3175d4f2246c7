"""Kernel-scale problems, and draws steered into the limits of the kernel under test (SPEC.md, "Problems at kernel
scale, kernels with limits, coverage"). ``properties.kernel.cases.cases`` and the gradient clauses' ``grad_cases``
draw one problem in ``TILE_SHARE`` from ``tile_shape``; every draw reads ``kernel_limits()``, the limits the plugin
makes active around each test (properties/kernel/limits.py).
"""
from __future__ import annotations

from hypothesis import strategies as st

from properties.kernel.limits import Limits, active, active_device

__all__ = ["kernel_limits", "set_run_seed", "run_seed", "run_choice", "RUN_HEAD_SIZES", "TILE_SHARE", "TILE_LENGTHS", "TILE_HEAD_SIZES", "BUDGET", "problem_budget",
           "tile_shape", "drawn_head_size", "head_sizes_up_to"]


def kernel_limits() -> Limits:
    """What the kernel under test accepts on its device (properties/kernel/limits.py); no limits outside a test."""
    return active() or _NO_LIMITS


_NO_LIMITS = Limits()

# ------------------------------------------------------------------------------------------ kernel scale
# Fused kernels tile queries and keys in blocks of 64 or 128: lengths around multiples of 64 (63, 64, 65, ...) give
# full, partial and single-row last tiles; head sizes of real models (64 to 256) cross a 64-wide half. One draw in
# TILE_SHARE is at that scale; its size is bounded by the problem budget so that the float64 oracle stays cheap.
TILE_SHARE = 6
TILE_LENGTHS = tuple(n for m in (64, 128, 192, 256, 512, 1024, 2048, 4096) for n in (m - 1, m, m + 1))
TILE_HEAD_SIZES = (64, 80, 96, 128, 192, 256)
BUDGET = 2 ** 20   # L * S * max(E, Ev) per example (L * S * S where the weights are read through V = I)


def problem_budget() -> tuple[int, int]:
    """(multiply-adds per example, longest length) for the tile-scale draws: 2^20 and 1025 at the default profile on
    the CPU; 4x for a profile of 100 examples or more (thorough) and 4x on CUDA, the top length doubling with each."""
    from hypothesis import settings
    factor = (4 if settings.default.max_examples >= 100 else 1) * (4 if active_device().startswith("cuda") else 1)
    return BUDGET * factor, {1: 1025, 4: 2049}.get(factor, 4097)


@st.composite
def head_sizes_up_to(draw, high: int) -> int:
    """A head size in [1, high] that the kernel under test accepts (drawn anew for each kernel)."""
    return draw(drawn_head_size(kernel_limits(), 1, high))


# Each head size a compiled kernel meets costs it a compile (Triton: one binary per HEAD constexpr). A run draws its
# head sizes from a few chosen for it (from the run's Hypothesis seed: every test of the run, and its replay, sees the
# same ones; another seed, others) and varies everything else; the pinned problems keep theirs.
RUN_HEAD_SIZES = {"small": 4, "tile": 3}
_run = {"seed": None}


def set_run_seed(seed: int | None) -> None:
    """The seed of this run's choice of head sizes (the plugin sets the run's Hypothesis seed; None: no choice)."""
    _run["seed"] = seed


def run_seed() -> int | None:
    """The run's Hypothesis seed (None outside a suite run)."""
    return _run["seed"]


def run_choice(candidates, kind: str) -> list:
    """The ``RUN_HEAD_SIZES[kind]`` of ``candidates`` this run draws from (all of them outside a suite run)."""
    candidates = sorted(candidates)
    if _run["seed"] is None or len(candidates) <= RUN_HEAD_SIZES[kind]:
        return candidates
    import random
    chooser = random.Random(f"{_run['seed']} {kind} {candidates}")
    return sorted(chooser.sample(candidates, RUN_HEAD_SIZES[kind]))


def drawn_head_size(limits: Limits, low: int, high: int) -> st.SearchStrategy[int]:
    """A head size in [low, high] (among this run's: ``run_choice``), or the smallest the kernel accepts above."""
    if limits.head_sizes is None:
        return st.sampled_from(run_choice(range(low, high + 1), "small"))
    inside = [n for n in limits.head_sizes if low <= n <= high]
    return st.sampled_from(run_choice(inside, "small") if inside else sorted(limits.head_sizes))


@st.composite
def tile_shape(draw, lead_size: int = 1, *, min_l: int = 1, min_s: int = 1, weights: bool = False):
    """(L, S, E, Ev) at kernel scale: S around a multiple of 64 up to the top length, a real head size, and L among
    the small and the tile lengths that keep L * S * max(E, Ev[, S]) * lead_size within the budget (L != S and
    partial last tiles on both axes come naturally); inside the kernel's limits."""
    limits = kernel_limits()
    budget, top = problem_budget()
    sizes = [n for n in TILE_HEAD_SIZES if limits.head_sizes is None or n in limits.head_sizes]
    sizes = run_choice(sizes, "tile") or sorted(limits.head_sizes, reverse=True)[:1]
    e = draw(st.sampled_from(sizes))
    ev = e if limits.equal_head_sizes or draw(st.booleans()) else draw(st.sampled_from(sizes))

    def cost(l, s):
        return l * s * max(e, ev, s if weights else 0) * lead_size
    lengths = [limits.length(n) for n in TILE_LENGTHS if n <= top]
    if limits.equal_lengths:
        square = [n for n in lengths if cost(n, n) <= budget and n >= max(min_l, min_s)] or [limits.length(64)]
        l = s = draw(st.sampled_from(square))
        return l, s, e, ev
    s = draw(st.sampled_from([n for n in lengths if n >= min_s and cost(1, n) <= budget] or [lengths[0]]))
    short = [limits.length(n) for n in range(1, 9)]
    l = draw(st.sampled_from([n for n in short + lengths if n >= min_l and cost(n, s) <= budget] or [short[0]]))
    return l, s, e, ev
