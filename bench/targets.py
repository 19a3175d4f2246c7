"""The bench's stated targets and how a results dict is judged against them: one place, read by ``python -m bench``
(bench/run.py) after every run and by ``python -m bench.suite`` when it merges a new suite measurement."""
from __future__ import annotations

import statistics

from bench.decode import decode_targets
from bench.training import LINEAR_EXPONENT_TARGET

__all__ = ["TARGETS", "evaluate_targets", "missed_targets"]

TARGETS = {"torch_vs_reference": 0.95, "suite_seconds": 60.0, "first_failure_seconds": 2.0,
           "distributed_seconds": 120.0}   # decoding: bench/decode.py


def evaluate_targets(results: dict) -> list[dict]:
    out = []
    models = results.get("models") or []
    if models:
        worst = min(models, key=lambda c: c["ratio"]["zoo_torch"])
        missed = [f"{c['family']} L={c['seq_len']} {c['dtype']} {c['mode']}: x{c['ratio']['zoo_torch']:.2f}"
                  for c in models if c["ratio"]["zoo_torch"] < TARGETS["torch_vs_reference"]]
        out.append({"target": "zoo (torch kernel) >= 0.95x reference throughput, every model pair",
                    "value": round(worst["ratio"]["zoo_torch"], 3), "met": not missed, "missed": missed})
        math = [c["ratio"]["zoo_math"] for c in models]
        out.append({"target": "zoo (math kernel) vs reference: reported, no target",
                    "value": f"min x{min(math):.2f}, median x{statistics.median(math):.2f}", "met": None})
    kernel = results.get("kernel") or []
    if kernel:
        worst = min(c["ratio"]["zoo_torch"] for c in kernel)
        out.append({"target": "zoo torch kernel >= 0.95x F.scaled_dot_product_attention, every shape",
                    "value": round(worst, 3), "met": worst >= TARGETS["torch_vs_reference"]})
    training = results.get("training") or {}
    me = (training.get("growth") or {}).get("memory_efficient")
    if me:
        quadratic = (training.get("growth") or {}).get("math")
        out.append({"target": f"memory_efficient attention training step: peak memory ~ linear in L "
                              f"(L^x, x <= {LINEAR_EXPONENT_TARGET}, L {me['from_length']} to {me['to_length']})",
                    "value": f"x{me['peak_ratio']:.1f} for x{me['length_ratio']:.0f} L (exponent "
                             f"{me['exponent']:.2f})", "met": me["exponent"] <= LINEAR_EXPONENT_TARGET,
                    "note": None if quadratic is None else f"math: x{quadratic['peak_ratio']:.1f} "
                                                           f"(exponent {quadratic['exponent']:.2f})"})
    out += decode_targets(results.get("decode") or [])
    suite = results.get("suite")
    if suite:
        run = suite["default"]
        ok = run.get("tests_ran") and run["seconds"] is not None
        out.append({"target": "pytest properties/ (default profile) <= 60 s wall",
                    "value": round(run["seconds"], 1) if ok else run["summary"],
                    "met": run["seconds"] <= TARGETS["suite_seconds"] if ok else None,
                    "note": f"{run['cpu_seconds']:.1f} s CPU; {run['summary']}" if ok else None})
    distributed = results.get("distributed")
    if distributed:
        seconds = distributed.get("seconds_median")
        ok = distributed.get("tests_ran") and seconds is not None
        out.append({"target": "pytest properties/ --world-size 2 (default profile) <= 120 s wall",
                    "value": round(seconds, 1) if ok else distributed["summary"],
                    "met": seconds <= TARGETS["distributed_seconds"] if ok else None,
                    "note": f"median of {distributed['runs']}; {distributed['cpu_seconds_median']:.1f} s CPU; "
                            f"{distributed['summary']}" if ok else None})
    mutation = results.get("mutation")
    if mutation:
        value = mutation.get("median_first_failure_seconds")
        if not mutation["available"]:
            value, met = "not available", None
        elif value is None:  # nothing caught
            value, met = f"0/{mutation['mutants']} caught", False
        else:
            value, met = round(value, 3), value <= TARGETS["first_failure_seconds"]
        out.append({"target": "median time to first failure over the mutation catalog <= 2 s", "value": value,
                    "met": met, "note": f"{mutation['caught']}/{mutation['mutants']} caught; test time only, "
                                        f"start-up excluded" if mutation["available"] else mutation["reason"]})
    return out



def missed_targets(results: dict) -> list[str]:
    """The stated targets this run missed, and the parts that failed (whose targets could not be judged)."""
    missed = [f"{t['target']}: {t['value']}" for t in results.get("targets", []) if t["met"] is False]
    missed += [f"{t['target']}: not measured ({t['value']})" for t in results.get("targets", [])
               if t["met"] is None and "no target" not in t["target"]]
    missed += [f"part {name} failed: {error}" for name, error in results.get("errors", {}).items()]
    return missed
