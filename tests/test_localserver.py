"""The local target server as a real process on 127.0.0.1, driven through engine.client.

One server per module (capture on, API key on), a tiny random Llama, and the same model
loaded in-process as the reference for tokens and hidden states.
"""

from __future__ import annotations

from tests.helpers.processes import free_port, local_server_argv, stop_process, wait_healthy

import asyncio
import http.server
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.capture.segments import assemble, list_segments, release
from engine.client import ServerClient, ServerReplyError, ServerUnreachableError

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key-5d1f0c"
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42],
    [50],
    [60, 61, 62, 63, 64],
    [100, 7, 100, 7],
    [200, 201, 202, 203, 204, 205],
    [250, 251],
]


class RunningServer:
    def __init__(self, proc: subprocess.Popen, url: str, spool: Path, log: Path, writer: str = "threads") -> None:
        self.proc, self.url, self.spool, self.log, self.writer = proc, url, spool, log, writer

    def client(self, api_key: str | None = API_KEY) -> ServerClient:
        return ServerClient(self.url, api_key=api_key, timeout=30)


@pytest.fixture(scope="module", params=["threads", "process"], ids=["writer-threads", "writer-process"])
def server(request, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Every test runs against both ways of writing segments: threads in the server, and a child
    process fed through shared memory (EAGLE3_CAPTURE_WRITER=process) whose slots hold 8 tokens, so
    most batches are cut into several slots and the longer prompts into several segments."""
    import os

    work = tmp_path_factory.mktemp("localserver")
    spool, log = work / "spool", work / "server.log"
    port = free_port()
    argv = local_server_argv(tiny_model_dir, port, "--capture-layers", "0,1,2", "--spool-dir", str(spool),
                       "--api-key", API_KEY, "--log-level", "info")
    with open(log, "wb") as log_handle:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log_handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "EAGLE3_CAPTURE_WRITER": request.param,
                                     "EAGLE3_CAPTURE_SLOT_TOKENS": "8"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield RunningServer(proc, url, spool, log, request.param)
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


# ---- info endpoints ------------------------------------------------------------------------

async def test_health_and_info(server, request):
    async with server.client() as client:
        await client.health()
        await client.health_generate()
        info = await client.server_info()
        assert info["backend"] == "local" and info["tp_size"] == 1
        assert info["disable_radix_cache"] is True and info["speculative_algorithm"] is None
        assert info["enable_metrics"] is True and info["host"] == "127.0.0.1"
        writer = info["capture"].pop("writer")
        assert info["capture"] == {"enabled": True, "layers": [0, 1, 2], "layers_sglang": [1, 2, 3],
                                   "spool_dir": str(server.spool.resolve())}
        mode = "process" if "writer-process" in request.node.name else "threads"
        assert writer.startswith("process (pid " if mode == "process" else "threads (4)"), writer
        model = await client.model_info()
        assert model["is_generation"] is True
        assert (model["num_layers"], model["hidden_size"], model["vocab_size"]) == (4, 64, 300)


# ---- generation ----------------------------------------------------------------------------

async def test_greedy_matches_model_generate(server, reference):
    model, _ = reference
    async with server.client() as client:
        for prompt in PROMPTS[:3]:
            result = await client.generate(input_ids=prompt, max_new_tokens=12)
            assert result.output_ids == greedy(model, prompt, 12)
            meta = result.meta
            assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
            assert meta["cached_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 12}
            assert meta["e2e_latency"] > 0


async def test_prefill_only(server):
    async with server.client() as client:
        result = await client.generate(input_ids=PROMPTS[0], max_new_tokens=0)
    assert result.output_ids == [] and result.text == ""
    assert result.meta["completion_tokens"] == 0 and result.meta["prompt_tokens"] == len(PROMPTS[0])
    assert result.meta["finish_reason"]["type"] == "length"


async def test_text_input(server, reference):
    model, tokenizer = reference
    text = "hello world, the capital"
    ids = tokenizer.encode(text)
    async with server.client() as client:
        result = await client.generate(text=text, max_new_tokens=6)
    assert result.output_ids == greedy(model, ids, 6)
    assert result.text == tokenizer.decode(result.output_ids, skip_special_tokens=True)
    assert result.meta["prompt_tokens"] == len(ids)


async def test_stop_token_ids(server, reference):
    model, _ = reference
    full = greedy(model, PROMPTS[4], 10)
    stop = full[3]
    cut = full.index(stop)
    async with server.client() as client:
        result = await client.generate(input_ids=PROMPTS[4], max_new_tokens=10, stop_token_ids=[stop])
    assert result.output_ids == full[: cut + 1]
    assert result.meta["finish_reason"] == {"type": "stop", "matched": stop}


async def test_sampling_with_seed_is_reproducible(server):
    async with server.client() as client:
        first = await client.generate(input_ids=PROMPTS[1], max_new_tokens=8, temperature=1.5, seed=7)
        again = await client.generate(input_ids=PROMPTS[1], max_new_tokens=8, temperature=1.5, seed=7)
    assert first.output_ids == again.output_ids and len(first.output_ids) == 8


async def test_eight_concurrent_requests_are_batched_and_correct(server, reference):
    model, _ = reference
    lengths = [3, 9, 5, 12, 1, 7, 4, 10]
    async with server.client() as client:
        before = (await client.server_info())["internal_states"][0]
        results = await asyncio.gather(*(client.generate(input_ids=p, max_new_tokens=n)
                                         for p, n in zip(PROMPTS, lengths)))
        info = await client.server_info()
    for prompt, n, result in zip(PROMPTS, lengths, results):
        assert result.output_ids == greedy(model, prompt, n), prompt
    after = info["internal_states"][0]
    assert after["largest_prefill_batch"] > 1
    # Each request is prefilled once, in fewer batches than requests.
    assert after["prefill_requests_total"] - before["prefill_requests_total"] == len(lengths)
    assert 1 <= after["prefill_batches_total"] - before["prefill_batches_total"] < len(lengths)


async def test_streaming(server):
    async with server.client() as client:
        plain = await client.generate(input_ids=PROMPTS[2], max_new_tokens=7)
        chunks = [chunk async for chunk in client.generate_stream(input_ids=PROMPTS[2], max_new_tokens=7)]
    assert [i for chunk in chunks for i in chunk.output_ids] == plain.output_ids
    assert chunks[-1].text == plain.text
    assert chunks[-1].finish_reason == {"type": "length", "length": 7}
    assert all(chunk.finish_reason is None for chunk in chunks[:-1])
    raw = httpx.post(f"{server.url}/generate", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30,
                     json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.startswith("data: {") and raw.text.endswith("data: [DONE]\n\n")


# ---- capture -------------------------------------------------------------------------------

async def test_capture_matches_reference_hidden_states(server, reference):
    model, _ = reference
    prompt = PROMPTS[2]
    async with server.client() as client:
        result = await client.generate(input_ids=prompt, max_new_tokens=2, rid="cap-1")
    assert result.meta["id"] == "cap-1"
    # The reply comes once the writer holds the states: wait for the segments, as the job does.
    capture = assemble(server.spool, "cap-1", expected_len=len(prompt), expected_input_ids=prompt, wait_s=30)
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        final = model.model(torch.tensor([prompt])).last_hidden_state[0]
    aux_ref = torch.cat([states[layer + 1][0] for layer in (0, 1, 2)], dim=-1)
    assert capture.layers == [0, 1, 2] and capture.aux_hidden_state.shape == (len(prompt), 3 * 64)
    torch.testing.assert_close(capture.aux_hidden_state, aux_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(capture.hidden_state, final, atol=1e-4, rtol=1e-4)
    segments = 1 if server.writer == "threads" else 2  # 13 tokens through the process writer's 8-token slots
    assert len(list_segments(server.spool, "cap-1")) == segments and release(server.spool, "cap-1") == segments


async def test_capture_only_for_explicit_rid_and_never_for_health(server):
    for rid in [p.name for p in server.spool.iterdir()]:
        release(server.spool, rid)
    async with server.client() as client:
        await client.health_generate()
        await client.generate(input_ids=PROMPTS[0], max_new_tokens=1)  # no rid: not captured
        assert list(server.spool.iterdir()) == []
        results = await asyncio.gather(*(client.generate(input_ids=p, max_new_tokens=0, rid=f"batch-{i}")
                                         for i, p in enumerate(PROMPTS[:4])))
    for i, (prompt, result) in enumerate(zip(PROMPTS, results)):
        assert assemble(server.spool, f"batch-{i}", expected_len=len(prompt), wait_s=30).num_tokens == len(prompt)
        assert result.meta["id"] == f"batch-{i}"
        release(server.spool, f"batch-{i}")


async def test_mixed_batch_captures_each_row_exactly(server, reference):
    """Requests of different lengths batched together, some captured and some not: each captured
    segment holds its own row's states (no padding, no neighbour's row) — the per-batch host copy
    is sliced per request by the writers."""
    model, _ = reference
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    rids = [f"mix-{i}" if i % 3 != 1 else None for i in range(8)]
    async with server.client() as client:
        await asyncio.gather(*(client.generate(input_ids=p, max_new_tokens=0, rid=r) for p, r in zip(prompts, rids)))
        info = await client.server_info()
    assert info["internal_states"][0]["largest_prefill_batch"] > 1
    segments: dict[str, int] = {}
    for prompt, rid in zip(prompts, rids):
        if rid is None:
            continue
        capture = assemble(server.spool, rid, expected_len=len(prompt), expected_input_ids=prompt, wait_s=30)
        with torch.no_grad():
            states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            final = model.model(torch.tensor([prompt])).last_hidden_state[0]
        aux_ref = torch.cat([states[layer + 1][0] for layer in (0, 1, 2)], dim=-1)
        torch.testing.assert_close(capture.aux_hidden_state, aux_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(capture.hidden_state, final, atol=1e-4, rtol=1e-4)
        segments[rid] = len(list_segments(server.spool, rid))
        release(server.spool, rid)
    assert sorted(p.name for p in server.spool.iterdir()) == []
    if server.writer == "process":  # 8-token slots: the 13-token prompts cannot be one segment
        assert segments["mix-2"] >= 2 and max(segments.values()) >= 2, segments
    else:
        assert set(segments.values()) == {1}, segments


async def test_unsafe_rid_rejected_when_capturing(server):
    async with server.client() as client:
        for rid in ("../x", "/etc"):
            with pytest.raises(ServerReplyError, match="HTTP 400.*invalid rid") as info:
                await client.generate(input_ids=[5, 6], max_new_tokens=1, rid=rid)
            assert info.value.status == 400
    assert not (server.spool.parent / "x").exists()


async def test_bad_requests_are_clear(server):
    async with server.client() as client:
        with pytest.raises(ServerReplyError, match="token id 999 is not in the vocabulary"):
            await client.generate(input_ids=[1, 999], max_new_tokens=1)
        with pytest.raises(ServerReplyError, match="max_new_tokens must be >= 0"):
            await client.generate(input_ids=[1], max_new_tokens=-1)


# ---- metrics and auth ------------------------------------------------------------------------

async def test_metrics_counters_increase(server):
    names = ["sglang:gen_throughput", "sglang:num_running_reqs", "sglang:num_queue_reqs",
             "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
             "sglang:cache_hit_rate"]
    async with server.client() as client:
        before = await client.metrics()
        await client.generate(input_ids=PROMPTS[0], max_new_tokens=4)
        after = await client.metrics()
    assert set(names) <= set(after)
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == len(PROMPTS[0])
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 4
    assert after["sglang:cached_tokens_total"] == 0 and after["sglang:cache_hit_rate"] == 0
    assert after["sglang:gen_throughput"] > 0


async def test_api_key_enforced_and_never_logged(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as raw:
        assert (await raw.get("/health")).status_code == 200  # SGLang exempts /health* and /metrics
        assert (await raw.get("/metrics")).status_code == 200
        assert (await raw.get("/server_info")).status_code == 401
        wrong = await raw.post("/generate", json={"input_ids": [5]}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    async with server.client(api_key=None) as client:
        with pytest.raises(ServerReplyError, match="HTTP 401 \\(check the API key\\)") as info:
            await client.generate(input_ids=[5], max_new_tokens=1)
    assert API_KEY not in str(info.value)
    assert API_KEY not in server.log.read_text()


# ---- start-up errors ---------------------------------------------------------------------

def _without_torch(tmp_path) -> dict[str, str]:
    """An environment where importing torch fails: a refusal that still comes was made before torch."""
    shadow = tmp_path / "no-torch" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('torch imported before the cheap checks')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)])}


def test_bad_model_path_fails_fast(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(local_server_argv(missing, free_port()), cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=_without_torch(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"model path {missing}: does not exist"]


def test_busy_port_fails_fast(tiny_model_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(local_server_argv(tiny_model_dir, port), cwd=REPO, capture_output=True, text=True,
                              timeout=60, env=_without_torch(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"port {port} on 127.0.0.1 is in use"]


def test_bad_capture_layers_fail_fast(tiny_model_dir, tmp_path):
    argv = local_server_argv(tiny_model_dir, free_port(), "--capture-layers", "1,2,3", "--spool-dir", str(tmp_path))
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env=_without_torch(tmp_path))
    assert proc.returncode == 2
    assert "capture layer 3 is out of range" in proc.stderr and "valid range is 0..2" in proc.stderr



def test_a_bad_capture_setting_in_the_environment_fails_fast(tiny_model_dir, tmp_path):
    """Refused before the model loads, naming the variable and the fix: never replaced by a default."""
    argv = local_server_argv(tiny_model_dir, free_port(), "--spool-dir", str(tmp_path))
    for name, value, said in (("EAGLE3_CAPTURE_SLOT_TOKENS", "8k", "is not a whole number of tokens"),
                              ("EAGLE3_CAPTURE_WRITER", "fork", "is not one of process, threads"),
                              ("EAGLE3_CAPTURE_WRITERS", "0", "is not a number of writer threads")):
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**_without_torch(tmp_path / name), name: value})
        assert proc.returncode == 2, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"capture: {name}={value!r} {said}") and "unset it" in line

# ---- client against malformed replies ----------------------------------------------------

class _BadReplies(http.server.BaseHTTPRequestHandler):
    """A real HTTP server that answers like a broken backend (no real server produces these)."""

    replies = {
        "/server_info": (200, b"<html>proxy error</html>"),
        "/model_info": (200, b"[1, 2]"),
        "/generate": (200, b'{"text": "x", "meta_info": {}}'),
        "/metrics": (200, b"sglang:x{model_name=\"a\"} not-a-number\n"),
        "/health": (503, b'{"error": {"message": "model worker is not running"}}'),
    }

    def _answer(self) -> None:
        status, body = self.replies.get(self.path, (404, b"nope"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def bad_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BadReplies)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


async def test_client_reports_malformed_replies(bad_server):
    async with ServerClient(bad_server, timeout=5) as client:
        with pytest.raises(ServerReplyError, match="reply is not JSON: <html>proxy error"):
            await client.server_info()
        with pytest.raises(ServerReplyError, match="expected a JSON object, got list"):
            await client.model_info()
        with pytest.raises(ServerReplyError, match="lacks 'output_ids'"):
            await client.generate(input_ids=[1])
        with pytest.raises(ServerReplyError, match="'not-a-number' is not a number"):
            await client.metrics()
        with pytest.raises(ServerReplyError, match="HTTP 503.*model worker is not running") as info:
            await client.health()
        assert info.value.status == 503


async def test_client_reports_unreachable_server():
    async with ServerClient(f"http://127.0.0.1:{free_port()}", timeout=5) as client:
        with pytest.raises(ServerUnreachableError, match="ConnectError"):
            await client.health()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU box)")
@pytest.mark.parametrize("writer", ["threads", "process"], ids=["writer-threads", "writer-process"])
@pytest.mark.parametrize("graph_tokens", ["8192", "0"], ids=["cuda-graphs", "eager"])
def test_cuda_capture_of_a_mixed_batch_equals_the_reference(tiny_model_dir: Path, tmp_path: Path, graph_tokens: str,
                                                            writer: str):
    """On CUDA the states reach the host through pinned buffers on a side stream: each captured row
    must equal the in-process forward, and uncaptured neighbours must leave no segment. The uncaptured
    prefill-only rows are answered by the prefill waiter once the GPU has run their forward. Both with
    the prefill-only batch replayed from a CUDA graph (the default) and eagerly
    (EAGLE3_PREFILL_GRAPH_TOKENS=0); /server_info says which ran. And with the segments written by the
    server's threads or by the writer process (EAGLE3_CAPTURE_WRITER), which copies the pinned host
    states into shared memory once the batch's copy event has fired."""
    import os

    from transformers import AutoModelForCausalLM

    spool, log = tmp_path / "spool", tmp_path / "server.log"
    port = free_port()
    argv = local_server_argv(tiny_model_dir, port, "--capture-layers", "0,1,2", "--spool-dir", str(spool),
                             device="cuda", dtype="bfloat16")
    with open(log, "wb") as handle:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "EAGLE3_PREFILL_GRAPH_TOKENS": graph_tokens,
                                     "EAGLE3_CAPTURE_WRITER": writer})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
        rids = [f"gpu-{i}" if i % 3 != 1 else None for i in range(8)]

        async def send():
            async with ServerClient(url, timeout=60) as client:
                return await asyncio.gather(*(client.generate(input_ids=p, max_new_tokens=0, rid=r)
                                              for p, r in zip(prompts, rids)))

        results = asyncio.run(send())
        for prompt, result in zip(prompts, results):
            assert result.output_ids == [] and result.meta["prompt_tokens"] == len(prompt)
            assert result.meta["finish_reason"] == {"type": "length", "length": 0}
        model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)  # .cuda() mistyped
        model = model.cuda().eval()
        for prompt, rid in zip(prompts, rids):
            if rid is None:
                continue  # checked below: no segment directory besides the captured rids
            capture = assemble(spool, rid, expected_len=len(prompt), expected_input_ids=prompt, wait_s=30)
            with torch.no_grad():
                ids = torch.tensor([prompt], device="cuda")
                states = model(ids, output_hidden_states=True).hidden_states
                final = model.model(ids).last_hidden_state[0]
            aux_ref = torch.cat([states[layer + 1][0] for layer in (0, 1, 2)], dim=-1).cpu()
            # bf16, batched with padding vs alone: equal up to bf16 rounding
            torch.testing.assert_close(capture.aux_hidden_state.float(), aux_ref.float(), atol=5e-2, rtol=5e-2)
            torch.testing.assert_close(capture.hidden_state.float(), final.cpu().float(), atol=5e-2, rtol=5e-2)
        assert sorted(p.name for p in spool.iterdir()) == sorted(r for r in rids if r is not None)
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["capture"]["writer"].startswith("process (pid " if writer == "process" else "threads (4)")
        graphs = info["prefill_cuda_graphs"]
        if graph_tokens == "0":
            assert graphs["enabled"] is False and graphs["buckets"] == []
        else:
            assert graphs["enabled"] is True and graphs["failure"] is None and graphs["buckets"], graphs
    finally:
        stop_process(proc)


