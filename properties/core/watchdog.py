"""Every call of the code under test, watched: a time limit per call, and a record of what is running.

The suite runs code it does not own — a kernel call and its backward pass, a module's or a model's forward, a
decode step, importing a plug-in, calling a factory, building a model from a config — inside ``user_call(plugin,
call)``. There:

* a call that runs longer than the limit (``--call-timeout SECONDS``, default ``DEFAULT_TIMEOUT``:
  properties/core/options.py) is interrupted in the main thread by SIGALRM with ``CallTimeout``. It is a BaseException, so neither the code under test's own
  ``except Exception`` nor Hypothesis (which would retry and shrink it, a limit's worth of time per attempt) holds
  it: pytest reports the test as failed, naming the plug-in, the call and the limit. Later calls of that plug-in
  fail at once with the same message, so a hang costs the limit once, not once per example. Code that catches
  BaseException (the zoo's size check does, around a user's constructor) is interrupted again every second, and a
  call that returns after catching the interrupt fails all the same;
* SystemExit, GeneratorExit, pytest's skip, fail, xfail and exit, and any other BaseException the code raises
  become ``UserExit``, an ordinary exception the guards report as a failure of the clause (a plug-in cannot end
  the run, nor skip its own clauses). KeyboardInterrupt is left alone: Ctrl-C still stops the run;
* the plug-in, the clause, the test and the call are written to a record (``Record``) that the supervisor
  (properties/plugin/watchdog.py) reads when the process ends without pytest's say or stops answering (a hang
  in C, where no signal handler runs): then it names them in one line and the exit status is not 0.

Nested calls (a user's kernel inside a user's module) are timed and recorded once, by the outermost.
"""
from __future__ import annotations

import os
import signal
import struct
import time

import pytest

from properties.core.options import DEFAULT_TIMEOUT

__all__ = ["CallTimeout", "UserExit", "Record", "user_call", "raised", "cause", "describe_args",
           "set_limit", "set_record", "set_test", "current_test", "limit", "last_call", "saved", "restore"]


class CallTimeout(BaseException):
    """A call of the code under test ran past the limit (or the plug-in already did once)."""


class UserExit(Exception):
    """The code under test raised a BaseException that would end or derail the run (SystemExit, pytest.skip, ...)."""

    def __init__(self, plugin: str, what: str, call: str):
        super().__init__(f"{plugin} raised {what} in {call}")
        self.plugin, self.what, self.call = plugin, what, call


def raised(exc: BaseException) -> str:
    """How the guards' messages name an exception of the code under test: 'ValueError: msg', or what UserExit saw."""
    return exc.what if isinstance(exc, UserExit) else f"{type(exc).__name__}: {exc}"


def cause(exc: BaseException) -> BaseException:
    """What a guard chains its own error to: the code under test's exception (SystemExit, ...) rather than UserExit,
    so that the report shows the user's traceback once."""
    return exc.__cause__ if isinstance(exc, UserExit) and exc.__cause__ is not None else exc


def _what(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) (sys.exit: the code under test must not end the process)"
    if isinstance(exc, pytest.exit.Exception):
        return f"pytest's Exit ({exc.msg}): the code under test must not end the run"
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        return f"pytest's {type(exc).__name__} ({exc}): the code under test cannot skip its own clauses"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _describe(value, depth: int = 0) -> str:
    import torch
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{tuple(value.shape)}"
    if isinstance(value, (tuple, list)) and depth < 2:
        inner = ", ".join(_describe(v, depth + 1) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)   # never the repr of an arbitrary object: it may be huge, slow or raise
        return text if len(text) <= 40 else text[:37] + "..."
    return type(value).__qualname__


def describe_args(name: str, args, kwargs) -> str:
    """'name(float32(2, 3), mask=bool(2, 3))': a call as the reports show it."""
    return f"{name}({', '.join([_describe(a) for a in args] + [f'{k}={_describe(v)}' for k, v in kwargs.items()])})"


