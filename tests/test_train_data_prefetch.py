"""BatchPrefetcher on the CPU: the same batches as the plain path, in order, from real records; a
loader's error reaches the step that needed it; no thread outlives it; training is unchanged.

(On CUDA the same class pins the batches and copies them on a side stream: the cuda tests below,
run on the H200; bench/training.py measures that path.)"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.train.data import Batch, BatchPrefetcher, RecordData, TrainDataError
from tests.helpers.training import make_records, train_workspace


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hidden") / "run"
    run.mkdir()
    make_records(tiny_model_dir, run, n=10, length=24)
    return run


@pytest.fixture(scope="module")
def data(run_dir) -> RecordData:
    hidden_size = int(json.loads((run_dir / "run.json").read_text())["hidden_size"])
    return RecordData(run_dir, hidden_size, max_len=20, eval_fraction=0.0)


def _entries(data: RecordData, step: int) -> list:
    order = data.epoch_order(seed=7, epoch=step // 3)
    start = (step % 3) * 3
    return [order[(start + i) % len(order)] for i in range(3)]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "train-prefetch"]


def _same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def test_yields_the_plain_batches_in_order_and_leaves_no_thread(data):
    steps = range(2, 9)  # a resumed run starts mid-way: the steps it is given, not 0..n
    plain = [data.collate(_entries(data, s)) for s in steps]
    with BatchPrefetcher(lambda s: data.collate(_entries(data, s)), steps, "cpu") as batches:
        got = list(batches)
    assert len(got) == len(plain) == 7
    assert all(_same(a, b) for a, b in zip(got, plain))
    assert len({tuple(b.lengths.tolist()) + (int(b.input_ids.sum()),) for b in got}) > 1  # not one batch 7 times
    assert not _prefetch_threads()


def test_loader_error_reaches_the_step_that_needed_it_with_its_message(data):
    seen = []

    def load(step: int) -> Batch:
        if step == 3:
            raise TrainDataError("records/0003.safetensors is missing: resume the extraction to redo it")
        return data.collate(_entries(data, step))

    with pytest.raises(TrainDataError, match="0003.safetensors is missing: resume the extraction"):
        with BatchPrefetcher(load, range(0, 6), "cpu") as batches:
            for batch in batches:
                seen.append(batch)
    assert len(seen) == 3  # steps 0, 1, 2 trained; the failure is step 3's, not the step before it
    assert not _prefetch_threads()


def test_close_mid_epoch_stops_a_thread_blocked_on_a_full_queue(data):
    loaded = []

    def load(step: int) -> Batch:
        loaded.append(step)
        return data.collate(_entries(data, step))

    prefetcher = BatchPrefetcher(load, range(0, 1000), "cpu", depth=2)
    first = next(prefetcher)
    deadline = time.monotonic() + 10
    while len(loaded) < 3 and time.monotonic() < deadline:  # the thread runs ahead, then waits on the queue
        time.sleep(0.01)
    t0 = time.monotonic()
    prefetcher.close()
    assert time.monotonic() - t0 < 2.0
    assert not _prefetch_threads()
    assert _same(first, data.collate(_entries(data, 0)))
    assert 3 <= len(loaded) <= 5  # bounded lookahead, not the whole epoch


def test_a_slow_loader_is_waited_for_and_an_empty_range_yields_nothing(data):
    def slow(step: int) -> Batch:
        time.sleep(0.2)
        return data.collate(_entries(data, step))

    with BatchPrefetcher(slow, range(4, 6), "cpu") as batches:
        got = list(batches)
    assert [len(b.lengths) for b in got] == [3, 3] and _same(got[1], data.collate(_entries(data, 5)))
    with BatchPrefetcher(slow, range(5, 5), "cpu") as batches:
        assert list(batches) == []
    assert not _prefetch_threads()


def test_training_through_the_prefetcher_is_unchanged(run_dir, tiny_model_dir, tmp_path, monkeypatch):
    """The trainer on the prefetcher reaches the weights of a trainer that collates each batch itself."""
    import engine.train.loop as loop

    ws_a = train_workspace(tmp_path / "a", tiny_model_dir, run_dir, epochs=1, save_every=100, log_every=2)
    prefetched = loop.Trainer(ws_a, max_steps=4)
    prefetched.run()

    class Plain:
        """Today's path without the thread: collate each step when it is asked for."""

        def __init__(self, load, steps, device, depth=2, interrupt=None):
            self.it = (load(s) for s in steps)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def wait(self, timeout):
            return True  # the next batch is made when asked for

        def __next__(self):
            return next(self.it)

    monkeypatch.setattr(loop, "BatchPrefetcher", Plain)
    ws_b = train_workspace(tmp_path / "b", tiny_model_dir, run_dir, epochs=1, save_every=100, log_every=2)
    plain = loop.Trainer(ws_b, max_steps=4)
    plain.run()
    assert prefetched.step == plain.step == 4
    for (name, a), b in zip(prefetched.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not _prefetch_threads()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 with bench/training.py's call)")


def _big_batch(step: int, tokens: int = 16384, width: int = 1024) -> Batch:
    """A pageable CPU batch whose values say which step it is (large enough that its copy takes ms)."""
    g = torch.Generator().manual_seed(step)
    return Batch(torch.randint(0, 1000, (1, tokens), generator=g), torch.ones(1, tokens, dtype=torch.bool),
                 torch.randn(1, tokens, 3 * width, generator=g).to(torch.bfloat16),
                 torch.full((1, tokens, width), float(step), dtype=torch.bfloat16), torch.tensor([tokens]))


@cuda
@pytest.mark.parametrize("ahead", [0, 1])
def test_cuda_batches_arrive_whole_on_the_consumer_stream(ahead):
    """Each batch is read on the compute stream at once, while the next one is being copied: without
    the wait on the copy's event the sums would see memory not yet written."""
    steps = range(0, 12)
    expected = [(float(_big_batch(s).aux.float().sum()), float(s)) for s in steps]
    got = []
    with BatchPrefetcher(_big_batch, steps, "cuda", ahead=ahead) as batches:
        for batch in batches:
            assert batch.aux.is_cuda and batch.lengths.is_cuda
            got.append((float(batch.aux.float().sum()), float(batch.hidden.float().mean())))
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):  # a step's worth of kernels between batches
                a = a @ a / 64
    assert [g[1] for g in got] == [e[1] for e in expected]
    assert all(abs(g[0] - e[0]) <= 1e-3 * max(1.0, abs(e[0])) for g, e in zip(got, expected))
    assert not _prefetch_threads()


