"""How a subject declines a problem, and what a decline does at every level.

A kernel, a part or a model **declines** a problem by raising ``NotImplementedError``, or a ``TypeError``,
``ValueError`` or ``RuntimeError`` whose message says the problem is unsupported in the words flash-attn, Triton
wrappers and PyTorch use ("not supported", "does not support", "only supports", "unsupported", "No available
kernel", ...), or a ``TypeError`` for an optional SDPA keyword its signature lacks (``enable_gqa``, ``scale``,
``dropout_p``, as before PyTorch 2.5 / 2.1). Any other exception (an IndexError, a CUDA error, a wrong shape) is a
failure. The kernel level learns a kernel's limits from its declines (properties/kernel/limits.py) and counts them
(properties/kernel/coverage.py). At the module and model levels a declined example is rejected, as at the kernel
level, never failed: a clause whose every example was declined is skipped with the reasons (the plug-in wraps each
module- and model-level test in ``counting``); one where some examples ran is judged on those; a test without
Hypothesis examples that meets a decline is skipped with it.
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter

import pytest


__all__ = ["DECLINE_WORDS", "OPTIONAL_KEYWORDS", "decline_reason", "declined_in", "counting"]

# How flash-attn, Triton wrappers and PyTorch word an unsupported problem (lower case, matched in the message).
DECLINE_WORDS = ("not support", "n't support", "unsupported", "only support", "no available kernel",
                 "not implemented")
# Python's own messages that contain those words and report a bug, not a decline.
NOT_A_DECLINE = ("unsupported operand type", "unsupported format", "not supported between instances")
# Keywords of optional SDPA features: a signature without one declines that feature (TypeError, unexpected keyword).
OPTIONAL_KEYWORDS = ("enable_gqa", "scale", "dropout_p")


def decline_reason(exc: BaseException, optional_keywords=OPTIONAL_KEYWORDS) -> str | None:
    """'Type: message' if ``exc`` declines the problem (see the module docstring), else None (a failure)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, NotImplementedError):
        return text
    if isinstance(exc, TypeError) and any(f"unexpected keyword argument '{kw}'" in str(exc) for kw in optional_keywords):
        return text
    if isinstance(exc, (TypeError, ValueError, RuntimeError)):
        message = str(exc).lower()
        if any(word in message for word in DECLINE_WORDS) and not any(bug in message for bug in NOT_A_DECLINE):
            return text
    return None


def declined_in(exc: BaseException) -> str | None:
    """The decline reason of ``exc`` or of an exception it was raised from (a clause that wraps the subject's error
    in its own AssertionError keeps it as the cause), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        reason = decline_reason(exc)
        if reason is not None:
            return reason
        exc = exc.__cause__
    return None


@contextlib.contextmanager
def counting(item, subject: str):
    """Around one module- or model-level test: an example whose exception is a decline (``declined_in``) is rejected
    and counted; every example declined, or a test without examples that meets a decline, is a skip."""
    from hypothesis.errors import FailedHealthCheck, Unsatisfiable
    reasons: Counter = Counter()
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    inner = getattr(handle, "inner_test", None)
    if inner is not None:
        @functools.wraps(inner)
        def rejecting(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except Exception as exc:
                reason = declined_in(exc)
                if reason is None:
                    raise
                from hypothesis import reject
                reasons[reason] += 1
                reject()
        handle.inner_test = rejecting
    try:
        yield reasons
    except (Unsatisfiable, FailedHealthCheck):
        if not reasons:
            raise
        grouped = "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common(3))
        pytest.skip(f"{subject} declined every example of this clause (not covered): {sum(reasons.values())} "
                    f"declined: {grouped}")
    except Exception as exc:
        reason = declined_in(exc)
        if reason is None:
            raise
        pytest.skip(f"{subject} declined this clause's problem (not covered): {reason}")
    finally:
        if inner is not None:
            handle.inner_test = inner
