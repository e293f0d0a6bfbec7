"""Dataset stage: parsing both formats, bad lines, tokenisation with the target's chat template,
the stage check + stats cache used by the disk budget, and regeneration against a real server.

Everything is real: real files, a real BPE tokenizer with a Jinja chat template, a real local
target server process on 127.0.0.1 and a real detached job that is killed and resumed.
"""

from __future__ import annotations

from tests.helpers.processes import stop_process, wait_healthy

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.checks.base import Status
from engine.checks.context import CheckContext
from engine.dataset import BadLineError, DatasetError, ParseReport, iter_samples, tokenize_conversation
from engine.dataset.formats import KEEP_BAD_LINES
from engine.dataset.regenerate import EXIT_OK, RegenerateError, check_paths, recover_output, start_regeneration_job
from engine.dataset.stats import length_bucket
from engine.dataset.tokenize import load_tokenizer, mask_method
from engine.dataset.stats_cache import load_cached_stats
from engine.workspace import init_workspace

REPO = Path(__file__).resolve().parent.parent

# A template like real chat templates: role headers, content, eos closing assistant turns.
GEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<A>{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "{% else %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<A>{% endif %}"
)
PLAIN_TEMPLATE = GEN_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello world"},
]


def _model_with_template(src: Path, dst: Path, template: str) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = template
    tok.save_pretrained(dst, save_jinja_files=False)
    return dst


@pytest.fixture(scope="module")
def gen_model(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return _model_with_template(tiny_model_dir, tmp_path_factory.mktemp("gen") / "model", GEN_TEMPLATE)


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return _model_with_template(tiny_model_dir, tmp_path_factory.mktemp("plain") / "model", PLAIN_TEMPLATE)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def sharegpt(conv: list[dict[str, str]]) -> list[dict[str, str]]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in conv]


# ---------------------------------------------------------------------------- parsing


def test_both_formats_normalise_to_the_same_messages(tmp_path: Path) -> None:
    openai = write_jsonl(tmp_path / "a.jsonl", [{"id": "x1", "messages": CONV}])
    share = write_jsonl(tmp_path / "b.jsonl", [{"id": "x1", "conversations": sharegpt(CONV)}])
    parts = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                           {"role": "assistant", "content": "ok"}]}]
    a, b = list(iter_samples(openai)), list(iter_samples(share))
    assert a[0].messages == b[0].messages == CONV
    assert a[0].id == b[0].id == "x1"
    report = ParseReport("")
    (p,) = iter_samples(write_jsonl(tmp_path / "c.jsonl", parts), report=report)
    assert p.messages[0] == {"role": "user", "content": "hi there"} and report.format == "messages"


def test_auto_detection_and_mixed_file_names_the_line(tmp_path: Path) -> None:
    report = ParseReport("")
    path = write_jsonl(tmp_path / "s.jsonl", ["not json", {"conversations": sharegpt(CONV)}])
    assert len(list(iter_samples(path, report=report))) == 1
    assert report.format == "sharegpt" and report.bad_count == 1
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}, {"messages": CONV}, {"conversations": sharegpt(CONV)}])
    with pytest.raises(DatasetError, match=r"m\.jsonl:3: .*ShareGPT.*detected at line 1"):
        list(iter_samples(mixed))
    # Set explicitly, the other format is a bad line with a hint, not a guess.
    reader = iter_samples(mixed, format="sharegpt")
    assert len(list(reader)) == 1
    assert [b.line for b in reader.bad_lines] == [1, 2]
    assert "missing key 'conversations'" in reader.bad_lines[0].reason and "dataset.format" in reader.bad_lines[0].reason


