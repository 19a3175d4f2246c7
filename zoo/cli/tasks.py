"""The tasks ``python -m zoo task=NAME`` runs, each handed its ``Job``: the config the command line composed and
checked once (zoo/cli/plan.py), and where Hydra runs it. A task refuses what it finds only once it runs (a
checkpoint, data that do not fit the model) with ``Refusal``; the zoo's own exit with a status (a verification that
failed) is ``OwnExit``."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from zoo.runtime.call_limit import bounded

__all__ = ["Job", "Refusal", "OwnExit", "TASKS"]


@dataclass
class Job:
    """One job of a command line: its config (validated, without Hydra's node), its task overrides, the option each
    config group resolved to, and the directory Hydra runs it in."""
    cfg: DictConfig
    overrides: list[str] = field(default_factory=list)
    choices: dict = field(default_factory=dict)
    output_dir: Path = Path(".")


class Refusal(Exception):
    """A bad input a task found once it ran: one line (the message) and the status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class OwnExit(SystemExit):
    """The zoo's own exit with a status (a verification that failed); any other SystemExit inside a run came from code
    the run called."""


def _built(cfg: DictConfig):
    """The model, its build bounded by call_timeout when a plug-in takes part."""
    from zoo.config.builder import model_from_config
    from zoo.config.schema import plugin_in

    with bounded(plugin_in(cfg), "building the model"):
        return model_from_config(cfg)


def _verify(job: Job, model) -> None:
    from zoo.tasks.verify import verify

    status = verify(job.cfg, job.overrides, job.choices, job.output_dir, profile=job.cfg.task.profile, model=model)
    if status:
        raise OwnExit(status)


def run(job: Job) -> None:
    """The card, a timed forward pass and (task.verify) a quick verification; the size check was the plan's."""
    from zoo.config.schema import plugin_in
    from zoo.tasks.summary import model_card, random_inputs, timed_forward

    cfg = job.cfg
    torch.manual_seed(cfg.seed)
    model = _built(cfg)
    print(model_card(cfg, model))
    inputs = random_inputs(model, cfg.task.batch, cfg.task.seq_len,
                           generator=torch.Generator().manual_seed(cfg.seed), device=cfg.device)
    with bounded(plugin_in(cfg), "the forward pass of task=run"):
        out, seconds = timed_forward(model, inputs)
    shapes = " + ".join(str(tuple(t.shape)) for t in inputs)
    print(f"\nforward    {shapes} -> {tuple(out.shape)} {str(out.dtype).removeprefix('torch.')} "
          f"in {seconds * 1e3:.1f} ms (eval, no grad)\n")
    if cfg.task.verify:
        _verify(job, model)


def verify(job: Job) -> None:
    from zoo.tasks.summary import model_card

    torch.manual_seed(job.cfg.seed)
    model = _built(job.cfg)
    print(model_card(job.cfg, model) + "\n")
    _verify(job, model)


def summary(job: Job) -> None:
    from zoo.config.builder import model_from_config
    from zoo.tasks.summary import model_card

    print(model_card(job.cfg, model_from_config(job.cfg, device="meta")))


def compare(job: Job) -> None:
    from zoo.tasks.compare import REFERENCES, run_compare

    preset, cfg = job.choices.get("preset"), job.cfg
    options = {k: v for k, v in cfg.task.items() if k != "name"}
    try:
        result = run_compare(preset, cfg.reference, seed=cfg.seed, **options)
    except ModuleNotFoundError as error:  # an optional dependency: one line naming the extra
        if error.name != "transformers":
            raise
        raise Refusal(f"zoo: task=compare reference={REFERENCES[preset]} needs Hugging Face transformers: "
                      f'pip install "transformer-zoo[hf]" (from a checkout: pip install -e ".[hf]")') from None
    if not result["ok"]:
        print("zoo: compare: a difference exceeds its rounding-error bound", file=sys.stderr)
        raise OwnExit(1)


def train(job: Job) -> None:
    from zoo.tasks.train import train_task
    train_task(job.cfg)


def generate(job: Job) -> None:
    from zoo.tasks.generate import generate_task
    generate_task(job.cfg)


TASKS = {"verify": verify, "compare": compare, "run": run, "summary": summary, "train": train, "generate": generate}
