"""Every bad `python -m zoo` input of issue 27 is one line and status 2, whatever the entry path (a single run, a
sweep, Hydra's own flags), and writes nothing; valid command lines still reach their task. In this process
(tests/cli_harness.py); tests/test_cli_fuzz.py draws many more."""
from __future__ import annotations

import json
import time

import pytest

from cli_harness import assert_one_line_refusal, zoo_in_process


@pytest.fixture
def places(tmp_path):
    """(the directory the command runs in, a file where a directory is expected)."""
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "a_file").write_text("a file where a directory should be\n")
    return work, tmp_path / "a_file"


@pytest.mark.parametrize("argv,words", [
    (["seed=99999999999999999999999"], ["seed=99999999999999999999999", "seed range"]),
    (["=5"], ["=5", "no key"]),
    (["~attention"], ["~attention", "cannot be removed", "allowed: math"]),
    (["~d_model"], ["~d_model", "cannot be removed"]),
    (["-m", "heads=3,abc"], ["heads=", "d_model=64"]),
    (["-m", "model=nosuch,decoder_only"], ["model=nosuch", "no such option", "decoder_only"]),
    (["--cfg", "job", "heads=abc"], ["heads=abc", "integer"]),
    (["-cn", "nosuch"], ["--config-name=nosuch"]),
    (["-cp", "/nonexistent"], ["--config-path=/nonexistent", "no such directory"]),
    (["-cd"], ["--config-dir", "expected one argument"]),
    (["-cd", "/nonexistent"], ["--config-dir=/nonexistent", "no such directory"]),
    (["--info", "nosuch"], ["--info", "invalid choice"]),
    (["--shell-completion", "nosuch"], ["--shell-completion", "install=SHELL"]),
    (["--shell-completion", "install=tcsh"], ["install=tcsh", "no such shell"]),
    (["--experimental-rerun", "/nonexistent.pickle"], ["--experimental-rerun=/nonexistent.pickle", "no such file"]),
    (["--experimental-rerun", "x.pickle", "heads=2"], ["--experimental-rerun", "heads=2"]),
    (["hydra.run.dir=${nosuch:x}"], ["hydra.run.dir=${nosuch:x}", "does not resolve"]),
    (["-m", "heads=1,2", "hydra.sweep.dir=${nosuch:x}"], ["hydra.sweep.dir", "does not resolve"]),
    (["heads=${nosuch:x}"], ["heads", "does not resolve"]),
    (["reference=abc"], ["reference=abc", "task=compare"]),
    (["reference=hf", "task=summary"], ["reference=hf", "task=compare"]),
    (["recipe=nosuch"], ["recipe=nosuch", "no such option", "train/tiny/decoder_only/copy"]),
    (["data=sort"], ["data=sort", "not read by task=run"]),
    (["task=generate", "heads=2", "task.checkpoint=x"], ["heads=2", "not read by task=generate"]),
    (["task=compare", "preset=gpt2_small", "dtype=float16"], ["dtype=float16", "not read by task=compare"]),
    (["allow_plugins=true"], ["allow_plugins=true", "loads none"]),
    (["layers=1e9"], ["layers=1000000000", "allowed: 1 to 4096"]),
    (["-m", "layers=1,1e9"], ["layers=1000000000"]),
    (["d_model=1099511627776"], ["model too large", "9,671,406,559,162,236,141,568,512 parameters"]),
    (["d_model=1073741824"], ["model too large", "parameters in float32", "available"]),
    (["task=train", "d_model=1073741824"], ["model too large", "AdamW"]),
    (["--cfg", "job", "--package", "nosuch"], ["--package=nosuch", "no such package"]),
    (["--package", "task"], ["--package=task", "--cfg"]),
    (["--resolve"], ["--resolve"]),
    (["--cfg", "job", "-m"], ["only one of"]),
    (["-m", "heads=range(0,100000)"], ["more than 1,024"]),
    (["-m", "heads=interval(1,2)"], ["interval"]),
    (["heads=1,2"], ["heads=1,2", "sweep"]),
    (["task=compare", "preset=tiny"], ["preset=tiny", "allowed: gpt2_small"]),
    (["task=compare", "preset=gpt2_small", "reference=torch"], ["reference=torch", "reference=hf"]),
    (["task=compare", "preset=gpt2_small", "task.seq_len=1"], ["task.seq_len=1"]),
    (["task=generate"], ["task.checkpoint: required"]),
    (["heads=3", "d_model=1000000000000000003"], ["heads=3", "allowed: 1, 1000000000000000003"]),
    (["-m", "heads=" + "[" * 3000 + "]" * 3000], ["nested 3,000 deep"]),  # Hydra's parser recurses
    (["+a" + ".b" * 5000 + "=1"], ["a key of 10,002 characters"]),  # Hydra looks for a group of that name
    (["task.prompt=" + "1 " * 10000], ["20,012 characters"]),  # Hydra's parser takes seconds per 10 KiB
    ([""], ["empty argument"]),
    (["~attention.window"], ["nothing to remove"]),
    (["~model.layers"], ["model.layers: missing"]),
    (["attention.kv_heads=3"], ["attention: kv_heads=3 must be a positive divisor of heads=4"]),
    (["++attention._target_=0.5"], ["attention._target_=0.5", "import path"]),
    (["norm_placement='a\nb\x85c\u2028d'"], ["norm_placement=a\\nb\\x85c\\u2028d"]),  # one line: escaped
])
def test_a_bad_input_is_one_line_and_writes_nothing(places, argv, words):
    work, _ = places
    assert_one_line_refusal(zoo_in_process(argv, work), *words)


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir"])
def test_an_output_directory_under_a_file_is_one_line(places, key):
    """Refused before Hydra starts (in the words of zoo/cli/directories.py, not "Hydra cannot start the run"): a
    sweep's job directories (sweep.dir / sweep.subdir) as well as the sweep's."""
    work, a_file = places
    argv = (["-m", "heads=1,2"] if "sweep" in key else []) + [f"{key}={a_file}/x", "task=summary"]
    assert_one_line_refusal(zoo_in_process(argv, work, watch=work.parent), key, "cannot be written", "Not a directory")


