"""The suite's power, checked the way a user runs it: every broken implementation of the bug catalog
(``properties.catalog.CATALOG``) fails one of its expected clauses, and the correct implementations
(``properties.catalog.CORRECT``) pass with zero failures.

Each run is ``pytest properties/ --kernel/--zoo/--model ARGUMENT --report-json PATH`` in a new pytest session
(``properties.catalog.run``). A broken entry runs only the tests of its expected clauses, stops at its first failure
and runs only their pinned ``@example`` cases (``--hypothesis-profile pinned``): it must be caught whatever
Hypothesis draws, because the default profile runs those cases first (a known bug class is never a coin flip).
Broken kernels plugged in the same way share a session, up to ``SESSION_SIZE`` of them, each on its own clauses and
stopped at its own first failure (``run_together``; one not caught there is run again alone). A correct entry runs
every test of its level, unrestricted, with a fresh seed: at the default profile, except the catalog's own SDPA kernels
(``own_kernel``), which run at the quick profile; the context-parallel kernels of the
distributed level (``--world-size 2``, the ranks started once per session) share a session per layout, broken and
correct apart, each kernel on its own clauses as above. The Hugging Face and torch.nn
examples, also correct implementations, are run by tests/test_examples.py. ``python -m
properties.catalog.mutation_report`` runs every entry on its whole level and reports the first failing clause and the
time to it.

The sessions are started two at a time (``CATALOG_JOBS``) when the first test here needs one. Under pytest-xdist a
worker runs a session when its first test needs it, and the workers share the results (a file per session in the
run's common temporary directory), so that no session runs twice.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

import properties.catalog
from properties.catalog import CATALOG, CORRECT, LEVELS, Entry, example_based
from properties.catalog.run import Run, run_entry, run_together, shareable
from properties.core.spec import load_clauses
from shared_runs import SharedRuns, common_directory
from zoo.nn.kernel import KERNELS

SEED = 0
# The examples are run by tests/test_examples.py; the zoo's three default kernels by the spec suite itself, which the
# test command runs (``pytest`` collects properties/: the same kernel level, at the default profile, on a fresh seed).
DEFAULT_KERNELS = {e.name for e in CORRECT if e.option == "--kernel" and e.argument in KERNELS and not e.extra}
CORRECT_HERE = [e for e in CORRECT if not e.needs_source_tree and e.name not in DEFAULT_KERNELS]
# Broken kernels per shared session: a session's start-up (collection, each kernel's limits probed) is paid once for
# all of them, and the catalog still splits into sessions enough for two jobs or two xdist workers.
SESSION_SIZE = 16
# Correct SDPA kernels per shared session: each runs its whole level at the default profile (tens of seconds), so
# that the sessions are few and still split between two jobs or two xdist workers.
CORRECT_SESSION_SIZE = 3


# Correct entries that differ from another correct entry only by the problems they decline: their numerics are the
# other entry's, verified with it ("tiled"); what is theirs is that declining breaks no clause and skips none wrongly,
# which the quick profile checks as tests/test_declines.py does (every pinned problem, fitted to the limits, plus 3
# draws per clause).
DECLINING_TWINS = {"tiled, a fused kernel's limits": "tiled"}
PINNED = dict(stop_first=True, seed=SEED, extra=("--hypothesis-profile", "pinned"))
QUICK = ("--hypothesis-profile", "quick")


def own_kernel(entry: Entry) -> bool:
    """The catalog's own correct SDPA kernels (properties/catalog/: the zoo's arithmetic in other orders, step by step,
    in tiles, in blocks of 3, with a hand-written backward, returning the LSE) run at the quick profile: each clause on
    every class it poses and every pinned problem, every run (a pair of classes costs a kernel 3x its classes alone).
    The pairs of classes are held every run at the default profile by the zoo's three kernels (the suite itself,
    properties/) and by PyTorch's own F.scaled_dot_product_attention here; the mutation report runs these at the
    default profile too."""
    return entry.level == "kernel" and entry.option == "--kernel" and entry.argument.startswith("properties.catalog.")


def _sessions() -> dict[str, list[Entry]]:
    """Session name -> its entries: the broken entries that can share a session, in slices of at most SESSION_SIZE,
    the correct SDPA kernels and the correct context-parallel kernels that can share one (a session per layout:
    starting the ranks and probing each kernel is most of a distributed session), and every other correct entry
    alone."""
    sessions = {}
    together = [e for e in CORRECT_HERE if e.level == "distributed" or (
        e.level == "kernel" and e.option == "--kernel" and e.name not in DECLINING_TWINS)]
    groups = [group for own in (True, False) for group in shareable([e for e in together if own_kernel(e) == own])]
    for group in [*shareable(CATALOG), *groups]:
        size = SESSION_SIZE if group[0].expected or group[0].level == "distributed" else CORRECT_SESSION_SIZE
        slices = math.ceil(len(group) / size)
        for i in range(slices):
            part = group[i * len(group) // slices:(i + 1) * len(group) // slices]
            sessions[part[0].name if len(part) == 1 else f"{part[0].name}+{len(part) - 1}"] = part
    return {**sessions, **{e.name: [e] for e in CORRECT_HERE if e not in together}}


SESSIONS = _sessions()
SESSION_OF = {e.name: name for name, entries in SESSIONS.items() for e in entries}


def _run_entries(entries: list[Entry]) -> list[Run]:
    """The runs of ``entries``: a session's, or the part of it a selection (-k) chose."""
    if entries[0].expected:
        return run_together(entries, **PINNED)
    quick = QUICK if own_kernel(entries[0]) or entries[0].name in DECLINING_TWINS else ()
    if len(entries) > 1 or entries[0].level == "distributed":   # correct kernels sharing a session: every clause,
        return run_together(entries, extra=quick)                 # a fresh seed, as if alone
    return [run_entry(entries[0], extra=quick)]


