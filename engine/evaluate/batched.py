"""Batched greedy and batched EAGLE-3 speculative decoding on the lean runner: N requests in flight.

What "concurrency N" means here (local backend): N requests decoded together as one static batch
(a wave): one target forward per step for all of them, each row at its own length (per-row RoPE
positions, per-row causal masks over one static KV cache [layers, 2, N, kv_heads, capacity,
head_dim]); a request leaves the batch when it ends (its cache rows are dropped), so the batch
shrinks as it drains. SGLang's continuous batching refills a slot as soon as it frees; a wave
does not, which both sides share. Speculation: every row drafts the same number of tokens (top-k
1 chain), the target verifies all rows' k+1 tokens in one forward, and each row accepts its own
prefix; the drafter's re-extension over the accepted tokens is padded to the longest row.

Each row's output equals batch-1 greedy decoding token for token (float32; tests check it).
Targets the lean runner cannot reproduce (`fastllama.unsupported_reason`) are not batched here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from engine.evaluate.fastllama import SDPA_GQA, FastLlama, rms_norm, try_fast_target
from engine.errors import EngineError


class BatchError(EngineError, ValueError):
    pass


@dataclass
class BatchResult:
    """One request of a wave."""

    tokens: list[int]
    seconds: float  # from the wave's start to this request's last token (its latency)
    verify_steps: int = 0
    accepted: list[int] = field(default_factory=list)


def _attend(qkv, keys, values, pos, cos, sin, heads, kv_heads, head_dim, mask):
    """qkv [B, t, (h+2kv)*hd] at positions pos [B, t]; caches [B, kv, cap, hd] -> [B, t, h*hd]."""
    b, t = pos.shape
    qk, v = qkv.view(b, t, heads + 2 * kv_heads, head_dim).transpose(1, 2).split([heads + kv_heads, kv_heads], 1)
    first, second = qk.chunk(2, dim=-1)
    qk = qk * cos[:, None] + torch.cat([second, first], dim=-1) * sin[:, None]
    q, k = qk.split([heads, kv_heads], dim=1)
    rows = torch.arange(b, device=pos.device)[:, None].expand(b, t)
    keys.transpose(1, 2)[rows, pos] = k.transpose(1, 2).to(keys.dtype)
    values.transpose(1, 2)[rows, pos] = v.transpose(1, 2).to(values.dtype)
    end = mask.shape[-1]
    keys, values = keys[:, :, :end], values[:, :, :end]
    if heads == kv_heads:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    elif SDPA_GQA:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    else:
        group = heads // kv_heads
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
                                             attn_mask=mask)
    return out.transpose(1, 2).reshape(b, t, heads * head_dim)


def _positions(starts: torch.Tensor, t: int):
    pos = starts[:, None] + torch.arange(t, device=starts.device)[None, :]
    end = int(pos.max()) + 1
    mask = (torch.arange(end, device=starts.device)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, t, end]
    return pos, mask


class BatchTarget:
    """The target over a batched static cache; lengths are kept by the caller."""

    def __init__(self, runner: FastLlama, batch: int, capacity: int):
        runner.reserve(capacity)  # RoPE tables
        self.r = runner
        self.cache = torch.zeros(len(runner.layers), 2, batch, runner.kv_heads, capacity, runner.head_dim,
                                 device=runner.device, dtype=runner.dtype)

    def keep(self, rows: torch.Tensor) -> None:
        self.cache = self.cache[:, :, rows]

    def forward(self, ids: torch.Tensor, starts: torch.Tensor, aux_layers: Sequence[int] = ()):
        """ids [B, t] at positions starts[b]..; -> logits [B, t, V], aux [B, t, 3H] | None."""
        r = self.r
        pos, mask = _positions(starts, ids.shape[1])
        cos, sin = r.cos[pos], r.sin[pos]
        x = F.embedding(ids, r.embed)
        wanted = {int(j) for j in aux_layers}
        captured = {0: x} if 0 in wanted else {}
        for i, (n_in, e_in, w_qkv, wo_t, n_post, e_post, w_gu, wd_t) in enumerate(r.blocks):
            out = _attend(F.linear(rms_norm(x, n_in, e_in), w_qkv), self.cache[i, 0], self.cache[i, 1], pos, cos,
                          sin, r.heads, r.kv_heads, r.head_dim, mask)
            x = x + out @ wo_t
            gate, up = F.linear(rms_norm(x, n_post, e_post), w_gu).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ wd_t
            if i + 1 in wanted:
                captured[i + 1] = x
        logits = F.linear(rms_norm(x, r.final_norm, r.final_eps), r.lm_head)
        aux = torch.cat([captured[int(j)] for j in aux_layers], dim=-1) if wanted else None
        return logits, aux


class BatchDrafter:
    """The drafter (one decoder layer) over a batched flat cache, as specdec.DraftRunner per row."""

    def __init__(self, runner, batch: int, capacity: int):
        runner.reserve(capacity)
        self.r = runner
        self.cache = torch.zeros(2, batch, runner.kv_heads, runner.capacity, runner.head_dim,
                                 device=runner.qkv.device, dtype=runner.qkv.dtype)

    def keep(self, rows: torch.Tensor) -> None:
        self.cache = self.cache[:, rows]

    def extend(self, ids: torch.Tensor, feature: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        r = self.r
        pos, mask = _positions(starts, ids.shape[1])
        norms = r.norms
        embeds = F.embedding(ids, r.embed).to(feature.dtype)
        x = torch.cat([rms_norm(embeds, *norms["input"]), rms_norm(feature, *norms["hidden"])], dim=-1)
        out = _attend(F.linear(x, r.qkv), self.cache[0], self.cache[1], pos, r.cos[pos], r.sin[pos], r.heads,
                      r.kv_heads, r.head_dim, mask)
        hidden = feature + out @ r.o_t
        gate, up = F.linear(rms_norm(hidden, *norms["post"]), r.gate_up).chunk(2, dim=-1)
        return hidden + (F.silu(gate) * up) @ r.down_t

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, 1, H] -> draft token ids [B, 1] (target ids)."""
        logits = F.linear(rms_norm(hidden[:, -1], *self.r.norms["final"]), self.r.lm_head)
        return self.r.hot_ids[logits.argmax(-1)][:, None]


