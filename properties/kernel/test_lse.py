"""Clauses on the log-sum-exp a kernel returns beside its output (SPEC.md, "Partial states and their merge"):
``--returns-lse`` declares an SDPA-signature kernel that returns (out, lse), lse (..., L) the log-sum-exp of each
query's scores over its admissible keys (base e, or 2 with ``--lse-base 2``). Without the option these clauses are
skipped (properties/plugin/contracts.py); the other clauses read the kernel's output (properties/kernel/guard.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume

from properties import clause
from properties.core.assertions import assert_all, assert_within
from properties.core.oracle import default_scale, to_float64
from properties.core.strategies import derived_generator, require_dtype
from properties.core.tolerance import softmax_bounds
from properties.kernel.gradients import lse_gradient_oracle
from properties.kernel.guard import backward_gradients, check_lse_against_oracle
from properties.kernel.problem_space import DENSITY, MAGNITUDE, MASK_EXTRAS, SHAPES, SPREAD, Space
from properties.kernel.schedule import scheduled

# Every attend class (rows without a key included), grouped heads, and score profiles up to the dtype's range; the
# values do not enter the LSE (Ev = E).
LSE_SHAPES = {name: classes for name, classes in SHAPES.items() if name != "Ev"}
LSE_ORACLE = Space.of("LSE-ORACLE", **LSE_SHAPES, group=True, attend=True, values=("gaussian", "peaked", "negative"),
                      extras={"spread": SPREAD, "magnitude": MAGNITUDE, **MASK_EXTRAS}, long_rows=True)


def _nan_rows(bounds, fully_masked: str):
    """Queries whose output may be NaN: those without an admissible key, unless --fully-masked zeros."""
    return None if fully_masked == "zeros" else bounds.reference.no_key_rows


@clause("LSE-ORACLE")
@scheduled(LSE_ORACLE)
def test_lse_agrees_with_float64_log_sum_exp(kernel, device, causal_alignment, fully_masked, lse_base, case):
    """Every pair of classes: lengths against the tiles, head sizes, dtypes, leading dims, grouped heads, no mask,
    is_causal, masks (rows without a key, masked tiles), typical, peaked and very negative scores."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    contract = case.contract(device)
    bounds = softmax_bounds(q, k, v, causal_alignment=causal_alignment, **contract)
    _, lse = kernel.with_lse(q, k, v, nan_rows=_nan_rows(bounds, fully_masked), **contract)
    check_lse_against_oracle(lse, bounds, base=lse_base, fully_masked=fully_masked)


@clause("LSE-GRAD")
@scheduled(Space.of("LSE-GRAD", L=True, S=True, order=True, E=True, dtype=True, group=("1", "2"),
                    attend=("none", "causal", "bool", "float", "bool-empty"), values=("gaussian", "peaked"),
                    fixed={"rank": "2"}, extras={"spread": SPREAD, "magnitude": MAGNITUDE, "density": DENSITY},
                    calls=4))
def test_lse_gradient_is_the_weights(kernel, device, causal_alignment, fully_masked, lse_base, case):
    """d lse_i / d s_ij = w_ij: the gradient of sum(lse ∘ g) reaches q and k through the weights and never v; a
    query with no admissible key passes nothing back (its upstream gradient is not zero)."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    contract = case.contract(device)
    bounds = softmax_bounds(q, k, v, causal_alignment=causal_alignment, **contract)
    no_key = bounds.reference.no_key_rows
    if fully_masked != "zeros":   # such a query's LSE, hence its gradient, follows no convention
        assume(not bool(no_key.any()))
    leaves = {name: t.detach().requires_grad_() for name, t in (("query", q), ("key", k), ("value", v))}
    _, lse = kernel.with_lse(leaves["query"], leaves["key"], leaves["value"], nan_rows=_nan_rows(bounds, fully_masked),
                             **contract)
    if lse.grad_fn is None:
        pytest.skip(f"kernel {kernel.name}: its LSE does not require grad when its inputs do (no grad_fn): LSE-GRAD "
                    f"does not apply")
    g64 = torch.randn(lse.shape, generator=derived_generator(case.seed, 5), dtype=torch.float64)
    upstream = g64.to(lse.dtype).to(lse.device)
    grads = backward_gradients(kernel, lse, upstream, {"query": leaves["query"], "key": leaves["key"]})
    dv = leaves["value"].grad
    if dv is not None:
        assert_all(to_float64(dv) == 0, to_float64(dv), what="dvalue of the LSE is exactly 0 (the LSE does not "
                                                               "depend on the values)")
    # the kernel's natural-log LSE is λ₂·log 2: its gradient with respect to the scores is the weights over log 2
    factor = torch.log(torch.tensor(2.0, dtype=torch.float64)) if lse_base == "2" else 1.0
    scale = default_scale(case.e)
    oracle = lse_gradient_oracle(bounds, q, k, to_float64(upstream), scale=scale)
    for name, grad in grads.items():
        assert_all(torch.isfinite(to_float64(grad)), to_float64(grad), what=f"d{name} of the LSE is finite")
        assert_within(to_float64(grad) * factor, oracle.value[name], oracle.bound[name],
                      what=f"d{name} of the LSE" + (" × log 2" if lse_base == "2" else ""),
                      reference="float64 autograd of torch.logsumexp")
