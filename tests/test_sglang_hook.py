"""The SGLang capture hook, driven the way SGLang 0.5.23 drives it.

SGLang's ForwardBatch needs CUDA/triton to import, so the batches here are minimal
stand-ins with the same attribute names (forward_mode with an enum `.name`, rids,
extend_seq_lens_cpu, extend_prefix_lens_cpu); test_sglang_launch.py checks those names
against the real 0.5.23 source. The hook is registered with torch's real
`register_forward_hook` on a module called positionally like SGLang's logits processor, and
the segments it writes are assembled with the real engine.capture.segments.assemble.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import pytest
import torch

from engine.capture.segments import SegmentError, assemble, list_segments
from engine.sglang.hook import CaptureConfigError, CaptureHook, make_capture_hook, should_capture

H = 8
LAYERS = [1, 2, 3]
# flush returns as soon as the writer is done; the bound only has to outlast a writer process's start
# (it imports torch) on a loaded two-core CI machine.
FLUSH_S = 60


class ForwardMode(enum.IntEnum):  # same member names as sglang's ForwardMode
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    TARGET_VERIFY = 5


@dataclass
class Batch:
    forward_mode: ForwardMode
    rids: list[str]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]


class LogitsProcessor(torch.nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        return hidden_states.sum()


def full_states(rid_seed: int, length: int):
    """Deterministic per-request ids, aux [L, 3H] and final [L, H] for positions 0..L-1."""
    g = torch.Generator().manual_seed(rid_seed)
    ids = torch.randint(0, 1000, (length,), generator=g)
    aux = torch.randn(length, 3 * H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    final = torch.randn(length, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    return ids, aux, final


def run_batch(module, batch: Batch, chunks, aux_as_list: bool = False):
    """chunks: per request (ids, aux, final) rows in the batch order."""
    ids = torch.cat([c[0] for c in chunks])
    aux = torch.cat([c[1] for c in chunks])
    final = torch.cat([c[2] for c in chunks])
    aux_arg = list(aux.split(H, dim=-1)) if aux_as_list else aux
    module(ids, final, None, batch, aux_arg)


@pytest.fixture(params=["process", "threads"])
def hooked(tmp_path, request):
    hook = CaptureHook(str(tmp_path / "spool"), LAYERS, rank_fn=lambda: 0, writer=request.param)
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    yield hook, module, tmp_path / "spool"
    hook.close()


def test_batches_chunks_health_and_decode_assemble_exactly(hooked):
    hook, module, spool = hooked
    a, b, c = full_states(1, 10), full_states(2, 7), full_states(3, 12)
    health = full_states(4, 1)
    auto = full_states(5, 3)
    # Batch 1: request a whole, request c's first chunk (0..4), a health check, an SGLang-generated rid.
    run_batch(module, Batch(ForwardMode.EXTEND, ["xa", "xc", "HEALTH_CHECK_123", "0" * 32], [10, 5, 1, 3], [0, 0, 0, 0]),
              [tuple(t[:10] for t in a), tuple(t[:5] for t in c), health, auto])
    # Batch 2: c's middle chunk (prefix 5), b whole; aux as a list like the unpacked models pass it.
    run_batch(module, Batch(ForwardMode.EXTEND, ["xc", "xb"], [4, 7], [5, 0]),
              [tuple(t[5:9] for t in c), b], aux_as_list=True)
    # A decode batch and a mixed batch: ignored.
    run_batch(module, Batch(ForwardMode.DECODE, ["xa", "xb"], [1, 1], [10, 7]),
              [tuple(t[:1] for t in a), tuple(t[:1] for t in b)])
    run_batch(module, Batch(ForwardMode.MIXED, ["xd"], [2], [0]), [tuple(t[:2] for t in a)])
    # Batch 3: c's last chunk (prefix 9).
    run_batch(module, Batch(ForwardMode.EXTEND, ["xc"], [3], [9]), [tuple(t[9:] for t in c)])
    assert hook.flush(FLUSH_S)
    assert hook.errors == [] and hook.written == 5
    assert hook.batches_by_process == (3 if hook.writer == "process" else 0)  # the three extend batches

    for rid, (ids, aux, final) in {"xa": a, "xb": b, "xc": c}.items():
        cap = assemble(spool, rid, expected_len=len(ids), expected_input_ids=ids.tolist())
        assert torch.equal(cap.aux_hidden_state, aux) and torch.equal(cap.hidden_state, final)
        assert cap.layers == LAYERS
    assert [s.start for s in list_segments(spool, "xc")] == [0, 5, 9]
    assert sorted(p.name for p in spool.iterdir()) == ["xa", "xb", "xc"]  # no health/auto/decode/mixed rid


def test_nonzero_rank_writes_nothing(tmp_path):
    hook = CaptureHook(str(tmp_path / "spool"), LAYERS, rank_fn=lambda: 1)
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    run_batch(module, Batch(ForwardMode.EXTEND, ["xa"], [4], [0]), [full_states(1, 4)])
    assert hook.flush(FLUSH_S)
    hook.close()
    assert not (tmp_path / "spool").exists()
    with pytest.raises(SegmentError):
        assemble(tmp_path / "spool", "xa")


def test_unsafe_rids_are_skipped_not_written(hooked):
    hook, module, spool = hooked
    run_batch(module, Batch(ForwardMode.EXTEND, ["../evil", "ok-1"], [2, 2], [0, 0]),
              [full_states(1, 2), full_states(2, 2)])
    assert hook.flush(FLUSH_S)
    assert sorted(p.name for p in spool.iterdir()) == ["ok-1"]
    assert not should_capture("../evil") and not should_capture("HEALTH_CHECK_x") and should_capture("x1-abc-a0")


def test_factory_reads_environment_and_refuses_without_it(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE3_CAPTURE_SPOOL", raising=False)
    monkeypatch.delenv("EAGLE3_CAPTURE_LAYERS", raising=False)
    with pytest.raises(CaptureConfigError, match="EAGLE3_CAPTURE_SPOOL"):
        make_capture_hook({"sglang": "0.5.23"})
    monkeypatch.setenv("EAGLE3_CAPTURE_SPOOL", str(tmp_path / "s"))
    monkeypatch.setenv("EAGLE3_CAPTURE_LAYERS", "1,2,3")
    with pytest.raises(CaptureConfigError, match="differ"):
        make_capture_hook({"layers": [0, 1, 2], "sglang": "0.5.23"})
    hook = make_capture_hook({"layers": [1, 2, 3], "sglang": "0.5.23"})
    try:
        assert hook.spool_dir == str(tmp_path / "s") and hook.layers == [1, 2, 3]
        assert hook._rank_fn() == 0  # no sglang, no torch.distributed: a single writer
    finally:
        hook.close()


def test_oversized_batches_are_cut_into_slots_and_writer_death_falls_back_to_the_thread(tmp_path):
    """A batch larger than a slot goes to the writer process too, cut into consecutive segments; the
    writer process killed under the hook: what it held is reported (the extraction retries those
    requests), later batches are written by the hook's thread."""
    import os
    import signal
    import time

    spool = tmp_path / "spool"
    hook = CaptureHook(str(spool), LAYERS, rank_fn=lambda: 0, slot_tokens=8)
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    a, b, c = full_states(1, 6), full_states(2, 20), full_states(3, 5)
    run_batch(module, Batch(ForwardMode.EXTEND, ["xa"], [6], [0]), [a])
    assert hook.flush(FLUSH_S) and hook.batches_by_process == 1 and hook.writer_state == "process"
    run_batch(module, Batch(ForwardMode.EXTEND, ["xb"], [20], [0]), [b])  # 20 tokens > an 8-token slot
    assert hook.flush(FLUSH_S) and hook.batches_by_process == 2 and hook.written == 2
    assert [info.start for info in list_segments(spool, "xb")] == [0, 8, 16]
    pid = hook.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while hook.writer_state == "process" and time.monotonic() < deadline:  # the reply thread sees the pipe close
        time.sleep(0.01)
    run_batch(module, Batch(ForwardMode.EXTEND, ["xc"], [5], [0]), [c])
    assert hook.flush(FLUSH_S)
    hook.close()
    assert hook.writer_state == "threads" and hook.errors == [] and hook.written == 3
    for rid, (ids, aux, final) in {"xa": a, "xb": b, "xc": c}.items():
        cap = assemble(spool, rid, expected_len=len(ids), expected_input_ids=ids.tolist())
        assert torch.equal(cap.aux_hidden_state, aux) and torch.equal(cap.hidden_state, final)


