"""Dropout on the attention weights: off means deterministic; on, the drop rate and the expectation
match p and the no-dropout output, and the drops of any two weights are independent — across heads, batch entries
and positions of one slice, tile to tile (statistical, false-alarm probability <= 1e-6 per example)."""
from __future__ import annotations

import dataclasses
import math

import torch
from einops import rearrange, repeat
from hypothesis import example, strategies as st

from properties import clause
from properties.core import evidence
from properties.kernel import coverage
from properties.core.assertions import assert_within, fmt
from properties.kernel.coverage import BITWISE, WITHIN_BOUND
from properties.kernel.repeats import bitwise_equal
from properties.core.oracle import to_float64
from properties.kernel.statistics import FALSE_ALARM, hoeffding_halfwidth, stacked_copies
from properties.core.strategies import seeded_rng
from properties.core.dtypes import selected_dtypes
from properties.kernel.guard import check_dropout_rate
from properties.core.strategies import on
from properties.kernel.problem_space import SHAPES, Extra, Problem, Space
from properties.kernel.schedule import scheduled
from properties.core.tolerance import output_bound, softmax_bounds

# Any rate, and the multiples of 1/16 (the rates cuDNN's dropout takes: other kernels are drawn them too).
P = Extra((0.5, 0.05, 0.95, 1 / 16, 0.25, 0.75, 15 / 16),
          st.one_of(st.floats(0.05, 0.95), st.sampled_from([i / 16 for i in range(1, 16)])))
# Hundreds of copies per problem: the rate and expectation clauses stay at short lengths and small head sizes
# (DROPOUT-OFF poses every class; DROPOUT-INDEPENDENT the tiles).
SMALL = dict(L=("one", "short"), S=("one", "short"), order=True, E=("odd", "8k"), Ev=("odd", "8k"), dtype=True,
             rank=True, fixed={"dropout": True}, extras={"p": P}, lengths={"short": (2, 3, 4, 5, 7, 8)})


def _pinned_4d() -> Problem:
    """A (B, H) = (2, 3) problem in the first selected dtype: the dropout clauses on real shapes."""
    return Problem(lead=(2, 3), l=3, s=5, e=4, ev=3, dtype=selected_dtypes()[0], seed=0, extras=(("p", 0.5),))


def _on_copies(fn, n: int, tensors, p: float, device, seed: int) -> torch.Tensor:
    """fn(*tensors, dropout_p=p) on n copies of the tensors in one call (n independent dropout draws), with the RNG
    seeded from the case so that a failure replays; the result in float64, the copies on its first axis. The copies
    go on a new leading axis of a problem without one, else on its batch axis (a 4-D problem stays 4-D)."""
    with seeded_rng(device, seed):
        out = to_float64(fn(*stacked_copies(n, *tensors), dropout_p=p))
    return out if tensors[0].dim() == 2 else rearrange(out, "(n b) ... -> n b ...", n=n)


@clause("DROPOUT-OFF")
@scheduled(Space.of("DROPOUT-OFF", **SHAPES))
def test_zero_dropout_is_deterministic(kernel, device, case):
    q, k, v = case.qkv(device)
    first = to_float64(kernel(q, k, v, dropout_p=0.0))
    second = to_float64(kernel(q, k, v, dropout_p=0.0))
    if bitwise_equal(first, second):
        coverage.compared(BITWISE)
        return
    # Calls that differ may still drop nothing: a kernel whose sums vary in order (atomics, split-K). Each must then
    # agree with the oracle without dropout (ATTN-ORACLE's bound), as a dropped weight would not.
    coverage.compared(WITHIN_BOUND)
    for call in (first, second):
        bounds = softmax_bounds(q, k, v)
        assert_within(call, bounds.reference.output, output_bound(bounds, v), what="out with dropout_p=0",
                      reference="oracle without dropout", note=" (two identical calls with dropout_p=0 differed, "
                      "so each is compared with the oracle)")


COPIES_FOR_RATE = 256


@clause("DROPOUT-RATE")
@example(case=_pinned_4d())
@scheduled(Space.of("DROPOUT-RATE", **SMALL))
def test_dropout_zeroes_weights_with_probability_p(kernel, device, case):
    p = case.p
    q, k, _ = case.qkv(device)
    bounds = softmax_bounds(q, k)
    positive = bounds.lower > 0  # weights that are nonzero without dropout (even after rounding)
    w = _on_copies(kernel.weights, COPIES_FOR_RATE, (q, k), p, device, case.seed)
    evidence.record("dropout-rate", subject=kernel.name, device=str(device), query=q, key=k, p=p,
                    copies=COPIES_FOR_RATE, seed=case.seed, positive=positive)
    check_dropout_rate(w, positive, p)


COPIES_FOR_MEAN = 2048


