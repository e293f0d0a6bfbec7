"""One huge dataset line (issue 20, case 6).

Found: a single 200 MB line drove `check dataset` to 22 GB RSS until the OOM killer killed it;
a 10 MB line took 3 GB and 16 s, printed a transformers warning, and the fix suggested
`max_seq_len` 6,990,512 for a model that reads 2,048 positions.

Replayed through the real command line (`eagle3-console check dataset`, a child process):
the peak RSS of that very process (wait4's rusage) is compared with the same check on the
file without the huge line; a watchdog kills the child early if it runs away, so a regression
fails the test instead of the machine. stdout and stderr are read for library chatter.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.workspaces import make_workspace, write_conversations
from engine.system.disk import fmt_bytes
from faults import ledger

MiB = 1 << 20
LINE_BYTES = 20 * MiB  # the huge line
RUNAWAY = 1536 * MiB  # RSS growth at which the watchdog kills the child (today's code passes it)
MAX_POSITIONS = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def warning_model(tiny_chat_model_dir, tmp_path_factory) -> Path:
    """The tiny chat model with model_max_length set, as real tokenizers have it (transformers then
    warns about longer sequences)."""
    target = tmp_path_factory.mktemp("maxlen") / "m"
    shutil.copytree(tiny_chat_model_dir, target)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = MAX_POSITIONS
    cfg_path.write_text(json.dumps(cfg))
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == MAX_POSITIONS
    return target


def _conversation(user_bytes: int) -> str:
    words = "hello world " * (user_bytes // 12)
    return json.dumps({"messages": [{"role": "user", "content": words}, {"role": "assistant", "content": "ok"}]})


def _workspace(root: Path, model: Path, extra_line: str | None, at: int = 6, max_len: int = 256):
    ws = make_workspace(root, model, **{"dataset.path": "train.jsonl", "dataset.max_seq_len": max_len})
    write_conversations(ws.root / "train.jsonl", 12)
    if extra_line is not None:
        lines = (ws.root / "train.jsonl").read_text().splitlines(keepends=True)
        lines.insert(at - 1, extra_line + "\n")
        (ws.root / "train.jsonl").write_text("".join(lines))
    return ws


# A small launcher between the test and the command: a child's ru_maxrss counts the image it was
# forked from (pytest's, hundreds of MB, growing as the test builds its files), so the command is
# started from a few-MB process and its own peak is read from that process's RUSAGE_CHILDREN.
LAUNCHER = (
    "import os, resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[2:])\n"
    "with open(sys.argv[1], 'w') as f: f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(code)\n"
)


def _check_dataset(ws, out: Path, base_rss: int = 0) -> dict:
    """`eagle3-console check dataset` as a child: its peak RSS, killed if it runs away."""
    out.mkdir(parents=True, exist_ok=True)
    stdout, stderr, maxrss = out / "stdout.txt", out / "stderr.txt", out / "maxrss_kib"
    command = [sys.executable, "-m", "eagle3_console", "check", "dataset", "-w", str(ws.root)]
    started = time.monotonic()
    with open(stdout, "wb") as so, open(stderr, "wb") as se:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(maxrss), *command],
                                stdout=so, stderr=se, stdin=subprocess.DEVNULL)
    killed: list[int] = []
    done = threading.Event()

    def watchdog() -> None:
        launcher = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                children = launcher.children()
                rss = max([c.memory_info().rss for c in children] or [0])
            except psutil.Error:
                children, rss = [], 0
            if (base_rss and rss > base_rss + RUNAWAY) or time.monotonic() - started > 240:
                killed.append(rss)
                for child in children:
                    child.kill()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        proc.wait(timeout=300)
    finally:
        done.set()
        thread.join()
    return {"rc": proc.returncode, "stdout": stdout.read_text(errors="replace"),
            "stderr": stderr.read_text(errors="replace"), "maxrss": int(maxrss.read_text()) * 1024,
            "seconds": time.monotonic() - started, "killed": killed}


def test_one_huge_line_is_refused_in_bounded_memory(warning_model, tmp_path):
    from engine.dataset import formats

    cap = getattr(formats, "MAX_LINE_BYTES", 0)  # 0 on code without a cap: the run below shows why it needs one
    assert cap < LINE_BYTES, "the reader's per-line byte cap must be below the test's line"
    base = _check_dataset(_workspace(tmp_path / "base", warning_model, None), tmp_path / "base-out")
    assert base["rc"] == 0, base["stdout"] + base["stderr"][-2000:]

    huge = _conversation(LINE_BYTES)
    ws = _workspace(tmp_path / "ws", warning_model, huge, at=6)
    size = len(huge.encode())
    run = _check_dataset(ws, tmp_path / "huge-out", base_rss=base["maxrss"])
    growth = run["maxrss"] - base["maxrss"]
    print(f"\n  huge line: {fmt_bytes(size)} line, peak RSS {fmt_bytes(run['maxrss'])} "
          f"(+{fmt_bytes(growth)} over the same check without it), {run['seconds']:.1f} s, rc {run['rc']}")
    assert not run["killed"], f"check dataset ran away: RSS {fmt_bytes(run['killed'][0])}, killed"
    # The reader holds at most one capped line; today's code grew ~100x the line before the watchdog.
    assert growth < cap + 8 * MiB, f"peak RSS grew {fmt_bytes(growth)} for a {fmt_bytes(size)} line"
    out = run["stdout"]
    assert run["rc"] == 1 and "dataset   failed" in out, out
    # The file, the line, its size, the cap, and what to do.
    assert f"{ws.root / 'train.jsonl'}:6" in out, out
    assert fmt_bytes(size) in out and cap and fmt_bytes(cap) in out, out
    assert "shorten" in out or "remove" in out, out
    assert "Traceback" not in run["stdout"] + run["stderr"]
    assert not (ws.state_dir / "dataset_stats.json").exists(), "stats written for a file that could not be read"
    ledger.add("dataset: one huge line", trials=2, faults=1, records=13)


def test_long_line_under_the_cap_prints_no_library_chatter_and_a_sane_fix(warning_model, tmp_path):
    long_line = _conversation(60_000)  # ~25,000 tokens of the tiny tokenizer, far over the model's 512 positions
    ws = _workspace(tmp_path / "ws", warning_model, long_line, at=3)
    run = _check_dataset(ws, tmp_path / "out")
    out, err = run["stdout"], run["stderr"]
    print(f"\n  long line: peak RSS {fmt_bytes(run['maxrss'])}, {run['seconds']:.1f} s")
    assert run["rc"] == 1 and "dataset   warned" in out, out + err[-2000:]
    for stream in (out, err):
        assert "Token indices" not in stream and "transformers" not in stream.lower(), stream[-2000:]
    lines = out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if "dataset_truncation" in line]
    fix = lines[at + 1]
    assert "fix:" in fix, out
    suggested = [int(n.replace(",", "")) for n in re.findall(r"\b\d[\d,]*\b", fix.split("fix:", 1)[1])]
    assert suggested and max(suggested) <= MAX_POSITIONS, f"suggests more than the model's {MAX_POSITIONS}: {fix}"
    assert str(MAX_POSITIONS) in fix, fix
    ledger.add("dataset: line over the model's length", trials=1, faults=1, records=13)
