"""Capture spool segments and layer numbering: real files in a temp spool."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.capture.layers import (
    default_capture_layers,
    parse_layer_list,
    to_sglang_numbering,
    validate_layers,
)
from engine.capture.segments import (
    CaptureIncomplete,
    CaptureLost,
    SegmentError,
    assemble,
    list_segments,
    mark_failed,
    open_capture,
    release,
    segment_path,
    try_mark_failed,
    write_segment,
)
from engine.io.names import UnsafeNameError

H = 8
LAYERS = [0, 1, 2]


def make_states(n: int, offset: int = 0, dtype: torch.dtype = torch.bfloat16):
    ids = torch.arange(offset, offset + n, dtype=torch.int64)
    aux = torch.randn(n, 3 * H).to(dtype)
    final = torch.randn(n, H).to(dtype)
    return ids, aux, final


# ---- layers ---------------------------------------------------------------------------

def test_default_layers_match_sglang_defaults():
    assert default_capture_layers(32) == [1, 15, 28]
    assert to_sglang_numbering(default_capture_layers(32)) == [2, 16, 29]  # Llama-3.1-8B
    assert to_sglang_numbering(default_capture_layers(61)) == [2, 30, 58]  # Kimi-K2.5
    assert default_capture_layers(8) == [1, 3, 4]


@pytest.mark.parametrize("num_layers", [4, 5, 6, 7, 8, 12])
def test_default_layers_tiny_models_distinct_and_capturable(num_layers):
    layers = default_capture_layers(num_layers)
    assert layers == sorted(set(layers)) and len(layers) == 3
    assert validate_layers(layers, num_layers) == layers
    assert default_capture_layers(4) == [0, 1, 2]


def test_default_layers_too_small_model():
    with pytest.raises(ValueError, match="at least 4 layers"):
        default_capture_layers(3)


@pytest.mark.parametrize(
    "layers, message",
    [
        ([0, 1, 3], r"capture layer 3 is out of range \(the last layer.*valid range is 0\.\.2"),
        ([1, 2, 4], r"capture layer 4 .*layers_to_capture"),
        ([-1, 0, 1], r"capture layer -1 is out of range"),
        ([0, 1], r"expected 3 capture layers"),
        ([2, 1, 0], r"distinct and increasing"),
        ([0, "1", 2], r"'1' is not an integer"),
    ],
)
def test_validate_layers_errors(layers, message):
    with pytest.raises(ValueError, match=message):
        validate_layers(layers, 4)


def test_parse_layer_list():
    assert parse_layer_list("1, 3,4") == [1, 3, 4]
    with pytest.raises(ValueError, match="'x'"):
        parse_layer_list("1,x")


# ---- segments -------------------------------------------------------------------------

def test_write_and_assemble_single_segment(tmp_path):
    ids, aux, final = make_states(5)
    path = write_segment(tmp_path, "req-1", 0, ids, aux, final, LAYERS)
    assert path == tmp_path / "req-1" / "0000000000.safetensors"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left
    capture = assemble(tmp_path, "req-1", expected_len=5, expected_input_ids=list(range(5)))
    assert capture.num_tokens == 5 and capture.layers == LAYERS
    assert capture.aux_hidden_state.dtype == torch.bfloat16  # dtype kept as given
    assert torch.equal(capture.aux_hidden_state, aux) and torch.equal(capture.hidden_state, final)
    assert capture.input_ids.dtype == torch.int64


def test_write_recreates_a_spool_that_was_removed(tmp_path):
    spool = tmp_path / "gone" / "spool"  # e.g. /dev/shm cleared under a running server
    ids, aux, final = make_states(3)
    path = write_segment(spool, "req-1", 0, ids, aux, final, LAYERS)
    assert path.is_file()
    assert assemble(spool, "req-1", expected_len=3).num_tokens == 3


def test_chunked_prefill_segments_stitch_in_position_order(tmp_path):
    parts = [make_states(4, 0), make_states(3, 4), make_states(6, 7)]
    # write out of order: assembly must order by start, not by write time
    for start, (ids, aux, final) in sorted(zip([0, 4, 7], parts), key=lambda p: -p[0]):
        write_segment(tmp_path, "chunked", start, ids, aux, final, LAYERS)
    assert [s.start for s in list_segments(tmp_path, "chunked")] == [0, 4, 7]
    capture = assemble(tmp_path, "chunked", expected_len=13)
    assert torch.equal(capture.input_ids, torch.arange(13))
    assert torch.equal(capture.aux_hidden_state, torch.cat([p[1] for p in parts]))
    assert torch.equal(capture.hidden_state, torch.cat([p[2] for p in parts]))


def test_gap_is_reported_with_positions(tmp_path):
    write_segment(tmp_path, "gappy", 0, *make_states(4), LAYERS)
    write_segment(tmp_path, "gappy", 6, *make_states(2, 6), LAYERS)
    with pytest.raises(SegmentError, match=r"gap .*positions 4\.\.5 are missing"):
        assemble(tmp_path, "gappy")


def test_missing_first_chunk_is_a_gap(tmp_path):
    write_segment(tmp_path, "late", 3, *make_states(2, 3), LAYERS)
    with pytest.raises(SegmentError, match=r"positions 0\.\.2 are missing"):
        assemble(tmp_path, "late")


def test_overlap_is_reported(tmp_path):
    write_segment(tmp_path, "dup", 0, *make_states(4), LAYERS)
    write_segment(tmp_path, "dup", 2, *make_states(4, 2), LAYERS)
    with pytest.raises(SegmentError, match=r"overlap .*starts at 2 .*up to 3"):
        assemble(tmp_path, "dup")


def test_expected_length_mismatch(tmp_path):
    write_segment(tmp_path, "short", 0, *make_states(4), LAYERS)
    with pytest.raises(SegmentError, match="covers 4 tokens, expected 13"):
        assemble(tmp_path, "short", expected_len=13)


def test_expected_ids_mismatch(tmp_path):
    write_segment(tmp_path, "ids", 0, *make_states(3), LAYERS)
    with pytest.raises(SegmentError, match="differ from the ids that were sent"):
        assemble(tmp_path, "ids", expected_input_ids=[0, 1, 7])


def test_mismatched_layers_between_segments(tmp_path):
    write_segment(tmp_path, "mixed", 0, *make_states(2), [0, 1, 2])
    write_segment(tmp_path, "mixed", 2, *make_states(2, 2), [1, 2, 3])
    with pytest.raises(SegmentError, match="layers='1,2,3'"):
        assemble(tmp_path, "mixed")


def test_no_segments(tmp_path):
    with pytest.raises(SegmentError, match="no capture segments for request 'ghost'"):
        assemble(tmp_path, "ghost")
    assert list_segments(tmp_path, "ghost") == []


@pytest.mark.parametrize(
    "aux_shape, final_shape, message",
    [((4, 3 * H), (3, H), r"hidden_state must be \[4, H\]"), ((4, 2 * H), (4, H), r"aux_hidden_state must be \[4, 3\*8\]")],
)
def test_write_rejects_shape_mismatch(tmp_path, aux_shape, final_shape, message):
    with pytest.raises(SegmentError, match=message):
        write_segment(tmp_path, "bad", 0, torch.arange(4), torch.zeros(aux_shape), torch.zeros(final_shape), LAYERS)
    assert not (tmp_path / "bad").exists()


def test_write_rejects_float_ids_and_mixed_dtypes(tmp_path):
    ids, aux, final = make_states(2)
    with pytest.raises(SegmentError, match="integer"):
        write_segment(tmp_path, "r", 0, ids.float(), aux, final, LAYERS)
    with pytest.raises(SegmentError, match="one float dtype"):
        write_segment(tmp_path, "r", 0, ids, aux, final.float(), LAYERS)


@pytest.mark.parametrize("rid", ["../x", "/etc", "a/b", "..", "", ".hidden"])
def test_bad_rid_rejected_everywhere(tmp_path, rid):
    ids, aux, final = make_states(2)
    with pytest.raises(UnsafeNameError):
        write_segment(tmp_path, rid, 0, ids, aux, final, LAYERS)
    with pytest.raises(UnsafeNameError):
        assemble(tmp_path, rid)
    with pytest.raises(UnsafeNameError):
        release(tmp_path, rid)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_segment_is_a_clear_error(tmp_path):
    path = write_segment(tmp_path, "torn", 0, *make_states(3), LAYERS)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(SegmentError, match="cannot read capture segment"):
        assemble(tmp_path, "torn")


def test_renamed_segment_detected(tmp_path):
    path = write_segment(tmp_path, "moved", 0, *make_states(3), LAYERS)
    os.rename(path, segment_path(tmp_path, "moved", 5))
    with pytest.raises(SegmentError, match="file name says otherwise"):
        assemble(tmp_path, "moved")


def test_release_removes_only_that_rid(tmp_path):
    write_segment(tmp_path, "a", 0, *make_states(2), LAYERS)
    write_segment(tmp_path, "a", 2, *make_states(2, 2), LAYERS)
    write_segment(tmp_path, "b", 0, *make_states(2), LAYERS)
    assert release(tmp_path, "a") == 2
    assert not (tmp_path / "a").exists()
    assert assemble(tmp_path, "b").num_tokens == 2
    assert release(tmp_path, "a") == 0  # idempotent


def test_release_keeps_foreign_files(tmp_path):
    write_segment(tmp_path, "c", 0, *make_states(2), LAYERS)
    (tmp_path / "c" / "notes.txt").write_text("not a segment")
    with pytest.raises(SegmentError, match="notes.txt"):
        release(tmp_path, "c")
    assert (tmp_path / "c" / "notes.txt").read_text() == "not a segment"
    assert not (tmp_path / "c" / "0000000000.safetensors").exists()


def test_release_races_a_writer_that_renames_its_temp_file(tmp_path, monkeypatch):
    """A capture given up as lost while the server's writer still publishes a later chunk: the temp
    file release listed is renamed into a segment before release unlinks it (as CI once saw). The
    release still empties and removes the rid, and counts the segment the rename published."""
    write_segment(tmp_path, "race", 0, *make_states(2), LAYERS)
    temp = tmp_path / "race" / ".0000000002.safetensors.1-2.tmp"
    temp.write_bytes(b"partial")
    real_unlink, raced = os.unlink, []

    def writer_wins(path, *args, **kwargs):
        if Path(path) == temp and not raced:
            raced.append(path)
            os.rename(temp, segment_path(tmp_path, "race", 2))  # the writer's publish lands first
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", writer_wins)
    assert release(tmp_path, "race") == 2
    assert raced and not (tmp_path / "race").exists()


def test_release_still_refuses_foreign_files_beside_a_racing_writer(tmp_path, monkeypatch):
    write_segment(tmp_path, "mixed", 0, *make_states(2), LAYERS)
    (tmp_path / "mixed" / "notes.txt").write_text("keep me")
    temp = tmp_path / "mixed" / ".0000000002.safetensors.1-2.tmp"
    temp.write_bytes(b"partial")
    real_unlink = os.unlink

    def writer_drops_its_temp(path, *args, **kwargs):
        if Path(path) == temp:
            real_unlink(temp)  # the writer failed and removed its own temp file first
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", writer_drops_its_temp)
    with pytest.raises(SegmentError, match="notes.txt"):
        release(tmp_path, "mixed")
    assert sorted(p.name for p in (tmp_path / "mixed").iterdir()) == ["notes.txt"]


def test_release_names_a_writer_that_never_stops_publishing(tmp_path, monkeypatch):
    write_segment(tmp_path, "busy", 0, *make_states(2), LAYERS)
    real_unlink, published = os.unlink, []

    def writer_publishes_again(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        published.append(write_segment(tmp_path, "busy", 2 * len(published) + 2, *make_states(2), LAYERS))

    monkeypatch.setattr(os, "unlink", writer_publishes_again)
    with pytest.raises(SegmentError, match="a writer kept publishing"):
        release(tmp_path, "busy")
    assert len(published) == 8


def test_release_refuses_symlinked_rid_dir(tmp_path):
    outside = tmp_path / "outside"
    write_segment(outside, "victim", 0, *make_states(2), LAYERS)
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "victim").symlink_to(outside / "victim")
    with pytest.raises(SegmentError, match="symlink"):
        release(spool, "victim")
    assert (outside / "victim" / "0000000000.safetensors").exists()


def test_all_finite_finds_any_nan_or_inf_anywhere():
    import torch

    from engine.records import all_finite

    x = torch.randn(64, 48).to(torch.bfloat16)
    assert all_finite(x) and all_finite(torch.empty(0, 4))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0), (31, 17), (63, 47)):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y), (bad, where)


# ---- publishing without fsync ---------------------------------------------------------

def test_segment_is_published_whole_and_never_fsynced(tmp_path, monkeypatch):
    """The spool is scratch (an extraction session re-captures whatever a crash interrupted), so a
    segment is renamed into place complete but not fsynced: every fsync hands the GIL away, which
    the server's model thread pays for. A failing fsync proves none is called."""
    def no_fsync(fd):
        raise AssertionError("a spool segment must not be fsynced")

    monkeypatch.setattr(os, "fsync", no_fsync)
    ids, aux, final = make_states(5)
    path = write_segment(tmp_path, "fast", 0, ids, aux, final, LAYERS)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left behind
    cap = assemble(tmp_path, "fast", expected_len=5)
    assert torch.equal(cap.aux_hidden_state, aux) and torch.equal(cap.hidden_state, final)


