"""Runs a transformers causal LM for the local target server, off the event loop.

`ModelRunner` composes the parts, split along their jobs as SGLang splits them:
- scheduler.py: the request queue, batching, and the prefill waiter;
- here: one group's right-padded prefill, then its decode with a shared KV cache, dropping rows
  as they finish (on the scheduler's worker thread; token events go back through `emit`);
- sampling.py: the next token; loading.py: the model directory; stats.py: the counters;
- capture_hooks.py records the states during the prefill, capture_sink.py writes them to the spool.
A request's `DoneEvent` is emitted only when generation has finished *and* its capture is safe
(requests.Completion): with the writer process, once the child holds the states (their segments follow,
as SGLang's do; readers wait for them); with writer threads, once the segments are in the spool.
"""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from engine.errors import one_line
from engine.localserver.capture_hooks import CaptureHooks
from engine.localserver.capture_sink import CaptureConfig, CaptureSink
from engine.localserver.loading import ModelInfo, load_model
from engine.localserver.requests import Completion, GenRequest, TokenEvent
from engine.localserver.sampling import make_generator, pick_token
from engine.localserver.scheduler import Scheduler
from engine.localserver.settings import SPOOL_SLOT_TOKENS, capture_slot_tokens
from engine.localserver.stats import RunnerMetrics


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
        self.scheduler = Scheduler(max_batch, batch_wait_s)
        self.max_batch = self.scheduler.max_batch
        self.metrics = RunnerMetrics()
        self.stats = self.metrics.stats
        self.hooks = CaptureHooks()
        self.sink = CaptureSink(capture_queue_size)
        self.sink.config = capture  # its hooks are installed by load()
        self._threads: list[threading.Thread] = []
        self.prefill_graphs: Any = None  # PrefillGraphs on CUDA (prefill-only batches)
        self.model: Any = None
        self.tokenizer: Any = None
        self.device = ""  # set by load()
        self._info: ModelInfo | None = None

    @property
    def info(self) -> ModelInfo:
        """What load() read about the model."""
        if self._info is None:
            raise RuntimeError("ModelRunner.load() has not run")
        return self._info

    @property
    def capture(self) -> CaptureConfig | None:
        return self.sink.config

    def load(self) -> None:
        """Load model and tokenizer; ModelLoadError with a one-line reason on failure."""
        loaded = load_model(self.model_path, self.requested_device, self.requested_dtype)
        self.model, self.tokenizer, self.device, self._info = loaded.model, loaded.tokenizer, loaded.device, loaded.info
        if self.capture is not None:
            self.enable_capture(self.capture)
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        if decoder is not None and str(self.device).startswith("cuda"):
            from engine.localserver.prefill_graphs import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(decoder, self.device, self.max_batch, self.info.pad_token_id,
                                                self.hooks.set)

    def enable_capture(self, capture: CaptureConfig) -> None:
        """Install the capture hooks (after load, before start). ModelLoadError if impossible."""
        self.hooks.install(self.model, capture.layers, self.info.num_layers, self.info.architectures)
        self.sink.config = capture

    # ---- threads ----------------------------------------------------------------------

    def start(self) -> None:
        graphs = self.prefill_graphs
        slot_tokens = capture_slot_tokens(graphs.max_tokens if graphs is not None and graphs.enabled
                                          else SPOOL_SLOT_TOKENS)
        state_bytes = self._info.hidden_size * self.model.dtype.itemsize if self._info is not None else 0
        loops = self.scheduler.loops(self._run_group_safely, on_stop=self.sink.close)
        loops += self.sink.start(state_bytes, slot_tokens)
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def alive(self) -> bool:
        return bool(self._threads) and all(thread.is_alive() for thread in self._threads)

    def stop(self, timeout: float = 5.0) -> None:
        self.scheduler.stop()
        for thread in self._threads:
            thread.join(timeout)

    def submit(self, request: GenRequest) -> None:
        self.scheduler.submit(request)

    @property
    def num_queue_reqs(self) -> int:
        return self.scheduler.num_queue_reqs

    def gen_throughput(self, window_s: float = 5.0) -> float:
        return self.metrics.gen_throughput(window_s)

    def writer_description(self) -> str:
        """How captured segments are written, for /server_info."""
        return self.sink.describe()

    # ---- the model (on the worker thread) ---------------------------------------------

    def _run_group_safely(self, group: list[GenRequest]) -> None:
        completions = [Completion(req) for req in group]
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
            self.hooks.set(False)

    def _forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, cache: Any,
                 keep: Any = None) -> tuple[Any, Any]:
        info = self.info
        kwargs: dict[str, Any] = {
            "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "use_cache": True, info.cache_kw: cache,
        }
        if keep is not None and info.has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(**kwargs)
        new_cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits, new_cache

    def _run_group(self, group: list[GenRequest], completions: list[Completion]) -> None:
        import torch

        device = self.device
        lengths = [len(req.input_ids) for req in group]
        width = max(lengths)
        batch = len(group)
        input_ids = torch.full((batch, width), self.info.pad_token_id, dtype=torch.long)
        for row, req in enumerate(group):
            input_ids[row, : lengths[row]] = torch.tensor(req.input_ids, dtype=torch.long)
        host_ids = input_ids  # the captured ids come from here: no device-to-host copy, no sync
        capture_rows = [row for row, req in enumerate(group) if req.capture]
        self.metrics.count_prefill(group)

        with torch.inference_mode():
            if self._run_graphed_prefill(group, completions, lengths, host_ids, capture_rows):
                return
            # The graphs build their own mask; the eager forward takes transformers' 2-D one.
            mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
            input_ids, mask = input_ids.to(device), mask.to(device)
            positions = torch.arange(width, device=device).unsqueeze(0).expand(batch, -1)
            # Logits only where a next token is needed: the last real position of each row.
            keep_positions = sorted(set(n - 1 for n in lengths))
            keep = torch.tensor(keep_positions, device=device) if self.info.has_logits_to_keep else None
            store = self.hooks.set(bool(capture_rows) and self.capture is not None)
            logits, cache = self._forward(input_ids, mask, positions, None, keep)
            self.hooks.set(False)
            if capture_rows:
                self.sink.queue_rows(completions, capture_rows, lengths, host_ids, store)
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
            self.sink.queue_batch(completions, capture_rows, lengths, host_ids, states)
        self._decode(group, completions, lengths, None, None, None)  # prefill only: no logits needed
        return True

    def _decode(self, group, completions, lengths, mask, cache, last_logits) -> None:
        import torch

        device, eos_token_ids, pad_token_id = self.device, self.info.eos_token_ids, self.info.pad_token_id
        generators = [make_generator(req.params.seed) for req in group]
        generated = [0] * len(group)
        active = list(range(len(group)))  # group rows still decoding, in cache-row order
        # max_new_tokens == 0: prefill only (capture), no token. Done when the GPU has run the forward:
        # a captured row's reply already waits for its copy; the others go to the prefill waiter.
        prefill_only = [row for row in active if group[row].params.max_new_tokens == 0]
        finish = {"type": "length", "length": 0}
        waiting = [(completions[row], finish) for row in prefill_only if not group[row].capture]
        self.scheduler.answer_when_computed(waiting, str(device).startswith("cuda"))
        for row in prefill_only:
            if group[row].capture:
                completions[row].finish_generation(finish=finish)
        active = [row for row in active if group[row].params.max_new_tokens > 0]
        logits_rows = list(range(len(group)))  # row of last_logits for each group row
        while active:
            next_tokens: dict[int, int] = {}
            for row in active:
                req = group[row]
                next_tokens[row] = pick_token(last_logits[logits_rows.index(row)], req.params, generators[row])
            self.metrics.count_tokens([group[r] for r in active], [1] * len(active))
            still: list[int] = []
            for row in active:
                token = next_tokens[row]
                generated[row] += 1
                req = group[row]
                req.emit(TokenEvent([token]))
                params = req.params
                if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
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
            step_ids = torch.tensor([[next_tokens.get(r, pad_token_id)] for r in logits_rows],
                                    dtype=torch.long, device=device)
            step_pos = torch.tensor([[lengths[r] + generated[r] - 1] for r in logits_rows],
                                    dtype=torch.long, device=device)
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)], dim=1)
            logits, cache = self._forward(step_ids, mask, step_pos, cache, 1)
            last_logits = logits[:, -1]
            active = still
