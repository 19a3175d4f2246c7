"""What the suite measures about a model's arithmetic, and the tolerance of comparisons in its own precision.

Kept apart from properties/model/checks.py, whose example counts are read from the Hypothesis profile when it is
imported: this module is imported early, by the plugin (through properties/model/subjects.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from properties.core.subject import Subject
from properties.core.tolerance import unit_roundoff

__all__ = ["OWN_ROUNDINGS", "OUTPUT_ROUNDINGS", "OWN_NOISE", "Precision", "Narrowing", "accumulation_roundoff",
           "allowed_dtypes", "register_precision", "precision_of"]

# Comparisons in a model's own precision (SPEC.md, "Models": tolerance). A model evaluated in float32 or
# bfloat16, or a float64 twin that computes in float32 inside (Hugging Face's eager softmax, GPT-Neo's q·k),
# cannot be held to 2^21 u of float64, and 2^21 u of its own dtype (12% of max|y| in float32) would let real
# leaks through. Its tolerance comes from what it measurably does instead: the coarsest floating dtype among
# its intermediate tensors (u_eff) and its noise ρ between two evaluations of the same input (nondeterministic
# kernels; nothing that changes batch, padding or positions, where a leak would pass for noise). Two
# arrangements of one correct computation (another batch, padding, a cache) differ by reordered sums, which
# accumulate in at least float32 (u_acc = min(u_eff, u(float32)): half-precision matmuls and reductions
# accumulate in float32), and by the final rounding to u_eff. Measured on correct zoo models: ≤ 2 u_acc·max|y|
# (float32), bitwise equal (bfloat16). The tolerance, relative to max|y|:
#     max(OWN_ROUNDINGS·u_acc + OUTPUT_ROUNDINGS·u_eff, OWN_NOISE·ρ)
# 16 u_acc leaves a factor 8 over the measured reordering; 4 u_eff is two roundings of each side's output.
# float32: 1.2e-6; bfloat16: 1.6e-2 (a 1% leak in float32, 5% in bfloat16 exceed it).
OWN_ROUNDINGS = 16
OUTPUT_ROUNDINGS = 4
OWN_NOISE = 16


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """u of the type sums accumulate in: the dtype's, or float32's for half precision."""
    return min(unit_roundoff(dtype), unit_roundoff(torch.float32))


def allowed_dtypes(declared: torch.dtype) -> tuple[torch.dtype, ...]:
    """The floating dtypes a model declared in ``declared`` may compute in: its own and wider ones, and float32 in a
    float64 model (deliberate float32 islands: transformers' rotary tables, softmax and RMSNorm statistics). 16-bit
    arithmetic inside a float32 or float64 model is never allowed (MODEL-PRECISION)."""
    floor = max(unit_roundoff(declared), unit_roundoff(torch.float32))
    return tuple(d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16) if unit_roundoff(d) <= floor)


@dataclass(frozen=True)
class Narrowing:
    """A module that computed in a floating dtype its model does not allow, or a float32 island of a float64 model:
    where (the module's qualified name and class), the first operation seen and the dtype."""
    module: str
    operation: str
    dtype: torch.dtype
    count: int = 1

    def describe(self) -> str:
        return (f"{self.module}: {self.operation} {'gives or reads' if self.count else ''} "
                f"{str(self.dtype).removeprefix('torch.')} ({self.count} operation{'s' if self.count != 1 else ''})")


@dataclass(frozen=True)
class Precision:
    """What the suite measured about a subject's arithmetic (properties/model/subjects.py). The bounds follow the
    dtype the model declares: ``compute_dtype`` is the coarsest dtype seen among those ``allowed_dtypes`` admits; a
    narrower one is a finding (``narrow``), never a reason to widen a bound."""
    compute_dtype: torch.dtype   # the coarsest allowed floating dtype among the forward pass's intermediate tensors
    noise: float                 # ρ: max |Δy| / max|y| between evaluations equal in exact arithmetic
    declared: torch.dtype | None = None         # the dtype of the model's floating parameters (or its output)
    narrow: tuple[Narrowing, ...] = ()          # modules computing in a dtype the declared one does not allow
    islands: tuple[Narrowing, ...] = ()         # float32 islands of a float64 model (allowed, reported)

    @property
    def own(self) -> bool:
        """True when comparisons are in the model's own precision (not a float64 computation)."""
        return self.compute_dtype != torch.float64

    @property
    def relative_tolerance(self) -> float:
        return max(OWN_ROUNDINGS * accumulation_roundoff(self.compute_dtype)
                   + OUTPUT_ROUNDINGS * unit_roundoff(self.compute_dtype), OWN_NOISE * self.noise)

    def describe(self) -> str:
        if not self.own:
            return "float64: tolerance 2^21 u max|y|"
        return (f"own precision ({str(self.compute_dtype).removeprefix('torch.')} inside, measured noise "
                f"{self.noise:.1e}): effects below {self.relative_tolerance:.1e}·max|y| are not detectable")


_PRECISION: dict[int, Precision] = {}


def register_precision(subject: Subject, precision: Precision) -> None:
    _PRECISION[id(subject)] = precision


def precision_of(subject: Subject | None) -> Precision | None:
    return _PRECISION.get(id(subject)) if subject is not None else None
