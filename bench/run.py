"""Benchmarks of the zoo against PyTorch and Hugging Face on one device: ``python -m bench``.

Sections (``--parts``, all by default):
    models   forward and forward+backward tokens/s of the three families vs their references,
             both zoo kernels, and forward FLOP/s as a fraction of the machine's matmul FLOP/s
    kernel   the zoo's math and torch kernels vs F.scaled_dot_product_attention called directly
    decode   greedy decoding with the static KV cache vs the growing one, recomputing the prefix, and Hugging
             Face's generate with a static cache; on CUDA also the compiled step; operations per step (bench/decode.py)
    suite    wall time of ``pytest properties/``, alone and with ``-n auto`` (subprocesses)
    mutation median time to the first failure over the mutation catalog, when one exists
    training peak memory and time of an attention training step (forward + backward of the kernel alone) of the
             memory_efficient, math and torch kernels at L = 1024, 4096, 8192 (bench/training.py)

Each part's measuring is bounded by a budget its cells share (bench/common.py: PART_BUDGETS_S), and
``--time-limit`` stops beginning new parts and cells; the run ends by saying how long each part took.
Results are printed as tables and written as JSON (``--out``; ``--merge`` updates the parts run in an
existing file and keeps the others). Ratios are zoo / reference
throughput, so > 1 means the zoo is faster; every ratio comes from one interleaved measurement.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import warnings

import torch

from bench.common import (
    FAMILIES,
    PART_BUDGETS_S,
    default_device,
    timing_device_problem,
    machine_info,
    out_of_time,
    matmul_flops_per_s,
    write_json_atomic,
)
from bench.decode import bench_decode
from zoo.cli.arguments import Parser, count, output_problem, seconds
from bench.kernels import bench_kernel, kernel_geometry
from bench.models import MODEL_HEADER, bench_models, overrides
from bench.suite import bench_mutation, bench_suite
from bench.targets import evaluate_targets, missed_targets
from bench.training import bench_training

PARTS = ("models", "kernel", "decode", "suite", "mutation", "training")


def lengths_problem(args) -> str | None:
    """Why a --lengths value cannot be measured (None when all can), before any work: the models part runs each
    family at each length, so no length may pass a family's max_len; the kernel part's math kernel holds two
    (batch, heads, L, L) float32 score tensors at once, which must fit in the device's free memory."""
    from zoo.config.composition import compose_config
    from zoo.config.device_memory import available_memory

    if "models" in args.parts:
        for family in args.families:
            max_len = compose_config(overrides(family, args)).max_len
            if max(args.lengths) > max_len:
                return (f"--lengths {max(args.lengths)}: longer than {family}'s max_len {max_len} (the models part "
                        f"runs every family at every length); nothing was measured")
    free = available_memory(args.device) if "kernel" in args.parts else None
    if free is not None:
        heads, _ = kernel_geometry(args)
        length = max(args.lengths)
        needed = 2 * args.batch * heads * length * length * 4
        if needed > free[0]:
            return (f"--lengths {length}: the kernel part's scores need {needed / 2**30:,.1f} GiB at batch "
                    f"{args.batch}, more than {free[0] / 2**30:,.1f} GiB free ({free[1]}); nothing was measured")
    return None


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small sizes, few repeats, the mutation part on one catalog entry in 8 (docs/benchmarks.md: "
                        "how long each run takes)")
    p.add_argument("--toy", action="store_true", help="tiny geometry instead of the presets' (smoke tests)")
    p.add_argument("--device", default=default_device(), help="default: cuda if available, else cpu")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    p.add_argument("--lengths", default=None, help="sequence lengths (default 128,512; quick 64)")
    p.add_argument("--batch", type=count(1), default=None, help="batch size (default 8; quick 2)")
    p.add_argument("--layers", type=count(1), default=None, help="layers per stack (default 2; quick 1)")
    p.add_argument("--new-tokens", type=count(1), default=None, help="tokens to decode (default 256; quick 32)")
    p.add_argument("--prompt", type=count(1), default=8, help="prompt length for decoding")
    p.add_argument("--decode-batch", type=count(1), default=1, help="sequences decoded at once (default 1)")
    p.add_argument("--train-lengths", default=None,
                   help="sequence lengths of the training part (default 1024,4096,8192; quick 256,512,1024; "
                        "toy 256,512)")
    p.add_argument("--matmul-n", type=count(1), default=None, help="matmul size (default 4096; quick 1024)")
    p.add_argument("--threads", type=count(1, 1024), default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time (default), or the process's CPU time: with --device cpu --threads 1 on a "
                        "machine shared with other work, it leaves out the time spent waiting for a core")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model families")
    p.add_argument("--out", default="bench/results.json", help="JSON output path ('' to skip)")
    p.add_argument("--time-limit", type=seconds(), default=None, metavar="SECONDS",
                   help="begin no part and no model, kernel or decode cell after this many seconds (what was "
                        "measured is kept and reported; default: none, the part budgets bound the run)")
    p.add_argument("--check", action="store_true",
                   help="exit with status 1 when a stated target is missed or a part fails (for CI); without it "
                        "a missed target is reported and the exit status is 0")
    p.add_argument("--merge", action="store_true",
                   help="update --out in place: replace the parts run, keep the others (their machine and "
                        "settings stay those of the file; this run's are recorded under 'merged')")
    args = p.parse_args(argv)
    quick = args.quick or args.toy

    def integers(option: str, text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            p.error(f"{option}: expected comma-separated integers, got {text!r}")
        if any(v < 1 for v in values):
            p.error(f"{option}: every value must be positive, got {text!r}")
        return values

    args.lengths = integers("--lengths", args.lengths or ("64" if quick else "128,512"))
    args.batch = args.batch if args.batch is not None else (2 if quick else 8)
    args.layers = args.layers if args.layers is not None else (1 if quick else 2)
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (32 if quick else 256)
    args.matmul_n = args.matmul_n if args.matmul_n is not None else (1024 if quick else 4096)
    args.train_lengths = integers("--train-lengths", args.train_lengths or (
        "256,512" if args.toy else "256,512,1024" if args.quick else "1024,4096,8192"))
    names = args.dtypes.split(",")
    bad = [n for n in names if not isinstance(getattr(torch, n, None), torch.dtype)]
    if bad:
        p.error(f"--dtypes: unknown dtype {bad[0]!r} (e.g. float32,bfloat16,float16,float64)")
    args.dtypes = [getattr(torch, name) for name in names]
    problem = timing_device_problem(args.device)
    if problem:
        p.error(f"--device {args.device}: {problem}")
    if args.out:
        problem = output_problem(args.out)
        if problem:
            p.error(f"--out {args.out}: cannot be written ({problem}); results are written after every part")
        if args.merge and os.path.exists(args.out):
            try:
                with open(args.out) as f:
                    merged_into = json.load(f)
            except (OSError, ValueError) as exc:
                p.error(f"--merge: {args.out} cannot be read as JSON ({exc}); nothing was measured")
            if not isinstance(merged_into, dict):
                p.error(f"--merge: {args.out} holds a JSON {type(merged_into).__name__}, not the object a results "
                        f"file is; nothing was measured")
    args.parts = args.parts.split(",")
    args.families = args.families.split(",")
    for name in args.parts:
        if name not in PARTS:
            p.error(f"--parts: unknown part {name!r} (allowed: {', '.join(PARTS)})")
    for name in args.families:
        if name not in FAMILIES:
            p.error(f"--families: unknown family {name!r} (allowed: {', '.join(FAMILIES)})")
    problem = lengths_problem(args)
    if problem:
        p.error(problem)
    if args.clock == "cpu" and (args.device != "cpu" or args.threads != 1):
        p.error("--clock cpu needs --device cpu --threads 1 (CPU time of several threads is not a duration)")
    # Repeats: budget_s of measuring per cell, at least min_repeats rounds (the big cells get only those).
    args.timing = ({"min_repeats": 1, "max_repeats": 2, "budget_s": 0.1} if args.toy else
                   {"min_repeats": 2, "max_repeats": 5, "budget_s": 1.0} if args.quick else
                   {"min_repeats": 3, "max_repeats": 15, "budget_s": 6.0})
    args.timing["clock"] = args.clock
    args.part_budgets_s = PART_BUDGETS_S["toy" if args.toy else "quick" if args.quick else "full"]
    args.deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    start = time.perf_counter()
    run: dict = {"machine": machine_info(device),
                 "settings": {"quick": args.quick, "toy": args.toy, "device": str(device),
                              "dtypes": [str(d).removeprefix("torch.") for d in args.dtypes],
                              "lengths": args.lengths, "train_lengths": args.train_lengths,
                              "batch": args.batch, "layers_per_stack": args.layers,
                              "new_tokens": args.new_tokens, "prompt": args.prompt,
                              "decode_batch": args.decode_batch, "threads": args.threads,
                              "timing": {**args.timing, "method": f"{args.clock} clock, device synchronised, "
                                         "alternating rounds (ABC, CBA, ...), median per callable"},
                              "parts": args.parts, "families": args.families}}
    results = run
    if args.merge and args.out and os.path.exists(args.out):  # this run's parts into the file's results
        with open(args.out) as f:
            results = json.load(f)
        for name in args.parts:
            results.get("errors", {}).pop(name, None)
            results.setdefault("merged", {})[name] = run  # the machine and settings these parts come from
        if not results.get("errors"):
            results.pop("errors", None)
    print(f"device {device} ({run['machine']['device_name']}), torch {torch.__version__}, "
          f"{args.threads} threads, {args.clock} clock, "
          f"load average {run['machine'].get('load_average_at_start')}", flush=True)

    def models():
        results["matmul"] = {}
        for dtype in args.dtypes:
            name = str(dtype).removeprefix("torch.")
            results["matmul"][name] = matmul_flops_per_s(args.matmul_n, dtype, device,
                                                         budget_s=args.timing["budget_s"], clock=args.clock)
            print(f"matmul {args.matmul_n}x{args.matmul_n} {name}: "
                  f"{results['matmul'][name]['flops_per_s'] / 1e9:,.1f} GFLOP/s", flush=True)
        print(MODEL_HEADER, flush=True)
        return bench_models(args, device, results["matmul"])

    def mutation():
        out = bench_mutation(every=8 if quick_sizes else 1)
        print(f"mutation median time to first failure: {out.get('median_first_failure_seconds', 'n/a')} "
              f"({out.get('caught', 0)}/{out.get('mutants', 0)} caught) {out.get('reason', '')} "
              f"[{out['module']}]", flush=True)
        return out

    sections = {"models": models, "kernel": lambda: bench_kernel(args, device),
                "decode": lambda: bench_decode(args, device), "suite": bench_suite, "mutation": mutation,
                "training": lambda: bench_training(args, device)}
    quick_sizes = args.quick or args.toy
    run["part_seconds"] = {}
    for name in args.parts:
        if out_of_time(args):
            print(f"{name}: not run, --time-limit {args.time_limit:g} s reached", flush=True)
            run.setdefault("not_run", []).append(name)
            continue
        began = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as exc:  # noqa: BLE001 -- keep what the other sections measured
            traceback.print_exc()
            results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            gc.collect()
        run["part_seconds"][name] = time.perf_counter() - began
        print(f"{name}: {run['part_seconds'][name]:.0f} s", flush=True)
        if args.out:
            write_json_atomic(args.out, results)
    results["targets"] = evaluate_targets(results)
    run["wall_seconds"] = time.perf_counter() - start  # with --merge, recorded with this run's parts
    if hasattr(os, "getloadavg"):
        run["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print("\ntargets")
    for t in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "-"}[t["met"]]
        print(f"  [{verdict:^6}] {t['target']}: {t['value']}" + (f"  ({t['note']})" if t.get("note") else ""))
        for line in t.get("missed", []):
            print(f"           {line}")
    for name, error in results.get("errors", {}).items():
        print(f"  [ERROR ] {name}: {error}")
    print(f"finished: wall time {run['wall_seconds']:.0f} s (" + ", ".join(
        f"{name} {seconds:.0f} s" for name, seconds in run["part_seconds"].items()) + ")"
          + (f"; not run (--time-limit): {', '.join(run['not_run'])}" if run.get("not_run") else ""))
    if args.out:
        write_json_atomic(args.out, results)
        print(f"wrote {args.out}")
    if args.check:
        missed = missed_targets(results)
        if missed:
            print(f"bench --check: {len(missed)} target(s) missed: {'; '.join(missed)}", file=sys.stderr)
            raise SystemExit(1)
        print("bench --check: every stated target met")
    return results