BAD_MESSAGES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"text": "hi"}, "missing key 'messages'"),
    ({"messages": "hi"}, "'messages' is a string, expected a list"),
    ({"messages": []}, "is empty"),
    ({"messages": ["hi"]}, "messages[0] is a string"),
    ({"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
    ({"messages": [{"role": 3, "content": "x"}]}, "messages[0].role is a number"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot' is unknown"),
    ({"messages": [{"role": "user", "content": None}]}, "content is null"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
]
BAD_SHAREGPT = [
    ({"conversations": {}}, "'conversations' is an object"),
    ({"conversations": []}, "is empty"),
    ({"conversations": [{"from": "human"}]}, "conversations[0] has no 'value'"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "from 'bot' is unknown"),
    ({"conversations": [{"from": "human", "value": 7}]}, "value is a number"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "no assistant turn"),
]


@pytest.mark.parametrize("fmt,bad", [("messages", BAD_MESSAGES), ("sharegpt", BAD_SHAREGPT)])
def test_malformed_lines_report_file_line_and_reason(tmp_path: Path, fmt: str, bad) -> None:
    good = {"messages": CONV} if fmt == "messages" else {"conversations": sharegpt(CONV)}
    path = write_jsonl(tmp_path / "d.jsonl", [good] + [b for b, _ in bad] + ["", good])
    reader = iter_samples(path, format="auto", on_bad_line="skip")
    samples = list(reader)
    assert [s.line for s in samples] == [1, len(bad) + 3]  # blank line skipped silently
    assert reader.bad_count == len(bad)
    for entry, (_, reason) in zip(reader.bad_lines, bad):
        assert reason in entry.reason, (entry, reason)
    assert [b.line for b in reader.bad_lines] == list(range(2, len(bad) + 2))
    assert str(reader.bad_lines[0]).startswith(f"{path}:2: ")
    with pytest.raises(BadLineError) as info:
        list(iter_samples(path, format="auto", on_bad_line="stop"))
    assert info.value.bad.line == 2 and str(path) in str(info.value) and "on_bad_line" in str(info.value)


def test_bad_lines_beyond_the_kept_ones_are_counted(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "many.jsonl", ["x"] * (KEEP_BAD_LINES + 5) + [{"messages": CONV}])
    reader = iter_samples(path)
    assert len(list(reader)) == 1
    assert reader.bad_count == KEEP_BAD_LINES + 5 and len(reader.bad_lines) == KEEP_BAD_LINES


def test_ids_missing_unsafe_or_duplicate_are_derived(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "ids.jsonl", [
        {"id": "good-1", "messages": CONV}, {"messages": CONV}, {"id": "../etc", "messages": CONV},
        {"id": "good-1", "messages": CONV}, {"id": 42, "messages": CONV}, {"id": "s0000005", "messages": CONV},
        {"messages": CONV},
    ])
    reader = iter_samples(path)
    ids = [s.id for s in reader]
    assert ids == ["good-1", "s0000001", "s0000002", "s0000003", "42", "s0000005", "s0000006"]
    assert reader.report.derived_ids == {"missing": 2, "unsafe": 1, "duplicate": 1}
    assert len(set(ids)) == len(ids)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist: check dataset.path"):
        list(iter_samples(tmp_path / "nope.jsonl"))


def _padded(size: int) -> str:
    """A messages line of exactly `size` bytes (UTF-8, newline excluded)."""
    head = json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}]})
    pad = size - len(head.encode())
    assert pad >= 0
    return json.dumps({"messages": [{"role": "user", "content": "x" * pad}, {"role": "assistant", "content": "ok"}]})


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_line_over_the_byte_cap_stops_the_read_naming_line_size_and_cap(tmp_path: Path, monkeypatch, policy) -> None:
    from engine.dataset import formats

    cap = 1000
    monkeypatch.setattr(formats, "MAX_LINE_BYTES", cap, raising=False)
    monkeypatch.setattr(formats, "_SKIP_CHUNK", 64, raising=False)  # the rest of the line is read in many small pieces
    good = json.dumps({"messages": CONV})
    assert len(good.encode()) <= cap
    at_cap, crlf_at_cap = _padded(cap), _padded(cap) + "\r"
    path = tmp_path / "d.jsonl"
    path.write_bytes(("\n".join([good, at_cap, crlf_at_cap, good, _padded(5000), good]) + "\n").encode())
    reader = iter_samples(path, on_bad_line=policy)
    seen = []
    with pytest.raises(DatasetError) as info:
        for sample in reader:
            seen.append(sample.line)
    assert seen == [1, 2, 3, 4]  # a line of exactly the cap (with LF or CRLF) is read
    message = str(info.value)
    assert message.startswith(f"{path}:5: ") and "4.9 KiB (5,000 bytes)" in message and "1000 B" in message, message
    assert "per-line cap" in message and "shorten or remove line 5" in message, message
    assert reader.bad_count == 0  # not skipped as a bad line: the read stops
    # Over the cap on the last line, with no newline at the end of the file.
    path.write_bytes((good + "\n" + _padded(cap + 1)).encode())
    with pytest.raises(DatasetError, match=r":2: line 2 is 1001 B, over the 1000 B per-line cap"):
        list(iter_samples(path, on_bad_line=policy))
    # A file that is one JSON document (a JSON array) rather than JSONL says so.
    path.write_text(json.dumps([{"messages": CONV}] * 20) + "\n")
    with pytest.raises(DatasetError, match="one JSON document rather than JSONL"):
        list(iter_samples(path))


