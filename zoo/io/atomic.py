"""Writing a file so that a reader sees the old version or the new one, never half of either."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["replacing", "write_text", "unwritable", "existing_ancestor"]


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


def existing_ancestor(path: Path) -> Path:
    """The path itself if it exists, else its deepest ancestor that does."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return candidate
        except OSError:  # a name too long, a loop of links: look further up
            continue
    return Path(path.anchor or "/")


def unwritable(path: str) -> str | None:
    """Why a directory cannot be created or written into, or None; creates nothing. Its deepest existing
    ancestor must be a directory in which a file can be made (made and removed: only trying says so for sure on
    a read-only file system or /proc), and every name below it must be one the file system can hold."""
    import tempfile

    if "\x00" in path:
        return "a path cannot hold a NUL character"
    target = Path(path).absolute()
    try:
        os.fsencode(str(target))
    except UnicodeError:
        return "not a name this file system can hold (undecodable characters)"
    if len(os.fsencode(str(target))) >= 4096:
        return f"a path of {len(os.fsencode(str(target))):,} bytes, more than a file system holds (4,095)"
    long = next((part for part in target.parts if len(os.fsencode(part)) > 255), None)
    if long is not None:
        return f"the name {long[:40]}... has {len(os.fsencode(long)):,} bytes, more than a file system holds (255)"
    base = existing_ancestor(target)
    if not base.is_dir():
        return f"Not a directory: {base} exists and is a file"
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        return f"no file can be created in {base} ({exc.strerror or type(exc).__name__})"
    return None


