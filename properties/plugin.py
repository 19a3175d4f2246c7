"""Pytest wiring for the spec suites: options, kernel/device parametrization, clause reports, profiles.

Options (``pytest properties/ --help``, group "spec properties"):

  --kernel SPEC           kernel under test, repeatable: a zoo backend (math, torch), 'pkg.module:function'
                          or 'path/to/file.py:function'; default: math and torch
  --device DEVICE         cpu, cuda, cuda:N, repeatable; default: cpu and every CUDA device (a bare
                          'cuda' entry, skipped with a reason, when there is none)
  --dtype DTYPE           float32, float64, bfloat16, float16, repeatable; default: all four
  --causal-alignment A    top-left (PyTorch, default) or bottom-right (FlashAttention)
  --fully-masked P        zeros (default), nan, mean or any: what a query with no admissible key must output
  --report-json PATH      write one record per (test, clause) for every test run
  --kernel-api API        sdpa (default), flash, flash-varlen or flash-kvcache: the calling convention of
                          --kernel (flash-attn 2.x keywords, properties/kernel/test_flash*.py); with a flash
                          API and no --kernel, the zoo's own kernels of that API (flash: all three)
  --window-right-below-lk draw flash windows with 0 <= right < Lk only (flash-attn 2's CUDA kernel)
  --reference-kernel SPEC a kernel each kernel under test must agree with, forward and backward (ATTN-DIFF*)
  --reference FACTORY     a model the model under test must agree with (MODEL-DIFF-*; properties/reference.py)

Which clauses run: with --kernel alone the kernel clauses; with --model the model clauses (and the kernel
clauses too if --kernel is also given); with --zoo, or with no plug-in option, every level.

Hypothesis profiles (select with Hypothesis' own ``--hypothesis-profile``): ``default`` (few examples, so
the whole suite stays fast), ``ci`` (the same, derandomized: reproducible runs), ``thorough`` (many
examples).  All disable the deadline: kernel timings vary with the device, its warm-up and other load.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import Phase, settings

from properties.core.levels import LEVELS, in_suite, level_of
from properties.core.zoo_config import zoo_run
from properties.model import subjects  # --model / --zoo: which models the model clauses run on
from properties import reference  # --reference / --reference-kernel: what the differential clauses compare with
from properties.kernel.guard import FULLY_MASKED_CONVENTIONS, GuardedKernel
from properties.core.oracle import ALIGNMENTS
from properties.core.spec import SpecError, load_clauses
from properties.core.strategies import DTYPES, select_dtypes
from properties.core.flash import set_window_right_below_lk
from properties.core.flash_guard import KERNEL_APIS, kernel_params
from zoo.io.atomic import write_text
from zoo.nn.kernel import KERNELS, resolve_kernel
from zoo.config.plugins import PluginError

# No "explain" phase: its report names lines of the assertion helpers, never the property's cause.
_PHASES = tuple(p for p in Phase if p != Phase.explain)
_DEFAULT = settings(max_examples=12, deadline=None, phases=_PHASES)
_PROFILES = {
    "default": _DEFAULT,
    "ci": settings(_DEFAULT, derandomize=True, print_blob=True),
    "thorough": settings(_DEFAULT, max_examples=400),
    # `python -m zoo` (the default task) checks the assembled model in seconds; `task=verify` runs `default`.
    "quick": settings(_DEFAULT, max_examples=3),
    # Only the @example shapes pinned for known bug classes: a seconds-long smoke run, and the check that no
    # catalogued bug depends on a lucky draw (python -m properties.catalog.pinned).
    "pinned": settings(_DEFAULT, phases=(Phase.explicit,)),
}
PROFILE_NAMES = tuple(_PROFILES)   # --hypothesis-profile values the suite registers


def _use_suite_profiles() -> None:
    """Register the suite's profiles (``default`` among them, replacing Hypothesis' own) and load ``default``."""
    for name, profile in _PROFILES.items():
        settings.register_profile(name, profile)
    settings.load_profile("default")


_SEED = pytest.StashKey[int]()


def _fix_seed(config) -> None:
    """Every suite run has one Hypothesis seed, printed in the header and after failures, so that a failure
    reproduces with --hypothesis-seed=N (given, it is honoured; otherwise one is drawn)."""
    seed = getattr(config.option, "hypothesis_seed", None)
    if seed is None:
        import random
        seed = random.SystemRandom().randrange(2**31)
        config.option.hypothesis_seed = seed   # Hypothesis' plugin reads it after this hook (tryfirst)
    config.stash[_SEED] = seed


def pytest_report_header(config):
    if _SEED in config.stash:
        seed = config.stash[_SEED]
        return f"spec suite: Hypothesis seed {seed} (reproduce with --hypothesis-seed={seed})"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SEED in config.stash and terminalreporter.stats.get("failed"):
        seed = config.stash[_SEED]
        terminalreporter.write_line(f"spec suite: reproduce these failures with --hypothesis-seed={seed} "
                                    f"(the counterexamples above are also kept in .hypothesis/)")


def _targets_suite(config) -> bool:
    """Whether this pytest run collects the spec suite (a path inside it, a path that holds it, or --pyargs
    properties): only then are the suite's Hypothesis profiles registered and ``default`` loaded, so that
    an unrelated test suite in an environment where the plugin is installed keeps Hypothesis' own settings
    and profiles."""
    from pathlib import Path
    suite = Path(__file__).resolve().parent
    for arg in config.args:
        name = arg.split("::")[0]
        if config.getoption("pyargs", False) and (name == "properties" or name.startswith("properties.")):
            return True
        path = (Path(config.invocation_params.dir) / name).resolve()
        if path == suite or suite in path.parents:
            return True
        if path in suite.parents:   # collected from above, unless it lies where pytest does not look
            hidden = [p for p in suite.relative_to(path).parts if p.startswith(".") or p.endswith("-packages")]
            if not hidden:
                return True
    return False

_KERNELS = pytest.StashKey[list]()
_FLASH = pytest.StashKey[dict]()   # --kernel-api: fixture -> params (properties.core.flash_guard.kernel_params)
_DEVICES = pytest.StashKey[list]()
_records: dict[str, dict] = {}  # nodeid -> outcome over its phases, for --report-json


def pytest_addoption(parser):
    group = parser.getgroup("spec properties", "kernel and options for the spec suites in properties/")
    group.addoption("--kernel", action="append", metavar="SPEC",
                    help=f"kernel under test (repeatable): one of {sorted(KERNELS)}, 'pkg.module:function' or "
                         "'path/to/file.py:function'; default: the zoo's backends math and torch")
    group.addoption("--device", action="append", metavar="DEVICE",
                    help="device to test on (repeatable): cpu, cuda, cuda:N; default: every available device")
    group.addoption("--dtype", action="append", choices=list(DTYPES),
                    help="dtype to draw (repeatable); default: all four")
    group.addoption("--causal-alignment", choices=ALIGNMENTS, default="top-left",
                    help="is_causal diagonal for L != S: top-left (PyTorch, default) or bottom-right "
                         "(FlashAttention)")
    group.addoption("--fully-masked", choices=FULLY_MASKED_CONVENTIONS, default="zeros",
                    help="output required for a query with no admissible key: zeros (default), nan, mean (of the "
                         "values, as an additive finfo.min mask gives) or any (no requirement)")
    group.addoption("--report-json", metavar="PATH",
                    help="write a JSON list of {clause, title, status, nodeid, duration_s, message}")
    group.addoption("--kernel-api", choices=KERNEL_APIS, default="sdpa",
                    help="calling convention of --kernel: sdpa (default, the SDPA signature) or flash-attn 2.x's "
                         "flash, flash-varlen, flash-kvcache; a flash API without --kernel checks the zoo's kernels")
    group.addoption("--window-right-below-lk", action="store_true",
                    help="flash clauses: draw windows with 0 <= right < Lk only (where flash-attn 2's CUDA kernel "
                         "follows its docstring)")
    subjects.add_options(parser)
    reference.add_options(parser)


def _default_devices() -> list[str]:
    if torch.cuda.is_available():
        return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", "cuda"]  # the cuda entry is skipped with its reason, so the report says why


def _device_param(name: str):
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise pytest.UsageError(f"--device {name!r}: {exc}") from None
    reason = None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            reason = "CUDA not available"
        elif device.index is not None and device.index >= torch.cuda.device_count():
            reason = f"{name} not present ({torch.cuda.device_count()} CUDA device(s))"
    elif device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except Exception:  # any backend may refuse in its own way (PyTorch's message lists every backend)
            reason = f"{name} not available on this machine"
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return pytest.param(name, marks=marks, id=name)


def _report_path_problem(path: str) -> str | None:
    """Why --report-json PATH could not be written at the end of the run (checked before it starts), or None."""
    import os
    from pathlib import Path
    target = Path(path).absolute()
    if target.is_dir():
        return "is a directory"
    ancestor = next((p for p in target.parents if p.exists()), None)
    if ancestor is not None and not ancestor.is_dir():
        return f"{ancestor} is not a directory"
    if ancestor is not None and not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    if target.exists() and not os.access(target, os.W_OK):
        return "is not writable"
    return None


_SIGTERM = pytest.StashKey[object]()


def _interrupt_on_sigterm(config) -> None:
    """SIGTERM ends the run as Ctrl-C does (KeyboardInterrupt): fixtures tear down and pytest-xdist stops its
    workers, instead of the process vanishing and leaving its children running. Restored at unconfigure."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        config.stash[_SIGTERM] = signal.signal(signal.SIGTERM, interrupt)


