"""Command line: the console, plus headless `init`, `check`, `run`, `status`.

Headless commands never import Textual (fast start, usable from scripts and cron).
User mistakes print one clear line and exit 2; never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from eagle3_console.cli_data import add_data_parser, cmd_data
from eagle3_console.cli_jobs import add_jobs_parser, cmd_jobs
from eagle3_console.cliprint import (
    event_line,
    fail,
    job_dict,
    job_line,
    progress_line,
    show_progress,
    workspace_arg,
)
from eagle3_console.tabs import TAB_IDS
from eagle3_console.render import STAGE_GLYPHS as GLYPHS, STATUS_GLYPHS
from engine.config import ConfigError
from engine.jobs.manager import JobState
from engine.workspace import WorkspaceError



WORKSPACE_HELP = "workspace directory (default: ./ or ./eagle3-workspace)"


def _common() -> argparse.ArgumentParser:
    # SUPPRESS: a subcommand's parser must not reset a `-w DIR` given before the subcommand
    # (`eagle3-console -w DIR status`); the top-level parser has its own -w with the None default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-w", "--workspace", metavar="DIR", default=argparse.SUPPRESS, help=WORKSPACE_HELP)
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="eagle3-console",
        description="Build EAGLE-3 drafters on SGLang from one terminal console.",
    )
    # Its own -w action: parents share action objects, so a default set here would reach the subcommands.
    parser.add_argument("-w", "--workspace", metavar="DIR", default=None, help=WORKSPACE_HELP)
    parser.add_argument("--read-only", action="store_true", help="attach without driving (never takes the lock)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("init", help="create a workspace", parents=[common])
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--demo", action="store_true", help="tiny local target + demo data (no GPU needed)")

    p = sub.add_parser("check", help="run stage checks headless; exit 0 iff all pass", parents=[common])
    p.add_argument("stages", nargs="*", metavar="STAGE")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("run", help="run stages headless", parents=[common])
    p.add_argument("stages", nargs="+", metavar="STAGE|all")
    p.add_argument("--json", action="store_true")
    p.add_argument("--force", action="store_true",
                   help="start a stage's job even when its prerequisite stages are red")

    p = sub.add_parser("status", help="what runs, where it stands", parents=[common])
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("server", help="start, stop or inspect the target server", parents=[common])
    p.add_argument("action", choices=["start", "stop", "status", "logs", "command"])
    p.add_argument("--no-capture", action="store_true", help="start without hidden-state capture")
    p.add_argument("-n", "--lines", type=int, default=50, help="log lines to show")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("screenshot", help="save SVG screenshots of the console headless (read-only)",
                       parents=[common])
    p.add_argument("out", metavar="DIR", help="directory for the SVG files")
    p.add_argument("--tabs", default="pipeline", help="comma-separated tabs: " + ", ".join(TAB_IDS))
    p.add_argument("--size", default="160x50", help="COLSxROWS (160 or wider shows all panes at once)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of live polling before the first shot")
    add_data_parser(sub, _common())
    add_jobs_parser(sub, common)
    return parser


def _open_workspace(args):
    from engine.config import validate_against_model
    from engine.workspace import Workspace, find_workspace

    root, _ = find_workspace(workspace_arg(args))
    ws = Workspace(root)
    if not ws.exists():
        raise WorkspaceError(f"{root} is not a workspace (no console.toml). "
                             f"Create one with `eagle3-console init {root}` (add --demo for the demo).")
    config = ws.config
    validate_against_model(config, ws.root, ws.config_path)
    return ws


# ----------------------------------------------------------------------------- commands


def refuse_init_reason(target: Path) -> str | None:
    """Why `init` must not turn `target` into a workspace: it is a file, or a non-empty directory that
    is not one already (a source checkout, a home directory); None when it may."""
    from engine.workspace import Workspace

    if not target.exists():
        return None
    if not target.is_dir():
        return f"{target} exists and is not a directory"
    if Workspace(target).exists():
        return None  # a workspace already: init leaves what is there
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
    if not entries:
        return None
    shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
    return (f"{target} is not empty and is not a workspace (no console.toml); it holds {shown}. "
            "Choose a new or empty directory (init would write console.toml, jobs/, state/ among them)")


def cmd_init(args) -> int:
    import time

    from engine.workspace import init_workspace

    def progress(text: str) -> None:
        print(f"  [{time.monotonic() - started:5.0f} s] {text}", flush=True)

    refused = refuse_init_reason(Path(args.dir).resolve())
    if refused:
        return fail(refused)
    started = time.monotonic()

    print(f"Creating {'demo ' if args.demo else ''}workspace {Path(args.dir).resolve()}", flush=True)
    ws = init_workspace(args.dir, demo=args.demo, progress=progress)
    print(f"Workspace ready in {time.monotonic() - started:.0f} s: {ws.root}\n  config: {ws.config_path}\n"
          f"  open it: eagle3-console -w {ws.root}")
    if not args.demo:
        print("  next: set model.path and dataset.path in console.toml, then `eagle3-console check`")
    return 0


def _print_report(report) -> None:
    glyph = GLYPHS.get(report.state.value, "?")
    print(f"{glyph} {report.stage:<9} {report.state.value:<11} {report.title}")
    if report.note and not report.results:
        print(f"    {report.note}")
    for r in report.results:
        print(f"    {STATUS_GLYPHS[r.status.value]} {r.name}: {r.evidence}")
        if r.fix:
            print(f"      fix: {r.fix}")


def _stage_list(names: list[str]) -> list[str]:
    from engine.pipeline import get_stage, stage_names

    if not names or names == ["all"]:
        return stage_names()
    for name in names:
        get_stage(name)  # raises KeyError with a suggestion
    return names


async def _check(ws, names: list[str]):
    from engine.core import Engine

    # Results are saved only when no console drives the workspace; beside one, they are
    # printed but not recorded (the driving console owns the record).
    engine = Engine(ws, drive=True)
    try:
        if engine.read_only:
            print(f"note: {engine.lock_holder.describe() if engine.lock_holder else 'another console'} drives this "
                  "workspace; results are printed, not recorded", file=sys.stderr)
        return await engine.run_checks(names)  # as the stages stand now: a running job reads running
    finally:
        await engine.close()


def cmd_check(args) -> int:
    ws = _open_workspace(args)
    try:
        names = _stage_list(args.stages)
    except KeyError as exc:
        return fail(exc.args[0])
    reports = asyncio.run(_check(ws, names))
    if args.json:
        print(json.dumps({"workspace": str(ws.root), "stages": [r.to_dict() for r in reports],
                          "ok": all(r.state.value == "passed" for r in reports)}, indent=2))
    else:
        for report in reports:
            _print_report(report)
    return 0 if all(r.state.value == "passed" for r in reports) else 1


def cmd_run(args) -> int:
    ws = _open_workspace(args)
    try:
        names = _stage_list(args.stages)
    except KeyError as exc:
        return fail(exc.args[0])
    return asyncio.run(_run(ws, names, force=args.force))


async def _run(ws, names: list[str], force: bool = False) -> int:
    from engine.core import Engine

    engine = Engine(ws, drive=True)
    try:
        if engine.read_only:
            return fail(f"{_holder(engine)} drives this workspace: run stages there")
        printer = RunPrinter()
        code = 0
        async for item in engine.run_stages(names, force=force):
            code = printer.show(item)
        return code
    finally:
        await engine.close()


def _holder(engine) -> str:
    return engine.lock_holder.describe() if engine.lock_holder else "another console"


class RunPrinter:
    """Prints `run`'s progress items (engine.runner): reports, the job's one-line progress bar redrawn
    in place, its other events, and why the run stopped. `show` returns the exit code so far."""

    def __init__(self) -> None:
        self.bar = ""  # the progress line on screen, not yet ended by a newline

    def _line(self, text: str) -> None:
        print(("\n" if self.bar else "") + text, flush=True)
        self.bar = ""

    def show(self, item) -> int:
        from engine import runner

        if isinstance(item, runner.StageResult):
            _print_report(item.report)
        elif isinstance(item, runner.StartingServer):
            print("starting the server…", flush=True)
        elif isinstance(item, runner.ServerStartFailed):
            return fail(item.error, 1)
        elif isinstance(item, runner.PrerequisitesRed):
            return fail(item.message)
        elif isinstance(item, runner.JobStarted):
            print(f"{item.stage}: job {item.job.id} (detached; Ctrl-C stops watching, not the job)", flush=True)
        elif isinstance(item, runner.JobProgress):
            self.bar = progress_line(item.event)
            print("\r" + self.bar, end="", flush=True)
        elif isinstance(item, runner.JobEventRead):
            line = event_line(item.event)
            if line is not None:
                self._line(line)
        elif isinstance(item, runner.JobEnded):
            job = item.job
            print(f"\njob {job.id} {job.state} (exit {job.exit_code})")
            self.bar = ""
            if job.state != JobState.SUCCEEDED:
                for line in (job.last_log_lines or [])[-10:]:
                    print(f"  | {line}")
        elif isinstance(item, runner.StageNotGreen):
            print(f"stopping at stage '{item.stage}': it is not green", file=sys.stderr)
            return 1
        return 0


def status_data(ws) -> dict:
    """`status --json`: the engine's snapshot, each job with its latest progress."""
    from engine.core import Engine

    async def snapshot():
        engine = Engine(ws, drive=False)
        try:
            return await engine.status()
        finally:
            await engine.close()

    status = asyncio.run(snapshot())
    jobs = list(status.jobs)
    return {**status.to_dict(), "jobs": [job_dict(j, with_progress=show_progress(j, jobs)) for j in jobs]}


