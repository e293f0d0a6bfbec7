"""Capture segments written by a child process, fed a batch at a time through shared memory.

Why a process: in the server process every segment write hands the GIL away and takes it back
around each system call (mkdir, open, write, rename), and each hand-off is taken from the thread
that launches the model's kernels and from the HTTP loop. On a small, fast target that tax sets
the capture's pace: a writer *thread* takes a Python-bound thread beside it far more of its
throughput than a writer *process* does (`bench/spool_gil.py`; bench/RESULTS.md, Capture overhead).

Here the server pays per *slot*, not per segment: copies into a shared-memory slot (large torch
copies, outside the GIL), one small message down a pipe, one reply. A batch of any size goes this
way: its rows are packed into as many slots as they need, a row longer than a slot cut into
consecutive segments (a batch too large for one slot used to fall back to the server's own writer
threads, the path this process exists to avoid). The child writes the segments with `write_segment`
(the same files, byte for byte, as the in-process writers) on its own threads and answers with one
error per segment; the caller may also hear when a batch is in the child's hands (`on_handed`), which
the local server answers its requests on. A slot is reused once its reply is back, so at most `slots`
slots are in the child's hands; `submit_packed` blocks for a free one (backpressure, as the writer queue
does in-process).

If the child dies, every batch it held is answered with an error naming the exit code (the
extraction job retries those requests) and `submit_packed` raises `SpoolProcessError`: the caller
falls back to in-process writers.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import signal
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


class _Gather:
    """One `submit_packed`'s answer, put together from its slots' replies: one error (or None) per piece,
    a piece cut over several slots keeping its first error; `on_done` once the last slot is back, and
    `on_handed` once the last slot is in the child's hands (never if one fails before that)."""

    def __init__(self, pieces: int, slots: int, on_done: Callable[[list[str | None]], None],
                 on_handed: Callable[[], None] | None = None) -> None:
        self.errors: list[str | None] = [None] * pieces
        self.slots = slots
        self.unsent = slots
        self.on_done = on_done
        self.on_handed = on_handed
        self.lock = threading.Lock()

    def slot_sent(self) -> None:
        with self.lock:
            self.unsent -= 1
            last = self.unsent == 0
        if last and self.on_handed is not None:
            self.on_handed()

    def slot_done(self, indices: list[int], errors: list[str | None]) -> None:
        with self.lock:
            for index, error in zip(indices, errors):
                if self.errors[index] is None:
                    self.errors[index] = error
            self.slots -= 1
            last = self.slots == 0
        if last:
            self.on_done(self.errors)


@dataclass
class _Filled:
    """A slot whose copies are queued: what the child needs to write it, and whom to answer."""

    slot: int
    base: int
    rows: list[tuple[str, int, int, int]]
    blocks: list[_Block]
    pieces: list[int]  # index of each row's segment in its batch
    gather: _Gather
    landed: Any  # torch.cuda.Event after the copies, or None (host copies are done)
    keep: list  # the source tensors, alive until the copies have landed

    def answer(self, errors: list[str | None]) -> None:
        self.gather.slot_done(self.pieces, errors)


@dataclass(frozen=True)
class _Block:
    """Where one tensor of a batch lies in its slot: byte offset, shape, dtype name."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


_BLOCK_SLACK = 3 * 16  # a slot's three blocks (ids, aux, final), each padded to 16 bytes


def slot_bytes_for(tokens: int, per_token: int) -> int:
    """The slot size that holds `tokens` tokens of `per_token` bytes (ids and every state), packed."""
    return tokens * per_token + _BLOCK_SLACK


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


def _cut(counts: Sequence[int], room: int) -> list[list[tuple[int, int, int]]]:
    """Pieces of `counts` tokens packed one after another into slots of `room` tokens: per slot,
    (piece index, first token, tokens); a piece longer than a slot's room spans several."""
    slots: list[list[tuple[int, int, int]]] = [[]]
    free = room
    for index, n in enumerate(counts):
        done = 0
        while done < n:
            if free == 0:
                slots.append([])
                free = room
            take = min(free, n - done)
            slots[-1].append((index, done, take))
            done, free = done + take, free - take
    return [parts for parts in slots if parts]


