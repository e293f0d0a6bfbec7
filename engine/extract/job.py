"""The extraction job (runs detached): `python -m engine.extract --workspace DIR`.

For every planned sample: send it to a server with capture on (prefill only), check its spool
segments against the request (tokens captured = sent, cached = 0, shapes), stream them into the
record file (finite check, hash and write chunk by chunk: no tensors, no read-back), fsync and
rename it, release the spool, then commit its manifest line together with the other records
finished meanwhile (`commit.GroupCommit`). Several requests are in flight, spread over one or
more endpoints. A server outage waits (and restarts the server the engine owns); a full disk
pauses; SIGTERM stops after the requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from engine.extract.layout import COMPLETE, PAUSE_FILE, RUN_LOCK, SPOOL_SESSIONS
from engine.io import atomic
from engine.system.disk import is_no_space, records_bytes, usage_for
from engine.capture.stfile import tensor_bytes
from engine.extract.commit import GroupCommit
from engine.extract.guard import ExtractionRefused, low_space, require_fit
from engine.extract.plan import Plan, PlannedSample, build_plan
from engine.extract.verify import check_run, rewrite_manifest, write_bad
from engine.records import (
    RecordEntry,
    RecordError,
    quantize_sources,
    read_run_meta,
    save_token_counts,
    write_record_stream,
    write_run_meta,
)
from engine.errors import EngineError

GIB = 2**30
SPACE_CHECK_S = 0.25  # how often free space and the pause file are looked at while requests go out
_RID = re.compile(r"^x\d+-([0-9a-f]{6})-a\d+$")
# An extraction fails (exit non-zero, `extract` red) when no sample is good, or when more than this
# fraction of its planned samples is bad: a run that "succeeds" with nothing is how a server
# capturing somewhere else went unnoticed (issue 20, item 4). Reached mid-run, it stops there.
MAX_BAD_FRACTION = 0.10


class ExtractionFailed(EngineError):
    """The run ended without usable data: too many bad samples (the message names counts and cause)."""


def bad_summary(bad: dict[str, str] | list[tuple[str, str]], planned: int, good: int) -> str | None:
    """Why a run with these bad samples fails, in one line (counts and the commonest cause); None
    when it does not (some good sample and bad <= MAX_BAD_FRACTION of the planned ones)."""
    from collections import Counter

    items = list(bad.items()) if isinstance(bad, dict) else list(bad)
    count = len(items)
    if not count or planned <= 0:
        return None
    too_many = count > MAX_BAD_FRACTION * planned
    if good > 0 and not too_many:
        return None
    causes = Counter(re.sub(r"x\d+-[0-9a-f]{6}-a\d+", "<rid>", reason) for _, reason in items)
    cause, times = causes.most_common(1)[0]
    head = "no good sample: " if good == 0 else ""
    return (f"{head}{count} of {planned} samples bad ({count / planned:.0%}; at most {MAX_BAD_FRACTION:.0%} may be), "
            f"{good} good; commonest cause ({times}x): {cause}")


BAD_FIX = ("find the cause in bad.jsonl (a server capturing into another spool, with other layers or another "
           "model: check the server stage), fix it, then start the extraction again: it retries the bad samples")


class SampleFailed(Exception):
    """This sample's capture is wrong (retry, then record as bad)."""


class SpoolFull(SampleFailed):
    """The server lost the sample's capture because the spool was full: not the sample's fault; wait for
    room and capture it again, as a full output disk pauses the job."""


def capture_failure(exc: Exception) -> SampleFailed:
    """What a capture that cannot be read means for its sample: SpoolFull if the server lost it to a full
    spool, else SampleFailed."""
    from engine.capture.segments import CaptureLost

    return (SpoolFull if isinstance(exc, CaptureLost) and exc.no_space else SampleFailed)(str(exc))


class Outage(Exception):
    """The server is unreachable: not the sample's fault, retry it after the server is back."""


@dataclass
class Progress:
    total: int
    total_tokens: int
    done: int = 0
    tokens: int = 0
    bytes: int = 0
    bad: int = 0
    paused: str = ""
    started: float = field(default_factory=time.monotonic)
    session_tokens: int = 0
    session_bytes: int = 0