def _runner(target) -> FastLlama:
    runner = try_fast_target(target)
    if runner is None:
        from engine.evaluate.fastllama import unsupported_reason

        raise BatchError(f"batched decoding needs the lean runner ({unsupported_reason(target) or 'switched off'})")
    return runner


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded(rows: list[list[int]], device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)


@torch.inference_mode()
def batched_greedy(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   stop_ids: Sequence[int] = ()) -> list[BatchResult]:
    """Greedy decoding of all prompts together; per request its tokens and latency."""
    runner = _runner(target)
    device = runner.device
    stop = frozenset(stop_ids)
    n = len(prompts)
    _sync(device)
    started = time.perf_counter()
    lens = torch.tensor([len(p) for p in prompts], device=device)
    session = BatchTarget(runner, n, 2 * int(lens.max()) + max_new_tokens + 4)
    logits, _ = session.forward(_padded([list(p) for p in prompts], device), torch.zeros_like(lens))
    last = logits[torch.arange(n, device=device), lens - 1].argmax(-1)
    out = [BatchResult([], 0.0) for _ in range(n)]
    alive = list(range(n))  # request index of each batch row
    while True:
        for row, token in enumerate(last.tolist()):
            out[alive[row]].tokens.append(token)
        keep = [row for row, i in enumerate(alive)
                if not (out[i].tokens[-1] in stop or len(out[i].tokens) >= max_new_tokens)]
        if len(keep) < len(alive):
            now = time.perf_counter() - started
            for row, i in enumerate(alive):
                if row not in keep:
                    out[i].seconds = now
            if not keep:
                break
            index = torch.tensor(keep, device=device)
            session.keep(index)
            last, lens = last[index], lens[index]
            alive = [alive[row] for row in keep]
        logits, _ = session.forward(last[:, None], lens)
        lens = lens + 1
        last = logits[:, -1].argmax(-1)
    _sync(device)
    return out


