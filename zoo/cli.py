"""``python -m zoo [overrides]``: compose the config, check it, and run the chosen task."""
from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from zoo.config.builder import ModelTooLarge, check_fits, compose_config, model_from_config
from zoo.config.schema import ConfigError, integral_overrides, validate
from zoo.io.checkpoint import CheckpointError
from zoo.tasks.generate import generate_task
from zoo.tasks.interrupts import Interrupted, stop_on_sigterm
from zoo.tasks.summary import model_card, random_inputs, timed_forward
from zoo.tasks.train import train_task

__all__ = ["main"]

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch < 2.5: cuda's

# Flags after which Hydra itself answers (help, config printing) or sweeps: no pre-check then.
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-m", "--multirun",
                "--shell-completion", "-sc", "-p", "--package", "--resolve", "-cp", "--config-path",
                "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")


# `python -m zoo --help`: this project's help first, then Hydra's (config groups and the composed config).
_TASKS = {
    "run": "the default: model card, a timed forward pass and a quick verification (task.verify=false skips it)",
    "summary": "the model card only, built on the meta device: any preset, no memory spent",
    "verify": "every applicable spec clause on the built model; report.json, report.md, junit.xml in the run dir",
    "compare": "a preset at reduced size against its reference: reference=hf (the hf extra) or reference=torch",
    "train": "train on a synthetic task (data=copy|reverse|sort|running_max); checkpoints in task.out_dir",
    "generate": "decode with a task=train checkpoint: task.checkpoint=DIR",
}
_GROUPS = {"model": "family", "attention": "kernel backend", "ffn": "feed-forward", "norm": "normalization",
           "pos": "positions", "preset": "sizes", "data": "task=train data", "experiment": "a training run"}


def _first_comment(text: str) -> str:
    lines = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#") and "@package" not in line]
    return lines[0] if lines else ""


