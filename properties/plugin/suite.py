"""The spec suite's hooks and fixtures: kernel and device parametrization, level selection, the check that every
clause test names its clauses, the per-test kernel limits and coverage. The entry point (properties/plugin/__init__.py) imports this module only
in a run that collects the suite or gives one of its options, and calls ``configure`` at configuration: it registers
this module, the session's, the report's and the references' as plug-ins of the run, starts the watchdog and loads
what the options name (kernels, models, references), so that anything unusable is a one-line usage error before
any test runs.
"""
from __future__ import annotations

import sys

import pytest
import torch

from properties.kernel import coverage, limits
from properties.core import declines
from properties.core.watchdog import CallTimeout, last_call, user_call
from properties.plugin import DEFAULTS, SUITE_PLUGIN, targets_suite
from properties.plugin import contracts
from properties.core.levels import in_suite, level_of
from properties.core.options import DTYPE_NAMES, LIMIT_OPTIONS
from properties.core.zoo_config import zoo_run
from properties.model import subjects  # --model / --zoo: which models the model clauses run on
from properties.plugin import reference  # --reference / --reference-kernel: what the differential clauses compare with
from properties.kernel.guard import GuardedKernel, lse_pair_problem
from properties.core.spec import SpecError, load_clauses
from properties.core.dtypes import device_unavailable, select_dtypes
from properties.kernel.flash import set_window_right_below_lk
from properties.kernel.flash_guard import kernel_params
from properties.kernel.merge_guard import merge_params
from properties.plugin import report, session
from properties.plugin import distributed  # --world-size: the ranks, the context-parallel kernels
from properties.plugin import watchdog as plugin_watchdog  # --call-timeout: the supervisor of code that exits, crashes, hangs
from zoo.nn.kernel import KERNELS, resolve_kernel
from zoo.runtime.plugins import PluginError

__all__ = ["configure"]

_KERNELS = pytest.StashKey[list]()
_FLASH = pytest.StashKey[dict]()   # --kernel-api: fixture -> params (flash_guard's kernel_params, merge_guard's)
_DEVICES = pytest.StashKey[list]()


def _default_devices() -> list[str]:
    if torch.cuda.is_available():
        return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", "cuda"]  # the cuda entry is skipped with its reason, so the report says why


def _device_param(name: str, *, asked: bool):
    """A device the clauses are parametrized with. One the command line asks for (``asked``) and this machine lacks
    is refused now in one line, as ``python -m zoo device=...`` refuses it; a default one (a bare 'cuda' where there
    is none) is kept, its clauses skipped with the reason, so that the report says why nothing ran there."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise pytest.UsageError(f"--device {name!r}: {exc}") from None
    reason = device_unavailable(device)
    if reason and asked:
        raise pytest.UsageError(f"--device {name}: {reason}; nothing would be verified (omit --device to check every "
                                f"device this machine has)")
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return pytest.param(name, marks=marks, id=name)


# The plug-ins this module registers (their hooks and fixtures), by the names pytest lists them under.
_PLUGINS = {"properties.plugin.session": session, "properties.plugin.report": report,
            "properties.plugin.reference": reference, "properties.plugin.distributed": distributed}


def configure(config) -> None:
    """Register the suite's plug-ins, start the watchdog, then load what the options name (the entry point calls it
    first among the configure hooks: before Hypothesis' plug-in reads --hypothesis-profile)."""
    manager = config.pluginmanager
    for name, module in {**_PLUGINS, SUITE_PLUGIN: sys.modules[__name__]}.items():
        if not manager.has_plugin(name):
            manager.register(module, name)
    plugin_watchdog.configure(config, targets_suite(config))   # first: it may fork before any plug-in is imported
    try:
        _configure(config)
    except CallTimeout as exc:   # importing a plug-in, its factory or building the model hung: one line
        raise pytest.UsageError(str(exc)) from None
    except KeyboardInterrupt as exc:   # pytest says nothing when interrupted before the session: say what stopped
        sys.stderr.write(f"ERROR: interrupted ({str(exc) or type(exc).__name__}) while loading the code under test"
                         f"{last_call()}\n")
        raise


def _loading(spec: str) -> str:
    return f"importing {spec.rpartition(':')[0]!r}" if ":" in spec else f"loading {spec!r}"


# Options that shape the kernel clauses only: given where no kernel clause runs, they would be accepted and ignored.
_KERNEL_ONLY = ("--causal-alignment", "--fully-masked", "--finfo-min-rows", "--window-right-below-lk",
                "--reference-kernel", "--returns-lse", "--lse-base", *LIMIT_OPTIONS)
# The zoo's kernel that returns its LSE: what --returns-lse checks without --kernel.
LSE_KERNEL = "zoo.nn.partial:attention_with_lse"


def _kernels_named(config) -> bool:
    """Whether the run names the kernels under test: --kernel, a kernel API other than SDPA's (the zoo's kernels of
    that API), or --returns-lse (the zoo's kernel that returns its LSE)."""
    return bool(config.getoption("--kernel", None) or config.getoption("--kernel-api", "sdpa") != "sdpa"
                or config.getoption("--returns-lse", False))


