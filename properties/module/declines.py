"""Declines at the module level: a part (or the kernel inside it) that declines a drawn problem in its own words,
by the rule of properties/kernel/limits.py (``decline_reason``: NotImplementedError, or a message saying the input
is not supported), has the example rejected, as the kernel level does, never failed. A module clause whose every
example was declined is skipped with the reasons (the plug-in wraps each module-level test in ``counting``); one
where some examples ran is judged on those.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest

from properties.kernel.limits import decline_reason

__all__ = ["reject_if_declined", "counting"]

_reasons: list[Counter | None] = [None]   # the declines of the module test now running (None outside one)


def reject_if_declined(exc: BaseException) -> None:
    """Reject the running example if ``exc`` declines it (its reason counted); return otherwise."""
    reason = decline_reason(exc)
    if reason is None or _reasons[0] is None:
        return
    from hypothesis import reject
    _reasons[0][reason] += 1
    reject()


@contextlib.contextmanager
def counting(subject: str):
    """Around one module-level test: the declines of its examples counted; every example declined is a skip."""
    from hypothesis.errors import FailedHealthCheck, Unsatisfiable
    reasons = _reasons[0] = Counter()
    try:
        yield reasons
    except (Unsatisfiable, FailedHealthCheck):
        if not reasons:
            raise
        grouped = "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common(3))
        pytest.skip(f"{subject} declined every example of this clause (not covered): {sum(reasons.values())} "
                    f"declined: {grouped}")
    finally:
        _reasons[0] = None
