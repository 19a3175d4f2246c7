"""The built wheel carries the config tree: `python -m zoo` works from any directory without the source tree."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_runs_from_a_temporary_directory(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "-w", str(wheels), str(ROOT)], check=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    # Only the installed copy may be importable: the dependencies stay where they are, but the
    # editable finder of the development install is bypassed by putting the target first and
    # checking where zoo was imported from.
    env = {**os.environ, "PYTHONPATH": str(target)}
    check = subprocess.run([sys.executable, "-c", "import zoo, zoo.conf; print(zoo.__file__, zoo.conf.__path__[0])"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
    assert str(target) in check.stdout, check.stdout
    result = subprocess.run([sys.executable, "-m", "zoo", "preset=gpt2_small", "task=summary"], cwd=elsewhere,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "124,439,808" in result.stdout