def _kernel_clauses_run(config) -> bool:
    """Whether the kernel level is selected (``_levels_selected``), read from the options alone: before --zoo is
    parsed, which may be refused."""
    if config.getoption("--world-size", None) is not None:   # the distributed level alone
        return False
    kernel = _kernels_named(config)
    whole = config.getoption("zoo", None) or config.getoption("zoo_config", None)   # every level
    return bool(kernel or whole or not config.getoption("--model", None))


def _refuse_kernel_options_without_kernels(config) -> None:
    """A kernel option where no kernel clause runs (--model alone) is a UsageError, not an option ignored."""
    if _kernel_clauses_run(config):
        return
    given = [name for name in _KERNEL_ONLY if config.getoption(name, DEFAULTS[name]) not in (DEFAULTS[name], False)]
    if given and config.getoption("--world-size", None) is not None:
        raise pytest.UsageError(f"{', '.join(given)}: {'a kernel option' if len(given) == 1 else 'kernel options'} of "
                                f"the SDPA clauses, which --world-size does not run (a context-parallel kernel is "
                                f"checked by the distributed clauses); leave {'it' if len(given) == 1 else 'them'} out")
    if given:
        raise pytest.UsageError(f"{', '.join(given)}: {'a kernel option' if len(given) == 1 else 'kernel options'}, "
                                f"but no kernel clause runs (--model alone checks the model clauses); add --kernel "
                                f"SPEC to check a kernel, or leave {'it' if len(given) == 1 else 'them'} out")


def _lse_options(config, api: str) -> bool:
    """--returns-lse (an SDPA-signature kernel returns (output, lse)) and --lse-base: whether the kernels return their
    LSE; a UsageError where an option would be accepted and ignored."""
    returns_lse = bool(config.getoption("--returns-lse", False))
    if returns_lse and api != "sdpa":
        raise pytest.UsageError(f"--returns-lse declares that an SDPA-signature kernel returns (output, lse); "
                                f"--kernel-api {api} has its own calling convention: leave one of them out")
    if config.getoption("--lse-base", "e") != "e" and not returns_lse and api != "merge":
        raise pytest.UsageError("--lse-base: the base of the LSE a kernel returns (--returns-lse) or a merge kernel "
                                "takes (--kernel-api merge); neither is given")
    return returns_lse


