"""The scale: exactly 1/sqrt(E) by default or the given value, recovered from the kernel's weights; and
its statistical purpose (paper 3.2.1, footnote 4)."""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from properties import clause
from properties.core.assertions import assert_within, fmt
from properties.core.strategies import require_dtype
from properties.core.oracle import default_scale, to_float64
from properties.kernel.statistics import FALSE_ALARM, weighted_chi_square_interval
from properties.core.strategies import on, required
from properties.kernel.problem_space import SHAPES, Extra, Space
from properties.kernel.schedule import scheduled
from properties.kernel.tiles import kernel_limits
from properties.core.tolerance import gamma, softmax_bounds, unit_roundoff

# A weight this far above the underflow threshold carries a negligible (1e-6 relative) underflow error.
_RECOVERABLE = 1e6


def _check_log_ratios(kernel, q, k, scale, scale_kwargs):
    """log(w_ij / w_ir) == scale * q_i . (k_j - k_r) within the tolerance model, for every key j and the key r of
    the row with the largest lower bound, both well above underflow (every pair (j, k) then follows within the sum
    of their bounds; memory O(L S)); the message reports the scale the weights imply."""
    __tracebackhide__ = True
    w = to_float64(kernel.weights(q, k, **scale_kwargs))
    bounds = softmax_bounds(q, k, scale=scale)
    usable = bounds.lower > _RECOVERABLE * bounds.tiny
    r = bounds.lower.argmax(-1, keepdim=True)
    pairs = usable & usable.gather(-1, r)
    log_w, scores = torch.log(w), bounds.reference.scores
    observed = log_w - log_w.gather(-1, r)
    expected = torch.where(pairs, scores - scores.gather(-1, r), torch.zeros_like(observed))
    error, slack = bounds.log_weight_error()
    bound = torch.where(pairs, error + error.gather(-1, r) + slack, torch.full_like(observed, torch.inf))
    informative = pairs & (expected.abs() > 1e-3)
    implied = (observed / expected * scale)[informative]
    recovered = fmt(float(implied.median())) if implied.numel() else "n/a"
    assert_within(observed, expected, bound, what="log(w_ij/w_ir)", reference="scale q_i.(k_j - k_r)",
                  note=f"; index (..., i, j), r the key of row i with the largest weight; scale {fmt(scale)} "
                       f"expected, the weights imply {recovered}")


# Two keys at least (a log-ratio of weights); the weights are read through V = I.
RATIO_SHAPES = {**{name: classes for name, classes in SHAPES.items() if name != "Ev"},
                "S": ("short", "tile", "past256", "long")}


@clause("SCALE-DEFAULT")
@scheduled(Space.of("SCALE-DEFAULT", **RATIO_SHAPES, weights=True))
def test_default_scale_is_one_over_sqrt_e(kernel, device, case):
    q, k, _ = case.qkv(device)
    _check_log_ratios(kernel, q, k, default_scale(case.e), {})


@clause("SCALE-EXPLICIT")
@scheduled(Space.of("SCALE-EXPLICIT", **RATIO_SHAPES, weights=True,
                    extras={"scale": Extra((0.5, 1 / 64, 4.0, 0.125, 2.0), st.floats(1 / 64, 4.0))}))
def test_explicit_scale_replaces_the_default(kernel, device, case):
    q, k, _ = case.qkv(device)
    _check_log_ratios(kernel, q, k, case.scale, {"scale": case.scale})


def _wide_exponent_range(dtype: torch.dtype) -> bool:
    """float32's exponent range or wider: e^-(|q.k|) of unscaled dot products stays representable."""
    return torch.finfo(dtype).tiny <= torch.finfo(torch.float32).tiny


SAMPLES = 2048


@clause("SCALE-VARIANCE")
@scheduled(Space.of("SCALE-VARIANCE", E=("odd", "8k", "64"), dtype=True,
                    extras={"unscaled": Extra((False, True), st.booleans())}))
def test_scaling_brings_score_variance_from_d_to_one(kernel, device, case):
    """See SPEC.md, SCALE-VARIANCE, for the derivation of the acceptance interval. The case gives the head size d,
    the dtype and the seed; its samples are the clause's own."""
    d, dtype, seed = case.e, case.dtype, case.seed
    unscaled = case.unscaled and _wide_exponent_range(dtype)   # float16 cannot hold those weights (SPEC.md)
    require_dtype(device, dtype)
    g = torch.Generator().manual_seed(seed)
    q64 = torch.randn(SAMPLES, 1, d, generator=g, dtype=torch.float64)
    k_sample = torch.randn(SAMPLES, 1, d, generator=g, dtype=torch.float64)
    k64 = torch.cat([torch.zeros_like(k_sample), k_sample], dim=1)  # key 0 is the reference: score 0
    scale = 1.0 if unscaled else default_scale(d)
    q, k = on(q64, dtype, device), on(k64, dtype, device)

    limits = kernel_limits()
    if limits.equal_lengths:   # a kernel that takes only L = S: the same query twice, row 0 read
        q = q.expand(-1, 2, -1).contiguous()
    # the samples on the first leading axis, padded with unit axes to a rank the kernel accepts (4-D only, say)
    rank = min(required([r for r in (1, 2) if limits.ranks is None or r in limits.ranks] or None,
                        "the kernel accepts no leading dims: this clause poses a batch of samples"))
    posed = (t.reshape(SAMPLES, *(1,) * (rank - 1), *t.shape[1:]) for t in (q, k))
    w = to_float64(kernel.weights(*posed, **({"scale": 1.0} if unscaled else {}))).reshape(SAMPLES, -1, 2)[:, 0, :]
    recovered = torch.log(w[:, 1]) - torch.log(w[:, 0])

    # Exact sampling distribution of the ideal scores x_m = scale q_m.k_m given the keys (float64 draws).
    ideal = scale * (q64[:, 0, :] * k_sample[:, 0, :]).sum(-1)
    interval = weighted_chi_square_interval(scale**2 * (k_sample[:, 0, :] ** 2).sum(-1), FALSE_ALARM)
    # Rounding: inputs rounded to the dtype (measured exactly) plus the kernel's log-ratio bound.
    bounds = softmax_bounds(q, k, scale=scale)
    rounded_scores = bounds.reference.scores[:, 0, 1]
    magnitude = scale * (q64[:, 0, :].abs() * k_sample[:, 0, :].abs()).sum(-1)
    eta = ((rounded_scores - ideal).abs() + gamma(d + 1, unit_roundoff(torch.float64)) * magnitude
           + bounds.log_ratio_error()[:, 0, 1, 0])
    slack = float(eta.norm())
    low = max(math.sqrt(interval.low) - slack, 0.0) ** 2 / SAMPLES
    high = (math.sqrt(interval.high) + slack) ** 2 / SAMPLES
    variance = float((recovered**2).sum()) / SAMPLES
    expected = float(scale**2 * (k_sample**2).sum()) / SAMPLES
    assert low <= variance <= high, (
        f"variance of the kernel's {'unscaled' if unscaled else 'scaled'} scores (recovered from its weights) "
        f"= {fmt(variance)}, outside [{fmt(low)}, {fmt(high)}] (expected {fmt(expected)} = "
        f"{'d' if unscaled else '1'} for these keys; false-alarm probability <= {FALSE_ALARM:g})")