def test_failed_segment_write_leaves_neither_segment_nor_temp(tmp_path, monkeypatch):
    import engine.capture.segments as segments

    def half_write(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"\x00" * 100)  # what a writer killed mid-file leaves
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segments, "_save", half_write)
    with pytest.raises(OSError, match="No space left"):
        write_segment(tmp_path, "full", 0, *make_states(4), LAYERS)
    assert list_segments(tmp_path, "full") == []
    assert list((tmp_path / "full").iterdir()) == []
    assert release(tmp_path, "full") == 0 and not (tmp_path / "full").exists()


def test_in_flight_temp_is_invisible_to_readers_and_freed_by_release(tmp_path):
    from engine.io.atomic import publish_via_path

    ids, aux, final = make_states(3)
    write_segment(tmp_path, "busy", 0, ids, aux, final, LAYERS)
    seen = {}

    def writer(tmp):  # a second segment caught mid-write: readers must not see it
        open(tmp, "wb").write(b"partial")
        seen["segments"] = [info.start for info in list_segments(tmp_path, "busy")]
        seen["release"] = release(tmp_path, "busy")  # frees the temp file too
        raise RuntimeError("stop before the rename")

    with pytest.raises(RuntimeError):
        publish_via_path(segment_path(tmp_path, "busy", 3), writer)
    assert seen == {"segments": [0], "release": 1}
    assert not (tmp_path / "busy").exists()


