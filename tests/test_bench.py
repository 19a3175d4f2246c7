"""The benchmark machinery at toy sizes: it runs, and its JSON has the promised structure. No timing asserts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a directory of the repository, not an installed package

from bench.common import forward_flops, interleaved  # noqa: E402
from bench.report import markdown  # noqa: E402
import bench.suite  # noqa: E402
from bench.common import FAMILIES, TOY  # noqa: E402
from zoo.config.builder import build_model, compose_config  # noqa: E402


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flop_formula_equals_flop_counter(family):
    # The math kernel is plain einsums (bmm), which FlopCounterMode counts; its CPU SDPA is not counted.
    overrides = [f"preset={FAMILIES[family]}", "layers=2", "dropout=0", "attention=math", *TOY]
    cfg, model = compose_config(overrides), build_model(overrides).eval()
    batch, length = 2, 12
    tokens = torch.randint(1, model.vocab_size, (batch, length))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        if family == "encoder_decoder":
            model(tokens, tokens)
        elif family == "encoder_only":
            model.pool(model(tokens))
        else:
            model(tokens)
    expected = forward_flops(family, batch=batch, seq_len=length, d_model=cfg.d_model, d_ff=cfg.d_ff,
                             vocab_size=cfg.vocab_size, layers=cfg.layers, pooler=family == "encoder_only")
    assert counter.get_total_flops() == expected


def test_interleaved_alternates_and_clamps_repeats():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    out = interleaved(fns, torch.device("cpu"), warmup=1, min_repeats=2, max_repeats=3, budget_s=1e9,
                      min_sample_s=0)
    assert out["repeats"] == 3 and out["calls_per_sample"] == 1
    assert "".join(calls) == "abc" + "abc" + "cba" + "abc"
    assert set(out["seconds"]) == set("abc") and all(len(s) == 3 for s in out["samples"].values())


def test_bench_command_writes_json(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--toy", "--device", "cpu", "--threads", "1", "--dtypes", "float32",
         "--lengths", "16", "--batch", "1", "--new-tokens", "4", "--prompt", "3", "--matmul-n", "64",
         "--parts", "models,kernel,decode", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "targets" in done.stdout
    results = json.loads(out.read_text())

    machine = results["machine"]
    for key in ("cpu", "cpu_count", "torch", "threads", "device", "device_name"):
        assert key in machine
    assert machine["threads"] == 1 and results["settings"]["device"] == "cpu"
    assert results["matmul"]["float32"]["flops_per_s"] > 0

    models = results["models"]
    assert {(c["family"], c["mode"]) for c in models} == {(f, m) for f in FAMILIES
                                                          for m in ("forward", "forward+backward")}
    for cell in models:
        assert set(cell["seconds"]) == {"reference", "zoo_torch", "zoo_math"}
        assert set(cell["ratio"]) == {"zoo_torch", "zoo_math"}
        assert cell["seq_len"] == 16 and cell["dtype"] == "float32" and cell["repeats"] >= 1
        if cell["mode"] == "forward":
            assert cell["flops_per_call"] > 0 and set(cell["matmul_utilization"]) == set(cell["seconds"])

    assert len(results["kernel"]) == 2 and {c["is_causal"] for c in results["kernel"]} == {False, True}
    assert all(set(c["ratio"]) == {"zoo_torch", "zoo_math"} for c in results["kernel"])
    (decode,) = results["decode"]
    assert decode["new_tokens"] == 4 and decode["speedup"] > 0 and decode["same_tokens"] is True
    assert "suite" not in results and "mutation" not in results
    for target in results["targets"]:
        assert set(target) >= {"target", "value", "met"}
    table = markdown(results)  # the README's tables
    assert "| family |" in table and "| greedy decoding |" in table


def test_mutation_summary(monkeypatch):
    monkeypatch.setattr(bench.suite, "mutation_report_first_failure_times",
                        lambda: {"a": 0.5, "b": 1.5, "c": None, "d": 3.0})
    found = bench.suite.bench_mutation()
    assert found["available"] and found["mutants"] == 4 and found["caught"] == 3
    assert found["median_first_failure_seconds"] == 1.5

    def broken():
        raise RuntimeError("no catalog entry ran")
    monkeypatch.setattr(bench.suite, "mutation_report_first_failure_times", broken)
    absent = bench.suite.bench_mutation()
    assert absent["available"] is False and "no catalog entry ran" in absent["reason"]
