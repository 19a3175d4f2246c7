"""Composing the config tree with overrides, checked: every way an override can fail is one ConfigError line.

``compose_checked`` composes (Hydra's compose API, inside a running Hydra app or the packaged tree), refuses an
optional group's option that does not exist (``recipe=nosuch`` would otherwise be dropped silently), validates
every value (zoo/config/schema.py) and refuses a key the chosen task does not read (zoo/config/task_schemas.py).
Hydra's and OmegaConf's own errors span several lines; ``explain_composition_error`` and ``explain_config_error``
say them in one.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Sequence

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, open_dict
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

from zoo.config.errors import ConfigError
from zoo.config.options import options
from zoo.config.schema import integral_overrides, validate
from zoo.config.task_schemas import check_applies, override_key

__all__ = ["compose_checked", "check_composed", "composition_errors", "compose_config", "explain_composition_error", "explain_config_error",
           "validate_checked", "check_override_words", "OPTIONAL_GROUPS"]

OPTIONAL_GROUPS = ("recipe",)  # `optional` entries of conf/config.yaml's defaults: Hydra skips a missing option


def compose_checked(overrides: Sequence[str] = (), *, config_name: str = "config",
                    command_line: bool = False) -> tuple[DictConfig, DictConfig]:
    """(the validated config, the whole composed config with Hydra's node: run and sweep dirs, choices).

    command_line: the overrides are a command line's, so a key its task does not read is refused (check_applies);
    building a model from overrides (build_model) runs no task and reads every model key."""
    overrides = integral_overrides(list(overrides))
    check_override_words(overrides)
    with composition_errors(overrides):
        if GlobalHydra.instance().is_initialized():  # inside a running Hydra app
            whole = compose(config_name, overrides=overrides, return_hydra_config=True)
        else:
            with initialize_config_module("zoo.conf", version_base="1.3"):
                whole = compose(config_name, overrides=overrides, return_hydra_config=True)
    return check_composed(whole, overrides, command_line=command_line), whole


@contextlib.contextmanager
def composition_errors(overrides: Sequence[str]):
    """What composing with ``overrides`` raises, as a one-line ConfigError."""
    try:
        yield
    except HydraException as exc:
        raise ConfigError(explain_composition_error(exc, overrides)) from None
    except (OmegaConfBaseException, ValueError, TypeError, KeyError, AttributeError, RecursionError, OSError) as exc:
        raise ConfigError(explain_config_error(exc, overrides)) from None


def check_composed(whole: DictConfig, overrides: Sequence[str], *, command_line: bool = False) -> DictConfig:
    """The config a composition gave (``whole``, with Hydra's node), checked: an optional group's option that does not
    exist, a key the task does not read (``command_line``), every value (validate). Returns it without Hydra's node."""
    _check_optional_choices(whole, overrides)
    cfg = copy.deepcopy(whole)
    with open_dict(cfg):
        del cfg["hydra"]
    if command_line:
        try:
            check_applies(cfg, overrides)
        except OmegaConfBaseException as exc:
            raise ConfigError(explain_config_error(exc, overrides)) from None
    validate_checked(cfg, overrides)
    return cfg


# Bounds on the command line, checked before Hydra's parser (recursive, and slow on long text) reads it.
MAX_OVERRIDES = 1000
MAX_OVERRIDE_CHARS = 16384
MAX_OVERRIDE_NESTING = 32
MAX_KEY_CHARS = 255


def _nesting(word: str) -> int:
    depth = deepest = 0
    for char in word:
        if char in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]})":
            depth -= 1
    return deepest


_REQUIRED_GROUPS = ("model", "attention", "ffn", "norm", "pos", "task", "data", "preset")


