"""Runs a transformers causal LM for the local target server, off the event loop.

Threads:
- one *worker* thread owns the model. It takes waiting requests in groups (it waits a few
  ms after the first one for more, up to `max_batch`), runs one right-padded prefill for
  the group, then decodes the group together with a shared KV cache, dropping rows as
  they finish. Token events are handed back through each request's `emit` callback.
- *writer* threads turn prefill captures into spool segments (bounded queue, so a
  slow disk pushes back on the worker instead of filling memory).
- one *prefill waiter* (CUDA only) answers prefill-only requests (`max_new_tokens` 0, no
  capture) once the GPU has finished their forward: the worker never waits for the GPU, so it
  launches the next batch meanwhile, and a reply still means the prefill is done (as in SGLang).

Capture uses forward hooks on the chosen decoder layers (their output = pre-norm residual
stream, HF `hidden_states[i+1]`) and on the final norm (post-norm state that feeds the LM
head), so the states come from the very forward pass that produced the first token.
A request's `DoneEvent` is emitted only when generation has finished *and* its capture
is complete in the spool, so a client may assemble the capture as soon as the reply arrives.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import one_line

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


class ModelLoadError(Exception):
    """The model directory cannot be served; str() is the reason (one line)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128  # SGLang's default
    temperature: float = 1.0  # SGLang's default; 0 means greedy
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class TokenEvent:
    ids: list[int]


@dataclass
class DoneEvent:
    finish_reason: dict[str, Any] | None
    error: str | None = None


RunnerEvent = TokenEvent | DoneEvent


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    emit: Callable[[RunnerEvent], None]  # called from runner threads; must not block
    capture: bool = False
    count_in_metrics: bool = True
    received: float = field(default_factory=time.monotonic)


@dataclass
class CaptureConfig:
    layers: list[int]  # 0-indexed decoder-layer outputs
    spool_dir: Path


@dataclass
class RunnerStats:
    num_running_reqs: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    largest_prefill_batch: int = 0  # evidence that concurrent requests share a prefill


class _Completion:
    """Emits the request's DoneEvent once generation and capture have both finished."""

    def __init__(self, request: GenRequest) -> None:
        self.request = request
        self._parts = 2 if request.capture else 1
        self._lock = threading.Lock()
        self._finish: dict[str, Any] | None = None
        self._error: str | None = None
        self.generation_done = False
        self.capture_queued = False

    def finish_generation(self, finish: dict[str, Any] | None = None, error: str | None = None) -> None:
        self.generation_done = True
        self._part_done(finish, error)

    def finish_capture(self, error: str | None = None) -> None:
        self._part_done(None, error)

    def abort(self, error: str) -> None:
        """The group failed: close whatever parts this thread still owns."""
        if not self.generation_done:
            self.finish_generation(error=error)
        if self.request.capture and not self.capture_queued:
            self.capture_queued = True
            self.finish_capture(error)

    def _part_done(self, finish: dict[str, Any] | None, error: str | None) -> None:
        with self._lock:
            if finish is not None:
                self._finish = finish
            if error is not None and self._error is None:
                self._error = error
            self._parts -= 1
            if self._parts != 0:
                return
        self.request.emit(DoneEvent(finish_reason=self._finish, error=self._error))


def _pinned_copy(device_tensor: Any) -> Any:
    """A non-blocking copy into a new pinned host buffer, on the current stream: the forward never
    waits for the host; a writer thread waits on the batch's `_copies_landed` event instead."""
    import torch

    host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)
    host.copy_(device_tensor, non_blocking=True)
    return host


def _copies_landed(stream: Any) -> Any:
    """An event recorded after the copies queued on `stream`. Blocking: a writer sleeps until they
    land instead of spinning a core (CUDA spin-waits by default), which the model thread needs."""
    import torch

    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


DEFAULT_CAPTURE_WRITERS = 4


