"""Integrity (SPEC.md, "Integrity, history and layouts"): a kernel leaves the caller's tensors alone, forward and
backward, and returns outputs of its own, independent from call to call.

Drawn as the other kernel clauses are (``cases``, ``grad_cases``; FlashAttention's API: ``flash_cases``), with few
examples each: what these clauses catch does not hide in a corner of the problem space, it shows on the first call.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import example, given

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_identical, assert_within
from properties.kernel.flash import FlashCase, flash_bounds, flash_cases
from properties.kernel.flash_guard import skip_unsupported
from properties.core.oracle import to_float64
from properties.core.strategies import require_dtype
from properties.core.dtypes import selected_dtypes
from properties.core.tolerance import output_bound, softmax_bounds
from properties.kernel.guard import backward_gradients, check_against_oracle
from properties.kernel.integrity import FEW, assert_no_alias, assert_unchanged, bitwise_equal, snapshot
from properties.kernel.problem_space import MASK_EXTRAS, SHAPES, Space
from properties.kernel.schedule import scheduled
from properties.kernel.test_gradients import GRAD, GradCase

F32 = selected_dtypes()[0]


def _inputs(q, k, v, kw) -> dict:
    return {"query": q, "key": k, "value": v, "attn_mask": kw.get("attn_mask")}


def _copies(q, k, v, kw: dict) -> dict | None:
    """--repro-dir: copies of the call's inputs before it (a kernel may write into them), for ``_record``."""
    if not evidence.active():
        return None
    return {name: t.detach().clone() if torch.is_tensor(t) else t for name, t in dict(query=q, key=k, value=v,
                                                                                       **kw).items()}


def _record(kernel, inputs: dict | None, **recorded) -> None:
    """The integrity reproducer of that call (after the oracle check, whose own evidence it replaces)."""
    if inputs is not None:
        evidence.record("integrity", subject=kernel.name, device=str(inputs["query"].device), inputs=inputs,
                        **{name: [t.detach().clone() for t in x] if isinstance(x, list) else x
                        for name, x in recorded.items()})


# ------------------------------------------------------------------------------------ ATTN-INPUTS-UNCHANGED
# Every attend class (masks with rows that admit no key among them) and grouped heads: what a kernel may be tempted
# to patch in the caller's tensors.
INTEGRITY = dict(**SHAPES, group=True, attend=True, extras=MASK_EXTRAS)


@clause("ATTN-INPUTS-UNCHANGED")
@scheduled(Space.of("ATTN-INPUTS-UNCHANGED", **INTEGRITY, shrink=False))
def test_forward_leaves_its_inputs_unchanged(kernel, device, causal_alignment, fully_masked, case):
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    kw = case.contract(device)
    before = snapshot(_inputs(q, k, v, kw))
    inputs = _copies(q, k, v, kw)
    check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked, **kw)
    _record(kernel, inputs)
    assert_unchanged(before, "by the kernel's forward")


@clause("ATTN-INPUTS-UNCHANGED")
@scheduled(Space.of("ATTN-INPUTS-UNCHANGED (backward)", **GRAD, shrink=False,
                    attend=("none", "causal", "bool", "float")))
def test_backward_leaves_its_inputs_unchanged(kernel, device, case):
    case = GradCase.of(case)
    q, k, v, do, mask = case.tensors(device)
    leaves = {"query": q.requires_grad_(), "key": k.requires_grad_(), "value": v.requires_grad_()}
    if mask is not None and case.mask == "float-grad":
        leaves["attn_mask"] = mask.requires_grad_()
    kw = case.contract(mask)
    before = snapshot({**_inputs(q, k, v, kw), "the upstream gradient": do})
    _record(kernel, _copies(q, k, v, kw), upstream=do)
    out = kernel(q, k, v, **kw)
    assert_unchanged(before, "by the kernel's forward (inputs that require grad)")
    grads = backward_gradients(kernel, out, do, leaves)
    assert_unchanged(before, "by the kernel's backward")
    for name, grad in grads.items():
        assert_no_alias(grad, {**_inputs(q, k, v, kw), "the upstream gradient": do, "the output": out},
                        what=f"d{name}")