def pytest_unconfigure(config):
    if _SIGTERM in config.stash:
        import signal
        signal.signal(signal.SIGTERM, config.stash[_SIGTERM])


@pytest.hookimpl(tryfirst=True)   # before Hypothesis' plugin loads --hypothesis-profile, which may name ours
def pytest_configure(config):
    if _targets_suite(config):
        _use_suite_profiles()
        _fix_seed(config)
        _interrupt_on_sigterm(config)
    report_json = config.getoption("--report-json", None)
    if report_json and (problem := _report_path_problem(report_json)):
        raise pytest.UsageError(f"--report-json {report_json}: cannot be written: {problem}")
    config.addinivalue_line("markers", "clause(*ids): the spec clauses (properties/SPEC.md) a test checks")
    for level in LEVELS:
        config.addinivalue_line("markers", f"{level}: a {level}-level clause (properties/{level}/); select with -m {level}")
    try:
        load_clauses()
    except SpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    kernels, api = [], config.getoption("--kernel-api")
    for spec in (config.getoption("--kernel") or list(KERNELS)) if api == "sdpa" else []:
        try:
            kernels.append(GuardedKernel(spec, resolve_kernel(spec)))
        except PluginError as exc:
            raise pytest.UsageError(f"--kernel: {exc}") from None
    config.stash[_KERNELS] = kernels
    try:
        config.stash[_FLASH] = kernel_params(config.getoption("--kernel"), api)
    except PluginError as exc:
        raise pytest.UsageError(f"--kernel (--kernel-api {api}): {exc}") from None
    set_window_right_below_lk(config.getoption("--window-right-below-lk"))
    config.stash[_DEVICES] = [_device_param(d) for d in config.getoption("--device") or _default_devices()]
    select_dtypes([DTYPES[name] for name in config.getoption("--dtype") or DTYPES])
    _records.clear()
    subjects.configure(config)  # loads --model / --zoo now: an unusable model is a UsageError
    reference.configure(config)  # after the model under test, which a reference factory may copy


