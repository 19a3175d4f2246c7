"""Checkpoints are files people share: loading one (task=generate, task=train task.resume=true) runs nothing it
names outside the zoo, and every file of it is checked against the checksums recorded when it was saved.

The hostile checkpoints below are "resealed" (manifest.json rewritten to match the edited files), as an adversary
would do: what stops them is the allow-list, not the checksums. The checksum tests edit without resealing, as an
accident or a careless hand would."""
from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zoo.io.checkpoint_read
from zoo.config.composition import compose_config
from zoo.io.checkpoint_read import MANIFEST, CheckpointError, checkpoints_in, read_state
from zoo.tasks.generate import generate_task
from zoo.tasks.train import train

from training import train_config, tree_digest

pytestmark = pytest.mark.usefixtures("one_thread")

SENTINEL_SOURCE = """\
from pathlib import Path
Path({marker!r}).write_text("the checkpoint ran me")


def attention(*args, **kwargs):
    Path({marker!r}).write_text("the checkpoint called me")
    raise RuntimeError("sentinel kernel")


class Model:
    def __init__(self, *args, **kwargs):
        Path({marker!r}).write_text("the checkpoint built me")
"""

GOOD_KERNEL = """\
import torch.nn.functional as F


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
"""


@pytest.fixture
def run(finished_run_once, tmp_path):
    """A private copy of the session's finished tiny run (steps 2 and 4), in tmp_path/run: the bait goes beside it."""
    copy = tmp_path / "run"
    shutil.copytree(finished_run_once, copy)
    return copy


