"""The spec (SPEC.md) as executable Hypothesis property suites.

Every property test names the clause(s) it checks::

    from properties import clause

    @clause("ATTN-ROWSUM")
    @given(case=cases())
    def test_rows_sum_to_one(kernel, device, case): ...

An ID that SPEC.md does not define is an error when the test module is imported. ``properties.Subject`` is the
contract of a model under test (a ``--model`` factory may return one). Importing the package loads nothing else:
pytest imports it in every run, for the plug-in's entry point (properties/plugin/__init__.py), and ``Subject`` brings
torch in only when it is first named.
"""
from __future__ import annotations

import importlib

import pytest

__all__ = ["clause", "Subject"]


def clause(*ids: str):
    """Bind a property test to spec clauses (the pytest marker ``clause``)."""
    from properties.core.spec import load_clauses
    if not ids:
        raise ValueError("clause() needs at least one clause ID")
    known = load_clauses()
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise ValueError(f"unknown spec clause ID(s) {', '.join(unknown)}: not defined in properties/SPEC.md")
    return pytest.mark.clause(*ids)


def __getattr__(name: str):
    if name == "Subject":
        return importlib.import_module("properties.core.subject").Subject
    raise AttributeError(f"module 'properties' has no attribute {name!r}")
