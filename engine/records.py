"""Extraction records: one safetensors file per sample, a manifest line per completed sample.

Record keys (and their meaning) are those of SpecForge's offline EAGLE-3 features:
  input_ids int64 [T], loss_mask int64 [T] (1 on assistant tokens),
  aux_hidden_state bf16 [T, 3H] (outputs of the three capture layers, low -> high),
  hidden_state bf16 [T, H] (post-final-norm state feeding the LM head). No padding.
With `extract.aux_format = "fp8"` aux_hidden_state is float8 e4m3 beside aux_scale float32 [T, 3]
(engine.aux_fp8); load_record returns it as bf16, so readers see the same keys either way.
SpecForge cannot read these files as they are: its offline trainer reads torch.save'd dicts in
`*.ckpt` files with the states shaped [1, T, .]. `eagle3-console data export RUN --format specforge
DIR` (engine/specforge_export.py) writes those; tests/test_specforge_export.py loads them with
SpecForge's own offline loader.

Records are written by streaming (`write_record_stream`): a hand-built safetensors header, then the
states chunk by chunk from wherever they are (the capture spool's files, or tensors), each chunk
checked for NaN/inf, hashed and written while it is in the cache; the sha256 is of the bytes written.

Layout of a run directory:
  run.json                 what produced it (model, H, layers, dataset, max_seq_len, sample count)
  records/<group>/<id>.safetensors   at most GROUP_SIZE files per directory
  manifest.jsonl           {"id", "index", "path", "tokens", "trainable", "bytes", "sha256"} per line,
                           appended only after the record is durable (fsync + rename + directory
                           fsync); the extraction appends several at once (`append_manifest_entries`)
  bad.jsonl                samples that failed after retries, with the reason
  token_counts.safetensors counts of loss-masked target tokens (draft vocabulary)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.io import atomic
from engine.capture import stfile
from engine.capture.stfile import tensor_bytes, write_all
from engine.io.names import check_name
from engine.errors import EngineError

GROUP_SIZE = 1000
FORMAT_VERSION = 1
MANIFEST = "manifest.jsonl"
BAD = "bad.jsonl"
RUN_META = "run.json"
TOKEN_COUNTS = "token_counts.safetensors"
KEYS = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")


class RecordError(EngineError):
    """A record or manifest problem, explained."""


@dataclass(frozen=True)
class RecordEntry:
    id: str
    index: int
    path: str  # relative to the run directory
    tokens: int
    trainable: int
    bytes: int
    sha256: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def all_finite(tensor) -> bool:
    """No NaN or inf anywhere. max/min propagate NaN and reach any inf: two reductions, without the
    record-sized [N] bool tensor isfinite().all() builds first (bench/RESULTS.md, Extraction)."""
    import torch

    if tensor.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack([tensor.amax(), tensor.amin()])).all())


def record_relpath(index: int, sample_id: str) -> str:
    check_name(sample_id, "sample id")
    return f"records/{index // GROUP_SIZE:05d}/{sample_id}.safetensors"


def sha256_of(data: bytes) -> str:
    """Hex SHA-256 of `data` (records, checkpoints and exports sign their files with it)."""
    return hashlib.sha256(data).hexdigest()


def record_tensors(input_ids, loss_mask, aux_hidden_state, hidden_state) -> dict:
    """Validate shapes and dtypes; the tensors as stored."""
    import torch

    t = int(input_ids.shape[0])
    if input_ids.dim() != 1 or loss_mask.shape != input_ids.shape:
        raise RecordError(f"input_ids {list(input_ids.shape)} and loss_mask {list(loss_mask.shape)} must both be [T]")
    if aux_hidden_state.dim() != 2 or hidden_state.dim() != 2 or aux_hidden_state.shape[0] != t or hidden_state.shape[0] != t:
        raise RecordError(f"states must be [T, 3H] and [T, H] with T={t}, got {list(aux_hidden_state.shape)} "
                          f"and {list(hidden_state.shape)}")
    if aux_hidden_state.shape[1] != 3 * hidden_state.shape[1]:
        raise RecordError(f"aux width {aux_hidden_state.shape[1]} != 3 x hidden {hidden_state.shape[1]}")
    tensors = {
        "input_ids": input_ids.to(torch.int64).contiguous(),
        "loss_mask": loss_mask.to(torch.int64).contiguous(),
        "aux_hidden_state": aux_hidden_state.to(torch.bfloat16).contiguous(),
        "hidden_state": hidden_state.to(torch.bfloat16).contiguous(),
    }
    return tensors


RECORD_METADATA = {"format": "eagle3-console", "version": str(FORMAT_VERSION)}
CHUNK = 4 << 20  # bytes checked, hashed and written at a time: a chunk stays in the CPU cache for all three
AUX_FORMATS = ("bf16", "fp8")  # how the aux states are stored (engine.aux_fp8 for fp8); readers get bf16

# Where a record's bytes come from: a bytes-like object, or (fd, offset, length) of an open file.
Source = Any


def _layout(tokens: int, hidden_size: int, aux_format: str) -> list[tuple[str, str, list[int], int]]:
    """A record's tensors in file order: (name, safetensors dtype, shape, bytes). fp8's scales come
    before its states, where float32 stays 4-byte aligned."""
    t, h = tokens, hidden_size
    if aux_format == "bf16":
        aux = [("aux_hidden_state", "BF16", [t, 3 * h], t * 3 * h * 2)]
    elif aux_format == "fp8":
        aux = [("aux_scale", "F32", [t, 3], t * 12), ("aux_hidden_state", "F8_E4M3", [t, 3 * h], t * 3 * h)]
    else:
        raise RecordError(f"aux format {aux_format!r} is not one of {', '.join(AUX_FORMATS)}")
    return [("input_ids", "I64", [t], t * 8), ("loss_mask", "I64", [t], t * 8), *aux,
            ("hidden_state", "BF16", [t, h], t * h * 2)]


def record_header(tokens: int, hidden_size: int, aux_format: str = "bf16") -> bytes:
    """The safetensors header of a record of `tokens` tokens, built by hand so that the states can
    be streamed into the file without building tensors first."""
    return stfile.header(_layout(tokens, hidden_size, aux_format), RECORD_METADATA)


def record_size(tokens: int, hidden_size: int, aux_format: str = "bf16") -> int:
    """Bytes of a record file: header and tensors."""
    return len(record_header(tokens, hidden_size, aux_format)) + sum(
        nbytes for *_, nbytes in _layout(tokens, hidden_size, aux_format))


def _chunks(source: Source, scratch: bytearray) -> Iterator[memoryview]:
    """The source's bytes, CHUNK at a time (every chunk but the last exactly CHUNK long, so a chunk
    never splits a value): slices of a buffer, or reads of a file range into `scratch`."""
    if isinstance(source, tuple):
        fd, offset, length = source
        view = memoryview(scratch)
        end = offset + length
        while offset < end:
            want = min(CHUNK, end - offset)
            _read_range(fd, view[:want], offset, end)
            offset += want
            yield view[:want]
        return
    data = memoryview(source).cast("B")
    for start in range(0, len(data), CHUNK):
        yield data[start:start + CHUNK]


def _read_range(fd: int, view: memoryview, offset: int, end: int) -> None:
    """Fill `view` from the file at `offset` (the source ends at `end`); RecordError if the file is shorter."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise RecordError(f"source file ended {end - offset - got} bytes early (truncated while read?)")
        got += n


