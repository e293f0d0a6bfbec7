"""Async client for the HTTP subset that SGLang and the local target server share.

Every failure surfaces as `ServerReplyError` (or its subclass `ServerUnreachableError`)
with a message naming the endpoint and what was wrong: HTTP status plus a body excerpt,
non-JSON, missing keys, wrong types. Callers never see a raw KeyError or httpx exception.
The API key is sent as a Bearer header and never appears in messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from engine.errors import EngineError

_EXCERPT = 200
log = logging.getLogger(__name__)
# Replies that mean "this is not an SGLang or local target server": the endpoint does not exist.
FOREIGN_STATUSES = frozenset({404, 405, 501})
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""})


class ServerReplyError(EngineError):
    """The server's reply was an error, or not what the API promises."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnreachableError(ServerReplyError):
    """No reply at all: connection refused, reset, or timed out."""


@dataclass
class GenerateResult:
    output_ids: list[int]
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamChunk:
    output_ids: list[int]  # local server: ids new in this chunk
    text: str  # cumulative decoded text
    meta: dict[str, Any]

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        reason = self.meta.get("finish_reason")
        return reason if isinstance(reason, dict) else None


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + "…"


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ServerReplyError(f"{where}: expected a list of integers, got {_excerpt(repr(value))}")
    return value


