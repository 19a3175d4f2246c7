"""Dropout on the attention weights: off means deterministic; on, the drop rate and the expectation
match p and the no-dropout output, and the drops of different heads and batch entries are independent
(statistical, false-alarm probability <= 1e-6 per example)."""
from __future__ import annotations

import dataclasses
import math

import torch
from einops import rearrange
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.kernel import coverage
from properties.core.assertions import assert_within, fmt
from properties.kernel.coverage import BITWISE, WITHIN_BOUND
from properties.kernel.repeats import bitwise_equal
from properties.core.oracle import to_float64
from properties.kernel.statistics import FALSE_ALARM, hoeffding_halfwidth, stacked_copies
from properties.core.strategies import seeded_rng, selected_dtypes
from properties.kernel.guard import check_dropout_rate
from properties.core.strategies import on
from properties.kernel.cases import Case, cases, with_pinned_cases
from properties.core.tolerance import output_bound, softmax_bounds

# Any rate, and the multiples of 1/16 (the rates cuDNN's dropout takes: other kernels are drawn them too).
probabilities = st.one_of(st.floats(0.05, 0.95), st.sampled_from([i / 16 for i in range(1, 16)]))
# Hundreds of copies per example: the statistical clauses stay at small shapes (DROPOUT-OFF draws kernel scale).
# Any number of leading dims, so 4-D (batch, head) problems with B > 1 and H > 1 are drawn too.
small_cases = cases(max_l=4, max_s=8, max_e=8, max_ev=4, tiles=False)


def _pinned_4d() -> Case:
    """A (B, H) = (2, 3) problem in the first selected dtype: the dropout clauses on real shapes."""
    return Case(lead=(2, 3), l=3, s=5, e=4, ev=3, dtype=selected_dtypes()[0], seed=0)


def rate_property(test):
    """The statistical dropout clauses draw a small case and a rate p (p = 0.5 on the pinned cases)."""
    test = given(case=small_cases, p=probabilities)(test)
    return with_pinned_cases(n_lead=0, tiles=False, p=0.5)(example(case=_pinned_4d(), p=0.5)(test))


def _on_copies(fn, n: int, tensors, p: float, device, seed: int) -> torch.Tensor:
    """fn(*tensors, dropout_p=p) on n copies of the tensors in one call (n independent dropout draws), with the RNG
    seeded from the case so that a failure replays; the result in float64, the copies on its first axis. The copies
    go on a new leading axis of a problem without one, else on its batch axis (a 4-D problem stays 4-D)."""
    with seeded_rng(device, seed):
        out = to_float64(fn(*stacked_copies(n, *tensors), dropout_p=p))
    return out if tensors[0].dim() == 2 else rearrange(out, "(n b) ... -> n b ...", n=n)


@clause("DROPOUT-OFF")
@with_pinned_cases()
@given(case=cases())
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
@rate_property
def test_dropout_zeroes_weights_with_probability_p(kernel, device, case, p):
    q, k, _ = case.qkv(device)
    bounds = softmax_bounds(q, k)
    positive = bounds.lower > 0  # weights that are nonzero without dropout (even after rounding)
    w = _on_copies(kernel.weights, COPIES_FOR_RATE, (q, k), p, device, case.seed)
    evidence.record("dropout-rate", subject=kernel.name, device=str(device), query=q, key=k, p=p,
                    copies=COPIES_FOR_RATE, seed=case.seed, positive=positive)
    check_dropout_rate(w, positive, p)


COPIES_FOR_MEAN = 2048


@clause("DROPOUT-EXPECTATION")
@rate_property
def test_dropout_leaves_the_expected_output_unchanged(kernel, device, case, p):
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


# Pairs compared per axis: enough that a kernel whose drops agree on every pair is told from independent drops at
# every drawn p (1 - (p^2 + (1-p)^2) >= 0.095 against a Hoeffding half-width of 0.06 at 4096 pairs).
PAIRS_FOR_INDEPENDENCE = 4096


# 4-D problems with B > 1 and H > 1.
real_shapes = st.builds(lambda case, b, h: dataclasses.replace(case, lead=(b, h)),
                        cases(lead=2, max_l=4, max_s=8, max_e=8, max_ev=4, tiles=False), st.integers(2, 3),
                        st.integers(2, 3))


@clause("DROPOUT-INDEPENDENT")
@example(case=_pinned_4d(), p=0.5)
@example(case=dataclasses.replace(_pinned_4d(), lead=(2, 2), l=1, s=1), p=0.05)
@given(case=real_shapes, p=probabilities)
def test_drops_are_independent_across_heads_and_batch(kernel, device, case, p):
    q, k, _ = case.qkv(device)
    positive = softmax_bounds(q, k).lower > 0   # (B, H, L, S): weights that are nonzero without dropout
    b, h = case.lead
    pairs_per_copy = {"heads": int((positive[:, 0:h - 1:2] & positive[:, 1::2]).sum()),
                      "batch entries": int((positive[0:b - 1:2] & positive[1::2]).sum())}
    copies = max(1, math.ceil(PAIRS_FOR_INDEPENDENCE / max(1, min(pairs_per_copy.values()))))
    kept = _on_copies(kernel.weights, copies, (q, k), p, device, case.seed) != 0   # (copies, B, H, L, S)
    evidence.record("dropout-independent", subject=kernel.name, device=str(device), query=q, key=k, p=p, copies=copies,
                    seed=case.seed, positive=positive)
    agree = p**2 + (1 - p) ** 2   # P(two independent slices both keep or both drop a weight)
    # Disjoint pairs (0, 1), (2, 3), ... along each axis: under independence their agreements are i.i.d.
    # Bernoulli(agree); two statistics, each at level FALSE_ALARM / 2.
    for axis, first, second in (("heads", (slice(None), slice(None), slice(0, h - 1, 2)),
                                 (slice(None), slice(None), slice(1, None, 2))),
                                ("batch entries", (slice(None), slice(0, b - 1, 2)), (slice(None), slice(1, None, 2)))):
        both = (positive[first[1:]] & positive[second[1:]]).expand_as(kept[first])
        n = int(both.sum())
        observed = float((kept[first] == kept[second])[both].float().mean())
        halfwidth = hoeffding_halfwidth(n, 1.0, FALSE_ALARM / 2)
        assert abs(observed - agree) <= halfwidth, (
            f"dropout p = {fmt(p)}: {axis} agree on a fraction {fmt(observed)} of {n} pairs of weights (kept by both or "
            f"dropped by both), independent drops agree on p^2 + (1-p)^2 = {fmt(agree)}: |difference| > {fmt(halfwidth)} "
            f"(Hoeffding, false-alarm probability <= {FALSE_ALARM / 2:g})")