def capture_writer_count() -> int:
    """Writer threads: EAGLE3_CAPTURE_WRITERS if set (1..64), else 4.

    Four write 9.4 GB/s into /dev/shm (H200 host; 3x what a 1B model captures at full prefill speed),
    and every writer also takes the GIL for a little Python per segment, which the model thread
    launching kernels pays for: with 8 writers a small target's capture ran at 0.745 of its plain
    prefill, with 2 at 0.876 (bench/RESULTS.md)."""
    raw = os.environ.get("EAGLE3_CAPTURE_WRITERS", "").strip()
    if raw.isdigit() and 1 <= int(raw) <= 64:
        return int(raw)
    return DEFAULT_CAPTURE_WRITERS


CAPTURE_WRITER_MODES = ("threads", "process")


def capture_writer_mode() -> str:
    """EAGLE3_CAPTURE_WRITER: "process" (default) hands whole batches to a child process through
    shared memory (engine/capture/spool_process.py), so the writes' GIL hand-offs leave the process
    that launches the kernels; it measured best in every pairing on the H200 and the dev box
    (bench/RESULTS.md). "threads" writes segments in the server process."""
    raw = os.environ.get("EAGLE3_CAPTURE_WRITER", "").strip().lower()
    if raw in ("", "process"):
        return "process"
    if raw == "threads":
        return "threads"
    print(f"EAGLE3_CAPTURE_WRITER={raw!r} is not one of {', '.join(CAPTURE_WRITER_MODES)}: using process",
          file=sys.stderr)
    return "process"


# Tokens one shared-memory slot holds when no prefill graphs set the size (CPU, graphs off); with
# graphs, their largest bucket. Larger (eager) batches are written by the in-process threads.
SPOOL_SLOT_TOKENS = 8192


def check_model_dir(model_path: Path) -> None:
    if not model_path.exists():
        raise ModelLoadError("does not exist")
    if not model_path.is_dir():
        raise ModelLoadError("is not a directory (expected a transformers model directory)")
    from engine.target import TargetError, read_config

    if not (model_path / "config.json").is_file():
        raise ModelLoadError("has no config.json (not a transformers model directory)")
    try:
        read_config(model_path)
    except TargetError as exc:
        raise ModelLoadError(str(exc)) from None


