"""SGLang backend: the same held-out prompts served twice by SGLang — without speculation, then with
`--speculative-algorithm EAGLE3` and the drafter export — and the same report.

The launch is the workspace's SGLang LaunchSpec with capture off (engine.sglang.launch), extended
with the speculative flags. Acceptance comes from each reply's `meta_info` (`spec_accept_length`
= completion tokens / verify steps, `spec_verify_ct`, and the per-request histogram
`spec_accept_histogram` / `spec_correct_drafts_histogram`: H[n] = verify steps that accepted
exactly n drafts), with the `/metrics` gauge `sglang:spec_accept_length` as a fallback.

Nothing here can run without SGLang and a GPU; tests/test_evaluate.py covers the argv and the
parsing only.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.evaluate.prompts import EvalPrompt
from engine.evaluate.report import PromptResult, first_mismatch
from engine.errors import EngineError

SPEC_FLAGS_WITH_VALUE = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                         "--speculative-eagle-topk", "--speculative-num-draft-tokens")


class SglangEvalError(EngineError):
    """The SGLang evaluation cannot run; the message names the cause and the fix."""


def strip_speculative(argv: list[str]) -> list[str]:
    """argv without any --speculative-* flag (and the value of those that take one)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name.startswith("--speculative-"):
            skip = "=" not in arg and name in SPEC_FLAGS_WITH_VALUE
            continue
        out.append(arg)
    return out


def speculative_argv(base: list[str], export_dir: Path | str, steps: int, topk: int, draft_tokens: int) -> list[str]:
    """The capture-free SGLang argv plus EAGLE-3 speculative decoding with the drafter export."""
    for name, value in (("spec_steps", steps), ("spec_topk", topk), ("spec_draft_tokens", draft_tokens)):
        if not isinstance(value, int) or value < 1:
            raise SglangEvalError(f"evaluate.{name} is {value!r}; it must be a positive integer")
    return strip_speculative(base) + [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(export_dir),
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(draft_tokens),
    ]


def settings_notes(steps: int, topk: int, draft_tokens: int) -> list[str]:
    notes = []
    if topk == 1 and draft_tokens != steps + 1:
        notes.append(f"with top-k 1 SGLang verifies steps+1 = {steps + 1} tokens; "
                     f"evaluate.spec_draft_tokens {draft_tokens} is adjusted by SGLang")
    return notes


@dataclass
class SpecMeta:
    completion_tokens: int
    verify_steps: int
    accept_length: float | None
    accepted: list[int]  # per draft position (from the histogram); [] when not reported


def _number(meta: dict, *names: str) -> float | None:
    for name in names:
        value = meta.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def parse_spec_meta(meta: dict[str, Any], completion_tokens: int) -> SpecMeta:
    """Acceptance figures of one /generate reply's meta_info (0.5.9 and 0.5.23 names)."""
    completion = int(_number(meta, "completion_tokens") or completion_tokens)
    verify = int(_number(meta, "spec_verify_ct") or 0)
    length = _number(meta, "spec_accept_length")
    if length is None and verify:
        length = completion / verify
    hist = meta.get("spec_accept_histogram") or meta.get("spec_correct_drafts_histogram")
    accepted: list[int] = []
    if isinstance(hist, list) and hist and all(isinstance(x, (int, float)) for x in hist):
        counts = [int(x) for x in hist]  # counts[n] = verify steps that accepted exactly n drafts
        accepted = [sum(counts[n] for n in range(pos + 1, len(counts))) for pos in range(len(counts) - 1)]
        verify = verify or sum(counts)
    return SpecMeta(completion, verify, length, accepted)


def metrics_accept_length(text: str) -> float | None:
    """Mean of the `sglang:spec_accept_length` gauge samples (one per rank) in /metrics text."""
    values = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("sglang:spec_accept_length"):
            continue
        rest = line[len("sglang:spec_accept_length"):]
        if rest and rest[0] not in " {":
            continue  # another metric with this prefix
        if rest.startswith("{"):
            rest = rest[rest.find("}") + 1:]
        try:
            values.append(float(rest.split()[0]))
        except (ValueError, IndexError):
            continue
    return sum(values) / len(values) if values else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EvalServer:
    """One SGLang server for the evaluation, run as a supervised job of the workspace (its own
    process group, log, crash record, and visible in the console's job list like any job)."""

    def __init__(self, jobs, kind: str, argv: list[str], env: dict[str, str], url: str, api_key: str | None,
                 cwd: Path):
        self.jobs, self.kind, self.argv, self.env, self.url, self.api_key = jobs, kind, argv, env, url, api_key
        self.cwd = cwd
        self.job_id: str | None = None

    async def start(self, timeout: float) -> None:
        from engine.client import ServerClient
        from engine.jobs import JobError
        from engine.server.manager import ServerStartError, wait_until_ready

        try:
            job = await asyncio.to_thread(self.jobs.start, self.kind, self.argv, env=self.env, cwd=self.cwd)
        except JobError as exc:
            raise SglangEvalError(f"cannot start SGLang: {exc}") from None
        self.job_id = job.id
        try:
            await wait_until_ready(self.jobs, job.id, ServerClient(self.url, api_key=self.api_key, timeout=30),
                                   timeout)
        except ServerStartError as exc:
            raise SglangEvalError(f"{exc} (job {job.id}; log: {job.dir}/log)") from None

    async def stop(self, grace: float = 30.0) -> None:
        if self.job_id is not None:
            await self.jobs.stop(self.job_id, grace=grace)


