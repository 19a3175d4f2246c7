"""Declared contracts: clauses a kernel or model is held to only when the run asks for them (SPEC.md, "Declared
contracts"). ``--deterministic``: repeated calls on the same inputs, forward and backward, are bitwise equal
(KERNEL-DETERMINISTIC, MODEL-DETERMINISTIC). ``--batch-invariant``: a sequence's result is bitwise the same whatever
else is in its batch (KERNEL-BATCH-INVARIANT, MODEL-BATCH-INVARIANT). ``--returns-lse``: the kernel returns
(output, lse), and the LSE is the log-sum-exp of each query's scores (LSE-ORACLE, LSE-GRAD). Without the option their
tests are skipped with the reason, so a default run neither pays for them nor fails a kernel that never promised them.
"""
from __future__ import annotations

import pytest

__all__ = ["CONTRACTS", "skip_undeclared"]

# clause -> the option that declares it
CONTRACTS = {"KERNEL-DETERMINISTIC": "--deterministic", "MODEL-DETERMINISTIC": "--deterministic",
             "KERNEL-BATCH-INVARIANT": "--batch-invariant", "MODEL-BATCH-INVARIANT": "--batch-invariant",
             "CP-DETERMINISTIC": "--deterministic", "CP-BATCH-INVARIANT": "--batch-invariant",
             "LSE-ORACLE": "--returns-lse", "LSE-GRAD": "--returns-lse"}


def skip_undeclared(config, items, clause_ids) -> None:
    """Mark the tests of a contract the run did not declare as skipped, with the option that declares it."""
    for item in items:
        options = sorted({CONTRACTS[c] for c in clause_ids(item) if c in CONTRACTS})
        undeclared = [o for o in options if not config.getoption(o)]
        if undeclared:
            item.add_marker(pytest.mark.skip(reason=f"a declared contract: run with {' '.join(undeclared)} to "
                                                    f"check it"))
