"""What ``python -m zoo`` checks before Hydra starts: every bad input is one line and status 2, whatever the entry
path, and nothing is written for it.

The command line is parsed with Hydra's own parser (its errors said in one line), the flags are checked together
(``--cfg``, ``--info``, ``-m``, ``--shell-completion``, ``--package``, ``--resolve``, ``--experimental-rerun``),
and the config is composed as Hydra will compose it (``-cp``, ``-cn``, ``-cd`` included): once for a single run,
once per job for a sweep (``-m``), each composition validated (zoo/config/composition.py) and checked as its task
will check it (the size check, the training directory, the compare preset). The output directory (``hydra.run.dir``
or ``hydra.sweep.dir``, interpolations resolved) must be writable. Only then does Hydra run, with the flags in a
canonical order and, unless one is given, an output directory no other run shares.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from zoo.cli.directories import check_job_dirs, output_dir
from zoo.config.errors import ConfigError

__all__ = ["Plan", "PlannedJobs", "plan", "MAX_JOBS", "MAX_RERUN_BYTES", "TASK_MODULE", "task_checks"]

MAX_JOBS = 1024            # jobs in one sweep; each is composed and checked before the first one starts
MAX_RERUN_BYTES = 16 << 20  # an --experimental-rerun pickle (Hydra's config.pickle is a few KiB)
_SHELLS = ("bash", "zsh", "fish")
# The module Hydra takes the command's task function from: the job's name (cli: hydra.job.name, the cli.log of a run)
# and the package a relative --config-path starts in (pkg://zoo/PATH, the directory zoo/PATH) follow from it.
TASK_MODULE = "zoo.cli"
_ZOO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Plan:
    """A command line checked whole: what to run, composed once per job, and what to remove if a job is refused
    after all (a bad input a task finds only once it runs)."""
    mode: str                      # run, multirun, cfg, info, help, shell, rerun
    argv: list[str] = field(default_factory=list)   # for Hydra's own entry (--cfg, --info, --help, completion)
    rerun: str | None = None
    # (output directory, its deepest ancestor that existed before): a refusal inside the run removes what it made
    output: tuple[Path, Path] | None = None
    config_name: str = "config"
    hydra: object = None           # the Hydra instance the configs were composed with (search path, task name)
    whole: DictConfig | None = None   # run: the job's config as Hydra runs it; multirun: the sweep's own config
    loader: object = None          # multirun: serves the sweep's launcher the jobs composed here (PlannedJobs)
    jobs: int = 0

    @contextmanager
    def active(self) -> Iterator[None]:
        """Hydra initialized as it was when the configs were composed (tasks that compose read it), cleared after."""
        from hydra.core.global_hydra import GlobalHydra

        previous = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
        GlobalHydra.instance().clear()
        GlobalHydra.instance().initialize(self.hydra)
        try:
            yield
        finally:
            GlobalHydra.instance().clear()
            if previous is not None:
                GlobalHydra.instance().initialize(previous)


class PlannedJobs:
    """The config loader a sweep's launcher is handed: ``load_sweep_config`` returns the job's config as the plan
    composed and checked it (keyed by the job's overrides, as Hydra's basic sweeper forms them), so that no job is
    composed twice (Hydra's sweeper asks once to check a batch, its launcher once to run each job); a job the plan did
    not foresee is composed and checked here. Everything else is the loader's."""

    def __init__(self, loader, composed: dict[tuple[str, ...], DictConfig]):
        self._loader, self._composed = loader, composed

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        planned = self._composed.get(tuple(sweep_overrides))   # asked twice: the sweeper's check, then the launch
        if planned is not None:   # a copy: the launcher sets each job's id on it (and a sweep may repeat a job)
            return copy.deepcopy(planned)
        whole = self._loader.load_sweep_config(master_config, list(sweep_overrides))
        from zoo.config.composition import check_composed
        check_composed(whole, list(sweep_overrides), command_line=True)
        return whole

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_loader", "_composed"):   # unpickling (joblib's workers) asks first
            raise AttributeError(name)
        return getattr(self._loader, name)


def plan(argv: list[str]) -> Plan:
    """Check the whole command line, composing each job once; ConfigError (one line) for the first problem."""
    from zoo.config.schema import integral_overrides

    args = _parse(integral_overrides(list(argv)))
    overrides = list(args.overrides)
    mode = _mode(args, overrides)
    if mode == "rerun":
        _check_rerun(args, overrides)
        return Plan("rerun", rerun=args.experimental_rerun)
    if mode == "shell":
        _check_shell_completion(overrides)
        return Plan("shell", argv=_hydra_argv(args, overrides))
    with _hydra_for(args) as config_name:
        from hydra.core.global_hydra import GlobalHydra
        hydra = GlobalHydra.instance().hydra
        if mode == "multirun":
            whole, jobs = _sweep_jobs(overrides, config_name)
            directory, extra = output_dir(whole, "sweep", overrides)
            _set_hydra_overrides(whole, extra)   # before the jobs are composed: each reads the sweep's hydra overrides
            composed, job_configs = {}, []   # job_configs: in the launcher's order, duplicates kept
            for job in jobs:
                with _composition_errors(job):
                    job_whole = hydra.config_loader.load_sweep_config(whole, list(job))
                task_checks(_checked(job_whole, job), job_whole)
                composed[tuple(job)] = job_whole
                job_configs.append(job_whole)
            if directory is not None:
                check_job_dirs(directory[0], job_configs, overrides)
            return Plan(mode, argv=_hydra_argv(args, overrides + extra), output=directory, config_name=config_name,
                        hydra=hydra, whole=whole, loader=PlannedJobs(hydra.config_loader, composed), jobs=len(jobs))
        whole = _compose(hydra, overrides, config_name, run_mode="run" if mode == "run" else "show")
        cfg = _checked(whole, overrides)
        if mode == "cfg" and args.package:
            _check_package(whole, args.package)
        if mode != "run":  # --cfg, --info, --help print and write nothing
            return Plan(mode, argv=_hydra_argv(args, overrides))
        task_checks(cfg, whole)
        directory, extra = output_dir(whole, "run", overrides)
        _set_hydra_overrides(whole, extra)
    return Plan(mode, argv=_hydra_argv(args, overrides + extra), output=directory, config_name=config_name,
                hydra=hydra, whole=whole, jobs=1)


# ------------------------------------------------------------------------------------------- the command line

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its usage and the message on several lines
        raise ConfigError(f"{message.replace('argument ', '', 1)} (python -m zoo --help lists the options)")


def _parse(arguments: list[str]) -> argparse.Namespace:
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.__class__ = _Parser
    try:
        return parser.parse_intermixed_args(arguments)  # `heads=2 -m layers=1,2` as well as `-m heads=2 ...`
    except TypeError:  # a parser parse_intermixed_args cannot handle (a future Hydra): as Hydra parses
        return parser.parse_args(arguments)


def _mode(args: argparse.Namespace, overrides: list[str]) -> str:
    commands = [name for name, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                      ("--shell-completion", args.shell_completion), ("--info", args.info)) if on]
    if len(commands) > 1:
        raise ConfigError(f"{' '.join(commands)}: only one of --run, --multirun, --cfg, --info and "
                          f"--shell-completion can be given")
    if args.experimental_rerun is not None:
        return "rerun"
    if args.resolve and not (args.cfg or args.help):
        raise ConfigError("--resolve: resolves the config that --cfg or --help prints, and neither is given")
    if args.package is not None and not args.cfg:
        raise ConfigError(f"--package={args.package}: selects the part of the config that --cfg prints, and --cfg "
                          f"is not given")
    if args.help or args.hydra_help:
        return "help"
    if args.shell_completion:
        return "shell"
    if args.cfg:
        return "cfg"
    if args.info is not None:
        return "info"
    if args.multirun or any(w.replace(" ", "") == "hydra.mode=MULTIRUN" for w in overrides):
        return "multirun"
    return "run"


