"""Clauses on the attention kernel as a function: shapes, oracle agreement, convexity, linearity,
permutations and independence of slices."""
from __future__ import annotations

import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core.assertions import assert_all, assert_within
from properties.core.strategies import require_dtype
from properties.kernel.guard import check_against_oracle
from properties.core.oracle import to_float64
from properties.core.strategies import on
from properties.kernel.cases import Case, cases, with_pinned_cases
from properties.core.tolerance import evaluation_error, output_bound, rounding_error, softmax_bounds


@clause("ATTN-SHAPE")
@with_pinned_cases(n_lead=0)
@with_pinned_cases(n_lead=1)
@with_pinned_cases()
@example(case=Case(lead=(2,), l=3, s=4, e=5, ev=2, dtype=torch.float16, seed=0))  # the cast back to half
@example(case=Case(lead=(2,), l=3, s=4, e=5, ev=2, dtype=torch.bfloat16, seed=0))
@given(case=cases(min_lead=0, max_lead=2))
def test_output_shape_dtype_and_device(kernel, device, case):
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    out = kernel(q, k, v)  # the guard raises on the wrong shape, dtype or device; restated here
    assert tuple(out.shape) == (*case.lead, case.l, case.ev), f"output shape {tuple(out.shape)}"
    assert out.dtype == case.dtype and out.device == q.device, f"output {out.dtype} on {out.device}"


# Precision at length (SPEC.md, "Tolerance model", step 6): small scores and non-negative values leave no
# cancellation to hide behind, so every rounding of a kernel's running state shows in its output.
LONG_ROW = Case(lead=(1, 1), l=3, s=1024, e=64, ev=64, dtype=torch.bfloat16, seed=0)


@clause("ATTN-ORACLE")
@with_pinned_cases(spread=0, positive=False)
@example(case=LONG_ROW, spread=-8, positive=True)
@given(case=cases(), spread=st.integers(-8, 4), positive=st.booleans())
def test_output_agrees_with_float64_oracle(kernel, device, case, spread, positive):
    """spread: the queries' scale (2^spread); positive: values uniform on [0, 1), whose weighted sum is no smaller
    than its terms."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv64()
    if positive:
        v = torch.rand(v.shape, generator=case.generator(1), dtype=torch.float64)
    q, k, v = on(q * 2.0**spread, case.dtype, device), on(k, case.dtype, device), on(v, case.dtype, device)
    check_against_oracle(kernel, q, k, v)


@clause("ATTN-CONVEX")
@with_pinned_cases(equal_rows=False)
@given(case=cases(), equal_rows=st.booleans())
def test_outputs_are_convex_combinations_of_values(kernel, device, case, equal_rows):
    q, k, v = case.qkv(device)
    if equal_rows:  # every value row is the same vector c, so every output row must be c
        v = v[..., :1, :].expand_as(v).contiguous()
    out, v64 = to_float64(kernel(q, k, v)), to_float64(v)
    slack_factor = evaluation_error(case.s, case.dtype) + rounding_error(case.s, 2, case.dtype) * (
        1 + evaluation_error(case.s, case.dtype))
    slack = slack_factor * v64.abs().amax(dim=-2, keepdim=True)
    low, high = v64.amin(dim=-2, keepdim=True) - slack, v64.amax(dim=-2, keepdim=True) + slack
    assert_all(out >= low, out - low, what="out >= min over keys of v - slack (value: out - bound)")
    assert_all(out <= high, high - out, what="out <= max over keys of v + slack (value: bound - out)")


@clause("ATTN-LINEAR-V")
@with_pinned_cases(alpha=1, beta=1)
@given(case=cases(), alpha=st.integers(-2, 2), beta=st.integers(-2, 2))
def test_output_is_linear_in_values(kernel, device, case, alpha, beta):
    q, k, _ = case.qkv(device)
    g = case.generator(1)
    # Integers in [-8, 8]: alpha*V1 + beta*V2 is then exact in every dtype (|.| <= 32).
    v1, v2 = (torch.randint(-8, 9, (*case.lead, case.s, case.ev), generator=g).to(torch.float64)
              for _ in range(2))
    v3 = alpha * v1 + beta * v2
    outs = [to_float64(kernel(q, k, on(v, case.dtype, device))) for v in (v1, v2, v3)]
    bounds = softmax_bounds(q, k)
    bound = (output_bound(bounds, v3) + abs(alpha) * output_bound(bounds, v1)
             + abs(beta) * output_bound(bounds, v2))
    assert_within(outs[2], alpha * outs[0] + beta * outs[1], bound, what="A(alpha V1 + beta V2)",
                  reference="alpha A(V1) + beta A(V2)")


@clause("ATTN-QUERY-PERMUTATION")
@with_pinned_cases()
@given(case=cases())
def test_permuting_queries_permutes_outputs(kernel, device, case):
    q, k, v = case.qkv(device)
    perm = torch.randperm(case.l, generator=case.generator(1))
    out = to_float64(kernel(q, k, v))
    permuted = to_float64(kernel(q[..., perm.to(device), :].contiguous(), k, v))
    bound = output_bound(softmax_bounds(q, k, v), v)[..., perm, :]
    assert_within(permuted, out[..., perm, :], 2 * bound, what="A(Pq)", reference="P A(q)",
                  note=f"; permutation {perm.tolist()}")


@clause("ATTN-KEY-PERMUTATION")
@with_pinned_cases()
@given(case=cases())
def test_permuting_key_value_pairs_changes_nothing(kernel, device, case):
    q, k, v = case.qkv(device)
    perm = torch.randperm(case.s, generator=case.generator(1)).to(device)
    out = to_float64(kernel(q, k, v))
    permuted = to_float64(kernel(q, k[..., perm, :].contiguous(), v[..., perm, :].contiguous()))
    bound = output_bound(softmax_bounds(q, k, v), v)
    assert_within(permuted, out, 2 * bound, what="A(q, Pk, Pv)", reference="A(q, k, v)",
                  note=f"; permutation {perm.tolist()}")


@clause("ATTN-SLICE-INDEPENDENT")
@with_pinned_cases(n_lead=1)
@with_pinned_cases()
@given(case=cases(min_lead=1, max_lead=2))
def test_batch_and_head_slices_are_independent(kernel, device, case):
    q, k, v = case.qkv(device)
    g = case.generator(1)
    # The slice keeps its leading dims (size 1), so a kernel that accepts only 4-D inputs computes it too.
    index = tuple(slice(i, i + 1) for i in (int(torch.randint(n, (1,), generator=g)) for n in case.lead))
    alone = to_float64(kernel(q[index], k[index], v[index]))
    together = to_float64(kernel(q, k, v))[index]
    # Fresh inputs everywhere except the chosen slice.
    others = [t.clone() for t in case.qkv(device, stream=2)]
    for fresh, kept in zip(others, (q, k, v)):
        fresh[index] = kept[index]
    beside_others = to_float64(kernel(*others))[index]
    bound = 2 * output_bound(softmax_bounds(q[index], k[index], v[index]), v[index])
    where = tuple(i.start for i in index)
    assert_within(together, alone, bound, what=f"A(q, k, v)[{where}]", reference="A(q[b], k[b], v[b])")
    assert_within(beside_others, alone, bound, what=f"slice {where} computed beside other inputs",
                  reference="A(q[b], k[b], v[b])")
