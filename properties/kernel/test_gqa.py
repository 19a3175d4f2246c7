"""Grouped-query attention (enable_gqa): query head i reads key/value head i // (H / H_kv)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from properties import clause
from properties.core.strategies import require_dtype
from properties.kernel.guard import check_against_oracle
from properties.core.strategies import gaussian, on
from properties.kernel.problem_space import SHAPES, Extra, Space
from properties.kernel.schedule import scheduled


@pytest.fixture(scope="session")
def gqa_kernel(kernel, device):
    """The kernel, or a skip (with the reason) if it rejects the enable_gqa keyword: an optional feature."""
    q = torch.zeros(1, 2, 1, 1, device=device)
    kv = torch.zeros(1, 1, 1, 1, device=device)
    if kernel.rejects_keyword("enable_gqa", q, kv, kv, enable_gqa=True):
        pytest.skip(f"kernel {kernel.name} rejects the enable_gqa keyword (TypeError)")
    return kernel


@clause("GQA-HEADS")
@scheduled(Space.of("GQA-HEADS", **{**SHAPES, "rank": ("1", "0")}, group=True, axes=1,
                    extras={"kv_heads": Extra((2, 1, 3), st.integers(1, 3))}))
def test_query_head_reads_its_group_kv_head(gqa_kernel, device, case):
    """case.lead holds the batch dims (one, or none); the test adds the head axis: the query has kv_heads * group
    heads, key and value kv_heads (group 1: enable_gqa with as many key/value heads as query heads)."""
    require_dtype(device, case.dtype)
    kv_heads, group = case.kv_heads, case.group
    if case.l * case.s > 4096:   # a long problem: at most 2 key/value heads
        kv_heads = min(kv_heads, 2)
    g = case.generator()
    h = kv_heads * group
    q = gaussian(g, *case.lead, h, case.l, case.e)
    k, v = gaussian(g, *case.lead, kv_heads, case.s, case.e), gaussian(g, *case.lead, kv_heads, case.s, case.ev)
    q, k, v = (on(t, case.dtype, device) for t in (q, k, v))
    check_against_oracle(gqa_kernel, q, k, v, enable_gqa=True, what=f"out (H={h}, H_kv={kv_heads})")
