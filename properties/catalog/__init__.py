"""The bug catalog: deliberately broken implementations, one realistic bug each, and the correct ones.

``CATALOG`` lists every broken implementation at four levels — kernels (SDPA signature, plugged in with
``--kernel``, or FlashAttention's API with ``--kernel-api``), modules (zoo parts replaced through ``_target_`` with
``--zoo``), models (factories for ``--model``) and context-parallel kernels (``--kernel`` with ``--world-size`` and
``--shard``: the distributed level) — with its mechanism and the spec clauses (``properties/SPEC.md``)
whose statements it violates. ``CORRECT`` lists implementations that must pass with zero failures. Each entry is
declared where its implementation is defined, by a decorator of ``properties.catalog.registry`` (``@bug``,
``@module_bug``, ``@correct``); the modules that declare entries are listed once, in ``MODULES``, and imported
when ``CATALOG`` or ``CORRECT`` is first read (they import torch and the zoo; the catalog's tools and its pytest
plug-in ``properties.catalog.select`` do not need them). ``python -m properties.catalog.mutation_report`` runs the
suite on all of them; ``tests/test_catalog.py`` checks the same in CI.

    pytest properties/ --kernel properties.catalog.kernels:causal_off_by_one
"""
from __future__ import annotations

import importlib

from properties.catalog.registry import Entry, entries
from properties.core.levels import LEVELS

__all__ = ["Entry", "CATALOG", "CORRECT", "LEVELS", "MODULES", "by_name"]

# The modules that declare entries, in the order the catalog lists them (level by level).
MODULES = tuple(f"{__name__}.{name}" for name in (
    "correct", "tiled", "kernels", "contract_bugs", "backward", "tile_bugs", "state_bugs", "flash_bugs",
    "flash_varlen_bugs", "flash_kvcache_bugs", "integrity_bugs", "modules", "models", "decode_bugs", "differential",
    "scale_bugs", "moe_bugs", "config_bugs", "pair_bugs", "merge_bugs", "distributed_bugs"))

CATALOG: list[Entry]
CORRECT: list[Entry]


def __getattr__(name: str):
    """CATALOG and CORRECT, collected from ``MODULES`` on first use (PEP 562)."""
    if name not in ("CATALOG", "CORRECT"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _collected()[name == "CORRECT"]


def _collected() -> tuple[list[Entry], list[Entry]]:
    if "CATALOG" not in globals():
        for module in MODULES:
            importlib.import_module(module)
        broken, correct = entries(list(MODULES))
        globals().update(CATALOG=broken, CORRECT=correct)
    return globals()["CATALOG"], globals()["CORRECT"]


def by_name(name: str) -> Entry:
    broken, correct = _collected()
    for entry in broken + correct:
        if entry.name == name:
            return entry
    raise KeyError(name)
