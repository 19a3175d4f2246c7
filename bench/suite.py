"""The cost of the spec suite (pytest properties/) and its time to the first failure over the catalog.

    python -m bench.suite                  # pytest properties/ (alone and -n auto) into bench/results.json "suite"
    python -m bench.suite --test-command   # the README's test command (`pytest`, what CI runs): "test_command"
    python -m bench.suite --plugin-cost    # what the installed plug-in costs an unrelated pytest run: "plugin_cost"
    python -m bench.suite --distributed    # pytest properties/ --world-size 2, three runs: "distributed"
    python -m bench.suite --recipes        # README's recipes, run as a user runs them: "recipes"

`--test-command` and `--recipes` also write the durations README states beside ``<!-- measured: KEY -->`` from the
figures of the same run (with the default ``--out``).

The durations README.md and docs/ state are checked against what these record (tests/test_readme_durations.py).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, fmt_seconds


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pytest(*extra: str, paths: tuple[str, ...] = ("properties/",), timeout: float = 1800) -> dict:
    """Wall time of pytest on `paths` in a subprocess (no paths: pyproject's testpaths, as the README's test
    command runs it), and its CPU time (all its processes, summed)."""
    command = [sys.executable, "-m", "pytest", *paths, "-q", "-rfE", *extra]
    cpu_start, start = children_cpu_seconds(), time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(command[2:]), "seconds": None, "cpu_seconds": None, "returncode": None,
                "summary": f"timed out after {timeout} s", "tests_ran": False}
    seconds, cpu_seconds = time.perf_counter() - start, children_cpu_seconds() - cpu_start
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"command": " ".join(command[2:]), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "returncode": done.returncode, "summary": lines[-1] if lines else done.stderr.strip()[-200:],
            "failed": [line.split(" ", 1)[1] for line in lines if line.startswith(("FAILED ", "ERROR "))],
            "tests_ran": done.returncode in (0, 1)}


def readme_test_arguments() -> list[str]:
    """The pytest arguments of README's test command (the block after ``<!-- test-command -->`` that .ci/run
    runs): what follows its last ``pytest``, e.g. ``-n auto --maxprocesses 8``."""
    import shlex
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("<!-- test-command -->")
    block = lines[start + 2:lines.index("```", start + 2)]
    words = shlex.split(" ".join(block))
    if "pytest" not in words:
        raise ValueError("README's test command runs no pytest")
    return words[len(words) - words[::-1].index("pytest"):]


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


def bench_distributed(runs: int = 3, world_size: int = 2) -> dict:
    """The distributed level at its default profile on the zoo's context-parallel kernels (ring, ulysses,
    allgather_kv on ``world_size`` gloo ranks, started once per run): ``runs`` runs, each one's wall and CPU time (the
    ranks' included: they are children of the run), and their medians."""
    samples = [run_pytest("--world-size", str(world_size), "-p", "no:cacheprovider") for _ in range(runs)]
    for sample in samples:
        print(f"distributed  {sample['command']}: {fmt_seconds(sample['seconds'])} wall, "
              f"{fmt_seconds(sample['cpu_seconds'])} CPU  ({sample['summary']})", flush=True)
    ran = [s for s in samples if s["tests_ran"] and s["seconds"] is not None]
    return {"command": samples[0]["command"], "runs": runs,
            "seconds": [round(s["seconds"], 2) for s in ran], "cpu_seconds": [round(s["cpu_seconds"], 2) for s in ran],
            "seconds_median": statistics.median(s["seconds"] for s in ran) if ran else None,
            "cpu_seconds_median": statistics.median(s["cpu_seconds"] for s in ran) if ran else None,
            "returncode": next((s["returncode"] for s in samples if s["returncode"] != 0), 0),
            "summary": samples[-1]["summary"], "tests_ran": len(ran) == runs}


UNRELATED_TEST = "def test_one():\n    assert 1 + 1 == 2\n"


