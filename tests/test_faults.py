"""Bad input and faults: each bad value is one line and exit status 2 (no traceback), a run stopped by a signal
says so in one line and leaves its last checkpoint intact and no child process behind, task=verify writes a
report whatever its kernel does and never over another run's, and `python -m bench --check` fails on a missed
target."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import zoo.cli.command
from properties.catalog.sessions import Session, run_pytest
from zoo.io.checkpoint_read import checkpoints_in, read_state

from cli_harness import sigint_as_at_a_terminal
from training import TINY

ROOT = Path(__file__).resolve().parents[1]


def zoo_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def children_of(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found] + [g for p in found for g in children_of(int(p))]


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended; only its parent's wait is missing


# ------------------------------------------------------------------------------- bad input: one line, status 2

@pytest.fixture
def cli(monkeypatch, capsys):
    """`python -m zoo ARGS` in this process, up to the point where Hydra would start the run (which must not be
    reached: every refusal here comes first)."""
    previous = signal.getsignal(signal.SIGTERM)

    def reached_hydra(*args):
        raise AssertionError("the bad input reached Hydra's run: it was not refused up front")

    monkeypatch.setattr(zoo.cli.command, "_run", reached_hydra)
    monkeypatch.setattr(zoo.cli.command, "_hydra_entry", reached_hydra)

    def run(*arguments):
        monkeypatch.setattr(sys, "argv", ["zoo", *arguments])
        # main(ARGS) as a program calls it: main() is the command, which ends with this process's children (a test
        # process's pytest session servers among them, properties/catalog/sessions.py)
        try:
            with pytest.raises(SystemExit) as exited:
                zoo.cli.command.main(list(arguments))
        finally:
            signal.signal(signal.SIGTERM, previous)
        captured = capsys.readouterr()
        return exited.value.code, captured.err
    return run


@pytest.mark.parametrize("arguments,words", [
    (["+foo=1"], ["foo=1: unknown key"]),
    (["+foo.bar=1", "task=summary"], ["foo=", "unknown key"]),
    (["device=meta"], ["device=meta", "task=summary"]),
    (["device=mps"], ["device=mps", "not available"]),
    (["device=cuda:7"], ["device=cuda:7"]),
    (["device=tpu"], ["device=tpu", "not a device"]),
    (["norm.eps=nan"], ["norm.eps=nan", "finite"]),
    (["norm.eps=0"], ["norm.eps=0", "positive"]),
    (["ffn.dropout=2"], ["ffn.dropout=2", "[0, 1)"]),
    (["attention.dropout=-0.1"], ["attention.dropout=-0.1", "[0, 1)"]),
    (["model.layers=0"], ["model.layers=0", "positive"]),
    (["pos=rotary", "pos.base=-1"], ["pos.base=-1", "positive"]),
    (["task.seq_len=600"], ["task.seq_len=600", "max_len=128"]),
    (["task=compare", "preset=gpt2_small", "task.seq_len=65"], ["task.seq_len=65", "task.max_len=64"]),
    (["task=train", "task.lr=inf"], ["task.lr=inf", "finite"]),
    (["task=train", "task.clip=nan"], ["task.clip=nan"]),
    (["heads=7", "d_model=1e9", "task=summary"], ["heads=7", "must divide d_model=1000000000", "allowed: 1, 2, 4"]),
    (["d_model=12.5"], ["d_model=12.5", "integer"]),
    (["attention.kernel=os:system"], ["attention.kernel=os:system", "does not take the arguments"]),
])
def test_a_bad_value_is_one_line_naming_the_key(cli, arguments, words):
    status, err = cli(*arguments)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(word in lines[0] for word in words), lines[0]


def test_an_unwritable_output_directory_is_one_line(cli, tmp_path):
    (tmp_path / "file").write_text("a file where a directory should be")
    status, err = cli(f"hydra.run.dir={tmp_path / 'file' / 'out'}", "task=summary")
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot be written" in err and "Not a directory" in err


def test_a_huge_model_is_refused_up_front_and_its_card_costs_nothing(tmp_path):
    # Under an address-space limit of 1.5 GiB above what the imports took: the card of a model with 8e18
    # parameters is computed on the meta device, and the default task on a 3-billion-parameter model is refused
    # before it allocates anything, naming the memory it needs.
    driver = textwrap.dedent("""
        import resource, sys
        import zoo.cli
        used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (used + 1536 * 2**20, resource.RLIM_INFINITY))
        for arguments in (["d_model=4096", "layers=16", "vocab_size=32000"], ["task=summary", "d_model=1e9"]):
            sys.argv[1:] = arguments
            try:
                zoo.cli.main()
            except SystemExit as exit:
                print(f"exit {exit.code}", file=sys.stderr, flush=True)
            print("== end", flush=True)
            print("== end", file=sys.stderr, flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=zoo_env())
    refused, summary_err = result.stderr.split("== end\n")[:2]
    assert "Traceback" not in result.stderr, result.stderr
    lines = refused.strip().splitlines()
    assert lines[-1] == "exit 2" and len(lines) == 2, refused
    assert lines[0].startswith("zoo: model too large:") and "GiB" in lines[0] and "ulimit -v" in lines[0], lines[0]
    card = result.stdout.split("== end\n")[1]
    assert "exit" not in summary_err, summary_err
    assert "precision  float32 on meta" in card and "8,000,002,042,000,000,512" in card, card
    assert "memory" in card and "EiB" in card


