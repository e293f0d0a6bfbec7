"""CUDA graphs for the local server's prefill-only batches (extraction, `max_new_tokens` 0).

A small target's prefill is bound by kernel launches on the host, not by the GPU (measured in
bench/RESULTS.md, capture overhead, session 6), and every bit of Python the capture adds in the
server process comes out of the same interpreter. Replaying a captured graph launches the whole
forward at once.

How: batches are padded to a bucket (rows: next power of two up to `max_batch`; tokens: next
multiple of 128) and run through the decoder alone (no LM head, no KV cache: a prefill-only
request needs neither) with an explicit [B, 1, L, L] boolean mask, which keeps transformers' mask
code free of host syncs. The capture hooks fire while a bucket is captured, so the tensors they
record become the graph's static outputs, refreshed by every replay. All buckets share one memory
pool; a replay's outputs are read (concatenated, cloned) before the next replay. Buckets over
`max_tokens` stay eager: a batch that large keeps the GPU busy by itself and would pin a lot of
memory. A bucket whose capture fails turns the graphs off for good and the batch runs eagerly.

EAGLE3_PREFILL_GRAPH_TOKENS sets `max_tokens` (default 8192; 0 turns the graphs off).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TOKENS = 8192
TOKEN_STEP = 128


def graph_token_limit() -> int:
    """EAGLE3_PREFILL_GRAPH_TOKENS if it is a whole number >= 0, else the default."""
    raw = os.environ.get("EAGLE3_PREFILL_GRAPH_TOKENS", "").strip()
    if raw.isdigit():
        return int(raw)
    if raw:
        print(f"EAGLE3_PREFILL_GRAPH_TOKENS={raw!r} is not a whole number of tokens; using "
              f"{DEFAULT_MAX_TOKENS} (0 turns prefill graphs off)", file=sys.stderr)
    return DEFAULT_MAX_TOKENS


def bucket_for(rows: int, width: int, max_batch: int, max_tokens: int) -> tuple[int, int] | None:
    """The padded (rows, tokens) shape a batch runs in, or None if it should run eagerly."""
    if rows < 1 or width < 1 or rows > max_batch:
        return None
    padded_rows = 1
    while padded_rows < rows:
        padded_rows *= 2
    padded_rows = min(padded_rows, max_batch)
    padded_width = -(-width // TOKEN_STEP) * TOKEN_STEP
    if padded_rows * padded_width > max_tokens:
        return None
    return padded_rows, padded_width


def padding_mask(torch: Any, lengths: Any, width: int) -> Any:
    """[B, 1, W, W] bool: query i of row b sees key j iff j <= i and j < lengths[b] (right padding).
    A padded query still sees its row's real tokens, so no row of the softmax is empty."""
    positions = torch.arange(width, device=lengths.device)
    causal = positions.view(1, width) <= positions.view(width, 1)
    real_keys = positions.view(1, width) < lengths.view(-1, 1)
    return (causal.unsqueeze(0) & real_keys.unsqueeze(1)).unsqueeze(1)


@dataclass
class _Graph:
    graph: Any
    input_ids: Any  # static [B, L] int64
    lengths: Any  # static [B] int64
    outputs: dict[str, Any]  # hook key -> static [B, L, ...] tensor


class PrefillGraphs:
    """Captures and replays the decoder's prefill for each bucket; `run` returns the hooks' states."""

    def __init__(self, decoder: Any, device: str, max_batch: int, pad_token_id: int,
                 set_hooks: Callable[[bool], dict[str, Any]], max_tokens: int | None = None) -> None:
        self.decoder = decoder
        self.device = device
        self.max_batch = max_batch
        self.pad_token_id = pad_token_id
        self.set_hooks = set_hooks  # (active) -> the hook store, emptied
        self.max_tokens = graph_token_limit() if max_tokens is None else max_tokens
        self.enabled = self.max_tokens > 0 and str(device).startswith("cuda")
        self.failure: str | None = None
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None

    def describe(self) -> dict[str, Any]:
        """For /server_info: whether prefill-only batches replay graphs, and which buckets exist."""
        return {"enabled": self.enabled, "max_tokens": self.max_tokens, "failure": self.failure,
                "buckets": [f"{rows}x{tokens}" for rows, tokens in sorted(self._graphs)]}

    def bucket(self, rows: int, width: int) -> tuple[int, int] | None:
        if not self.enabled:
            return None
        return bucket_for(rows, width, self.max_batch, self.max_tokens)

    def forward_static(self, input_ids: Any, lengths: Any) -> None:
        """The forward a graph holds: decoder only, explicit mask, no cache (also runs eagerly)."""
        import torch

        width = input_ids.shape[1]
        positions = torch.arange(width, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
        self.decoder(input_ids=input_ids, attention_mask=padding_mask(torch, lengths, width),
                     position_ids=positions, use_cache=False)

    def run(self, host_ids: Any, lengths: list[int]) -> dict[str, Any] | None:
        """Prefill `host_ids` [B, W] (right-padded, on the host) through its bucket's graph; the hooks'
        states, [B, W, ...] views of static outputs valid until the next `run`. None: run it eagerly."""
        import torch

        rows, width = host_ids.shape
        shape = self.bucket(rows, width)
        if shape is None:
            return None
        entry = self._graphs.get(shape)
        if entry is None:
            try:
                entry = self._capture(shape)
            except Exception as exc:  # an op this model or transformers version cannot capture
                from engine.errors import one_line

                self.enabled = False
                self.failure = one_line(exc)
                print(f"prefill CUDA graphs off, running eagerly: capture of bucket {shape} failed ({self.failure})",
                      file=sys.stderr)
                self.set_hooks(False)
                return None
            self._graphs[shape] = entry
        # Pinned staging from the caching host allocator, which keeps a block until its copy has run:
        # a pageable copy would make the host wait for the previous replay to finish.
        padded = torch.empty(shape, dtype=torch.long, pin_memory=True).fill_(self.pad_token_id)
        padded[:rows, :width] = host_ids
        padded_lengths = torch.ones(shape[0], dtype=torch.long, pin_memory=True)  # padding rows: never read
        padded_lengths[:rows] = torch.tensor(lengths, dtype=torch.long)
        entry.input_ids.copy_(padded, non_blocking=True)
        entry.lengths.copy_(padded_lengths, non_blocking=True)
        entry.graph.replay()
        return {key: value[:rows, :width] for key, value in entry.outputs.items()}

    def _capture(self, shape: tuple[int, int]) -> _Graph:
        import torch

        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long, device=self.device)
        lengths = torch.full((shape[0],), shape[1], dtype=torch.long, device=self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (lazy inits, cuBLAS workspaces)
            for _ in range(2):
                self.forward_static(input_ids, lengths)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        store = self.set_hooks(True)
        try:
            # thread_local: the writer and waiter threads may touch CUDA events meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self.forward_static(input_ids, lengths)
            outputs = dict(store)
        finally:
            self.set_hooks(False)
        return _Graph(graph=graph, input_ids=input_ids, lengths=lengths, outputs=outputs)
