"""Extraction records written by streaming (engine.records.write_record_stream) and committed in
groups (engine.extract.commit.GroupCommit): real files, real safetensors readers, a real full disk."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import engine.records as records
from engine.capture.segments import assemble, open_capture, write_segment
from engine.extract.commit import GroupCommit
from engine.records import (
    RecordError,
    append_manifest_entries,
    load_record,
    read_manifest,
    record_size,
    verify_record,
    write_record,
    write_record_stream,
)
from tests.faults.helpers import tmpfs

H = 8
LAYERS = [0, 1, 2]


def _states(n: int, offset: int = 0, dtype=torch.bfloat16):
    ids = torch.arange(offset, offset + n, dtype=torch.int64)
    return ids, torch.randn(n, 3 * H).to(dtype), torch.randn(n, H).to(dtype)


def _mask(n: int) -> torch.Tensor:
    return torch.tensor([i % 3 != 0 for i in range(n)], dtype=torch.int64)


def _le64(values) -> bytes:
    return torch.as_tensor(values, dtype=torch.int64).numpy().astype("<i8").tobytes()


def test_streamed_record_is_a_safetensors_file_its_entry_describes(tmp_path):
    ids, aux, final = _states(7, dtype=torch.float32)
    mask = _mask(7)
    entry = write_record(tmp_path, 3, "s3", ids, mask, aux, final)
    path = tmp_path / entry.path
    data = path.read_bytes()
    assert entry.bytes == len(data) == record_size(7, H)
    assert entry.sha256 == hashlib.sha256(data).hexdigest()
    assert (entry.tokens, entry.trainable, entry.index) == (7, int(mask.sum()), 3)
    header_len = int.from_bytes(data[:8], "little")
    assert (8 + header_len) % 8 == 0, "tensor data starts 8-byte aligned"
    loaded = load_file(str(path))  # safetensors' own reader, and its lazy one
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == records.RECORD_METADATA
    assert torch.equal(loaded["input_ids"], ids) and torch.equal(loaded["loss_mask"], mask)
    assert torch.equal(loaded["aux_hidden_state"], aux.to(torch.bfloat16))
    assert torch.equal(loaded["hidden_state"], final.to(torch.bfloat16))
    assert verify_record(tmp_path, entry, H) is None
    assert [p.name for p in path.parent.iterdir()] == ["s3.safetensors"], "no temp file left"


def test_record_streamed_from_spool_segments_equals_the_one_written_from_tensors(tmp_path, monkeypatch):
    """A chunked prefill's three segments, streamed in chunks that do not line up with the
    segments or rows, give byte for byte the file `write_record` makes from the stitched tensors."""
    monkeypatch.setattr(records, "CHUNK", 250)  # even (whole bf16 values), but splits rows and segments
    spool = tmp_path / "spool"
    parts = [_states(4, 0), _states(3, 4), _states(6, 7)]
    for start, (ids, aux, final) in zip([0, 4, 7], parts):
        write_segment(spool, "rid", start, ids, aux, final, LAYERS)
    mask = _mask(13)
    with open_capture(spool, "rid", 13, list(range(13))) as capture:
        streamed = write_record_stream(tmp_path / "a", 0, "s0", capture.input_ids, _le64(mask),
                                       capture.sources("aux_hidden_state"), capture.sources("hidden_state"), H)
    whole = assemble(spool, "rid", 13)
    direct = write_record(tmp_path / "b", 0, "s0", whole.input_ids, mask, whole.aux_hidden_state, whole.hidden_state)
    assert streamed == direct
    assert (tmp_path / "a" / streamed.path).read_bytes() == (tmp_path / "b" / direct.path).read_bytes()
    loaded = load_record(tmp_path / "a", streamed)
    assert torch.equal(loaded["aux_hidden_state"], torch.cat([p[1] for p in parts]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_anywhere_refuses_the_record_and_leaves_nothing(tmp_path, monkeypatch, bad):
    monkeypatch.setattr(records, "CHUNK", 64)
    spool = tmp_path / "spool"
    for where in [("aux", 0, 0), ("aux", 5, 3 * H - 1), ("aux", 2, 16), ("final", 9, 0), ("final", 9, H - 1)]:
        ids, aux, final = _states(10)
        (aux if where[0] == "aux" else final)[where[1], where[2]] = bad
        with pytest.raises(RecordError, match="non-finite"):
            write_record(tmp_path / "run", 1, "s1", ids, _mask(10), aux, final)
        write_segment(spool, "r", 0, ids, aux, final, LAYERS)
        with open_capture(spool, "r", 10) as capture, pytest.raises(RecordError, match="non-finite"):
            write_record_stream(tmp_path / "run", 1, "s1", capture.input_ids, _le64(_mask(10)),
                                capture.sources("aux_hidden_state"), capture.sources("hidden_state"), H)
        (spool / "r" / "0000000000.safetensors").unlink()
    assert list((tmp_path / "run").rglob("*")) == [tmp_path / "run" / "records", tmp_path / "run" / "records" / "00000"]
    ids, aux, final = _states(10)
    aux[3, 3] = 65280.0  # large but finite: stored
    write_record(tmp_path / "run", 1, "s1", ids, _mask(10), aux, final)


def test_parts_that_do_not_fit_the_header_are_refused(tmp_path):
    ids, aux, final = _states(5)
    with pytest.raises(RecordError, match=r"hidden_state: 64 bytes, a bf16 \[5, 8\] needs 80"):
        write_record_stream(tmp_path, 0, "s", _le64(ids), _le64(_mask(5)), [records.tensor_bytes(aux)],
                            [records.tensor_bytes(final[:4])], H)
    with pytest.raises(RecordError, match="int64"):
        write_record_stream(tmp_path, 0, "s", _le64(ids), _le64(_mask(4)), [records.tensor_bytes(aux)],
                            [records.tensor_bytes(final)], H)
    assert not (tmp_path / "records").exists() or not list((tmp_path / "records").rglob("*.safetensors"))


def test_size_only_verification_reads_nothing_and_catches_truncation(tmp_path, monkeypatch):
    ids, aux, final = _states(6)
    entry = write_record(tmp_path, 0, "s0", ids, _mask(6), aux, final)
    path = tmp_path / entry.path
    real_read = type(path).read_bytes

    def no_read(self):
        raise AssertionError("a size-only check must not read the record")

    monkeypatch.setattr(type(path), "read_bytes", no_read)
    assert verify_record(tmp_path, entry, None, deep=False) is None
    os.truncate(path, entry.bytes - 1)
    assert "truncated" in verify_record(tmp_path, entry, None, deep=False)
    path.unlink()
    assert "missing" in verify_record(tmp_path, entry, None, deep=False)
    monkeypatch.setattr(type(path), "read_bytes", real_read)


# ---- group commit ---------------------------------------------------------------------


def _entries(run_dir, n: int, first: int = 0):
    entries = []
    for i in range(first, first + n):
        ids, aux, final = _states(3)
        entries.append(write_record(run_dir, i, f"s{i:03d}", ids, _mask(3), aux, final))
    return entries


def test_group_commit_writes_every_line_once_in_fewer_appends(tmp_path):
    run_dir = tmp_path / "run"
    entries = _entries(run_dir, 24)
    appends: list[int] = []

    async def slow_thread(fn, *args):
        appends.append(len(args[1]))
        await asyncio.sleep(0.05)  # a slow disk: commits pile up behind the one under way
        return await asyncio.to_thread(fn, *args)

    async def main():
        group = GroupCommit(run_dir, slow_thread)
        await asyncio.gather(*(group.commit(e) for e in entries))
        return group.groups

    groups = asyncio.run(main())
    found, problems = read_manifest(run_dir)
    assert not problems and sorted(found) == sorted(e.id for e in entries)
    lines = (run_dir / records.MANIFEST).read_text().splitlines()
    assert len(lines) == 24 and groups == len(appends) < 24 and sum(appends) == 24, appends


def test_a_full_disk_fails_the_whole_group_and_leaves_the_manifest_as_it_was(tmp_path):
    with tmpfs(tmp_path / "disk", "256k") as disk:
        run_dir = disk / "run"
        first = _entries(run_dir, 1)
        append_manifest_entries(run_dir, first)
        manifest = run_dir / records.MANIFEST
        with open(manifest, "a") as handle:  # a blank line (readers skip it) up to 100 bytes before the
            handle.write(" " * (3995 - manifest.stat().st_size) + "\n")  # page's end: a group fits only in part
        before = manifest.read_bytes()
        assert len(before) == 3996
        later = _entries(run_dir, 40, first=1)
        ballast = disk / "ballast"
        with open(ballast, "wb", buffering=0) as handle:  # fill the disk to the last byte
            with contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0" * 4096)
            with contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0")

        async def commit_all(group):
            return await asyncio.gather(*(group.commit(e) for e in later), return_exceptions=True)

        results = asyncio.run(commit_all(GroupCommit(run_dir, asyncio.to_thread)))
        assert results and all(isinstance(r, OSError) and r.errno == errno.ENOSPC for r in results), results
        assert (run_dir / records.MANIFEST).read_bytes() == before, "no line and no fragment of the failed group"
        ballast.unlink()
        asyncio.run(commit_all(GroupCommit(run_dir, asyncio.to_thread)))  # the same entries, committed again
        ids = [json.loads(line)["id"] for line in manifest.read_text().splitlines() if line.strip()]
        assert ids == [e.id for e in first + later]
