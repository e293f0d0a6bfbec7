"""safetensors files written by streaming: the header built by hand, then each tensor's bytes
written straight from its memory (no serialised copy of the whole file first, as `save_file`
makes while holding the GIL). The format: u64 little-endian header length, the JSON header
(dtype, shape, data_offsets per tensor, optional string `__metadata__`), spaces up to an 8-byte
boundary, then the tensors' bytes back to back. Torch-free: used by the capture spool and the
extraction records."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from typing import Any

# (name, safetensors dtype such as "BF16" or "I64", shape, byte length), in file order
Entry = tuple[str, str, Sequence[int], int]


def header(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes that precede the tensors' data."""
    spec: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        spec[name] = {"dtype": dtype, "shape": [int(x) for x in shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(spec, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors' own writer pads it
    return struct.pack("<Q", len(text)) + text


def write_all(fd: int, data: Any) -> int:
    """Write every byte of a buffer (os.write may write less); returns its length."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        view = view[os.write(fd, view):]
    return size


def tensor_bytes(tensor: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps the tensor alive)."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
