"""Running the suite on a catalog entry the way a user does: ``pytest properties/ OPTION ARGUMENT`` in a
new pytest session with ``--report-json``, and reading the report.

Kernel entries plugged in the same way (the same option and extra words) can also share one session
(``run_together``): ``pytest properties/kernel --kernel A --kernel B ...``, or for context-parallel kernels
``pytest properties/distributed --kernel A --kernel B ... --world-size W [--shard LAYOUT]`` (the ranks started once,
every kernel loaded on them), with a plan
(``properties.catalog.select``) that runs each kernel only on its own clauses and stops each at its first failure,
the report split by kernel. An entry such a session does not catch is run again alone, so that a shared session
never reports a miss, a usage error or a time-out that the entry's own session would not.

Each run starts in a fresh temporary directory, so Hypothesis' example database (``.hypothesis/`` in the
working directory) is empty: no run replays a failure another run found. The suite itself is the
installed ``properties`` package's directory, so this works from a wheel as from a checkout.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import properties
from properties.catalog.registry import KERNEL_APIS, Entry
from properties.catalog.sessions import run_pytest

__all__ = ["SUITE", "SOURCE_ROOT", "Run", "command", "run_entry", "run_all", "shareable", "run_together"]

SUITE = Path(properties.__file__).resolve().parent
# A checkout holds examples/ next to properties/; an installed package does not.
SOURCE_ROOT = SUITE.parent if (SUITE.parent / "examples").is_dir() else None
FAILED = ("failed", "error")
# Start-up only: plug-ins the suite does not use (each costs ~0.3 s of imports and assertion rewriting per
# run when bytecode is not cached); blocking one that is not installed is allowed.
QUIET_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:anyio", "-p", "no:hydra_pytest", "-p", "no:xdist",
                 "-p", "no:xdist.looponfail")


@dataclass
class Run:
    entry: Entry
    command: list[str]
    returncode: int | None = None
    rows: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    output: str = ""
    unavailable: str = ""   # why the entry could not be run (e.g. examples/ missing from an install)

    @property
    def tests(self) -> list[dict]:
        """One record per test (the report has one per (test, clause)), in execution order."""
        seen: dict[str, dict] = {}
        for row in self.rows:
            record = seen.setdefault(row["nodeid"], {"nodeid": row["nodeid"], "status": row["status"],
                                                     "duration_s": row["duration_s"], "message": row["message"],
                                                     "clauses": []})
            record["clauses"].append(row["clause"])
        return list(seen.values())

    @property
    def failed_clauses(self) -> list[str]:
        out: list[str] = []
        for test in self.tests:
            if test["status"] in FAILED:
                out += [c for c in test["clauses"] if c not in out]
        return out

    @property
    def passed_clauses(self) -> set[str]:
        return {row["clause"] for row in self.rows if row["status"] == "passed"}

    @property
    def first_failure(self) -> dict | None:
        """{clauses, nodeid, message, time_s}: the first failing test in execution order, with the sum of the
        test durations up to and including it (process start-up excluded)."""
        elapsed = 0.0
        for test in self.tests:
            elapsed += test["duration_s"]
            if test["status"] in FAILED:
                return {"clauses": test["clauses"], "nodeid": test["nodeid"], "message": test["message"],
                        "time_s": elapsed}
        return None

    @property
    def tests_s(self) -> float:
        return sum(t["duration_s"] for t in self.tests)

    @property
    def startup_s(self) -> float:
        """Wall time not spent in tests: interpreter and torch start-up, collection, building the subject."""
        return max(0.0, self.wall_s - self.tests_s)

    @property
    def caught(self) -> bool:
        return bool(self.failed_clauses)

    @property
    def caught_expected(self) -> bool:
        return bool(set(self.failed_clauses) & set(self.entry.expected))

    @property
    def usage_error(self) -> bool:
        return self.returncode not in (0, 1) or (self.returncode == 1 and not self.rows)


def _targets(entry: Entry) -> list[Path]:
    # Only the folders of the entry's level are collected: a kernel option alone runs only the kernel level, and a
    # --zoo or --model entry of the module or model level neither collects the kernel tests nor probes the default
    # kernels' limits for them (most of a short run's start-up). The --catalog-level selection is unchanged.
    if entry.level == "distributed":   # --world-size runs the distributed clauses alone
        return [SUITE / "distributed"]
    if entry.extra:
        return [SUITE]
    return {"kernel": [SUITE / "kernel"], "module": [SUITE / "module", SUITE / "model"],
            "model": [SUITE / "model"]}.get(entry.level, [SUITE])


def _clause_files(targets: list[Path], clauses: Sequence[str]) -> list[Path]:
    """The test files under ``targets`` that bind one of ``clauses`` (each test names its clauses literally,
    ``@clause("ID")``): collecting only them keeps every test ``--catalog-clause`` would keep, without importing and
    collecting the level's other files (most of a caught entry's start-up)."""
    if not clauses:
        return targets
    wanted = [f'"{clause}"' for clause in clauses]
    files = [path for target in targets for path in sorted(target.rglob("test_*.py"))
             if any(word in path.read_text(encoding="utf-8") for word in wanted)]
    return files or targets


def _pytest(targets: list[Path], plug_in: list[str], report: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", *map(str, targets), "-q", "-p", "properties.catalog.select", *QUIET_PLUGINS,
            *plug_in, "--report-json", str(report)]


def command(entry: Entry, report: Path, *, level: bool = True, clauses: Sequence[str] = (), stop_first: bool = False,
            seed: int | None = None, extra: Sequence[str] = ()) -> list[str] | None:
    """The pytest command line for ``entry`` (None when its argument is unavailable here): the user's
    ``pytest properties/ OPTION ARGUMENT --report-json PATH``; ``level`` drops the kernel tests of the default
    kernels from a ``--zoo`` run, ``clauses`` keeps only those clauses' tests, ``stop_first`` adds ``-x``."""
    argument = entry.resolved_argument(SOURCE_ROOT)
    if argument is None:
        return None
    cmd = _pytest(_clause_files(_targets(entry), clauses),
                  [*([entry.option, argument] if entry.option else []), *entry.extra], report)
    if level and entry.option == "--zoo":  # --zoo runs every level; the kernel tests then check the default kernels
        cmd += ["--catalog-level", entry.level]
    for clause in clauses:
        cmd += ["--catalog-clause", clause]
    if stop_first:
        cmd.append("-x")
    if seed is not None:
        cmd.append(f"--hypothesis-seed={seed}")
    return cmd + list(extra)


