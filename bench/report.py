"""A results JSON as Markdown tables, for the README: ``python -m bench.report bench/results.json``."""
from __future__ import annotations

import json
import sys


def _ratio(x: float) -> str:
    return f"{x:.2f}×"


def markdown(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    lines = [f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, device `{m['device']}` ({m['device_name']}), "
             f"torch {m['torch']}, transformers {m.get('transformers')}, {s['threads']} torch thread(s), "
             f"{s['timing'].get('clock', 'wall')} clock; load average {m.get('load_average_at_start')} at start, "
             f"{m.get('load_average_at_end')} at end. Batch {s['batch']}, {s['layers_per_stack']} layers per stack. "
             f"Wall time of the run: {results.get('wall_seconds', 0) / 60:.0f} min.", ""]
    if results.get("models"):
        lines += ["| family | L | dtype | pass | reference tok/s | zoo `torch` tok/s | ratio | zoo `math` tok/s "
                  "| ratio | forward FLOP/s ÷ matmul FLOP/s (zoo `torch`) | rounds |",
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
        lines += ["| attention kernel shape | dtype | causal | `F.scaled_dot_product_attention` | zoo `torch` | "
                  "zoo `math` |", "| --- | --- | --- | ---: | ---: | ---: |"]
        for c in results["kernel"]:
            lines.append(f"| {tuple(c['shape'])} | {c['dtype']} | {c['is_causal']} "
                         f"| {c['seconds']['sdpa'] * 1e3:.2f} ms | {_ratio(c['ratio']['zoo_torch'])} "
                         f"| {_ratio(c['ratio']['zoo_math'])} |")
        lines.append("")
    if results.get("decode"):
        lines += ["| greedy decoding | dtype | new tokens | KVCache | recompute prefix | speedup | same tokens |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for c in results["decode"]:
            lines.append(f"| {c['model']}, {c['layers']} layers, batch {c['batch']}, prompt {c['prompt']} "
                         f"| {c['dtype']} | {c['new_tokens']} | {c['seconds']['cached']:.2f} s "
                         f"| {c['seconds']['recompute']:.2f} s "
                         f"| {c['speedup']:.1f}× | {c['same_tokens']} |")
        lines.append("")
    if results.get("suite"):
        for name, run in results["suite"].items():
            wall = "n/a" if run["seconds"] is None else f"{run['seconds']:.0f} s wall"
            cpu = f", {run['cpu_seconds']:.0f} s CPU" if run.get("cpu_seconds") is not None else ""
            lines.append(f"- `{run['command']}`: {wall}{cpu} ({run['summary']})")
    if results.get("mutation"):
        mut = results["mutation"]
        value = mut.get("median_first_failure_seconds")
        lines.append(f"- median time to first failure over the mutation catalog: "
                     f"{'not available — ' + mut['reason'] if value is None else f'{value:.2f} s'}")
    if results.get("targets"):
        lines += ["", "| target | value | met |", "| --- | --- | --- |"]
        for t in results["targets"]:
            met = {True: "yes", False: "**no**", None: "—"}[t["met"]]
            lines.append(f"| {t['target']} | {t['value']} | {met} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(json.load(open(sys.argv[1] if len(sys.argv) > 1 else "bench/results.json"))))
