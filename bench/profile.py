"""Where the time goes in one benchmark cell: torch.profiler tables for the zoo and its reference.

    python -m bench.profile --family decoder_only --dtype bfloat16 --seq-len 128 --mode forward
    python -m bench.profile --host-overhead      # host time per forward pass (three families) and per decoded token

``--host-overhead`` measures what a forward pass costs the host when the arithmetic costs nothing: the model at
d_model 16 on 8 tokens (same layers, same modules), process CPU time per call, the zoo and its reference in
alternating rounds. On a GPU a small model's forward pass waits on the host's Python and dispatch for every
operation, so this is the CPU-measurable part of the zoo's speed against Hugging Face and nn.Transformer there
(issue 26: the encoder-decoder at L = 128 in float16 ran at 0.82x nn.Transformer on an H100).
"""
from __future__ import annotations

import argparse
import statistics
import time

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
from zoo.config.builder import build_model
from zoo.config.composition import compose_config


def host_overhead(family: str, *, layers: int = 2, rounds: int = 15, calls: int = 40) -> dict:
    """Median process CPU microseconds per forward pass (inference mode, one thread) of the zoo (torch kernel) and
    its reference, both at d_model 16, 2 heads, vocabulary 64, batch 1 x 8 tokens."""
    tiny = [f"layers={layers}", "dropout=0", "d_model=16", "heads=2", "d_ff=32", "vocab_size=64", "max_len=32"]
    args = argparse.Namespace(layers=layers, toy=False)
    cfg = compose_config(overrides(family, args, *tiny))
    zoo = build_model(overrides(family, args, *tiny, "attention=torch")).eval()
    reference = build_reference(family, cfg, device="cpu", dtype=torch.float32).eval()
    inputs = model_inputs(family, cfg.vocab_size, 1, 8, "cpu")
    calls_of = {"zoo": zoo_call(family, zoo), "reference": reference_call(family, reference)}
    samples = {name: [] for name in calls_of}
    with torch.inference_mode():
        for call in calls_of.values():
            for _ in range(calls):
                call(*inputs)
        for _ in range(rounds):
            for name, call in calls_of.items():
                start = time.process_time()
                for _ in range(calls):
                    call(*inputs)
                samples[name].append((time.process_time() - start) / calls * 1e6)
    median = {name: statistics.median(v) for name, v in samples.items()}
    return {"family": family, "microseconds": median, "reference_over_zoo": median["reference"] / median["zoo"]}


def decode_host_overhead(*, layers: int = 2, tokens: int = 128, rounds: int = 9) -> dict:
    """Median process CPU microseconds per generated token (greedy, batch 1, after 8 tokens) of the decoder-only
    model at the host-overhead size, with the static cache and with the growing KVCache: a decoding step's host
    cost, which is what a step costs on a GPU when it is not captured in a CUDA graph."""
    from zoo.tasks.generate import generate

    tiny = [f"layers={layers}", "dropout=0", "d_model=16", "heads=2", "d_ff=32", "vocab_size=64",
            f"max_len={tokens + 8}", "attention=torch"]
    model = build_model(overrides("decoder_only", argparse.Namespace(layers=layers, toy=False), *tiny)).eval()
    prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    samples = {"static": [], "growing": []}
    with torch.inference_mode():
        for _ in range(2):
            for name in samples:
                generate(model, prompt, tokens, eos_id=None, static=name == "static")
        for _ in range(rounds):
            for name in samples:
                start = time.process_time()
                generate(model, prompt, tokens, eos_id=None, static=name == "static")
                samples[name].append((time.process_time() - start) / tokens * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv=None) -> None:
    from bench.common import timing_device_problem
    from zoo.cli.arguments import Parser, count

    p = Parser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="decoder_only", choices=list(FAMILIES))
    p.add_argument("--backend", default="torch", choices=["torch", "math"])
    p.add_argument("--device", default=default_device())
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--seq-len", type=count(1), default=128)
    p.add_argument("--batch", type=count(1), default=8)
    p.add_argument("--layers", type=count(1), default=2)
    p.add_argument("--mode", default="forward", choices=["forward", "forward+backward"])
    p.add_argument("--threads", type=count(1, 1024), default=torch.get_num_threads())
    p.add_argument("--calls", type=count(1), default=3)
    p.add_argument("--rows", type=count(1), default=15)
    p.add_argument("--toy", action="store_true")
    p.add_argument("--host-overhead", action="store_true",
                   help="host CPU time per forward pass at tiny sizes, every family (see the module docstring)")
    args = p.parse_args(argv)
    problem = timing_device_problem(args.device)
    if problem:
        p.error(f"--device {args.device}: {problem}")
    if not args.host_overhead:
        max_len = compose_config(overrides(args.family, args)).max_len
        if args.seq_len > max_len:
            p.error(f"--seq-len {args.seq_len}: longer than {args.family}'s max_len {max_len}; nothing was profiled")
    torch.set_num_threads(args.threads)
    if args.host_overhead:
        torch.set_num_threads(1)
        for family in FAMILIES:
            out = host_overhead(family, layers=args.layers)
            us = out["microseconds"]
            print(f"{family:<16} host CPU per forward: zoo {us['zoo']:,.0f} us, reference {us['reference']:,.0f} us "
                  f"(reference / zoo x{out['reference_over_zoo']:.2f})", flush=True)
        us = decode_host_overhead(layers=args.layers)
        print(f"decoder_only     host CPU per decoded token: static cache {us['static']:,.0f} us, growing KVCache "
              f"{us['growing']:,.0f} us (x{us['growing'] / us['static']:.2f})", flush=True)
        return
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
