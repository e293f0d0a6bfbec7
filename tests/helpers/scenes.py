"""Deterministic scenes of the console for snapshot tests and documentation screenshots.

A scene is a real ConsoleApp over a real (non-demo) workspace whose engine pollers are not
started; instead the scene publishes fixed engine events (GPU snapshots, disk usage, server
status, jobs and their events, stage reports) and writes fixed metrics.jsonl / report.json
files into the workspace, which the panes read through their own workers. The GPU snapshots
are hand-built (a fake: there is no GPU or NVML on CI); everything else takes the same path
as live data. Times are fixed, so frames are identical from run to run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.checks.base import CheckResult, StageReport, StageState, Status
from engine.core import Engine
from engine.system.disk import DiskUsage
from engine.events import DiskUpdated, GpuUpdated, JobEvents, JobLogTail, JobsUpdated, ServerUpdated, StageUpdated
from engine.jobs.events import JobEvent, parse_many
from engine.system.gpu import GpuSample, GpuSnapshot
from engine.jobs.manager import JobInfo, JobState
from engine.pipeline import stages
from engine.server.manager import ServerStatus
from eagle3_console.app import ConsoleApp
from eagle3_console.header import ConsoleHeader

GIB = 2**30
T0 = 1_767_225_600.0  # fixed wall clock for every event (2026-01-01)
SHOWN_ROOT = Path("/srv/eagle3/ws-demo")  # the header shows this instead of the temp dir


# pid -> parent pid of the scene's GPU processes: SGLang TP workers under the server job (4242), two
# trainer ranks under torchrun (the train job, 4300), and someone else's process (no job above it).
SCENE_PARENTS = {5001: 4242, 5002: 4242, 5003: 4242, 5004: 4242, 6001: 4300, 6002: 4300, 9999: 1}


def scene_parent(pid: int) -> int | None:
    """The parent-pid lookup over SCENE_PARENTS (what psutil_parent is on a real machine)."""
    return SCENE_PARENTS.get(pid)


def scene_processes(i: int) -> tuple:
    from engine.system.gpu import GpuProcess

    if i < 4:
        return (GpuProcess(5001 + i, "sglang::scheduler_TP" + str(i), 96 * GIB),)
    if i < 6:
        return (GpuProcess(6001 + i - 4, "python", 18 * GIB),)
    if i == 7:
        return (GpuProcess(9999, "jupyter-kernel", 40 * GIB),)
    return ()


def gpu_snapshot(n: int = 8, step: int = 0, available: bool = True, processes: bool = False) -> GpuSnapshot:
    """`n` H200s with fixed, varied figures (`step` shifts utilisation for the sparklines); with
    `processes`, the GPU processes of SCENE_PARENTS."""
    if not available:
        return GpuSnapshot(False, "NVML unavailable: libnvidia-ml.so.1 not found (no NVIDIA driver on this host)",
                           None, None, (), "unknown", T0)
    gpus = tuple(
        GpuSample(index=i, name="NVIDIA H200", uuid=f"GPU-{i:04d}", compute_capability=(9, 0),
                  utilization_gpu=(17 * i + 23 * step) % 101, utilization_memory=30,
                  memory_used=int((20 + 13 * i) * GIB), memory_total=141 * GIB, temperature_c=48 + 5 * i,
                  power_w=180.0 + 55 * i, power_limit_w=700.0, sm_clock_mhz=1980 - 10 * i, max_sm_clock_mhz=1980,
                  pcie_gen=5, pcie_width=16, processes=scene_processes(i) if processes else ())
        for i in range(n))
    return GpuSnapshot(True, "", "570.124.06", "12.8", gpus, "NVLink (18 links/GPU)", T0)


def disks(full: bool = False) -> tuple[DiskUsage, ...]:
    hidden_used = 1900 * GIB if full else 1100 * GIB
    return (
        DiskUsage("workspace, drafters", "/srv/eagle3/ws-demo", "/srv", 3700 * GIB, 900 * GIB, 2800 * GIB, 100 * GIB),
        DiskUsage("hidden", "/data/hidden/run1", "/data", 2000 * GIB, hidden_used, 2000 * GIB - hidden_used,
                  150 * GIB),
    )


def job(job_id: str, kind: str, state: str, exit_code: int | None = None, pid: int = 4100) -> JobInfo:
    return JobInfo(id=job_id, kind=kind, argv=("python", "-m", f"engine.{kind}"), state=JobState(state), pid=pid,
                   create_time=T0, exit_code=exit_code, started_at=T0, ended_at=None,
                   last_log_lines=tuple(job_log(job_id, state)[-5:]), dir=Path("/nonexistent") / job_id)


def job_log(job_id: str, state: str = "running") -> list[str]:
    """A fixed log for a scene's job (what JobManager.tail would read)."""
    kind = job_id.split("-")[0]
    lines = [f"[00:00:0{i}] {kind}: step {i * 50} of 400 · {4000 + 10 * i} tok/s" for i in range(1, 9)]
    if state == "failed":
        lines += ["Traceback (most recent call last):", '  File "engine/train/loop.py", line 212, in step',
                  "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    return lines


def scene_tail(job_id: str, n: int = 50) -> list[str]:
    state = SCENE_STATES.get(job_id, "running")
    return job_log(job_id, state)[-n:]


SCENE_STATES: dict[str, str] = {}


def server_status(state: str = "ready") -> ServerStatus:
    common: dict[str, Any] = dict(backend="sglang", url="http://127.0.0.1:30000", job_id="server-1", model="/models/Llama-3.1-8B",
                  capture={"enabled": True, "layers": [1, 15, 28], "layers_sglang": [2, 16, 29]},
                  flags={"disable_radix_cache": True, "enable_metrics": True, "chunked_prefill_size": 8192},
                  log_tail=("[2026-01-01 00:00:01] server is fired up and ready to roll!",
                            "[2026-01-01 00:01:05] POST /generate HTTP/1.1 200 OK"), at=T0)
    if state == "crashed":
        return ServerStatus(state="crashed", pid=None, exit_code=-9, restarts=1,
                            error="process exited with -9 (killed: out of memory?)", **common)
    return ServerStatus(state="ready", pid=4242, uptime_s=3725, gen_throughput=812.5, running_reqs=4,
                        queued_reqs=12, **common)


def extract_events(phase: str) -> tuple[JobEvent, ...]:
    """Events like engine.extract.job's: started, progress, then a pause, an error or finished."""
    def progress(done, paused=""):
        return {"type": "progress", "t": T0, "done": done, "total": 2000, "tokens": done * 1500,
                "total_tokens": 3_000_000, "tokens_per_s": 5200.0 + done, "mb_per_s": 290.0, "eta_s": 3000 - done,
                "bytes": done * 1500 * 57360, "bad": 2, "paused": paused, "output_mount": "/data"}

    events = [{"type": "planning", "t": T0},
              {"type": "started", "t": T0, "samples": 2000, "budget": "needs 160 GiB of 900 GiB free",
               "truncated": 3, "resumed": 0}]
    events += [progress(done) for done in range(100, 900, 50)]
    events.append({"type": "bad_sample", "t": T0, "id": "s0417", "reason": "non-finite hidden state at token 12"})
    if phase == "paused":
        reason = "output disk below reserve: 100 GiB free, reserve 150 GiB"
        events += [{"type": "paused", "t": T0, "reason": reason}, progress(850, paused=reason)]
    elif phase == "failed":
        events.append({"type": "error", "t": T0, "message": "server at http://127.0.0.1:30000 unreachable for 600 s"})
    elif phase == "done":
        events += [progress(2000), {"type": "finished", "t": T0, "samples": 1998, "bad": 2, "tokens": 3_000_000}]
    return tuple(parse_many(events))


def write_metrics(drafter_dir: Path, steps: int) -> None:
    lines = []
    for step in range(5, steps + 1, 5):
        loss = 6.0 / (1 + step / 40)
        acc = [round(min(0.95, 0.2 + step / 400) * 0.9**p, 4) for p in range(7)]
        lines.append({"type": "train", "step": step, "t": T0 + step * 0.5, "loss": round(loss, 4), "acc": acc,
                      "sim_al": round(1 + sum(acc), 4), "lr": 1e-4, "grad_norm": 1.25, "tokens_per_s": 42000.0})
        if step % 50 == 0:
            lines.append({"type": "eval", "step": step, "t": T0 + step * 0.5, "loss": round(loss * 1.1, 4),
                          "acc": acc, "sim_al": round(0.95 + sum(acc), 4)})
    drafter_dir.mkdir(parents=True, exist_ok=True)
    (drafter_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ckpt = drafter_dir / "checkpoints"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "latest.json").write_text(json.dumps({"step": steps - steps % 50}))


def write_report(eval_dir: Path, speedup: float) -> None:
    prompts = []
    for i in range(6):
        tokens, verify = 128, 40 + 3 * i
        spec_s, base_s = 1.0 + 0.1 * i, (1.0 + 0.1 * i) * speedup
        prompts.append({"id": f"ops-{i:03d}", "completion_tokens": tokens, "verify_steps": verify,
                        "acceptance_length": tokens / verify, "spec_tokens_per_s": tokens / spec_s,
                        "base_tokens_per_s": tokens / base_s, "speedup": speedup, "matches_greedy": True})
    overall = {"prompts": 6, "completion_tokens": 768, "verify_steps": 285, "acceptance_length": 768 / 285,
               "position_accept": [0.81, 0.52, 0.31, 0.17, 0.08], "spec_tokens_per_s": 121.4 * speedup,
               "base_tokens_per_s": 121.4, "speedup": speedup, "greedy_compared": 6, "greedy_matches": 6}
    report = {"version": 1, "created_at": T0, "backend": "sglang",
              "drafter": {"path": "/srv/eagle3/ws-demo/drafters/run1/export", "sha256": "3f9a1c0d7e21" + "0" * 52},
              "settings": {"spec_steps": 5, "spec_topk": 1, "spec_draft_tokens": 6, "max_new_tokens": 128},
              "notes": [], "overall": overall, "prompts": prompts}
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / "report.json").write_text(json.dumps(report))


