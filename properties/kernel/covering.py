"""Covering arrays with constraints: rows of classes in which every t-tuple of classes that can be posed together
appears at least once (SPEC.md, "Problems at kernel scale, kernels with limits, coverage").

A deterministic greedy construction in the manner of AETG (Cohen et al. 1997) and IPOG's horizontal growth (Lei et
al. 2007): while a target tuple is uncovered, the most expensive uncovered one seeds a row, and each remaining factor
takes the class that covers the most uncovered targets with the classes already in the row, ties going to the
cheaper class, then to the earlier one. A constraint function on partial rows keeps every row posable; a completion
search (depth first, cheapest classes first) keeps every partial row completable, so that the construction never
reaches a dead end; on a design whose validity is monotone (a rejected partial row has no valid completion) the search
cuts a branch as soon as some missing factor has no admissible class (forward checking), which finds the same rows.
Nothing here is random: the same factors, constraints and costs give the same rows.

Pure Python, no torch: properties/kernel/problem_space.py says what the factors, targets, constraints and costs are.
"""
from __future__ import annotations

from itertools import combinations
from typing import Callable

__all__ = ["Design", "Target", "targets_of", "covered_by", "complete", "covering_rows"]

Target = tuple[tuple[str, str], ...]   # ((attribute, class), ...), attributes in a fixed order


class Design:
    """What a covering array is built over.

    ``factors``: factor -> its classes in preference order (cheapest first). ``valid(partial) -> bool``: whether a
    partial row (factor -> class) can still be posed (False only when some assigned classes conflict). ``cost(partial)``:
    a lower bound of the cost of any completion. ``monotone``: ``valid`` rejects no partial row that has a valid
    completion (the search then cuts a branch as soon as some missing factor has no admissible class). ``derived``:
    attribute -> function of a complete row (an attribute that targets may name besides the factors).
    ``allowed(attributes) -> bool``: which combinations of attributes are targets."""

    def __init__(self, factors: dict[str, tuple[str, ...]], valid: Callable[[dict], bool],
                 cost: Callable[[dict], float], derived: dict[str, Callable[[dict], str]] | None = None,
                 derived_classes: dict[str, tuple[str, ...]] | None = None,
                 allowed: Callable[[tuple[str, ...]], bool] | None = None, monotone: bool = False):
        self.factors = {name: tuple(classes) for name, classes in factors.items()}
        self.valid, self.cost, self.monotone = valid, cost, monotone
        self.derived = dict(derived or {})
        self.derived_classes = dict(derived_classes or {})
        self.allowed = allowed or (lambda attributes: True)
        self._completions: dict = {}

    def attributes(self) -> list[str]:
        return list(self.factors) + list(self.derived)

    def classes(self, attribute: str) -> tuple[str, ...]:
        return self.factors[attribute] if attribute in self.factors else self.derived_classes[attribute]

    def value(self, row: dict, attribute: str) -> str | None:
        """The class of ``attribute`` in a (partial) row, None while unknown (a derived attribute is a function of a
        partial row that returns None until its inputs are there)."""
        if attribute in self.factors:
            return row.get(attribute)
        return self.derived[attribute](row)


def targets_of(design: Design, strength: int) -> list[Target]:
    """Every combination of ``strength`` classes of distinct attributes that ``design.allowed`` names (posable or
    not: the caller sorts them), attributes in declaration order."""
    attributes = [a for a in design.attributes() if len(design.classes(a)) > 0]
    out: list[Target] = []
    for chosen in combinations(attributes, min(strength, len(attributes))):
        if not design.allowed(chosen):
            continue
        def expand(i: int, prefix: tuple):
            if i == len(chosen):
                out.append(prefix)
                return
            for c in design.classes(chosen[i]):
                expand(i + 1, prefix + ((chosen[i], c),))
        expand(0, ())
    return out


def covered_by(design: Design, row: dict, strength: int) -> set[Target]:
    """Every ``strength``-tuple of a complete row's attributes (the targets it covers, allowed or not)."""
    known = _known(design, row)
    attrs = [a for a in design.attributes() if a in known]
    return {tuple((a, known[a]) for a in chosen) for chosen in combinations(attrs, min(strength, len(attrs)))}


def _fixes(design: Design, target: Target) -> tuple[dict, list[tuple[str, str]]]:
    """(the factor classes a target fixes, its conditions on derived attributes)."""
    fixed = {a: c for a, c in target if a in design.factors}
    conditions = [(a, c) for a, c in target if a not in design.factors]
    return fixed, conditions


def _meets(design: Design, row: dict, conditions: tuple) -> bool:
    return all(design.value(row, a) in (None, c) for a, c in conditions)


def complete(design: Design, partial: dict, conditions: tuple = ()) -> dict | None:
    """A complete valid row extending ``partial`` (cheapest classes first) whose derived attributes meet
    ``conditions``, or None: a greedy pass first (each missing factor its first class that keeps the row valid, which
    almost always succeeds), a depth-first search where it does not."""
    key = ("greedy", tuple(map(partial.get, design.factors)), conditions)
    if key in design._completions:
        return design._completions[key]
    design._completions[key] = result = _complete(design, partial, conditions)
    return result


