"""Training-time-test attention: causal over the step-0 keys plus each position's own keys
from the later steps (the "diagonal").

At TTT step k the query at position t may attend to
  * step-0 keys at positions j <= t (the features the target really produced), and
  * the keys of steps 1..k at the same position t (what the drafter itself produced there).
This is the attention SGLang performs while drafting a chain: step-0 keys are the prefix KV
cache, later keys are the drafted tokens at positions t+1, t+2, ...

Backends:
  flash A fused causal kernel (FlashAttention-2 on CUDA, PyTorch's flash kernel on the CPU) over the
        step-0 keys, merged in log-space with the diagonal scores; its backward gets the merged
        output and log-sum-exp (engine.train.merged_attention). No compilation per length.
  cudnn The same with cuDNN's fused attention as the causal kernel on CUDA (PyTorch's flash kernel
        on the CPU); the default. Where cuDNN's kernel fails its probe, FlashAttention-2 takes over.
  flex  FlexAttention over the concatenated keys with a block mask (GPU; compiled; memory
        linear in T, the diagonal blocks cost k*T*block extra work, not k*T^2).
  sdpa  exact and differentiable everywhere (CPU included): SDPA with causal flash/efficient
        kernels for the step-0 part and the diagonal scores computed directly, merged in
        log-space. The causal part must give its log-sum-exp, which SDPA does not expose, so
        this backend recovers it with a chunked, checkpointed score pass: memory stays
        linear in T (no T x kT mask), at the cost of one extra QK^T product per step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.train.kv_heads import repeat_kv


BACKENDS = ("flash", "cudnn", "sdpa", "flex", "dense")
FUSED_KERNEL_BACKENDS = ("flash", "cudnn")  # engine.train.merged_attention, each with its causal kernel on CUDA
DEFAULT_BACKEND = "cudnn"  # fastest on the H100 at both bench lengths; flash where its probe fails


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown TTT attention backend {name!r} (EAGLE3_TRAIN_ATTENTION): use one of "
                         f"{', '.join(BACKENDS[:4])}; {DEFAULT_BACKEND} is the default")
    return name


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  backend: str = DEFAULT_BACKEND):
    """q [B, h, T, d]; keys/values: one [B, kv, T, d] per step so far (step 0 first)."""
    check_backend(backend)
    if backend in FUSED_KERNEL_BACKENDS:
        from engine.train.merged_attention import merged_ttt_attention, usable_kernel

        kernel = usable_kernel(q, backend)
        if kernel is not None:
            return merged_ttt_attention(q, keys, values, kernel)
        return _sdpa_merge(q, keys, values)  # this device has no such fused kernel: the exact fallback
    if backend == "sdpa":
        return _sdpa_merge(q, keys, values)
    if backend == "flex":
        return _flex(q, keys, values)
    return _dense(q, keys, values)


def _sdpa_merge(q, keys, values):
    """Causal SDPA over step-0 keys, merged in log-space with the diagonal scores.

    With z_c = sum_{j<=t} exp(q.k_j*scale) = exp(lse_c) and diagonal scores s_i:
        out = (z_c * o_c + sum_i e^{s_i} v_i) / (z_c + sum_i e^{s_i}).
    """
    groups = q.shape[1] // keys[0].shape[1]
    scale = q.shape[-1] ** -0.5
    k0, v0 = keys[0], values[0]
    o_c = F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=groups > 1)
    if len(keys) == 1:
        return o_c
    lse_c = causal_lse(q, repeat_kv(k0, groups), scale)  # [B, h, T] fp32
    diag_k = torch.stack([repeat_kv(k, groups) for k in keys[1:]], dim=0)  # [S, B, h, T, d]
    diag_v = torch.stack([repeat_kv(v, groups) for v in values[1:]], dim=0)
    s = (q.unsqueeze(0) * diag_k).sum(-1).float() * scale  # [S, B, h, T]
    all_lse = torch.logsumexp(torch.cat([lse_c.unsqueeze(0), s], dim=0), dim=0)
    w_c = torch.exp(lse_c - all_lse).unsqueeze(-1)
    w_d = torch.exp(s - all_lse.unsqueeze(0)).unsqueeze(-1)
    out = w_c * o_c.float() + (w_d * diag_v.float()).sum(0)
    return out.to(q.dtype)


def causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float, chunk: int = 1024) -> torch.Tensor:
    """log sum_{j<=t} exp(q_t.k_j * scale) for every t, in query chunks (memory chunk x T).

    Each chunk is checkpointed so backward does not keep the [chunk, T] scores either.
    """
    t = q.shape[2]
    outs = []
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)
        if q.requires_grad or k.requires_grad:
            outs.append(torch.utils.checkpoint.checkpoint(_lse_chunk, q[:, :, start:stop], k[:, :, :stop], start,
                                                          scale, use_reentrant=False))
        else:
            outs.append(_lse_chunk(q[:, :, start:stop], k[:, :, :stop], start, scale))
    return torch.cat(outs, dim=-1)


def _lse_chunk(q, k, start: int, scale: float):
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    rows = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
    cols = torch.arange(k.shape[2], device=q.device)[None, :]
    scores = scores.masked_fill(cols > rows, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def _dense(q, keys, values):
    """Reference: one SDPA over all keys with an explicit [T, S*T] mask (tests only: quadratic)."""
    t = q.shape[2]
    groups = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys, dim=2)
    v = torch.cat(values, dim=2)
    rows = torch.arange(t, device=q.device)[:, None]
    cols = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = ((cols < t) & (cols <= rows)) | ((cols >= t) & (cols % t == rows))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)


@functools.lru_cache(maxsize=64)
def _block_mask(t: int, steps: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx < t) & (kv_idx <= q_idx)) | ((kv_idx >= t) & (kv_idx % t == q_idx))

    return create_block_mask(mask_mod, None, None, t, steps * t, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    import torch._dynamo

    # Record lengths vary: let dynamo switch to a dynamic-shape kernel after the first recompile
    # instead of hitting the recompile limit and falling back to the unfused (quadratic) path.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=None)


def _flex(q, keys, values):
    t = q.shape[2]
    groups = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys, dim=2)
    v = torch.cat(values, dim=2)
    mask = _block_mask(t, len(keys), str(q.device))
    fn = _compiled_flex() if q.is_cuda else __import__(
        "torch.nn.attention.flex_attention", fromlist=["flex_attention"]).flex_attention
    return fn(q, k, v, block_mask=mask, enable_gqa=groups > 1)
