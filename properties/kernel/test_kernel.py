"""Clauses on the attention kernel as a function: shapes, oracle agreement, convexity, linearity,
permutations and independence of slices."""
from __future__ import annotations

import torch
from hypothesis import example, strategies as st

from properties import clause
from properties.core.assertions import assert_all, assert_within
from properties.core.strategies import require_dtype
from properties.kernel.guard import check_against_oracle
from properties.core.oracle import to_float64
from properties.core.strategies import on
from properties.kernel.problem_space import MASK_EXTRAS, SHAPES, VALUE_EXTRAS, Extra, Problem, Space
from properties.kernel.schedule import scheduled
from properties.core.tolerance import deciding_output_bound, evaluation_error, rounding_error, softmax_bounds


@clause("ATTN-SHAPE")
@scheduled(Space.of("ATTN-SHAPE", **SHAPES, group=True))
def test_output_shape_dtype_and_device(kernel, device, case):
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    out = kernel(q, k, v, **case.contract(device))  # the guard raises on the wrong shape, dtype or device; restated
    assert tuple(out.shape) == (*case.lead, case.l, case.ev), f"output shape {tuple(out.shape)}"
    assert out.dtype == case.dtype and out.device == q.device, f"output {out.dtype} on {out.device}"


# Precision at length (SPEC.md, "Tolerance model", step 6): small scores and non-negative values leave no
# cancellation to hide behind, so every rounding of a kernel's running state shows in its output. (Four classes at
# once: S long, bfloat16, positive values and a spread of 2^-8; the covering rows hold pairs of them.)
LONG_ROW = Problem(lead=(1, 1), l=3, s=1024, e=64, ev=64, dtype=torch.bfloat16, seed=0, values="positive",
                   extras=(("spread", -8),))
ORACLE = Space.of("ATTN-ORACLE", **SHAPES, group=True, attend=True, values=("gaussian", "positive", "shifted", "peaked"),
                  extras={**VALUE_EXTRAS, **MASK_EXTRAS}, long_rows=True)


@clause("ATTN-ORACLE")
@example(case=LONG_ROW)
@scheduled(ORACLE)
def test_output_agrees_with_float64_oracle(kernel, device, causal_alignment, fully_masked, case):
    """Every pair of classes: lengths against the tiles, head sizes, dtypes, leading dims, grouped heads, no mask,
    is_causal or a mask (rows without a key, masked tiles), and the values' distribution."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked,
                         **case.contract(device))


@clause("ATTN-CONVEX")
@scheduled(Space.of("ATTN-CONVEX", **SHAPES, values=("gaussian", "positive", "shifted"),
                    extras={**VALUE_EXTRAS, "equal_rows": Extra((False, True), st.booleans())}))
def test_outputs_are_convex_combinations_of_values(kernel, device, case):
    q, k, v = case.qkv(device)
    if case.equal_rows:  # every value row is the same vector c, so every output row must be c
        v = v[..., :1, :].expand_as(v).contiguous()
    out, v64 = to_float64(kernel(q, k, v)), to_float64(v)
    slack_factor = evaluation_error(case.s, case.dtype) + rounding_error(case.s, 2, case.dtype) * (
        1 + evaluation_error(case.s, case.dtype))
    slack = slack_factor * v64.abs().amax(dim=-2, keepdim=True)
    low, high = v64.amin(dim=-2, keepdim=True) - slack, v64.amax(dim=-2, keepdim=True) + slack
    assert_all(out >= low, out - low, what="out >= min over keys of v - slack (value: out - bound)")
    assert_all(out <= high, high - out, what="out <= max over keys of v + slack (value: bound - out)")


@clause("ATTN-LINEAR-V")
@scheduled(Space.of("ATTN-LINEAR-V", **SHAPES, group=True,
                    extras={"alpha": Extra((1, -2, 2, -1, 0), st.integers(-2, 2)),
                            "beta": Extra((1, 2, -1, 0, -2), st.integers(-2, 2))}))
def test_output_is_linear_in_values(kernel, device, case):
    q, k, _ = case.qkv(device)
    kw = case.contract(device)
    g = case.generator(1)
    # Integers in [-8, 8]: alpha*V1 + beta*V2 is then exact in every dtype (|.| <= 32).
    v1, v2 = (torch.randint(-8, 9, (*case.kv_lead, case.s, case.ev), generator=g).to(torch.float64)
              for _ in range(2))
    v3 = case.alpha * v1 + case.beta * v2
    outs = [to_float64(kernel(q, k, on(v, case.dtype, device), **kw)) for v in (v1, v2, v3)]
    bounds = softmax_bounds(q, k, enable_gqa=case.group > 1)
    combined = case.alpha * outs[0] + case.beta * outs[1]
    bound = deciding_output_bound(outs[2], combined, bounds, terms=[(v3, 1), (v1, abs(case.alpha)),
                                                                   (v2, abs(case.beta))])
    assert_within(outs[2], combined, bound, what="A(alpha V1 + beta V2)", reference="alpha A(V1) + beta A(V2)")


@clause("ATTN-QUERY-PERMUTATION")
@scheduled(Space.of("ATTN-QUERY-PERMUTATION", **SHAPES))
def test_permuting_queries_permutes_outputs(kernel, device, case):
    q, k, v = case.qkv(device)
    perm = torch.randperm(case.l, generator=case.generator(1))
    out = to_float64(kernel(q, k, v))
    permuted = to_float64(kernel(q[..., perm.to(device), :].contiguous(), k, v))
    bounds = softmax_bounds(q[..., perm.to(device), :], k, v)
    bound = deciding_output_bound(permuted, out[..., perm, :], bounds, v, factor=2)
    assert_within(permuted, out[..., perm, :], bound, what="A(Pq)", reference="P A(q)",
                  note=f"; permutation {perm.tolist()}")


@clause("ATTN-KEY-PERMUTATION")
@scheduled(Space.of("ATTN-KEY-PERMUTATION", **SHAPES))
def test_permuting_key_value_pairs_changes_nothing(kernel, device, case):
    q, k, v = case.qkv(device)
    perm = torch.randperm(case.s, generator=case.generator(1)).to(device)
    out = to_float64(kernel(q, k, v))
    permuted = to_float64(kernel(q, k[..., perm, :].contiguous(), v[..., perm, :].contiguous()))
    bound = deciding_output_bound(permuted, out, softmax_bounds(q, k, v), v, factor=2)
    assert_within(permuted, out, bound, what="A(q, Pk, Pv)", reference="A(q, k, v)",
                  note=f"; permutation {perm.tolist()}")


@clause("ATTN-SLICE-INDEPENDENT")
@scheduled(Space.of("ATTN-SLICE-INDEPENDENT", **{**SHAPES, "rank": ("1", "2")}))
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
    bounds = softmax_bounds(q[index], k[index], v[index])
    where = tuple(i.start for i in index)
    assert_within(together, alone, deciding_output_bound(together, alone, bounds, v[index], factor=2),
                  what=f"A(q, k, v)[{where}]", reference="A(q[b], k[b], v[b])")
    assert_within(beside_others, alone, deciding_output_bound(beside_others, alone, bounds, v[index], factor=2),
                  what=f"slice {where} computed beside other inputs", reference="A(q[b], k[b], v[b])")
