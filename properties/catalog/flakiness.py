"""False alarms under many Hypothesis seeds: ``python -m properties.catalog.flakiness --seeds 20``.

For each seed s, the whole suite runs on every correct implementation with ``--hypothesis-seed=s``: the plain
``pytest properties/`` (the zoo's own parts at every level: both kernel backends, every module option, the
twelve tiny zoo models) and ``properties.catalog.CORRECT`` (PyTorch's SDPA, the step-by-step and flash
kernels, nn.MultiheadAttention and the flash kernel inside zoo models, nn.Transformer, nn.TransformerEncoder
and the Hugging Face GPT-2, BERT and BART examples), each unrestricted. Any failing test is a false alarm;
the target is 0. Not part of CI (20 seeds take about 15 minutes on 2 cores).

Options: ``--seeds N`` (default 20), ``--first-seed S`` (default 1: seeds S … S + N − 1), ``-n/--jobs N``
(suite runs in parallel, default 2), ``--json PATH``, ``--only NAME`` (repeatable: those subjects only).
"""
from __future__ import annotations

import json
import sys
import time

from properties.catalog import CORRECT, Entry
from zoo.io.atomic import write_text
from properties.catalog.run import run_all

__all__ = ["SUBJECTS", "main"]

ZOO = Entry("zoo (plain pytest properties/)", "module", "the zoo's own parts at every level", (), "", "")
SUBJECTS: list[Entry] = [ZOO] + [e for e in CORRECT if e.name not in ("zoo math", "zoo torch")]  # in the plain run


def main(argv=None) -> int:
    from zoo.cli.arguments import Parser, check_outputs, count
    parser = Parser(prog="python -m properties.catalog.flakiness",
                    description="Run the suite on the correct implementations under many seeds.")
    parser.add_argument("--seeds", type=count(1), default=20, help="how many seeds (>= 1; default 20)")
    parser.add_argument("--first-seed", type=count(0, 2**32 - 1), default=1)
    parser.add_argument("-n", "--jobs", type=count(1, 64), default=2, help="suite runs in parallel (default 2)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only these subjects (repeatable)")
    args = parser.parse_args(argv)
    check_outputs(parser, json=args.json)
    unknown = [name for name in args.only or () if name not in {e.name for e in SUBJECTS}]
    if unknown:   # every name is checked: a typo beside a known name is not dropped silently
        parser.error(f"--only {unknown}: no such subject; the subjects are {[e.name for e in SUBJECTS]}")
    subjects = [e for e in SUBJECTS if not args.only or e.name in args.only]
    if args.first_seed + args.seeds - 1 > 2**32 - 1:
        parser.error(f"--first-seed {args.first_seed} --seeds {args.seeds}: seeds past 2**32 - 1")

    seeds = range(args.first_seed, args.first_seed + args.seeds)
    start = time.perf_counter()
    results, failures, tests = [], [], 0
    for seed in seeds:
        runs = run_all(subjects, jobs=args.jobs, seed=seed, level=False)
        for run in runs:
            if run.unavailable:
                continue
            bad = [t for t in run.tests if t["status"] in ("failed", "error")]
            if run.returncode != 0 and not bad:
                bad = [{"nodeid": "(run)", "message": f"exit status {run.returncode}: {run.output[-500:]}"}]
            tests += len(run.tests)
            failures += [{"seed": seed, "subject": run.entry.name, "nodeid": t["nodeid"], "message": t["message"][:500]}
                         for t in bad]
            results.append({"seed": seed, "subject": run.entry.name, "tests": len(run.tests),
                            "passed": sum(t["status"] == "passed" for t in run.tests),
                            "failed": len(bad), "wall_s": round(run.wall_s, 2)})
        so_far = sum(r["failed"] for r in results if r["seed"] == seed)
        print(f"seed {seed}: {len(runs)} runs, {so_far} failure(s)  [{time.perf_counter() - start:.0f} s]",
              file=sys.stderr, flush=True)
    names = sorted({r["subject"] for r in results})
    print(f"{len(seeds)} seeds x {len(names)} subjects = {len(results)} suite runs, {tests} tests: "
          f"{len(failures)} failure(s) in {time.perf_counter() - start:.0f} s")
    for f in failures:
        print(f"  seed {f['seed']} {f['subject']}: {f['nodeid']}: {f['message']}")
    if args.json:
        write_text(args.json, json.dumps({"seeds": list(seeds), "runs": results, "failures": failures}, indent=1))
    if not results:   # every subject unavailable here: nothing was verified
        print("flakiness: nothing verified: no subject could run here (their files are in a source checkout)",
              file=sys.stderr)
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
