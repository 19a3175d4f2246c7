"""``task=train``: fit a zoo model to a synthetic task (zoo/tasks/data.py) and report held-out exact match.

AdamW with weight decay on matrices only, linear warm-up then cosine decay, gradient clipping,
periodic evaluation on a held-out stream, and atomic checkpoints (zoo/io/checkpoint.py) from which
``task.resume=true`` continues bit for bit: batch i is a function of the seed and i, and the
weights, optimizer moments and RNG states are all restored.

Exact match counts a sequence as right when the argmax at every answer position equals the target
given the true prefix. For the sequence tasks this is the same as greedy decoding reproducing the
answer and its EOS: greedy picks that argmax at each step, so it stays on the true prefix exactly as
long as every argmax is right. One forward pass therefore measures what generation would.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from importlib.resources import files
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from zoo.config.builder import model_from_config
from zoo.config.sizing import check_fits
from zoo.io.atomic import unwritable
from zoo.io.checkpoint import load_training_state, save_training_checkpoint
from zoo.io.checkpoint_read import CheckpointError, check_config, checkpoints_in, latest_checkpoint, read_state
from zoo.tasks.interrupts import Interrupted
from zoo.tasks.data import IGNORE, SyntheticTask, pack, task_from_config
from zoo.runtime.plugins import PluginError, locate
from zoo.config.errors import ConfigError

__all__ = ["check_out_dir", "training_fits", "fit_config_to_data", "family_of", "recipe_values", "recipe_line",
           "learning_rate", "make_optimizer", "forward_batch", "batch_metrics", "evaluate", "seeded_model", "train",
           "train_task"]


def family_of(cfg: DictConfig) -> str:
    try:
        kind = getattr(locate(cfg.model._target_), "kind", None)
    except PluginError as exc:
        raise ConfigError(f"model._target_={cfg.model._target_}: cannot be loaded: {exc}") from exc
    if kind not in ("decoder_only", "encoder_decoder", "encoder_only"):
        raise ConfigError(f"model._target_={cfg.model._target_}: task=train needs a zoo model family "
                          f"(decoder_only, encoder_decoder, encoder_only)")
    return kind


def fit_config_to_data(cfg: DictConfig) -> tuple[DictConfig, SyntheticTask]:
    """A copy of cfg whose vocab_size and max_len are what the data needs (and 2 classes for labelling).

    They are derived rather than checked: a larger vocabulary only wastes softmax work on ids that
    never occur, and a smaller one cannot work, so there is no other sensible value.
    """
    task = task_from_config(cfg.data)
    family = family_of(cfg)
    try:
        task.check_family(family)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.vocab_size = task.vocab_size
        cfg.max_len = task.model_max_len(family)
        if family == "encoder_only":
            cfg.model.head_classes = 2
    return cfg, task


def learning_rate(step: int, *, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then half a cosine from lr down to min_lr_ratio * lr at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Decay shrinks matrices and embeddings towards zero; on biases and norm gains it only hurts.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def forward_batch(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits for every target position of a batch in the family's layout (zoo/tasks/data.py)."""
    if model.kind == "decoder_only":
        # Padding is on the right: under the causal mask no real position ever sees it, so no mask is
        # needed, and without one the attention kernel can take its is_causal fast path.
        # A packed batch (task.packing) says which sequence each token belongs to; only then is it passed.
        return model(batch["tokens"], **({"segments": batch["segments"]} if "segments" in batch else {}))
    if model.kind == "encoder_decoder":
        # The source needs its mask (the encoder and cross-attention look both ways); the right-padded
        # target does not, for the same reason as above.
        return model(batch["src"], batch["tgt"], src_mask=batch["src_mask"])
    return model(batch["tokens"], mask=batch["mask"])


