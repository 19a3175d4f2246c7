"""The spec suite's watchdog (properties/plugin/suite.py calls ``configure``; the entry point registers
``--call-timeout``): the per-call limit, and a supervisor process, so that code under test that ends the process,
crashes or hangs never reads as a pass.

A run started as ``pytest`` or ``python -m pytest`` (so also ``python -m properties`` and ``task=verify``) forks
once, at configuration, before any code under test is imported: the child runs the session as usual, the parent
only watches it. The child records what it is running (properties/core/watchdog.py: the plug-in, clause, test and
call) in memory they share, and at the very end that pytest ended it, with which status. When the child ends
otherwise — ``os._exit``, a C ``exit()``, a segfault, a kill — the parent prints one line naming what was running
(for a crash, with the innermost frame outside the standard library, from faulthandler) and ends with a status
that is never 0: the same signal if a signal killed the child, else its exit status, or 1 in place of 0.

A call past its limit is interrupted in the child by SIGALRM. When that does not stop it within a grace of
2 s + a quarter of the limit (a hang inside C code, where no Python signal handler runs, or code that blocks
SIGALRM), the parent asks for its Python stack (SIGUSR1, faulthandler), kills the process running it and says so
in one line: for the main process the run ends there with status 1; a pytest-xdist worker's death is reported by
xdist as the failure of its test (pytest-xdist workers write their records into the same memory, one slot each),
and the run goes on. The parent ignores Ctrl-C (the child, in the same process group, receives it and stops as
usual) and passes SIGTERM and SIGHUP on; the child gets SIGTERM if the parent dies (PR_SET_PDEATHSIG).

Not supervised (the per-call limit still holds): ``pytest.main()`` called inside another program (the parent
could not hand control back to it), platforms other than Linux, runs that do not collect the suite, processes
that already run other Python threads or have initialized CUDA (the fork happens before the suite touches
CUDA), and any process where the shared memory or the fork fails.
"""
from __future__ import annotations

import faulthandler
import math
import mmap
import os
import re
import signal
import struct
import sys
import time

import pytest

from properties.core import watchdog
from properties.core.options import DEFAULT_TIMEOUT, MIN_TIMEOUT
from properties.core.watchdog import Record
from properties.plugin._utils import number_option

__all__ = ["configure"]

_ENV = "PROPERTIES_WATCHDOG"          # "supervisor pid:fd": where pytest-xdist workers find the shared records
_SLOTS = 64                            # slot 0: the supervised process; 1..63: xdist workers (by number)
_HEADER = struct.Struct("<8sii")       # magic, finished (pytest ended the child), pytest's exit status (-1: none)
_MAGIC = b"propwdg1"
_OFFSET = 64                           # the slots start here
_KILL_AFTER = 2.0                      # seconds between the stack dump (SIGUSR1) and SIGKILL
_session = None
_BEFORE = pytest.StashKey[dict]()      # the watchdog as it was before this run (restored at its end)


def _timeout(config) -> float:
    seconds = number_option(config, "--call-timeout", float, lambda s: math.isfinite(s) and 0 <= s <= 1e6,
                            "a number of seconds in [0, 1e6] (0: no limit)", dest="call_timeout")
    if seconds is None:
        return DEFAULT_TIMEOUT
    if 0 < seconds < MIN_TIMEOUT:   # a limit that stops correct code (importing torch) verifies nothing
        given = getattr(getattr(config, "invocation_params", None), "args", ())
        name = "--kernel-timeout" if any(str(a).startswith("--kernel-timeout") for a in given) else "--call-timeout"
        raise pytest.UsageError(f"{name} {config.getoption('call_timeout')!r}: expected 0 (no limit) or at least "
                                f"{MIN_TIMEOUT:g} s: importing a plug-in or a first kernel call takes that long when nothing is wrong")
    return seconds


def configure(config, targets_suite: bool) -> None:
    """Read --call-timeout; in a run that collects the suite, supervise it (the command line's process) or join the
    supervisor's records (a pytest-xdist worker)."""
    seconds = _timeout(config)
    if not targets_suite:
        return
    debugging = config.getoption("usepdb", False) or config.getoption("trace", False)
    config.stash[_BEFORE] = watchdog.saved()
    watchdog.set_limit(0.0 if debugging else seconds, alarm=True)
    watchdog.set_record(None)   # a record inherited from an enclosing run (pytest.main() in it, or forked) is not ours
    if not config.pluginmanager.has_plugin("properties.plugin.watchdog"):
        config.pluginmanager.register(sys.modules[__name__], "properties.plugin.watchdog")
    if hasattr(config, "workerinput"):
        _join(config)
        return
    os.environ.pop(_ENV, None)   # an enclosing run's supervisor is not this run's: its workers must not join it
    if _may_fork(config):
        _fork(grace=2.0 + watchdog.limit() / 4)