def source_bytes(source: Source) -> bytearray | memoryview:
    """All the bytes of a source at once (for a whole-row transform such as engine.aux_fp8's)."""
    if not isinstance(source, tuple):
        return memoryview(source).cast("B")
    fd, offset, length = source
    buffer = bytearray(length)
    _read_range(fd, memoryview(buffer), offset, offset + length)
    return buffer


_local = threading.local()


def _scratch() -> bytearray:
    """This thread's read buffer, kept between records (a fresh one would be zero-filled each time)."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or len(buffer) != CHUNK:
        buffer = _local.scratch = bytearray(CHUNK)
    return buffer


def _source_len(source: Source) -> int:
    return source[2] if isinstance(source, tuple) else memoryview(source).nbytes


def _bf16_finite(chunk: memoryview) -> bool:
    """No NaN or inf among these bf16 values: none has all eight exponent bits set (one pass over
    bytes already in the cache, outside the GIL, no float conversion)."""
    import torch

    if len(chunk) < 2:
        return True
    bits = torch.frombuffer(chunk, dtype=torch.int16)
    return int(torch.bitwise_and(bits, 0x7F80).max()) != 0x7F80


def _f32_finite(chunk: memoryview) -> bool:
    import torch

    if len(chunk) < 4:
        return True
    values = torch.frombuffer(chunk, dtype=torch.float32)
    return bool(torch.isfinite(torch.stack([values.amax(), values.amin()])).all())


def quantize_sources(sources: list[Any], hidden_size: int) -> tuple[list[memoryview], memoryview]:
    """The e4m3 bytes of bf16 aux sources (in order; engine.aux_fp8) and their scales' bytes.
    RecordError on a NaN or inf (it would hide behind a scale: checked here, before quantizing), or on a
    source file cut short. Quantized BLOCK_ROWS tokens at a time, so the float32 working copy stays
    small at any length."""
    import torch

    from engine.aux_fp8 import BLOCK_ROWS, LAYERS, quantize

    width = LAYERS * hidden_size
    out, scales = [], []
    for source in sources:
        data = source_bytes(source)
        if not len(data):
            continue
        aux = torch.frombuffer(data, dtype=torch.bfloat16).view(-1, width)
        q = torch.empty(aux.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(aux.shape[0], LAYERS, dtype=torch.float32)
        for start in range(0, aux.shape[0], BLOCK_ROWS):
            block = aux[start:start + BLOCK_ROWS]
            if not bool(torch.isfinite(torch.stack([block.amax(), block.amin()]).float()).all()):
                raise RecordError("non-finite values in the captured states")
            q[start:start + BLOCK_ROWS], s[start:start + BLOCK_ROWS] = quantize(block, hidden_size)
        out.append(tensor_bytes(q.view(torch.uint8)))
        scales.append(s)
    joined = torch.cat(scales) if scales else torch.zeros(0, LAYERS)
    return out, tensor_bytes(joined.contiguous())


def write_record_stream(run_dir: Path, index: int, sample_id: str, input_ids: bytes | memoryview,
                        loss_mask: bytes | memoryview,
                        aux_sources: list[Source], hidden_sources: list[Source], hidden_size: int,
                        sync_dir: bool = True, durable: bool = True, aux_format: str = "bf16",
                        aux_scale: bytes | memoryview | None = None) -> RecordEntry:
    """Write a record from its parts and return its manifest entry (not yet appended).

    `input_ids` and `loss_mask` are little-endian int64 bytes; the states' sources hold bf16 rows,
    concatenated in order (the segments of a chunked prefill); with `aux_format` "fp8" the aux sources
    hold e4m3 rows and `aux_scale` their float32 [T, 3] scales (engine.aux_fp8.quantize_sources). Each
    chunk is checked for NaN/inf, hashed and written while it is in the cache: no tensors are built,
    nothing is read back. The file is fsynced and renamed into place; its directory is fsynced too
    unless `sync_dir` is False (a caller that commits several records under one directory fsync:
    `append_manifest_entries`). `durable` False skips both fsyncs: for records that are thrown away,
    not trusted, after a crash. RecordError on a non-finite value or a size that does not match the
    header (nothing is left behind)."""
    from engine.aux_fp8 import nan_free

    tokens = len(input_ids) // 8
    if len(input_ids) != 8 * tokens or len(loss_mask) != len(input_ids):
        raise RecordError(f"input_ids ({len(input_ids)} bytes) and loss_mask ({len(loss_mask)} bytes) must be "
                          "int64 [T] each")
    layout = {name: (dtype, shape, nbytes) for name, dtype, shape, nbytes in _layout(tokens, hidden_size, aux_format)}
    parts: dict[str, list[Source]] = {"aux_hidden_state": aux_sources, "hidden_state": hidden_sources}
    if aux_format == "fp8":
        if aux_scale is None:
            raise RecordError("fp8 aux states need their scales (aux_scale)")
        parts["aux_scale"] = [aux_scale]
    for name, sources in parts.items():
        dtype, shape, nbytes = layout[name]
        got = sum(_source_len(s) for s in sources)
        if got != nbytes:
            raise RecordError(f"{name}: {got} bytes, a {dtype.lower()} {shape} needs {nbytes}")
    finite = {"BF16": _bf16_finite, "F8_E4M3": nan_free, "F32": _f32_finite}
    rel = record_relpath(index, sample_id)
    path = Path(run_dir) / rel
    header = record_header(tokens, hidden_size, aux_format)
    digest = hashlib.sha256(header)
    scratch = _scratch() if any(isinstance(s, tuple) for sources in parts.values() for s in sources) else bytearray()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        size = write_all(fd, header)
        for data in (input_ids, loss_mask):
            digest.update(data)
            size += write_all(fd, data)
        for name in layout:
            if name not in parts:
                continue
            check = finite[layout[name][0]]
            for source in parts[name]:
                for chunk in _chunks(source, scratch):
                    if not check(chunk):
                        raise RecordError("non-finite values in the captured states")
                    digest.update(chunk)
                    size += write_all(fd, chunk)
        if durable:
            os.fsync(fd)
        os.fchmod(fd, 0o644)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if sync_dir and durable:
        atomic.fsync_dir(path.parent)
    trainable = sum(memoryview(loss_mask).cast("q")) if tokens else 0
    return RecordEntry(sample_id, index, rel, tokens, int(trainable), size, digest.hexdigest())


def write_record(run_dir: Path, index: int, sample_id: str, input_ids, loss_mask, aux_hidden_state,
                 hidden_state, aux_format: str = "bf16") -> RecordEntry:
    """Write the record atomically (durable on return) and return its manifest entry (not yet
    appended). RecordError if a state holds NaN or inf, as for a captured record."""
    tensors = record_tensors(input_ids, loss_mask, aux_hidden_state, hidden_state)
    tensors = {k: v.cpu() for k, v in tensors.items()}
    hidden = int(tensors["hidden_state"].shape[1])
    aux: list[Source] = [tensor_bytes(tensors["aux_hidden_state"])]
    scale = None
    if aux_format == "fp8":
        aux, scale = quantize_sources(aux, hidden)
    return write_record_stream(run_dir, index, sample_id, tensor_bytes(tensors["input_ids"]),
                               tensor_bytes(tensors["loss_mask"]), aux, [tensor_bytes(tensors["hidden_state"])], hidden,
                               aux_format=aux_format, aux_scale=scale)


def sha256_and_size(path: str) -> tuple[str, int]:
    """(hex SHA-256, bytes) of a file, read in 4 MiB blocks so a large file never sits in memory."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def append_manifest(run_dir: Path, entry: RecordEntry) -> None:
    atomic.append_line(Path(run_dir) / MANIFEST, entry.to_json())


