"""``python -m zoo [overrides]``: compose the config, check it, and run the chosen task."""
from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig

from zoo.build import compose_config, model_from_config
from zoo.schema import ConfigError, validate
from zoo.summary import model_card, random_inputs, timed_forward

__all__ = ["main"]

# Flags after which Hydra itself answers (help, config printing) or sweeps: no pre-check then.
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-m", "--multirun",
                "--shell-completion", "-sc", "-p", "--package", "--resolve", "-cp", "--config-path",
                "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")


def _exit_with(error: Exception) -> None:
    print(f"zoo: invalid config: {error}", file=sys.stderr)
    sys.exit(2)


def run(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    model = model_from_config(cfg)
    print(model_card(cfg, model))
    inputs = random_inputs(model, cfg.task.batch, cfg.task.seq_len,
                           generator=torch.Generator().manual_seed(cfg.seed), device=cfg.device)
    out, seconds = timed_forward(model, inputs)
    shapes = " + ".join(str(tuple(t.shape)) for t in inputs)
    print(f"\nforward    {shapes} -> {tuple(out.shape)} {str(out.dtype).removeprefix('torch.')} "
          f"in {seconds * 1e3:.1f} ms (eval, no grad)")


def summary(cfg: DictConfig) -> None:
    print(model_card(cfg, model_from_config(cfg, device="meta")))


TASKS = {"run": run, "summary": summary}


@hydra.main(config_path="pkg://zoo.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
    except ConfigError as error:
        _exit_with(error)
    TASKS[cfg.task.name](cfg)


def main() -> None:
    arguments = sys.argv[1:]
    if not any(a.split("=")[0] in _HYDRA_FLAGS for a in arguments):
        try:  # Hydra's own errors span several lines; compose first to say them in one
            compose_config(arguments)
        except ConfigError as error:
            _exit_with(error)
    _hydra_main()
