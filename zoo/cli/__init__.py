"""``python -m zoo``: the command line (``main``, in ``command``), its checks and plan (``plan``), its tasks
(``tasks``), its help (``help``), its output directories (``directories``), and the argument checks every argparse
command of the project shares (``arguments``: bench/ and the suite's tools use them without loading the command line
itself)."""
from __future__ import annotations

import importlib

__all__ = ["main"]


def __getattr__(name: str):
    if name == "main":   # loaded when used: zoo.cli.arguments alone must not import Hydra's runner and the tasks
        return importlib.import_module("zoo.cli.command").main
    raise AttributeError(f"module 'zoo.cli' has no attribute {name!r}")
