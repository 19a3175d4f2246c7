"""``python -m zoo [overrides]``: compose the config, check it, and run the chosen task."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import hydra
import torch
from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from zoo.call_limit import (DEFAULT_TIMEOUT, CallLimitExceeded, bounded, parse_limit, reset_limit,
                            set_limit)
from zoo.cli_checks import Plan, plan
from zoo.cli_dirs import discard
from zoo.config.builder import model_from_config
from zoo.config.sizing import ModelTooLarge, check_fits
from zoo.config.composition import explain_composition_error, explain_config_error, validate_checked
from zoo.config.schema import ConfigError, plugin_in
from zoo.io.checkpoint import CheckpointError
from zoo.tasks.generate import generate_task
from zoo.tasks.interrupts import Interrupted, stop_on_sigterm
from zoo.tasks.summary import model_card, random_inputs, timed_forward
from zoo.tasks.train import train_task

__all__ = ["main"]

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch < 2.5: cuda's

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
        f"  call_timeout=SECONDS                     time limit for one call of a plug-in: importing it, building the",
        f"                                           model, a forward pass, a decoding (default {DEFAULT_TIMEOUT:g}; 0: no",
        "                                           limit); past it, one line and exit status 1, also when stuck in C",
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


def _verify(cfg: DictConfig, model, profile: str) -> None:
    from hydra.core.hydra_config import HydraConfig

    from zoo.tasks.verify import verify

    runtime = HydraConfig.get()
    status = verify(cfg, list(runtime.overrides.task), dict(runtime.runtime.choices),
                    Path(runtime.runtime.output_dir), profile=profile, model=model)
    if status:
        raise _OwnExit(status)


def _built(cfg: DictConfig):
    """The model, its build bounded by call_timeout when a plug-in takes part."""
    with bounded(plugin_in(cfg), "building the model"):
        return model_from_config(cfg)


def run(cfg: DictConfig) -> None:
    check_fits(cfg, batch=cfg.task.batch, length=cfg.task.seq_len)
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
        _verify(cfg, model, cfg.task.profile)


def verify_task(cfg: DictConfig) -> None:
    check_fits(cfg)
    torch.manual_seed(cfg.seed)
    model = _built(cfg)
    print(model_card(cfg, model) + "\n")
    _verify(cfg, model, cfg.task.profile)


def summary(cfg: DictConfig) -> None:
    print(model_card(cfg, model_from_config(cfg, device="meta")))


def compare(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from zoo.tasks.compare import REFERENCES, check_compare, run_compare

    preset = HydraConfig.get().runtime.choices.get("preset")
    check_compare(preset, cfg.reference, cfg.task)
    options = {k: v for k, v in cfg.task.items() if k != "name"}
    try:
        result = run_compare(preset, cfg.reference, seed=cfg.seed, **options)
    except ModuleNotFoundError as error:  # an optional dependency: one line naming the extra
        if error.name != "transformers":
            raise
        _refuse(f"zoo: task=compare reference={REFERENCES[preset]} needs Hugging Face transformers: "
                f'pip install "transformer-zoo[hf]" (from a checkout: pip install -e ".[hf]")')
    if not result["ok"]:
        print("zoo: compare: a difference exceeds its rounding-error bound", file=sys.stderr)
        raise _OwnExit(1)


TASKS = {"verify": verify_task, "compare": compare, "run": run, "summary": summary, "train": train_task, "generate": generate_task}


@hydra.main(config_path="pkg://zoo.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    global _TASK_RAISED
    try:
        validate_checked(cfg)
    except ConfigError as error:
        _exit_with(error)
    set_limit(parse_limit(cfg.call_timeout))
    try:  # a task finds some problems only once it runs (data vs model, a checkpoint): still one line
        TASKS[cfg.task.name](cfg)
    except _OwnExit:
        raise
    except CallLimitExceeded as error:  # a plug-in's call interrupted past call_timeout
        _refuse(str(error), status=1)
    except SystemExit as stop:  # code the run called (a plug-in's constructor, kernel or forward) ended it
        _refuse(f"zoo: the run was ended by sys.exit({stop.code!r}) in code it called (a plug-in?); nothing it "
                f"was to do was finished")
    except ModelTooLarge as error:
        _refuse(f"zoo: model too large: {error}")
    except ConfigError as error:
        _exit_with(error)
    except CheckpointError as error:
        _refuse(f"zoo: bad checkpoint: {error}")
    except InstantiationException as error:  # a constructor (of a plug-in, or one given sizes it cannot take)
        cause = error.__cause__ or error
        if _out_of_memory(cause):
            _refuse(f"zoo: out of memory: {_first_line(cause)}")
        _refuse(f"zoo: the model cannot be built: {type(cause).__name__}: {_first_line(cause)}")
    except (_OUT_OF_MEMORY, MemoryError) as error:
        _refuse(f"zoo: out of memory: {_first_line(error)}")
    except RuntimeError as error:  # the CPU allocator says it this way
        if not _out_of_memory(error):
            _TASK_RAISED = True
            raise
        _refuse(f"zoo: out of memory: {_first_line(error)}")
    except OSError as error:  # a file or directory that cannot be read or written
        where = f": {error.filename}" if error.filename else ""
        _refuse(f"zoo: {error.strerror or type(error).__name__}{where}")
    except Exception:  # a bug in a task: its traceback, as Python shows it (main() tells it from Hydra's errors)
        _TASK_RAISED = True
        raise


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (_OUT_OF_MEMORY, MemoryError)) or "can't allocate memory" in str(error)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error).strip() else type(error).__name__


_PLAN: Plan | None = None  # this process's checked command line: what a refusal inside the run removes
_TASK_RAISED = False  # set when a task itself raised: that is a bug, shown with its traceback


def _refuse(message: str, status: int = 2) -> NoReturn:
    """One line on stderr and the exit status; the output directory Hydra made for this run goes too if it
    holds nothing but Hydra's own files (a bad input leaves nothing behind)."""
    if _PLAN is not None:
        try:
            discard(_PLAN.output)
        except OSError:  # the refusal itself must still be said
            pass
    say(message)
    raise _OwnExit(status)


