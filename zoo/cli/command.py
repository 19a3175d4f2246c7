"""``python -m zoo [overrides]``: check the whole command line and compose each job once (zoo/cli/plan.py), then
run the jobs through Hydra's own job machinery (its run directory, .hydra/ files, logging, callbacks, a sweep's
launcher) with the configs the plan composed, each handed to its task (zoo/cli/tasks.py).

Every bad input is one line on stderr and status 2, whichever step finds it; a refusal once a job has started
removes the output directory it made if that holds nothing but Hydra's own files."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
import torch
from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zoo.cli.directories import discard
from zoo.cli.help import project_help
from zoo.cli.plan import TASK_MODULE, Plan, plan
from zoo.cli.tasks import TASKS, Job, OwnExit, Refusal
from zoo.config.composition import explain_composition_error, explain_config_error, validate_checked
from zoo.config.errors import ConfigError
from zoo.config.sizing import ModelTooLarge
from zoo.io.checkpoint_read import CheckpointError
from zoo.runtime.call_limit import DEFAULT_TIMEOUT, CallLimitExceeded, parse_limit, reset_limit, set_limit
from zoo.tasks.interrupts import Interrupted, stop_on_sigterm

__all__ = ["main", "say", "JobRunner"]

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch < 2.5: cuda's


def say(message: str) -> None:
    """One line on stderr, whatever the message quotes of the input: a control character or a line separator in
    a value (\\n, \\r, U+0085, U+2028 ...) is written as its escape."""
    print("".join(c if c.isprintable() else repr(c)[1:-1] for c in message), file=sys.stderr, flush=True)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error).strip() else type(error).__name__


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (_OUT_OF_MEMORY, MemoryError)) or "can't allocate memory" in str(error)


class JobRunner:
    """The task function Hydra runs for each job (in this process, or in a launcher's worker: it pickles): the job's
    config, composed and validated by the plan, handed to its task; what the task refuses is one line. ``output``: the
    plan's output directory, removed on a refusal if it holds only Hydra's files."""

    def __init__(self, output: tuple[Path, Path] | None):
        self.output = output

    def __call__(self, cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        runtime = HydraConfig.get()
        job = Job(cfg, list(runtime.overrides.task), dict(runtime.runtime.choices), Path(runtime.runtime.output_dir))
        set_limit(parse_limit(cfg.call_timeout))
        try:  # a task finds some problems only once it runs (data vs model, a checkpoint): still one line
            TASKS[cfg.task.name](job)
        except OwnExit:
            raise
        except Refusal as refusal:
            self.refuse(str(refusal), refusal.status)
        except CallLimitExceeded as error:  # a plug-in's call interrupted past call_timeout
            self.refuse(str(error), status=1)
        except SystemExit as stop:  # code the run called (a plug-in's constructor, kernel or forward) ended it
            self.refuse(f"zoo: the run was ended by sys.exit({stop.code!r}) in code it called (a plug-in?); nothing "
                        f"it was to do was finished")
        except ModelTooLarge as error:
            self.refuse(f"zoo: model too large: {error}")
        except ConfigError as error:
            self.refuse(f"zoo: invalid config: {error}")
        except CheckpointError as error:
            self.refuse(f"zoo: bad checkpoint: {error}")
        except InstantiationException as error:  # a constructor (of a plug-in, or one given sizes it cannot take)
            cause = error.__cause__ or error
            if _out_of_memory(cause):
                self.refuse(f"zoo: out of memory: {_first_line(cause)}")
            self.refuse(f"zoo: the model cannot be built: {type(cause).__name__}: {_first_line(cause)}")
        except (_OUT_OF_MEMORY, MemoryError) as error:
            self.refuse(f"zoo: out of memory: {_first_line(error)}")
        except RuntimeError as error:  # the CPU allocator says it this way
            if not _out_of_memory(error):
                error.zoo_task_raised = True
                raise
            self.refuse(f"zoo: out of memory: {_first_line(error)}")
        except OSError as error:  # a file or directory that cannot be read or written
            where = f": {error.filename}" if error.filename else ""
            self.refuse(f"zoo: {error.strerror or type(error).__name__}{where}")
        except Exception as error:  # a bug in a task: its traceback, as Python shows it
            error.zoo_task_raised = True
            raise

    def refuse(self, message: str, status: int = 2):
        """One line on stderr and the exit status; the output directory this run made goes too if it holds nothing
        but Hydra's own files (a bad input leaves nothing behind)."""
        try:
            discard(self.output)
        except OSError:  # the refusal itself must still be said
            pass
        say(message)
        raise OwnExit(status)


def _run(checked: Plan) -> None:
    """The plan's jobs through Hydra's job machinery, with the configs the plan composed (as Hydra.run and
    Hydra.multirun do after composing them)."""
    from hydra.core.plugins import Plugins
    from hydra.core.utils import run_job
    from hydra.types import HydraContext
    from hydra._internal.callbacks import Callbacks

    runner, cfg, name = JobRunner(checked.output), checked.whole, checked.config_name
    callbacks = Callbacks(cfg)
    with checked.active():
        if checked.mode == "run":
            callbacks.on_run_start(config=cfg, config_name=name)
            ret = run_job(hydra_context=HydraContext(config_loader=checked.hydra.config_loader, callbacks=callbacks),
                          task_function=runner, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                          configure_logging=True)
            callbacks.on_run_end(config=cfg, config_name=name, job_return=ret)
            _ = ret.return_value   # the task's exception, if it raised one
            return
        callbacks.on_multirun_start(config=cfg, config_name=name)
        sweeper = Plugins.instance().instantiate_sweeper(
            config=cfg, hydra_context=HydraContext(config_loader=checked.loader, callbacks=callbacks),
            task_function=runner)
        sweeper.sweep(arguments=OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False))
        callbacks.on_multirun_end(config=cfg, config_name=name)


