"""Where the time goes in one benchmark cell: torch.profiler tables for the zoo and its reference.

    python -m bench.profile --family decoder_only --dtype bfloat16 --seq-len 128 --mode forward
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import FAMILIES, default_device
from bench.models import (
    forward_fn,
    model_inputs,
    overrides,
    reference_call,
    training_fn,
    zoo_call,
)
from bench.references import build_reference
from zoo.config.builder import build_model, compose_config


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="decoder_only", choices=list(FAMILIES))
    p.add_argument("--backend", default="torch", choices=["torch", "math"])
    p.add_argument("--device", default=default_device())
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mode", default="forward", choices=["forward", "forward+backward"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--toy", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = compose_config(overrides(args.family, args))
    zoo = build_model(overrides(args.family, args, f"attention={args.backend}"), device=device, dtype=dtype)
    models = {f"zoo ({args.backend} kernel)": (zoo_call, zoo),
              "reference": (reference_call, build_reference(args.family, cfg, device=device, dtype=dtype))}
    inputs = model_inputs(args.family, cfg.vocab_size, args.batch, args.seq_len, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, (make_call, model) in models.items():
        train = args.mode == "forward+backward"
        model.train(train)
        run = (training_fn if train else forward_fn)(model, make_call(args.family, model), inputs)
        run()  # warm-up
        with profile(activities=activities) as prof:
            for _ in range(args.calls):
                run()
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"\n== {name}: {args.family} L={args.seq_len} batch={args.batch} {args.dtype} {args.mode}, "
              f"{args.calls} calls")
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))


if __name__ == "__main__":
    main()