def test_a_capture_written_after_the_read_began_is_waited_for_and_a_wrong_one_is_not(tmp_path):
    """A chunked prefill's segments landing out of order while the reader waits (the later chunk
    first, then the gap filled): the read returns the whole capture. A capture that cannot become
    right by waiting (overlapping segments, other token ids) fails at once, not after `wait_s`."""
    import threading
    import time

    first, second = make_states(5), make_states(4, 5)
    write_segment(tmp_path, "late", 5, *second, LAYERS)
    timer = threading.Timer(0.3, write_segment, (tmp_path, "late", 0, *first, LAYERS))
    timer.start()
    started = time.monotonic()
    capture = assemble(tmp_path, "late", expected_len=9, expected_input_ids=list(range(9)), wait_s=30)
    assert 0.25 <= time.monotonic() - started < 10
    assert torch.equal(capture.aux_hidden_state, torch.cat([first[1], second[1]]))
    with pytest.raises(CaptureIncomplete, match="gap in capture"):  # no wait asked: the old answer
        write_segment(tmp_path, "gap", 3, *make_states(2, 3), LAYERS)
        assemble(tmp_path, "gap", expected_len=5)
    write_segment(tmp_path, "wrong", 0, *make_states(4, 100), LAYERS)
    write_segment(tmp_path, "overlap", 0, *make_states(4), LAYERS)
    write_segment(tmp_path, "overlap", 2, *make_states(4, 2), LAYERS)
    for rid, expected_ids, message in (("wrong", list(range(4)), "differ from the ids that were sent"),
                                       ("overlap", None, "overlap in capture")):
        started = time.monotonic()
        with pytest.raises(SegmentError, match=message) as caught:
            assemble(tmp_path, rid, expected_len=4 if rid == "wrong" else 6, expected_input_ids=expected_ids,
                     wait_s=30)
        assert not isinstance(caught.value, CaptureIncomplete) and time.monotonic() - started < 5


