"""Mixed precision for the unrolled training step: bf16 compute over fp32 master weights, each weight cast
once and its gradient summed once per step, however many TTT steps use it.

Plain autocast casts each weight once per forward (its cast cache), but autograd then sums the seven
TTT steps' gradients of that bf16 copy in bf16 (six weight-sized adds per weight, each rounded) before
one cast to fp32; and an RMSNorm with an fp32 weight returns fp32, which each projection reading it
casts back to bf16 (and its gradient back to fp32 in backward).

  step_weights(model)  within it, each CastLinear of `model` computes with one bf16 copy of its weight
                       (WeightCast, made at its first use); every use's backward adds its weight gradient
                       into one fp32 buffer (on CUDA inside the GEMM: fp32 output, beta 1) and
                       WeightCast.backward hands that buffer to the fp32 master: one AccumulateGrad (and
                       one DDP hook) per weight and step, fp32 accumulation throughout.
  stacked_linears      q/k/v (and gate/up) as one GEMM over their stacked bf16 copies, x's gradient one GEMM
                       (EAGLE3_TRAIN_SEPARATE_PROJECTIONS=1: one per projection, for A/B measurements).
  swiglu               silu(gate) * up over the stacked gate/up output: one fused kernel each way, fp32
                       inside, its backward writing the stacked gradient directly (no cat of two halves).
  rms_norm             fp32 statistics, output in the compute dtype, its own backward that saves only x
                       and 1/rms (fused by torch.compile on CUDA, eager elsewhere or if compiling fails).

EAGLE3_TRAIN_PLAIN_AUTOCAST=1 turns these off, and every compiled_or_eager kernel (RoPE in engine.train.model,
the fused head's norm in engine.train.loss, swiglu): the previous path (plain autocast, RMSNorm through autograd returning
weight * x_hat in the promoted dtype, eager kernels), for A/B measurements (bench/specforge_training.py --sides
ours/plain-autocast).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable
import torch.nn.functional as F

_BROKEN: list[str] = []  # why the compiled kernels are off (first failure), empty while they work
COMPILE_DEVICES = ("cuda",)  # on the CPU compiling costs more than it saves (tests widen this)


def separate_projections() -> bool:
    """EAGLE3_TRAIN_SEPARATE_PROJECTIONS=1: q/k/v and gate/up as separate GEMMs (the path before
    stacked_linears), for A/B measurements; read at each use."""
    return os.environ.get("EAGLE3_TRAIN_SEPARATE_PROJECTIONS", "").strip() == "1"


def plain_autocast() -> bool:
    """EAGLE3_TRAIN_PLAIN_AUTOCAST=1: the previous mixed precision (read at each use, so one process can A/B)."""
    return os.environ.get("EAGLE3_TRAIN_PLAIN_AUTOCAST", "").strip() == "1"


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on this device type, None where it is off (or the device has none:
    the meta device, on which tests run the step to prove it never reads device data)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off on this device type (nothing to turn off where it has none)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _reason(exc: Exception) -> str:
    """Why a fast path was switched off, for its note: the error's type and first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def compile_dynamic() -> bool | None:
    """torch.compile's `dynamic` for compiled_or_eager: None (automatic: the first record length compiles
    with constant shapes, a second makes only the dimensions that changed symbolic, so the model's widths
    stay constants in the kernels' index arithmetic); EAGLE3_TRAIN_COMPILE_DYNAMIC=all makes every
    dimension symbolic from the start (the previous behaviour, for A/B measurements)."""
    return True if os.environ.get("EAGLE3_TRAIN_COMPILE_DYNAMIC", "").strip() == "all" else None


def compiled_or_eager(fn: Callable, anywhere: bool = False) -> Callable:
    """fn compiled (at the first CUDA call; shapes as compile_dynamic says) for CUDA tensors; fn itself on the CPU or once
    compiling has failed (a machine without Triton or a C compiler must still train, at eager speed).
    Under autograd the compiled fn has a compiled backward too (engine.train.model's RoPE).
    anywhere: compile on every device and under any autocast: the caller chose to (the loss head's
    compile_head)."""
    compiled: dict[bool | None, Callable] = {}

    @functools.wraps(fn)
    def run(*args):
        if _BROKEN or not (anywhere or args[0].device.type in COMPILE_DEVICES and not plain_autocast()):
            return fn(*args)
        try:
            dynamic = compile_dynamic()
            if dynamic not in compiled:
                compiled[dynamic] = torch.compile(fn, dynamic=dynamic)
            return compiled[dynamic](*args)
        except Exception as exc:  # torch.compile raises backend-specific types
            _BROKEN.append(_reason(exc))
            print(f"note: compiled {fn.__name__} unavailable ({_BROKEN[0]}); training continues eagerly",
                  file=sys.stderr, flush=True)
            return fn(*args)

    return run


