"""Benchmarks of the zoo against PyTorch and Hugging Face on one device: ``python -m bench``.

Sections (``--parts``, all by default):
    models   forward and forward+backward tokens/s of the three families vs their references,
             both zoo kernels, and forward FLOP/s as a fraction of the machine's matmul FLOP/s
    kernel   the zoo's math and torch kernels vs F.scaled_dot_product_attention called directly
    decode   greedy decoding with a KVCache vs recomputing the whole prefix at every step
    suite    wall time of ``pytest properties/``, alone and with ``-n auto`` (subprocesses)
    mutation median time to the first failure over the mutation catalog, when one exists

Results are printed as tables and written as JSON (``--out``). Ratios are zoo / reference
throughput, so > 1 means the zoo is faster; every ratio comes from one interleaved measurement.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import (default_device, forward_flops, interleaved, machine_info, matmul_flops_per_s,
                          write_json_atomic)
from bench.references import REFERENCE_NAMES, build_reference
from zoo.attention import KVCache
from zoo.build import build_model, compose_config
from zoo.kernel import math_attention, torch_attention

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"encoder_decoder": "vaswani_base", "decoder_only": "gpt2_small", "encoder_only": "bert_base"}
BACKENDS = ("torch", "math")
PARTS = ("models", "kernel", "decode", "suite", "mutation")
# Tiny geometry for smoke tests (--toy): the same code paths in seconds.
TOY = ["d_model=64", "heads=4", "d_ff=128", "vocab_size=512", "max_len=128"]
TARGETS = {"torch_vs_reference": 0.95, "decode_speedup": 5.0, "suite_seconds": 60.0, "first_failure_seconds": 2.0}
# Where the mutation catalog may live, and the function the benchmark calls:
#   first_failure_times() -> dict[str, float | None]
#   mutant name -> seconds until the suite's first failure on it (None: the mutant survived).
MUTATION_MODULES = ("tests.mutation_report", "properties.mutation_report", "mutation_report")
MUTATION_HOOK = "first_failure_times"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (a minute or two on a CPU)")
    p.add_argument("--toy", action="store_true", help="tiny geometry instead of the presets' (smoke tests)")
    p.add_argument("--device", default=default_device(), help="default: cuda if available, else cpu")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    p.add_argument("--lengths", default=None, help="sequence lengths (default 128,512; quick 64)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 8; quick 2)")
    p.add_argument("--layers", type=int, default=None, help="layers per stack (default 2; quick 1)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens to decode (default 256; quick 32)")
    p.add_argument("--prompt", type=int, default=8, help="prompt length for decoding")
    p.add_argument("--decode-batch", type=int, default=1, help="sequences decoded at once (default 1)")
    p.add_argument("--matmul-n", type=int, default=None, help="matmul size (default 4096; quick 1024)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time (default), or the process's CPU time: with --device cpu --threads 1 on a "
                        "machine shared with other work, it leaves out the time spent waiting for a core")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model families")
    p.add_argument("--out", default="bench/results.json", help="JSON output path ('' to skip)")
    args = p.parse_args(argv)
    quick = args.quick or args.toy
    args.lengths = [int(x) for x in (args.lengths or ("64" if quick else "128,512")).split(",")]
    args.batch = args.batch or (2 if quick else 8)
    args.layers = args.layers or (1 if quick else 2)
    args.new_tokens = args.new_tokens or (32 if quick else 256)
    args.matmul_n = args.matmul_n or (1024 if quick else 4096)
    args.dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    args.parts = args.parts.split(",")
    args.families = args.families.split(",")
    for name in args.parts:
        if name not in PARTS:
            p.error(f"--parts: unknown part {name!r} (allowed: {', '.join(PARTS)})")
    for name in args.families:
        if name not in FAMILIES:
            p.error(f"--families: unknown family {name!r} (allowed: {', '.join(FAMILIES)})")
    if args.clock == "cpu" and (args.device != "cpu" or args.threads != 1):
        p.error("--clock cpu needs --device cpu --threads 1 (CPU time of several threads is not a duration)")
    # Repeats: budget_s of measuring per cell, at least min_repeats rounds (the big cells get only those).
    args.timing = (dict(min_repeats=1, max_repeats=2, budget_s=0.1) if args.toy else
                   dict(min_repeats=2, max_repeats=5, budget_s=1.0) if args.quick else
                   dict(min_repeats=3, max_repeats=15, budget_s=6.0))
    args.timing["clock"] = args.clock
    return args


def overrides(family: str, args, *extra: str) -> list[str]:
    return [f"preset={FAMILIES[family]}", f"layers={args.layers}", "dropout=0", *(TOY if args.toy else []), *extra]


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied tensor is yielded once


def model_inputs(family: str, vocab_size: int, batch: int, length: int, device) -> tuple:
    tokens = lambda: torch.randint(1, vocab_size, (batch, length), device=device)  # noqa: E731
    return (tokens(), tokens()) if family == "encoder_decoder" else (tokens(),)


def zoo_call(family: str, model):
    if family == "encoder_only":  # hidden states and BERT's pooler, as BertModel returns both
        return lambda tokens: (lambda h: [h, model.pool(h)])(model(tokens))
    return lambda *inputs: [model(*inputs)]


def reference_call(family: str, model):
    if family == "decoder_only":
        return lambda tokens: [model(input_ids=tokens).logits]
    if family == "encoder_only":
        return lambda tokens: (lambda o: [o.last_hidden_state, o.pooler_output])(model(input_ids=tokens))
    return lambda src, tgt: [model(src, tgt)]


def forward_fn(model, call, inputs):
    def run():
        with torch.inference_mode():
            call(*inputs)
    return run


def training_fn(model, call, inputs):
    def run():
        sum(out.sum() for out in call(*inputs)).backward()
        model.zero_grad(set_to_none=True)
    return run


def bench_models(args, device, matmul: dict) -> list[dict]:
    cells = []
    for family in args.families:
        cfg = compose_config(overrides(family, args))
        for dtype in args.dtypes:
            dtype_name = str(dtype).removeprefix("torch.")
            torch.manual_seed(0)
            models = {f"zoo_{b}": build_model(overrides(family, args, f"attention={b}"), device=device, dtype=dtype)
                      for b in BACKENDS}
            models["reference"] = build_reference(family, cfg, device=device, dtype=dtype)
            counts = {name: count_parameters(m) for name, m in models.items()}
            if len(set(counts.values())) != 1:
                raise RuntimeError(f"{family}: parameter counts differ, geometry is not identical: {counts}")
            calls = {name: (reference_call if name == "reference" else zoo_call)(family, m)
                     for name, m in models.items()}
            for length in args.lengths:
                inputs = model_inputs(family, cfg.vocab_size, args.batch, length, device)
                tokens = sum(t.numel() for t in inputs)
                flops = forward_flops(family, batch=args.batch, seq_len=length, d_model=cfg.d_model,
                                      d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, layers=cfg.layers,
                                      pooler=family == "encoder_only")
                for mode, make, train in (("forward", forward_fn, False), ("forward+backward", training_fn, True)):
                    for m in models.values():
                        m.train(train)
                    fns = {name: make(models[name], calls[name], inputs)
                           for name in ("reference", "zoo_torch", "zoo_math")}
                    out = interleaved(fns, device, **args.timing)
                    seconds = out["seconds"]
                    cell = {"family": family, "reference": REFERENCE_NAMES[family], "seq_len": length,
                            "batch": args.batch, "dtype": dtype_name, "mode": mode, "tokens_per_call": tokens,
                            "parameters": counts["reference"], "repeats": out["repeats"],
                            "calls_per_sample": out["calls_per_sample"], "seconds": seconds,
                            "tokens_per_s": {k: tokens / s for k, s in seconds.items()},
                            "ratio": {k: seconds["reference"] / seconds[k] for k in ("zoo_torch", "zoo_math")},
                            "samples": out["samples"]}
                    if mode == "forward":
                        cell["flops_per_call"] = flops
                        cell["flops_per_s"] = {k: flops / s for k, s in seconds.items()}
                        peak = matmul[dtype_name]["flops_per_s"]
                        cell["matmul_utilization"] = {k: flops / s / peak for k, s in seconds.items()}
                    cells.append(cell)
                    print(format_model_row(cell), flush=True)
            del models, calls, fns
            gc.collect()
    return cells


def bench_kernel(args, device) -> list[dict]:
    cells = []
    heads, head_dim = (4, 16) if args.toy else (12, 64)
    for dtype in args.dtypes:
        for length in args.lengths:
            q, k, v = (torch.randn(args.batch, heads, length, head_dim, device=device).to(dtype) for _ in range(3))
            for causal in (False, True):
                def fn(kernel):
                    def run():
                        with torch.inference_mode():
                            kernel(q, k, v, is_causal=causal)
                    return run
                fns = {"sdpa": fn(F.scaled_dot_product_attention), "zoo_torch": fn(torch_attention),
                       "zoo_math": fn(math_attention)}
                timing = {**args.timing, "max_repeats": 4 * args.timing["max_repeats"]}  # cheap: more rounds
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


def generate_cached(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    cache = KVCache()
    token = model(prompt, cache=cache)[:, -1].argmax(-1, keepdim=True)
    out = [token]
    for _ in range(new_tokens - 1):
        token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1)


def generate_recompute(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    sequence = prompt
    for _ in range(new_tokens):
        token = model(sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, token], dim=1)
    return sequence[:, prompt.shape[1]:]


def bench_decode(args, device) -> list[dict]:
    cells = []
    for dtype in args.dtypes:
        torch.manual_seed(0)
        model = build_model(overrides("decoder_only", args, "attention=torch"), device=device, dtype=dtype).eval()
        if model.max_len < args.prompt + args.new_tokens:
            raise ValueError(f"max_len={model.max_len} < prompt {args.prompt} + {args.new_tokens} new tokens")
        prompt = torch.randint(1, model.vocab_size, (args.decode_batch, args.prompt), device=device)
        results = {}

        def fn(name, generate, n):
            def run():
                with torch.inference_mode():
                    results[name] = generate(model, prompt, n)
            return run
        for warm in (fn("cached", generate_cached, 8), fn("recompute", generate_recompute, 8)):
            warm()
        fns = {"cached": fn("cached", generate_cached, args.new_tokens),
               "recompute": fn("recompute", generate_recompute, args.new_tokens)}
        out = interleaved(fns, device, warmup=0, min_repeats=args.timing["min_repeats"], max_repeats=5,
                          budget_s=args.timing["budget_s"], clock=args.clock)
        s = out["seconds"]
        cell = {"model": "decoder_only (gpt2_small geometry)", "layers": args.layers, "backend": "torch",
                "dtype": str(dtype).removeprefix("torch."), "batch": args.decode_batch, "prompt": args.prompt,
                "new_tokens": args.new_tokens, "repeats": out["repeats"], "seconds": s,
                "tokens_per_s": {k: args.decode_batch * args.new_tokens / v for k, v in s.items()},
                "speedup": s["recompute"] / s["cached"],
                "same_tokens": bool(torch.equal(results["cached"], results["recompute"])),
                "samples": out["samples"]}
        cells.append(cell)
        print(f"decode {cell['dtype']:<8} {args.new_tokens} tokens: cached {s['cached']:.2f} s, "
              f"recompute {s['recompute']:.2f} s, speedup x{cell['speedup']:.1f}, "
              f"same tokens: {cell['same_tokens']}", flush=True)
        del model
        gc.collect()
    return cells


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pytest(*extra: str, timeout: float = 1800) -> dict:
    """Wall time of the suite in a subprocess, and its CPU time (all its processes, summed)."""
    command = [sys.executable, "-m", "pytest", "properties/", "-q", *extra]
    cpu_start, start = _children_cpu_seconds(), time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(command[2:]), "seconds": None, "cpu_seconds": None, "returncode": None,
                "summary": f"timed out after {timeout} s", "tests_ran": False}
    seconds, cpu_seconds = time.perf_counter() - start, _children_cpu_seconds() - cpu_start
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"command": " ".join(command[2:]), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "returncode": done.returncode, "summary": lines[-1] if lines else done.stderr.strip()[-200:],
            "tests_ran": done.returncode in (0, 1)}


def bench_suite() -> dict:
    result = {"default": run_pytest()}
    print(f"suite  pytest properties/: {fmt_seconds(result['default']['seconds'])} wall, "
          f"{fmt_seconds(result['default']['cpu_seconds'])} CPU  ({result['default']['summary']})", flush=True)
    if importlib.util.find_spec("xdist") is None:
        result["xdist"] = {"command": "pytest properties/ -n auto", "seconds": None, "returncode": None,
                           "summary": "pytest-xdist is not installed"}
    else:
        result["xdist"] = run_pytest("-n", "auto")
    print(f"suite  pytest properties/ -n auto: {fmt_seconds(result['xdist']['seconds'])} wall, "
          f"{fmt_seconds(result['xdist'].get('cpu_seconds'))} CPU  ({result['xdist']['summary']})", flush=True)
    return result


def mutation_report_first_failure_times(timeout: float = 1800) -> dict[str, float | None]:
    """Adapter for ``python -m properties.mutation_report`` (which has no MUTATION_HOOK): run its CLI in a
    subprocess on the broken entries of properties.catalog.CATALOG and read its JSON rows. Its time to
    the first failure is the sum of the test durations up to and including the first failing test
    (process start-up excluded); None when the entry was not caught."""
    names = subprocess.run([sys.executable, "-c", "from properties.catalog import CATALOG\n"
                            "print('\\n'.join(e.name for e in CATALOG))"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout.split("\n")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "mutation.json"
        only = [arg for name in names if name.strip() for arg in ("--only", name.strip())]
        done = subprocess.run([sys.executable, "-m", "properties.mutation_report", "--json", str(report), *only],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if not report.exists():
            raise RuntimeError(f"properties.mutation_report exited {done.returncode} without a report: "
                               f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        rows = [row for row in json.loads(report.read_text())["rows"] if row["broken"]]
    ran = [row for row in rows if row["status"] not in ("unavailable", "usage error")]
    if not ran:
        raise RuntimeError(f"no catalog entry ran: statuses {sorted({row['status'] for row in rows})}")
    return {row["name"]: row["time_to_first_failure_s"] for row in ran}


def bench_mutation(modules=MUTATION_MODULES, fallback: bool = True) -> dict:
    """Median time to the first failure over the mutation catalog: MUTATION_HOOK of the first module of
    ``modules`` that has it, else (fallback) the properties.mutation_report CLI, else not available."""
    source, hook, missing = None, None, []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            continue
        try:
            hook = getattr(importlib.import_module(name), MUTATION_HOOK, None)
        except Exception as exc:  # a catalog still being built must not cost the other results
            missing.append(f"{name} does not import ({type(exc).__name__}: {exc})")
            continue
        if hook is not None:
            source = name
            break
        missing.append(f"{name} has no {MUTATION_HOOK}()")
    if hook is None and fallback and "properties.mutation_report" in modules and \
            importlib.util.find_spec("properties.mutation_report") is not None:
        source, hook = "python -m properties.mutation_report (subprocess)", mutation_report_first_failure_times
    if hook is None:
        return {"available": False, "module": None,
                "reason": "; ".join(missing) or f"no mutation catalog yet: none of {', '.join(modules)} exists; "
                f"when one does, bench calls its {MUTATION_HOOK}() -> {{mutant: seconds or None}}"}
    start = time.perf_counter()
    try:
        times = hook()
    except Exception as exc:
        return {"available": False, "module": source, "reason": f"{type(exc).__name__}: {exc}"}
    caught = [t for t in times.values() if t is not None]
    return {"available": True, "module": source, "mutants": len(times), "caught": len(caught),
            "median_first_failure_seconds": statistics.median(caught) if caught else None,
            "max_first_failure_seconds": max(caught) if caught else None, "first_failure_seconds": times,
            "wall_seconds": time.perf_counter() - start}


def evaluate_targets(results: dict) -> list[dict]:
    out = []
    models = results.get("models") or []
    if models:
        worst = min(models, key=lambda c: c["ratio"]["zoo_torch"])
        missed = [f"{c['family']} L={c['seq_len']} {c['dtype']} {c['mode']}: x{c['ratio']['zoo_torch']:.2f}"
                  for c in models if c["ratio"]["zoo_torch"] < TARGETS["torch_vs_reference"]]
        out.append({"target": "zoo (torch kernel) >= 0.95x reference throughput, every model pair",
                    "value": round(worst["ratio"]["zoo_torch"], 3), "met": not missed, "missed": missed})
        math = [c["ratio"]["zoo_math"] for c in models]
        out.append({"target": "zoo (math kernel) vs reference: reported, no target",
                    "value": f"min x{min(math):.2f}, median x{statistics.median(math):.2f}", "met": None})
    kernel = results.get("kernel") or []
    if kernel:
        worst = min(c["ratio"]["zoo_torch"] for c in kernel)
        out.append({"target": "zoo torch kernel >= 0.95x F.scaled_dot_product_attention, every shape",
                    "value": round(worst, 3), "met": worst >= TARGETS["torch_vs_reference"]})
    decode = results.get("decode") or []
    if decode:
        worst = min(c["speedup"] for c in decode)
        out.append({"target": f"cached decoding >= 5x faster than recomputation ({decode[0]['new_tokens']} tokens)",
                    "value": round(worst, 2), "met": worst >= TARGETS["decode_speedup"]})
    suite = results.get("suite")
    if suite:
        run = suite["default"]
        ok = run.get("tests_ran") and run["seconds"] is not None
        out.append({"target": "pytest properties/ (default profile) <= 60 s wall",
                    "value": round(run["seconds"], 1) if ok else run["summary"],
                    "met": run["seconds"] <= TARGETS["suite_seconds"] if ok else None,
                    "note": f"{run['cpu_seconds']:.1f} s CPU; {run['summary']}" if ok else None})
    mutation = results.get("mutation")
    if mutation:
        value = mutation.get("median_first_failure_seconds")
        if not mutation["available"]:
            value, met = "not available", None
        elif value is None:  # nothing caught
            value, met = f"0/{mutation['mutants']} caught", False
        else:
            value, met = round(value, 3), value <= TARGETS["first_failure_seconds"]
        out.append({"target": "median time to first failure over the mutation catalog <= 2 s", "value": value,
                    "met": met, "note": f"{mutation['caught']}/{mutation['mutants']} caught; test time only, "
                                        f"start-up excluded" if mutation["available"] else mutation["reason"]})
    return out


def fmt_seconds(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f} s"


def format_model_row(c: dict) -> str:
    t = c["tokens_per_s"]
    util = c.get("matmul_utilization")
    extra = f"  util torch {util['zoo_torch']:.0%} ref {util['reference']:.0%}" if util else ""
    return (f"{c['family']:<16}{c['seq_len']:>5} {c['dtype']:<9}{c['mode']:<17}{t['reference']:>10,.0f}"
            f"{t['zoo_torch']:>10,.0f} x{c['ratio']['zoo_torch']:<6.2f}{t['zoo_math']:>10,.0f} "
            f"x{c['ratio']['zoo_math']:<6.2f}{c['repeats']:>3}{extra}")


MODEL_HEADER = (f"{'family':<16}{'L':>5} {'dtype':<9}{'mode':<17}{'ref tok/s':>10}{'torch':>10} {'ratio':<7}"
                f"{'math':>10} {'ratio':<7}{'n':>3}  forward FLOP/s / matmul FLOP/s")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    start = time.perf_counter()
    results: dict = {"machine": machine_info(device),
                     "settings": {"quick": args.quick, "toy": args.toy, "device": str(device),
                                  "dtypes": [str(d).removeprefix("torch.") for d in args.dtypes],
                                  "lengths": args.lengths, "batch": args.batch, "layers_per_stack": args.layers,
                                  "new_tokens": args.new_tokens, "prompt": args.prompt,
                                  "decode_batch": args.decode_batch, "threads": args.threads,
                                  "timing": {**args.timing, "method": f"{args.clock} clock, device synchronised, "
                                             "alternating rounds (ABC, CBA, ...), median per callable"},
                                  "parts": args.parts, "families": args.families}}
    print(f"device {device} ({results['machine']['device_name']}), torch {torch.__version__}, "
          f"{args.threads} threads, {args.clock} clock, "
          f"load average {results['machine'].get('load_average_at_start')}", flush=True)

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
        out = bench_mutation()
        print(f"mutation median time to first failure: {out.get('median_first_failure_seconds', 'n/a')} "
              f"({out.get('caught', 0)}/{out.get('mutants', 0)} caught) {out.get('reason', '')} "
              f"[{out['module']}]", flush=True)
        return out

    sections = {"models": models, "kernel": lambda: bench_kernel(args, device),
                "decode": lambda: bench_decode(args, device), "suite": bench_suite, "mutation": mutation}
    for name in args.parts:
        try:
            results[name] = sections[name]()
        except Exception as exc:  # keep what the other sections measured
            traceback.print_exc()
            results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            gc.collect()
        if args.out:
            write_json_atomic(args.out, results)
    results["targets"] = evaluate_targets(results)
    results["wall_seconds"] = time.perf_counter() - start
    if hasattr(os, "getloadavg"):
        results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print("\ntargets")
    for t in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "-"}[t["met"]]
        print(f"  [{verdict:^6}] {t['target']}: {t['value']}" + (f"  ({t['note']})" if t.get("note") else ""))
        for line in t.get("missed", []):
            print(f"           {line}")
    for name, error in results.get("errors", {}).items():
        print(f"  [ERROR ] {name}: {error}")
    print(f"wall time {results['wall_seconds']:.0f} s")
    if args.out:
        write_json_atomic(args.out, results)
        print(f"wrote {args.out}")
    return results
