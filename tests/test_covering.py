"""The covering construction (properties/kernel/covering.py) on the suite's own clause spaces, for a kernel without
limits and for kernels with the limits fused kernels have: every target some valid row holds is in a row, every
target reported unposable has no valid row, and the completion search that cuts branches early (forward checking,
on the designs ``covering_design`` marks monotone) finds the very rows the plain depth-first search finds."""
from __future__ import annotations

import pytest
import torch

from properties.kernel import covering, test_gradients, test_history, test_kernel, test_masks
from properties.kernel.limits import Limits
from properties.kernel.problem_space import BUDGET, LONG_BUDGET, Context
from properties.kernel.schedule import covering_design

GRAD_GQA = test_gradients.test_shared_kv_head_gradient_is_the_sum_over_its_group.covering_space[0]
SPACES = [test_kernel.ORACLE, GRAD_GQA, test_history.test_output_does_not_depend_on_earlier_calls.covering_space[0],
          test_masks.test_bool_mask_equals_its_additive_float_mask.covering_space[0]]
LIMITS = {
    "none": Limits(),
    "fused": Limits(head_sizes=(16, 32, 64, 128), length_multiple=16, masks=("bool",)),
    "half, no masks": Limits(dtypes=(torch.float16, torch.bfloat16), head_sizes=(16, 32, 64, 128), masks=(),
                             equal_head_sizes=True),
    "square, 4-d, plain": Limits(equal_lengths=True, causal=False, gqa=False, strided=False, ranks=(4,)),
}
DTYPES = ("float32", "float64", "bfloat16", "float16")


def _context(space, limits: Limits) -> Context:
    return Context(limits, DTYPES, LONG_BUDGET if space.long_rows else BUDGET, 2)


def _unpruned(design: covering.Design) -> covering.Design:
    return covering.Design(design.factors, design.valid, design.cost, design.derived, design.derived_classes,
                           design.allowed, monotone=False)


@pytest.mark.parametrize("limits", list(LIMITS), ids=list(LIMITS))
@pytest.mark.parametrize("space", SPACES, ids=[s.name for s in SPACES])
def test_rows_cover_every_posable_pair_and_pruning_changes_no_row(space, limits):
    ctx = _context(space, LIMITS[limits])
    structure, full = covering_design(space, ctx, 0), covering_design(space, ctx, 2)
    assert full.monotone and structure.monotone
    targets = covering.targets_of(structure, 2)
    rows, unposable = covering.covering_rows(full, targets, 2)
    assert (rows, unposable) == covering.covering_rows(_unpruned(full), targets, 2)
    held = set().union(*(covering.covered_by(full, row, 2) for row in rows))
    assert all(full.valid(row) and set(row) == set(full.factors) for row in rows)
    assert not [t for t in targets if t not in held and t not in unposable], "a target no row holds, not unposable"
    assert all(covering.posable(_unpruned(full), t) is None for t in unposable)


def test_within_the_budget_under_limits_is_not_monotone_so_it_is_searched_whole():
    """A head-size class the limits leave empty costs its own smallest size (1) once chosen, less than the least
    accepted size (16) an unchosen factor costs: a partial row over the budget can have a completion within it, and
    forward checking would wrongly report the pair beyond the budget."""
    budget = covering_design(GRAD_GQA, Context(LIMITS["fused"], ("float32",), BUDGET, 2), 1)
    assert not budget.monotone
    target = (("order", ">"), ("scale", "past256"))
    row = covering.posable(budget, target)
    assert row is not None and budget.valid(row)
    assert not any(budget.valid({"L": row["L"], "group": c}) for c in budget.factors["group"])
