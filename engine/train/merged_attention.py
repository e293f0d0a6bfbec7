"""TTT attention from a fused causal kernel plus the diagonal, merged in log space.

The fused kernel (FlashAttention-2 or cuDNN's on CUDA, PyTorch's flash kernel on the CPU) attends over
the step-0 keys and returns its output and log-sum-exp; each query's S diagonal keys (its own position
in TTT steps 1..S) are S dot products. Backward hands the kernel the *merged* output and log-sum-exp:
its P = exp(qk - lse) and D = rowsum(dO * O) are then those of the whole softmax, so the step-0 part's
gradients come out exact with no extra pass over the scores, and the diagonal's are elementwise.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from typing import Callable

import torch

from engine.train.kv_heads import repeat_kv, sum_heads
from engine.train.mixed import compiled_or_eager, no_autocast

aten = torch.ops.aten


@dataclass(frozen=True)
class CausalKernel:
    """A fused causal attention with the two entry points this merge needs."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple]]  # (q, k, v, scale) -> out, lse, state
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (dout, q, k, v, out, lse, state, scale)
    native_gqa: bool = False  # takes fewer key/value heads than query heads; else they are repeated
    # Whether to probe grouped heads at all: a kernel that took them but read past the key/value tensors
    # could fault the device, which no later call survives.
    probe_grouped: bool = True


def _flash_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(dout, q, k, v, out, lse, state, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


def _cudnn_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, state, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    # No bias: None reaches the op as the undefined tensor PyTorch's own autograd passes (an empty
    # tensor is a defined 1-D bias, which the op refuses).
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale)


def _cpu_forward(q, k, v, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, state, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True, scale=scale)


KERNELS = {
    "flash": CausalKernel("flash", _flash_forward, _flash_backward),
    "cudnn": CausalKernel("cudnn", _cudnn_forward, _cudnn_backward, probe_grouped=False),
    "cpu": CausalKernel("cpu", _cpu_forward, _cpu_backward),
}


# A kernel the probe turns down gives way to the next one here before the exact SDPA path.
FALLBACKS = {"cudnn": ("cudnn", "flash"), "flash": ("flash",)}


def kernel_for(device: torch.device, preferred: str = "flash") -> CausalKernel:
    return KERNELS[preferred] if device.type == "cuda" else KERNELS["cpu"]


def usable_kernel(q: torch.Tensor, preferred: str = "flash") -> CausalKernel | None:
    """The first fused kernel for q's device, preferred first, that passes the probe at q's head width and
    dtype, or None where none can run them (FlashAttention-2 needs an Ampere or newer GPU and at most
    256-wide heads, cuDNN's a cuDNN 9 build, say): the caller then takes the exact SDPA path."""
    names = tuple(dict.fromkeys(kernel_for(q.device, name).name for name in FALLBACKS[preferred]))
    for position, name in enumerate(names):
        then = names[position + 1] if position + 1 < len(names) else "the exact SDPA backend"
        kernel = probed_kernel(name, str(q.device), q.shape[-1], q.dtype, then)
        if kernel is not None:
            return kernel
    return None


@functools.lru_cache(maxsize=32)
def probed_kernel(kernel_name: str, device: str, head_dim: int, dtype: torch.dtype,
                  then: str = "the exact SDPA backend") -> CausalKernel | None:
    """Forward and backward at the real head width and dtype checked against a reference, with equal heads
    and then (where probe_grouped) with grouped key/value heads: None if the first fails (the note says the
    run goes on with `then`), the kernel marked native_gqa if the second passes too (else the heads are
    repeated for it)."""
    kernel = KERNELS[kernel_name]
    with torch.enable_grad(), no_autocast(torch.device(device).type):  # the caller may be evaluating, or autocasting
        problem = _probe(kernel, device, head_dim, dtype, kv_heads=PROBE_HEADS)
        native_gqa = (not problem and kernel.probe_grouped
                      and not _probe(kernel, device, head_dim, dtype, kv_heads=PROBE_HEADS // 2))
    if problem:
        print(f"note: {kernel_name} attention unavailable on {device} for {head_dim}-wide {dtype} heads ({problem}); "
              f"training uses {then}", file=sys.stderr, flush=True)
        return None
    return replace(kernel, native_gqa=native_gqa)


PROBE_HEADS, PROBE_TOKENS = 4, 64


def _probe(kernel: CausalKernel, device: str, head_dim: int, dtype: torch.dtype, kv_heads: int) -> str:
    """'' when the kernel's forward (out and log-sum-exp) and backward on PROBE_HEADS query heads over
    kv_heads key/value heads agree with a float64 reference, else what went wrong. Values, not only
    shapes: a kernel that took grouped heads without error but read them wrongly would train on garbage."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, PROBE_TOKENS, head_dim, generator=gen).to(device, dtype)
                     for heads in (PROBE_HEADS, kv_heads, kv_heads, PROBE_HEADS))
    scale = head_dim ** -0.5
    try:
        out, lse, state = kernel.forward(q, k, v, scale)
        grads = kernel.backward(dout, q, k, v, out, lse, state, scale)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if tuple(g.shape for g in grads) != (q.shape, k.shape, v.shape):
        return f"gradient shapes {[tuple(g.shape) for g in grads]} for {tuple(q.shape)}, {tuple(k.shape)}"
    want_out, want_lse, want_grads = _reference(q, k, v, dout, scale)
    if lse.numel() != want_lse.numel() or (lse.double().reshape(want_lse.shape) - want_lse).abs().max() > 0.05:
        return "its log-sum-exp disagrees with the reference"
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want_grads)):
        if (got.double() - want).norm() > 0.03 * want.norm():
            return f"its {name} disagrees with the reference"
    return ""


def _reference(q, k, v, dout, scale):
    """Causal attention in float64 with repeated key/value heads: out, log-sum-exp and (dq, dk, dv)."""
    groups = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    scores = (q64 @ repeat_kv(k64, groups).transpose(-1, -2)) * scale
    t = q.shape[2]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ repeat_kv(v64, groups)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), lse.detach(), grads


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (the merge's arithmetic), float64 kept as it is."""
    return x if x.dtype == torch.float64 else x.float()


def _merge_forward(q, out_c, lse_c, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor], scale: float):
    """The whole softmax from the causal part's (out, lse) and the diagonal keys, in fp32.

    Returns out [B, kv, g, T, d], lse and the diagonal scores s [S, B, kv, g, T]."""
    kv = diag_k[0].shape[1]
    qf = _wide(q.unflatten(1, (kv, -1)))  # [B, kv, g, T, d]: no copy of the keys per group
    s = torch.stack([(qf * _wide(k.unsqueeze(2))).sum(-1) for k in diag_k]) * scale
    lse_c = _wide(lse_c).reshape(s.shape[1:])
    lse = torch.logsumexp(torch.cat([lse_c.unsqueeze(0), s]), dim=0)
    out = _wide(out_c.unflatten(1, (kv, -1))) * torch.exp(lse_c - lse).unsqueeze(-1)
    for i, v in enumerate(diag_v):
        out = out + torch.exp(s[i] - lse).unsqueeze(-1) * _wide(v.unsqueeze(2))
    return out, lse, s


def _diag_backward(dout, q, out, lse, s, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor], scale: float):
    """Gradients of the diagonal terms: (dq from them, [dk_i], [dv_i]), fp32."""
    kv = diag_k[0].shape[1]
    doutf = _wide(dout.unflatten(1, (kv, -1)))
    qf = _wide(q.unflatten(1, (kv, -1)))
    lse = _wide(lse).reshape(s.shape[1:])
    rowdot = (doutf * _wide(out.unflatten(1, (kv, -1)))).sum(-1)  # D = rowsum(dO * O)
    dq = torch.zeros_like(qf)
    dks, dvs = [], []
    for i, (k, v) in enumerate(zip(diag_k, diag_v)):
        p = torch.exp(s[i] - lse)
        dvs.append((p.unsqueeze(-1) * doutf).sum(2))
        ds = p * ((doutf * _wide(v.unsqueeze(2))).sum(-1) - rowdot) * scale
        dq = dq + ds.unsqueeze(-1) * _wide(k.unsqueeze(2))
        dks.append((ds.unsqueeze(-1) * qf).sum(2))
    return dq.flatten(1, 2), dks, dvs


