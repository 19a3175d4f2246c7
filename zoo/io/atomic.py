"""Writing a file so that a reader sees the old version or the new one, never half of either.

A symbolic link is written through: the new file is renamed onto the link's target, never onto the link. A path
that names no regular file by a name (a character device such as /dev/stdout or /dev/null, a FIFO, a link through
/proc to a pipe or a deleted file) is written directly: nothing is ever renamed over it."""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["replacing", "write_text", "unwritable", "existing_ancestor", "destination", "unwritable_file"]


def destination(path: str | os.PathLike) -> tuple[Path, bool]:
    """(where the new file goes, whether it is renamed there): the path itself, or a link's final target, renamed;
    the path as given, written directly, when it exists as something other than a regular file reachable by name."""
    path = Path(path)
    try:
        info = os.stat(path)   # follows links
    except FileNotFoundError:
        return (Path(os.path.realpath(path)) if path.is_symlink() else path), True   # a dangling link: its target
    except OSError:   # a loop of links, a name too long: the rename would fail the same way; let it say so
        return path, True
    if not stat.S_ISREG(info.st_mode):
        return path, False
    if not path.is_symlink():
        return path, True
    if _through_proc(path):   # /dev/stdout -> /proc/self/fd/1: the open file itself, whatever its name
        return path, False
    target = Path(os.path.realpath(path))
    try:
        same = os.path.samefile(path, target)
    except OSError:   # /proc/self/fd/N of a deleted file resolves to a name that does not exist
        same = False
    return (target, True) if same else (path, False)


def _through_proc(path: Path) -> bool:
    """Whether following the link ``path`` passes through /proc (a process's open file, not a name)."""
    return _proc_link(path) is not None


def _proc_link(path: Path) -> Path | None:
    """The first /proc path on the chain of links from ``path`` (None if there is none)."""
    for _ in range(40):
        if not path.is_symlink():
            return None
        path = Path(os.path.abspath(path.parent / os.readlink(path)))
        if path.parts[1:2] == ("proc",):
            return path
    return None


def _own_descriptor(path: Path) -> int | None:
    """N when ``path`` leads to /proc/self/fd/N (or this process's pid): /dev/stdout is descriptor 1."""
    link = _proc_link(path)
    if link is None or len(link.parts) != 5 or link.parts[3] != "fd" or not link.parts[4].isdigit():
        return None
    return int(link.parts[4]) if link.parts[2] in ("self", str(os.getpid())) else None


def _write_directly(path: Path, data_file: str) -> None:
    """The bytes of ``data_file`` into ``path`` as it is: this process's own descriptor (after Python's buffers, so
    that the order of its output holds), else the file opened for appending (a device, a FIFO)."""
    import sys
    fd = _own_descriptor(path)
    with open(data_file, "rb") as written:
        data = written.read()
    if fd is not None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return
    with open(path, "ab") as out:
        out.write(data)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (beside a link's target) to write; on success it is synced, given the
    permissions a new file would have (mkstemp makes it private) and renamed onto ``path`` (the link's target); on
    any error removed. A path that is not a regular file (``destination``) gets the bytes written into it instead."""
    path, rename = destination(path)
    if not rename:
        handle, name = tempfile.mkstemp(prefix=".zoo-direct.", suffix=".tmp")
        os.close(handle)
        try:
            yield Path(name)
            _write_directly(path, name)
        finally:
            Path(name).unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:200]}.", suffix=".tmp")
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


def unwritable_file(path: str) -> str | None:
    """Why ``write_text(path, ...)`` would fail, or None: checked before minutes of work, so that an output path that
    cannot be written is one line at the start (every command's --json, --out, --report-json). The file is written
    beside PATH (beside a link's target) and renamed onto it, or written into a character device such as
    /dev/stdout (``destination``), so a file is created and removed there now."""
    if not path.strip():
        return "the path is empty"
    if "\x00" in path:
        return "a path cannot hold a NUL character"
    try:
        target, rename = destination(Path(path).absolute())
        if target.is_dir():
            return "is a directory"
        if not rename:
            if not stat.S_ISCHR(os.stat(target).st_mode) and not Path(path).is_symlink():
                return "is not a regular file or a character device (a FIFO or socket)"
            return None if os.access(target, os.W_OK) else "is not writable"
        ancestor = next((p for p in target.parents if p.exists()), None)
        if ancestor is not None and not ancestor.is_dir():
            return f"{ancestor} is not a directory"
        if ancestor is not None and not os.access(ancestor, os.W_OK | os.X_OK):
            return f"{ancestor} is not writable"
        if target.exists() and not os.access(target, os.W_OK):
            return "is not writable"
        if ancestor == target.parent:
            with tempfile.NamedTemporaryFile(dir=ancestor, prefix=f".{target.name[:64]}.", suffix=".probe"):
                pass
        elif len(os.fsencode(target.name)) > 255:
            return f"the name has {len(os.fsencode(target.name))} bytes, more than a file system holds (255)"
    except OSError as exc:   # a name too long, a file system that refuses new files (/sys, /proc), ...
        return exc.strerror or str(exc)
    return None
