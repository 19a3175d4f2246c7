"""The level of a property test — kernel, module, model or distributed — is the folder it lives in, and nothing else.

`properties/kernel/` holds the clauses on functions with the SDPA signature, `properties/module/` those on
parts (multi-head attention, feed-forward, norms, positions, layers), `properties/model/` those on whole
models, `properties/distributed/` those on a kernel split across ranks (--world-size). The plugin's level
selection (--kernel, --model, --zoo, --world-size), `-m kernel|module|model|distributed`, the catalog's
--catalog-level and the report's "level" field all ask `level_of`.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["LEVELS", "SUITE_DIR", "in_suite", "level_of"]

LEVELS = ("kernel", "module", "model", "distributed")
SUITE_DIR = Path(__file__).resolve().parent.parent


def in_suite(item) -> bool:
    """Whether a collected test is one of the suite's clause tests (the plugin leaves all others alone)."""
    return SUITE_DIR in Path(str(item.path)).resolve().parents


def level_of(item) -> str | None:
    """'kernel', 'module', 'model' or 'distributed' for a clause test; None for any other test."""
    path = Path(str(item.path)).resolve()
    if SUITE_DIR not in path.parents:
        return None
    folder = path.relative_to(SUITE_DIR).parts[0]
    return folder if folder in LEVELS else None