class Extractor:
    def __init__(self, workspace, ctx=None, limit: int | None = None):
        self.ws = workspace
        self.cfg = workspace.config
        self.ctx = ctx
        self.limit = limit
        self.run_dir: Path = workspace.hidden_dir
        self.spool: Path = workspace.spool_dir
        self.tag = secrets.token_hex(3)  # rids unique per session: stale segments never collide
        self.bad: dict[str, str] = {}
        self._restart_lock = asyncio.Lock()
        self.failure: str | None = None  # set once too many samples are bad: the run stops there
        self._progress: Progress | None = None
        self._writes: ThreadPoolExecutor | None = None  # every write into the run dir goes through it
        self._sent: set[str] = set()  # rids already sent once: a reused one may have stale segments
        self._down: set[str] = set()  # endpoints in an outage that server_down has announced
        self._commits: GroupCommit | None = None
        self._requests = asyncio.Semaphore(1)  # sized when the run starts
        self._space_ok_at = -SPACE_CHECK_S  # when the disks last had room and no pause was asked for

    @property
    def progress(self) -> Progress:
        """The counts of the run under way (set once the run has started)."""
        assert self._progress is not None, "no run under way"
        return self._progress

    @progress.setter
    def progress(self, value: Progress) -> None:
        self._progress = value

    # -- events
    def event(self, kind: str, **data) -> None:
        if self.ctx is not None:
            self.ctx.event(kind, **data)
        else:
            print(json.dumps({"type": kind, **data}), flush=True)

    @property
    def stopping(self) -> bool:
        return bool(self.failure is not None or (self.ctx is not None and self.ctx.stop_requested))

    # -- setup
    def _target(self):
        from engine.model.target import TargetError, workspace_plan

        try:
            return workspace_plan(self.ws)
        except TargetError as exc:
            raise ExtractionRefused(f"{exc}; fix the `model` stage first") from None

    def _check_run_meta(self, plan: Plan, target, layers: list[int]) -> None:
        from engine.model.weights_id import WEIGHTS_FIX, weights_mismatch

        hidden = target.hidden_size
        meta = {"model": str(self.ws.model_dir), "hidden_size": hidden, "layers": layers,
                "architecture": target.architecture, "sglang_layer_ids": target.sglang_ids, "dataset": plan.dataset,
                "fingerprint": plan.fingerprint, "max_seq_len": self.cfg.dataset.max_seq_len,
                "num_samples": len(plan.samples), "dtype": "bfloat16", "aux_format": self.cfg.extract.aux_format,
                "model_weights": self._weights_id()}
        if (self.run_dir / "run.json").is_file():
            old = {"aux_format": "bf16", **read_run_meta(self.run_dir)}  # runs from before the key: bf16
            for key in ("hidden_size", "layers", "fingerprint", "max_seq_len", "aux_format"):
                if old.get(key) != meta[key]:
                    raise ExtractionRefused(
                        f"run {self.run_dir} was made with {key}={old.get(key)!r}, now {meta[key]!r}: set "
                        "extract.run to a new name (old records are kept until you release them)")
            mismatch = weights_mismatch(old, self.ws.model_dir, meta["model_weights"])
            if mismatch:
                raise ExtractionRefused(f"run {self.run_dir}: {mismatch}; resuming would mix two models' hidden "
                                        f"states in one run. Fix: {WEIGHTS_FIX}")
        else:
            write_run_meta(self.run_dir, {**meta, "created_at": time.time()})

    def _weights_id(self) -> str | None:
        from engine.model.weights_id import weights_id

        try:
            return weights_id(self.ws.model_dir)
        except OSError as exc:
            raise ExtractionRefused(f"the target's weights in {self.ws.model_dir} cannot be read ({exc}); fix the "
                                    "`model` stage first") from None

    def endpoints(self) -> list[str]:
        from engine.server.manager import ServerManager

        primary = ServerManager(self.ws).record().get("url") or f"http://{self.cfg.server.host}:{self.cfg.server.port}"
        return [primary] + [u for u in self.cfg.extract.endpoints if u != primary]

    async def check_server(self) -> None:
        """Refuse to start against a server that captures what console.toml does not describe
        (started before console.toml changed: another spool, layers or model, or no capture):
        every sample would come out bad. One that only moved (server.port) is used where it runs,
        and said so."""
        from engine.client import ServerClient
        from engine.config import ConfigError
        from engine.server.drift import RESTART_FIX, describe, drift, reported_drift, wanted_spec
        from engine.jobs.manager import ACTIVE_STATES
        from engine.server.manager import ServerManager

        manager = ServerManager(self.ws)
        record = manager.record()
        job = manager.job()
        ours = job is not None and job.state in ACTIVE_STATES
        try:
            spec, _ = wanted_spec(self.ws.root, capture=True)
        except ConfigError:
            spec = None
        found: list = []
        for number, url in enumerate(self.endpoints()):
            client = ServerClient(url, api_key=self.cfg.server.api_key or None, timeout=5)
            try:
                info = await client.server_info()
            except Exception:  # noqa: BLE001 - not up (yet), or not answering: the outage handling waits
                info = None
            finally:
                await client.aclose()
            if info is None and number == 0 and not ours and (await manager.poll()).state == "stopped":
                # Nothing answers and nothing of ours is starting or to be restarted: the job would wait
                # for a server nobody starts.
                raise ExtractionRefused(f"no server answers at {url} and this workspace's server is stopped: start "
                                        "it (`eagle3-console server start`, or the Server pane), then start the "
                                        "extraction again")
            if ours and url == record.get("url"):
                if not record.get("capture", True):
                    found.append(("the server", ("capture: the server runs without capture, console.toml's "
                                                 "extraction needs it on")))
                found += [("the server", d) for d in await asyncio.to_thread(drift, manager, info)]
            elif info is not None and spec is not None:
                found += [(url, d) for d in reported_drift(info, spec)]

        def say(where: str, d) -> str:
            if isinstance(d, str):
                return d
            if where == "the server":
                return d.describe()
            return f"{d.setting}: the server at {where} runs with {d.running}, console.toml says {d.wanted}"

        blocking = [(where, d) for where, d in found if isinstance(d, str) or d.blocking]
        if blocking:
            named = "; ".join(say(where, d) for where, d in blocking)
            raise ExtractionRefused(f"the running server differs from console.toml: {named}. Every capture would "
                                    f"be missing or not what console.toml describes: {RESTART_FIX}, then start "
                                    "the extraction again")
        moved = [d for _, d in found if not isinstance(d, str)]
        if moved:
            url = record.get("url", "")
            message = (f"the running server differs from console.toml: {describe(moved)}; extracting from {url}, "
                       f"where it runs (started before console.toml changed): {RESTART_FIX}")
            self.event("server_drift", message=message, url=url, differences=[d.to_dict() for d in moved])
            if self.ctx is not None:
                print(f"extraction: note: {message}", flush=True)

    def _lock_run(self) -> None:
        """One writer per run: two extractions appending to one manifest would duplicate records,
        and only with the lock held are temp files certainly a dead writer's."""
        from engine.workspace import WorkspaceLock

        self._run_lock = WorkspaceLock(self.run_dir, RUN_LOCK)
        if not self._run_lock.acquire(wait_s=1.0):
            who = self._run_lock.holder_text("another process")
            raise ExtractionRefused(f"run {self.run_dir} is being extracted by {who}: wait for that job to finish "
                                    "or stop it (`eagle3-console jobs` lists them, `jobs stop ID` stops one), then start "
                                    "again; it resumes")

    async def _in_writer(self, fn, *args):
        """Run a write into the run directory on the run's writer threads, which the run waits for
        before it lets go of the run lock (a cancelled await does not stop its thread)."""
        if self._writes is None:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._writes, fn, *args)

    # -- spool of earlier sessions
    def release_stale_spool(self, own: bool = False) -> int:
        """Free the captures of earlier sessions of this run: a job killed with requests in flight
        leaves their segments in the spool (often tmpfs) for good. Only our own sessions' rids are
        touched, since several workspaces may share one spool directory. `own`: this session's too,
        once no request is in flight (a writer that ran past extract.capture_wait_s writes a rid the
        job has already released and retried)."""
        from engine.capture.segments import SegmentError, release

        try:
            tags = set((self.run_dir / SPOOL_SESSIONS).read_text(encoding="utf-8").split())
        except FileNotFoundError:
            return 0
        if not own:
            tags.discard(self.tag)
        removed = 0
        if not tags:
            return 0
        if self.spool.is_dir():
            for entry in self.spool.iterdir():
                match = _RID.match(entry.name)
                if match and match.group(1) in tags:
                    try:
                        removed += release(self.spool, entry.name)
                    except (SegmentError, OSError):
                        pass  # not ours after all, or vanishing: leave it
        return removed + self._release_earlier_spools(tags)

    def _release_earlier_spools(self, tags: set[str]) -> int:
        """The same, in the spools earlier servers of this workspace captured into (the server
        record remembers them): a session against a server started before extract.spool_dir
        changed left its captures there."""
        from engine.server.manager import ServerManager
        from engine.server.spool import sweep

        record = ServerManager(self.ws).record()
        spools = {s for s in [record.get("spool_dir"), *(record.get("earlier_spools") or [])]
                  if isinstance(s, str) and s}
        removed = 0
        for spool in spools:
            if Path(spool).resolve() != self.spool.resolve():
                try:
                    removed += sweep(Path(spool), tags).files
                except OSError:
                    pass
        return removed

    # -- disk
    def _space_paths(self) -> dict[str, tuple[Path, int]]:
        return {"output": (self.run_dir, int(self.cfg.extract.disk_reserve_gb * GIB)),
                "spool": (self.spool, int(self.cfg.extract.spool_reserve_gb * GIB))}

    def _pause_reason(self) -> str | None:
        """Low disk, or a pause the user asked for (a `pause.requested` file in the job folder)."""
        if self.ctx is not None and (Path(self.ctx.job_dir) / PAUSE_FILE).exists():
            return "paused by the user"
        return low_space(self._space_paths())

    async def wait_for_space(self) -> None:
        # Looked at every SPACE_CHECK_S, not before every request: each look is a thread hop and two
        # statvfs calls, and a disk that fills in between still pauses (the write meets ENOSPC).
        if time.monotonic() - self._space_ok_at < SPACE_CHECK_S:
            return
        reason = await asyncio.to_thread(self._pause_reason)
        if not reason:
            self._space_ok_at = time.monotonic()
            return
        self.progress.paused = reason
        self.event("paused", reason=reason)
        while reason and not self.stopping:
            await asyncio.sleep(1.0)
            reason = await asyncio.to_thread(self._pause_reason)
        self.progress.paused = ""
        self.event("resumed")

    # -- one sample
    async def request(self, client, sample: PlannedSample, attempt: int) -> str:
        """Send the sample for capture; its rid once the server has captured it as asked."""
        from engine.client import ServerReplyError, ServerUnreachableError

        rid = f"x{sample.index}-{self.tag}-a{attempt}"
        if rid in self._sent:  # sent before (an outage): a capture of that try may linger
            await asyncio.to_thread(self.release_spool, rid)
        self._sent.add(rid)
        try:
            result = await client.generate(input_ids=sample.input_ids, max_new_tokens=0, rid=rid)
        except ServerUnreachableError as exc:
            raise Outage(str(exc)) from None
        except ServerReplyError as exc:
            if exc.status is not None and exc.status >= 500:
                raise Outage(str(exc)) from None
            await asyncio.to_thread(self.release_spool, rid)
            raise SampleFailed(f"server refused the request: {exc}") from None
        meta = result.meta
        problem = None
        if meta.get("cached_tokens") != 0:
            problem = f"cached_tokens={meta.get('cached_tokens')}: the radix cache must be off"
        elif meta.get("prompt_tokens") not in (None, len(sample.input_ids)):
            problem = f"server counted {meta.get('prompt_tokens')} prompt tokens, sent {len(sample.input_ids)}"
        if problem:
            await asyncio.to_thread(self.release_spool, rid)
            raise SampleFailed(problem)
        return rid

    def _write(self, sample: PlannedSample, rid: str, hidden: int) -> RecordEntry:
        """The sample's record in this run (durable, not yet in the manifest: the group commit adds it)."""
        return self.write_capture(sample, rid, hidden, self.run_dir, sample.index, sample.id, sync_dir=False)

    def write_capture(self, sample: PlannedSample, rid: str, hidden: int, run_dir: Path, index: int,
                      record_id: str, durable: bool = True, sync_dir: bool = True) -> RecordEntry:
        """Stream the capture of `rid` into a record `record_id` under `run_dir` (renamed into place, not
        yet in a manifest), then release its spool. `durable` False skips the fsyncs, for records nobody
        trusts after a crash (online training's stream). SampleFailed/RecordError: the capture is wrong."""
        import torch

        from engine.capture.segments import SegmentError, open_capture

        try:
            try:
                capture = open_capture(self.spool, rid, len(sample.input_ids), sample.input_ids,
                                       self.cfg.extract.capture_wait_s)
            except (SegmentError, OSError) as exc:
                raise capture_failure(exc) from None
            with capture:
                aux_width = capture.segments[0].blocks["aux_hidden_state"].shape[1]
                if capture.hidden_size != hidden or aux_width != 3 * hidden:
                    raise SampleFailed(f"captured widths {aux_width}/{capture.hidden_size}, expected "
                                       f"{3 * hidden}/{hidden}")
                aux: list = capture.sources("aux_hidden_state")
                final: list = capture.sources("hidden_state")
                if capture.dtype != "BF16":  # e.g. a float32 target on the CPU: records hold bf16
                    aux = [tensor_bytes(capture.tensor("aux_hidden_state").to(torch.bfloat16))]
                    final = [tensor_bytes(capture.tensor("hidden_state").to(torch.bfloat16))]
                mask = struct.pack(f"<{len(sample.loss_mask)}q", *sample.loss_mask)
                aux_format, scale = self.cfg.extract.aux_format, None
                if aux_format == "fp8":  # engine.aux_fp8: the states are read once to quantize them
                    aux, scale = quantize_sources(aux, hidden)
                return write_record_stream(run_dir, index, record_id, capture.input_ids, mask, aux, final, hidden,
                                           sync_dir=sync_dir, durable=durable, aux_format=aux_format, aux_scale=scale)
        finally:
            self.release_spool(rid)

    def release_spool(self, rid: str) -> None:
        """Free the spool folder of `rid`. Never raises: the sample's fate is decided by then (a record,
        a retry), and a folder we may not empty (a file not ours, no permission) must not undo it or
        crash the job. What is left belongs to this session's tag; a later session sweeps it."""
        from engine.capture.segments import SegmentError, release

        try:
            release(self.spool, rid)
        except (SegmentError, OSError) as exc:
            print(f"warning: capture spool of {rid} left in place: {exc}", file=sys.stderr, flush=True)

    async def wait_for_server(self, url: str, primary: bool) -> None:
        """Wait until the endpoint answers; restart the engine-owned server if it crashed. Every request in
        flight meets the outage: one server_down and one server_up are said for all of them."""
        from engine.client import ServerClient
        from engine.server.manager import ServerManager, ServerStartError

        if url not in self._down:
            self._down.add(url)
            self.event("server_down", url=url)
        client = ServerClient(url, api_key=self.cfg.server.api_key or None, timeout=10)
        try:
            while not self.stopping:
                if primary:
                    async with self._restart_lock:
                        manager = ServerManager(self.ws)
                        status = await manager.poll()
                        if status.state == "crashed" and self.cfg.server.restart_on_crash:
                            self.event("server_restart", exit_code=status.exit_code)
                            try:
                                await manager.ensure_running()
                            except ServerStartError as exc:
                                self.event("server_restart_failed", reason=str(exc))
                try:
                    await client.health_generate()
                    if url in self._down:  # the first waiter to see it back says so
                        self._down.discard(url)
                        self.event("server_up", url=url)
                    return
                except Exception:
                    await asyncio.sleep(1.0)
        finally:
            await client.aclose()

    async def _process(self, sample: PlannedSample, clients, load, hidden: int) -> None:
        attempt = 0
        while not self.stopping:
            await self.wait_for_space()
            if self.stopping:
                return
            try:
                async with self._requests:  # extract.concurrency requests in flight per endpoint
                    i = min(range(len(clients)), key=lambda k: load[k])
                    load[i] += 1
                    try:
                        rid = await self.request(clients[i][1], sample, attempt)
                    finally:
                        load[i] -= 1
                # Written while another worker's request holds the slot: the server never waits
                # for a record to reach the disk before it gets the next request.
                entry = await self._in_writer(self._write, sample, rid, hidden)
            except Outage:
                await self.wait_for_server(clients[i][0], primary=(i == 0))
                continue
            except SpoolFull as exc:
                self.event("paused", reason=f"spool full while capturing {sample.id}: {exc}")
                await asyncio.sleep(1.0)
                continue
            except OSError as exc:
                if is_no_space(exc):
                    # The atomic write removed its temp file; nothing partial is counted.
                    self.event("paused", reason=f"disk full while writing {sample.id}")
                    await asyncio.sleep(1.0)
                    continue
                raise
            except (SampleFailed, RecordError) as exc:
                attempt += 1
                if attempt > self.cfg.extract.max_retries:
                    self.bad[sample.id] = str(exc)
                    self.progress.bad = len(self.bad)
                    await self._in_writer(write_bad, self.run_dir, dict(self.bad))
                    self.event("bad_sample", id=sample.id, reason=str(exc))
                    if self.failure is None and len(self.bad) > MAX_BAD_FRACTION * self.progress.total:
                        # Decided: the run cannot end under the limit. Stop instead of grinding on.
                        good = self.progress.done
                        self.failure = bad_summary(self.bad, self.progress.total, good)
                    return
                self.event("retry", id=sample.id, attempt=attempt, reason=str(exc))
                continue
            if not await self._commit(sample, entry):
                return
            p = self.progress
            p.done += 1
            p.tokens += entry.tokens
            p.bytes += entry.bytes
            p.session_tokens += entry.tokens
            p.session_bytes += entry.bytes
            return

    async def _commit(self, sample: PlannedSample, entry: RecordEntry) -> bool:
        """Commit the record's manifest line (with the group); a full disk pauses and tries again.
        False if the job stops first: the record stays on disk, uncommitted, and is redone."""
        assert self._commits is not None
        while True:
            try:
                await self._commits.commit(entry)
                return True
            except OSError as exc:
                if not is_no_space(exc):
                    raise
                self.event("paused", reason=f"disk full while committing {sample.id}")
                await asyncio.sleep(1.0)
                if self.stopping:
                    return False

    async def _report(self) -> None:
        while True:
            self._emit_progress()
            await asyncio.sleep(1.0)

    def _emit_progress(self) -> None:
        p = self.progress
        elapsed = max(time.monotonic() - p.started, 1e-6)
        tok_s = p.session_tokens / elapsed
        remaining = p.total_tokens - p.tokens
        out = usage_for("output", str(self.run_dir))
        spool = usage_for("spool", str(self.spool))
        data = dict(tokens=p.tokens, total_tokens=p.total_tokens, tokens_per_s=round(tok_s, 1),
                    mb_per_s=round(p.session_bytes / elapsed / 1e6, 2), eta_s=round(remaining / tok_s) if tok_s > 0 else None,
                    bytes=p.bytes, bad=p.bad, paused=p.paused, output_free=out.free, output_mount=out.mount,
                    spool_free=spool.free)
        if self.ctx is not None:
            self.ctx.progress(p.done, p.total, **data)
        else:
            print(json.dumps({"type": "progress", "done": p.done, "total": p.total, **data}), flush=True)

    # -- the run
    async def run(self) -> int:
        target = self._target()
        layers = list(target.capture_layers)
        await self.check_server()
        self.event("planning", dataset=self.cfg.dataset.path)
        plan = await asyncio.to_thread(build_plan, self.ws, self.limit)
        if not plan.samples:
            raise ExtractionRefused(f"dataset {plan.dataset} has no usable sample: run the dataset stage for details")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.spool.mkdir(parents=True, exist_ok=True)
        self._lock_run()
        try:
            return await self._run_locked(plan, target, layers)
        finally:
            self._run_lock.release()

    async def _run_locked(self, plan: Plan, target, layers: list[int]) -> int:
        from engine.client import ServerClient

        hidden = target.hidden_size
        self._check_run_meta(plan, target, layers)
        # Lock held: only a writer killed mid-write can have left a temp file, among the records or
        # beside them (complete.json, token counts, a manifest rewrite: a kill while finishing).
        swept = await asyncio.to_thread(atomic.remove_dead_temp_files, self.run_dir, [".", "records/*"])
        if swept:
            self.event("swept_temp", count=swept)
        await asyncio.to_thread(self.release_stale_spool)
        atomic.append_line(self.run_dir / SPOOL_SESSIONS, self.tag)

        check = await asyncio.to_thread(check_run, self.run_dir, hidden)
        planned = {s.id: s for s in plan.samples}
        beyond = sum(1 for entry_id in check.good if entry_id not in planned)
        if self.limit is not None and beyond:
            # The repair below keeps only planned records: a limited plan would cut finished work out of
            # the manifest (records of the same dataset and tokenizer: the fingerprint matched).
            raise ExtractionRefused(
                f"run {self.run_dir} holds {beyond} finished record(s) beyond --limit {self.limit}: a limited "
                "extraction would drop them from its manifest; run without --limit to resume it, or set "
                "extract.run to a new name for a limited run")
        good = [e for e in check.good.values() if e.id in planned and e.tokens == len(planned[e.id].input_ids)]
        if check.problems or len(good) != len(check.good):
            await asyncio.to_thread(rewrite_manifest, self.run_dir, good)
            self.event("resume_repair", problems=check.problems[:20], redo=len(check.problems))
        done_ids = {e.id for e in good}
        todo = [s for s in plan.samples if s.id not in done_ids]
        if (self.run_dir / "bad.jsonl").exists():  # every bad sample of an earlier session is retried now
            await self._in_writer(write_bad, self.run_dir, {})
        needed = records_bytes(sum(len(s.input_ids) for s in todo), len(todo), hidden, self.cfg.extract.aux_format)
        budget = require_fit(self.run_dir, needed, int(self.cfg.extract.disk_reserve_gb * GIB))
        self.event("started", samples=len(plan.samples), todo=len(todo), resumed=len(good),
                   verified=check.checked, hashed=check.deep_checked, budget=budget.message(),
                   truncated=plan.truncated, bad_lines=plan.bad_lines)
        self.progress = Progress(total=len(plan.samples), total_tokens=plan.total_tokens, done=len(good),
                                 tokens=sum(e.tokens for e in good), bytes=sum(e.bytes for e in good))

        clients = [(url, ServerClient(url, api_key=self.cfg.server.api_key or None, timeout=600))
                   for url in self.endpoints()]
        load = [0] * len(clients)
        queue: asyncio.Queue[PlannedSample] = asyncio.Queue()
        for sample in todo:
            queue.put_nowait(sample)

        async def worker() -> None:
            while not self.stopping:
                try:
                    sample = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await self._process(sample, clients, load, hidden)

        reporter = asyncio.create_task(self._report())
        in_flight = self.cfg.extract.concurrency * len(clients)
        self._requests = asyncio.Semaphore(in_flight)
        # Twice as many workers as requests in flight: while one writes its record, another's
        # request takes its place at the server (the spool holds at most twice `in_flight` captures).
        n_workers = 2 * in_flight
        self._writes = ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="record-writer")
        self._commits = GroupCommit(self.run_dir, self._in_writer)
        workers: list[asyncio.Task] = []
        try:
            workers = [asyncio.create_task(worker()) for _ in range(n_workers)]
            await asyncio.gather(*workers)
        finally:
            # One worker's error must not leave the others writing records after the run lock
            # is released: stop them, then wait for the writes already under way.
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            writes, self._writes = self._writes, None
            await asyncio.to_thread(writes.shutdown, True)
            if self.bad:  # the writer threads may have finished their bad.jsonl snapshots out of order
                await asyncio.to_thread(write_bad, self.run_dir, dict(self.bad))
            reporter.cancel()
            for _, client in clients:
                await client.aclose()
        self._emit_progress()
        if self.failure is not None:
            left = self.progress.total - self.progress.done - len(self.bad)
            raise ExtractionFailed(f"{self.failure}; stopped with {left} sample(s) not attempted. {BAD_FIX}")
        if self.stopping:
            self.event("stopped", done=self.progress.done, total=self.progress.total)
            return 0
        return await asyncio.to_thread(self._finish, plan, target)

    def _finish(self, plan: Plan, target) -> int:
        import torch

        hidden = target.hidden_size
        # Sizes only: this session hashed its records as it wrote them, and the start of the
        # session verified the earlier ones (re-reading gigabytes here would prove nothing new).
        final = check_run(self.run_dir, hidden, deep=False, recent=0)
        self.release_stale_spool(own=True)  # late captures: a killed session's, and ours given up on
        covered = set(final.good)
        missing = [s.id for s in plan.samples if s.id not in covered and s.id not in self.bad]
        if missing:
            self.event("incomplete", missing=missing[:20], count=len(missing))
            return 3
        failure = bad_summary(self.bad, len(plan.samples), len(covered))
        if failure is not None:  # no complete.json: the run did not give what it was for
            raise ExtractionFailed(f"{failure}. {BAD_FIX}")
        vocab = target.vocab_size
        counts = torch.zeros(vocab, dtype=torch.int64)
        for s in plan.samples:
            if s.id in covered:
                ids = torch.tensor(s.input_ids)
                mask = torch.tensor(s.loss_mask, dtype=torch.bool)
                counts += torch.bincount(ids[mask], minlength=vocab)[:vocab]
        save_token_counts(self.run_dir, counts)
        summary = {"samples": len(covered), "bad": len(self.bad), "tokens": final.tokens, "bytes": final.bytes,
                   "fingerprint": plan.fingerprint, "finished_at": time.time()}
        atomic.write_json(self.run_dir / COMPLETE, summary)
        self.event("finished", **summary)
        return 0


