"""Group commit of extraction records: the manifest lines of every record that finished while
the previous group was being committed go out together, under one fsync of their directories
and one of the manifest, instead of two fsyncs per record (each a journal commit the disk
waits for while the records' own data could be streaming)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from engine.records import RecordEntry, append_manifest_entries


class GroupCommit:
    """`await commit(entry)` returns once `entry`'s manifest line is durable; it raises what the
    append raised (OSError ENOSPC on a full disk: the manifest is then unchanged and the entry
    may be committed again). `run_in_thread(fn, *args)` runs the blocking append off the loop."""

    def __init__(self, run_dir: Path, run_in_thread: Callable[..., Awaitable[Any]]) -> None:
        self.run_dir = run_dir
        self._run = run_in_thread
        self._waiting: list[tuple[RecordEntry, asyncio.Future[None]]] = []
        self._lock = asyncio.Lock()
        self.groups = 0  # appends made (one fsync of the manifest each)

    async def commit(self, entry: RecordEntry) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((entry, future))
        async with self._lock:
            if not future.done():  # no earlier group took it: this caller commits everything waiting
                group, self._waiting = self._waiting, []
                try:
                    await self._run(append_manifest_entries, self.run_dir, [e for e, _ in group])
                except BaseException as exc:
                    for _, waiter in group:
                        if waiter.done():
                            continue
                        if isinstance(exc, Exception):
                            waiter.set_exception(exc)
                        else:
                            waiter.cancel()
                else:
                    self.groups += 1
                    for _, waiter in group:
                        if not waiter.done():
                            waiter.set_result(None)
        await future