def _complete(design: Design, partial: dict, conditions: tuple) -> dict | None:
    if not design.valid(partial) or not _meets(design, partial, conditions):
        return None
    row = dict(partial)
    for factor, classes in design.factors.items():
        if factor in row:
            continue
        chosen = next((c for c in classes if design.valid({**row, factor: c})
                       and _meets(design, {**row, factor: c}, conditions)), None)
        if chosen is None:
            break
        row[factor] = chosen
    else:
        if all(design.value(row, a) == c for a, c in conditions):
            return row
    return _search(design, partial, conditions)


def _search(design: Design, partial: dict, conditions: tuple) -> dict | None:
    key = (tuple(map(partial.get, design.factors)), conditions)
    if key in design._completions:
        return design._completions[key]
    if not design.valid(partial) or any(design.value(partial, a) not in (None, c) for a, c in conditions):
        design._completions[key] = None
        return None
    missing = next((f for f in design.factors if f not in partial), None)
    if missing is None:
        ok = all(design.value(partial, a) == c for a, c in conditions)
        result = dict(partial) if ok else None
        design._completions[key] = result
        return result
    # Forward checking: a missing factor none of whose classes the row admits ends the branch here, instead of after
    # every combination of the factors before it (a kernel without masks, say, under a clause of masks). The first
    # completion found is the same where validity is monotone: only branches without one are cut.
    if design.monotone and any(not any(design.valid({**partial, f: c}) for c in classes)
                               for f, classes in design.factors.items() if f not in partial):
        design._completions[key] = None
        return None
    factor = missing
    result = None
    for c in design.factors[factor]:
        result = _search(design, {**partial, factor: c}, conditions)
        if result is not None:
            break
    design._completions[key] = result
    return result


def posable(design: Design, target: Target) -> dict | None:
    """A complete valid row holding ``target``, or None."""
    fixed, conditions = _fixes(design, target)
    return complete(design, fixed, tuple(conditions))


def _known(design: Design, row: dict) -> dict:
    """The attributes of a (partial) row whose classes are known: its factors and the derived attributes whose
    inputs it holds."""
    known = dict(row)
    for a, fn in design.derived.items():
        value = fn(row)
        if value is not None:
            known[a] = value
    return known


def _new_targets(design: Design, before: dict, after: dict, strength: int, uncovered: set) -> int:
    """How many uncovered targets ``after`` (a row one factor longer than ``before``) holds that ``before`` did not
    determine: tuples of ``strength`` known attributes with at least one newly known, looked up in ``uncovered``."""
    order = design.attributes()
    fresh = [a for a in after if a not in before]
    old = [a for a in before]
    count = 0
    for k in range(1, min(strength, len(fresh)) + 1):
        for new in combinations(fresh, k):
            for rest in combinations(old, strength - k):
                attrs = sorted(new + rest, key=order.index)
                count += tuple((a, after[a]) for a in attrs) in uncovered
    return count


def covering_rows(design: Design, targets: list[Target], strength: int) -> tuple[list[dict], list[Target]]:
    """(rows, the targets no row can hold): rows (factor -> class) covering every target of ``targets`` that some
    valid row holds; targets are ``strength``-tuples in the attributes' declaration order (``targets_of``). A target
    is tried as a row's seed only while no row holds it, so that the completion search runs for the seeds alone."""
    uncovered = set(targets)
    order = {t: i for i, t in enumerate(targets)}
    seed_cost = {t: design.cost(_fixes(design, t)[0]) for t in targets}
    by_priority = iter(sorted(uncovered, key=lambda t: (-seed_cost[t], order[t])))   # the most expensive first
    rows: list[dict] = []
    unposable: list[Target] = []
    while uncovered:
        seed = next(t for t in by_priority if t in uncovered)
        fixed, conditions = _fixes(design, seed)
        conditions = tuple(conditions)
        if complete(design, fixed, conditions) is None:
            unposable.append(seed)
            uncovered.discard(seed)
            continue
        row = dict(fixed)
        for factor in design.factors:
            if factor in row:
                continue
            before = _known(design, row)
            ranked = []
            for rank, c in enumerate(design.factors[factor]):
                trial = {**row, factor: c}
                if not design.valid(trial):
                    continue
                gain = _new_targets(design, before, _known(design, trial), strength, uncovered)
                ranked.append(((gain, -design.cost(trial), -rank), c))
            ranked.sort(reverse=True)
            # the best class whose row can still be completed (checked in that order: the first usually can)
            best = next((c for _, c in ranked if complete(design, {**row, factor: c}, conditions) is not None), None)
            if best is None:   # cannot happen: the seed was posable and each step keeps the row completable
                raise RuntimeError(f"covering construction: no class of {factor} completes {row}")
            row[factor] = best
        newly = covered_by(design, row, strength) & uncovered
        if seed not in newly:   # guards against a silent endless loop
            raise RuntimeError(f"covering construction: the row {row} does not cover its seed {seed}")
        uncovered -= newly
        rows.append(row)
    return rows, unposable
