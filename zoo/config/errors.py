"""ConfigError, the one-line refusal every check of a config raises (zoo/config/schema.py, task_schemas.py)."""
from __future__ import annotations

import typing
from typing import Any

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config value that cannot be used; str() is one line for the user."""


def _fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{key}={value}: {allowed}")
