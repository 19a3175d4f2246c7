"""Which dtypes a run checks (``--dtype``), which a device computes in, and whether a device is usable here: read
by the strategies, which draw them, by the kernel limits (kernel/limits.py), which probe and steer into them, and
by the plug-in and the model subjects, which skip a --device this machine lacks."""
from __future__ import annotations

import functools

import torch

from properties.core.options import DTYPE_NAMES

__all__ = ["select_dtypes", "selected_dtypes", "dtype_supported", "device_unavailable"]

_ALL = tuple(getattr(torch, name) for name in DTYPE_NAMES)   # in DTYPE_NAMES' order, the order Hypothesis shrinks in
_selected: list[torch.dtype] = list(_ALL)


def select_dtypes(dtypes) -> None:
    """Restrict every dtype strategy to ``dtypes`` (called once by properties.plugin from ``--dtype``)."""
    _selected[:] = [d for d in _ALL if d in set(dtypes)]


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


def device_unavailable(device: torch.device) -> str:
    """Why ``device`` cannot be used here ('' when it can): CUDA absent, an index past the CUDA devices, or
    another backend that refuses to make a tensor (MPS absent, ...)."""
    if device.type == "cpu":
        return ""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA not available"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"{device} not present ({torch.cuda.device_count()} CUDA device(s))"
        return ""
    try:
        torch.empty(1, device=device)
    except Exception:  # any backend may refuse in its own way (PyTorch's message lists every backend)
        return f"{device} not available on this machine"
    return ""
