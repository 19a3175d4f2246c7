"""What changes with the number of ranks: nothing but rounding (CP-WORLD-SIZE), and lengths the ranks cannot share
equally are declined or handled, never wrong (CP-SHARD-EDGES)."""
from __future__ import annotations

from hypothesis import given, strategies as st

from properties import clause
from properties.core.assertions import assert_within
from properties.distributed.cases import check_gradients, check_output, cp_cases, expected
from properties.distributed.worker import subgroup_sizes


@clause("CP-WORLD-SIZE")
@given(data=st.data())
def test_fewer_ranks_agree_within_the_bound(cp_kernel, data):
    cp_kernel.require("backward")
    sizes = subgroup_sizes(cp_kernel.size)
    if not sizes:
        import pytest
        pytest.skip("--world-size 1: no smaller world to compare with")
    world = data.draw(st.sampled_from(sizes), label="smaller world")
    case = data.draw(cp_cases(cp_kernel), label="case")
    q, k, v, do = case.tensors()
    layout = cp_kernel.layout
    unit = world if layout == "contiguous" else 2 * world
    assert case.length % unit == 0   # a multiple of the whole world's unit is one of every smaller power of two's
    results, expectations = {}, {}
    for w in (cp_kernel.size, world):
        results[w] = cp_kernel(q, k, v, grad_out=do, world=w, **case.kwargs())
        expectations[w] = expected(case, q, k, v, do, world=w, layout=layout)
        check_output(results[w].out, expectations[w], world=w, layout=layout, what=f"out on {w} ranks")
        check_gradients(results[w].grads, expectations[w], world=w, layout=layout, where=f" on {w} ranks")
    big, small = results[cp_kernel.size], results[world]
    both = expectations[cp_kernel.size].out_bound + expectations[world].out_bound
    assert_within(big.out, small.out, both, what=f"out on {cp_kernel.size} ranks", reference=f"out on {world}")


@clause("CP-SHARD-EDGES")
@given(data=st.data())
def test_lengths_the_ranks_cannot_share_equally_are_declined_or_right(cp_kernel, data):
    case = data.draw(cp_cases(cp_kernel, divisible=False), label="case")
    q, k, v, do = case.tensors()
    grad = "backward" not in cp_kernel.declined
    result = cp_kernel(q, k, v, grad_out=do if grad else None, on_decline="return", **case.kwargs())
    if result is None:   # declined on every rank, in the kernel's words (counted in the coverage)
        return
    exp = expected(case, q, k, v, do if grad else None, world=cp_kernel.size, layout=cp_kernel.layout)
    check_output(result.out, exp, world=cp_kernel.size, layout=cp_kernel.layout)
    if grad:
        check_gradients(result.grads, exp, world=cp_kernel.size, layout=cp_kernel.layout)
