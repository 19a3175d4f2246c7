"""The suite's power, checked the way a user runs it: every broken implementation of the bug catalog
(``properties.catalog.CATALOG``) fails one of its expected clauses, and the correct implementations
(``properties.catalog.CORRECT``) pass with zero failures.

Each run is ``pytest properties/ --kernel/--zoo/--model ARGUMENT --report-json PATH`` in a subprocess
(``properties.catalog.run``). A broken entry runs only the tests of its expected clauses (``--catalog-clause``),
stops at the first failure (``-x``) and runs only their pinned ``@example`` cases (``--hypothesis-profile
pinned``): it must be caught whatever Hypothesis draws, because the default profile runs those cases first
(a known bug class is never a coin flip). A correct one runs every test of its level, unrestricted, at the
default profile with a fresh seed. The Hugging Face and torch.nn examples, also
correct implementations, are run by tests/test_examples.py. ``python -m properties.catalog.mutation_report`` runs every
entry on its whole level and reports the first failing clause and the time to it.

Runs are started two at a time (``CATALOG_JOBS``) when the first test here needs one; under pytest-xdist each
test runs its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from properties.catalog import CATALOG, CORRECT, LEVELS, Entry, example_based
from properties.catalog.run import Run, run_entry
from properties.core.spec import load_clauses
from zoo.nn.kernel import KERNELS

SEED = 0
# The examples are run by tests/test_examples.py; the zoo's three default kernels by the spec suite itself, which the
# test command runs (``pytest`` collects properties/: the same kernel level, at the default profile, on a fresh seed).
DEFAULT_KERNELS = {e.name for e in CORRECT if e.option == "--kernel" and e.argument in KERNELS and not e.extra}
CORRECT_HERE = [e for e in CORRECT if not e.needs_source_tree and e.name not in DEFAULT_KERNELS]


# Correct entries that differ from another correct entry only by the problems they decline: their numerics are the
# other entry's, verified at the default profile ("tiled"); what is theirs is that declining breaks no clause and
# skips none wrongly, which the quick profile checks as tests/test_declines.py does (every pinned problem, fitted to
# the limits, plus 3 draws per clause).
DECLINING_TWINS = {"tiled, a fused kernel's limits": "tiled"}


def _options(entry: Entry) -> dict:
    if entry.expected:
        return dict(clauses=entry.expected, stop_first=True, seed=SEED, extra=("--hypothesis-profile", "pinned"))
    if entry.name in DECLINING_TWINS:
        return dict(extra=("--hypothesis-profile", "quick"))
    return {}


@pytest.fixture(scope="module")
def runs(request):
    """name -> Future[Run], all started at once (two at a time) unless under pytest-xdist."""
    if hasattr(request.config, "workerinput"):
        yield None
        return
    selected = {item.callspec.params["entry"].name for item in request.session.items
                if item.module.__name__ == __name__ and hasattr(item, "callspec") and "entry" in item.callspec.params}
    entries = [e for e in CATALOG + CORRECT_HERE if e.name in selected]
    with ThreadPoolExecutor(max_workers=int(os.environ.get("CATALOG_JOBS", "2"))) as pool:
        yield {e.name: pool.submit(run_entry, e, **_options(e)) for e in entries}


def _run(runs, entry: Entry) -> Run:
    future: Future | None = None if runs is None else runs.get(entry.name)
    return future.result() if future is not None else run_entry(entry, **_options(entry))


def _explain(run: Run) -> str:
    return f"{' '.join(run.command[2:])}\nexit status {run.returncode}\n{run.output[-3000:]}"


@pytest.mark.parametrize("document", ["README.md", "docs/catalog.md"])
def test_the_documents_count_the_catalog(document):
    import re
    from pathlib import Path
    text = " ".join((Path(__file__).resolve().parents[1] / document).read_text(encoding="utf-8").split())
    said = re.search(r"(\d+) deliberately broken implementations \((\d+) kernels, (\d+) modules, (\d+) models;", text)
    assert said, f"{document} no longer counts the catalog's broken implementations"
    levels = [e.level for e in CATALOG]
    assert tuple(map(int, said.groups())) == (len(CATALOG), *(levels.count(level) for level in LEVELS))
    assert re.search(rf"\b{len(CORRECT)} correct implementations", text), f"{document}: not {len(CORRECT)} correct"


def test_catalog_is_well_formed():
    clauses = load_clauses()
    names = [e.name for e in CATALOG + CORRECT]
    assert len(names) == len(set(names)), "entry names must be unique"
    here = {e.name for e in CORRECT_HERE}
    assert all(name in here and twin in here for name, twin in DECLINING_TWINS.items()), DECLINING_TWINS
    assert len(CATALOG) >= 30
    assert {e.level for e in CATALOG} == set(LEVELS)
    for entry in CATALOG:
        assert entry.expected, f"{entry.name}: no expected clause"
        unknown = [c for c in entry.expected if c not in clauses]
        assert not unknown, f"{entry.name}: clauses not in SPEC.md: {unknown}"
        assert entry.mechanism and "\n" not in entry.mechanism
    assert all(not e.expected for e in CORRECT)


@pytest.mark.parametrize("entry", CATALOG, ids=[e.name for e in CATALOG])
def test_broken_implementation_fails_an_expected_clause(runs, entry):
    run = _run(runs, entry)
    assert run.returncode == 1 and run.rows, f"the suite did not run to a failure:\n{_explain(run)}"
    failed = run.failed_clauses
    assert set(failed) & set(entry.expected), (f"{entry.name} ({entry.mechanism}): expected one of "
                                               f"{entry.expected} to fail, failed: {failed}\n{_explain(run)}")


@pytest.mark.parametrize("entry", CORRECT_HERE, ids=[e.name for e in CORRECT_HERE])
def test_correct_implementation_passes(runs, entry):
    run = _run(runs, entry)
    failures = [f"{t['nodeid']}: {t['message']}" for t in run.tests if t["status"] in ("failed", "error")]
    assert run.returncode == 0 and not failures, f"false alarm on {entry.name}: {failures}\n{_explain(run)}"
    assert sum(t["status"] == "passed" for t in run.tests) >= 10, f"too few tests ran:\n{_explain(run)}"


# ------------------------------------------------------------------ the baseline and the report command
@pytest.mark.parametrize("spec", ["torch.nn.functional:scaled_dot_product_attention", "math",
                                  "properties.catalog.correct:stepwise_attention",
                                  "properties.catalog.correct:flash_attention"])
def test_example_based_baseline_passes_correct_kernels(spec):
    # the forward half: its gradient half has documented false alarms (example_based's docstring, docs/catalog.md)
    result = example_based.run(spec, gradients=False)
    assert result.cases == len(example_based.GRID) and not result.failures, result.failures[:3]


def test_example_based_baseline_fails_a_wrong_scale():
    result = example_based.run("properties.catalog.kernels:scale_missing", stop_first=True)
    assert result.caught and "max |out - out_ref|" in result.failures[0]


def test_mutation_report_command(tmp_path):
    report = tmp_path / "report.json"
    # The pinned profile: this checks the command's report (its table, counts and JSON fields); that each broken
    # entry is caught and each correct one passes at the default profile is what the tests above check.
    proc = subprocess.run([sys.executable, "-m", "properties.catalog.mutation_report", "--only", "gqa_heads_tiled",
                           "--only", "nn.MultiheadAttention", "--profile", "pinned", "--json", str(report)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| gqa_heads_tiled | kernel | GQA-HEADS | caught | GQA-HEADS |" in proc.stdout, proc.stdout
    assert "Caught: 1/1 broken implementations" in proc.stdout and "False alarms: 0/1" in proc.stdout, proc.stdout
    rows = {r["name"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["gqa_heads_tiled"]["time_to_first_failure_s"] > 0 and rows["gqa_heads_tiled"]["startup_s"] > 0
    assert rows["nn.MultiheadAttention"]["status"] == "passed"


@pytest.mark.parametrize("command, argv, message", [
    ("mutation_report", ["--profile", "nope"], "argument --profile: invalid choice: 'nope'"),
    ("mutation_report", ["--only", "no_such_entry"], "--only ['no_such_entry']: no such entry"),
    ("flakiness", ["--only", "no_such_entry"], "--only ['no_such_entry']: no such subject"),
])
def test_report_commands_refuse_bad_options_in_one_line(capsys, command, argv, message):
    import importlib
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"properties.catalog.{command}").main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
