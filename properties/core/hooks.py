"""Forward hooks on the code under test: what a hooked module returned, and hooks that stay only for a block."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

__all__ = ["first_output", "hooks_in_place"]


def first_output(output):
    """A module's output: the first element of a tuple or list (Hugging Face layers return (hidden, weights, ...))."""
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def hooks_in_place(handles: Iterable) -> Iterator[None]:
    """The block runs with the hooks ``handles`` (torch's RemovableHandle) registered; they are removed on the way
    out, whatever the block raised."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
