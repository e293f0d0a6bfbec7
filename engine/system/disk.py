"""Disk guardrails: free space per output path, a reserve never to be used, size parsing.

Hidden-state extraction writes ~56 KiB per token for a 7168-wide target, so a run can need
more than a terabyte. The engine budgets the bytes before starting and pauses when free space
falls to the reserve, instead of discovering a full disk halfway through.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Union, Any, Callable, Mapping

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


@dataclass(frozen=True)
class DiskUsage:
    label: str  # what the path is for, e.g. "hidden"; merged labels read "hidden, drafters"
    path: str  # the path asked about (it may not exist yet)
    mount: str  # mount point of the filesystem that holds it
    total: int  # bytes
    used: int  # bytes
    free: int  # bytes available to this (unprivileged) user
    reserve: int  # bytes to leave free

    @property
    def available_after_reserve(self) -> int:
        """Bytes a job may still write before touching the reserve (never negative)."""
        return max(0, self.free - self.reserve)

    @property
    def below_reserve(self) -> bool:
        return self.free < self.reserve


def is_no_space(exc: BaseException) -> bool:
    """Whether a write failed for want of room (a full disk or quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _nearest_existing(path: Path) -> Path:
    """`path` itself, or its closest ancestor that exists (an output dir may not exist yet)."""
    current = Path(os.path.abspath(path))
    while not current.exists():
        parent = current.parent
        if parent == current:
            break
        current = parent
    return current


def _mount_point(path: Path) -> Path:
    current = Path(os.path.realpath(path))
    while not os.path.ismount(current):
        parent = current.parent
        if parent == current:
            break
        current = parent
    return current


def usage_for(label: str, path: str | os.PathLike[str], reserve_bytes: int = 0) -> DiskUsage:
    """Space on the filesystem that holds (or will hold) `path`."""
    if reserve_bytes < 0:
        raise ValueError(f"disk reserve must be >= 0 bytes, got {reserve_bytes}")
    requested = Path(path).expanduser()
    existing = _nearest_existing(requested)
    usage = shutil.disk_usage(existing)  # free = blocks available to non-root users
    return DiskUsage(
        label=label,
        path=str(requested),
        mount=str(_mount_point(existing)),
        total=usage.total,
        used=usage.used,
        free=usage.free,
        reserve=reserve_bytes,
    )


Reserve = Union[int, Mapping[str, int]]


def _reserve_of(reserve_bytes: Reserve, label: str) -> int:
    if isinstance(reserve_bytes, Mapping):
        return int(reserve_bytes.get(label, 0))
    return int(reserve_bytes)


def usage_for_paths(paths: Mapping[str, str | os.PathLike[str]], reserve_bytes: Reserve) -> list[DiskUsage]:
    """One DiskUsage per filesystem, in first-seen order; paths sharing one are merged.

    `reserve_bytes` is one figure for all paths or one per label (the spool keeps a smaller
    reserve than the output disk). The reserve belongs to the filesystem, so two outputs on
    one disk share it (the larger one) rather than each counting the same free bytes.
    """
    merged: dict[tuple[int, str], DiskUsage] = {}
    for label, path in paths.items():
        usage = usage_for(label, path, _reserve_of(reserve_bytes, label))
        key = (os.stat(_nearest_existing(Path(path).expanduser())).st_dev, usage.mount)
        if key in merged:
            first = merged[key]
            merged[key] = DiskUsage(
                label=f"{first.label}, {label}",
                path=first.path,
                mount=first.mount,
                total=usage.total,
                used=usage.used,
                free=usage.free,
                reserve=max(first.reserve, usage.reserve),
            )
        else:
            merged[key] = usage
    return list(merged.values())


def bytes_per_token(hidden_size: int, aux_format: str = "bf16") -> int:
    """Record bytes per token: aux [3H] and final [H] states, int64 input_ids and loss_mask. bf16 aux:
    8H + 16; fp8 aux (e4m3 and float32 scales [3], engine.aux_fp8): 5H + 28."""
    if hidden_size <= 0:
        raise ValueError("hidden_size must be positive")
    if aux_format == "fp8":
        return 3 * hidden_size + 12 + 2 * hidden_size + 16
    if aux_format != "bf16":
        raise ValueError(f"aux format {aux_format!r} is not bf16 or fp8")
    return 2 * (3 * hidden_size + hidden_size) + 16


RECORD_OVERHEAD_BYTES = 1024  # a record's safetensors header (360-470 B) and its manifest line, rounded up


def tree_bytes(root: Path) -> int:
    """Bytes of every entry under `root` now (what a disk holds there), symlinks counted as links (never
    followed). Jobs delete files and whole directories as they go: whatever vanishes while we look is
    skipped (os.walk passes over a directory it can no longer list)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for entry in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            try:
                total += os.lstat(os.path.join(dirpath, entry)).st_size
            except OSError:
                pass  # vanished while walking
    return total


def records_bytes(tokens: int, samples: int, hidden_size: int, aux_format: str = "bf16") -> int:
    """Disk bytes of `samples` records holding `tokens` tokens in all: the states and ids of every
    token, and each record's header and manifest line."""
    return tokens * bytes_per_token(hidden_size, aux_format) + samples * RECORD_OVERHEAD_BYTES


def fmt_bytes(n: int | float) -> str:
    """Binary units: 512 -> "512 B", 57360 -> "56.0 KiB", 1.2 * 2**40 -> "1.2 TiB"."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if round(value, 1) >= 1024 and unit < len(_UNITS) - 1:  # 1023.96 KiB prints as 1.0 MiB
        value /= 1024
        unit += 1
    return f"{sign}{value:.1f} {_UNITS[unit]}"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([kmgtpe]?)(i?b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}


def parse_size(text: str | int) -> int:
    """Bytes from a size such as "50G", "50GiB", "1.5T", "800M", "50GB" or "1048576".

    Units are binary whatever the spelling ("50G" = "50GB" = "50GiB" = 50 * 2**30), matching
    the binary units the console displays and `df -h` prints; a plain number is bytes.
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid size {text}: a size can't be negative")
        return text
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: use a number with an optional unit, "
            "e.g. 50G, 50GiB, 50GB, 1.5T, 800M, or plain bytes like 1048576"
        )
    number, prefix, suffix = match.groups()
    prefix, suffix = prefix.lower(), suffix.lower()
    if not prefix:
        if suffix not in ("", "b"):  # "5i" / "5ib" mean nothing
            raise ValueError(f"invalid size {text!r}: a unit like KiB/MiB/GiB needs its K/M/G")
        if "." in number:
            raise ValueError(f"invalid size {text!r}: whole bytes only, or add a unit such as 1.5G")
        return int(number)
    return int(round(float(number) * 1024 ** _POWERS[prefix]))