# ----------------------------------------------------------------------------------------------- signals

def test_ctrl_c_during_training_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    with sigint_as_at_a_terminal():
        process = subprocess.Popen(
            [sys.executable, "-m", "zoo", "model=decoder_only", "task=train", "data=reverse", *TINY,
             "task.steps=100000", "task.batch=8", "task.eval_every=1000", "task.eval_batches=1",
             "task.checkpoint_every=3", "task.keep=2", f"task.out_dir={out}"], cwd=tmp_path,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=zoo_env())
    try:
        deadline = time.monotonic() + 120
        while len(checkpoints_in(out)) < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert len(checkpoints_in(out)) >= 2, process.communicate(timeout=10)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:   # a run the test could not stop must not train on through the rest of the test session
        process.kill()
        process.wait()
    lines = err.strip().splitlines()
    assert process.returncode == 130 and len(lines) == 1 and "Traceback" not in err, err
    assert "interrupted during training" in lines[0] and "task.resume=true" in lines[0], lines[0]
    kept = checkpoints_in(out)
    assert 1 <= len(kept) <= 2 and str(kept[-1]) in lines[0]
    for checkpoint in kept:  # whole and verified: every checksum holds
        assert read_state(checkpoint)["step"] == int(checkpoint.name.split("-")[1])
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no half-written or half-deleted one



@pytest.mark.parametrize("moment", ["deleting old checkpoints", "making the temporary directory"])
@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_checkpointing_waits_and_leaves_nothing_hidden(tmp_path, monkeypatch, number, moment):
    """The race a CI run hit: Ctrl-C in the middle of deleting an old checkpoint left its hidden remains."""
    import shutil
    import tempfile
    import torch
    import zoo.io.checkpoint as checkpoint

    class Delivered(KeyboardInterrupt):
        pass

    def handler(signum, frame):  # stands for whatever handler the process had (ours, pytest-xdist's ...)
        raise Delivered(signum)

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        checkpoint.save_training_checkpoint(tmp_path, step, model, optimizer, config={})
    (tmp_path / ".step-0000000.deleting").mkdir()  # what a run killed (-9) while deleting leaves
    module, name = (shutil, "rmtree") if moment.startswith("deleting") else (tempfile, "mkdtemp")
    original = getattr(module, name)

    def signalled(*args, **kwargs):  # without the fix the signal is handled at once, in the middle
        signal.raise_signal(number)
        return original(*args, **kwargs)

    monkeypatch.setattr(getattr(checkpoint, module.__name__), name, signalled)
    previous = signal.signal(number, handler)
    try:
        with pytest.raises(Delivered) as stopped:
            checkpoint.save_training_checkpoint(tmp_path, 3, model, optimizer, config={}, keep=1)
        assert signal.getsignal(number) is handler  # the handler in place before is back
    finally:
        signal.signal(number, previous)
    assert stopped.value.args == (number,)  # delivered once, to that handler, once the step was done
    left = sorted(p.name for p in tmp_path.iterdir())
    if moment.startswith("deleting"):  # the new checkpoint is whole, the old ones and earlier remains gone
        assert left == ["step-0000003"]
    else:  # stopped before writing: the temporary directory removed, the earlier checkpoints untouched
        assert left == [".step-0000000.deleting", "step-0000001", "step-0000002"]


# A kernel that aborts its process when a test calls it (pytest sets PYTEST_CURRENT_TEST while a test runs):
# the suite's child dies in the middle, as with a kernel that segfaults. The parent, which draws the pictures
# with it, is unharmed.
CRASHING_KERNEL = """\
import os
import torch.nn.functional as F


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if os.environ.get("PYTEST_CURRENT_TEST"):
        os.abort()
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
"""


def verify_command(*extra):
    return [sys.executable, "-m", "zoo", "model=encoder_only", "d_model=16", "heads=2", "layers=1", "d_ff=32",
            "task=verify", "task.profile=quick", *extra]


