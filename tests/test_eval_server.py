"""The SGLang evaluation's servers run as supervised workspace jobs, through the same readiness
wait as the capture server. SGLang cannot run here (no GPU), so the local target server — a real
process serving SGLang's /health_generate — stands in for it; the argv is all that differs."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from engine.evaluate.sglang_eval import EvalServer, SglangEvalError
from engine.jobs.manager import JobManager
from tests.helpers.processes import free_port


def test_eval_server_is_a_job_that_starts_serves_and_stops(tmp_path, tiny_model_dir):
    port = free_port()
    argv = [sys.executable, "-m", "engine.localserver", "--model-path", str(tiny_model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu"]
    jobs = JobManager(tmp_path / "jobs")
    url = f"http://127.0.0.1:{port}"
    server = EvalServer(jobs, "eval-server-baseline", argv, {}, url, None, tmp_path)

    async def scenario():
        await server.start(timeout=60)
        try:
            assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
            job = jobs.get(server.job_id)
            assert job.kind == "eval-server-baseline" and job.state == "running"
            assert [j.id for j in jobs.active()] == [server.job_id]  # visible like any job
        finally:
            await server.stop(grace=10)

    asyncio.run(scenario())
    assert jobs.get(server.job_id).state not in ("starting", "running")
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_eval_server_that_dies_while_starting_is_reported_with_its_log(tmp_path):
    jobs = JobManager(tmp_path / "jobs")
    argv = [sys.executable, "-c", "import sys; print('CUDA error: out of memory', flush=True); sys.exit(3)"]
    server = EvalServer(jobs, "eval-server-speculative", argv, {}, f"http://127.0.0.1:{free_port()}", None, tmp_path)
    with pytest.raises(SglangEvalError) as err:
        asyncio.run(server.start(timeout=30))
    message = str(err.value)
    assert "server failed to start" in message and server.job_id in message and "/log" in message
    assert jobs.get(server.job_id).exit_code == 3
