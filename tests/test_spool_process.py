"""The capture writer process (engine/capture/spool_process.py): a real child process, real shared
memory, real segment files, real signals; and the local server falling back to its own writer
threads when that child is killed under it."""

from __future__ import annotations

from tests.helpers.processes import free_port, local_server_argv, stop_process, wait_healthy, writer_child_pid

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from engine.capture.segments import SegmentError, assemble, list_segments, open_capture, write_segment
from engine.capture.spool_process import SpoolProcessError, SpoolWriterProcess, shm_room_problem
from engine.client import ServerClient

REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 2, 3]


def _batch(rows: int, width: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (rows, width), generator=generator)
    aux = torch.randn(rows, width, 3 * hidden, generator=generator).to(dtype)
    final = torch.randn(rows, width, hidden, generator=generator).to(dtype)
    return ids, aux, final


def _contents(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key).view(torch.uint8).flatten().tolist() for key in handle.keys()}
        return handle.metadata(), tensors


def _packed(lengths, ids, aux, final):
    """The first lengths[i] tokens of row i of a padded batch, packed back to back as a server holds a batch."""
    return tuple(torch.cat([t[i, :n] for i, n in enumerate(lengths)]) for t in (ids, aux, final))


def _submit(process, rids, lengths, ids, aux, final, replies, starts=None):
    """Row i of a padded batch as the segment (rids[i], starts[i] or 0, lengths[i] tokens), handed over packed."""
    starts = starts or [0] * len(rids)
    process.submit_packed(list(zip(rids, starts, lengths)), *_packed(lengths, ids, aux, final), replies)


class _Replies:
    def __init__(self) -> None:
        self.got: list[list[str | None]] = []
        self.event = threading.Event()

    def __call__(self, errors: list[str | None]) -> None:
        self.got.append(errors)
        self.event.set()

    def wait(self, timeout: float = 30) -> list[str | None]:
        assert self.event.wait(timeout), "no reply from the writer process"
        self.event.clear()
        return self.got[-1]


@pytest.fixture()
def writer(tmp_path):
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=1 << 20, slots=2, threads=2)
    process.start()
    yield process
    process.close(timeout=10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_batch_becomes_the_same_files_as_the_in_process_writer(writer, tmp_path, dtype):
    """Rows of different lengths, each cut to its own length; the files hold the same tensors and
    metadata as what `write_segment` writes in-process (safetensors orders header keys by a hash,
    so the bytes themselves may differ), and a bad request id fails only its own row."""
    ids, aux, final = _batch(4, 12, 16, dtype)
    lengths, rids = [12, 5, 1, 7], ["row-a", "row-b", "../escape", "row-d"]
    replies = _Replies()
    _submit(writer, rids, lengths, ids, aux, final, replies)
    errors = replies.wait()
    assert errors[0] is None and errors[1] is None and errors[3] is None
    assert errors[2] is not None and "invalid request id '../escape'" in errors[2]
    assert not (tmp_path / "escape").exists()
    reference = tmp_path / "reference"
    for i in (0, 1, 3):
        n = lengths[i]
        capture = assemble(writer.spool_dir, rids[i], expected_len=n, expected_input_ids=ids[i, :n].tolist())
        assert torch.equal(capture.aux_hidden_state, aux[i, :n]) and torch.equal(capture.hidden_state, final[i, :n])
        expected = write_segment(reference, rids[i], 0, ids[i, :n], aux[i, :n], final[i, :n], LAYERS)
        written = writer.spool_dir / rids[i] / expected.name
        assert _contents(written) == _contents(expected)


def test_nothing_is_left_in_dev_shm_and_close_is_clean(tmp_path):
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=1 << 20, slots=2, threads=1)
    process.start()
    # Its own name only: other tests (other workers) may hold arenas in /dev/shm meanwhile.
    name = process.arena_name
    assert process.alive and name and name not in os.listdir("/dev/shm"), "the name is dropped once both sides map it"
    replies = _Replies()
    ids, aux, final = _batch(2, 4, 8, torch.float32)
    _submit(process, ["a", "b"], [4, 3], ids, aux, final, replies)
    assert replies.wait() == [None, None]
    pid = process.pid
    process.close(timeout=10)
    assert not process.alive and process.failure is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(SpoolProcessError, match="not running"):
        _submit(process, ["c"], [4], ids, aux, final, replies)


