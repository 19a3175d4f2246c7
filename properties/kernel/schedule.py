"""The covering schedule of the kernel clauses: every pair of classes a clause can pose and the kernel accepts, in
every run (SPEC.md, "Problems at kernel scale, kernels with limits, coverage").

``@scheduled(space)`` is the one decorator every kernel clause uses. It gives the test:

- the **covering rows** as explicit examples (``Slot``): a covering array over the clause's space (its factors'
  classes, properties/kernel/problem_space.py), built for the kernel under test from its limits and the run's dtypes
  when the test starts (properties/kernel/covering.py). Every pair of classes (every triple under ``thorough``; every
  class under ``quick``) that the clause can pose within its budget and the kernel accepts is in some row; the rows
  run first, cheapest first, whatever the profile (the ``pinned`` profile runs nothing else). Values inside each class
  rotate from row to row and with the run's seed;
- **drawn problems** (``problems``): Hypothesis draws the classes, then the values inside them, and shrinks a failure
  to the smallest problem of the failing classes (classes in cost order, values smallest first).

A failing covering row is shrunk inside its classes (each value, then the seed, to its class's smallest), and the
failure names the row, its classes and the smallest failing problem. Rows the kernel declines (its limits, or a
decline at run time) are counted as declined, not run (properties/kernel/coverage.py reports the pairs covered and
declined); a clause none of whose rows the kernel accepts is skipped with the kernel's reasons before anything is
drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings, strategies as st

from properties.kernel.covering import Design, complete, covered_by, covering_rows, posable, targets_of
from properties.kernel.problem_space import (BUDGET, LONG_BUDGET, DTYPE_NAMES, DTYPE_ORDER, Context, Drawing, Problem, Rotation,
                                             SQUARE_CLASSES, Smallest, Space, limits_reason, picks_of, realize,
                                             row_cost, scale_of, square_of, structure_ok)

__all__ = ["Schedule", "Slot", "scheduled", "problems", "context", "schedule_for", "strength", "SLOTS",
           "covering_design", "shrink_names", "shrunk"]

# Explicit examples per clause, one covering row each (more rows than slots share them: slot i runs rows i, i + n, ...).
SLOTS = {1: 12, 2: 72, 3: 480}


def profile_examples() -> int:
    """The loaded profile's max_examples (inside a test ``settings.default`` is the test's own settings)."""
    name = settings.get_current_profile_name() if hasattr(settings, "get_current_profile_name") else \
        settings._current_profile
    try:
        return settings.get_profile(name).max_examples
    except Exception:   # no profile by that name: the settings in force
        return settings.default.max_examples


def strength() -> int:
    """Pairs (2) at the default profile; triples (3) under ``thorough`` (100 examples or more); single classes (1)
    under ``quick`` (3 examples or fewer)."""
    n = profile_examples()
    return 3 if n >= 100 else 1 if n <= 3 else 2


def context(space: Space | None = None) -> Context:
    """The context of the test now running: its kernel's limits on its device, the run's dtypes, the budget."""
    from properties.core.dtypes import selected_dtypes
    from properties.kernel.limits import active_device
    from properties.kernel.tiles import kernel_limits
    t = strength()
    base = LONG_BUDGET if space is not None and space.long_rows else BUDGET
    budget = base * (4 if t >= 3 else 1) * (4 if active_device().startswith("cuda") else 1)
    names = tuple(n for n in DTYPE_ORDER if n in {DTYPE_NAMES[d] for d in selected_dtypes()})
    return Context(kernel_limits(), names, budget, t)


def covering_design(space: Space, ctx: Context, level: int) -> Design:
    """The covering design of a space: ``level`` 0 what the clause can pose at all, 1 within the budget, 2 what the
    kernel accepts too."""
    factors = {}
    for factor, classes in space.factors:
        if factor == "dtype":
            classes = tuple(c for c in classes if c in ctx.dtypes)
        factors[factor] = classes

    costs: dict = {}

    def cost(row):   # a function of the few factors that set the sizes
        key = tuple(map(row.get, _SIZE_FACTORS))
        if key not in costs:
            costs[key] = row_cost(space, ctx, row)
        return costs[key]

    limited = level >= 2 and bool(ctx.limits)   # (a kernel without limits accepts every row)
    names, verdicts = tuple(factors), {}

    def valid(row):   # a function of the row's factors, asked of the same partial rows many times over
        key = tuple(map(row.get, names))
        if key not in verdicts:
            verdicts[key] = (structure_ok(space, row) and (level < 1 or cost(row) <= ctx.budget)
                             and (not limited or limits_reason(space, ctx, row) is None))
        return verdicts[key]
    lengths = all(f in factors for f in ("L", "S", "order"))
    squares = tuple(c for c in SQUARE_CLASSES if c in factors.get("L", ()) and c in factors.get("S", ()))
    return Design(factors, valid, cost,
                  derived={"scale": scale_of, "square": square_of} if lengths else None,
                  derived_classes={"scale": factors["L"], "square": squares} if lengths else None,
                  allowed=_allowed if lengths else None,
                  # Not within the budget under limits: a class the limits leave without sizes (odd head sizes, say)
                  # costs its smallest size, 1, while a factor still missing costs the least size they accept.
                  monotone=level != 1 or not ctx.limits)


_SIZE_FACTORS = ("L", "S", "order", "E", "Ev", "group", "attend")
_LENGTH_ATTRIBUTES = {"L", "S", "order", "scale", "square"}   # (the dtype: see _allowed)


def _allowed(attributes: tuple[str, ...]) -> bool:
    """The order of L and S is covered against the scale (the longer one's class), not against L and S apart: L > S
    at tile scale, without a pair (L = long, L < S) that would force two long sequences into a row. Self-attention
    (L = S below the longest class: ``square``) is covered against the dtype: positions past 256 in both the queries
    and the keys, in bfloat16."""
    lengths = _LENGTH_ATTRIBUTES.intersection(attributes)
    if "square" in attributes:
        return lengths == {"square"} and "dtype" in attributes
    if "scale" in attributes:
        return lengths == {"scale", "order"}
    return not ("order" in attributes and ("L" in attributes or "S" in attributes))


def describe(target) -> str:
    return " & ".join(f"{a}={c}" for a, c in target)


class Schedule:
    """A clause's covering rows for one context: the targets (tuples of classes) with their status — ``accepted``
    (in some row), ``declined`` (the kernel's limits rule out every problem holding it: ``reasons``) or ``budget``
    (every problem holding it costs more than the clause's budget) — the rows, and the problems realized from them."""

    def __init__(self, space: Space, ctx: Context, run_seed: int):
        self.space, self.ctx = space, ctx
        self.strength = ctx.strength
        structure, budget, full = (covering_design(space, ctx, level) for level in (0, 1, 2))
        self.design = full
        self.declined: dict = {}      # target -> the kernel's reason
        self.beyond_budget: list = []
        targets = targets_of(structure, ctx.strength)
        rows, unposable = covering_rows(full, targets, ctx.strength)
        for target in unposable:   # (the targets some row holds are the accepted ones)
            if posable(structure, target) is None:
                continue
            fitting = posable(budget, target)
            if fitting is None:
                self.beyond_budget.append(target)
            else:
                fixed = {a: c for a, c in target if a in full.factors}
                self.declined[target] = (limits_reason(space, ctx, fixed) or limits_reason(space, ctx, fitting)
                                         or "outside the kernel's limits")
        rejected = set(unposable)
        self.accepted: list = [t for t in targets if t not in rejected]
        self.rows = sorted(rows, key=lambda row: row_cost(space, ctx, row))
        accepted = set(self.accepted)
        self.row_targets = [covered_by(full, row, ctx.strength) & accepted for row in self.rows]
        self.problems = []
        seen: dict = {}
        for i, row in enumerate(self.rows):
            occurrences = {name: seen.get(_occurrence_key(name, row), 0) for name in _PICK_NAMES + [
                n for n, _ in space.extras]}
            self.problems.append(realize(space, ctx, row, Rotation(run_seed, space.name, occurrences, i), i))
            for name in occurrences:
                key = _occurrence_key(name, row)
                seen[key] = seen.get(key, 0) + 1

    def reasons(self) -> list[str]:
        """The kernel's reasons for the declined targets: first those that rule out a whole factor (every class the
        clause poses of it, or a feature every problem of the clause has), then the others, most frequent first."""
        from collections import Counter
        blocking = [] if (whole := limits_reason(self.space, self.ctx, {})) is None else [whole]
        for factor, classes in self.design.factors.items():
            why = [limits_reason(self.space, self.ctx, {factor: c}) for c in classes]
            if why and all(why):
                blocking += why
        ordered = blocking + [reason for reason, _ in Counter(self.declined.values()).most_common()]
        return list(dict.fromkeys(ordered))


_PICK_NAMES = ["L", "S", "L=S", "shorter", "longer", "E", "Ev", "lead"]


def _occurrence_key(name: str, row: dict):
    factor = {"L": "L", "S": "S", "L=S": "L", "shorter": "L", "longer": "L", "E": "E", "Ev": "Ev",
              "lead": "rank"}.get(name)
    return (name, row.get(factor)) if factor else (name,)


_CACHE: dict = {}


def schedule_for(space: Space, ctx: Context | None = None) -> Schedule:
    """The schedule of ``space`` in ``ctx`` (default: the running test's), built once per context and run seed."""
    from properties.kernel.tiles import run_seed
    ctx = ctx or context(space)
    seed = run_seed() or 0
    key = (space, ctx.key(), seed)
    if key not in _CACHE:
        _CACHE[key] = Schedule(space, ctx, seed)
    return _CACHE[key]


# ------------------------------------------------------------------------------------------------ explicit rows
@dataclass(frozen=True)
class Slot:
    """The ``index``-th covering row of a clause, whatever the kernel: resolved when the test runs, from the
    schedule of the kernel under test (slot i holds rows i, i + SLOTS, ...)."""

    space: Space
    index: int

    def problems(self) -> list[Problem]:
        schedule = schedule_for(self.space)
        return schedule.problems[self.index::SLOTS[schedule.strength]]

    def __repr__(self) -> str:
        try:
            rows = self.problems()
        except Exception:   # outside a test (no kernel): the slot itself
            return f"<covering row {self.index}>"
        if not rows:
            return f"<covering row {self.index}: none for this kernel>"
        return " then ".join(repr(p) for p in rows)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


@st.composite
def problems(draw, space: Space) -> Problem:
    """A drawn problem of ``space`` inside the kernel's limits: the classes, factor by factor among those that can
    still be completed (cheapest first, so that a failure shrinks to cheaper classes), then values inside them."""
    schedule = schedule_for(space)
    design = schedule.design
    row: dict = {}
    for factor, classes in design.factors.items():
        options = [c for c in classes if complete(design, {**row, factor: c}) is not None]
        if not options:
            from hypothesis import reject
            reject()
        row[factor] = draw(st.sampled_from(options))
    return realize(space, schedule.ctx, row, Drawing(draw, space))


def scheduled(space: Space, argname: str = "case"):
    """Decorator: the test draws ``argname`` from ``space`` (``problems``) after running its covering rows as
    explicit examples (``Slot``); Hypothesis draws a sixth of the profile's examples besides (2 by default)."""
    def decorate(test):
        test = given(**{argname: problems(space)})(test)
        for index in reversed(range(SLOTS[strength()])):
            test = example(**{argname: Slot(space, index)})(test)
        draws = max(1, profile_examples() // 6)
        test = settings(max_examples=draws)(test)
        test.covering_space = (space, argname)
        return test
    return decorate


# ------------------------------------------------------------------------------------------------ shrinking a row
def shrink_names(problem: Problem) -> list[str]:
    """What a failing row shrinks, in order: the seed, the leading dims, the head sizes, the lengths, the extras."""
    return ["seed", "lead", "Ev", "E", "L=S", "shorter", "longer", "L", "S"] + [
        name for name, _ in problem.extras if problem.uses(name)]


def shrunk(space: Space, problem: Problem, name: str) -> Problem:
    """``problem`` with ``name`` at its class's smallest value (the same classes)."""
    schedule = schedule_for(space)
    return realize(space, schedule.ctx, dict(problem.classes), Smallest(picks_of(problem), {name}), problem.row)
