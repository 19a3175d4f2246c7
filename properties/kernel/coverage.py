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
    schedule: object = None                             # a scheduled clause's Schedule (properties/kernel/schedule.py)
    row_status: dict = field(default_factory=dict)      # covering row -> run | failed | rejected | the decline reason
    failed_row: int | None = None
    drawn: list = field(default_factory=list)           # the classes of the drawn problems that ran

    @property
    def rows_run(self) -> int:
        return sum(status in ("run", "failed") for status in self.row_status.values())

    @property
    def rows_declined(self) -> int:
        return sum(status not in ("run", "failed", "rejected") for status in self.row_status.values())

    def pairs(self) -> dict | None:
        """The tuples of classes (pairs at the default profile) of a scheduled clause: covered (a row or a drawn
        problem holding it ran), declined (the kernel's limits rule it out, or it declined every row holding it),
        beyond the budget, not reached (its rows came after a failure); counts and lists."""
        schedule = self.schedule
        if schedule is None:
            return None
        from properties.kernel.covering import covered_by
        from properties.kernel.schedule import describe
        accepted = set(schedule.accepted)
        covered: set = set()
        for i, status in self.row_status.items():
            if status in ("run", "failed"):
                covered |= schedule.row_targets[i]
        for classes in self.drawn:
            covered |= covered_by(schedule.design, classes, schedule.strength) & accepted
        declined = dict(schedule.declined)
        for i, status in sorted(self.row_status.items()):
            if status not in ("run", "failed", "rejected"):
                for target in schedule.row_targets[i] - covered:
                    declined.setdefault(target, status)
        not_reached = accepted - covered - set(declined)
        rejected = {t for i, status in self.row_status.items() if status == "rejected"
                    for t in schedule.row_targets[i]} & not_reached
        return {"strength": schedule.strength, "covered": len(covered), "declined": len(declined),
                "beyond_budget": len(schedule.beyond_budget), "not_reached": len(not_reached),
                "rejected": len(rejected),
                "rows": len(schedule.rows), "rows_run": self.rows_run, "rows_declined": self.rows_declined,
                "covered_pairs": sorted(describe(t) for t in covered),
                "declined_pairs": [{"pair": describe(t), "reason": r} for t, r in sorted(declined.items())],
                "beyond_budget_pairs": sorted(describe(t) for t in schedule.beyond_budget),
                "not_reached_pairs": sorted(describe(t) for t in not_reached)}

    def as_dict(self) -> dict:
        pairs = self.pairs()
        return {"kernel": self.kernel, "device": self.device, "run": self.run, "declined": self.declined, "reasons": dict(self.reasons.most_common()),
                "max_l": self.max_l, "max_s": self.max_s, "max_e": self.max_e, "dtypes": sorted(self.dtypes),
                "specialisations": sorted(self.specialisations),
                **({"comparisons": dict(self.comparisons)} if self.comparisons else {}),
                **({"pairs": pairs} if pairs is not None else {})}


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


def declined(reason: str, by: str | None = None) -> None:
    """A kernel declined the running example (the guard calls this, then rejects the example): the kernel under test,
    or ``by``, another kernel the clause calls (a reference kernel), whose name the reason then carries."""
    if _current[0] is not None and _example["decline"] is None:
        other = by is not None and by != _current[0].kernel
        _example["decline"] = f"{by if by.startswith('reference ') else 'kernel ' + by} declined: {reason}" if other \
            else reason


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


def _commit(record: Coverage) -> str:
    """Count the example now ending: 'declined', 'run' or '' (nothing called: rejected before the kernel ran)."""
    calls = _example["calls"]
    if _example["decline"] is not None:
        record.declined += 1
        record.reasons[_example["decline"]] += 1
        return "declined"
    if calls:
        record.run += 1
        for l, s, e, dtype in calls:
            record.max_l, record.max_s, record.max_e = max(record.max_l, l), max(record.max_s, s), max(record.max_e, e)
            record.dtypes.add(dtype)
        return "run"
    return ""


