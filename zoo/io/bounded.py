"""Reading files a user hands the zoo (checkpoints' JSON, config YAML) within stated bounds: a file too large or
nested too deep is a one-line error (InputTooLarge, a ValueError) before it is parsed, never a parser that runs
out of memory or recursion."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

__all__ = ["InputTooLarge", "read_bounded", "loads_json", "read_json", "nesting_depth", "MAX_DEPTH"]

MAX_DEPTH = 64  # the zoo's own files nest 5 deep (state.json: config.model.<key>); 64 leaves room for anyone's

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a JSON string, escapes included
_BRACKET = re.compile(r"[\[\]{}]")


class InputTooLarge(ValueError):
    """A file or text beyond the bounds its reader states; str() is one line."""


def read_bounded(path: str | os.PathLike, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most max_bytes (checked before reading, and again while reading: it may
    grow). A FIFO, a device or a directory is refused before anything waits on it."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # FileNotFoundError and the like are the caller's to say
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputTooLarge(f"{path}: not a regular file (a directory, FIFO or device)")
        if info.st_size > max_bytes:
            raise InputTooLarge(f"{path}: {info.st_size:,} bytes, more than the {max_bytes:,} a {what} may have")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise InputTooLarge(f"{path}: more than the {max_bytes:,} bytes a {what} may have")
    return data


def nesting_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON (or flow-style YAML) text nest, without parsing it: brackets
    outside strings, counted in one pass over the brackets alone."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads_json(text: str, *, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads of a text nested at most max_depth deep (json's own parser recurses, and fails far deeper with a
    RecursionError instead of a ValueError)."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise InputTooLarge(f"{where}: nested {depth:,} deep, more than the {max_depth} its reader accepts")
    try:
        return json.loads(text)
    except RecursionError:  # unreachable after the count above; kept so that no RecursionError escapes
        raise InputTooLarge(f"{where}: nested too deep to read") from None


def read_json(path: str | os.PathLike, *, max_bytes: int, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """A JSON file within both bounds; ValueError (InputTooLarge, or json's) for one that is not."""
    data = read_bounded(path, max_bytes, what)
    return loads_json(data.decode("utf-8"), where=str(path), max_depth=max_depth)