def test_a_sweep_that_repeats_a_job_runs_it_twice(places):
    """Each job gets its own copy of the config the plan composed: the launcher numbers every job on its config, and
    a sweep may list the same overrides twice."""
    work, _ = places
    outcome = zoo_in_process(["-m", "heads=2,2", "task=summary"], work)
    assert outcome.status == 0 and outcome.ran == ["summary", "summary"], outcome.err[-2000:]
    assert sorted(p.name for p in work.glob("multirun/*/*/*/")) == ["0", "1"]


@pytest.mark.parametrize("argv", [["hydra.job_logging.root.level=NOSUCH"], ["hydra.output_subdir=/proc/x"]])
def test_what_only_hydras_run_finds_is_one_line_and_leaves_nothing(places, argv):
    """Hydra's own machinery (logging set up from hydra.job_logging, where it saves the config) fails after it
    made the output directory: still one line, and the directory goes."""
    work, _ = places
    assert_one_line_refusal(zoo_in_process([*argv, "task=summary"], work), "Hydra cannot start the run")


def test_an_out_dir_that_takes_no_files_says_so(places):
    work, _ = places
    line = assert_one_line_refusal(zoo_in_process(["task=train", "task.out_dir=/proc"], work), "task.out_dir=/proc")
    assert "no file can be created in /proc" in line


def test_the_size_check_of_a_deep_model_is_immediate(places):
    work, _ = places
    started = time.process_time()
    assert_one_line_refusal(zoo_in_process(["layers=4096", "d_model=65536", "heads=1"], work), "model too large")
    assert time.process_time() - started < 5  # counted from the config, not built (4,096 layers on meta: minutes)


