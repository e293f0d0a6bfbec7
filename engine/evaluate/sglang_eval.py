"""SGLang backend: the same held-out prompts served twice by SGLang — without speculation, then with
`--speculative-algorithm EAGLE3` and the drafter export — and the same report.

The launch is the workspace's SGLang LaunchSpec with capture off (engine.sglang.launch), extended
with the speculative flags. Acceptance comes from each reply's `meta_info` (`spec_accept_length`
= completion tokens / verify steps, `spec_verify_ct`, and the per-request histogram
`spec_accept_histogram` / `spec_correct_drafts_histogram`: H[n] = verify steps that accepted
exactly n drafts), with the `/metrics` gauge `sglang:spec_accept_length` as a fallback.

The measurement (the same contract as the local backend, engine/evaluate/local_eval.py): the plain
server and one speculative server per setting (the configured one and `evaluate.sglang_sweep`) are
launched one after another with the same argv but for the speculative flags; each serves the same
prompts, an untimed warm-up per concurrency level first, then `evaluate.rounds` rounds that each run
every level (in an order that rotates per round). Concurrency N = N concurrent HTTP clients, a
closed loop: a client sends its next prompt as soon as its reply is in. A sample is one prompt in one
round at one level, speculative tok/s over plain tok/s; the report gives per level and setting the
median with its bootstrap interval, the verdict, throughput (tokens / wall time of the level's run)
and per-request latency each side, and the best setting per level as SGLang flags.

The server launcher is injectable (`launch`): tests/test_evaluate_sglang.py runs the real argv
builder and real HTTP servers in real subprocesses, but a stand-in answers for SGLang there, so its
figures are not SGLang's. tests/test_evaluate_sglang.py also has SGLang 0.5.23's own ServerArgs
parse and resolve every server's argv.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine.evaluate.prompts import EvalPrompt
from engine.evaluate.report import PromptResult, SpecSetting, Tally, first_mismatch, level_summary
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.client import GenerateResult

SPEC_FLAGS_WITH_VALUE = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                         "--speculative-eagle-topk", "--speculative-num-draft-tokens")


class SglangEvalError(EngineError):
    """The SGLang evaluation cannot run; the message names the cause and the fix."""


def strip_speculative(argv: list[str]) -> list[str]:
    """argv without any --speculative-* flag (and the value of those that take one)."""
    out: list[str] = []
    skip = False
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
    notes: list[str] = []
    if topk == 1 and draft_tokens != steps + 1:
        notes.append(f"with top-k 1 SGLang verifies steps+1 = {steps + 1} tokens; evaluate.spec_draft_tokens "
                     f"{draft_tokens} is adjusted by SGLang (measured and reported with {steps + 1})")
    return notes


@dataclass
class SpecMeta:
    completion_tokens: int
    verify_steps: int
    accept_length: float | None
    accepted: list[int]  # per draft position (from the histogram); [] when not reported


def _number(meta: dict[str, Any], *names: str) -> float | None:
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
    values: list[float] = []
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

    def __init__(self, jobs: Any, kind: str, argv: list[str], env: dict[str, str], url: str, api_key: str | None,
                 cwd: Path):
        self.jobs, self.kind, self.argv, self.env, self.url, self.api_key = jobs, kind, argv, env, url, api_key
        self.cwd = cwd
        self.job_id: str | None = None

    async def start(self, timeout: float) -> None:
        from engine.client import ServerClient
        from engine.jobs.manager import JobError
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


# ----------------------------------------------------------------------------- the measurement

# kind, argv, env, url, api_key -> a server to start and stop (EvalServer; tests inject their own argv).
Launch = Callable[[str, list[str], dict[str, str], str, "str | None"], EvalServer]
GENERATE_TIMEOUT_S = 600.0


@dataclass
class Reply:
    output_ids: list[int]
    seconds: float  # request latency as the client saw it
    meta: SpecMeta

    @property
    def verify_steps(self) -> int:
        """Verify steps, from the acceptance length when the reply has no count (older SGLang)."""
        if self.meta.verify_steps or not self.meta.accept_length:
            return self.meta.verify_steps
        return max(1, round(self.meta.completion_tokens / self.meta.accept_length))


@dataclass
class ServerRun:
    """One server's replies[level][round][prompt] (None: not measured) and each level run's wall time."""

    replies: dict[int, list[list[Reply | None]]]
    walls: dict[int, list[float | None]]
    metrics: str = ""

    def complete(self, level: int, rnd: int) -> bool:
        return self.walls[level][rnd] is not None and all(x is not None for x in self.replies[level][rnd])


def configured_setting(steps: int, topk: int, draft_tokens: int) -> SpecSetting:
    """evaluate.spec_*: at top-k 1 SGLang serves steps + 1 draft tokens whatever is written."""
    return SpecSetting(steps, topk, steps + 1 if topk == 1 else draft_tokens)


def sweep_settings(ev: Any) -> tuple[SpecSetting, list[SpecSetting]]:
    """The configured setting and every setting to launch (configured + evaluate.sglang_sweep)."""
    from engine.config import sglang_setting_problem

    configured = configured_setting(ev.spec_steps, ev.spec_topk, ev.spec_draft_tokens)
    problem = sglang_setting_problem([configured.steps, configured.topk, configured.draft_tokens])
    if problem:
        raise SglangEvalError(f"evaluate.spec_steps/spec_topk/spec_draft_tokens ({configured.key}): {problem}; "
                              "change them in console.toml")
    return configured, sorted({configured, *(SpecSetting(*entry) for entry in ev.sglang_sweep)})


def plan_servers(base_argv: list[str], export_dir: Path | str,
                 settings: list[SpecSetting]) -> list[tuple[str, SpecSetting | None, list[str]]]:
    """(job kind, setting or None for the plain server, argv) in launch order: the plain server first."""
    plan: list[tuple[str, SpecSetting | None, list[str]]] = [
        ("eval-server-baseline", None, strip_speculative(base_argv))]
    for s in settings:
        plan.append((f"eval-server-spec-{s.steps}-{s.topk}-{s.draft_tokens}", s,
                     speculative_argv(base_argv, export_dir, s.steps, s.topk, s.draft_tokens)))
    return plan


def schedule(levels: list[int], rounds: int) -> list[tuple[int, int]]:
    """(round, level) in run order: every level once per round, the order rotating per round, so
    drift over a server's run does not always fall on the same level."""
    order = []
    for r in range(rounds):
        shift = r % len(levels)
        order += [(r, n) for n in levels[shift:] + levels[:shift]]
    return order