def _configure(config):
    _refuse_kernel_options_without_kernels(config)
    session.configure(config)
    report.configure_report(config)
    report.configure_reproducers(config)
    try:
        load_clauses()
    except SpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    kernels, api = [], config.getoption("--kernel-api")
    select_dtypes([getattr(torch, name) for name in config.getoption("--dtype") or DTYPE_NAMES])
    try:
        declared = limits.declared_limits({name: config.getoption(name) for name in LIMIT_OPTIONS},
                                          [getattr(torch, name) for name in config.getoption("--dtype") or ()], api)
    except limits.LimitsError as exc:
        raise pytest.UsageError(str(exc)) from None
    returns_lse = _lse_options(config, api)
    sdpa_kernels = api == "sdpa" and config.getoption("--world-size", None) is None
    default = [LSE_KERNEL] if returns_lse else list(KERNELS)
    for spec in (config.getoption("--kernel") or default) if sdpa_kernels else []:
        try:
            with user_call(f"kernel {spec}", _loading(spec)):   # the watchdog: import-time exits and hangs
                kernels.append(GuardedKernel(spec, resolve_kernel(spec), declared, returns_lse=returns_lse))
        except PluginError as exc:
            raise pytest.UsageError(f"--kernel: {exc}") from None
    config.stash[_KERNELS] = kernels
    try:
        specs = config.getoption("--kernel") or []
        named = " ".join(specs) or f"(the zoo's {api} kernels)"
        with user_call(f"kernel {named}", f"loading it (--kernel-api {api})"):
            config.stash[_FLASH] = {**kernel_params(config.getoption("--kernel"), api),
                                    **merge_params(config.getoption("--kernel"), api)}
    except PluginError as exc:
        raise pytest.UsageError(f"--kernel (--kernel-api {api}): {exc}") from None
    set_window_right_below_lk(config.getoption("--window-right-below-lk"))
    asked = config.getoption("--device")
    config.stash[_DEVICES] = [_device_param(d, asked=bool(asked)) for d in asked or _default_devices()]
    # Every kernel's limits now, before any test draws (properties/kernel/limits.py): limits learned in the middle of
    # a test would change what its strategy draws between Hypothesis' runs of one example (FlakyStrategyDefinition).
    # No probe where no kernel clause runs: --model alone, or only other levels' folders collected
    # (pytest properties/model --zoo ...).
    probed = kernels if _kernel_clauses_run(config) and targets_suite(config, "kernel") else []
    for kernel in probed:
        for device in [p.values[0] for p in config.stash[_DEVICES] if not p.marks]:
            try:
                kernel.learn(device)
            except limits.LimitsError as exc:
                raise pytest.UsageError(f"--kernel {kernel.name} {exc} (on {device}; declare its limits with "
                                        f"--dtype, --kernel-head-size, --kernel-no-mask, --kernel-equal-lengths, "
                                        f"--kernel-equal-head-sizes)") from None
            problem = lse_pair_problem(kernel, device) if kernel.returns_lse else ""
            if problem:
                said = problem.split(" in kernel(")[0].rstrip(",")   # (the call is the plainest problem)
                raise pytest.UsageError(f"--kernel {kernel.name} --returns-lse: {said} (on {device}, the plainest "
                                        f"problem)")
    subjects.configure(config)  # loads --model / --zoo now: an unusable model is a UsageError
    reference.configure(config)  # after the model under test, which a reference factory may copy
    distributed.configure(config)  # --world-size: the ranks start once, here, after the watchdog's fork


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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report.write_coverage(terminalreporter)
    report.write_model_basis(terminalreporter)
    report.write_reproducers(terminalreporter)
    session.write_seed(terminalreporter, config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Around each kernel-level test: the draws steer into the kernel's limits on its device, and the examples
    run and declined are counted (properties/kernel/coverage.py); around each module- and model-level one, the examples its
    subject declines (properties/core/declines.py)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    kernel = next((v for k, v in params.items() if k.endswith("kernel") and hasattr(v, "name")), None)
    if level_of(item) in ("module", "model"):
        where = f" ({item.callspec.id})" if hasattr(item, "callspec") else ""
        with declines.counting(item, f"the {level_of(item)} under test{where}"):
            return (yield)
    if level_of(item) not in ("kernel", "distributed") or kernel is None:
        return (yield)
    device = params.get("device", "cpu")
    limits.set_active((lambda: kernel.limits(device)) if isinstance(kernel, GuardedKernel) else None, device)
    try:
        with coverage.counting(item, kernel.name, device):
            return (yield)
    finally:
        limits.set_active(None)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A fixture that calls the code under test (building the model, its float64 twin) and meets --call-timeout fails
    as pytest's own failure, cached for the tests that share the fixture. CallTimeout is a BaseException, so that the
    code under test cannot catch it; pytest caches only its own outcomes and Exceptions, and a fixture left uncached
    with its finalizer registered breaks every later test that requests it (``assert not self._finalizers``)."""
    try:
        return (yield)
    except CallTimeout as exc:
        failure = pytest.fail.Exception(str(exc), pytrace=False)
        failure.__cause__ = exc
        fixturedef.cached_result = (None, fixturedef.cache_key(request), (failure, exc.__traceback__))
        raise failure from exc


@pytest.fixture(scope="session")
def mut(request):
    """The model under test (properties.model.subjects.ModelUnderTest), built once per session."""
    return subjects.model_under_test(request.config, request.param)


def _option_fixture(option: str, doc: str):
    """A session fixture named after ``option`` (--causal-alignment: causal_alignment) whose value is the option's."""
    def value(pytestconfig) -> str:
        return pytestconfig.getoption(option)
    value.__doc__ = f"{option}: {doc}"
    return pytest.fixture(scope="session", name=option.removeprefix("--").replace("-", "_"))(value)


# The kernel's declared conventions (properties/plugin/__init__.py: OPTIONS), as the clauses that read them take them.
causal_alignment = _option_fixture("--causal-alignment", "the is_causal diagonal for L != S, top-left or bottom-right")
fully_masked = _option_fixture("--fully-masked", "the output required for a query with no admissible key")
finfo_min_rows = _option_fixture("--finfo-min-rows",
                                 "how a float-mask row of scores all below -finfo(float32).max/log2(e) is read")
lse_base = _option_fixture("--lse-base", '"e" or "2", the base of the LSEs kernels return and merges take')


def _levels_selected(config) -> set[str]:
    """--kernel alone checks kernels; --model alone checks the model (plus kernels if --kernel is also
    given); --zoo or --zoo-config checks the assembled model at every level; no plug-in option checks the zoo
    at every level."""
    if config.getoption("--world-size", None) is not None:
        return {"distributed"}
    kernel, model = _kernels_named(config), config.getoption("--model", None)
    if zoo_run(config) is not None or not (kernel or model):
        return {"kernel", "module", "model", "distributed"}
    return ({"kernel"} if kernel else set()) | ({"model"} if model else set())


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if in_suite(item)]
    unbound = [item.nodeid for item in mine if not report.clause_ids(item)]
    if unbound:
        raise pytest.UsageError(f"property tests must name their spec clause with @properties.clause(...): "
                                f"{', '.join(unbound[:5])}{' ...' if len(unbound) > 5 else ''}")
    for item in mine:   # a kernel that accepts no problem on a device: its clauses there are skipped, with its reason
        params = getattr(getattr(item, "callspec", None), "params", {})
        kernel, device = params.get("kernel"), params.get("device")
        if isinstance(kernel, GuardedKernel) and device is not None and kernel.limits(device).unusable:
            item.add_marker(pytest.mark.skip(reason=f"kernel {kernel.name} declines every problem on {device} "
                                                    f"(not covered): {kernel.limits(device).unusable}"))
    contracts.skip_undeclared(config, mine, report.clause_ids)   # --deterministic, --batch-invariant
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
