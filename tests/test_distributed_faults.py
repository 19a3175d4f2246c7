"""Bad input and faults at the distributed level, run as a user runs it (`python -m pytest properties/ --world-size 2
--kernel FILE.py:fn ...` as a new pytest session, forked from the catalog's session server, or under torchrun; the
broken kernels are tests/distributed_kernels.py): a bad option or a kernel the suite cannot use is one line and
pytest's usage status (4); a rank that raises, returns the wrong shape, hangs, never joins a collective, exits or is
killed fails the clauses with lines that name the rank and the clause; a hang costs --call-timeout once; no process
of the run survives it (every process it started carries a token in its environment, looked for in /proc
afterwards); and no run can hang this test (each is killed past a time limit)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from properties.catalog.sessions import run_pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "tests/distributed_kernels.py"
LIMIT = 10          # --call-timeout of these runs (seconds)
NEVER = 600         # a run still going after this long has hung: killed, and the test fails
USAGE_ERROR = 4     # pytest's status for a UsageError (one 'ERROR: ...' line, nothing collected)
pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="the processes a run leaves are looked for in /proc (Linux)")


def _processes_with(token: str) -> dict[int, str]:
    """pid -> command line of every process whose environment holds ``token``, but the session servers the runs are
    forked from (started with it, they outlive each run by design)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes():
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:   # ended meanwhile, or not ours to read
            continue
    return {pid: command for pid, command in found.items() if f"-m {SESSION_SERVER}" not in command}


# The environment token of this process's runs: one for all of them, so that they share a session server (a run
# whose environment differs gets a server of its own); each run's leftovers are killed before the next starts.
TOKEN = f"CP_FAULTS_{uuid.uuid4().hex}"
SESSION_SERVER = "properties.catalog.sessions"


