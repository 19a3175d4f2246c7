"""FlashAttention API clauses (SPEC.md, "The FlashAttention API"): ``flash_attn_func(q, k, v, ...)`` with q
(B, Lq, H, D), k and v (B, Lk, Hkv, D). Run with ``--kernel-api flash`` (the fixture ``flash_kernel``; skipped with
the reason under the default ``--kernel-api sdpa``). The oracle and its bound are kernel/flash.py; a feature the
kernel declines (NotImplementedError) skips its clauses and is left out of the other clauses' draws."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from hypothesis import assume, example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_identical, assert_within, fmt
from properties.kernel.flash import FlashCase, flash_allowed, flash_bounds, flash_cases, to_heads_first
from properties.kernel.magnitudes import Scores
from properties.kernel.flash_guard import flash_weights, skip_unsupported
from properties.core.oracle import to_float64
from properties.kernel.statistics import FALSE_ALARM, hoeffding_halfwidth
from properties.core.strategies import seeded_rng
from properties.core.dtypes import selected_dtypes
from properties.core.tolerance import evaluation_error, rounding_error, rowsum_error
from properties.kernel.guard import check_dropout_rate

F32 = selected_dtypes()[0]   # pinned examples use the first selected dtype (float32 unless --dtype says otherwise)


def _supported(kernel, device, case: FlashCase) -> FlashCase:
    """The case without the features the kernel declines (their own clauses report them as skipped)."""
    return case.without(kernel.unsupported(device))


def _call(kernel, case: FlashCase, q, k, v, slopes, **extra):
    with skip_unsupported(kernel, f"{case!r}"):
        return kernel(q, k, v, **case.kwargs(slopes), **extra)


def check_flash_oracle(kernel, device, case: FlashCase, *, what: str = "out"):
    """Call the kernel on the case and check |out − oracle| <= bound (exact 0 for queries with no key)."""
    __tracebackhide__ = True
    q, k, v, slopes = case.tensors(device)
    bounds = flash_bounds(q, k, v, **case.oracle_kwargs(slopes))
    out = _call(kernel, case, q, k, v, slopes)
    bound = bounds.output_bound()
    evidence.record("flash-oracle", subject=kernel.name, device=str(device), query=q, key=k, value=v,
                    kwargs=case.kwargs(slopes), bound=bound, what=what)
    assert_within(to_float64(out), bounds.output, bound, what=what,
                  reference="float64 flash oracle", note=f"; index (b, i, h, d); {case!r}")
    return out, bounds


def _weights(kernel, device, case: FlashCase):
    """(bounds, the kernel's weights (B, H, Lq, Lk) in float64) for the case."""
    q, k, v, slopes = case.tensors(device)
    bounds = flash_bounds(q, k, v, **case.oracle_kwargs(slopes))
    with skip_unsupported(kernel, f"{case!r}"):
        w = flash_weights(kernel, q, k, **case.kwargs(slopes))
    if evidence.active() and bounds.softmax is not None:   # the weights within [lower, upper], exactly 0 outside the band
        sb = bounds.softmax
        evidence.record("flash-oracle", subject=kernel.name, device=str(device), query=q, key=k, value=None,
                        kwargs=case.kwargs(slopes), bound=torch.maximum(sb.upper - sb.weights, sb.weights - sb.lower),
                        what="weights (read through V = I)")
    return bounds, w


def _check_weights(bounds, w, what: str, case: FlashCase) -> None:
    __tracebackhide__ = True
    sb = bounds.softmax
    assert_all(sb.admissible | (w == 0), w, what=f"weight is exactly 0 where {what} excludes the key "
               f"(index b, h, i, j)", note=f"; {case!r}")
    assert_all(w >= sb.lower, w - sb.lower, what="weight >= its oracle lower bound (index b, h, i, j; value "
               "w - lower): an admissible key lost weight", note=f"; {case!r}")
    assert_all(w <= sb.upper, sb.upper - w, what="weight <= its oracle upper bound (index b, h, i, j; value "
               "upper - w)", note=f"; {case!r}")


# --------------------------------------------------------------------------------------------- FLASH-SHAPE
@clause("FLASH-SHAPE")
@example(case=FlashCase(1, 1, 1, 1, 1, 1, F32))
@example(case=FlashCase(3, 3, 5, 2, 2, 3, F32, strided=True))   # B == Lq: batch and sequence axes swapped?
@given(case=flash_cases())
def test_flash_output_shape_dtype_and_device(flash_kernel, device, case):
    case = _supported(flash_kernel, device, case)
    q, k, v, slopes = case.tensors(device)
    out = _call(flash_kernel, case, q, k, v, slopes)   # the guard checks shape, dtype, device, finiteness
    assert tuple(out.shape) == (case.b, case.lq, case.heads, case.d), f"output shape {tuple(out.shape)}"
    assert out.dtype == case.dtype and out.device == q.device, f"output {out.dtype} on {out.device}"


# -------------------------------------------------------------------------------------------- FLASH-ORACLE
@clause("FLASH-ORACLE")
@example(case=FlashCase(2, 3, 5, 2, 2, 4, F32, causal=True, window=(2, -1), softcap=2.5, alibi="batch",
                        strided=True, seed=1))
@example(case=FlashCase(1, 4, 4, 1, 1, 3, F32, seed=0))
@given(case=flash_cases())
def test_flash_output_agrees_with_float64_oracle(flash_kernel, device, case):
    check_flash_oracle(flash_kernel, device, _supported(flash_kernel, device, case))


# ------------------------------------------------------------------------------- FLASH-CAUSAL-BOTTOM-RIGHT
@clause("CAUSAL-BOTTOM-RIGHT")
@example(case=FlashCase(1, 3, 6, 1, 1, 4, F32, causal=True, window=(-1, -1)))   # Lq < Lk: offset 3
@example(case=FlashCase(1, 5, 3, 1, 1, 4, F32, causal=True, window=(-1, -1)))   # Lq > Lk: two empty rows
@example(case=FlashCase(1, 1, 4, 1, 1, 2, F32, causal=True, window=(-1, -1)))   # decode step: sees every key
@given(case=flash_cases(causal=True, window=False, softcap=False, alibi="none"))
def test_flash_causal_is_bottom_right_aligned(flash_kernel, device, case):
    case = _supported(flash_kernel, device, case)
    bounds, w = _weights(flash_kernel, device, case)
    _check_weights(bounds, w, f"causal (bottom-right: j <= i + {case.lk - case.lq})", case)


# ------------------------------------------------------------------------------------- FLASH-WINDOW-BOUNDS
@clause("WINDOW-BOUNDS")
@example(case=FlashCase(1, 4, 4, 1, 1, 4, F32, window=(1, 1)))    # each side: its edge key in, the next out
@example(case=FlashCase(1, 4, 6, 1, 1, 4, F32, window=(2, 0)))    # Lq < Lk: the band shifts right by 2
@example(case=FlashCase(1, 4, 6, 1, 1, 4, F32, window=(0, 2)))
@example(case=FlashCase(1, 5, 3, 1, 1, 4, F32, window=(1, -1)))   # Lq > Lk, unbounded right
@example(case=FlashCase(1, 5, 5, 1, 1, 4, F32, causal=True, window=(2, -1)))   # Mistral's causal sliding window
@example(case=FlashCase(1, 3, 5, 1, 1, 4, F32, window=(-1, 0)))
@example(case=FlashCase(1, 65, 65, 1, 1, 64, F32, causal=True, window=(32, -1), scores=Scores("negative", 1.0)))
@given(case=flash_cases(window=True, softcap=False, alibi="none", scores=True))
def test_flash_window_admits_exactly_its_band(flash_kernel, device, case):
    flash_kernel.require(device, "window")
    case = _supported(flash_kernel, device, case)
    bounds, w = _weights(flash_kernel, device, case)
    left, right = case.window
    _check_weights(bounds, w, f"window_size={case.window} (i + {case.lk - case.lq} - {left} <= j <= "
                              f"i + {case.lk - case.lq} + {right}{', causal' if case.causal else ''})", case)


# ----------------------------------------------------------------------------------- FLASH-SOFTCAP-FORMULA
@clause("SOFTCAP-FORMULA")
@example(case=FlashCase(1, 3, 5, 1, 1, 4, F32, softcap=1.0, spread=3, scale=0.5))
@example(case=FlashCase(1, 4, 4, 1, 1, 4, F32, causal=True, softcap=2.5, alibi="heads", spread=2))
@given(case=flash_cases(softcap=True))
def test_flash_softcap_caps_the_scaled_score(flash_kernel, device, case):
    flash_kernel.require(device, "softcap")
    case = _supported(flash_kernel, device, replace(case, spread=max(case.spread, 1)))
    check_flash_oracle(flash_kernel, device, case, what="out with softcap")


# ------------------------------------------------------------------------------------- FLASH-SOFTCAP-RANGE
@clause("SOFTCAP-RANGE")
@example(case=FlashCase(1, 4, 4, 1, 1, 4, F32, causal=True, softcap=1.0, spread=3))
@example(case=FlashCase(1, 3, 5, 1, 1, 4, F32, window=(1, 0), softcap=0.5, spread=3))
@given(case=flash_cases(softcap=True, alibi="none"))
def test_flash_softcapped_weights_stay_within_exp_2c(flash_kernel, device, case):
    flash_kernel.require(device, "softcap")
    case = _supported(flash_kernel, device, replace(case, spread=max(case.spread, 2)))
    bounds, w = _weights(flash_kernel, device, case)
    sb = bounds.softmax
    assert_all(sb.admissible | (w == 0), w, what="weight is exactly 0 for keys the causal/window mask excludes "
               "(the cap applies before the mask: tanh(-inf) must not resurrect them)", note=f"; {case!r}")
    positive = sb.lower > 0
    pair = positive[..., :, None] & positive[..., None, :]
    log_w = torch.log(torch.where(positive, w, torch.ones_like(w)).clamp_min(1e-300))
    ratio = log_w[..., :, None] - log_w[..., None, :]
    limit = 2 * case.softcap + sb.log_ratio_error()
    assert_all(~pair | (ratio <= limit), ratio, what=f"log(w_ij / w_ik) <= 2·softcap = {2 * case.softcap:g} "
               "plus rounding (index b, h, i, j, k)", note=f"; {case!r}")


# ---------------------------------------------------------------------------------------- FLASH-ALIBI-BIAS
@clause("ALIBI-BIAS")
@example(case=FlashCase(2, 3, 6, 1, 2, 4, F32, alibi="batch", spread=-2), zero_q=True)
@example(case=FlashCase(1, 5, 3, 2, 1, 4, F32, alibi="heads", causal=True), zero_q=True)
@example(case=FlashCase(1, 4, 4, 1, 2, 3, F32, alibi="heads", window=(2, 1)), zero_q=False)
@given(case=flash_cases(), zero_q=st.booleans())
def test_flash_alibi_adds_minus_slope_times_distance(flash_kernel, device, case, zero_q):
    """zero_q: q = 0, so the scores are the bias alone and the weights are softmax(−slope·|i + o − j|)."""
    if case.alibi == "none":
        case = replace(case, alibi="heads")
    flash_kernel.require(device, f"alibi_{case.alibi}")
    case = _supported(flash_kernel, device, case)
    if zero_q:
        case = replace(case, spread=-60)   # q·2^-60: the scores vanish beside the bias, exactly representable
    check_flash_oracle(flash_kernel, device, case, what=f"out with alibi_slopes {case.alibi}")


# ------------------------------------------------------------------------------------------- FLASH-GQA
@clause("FLASH-GQA")
@example(case=FlashCase(1, 3, 4, 2, 2, 4, F32))    # the smallest shape where head h's kv head is observable
@example(case=FlashCase(2, 2, 5, 2, 3, 3, F32, causal=True, alibi="heads"))
@given(case=flash_cases())
def test_flash_query_head_reads_kv_head_h_div_group(flash_kernel, device, case):
    if case.group == 1:
        case = replace(case, group=2)
    flash_kernel.require(device, "gqa")
    case = _supported(flash_kernel, device, case)
    out, bounds = check_flash_oracle(flash_kernel, device, case, what=f"out (H={case.heads}, Hkv={case.kv_heads})")
    q, k, v, slopes = case.tensors(device)
    wide = _call(flash_kernel, case, q, k.repeat_interleave(case.group, dim=2),
                 v.repeat_interleave(case.group, dim=2), slopes)
    assert_within(to_float64(out), to_float64(wide), 2 * bounds.output_bound(), what="out with Hkv heads",
                  reference="out with k, v repeat_interleave'd to H heads", note=f"; {case!r}")


# ------------------------------------------------------------------------------------------ FLASH-SCALE
@clause("FLASH-SCALE")
@example(case=FlashCase(1, 2, 5, 1, 1, 9, F32, scale=None))          # default 1/3, not 1 or 1/9
@example(case=FlashCase(1, 2, 5, 1, 1, 4, F32, scale=1.5, softcap=5.0))
@given(case=flash_cases(window=False, alibi="none"))
def test_flash_softmax_scale_default_and_explicit(flash_kernel, device, case):
    case = _supported(flash_kernel, device, replace(case, spread=max(case.spread, 0)))
    check_flash_oracle(flash_kernel, device, case,
                       what=f"out with softmax_scale={case.scale} ({'1/sqrt(D)' if case.scale is None else 'given'})")


# --------------------------------------------------------------------------------- FLASH-FULLY-MASKED
@clause("FLASH-FULLY-MASKED")
@example(case=FlashCase(1, 5, 2, 1, 1, 3, F32, causal=True))
@example(case=FlashCase(1, 3, 6, 1, 1, 3, F32, window=(0, -1)))
@given(case=flash_cases(min_lq=2, max_lk=6))
def test_flash_query_without_admissible_key_outputs_zero(flash_kernel, device, case):
    case = _supported(flash_kernel, device, case)
    if case.window == (-1, -1) and not case.causal:
        case = replace(case, causal=True)
    empty = ~flash_allowed(case.lq, case.lk, causal=case.causal, window_size=case.window).any(-1)
    assume(bool(empty.any()))
    out, _ = check_flash_oracle(flash_kernel, device, case)
    rows = to_float64(out)[:, empty]
    assert_all(rows == 0, rows, what=f"out is exactly 0 for queries {empty.nonzero().flatten().tolist()} "
               "with no admissible key", note=f"; {case!r}")


# ------------------------------------------------------------------------------------------ FLASH-ROWSUM
@clause("FLASH-ROWSUM")
@example(case=FlashCase(1, 4, 3, 1, 1, 2, F32, causal=True, softcap=1.0, alibi="heads"))
@given(case=flash_cases())
def test_flash_weights_sum_to_one(flash_kernel, device, case):
    case = _supported(flash_kernel, device, case)
    bounds, w = _weights(flash_kernel, device, case)
    has_key = bounds.softmax.admissible.any(-1)
    sums = w.sum(-1)
    assert_within(sums, has_key.to(torch.float64), rowsum_error(case.lk, case.dtype),
                  what="sum over keys of the weights", reference="1 (0 for a query with no admissible key)",
                  note=f"; index (b, h, i); {case!r}")


# ------------------------------------------------------------------------------------------ FLASH-CONVEX
@clause("FLASH-CONVEX")
@example(case=FlashCase(1, 3, 4, 1, 1, 3, F32, window=(1, 1), softcap=1.0), equal_rows=True)
@given(case=flash_cases(), equal_rows=st.booleans())
def test_flash_outputs_are_convex_combinations(flash_kernel, device, case, equal_rows):
    case = _supported(flash_kernel, device, case)
    q, k, v, slopes = case.tensors(device)
    if equal_rows:  # every key's value row is one vector per (batch, kv head): each output row must be it
        v = v[:, :1].expand_as(v).contiguous()
    bounds = flash_bounds(q, k, v, **case.oracle_kwargs(slopes))
    out = to_float64(_call(flash_kernel, case, q, k, v, slopes))            # (B, Lq, H, D)
    admissible = bounds.softmax.admissible                                  # (B, H, Lq, Lk)
    vh = to_heads_first(v).repeat_interleave(case.group, dim=1)[:, :, None]  # (B, H, 1, Lk, D)
    inf = torch.full_like(vh, math.inf).expand(-1, -1, case.lq, -1, -1)
    keep = admissible[..., None]
    low = torch.where(keep, vh.expand_as(inf), inf).amin(-2).transpose(1, 2)     # (B, Lq, H, D)
    high = torch.where(keep, vh.expand_as(inf), -inf).amax(-2).transpose(1, 2)
    has_key = admissible.any(-1).transpose(1, 2)[..., None]
    factor = evaluation_error(case.lk, case.dtype) + rounding_error(case.lk, 2, case.dtype) * (
        1 + evaluation_error(case.lk, case.dtype))
    slack = factor * torch.maximum(low.abs(), high.abs())
    ok = ~has_key | ((out >= low - slack) & (out <= high + slack))
    assert_all(ok, out, what="out lies between the smallest and largest value over the admissible keys, "
               "within rounding (index b, i, h, d; value out)", note=f"; {case!r}")


# ------------------------------------------------------------------------------- FLASH-SLICE-INDEPENDENT
@clause("FLASH-SLICE-INDEPENDENT")
@example(case=FlashCase(3, 3, 4, 1, 2, 3, F32, alibi="batch"))
@given(case=flash_cases(max_b=3))
def test_flash_batch_entries_are_independent(flash_kernel, device, case):
    case = _supported(flash_kernel, device, case)
    q, k, v, slopes = case.tensors(device)
    b = int(torch.randint(case.b, (1,), generator=torch.Generator().manual_seed(case.seed)))
    own = None if slopes is None or slopes.dim() == 1 else slopes[b:b + 1]
    alone = to_float64(_call(flash_kernel, case, q[b:b + 1], k[b:b + 1], v[b:b + 1], own if own is not None else slopes))
    together = to_float64(_call(flash_kernel, case, q, k, v, slopes))[b:b + 1]
    q2, k2, v2, _ = case.tensors(device, stream=3)
    for fresh, kept in zip((q2, k2, v2), (q, k, v)):
        fresh[b] = kept[b]
    beside = to_float64(_call(flash_kernel, case, q2, k2, v2, slopes))[b:b + 1]
    bounds = flash_bounds(q[b:b + 1], k[b:b + 1], v[b:b + 1], **case.oracle_kwargs(own if own is not None else slopes))
    bound = 2 * bounds.output_bound()
    assert_within(together, alone, bound, what=f"out[{b}] of the batch", reference=f"out of batch entry {b} alone",
                  note=f"; {case!r}")
    assert_within(beside, alone, bound, what=f"out[{b}] beside other inputs", reference=f"out of entry {b} alone",
                  note=f"; {case!r}")


# ------------------------------------------------------------------------------- FLASH-KEY-PERMUTATION
@clause("FLASH-KEY-PERMUTATION")
@example(case=FlashCase(1, 3, 5, 1, 2, 3, F32, softcap=1.0))
@given(case=flash_cases(causal=False, window=False, alibi="none"))
def test_flash_permuting_keys_and_values_changes_nothing(flash_kernel, device, case):
    case = _supported(flash_kernel, device, case)
    q, k, v, slopes = case.tensors(device)
    perm = torch.randperm(case.lk, generator=torch.Generator().manual_seed(case.seed)).to(device)
    out = to_float64(_call(flash_kernel, case, q, k, v, slopes))
    permuted = to_float64(_call(flash_kernel, case, q, k[:, perm].contiguous(), v[:, perm].contiguous(), slopes))
    bound = 2 * flash_bounds(q, k, v, **case.oracle_kwargs(slopes)).output_bound()
    assert_within(permuted, out, bound, what="out(q, Pk, Pv)", reference="out(q, k, v)",
                  note=f"; permutation {perm.tolist()}; {case!r}")


# -------------------------------------------------------------------------------------------- dropout
dropout_cases = flash_cases(max_b=1, max_lq=4, max_lk=6, max_d=4, window=False, softcap=False, alibi="none")


def _copies(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.expand(n, *t.shape[1:]).contiguous()


@clause("FLASH-DROPOUT-OFF")
@example(case=FlashCase(1, 3, 4, 1, 1, 3, F32, causal=True, window=(1, 0), softcap=1.0, alibi="heads"))
@given(case=flash_cases())
def test_flash_zero_dropout_is_deterministic(flash_kernel, device, case):
    case = _supported(flash_kernel, device, case)
    q, k, v, slopes = case.tensors(device)
    first = _call(flash_kernel, case, q, k, v, slopes, dropout_p=0.0)
    second = _call(flash_kernel, case, q, k, v, slopes, dropout_p=0.0)
    assert_identical(second, first, what="second call with dropout_p=0", reference="first call")


def dropout_property(test):
    """The statistical dropout clauses draw a small case and a rate p (p = 0.5 on the pinned case)."""
    return example(case=FlashCase(1, 2, 4, 1, 1, 4, F32), p=0.5)(
        given(case=dropout_cases, p=st.floats(0.05, 0.95))(test))


def _dropout_problem(kernel, device, case: FlashCase, *, nonnegative_values: bool = False):
    """(case, q, k, v, slopes, bounds) for a dropout clause (skipped if the kernel declines dropout);
    ``nonnegative_values``: v drawn from [0, 1)."""
    kernel.require(device, "dropout")
    case = _supported(kernel, device, case)
    q, k, v, slopes = case.tensors(device)
    if nonnegative_values:
        g = torch.Generator().manual_seed(case.seed)
        v = case.place(torch.rand(1, case.lk, case.kv_heads, case.d, generator=g, dtype=torch.float64), device)
    return case, q, k, v, slopes, flash_bounds(q, k, v, **case.oracle_kwargs(slopes))


COPIES_FOR_RATE = 256


@clause("FLASH-DROPOUT-RATE")
@dropout_property
def test_flash_dropout_zeroes_weights_with_probability_p(flash_kernel, device, case, p):
    case, q, k, _, slopes, bounds = _dropout_problem(flash_kernel, device, case)
    positive = (bounds.softmax.lower > 0)[0]                                  # (H, Lq, Lk)
    assume(bool(positive.any()))
    with seeded_rng(device, case.seed), skip_unsupported(flash_kernel, "dropout"):
        w = flash_weights(flash_kernel, _copies(q, COPIES_FOR_RATE), _copies(k, COPIES_FOR_RATE),
                          dropout_p=p, **case.kwargs(slopes))
    check_dropout_rate(w, positive, p, note=f"; {case!r}")


COPIES_FOR_MEAN = 2048


@clause("FLASH-DROPOUT-EXPECTATION")
@dropout_property
def test_flash_dropout_leaves_the_expected_output_unchanged(flash_kernel, device, case, p):
    case, q, k, v, slopes, bounds = _dropout_problem(flash_kernel, device, case, nonnegative_values=True)
    with seeded_rng(device, case.seed):
        out = to_float64(_call(flash_kernel, case, _copies(q, COPIES_FOR_MEAN), _copies(k, COPIES_FOR_MEAN),
                               _copies(v, COPIES_FOR_MEAN), slopes, dropout_p=p))
    mean = out.mean(0, keepdim=True)
    statistical = bounds.output / (1 - p) * hoeffding_halfwidth(COPIES_FOR_MEAN, 1.0, FALSE_ALARM / mean.numel())
    rounding = bounds.output_bound(extra_roundings=1, weight_factor=1 / (1 - p))
    assert_within(mean, bounds.output, statistical + rounding,
                  what=f"mean over {COPIES_FOR_MEAN} dropout draws (p = {fmt(p)}) of out",
                  reference="oracle without dropout", note=f"; {case!r}")