def pytest_generate_tests(metafunc):
    if not in_suite(metafunc.definition):
        return
    # Session scope lets fixtures of any scope use them (Hypothesis rejects function-scoped fixtures).
    flash = metafunc.config.stash[_FLASH]
    if "kernel" in metafunc.fixturenames and "kernel" in flash:   # --kernel-api flash*: SDPA clauses skipped
        metafunc.parametrize("kernel", flash["kernel"], scope="session")
    elif "kernel" in metafunc.fixturenames:
        kernels = metafunc.config.stash[_KERNELS]
        metafunc.parametrize("kernel", kernels, ids=[k.name for k in kernels], scope="session")
    for fixture in set(flash) - {"kernel"}:
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, flash[fixture], scope="session")
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", metafunc.config.stash[_DEVICES], scope="session")
    if "mut" in metafunc.fixturenames:  # the model clauses: once per model under test (zoo families, --model, --zoo)
        metafunc.parametrize("mut", subjects.subject_ids(metafunc.config), indirect=True)


@pytest.fixture(scope="session")
def mut(request):
    """The model under test (properties.model.subjects.ModelUnderTest), built once per session."""
    return subjects.model_under_test(request.config, request.param)


@pytest.fixture(scope="session")
def causal_alignment(pytestconfig) -> str:
    return pytestconfig.getoption("--causal-alignment")


