"""When the float64 twin departs and the model does not (SPEC.md, "Models": precision of the comparisons).

The clauses that compare two evaluations of one model run on its float64 twin, where a defect of a percent stands
far above rounding. Some correct models are not correct in float64, a precision nobody ships them in: Hugging Face's
eager attention (Llama, Gemma 2) and Bloom's and MPT's add ``finfo(float64).min`` to masked scores and take their
softmax in float32, where that minimum is -inf; a fully masked row (a left-padded query, a padded query outside a
sliding window) turns into NaN, which the next layer multiplies by a zero weight, and 0 x NaN reaches the real
positions. The twin then fails the clause for its own departure.

``twin_fallback`` wraps such a clause: it watches the twin while the clause runs (every output and gradient the
clause computes passes ``observe``); when the clause fails on the twin *and* the twin departed — a non-finite value
in one of its outputs, or an exception its own code raised — the clause runs again on the same example on the model
as built, in its own precision (``mut.native``, with the tolerance of properties/model/precision.py). That verdict
stands: a pass carries a note naming the twin's departure (a warning, and the report's ``note``), a failure says
that it was found in the model's own precision and why. A twin that fails a clause without departing is a finding.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from contextvars import ContextVar

import torch
from hypothesis.errors import UnsatisfiedAssumption

from properties.model.precision import precision_of

__all__ = ["twin_fallback", "observe", "add_note", "pop_notes", "pop_precision", "TwinDeparture", "ON_TWIN", "OWN",
           "NOT_CHECKED", "ISLANDS"]

_WATCHED: ContextVar[tuple | None] = ContextVar("twin_watched", default=None)   # (twin subject, departures list)
_NOTES: list[str] = []   # notes of the test being run, read by the report (properties/plugin/report.py)
_RAN: list[str] = []     # where each example of the test being run compared: ON_TWIN, or OWN + the reason
ON_TWIN = "float64 twin"
OWN = "own precision"
NOT_CHECKED = "not checked: "   # a note naming what the clause could not check (the report's summary lists them)
ISLANDS = "float32 islands (allowed): "   # a note naming the modules a float64 twin computes in float32 (summary too)


class TwinDeparture(UserWarning):
    """A clause ran in the model's own precision because its float64 twin departs."""


def observe(subject, value, what: str) -> None:
    """Record a departure when ``subject`` is the twin being watched and ``value`` (a tensor) is not finite."""
    watched = _WATCHED.get()
    if watched is None or subject is not watched[0] or not torch.is_tensor(value) or not value.is_floating_point():
        return
    if not torch.isfinite(value.detach()).all():
        watched[1].append(f"{'NaN' if torch.isnan(value.detach()).any() else 'inf'} in its {what}")


def pop_precision() -> str:
    """Where the test just run compared (cleared): ON_TWIN (with "(float32 inside)" when the twin computes in
    float32 somewhere, and is held to float32's tolerance), "own precision: REASON" when an example fell back or the
    model has no twin, "" for a clause that does not compare on the twin."""
    ran = list(dict.fromkeys(_RAN))
    _RAN.clear()
    own = [r for r in ran if not r.startswith(ON_TWIN)]
    return own[0] if own else ran[0] if ran else ""


def add_note(note: str) -> None:
    """A note on the test being run, for its report record (``note``) and the summary (NOT_CHECKED notes)."""
    _NOTES.append(note)


def pop_notes() -> list[str]:
    """The notes of the test just run (each once), cleared."""
    notes = list(dict.fromkeys(_NOTES))
    _NOTES.clear()
    return notes


class _Recorded:
    """st.data() that records its draws, so that a second run can replay them."""

    def __init__(self, data):
        self.data, self.values = data, []

    def draw(self, strategy, label=None):
        self.values.append(self.data.draw(strategy, label=label))
        return self.values[-1]

    def __repr__(self):
        return repr(self.data)


class _Replayed:
    def __init__(self, values):
        self.values = iter(values)

    def draw(self, strategy, label=None):
        return next(self.values)


def _refusal(note: str) -> str:
    """Why there is no twin, shortly: "the twin is refused (RuntimeError)", or the subject has no module."""
    if "does not run in float64" in note:
        return "the twin is refused (" + note.split("(", 1)[1].split(")", 1)[0] + ")"
    return note.split(":")[0] if note else "no float64 twin"


def twin_fallback(test):
    """Decorator (innermost, on a model clause taking ``mut`` and optionally ``data``): the fallback above.
    properties.model.checks.model_property applies it; a clause with settings of its own stacks it itself."""
    @functools.wraps(test)
    def run(mut, *args, **kwargs):
        if mut.precise is mut.native:
            _RAN.append(f"{OWN}: {_refusal(mut.precise_note)}")
            return test(mut, *args, **kwargs)
        data = kwargs.get("data")
        if data is not None:
            kwargs["data"] = recorded = _Recorded(data)
        departures: list[str] = []
        token = _WATCHED.set((mut.precise, departures))
        try:
            result = test(mut, *args, **kwargs)
            inside = precision_of(mut.precise)   # a twin that computes in float32 inside is held to float32's bound
            _RAN.append(ON_TWIN + (f" ({str(inside.compute_dtype).removeprefix('torch.')} inside)"
                                   if inside is not None and inside.own else ""))
            return result
        except (UnsatisfiedAssumption, KeyError):   # rejected examples and bad pins are not verdicts
            raise
        except Exception as exc:
            if not departures and isinstance(exc, AssertionError):
                raise
            if not departures:   # the twin's own code raised: a departure when the model as built runs
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                departures.append(f"it raises {type(exc).__name__}: {first}")
            failure = exc
        finally:
            _WATCHED.reset(token)
        departure = "; ".join(dict.fromkeys(departures))
        if data is not None:
            kwargs["data"] = _Replayed(recorded.values)
        native = dataclasses.replace(mut, precise=mut.native,
                                     precise_note=f"the float64 twin departs ({departure})")
        _RAN.append(f"{OWN}: the twin departs ({departure})")
        try:
            test(native, *args, **kwargs)
        except AssertionError as exc:
            raise AssertionError(f"{exc} [in the model's own precision: its float64 twin departs ({departure}) and "
                                 f"failed with {type(failure).__name__}]") from exc
        precision = precision_of(mut.native)
        dtype = str(precision.compute_dtype).removeprefix("torch.") if precision is not None else "its dtype"
        note = f"ran in the model's own precision ({dtype}): its float64 twin departs ({departure})"
        _NOTES.append(note)
        warnings.warn(note, TwinDeparture)
    return run