@pytest.fixture
def bait(tmp_path, monkeypatch):
    """victim.txt (must stay as it is), sentinel.py (importing or calling it leaves tmp_path/RAN), on sys.path."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    (tmp_path / "sentinel.py").write_text(SENTINEL_SOURCE.format(marker=str(tmp_path / "RAN")))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sentinel", raising=False)
    return tmp_path


def edit_state(checkpoint: Path, edit, *, reseal: bool) -> None:
    state = json.loads((checkpoint / "state.json").read_text())
    edit(state)
    (checkpoint / "state.json").write_text(json.dumps(state, indent=1))
    if reseal:
        (checkpoint / MANIFEST).write_text(json.dumps(zoo.io.checkpoint_read.manifest_of(checkpoint)))


@functools.lru_cache(maxsize=None)
def _composed(kind: str, *extra: str):
    if kind == "generate":
        return compose_config(["task=generate", "task.checkpoint=PLACEHOLDER", "task.samples=2", *extra])
    return train_config("PLACEHOLDER", *extra)


def generate_config(checkpoint, *extra):
    cfg = copy.deepcopy(_composed("generate", *extra))  # composing costs more than the check under test
    cfg.task.checkpoint = str(checkpoint)
    return cfg


def resume_config(run, steps=8):
    cfg = copy.deepcopy(_composed("train", f"task.steps={steps}", "task.resume=true"))
    cfg.task.out_dir = str(run)
    return cfg


def assert_untouched(bait: Path) -> None:
    assert not (bait / "RAN").exists(), (bait / "RAN").read_text()
    assert (bait / "victim.txt").read_text() == "precious data\n"
    assert "sentinel" not in sys.modules


# ---------------------------------------------------------------------------------------- what a checkpoint names

def _nested(key, value):
    def edit(state):
        state["config"][key] = value
    return edit


HOSTILE = {
    "kernel file": (lambda s, b: s["config"]["attention"].update(kernel=f"{b / 'sentinel.py'}:attention"),
                    "attention.kernel="),
    "kernel module": (lambda s, b: s["config"]["attention"].update(kernel="sentinel:attention"), "attention.kernel="),
    "model class": (lambda s, b: s["config"]["model"].update(_target_="sentinel.Model"), "model._target_="),
    "stdlib call": (lambda s, b: s["config"]["norm"].update(_target_="pathlib.Path.write_text"), "norm._target_="),
    "nested call": (lambda s, b: s["config"]["ffn"].update(
        bias={"_target_": "builtins.open", "_args_": [str(b / "victim.txt"), "w"]}), "ffn.bias._target_="),
    "positional args": (lambda s, b: s["config"]["attention"].update(_args_=[str(b / "victim.txt"), "w"]),
                        "attention._args_"),
    "data node": (lambda s, b: s["config"]["data"].update(_target_="os.remove", path=str(b / "victim.txt")),
                  "data._target_="),
    "interpolation": (lambda s, b: s["config"].update(d_model="${oc.env:HOME}"), "d_model="),
    "switch in the file": (lambda s, b: (s["config"].update(allow_plugins=True),
                                         s["config"]["attention"].update(kernel="sentinel:attention")),
                           "attention.kernel="),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_checkpoint_runs_nothing_on_generate_or_resume(run, bait, name):
    edit, key = HOSTILE[name]
    for checkpoint in checkpoints_in(run):
        edit_state(checkpoint, lambda state: edit(state, bait), reseal=True)
    before = tree_digest(run)
    with pytest.raises(CheckpointError) as error:
        generate_task(generate_config(run))
    message = str(error.value)
    assert "\n" not in message and key in message, message
    assert_untouched(bait)
    with pytest.raises(CheckpointError) as error:
        train(resume_config(run), quiet=True)
    assert key in str(error.value), str(error.value)
    assert_untouched(bait)
    assert tree_digest(run) == before


def test_the_cli_refuses_a_hostile_checkpoint_in_one_line(run, bait):
    # sentinel.py lies in the working directory, which `python -m` puts on sys.path.
    for checkpoint in checkpoints_in(run):
        edit_state(checkpoint, lambda state: (state["config"]["model"].update(_target_="sentinel.Model"),
                                              state["config"]["attention"].update(kernel="sentinel.py:attention")),
                   reseal=True)
    result = subprocess.run([sys.executable, "-m", "zoo", "task=generate", f"task.checkpoint='{run}'"], cwd=bait,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "model._target_='sentinel.Model'" in lines[0] and "allow_plugins=true" in lines[0], lines[0]
    assert_untouched(bait)


def test_allow_plugins_on_the_command_line_is_the_only_way_to_load_a_plugged_kernel(tmp_path, bait):
    kernel = tmp_path / "good_kernel.py"
    kernel.write_text(GOOD_KERNEL)
    out = tmp_path / "plugged"
    train(train_config(out, "task.steps=2", "task.checkpoint_every=2", f"attention.kernel='{kernel}:attention'"),
          quiet=True)
    with pytest.raises(CheckpointError, match=r"attention\.kernel=.*good_kernel\.py:attention.*allow_plugins=true"):
        generate_task(generate_config(out))
    generate_task(generate_config(out, "allow_plugins=true"))  # the user's explicit switch: loads and decodes
    # Resuming with the same plug-in named on the command line asks for it: no switch needed.
    train(train_config(out, "task.steps=4", "task.checkpoint_every=2", "task.resume=true",
                       f"attention.kernel='{kernel}:attention'"), quiet=True)
    # ... but another plug-in path in the checkpoint than the one the command line names is refused.
    edit_state(out / "step-0000004", lambda s: s["config"]["attention"].update(kernel="sentinel:attention"),
               reseal=True)
    with pytest.raises(CheckpointError, match="sentinel:attention"):
        train(train_config(out, "task.steps=6", "task.resume=true", f"attention.kernel='{kernel}:attention'"),
              quiet=True)
    assert_untouched(bait)


# ------------------------------------------------------------------------------------------------ checksums

def _set_step(state):
    state["step"] = 3


def _set_lr(state):
    state["optimizer"]["param_groups"][0]["lr"] = 1.0


def _edit_manifest(checkpoint):
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["state.json"]["sha256"] = "0" * 64  # as if state.json were edited and the manifest by hand
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _truncate(checkpoint, name):
    data = (checkpoint / name).read_bytes()
    (checkpoint / name).write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage,words", [
    (lambda c: edit_state(c, _set_step, reseal=False), ["state.json is damaged", "recorded at save time"]),
    (lambda c: edit_state(c, _set_lr, reseal=False), ["state.json is damaged", "recorded at save time"]),
    (lambda c: _truncate(c, "model.safetensors"), ["model.safetensors is damaged", "truncated to"]),
    (lambda c: _truncate(c, "train_state.safetensors"), ["train_state.safetensors is damaged", "truncated to"]),
    (lambda c: _truncate(c, "state.json"), ["state.json is damaged", "truncated to"]),
    (lambda c: (c / MANIFEST).unlink(), ["manifest.json is missing"]),
    (lambda c: _truncate(c, MANIFEST), ["manifest.json is damaged"]),
    (lambda c: _edit_manifest(c), ["manifest.json is damaged", "own sha256"]),
])
def test_every_file_of_a_checkpoint_is_checked_before_use(run, damage, words):
    damage(run / "step-0000004")
    before = tree_digest(run)
    for attempt in (lambda: train(resume_config(run), quiet=True),
                    lambda: generate_task(generate_config(run))):
        with pytest.raises(CheckpointError) as error:
            attempt()
        message = str(error.value)
        assert "\n" not in message and all(w in message for w in words), message
    assert tree_digest(run) == before


@pytest.mark.parametrize("edit,words", [
    (lambda s: s.update(step="four"), ["step='four' is not an integer"]),
    (lambda s: s.update(step=-4), ["step=-4 is negative"]),
    (lambda s: s.update(step=5), ["step=5 but the directory is step-0000004"]),
    (lambda s: s.update(optimizer={}), ["optimizer.param_groups=None"]),
    (lambda s: s.update(optimizer=""), ["optimizer='' is not a mapping"]),
    (lambda s: s["optimizer"]["param_groups"].__setitem__(0, {}), ["param_groups[0].params=None"]),
    (lambda s: s["optimizer"]["param_groups"][0].pop("lr"), ["param_groups[0] lacks lr"]),
    (lambda s: s["optimizer"]["param_groups"][0].update(lr="fast"), ["param_groups[0].lr='fast'"]),
    (lambda s: s["optimizer"]["param_groups"][0].update(betas=[0.9]), ["betas=[0.9] is not a pair"]),
    (lambda s: s["optimizer"].update(scalars={"x.step": 1}), ["scalars['x.step']"]),
])
def test_a_resealed_state_with_wrong_entries_is_one_line(run, edit, words):
    edit_state(run / "step-0000004", edit, reseal=True)
    before = tree_digest(run)
    with pytest.raises(CheckpointError) as error:
        train(resume_config(run), quiet=True)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert tree_digest(run) == before


def test_a_saved_config_that_is_not_a_zoo_config_is_one_line(run):
    edit_state(run / "step-0000004", lambda s: s.update(config={"d_model": 32, "heads": "many"}), reseal=True)
    with pytest.raises(CheckpointError, match=r"state\.json: not a zoo config \(.*heads") as error:
        generate_task(generate_config(run / "step-0000004"))
    assert "\n" not in str(error.value)
    edit_state(run / "step-0000002", lambda s: s["config"]["norm"].update(eps=float("nan")), reseal=True)
    with pytest.raises(CheckpointError, match=r"its config is not valid: norm\.eps=nan: must be a finite number"):
        generate_task(generate_config(run / "step-0000002"))


def test_a_saved_checkpoint_verifies_and_names_every_file(run):
    manifest = json.loads((run / "step-0000004" / MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "train_state.safetensors", "state.json"}
    assert read_state(run / "step-0000004")["step"] == 4
    assert "allow_plugins" not in read_state(run / "step-0000004")["config"]  # a switch, never saved
