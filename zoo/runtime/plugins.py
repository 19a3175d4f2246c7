"""Loading user plug-ins by import path: the one place that turns a string into an object."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from zoo.runtime.call_limit import CallLimitExceeded, bounded

__all__ = ["PluginError", "load_object", "locate"]


class PluginError(ValueError):
    """A plug-in path that cannot be loaded; the message is one line meant for the user."""


def _raised(exc: BaseException) -> str:
    """One line for what an import raised; a module that calls sys.exit() while imported says so."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r}) while imported"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def load_object(spec: str) -> object:
    """Load ``pkg.module:attr`` or ``path/to/file.py:attr`` (attr may be dotted)."""
    if ":" not in spec:
        raise PluginError(f"{spec!r}: expected 'pkg.module:name' or 'path/to/file.py:name'")
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py") or "/" in where or "\\" in where:
            path = Path(where)
            if not path.is_file():
                raise PluginError(f"{spec!r}: file {where!r} does not exist")
            name_in_sys = f"_plugin_{path.resolve().as_posix().replace('/', '_').replace('.', '_')}"
            module_spec = importlib.util.spec_from_file_location(name_in_sys, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name_in_sys] = module  # dataclasses and pickling look modules up here
            with bounded(f"plug-in {spec!r}", f"importing {where!r}"):
                module_spec.loader.exec_module(module)
        else:
            with bounded(f"plug-in {spec!r}", f"importing {where!r}"):
                module = importlib.import_module(where)
    except PluginError:
        raise
    except (KeyboardInterrupt, CallLimitExceeded):   # Ctrl-C (or SIGTERM) while importing still stops the program
        raise
    except BaseException as exc:  # the user's module may fail in any way while importing, sys.exit() included
        raise PluginError(f"{spec!r}: cannot import {where!r}: {_raised(exc)}") from exc
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{spec!r}: {where!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    return obj


def locate(dotted: str) -> object:
    """Load 'pkg.module.Name' (Hydra's _target_ form): the longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with bounded(f"plug-in {dotted!r}", f"importing {'.'.join(parts[:cut])!r}"):
                obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise PluginError(f"{dotted!r}: importing it failed: {exc}") from exc
            continue
        except (KeyboardInterrupt, CallLimitExceeded):
            raise
        except BaseException as exc:  # the user's module may fail in any way while importing, sys.exit() included
            raise PluginError(f"{dotted!r}: importing it failed: {_raised(exc)}") from exc
        for name in parts[cut:]:
            if not hasattr(obj, name):
                raise PluginError(f"{dotted!r}: {'.'.join(parts[:cut])!r} has no attribute {name!r}")
            obj = getattr(obj, name)
        return obj
    raise PluginError(f"{dotted!r}: no module named {parts[0]!r}")