def _may_fork(config) -> bool:
    import threading
    import torch
    if not (sys.platform.startswith("linux") and hasattr(os, "fork")) or threading.active_count() > 1:
        return False
    if torch.cuda.is_initialized():   # a forked child cannot use CUDA once its parent has initialized it
        return False
    if config.getoption("help", False) or config.getoption("version", False):
        return False
    return _command_line()


def _command_line() -> bool:
    """Whether pytest runs as the command line's program (not pytest.main() inside another program)."""
    frame = sys._getframe()
    while frame is not None:   # pytest's command line entry point, not pytest.main() inside another program
        if frame.f_code.co_name in ("_console_main", "console_main") and \
                frame.f_globals.get("__name__") == "_pytest.config":
            return True
        frame = frame.f_back
    return False


def _file() -> int:
    """An anonymous file the child and the parent share (memfd; an unlinked temporary file where there is none)."""
    if hasattr(os, "memfd_create"):
        try:
            return os.memfd_create("properties-watchdog")
        except OSError:   # a kernel or sandbox without memfd
            pass
    import tempfile
    fd, path = tempfile.mkstemp(prefix="properties-watchdog-")
    os.unlink(path)
    return fd


def _fork(grace: float) -> None:
    """Fork; the child returns and runs the session, the parent watches it and never returns. Nothing happens when
    the machinery is missing (no shared memory, no fork): the run goes on unsupervised."""
    import warnings
    try:
        fd, faults = _file(), _file()
        os.ftruncate(fd, _OFFSET + _SLOTS * Record.SIZE)
        shared = mmap.mmap(fd, _OFFSET + _SLOTS * Record.SIZE)
        _HEADER.pack_into(shared, 0, _MAGIC, 0, -1)
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        os.environ[_ENV] = f"{parent}:{fd}"
        with warnings.catch_warnings():   # Python >= 3.12 warns of native threads (torch's): the child uses none
            warnings.simplefilter("ignore", DeprecationWarning)
            child = os.fork()
    except (OSError, ValueError):
        os.environ.pop(_ENV, None)
        return
    if child == 0:
        _become_supervised(parent, shared, faults)
        return
    status = 3
    try:
        status = _supervise(child, shared, faults, grace)
    except BaseException:  # noqa: BLE001  the watchdog must never leave the child unattended, nor return to pytest
        _kill(child, signal.SIGKILL)
    finally:
        _exit(status)


def _kill(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except OSError:   # it ended meanwhile
        pass


# ------------------------------------------------------------------------------------------------- the child
def _become_supervised(parent: int, shared: mmap.mmap, faults: int) -> None:
    if sys.platform.startswith("linux"):
        try:   # end with the supervisor (PR_SET_PDEATHSIG): SIGTERM, which the suite turns into Ctrl-C
            import ctypes
            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))
        except Exception:  # noqa: BLE001  (no libc prctl: the supervisor outliving nothing is harmless)
            pass
    if os.getppid() != parent:
        os._exit(2)
    global _shared, _faults
    _shared, _faults = shared, faults
    watchdog.set_record(Record(memoryview(shared)[_OFFSET:_OFFSET + Record.SIZE], os.getpid()))
    faulthandler.enable(file=faults, all_threads=False)   # a crash's Python stack, for the parent's one line
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):   # the parent's request for the stack of a hang
        faulthandler.register(signal.SIGUSR1, file=faults, all_threads=False)


_shared = None
_faults = None


def _join(config) -> None:
    """A pytest-xdist worker: write this process's record into the supervisor's memory, in the slot of its number."""
    where = os.environ.get(_ENV, "")
    number = re.fullmatch(r"gw(\d+)", str(config.workerinput.get("workerid", "")))
    if not where or number is None:
        return
    try:
        pid, fd = (int(x) for x in where.split(":"))
        with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
            shared = mmap.mmap(f.fileno(), _OFFSET + _SLOTS * Record.SIZE)
    except (OSError, ValueError):  # not ours, or gone: this worker is then watched by its own limit only
        return
    if _HEADER.unpack_from(shared, 0)[0] != _MAGIC:
        return
    slot = 1 + int(number.group(1)) % (_SLOTS - 1)
    start = _OFFSET + slot * Record.SIZE
    watchdog.set_record(Record(memoryview(shared)[start:start + Record.SIZE], os.getpid()))


def pytest_sessionstart(session):
    global _session
    _session = session
    if _faults is not None:   # after pytest's faulthandler plugin pointed it at the terminal
        faulthandler.enable(file=_faults, all_threads=False)


def pytest_runtest_setup(item):
    clauses = ", ".join(cid for mark in item.iter_markers("clause") for cid in mark.args)
    watchdog.set_test(item.nodeid, clauses)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _BEFORE in config.stash:
        watchdog.restore(config.stash[_BEFORE])
    status = getattr(_session, "exitstatus", None)
    if _shared is not None:
        _HEADER.pack_into(_shared, 0, _MAGIC, 1, -1 if status is None else int(status))
    if _BEFORE in config.stash and (_shared is not None or _command_line()):
        # the report is written: processes and threads the code under test left running do not keep the run alive
        from zoo.runtime.leftovers import end_leftovers
        end_leftovers(1 if status is None else int(status))


