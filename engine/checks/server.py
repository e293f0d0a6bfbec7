"""Stage `server`: process up, health OK, capture-safe flags confirmed, decode tok/s measured."""

from __future__ import annotations

import time

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.dataset.tokenize import chat_token_ids

START_FIX = "start it: `eagle3-console server start` or `s` on the Server pane"


def probe_prompt_ids(workspace) -> list[int]:
    """A short chat prompt rendered with the target's own template (what extraction will send)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(workspace.model_dir), local_files_only=True)
    messages = [{"role": "user", "content": "Which GPU is busiest, and how much memory is free on it?"}]
    return chat_token_ids(tok, messages, add_generation_prompt=True)


def settings_check(differences: list) -> CheckResult:
    """The running server against console.toml (engine.server.drift): red when captures made now
    would not be what console.toml describes, amber when only its address differs."""
    from engine.server.drift import RESTART_FIX, describe

    if not differences:
        return passed("settings", "the running server was started with what console.toml asks for now "
                                  "(model, address, capture layers, spool, launch flags)")
    evidence = f"the running server differs from console.toml: {describe(differences)}"
    if any(d.blocking for d in differences):
        return failed("settings", evidence + " (captures now would not be what console.toml describes)", RESTART_FIX)
    return warned("settings", evidence + " (the engine still reaches it where it runs)", RESTART_FIX)


async def check_server(ctx: CheckContext) -> list[CheckResult]:
    import asyncio

    from engine.server.bench import decode_benchmark
    from engine.server.manager import ServerManager

    manager = ServerManager(ctx.workspace)
    status = await manager.poll()
    if status.state in ("stopped", "crashed"):
        detail = f" (exit {status.exit_code}: {status.error})" if status.state == "crashed" else ""
        return [failed("process", f"server {status.state}{detail}", START_FIX)]
    results = [passed("process", f"{status.backend} server pid {status.pid}, up {status.uptime_s or 0:.0f}s at {status.url}")]
    client = manager.client()
    try:
        started = time.perf_counter()
        try:
            await client.health_generate()
        except Exception as exc:
            return results + [failed("health", f"/health_generate failed: {exc}", "see `eagle3-console server logs`")]
        results.append(passed("health", f"/health_generate OK in {1000 * (time.perf_counter() - started):.0f} ms"))
        info = await client.server_info()
        results.append(settings_check(await asyncio.to_thread(manager.drift, info)))
        if ctx.config.model.backend == "sglang":
            from engine.checks.sglang import check_sglang_server_info

            results += check_sglang_server_info(info, ctx)
        else:
            results.append(_flags_check(info, ctx))
        ids = await asyncio.to_thread(probe_prompt_ids, ctx.workspace)
        bench = await decode_benchmark(client, ids, max_new_tokens=32)
        if bench.tokens < 2:
            results.append(warned("decode", f"only {bench.tokens} token(s) generated; throughput not measurable",
                                  "the model stops at once on the probe prompt; check its chat template"))
        else:
            results.append(passed("decode", f"single-stream {bench.tokens_per_s:.1f} tok/s over {bench.tokens} tokens, "
                                            f"first token {1000 * bench.ttft_s:.0f} ms"))
    finally:
        await client.aclose()
    return results


def _flags_check(info: dict, ctx: CheckContext) -> CheckResult:
    """Radix cache off, no speculation, metrics on, capture on: otherwise captures are partial or wrong."""
    problems = []
    if info.get("disable_radix_cache") is not True:
        problems.append("radix cache is ON (cached prefixes are never recomputed, so never captured)")
    if info.get("speculative_algorithm"):
        problems.append(f"speculative_algorithm={info.get('speculative_algorithm')} (verify batches look like EXTEND)")
    if info.get("enable_metrics") is not True:
        problems.append("metrics are off")
    capture = info.get("capture") or {}
    if not capture.get("enabled"):
        problems.append("capture is not enabled in this server")
    evidence = (f"disable_radix_cache={info.get('disable_radix_cache')}, speculative_algorithm="
                f"{info.get('speculative_algorithm')}, enable_metrics={info.get('enable_metrics')}, "
                f"capture layers {capture.get('layers')} (SGLang layers_to_capture {capture.get('layers_sglang')})")
    if problems:
        return failed("flags", "; ".join(problems) + f" — {evidence}",
                      "restart the server from the console, which launches it with the capture-safe flags")
    return passed("flags", evidence)
