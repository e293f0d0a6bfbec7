"""Where the captured states go after a prefill: device-to-host copies, then spool segments.

With the process writer (the default), the model thread copies each captured batch from the device
straight into the shared-memory slots of a child process that writes the segments
(engine/capture/spool_process.py); the copies run on a side stream and a full set of slots pushes back
on the model thread. Otherwise, or if the child dies, *writer* threads turn pinned host copies into
spool segments (bounded queue, so a slow disk pushes back on the model thread instead of filling memory).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import one_line
from engine.localserver.requests import Completion
from engine.localserver.settings import capture_slots, capture_writer_count, capture_writer_mode


@dataclass
class CaptureConfig:
    layers: list[int]  # 0-indexed decoder-layer outputs
    spool_dir: Path


def pinned_copy(device_tensor: Any) -> Any:
    """A non-blocking copy into a new pinned host buffer, on the current stream: the forward never
    waits for the host; a writer waits on the batch's `copies_landed` event instead."""
    import torch

    host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)
    host.copy_(device_tensor, non_blocking=True)
    return host


def copies_landed(stream: Any) -> Any:
    """An event recorded after the copies queued on `stream`. Blocking: a writer sleeps until they
    land instead of spinning a core (CUDA spin-waits by default), which the model thread needs."""
    import torch

    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


class _AnswerOnHandover:
    """Answers a batch's captured requests as soon as the writer process holds their states, not once
    the segments are written: the clients send their next requests while the child writes, so the
    model is not left waiting on the spool (SGLang's hook answers before its writes too; readers wait
    for the segments, `open_capture`). A write that fails after the answer leaves a failure mark in the
    spool instead (`mark_failed`), so a reader fails at once with the reason; a batch that never reached
    the child is answered with its errors."""

    def __init__(self, batch: list[Completion], segments: list[tuple[str, int, int]], spool_dir: Path) -> None:
        self.batch, self.segments, self.spool_dir = batch, segments, spool_dir
        self.lock = threading.Lock()
        self.answered = False

    def handed(self) -> None:
        with self.lock:
            if self.answered:
                return
            self.answered = True
        for completion in self.batch:
            completion.finish_capture()

    def written(self, errors: list[str | None]) -> None:
        with self.lock:
            late, self.answered = self.answered, True
        if not late:
            for completion, error in zip(self.batch, errors):
                completion.finish_capture(error=error)
            return
        from engine.capture.segments import try_mark_failed

        for (rid, start, _), error in zip(self.segments, errors):
            if error is not None:
                print(f"capture: request {rid}: {error}", file=sys.stderr)
                if problem := try_mark_failed(self.spool_dir, rid, start, error):
                    print(f"capture: {problem}", file=sys.stderr)


