"""The spec suite's reports (properties/plugin/suite.py calls ``configure_report`` and registers this module for its
hooks): each failure opens with the text of the clauses it violates, and ``--report-json PATH`` gets one record per
(test, clause) with its status, duration, message, Hypothesis' counterexample and, for a kernel clause, its coverage
(problems run and declined with the reasons grouped, the largest L, S and E reached, the dtypes:
properties/kernel/coverage.py), which the terminal summary also prints.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from properties.kernel import coverage
from properties.core import evidence
from properties.repro import write as reproducers
from properties.core.levels import in_suite, level_of
from properties.core.spec import load_clauses
from properties.core.subject import called_dtypes
from properties.model.twin import ISLANDS, NOT_CHECKED, ON_TWIN, pop_notes, pop_precision
from zoo.io.atomic import write_text

__all__ = ["clause_ids", "configure_report", "configure_reproducers", "write_coverage", "write_model_basis",
           "write_reproducers", "unverified", "model_basis", "pytest_runtest_makereport", "pytest_runtest_logreport",
           "pytest_sessionfinish", "pytest_configure_node", "pytest_unconfigure", "remove_empty_run_dir", "run_dir",
           "pytest_collection_modifyitems"]

_records: dict[str, dict] = {}  # nodeid -> outcome over its phases, for --report-json


def _report_path_problem(path: str) -> str | None:
    """Why --report-json PATH could not be written at the end of the run (checked before it starts), or None."""
    from zoo.io.atomic import unwritable_file
    return unwritable_file(path)


def configure_report(config) -> None:
    """Refuse a --report-json PATH that could not be written at the end (a UsageError now); start afresh."""
    report_json = config.getoption("--report-json", None)
    if report_json is not None and (problem := _report_path_problem(report_json)):
        raise pytest.UsageError(f"--report-json {report_json}: cannot be written: {problem}")
    _refuse_shared_outputs(config)
    _records.clear()


def _refuse_shared_outputs(config) -> None:
    """Two outputs on one path would lose one of them at the end of the run (the last writer wins): refused now, as is
    a report inside the reproducer directory."""
    if hasattr(config, "workerinput"):
        return
    outputs = [(option, value) for option, value in (
        ("--report-json", config.getoption("--report-json", None)),
        ("--junitxml", getattr(config.option, "xmlpath", None)),
        ("--report-log", getattr(config.option, "report_log", None)),
        ("--resultlog", getattr(config.option, "resultlog", None))) if value]
    resolved = [(option, Path(value).expanduser().resolve()) for option, value in outputs]
    for i, (option, path) in enumerate(resolved):
        for other, other_path in resolved[:i]:
            if path == other_path:
                raise pytest.UsageError(f"{other} and {option} name the same file {outputs[i][1]}: one would overwrite "
                                        f"the other; give each its own path")
    repro = config.getoption("--repro-dir", None)
    if repro:
        folder = Path(repro).expanduser().resolve()
        for (option, path), (_, given) in zip(resolved, outputs):
            if path == folder or folder in path.parents:
                raise pytest.UsageError(f"{option} {given}: inside --repro-dir {repro}, which holds only reproducers; "
                                        f"write the report elsewhere")


def clause_ids(item) -> list[str]:
    return [cid for mark in item.iter_markers("clause") for cid in mark.args]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    ids = clause_ids(item) if in_suite(item) else []
    report.level = level_of(item)
    report.clauses = ids  # survives pytest-xdist's report serialization (plain attribute)
    report.subject = _subject(item, report.level) if ids else ""
    mut = getattr(item, "funcargs", {}).get("mut")
    report.resolution = mut.resolution if mut is not None and hasattr(mut, "resolution") else ""
    # A model clause that ran in the model's own precision because its float64 twin departs says so (model/twin.py).
    report.note = "; ".join(pop_notes()) if call.when == "call" and mut is not None else ""
    # Where its comparisons ran: the float64 twin, or the model's own precision and why (model/twin.py).
    report.precision = pop_precision() if call.when == "call" and mut is not None else ""
    report.coverage = coverage.record_of(item.nodeid) if call.when == "call" else None
    # The dtypes the model was called in during this test (its float64 twin's and its own), for the report.
    report.model_dtypes = called_dtypes() if call.when == "call" and mut is not None else []
    report.repro = None
    report.repro_missing = ""
    if call.when == "setup":
        evidence.clear()
    if report.failed and ids:
        clauses = load_clauses()
        report.sections.insert(0, (f"spec clause {', '.join(ids)}",
                                   "\n\n".join(clauses[i].describe() for i in ids)))
        if call.when == "call" and evidence.active():   # --repro-dir: the script of this failure
            from properties.core.watchdog import CallTimeout
            if call.excinfo is not None and call.excinfo.errisinstance(CallTimeout):   # its script would hang too
                evidence.clear()
                report.repro_missing = "a call did not return within --call-timeout; a script would hang too"
            else:
                evidence.use_failing_example()
                report.repro, report.repro_missing = reproducers.write(clauses[ids[0]], item.nodeid,
                                                                       _counterexample(report))
    if call.when == "call" and ids:   # --junitxml writes the item's properties with its test case
        item.user_properties.append(("clauses", " ".join(ids)))
        if report.failed:
            item.user_properties.append(("failure", _message(report)))
        if report.coverage:
            item.user_properties.append(("coverage", json.dumps(report.coverage)))
        if report.repro:
            item.user_properties.append(("repro", report.repro))
        elif report.repro_missing:
            item.user_properties.append(("repro_missing", report.repro_missing))
    return report


def _subject(item, level: str | None) -> str:
    """What a clause test verifies, as the verdict names it: 'kernel NAME', 'model KEY', 'modules' ('' for a test
    of no subject, such as an SDPA clause's placeholder under a flash API)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if level == "kernel":
        kernel = next((v for k, v in params.items() if k.endswith("kernel") and hasattr(v, "name")), None)
        return f"kernel {kernel.name}" if kernel is not None else ""
    if level == "model":
        return f"model {params['mut']}" if isinstance(params.get("mut"), str) else ""
    return "the zoo's modules" if level == "module" else ""


_HYPOTHESIS_MARKERS = ("Falsifying example:", "Failing explicit example:", "Failing test case:")  # its wordings


def _message(report) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):  # without the example Hypothesis notes on it
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        return min((reason[:i] for i in (reason.find(m) for m in _HYPOTHESIS_MARKERS) if i >= 0), key=len,
                   default=reason).strip()
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]


