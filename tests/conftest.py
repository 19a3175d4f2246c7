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
