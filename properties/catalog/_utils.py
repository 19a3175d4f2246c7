"""What several catalog modules share and no one of them is the home of."""
from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a plain-torch kernel computes in: float32 for half-precision inputs, else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