# ------------------------------------------------------------------------------ fp32 accumulation

FP32_GEMM_BROKEN: list[str] = []


def _note_gemm_failure(exc: Exception) -> None:
    FP32_GEMM_BROKEN.append(_reason(exc))


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 a, b as a new fp32 tensor: on CUDA one GEMM with an fp32 output (the product is never
    rounded to bf16); elsewhere, or where this torch lacks out_dtype, the bf16 product cast up."""
    if a.is_cuda and not FP32_GEMM_BROKEN and a.dtype != torch.float32:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            _note_gemm_failure(exc)
    return (a @ b).float()


def accumulate_fp32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b for bf16 a, b and an fp32 out. On CUDA one GEMM that accumulates into out in fp32 (cuBLAS
    with an fp32 C, beta 1): no bf16 product written and read again by a separate add. Elsewhere, or where
    this torch lacks out_dtype, the product in bf16 then an fp32 add (what autocast + autograd do)."""
    if out.is_cuda and not FP32_GEMM_BROKEN and a.dtype != out.dtype:
        try:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            return
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            _note_gemm_failure(exc)
    out.add_(a @ b)


# ------------------------------------------------------------------------------ weights cast once


class _GradSlot:
    """The fp32 weight gradient of one step, filled by every use's backward (holds no graph: no cycle)."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.grad is None:
            self.grad = matmul_fp32(a, b)
        else:
            accumulate_fp32(self.grad, a, b)

    def take(self, grad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The step's sum, handed over (AccumulateGrad can adopt it without a copy), plus `grad` from uses
        of the copy by plain autograd ops; the slot is empty again."""
        total, self.grad = self.grad, None
        if grad is not None:
            total = grad.to(dtype) if total is None else total.add_(grad)
        return total


class _WeightCast(torch.autograd.Function):
    """master (fp32) -> its copy in the compute dtype; backward returns the slot's fp32 sum once. Autograd
    runs it after every use of the copy (they all depend on it), so the slot is complete by then."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, dtype: torch.dtype, slot: _GradSlot):
        ctx.set_materialize_grads(False)  # the uses return no gradient for the copy: no zeros made
        ctx.slot, ctx.master_dtype = slot, master.dtype
        return master.to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.slot.take(grad, ctx.master_dtype), None, None


class _LinearAccum(torch.autograd.Function):
    """y = x @ w.T with w a WeightCast copy; backward adds x's share of dL/dw into the slot."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, slot: _GradSlot):
        ctx.x_dtype = x.dtype
        x = x.to(weight.dtype)
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        return F.linear(x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_y = grad_y.to(weight.dtype)
        grad_x = (grad_y @ weight).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        ctx.slot.add(grad_y.reshape(-1, grad_y.shape[-1]).T, x.reshape(-1, x.shape[-1]))
        return grad_x, None, None


class _StackedWeightCast(torch.autograd.Function):
    """Several fp32 masters of one input width -> one stacked copy [sum of rows, in] in the compute dtype;
    backward hands each master its rows of the slot's fp32 sum (contiguous views, adopted as they are)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, slot: _GradSlot, *masters: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.slot, ctx.sizes, ctx.master_dtype = slot, [m.shape[0] for m in masters], masters[0].dtype
        stacked = torch.empty(sum(ctx.sizes), masters[0].shape[1], dtype=dtype, device=masters[0].device)
        for rows, master in zip(stacked.split(ctx.sizes), masters):
            rows.copy_(master)
        return stacked

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        total = ctx.slot.take(grad, ctx.master_dtype)
        return (None, None, *(total.split(ctx.sizes) if total is not None else [None] * len(ctx.sizes)))


class CastLinear(nn.Linear):
    """nn.Linear (no bias) whose weight is cast once per step inside step_weights(); a plain Linear outside."""

    _cast_dtype: torch.dtype | None = None
    _cast: tuple[torch.Tensor, _GradSlot] | None = None
    _stack: tuple[torch.Tensor, _GradSlot] | None = None  # stacked_linears' copy, kept on the group's first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cast_dtype is None or self.bias is not None:
            return super().forward(x)
        if self._cast is None:
            slot = _GradSlot()
            self._cast = (_WeightCast.apply(self.weight, self._cast_dtype, slot), slot)
        weight, slot = self._cast
        return _LinearAccum.apply(x, weight, slot)


def stacked_linear(x: torch.Tensor, linears: Sequence[CastLinear]) -> torch.Tensor | None:
    """cat([m(x) for m in linears], -1) as one GEMM over their stacked bf16 copies, for bias-free CastLinears
    of one input width inside step_weights; x's gradient is one GEMM too (not one per linear plus the adds
    that sum them). None where that does not apply (outside step_weights, or separate projections asked)."""
    first = linears[0]
    if separate_projections() or any(m._cast_dtype is None or m.bias is not None for m in linears):
        return None
    if first._stack is None:
        slot = _GradSlot()
        first._stack = (_StackedWeightCast.apply(first._cast_dtype, slot, *(m.weight for m in linears)), slot)
    weight, slot = first._stack
    return _LinearAccum.apply(x, weight, slot)


def stacked_linears(x: torch.Tensor, linears: Sequence[CastLinear]) -> list[torch.Tensor]:
    """[m(x) for m in linears]: stacked_linear's output split, or each linear on its own where it does not apply."""
    stacked = stacked_linear(x, linears)
    if stacked is None:
        return [m(x) for m in linears]
    return list(stacked.split([m.weight.shape[0] for m in linears], dim=-1))