def run_suite(*arguments: str, runner: tuple[str, ...] | None = None):
    """``python -m pytest properties/ -q -p no:cacheprovider ARGUMENTS`` from the repository root, forked from the
    session server (``runner``: a command of its own, torchrun's): (status, output, seconds, processes of the run
    still alive 5 s after it ended)."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, "OMP_NUM_THREADS": "1",
           TOKEN: "1"}
    command = ["properties/", "-q", "-p", "no:cacheprovider", *arguments]
    start = time.monotonic()
    if runner is None:
        session = run_pytest(command, cwd=ROOT, env=env, timeout=NEVER)
        if session.timed_out:
            pytest.fail(f"the run did not end within {NEVER} s: {' '.join(arguments)}\n{session.output[-3000:]}")
        status, output = session.returncode, session.output
    else:
        process = subprocess.Popen([*runner, *command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=NEVER)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"the run did not end within {NEVER} s: {' '.join(arguments)}\n{output[-3000:]}")
        status = process.returncode
    seconds = time.monotonic() - start
    end = time.monotonic() + 5
    while (left := _processes_with(TOKEN)) and time.monotonic() < end:
        time.sleep(0.2)
    for pid in left:   # leave nothing to the next test either
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return status, output, seconds, left


def assert_one_line_usage_error(arguments, *words):
    status, output, seconds, left = run_suite(*arguments)
    lines = [line for line in output.splitlines() if line.strip()]
    assert status == USAGE_ERROR and len(lines) == 1, output[-3000:]
    assert lines[0].startswith("ERROR: ") and "Traceback" not in output, lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    assert not left, f"processes left behind: {left}"
    return lines[0]


# ------------------------------------------------------------------------------------------- bad input: one line

def test_more_ranks_than_the_machine_holds_is_one_line():
    line = assert_one_line_usage_error(["--world-size", "4096"], "--world-size 4096: this machine holds at most")
    assert "CPU core" in line or "memory" in line, line


def test_a_master_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_usage_error(["--world-size", "2", "--master-port", str(port)],
                                    f"--master-port {port}", "cannot listen there", "address already in use")


@pytest.mark.parametrize("where", ["call", "import"])
def test_a_kernel_that_makes_its_own_process_group_is_one_line(tmp_path, where):
    spec = f"{KERNELS}:calls_init_process_group"
    if where == "import":
        path = tmp_path / "own_group.py"
        path.write_text("import torch.distributed as dist\n\ndist.init_process_group('gloo')\n\n\n"
                        "def attention(q, k, v, **kwargs):\n    return q\n")
        spec = f"{path}:attention"
    assert_one_line_usage_error(["--world-size", "2", "--kernel", spec, "--call-timeout", str(LIMIT)],
                                "called torch.distributed.init_process_group", "on rank", "group=")


def test_a_kernel_that_declines_the_layout_is_one_line():
    """Declining the plainest problem in every dtype, in its own words, on every rank: nothing can be verified, and
    the line says which --shard was given."""
    assert_one_line_usage_error(["--world-size", "2", "--shard", "zigzag", "--kernel",
                                 f"{KERNELS}:declines_every_problem", "--call-timeout", str(LIMIT)],
                                "--shard zigzag", "declines the plainest problem on 2 ranks, zigzag shards",
                                "does not support the zigzag layout", "float32")


@pytest.mark.parametrize("body,words", [
    (None, ["does not exist"]),
    ("import a_module_nobody_has\n", ["cannot import", "ModuleNotFoundError", "a_module_nobody_has"]),
    ("def attention(q, k, v, **kwargs:\n", ["cannot import", "SyntaxError"]),
])
def test_a_kernel_path_that_does_not_import_is_one_line(tmp_path, body, words):
    path = tmp_path / "theirs.py"
    if body is not None:
        path.write_text(body)
    assert_one_line_usage_error(["--world-size", "2", "--kernel", f"{path}:attention", "--call-timeout", str(LIMIT)],
                                "--kernel", str(path), *words)


# -------------------------------------------------------------------------------- faults: the rank and the clause

# Each broken kernel (tests/distributed_kernels.py: only rank 1 misbehaves) and what every one of its clause failures
# must say; all of them in one run, as a user may pass several kernels, with the zoo's ring after them, which must
# still pass every clause it runs.
FAULTS = {
    "raises_on_rank_1": "rank 1 of 2 raised RuntimeError: rank 1 lost its key cache",
    "raises_in_the_backward_on_rank_1": "rank 1 of 2 raised RuntimeError: rank 1's backward lost the saved key "
                                        "block in the backward pass of",
    "wrong_shape_on_rank_1": "rank 1's output shape",
    "hangs_on_rank_1": f"rank 1 did not return within {LIMIT} s (--call-timeout); rank 0 timed out in a collective",
    "hangs_on_rank_1_ignoring_alarms": f"rank 1 did not answer within {LIMIT} s (--call-timeout); rank 0 timed out "
                                       f"in a collective",
    "hangs_on_batches_on_rank_1": f"rank 1 did not return within {LIMIT} s (--call-timeout)",
    "skips_the_ring_on_rank_1": "rank 1 returned without joining the collective rank 0 waited in",
    "exits_on_rank_1": "rank 1 ended (exit status 3)",
    "killed_on_rank_1": "rank 1 ended (signal 9)",
}
HANGS = ("hangs_on_rank_1", "hangs_on_rank_1_ignoring_alarms", "hangs_on_batches_on_rank_1",
         "skips_the_ring_on_rank_1")
CLAUSES = ("CP-SHAPE", "CP-ORACLE", "CP-CAUSAL", "CP-SCALE", "CP-GQA", "CP-GRAD", "CP-INPUTS-UNCHANGED", "CP-HISTORY",
           "CP-WORLD-SIZE", "CP-SHARD-EDGES")


@pytest.fixture(scope="module")
def faulty_run():
    kernels = [a for name in FAULTS for a in ("--kernel", f"{KERNELS}:{name}")]
    return run_suite("--world-size", "2", *kernels, "--kernel", "ring", "--kernel", f"{KERNELS}:declines_late_on_rank_1",
                     "--call-timeout", str(LIMIT), "-rfEp")


def _failure_lines(output: str, name: str) -> list[str]:
    """The one-line messages the clauses of kernel ``name`` failed with (pytest's 'E   Type: message' lines)."""
    spec = re.escape(f"kernel {KERNELS}:{name}")
    return [m.group(1) for m in re.finditer(rf"^E +\S+(?:RanksLost|KernelContractError): ({spec}[: ].*)$", output,
                                            re.MULTILINE)]


def test_faulty_ranks_are_named_with_the_clause_and_the_run_goes_on(faulty_run):
    status, output, seconds, left = faulty_run
    assert status == 1 and "INTERNALERROR" not in output and "Traceback (most recent call last)" not in output, \
        output[-5000:]
    assert not left, f"processes left behind: {left}"
    for name, words in FAULTS.items():
        lines = _failure_lines(output, name)
        assert lines, f"no clause of {name} failed:\n{output[-5000:]}"
        failed = {c for line in lines for c in re.findall(r"\[clause (CP-[A-Z-]+)\]", line)}
        assert len(failed) == len(lines) and failed, lines   # every line names its clause, once
        assert all(words in line for line in lines), (name, lines)
    for name in HANGS:   # every clause of a kernel that hung fails, at once after the first: it is not called again
        failed = {c for line in _failure_lines(output, name) for c in re.findall(r"\[clause (CP-[A-Z-]+)\]", line)}
        assert failed == set(CLAUSES), (name, failed)
    first = _failure_lines(output, "hangs_on_batches_on_rank_1")
    assert any("(the start-up probe)" not in line for line in first), first   # met in a clause, not at start-up
    ring = {line.split()[0] for line in output.splitlines() if line.endswith("[ring]")}
    passed = [line for line in output.splitlines() if line.startswith("PASSED") and line.endswith("[ring]")]
    ring_failures = [line for line in output.splitlines() if "[ring]" in line and not line.startswith("PASSED")]
    assert ring == {"PASSED"} and len(passed) == len(CLAUSES) - 1, (   # CP-SHARD-EDGES: declined, skipped
        ring_failures, re.findall(r"^E +.*kernel ring\b.*$", output, re.MULTILINE)[:10])
    # The same kernel with rank 1 reaching its decline of unequal shards 3 s late (a loaded machine): declined, not
    # a failure.
    late = [line for line in output.splitlines() if line.endswith("declines_late_on_rank_1]")]
    assert late and not [line for line in late if line.startswith(("FAILED", "ERROR"))], late


def test_a_hang_costs_the_call_timeout_once(faulty_run):
    """Four kernels hang (or leave a rank waiting) once each: the run's wall time is the rest of the run plus at most
    the driver's deadline (--call-timeout + 2 s + a quarter of it) per hung kernel, with room for a loaded machine."""
    status, output, seconds, left = faulty_run
    deadline = LIMIT + 2 + LIMIT / 4
    assert seconds < len(HANGS) * deadline + 240, seconds


# ------------------------------------------------------------------------------------------------------ torchrun

@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_under_torchrun_the_suite_joins_its_group_and_names_the_rank():
    """`torchrun --nproc_per_node 2 -m pytest properties/ --world-size 2`: rank 0 runs the session, rank 1 serves it;
    the zoo's ring passes (pinned problems), and a broken kernel's failures in the same run name rank 1 and the
    clause."""
    torchrun = (shutil.which("torchrun"), "--nproc_per_node", "2", "-m", "pytest")
    status, output, seconds, left = run_suite("--world-size", "2", "--hypothesis-profile", "pinned", "--kernel", "ring",
                                              "--kernel", f"{KERNELS}:wrong_shape_on_rank_1", "-rfEp", runner=torchrun)
    assert status == 1 and "INTERNALERROR" not in output, output[-5000:]
    assert not left, f"processes left behind: {left}"
    assert "torchrun rank 1 of 2: served rank 0's session" in output, output[-3000:]
    ring = [line for line in output.splitlines() if "[ring]" in line]
    assert any(line.startswith("PASSED") for line in ring), output[-3000:]
    assert not [line for line in ring if line.startswith(("FAILED", "ERROR"))], ring
    lines = _failure_lines(output, "wrong_shape_on_rank_1")
    assert lines and all("rank 1's output shape" in line and "[clause CP-" in line for line in lines), \
        output[-5000:]
