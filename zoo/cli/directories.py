"""The output directory of a `python -m zoo` run, checked before Hydra makes it (zoo/cli/plan.py), and removed
again if the run refuses its config once Hydra has started (a bad input leaves nothing behind)."""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

from zoo.config.errors import ConfigError
from zoo.io.atomic import existing_ancestor, unwritable

__all__ = ["output_dir", "check_job_dirs", "discard"]

_HYDRA_DEFAULT_DIRS = {"run": "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}",
                       "sweep": "multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}"}


def output_dir(whole: DictConfig, kind: str, overrides: list[str]) -> tuple[tuple[Path, Path] | None, list[str]]:
    """((the run's or sweep's directory, its deepest ancestor that exists now), the overrides to add).

    Hydra's default directory (outputs/DATE/TIME, multirun/DATE/TIME) is shared by two runs started in the same
    second: unless the config names another, it is named after the time to the microsecond and the process id,
    which no two running processes share. A named one must resolve and be writable."""
    from datetime import datetime

    raw = OmegaConf.to_container(whole.hydra[kind], resolve=False)["dir"]
    extra = []
    if raw == _HYDRA_DEFAULT_DIRS[kind]:
        now = datetime.now()
        root = "outputs" if kind == "run" else "multirun"
        path = f"{root}/{now:%Y-%m-%d}/{now:%H-%M-%S}-{now:%f}-{os.getpid()}"
        # both, as before: a sweep's jobs read hydra.run.dir too where a launcher runs them one by one
        extra = [f"hydra.{k}.dir={root_dir}/{now:%Y-%m-%d}/{now:%H-%M-%S}-{now:%f}-{os.getpid()}"
                 for k, root_dir in (("run", "outputs"), ("sweep", "multirun"))
                 if OmegaConf.to_container(whole.hydra[k], resolve=False)["dir"] == _HYDRA_DEFAULT_DIRS[k]]
    else:
        path = _resolved(whole, kind, "dir", raw, overrides)
        if path is None:
            return None, extra
    problem = unwritable(path)
    if problem:
        raise ConfigError(f"{_given(overrides, kind, 'dir', raw)}: the output directory cannot be written: {problem}")
    target = Path(path).absolute()
    return (target, existing_ancestor(target)), extra


def check_job_dirs(sweep: Path, jobs: list[DictConfig], overrides: list[str]) -> None:
    """Each job of a sweep runs in the sweep's directory joined with hydra.sweep.subdir (numbered as the launcher
    numbers its jobs, from 0): ConfigError for the first that cannot be written, before Hydra makes the sweep's."""
    for num, job in enumerate(jobs):
        raw = OmegaConf.to_container(job.hydra.sweep, resolve=False)["subdir"]
        job = job.copy()
        with open_dict(job):
            job.hydra.job.num, job.hydra.job.id = num, num
        subdir = _resolved(job, "sweep", "subdir", raw, overrides)
        problem = subdir and unwritable(str(sweep / subdir))
        if problem:
            raise ConfigError(f"{_given(overrides, 'sweep', 'subdir', raw)}: a job's directory cannot be written: "
                              f"{problem}")


def _given(overrides: list[str], kind: str, key: str, raw: str) -> str:
    """The override that set hydra.<kind>.<key>, as typed, else the key and its value in the config."""
    return next((w for w in overrides if w.partition("=")[0].lstrip("+") == f"hydra.{kind}.{key}"),
                f"hydra.{kind}.{key}={raw}")


def _resolved(whole: DictConfig, kind: str, key: str, raw: str, overrides: list[str]) -> str | None:
    """hydra.<kind>.<key> resolved as Hydra will resolve it (the `now` and `hydra` resolvers); None when it names a
    value only the run sets (`${hydra:runtime.output_dir}`)."""
    from hydra.core.hydra_config import HydraConfig

    instance = HydraConfig.instance()
    previous = instance.cfg
    try:
        instance.set_config(whole)
        value = whole.hydra[kind][key]
    except MissingMandatoryValue:
        return None
    except (InterpolationResolutionError, OmegaConfBaseException, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{_given(overrides, kind, key, raw)}: the interpolation does not resolve: {reason}") \
            from None
    finally:
        instance.cfg = previous
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"hydra.{kind}.{key}={raw}: not a directory name")
    return value


def discard(output: tuple[Path, Path] | None) -> None:
    """After a refusal once Hydra has started: remove the run's (or sweep's) directory if every file in it is one of
    Hydra's own (under .hydra/, a job's log, a sweep's multirun.yaml), then its parents that this run made."""
    import shutil

    if output is None:
        return
    target, base = output
    if target == base or base not in target.parents or not target.is_dir():
        return
    for root, _, names in os.walk(target):
        inside_hydra = ".hydra" in Path(root).relative_to(target).parts
        if not all(inside_hydra or name.endswith(".log") or name == "multirun.yaml" for name in names):
            return
    shutil.rmtree(target, ignore_errors=True)
    for parent in target.parents:
        if parent == base:
            break
        try:
            parent.rmdir()  # only an empty one: another run may share it
        except OSError:
            break
