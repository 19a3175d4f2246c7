"""The declared contracts (--deterministic, --batch-invariant; SPEC.md "Declared contracts") on correct kernels, and
the repeats rule (SPEC.md "Repeats") on a kernel whose sums vary in order. The broken kernels that fail the
contracts are catalog entries (tests/test_catalog.py)."""
from __future__ import annotations

from properties.catalog import Entry
from properties.catalog.run import run_entry

CONTRACTS = ("KERNEL-DETERMINISTIC", "KERNEL-BATCH-INVARIANT")
FLAGS = ("--deterministic", "--batch-invariant")


def _passes(spec: str, clauses, extra=()) -> None:
    run = run_entry(Entry(spec, "kernel", spec, (), "--kernel", spec, extra), clauses=clauses, seed=0)
    failures = [f"{t['nodeid']}: {t['message']}" for t in run.tests if t["status"] in ("failed", "error")]
    ran = {t["clause"] for t in run.rows if t["status"] == "passed"}
    assert run.returncode == 0 and not failures, f"{spec}: {failures}\n{run.output[-3000:]}"
    assert ran == set(clauses), f"{spec}: passed {sorted(ran)}, expected {clauses}\n{run.output[-3000:]}"
    return run


CORRECT = ("torch.nn.functional:scaled_dot_product_attention", "math",
           "properties.catalog.contract_bugs:batch_invariant_attention")


def test_correct_kernels_keep_their_contracts():
    """PyTorch's CPU SDPA, the zoo's math kernel and the batch-invariant twin repeat bitwise, in one session; the twin
    keeps its rows whatever the batch. (SDPA and math do not, on this CPU, for every class: docs/kernels.md.)"""
    run = _passes(CORRECT[0], CONTRACTS[:1], (FLAGS[0], *(w for spec in CORRECT[1:] for w in ("--kernel", spec))))
    kernels = {r["coverage"]["kernel"] for r in run.rows if r["status"] == "passed"}
    assert kernels == set(CORRECT), kernels
    _passes(CORRECT[2], CONTRACTS[1:], FLAGS[1:])


def test_contracts_are_skipped_unless_declared():
    """Without its option a contract's test is marked skipped with the option named; with it, left alone."""
    from types import SimpleNamespace

    import pytest

    from properties.plugin.contracts import CONTRACTS, skip_undeclared

    class Item(SimpleNamespace):
        def add_marker(self, mark):
            self.marks.append(mark)

    items = [Item(clauses=[clause], marks=[]) for clause in [*CONTRACTS, "ATTN-ORACLE"]]
    for declared in ({}, {"--deterministic": True}):
        for item in items:
            item.marks.clear()
        config = SimpleNamespace(getoption=lambda name: declared.get(name, False))
        skip_undeclared(config, items, lambda item: item.clauses)
        for item in items:
            wanted = CONTRACTS.get(item.clauses[0])
            if wanted is None or declared.get(wanted):
                assert not item.marks, item
            else:
                assert [m.kwargs["reason"] for m in item.marks] == [f"a declared contract: run with {wanted} to "
                                                                    f"check it"], item
                assert item.marks[0].name == pytest.mark.skip.name


def test_varying_order_is_no_leak():
    """An accurate kernel whose sums vary in order passes the clauses that compare two calls, within the bound where
    its repeats differ, and the coverage says so."""
    run = _passes("properties.catalog.contract_bugs:atomic_order_attention",
                  ("MASK-NO-INFLUENCE", "CAUSAL-NO-FUTURE", "DROPOUT-OFF"))
    compared = [r["coverage"].get("comparisons", {}) for r in run.rows if r["coverage"]]
    assert any(any(how.startswith("within") for how in c) for c in compared), compared
