"""What code under test leaves running must not keep a command alive once its report is written: a child process
it started (which may hold the command's output pipe open, so that a caller reading it never sees the end) and a
non-daemon thread (which Python waits for at exit, forever if it never ends).

``end_leftovers(status)`` is called as a command's very last step (``python -m zoo``; the spec suite's pytest
process at unconfigure): it kills this process's remaining children, and when a non-daemon thread is still running it
flushes the standard streams and ends the process with ``status`` at once (os._exit), saying so in one line.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["children", "end_leftovers"]


def children(pid: int | None = None) -> list[int]:
    """The processes whose parent is ``pid`` (this process by default), from /proc; [] where there is no /proc."""
    pid = os.getpid() if pid is None else pid
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):   # it ended meanwhile
            continue
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def end_leftovers(status: int, *, who: str = "the code under test") -> None:
    """Kill this process's remaining children; if a non-daemon thread other than this one is alive, flush and end the
    process now with ``status`` (returns otherwise)."""
    for pid in children():
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):   # already gone, or not ours to reap
            pass
    current = threading.current_thread()
    left = [t for t in threading.enumerate() if t is not current and t.is_alive() and not t.daemon
            and t is not threading.main_thread()]
    if not left:
        return
    names = ", ".join(t.name for t in left[:5]) + (", ..." if len(left) > 5 else "")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os.write(2, f"WARNING: {len(left)} thread(s) {who} started still running ({names}); the process ends without "
                f"waiting for them\n".encode("utf-8", "replace"))
    os._exit(status)
