"""The backward clause of attention split across ranks: dQ, dK, dV of the whole sequence, gathered from the ranks'
shards, against the float64 chain rule (properties/kernel/gradients.py) within its bound plus the merge's."""
from __future__ import annotations

from hypothesis import example, given, strategies as st

from properties import clause
from properties.distributed.cases import (FLOAT16_PIN, GROUPED_PIN, HALF_PIN, case_for, check_gradients, check_output,
                                          expected)


@clause("CP-GRAD")
@example(case=HALF_PIN)
@example(case=FLOAT16_PIN)
@example(case=GROUPED_PIN)
@given(case=st.data())
def test_gradients_agree_with_the_oracle_of_the_whole_sequence(cp_kernel, case):
    cp_kernel.require("backward")
    case = case_for(case, cp_kernel)
    q, k, v, do = case.tensors()
    world, layout = cp_kernel.size, cp_kernel.layout
    result = cp_kernel(q, k, v, grad_out=do, **case.kwargs())
    exp = expected(case, q, k, v, do, world=world, layout=layout)
    check_output(result.out, exp, world=world, layout=layout)
    check_gradients(result.grads, exp, world=world, layout=layout)
