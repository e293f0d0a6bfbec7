"""Regenerate the assistant turns of a dataset with the target itself (the seed's "synth" set).

A drafter learns to predict the target; training on the target's own answers (greedy)
instead of another model's text raises acceptance. For each sample, each assistant turn
is replaced, in order, by the server's continuation of the conversation so far (earlier
turns already regenerated), rendered with the target's chat template and
add_generation_prompt.

The result is a NEW file (never the input): one JSON line per sample, {"id", "messages"},
appended and fsynced as each sample completes, so a kill loses at most the line in
flight. `--resume` skips ids already in the output and first cuts a torn last line.
Lines complete out of input order when concurrency > 1.

Run as a detached job (see `start_regeneration_job`) or by hand:
    python -m engine.dataset regenerate --workspace DIR --out PATH [--concurrency N]
        [--max-new-tokens N] [--url URL] [--resume]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.io.atomic import append_line
from engine.dataset.formats import DatasetReader
from engine.errors import EngineError

PROGRESS_EVERY_S = 1.0
GIVE_UP_AFTER_CONSECUTIVE_FAILURES = 5

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INCOMPLETE = 3  # stopped, or some samples failed: run again with --resume


class RegenerateError(EngineError):
    """A request that cannot be carried out; the message says what to do."""


@dataclass
class RegenerateOptions:
    workspace: Path
    out: Path
    input: Path | None = None  # default: the workspace's dataset.path
    url: str | None = None  # default: state/server.json "url"
    concurrency: int = 4
    max_new_tokens: int = 512
    resume: bool = False
    retries: int = 2
    timeout_s: float = 600.0


@dataclass
class RegenerateSummary:
    total: int = 0
    skipped: int = 0  # already in the output (resume)
    written: int = 0
    failed: int = 0
    bad_lines: int = 0
    turns: int = 0
    stopped: bool = False
    failures: list[dict[str, str]] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.skipped + self.written

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "skipped": self.skipped, "written": self.written, "failed": self.failed,
                "bad_lines": self.bad_lines, "turns": self.turns, "stopped": self.stopped,
                "failures": self.failures[:20]}


# ---------------------------------------------------------------------------- output file


def recover_output(out: Path) -> set[str]:
    """Ids already written to `out`; a torn last line (a kill mid-write) is cut off first."""
    try:
        data = out.read_bytes()
    except FileNotFoundError:
        return set()
    keep = data.rfind(b"\n") + 1  # bytes after the last newline are a torn write
    lines = data[:keep].split(b"\n")[:-1]
    ids: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise RegenerateError(f"{out}:{number} is not a line this tool wrote (no JSON with 'id'); resume "
                                      "only into a file written by regeneration, or choose a new --out") from None
            keep -= len(line) + 1  # a torn last line that happens to end in a newline byte
    if keep < len(data):
        with open(out, "r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
    return ids


def check_paths(input_path: Path, out: Path, resume: bool) -> None:
    src, dst = input_path.expanduser().resolve(), out.expanduser().resolve()
    if not src.is_file():
        raise RegenerateError(f"input dataset {src} does not exist: check dataset.path or --input")
    if dst == src or (dst.exists() and os.path.samefile(dst, src)):
        raise RegenerateError(f"--out {dst} is the input dataset: regeneration never overwrites the original; "
                              "choose a new file name, e.g. data/train.regen.jsonl")
    if dst.exists() and not resume:
        raise RegenerateError(f"--out {dst} already exists: pass --resume to continue it, or choose a new file")
    if dst.exists() and not dst.is_file():
        raise RegenerateError(f"--out {dst} is not a regular file: choose a file path")


# ---------------------------------------------------------------------------- generation


def _stop_token_ids(tokenizer, model_dir: Path) -> list[int]:
    """End-of-turn ids: the tokenizer's eos plus generation_config.json's (chat models often add one)."""
    ids: set[int] = set()
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    try:
        gen = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
        eos = gen.get("eos_token_id")
        ids.update(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    except (OSError, ValueError, AttributeError):
        pass
    return sorted(ids)


class Regenerator:
    def __init__(self, client, tokenizer, max_new_tokens: int, stop_ids: list[int], retries: int):
        self.client = client
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.retries = retries

    async def _generate(self, prompt: list[int]) -> tuple[str, str]:
        from engine.client import ServerReplyError

        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                result = await self.client.generate(input_ids=prompt, max_new_tokens=self.max_new_tokens,
                                                    temperature=0.0, stop_token_ids=self.stop_ids or None)
                reason = result.meta.get("finish_reason")
                kind = reason.get("type", "") if isinstance(reason, dict) else str(reason or "")
                return result.text, kind
            except ServerReplyError as exc:
                last = exc
                if exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
                    break  # the request itself is wrong: retrying will not help
                await asyncio.sleep(min(2.0 ** attempt, 10.0))
        raise RegenerateError(str(last))

    async def sample(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[str]]:
        """The conversation with each assistant turn replaced by the target's greedy answer."""
        from engine.dataset.tokenize import prompt_ids

        new: list[dict[str, str]] = []
        finishes: list[str] = []
        for message in messages:
            if message["role"] != "assistant" or not new:  # an opening assistant turn has no prompt: kept
                new.append(dict(message))
                continue
            prompt = prompt_ids(self.tokenizer, new)
            text, finish = await self._generate(prompt)
            new.append({"role": "assistant", "content": text})
            finishes.append(finish)
        return new, finishes


