"""Comparing two calls that must agree, bitwise where the kernel repeats bitwise (SPEC.md, "Repeats").

MASK-NO-INFLUENCE, CAUSAL-NO-FUTURE and DROPOUT-OFF compare a kernel's output with its output on other inputs that
must not change it. A kernel that sums in an order that varies from call to call (atomics, split-K) cannot be held
to bitwise equality there without being reported as a leak; a kernel whose identical calls do agree bitwise is held
to it, so that a leak of one ulp through a masked key is still a leak. The clause calls the kernel again on the same
inputs when the outputs differ: ``assert_unchanged`` compares bitwise where those repeats agree bitwise and within
the derived bound otherwise, recording which in the clause's coverage (properties/kernel/coverage.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from properties.core import evidence
from properties.kernel import coverage
from properties.kernel.coverage import BITWISE, WITHIN_BOUND
from properties.core.assertions import assert_identical, assert_within

__all__ = ["bitwise_equal", "assert_unchanged"]



def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values, NaN only where NaN (the sign of zero ignored, as ``==`` does)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


REPEATS = 8   # repeats of a call before it counts as bitwise repeatable (only after a bitwise difference)


def assert_unchanged(actual: torch.Tensor, expected: torch.Tensor, again: Callable[[], torch.Tensor],
                     select: Callable[[torch.Tensor], torch.Tensor], bound: Callable[[], torch.Tensor], *,
                     what: str, reference: str, note: str = "", subject: str = "", calls: tuple = ()) -> None:
    """select(actual) equals select(expected) bitwise, unless the call that gave ``expected`` does not repeat
    bitwise: ``again()`` reruns it (up to REPEATS times, only once the two differ); if a rerun differs from
    ``expected``, the comparison is within ``bound()`` instead (each output within the oracle's bound of the same
    float64 value, so the two within twice that bound). The coverage records which comparison decided."""
    __tracebackhide__ = True
    index = evidence.flat_index(actual.shape, select)
    if bitwise_equal(select(actual), select(expected)):
        coverage.compared(BITWISE)
        return
    # calls: the inputs of the call that gave ``expected`` and of the one that gave ``actual`` (--repro-dir)
    recorded = dict(subject=subject, device=str(actual.device), what=what, reference=reference, first=calls[0],
                    second=calls[-1], index_first=index, index_second=index) if calls else None
    if all(bitwise_equal(again(), expected) for _ in range(REPEATS)):
        coverage.compared(BITWISE)
        if recorded:
            evidence.record("two-calls", **recorded, bitwise=True)
        assert_identical(select(actual), select(expected), what=what, reference=reference,
                         note=f"{note} ({REPEATS} repeats of the first call agreed with it bitwise)")
        return
    coverage.compared(WITHIN_BOUND)
    within = bound()
    if recorded:
        evidence.record("two-calls", **recorded, bitwise=False, bound=within)
    assert_within(select(actual), select(expected), within, what=what, reference=reference,
                  note=f"{note} (two identical calls differed, so the comparison is within the bound, not bitwise)")