def _check_meta(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ServerReplyError(f"{where}: 'meta_info' missing or not an object")
    return value


def parse_generate_reply(data: Any, where: str) -> GenerateResult:
    if not isinstance(data, dict):
        raise ServerReplyError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if "output_ids" not in data:
        raise ServerReplyError(f"{where}: reply lacks 'output_ids' (keys: {sorted(data)[:10]})")
    text = data.get("text", "")
    if not isinstance(text, str):
        raise ServerReplyError(f"{where}: 'text' is {type(text).__name__}, expected a string")
    return GenerateResult(output_ids=_int_list(data["output_ids"], f"{where} output_ids"), text=text,
                          meta=_check_meta(data.get("meta_info"), where))


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value}, summing samples that differ only
    in labels (e.g. one per TP/DP rank). Histogram `_bucket` samples are skipped."""
    values: dict[str, float] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = len(line.split(None, 1)[0])  # index of the first whitespace (or end)
        if 0 <= brace < space:
            name, rest = line[:brace], _skip_labels(line, brace, number)
        else:
            name, rest = line[:space], line[space:]
        fields = rest.split()
        if not name or not fields:
            raise ServerReplyError(f"/metrics line {number} is malformed: {_excerpt(raw)}")
        try:
            value = float(fields[0])
        except ValueError:
            raise ServerReplyError(f"/metrics line {number}: value {fields[0]!r} is not a number") from None
        if name.endswith("_bucket"):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def _skip_labels(line: str, start: int, number: int) -> str:
    """Return what follows the label set that opens at line[start] == '{'."""
    in_quotes = escaped = False
    for index in range(start + 1, len(line)):
        char = line[index]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            in_quotes = not in_quotes
        elif char == "}" and not in_quotes:
            return line[index + 1:]
    raise ServerReplyError(f"/metrics line {number}: unterminated label set")


def port_owner(host: str, port: int) -> str | None:
    """Who listens on a local TCP port, in words ("pid 4242 (python3: python -m http.server 30000)"),
    "another user's process" when the kernel will not say, None when the host is not this machine
    or nobody listens."""
    if host not in LOCAL_HOSTS:
        return None
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port:
            continue
        if conn.pid is None:
            return "another user's process"
        try:
            proc = psutil.Process(conn.pid)
            name = proc.name()
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            return f"pid {conn.pid}"
        cmdline = cmdline if len(cmdline) <= 120 else cmdline[:119] + "…"
        return f"pid {conn.pid} ({name}: {cmdline})" if cmdline else f"pid {conn.pid} ({name})"
    return None


@dataclass
class _Foreign:
    """A base URL whose port answered like something else than our server: probes back off."""

    owner: str | None
    failures: int = 0
    next_at: float = 0.0  # monotonic: no health probe before this
    busy: bool = False
    result_at: float = 0.0
    message: str = ""
    status: int = 404


# base URL -> what answers there; shared by every client of the process (the extraction runs one
# "wait for the server" loop per request in flight: they must not each probe).
_FOREIGN: dict[str, _Foreign] = {}
_NAMED: set[tuple[str, str | None]] = set()


def _foreign_message(where: str, response: httpx.Response, owner: str | None, port: int | None) -> str:
    who = f"held by {owner}" if owner else "held by a process this user cannot see"
    return (f"{where} returned HTTP {response.status_code}: port {port} does not answer like an SGLang or local "
            f"target server ({who}): stop that process or set server.port to a free port "
            f"(reply: {_excerpt(response.text) or '(empty body)'})")


def generate_body(input_ids: list[int] | None = None, text: str | None = None, max_new_tokens: int = 16,
                  temperature: float = 0.0, rid: str | None = None, stop_token_ids: list[int] | None = None,
                  seed: int | None = None, stream: bool = False) -> dict[str, Any]:
    """The JSON body of a POST /generate, in SGLang's GenerateReqInput and SamplingParams field names
    (tests/test_sglang_requests.py has SGLang 0.5.23's own classes parse and verify every body we send)."""
    if (input_ids is None) == (text is None):
        raise ValueError("pass exactly one of input_ids or text")
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    if stop_token_ids:
        sampling["stop_token_ids"] = list(stop_token_ids)
    if seed is not None:
        sampling["sampling_seed"] = seed
    body: dict[str, Any] = {"sampling_params": sampling}
    if input_ids is not None:
        body["input_ids"] = list(input_ids)
    else:
        body["text"] = text
    if rid is not None:
        body["rid"] = rid
    if stream:
        body["stream"] = True
    return body


class ServerClient:
    """`async with ServerClient("http://127.0.0.1:30000") as client: await client.generate(...)`"""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                       timeout=httpx.Timeout(timeout), trust_env=False)

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- plumbing --------------------------------------------------------------------

    async def _request(self, method: str, path: str, json_body: Any = None) -> httpx.Response:
        where = f"{method} {self.base_url}{path}"
        try:
            response = await self._http.request(method, path, json=json_body)
        except httpx.TimeoutException:
            raise ServerUnreachableError(f"{where}: no reply within {self._timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise ServerUnreachableError(f"{where}: {type(exc).__name__}: {exc or 'connection failed'}") from None
        self._raise_for_status(response, where)
        return response

    @staticmethod
    def _raise_for_status(response: httpx.Response, where: str) -> None:
        if response.status_code < 400:
            return
        hint = " (check the API key)" if response.status_code == 401 else ""
        raise ServerReplyError(
            f"{where} returned HTTP {response.status_code}{hint}: {_excerpt(response.text)}",
            status=response.status_code,
        )

    async def _json(self, method: str, path: str, json_body: Any = None) -> Any:
        response = await self._request(method, path, json_body)
        try:
            return response.json()
        except ValueError:
            raise ServerReplyError(
                f"{method} {path}: reply is not JSON: {_excerpt(response.text) or '(empty body)'}"
            ) from None

    async def _json_object(self, path: str) -> dict[str, Any]:
        data = await self._json("GET", path)
        if not isinstance(data, dict):
            raise ServerReplyError(f"GET {path}: expected a JSON object, got {type(data).__name__}")
        return data

    # ---- endpoints -------------------------------------------------------------------

    async def health(self) -> None:
        """Returns when the server reports healthy; ServerReplyError otherwise."""
        await self._request("GET", "/health")

    async def health_generate(self) -> None:
        """Returns when a one-token health generation succeeded.

        When the port answers like something else (HTTP 404/405/501: no such endpoint), the owner
        of the port is named (logged once per process) and further probes of that URL back off,
        1 s doubling to 30 s, shared by every client of the process: callers that poll in a loop
        never hammer a foreign server. Any other outcome ends the back-off."""
        state = _FOREIGN.get(self.base_url)
        if state is not None:
            await self._wait_turn(state)
        await self._probe("/health_generate")

    async def _wait_turn(self, state: _Foreign) -> None:
        """Wait for the back-off; if another client probed meanwhile, its answer is ours."""
        asked = time.monotonic()
        while True:
            if state.result_at > asked and state.message and _FOREIGN.get(self.base_url) is state:
                raise ServerReplyError(state.message, status=state.status)
            if _FOREIGN.get(self.base_url) is not state:
                return  # someone got a different answer: probe normally
            now = time.monotonic()
            if not state.busy and now >= state.next_at:
                return
            await asyncio.sleep(min(0.25, max(0.02, state.next_at - now)))

    async def _probe(self, path: str) -> None:
        state = _FOREIGN.get(self.base_url)
        if state is not None:
            state.busy = True
        where = f"GET {self.base_url}{path}"
        sent = time.monotonic()
        try:
            try:
                response = await self._http.request("GET", path)
            except httpx.TimeoutException:
                raise ServerUnreachableError(f"{where}: no reply within {self._timeout:g} s") from None
            except httpx.HTTPError as exc:
                raise ServerUnreachableError(f"{where}: {type(exc).__name__}: {exc or 'connection failed'}") from None
            if response.status_code not in FOREIGN_STATUSES:
                _FOREIGN.pop(self.base_url, None)
                self._raise_for_status(response, where)
                return
            state = self._foreign(state)
            if state.result_at < sent:  # probes sent together (several callers at once) count once
                state.failures += 1
                state.next_at = time.monotonic() + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (state.failures - 1))
            state.message = _foreign_message(where, response, state.owner, urlsplit(self.base_url).port)
            state.status = response.status_code
            state.result_at = time.monotonic()
            raise ServerReplyError(state.message, status=response.status_code)
        except ServerUnreachableError:
            _FOREIGN.pop(self.base_url, None)  # nobody there now: whoever comes next is probed afresh
            raise
        finally:
            if state is not None:
                state.busy = False

    def _foreign(self, state: _Foreign | None) -> _Foreign:
        if state is None:
            parts = urlsplit(self.base_url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            owner = port_owner(parts.hostname or "", port)
            state = _FOREIGN.setdefault(self.base_url, _Foreign(owner))
            if (self.base_url, owner) not in _NAMED:
                _NAMED.add((self.base_url, owner))
                log.warning("port %s (%s) answers, but not as an SGLang or local target server: it is held by %s; "
                            "health probes back off up to %.0f s", port, self.base_url,
                            owner or "a process this user cannot see", BACKOFF_MAX_S)
        return state

    async def server_info(self) -> dict[str, Any]:
        return await self._json_object("/server_info")

    async def model_info(self) -> dict[str, Any]:
        return await self._json_object("/model_info")

    async def generate(self, input_ids: list[int] | None = None, text: str | None = None,
                       max_new_tokens: int = 16, temperature: float = 0.0, rid: str | None = None,
                       stop_token_ids: list[int] | None = None, seed: int | None = None) -> GenerateResult:
        body = generate_body(input_ids, text, max_new_tokens, temperature, rid, stop_token_ids, seed, stream=False)
        return parse_generate_reply(await self._json("POST", "/generate", body), "POST /generate")

    async def generate_stream(self, input_ids: list[int] | None = None, text: str | None = None,
                              max_new_tokens: int = 16, temperature: float = 0.0, rid: str | None = None,
                              stop_token_ids: list[int] | None = None,
                              seed: int | None = None) -> AsyncIterator[StreamChunk]:
        """Yield one StreamChunk per SSE event until `data: [DONE]`."""
        body = generate_body(input_ids, text, max_new_tokens, temperature, rid, stop_token_ids, seed, stream=True)
        where = f"POST {self.base_url}/generate (stream)"
        try:
            async with self._http.stream("POST", "/generate", json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._raise_for_status(response, where)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        return
                    yield self._parse_chunk(payload, where)
        except httpx.TimeoutException:
            raise ServerUnreachableError(f"{where}: no data within {self._timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise ServerUnreachableError(f"{where}: {type(exc).__name__}: {exc or 'connection failed'}") from None
        raise ServerReplyError(f"{where}: the stream ended without 'data: [DONE]'")

    @staticmethod
    def _parse_chunk(payload: str, where: str) -> StreamChunk:
        try:
            data = json.loads(payload)
        except ValueError:
            raise ServerReplyError(f"{where}: chunk is not JSON: {_excerpt(payload)}") from None
        if isinstance(data, dict) and "error" in data:
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ServerReplyError(f"{where}: server reported an error: {_excerpt(str(message))}")
        result = parse_generate_reply(data, where)
        return StreamChunk(output_ids=result.output_ids, text=result.text, meta=result.meta)

    async def metrics(self) -> dict[str, float]:
        response = await self._request("GET", "/metrics")
        return parse_prometheus_text(response.text)