def test_a_segment_marked_failed_fails_the_waiting_reader_at_once_and_is_released(tmp_path):
    """A server that answered before writing marks a write that then failed: a reader waiting for the
    capture (first chunk written, second still missing) fails at once with the server's reason, not
    after `wait_s`; `release` frees the mark with the segments."""
    import threading
    import time

    write_segment(tmp_path, "lost", 0, *make_states(5), LAYERS)
    reason = "capture write failed: the capture writer process exited (code -9)"
    timer = threading.Timer(0.3, mark_failed, (tmp_path, "lost", 5, reason))
    timer.start()
    started = time.monotonic()
    with pytest.raises(SegmentError, match=r"failed in the server's writer: .*exited \(code -9\)") as caught:
        with open_capture(tmp_path, "lost", 9, wait_s=30):
            pass
    assert not isinstance(caught.value, CaptureIncomplete) and 0.25 <= time.monotonic() - started < 5
    assert sorted(p.name for p in (tmp_path / "lost").iterdir()) == ["0000000000.safetensors", "0000000005.failed"]
    assert release(tmp_path, "lost") == 1 and not (tmp_path / "lost").exists()
    with pytest.raises(UnsafeNameError):
        mark_failed(tmp_path, "../escape", 0, reason)


def test_a_full_spool_still_takes_the_failure_mark_without_its_reason(tmp_path):
    """On a spool too full for another page (a real tmpfs filled to the last byte), the mark goes in empty
    and the reader still fails at once, saying the spool was full (`no_space`: the job pauses instead of
    counting it against the sample). A later mark of the same segment does not replace the first."""
    import errno

    from faults.helpers import tmpfs

    with tmpfs(tmp_path / "spool", "256k") as spool:
        (spool / "full").mkdir()
        with open(spool / "ballast", "wb", buffering=0) as handle:
            with pytest.raises(OSError) as full:
                while True:
                    handle.write(b"\0" * 4096)
        assert full.value.errno == errno.ENOSPC
        assert try_mark_failed(spool, "full", 0, "capture write failed: [Errno 28] No space left on device") is None
        with pytest.raises(CaptureLost, match="was lost: the spool .* was full when the server wrote it") as lost:
            open_capture(spool, "full", 4, wait_s=30)
        assert lost.value.no_space
        assert try_mark_failed(spool, "full", 0, "the writer process exited") is None
        assert sorted(p.name for p in (spool / "full").iterdir()) == ["0000000000.nospace"]
        assert release(spool, "full") == 0 and not (spool / "full").exists()
