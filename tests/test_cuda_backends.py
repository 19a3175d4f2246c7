"""PyTorch's SDPA backends as --kernel plug-ins (examples/torch_cuda_backends.py) and the one departure the suite
found among them on CUDA: the memory-efficient kernel's float-mask rows of finfo.min (MASK-LOW-PRECISION,
--finfo-min-rows; examples/repro_mem_efficient_finfo_min.py). Here, without CUDA: the CUDA backends decline and are
reported skipped with their reason, math passes; the kernel's arithmetic emulated on the CPU is caught, and passes
once the convention is declared; the zoo's torch backend keeps such rows; a bad value of the option is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zoo.config.plugins import load_object
from zoo.nn.kernel import _shift_overflowing_rows, torch_attention

ROOT = Path(__file__).resolve().parents[1]
EMULATED = "examples/repro_mem_efficient_finfo_min.py:log2e_scaled_attention"
MASK_CLAUSE = str(ROOT / "properties" / "kernel" / "test_masks.py")


def _pytest(*args, report: Path | None = None):
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", "-W", "ignore", "--device", "cpu"]
    cmd += ["--report-json", str(report)] if report else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = json.loads(report.read_text()) if report is not None and report.exists() else []
    return proc, {(r["clause"], r["nodeid"].split("[")[1].rsplit("-cpu", 1)[0]): r for r in rows}


def test_cuda_backends_are_skipped_with_their_reason_and_math_passes_on_the_cpu(tmp_path):
    kernels = [f"examples/torch_cuda_backends.py:{name}" for name in ("flash", "efficient", "cudnn", "math")]
    proc, rows = _pytest(MASK_CLAUSE, "-k", "overflow", *(a for k in kernels + [EMULATED] for a in ("--kernel", k)),
                         report=tmp_path / "r.json")
    assert proc.returncode == 1, proc.stdout[-3000:]        # the emulated memory-efficient arithmetic is caught
    for name in ("flash", "efficient", "cudnn"):
        row = rows[("MASK-LOW-PRECISION", f"examples/torch_cuda_backends.py:{name}")]
        assert row["status"] == "skipped" and "is a CUDA backend" in row["message"], row
    assert rows[("MASK-LOW-PRECISION", "examples/torch_cuda_backends.py:math")]["status"] == "passed"
    assert rows[("MASK-LOW-PRECISION", EMULATED)]["status"] == "failed", rows[("MASK-LOW-PRECISION", EMULATED)]


def test_declared_finfo_min_rows_pass_the_emulated_memory_efficient_kernel(tmp_path):
    proc, rows = _pytest(MASK_CLAUSE, "-k", "overflow", "--kernel", EMULATED, "--kernel", "torch",
                         "--finfo-min-rows", "masked", report=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert {r["status"] for r in rows.values()} == {"passed"}, rows


def test_a_bad_finfo_min_rows_is_a_usage_error():
    proc, _ = _pytest(MASK_CLAUSE, "--finfo-min-rows", "zeros")
    lines = [line for line in proc.stderr.splitlines() if "--finfo-min-rows" in line]
    assert proc.returncode == 4 and len(lines) == 1 and "invalid choice: 'zeros'" in lines[0], proc.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_zoo_torch_backend_shifts_only_rows_that_would_overflow(dtype):
    info = torch.finfo(dtype)
    mask = torch.randn(4, 6).to(dtype)
    mask[1] = info.min                                                       # overflows: shifted to zeros
    mask[2, :3], mask[2, 3:] = info.min, -info.max / 2                       # does not: left as it is
    mask[3] = -torch.inf                                                     # fully masked: left as it is
    shifted = _shift_overflowing_rows(mask)
    assert torch.equal(shifted[1], torch.zeros(6, dtype=dtype))
    assert torch.equal(shifted[[0, 2, 3]], mask[[0, 2, 3]])
    # the emulated memory-efficient arithmetic: the row of finfo.min gives zeros, the shifted row its softmax (the
    # same as a row of zeros gives, bit for bit)
    emulated = load_object(f"{ROOT / EMULATED}")
    q, k, v = (torch.randn(1, n, 8).to(dtype) for n in (4, 6, 6))
    assert torch.equal(emulated(q, k, v, mask)[0, 1], torch.zeros(8, dtype=dtype))
    unmasked = mask.clone()
    unmasked[1] = 0
    assert torch.equal(emulated(q, k, v, shifted)[0, 1], emulated(q, k, v, unmasked)[0, 1])
    assert torch.equal(torch_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, shifted))
