"""The model clauses over many models, as one table: ``python -m properties.adapters.conformance``.

    python -m properties.adapters.conformance [--jobs 2] [--out DIR] [--factories FILE] [--only NAME ...]
                                              [--long N] [-- PYTEST_OPTION ...]

For every factory of FILE (default: the repository's examples/conformance.py; every public top-level
function is one) it runs, ``--jobs`` at a time, in its own process::

    python -m pytest <properties> -m model -q -p no:cacheprovider --model FILE:NAME --report-json DIR/json/NAME.json

and writes DIR/conformance.md (one row per model, one column per clause: pass, skip or FAIL, with the
reasons as numbered notes under the table) and DIR/conformance.json (every record, by model). Each factory runs a
second time with ``CONFORMANCE_MAX_LEN=N`` in its environment (``--long N``, default 2048; 0: not at all): a
factories file that reads it builds its models with max_len N (examples/conformance.py does), so that the long
draws of MODEL-SHIFT, MODEL-WINDOW and MODEL-KV-CACHE reach positions past 256 and 1024; the table's column
"max_len N" gives that run's verdict over every clause. The exit status is 1 when any clause failed or a run did
not finish, else 0.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import properties

SUITE = Path(properties.__file__).resolve().parent
DEFAULT_FACTORIES = SUITE.parent / "examples" / "conformance.py"


def factories(path: Path) -> list[str]:
    """The public top-level functions of `path`, in order (read without importing it)."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]


LENGTH_VARIABLE = "CONFORMANCE_MAX_LEN"


def run_one(path: Path, name: str, out: Path, timeout: float, extra: list[str], length: int = 0) -> dict:
    """One suite run of factory ``name``; ``length``: with CONFORMANCE_MAX_LEN=length in its environment."""
    report = out / "json" / (f"{name}@{length}.json" if length else f"{name}.json")
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", str(SUITE), "-m", "model", "-q", "-p", "no:cacheprovider",
               "--model", f"{path}:{name}", "--report-json", str(report), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models; the runs share the machine
    env.pop(LENGTH_VARIABLE, None)
    if length:
        env[LENGTH_VARIABLE] = str(length)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail, code = [line for line in lines if line.startswith(("ERROR", "E "))][:1] or lines[-1:], proc.returncode
    except subprocess.TimeoutExpired:
        tail, code = [f"timed out after {timeout:.0f} s"], None
    seconds = round(time.perf_counter() - start, 1)
    records = json.loads(report.read_text()) if report.is_file() else []
    error = "" if records else (tail[0] if tail else f"exit status {code}")
    return {"model": name, "max_len": length or None, "seconds": seconds, "exit_status": code, "error": error,
            "records": records}


def _short(text: str, width: int) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[: width - 1] + "…"


def cell(records: list[dict], notes: dict[str, int]) -> str:
    """pass / skip / FAIL for one model and clause, over the clause's tests; reasons become numbered notes."""
    def note(text: str) -> str:
        return f"[{notes.setdefault(text, len(notes) + 1)}]"
    failed = [r for r in records if r["status"] in ("failed", "error")]
    if failed:
        return "FAIL " + " ".join(sorted({note(_short(f"{r['nodeid'].split('::')[-1]}: {r['message']}", 220))
                                          for r in failed}))
    skipped = [r for r in records if r["status"] == "skipped"]
    reasons = " ".join(sorted({note(_short(r["message"], 90)) for r in skipped}))
    if len(skipped) == len(records):
        return f"skip {reasons}"
    # A pass in the model's own precision because the float64 twin departs (properties/model/twin.py) says so.
    noted = " ".join(sorted({note(_short(r["note"], 220)) for r in records if r.get("note")}))
    passed = f"pass {noted}" if noted else "pass"
    return f"{passed}, skip {reasons}" if skipped else passed


def verdict(result: dict, notes: dict[str, int]) -> str:
    """One cell for a whole run: pass, FAIL with the failed tests as numbered notes, or no report."""
    def note(text: str) -> str:
        return f"[{notes.setdefault(_short(text, 220), len(notes) + 1)}]"
    if result["error"]:
        return f"no report {note(result['error'])}"
    failed = [r for r in result["records"] if r["status"] in ("failed", "error")]
    if failed:
        return "FAIL " + " ".join(sorted({note(f"{r['clause']} {r['nodeid'].split('::')[-1]}: {r['message']}")
                                          for r in failed}))
    return f"pass ({sum(r['status'] == 'passed' for r in result['records'])} records)"


