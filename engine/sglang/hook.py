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

The forward never waits on disk: rows are copied asynchronously into pinned host memory,
a CUDA event marks the copy, and a daemon thread waits on the event and writes the files.
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

from engine.capture.segments import write_segment
from engine.io.names import is_safe_name
from engine.errors import EngineError

logger = logging.getLogger("eagle3_console.capture_hook")

ENV_SPOOL = "EAGLE3_CAPTURE_SPOOL"
ENV_LAYERS = "EAGLE3_CAPTURE_LAYERS"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"
_GENERATED_RID = re.compile(r"^[0-9a-f]{32}$")  # uuid4().hex, what SGLang assigns when no rid is given
MAX_PENDING_BATCHES = 256  # beyond this the forward blocks rather than exhausting pinned memory


class CaptureConfigError(EngineError, RuntimeError):
    """The hook was loaded without the spool/layer settings the console puts in the environment."""


@dataclass
class _Pending:
    event: Any  # torch.cuda.Event or None for CPU tensors
    items: list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]  # rid, start, ids, aux, final


def should_capture(rid: Any, health_prefix: str = HEALTH_CHECK_PREFIX) -> bool:
    if not isinstance(rid, str) or rid.startswith(health_prefix) or _GENERATED_RID.match(rid):
        return False
    return is_safe_name(rid)


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "name", mode))


def _pack_aux(aux: Any) -> torch.Tensor | None:
    if aux is None:
        return None
    if isinstance(aux, torch.Tensor):
        return aux
    if isinstance(aux, (list, tuple)) and aux and all(isinstance(a, torch.Tensor) for a in aux):
        return torch.cat(list(aux), dim=-1)
    return None


def _to_host(src: torch.Tensor) -> torch.Tensor:
    if src.is_cuda:
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        return dst
    return src.detach().clone()


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
                 health_prefix: str = HEALTH_CHECK_PREFIX) -> None:
        self.spool_dir = spool_dir
        self.layers = list(layers)
        self.health_prefix = health_prefix
        self._rank_fn = rank_fn
        self._rank: int | None = None
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=MAX_PENDING_BATCHES)
        self._idle = threading.Condition()
        self._outstanding = 0
        self.written = 0
        self.errors: list[str] = []
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._writer, name="eagle3-capture-writer", daemon=True)
        self._thread.start()

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
        aux = _pack_aux(inputs[4] if len(inputs) > 4 else None)
        if aux is None:
            self._warn_once("aux", "no aux hidden states reached the logits processor: was the server started "
                                   "with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3?")
            return
        input_ids, hidden = inputs[0], inputs[1]
        items = []
        offset = 0
        for rid, length, start in zip(rids, seq_lens, prefix_lens):
            length, start = int(length), int(start)
            rows = slice(offset, offset + length)
            offset += length
            if length <= 0 or not should_capture(rid, self.health_prefix):
                continue
            items.append((rid, start, _to_host(input_ids[rows]), _to_host(aux[rows]), _to_host(hidden[rows])))
        if not items:
            return
        event = None
        if hidden.is_cuda:
            # Blocking: the writer sleeps until the copies land instead of spinning a core (CUDA
            # spin-waits by default) that SGLang's scheduler, a busy Python thread, needs.
            event = torch.cuda.Event(blocking=True)
            event.record()
        with self._idle:
            self._outstanding += 1
        self._queue.put(_Pending(event, items))

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
            try:
                if pending.event is not None:
                    pending.event.synchronize()
                for rid, start, ids, aux, final in pending.items:
                    try:
                        write_segment(self.spool_dir, rid, start, ids, aux, final, self.layers)
                        self.written += 1
                    except Exception as exc:  # a full disk must not kill the server; the probe reports gaps
                        self.errors.append(f"{rid}@{start}: {exc}")
                        logger.error("eagle3-console capture hook: writing %s@%d failed: %s", rid, start, exc)
            finally:
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
    hook = CaptureHook(spool, layers, rank_fn=lambda: sglang_writer_rank(rank_functions),
                       health_prefix=profile.health_check_prefix)
    atexit.register(hook.close)
    return hook
