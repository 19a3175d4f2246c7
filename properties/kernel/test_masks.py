"""attn_mask: bool (True = may attend) and additive float masks, their broadcasting, fully masked queries
and extreme mask values."""
from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import example, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.kernel.repeats import assert_unchanged
from properties.kernel.guard import check_against_oracle, fully_masked_mean
from properties.core.oracle import to_float64
from properties.core.strategies import huge_values, require_dtype, scale_partial_sums, score_limit, on, random_bool_mask, rescale_keys
from properties.core.dtypes import selected_dtypes
from properties.core.oracle import reference_scores
from properties.kernel.problem_space import DENSITY, MAGNITUDE, MASK_EXTRAS, SHAPES, Extra, Problem, Space
from properties.kernel.schedule import scheduled
from properties.core.tolerance import deciding_output_bound, output_bound, softmax_bounds

# Scores typical, peaked or all very negative (SPEC.md, "Extreme scores under masks"); the mask's density, the tile of
# its masked tiles.
EXTREMES = dict(values=("gaussian", "peaked", "negative"), extras={"magnitude": MAGNITUDE, **MASK_EXTRAS})
WEIGHT_SHAPES = {name: classes for name, classes in SHAPES.items() if name != "Ev"}


def _mask_shape(case):
    return (*case.lead, case.l, case.s)


def as_float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask equivalent to a bool mask: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask.cpu(), float("-inf")).to(mask.device)


def _as_kind(mask: torch.Tensor, kind: str, dtype) -> torch.Tensor:
    return mask if kind == "bool" else as_float_mask(mask, dtype)


def _bool_mask(case: Problem, device) -> torch.Tensor:
    """The case's bool mask (every query keeps a key: ``bool``, or whole aligned tiles masked in random rows:
    ``bool-tiles``), the float kinds' admissible keys as a bool mask."""
    kind = "bool-tiles" if case.attend.endswith("tiles") else "bool"
    return dataclasses.replace(case, attend=kind).mask64().to(device)


# Float32-range scores all near -2^16 at L = S = 65: a running maximum that starts at a finite sentinel loses such a
# row (a past bug: properties/catalog/state_bugs.py, running_max_sentinel).
NEGATIVE_ROWS = Problem(lead=(1, 1), l=65, s=65, e=64, ev=64, dtype=selected_dtypes()[0], seed=0, attend="bool",
                        values="negative", extras=(("magnitude", 1.0), ("density", 0.5)))


@clause("MASK-BOOL")
@example(case=NEGATIVE_ROWS)
@scheduled(Space.of("MASK-BOOL", **WEIGHT_SHAPES, attend=("bool", "bool-tiles"), weights=True, **EXTREMES))
def test_bool_mask_true_means_attend(kernel, device, case):
    (q, k, v), mask = case.qkv(device), _bool_mask(case, device)
    w, bounds = check_against_oracle(kernel, q, k, None, attn_mask=mask, what="weights")
    assert_all(mask.cpu() | (to_float64(w) == 0), to_float64(w), what="weight is exactly 0 where the bool mask is False")
    # Every row keeps a key: its weights sum to 1 (ATTN-ROWSUM), which holds at any score magnitude.
    row_sums = to_float64(w).sum(-1)
    assert_within(row_sums, torch.ones_like(row_sums), bounds.rowsum_error, what="sum over keys of the weights",
                  reference="1 (every query keeps a key)")
    check_against_oracle(kernel, q, k, v, attn_mask=mask)


@clause("MASK-FLOAT-ADDITIVE")
@scheduled(Space.of("MASK-FLOAT-ADDITIVE", **SHAPES, group=True, fixed={"attend": "float"},
                    values=("gaussian", "peaked", "negative"),
                    extras={"magnitude": MAGNITUDE, "tau": Extra((0, -2, 2, 4, -1), st.integers(-2, 4))}))
def test_float_mask_is_added_to_scores(kernel, device, case):
    """A finite float mask with entries N(0, tau^2), tau = 2^k."""
    q, k, v = case.qkv(device)
    mask64 = torch.randn(_mask_shape(case), generator=case.generator(1), dtype=torch.float64) * 2.0**case.tau
    kw = {"enable_gqa": True} if case.group > 1 else {}
    check_against_oracle(kernel, q, k, v, attn_mask=on(mask64, case.dtype, device), **kw)


@clause("MASK-BOOL-FLOAT")
@example(case=dataclasses.replace(NEGATIVE_ROWS, ev=64))
@scheduled(Space.of("MASK-BOOL-FLOAT", **SHAPES, group=True, attend=("bool", "bool-tiles"),
                    **EXTREMES))
