"""Writing a file so that a reader sees the old version or the new one, never half of either."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["replacing", "write_text"]


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on success it is synced, given the permissions
    a new file would have (mkstemp makes it private) and renamed onto ``path``; on any error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
