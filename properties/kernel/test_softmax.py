"""Softmax clauses, observed on any black-box kernel through V = I (its output is then the weights)."""
from __future__ import annotations

import math

import torch
from hypothesis import assume, example, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.kernel.guard import check_against_oracle
from properties.core.oracle import to_float64
from properties.core.strategies import on, require_dtype, scale_partial_sums, score_limit
from properties.core.dtypes import selected_dtypes
from properties.kernel.problem_space import DENSITY, SHAPES, Extra, Problem, Space
from properties.kernel.schedule import scheduled
from properties.core.tolerance import deciding_output_bound, rowsum_error, softmax_bounds

# Score spread: q is multiplied by 2**spread, so scores range from a quarter to 16 times standard normal.
SPREAD = Extra((0, -2, 2, 4, -1), st.integers(-2, 4))
# The weights are read through V = I: no value head size.
WEIGHT_SHAPES = {name: classes for name, classes in SHAPES.items() if name != "Ev"}


def _weights(kernel, device, case: Problem, **kwargs):
    """((q, k), the kernel's attention weights in float64) for the case's queries scaled by 2**spread."""
    require_dtype(device, case.dtype)
    q, k, _ = case.qkv(device)
    return (q, k), to_float64(kernel.weights(q, k, **kwargs))


@clause("ATTN-WEIGHT-RANGE")
@scheduled(Space.of("ATTN-WEIGHT-RANGE", **WEIGHT_SHAPES, extras={"spread": SPREAD}, weights=True))
def test_weights_are_finite_and_in_unit_interval(kernel, device, case):
    _, w = _weights(kernel, device, case)  # the guard has already checked finiteness
    limit = 1 + rowsum_error(case.s, case.dtype)
    assert_all(w >= 0, w, what="weights >= 0")
    assert_all(w <= limit, w, what=f"weights <= 1 + evaluation error = {limit:.6g}")


@clause("ATTN-ROWSUM")
@scheduled(Space.of("ATTN-ROWSUM", **WEIGHT_SHAPES, attend=("none", "bool", "bool-tiles"),
                    extras={"spread": SPREAD, "density": DENSITY}, weights=True))
def test_weights_sum_to_one_over_keys(kernel, device, case):
    _, w = _weights(kernel, device, case, **case.contract(device))
    row_sums = w.sum(dim=-1)
    assert_within(row_sums, torch.ones_like(row_sums), rowsum_error(case.s, case.dtype),
                  what="sum over keys of the weights", reference="1")


@clause("ATTN-SHIFT-INVARIANT")
@scheduled(Space.of("ATTN-SHIFT-INVARIANT", **SHAPES, fixed={"attend": "float"},
                    extras={"shift_exponent": Extra((1.0, 0.0, 0.5, 0.25, 0.75), st.floats(0.0, 1.0)),
                            "negative": Extra((False, True), st.booleans())}))