def _counted(inner, record: Coverage, kernel_name: str, explicit: int, covering=None):
    """``inner`` counting its examples. A covering row (``schedule.Slot``) is resolved for the kernel under test and
    its outcome kept (``Coverage.rows``); a failing row is shrunk inside its classes. Any other explicit example is
    first fitted into the kernel's limits (the draws already are), so that the pinned shapes run on a kernel with
    limits too."""
    from properties.kernel.schedule import Slot

    @functools.wraps(inner)
    def example(*args, **kwargs):
        slot = next(((name, v) for name, v in kwargs.items() if isinstance(v, Slot)), None)
        if slot is not None:
            return _run_rows(inner, record, args, kwargs, *slot)
        _fresh()
        fitted = {name: fit(value) for name, value in kwargs.items()}
        outcome = ""
        try:
            return inner(*args, **fitted)
        except AssertionError as exc:
            changed = [f"{name}={fitted[name]!r}" for name in kwargs if fitted[name] is not kwargs[name]]
            if changed:
                exc.add_note(f"(the kernel's limits fitted this example: {', '.join(changed)})")
            if covering is not None and record.failed_row is None:
                record.failed_row = -1   # a pinned example failed: the covering rows after it are left (one failure)
            raise
        finally:
            outcome = _commit(record)
            if outcome == "run" and covering is not None:
                problem = fitted.get(covering[1])
                if hasattr(problem, "classes"):
                    record.drawn.append(dict(problem.classes))
            rows_done = record.rows_run + record.rows_declined
            if outcome == "declined" and not record.run and record.declined >= rows_done + explicit + GIVE_UP:
                pytest.skip(_all_declined(kernel_name, record))
    return example


def _fresh() -> None:
    """A new example: nothing called yet, and no evidence for --repro-dir but its own (a comparison recorded by an
    earlier example that passed would stand for this one's failure)."""
    from properties.core import evidence
    _example["calls"], _example["decline"] = [], None
    evidence.new_example()


def _run_rows(inner, record: Coverage, args, kwargs, argname: str, slot):
    """Run a slot's covering rows (one, or more where the rows outnumber the slots); a row the kernel declines is
    counted and the next one runs; after a failing row the remaining rows are left (one failure is reported)."""
    from hypothesis import reject
    from hypothesis.errors import UnsatisfiedAssumption
    problems = slot.problems()
    if not problems or record.failed_row is not None:
        reject()
    ran = False
    for problem in problems:
        _fresh()
        try:
            inner(*args, **{**kwargs, argname: problem})
        except UnsatisfiedAssumption:
            status = _commit(record)
            record.row_status[problem.row] = (_example["decline"] or "rejected") if status == "declined" else "rejected"
            continue
        except AssertionError as exc:
            _commit(record)
            record.row_status[problem.row] = "failed"
            record.failed_row = problem.row
            raise _shrink(inner, args, kwargs, argname, slot.space, problem, exc, record) from None
        status = _commit(record)
        record.row_status[problem.row] = "run" if status == "run" else "rejected"
        ran = ran or status == "run"
    if not ran:
        reject()


SHRINK_TRIALS = 24   # reruns a failing covering row may cost to shrink inside its classes


def _shrink(inner, args, kwargs, argname, space, problem, exc, record) -> AssertionError:
    """The smallest failing problem of a failing row's classes (each value, then the seed, at its class's smallest
    while the row still fails), its failure returned with notes naming the row, its classes and both problems."""
    from hypothesis.errors import UnsatisfiedAssumption
    from properties.kernel.schedule import shrink_names, shrunk, schedule_for
    best, best_exc, trials, last = problem, exc, 0, problem
    for _ in range(2 if space.shrink else 0):
        changed = False
        for name in shrink_names(best):
            candidate = shrunk(space, best, name)
            if candidate == best or trials >= SHRINK_TRIALS:
                continue
            trials += 1
            last = candidate
            _fresh()
            try:
                inner(*args, **{**kwargs, argname: candidate})
            except AssertionError as failure:
                best, best_exc, changed = candidate, failure, True
            except (UnsatisfiedAssumption, Exception):   # another outcome (a decline, a skip) is not this failure
                pass
        if not changed:
            break
    if last is not best:   # --repro-dir keeps the evidence of the last calls: make them the failing problem's alone
        _fresh()
        try:
            inner(*args, **{**kwargs, argname: best})
        except AssertionError as failure:
            best_exc = failure
        except Exception:
            pass
    rows = len(schedule_for(space).rows)
    classes = ", ".join(f"{f}={c}" for f, c in problem.classes)
    best_exc.add_note(f"covering row {problem.row} of {rows} ({space.name}; classes {classes}) failed")
    if best is not problem:
        best_exc.add_note(f"the smallest failing problem of these classes: {best!r} (shrunk from {problem!r})")
    return best_exc


def fit(value):
    """``value`` inside the limits of the kernel under test (``Limits.fit``), or ``value`` itself."""
    from properties.kernel.limits import active
    limits = active()
    return limits.fit(value) if limits else value