@torch.inference_mode()
def batched_speculative(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int, num_steps: int,
                        aux_layers: Sequence[int], stop_ids: Sequence[int] = ()) -> list[BatchResult]:
    """EAGLE-3 chain speculation (top-k 1) for all prompts together; each row equals greedy."""
    from engine.evaluate.specdec import DraftRunner

    if num_steps < 1:
        raise BatchError(f"spec_steps is {num_steps}; it must be at least 1")
    runner = _runner(target)
    device = runner.device
    dtype = drafter.fc.weight.dtype
    stop = frozenset(stop_ids)
    n = len(prompts)
    _sync(device)
    started = time.perf_counter()
    lens = torch.tensor([len(p) for p in prompts], device=device)
    capacity = 2 * int(lens.max()) + max_new_tokens + 2 * num_steps + 4
    session = BatchTarget(runner, n, capacity)
    drafts_runner = BatchDrafter(DraftRunner(drafter, capacity), n, capacity)
    rows = torch.arange(n, device=device)
    logits, aux = session.forward(_padded([list(p) for p in prompts], device), torch.zeros_like(lens), aux_layers)
    last = logits[rows, lens - 1].argmax(-1)  # [B] newest token, not yet fed to the target
    # Draft prefill: index t reads the features of token t and the embedding of token t+1.
    draft_ids = _padded([list(p[1:]) + [0] for p in prompts], device)
    draft_ids[rows, lens - 1] = last
    hidden = drafts_runner.extend(draft_ids, drafter.project(aux.to(dtype)), torch.zeros_like(lens))
    hidden = hidden[rows, lens - 1][:, None]  # [B, 1, H]
    committed = lens.clone()  # target positions fed = drafter entries holding a target feature
    out = [BatchResult([tok], 0.0, 0, [0] * num_steps) for tok in last.tolist()]
    alive = list(range(n))

    def drop(done_rows: list[int]) -> bool:
        nonlocal last, committed, hidden, alive
        if not done_rows:
            return True
        now = time.perf_counter() - started
        for row in done_rows:
            out[alive[row]].seconds = now
        keep = [row for row in range(len(alive)) if row not in done_rows]
        if not keep:
            return False
        index = torch.tensor(keep, device=device)
        session.keep(index)
        drafts_runner.keep(index)
        last, committed, hidden = last[index], committed[index], hidden[index]
        alive = [alive[row] for row in keep]
        return True

    ended = [row for row, i in enumerate(alive) if out[i].tokens[-1] in stop or len(out[i].tokens) >= max_new_tokens]
    running = drop(ended)
    while running:
        b = len(alive)
        drafts, chain, at = [], hidden, committed
        for j in range(num_steps):
            drafts.append(drafts_runner.propose(chain))
            if j + 1 < num_steps:
                chain = drafts_runner.extend(drafts[-1], chain, at)
                at = at + 1
        verify_ids = torch.cat([last[:, None]] + drafts, dim=1)  # [B, k+1]
        logits, aux = session.forward(verify_ids, committed, aux_layers)
        choices_t = logits.argmax(-1)  # [B, k+1]
        both = torch.cat([verify_ids[:, 1:], choices_t], dim=1).tolist()  # the one host sync of this step
        accepted = []
        ended = []
        for row in range(b):
            drafted, choices = both[row][:num_steps], both[row][num_steps:]
            m = 0
            while m < num_steps and drafted[m] == choices[m]:
                m += 1
            result = out[alive[row]]
            result.verify_steps += 1
            for i in range(m):
                result.accepted[i] += 1
            for token in choices[: m + 1]:
                result.tokens.append(token)
                if token in stop or len(result.tokens) >= max_new_tokens:
                    ended.append(row)
                    break
            accepted.append(m)
        m_t = torch.tensor(accepted, device=device)
        width = max(accepted) + 1
        # Roll every row forward to its accepted tokens (rows that ended are dropped right after).
        hidden_all = drafts_runner.extend(choices_t[:, :width], drafter.project(aux[:, :width].to(dtype)), committed)
        hidden = hidden_all[torch.arange(b, device=device), m_t][:, None]
        last = choices_t[torch.arange(b, device=device), m_t]
        committed = committed + m_t + 1
        running = drop(ended)
    _sync(device)
    return out