def _counterexample(report) -> str:
    """Hypothesis' minimal failing input ("Falsifying example: test(case=..., ...)"), as one line."""
    text = str(report.longrepr)
    starts = [i for i in (text.find(marker) for marker in _HYPOTHESIS_MARKERS) if i >= 0]
    if not starts:
        return ""
    parts = []
    for line in text[min(starts):].splitlines():
        line = line.removeprefix("E").strip()
        parts.append(line)
        if line == ")" or (len(parts) == 1 and line.endswith(")")):
            break
    return " ".join(" ".join(parts).replace("( ", "(").replace(", )", ")").split())


def pytest_runtest_logreport(report):
    ids = getattr(report, "clauses", None)
    if not ids:
        return
    record = _records.setdefault(report.nodeid, {"clauses": ids, "level": getattr(report, "level", None),
                                                "status": "passed", "duration_s": 0.0,
                                                "message": "", "counterexample": "",
                                                "resolution": getattr(report, "resolution", ""), "note": "",
                                                "precision": "", "subject": getattr(report, "subject", ""),
                                                "model_dtypes": []})
    record["model_dtypes"] = sorted(set(record["model_dtypes"]) | set(getattr(report, "model_dtypes", None) or ()))
    record["duration_s"] += report.duration
    record["note"] = record["note"] or getattr(report, "note", "")
    record["precision"] = record["precision"] or getattr(report, "precision", "")
    if getattr(report, "coverage", None):
        record["coverage"] = report.coverage
    if getattr(report, "repro", None):
        record["repro"] = report.repro
    if getattr(report, "repro_missing", ""):
        record["repro_missing"] = report.repro_missing
    if report.failed:
        status = "failed" if report.when == "call" else "error"
        if record["status"] not in ("failed", "error"):
            record["status"], record["message"] = status, _message(report)
            record["counterexample"] = _counterexample(report)
    elif report.skipped and record["status"] == "passed":
        record["status"], record["message"] = "skipped", _message(report)


def write_coverage(terminalreporter) -> None:
    """The per-clause coverage of the kernel clauses (properties/kernel/coverage.py) at the end of the run."""
    rows = [{**r, "clauses": r["clauses"]} for r in _records.values() if r.get("coverage")]
    lines = coverage.summary_lines(rows, verbose=terminalreporter.config.getoption("verbose") > 0)
    lines += sorted({r["message"] for r in _records.values()   # kernels that decline every problem on a device
                     if r["status"] == "skipped" and " declines every problem on " in r["message"]})
    if lines:
        terminalreporter.write_sep("=", "kernel clause coverage (problems run and declined; largest L, S, E; dtypes)")
        for line in lines:
            terminalreporter.write_line(line)


