"""Online and hybrid training data: states captured from the running server while training.

`OnlineData` stands where `RecordData` stands in the trainer (same split, same epoch order, same
batches per step), but its records do not come from an extraction run. A producer thread sends
each sample of the steps ahead to the server through the extraction's own capture path
(engine.extract.job.Extractor: request with a client-chosen rid, stitched spool segments, the same
checks) and streams it into a record in the window directory, `<extract.output_dir>/window/<train.run>/`,
as the extraction job does (Extractor.write_capture: chunk by chunk from the spool, finite-checked and
hashed on the way, no tensors built). The write happens after the request has given its slot back, so the
server keeps `extract.concurrency` requests per endpoint while records are written. The trainer reads each record when its batch is built and
deletes it at once; the next epoch captures it again. The bytes in the window never exceed
`train.window_gb` (engine.train.window): the producer waits when it is full, except that one batch
always fits (a batch larger than the whole window trains alone).

- `stream/`: records of the steps ahead, deleted once read; emptied at every start (a crashed run's
  leftovers are captured again, never trusted, so they are written without fsync).
- `kept/`: records kept for good, a run directory of its own (manifest.jsonl with sha256): the held-out
  set (those of the held-out samples that fit in a quarter of the window: a run too big to store
  cannot keep a 5 % slice either) and, in hybrid mode, as many training samples as fit in what is
  left after room for the records in flight; those are captured once, in the first epoch that meets
  them, and read from disk by every later epoch.

Crash and resume: a checkpoint stores the data position (epoch, next sample index; a pure function of
the step, as offline). After kill -9, training resumes from the last checkpoint's step and the producer
captures from that position again. The samples that can be trained twice are exactly those consumed
after the last checkpoint: the batches of steps from the checkpoint's step up to the last batch the
trainer had read (at most the prefetch depth past the step it was training). Their updates died with
the process, so the resumed weights see each sample once per epoch; only the capture and the compute
are repeated. `<drafter_dir>/online_ledger.jsonl` records every consumption (step, sample id), which is
how tests/faults/test_kill_online.py checks this.

Several trainer ranks (train.num_gpus > 1, torchrun): each rank captures and consumes its own shard,
the samples of its own batches (the trainer's `_batch_entries`, as offline: step s of rank r trains
epoch-order positions s*B*W + r*B .. +B-1), into its own window, `<window>/rank<r>/`, of
`train.window_gb / num_gpus`: the ranks together never hold more than the window plus one batch per
rank. Each rank keeps its share of the held-out set (the trainer evaluates slice r of it on rank r);
in hybrid mode a rank keeps the training samples it meets, and every rank reads a sample some rank has
kept from that rank's kept/ (the manifests, read as they grow; one box, one filesystem) instead of
capturing it again, unless it was dispatched before the keeping rank's record was committed. Rank 0 writes checkpoints
and data.json; every rank appends its own ledger lines (with its rank), so the guarantee above holds
for the ranks together: what any rank consumed at or after the checkpoint's step is trained twice.
Only rank 0 restarts a crashed server.

Across machines (README, "Across machines"): capture agents on the server hosts, the trainer keeping the
order and the budget by tickets, the records in Mooncake Store or on a shared filesystem. Not built.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.io import atomic
from engine.system.disk import bytes_per_token
from engine.errors import EngineError
from engine.records import (
    RecordEntry,
    RecordError,
    append_manifest,
    load_record,
    read_manifest,
    read_run_meta,
    write_run_meta,
)
from engine.train.data import RecordData, TrainDataError, is_eval
from engine.train.window import (
    Window,
    WindowClosed,
    drop_other_layouts,
    last_capture_rate,
    rank_window_dir,
    record_bytes,
    window_budget,
    window_dir,
)

STREAM = "stream"
KEPT = "kept"
LEDGER = "online_ledger.jsonl"
DATA_NOTE = "data.json"  # in the drafter directory: which mode trained it, and the window's figures
EVAL_SHARE = 0.25  # of the window, at most, for the held-out records


class OnlineError(EngineError):
    """Online training cannot start or go on; the message names the cause and the fix."""


@dataclass
class _Ready:
    entry: RecordEntry  # the record in stream/ (or in a peer rank's kept/, when `peer_dir` is set)
    nbytes: int  # as reserved (0 for a peer's kept record: it counts in that rank's window)
    step: int
    peer_dir: Path | None = None


@dataclass(frozen=True)
class _Job:
    sample: Any  # engine.extract.plan.PlannedSample
    step: int  # the batch (step) it is captured for; -1 for the held-out set
    nbytes: int
    keep: bool
    seq: int  # unique per capture in this session: its rid and file name


class OnlineData(RecordData):
    """The trainer's data source in `train.mode = "online"` or `"hybrid"` (see the module docstring)."""

    def __init__(self, workspace, target, max_len: int, eval_fraction: float, batch_size: int,
                 ctx=None, event: Callable[..., None] | None = None, rank: int = 0, world: int = 1):
        from engine.extract.plan import build_plan

        self.ws = workspace
        self.cfg = workspace.config
        self.mode = self.cfg.train.mode
        self.ctx = ctx
        self._event = event or (lambda kind, **data: None)
        self.max_len = max_len
        self.hidden_size = target.hidden_size
        self.target = target
        self.meta = {"layers": list(target.capture_layers), "hidden_size": target.hidden_size, "mode": self.mode}
        self.batch_size = batch_size
        self.rank, self.world = rank, world
        self.dir = rank_window_dir(workspace, rank, world)
        self.stream_dir = self.dir / STREAM
        self.kept_dir = self.dir / KEPT
        self.window = Window(window_budget(self.cfg) // world)  # this rank's share
        self.totals: dict[str, float] | None = None  # the window's figures summed over the ranks, when set
        plan = build_plan(workspace)
        self.fingerprint = plan.fingerprint
        samples = [s for s in plan.samples if len(s.input_ids) >= 3]
        if not samples:
            raise TrainDataError(f"dataset {plan.dataset} has no sample of 3 or more tokens: run the `dataset` stage "
                                 "for details")
        self.samples = {s.id: s for s in samples}
        self.per_token = bytes_per_token(self.hidden_size)
        usable = [RecordEntry(s.id, s.index, "", len(s.input_ids), int(sum(s.loss_mask)),
                              record_bytes(len(s.input_ids), self.hidden_size), "") for s in samples]
        self._split(usable, eval_fraction)
        self.kept: dict[str, RecordEntry] = {}  # sample id -> its record in kept/
        self._keeping: set[str] = set()  # being captured to be kept
        self._ready: dict[str, deque[_Ready]] = {}
        self.peer_kept: dict[str, tuple[Path, RecordEntry]] = {}  # hybrid, several ranks: other ranks' kept/
        self._peers_read = 0.0
        self.peer_reads = 0
        self._cond = threading.Condition()
        self._error: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._seq = 0
        self.captured = self.captured_tokens = 0
        self.consumed_tokens = 0
        # CPU seconds the producer's threads spent in this process (the event loop: requests and dispatch;
        # the writers: records): what it takes from the training loop, which shares the GIL with it.
        self.producer_cpu = 0.0
        self._cpu_lock = threading.Lock()
        self._rate_mark = (time.monotonic(), 0, 0, 0.0)
        self.keep_budget = 0
        self._rate: float | None = None  # the last capture rate measured in this workspace (tok/s), for the plan
        self.keep_used = 0  # bytes of training records kept or being kept (hybrid), decided in step order
        if rank == 0:
            drop_other_layouts(window_dir(workspace), world)  # a run of another num_gpus left them
        self._open_kept()  # the trainer holds the drafter's lock: no other run uses this window
        self._plan_keep_budget()

    # ------------------------------------------------------------------ the split (as RecordData's)
    def _split(self, usable: list[RecordEntry], fraction: float) -> None:
        held = [e for e in usable if is_eval(e.id, fraction)] if fraction > 0 else []
        if fraction > 0 and not held and len(usable) >= 2:
            held = [usable[-1]]
        if len(held) == len(usable):
            held = held[1:]
        held_ids = {e.id for e in held}
        self.train_entries = [e for e in usable if e.id not in held_ids]
        # Only the held-out records that fit in a share of the window are kept (and evaluated on). With
        # several ranks, kept record i is rank i % world's (the trainer evaluates eval_entries[rank::world])
        # and counts in that rank's window: the list is the same on every rank.
        room, kept_eval = [int(self.window.budget * EVAL_SHARE)] * self.world, list[RecordEntry]()
        for entry in held:
            owner = len(kept_eval) % self.world
            if entry.bytes > room[owner]:
                break
            kept_eval.append(entry)
            room[owner] -= entry.bytes
        self.eval_entries = kept_eval
        self.own_eval = kept_eval[self.rank::self.world]  # the ones this rank captures, keeps and evaluates
        self.held_out = len(held)

    def token_counts(self):
        """Counts of loss-masked target tokens over every usable sample (what extraction saves)."""
        import torch

        vocab = self.target.vocab_size
        counts = torch.zeros(vocab, dtype=torch.int64)
        for sample in self.samples.values():
            ids = torch.tensor(sample.input_ids)
            mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
            counts += torch.bincount(ids[mask], minlength=vocab)[:vocab]
        return counts

    def offline_bytes(self) -> int:
        """What an offline extraction of the same samples would write."""
        return sum(record_bytes(len(s.input_ids), self.hidden_size) for s in self.samples.values())

    # ------------------------------------------------------------------ start
    def _open_kept(self) -> None:
        """Kept records of an earlier session that still match this dataset and model; the rest go."""
        meta = {"fingerprint": self.fingerprint, "hidden_size": self.hidden_size,
                "layers": list(self.target.capture_layers), "model": str(self.ws.model_dir)}
        try:
            old = read_run_meta(self.kept_dir)
        except RecordError:
            old = None
        if old is not None and any(old.get(k) != v for k, v in meta.items()):
            shutil.rmtree(self.kept_dir, ignore_errors=True)
            old = None
        self.kept_dir.mkdir(parents=True, exist_ok=True)
        if old is None:
            write_run_meta(self.kept_dir, meta)
        entries, _ = read_manifest(self.kept_dir)
        named = {e.path for e in entries.values()}
        for path in list(self.kept_dir.glob("records/*/*")):  # a record killed before its manifest line
            if path.relative_to(self.kept_dir).as_posix() not in named:
                path.unlink(missing_ok=True)
        held = {e.id for e in self.own_eval}
        wanted = held | ({e.id for e in self.train_entries} if self.mode == "hybrid" else set())
        good = []
        for entry in entries.values():
            if entry.id in wanted and (self.kept_dir / entry.path).is_file():
                good.append(entry)
                self.kept[entry.id] = entry
                self.window.add_kept(entry.bytes)
                if entry.id not in held:
                    self.keep_used += entry.bytes
            else:
                (self.kept_dir / entry.path).unlink(missing_ok=True)
        if len(good) != len(entries):
            atomic.write_text(self.kept_dir / "manifest.jsonl", "".join(e.to_json() + "\n" for e in good))

    def _plan_keep_budget(self) -> None:
        """Hybrid: keep what the window holds beside the held-out set and room for the records in flight
        (a batch, plus one capture per producer worker)."""
        if self.mode != "hybrid":
            return
        largest = max(e.bytes for e in self.train_entries)
        in_flight = (self.batch_size + self._workers()) * largest
        eval_bytes = sum(e.bytes for e in self.own_eval)
        self.keep_budget = max(0, self.window.budget - eval_bytes - in_flight)

    def _requests(self) -> int:
        """Requests in flight at once: `extract.concurrency` per endpoint, as the extraction job."""
        return self.cfg.extract.concurrency * (1 + len(self.cfg.extract.endpoints))

    def _workers(self) -> int:
        # Twice the requests: while one worker writes its record, another's request holds the slot.
        return 2 * self._requests()

    def start(self, batch_entries: Callable[[int], list[RecordEntry]], first_step: int, limit: int) -> None:
        """Start capturing the batches of steps first_step..limit-1 (as `batch_entries` gives them)."""
        shutil.rmtree(self.stream_dir, ignore_errors=True)
        self.stream_dir.mkdir(parents=True, exist_ok=True)
        # The plan went out with the trainer's `started` event; data.json keeps it beside the drafter.
        if self.rank == 0:
            atomic.write_json(self.ws.drafter_dir / DATA_NOTE, {**self.plan_fields(), "t": time.time()})
        self._thread = threading.Thread(target=self._thread_main, args=(batch_entries, first_step, limit),
                                        name="online-capture", daemon=True)
        self._thread.start()

    def plan_fields(self) -> dict[str, Any]:
        """The plan, before any capture: what an epoch costs in prefill (at the last capture rate measured
        here) against the disk an offline run would need, and the window."""
        tokens = sum(e.tokens for e in self.train_entries)
        if self._rate is None:
            self._rate = last_capture_rate(self.ws) or 0.0
        estimate = {"capture_rate_seen": round(self._rate, 1),
                    "prefill_s_per_epoch": round(tokens / self._rate, 1)} if self._rate else {}
        # window_budget: all ranks' together (each holds budget / world; `started` carries `world`)
        return {**estimate, "mode": self.mode, "window_budget": self.window.budget * self.world,
                "window_kept": self.window.kept, "keep_budget": self.keep_budget, "epoch_tokens": tokens,
                "offline_bytes": self.offline_bytes(), "eval_kept": len(self.eval_entries), "held_out": self.held_out,
                "window_dir": str(self.dir if self.world == 1 else self.dir.parent)}

    # ------------------------------------------------------------------ producer
    def _thread_main(self, batch_entries, first_step: int, limit: int) -> None:
        try:
            asyncio.run(self._produce(batch_entries, first_step, limit))
        except WindowClosed:
            pass
        except BaseException as exc:  # the trainer raises it at the batch that waits for it
            self._fail(f"online capture stopped: {type(exc).__name__}: {exc}")

    def _fail(self, message: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = message
            self._cond.notify_all()
        self.window.close()

    @property
    def stopping(self) -> bool:
        # Not on a stop request: the trainer checkpoints at its next step, and the batch it may be waiting
        # for must still arrive. close() stops the producer.
        return self._closed or self._error is not None

    async def _produce(self, batch_entries, first_step: int, limit: int) -> None:
        from engine.client import ServerClient
        from engine.extract.guard import ExtractionRefused
        from engine.extract.job import Extractor
        from engine.extract.layout import SPOOL_SESSIONS

        extractor = Extractor(self.ws, self.ctx)
        extractor.run_dir = self.dir  # its spool sessions are recorded here, so the next start frees them
        try:
            await extractor.check_server()
        except ExtractionRefused as exc:
            raise OnlineError(str(exc).replace("start the extraction again", "start training again")) from None
        extractor.spool.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(extractor.release_stale_spool)
        atomic.append_line(self.dir / SPOOL_SESSIONS, extractor.tag)
        clients = [(url, ServerClient(url, api_key=self.cfg.server.api_key or None, timeout=600))
                   for url in extractor.endpoints()]
        load = [0] * len(clients)
        slots = asyncio.Semaphore(self.cfg.extract.concurrency * len(clients))
        writes = ThreadPoolExecutor(max_workers=self._workers(), thread_name_prefix="online-writer")
        jobs: asyncio.Queue[_Job | None] = asyncio.Queue(maxsize=self.cfg.extract.concurrency * len(clients))

        async def worker() -> None:
            while True:
                job = await jobs.get()
                if job is None or self.stopping:
                    return
                try:
                    await self._capture(extractor, clients, load, slots, writes, job)
                except Exception as exc:  # at once: the dispatcher and the waiting trainer stop on it
                    self._fail(str(exc) if isinstance(exc, EngineError) else
                               f"online capture stopped: {type(exc).__name__}: {exc}")
                    return

        workers = [asyncio.create_task(worker()) for _ in range(self._workers())]
        meter = asyncio.create_task(self._meter_loop_cpu())
        try:
            for entry in self.own_eval:
                if entry.id not in self.kept:
                    await self._dispatch(jobs, entry, -1, keep=True)
            for step in range(first_step, limit):
                self._refresh_peers()
                for entry in batch_entries(step):
                    if entry.id in self.kept or entry.id in self._keeping:
                        continue  # read from kept/ (hybrid), captured once
                    if entry.id in self.peer_kept:  # another rank kept it: read from there, in this order
                        self._queue_peer(entry.id, step)
                        continue
                    keep = self.mode == "hybrid" and self.keep_used + entry.bytes <= self.keep_budget
                    if keep:
                        self.keep_used += entry.bytes
                    if not await self._dispatch(jobs, entry, step, keep):
                        return
            for _ in workers:
                while not self.stopping:
                    try:
                        jobs.put_nowait(None)
                        break
                    except asyncio.QueueFull:
                        await asyncio.sleep(0.02)
            await asyncio.gather(*workers)
        finally:
            meter.cancel()
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.to_thread(writes.shutdown, True)  # the writes under way end before the window closes
            for _, client in clients:
                await client.aclose()

    def _charge_cpu(self, seconds: float) -> None:
        with self._cpu_lock:
            self.producer_cpu += max(0.0, seconds)

    async def _meter_loop_cpu(self) -> None:
        """Charge the event loop thread's CPU time to the producer, four times a second."""
        last = time.thread_time()
        try:
            while True:
                await asyncio.sleep(0.25)
                now = time.thread_time()
                self._charge_cpu(now - last)
                last = now
        finally:  # cancelled when the producer ends
            self._charge_cpu(time.thread_time() - last)

    def _refresh_peers(self) -> None:
        """Hybrid on several ranks: the training records the other ranks have kept so far (their manifests,
        appended once a record is durable; every rank has opened its kept/ before any producer starts, as
        the trainer's DDP set-up waits for all). Without this a sample kept by one rank would be captured
        again whenever the epoch's order gives it to another: most of the time on many ranks."""
        if self.mode != "hybrid" or self.world == 1 or time.monotonic() - self._peers_read < 0.1:
            return
        self._peers_read = time.monotonic()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            peer = rank_window_dir(self.ws, rank, self.world) / KEPT
            entries, _ = read_manifest(peer)
            for entry in entries.values():
                if entry.id not in self.kept and entry.id not in self.peer_kept:
                    self.peer_kept[entry.id] = (peer, entry)

    def _queue_peer(self, sample_id: str, step: int) -> None:
        peer, entry = self.peer_kept[sample_id]
        with self._cond:
            self._ready.setdefault(sample_id, deque()).append(_Ready(entry, 0, step, peer_dir=peer))
            self._cond.notify_all()

    async def _dispatch(self, jobs, entry: RecordEntry, step: int, keep: bool) -> bool:
        """Reserve the record's bytes (waiting while the window is full), then queue its capture."""
        slot = step if step >= 0 else -1
        while not await asyncio.to_thread(self.window.reserve, entry.bytes, slot, 0.5):
            if self.stopping:
                return False
        if keep:
            self._keeping.add(entry.id)
        self._seq += 1
        job = _Job(self.samples[entry.id], step, entry.bytes, keep, self._seq)
        while not self.stopping:  # never blocks for good: the workers may have stopped on an error
            try:
                jobs.put_nowait(job)
                return True
            except asyncio.QueueFull:
                await asyncio.sleep(0.02)
        return False

    async def _capture(self, extractor, clients, load: list[int], slots: asyncio.Semaphore,
                       writes: ThreadPoolExecutor, job: _Job) -> None:
        from engine.extract.job import Outage, SampleFailed

        retries = self.cfg.extract.max_retries
        attempt = 0
        loop = asyncio.get_running_loop()
        while not self.stopping:
            i = 0
            try:
                async with slots:  # extract.concurrency requests per endpoint, as the extraction job
                    i = min(range(len(clients)), key=lambda k: load[k])
                    load[i] += 1
                    try:
                        # rid x<index>-<tag>-a<n>: n unique per capture of this session, so two captures of one
                        # sample (consecutive epochs) never share spool segments (max_retries <= 1000 < 10,000)
                        rid = await extractor.request(clients[i][1], job.sample, job.seq * 10_000 + attempt)
                    finally:
                        load[i] -= 1
                # Written after the slot is given back: the next request is at the server meanwhile.
                await loop.run_in_executor(writes, self._store, extractor, job, rid)
                return
            except Outage:
                await extractor.wait_for_server(clients[i][0], primary=(i == 0 and self.rank == 0))
                await asyncio.sleep(0.5)  # it returns at once when a stop is asked: no busy loop
            except (SampleFailed, RecordError) as exc:
                attempt += 1
                if attempt > retries:
                    raise OnlineError(f"sample {job.sample.id} could not be captured in {attempt} attempts: {exc}; "
                                      "check the `capture` stage (`eagle3-console check capture`), fix what it "
                                      "names, then start training again: it resumes from its checkpoint") from None
                self._event("retry", id=job.sample.id, attempt=attempt, reason=str(exc))
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # Not a pause, as in the extraction: what fills the disk may be the window's own records of
                # later steps, which only the trainer's progress frees, and it waits for this one.
                where = self.kept_dir if job.keep else self.stream_dir
                raise OnlineError(f"disk full while writing the online window in {where} ({exc.strerror}): free "
                                  "space on that disk or lower train.window_gb (`eagle3-console check disk` shows "
                                  "what fits), then start training again: it resumes from its checkpoint") from None

    def _store(self, extractor, job: _Job, rid: str) -> None:
        """Stream the capture into its record: kept/ durably with a manifest line, stream/ without fsync."""
        started = time.thread_time()
        try:
            self._write_record(extractor, job, rid)
        finally:
            self._charge_cpu(time.thread_time() - started)

    def _write_record(self, extractor, job: _Job, rid: str) -> None:
        sample, h = job.sample, self.hidden_size
        if job.keep:
            entry = extractor.write_capture(sample, rid, h, self.kept_dir, sample.index, sample.id)
            append_manifest(self.kept_dir, entry)
        else:
            entry = extractor.write_capture(sample, rid, h, self.stream_dir, job.seq, f"s{job.seq}", durable=False)
        if entry.bytes > job.nbytes:  # record_bytes is an upper bound: a bug if not
            raise OnlineError(f"record of {sample.id} is {entry.bytes} bytes, {job.nbytes} were reserved; "
                              "report a bug")
        with self._cond:
            self.captured += 1
            self.captured_tokens += entry.tokens
            if job.keep:
                self.kept[sample.id] = entry
                self._keeping.discard(sample.id)
                self.window.keep(job.nbytes, job.step if job.step >= 0 else -1)
            else:
                self._ready.setdefault(sample.id, deque()).append(_Ready(entry, job.nbytes, job.step))
            self._cond.notify_all()

    # ------------------------------------------------------------------ consumer
    def load(self, entry: RecordEntry) -> dict:
        """The sample's record, once captured: a streamed one is read and deleted at once (its bytes go
        back to the window), a kept one is read from kept/."""
        with self._cond:
            while True:
                queued = self._ready.get(entry.id)
                if queued:
                    ready: _Ready | None = queued.popleft()
                    break
                if entry.id in self.kept:
                    ready = None
                    break
                if self._error is not None:
                    raise TrainDataError(self._error)
                if self._closed:
                    raise TrainDataError("online capture was stopped before this sample arrived")
                self._cond.wait(1.0)
        if ready is None:
            kept = self.kept[entry.id]
            try:
                return load_record(self.kept_dir, kept, verify=True)
            except (OSError, RecordError) as exc:
                raise TrainDataError(f"{self.kept_dir / kept.path}: {exc}; delete {self.kept_dir} and start "
                                     "training again (it captures the kept records again)") from None
        if ready.peer_dir is not None:
            try:
                tensors = load_record(ready.peer_dir, ready.entry, verify=True)
            except (OSError, RecordError) as exc:
                raise TrainDataError(f"{ready.peer_dir / ready.entry.path}: {exc}; delete {ready.peer_dir} and "
                                     "start training again (it captures the kept records again)") from None
            self.peer_reads += 1
            self._ledger(ready.step, entry.id, kept_by=ready.peer_dir.parent.name)
            return tensors
        path = self.stream_dir / ready.entry.path
        try:
            tensors = load_record(self.stream_dir, ready.entry, verify=True)
        except (OSError, RecordError) as exc:
            raise TrainDataError(f"{path}: {exc}") from None
        finally:
            path.unlink(missing_ok=True)
            self.window.release(ready.nbytes, ready.step)
        self.consumed_tokens += ready.entry.tokens
        self._ledger(ready.step, entry.id)
        return tensors

    def _ledger(self, step: int, sample_id: str, kept_by: str | None = None) -> None:
        """One line per consumed record (`kept_by`: read from that rank's kept/, not captured); appended
        without fsync: a kill of the process loses none."""
        fields = {"step": step, "id": sample_id, "pid": os.getpid(), "rank": self.rank}
        line = json.dumps({**fields, "kept_by": kept_by} if kept_by else fields) + "\n"
        path = self.ws.drafter_dir / LEDGER
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    FIGURES = ("window_bytes", "window_peak", "window_budget", "captured", "captured_tokens", "consumed_tokens")

    def figures(self) -> list[float]:
        """This rank's window figures (FIGURES' order); the trainer sums them over the ranks into `totals`."""
        return [float(x) for x in (self.window.used, self.window.peak, self.window.budget, self.captured,
                                   self.captured_tokens, self.consumed_tokens)]

    def _figures(self) -> dict[str, float]:
        return self.totals if self.totals is not None else dict(zip(self.FIGURES, self.figures()))

    def progress_fields(self, step: int, steps_per_epoch: int) -> dict[str, Any]:
        """Producer (capture) and consumer (trainer) rates since the last call, window fill, epoch position:
        over every rank once the trainer has set `totals` (each peak summed: a bound of the total's)."""
        now = time.monotonic()
        then, captured, consumed, cpu = self._rate_mark
        elapsed = max(now - then, 1e-9)
        fig = self._figures()
        self._rate_mark = (now, int(fig["captured_tokens"]), int(fig["consumed_tokens"]), self.producer_cpu)
        epoch, index = divmod(step, steps_per_epoch)
        return {"mode": self.mode, "epoch": epoch + 1, "epoch_step": index, "steps_per_epoch": steps_per_epoch,
                "capture_tokens_per_s": round((fig["captured_tokens"] - captured) / elapsed, 1),
                "train_tokens_per_s": round((fig["consumed_tokens"] - consumed) / elapsed, 1),
                "window_bytes": int(fig["window_bytes"]), "window_budget": int(fig["window_budget"]),
                "window_peak": int(fig["window_peak"]), "captured": int(fig["captured"]),
                "producer_cpu": round((self.producer_cpu - cpu) / elapsed, 3)}  # this rank's

    def close(self) -> dict[str, Any]:
        """Stop capturing, empty stream/ (kept/ stays); what the window held at most."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.window.close()
        if self._thread is not None:
            self._thread.join(timeout=60)
        shutil.rmtree(self.stream_dir, ignore_errors=True)
        fig = self._figures()
        end = {"window_peak": int(fig["window_peak"]), "window_budget": int(fig["window_budget"]),
               "captured": int(fig["captured"]), "producer_cpu_s": round(self.producer_cpu, 2)}
        if self._thread is not None and self.rank == 0:
            note = {**self.plan_fields(), **end, "t": time.time()}
            try:
                old = json.loads((self.ws.drafter_dir / DATA_NOTE).read_text())
                note["window_peak"] = max(note["window_peak"], int(old.get("window_peak") or 0))  # over every session
            except (OSError, ValueError, TypeError):
                pass
            atomic.write_json(self.ws.drafter_dir / DATA_NOTE, note)
        return {"mode": self.mode, **end}
