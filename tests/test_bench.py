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

import bench.suite
import bench.training
from bench.common import FAMILIES, TOY, forward_flops, interleaved
from bench.report import markdown
from zoo.config.builder import build_model
from zoo.config.composition import compose_config


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
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
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
    assert set(decode["seconds"]) == {"static", "growing", "recompute", "hf_static"}  # + static_compiled on CUDA
    ops = decode["ops_per_step"]  # the static cache builds no mask and concatenates nothing per layer
    assert 0 < ops["static"]["working"] < ops["growing"]["working"] <= ops["growing"]["dispatched"]
    assert "suite" not in results and "mutation" not in results
    for target in results["targets"]:
        assert set(target) >= {"target", "value", "met"}
    table = markdown(results)  # docs/benchmarks.md's tables
    assert "| family |" in table and "| greedy decoding |" in table


def test_time_limit_begins_nothing_after_it_and_says_so(tmp_path, capsys):
    from bench.run import main
    results = main(["--toy", "--device", "cpu", "--threads", "1", "--parts", "kernel,decode", "--time-limit",
                    "1e-9", "--out", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "kernel: not run, --time-limit" in out and "not run (--time-limit): kernel, decode" in out
    assert results["not_run"] == ["kernel", "decode"] and "kernel" not in results and results["part_seconds"] == {}


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


def test_training_part_measures_peak_memory(tmp_path):
    # --toy: L = 256 and 512 (2 and 4 key blocks of the memory-efficient kernel), each cell's peak measured in
    # its own subprocess. From 256 to 512 a linear peak grows 2x, a quadratic one 4x: the memory-efficient
    # kernel must stay below the geometric middle (2.83x), and math must pass it, which shows that the
    # measurement sees the (L, L) score matrices at all.
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--toy", "--device", "cpu", "--threads", "1", "--parts", "training",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    training = json.loads(out.read_text())["training"]
    assert (training["batch"], training["heads"], training["head_dim"], training["dtype"]) == (1, 8, 64, "float32")
    cells = {(c["backend"], c["length"]): c for c in training["cells"]}
    assert set(cells) == {(b, n) for b in ("memory_efficient", "math", "torch") for n in (256, 512)}
    for cell in cells.values():
        assert cell["skipped"] is None and cell["seconds"] > 0 and cell["peak_bytes"] > 0
        assert cell["memory_method"] in ("rss_high_water", "rss_high_water_own_malloc", "ru_maxrss_growth")
    growth = {b: cells[b, 512]["peak_bytes"] / cells[b, 256]["peak_bytes"] for b in ("memory_efficient", "math")}
    assert growth["memory_efficient"] <= 2 ** 1.5 < growth["math"], growth
    assert training["growth"]["memory_efficient"]["peak_ratio"] == pytest.approx(growth["memory_efficient"])

    table = markdown(json.loads(out.read_text()), "training")
    for backend in ("memory_efficient", "math", "torch"):
        assert f"| `{backend}` | 256 |" in table and f"| `{backend}` | 512 |" in table
    assert "Peak memory at the largest L ÷ at the smallest" in table
    target = next(t for t in json.loads(out.read_text())["targets"] if t["target"].startswith("memory_efficient"))
    assert target["met"] is True


def test_training_skips_a_cell_that_would_not_fit(monkeypatch):
    training = bench.training
    monkeypatch.setattr(training, "available_bytes", lambda device: 8 * 2**30)
    previous = {"length": 4096, "peak_bytes": 3.6 * 2**30, "seconds": 5.0}
    reason = training.skip_reason(previous, 8192, torch.device("cpu"))
    assert reason.startswith("skipped: would need ~14.4 GiB")
    assert training.skip_reason(previous, 4096, torch.device("cpu")) is None
    slow = {"length": 1024, "peak_bytes": 2**20, "seconds": 3.0}
    assert "min" in training.skip_reason(slow, 8192, torch.device("cpu"))


def test_train_targets_records_every_seed_and_device_and_states_only_the_default_run(tmp_path, monkeypatch):
    import bench.train_targets as targets
    from bench.report import train_seeds_markdown

    ran = []

    def fake(name, *, seed=None, threads=None, device=None, extra=()):
        ran.append((name, seed, device, extra))
        return {"what": name, "command": f"python -m zoo {name}", "extra_overrides": list(extra),
                "exact": 0.995 if seed else 1.0, "sequences": 1024, "seconds": 20.0, "cpu_seconds": 10.0,
                "threads": threads, "returncode": 0, "met": True, "goal": 0.99}
    monkeypatch.setattr(targets, "run_target", fake)
    out = tmp_path / "r.json"
    assert targets.main(["reverse", "--seed", "0,2", "--threads", "1", "--out", str(out)]) == 0
    assert targets.main(["reverse", "--seed", "1", "--device", "cuda", "--out", str(out)]) == 0
    assert targets.main(["sort", "--set", "task.steps=2", "--out", str(out)]) == 0
    assert ran[:2] == [("reverse", None, None, ()), ("reverse", 2, None, ())]  # seed 0: the documented command
    results = json.loads(out.read_text())
    assert set(results["train_targets"]) == {"reverse"}  # not seed 2, not cuda, not a run with --set
    assert set(results["train_targets_seeds"]["cpu"]["reverse"]) == {"0", "2"}
    assert results["train_targets_seeds"]["cuda"]["reverse"]["1"]["exact"] == 0.995
    table = "\n".join(train_seeds_markdown(results))
    assert "| `reverse` | cpu | 100.00%, 10 s CPU |  | 99.50%, 10 s CPU |" in table
    assert "| `reverse` | cuda |  | 99.50%, 20 s |  |" in table and "(task.steps=2)" in table
    with pytest.raises(SystemExit):
        targets.main(["reverse", "--seed", "one"])


def test_gpu_check_fills_its_block_of_the_page_and_nothing_else(tmp_path):
    from bench.gpu_check import BEGIN, END, fill_section, gpu_section

    results = {"machine": {"device_name": "NVIDIA H100", "torch": "2.x", "transformers": "5.x", "usable_cores": 16},
               "measured_on": "2026-01-01", "tiny": False, "seconds": 300.0,
               "steps": {"streams": {"status": 0, "seconds": 5.0}, "recipes": {"status": 0, "seconds": 120.0}},
               "streams": {"reverse": {"same_initial_weights": True, "same_first_batch": True,
                                       "devices": ["cpu", "cuda"]}},
               "recipes": {"train_targets_seeds": {"cuda": {"sort": {"0": {
                   "exact": 0.9951, "seconds": 21.0, "cpu_seconds": 20.0, "threads": None}}}}}}
    section = gpu_section(results)
    assert "NVIDIA H100" in section and "`reverse` initial weights equal on cpu and cuda" in section
    assert "| `sort` | cuda | 99.51%, 21 s |" in section
    page = tmp_path / "benchmarks.md"
    page.write_text(f"before\n{BEGIN}\nUnmeasured.\n{END}\nafter\n")
    fill_section(page, section)
    text = page.read_text()
    assert text.startswith(f"before\n{BEGIN}\nMeasured by") and text.endswith(f"{END}\nafter\n")
    assert "Unmeasured" not in text


def test_two_measurements_at_once_are_one_line_before_anything_runs(capsys):
    """`python -m bench.suite` measures one thing per run: two of its measurement options are argparse's one-line
    usage error (exit 2), before any measurement starts."""
    with pytest.raises(SystemExit) as stopped:
        bench.suite.main(["--recipes", "--plugin-cost", "--out", ""])
    assert stopped.value.code == 2
    assert "argument --plugin-cost: not allowed with argument --recipes" in capsys.readouterr().err
