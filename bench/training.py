"""Peak memory and time of one attention training step: forward + backward of the kernel alone.

Backends: the zoo's ``memory_efficient`` and ``math`` kernels (``zoo.nn.kernel.KERNELS``) and ``torch``
(``F.scaled_dot_product_attention``). Inputs q, k, v of shape (1, 8, L, 64), float32, requires_grad; no mask,
not causal, no dropout. One step is ``kernel(q, k, v).backward(grad_out)`` with a fixed random grad_out.

Peak memory of each (backend, L) is measured in a fresh process, so that no earlier cell's high-water mark or
allocator state can hide or inflate it: forked from a multiprocessing fork server that has imported torch and the
zoo and run nothing else (the processes of one L run at the same time when their predicted memory fits: the
measurements are per process). In that process the inputs are allocated and one small warm-up step (L = 256)
has run before the measured step, so that one-time initialisation (thread pools, lazily loaded kernels, code
pages) is not counted:

  cuda  ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus
        ``memory_allocated()`` just before the step: the most bytes the step's tensors (activations saved for
        the backward, temporaries, output, gradients) held at once, inputs excluded.
  cpu   PyTorch keeps no peak statistic on the CPU, so the operating system's: the process's resident-set
        high-water mark (VmHWM in /proc/self/status, the number getrusage reports as ru_maxrss, which cannot be
        reset). It is reset to the current RSS just before the step (writing 5 to /proc/self/clear_refs) and read after it; the
        kernel raises it whenever the RSS grows, so VmHWM after the step minus the RSS before it is the
        largest growth of the process's resident memory during the step.

        RSS counts what the allocator keeps, not only live tensors, so the process first fixes glibc's mmap
        threshold at 64 KiB (mallopt(M_MMAP_THRESHOLD), as MALLOC_MMAP_THRESHOLD_=65536 would): every buffer of 64
        KiB or more is then its own mapping, returned to the system when freed, and the RSS follows the live
        tensors. With glibc's default (a threshold that grows up to 32 MiB), freed buffers under 32 MiB stay in a
        fragmented heap and the memory-efficient kernel's (L x 128) score blocks (16 MiB each at L = 4096) pile up:
        a one-off measurement in the same way on the project's 2-core CPU gave 74 MiB at L = 1024 and 624 MiB at L =
        4096 with the default, against 30 and 121 MiB with the fixed threshold. Where /proc/self/clear_refs is
        missing (not Linux), the growth of ru_maxrss over the step is reported, a lower bound that is None when the
        step did not raise it.

Time: in the bench process, ``bench.common.interleaved`` over the backends of one L (one warm-up round at that
L, then alternating rounds, median per backend).

Before each (backend, L) the previous L's measurement of that backend is extrapolated quadratically (peak and
step time x (L / L_prev)^2, the math kernel's growth, an overestimate for the others): a cell predicted to need
more than 80% of the available memory, or more than MAX_STEP_SECONDS per step, is skipped and says why.
"""
from __future__ import annotations

import ctypes
import gc
import math
import multiprocessing
import resource
import sys

import torch

from bench.common import interleaved

BACKENDS = ("memory_efficient", "math", "torch")
GEOMETRY = {"batch": 1, "heads": 8, "head_dim": 64}
DTYPE = torch.float32
WARMUP_LENGTH = 256
MMAP_THRESHOLD = 64 * 1024  # bytes; see the module docstring
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MAX_STEP_SECONDS = 180.0
MEMORY_FRACTION = 0.8
LINEAR_EXPONENT_TARGET = 1.25  # memory_efficient: peak ∝ L^x with x <= this between the smallest and largest L

MEMORY_METHODS = {
    "cuda_max_memory_allocated": "torch.cuda.max_memory_allocated() during the step minus memory_allocated() "
                                 "before it (inputs excluded), fresh process per cell",
    "rss_high_water": "growth of the process's resident memory during the step (VmHWM reset just before it, "
                      "minus the RSS then; inputs allocated before), fresh process per cell, glibc mmap "
                      "threshold fixed at 64 KiB so that freed tensors leave the RSS",
    "rss_high_water_own_malloc": "growth of the process's resident memory during the step (VmHWM reset just "
                                 "before it, minus the RSS then; inputs allocated before), fresh process per cell, "
                                 "with the allocator's own policy (no mallopt): freed memory it keeps counts",
    "ru_maxrss_growth": "growth of getrusage ru_maxrss over the step, fresh process per cell (a lower bound)",
}


