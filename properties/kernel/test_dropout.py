"""Dropout on the attention weights: off means deterministic; on, the drop rate and the expectation
match p and the no-dropout output (statistical, false-alarm probability <= 1e-6 per example)."""
from __future__ import annotations


import torch
from hypothesis import given, strategies as st

from properties import clause
from properties.core import repro
from properties.kernel import coverage
from properties.core.assertions import assert_within, fmt
from properties.kernel.repeats import BITWISE, WITHIN_BOUND, bitwise_equal
from properties.core.oracle import to_float64
from properties.kernel.statistics import FALSE_ALARM, hoeffding_halfwidth
from properties.core.strategies import seeded_rng
from properties.kernel.guard import check_dropout_rate
from properties.core.strategies import on
from properties.kernel.cases import cases, with_pinned_cases
from properties.core.tolerance import output_bound, softmax_bounds

# Any rate, and the multiples of 1/16 (the rates cuDNN's dropout takes: other kernels are drawn them too).
probabilities = st.one_of(st.floats(0.05, 0.95), st.sampled_from([i / 16 for i in range(1, 16)]))
# Hundreds of copies per example: the statistical clauses stay at small shapes (DROPOUT-OFF draws kernel scale).
# The copies are stacked on a leading axis of their own (axes=1): the case's lead keeps the stack inside the ranks
# the kernel accepts (none for a 3-D problem, one for a kernel that takes only 4-D inputs).
small_cases = cases(lead=0, axes=1, max_l=4, max_s=8, max_e=8, max_ev=4, tiles=False)


def rate_property(test):
    """The statistical dropout clauses draw a small case and a rate p (p = 0.5 on the pinned cases)."""
    return with_pinned_cases(n_lead=0, axes=1, tiles=False, p=0.5)(given(case=small_cases, p=probabilities)(test))


def _on_copies(fn, n: int, tensors, p: float, device, seed: int) -> torch.Tensor:
    """fn(*tensors, dropout_p=p) on n stacked copies of the tensors (n independent dropout draws in one call),
    with the RNG seeded from the case so that a failure replays; the result in float64."""
    with seeded_rng(device, seed):
        return to_float64(fn(*(t.expand(n, *t.shape).contiguous() for t in tensors), dropout_p=p))


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
    repro.record("dropout-rate", subject=kernel.name, device=str(device), query=q, key=k, p=p,
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
    assert_within(mean, bounds.reference.output, statistical + rounding,
                  what=f"mean over {COPIES_FOR_MEAN} dropout draws (p = {fmt(p)}) of out",
                  reference="oracle without dropout",
                  note=f" (Hoeffding at level {FALSE_ALARM:g} over {mean.numel()} coordinates, plus rounding)")