def test_writer_setting_is_checked(tmp_path, monkeypatch):
    with pytest.raises(CaptureConfigError, match="process"):
        CaptureHook(str(tmp_path), LAYERS, rank_fn=lambda: 0, writer="fork")
    monkeypatch.setenv("EAGLE3_CAPTURE_SPOOL", str(tmp_path))
    monkeypatch.setenv("EAGLE3_CAPTURE_LAYERS", "1,2,3")
    monkeypatch.setenv("EAGLE3_CAPTURE_SLOT_TOKENS", "lots")
    with pytest.raises(CaptureConfigError, match="EAGLE3_CAPTURE_SLOT_TOKENS='lots' is not a whole number"):
        make_capture_hook({"sglang": "0.5.23"})
    monkeypatch.setenv("EAGLE3_CAPTURE_SLOT_TOKENS", "0")  # a number, but no slot holds 0 tokens
    with pytest.raises(CaptureConfigError, match="from 1 to 1,048,576: give one in that range, or unset it"):
        make_capture_hook({"sglang": "0.5.23"})
    monkeypatch.delenv("EAGLE3_CAPTURE_SLOT_TOKENS")
    monkeypatch.setenv("EAGLE3_CAPTURE_WRITER", "fork")
    with pytest.raises(CaptureConfigError, match="EAGLE3_CAPTURE_WRITER='fork' is not one of process, threads"):
        make_capture_hook({"sglang": "0.5.23"})