def make_step(backend: str, length: int, device: torch.device):
    """A callable running one forward + backward of ``backend`` at sequence length ``length``."""
    from zoo.nn.kernel import KERNELS
    kernel = KERNELS[backend]
    shape = (GEOMETRY["batch"], GEOMETRY["heads"], length, GEOMETRY["head_dim"])
    q, k, v = (torch.randn(shape, device=device, dtype=DTYPE, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=DTYPE)

    def step():
        for t in (q, k, v):
            t.grad = None
        kernel(q, k, v, is_causal=False).backward(grad_out)
    return step


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # "VmRSS:  123456 kB"
    raise KeyError(key)


def _ru_maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def measure_peak(backend: str, length: int, device: torch.device) -> dict:
    """Peak memory of one step, in this process (meant to be a fresh one: see the module docstring)."""
    make_step(backend, min(length, WARMUP_LENGTH), device)()  # one-time initialisation is not the step's
    step = make_step(backend, length, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return {"peak_bytes": torch.cuda.max_memory_allocated(device) - before,
                "memory_method": "cuda_max_memory_allocated"}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS (Linux >= 4.0)
        before = _proc_status_bytes("VmRSS")
    except OSError:
        before = _ru_maxrss_bytes()
        step()
        after = _ru_maxrss_bytes()
        return {"peak_bytes": after - before if after > before else None, "memory_method": "ru_maxrss_growth"}
    step()
    return {"peak_bytes": _proc_status_bytes("VmHWM") - before, "rss_before_bytes": before,
            "memory_method": "rss_high_water"}


def _fix_mmap_threshold() -> bool:
    """glibc: serve every allocation of MMAP_THRESHOLD bytes or more by its own mapping (unmapped when freed).

    Setting M_MMAP_THRESHOLD also turns off glibc's dynamic threshold (mallopt(3)). False where there is no
    mallopt (not glibc): the RSS then includes what that allocator keeps.
    """
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def _cell(spec: dict, conn) -> None:
    """The body of a measuring process: see measure_peak."""
    fixed = _fix_mmap_threshold()
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    found = measure_peak(spec["backend"], spec["length"], torch.device(spec["device"]))
    if found["memory_method"] == "rss_high_water" and not fixed:
        found["memory_method"] = "rss_high_water_own_malloc"
    conn.send({**found, "mmap_threshold_bytes": MMAP_THRESHOLD if fixed else None})
    conn.close()


_context = None


def _processes():
    """Fresh processes forked from a server that has imported torch and the zoo and run nothing else: a cell
    costs a fork, not a Python start and ``import torch``. (Forking the bench process itself is not safe: its
    thread pools are running.)"""
    global _context
    if _context is None:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        _context = multiprocessing.get_context(method)
        if method == "forkserver":
            # what a first step would import (symbolic_shapes: sympy, half a second): imports only, no threads
            _context.set_forkserver_preload(["bench.training", "zoo.nn.kernel", "torch.fx.experimental.symbolic_shapes"])
    return _context


def peaks_in_subprocesses(backends: list[str], length: int, device: torch.device, threads: int,
                          together: bool) -> dict[str, dict | Exception]:
    """Each backend's measure_peak in its own fresh process; with together=True the processes run at once.

    Running them at once changes no measurement (VmHWM, and CUDA's peak statistic, are per process), but
    their sum of memory has to fit, which the caller checks. A process that dies (killed for memory, say)
    gives a RuntimeError in place of its result.
    """
    context, running, found = _processes(), {}, {}

    def finish(backend):
        child, conn = running.pop(backend)
        try:
            found[backend] = conn.recv()
        except EOFError:  # it died without an answer
            found[backend] = None
        child.join()
        conn.close()
        if found[backend] is None or child.exitcode != 0:
            found[backend] = RuntimeError(f"the measuring process exited with status {child.exitcode}")

    for backend in backends:
        conn, child_conn = context.Pipe(duplex=False)
        spec = {"backend": backend, "length": length, "device": str(device), "threads": threads}
        child = context.Process(target=_cell, args=(spec, child_conn), name=f"bench-training-{backend}-{length}")
        child.start()
        child_conn.close()  # so that recv() sees EOF if the child dies
        running[backend] = (child, conn)
        if not together:
            finish(backend)
    for backend in list(running):
        finish(backend)
    return found


def available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def predicted_peak(previous: dict | None, length: int) -> float:
    """The same backend's previous peak x (L / L_prev)^2; 0 when unknown."""
    if previous is None or not previous.get("peak_bytes"):
        return 0.0
    return previous["peak_bytes"] * (length / previous["length"]) ** 2


def skip_reason(previous: dict | None, length: int, device: torch.device) -> str | None:
    """Why a cell is not run, from the quadratic extrapolation of the same backend's previous length."""
    if previous is None:
        return None
    growth = (length / previous["length"]) ** 2
    if previous.get("peak_bytes") is not None:
        need, free = predicted_peak(previous, length), available_bytes(device)
        if free is not None and need > MEMORY_FRACTION * free:
            return f"skipped: would need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    if previous.get("seconds") is not None and previous["seconds"] * growth > MAX_STEP_SECONDS:
        return f"skipped: a step would take ~{previous['seconds'] * growth / 60:.0f} min"
    return None


def growth(cells: list[dict]) -> dict:
    """Per backend: peak at the largest measured L over peak at the smallest, and the exponent x of L^x."""
    out = {}
    for backend in BACKENDS:
        measured = [c for c in cells if c["backend"] == backend and c.get("peak_bytes")]
        if len(measured) < 2:
            continue
        first, last = measured[0], measured[-1]
        length_ratio, peak_ratio = last["length"] / first["length"], last["peak_bytes"] / first["peak_bytes"]
        out[backend] = {"from_length": first["length"], "to_length": last["length"], "length_ratio": length_ratio,
                        "peak_ratio": peak_ratio, "exponent": math.log(peak_ratio) / math.log(length_ratio)}
    return out


def bench_training(args, device: torch.device) -> dict:
    cells, previous = [], {}
    for length in args.train_lengths:
        ran, row = {}, []
        for backend in BACKENDS:
            row.append({"backend": backend, "length": length,
                        "shape": [GEOMETRY["batch"], GEOMETRY["heads"], length, GEOMETRY["head_dim"]],
                        "skipped": skip_reason(previous.get(backend), length, device)})
        todo = [c["backend"] for c in row if c["skipped"] is None]
        free, need = available_bytes(device), sum(predicted_peak(previous.get(b), length) for b in todo)
        together = free is None or need <= MEMORY_FRACTION * free  # else one after the other
        found = peaks_in_subprocesses(todo, length, device, args.threads, together)
        for cell in row:
            result = found.get(cell["backend"])
            if isinstance(result, Exception):
                cell["skipped"] = f"failed: {result}"
            elif result is not None:
                cell.update(result)
                ran[cell["backend"]] = cell
        cells += row
        if ran:
            steps = {backend: make_step(backend, length, device) for backend in ran}
            out = interleaved(steps, device, warmup=1, **args.timing)
            del steps
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # leave the next L's subprocesses the memory this process cached
            for backend, cell in ran.items():
                cell.update(seconds=out["seconds"][backend], samples=out["samples"][backend],
                            repeats=out["repeats"], calls_per_sample=out["calls_per_sample"])
            previous.update(ran)
        for cell in cells[-len(BACKENDS):]:
            if cell["skipped"]:
                print(f"training {cell['backend']:<16} L={length:<5} {cell['skipped']}", flush=True)
            else:
                peak = "n/a" if cell["peak_bytes"] is None else f"{cell['peak_bytes'] / 2**20:10,.1f} MiB"
                print(f"training {cell['backend']:<16} L={length:<5} peak {peak}  "
                      f"step {cell['seconds'] * 1e3:10,.1f} ms  ({cell['repeats']} rounds)", flush=True)
    methods = sorted({c["memory_method"] for c in cells if c.get("memory_method")})
    return {**GEOMETRY, "dtype": str(DTYPE).removeprefix("torch."), "is_causal": False, "attn_mask": None,
            "lengths": list(args.train_lengths), "threads": args.threads, "clock": args.timing["clock"],
            "memory_method": "; ".join(MEMORY_METHODS[m] for m in methods), "cells": cells,
            "growth": growth(cells)}