class CaptureSink:
    def __init__(self, queue_size: int = 16) -> None:
        self.config: CaptureConfig | None = None
        self.writers = capture_writer_count()
        self.mode = capture_writer_mode()
        self.note = ""  # why the process writer is not in use, when it was asked for
        self._write_queue: queue.Queue[tuple | None] = queue.Queue(maxsize=max(queue_size, 2 * self.writers))
        self._process: Any = None  # SpoolWriterProcess while it takes batches
        self._copy_stream: Any = None  # CUDA stream for device-to-host copies of captured states

    # ---- threads ----------------------------------------------------------------------

    def start(self, state_bytes: int, slot_tokens: int) -> list[tuple[Callable[[], None], str]]:
        """Start the writer process if it is wanted; returns the loops the caller runs as threads.
        Several writers: safetensors writes outside the GIL, so segments of one batch are written in
        parallel while the model runs the next one."""
        if self.config is not None and self.mode == "process":
            self._start_process(state_bytes, slot_tokens)
        return [(self._writer_loop, f"capture-writer-{i}") for i in range(self.writers)]

    def close(self) -> None:
        """Ask the loops to finish what is queued and return."""
        if self._process is not None:
            self._process.close()  # after the slots already filled are written
        for _ in range(self.writers):
            self._write_queue.put(None)

    def describe(self) -> str:
        """How captured segments are written, for /server_info."""
        if (live := self._live_process()) is not None:
            # Whether device states land in the shared arena asynchronously or, unpinned, hold up the model
            # thread while they copy; unknown until the first batch from a GPU.
            pinning = {None: "", True: "; arena pinned for CUDA copies",
                       False: "; arena NOT pinned: device copies wait on the model thread"}[live.pinned]
            return f"process (pid {live.pid}{pinning})"
        writer = self._process
        note = self.note or (writer.failure if writer is not None else "")
        return f"threads ({self.writers})" + (f"; {note}" if note else "")

    def _start_process(self, state_bytes: int, slot_tokens: int) -> None:
        """Start the writer process; if it cannot start, `note` says why and threads write. `state_bytes`:
        one token's hidden state; a slot holds `slot_tokens` tokens of every captured state."""
        from engine.capture.spool_process import SpoolProcessError, SpoolWriterProcess, slot_bytes_for

        assert self.config is not None
        per_token = (len(self.config.layers) + 1) * state_bytes + 8  # + the int64 id
        slot_bytes = slot_bytes_for(slot_tokens, per_token)
        writer = SpoolWriterProcess(self.config.spool_dir, self.config.layers, slot_bytes=slot_bytes,
                                    slots=capture_slots(slot_bytes), threads=self.writers,
                                    on_failure=lambda reason: print(f"capture: {reason}; threads write the "
                                                                    "segments from now on", file=sys.stderr))
        try:
            writer.start()
        except SpoolProcessError as exc:
            self.note = f"process writer unavailable, threads write the segments: {exc}"
            print(f"capture: {self.note}", file=sys.stderr)
            return
        self._process = writer

    def _live_process(self) -> Any:
        """The writer process if it takes batches now, else None (threads write)."""
        writer = self._process
        return writer if writer is not None and writer.alive else None

    def _writer_loop(self) -> None:
        while True:
            item = self._write_queue.get()
            if item is None:
                return
            completion, ids, aux, final, copied = item
            self._write_here(completion, ids, aux, final, copied)

    def _write_here(self, completion: Completion, ids: Any, aux: Any, final: Any, copied: Any = None) -> None:
        """Write one captured row's segment on this thread and answer its request."""
        from engine.capture.segments import write_segment

        assert self.config is not None
        try:
            # The asynchronous device-to-host copies have landed. Only the batch's first writer
            # usually waits: `query` keeps the GIL, a `synchronize` hands it away and back.
            if copied is not None and not copied.query():
                copied.synchronize()
            write_segment(self.config.spool_dir, completion.request.rid, 0, ids, aux, final, self.config.layers)
        except Exception as exc:
            completion.finish_capture(error=f"capture write failed: {one_line(exc)}")
        else:
            completion.finish_capture()

    # ---- from the model thread --------------------------------------------------------

    def _copy_stream_after(self, *device_tensors: Any) -> Any:
        """The stream for the captured states' device-to-host copies, ordered after the compute
        stream's work so far. The copies overlap the next batch's forward instead of queuing
        behind it; `record_stream` keeps the allocator from handing `device_tensors`' blocks to
        that forward before the copy stream has read them."""
        import torch

        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device_tensors[0].device)
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        for tensor in device_tensors:
            tensor.record_stream(self._copy_stream)
        return self._copy_stream

    def queue_batch(self, completions, rows, lengths, host_ids, states: dict[str, Any]) -> None:
        """The graph path's captures, and every batch's while the writer process runs. To the writer
        process: the batch's rows packed (padding dropped) and copied from the device straight into its
        shared-memory slots (the process cuts the batch into slots; no pinned buffer between). To the
        writer threads: one pinned buffer and one copy per batch for each of the aux and final states,
        written as per-row views.

        Why per batch: a small target replays its prefill in one launch, so the per-row work of
        `queue_rows` (each torch call a GIL hand-off the model thread waits to get back) becomes
        most of its host time. Graph buckets have fixed shapes, so the host allocator's cached
        blocks fit every batch again; eager batches (large targets) written by threads keep the
        per-row copies."""
        import torch

        assert self.config is not None
        width = max(lengths[row] for row in rows)
        pick: Any
        if rows == list(range(len(rows))):  # extraction: every real row is captured
            pick = slice(0, len(rows))
        else:
            pick = torch.tensor(rows, device=states["final"].device)
        # New tensors on the compute stream, never views (`contiguous` would return the graph's own
        # output when the batch fills its bucket): the next replay overwrites the graph's outputs while
        # the copy stream still reads these.
        aux_states = torch.cat([states[f"layer{layer}"][pick, :width] for layer in self.config.layers], dim=-1)
        final_states = states["final"][pick, :width].clone(memory_format=torch.contiguous_format)
        if self._to_process(completions, rows, lengths, host_ids, aux_states, final_states):
            return
        if final_states.is_cuda:
            with torch.cuda.stream(self._copy_stream_after(aux_states, final_states)):
                aux, final = pinned_copy(aux_states), pinned_copy(final_states)
                copied = copies_landed(self._copy_stream)
        else:  # CPU (tests): the new tensors are the host buffers
            aux, final, copied = aux_states, final_states, None
        del aux_states, final_states
        for i, row in enumerate(rows):
            n = lengths[row]
            completions[row].capture_queued = True
            self._write_queue.put((completions[row], host_ids[row, :n], aux[i, :n], final[i, :n], copied))

    def _to_process(self, completions, rows, lengths, host_ids, aux_states: Any, final_states: Any) -> bool:
        """Hand a batch's captured rows to the writer process; False: the writer threads take it.

        Packed whole (`submit_packed`: the rows of every request back to back, a segment table beside
        them): this thread launches the model, and a view or plan per request would cost it a few torch
        calls each."""
        import torch

        from engine.capture.spool_process import SpoolProcessError

        writer = self._live_process()
        if writer is None or self.config is None:
            return False
        batch = [completions[row] for row in rows]
        counts = [int(lengths[row]) for row in rows]
        width = aux_states.shape[1]
        ids = host_ids[rows, :width].reshape(-1)
        aux, final = aux_states.reshape(len(rows) * width, -1), final_states.reshape(len(rows) * width, -1)
        if sum(counts) != len(rows) * width:  # shorter rows: their padding stays behind
            keep = (torch.arange(width) < torch.tensor(counts)[:, None]).reshape(-1).nonzero().squeeze(1)  # host
            ids = ids.index_select(0, keep)
            if final.is_cuda:
                keep = keep.pin_memory().to(final.device, non_blocking=True)
            aux, final = aux.index_select(0, keep), final.index_select(0, keep)
        segments = [(completion.request.rid, 0, n) for completion, n in zip(batch, counts)]
        answer = _AnswerOnHandover(batch, segments, self.config.spool_dir)
        for completion in batch:
            completion.capture_queued = True
        try:
            if final.is_cuda:
                with torch.cuda.stream(self._copy_stream_after(aux, final)):
                    writer.submit_packed(segments, ids, aux, final, answer.written, answer.handed)
            else:
                writer.submit_packed(segments, ids, aux, final, answer.written, answer.handed)
        except SpoolProcessError:  # the child is gone (on_failure said so): the threads take the batch
            return False
        return True

    def queue_rows(self, completions, rows, lengths, host_ids, states: dict[str, Any]) -> None:
        """Queue an eager batch's captured rows; `states` maps hook keys to [B, W, ...] tensors."""
        import torch

        assert self.config is not None
        if self._live_process() is not None:
            # The writer process takes whole batches: one host copy a batch, as on the graph path.
            self.queue_batch(completions, rows, lengths, host_ids, states)
            return
        layer_states = [states[f"layer{layer}"] for layer in self.config.layers]
        final_states = states["final"]
        # One concatenation for the whole batch: a row's [:n] slice of [B, W, 3H] is contiguous, so
        # each row is copied straight from it (per-row work is two buffers and two copies).
        aux_states = torch.cat(layer_states, dim=-1)
        on_gpu = final_states.is_cuda
        items = []
        with torch.cuda.stream(self._copy_stream_after(aux_states, final_states)) if on_gpu \
                else contextlib.nullcontext():
            for row in rows:
                aux, final = aux_states[row, :lengths[row]], final_states[row, :lengths[row]]
                if on_gpu:
                    aux, final = pinned_copy(aux), pinned_copy(final)
                # The ids come from the host batch: no device-to-host copy, no sync.
                items.append([completions[row], host_ids[row, :lengths[row]], aux, final, None])
        if on_gpu:
            copied = copies_landed(self._copy_stream)
            for item in items:
                item[4] = copied
        # Every copy is queued before the first put, which blocks while the disk lags: the
        # device copies of the batch are freed as they land, not held behind a full queue.
        del aux_states
        for item in items:
            item[0].capture_queued = True
            self._write_queue.put(tuple(item))