@pytest.fixture(scope="session")
def fully_masked(pytestconfig) -> str:
    return pytestconfig.getoption("--fully-masked")


def _clause_ids(item) -> list[str]:
    return [cid for mark in item.iter_markers("clause") for cid in mark.args]


def _levels_selected(config) -> set[str]:
    """--kernel alone checks kernels; --model alone checks the model (plus kernels if --kernel is also
    given); --zoo or --zoo-config checks the assembled model at every level; no plug-in option checks the zoo
    at every level."""
    kernel, model = config.getoption("--kernel", None), config.getoption("--model", None)
    kernel = kernel or config.getoption("--kernel-api", "sdpa") != "sdpa"   # a flash API is a kernel option
    if zoo_run(config) is not None or not (kernel or model):
        return {"kernel", "module", "model"}
    return ({"kernel"} if kernel else set()) | ({"model"} if model else set())


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if in_suite(item)]
    unbound = [item.nodeid for item in mine if not _clause_ids(item)]
    if unbound:
        raise pytest.UsageError(f"property tests must name their spec clause with @properties.clause(...): "
                                f"{', '.join(unbound[:5])}{' ...' if len(unbound) > 5 else ''}")
    levels = _levels_selected(config)
    deselected = [item for item in mine if level_of(item) not in levels]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in set(deselected)]


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item):
    level = level_of(item)
    if level is not None:  # before -m selects: `pytest properties/ -m kernel`
        item.add_marker(level)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread(request):
    """The suite's tensors are tiny: CPU intra-op threads only add synchronization, which costs 35x on a loaded
    2-core machine (measured: 355 ms vs 10 ms for one oracle bound of 2048 small problems). Restored after
    each module, and other test suites are left alone."""
    if not in_suite(request.node):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    ids = _clause_ids(item) if in_suite(item) else []
    report.level = level_of(item)
    report.clauses = ids  # survives pytest-xdist's report serialization (plain attribute)
    mut = getattr(item, "funcargs", {}).get("mut")
    report.resolution = mut.resolution if mut is not None and hasattr(mut, "resolution") else ""
    if report.failed and ids:
        clauses = load_clauses()
        report.sections.insert(0, (f"spec clause {', '.join(ids)}",
                                   "\n\n".join(clauses[i].describe() for i in ids)))
    return report


def _message(report) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]


def _counterexample(report) -> str:
    """Hypothesis' minimal failing input ("Falsifying example: test(case=..., ...)"), as one line."""
    text = str(report.longrepr)
    markers = ("Falsifying example:", "Failing explicit example:", "Failing test case:")  # Hypothesis' wordings
    starts = [i for i in (text.find(marker) for marker in markers) if i >= 0]
    if not starts:
        return ""
    parts = []
    for line in text[min(starts):].splitlines():
        line = line.removeprefix("E").strip()
        parts.append(line)
        if line == ")" or (len(parts) == 1 and line.endswith(")")):
            break
    return " ".join(" ".join(parts).replace("( ", "(").replace(", )", ")").split())


def pytest_runtest_logreport(report):
    ids = getattr(report, "clauses", None)
    if not ids:
        return
    record = _records.setdefault(report.nodeid, {"clauses": ids, "level": getattr(report, "level", None),
                                                "status": "passed", "duration_s": 0.0,
                                                "message": "", "counterexample": "",
                                                "resolution": getattr(report, "resolution", "")})
    record["duration_s"] += report.duration
    if report.failed:
        status = "failed" if report.when == "call" else "error"
        if record["status"] not in ("failed", "error"):
            record["status"], record["message"] = status, _message(report)
            record["counterexample"] = _counterexample(report)
    elif report.skipped and record["status"] == "passed":
        record["status"], record["message"] = "skipped", _message(report)


def pytest_sessionfinish(session):
    path = session.config.getoption("--report-json")
    if not path or hasattr(session.config, "workerinput"):  # pytest-xdist: only the controller writes
        return
    clauses = load_clauses()
    rows = [{"clause": cid, "title": clauses[cid].title, "level": r["level"], "status": r["status"], "nodeid": nodeid,
             "duration_s": round(r["duration_s"], 6), "message": r["message"],
             "counterexample": r["counterexample"], "resolution": r["resolution"]}
            for nodeid, r in _records.items() for cid in r["clauses"]]
    write_text(path, json.dumps(rows, indent=1))