def cmd_status(args) -> int:
    from engine.system.disk import fmt_bytes

    ws = _open_workspace(args)
    data = status_data(ws)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"workspace {data['workspace']}" + (f"  (driven by {data['driver']})" if data["driver"] else ""))
    print("stages:")
    for s in data["stages"]:
        last = s["checks"]
        fails = [c for c in last if c["status"] == "fail"]
        if s["state"] in ("running", "stale") and s.get("note"):
            detail = f" — {s['note']}"  # a job makes it now, or the result predates a change
        else:
            detail = f" — {fails[0]['name']}: {fails[0]['evidence']}" if fails else ""
        print(f"  {GLYPHS.get(s['state'], '?')} {s['stage']:<9} {s['state']}{detail}")
    srv = data["server"]
    print(f"server: {srv['state']}" + (f" pid {srv['pid']} {srv['url']}" if srv.get("pid") else "")
          + (f", {srv['gen_throughput']:.1f} tok/s" if srv.get("gen_throughput") is not None else "")
          + (f"; its port {ws.config.server.port} is held by {srv['port_owner']}, not by this workspace's server"
             if srv.get("port_owner") else ""))
    if srv.get("drift"):  # started before console.toml changed (engine.server.drift)
        from engine.server.drift import RESTART_FIX

        print("server settings differ from console.toml: " + "; ".join(
            f"{d['setting']} (running {d['running']}, console.toml {d['wanted']})" for d in srv["drift"])
            + f" — {RESTART_FIX}")
    print("jobs:" if data["jobs"] else "jobs: none")
    for j in data["jobs"]:
        print(f"  {job_line(j)}")
    ev = data["evaluation"]
    if ev and ev.get("available"):
        al = ev.get("acceptance_length")
        print(f"evaluation: acceptance length {'?' if al is None else f'{al:.2f}'} · "
              f"{'SLOWER: ' if ev['slower'] else ''}{ev['verdict']}")
    else:
        print(f"evaluation: none ({ev['reason'] if ev else 'not run'})")
    g = data["gpus"]
    if not g["available"]:
        print(f"gpus: {g['reason']}")
    else:
        print(f"gpus: {len(g['gpus'])} ({g['interconnect']}), driver {g['driver_version']}")
        for gpu in g["gpus"]:
            used, total = gpu.get("memory_used") or 0, gpu.get("memory_total") or 0
            print(f"  GPU{gpu['index']} {gpu['name']}: util {gpu.get('utilization_gpu')}%, "
                  f"mem {fmt_bytes(used)}/{fmt_bytes(total)}, {gpu.get('temperature_c')}°C")
    print("disk:")
    for d in data["disk"]:
        flag = "  BELOW RESERVE" if d["below_reserve"] else ""
        print(f"  {d['label']:<20} {fmt_bytes(d['free'])} free of {fmt_bytes(d['total'])} on {d['mount']} "
              f"(reserve {fmt_bytes(d['reserve'])}){flag}")
    return 0