def test_gil_switch_interval_comes_from_the_environment(monkeypatch, capsys):
    """The local server's opt-in GIL switch interval: set in seconds from milliseconds, and a bad
    value is named on stderr and leaves Python's default in place."""
    import sys as _sys

    from engine.localserver.__main__ import GIL_SWITCH_ENV, apply_gil_switch_interval

    before = _sys.getswitchinterval()
    try:
        monkeypatch.delenv(GIL_SWITCH_ENV, raising=False)
        assert apply_gil_switch_interval() is None and _sys.getswitchinterval() == before
        monkeypatch.setenv(GIL_SWITCH_ENV, "0.5")
        assert apply_gil_switch_interval() == 0.0005 and abs(_sys.getswitchinterval() - 0.0005) < 1e-9
        _sys.setswitchinterval(before)
        for bad in ("fast", "0", "100"):
            monkeypatch.setenv(GIL_SWITCH_ENV, bad)
            assert apply_gil_switch_interval() is None and _sys.getswitchinterval() == before
            assert f"ignored {GIL_SWITCH_ENV}={bad!r}" in capsys.readouterr().err
    finally:
        _sys.setswitchinterval(before)


def test_a_gpu_server_runs_its_host_torch_on_one_thread_unless_told():
    """On a GPU the server's host-side torch ops are bookkeeping: a thread a core only spins (bench/RESULTS.md,
    Capture overhead, session 24). On a CPU the model runs on those threads, and OMP_NUM_THREADS always wins."""
    from engine.localserver.loading import host_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert host_threads(torch, "cpu", {}) == 2
        assert host_threads(torch, "cuda", {"OMP_NUM_THREADS": "4"}) == 2
        assert host_threads(torch, "cuda", {}) == 1
    finally:
        torch.set_num_threads(before)


def test_loading_a_model_sets_the_host_threads_for_its_device(tiny_model_dir, monkeypatch):
    from engine.localserver import loading

    seen: list[str] = []
    monkeypatch.setattr(loading, "host_threads", lambda torch_module, device: seen.append(device) or 1)
    loading.load_model(tiny_model_dir, "cpu", "auto")
    assert seen == ["cpu"]
