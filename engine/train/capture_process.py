"""Online training's captures, made in a process of their own.

A capture costs CPU in the client: the request, then reading the server's spool segments back,
checking, hashing and writing the record. Inside the trainer's process that work shares the GIL with
the training loop (bench/RESULTS.md, runs 13-15: the online trainer ran at ~0.4 of its offline rate
with the window full). So the trainer's producer thread (engine.train.online) keeps only what needs its
state: the order of the samples, the window's budget, the bookkeeping. It sends this process one order
per record; this process requests the capture through the extraction's own path
(engine.extract.job.Extractor), writes the record where the order says (stream/ without fsync, kept/
durably with its manifest line) and answers with the record's manifest entry.

Messages (multiprocessing.connection over a socket pair, pickled tuples):
  trainer -> here   ("capture", Order)   one record
                    ("end",)             no order follows: answer those sent, then exit
                    ("stop",)            exit now (captures under way are dropped; their writes finish)
  here -> trainer   ("ready",)           set up, the server checked
                    ("stored", seq, RecordEntry)
                    ("failed", message)  nothing more is captured
                    ("ended", cpu_s)     every order answered

It dies with its trainer (PR_SET_PDEATHSIG, and EOF on the connection) and ignores SIGTERM: a job's stop
signals its whole process group, and the trainer stops its captures itself once it has checkpointed.
Captures it had in flight stay in the server's spool until the next start frees them: its session's tag
is in the window's spool sessions, as an extraction job's is in its run directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Iterator

from engine.errors import EngineError
from engine.system.disk import is_no_space

READY_TIMEOUT_S = 300.0  # imports, the server check and the spool sweep; a dead process is seen at once
EXIT_TIMEOUT_S = 60.0  # for the writes under way to finish after a stop, before a kill


class CaptureProcessError(EngineError):
    """The capture process could not start, or stopped; the message names the cause and the fix."""


def failure_text(exc: BaseException) -> str:
    """What the trainer is told when the capture stops on `exc`: our errors say cause and fix themselves."""
    return str(exc) if isinstance(exc, EngineError) else f"online capture stopped: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class CaptureSpec:
    """What the capture process needs from its trainer (sent as JSON on its command line)."""

    root: str  # the workspace
    rank: int
    hidden_size: int
    window_dir: str  # this rank's: its spool sessions are recorded there
    stream_dir: str
    kept_dir: str
    job_dir: str | None  # events go to this job's events.jsonl (rank 0), else nowhere
    workers: int  # captures under way at once (requests plus records being written)
    parent_pid: int


@dataclass(frozen=True)
class Order:
    seq: int  # unique per capture in the trainer's session: its rid and its stream/ file name
    sample: Any  # engine.extract.plan.PlannedSample
    keep: bool  # kept/ (durable, with a manifest line) or stream/


# ---------------------------------------------------------------------------------------------- trainer side
class CaptureProcess:
    """The trainer's handle on its capture process. Start it from a thread that outlives it (the kernel's
    parent-death signal follows the starting thread)."""

    def __init__(self, spec: CaptureSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None

    def start(self) -> None:
        """Start the process and wait until it is ready; CaptureProcessError with its reason if not."""
        ours, theirs = Pipe(duplex=True)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.train.capture_process", str(theirs.fileno()),
                 json.dumps(asdict(self.spec))],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = ours
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ours.poll(0.5):
            if self.proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise CaptureProcessError(f"the capture process was not ready after {READY_TIMEOUT_S:.0f} s: see "
                                          "the job log for where it stood, then start training again")
        message = self._recv()
        if message is None:
            raise CaptureProcessError(f"the capture process exited ({self.exit_text()}) before it was ready: its "
                                      "error is in the job log; fix it, then start training again")
        if message[0] == "failed":
            self.stop()
            raise CaptureProcessError(message[1])

    def order(self, order: Order) -> None:
        assert self.conn is not None
        self.conn.send(("capture", order))

    def end(self) -> None:
        """No order follows: the process answers the ones sent, says `ended` and exits."""
        self._send(("end",))

    def messages(self) -> Iterator[tuple]:
        """Its answers, until it exits (one reader thread)."""
        while (message := self._recv()) is not None:
            yield message

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_text(self, wait: float = 5.0) -> str:
        """How it ended (waiting up to `wait` s for it to be reaped: its connection closes first)."""
        if self.proc is None:
            return "never started"
        try:
            code = self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def stop(self, timeout: float = EXIT_TIMEOUT_S) -> None:
        """Ask it to exit (the writes under way finish), wait, kill it if it does not. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._send(("stop",))
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        """After stop() and after the reader has seen the end: the connection goes."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _send(self, message: tuple) -> None:
        try:
            if self.conn is not None:
                self.conn.send(message)
        except OSError:  # it exited already
            pass

    def _recv(self) -> tuple | None:
        try:
            return self.conn.recv() if self.conn is not None else None
        except (EOFError, OSError):
            return None


# ---------------------------------------------------------------------------------------------- the process
class Capturer:
    """Requests captures and writes their records (the loop of the capture process)."""

    def __init__(self, spec: CaptureSpec, conn: Connection):
        from engine.jobs.context import JobContext
        from engine.workspace import Workspace

        self.spec = spec
        self.conn = conn
        self._send_lock = threading.Lock()
        self.ws = Workspace(spec.root)
        self.cfg = self.ws.config
        self.ctx = JobContext(Path(spec.job_dir)) if spec.job_dir else None
        self.stream_dir, self.kept_dir = Path(spec.stream_dir), Path(spec.kept_dir)
        self.stopping = False
        self._workers: list[asyncio.Task] = []

    def send(self, *message: Any) -> None:
        with self._send_lock:  # the loop and the writer threads answer
            try:
                self.conn.send(message)
            except OSError:  # the trainer is gone: this process follows it
                self.stopping = True

    def event(self, kind: str, **data: Any) -> None:
        if self.ctx is not None:
            self.ctx.event(kind, **data)

    async def run(self) -> None:
        from engine.client import ServerClient
        from engine.extract.guard import ExtractionRefused
        from engine.extract.job import Extractor
        from engine.extract.layout import SPOOL_SESSIONS
        from engine.io import atomic

        self.extractor = extractor = Extractor(self.ws, self.ctx)
        extractor.run_dir = Path(self.spec.window_dir)  # its spool sessions are recorded there
        try:
            await extractor.check_server()
        except ExtractionRefused as exc:
            self.send("failed", str(exc).replace("start the extraction again", "start training again"))
            return
        extractor.spool.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(extractor.release_stale_spool)
        atomic.append_line(extractor.run_dir / SPOOL_SESSIONS, extractor.tag)
        self.clients = [(url, ServerClient(url, api_key=self.cfg.server.api_key or None, timeout=600))
                        for url in extractor.endpoints()]
        self.load = [0] * len(self.clients)
        self.slots = asyncio.Semaphore(self.cfg.extract.concurrency * len(self.clients))
        self.writes = ThreadPoolExecutor(max_workers=self.spec.workers, thread_name_prefix="capture-writer")
        orders: asyncio.Queue[tuple] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.send("ready")
        self._workers = workers = [asyncio.create_task(self._worker(orders)) for _ in range(self.spec.workers)]
        threading.Thread(target=self._read_orders, args=(loop, orders), name="capture-orders", daemon=True).start()
        try:
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.to_thread(self.writes.shutdown, True)  # a record being written is finished
            for _, client in self.clients:
                await client.aclose()
        if not self.stopping:
            self.send("ended", round(time.process_time(), 3))

    def _read_orders(self, loop: asyncio.AbstractEventLoop, orders: asyncio.Queue) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the trainer is gone
                message = ("stop",)
            if message[0] == "stop":
                loop.call_soon_threadsafe(self._stop_now)
                return
            loop.call_soon_threadsafe(orders.put_nowait, message)
            if message[0] == "end":
                return

    def _stop_now(self) -> None:
        """Captures under way are dropped (a record being written is finished by its writer thread)."""
        self.stopping = True
        for task in self._workers:
            task.cancel()

    async def _worker(self, orders: asyncio.Queue) -> None:
        while not self.stopping:
            message = await orders.get()
            if message[0] == "end":
                orders.put_nowait(message)  # for the other workers: it comes after every order
                return
            order: Order = message[1]
            try:
                entry = await self._capture(order)
            except Exception as exc:
                self.send("failed", failure_text(exc))
                self._stop_now()  # the trainer stops on it: nothing more is captured
                return
            if entry is not None:
                self.send("stored", order.seq, entry)

    async def _capture(self, order: Order):
        from engine.extract.job import Outage, SampleFailed, SpoolFull
        from engine.records import RecordError

        extractor, retries, attempt = self.extractor, self.cfg.extract.max_retries, 0
        loop = asyncio.get_running_loop()
        while not self.stopping:
            i = 0
            try:
                async with self.slots:  # extract.concurrency requests per endpoint, as the extraction job
                    i = min(range(len(self.clients)), key=lambda k: self.load[k])
                    self.load[i] += 1
                    try:
                        # rid x<index>-<tag>-a<n>: n unique per capture of this session, so two captures of one
                        # sample (consecutive epochs) never share spool segments (max_retries <= 1000 < 10,000)
                        rid = await extractor.request(self.clients[i][1], order.sample, order.seq * 10_000 + attempt)
                    finally:
                        self.load[i] -= 1
                # Written after the slot is given back: the next request is at the server meanwhile.
                return await loop.run_in_executor(self.writes, self._write, order, rid)
            except Outage:
                await extractor.wait_for_server(self.clients[i][0], primary=(i == 0 and self.spec.rank == 0))
                await asyncio.sleep(0.5)  # it returns at once when a stop is asked: no busy loop
            except SpoolFull as exc:  # the server's spool, not the window: the trainer's progress does not free it
                self.event("retry", id=order.sample.id, attempt=attempt, reason=str(exc))
                await asyncio.sleep(1.0)
            except (SampleFailed, RecordError) as exc:
                attempt += 1
                if attempt > retries:
                    raise CaptureProcessError(
                        f"sample {order.sample.id} could not be captured in {attempt} attempts: {exc}; check the "
                        "`capture` stage (`eagle3-console check capture`), fix what it names, then start training "
                        "again: it resumes from its checkpoint") from None
                self.event("retry", id=order.sample.id, attempt=attempt, reason=str(exc))
            except OSError as exc:
                if not is_no_space(exc):
                    raise
                # Not a pause, as in the extraction: what fills the disk may be the window's own records of
                # later steps, which only the trainer's progress frees, and it waits for this one.
                where = self.kept_dir if order.keep else self.stream_dir
                raise CaptureProcessError(
                    f"disk full while writing the online window in {where} ({exc.strerror}): free space on that "
                    "disk or lower train.window_gb (`eagle3-console check disk` shows what fits), then start "
                    "training again: it resumes from its checkpoint") from None
        return None

    def _write(self, order: Order, rid: str):
        """Stream the capture into its record: kept/ durably with a manifest line, stream/ without fsync."""
        from engine.records import append_manifest

        sample, h, extractor = order.sample, self.spec.hidden_size, self.extractor
        if order.keep:
            entry = extractor.write_capture(sample, rid, h, self.kept_dir, sample.index, sample.id)
            append_manifest(self.kept_dir, entry)
            return entry
        return extractor.write_capture(sample, rid, h, self.stream_dir, order.seq, f"s{order.seq}", durable=False)


def main(argv: list[str] | None = None) -> int:
    from engine.system.procinfo import die_with_parent

    args = sys.argv[1:] if argv is None else argv
    die_with_parent()
    # A job is stopped by SIGTERM to its process group: the trainer checkpoints at its next step, and the
    # batch it may be waiting for must still arrive. This process stops when the trainer says so.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(args[0]))
    spec = CaptureSpec(**json.loads(args[1]))
    if os.getppid() != spec.parent_pid:  # the trainer died before the death signal was set
        return 1
    capturer = Capturer(spec, conn)
    try:
        asyncio.run(capturer.run())
    except Exception as exc:
        capturer.send("failed", failure_text(exc))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