def test_a_killed_writer_fails_the_batches_it_held_and_refuses_more(writer):
    """SIGSTOP holds a batch in the child, SIGKILL loses it: its rows are answered with an error
    naming the exit code (nothing hangs), the failure callback is not needed for that, and the
    next submit raises instead of waiting for a slot forever."""
    ids, aux, final = _batch(3, 6, 8, torch.bfloat16)
    os.kill(writer.pid, signal.SIGSTOP)
    replies = _Replies()
    _submit(writer, ["x0", "x1", "x2"], [6, 6, 2], ids, aux, final, replies)
    os.kill(writer.pid, signal.SIGKILL)
    errors = replies.wait()
    assert len(errors) == 3 and all("exited (code -9)" in e and "1 batch(es) unwritten" in e for e in errors), errors
    assert not writer.alive and "code -9" in writer.failure
    with pytest.raises(SpoolProcessError, match="exited"):
        _submit(writer, ["y"], [6], ids, aux, final, replies)


def test_a_batch_is_handed_over_before_it_is_written(writer):
    """`on_handed` comes once every slot of the batch is in the child's hands, before the child has
    written a byte (it is stopped); `on_done` only after it goes on, and the segments are then whole."""
    ids, aux, final = _batch(2, 6, 8, torch.bfloat16)
    handed, replies = threading.Event(), _Replies()
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        writer.submit_packed([("h0", 0, 6), ("h1", 0, 3)], *_packed([6, 3], ids, aux, final), replies,
                             on_handed=handed.set)
        assert handed.wait(30), "the batch never reached the child"
        time.sleep(0.2)
        assert not replies.event.is_set() and not (writer.spool_dir / "h0").exists()
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    assert replies.wait() == [None, None]
    for rid, n in (("h0", 6), ("h1", 3)):
        assert torch.equal(assemble(writer.spool_dir, rid, expected_len=n).aux_hidden_state, aux[int(rid[1]), :n])


def test_a_stop_signal_to_the_group_does_not_lose_what_the_child_holds(writer):
    """SIGTERM and SIGINT (a job stop or Ctrl-C reach the whole process group) while the child holds an
    answered batch: it still writes it, and it ends only when told to."""
    ids, aux, final = _batch(1, 6, 8, torch.bfloat16)
    handed, replies = threading.Event(), _Replies()
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        writer.submit_packed([("kept", 0, 6)], *_packed([6], ids, aux, final), replies, on_handed=handed.set)
        assert handed.wait(30)
        os.kill(writer.pid, signal.SIGTERM)
        os.kill(writer.pid, signal.SIGINT)
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    assert replies.wait() == [None] and writer.alive
    assert torch.equal(assemble(writer.spool_dir, "kept", expected_len=6).hidden_state, final[0])


def test_submit_waits_for_a_free_slot(tmp_path):
    """Backpressure: with every slot in the (stopped) child's hands, submit blocks; it goes on as
    soon as the child answers."""
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=1 << 20, slots=1, threads=1)
    process.start()
    try:
        ids, aux, final = _batch(1, 4, 8, torch.float32)
        first, second = _Replies(), _Replies()
        os.kill(process.pid, signal.SIGSTOP)
        _submit(process, ["one"], [4], ids, aux, final, first)
        blocked = threading.Thread(target=_submit, args=(process, ["two"], [4], ids, aux, final, second))
        blocked.start()
        blocked.join(1.0)
        assert blocked.is_alive(), "the second batch must wait: the only slot is taken"
        os.kill(process.pid, signal.SIGCONT)
        blocked.join(30)
        assert not blocked.is_alive() and first.wait() == [None] and second.wait() == [None]
    finally:
        process.close(timeout=10)


