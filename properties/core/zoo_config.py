"""The zoo config a run names — ``--zoo "OVERRIDES"`` or ``--zoo-config FILE`` — obtained once per session.

``--zoo`` composes the packaged Hydra tree with the overrides; ``--zoo-config`` loads a config that was
composed elsewhere (``python -m zoo task=verify`` writes the one it composed, so the suite never composes it
again; any run's ``outputs/DATE/TIME/.hydra/config.yaml`` works too, its options read from the
``hydra.yaml`` beside it). Either way the model clauses run on the model that config builds, the module clauses on the part
nodes it names, and the layer clauses on the layers of a model built from it in float64.
"""
from __future__ import annotations

import contextlib
import functools
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import DictConfig

from properties.core.config_file import read_config
from properties.core.watchdog import user_call
from zoo.config.options import PARTS

__all__ = ["ZooRun", "PARTS", "compose", "zoo_run"]

# Sizes of the models whose layers the layer clauses check under --zoo (overrides that set a key win).
LAYER_SIZES = ("d_model=16", "heads=2", "d_ff=32", "layers=2", "vocab_size=16", "max_len=16")

_RUN = pytest.StashKey[object]()


@dataclass(frozen=True)
class ZooRun:
    cfg: DictConfig              # the validated config of the model under test
    layer_cfg: DictConfig        # the config the layer and module clauses build from (tiny sizes under --zoo)
    choices: dict                # group -> option chosen ("config" for a loaded file)
    named: frozenset             # the part groups the user named: their module clauses run
    origin: str                  # "--zoo '...'" or "--zoo-config PATH", for reports and errors

    def __repr__(self) -> str:  # Hypothesis prints it in counterexamples
        return f"<{self.origin}>"

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis' printer would list every field of the config
        printer.text(repr(self))


def _plugin_call(origin: str):
    """The bounded call (--call-timeout) around a plug-in's own code while a config is validated: Hydra's
    composition and the zoo's imports are the suite's work, which a loaded machine may make slow."""
    return lambda: user_call(f"model built by {origin}", "importing the parts it names (validating it)")


@functools.lru_cache(maxsize=None)
def compose(words: tuple[str, ...], origin: str | None = None) -> tuple[DictConfig, dict]:
    """(validated config, the option chosen for each group) for Hydra overrides; ConfigError if unusable. With
    ``origin`` (how the user named the model, for messages) the plug-in's code runs as a bounded call."""
    from hydra import compose as hydra_compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from zoo.config.composition import explain_composition_error
    from zoo.config.errors import ConfigError
    from zoo.config.schema import validate
    if not any(w.split("=", 1)[0].lstrip("+~") == "task" for w in words):
        # the suite checks models, not a task: verify's node has no sizes of its own to contradict the model's
        words = ("task=verify", *words)
    try:
        if GlobalHydra.instance().is_initialized():
            cfg = hydra_compose("config", overrides=list(words), return_hydra_config=True)
        else:
            with initialize_config_module("zoo.conf", version_base="1.3"):
                cfg = hydra_compose("config", overrides=list(words), return_hydra_config=True)
    except HydraException as exc:
        raise ConfigError(explain_composition_error(exc)) from exc
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items()}
    with open_dict(cfg):
        del cfg["hydra"]
    validate(cfg, _plugin_call(origin) if origin else contextlib.nullcontext)
    return cfg, choices


def group_of(word: str) -> str | None:
    """The part group (or 'model') an override word names, e.g. 'attention' for 'attention._target_=...'."""
    key = word.split("=", 1)[0].lstrip("+~")
    head = key.split(".", 1)[0].split("@", 1)[0]
    return head if head in PARTS or head == "model" else None


def with_layer_sizes(words: tuple[str, ...]) -> tuple[str, ...]:
    given = {w.split("=", 1)[0].lstrip("+~") for w in words}
    return tuple(s for s in LAYER_SIZES if s.split("=", 1)[0] not in given) + tuple(words)


def _load(path: str) -> DictConfig:
    from zoo.config.errors import ConfigError
    from zoo.config.schema import validate
    try:
        cfg = read_config(Path(path))
    except ConfigError as exc:
        raise pytest.UsageError(f"--zoo-config {path!r}: {exc}") from None
    try:
        validate(cfg, _plugin_call(f"--zoo-config {path}"))
    except ConfigError as exc:
        raise pytest.UsageError(f"--zoo-config {path!r}: {exc}") from None
    except Exception as exc:  # a key missing altogether
        raise pytest.UsageError(f"--zoo-config {path!r}: not a zoo config ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0]})") from None
    return cfg


