"""Capture segments written by a child process, fed a batch at a time through shared memory.

Why a process: in the server process every segment write hands the GIL away and takes it back
around each system call (mkdir, open, write, rename), and each hand-off is taken from the thread
that launches the model's kernels and from the HTTP loop. On a small, fast target that tax sets
the capture's pace: a writer *thread* takes a Python-bound thread beside it far more of its
throughput than a writer *process* does (`bench/spool_gil.py`; bench/RESULTS.md, Capture overhead).

Here the server pays per *batch*, not per segment: one copy into a shared-memory slot (a large
torch copy, outside the GIL), one small message down a pipe, one reply. The child writes the
rows with `write_segment` (the same files, byte for byte, as the in-process writers) on its own
threads and answers with one error slot per row. A slot is reused once its reply is back, so at
most `slots` batches are in the child's hands; `submit` blocks for a free one (backpressure, as
the writer queue does in-process).

If the child dies, every batch it held is answered with an error naming the exit code (the
extraction job retries those requests) and `submit` raises `SpoolProcessError`: the caller
falls back to in-process writers.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import torch

from engine.errors import EngineError, one_line

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory
DEFAULT_SLOTS = 3  # one being filled, one being written, one spare


class SpoolProcessError(EngineError, RuntimeError):
    """The writer process cannot take (more) batches; the message says why and what to do."""


@dataclass(frozen=True)
class _Block:
    """Where one tensor of a batch lies in its slot: byte offset, shape, dtype name."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


def shm_room_problem(nbytes: int, directory: str = SHM_DIR) -> str | None:
    """Why `nbytes` of shared memory cannot be had under `directory`, or None.

    Checked before creating the arena: shared memory is allocated lazily, so a too-small
    /dev/shm (64 MB in a default Docker container) would otherwise surface as a SIGBUS when a
    page is first touched, killing the server."""
    try:
        stats = os.statvfs(directory)
    except OSError as exc:
        return f"{directory} is not usable for shared memory ({exc.strerror})"
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        return (f"{directory} has {free / 2**20:,.0f} MiB free, the capture writer process needs "
                f"{nbytes / 2**20:,.0f} MiB (in Docker: --shm-size=2g)")
    return None


def _padded(nbytes: int, alignment: int = 16) -> int:
    """Sizes rounded up to `alignment` bytes, so every block starts aligned for any dtype."""
    return nbytes + (-nbytes % alignment)


def _view(arena: torch.Tensor, base: int, block: _Block) -> torch.Tensor:
    dtype = getattr(torch, block.dtype)
    count = 1
    for size in block.shape:
        count *= size
    nbytes = count * dtype.itemsize
    return arena[base + block.offset: base + block.offset + nbytes].view(dtype).view(block.shape)


