"""The capture hook SGLang loads into every TP worker through `--forward-hooks`.

SGLang (0.5.23 `model_executor/hook_manager.py`) imports `make_capture_hook`, calls it with the
spec's "config" dict and registers the result with `module.register_forward_hook` on the
logits processor, after CUDA-graph capture, so it runs on eager forwards only. The logits
processor is called positionally as

    (input_ids, hidden_states [T, H] post final norm, lm_head, forward_batch, aux_hidden_states)

where aux is SGLang's own EAGLE-3 capture (one packed [T, k*H] tensor, or a list of k [T, H]),
switched on by `--enable-return-aux-hidden-states`.

Policy: only pure EXTEND batches (not MIXED, TARGET_VERIFY, DECODE ...); only the writer rank
(rank 0 of the TP group, or of the DP group's attention-TP group with DP attention); only
request ids a client chose: health checks (`HEALTH_CHECK…`) and SGLang's own generated ids
(32 lowercase hex, e.g. warmup or ad-hoc traffic) are skipped, like the local server does.
Ids are validated as file names before use. Rows are sliced per request by
extend_seq_lens_cpu; extend_prefix_lens_cpu is the segment's start position, so chunked
prefill leaves one segment per chunk that `assemble` stitches.

The forward never waits on disk, nor on the copy, unless the batches waiting for the writer already
hold `EAGLE3_CAPTURE_PENDING_MB` of host memory (4 GiB; then it waits for room): the batch's captured
rows are copied into pinned host memory on a side stream that first waits for the forward's stream, so
the next forward's kernels run while the copy engine drains the states (on the forward's own stream the
copy would hold the next batch back). The source tensors are recorded on the side stream, so SGLang's
allocator does not reuse their memory before the copy has read it; nothing writes them in place after the
logits processor. A CUDA event on the side stream marks the copy, and a daemon thread waits on the event
and hands the batch to a writer *process* (engine.capture.spool_process, the local server's design):
here the hook shares the GIL with SGLang's scheduler, and a writer thread's system calls would take it
from the thread that launches the model. The packed batch goes over whole (`submit_packed`: one copy a
tensor into shared memory and one pipe message a slot, no per-request views); the child writes the
segments; a batch larger than a slot is cut into several. Until the child is up (it starts on the first
captured batch), or if it dies, the thread writes the segments itself (`EAGLE3_CAPTURE_WRITER=threads`
always, as for the local server).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import queue
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.capture.segments import try_mark_failed, write_segment
from engine.capture.writer_env import (DEFAULT_SLOT_TOKENS, WRITER_ENV, WRITER_MODES, slot_tokens_from_env,
                                       writer_mode_from_env)
from engine.io.env import whole_number_from_env
from engine.system.disk import is_no_space
from engine.io.names import is_safe_name
from engine.errors import EngineError

logger = logging.getLogger("eagle3_console.capture_hook")

ENV_SPOOL = "EAGLE3_CAPTURE_SPOOL"
ENV_LAYERS = "EAGLE3_CAPTURE_LAYERS"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"
_GENERATED_RID = re.compile(r"^[0-9a-f]{32}$")  # uuid4().hex, what SGLang assigns when no rid is given
MAX_PENDING_BATCHES = 256  # a count bound beside the byte bound below (many tiny batches); past it the forward blocks
# Host memory that captured batches may hold while they wait for the writer; past it the forward waits.
# A batch count alone bounds nothing: 256 batches of a 1B target's 16 x 2,048-token prefill are 137 GB.
PENDING_MB_ENV = "EAGLE3_CAPTURE_PENDING_MB"
DEFAULT_PENDING_MB = 4096
MAX_PENDING_MB = 1 << 20


def pending_bytes_from_env() -> int:
    """EAGLE3_CAPTURE_PENDING_MB in bytes if set, else the default; ValueError naming the variable and the
    fix for anything else (never replaced by the default: the operator set it for a reason)."""
    return whole_number_from_env(PENDING_MB_ENV, DEFAULT_PENDING_MB, MAX_PENDING_MB, "a whole number of MiB",
                                 f"{DEFAULT_PENDING_MB:,} MiB") << 20


class CaptureConfigError(EngineError, RuntimeError):
    """The hook was loaded without the spool/layer settings the console puts in the environment."""


@dataclass
class _Pending:
    event: Any  # torch.cuda.Event or None for CPU tensors
    segments: list[tuple[str, int, int]]  # rid, start position, tokens: packed one after another below
    ids: torch.Tensor  # [T] on the host (pinned when the batch came from a GPU)
    aux: torch.Tensor  # [T, k*H]
    final: torch.Tensor  # [T, H]
    nbytes: int  # host memory the three hold, counted against the hook's pending bound

    def pieces(self) -> list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each segment's (rid, start, ids, aux, final): views of its rows of the packed batch."""
        pieces, offset = [], 0
        for rid, start, n in self.segments:
            rows = slice(offset, offset + n)
            pieces.append((rid, start, self.ids[rows], self.aux[rows], self.final[rows]))
            offset += n
        return pieces


