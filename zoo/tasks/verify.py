"""``task=verify``: run the spec suite (pytest properties/) on the model a config assembles, and report.

The suite runs in a child pytest process through pytest's public entry point — the same code as ``pytest
properties/`` — with ``--zoo-config`` naming the config this run composed (saved once, resolved, so the child
never composes it again), ``--kernel`` set to the attention kernel of the config, and
``--report-json``/``--junitxml`` pointed at a private temporary directory. The zoo never imports the suite:
it names it to pytest as the plugin ``properties.plugin``. Only when the run has finished are report.json, report.md and junit.xml moved into the output
directory, each by an atomic rename: an interrupted run (Ctrl-C, SIGTERM) leaves none, never half.

A report is always written once the suite has run, whatever happened: clauses that fail give exit status 1, a
run that broke (pytest's usage or internal error, a crashed child) a report saying so and exit status 2, and
a picture that cannot be drawn (a plugged kernel that raises on masks, say) a note in the report. Nothing is
written over an existing report: when the output directory already holds one (a hydra.run.dir given twice),
this run's files get the first free suffix (report-2.json, report-2.md, junit-2.xml, attention-2.png, ...),
chosen under a lock so two runs finishing together cannot pick the same one. The child pytest ends with this
process: it is stopped on Ctrl-C, SIGTERM or any error here, and on Linux the kernel sends it SIGTERM if this
process dies in any other way (PR_SET_PDEATHSIG), so no suite is left running unattended.

The reports, the pictures and a sweep's summary are written by zoo/tasks/verify_reports.py (its names are
importable from here too).
"""
from __future__ import annotations

import codecs
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from zoo.io.atomic import replacing
from zoo.tasks.plots import PLOTS_HINT
from zoo.tasks.verify_reports import (REPORT_FILES, clause_table, draw_pictures, free_suffix, reports_lock,
                                      suffixed_name, summarize, write_reports)

__all__ = ["run_suite", "verify", "suite_dir"]


def suite_dir() -> Path:
    """Where the suite's package lies, found without importing it (the zoo does not depend on the suite)."""
    spec = importlib.util.find_spec("properties")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the spec suite (package 'properties') is not installed beside the zoo")
    return Path(next(iter(spec.submodule_search_locations)))


# The child's first lines: ask the kernel for SIGTERM when the parent dies (Linux), give up if it already has,
# then run pytest exactly as `python -m pytest` would.
_CHILD = """\
import os, signal, sys
parent = int(sys.argv.pop(1))
if sys.platform.startswith("linux"):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:
        pass
if os.getppid() != parent:
    sys.exit(2)
import runpy
runpy.run_module("pytest", run_name="__main__", alter_sys=True)
"""

PYTEST_STATUS = {0: "all tests passed", 1: "tests failed", 2: "interrupted", 3: "pytest internal error",
                 4: "pytest usage error", 5: "no tests collected, or every test skipped: nothing verified"}


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _end_group(group: int) -> None:
    """SIGKILL what is left of the suite's process group (processes a plug-in started and left running)."""
    import signal
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:   # nothing left
        pass