class ModelRunner:
    def __init__(
        self,
        model_path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        capture: CaptureConfig | None = None,
        max_batch: int = 8,
        batch_wait_s: float = 0.005,
        capture_queue_size: int = 16,
    ) -> None:
        self.model_path = Path(model_path)
        self.requested_device = device
        self.requested_dtype = dtype
        self.capture = capture
        self.max_batch = max(1, int(max_batch))
        self.batch_wait_s = batch_wait_s
        self.stats = RunnerStats()
        self._inbox: queue.Queue[GenRequest | None] = queue.Queue()
        self.capture_writers = capture_writer_count()
        self._write_queue: queue.Queue[tuple | None] = queue.Queue(
            maxsize=max(capture_queue_size, 2 * self.capture_writers))
        self._copy_stream: Any = None  # CUDA stream for device-to-host copies of captured states
        self.writer_mode = capture_writer_mode()
        self.writer_note = ""  # why the process writer is not in use, when it was asked for
        self._spool_process: Any = None  # SpoolWriterProcess while it takes batches
        self._batch_queue: queue.Queue[tuple | None] = queue.Queue(maxsize=2)
        self._prefill_done: queue.Queue[tuple | None] = queue.Queue()  # (CUDA event, [(completion, finish)])
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._stats_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._hook_store: dict[str, Any] = {}
        self._hooks_active = False
        self.prefill_graphs: Any = None  # PrefillGraphs on CUDA (prefill-only batches)
        self.model: Any = None
        self.tokenizer: Any = None

    # ---- loading ----------------------------------------------------------------------

    def load(self) -> None:
        """Load model and tokenizer; ModelLoadError with a one-line reason on failure."""
        check_model_dir(self.model_path)
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # keep the server's stderr to its own messages
        hf_logging.disable_progress_bar()
        self.device = self._resolve_device(torch)
        try:
            config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(f"config.json cannot be loaded: {one_line(exc)}") from None
        dtype = self._resolve_dtype(torch)
        major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
        try:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, local_files_only=True, **{dtype_kw: dtype}
            )
        except Exception as exc:
            raise ModelLoadError(f"cannot load the model ({one_line(exc)})") from None
        if self.device == "cpu" and model.dtype == torch.float16:
            model = model.float()  # fp16 kernels are poor or missing on CPU
        self.model = model.to(self.device).eval()
        from engine.sdpa import avoid_cudnn_attention

        avoid_cudnn_attention(self.device)  # decode steps change the key length: no per-shape plan builds
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except Exception:
            self.tokenizer = None  # input_ids still work; text requests get a clear 400
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.max_context = int(getattr(text_config, "max_position_embeddings", 0) or 0) or None
        self.model_type = getattr(config, "model_type", None)
        self.architectures = list(getattr(config, "architectures", None) or [])
        self.eos_token_ids = self._eos_ids()
        self.pad_token_id = self._pad_id()
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        if self.capture is not None:
            self.enable_capture(self.capture)
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        if decoder is not None and str(self.device).startswith("cuda"):
            from engine.localserver.prefill_graphs import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(decoder, self.device, self.max_batch, self.pad_token_id,
                                                self._set_hooks)

    def _resolve_device(self, torch: Any) -> str:
        wanted = self.requested_device
        if wanted == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if wanted == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("--device cuda was asked for, but torch sees no CUDA device")
        return wanted

    def _resolve_dtype(self, torch: Any) -> Any:
        return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[self.requested_dtype]

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        generation_config = getattr(self.model, "generation_config", None)
        for source in (getattr(generation_config, "eos_token_id", None),
                       getattr(self.model.config, "eos_token_id", None),
                       getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(x) for x in source)
        return frozenset(ids)

    def _pad_id(self) -> int:
        for source in (getattr(self.tokenizer, "pad_token_id", None),
                       getattr(self.model.config, "pad_token_id", None)):
            if isinstance(source, int):
                return source
        return min(self.eos_token_ids) if self.eos_token_ids else 0

    def enable_capture(self, capture: CaptureConfig) -> None:
        """Install the capture hooks (after load, before start). ModelLoadError if impossible."""
        from engine.capture.layers import validate_layers

        try:
            validate_layers(capture.layers, self.num_layers)
        except ValueError as exc:
            raise ModelLoadError(f"capture: {exc}") from None
        self.capture = capture
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        norm = next((getattr(decoder, name) for name in ("norm", "final_layernorm", "ln_f")
                     if getattr(decoder, name, None) is not None), None)
        if layers is None or norm is None:
            raise ModelLoadError(
                "capture needs a decoder with .layers and a final norm; this architecture "
                f"({', '.join(self.architectures) or 'unknown'}) does not expose them"
            )
        for layer_id in capture.layers:
            layers[layer_id].register_forward_hook(self._make_hook(f"layer{layer_id}"))
        norm.register_forward_hook(self._make_hook("final"))

    def _set_hooks(self, active: bool) -> dict[str, Any]:
        """Turn the capture hooks on or off; returns the (emptied) store they fill."""
        self._hooks_active = active
        self._hook_store = {}
        return self._hook_store

    def _make_hook(self, key: str) -> Callable:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if self._hooks_active:
                self._hook_store[key] = output[0] if isinstance(output, tuple) else output
        return hook

    # ---- threads ----------------------------------------------------------------------

    def start(self) -> None:
        # Several writers: safetensors writes outside the GIL, so segments of one batch are
        # written in parallel while the model runs the next one.
        targets = [(self._worker_loop, "model-worker"), (self._prefill_waiter_loop, "prefill-waiter")]
        targets += [(self._writer_loop, f"capture-writer-{i}") for i in range(self.capture_writers)]
        if self.capture is not None and self.writer_mode == "process" and self._start_spool_process():
            targets.append((self._feeder_loop, "capture-feeder"))
        for target, name in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def alive(self) -> bool:
        return bool(self._threads) and all(thread.is_alive() for thread in self._threads)

    def stop(self, timeout: float = 5.0) -> None:
        self._inbox.put(None)
        for thread in self._threads:
            thread.join(timeout)

    def submit(self, request: GenRequest) -> None:
        self._inbox.put(request)

    @property
    def num_queue_reqs(self) -> int:
        return self._inbox.qsize()

    def gen_throughput(self, window_s: float = 5.0) -> float:
        now = time.monotonic()
        with self._stats_lock:
            while self._recent_tokens and self._recent_tokens[0][0] < now - window_s:
                self._recent_tokens.popleft()
            return sum(n for _, n in self._recent_tokens) / window_s

    def _count_tokens(self, requests: list[GenRequest], new_tokens: list[int]) -> None:
        counted = sum(n for req, n in zip(requests, new_tokens) if req.count_in_metrics)
        with self._stats_lock:
            self.stats.generation_tokens_total += counted
            self._recent_tokens.append((time.monotonic(), counted))

    def _worker_loop(self) -> None:
        while True:
            first = self._inbox.get()
            if first is None:
                self._stop_helpers()
                return
            group = [first]
            stop_after = False
            deadline = time.monotonic() + self.batch_wait_s
            while len(group) < self.max_batch:
                try:
                    item = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop_after = True
                    break
                group.append(item)
            self._run_group_safely(group)
            if stop_after:
                self._stop_helpers()
                return

    def _stop_helpers(self) -> None:
        self._prefill_done.put(None)  # queued after every pending item: those are answered first
        if self._spool_process is not None:
            self._batch_queue.put(None)
        for _ in range(self.capture_writers):
            self._write_queue.put(None)

    def _prefill_waiter_loop(self) -> None:
        while True:
            item = self._prefill_done.get()
            if item is None:
                return
            done, finished = item
            try:
                done.synchronize()
            except Exception as exc:  # a failed forward surfaces here on CUDA
                for completion, _ in finished:
                    completion.finish_generation(error=f"generation failed: {one_line(exc)}")
            else:
                for completion, finish in finished:
                    completion.finish_generation(finish=finish)

    def _run_group_safely(self, group: list[GenRequest]) -> None:
        completions = [_Completion(req) for req in group]
        self.stats.num_running_reqs = len(group)
        try:
            self._run_group(group, completions)
        except Exception as exc:  # one bad batch must not kill the server
            traceback.print_exc(file=sys.stderr)
            message = f"generation failed: {one_line(exc)}"
            for completion in completions:
                completion.abort(message)
        finally:
            self.stats.num_running_reqs = 0
            self._set_hooks(False)

    def _writer_loop(self) -> None:
        while True:
            item = self._write_queue.get()
            if item is None:
                return
            completion, ids, aux, final, copied = item
            self._write_here(completion, ids, aux, final, copied)

    def _write_here(self, completion: _Completion, ids: Any, aux: Any, final: Any, copied: Any = None) -> None:
        """Write one captured row's segment on this thread and answer its request."""
        from engine.capture.segments import write_segment

        assert self.capture is not None
        try:
            # The asynchronous device-to-host copies have landed. Only the batch's first writer
            # usually waits: `query` keeps the GIL, a `synchronize` hands it away and back.
            if copied is not None and not copied.query():
                copied.synchronize()
            write_segment(self.capture.spool_dir, completion.request.rid, 0, ids, aux, final, self.capture.layers)
        except Exception as exc:
            completion.finish_capture(error=f"capture write failed: {one_line(exc)}")
        else:
            completion.finish_capture()

    def _start_spool_process(self) -> bool:
        """Start the writer process; False (and `writer_note` says why) to stay with threads."""
        import torch

        from engine.capture.spool_process import SpoolProcessError, SpoolWriterProcess

        assert self.capture is not None
        element = self.model.dtype.itemsize if self.model is not None else torch.float32.itemsize
        per_token = (len(self.capture.layers) + 1) * self.hidden_size * element + 8  # + the int64 id
        graphs = self.prefill_graphs
        tokens = graphs.max_tokens if graphs is not None and graphs.enabled else SPOOL_SLOT_TOKENS
        writer = SpoolWriterProcess(self.capture.spool_dir, self.capture.layers,
                                    slot_bytes=tokens * per_token + 64, threads=self.capture_writers,
                                    on_failure=lambda reason: print(f"capture: {reason}; threads write the "
                                                                    "segments from now on", file=sys.stderr))
        try:
            writer.start()
        except SpoolProcessError as exc:
            self.writer_note = f"process writer unavailable, threads write the segments: {exc}"
            print(f"capture: {self.writer_note}", file=sys.stderr)
            return False
        self._spool_process = writer
        return True

    def writer_description(self) -> str:
        """How captured segments are written, for /server_info."""
        if (live := self._live_writer_process()) is not None:
            return f"process (pid {live.pid})"
        writer = self._spool_process
        note = self.writer_note or (writer.failure if writer is not None else "")
        return f"threads ({self.capture_writers})" + (f"; {note}" if note else "")

    def _feeder_loop(self) -> None:
        """Hands each captured batch to the writer process once its host copies have landed."""
        from engine.capture.spool_process import SpoolProcessError

        assert self._spool_process is not None
        writer = self._spool_process
        while True:
            item = self._batch_queue.get()
            if item is None:
                writer.close()
                return
            batch, ids, aux, final, copied = item

            def answer(errors: list[str | None], batch: list = batch) -> None:
                for (completion, _), error in zip(batch, errors):
                    completion.finish_capture(error=error)

            try:
                if copied is not None and not copied.query():
                    copied.synchronize()
                writer.submit([completion.request.rid for completion, _ in batch], [n for _, n in batch],
                              ids, aux, final, answer)
                continue
            except SpoolProcessError:
                pass  # the child is gone (on_failure said so): this thread writes the batch
            except Exception as exc:  # the batch's forward or copies failed on the device
                answer([f"capture write failed: {one_line(exc)}"] * len(batch))
                continue
            # Later batches go to the writer threads (`_queue_batch_captures` sees the child dead).
            for i, (completion, n) in enumerate(batch):
                self._write_here(completion, ids[i, :n], aux[i, :n], final[i, :n])

    # ---- the model --------------------------------------------------------------------

    def _forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, cache: Any,
                 keep: Any = None) -> tuple[Any, Any]:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "use_cache": True, self._cache_kw: cache,
        }
        if keep is not None and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(**kwargs)
        new_cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits, new_cache

    def _run_group(self, group: list[GenRequest], completions: list[_Completion]) -> None:
        import torch

        device = self.device
        lengths = [len(req.input_ids) for req in group]
        width = max(lengths)
        batch = len(group)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        for row, req in enumerate(group):
            input_ids[row, : lengths[row]] = torch.tensor(req.input_ids, dtype=torch.long)
        host_ids = input_ids  # the captured ids come from here: no device-to-host copy, no sync
        capture_rows = [row for row, req in enumerate(group) if req.capture]

        with self._stats_lock:
            self.stats.largest_prefill_batch = max(self.stats.largest_prefill_batch, batch)
            for req in group:
                if req.count_in_metrics:
                    self.stats.prompt_tokens_total += len(req.input_ids)
                    self.stats.num_requests_total += 1

        with torch.inference_mode():
            if self._run_graphed_prefill(group, completions, lengths, host_ids, capture_rows):
                return
            # The graphs build their own mask; the eager forward takes transformers' 2-D one.
            mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
            input_ids, mask = input_ids.to(device), mask.to(device)
            positions = torch.arange(width, device=device).unsqueeze(0).expand(batch, -1)
            # Logits only where a next token is needed: the last real position of each row.
            keep_positions = sorted(set(n - 1 for n in lengths))
            keep = torch.tensor(keep_positions, device=device) if self._has_logits_to_keep else None
            store = self._set_hooks(bool(capture_rows) and self.capture is not None)
            logits, cache = self._forward(input_ids, mask, positions, None, keep)
            self._set_hooks(False)
            if capture_rows:
                self._queue_captures(completions, capture_rows, lengths, host_ids, store)
            store.clear()  # the captured layer outputs are not kept alive through the decode
            if keep is not None:
                index_of = {pos: i for i, pos in enumerate(keep_positions)}
                last = torch.stack([logits[row, index_of[lengths[row] - 1]] for row in range(batch)])
            else:
                last = torch.stack([logits[row, lengths[row] - 1] for row in range(batch)])
            del logits
            self._decode(group, completions, lengths, mask, cache, last)

    def _run_graphed_prefill(self, group, completions, lengths, host_ids, capture_rows) -> bool:
        """A prefill-only batch through its CUDA graph (prefill_graphs.py); False: run it eagerly."""
        if self.prefill_graphs is None or any(req.params.max_new_tokens != 0 for req in group):
            return False
        states = self.prefill_graphs.run(host_ids, lengths)
        if states is None:
            return False
        if capture_rows and self.capture is not None:
            self._queue_batch_captures(completions, capture_rows, lengths, host_ids, states)
        self._decode(group, completions, lengths, None, None, None)  # prefill only: no logits needed
        return True

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

    def _live_writer_process(self) -> Any:
        """The writer process if it takes batches now, else None (threads write)."""
        writer = self._spool_process
        return writer if writer is not None and writer.alive else None

    def _queue_batch_captures(self, completions, rows, lengths, host_ids, states: dict[str, Any]) -> None:
        """The graph path's captures, and every batch's while the writer process runs: one pinned
        buffer and one copy per batch for each of the aux and final states, handed to the writer
        process whole or to the writer threads as per-row views.

        A small target replays its prefill in one launch, so the per-row work of `_queue_captures`
        (two pinned buffers, two copies and four slices a row, each torch call a GIL hand-off the
        model thread waits to get back while the HTTP loop and the writers are busy) becomes most
        of its host time. Graph buckets have fixed shapes, so the host allocator's cached blocks
        fit every batch again; eager batches (large targets) written by threads keep the per-row
        copies."""
        import torch

        assert self.capture is not None
        width = max(lengths[row] for row in rows)
        if rows == list(range(len(rows))):  # extraction: every real row is captured
            pick = slice(0, len(rows))
        else:
            pick = torch.tensor(rows, device=states["final"].device)
        # New tensors on the compute stream, not views: the next replay overwrites the graph's outputs
        # while the copy stream still reads these.
        aux_states = torch.cat([states[f"layer{layer}"][pick, :width] for layer in self.capture.layers], dim=-1)
        final_states = states["final"][pick, :width].contiguous()
        if final_states.is_cuda:
            with torch.cuda.stream(self._copy_stream_after(aux_states, final_states)):
                aux, final = _pinned_copy(aux_states), _pinned_copy(final_states)
                copied = _copies_landed(self._copy_stream)
        else:  # CPU (tests): the new tensors are the host buffers
            aux, final, copied = aux_states, final_states, None
        del aux_states, final_states
        writer = self._live_writer_process()
        if writer is not None:
            ids = host_ids[rows, :width]
            if writer.fits(ids, aux, final):
                for row in rows:
                    completions[row].capture_queued = True
                self._batch_queue.put(([(completions[row], lengths[row]) for row in rows], ids, aux, final, copied))
                return
        for i, row in enumerate(rows):
            n = lengths[row]
            completions[row].capture_queued = True
            self._write_queue.put((completions[row], host_ids[row, :n], aux[i, :n], final[i, :n], copied))

    def _queue_captures(self, completions, rows, lengths, host_ids, states: dict[str, Any]) -> None:
        """Queue the captured rows' segments; `states` maps hook keys to [B, W, ...] tensors."""
        import torch

        assert self.capture is not None
        if self._live_writer_process() is not None:
            # The writer process takes whole batches: one host copy a batch, as on the graph path.
            self._queue_batch_captures(completions, rows, lengths, host_ids, states)
            return
        layer_states = [states[f"layer{layer}"] for layer in self.capture.layers]
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
                    aux, final = _pinned_copy(aux), _pinned_copy(final)
                # The ids come from the host batch: no device-to-host copy, no sync.
                items.append([completions[row], host_ids[row, :lengths[row]], aux, final, None])
        if on_gpu:
            copied = _copies_landed(self._copy_stream)
            for item in items:
                item[4] = copied
        # Every copy is queued before the first put, which blocks while the disk lags: the
        # device copies of the batch are freed as they land, not held behind a full queue.
        del aux_states
        for item in items:
            item[0].capture_queued = True
            self._write_queue.put(tuple(item))

    def _decode(self, group, completions, lengths, mask, cache, last_logits) -> None:
        import torch

        device = self.device
        generators = [self._generator(req.params.seed) for req in group]
        generated = [0] * len(group)
        active = list(range(len(group)))  # group rows still decoding, in cache-row order
        # max_new_tokens == 0: prefill only (capture), no token. Done when the GPU has run the forward:
        # a captured row's reply already waits for its copy; the others go to the prefill waiter.
        prefill_only = [row for row in active if group[row].params.max_new_tokens == 0]
        finish = {"type": "length", "length": 0}
        waiting = [(completions[row], finish) for row in prefill_only if not group[row].capture]
        if waiting and str(device).startswith("cuda"):
            done = torch.cuda.Event(blocking=True)  # the waiter sleeps instead of spinning a core
            done.record()
            for completion, _ in waiting:
                completion.generation_done = True  # handed over: a later failure must not close it twice
            self._prefill_done.put((done, waiting))
        else:
            for completion, _ in waiting:
                completion.finish_generation(finish=finish)
        for row in prefill_only:
            if group[row].capture:
                completions[row].finish_generation(finish=finish)
        active = [row for row in active if group[row].params.max_new_tokens > 0]
        logits_rows = list(range(len(group)))  # row of last_logits for each group row
        while active:
            next_tokens: dict[int, int] = {}
            for row in active:
                req = group[row]
                next_tokens[row] = self._pick(last_logits[logits_rows.index(row)], req.params, generators[row])
            self._count_tokens([group[r] for r in active], [1] * len(active))
            still: list[int] = []
            for row in active:
                token = next_tokens[row]
                generated[row] += 1
                req = group[row]
                req.emit(TokenEvent([token]))
                params = req.params
                if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                    completions[row].finish_generation(finish={"type": "stop", "matched": token})
                elif generated[row] >= params.max_new_tokens:
                    completions[row].finish_generation(finish={"type": "length", "length": params.max_new_tokens})
                else:
                    still.append(row)
            if not still:
                return
            if len(still) < len(logits_rows) and hasattr(cache, "batch_select_indices"):
                keep_idx = torch.tensor([logits_rows.index(r) for r in still], device=device)
                cache.batch_select_indices(keep_idx)
                mask = mask[keep_idx]
                logits_rows = list(still)
            step_ids = torch.tensor([[next_tokens.get(r, self.pad_token_id)] for r in logits_rows],
                                    dtype=torch.long, device=device)
            step_pos = torch.tensor([[lengths[r] + generated[r] - 1] for r in logits_rows],
                                    dtype=torch.long, device=device)
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)], dim=1)
            logits, cache = self._forward(step_ids, mask, step_pos, cache, 1)
            last_logits = logits[:, -1]
            active = still

    @staticmethod
    def _generator(seed: int | None) -> Any:
        import torch

        if seed is None:
            return None
        generator = torch.Generator(device="cpu")
        generator.manual_seed(int(seed))
        return generator

    @staticmethod
    def _pick(logits: Any, params: SamplingParams, generator: Any) -> int:
        import torch

        if params.temperature <= 0.0 or params.top_k == 1:
            return int(torch.argmax(logits).item())
        scores = logits.float().to("cpu") / params.temperature
        if params.top_k > 0:
            kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=generator).item())