merge_forward = compiled_or_eager(_merge_forward)
diag_backward = compiled_or_eager(_diag_backward)


class MergedTTTAttention(torch.autograd.Function):
    """out = softmax over (causal step-0 keys, this position's keys of steps 1..S) applied to the values."""

    @staticmethod
    def forward(ctx, kernel: CausalKernel, scale: float, q, k0, v0, *diag):
        groups = q.shape[1] // k0.shape[1]
        expand = groups > 1 and not kernel.native_gqa
        kc, vc = (repeat_kv(k0, groups), repeat_kv(v0, groups)) if expand else (k0, v0)
        out_c, lse_c, state = kernel.forward(q, kc, vc, scale)
        half = len(diag) // 2
        diag_k, diag_v = list(diag[:half]), list(diag[half:])
        if diag_k:
            merged, lse_all, s = merge_forward(q, out_c, lse_c, diag_k, diag_v, scale)
            out = torch.empty_like(out_c)  # the kernel's own layout: its backward and o_proj read it cheaply
            out.copy_(merged.flatten(1, 2))
            lse = torch.empty_like(lse_c)
            lse.copy_(lse_all.reshape(lse_c.shape))
        else:
            out, lse, s = out_c, lse_c, None
        ctx.kernel, ctx.scale, ctx.groups, ctx.expand, ctx.state, ctx.half = kernel, scale, groups, expand, state, half
        ctx.save_for_backward(q, k0, v0, out, lse, *([s] if s is not None else []), *diag)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse, *rest = ctx.saved_tensors
        half, groups = ctx.half, ctx.groups
        s = rest[0] if half else None
        diag = rest[1:] if half else []
        diag_k, diag_v = list(diag[:half]), list(diag[half:])
        kc, vc = (repeat_kv(k0, groups), repeat_kv(v0, groups)) if ctx.expand else (k0, v0)
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        dq, dk0, dv0 = ctx.kernel.backward(dout, q, kc, vc, out, lse, ctx.state, ctx.scale)
        if ctx.expand:
            dk0, dv0 = sum_heads(dk0, groups), sum_heads(dv0, groups)
        dks: list = []
        dvs: list = []
        if half:
            dq_diag, dks, dvs = diag_backward(dout, q, out, lse, s, diag_k, diag_v, ctx.scale)
            dq = (_wide(dq) + dq_diag).to(q.dtype)
            dks = [g.to(k.dtype) for g, k in zip(dks, diag_k)]
            dvs = [g.to(v.dtype) for g, v in zip(dvs, diag_v)]
        return (None, None, dq, dk0.to(k0.dtype), dv0.to(v0.dtype), *dks, *dvs)


def merged_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         kernel: CausalKernel | None = None) -> torch.Tensor:
    """q [B, h, T, d]; keys/values: one [B, kv, T, d] per TTT step so far (step 0 first)."""
    kernel = kernel or usable_kernel(q)
    if kernel is None:
        raise RuntimeError(f"no fused causal attention kernel runs on {q.device} for these heads")
    return MergedTTTAttention.apply(kernel, q.shape[-1] ** -0.5, q, keys[0], values[0], *keys[1:], *values[1:])
