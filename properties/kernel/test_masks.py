"""attn_mask: bool (True = may attend) and additive float masks, their broadcasting, fully masked queries
and extreme mask values."""
from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.kernel.repeats import assert_unchanged
from properties.kernel.guard import check_against_oracle, fully_masked_mean
from properties.core.oracle import to_float64
from properties.core.strategies import (huge_values, require_dtype, scale_partial_sums, score_limit, selected_dtypes,
                                        on, random_bool_mask, rescale_keys)
from properties.kernel.cases import Case, cases, with_pinned_cases
from properties.core.oracle import reference_scores
from properties.kernel.magnitudes import (TYPICAL, Scores, covered_tiles, score_shapes, shaped_qkv, shaped_qkv64,
                                        tile_covers)
from properties.core.tolerance import output_bound, softmax_bounds

densities = st.floats(0.0, 1.0)
mask_kinds = st.sampled_from(["bool", "float"])


def _mask_shape(case):
    return (*case.lead, case.l, case.s)


def as_float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask equivalent to a bool mask: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask.cpu(), float("-inf")).to(mask.device)


def _as_kind(mask: torch.Tensor, kind: str, dtype) -> torch.Tensor:
    return mask if kind == "bool" else as_float_mask(mask, dtype)


def _bool_mask(case, density: float, device, cover: int | None = None) -> torch.Tensor:
    """A random bool attention mask of the case's shape: each entry True (attend) with probability density; with
    ``cover``, whole aligned tiles of that many keys masked in random rows (a row left without a key keeps its
    last one)."""
    mask = random_bool_mask(case.generator(1), _mask_shape(case), density) & \
        ~covered_tiles(_mask_shape(case), cover, case.generator(4))
    mask[..., -1] |= ~mask.any(-1)
    return mask.to(device)


def _pinned_extremes(**other):
    """The pins of the extreme draws: float32-range scores all near -2^16 (a running maximum that starts at a finite
    sentinel loses such a row), and whole 64-key tiles masked in a row of 130 keys (a skipped tile that spoils the
    running state), at L = 65."""
    first = selected_dtypes()[0]
    long_row = Case(lead=(1, 1), l=65, s=130, e=64, ev=64, dtype=first, seed=0)
    def decorate(test):
        test = example(case=long_row, scores=TYPICAL, cover=64, **other)(test)
        return example(case=dataclasses.replace(long_row, s=65), scores=Scores("negative", 1.0), cover=None,
                       **other)(test)
    return decorate


@clause("MASK-BOOL")
@with_pinned_cases(density=0.5, scores=TYPICAL, cover=None)
@_pinned_extremes(density=0.5)
@given(case=cases(weights=True), density=densities, scores=score_shapes(), cover=tile_covers())
def test_bool_mask_true_means_attend(kernel, device, case, density, scores, cover):
    (q, k, v), mask = shaped_qkv(case, scores, device), _bool_mask(case, density, device, cover)
    w, bounds = check_against_oracle(kernel, q, k, None, attn_mask=mask, what="weights")
    assert_all(mask.cpu() | (to_float64(w) == 0), to_float64(w), what="weight is exactly 0 where the bool mask is False")
    # Every row keeps a key: its weights sum to 1 (ATTN-ROWSUM), which holds at any score magnitude.
    row_sums = to_float64(w).sum(-1)
    assert_within(row_sums, torch.ones_like(row_sums), bounds.rowsum_error, what="sum over keys of the weights",
                  reference="1 (every query keeps a key)")
    check_against_oracle(kernel, q, k, v, attn_mask=mask)


@clause("MASK-FLOAT-ADDITIVE")
@with_pinned_cases(spread=0, scores=TYPICAL)
@given(case=cases(), spread=st.integers(-2, 4), scores=score_shapes())
def test_float_mask_is_added_to_scores(kernel, device, case, spread, scores):
    q, k, v = shaped_qkv(case, scores, device)
    mask64 = torch.randn(_mask_shape(case), generator=case.generator(1), dtype=torch.float64) * 2.0**spread
    check_against_oracle(kernel, q, k, v, attn_mask=on(mask64, case.dtype, device))