def append_manifest_entries(run_dir: Path, entries: list[RecordEntry]) -> None:
    """Commit several records at once (group commit): one fsync per records directory (their
    renames), then their manifest lines in one write and one fsync. Each record's data must
    already be durable (`write_record_stream` fsyncs it). A failed append (a full disk) leaves
    the manifest as it was: none of these lines, no fragment."""
    if not entries:
        return
    for directory in sorted({(Path(run_dir) / e.path).parent for e in entries}):
        atomic.fsync_dir(directory)
    atomic.append_lines(Path(run_dir) / MANIFEST, [e.to_json() for e in entries])


def read_manifest(run_dir: Path) -> tuple[dict[str, RecordEntry], list[str]]:
    """Entries by id, plus problems found (torn last line, duplicates, malformed lines).

    A torn last line (a crash mid-append) is ignored: its record is simply redone.
    """
    path = Path(run_dir) / MANIFEST
    entries: dict[str, RecordEntry] = {}
    problems: list[str] = []
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return entries, problems
    lines = raw.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            entry = RecordEntry(**{k: data[k] for k in RecordEntry.__dataclass_fields__})
        except (ValueError, KeyError, TypeError):
            torn = number == len(lines) or (number == len(lines) - 1 and not lines[-1])
            problems.append(f"manifest line {number}: {'torn (ignored)' if torn else 'malformed'}")
            continue
        if entry.id in entries:
            problems.append(f"manifest line {number}: duplicate id {entry.id}")
        entries[entry.id] = entry
    return entries, problems


