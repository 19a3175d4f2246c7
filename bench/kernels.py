"""The zoo's kernels against F.scaled_dot_product_attention called directly."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import cell_timing, interleaved, out_of_time
from zoo.nn.kernel import math_attention, torch_attention


def kernel_geometry(args) -> tuple[int, int]:
    """(heads, head size) of the kernel part's problems: (batch, heads, L, head size) for each L of --lengths."""
    return (4, 16) if args.toy else (12, 64)


def bench_kernel(args, device) -> list[dict]:
    cells = []
    heads, head_dim = kernel_geometry(args)
    share = cell_timing(args, "kernel", len(args.dtypes) * len(args.lengths) * 2)
    for dtype in args.dtypes:
        for length in args.lengths:
            if out_of_time(args):
                print(f"kernel: --time-limit reached, {dtype} L={length} and the cells after it not measured",
                      flush=True)
                return cells
            q, k, v = (torch.randn(args.batch, heads, length, head_dim, device=device).to(dtype) for _ in range(3))
            for causal in (False, True):
                def fn(kernel, q=q, k=k, v=v, causal=causal):
                    def run():
                        with torch.inference_mode():
                            kernel(q, k, v, is_causal=causal)
                    return run
                fns = {"sdpa": fn(F.scaled_dot_product_attention), "zoo_torch": fn(torch_attention),
                       "zoo_math": fn(math_attention)}
                timing = {**share, "max_repeats": 4 * share["max_repeats"]}  # cheap calls: more rounds
                out = interleaved(fns, device, warmup=2, **timing)
                s = out["seconds"]
                cell = {"shape": list(q.shape), "dtype": str(dtype).removeprefix("torch."), "is_causal": causal,
                        "repeats": out["repeats"], "calls_per_sample": out["calls_per_sample"], "seconds": s,
                        "ratio": {name: s["sdpa"] / s[name] for name in ("zoo_torch", "zoo_math")}}
                cells.append(cell)
                print(f"kernel {tuple(cell['shape'])} {cell['dtype']:<8} causal={causal!s:<5} "
                      f"sdpa {s['sdpa'] * 1e3:8.2f} ms  torch x{cell['ratio']['zoo_torch']:.2f}  "
                      f"math x{cell['ratio']['zoo_math']:.2f}", flush=True)
    return cells
