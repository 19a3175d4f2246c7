"""pytest plugin: run one level of the suite, only the tests of some clauses, or a catalog plan.

    pytest properties/ -p properties.catalog.select --catalog-level kernel --kernel mypkg.mod:attn
    pytest properties/ -p properties.catalog.select --catalog-clause MASK-BOOL --kernel mypkg.mod:attn
    pytest properties/kernel -p properties.catalog.select --catalog-plan plan.json --kernel a:f --kernel b:g

Levels are the suite's folders (properties/core/levels.py): ``kernel``, ``model``, ``distributed``, and ``module``,
which here keeps the model clauses too, since they are what a ``--zoo`` override of a part also changes. A plan runs many
kernels in one session, each on its own clauses (SDPA kernels, or the context-parallel kernels of a ``--world-size``
run): a JSON object ``{"kernels": {NAME: [CLAUSE, ...]}, "stop_first":
BOOL, "nodeids": PATH}`` keeps a test of kernel NAME (``--kernel NAME``) only if it is bound to one of NAME's clauses
(all of them where the list is empty); with ``stop_first``, a kernel's tests after its first failure are skipped
(``-x`` for each kernel); ``nodeids`` is where the plan writes ``{nodeid: NAME}`` for the tests it keeps. Deselects
and skips only: the tests that remain run exactly as in a full run.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest

from properties.core.levels import LEVELS, level_of

_PLAN = pytest.StashKey[dict]()
_FAILED = pytest.StashKey[set]()


def pytest_addoption(parser):
    group = parser.getgroup("catalog", "select a level or clauses of the spec suite (properties.catalog.select)")
    group.addoption("--catalog-level", choices=LEVELS, default=None,
                    help="run only the kernel, module (module and model), model or distributed clauses")
    group.addoption("--catalog-clause", action="append", default=None, metavar="ID",
                    help="run only tests bound to this clause (repeatable)")
    group.addoption("--catalog-plan", default=None, metavar="PATH",
                    help="run each kernel only on its own clauses, per a JSON plan (the module's docstring)")


def pytest_configure(config):
    path = config.getoption("--catalog-plan")
    if path is None:
        return
    try:
        with open(path, encoding="utf-8") as file:
            plan = json.load(file)
        kernels = {name: set(clauses) for name, clauses in plan["kernels"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise pytest.UsageError(f"--catalog-plan {path}: not a catalog plan ({exc})") from None
    config.stash[_PLAN] = {**plan, "kernels": kernels}
    config.stash[_FAILED] = set()


def _clauses(item) -> set[str]:
    return {cid for mark in item.iter_markers("clause") for cid in mark.args}


def _kernel(item) -> str | None:
    """The name of the kernel a kernel-level test is parametrized with (None for any other test)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return next((v.name for k, v in params.items() if k.endswith("kernel") and hasattr(v, "name")), None)


def _keep(item, level: str | None, clauses: set[str] | None, plan: dict | None) -> bool:
    if level is not None:
        own = level_of(item)
        if not (own == level or (level == "module" and own == "model")):
            return False
    if clauses is not None and not _clauses(item) & clauses:
        return False
    if plan is not None:
        kernel = _kernel(item)
        if kernel not in plan["kernels"]:
            return False
        wanted = plan["kernels"][kernel]
        return not wanted or bool(_clauses(item) & wanted)
    return True


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    level = config.getoption("--catalog-level")
    clauses = config.getoption("--catalog-clause")
    clauses = set(clauses) if clauses else None
    plan = config.stash.get(_PLAN, None)
    if level is None and clauses is None and plan is None:
        return
    kept, dropped = [], []
    for item in items:
        (kept if _keep(item, level, clauses, plan) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if plan is not None and plan.get("nodeids"):
        _write_json(plan["nodeids"], {item.nodeid: _kernel(item) for item in kept})


def _write_json(path: str, data) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".plan-")
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        json.dump(data, file)
    os.replace(partial, path)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    plan = item.config.stash.get(_PLAN, None)
    if plan is not None and plan.get("stop_first") and _kernel(item) in item.config.stash[_FAILED]:
        pytest.skip(f"catalog plan: kernel {_kernel(item)} has failed already (-x for each kernel)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    plan = item.config.stash.get(_PLAN, None)
    if plan is not None and report.failed and report.when in ("setup", "call"):
        item.config.stash[_FAILED].add(_kernel(item))
    return report