def stage_reports(kind: str) -> list[StageReport]:
    """Stage reports for a scene: all pending, mixed (one failure with a fix), or all green."""
    out = []
    results: tuple[CheckResult, ...]
    for stage in stages():
        if kind == "pending":
            out.append(StageReport(stage.name, stage.title, StageState.PENDING, note="not run yet"))
            continue
        if kind == "mixed" and stage.name in ("disk", "extract", "train", "evaluate"):
            if stage.name == "disk":
                results = (CheckResult("output dir", Status.PASS, "/data/hidden/run1 exists, writable", measured_at=T0),
                           CheckResult("space", Status.FAIL, "needs 160 GiB; 50 GiB free above the 150 GiB reserve",
                                       fix="free space on /data or set extract.output_dir to a larger disk",
                                       measured_at=T0))
                out.append(StageReport(stage.name, stage.title, StageState.FAILED, results))
            elif stage.name == "extract":
                out.append(StageReport(stage.name, stage.title, StageState.RUNNING, note="checking…"))
            else:
                out.append(StageReport(stage.name, stage.title, StageState.PENDING, note="not run yet"))
            continue
        results = (CheckResult(f"{stage.name} ok", Status.PASS, f"{stage.title}: measured and verified",
                               measured_at=T0),)
        out.append(StageReport(stage.name, stage.title, StageState.PASSED, results))
    return out


