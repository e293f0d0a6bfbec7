"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync dir.

A reader never sees a half-written file; after a crash either the old or the new
content is there, never a mix.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, IO, Iterable


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in `directory` durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_dead_temp_files(root: str | os.PathLike, directories: Iterable[str]) -> int:
    """Delete the temp files (`.NAME.XXXXXXXX.tmp`, as write_via_path names them) of writes that
    never finished (a writer killed mid-write) in `root/<d>` for each glob `d`; returns how many.
    They were never renamed into place, so no data goes with them. Call it only while no live
    writer can be using those directories."""
    removed = 0
    for directory in directories:
        for path in Path(root).glob(f"{directory}/.*.tmp"):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _discard(tmp: str | os.PathLike) -> None:
    """Remove a temp file whose write failed (it may already be gone)."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def write_via_path(path: str | os.PathLike, writer: Callable[[str], None], mode: int = 0o644) -> None:
    """Atomic write for libraries that want a file *name* (safetensors' save_file writes
    straight from tensor memory, with no bytes object built in Python first: bench/RESULTS.md,
    Capture overhead)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(path.parent)


def publish_via_path(path: str | os.PathLike, writer: Callable[[str], None]) -> None:
    """Atomic *visibility* without durability, for scratch files nobody reads after a crash (the
    capture spool: an extraction session frees earlier sessions' requests and captures them again).

    A reader sees the whole file or none of it (temp name in the same directory, then rename), but
    nothing is fsynced and the temp name is fixed per thread instead of drawn by mkstemp: each of
    those system calls gives the GIL away and takes it back, and on a GPU server the thread that
    launches the model's kernels pays for every such hand-off (bench/RESULTS.md, session 6).
    The caller creates the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_native_id()}.tmp")
    try:
        writer(str(tmp))
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def write_with(path: str | os.PathLike, writer: Callable[[IO[bytes]], object], mode: int = 0o644) -> None:
    """Write `path` atomically; `writer` receives a binary file object (what it returns is ignored)."""

    def through_handle(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            writer(handle)

    write_via_path(path, through_handle, mode)


def write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    write_with(path, lambda handle: handle.write(data), mode)


def write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> None:
    write_bytes(path, text.encode("utf-8"), mode)


def write_json(path: str | os.PathLike, obj: Any, mode: int = 0o644) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line and fsync: used for manifests and event logs (append-only)."""
    append_lines(path, [line])


def append_lines(path: str | os.PathLike, lines: list[str]) -> None:
    """Append lines in one write and one fsync (a group commit); a failed append leaves the file as it
    was: none of these lines, no fragment."""
    if any("\n" in line for line in lines):
        raise ValueError("append_lines takes lines without newlines")
    if not lines:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = memoryview("".join(line + "\n" for line in lines).encode("utf-8"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except BaseException:
            # A full disk can take part of the lines: cut them off, or the next append would
            # glue onto the fragment and turn a good line into a malformed one.
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)