@clause("DROPOUT-EXPECTATION")
@example(case=_pinned_4d())
@scheduled(Space.of("DROPOUT-EXPECTATION", **SMALL))
def test_dropout_leaves_the_expected_output_unchanged(kernel, device, case):
    p = case.p
    q, k, _ = case.qkv(device)
    # Non-negative values: a copy's output then lies in [0, R], with R = sum_j w_j v_j / (1 - p).
    v = on(torch.rand(*case.lead, case.s, case.ev, generator=case.generator(1), dtype=torch.float64), case.dtype,
           device)
    bounds = softmax_bounds(q, k, v)
    out = _on_copies(kernel, COPIES_FOR_MEAN, (q, k, v), p, device, case.seed)
    mean = out.mean(dim=0)
    value_range = bounds.reference.output / (1 - p)
    statistical = value_range * hoeffding_halfwidth(COPIES_FOR_MEAN, 1.0, FALSE_ALARM / mean.numel())
    rounding = output_bound(bounds, v, extra_roundings=1, weight_factor=1 / (1 - p))
    evidence.record("dropout-mean", subject=kernel.name, device=str(device), query=q, key=k, value=v, p=p,
                    copies=COPIES_FOR_MEAN, seed=case.seed, bound=statistical + rounding)
    assert_within(mean, bounds.reference.output, statistical + rounding,
                  what=f"mean over {COPIES_FOR_MEAN} dropout draws (p = {fmt(p)}) of out",
                  reference="oracle without dropout",
                  note=f" (Hoeffding at level {FALSE_ALARM:g} over {mean.numel()} coordinates, plus rounding)")


# Pairs compared per statistic: enough that weights whose drops agree on every pair are told from independent drops at
# every drawn p (1 - (p^2 + (1-p)^2) >= 0.095 against a Hoeffding half-width below 0.05 at 4096 pairs and the
# budget split over every statistic).
PAIRS_FOR_INDEPENDENCE = 4096
# Offsets between the positions paired inside a slice: neighbours, and the tiles of fused kernels (16 to 128).
OFFSETS = (1, 16, 32, 64, 128)


def _pairs(l: int, s: int, b: int, h: int) -> list[tuple[str, tuple, tuple]]:
    """(name, first, second): disjoint pairs of weights as index tuples into (copies, B, H, L, S) — heads (0, 1),
    (2, 3), ... of every batch entry; batch entries likewise; and inside each slice, for each offset d, rows i and
    i + d for the i with i mod 2d < d (columns likewise): each weight in at most one pair of a statistic."""
    every = slice(None)
    out = []
    if h > 1:
        out.append(("heads", (every, every, slice(0, h - 1, 2)), (every, every, slice(1, h, 2))))
    if b > 1:
        out.append(("batch entries", (every, slice(0, b - 1, 2)), (every, slice(1, b, 2))))
    for axis, n in (("rows", l), ("columns", s)):
        for d in OFFSETS:
            if d >= n:
                continue
            first = torch.tensor([i for i in range(n - d) if i % (2 * d) < d])
            index = (every, every, every, first) if axis == "rows" else (every, every, every, every, first)
            shifted = (every, every, every, first + d) if axis == "rows" else (every, every, every, every, first + d)
            out.append((f"{axis} {d} apart", index, shifted))
    return out


@clause("DROPOUT-INDEPENDENT")
@example(case=dataclasses.replace(_pinned_4d(), lead=(2, 2), l=1, s=1, extras=(("p", 0.05),)))
@example(case=_pinned_4d())
@scheduled(Space.of("DROPOUT-INDEPENDENT", L=("short", "tile"), S=("short", "tile"), order=True, E=("odd", "8k"),
                    dtype=True, fixed={"dropout": True, "rank": "2"}, extras={"p": P},
                    lengths={"tile": (65, 127, 129)}, weights=True))
def test_drops_are_independent_between_any_two_weights(kernel, device, case):
    """(B, H) at least (2, 2); the weights read through V = I on enough copies that every statistic has 4096 pairs
    (or none: an offset past the slice)."""
    p = case.p
    b, h = max(2, case.lead[0]), max(2, case.lead[1])
    case = dataclasses.replace(case, lead=(b, h))
    q, k, _ = case.qkv(device)
    positive = softmax_bounds(q, k).lower > 0   # (B, H, L, S): weights that are nonzero without dropout
    statistics = _pairs(case.l, case.s, b, h)
    per_copy = {name: int((positive[first[1:]] & positive[second[1:]]).sum()) for name, first, second in statistics}
    copies = max(1, max(math.ceil(PAIRS_FOR_INDEPENDENCE / n) for n in per_copy.values() if n) if any(
        per_copy.values()) else 1)
    kept = _on_copies(kernel.weights, copies, (q, k), p, device, case.seed) != 0   # (copies, B, H, L, S)
    evidence.record("dropout-independent", subject=kernel.name, device=str(device), query=q, key=k, p=p, copies=copies,
                    seed=case.seed, positive=positive)
    agree = p**2 + (1 - p) ** 2   # P(two independent weights both kept or both dropped)
    # Disjoint pairs: under independence each statistic's agreements are i.i.d. Bernoulli(agree); the false-alarm
    # budget is split evenly over the statistics (union bound).
    alpha = FALSE_ALARM / len(statistics)
    for name, first, second in statistics:
        both = (positive[first[1:]] & positive[second[1:]]).expand_as(kept[first])
        n = int(both.sum())
        if not n:
            continue
        observed = float((kept[first] == kept[second])[both].float().mean())
        halfwidth = hoeffding_halfwidth(n, 1.0, alpha)
        assert abs(observed - agree) <= halfwidth, (
            f"dropout p = {fmt(p)}: {name} agree on a fraction {fmt(observed)} of {n} pairs of weights (kept by both "
            f"or dropped by both), independent drops agree on p^2 + (1-p)^2 = {fmt(agree)}: |difference| > "
            f"{fmt(halfwidth)} (Hoeffding, false-alarm probability <= {alpha:.3g}: {len(statistics)} statistics "
            f"share {FALSE_ALARM:g})")
