"""Third-party context-parallel code under the distributed level, run as a user runs it, and the gloo pitfall the
zoo's kernels must not depend on.

* ring-attention-pytorch 0.5.20 (lucidrains) through examples/ring_attention_pytorch_adapter.py: the suite names, with
  the clause and the rank, what it departs in (docs/distributed.md, "Third-party kernels"): the forward and dQ within
  their bounds, dK and dV outside in ``ring_flash_attn`` and ``zig_zag_attn``, a RuntimeError in float64 from
  ``ring_flash_attn``. Skipped where the package is not installed (it is not one of the project's dependencies).
* torch.distributed.nn.functional.all_gather's backward on gloo (examples/repro_all_gather_backward_gloo.py): the zoo's
  all_gather returns each rank's gradient in place, and nothing in zoo/ or properties/ uses torch's.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = "examples/ring_attention_pytorch_adapter.py"
needs_ring_attention_pytorch = pytest.mark.skipif(
    importlib.util.find_spec("ring_attention_pytorch") is None,
    reason="ring-attention-pytorch is not installed (pip install ring-attention-pytorch==0.5.20)")


def suite(*arguments: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "properties/", "-q", "-p", "no:cacheprovider",
                           "--world-size", "2", "--call-timeout", "60", *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    return done.returncode, done.stdout + done.stderr


def failures(output: str) -> dict[str, str]:
    """clause -> the first failure line of its test (pytest's 'E   ...' line, Hypothesis' '| ...' in a group)."""
    found = {}
    for block in re.split(r"^_+ test_", output, flags=re.MULTILINE)[1:]:
        clause = re.search(r"spec clause (CP-[A-Z-]+)", block)
        line = re.search(r"^(?:E|\s+\|) +(?:\S+Error: |AssertionError: )(.*)$", block, re.MULTILINE)
        if clause and line:
            found[clause.group(1)] = line.group(1)
    return found


@needs_ring_attention_pytorch
@pytest.mark.parametrize("name,layout", [("ring", "contiguous"), ("zigzag", "zigzag")])
def test_ring_attention_pytorch_gets_dk_and_dv_wrong_and_the_suite_names_them(name, layout):
    status, output = suite("--kernel", f"{ADAPTER}:{name}", "--shard", layout, "--dtype", "float32")
    assert status == 1, output[-3000:]
    failed = failures(output)
    assert set(failed) >= {"CP-GRAD", "CP-WORLD-SIZE"}, (sorted(failed), output[-3000:])
    assert not set(failed) & {"CP-SHAPE", "CP-ORACLE", "CP-CAUSAL", "CP-GQA", "CP-INPUTS-UNCHANGED"}, failed
    line = failed["CP-GRAD"]
    assert line.startswith("|dkey - oracle|") and "|dvalue - oracle|" in line, line
    assert "(dquery within its bound)" in line and re.search(r"is held by rank \d of 2", line), line


@needs_ring_attention_pytorch
def test_ring_flash_attn_raises_in_float64_on_every_rank():
    status, output = suite("--kernel", f"{ADAPTER}:ring", "--dtype", "float64", "-k", "every_rank_returns")
    assert status == 1, output[-3000:]
    line = failures(output)["CP-SHAPE"]
    assert "rank 0 of 2 raised RuntimeError: value cannot be converted to type float without overflow" in line, line
    assert "[clause CP-SHAPE]" in line and "rank 1: RuntimeError: value cannot be converted" in line, line


@needs_ring_attention_pytorch
def test_the_adapter_refuses_the_other_layout_in_one_line():
    status, output = suite("--kernel", f"{ADAPTER}:ring", "--shard", "zigzag")
    lines = [line for line in output.splitlines() if line.strip()]
    assert status == 4 and len(lines) == 1, output[-3000:]
    assert "it is written for contiguous shards (its `layouts`), not --shard zigzag" in lines[0], lines[0]


def test_the_zoo_all_gather_backward_is_right_on_gloo_where_torch_s_is_not_relied_on():
    done = subprocess.run([sys.executable, "examples/repro_all_gather_backward_gloo.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert sorted(line for line in lines if "zoo.nn.collectives" in line) == [
        "rank 0 zoo.nn.collectives.all_gather: right", "rank 1 zoo.nn.collectives.all_gather: right"], done.stdout
    torch_lines = [line for line in lines if "torch.distributed.nn" in line]
    assert len(torch_lines) == 2 and done.returncode == (1 if any("WRONG" in line for line in torch_lines) else 0), \
        done.stdout + done.stderr
    users = [str(path.relative_to(ROOT)) for folder in ("zoo", "properties") for path in (ROOT / folder).rglob("*.py")
             if re.search(r"^\s*(from|import) torch\.distributed\.nn|distributed\.nn\.functional\.",
                          path.read_text(), re.MULTILINE)]
    assert not users, users
