"""Decoding with trained models: cached vs recomputed, greedy vs teacher forcing, task=generate and the CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from zoo.config.builder import model_from_config
from zoo.config.composition import compose_config
from zoo.io.checkpoint_read import CheckpointError
from zoo.tasks.data import BOS, IGNORE, PAD, SyntheticTask
from zoo.tasks.generate import generate, generate_task, pick_next
from zoo.config.errors import ConfigError
from zoo.tasks.train import fit_config_to_data, forward_batch, train

from cli_harness import zoo_in_process
from plain_install import plain_env
from training import TINY, flip_byte, train_config

pytestmark = pytest.mark.usefixtures("one_thread")


# -------------------------------------------------------------------------------------------- generation

@pytest.mark.parametrize("pos", ["learned", "rotary", "sinusoidal"])
@pytest.mark.parametrize("family", ["decoder_only", "encoder_decoder"])
def test_cached_decoding_equals_recomputing_the_prefix(family, pos):
    # float64: a random model's logits are close together, and in float32 the two summation orders could
    # flip an argmax; the claim is that both paths compute one function, which float64 shows sharply.
    cfg, data = fit_config_to_data(compose_config([f"model={family}", "task=train", *TINY, f"pos={pos}",
                                                   "layers=2", "kv_heads=1", "dtype=float64"]))
    torch.manual_seed(0)
    model = model_from_config(cfg)
    x, lengths = data.sample(6, "heldout")
    if family == "encoder_decoder":
        kw = dict(src=x, src_mask=torch.arange(x.shape[1]) < lengths[:, None])
        prompt = torch.full((6, 1), BOS)
    else:
        kw, prompt = {}, torch.cat([torch.full((6, 1), BOS), x[:, :3]], dim=1)
    max_new = model.max_len - prompt.shape[1] + 1
    cached = generate(model, prompt, max_new, eos_id=None, **kw)
    uncached = generate(model, prompt, max_new, eos_id=None, use_cache=False, **kw)
    assert cached.shape == (6, max_new) and torch.equal(cached, uncached)
    sampled = [generate(model, prompt, max_new, temperature=1.5, top_k=4, use_cache=c,
                        generator=torch.Generator().manual_seed(7), eos_id=None, **kw) for c in (True, False)]
    assert torch.equal(*sampled)
    with pytest.raises(ValueError, match="exceeds the model's max_len"):
        generate(model, prompt, max_new + 1, **kw)


def test_greedy_generation_of_a_trained_model_matches_teacher_forced_exact_match(tmp_path):
    result = train(train_config(tmp_path, "task.steps=150", "dropout=0", "task.eval_every=150",
                                family="encoder_decoder", data="copy"), quiet=True)
    model, data = result["model"], SyntheticTask("copy", vocab=6, min_len=2, max_len=5)
    batch = data.batch("encoder_decoder", 64, "heldout", 0)
    with torch.no_grad():
        right = (forward_batch(model.eval(), batch).argmax(-1) == batch["targets"]) | (batch["targets"] == IGNORE)
    forced = right.all(dim=1)
    out = generate(model, torch.full((64, 1), BOS), 6, src=batch["src"], src_mask=batch["src_mask"])
    out_cached_off = generate(model, torch.full((64, 1), BOS), 6, src=batch["src"], src_mask=batch["src_mask"],
                              use_cache=False)
    assert torch.equal(out, out_cached_off)
    targets = batch["targets"].masked_fill(batch["targets"] == IGNORE, PAD)
    greedy = (out == targets[:, : out.shape[1]]).all(dim=1)
    assert torch.equal(greedy, forced)
    assert 0 < int(forced.sum())  # some right and the comparison is not vacuous


def test_pick_next_top_k_and_temperature():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    assert pick_next(logits).tolist() == [1]
    draws = {int(pick_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(s))) for s in range(50)}
    assert draws == {1, 2}


# -------------------------------------------------------------------------------------------- task=generate

def generate_config(checkpoint, *extra):
    return compose_config(["task=generate", f"task.checkpoint='{checkpoint}'", *extra])


def test_generate_task_prints_prompts_answers_and_exact_match(finished_run, capsys):
    generate_task(generate_config(finished_run, "task.samples=5"))
    out = capsys.readouterr().out
    out_eager = out.splitlines()
    assert "(step 4)" in out and "greedy, with a static KV cache" in out and "exact match" in out
    assert len([line for line in out.splitlines() if "->" in line]) == 5
    generate_task(generate_config(finished_run / "step-0000002", "task.prompt='5 0 3'", "task.temperature=0.7",
                                  "task.top_k=3", "task.cache=false"))
    out = capsys.readouterr().out
    assert "(step 2)" in out and "without a KV cache" in out and "5 0 3  ->" in out
    # task.compile: the decoding step compiled whole (aot_eager on the CPU), the same answers as the eager step.
    generate_task(generate_config(finished_run, "task.samples=5", "task.compile=aot_eager"))
    compiled = capsys.readouterr().out
    assert "with a static KV cache, the step compiled (aot_eager)" in compiled
    assert [line for line in compiled.splitlines() if "->" in line] == [line for line in out_eager if "->" in line]


@pytest.mark.parametrize("extra,words", [
    (("task.prompt='1 2 x'",), ["task.prompt", "symbols 0..5"]),
    (("task.prompt='1 2 6'",), ["task.prompt", "symbols in 0..5"]),
    (("task.prompt='1 2 3 4 5 0'",), ["6 symbols", "at most 5"]),
    (("task.max_new=50",), ["task.max_new=50", "max_len"]),
    (("task.compile=fast",), ["task.compile=fast", "reduce-overhead", "aot_eager"]),
    (("task.compile=aot_eager", "task.block_size=4"), ["task.compile=aot_eager", "static KV cache"]),
])
def test_generate_task_bad_options_are_config_errors(finished_run, extra, words):
    with pytest.raises(ConfigError) as error:
        generate_task(generate_config(finished_run, *extra))
    assert all(w in str(error.value) for w in words), str(error.value)


def test_generate_task_needs_a_checkpoint_of_a_generating_model(tmp_path):
    with pytest.raises(ConfigError, match="task.checkpoint: required"):
        generate_task(compose_config(["task=generate"]))
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        generate_task(generate_config(tmp_path))
    train(train_config(tmp_path, "task.steps=2", family="encoder_only"), quiet=True)
    with pytest.raises(ConfigError, match="encoder_only model, which labels tokens"):
        generate_task(generate_config(tmp_path))


# -------------------------------------------------------------------------------------------- command line

def run_zoo(*arguments: str, cwd) -> subprocess.CompletedProcess:
    """README's training and decoding commands as they run after README's plain set-up (no extras; one thread, as
    the one_thread fixture: threads only slow a tiny model down)."""
    return subprocess.run([sys.executable, "-m", "zoo", *arguments], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=plain_env(cwd / ".plain-install"))


def test_cli_trains_then_generates_from_the_checkpoint(tmp_path):
    result = run_zoo("model=decoder_only", "task=train", "data=reverse", *TINY, "task.steps=20", "task.batch=16",
                     "task.eval_every=10", "task.checkpoint_every=10", "task.eval_batches=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "held-out exact match:" in result.stdout and "step     10" in result.stdout
    # The default out_dir is Hydra's output directory of the run.
    [run_dir] = {p.parent for p in tmp_path.glob("outputs/*/*/step-0000020")}
    assert (run_dir / "step-0000010").is_dir()

    result = run_zoo("task=generate", f"task.checkpoint='{run_dir}'", "task.samples=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "(step 20)" in result.stdout and "exact match" in result.stdout and "->" in result.stdout

    # Errors a task finds only once it runs still come out as one line and status 2. They take the same path in
    # this process (tests/cli_harness.py, the tasks for real) as in the two processes above, without their start-up.
    flip_byte(run_dir / "step-0000020" / "model.safetensors")
    for arguments, words in [
        (("model=encoder_only", "task=train", "data=reverse"), ["data=reverse", "does not fit", "running_max"]),
        (("task=generate", f"task.checkpoint='{run_dir}'"), ["bad checkpoint", "damaged"]),
    ]:
        outcome = zoo_in_process(list(arguments), tmp_path, real_tasks=True)
        lines = outcome.err.strip().splitlines()
        assert outcome.status == 2 and len(lines) == 1 and "Traceback" not in outcome.err, outcome.err
        assert all(w in lines[0] for w in words), lines[0]