@clause("MASK-BOOL-FLOAT")
@with_pinned_cases(density=0.5, scores=TYPICAL, cover=None)
@_pinned_extremes(density=0.5)
@given(case=cases(), density=densities, scores=score_shapes(), cover=tile_covers())
def test_bool_mask_equals_its_additive_float_mask(kernel, device, case, density, scores, cover):
    (q, k, v), mask = shaped_qkv(case, scores, device), _bool_mask(case, density, device, cover)
    with_bool, bounds = check_against_oracle(kernel, q, k, v, attn_mask=mask, what="out (bool mask)")
    with_float, _ = check_against_oracle(kernel, q, k, v, attn_mask=as_float_mask(mask, case.dtype),
                                         what="out (float mask)")
    assert_within(with_bool, with_float, 2 * output_bound(bounds, v), what="out with bool mask",
                  reference="out with the equivalent -inf float mask")


@clause("MASK-NO-INFLUENCE")
@with_pinned_cases(density=0.5, kind="bool", scores=TYPICAL, cover=None)
@given(case=cases(), density=densities, kind=mask_kinds, scores=score_shapes(), cover=tile_covers())
def test_masked_keys_and_values_have_no_influence(kernel, device, case, density, kind, scores, cover, fully_masked):
    require_dtype(device, case.dtype)
    mask = _bool_mask(case, density, "cpu", cover)
    q64, k64, v64 = shaped_qkv64(case, scores)
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
@with_pinned_cases(density=0.5, kind="bool", scores=TYPICAL, cover=None)
@given(case=cases(), density=densities, kind=mask_kinds, scores=score_shapes(), cover=tile_covers())
def test_query_without_admissible_key_outputs_zeros(kernel, device, case, density, kind, scores, cover,
                                                    fully_masked):
    q, k, v = shaped_qkv(case, scores, device)
    g = case.generator(1)
    mask = random_bool_mask(g, _mask_shape(case), density) & ~covered_tiles(_mask_shape(case), cover,
                                                                            case.generator(4))
    empty = torch.rand(*case.lead, case.l, generator=g, dtype=torch.float64) < 0.5
    empty[..., 0] = True  # at least one fully masked query per slice
    mask = mask & ~empty[..., None]
    check_against_oracle(kernel, q, k, v, attn_mask=_as_kind(mask.to(device), kind, case.dtype),
                         fully_masked=fully_masked)


BROADCAST_SHAPES = ["L,S", "1,1,L,S", "B,1,L,S", "1,H,L,S", "B,H,L,S"]


@clause("MASK-BROADCAST")
@with_pinned_cases(shape="L,S", kind="bool", scores=TYPICAL)
@with_pinned_cases(shape="B,1,L,S", kind="float", scores=TYPICAL)
@given(case=cases(lead=2), shape=st.sampled_from(BROADCAST_SHAPES), kind=mask_kinds, scores=score_shapes())
def test_mask_broadcasts_over_batch_and_heads(kernel, device, case, shape, kind, scores):
    q, k, v = shaped_qkv(case, scores, device)
    sizes = {"B": case.lead[0], "H": case.lead[1], "L": case.l, "S": case.s, "1": 1}
    mask = random_bool_mask(case.generator(1), tuple(sizes[d] for d in shape.split(",")), 0.5)
    check_against_oracle(kernel, q, k, v, attn_mask=_as_kind(mask.to(device), kind, case.dtype))


_HALF = torch.float16 if torch.float16 in selected_dtypes() else selected_dtypes()[0]


@clause("MASK-LOW-PRECISION")
@with_pinned_cases(density=0.5, magnitude=0.0, opposed=False)
@example(case=Case(lead=(1, 1), l=2, s=3, e=8, ev=2, dtype=_HALF, seed=0), density=0.5, magnitude=0.75,
         opposed=True)
@given(case=cases(weights=True), density=densities, magnitude=st.floats(0.0, 1.0), opposed=st.booleans())
def test_extreme_float_mask_values_do_not_overflow(kernel, device, case, density, magnitude, opposed, fully_masked,
                                                   finfo_min_rows):
    """magnitude: the scores' size, a fraction of the realistic exponent range of ATTN-LARGE-SCORES. opposed:
    the keys point against query 0, so that its whole row of scores is large and negative; row 0 is always
    masked with finfo.min everywhere. The pinned float16 example has row-0 scores near −2^10: score + finfo.min
    leaves float16's range if a kernel adds the mask in float16. Under --finfo-min-rows masked, a row whose
    every score is below -finfo(float32).max / log2(e) may instead follow --fully-masked."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv64()
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
