"""fp8 storage of the aux states (`extract.aux_format = "fp8"`): float8 e4m3 with a float32 scale per
token and capture layer, the final hidden state kept in bf16.

The aux states are three quarters of a record (6H of 8H bytes a token in bf16); in e4m3 they take 3H
bytes plus 12 for the scales: 5H + 28 bytes a token instead of 8H + 16, 0.63 of the disk. Each capture
layer's H values of a token share one scale, amax / 448 (e4m3's largest finite value): the layers'
magnitudes differ by orders from the first capture layer to the last, a token's values within one layer
much less. Readers get bf16 back (engine.records.load_record dequantizes), so the trainer, the
evaluation and the SpecForge export do not know the difference. Whether a drafter trained on it is as
good is the GPU end to end's question (bench/gpu_end_to_end.py --compare-fp8), which decides whether
this stays.
"""

from __future__ import annotations

import os
from typing import Any

E4M3_MAX = 448.0
LAYERS = 3  # capture layers in the aux state
BLOCK_ROWS = 1024  # tokens quantized at a time (a float32 copy of 1024 x 3H: 84 MiB at H = 7168)


def quantize(aux: Any, hidden_size: int) -> tuple[Any, Any]:
    """(float8_e4m3fn [T, 3H], float32 scales [T, 3]) of bf16/float aux states [T, 3H]."""
    import torch

    rows = aux.reshape(-1, LAYERS, hidden_size).float()
    amax = rows.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = (rows / scales.unsqueeze(2)).clamp_(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).reshape(-1, LAYERS * hidden_size), scales.contiguous()


def dequantize(q: Any, scales: Any, hidden_size: int) -> Any:
    """bf16 aux states [T, 3H] from float8_e4m3fn [T, 3H] and float32 scales [T, 3]."""
    import torch

    rows = q.reshape(-1, LAYERS, hidden_size).float() * scales.float().unsqueeze(2)
    return rows.reshape(-1, LAYERS * hidden_size).to(torch.bfloat16)


def nan_free(chunk: memoryview) -> bool:
    """No NaN among these e4m3fn bytes (0x7F and 0xFF, the only non-finite codes: e4m3fn has no inf)."""
    import torch

    if not len(chunk):
        return True
    bits = torch.frombuffer(chunk, dtype=torch.uint8)
    return int(torch.bitwise_and(bits, 0x7F).max()) != 0x7F


def read_source(source: Any) -> bytearray | memoryview:
    """All the bytes of a record source (engine.records.Source: a buffer, or (fd, offset, length))."""
    if not isinstance(source, tuple):
        return memoryview(source).cast("B")
    fd, offset, length = source
    buffer = bytearray(length)
    view, got = memoryview(buffer), 0
    while got < length:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"source file ended {length - got} bytes early (truncated while read?)")
        got += n
    return buffer


def quantize_sources(sources: list[Any], hidden_size: int) -> tuple[list[memoryview], memoryview, bool]:
    """The e4m3 bytes of bf16 aux sources (in order), their scales' bytes, and whether every input value
    was finite (a NaN or inf in bf16 would hide behind a scale: it is checked here, before quantizing).
    Quantized BLOCK_ROWS tokens at a time, so the float32 working copy stays small at any length."""
    import torch

    from engine.capture.stfile import tensor_bytes

    width = LAYERS * hidden_size
    out, scales, finite = [], [], True
    for source in sources:
        data = read_source(source)
        if not len(data):
            continue
        aux = torch.frombuffer(data, dtype=torch.bfloat16).view(-1, width)
        q = torch.empty(aux.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(aux.shape[0], LAYERS, dtype=torch.float32)
        for start in range(0, aux.shape[0], BLOCK_ROWS):
            block = aux[start:start + BLOCK_ROWS]
            finite = finite and bool(torch.isfinite(torch.stack([block.amax(), block.amin()]).float()).all())
            q[start:start + BLOCK_ROWS], s[start:start + BLOCK_ROWS] = quantize(block, hidden_size)
        out.append(tensor_bytes(q.view(torch.uint8)))
        scales.append(s)
    joined = torch.cat(scales) if scales else torch.zeros(0, LAYERS)
    return out, tensor_bytes(joined.contiguous()), finite
