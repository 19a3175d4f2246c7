"""Timing, FLOP counting and machine information shared by the benchmarks.

Timing is plain ``time.perf_counter`` around a device synchronisation (the same idea as
``torch.utils.benchmark``'s blocked_autorange, with the interleaving it lacks): each callable is
warmed up, then the callables of one comparison run in alternating order (A B C, C B A, ...) for
the same number of rounds, and each is summarised by its median. Comparing in the same rounds means that
a slow phase of a shared machine hits the zoo and the reference alike.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zoo.io.atomic import write_text

__all__ = ["CLOCKS", "PART_BUDGETS_S", "cell_timing", "default_device", "forward_flops", "interleaved",
           "machine_info", "matmul_flops_per_s", "out_of_time", "synchronize", "timing_device_problem",
           "write_json_atomic"]

# Seconds of measuring per part, shared by its cells: a cell gets part / cells, and never more than the run's
# per-cell budget (args.timing["budget_s"]). On a GPU, where every call takes milliseconds, these budgets are the
# run's duration: before them each cell had its own 6 s (4 x the rounds for the kernel part), and the 32 cells of
# `--parts models,kernel,decode` alone asked for more than 3 minutes of rounds (issue 26: it did not finish in 120 s).
# On a CPU a cell is slower than its share and gets its minimum rounds whatever the budget.
PART_BUDGETS_S = {"toy": {"models": 2.0, "kernel": 1.0, "decode": 1.0},
                  "quick": {"models": 12.0, "kernel": 4.0, "decode": 4.0},
                  "full": {"models": 40.0, "kernel": 12.0, "decode": 20.0}}


def cell_timing(args, part: str, cells: int) -> dict:
    """interleaved()'s keywords for one of the ``cells`` cells of ``part``: its share of the part's budget."""
    share = args.part_budgets_s[part] / max(cells, 1)
    return {**args.timing, "budget_s": min(args.timing["budget_s"], share)}


def out_of_time(args) -> bool:
    """Whether the run's --time-limit has passed: a part or cell not begun by then is not begun."""
    deadline = getattr(args, "deadline", None)
    return deadline is not None and time.monotonic() > deadline


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def timing_device_problem(name: str) -> str | None:
    """Why nothing can be timed on device ``name`` (None when it can): what zoo.cli.arguments.device_problem says, and the
    meta device, whose tensors hold no data: its 'timings' would be of nothing, recorded as if measured."""
    from zoo.cli.arguments import device_problem

    problem = device_problem(name)
    if problem is None and torch.device(name).type == "meta":
        return "the meta device holds no data: a benchmark on it would time nothing"
    return problem


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device``; CPU work is already done when a call returns."""
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    if backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(fn: Callable[[], object], device: torch.device, number: int = 1, clock: str = "wall") -> float:
    """Seconds per call, averaged over ``number`` back-to-back calls."""
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    for _ in range(number):
        fn()
    synchronize(device)
    return (now() - start) / number


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, *, warmup: int = 1,
                min_repeats: int = 3, max_repeats: int = 15, budget_s: float = 5.0,
                min_sample_s: float = 0.05, clock: str = "wall") -> dict:
    """Median seconds per call of each callable, measured in alternating rounds.

    One sample times ``number`` back-to-back calls, enough to last min_sample_s (1 for slow calls),
    so that a short call is not one scheduler time slice. The number of rounds is
    budget_s / (time of one round), clamped to [min_repeats, max_repeats]: big cells get few
    repeats, small ones many. With warmup=0 the first round is measured and kept (for calls too
    slow to run once just to warm up).

    clock="cpu" measures the process's CPU time instead of wall time: on a CPU shared with other
    work and with one torch thread, that leaves out the time spent waiting for a core.
    """
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    if warmup:
        for _ in range(warmup):
            round_s = sum(_time(fns[name], device, 1, clock) for name in names)
    else:  # the caller warmed up on a smaller problem: the first measured round sets the pace
        for name in names:
            samples[name].append(_time(fns[name], device, 1, clock))
        round_s = sum(s[0] for s in samples.values())
    number = 1 if warmup == 0 else max(1, math.ceil(min_sample_s / max(round_s / len(names), 1e-9)))
    repeats = max(min_repeats, min(max_repeats, int(budget_s / max(round_s * number, 1e-9))))
    for r in range(len(samples[names[0]]), repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(_time(fns[name], device, number, clock))
    return {"repeats": repeats, "calls_per_sample": number,
            "seconds": {name: statistics.median(s) for name, s in samples.items()},
            "samples": samples}


def forward_flops(family: str, *, batch: int, seq_len: int, d_model: int, d_ff: int, vocab_size: int,
                  layers: int, decoder_layers: int | None = None, pooler: bool = False) -> int:
    """Matmul FLOPs (a multiply-add = 2) of one forward pass; element-wise work is not counted.

    With T = batch * seq_len tokens per stack, d = d_model, f = d_ff, V = vocab_size, heads of any
    number (kv_heads = heads):
        a layer's projections      2 T (4 d^2 + 2 d f)        q, k, v, out; FFN up and down
        self-attention core        4 b L S d                  Q K^T and P V, the full L x S square
                                                              (causal masking is not subtracted)
        cross-attention            2 T_tgt 2 d^2 + 2 T_src 2 d^2 + 4 b L_tgt L_src d
        tied LM head               2 T d V                    decoder_only, encoder_decoder
        BERT pooler                2 b d^2                    encoder_only with pooler
    The sequence length is the same for source and target in the encoder-decoder benchmarks.
    ``tests/test_bench.py`` checks this against torch.utils.flop_counter on the math kernel.
    """
    b, length, d, f = batch, seq_len, d_model, d_ff
    tokens = b * length
    layer = 2 * tokens * (4 * d * d + 2 * d * f) + 4 * b * length * length * d
    if family == "decoder_only":
        return layers * layer + 2 * tokens * d * vocab_size
    if family == "encoder_only":
        return layers * layer + (2 * b * d * d if pooler else 0)
    if family == "encoder_decoder":
        cross = 2 * tokens * 2 * d * d + 2 * tokens * 2 * d * d + 4 * b * length * length * d
        dec = layers if decoder_layers is None else decoder_layers
        return layers * layer + dec * (layer + cross) + 2 * tokens * d * vocab_size
    raise ValueError(f"unknown family {family!r}")


def matmul_flops_per_s(n: int, dtype: torch.dtype, device: torch.device, *, budget_s: float = 3.0,
                       clock: str = "wall") -> dict:
    """The machine's dense matmul rate: torch.mm of two n x n matrices, median of repeats."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = interleaved({"mm": lambda: torch.mm(a, b)}, device, warmup=2, min_repeats=3, budget_s=budget_s,
                      clock=clock)
    seconds = out["seconds"]["mm"]
    return {"n": n, "repeats": out["repeats"], "seconds": seconds, "flops_per_s": 2 * n ** 3 / seconds}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        device_name = _cpu_model()
    else:
        device_name = device.type
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "usable_cores": usable,
        "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "device": str(device), "device_name": device_name,
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write to a temporary file in the same directory, then rename: readers never see half a file."""
    write_text(path, json.dumps(data, indent=2) + "\n")


ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"encoder_decoder": "vaswani_base", "decoder_only": "gpt2_small", "encoder_only": "bert_base"}
BACKENDS = ("torch", "math")
# Tiny geometry for smoke tests (--toy): the same code paths in seconds.
TOY = ["d_model=64", "heads=4", "d_ff=128", "vocab_size=512", "max_len=128"]


def fmt_seconds(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f} s"
