"""What Hypothesis draws, and the tensors a drawn case seeds.

Hypothesis draws only structure: shapes, the dtype, flags, magnitudes and one integer seed.  Bulk
tensors come from a ``torch.Generator`` seeded with that integer, always on the CPU in float64 and then
rounded to the case's dtype and moved to the device, so a counterexample is a short, readable line such
as ``Case(lead=(), l=1, s=2, e=1, ev=1, dtype=torch.float32, seed=0)`` (properties/kernel/cases.py) and replays
identically on every device.  The dtypes drawn are the ones selected on the command line (``--dtype``);
``properties.plugin`` sets them with :func:`properties.core.dtypes.select_dtypes` before any test module is imported.
"""
from __future__ import annotations

import contextlib
import inspect

import math

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from properties.core.dtypes import dtype_supported, selected_dtypes
from zoo.config.options import DTYPES

__all__ = ["DTYPES", "derived_generator", "seeded_rng", "require_dtype", "PinnedData", "could_draw", "seeds", "gaussian", "on", "identity_values",
           "random_bool_mask", "scale_partial_sums", "rescale_keys", "huge_values", "REALISTIC_SCORE", "score_limit",
           "pinned_property", "required"]


def derived_generator(seed: int, stream: int = 0) -> torch.Generator:
    """The CPU generator of an example's ``stream``-th independent draw: the one seed formula of the suite."""
    return torch.Generator().manual_seed(seed * 1009 + stream)


seeds = st.integers(min_value=0, max_value=2**32 - 1)


def pinned_property(settings, drawn: dict, *pinned: dict):
    """Decorator: the stack that a family of properties shares, so that each test names only its clause:
    ``settings`` (a ``hypothesis.settings``), an ``@example(**p)`` for each ``p`` of ``pinned`` (run in that
    order, before anything drawn) and ``@given(**drawn)``."""
    def decorate(test):
        test = given(**drawn)(test)
        for p in reversed(pinned):
            test = example(**p)(test)
        return settings(test)
    return decorate


def required(value, reason: str):
    """``value``, once the test is skipped with ``reason`` where it is None (an option this run was not given)."""
    if value is None:
        pytest.skip(reason)
    return value


class PinnedData:
    """``st.data()`` in an ``@example``: each ``data.draw(strategy, label=L)`` in the test's body returns
    ``values[L]``, so the shapes a test draws inside its body are pinned as well as its arguments::

        @example(p=Tokens(...), data=PinnedData({"sample": 1, "position": 2}))

    A value the strategy could not have drawn there (:func:`could_draw`: outside an integer range that depends
    on the subject, say) rejects the example as ``assume`` does, so a pin never checks what the clause does not
    claim.  ``checks`` maps the name of a composite strategy to ``check(value, *args, **kwargs) -> bool``.  A
    callable value is a shape that depends on the subject: it is called with the strategy's arguments
    (``{"length": lambda low, high: high}`` pins ``st.integers(1, s.max_len)`` to max_len)."""

    def __init__(self, values: dict, checks: dict | None = None):
        self.values, self.checks = dict(values), dict(checks or {})

    def draw(self, strategy, label=None):
        if label not in self.values:
            raise KeyError(f"the pinned example gives no value for the draw {label!r} (it gives {sorted(self.values)})")
        value = self.values[label]
        if callable(value):
            args, kwargs = _arguments(strategy)
            value = value(*args, **kwargs)
        assume(could_draw(strategy, value, self.checks))
        return value

    def __repr__(self) -> str:
        def show(v):   # a subject-dependent value by its docstring: <max_len>
            return f"<{(v.__doc__ or v.__name__).strip()}>" if callable(v) else repr(v)
        return "PinnedData({" + ", ".join(f"{k!r}: {show(v)}" for k, v in self.values.items()) + "})"

    def _repr_pretty_(self, printer, cycle):  # one line in Hypothesis' report of a failing example
        printer.text(repr(self))


def _arguments(strategy) -> tuple[tuple, dict]:
    """The arguments a lazily built strategy (``st.integers(1, 8)``, a composite's call) was given."""
    if getattr(strategy, "function", None) is None:
        raise TypeError(f"a pinned value that depends on the strategy needs its arguments; {strategy!r} has none")
    return strategy._LazyStrategy__args, strategy._LazyStrategy__kwargs