async def _generate(http: Any, where: str, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
    import httpx

    from engine.client import ServerReplyError, generate_body, parse_generate_reply

    try:
        response = await http.post("/generate", json=generate_body(input_ids, max_new_tokens=max_new_tokens))
    except httpx.HTTPError as exc:
        raise SglangEvalError(f"{where}: /generate failed ({type(exc).__name__}: {exc}); see the server "
                              "job's log in the Jobs pane") from None
    if response.status_code != 200:
        raise SglangEvalError(f"{where}: /generate answered HTTP {response.status_code} "
                              f"({response.text[:300]}); see the server job's log in the Jobs pane")
    try:
        return parse_generate_reply(response.json(), where)
    except (ValueError, ServerReplyError) as exc:
        raise SglangEvalError(f"{where}: unusable /generate reply ({exc}); is this an SGLang server?") from None


async def _level_run(http: Any, where: str, ids: list[list[int]], clients: int, max_new_tokens: int,
                     should_stop: Callable[[], bool], results: list[Reply | None],
                     on_reply: Callable[[Reply], None]) -> float:
    """Every prompt once through `clients` concurrent clients (closed loop), replies into `results`;
    the wall time."""
    cursor = iter(range(len(ids)))

    async def client() -> None:
        for i in cursor:  # shared: each client takes the next prompt when its reply is in
            if should_stop():
                return
            started = time.perf_counter()
            reply = await _generate(http, where, ids[i], max_new_tokens)
            got = Reply(reply.output_ids, time.perf_counter() - started,
                        parse_spec_meta(reply.meta, len(reply.output_ids)))
            results[i] = got
            on_reply(got)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - started


def new_run(levels: list[int], rounds: int, prompts: int) -> ServerRun:
    return ServerRun({n: [[None] * prompts for _ in range(rounds)] for n in levels}, {n: [None] * rounds for n in levels})


async def _measure_server(server: EvalServer, kind: str, run: ServerRun, ids: list[list[int]], levels: list[int],
                          rounds: int, max_new_tokens: int, should_stop: Callable[[], bool],
                          on_reply: Callable[[int, int, Reply], None]) -> None:
    """Warm-up, then every (round, level) of the schedule, replies and walls into `run`."""
    import httpx

    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    most = max(levels)  # httpx's default pool (100) would cap higher levels without saying so
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=GENERATE_TIMEOUT_S, trust_env=False,
                                 limits=httpx.Limits(max_connections=most, max_keepalive_connections=most)) as http:
        for n in levels:  # warm-up (untimed): first-call paths at every batch size measured
            await asyncio.gather(*(_generate(http, f"{kind} warm-up", ids[i], min(8, max_new_tokens))
                                   for i in range(n)))
        for r, n in schedule(levels, rounds):
            if should_stop():
                break

            def reply_at(reply: Reply, r: int = r, n: int = n) -> None:
                on_reply(r, n, reply)

            wall = await _level_run(http, f"{kind} (concurrency {n}, round {r + 1})", ids, n, max_new_tokens,
                                    should_stop, run.replies[n][r], reply_at)
            run.walls[n][r] = None if should_stop() else wall
    run.metrics = await _metrics_text(server)