def project_help() -> str:
    """What `python -m zoo --help` prints before Hydra's help: tasks, groups, plug-in points, the suite's options.
    Tasks, groups, options and defaults are read from the packaged config tree (conf/, shipped as zoo.conf)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    from zoo.config.options import options
    from zoo.nn.kernel import KERNELS

    conf = files("zoo.conf")
    primary = OmegaConf.create((conf / "config.yaml").read_text())
    # unresolved: the recipe entry is a defaults-list interpolation that only Hydra's composition can resolve
    entries = OmegaConf.to_container(primary, resolve=False).get("defaults", [])
    defaults = {k: v for entry in entries if not isinstance(entry, str) for k, v in entry.items()}
    keys = [k for k in primary if k not in ("defaults", "hydra")]

    def listed(group: str) -> str:
        return ", ".join(f"{o} (default)" if o == defaults.get(group) else o for o in options(group))

    tasks = sorted(options("task"), key=lambda t: (t != defaults.get("task"), t not in _TASKS, list(_TASKS).index(t)
                                                   if t in _TASKS else 0, t))
    width = max(map(len, tasks))
    task_lines = [f"  {t:<{width}}  {_TASKS.get(t) or _first_comment((conf / 'task' / f'{t}.yaml').read_text())}"
                  for t in tasks]
    groups = [g for g in _GROUPS if g in {p.name for p in conf.iterdir()}]
    group_lines = [f"  {g:<10} {_GROUPS[g] + ':':<16} {listed(g)}" for g in groups]
    return "\n".join([
        "transformer-zoo: Transformers assembled from Hydra configs, checked against the spec (properties/SPEC.md).",
        "",
        "usage: python -m zoo [GROUP=OPTION ...] [KEY=VALUE ...] [task=TASK]   e.g. python -m zoo model=decoder_only heads=8",
        "       python -m zoo -m KEY=A,B ...                                   a sweep (multirun), one job per combination",
        "",
        f"tasks (task=...; default {defaults.get('task', 'run')}):",
        *task_lines,
        "",
        "config groups (GROUP=OPTION):",
        *group_lines,
        f"top-level keys (KEY=VALUE): {', '.join(keys)}",
        "task=train with the tiny preset also applies the recipe conf/recipe/train/tiny/MODEL/DATA.yaml where one",
        "exists (printed when training starts; a value on the command line wins; ~recipe drops it).",
        "",
        "plug-in points:",
        "  attention.kernel=pkg.mod:fn              any kernel with the signature of F.scaled_dot_product_attention",
        "                                           (also path/to/file.py:fn)",
        "  attention._target_=pkg.mod.MyAttention   your class in place of a part (likewise ffn., norm., pos._target_),",
        "                                           called with the node's keys plus device= and dtype=",
        "  allow_plugins=true                       let task=generate / task.resume=true import the plug-in paths a",
        "                                           checkpoint names (by default only the zoo's own classes and kernels)",
        "",
        "verify your own implementation with the spec suite (pytest; python -m properties ... is the same):",
        f"  pytest --pyargs properties --kernel pkg.mod:fn          the kernel clauses (or {'|'.join(sorted(KERNELS))})",
        "  pytest --pyargs properties --model pkg.mod:factory      the model clauses on a factory's model",
        '  pytest --pyargs properties --zoo "attention._target_=pkg.mod.MyAttention"   every level on a zoo model',
        "  options: --device, --dtype, --causal-alignment, --fully-masked, --report-json PATH, --hypothesis-profile",
        "",
        "Outputs go to Hydra's run directory (outputs/DATE/TIME; a sweep: multirun/DATE/TIME).",
        "",
        "Hydra's help follows.",
        "",
    ])


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
    check_fits(cfg)
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
    check_fits(cfg)
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
    try:
        result = run_compare(preset, cfg.reference, seed=cfg.seed, **options)
    except ModuleNotFoundError as error:  # an optional dependency: one line naming the extra
        if error.name != "transformers":
            raise
        print(f"zoo: task=compare reference={REFERENCES[preset]} needs Hugging Face transformers: "
              f'pip install "transformer-zoo[hf]" (from a checkout: pip install -e ".[hf]")', file=sys.stderr)
        sys.exit(2)
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
    except ModelTooLarge as error:
        print(f"zoo: model too large: {error}", file=sys.stderr)
        sys.exit(2)
    except ConfigError as error:
        _exit_with(error)
    except CheckpointError as error:
        print(f"zoo: bad checkpoint: {error}", file=sys.stderr)
        sys.exit(2)
    except (_OUT_OF_MEMORY, MemoryError) as error:
        print(f"zoo: out of memory: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
              file=sys.stderr)
        sys.exit(2)
    except RuntimeError as error:  # the CPU allocator says it this way
        if "can't allocate memory" not in str(error):
            raise
        print(f"zoo: out of memory: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:  # a file or directory that cannot be read or written
        where = f": {error.filename}" if error.filename else ""
        print(f"zoo: {error.strerror or type(error).__name__}{where}", file=sys.stderr)
        sys.exit(2)


def _fits(cfg: DictConfig) -> None:
    """Refuse a model too large for its device before Hydra starts (and before a byte of it is allocated)."""
    if cfg.task.name in ("run", "verify"):
        check_fits(cfg)
    elif cfg.task.name == "train":
        from zoo.tasks.train import fit_config_to_data
        check_fits(fit_config_to_data(cfg)[0], training=True)


def _given(arguments: list[str], key: str) -> str | None:
    values = [a.split("=", 1)[1] for a in arguments if a.split("=", 1)[0].lstrip("+~") == key and "=" in a]
    return values[-1] if values else None


def _unique_output_dirs(arguments: list[str]) -> list[str]:
    """Hydra's default output directory (outputs/DATE/TIME) is shared by two runs started in the same second;
    unless one is given, name it after the time to the microsecond and the process id, which no two running
    processes share (likewise a sweep's multirun/DATE/TIME)."""
    now = datetime.now()
    stamp = f"{now:%H-%M-%S}-{now:%f}-{os.getpid()}"
    extra = []
    if _given(arguments, "hydra.run.dir") is None:
        extra.append(f"hydra.run.dir=outputs/{now:%Y-%m-%d}/{stamp}")
    if _given(arguments, "hydra.sweep.dir") is None:
        extra.append(f"hydra.sweep.dir=multirun/{now:%Y-%m-%d}/{stamp}")
    return extra


def _unwritable(path: str) -> str | None:
    """Why a directory cannot be created or written into, or None. It is created here (Hydra would create it
    next), and a file is made and removed in it: only trying says so for sure (a read-only file system, /proc,
    a path under a file)."""
    import tempfile

    target = Path(path).expanduser().absolute()
    if target.exists() and not target.is_dir():
        return f"{target} exists and is not a directory"
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as exc:
        return f"{exc.strerror or type(exc).__name__}{f': {exc.filename}' if exc.filename else ''}"
    return None


def _check_output_dir(arguments: list[str]) -> None:
    value = _given(arguments, "hydra.run.dir")
    if value is None:
        return
    from omegaconf import OmegaConf
    try:  # a literal path or one with ${now:...}; other interpolations only Hydra can resolve
        path = str(OmegaConf.create({"dir": value.strip("'\"")}).dir)
    except Exception:
        return
    problem = _unwritable(path)
    if problem:
        print(f"zoo: hydra.run.dir={value}: the output directory cannot be written: {problem}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    stop_on_sigterm()
    try:
        _main()
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: one line (the task's own, if it said where it stopped)
        message = str(stop) if isinstance(stop, Interrupted) else "interrupted"
        print(f"zoo: {message}", file=sys.stderr, flush=True)
        sys.exit(getattr(stop, "status", 130))


def _main() -> None:
    arguments = integral_overrides(sys.argv[1:])
    if "--help" in arguments or "-h" in arguments:
        print(project_help(), flush=True)
    hydra_flags = any(a.split("=")[0] in _HYDRA_FLAGS for a in arguments)
    if not hydra_flags:
        try:  # Hydra's own errors span several lines; compose first to say them in one
            _fits(compose_config(arguments))
        except ModelTooLarge as error:
            print(f"zoo: model too large: {error}", file=sys.stderr)
            sys.exit(2)
        except ConfigError as error:
            _exit_with(error)
        _check_output_dir(arguments)
    if not any(a in ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")
               for a in arguments):
        arguments = arguments + _unique_output_dirs(arguments)
    sys.argv[1:] = arguments
    _hydra_main()