def unverified() -> str:
    """'' when a test of some subject of the run ran (passed or failed); when every one was skipped (each problem
    declined, each clause skipped, the device absent), one line naming each subject and its most frequent reason.
    A run that verified one subject and not another passes: its coverage report names what was not covered."""
    from collections import Counter, defaultdict
    statuses, reasons = defaultdict(Counter), defaultdict(Counter)
    for record in _records.values():
        if record.get("subject"):
            statuses[record["subject"]][record["status"]] += 1
            if record["status"] == "skipped":
                reasons[record["subject"]][record["message"]] += 1
    if not statuses or any(set(count) != {"skipped"} for count in statuses.values()):
        return ""
    parts = []
    for name, count in statuses.items():
        reason, _ = reasons[name].most_common(1)[0]
        reason = reason if len(reason) <= 240 else reason[:237] + "..."
        parts.append(f"{name}: all {count['skipped']} of its tests skipped ({reason})")
    return "; ".join(parts)


def _nothing_verified(session) -> None:
    """A run that verified nothing never passes: one line, exit status 5 (pytest's "no tests ran"), unless the run
    already failed."""
    line = unverified()
    if line and session.exitstatus == pytest.ExitCode.OK:
        import sys
        sys.stderr.write(f"ERROR: nothing verified for {line}\n")
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


LACKS = "Subject."   # a model clause skipped because the subject leaves an optional field None ("Subject.X is None")


def _reason(why: str) -> str:
    """A fallback's reason in a few words: the twin gives NaN or inf, raises, or is refused."""
    if why.startswith("the twin departs"):
        if "raises " in why:
            return "the twin raises " + why.split("raises ", 1)[1].split(":")[0]
        return "the twin gives " + ("NaN" if "NaN" in why else "inf")
    return why


def model_basis(records) -> list[str]:
    """Per model clause: tests run on the float64 twin, tests in the model's own precision (why), tests skipped
    because the model lacks a feature. ``records``: the report's records (clauses, level, status, message,
    precision)."""
    by_clause: dict[str, dict] = {}
    for r in records:
        if r["level"] != "model":
            continue
        for cid in r["clauses"]:
            row = by_clause.setdefault(cid, {"twin": 0, "inside": set(), "own": {}, "lacks": set()})
            for note in (r.get("note") or "").split("; "):   # what the clause could not check, named
                if note.startswith((NOT_CHECKED, ISLANDS)):
                    prefix = NOT_CHECKED if note.startswith(NOT_CHECKED) else ISLANDS
                    row.setdefault(prefix, {}).update(dict.fromkeys(note.removeprefix(prefix).split(" | ")))
            if r["status"] == "skipped" and r["message"].startswith(LACKS):
                row["lacks"].add(r["message"].split(":")[0])
            elif r["status"] != "skipped" and r.get("precision", "").startswith(ON_TWIN):
                row["twin"] += 1
                row["inside"].add(r["precision"].removeprefix(ON_TWIN).strip())
            elif r["status"] != "skipped" and r.get("precision"):
                why = _reason(r["precision"].split(": ", 1)[-1])
                row["own"][why] = row["own"].get(why, 0) + 1
    lines = []
    for cid, row in sorted(by_clause.items()):
        inside = " ".join(sorted(filter(None, row["inside"])))
        parts = [f"{row['twin']} on the float64 twin" + (f" {inside}" if inside else "")] if row["twin"] or row["own"] \
            else []
        parts += [f"{n} in its own precision ({why})" for why, n in row["own"].items()]
        parts += [f"skipped: {lack}" for lack in sorted(row["lacks"])]
        parts += [prefix + ", ".join(row[prefix]) for prefix in (ISLANDS, NOT_CHECKED) if row.get(prefix)]
        if parts:
            lines.append(f"{cid}: " + "; ".join(parts))
    return lines


def write_model_basis(terminalreporter) -> None:
    """What the model clauses' passes rest on (model_basis), at the end of the run."""
    lines = model_basis(list(_records.values()))
    if lines:
        terminalreporter.write_sep("=", "model clauses: float64 twin or own precision; features the model lacks")
        for line in lines:
            terminalreporter.write_line(line)


def write_reproducers(terminalreporter) -> None:
    """The reproducers --repro-dir wrote, one line each (properties/repro/write.py)."""
    written = [(r["clauses"], r["repro"]) for r in _records.values() if r.get("repro")]
    missing = [(nodeid, r["repro_missing"]) for nodeid, r in _records.items() if r.get("repro_missing")]
    if written or missing:
        where = run_dir(terminalreporter.config)
        terminalreporter.write_sep("=", f"reproducers ({len(written)} in {where}; each exits 1 while its failure is "
                                        f"there, 0 once fixed, 2 if it cannot run)")
        for ids, path in written:
            terminalreporter.write_line(f"{', '.join(ids)}: python {path}")
        for nodeid, why in missing:   # never silently missing
            terminalreporter.write_line(f"no reproducer for {nodeid}: {why}")


