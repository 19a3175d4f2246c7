"""``python -m zoo``'s limit on one call of a plug-in (``call_timeout=SECONDS``): importing it, building a model
with it, a forward pass or a decoding through it.

The same two stages as the spec suite's ``--call-timeout`` (properties/core/watchdog.py, whose supervisor is
properties/plugin/watchdog.py), which the zoo cannot import (the suite sits above the zoo, docs/ARCHITECTURE.md):

* past the limit, SIGALRM interrupts the main thread with ``CallLimitExceeded`` (a BaseException, so the plug-in's
  own ``except Exception`` does not hold it), again every second if the plug-in catches it; the command then says
  so in one line and ends with status 1;
* a call that the interrupt does not stop within a grace of 2 s + a quarter of the limit (the suite's grace) is
  stuck in C code, where no Python signal handler runs (a ctypes call, ``signal.pause()``, a C extension's sleep):
  a watchdog thread then kills this process's children, writes one line naming the plug-in and the call, and ends
  the process at once with status 1 (os._exit). C code that never releases the GIL stops the thread too; only a
  separate process (the suite's supervisor) could end that.

The limit is 0 (none) until the command sets it, so the suite and library users of the zoo are not affected.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

__all__ = ["DEFAULT_TIMEOUT", "MIN_TIMEOUT", "CallLimitExceeded", "bounded", "set_limit", "reset_limit", "limit",
           "parse_limit"]

# The suite's defaults (properties/core/watchdog.py: DEFAULT_TIMEOUT, MIN_TIMEOUT), for the same reasons: a correct
# plug-in's import or first call takes some tenths of a second on a loaded machine, and a hang is named in a minute.
DEFAULT_TIMEOUT = 60.0
MIN_TIMEOUT = 1.0
KILLED_STATUS = 1


class CallLimitExceeded(BaseException):
    """A call of a plug-in ran past ``call_timeout``; the message is one line meant for the user."""


class _State:
    limit = 0.0              # seconds; 0: no limit
    active = None            # (plugin, call, start) of the outermost bounded call in progress
    alarm = False            # our SIGALRM handler is installed
    previous = signal.SIG_DFL  # the SIGALRM handler it replaced, put back by reset_limit
    watcher = None           # the watchdog thread, started with the first bounded call
    wake = threading.Condition()


def limit() -> float:
    return _State.limit


def parse_limit(text: object) -> float:
    """``call_timeout``'s value -> seconds; ValueError with the reason for anything else."""
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(text, bool) or not math.isfinite(seconds) or not 0 <= seconds <= 1e6:
        raise ValueError("expected a number of seconds in [0, 1e6] (0: no limit)")
    if 0 < seconds < MIN_TIMEOUT:
        raise ValueError(f"expected 0 (no limit) or at least {MIN_TIMEOUT:g} s: importing a plug-in or its first "
                         f"call takes that long when nothing is wrong")
    return seconds


def set_limit(seconds: float) -> None:
    """The limit of every later bounded call (0: none); SIGALRM enforces it where this is the main thread. A
    handler already there (a host program's, the suite's watchdog left by an embedding run) is replaced until
    ``reset_limit``: without ours, a plug-in looping in Python would meet only the hard stop, which ends the host."""
    _State.limit = seconds
    if seconds > 0 and not _State.alarm and hasattr(signal, "setitimer") \
            and threading.current_thread() is threading.main_thread():
        _State.previous = signal.signal(signal.SIGALRM, _on_alarm)
        _State.alarm = True


def reset_limit() -> None:
    """No limit, and SIGALRM as it was before ``set_limit``."""
    _State.limit = 0.0
    if _State.alarm:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if _State.previous is None else _State.previous)
        _State.alarm, _State.previous = False, signal.SIG_DFL


def _message(plugin: str, call: str, how: str) -> str:
    return f"zoo: {plugin} did not return within {_State.limit:g} s (call_timeout) in {call}{how}"


def _on_alarm(signum, frame):
    if _State.active is None:   # the call returned just as the timer fired
        return
    plugin, call, _ = _State.active
    raise CallLimitExceeded(_message(plugin, call, ""))


def _watch() -> None:
    """The hard stop: a call still running past limit + grace is stuck where the interrupt cannot reach it."""
    with _State.wake:
        while True:
            active = _State.active
            if active is None or not _State.limit:
                _State.wake.wait()
                continue
            deadline = active[2] + _State.limit + 2.0 + _State.limit / 4
            left = deadline - time.monotonic()
            if left > 0:
                _State.wake.wait(left)
                continue
            if _State.active is not active:
                continue
            from zoo.runtime.leftovers import children
            for pid in children():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            line = _message(active[0], active[1], " and the interrupt did not stop it (stuck in C code?): killed")
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (AttributeError, OSError, ValueError):
                    pass
            os.write(2, "".join(c if c.isprintable() else repr(c)[1:-1] for c in line).encode("utf-8", "replace")
                     + b"\n")
            os._exit(KILLED_STATUS)


class bounded:
    """``with bounded("attention.kernel=k.py:f", "the forward pass"):`` around one call of a plug-in; nested bounded
    calls are timed once, by the outermost. Nothing is done while the limit is 0, nor for plugin None (no plug-in
    takes part)."""
    __slots__ = ("plugin", "call", "outer")

    def __init__(self, plugin: str | None, call: str):
        self.plugin, self.call = plugin, call

    def __enter__(self):
        self.outer = bool(self.plugin) and _State.limit > 0 and _State.active is None
        if self.outer:
            with _State.wake:
                _State.active = (self.plugin, self.call, time.monotonic())
                if _State.watcher is None:
                    _State.watcher = threading.Thread(target=_watch, name="zoo-call-limit", daemon=True)
                    _State.watcher.start()
                _State.wake.notify_all()
            if _State.alarm:   # then every second: a plug-in that swallows the interrupt is interrupted again
                signal.setitimer(signal.ITIMER_REAL, _State.limit, min(1.0, _State.limit))
        return self

    def __exit__(self, kind, exc, tb):
        if not self.outer:
            return False
        if _State.alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        start = _State.active[2]
        with _State.wake:
            _State.active = None
            _State.wake.notify_all()
        if exc is None and time.monotonic() - start > _State.limit:   # it caught the interrupt and went on
            raise CallLimitExceeded(_message(self.plugin, self.call, "; the interrupt was caught inside the call, "
                                                                     "which went on"))
        return False
