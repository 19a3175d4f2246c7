"""Plug-in files that misbehave, fuzzed, each run by ``pytest`` in a process of its own (properties/plugin/watchdog.py).

Hypothesis draws a plug-in — a kernel, a model factory or a module (a norm, through --zoo) — and one misdeed at
import, while built or while called: ending the process (os._exit, sys.exit), raising a BaseException, hanging in
Python or in C, crashing, returning something that is not the contract's tensor, or printing garbage around a
correct answer. Whatever it does, the run never reads as a pass unless the plug-in was correct; it ends with a
reported failure (status 1), a one-line error (pytest's usage-error status 4), pytest's "interrupted" (2) for a
KeyboardInterrupt, or the supervisor's one line naming the plug-in (status never 0); it prints no INTERNALERROR
and no Python traceback outside pytest's reports of the failed tests, and a run that broke writes no
--report-json. Each run costs a pytest start-up
(~5 CPU-s): four pinned cases, two drawn.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from hypothesis import assume, example, given, settings, strategies as st

from properties.catalog.sessions import run_pytest

ROOT = Path(__file__).resolve().parents[1]
# --call-timeout for these runs: a hang costs it in wall time (a Python loop below sleeps, so no CPU time), while a
# correct call takes milliseconds; importing the plug-in (torch and the zoo are loaded by then) well under a second.
# Hydra's composition and the zoo's own imports are not timed (properties/core/zoo_config.py: _plugin_call): under
# load ~7 they once spent the whole 10 s before a module plug-in's clause ran.
TIMEOUT = "10"

MISDEEDS = {   # name -> (statement in the plug-in, what the run must end with)
    "os._exit(0)": ("os._exit(0)", "fatal"),
    "os._exit(3)": ("os._exit(3)", "fatal"),
    "segfault": ("ctypes.string_at(0)", "fatal"),
    "hang in C": ("signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM]); time.sleep(10**6)", "fatal"),
    "sys.exit(0)": ("sys.exit(0)", "error"),
    "sys.exit('text')": ("sys.exit('bye')", "error"),
    "GeneratorExit": ("raise GeneratorExit('gen')", "error"),
    "a BaseException": ("raise type('Odd', (BaseException,), {})('odd')", "error"),
    "pytest.skip": ("import pytest; pytest.skip('no')", "error"),
    "pytest.exit(0)": ("import pytest; pytest.exit('bye', returncode=0)", "error"),
    "ValueError": ("raise ValueError('plain')", "error"),
    "sleep": ("time.sleep(10**6)", "error"),
    "a Python loop": ("while True: sum(range(100)); time.sleep(0.01)", "error"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", "interrupted"),
    "a string": ("return 'garbage'", "error"),
    "a wrong shape": ("return torch.zeros(1)", "error"),
    "print garbage": ("print('garbage \\x1b[31m' * 40); print('ERROR: not ours', file=sys.stderr)", "benign"),
}
WHEN = ("import", "build", "call")
HANGS = ("sleep", "a Python loop")   # hangs in Python: the interrupt ends them

HEADER = "import ctypes, os, signal, sys, time\nimport torch\nimport torch.nn.functional as F\n\n\ndef misdeed():\n    {}\n"
PLUGINS = {
    "kernel": """
def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if {call}:
        bad = misdeed()
        if bad is not None:
            return bad
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
""",
    "model": """
from properties import Subject


class Tiny(torch.nn.Module):   # MODEL-SHAPE asks for logits of the right shape, nothing more
    def __init__(self):
        super().__init__()
        self.embedding, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, tokens, mask):
        if {call}:
            bad = misdeed()
            if bad is not None:
                return bad
        return self.head(self.embedding(tokens))


def model():
    if {build}:
        bad = misdeed()
        if bad is not None:
            return bad
    tiny = Tiny()
    return Subject(kind="decoder_only", forward=tiny, vocab_size=16, max_len=16, module=tiny, positional=False)
""",
    "module": """
from zoo.nn.norm import LayerNorm


class BadNorm(LayerNorm):
    def __init__(self, *args, **kwargs):
        if {build}:
            misdeed()
        super().__init__(*args, **kwargs)

    def forward(self, x):
        if {call}:
            bad = misdeed()
            if bad is not None:
                return bad
        return super().forward(x)
