"""Assertions whose failure messages give the observed and expected numbers and where they differ.

Every helper raises ``AssertionError`` with one line of the form
``max |out - oracle| = 3.1e-02 > bound 1.2e-03 at index (0, 1, 2, 0): out = 0.51, oracle = 0.54``
(plus how many entries are affected), so a failing property reads without a debugger.  Comparisons are
done in float64 on the CPU; NaN never satisfies a bound.
"""
from __future__ import annotations

import torch

__all__ = ["assert_within", "assert_identical", "assert_all", "fmt"]


def fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _f64(t) -> torch.Tensor:
    return torch.as_tensor(t).detach().to("cpu", torch.float64)


def _index(flat_index: int, shape) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tuple(shape))) if shape else ()


def assert_within(actual, expected, bound, *, what: str = "out", reference: str = "oracle",
                  note: str = "") -> None:
    """|actual - expected| <= bound everywhere (bound: scalar or broadcastable tensor)."""
    __tracebackhide__ = True  # pytest shows the property's line, not this helper's
    a, e = _f64(actual), _f64(expected)
    a, e = torch.broadcast_tensors(a, e)
    b = torch.broadcast_to(_f64(bound), a.shape)
    error = (a - e).abs()
    error = torch.where(torch.isnan(error), torch.full_like(error, torch.inf), error)
    outside = ~(error <= b)
    if not outside.any():
        return
    # Report the entry that exceeds its bound by the largest factor.
    excess = torch.where(outside, error / b.clamp_min(1e-300), torch.full_like(error, -1.0))
    i = int(excess.argmax())
    idx = _index(i, a.shape)
    flat_a, flat_e, flat_b, flat_err = a.reshape(-1), e.reshape(-1), b.reshape(-1), error.reshape(-1)
    scalar_bound = b.numel() <= 1 or bool((b == b.reshape(-1)[0]).all())
    head = (f"max |{what} - {reference}| = {fmt(float(error.max()))} > bound {fmt(float(flat_b[i]))}"
            if scalar_bound else
            f"|{what} - {reference}| = {fmt(float(flat_err[i]))} > bound {fmt(float(flat_b[i]))}")
    raise AssertionError(
        f"{head} at index {idx}: {what} = {fmt(float(flat_a[i]))}, {reference} = {fmt(float(flat_e[i]))} "
        f"({int(outside.sum())} of {a.numel()} entries outside the bound){note}")


def assert_identical(actual, expected, *, what: str = "out", reference: str = "expected",
                     note: str = "") -> None:
    """Bitwise equality (same values, NaN only where NaN)."""
    __tracebackhide__ = True
    a, e = _f64(actual), _f64(expected)
    a, e = torch.broadcast_tensors(a, e)
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    if bool(same.all()):
        return
    i = int((~same).reshape(-1).nonzero()[0])
    diff = (a - e).abs()
    diff = torch.where(same, torch.zeros_like(diff), diff)
    raise AssertionError(
        f"{what} differs from {reference}: first at index {_index(i, a.shape)}: {what} = "
        f"{fmt(float(a.reshape(-1)[i]))}, {reference} = {fmt(float(e.reshape(-1)[i]))} "
        f"({int((~same).sum())} of {a.numel()} entries differ, max |difference| = "
        f"{fmt(float(torch.nan_to_num(diff, nan=torch.inf).max()))}){note}")


def assert_all(condition: torch.Tensor, values: torch.Tensor, *, what: str, note: str = "") -> None:
    """Every entry of ``condition`` holds; otherwise report the first offending entry of ``values``."""
    __tracebackhide__ = True
    condition = torch.as_tensor(condition).detach().cpu()
    if bool(condition.all()):
        return
    values = torch.broadcast_to(_f64(values), condition.shape)
    i = int((~condition).reshape(-1).nonzero()[0])
    raise AssertionError(
        f"{what}: violated at index {_index(i, condition.shape)} (value {fmt(float(values.reshape(-1)[i]))}; "
        f"{int((~condition).sum())} of {condition.numel()} entries){note}")
