"""Greedy EAGLE-3 speculative decoding against a transformers target, and the plain greedy baseline.

One verify step (chain drafting, top-k 1, as SGLang with `--speculative-eagle-topk 1`):

  1. The drafter proposes `k` tokens in a chain. Its first step reads the target's aux
     features; each later step reads the drafter's own pre-norm output from the step before.
  2. The target scores `[last token, d1 .. dk]` in one forward (KV cache kept).
  3. The longest prefix of drafts equal to the target's greedy choices is accepted, plus the
     target's own next token (the "bonus"); the target cache is cropped to what was accepted.
  4. The drafter's chain entries are dropped from its cache and the accepted positions are
     re-run from the target's real features (SGLang's "draft extend").

Alignment (the training convention of engine.train.data): the drafter entry at index t reads the
target's aux features of token t and the embedding of token t+1, sits at RoPE position t and
predicts token t+2. Drafted tokens continue that line: chain step j sits at index/position n-1+j.
So one flat KV cache, whose index equals the RoPE position, serves both the prefix and the chain;
this is exactly the training-time-test attention (engine.train.attention), which
`tests/test_evaluate.py` checks against `Eagle3Drafter.draft_logits`.

Aux layers are SGLang ids: SGLang id j = output of decoder layer j-1 = transformers
`hidden_states[j]` (index 0 is the embedding output). The last index (post final norm) is not
an aux state.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.train.model import Eagle3Drafter, apply_rope, rope_cos_sin


class SpecDecodeError(ValueError):
    """Inputs that cannot be decoded (wrong layers, empty prompt); the message names the fix."""


@dataclass
class DecodeResult:
    tokens: list[int]  # the completion (stop token included when one ended it)
    seconds: float  # wall time of prefill + decode
    verify_steps: int = 0  # speculative only: target verify forwards
    accepted: list[int] = field(default_factory=list)  # per draft position: verify steps that accepted it

    @property
    def acceptance_length(self) -> float | None:
        """SGLang's spec_accept_length: completion tokens / verify steps (bonus token counted)."""
        return len(self.tokens) / self.verify_steps if self.verify_steps else None


def check_aux_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """SGLang aux ids must be 1 .. L-1 (outputs of layers 0 .. L-2); hidden_states[L] is post-norm."""
    layers = [int(x) for x in layers]
    if len(layers) != 3:
        raise SpecDecodeError(f"the drafter export names {len(layers)} aux layers ({layers}); EAGLE-3 needs 3: "
                              "re-export the drafter (train stage)")
    bad = [x for x in layers if not 1 <= x <= num_layers - 1]
    if bad:
        raise SpecDecodeError(f"aux layer ids {layers} (SGLang numbering) must lie in 1..{num_layers - 1} for a "
                              f"{num_layers}-layer target: the drafter was built for another model")
    return layers


def aux_features(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """Concatenate the captured layers low -> high: [B, T, 3H]. `layers` are SGLang ids."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def new_cache(target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def forward(target, input_ids: torch.Tensor, cache, hidden_states: bool = False):
    """One target forward with a KV cache. transformers renamed `past_key_values` to `cache` (v5.x)."""
    kw = getattr(target, "_eagle3_cache_kw", None)
    if kw is None:
        kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        target._eagle3_cache_kw = kw
    return target(input_ids=input_ids, use_cache=True, output_hidden_states=hidden_states, **{kw: cache})


def crop_cache(cache, keep: int) -> None:
    """Keep the first `keep` positions. A negative argument means "remove this many" in every
    transformers version (the positive form was removed in v5)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


class DraftRunner:
    """The drafter at inference: one flat KV cache (index = RoPE position), causal attention."""

    def __init__(self, drafter: Eagle3Drafter):
        self.d = drafter
        self.keys: torch.Tensor | None = None  # [1, kv, S, hd]
        self.values: torch.Tensor | None = None
        self.hot_ids = drafter.d2t + torch.arange(drafter.d2t.shape[0], device=drafter.d2t.device)

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def crop(self, keep: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]

    def extend(self, input_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """Tokens [1, T] and features [1, T, H] at the next T positions -> pre-norm outputs [1, T, H]."""
        d, mid = self.d, self.d.midlayer
        start = self.length
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        embeds = d.embed_tokens(input_ids).to(feature.dtype)
        x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(feature)], dim=-1)
        hidden = feature + self._attend(x, positions)
        return hidden + mid.mlp(mid.post_attention_layernorm(hidden))

    def _attend(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        attn, cfg = self.d.midlayer.self_attn, self.d.cfg
        b, t, _ = x.shape
        hd, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q = attn.q_proj(x).view(b, t, h, hd).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, kv, hd).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, kv, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, hd, cfg.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start = self.length
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        keys, values = self.keys, self.values
        if h != kv:
            keys, values = keys.repeat_interleave(h // kv, dim=1), values.repeat_interleave(h // kv, dim=1)
        mask = None
        if t > 1:  # query i sits at cache index start+i and sees keys 0 .. start+i
            rows = torch.arange(t, device=x.device)[:, None] + start
            mask = torch.arange(keys.shape[2], device=x.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, h * hd))

    def propose(self, hidden: torch.Tensor) -> int:
        """Greedy draft token (a target id) from a pre-norm output [1, 1, H]."""
        draft_id = self.d.logits(hidden)[0, -1].argmax()
        return int(self.hot_ids[draft_id])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stopped(token: int, count: int, max_new_tokens: int, stop_ids: frozenset[int]) -> bool:
    return token in stop_ids or count >= max_new_tokens


