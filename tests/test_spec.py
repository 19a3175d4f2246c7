"""The spec and its properties correspond one to one: every clause has a property, every property a clause."""
from __future__ import annotations

import importlib

import pytest

import properties
from properties.core.levels import LEVELS, SUITE_DIR
from properties.core.spec import SPEC_PATH, load_clauses

PROPERTY_MODULES = sorted(f"{p.parent.name}.{p.stem}" for level in LEVELS for p in (SUITE_DIR / level).glob("test_*.py"))


def property_tests() -> dict[str, list[str]]:
    """test name -> the clause IDs its @clause marker names (empty when it has none)."""
    found = {}
    for name in PROPERTY_MODULES:
        module = importlib.import_module(f"properties.{name}")
        for attribute, test in vars(module).items():
            if attribute.startswith("test_") and callable(test):
                marks = [m for m in getattr(test, "pytestmark", []) if m.name == "clause"]
                found[f"{name}.{attribute}"] = [cid for m in marks for cid in m.args]
    return found


def test_every_clause_has_a_statement_a_source_and_a_property():
    clauses = load_clauses()
    assert len(clauses) >= 60
    covered = {cid for ids in property_tests().values() for cid in ids}
    missing = sorted(set(clauses) - covered)
    assert not missing, f"clauses without a property: {missing}"
    for clause in clauses.values():
        assert clause.statement.strip() and clause.source.strip(), clause.id


def test_every_property_names_a_known_clause():
    clauses = load_clauses()
    tests = property_tests()
    assert tests, "no property tests found"
    unbound = [name for name, ids in tests.items() if not ids]
    assert not unbound, f"property tests without @clause: {unbound}"
    unknown = sorted({cid for ids in tests.values() for cid in ids} - set(clauses))
    assert not unknown, f"properties name clauses SPEC.md does not define: {unknown}"


def test_an_unknown_clause_id_is_refused():
    with pytest.raises(ValueError, match="NOT-A-CLAUSE"):
        properties.clause("NOT-A-CLAUSE")


def test_the_spec_cites_its_sources():
    text = SPEC_PATH.read_text(encoding="utf-8")
    for source in ("3.2.1", "scaled_dot_product_attention", "000_b825df1c85f3440b.txt", "004_f5071b93f474a819.txt"):
        assert source in text, source


def test_the_documents_count_the_clauses_of_a_spec_section_right():
    import re
    root = SPEC_PATH.parents[1]
    said = []
    for document in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = " ".join(document.read_text(encoding="utf-8").split())
        said += re.findall(r'(\d+) clauses in SPEC\.md, "([^"]+)"', text)
    assert said, "no document names a section's clause count"
    section, counts = None, {}
    for line in SPEC_PATH.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("### ") and section is not None:
            counts[section] = counts.get(section, 0) + 1
    assert [(int(n), name) for n, name in said] == [(counts.get(name, 0), name) for _, name in said]