def _child_env() -> dict[str, str]:
    """The child runs in a scratch directory: the modules `python -m zoo` found from the user's directory (its
    sys.path[0]) and relative PYTHONPATH entries must stay importable there, so both are passed as absolute paths."""
    here = os.getcwd()
    paths = [here] + [os.path.join(here, p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def absolute_kernel_path(kernel):
    """'dir/file.py:fn' relative to this directory -> the same file as an absolute path (the child's directory
    differs); names, module paths and absolute paths are returned as they are."""
    if not isinstance(kernel, str) or ":" not in kernel:
        return kernel
    where, _, name = kernel.rpartition(":")
    if (where.endswith(".py") or "/" in where or "\\" in where) and not os.path.isabs(where) \
            and os.path.isfile(where):
        return f"{os.path.abspath(where)}:{name}"
    return kernel


def run_suite(config_path: Path, kernel: str | None, *, device: str, profile: str, workdir: Path,
              echo=True, call_timeout: float | None = None) -> tuple[int, Path, Path, float, str]:
    """Run pytest on the suite in a child process, echoing its output; returns (exit status, report json,
    junit xml, seconds, the last lines of its output). The child never outlives this call."""
    report, junit = workdir / "report.json", workdir / "junit.xml"
    suite = suite_dir()
    command = [sys.executable, "-c", _CHILD, str(os.getpid()),
               "-p", "properties.plugin", str(suite), "-p", "no:cacheprovider",
               "--rootdir", str(suite.parent), "-q", "--no-header", "-rN", "--color=no",
               f"--hypothesis-profile={profile}", "--device", device, "--zoo-config", str(config_path),
               "--report-json", str(report), "--junitxml", str(junit)]
    if kernel is not None:
        command += ["--kernel", kernel]
    if call_timeout is not None:   # the suite's own limit, so the config's call_timeout holds in the suite too
        command += ["--call-timeout", f"{call_timeout:g}"]
    start = time.perf_counter()
    tail = bytearray()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    # Its own process group: what a plug-in starts and leaves running (a child process holding the output pipe) is
    # ended with it, and the output is read until pytest itself ends, not until every holder of the pipe closes it.
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=_child_env(), start_new_session=True)
    import select

    def take(chunk: bytes) -> None:
        if echo:
            sys.stdout.write(decoder.decode(chunk))
            sys.stdout.flush()
        tail.extend(chunk)
        del tail[:-6000]
    try:
        fd, ended_at = process.stdout.fileno(), None
        while True:
            ready, _, _ = select.select([fd], [], [], 0.2)
            chunk = os.read(fd, 1 << 16) if ready else None
            if chunk:
                take(chunk)
            elif chunk == b"":   # end of output: every holder closed it
                break
            if process.poll() is not None:   # pytest ended; what it wrote is read in the next 0.5 s at most
                ended_at = ended_at or time.monotonic()
                if not ready and time.monotonic() - ended_at > 0.5:
                    break
        status = process.wait()
    finally:  # Ctrl-C, SIGTERM (zoo.tasks.interrupts) or an error here: the suite stops too
        _stop(process)
        _end_group(process.pid)
        process.stdout.close()
        if echo and tail and not tail.endswith(b"\n"):   # pytest's progress letters, cut off: what follows
            sys.stdout.write("\n")                        # ("zoo: interrupted", the table) starts its own line
            sys.stdout.flush()
    text = tail.decode("utf-8", errors="replace")
    return status, report, junit, time.perf_counter() - start, "\n".join(text.splitlines()[-40:])


def configured_kernel(cfg: DictConfig) -> str | None:
    """The attention kernel of a config whose attention is the zoo's multi-head attention (or a subclass)."""
    from hydra.utils import get_class
    from zoo.nn.attention import MultiHeadAttention
    try:
        is_zoo_attention = issubclass(get_class(cfg.attention._target_), MultiHeadAttention)
    except Exception:  # a replacement that is not a class: it has no kernel option of ours
        return None
    kernel = cfg.attention.get("kernel") if is_zoo_attention else None
    return kernel if isinstance(kernel, str) else None


def verify(cfg: DictConfig, overrides: list[str], choices: dict[str, str], out_dir: Path, *, profile: str,
           model=None) -> int:
    """Run the suite on the configured model, print the clause table, write the reports; the exit status:
    0 every clause passed, 1 a clause failed, 2 the run broke (its report says how)."""
    kernel = configured_kernel(cfg)
    print(f"verifying: pytest properties/ --zoo-config config.yaml{f' --kernel {kernel}' if kernel else ''} "
          f"--hypothesis-profile={profile}  (python -m zoo {' '.join(overrides)})", flush=True)
    kernel = absolute_kernel_path(kernel)
    saved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if isinstance(saved.attention.get("kernel"), str):
        saved.attention.kernel = absolute_kernel_path(saved.attention.kernel)
    with tempfile.TemporaryDirectory(prefix="zoo-verify-") as scratch:
        config_path = Path(scratch) / "config.yaml"  # the config composed once, for the child to load,
        OmegaConf.save(saved, config_path)  # with Hydra's record of the options chosen beside it
        OmegaConf.save({"hydra": {"runtime": {"choices": choices}}}, Path(scratch) / "hydra.yaml")
        # A KeyboardInterrupt (Ctrl-C, SIGTERM) propagates from here: an interrupted run writes no report.
        status, report_path, junit, seconds, tail = run_suite(config_path, kernel, device=cfg.device,
                                                              profile=profile, workdir=Path(scratch),
                                                              call_timeout=float(cfg.get("call_timeout", 60.0)))
        records, problem = [], ""
        if report_path.exists():
            try:
                records = json.loads(report_path.read_text(encoding="utf-8"))
            except ValueError as exc:
                problem = f"the suite's record is unreadable ({exc})"
        if status not in (0, 1):
            meaning = PYTEST_STATUS.get(status, f"killed by signal {-status}" if status < 0 else "unknown")
            problem = f"the suite did not run to the end (pytest exit status {status}: {meaning})"
        elif not report_path.exists():
            problem = "the suite wrote no record of its tests"
        exit_status = 2 if problem else status
        pictures = Path(scratch) / "pictures"
        pictures.mkdir()
        from zoo.runtime.call_limit import bounded
        from zoo.config.schema import plugin_in
        with bounded(plugin_in(cfg), "drawing the attention pictures of task=verify"):   # the kernel runs here too
            drawn, notes = draw_pictures(model, cfg.d_model, pictures)
        with reports_lock(out_dir):
            names = [*REPORT_FILES, *(path.name for path in drawn.values())]
            suffix = free_suffix(out_dir, names)
            figures = {}
            for title, path in drawn.items():
                with replacing(out_dir / suffixed_name(path.name, suffix)) as temporary:
                    shutil.copyfile(path, temporary)
                figures[title] = suffixed_name(path.name, suffix)
            report = write_reports(out_dir, cfg=cfg, overrides=overrides, records=records, junit=junit,
                                   seconds=seconds, status=exit_status, figures=figures, suffix=suffix, notes=notes,
                                   problem=problem, output_tail=tail if problem else "")
    rows = summarize(records)
    print()
    print(clause_table(rows))
    totals = report["totals"]
    where = out_dir if not suffix else \
        f"{out_dir} ({suffixed_name('report.md', suffix)}: the directory already held a report)"
    print(f"\n{totals['passed']} clauses passed, {totals['failed'] + totals['error']} failed, "
          f"{totals['skipped']} skipped in {seconds:.1f} s; reports in {where}")
    if report.get("model_dtypes"):
        print(f"the model clauses ran the model in {', '.join(report['model_dtypes'])}")
    for title, note in notes.items():
        print(f"(picture not drawn: {title}: {note})")
    if not figures and not notes:
        print(f"(no pictures: {PLOTS_HINT})")
    if problem:
        print(f"zoo: verify: {problem}; report in {out_dir / suffixed_name('report.md', suffix)}", file=sys.stderr)
    return exit_status
