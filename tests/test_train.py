"""task=train at a size that runs in seconds: data, schedule, learning, checkpoints, exact resume, damaged
checkpoints, torch.compile (decoding and task=generate: test_generate.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import zoo.conf
import zoo.io.checkpoint
import zoo.tasks.train
from zoo.config.builder import model_from_config
from zoo.config.composition import compose_config
from zoo.io.checkpoint import load_weights
from zoo.io.checkpoint_read import CheckpointError, checkpoints_in, read_state
from zoo.config.options import DATA_TASKS
from zoo.tasks.data import BOS, EOS, IGNORE, N_SPECIAL, PAD, SEP, SyntheticTask, stream_seed
from zoo.config.errors import ConfigError
from zoo.config.task_schemas import DataOptions, GenerateTask, TrainTask
from zoo.tasks.train import evaluate, fit_config_to_data, forward_batch, learning_rate, train

from training import DATA_FOR, TINY, flip_byte, train_config, tree_digest

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("group,option,schema", [("task", "train", TrainTask), ("task", "generate", GenerateTask),
                                                 *[("data", name, DataOptions) for name in DATA_TASKS]])
def test_yaml_defaults_are_the_schema_defaults(group, option, schema):
    # ~recipe: without the training recipe that task=train on the default data would otherwise get
    node = OmegaConf.to_container(compose_config([f"{group}={option}", "~recipe"])[group], resolve=False)
    defaults = {f.name: f.default for f in dataclasses.fields(schema)}
    if schema is DataOptions:
        defaults["name"] = option
    assert node == defaults


# ------------------------------------------------------------------------------- recipes and experiments

RECIPES = Path(zoo.conf.__path__[0]) / "recipe"


def recipe_chosen(overrides):
    """The recipe conf/config.yaml selects for these overrides, as Hydra records the choice."""
    with initialize_config_module("zoo.conf", version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True).hydra.runtime.choices.recipe


def test_plain_training_command_gets_its_recipe_and_other_tasks_keep_the_papers_defaults():
    plain = compose_config(["model=decoder_only", "task=train", "data=reverse"])
    assert (plain.layers, plain.norm_placement, plain.dropout, plain.task.steps) == (3, "pre", 0.0, 2500)
    for task in ("run", "summary", "verify"):  # the same model and data, another task: the paper's settings
        cfg = compose_config(["model=decoder_only", "data=reverse", f"task={task}"])
        assert (cfg.layers, cfg.norm_placement, cfg.dropout) == (2, "post", 0.1), task
        assert cfg.pos._target_.endswith("SinusoidalPositions")
    # another preset or family has no recipe: nothing measured for it, so nothing is changed
    big = compose_config(["model=decoder_only", "task=train", "data=reverse", "preset=gpt2_small"])
    assert (big.layers, big.dropout, big.task.steps) == (12, 0.1, 2000)
    unmeasured = compose_config(["model=encoder_decoder", "task=train", "data=reverse"])
    assert (unmeasured.layers, unmeasured.norm_placement, unmeasured.task.steps) == (2, "post", 2000)
    off = compose_config(["model=decoder_only", "task=train", "data=reverse", "~recipe"])
    assert (off.layers, off.norm_placement, off.task.steps) == (2, "post", 2000)


def test_command_line_values_win_over_the_recipe():
    cfg = compose_config(["model=decoder_only", "task=train", "data=reverse", "layers=2", "dropout=0.1",
                          "norm_placement=post", "task.steps=7", "task.lr=1e-4"])
    assert (cfg.layers, cfg.dropout, cfg.norm_placement, cfg.task.steps, cfg.task.lr) == (2, 0.1, "post", 7, 1e-4)
    assert cfg.task.eval_batches == 16  # what was not given still comes from the recipe


@pytest.mark.parametrize("recipe", sorted(str(p.relative_to(RECIPES).with_suffix("")) for p in RECIPES.rglob("*.yaml")))
def test_every_recipe_is_chosen_by_its_own_combination_and_validates(recipe):
    task, preset, family, data = recipe.split("/")
    overrides = [f"task={task}", f"preset={preset}", f"model={family}", f"data={data}"]
    assert recipe_chosen(overrides) == recipe
    cfg = compose_config(overrides)  # validated: every key the recipe sets exists and has an allowed value
    values = zoo.tasks.train.recipe_values(recipe)
    assert values and all(OmegaConf.select(cfg, key) == value for key, value in values.items())
    fit_config_to_data(cfg)  # the data task fits the family


def test_recipe_is_said_when_training_starts_with_what_the_command_line_changed(tmp_path, capsys):
    overrides = ["model=decoder_only", "task=train", "data=reverse"]
    recipe = recipe_chosen(overrides)
    assert recipe == "train/tiny/decoder_only/reverse"
    cfg = compose_config([*overrides, *TINY, f"task.out_dir='{tmp_path}'", "task.steps=1", "task.batch=4",
                          "task.eval_batches=1"])
    train(cfg, recipe=recipe)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("recipe ")]
    assert len(lines) == 1, lines
    kept, _, otherwise = lines[0].partition("; set otherwise here: ")
    assert kept.split(": ", 1)[1].split() == ["norm_placement=pre", "dropout=0.0", "task.lr=0.003", "task.eval_every=500"]
    assert otherwise.split(" (")[0].split() == ["layers=1", "task.steps=1", "task.eval_batches=1"]
    assert "override any on the command line" in lines[0]
    assert zoo.tasks.train.recipe_line("train/tiny/encoder_only/running_max", cfg) is None  # none: no line


def test_every_training_target_is_a_command_that_composes_and_plain_ones_get_their_recipe():
    from bench.train_targets import TARGETS

    for name, overrides in TARGETS.items():
        compose_config(overrides)
        assert (recipe_chosen(overrides) is None) == (not name.startswith("plain-")), name


def test_the_training_page_shows_the_recipe_line_training_prints():
    page = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text().splitlines()
    shown = [line for line in page if line.startswith("recipe train/")]
    overrides = ["model=decoder_only", "task=train", "data=reverse"]
    assert shown == [zoo.tasks.train.recipe_line(recipe_chosen(overrides), compose_config(overrides))]


@pytest.mark.parametrize("experiment,family,data", [("reverse", "decoder_only", "reverse"),
                                                    ("sort", "encoder_decoder", "sort")])
def test_experiments_set_a_whole_training_run_and_the_command_line_still_wins(experiment, family, data):
    assert recipe_chosen([f"experiment={experiment}"]) is None  # an experiment states every setting itself
    cfg = compose_config([f"experiment={experiment}"])
    assert (cfg.task.name, cfg.data.name, cfg.model._target_.rsplit(".", 1)[1]) == (
        "train", data, {"decoder_only": "DecoderOnly", "encoder_decoder": "EncoderDecoder"}[family])
    assert (cfg.norm_placement, cfg.dropout, cfg.attention.kernel, cfg.task.steps) == ("pre", 0.0, "torch", 1500)
    mine = compose_config([f"experiment={experiment}", "task.steps=10", "layers=1", "attention=math", "pos=rotary"])
    assert (mine.task.steps, mine.layers, mine.attention.kernel) == (10, 1, "math")
    assert mine.pos._target_.endswith("RotaryPositions")


def test_the_training_page_says_what_each_experiment_contains():
    """docs/training.md spells each preset out as a long command; both must compose to one config."""
    lines = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text().splitlines()
    pairs = [(line.split()[3], lines[i + 1].split()[3:]) for i, line in enumerate(lines)
             if line.startswith("python -m zoo experiment=") and line.rstrip().endswith("# the same as:")]
    assert sorted(name for name, _ in pairs) == ["experiment=reverse", "experiment=sort"]
    for preset, spelled_out in pairs:
        resolved = ["task.out_dir=unused"]  # out_dir names Hydra's run directory, which only a Hydra run resolves
        assert (OmegaConf.to_container(compose_config([preset, *resolved]), resolve=True)
                == OmegaConf.to_container(compose_config([*spelled_out, *resolved]), resolve=True)), preset


# ------------------------------------------------------------------------------------------------ data

def python_answer(name, xs):
    if name == "copy":
        return list(xs)
    if name == "reverse":
        return list(reversed(xs))
    if name == "sort":
        return sorted(xs)
    return [int(all(x > earlier for earlier in xs[:i])) for i, x in enumerate(xs)]


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_decoder_only_layout_and_loss_positions(name):
    data = SyntheticTask(name, vocab=5, min_len=1, max_len=6, seed=3)
    batch = data.batch("decoder_only", 50)
    assert batch["tokens"].shape == (50, 2 * 6 + 2) == (50, data.model_max_len("decoder_only"))
    seen_lengths = set()
    for tokens, targets, n in zip(batch["tokens"].tolist(), batch["targets"].tolist(), batch["lengths"].tolist()):
        seen_lengths.add(n)
        sequence = tokens + [targets[-1] if targets[-1] != IGNORE else PAD]
        x = tokens[1:1 + n]
        assert tokens[0] == BOS and tokens[1 + n] == SEP and all(N_SPECIAL <= t < N_SPECIAL + 5 for t in x)
        assert sequence[2 + n: 2 + 2 * n] == python_answer(name, x) and sequence[2 + 2 * n] == EOS
        assert all(t == PAD for t in sequence[3 + 2 * n:])
        # The loss sees exactly the answer and its EOS: the prompt is given, never predicted.
        counted = [i for i, t in enumerate(targets) if t != IGNORE]
        assert counted == list(range(1 + n, 2 + 2 * n))
        assert [targets[i] for i in counted] == python_answer(name, x) + [EOS]
    assert seen_lengths == set(range(1, 7))


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_encoder_decoder_layout(name):
    data = SyntheticTask(name, vocab=7, min_len=2, max_len=5, seed=1)
    batch = data.batch("encoder_decoder", 40)
    for i, n in enumerate(batch["lengths"].tolist()):
        x = batch["src"][i, :n].tolist()
        y = python_answer(name, x)
        assert batch["src_mask"][i].tolist() == [True] * n + [False] * (5 - n)
        assert batch["src"][i, n:].eq(PAD).all()
        assert batch["tgt"][i, : n + 1].tolist() == [BOS] + y and batch["tgt"][i, n + 1:].eq(PAD).all()
        assert batch["targets"][i].tolist() == y + [EOS] + [IGNORE] * (5 - n)


def test_running_max_labels():
    data = SyntheticTask("running_max", vocab=9, min_len=1, max_len=7, seed=2)
    batch = data.batch("encoder_only", 60)
    for i, n in enumerate(batch["lengths"].tolist()):
        x = batch["tokens"][i, :n].tolist()
        assert batch["targets"][i].tolist() == python_answer("running_max", x) + [IGNORE] * (7 - n)
        assert batch["mask"][i].sum() == n


def test_batches_depend_on_seed_stream_and_index_only():
    data = SyntheticTask("reverse", vocab=16, min_len=8, max_len=16, seed=0)
    a, b = data.batch("decoder_only", 8, "train", 5), data.batch("decoder_only", 8, "train", 5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tokens"], data.batch("decoder_only", 8, "train", 6)["tokens"])
    assert not torch.equal(a["tokens"], data.batch("decoder_only", 8, "heldout", 5)["tokens"])
    other_seed = SyntheticTask("reverse", vocab=16, min_len=8, max_len=16, seed=1)
    assert not torch.equal(a["tokens"], other_seed.batch("decoder_only", 8, "train", 5)["tokens"])
    assert len({stream_seed(s, n, i) for s in range(3) for n in ("train", "heldout") for i in range(3)}) == 18


def test_model_is_sized_to_the_data(tmp_path):
    for family in DATA_FOR:
        cfg, data = fit_config_to_data(train_config(tmp_path, family=family))
        assert cfg.vocab_size == data.vocab_size == N_SPECIAL + 6
        model = model_from_config(cfg)
        assert model.max_len == data.model_max_len(family)
        longest = SyntheticTask(data.name, vocab=6, min_len=5, max_len=5).batch(family, 2)
        logits = forward_batch(model, longest)  # the longest example fits the positions exactly
        assert logits.shape[:2] == longest["targets"].shape
        assert logits.shape[-1] == (2 if family == "encoder_only" else data.vocab_size)


@pytest.mark.parametrize("family,data,allowed", [("encoder_only", "reverse", "running_max"),
                                                 ("decoder_only", "running_max", "copy, reverse, sort")])
def test_data_that_does_not_fit_the_family_is_a_config_error(tmp_path, family, data, allowed):
    with pytest.raises(ConfigError, match=f"data={data} does not fit model={family}.*{allowed}"):
        train(train_config(tmp_path, family=family, data=data))


def test_learning_rate_warms_up_linearly_then_decays_by_cosine():
    kw = dict(lr=1.0, warmup=10, steps=110, min_lr_ratio=0.1)
    rates = [learning_rate(s, **kw) for s in range(110)]
    assert rates[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert rates[10] == pytest.approx(1.0)
    assert learning_rate(60, **kw) == pytest.approx(0.55)  # half way: the mean of peak and floor
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    assert learning_rate(110, **kw) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------- training

@pytest.mark.parametrize("family", list(DATA_FOR))
def test_training_lowers_the_held_out_loss(tmp_path, family):
    cfg = train_config(tmp_path, "task.steps=60", "task.eval_every=60", "dropout=0", family=family)
    fitted, data = fit_config_to_data(cfg)
    torch.manual_seed(fitted.seed)  # train() builds the same initial model from the same seed
    held_out = [data.batch(family, 16, "heldout", i) for i in range(2)]
    before = evaluate(model_from_config(fitted), held_out)
    after = train(cfg, quiet=True)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert after["token_acc"] > 1.5 * before["token_acc"], (before, after)


def test_checkpoint_round_trip(tmp_path):
    result = train(train_config(tmp_path, "task.steps=12", "task.checkpoint_every=4", "task.keep=2"), quiet=True)
    assert [p.name for p in checkpoints_in(tmp_path)] == ["step-0000008", "step-0000012"]  # keep=2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    state = read_state(tmp_path / "step-0000012")
    assert state["step"] == 12 and state["config"]["d_model"] == 32 and state["config"]["data"]["name"] == "reverse"
    fresh = model_from_config(result["config"])
    load_weights(fresh, tmp_path / "step-0000012")
    trained = result["model"].state_dict()
    assert all(torch.equal(trained[k], v) for k, v in fresh.state_dict().items())
    # Tied weights stay tied after loading.
    assert fresh.lm_head.weight is fresh.decoder.embedding.weight


def test_resume_after_an_interruption_is_bitwise_identical(tmp_path, monkeypatch):
    # Dropout on, so that the restored RNG state matters as much as the weights and the optimizer.
    extra = ["task.steps=10", "task.checkpoint_every=4", "task.eval_every=3", "task.keep=10", "dropout=0.2"]
    straight = train(train_config(tmp_path / "straight", *extra), quiet=True)["model"].state_dict()

    save = zoo.tasks.train.save_training_checkpoint

    def save_then_interrupt(*args, **kwargs):
        path = save(*args, **kwargs)
        if path.name == "step-0000004":
            raise KeyboardInterrupt  # as if stopped right after the first checkpoint
        return path

    monkeypatch.setattr(zoo.tasks.train, "save_training_checkpoint", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(train_config(tmp_path / "split", *extra), quiet=True)
    monkeypatch.setattr(zoo.tasks.train, "save_training_checkpoint", save)
    torch.manual_seed(12345)  # whatever the process's RNG holds now must not matter
    resumed = train(train_config(tmp_path / "split", *extra, "task.resume=true"), quiet=True)["model"].state_dict()
    assert straight.keys() == resumed.keys()
    different = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    assert not different, different
    first = read_state(tmp_path / "split" / "step-0000004")
    assert first["step"] == 4

    # ... while a run that resumes without the RNG state would not be identical: the test has teeth.
    monkeypatch.setattr(zoo.io.checkpoint, "_set_rng_states", lambda *a: None)
    for p in checkpoints_in(tmp_path / "split")[1:]:
        shutil.rmtree(p)
    torch.manual_seed(12345)
    unrestored = train(train_config(tmp_path / "split", *extra, "task.resume=true"), quiet=True)["model"]
    assert any(not torch.equal(straight[k], v) for k, v in unrestored.state_dict().items())


@pytest.mark.parametrize("damage,words", [
    (lambda c: flip_byte(c / "model.safetensors"), ["model.safetensors is damaged", "sha256"]),
    (lambda c: flip_byte(c / "train_state.safetensors"), ["train_state.safetensors is damaged"]),
    (lambda c: (c / "state.json").write_text('{"format": "zoo-train'), ["state.json is damaged"]),
    (lambda c: (c / "model.safetensors").unlink(), ["model.safetensors is missing"]),
    (lambda c: (c / "state.json").unlink(), ["state.json is missing"]),
])
def test_damaged_checkpoint_is_a_clear_error_and_nothing_is_overwritten(finished_run, damage, words):
    damage(finished_run / "step-0000004")
    before = tree_digest(finished_run)
    with pytest.raises(CheckpointError) as error:
        train(train_config(finished_run, "task.steps=8", "task.resume=true"), quiet=True)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert tree_digest(finished_run) == before


def test_checkpoint_of_another_model_is_a_clear_error(finished_run):
    before = tree_digest(finished_run)
    with pytest.raises(CheckpointError, match="another config: d_model=32 there, 64 now"):
        train(train_config(finished_run, "task.steps=8", "task.resume=true", "d_model=64"), quiet=True)
    with pytest.raises(CheckpointError, match="another config: data.vocab=6 there, 7 now"):
        train(train_config(finished_run, "task.steps=8", "task.resume=true", "data.vocab=7"), quiet=True)
    assert tree_digest(finished_run) == before
    # Weights that do not fit: one line naming every key that is off.
    cfg, _ = fit_config_to_data(train_config(finished_run, "d_model=64"))
    with pytest.raises(CheckpointError) as error:
        load_weights(model_from_config(cfg), finished_run / "step-0000004")
    assert "\n" not in str(error.value) and "shape mismatch decoder.embedding.embedding.weight" in str(error.value)


def test_fresh_run_refuses_an_out_dir_with_checkpoints(finished_run):
    before = tree_digest(finished_run)
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run; pass task.resume=true"):
        train(train_config(finished_run, "task.steps=4"), quiet=True)
    assert tree_digest(finished_run) == before


def test_resume_without_a_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="task.resume=true: no checkpoint in"):
        train(train_config(tmp_path, "task.resume=true"), quiet=True)


# ------------------------------------------------------------------------------------------ torch.compile

# Inductor generates and compiles C++ kernels: about 30 s with a warm cache and 2 minutes cold on a busy
# 2-core machine, so it runs on request (ZOO_SLOW=1), as do the other cases. The default run keeps one
# case: aot_eager traces the same graphs (Dynamo, AOTAutograd, forward and backward) without C++.
_SLOW = pytest.mark.skipif(not os.environ.get("ZOO_SLOW"), reason="torch.compile takes minutes on a small "
                           "CPU; set ZOO_SLOW=1 to run it")


@pytest.mark.parametrize("family,backend", [
    ("decoder_only", "aot_eager"),
    pytest.param("encoder_decoder", "aot_eager", marks=_SLOW),
    pytest.param("decoder_only", "inductor", marks=_SLOW),
    pytest.param("encoder_decoder", "inductor", marks=_SLOW),
])
def test_torch_compile_matches_eager(family, backend):
    cfg, data = fit_config_to_data(compose_config([f"model={family}", "task=train", *TINY, "dropout=0"]))
    torch.manual_seed(0)
    model = model_from_config(cfg)
    batch = data.batch(family, 4)
    eager = forward_batch(model, batch)
    eager_grads = torch.autograd.grad(eager.square().mean(), list(model.parameters()))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend, dynamic=False)
        out = forward_batch(compiled, batch)
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
    except Exception as exc:  # no C++ compiler, unsupported platform...: say why, do not fail
        pytest.skip(f"torch.compile({backend}) unsupported here: {type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0][:200]}")
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