# ---------------------------------------------------------------------------------------- ATTN-OUTPUT-FRESH
@clause("ATTN-OUTPUT-FRESH")
@scheduled(Space.of("ATTN-OUTPUT-FRESH", **INTEGRITY, shrink=False))
def test_outputs_are_the_callers_own(kernel, device, causal_alignment, fully_masked, case):
    """The output aliases no input; a second call on the same tensors, written in place with new values (a static
    KV cache is), gives a new tensor with the new problem's output and leaves the first output alone; writing into
    the first output leaves the second alone."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    kw = case.contract(device)
    inputs, copies = _inputs(q, k, v, kw), _copies(q, k, v, kw)
    first, _ = check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked,
                                    what="out (first call)", **kw)
    _record(kernel, copies)
    assert_no_alias(first, inputs, what="the output")
    kept = first.detach().clone()
    with torch.no_grad():
        for t, new in zip((q, k, v), case.qkv(device, stream=3)):
            t.copy_(new)
    if copies is not None:   # the script replays both calls: its own oracle check of the second is one of its checks
        bound = output_bound(softmax_bounds(q, k, v, causal_alignment=causal_alignment, **kw), v)
        _record(kernel, copies, second=[q, k, v], alignment=causal_alignment, fully_masked=fully_masked, bound=bound,
                sticky=True)
    second, _ = check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked,
                                     what="out of a second call, on the inputs written in place with new values",
                                     **kw)
    assert_no_alias(second, {**inputs, "the first call's output": first}, what="the second call's output")
    assert bitwise_equal(first, kept), ("the first call's output changed during the second call (the kernel "
                                        "reuses an output buffer)")
    kept = second.detach().clone()
    with torch.no_grad():
        first.detach().fill_(float("nan"))
    assert_identical(second, kept, what="the second call's output after writing NaN into the first's",
                     reference="its value before")


# ------------------------------------------------------------------------------ the FlashAttention API
@clause("ATTN-INPUTS-UNCHANGED")
@example(case=FlashCase(2, 3, 5, 1, 2, 4, F32, causal=True, strided=True))
@FEW
@given(case=flash_cases())
def test_flash_leaves_its_inputs_unchanged(flash_kernel, device, case):
    case = case.without(flash_kernel.unsupported(device))
    q, k, v, slopes = case.tensors(device)
    before = snapshot({"q": q, "k": k, "v": v, "alibi_slopes": slopes})
    with skip_unsupported(flash_kernel, f"{case!r}"):
        out = flash_kernel(q, k, v, **case.kwargs(slopes))
    assert_unchanged(before, "by the kernel")
    assert_no_alias(out, {"q": q, "k": k, "v": v, "alibi_slopes": slopes})


@clause("ATTN-OUTPUT-FRESH")
@example(case=FlashCase(2, 3, 5, 1, 2, 4, F32))
@FEW
@given(case=flash_cases())
def test_flash_outputs_are_the_callers_own(flash_kernel, device, case):
    case = case.without(flash_kernel.unsupported(device))
    q, k, v, slopes = case.tensors(device)
    with skip_unsupported(flash_kernel, f"{case!r}"):
        first = flash_kernel(q, k, v, **case.kwargs(slopes))
        kept = first.detach().clone()
        with torch.no_grad():   # new values, in place: the same tensors, another problem
            for t, new in zip((q, k, v), replace(case, seed=case.seed + 1).tensors(device)):
                t.copy_(new)
        second = flash_kernel(q, k, v, **case.kwargs(slopes))
    assert_no_alias(second, {"q": q, "k": k, "v": v, "the first call's output": first},
                    what="the second call's output")
    assert bitwise_equal(first, kept), ("the first call's output changed during the second call (the kernel "
                                        "reuses an output buffer)")
    bounds = flash_bounds(q, k, v, **case.oracle_kwargs(slopes))
    assert_within(to_float64(second), bounds.output, bounds.output_bound(), reference="float64 flash oracle",
                  what="out of a second call, on the inputs written in place with new values")
    kept = second.detach().clone()
    with torch.no_grad():
        first.detach().fill_(float("nan"))
    assert_identical(second, kept, what="the second call's output after writing NaN into the first's",
                     reference="its value before")