def _run_session(name: str) -> list[Run]:
    return _run_entries(SESSIONS[name])


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """name -> a callable returning its Run: under pytest-xdist, the worker's share of the sessions (``SharedRuns``);
    else every selected entry's session started at once, two at a time."""
    if hasattr(request.config, "workerinput"):
        shared = SharedRuns(common_directory(tmp_path_factory), _run_session, prefix="catalog-session")
        cache: dict[str, list[Run]] = {}

        def result(name: str) -> Run:
            session = SESSION_OF[name]
            if session not in cache:
                cache[session] = shared.runs(session)
            return next(run for run in cache[session] if run.entry.name == name)
        yield result
        return
    selected = {item.callspec.params["entry"].name for item in request.session.items
                if item.module.__name__ == __name__ and hasattr(item, "callspec") and "entry" in item.callspec.params}
    chosen = {name: [e for e in entries if e.name in selected] for name, entries in SESSIONS.items()}
    with ThreadPoolExecutor(max_workers=int(os.environ.get("CATALOG_JOBS", "2"))) as pool:
        futures: dict[str, Future] = {}
        for name, entries in chosen.items():
            if entries:
                future = pool.submit(_run_chosen, name, entries)
                futures.update({e.name: future for e in entries})
        yield lambda name: next(run for run in futures[name].result() if run.entry.name == name)


def _run_chosen(name: str, entries: list[Entry]) -> list[Run]:
    return _run_entries(entries)


def _explain(run: Run) -> str:
    return f"{' '.join(run.command[2:])}\nexit status {run.returncode}\n{run.output[-3000:]}"


@pytest.mark.parametrize("document", ["README.md", "docs/catalog.md"])
def test_the_documents_count_the_catalog(document):
    import re
    from pathlib import Path
    text = " ".join((Path(__file__).resolve().parents[1] / document).read_text(encoding="utf-8").split())
    said = re.search(r"(\d+) deliberately broken implementations \((\d+) kernels, (\d+) modules, (\d+) models, "
                     r"(\d+) context-parallel kernels;", text)
    assert said, f"{document} no longer counts the catalog's broken implementations"
    levels = [e.level for e in CATALOG]
    assert tuple(int(n or 0) for n in said.groups()) == (len(CATALOG), *(levels.count(level) for level in LEVELS))
    assert re.search(rf"\b{len(CORRECT)} correct implementations", text), f"{document}: not {len(CORRECT)} correct"


def test_catalog_is_well_formed():
    clauses = load_clauses()
    names = [e.name for e in CATALOG + CORRECT]
    assert len(names) == len(set(names)), "entry names must be unique"
    here = {e.name for e in CORRECT_HERE}
    assert all(name in here and twin in here for name, twin in DECLINING_TWINS.items()), DECLINING_TWINS
    assert sorted(SESSION_OF) == sorted(e.name for e in CATALOG + CORRECT_HERE)
    assert len(CATALOG) >= 30
    assert {e.level for e in CATALOG} == set(LEVELS)
    for entry in CATALOG:
        assert entry.expected, f"{entry.name}: no expected clause"
        unknown = [c for c in entry.expected if c not in clauses]
        assert not unknown, f"{entry.name}: clauses not in SPEC.md: {unknown}"
        assert entry.mechanism and "\n" not in entry.mechanism
    assert all(not e.expected for e in CORRECT)
    # every module that declares an entry is listed: an unlisted one would leave its entries out unseen
    from properties.catalog import MODULES
    catalog = Path(properties.catalog.__file__).parent
    declaring = {f"properties.catalog.{path.stem}" for path in catalog.glob("*.py") if path.stem != "registry"
                 and any(word in path.read_text(encoding="utf-8") for word in ("@bug(", "@module_bug(", "@correct(",
                                                                              "\ndeclare("))}
    assert declaring <= set(MODULES), sorted(declaring - set(MODULES))