def test_adding_a_constant_to_a_row_of_scores_changes_nothing(kernel, device, case):
    """shift_exponent is the fraction of the dtype's exponent range: the row constants reach
    2**(shift_exponent * log2(finfo.max / 4))."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    top = math.log2(torch.finfo(case.dtype).max / 4)
    per_row = torch.rand(*case.lead, case.l, 1, generator=case.generator(1), dtype=torch.float64)
    shift = (per_row * 2.0 ** (case.shift_exponent * top)) * (-1 if case.negative else 1)
    mask = on(shift.expand(*case.lead, case.l, case.s), case.dtype, device).contiguous()
    out = kernel(q, k, v, attn_mask=mask)
    # The bound is the masked call's (its score errors include u*|c|); the exact result is the unmasked one.
    unshifted = softmax_bounds(q, k, v).reference.output
    bound = deciding_output_bound(out, unshifted, softmax_bounds(q, k, v, attn_mask=mask), v)
    evidence.record("shifted", subject=kernel.name, device=str(device), inputs=dict(query=q, key=k, value=v, attn_mask=mask),
                    bound=bound, what="out with row-constant mask", reference="the oracle without mask")
    assert_within(out, unshifted, bound, what="out with row-constant mask", reference="oracle without mask")


@clause("ATTN-ORDER")
@scheduled(Space.of("ATTN-ORDER", **WEIGHT_SHAPES, extras={"spread": SPREAD}, weights=True))
def test_larger_score_never_gets_smaller_weight(kernel, device, case):
    (q, k), w = _weights(kernel, device, case)
    bounds = softmax_bounds(q, k)
    # Only pairs whose rounding intervals are disjoint have a guaranteed order: for each key k, every key j with
    # lower_j > upper_k must have w_j >= w_k. Sorting the keys by lower bound makes those j a prefix, whose
    # smallest weight is a running minimum (O(L S log S), not O(L S^2)).
    order = bounds.lower.argsort(dim=-1, descending=True)
    smallest, at = torch.cummin(w.gather(-1, order), dim=-1)
    above = torch.searchsorted(-bounds.lower.gather(-1, order), -bounds.upper, side="left")  # #{j: lower_j > upper_k}
    position = (above - 1).clamp_min(0)
    gap = smallest.gather(-1, position) - w                    # min over those j of w_ij - w_ik
    j = order.gather(-1, at.gather(-1, position))
    violated = (above > 0) & (gap < 0)
    first = tuple(int(i) for i in violated.nonzero()[0]) if bool(violated.any()) else None
    assert_all(~violated, gap, what="w_ij >= w_ik whenever score s_ij exceeds s_ik by more than the rounding margin "
                                    "(index ..., i, k; value min over such j of w_ij - w_ik)",
               note=f"; first at key k = {first[-1]} against j = {int(j[first])}" if first else "")


def _edge(dtype) -> Problem:
    """The clause's edge (magnitude 1, keys aligned with the queries) at the commonest head size."""
    return Problem(lead=(1, 1), l=2, s=2, e=64, ev=2, dtype=dtype, seed=0,
                   extras=(("magnitude", 1.0), ("aligned", True)))


@clause("ATTN-LARGE-SCORES")
@example(case=_edge(selected_dtypes()[0]))
@example(case=_edge(torch.float16))   # float16: an unscaled q.k of 8 x finfo.max/4 overflows where the scaled score fits
@scheduled(Space.of("ATTN-LARGE-SCORES", **{**WEIGHT_SHAPES, "E": ("odd", "8k", "64", "128")}, weights=True,
                    extras={"magnitude": Extra((1.0, 0.0, 0.5, 0.75, 0.25), st.floats(0.0, 1.0)),
                            "aligned": Extra((True, False), st.booleans())}))
def test_scores_up_to_the_dtype_range_do_not_overflow(kernel, device, case):
    """magnitude is the fraction of the admissible exponent range: the largest scaled partial sum is
    2**round(magnitude * log2(score_limit(dtype))), score_limit = min(2^16, finfo.max / 4).  Head sizes up to 128, as in real models: an unscaled
    q.k exceeds the scaled score by sqrt(E)."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv64()
    if case.aligned:  # the largest dot products a given partial-sum bound allows
        n = min(case.l, case.s)
        k[..., :n, :] = q[..., :n, :]
    exponent = round(case.magnitude * math.log2(score_limit(case.dtype)))
    q, k = scale_partial_sums(q, k, 1 / math.sqrt(case.e), 2.0**exponent)
    q, k, v = (on(t, case.dtype, device) for t in (q, k, v))
    assume(bool(torch.isfinite(q).all() and torch.isfinite(k).all()))  # extreme ratios |q_e|/|k_e| only
    check_against_oracle(kernel, q, k, v)
    w, bounds = check_against_oracle(kernel, q, k, None, what="weights")
    evidence.record("rowsum", subject=kernel.name, device=str(device), inputs=dict(query=q, key=k),
                    bound=bounds.rowsum_error, reference="every row has a finite score")
    row_sums = to_float64(w).sum(-1)
    assert_within(row_sums, torch.ones_like(row_sums), bounds.rowsum_error,
                  what="sum over keys of the weights", reference="1")
