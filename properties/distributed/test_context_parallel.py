"""The forward clauses of attention split across ranks (SPEC.md, "Attention split across ranks"): each rank's output
is its shard of attention over the whole sequence, held to the float64 oracle of the whole problem.

``cp_kernel`` is a properties/distributed/guard.py ContextParallelKernel (--kernel with --world-size); the problems
are properties/distributed/cases.py's.
"""
from __future__ import annotations

import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core.assertions import assert_identical, assert_within
from properties.core.strategies import derived_generator
from properties.distributed.cases import (FLOAT_PIN, GROUPED_PIN, HALF_PIN, UNEVEN_GROUPS_PIN, case_for, check_output,
                                          cp_cases, expected)
from properties.distributed.layouts import rows_of


@clause("CP-SHAPE")
@given(data=st.data())
def test_every_rank_returns_its_shard(cp_kernel, data):
    """The guard checks every rank's output (a tensor of the shard's shape, the query's dtype, finite)."""
    case = data.draw(cp_cases(cp_kernel), label="case")
    q, k, v, _ = case.tensors()
    result = cp_kernel(q, k, v, **case.kwargs())
    assert tuple(result.out.shape) == (case.b, case.heads, case.length, case.ev)


@clause("CP-ORACLE")
@example(case=HALF_PIN)
@example(case=FLOAT_PIN)
@given(case=st.data())
def test_output_agrees_with_the_oracle_of_the_whole_sequence(cp_kernel, case):
    case = case_for(case, cp_kernel)
    q, k, v, _ = case.tensors()
    result = cp_kernel(q, k, v, **case.kwargs())
    check_output(result.out, expected(case, q, k, v, world=cp_kernel.size, layout=cp_kernel.layout),
                 world=cp_kernel.size, layout=cp_kernel.layout)


@clause("CP-CAUSAL")
@example(case=HALF_PIN, cut=None)
@given(case=st.data(), cut=st.data())
def test_causal_queries_never_see_later_keys_on_any_rank(cp_kernel, case, cut):
    cp_kernel.require("causal")
    case = case_for(case, cp_kernel, causal=True)
    world, layout = cp_kernel.size, cp_kernel.layout
    boundaries = sorted({int(rows.min()) for rows in rows_of(case.length, world, layout) if len(rows)} - {0})
    if cut is None:
        t = boundaries[0] if boundaries else max(1, case.length // 2)
    else:   # a shard boundary first, then any row
        t = cut.draw(st.sampled_from(boundaries) | st.integers(1, max(1, case.length - 1)), label="cut")
    q, k, v, _ = case.tensors()
    first = cp_kernel(q, k, v, **case.kwargs())
    exp = expected(case, q, k, v, world=world, layout=layout)
    check_output(first.out, exp, world=world, layout=layout)
    g = derived_generator(case.seed, 7)
    k2, v2 = k.clone(), v.clone()
    k2[..., t:, :] = torch.randn(k2[..., t:, :].shape, generator=g, dtype=torch.float64).to(k.dtype) * 8
    v2[..., t:, :] = torch.randn(v2[..., t:, :].shape, generator=g, dtype=torch.float64).to(v.dtype) * 8
    second = cp_kernel(q, k2, v2, **case.kwargs())
    before = slice(0, t)
    what = f"output of queries before row {t} once the keys and values from row {t} on changed"
    if torch.equal(cp_kernel(q, k, v, **case.kwargs()).out, first.out):   # the kernel repeats itself bitwise
        assert_identical(second.out[..., before, :], first.out[..., before, :], what=what,
                         reference="the output before the change")
    else:
        assert_within(second.out[..., before, :], exp.out[..., before, :], exp.out_bound[..., before, :], what=what)


@clause("CP-SCALE")
@given(data=st.data())
def test_scale_replaces_the_default_on_every_rank(cp_kernel, data):
    cp_kernel.require("scale")
    scale = data.draw(st.one_of(st.none(), st.floats(1e-3, 0.1), st.floats(1.5, 4.0)), label="scale")
    case = data.draw(cp_cases(cp_kernel, scale=scale), label="case")
    q, k, v, _ = case.tensors()
    result = cp_kernel(q, k, v, **case.kwargs())
    check_output(result.out, expected(case, q, k, v, world=cp_kernel.size, layout=cp_kernel.layout),
                 world=cp_kernel.size, layout=cp_kernel.layout)


@clause("CP-GQA")
@example(case=GROUPED_PIN)
@example(case=UNEVEN_GROUPS_PIN)
@given(case=st.data())
def test_grouped_heads_read_their_key_value_head_on_every_rank(cp_kernel, case):
    cp_kernel.require("gqa")
    case = case_for(case, cp_kernel, gqa=True)
    q, k, v, _ = case.tensors()
    result = cp_kernel(q, k, v, **case.kwargs())
    check_output(result.out, expected(case, q, k, v, world=cp_kernel.size, layout=cp_kernel.layout),
                 world=cp_kernel.size, layout=cp_kernel.layout)
