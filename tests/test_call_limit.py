"""``python -m zoo call_timeout=SECONDS`` (zoo/runtime/call_limit.py): a plug-in that hangs while imported, or in the forward
pass (in Python, or where no signal handler runs), ends the command with one line and status 1, and a child
process it started is killed. The hangs that need the hard stop run as commands (about 8 s of CPU each, mostly
start-up); the rest run in this process (tests/cli_harness.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_harness import assert_one_line_refusal, zoo_in_process
from zoo.runtime.call_limit import DEFAULT_TIMEOUT

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):\n"


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zoo: "), err[-3000:]
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("value, why", [("0.5", "at least 1 s"), ("-1", "in [0, 1e6]"), ("nan", "in [0, 1e6]"),
                                        ("soon", "expected float")])
def test_a_limit_that_cannot_bind_is_refused(tmp_path, value, why):
    assert_one_line_refusal(zoo_in_process([f"call_timeout={value}", "task=summary"], tmp_path), "call_timeout", why)


def test_help_states_the_limit_and_its_default(tmp_path):
    outcome = zoo_in_process(["--help"], tmp_path)
    assert outcome.status == 0
    assert "call_timeout=SECONDS" in outcome.out and f"default {DEFAULT_TIMEOUT:g}" in outcome.out


def _host_handler(signum, frame):
    raise AssertionError("the host's SIGALRM handler ran during the zoo's bounded call")


@pytest.mark.parametrize("host_handler", [False, True], ids=["no handler", "host handler"])
def test_a_kernel_looping_in_python_is_interrupted(tmp_path, host_handler):
    """With a SIGALRM handler already installed (the spec suite's watchdog does so in every pytest-xdist worker that
    collects properties/), the zoo still interrupts the loop with its own, and puts the host's back after: without
    it only the hard stop remained, and that ends the host process (CI lost a worker to it)."""
    (tmp_path / "loop.py").write_text(KERNEL + "    while True:\n        try:\n            pass\n"
                                               "        except BaseException:\n            pass\n")
    before = signal.signal(signal.SIGALRM, _host_handler) if host_handler else signal.getsignal(signal.SIGALRM)
    try:
        start = time.monotonic()
        outcome = zoo_in_process(["attention.kernel=loop.py:attention", "call_timeout=1", "task.verify=false"],
                                 tmp_path, real_tasks=True)
        assert signal.getsignal(signal.SIGALRM) is (_host_handler if host_handler else before)
    finally:
        signal.signal(signal.SIGALRM, before)
    assert outcome.status == 1, outcome.err[-3000:]
    line = _one_line(outcome.err)
    assert "attention.kernel=loop.py:attention did not return within 1 s (call_timeout) in the forward pass" in line
    assert time.monotonic() - start < 30


def _zoo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "zoo", *args, f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


def test_an_import_stuck_in_c_ends_in_one_line(tmp_path):
    (tmp_path / "stuck.py").write_text("import ctypes\nctypes.CDLL(None).sleep(1000)\n" + KERNEL + "    pass\n")
    done = _zoo(tmp_path, "attention.kernel=stuck.py:attention", "call_timeout=2")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "plug-in 'stuck.py:attention' did not return within 2 s (call_timeout) in importing" in _one_line(done.stderr)


def test_a_forward_stuck_where_no_handler_runs_is_killed_with_its_child(tmp_path):
    marker = f"zoo-call-limit-test-{os.getpid()}-{time.monotonic_ns()}"
    (tmp_path / "blocked.py").write_text(
        "import signal, subprocess, sys, time\n" + KERNEL +
        f"    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', {marker!r}])\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])   # the interrupt cannot reach it\n"
        "    time.sleep(300)\n")
    done = _zoo(tmp_path, "attention.kernel=blocked.py:attention", "call_timeout=2", "task.verify=false")
    assert done.returncode == 1, done.stderr[-3000:]
    line = _one_line(done.stderr)
    assert "did not return within 2 s (call_timeout) in the forward pass" in line and "killed" in line
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"the plug-in's child process survived: {left}"
