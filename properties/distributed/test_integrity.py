"""Integrity, history and the declared contracts of a kernel split across ranks: it leaves its shards alone, forgets
the calls before, and (where declared) repeats itself bitwise and ignores its batch."""
from __future__ import annotations

import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core.assertions import assert_identical, assert_within
from properties.distributed.cases import FLOAT_PIN, case_for, check_output, cp_cases, expected


@clause("CP-INPUTS-UNCHANGED")
@example(case=FLOAT_PIN)
@given(case=st.data())
def test_no_rank_writes_into_its_shards(cp_kernel, case):
    case = case_for(case, cp_kernel)
    q, k, v, do = case.tensors()
    grad = "backward" not in cp_kernel.declined
    result = cp_kernel(q, k, v, grad_out=do if grad else None, **case.kwargs())
    assert not result.changed, "; ".join(f"rank {r} wrote into its {', '.join(names)} shard"
                                         for r, names in sorted(result.changed.items()))


@clause("CP-HISTORY")
@given(data=st.data())
def test_an_output_does_not_depend_on_the_calls_before(cp_kernel, data):
    case = data.draw(cp_cases(cp_kernel), label="case")
    history = data.draw(st.lists(cp_cases(cp_kernel), min_size=1, max_size=2), label="history")
    world, layout = cp_kernel.size, cp_kernel.layout
    q, k, v, do = case.tensors()
    exp = expected(case, q, k, v, world=world, layout=layout)
    first = cp_kernel(q, k, v, **case.kwargs())
    check_output(first.out, exp, world=world, layout=layout)
    repeat = cp_kernel(q, k, v, **case.kwargs())
    for other in history:
        oq, ok, ov, _ = other.tensors(stream=1)
        result = cp_kernel(oq, ok, ov, **other.kwargs())
        check_output(result.out, expected(other, oq, ok, ov, world=world, layout=layout), world=world, layout=layout,
                     what="out of a call in the history")
    last = cp_kernel(q, k, v, **case.kwargs())
    if torch.equal(repeat.out, first.out):
        assert_identical(last.out, first.out, what="out after the history", reference="out before it")
    else:
        assert_within(last.out, first.out, 2 * exp.out_bound, what="out after the history", reference="out before it")


@clause("CP-DETERMINISTIC")
@given(data=st.data())
def test_repeated_calls_are_bitwise_equal(cp_kernel, data):
    case = data.draw(cp_cases(cp_kernel), label="case")
    between = data.draw(cp_cases(cp_kernel), label="between")
    q, k, v, do = case.tensors()
    grad = "backward" not in cp_kernel.declined
    first = cp_kernel(q, k, v, grad_out=do if grad else None, **case.kwargs())
    bq, bk, bv, _ = between.tensors(stream=1)
    cp_kernel(bq, bk, bv, **between.kwargs())
    second = cp_kernel(q, k, v, grad_out=do if grad else None, **case.kwargs())
    assert_identical(second.out, first.out, what="out of the second call", reference="the first")
    for name, g in first.grads.items():
        assert_identical(second.grads[name], g, what=f"d{name} of the second call", reference="the first")


@clause("CP-BATCH-INVARIANT")
@given(data=st.data())
def test_a_sequence_does_not_depend_on_its_batch(cp_kernel, data):
    case = data.draw(cp_cases(cp_kernel), label="case")
    size = data.draw(st.sampled_from((2, 3)), label="batch")
    at = data.draw(st.integers(0, size - 1), label="position")
    q, k, v, _ = (t[:1] for t in case.tensors())
    others = [tuple(t[:1] for t in case.tensors(stream=1 + i)) for i in range(size - 1)]
    batch = others[:at] + [(q, k, v)] + others[at:]
    alone = cp_kernel(q, k, v, **case.kwargs())
    together = cp_kernel(*(torch.cat([b[i] for b in batch]) for i in range(3)), **case.kwargs())
    assert_identical(together.out[at:at + 1], alone.out, what=f"its rows at position {at} of a batch of {size}",
                     reference="its rows alone")