async def _serve_prompts(server: EvalServer, prompts: list[EvalPrompt], max_new_tokens: int,
                         should_stop: Callable[[], bool] | None):
    from engine.client import ServerClient

    out = []
    async with ServerClient(server.url, api_key=server.api_key, timeout=600) as client:
        await client.generate(input_ids=prompts[0].input_ids, max_new_tokens=min(8, max_new_tokens))  # warm-up
        for prompt in prompts:
            if should_stop is not None and should_stop():
                break
            started = time.perf_counter()
            result = await client.generate(input_ids=prompt.input_ids, max_new_tokens=max_new_tokens,
                                           temperature=0.0)
            out.append((result, time.perf_counter() - started))
    return out, await _metrics_text(server)


async def _metrics_text(server: EvalServer) -> str:
    """Raw /metrics text: gauges are per rank, so they are averaged here, not summed."""
    import httpx

    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=30, trust_env=False) as http:
            response = await http.get(server.url + "/metrics")
            return response.text if response.status_code == 200 else ""
    except httpx.HTTPError:
        return ""


async def evaluate_sglang(workspace, export_dir: Path, prompts: list[EvalPrompt], on_phase: Callable[[str], None],
                          should_stop: Callable[[], bool] | None = None) -> tuple[list[PromptResult], list[str]]:
    """Baseline server run, then the speculative one; per-prompt results and notes."""
    from engine.jobs import JobManager
    from engine.server.manager import ServerManager

    try:
        from engine.sglang.launch import build_sglang_spec
    except ImportError:
        raise SglangEvalError("this build has no SGLang launcher (engine.sglang.launch); use model.backend = "
                              "\"local\"") from None
    if ServerManager(workspace).is_running():
        raise SglangEvalError("the workspace's capture server is running and holds the GPUs: stop it first "
                              "(`eagle3-console server stop`), then run evaluate again")
    cfg = workspace.config
    ev = cfg.evaluate
    port = free_port(cfg.server.host)
    spec = build_sglang_spec(workspace, capture=False, port=port)
    runs = {"baseline": strip_speculative(spec.argv),
            "speculative": speculative_argv(spec.argv, export_dir, ev.spec_steps, ev.spec_topk, ev.spec_draft_tokens)}
    replies: dict[str, list] = {}
    metrics: dict[str, str] = {}
    jobs = JobManager(workspace.jobs_dir)
    for name, argv in runs.items():
        on_phase(name)
        server = EvalServer(jobs, f"eval-server-{name}", argv, spec.env, spec.url, spec.api_key, workspace.root)
        try:
            await server.start(cfg.server.startup_timeout_s)
            replies[name], metrics[name] = await _serve_prompts(server, prompts, ev.max_new_tokens, should_stop)
        finally:
            await server.stop()
    results = []
    gauge = metrics_accept_length(metrics.get("speculative", ""))
    for prompt, (base, base_s), (spec_r, spec_s) in zip(prompts, replies["baseline"], replies["speculative"]):
        meta = parse_spec_meta(spec_r.meta, len(spec_r.output_ids))
        mismatch = first_mismatch(spec_r.output_ids, base.output_ids)
        results.append(PromptResult(
            id=prompt.id, prompt_tokens=len(prompt.input_ids), completion_tokens=meta.completion_tokens,
            verify_steps=meta.verify_steps, accepted=meta.accepted, spec_seconds=spec_s, base_seconds=base_s,
            base_completion_tokens=len(base.output_ids), matches_greedy=mismatch is None, first_mismatch=mismatch,
            server_accept_length=meta.accept_length if meta.accept_length is not None else gauge))
    notes = settings_notes(ev.spec_steps, ev.spec_topk, ev.spec_draft_tokens)
    notes.append("timed per request over HTTP (one at a time), greedy (temperature 0)")
    if gauge is not None:
        notes.append(f"/metrics sglang:spec_accept_length (last logged): {gauge:.2f}")
    return results, notes