def test_extraction_plan_reads_through_the_same_cap(tmp_path: Path, gen_model: Path, monkeypatch) -> None:
    from engine.dataset import formats
    from engine.extract.plan import build_plan

    monkeypatch.setattr(formats, "MAX_LINE_BYTES", 1000, raising=False)
    ws = make_workspace(tmp_path / "ws", gen_model, [{"messages": CONV}, _padded(3000), {"messages": CONV}])
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: line 2 is 2\.9 KiB .*over the 1000 B per-line cap"):
        build_plan(ws)


# ---------------------------------------------------------------------------- tokenising


@pytest.mark.parametrize("which,method", [("gen", "generation"), ("plain", "prefix-diff")])
def test_loss_mask_is_exactly_the_assistant_tokens(which, method, gen_model, plain_model) -> None:
    tok = load_tokenizer(gen_model if which == "gen" else plain_model)
    assert mask_method(tok) == method
    sample = tokenize_conversation(tok, CONV, 512)
    rendered = tok.apply_chat_template(CONV, tokenize=False)
    assert sample.input_ids == tok(rendered, add_special_tokens=False)["input_ids"]  # the serving template
    masked = [i for i, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tok.decode(masked) == "Paris is the capital.</s>hello world</s>"
    # The mask is a set of contiguous runs, one per assistant turn, ending on eos.
    runs = [i for i in range(len(sample.loss_mask)) if sample.loss_mask[i] and (i == 0 or not sample.loss_mask[i - 1])]
    assert len(runs) == 2
    eos_positions = [i for i, t in enumerate(sample.input_ids) if t == tok.eos_token_id]
    assert all(sample.loss_mask[i] == 1 for i in eos_positions)
    assert sample.loss_mask[0] == 0 and sample.truncated == 0 and sample.full_length == len(sample.input_ids)


def test_truncation_counts(gen_model) -> None:
    tok = load_tokenizer(gen_model)
    full = tokenize_conversation(tok, CONV, 10_000)
    cut = tokenize_conversation(tok, CONV, 20)
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]
    assert cut.full_length == full.full_length and cut.truncated == full.full_length - 20
    assert length_bucket(0) == 0 and length_bucket(1) == 1 and length_bucket(255) == 128 and length_bucket(256) == 256


# ---------------------------------------------------------------------------- the stage


def make_workspace(root: Path, model: Path, lines: list, eval_lines: list | None = None, max_len: int = 512):
    ws = init_workspace(root)
    cfg = ws.config
    cfg.model.path = str(model)
    write_jsonl(root / "train.jsonl", lines)
    cfg.dataset.path = "train.jsonl"
    if eval_lines is not None:
        write_jsonl(root / "eval.jsonl", eval_lines)
        cfg.dataset.eval_path = "eval.jsonl"
    cfg.dataset.max_seq_len = max_len
    ws.save_config(cfg)
    return ws


def by_name(results):
    return {r.name: r for r in results}


