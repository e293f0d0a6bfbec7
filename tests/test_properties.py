"""Property-based tests (hypothesis): bad input gets a valid result or a clear error, nothing else.

- the config parser: any TOML text -> Config or ConfigError (and a Config survives a round trip);
  NaN, +-inf, huge and negative numbers for every numeric key -> a ConfigError naming the key,
  the value and the fix, or a finite value in range;
- the dataset parsers (both formats, auto-detection, skip/stop): any file -> samples with safe
  ids and normalised messages, or DatasetError; every non-blank line is a sample or a bad line;
- the HTTP client against a real HTTP server on 127.0.0.1 replying with generated status codes
  and bodies: every call returns a valid result or raises ServerReplyError, within a timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import typing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.client import ServerClient, ServerReplyError
from engine.config import SECTIONS, Config, ConfigError, parse_config, render_config, set_value
from engine.dataset.formats import DatasetError, iter_samples
from engine.io.names import is_safe_name

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ---- config ----------------------------------------------------------------------------------

_scalars = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                     st.text(max_size=20))
_values = st.one_of(_scalars, st.lists(_scalars, max_size=4))
_keys = st.sampled_from(sorted({f.name for cls in SECTIONS.values() for f in cls.__dataclass_fields__.values()}
                               | {"bogus", "Port", "run"}))
_sections = st.sampled_from([*SECTIONS, "bogus", "Model"])


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


@FAST
@given(st.dictionaries(_sections, st.dictionaries(_keys, _values, max_size=5), max_size=4))
def test_config_parser_gives_a_config_or_a_config_error(doc):
    text = "".join(f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in body.items())
                   for name, body in doc.items())
    try:
        config = parse_config(text)
    except ConfigError as exc:
        assert str(exc) and "Fix:" in str(exc)
        return
    assert isinstance(config, Config)
    _assert_numbers_finite_and_bounded(config)
    assert parse_config(render_config(config)) == config  # what we write back reads the same


# Every numeric key of console.toml, found from the dataclasses (not from the validation table).
_NUMERIC = [(f"{name}.{key}", tp) for name, cls in SECTIONS.items()
            for key, tp in typing.get_type_hints(cls).items() if tp in (int, float) and key in cls.__dataclass_fields__]


def _assert_numbers_finite_and_bounded(config: Config) -> None:
    """Every number finite, non-negative and within the bounds its key declares."""
    from engine.config import SETTINGS

    for dotted, _ in _NUMERIC:
        section, _, key = dotted.partition(".")
        value = getattr(getattr(config, section), key)
        spec = SETTINGS[dotted]
        assert math.isfinite(value) and 0 <= spec.low <= value <= spec.high, f"{dotted} = {value!r} accepted"


_bad_numbers = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1, -1.0, -1e-9, 1e300, 10**18, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**63), 2**63 - 1),
)


def _number_literal(value) -> str:
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    return str(value)


@FAST
@given(key=st.sampled_from(_NUMERIC), value=_bad_numbers)
def test_every_numeric_key_is_finite_and_in_range_or_a_clear_error(key, value):
    """NaN, +-inf, huge and negative numbers for every numeric key: a ConfigError naming the key,
    the value and a fix, or a value that is finite and in range (never a NaN that fails later)."""
    dotted, _ = key
    section, _, name = dotted.partition(".")
    text = f"[{section}]\n{name} = {_number_literal(value)}\n"
    for attempt in ("file", "set_value"):
        try:
            config = parse_config(text, "ws/console.toml") if attempt == "file" else set_value(Config(), dotted, value)
        except ConfigError as exc:
            assert exc.key == dotted, str(exc)
            assert f"(got {value!r})" in str(exc) and "Fix:" in str(exc), str(exc)
            assert any(ch.isdigit() for ch in exc.fix), str(exc)  # the fix names the valid range
            continue
        _assert_numbers_finite_and_bounded(config)


@FAST
@given(st.text(max_size=200))
def test_config_parser_on_arbitrary_text(text):
    try:
        assert isinstance(parse_config(text), Config)
    except ConfigError as exc:
        assert "Fix:" in str(exc)


# ---- datasets --------------------------------------------------------------------------------

_role = st.sampled_from(["user", "assistant", "system", "human", "gpt", "tool", "", 3])
_content = st.one_of(st.text(max_size=30), st.none(), st.integers(),
                     st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                     "text": st.text(max_size=10)}), max_size=2))
_turn = st.one_of(st.fixed_dictionaries({"role": _role, "content": _content}),
                  st.fixed_dictionaries({"from": _role, "value": _content}),
                  st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2), st.text(max_size=5))
_id = st.one_of(st.none(), st.text(max_size=12), st.integers(), st.sampled_from(["../x", "a/b", ".", "s0000000"]))
_record = st.one_of(
    st.builds(lambda i, t: {"id": i, "messages": t}, _id, st.lists(_turn, max_size=4)),
    st.builds(lambda i, t: {"id": i, "conversations": t}, _id, st.lists(_turn, max_size=4)),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=2),
)
_line = st.one_of(_record.map(json.dumps), st.text(max_size=40), st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
                  st.just(""), st.just("[1, 2]"))


@FAST
@given(lines=st.lists(st.one_of(_line.map(lambda s: s.encode("utf-8", "surrogatepass")),
                                st.binary(max_size=16)), max_size=8),
       fmt=st.sampled_from(["auto", "messages", "sharegpt"]), policy=st.sampled_from(["skip", "stop"]))
def test_dataset_parsers_give_samples_or_a_dataset_error(tmp_path, lines, fmt, policy):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    reader = iter_samples(path, fmt, policy)
    samples = []
    try:
        for sample in reader:
            samples.append(sample)
    except DatasetError as exc:
        assert str(exc)
        return
    ids = [s.id for s in samples]
    assert len(ids) == len(set(ids)) and all(is_safe_name(i) for i in ids)
    for sample in samples:
        assert sample.messages and any(m["role"] == "assistant" for m in sample.messages)
        assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
                   for m in sample.messages)
    nonblank = sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
    assert len(samples) + reader.bad_count >= nonblank - sum(  # lines that are blank once decoded
        1 for line in path.read_bytes().split(b"\n") if line.strip() and not line.decode("utf-8", "replace").strip())
    if policy == "stop":
        assert reader.bad_count == 0


# ---- HTTP client against malformed replies -----------------------------------------------------

class _Reply:
    status = 200
    body = b""
    content_type = "application/json"
    length_delta = 0  # > 0: announce more bytes than sent (a reply cut short)


class _Handler(BaseHTTPRequestHandler):
    def _answer(self):
        reply = _Reply
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body) + reply.length_delta))
        self.end_headers()
        self.wfile.write(reply.body)
        if reply.length_delta:
            self.close_connection = True

    def do_GET(self):
        self._answer()

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self._answer()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def reply_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


_json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                      st.text(max_size=10)),
                            lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                   st.dictionaries(st.text(max_size=8), kids, max_size=3)),
                            max_leaves=8)
_generate_like = st.fixed_dictionaries({}, optional={
    "output_ids": st.one_of(st.lists(st.integers(0, 500), max_size=4), _json_values),
    "text": st.one_of(st.text(max_size=10), _json_values),
    "meta_info": st.one_of(st.dictionaries(st.sampled_from(["id", "cached_tokens", "prompt_tokens"]), _json_values,
                                           max_size=3), _json_values)})
_bodies = st.one_of(_generate_like.map(lambda d: json.dumps(d).encode()), _json_values.map(lambda v: json.dumps(v).encode()),
                    st.binary(max_size=60),
                    st.lists(st.sampled_from(["# HELP x y", "sglang:num_running_reqs 1", 'a{b="c"} 2.5', "bad line",
                                              "x{y=\"unterminated 1", "m nan", "n notanumber"]), max_size=4)
                    .map(lambda ls: "\n".join(ls).encode()))


@FAST
@given(status=st.sampled_from([200, 200, 200, 201, 204, 301, 400, 401, 404, 500, 502, 503]), body=_bodies,
       cut=st.sampled_from([0, 0, 0, 5]), call=st.sampled_from(["generate", "server_info", "model_info", "metrics",
                                                                 "health", "generate_stream"]))
def test_client_returns_a_valid_result_or_a_server_reply_error(reply_server, status, body, cut, call):
    _Reply.status, _Reply.body, _Reply.length_delta = status, body, cut

    async def go():
        async with ServerClient(reply_server, api_key="sk-prop-secret", timeout=5) as client:
            if call == "generate":
                result = await client.generate(input_ids=[1, 2], max_new_tokens=1)
                assert all(isinstance(t, int) for t in result.output_ids) and isinstance(result.meta, dict)
            elif call == "generate_stream":
                async for chunk in client.generate_stream(input_ids=[1], max_new_tokens=1):
                    assert isinstance(chunk.meta, dict)
            elif call == "metrics":
                assert all(isinstance(v, float) for v in (await client.metrics()).values())
            elif call == "health":
                await client.health()
            else:
                assert isinstance(await getattr(client, call)(), dict)

    try:
        asyncio.run(asyncio.wait_for(go(), 20))
    except ServerReplyError as exc:
        assert str(exc) and "sk-prop-secret" not in str(exc)  # a message naming the problem, never the key