def _slot_rows(parts: list[tuple[int, int, int]], heads: Sequence[tuple]) -> list[tuple[str, int, int, int]]:
    """A slot's rows for the child: (rid, start position, first row in the slot, tokens) of each part;
    heads[i] starts with piece i's rid and start position."""
    rows, at = [], 0
    for index, first, n in parts:
        rid, start = heads[index][0], heads[index][1]
        rows.append((rid, int(start) + first, at, n))
        at += n
    return rows


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
        # Filled slots wait here for their device-to-host copies to land; the sender thread then
        # hands them to the child in order.
        self._outbox: queue.Queue[_Filled | None] = queue.Queue()
        self._sender: threading.Thread | None = None
        self._registered: bool | None = None  # arena pinned for CUDA copies: None = not tried yet

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
            process = context.Process(
                target=_child_main, name="capture-spool-writer", daemon=True,
                args=(self._shm.name, child_end, str(self.spool_dir), self.layers, self.threads))
            try:
                process.start()
            except BaseException:
                parent_end.close()
                raise
            finally:
                child_end.close()
            self._process = process  # only a started process: close() joins it
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
        self._sender = threading.Thread(target=self._send_filled, name="capture-spool-sender", daemon=True)
        self._sender.start()

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

    @property
    def pinned(self) -> bool | None:
        """Whether the arena is registered with CUDA, so device states are copied into it asynchronously;
        None until the first batch from a device asked for it."""
        return self._registered

    def close(self, timeout: float = 30.0) -> None:
        """Let the child finish the batches it holds, stop it, free the shared memory."""
        if self._sender is not None:
            self._outbox.put(None)  # the slots filled before the close still go out
            self._sender.join(timeout)
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
        if self._registered and self._arena is not None:
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
            self._registered = False
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

    def tokens_per_slot(self, per_token: int) -> int:
        """How many tokens of `per_token` bytes (ids and every state) one slot holds, packed."""
        return max(0, (self.slot_bytes - _BLOCK_SLACK) // per_token)

    def submit_packed(self, segments: Sequence[tuple[str, int, int]], ids: torch.Tensor, aux: torch.Tensor,
                      final: torch.Tensor, on_done: Callable[[list[str | None]], None],
                      on_handed: Callable[[], None] | None = None) -> None:
        """Hand a packed batch to the child: segment i is (rid, start position, tokens) and its rows follow
        segment i-1's in ids [T], aux [T, k*H], final [T, H]. The rows are packed into as many slots as they
        need, one copy a tensor a slot and no per-segment view (in a server the Python between two batches
        runs on threads that share the scheduler's GIL); a segment longer than a slot's room becomes
        consecutive segments of its request (the spool's reader joins them, as it joins SGLang's chunked
        prefill). Host tensors are copied before this returns (the caller may reuse them). CUDA tensors are
        copied on the current stream, straight into the arena (registered with CUDA on first use): a slot
        goes to the child once its copies have landed, and the tensors are kept alive until then. Blocks
        while every slot is in the child's hands. `on_done(errors)` is called once, later, from another
        thread, with one None or error message per segment. `on_handed()`, if given, is called once every slot
        of the batch has landed and gone to the child (from another thread, before or after `on_done`): the
        states no longer depend on the caller's memory, and the child writes them even if this process dies;
        it is not called if a slot fails before that.

        SpoolProcessError only when nothing was handed over (the child is gone); if it dies between two
        slots, the segments not handed over are answered with that error instead."""
        counts = [int(n) for _, _, n in segments]
        if any(n < 0 for n in counts) or not ids.shape[0] == aux.shape[0] == final.shape[0] == sum(counts):
            raise ValueError(f"a packed batch of {ids.shape[0]}/{aux.shape[0]}/{final.shape[0]} rows (ids/aux/final) "
                             f"for segments of {sum(counts)} tokens: the rows and the segment table disagree")
        offsets = list(itertools.accumulate(counts, initial=0))  # each segment's first row in the batch
        slots = []
        for parts in _cut(counts, self._room(ids, aux, final)):
            index, first, _ = parts[0]
            rows = _slot_rows(parts, segments)
            first_row, tokens = offsets[index] + first, sum(n for *_, n in rows)
            slots.append((rows, [index for index, *_ in parts],
                          [[t[first_row:first_row + tokens]] for t in (ids, aux, final)]))
        self._hand_over(slots, len(counts), on_done, on_handed)

    def _room(self, ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> int:
        """Tokens one slot holds of states of these widths and dtypes; ValueError if not one."""
        per_token = ids.element_size() + aux.shape[-1] * aux.element_size() + final.shape[-1] * final.element_size()
        room = self.tokens_per_slot(per_token)
        if room < 1:
            raise ValueError(f"a shared-memory slot of {self.slot_bytes} bytes holds no token of {per_token} bytes")
        return room

    def _hand_over(self, slots: list[tuple[list[tuple[str, int, int, int]], list[int], list[list[torch.Tensor]]]],
                   count: int, on_done: Callable[[list[str | None]], None],
                   on_handed: Callable[[], None] | None) -> None:
        """Fill the slots one after another (rows, the index of each row's segment, its sources) and answer
        the batch's `count` segments once; see submit_packed for what a child dying between two slots does."""
        if not slots:  # pieces of no tokens: nothing to write
            if on_handed is not None:
                on_handed()
            on_done([None] * count)
            return
        gather = _Gather(count, len(slots), on_done, on_handed)
        for number, (rows, indices, sources) in enumerate(slots):
            try:
                self._fill(rows, indices, sources, gather)
            except SpoolProcessError as exc:
                if number == 0:
                    raise
                for _, later, _ in slots[number:]:
                    gather.slot_done(later, [f"capture write failed: {exc}"] * len(later))
                return

    def _fill(self, rows: list[tuple[str, int, int, int]], indices: list[int], sources: list[list[torch.Tensor]],
              gather: _Gather) -> None:
        """Copy one slot's rows (ids, aux and final: each a list of row blocks in order) into a free slot and
        queue it for the child."""
        if self._dead is not None or self._arena is None:
            raise SpoolProcessError(self._dead or "the capture writer process is not running")
        tokens = sum(n for *_, n in rows)
        blocks, offset = [], 0
        for kind, like in enumerate(source[0] for source in sources):
            shape = (tokens,) if kind == 0 else (tokens, like.shape[-1])
            blocks.append(_Block(offset, shape, str(like.dtype).removeprefix("torch.")))
            offset += _padded(math.prod(shape) * like.element_size())
        on_device = any(block.is_cuda for source in sources for block in source)
        if on_device:
            self._register()
        slot = self._free.get()
        if self._dead is not None:
            self._free.put(slot)
            raise SpoolProcessError(self._dead)
        base = slot * self.slot_bytes
        keep: list[torch.Tensor] = []
        for block, source in zip(blocks, sources):
            view, at = _view(self._arena, base, block), 0
            for part in source:  # large copies, outside the GIL; from the device, asynchronous (pinned arena)
                view[at:at + part.shape[0]].copy_(part, non_blocking=part.is_cuda)
                at += part.shape[0]
                keep.append(part)
        landed = None
        if on_device:
            landed = torch.cuda.Event(blocking=True)  # the sender sleeps on it instead of spinning a core
            landed.record()
        self._outbox.put(_Filled(slot, base, rows, blocks, indices, gather, landed, keep))

    def _register(self) -> None:
        """Pin the arena for CUDA once, so device-to-host copies land in it directly and
        asynchronously; if CUDA refuses, the copies still land, synchronously."""
        if self._registered is None and self._arena is not None:
            code = torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(), self._arena.numel(), 0)
            self._registered = int(code) == 0

    def _send_filled(self) -> None:
        """Hands each filled slot to the child once its copies have landed, in the order filled."""
        while (filled := self._outbox.get()) is not None:
            error = None
            try:
                if filled.landed is not None:
                    filled.landed.synchronize()
            except Exception as exc:  # the copies failed on the device
                error = f"capture copy failed: {one_line(exc)}"
            filled.keep.clear()  # the device states may be freed now
            batch_id = next(self._ids)
            with self._lock:
                if error is None and self._dead is not None:
                    error = f"capture write failed: {self._dead}"
                if error is None:
                    self._pending[batch_id] = (filled.slot, filled.answer, len(filled.rows))
                    try:
                        self._conn.send((batch_id, filled.base, filled.rows, filled.blocks))
                    except OSError as exc:
                        del self._pending[batch_id]
                        error = f"capture write failed: the capture writer process is gone ({exc})"
            if error is not None:
                self._free.put(filled.slot)
                filled.answer([error] * len(filled.rows))
            else:
                filled.gather.slot_sent()

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


WRITER_PROCESS_NAME = "eagle3-capture"


def _child_main(shm_name: str, conn: Any, spool_dir: str, layers: list[int], threads: int) -> None:
    """The writer process: attach the arena, then write each batch's rows on `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.capture.segments import try_mark_failed, write_segment
    from engine.system.disk import is_no_space
    from engine.system.procinfo import name_process

    name_process(WRITER_PROCESS_NAME)  # the server's CPU by process (bench/capture_overhead.py) names it
    # A stop signal to the server's process group (a job stop, Ctrl-C) must not lose the batches the server has
    # already answered for: this process ends when the server says so or is gone, after writing what it holds.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shm = shared_memory.SharedMemory(name=shm_name)
    arena = torch.frombuffer(shm.buf, dtype=torch.uint8)
    send_lock = threading.Lock()
    conn.send("ready")

    def write_row(ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, rid: str, start: int) -> str | None:
        try:
            write_segment(spool_dir, rid, start, ids, aux, final, layers)
        except Exception as exc:  # reported per row: one bad request must not fail its batch
            error = f"capture write failed: {one_line(exc)}"
            # The server may have answered already: the mark tells the reader, and whether the spool was full.
            try_mark_failed(spool_dir, rid, start, error, no_space=is_no_space(exc))
            return error
        return None

    def write_batch(batch_id: int, base: int, segments: list[tuple[str, int, int, int]],
                    blocks: list[_Block]) -> None:
        ids, aux, final = (_view(arena, base, block) for block in blocks)

        def one(segment: tuple[str, int, int, int]) -> str | None:
            rid, start, at, n = segment  # its tokens are rows at..at+n of the slot
            return write_row(ids[at:at + n], aux[at:at + n], final[at:at + n], rid, start)

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
