"""Decoding and differential clauses, run the way a user runs them (``pytest properties/ ...`` in a new pytest session):
the examples pass, a reference that cannot be used is a one-line usage error, the catalog's decode-path bugs are
missed by the clauses that existed before MODEL-BATCHED-DECODING (which catches them: tests/test_catalog.py), and
--reference-kernel tells a broken kernel from a correct one."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from properties.catalog import CATALOG, Entry
from properties.catalog.run import command, run_entry
from properties.catalog.sessions import run_pytest

ROOT = Path(__file__).resolve().parents[1]
DIFF = ["MODEL-DIFF-FORWARD", "MODEL-DIFF-GRADIENT", "MODEL-DIFF-DECODE"]
# The model clauses that existed before MODEL-BATCHED-DECODING (issue 17).
OLDER = ["MODEL-SHAPE", "MODEL-CAUSAL", "MODEL-DEPENDENCE", "MODEL-PERMUTATION", "MODEL-BATCH", "MODEL-PADDING",
         "MODEL-DETERMINISM", "MODEL-DISTRIBUTION", "MODEL-FACTORISATION", "MODEL-KV-CACHE", "MODEL-LENGTH",
         "MODEL-GRADIENT", "MODEL-GRAD-PADDING", "MODEL-GRAD-BATCH"]


def _suite(tmp_path, *args, path="properties/", timeout=900):
    """``pytest PATH ARGS --report-json`` from the repository root: (process, report rows)."""
    report = tmp_path / "report.json"
    proc = run_pytest([path, "-q", "-p", "no:cacheprovider", "--report-json", str(report), *args], cwd=ROOT,
                      timeout=timeout)
    return proc, (json.loads(report.read_text()) if report.exists() else [])


def _only(*clauses: str) -> list[str]:
    return ["-p", "properties.catalog.select", *(f"--catalog-clause={c}" for c in clauses)]


@pytest.mark.parametrize("model,reference", [
    ("examples/differential.py:llama_sdpa", "examples/differential.py:llama_eager"),
    ("examples/differential.py:zoo_memory_efficient", "examples/differential.py:zoo_math"),
], ids=["llama-sdpa-vs-eager", "zoo-memory_efficient-vs-math"])
def test_examples_pass(tmp_path, model, reference):
    if "llama" in model:
        pytest.importorskip("transformers")
    proc, rows = _suite(tmp_path, "-m", "model", "--model", model, "--reference", reference,
                        *_only(*DIFF, "MODEL-BATCHED-DECODING"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = {r["clause"] for r in rows if r["status"] == "passed"}
    assert set(DIFF) | {"MODEL-BATCHED-DECODING"} <= passed, rows


_FACTORIES = '''
from zoo.config.builder import build_model
TINY = ["task=verify", "d_model=32", "heads=2", "layers=1", "d_ff=64", "vocab_size=64", "max_len=16"]
def decoder():
    return build_model(["model=decoder_only", "pos=rotary", *TINY])
def encoder(subject):
    return build_model(["model=encoder_only", *TINY])
def other_vocabulary(subject):
    return build_model(["model=decoder_only", "pos=rotary", *TINY, "vocab_size=32"])
def two_arguments(subject, other):
    return decoder()
def raises(subject):
    raise RuntimeError("no weights here")
def not_a_model(subject):
    return 3
'''


@pytest.mark.parametrize("reference,expected", [
    ("encoder", "its kind 'encoder_only' differs from the model under test's 'decoder_only'"),
    ("other_vocabulary", "its vocabulary size 32 differs from the model under test's 64"),
    ("two_arguments", "the factory requires 2 arguments (subject, other)"),
    ("raises", "the factory raised RuntimeError: no weights here"),
    ("missing", "has no attribute 'missing'"),
    ("not_a_model", "returned builtins.int; expected a zoo model"),
], ids=lambda value: value if " " not in value else "")
def test_an_unusable_reference_is_a_one_line_usage_error(tmp_path, reference, expected):
    factories = tmp_path / "factories.py"
    factories.write_text(_FACTORIES)
    proc, _ = _suite(tmp_path, "--collect-only", "--model", f"{factories}:decoder", "--reference",
                     f"{factories}:{reference}")
    lines = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert proc.returncode == 4 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize("args,expected", [
    (["--reference", "properties.catalog.differential:reference"], "needs the model it is compared with"),
    (["--reference-kernel", "no_such_kernel"], "--reference-kernel: kernel 'no_such_kernel'"),
])
def test_reference_options_checked_at_start_up(tmp_path, args, expected):
    proc, _ = _suite(tmp_path, "--collect-only", *args)
    assert proc.returncode == 4 and expected in proc.stderr, proc.stderr[-2000:]


def test_without_a_reference_the_differential_clauses_are_skipped_with_the_reason(tmp_path):
    proc, rows = _suite(tmp_path, "-m", "model", "--model", "properties.catalog.decode_bugs:tiny_lm", *_only(*DIFF))
    # every selected test skipped: nothing verified, which never passes (exit status 5 and one line)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: nothing verified")]
    assert proc.returncode == 5 and rows and len(lines) == 1 and "no --reference given" in lines[0], proc.stderr[-3000:]
    assert all(r["status"] == "skipped" and "no --reference given" in r["message"] for r in rows), rows


def test_catalog_entries_carry_extra_options(tmp_path):
    entry = Entry("x", "model", "m", ("MODEL-DIFF-FORWARD",), "--model", "a.b:c", ("--reference", "a.b:d"))
    assert entry.plug_in == ["--model", "a.b:c", "--reference", "a.b:d"]
    cmd = command(entry, tmp_path / "r.json")
    assert cmd[cmd.index("--model"):cmd.index("--model") + 4] == ["--model", "a.b:c", "--reference", "a.b:d"]


def test_decode_path_bugs_escape_the_older_clauses():
    """The claim of the catalog's MODEL-BATCHED-DECODING entries: every older model clause passes on them (their
    forward pass is right, and their bugs need one-token steps after a left-padded prefill, more than 8 positions,
    or a chunk of 8 after cached keys). Run at the default profile with a fixed seed, without -x."""
    entries = [e for e in CATALOG if e.expected == ("MODEL-BATCHED-DECODING",)]
    assert len(entries) >= 4
    with ThreadPoolExecutor(max_workers=int(os.environ.get("CATALOG_JOBS", "2"))) as pool:
        # MODEL-KV-CACHE's long draws (test_cached_decoding_at_length, issue 25) came after MODEL-BATCHED-DECODING.
        runs = list(pool.map(lambda e: run_entry(e, clauses=OLDER, seed=0, extra=("-k", "not at_length")), entries))
    for run in runs:
        assert run.returncode == 0 and run.rows and not run.failed_clauses, \
            f"{run.entry.name}: older clauses failed {run.failed_clauses}\n{run.output[-3000:]}"
        assert {"MODEL-KV-CACHE", "MODEL-PADDING", "MODEL-BATCH"} <= run.passed_clauses, run.entry.name


def test_reference_kernel_tells_broken_kernels_from_correct_ones(tmp_path):
    kernels = {"properties.catalog.kernels:scale_missing": "ATTN-DIFF",          # a wrong forward
               "properties.catalog.backward:dq_unscaled": "ATTN-DIFF-GRAD",      # an exact forward, a wrong backward
               "memory_efficient": None}                                         # correct
    args = [a for spec in kernels for a in ("--kernel", spec)]
    proc, rows = _suite(tmp_path, "--reference-kernel", "torch", "--device", "cpu", *args,
                        path="properties/kernel/test_reference_kernel.py")
    failed = {(r["nodeid"].split("[")[1].split("-cpu")[0], r["clause"]) for r in rows if r["status"] == "failed"}
    passed = {(r["nodeid"].split("[")[1].split("-cpu")[0], r["clause"]) for r in rows if r["status"] == "passed"}
    assert ("properties.catalog.kernels:scale_missing", "ATTN-DIFF") in failed, rows
    assert ("properties.catalog.backward:dq_unscaled", "ATTN-DIFF-GRAD") in failed, rows
    assert ("properties.catalog.backward:dq_unscaled", "ATTN-DIFF") in passed, rows
    assert {("memory_efficient", "ATTN-DIFF"), ("memory_efficient", "ATTN-DIFF-GRAD")} <= passed, rows
    assert not [f for f in failed if f[0] == "memory_efficient"], rows


# ------------------------------------------------------------------------------------- --reference upstream
_PORT = '''
import torch
from properties.catalog.config_bugs import gemma2, gemma2_scale_from_head_dim
from properties.core.subject import Subject

def renamed():   # a port whose weights live under other names: model.* -> port.*
    s = gemma2()
    class Port(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.port, self.config = inner.model, inner.config
            self.lm_head = inner.lm_head
    port = Port(s.module)
    return Subject(s.kind, s.forward, s.vocab_size, s.max_len, module=port, decode_step=s.decode_step)

def names(state):
    return {("model." + k[len("port."):] if k.startswith("port.") else k): v for k, v in state.items()}

NOT_A_MAPPING = 3
'''


def test_reference_upstream_is_transformers_own_model(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "port.py").write_text(_PORT)
    bug = "properties.catalog.config_bugs:gemma2_scale_from_head_dim"
    proc, rows = _suite(tmp_path, "-m", "model", "--model", bug, "--reference", "upstream", *_only("MODEL-DIFF-FORWARD"))
    assert proc.returncode == 1 and {r["clause"] for r in rows if r["status"] == "failed"} == {"MODEL-DIFF-FORWARD"}
    assert "the outputs part from the reference upstream" in proc.stdout, proc.stdout[-3000:]
    port = str(tmp_path / "port.py")
    proc, rows = _suite(tmp_path, "-m", "model", "--model", f"{port}:renamed", "--reference", "upstream",
                        "--reference-map", f"{port}:names", *_only("MODEL-DIFF-FORWARD"))
    assert proc.returncode == 0 and {r["status"] for r in rows} == {"passed"}, proc.stdout[-3000:]
    for extra, message in [((), r"needs \d+ weight\(s\) the model under test does not have by that name "
                                r"\(.*\); pass --reference-map FILE.py:NAMES"),
                           (("--reference-map", f"{port}:NOT_A_MAPPING"), "--reference-map: a int; expected a dict")]:
        proc, _ = _suite(tmp_path, "-m", "model", "--model", f"{port}:renamed", "--reference", "upstream", *extra)
        assert proc.returncode == 4 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert __import__("re").search(message, proc.stderr), proc.stderr
    proc, _ = _suite(tmp_path, "-m", "model", "--model", "examples/differential.py:zoo_memory_efficient", "--reference",
                     "upstream")
    assert proc.returncode == 4 and "carries no transformers config" in proc.stderr, proc.stderr
    proc, _ = _suite(tmp_path, "-m", "model", "--model", bug, "--reference-map", f"{port}:names")
    assert proc.returncode == 4 and "it goes with --reference upstream" in proc.stderr, proc.stderr
