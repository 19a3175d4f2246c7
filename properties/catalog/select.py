"""pytest plugin: run one level of the suite, or only the tests of some clauses.

    pytest properties/ -p properties.catalog.select --catalog-level kernel --kernel mypkg.mod:attn
    pytest properties/ -p properties.catalog.select --catalog-clause MASK-BOOL --kernel mypkg.mod:attn

Levels are the suite's folders (properties/core/levels.py): ``kernel``, ``model``, and ``module``, which here
keeps the model clauses too, since they are what a ``--zoo`` override of a part also changes. Deselects only:
the tests that remain run exactly as in a full run.
"""
from __future__ import annotations

import pytest

from properties.core.levels import LEVELS, level_of


def pytest_addoption(parser):
    group = parser.getgroup("catalog", "select a level or clauses of the spec suite (properties.catalog.select)")
    group.addoption("--catalog-level", choices=LEVELS, default=None,
                    help="run only the kernel, module (module and model) or model clauses")
    group.addoption("--catalog-clause", action="append", default=None, metavar="ID",
                    help="run only tests bound to this clause (repeatable)")


def _keep(item, level: str | None, clauses: set[str] | None) -> bool:
    if level is not None:
        own = level_of(item)
        if not (own == level or (level == "module" and own == "model")):
            return False
    if clauses is not None:
        bound = {cid for mark in item.iter_markers("clause") for cid in mark.args}
        if not bound & clauses:
            return False
    return True


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    level = config.getoption("--catalog-level")
    clauses = config.getoption("--catalog-clause")
    clauses = set(clauses) if clauses else None
    if level is None and clauses is None:
        return
    kept, dropped = [], []
    for item in items:
        (kept if _keep(item, level, clauses) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