def test_a_state_json_nested_200000_deep_is_a_bad_checkpoint(places):
    from zoo.io.checkpoint_read import MANIFEST, manifest_of

    work, _ = places
    step = work.parent / "run" / "step-0000001"
    step.mkdir(parents=True)
    for name in ("model.safetensors", "train_state.safetensors"):
        (step / name).write_bytes(b"\0" * 16)
    (step / "state.json").write_text("[" * 200_000 + "]" * 200_000)
    (step / MANIFEST).write_text(json.dumps(manifest_of(step)))  # resealed: only the nesting is wrong
    outcome = zoo_in_process(["task=generate", f"task.checkpoint={step.parent}"], work, real_tasks=True)
    assert_one_line_refusal(outcome, "bad checkpoint", "nested 200,000 deep")


def test_a_manifest_with_too_many_entries_is_a_bad_checkpoint(tmp_path):
    from zoo.io.checkpoint_read import _MANIFEST_FORMAT, MANIFEST, CheckpointError, _manifest_digest, read_state

    step = tmp_path / "step-0000001"
    step.mkdir()
    body = {"format": _MANIFEST_FORMAT, "files": {f"f{i}": {"bytes": 0, "sha256": ""} for i in range(100)}}
    (step / MANIFEST).write_text(json.dumps({**body, "sha256": _manifest_digest(body)}))
    with pytest.raises(CheckpointError, match="100 entries, more than the 16"):
        read_state(step)
    (step / MANIFEST).write_text(" " * (65 << 10))
    with pytest.raises(CheckpointError, match="more than the 65,536 a manifest may have"):
        read_state(step)


@pytest.mark.parametrize("argv,ran", [
    (["model=decoder_only", "heads=8"], ["run"]),
    (["preset=gpt2_small", "task=summary"], ["summary"]),
    (["-m", "model=encoder_only,decoder_only", "heads=1,2", "task=verify"], ["verify"] * 4),
    (["heads=2", "-m", "layers=1,2", "task=summary"], ["summary"] * 2),  # options after overrides, too
    (["model=decoder_only", "task=train", "data=reverse", "task.steps=1", "~recipe"], ["train"]),
    (["task=generate", "task.checkpoint=runs/rev", "task.temperature=0.8", "task.top_k=4"], ["generate"]),
    (["preset=gpt2_small", "task=compare", "reference=hf"], ["compare"]),
])
def test_valid_command_lines_reach_their_task(places, argv, ran):
    work, _ = places
    (work / "runs" / "rev" / "step-0000001").mkdir(parents=True)  # what task=generate finds before it runs
    (work / "runs" / "rev" / "step-0000001" / "state.json").write_text("{}")
    outcome = zoo_in_process(argv, work)
    assert outcome.status == 0 and outcome.ran == ran, outcome.err[-3000:]


@pytest.mark.parametrize("argv,expected", [(["--cfg", "job", "heads=2"], "heads: 2"), (["--help"], "transformer-zoo:"),
                                           (["--info", "defaults"], "Defaults List")])
def test_hydra_flags_that_print_still_print_and_write_nothing(places, argv, expected):
    work, _ = places
    outcome = zoo_in_process(argv, work)
    assert outcome.status == 0 and expected in outcome.out and not outcome.written, outcome.err[-3000:]


EXITING_PART = """\
import sys
from torch import nn


class Attention(nn.Module):
    def __init__(self, d_model, heads, kv_heads=None, bias=True, dropout=0.0, kernel="math", *, device=None,
                 dtype=None):
        super().__init__()
        sys.exit(0)
"""


def test_a_plug_in_that_calls_sys_exit_while_built_is_one_line_not_a_silent_exit(places, monkeypatch):
    work, _ = places
    (work.parent / "exiting_part.py").write_text(EXITING_PART)
    monkeypatch.syspath_prepend(str(work.parent))
    outcome = zoo_in_process(["task=summary", "attention._target_=exiting_part.Attention"], work, real_tasks=True)
    assert_one_line_refusal(outcome, "sys.exit(0)", "plug-in")