def should_capture(rid: Any, health_prefix: str = HEALTH_CHECK_PREFIX) -> bool:
    if not isinstance(rid, str) or rid.startswith(health_prefix) or _GENERATED_RID.match(rid):
        return False
    return is_safe_name(rid)


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "name", mode))


def _aux_parts(aux: Any) -> list[torch.Tensor] | None:
    """SGLang's aux states as a list of tensors to concatenate on the last dim; None if absent."""
    if isinstance(aux, torch.Tensor):
        return [aux]
    if isinstance(aux, (list, tuple)) and aux and all(isinstance(a, torch.Tensor) for a in aux):
        return list(aux)
    return None


def _to_host(src: torch.Tensor) -> torch.Tensor:
    if src.is_cuda:
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        return dst
    return src.detach().clone()


_COPY_STREAMS: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def _batch_to_host(input_ids: torch.Tensor, aux: list[torch.Tensor], hidden: torch.Tensor,
                   spans: list[tuple[int, int]], total: int) -> tuple[list[torch.Tensor], Any]:
    """Host copies of the kept rows of ids, packed aux and final states, and the CUDA event that marks
    them done (None for CPU tensors). On CUDA everything, the aux concatenation included, runs on the
    side stream; see the module docstring."""
    sources = [input_ids, *aux, hidden]

    def copies() -> list[torch.Tensor]:
        packed = aux[0] if len(aux) == 1 else torch.cat(aux, dim=-1)
        return [_to_host(_kept_rows(t, spans, total)) for t in (input_ids, packed, hidden)]

    if not hidden.is_cuda:
        return copies(), None
    side = _copy_stream(hidden.device)
    side.wait_stream(torch.cuda.current_stream(hidden.device))
    with torch.cuda.stream(side):
        for tensor in sources:
            if tensor.is_cuda:
                tensor.record_stream(side)
        host = copies()
        # Blocking: the writer sleeps until the copies land instead of spinning a core (CUDA
        # spin-waits by default) that SGLang's scheduler, a busy Python thread, needs.
        event = torch.cuda.Event(blocking=True)
        event.record(side)
    return host, event


def _kept_rows(tensor: torch.Tensor, spans: list[tuple[int, int]], total: int) -> torch.Tensor:
    """The rows of `spans` (offset, length; in order, disjoint) packed together: a view when they are
    all `total` rows of the batch, the usual case."""
    if sum(n for _, n in spans) == total:
        return tensor[:total]
    return torch.cat([tensor[at:at + n] for at, n in spans])