def _hydra_argv(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The flags in `--flag=value` form, then the overrides: what Hydra's parser reads back exactly."""
    flags = [flag for flag, on in (("--help", args.help), ("--hydra-help", args.hydra_help), ("--run", args.run),
                                   ("--multirun", args.multirun), ("--resolve", args.resolve),
                                   ("--shell-completion", args.shell_completion)) if on]
    for flag, value in (("--cfg", args.cfg), ("--package", args.package), ("--config-path", args.config_path),
                        ("--config-name", args.config_name), ("--config-dir", args.config_dir),
                        ("--info", args.info)):
        if value is not None:
            flags.append(f"{flag}={value}")
    return flags + overrides


def _check_rerun(args: argparse.Namespace, overrides: list[str]) -> None:
    """Hydra ignores every other argument of a rerun (with a warning): refused instead."""
    others = [flag for flag, on in (("--multirun", args.multirun), ("--cfg", args.cfg), ("--info", args.info),
                                    ("--config-name", args.config_name), ("--config-path", args.config_path),
                                    ("--config-dir", args.config_dir), ("--shell-completion", args.shell_completion),
                                    ("--help", args.help)) if on]
    if overrides or others:
        raise ConfigError(f"--experimental-rerun: reruns a job exactly as it ran, and cannot take "
                          f"{' '.join([*others, *overrides][:3])} as well")
    path = Path(args.experimental_rerun)
    problem = _readable_file(path, MAX_RERUN_BYTES)
    if problem:
        raise ConfigError(f"--experimental-rerun={args.experimental_rerun}: {problem} (a config.pickle that Hydra's "
                          f"PickleJobInfoCallback wrote)")


def _readable_file(path: Path, limit: int) -> str | None:
    try:
        if not path.exists():
            return "no such file"
        if not path.is_file():
            return "not a regular file"
        size = path.stat().st_size
    except (OSError, ValueError) as exc:
        return f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    if size > limit:
        return f"{size:,} bytes, more than the {limit:,} such a file may have"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    return None


def _check_shell_completion(overrides: list[str]) -> None:
    words = [w.partition("=") for w in overrides]
    commands = [(key, value) for key, _, value in words if key in ("install", "uninstall", "query")]
    others = [key for key, _, _ in words if key not in ("install", "uninstall", "query")]
    if len(commands) != 1 or others:
        raise ConfigError(f"--shell-completion {' '.join(overrides)}: takes one of install=SHELL, uninstall=SHELL or "
                          f"query=SHELL (allowed shells: {', '.join(_SHELLS)})")
    command, shell = commands[0]
    if shell not in _SHELLS:
        raise ConfigError(f"--shell-completion {command}={shell}: no such shell (allowed: {', '.join(_SHELLS)})")
    if command == "query" and "COMP_LINE" not in os.environ:
        raise ConfigError(f"--shell-completion query={shell}: the shell runs this while completing, with COMP_LINE "
                          f"set; to set completion up: --shell-completion install={shell}")


def _check_package(whole: DictConfig, package: str) -> None:
    node = OmegaConf.select(whole, package, default=None) if package not in ("_global_", "") else whole
    if node is None:
        top = ", ".join(k for k in whole if k != "hydra")
        raise ConfigError(f"--package={package}: no such package in the config (allowed: _global_, hydra, {top})")


# ------------------------------------------------------------------------------------------ composing as Hydra

@contextmanager
def _hydra_for(args: argparse.Namespace) -> Iterator[str]:
    """GlobalHydra initialized with the search path Hydra's run will use (-cp, -cd), cleared after; yields the
    primary config's name (-cn)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path, detect_task_name
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    config_path = args.config_path if args.config_path is not None else "pkg://zoo.conf"
    if args.config_path is not None:
        _check_config_path(config_path)
        if not config_path.startswith("pkg://"):
            _check_config_files(config_path if os.path.isabs(config_path)
                                else os.path.join(_ZOO_DIR, config_path), "--config-path")
    search_path = create_automatic_config_search_path(None, TASK_MODULE, config_path)
    if args.config_dir is not None:
        directory = os.path.abspath(args.config_dir)
        if not os.path.isdir(directory):
            raise ConfigError(f"--config-dir={args.config_dir}: no such directory")
        _check_config_files(directory, "--config-dir")
        search_path.prepend(provider="command-line", path=f"file://{directory}",
                            anchor=SearchPathQuery(provider="schema"))
    config_name = args.config_name if args.config_name is not None else "config"
    previous = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        Hydra.create_main_hydra2(task_name=detect_task_name(None, TASK_MODULE), config_search_path=search_path)
        loader = GlobalHydra.instance().config_loader()
        if not loader.repository.config_exists(f"{config_name}.yaml") and \
                not loader.repository.config_exists(config_name):
            raise ConfigError(f"--config-name={config_name}: no such primary config in the search path (allowed: "
                              f"config, or a config in the directory -cp or -cd names)")
        yield config_name
    finally:
        GlobalHydra.instance().clear()
        if previous is not None:
            GlobalHydra.instance().initialize(previous)


def _check_config_path(config_path: str) -> None:
    import importlib.util

    if config_path.endswith((".yaml", ".yml")):
        raise ConfigError(f"--config-path={config_path}: a directory, not a file (name the config with -cn)")
    if config_path.startswith("pkg://"):
        module = config_path.removeprefix("pkg://").replace("/", ".")
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"--config-path={config_path}: no such package")
        return
    directory = config_path if os.path.isabs(config_path) else os.path.join(_ZOO_DIR, config_path)
    if not os.path.isdir(directory):
        raise ConfigError(f"--config-path={config_path}: no such directory (relative paths start at "
                          f"{_ZOO_DIR}; give an absolute one)")


MAX_CONFIG_BYTES = 1 << 20  # one YAML file of a config directory (the zoo's are under 2 KiB)
MAX_CONFIG_FILES = 10_000


def _check_config_files(directory: str, flag: str) -> None:
    """The YAML files of a config directory a user names, bounded before Hydra parses any: at most
    MAX_CONFIG_FILES files looked at, each at most MAX_CONFIG_BYTES."""
    seen = 0
    for root, _, names in os.walk(directory):
        for name in names:
            seen += 1
            if seen > MAX_CONFIG_FILES:
                raise ConfigError(f"{flag}={directory}: more than {MAX_CONFIG_FILES:,} files (a config directory "
                                  f"holds YAML files, not a data set)")
            path = os.path.join(root, name)
            try:
                size = os.path.getsize(path) if name.endswith((".yaml", ".yml")) else 0
            except OSError:
                continue
            if size > MAX_CONFIG_BYTES:
                raise ConfigError(f"{flag}={directory}: {path} has {size:,} bytes, more than the "
                                  f"{MAX_CONFIG_BYTES:,} a config file may have")


def _composition_errors(overrides: list[str]):
    from zoo.config.composition import composition_errors
    return composition_errors(overrides)


def _compose(hydra, overrides: list[str], config_name: str, run_mode: str) -> DictConfig:
    """The config of a single run, composed as Hydra's own run composes it (logging configured when it is to run)."""
    from hydra.types import RunMode

    from zoo.config.composition import check_override_words

    check_override_words(overrides)
    with _composition_errors(overrides):
        whole = hydra.compose_config(config_name, overrides, run_mode=RunMode.RUN,
                                     with_log_configuration=run_mode == "run")
    if whole.hydra.mode is None:
        with read_write(whole.hydra), open_dict(whole.hydra):
            whole.hydra.mode = RunMode.RUN
    return whole


def _checked(whole: DictConfig, overrides: list[str]) -> DictConfig:
    from zoo.config.composition import check_composed
    return check_composed(whole, overrides, command_line=True)


def _set_hydra_overrides(whole: DictConfig, extra: list[str]) -> None:
    """Hydra overrides the plan adds (the run's own output directory), set in the composed config as Hydra would have
    set them from the command line: the value, and the word in hydra.overrides.hydra (hydra.yaml records it, and a
    sweep's jobs are composed with it)."""
    for word in extra:
        key, _, value = word.partition("=")
        with read_write(whole), open_dict(whole):
            OmegaConf.update(whole, key, value, merge=False)
            whole.hydra.overrides.hydra.append(word)


def _sweep_jobs(overrides: list[str], config_name: str) -> tuple[DictConfig, list[list[str]]]:
    """The sweep's own config and its jobs, each a list of overrides exactly as Hydra's basic sweeper forms them (the
    product of the comma lists, range() and choice() of each task key, the last override of a key winning), at most
    MAX_JOBS, counted before any list is expanded."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from hydra.types import RunMode

    from zoo.config.composition import check_override_words, explain_composition_error

    check_override_words(overrides)
    hydra = GlobalHydra.instance().hydra
    with _composition_errors(overrides):
        whole = hydra.compose_config(config_name, overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=True)
        task_overrides = OmegaConf.to_container(whole.hydra.overrides.task, resolve=False)
        parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(task_overrides)
    batch = whole.hydra.get("sweeper", {}).get("max_batch_size")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ConfigError(f"hydra.sweeper.max_batch_size={batch}: must be a positive integer or null (all at once)")
    counts: dict[str, int] = {}
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            counts[key] = 1
            continue
        if not override.is_discrete_sweep():
            raise ConfigError(f"{override.input_line}: Hydra's basic sweeper takes comma lists, range() and "
                              f"choice() (an interval needs a sweeper plug-in such as Optuna)")
        try:
            values = list(itertools.islice(override.sweep_string_iterator(), MAX_JOBS + 1))
        except HydraException as exc:
            raise ConfigError(f"{override.input_line}: {explain_composition_error(exc, overrides)}") from None
        if not values:
            raise ConfigError(f"{override.input_line}: matches no value, so the sweep has no jobs")
        if len(values) > MAX_JOBS:
            raise ConfigError(f"{override.input_line}: more than {MAX_JOBS:,} values (allowed: at most {MAX_JOBS:,} "
                              f"jobs in one sweep)")
        counts[key] = len(values)
    count = 1
    for n in counts.values():
        count *= n
    if count > MAX_JOBS:
        raise ConfigError(f"-m {' '.join(o for o in overrides if ',' in o or '(' in o)[:200]}: {count:,} jobs "
                          f"(allowed: at most {MAX_JOBS:,} jobs in one sweep)")
    with _composition_errors(overrides):
        batches = BasicSweeper.split_arguments(parsed, None)
    return whole, [job for batch_ in batches for job in batch_]


# ---------------------------------------------------------------------------------------- each task's checks

def task_checks(cfg: DictConfig, whole: DictConfig) -> None:
    """What each task would refuse once it ran, checked now (the task checks it again when it runs)."""
    from zoo.config.sizing import check_fits

    name = cfg.task.name
    if name == "run":
        check_fits(cfg, batch=cfg.task.batch, length=cfg.task.seq_len)
    elif name == "verify":
        check_fits(cfg)
    elif name == "train":
        from zoo.tasks.train import check_out_dir, fit_config_to_data, training_fits

        fitted, _ = fit_config_to_data(cfg)
        training_fits(fitted)
        if not OmegaConf.is_interpolation(cfg.task, "out_dir"):
            check_out_dir(Path(cfg.task.out_dir), resume=bool(cfg.task.resume))
    elif name == "compare":
        from zoo.tasks.compare import check_compare

        check_compare(whole.hydra.runtime.choices.get("preset"), cfg.reference, cfg.task)
    elif name == "generate":
        from zoo.io.checkpoint_read import resolve_checkpoint

        if not cfg.task.checkpoint:
            raise ConfigError("task.checkpoint: required (a task=train out_dir or one of its step-NNNNNNN directories)")
        resolve_checkpoint(cfg.task.checkpoint)  # a directory that holds one (read and verified when the task runs)
