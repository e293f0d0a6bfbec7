"""Single-stream decode throughput through the streaming `/generate` endpoint."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeBench:
    tokens: int
    seconds: float  # first token to last token
    ttft_s: float  # request sent to first token

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - 1) / self.seconds if self.seconds > 0 and self.tokens > 1 else 0.0


async def decode_benchmark(client, input_ids: list[int], max_new_tokens: int = 64) -> DecodeBench:
    """Greedy-decode `max_new_tokens` and time the stream; the first token's latency is excluded."""
    sent = time.perf_counter()
    first = last = None
    count = 0
    async for chunk in client.generate_stream(input_ids=input_ids, max_new_tokens=max_new_tokens, temperature=0.0):
        now = time.perf_counter()
        produced = int(chunk.meta.get("completion_tokens", count))
        if produced > count:
            count = produced
            first = first or now
            last = now
    if first is None or last is None:
        return DecodeBench(0, 0.0, 0.0)
    return DecodeBench(count, last - first, first - sent)
