"""The capture spool: one request's slice of a prefill, written as one safetensors file.

Shared by the local target server and the SGLang capture patch, so both backends produce
byte-compatible spools. Layout:

    <spool>/<rid>/<start:010d>.safetensors

A segment holds, for prompt positions [start, start + n):
    input_ids         int64 [n]
    aux_hidden_state  [n, k*H]  pre-norm outputs of the k chosen layers, concatenated low -> high
    hidden_state      [n, H]    post-final-norm state (what feeds the LM head)
Float tensors keep the dtype they were given (bf16 in production). Metadata (all strings):
format, version, rid, start, n_tokens, layers (our 0-indexed numbering), hidden_size, dtype.

Chunked prefill writes several segments per rid; `assemble` stitches them by position and
refuses gaps and overlaps. The spool is scratch: `release` empties a rid once its record
has been committed elsewhere (durably, by the extraction job), and segments are published
atomically but not fsynced. A retried request should `release` first, so stale
segments from the failed attempt cannot overlap the new ones.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.atomic import publish_via_path
from engine.names import check_name
from engine.errors import EngineError

FORMAT_NAME = "eagle3-console/capture-segment"
FORMAT_VERSION = "1"
_SEGMENT_FILE = re.compile(r"^(\d{10})\.safetensors$")


class SegmentError(EngineError, ValueError):
    """A segment is malformed, or the segments of one rid do not fit together."""


@dataclass(frozen=True)
class SegmentInfo:
    path: Path
    start: int


@dataclass
class AssembledCapture:
    input_ids: torch.Tensor  # int64 [T]
    aux_hidden_state: torch.Tensor  # [T, k*H]
    hidden_state: torch.Tensor  # [T, H]
    layers: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def segment_path(spool_dir: str | os.PathLike, rid: str, start: int) -> Path:
    check_name(rid, "request id")
    return Path(spool_dir) / rid / f"{start:010d}.safetensors"


def write_segment(
    spool_dir: str | os.PathLike,
    rid: str,
    start: int,
    input_ids: torch.Tensor | Sequence[int],
    aux: torch.Tensor,
    final: torch.Tensor,
    layers: Sequence[int],
) -> Path:
    """Validate and atomically publish one segment; returns its path (complete on return).

    Not fsynced: the spool is scratch, never read across a crash (see `publish_via_path`)."""
    check_name(rid, "request id")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise SegmentError(f"segment start must be an integer >= 0, got {start!r}")
    layers = [int(layer) for layer in layers]
    if not layers:
        raise SegmentError("a segment needs at least one capture layer")
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise SegmentError(f"input_ids must be a 1-D integer tensor, got {ids.dtype} {list(ids.shape)}")
    n = int(ids.shape[0])
    if n == 0:
        raise SegmentError("a segment must hold at least one token")
    if final.dim() != 2 or final.shape[0] != n:
        raise SegmentError(f"hidden_state must be [{n}, H], got {list(final.shape)}")
    hidden = int(final.shape[1])
    if aux.dim() != 2 or tuple(aux.shape) != (n, len(layers) * hidden):
        raise SegmentError(
            f"aux_hidden_state must be [{n}, {len(layers)}*{hidden}] for layers {layers}, got {list(aux.shape)}"
        )
    if not (aux.dtype.is_floating_point and final.dtype.is_floating_point) or aux.dtype != final.dtype:
        raise SegmentError(f"hidden states must share one float dtype, got {aux.dtype} and {final.dtype}")
    tensors = {
        "input_ids": ids.detach().to(device="cpu", dtype=torch.int64).contiguous(),
        "aux_hidden_state": aux.detach().cpu().contiguous(),
        "hidden_state": final.detach().cpu().contiguous(),
    }
    metadata = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "rid": rid,
        "start": str(start),
        "n_tokens": str(n),
        "layers": ",".join(str(layer) for layer in layers),
        "hidden_size": str(hidden),
        "dtype": str(final.dtype).removeprefix("torch."),
    }
    path = segment_path(spool_dir, rid, start)
    # One mkdir, not makedirs' stat-then-mkdir: each system call hands the GIL away and a writer waits
    # to get it back while the server's other threads are busy.
    try:
        os.mkdir(path.parent)
    except FileExistsError:
        pass
    except FileNotFoundError:  # the spool itself is gone: recreate it
        os.makedirs(path.parent, exist_ok=True)
    publish_via_path(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return path


def _rid_dir(spool_dir: str | os.PathLike, rid: str) -> Path:
    check_name(rid, "request id")
    directory = Path(spool_dir) / rid
    if directory.is_symlink():
        raise SegmentError(f"spool entry {directory} is a symlink; refusing to follow it")
    return directory


def list_segments(spool_dir: str | os.PathLike, rid: str) -> list[SegmentInfo]:
    """Segments of `rid` sorted by start position ([] if the rid has none)."""
    directory = _rid_dir(spool_dir, rid)
    if not directory.is_dir():
        return []
    found: list[SegmentInfo] = []
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue  # an atomic write still in flight (temp file)
        match = _SEGMENT_FILE.match(entry.name)
        if not match or not entry.is_file():
            raise SegmentError(
                f"unexpected entry {entry} in the capture spool; only <start:010d>.safetensors belongs there"
            )
        found.append(SegmentInfo(path=entry, start=int(match.group(1))))
    return sorted(found, key=lambda info: info.start)


def _read_segment(info: SegmentInfo, rid: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(info.path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(info.path))
    except Exception as exc:  # corrupt or truncated file
        raise SegmentError(f"cannot read capture segment {info.path}: {exc}") from None
    if metadata.get("format") != FORMAT_NAME or metadata.get("version") != FORMAT_VERSION:
        raise SegmentError(
            f"{info.path} is not a version-{FORMAT_VERSION} capture segment "
            f"(format={metadata.get('format')!r}, version={metadata.get('version')!r})"
        )
    if metadata.get("rid") != rid or metadata.get("start") != str(info.start):
        raise SegmentError(
            f"{info.path} claims rid={metadata.get('rid')!r} start={metadata.get('start')!r}; "
            "the file name says otherwise"
        )
    missing = {"input_ids", "aux_hidden_state", "hidden_state"} - tensors.keys()
    if missing:
        raise SegmentError(f"{info.path} lacks tensors {sorted(missing)}")
    return tensors, metadata


def assemble(
    spool_dir: str | os.PathLike,
    rid: str,
    expected_len: int | None = None,
    expected_input_ids: Sequence[int] | None = None,
) -> AssembledCapture:
    """Stitch the segments of `rid` into one capture covering positions 0 .. T-1.

    Raises SegmentError on: no segments, a gap, an overlap, mismatched layers/shape/dtype,
    a total length other than `expected_len`, or token ids other than `expected_input_ids`.
    """
    segments = list_segments(spool_dir, rid)
    if not segments:
        raise SegmentError(f"no capture segments for request {rid!r} in {spool_dir}")
    ids_parts: list[torch.Tensor] = []
    aux_parts: list[torch.Tensor] = []
    final_parts: list[torch.Tensor] = []
    first_meta: dict[str, str] | None = None
    position = 0
    for info in segments:
        tensors, metadata = _read_segment(info, rid)
        n = int(tensors["input_ids"].shape[0])
        if info.start > position:
            raise SegmentError(
                f"gap in capture of {rid!r}: positions {position}..{info.start - 1} are missing "
                f"(next segment {info.path.name} starts at {info.start})"
            )
        if info.start < position:
            raise SegmentError(
                f"overlap in capture of {rid!r}: segment {info.path.name} starts at {info.start} but "
                f"positions up to {position - 1} are already covered (stale segments? release the rid before retrying)"
            )
        if first_meta is None:
            first_meta = metadata
        else:
            for key in ("layers", "hidden_size", "dtype"):
                if metadata.get(key) != first_meta.get(key):
                    raise SegmentError(
                        f"segment {info.path.name} of {rid!r} has {key}={metadata.get(key)!r}, "
                        f"earlier segments have {first_meta.get(key)!r}"
                    )
        aux, final = tensors["aux_hidden_state"], tensors["hidden_state"]
        if aux.shape[0] != n or final.shape[0] != n:
            raise SegmentError(
                f"segment {info.path.name} of {rid!r}: {n} input_ids but aux has {aux.shape[0]} rows "
                f"and hidden_state {final.shape[0]}"
            )
        if aux_parts and (aux.shape[1] != aux_parts[0].shape[1] or final.shape[1] != final_parts[0].shape[1]):
            raise SegmentError(f"segment {info.path.name} of {rid!r} has a different hidden width")
        ids_parts.append(tensors["input_ids"])
        aux_parts.append(aux)
        final_parts.append(final)
        position = info.start + n
    if expected_len is not None and position != expected_len:
        raise SegmentError(
            f"capture of {rid!r} covers {position} tokens, expected {expected_len} "
            "(a truncated prefill, or a prefix served from cache?)"
        )
    capture = AssembledCapture(
        input_ids=torch.cat(ids_parts),
        aux_hidden_state=torch.cat(aux_parts),
        hidden_state=torch.cat(final_parts),
        layers=[int(x) for x in first_meta["layers"].split(",")] if first_meta else [],
    )
    if expected_input_ids is not None:
        expected = torch.as_tensor(list(expected_input_ids), dtype=torch.int64)
        if expected.shape != capture.input_ids.shape or not torch.equal(expected, capture.input_ids):
            raise SegmentError(f"captured token ids of {rid!r} differ from the ids that were sent")
    return capture


def release(spool_dir: str | os.PathLike, rid: str) -> int:
    """Remove the spool directory of `rid`; returns the number of segment files removed.

    Only segment files and in-flight temp files are deleted; anything else found there is
    left in place and reported, so a mistaken spool path cannot destroy unrelated data.
    """
    directory = _rid_dir(spool_dir, rid)
    if not directory.is_dir():
        return 0
    removed = 0
    for entry in directory.iterdir():
        is_segment = _SEGMENT_FILE.match(entry.name) is not None
        is_temp = entry.name.startswith(".") and entry.name.endswith(".tmp")
        if (is_segment or is_temp) and entry.is_file() and not entry.is_symlink():
            entry.unlink()
            removed += int(is_segment)
    try:
        directory.rmdir()
    except OSError:
        leftover = sorted(entry.name for entry in directory.iterdir())
        raise SegmentError(
            f"released capture segments of {rid!r} but left {directory} in place: it holds "
            f"unexpected entries {leftover[:5]}"
        ) from None
    return removed
