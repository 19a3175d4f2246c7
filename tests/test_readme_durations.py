"""The durations README.md and the pages of docs/ state stay true (issue 18): each one, written in bold
(**64 s**, **9 min**), names the measurement it comes from in bench/results.json with an HTML comment on the same
line, <!-- measured: KEY -->, KEY a dotted path such as train_targets.reverse.cpu_seconds (FILE:KEY for another
JSON file in bench/, such as results_quick.json:wall_seconds), and must lie within 1.5x of it. Not a timed test: it
reads the documents and the records. The records are written by the commands that measure:
`python -m bench.train_targets` ("train_targets"), `python -m bench.suite` ("suite"; `--test-command`:
"test_command"), `python -m bench`."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README, RESULTS = ROOT / "README.md", ROOT / "bench" / "results.json"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]  # where the README's prose and tables moved (issue 31)
TRAINING = ROOT / "docs" / "training.md"  # the Targets table
TOLERANCE = 1.5  # measurements on a shared machine scatter; a stale statement is off by more than this
DURATION = re.compile(r"\*\*(\d+(?:\.\d+)?) (s|min|h)\*\*")
RECORD = re.compile(r"<!-- measured: ((?:[\w\-]+\.json:)?[\w.\-]+) -->")  # KEY, or FILE:KEY for bench/FILE
SECONDS_PER = {"s": 1, "min": 60, "h": 3600}


def stated_durations(text: str) -> list[tuple[int, str, float, str | None]]:
    """(line number, the bold text, seconds, record key or None) for every bold duration in text; the key is the
    first <!-- measured: KEY --> after it on its line."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in DURATION.finditer(line):
            record = RECORD.search(line, match.end())
            found.append((number, match.group(0), float(match.group(1)) * SECONDS_PER[match.group(2)],
                          record.group(1) if record else None))
    return found


def recorded_seconds(results: dict, key: str) -> float:
    """The seconds recorded at a dotted KEY of results (bench/results.json), or at KEY of bench/FILE for FILE:KEY."""
    if ":" in key:
        name, key = key.split(":", 1)
        path = RESULTS.parent / name
        if not path.is_file():
            raise KeyError(f"bench/{name} does not exist")
        results = json.loads(path.read_text())
    node = results
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"bench/results.json has no {key} (missing {part!r})")
        node = node[part]
    if not isinstance(node, (int, float)) or node <= 0:
        raise KeyError(f"bench/results.json: {key} is {node!r}, not a duration in seconds")
    return float(node)


def drift(text: str, results: dict, name: str = "README.md") -> list[str]:
    """What is wrong with the durations stated in text (the document `name`): no record named, a record missing,
    or off by > 1.5x."""
    problems = []
    for number, bold, seconds, key in stated_durations(text):
        if key is None:
            problems.append(f"{name}:{number}: {bold} names no measurement (add <!-- measured: KEY -->)")
            continue
        try:
            measured = recorded_seconds(results, key)
        except KeyError as error:
            problems.append(f"{name}:{number}: {bold}: {error.args[0]}")
            continue
        if max(seconds / measured, measured / seconds) > TOLERANCE:
            problems.append(f"{name}:{number}: {bold} but {key} records {measured:.0f} s "
                            f"(more than {TOLERANCE}x apart: measure again or correct the page)")
    return problems


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_duration_a_document_states_is_within_tolerance_of_its_recorded_measurement(document):
    problems = drift(document.read_text(), json.loads(RESULTS.read_text()), str(document.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_readme_and_the_benchmarks_page_state_measured_durations():
    for document in (README, ROOT / "docs" / "benchmarks.md"):
        assert stated_durations(document.read_text()), f"{document.name} states no duration in bold: nothing checked"


@pytest.mark.parametrize("line,problem", [
    ("took **64 s** wall <!-- measured: train_targets.reverse.seconds -->", None),
    ("took **1.2 min** <!-- measured: train_targets.reverse.seconds -->", None),       # 72 s against 64 s
    ("took **30 s** wall <!-- measured: train_targets.reverse.seconds -->", "more than 1.5x apart"),
    ("took **2 min** wall <!-- measured: train_targets.reverse.seconds -->", "more than 1.5x apart"),
    ("took **64 s** wall", "names no measurement"),
    ("took **64 s** wall <!-- measured: train_targets.sort.seconds -->", "has no train_targets.sort.seconds"),
    ("took **64 s** <!-- measured: train_targets.reverse -->", "not a duration in seconds"),
    ("took **64 s** <!-- measured: no_such_file.json:wall_seconds -->", "bench/no_such_file.json does not exist"),
])
def test_the_check_catches_a_drifted_unrecorded_or_unknown_duration(line, problem):
    results = {"train_targets": {"reverse": {"seconds": 64.0}}}
    problems = drift(line, results)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_training_targets_table_is_the_report_of_the_recorded_runs():
    """The Targets table (accuracy and times) is what `python -m bench.report --only train_targets` prints from
    the JSON, so no number in it can be edited by hand or left behind by a new measurement."""
    from bench.report import train_targets_markdown

    table = train_targets_markdown(json.loads(RESULTS.read_text()))
    assert table, "bench/results.json records no training targets (python -m bench.train_targets)"
    assert "\n".join(table).strip() in TRAINING.read_text()


def test_benchmark_tables_are_the_report_of_the_recorded_runs():
    """docs/benchmarks.md's CPU tables and training step table, and docs/training.md's seeds table, are what
    `python -m bench.report` prints from the JSON (the training step's own introduction is the page's prose)."""
    from bench.report import markdown

    results = json.loads(RESULTS.read_text())
    main = markdown(results).split("One attention training step")[0].strip()
    training = [line for line in markdown(results, "training").splitlines() if line.startswith("|")]
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert main and main in page, "docs/benchmarks.md: run python -m bench.report bench/results.json again"
    assert training and "\n".join(training) in page
    assert markdown(results, "seeds").strip() in TRAINING.read_text()


def test_the_measuring_run_writes_the_durations_it_measured(tmp_path):
    from bench.suite import write_readme_durations
    page = tmp_path / "README.md"
    page.write_text("They take **13 min** <!-- measured: test_command.seconds --> on a 2-core CPU.\n"
                    "The kernel recipe: **40 s** <!-- measured: recipes.kernel.seconds -->; **9 s** unmeasured.\n")
    changes = write_readme_durations({"test_command": {"seconds": 455.0}, "recipes": {"kernel": {"seconds": None}}},
                                     page)
    assert changes == ["test_command.seconds: 13 min -> 8 min"]
    assert page.read_text().splitlines() == [
        "They take **8 min** <!-- measured: test_command.seconds --> on a 2-core CPU.",
        "The kernel recipe: **40 s** <!-- measured: recipes.kernel.seconds -->; **9 s** unmeasured."]
