"""ConfigError, the one-line refusal every check of a config raises (zoo/config/schema.py, task_schemas.py), and
``refuse_value``, which says it for one key and its value."""
from __future__ import annotations

import typing
from typing import Any

__all__ = ["ConfigError", "refuse_value"]


class ConfigError(ValueError):
    """A config value that cannot be used; str() is one line for the user."""


def refuse_value(key: str, value: Any, allowed: str) -> typing.NoReturn:
    """ConfigError ``key=value: allowed``: a value and what the key takes instead, in one line."""
    raise ConfigError(f"{key}={value}: {allowed}")
