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

from properties.core.assertions import assert_all, assert_within, fmt
from properties.core.oracle import expand_kv_heads, to_float64
from properties.core.statistics import FALSE_ALARM, hoeffding_halfwidth
from properties.core.strategies import identity_values
from properties.core.watchdog import cause, raised, user_call
from properties.core.tolerance import (SoftmaxBounds, evaluation_error, gamma, output_bound, softmax_bounds,
                                       unit_roundoff)

__all__ = ["KernelContractError", "GuardedKernel", "describe_call", "check_output", "check_against_oracle",
           "check_dropout_rate"]


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


def check_output(name: str, out, query, value, call: str, nan_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The output contract of every kernel API: a tensor of shape (*query.shape[:-1], value's last dim), the
    query's dtype and device, finite except at ``nan_rows`` (bool, query shape without its last dim)."""
    __tracebackhide__ = True
    if not isinstance(out, torch.Tensor):
        raise KernelContractError(f"kernel {name} returned {type(out).__name__}, not a tensor, in {call}")
    expected = (*query.shape[:-1], value.shape[-1])
    if tuple(out.shape) != expected:
        raise KernelContractError(f"output shape {tuple(out.shape)} != expected {expected} "
                                  f"(query's leading dims, value's last dim) in {call}")
    if out.dtype != query.dtype:
        raise KernelContractError(f"output dtype {out.dtype} != query dtype {query.dtype} in {call}")
    if out.device != query.device:
        raise KernelContractError(f"output device {out.device} != query device {query.device} in {call}")
    finite = torch.isfinite(out)
    if nan_rows is not None:
        finite = finite | nan_rows.to(out.device)[..., None]
    assert_all(finite.cpu(), out.cpu(), what=f"output is finite (kernel {name})", note=f" in {call}")
    return out


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
            with user_call(self.plugin, call):
                out = self.fn(query, key, value, **kwargs)
        except NotImplementedError as exc:
            if kwargs.get("dropout_p", 0.0):   # dropout is optional: a kernel may declare it unsupported
                import pytest
                pytest.skip(f"kernel {self.name} raises NotImplementedError for dropout_p > 0 ({exc}): "
                            f"the dropout clauses do not apply")
            raise KernelContractError(f"kernel {self.name} raised NotImplementedError: {exc}\n  in {call}") from exc
        except Exception as exc:  # any failure of user code is a finding, not a crash of the suite
            raise KernelContractError(f"kernel {self.name} raised {raised(exc)}\n  in {call}") from cause(exc)
        return check_output(self.name, out, query, value, call, nan_rows)

    @property
    def plugin(self) -> str:
        """How the watchdog names it (properties/core/watchdog.py)."""
        return f"kernel {self.name}"

    def weights(self, query, key, **kwargs) -> torch.Tensor:
        """The kernel's attention weights: its output for V = I_S (attention is linear in V)."""
        __tracebackhide__ = True
        value = identity_values(tuple(key.shape[:-2]), key.shape[-2], key.dtype, key.device)
        return self(query, key, value, **kwargs)

    def rejects_keyword(self, keyword: str, query, key, value, **kwargs) -> bool:
        """True if the kernel raises TypeError naming ``keyword`` (an optional feature it lacks)."""
        try:
            with user_call(self.plugin, lambda: describe_call(query, key, value, kwargs)):
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
    mask = contract.get("attn_mask")
    float_mask = mask is not None and mask.dtype != torch.bool
    may_be_nan = fully_masked in NON_FINITE_CONVENTIONS or (fully_masked == "mean" and float_mask)
    out = kernel(query, key, value, nan_rows=no_key if may_be_nan else None, **contract)
    actual = to_float64(out)
    if fully_masked != "zeros" and bool(no_key.any()):
        if fully_masked == "nan":
            assert_all(torch.isnan(actual[no_key]), actual[no_key],
                       what="queries with no admissible key output NaN (--fully-masked nan)")
        elif fully_masked == "mean":
            # a user's own all −inf float row cannot become finite scores: NaN there, else the mean
            nan_rows = torch.isnan(actual).any(-1) if float_mask else torch.zeros_like(actual[..., 0], dtype=torch.bool)
            check_fully_masked_mean(actual, value, no_key & ~nan_rows)
        actual = torch.where(no_key[..., None], bounds.reference.output, actual)
    assert_within(actual, bounds.reference.output, output_bound(bounds, value), what=what)
    return out, bounds


def check_dropout_rate(w: torch.Tensor, positive: torch.Tensor, p: float, note: str = "") -> None:
    """DROPOUT-RATE: ``w`` holds a kernel's weights over independent dropout draws (the draws on the first axis),
    ``positive`` marks the weights that are nonzero without dropout; the fraction of those that are 0 is p within
    Hoeffding's bound at false-alarm probability FALSE_ALARM."""
    __tracebackhide__ = True
    n = w.shape[0] * int(positive.sum())
    dropped = float((w[:, positive] == 0).sum()) / n
    halfwidth = hoeffding_halfwidth(n, 1.0, FALSE_ALARM)
    assert abs(dropped - p) <= halfwidth, (
        f"fraction of dropped weights = {fmt(dropped)}, dropout_p = {fmt(p)}: |difference| > {fmt(halfwidth)} "
        f"(Hoeffding, n = {n} weights, false-alarm probability <= {FALSE_ALARM:g}){note}")


# What a query with no admissible key may output (SPEC.md, MASK-FULLY-MASKED; --fully-masked): zeros (the
# default, PyTorch >= 2.5), NaN (the textbook softmax of an all −inf row), the mean of the values over all keys
# (an additive finfo.min mask: every score becomes finfo.min, the weights uniform; for a row that the caller's
# own float mask sets to −inf, NaN), or any value at all.
FULLY_MASKED_CONVENTIONS = ("zeros", "nan", "mean", "any")
NON_FINITE_CONVENTIONS = ("nan", "any")


def check_fully_masked_mean(actual: torch.Tensor, value: torch.Tensor, no_key: torch.Tensor) -> None:
    """Rows without an admissible key equal the mean of the values over all S keys: weights 1/S each within
    the softmax's evaluation error, the weighted sum within γ(S + 2) of Σ|w v|, plus underflow."""
    __tracebackhide__ = True
    v = to_float64(value)
    if v.dim() >= 3 and actual.dim() >= 3 and v.shape[-3] != actual.shape[-3]:
        v = expand_kv_heads(v, actual.shape[-3])
    s = v.shape[-2]
    u = unit_roundoff(value.dtype) + unit_roundoff(torch.float64)
    mean = torch.broadcast_to(v.mean(-2, keepdim=True), actual.shape)
    bound = torch.broadcast_to((evaluation_error(s, value.dtype) + gamma(s + 2, u)) * v.abs().mean(-2, keepdim=True)
                               + s * torch.finfo(value.dtype).tiny, actual.shape)
    rows = torch.broadcast_to(no_key.cpu(), actual.shape[:-1])
    assert_within(actual[rows], mean[rows], bound[rows], what="output of a query with no admissible key",
                  reference="mean of the values (--fully-masked mean)")


def backward_gradients(kernel, out, upstream, leaves: dict) -> dict:
    """Backpropagate ``upstream`` through a kernel's output; the gradients of ``leaves`` (name -> leaf), each of
    its leaf's shape. Skips when the kernel has no autograd (output without grad, NotImplementedError)."""
    import pytest
    if not out.requires_grad:
        pytest.skip(f"kernel {kernel.name}: its output does not require grad when its inputs do")
    try:
        with user_call(kernel.plugin, lambda: f"the backward pass of kernel {kernel.name}"):
            out.backward(upstream)
    except NotImplementedError as exc:
        pytest.skip(f"kernel {kernel.name}: backward raises NotImplementedError ({exc})")
    except Exception as exc:  # any failure of user code is a finding
        raise KernelContractError(f"kernel {kernel.name}: backward raised {raised(exc)}") from cause(exc)
    grads = {}
    for name, leaf in leaves.items():
        if leaf.grad is None:
            raise KernelContractError(f"kernel {kernel.name}: no gradient reached {name}, which requires grad")
        assert tuple(leaf.grad.shape) == tuple(leaf.shape), f"d{name} has shape {tuple(leaf.grad.shape)}"
        grads[name] = leaf.grad
    return grads
