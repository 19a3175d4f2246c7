"""Which dtypes a run checks (``--dtype``) and which a device computes in: read by the strategies, which draw them,
and by the kernel limits (core/limits.py), which probe and steer into them."""
from __future__ import annotations

import functools

import torch

from zoo.config.options import DTYPES

__all__ = ["select_dtypes", "selected_dtypes", "dtype_supported"]

# DTYPES' order matters: Hypothesis shrinks sampled_from towards the first entry, so counterexamples show
# float32 unless the failure needs another dtype.
_selected: list[torch.dtype] = list(DTYPES.values())


def select_dtypes(dtypes) -> None:
    """Restrict every dtype strategy to ``dtypes`` (called once by properties.plugin from ``--dtype``)."""
    _selected[:] = [d for d in DTYPES.values() if d in set(dtypes)]


def selected_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(_selected)


@functools.lru_cache(maxsize=None)
def dtype_supported(device: str, dtype: torch.dtype) -> bool:
    """Whether ``device`` computes in ``dtype`` (bf16 needs compute capability 8 on CUDA)."""
    if device.startswith("cuda") and dtype == torch.bfloat16:
        return torch.cuda.is_bf16_supported()
    try:
        x = torch.ones(2, 2, dtype=dtype, device=device)
        (x @ x).exp().sum().item()
        return True
    except (RuntimeError, TypeError):
        return False