def check_override_words(overrides: Sequence[str]) -> None:
    """The command line's words before Hydra's parser reads them (it recurses on nesting, takes seconds on long text
    and looks a group's key up as a file name): bounded in number, length and nesting; and a word with no key, or
    the removal of what every config needs (`~d_model`, `~attention`, `model=null`), refused now rather than later
    in a long message about something else."""
    from dataclasses import fields

    from zoo.config.schema import ZooSchema

    required = {f.name for f in fields(ZooSchema)} - {"kv_heads", "reference", "allow_plugins"}
    if len(overrides) > MAX_OVERRIDES:
        raise ConfigError(f"{len(overrides):,} overrides, more than the {MAX_OVERRIDES:,} a command line may have")
    for word in overrides:
        if len(word) > MAX_OVERRIDE_CHARS:
            raise ConfigError(f"{word[:40]}...: {len(word):,} characters, more than the {MAX_OVERRIDE_CHARS:,} an "
                              f"override may have")
        if len(word.partition("=")[0]) > MAX_KEY_CHARS:
            raise ConfigError(f"{word[:40]}...: a key of {len(word.partition('=')[0]):,} characters, more than the "
                              f"{MAX_KEY_CHARS} a key may have (a group's key names a directory)")
        if _nesting(word) > MAX_OVERRIDE_NESTING:
            raise ConfigError(f"{word[:40]}...: brackets nested {_nesting(word):,} deep, more than the "
                              f"{MAX_OVERRIDE_NESTING} an override may nest")
        if not word.strip():
            raise ConfigError(f"{word!r}: an empty argument is not an override (an override is key=value, "
                              f"group=option or ~key)")
        key, equals, value = word.partition("=")
        bare = key.lstrip("+~")
        if not bare:
            raise ConfigError(f"{word}: no key before '=' (an override is key=value, group=option or ~key)")
        removed = key.startswith("~") or (equals and value.strip() == "null" and bare in _REQUIRED_GROUPS)
        if not removed:
            continue
        if bare in _REQUIRED_GROUPS:
            raise ConfigError(f"{word}: cannot be removed, every config needs its {bare} (allowed: "
                              f"{', '.join(options(bare))})")
        if bare in required:
            raise ConfigError(f"{word}: cannot be removed, {bare} has no default (set {bare}=VALUE instead)")


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the packaged config tree with Hydra overrides, then validate it."""
    return compose_checked(overrides)[0]


def validate_checked(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """validate(cfg), with a value OmegaConf cannot produce (removed, an interpolation that does not resolve)
    said in one line too."""
    try:
        validate(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(explain_config_error(exc, overrides)) from None


def _check_optional_choices(whole: DictConfig, overrides: Sequence[str]) -> None:
    """An option of an optional group named on the command line must exist: Hydra drops a missing one silently."""
    choices = whole.hydra.runtime.choices
    for group in OPTIONAL_GROUPS:
        given = [w for w in overrides if override_key(w) == group and "=" in w and not w.startswith("~")]
        choice = choices.get(group)
        if given and choice not in (None, "null") and choice not in options_below(group):
            _, _, value = given[-1].partition("=")
            known = options_below(group)
            raise ConfigError(f"{group}={value}: no such option (allowed: {', '.join(known) or 'none'}, or "
                              f"~{group} for none)")


def options_below(group: str) -> tuple[str, ...]:
    """The options of a group whose options live in sub-folders (recipe: train/tiny/decoder_only/copy ...)."""
    from importlib.resources import files

    root = files("zoo.conf") / group
    found: list[str] = []

    def walk(node, prefix: str) -> None:
        for entry in node.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".yaml"):
                found.append(prefix + entry.name.removesuffix(".yaml"))
    if root.is_dir():
        walk(root, "")
    return tuple(sorted(found))


def explain_composition_error(exc: HydraException, overrides: Sequence[str] = ()) -> str:
    """Hydra's several-line composition errors, said in one line: key, value, what is allowed."""
    if isinstance(exc, MissingConfigException) and exc.options:
        group, _, choice = (exc.missing_cfg_file or "").rpartition("/")
        return f"{group}={choice}: no such option (allowed: {', '.join(sorted(exc.options))})"
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        return f"{exc.missing_cfg_file}: no such config (a config name or group option that does not exist)"
    cause = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    override = next((line.split("'")[1] for line in lines if line.startswith("Could not override '")), None)
    if override is not None:
        return f"{override}: unknown key (add a new key with +{override}=VALUE only if the part accepts it)"
    if lines and lines[0].startswith("Error merging override ") and cause is not None:
        reason = _first_line(cause)
        if "could not be converted to" in reason:
            reason = "expected " + reason.rsplit("converted to ", 1)[1].lower()
        return f"{lines[0].removeprefix('Error merging override ')}: {reason}"
    unparsed = _unparsed(lines)
    if unparsed is not None:
        word, reason = unparsed
        return (f"{word}: not an override Hydra can parse{f' ({reason})' if reason else ''}; quote a value with "
                f"spaces or brackets: key='a b'")
    if lines and lines[0].startswith("Ambiguous value for argument '"):
        word = lines[0].split("'")[1]
        return f"{word}: a comma list is a sweep (add -m), a list is KEY=[A,B], a string is KEY='A,B'"
    if lines and lines[0].startswith("Could not delete from config."):
        key = lines[0].split("'")[1] if lines[0].count("'") >= 2 else ""
        word = next((w for w in overrides if w.startswith("~") and w.partition("=")[0].lstrip("~") == key), key)
        return f"{word}: nothing to remove, {key} is null or absent"
    text = " ".join(lines) if len(" ".join(lines)) < 300 else (lines[0] if lines else type(exc).__name__)
    return text


def _unparsed(lines: list[str]) -> tuple[str, str] | None:
    """(the override, why) from Hydra's parse errors: "Error parsing override 'W'" with the parser's reason on the
    next line, or the lexer's "LexerNoViableAltException: W"."""
    if lines and lines[0].startswith("Error parsing override '"):
        word = lines[0].removeprefix("Error parsing override '").removesuffix("'")
        reason = lines[1].split(" expecting ")[0] if len(lines) > 1 and not lines[1].startswith("See ") else ""
        return word, reason
    if lines and lines[0].startswith("LexerNoViableAltException: "):
        return lines[0].removeprefix("LexerNoViableAltException: "), ""
    return None


def explain_config_error(exc: Exception, overrides: Sequence[str] = ()) -> str:
    """An OmegaConf error (or one Hydra let through) while composing or validating, in one line naming the key."""
    key = str(getattr(exc, "full_key", "") or "")
    removed = [w for w in overrides if w.startswith("~") and w.partition("=")[0].lstrip("~") == key]
    if key and (removed or isinstance(exc, MissingMandatoryValue)):
        top = key.split(".")[0]
        word = removed[-1] if removed else key
        if top in ("model", "attention", "ffn", "norm", "pos", "task", "data") and top == key:
            return f"{word}: cannot be removed, every config needs its {top} (allowed: {', '.join(options(top))})"
        return f"{word}: cannot be removed, {key} has no default (set {key}=VALUE instead)"
    if isinstance(exc, InterpolationResolutionError):
        return f"{key or 'config'}: the interpolation does not resolve: {_first_line(exc)}"
    if key:
        return f"{key}: {_first_line(exc)}"
    return f"{_first_line(exc) or type(exc).__name__} (an override is key=value or group=option)"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
