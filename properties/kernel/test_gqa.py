"""Grouped-query attention (enable_gqa): query head i reads key/value head i // (H / H_kv)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from properties import clause
from properties.core.strategies import require_dtype
from properties.kernel.guard import check_against_oracle
from properties.core.strategies import gaussian, on
from properties.kernel.cases import cases, with_pinned_cases


@pytest.fixture(scope="session")
def gqa_kernel(kernel, device):
    """The kernel, or a skip (with the reason) if it rejects the enable_gqa keyword: an optional feature."""
    q = torch.zeros(1, 2, 1, 1, device=device)
    kv = torch.zeros(1, 1, 1, 1, device=device)
    if kernel.rejects_keyword("enable_gqa", q, kv, kv, enable_gqa=True):
        pytest.skip(f"kernel {kernel.name} rejects the enable_gqa keyword (TypeError)")
    return kernel


@clause("GQA-HEADS")
@with_pinned_cases(n_lead=1, axes=1, kv_heads=2, group=2)  # the smallest shape where head i's kv head is observable
@given(case=cases(lead=1, axes=1), kv_heads=st.integers(1, 3), group=st.integers(1, 3))
def test_query_head_reads_its_group_kv_head(gqa_kernel, device, case, kv_heads, group):
    """case.lead holds the batch dims (one, or as many as the kernel's ranks leave beside the head axis); the query
    has kv_heads * group heads, key and value kv_heads."""
    require_dtype(device, case.dtype)
    if case.l * case.s > 4096:   # a kernel-scale draw: at most 2 x 2 heads, within the problem budget
        kv_heads, group = min(kv_heads, 2), min(group, 2)
    g = case.generator()
    h = kv_heads * group
    q = gaussian(g, *case.lead, h, case.l, case.e)
    k, v = gaussian(g, *case.lead, kv_heads, case.s, case.e), gaussian(g, *case.lead, kv_heads, case.s, case.ev)
    q, k, v = (on(t, case.dtype, device) for t in (q, k, v))
    check_against_oracle(gqa_kernel, q, k, v, enable_gqa=True, what=f"out (H={h}, H_kv={kv_heads})")