def bench_plugin_cost(runs: int = 7) -> dict:
    """The CPU time (user + sys of the child) of an unrelated one-test pytest run in an empty temporary directory, with
    the suite's plug-in loaded as pytest loads it everywhere (its entry point) and with ``-p no:properties.plugin``:
    ``runs`` runs of each, interleaved, and their medians. What the installed package costs every other project's
    test run (tests/test_plugin_cost.py checks what it imports there)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_one.py"]
    samples: dict[str, list[float]] = {"with_plugin": [], "without_plugin": []}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "test_one.py").write_text(UNRELATED_TEST)
        for _ in range(runs):
            for key, extra in (("with_plugin", []), ("without_plugin", ["-p", "no:properties.plugin"])):
                start = children_cpu_seconds()
                subprocess.run([*command, *extra], cwd=tmp, capture_output=True, text=True, timeout=300, check=True)
                samples[key].append(children_cpu_seconds() - start)
    medians = {key: statistics.median(values) for key, values in samples.items()}
    print(f"an unrelated one-test pytest run: {medians['with_plugin']:.2f} s CPU with the plug-in, "
          f"{medians['without_plugin']:.2f} s without (medians of {runs}; difference "
          f"{medians['with_plugin'] - medians['without_plugin']:+.2f} s)", flush=True)
    return {"command": " ".join(command[2:]) + "  (and with -p no:properties.plugin)", "runs": runs,
            **{key: {"cpu_seconds_median": medians[key], "cpu_seconds": [round(v, 3) for v in samples[key]]}
               for key in samples},
            "difference_cpu_seconds": medians["with_plugin"] - medians["without_plugin"]}


def mutation_report_first_failure_times(timeout: float = 1800, every: int = 1) -> dict[str, float | None]:
    """Adapter for ``python -m properties.catalog.mutation_report`` (which has no MUTATION_HOOK): run its CLI in a
    subprocess on the broken entries of properties.catalog.CATALOG and read its JSON rows. Its time to
    the first failure is the sum of the test durations up to and including the first failing test
    (process start-up excluded); None when the entry was not caught. every=N: one entry in N, in catalog order."""
    names = subprocess.run([sys.executable, "-c", ("from properties.catalog import CATALOG\n"
                                                   "print('\\n'.join(e.name for e in CATALOG))")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout.split("\n")
    names = [name for name in names if name.strip()][::every]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "mutation.json"
        only = [arg for name in names if name.strip() for arg in ("--only", name.strip())]
        done = subprocess.run([sys.executable, "-m", "properties.catalog.mutation_report", "--json", str(report), *only],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        if not report.exists():
            raise RuntimeError(f"properties.catalog.mutation_report exited {done.returncode} without a report: "
                               f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        rows = [row for row in json.loads(report.read_text())["rows"] if row["broken"]]
    ran = [row for row in rows if row["status"] not in ("unavailable", "usage error")]
    if not ran:
        raise RuntimeError(f"no catalog entry ran: statuses {sorted({row['status'] for row in rows})}")
    return {row["name"]: row["time_to_first_failure_s"] for row in ran}


def bench_mutation(every: int = 1) -> dict:
    """Median time to the first failure over the mutation catalog (one entry in ``every``), from its report's JSON
    rows."""
    start = time.perf_counter()
    try:
        # every=1 calls it without the keyword, as it always was (a replacement may not take it).
        times = mutation_report_first_failure_times(every=every) if every > 1 else \
            mutation_report_first_failure_times()
    except Exception as exc:  # noqa: BLE001 -- a broken catalog run must not cost the other results
        return {"available": False, "module": "properties.catalog.mutation_report",
                "reason": f"{type(exc).__name__}: {exc}"}
    caught = [t for t in times.values() if t is not None]
    return {"available": True, "module": "properties.catalog.mutation_report", "mutants": len(times), "every": every,
            "caught": len(caught),
            "median_first_failure_seconds": statistics.median(caught) if caught else None,
            "max_first_failure_seconds": max(caught) if caught else None, "first_failure_seconds": times,
            "wall_seconds": time.perf_counter() - start}


RECIPE_KERNEL = "examples/my_kernel.py"


def bench_recipes() -> dict:
    """README's recipes as a user runs them, from a directory of their own beside the clone: the kernel recipe
    (``pytest --pyargs properties --kernel my.py:attention`` on a copy of examples/my_kernel.py), the model recipe
    (``pytest --pyargs properties --model my_model.py:make`` on README's my_model.py; needs transformers) and the
    zoo recipe's ``task=verify``. Wall and CPU seconds and pytest's summary line of each."""
    import re
    import shutil
    readme = (ROOT / "README.md").read_text()
    my_model = re.search(r"<!-- recipe: my_model.py -->\n```python\n(.*?)```", readme, re.S).group(1)
    runs = {"kernel": [sys.executable, "-m", "pytest", "--pyargs", "properties", "-q", "-p", "no:cacheprovider",
                       "--kernel", "my.py:attention"],
            "model": [sys.executable, "-m", "pytest", "--pyargs", "properties", "-q", "-p", "no:cacheprovider",
                      "--model", "my_model.py:make"],
            "zoo_verify": [sys.executable, "-m", "zoo", "model=decoder_only", "pos=rotary", "ffn=swiglu",
                           "norm=rmsnorm", "kv_heads=2", "task=verify"]}
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ROOT / RECIPE_KERNEL, Path(tmp) / "my.py")
        (Path(tmp) / "my_model.py").write_text(my_model)
        for name, command in runs.items():
            if name == "model" and importlib.util.find_spec("transformers") is None:
                result[name] = {"seconds": None, "summary": "transformers is not installed (pip install -e '.[hf]')"}
                continue
            cpu_start, start = children_cpu_seconds(), time.perf_counter()
            done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=1800, check=False)
            lines = [line for line in done.stdout.splitlines() if line.strip()]
            summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line), "")
            result[name] = {"command": " ".join(command[2:] if command[1] == "-m" else command),
                            "seconds": time.perf_counter() - start, "cpu_seconds": children_cpu_seconds() - cpu_start,
                            "returncode": done.returncode, "summary": summary or done.stderr.strip()[-200:]}
            print(f"recipe {name}: {fmt_seconds(result[name]['seconds'])} wall, "
                  f"{fmt_seconds(result[name]['cpu_seconds'])} CPU ({result[name]['summary']})", flush=True)
    return result


def stated(seconds: float) -> str:
    """A duration as README states it: whole seconds under two minutes, whole minutes above."""
    return f"{round(seconds)} s" if seconds < 120 else f"{round(seconds / 60)} min"


def write_readme_durations(results: dict, path: Path = ROOT / "README.md") -> list[str]:
    """Rewrite each bold duration of README that names a record of ``results`` (``**N min** <!-- measured: KEY
    -->``, KEY a dotted path) from that record, atomically; the changes, as ``KEY: old -> new``."""
    import re
    from zoo.io.atomic import write_text
    pattern = re.compile(r"\*\*(\d+(?:\.\d+)? (?:s|min|h))\*\*( <!-- measured: ([\w.\-]+) -->)")
    changes = []

    def rewrite(match):
        node = results
        for part in match.group(3).split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, (int, float)) or node <= 0:
            return match.group(0)
        new = stated(float(node))
        if new != match.group(1):
            changes.append(f"{match.group(3)}: {match.group(1)} -> {new}")
        return f"**{new}**{match.group(2)}"
    text = path.read_text()
    updated = pattern.sub(rewrite, text)
    if updated != text:
        write_text(path, updated)
    return changes


def bench_test_command() -> dict:
    """README's test command, run once from the repository root."""
    measured = run_pytest(*readme_test_arguments(), paths=(), timeout=3600)
    print(f"pytest: {fmt_seconds(measured['seconds'])} wall, {fmt_seconds(measured['cpu_seconds'])} CPU "
          f"({measured['summary']})", flush=True)
    return measured


# What a run measures instead of the spec suite: the option, the key of results.json it is recorded under, what it
# measures (the option's help) and the function that measures it.
MEASUREMENTS = (
    ("--test-command", "test_command", "the README's test command (its pytest with its arguments, from the repository "
                                       "root: every test CI runs)", bench_test_command),
    ("--plugin-cost", "plugin_cost", "what the suite's plug-in costs an unrelated one-test pytest run (CPU time, with "
                                     "and without it)", bench_plugin_cost),
    ("--recipes", "recipes", "README's recipes as a user runs them (kernel, model, the zoo's task=verify)",
     bench_recipes),
    ("--distributed", "distributed", "the distributed level (pytest properties/ --world-size 2, the zoo's "
                                     "context-parallel kernels on 2 gloo ranks) three times", bench_distributed),
)


def main(argv=None) -> int:
    import argparse
    import datetime
    import os

    from bench.common import write_json_atomic

    parser = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.splitlines()[0])
    instead = parser.add_mutually_exclusive_group()
    for option, key, what, _ in MEASUREMENTS:
        instead.add_argument(option, dest="key", action="store_const", const=key,
                             help=f"measure {what} instead of the spec suite; recorded under \"{key}\"")
    parser.add_argument("--out", default="bench/results.json", help="results JSON to merge into ('' to skip)")
    args = parser.parse_args(argv)
    key = args.key or "suite"
    measure = {k: fn for _, k, _, fn in MEASUREMENTS}.get(key, bench_suite)
    measured = measure()
    if key != "suite":   # when and under what load (the suite's record carries its machine elsewhere)
        measured["measured_on"] = datetime.date.today().isoformat()
        if hasattr(os, "getloadavg"):
            measured["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        results = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                results = json.load(f)
        results[key] = measured
        if key in ("suite", "distributed") and "targets" in results:  # their targets are judged on the new run
            from bench.targets import evaluate_targets
            results["targets"] = evaluate_targets(results)
        write_json_atomic(args.out, results)
        print(f"merged into {args.out} under {key!r}")
        if Path(args.out).resolve() == (ROOT / "bench" / "results.json").resolve():
            for change in write_readme_durations(results):
                print(f"README.md: {change}")
    if key == "plugin_cost":   # every run passed (check=True)
        return 0
    return 0 if all(run.get("returncode") in (0, None) for run in
                    ([measured] if key in ("test_command", "distributed") else measured.values())
                    if isinstance(run, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