SCENES = ("empty", "running", "failed", "done")


def make_app(ws, scene: str) -> ConsoleApp:
    """A console whose engine pollers stay off; `apply_scene` feeds it the scene's data."""
    if scene == "running":
        write_metrics(ws.drafter_dir, 180)
    elif scene in ("failed", "done"):
        write_metrics(ws.drafter_dir, 400)
        write_report(ws.eval_dir, 0.82 if scene == "failed" else 1.87)
    engine = Engine(ws)

    async def no_pollers() -> None:  # the scene publishes fixed events instead
        return None

    def follow_scene_log(job_id: str | None, lines: int = 400) -> None:
        if job_id:  # the scene's jobs have fixed logs (no job folders)
            engine._emit(JobLogTail(job_id=job_id, lines=tuple(scene_tail(job_id, lines))))

    engine.start = no_pollers  # type: ignore[method-assign]  # the scene publishes fixed events
    engine.follow_log = follow_scene_log  # type: ignore[method-assign]
    return ConsoleApp(engine)


async def apply_scene(app: ConsoleApp, pilot, scene: str, tab: str | None = None) -> None:
    """Publish the scene's events, wait until the panes have read their files, then show `tab`."""
    from eagle3_console.panes import EvaluationPane, TrainingPane

    engine = app.engine
    header = app.query_one(ConsoleHeader)
    header.workspace = SHOWN_ROOT
    header._render_line()
    from eagle3_console.strip import StatusStrip

    app.query_one(StatusStrip).state.server_port = 30000  # the workspace's port is a free one: varies
    emit = engine._emit
    if scene == "empty":
        emit(GpuUpdated(gpu_snapshot(available=False)))
        emit(DiskUpdated(disks()))
        emit(JobsUpdated(()))
    else:
        from eagle3_console.panes import GpuPane

        app.query_one(GpuPane).parent_of = scene_parent
        for step in range(12):
            emit(GpuUpdated(gpu_snapshot(step=step, processes=True)))
        emit(DiskUpdated(disks(full=scene == "running")))
        emit(ServerUpdated(server_status("crashed" if scene == "failed" else "ready")))
        phase = {"running": "paused", "failed": "failed", "done": "done"}[scene]
        ext_state = {"running": "running", "failed": "failed", "done": "succeeded"}[scene]
        train_state = {"running": "running", "failed": "failed", "done": "succeeded"}[scene]
        codes = {"running": None, "failed": 1, "succeeded": 0}
        SCENE_STATES.update({"train-20260101-0002": train_state, "extract-20260101-0001": ext_state})
        jobs = (job("train-20260101-0002", "train", train_state, codes[train_state], pid=4300),
                job("extract-20260101-0001", "extract", ext_state, codes[ext_state], pid=4100),
                job("server-20260101-0000", "server", "running" if scene != "failed" else "failed",
                    None if scene != "failed" else 1, pid=4242))
        emit(JobsUpdated(jobs))
        emit(JobEvents("extract-20260101-0001", "extract", extract_events(phase)))
        train_events = [{"type": "started", "t": T0, "total_steps": 400}]
        if scene == "failed":
            train_events.append({"type": "error", "t": T0, "message": "CUDA out of memory at step 400"})
        elif scene == "done":
            train_events.append({"type": "finished", "t": T0, "export": "drafters/run1/export"})
        emit(JobEvents("train-20260101-0002", "train", tuple(parse_many(train_events))))
        for report in stage_reports({"running": "mixed", "failed": "mixed", "done": "passed"}[scene]):
            emit(StageUpdated(report))
    from eagle3_console.panes import JobsPane

    app.query_one(JobsPane).clock = lambda: T0 + 754  # ages are fixed
    app.query_one(JobsPane)._rebuild()
    await engine.refresh_files()  # the metrics and report the scene wrote, as the file watcher sends them
    training, evaluation = app.query_one(TrainingPane), app.query_one(EvaluationPane)
    for _ in range(100):
        await pilot.pause(0.02)
        trained = scene == "empty" or training.view.step is not None
        evaluated = scene in ("empty", "running") or evaluation.report is not None
        if trained and evaluated:
            break
    if tab is not None:
        app.action_show_tab(tab)
    if scene in ("failed", "running"):
        from eagle3_console.panes import PipelinePane

        app.query_one(PipelinePane).select_stage("disk")
    app.clear_notifications()
    # The GPU process list and the job logs are read by thread workers: let them land before the frame.
    await app.workers.wait_for_complete()
    await pilot.pause(0.1)
    await app.workers.wait_for_complete()
    if scene != "empty":  # under load the last read can land after the first wait: wait for its rows
        from eagle3_console.panes import GpuPane

        gpu = app.query_one(GpuPane)
        for _ in range(100):
            if gpu.process_rows:
                break
            await pilot.pause(0.02)
        # Rendered twice: the first at the width the pane had, the second once the layout has settled.
        for _ in range(2):
            gpu.refresh_view()
            await pilot.pause(0.05)
            await pilot.pause()
    await pilot.pause(0.05)
