"""Calling a merge kernel (``--kernel-api merge``; SPEC.md, "Partial states and their merge"): the guard and the
plug-in's parametrization.

A merge kernel has FlashInfer's signature ``merge_state(v_a, s_a, v_b, s_b) -> (v, s)``: v (N, H, D) in any float
dtype, s (N, H) the LSE (float32, float64 for float64 values; base e or, with ``--lse-base 2``, 2), returning v in
v_a's dtype and s float32 or float64. Its many-state form ``merge_states(v (N, n, H, D), s (N, n, H)) -> (v, s)`` is
checked where the kernel object has a ``merge_states`` attribute, or else its module does. Every call goes through a
``MergeKernel``: an exception, a result that is not the pair (v, s), a wrong shape, dtype or device, a NaN or an
infinite output (except where a query without an admissible key may be NaN, ``nan_rows``) is an ``AssertionError``,
the failure of the clause; a decline (properties/kernel/limits.py's rule: NotImplementedError, an unsupported
message) rejects the example and is counted in the clause's coverage.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from properties.core.assertions import assert_all
from properties.core.declines import decline_reason
from properties.core.watchdog import cause, describe_args, raised, user_call
from properties.kernel import coverage
from properties.kernel.guard import KernelContractError, NamedKernel, check_lse, check_output

__all__ = ["MergeKernel", "resolve_merge_kernel", "merge_params", "FIXTURE", "ZOO_MERGE"]

FIXTURE = "merge_kernel"
ZOO_MERGE = "zoo.nn.partial:merge_state"   # what --kernel-api merge checks without --kernel


@dataclass(frozen=True, repr=False)
class MergeKernel(NamedKernel):
    """A merge kernel (``pairwise``: merge_state) and its many-state form (``many``: merge_states, or None), checked
    on every call; ``repr`` is its name."""

    name: str
    pairwise: Callable
    many: Callable | None = None

    def merge_state(self, v_a, s_a, v_b, s_b, *, nan_rows: torch.Tensor | None = None):
        """The merge of two states, checked: v of v_a's shape and dtype, s of s_a's shape (``nan_rows``: bool (N, H),
        rows whose v and s may be NaN)."""
        __tracebackhide__ = True
        return self._call(self.pairwise, "merge_state", (v_a, s_a, v_b, s_b), v_a, s_a, nan_rows, states=2)

    def merge_states(self, v, s, *, nan_rows: torch.Tensor | None = None):
        """The merge of the n states stacked on dim 1 (v (N, n, H, D), s (N, n, H)), checked."""
        __tracebackhide__ = True
        return self._call(self.many, "merge_states", (v, s), v[:, 0], s[:, 0], nan_rows, states=v.shape[1])

    def _call(self, fn, form: str, args, v_like, s_like, nan_rows, *, states: int):
        __tracebackhide__ = True
        call = describe_args(f"{form} of kernel {self.name}", args, {})
        try:
            with user_call(self.plugin, call):
                result = fn(*args)
        except Exception as exc:  # any failure of user code is a finding, unless it declines the problem
            reason = decline_reason(exc)
            if reason is None:
                raise KernelContractError(f"merge kernel {self.name} raised {raised(exc)}\n  in {call}") from cause(exc)
            _reject(reason, call)
        if not (isinstance(result, (tuple, list)) and len(result) == 2
                and all(isinstance(t, torch.Tensor) for t in result)):
            got = f"a {type(result).__name__} of {len(result)}" if isinstance(result, (tuple, list)) else \
                type(result).__name__
            raise KernelContractError(f"merge kernel {self.name} returned {got}, not the pair (v, s), in {call}")
        v, s = result
        allowed = torch.zeros(s_like.shape, dtype=torch.bool) if nan_rows is None else nan_rows.cpu()
        check_output(self.name, v, v_like, v_like, call, allowed)   # v_like's shape, dtype and device; finite
        check_lse(self.name, s, s_like.shape, s_like.device, call, what="merged s")
        s_cpu = s.detach().cpu()
        assert_all(~torch.isnan(s_cpu) & (s_cpu != torch.inf) | allowed, s_cpu,
                   what=f"merged s is a number below +inf (kernel {self.name})", note=f" in {call}")
        coverage.ran(v.shape[0], states, v.shape[-1], v.dtype)   # (rows, states, head size)
        return v, s


def _reject(reason: str, call: str):
    """A declined call: counted, and the example rejected (outside one, the clause skipped)."""
    from hypothesis import reject
    from hypothesis.control import currently_in_test_context
    coverage.declined(reason)
    if not currently_in_test_context():
        pytest.skip(f"{call} declined: {reason}")
    reject()


def resolve_merge_kernel(spec: str) -> MergeKernel:
    """``pkg.module:merge_state`` or ``path/to/file.py:merge_state`` -> a MergeKernel, with the many-state form the
    object or its module offers; raises zoo.runtime.plugins.PluginError for a spec that is not such a function."""
    from zoo.runtime.plugins import PluginError, load_object
    fn = load_object(spec)
    if not callable(fn):
        raise PluginError(f"kernel {spec!r} is not callable")
    try:
        inspect.signature(fn).bind(0, 0, 0, 0)
    except TypeError:
        raise PluginError(f"kernel {spec!r} does not take merge_state's arguments (v_a, s_a, v_b, s_b): its signature "
                          f"is {inspect.signature(fn)}") from None
    except ValueError:   # a builtin without a signature: left to its first call
        pass
    many = getattr(fn, "merge_states", None)
    if not callable(many):
        many = getattr(sys.modules.get(getattr(fn, "__module__", None) or ""), "merge_states", None)
    return MergeKernel(spec, fn, many if callable(many) and many is not fn else None)


def merge_params(specs, api: str) -> dict[str, list]:
    """The parametrization of ``merge_kernel`` for ``--kernel-api api`` and ``--kernel specs``: the merge kernels
    under ``merge`` (the zoo's without --kernel), else one entry skipped with the reason. Raises PluginError."""
    if api != "merge":
        return {FIXTURE: [pytest.param(None, id="merge", marks=pytest.mark.skip(
            reason="the merge clauses run with --kernel-api merge (a kernel with FlashInfer's merge_state "
                   "signature)"))]}
    return {FIXTURE: [pytest.param(resolve_merge_kernel(spec), id=spec) for spec in specs or [ZOO_MERGE]]}