@pytest.mark.parametrize("writer", ["process", "threads"])
def test_pending_host_memory_is_bounded_the_forward_waits_for_room(tmp_path, monkeypatch, writer):
    """Captured batches waiting for a stalled writer may hold at most the hook's pending bound of host
    memory: past it the forward waits (before allocating), and goes on once the writer catches up. One
    batch is always let through, however large. Nothing is lost on the way."""
    import threading
    import time

    import engine.capture.spool_process as spool_process
    import engine.sglang.hook as hook_module

    gate = threading.Event()
    real_write = hook_module.write_segment

    def stalled_write(*args, **kwargs):
        gate.wait(30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(hook_module, "write_segment", stalled_write)  # the hook's own thread
    if writer == "process":  # the hand-over to the child blocks while no slot is free: stall at the slot
        real_fill = spool_process.SpoolWriterProcess._fill

        def stalled_fill(self, *args, **kwargs):
            gate.wait(30)
            return real_fill(self, *args, **kwargs)

        monkeypatch.setattr(spool_process.SpoolWriterProcess, "_fill", stalled_fill)
    batch_bytes = 6 * (8 + 3 * H * 2 + H * 2)  # 6 tokens: int64 ids, bf16 aux [6, 3H] and final [6, H]
    spool = tmp_path / "spool"
    hook = CaptureHook(str(spool), LAYERS, rank_fn=lambda: 0, writer=writer, pending_bytes=batch_bytes * 3 // 2)
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    states = {f"r{i}": full_states(i, 6) for i in range(4)}
    called: list[str] = []

    def forward_loop():
        for rid, chunk in states.items():
            run_batch(module, Batch(ForwardMode.EXTEND, [rid], [6], [0]), [chunk])
            called.append(rid)

    loop = threading.Thread(target=forward_loop, daemon=True)
    loop.start()
    deadline = time.monotonic() + 30
    while not called and time.monotonic() < deadline:  # the first forward passes (a slow box: later)
        time.sleep(0.01)
    time.sleep(0.5)  # time enough for the second to pass, were it not held
    # The first batch waits for the stalled writer; the second would pass the bound: its forward waits.
    assert called == ["r0"] and loop.is_alive()
    assert hook.pending_bytes == batch_bytes <= hook.pending_limit
    gate.set()
    loop.join(30)
    assert not loop.is_alive() and called == list(states)
    assert hook.flush(FLUSH_S)
    hook.close()
    assert hook.errors == [] and hook.written == 4 and hook.pending_bytes == 0
    for rid, (ids, aux, final) in states.items():
        cap = assemble(spool, rid, expected_len=6, expected_input_ids=ids.tolist())
        assert torch.equal(cap.aux_hidden_state, aux) and torch.equal(cap.hidden_state, final)


def test_a_batch_larger_than_the_pending_bound_still_goes_through(tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    hook = CaptureHook(str(spool), LAYERS, rank_fn=lambda: 0, writer="threads", pending_bytes=1)
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    a, b = full_states(1, 9), full_states(2, 4)
    run_batch(module, Batch(ForwardMode.EXTEND, ["xa", "xb"], [9, 4], [0, 0]), [a, b])
    run_batch(module, Batch(ForwardMode.EXTEND, ["xc"], [4], [0]), [full_states(3, 4)])
    assert hook.flush(FLUSH_S)
    hook.close()
    assert hook.written == 3 and hook.pending_bytes == 0
    monkeypatch.setenv("EAGLE3_CAPTURE_SPOOL", str(tmp_path))
    monkeypatch.setenv("EAGLE3_CAPTURE_LAYERS", "1,2,3")
    monkeypatch.setenv("EAGLE3_CAPTURE_PENDING_MB", "0")
    with pytest.raises(CaptureConfigError, match="EAGLE3_CAPTURE_PENDING_MB='0' is not a whole number of MiB from 1"):
        make_capture_hook({"sglang": "0.5.23"})
    monkeypatch.setenv("EAGLE3_CAPTURE_PENDING_MB", "512")
    hook = make_capture_hook({"sglang": "0.5.23"})
    try:
        assert hook.pending_limit == 512 << 20
    finally:
        hook.close()


def test_a_batch_that_fails_is_reported_and_the_next_one_is_still_written(tmp_path, monkeypatch):
    import engine.capture.spool_process as spool_process

    real_submit = spool_process.SpoolWriterProcess.submit_packed
    calls = []

    def failing_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("copy failed: an illegal memory access was encountered")
        return real_submit(self, *args, **kwargs)

    monkeypatch.setattr(spool_process.SpoolWriterProcess, "submit_packed", failing_once)
    spool = tmp_path / "spool"
    hook = CaptureHook(str(spool), LAYERS, rank_fn=lambda: 0)
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    lost, kept = full_states(1, 5), full_states(2, 5)
    run_batch(module, Batch(ForwardMode.EXTEND, ["lost"], [5], [0]), [lost])
    run_batch(module, Batch(ForwardMode.EXTEND, ["kept"], [5], [0]), [kept])
    assert hook.flush(FLUSH_S)
    hook.close()
    assert hook.errors == ["lost@0: capture failed: copy failed: an illegal memory access was encountered"]
    assert hook.written == 1 and hook.pending_bytes == 0 and sorted(p.name for p in spool.iterdir()) == ["kept", "lost"]
    cap = assemble(spool, "kept", expected_len=5, expected_input_ids=kept[0].tolist())
    assert torch.equal(cap.aux_hidden_state, kept[1]) and torch.equal(cap.hidden_state, kept[2])
    # SGLang answered "lost" already: its reader fails at once with the reason, not after its patience.
    started = time.monotonic()
    with pytest.raises(SegmentError, match="failed in the server's writer: capture failed: copy failed: an illegal"):
        assemble(spool, "lost", expected_len=5, wait_s=30)
    assert time.monotonic() - started < 5 and [p.name for p in (spool / "lost").iterdir()] == ["0000000000.failed"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_run_beside_the_forward_and_keep_their_sources_alive(tmp_path):
    """The D2H copy waits for the forward's stream but the forward's stream never waits for it, and
    SGLang's allocator does not hand the captured tensors' memory to the next batch before the copy has
    read it. The hook's copy stream is held up on purpose so that each race would be lost."""
    import time

    from engine.sglang.hook import _copy_stream

    spool = tmp_path / "spool"
    hook = CaptureHook(str(spool), LAYERS, rank_fn=lambda: 0)
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    length = 1 << 16
    side = _copy_stream(torch.device("cuda", torch.cuda.current_device()))
    a, b = full_states(7, length), full_states(8, length)

    # 1. The states are produced late on the forward's stream: a copy that did not wait would read garbage.
    staged = [t.to("cuda") for t in a]
    torch.cuda._sleep(1 << 30)
    gpu = [t.clone() for t in staged]
    module(gpu[0], gpu[2], None, Batch(ForwardMode.EXTEND, ["xa"], [length], [0]), list(gpu[1].split(H, dim=-1)))
    assert hook.flush(FLUSH_S)

    # 2. The copy is held up on its own stream: the forward's stream runs on, and the next "batch" (same
    # sizes, so a freed block would be reused at once) does not overwrite what the copy has yet to read.
    # The fill kernel is loaded first: CUDA loads a kernel's module at its first launch, and that load
    # waits for the whole device (a server has loaded its kernels long before it captures).
    [torch.full_like(t, 3, device="cuda") for t in b]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 31)
    gpu = [t.to("cuda") for t in b]
    module(gpu[0], gpu[2], None, Batch(ForwardMode.EXTEND, ["xb"], [length], [0]), list(gpu[1].split(H, dim=-1)))
    del gpu
    junk = [torch.full_like(t, 3, device="cuda") for t in b]
    marker = torch.cuda.Event()
    marker.record()
    marker.synchronize()
    time.sleep(0.05)
    assert not side.query() and hook.written == 1  # xa only: xb's copy still waits on the side stream
    assert hook.flush(FLUSH_S)
    hook.close()
    assert hook.errors == [] and hook.written == 2
    for rid, (ids, aux, final) in {"xa": a, "xb": b}.items():
        cap = assemble(spool, rid, expected_len=length, expected_input_ids=ids.tolist())
        assert torch.equal(cap.aux_hidden_state, aux) and torch.equal(cap.hidden_state, final)
    del junk, staged


def test_the_extraction_job_reads_a_capture_the_hook_writes_after_the_answer(tmp_path):
    """SGLang answers a request once its forward is done; the hook's writer process writes the states
    after that. Here the writer child is held (SIGSTOP) as the batch arrives, so when the answer would
    be out the spool has nothing: a plain read fails, which made the extraction job retry (recapture)
    such samples and, after extract.max_retries, call them bad. The job's read waits
    (extract.capture_wait_s) and writes the exact record once the child goes on; a capture that never
    comes ends the wait with an error saying so."""
    import os
    import signal
    import threading
    import time

    from engine.capture.segments import CaptureIncomplete, open_capture
    from engine.extract.job import Extractor
    from engine.extract.plan import PlannedSample
    from engine.records import load_record
    from tests.helpers.workspaces import console_workspace

    ws = console_workspace(tmp_path, **{"extract.capture_wait_s": 30.0})
    hook = CaptureHook(str(ws.spool_dir), LAYERS, rank_fn=lambda: 0, writer="process")
    module = LogitsProcessor()
    module.register_forward_hook(hook)
    held = None
    try:
        run_batch(module, Batch(ForwardMode.EXTEND, ["warm"], [4], [0]), [full_states(1, 4)])  # starts the child
        assert hook.flush(FLUSH_S) and hook.writer_state == "process"
        held = hook.writer_pid
        ids, aux, final = full_states(7, 12)
        os.kill(held, signal.SIGSTOP)
        run_batch(module, Batch(ForwardMode.EXTEND, ["late"], [12], [0]), [(ids, aux, final)])  # SGLang answers now
        with pytest.raises(CaptureIncomplete, match="no capture segments for request 'late'"):
            open_capture(ws.spool_dir, "late", 12, ids.tolist())
        with pytest.raises(CaptureIncomplete, match=r"'never'.*after waiting 0.2 s for the server's capture writer"):
            open_capture(ws.spool_dir, "never", 4, wait_s=0.2)
        threading.Timer(0.5, os.kill, (held, signal.SIGCONT)).start()
        started = time.monotonic()
        sample = PlannedSample(index=0, id="s0", input_ids=ids.tolist(), loss_mask=[1] * 12)
        entry = Extractor(ws).write_capture(sample, "late", H, tmp_path / "run", 0, "s0")
        assert time.monotonic() - started >= 0.4, "the record was written before the capture existed"
        held = None
        record = load_record(tmp_path / "run", entry)
        assert torch.equal(record["aux_hidden_state"], aux) and torch.equal(record["hidden_state"], final)
        assert record["input_ids"].tolist() == ids.tolist()
        assert not (ws.spool_dir / "late").exists(), "the spool is released once the record is written"
    finally:
        if held is not None:
            os.kill(held, signal.SIGCONT)
        hook.close()