def test_runs_started_together_get_their_own_output_directories(tmp_path):
    runs = [subprocess.Popen([sys.executable, "-m", "zoo", "task=summary"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=zoo_env()) for _ in range(2)]
    assert [run.wait(timeout=300) for run in runs] == [0, 0], [run.stderr.read() for run in runs]
    assert len(set(tmp_path.glob("outputs/*/*/.hydra"))) == 2


def test_a_run_that_breaks_still_writes_its_report_and_never_over_another(tmp_path):
    (tmp_path / "crash.py").write_text(CRASHING_KERNEL)
    out = tmp_path / "out"
    command = verify_command("attention.kernel=crash.py:attention", f"hydra.run.dir={out}")
    # Two runs into one directory (a hydra.run.dir given twice), finishing together: both reports are kept.
    runs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=zoo_env()) for _ in range(2)]
    results = [(*run.communicate(timeout=300), run.returncode) for run in runs]
    for out_text, err, status in results:
        assert status == 2, out_text[-2000:] + err
        assert err.strip().splitlines()[-1].startswith("zoo: verify: the suite did not run to the end"), err
    written = {p.name for p in out.iterdir()}
    for suffix in ("", "-2"):
        assert {f"report{suffix}.json", f"report{suffix}.md"} <= written, written  # junit.xml: the child died first
        report = json.loads((out / f"report{suffix}.json").read_text())
        assert report["status"] == "broken" and report["exit_status"] == 2
        assert "killed by signal 6" in report["problem"], report["problem"]
        markdown = (out / f"report{suffix}.md").read_text()
        assert "The run broke" in markdown and f"](attention{suffix}.png)" in markdown
    said = sorted(f"report{suffix}.md" for _, err, _ in results for suffix in ("", "-2") if f"report{suffix}.md" in err)
    assert said == ["report-2.md", "report.md"], [err for _, err, _ in results]  # each run names its own


def test_sigterm_to_verify_stops_its_suite_and_leaves_no_child(tmp_path):
    process = subprocess.Popen(verify_command(f"hydra.run.dir={tmp_path / 'out'}"), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=zoo_env())
    for line in process.stdout:
        if line.startswith("verifying:"):
            break
    deadline = time.monotonic() + 60
    while not children_of(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # the child pytest is importing and collecting the suite
    children = children_of(process.pid)
    assert children, "the suite's child process never started"
    process.send_signal(signal.SIGTERM)  # the parent alone, as `kill PID` does
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143 and err.strip() == "zoo: terminated (SIGTERM)", err
    time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)]
    assert not list((tmp_path / "out").glob("report*"))  # an interrupted run writes no report


# ------------------------------------------------------------------------------------------------- bench

def test_bench_check_fails_on_a_missed_target(monkeypatch, capsys):
    import bench.decode
    import bench.run

    # Cached decoding of 4 tokens after a 3-token prompt cannot be 5x faster than recomputing the prefix (it
    # does at most 3x less work): the stated target is missed for real.
    argv = ["--toy", "--device", "cpu", "--threads", "1", "--dtypes", "float32", "--new-tokens", "4",
            "--prompt", "3", "--parts", "decode", "--out", ""]
    with pytest.raises(SystemExit) as exited:
        bench.run.main([*argv, "--check"])
    assert exited.value.code == 1
    assert "bench --check: 1 target(s) missed: cached decoding" in capsys.readouterr().err
    assert not bench.run.missed_targets(bench.run.main(argv))[1:]  # without --check: reported, no exit
    monkeypatch.setitem(bench.decode.DECODE_TARGETS, "cpu_speedup", 0.0)
    results = bench.run.main([*argv, "--check"])
    assert [t["met"] for t in results["targets"]] == [True]
    assert "every stated target met" in capsys.readouterr().out


def test_sigterm_to_a_parallel_suite_run_leaves_no_worker(tmp_path):
    pytest.importorskip("xdist")
    process = subprocess.Popen([sys.executable, "-m", "pytest", str(ROOT / "properties" / "model"), "-q", "-n", "2",
                                "-p", "no:cacheprovider", "--rootdir", str(ROOT)], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=zoo_env())
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while len(workers) < 2 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
        workers = children_of(process.pid)
    assert len(workers) >= 2, "pytest-xdist did not start its workers"
    time.sleep(1)  # the workers are importing torch
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output[-2000:]  # pytest's "interrupted": the run ended as Ctrl-C ends it
    assert "KeyboardInterrupt: SIGTERM" in output, output[-2000:]
    time.sleep(1)
    assert not [pid for pid in workers if alive(pid)]


# ------------------------------------------------------------------------------------------ the suite's options

