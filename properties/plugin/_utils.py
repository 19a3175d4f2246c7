"""What several modules of the plug-in share and no one of them is the home of."""
from __future__ import annotations

from typing import Callable, TypeVar

import pytest

__all__ = ["number_option"]

T = TypeVar("T")


def number_option(config, name: str, parse: Callable[[str], T], accepts: Callable[[T], bool], expected: str, *,
                  dest: str | None = None) -> T | None:
    """The command-line option ``name`` (stored under ``dest``, by default its own name) as a number: None when it is
    not given; a one-line UsageError ``NAME 'TEXT': expected EXPECTED`` when ``parse`` raises ValueError or
    ``accepts`` refuses the number."""
    text = config.getoption(dest or name, None)
    if text is None:
        return None
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not accepts(value):
        raise pytest.UsageError(f"{name} {text!r}: expected {expected}")
    return value
