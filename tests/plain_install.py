"""Running a README command as it runs after README's plain set-up (`pip install torch==2.13.0 -e .`, no extras).

The project's own tests run in an environment with the `[test]` extra, which brings packages the plain install
does not (transformers, matplotlib, ...) and with them their dependencies (numpy, among others). A command that
needs one of those passes here and fails for a new user. :func:`plain_env` gives a subprocess environment in
which exactly the plain install can be imported: the distributions that `transformer-zoo`'s own requirements
bring, followed recursively (extras left out, markers evaluated for this interpreter), plus pip, which every
virtual environment has. Every other installed distribution's top-level modules raise ModuleNotFoundError, as
they would in a fresh virtual environment (find_spec answers None for them), and their metadata is hidden (so pytest loads none of the plug-ins
they declare), through a `sitecustomize` module put first on PYTHONPATH (Python imports it at start-up, in every
child process too).
"""
from __future__ import annotations

import functools
import importlib.metadata as metadata
import os
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

__all__ = ["plain_distributions", "blocked_modules", "plain_env"]

PROJECT = "transformer-zoo"
ALWAYS = {"pip"}   # what `python -m venv` puts in every environment


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=None)
def plain_distributions() -> frozenset[str]:
    """The normalised names of the distributions that `pip install -e .` brings: the closure of the project's
    requirements without extras."""
    found, todo = set(ALWAYS), [PROJECT]
    while todo:
        name = todo.pop()
        if _normalise(name) in found and name != PROJECT:
            continue
        found.add(_normalise(name))
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                metadata.distribution(requirement.name)
            except metadata.PackageNotFoundError:   # an optional one this machine lacks: nothing to block either
                continue
            todo.append(requirement.name)
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def blocked_modules() -> tuple[str, ...]:
    """Top-level import names that only distributions outside the plain install provide."""
    plain = plain_distributions()
    blocked = {module for module, owners in metadata.packages_distributions().items()
               if module.isidentifier() and not any(_normalise(owner) in plain for owner in owners)}
    return tuple(sorted(blocked - set(sys.stdlib_module_names)))


_SITECUSTOMIZE = '''\
import importlib.metadata
import re
import sys

_PLAIN = frozenset({plain!r})
_BLOCKED = frozenset({blocked!r})


def _discover(cls, _discover=importlib.metadata.Distribution.discover.__func__, **kwargs):
    """Their metadata too: pytest loads the plug-ins that installed distributions declare (entry points)."""
    return (d for d in _discover(cls, **kwargs)
            if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() in _PLAIN)


# Top-level modules of distributions that README's plain set-up does not install (tests/plain_install.py): None
# in sys.modules is Python's own "not importable" (import raises ModuleNotFoundError, importlib.util.find_spec
# answers None, as for a module that is absent).
sys.modules.update(dict.fromkeys(_BLOCKED))
importlib.metadata.Distribution.discover = classmethod(_discover)
'''


def plain_env(directory: Path, base: dict | None = None) -> dict:
    """A copy of ``base`` (default ``os.environ``) in which Python processes see only the plain install; the
    `sitecustomize` that does it is written into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(plain=sorted(plain_distributions()),
                                                                      blocked=sorted(blocked_modules())))
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"   # the tiny models of these runs only slow down with more threads
    return env