# ------------------------------------------------------------------------------------------------- the record
class Record:
    """One process's entry in memory the supervisor shares: what runs now and since when. Layout (bytes): pid q,
    sequence Q, active i, (pad) i, start d, limit d, text length I, (pad) I, then UTF-8 text: plugin, clauses, test,
    call separated by \\x1f. ``buffer`` is a slice of an mmap (or a bytearray when nothing supervises)."""
    HEADER = struct.Struct("<qQiiddII")
    SIZE = 2048
    SEP = "\x1f"

    def __init__(self, buffer, pid: int):
        self.buffer, self.sequence = buffer, 0
        self.HEADER.pack_into(buffer, 0, pid, 0, 0, 0, 0.0, 0.0, 0, 0)

    def write(self, active: bool, fields: tuple[str, str, str, str], start: float = 0.0, limit: float = 0.0) -> None:
        text = self.SEP.join(fields).encode("utf-8", "replace")[: self.SIZE - self.HEADER.size]
        self.buffer[self.HEADER.size:self.HEADER.size + len(text)] = text
        self.sequence += 1
        pid = self.HEADER.unpack_from(self.buffer, 0)[0]
        self.HEADER.pack_into(self.buffer, 0, pid, self.sequence, int(active), 0, start, limit, len(text), 0)

    def clear(self) -> None:
        pid, sequence, _, _, start, limit, length, _ = self.HEADER.unpack_from(self.buffer, 0)
        self.HEADER.pack_into(self.buffer, 0, pid, sequence + 1, 0, 0, start, limit, length, 0)

    @classmethod
    def read(cls, buffer) -> tuple[int, int, bool, float, float, list[str]]:
        """(pid, sequence, active, start, limit, [plugin, clauses, test, call]) of a record another process wrote."""
        pid, sequence, active, _, start, limit, length, _ = cls.HEADER.unpack_from(buffer, 0)
        text = bytes(buffer[cls.HEADER.size:cls.HEADER.size + min(length, cls.SIZE - cls.HEADER.size)])
        fields = (text.decode("utf-8", "replace").split(cls.SEP) + ["", "", "", ""])[:4]
        return pid, sequence, bool(active), start, limit, fields


# -------------------------------------------------------------------------------------------------- state
class _Watch:
    limit = DEFAULT_TIMEOUT   # seconds; 0: no limit
    alarm = False             # our SIGALRM handler is installed (main thread, no other handler there before)
    active = None             # [plugin, call] of the outermost call in progress
    last = None               # the same, of the last outermost call (kept after it ends)
    test = ("", "")           # (clauses, nodeid) of the running test
    hung: dict = {}           # plugin -> why it is not called again
    record: Record | None = None


def limit() -> float:
    return _Watch.limit


def set_limit(seconds: float, *, alarm: bool) -> None:
    """The per-call limit (0: none), and whether SIGALRM enforces it in this process (main thread only); a new
    run (pytest.main() called again in one process) starts with no plug-in marked as hung."""
    _Watch.limit, _Watch.hung, _Watch.active, _Watch.last = seconds, {}, None, None
    alarm = alarm and hasattr(signal, "setitimer")   # POSIX; elsewhere only the limit's value is kept
    if alarm and seconds > 0 and not _Watch.alarm:
        import threading
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGALRM, _on_alarm)
            _Watch.alarm = True
    elif not alarm and _Watch.alarm:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        _Watch.alarm = False


def saved() -> dict:
    """The watchdog's state, for ``restore`` when a run ends (pytest.main() inside a run must not end the outer's)."""
    return {name: (dict(value) if isinstance(value, dict) else value) for name, value in vars(_Watch).items()
            if not name.startswith("__")}


def restore(state: dict) -> None:
    set_limit(state["limit"], alarm=state["alarm"])
    for name, value in state.items():
        setattr(_Watch, name, value)


def last_call() -> str:
    """': kernel k.py:f, importing 'k.py'': the last call of the code under test, for a message ('' if none)."""
    if _Watch.last is None:
        return ""
    plugin, call = _Watch.last
    return f": {plugin}, {call() if callable(call) else call}"


