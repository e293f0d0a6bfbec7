"""HTTP layer of the local target server: SGLang's endpoint names and reply shapes.

Endpoints: GET /health, /health_generate, /server_info (/get_server_info), /model_info
(/get_model_info), /metrics; POST /generate. Errors are JSON `{"error": {"message": ...}}`
with status 400 (bad request), 401 (API key) or 500/503 (server side), like SGLang.

Capture policy: with capture enabled, a /generate request is captured when it carries an
explicit `rid` (which must then be a safe file name, else 400). Requests without a rid get
a generated id and are *not* captured, so ad-hoc or warm-up traffic never fills the spool
with captures nobody will collect. Health checks (rid prefix HEALTH_CHECK) are never captured.

Streaming (`"stream": true`): SSE chunks `data: {...}\\n\\n`, each with `output_ids` holding only
the new token ids since the previous chunk and `text` the cumulative decoded text (the
shape SGLang streams by default); the last chunk carries the finish_reason, then
`data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import __version__
from engine.capture.layers import to_sglang_numbering
from engine.errors import EngineError
from engine.localserver.model_runner import ModelRunner
from engine.localserver.requests import HEALTH_CHECK_RID_PREFIX, DoneEvent, GenRequest, TokenEvent
from engine.localserver.sampling import SamplingParams
from engine.io.names import UnsafeNameError, check_name

HEALTH_CHECK_TIMEOUT_S = 20.0
_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
    "seed", "sampling_seed", "skip_special_tokens",
}


@dataclass
class ServerSettings:
    model_path: str
    host: str
    port: int
    device: str
    dtype: str
    max_batch: int
    api_key: str | None = None


class BadRequest(EngineError):
    pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


class ApiKeyMiddleware:
    """With an API key set, every path except /health* and /metrics* needs
    `Authorization: Bearer <key>` (SGLang's rule). The key itself is never logged."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._expected is not None:
            path: str = scope.get("path", "")
            if not path.startswith(("/health", "/metrics")):
                given = b""
                for name, value in scope.get("headers", []):
                    if name == b"authorization":
                        given = value
                if not hmac.compare_digest(given, self._expected):
                    response = _error(401, "Unauthorized: send 'Authorization: Bearer <api key>'")
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


# ---- request parsing ---------------------------------------------------------------------

def _int(value: Any, name: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def parse_sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = set(raw) - _SAMPLING_KEYS
    if unknown:
        raise BadRequest(
            f"unsupported sampling_params {sorted(unknown)}; the local server supports {sorted(_SAMPLING_KEYS)}"
        )
    params = SamplingParams()
    if raw.get("max_new_tokens") is not None:
        params.max_new_tokens = _int(raw["max_new_tokens"], "max_new_tokens", 0)
    if raw.get("temperature") is not None:
        params.temperature = _float(raw["temperature"], "temperature")
        if params.temperature < 0:
            raise BadRequest("temperature must be >= 0 (0 = greedy)")
    if raw.get("top_p") is not None:
        params.top_p = _float(raw["top_p"], "top_p")
        if not 0.0 < params.top_p <= 1.0:
            raise BadRequest("top_p must be in (0, 1]")
    if raw.get("top_k") is not None:
        params.top_k = _int(raw["top_k"], "top_k")
    stop = raw.get("stop_token_ids")
    if stop is not None:
        if not isinstance(stop, list):
            raise BadRequest("stop_token_ids must be a list of integers")
        params.stop_token_ids = frozenset(_int(t, "stop_token_ids item", 0) for t in stop)
    if raw.get("ignore_eos") is not None:
        params.ignore_eos = bool(raw["ignore_eos"])
    seed = raw.get("sampling_seed", raw.get("seed"))
    if seed is not None:
        params.seed = _int(seed, "seed")
    return params


@dataclass
class ParsedItem:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    capture: bool


def parse_generate(body: Any, runner: ModelRunner) -> tuple[list[ParsedItem], bool, bool]:
    """Return (items, is_batch, stream) or raise BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BadRequest("send exactly one of 'input_ids' or 'text'")
    if has_ids:
        raw_ids = body["input_ids"]
        if not isinstance(raw_ids, list) or not raw_ids:
            raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists)")
        is_batch = isinstance(raw_ids[0], list)
        prompts = raw_ids if is_batch else [raw_ids]
        for prompt in prompts:
            if not isinstance(prompt, list) or not prompt:
                raise BadRequest("every prompt in input_ids must be a non-empty list of token ids")
            for token in prompt:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < runner.info.vocab_size:
                    raise BadRequest(f"token id {token!r} is not in the vocabulary (0..{runner.info.vocab_size - 1})")
    else:
        texts = body["text"]
        is_batch = isinstance(texts, list)
        texts = texts if is_batch else [texts]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("text must be a non-empty string or a list of non-empty strings")
        if runner.tokenizer is None:
            raise BadRequest("this model directory has no usable tokenizer; send input_ids instead of text")
        prompts = [list(runner.tokenizer.encode(t)) for t in texts]
        if any(not p for p in prompts):
            raise BadRequest("a text encoded to zero tokens")
    count = len(prompts)
    raw_sampling = body.get("sampling_params")
    if is_batch and isinstance(raw_sampling, list):
        if len(raw_sampling) != count:
            raise BadRequest(f"sampling_params has {len(raw_sampling)} entries for {count} prompts")
        sampling = [parse_sampling(raw) for raw in raw_sampling]
    else:
        sampling = [parse_sampling(raw_sampling)] * count
    raw_rid = body.get("rid")
    if raw_rid is None:
        rids: list[Any] = [None] * count
    elif is_batch:
        if not isinstance(raw_rid, list) or len(raw_rid) != count:
            raise BadRequest(f"a batch of {count} prompts needs rid as a list of {count} strings")
        rids = raw_rid
    else:
        rids = [raw_rid]
    stream = bool(body.get("stream", False))
    if stream and is_batch:
        raise BadRequest("streaming is supported for a single prompt only")
    items: list[ParsedItem] = []
    for prompt, params, rid in zip(prompts, sampling, rids):
        capture = False
        if rid is None:
            rid = uuid.uuid4().hex
        elif not isinstance(rid, str):
            raise BadRequest(f"rid must be a string, got {rid!r}")
        elif runner.capture is not None and not rid.startswith(HEALTH_CHECK_RID_PREFIX):
            try:
                check_name(rid, "rid")
            except UnsafeNameError as exc:
                raise BadRequest(f"{exc} (capture is on, and the rid names the capture's spool folder)") from None
            capture = True
        if runner.info.max_context and len(prompt) + params.max_new_tokens > runner.info.max_context:
            raise BadRequest(
                f"the input ({len(prompt)} tokens) plus max_new_tokens ({params.max_new_tokens}) is longer "
                f"than the model's context length ({runner.info.max_context} tokens)"
            )
        items.append(ParsedItem(rid, prompt, params, capture))
    if len({item.rid for item in items}) != len(items):
        raise BadRequest("rids in one batch must be distinct")
    return items, is_batch, stream


# ---- the app -------------------------------------------------------------------------------

class LocalServerApp:
    def __init__(self, runner: ModelRunner, settings: ServerSettings) -> None:
        self.runner = runner
        self.settings = settings
        self._in_flight: set[str] = set()

    # -- plumbing
    def _submit(self, item: ParsedItem, count_in_metrics: bool = True) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:
                pass  # the event loop is gone: server shutting down

        self.runner.submit(GenRequest(rid=item.rid, input_ids=item.input_ids, params=item.params,
                                      emit=emit, capture=item.capture, count_in_metrics=count_in_metrics))
        return events

    def _text(self, ids: list[int]) -> str:
        tokenizer = self.runner.tokenizer
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None and ids else ""

    def _meta(self, item: ParsedItem, output_ids: list[int], finish: dict | None, started: float) -> dict:
        return {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,  # no prefix cache: every prompt token is computed (and captured)
            "e2e_latency": time.monotonic() - started,
        }

    async def _run_one(self, item: ParsedItem, started: float, count: bool = True) -> dict:
        events = self._submit(item, count)
        output_ids: list[int] = []
        while True:
            event = await events.get()
            if isinstance(event, TokenEvent):
                output_ids.extend(event.ids)
            elif isinstance(event, DoneEvent):
                if event.error:
                    raise RuntimeError(event.error)
                return {"text": self._text(output_ids), "output_ids": output_ids,
                        "meta_info": self._meta(item, output_ids, event.finish_reason, started)}

    # -- endpoints
    async def health(self, request: Request) -> Response:
        return Response(status_code=200) if self.runner.alive() else _error(503, "model worker is not running")

    async def health_generate(self, request: Request) -> Response:
        if not self.runner.alive():
            return _error(503, "model worker is not running")
        item = ParsedItem(rid=f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", input_ids=[0],
                          params=SamplingParams(max_new_tokens=1, temperature=0.0), capture=False)
        try:
            await asyncio.wait_for(self._run_one(item, time.monotonic(), count=False), HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error(503, f"health generation did not finish within {HEALTH_CHECK_TIMEOUT_S:.0f} s")
        except RuntimeError as exc:
            return _error(503, f"health generation failed: {exc}")
        return Response(status_code=200)

    async def server_info(self, request: Request) -> Response:
        capture = self.runner.capture
        return JSONResponse({
            "backend": "local",
            "version": __version__,
            "model_path": self.settings.model_path,
            "tokenizer_path": self.settings.model_path,
            "served_model_name": self.settings.model_path,
            "host": self.settings.host,
            "port": self.settings.port,
            "tp_size": 1,
            "dp_size": 1,
            "disable_radix_cache": True,
            "speculative_algorithm": None,
            "enable_metrics": True,
            "skip_server_warmup": True,
            "max_running_requests": self.settings.max_batch,
            "device": self.runner.device,
            "dtype": str(self.runner.model.dtype).removeprefix("torch."),
            "capture": {
                "enabled": capture is not None,
                "layers": list(capture.layers) if capture else None,
                "layers_sglang": to_sglang_numbering(capture.layers) if capture else None,
                "spool_dir": str(capture.spool_dir) if capture else None,
                "writer": self.runner.writer_description() if capture else None,
            },
            "prefill_cuda_graphs": (self.runner.prefill_graphs.describe() if self.runner.prefill_graphs is not None
                                    else {"enabled": False}),
            "internal_states": [{
                "last_gen_throughput": self.runner.gen_throughput(),
                "largest_prefill_batch": self.runner.stats.largest_prefill_batch,
                "prefill_batches_total": self.runner.stats.prefill_batches_total,
                "prefill_requests_total": self.runner.stats.prefill_requests_total,
            }],
        })

    async def model_info(self, request: Request) -> Response:
        runner = self.runner
        return JSONResponse({
            "model_path": self.settings.model_path,
            "tokenizer_path": self.settings.model_path,
            "served_model_name": self.settings.model_path,
            "is_generation": True,
            "model_type": runner.info.model_type,
            "architectures": runner.info.architectures,
            "num_layers": runner.info.num_layers,
            "hidden_size": runner.info.hidden_size,
            "vocab_size": runner.info.vocab_size,
            "max_context_length": runner.info.max_context,
        })

    async def metrics(self, request: Request) -> Response:
        runner, stats = self.runner, self.runner.stats
        gauges = [
            ("sglang:gen_throughput", "The generation throughput (token/s).", runner.gen_throughput()),
            ("sglang:num_running_reqs", "The number of running requests.", stats.num_running_reqs),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", runner.num_queue_reqs),
            ("sglang:cache_hit_rate", "The prefix cache hit rate (always 0: no prefix cache).", 0.0),
        ]
        counters = [
            ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", stats.prompt_tokens_total),
            ("sglang:generation_tokens_total", "Number of generation tokens processed.",
             stats.generation_tokens_total),
            ("sglang:cached_tokens_total", "Number of cached prompt tokens.", 0),
            ("sglang:num_requests_total", "Number of requests processed.", stats.num_requests_total),
        ]
        label = '{model_name="%s"}' % _escape_label(self.settings.model_path)
        lines: list[str] = []
        for kind, rows in (("gauge", gauges), ("counter", counters)):
            for name, help_text, value in rows:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                          f"{name}{label} {float(value)!r}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        try:
            items, is_batch, stream = parse_generate(body, self.runner)
        except BadRequest as exc:
            return _error(400, str(exc))
        busy = [item.rid for item in items if item.capture and item.rid in self._in_flight]
        if busy:
            return _error(400, f"request id {busy[0]!r} is already in flight")
        captured = {item.rid for item in items if item.capture}
        self._in_flight |= captured
        if stream:
            return StreamingResponse(self._stream(items[0], started, captured), media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(self._run_one(item, started) for item in items))
        except RuntimeError as exc:
            return _error(500, str(exc))
        finally:
            self._in_flight -= captured
        return JSONResponse(results if is_batch else results[0])

    async def _stream(self, item: ParsedItem, started: float, captured: set[str]) -> AsyncIterator[str]:
        try:
            events = self._submit(item)
            output_ids: list[int] = []
            while True:
                event = await events.get()
                if isinstance(event, TokenEvent):
                    output_ids.extend(event.ids)
                    chunk = {"text": self._text(output_ids), "output_ids": list(event.ids),
                             "meta_info": self._meta(item, output_ids, None, started)}
                else:
                    assert isinstance(event, DoneEvent)
                    if event.error:
                        chunk = {"error": {"message": event.error}}
                    else:
                        chunk = {"text": self._text(output_ids), "output_ids": [],
                                 "meta_info": self._meta(item, output_ids, event.finish_reason, started)}
                yield f"data: {json.dumps(chunk)}\n\n"
                if isinstance(event, DoneEvent):
                    break
            yield "data: [DONE]\n\n"
        finally:
            self._in_flight -= captured


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def build_app(runner: ModelRunner, settings: ServerSettings) -> ASGIApp:
    server = LocalServerApp(runner, settings)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/health_generate", server.health_generate, methods=["GET"]),
        Route("/server_info", server.server_info, methods=["GET"]),
        Route("/get_server_info", server.server_info, methods=["GET"]),
        Route("/model_info", server.model_info, methods=["GET"]),
        Route("/get_model_info", server.model_info, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/generate", server.generate, methods=["POST"]),
    ]
    return ApiKeyMiddleware(Starlette(routes=routes), settings.api_key)