def verify_record(run_dir: Path, entry: RecordEntry, hidden_size: int | None = None, deep: bool = True) -> str | None:
    """None if the record is intact, else the reason. `deep` re-hashes the bytes; without it and
    without `hidden_size` only the file's size is compared (no read)."""
    path = Path(run_dir) / entry.path
    if not deep and hidden_size is None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{entry.path}: missing"
        except OSError as exc:
            return f"{entry.path}: unreadable ({exc.strerror})"
        return None if size == entry.bytes else f"{entry.path}: {size} bytes, manifest says {entry.bytes} (truncated?)"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return f"{entry.path}: missing"
    except OSError as exc:
        return f"{entry.path}: unreadable ({exc.strerror})"
    if len(data) != entry.bytes:
        return f"{entry.path}: {len(data)} bytes, manifest says {entry.bytes} (truncated?)"
    if deep and sha256_of(data) != entry.sha256:
        return f"{entry.path}: checksum mismatch (corrupted)"
    if hidden_size is not None:
        try:
            tensors = load_record_bytes(data)
        except RecordError as exc:
            return f"{entry.path}: {exc}"
        if tuple(tensors["hidden_state"].shape) != (entry.tokens, hidden_size):
            return f"{entry.path}: hidden_state {list(tensors['hidden_state'].shape)}, expected [{entry.tokens}, {hidden_size}]"
    return None


