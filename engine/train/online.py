"""Online and hybrid training data: states captured from the running server while training.

`OnlineData` stands where `RecordData` stands in the trainer (same split, same epoch order, same
batches per step), but its records do not come from an extraction run. A producer thread decides, in
step order, which samples of the steps ahead are captured and reserves their bytes in the window; a
capture process of the trainer's own (engine.train.capture_process) sends them to the server through
the extraction's own capture path (engine.extract.job.Extractor: request with a client-chosen rid,
stitched spool segments, the same checks) and streams each into a record in the window directory,
`<extract.output_dir>/window/<train.run>/`, as the extraction job does (Extractor.write_capture: chunk by
chunk from the spool, finite-checked and hashed on the way, no tensors built), after the request has
given its slot back. That work costs CPU per capture; in the trainer's process it shared the GIL with
the training loop. The trainer reads each record when its batch is built and
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

import json
import os
import shutil
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil

from engine.io import atomic
from engine.records import (
    RecordEntry,
    RecordError,
    load_record,
    read_manifest,
    read_run_meta,
    write_run_meta,
)
from engine.train.capture_process import EXIT_TIMEOUT_S, CaptureProcess, CaptureSpec, Order, failure_text
from engine.train.data import RecordData, TrainDataError, is_eval, target_weights
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


class _ThreadMeter:
    """Charges the CPU time of the thread it was made in to the producer, at each tick."""

    def __init__(self, data: "OnlineData"):
        self.data = data
        self.last = time.thread_time()

    def tick(self) -> None:
        now = time.thread_time()
        self.data._charge_cpu(now - self.last)
        self.last = now


class OnlineData(RecordData):
    """The trainer's data source in `train.mode = "online"` or `"hybrid"` (see the module docstring)."""

    def __init__(self, workspace, target, max_len: int, eval_fraction: float, batch_size: int,
                 ctx=None, rank: int = 0, world: int = 1):
        from engine.extract.plan import build_plan

        self.ws = workspace
        self.cfg = workspace.config
        self.mode = self.cfg.train.mode
        self.ctx = ctx
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
        usable = [RecordEntry(s.id, s.index, "", len(s.input_ids), int(sum(s.loss_mask)), self._record_bytes(s), "")
                  for s in samples]
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
        self._interrupted = False  # the trainer stops waiting for records (its batch loader closes)
        self._thread: threading.Thread | None = None
        self._seq = 0
        self.captured = self.captured_tokens = 0
        self.consumed_tokens = 0
        # CPU seconds the producer's threads spent in this process (dispatch, and filing the capture
        # process's answers): what it takes from the training loop, which shares the GIL with it. The
        # captures themselves cost the capture process (capture_cpu), outside it.
        self.producer_cpu = 0.0
        self._capture: CaptureProcess | None = None
        self._capture_cpu = 0.0
        self._pending: dict[int, _Job] = {}  # ordered, not yet answered, by seq
        self._cpu_lock = threading.Lock()
        self._rate_mark = (time.monotonic(), 0, 0, 0.0, 0.0)
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
        return sum(self._record_bytes(s) for s in self.samples.values())

    def _record_bytes(self, sample) -> int:
        return record_bytes(len(sample.input_ids), self.hidden_size, self.cfg.extract.aux_format)

    # ------------------------------------------------------------------ start
    def _open_kept(self) -> None:
        """Kept records of an earlier session that still match this dataset and model; the rest go."""
        weights = target_weights(self.ws.model_dir)
        meta = {"fingerprint": self.fingerprint, "hidden_size": self.hidden_size,
                "layers": list(self.target.capture_layers), "model": str(self.ws.model_dir),
                "aux_format": self.cfg.extract.aux_format, "model_weights": weights}
        self.meta["model_weights"] = weights  # what the drafter is trained against (its export says so)
        try:
            old = read_run_meta(self.kept_dir)
        except RecordError:
            old = None
        # The weights id, not the path, says which model: a moved model keeps its kept records.
        changed = [k for k, v in meta.items() if old is not None and k != "model" and old.get(k) != v]
        if changed:  # records of another dataset or model: captured again from this one
            entries, _ = read_manifest(self.kept_dir)
            print(f"note: {self.kept_dir}: {len(entries)} kept record(s) of an earlier session dropped "
                  f"({', '.join(changed)} changed); they are captured again", file=sys.stderr, flush=True)
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
        meter = _ThreadMeter(self)
        try:
            self._produce(batch_entries, first_step, limit, meter)
        except WindowClosed:
            pass
        except BaseException as exc:  # the trainer raises it at the batch that waits for it
            self._fail(failure_text(exc))
        finally:
            meter.tick()

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

    def _produce(self, batch_entries, first_step: int, limit: int, meter: "_ThreadMeter") -> None:
        """Decide, in step order, what is captured and reserve its bytes; the capture process does the rest
        (engine.train.capture_process) and the receiver thread files what it answers."""
        capture = CaptureProcess(CaptureSpec(
            root=str(self.ws.root), rank=self.rank, hidden_size=self.hidden_size, window_dir=str(self.dir),
            stream_dir=str(self.stream_dir), kept_dir=str(self.kept_dir),
            job_dir=str(self.ctx.job_dir) if self.ctx is not None else None, workers=self._workers(),
            parent_pid=os.getpid()))
        self._capture = capture
        try:
            capture.start()
            receiver = threading.Thread(target=self._receive, args=(capture,), name="online-receive", daemon=True)
            receiver.start()
            try:
                for entry in self.own_eval:
                    if entry.id not in self.kept and not self._dispatch(capture, entry, -1, True, meter):
                        return
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
                        if not self._dispatch(capture, entry, step, keep, meter):
                            return
                capture.end()
                while receiver.is_alive() and not self.stopping:
                    receiver.join(0.5)
            finally:
                capture.stop()  # the writes under way end before the window closes
                receiver.join(EXIT_TIMEOUT_S)
        finally:
            capture.close()

    def _charge_cpu(self, seconds: float) -> None:
        with self._cpu_lock:
            self.producer_cpu += max(0.0, seconds)

    @property
    def capture_pid(self) -> int | None:
        """The capture process's pid, once started."""
        return self._capture.pid if self._capture is not None else None

    def capture_cpu(self) -> float:
        """CPU seconds the capture process has used so far (its own, outside the trainer's process)."""
        pid = self.capture_pid
        if pid is not None:
            try:
                times = psutil.Process(pid).cpu_times()
                self._capture_cpu = max(self._capture_cpu, times.user + times.system)
            except psutil.Error:
                pass
        return self._capture_cpu


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

    def _dispatch(self, capture: CaptureProcess, entry: RecordEntry, step: int, keep: bool,
                  meter: "_ThreadMeter") -> bool:
        """Reserve the record's bytes (waiting while the window is full), then order its capture."""
        slot = step if step >= 0 else -1
        while not self.window.reserve(entry.bytes, slot, 0.5):
            if self.stopping:
                return False
        if keep:
            self._keeping.add(entry.id)
        self._seq += 1
        job = _Job(self.samples[entry.id], step, entry.bytes, keep, self._seq)
        with self._cond:
            self._pending[job.seq] = job
        capture.order(Order(job.seq, job.sample, keep))
        meter.tick()
        return True

    def _receive(self, capture: CaptureProcess) -> None:
        """File the capture process's answers until it exits; an exit nobody asked for fails the run."""
        meter = _ThreadMeter(self)
        try:
            for message in capture.messages():
                if message[0] == "stored":
                    self._stored(self._pending.pop(message[1]), message[2])
                elif message[0] == "failed":
                    self._fail(message[1])
                elif message[0] == "ended":
                    self._capture_cpu = max(self._capture_cpu, float(message[1]))
                    return
                meter.tick()
            if not self.stopping:
                self._fail(f"online capture stopped: the capture process ended ({capture.exit_text()}) with captures "
                           "still to make; its error is in the job log. Start training again: it resumes from its "
                           "checkpoint")
        finally:
            meter.tick()

    def _stored(self, job: _Job, entry: RecordEntry) -> None:
        """A record is on disk (stream/, or kept/ with its manifest line)."""
        if entry.bytes > job.nbytes:  # record_bytes is an upper bound: a bug if not
            self._fail(f"record of {job.sample.id} is {entry.bytes} bytes, {job.nbytes} were reserved; report a bug")
            return
        sample = job.sample
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
                if self._closed or self._interrupted:
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
        then, captured, consumed, cpu, capture_cpu = self._rate_mark
        elapsed = max(now - then, 1e-9)
        fig = self._figures()
        now_capture_cpu = self.capture_cpu()
        self._rate_mark = (now, int(fig["captured_tokens"]), int(fig["consumed_tokens"]), self.producer_cpu,
                           now_capture_cpu)
        # Steps done in the epoch under way; an epoch's last step still belongs to it (the run's final step
        # reads "epoch E step N/N", not the start of an epoch that never comes).
        epoch, index = divmod(max(step - 1, 0), steps_per_epoch)
        index = index + 1 if step > 0 else 0
        return {"mode": self.mode, "epoch": epoch + 1, "epoch_step": index, "steps_per_epoch": steps_per_epoch,
                "capture_tokens_per_s": round((fig["captured_tokens"] - captured) / elapsed, 1),
                "train_tokens_per_s": round((fig["consumed_tokens"] - consumed) / elapsed, 1),
                "window_bytes": int(fig["window_bytes"]), "window_budget": int(fig["window_budget"]),
                "window_peak": int(fig["window_peak"]), "captured": int(fig["captured"]),
                "producer_cpu": round((self.producer_cpu - cpu) / elapsed, 3),  # this rank's, in the trainer
                "capture_cpu": round((now_capture_cpu - capture_cpu) / elapsed, 3)}  # its capture process

    def interrupt(self) -> None:
        """A load that waits for a record gives up now (the capture goes on until close())."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def close(self) -> dict[str, Any]:
        """Stop capturing, empty stream/ (kept/ stays); what the window held at most."""
        self.capture_cpu()  # while its process still runs
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.window.close()
        if self._thread is not None:
            self._thread.join(timeout=2 * EXIT_TIMEOUT_S + 5)
        shutil.rmtree(self.stream_dir, ignore_errors=True)
        fig = self._figures()
        end = {"window_peak": int(fig["window_peak"]), "window_budget": int(fig["window_budget"]),
               "captured": int(fig["captured"]), "producer_cpu_s": round(self.producer_cpu, 2),
               "capture_cpu_s": round(self._capture_cpu, 2)}
        if self._thread is not None and self.rank == 0:
            note = {**self.plan_fields(), **end, "t": time.time()}
            try:
                old = json.loads((self.ws.drafter_dir / DATA_NOTE).read_text())
                note["window_peak"] = max(note["window_peak"], int(old.get("window_peak") or 0))  # over every session
            except (OSError, ValueError, TypeError):
                pass
            atomic.write_json(self.ws.drafter_dir / DATA_NOTE, note)
        return {"mode": self.mode, **end}