def cmd_console(args) -> int:
    from engine.workspace import Workspace, find_workspace, init_workspace

    root, is_default = find_workspace(workspace_arg(args))
    ws = Workspace(root)
    if not ws.exists():
        if not is_default:
            raise WorkspaceError(f"{root} is not a workspace (no console.toml). "
                                 f"Create one with `eagle3-console init {root}` (add --demo for the demo).")
        print(f"No workspace here: creating the demo workspace {root} "
              "(tiny local model, about 2 minutes on 2 CPU cores)…",
              flush=True)
        init_workspace(root, demo=True, progress=lambda text: print(f"  {text}", flush=True))
    from engine.config import validate_against_model

    validate_against_model(ws.config, ws.root, ws.config_path)
    from eagle3_console.app import run_console  # Textual is imported only here

    return run_console(ws, read_only=args.read_only)


def cmd_screenshot(args) -> int:
    tabs = [t.strip() for t in args.tabs.split(",") if t.strip()]
    unknown = [t for t in tabs if t not in TAB_IDS]
    if unknown or not tabs:
        return fail(f"unknown tab {', '.join(unknown) or '(none)'}: choose from {', '.join(TAB_IDS)}")
    try:
        cols, rows = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        return fail(f"--size {args.size!r} is not COLSxROWS, e.g. 160x50")
    if not (40 <= cols <= 400 and 12 <= rows <= 200):
        return fail(f"--size {args.size} is out of range: use 40..400 columns and 12..200 rows")
    ws = _open_workspace(args)
    from eagle3_console.app import save_screenshots  # Textual is imported only here

    for path in save_screenshots(ws, Path(args.out), tabs, (cols, rows), max(0.0, args.settle)):
        print(path)
    return 0


