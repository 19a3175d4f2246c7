"""The suite's power on the bug catalog: ``python -m properties.catalog.mutation_report``.

Runs ``pytest properties/ OPTION ARGUMENT --report-json`` (``properties.catalog.run``) on every broken
implementation of ``properties.catalog.CATALOG`` and every correct one of ``CORRECT``, each on its whole
level with nothing restricted (a ``--zoo`` run leaves out only the kernel tests of the default kernels), and
prints one row per entry: whether an expected clause failed, the first failing clause in execution order, the
time to that first failure — the sum of the report's test durations up to and including the first failing
test, process start-up excluded — and the start-up itself (wall time minus the test durations: interpreter,
imports, collection). Kernel entries are also run through the FlashAttention-style example-based test
(``properties.catalog.example_based``) for a side-by-side detection rate.

Options: ``--json PATH`` (every row, and the totals), ``--jobs N`` (suite runs in parallel, default 2),
``--seed N`` (``--hypothesis-seed`` of every run, default 0), ``--only NAME`` (repeatable).
"""
from __future__ import annotations

import json
import sys
import time

import torch

from properties.catalog import CATALOG, CORRECT, LEVELS, Entry
from zoo.io.atomic import write_text
from properties.catalog import example_based
from properties.plugin.session import PROFILE_NAMES
from properties.catalog.run import Run, run_all

__all__ = ["main", "rows_for", "totals"]


def _kernel_callable(entry: Entry):
    from zoo.nn.kernel import resolve_kernel
    return resolve_kernel(entry.argument)


def rows_for(runs: list[Run], examples: dict[str, example_based.Result]) -> list[dict]:
    rows = []
    for run in runs:
        entry, first = run.entry, run.first_failure
        ex = examples.get(entry.name)
        rows.append({
            "name": entry.name, "level": entry.level, "broken": bool(entry.expected), "mechanism": entry.mechanism,
            "plug_in": " ".join(entry.plug_in), "expected": list(entry.expected),
            "status": ("unavailable" if run.unavailable else "usage error" if run.usage_error else
                       ("caught" if run.caught_expected else "caught (other clause)" if run.caught else "missed")
                       if entry.expected else ("false alarm" if run.caught else "passed")),
            "failed_clauses": run.failed_clauses,
            "first_failing_clause": first and "+".join(first["clauses"]),
            "first_failing_test": first and first["nodeid"],
            "first_failure_message": first and first["message"][:300],
            "time_to_first_failure_s": first and round(first["time_s"], 3),
            "tests_s": round(run.tests_s, 3), "startup_s": None if run.unavailable else round(run.startup_s, 3),
            "wall_s": round(run.wall_s, 3),
            "tests_run": len(run.tests), "returncode": run.returncode, "unavailable": run.unavailable,
            "example_based": None if ex is None else {
                "caught": ex.caught, "failed_cases": len(ex.failures), "cases": ex.cases,
                "time_to_first_failure_s": None if ex.first_failure_s is None else round(ex.first_failure_s, 4),
                "first_failure": ex.failures[0] if ex.failures else None},
        })
    return rows


def totals(rows: list[dict]) -> dict:
    broken = [r for r in rows if r["broken"]]
    correct = [r for r in rows if not r["broken"] and r["status"] != "unavailable"]
    kernels = [r for r in broken if r["level"] == "kernel"]
    correct_kernels = [r for r in correct if r["example_based"] is not None]
    per_level = {level: f"{sum(r['status'] == 'caught' for r in broken if r['level'] == level)}/"
                        f"{sum(r['level'] == level for r in broken)}" for level in LEVELS}
    return {
        "caught": sum(r["status"] == "caught" for r in broken), "caught_other": sum(r["status"] == "caught (other clause)"
                                                                                   for r in broken),
        "broken": len(broken), "per_level": per_level,
        "false_alarms": sum(r["status"] != "passed" for r in correct), "correct": len(correct),
        "kernels_property_based": sum(r["status"] == "caught" for r in kernels),
        "kernels_example_based": sum(bool(r["example_based"] and r["example_based"]["caught"]) for r in kernels),
        "kernels": len(kernels),
        "example_based_false_alarms": sum(bool(r["example_based"]["caught"]) for r in correct_kernels),
        "correct_kernels": len(correct_kernels),
        "mean_startup_s": round(sum(r["startup_s"] for r in rows if not r["unavailable"]) /
                                max(1, sum(not r["unavailable"] for r in rows)), 2),
        "mean_time_to_first_failure_s": round(sum(r["time_to_first_failure_s"] or 0 for r in broken if r["status"] == "caught")
                                              / max(1, sum(r["status"] == "caught" for r in broken)), 2),
    }


