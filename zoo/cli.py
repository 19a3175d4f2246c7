"""``python -m zoo [overrides]``: compose the config, check it, and run the chosen task."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from zoo.config.builder import compose_config, model_from_config
from zoo.config.schema import ConfigError, validate
from zoo.tasks.summary import model_card, random_inputs, timed_forward
from zoo.io.checkpoint import CheckpointError
from zoo.tasks.generate import generate_task
from zoo.tasks.train import train_task

__all__ = ["main"]

# Flags after which Hydra itself answers (help, config printing) or sweeps: no pre-check then.
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-m", "--multirun",
                "--shell-completion", "-sc", "-p", "--package", "--resolve", "-cp", "--config-path",
                "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")


def _exit_with(error: Exception) -> None:
    print(f"zoo: invalid config: {error}", file=sys.stderr)
    sys.exit(2)


def _verify(cfg: DictConfig, model, profile: str) -> None:
    from hydra.core.hydra_config import HydraConfig
    from zoo.tasks.verify import verify

    runtime = HydraConfig.get()
    status = verify(cfg, list(runtime.overrides.task), dict(runtime.runtime.choices),
                    Path(runtime.runtime.output_dir), profile=profile, model=model)
    if status:
        sys.exit(status)


def run(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    model = model_from_config(cfg)
    print(model_card(cfg, model))
    inputs = random_inputs(model, cfg.task.batch, cfg.task.seq_len,
                           generator=torch.Generator().manual_seed(cfg.seed), device=cfg.device)
    out, seconds = timed_forward(model, inputs)
    shapes = " + ".join(str(tuple(t.shape)) for t in inputs)
    print(f"\nforward    {shapes} -> {tuple(out.shape)} {str(out.dtype).removeprefix('torch.')} "
          f"in {seconds * 1e3:.1f} ms (eval, no grad)\n")
    if cfg.task.verify:
        _verify(cfg, model, cfg.task.profile)


def verify_task(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    model = model_from_config(cfg)
    print(model_card(cfg, model) + "\n")
    _verify(cfg, model, cfg.task.profile)


def summary(cfg: DictConfig) -> None:
    print(model_card(cfg, model_from_config(cfg, device="meta")))


def compare(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from zoo.tasks.compare import REFERENCES, run_compare

    preset = HydraConfig.get().runtime.choices.get("preset")
    if preset not in REFERENCES:
        raise ConfigError(f"preset={preset}: task=compare needs a preset with a reference implementation "
                          f"(allowed: {', '.join(REFERENCES)})")
    if cfg.reference is not None and cfg.reference != REFERENCES[preset]:
        raise ConfigError(f"reference={cfg.reference}: preset={preset} is compared with reference={REFERENCES[preset]}")
    options = {k: v for k, v in cfg.task.items() if k != "name"}
    result = run_compare(preset, cfg.reference, seed=cfg.seed, **options)
    if not result["ok"]:
        print("zoo: compare: a difference exceeds its rounding-error bound", file=sys.stderr)
        sys.exit(1)


TASKS = {"verify": verify_task, "compare": compare, "run": run, "summary": summary, "train": train_task, "generate": generate_task}


@hydra.main(config_path="pkg://zoo.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
    except ConfigError as error:
        _exit_with(error)
    try:  # a task finds some problems only once it runs (data vs model, a checkpoint): still one line
        TASKS[cfg.task.name](cfg)
    except ConfigError as error:
        _exit_with(error)
    except CheckpointError as error:
        print(f"zoo: bad checkpoint: {error}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    arguments = sys.argv[1:]
    if not any(a.split("=")[0] in _HYDRA_FLAGS for a in arguments):
        try:  # Hydra's own errors span several lines; compose first to say them in one
            compose_config(arguments)
        except ConfigError as error:
            _exit_with(error)
    _hydra_main()
