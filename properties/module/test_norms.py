"""LayerNorm and RMSNorm as modules (SPEC.md, "Modules": NORM-*).

The norm is the config group's option (``layernorm`` or ``rmsnorm``); the clauses read its gain
``weight`` (LayerNorm also ``bias``, which may be None) and eps from the node's ``eps`` (else the module's
``eps`` attribute).  NORM-PER-TOKEN needs none of them (it falls back to float64 and the comparison
tolerance); the others are skipped with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.core.strategies import require_dtype
from properties.model.checks import comparison_tolerance
from properties.module.approx import effective_u
from properties.module.oracle import layer_norm_oracle, layer_norm_stats, rms_norm_oracle
from properties.module.gradients import check_gradients, layer_norm, rms_norm
from properties.module.parts import OneLine, call_module, inputs, module_settings, part_params
from properties.core.oracle import to_float64
from properties.core.strategies import PinnedData, pinned_property, seeds
from properties.core.dtypes import selected_dtypes
from properties.kernel.cases import dtypes
from properties.core.tolerance import gamma, unit_roundoff

KINDS = ("layernorm", "rmsnorm")
FIRST = selected_dtypes()[0]   # pinned examples use the first selected dtype (float32 unless --dtype says)


def _only(*kinds):
    def applies(part):
        return None if part.choice in kinds else f"norm={part.choice}: the clause is about {' and '.join(kinds)}"
    return applies


def pytest_generate_tests(metafunc):
    if "norm" in metafunc.fixturenames:
        kinds = getattr(metafunc.function, "kinds", KINDS)
        metafunc.parametrize("norm", part_params(metafunc.config, "norm", _only(*kinds)))


def kinds(*names):
    def mark(fn):
        fn.kinds = names
        return fn
    return mark


@dataclass(frozen=True)
class Tokens(OneLine):
    """(batch, l) tokens of d features: entries N(shift·scale, scale²) per sample, dtype, seed."""
    batch: int
    l: int
    d: int
    scale_log2: int
    shift: float
    dtype: torch.dtype
    seed: int


problems = st.builds(Tokens, batch=st.integers(1, 3), l=st.integers(1, 6), d=st.integers(2, 16),
                     scale_log2=st.integers(-3, 3), shift=st.sampled_from([0.0, 0.5, -2.0]), dtype=dtypes(),
                     seed=seeds)


# Pinned shapes (drawn every run), in the order of Tokens' fields: batch, l, d, scale_log2, shift, dtype, seed.
# B == L == 3 with d = 5 odd: statistics over the positions or the batch instead of the features raise no
# shape error and show in the values; a mean of half the scale.
PINNED = Tokens(3, 3, 5, 0, 0.5, FIRST, 0)
# Small tokens far from 0 (mean -2s, s = 1/8) over 16 features: the variance's cancellation at its edge.
PINNED_SHIFTED = Tokens(2, 4, 16, -3, -2.0, FIRST, 1)
# The settings, the pinned shapes (one or both), then drawn tokens: the stack of the clauses drawing only p.
on_pinned_tokens = pinned_property(module_settings, {"p": problems}, {"p": PINNED})
on_both_pinned_tokens = pinned_property(module_settings, {"p": problems}, {"p": PINNED}, {"p": PINNED_SHIFTED})


def tokens(p: Tokens, device, stream: int = 1, dtype=None):
    scale = 2.0 ** p.scale_log2
    return inputs(p.seed, stream, (p.batch, p.l, p.d), dtype or p.dtype, device, scale=scale, shift=p.shift * scale)


def build(norm, p: Tokens, device, dtype=None):
    return norm.build(device, dtype or p.dtype, p.seed, d_model=p.d)


def forward(module, x):
    return call_module(module, x, expect=tuple(x.shape), like=x, what="norm")


def affine(norm, module):
    """(eps, gain, bias) read from the node and the module, or skip with the reason."""
    eps = norm.get("eps", getattr(module, "eps", None))
    if eps is None:
        pytest.skip("no eps: neither the norm node nor the module has one")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        pytest.skip(f"{type(module).__qualname__} has no weight (gain) tensor: the clause reads weight and bias")
    bias = getattr(module, "bias", None) if norm.choice == "layernorm" else None
    return float(eps), weight.detach(), (bias.detach() if isinstance(bias, torch.Tensor) else None)


def oracle(norm, x, eps, weight, bias, dtype):
    if norm.choice == "layernorm":
        return layer_norm_oracle(x, eps, weight, bias, dtype)
    return rms_norm_oracle(x, eps, weight, dtype)


def recovered(out, weight, bias, error):
    """n' = (y - b)/g in float64 and its bound: the output's error over |g| plus the two float64 steps."""
    g, y = to_float64(weight), to_float64(out)
    b = to_float64(bias) if bias is not None else torch.zeros_like(g)
    u64 = unit_roundoff(torch.float64)
    n = (y - b) / g
    return n, error / g.abs() + gamma(2, u64) * (y.abs() + b.abs()) / g.abs()


def normalized(norm, p, device, check: str | None = None):
    """Run the norm on drawn tokens x and recover its normalized features from the output: (x, eps, the exact
    normalized features (float64 oracle), the recovered ones n = (y - bias)/weight (no bias for RMSNorm),
    their error bound)."""
    module = build(norm, p, device)
    x = tokens(p, device)
    eps, weight, bias = affine(norm, module)
    out = forward(module, x)
    n_exact, y = oracle(norm, x, eps, weight, bias, p.dtype)
    n, e = recovered(out, weight, bias, y.error)
    if check == "standardize":   # --repro-dir: the script recovers n from the same call and applies the same checks
        _, v, _ = layer_norm_stats(x, eps)
        evidence.record_module_oracle(out, n_exact.value, y.error, check=check, variance=(v / (v + eps))[..., 0],
                                      what="mean and variance of the normalized features (y - bias)/weight",
                                      reference="0 and σ²/(σ² + eps)", oracle="properties/module/oracle.py")
    return x, eps, n_exact, n, e


def assert_mean_square(n, n_exact, e, expected, **message):
    """mean_d n² = expected per token, within what the recovered features' error e adds (|n² - n_exact²| <=
    (2|n_exact| + e) e) plus the float64 mean over d features."""
    square = (n * n).mean(-1)
    d = n.shape[-1]
    bound = ((2 * n_exact.value.abs() + e) * e).mean(-1) + gamma(d + 2, unit_roundoff(torch.float64)) * square
    assert_within(square, expected, bound, **message)


# ------------------------------------------------------------------------------------ NORM-STANDARDIZE
@clause("NORM-STANDARDIZE")
@kinds("layernorm")
@on_both_pinned_tokens
def test_layernorm_mean_zero_variance_one(norm, device, p):
    x, eps, n_exact, n, e = normalized(norm, p, device, check="standardize")
    _, v, _ = layer_norm_stats(x, eps)
    mean, mean_bound = n.mean(-1), e.mean(-1) + gamma(p.d + 1, unit_roundoff(torch.float64)) * n.abs().mean(-1)
    assert_within(mean, torch.zeros_like(mean), mean_bound, what="mean of the normalized features",
                  reference="0", note=" (normalized = (y - bias)/weight)")
    assert_mean_square(n, n_exact, e, (v / (v + eps))[..., 0], what="variance of the normalized features",
                       reference="σ²/(σ² + eps) (1 up to eps)")


# ---------------------------------------------------------------------------------------------- NORM-RMS
@clause("NORM-RMS")
@kinds("rmsnorm")
@on_both_pinned_tokens
def test_rmsnorm_unit_rms(norm, device, p):
    x, eps, n_exact, n, e = normalized(norm, p, device)
    ms = (to_float64(x) ** 2).mean(-1)
    assert_mean_square(n, n_exact, e, ms / (ms + eps), what="mean square of the normalized features",
                       reference="ms/(ms + eps) (1 up to eps)", note=" (normalized = y/weight)")


# ------------------------------------------------------------------------------------- NORM-PER-TOKEN
@clause("NORM-PER-TOKEN")
@module_settings
@example(p=PINNED, data=PinnedData({"sample": 1, "position": 2}))
@given(p=problems, data=st.data())
def test_statistics_over_features_not_positions(norm, device, p, data):
    require_dtype(device, p.dtype)
    b = data.draw(st.integers(0, p.batch - 1), label="sample")
    i = data.draw(st.integers(0, p.l - 1), label="position")
    module = build(norm, p, device)
    x = tokens(p, device)
    eps = norm.get("eps", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    readable = eps is not None and isinstance(weight, torch.Tensor)
    if not readable:   # black box: float64 and the comparison tolerance
        module, x = build(norm, p, device, torch.float64), x.to(torch.float64)
    others = tokens(p, device, stream=2, dtype=x.dtype) * 4
    changed = others.clone()
    changed[b, i] = x[b, i]
    full = forward(module, x)[b, i]
    with_others_changed = forward(module, changed)[b, i]
    alone = forward(module, x[b:b + 1, i:i + 1])[0, 0]
    if readable:
        bias = getattr(module, "bias", None) if norm.choice == "layernorm" else None
        bias = bias.detach() if isinstance(bias, torch.Tensor) else None
        _, y = oracle(norm, x[b:b + 1, i:i + 1], float(eps), weight.detach(), bias, p.dtype)
        bound = 2 * y.error[0, 0]
    else:
        bound = torch.tensor(comparison_tolerance(full))
    assert_within(with_others_changed, full, bound, what=f"norm output at (sample {b}, position {i})",
                  reference="the same with every other token changed")
    assert_within(alone, full, bound, what=f"norm of token ({b}, {i}) alone", reference="inside the batch")


# -------------------------------------------------------------------------------- NORM-SCALE-INVARIANT
@clause("NORM-SCALE-INVARIANT")
@module_settings
@example(p=PINNED, k=3)
@example(p=PINNED_SHIFTED, k=-2)
@given(p=problems, k=st.integers(-4, 4).filter(lambda k: k != 0))
def test_positive_scaling(norm, device, p, k):
    module = build(norm, p, device)
    x = tokens(p, device)
    alpha = 2.0 ** k
    scaled = x * alpha
    assume(torch.equal(to_float64(scaled), to_float64(x) * alpha))   # αx exact (no subnormal rounding)
    eps, weight, bias = affine(norm, module)
    out, out_scaled = forward(module, x), forward(module, scaled)
    _, y = oracle(norm, x, eps, weight, bias, p.dtype)
    _, y_scaled = oracle(norm, scaled, eps, weight, bias, p.dtype)
    # The eps term: N_eps(αx) = N_{eps/α²}(x) exactly, so the outputs differ by |g|·|n_{eps/α²} - n_eps|,
    # evaluated here in float64 (its own rounding is below y's float64 part already counted).
    g = to_float64(weight).abs()
    if norm.choice == "layernorm":
        n_big, n_small = layer_norm_stats(x, eps / alpha ** 2)[2], layer_norm_stats(x, eps)[2]
    else:
        xd = to_float64(x)
        ms = (xd * xd).mean(-1, keepdim=True)
        n_big, n_small = xd / torch.sqrt(ms + eps / alpha ** 2), xd / torch.sqrt(ms + eps)
    eps_term = g * (n_big - n_small).abs()
    u = effective_u(torch.float64)
    bound = y.error + y_scaled.error + eps_term * (1 + gamma(4, u)) + gamma(4, u) * g * n_small.abs()
    assert_within(out_scaled, out, bound, what=f"Norm({alpha:g}·x)", reference="Norm(x)",
                  note=f" (eps term up to {float(eps_term.max()):.2e})")
    assert_all(torch.isfinite(to_float64(out_scaled)), to_float64(out_scaled), what="Norm(αx) is finite")


# ------------------------------------------------------------------------------------------- NORM-GRAD
@clause("NORM-GRAD")
@on_pinned_tokens
def test_gradients_follow_the_formula(norm, device, p):
    module = build(norm, p, device)
    eps, _, _ = affine(norm, module)
    names = ("weight", "bias") if norm.choice == "layernorm" else ("weight",)
    params = {n: t for n, t in module.named_parameters() if n in names}
    formula = layer_norm if norm.choice == "layernorm" else rms_norm
    x, upstream = tokens(p, device), tokens(p, device, stream=2)
    failures = check_gradients(module, lambda m, x: m(x), lambda i, w: formula(i["x"], w, eps), {"x": x}, params,
                               upstream, p.dtype, p.seed)
    assert not failures, f"gradients of sum({norm.choice}(x) ∘ G) depart from the formula's:\n  " + "\n  ".join(failures)
