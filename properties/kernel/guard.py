"""Calling the kernel under test: the guard, weight extraction, and the standard oracle check.

Every property calls the user's kernel through :class:`GuardedKernel`, which turns anything that breaks
the calling contract (an exception, an output of the wrong shape, dtype or device, NaN or Inf where none
is allowed) into an ``AssertionError``.  Pytest then reports it as a failure of the clause the property is
bound to, Hypothesis shrinks it like any other failure, and the rest of the suite keeps running.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from properties.core.assertions import assert_all, assert_within
from properties.core.oracle import to_float64
from properties.core.strategies import identity_values
from properties.core.tolerance import SoftmaxBounds, output_bound, softmax_bounds

__all__ = ["KernelContractError", "GuardedKernel", "describe_call",
           "check_against_oracle"]


class KernelContractError(AssertionError):
    """The kernel raised, or returned something the contract rules out."""


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype}{tuple(t.shape)}@{t.device}".replace("torch.", "")
    return repr(t)


def describe_call(query, key, value, kwargs) -> str:
    args = ", ".join([_describe(query), _describe(key), _describe(value)]
                     + [f"{k}={_describe(v)}" for k, v in kwargs.items()])
    return f"kernel({args})"


@dataclass(frozen=True, repr=False)
class GuardedKernel:
    """A kernel with the SDPA contract, checked on every call.  ``repr`` is its name, so Hypothesis'
    falsifying example reads ``kernel=math``."""

    name: str
    fn: Callable

    def __repr__(self) -> str:
        return self.name

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis' printer prefers this to __repr__
        printer.text(self.name)

    def __call__(self, query, key, value, *, nan_rows: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """``kwargs`` go to the kernel unchanged (only those given, so minimal signatures work);
        ``nan_rows`` (bool, query shape without E) marks queries allowed to come out NaN."""
        __tracebackhide__ = True
        call = describe_call(query, key, value, kwargs)
        try:
            out = self.fn(query, key, value, **kwargs)
        except Exception as exc:  # any failure of user code is a finding, not a crash of the suite
            raise KernelContractError(f"kernel {self.name} raised {type(exc).__name__}: {exc}\n"
                                      f"  in {call}") from exc
        if not isinstance(out, torch.Tensor):
            raise KernelContractError(f"kernel {self.name} returned {type(out).__name__}, not a tensor, "
                                      f"in {call}")
        expected = (*query.shape[:-1], value.shape[-1])
        if tuple(out.shape) != expected:
            raise KernelContractError(f"output shape {tuple(out.shape)} != expected {expected} "
                                      f"(query's leading dims and L, value's Ev) in {call}")
        if out.dtype != query.dtype:
            raise KernelContractError(f"output dtype {out.dtype} != query dtype {query.dtype} in {call}")
        if out.device != query.device:
            raise KernelContractError(f"output device {out.device} != query device {query.device} in {call}")
        finite = torch.isfinite(out)
        if nan_rows is not None:
            finite = finite | nan_rows.to(out.device)[..., None]
        assert_all(finite.cpu(), out.cpu(), what=f"output is finite (kernel {self.name})", note=f" in {call}")
        return out

    def weights(self, query, key, **kwargs) -> torch.Tensor:
        """The kernel's attention weights: its output for V = I_S (attention is linear in V)."""
        __tracebackhide__ = True
        value = identity_values(tuple(key.shape[:-2]), key.shape[-2], key.dtype, key.device)
        return self(query, key, value, **kwargs)

    def rejects_keyword(self, keyword: str, query, key, value, **kwargs) -> bool:
        """True if the kernel raises TypeError naming ``keyword`` (an optional feature it lacks)."""
        try:
            self.fn(query, key, value, **kwargs)
        except TypeError as exc:
            return keyword in str(exc)
        except Exception:
            return False
        return False


def check_against_oracle(kernel: GuardedKernel, query, key, value, *, fully_masked: str = "zeros",
                         causal_alignment: str = "top-left", what: str = "out",
                         **contract) -> tuple[torch.Tensor, SoftmaxBounds]:
    """Call the kernel with ``contract`` (its keyword arguments) and check ATTN-ORACLE's bound.  Queries
    without an admissible key must give zeros (exactly: their bound is 0) or, with
    ``fully_masked='nan'``, NaN.  Returns (output, bounds)."""
    __tracebackhide__ = True
    bounds = softmax_bounds(query, key, value, causal_alignment=causal_alignment, **contract)
    no_key = bounds.reference.no_key_rows
    out = kernel(query, key, value, nan_rows=no_key if fully_masked == "nan" else None, **contract)
    actual = to_float64(out)
    if fully_masked == "nan" and bool(no_key.any()):
        assert_all(torch.isnan(actual[no_key]), actual[no_key],
                   what="queries with no admissible key output NaN (--fully-masked nan)")
        actual = torch.where(no_key[..., None], bounds.reference.output, actual)
    assert_within(actual, bounds.reference.output, output_bound(bounds, value), what=what)
    return out, bounds