def table(results: list[dict], long: dict[str, dict] | None = None, length: int = 0) -> str:
    """One row per model; ``long``: model -> its run at max_len ``length``, one more column."""
    clauses = sorted({r["clause"] for result in results for r in result["records"]})
    notes: dict[str, int] = {}
    extra = [f"max_len {length}", f"s at {length}"] if long else []
    lines = ["| model | " + " | ".join([*clauses, "s", *extra]) + " |", "|---" * (len(clauses) + 2 + len(extra)) + "|"]
    for result in results:
        by_clause = {c: [r for r in result["records"] if r["clause"] == c] for c in clauses}
        if result["error"]:
            cells = [f"no report [{notes.setdefault(_short(result['error'], 220), len(notes) + 1)}]"] * len(clauses)
        else:
            cells = [cell(by_clause[c], notes) if by_clause[c] else "–" for c in clauses]
        cells.append(f"{result['seconds']:.0f}")
        if long:
            at_length = long[result["model"]]
            cells += [verdict(at_length, notes), f"{at_length['seconds']:.0f}"]
        lines.append(f"| {result['model']} | " + " | ".join(cells) + " |")
    lines += ["", "Notes:", ""] + [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines)


def pytest_refuses(options: list[str]) -> str | None:
    """pytest's own error for the options after ``--`` (None when it takes them), asked once before any model runs:
    the suite's configuration with them, collecting its core/ folder, which holds no test (exit 5: nothing
    collected, the options taken; 4: a usage error)."""
    if not options:
        return None
    command = [sys.executable, "-m", "pytest", str(SUITE / "core"), "--collect-only", "-q", "-p", "no:cacheprovider",
               *options]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode in (0, 5):
        return None
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if "error" in line.lower()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def main(argv=None) -> int:
    from zoo.cli.arguments import Parser, count, seconds
    from zoo.io.atomic import unwritable, write_text
    parser = Parser(prog="python -m properties.adapters.conformance", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=count(1, 64), default=2, help="runs at a time (default 2)")
    parser.add_argument("--out", type=Path, default=Path("outputs/conformance"), help="default outputs/conformance")
    parser.add_argument("--factories", type=Path, default=DEFAULT_FACTORIES, help="file of factories (default "
                        "examples/conformance.py)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these factories only")
    parser.add_argument("--timeout", type=seconds(), default=900, help="seconds per model (default 900)")
    parser.add_argument("--long", type=count(0), default=2048, metavar="N", help="run each factory again with "
                        f"{LENGTH_VARIABLE}=N (default 2048; 0: not)")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest options, e.g. -- --hypothesis-profile ci")
    args = parser.parse_args(argv)
    path = args.factories.resolve()
    if not path.is_file():
        parser.error(f"--factories {args.factories}: no such file")
    try:
        names = factories(path)
    except (OSError, SyntaxError, ValueError) as exc:   # not a Python file (UnicodeDecodeError is a ValueError)
        parser.error(f"--factories {args.factories}: cannot be read as Python ({type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:120]})")
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"--only: {', '.join(unknown)} not in {path.name} ({', '.join(names)})")
    names = [n for n in names if not args.only or n in args.only]
    if not names:
        parser.error(f"--factories {args.factories}: no factory there; nothing to run")
    refused = pytest_refuses(args.pytest_args)
    if refused:
        parser.error(f"-- {' '.join(args.pytest_args)}: pytest refuses them ({refused}); nothing was run")
    problem = unwritable(str(args.out / "json"))
    if problem:
        parser.error(f"--out {args.out}: cannot be written ({problem}); nothing was run")
    (args.out / "json").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs = [(n, 0) for n in names] + [(n, args.long) for n in names if args.long]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results, long = [], {}
        for result in pool.map(lambda run: run_one(path, run[0], args.out, args.timeout, args.pytest_args, run[1]),
                               runs):
            failed = sum(r["status"] in ("failed", "error") for r in result["records"])
            summary = result["error"] or f"{len(result['records'])} records, {failed} failed"
            label = result["model"] + (f" @{result['max_len']}" if result["max_len"] else "")
            print(f"{label:<26} {result['seconds']:6.1f} s  {summary}", flush=True)
            if result["max_len"]:
                long[result["model"]] = result
            else:
                results.append(result)
    wall = time.perf_counter() - start
    header = (f"# Conformance: model clauses over {len(results)} models\n\n`{path.name}`, {args.jobs} job(s), "
              f"{wall:.0f} s wall time. Cells: pass, skip [note] or FAIL [note] over the clause's tests "
              f"(a clause may have several); s: seconds per model run"
              + (f"; max_len {args.long}: the same factory run with {LENGTH_VARIABLE}={args.long}, every clause"
                 if args.long else "") + ".\n\n")
    write_text(args.out / "conformance.md", header + table(results, long, args.long) + "\n")
    write_text(args.out / "conformance.json", json.dumps({"wall_s": round(wall, 1), "results": results,
                                                           "long": list(long.values())}, indent=1))
    print(f"{args.out / 'conformance.md'} ({wall:.0f} s)")
    bad = any(r["error"] or any(x["status"] in ("failed", "error") for x in r["records"])
              for r in [*results, *long.values()])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