class _OwnExit(SystemExit):
    """The zoo's own exit with a status (its one-line refusals, a verification that failed); any other SystemExit
    inside a run came from code the run called."""


def say(message: str) -> None:
    """One line on stderr, whatever the message quotes of the input: a control character or a line separator in
    a value (\\n, \\r, U+0085, U+2028 ...) is written as its escape."""
    print("".join(c if c.isprintable() else repr(c)[1:-1] for c in message), file=sys.stderr, flush=True)


def _exit_with(error: Exception) -> NoReturn:
    _refuse(f"zoo: invalid config: {error}")


def main(argv: list[str] | None = None) -> None:
    """`python -m zoo ARGS`; `main([...])` runs the same in this process (the CLI's tests do)."""
    stop_on_sigterm()
    status = 1
    try:
        _main(sys.argv[1:] if argv is None else list(argv))
        status = 0
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: one line (the task's own, if it said where it stopped)
        message = str(stop) if isinstance(stop, Interrupted) else "interrupted"
        say(f"zoo: {message}")
        status = getattr(stop, "status", 130)
        sys.exit(status)
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        raise
    finally:
        reset_limit()   # main([...]) in another program leaves no limit and no SIGALRM handler behind
        if argv is None:   # as a command (tests call main([...]) in their own process): nothing a plug-in left
            from zoo.leftovers import end_leftovers
            end_leftovers(status, who="a plug-in")


def _main(arguments: list[str]) -> None:
    global _PLAN, _TASK_RAISED
    set_limit(_limit_given(arguments))   # the checks below import the plug-ins
    try:  # Hydra's own errors span several lines and leave an output directory: check everything first
        checked = plan(arguments)
    except CallLimitExceeded as error:
        say(str(error))
        sys.exit(1)
    except ModelTooLarge as error:
        say(f"zoo: model too large: {error}")
        sys.exit(2)
    except ConfigError as error:
        say(f"zoo: invalid config: {error}")
        sys.exit(2)
    except CheckpointError as error:
        say(f"zoo: bad checkpoint: {error}")
        sys.exit(2)
    if "--help" in checked.argv:
        print(project_help(), flush=True)
    if checked.mode == "rerun":
        _rerun(checked.rerun)
        return
    _PLAN = checked
    sys.argv[1:] = checked.argv
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises what it meets instead of printing it over many lines
    _TASK_RAISED = False
    try:
        _hydra_main()
    except HydraException as error:  # what Hydra met that the checks before it did not foresee
        _refuse(f"zoo: invalid config: {explain_composition_error(error, checked.argv)}")
    except OmegaConfBaseException as error:
        _refuse(f"zoo: invalid config: {explain_config_error(error, checked.argv)}")
    except Exception as error:  # Hydra's own machinery (logging set up from hydra.job_logging, a callback ...)
        if _TASK_RAISED:
            raise
        cause = error.__cause__ or error
        _refuse(f"zoo: invalid config: Hydra cannot start the run: {_first_line(error)}"
                + (f": {_first_line(cause)}" if cause is not error else ""))
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
        _PLAN = None


def _limit_given(arguments: list[str]) -> float:
    """call_timeout as the command line gives it (the last one wins, as in Hydra), for the checks that import
    plug-ins before the config is composed; DEFAULT_TIMEOUT when absent or not a valid limit (the config's check
    then refuses it in one line)."""
    given = [a.split("=", 1)[1] for a in arguments if a.lstrip("+").startswith("call_timeout=")]
    try:
        return parse_limit(given[-1]) if given else DEFAULT_TIMEOUT
    except ValueError:
        return DEFAULT_TIMEOUT


def _rerun(path: str) -> None:
    """--experimental-rerun FILE: the job a config.pickle describes (Hydra's PickleJobInfoCallback writes it), run
    again through the same checks as any run. The file is unpickled: name only one you wrote."""
    import warnings

    from hydra.main import _get_rerun_conf

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = _get_rerun_conf(path, [])
    except Exception as error:  # noqa: BLE001 - whatever the file holds, one line
        say(f"zoo: invalid config: --experimental-rerun={path}: not a config pickle Hydra wrote "
            f"({type(error).__name__}: {_first_line(error)})")
        sys.exit(2)
    _hydra_main(cfg)
