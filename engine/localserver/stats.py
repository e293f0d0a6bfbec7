"""The runner's counters for /metrics and /server_info."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from engine.localserver.requests import GenRequest


@dataclass
class RunnerStats:
    num_running_reqs: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    largest_prefill_batch: int = 0  # evidence that concurrent requests share a prefill
    # Requests over batches is the mean batch a load got: closed-loop clients whose answers come back
    # spread out send their next requests spread out, and the worker then prefills part-full batches.
    prefill_batches_total: int = 0
    prefill_requests_total: int = 0


class RunnerMetrics:
    """Counts prefills and generated tokens from the model thread; read from the HTTP loop."""

    def __init__(self) -> None:
        self.stats = RunnerStats()
        self._lock = threading.Lock()
        self._recent_tokens: deque[tuple[float, int]] = deque()

    def count_prefill(self, group: list[GenRequest]) -> None:
        with self._lock:
            self.stats.largest_prefill_batch = max(self.stats.largest_prefill_batch, len(group))
            self.stats.prefill_batches_total += 1
            self.stats.prefill_requests_total += len(group)
            for req in group:
                if req.count_in_metrics:
                    self.stats.prompt_tokens_total += len(req.input_ids)
                    self.stats.num_requests_total += 1

    def count_tokens(self, requests: list[GenRequest], new_tokens: list[int]) -> None:
        counted = sum(n for req, n in zip(requests, new_tokens) if req.count_in_metrics)
        with self._lock:
            self.stats.generation_tokens_total += counted
            self._recent_tokens.append((time.monotonic(), counted))

    def gen_throughput(self, window_s: float = 5.0) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent_tokens and self._recent_tokens[0][0] < now - window_s:
                self._recent_tokens.popleft()
            return sum(n for _, n in self._recent_tokens) / window_s
