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

Speed: both decodes run the target through `engine.evaluate.fastllama` (a lean forward over a
static KV cache) when it reproduces the model, else through transformers' forward with a
DynamicCache; the baseline and speculative decoding always use the same one. Draft tokens stay on
the device, so a verify step costs one host sync (greedy: one per token).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.evaluate.fastllama import (
    MIN_CAPACITY,
    FastLlama,
    attend,
    grown,
    offset_causal,
    rms_norm,
    rope_tables,
    try_fast_target,
)
from engine.train.model import Eagle3Drafter
from engine.errors import EngineError


class SpecDecodeError(EngineError, ValueError):
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
    """transformers hidden_states indices of the aux layers: 1 .. L-1 (outputs of layers 0 .. L-2);
    hidden_states[L] is post-norm."""
    layers = [int(x) for x in layers]
    if len(layers) != 3:
        raise SpecDecodeError(f"the drafter export names {len(layers)} aux layers ({layers}); EAGLE-3 needs 3: "
                              "re-export the drafter (train stage)")
    bad = [x for x in layers if not 1 <= x <= num_layers - 1]
    if bad:
        raise SpecDecodeError(f"aux layers at hidden_states{layers} must lie in 1..{num_layers - 1} for a "
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


def _fused_draft_weights(drafter: Eagle3Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k/v and gate/up fused once per drafter (kept on it), not once per decode: for a drafter
    of an 8B target that is a 0.4 GB copy saved per prompt. Rebuilt when a source weight changes."""
    attn, mlp = drafter.midlayer.self_attn, drafter.midlayer.mlp
    sources = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight)
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in sources)
    cached = getattr(drafter, "_eagle3_fused_weights", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    with torch.no_grad():
        qkv = torch.cat(sources[:3]).detach()
        gate_up = torch.cat(sources[3:]).detach()
    setattr(drafter, "_eagle3_fused_weights", (key, qkv, gate_up))  # a plain attribute, not a submodule
    return qkv, gate_up


class DraftRunner:
    """The drafter at inference: one flat KV cache (index = RoPE position), causal attention.

    The cache is preallocated ([2, 1, kv_heads, capacity, head_dim], at least doubled when full),
    RoPE tables are built once, q/k/v and gate/up are fused, and draft tokens stay on the device
    (`propose_token`), so a draft chain needs no host sync. Weights are read when the runner is
    made (one runner per decode)."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int = MIN_CAPACITY):
        cfg, mid = drafter.cfg, drafter.midlayer
        self.d = drafter
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv, self.gate_up = _fused_draft_weights(drafter)
        self.o_t, self.down_t = mid.self_attn.o_proj.weight.detach().t(), mid.mlp.down_proj.weight.detach().t()
        self.embed = drafter.embed_tokens.weight.detach()
        self.norms = {name: (norm.weight.detach(), norm.eps) for name, norm in (
            ("input", mid.input_layernorm), ("hidden", mid.hidden_norm), ("post", mid.post_attention_layernorm),
            ("final", drafter.norm))}
        self.lm_head = drafter.lm_head.weight.detach()
        device = self.qkv.device
        # As engine.train.model.rope_cos_sin computes it, so positions match training bit for bit.
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, self.head_dim, 2, device=device,
                                                               dtype=torch.float32) / self.head_dim))
        d2t = drafter.d2t
        self.hot_ids = d2t + torch.arange(d2t.shape[0], device=d2t.device)
        self.length = 0
        self.capacity = 0
        self.cache: torch.Tensor | None = None  # [2 (k, v), 1, kv_heads, capacity, head_dim]
        self.reserve(capacity)

    def reserve(self, length: int) -> None:
        """Room for `length` positions in the cache and rope tables (grown, never shrunk)."""
        if length <= self.capacity:
            return
        capacity = grown(self.capacity, length)
        cache = torch.zeros(2, 1, self.kv_heads, capacity, self.head_dim, device=self.qkv.device,
                            dtype=self.qkv.dtype)
        if self.cache is not None:
            cache[..., : self.capacity, :] = self.cache
        self.cache, self.capacity = cache, capacity
        self.keys, self.values = cache[0], cache[1]
        self.cos, self.sin = rope_tables(self.inv_freq, capacity, self.qkv.dtype)

    def crop(self, keep: int) -> None:
        self.length = min(self.length, keep)

    def extend(self, input_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """Tokens [1, T] and features [1, T, H] at the next T positions -> pre-norm outputs [1, T, H]."""
        t = input_ids.shape[1]
        start, end = self.length, self.length + t
        self.reserve(end)
        norms = self.norms
        feature = feature[0]
        embeds = F.embedding(input_ids[0], self.embed).to(feature.dtype)
        x = torch.cat([rms_norm(embeds, *norms["input"]), rms_norm(feature, *norms["hidden"])], dim=-1)
        mask = offset_causal(t, start, x.device)
        out = attend(F.linear(x, self.qkv), self.keys, self.values, start, self.cos[start:end],
                     self.sin[start:end], self.heads, self.kv_heads, self.head_dim, mask)
        hidden = torch.addmm(feature, out, self.o_t)
        gate, up = F.linear(rms_norm(hidden, *norms["post"]), self.gate_up).chunk(2, dim=-1)
        hidden = torch.addmm(hidden, F.silu(gate) * up, self.down_t)
        self.length = end
        return hidden[None]

    def propose_token(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft token (a target id) from a pre-norm output [1, 1, H], as a device tensor [1, 1]."""
        logits = F.linear(rms_norm(hidden[0, -1:], *self.norms["final"]), self.lm_head)
        return self.hot_ids[logits.argmax(-1)].view(1, 1)

    def propose(self, hidden: torch.Tensor) -> int:
        """The same as a Python int (one host sync)."""
        return int(self.propose_token(hidden))


class _FastTarget:
    """One decode on the lean runner: the cache length is all the state a crop needs."""

    def __init__(self, runner: FastLlama, capacity: int):
        runner.reserve(capacity)
        self.runner, self.length = runner, 0

    def forward(self, input_ids: torch.Tensor, aux_layers: Sequence[int] = (), all_logits: bool = False):
        logits, aux = self.runner.forward(input_ids, self.length, aux_layers, all_logits)
        self.length += input_ids.shape[1]
        return logits[0], aux

    def crop(self, keep: int) -> None:
        self.length = min(self.length, keep)


class _HFTarget:
    """One decode on transformers' own forward with a DynamicCache (the fallback and the reference)."""

    def __init__(self, target):
        self.target, self.cache = target, new_cache(target)

    def forward(self, input_ids: torch.Tensor, aux_layers: Sequence[int] = (), all_logits: bool = False):
        out = forward(self.target, input_ids, self.cache, hidden_states=bool(aux_layers))
        logits = out.logits[0] if all_logits else out.logits[0, -1:]
        return logits, (aux_features(out.hidden_states, aux_layers) if aux_layers else None)

    def crop(self, keep: int) -> None:
        crop_cache(self.cache, keep)


def open_target(target, capacity: int):
    """The lean runner when it reproduces this target, else transformers' forward (same interface:
    `forward(ids [1, t], aux_layers, all_logits) -> (logits [t or 1, V], aux [1, t, 3H] | None)`)."""
    runner = try_fast_target(target)
    return _FastTarget(runner, capacity) if runner is not None else _HFTarget(target)


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
    session = open_target(target, len(prompt_ids) + max_new_tokens + 1)
    logits, _ = session.forward(torch.tensor([list(prompt_ids)], device=device))
    last = logits[-1:].argmax(-1)  # [1], stays on the device as the next input
    token = int(last)
    tokens = [token]
    while not _stopped(token, len(tokens), max_new_tokens, stop):
        logits, _ = session.forward(last.view(1, 1))
        last = logits[-1:].argmax(-1)
        token = int(last)
        tokens.append(token)
    _sync(device)
    return DecodeResult(tokens, time.perf_counter() - started)


@torch.inference_mode()
def speculative_decode(target, drafter: Eagle3Drafter, prompt_ids: Sequence[int], max_new_tokens: int,
                       num_steps: int, aux_layers: Sequence[int], stop_ids: Sequence[int] = (),
                       on_verify: Callable[[int], None] | None = None) -> DecodeResult:
    """Greedy EAGLE-3 decoding; the output equals `greedy_decode` token for token.

    `num_steps` draft tokens per verify step; `aux_layers` as transformers hidden_states indices (ours + 1). Drafts stay on the
    device: one host sync per verify step (reading drafts and the target's choices together).
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

    capacity = len(prompt_ids) + max_new_tokens + num_steps + 2
    session = open_target(target, capacity)
    ids = torch.tensor([list(prompt_ids)], device=device)
    logits, aux = session.forward(ids, aux_layers)
    last = logits[-1:].argmax(-1).view(1, 1)  # the newest token, not yet fed to the target
    token = int(last)
    tokens = [token]
    runner = DraftRunner(drafter, capacity)
    # Draft prefill: index t reads the features of token t and the embedding of token t+1.
    hidden = runner.extend(torch.cat([ids[:, 1:], last], dim=1), drafter.project(aux.to(dtype)))[:, -1:]
    committed = runner.length  # = target positions holding a feature (the last token is not fed yet)
    verify_steps, accepted = 0, [0] * num_steps

    while not _stopped(token, len(tokens), max_new_tokens, stop):
        drafts = []
        chain = hidden
        for j in range(num_steps):
            drafts.append(runner.propose_token(chain))
            if j + 1 < num_steps:
                chain = runner.extend(drafts[-1], chain)
        verify_ids = torch.cat([last] + drafts, dim=1)
        logits, aux = session.forward(verify_ids, aux_layers, all_logits=True)
        choices_t = logits.argmax(-1)  # [k + 1]
        both = torch.cat([verify_ids[0, 1:], choices_t]).tolist()  # the one host sync of this step
        drafted, choices = both[:num_steps], both[num_steps:]
        m = 0
        while m < num_steps and drafted[m] == choices[m]:
            m += 1
        verify_steps += 1
        for i in range(m):
            accepted[i] += 1
        if on_verify is not None:
            on_verify(m)
        for new in choices[: m + 1]:  # accepted drafts equal the target's choices, then the bonus
            token = new
            tokens.append(token)
            if _stopped(token, len(tokens), max_new_tokens, stop):
                break
        else:  # all m+1 tokens kept: roll both caches forward to them
            session.crop(committed + 1 + m)
            runner.crop(committed)
            hidden = runner.extend(choices_t[None, : m + 1], drafter.project(aux[:, : m + 1].to(dtype)))[:, -1:]
            last = choices_t[m:m + 1].view(1, 1)
            committed = runner.length
            continue
        break
    _sync(device)
    return DecodeResult(tokens, time.perf_counter() - started, verify_steps, accepted)
