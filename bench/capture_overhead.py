"""Prefill throughput with hidden-state capture on vs off, on the same local server, one run.

The server is started once with capture enabled; requests carrying a rid are captured
(segments written to the spool), requests without one are not. Rounds alternate so both
sides see the same machine state. Prints tokens/s for each side and the ratio on/off.

    python bench/capture_overhead.py                 # CPU: tiny random Llama
    python bench/capture_overhead.py --size 1b       # GPU: ~1B random Llama in bf16
    python bench/capture_overhead.py --size e2e --length 512 --requests 128 --concurrency 16 --max-batch 8
                                                     # GPU: gpu_end_to_end.py's measurement, standalone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (128, 6, 4, 2, 384, 2048),
    "1b": (2048, 16, 16, 8, 5632, 32000),
    "e2e": (640, 16, 10, 2, 1728, 8192),  # the 80M target bench/gpu_end_to_end.py trains (run it with --length 512)
}


def build_model(size: str, out: Path, dtype: str) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["capture overhead benchmark text"] * 10, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                         torch_dtype=dtype, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    return out, params


PHASE_FILE: str | None = None  # set with --profile-server: tells the stack sampler which side runs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def run_round(client, spool: Path, capture: bool, n: int, length: int, vocab: int, concurrency: int,
                    seed: int) -> float:
    import random

    from engine.capture.segments import release

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]) -> int:
        async with sem:
            rid = f"bench-{seed}-{i}" if capture else None
            result = await client.generate(input_ids=ids, max_new_tokens=0, rid=rid)
            if capture:
                await asyncio.to_thread(release, spool, rid)
            return int(result.meta.get("prompt_tokens", len(ids)))

    if PHASE_FILE:
        Path(PHASE_FILE).write_text("on" if capture else "off")
    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    rate = tokens / (time.perf_counter() - started)
    if PHASE_FILE:
        Path(PHASE_FILE).write_text("idle")
    return rate


def round_ratios(result: dict) -> list[float]:
    """Round i on / round i off (the sides alternate, so a pair shares the machine's state)."""
    return [round(a / b, 3) for a, b in zip(result["on"], result["off"])]


async def bench(url: str, spool: Path, args, vocab: int) -> dict:
    from engine.client import ServerClient

    async with ServerClient(url, timeout=600) as client:
        await run_round(client, spool, True, args.concurrency, args.length, vocab, args.concurrency, 999)  # warm-up
        await run_round(client, spool, False, args.concurrency, args.length, vocab, args.concurrency, 998)
        on, off = [], []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for capture in order:
                rate = await run_round(client, spool, capture, args.requests, args.length, vocab, args.concurrency, r)
                (on if capture else off).append(rate)
    return {"on": on, "off": off}


def spool_write_ceiling(spool: Path, hidden: int, tokens: int, dtype: str, seconds: float = 3.0) -> dict:
    """The capture writer's own limit, measured in the same run: segments of one request's size
    written with `write_segment` by as many threads as the server uses. tok/s above this cannot
    be captured whatever the GPU does."""
    import threading

    import torch

    from engine.capture.segments import release, write_segment

    from engine.localserver.model_runner import capture_writer_count

    threads = capture_writer_count()  # = the server's writer pool
    torch_dtype = getattr(torch, dtype)
    aux = torch.randn(tokens, 3 * hidden).to(torch_dtype)
    final = torch.randn(tokens, hidden).to(torch_dtype)
    ids = torch.arange(tokens)
    written = [0] * threads
    deadline = time.perf_counter() + seconds

    def writer(k: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            rid = f"ceiling-{k}-{i}"
            write_segment(spool, rid, 0, ids, aux, final, [1, 2, 3])
            release(spool, rid)
            written[k] += tokens
            i += 1

    started = time.perf_counter()
    pool = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - started
    bytes_per_token = 4 * hidden * aux.element_size() + 8
    tok_s = sum(written) / elapsed
    return {"threads": threads, "tok_s": round(tok_s), "gb_s": round(tok_s * bytes_per_token / 1e9, 2)}


def main() -> int:  # noqa: C901 - a linear script
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--length", type=int, default=None, help="prompt tokens per request")
    parser.add_argument("--requests", type=int, default=None, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=None, help="server batch size (default: --concurrency)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per side (alternating); the spread is printed")
    parser.add_argument("--spool", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--profile-server", metavar="OUT", default=None,
                        help="sample the server's thread stacks (bench/stack_sampler.py) into OUT, split by side")
    parser.add_argument("--probe-server", metavar="OUT", default=None,
                        help="time the server's prefill forwards from inside (bench/runner_probe.py: host/GPU ms, "
                             "allocator counts, captured vs plain) into OUT")
    args = parser.parse_args()
    global PHASE_FILE
    import torch

    from engine.capture.layers import default_capture_layers

    gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.length = args.length or (2048 if gpu else 256)
    # Enough requests that a round is mostly steady state: filling and draining the pipeline (two
    # batches in flight) is a fixed cost per round that the extraction job pays once per run.
    args.requests = args.requests or (96 if gpu else 16)
    work = Path(tempfile.mkdtemp(prefix="capbench-"))
    spool = Path(tempfile.mkdtemp(prefix="capbench-spool-", dir=args.spool))
    try:
        model_dir, params = build_model(args.size, work / "model", dtype)
        if gpu:
            torch.cuda.empty_cache()
        hidden, layers, *_ , vocab = SIZES[args.size]
        port = free_port()
        log = open(work / "server.log", "w")
        launcher = [sys.executable]
        if args.profile_server:
            PHASE_FILE = str(work / "phase")
            launcher += [str(Path(__file__).with_name("stack_sampler.py")), str(Path(args.profile_server).resolve()),
                         "--phase-file", PHASE_FILE, "--"]
        elif args.probe_server:
            launcher += [str(Path(__file__).with_name("runner_probe.py")), str(Path(args.probe_server).resolve()), "--"]
        server = subprocess.Popen(
            [*launcher, "-m", "engine.localserver", "--model-path", str(model_dir), "--port", str(port),
             "--device", "cuda" if gpu else "cpu", "--dtype", dtype, "--capture-layers",
             ",".join(map(str, default_capture_layers(layers))), "--spool-dir", str(spool), "--max-batch", str(args.max_batch or args.concurrency)],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
        try:
            url = f"http://127.0.0.1:{port}"
            import httpx

            deadline = time.time() + 300
            while time.time() < deadline:
                if server.poll() is not None:
                    print((work / "server.log").read_text()[-2000:])
                    return 1
                try:
                    if httpx.get(url + "/health_generate", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            result = asyncio.run(bench(url, spool, args, vocab))
        finally:
            if args.probe_server:
                time.sleep(2.5)  # the probe rewrites its file every 2 s: let it take in the last round
            server.terminate()
            server.wait(30)
        ceiling = spool_write_ceiling(spool, hidden, args.length, dtype)
        on, off = statistics.median(result["on"]), statistics.median(result["off"])
        device = torch.cuda.get_device_name(0) if gpu else f"CPU ({os.cpu_count()} cores)"
        summary = {"device": device, "model": f"random Llama {args.size} ({params / 1e6:.0f}M params, {dtype})",
                   "prompt_tokens": args.length, "requests_per_round": args.requests, "concurrency": args.concurrency,
                   "rounds": args.rounds, "capture_on_tok_s": round(on, 1), "capture_off_tok_s": round(off, 1),
                   "ratio_on_off": round(on / off, 3), "all_on": [round(x) for x in result["on"]],
                   "all_off": [round(x) for x in result["off"]], "spool_write_ceiling": ceiling,
                   "per_round_ratios": round_ratios(result)}
        print(json.dumps(summary, indent=2))
        pairs = sorted(a / b for a, b in zip(result["on"], result["off"]))
        print(f"capture overhead ratio (on/off): {on / off:.3f}  [{on:,.0f} vs {off:,.0f} prefill tok/s, {device}]")
        print(f"per-round ratios (round i on / round i off): min {pairs[0]:.3f}, median "
              f"{statistics.median(pairs):.3f}, max {pairs[-1]:.3f} over {len(pairs)} rounds")
        if args.probe_server and Path(args.probe_server).is_file():
            print("server prefill probe:", Path(args.probe_server).read_text())
        print(f"spool write ceiling: {ceiling['tok_s']:,} tok/s ({ceiling['gb_s']} GB/s, {ceiling['threads']} writer "
              f"threads, {spool}); capture-on can reach at most {min(1.0, ceiling['tok_s'] / off):.3f} of off")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(spool, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
