"""Reading a YAML config the user names (``--zoo-config FILE`` and the ``hydra.yaml`` beside it), with bounds.

A config the suite reads is a few kilobytes of nested keys. Anything else is refused in one line before it is
parsed into objects: a path that is not a regular file (a directory, a FIFO that would block, a device), more than
``MAX_BYTES``, text that is not UTF-8, nesting deeper than ``MAX_DEPTH`` (counted from the scanner's tokens, so
the recursive parser never sees it), or more than ``MAX_NODES`` values once aliases are expanded (a few lines of
``&a`` / ``*a`` can stand for billions of values, and OmegaConf copies every one), or an alias that contains
itself.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from zoo.config.errors import ConfigError

__all__ = ["read_config", "MAX_BYTES", "MAX_DEPTH", "MAX_NODES"]

MAX_BYTES = 1 << 20     # a saved zoo config is about 2 KiB
MAX_DEPTH = 32          # a zoo config nests 3 deep (hydra.yaml: 5)
MAX_NODES = 100_000     # a zoo config has about 100 values


def read_config(path: Path):
    """The DictConfig a YAML file holds; ConfigError (one line) for anything outside the bounds above."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO must not block the open
    except FileNotFoundError:
        raise ConfigError("no such file") from None
    except OSError as exc:
        raise ConfigError(f"cannot be read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError("not a regular file (a directory, FIFO or device)")
        if info.st_size > MAX_BYTES:
            raise ConfigError(f"{info.st_size:,} bytes; a config file has at most {MAX_BYTES:,}")
        data = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"more than {MAX_BYTES:,} bytes; a config file has at most that")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        _check_depth(yaml.scan(text, Loader=yaml.SafeLoader))
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:   # a YAML error spans lines: say its first
        raise ConfigError(f"not a YAML config: {str(exc).splitlines()[0]}") from None
    if root is not None:
        _check_size(root)
    try:
        cfg = OmegaConf.create(text)
    except Exception as exc:  # OmegaConf's errors (a key type it refuses, ...) span lines: say the first
        raise ConfigError(f"not a config: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") \
            from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"holds a {type(cfg).__name__}, not a mapping of keys")
    return cfg


def _check_depth(tokens) -> None:
    import yaml
    opening = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
               yaml.FlowSequenceStartToken)
    closing = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
    depth = 0
    for token in tokens:
        if isinstance(token, opening):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"nested more than {MAX_DEPTH} deep (line {token.start_mark.line + 1}); a config "
                                  f"nests a few levels")
        elif isinstance(token, closing):
            depth -= 1


def _check_size(root) -> None:
    """The number of values with aliases expanded, counted once per node (memoized), refusing a cycle."""
    import yaml
    counted: dict[int, int] = {}
    stack = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in counted:
            continue
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if not children_done:
            if key in open_nodes:
                raise ConfigError("an alias contains itself (a recursive anchor)")
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in counted)
            continue
        open_nodes.discard(key)
        counted[key] = 1 + sum(counted[id(child)] for child in children)
        if counted[key] > MAX_NODES:
            raise ConfigError(f"more than {MAX_NODES:,} values once its aliases are expanded; a config has a few "
                              f"hundred")