def test_registry_computes_the_plug_in_and_refuses_what_it_cannot_find(monkeypatch):
    import types

    from properties.catalog import registry
    monkeypatch.setattr(registry, "_DECLARED", [])
    module = types.ModuleType("catalog_fake_bugs")
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def attention(q, k, v):
        return q
    attention.__module__ = module.__name__

    class Broken:
        def __call__(self, q, k, v):
            return q
    Broken.__module__ = module.__name__
    registry.bug("ATTN-ORACLE", mechanism="m")(attention)
    registry.bug("WINDOW-BOUNDS", api="flash", mechanism="m", instance="broken")(Broken)
    registry.bug("CP-GRAD", level="distributed", extra=("--world-size", "2", "--shard", "zigzag"), mechanism="m",
                 instance="ranks")(Broken)
    registry.module_bug("part_bug", "ffn=gelu ffn._target_={target}", "FFN-FORMULA", mechanism="m")(Broken)
    module.attention, module.broken, module.ranks = attention, Broken, Broken()
    with pytest.raises(ValueError, match="catalog_fake_bugs.broken is not an instance of"):
        registry.entries([module.__name__])
    module.broken = Broken()
    broken, correct = registry.entries([module.__name__])
    assert [(e.name, e.level, e.option, e.argument, e.extra) for e in broken] == [
        ("attention", "kernel", "--kernel", "catalog_fake_bugs:attention", ()),
        ("flash_broken", "kernel", "--kernel-api=flash", "--kernel=catalog_fake_bugs:broken", ()),
        ("part_bug", "module", "--zoo", "ffn=gelu ffn._target_=catalog_fake_bugs." + Broken.__qualname__, ()),
        ("ranks", "distributed", "--kernel", "catalog_fake_bugs:ranks", ("--world-size", "2", "--shard", "zigzag"))]
    assert correct == [] and broken[1].api == "flash" and broken[1].spec == "catalog_fake_bugs:broken"
    with pytest.raises(ValueError, match="not listed: \\['catalog_fake_bugs'\\]"):
        registry.entries([])
    registry.bug("MODEL-PADDING", level="model", mechanism="m")(attention)
    with pytest.raises(ValueError, match=r"declared twice: \['attention'\]"):
        registry.entries([module.__name__])
    with pytest.raises(TypeError, match="instance="):
        registry.bug("ATTN-ORACLE", mechanism="m")(Broken)
    with pytest.raises(ValueError, match="names the clauses"):
        registry.bug(mechanism="m")
    with pytest.raises(ValueError, match="needs --world-size W"):   # a context-parallel kernel runs on ranks
        registry.bug("CP-GRAD", level="distributed", mechanism="m")(attention)


@pytest.mark.parametrize("entry", CATALOG, ids=[e.name for e in CATALOG])
def test_broken_implementation_fails_an_expected_clause(runs, entry):
    run = runs(entry.name)
    assert run.returncode == 1 and run.rows, f"the suite did not run to a failure:\n{_explain(run)}"
    failed = run.failed_clauses
    assert set(failed) & set(entry.expected), (f"{entry.name} ({entry.mechanism}): expected one of "
                                               f"{entry.expected} to fail, failed: {failed}\n{_explain(run)}")


@pytest.mark.parametrize("entry", CORRECT_HERE, ids=[e.name for e in CORRECT_HERE])
def test_correct_implementation_passes(runs, entry):
    run = runs(entry.name)
    failures = [f"{t['nodeid']}: {t['message']}" for t in run.tests if t["status"] in ("failed", "error")]
    assert run.returncode == 0 and not failures, f"false alarm on {entry.name}: {failures}\n{_explain(run)}"
    # The distributed level has 12 clause tests; CP-SHARD-EDGES, CP-DETERMINISTIC and CP-BATCH-INVARIANT skip for a
    # kernel that declines unequal shards and declares neither contract; a merge kernel has two clauses (MERGE-ORACLE,
    # MERGE-EMPTY).
    least = 9 if entry.level == "distributed" else 2 if entry.api == "merge" else 10
    assert sum(t["status"] == "passed" for t in run.tests) >= least, f"too few tests ran:\n{_explain(run)}"


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
    # The pinned profile and two module-level entries (the cheapest runs of a whole level), one at a time (one
    # session server): this checks the command's report (its table, counts and JSON fields); that each broken entry
    # is caught and each correct one passes is what the tests above check, the example-based column what
    # test_example_based_* check.
    proc = subprocess.run([sys.executable, "-m", "properties.catalog.mutation_report", "--only",
                           "gqa_heads_interleaved", "--only", "nn.MultiheadAttention", "--profile", "pinned", "--jobs",
                           "1", "--json", str(report)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| gqa_heads_interleaved | module | MHA-GQA | caught | " in proc.stdout, proc.stdout
    assert "Caught: 1/1 broken implementations" in proc.stdout and "False alarms: 0/1" in proc.stdout, proc.stdout
    rows = {r["name"]: r for r in json.loads(report.read_text())["rows"]}
    broken = rows["gqa_heads_interleaved"]
    assert broken["time_to_first_failure_s"] > 0 and broken["startup_s"] > 0 and broken["first_failing_clause"]
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
