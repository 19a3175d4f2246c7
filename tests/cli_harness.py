"""`python -m zoo ARGS` in this process, as the CLI's input tests run it: a subprocess costs 2-3 s of start-up
(torch, Hydra), an in-process call 0.1-0.3 s. Hydra runs for real (composition, output directories, sweeps,
--cfg, --info); the tasks themselves are replaced by a recorder, since what is checked here is that a command line
is refused in one line before anything is written, or reaches its task with a valid config."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import zoo.cli.command
import zoo.cli.tasks


@dataclass
class Outcome:
    status: int
    out: str
    err: str
    written: list[str]                      # paths under the watched directory that the call made or changed
    ran: list[str] = field(default_factory=list)  # the tasks that were reached, in order


@contextlib.contextmanager
def sigint_as_at_a_terminal() -> Iterator[None]:
    """Children started inside the block get SIGINT at its default action, as a terminal's foreground process has it,
    so that a test can interrupt them as Ctrl-C does. A test run started with SIGINT ignored (a background job of a
    shell without job control) would hand that to them, and Python keeps an inherited ignored SIGINT ignored: the
    child would run on, and the test would measure the shell, not the zoo. (A handled signal is reset to its default
    by exec; an ignored one is not.)"""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime) of every file below ``root``, (-1, 0) of every directory: a directory counts as written
    when the call leaves it behind, not when a file was made in it and removed again (its time alone changed)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            try:
                stat = path.lstat()
            except OSError:
                continue
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns) if name in filenames else (-1, 0)
    return found


def zoo_in_process(argv: list[str], cwd: Path, *, watch: Path | None = None, real_tasks: bool = False) -> Outcome:
    """Run `python -m zoo *argv` from `cwd`; `watch` (default cwd) is the tree whose changes are reported."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    watch = watch or cwd
    before = _tree(watch)
    ran: list[str] = []
    tasks = dict(zoo.cli.tasks.TASKS)
    if not real_tasks:
        for name in tasks:
            zoo.cli.tasks.TASKS[name] = lambda job: ran.append(str(job.cfg.task.name))
    previous = (os.getcwd(), list(sys.argv), signal.getsignal(signal.SIGTERM), dict(os.environ))
    loggers = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level) for name in ("", "hydra")}
    out, err = io.StringIO(), io.StringIO()
    status = 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                zoo.cli.command.main(list(argv))
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        zoo.cli.tasks.TASKS.clear()
        zoo.cli.tasks.TASKS.update(tasks)
        os.chdir(previous[0])
        sys.argv[:] = previous[1]
        signal.signal(signal.SIGTERM, previous[2])
        os.environ.clear()
        os.environ.update(previous[3])
        HydraConfig.instance().cfg = None  # a run leaves its config set; later tests must not find it
        GlobalHydra.instance().clear()
        for name, (handlers, level) in loggers.items():  # Hydra set up logging for the job: undo it
            logger = logging.getLogger(name)
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()
            logger.handlers[:] = handlers
            logger.setLevel(level)
    after = _tree(watch)
    written = sorted(p for p in after if before.get(p) != after[p])
    return Outcome(status, out.getvalue(), err.getvalue(), written, ran)


def assert_one_line_refusal(outcome: Outcome, *words: str) -> str:
    """Status 2, one line on stderr that starts with `zoo: ` and names every word, no traceback, nothing written."""
    lines = [line for line in outcome.err.splitlines() if line.strip()]
    assert outcome.status == 2, (outcome.status, outcome.err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("zoo: "), outcome.err[-3000:]
    assert "Traceback" not in outcome.err
    assert not outcome.written, outcome.written
    assert not outcome.ran, outcome.ran
    assert all(word in lines[0] for word in words), (words, lines[0])
    return lines[0]
