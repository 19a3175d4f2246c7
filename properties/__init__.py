"""The spec (SPEC.md) as executable Hypothesis property suites.

Every property test names the clause(s) it checks::

    from properties import clause

    @clause("ATTN-ROWSUM")
    @given(case=cases())
    def test_rows_sum_to_one(kernel, device, case): ...

An ID that SPEC.md does not define is an error when the test module is imported.
"""
from __future__ import annotations

import pytest

from properties.core.spec import load_clauses
from properties.core.subject import Subject  # the model contract: a --model factory may return one

__all__ = ["clause", "Subject"]


def clause(*ids: str):
    """Bind a property test to spec clauses (the pytest marker ``clause``)."""
    if not ids:
        raise ValueError("clause() needs at least one clause ID")
    known = load_clauses()
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise ValueError(f"unknown spec clause ID(s) {', '.join(unknown)}: not defined in properties/SPEC.md")
    return pytest.mark.clause(*ids)