def cached_stats(ws) -> dict[str, Any]:
    """The dataset stage's cached statistics, which the stage just wrote."""
    stats = load_cached_stats(ws)
    assert stats is not None, "no cached dataset statistics"
    return stats


def test_stage_writes_stats_and_disk_uses_exact_count(tmp_path: Path, gen_model: Path) -> None:
    from engine.checks.dataset import check_dataset
    from engine.checks.disk import estimate_tokens

    # The long sample's answer lies wholly past max_seq_len: truncation leaves it nothing to train on.
    long_conv = [{"role": "user", "content": "hello " * 200}, {"role": "assistant", "content": "world"}]
    empty_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]  # eos still trains
    lines = [{"messages": CONV}] * 30 + [{"messages": long_conv}, "oops", {"messages": empty_answer}]
    ws = make_workspace(tmp_path / "ws", gen_model, lines, eval_lines=[{"conversations": sharegpt(CONV)}], max_len=128)
    ctx = CheckContext(ws)
    results = by_name(check_dataset(ctx))
    assert results["dataset_parse"].status is Status.WARN and "line 32: not valid JSON" in results["dataset_parse"].evidence
    assert results["dataset_truncation"].status is Status.WARN and results["dataset_truncation"].evidence.startswith("1 of 32 samples exceed")
    assert results["dataset_trainable"].status is Status.WARN and "s0000030" in results["dataset_trainable"].evidence
    assert results["dataset_tokens"].status is Status.PASS and "tok |" in results["dataset_tokens"].evidence
    assert "tokenised in" in results["dataset_tokens"].evidence
    assert results["eval_parse"].status is Status.PASS

    stats = cached_stats(ws)
    tok = load_tokenizer(gen_model)
    full = [tokenize_conversation(tok, c, 10**9).full_length for c in [CONV] * 30 + [long_conv, empty_answer]]
    assert stats["samples"] == 32 and stats["total_tokens"] == sum(full)
    assert stats["total_tokens_after_truncation"] == sum(min(n, 128) for n in full)
    assert stats["truncated_tokens"] == sum(max(n - 128, 0) for n in full) and stats["over_max_len"] == 1
    assert stats["no_trainable"] == 1 and stats["bad_lines"]["count"] == 1
    assert sum(b["samples"] for b in stats["histogram"]) == 32
    assert stats["dataset"]["size"] == (ws.root / "train.jsonl").stat().st_size
    assert stats["eval"]["samples"] == 1

    tokens, source = estimate_tokens(ctx)
    assert (tokens, source) == (stats["total_tokens_after_truncation"], "from the dataset stage")
    # The file changes: the cache describes another file now and is ignored.
    with open(ws.root / "train.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"messages": CONV}) + "\n")
    assert load_cached_stats(ws) is None
    assert "estimated" in estimate_tokens(ctx)[1]


def test_stage_fails_on_stop_policy_and_missing_files(tmp_path: Path, gen_model: Path) -> None:
    from engine.checks.dataset import check_dataset

    ws = make_workspace(tmp_path / "ws", gen_model, [{"messages": CONV}, {"messages": []}])
    cfg = ws.config
    cfg.dataset.on_bad_line = "stop"
    ws.save_config(cfg)
    results = by_name(check_dataset(CheckContext(ws)))
    assert results["dataset_parse"].status is Status.FAIL and ":2: 'messages' is empty" in results["dataset_parse"].evidence
    assert load_cached_stats(ws) is None
    cfg.dataset.path = "missing.jsonl"
    ws.save_config(cfg)
    (result,) = check_dataset(CheckContext(ws))
    assert result.status is Status.FAIL and "does not exist" in result.evidence


def test_stage_fails_on_a_line_over_the_cap_with_the_line_and_a_fix(tmp_path: Path, gen_model: Path,
                                                                     monkeypatch) -> None:
    from engine.checks.dataset import check_dataset
    from engine.dataset import formats

    monkeypatch.setattr(formats, "MAX_LINE_BYTES", 1000, raising=False)
    ws = make_workspace(tmp_path / "ws", gen_model, [{"messages": CONV}] * 3 + [_padded(4000), {"messages": CONV}])
    (result,) = check_dataset(CheckContext(ws))
    assert result.name == "dataset_parse" and result.status is Status.FAIL
    assert result.evidence.startswith(f"{ws.root / 'train.jsonl'}:4: line 4 is 3.9 KiB (4,000 bytes)"), result.evidence
    assert "1000 B per-line cap" in result.evidence and "shorten or remove line 4" in result.fix, result
    assert load_cached_stats(ws) is None


def test_stats_tokenise_in_batches_bounded_in_characters(tmp_path: Path, gen_model: Path, monkeypatch) -> None:
    from engine.dataset import stats as stats_module

    calls: list[int] = []
    real = stats_module.tokenize_batch

    def spy(tokenizer, conversations, *args, **kwargs):
        calls.append(sum(len(m["content"]) for conv in conversations for m in conv))
        return real(tokenizer, conversations, *args, **kwargs)

    monkeypatch.setattr(stats_module, "tokenize_batch", spy)
    monkeypatch.setattr(stats_module, "BATCH_CHARS", 2000, raising=False)
    long_conv = [{"role": "user", "content": "hello " * 500}, {"role": "assistant", "content": "world"}]  # 3,005 chars
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": CONV}] * 40 + [{"messages": long_conv}] * 3 + [{"messages": CONV}] * 5)
    result = stats_module.compute_stats(path, load_tokenizer(gen_model), 128)
    assert result.samples == 48 and len(calls) > 3
    assert max(calls) <= 3005, calls  # a batch holds at most 2,000 chars, or one longer sample alone
    assert sum(calls) == sum(len(m["content"]) for conv in [CONV] * 45 + [long_conv] * 3 for m in conv)


def test_truncation_fix_never_suggests_more_than_the_model_reads(tmp_path: Path, gen_model: Path) -> None:
    from engine.checks.dataset import check_dataset

    positions = json.loads((gen_model / "config.json").read_text())["max_position_embeddings"]
    long_conv = [{"role": "user", "content": "hello " * 3000}, {"role": "assistant", "content": "world"}]
    ws = make_workspace(tmp_path / "ws", gen_model, [{"messages": CONV}] * 3 + [{"messages": long_conv}], max_len=128)
    results = by_name(check_dataset(CheckContext(ws)))
    truncation = results["dataset_truncation"]
    assert truncation.status is Status.WARN and f"longest {cached_stats(ws)['longest']:,}" in truncation.evidence
    assert cached_stats(ws)["longest"] > positions
    assert f"at most to {positions}" in truncation.fix and "max_position_embeddings" in truncation.fix, truncation.fix
    numbers = [int(n.replace(",", "")) for n in __import__("re").findall(r"\b\d[\d,]*\b", truncation.fix)]
    assert max(numbers) <= positions, truncation.fix
    # Already at the model's length: raising max_seq_len does not help, and the fix says so.
    cfg = ws.config
    cfg.dataset.max_seq_len = positions
    ws.save_config(cfg)
    fix = by_name(check_dataset(CheckContext(ws)))["dataset_truncation"].fix
    assert "does not help" in fix and str(positions) in fix, fix
    # A sample that fits the model: the exact length that keeps everything, as before.
    ws = make_workspace(tmp_path / "ws2", gen_model, [{"messages": CONV}] * 3 + [{"messages": [
        {"role": "user", "content": "hello " * 100}, {"role": "assistant", "content": "world"}]}], max_len=64)
    stats_longest = None
    truncation = by_name(check_dataset(CheckContext(ws)))["dataset_truncation"]
    stats_longest = cached_stats(ws)["longest"]
    assert stats_longest <= positions and f"to {stats_longest} keeps everything" in truncation.fix, truncation.fix


def test_stage_is_registered_in_the_pipeline() -> None:
    from engine.checks.dataset import check_dataset
    from engine.pipeline import get_stage

    assert get_stage("dataset").checks is check_dataset


# ---------------------------------------------------------------------------- regeneration


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(gen_model: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("regen-server") / "server.log"
    port = free_port()
    argv = [sys.executable, "-m", "engine.localserver", "--model-path", str(gen_model), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    with open(log, "wb") as handle:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url
    finally:
        stop_process(proc)


def wait_job(jobs, job_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = jobs.get(job_id)
        if not info.active:
            return info
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still running after {timeout} s: {jobs.tail(job_id)}")


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_regenerate_job_writes_new_file_and_resumes_after_kill(tmp_path: Path, gen_model: Path, server_url: str) -> None:
    from engine.jobs.manager import JobManager
    from engine.server.manager import STATE_FILE

    n = 8
    convs = [[{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "old answer"},
              {"role": "user", "content": "and?"}, {"role": "assistant", "content": "old again"}] for i in range(n)]
    lines = [{"id": f"q{i}", "messages": c} for i, c in enumerate(convs)]
    ws = make_workspace(tmp_path / "ws", gen_model, lines)
    original = (ws.root / "train.jsonl").read_bytes()
    (ws.state_dir / STATE_FILE).write_text(json.dumps({"url": server_url}))  # as the server manager records it
    jobs = JobManager(ws.jobs_dir)
    out = ws.root / "regen.jsonl"

    with pytest.raises(RegenerateError, match="never overwrites"):
        start_regeneration_job(ws, Path("train.jsonl"), jobs=jobs)

    job = start_regeneration_job(ws, out, jobs=jobs, concurrency=1, max_new_tokens=48)
    deadline = time.monotonic() + 60
    while count_lines(out) < 3 and time.monotonic() < deadline and jobs.get(job.id).active:
        time.sleep(0.05)
    jobs.kill(job.id)
    written_before = count_lines(out)
    assert 3 <= written_before, jobs.tail(job.id)
    with open(out, "ab") as handle:
        handle.write(b'{"id": "q99", "messa')  # a write torn by the kill

    with pytest.raises(RegenerateError, match="already exists"):
        start_regeneration_job(ws, out, jobs=jobs)
    job2 = start_regeneration_job(ws, out, jobs=jobs, concurrency=3, max_new_tokens=8, resume=True)
    info = wait_job(jobs, job2.id)
    assert info.exit_code == EXIT_OK, jobs.tail(job2.id)

    assert (ws.root / "train.jsonl").read_bytes() == original
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(n))  # each once, torn line gone
    for row in rows:
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert msgs[1]["content"] != "old answer" and msgs[3]["content"] != "old again"
    events, _ = jobs.events(job2.id)
    started = next(e for e in events if e["type"] == "started")
    finished = next(e for e in events if e["type"] == "finished")
    assert started["already_done"] == written_before
    assert finished["skipped"] == written_before and finished["written"] == n - written_before
    assert any(e["type"] == "progress" for e in events)

    # Greedy: q0 came from the first run (concurrency 1, in order); its answer is exactly the server's greedy continuation of the prompt.
    from engine.dataset.tokenize import prompt_ids

    tok = load_tokenizer(gen_model)
    first = next(r for r in rows if r["id"] == "q0")
    prompt = prompt_ids(tok, first["messages"][:1])
    reply = httpx.post(f"{server_url}/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 48, "temperature": 0.0}}, timeout=30).json()
    assert first["messages"][1]["content"] == reply["text"]


def test_recover_output_and_path_guards(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": "a", "messages": []}\n{"id": "b", "messages": []}\n{"id": "c", "mes')
    assert recover_output(out) == {"a", "b"}
    assert out.read_bytes().endswith(b'"b", "messages": []}\n')
    out.write_bytes(b'garbage\n{"id": "a"}\n')
    with pytest.raises(RegenerateError, match="o.jsonl:1"):
        recover_output(out)
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": CONV}])
    os.symlink(src, tmp_path / "link.jsonl")
    with pytest.raises(RegenerateError, match="never overwrites"):
        check_paths(src, tmp_path / "link.jsonl", resume=True)
