"""The installed package works without the source tree: the built wheel carries the config tree (`python -m zoo`
from any directory) and the spec suite is a pytest plugin of the package (entry point `pytest11`), so
`pytest --pyargs properties --kernel ...` and `python -m properties ...` work from anywhere."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "properties.plugin"
ONE_KERNEL_TEST = ["--kernel", "torch", "-q", "-p", "no:cacheprovider", "-k", "convex_combinations"]


def run(command: list[str], cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=300)


def test_every_package_of_the_tree_is_in_the_wheel():
    """pyproject lists the packages the wheel carries: a package folder left out of the list is missing from every
    install but the editable one (zoo/cli/ and zoo/runtime/ once were)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for top in ("zoo", "properties")
             for init in (ROOT / top).rglob("__init__.py")}
    assert not found - listed, f"packages pyproject.toml does not list: {sorted(found - listed)}"


def test_pytest_plugin_entry_point_is_declared_and_loadable():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    # The name must be the module's name: pytest then skips `pytest_plugins = ["properties.plugin"]` (conftest.py)
    # and `-p properties.plugin` as already loaded, instead of registering the module twice.
    assert declared == {PLUGIN: PLUGIN}
    module = importlib.metadata.EntryPoint(PLUGIN, declared[PLUGIN], "pytest11").load()
    assert module is importlib.import_module(PLUGIN)
    assert all(callable(getattr(module, hook, None)) for hook in ("pytest_addoption", "pytest_configure"))
    # What pytest reads: the metadata of the installed distribution (it iterates every one, as here).
    installed = [(ep.name, ep.value) for dist in importlib.metadata.distributions()
                 if (dist.metadata["Name"] or "").lower() == "transformer-zoo"
                 for ep in dist.entry_points if ep.group == "pytest11"]
    assert (PLUGIN, PLUGIN) in installed, f"installed metadata lacks the entry point ({installed}): pip install -e ."


def test_plugin_is_registered_once_in_the_checkout():
    # Three routes name the plugin here: the entry point, conftest.py's pytest_plugins and -p.
    result = run([sys.executable, "-m", "pytest", "-p", PLUGIN, "properties/kernel/test_kernel.py", *ONE_KERNEL_TEST],
                 cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "already registered" not in result.stdout + result.stderr


def test_unrelated_suite_is_left_alone(tmp_path):
    # Another project's tests in an environment where the zoo is installed: the plugin is loaded (its options
    # parse) but parametrizes, deselects and marks nothing of theirs, even a test using a fixture named `kernel`.
    (tmp_path / "conftest.py").write_text("import pytest\n\n\n@pytest.fixture\ndef kernel():\n    return 'theirs'\n")
    (tmp_path / "test_theirs.py").write_text("def test_plain():\n    assert 1 + 1 == 2\n\n\n"
                                             "def test_own_kernel(kernel):\n    assert kernel == 'theirs'\n")
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kernel", "torch"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout and "deselected" not in result.stdout, result.stdout


def _build_isolation() -> list[str]:
    """Build with this environment's setuptools where it can build the project (70.1 and later write wheels
    without the ``wheel`` package): an isolated build downloads setuptools on every run, some 30 s of waiting for
    what this test does not check."""
    try:
        version = tuple(int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if version >= (70, 1) else []


def test_wheel_runs_from_a_temporary_directory(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *_build_isolation(),
                    "-w", str(wheels), str(ROOT)], check=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (entry_points,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert f"[pytest11]\n{PLUGIN} = {PLUGIN}" in archive.read(entry_points).decode()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    # Only the installed copy may be importable: the dependencies stay where they are, but the
    # editable finder of the development install is bypassed by putting the target first and
    # checking where zoo was imported from.
    env = {**os.environ, "PYTHONPATH": str(target)}
    check = subprocess.run([sys.executable, "-c", "import zoo, zoo.conf; print(zoo.__file__, zoo.conf.__path__[0])"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
    assert str(target) in check.stdout, check.stdout
    result = run([sys.executable, "-m", "zoo", "preset=gpt2_small", "task=summary"], cwd=elsewhere, env=env)
    assert result.returncode == 0, result.stderr
    assert "124,439,808" in result.stdout
    # The spec suite of the installed copy, found by the entry point, from a directory without a conftest.py.
    for command in ([sys.executable, "-m", "pytest", "--pyargs", "properties"], [sys.executable, "-m", "properties"]):
        suite = run([*command, *ONE_KERNEL_TEST], cwd=elsewhere, env=env)
        assert suite.returncode == 0 and "1 passed" in suite.stdout, suite.stdout + suite.stderr
        assert "already registered" not in suite.stdout + suite.stderr


def test_the_plain_install_sandbox_hides_the_extras_and_keeps_what_the_zoo_needs(tmp_path):
    """tests/plain_install.py, which README's main, training and decoding commands run under (test_cli.py,
    test_generate.py): a package of an extra is neither importable nor a pytest plug-in there, and what the
    zoo's own modules need, saving a checkpoint included, is."""
    from plain_install import blocked_modules, plain_env
    extras = [m for m in ("transformers", "matplotlib", "xdist") if importlib.util.find_spec(m) is not None]
    assert extras and set(extras) <= set(blocked_modules()), "the [test] extra is not installed here"
    script = ("import importlib.metadata, importlib.util, sys\n"
              f"assert all(importlib.util.find_spec(m) is None for m in {extras!r})\n"
              "assert not [d for d in importlib.metadata.distributions() if d.metadata['Name'] == 'pytest-xdist']\n"
              "import torch, safetensors.torch, zoo.cli, zoo.tasks.train, zoo.tasks.generate, properties.plugin\n"
              "safetensors.torch.save_file({'w': torch.ones(2)}, sys.argv[1])\n")
    result = run([sys.executable, "-c", script, str(tmp_path / "w.safetensors")], cwd=tmp_path,
                 env=plain_env(tmp_path / "plain"))
    assert result.returncode == 0, result.stderr
