"""Differential kernel clauses (SPEC.md, "Decoding and differential clauses": ATTN-DIFF, ATTN-DIFF-GRAD): each kernel
under test against the kernel ``--reference-kernel`` names, forward and backward, on the problems the gradient
clauses draw (masks, is_causal, scale, grouped-query heads, strided inputs, every selected dtype). Skipped, with the
reason, without ``--reference-kernel``.

Bound: each correct kernel lies within the ATTN-ORACLE bound (dQ, dK, dV: the ATTN-GRAD bound) of the float64
oracle in the tested dtype, so two correct kernels lie within the sum of their bounds — twice the bound — of each
other. The report also gives each kernel's distance from the oracle, which says which of the two is off.
"""
from __future__ import annotations

import torch
from hypothesis import assume

from properties import clause
from properties.core.assertions import assert_within
from properties.kernel.gradients import gradient_oracle
from properties.core.oracle import default_scale, to_float64
from properties.core.tolerance import output_bound, softmax_bounds
from properties.kernel.guard import NON_FINITE_CONVENTIONS
from properties.kernel.problem_space import Space
from properties.kernel.schedule import scheduled
from properties.kernel.test_gradients import GRAD, GradCase, backward

ATTENDS = ("none", "causal", "bool", "float")


def _problem(case: GradCase, device, causal_alignment):
    q, k, v, do, mask = case.tensors(device)
    if mask is not None:
        mask = mask.detach()
    bounds = softmax_bounds(q, k, v, attn_mask=mask, is_causal=case.causal, enable_gqa=case.group > 1,
                            scale=case.scale, causal_alignment=causal_alignment)
    return q, k, v, do, mask, bounds


def _distance(actual, oracle) -> str:
    return f"{float((to_float64(actual) - oracle).abs().nan_to_num(float('inf')).max()):.2e}"


def _same_nan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN where both are NaN counts as agreement (e.g. both follow --fully-masked nan)."""
    a, b = to_float64(a), to_float64(b)
    both = torch.isnan(a) & torch.isnan(b)
    return a.masked_fill(both, 0.0), b.masked_fill(both, 0.0)


@clause("ATTN-DIFF")
@scheduled(Space.of("ATTN-DIFF", **{**GRAD, "calls": 2}, attend=ATTENDS))
def test_kernel_agrees_with_the_reference_kernel(kernel, reference_kernel, device, causal_alignment, fully_masked,
                                                   case):
    case = GradCase.of(case)
    q, k, v, _, mask, bounds = _problem(case, device, causal_alignment)
    no_key = bounds.reference.no_key_rows
    nan_rows = no_key if fully_masked in NON_FINITE_CONVENTIONS or fully_masked == "mean" else None
    contract = case.contract(mask)
    out = kernel(q, k, v, nan_rows=nan_rows, **contract)
    ref = reference_kernel(q, k, v, nan_rows=nan_rows, **contract)
    oracle = bounds.reference.output
    actual, expected = _same_nan(out, ref)
    assert_within(actual, expected, 2 * output_bound(bounds, v), what=f"kernel {kernel.name}",
                  reference=reference_kernel.name,
                  note=f"; max distance from the float64 oracle: kernel {_distance(out, oracle)}, reference "
                       f"{_distance(ref, oracle)} ({case})")


@clause("ATTN-DIFF-GRAD")
@scheduled(Space.of("ATTN-DIFF-GRAD", **{**GRAD, "calls": 8}, attend=ATTENDS))
def test_kernel_gradients_agree_with_the_reference_kernel(kernel, reference_kernel, device, causal_alignment,
                                                            fully_masked, case):
    case = GradCase.of(case)
    q, k, v, do, mask, bounds = _problem(case, device, causal_alignment)
    if fully_masked != "zeros":
        assume(not bool(bounds.reference.no_key_rows.any()))
    if mask is not None and case.mask == "float-grad":
        mask.requires_grad_()
    contract = {name: value for name, value in case.contract(None).items()}
    _, mine = backward(kernel, q, k, v, do, mask, **contract)
    reference_mask = None if mask is None else mask.detach().requires_grad_(mask.requires_grad)
    _, theirs = backward(reference_kernel, q, k, v, do, reference_mask, **contract)
    scale = default_scale(case.e) if case.scale is None else case.scale
    oracle = gradient_oracle(bounds, q, k, v, do, scale=scale,
                             attn_mask=mask if "attn_mask" in mine and "attn_mask" in theirs else None)
    for name in [n for n in mine if n in theirs]:
        actual, expected = _same_nan(mine[name], theirs[name])
        assert_within(actual, expected, 2 * oracle.bound[name], what=f"d{name} of kernel {kernel.name}",
                      reference=f"d{name} of {reference_kernel.name}",
                      note=f"; max distance from the float64 chain rule: kernel "
                           f"{_distance(mine[name], oracle.value[name])}, reference "
                           f"{_distance(theirs[name], oracle.value[name])} ({case})")
