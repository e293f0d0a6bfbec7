"""Sampling parameters and the choice of the next token (SGLang's defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingParams:
    max_new_tokens: int = 128  # SGLang's default
    temperature: float = 1.0  # SGLang's default; 0 means greedy
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    seed: int | None = None


def make_generator(seed: int | None) -> Any:
    """A CPU generator for a seeded request; None draws from torch's global one."""
    import torch

    if seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    return generator


def pick_token(logits: Any, params: SamplingParams, generator: Any) -> int:
    """The next token from one row's logits: greedy, or temperature, top-k and top-p sampling."""
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