# ---------------------------------------------------------------------------- the run


class _Reporter:
    """Progress to the job's events (inside a job) or to stderr (by hand)."""

    def __init__(self) -> None:
        from engine.jobs.context import JOB_DIR_ENV, JobContext

        self.ctx = JobContext.from_env() if os.environ.get(JOB_DIR_ENV) else None
        self._last = 0.0

    @property
    def stop_requested(self) -> bool:
        return bool(self.ctx and self.ctx.stop_requested)

    def install(self) -> None:
        if self.ctx is not None:
            self.ctx.install_sigterm_handler()

    def event(self, type: str, **data: Any) -> None:
        if self.ctx is not None:
            self.ctx.event(type, **data)
        print(f"{type}: " + ", ".join(f"{k}={v}" for k, v in data.items()), file=sys.stderr, flush=True)

    def progress(self, summary: RegenerateSummary, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < PROGRESS_EVERY_S:
            return
        self._last = now
        extra = {"written": summary.written, "skipped": summary.skipped, "failed": summary.failed}
        if self.ctx is not None:
            self.ctx.progress(summary.done, summary.total, **extra)
        print(f"progress: {summary.done}/{summary.total} {extra}", file=sys.stderr, flush=True)


def _server_url(workspace) -> str:
    from engine.server.manager import STATE_FILE

    try:
        url = json.loads((workspace.state_dir / STATE_FILE).read_text(encoding="utf-8")).get("url")
    except (OSError, ValueError, AttributeError):
        url = None
    if not url:
        raise RegenerateError("no server URL: start the server (`eagle3-console server start`) or pass --url")
    return str(url)


async def run_regeneration(opts: RegenerateOptions, reporter: _Reporter | None = None,
                           client_factory: Callable[..., Any] | None = None) -> RegenerateSummary:
    from engine.client import ServerClient
    from engine.dataset.tokenize import load_tokenizer
    from engine.workspace import Workspace

    reporter = reporter or _Reporter()
    ws = Workspace(opts.workspace)
    cfg = ws.config.dataset
    input_path = opts.input or (ws.path(cfg.path) if cfg.path else None)
    if input_path is None:
        raise RegenerateError("no input dataset: set dataset.path or pass --input")
    out = ws.path(str(opts.out))
    check_paths(input_path, out, opts.resume)
    url = opts.url or _server_url(ws)
    tokenizer = load_tokenizer(ws.model_dir)
    done_ids = recover_output(out) if opts.resume else set()
    out.parent.mkdir(parents=True, exist_ok=True)

    summary = RegenerateSummary(total=sum(1 for _ in DatasetReader(input_path, cfg.format, cfg.on_bad_line)))
    reporter.event("started", input=str(input_path), out=str(out), url=url, total=summary.total,
                   already_done=len(done_ids))
    make_client = client_factory or (lambda: ServerClient(url, api_key=ws.config.server.api_key or None,
                                                          timeout=opts.timeout_s))
    semaphore = asyncio.Semaphore(max(1, opts.concurrency))
    consecutive_failures = 0
    give_up: list[str] = []

    async with make_client() as client:
        regen = Regenerator(client, tokenizer, opts.max_new_tokens, _stop_token_ids(tokenizer, ws.model_dir),
                            opts.retries)

        async def one(sample) -> None:
            nonlocal consecutive_failures
            try:
                messages, finishes = await regen.sample(sample.messages)
            except RegenerateError as exc:
                summary.failed += 1
                consecutive_failures += 1
                summary.failures.append({"id": sample.id, "error": str(exc)})
                reporter.event("sample_failed", id=sample.id, line=sample.line, error=str(exc))
                if consecutive_failures >= GIVE_UP_AFTER_CONSECUTIVE_FAILURES and not give_up:
                    give_up.append(str(exc))
                return
            finally:
                semaphore.release()
            consecutive_failures = 0
            append_line(out, json.dumps({"id": sample.id, "messages": messages}, ensure_ascii=False))
            summary.written += 1
            summary.turns += len(finishes)
            reporter.progress(summary)

        tasks: set[asyncio.Task] = set()
        reader = DatasetReader(input_path, cfg.format, cfg.on_bad_line)
        for sample in reader:
            if reporter.stop_requested or give_up:
                summary.stopped = True
                break
            if sample.id in done_ids:
                summary.skipped += 1
                continue
            await semaphore.acquire()
            task = asyncio.create_task(one(sample))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        summary.bad_lines = reader.bad_count
    reporter.progress(summary, force=True)
    if give_up:
        raise RegenerateError(f"gave up after {GIVE_UP_AFTER_CONSECUTIVE_FAILURES} failures in a row "
                              f"({give_up[0]}); check the server, then run again with --resume")
    return summary


def main_regenerate(opts: RegenerateOptions) -> int:
    from engine.config import ConfigError
    from engine.dataset.formats import DatasetError
    from engine.dataset.tokenize import TokenizerError

    reporter = _Reporter()
    reporter.install()
    try:
        summary = asyncio.run(run_regeneration(opts, reporter))
    except (RegenerateError, DatasetError, TokenizerError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        if reporter.ctx is not None:
            try:
                reporter.ctx.event("error", message=str(exc))
            except OSError:
                pass  # a full disk: the line above still says why
        return EXIT_ERROR
    reporter.event("finished", **summary.to_dict())
    if summary.stopped or summary.failed:
        why = "stopped" if summary.stopped else f"{summary.failed} samples failed"
        print(f"incomplete ({why}): run again with --resume to finish", file=sys.stderr)
        return EXIT_INCOMPLETE
    return EXIT_OK


def regenerate_argv(workspace: Path, out: Path, *, concurrency: int = 4, max_new_tokens: int = 512,
                    url: str | None = None, resume: bool = False, input: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "engine.dataset", "regenerate", "--workspace", str(workspace), "--out", str(out),
            "--concurrency", str(concurrency), "--max-new-tokens", str(max_new_tokens)]
    if url:
        argv += ["--url", url]
    if input is not None:
        argv += ["--input", str(input)]
    if resume:
        argv.append("--resume")
    return argv


def start_regeneration_job(workspace, out: Path, jobs=None, **options: Any):
    """Start regeneration as a detached job of kind "regenerate"; returns its JobInfo.

    Path problems are raised here (RegenerateError) before any process starts.
    """
    from engine.jobs.manager import JobManager

    cfg = workspace.config.dataset
    input_path = options.get("input") or workspace.path(cfg.path)
    check_paths(Path(input_path), workspace.path(str(out)), bool(options.get("resume")))
    jobs = jobs or JobManager(workspace.jobs_dir)
    return jobs.start("regenerate", regenerate_argv(workspace.root, Path(out), **options), cwd=workspace.root)