def _fmt(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = ["| entry | level | expected clause(s) | suite | first failing clause | time to 1st failure (s) | "
             "start-up (s) | example-based (FA-style) |", "|---|---|---|---|---|---:|---:|---|"]
    for r in rows:
        ex = r["example_based"]
        ex_text = "n/a" if ex is None else (
            (f"caught ({ex['failed_cases']}/{ex['cases']} cases, {_fmt(ex['time_to_first_failure_s'], 3)} s)"
             if r["broken"] else f"false alarm ({ex['failed_cases']}/{ex['cases']})")
            if ex["caught"] else ("missed" if r["broken"] else "passed"))
        expected = ", ".join(r["expected"]) if r["broken"] else "(correct)"
        lines.append(f"| {r['name']} | {r['level']} | {expected} | {r['status']} | {r['first_failing_clause'] or '–'} | "
                     f"{_fmt(r['time_to_first_failure_s'])} | {_fmt(r['startup_s'], 1)} | {ex_text} |")
    return "\n".join(lines)


def summary(t: dict) -> str:
    return "\n".join([
        f"Caught: {t['caught']}/{t['broken']} broken implementations by an expected clause "
        f"({', '.join(f'{level} {caught}' for level, caught in t['per_level'].items())})"
        + (f"; {t['caught_other']} more by another clause only" if t["caught_other"] else ""),
        f"False alarms: {t['false_alarms']}/{t['correct']} correct implementations",
        f"Kernels, side by side: property suite {t['kernels_property_based']}/{t['kernels']}, "
        f"example-based (FlashAttention-style) {t['kernels_example_based']}/{t['kernels']}; example-based false "
        f"alarms {t['example_based_false_alarms']}/{t['correct_kernels']}",
        f"Mean time to the first failure {t['mean_time_to_first_failure_s']} s (tests only); mean start-up "
        f"{t['mean_startup_s']} s per run",
    ])


def main(argv=None) -> int:
    from zoo.cli.arguments import Parser, check_outputs, count
    parser = Parser(prog="python -m properties.catalog.mutation_report",
                                     description="Run the spec suite on the bug catalog and the correct implementations.")
    parser.add_argument("--json", metavar="PATH", help="write every row and the totals as JSON")
    parser.add_argument("--jobs", type=count(1, 64), default=2, help="suite runs in parallel (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="--hypothesis-seed of every run (default 0)")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only these entries (repeatable)")
    parser.add_argument("--profile", default="default", choices=PROFILE_NAMES,
                        help="Hypothesis profile of every run; 'pinned' runs only the @example cases, and shows "
                             "which bugs a run catches whatever it draws (default: default)")
    args = parser.parse_args(argv)
    check_outputs(parser, json=args.json)

    entries = [e for e in CATALOG + CORRECT if not args.only or e.name in args.only]
    if not entries:
        parser.error(f"--only {args.only}: no such entry")
    start = time.perf_counter()

    def progress(run: Run):
        first = run.first_failure
        print(f"  {run.entry.name}: {'unavailable' if run.unavailable else (first and '+'.join(first['clauses'])) or 'passed'}"
              f" ({run.wall_s:.1f} s)", file=sys.stderr, flush=True)

    print(f"running the suite on {len(entries)} implementations, {args.jobs} at a time (seed {args.seed}, profile {args.profile})",
          file=sys.stderr, flush=True)
    runs = run_all(entries, jobs=args.jobs, progress=progress, seed=args.seed,
                   extra=["--hypothesis-profile", args.profile])
    if all(run.unavailable for run in runs):   # nothing verified: never a pass
        print(f"mutation_report: nothing verified: none of the {len(runs)} entries could run here "
              f"({runs[0].unavailable})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    # (the baseline calls an SDPA kernel for its output: not a context-parallel one, nor one that returns (out, lse))
    examples = {e.name: example_based.run(_kernel_callable(e), e.name) for e in entries
                if e.option == "--kernel" and e.level == "kernel" and "--returns-lse" not in e.extra}
    rows = rows_for(runs, examples)
    t = totals(rows)
    print(table(rows))
    print()
    print(summary(t))
    print(f"(total {time.perf_counter() - start:.0f} s with --jobs {args.jobs})")
    if args.json:
        write_text(args.json, json.dumps({"seed": args.seed, "rows": rows, "totals": t}, indent=1))
    bad = t["broken"] - t["caught"] + t["false_alarms"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