""",
}
SELECTION = {   # the few clauses each run needs: every one calls the plug-in
    "kernel": lambda d: ["properties/kernel/test_softmax.py", "--kernel", f"{d}/plug.py:attention"],
    "model": lambda d: ["properties/model/test_models.py", "-k", "test_output_shape", "--model", f"{d}/plug.py:model"],
    "module": lambda d: ["properties/module/test_norms.py", "--zoo", "norm._target_=plug.BadNorm"],
}


def plugin_source(level: str, misdeed: str, when: str) -> str:
    statement = MISDEEDS[misdeed][0]
    source = HEADER.format(statement) + PLUGINS[level].format(build=when == "build", call=when == "call")
    return source + ("\nmisdeed()\n" if when == "import" else "")


def run(level: str, misdeed: str, when: str, folder: str) -> subprocess.CompletedProcess:
    Path(folder, "plug.py").write_text(plugin_source(level, misdeed, when))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "PROPERTIES_WATCHDOG")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([folder, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-m", "pytest", *SELECTION[level](folder), "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(ROOT), "--hypothesis-profile", "pinned", "--call-timeout", TIMEOUT,
                           "--report-json", f"{folder}/out/report.json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return proc


def outside_failure_reports(output: str) -> str:
    """The output without pytest's reports of failed tests (between its FAILURES or ERRORS banner and the short
    summary), where the user's own traceback belongs (Hypothesis' groups of distinct failures print as Python's)."""
    return re.sub(r"^=+ (FAILURES|ERRORS) =+$.*?(?=^=+ short test summary info =+$|\Z)", "", output,
                  flags=re.M | re.S)


LEVEL_WHEN = st.sampled_from(sorted(PLUGINS)).flatmap(
    lambda level: st.tuples(st.just(level), st.sampled_from(WHEN if level != "kernel" else ("import", "call"))))


@settings(max_examples=2, deadline=None)
@given(level_when=LEVEL_WHEN, misdeed=st.sampled_from(sorted(MISDEEDS)))
@example(level_when=("kernel", "call"), misdeed="os._exit(0)")
@example(level_when=("model", "call"), misdeed="segfault")
@example(level_when=("module", "call"), misdeed="hang in C")
@example(level_when=("module", "build"), misdeed="a Python loop")   # the zoo's size check catches the interrupt
def test_a_misbehaving_plugin_never_reads_as_a_pass(level_when, misdeed):
    level, when = level_when
    expected = MISDEEDS[misdeed][1]
    # A value returned at import, or by a constructor (Python ignores it), is no misdeed: nothing to run.
    assume(not (MISDEEDS[misdeed][0].startswith("return") and (when == "import" or (level, when) == ("module", "build"))))
    with tempfile.TemporaryDirectory(prefix="misbehaving-") as folder:
        check_run(level, misdeed, when, expected, folder)


def check_run(level: str, misdeed: str, when: str, expected: str, folder: str) -> None:
    proc = run(level, misdeed, when, folder)
    output = proc.stdout + proc.stderr
    where = f"{level} plug-in, {misdeed} at {when}: status {proc.returncode}\n{output[-3000:]}"
    assert "Traceback (most recent call last)" not in outside_failure_reports(output), where
    assert "INTERNALERROR" not in output, where
    report = Path(folder, "out", "report.json")
    if expected == "benign":
        assert proc.returncode == 0 and report.is_file(), where
        return
    if expected == "fatal" or (expected == "error" and when != "call"):   # the run broke: it wrote nothing
        assert not Path(folder, "out").exists(), where
    assert proc.returncode != 0, where
    errors = [line for line in output.splitlines() if line.startswith("ERROR: ") and "not ours" not in line]
    if expected == "fatal":
        assert len(errors) == 1 and ("ended the test process" in errors[0] or "did not return" in errors[0]), where
        assert "plug" in errors[0], where   # the plug-in is named: plug.py:attention, plug.BadNorm, ...
        if when == "call":   # in a clause, or in the probe of a kernel's limits that precedes them
            assert re.search(r"clause [A-Z0-9, -]+, test properties/|a probe of its limits", errors[0]), where
        if misdeed == "segfault":
            assert proc.returncode == -11 and re.search(r"signal SIGSEGV at .*plug\.py:\d+ in misdeed", errors[0]), where
        if misdeed == "hang in C":
            assert proc.returncode == 1 and re.search(r"stuck at .*plug\.py:\d+ in misdeed", errors[0]), where
    elif expected == "interrupted":
        assert proc.returncode == 2, where
    elif when == "call" and level == "kernel" and misdeed in HANGS:   # its first call is the start-up probe of its
        lines = [line for line in output.splitlines() if line.strip()]   # limits: one line before any test runs
        assert proc.returncode == 4 and len(lines) == 1 and "a probe of its limits" in lines[0], where
    elif when == "call":   # a failure of the clauses that called it, in the report too
        assert proc.returncode == 1 and re.search(r"^FAILED|^ERROR properties/", proc.stdout, re.M), where
        statuses = {row["status"] for row in json.loads(report.read_text())}
        assert statuses & {"failed", "error"}, where
    else:   # at import or while built: one line before any test runs
        lines = [line for line in output.splitlines() if line.strip()]
        assert proc.returncode == 4 and len(lines) == 1 and lines[0].startswith("ERROR: "), where


def test_a_bad_call_timeout_is_one_line_before_anything_runs():
    proc = run_pytest(["properties/", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), "--call-timeout", "soon"],
                      cwd=ROOT, timeout=300)   # a session forked from a server that imported torch once
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 4 and lines == ["ERROR: --call-timeout 'soon': expected a number of seconds in [0, 1e6] "
                                              "(0: no limit)"], proc.stdout[-2000:] + proc.stderr[-2000:]
