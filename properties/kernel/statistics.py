"""Tail bounds for the statistical clauses: acceptance intervals with a stated false-alarm probability.

A statistical property fails a correct implementation with probability at most ``FALSE_ALARM`` per
Hypothesis example (over the randomness of the seeded draws); a run of n examples therefore false-alarms
with probability at most n * FALSE_ALARM (union bound), e.g. 1e-4 for the ``thorough`` profile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FALSE_ALARM", "Interval", "hoeffding_halfwidth", "weighted_chi_square_interval", "stacked_copies"]

FALSE_ALARM = 1e-6


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def __contains__(self, x: float) -> bool:
        return self.low <= x <= self.high

    def __str__(self) -> str:
        return f"[{self.low:.4g}, {self.high:.4g}]"


def hoeffding_halfwidth(n: int, value_range: float, alpha: float = FALSE_ALARM) -> float:
    """Mean of n independent variables each within an interval of length ``value_range``:
    P(|mean - E mean| >= h) <= 2 exp(-2 n h^2 / range^2) = alpha  (Hoeffding 1963, Theorem 2)."""
    return value_range * math.sqrt(math.log(2 / alpha) / (2 * n))


def weighted_chi_square_interval(weights: torch.Tensor, alpha: float = FALSE_ALARM) -> Interval:
    """Y = sum_m a_m Z_m^2 with a_m >= 0 and Z_m i.i.d. N(0, 1).  Laurent & Massart (2000, Lemma 1):
    P(Y - sum a >= 2 |a|_2 sqrt(t) + 2 |a|_inf t) <= e^-t and P(sum a - Y >= 2 |a|_2 sqrt(t)) <= e^-t;
    with t = ln(2 / alpha) the two tails together have probability <= alpha."""
    a = weights.to(torch.float64)
    t = math.log(2 / alpha)
    total, l2, linf = float(a.sum()), float(a.norm()), float(a.max())
    return Interval(max(total - 2 * l2 * math.sqrt(t), 0.0), total + 2 * l2 * math.sqrt(t) + 2 * linf * t)


def stacked_copies(n: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """n copies of each tensor, for n independent dropout draws in one call: on a new leading axis of a 2-D problem,
    else on its batch axis, copy-major (copy i of batch entry b at i * B + b), so that a 4-D problem stays 4-D."""
    return [t.expand(n, *t.shape).contiguous() if t.dim() == 2 else t.repeat(n, *[1] * (t.dim() - 1))
            for t in tensors]