def _print_only(cfg: DictConfig) -> None:
    """The task function of Hydra's own entry, which serves what only prints (--cfg, --info, --help, --hydra-help,
    --shell-completion) and never runs it; jobs run through ``_run``, which hands Hydra the configs the plan composed."""
    raise AssertionError(f"python -m zoo runs its jobs through zoo/cli/command.py: _run, not Hydra's entry "
                         f"(task={cfg.task.name})")


# Hydra names the job and finds a relative --config-path from its task function's module: the plan's (TASK_MODULE),
# so that --cfg hydra and --info print what a run of the same command line uses.
_print_only.__module__ = TASK_MODULE
_hydra_entry = hydra.main(config_path="pkg://zoo.conf", config_name="config", version_base="1.3")(_print_only)


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
            from zoo.runtime.leftovers import end_leftovers
            end_leftovers(status, who="a plug-in")


def _main(arguments: list[str]) -> None:
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
    runner = JobRunner(checked.output)
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises what it meets instead of printing it over many lines
    try:
        if checked.mode in ("run", "multirun"):
            _run(checked)
        else:
            sys.argv[1:] = checked.argv
            _hydra_entry()
    except HydraException as error:  # what Hydra met that the checks before it did not foresee
        runner.refuse(f"zoo: invalid config: {explain_composition_error(error, checked.argv)}")
    except OmegaConfBaseException as error:
        runner.refuse(f"zoo: invalid config: {explain_config_error(error, checked.argv)}")
    except Exception as error:  # Hydra's own machinery (logging set up from hydra.job_logging, a callback ...)
        if getattr(error, "zoo_task_raised", False):
            raise
        cause = error.__cause__ or error
        runner.refuse(f"zoo: invalid config: Hydra cannot start the run: {_first_line(error)}"
                      + (f": {_first_line(cause)}" if cause is not error else ""))
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


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
    runner = JobRunner(None)
    try:
        validate_checked(cfg)
    except ConfigError as error:
        runner.refuse(f"zoo: invalid config: {error}")
    runner(cfg)