def test_a_batch_larger_than_a_slot_is_cut_into_slots_and_a_long_row_into_segments(tmp_path):
    """Four rows of 40 tokens through slots of 16: the rows are packed into ten slots (two in the
    child's hands at a time), each row becomes consecutive segments of its request, and the spool's
    reader joins them into exactly the row's states. One answer, one entry per row."""
    ids, aux, final = _batch(4, 40, 8, torch.bfloat16)
    per_token = 8 + 3 * 8 * 2 + 8 * 2
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=16 * per_token + 48, slots=2, threads=2)
    process.start()
    try:
        assert process.tokens_per_slot(per_token) == 16
        lengths, rids = [40, 33, 17, 1], ["long-a", "long-b", "long-c", "short-d"]
        replies = _Replies()
        _submit(process, rids, lengths, ids, aux, final, replies)
        assert replies.wait() == [None] * 4
        assert len(replies.got) == 1, "one answer for the whole submit"
        starts = {rid: [info.start for info in list_segments(process.spool_dir, rid)] for rid in rids}
        assert starts["long-a"] == [0, 16, 32], starts  # the first row starts a slot
        assert all(len(found) >= 2 for rid, found in starts.items() if rid != "short-d"), starts
        assert starts["short-d"] == [0]
        for i, rid in enumerate(rids):
            n = lengths[i]
            capture = assemble(process.spool_dir, rid, expected_len=n, expected_input_ids=ids[i, :n].tolist())
            assert torch.equal(capture.aux_hidden_state, aux[i, :n]) and torch.equal(capture.hidden_state, final[i, :n])
    finally:
        process.close(timeout=10)


def test_a_packed_batch_cut_over_slots_becomes_the_same_files_as_the_in_process_writer(tmp_path):
    """Segments of a packed batch through slots of 16 tokens: each segment file holds exactly what
    `write_segment` writes in-process for the same rows and start, one answer per segment, a segment of
    no tokens included; a segment starting past 0 (a chunked prefill's later chunk) keeps its position."""
    ids, aux, final = _batch(4, 40, 8, torch.bfloat16, seed=9)
    per_token = 8 + 3 * 8 * 2 + 8 * 2
    lengths, rids, starts = [40, 0, 17, 23], ["pa", "pz", "pc", "pd"], [0, 0, 0, 64]
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=16 * per_token + 48, slots=2, threads=2)
    process.start()
    try:
        replies = _Replies()
        _submit(process, rids, lengths, ids, aux, final, replies, starts=starts)
        assert replies.wait() == [None] * 4 and len(replies.got) == 1
    finally:
        process.close(timeout=10)
    reference = tmp_path / "reference"
    for i, rid in enumerate(rids):
        found = list_segments(process.spool_dir, rid)
        if not lengths[i]:
            assert not found and not (process.spool_dir / rid).exists()
            continue
        assert found[0].start == starts[i] and len(found) >= 2, [s.start for s in found]
        bounds = [s.start - starts[i] for s in found] + [lengths[i]]
        for segment, first, end in zip(found, bounds, bounds[1:]):
            expected = write_segment(reference, rid, segment.start, ids[i, first:end], aux[i, first:end],
                                     final[i, first:end], LAYERS)
            assert _contents(segment.path) == _contents(expected), segment.path.name


def test_a_packed_batch_whose_rows_disagree_with_its_table_is_refused(writer):
    ids, aux, final = _packed([4, 4], *_batch(2, 4, 8, torch.float32))
    with pytest.raises(ValueError, match="8/8/8 rows .* segments of 9 tokens: the rows and the segment table disagree"):
        writer.submit_packed([("a", 0, 4), ("b", 0, 5)], ids, aux, final, _Replies())
    with pytest.raises(ValueError, match="disagree"):
        writer.submit_packed([("a", 0, 4), ("b", 0, 4)], ids, aux[:7], final, _Replies())
    replies = _Replies()
    writer.submit_packed([], ids[:0], aux[:0], final[:0], replies)
    assert replies.wait() == []


