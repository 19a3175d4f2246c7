"""Suite runs computed once for every pytest-xdist worker of a test run (tests/test_catalog.py, test_declines.py).

Under xdist each worker is a process of its own: the first worker that needs a session's runs claims it (a file made
exclusively in the run's common temporary directory) and writes the runs there; the others wait for them, or run the
session themselves if the claimer died before writing them."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable

from properties.catalog import Entry
from properties.catalog.run import Run

__all__ = ["SharedRuns", "common_directory"]


def common_directory(tmp_path_factory) -> Path:
    """The directory every worker of this test run sees (the parent of the workers' own temporary directories)."""
    return tmp_path_factory.getbasetemp().parent


class SharedRuns:
    """``runs(name)``: ``compute(name)``, computed by one worker and read by the others."""

    def __init__(self, directory: Path, compute: Callable[[str], list[Run]], *, prefix: str):
        self.directory, self.compute, self.prefix = directory, compute, prefix

    def runs(self, name: str) -> list[Run]:
        key = f"{self.prefix}-" + "".join(c if c.isalnum() or c in "_+-" else "_" for c in name)
        done, claim = self.directory / f"{key}.json", self.directory / f"{key}.claim"
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            deadline = time.monotonic() + 1800
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if done.exists():
                return [_run_from(record) for record in json.loads(done.read_text())]
        runs = self.compute(name)
        partial = done.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps([dataclasses.asdict(run) for run in runs]))
        os.replace(partial, done)
        return runs


def _run_from(record: dict) -> Run:
    entry = Entry(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.pop("entry").items()})
    return Run(entry, **record)
