"""ATTN-GRAD-GQA's bound against a backward computed as a fused kernel computes it (SPEC.md, ATTN-GRAD-GQA, "What
a fused backward does"): FlashAttention-2's Algorithm 2 in float32 for float16/bfloat16 inputs, the row log-sum-exp
saved by the forward, D = rowsum(dO ∘ O) from the output rounded to the input dtype, and dK, dV of a shared key/value
head accumulated over its query group in float32 and rounded once. Small cases, those where the bound once collapsed
on an H100 (one query, a bool mask, Ev != E): the clause's check passes such a backward, and still fails one whose
group sum is wrong.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from properties.core.dtypes import select_dtypes
from properties.kernel.test_gradients import GradCase, check_group_sums

F32 = torch.float32


def fused_backward(q, k, v, do, mask, scale: float, group: int) -> dict:
    """dK and dV of ``k``, ``v`` (kv heads; the query has ``group`` times as many), as FlashAttention-2 forms them."""
    q32, k32, v32, do32 = (t.to(F32) for t in (q, k, v, do))
    k32, v32 = (t.repeat_interleave(group, dim=1) for t in (k32, v32))
    scores = scale * q32 @ k32.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    row_max = scores.amax(-1, keepdim=True)
    admissible = torch.isfinite(row_max)
    shifted = torch.where(admissible, scores - row_max, torch.full_like(scores, -math.inf))
    lse = torch.where(admissible, row_max + torch.log(torch.exp(shifted).sum(-1, keepdim=True)),
                      torch.full_like(row_max, math.inf))        # no admissible key: +inf, so that P = 0
    p = torch.exp(scores - lse)
    out = (p @ v32).to(q.dtype)                                   # the forward's output, rounded once
    d = (do32 * out.to(F32)).sum(-1, keepdim=True)                # D from the rounded output
    d_s = p * (do32 @ v32.transpose(-1, -2) - d)
    d_k = scale * d_s.transpose(-1, -2) @ q32                     # per query head, float32
    d_v = p.transpose(-1, -2) @ do32

    def per_kv_head(t):                                           # the group summed in float32, rounded once
        return t.unflatten(1, (t.shape[1] // group, group)).sum(2).to(q.dtype)
    return {"key": per_kv_head(d_k), "value": per_kv_head(d_v)}


def _cases():
    for dtype, seed, (l, s, e, ev), kv_heads in itertools.product(
            (torch.bfloat16, torch.float16, torch.float32), range(3), ((1, 2, 8, 16), (1, 3, 4, 2), (2, 5, 8, 3)),
            (1, 2)):
        yield GradCase(1, kv_heads, 2, l, s, e, ev, dtype, "bool", False, None, False, seed)


def _check(case: GradCase, backward_fn) -> None:
    q, k, v, do, mask = case.tensors("cpu")
    scale = 1 / math.sqrt(case.e)
    shared = backward_fn(q, k, v, do, mask, scale, case.group)
    per_head = backward_fn(q, *(t.repeat_interleave(case.group, dim=1) for t in (k, v)), do, mask, scale, 1)
    check_group_sums(case, q, k, v, do, mask, shared, per_head, "top-left")


@pytest.fixture(autouse=True, scope="module")
def _all_dtypes():
    select_dtypes([torch.float32, torch.float64, torch.bfloat16, torch.float16])


def test_a_fused_backward_meets_the_grouped_bound_on_one_query_with_a_bool_mask():
    cases = list(_cases())
    for case in cases:
        _check(case, fused_backward)
    masks = [case.tensors("cpu")[4] for case in cases]
    assert any(bool((~m.any(-1)).any()) for m in masks) and any(bool(m.all()) for m in masks), \
        "the cases include a query with no admissible key and one that admits every key"


def test_the_grouped_bound_still_catches_a_group_sum_that_drops_a_head():
    def last_head_only(q, k, v, do, mask, scale, group):
        grads = fused_backward(q, k, v, do, mask, scale, group)
        if group == 1:
            return grads
        alone = fused_backward(q[:, group - 1::group], k, v, do[:, group - 1::group], mask, scale, 1)
        return alone   # the shared head's gradient from one head of its group
    for case in _cases():
        admits_a_key = bool(case.tensors("cpu")[4].any())   # else every gradient is 0, the bug's included
        if admits_a_key:
            with pytest.raises(AssertionError, match="of the shared heads"):
                _check(case, last_head_only)
        else:
            _check(case, last_head_only)


def test_the_bound_of_a_query_without_admissible_key_is_tiny_and_the_clause_leaves_it_to_the_mask_clauses():
    """The H100 case (one query, 2 keys, E = 8, Ev = 16, bfloat16, a bool mask, seed 2): the mask admits no key, so
    every weight, its bound, and every term of the gradient bound vanish (about 6e-38). A kernel that outputs anything but
    zeros there (cuDNN with a bool mask; here its stand-in) breaks MASK-FULLY-MASKED, not the group sum: with dO = 0
    on such queries, as the clause poses it, their rows contribute nothing to either side."""
    from properties.catalog.declining import cudnn_bool_mask_rows

    def autograd_backward(q, k, v, do, mask, scale, group):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        cudnn_bool_mask_rows(*leaves, attn_mask=mask, scale=scale, enable_gqa=group > 1).backward(do)
        return {"key": leaves[1].grad, "value": leaves[2].grad}

    case = GradCase(1, 1, 2, 1, 2, 8, 16, torch.bfloat16, "bool", False, None, False, 2)
    q, k, v, do, mask = case.tensors("cpu")
    assert not bool(mask.any())
    scale = 1 / math.sqrt(case.e)
    wide = [t.repeat_interleave(2, dim=1) for t in (k, v)]
    with pytest.raises(AssertionError, match=r"> bound \d\.\d+e-38"):
        check_group_sums(case, q, k, v, do, mask, autograd_backward(q, k, v, do, mask, scale, 2),
                         autograd_backward(q, *wide, do, mask, scale, 1), "top-left")
    do = do.masked_fill(~mask.any(-1)[..., None], 0)
    check_group_sums(case, q, k, v, do, mask, autograd_backward(q, k, v, do, mask, scale, 2),
                     autograd_backward(q, *wide, do, mask, scale, 1), "top-left")
