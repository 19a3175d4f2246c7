"""Grouped-query attention (enable_gqa): query head i reads key/value head i // (H / H_kv)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from properties import clause
from properties.harness import check_against_oracle, require_dtype
from properties.strategies import Case, cases, on, with_pinned_cases


@pytest.fixture(scope="session")
def gqa_kernel(kernel, device):
    """The kernel, or a skip (with the reason) if it rejects the enable_gqa keyword: an optional feature."""
    q = torch.zeros(1, 2, 1, 1, device=device)
    kv = torch.zeros(1, 1, 1, 1, device=device)
    if kernel.rejects_keyword("enable_gqa", q, kv, kv, enable_gqa=True):
        pytest.skip(f"kernel {kernel.name} rejects the enable_gqa keyword (TypeError)")
    return kernel


def _kv_heads(case: Case, divisor_index: int) -> int:
    divisors = [d for d in range(1, case.lead[1] + 1) if case.lead[1] % d == 0]
    return divisors[divisor_index % len(divisors)]


@clause("GQA-HEADS")
@with_pinned_cases(divisor_index=0)
@with_pinned_cases(divisor_index=1)
@given(case=cases(lead=2, max_dim=6), divisor_index=st.integers(0, 3))
def test_query_head_reads_its_group_kv_head(gqa_kernel, device, case, divisor_index):
    """divisor_index picks H_kv among the divisors of H (wrapping around)."""
    require_dtype(device, case.dtype)
    kv_heads = _kv_heads(case, divisor_index)
    q, _, _ = case.qkv64()
    g = case.generator(1)
    b = case.lead[0]
    k = torch.randn(b, kv_heads, case.s, case.e, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv_heads, case.s, case.ev, generator=g, dtype=torch.float64)
    q, k, v = (on(t, case.dtype, device) for t in (q, k, v))
    check_against_oracle(gqa_kernel, q, k, v, enable_gqa=True, what=f"out (H={case.lead[1]}, H_kv={kv_heads})")