@torch.inference_mode()
def greedy_decode(target, prompt_ids: Sequence[int], max_new_tokens: int,
                  stop_ids: Sequence[int] = ()) -> DecodeResult:
    """Plain greedy decoding with a KV cache: the baseline and the reference output."""
    if not prompt_ids:
        raise SpecDecodeError("empty prompt")
    stop = frozenset(stop_ids)
    device = target.device
    _sync(device)
    started = time.perf_counter()
    cache = new_cache(target)
    ids = torch.tensor([list(prompt_ids)], device=device)
    out = forward(target, ids, cache)
    token = int(out.logits[0, -1].argmax())
    tokens = [token]
    while not _stopped(token, len(tokens), max_new_tokens, stop):
        out = forward(target, torch.tensor([[token]], device=device), cache)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    _sync(device)
    return DecodeResult(tokens, time.perf_counter() - started)


@torch.inference_mode()
def speculative_decode(target, drafter: Eagle3Drafter, prompt_ids: Sequence[int], max_new_tokens: int,
                       num_steps: int, aux_layers: Sequence[int], stop_ids: Sequence[int] = (),
                       on_verify: Callable[[int], None] | None = None) -> DecodeResult:
    """Greedy EAGLE-3 decoding; the output equals `greedy_decode` token for token.

    `num_steps` draft tokens per verify step; `aux_layers` in SGLang numbering.
    """
    if not prompt_ids:
        raise SpecDecodeError("empty prompt")
    if num_steps < 1:
        raise SpecDecodeError(f"spec_steps is {num_steps}; it must be at least 1")
    stop = frozenset(stop_ids)
    device = target.device
    dtype = drafter.fc.weight.dtype
    _sync(device)
    started = time.perf_counter()

    cache = new_cache(target)
    ids = torch.tensor([list(prompt_ids)], device=device)
    out = forward(target, ids, cache, hidden_states=True)
    token = int(out.logits[0, -1].argmax())
    tokens = [token]
    runner = DraftRunner(drafter)
    # Draft prefill: index t reads the features of token t and the embedding of token t+1.
    shifted = torch.cat([ids[:, 1:], torch.tensor([[token]], device=device)], dim=1)
    hidden = runner.extend(shifted, drafter.project(aux_features(out.hidden_states, aux_layers).to(dtype)))[:, -1:]
    committed = runner.length  # = target positions holding a feature (the last token is not fed yet)
    verify_steps, accepted = 0, [0] * num_steps

    while not _stopped(token, len(tokens), max_new_tokens, stop):
        drafts = []
        chain = hidden
        for j in range(num_steps):
            drafts.append(runner.propose(chain))
            if j + 1 < num_steps:
                chain = runner.extend(torch.tensor([[drafts[-1]]], device=device), chain)
        out = forward(target, torch.tensor([[token] + drafts], device=device), cache, hidden_states=True)
        choices = out.logits[0].argmax(-1).tolist()
        m = 0
        while m < num_steps and drafts[m] == choices[m]:
            m += 1
        verify_steps += 1
        for i in range(m):
            accepted[i] += 1
        if on_verify is not None:
            on_verify(m)
        for new in drafts[:m] + [choices[m]]:
            token = new
            tokens.append(token)
            if _stopped(token, len(tokens), max_new_tokens, stop):
                break
        else:  # all m+1 tokens kept: roll both caches forward to them
            crop_cache(cache, committed + 1 + m)
            runner.crop(committed)
            feats = aux_features(out.hidden_states, aux_layers)[:, : m + 1].to(dtype)
            nxt = torch.tensor([drafts[:m] + [choices[m]]], device=device)
            hidden = runner.extend(nxt, drafter.project(feats))[:, -1:]
            committed = runner.length
            continue
        break
    _sync(device)
    return DecodeResult(tokens, time.perf_counter() - started, verify_steps, accepted)
