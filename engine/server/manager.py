"""The server process the engine owns: start detached, wait for readiness, poll, stop, restart.

The server is a job of kind "server" (engine.jobs.manager), so it survives the console. Which job
is *the* server, and whether it should be running, is recorded in `<ws>/state/server.json`:
a crash is a server that should run but does not.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.io import atomic
from engine.jobs.manager import ACTIVE_STATES, JobInfo, JobManager
from engine.server.local import build_spec
from engine.server.spec import LaunchSpec
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.client import ServerClient

STATE_FILE = "server.json"
INFO_REFRESH_S = 30.0  # the watcher re-reads /server_info this often (it is fixed per server process)


class ServerStartError(EngineError):
    """The server could not start; the message names the cause and carries the log tail."""

    def __init__(self, message: str, log_tail: list[str] | None = None):
        super().__init__(message)
        self.log_tail = log_tail or []


@dataclass(frozen=True)
class ServerStatus:
    state: str  # stopped | starting | ready | unhealthy | crashed
    backend: str = ""
    url: str = ""
    job_id: str | None = None
    pid: int | None = None
    uptime_s: float | None = None
    model: str = ""
    capture: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)  # capture-relevant server args
    gen_throughput: float | None = None
    running_reqs: float | None = None
    queued_reqs: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    cached_tokens_total: float | None = None
    exit_code: int | None = None
    restarts: int = 0
    error: str = ""
    log_tail: tuple[str, ...] = ()
    at: float = field(default_factory=time.time)
    # How the running server differs from console.toml now (engine.server.drift.Difference).
    drift: tuple = ()

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data["log_tail"] = list(self.log_tail)
        data["drift"] = [d.to_dict() for d in self.drift]
        return data


FLAG_KEYS = ("disable_radix_cache", "speculative_algorithm", "enable_metrics", "chunked_prefill_size",
             "enable_mixed_chunk", "skip_server_warmup", "tp_size", "dp_size", "attention_backend")


def server_flags(info: dict[str, Any]) -> dict[str, Any]:
    """The capture-relevant flags of /server_info, plus the local server's prefill CUDA graphs in
    one word: "on (N buckets)", "off", or "failed" (prefill then runs eagerly, several times slower
    on a small target), and how it writes segments: "threads", "process", or "process stopped"
    (the writer process died and the server's threads took over)."""
    flags: dict[str, Any] = {}
    graphs = info.get("prefill_cuda_graphs")
    if isinstance(graphs, dict):  # first: the pane clips the line, and this one changes the speed most
        if graphs.get("failure"):
            flags["prefill_graphs"] = "failed"
        elif graphs.get("enabled"):
            flags["prefill_graphs"] = f"on ({len(graphs.get('buckets') or [])} buckets)"
        else:
            flags["prefill_graphs"] = "off"
    flags.update((k, info.get(k)) for k in FLAG_KEYS if k in info)
    writer = info["capture"].get("writer") if isinstance(info.get("capture"), dict) else None
    if isinstance(writer, str):  # the local server's segment writers: "threads", "process", or a fallback
        mode = writer.split(" ", 1)[0]
        if mode == "threads" and "process" in writer:  # a warning: first, before the pane clips the line
            flags = {"capture_writer": "process stopped", **flags}
        else:
            flags["capture_writer"] = mode
    return flags


def port_in_use(host: str, port: int) -> str | None:
    """None if we can bind host:port, else a description naming who holds it (when visible)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return None
        except OSError:
            pass
    owner = ""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                owner = f" by pid {conn.pid} ({psutil.Process(conn.pid).name()})"
                break
    except Exception:  # permissions or a vanished process: the port is busy either way
        pass
    return f"port {port} on {host} is in use{owner}"


class ServerManager:
    def __init__(self, workspace, jobs: JobManager | None = None):
        self.workspace = workspace
        self.jobs = jobs or JobManager(workspace.jobs_dir)
        # What poll() keeps between calls: the stopped status for unchanged files, the server's
        # info for one job, the watcher's HTTP client for one url on one event loop.
        self._idle_poll: tuple[tuple, ServerStatus] | None = None
        self._held_info: tuple[tuple[str, int | None], float, dict[str, Any]] | None = None
        self._held_client: tuple[tuple[str | None, asyncio.AbstractEventLoop], ServerClient] | None = None

    # -- the record of which job is the server
    @property
    def _state_path(self):
        return self.workspace.state_dir / STATE_FILE

    def record(self) -> dict[str, Any]:
        try:
            data = json.loads(self._state_path.read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_record(self, **changes: Any) -> dict[str, Any]:
        data = {**self.record(), **changes}
        atomic.write_json(self._state_path, data, mode=0o600)
        return data

    def job(self) -> JobInfo | None:
        job_id = self.record().get("job_id")
        if not job_id:
            return None
        try:
            return self.jobs.get(job_id)
        except LookupError:
            return None

    def is_running(self) -> bool:
        job = self.job()
        return job is not None and job.state in ACTIVE_STATES

    def spec(self, capture: bool = True) -> LaunchSpec:
        return build_spec(self.workspace, capture=capture)

    def drift(self, info: dict[str, Any] | None = None) -> list:
        """How the running server differs from console.toml on disk (engine.server.drift); [] when
        none runs. Remembered until console.toml, the record or the job changes."""
        from engine.server.drift import remembered_drift

        return remembered_drift(self, info)

    def client(self, url: str | None = None) -> ServerClient:
        from engine.client import ServerClient

        rec = self.record()
        return ServerClient(url or rec.get("url") or self.spec().url, api_key=self.workspace.config.server.api_key or None)

    # -- start / stop
    async def start(self, capture: bool = True, timeout: float | None = None, restarts: int | None = None) -> ServerStatus:
        """Start the server and wait until it generates; raise ServerStartError fast on failure."""
        current = self.job()
        if current is not None and current.state in ACTIVE_STATES:
            return await self.poll()
        from engine.config import ConfigError
        from engine.model.weights_id import readable_weights_id
        from engine.server.drift import api_key_fingerprint

        try:
            # console.toml as it is now, not as it was when this process first read it: a restart
            # is how an edit reaches the server (engine.server.drift).
            if self.workspace.config_path.is_file():
                self.workspace.reload()
            spec = self.spec(capture=capture)
        except ConfigError as exc:  # refused before anything starts: the target cannot be planned or captured
            raise ServerStartError(str(exc)) from None
        busy = port_in_use(spec.host, spec.port)
        if busy:
            raise ServerStartError(f"{busy}: stop whatever holds it, or set server.port to a free port")
        spools = self._earlier_spools(spec)
        weights = await asyncio.to_thread(readable_weights_id, self.workspace.model_dir)
        # JobManager.start waits (briefly, blocking) for the supervisor: keep it off the event loop.
        job = await asyncio.to_thread(self.jobs.start, "server", spec.argv, env=spec.env, cwd=self.workspace.root)
        self._write_record(job_id=job.id, url=spec.url, backend=spec.backend, desired="running",
                           capture=spec.capture, spool_dir=spec.spool_dir, capture_layers=list(spec.capture_layers),
                           argv=spec.redacted_argv(), env=spec.redacted_env_set(), started_at=time.time(),
                           api_key_sha256=api_key_fingerprint(self.workspace.config.server.api_key),
                           earlier_spools=spools, model_weights=weights,
                           restarts=self.record().get("restarts", 0) if restarts is None else restarts)
        if spools:
            await asyncio.to_thread(self._sweep_earlier_spools, spools, spec.spool_dir)
        await self.wait_ready(job.id, spec.url, timeout or self.workspace.config.server.startup_timeout_s)
        return await self.poll()

    def _earlier_spools(self, spec: LaunchSpec) -> list[str]:
        """The spools earlier servers of this workspace captured into, other than the new one's."""
        from engine.server.spool import HISTORY

        rec = self.record()
        found = [s for s in [rec.get("spool_dir"), *(rec.get("earlier_spools") or [])] if isinstance(s, str) and s]
        keep = spec.spool_dir if spec.capture else None
        out: list[str] = []
        for spool in found:
            if spool != keep and spool not in out:
                out.append(spool)
        return out[:HISTORY]

    def _sweep_earlier_spools(self, spools: list[str], keep: str) -> None:
        """The old server is gone: its spools hold only what nobody will collect (except a live
        extraction's own captures, which it releases itself)."""
        from engine.server.spool import sweep_earlier_spools

        try:
            swept = sweep_earlier_spools(self.workspace, spools, keep=keep)
        except OSError:
            return
        if swept.folders:
            self._write_record(last_sweep={"at": time.time(), "spools": spools, "folders": swept.folders,
                                           "files": swept.files, "bytes": swept.bytes})

    async def restart(self, capture: bool | None = None, timeout: float | None = None) -> ServerStatus:
        """Stop the server and start it again from console.toml as it is now (applies an edit)."""
        if capture is None:
            capture = bool(self.record().get("capture", True))
        await self.stop()
        return await self.start(capture=capture, timeout=timeout)

    async def wait_ready(self, job_id: str, url: str, timeout: float) -> None:
        await wait_until_ready(self.jobs, job_id, self.client(url), timeout)

    async def stop(self, grace: float = 15.0) -> ServerStatus:
        self._write_record(desired="stopped")
        job = self.job()
        if job is not None and job.state in ACTIVE_STATES:
            await self.jobs.stop(job.id, grace=grace)
        return await self.poll()

    async def ensure_running(self) -> ServerStatus:
        """Restart a server that should run but crashed (restart policy permitting)."""
        status = await self.poll()
        if status.state == "crashed" and self.workspace.config.server.restart_on_crash:
            return await self.start(capture=bool(self.record().get("capture", True)),
                                    restarts=int(self.record().get("restarts", 0)) + 1)
        return status

    # -- polling
    async def poll(self, *, reuse_client: bool = False) -> ServerStatus:
        """The server's status now. `reuse_client`: keep one HTTP client between calls (the
        watcher: creating one builds an SSL context, every second: bench/RESULTS.md, Console overhead);
        close it with close_poll_client().

        A stopped or crashed server whose record and job files have not changed since the last
        poll is not read again (the console polls every second, mostly with no server)."""
        key = self._poll_files_key()
        cached = self._idle_poll
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        rec = self.record()
        job_id = rec.get("job_id")
        job = await asyncio.to_thread(self.job) if job_id else None
        base = dict(backend=rec.get("backend", ""), url=rec.get("url", ""), restarts=int(rec.get("restarts", 0)))
        if job is None:
            return self._remember_idle(key, ServerStatus(state="stopped", **base))
        base.update(job_id=job.id, pid=job.pid)
        if job.state not in ACTIVE_STATES:
            tail = tuple(job.last_log_lines or self.jobs.tail(job.id, 10))
            crashed = rec.get("desired") == "running"
            return self._remember_idle(key, ServerStatus(
                state="crashed" if crashed else "stopped", exit_code=job.exit_code, log_tail=tail,
                error=(_failure_reason(list(tail)) if crashed else ""), **base))
        self._idle_poll = None
        base["uptime_s"] = time.time() - job.started_at if job.started_at else None
        client = await self._poll_client(rec.get("url")) if reuse_client else self.client(rec.get("url"))
        try:
            info = await self._server_info(client, job) if reuse_client else await client.server_info()
            metrics = await client.metrics()
        except Exception as exc:
            base["drift"] = tuple(await asyncio.to_thread(self.drift))
            return ServerStatus(state="starting" if (base["uptime_s"] or 0) < 5 else "unhealthy", error=str(exc)[:300],
                                log_tail=tuple(self.jobs.tail(job.id, 10)), **base)
        finally:
            if not reuse_client:
                await client.aclose()
        base["drift"] = tuple(await asyncio.to_thread(self.drift, info))
        return ServerStatus(
            state="ready", model=str(info.get("model_path", "")), capture=_capture_info(info),
            flags=server_flags(info),
            gen_throughput=metrics.get("sglang:gen_throughput"),
            running_reqs=metrics.get("sglang:num_running_reqs"),
            queued_reqs=metrics.get("sglang:num_queue_reqs"),
            prompt_tokens_total=metrics.get("sglang:prompt_tokens_total"),
            generation_tokens_total=metrics.get("sglang:generation_tokens_total"),
            cached_tokens_total=metrics.get("sglang:cached_tokens_total"),
            log_tail=tuple(self.jobs.tail(job.id, 10)), **base,
        )

    def _poll_files_key(self) -> tuple | None:
        """Identity (inode, size, mtime) of server.json and of the recorded job's job.json."""
        from engine.jobs.context import RECORD_FILE

        def ident(path) -> tuple[int, int, int] | None:
            try:
                st = path.stat()
            except OSError:
                return None
            return (st.st_ino, st.st_size, st.st_mtime_ns)

        state = ident(self._state_path)
        remembered = getattr(self, "_record_job_id", None)  # (server.json identity, its job_id)
        if state is None:
            job_id = None
        elif remembered is not None and remembered[0] == state:
            job_id = remembered[1]
        else:
            job_id = self.record().get("job_id")
            self._record_job_id = (state, job_id)
        if not job_id:
            return (state, None)
        if not isinstance(job_id, str) or "/" in job_id or job_id.startswith("."):
            return None  # not a plain folder name: never cached, let the full poll report it
        return (state, ident(self.jobs.jobs_dir / job_id / RECORD_FILE))

    async def _server_info(self, client: ServerClient, job: JobInfo) -> dict[str, Any]:
        """/server_info for the watcher: it names the model and launch flags, fixed for a server
        process, so it is fetched once per process and then every INFO_REFRESH_S, not every poll."""
        held = self._held_info
        now = time.monotonic()
        if held is not None and held[0] == (job.id, job.pid) and now - held[1] < INFO_REFRESH_S:
            return held[2]
        self._held_info = None
        info = await client.server_info()
        self._held_info = ((job.id, job.pid), now, info)
        return info

    def _remember_idle(self, key: tuple | None, status: ServerStatus) -> ServerStatus:
        self._idle_poll = (key, status) if key is not None else None
        return status

    async def _poll_client(self, url: str | None) -> ServerClient:
        """The watcher's HTTP client, made again when the url changes or on another event loop."""
        loop = asyncio.get_running_loop()
        held = self._held_client
        if held is not None and held[0] == (url, loop):
            return held[1]
        await self.close_poll_client()
        client = self.client(url)
        self._held_client = ((url, loop), client)
        return client

    async def close_poll_client(self) -> None:
        held = self._held_client
        self._held_client = None
        if held is not None and held[0][1] is asyncio.get_running_loop():
            try:
                await held[1].aclose()
            except Exception:  # closing a pool whose connections already broke
                pass

    async def watch(self, callback, interval: float = 1.0) -> None:
        """Poll forever; restart a crashed server when the policy allows (one poller, self-rescheduling)."""
        try:
            while True:
                started = time.monotonic()
                try:
                    status = await self.poll(reuse_client=True)
                    if status.state == "crashed" and self.workspace.config.server.restart_on_crash:
                        callback(status)
                        try:
                            status = await self.ensure_running()
                        except ServerStartError as exc:
                            error = f"restart failed: {exc}"
                            try:
                                self._write_record(desired="stopped")  # no restart loop
                            except OSError as record_error:  # a full disk: the reason above still comes first
                                error += (f"; and {self._state_path} could not be written "
                                          f"({record_error.strerror or record_error})")
                            status = ServerStatus(state="crashed", error=error, log_tail=tuple(exc.log_tail))
                    callback(status)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the watcher must outlive any single failure
                    callback(ServerStatus(state="unhealthy", error=f"poll failed: {exc}"))
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
        finally:
            await self.close_poll_client()

    def logs(self, n: int = 50) -> list[str]:
        job = self.job()
        return self.jobs.tail(job.id, n) if job else []


async def wait_until_ready(jobs: JobManager, job_id: str, client, timeout: float) -> None:
    """Wait until the server job answers /health_generate; ServerStartError (with the log tail)
    as soon as it exits, or after `timeout` (then it is stopped). Closes `client`."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            job = await asyncio.to_thread(jobs.get, job_id)
            if job.state not in ACTIVE_STATES:
                tail = jobs.tail(job_id, 20)
                reason = _failure_reason(tail) or f"server exited with code {job.exit_code}"
                raise ServerStartError(f"server failed to start: {reason}", tail)
            try:
                await client.health_generate()
                return
            except Exception:
                pass
            if time.monotonic() > deadline:
                tail = jobs.tail(job_id, 20)
                await jobs.stop(job_id, grace=5)
                raise ServerStartError(
                    f"server not ready after {timeout:.0f}s (stopped it): see the log; raise "
                    "server.startup_timeout_s if the model is large", tail)
            await asyncio.sleep(0.25)
    finally:
        await client.aclose()


def _capture_info(info: dict[str, Any]) -> dict[str, Any]:
    """Capture settings: the local server reports `capture`; SGLang carries our hook's config."""
    if isinstance(info.get("capture"), dict):
        return dict(info["capture"])
    if info.get("forward_hooks"):
        from engine.sglang.launch import hook_layers

        layers, layers_sglang = hook_layers(info)
        if layers is not None:
            return {"enabled": True, "layers": layers, "layers_sglang": layers_sglang, "backend": "sglang hook"}
    return {}


_KNOWN_FAILURES = (
    ("model path", None),
    ("is in use", None),
    ("out of memory", "out of GPU memory: lower mem fraction, use more GPUs (tp_size) or a smaller model"),
    ("CUDA error", None),
    ("No module named", "a Python package is missing on this machine"),
)


def _failure_reason(tail: list[str]) -> str:
    """The most telling log line: a known failure if one appears, else the last non-empty line."""
    for line in reversed(tail):
        low = line.lower()
        for needle, explanation in _KNOWN_FAILURES:
            if needle.lower() in low:
                return f"{line.strip()}" + (f" ({explanation})" if explanation else "")
    for line in reversed(tail):
        if line.strip():
            return line.strip()
    return ""