def _all_declined(kernel_name: str, record: Coverage) -> str:
    return (f"kernel {kernel_name} declined every problem drawn for this clause (not covered): "
            f"{declined_summary(record)}")


def _schedule_skip(kernel_name: str, schedule) -> str | None:
    """The skip of a clause none of whose covering rows the kernel accepts, with its reasons; None if it has rows."""
    if schedule.rows:
        return None
    reasons = "; ".join(schedule.reasons()[:3]) or "no problem of this clause fits the budget"
    return (f"kernel {kernel_name} declines every problem of this clause (not covered): "
            f"{len(schedule.declined)} {_TUPLES_OF.get(schedule.strength, 'tuples of classes')} declined: {reasons}")


@contextlib.contextmanager
def counting(item, kernel_name: str, device: str):
    """Count the examples of ``item`` (a Hypothesis test); skip it if the kernel declined every one. A scheduled
    clause (properties/kernel/schedule.py) is skipped before anything runs when the kernel accepts none of its
    rows, and reports the pairs of classes covered and declined."""
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    if handle is None:
        yield
        return
    from hypothesis.errors import FailedHealthCheck, Unsatisfiable
    record = _records[item.nodeid] = Coverage(kernel=kernel_name, device=str(device))
    covering = getattr(item.obj, "covering_space", None)
    if covering is not None:
        from properties.kernel.schedule import schedule_for
        record.schedule = schedule_for(covering[0])
        skip = _schedule_skip(kernel_name, record.schedule)
        if skip:
            pytest.skip(skip)
    inner = handle.inner_test
    explicit = len(getattr(inner, "hypothesis_explicit_examples", ())) if covering is None else 0
    handle.inner_test = _counted(inner, record, kernel_name, explicit, covering)
    _current[0] = record
    try:
        yield record
    except (Unsatisfiable, FailedHealthCheck):
        # every draw rejected: declines (counted), or the clause's own assumptions where the kernel declined the
        # rest; the covering rows that ran are the clause's verdict
        if record.declined and not record.run:
            pytest.skip(_all_declined(kernel_name, record))
        if not record.rows_run:
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
        scheduled = [c["pairs"] for c in cs if c.get("pairs")]
        pairs = ""
        if scheduled:
            name = _TUPLES_OF.get(scheduled[0]["strength"], "tuples of classes")
            pairs = (f"; {name}: {sum(p['covered'] for p in scheduled)} covered, "
                     f"{sum(p['declined'] for p in scheduled)} declined, "
                     f"{sum(p['beyond_budget'] for p in scheduled)} beyond the budget, in "
                     f"{sum(p['rows'] for p in scheduled)} covering rows of {len(scheduled)} clauses")
        lines.append(f"kernel {kernel} on {device}: {len(group)} tests, {run} problems run, "
                     f"{declined or 'none'} declined; largest {_dims({**top, 'dtypes': dtypes})}; "
                     f"{compiled} specialisations (dtype, E, Ev, causal, L and S classes: 1, 16k, other){pairs}")
        for row in group:
            c = row["coverage"]
            p = c.get("pairs") or {}
            if not (verbose or c["declined"] or c["run"] < THIN or _not_bitwise(c) or p.get("declined")
                    or p.get("not_reached")):
                continue
            if row["status"] == "skipped" and not c["run"]:
                what = row.get("message") or declined_summary(c)
            else:
                what = f"{c['run']} run ({_dims(c)})" + (f", {declined_summary(c)}" if c["declined"] else "")
            if c.get("comparisons"):
                what += "; compared " + ", ".join(f"{how}: {n}" for how, n in c["comparisons"].items())
            if p:
                what += (f"; {_TUPLES.get(p['strength'], 'tuples')}: {p['covered']} covered, {p['declined']} declined"
                         + (f", {p['beyond_budget']} beyond the budget" if p["beyond_budget"] else "")
                         + (f", {p['not_reached']} not reached ({p.get('rejected', 0)} of them in rows the clause's "
                            f"own conditions rejected, the others after a failing row)" if p["not_reached"] else ""))
            lines.append(f"  {', '.join(row['clauses'])} [{row['status']}]: {what}")
    return lines


def _not_bitwise(c: dict) -> bool:
    return bool(c.get("comparisons", {}).get(WITHIN_BOUND))


THIN = 3   # a clause run on fewer problems than this is listed even when it passed
_TUPLES = {1: "classes", 2: "pairs", 3: "triples"}
_TUPLES_OF = {1: "classes", 2: "pairs of classes", 3: "triples of classes"}
