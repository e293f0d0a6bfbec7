"""The capture spool: one request's slice of a prefill, written as one safetensors file.

Shared by the local target server and the SGLang capture patch, so both backends produce
byte-compatible spools. Layout:

    <spool>/<rid>/<start:010d>.safetensors
    <spool>/<rid>/<start:010d>.failed        why the segment at `start` will never come (text)
    <spool>/<rid>/<start:010d>.nospace       the same, because the spool was full (empty: it needs no page)

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

import json
import os
import re
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from engine.io.atomic import publish_via_path
from engine.capture import stfile
from engine.io.names import check_name
from engine.errors import EngineError
from engine.system.disk import is_no_space

FORMAT_NAME = "eagle3-console/capture-segment"
FORMAT_VERSION = "1"
_SEGMENT_FILE = re.compile(r"^(\d{10})\.safetensors$")
_FAILED_FILE = re.compile(r"^(\d{10})\.(failed|nospace)$")
# safetensors dtype names of what a segment may hold, and their torch types.
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class SegmentError(EngineError, ValueError):
    """A segment is malformed, or the segments of one rid do not fit together."""


# open_capture's re-reads of an incomplete capture: 2 ms first (a writer a batch behind), then doubling to 50 ms.
FIRST_PAUSE_S, MAX_PAUSE_S = 0.002, 0.05


class CaptureIncomplete(SegmentError):
    """The segments of one rid fit together so far but do not cover the request yet: none, a gap, or
    fewer tokens than expected. A server whose writer is still at work shows this (SGLang answers a
    request before its hook's writer has written the states); a truncated prefill does too."""


class CaptureLost(SegmentError):
    """The server answered the request, then failed to write its capture and left the reason in the
    spool (`mark_failed`): it will never be complete. `no_space`: because the spool was full, which is
    not the sample's fault (capture it again once there is room)."""

    def __init__(self, message: str, no_space: bool = False) -> None:
        super().__init__(message)
        self.no_space = no_space


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
    if final.dtype not in _DTYPE_NAMES:
        raise SegmentError(f"hidden states in {final.dtype} cannot be spooled: use bf16, fp16 or fp32")
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
    publish_via_path(path, lambda tmp: _save(tensors, tmp, metadata))
    return path


def mark_failed(spool_dir: str | os.PathLike, rid: str, start: int, reason: str, no_space: bool = False) -> Path:
    """Publish why the segment of `rid` at `start` will never be written. A server that answers a request
    once its states are in its writer's hands (before the segment is on the spool) says so here when the
    write then fails, so a reader fails at once with the reason instead of waiting out its patience.
    `no_space`: the spool was full; the mark is then empty, which a full spool still takes."""
    path = segment_path(spool_dir, rid, start).with_suffix(".nospace" if no_space else ".failed")
    os.makedirs(path.parent, exist_ok=True)
    data = b"" if no_space else reason.encode("utf-8", "replace")

    def write(tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            stfile.write_all(fd, data)
        finally:
            os.close(fd)

    publish_via_path(path, write)
    return path


def try_mark_failed(spool_dir: str | os.PathLike, rid: str, start: int, reason: str,
                    no_space: bool = False) -> str | None:
    """`mark_failed` for a writer that must go on whatever happens, unless the segment is marked already
    (the writer that saw the error marks first: it knows whether the spool was full): None, or why the
    mark could not be written (an unsafe rid...), for its log; the reader then waits out its patience."""
    try:
        path = segment_path(spool_dir, rid, start)
        if path.with_suffix(".failed").exists() or path.with_suffix(".nospace").exists():
            return None
        mark_failed(spool_dir, rid, start, reason, no_space)
    except (OSError, EngineError) as exc:
        if is_no_space(exc) and not no_space:
            try:  # no page left for the reason: the spool is full, and an empty mark says so
                mark_failed(spool_dir, rid, start, reason, no_space=True)
                return None
            except OSError:
                pass
        return f"cannot mark the capture of {rid}@{start} failed: {exc}"
    return None


def _save(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str]) -> None:
    """A safetensors file streamed from the tensors' memory: `save_file` first copies them into
    one bytes object while holding the GIL, which the server's other threads wait for."""
    entries = [(name, _DTYPE_NAMES[t.dtype], tuple(t.shape), t.numel() * t.element_size())
               for name, t in tensors.items()]
    fd = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        stfile.write_all(fd, stfile.header(entries, metadata))
        for tensor in tensors.values():
            if tensor.numel():
                stfile.write_all(fd, stfile.tensor_bytes(tensor))
    finally:
        os.close(fd)


def _rid_dir(spool_dir: str | os.PathLike, rid: str) -> Path:
    check_name(rid, "request id")
    directory = Path(spool_dir) / rid
    if directory.is_symlink():
        raise SegmentError(f"spool entry {directory} is a symlink; refusing to follow it")
    return directory


def _failure_text(path: Path) -> str:
    try:
        return path.read_text("utf-8", "replace").strip() or "(no reason given)"
    except OSError as exc:
        return f"(its reason in {path} cannot be read: {exc.strerror})"


def list_segments(spool_dir: str | os.PathLike, rid: str) -> list[SegmentInfo]:
    """Segments of `rid` sorted by start position ([] if the rid has none). CaptureLost if the server
    marked a segment of it as failed (`mark_failed`): it will never be complete."""
    directory = _rid_dir(spool_dir, rid)
    if not directory.is_dir():
        return []
    found: list[SegmentInfo] = []
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue  # an atomic write still in flight (temp file)
        match = _SEGMENT_FILE.match(entry.name)
        failure = _FAILED_FILE.match(entry.name)
        if failure and entry.is_file():
            if failure.group(2) == "nospace":
                raise CaptureLost(f"capture of {rid!r} was lost: the spool {directory.parent} was full when the "
                                  "server wrote it", no_space=True)
            raise CaptureLost(f"capture of {rid!r} failed in the server's writer: {_failure_text(entry)}")
        if not match or not entry.is_file():
            raise SegmentError(
                f"unexpected entry {entry} in the capture spool; only <start:010d>.safetensors belongs there"
            )
        found.append(SegmentInfo(path=entry, start=int(match.group(1))))
    return sorted(found, key=lambda info: info.start)


_TENSORS = ("input_ids", "aux_hidden_state", "hidden_state")
_MAX_HEADER = 1 << 20  # a segment's header is a few hundred bytes; more is a damaged length field


@dataclass(frozen=True)
class Block:
    """Where one tensor of a segment lies in its file: byte offset and length, dtype, shape."""

    offset: int
    nbytes: int
    dtype: str  # safetensors name: "BF16", "I64", ...
    shape: tuple[int, ...]


@dataclass
class SpooledSegment:
    start: int
    fd: int
    blocks: dict[str, Block]

    def source(self, name: str) -> tuple[int, int, int]:
        """(fd, offset, length) of one tensor's bytes."""
        block = self.blocks[name]
        return self.fd, block.offset, block.nbytes


@dataclass
class SpooledCapture:
    """A rid's segments, checked against each other and the request, left open on disk: nothing
    is read but their headers and ids, so a record can be written from them without building
    tensors (`engine.records.write_record_stream`). Close it (or use it as a context manager)."""

    rid: str
    layers: list[int]
    hidden_size: int
    dtype: str  # of the states, safetensors name
    input_ids: bytes  # int64, little-endian, positions 0 .. T-1
    segments: list[SpooledSegment]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) // 8

    def sources(self, name: str) -> list[tuple[int, int, int]]:
        return [segment.source(name) for segment in self.segments]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the whole capture, read into memory (segments concatenated)."""
        parts = []
        for segment in self.segments:
            block = segment.blocks[name]
            data = bytearray(block.nbytes)
            if block.nbytes and os.preadv(segment.fd, [data], block.offset) != block.nbytes:
                raise SegmentError(f"capture segment of {self.rid!r} at {segment.start} shrank while being read")
            parts.append(torch.frombuffer(data, dtype=_DTYPES[block.dtype]).reshape(block.shape) if block.nbytes
                         else torch.empty(block.shape, dtype=_DTYPES[block.dtype]))
        return torch.cat(parts)

    def close(self) -> None:
        for segment in self.segments:
            if segment.fd >= 0:
                os.close(segment.fd)
                segment.fd = -1

    def __enter__(self) -> SpooledCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _segment_blocks(fd: int, info: SegmentInfo, rid: str) -> tuple[dict[str, Block], dict[str, str]]:
    """Parse and check one segment's safetensors header (the format: u64 length, JSON, data)."""
    try:
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            raise ValueError("shorter than a header")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER:
            raise ValueError(f"header length {length}")
        raw = os.pread(fd, length, 8)
        if len(raw) != length:
            raise ValueError("header cut short")
        header = json.loads(raw)
        metadata = header.pop("__metadata__", None) or {}
        size = os.fstat(fd).st_size
        blocks: dict[str, Block] = {}
        end = 0
        for name, spec in header.items():
            dtype, shape = spec["dtype"], tuple(int(x) for x in spec["shape"])
            begin, stop = (int(x) for x in spec["data_offsets"])
            count = 1
            for dim in shape:
                count *= dim
            if dtype not in _DTYPES or stop - begin != count * _DTYPES[dtype].itemsize or begin < 0:
                raise ValueError(f"tensor {name}: {dtype} {list(shape)} at {begin}..{stop}")
            blocks[name] = Block(8 + length + begin, stop - begin, dtype, shape)
            end = max(end, stop)
        if size != 8 + length + end:
            raise ValueError(f"{size} bytes, the header describes {8 + length + end} (truncated?)")
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:  # torn or damaged file
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
    missing = set(_TENSORS) - blocks.keys()
    if missing:
        raise SegmentError(f"{info.path} lacks tensors {sorted(missing)}")
    return blocks, metadata