class SpoolWriterProcess:
    """A child process writing capture segments for the server (see the module docstring)."""

    def __init__(self, spool_dir: str | os.PathLike, layers: Sequence[int], slot_bytes: int,
                 slots: int = DEFAULT_SLOTS, threads: int = 4,
                 on_failure: Callable[[str], None] | None = None) -> None:
        """`on_failure(reason)` is called once, from the reply thread, if the child dies."""
        if slot_bytes <= 0 or slots <= 0 or threads <= 0:
            raise ValueError("slot_bytes, slots and threads must be positive")
        self.spool_dir = Path(spool_dir)
        self.layers = [int(layer) for layer in layers]
        self.slot_bytes = _padded(int(slot_bytes), 64)  # every slot starts aligned
        self.slots = int(slots)
        self.threads = int(threads)
        self._on_failure = on_failure
        self._shm: shared_memory.SharedMemory | None = None
        self._arena: torch.Tensor | None = None
        self._process: Any = None
        self._conn: Any = None
        self._reader: threading.Thread | None = None
        self._free: queue.Queue[int] = queue.Queue()
        self._pending: dict[int, tuple[int, Callable[[list[str | None]], None], int]] = {}
        self._lock = threading.Lock()  # guards _pending, _dead and the pipe's sending end
        self._ids = itertools.count()
        self._dead: str | None = None
        self._unlinked = False

    @property
    def arena_name(self) -> str | None:
        """The shared arena's POSIX name (its file in /dev/shm until both processes have mapped it)."""
        return None if self._shm is None else self._shm.name

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Create the shared arena and the child; SpoolProcessError (nothing left behind) if either fails."""
        import multiprocessing

        size = self.slot_bytes * self.slots
        problem = shm_room_problem(size)
        if problem:
            raise SpoolProcessError(problem)
        try:
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self._arena = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
            context = multiprocessing.get_context("spawn")  # fork would copy a CUDA context and threads
            parent_end, child_end = context.Pipe()
            self._process = context.Process(
                target=_child_main, name="capture-spool-writer", daemon=True,
                args=(self._shm.name, child_end, str(self.spool_dir), self.layers, self.threads))
            self._process.start()
            child_end.close()
            self._conn = parent_end
            # The child says it is ready once it has attached the arena and imported what it needs.
            if not parent_end.poll(120) or parent_end.recv() != "ready":
                raise SpoolProcessError("the capture writer process did not start within 120 s")
            # Both processes have it mapped: drop the name now, so nothing is left in /dev/shm
            # however either process ends (a SIGTERM'd or SIGKILL'd server included).
            self._unlink()
        except (OSError, EOFError, SpoolProcessError) as exc:
            self.close(timeout=5)
            if isinstance(exc, SpoolProcessError):
                raise
            code = self._process.exitcode if self._process is not None else None
            detail = str(exc) or f"it exited with code {code} before it was ready (its traceback is above)"
            raise SpoolProcessError(f"cannot start the capture writer process: {detail}") from None
        for slot in range(self.slots):
            self._free.put(slot)
        self._reader = threading.Thread(target=self._read_replies, name="capture-spool-replies", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """Started, not closed, and not known dead. No system call: the model thread asks every
        batch, and the reply thread learns of a death at once (the pipe closes)."""
        return self._dead is None and self._arena is not None and self._process is not None

    @property
    def failure(self) -> str | None:
        """Why the child stopped taking batches (None while it runs or after a clean close)."""
        return self._dead

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def close(self, timeout: float = 30.0) -> None:
        """Let the child finish the batches it holds, stop it, free the shared memory."""
        if self._conn is not None and self._dead is None:
            try:
                with self._lock:
                    self._conn.send(None)
            except OSError:
                pass
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        if self._reader is not None:
            self._reader.join(timeout)
        if self._conn is not None:
            self._conn.close()
        self._arena = None  # the buffer cannot be closed while a tensor still exports it
        if self._shm is not None:
            self._unlink()  # if start failed before it did
            try:
                self._shm.close()
            except BufferError:  # a tensor still exports the buffer: the mapping goes with it
                pass
            self._shm = None

    def _unlink(self) -> None:
        if self._shm is not None and not self._unlinked:
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    # ---- batches --------------------------------------------------------------------------

    def fits(self, *tensors: torch.Tensor) -> bool:
        """Whether these tensors, laid out as `submit` lays them (16-byte aligned), fit one slot."""
        return sum(_padded(t.numel() * t.element_size()) for t in tensors) <= self.slot_bytes

    def submit(self, rids: Sequence[str], lengths: Sequence[int], input_ids: torch.Tensor,
               aux: torch.Tensor, final: torch.Tensor,
               on_done: Callable[[list[str | None]], None]) -> None:
        """Hand one batch to the child: row i is `rids[i]`'s segment of `lengths[i]` tokens,
        `input_ids` [R, W] int64, `aux` [R, W, k*H] and `final` [R, W, H] on the host. Returns
        once the tensors are copied (the caller may reuse them); `on_done(errors)` is called later,
        from another thread, with one None or error message per row. Blocks while every slot is in
        the child's hands. SpoolProcessError if the child is gone (nothing was handed over)."""
        rows = [(rid, 0, i, int(n)) for i, (rid, n) in enumerate(zip(rids, lengths))]
        self._hand_over(rows, False, (input_ids, aux, final), on_done)

    def submit_packed(self, segments: Sequence[tuple[str, int, int]], input_ids: torch.Tensor,
                      aux: torch.Tensor, final: torch.Tensor,
                      on_done: Callable[[list[str | None]], None]) -> None:
        """As `submit`, for rows packed one after another as SGLang lays out an extend batch:
        segment i is (rid, start position, tokens), its rows follow segment i-1's in `input_ids` [T],
        `aux` [T, k*H] and `final` [T, H]; a segment starting past 0 is a chunk of a longer prompt."""
        rows, offset = [], 0
        for rid, start, n in segments:
            rows.append((rid, int(start), offset, int(n)))
            offset += int(n)
        self._hand_over(rows, True, (input_ids, aux, final), on_done)

    def _hand_over(self, rows: list[tuple[str, int, int, int]], packed: bool, tensors: tuple[torch.Tensor, ...],
                   on_done: Callable[[list[str | None]], None]) -> None:
        if self._dead is not None or self._arena is None:
            raise SpoolProcessError(self._dead or "the capture writer process is not running")
        if not self.fits(*tensors):
            raise ValueError("batch larger than a shared-memory slot: check fits() first")
        slot = self._free.get()
        base = slot * self.slot_bytes
        blocks, offset = [], 0
        for tensor in tensors:
            block = _Block(offset, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            _view(self._arena, base, block).copy_(tensor)  # one large copy, outside the GIL
            blocks.append(block)
            offset += _padded(tensor.numel() * tensor.element_size())
        batch_id = next(self._ids)
        with self._lock:
            if self._dead is not None:
                self._free.put(slot)
                raise SpoolProcessError(self._dead)
            self._pending[batch_id] = (slot, on_done, len(rows))
            try:
                self._conn.send((batch_id, base, rows, packed, blocks))
            except OSError as exc:
                del self._pending[batch_id]
                self._free.put(slot)
                raise SpoolProcessError(f"the capture writer process is gone: {exc}") from None

    def _read_replies(self) -> None:
        clean = False
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                break
            if reply is None:  # the child's last word after a clean stop
                clean = True
                break
            batch_id, errors = reply
            with self._lock:
                slot, on_done, _ = self._pending.pop(batch_id)
            self._free.put(slot)
            on_done(errors)
        self._process.join(5)
        code = self._process.exitcode
        with self._lock:
            if self._dead is None and not clean:
                self._dead = (f"the capture writer process exited (code {code}) with {len(self._pending)} "
                              "batch(es) unwritten; those requests failed (the extraction job retries them)")
            orphans, self._pending = list(self._pending.values()), {}
        for slot, on_done, rows in orphans:
            self._free.put(slot)
            on_done([f"capture write failed: {self._dead}"] * rows)
        if self._dead is not None and self._on_failure is not None:
            self._on_failure(self._dead)


def _child_main(shm_name: str, conn: Any, spool_dir: str, layers: list[int], threads: int) -> None:
    """The writer process: attach the arena, then write each batch's rows on `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.capture.segments import write_segment

    shm = shared_memory.SharedMemory(name=shm_name)
    arena = torch.frombuffer(shm.buf, dtype=torch.uint8)
    send_lock = threading.Lock()
    conn.send("ready")

    def write_row(ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, rid: str, start: int) -> str | None:
        try:
            write_segment(spool_dir, rid, start, ids, aux, final, layers)
        except Exception as exc:  # reported per row: one bad request must not fail its batch
            return f"capture write failed: {one_line(exc)}"
        return None

    def write_batch(batch_id: int, base: int, segments: list[tuple[str, int, int, int]], packed: bool,
                    blocks: list[_Block]) -> None:
        ids, aux, final = (_view(arena, base, block) for block in blocks)

        def one(segment: tuple[str, int, int, int]) -> str | None:
            rid, start, at, n = segment  # packed: rows at..at+n; padded: row `at`, its first n
            pick = (slice(at, at + n),) if packed else (at, slice(0, n))
            return write_row(ids[pick], aux[pick], final[pick], rid, start)

        errors = list(rows.map(one, segments))
        with send_lock:
            conn.send((batch_id, errors))

    # Two batches in progress at once (one finishing its last rows while the next starts), a
    # batch's rows in parallel on `rows`.
    with ThreadPoolExecutor(threads, thread_name_prefix="row") as rows, \
            ThreadPoolExecutor(2, thread_name_prefix="batch") as batches:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server is gone: nothing left to answer
                break
            if message is None:
                break
            batches.submit(write_batch, *message)
    with send_lock:
        try:
            conn.send(None)
        except OSError:
            pass
    del arena  # release the buffer's export before closing the mapping
    try:
        shm.close()
    except BufferError:
        pass