@contextlib.contextmanager
def step_weights(model: nn.Module) -> Iterator[None]:
    """One forward of a training step: the CastLinears of `model` with trainable fp32 weights cast them to
    the autocast dtype once, at first use. Nothing changes without autocast or without grad (evaluation)."""
    params = next(model.parameters(), None)
    device = params.device.type if params is not None else "cpu"
    dtype = autocast_dtype(device)
    if plain_autocast() or not torch.is_grad_enabled() or dtype is None:
        yield
        return
    linears = [m for m in model.modules() if isinstance(m, CastLinear) and m.weight.requires_grad
               and m.weight.dtype != dtype and m.weight.dtype.is_floating_point]
    for m in linears:
        m._cast_dtype, m._cast = dtype, None
    try:
        yield
    finally:
        for m in linears:  # the graph keeps what backward needs; the modules keep nothing
            m._cast_dtype, m._cast, m._stack = None, None, None


# ------------------------------------------------------------------------------ RMSNorm


def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
    acc = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(acc)
    inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * inv * weight.to(acc)).to(out_dtype), inv


def _rms_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, inv: torch.Tensor):
    acc = inv.dtype
    x_hat = x.to(acc) * inv
    g = grad_y.to(acc)
    grad_w = (g * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)
    g_hat = g * weight.to(acc)
    grad_x = inv * (g_hat - x_hat * (g_hat * x_hat).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)


_rms_forward_kernel = compiled_or_eager(_rms_forward)
_rms_backward_kernel = compiled_or_eager(_rms_backward)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
        y, inv = _rms_forward_kernel(x, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, inv)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, inv = ctx.saved_tensors
        grad_x, grad_w = _rms_backward_kernel(grad_y, x, weight, inv)
        return grad_x, grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), statistics in fp32 at least. Under autocast the result is in the autocast dtype
    (what the projections after it compute in); otherwise in the promoted dtype of x and weight."""
    if plain_autocast():
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out_dtype = autocast_dtype(x.device.type) or torch.promote_types(x.dtype, weight.dtype)
    return _RMSNorm.apply(x, weight, eps, out_dtype)


# ------------------------------------------------------------------------------ SwiGLU


def _swiglu_forward(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.to(torch.promote_types(gate_up.dtype, torch.float32)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    g = grad.to(acc)
    sig = torch.sigmoid(gate)
    grad_gate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat([grad_gate, g * gate * sig], dim=-1).to(gate_up.dtype)


_swiglu_forward_kernel = compiled_or_eager(_swiglu_forward)
_swiglu_backward_kernel = compiled_or_eager(_swiglu_backward)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor):
        ctx.save_for_backward(gate_up)
        return _swiglu_forward_kernel(gate_up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return _swiglu_backward_kernel(grad, gate_up)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat([gate, up], -1). Saves only gate_up for backward (eagerly, autograd
    also kept silu(gate)); on CUDA each direction is one compiled kernel computing in fp32 and rounding once."""
    if plain_autocast():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(gate_up)
