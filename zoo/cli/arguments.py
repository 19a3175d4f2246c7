"""Arguments of the project's argparse commands (``python -m bench``, ``bench.gpu_check``, the catalog's commands,
``properties.adapters.conformance``), checked before any work as ``python -m zoo`` checks its own: a bad value is
one line on stderr and exit status 2, never a traceback, and never a value silently replaced or ignored.

``Parser`` is argparse's parser with that one-line error; the ``type=`` functions below refuse what the option cannot
mean (a count below its minimum, NaN or infinite seconds); ``device_problem`` and ``output_problem`` say why a device
or an output path cannot be used, and ``check_outputs`` refuses the paths before minutes of work.
"""
from __future__ import annotations

import argparse
import math
import sys
import threading

__all__ = ["Parser", "count", "seconds", "device_problem", "output_problem", "check_outputs"]


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (``prog: error: message``) and exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())} ({self.prog} --help lists the options)\n")
        sys.exit(2)


def count(minimum: int = 1, maximum: int | None = None):
    """type= for an integer option in [minimum, maximum]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return value
    parse.__name__ = "count"
    return parse


def seconds(minimum: float = 0.0, *, inclusive: bool = False):
    """type= for a finite number of seconds above ``minimum`` (at least it, when ``inclusive``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            raise argparse.ArgumentTypeError(f"expected a finite number of seconds {bound}, got {text!r}")
        if value > threading.TIMEOUT_MAX:   # what Python's waits (subprocess, threads, locks) can honour
            raise argparse.ArgumentTypeError(f"expected at most {threading.TIMEOUT_MAX:.3g} seconds, the longest wait "
                                             f"Python can make, got {text!r}")
        return value
    parse.__name__ = "seconds"
    return parse


def device_problem(name: str) -> str | None:
    """Why torch cannot use device ``name`` here (None when it can): a name torch does not know, a CUDA device
    absent or past the count, a backend this build or machine lacks."""
    import torch
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        return f"not a device torch knows ({' '.join(str(exc).split())[:160]})"
    try:
        torch.empty(1, device=device)
    except Exception:  # noqa: BLE001 -- any backend may refuse in its own way
        return "not available on this machine"
    return None


def output_problem(path: str) -> str | None:
    """Why an output file cannot be written at ``path`` (zoo.io.atomic.unwritable_file), or None."""
    from zoo.io.atomic import unwritable_file
    return unwritable_file(str(path))


def check_outputs(parser: argparse.ArgumentParser, **paths) -> None:
    """``parser.error`` for the first output path (option name = path; None or '' skipped) that cannot be written."""
    for option, path in paths.items():
        if path:
            problem = output_problem(str(path))
            if problem:
                parser.error(f"--{option.replace('_', '-')} {path}: cannot be written ({problem}); nothing was run")