def test_a_child_dying_between_slots_answers_every_piece_once(tmp_path):
    """The first slot is in the (stopped) child's hands and the second waits for a free slot when the
    child is killed: submit returns without raising, and its one answer gives every piece the exit
    code, the pieces of the slot never handed over included."""
    ids, aux, final = _batch(2, 16, 8, torch.float32)

    def submit(process, rids, n, replies):
        _submit(process, rids, [n] * len(rids), ids, aux, final, replies)

    per_token = 8 + 3 * 8 * 4 + 8 * 4
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=16 * per_token + 48, slots=1, threads=1)
    process.start()
    try:
        os.kill(process.pid, signal.SIGSTOP)
        replies = _Replies()
        submitting = threading.Thread(target=submit, args=(process, ["p0", "p1"], 16, replies))
        submitting.start()
        submitting.join(1.0)
        assert submitting.is_alive(), "the second slot must wait: the only one is taken"
        os.kill(process.pid, signal.SIGKILL)
        submitting.join(30)
        assert not submitting.is_alive()
        errors = replies.wait()
        assert len(replies.got) == 1 and len(errors) == 2
        assert all(error is not None and "code -9" in error for error in errors), errors
        with pytest.raises(SpoolProcessError, match="exited"):
            submit(process, ["p2"], 4, _Replies())
    finally:
        process.close(timeout=10)


def test_close_right_after_submit_still_writes_the_filled_slots(tmp_path):
    """Filled slots wait for the sender thread; closing at once must send them first, not drop them."""
    ids, aux, final = _batch(3, 20, 8, torch.float32)
    per_token = 8 + 3 * 8 * 4 + 8 * 4
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=16 * per_token + 48, slots=4, threads=2)
    process.start()
    replies = _Replies()
    _submit(process, ["c0", "c1", "c2"], [20, 20, 20], ids, aux, final, replies)
    process.close(timeout=30)
    assert replies.wait() == [None, None, None] and process.failure is None
    for i in range(3):
        capture = assemble(process.spool_dir, f"c{i}", expected_len=20, expected_input_ids=ids[i].tolist())
        assert torch.equal(capture.aux_hidden_state, aux[i]) and torch.equal(capture.hidden_state, final[i])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU box)")
def test_device_states_are_copied_straight_into_the_pinned_arena(tmp_path):
    """CUDA states: the arena is registered with CUDA on first use and the copies land in it
    asynchronously, on a side stream as the server issues them; the source tensors are dropped by
    the caller at once (the writer keeps them alive until the copies have landed). The files equal
    the device states, across several slots."""
    ids, aux, final = _batch(4, 40, 64, torch.bfloat16, seed=3)
    per_token = 8 + 3 * 64 * 2 + 64 * 2
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=32 * per_token + 48, slots=3, threads=2)
    process.start()
    try:
        stream = torch.cuda.Stream()
        replies = _Replies()
        device_aux, device_final = aux.cuda(), final.cuda()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _submit(process, ["g0", "g1", "g2", "g3"], [40, 39, 1, 25], ids, device_aux, device_final, replies)
        del device_aux, device_final
        assert replies.wait() == [None] * 4 and process.pinned
        for i, n in enumerate([40, 39, 1, 25]):
            capture = assemble(process.spool_dir, f"g{i}", expected_len=n, expected_input_ids=ids[i, :n].tolist())
            assert torch.equal(capture.aux_hidden_state, aux[i, :n]) and torch.equal(capture.hidden_state, final[i, :n])
    finally:
        process.close(timeout=10)
    assert not process.pinned


def test_too_little_shared_memory_is_refused_before_anything_starts(tmp_path):
    stats = os.statvfs("/dev/shm")
    too_much = stats.f_bavail * stats.f_frsize + (1 << 30)
    problem = shm_room_problem(too_much)
    assert problem is not None and "MiB free" in problem and "--shm-size" in problem
    assert shm_room_problem(1 << 20) is None
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=too_much, slots=1)
    with pytest.raises(SpoolProcessError, match="MiB free"):
        process.start()
    assert process.pid is None and not process.alive