def test_bool_mask_equals_its_additive_float_mask(kernel, device, case):
    (q, k, v), mask = case.qkv(device), _bool_mask(case, device)
    kw = {"enable_gqa": True} if case.group > 1 else {}
    with_bool, bounds = check_against_oracle(kernel, q, k, v, attn_mask=mask, what="out (bool mask)", **kw)
    with_float, _ = check_against_oracle(kernel, q, k, v, attn_mask=as_float_mask(mask, case.dtype),
                                         what="out (float mask)", **kw)
    assert_within(with_bool, with_float, deciding_output_bound(with_bool, with_float, bounds, v, factor=2),
                  what="out with bool mask", reference="out with the equivalent -inf float mask")


@clause("MASK-NO-INFLUENCE")
@scheduled(Space.of("MASK-NO-INFLUENCE", **SHAPES, attend=("bool", "float", "bool-tiles"),
                    **EXTREMES))
def test_masked_keys_and_values_have_no_influence(kernel, device, case, fully_masked):
    require_dtype(device, case.dtype)
    kind = "float" if case.attend == "float" else "bool"
    mask = _bool_mask(case, "cpu")
    q64, k64, v64 = case.qkv64()
    # Replace the keys and values that query 0 may not see (in every slice) by huge finite ones; every
    # query that admits none of them must give a bitwise identical output.
    hidden = ~mask[..., :1, :].transpose(-1, -2)  # (..., s, 1): masked for query 0
    big = torch.finfo(case.dtype).max / 4   # q.k stays finite even where a kernel forms it before scaling
    big_k = rescale_keys(q64, k64, 1 / math.sqrt(case.e), big / math.sqrt(case.e), big)
    k_new = torch.where(hidden, big_k, k64)
    v_new = torch.where(hidden, huge_values(v64, case.dtype), v64)
    q, k, v, k2, v2 = (on(t, case.dtype, device) for t in (q64, k64, v64, k_new, v_new))
    attn_mask = _as_kind(mask.to(device), kind, case.dtype)
    before = to_float64(kernel(q, k, v, attn_mask=attn_mask))
    after = to_float64(kernel(q, k2, v2, attn_mask=attn_mask))
    blind = ~(mask & hidden.transpose(-1, -2)).any(dim=-1)  # (..., l): admits no replaced key
    if fully_masked in ("mean", "any"):   # a query without admissible key may read every value (mean) or anything
        blind = blind & mask.any(dim=-1)
    assert_unchanged(after, before, lambda: to_float64(kernel(q, k, v, attn_mask=attn_mask)), lambda t: t[blind],
                     lambda: 2 * output_bound(softmax_bounds(q, k, v, attn_mask=attn_mask), v)[blind],
                     what=f"out of queries that admit none of the replaced keys ({kind} mask)",
                     reference="out before the masked keys/values were replaced by huge values", subject=kernel.name,
                     calls=(dict(query=q, key=k, value=v, attn_mask=attn_mask),
                            dict(query=q, key=k2, value=v2, attn_mask=attn_mask)))


@clause("MASK-FULLY-MASKED")
@scheduled(Space.of("MASK-FULLY-MASKED", **SHAPES, group=True, attend=("bool-empty", "float-empty"), **EXTREMES))
def test_query_without_admissible_key_outputs_zeros(kernel, device, case, fully_masked):
    """Some queries of every slice admit no key (at least the first)."""
    q, k, v = case.qkv(device)
    check_against_oracle(kernel, q, k, v, fully_masked=fully_masked, **case.contract(device))


BROADCAST_SHAPES = ["L,S", "1,1,L,S", "B,1,L,S", "1,H,L,S", "B,H,L,S"]


@clause("MASK-BROADCAST")
@scheduled(Space.of("MASK-BROADCAST", **{**SHAPES, "rank": ("2",)}, group=True, attend=("bool", "float"),
                    values=("gaussian", "peaked", "negative"),
                    extras={"magnitude": MAGNITUDE, "density": DENSITY,
                            "shape": Extra(tuple(BROADCAST_SHAPES), st.sampled_from(BROADCAST_SHAPES))}))
def test_mask_broadcasts_over_batch_and_heads(kernel, device, case):
    q, k, v = case.qkv(device)
    sizes = {"B": case.lead[0], "H": case.lead[1], "L": case.l, "S": case.s, "1": 1}
    check_against_oracle(kernel, q, k, v, **case.contract(device, shape=[sizes[d] for d in case.shape.split(",")]))


_HALF = torch.float16 if torch.float16 in selected_dtypes() else selected_dtypes()[0]


@clause("MASK-LOW-PRECISION")
@example(case=Problem(lead=(1, 1), l=2, s=3, e=8, ev=2, dtype=_HALF, seed=0, attend="float",
                      extras=(("density", 0.5), ("magnitude", 0.75), ("opposed", True))))
@scheduled(Space.of("MASK-LOW-PRECISION", **WEIGHT_SHAPES, weights=True, fixed={"attend": "float"},
                    extras={"density": DENSITY, "magnitude": Extra((0.0, 0.5, 1.0, 0.75, 0.25), st.floats(0.0, 1.0)),
                            "opposed": Extra((False, True), st.booleans())}))
