"""Gradient clauses of the ``flash`` API (SPEC.md, FLASH-GRAD, FLASH-GRAD-MASKED): the backward pass of a
``flash_attn_func`` kernel whose output requires grad, against kernel/gradients.py's float64 chain rule and bound
(the flash scores enter as a constant additive mask: ALiBi and the causal/window band; a soft cap through its
slope 1 − tanh², kernel/gradients.py: softcap_slope)."""
from __future__ import annotations

import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.kernel.flash import FlashCase, flash_allowed, flash_bounds, flash_cases, flash_gradients, to_heads_first
from properties.kernel.flash_guard import skip_unsupported
from properties.core.oracle import to_float64
from properties.core.strategies import derived_generator
from properties.core.dtypes import selected_dtypes
from properties.kernel.guard import backward_gradients

F32 = selected_dtypes()[0]


def _backward(kernel, case: FlashCase, q, k, v, slopes, grad_out) -> dict:
    """Gradients of sum(out ∘ grad_out) w.r.t. q, k, v (as the inputs' layout), or a skip without autograd."""
    leaves = {"query": q.detach().requires_grad_(), "key": k.detach().requires_grad_(),
              "value": v.detach().requires_grad_()}
    with skip_unsupported(kernel, f"{case!r}"):
        out = kernel(leaves["query"], leaves["key"], leaves["value"], **case.kwargs(slopes))
    grads = backward_gradients(kernel, out, grad_out, leaves)
    return grads


def _grad_out(case: FlashCase, device) -> torch.Tensor:
    g = derived_generator(case.seed, 9)
    return case.place(torch.randn(case.b, case.lq, case.heads, case.d, generator=g, dtype=torch.float64), device)


@clause("FLASH-GRAD")
@example(case=FlashCase(2, 3, 5, 2, 2, 4, F32, causal=True, window=(2, -1), alibi="batch", strided=True, seed=1))
@example(case=FlashCase(1, 5, 3, 1, 1, 3, F32, causal=True, scale=0.5))
@example(case=FlashCase(1, 3, 4, 1, 2, 4, F32, softcap=1.0, spread=2, seed=2))   # scores beyond the cap's knee
@given(case=flash_cases(max_lq=6, max_lk=6, max_d=6))
def test_flash_gradients_agree_with_float64_chain_rule(flash_kernel, device, case):
    case = case.without(flash_kernel.unsupported(device))
    q, k, v, slopes = case.tensors(device)
    do = _grad_out(case, device)
    grads = _backward(flash_kernel, case, q, k, v, slopes, do)
    oracle = flash_gradients(case, flash_bounds(q, k, v, **case.oracle_kwargs(slopes)), q, k, v, do)
    evidence.record("flash-gradient", subject=flash_kernel.name, device=str(device), query=q, key=k, value=v,
                    kwargs=case.kwargs(slopes), upstream=do, bound=oracle.bound)
    for name, grad in grads.items():
        assert_within(to_heads_first(grad), oracle.value[name], oracle.bound[name], what=f"d{name}",
                      reference="float64 chain rule", note=f"; index (b, h, position, d); {case!r}")


@clause("FLASH-GRAD-MASKED")
@example(case=FlashCase(1, 4, 4, 1, 1, 3, F32, window=(1, 0)), row=2)
@example(case=FlashCase(1, 5, 2, 1, 1, 3, F32, causal=True), row=4)
@given(case=flash_cases(max_lq=6, max_lk=6, max_d=6), row=st.integers(0, 5))
def test_flash_excluded_keys_get_no_gradient_from_a_query(flash_kernel, device, case, row):
    case = case.without(flash_kernel.unsupported(device))
    if case.window == (-1, -1) and not case.causal:
        case = FlashCase(**{**case.__dict__, "causal": True})
    row = row % case.lq
    q, k, v, slopes = case.tensors(device)
    do = torch.zeros_like(_grad_out(case, device))
    do[:, row] = _grad_out(case, device)[:, row]
    grads = _backward(flash_kernel, case, q, k, v, slopes, do)
    allowed = flash_allowed(case.lq, case.lk, causal=case.causal, window_size=case.window)
    if evidence.active():   # the script's chain rule with bound 0 where this clause wants exact zeros, finite elsewhere
        bound = {name: torch.full_like(to_heads_first(grad), torch.inf) for name, grad in grads.items()}
        for name, where in (("key", ~allowed[row]), ("value", ~allowed[row]), ("query", ~allowed.any(-1))):
            bound[name][:, :, where] = 0
        evidence.record("flash-gradient", subject=flash_kernel.name, device=str(device), query=q, key=k, value=v,
                        kwargs=case.kwargs(slopes), upstream=do, bound=bound)
    for name, grad in grads.items():
        g = to_float64(grad)
        assert_all(torch.isfinite(g), g, what=f"d{name} is finite")
    for name in ("key", "value"):
        g = to_float64(grads[name])[:, ~allowed[row]]
        assert_all(g == 0, g, what=f"d{name} is exactly 0 for keys {(~allowed[row]).nonzero().flatten().tolist()} "
                                   f"that query {row} may not attend (dO nonzero at row {row} only)",
                   note=f"; {case!r}")
    empty = ~allowed.any(-1)
    g = to_float64(grads["query"])[:, empty]
    assert_all(g == 0, g, what=f"dquery is exactly 0 for queries {empty.nonzero().flatten().tolist()} with no "
                               "admissible key", note=f"; {case!r}")