def test_a_child_that_cannot_be_spawned_is_a_spool_process_error_with_nothing_left(tmp_path, monkeypatch):
    """fork/exec refused (EAGAIN at a process limit): start says so as SpoolProcessError, which the server's
    sink answers with writer threads, and drops the arena. It raised AssertionError (close joined a child
    never started) and left the arena in /dev/shm."""
    import multiprocessing.context

    def refused(self):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refused)
    process = SpoolWriterProcess(tmp_path / "spool", LAYERS, slot_bytes=1 << 20, slots=2, threads=1)
    created = []
    real_shm = shared_memory.SharedMemory

    def remember(*args, **kwargs):
        created.append(real_shm(*args, **kwargs))
        return created[-1]

    monkeypatch.setattr(shared_memory, "SharedMemory", remember)
    with pytest.raises(SpoolProcessError, match="Resource temporarily unavailable"):
        process.start()
    assert process.pid is None and not process.alive
    assert created and created[0].name.lstrip("/") not in os.listdir("/dev/shm")


@contextlib.contextmanager
def _server_with_writer_process(model_dir: Path, tmp_path: Path):
    """A real local server with EAGLE3_CAPTURE_WRITER=process: (url, spool, the child's pid, log path)."""
    spool, log = tmp_path / "spool", tmp_path / "server.log"
    port = free_port()
    argv = local_server_argv(model_dir, port, "--capture-layers", "0,1,2", "--spool-dir", str(spool))
    with open(log, "wb") as handle:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "EAGLE3_CAPTURE_WRITER": "process"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url, spool, writer_child_pid(_writer_description(url)), log
    finally:
        stop_process(proc)


def _capture(url: str, prompt: list[int], rids: list[str]) -> None:
    async def send():
        async with ServerClient(url, timeout=30) as client:
            await asyncio.gather(*(client.generate(input_ids=prompt, max_new_tokens=0, rid=r) for r in rids))

    asyncio.run(send())


def _writer_description(url: str) -> str:
    return httpx.get(f"{url}/server_info", timeout=10).json()["capture"]["writer"]


