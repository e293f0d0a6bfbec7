"""What a request to the runner is, what it hands back, and when it is done."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.localserver.sampling import SamplingParams

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


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


class Completion:
    """Emits the request's DoneEvent once generation and capture have both finished (the capture: its
    states are in the writer process's hands or in the spool, see model_runner)."""

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