def _choices_beside(path: Path) -> dict:
    """The option chosen in each group, from the hydra.yaml that Hydra (and task=verify) writes beside a
    run's config.yaml; the clauses about one option (norm=rmsnorm, pos=rotary, ...) need it."""
    beside = path.parent / "hydra.yaml"
    if not beside.is_file():
        return {}
    try:
        return {str(k): str(v) for k, v in read_config(beside).hydra.runtime.choices.items()}
    except Exception:  # not Hydra's layout: the clauses about one option skip with their reason
        return {}


def zoo_run(config) -> ZooRun | None:
    """The run's zoo config, or None when neither --zoo nor --zoo-config is given (cached per session)."""
    if _RUN in config.stash:
        return config.stash[_RUN]
    text, path = config.getoption("zoo", None), config.getoption("zoo_config", None)
    if text and path:
        raise pytest.UsageError("--zoo and --zoo-config both name a zoo model: give one")
    run = None
    if path:
        cfg = _load(path)
        run = ZooRun(cfg, cfg, _choices_beside(Path(path)), frozenset(PARTS) | {"model"}, f"--zoo-config {path}")
    elif text:
        from zoo.runtime.plugins import PluginError
        from zoo.config.errors import ConfigError
        words = tuple(shlex.split(text))
        if any(word.lstrip("+~").split("=", 1)[0] == "call_timeout" for word in words):   # the CLI's limit, not read here
            raise pytest.UsageError(f"--zoo {' '.join(words)!r}: call_timeout is python -m zoo's limit; the suite's "
                                    f"limit on each call is --call-timeout SECONDS")
        try:
            origin = f"--zoo {' '.join(words)}"
            cfg, choices = compose(words, origin)
            layer_cfg, _ = compose(with_layer_sizes(words), origin)
        except (ConfigError, PluginError) as exc:
            raise pytest.UsageError(f"--zoo {' '.join(words)!r}: {exc}") from None
        named = frozenset(g for g in map(group_of, words) if g is not None)
        run = ZooRun(cfg, layer_cfg, choices, named, f"--zoo {' '.join(words)}")
    if run is not None:
        _check_size(config, run)
    config.stash[_RUN] = run
    return run


def _check_size(config, run: ZooRun) -> None:
    """The zoo's own size check (zoo.config.sizing.check_fits, as ``python -m zoo`` runs it) before the suite builds
    anything: a model that cannot fit is one line, not an allocation failure or hours of building. It runs for the
    model under test on the first --device (when this machine has it) and for the layer clauses' model on the CPU."""
    from zoo.config.sizing import builds_a_part, check_fits
    from zoo.config.errors import ConfigError
    from properties.core.watchdog import UserExit, raised
    from properties.core.dtypes import device_unavailable
    import torch
    device = (config.getoption("--device", None) or ["cpu"])[0]
    try:
        checks = [(run.cfg, device)] if not device_unavailable(torch.device(device)) else []
    except (RuntimeError, ValueError):   # a --device that names nothing: the plugin says so
        checks = []
    checks.append((run.layer_cfg, "cpu"))
    # A part of the user's own is counted by building it on the meta device, where torch's first arithmetic in a
    # process imports its decompositions (over a second): not the code under test's time. The zoo's own parts are
    # counted from their settings, with nothing to import.
    if any(builds_a_part(cfg) for cfg, _ in checks):
        torch.empty(1, device="meta").normal_()
    for cfg, where in checks:
        try:
            with user_call(f"model built by {run.origin}", "the size check (zoo.config.sizing.check_fits)"):
                check_fits(cfg, device=where)
        except ConfigError as exc:   # ModelTooLarge among them
            raise pytest.UsageError(f"{run.origin}: {exc}") from None
        except UserExit as exc:   # a user's part that calls sys.exit() while constructed, say
            raise pytest.UsageError(f"{run.origin}: building the model raised {raised(exc)}") from None
        except Exception:  # noqa: BLE001  a user's part that cannot be sized this way: the build that follows says why
            pass
