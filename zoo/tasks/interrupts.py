"""Stopping on a signal: Ctrl-C (SIGINT) and SIGTERM end a run with one line and a conventional exit status
(130, 143), after the ``finally`` blocks have run: a checkpoint being written is removed whole, a child
process is stopped, and what was already written stays as it was."""
from __future__ import annotations

import signal
import threading

__all__ = ["Interrupted", "stop_on_sigterm"]


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; str() is one line for the user, ``status`` the exit status."""

    def __init__(self, message: str = "interrupted", status: int = 130):
        super().__init__(message)
        self.status = status


def _on_sigterm(signum, frame):
    raise Interrupted("terminated (SIGTERM)", 128 + signal.SIGTERM)


def stop_on_sigterm() -> None:
    """Make SIGTERM raise ``Interrupted`` in the main thread, as Ctrl-C raises KeyboardInterrupt (the default
    action would end the process at once, skipping every clean-up and orphaning its children)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
