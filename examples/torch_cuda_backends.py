"""PyTorch's ``scaled_dot_product_attention`` with one backend forced, as ``--kernel`` plug-ins:

    pytest properties/ --device cuda --kernel examples/torch_cuda_backends.py:flash
    pytest properties/ --device cuda --kernel examples/torch_cuda_backends.py:efficient --finfo-min-rows masked
    pytest properties/ --device cuda --kernel examples/torch_cuda_backends.py:cudnn --fully-masked any
    pytest properties/ --device cuda --kernel examples/torch_cuda_backends.py:math

Each runs its backend alone (``torch.nn.attention.sdpa_kernel``). A problem the backend cannot run — a dtype it
lacks, an attn_mask the flash kernel takes none of, a head size, grouped heads — makes PyTorch raise "No available
kernel", which the suite counts as a decline (properties/kernel/limits.py): the draws then stay inside what the backend
accepts, and the coverage report says what was declined. flash, efficient and cudnn are CUDA kernels and decline any
other device (so on a machine without CUDA their clauses are skipped with that reason); math runs everywhere.
The memory-efficient kernel treats a float-mask row of finfo.min as fully masked (float32, bfloat16:
examples/repro_mem_efficient_finfo_min.py), which ``--finfo-min-rows masked`` declares; the cuDNN kernel, with a bool mask,
gives a query whose mask admits no key neither zeros nor the mean of the values (examples/repro_cudnn_bool_mask_rows.py),
which ``--fully-masked any`` accepts (docs/kernels.md). ``python -m bench.cuda_backends``
runs the suite on each of them and on the zoo and writes docs/kernels.md's CUDA table.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["flash", "efficient", "cudnn", "math", "BACKENDS"]


def _forced(backend: SDPBackend, cuda_only: bool):
    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if cuda_only and query.device.type != "cuda":
            raise NotImplementedError(f"{backend.name} is a CUDA backend of scaled_dot_product_attention: "
                                      f"{query.device.type} is not supported")
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    kernel.__name__ = kernel.__qualname__ = backend.name.lower()
    kernel.__doc__ = f"F.scaled_dot_product_attention with only {backend.name} enabled."
    return kernel


flash = _forced(SDPBackend.FLASH_ATTENTION, cuda_only=True)
efficient = _forced(SDPBackend.EFFICIENT_ATTENTION, cuda_only=True)
cudnn = _forced(SDPBackend.CUDNN_ATTENTION, cuda_only=True)
math = _forced(SDPBackend.MATH, cuda_only=False)
BACKENDS = {"flash": flash, "efficient": efficient, "cudnn": cudnn, "math": math}
