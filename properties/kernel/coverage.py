"""What each kernel clause actually ran: problems run, problems the kernel declined (reasons grouped), the largest
L, S and E reached, the dtypes — so that "passed" never hides "barely tested".

The plugin wraps each kernel-level test (``counting``): every Hypothesis example (explicit or drawn) is counted as
*run* when the kernel ran on it to the end (passed or failed), as *declined* when the kernel declined it (the guard
records the reason, properties/kernel/limits.py, and rejects the example). A clause whose every example was declined
is skipped with the kernel's reasons, never passed; after ``GIVE_UP`` drawn examples declined without one run it
stops drawing. Explicit (pinned) examples are first fitted into the kernel's limits (``Limits.fit``).
``properties/plugin/report.py`` puts each test's record in ``--report-json`` and the terminal summary.
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass, field

import pytest

__all__ = ["Coverage", "counting", "ran", "declined", "compared", "specialisation", "length_class", "record_of",
           "GIVE_UP", "declined_summary"]

GIVE_UP = 25   # drawn examples declined, none run: every problem this clause poses lies outside the kernel's limits


@dataclass
class Coverage:
    kernel: str = ""
    device: str = ""
    run: int = 0
    declined: int = 0
    reasons: Counter = field(default_factory=Counter)
    max_l: int = 0
    max_s: int = 0
    max_e: int = 0
    dtypes: set = field(default_factory=set)
    specialisations: set = field(default_factory=set)   # ``specialisation`` of every call that returned
    comparisons: Counter = field(default_factory=Counter)   # how two calls were compared (core/repeats.py)

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "device": self.device, "run": self.run, "declined": self.declined, "reasons": dict(self.reasons.most_common()),
                "max_l": self.max_l, "max_s": self.max_s, "max_e": self.max_e, "dtypes": sorted(self.dtypes),
                "specialisations": sorted(self.specialisations),
                **({"comparisons": dict(self.comparisons)} if self.comparisons else {})}


_records: dict[str, Coverage] = {}
_current: list = [None]                       # the Coverage of the test now running
_example: dict = {"calls": [], "decline": None}


def length_class(n: int) -> str:
    """How a compiler specialises a length: Triton compiles an integer argument anew for 1, a multiple of 16 and any
    other value (triton.jit's default specialisation); the suite uses the same classes for every kernel."""
    return "1" if n == 1 else "16k" if n % 16 == 0 else "n"


def specialisation(dtype, e: int, ev: int, causal: bool, l: int, s: int) -> str:
    """The compile-relevant parameters of a call: what a compiled kernel (Triton, a template library) may build a
    separate binary for: the dtype, the head sizes, the causal flag and the lengths' classes (``length_class``)."""
    return (f"{str(dtype).removeprefix('torch.')} E={e} Ev={ev}{' causal' if causal else ''} "
            f"L:{length_class(l)} S:{length_class(s)}")


def ran(l: int, s: int, e: int, dtype, ev: int | None = None, causal: bool = False) -> None:
    """A kernel call of the running example returned (the guard calls this)."""
    if _current[0] is not None:
        _example["calls"].append((l, s, e, str(dtype).removeprefix("torch.")))
        _current[0].specialisations.add(specialisation(dtype, e, e if ev is None else ev, causal, l, s))


def declined(reason: str) -> None:
    """The kernel declined the running example (the guard calls this, then rejects the example)."""
    if _current[0] is not None and _example["decline"] is None:
        _example["decline"] = reason


# How a clause compared two calls (properties/kernel/repeats.py).
BITWISE = "bitwise"
WITHIN_BOUND = "within the derived bound (repeated calls differed)"


def compared(how: str) -> None:
    """The running example compared two calls ``how`` (bitwise, or within the bound: properties/core/repeats.py)."""
    if _current[0] is not None:
        _current[0].comparisons[how] += 1


def record_of(nodeid: str) -> dict | None:
    record = _records.get(nodeid)
    return record.as_dict() if record is not None else None


def declined_summary(record: Coverage | dict) -> str:
    """'3 declined: NotImplementedError: ... (2); ...' — the reasons grouped, most frequent first."""
    reasons = record.reasons if isinstance(record, Coverage) else Counter(record["reasons"])
    n = record.declined if isinstance(record, Coverage) else record["declined"]
    grouped = "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common(3))
    more = f"; and {len(reasons) - 3} other reasons" if len(reasons) > 3 else ""
    return f"{n} declined: {grouped}{more}"


def _commit(record: Coverage) -> None:
    calls = _example["calls"]
    if _example["decline"] is not None:
        record.declined += 1
        record.reasons[_example["decline"]] += 1
    elif calls:
        record.run += 1
        for l, s, e, dtype in calls:
            record.max_l, record.max_s, record.max_e = max(record.max_l, l), max(record.max_s, s), max(record.max_e, e)
            record.dtypes.add(dtype)


def _counted(inner, record: Coverage, kernel_name: str, explicit: int):
    """``inner`` counting its examples; an explicit example is first fitted into the kernel's limits (the draws
    already are: core/strategies.py), so that the pinned shapes run on a kernel with limits too."""
    @functools.wraps(inner)
    def example(*args, **kwargs):
        _example["calls"], _example["decline"] = [], None
        fitted = {name: fit(value) for name, value in kwargs.items()}
        try:
            return inner(*args, **fitted)
        except AssertionError as exc:
            changed = [f"{name}={fitted[name]!r}" for name in kwargs if fitted[name] is not kwargs[name]]
            if changed:
                exc.add_note(f"(the kernel's limits fitted this example: {', '.join(changed)})")
            raise
        finally:
            _commit(record)
            if _example["decline"] is not None and not record.run and record.declined >= explicit + GIVE_UP:
                pytest.skip(_all_declined(kernel_name, record))
    return example


def fit(value):
    """``value`` inside the limits of the kernel under test (``Limits.fit``), or ``value`` itself."""
    from properties.kernel.limits import active
    limits = active()
    return limits.fit(value) if limits else value


def _all_declined(kernel_name: str, record: Coverage) -> str:
    return (f"kernel {kernel_name} declined every problem drawn for this clause (not covered): "
            f"{declined_summary(record)}")


@contextlib.contextmanager
def counting(item, kernel_name: str, device: str):
    """Count the examples of ``item`` (a Hypothesis test); skip it if the kernel declined every one."""
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    if handle is None:
        yield
        return
    from hypothesis.errors import FailedHealthCheck, Unsatisfiable
    record = _records[item.nodeid] = Coverage(kernel=kernel_name, device=str(device))
    inner = handle.inner_test
    explicit = len(getattr(inner, "hypothesis_explicit_examples", ()))
    handle.inner_test = _counted(inner, record, kernel_name, explicit)
    _current[0] = record
    try:
        yield record
    except (Unsatisfiable, FailedHealthCheck):
        if record.declined and not record.run:
            pytest.skip(_all_declined(kernel_name, record))
        raise
    else:
        if record.declined and not record.run:
            pytest.skip(_all_declined(kernel_name, record))
    finally:
        handle.inner_test = inner
        _current[0] = None


# ------------------------------------------------------------------------------------------------ reports
def _dims(c: dict) -> str:
    return f"L <= {c['max_l']}, S <= {c['max_s']}, E <= {c['max_e']}; {', '.join(c['dtypes']) or 'no dtype'}"


def summary_lines(rows: list[dict], verbose: bool = False) -> list[str]:
    """The terminal summary of ``rows`` ({clauses, status, message, coverage} per kernel-level test): one line per
    kernel and device, then one per clause that was declined, skipped for declines, or run on fewer than THIN
    problems (every clause with ``verbose``)."""
    groups: dict[tuple, list] = {}
    for row in rows:
        c = row.get("coverage")
        if c:
            groups.setdefault((c["kernel"], c["device"]), []).append(row)
    lines = []
    for (kernel, device), group in groups.items():
        cs = [r["coverage"] for r in group]
        run, declined = sum(c["run"] for c in cs), sum(c["declined"] for c in cs)
        top = {key: max(c[key] for c in cs) for key in ("max_l", "max_s", "max_e")}
        dtypes = sorted({d for c in cs for d in c["dtypes"]})
        compiled = len({k for c in cs for k in c.get("specialisations", ())})
        lines.append(f"kernel {kernel} on {device}: {len(group)} tests, {run} problems run, "
                     f"{declined or 'none'} declined; largest {_dims({**top, 'dtypes': dtypes})}; "
                     f"{compiled} specialisations (dtype, E, Ev, causal, L and S classes: 1, 16k, other)")
        for row in group:
            c = row["coverage"]
            if not (verbose or c["declined"] or c["run"] < THIN or _not_bitwise(c)):
                continue
            if row["status"] == "skipped" and not c["run"]:
                what = row.get("message") or declined_summary(c)
            else:
                what = f"{c['run']} run ({_dims(c)})" + (f", {declined_summary(c)}" if c["declined"] else "")
            if c.get("comparisons"):
                what += "; compared " + ", ".join(f"{how}: {n}" for how, n in c["comparisons"].items())
            lines.append(f"  {', '.join(row['clauses'])} [{row['status']}]: {what}")
    return lines


def _not_bitwise(c: dict) -> bool:
    return bool(c.get("comparisons", {}).get(WITHIN_BOUND))


THIN = 3   # a clause run on fewer problems than this is listed even when it passed
