"""Precision at length: the real error of correct kernels against the derived bound (properties/core/tolerance.py,
step 6), in bfloat16 and float16, on long rows, and the same for the state-rounding bug of the catalog.

For each kernel, problems of S = 64 ... 1024 keys (L = 3, E = 64), values gaussian or uniform on [0, 1), query
scales 2^-8 ... 1, seeds 0 ... N - 1: the largest |out - oracle| / bound of each problem. Prints the quantiles of
that ratio per kernel and dtype (a correct kernel must stay below 1, the bug must not):

    python examples/precision_at_length.py --seeds 4
    TRITON_INTERPRET=1 python examples/precision_at_length.py --seeds 1 --kernels triton
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

from properties.core.strategies import on
from properties.kernel.cases import Case
from properties.core.tolerance import output_bound, softmax_bounds

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str, attribute: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attribute)


def kernels(names: list[str]) -> dict:
    from zoo.nn.kernel import KERNELS
    from properties.catalog.correct import flash_attention, stepwise_attention
    from properties.catalog.tiled import tiled_attention
    from properties.catalog.state_bugs import state_rounded_per_tile
    known = {"sdpa": lambda: F.scaled_dot_product_attention, "zoo-math": lambda: KERNELS["math"],
             "zoo-torch": lambda: KERNELS["torch"], "zoo-memory_efficient": lambda: KERNELS["memory_efficient"],
             "tiled": lambda: tiled_attention, "flash": lambda: flash_attention, "stepwise": lambda: stepwise_attention,
             "flex": lambda: _example("flex_attention_adapter", "scaled_dot_product_attention"),
             "triton": lambda: _example("triton_attention", "attention"),
             "BUG state_rounded_per_tile": lambda: state_rounded_per_tile}
    return {name: known[name]() for name in names}


def ratios(fn, dtype, seeds: int) -> list[float]:
    out = []
    for s in (64, 256, 1024):
        for seed in range(seeds):
            for spread in (-8, -4, 0):
                for positive in (False, True):
                    case = Case(lead=(1, 1), l=3, s=s, e=64, ev=64, dtype=dtype, seed=seed)
                    q, k, v = case.qkv64()
                    if positive:
                        v = torch.rand(v.shape, generator=case.generator(1), dtype=torch.float64)
                    q, k, v = on(q * 2.0**spread, dtype, "cpu"), on(k, dtype, "cpu"), on(v, dtype, "cpu")
                    bounds = softmax_bounds(q, k, v)
                    error = (fn(q, k, v).double() - bounds.reference.output).abs()
                    out.append(float((error / output_bound(bounds, v)).max()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--kernels", nargs="*", default=["sdpa", "zoo-math", "zoo-torch", "zoo-memory_efficient",
                                                          "tiled", "flash", "stepwise", "flex",
                                                          "BUG state_rounded_per_tile"])
    args = parser.parse_args()
    for name, fn in kernels(args.kernels).items():
        for dtype in (torch.bfloat16, torch.float16):
            r = torch.tensor(ratios(fn, dtype, args.seeds), dtype=torch.float64)
            q = torch.quantile(r, torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
            print(f"{name:28s} {str(dtype)[6:]:9s} n={len(r):3d} error/bound median {q[0]:.3f} p90 {q[1]:.3f} "
                  f"max {q[2]:.3f}", flush=True)


if __name__ == "__main__":
    main()
