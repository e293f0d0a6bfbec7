"""The head-weight gradient's fp32 accumulation (engine.train.mixed.accumulate_fp32): out += a @ b for
bf16 operands into an fp32 buffer, across chunks and TTT steps."""

from __future__ import annotations

import pytest
import torch

from engine.train import mixed


def _operands(device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(96, 80, generator=g)
    a = torch.randn(96, 512, generator=g).to(torch.bfloat16)
    b = torch.randn(512, 80, generator=g).to(torch.bfloat16)
    return out.to(device), a.to(device), b.to(device)


def test_cpu_path_is_the_bf16_product_added_in_fp32():
    out, a, b = _operands("cpu")
    a = a.T.contiguous().T  # a transposed view, as g_logits.T is
    # The same operand in the reference: CPU bf16 GEMMs round differently by layout (seen on an AVX2 host).
    expected = out + (a @ b).float()
    mixed.accumulate_fp32(out, a, b)
    assert out.dtype == torch.float32 and torch.equal(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_accumulates_into_fp32_in_one_gemm_and_keeps_what_was_there():
    out, a, b = _operands("cuda")
    start = out.clone()
    exact = start.double()
    for seed in (1, 2, 3):  # three chunks / steps into one buffer
        _, a, b = _operands("cuda", seed)
        mixed.accumulate_fp32(out, a.T.contiguous().T, b)
        exact += a.double() @ b.double()
    assert not mixed.FP32_GEMM_BROKEN, mixed.FP32_GEMM_BROKEN  # the one-GEMM path ran
    err = (out.double() - exact).abs().max().item()
    assert err < 1e-3 * exact.abs().max().item(), err  # fp32 accumulation of exact bf16 products
    rounded = start.clone()
    for seed in (1, 2, 3):
        _, a, b = _operands("cuda", seed)
        rounded += (a @ b).float()
    assert err <= (rounded.double() - exact).abs().max().item()  # no worse than bf16 product + fp32 add