_RUN_DIR = pytest.StashKey[str]()   # --repro-dir: this run's own subdirectory


def configure_reproducers(config) -> None:
    """--repro-dir DIR: keep the evidence of each comparison, and write a script for each failing clause into a fresh
    subdirectory of DIR made for this run (``DIR/run-<date>-<time>[-k]``), so that no file already in DIR, nor the
    target of a link there, is ever written: the controller makes it (pytest-xdist's workers are handed its name,
    ``pytest_configure_node``) and removes it at the end if no script was kept."""
    directory = config.getoption("--repro-dir", None)
    run_dir = None
    if directory is not None:
        run_dir = getattr(config, "workerinput", {}).get("repro_run_dir") or _fresh_run_dir(directory)
        config.stash[_RUN_DIR] = run_dir
    evidence.activate(run_dir, config.getoption("--causal-alignment", "top-left"))
    reproducers.reset()


def _fresh_run_dir(directory: str) -> str:
    import os
    import time
    from zoo.io.atomic import unwritable
    if problem := unwritable(directory):
        raise pytest.UsageError(f"--repro-dir {directory}: {problem}")
    base = Path(directory)
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(f"--repro-dir {directory}: cannot be made ({exc.strerror or exc})") from None
    stamp = time.strftime("run-%Y%m%d-%H%M%S")
    for k in range(1, 1000):
        candidate = base / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            os.mkdir(candidate)   # exclusive: a directory or link of that name already there is never reused
            return str(candidate)
        except FileExistsError:
            continue
        except OSError as exc:
            raise pytest.UsageError(f"--repro-dir {directory}: no subdirectory can be made there "
                                    f"({exc.strerror or exc})") from None
    raise pytest.UsageError(f"--repro-dir {directory}: 999 runs of this second already there")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist: each worker writes into the controller's run directory."""
    if _RUN_DIR in node.config.stash:
        node.workerinput["repro_run_dir"] = node.config.stash[_RUN_DIR]


def remove_empty_run_dir(config) -> None:
    """At the end of the controller's run: the run directory goes if it holds nothing (no failure left a script)."""
    if _RUN_DIR in config.stash and not hasattr(config, "workerinput"):
        try:
            Path(config.stash[_RUN_DIR]).rmdir()
        except OSError:   # it holds scripts (or went away): kept as it is
            pass


def pytest_unconfigure(config):
    remove_empty_run_dir(config)


def pytest_collection_modifyitems(config, items):
    """--repro-dir: each Hypothesis example starts with no evidence, so that a failure's script is built from the
    failing example's own comparisons, never from an earlier example's that passed (a record marked sticky, which
    later records of its test do not replace, would otherwise outlive its example), and a failing example's records
    are kept past the examples run after it (Hypothesis runs every explicit example, the passing ones after a
    failing one too). Hypothesis' documented hook for wrapping each example is the test's ``hypothesis.inner_test``."""
    if not evidence.active():
        return
    for item in items:
        handle = getattr(getattr(item, "obj", None), "hypothesis", None)
        inner = getattr(handle, "inner_test", None)
        if inner is None or getattr(inner, "_clears_evidence", False):
            continue

        def each_example(*args, _inner=inner, **kwargs):
            evidence.new_example()
            try:
                return _inner(*args, **kwargs)
            except BaseException:
                evidence.example_failed()
                raise
        each_example._clears_evidence = True
        handle.inner_test = each_example


def run_dir(config) -> str | None:
    """This run's reproducer directory (None without --repro-dir)."""
    return config.stash.get(_RUN_DIR, None)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # pytest-xdist: only the controller judges and writes
        return
    _nothing_verified(session)
    path = session.config.getoption("--report-json")
    if not path:
        return
    clauses = load_clauses()
    rows = [{"clause": cid, "title": clauses[cid].title, "level": r["level"], "status": r["status"], "nodeid": nodeid,
             "duration_s": round(r["duration_s"], 6), "message": r["message"],
             "counterexample": r["counterexample"], "resolution": r["resolution"], "note": r["note"],
             "precision": r["precision"], "coverage": r.get("coverage"), "repro": r.get("repro"),
             "repro_missing": r.get("repro_missing", ""), "model_dtypes": r["model_dtypes"]}
            for nodeid, r in _records.items() for cid in r["clauses"]]
    try:
        write_text(path, json.dumps(rows, indent=1))
    except OSError as exc:   # the disk filled, the directory went away: one line, and the run does not pass
        import sys
        sys.stderr.write(f"ERROR: --report-json {path}: could not be written: {exc.strerror or exc}\n")
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
