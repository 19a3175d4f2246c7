"""A results JSON as Markdown tables, for docs/benchmarks.md: ``python -m bench.report bench/results.json``.

``python -m bench.report bench/results.json --only training`` prints only that part's table; ``--only train_targets``
the training targets of docs/training.md (``python -m bench.train_targets``), ``--only seeds`` the recipes over
seeds and devices.
"""
from __future__ import annotations

import argparse
import json


def _ratio(x: float) -> str:
    return f"{x:.2f}×"


def _bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _step_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def training_markdown(results: dict) -> list[str]:
    """The attention training-step table (bench/training.py): peak memory and time per backend and L."""
    t = results.get("training")
    if not t or not t.get("cells"):
        return []
    run = (results.get("merged") or {}).get("training") or results  # the run that measured this part
    m = run["machine"]
    lines = [(f"One attention training step, `kernel(q, k, v).backward(grad)` and nothing else: q, k, v of shape "
              f"({t['batch']}, {t['heads']}, L, {t['head_dim']}), {t['dtype']}, not causal, no mask. Device "
              f"`{m['device']}` ({m['device_name']}), torch {m['torch']}, {t['threads']} torch thread(s), "
              f"load average {m.get('load_average_at_start')} at start. Peak memory: {t['memory_method']}. "
              f"Time: {t.get('clock', 'wall')} clock, median of the rounds after one warm-up round, the backends "
              f"of one L interleaved."), "",
             "| backend | L | peak memory | ÷ peak at the smallest L | time per step | rounds |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    first = {}
    backends = list(dict.fromkeys(c["backend"] for c in t["cells"]))
    for c in sorted(t["cells"], key=lambda c: (backends.index(c["backend"]), c["length"])):
        if c.get("skipped"):
            lines.append(f"| `{c['backend']}` | {c['length']} | {c['skipped']} | | | |")
            continue
        base = first.setdefault(c["backend"], c)
        ratio = (f"{c['peak_bytes'] / base['peak_bytes']:.1f}× (L ×{c['length'] // base['length']})"
                 if c["peak_bytes"] and base["peak_bytes"] and c is not base else "")
        lines.append(f"| `{c['backend']}` | {c['length']} | {_bytes(c['peak_bytes'])} | {ratio} "
                     f"| {_step_seconds(c['seconds'])} | {c['repeats']} |")
    if t.get("growth"):
        lines += ["", "Peak memory at the largest L ÷ at the smallest: " + "; ".join(
            f"`{b}` {g['peak_ratio']:.1f}× for L {g['from_length']} → {g['to_length']} (linear would be "
            f"{g['length_ratio']:.0f}×, quadratic {g['length_ratio'] ** 2:.0f}×; peak ∝ L^{g['exponent']:.2f})"
            for b, g in t["growth"].items()) + "."]
    return [*lines, ""]


def train_targets_markdown(results: dict) -> list[str]:
    """The training targets of docs/training.md (bench/train_targets.py): accuracy, CPU and wall time per command.
    Each CPU time is written as the page states it, bold with the record it comes from (tests/test_readme_durations.py
    keeps the two within 1.5x)."""
    targets = results.get("train_targets")
    if not targets:
        return []
    lines = ["| target | command | held-out exact match | CPU time, one thread | wall time |",
             "| --- | --- | ---: | ---: | ---: |"]
    for name, t in targets.items():
        exact = "failed" if t["exact"] is None else f"{100 * t['exact']:.2f}% of {t['sequences']:,}"
        load = t.get("load_average_at_start")
        lines.append(f"| {t.get('what', name)} | `{t['command']}` | {exact} "
                     f"| **{t['cpu_seconds']:.0f} s** <!-- measured: train_targets.{name}.cpu_seconds --> "
                     f"| {t['seconds']:.0f} s{f' (load {load[0]:.1f})' if load else ''} |")
    return [*lines, ""]


def train_seeds_markdown(results: dict) -> list[str]:
    """The recipes over seeds and devices (``python -m bench.train_targets ... --seed 0,1,2 [--device D]``): held-out
    exact match per seed, and the time each run took (CPU time with one thread, else wall time)."""
    runs = results.get("train_targets_seeds")
    if not runs:
        return []
    seeds = sorted({int(seed) for by_name in runs.values() for by_seed in by_name.values() for seed in by_seed})
    lines = ["| recipe | device | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in seeds) + " |"]
    for device, by_name in runs.items():
        for name, by_seed in by_name.items():
            cells = []
            for seed in seeds:
                row = by_seed.get(str(seed))
                if row is None:
                    cells.append("")
                    continue
                exact = "failed" if row["exact"] is None else f"{100 * row['exact']:.2f}%"
                spent = (f"{row['cpu_seconds']:.0f} s CPU" if row.get("threads") == 1 else f"{row['seconds']:.0f} s")
                marked = f" ({' '.join(row['extra_overrides'])})" if row.get("extra_overrides") else ""
                cells.append(f"{exact}, {spent}{marked}")
            lines.append(f"| `{name}` | {device} | " + " | ".join(cells) + " |")
    return [*lines, ""]


DECODE_COLUMNS = {"static": "static cache", "static_compiled": "static, compiled (CUDA graph)",
                  "growing": "growing cache", "recompute": "recompute prefix",
                  "hf_static": "HF `generate`, static cache"}


def decode_markdown(cells: list[dict]) -> list[str]:
    """Greedy decoding (bench/decode.py): seconds per variant, the speed-ups, operations per decoding step."""
    names = [n for n in DECODE_COLUMNS if any(n in c["seconds"] for c in cells)]
    lines = ["| greedy decoding | dtype | new tokens | " + " | ".join(DECODE_COLUMNS[n] for n in names)
             + " | recompute ÷ static | HF ÷ zoo best | ops per step: growing → static | same tokens |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: | --- |"]
    for c in cells:
        ops = c.get("ops_per_step") or {}
        count = lambda n: f"{ops[n]['working']:.0f}" if n in ops else "n/a"  # noqa: E731
        seconds = [f"{c['seconds'][n]:.2f} s" if n in c["seconds"] else "" for n in names]
        hf = f"{c['vs_hf_static']:.2f}×" if c.get("vs_hf_static") else "n/a"
        lines.append(f"| {c['model']}, {c['layers']} layers, batch {c['batch']}, prompt {c['prompt']} "
                     f"| {c['dtype']} | {c['new_tokens']} | " + " | ".join(seconds)
                     + f" | {c['speedup']:.1f}× | {hf} | {count('growing')} → {count('static')}"
                     + (f" (compiled: {ops['static_compiled'].get('launches', 0):.0f} launches)"
                        if "static_compiled" in ops else "") + f" | {c['same_tokens']}"
                     + (f" (compiled: {c['same_tokens_compiled']})" if c.get("same_tokens_compiled") is not None
                        else "") + " |")
    return [*lines, ""]


def markdown(results: dict, only: str | None = None) -> str:
    if only == "training":
        return "\n".join(training_markdown(results))
    if only == "train_targets":
        return "\n".join(train_targets_markdown(results))
    if only == "seeds":
        return "\n".join(train_seeds_markdown(results))
    m, s = results["machine"], results["settings"]
    lines = [(f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, device `{m['device']}` ({m['device_name']}), "
              f"torch {m['torch']}, transformers {m.get('transformers')}, {s['threads']} torch thread(s), "
              f"{s['timing'].get('clock', 'wall')} clock; load average {m.get('load_average_at_start')} at start, "
              f"{m.get('load_average_at_end')} at end. Batch {s['batch']}, {s['layers_per_stack']} layers per "
              f"stack. Wall time of the run: {results.get('wall_seconds', 0) / 60:.0f} min."), ""]
    if results.get("models"):
        lines += [("| family | L | dtype | pass | reference tok/s | zoo `torch` tok/s | ratio | zoo `math` tok/s "
                   "| ratio | forward FLOP/s ÷ matmul FLOP/s (zoo `torch`) | rounds |"),
                  "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for c in results["models"]:
            t, r = c["tokens_per_s"], c["ratio"]
            util = c.get("matmul_utilization", {}).get("zoo_torch")
            lines.append(f"| {c['family']} | {c['seq_len']} | {c['dtype']} | {c['mode']} | {t['reference']:,.0f} "
                         f"| {t['zoo_torch']:,.0f} | {_ratio(r['zoo_torch'])} | {t['zoo_math']:,.0f} "
                         f"| {_ratio(r['zoo_math'])} | {'' if util is None else f'{util:.0%}'} | {c['repeats']} |")
        lines.append("")
    if results.get("matmul"):
        lines.append("Matmul FLOP/s (torch.mm, n × n): " + ", ".join(
            f"{name} {v['flops_per_s'] / 1e9:,.0f} GFLOP/s (n={v['n']})" for name, v in results["matmul"].items()))
        lines.append("")
    if results.get("kernel"):
        lines += [("| attention kernel shape | dtype | causal | `F.scaled_dot_product_attention` | zoo `torch` | "
                   "zoo `math` |"), "| --- | --- | --- | ---: | ---: | ---: |"]
        for c in results["kernel"]:
            lines.append(f"| {tuple(c['shape'])} | {c['dtype']} | {c['is_causal']} "
                         f"| {c['seconds']['sdpa'] * 1e3:.2f} ms | {_ratio(c['ratio']['zoo_torch'])} "
                         f"| {_ratio(c['ratio']['zoo_math'])} |")
        lines.append("")
    if results.get("decode"):
        lines += decode_markdown(results["decode"])
    if results.get("suite"):
        for run in results["suite"].values():
            wall = "n/a" if run["seconds"] is None else f"{run['seconds']:.0f} s wall"
            cpu = f", {run['cpu_seconds']:.0f} s CPU" if run.get("cpu_seconds") is not None else ""
            lines.append(f"- `{run['command']}`: {wall}{cpu} ({run['summary']})")
    if results.get("mutation"):
        mut = results["mutation"]
        value = mut.get("median_first_failure_seconds")
        lines.append(f"- median time to first failure over the mutation catalog: "
                     f"{'not available — ' + mut['reason'] if value is None else f'{value:.2f} s'}")
    if results.get("plugin_cost"):
        cost = results["plugin_cost"]
        lines.append(f"- an unrelated one-test pytest run, CPU time (median of {cost['runs']}): "
                     f"{cost['with_plugin']['cpu_seconds_median']:.2f} s with the suite's plug-in, "
                     f"{cost['without_plugin']['cpu_seconds_median']:.2f} s without it "
                     f"(difference {cost['difference_cpu_seconds']:+.2f} s)")
    if results.get("targets"):
        lines += ["", "| target | value | met |", "| --- | --- | --- |"]
        for t in results["targets"]:
            met = {True: "yes", False: "**no**", None: "—"}[t["met"]]
            lines.append(f"| {t['target']} | {t['value']} | {met} |")
    training = training_markdown(results)  # docs/benchmarks.md gives it a section of its own
    if training:
        lines += ["", *training]
    return "\n".join(lines)


def read_results(parser, path: str, only: str | None) -> dict:
    """The results object at ``path``, or ``parser.error`` with one line saying why it cannot be one."""
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except OSError as exc:
        parser.error(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})")
    except UnicodeDecodeError:
        parser.error(f"{path}: not UTF-8 text, so not a results file of python -m bench")
    except ValueError as exc:
        parser.error(f"{path}: not JSON ({exc})")
    if not isinstance(results, dict):
        parser.error(f"{path}: holds a JSON {type(results).__name__}, not the object python -m bench writes")
    needed = {"training": ("training",), "train_targets": ("train_targets",), "seeds": ("train_targets_seeds",),
              None: ("machine", "settings")}[only]
    missing = [key for key in needed if key not in results]
    if only is None and missing:
        parser.error(f"{path}: no {' and no '.join(repr(k) for k in missing)} record: not a results file of "
                     f"python -m bench (--only selects one part of another file)")
    return results


def main(argv=None) -> int:
    from zoo.cli.arguments import Parser

    p = Parser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", default="bench/results.json")
    p.add_argument("--only", choices=["training", "train_targets", "seeds"], default=None,
                   help="only this part's table (seeds: the recipes over seeds and devices)")
    args = p.parse_args(argv)
    results = read_results(p, args.path, args.only)
    try:
        text = markdown(results, args.only)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, ZeroDivisionError) as exc:
        # A record of the right name whose fields are not what python -m bench writes (edited, or another version's).
        p.error(f"{args.path}: a record is not what python -m bench writes ({type(exc).__name__}: {exc})")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
