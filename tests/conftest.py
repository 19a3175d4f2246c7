"""Fixtures shared by tests/."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from training import train_config

from zoo.tasks.train import train

# Many tests start Python processes (python -m zoo, the catalog's pytest sessions). Where the environment forbids
# bytecode caching (PYTHONDONTWRITEBYTECODE, set on some CI machines), each of them compiles every module of the
# project again and rewrites the asserts of the whole suite: about 2 s a process, several minutes a run. They
# cache it as Python does by default (__pycache__/, ignored by git); nothing they check depends on it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.hookimpl(optionalhook=True)   # (pytest-xdist may be absent or blocked: -p no:xdist)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the CPU cores this process may use. With one worker a core, the cores
    idled 14 % of the run while tests waited (a kernel that hangs until its --call-timeout, a rank waiting for
    another, a catalog session another worker is running): on 2 cores, 3 workers ran the test command in 611 s
    against 690 s for 2, and 4 workers gained nothing more (docs/benchmarks.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1


@pytest.fixture
def one_thread():
    # Models this small gain nothing from intra-op threads, and on a busy machine OpenMP threads that
    # wait on each other make every step many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def finished_run_once(tmp_path_factory):
    """A finished tiny run (checkpoints at steps 2 and 4), trained once a session: tests copy it, never write in it."""
    out = tmp_path_factory.mktemp("finished-run")
    train(train_config(out, "task.steps=4", "task.checkpoint_every=2"), quiet=True)
    return out


@pytest.fixture
def finished_run(finished_run_once, tmp_path):
    """The test's own copy of ``finished_run_once``, in tmp_path (tests damage and extend it). A checkpoint names no
    directory of its own: a copy is the same run (tests/test_safety.py resumes and decodes copies)."""
    shutil.copytree(finished_run_once, tmp_path, dirs_exist_ok=True)
    return tmp_path