def test_extreme_float_mask_values_do_not_overflow(kernel, device, case, fully_masked, finfo_min_rows):
    """magnitude: the scores' size, a fraction of the realistic exponent range of ATTN-LARGE-SCORES. opposed:
    the keys point against query 0, so that its whole row of scores is large and negative; row 0 is always
    masked with finfo.min everywhere. The pinned float16 example has row-0 scores near −2^10: score + finfo.min
    leaves float16's range if a kernel adds the mask in float16. Under --finfo-min-rows masked, a row whose
    every score is below -finfo(float32).max / log2(e) may instead follow --fully-masked."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv64()
    density, magnitude, opposed = case.density, case.magnitude, case.opposed
    if opposed:
        k = -q[..., :1, :] + 0.1 * k
    q, k = scale_partial_sums(q, k, 1 / math.sqrt(case.e), 2.0 ** round(magnitude * math.log2(score_limit(case.dtype))))
    q, k, v = (on(t, case.dtype, device) for t in (q, k, v))
    g = case.generator(1)
    info = torch.finfo(case.dtype)
    choice = torch.randint(2, _mask_shape(case), generator=g)
    masked = random_bool_mask(g, _mask_shape(case), density)
    large_negative = torch.where(choice == 0, torch.tensor(info.min, dtype=torch.float64),
                                 torch.tensor(-info.max / 2, dtype=torch.float64))
    mask64 = torch.where(masked, torch.zeros_like(large_negative), large_negative)
    all_min = torch.rand(*case.lead, case.l, generator=g, dtype=torch.float64) < 0.25
    all_min[..., 0] = True
    mask64 = torch.where(all_min[..., None], torch.full_like(mask64, info.min), mask64)
    mask = on(mask64, case.dtype, device)
    overflow = torch.zeros(*case.lead, case.l, dtype=torch.bool)
    if finfo_min_rows == "masked":   # rows whose every score a float32 product with log2(e) sends to -inf
        overflow = (reference_scores(q, k, attn_mask=mask) < _LOG2E_OVERFLOW).all(-1)
    if not bool(overflow.any()):
        check_against_oracle(kernel, q, k, v, attn_mask=mask)
        # Every row has a finite score: its weights sum to 1 (ATTN-ROWSUM), which an overflow to −inf breaks even
        # where the output bound, wide at these magnitudes, would not notice.
        w, bounds = check_against_oracle(kernel, q, k, None, attn_mask=mask, what="weights")
        evidence.record("rowsum", subject=kernel.name, device=str(device), inputs=dict(query=q, key=k, attn_mask=mask),
                        bound=bounds.rowsum_error, reference="no row is fully masked: score + finfo.min is finite")
        row_sums = to_float64(w).sum(-1)
        assert_within(row_sums, torch.ones_like(row_sums), bounds.rowsum_error, what="sum over keys of the weights",
                      reference="1 (no row is fully masked: score + finfo.min is finite)")
        return
    for value in (v, None):   # the output, then the weights
        out, bounds, as_masked = _softmax_or_masked(kernel, q, k, value, mask, overflow, fully_masked)
        if value is None:   # the rows that do not follow --fully-masked sum to 1
            row_sums = to_float64(out).sum(-1)[~as_masked]
            assert_within(row_sums, torch.ones_like(row_sums), bounds.rowsum_error, what="sum over keys of the "
                          "weights", reference="1 (rows not output as fully masked)")


# -finfo(float32).max / log2(e): a score below it overflows to -inf where a kernel multiplies by log2(e) in float32.
_LOG2E_OVERFLOW = -torch.finfo(torch.float32).max / math.log2(math.e)


def _softmax_or_masked(kernel, q, k, value, mask, overflow, fully_masked):
    """--finfo-min-rows masked: every row follows ATTN-ORACLE, except that an ``overflow`` row may instead output
    what --fully-masked says a query without admissible key outputs. Returns (out, bounds, the rows that did)."""
    __tracebackhide__ = True
    bounds = softmax_bounds(q, k, value, attn_mask=mask)
    out = kernel.weights(q, k, attn_mask=mask, nan_rows=overflow) if value is None else \
        kernel(q, k, value, attn_mask=mask, nan_rows=overflow)
    actual = to_float64(out)
    if fully_masked == "mean":
        mean, bound = fully_masked_mean(actual, value, q.dtype)
        as_masked = ((actual - mean).abs() <= bound).all(-1)
    else:
        as_masked = {"zeros": (actual == 0).all(-1), "nan": torch.isnan(actual).all(-1),
                     "any": torch.ones_like(overflow)}[fully_masked]
    as_masked = overflow & as_masked
    actual = torch.where(as_masked[..., None], bounds.reference.output, actual)
    assert_within(actual, bounds.reference.output, output_bound(bounds, value), what="out" if value is not None
                  else "weights", note=" (rows declared as overflowing may also follow --fully-masked "
                                       f"{fully_masked}: rows {overflow.nonzero().tolist()})")
    return out, bounds, as_masked