def limit_torch_threads(concurrency: int) -> int:
    """The job's parallelism is across samples (a worker thread each); every torch op of a worker
    also fanning out over all cores would oversubscribe the CPU many times over. Per process:
    call it in the job's own process, not in a host that runs other torch work."""
    import torch

    threads = max(1, min(4, (os.cpu_count() or 2) // max(1, concurrency)))
    torch.set_num_threads(threads)
    return threads


def main(argv: list[str] | None = None) -> int:
    import argparse

    from engine.config import ConfigError
    from engine.jobs.context import JobContext, say_error
    from engine.workspace import Workspace

    parser = argparse.ArgumentParser(prog="python -m engine.extract")
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--limit", type=int, default=None, help="extract only the first N samples")
    args = parser.parse_args(argv)
    ctx = None
    try:
        ctx = JobContext.from_env()
        ctx.install_sigterm_handler()
    except Exception:
        ctx = None  # run by hand: events go to stdout
    try:
        ws = Workspace(args.workspace)
        limit_torch_threads(ws.config.extract.concurrency)
        return asyncio.run(Extractor(ws, ctx, args.limit).run())
    except (ConfigError, ExtractionRefused, ExtractionFailed, RecordError) as exc:
        return say_error(ctx, "extraction", str(exc))
    except OSError as exc:
        # Mid-run a full disk pauses; one that fills while the job starts or finishes (run.json,
        # token counts) ends it cleanly: every committed record stays, a restart resumes.
        if not is_no_space(exc):
            raise
        return say_error(ctx, "extraction", f"no space left on the disk of {exc.filename or 'the output'}: free "
                         "some space (or set extract.output_dir on another disk) and start the extraction again; "
                         "it resumes")