def cmd_server(args) -> int:
    ws = _open_workspace(args)
    return asyncio.run(_server(ws, args))


async def _server(ws, args) -> int:
    from engine.core import Engine
    from engine.server.manager import ServerStartError

    changes = args.action in ("start", "stop")
    engine = Engine(ws, drive=changes)
    try:
        if changes and engine.read_only:
            return fail(f"{_holder(engine)} drives this workspace: {args.action} the server from that console")
        if args.action == "command":
            return _print_command(engine.server.spec(capture=not args.no_capture), args.json)
        if args.action == "logs":
            print("\n".join(engine.server.logs(args.lines)))
            return 0
        try:
            if args.action == "start":
                print(f"starting {ws.config.model.backend} server…", flush=True)
                status = await engine.start_server(capture=not args.no_capture)
            elif args.action == "stop":
                status = await engine.stop_server()
            else:
                status = await engine.server.poll()
        except ServerStartError as exc:
            print(f"eagle3-console: error: {exc}", file=sys.stderr)
            for line in exc.log_tail[-10:]:
                print(f"  | {line}", file=sys.stderr)
            return 1
    finally:
        await engine.close()
    if args.json:
        print(json.dumps(status.to_dict(), indent=2))
    else:
        _print_server(status)
    return 0 if status.state in ("ready", "stopped") else 1


def _print_command(spec, as_json: bool) -> int:
    import shlex

    if as_json:
        print(json.dumps(spec.to_json(), indent=2))
        return 0
    print("# environment set for the server (plus your own environment)")
    for key, value in spec.redacted_env_set().items():
        print(f"export {key}={value}")
    print("# command")
    print(" ".join(shlex.quote(a) for a in spec.redacted_argv()))
    for note in spec.notes:
        print(f"# {note}")
    return 0


def _print_server(status) -> None:
    print(f"server: {status.state}" + (f" ({status.backend}, pid {status.pid}, {status.url})" if status.pid else ""))
    if status.model:
        print(f"  model: {status.model}")
    if status.capture:
        print(f"  capture: {status.capture}")
    if status.flags:
        print("  flags: " + ", ".join(f"{k}={v}" for k, v in status.flags.items()))
    if status.error:
        print(f"  error: {status.error}")
    if status.state == "crashed":
        for line in status.log_tail:
            print(f"  | {line}")


def _cmd_data(args) -> int:
    return cmd_data(_open_workspace(args), args)


COMMANDS = {"init": cmd_init, "check": cmd_check, "run": cmd_run, "status": cmd_status, "server": cmd_server,
            "data": _cmd_data, "screenshot": cmd_screenshot, "jobs": cmd_jobs}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = COMMANDS.get(args.command, cmd_console)
    try:
        return handler(args)
    except (ConfigError, WorkspaceError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `eagle3-console status | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