def run_entry(entry: Entry, *, timeout: float = 900, **options) -> Run:
    """Run the suite on ``entry`` in a new pytest session (one intra-op thread, a fresh working directory),
    forked from a server that has imported torch once (``properties.catalog.sessions``)."""
    with tempfile.TemporaryDirectory(prefix="catalog-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = command(entry, report, **options)
        if cmd is None:
            return Run(entry, [], unavailable=f"{entry.argument.split(':')[0]} is not here (a source checkout has it)")
        start = time.perf_counter()
        session = run_pytest(cmd[3:], cwd=tmp, timeout=timeout)
        wall = time.perf_counter() - start
        rows = json.loads(report.read_text()) if report.exists() else []
    return Run(entry, cmd, session.returncode, rows, wall, session.output[-6000:])


def run_all(entries: Iterable[Entry], *, jobs: int = 2, progress=None, **options) -> list[Run]:
    """``run_entry`` for every entry, ``jobs`` at a time; results in the entries' order."""
    entries = list(entries)

    def one(entry):
        result = run_entry(entry, **options)
        if progress is not None:
            progress(result)
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, entries))


def shareable(entries: Iterable[Entry]) -> list[list[Entry]]:
    """The entries that can share a session, grouped (in their order): kernel (or context-parallel kernel) entries
    with the same option and the same extra words (for a context-parallel kernel, its --world-size and --shard).
    Every other entry is a group of its own."""
    groups: dict[tuple, list[Entry]] = {}
    for entry in entries:
        together = entry.level in ("kernel", "distributed") and entry.option in (
            "--kernel", *(f"--kernel-api={api}" for api in KERNEL_APIS))
        groups.setdefault((entry.option, entry.extra) if together else (id(entry),), []).append(entry)
    return list(groups.values())


def run_together(entries: Sequence[Entry], *, stop_first: bool = False, seed: int | None = None,
                 extra: Sequence[str] = (), timeout: float = 900) -> list[Run]:
    """Run kernel ``entries`` of one ``shareable`` group in one session, each on its expected clauses (a correct one
    on all of them), and return one Run per entry, as ``run_entry`` would; an entry not caught (or every entry,
    if the session ends with a usage error or a time-out) is run again alone with the same options."""
    entries = list(entries)
    if len(entries) == 1:
        return [run_entry(entries[0], clauses=entries[0].expected, stop_first=stop_first, seed=seed, extra=extra,
                          timeout=timeout)]
    if len(shareable(entries)) != 1:
        raise ValueError(f"entries that cannot share a session: {[e.name for e in entries]}")
    with tempfile.TemporaryDirectory(prefix="catalog-") as tmp:
        report, plan, nodeids = Path(tmp) / "report.json", Path(tmp) / "plan.json", Path(tmp) / "nodeids.json"
        plan.write_text(json.dumps({"kernels": {e.spec: list(e.expected) for e in entries}, "stop_first": stop_first,
                                    "nodeids": str(nodeids)}))
        option = entries[0].option
        plug_in = [word for e in entries for word in ([option, e.spec] if option == "--kernel" else [e.argument])]
        if option != "--kernel":
            plug_in.insert(0, option)
        clauses = [] if not all(e.expected for e in entries) else sorted({c for e in entries for c in e.expected})
        cmd = _pytest(_clause_files(_targets(entries[0]), clauses), [*plug_in, *entries[0].extra], report) + [
            "--catalog-plan", str(plan)]
        cmd += [f"--hypothesis-seed={seed}"] if seed is not None else []
        cmd += [*extra, "--tb=line"]   # each failure's message is read from the report; no source in tracebacks
        start = time.perf_counter()
        session = run_pytest(cmd[3:], cwd=tmp, timeout=timeout)
        wall = time.perf_counter() - start
        rows = json.loads(report.read_text()) if report.exists() else []
        kernel_of = json.loads(nodeids.read_text()) if nodeids.exists() else {}
    runs = []
    for entry in entries:
        own = [row for row in rows if kernel_of.get(row["nodeid"]) == entry.spec]
        failed = any(row["status"] in FAILED for row in own)
        returncode = session.returncode if session.returncode not in (0, 1) else int(failed)
        run = Run(entry, cmd, returncode, own, wall, session.output[-6000:])
        if not run.caught_expected and (entry.expected or run.usage_error):
            run = run_entry(entry, clauses=entry.expected, stop_first=stop_first, seed=seed, extra=extra,
                            timeout=timeout)
        runs.append(run)
    return runs
