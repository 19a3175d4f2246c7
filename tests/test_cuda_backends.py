"""PyTorch's SDPA backends as --kernel plug-ins (examples/torch_cuda_backends.py) and the one departure the suite
found among them on CUDA: the memory-efficient kernel's float-mask rows of finfo.min (MASK-LOW-PRECISION,
--finfo-min-rows; examples/repro_mem_efficient_finfo_min.py). Here, without CUDA, in this process: the kernel's
arithmetic emulated on the CPU is caught, and passes once the convention is declared; the zoo's torch backend keeps
such rows. (The CUDA backends' declines on the CPU and the option's usage error: tests/test_kernel_limits.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zoo.runtime.plugins import load_object
from zoo.nn.kernel import _shift_overflowing_rows, torch_attention

ROOT = Path(__file__).resolve().parents[1]
EMULATED = "examples/repro_mem_efficient_finfo_min.py:log2e_scaled_attention"


def _mask_clause(kernel_spec: str, finfo_min_rows: str, fully_masked: str = "zeros", dtype=torch.float32):
    """MASK-LOW-PRECISION's body on one pinned shape (row 0 of finfo.min everywhere), in this process."""
    from properties.kernel.guard import GuardedKernel
    from properties.kernel.problem_space import Problem
    from properties.kernel.test_masks import test_extreme_float_mask_values_do_not_overflow as clause
    kernel = GuardedKernel(kernel_spec, load_object(kernel_spec))
    case = Problem((1, 1), 3, 5, 8, 4, dtype, 0, attend="float",
                   extras=(("density", 0.5), ("magnitude", 0.0), ("opposed", False)))
    clause.hypothesis.inner_test(kernel=kernel, device="cpu", case=case, fully_masked=fully_masked,
                                 finfo_min_rows=finfo_min_rows)


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")   # the body's assume, called bare
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_memory_efficient_arithmetic_is_caught_unless_declared(dtype):
    emulated = f"{ROOT / EMULATED}"
    with pytest.raises(AssertionError, match="weights"):
        _mask_clause(emulated, "softmax", dtype=dtype)
    _mask_clause(emulated, "masked", dtype=dtype)                  # declared: the row may come out fully masked
    _mask_clause("torch.nn.functional:scaled_dot_product_attention", "masked", dtype=dtype)  # the softmax: also fine
    with pytest.raises(AssertionError):                            # declared rows follow --fully-masked, not anything
        _mask_clause(emulated, "masked", fully_masked="nan", dtype=dtype)


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


def test_the_cuda_table_script_says_in_one_line_that_it_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: python -m bench.cuda_backends runs the suite for real")
    from bench.cuda_backends import main
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0]