@cuda
@pytest.mark.parametrize("ahead", [0, 1])
def test_cuda_loader_error_reaches_the_step_that_needed_it(ahead):
    def load(step: int) -> Batch:
        if step == 2:
            raise TrainDataError("records/0002.safetensors failed its hash: re-extract it")
        return _big_batch(step, tokens=64, width=8)

    seen = []
    with pytest.raises(TrainDataError, match="0002.safetensors failed its hash"):
        with BatchPrefetcher(load, range(0, 5), "cuda", ahead=ahead) as batches:
            for batch in batches:
                seen.append(float(batch.hidden[0, 0, 0]))
    assert seen == [0.0, 1.0]
    assert not _prefetch_threads()


def test_a_loader_that_waits_is_told_to_give_up_when_the_prefetcher_closes():
    """Online, a batch waits for captures: `wait` says so without blocking, and `close()` interrupts the
    loader (it would otherwise join a thread that waits for ever)."""
    given_up = threading.Event()

    def load(step):
        if not given_up.wait(30):
            raise AssertionError("never interrupted")
        raise RuntimeError("stopped while waiting")

    prefetcher = BatchPrefetcher(load, range(0, 3), "cpu", interrupt=given_up.set)
    assert prefetcher.wait(0.1) is False
    started = time.monotonic()
    prefetcher.close()
    assert time.monotonic() - started < 5
