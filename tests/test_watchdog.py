"""The watchdog in-process (properties/core/watchdog.py): code under test that exits, skips its own clauses or hangs
in Python is a failure naming it, at the kernel, module and model levels; --call-timeout; bounded config files.

The process-level cases (os._exit, a segfault, a hang in C) need a process of their own: tests/test_watchdog_runs.py.
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from properties.core import watchdog
from properties.core.config_file import MAX_DEPTH, read_config
from properties.core.subject import Subject, watched
from properties.core.watchdog import CallTimeout, UserExit, user_call
from properties.kernel.guard import GuardedKernel, KernelContractError
from properties.module.parts import call_module, watch_module
from zoo.runtime.plugins import PluginError, load_object
from zoo.config.errors import ConfigError
from zoo.nn.norm import LayerNorm


@pytest.fixture(autouse=True)
def limit_of(request):
    """Run with a short per-call limit, and leave the process's watchdog as it was (pytest-xdist runs the spec
    suite in this same worker)."""
    state = watchdog.saved()
    watchdog.set_record(None)
    watchdog.set_limit(0.3, alarm=True)
    yield
    watchdog.restore(state)


class Custom(BaseException):
    pass


# What code under test may do instead of returning: (name, the function, the words the report must hold).
MISDEEDS = {
    "sys.exit(3)": (lambda: sys.exit(3), "SystemExit(3)"),
    "sys.exit()": (lambda: sys.exit(), "SystemExit(None)"),
    "raise GeneratorExit": (lambda: (_ for _ in ()).throw(GeneratorExit("gen")), "GeneratorExit"),
    "raise Custom(BaseException)": (lambda: (_ for _ in ()).throw(Custom("odd")), "Custom: odd"),
    "pytest.skip": (lambda: pytest.skip("not today"), "cannot skip its own clauses"),
    "pytest.xfail": (lambda: pytest.xfail("meh"), "cannot skip its own clauses"),
    "pytest.exit(returncode=0)": (lambda: pytest.exit("bye", returncode=0), "must not end the run"),
    "pytest.fail": (lambda: pytest.fail("no"), "Failed: no"),
}


def _spin():
    while True:
        pass


HANGS = {"time.sleep": lambda: time.sleep(10**6), "a Python busy loop": _spin,
         "a swallowed timeout": lambda: [_swallow() for _ in range(10**9)]}


def _swallow():
    try:
        time.sleep(10**6)
    except Exception:  # noqa: BLE001  the code under test's own handler must not hold the interrupt
        pass


# --------------------------------------------------------------------------------- the three levels, fuzzed
def _as_kernel(misdeed):
    def kernel(q, k, v, **kwargs):
        misdeed()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    guarded = GuardedKernel("bad.py:attention", kernel)
    q = torch.zeros(1, 1, 2, 4)
    return lambda: guarded(q, q, q)


def _as_model(misdeed):
    def forward(tokens, mask):
        misdeed()
        return torch.zeros(*tokens.shape, 8)
    subject = watched(Subject(kind="decoder_only", forward=forward, vocab_size=8, max_len=8), "model bad.py:model")
    tokens = torch.ones(1, 3, dtype=torch.long)
    return lambda: subject.forward(tokens, None)


class _Norm(LayerNorm):
    misdeed = None

    def forward(self, x):
        type(self).misdeed()
        return super().forward(x)


def _as_module(misdeed, through_call_module: bool):
    norm = type("BadNorm", (_Norm,), {"misdeed": staticmethod(misdeed)})
    module = watch_module(norm(4), "module norm=config (bad.BadNorm)")
    x = torch.zeros(2, 4)
    if through_call_module:
        return lambda: call_module(module, x, expect=(2, 4), like=x, what="norm")
    return lambda: module(x)


LEVELS = {"kernel": _as_kernel, "model": _as_model, "module": lambda m: _as_module(m, True),
          "module called directly": lambda m: _as_module(m, False)}


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(level=st.sampled_from(sorted(LEVELS)), misdeed=st.sampled_from(sorted(MISDEEDS)))
def test_a_base_exception_of_the_code_under_test_is_a_failure_naming_it(level, misdeed):
    function, words = MISDEEDS[misdeed]
    call = LEVELS[level](function)
    with pytest.raises(Exception) as caught:   # an Exception: Hypothesis shrinks it, pytest reports the clause
        call()
    text = str(caught.value)
    assert words in text, text
    assert ("bad.py" in text or "BadNorm" in text or "norm(" in text), text
    if isinstance(caught.value, UserExit):
        assert caught.value.plugin.split()[0] in ("kernel", "model", "module"), text


def test_keyboard_interrupt_still_stops_the_run():
    for make in LEVELS.values():
        with pytest.raises(KeyboardInterrupt):
            make(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(level=st.sampled_from(sorted(LEVELS)), hang=st.sampled_from(sorted(HANGS)))
def test_a_call_past_the_limit_fails_once_and_is_not_retried(level, hang):
    watchdog.set_limit(0.3, alarm=True)   # each example starts afresh
    call = LEVELS[level](HANGS[hang])
    start = time.monotonic()
    with pytest.raises(CallTimeout, match=r"did not return within 0\.3 s \(--call-timeout\) in "):
        call()
    with pytest.raises(CallTimeout, match="is not called again: it did not return within 0.3 s"):
        call()
    assert time.monotonic() - start < 5


def _catch_everything():
    try:
        time.sleep(10**6)
    except BaseException:  # noqa: BLE001  as the zoo's size check does around a user's constructor
        pass


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_code_that_catches_the_interrupt_is_interrupted_again_and_still_fails(level):
    """A BaseException handler that holds CallTimeout and goes on (here: into a second hang) is interrupted again a
    second later, and the call fails when it returns: neither a hang until the supervisor kills it, nor a pass."""
    watchdog.set_limit(0.3, alarm=True)
    call = LEVELS[level](lambda: [_catch_everything() for _ in range(2)])
    start = time.monotonic()
    with pytest.raises(CallTimeout, match=r"did not return within 0\.3 s \(--call-timeout\) in .*was caught inside the call"):
        call()
    assert time.monotonic() - start < 5 and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_correct_call_is_untouched_and_the_timer_is_off_after_it():
    kernel = GuardedKernel("torch", torch.nn.functional.scaled_dot_product_attention)
    q = torch.randn(1, 2, 3, 4)
    for _ in range(3):
        out = kernel(q, q, q)
    assert out.shape == q.shape
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    time.sleep(0.5)   # longer than the limit, outside any call: nothing fires


def test_nested_calls_are_timed_once_by_the_outermost():
    with user_call("model outer", "forward"):
        with user_call("kernel inner", "kernel(...)"):
            pass
        assert watchdog._Watch.active[0] == "model outer"
    assert watchdog._Watch.active is None


def test_a_watched_module_stays_bound_to_its_copy():
    module = watch_module(LayerNorm(4), "module norm=layernorm (zoo.nn.norm.LayerNorm)")
    twin = copy.deepcopy(module).to(torch.float64)
    with torch.no_grad():
        twin.bias.add_(1)
    x = torch.arange(4, dtype=torch.float64)[None]
    assert twin.forward.__self__ is twin
    assert not torch.equal(twin(x), module.to(torch.float64)(x))


def test_an_import_that_calls_sys_exit_is_a_plugin_error(tmp_path):
    for body, words in [("import sys\nsys.exit(7)\n", "it called sys.exit(7) while imported"),
                        ("raise GeneratorExit\n", "GeneratorExit"),
                        ("class B(BaseException):\n    pass\nraise B('boom')\n", "B: boom")]:
        path = tmp_path / f"plugin_{len(words)}.py"
        path.write_text(body)
        with pytest.raises(PluginError, match="cannot import") as caught:
            load_object(f"{path}:f")
        assert words in str(caught.value) and "\n" not in str(caught.value)
    path = tmp_path / "interrupted.py"
    path.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_object(f"{path}:f")


# ------------------------------------------------------------------------------------------- --call-timeout
class _Options:
    def __init__(self, value):
        self.value = value

    def getoption(self, name, default=None):
        return self.value if name == "call_timeout" else default


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "1e7", "", "1s"])
def test_a_bad_call_timeout_is_one_line(value):
    from properties.plugin.watchdog import _timeout
    with pytest.raises(pytest.UsageError) as caught:
        _timeout(_Options(value))
    assert str(caught.value).startswith(f"--call-timeout {value!r}: expected a number of seconds") and \
        "\n" not in str(caught.value)


@pytest.mark.parametrize("value,seconds", [(None, watchdog.DEFAULT_TIMEOUT), ("0", 0.0), ("2.5", 2.5)])
def test_call_timeout_values(value, seconds):
    from properties.plugin.watchdog import _timeout
    assert _timeout(_Options(value)) == seconds


# ------------------------------------------------------------------------------------------- config files
def _refused(tmp_path, name: str, data: bytes | str, words: str):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(ConfigError) as caught:
        read_config(path)
    assert words in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_config_files_outside_the_bounds_are_refused_in_one_line(tmp_path):
    laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))
    _refused(tmp_path, "laughs.yaml", laughs, "once its aliases are expanded")
    _refused(tmp_path, "loop.yaml", "a: &a [1, *a]\n", "contains itself")
    _refused(tmp_path, "deep.yaml", "a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n", "nested more than")
    _refused(tmp_path, "deeper.yaml", "a: " + "[" * 100_000 + "\n", "nested more than")
    _refused(tmp_path, "big.yaml", "a: 1\n" + "#" * (2 << 20), "bytes; a config file has at most")
    _refused(tmp_path, "latin1.yaml", b"name: caf\xe9\n", "not UTF-8")
    _refused(tmp_path, "list.yaml", "- 1\n- 2\n", "not a mapping")
    _refused(tmp_path, "bad.yaml", "d_model: [unclosed\n", "not a YAML config")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_config(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):   # and the open did not block
        read_config(fifo)
    with pytest.raises(ConfigError, match="no such file"):
        read_config(tmp_path / "absent.yaml")


def test_a_config_within_the_bounds_reads_as_omegaconf_reads_it(tmp_path):
    from omegaconf import OmegaConf
    path = tmp_path / "config.yaml"
    path.write_text("d_model: 64\nattention:\n  _target_: zoo.nn.attention.MultiHeadAttention\n  d_model: ${d_model}\n"
                    "  window: [-1, 0]\nbase: &base {eps: 1.0e-05}\nnorm:\n  <<: *base\n  bias: true\n")
    assert read_config(path) == OmegaConf.load(path)
    assert read_config(path).attention.d_model == 64 and read_config(path).norm.eps == 1e-5


# ------------------------------------------------------------------------------------------- --report-json
def test_a_report_path_that_cannot_take_the_report_is_refused(tmp_path):
    from properties.plugin.report import _report_path_problem
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "file").write_text("")
    for path, words in [("", "empty"), (str(fifo), "not a regular file"), (str(tmp_path), "is a directory"),
                        (str(tmp_path / "file" / "r.json"), "is not a directory"),
                        (str(tmp_path / ("n" * 300)), "too long"), (str(tmp_path / ("d" * 300) / "r.json"), "too long")]:
        problem = _report_path_problem(path)
        assert problem is not None and words in problem, (path[:80], problem)
    assert _report_path_problem(str(tmp_path / "new" / "report.json")) is None
    assert _report_path_problem(str(tmp_path / "report.json")) is None and sorted(os.listdir(tmp_path)) == ["fifo", "file"]


# ------------------------------------------------------------------------------------------- --zoo size check
class _ZooOptions:
    def __init__(self, zoo: str):
        self.zoo, self.stash = zoo, {}

    def getoption(self, name, default=None):
        return {"zoo": self.zoo, "zoo_config": None, "--device": ["cpu"]}.get(name, default)


class _Built(BaseException):
    pass


def _size_check_builds_the_model(monkeypatch) -> bool:
    """Whether zoo.config.sizing.check_fits still builds the model (on the meta device) to decide."""
    from zoo.config import builder
    from zoo.config.composition import compose_config
    from zoo.config.sizing import check_fits

    def refuse(*args, **kwargs):
        raise _Built()
    cfg = compose_config(["task=summary"])
    with monkeypatch.context() as patch:
        patch.setattr(builder, "model_from_config", refuse)
        try:
            check_fits(cfg)
        except _Built:
            return True
    return False


@pytest.mark.parametrize("override", ["layers=1000000000", "d_model=1099511627776"])
def test_a_zoo_model_that_cannot_fit_is_one_line_before_anything_is_built(override, monkeypatch):
    from properties.core.zoo_config import zoo_run
    if _size_check_builds_the_model(monkeypatch):
        pytest.skip("zoo.config.sizing.check_fits still builds the model to size it (the robust-cli branch decides "
                    "from the config)")
    watchdog.set_limit(60, alarm=True)
    start = time.monotonic()
    with pytest.raises(pytest.UsageError) as caught:
        zoo_run(_ZooOptions(override))
    message = str(caught.value)   # the size check's "does not fit in memory", or a refusal of the value itself
    assert message.startswith("--zoo") and override.split("=")[1] in message and "\n" not in message, message
    assert time.monotonic() - start < 10


def test_the_zoo_size_check_runs_before_the_suite_builds_a_zoo_model():
    from properties.core.zoo_config import zoo_run
    watchdog.set_limit(60, alarm=True)   # composing and sizing take a second on a loaded machine
    with pytest.raises(pytest.UsageError) as caught:   # 2^20 wide: terabytes of weights, sized on the meta device
        zoo_run(_ZooOptions("d_model=1048576"))
    message = str(caught.value)
    assert message.startswith("--zoo d_model=1048576: the model does not fit in memory") and "\n" not in message


def test_only_a_zoo_plug_ins_own_code_spends_its_call_timeout(tmp_path, monkeypatch):
    """The bounded call "importing the parts it names (validating it)" holds the plug-in's import alone: Hydra's
    composition is the suite's own work, and on a loaded machine it once spent a test's whole 10 s before the
    plug-in ran (tests/test_watchdog_runs.py, 'hang in C' at call, load ~7)."""
    import hydra
    from properties.core.zoo_config import zoo_run
    (tmp_path / "plug_timed.py").write_text("from properties.core import watchdog\nfrom zoo.nn.norm import LayerNorm\n"
                                            "BOUND = watchdog._Watch.active\n\n\nclass Norm(LayerNorm):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    composing = hydra.compose
    bound_while_composing = []

    def spy(*args, **kwargs):
        bound_while_composing.append(watchdog._Watch.active)
        return composing(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", spy)
    run = zoo_run(_ZooOptions("norm._target_=plug_timed.Norm"))
    import plug_timed
    assert run.cfg.norm._target_ == "plug_timed.Norm"
    assert bound_while_composing and not any(bound_while_composing)
    assert plug_timed.BOUND is not None and plug_timed.BOUND[0] == "model built by --zoo norm._target_=plug_timed.Norm"