def load_record_bytes(data: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own error types on damaged headers
        raise RecordError(f"not a readable safetensors record ({exc})") from None
    missing = [k for k in KEYS if k not in tensors]
    if missing:
        raise RecordError(f"record lacks {', '.join(missing)}")
    if "aux_scale" in tensors:  # fp8 aux states: readers get bf16 (engine.aux_fp8)
        from engine.aux_fp8 import LAYERS, dequantize

        scale, aux, hidden = tensors.pop("aux_scale"), tensors["aux_hidden_state"], tensors["hidden_state"]
        if tuple(scale.shape) != (aux.shape[0], LAYERS) or aux.shape[1] != 3 * hidden.shape[1]:
            raise RecordError(f"fp8 record: aux {list(aux.shape)} with scales {list(scale.shape)} and hidden "
                              f"{list(hidden.shape)} do not fit together")
        tensors["aux_hidden_state"] = dequantize(aux, scale, int(hidden.shape[1]))
    return tensors


def load_record(run_dir: Path, entry: RecordEntry, verify: bool = True) -> dict[str, Any]:
    """Load a record's tensors; with `verify`, a checksum mismatch raises instead of training on bad data."""
    path = Path(run_dir) / entry.path
    data = path.read_bytes()
    if verify and (len(data) != entry.bytes or sha256_of(data) != entry.sha256):
        raise RecordError(f"{entry.path}: checksum mismatch; re-run extraction to redo this sample")
    return load_record_bytes(data)


def write_run_meta(run_dir: Path, meta: dict[str, Any]) -> None:
    atomic.write_json(Path(run_dir) / RUN_META, {"format_version": FORMAT_VERSION, **meta})


def read_run_meta(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_META
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{path} missing: {run_dir} is not an extraction run") from None
    except ValueError as exc:
        raise RecordError(f"{path} is damaged ({exc})") from None


def save_token_counts(run_dir: Path, counts) -> None:
    from safetensors.torch import save

    atomic.write_bytes(Path(run_dir) / TOKEN_COUNTS, save({"counts": counts.contiguous()}))


def load_token_counts(run_dir: Path):
    from safetensors.torch import load

    path = Path(run_dir) / TOKEN_COUNTS
    try:
        return load(path.read_bytes())["counts"]
    except FileNotFoundError:
        raise RecordError(f"{path} missing: the extraction has not finished") from None
