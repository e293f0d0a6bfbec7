"""fp8 storage of the aux states (`extract.aux_format = "fp8"`): float8 e4m3 with a float32 scale per
token and capture layer, the final hidden state kept in bf16.

The aux states are three quarters of a record (6H of 8H bytes a token in bf16); in e4m3 they take 3H
bytes plus 12 for the scales: 5H + 28 bytes a token instead of 8H + 16, 0.63 of the disk. Each capture
layer's H values of a token share one scale, amax / 448 (e4m3's largest finite value): the layers'
magnitudes differ by orders from the first capture layer to the last, a token's values within one layer
much less. engine.records quantizes a record's aux sources (quantize_sources) and gives readers bf16
back (load_record dequantizes), so the trainer, the evaluation and the SpecForge export do not know the
difference. Whether a drafter trained on it is as good is the GPU end to end's question
(bench/gpu_end_to_end.py --compare-fp8), which decides whether this stays.
"""

from __future__ import annotations

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
