"""`python -m zoo` as a user runs it: from another directory, with good and bad values.

A process is started where the process is the point: README's main command after README's plain set-up, the exit
status and stderr of the interpreter on a bad value, and a missing extra in the plain set-up. The other command
lines run in this process (tests/cli_harness.py: Hydra for real, the tasks for real where their output is read),
which spares the 3-6 s start-up (torch, Hydra) of each."""
from __future__ import annotations

import subprocess
import sys

import pytest
from plain_install import plain_env

from cli_harness import assert_one_line_refusal, zoo_in_process


def zoo(*arguments: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zoo", *arguments], cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=120, env=env)


def test_default_command_prints_the_card_and_forward_then_a_quick_verification(tmp_path):
    # README's main command, after README's plain set-up: no package of an extra is importable
    result = zoo("model=decoder_only", "heads=8", cwd=tmp_path, env=plain_env(tmp_path / "plain"))
    assert result.returncode == 0, result.stderr
    assert "heads=8" in result.stdout and "total" in result.stdout
    assert "forward    (2, 32) -> (2, 32, 1000)" in result.stdout
    card, _, verification = result.stdout.partition("verifying:")   # then the quick verification, in the same run
    assert "total" in card and "forward" in card
    assert "MODEL-CAUSAL" in verification and "0 failed" in verification


@pytest.mark.parametrize("preset,total", [("gpt2_small", "124,439,808"), ("bert_base", "109,482,240"),
                                          ("vaswani_base", "63,084,544")])
def test_summary_prints_exact_counts(tmp_path, preset, total):
    result = zoo_in_process([f"preset={preset}", "task=summary"], tmp_path, real_tasks=True)
    assert result.status == 0, result.err
    assert total in result.out
    if preset == "vaswani_base":
        assert "44,140,544" in result.out


def test_bad_value_from_the_interpreter_is_one_line_and_status_2(tmp_path):
    # The process's own exit status and stderr; the other bad values below take the same path in this process.
    result = zoo("heads=3", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(word in lines[0] for word in ["heads=3", "must divide d_model=64", "allowed"]), lines[0]


@pytest.mark.parametrize("override,words", [
    ("heads=3", ["heads=3", "must divide d_model=64", "allowed"]),
    ("kv_heads=3", ["kv_heads=3", "allowed"]),
    ("heads=abc", ["heads=abc", "integer"]),
    ("model=transformer", ["model=transformer", "allowed", "decoder_only"]),
    ("ffn.activation=tanh", ["ffn.activation=tanh", "relu"]),
    ("attention.bogus=1", ["attention.bogus", "unknown key"]),
    ("+attention.bogus=1", ["attention.bogus=1", "not a parameter", "kv_heads"]),
    ("dropout=2", ["dropout=2", "[0, 1)"]),
    ("attention._target_=nowhere.Attention", ["attention._target_=nowhere.Attention", "no module"]),
])
def test_bad_value_is_one_line_and_status_2(tmp_path, override, words):
    assert_one_line_refusal(zoo_in_process([override], tmp_path), *words)


@pytest.mark.parametrize("preset,reference", [("gpt2_small", "hf"), ("vaswani_base", "torch")])
def test_compare_prints_differences_within_bounds(tmp_path, preset, reference):
    result = zoo_in_process([f"preset={preset}", "task=compare", f"reference={reference}"], tmp_path, real_tasks=True)
    assert result.status == 0, result.err
    assert "logits" in result.out and "all within bound" in result.out


def test_compare_with_the_wrong_reference_is_one_line(tmp_path):
    result = zoo_in_process(["preset=vaswani_base", "task=compare", "reference=hf"], tmp_path)
    assert result.status == 2
    assert result.err.strip() == "zoo: invalid config: reference=hf: preset=vaswani_base is compared with reference=torch"


def test_help_prints_the_project_help_then_hydras(tmp_path):
    from zoo.config.options import options

    result = zoo_in_process(["--help"], tmp_path)
    assert result.status == 0, result.err
    out = result.out
    ours, hydra_starts = out.index("transformer-zoo:"), out.index("== Configuration groups ==")
    assert ours == 0 and hydra_starts > ours, out[:400]
    project = out[:hydra_starts]
    for task in options("task"):  # every file of conf/task/, each with its line
        assert f"\n  {task} " in project, task
    for group in ("model", "attention", "ffn", "norm", "pos", "preset", "data"):
        assert f"\n  {group} " in project and all(option in project for option in options(group)), group
    for words in ("attention.kernel=pkg.mod:fn", "attention._target_=", "--kernel", "--model", "--zoo",
                  "pytest --pyargs properties", "python -m properties"):
        assert words in project, words
    assert zoo_in_process(["-h"], tmp_path).out.startswith("transformer-zoo:")


def test_compare_without_transformers_names_the_extra(tmp_path):
    result = zoo("preset=gpt2_small", "task=compare", "reference=hf", cwd=tmp_path, env=plain_env(tmp_path / "plain"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "transformer-zoo[hf]" in lines[0], result.stderr