def set_record(record: Record | None) -> None:
    _Watch.record = record


def set_test(nodeid: str, clauses: str) -> None:
    """The test now running (called before each test's setup); recorded for the supervisor."""
    _Watch.test = (clauses, nodeid)
    if _Watch.record is not None and _Watch.active is None:
        _Watch.record.write(False, ("", clauses, nodeid, ""))


def current_test() -> tuple[str, str]:
    """(clauses, nodeid) of the test now running ('' and '' outside one)."""
    return _Watch.test


def _on_alarm(signum, frame):
    if _Watch.active is None:   # the call returned just as the timer fired
        return
    plugin, call = _Watch.active
    call = call() if callable(call) else call
    clauses, nodeid = _Watch.test
    where = f" (test {nodeid})" if nodeid else ""
    _Watch.hung[plugin] = f"it did not return within {_Watch.limit:g} s in {call}{where}"
    raise CallTimeout(f"{plugin} did not return within {_Watch.limit:g} s (--call-timeout) in {call}")


_STANDARD = {1: "the standard output (file descriptor 1)", 2: "the standard error (file descriptor 2)"}
_saved_standard: dict[int, int] = {}   # fd -> a duplicate made before the first call, to put it back from


def _keep_standard_streams() -> None:
    if not _saved_standard:
        for fd in _STANDARD:
            try:
                _saved_standard[fd] = os.dup(fd)
            except OSError:   # not open when the run began: nothing to protect
                pass


def _restore_standard_streams() -> list[str]:
    """The standard streams the call closed (or pointed elsewhere than a file), each put back as it was before it."""
    closed = []
    for fd, backup in _saved_standard.items():
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(backup, fd)
            closed.append(_STANDARD[fd])
    return closed


class user_call:
    """``with user_call("kernel k.py:f", "kernel(float32(1, 2, 3, 4), ...)"):`` around one call of the code under test;
    ``call`` may be a function returning that text (computed only if needed)."""
    __slots__ = ("plugin", "call", "outer")

    def __init__(self, plugin: str, call):
        self.plugin, self.call = plugin, call

    def __enter__(self):
        if self.plugin in _Watch.hung:
            raise CallTimeout(f"{self.plugin} is not called again: {_Watch.hung[self.plugin]}")
        self.outer = _Watch.active is None
        if self.outer:
            _keep_standard_streams()
            if _Watch.record is not None:
                self.call = self.call() if callable(self.call) else self.call
                _Watch.record.write(True, (self.plugin, *_Watch.test, self.call), time.monotonic(), _Watch.limit)
            _Watch.active = _Watch.last = [self.plugin, self.call]
            if _Watch.alarm:   # then every second: code that swallows the interrupt is interrupted again
                signal.setitimer(signal.ITIMER_REAL, _Watch.limit, min(1.0, _Watch.limit))
        return self

    def __exit__(self, kind, exc, tb):
        closed = []
        if self.outer:
            _Watch.active = None
            if _Watch.alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if _Watch.record is not None:
                _Watch.record.clear()
            closed = _restore_standard_streams()
        if closed and not isinstance(exc, (KeyboardInterrupt, CallTimeout)):   # the run's own output, taken from it
            call = self.call() if callable(self.call) else self.call
            raise UserExit(self.plugin, f"a fault: it closed {' and '.join(closed)}, which the test run writes to (put back "
                                        f"for the calls after it)", call) from exc
        if exc is None and self.outer and self.plugin in _Watch.hung:   # it swallowed the interrupt, then returned
            raise CallTimeout(f"{self.plugin} did not return within {_Watch.limit:g} s (--call-timeout) in "
                              f"{self.call() if callable(self.call) else self.call}; the interrupt was caught inside the call, "
                              f"which went on")
        if exc is None or isinstance(exc, (KeyboardInterrupt, CallTimeout)) or \
                (isinstance(exc, Exception) and not isinstance(exc, pytest.exit.Exception)):
            return False
        call = self.call() if callable(self.call) else self.call
        raise UserExit(self.plugin, _what(exc), call) from exc
