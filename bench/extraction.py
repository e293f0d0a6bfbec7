"""Extraction throughput (tokens/s, write MB/s) next to a plain write of the same bytes, one run.

The product's own extraction job runs in-process against a server it starts (capture on).
Then, on the same output disk, the same number of bytes is written twice without any model:
as many files as there are records, of the average record size, with the records' atomic
pattern (temp + fsync + rename, `engine.io.atomic.write_bytes`), and as one file with buffered
writes and one fsync. The ratio extraction MB/s / plain MB/s says how close extraction gets
to what the disk can take.

    python bench/extraction.py                       # the demo workspace (built in a temp dir)
    python bench/extraction.py --workspace DIR       # an existing workspace (a fresh bench-* run in it)
    python bench/extraction.py --size 1b             # GPU: ~1B random Llama in bf16, synthetic data
    python bench/extraction.py --size tiny           # the same synthetic path on CPU (smoke test)
    python bench/extraction.py --size 1b --steps     # and where the job's time goes, step by step
    python bench/extraction.py --size e2e --samples 800   # the end-to-end target's shape (80M, 5 KiB/token)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# {% generation %} marks the assistant tokens (the loss mask); the dataset stage requires a template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}</s>{% endgeneration %}{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
WORDS = ["gpu", "disk", "server", "token", "hello", "world", "capture", "layer", "draft", "speed",
         "overhead", "benchmark", "text", "hidden", "state", "record"]
CHUNK = 4 << 20  # plain sequential write: 4 MiB buffered writes


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class EventLog:
    """A job context for an in-process Extractor: keeps events with their time, never asks to stop."""

    job_dir: Path
    events: list[dict] = field(default_factory=list)
    stop_requested: bool = False
    _last_log: float = 0.0

    def event(self, kind: str, **data) -> None:
        self.events.append({"type": kind, "t": time.monotonic(), **data})
        if kind in ("started", "finished", "bad_sample", "server_down", "paused", "incomplete"):
            log(f"extract {kind}: {json.dumps(data)[:200]}")

    def progress(self, done: int, total: int, **data) -> None:
        if time.monotonic() - self._last_log > 10:  # a sign of life on long GPU runs
            self._last_log = time.monotonic()
            log(f"extract {done}/{total} samples, {data.get('tokens_per_s')} tok/s, {data.get('mb_per_s')} MB/s")

    def first(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["type"] == kind), None)


# ----------------------------------------------------------------------------- workspaces


def write_conversations(path: Path, n: int, response_words: int, seed: int = 0) -> None:
    """n OpenAI-format conversations: a short question, a long answer (most tokens are trained on)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(n):
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(response_words // 2, response_words)))
            handle.write(json.dumps({"id": f"b{i:05d}", "messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")


def synthetic_workspace(root: Path, size: str, args, gpu: bool):
    """A workspace on a random Llama (capture_overhead's build_model) with a synthetic dataset."""
    import torch
    from capture_overhead import build_model, free_port

    from engine.config import set_value
    from engine.workspace import init_workspace

    dtype = "bfloat16" if gpu else "float32"
    model_dir, params = build_model(size, root / "model", dtype)
    cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tok_cfg))
    if gpu:
        torch.cuda.empty_cache()
    ws = init_workspace(root / "ws")
    write_conversations(ws.root / "train.jsonl", args.samples, args.response_words)
    spool = Path(tempfile.mkdtemp(prefix="extbench-spool-", dir=args.spool)) if args.spool else ws.root / "spool"
    config = ws.config
    for key, value in {"model.path": str(model_dir), "model.dtype": dtype, "server.device": "cuda" if gpu else "cpu",
                       "server.port": free_port(), "server.startup_timeout_s": 600.0, "dataset.path": "train.jsonl",
                       "dataset.max_seq_len": args.max_seq_len, "extract.spool_dir": str(spool),
                       "extract.disk_reserve_gb": 1.0, "extract.spool_reserve_gb": 0.1,
                       "extract.concurrency": args.concurrency or (16 if gpu else 4)}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    return ws, f"random Llama {size} ({params / 1e6:.0f}M params, {dtype})", spool


def demo_workspace(root: Path, args):
    from capture_overhead import free_port

    from engine.config import set_value
    from engine.workspace import init_workspace

    started = time.perf_counter()
    ws = init_workspace(root / "ws", demo=True)
    log(f"demo workspace built in {time.perf_counter() - started:.0f} s")
    config = set_value(ws.config, "server.port", free_port())  # the demo's fixed port may be taken
    if args.concurrency:
        config = set_value(config, "extract.concurrency", args.concurrency)
    ws.save_config(config)
    return ws


def model_label(ws) -> str:
    from engine.model.target import workspace_plan

    plan = workspace_plan(ws)
    return f"{ws.model_dir.name} (hidden {plan.hidden_size}, {plan.num_layers} layers, {ws.config.model.dtype})"


# ----------------------------------------------------------------------------- the disk side


def atomic_files_mb_s(directory: Path, count: int, size: int) -> float:
    """`count` files of `size` bytes, each temp + fsync + rename + dir fsync (the records' pattern)."""
    from engine.io import atomic

    data = os.urandom(size)
    directory.mkdir(parents=True)
    started = time.perf_counter()
    for i in range(count):
        atomic.write_bytes(directory / f"f{i:06d}.bin", data)
    return count * size / (time.perf_counter() - started) / 1e6


def plain_file_mb_s(path: Path, total: int) -> float:
    """One file, buffered 4 MiB writes, one fsync at the end."""
    block = os.urandom(CHUNK)
    started = time.perf_counter()
    with open(path, "wb") as handle:
        left = total
        while left > 0:
            left -= handle.write(block[:min(left, CHUNK)])
        handle.flush()
        os.fsync(handle.fileno())
    return total / (time.perf_counter() - started) / 1e6


def plain_mb_s_beside(ws, total: int) -> float:
    """One plain file of `total` bytes on the records' file system, removed afterwards."""
    scratch = Path(tempfile.mkdtemp(prefix=".extbench-disk-", dir=ws.hidden_dir.parent))
    try:
        log(f"disk: one plain file of {total:,} bytes")
        return plain_file_mb_s(scratch / "plain.bin", total)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def extract_once(ws, job_dir: Path, extractor, timer) -> dict | None:
    """One extraction job in this process against the running server; its figures, or None if it failed."""
    ctx = EventLog(job_dir)
    ctx.job_dir.mkdir()
    if timer is not None:
        timer.install()
    wall = time.perf_counter()
    code = asyncio.run(extractor(ws, ctx).run())
    wall = time.perf_counter() - wall
    # Taken now: the disk measurements fsync too, and the timers count every fsync.
    steps = timer.snapshot() if timer is not None else None
    finished, begun = ctx.first("finished"), ctx.first("started")
    if code != 0 or finished is None or begun is None:
        print(f"extraction bench: the extraction job ended with code {code}: "
              f"{[e for e in ctx.events if e['type'] not in ('retry',)][-5:]}", file=sys.stderr)
        return None
    seconds = finished["t"] - begun["t"]  # like gpu_end_to_end.py: "started" to "finished"
    return {"samples": finished["samples"], "tokens": finished["tokens"], "bytes": finished["bytes"],
            "bad": finished.get("bad", 0), "seconds": round(seconds, 2), "wall_with_planning_s": round(wall, 2),
            "extraction_mb_s": round(finished["bytes"] / seconds / 1e6, 2), "steps": steps}


# ----------------------------------------------------------------------------- main


def run(args) -> int:  # noqa: C901 - a linear script
    import torch

    from engine.config import set_value
    from engine.extract.job import Extractor, limit_torch_threads
    from engine.server.manager import ServerManager
    from engine.workspace import Workspace

    gpu = torch.cuda.is_available()
    if args.size in ("1b", "e2e") and not gpu:
        print(f"extraction bench: --size {args.size} needs a GPU; use --size tiny for the same path on CPU",
              file=sys.stderr)
        return 2
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)  # the disk under test: create the folder asked for
    temp = Path(tempfile.mkdtemp(prefix="extbench-", dir=args.out_dir))
    own_run: Path | None = None  # a bench run inside a user's workspace: removed at the end
    spool: Path | None = None
    manager = None
    started_server = False
    try:
        if args.workspace:
            ws = Workspace(args.workspace)
            # A fresh run name in memory only: the user's config file and runs are left as they are.
            ws._config = set_value(ws.config, "extract.run", f"bench-{secrets.token_hex(3)}")
            own_run = ws.hidden_dir
            label = model_label(ws)
        elif args.size == "demo":
            ws = demo_workspace(temp, args)
            label = model_label(ws)
        else:
            ws, label, spool = synthetic_workspace(temp, args.size, args, gpu)
        manager = ServerManager(ws)
        started_server = not manager.is_running()
        log("starting the server (capture on)")
        asyncio.run(manager.start(capture=True))

        limit_torch_threads(ws.config.extract.concurrency)  # as the job process does
        timer: Any = None
        if args.steps:
            import step_timer as timer
        base_run = ws.config.extract.run
        pairs: list[dict[str, Any]] = []
        for pair in range(args.pairs):
            if args.pairs > 1:  # each pair extracts into a fresh run, freed when the pair is measured
                ws._config = set_value(ws.config, "extract.run", f"{base_run}-pair{pair}")
                own_run = ws.hidden_dir if args.workspace else None
            # Odd pairs time the disk first (the same bytes as the pair before): a drift of the disk over
            # the run (its cache filling, the host's writeback) then lands on both sides of the median.
            disk_first = pair % 2 == 1
            plain_before = plain_mb_s_beside(ws, pairs[-1]["bytes"]) if disk_first else None
            job = extract_once(ws, temp / f"job{pair}", Extractor, timer)
            if job is None:
                return 1
            plain = plain_before or plain_mb_s_beside(ws, job["bytes"])
            pairs.append({**job, "plain_sequential_mb_s": round(plain, 1), "plain_first": disk_first,
                          "ratio_extraction_plain": round(job["extraction_mb_s"] / plain, 4)})
            log(f"pair {pair + 1}/{args.pairs}: job {job['extraction_mb_s']:,.1f} MB/s, plain {plain:,.1f} MB/s, "
                f"ratio {pairs[-1]['ratio_extraction_plain']:.3f}")
            if args.pairs > 1:
                shutil.rmtree(ws.hidden_dir, ignore_errors=True)  # this bench's own records: the disk stays as it was
                os.sync()
        if started_server:
            asyncio.run(manager.stop(grace=10))
            started_server = False
        # The figures of the median pair (the lower middle for an even count): job and disk side by side
        # as they were measured, not medians of each side taken from different pairs.
        middle = sorted(pairs, key=lambda p: p["ratio_extraction_plain"])[(len(pairs) - 1) // 2]
        samples, tokens, total, seconds = middle["samples"], middle["tokens"], middle["bytes"], middle["seconds"]
        ext_mb_s, plain_mb_s, ratio = middle["extraction_mb_s"], middle["plain_sequential_mb_s"], middle["ratio_extraction_plain"]
        atomic_mb_s = 0.0
        if not args.skip_atomic:
            scratch = Path(tempfile.mkdtemp(prefix=".extbench-disk-", dir=ws.hidden_dir.parent))
            try:
                log(f"disk: {samples} atomic files of {total // samples:,} bytes")
                atomic_mb_s = atomic_files_mb_s(scratch / "atomic", samples, total // samples)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        steps = pairs[-1].get("steps")
        for p in pairs:
            p.pop("steps", None)

        device = torch.cuda.get_device_name(0) if gpu else f"CPU ({os.cpu_count()} cores)"
        summary = {"device": device, "model": label, "workspace": "given" if args.workspace else args.size,
                   "output_dir": str(ws.hidden_dir.parent), "concurrency": ws.config.extract.concurrency,
                   "samples": samples, "tokens": tokens, "bytes": total, "bad": sum(p["bad"] for p in pairs),
                   "seconds": round(seconds, 2), "wall_with_planning_s": middle["wall_with_planning_s"],
                   "extraction_tok_s": round(tokens / seconds, 1), "extraction_mb_s": round(ext_mb_s, 2),
                   "avg_record_bytes": total // samples, "bytes_per_token": round(total / tokens, 1),
                   "atomic_files_mb_s": round(atomic_mb_s, 1),
                   "plain_sequential_mb_s": round(plain_mb_s, 1), "ratio_extraction_plain": round(ratio, 4),
                   "ratio_atomic_plain": round(atomic_mb_s / plain_mb_s, 4), "pairs": pairs}
        if args.steps:
            summary["steps"] = timer.report(samples, seconds, steps)
        print(json.dumps(summary, indent=2))
        spread = f"; per pair {' / '.join(str(p['ratio_extraction_plain']) for p in pairs)}" if len(pairs) > 1 else ""
        print(f"extraction write ratio (extraction/plain): {ratio:.4f}  [{ext_mb_s:,.1f} vs {plain_mb_s:,.1f} MB/s"
              f"{' (the median of ' + str(len(pairs)) + ' pairs)' if len(pairs) > 1 else ''}; atomic small files "
              f"{atomic_mb_s:,.1f} MB/s; {tokens / seconds:,.0f} tok/s, {device}{spread}]")
        return 0
    finally:
        if manager is not None and started_server:
            asyncio.run(manager.stop(grace=10))
        if own_run is not None:
            shutil.rmtree(own_run, ignore_errors=True)  # only the bench-* run this script created
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("demo", "tiny", "1b", "e2e"), default="demo")
    parser.add_argument("--workspace", default=None, help="use this workspace instead of building the demo")
    parser.add_argument("--samples", type=int, default=None, help="synthetic conversations (tiny/1b/e2e)")
    parser.add_argument("--response-words", type=int, default=None, help="longest answer, in words (tiny/1b/e2e)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=None, help="extract.concurrency (requests in flight)")
    parser.add_argument("--out-dir", default=None, help="where the temp workspace (the disk under test) goes")
    parser.add_argument("--skip-atomic", action="store_true",
                        help="leave out the atomic small-files write (the plain write is the ratio's measure)")
    parser.add_argument("--steps", action="store_true",
                        help="time each step of the job's per-record path (bench/step_timer.py)")
    parser.add_argument("--pairs", type=int, default=1,
                        help="job + plain write pairs against one server, the disk first in every other pair; "
                             "the figures are the median pair's")
    parser.add_argument("--spool", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="parent of the capture spool (tiny/1b/e2e)")
    args = parser.parse_args()
    if args.workspace:
        from engine.workspace import Workspace

        if not Workspace(args.workspace).exists():
            parser.error(f"--workspace {args.workspace} is not a workspace (no config file there): "
                         "run `eagle3-console init DIR` first, or leave --workspace out to build the demo")
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: give 1 or more")
    if args.steps and args.pairs > 1:
        parser.error("--steps times one job: leave out --pairs or give --pairs 1")
    big = args.size in ("1b", "e2e")
    args.samples = args.samples or (400 if big else 64)
    args.response_words = args.response_words or (400 if big else 60)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
