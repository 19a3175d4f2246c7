"""PyTorch's cuDNN attention backend with a bool mask: a query whose mask admits no key does not come out as 0.

    python examples/repro_cudnn_bool_mask_rows.py

MASK-FULLY-MASKED's, MASK-NO-INFLUENCE's and ATTN-GRAD-MASKED's failures on an H100 (``--kernel
examples/torch_cuda_backends.py:cudnn``, and plain ``torch.nn.functional:scaled_dot_product_attention``, which the
dispatcher sends to cuDNN for half-precision inputs with a bool mask on Hopper), reproduced without the suite. With
a bool mask, such a row comes out neither as zeros (the math backend, PyTorch >= 2.5) nor as the mean of the values
(a finfo.min mask), its output depends on the masked keys and values, and keys that no query may attend get a
nonzero dK and dV; the same mask given as its additive -inf float mask gives zeros. PyTorch documents no value for
such a row (docs/sources/pytorch-sdpa.md), so the suite counts this a departure, which a user who accepts it declares
with ``--fully-masked any`` (docs/kernels.md); the zoo's ``torch`` kernel passes bool masks as -inf float masks and
zeroes such rows itself (zoo/nn/kernel.py, ``sdpa_keeping_the_contract``).

It needs CUDA (and PyTorch built with cuDNN attention); on a machine without, it says so and exits 0.
"""
import sys

import torch
import torch.nn.functional as F


def _problem(s: int, dtype, device):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, s, 64, generator=g).to(dtype).to(device) for _ in range(3))
    mask = torch.rand(s, s, generator=g) < 0.5
    mask[0] = False                   # query 0 admits no key
    mask[1:, 0] = True                # every other query admits key 0
    mask[:, 1] = False                # key 1: no query may attend it
    return q, k, v, mask.to(device)


def main() -> int:
    if not torch.cuda.is_available():
        print("examples/repro_cudnn_bool_mask_rows.py needs CUDA (PyTorch's cuDNN attention backend): nothing to run")
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from zoo.nn.kernel import torch_attention
    for dtype in (torch.bfloat16, torch.float16):
        for s in (8, 63, 1024):
            q, k, v, mask = _problem(s, dtype, "cuda")
            float_mask = torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill(~mask, float("-inf"))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
                    out.backward(torch.ones_like(out))
                    with_float = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
            except RuntimeError as exc:
                print(f"cuDNN attention not available: {str(exc).splitlines()[0]}")
                return 0
            mean = v.float().mean(-2)
            zoo = torch_attention(q, k, v, attn_mask=mask)
            print(f"{str(dtype).removeprefix('torch.'):9} S = {s:4}: query 0 with a bool mask: max |out| = "
                  f"{out[..., 0, :].abs().max().item():.3g} (the mean of the values: "
                  f"{bool(torch.allclose(out[..., 0, :].float(), mean, atol=1e-2))}); key 1's max |dK| = "
                  f"{leaves[1].grad[..., 1, :].abs().max().item():.3g}, |dV| = "
                  f"{leaves[2].grad[..., 1, :].abs().max().item():.3g}; with the -inf float mask max |out| = "
                  f"{with_float[..., 0, :].abs().max().item():.3g}; the zoo's torch kernel "
                  f"{zoo[..., 0, :].abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