def open_capture(
    spool_dir: str | os.PathLike,
    rid: str,
    expected_len: int | None = None,
    expected_input_ids: Sequence[int] | None = None,
    wait_s: float = 0.0,
) -> SpooledCapture:
    """Open the segments of `rid` as one capture covering positions 0 .. T-1, checked as `assemble`
    checks them, without reading the states.

    `wait_s` > 0: an incomplete capture (CaptureIncomplete) is read again, more slowly each time, until
    it is complete or `wait_s` has passed. SGLang answers a request once its forward is done and the
    capture hook's writer writes the segments after that, so a reader that opens the spool on the
    answer may be early; a wrong capture (overlap, other ids or widths) fails at once."""
    deadline = time.monotonic() + wait_s
    pause = FIRST_PAUSE_S
    while True:
        try:
            return _open_once(spool_dir, rid, expected_len, expected_input_ids)
        except CaptureIncomplete as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                if wait_s <= 0:
                    raise
                raise CaptureIncomplete(
                    f"{exc}; still so after waiting {wait_s:g} s for the server's capture writer: it is behind "
                    "or failed (see the server log), or the prefill was cut short") from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, MAX_PAUSE_S)


def _open_once(spool_dir: str | os.PathLike, rid: str, expected_len: int | None,
               expected_input_ids: Sequence[int] | None) -> SpooledCapture:
    segments = list_segments(spool_dir, rid)
    if not segments:
        raise CaptureIncomplete(f"no capture segments for request {rid!r} in {spool_dir}")
    capture = SpooledCapture(rid, [], 0, "", b"", [])
    ids_parts: list[bytes] = []
    first_meta: dict[str, str] | None = None
    position = 0
    try:
        for info in segments:
            try:
                fd = os.open(info.path, os.O_RDONLY)
            except OSError as exc:
                raise SegmentError(f"cannot read capture segment {info.path}: {exc.strerror}") from None
            segment = SpooledSegment(info.start, fd, {})
            capture.segments.append(segment)
            segment.blocks, metadata = _segment_blocks(fd, info, rid)
            ids, aux, final = (segment.blocks[name] for name in _TENSORS)
            n = ids.shape[0] if len(ids.shape) == 1 and ids.dtype == "I64" else -1
            if info.start > position:
                raise CaptureIncomplete(
                    f"gap in capture of {rid!r}: positions {position}..{info.start - 1} are missing "
                    f"(next segment {info.path.name} starts at {info.start})"
                )
            if info.start < position:
                raise SegmentError(
                    f"overlap in capture of {rid!r}: segment {info.path.name} starts at {info.start} but "
                    f"positions up to {position - 1} are already covered (stale segments? release the rid before "
                    "retrying)"
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
            if n < 0 or len(aux.shape) != 2 or len(final.shape) != 2 or aux.shape[0] != n or final.shape[0] != n:
                raise SegmentError(
                    f"segment {info.path.name} of {rid!r}: input_ids {list(ids.shape)} ({ids.dtype}), aux "
                    f"{list(aux.shape)} and hidden_state {list(final.shape)} do not have one row per token"
                )
            earlier = capture.segments[0].blocks
            if aux.dtype != final.dtype or aux.dtype != earlier["aux_hidden_state"].dtype or \
                    aux.shape[1] != earlier["aux_hidden_state"].shape[1] or \
                    final.shape[1] != earlier["hidden_state"].shape[1]:
                raise SegmentError(f"segment {info.path.name} of {rid!r} has a different hidden width or dtype")
            data = os.pread(fd, ids.nbytes, ids.offset)
            if len(data) != ids.nbytes:
                raise SegmentError(f"cannot read capture segment {info.path}: input_ids cut short")
            ids_parts.append(data)
            position = info.start + n
        if expected_len is not None and position != expected_len:
            raise (CaptureIncomplete if position < expected_len else SegmentError)(
                f"capture of {rid!r} covers {position} tokens, expected {expected_len} "
                "(a truncated prefill, or a prefix served from cache?)"
            )
        capture.input_ids = b"".join(ids_parts)
        if expected_input_ids is not None:
            expected = struct.pack(f"<{len(expected_input_ids)}q", *expected_input_ids)
            if expected != capture.input_ids:
                raise SegmentError(f"captured token ids of {rid!r} differ from the ids that were sent")
        assert first_meta is not None
        capture.layers = [int(x) for x in first_meta["layers"].split(",")] if first_meta.get("layers") else []
        capture.hidden_size = capture.segments[0].blocks["hidden_state"].shape[1]
        capture.dtype = capture.segments[0].blocks["hidden_state"].dtype
        return capture
    except BaseException:
        capture.close()
        raise


def assemble(
    spool_dir: str | os.PathLike,
    rid: str,
    expected_len: int | None = None,
    expected_input_ids: Sequence[int] | None = None,
    wait_s: float = 0.0,
) -> AssembledCapture:
    """Stitch the segments of `rid` into one capture covering positions 0 .. T-1.

    Raises SegmentError on: no segments, a gap, an overlap, mismatched layers/shape/dtype,
    a total length other than `expected_len`, or token ids other than `expected_input_ids`.
    `wait_s`: see open_capture.
    """
    with open_capture(spool_dir, rid, expected_len, expected_input_ids, wait_s) as capture:
        return AssembledCapture(
            input_ids=torch.frombuffer(bytearray(capture.input_ids), dtype=torch.int64),
            aux_hidden_state=capture.tensor("aux_hidden_state"),
            hidden_state=capture.tensor("hidden_state"),
            layers=capture.layers,
        )


def release(spool_dir: str | os.PathLike, rid: str) -> int:
    """Remove the spool directory of `rid`; returns the number of segment files removed.

    Only segment files, failure marks and in-flight temp files are deleted; anything else found
    there is left in place and reported, so a mistaken spool path cannot destroy unrelated data.
    The server's writer may still be publishing a segment of `rid` (a capture given up as lost
    while a later chunk is in flight): a temp file that vanishes was renamed or dropped by its
    writer, and what a rename publishes is removed on the next pass.
    """
    directory = _rid_dir(spool_dir, rid)
    if not directory.is_dir():
        return 0
    removed = 0
    for _ in range(_RELEASE_PASSES):
        ours = [entry for entry in directory.iterdir() if _is_spool_file(entry)]
        for entry in ours:
            try:
                entry.unlink()
            except FileNotFoundError:
                continue
            removed += int(_SEGMENT_FILE.match(entry.name) is not None)
        try:
            directory.rmdir()
            return removed
        except FileNotFoundError:
            return removed
        except OSError:
            if not any(_is_spool_file(entry) for entry in directory.iterdir()):
                break
    entries = list(directory.iterdir())
    foreign = sorted(entry.name for entry in entries if not _is_spool_file(entry))
    if not foreign:
        raise SegmentError(f"released capture segments of {rid!r} but a writer kept publishing into {directory} "
                           f"over {_RELEASE_PASSES} passes; release it again once the server is idle")
    raise SegmentError(
        f"released capture segments of {rid!r} but left {directory} in place: it holds "
        f"unexpected entries {foreign[:5]}"
    )


# A writer publishes at most one segment of a rid at a time, so two passes settle a release that
# raced it; the rest absorb a writer that keeps publishing chunks while we sweep.
_RELEASE_PASSES = 8


def _is_spool_file(entry: Path) -> bool:
    name = entry.name
    ours = (_SEGMENT_FILE.match(name) is not None or _FAILED_FILE.match(name) is not None
            or (name.startswith(".") and name.endswith(".tmp")))
    return ours and not entry.is_symlink() and entry.is_file()