def suite(*arguments, cwd) -> Session:
    """`python -m pytest properties/ ARGS` as a new pytest session forked from a server that imported torch once
    (properties/catalog/sessions.py): what is checked is the session's output and status, not the interpreter's
    start-up, which cost ~3 CPU-s a run."""
    return run_pytest([str(ROOT / "properties"), "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *arguments],
                      cwd=cwd, timeout=600)


def test_bad_suite_options_are_one_line_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("a file where a directory should be")
    for arguments, words in [(["--report-json", str(tmp_path / "file" / "report.json")],
                              ["--report-json", "cannot be written", "is not a directory"]),
                             (["--report-json", str(tmp_path)], ["--report-json", "is a directory"]),
                             (["--zoo", "heads='8"], ["--zoo", "No closing quotation"])]:
        result = suite(*arguments, cwd=tmp_path)
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        assert result.returncode == 4 and len(lines) == 1, result.stdout[-2000:] + result.stderr[-2000:]
        assert lines[0].startswith("ERROR: ") and all(w in lines[0] for w in words), lines[0]
        assert "INTERNALERROR" not in result.stdout + result.stderr


def test_a_device_this_machine_lacks_is_refused_in_one_line(tmp_path):
    """An asked-for device this machine lacks is refused before anything is collected, as `python -m zoo device=mps`
    refuses it (a default 'cuda' entry without CUDA is kept and its clauses skipped with the reason instead)."""
    import torch
    try:  # in this process: a failed allocation leaves nothing behind, and an interpreter costs seconds
        torch.empty(1, device="mps")
        pytest.skip("this machine has MPS")
    except Exception:  # noqa: BLE001  torch says why in its own type (NotImplementedError on a CPU build)
        pass
    result = suite("--device", "mps", cwd=tmp_path)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 4 and len(lines) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert lines[0].startswith("ERROR: --device mps: mps not available on this machine"), lines[0]


def test_a_model_whose_float64_cast_hangs_fails_each_clause_in_one_line(tmp_path):
    """--call-timeout inside a fixture (the float64 twin's cast hangs): each model clause errors with the timeout's
    line, and no later test meets pytest's internal fixture state (`assert not self._finalizers`)."""
    (tmp_path / "stubborn.py").write_text(textwrap.dedent('''
        import torch
        from properties.catalog.models import parts
        from zoo.nn.models import DecoderOnly

        def make():   # built without composing a config: only the cast may take the 2 s, even on a loaded machine
            model = DecoderOnly(**parts())
            base = type(model)

            def _apply(self, fn, *args, **kwargs):
                if fn(torch.zeros(1)).dtype == torch.float64:   # the cast to the float64 twin never returns
                    while True:
                        pass
                return base._apply(self, fn, *args, **kwargs)
            model.__class__ = type("Stubborn", (base,), {"_apply": _apply})
            return model
        '''))
    result = run_pytest([str(ROOT / "properties" / "model" / "test_models.py"), "-q", "-p", "no:cacheprovider",
                         "--rootdir", str(ROOT), "--model", "stubborn.py:make", "--call-timeout", "2",
                         "-k", "output_shape or causal_perturbation or batch_independence"], cwd=tmp_path, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "_finalizers" not in output and "INTERNALERROR" not in output, output[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR ")]
    assert len(errors) == 3, errors
    assert output.count("stubborn.py:make did not return within 2 s (--call-timeout) in module.to(float64)") >= 3, \
        output[-3000:]

def test_a_kernel_that_closes_the_standard_streams_fails_its_clauses_and_the_run_goes_on(tmp_path):
    """A kernel closing file descriptors 1 and 2 (from its first call, the start-up probe's, on): each call's clause
    fails naming the kernel and what it closed, the streams are put back, and pytest reports as usual."""
    (tmp_path / "closer.py").write_text(textwrap.dedent('''
        import os
        import torch.nn.functional as F

        def attention(query, key, value, **kw):
            os.close(1)
            os.close(2)
            return F.scaled_dot_product_attention(query, key, value, **kw)
        '''))
    result = run_pytest([str(ROOT / "properties" / "kernel" / "test_causal.py"), "-q", "-p", "no:cacheprovider",
                         "--rootdir", str(ROOT), "--kernel", "closer.py:attention", "--hypothesis-profile", "pinned",
                         "-k", "ignore_later_keys"], cwd=tmp_path, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "INTERNALERROR" not in output, output[-3000:]
    assert "kernel closer.py:attention raised a fault: it closed the standard output (file descriptor 1) and the " \
           "standard error (file descriptor 2)" in output, output[-3000:]
    assert "1 failed" in result.stdout.strip().splitlines()[-1]