class DiskSampler:
    """Free space for a set of labelled paths, on demand or every `interval` seconds."""

    def __init__(self, paths: Mapping[str, str | os.PathLike[str]], reserve_bytes: Reserve, interval: float = 5.0) -> None:
        if interval <= 0:
            raise ValueError("disk sampling interval must be positive seconds")
        if min([reserve_bytes] if isinstance(reserve_bytes, int) else list(reserve_bytes.values()) or [0]) < 0:
            raise ValueError(f"disk reserve must be >= 0 bytes, got {reserve_bytes}")
        self.paths = dict(paths)
        self.reserve_bytes = reserve_bytes
        self.interval = interval
        self.last_error: str | None = None  # why the last sample missed paths, for the pane

    def sample(self) -> list[DiskUsage]:
        """Current usage per filesystem; a path whose filesystem can't be read is left out."""
        try:
            result = usage_for_paths(self.paths, self.reserve_bytes)
            self.last_error = None
            return result
        except OSError:
            pass
        # Slow path: find the failing path(s) and keep the others.
        readable: dict[str, str | os.PathLike[str]] = {}
        errors = []
        for label, path in self.paths.items():
            try:
                usage_for(label, path)
                readable[label] = path
            except OSError as error:
                errors.append(f"{label} ({path}): {error.strerror or error}")
        self.last_error = "; ".join(errors) or None
        try:
            return usage_for_paths(readable, self.reserve_bytes)
        except OSError as error:
            self.last_error = str(error)
            return []

    async def watch(self, callback: Callable[[list[DiskUsage]], Any]) -> None:
        """Sample every `interval` forever, off the event loop; cancel the task to stop."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            result = await asyncio.to_thread(self.sample)
            outcome = callback(result)
            if inspect.isawaitable(outcome):
                await outcome
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))
