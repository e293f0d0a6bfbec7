"""Which requests the model runs together, and answering prefill-only requests off the model thread.

The *worker* loop takes waiting requests in groups: it waits a few ms after the first one for more,
up to `max_batch`, and hands each group to the runner. The *prefill waiter* (CUDA only) answers
prefill-only requests (`max_new_tokens` 0, no capture) once the GPU has finished their forward: the
worker never waits for the GPU, so it launches the next batch meanwhile, and a reply still means the
prefill is done (as in SGLang).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from engine.errors import one_line
from engine.localserver.requests import Completion, GenRequest


class Scheduler:
    def __init__(self, max_batch: int = 8, batch_wait_s: float = 0.005) -> None:
        self.max_batch = max(1, int(max_batch))
        self.batch_wait_s = batch_wait_s
        self._inbox: queue.Queue[GenRequest | None] = queue.Queue()
        self._prefill_done: queue.Queue[tuple | None] = queue.Queue()  # (CUDA event, [(completion, finish)])

    def submit(self, request: GenRequest) -> None:
        self._inbox.put(request)

    def stop(self) -> None:
        """The worker runs what was submitted before, then stops."""
        self._inbox.put(None)

    @property
    def num_queue_reqs(self) -> int:
        return self._inbox.qsize()

    def loops(self, run_group: Callable[[list[GenRequest]], None],
              on_stop: Callable[[], None]) -> list[tuple[Callable[[], None], str]]:
        """The loops the caller runs as threads; `on_stop` is called on the worker once it stops."""
        def worker() -> None:
            self._worker_loop(run_group, on_stop)
        return [(worker, "model-worker"), (self._prefill_waiter_loop, "prefill-waiter")]

    def answer_when_computed(self, finished: list[tuple[Completion, dict[str, Any]]], on_cuda: bool) -> None:
        """Finish these requests' generation once the work queued so far has run: on CUDA by the
        prefill waiter (the caller goes on launching), elsewhere now."""
        if finished and on_cuda:
            import torch

            done = torch.cuda.Event(blocking=True)  # the waiter sleeps instead of spinning a core
            done.record()
            for completion, _ in finished:
                completion.generation_done = True  # handed over: a later failure must not close it twice
            self._prefill_done.put((done, finished))
        else:
            for completion, finish in finished:
                completion.finish_generation(finish=finish)

    def _worker_loop(self, run_group: Callable[[list[GenRequest]], None], on_stop: Callable[[], None]) -> None:
        while True:
            group, stop = self._next_group()
            if group:
                run_group(group)
            if stop:
                self._stop_waiter()
                on_stop()
                return

    def _next_group(self) -> tuple[list[GenRequest], bool]:
        """The next group to run, and whether the worker stops after it (stop() was called)."""
        first = self._inbox.get()
        if first is None:
            return [], True
        group = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(group) < self.max_batch:
            try:
                item = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return group, True
            group.append(item)
        return group, False

    def _stop_waiter(self) -> None:
        self._prefill_done.put(None)  # queued after every pending item: those are answered first

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