async def measure_sglang(plan: list[tuple[str, SpecSetting | None, list[str]]], launch: Launch, env: dict[str, str],
                         url: str, api_key: str | None, startup_timeout: float, prompts: list[EvalPrompt],
                         max_new_tokens: int, configured: SpecSetting, rounds: int, levels: list[int],
                         progress: Callable[[dict[str, Any]], None] | None = None,
                         should_stop: Callable[[], bool] | None = None,
                         on_phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Launch every server of `plan` in turn and measure it; the same result shape as
    engine.evaluate.local_eval.measure_local (levels, prompt_results, load, notes, done, total, stopped)."""
    from engine.evaluate.local_eval import plan_levels

    stop = should_stop or (lambda: False)
    levels, notes = plan_levels(levels, len(prompts))
    ids = [p.input_ids for p in prompts]
    total = len(ids) * rounds * len(levels) * len(plan)
    load: dict[str, Any] = {"before": os.getloadavg()[0], "cpus": os.cpu_count() or 1}
    state: dict[str, Any] = {"done": 0, "peak": load["before"], "last": 0.0}
    base: ServerRun | None = None
    runs: dict[SpecSetting, ServerRun] = {}
    for kind, setting, argv in plan:
        if stop():
            break
        if on_phase is not None:
            on_phase(kind)
        running: dict[str, Any] = {"tokens": 0, "verify": 0}
        run = new_run(levels, rounds, len(ids))

        def on_reply(r: int, n: int, reply: Reply, kind: str = kind, setting: SpecSetting | None = setting,
                     running: dict[str, Any] = running, run: ServerRun = run) -> None:
            state["done"] += 1
            running["tokens"] += reply.meta.completion_tokens
            running["verify"] += reply.verify_steps
            now = time.monotonic()
            if progress is None or now - state["last"] < 1.0 and state["done"] % len(ids):
                return
            state["last"] = now
            state["peak"] = max(state["peak"], os.getloadavg()[0])
            al = running["tokens"] / running["verify"] if setting is not None and running["verify"] else None
            progress({"done": state["done"], "total": total, "concurrency": n, "round": r + 1, "rounds": rounds,
                      "server": kind, "setting": setting.label if setting else "no speculation",
                      "acceptance_length": None if al is None else round(al, 3),
                      "speedup": _running_speedup(base, run) if setting else None})

        server = launch(kind, argv, env, url, api_key)
        try:
            await server.start(startup_timeout)
            await _measure_server(server, kind, run, ids, levels, rounds, max_new_tokens, stop, on_reply)
        finally:
            await server.stop()
        if setting is None:
            base = run
        else:
            runs[setting] = run
        state["peak"] = max(state["peak"], os.getloadavg()[0])
    load.update(after=os.getloadavg()[0], max=max(state["peak"], os.getloadavg()[0]))
    out_levels = []
    for n in levels:
        tallies = {s: _tally(base, run, n, rounds) for s, run in runs.items()} if base else {}
        if any(t.samples for t in tallies.values()):
            out_levels.append(level_summary(n, configured, tallies, len(ids) // n, rounds))
    configured_run = runs.get(configured)
    results = _prompt_results(prompts, base, configured_run, levels[0], rounds) if base and configured_run else []
    gauge = metrics_accept_length(configured_run.metrics) if configured_run else None
    notes.append(f"SGLang backend: the plain server, then one speculative server per setting ({len(runs)}), launched "
                 "one after another with the same argv but for the speculative flags; per server an untimed warm-up "
                 f"per level, then {rounds} round(s) each running every level (order rotating per round). "
                 "Concurrency N = N concurrent HTTP clients, each sending its next prompt when its reply is in; "
                 "speedup = median over prompts x rounds of per-request (spec tok/s / base tok/s) at the same level "
                 "and round, 95% bootstrap interval (seed 0); throughput = tokens / wall time of a level's run. "
                 "Drift between server launches is not cancelled as it is by the local backend's interleaving")
    if gauge is not None:
        notes.append(f"/metrics sglang:spec_accept_length (last logged, configured setting): {gauge:.2f}")
    stopped = state["done"] < total
    return {"levels": out_levels, "prompt_results": results, "load": load, "notes": notes, "done": state["done"],
            "total": total, "stopped": stopped}


def _running_speedup(base: ServerRun | None, run: ServerRun | None) -> float | None:
    """Median per-request speedup over the pairs measured so far on the server that is running."""
    from engine.evaluate.stats import median

    if base is None or run is None:
        return None
    samples = [_speedup(b, s) for n, rounds in run.replies.items() for r, replies in enumerate(rounds)
               for b, s in zip(base.replies[n][r], replies) if b is not None and s is not None]
    m = median([x for x in samples if x is not None])
    return None if m is None else round(m, 3)


def _speedup(b: Reply, s: Reply) -> float | None:
    if b.seconds <= 0 or s.seconds <= 0 or not b.output_ids:
        return None
    return (s.meta.completion_tokens / s.seconds) / (len(b.output_ids) / b.seconds)


def _tally(base: ServerRun, run: ServerRun, level: int, rounds: int) -> Tally:
    """Pairs of one level from the level runs both servers completed."""
    tally = Tally()
    for r in range(rounds):
        if not (base.complete(level, r) and run.complete(level, r)):
            continue
        for b, s in zip(base.replies[level][r], run.replies[level][r]):
            assert b is not None and s is not None
            tally.add_counts(len(b.output_ids), b.seconds, s.meta.completion_tokens, s.seconds, s.verify_steps,
                             list(s.meta.accepted), s.output_ids == b.output_ids)
        tally.wave_walls.append((base.walls[level][r] or 0.0, run.walls[level][r] or 0.0))
    return tally


def _prompt_results(prompts: list[EvalPrompt], base: ServerRun, run: ServerRun, level: int,
                    rounds: int) -> list[PromptResult]:
    """Per prompt at the first level with the configured setting, summed over the rounds measured."""
    out = []
    for i, prompt in enumerate(prompts):
        pairs = [(b, s) for b, s in ((base.replies[level][r][i], run.replies[level][r][i]) for r in range(rounds))
                 if b is not None and s is not None]
        if not pairs:
            continue
        width = max(len(s.meta.accepted) for _, s in pairs)
        first_b, first_s = pairs[0]
        out.append(PromptResult(
            id=prompt.id, prompt_tokens=len(prompt.input_ids),
            completion_tokens=sum(s.meta.completion_tokens for _, s in pairs),
            verify_steps=sum(s.verify_steps for _, s in pairs),
            accepted=[sum((s.meta.accepted or [0] * width)[k] if k < len(s.meta.accepted) else 0 for _, s in pairs)
                      for k in range(width)],
            spec_seconds=sum(s.seconds for _, s in pairs), base_seconds=sum(b.seconds for b, _ in pairs),
            base_completion_tokens=sum(len(b.output_ids) for b, _ in pairs),
            matches_greedy=all(s.output_ids == b.output_ids for b, s in pairs),
            first_mismatch=first_mismatch(first_s.output_ids, first_b.output_ids)))
    return out


async def evaluate_sglang(workspace: Any, export_dir: Path, prompts: list[EvalPrompt],
                          progress: Callable[[dict[str, Any]], None] | None = None,
                          on_phase: Callable[[str], None] | None = None,
                          should_stop: Callable[[], bool] | None = None,
                          launch: Launch | None = None) -> dict[str, Any]:
    """The workspace's SGLang launch (capture off), plain and per speculative setting, measured at
    every evaluate.concurrency level; see measure_sglang. `launch` defaults to supervised jobs."""
    from engine.jobs.manager import JobManager
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
    configured, settings = sweep_settings(ev)
    spec = build_sglang_spec(workspace, capture=False, port=free_port(cfg.server.host))
    if launch is None:
        jobs = JobManager(workspace.jobs_dir)

        def launch(kind: str, argv: list[str], env: dict[str, str], url: str, api_key: str | None) -> EvalServer:
            return EvalServer(jobs, kind, argv, env, url, api_key, workspace.root)

    measured = await measure_sglang(plan_servers(spec.argv, export_dir, settings), launch, spec.env, spec.url,
                                    spec.api_key, cfg.server.startup_timeout_s, prompts, ev.max_new_tokens,
                                    configured, ev.rounds, list(ev.concurrency), progress=progress,
                                    should_stop=should_stop, on_phase=on_phase)
    measured["notes"] += settings_notes(ev.spec_steps, ev.spec_topk, ev.spec_draft_tokens)
    measured["notes"] += running_cap_notes(spec.argv, list(ev.concurrency))
    return measured


SPEC_RUNNING_CAP = 48  # SGLang 0.5.23 (speculative_hook.py) resets max_running_requests to this when unset


def running_cap_notes(argv: list[str], levels: list[int]) -> list[str]:
    """Levels above the running-request cap SGLang gives speculative servers (not plain ones)."""
    above = [n for n in levels if n > SPEC_RUNNING_CAP]
    if not above or any(a.split("=", 1)[0] == "--max-running-requests" for a in argv):
        return []
    return [f"concurrency {', '.join(map(str, above))}: SGLang runs at most {SPEC_RUNNING_CAP} requests at once on a "
            "speculative server unless --max-running-requests is given (the plain server has no such cap), so "
            "there the rest queue; add --max-running-requests to server.extra_args to compare like with like"]