def could_draw(strategy, value, checks: dict | None = None) -> bool:
    """Whether ``strategy`` could draw ``value``, as far as can be told: the bounds of ``integers``, the items of
    ``permutations`` and ``sampled_from``, every ``filter``, and ``checks[name]`` for a composite strategy of
    that name; anything else is taken on trust.  (It reads the arguments Hypothesis keeps in its lazily built
    strategies: private attributes of Hypothesis 6, read nowhere else in the suite.)"""
    if not all(t[1](value) for t in getattr(strategy, "_transformations", ()) if t[0] == "filter"):
        return False
    if isinstance(getattr(strategy, "elements", None), (tuple, list, range)):   # sampled_from
        return value in strategy.elements
    function = getattr(strategy, "function", None)          # a lazily built strategy: its function and arguments
    if function is None:
        return True
    args, kwargs = _arguments(strategy)
    name = function.__name__
    if name in (checks or {}):
        return bool(checks[name](value, *args, **kwargs))
    if name not in ("integers", "permutations"):
        return True
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if name == "integers":
        return ((a["min_value"] is None or value >= a["min_value"]) and
                (a["max_value"] is None or value <= a["max_value"]))
    return sorted(value) == sorted(a["values"])


def gaussian(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def on(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Round to ``dtype`` on the CPU (the same rounding on every device), then move."""
    return t.to(dtype).to(device)


def identity_values(lead: tuple[int, ...], s: int, dtype: torch.dtype, device) -> torch.Tensor:
    """V = I_S for every leading index: attention is linear in V, so the output is the weight matrix."""
    return torch.eye(s, dtype=dtype, device=device).expand(*lead, s, s).contiguous()


def random_bool_mask(generator: torch.Generator, shape, density: float, *, keep_one: bool = True):
    """Bernoulli(density) bool mask (True = may attend); ``keep_one`` gives every query a random key."""
    mask = torch.rand(*shape, generator=generator, dtype=torch.float64) < density
    if keep_one:
        pick = torch.randint(shape[-1], (*shape[:-1], 1), generator=generator)
        mask = mask | torch.zeros(shape, dtype=torch.bool).scatter(-1, pick, True)
    return mask


def _largest_partial_sum(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    return (abs(scale) * (q.abs() @ k.abs().transpose(-1, -2))).max().item()


# The largest scaled attention score (and partial sum of one) that real activations reach. Trained models keep
# scores within a few hundred; the unstable runs that QK-normalisation was introduced for (ViT-22B, Dehghani
# et al. 2023) saw attention logits grow to about 5·10^4 before diverging. 2^16 covers that; beyond it a
# model has already failed, so a kernel is not required to compute there.
REALISTIC_SCORE = 2.0 ** 16


def score_limit(dtype: torch.dtype) -> float:
    """Largest scaled partial sum drawn for ``dtype``: the realistic range, and at most finfo.max/4 (room for
    the max subtraction, a difference of two scores, and rounding)."""
    return min(REALISTIC_SCORE, torch.finfo(dtype).max / 4)


def scale_partial_sums(q: torch.Tensor, k: torch.Tensor, scale: float, target: float):
    """Rescale q and k (float64) by one factor so that max_ij scale * sum_e |q_ie k_je| == target.

    Every partial sum of every scaled score is then at most ``target`` in magnitude, whatever order a
    kernel adds in: the precondition of ATTN-LARGE-SCORES.  (Square roots taken apart: target/current
    itself may overflow.)"""
    current = _largest_partial_sum(q, k, scale)
    if current == 0:
        return q, k
    factor = math.sqrt(target) / math.sqrt(current)
    return q * factor, k * factor


def rescale_keys(q: torch.Tensor, k: torch.Tensor, scale: float, target: float, limit: float) -> torch.Tensor:
    """k (float64) rescaled so that max_ij scale * sum_e |q_ie k_je| reaches ``target`` against these
    queries (keys as large as the dtype allows, ATTN-LARGE-SCORES' precondition), with no entry above
    ``limit`` (small queries would otherwise need keys beyond the dtype's range)."""
    current, largest = _largest_partial_sum(q, k, scale), k.abs().max().item()
    if current == 0 or largest == 0:
        return k
    log_factor = min(math.log2(target) - math.log2(current), math.log2(limit) - math.log2(largest))
    half = log_factor / 2  # tiny keys may need a factor beyond float64's range; its square root is not
    return k * 2.0**half * 2.0**half


def huge_values(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of magnitude finfo(dtype).max / 4 with v's signs: as large as a convex combination can
    carry without rounding up to Inf."""
    return torch.where(v < 0, -1.0, 1.0).to(torch.float64) * (torch.finfo(dtype).max / 4)


def require_dtype(device: str, dtype: torch.dtype) -> None:
    """Discard an example whose dtype the device cannot compute in, or that the run did not select (an
    ``@example`` pinned in float16 is skipped under ``--dtype float32``)."""
    assume(dtype in selected_dtypes() and dtype_supported(device, dtype))


@contextlib.contextmanager
def seeded_rng(device: str, seed: int):
    """Dropout draws from the global generators: seed them from the case (so a failure replays) and
    restore them afterwards."""
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield
