"""Issue 26's checks on a GPU, in one command that fits in 8 minutes on an H100, and docs/benchmarks.md filled
from them.

    python -m bench.gpu_check                  # on CUDA: bench/results_gpu.json, docs/benchmarks.md's GPU section
    python -m bench.gpu_check --tiny --device cpu --doc /tmp/benchmarks.md    # the same steps at tiny sizes

Steps, in this order, each recorded in the JSON as soon as it ends (a run stopped halfway keeps what it measured):
    streams   the recipes' first data batch and initial weights, drawn with the same seed for the CPU and for the
              device: equal (zoo/tasks/train.py: seeded_model; the data are CPU draws)
    bench     ``python -m bench --device cuda --parts decode,models,kernel --dtypes bfloat16,float16`` (the command
              that did not finish in 120 s): decoding with the static cache, compiled, against recomputing and
              against Hugging Face's static-cache generate; the three families against Hugging Face and
              nn.Transformer; the kernels against SDPA. Each part's measuring has a budget, and --time-limit
              keeps it from beginning a cell late.
    recipes   ``python -m bench.train_targets reverse sort --seed 0,1,2 --device cuda``: the two presets' held-out
              exact match over three seeds on the device
Then the tables go into docs/benchmarks.md (``--doc``; ``--readme`` is the same option, its name from when the
section lived in README.md) between ``<!-- gpu-check:begin -->`` and ``<!-- gpu-check:end -->``.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import ROOT, machine_info, write_json_atomic
from bench.report import decode_markdown, markdown, train_seeds_markdown
from zoo.cli.arguments import Parser, check_outputs, device_problem, output_problem, seconds
from zoo.io.atomic import write_text

BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
TINY_BENCH = ["--toy", "--dtypes", "float32", "--lengths", "16", "--batch", "1", "--new-tokens", "4", "--prompt", "3",
              "--matmul-n", "64", "--families", "encoder_decoder"]
TINY_RECIPE = ["--set", "task.steps=6", "--set", "task.eval_every=6", "--set", "task.eval_batches=1",
               "--set", "task.checkpoint_every=6"]


def streams_check(device: str) -> dict:
    """Whether the reverse and sort presets start from the same initial weights on the CPU and on ``device``, and
    draw the same first batch whatever the global generators' state."""
    from zoo.config.composition import compose_config
    from zoo.tasks.train import family_of, fit_config_to_data, seeded_model

    out = {}
    for name in ("reverse", "sort"):
        cfg, data = fit_config_to_data(compose_config([f"experiment={name}"]))
        weights = {}
        for where in ("cpu", device):
            cfg.device = where
            weights[where] = {k: v.detach().cpu() for k, v in seeded_model(cfg).state_dict().items()}
        first = data.batch(family_of(cfg), 4, "train", 0)
        torch.manual_seed(12345)  # every device's global generator elsewhere: the batch must not change
        again = data.batch(family_of(cfg), 4, "train", 0)
        out[name] = {"same_initial_weights": all(torch.equal(weights["cpu"][k], weights[device][k])
                                                 for k in weights["cpu"]),
                     "same_first_batch": all(torch.equal(first[k], again[k]) for k in first),
                     "devices": ["cpu", device]}
    return out


def _run(command: list[str], timeout: float) -> dict:
    start = time.perf_counter()
    print("\n$ " + " ".join(command), flush=True)
    try:
        done = subprocess.run(command, cwd=ROOT, timeout=max(timeout, 1), check=False)
        status = done.returncode
    except subprocess.TimeoutExpired:
        status = "timed out"
    return {"command": " ".join(command[2:]), "status": status, "seconds": time.perf_counter() - start}


def gpu_section(results: dict) -> str:
    """The GPU section of docs/benchmarks.md, from a gpu_check JSON."""
    m = results["machine"]
    lines = [f"Measured by `python -m bench.gpu_check` on {results['measured_on']}: {m['device_name']}, torch "
             f"{m['torch']}, transformers {m.get('transformers')}, {m['usable_cores']} CPU cores; the whole check "
             f"took {results['seconds'] / 60:.1f} min"
             + ("" if not results.get("tiny") else " (**tiny sizes: a trial of the script, not a measurement**)")
             + ". Steps: " + ", ".join(f"{name} {step['seconds']:.0f} s (status {step['status']})"
                                       for name, step in results["steps"].items()) + ".", ""]
    streams = results.get("streams") or {}
    if streams:
        lines += ["Same seed, same start: " + "; ".join(
            f"`{name}` initial weights {'equal' if s['same_initial_weights'] else '**differ**'} on "
            f"{' and '.join(s['devices'])}, first batch {'equal' if s['same_first_batch'] else '**differs**'}"
            for name, s in streams.items()) + ".", ""]
    bench = results.get("bench") or {}
    if bench.get("decode"):
        lines += decode_markdown(bench["decode"])
    if bench:
        body = markdown({**bench, "decode": None, "targets": bench.get("targets")})
        lines += [line for line in body.splitlines()[2:]] + [""]  # its machine line is the one above
    seeds = train_seeds_markdown(results.get("recipes") or {})
    if seeds:
        lines += ["The recipes over three seeds on the device (held-out exact match, wall time):", "", *seeds]
    return "\n".join(lines).rstrip() + "\n"


def fill_section(path: Path, section: str) -> None:
    """Replace what lies between the gpu-check markers of the Markdown file at `path` with `section`."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    write_text(path, f"{head}{BEGIN}\n{section}{END}{tail}")


# --limit's least value: the recipes get 150 s, and the bench 100 s past its last cell and at least 60 s of cells.
MIN_LIMIT_S = 150.0 + 100.0 + 60.0


def _check_doc(p, path: str) -> None:
    """--doc (--readme): a file with the BEGIN ... END block, writable: refused now, not after the whole check."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        p.error(f"--doc {path}: cannot be read ({getattr(exc, 'strerror', None) or type(exc).__name__})")
    if BEGIN not in text or END not in text:
        p.error(f"--doc {path}: no {BEGIN} ... {END} block to fill ('' to skip it)")
    problem = output_problem(path)
    if problem:
        p.error(f"--doc {path}: cannot be written ({problem})")


def _beside(out: str, step: str) -> Path:
    """Where a step of the check writes its own results: beside --out, named after it (results_gpu_bench.json)."""
    return Path(out).with_name(f"{Path(out).stem}_{step}.json")


def main(argv=None) -> int:
    p = Parser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and a few training steps: a trial of the script")
    p.add_argument("--out", default="bench/results_gpu.json")
    p.add_argument("--doc", "--readme", dest="doc", default="docs/benchmarks.md",
                   help="the page whose GPU section is filled ('' to skip); --readme is the same option")
    p.add_argument("--limit", type=seconds(MIN_LIMIT_S, inclusive=True), default=450.0,
                   help=f"seconds for the whole check (default 450, at least {MIN_LIMIT_S:g}: the recipes' 150 s and "
                        f"the bench's 100 s after its last cell)")
    args = p.parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        p.error(f"--device {args.device}: {problem}")
    check_outputs(p, out=args.out)
    for written in (_beside(args.out, 'bench'), _beside(args.out, 'recipes')):   # the steps' own files, kept too
        problem = output_problem(str(written))
        if problem:
            p.error(f"--out {args.out}: the file {written} written beside it cannot be written ({problem}); "
                    f"nothing was run")
    if args.doc:
        _check_doc(p, args.doc)
    started = time.perf_counter()
    deadline = started + args.limit
    device = torch.device(args.device)
    results = {"machine": machine_info(device), "measured_on": datetime.date.today().isoformat(),
               "tiny": args.tiny, "steps": {}}

    def save():
        results["seconds"] = time.perf_counter() - started
        write_json_atomic(args.out, results)

    t = time.perf_counter()
    try:
        results["streams"] = streams_check(args.device)
        status = 0
    except Exception as exc:  # noqa: BLE001 -- report it and go on with the measurements
        results["streams_error"], status = f"{type(exc).__name__}: {exc}", 1
    results["steps"]["streams"] = {"status": status, "seconds": time.perf_counter() - t}
    save()

    bench_json = _beside(args.out, 'bench')
    # The bench gets what is left but 150 s for the recipes; it begins no cell in its last 100 s.
    bench_time = max(60.0, deadline - time.perf_counter() - 150)
    command = [sys.executable, "-m", "bench", "--device", args.device, "--parts", "decode,models,kernel",
               "--dtypes", "bfloat16,float16", "--out", str(bench_json), "--time-limit", f"{max(1.0, bench_time - 100):.0f}"]
    results["steps"]["bench"] = _run(command + (TINY_BENCH if args.tiny else []), bench_time)
    if bench_json.exists():
        results["bench"] = json.loads(bench_json.read_text())
    save()

    recipes_json = _beside(args.out, 'recipes')
    if recipes_json.exists():
        recipes_json.unlink()
    command = [sys.executable, "-m", "bench.train_targets", "reverse", "sort", "--seed", "0,1,2",
               "--device", args.device, "--out", str(recipes_json)]
    results["steps"]["recipes"] = _run(command + (TINY_RECIPE if args.tiny else []),
                                       max(30.0, deadline - time.perf_counter()))
    if recipes_json.exists():
        results["recipes"] = {"train_targets_seeds": json.loads(recipes_json.read_text()).get("train_targets_seeds")}
    save()

    section = gpu_section(results)
    print("\n" + section)
    if args.doc:
        fill_section(Path(args.doc), section)
        print(f"filled the GPU section of {args.doc}")
    print(f"gpu_check: {results['seconds']:.0f} s; wrote {args.out}")
    return 0 if all(step["status"] == 0 for step in results["steps"].values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
