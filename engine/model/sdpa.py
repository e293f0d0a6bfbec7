"""Process-wide choice of PyTorch's attention (SDPA) backends for processes that decode."""

from __future__ import annotations

import os

CUDNN_SDPA_ENV = "EAGLE3_SDPA_CUDNN"  # "1" keeps cuDNN attention on


def avoid_cudnn_attention(device: str) -> bool:
    """On CUDA, turn cuDNN's SDPA backend off for this process (flash / memory-efficient / math remain).

    Decoding changes the key length at every step; cuDNN attention builds an execution plan per new
    shape, so a masked verify or draft-extend step paid a plan build each time, several times the step
    itself (bench/decode_speed.py; bench/RESULTS.md, End to end on the H200). Called by the evaluation
    job and the local server.
    Returns whether cuDNN attention is now off."""
    import torch

    if not str(device).startswith("cuda") or os.environ.get(CUDNN_SDPA_ENV, "").strip() == "1":
        return False
    if not hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True