def test_the_server_keeps_capturing_when_its_writer_process_is_killed(tiny_model_dir, tmp_path):
    """/server_info names the child; after SIGKILL to it the server says so (log and /server_info) and
    its own threads write the segments of later requests, which match the ones written before."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with _server_with_writer_process(tiny_model_dir, tmp_path) as (url, spool, child, log):
        _capture(url, prompt, ["before-0", "before-1"])
        # Answered once the child held the states; their segments follow.
        before = assemble(spool, "before-0", expected_len=len(prompt), expected_input_ids=prompt, wait_s=30)
        os.kill(child, signal.SIGKILL)
        deadline = time.time() + 30
        while "exited" not in (writer := _writer_description(url)):
            assert time.time() < deadline, writer
            time.sleep(0.1)
        assert writer.startswith("threads (4); the capture writer process exited (code -9)"), writer
        _capture(url, prompt, ["after-0", "after-1", "after-2"])
        for rid in ("after-0", "after-1", "after-2"):
            after = assemble(spool, rid, expected_len=len(prompt), expected_input_ids=prompt, wait_s=30)
            assert torch.equal(after.aux_hidden_state, before.aux_hidden_state)
            assert torch.equal(after.hidden_state, before.hidden_state)
    assert "threads write the segments from now on" in log.read_text()


def test_the_server_answers_once_its_writer_holds_the_states_and_marks_a_write_lost_after(tiny_model_dir, tmp_path):
    """The writer child stopped: the request is still answered (its states are in the child's hands) and
    no segment exists yet. The child killed: the capture can never be written, and a reader waiting
    for it fails at once with the server's reason (a failure mark in the spool), not after `wait_s`."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with _server_with_writer_process(tiny_model_dir, tmp_path) as (url, spool, child, log):
        os.kill(child, signal.SIGSTOP)
        try:
            _capture(url, prompt, ["held"])
            assert not (spool / "held").exists(), "answered before the write: nothing can be in the spool yet"
        finally:
            os.kill(child, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(SegmentError, match=r"failed in the server's writer: .*exited \(code -9\)"):
            open_capture(spool, "held", len(prompt), prompt, wait_s=30)
        assert time.monotonic() - started < 15
    assert "capture: request held: capture write failed" in log.read_text()


def test_writer_mode_from_the_environment(monkeypatch):
    from engine.localserver.settings import capture_writer_count, capture_writer_mode

    for raw, expected in (("", "process"), ("threads", "threads"), (" Process ", "process"), (" THREADS", "threads")):
        monkeypatch.setenv("EAGLE3_CAPTURE_WRITER", raw)
        assert capture_writer_mode() == expected
    monkeypatch.setenv("EAGLE3_CAPTURE_WRITER", "bogus")
    with pytest.raises(ValueError, match="EAGLE3_CAPTURE_WRITER='bogus' is not one of process, threads: set one"):
        capture_writer_mode()
    monkeypatch.delenv("EAGLE3_CAPTURE_WRITERS", raising=False)
    assert capture_writer_count() == 4
    for bad in ("0", "65", "four"):
        monkeypatch.setenv("EAGLE3_CAPTURE_WRITERS", bad)
        with pytest.raises(ValueError, match=f"EAGLE3_CAPTURE_WRITERS='{bad}' is not a number of writer threads"):
            capture_writer_count()


def test_slot_tokens_and_slots_from_the_environment(monkeypatch):
    """EAGLE3_CAPTURE_SLOT_TOKENS sizes the local server's slots (a bad value is refused, naming it); the
    slot count fits 1 GiB, from 3 to 9."""
    from engine.localserver.settings import capture_slot_tokens, capture_slots

    monkeypatch.delenv("EAGLE3_CAPTURE_SLOT_TOKENS", raising=False)
    assert capture_slot_tokens(4096) == 4096
    monkeypatch.setenv("EAGLE3_CAPTURE_SLOT_TOKENS", " 16 ")
    assert capture_slot_tokens(4096) == 16
    for bad in ("0", "-8", "many", str((1 << 20) + 1)):
        monkeypatch.setenv("EAGLE3_CAPTURE_SLOT_TOKENS", bad)
        with pytest.raises(ValueError, match=f"EAGLE3_CAPTURE_SLOT_TOKENS='{bad}' is not a whole number of tokens"):
            capture_slot_tokens(4096)
    assert [capture_slots(8192 * per_token + 48) for per_token in (5128, 16392, 32776)] == [9, 7, 3]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")
def test_the_writer_process_is_named_so_ps_and_the_capture_bench_can_tell_it_apart(writer):
    import psutil

    from engine.capture.spool_process import WRITER_PROCESS_NAME

    assert psutil.Process(writer.pid).name() == WRITER_PROCESS_NAME
    assert psutil.Process().name() != WRITER_PROCESS_NAME  # the parent keeps its own


def test_the_servers_writer_description_says_whether_device_copies_are_asynchronous(tmp_path, monkeypatch):
    """/server_info's capture writer: nothing about pinning before a batch came from a GPU (CPU), and a
    plain warning when CUDA refused to pin the arena (the copies then hold up the model thread)."""
    from engine.localserver.capture_sink import CaptureConfig, CaptureSink

    sink = CaptureSink()
    sink.mode = "process"
    sink.config = CaptureConfig(layers=LAYERS, spool_dir=tmp_path / "spool")
    sink.start(state_bytes=64 * 2, slot_tokens=8)
    try:
        assert sink.describe() == f"process (pid {sink._process.pid})"

        class RefusingRuntime:
            def cudaHostRegister(self, *args):  # noqa: N802 - CUDA's name
                return 1  # cudaErrorInvalidValue

        monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingRuntime())
        sink._process._register()
        assert sink.describe() == (f"process (pid {sink._process.pid}; arena NOT pinned: device copies wait on "
                                   "the model thread)")
    finally:
        sink.close()