# ------------------------------------------------------------------------------------------------ the parent
def _supervise(child: int, shared: mmap.mmap, faults: int, grace: float) -> int:
    """Wait for the child, killing what hangs past its limit; the status this process ends with."""
    def forward(signum, frame):
        _kill(child, signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    interval = max(0.1, min(1.0, watchdog.limit() / 4)) if watchdog.limit() else 1.0
    killed: dict[int, tuple[float, list]] = {}   # pid -> (when SIGUSR1 was sent, the record)
    import select
    try:
        poll = select.poll()
        poll.register(os.pidfd_open(child), select.POLLIN)
    except (AttributeError, OSError):   # Linux < 5.3: poll the child's status instead
        poll = None
    while True:
        if poll is not None:
            if poll.poll(interval * 1000):
                break
        else:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                return _ended(status, child, shared, faults, killed)
            time.sleep(min(interval, 0.05))
        now = time.monotonic()
        for slot in range(_SLOTS):
            view = memoryview(shared)[_OFFSET + slot * Record.SIZE:_OFFSET + (slot + 1) * Record.SIZE]
            pid, sequence, active, start, limit, fields = Record.read(view)
            if not active or not limit or now <= start + limit + grace or pid in killed or pid <= 0:
                continue
            if pid != child and _parent_of(pid) != child:   # a worker that died mid-call: stale
                continue
            if Record.read(view)[1] != sequence:   # the call ended while we looked
                continue
            killed[pid] = (now, fields)
            _kill(pid, signal.SIGUSR1 if pid == child else signal.SIGKILL)
            if pid != child:
                _say(f"{_hang(fields, limit)}; pytest-xdist worker (pid {pid}) killed: xdist reports its test as "
                     f"crashed")
        for pid, (when, _) in killed.items():
            if pid == child and now > when + _KILL_AFTER:
                _kill(child, signal.SIGKILL)
    return _ended(os.waitpid(child, 0)[1], child, shared, faults, killed)


def _ended(status: int, child: int, shared, faults: int, killed: dict) -> int:
    magic, finished, recorded = _HEADER.unpack_from(shared, 0)
    pid, _, active, _, limit, fields = Record.read(memoryview(shared)[_OFFSET:_OFFSET + Record.SIZE])
    if child in killed:
        _say(f"{_hang(killed[child][1], limit, _frame(faults, 'stuck at'))}; the run stopped there")
        return 1
    if finished:
        if os.WIFSIGNALED(status):
            return -os.WTERMSIG(status)
        return os.WEXITSTATUS(status) or max(recorded, 0)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        how = f"signal {signal.Signals(number).name}{_frame(faults, 'at')}"
    else:
        code = os.WEXITSTATUS(status)
        how = f"exit status {code}, without pytest ending it: os._exit or a C exit()"
    plugin, clauses, test, call = fields
    if active:
        where = f" in {call}" + (f", clause {clauses}" if clauses else "") + (f", test {test}" if test else "")
        _say(f"{plugin} ended the test process ({how}){where}; the run stopped there")
    else:
        after = f" during test {test}" if test else " while the run started"
        _say(f"the test process ended ({how}) outside any call of the code under test{after}; the run stopped there")
    return -number if os.WIFSIGNALED(status) else (code or 1)


def _hang(fields: list, limit: float, at: str = "") -> str:
    plugin, clauses, test, call = fields
    where = f" in {call}" + (f", clause {clauses}" if clauses else "") + (f", test {test}" if test else "")
    return f"{plugin} did not return within {limit:g} s (--call-timeout) and the interrupt did not stop it" \
           f"{at and ' (' + at.strip() + ')'}: killed{where}"


def _frame(faults: int, word: str) -> str:
    """' at file.py:12 in f': the innermost frame of faulthandler's dump outside the standard library ('' if none)."""
    import sysconfig
    text = os.pread(faults, 1 << 16, 0).decode("utf-8", "replace")
    library = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
    for path, line, name in frames:
        if not os.path.realpath(path).startswith(library):
            return f" {word} {path}:{line} in {name}"
    return f" {word} {frames[0][0]}:{frames[0][1]} in {frames[0][2]}" if frames else ""


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _say(line: str) -> None:
    os.write(2, f"\nERROR: {line}\n".encode("utf-8", "replace"))


def _exit(status: int) -> None:
    """End as the child ended: with its status, or by the same signal (no core file of this idle process)."""
    try:
        if status < 0:
            import resource
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if -status not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(-status, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [-status])
            os.kill(os.getpid(), -status)
    finally:
        os._exit(128 - status if status < 0 else status)
