"""The suite's plug-in costs nothing until asked. pytest loads it (entry point ``properties.plugin``) in every run of an
environment where the package is installed: an unrelated run must import nothing of torch, Hydra, the zoo or the
suite, only the entry point and the option lists it registers. A suite option, or collecting the suite, loads the
suite. Not a timed test: what an unrelated run imports is the guard; its CPU time is measured by
``python -m bench.suite --plugin-cost`` (bench/results.json "plugin_cost", docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from properties.plugin import targets_suite

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "properties"
# What the plug-in may add to an unrelated run: the entry point and the torch-free modules it reads.
LIGHT = {"properties", "properties.plugin", "properties.core", "properties.core.levels", "properties.core.options"}
HEAVY = ("torch", "hydra", "omegaconf", "einops", "numpy", "safetensors", "zoo")
DUMP = '''import json, os, sys


def pytest_sessionfinish(session):
    with open(os.environ["MODULES_JSON"], "w") as f:
        json.dump(sorted(sys.modules), f)
'''


def _run(tmp_path: Path, cwd: Path, *args: str, name: str = "modules") -> tuple[subprocess.CompletedProcess, set[str]]:
    """pytest in a child, from ``cwd``, with a plug-in of its own that writes the names in sys.modules at the end."""
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "dump_modules.py").write_text(DUMP)
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "PROPERTIES_")) and k not in ("PYTHONPATH", "COV_CORE_SOURCE")}
    env.update(PYTHONPATH=str(plugins), MODULES_JSON=str(out))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "dump_modules", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    return done, set(json.loads(out.read_text())) if out.exists() else set()


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.fixture
def unrelated(tmp_path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_x.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    return project


def test_an_unrelated_run_imports_only_the_entry_point(tmp_path, unrelated):
    done, loaded = _run(tmp_path, unrelated, "-q", "test_x.py", name="with")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
    assert "properties.plugin" in loaded, "the plug-in was not loaded: pip install -e ."
    bare, without = _run(tmp_path, unrelated, "-q", "-p", "no:properties.plugin", "test_x.py", name="without")
    assert bare.returncode == 0 and "properties.plugin" not in without, bare.stdout + bare.stderr
    added = loaded - without   # other plug-ins of the environment (Hydra's, say) import what they import either way
    assert not _heavy(added), f"the plug-in imported {_heavy(added)[:10]} in an unrelated run"
    assert added <= LIGHT, f"the plug-in imports more than its entry point in an unrelated run: {sorted(added - LIGHT)}"


@pytest.mark.parametrize("option", [["--deterministic"], ["--kernel", "math"], ["--causal-alignment", "bottom-right"],
                                    ["--model", "properties.catalog.decode_bugs:tiny_lm"]])
def test_a_suite_option_loads_the_suite(tmp_path, unrelated, option):
    done, loaded = _run(tmp_path, unrelated, "-q", "test_x.py", *option)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
    assert {"properties.plugin.suite", "torch"} <= loaded


def test_collecting_the_suite_by_module_name_loads_it(tmp_path, unrelated):
    done, loaded = _run(tmp_path, unrelated, "--pyargs", "properties.kernel.test_causal", "--co", "-q")
    assert done.returncode == 0 and "tests collected" in done.stdout, done.stdout + done.stderr
    assert "properties.plugin.suite" in loaded
    assert "test_causal_diagonal_alignment[math-cpu]" in done.stdout   # the suite's kernels and devices


def test_a_clause_module_reached_without_the_suite_is_a_usage_error(tmp_path, unrelated):
    """pytest collects a clause module that the command line did not name (here through a link): its tests would run
    without the suite's kernels, profiles and watchdog, so the run stops, saying how to name the suite."""
    (unrelated / "test_linked.py").symlink_to(SUITE / "kernel" / "test_softmax.py")
    done, loaded = _run(tmp_path, unrelated, "-q")
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR:")]
    assert done.returncode == pytest.ExitCode.USAGE_ERROR and len(errors) == 1, done.stdout + done.stderr
    assert "test_linked.py: clause modules of the spec suite" in errors[0] and "--pyargs properties" in errors[0]
    assert "properties.plugin.suite" not in loaded


class _Config:
    def __init__(self, args, invocation_dir, pyargs=False):
        self.args, self.option_pyargs = [str(a) for a in args], pyargs
        self.invocation_params = type("Invocation", (), {"dir": Path(invocation_dir)})()

    def getoption(self, name, default=None):
        return self.option_pyargs if name == "pyargs" else default


@pytest.mark.parametrize("args,cwd,pyargs,expected", [
    ([SUITE], "/", False, True),                                   # the suite
    (["properties/kernel/test_causal.py::test_x"], ROOT, False, True),   # a path inside it, relative
    ([ROOT], "/", False, True),                                    # a path that holds it
    ([ROOT.parent], "/", False, True),                             # from further above: pytest collects it too
    ([ROOT / "tests"], "/", False, False),                         # beside it
    (["properties"], "/", True, True),                             # --pyargs properties
    (["properties.kernel.test_causal"], "/", True, True),          # --pyargs a clause module
    (["properties"], "/", False, False),                           # a relative path that is not there
    (["propertiesx"], "/", True, False),
])
def test_which_runs_target_the_suite(args, cwd, pyargs, expected):
    assert targets_suite(_Config(args, cwd, pyargs)) is expected


def test_a_part_of_the_suite_is_targeted_by_its_folder():
    assert targets_suite(_Config([SUITE / "kernel"], "/"), "kernel")
    assert not targets_suite(_Config([SUITE / "model"], "/"), "kernel")
    assert targets_suite(_Config([SUITE], "/"), "kernel")
    assert targets_suite(_Config(["properties.kernel.test_causal"], "/", pyargs=True), "kernel")
    assert not targets_suite(_Config(["properties.model"], "/", pyargs=True), "kernel")