def _readme_commands() -> list[str]:
    """Every `python -m zoo ...` command of README.md and the pages of docs/ that a user may run as written (not the
    `$ ...` examples of refusals, not placeholders such as mypkg or NAME, not README's recipe that uses the kernel
    file an earlier recipe wrote: tests/test_readme_recipes.py runs the recipes; not the CHANGELOG, whose commands
    are history and may name a placeholder kernel)."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
                     if p.name != "CHANGELOG.md")
    found = re.findall(r"^python -m zoo ([^\n#]*)", text, re.M) + re.findall(r"`python -m zoo ([^`]*)`", text)
    commands = []
    for words in found:
        words = words.strip()
        if words and not any(p in words for p in ("mypkg", "NAME", "wrong_scale", "my.py", "...", "ARGS")):
            commands.append(words)
    return sorted(set(commands), key=commands.index)


@pytest.mark.parametrize("command", _readme_commands())
def test_every_readme_command_passes_the_checks(tmp_path, monkeypatch, command):
    """bars/12's commands keep working: each passes every check before Hydra (zoo.cli.plan.plan), which is
    where a bad input stops; its task then runs as it did before (tests/test_cli.py, test_train.py ...)."""
    import shlex

    from zoo.cli.plan import plan

    monkeypatch.chdir(tmp_path)
    if "task.resume=true" in command or "task=generate" in command:  # what the earlier command would have left
        (tmp_path / "runs" / "rev" / "step-0000001").mkdir(parents=True)
        (tmp_path / "runs" / "rev" / "step-0000001" / "state.json").write_text("{}")
    checked = plan(shlex.split(command))
    assert checked.mode in ("run", "multirun", "help") and not list(tmp_path.glob("outputs")), checked


@pytest.mark.parametrize("command,said", [
    ("heads=3", "zoo: invalid config: heads=3: must divide d_model=64 (allowed: 1, 2, 4, 8, 16, 32, 64)"),
    ("model=transformer", "zoo: invalid config: model=transformer: no such option (allowed: decoder_only, "
                          "encoder_decoder, encoder_only)"),
    ("-m model=nosuch,decoder_only", "zoo: invalid config: model=nosuch: no such option (allowed: decoder_only, "
                                     "encoder_decoder, encoder_only)"),
    ("'hydra.run.dir=${nosuch:x}'", "zoo: invalid config: hydra.run.dir=${nosuch:x}: the interpolation does not "
                                    "resolve: Unsupported interpolation type nosuch"),
    ("reference=hf", "zoo: invalid config: reference=hf: only task=compare compares with a reference, not task=run"),
    ("d_model=1073741824", "zoo: model too large: the model does not fit in memory: 9,223,374,229,435,580,928 "
                           "parameters in float32 need at least 32.0 EiB (weights and buffers, and the activations "
                           "of a batch of 2 x 32 tokens) on cpu, and "),
])
def test_the_refusals_the_zoo_page_shows_are_what_the_cli_says(places, command, said):
    import shlex
    from pathlib import Path

    shown = (Path(__file__).resolve().parents[1] / "docs" / "zoo.md").read_text(encoding="utf-8")
    assert f"$ python -m zoo {command}\n{said}" in shown
    work, _ = places
    assert assert_one_line_refusal(zoo_in_process(shlex.split(command), work)).startswith(said)


def test_a_checkpoint_file_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    """A FIFO in place of state.json or a weight file would block the first read forever."""
    import os

    from zoo.io.checkpoint_read import CheckpointError, read_state

    step = tmp_path / "step-0000001"
    step.mkdir()
    for name in ("model.safetensors", "train_state.safetensors"):
        (step / name).write_bytes(b"\0")
    os.mkfifo(step / "state.json")
    os.mkfifo(step / "manifest.json")
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_state(step)