def batch_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss (mean over target tokens), token accuracy and exact match (every target of a row right)."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
    counted = targets != IGNORE
    right = (logits.argmax(-1) == targets) & counted
    return {"loss": loss, "token_acc": right.sum() / counted.sum().clamp(min=1),
            "exact": (right | ~counted).all(dim=1).float().mean(), "rows": torch.tensor(targets.shape[0])}


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    was_training = model.training
    model.eval()
    totals = {"loss": 0.0, "token_acc": 0.0, "exact": 0.0}
    rows = 0
    for batch in batches:
        m = batch_metrics(forward_batch(model, batch), batch["targets"])
        n = int(m["rows"])
        for key in totals:
            totals[key] += float(m[key]) * n
        rows += n
    model.train(was_training)
    return {key: value / rows for key, value in totals.items()} | {"sequences": rows}


def _to(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _out_dir(cfg: DictConfig) -> Path:
    """task.out_dir, or the current directory when it names Hydra's output dir outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    raw = OmegaConf.to_container(cfg.task, resolve=False)["out_dir"]
    if "${hydra:" in str(raw) and not HydraConfig.initialized():
        return Path.cwd()
    return Path(cfg.task.out_dir)


def _config_differences(saved: dict, now: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    found = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<absent>"), now.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            found += _config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append((f"{prefix}{key}", a, b))
    return found if prefix else sorted(found, key=_likely_cause)


def _likely_cause(difference: tuple) -> tuple[int, str]:
    """Order differences so the one a user typed comes first: top-level keys, then data, then the rest
    (part nodes copy the top-level sizes, and vocab_size / max_len follow from the data)."""
    key = difference[0]
    if "." not in key and key not in ("vocab_size", "max_len"):
        return 0, key
    return (1 if key.startswith("data.") else 2), key


class _Progress:
    """One self-rewriting line on a terminal; elsewhere (logs, pipes) only the evaluation lines."""

    def __init__(self, stream=None, quiet: bool = False):
        stream = stream or sys.stdout  # looked up now, not at import: whatever stdout is when training starts
        self.stream, self.quiet, self.live, self.last = stream, quiet, not quiet and stream.isatty(), 0.0

    WIDTH = 120

    def update(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.live and (force or now - self.last > 0.2):
            self.stream.write("\r" + text.ljust(self.WIDTH)[:self.WIDTH])
            self.stream.flush()
            self.last = now

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self.live:
            self.stream.write("\r" + " " * self.WIDTH + "\r")
        print(text, file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    """Seconds as M:SS (H:MM:SS from an hour), the way a progress bar shows time left."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def recipe_values(recipe: str | None) -> dict[str, object]:
    """What the training recipe `recipe` (conf/recipe/RECIPE.yaml, e.g. train/tiny/decoder_only/reverse) sets, as
    command-line keys and values; {} when the recipe names no file (most combinations have none)."""
    if not recipe:
        return {}
    path = files("zoo.conf").joinpath("recipe", *f"{recipe}.yaml".split("/"))
    if not path.is_file():
        return {}

    def flat(node: dict, prefix: str = "") -> dict[str, object]:
        out = {}
        for key, value in node.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    return flat(OmegaConf.to_container(OmegaConf.create(path.read_text())))


def recipe_line(recipe: str | None, cfg: DictConfig) -> str | None:
    """One line saying what the recipe chose and which of its values this run sets otherwise, or None."""
    values = recipe_values(recipe)
    if not values:
        return None
    here = {key: OmegaConf.select(cfg, key) for key in values}
    kept = [f"{key}={value}" for key, value in values.items() if here[key] == value]
    other = [f"{key}={here[key]}" for key, value in values.items() if here[key] != value]
    return (f"recipe {recipe}: {' '.join(kept) or '(every value set otherwise)'}"
            + (f"; set otherwise here: {' '.join(other)}" if other else "")
            + f" (conf/recipe/{recipe}.yaml; override any on the command line)")


def train(cfg: DictConfig, *, quiet: bool = False, recipe: str | None = None) -> dict:
    """Train as cfg.task says; return the final held-out metrics, the model and where checkpoints went.

    recipe: the training recipe Hydra chose for this run (conf/config.yaml: recipe), said in one line at the start.
    """
    told = recipe_line(recipe, cfg)  # before the config is fitted to the data, as the user composed it
    cfg, data = fit_config_to_data(cfg)
    opts = cfg.task
    out_dir = _out_dir(cfg)
    with open_dict(cfg):
        cfg.task.out_dir = str(out_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    allow_plugins = bool(config.pop("allow_plugins", False))  # a command-line switch, never saved in a checkpoint
    device = torch.device(cfg.device)

    check_out_dir(out_dir, resume=bool(opts.resume))
    resume_from, state = None, None
    if opts.resume:
        resume_from = latest_checkpoint(out_dir)
        # Checked before the model is built; nothing the checkpoint names is imported (the model is built from
        # the command line's config, which must match the saved one).
        state = read_state(resume_from)
        state["config"] = check_config(state["config"], f"{resume_from}/state.json", allow_plugins=allow_plugins,
                                       asked=config)
    _check_writable(out_dir)
    training_fits(cfg)

    model = seeded_model(cfg)
    model.train()
    optimizer = make_optimizer(model, lr=opts.lr, weight_decay=opts.weight_decay)
    start = 0
    progress = _Progress(quiet=quiet)
    if resume_from is not None:
        differences = _config_differences(state["config"], config)
        fatal = [d for d in differences if not d[0].startswith("task.") and d[0] != "device"]
        if fatal:
            key, a, b = fatal[0]
            raise CheckpointError(f"{resume_from} was written for another config: {key}={a} there, {b} now "
                                  f"({len(fatal)} difference{'s' if len(fatal) > 1 else ''}; resume with the "
                                  f"same model and data overrides)")
        start = load_training_state(resume_from, state, model, optimizer)
        changed = ", ".join(f"{k}: {a} -> {b}" for k, a, b in differences if k not in ("task.resume",))
        progress.line(f"resuming from {resume_from} (step {start})" + (f"; changed {changed}" if changed else ""))

    held_out = [_to(data.batch(model.kind, opts.batch, "heldout", i), device) for i in range(opts.eval_batches)]
    parameters = sum(p.numel() for p in model.parameters())
    if told:
        progress.line(told)
    progress.line(f"train {model.kind} ({parameters:,} parameters) on {data.name}: vocab {data.vocab} symbols, "
                  f"length {data.min_len}-{data.max_len}; {opts.steps} steps of {opts.batch}; "
                  f"checkpoints in {out_dir}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    started, cpu_started, smoothed, result = time.monotonic(), time.process_time(), None, None
    try:
        result, smoothed = _loop(model, optimizer, params, data, held_out, opts, out_dir, config, device, start,
                                 progress, started)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: say where the run can be continued from
        latest = latest_checkpoint(out_dir)
        where = (f"the last checkpoint, {latest}, is intact: continue with task.resume=true "
                 f"task.out_dir={out_dir}" if latest is not None else "no checkpoint had been written yet")
        raise Interrupted(f"{str(stop) if isinstance(stop, Interrupted) else 'interrupted'} during training; "
                          f"{where}", getattr(stop, "status", 130)) from None

    if result is None:  # resumed at the end: nothing left to train, report the checkpoint's model
        result = evaluate(model, held_out)
    seconds, cpu_seconds = time.monotonic() - started, time.process_time() - cpu_started
    # CPU time too: on a shared machine the wall time also counts the waits for a free core.
    progress.line(f"held-out exact match: {100 * result['exact']:.2f}% of {result['sequences']} sequences "
                  f"(token accuracy {100 * result['token_acc']:.2f}%) after {opts.steps} steps, "
                  f"{seconds:.1f} s ({cpu_seconds:.1f} s CPU)")
    return {**result, "seconds": seconds, "cpu_seconds": cpu_seconds, "model": model, "out_dir": out_dir,
            "config": cfg}


def seeded_model(cfg: DictConfig) -> nn.Module:
    """The model cfg builds, its initial weights drawn from ``cfg.seed`` on the CPU's generator and then moved to
    ``cfg.device``: a CUDA generator seeded alike draws another stream, so building on the device would start a
    recipe from other weights on every kind of device. The data streams are CPU draws too (SyntheticTask)."""
    torch.manual_seed(cfg.seed)
    return model_from_config(cfg, device="cpu").to(cfg.device)


def check_out_dir(out_dir: Path, *, resume: bool) -> None:
    """task.out_dir before anything is written: a resumed run needs a checkpoint there, a fresh one refuses one that
    holds checkpoints (nothing is overwritten), and either needs a directory it can create and write into."""
    problem = unwritable(str(out_dir))   # first: a name no file system holds cannot even be looked into
    if problem:
        raise ConfigError(f"task.out_dir={out_dir}: cannot be written: {problem}")
    if resume and latest_checkpoint(out_dir) is None:
        raise ConfigError(f"task.resume=true: no checkpoint in {out_dir} (pass the earlier run's task.out_dir)")
    if not resume and checkpoints_in(out_dir):
        raise ConfigError(f"task.out_dir={out_dir}: holds checkpoints of an earlier run; pass task.resume=true "
                          f"to continue it or choose another task.out_dir (nothing was overwritten)")


def training_fits(cfg: DictConfig) -> None:
    """The size check of a training run (cfg fitted to its data): weights, gradients, AdamW moments, and the
    activations of a batch of the longest sequences; the held-out batches stay on the device too."""
    opts = cfg.task
    held_out = opts.eval_batches * opts.batch * cfg.max_len * 3  # tokens, targets and mask of each, kept all along
    check_fits(cfg, training=True, batch=opts.batch, length=cfg.max_len, resident_tokens=held_out)


def _check_writable(out_dir: Path) -> None:
    """Create task.out_dir; only trying says for sure that it can be written (check_out_dir tried a file in its
    deepest existing ancestor)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"task.out_dir={out_dir}: cannot be created ({exc.strerror})") from None
    problem = unwritable(str(out_dir))
    if problem:
        raise ConfigError(f"task.out_dir={out_dir}: cannot be written: {problem}")


def _loop(model, optimizer, params, data, held_out, opts, out_dir, config, device, start, progress, started):
    smoothed, result = None, None
    for step in range(start, opts.steps):
        lr = learning_rate(step, lr=opts.lr, warmup=opts.warmup, steps=opts.steps, min_lr_ratio=opts.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = data.batch(model.kind, opts.batch, "train", step)
        batch = _to(pack(batch, model.max_len) if opts.get("packing") else batch, device)
        metrics = batch_metrics(forward_batch(model, batch), batch["targets"])
        optimizer.zero_grad(set_to_none=True)
        metrics["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, opts.clip)
        optimizer.step()

        done = step + 1
        loss = metrics["loss"].item()
        smoothed = loss if smoothed is None else 0.95 * smoothed + 0.05 * loss
        rate = (done - start) / max(time.monotonic() - started, 1e-9)
        held_out_exact = "-" if result is None else f"{100 * result['exact']:.1f}%"
        progress.update(f"step {done}/{opts.steps}  loss {smoothed:.4f}  acc {float(metrics['token_acc']):.3f}  "
                        f"held-out exact {held_out_exact}  lr {lr:.2e}  {rate:.1f} steps/s  "
                        f"ETA {_clock((opts.steps - done) / rate)}",
                        force=done == opts.steps)
        if done % opts.eval_every == 0 or done == opts.steps:
            result = evaluate(model, held_out)
            progress.line(f"step {done:>6}  train loss {smoothed:.4f}  held-out loss {result['loss']:.4f}  "
                          f"token acc {result['token_acc']:.4f}  exact match {100 * result['exact']:.2f}%  "
                          f"({time.monotonic() - started:.0f} s)")
        if done % opts.checkpoint_every == 0 or done == opts.steps:
            save_training_checkpoint(out_dir, done, model, optimizer, config,
                                     metrics={"train_loss": smoothed, **(result or {})}, keep=opts.keep)
    return result, smoothed


def train_task(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    train(cfg, recipe=choices.get("recipe"))
