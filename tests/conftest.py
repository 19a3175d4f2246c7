"""Fixtures shared by tests/."""
from __future__ import annotations

import pytest
import torch
from training import train_config

from zoo.tasks.train import train


@pytest.fixture
def one_thread():
    # Models this small gain nothing from intra-op threads, and on a busy machine OpenMP threads that
    # wait on each other make every step many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def finished_run(tmp_path):
    train(train_config(tmp_path, "task.steps=4", "task.checkpoint_every=2"), quiet=True)
    return tmp_path