def sglang_writer_rank(functions: tuple[str, ...]) -> int:
    """This worker's rank among the TP ranks that share its batch; 0 when not distributed."""
    for path in functions:
        module_name, _, attr = path.partition(":")
        try:
            group = getattr(importlib.import_module(module_name), attr)()
            return int(group.rank_in_group)
        except Exception:  # older layout or groups not initialised: try the next one
            continue
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class CaptureHook:
    """A `register_forward_hook` callable writing spool segments; see the module docstring."""

    def __init__(self, spool_dir: str, layers: list[int], rank_fn: Callable[[], int],
                 health_prefix: str = HEALTH_CHECK_PREFIX, writer: str = "process",
                 slot_tokens: int = DEFAULT_SLOT_TOKENS, pending_bytes: int = DEFAULT_PENDING_MB << 20) -> None:
        if writer not in WRITER_MODES:
            raise CaptureConfigError(f"{WRITER_ENV}={writer!r}: use \"process\" (the default) or \"threads\"")
        self.spool_dir = spool_dir
        self.layers = list(layers)
        self.health_prefix = health_prefix
        self.writer = writer
        self.slot_tokens = max(1, int(slot_tokens))
        self._rank_fn = rank_fn
        self._rank: int | None = None
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=MAX_PENDING_BATCHES)
        self._idle = threading.Condition()
        self._outstanding = 0
        self.pending_limit = max(1, int(pending_bytes))
        self.pending_bytes = 0  # host bytes of batches captured and not yet handed over or written
        self.written = 0
        self.batches_by_process = 0  # batches the writer process wrote (the rest: this process's thread)
        self.errors: list[str] = []
        self._warned: set[str] = set()
        self._process: Any = None  # SpoolWriterProcess once started
        self._process_state = "off" if writer == "threads" else "not started"
        self._thread = threading.Thread(target=self._writer, name="eagle3-capture-writer", daemon=True)
        self._thread.start()

    @property
    def writer_state(self) -> str:
        """Who writes the segments: "process" (the writer process runs), "threads" (by choice, or since
        the process failed to start or died: see the server log), or "not started" (no batch yet)."""
        if self._process_state == "running":
            return "process"
        return "not started" if self._process_state == "not started" else "threads"

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid while it runs (for `jobs stacks` and the operator's eyes)."""
        return self._process.pid if self._process_state == "running" else None

    # -- forward side
    def __call__(self, module: Any, inputs: tuple, output: Any) -> None:
        if len(inputs) < 4:
            self._warn_once("args", f"logits processor called with {len(inputs)} positional args; need 5")
            return
        batch = inputs[3]
        if _mode_name(getattr(batch, "forward_mode", None)) != "EXTEND":
            return
        if self._rank is None:
            self._rank = int(self._rank_fn())
        if self._rank != 0:
            return
        rids = getattr(batch, "rids", None)
        seq_lens = getattr(batch, "extend_seq_lens_cpu", None)
        prefix_lens = getattr(batch, "extend_prefix_lens_cpu", None)
        if rids is None or seq_lens is None or prefix_lens is None:
            self._warn_once("batch", "ForwardBatch lacks rids/extend_seq_lens_cpu/extend_prefix_lens_cpu")
            return
        aux = _aux_parts(inputs[4] if len(inputs) > 4 else None)
        if aux is None:
            self._warn_once("aux", "no aux hidden states reached the logits processor: was the server started "
                                   "with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3?")
            return
        input_ids, hidden = inputs[0], inputs[1]
        segments, spans = [], []
        offset = 0
        for rid, length, start in zip(rids, seq_lens, prefix_lens):
            length, start = int(length), int(start)
            at = offset
            offset += length
            if length <= 0 or not should_capture(rid, self.health_prefix):
                continue
            segments.append((rid, start, length))
            spans.append((at, length))
        if not segments:
            return
        rows = sum(n for _, n in spans)
        nbytes = rows * (input_ids.element_size() + sum(a.shape[-1] * a.element_size() for a in aux)
                         + hidden.shape[-1] * hidden.element_size())
        with self._idle:
            # Backpressure before the host buffers exist; one batch is always let through, however large.
            self._idle.wait_for(lambda: self.pending_bytes == 0 or self.pending_bytes + nbytes <= self.pending_limit)
            self.pending_bytes += nbytes
            self._outstanding += 1
        try:
            # One host copy a tensor for the whole batch (the rows kept, packed), not one per request.
            (ids, aux_rows, final), event = _batch_to_host(input_ids, aux, hidden, spans, offset)
        except BaseException:
            self._release(nbytes)
            self._done()
            raise
        self._queue.put(_Pending(event, segments, ids, aux_rows, final, nbytes))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.error("eagle3-console capture hook: %s", message)

    # -- writer side
    def _writer(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            handed = False
            try:
                if pending.event is not None:
                    pending.event.synchronize()
                handed = self._to_process(pending)
                if not handed:
                    self._write_here(pending)
            except Exception as exc:  # e.g. a failed copy: this batch is lost, the thread goes on with the next
                with self._idle:
                    self.errors.extend(f"{rid}@{start}: capture failed: {exc}" for rid, start, _ in pending.segments)
                logger.error("eagle3-console capture hook: a captured batch was lost: %s", exc)
                for rid, start, _ in pending.segments:
                    self._mark_lost(rid, start, f"capture failed: {exc}")
            finally:
                self._release(pending.nbytes)  # handed over, the process holds its own copy
                if not handed:
                    self._done()
            del pending  # its host buffers go back now, not when the next batch arrives

    def _to_process(self, pending: _Pending) -> bool:
        """Hand the batch to the writer process (started on the first batch); False: write it here."""
        from engine.capture.spool_process import SpoolProcessError

        process = self._live_process(pending)
        if process is None:
            return False
        try:
            segments = pending.segments  # the reply keeps the table, not the host buffers
            process.submit_packed(segments, pending.ids, pending.aux, pending.final,
                                  lambda errors: self._process_done(segments, errors))
        except SpoolProcessError as exc:
            self._process_gone(str(exc))
            return False
        return True

    def _live_process(self, pending: _Pending) -> Any:
        from engine.capture.spool_process import SpoolWriterProcess, slot_bytes_for

        if self._process_state == "not started":
            per_token = (pending.ids.element_size() + pending.aux.shape[-1] * pending.aux.element_size()
                         + pending.final.shape[-1] * pending.final.element_size())
            process = SpoolWriterProcess(self.spool_dir, self.layers,
                                         slot_bytes=slot_bytes_for(self.slot_tokens, per_token),
                                         on_failure=self._process_gone)
            try:
                process.start()
            except Exception as exc:  # no room in /dev/shm, no spawn here...: this thread writes
                self._process_gone(f"cannot start the capture writer process: {exc}")
                return None
            self._process, self._process_state = process, "running"
        return self._process if self._process_state == "running" and self._process.alive else None

    def _process_gone(self, reason: str) -> None:
        if self._process_state != "failed":
            self._process_state = "failed"
            logger.error("eagle3-console capture hook: %s; the writer thread writes the segments from now on",
                         reason)

    def _process_done(self, segments: list[tuple[str, int, int]], errors: list[str | None]) -> None:
        with self._idle:  # the reply thread; the writer thread may count a fallback batch at once
            for (rid, start, _), error in zip(segments, errors):
                if error is None:
                    self.written += 1
                else:
                    self.errors.append(f"{rid}@{start}: {error}")
                    logger.error("eagle3-console capture hook: writing %s@%d failed: %s", rid, start, error)
            self.batches_by_process += 1
        for (rid, start, _), error in zip(segments, errors):
            if error is not None:
                self._mark_lost(rid, start, error)
        self._done()

    def _write_here(self, pending: _Pending) -> None:
        for rid, start, ids, aux, final in pending.pieces():
            try:
                write_segment(self.spool_dir, rid, start, ids, aux, final, self.layers)
                with self._idle:
                    self.written += 1
            except Exception as exc:  # a full disk must not kill the server; the probe reports gaps
                with self._idle:
                    self.errors.append(f"{rid}@{start}: {exc}")
                logger.error("eagle3-console capture hook: writing %s@%d failed: %s", rid, start, exc)
                self._mark_lost(rid, start, f"capture write failed: {exc}", is_no_space(exc))

    def _mark_lost(self, rid: str, start: int, reason: str, no_space: bool = False) -> None:
        """SGLang has answered the request already: leave the reason in the spool, so the reader fails at
        once instead of waiting out extract.capture_wait_s (the writer process marks its own failures)."""
        if problem := try_mark_failed(self.spool_dir, rid, start, reason, no_space):
            logger.error("eagle3-console capture hook: %s", problem)

    def _release(self, nbytes: int) -> None:
        with self._idle:
            self.pending_bytes -= nbytes
            self._idle.notify_all()

    def _done(self) -> None:
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued segment is on disk; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout=timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        if self._process is not None:
            self._process.close(timeout)
            self._process = None
            if self._process_state == "running":
                self._process_state = "closed"


def _layers_from(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        layers = []
    if not layers:
        raise CaptureConfigError(f"{ENV_LAYERS}={text!r} is not a comma-separated list of layer ids")
    return layers


def make_capture_hook(config: dict[str, Any] | None = None) -> CaptureHook:
    """Hook factory named in `--forward-hooks`; settings come from the environment the console sets."""
    from engine.sglang.versions import detect_profile, installed_version

    config = config or {}
    spool = os.environ.get(ENV_SPOOL, "")
    layers_text = os.environ.get(ENV_LAYERS, "")
    if not spool or not layers_text:
        raise CaptureConfigError(
            f"{ENV_SPOOL} and {ENV_LAYERS} must be set for the capture hook; start the server from the console "
            "(`eagle3-console server start`), which sets them")
    layers = _layers_from(layers_text)
    if config.get("layers") is not None and [int(x) for x in config["layers"]] != layers:
        raise CaptureConfigError(f"--forward-hooks config layers {config['layers']} differ from {ENV_LAYERS}={layers}")
    profile = detect_profile(installed_version() or config.get("sglang"))
    rank_functions = profile.rank_functions
    try:
        slot_tokens, writer = slot_tokens_from_env(DEFAULT_SLOT_TOKENS), writer_mode_from_env()
        pending_bytes = pending_bytes_from_env()
    except ValueError as exc:
        raise CaptureConfigError(str(exc)) from None
    hook = CaptureHook(spool, layers, rank_fn=lambda: sglang_writer_rank(rank_functions),
                       health_prefix=profile.health_check_prefix, writer=writer, slot_tokens=slot_tokens,
                       pending_bytes=pending_bytes)
    atexit.register(hook.close)
    return hook
