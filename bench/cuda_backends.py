"""The spec suite on CUDA: the zoo's parts, and PyTorch's SDPA with each backend forced: docs/kernels.md's CUDA table.

    python -m bench.cuda_backends                 # needs CUDA; prints the table, records bench/results.json "cuda"
    python -m bench.cuda_backends --write-docs    # and replaces the table between docs/kernels.md's cuda-table markers

Each row is one suite run as a user runs it (examples/torch_cuda_backends.py for the forced backends), with
--device cuda, every dtype the device computes in, forward and backward clauses, and --report-json: the row gives
the tests passed, failed and skipped, the clauses that failed, what the kernel declined (grouped, from the
coverage records: properties/kernel/coverage.py) and the wall time. On a machine without CUDA it exits with status 2
and one line, leaving the table as it is.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import ROOT

BACKENDS = "examples/torch_cuda_backends.py"
# (row name, pytest arguments after `pytest`): the zoo at every level, then SDPA as dispatched and each backend forced,
# each with the conventions docs/kernels.md says to declare for it ("What to declare for each of PyTorch's backends").
RUNS = [
    ("zoo (every level: math, torch, memory_efficient kernels; modules; models)", ["properties/"]),
    ("F.scaled_dot_product_attention (PyTorch's dispatch)",
     ["properties/kernel", "--kernel", "torch.nn.functional:scaled_dot_product_attention", "--finfo-min-rows", "masked",
      "--fully-masked", "any"]),
    ("flash (SDPBackend.FLASH_ATTENTION)", ["properties/kernel", "--kernel", f"{BACKENDS}:flash"]),
    ("memory-efficient (SDPBackend.EFFICIENT_ATTENTION)",
     ["properties/kernel", "--kernel", f"{BACKENDS}:efficient", "--finfo-min-rows", "masked"]),
    ("cuDNN (SDPBackend.CUDNN_ATTENTION)", ["properties/kernel", "--kernel", f"{BACKENDS}:cudnn", "--fully-masked", "any"]),
    ("math (SDPBackend.MATH)", ["properties/kernel", "--kernel", f"{BACKENDS}:math"]),
    ("Triton, FlashAttention-2 style (examples/triton_attention.py)",
     ["properties/kernel", "--kernel", "examples/triton_attention.py:attention"]),
]
START, END = "<!-- cuda-table -->", "<!-- /cuda-table -->"
TABLE_PAGE = "docs/kernels.md"  # the page whose cuda-table markers hold the table


def run(name: str, arguments: list[str], timeout: float = 3600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pytest", *arguments, "--device", "cuda", "-q", "-p", "no:cacheprovider",
                   "-W", "ignore", "--report-json", str(report)]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        rows = json.loads(report.read_text()) if report.exists() else []
    status = Counter(r["status"] for r in {r["nodeid"]: r for r in rows}.values())
    declined: Counter = Counter()
    for r in {r["nodeid"]: r for r in rows}.values():
        declined.update((r.get("coverage") or {}).get("reasons", {}))
    return {"name": name, "command": " ".join(["pytest", *arguments, "--device", "cuda"]),
            "returncode": done.returncode, "seconds": round(time.perf_counter() - start, 1),
            "passed": status["passed"], "failed": status["failed"] + status["error"], "skipped": status["skipped"],
            "failed_clauses": sorted({r["clause"] for r in rows if r["status"] in ("failed", "error")}),
            "declined": dict(declined.most_common(3)), "tail": done.stdout[-1500:]}


def table(results: list[dict], device: str) -> str:
    lines = [f"Measured on {device}:", "", "| subject | passed | failed | skipped | failing clauses | most declined | "
             "wall |", "|---|---|---|---|---|---|---|"]
    for r in results:
        declined = "; ".join(f"{reason[:60]} ({n})" for reason, n in r["declined"].items()) or "none"
        lines.append(f"| {r['name']} | {r['passed']} | {r['failed']} | {r['skipped']} | "
                     f"{', '.join(r['failed_clauses']) or 'none'} | {declined} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    import torch

    from bench.common import write_json_atomic
    from zoo.io.atomic import write_text

    parser = argparse.ArgumentParser(prog="python -m bench.cuda_backends", description=__doc__.splitlines()[0])
    # --write-readme: its name from when the table lived in README.md; the same option (issue 31 moved the table).
    parser.add_argument("--write-docs", "--write-readme", dest="write_docs", action="store_true",
                        help=f"replace the CUDA table in {TABLE_PAGE} with this run's")
    parser.add_argument("--out", default="bench/results.json", help="results JSON to merge into ('' to skip)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.cuda_backends: CUDA is not available here; the table needs a GPU", file=sys.stderr)
        return 2
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    results = []
    for name, arguments in RUNS:
        results.append(run(name, arguments))
        r = results[-1]
        print(f"{name}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped in {r['seconds']} s "
              f"{r['failed_clauses'] or ''}", flush=True)
    markdown = table(results, device)
    print(markdown)
    if args.out:
        path = ROOT / args.out
        recorded = json.loads(path.read_text()) if path.exists() else {}
        recorded["cuda"] = {"device": device, "runs": results}
        write_json_atomic(path, recorded)
    if args.write_docs:
        page = ROOT / TABLE_PAGE
        text = page.read_text(encoding="utf-8")
        pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
        write_text(page, pattern.sub(lambda _: f"{START}\n{markdown}\n{END}", text, count=1))
    return 0 if all(r["failed"] == 0 and r["returncode"] in (0, 5) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
