"""End to end on one GPU with a real (home-made) language model, through the product's own jobs.

1. Train a ~80M-parameter, 16-layer Llama on Python source (the standard library, topped up with
   installed packages' code; evaluation on held-out standard-library files) for a fixed time budget,
   report its held-out loss, save it as a Hugging Face directory (BPE tokenizer + chat template).
2. Run the pipeline on it through the local backend on CUDA, exactly as a user would: workspace,
   server (capture on), capture probe, extraction job, drafter training job, evaluation job.
   Dataset: held-in files (prompt = first part of a file, response = its continuation);
   evaluation: held-out files.
3. Print one table: target loss, capture overhead ratio, extraction tok/s and MB/s, drafter
   training tok/s, acceptance length and per-position acceptance, decode tok/s with and without
   speculation, speedup. `eagle3-console status --json` is sampled during the jobs.

    python bench/gpu_end_to_end.py --out /tmp/e2e [--target-seconds 110] [--quick]

`--compare-online` (issue 25): after the offline drafter, a second drafter from the same dataset, steps,
seed and settings with `train.mode = "online"` (states captured from the running server into a window
of `--online-window-frac` of the offline records' bytes), its window directory sampled every ~50 ms;
then both drafters evaluated back to back with the server stopped, and one summary block
(bench/online_compare.py). To fit one call, `--skip-capture-overhead` and a shorter evaluation
(`--eval-rounds 1 --eval-concurrency 1 --eval-sweep ''`). Every phase's wall time is logged and kept
in results.json ("phases"). `--beside-capture` adds, before the online leg, the offline training again
while extraction jobs capture from the same server in their own process: what sharing the GPU and host
costs the trainer, apart from what its in-process producer costs.

On the lent device (10 minutes a call, 8 files back) the default 110 s of target training leaves
room for the answer regeneration and the evaluation; copy back only the log, results.json,
report.json and shots/*.svg. Job progress is logged as it comes and results.json is rewritten after
each phase, so a run cut by the limit shows how far it got; a job silent for 45 s gets its stacks
dumped into the log (SIGUSR1).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|code|>{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}<|prompt|>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|code|>{% endif %}"
)
SPECIALS = ["<|pad|>", "<|end|>", "<|prompt|>", "<|code|>"]


class Laps:
    """Wall time of each phase since the previous one, logged and kept in results["phases"]."""

    def __init__(self, results: dict, out: Path):
        self.results, self.out = results, out
        self.t0 = self.last = time.monotonic()
        results["phases"] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.results["phases"][name] = round(now - self.last, 1)
        self.results["phases"]["total"] = round(now - self.t0, 1)
        log(f"phase {name}: {now - self.last:.1f} s (total {now - self.t0:.1f} s)")
        self.last = now
        save_results(self.out, self.results)


def save_results(out: Path, results: dict) -> None:
    """After every phase: a run cut by the call's time limit still returns what it measured."""
    (out / "results.json").write_text(json.dumps(results, indent=2))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _read_py(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) >= 400 else None


def code_corpus(limit_bytes: int) -> tuple[list[str], list[str], dict]:
    """Held-in and held-out Python files. Held-out: 1 in 20 standard-library files (by name hash:
    stable, no file on both sides). Held-in: the other standard-library files, topped up to
    `limit_bytes` with the source of installed packages when the standard library alone is small
    (the device's held 533 files: a ~90M target memorised them in a minute). A package file that
    shares its name with a held-out file is skipped, so vendored copies cannot leak."""
    base = Path(sysconfig.get_paths()["stdlib"])
    held_in, held_out, names_out = [], [], set()
    stdlib_bytes = 0
    for path in sorted(p for p in base.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts):
        text = _read_py(path)
        if text is None:
            continue
        name = str(path.relative_to(base))
        stdlib_bytes += len(text)
        if int(hashlib.sha1(name.encode()).hexdigest(), 16) % 20 == 0:
            held_out.append(text)
            names_out.add(path.name)
        else:
            held_in.append(text)
    total = sum(map(len, held_in))
    extra_files = 0
    roots = sorted({Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()})
    for root in roots:
        if total >= limit_bytes:
            break
        for path in sorted(root.rglob("*.py")):
            if total >= limit_bytes:
                break
            if path.name in names_out or "test" in path.parts or "tests" in path.parts:
                continue
            text = _read_py(path)
            if text is None:
                continue
            held_in.append(text)
            total += len(text)
            extra_files += 1
    info = {"stdlib_files": len(held_in) - extra_files + len(held_out), "stdlib_mb": round(stdlib_bytes / 1e6, 1),
            "package_files": extra_files, "held_in_mb": round(total / 1e6, 1), "held_out_files": len(held_out)}
    return held_in, held_out, info


def build_tokenizer(texts: list[str], out: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   additional_special_tokens=["<|prompt|>", "<|code|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def train_target(tok, held_in: list[str], held_out: list[str], out: Path, seconds: float, quick: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    def flat(texts: list[str]) -> torch.Tensor:
        batches = tok(texts)["input_ids"]  # one call: the fast tokenizer spreads it over threads
        return torch.tensor([t for ids in batches for t in ids + [tok.eos_token_id]])

    ids, val = flat(held_in), flat(held_out)
    log(f"target corpus: {len(ids):,} held-in tokens, {len(val):,} held-out tokens")
    seq, batch = (128, 8) if quick else (512, 64)
    dims = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2} if quick else {"hidden_size": 640, "intermediate_size": 1728,
                                                     "num_hidden_layers": 16, "num_attention_heads": 10,
                                                     "num_key_value_heads": 2}
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                         rope_theta=10000.0, **dims)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if quick else 6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    started, step, tokens = time.time(), 0, 0
    model.train()
    while time.time() - started < seconds:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s:s + seq] for s in starts]).to(device)
        elapsed = time.time() - started
        frac = elapsed / seconds
        lr_scale = min(1.0, step / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = (1e-3 if quick else 6e-4) * lr_scale
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        if step % 200 == 0:
            log(f"target step {step} loss {loss.item():.3f} ({tokens / (time.time() - started):,.0f} tok/s)")
    model.eval()
    losses = []
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        for s in range(0, min(len(val) - seq - 1, seq * 64), seq):
            x = val[s:s + seq].unsqueeze(0).to(device)
            losses.append(model(input_ids=x, labels=x).loss.item())
    model.save_pretrained(out, safe_serialization=True)
    return {"params": params, "steps": step, "train_tokens": tokens, "train_seconds": round(time.time() - started, 1),
            "heldout_loss": round(sum(losses) / max(len(losses), 1), 3), "final_train_loss": round(loss.item(), 3)}


def write_dataset(tok, texts: list[str], path: Path, n: int, prompt_tokens: int, total_tokens: int, seed: int,
                  stride: int | None = None) -> int:
    """Up to n samples: windows of `total_tokens` every `stride` tokens of each file (default 3 windows
    apart), the prompt a random cut of the first `prompt_tokens`, the answer the rest of the window."""
    rng = random.Random(seed)
    stride = stride or total_tokens * 3
    rows = 0
    with open(path, "w") as handle:
        for text in texts:
            ids = tok(text)["input_ids"]
            if len(ids) < prompt_tokens + 32:
                continue
            for start in range(0, len(ids) - prompt_tokens - 32, stride):
                cut = start + rng.randint(prompt_tokens // 2, prompt_tokens)
                prompt = tok.decode(ids[start:cut])
                answer = tok.decode(ids[cut:start + total_tokens])
                handle.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                      {"role": "assistant", "content": answer}]}) + "\n")
                rows += 1
                if rows >= n:
                    return rows
    return rows


def regenerate_answers(model_dir: Path, tok, source: Path, dest: Path, max_new_tokens: int, batch: int) -> dict:
    """The seed's "synth" set: every answer rewritten by the target itself (greedy, batched, in
    process), so the drafter learns what it will be asked to predict at decode time. Written to a
    new file; the original dataset is kept."""
    import torch
    from transformers import AutoModelForCausalLM

    gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if gpu else torch.float32)
    model = model.to("cuda" if gpu else "cpu").eval()
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    tok.padding_side = "left"
    started, new_tokens = time.time(), 0
    with open(dest, "w") as handle:
        for first in range(0, len(rows), batch):
            chunk = rows[first:first + batch]
            prompts = [tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=False)
                       for r in chunk]
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            for row, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:].tolist()):
                if tok.eos_token_id in ids:
                    ids = ids[:ids.index(tok.eos_token_id)]
                new_tokens += len(ids)
                answer = tok.decode(ids)
                handle.write(json.dumps({"messages": [row["messages"][0],
                                                      {"role": "assistant", "content": answer}]}) + "\n")
    tok.padding_side = "right"
    seconds = time.time() - started
    del model
    if gpu:
        torch.cuda.empty_cache()
    return {"samples": len(rows), "new_tokens": new_tokens, "seconds": round(seconds, 1),
            "tok_s": round(new_tokens / max(seconds, 1e-9))}


def screenshot(ws_dir: Path, out: Path, tag: str) -> None:
    """The console itself, headless and read-only, at 160x50 (all six panes) while a job runs."""
    cmd = [sys.executable, "-m", "eagle3_console", "screenshot", "-w", str(ws_dir), str(out / "shots"),
           "--tabs", "pipeline", "--size", "160x50", "--settle", "4"]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        log(f"screenshot during {tag}: timed out")
        return
    shot = out / "shots" / "pipeline-160x50.svg"
    if proc.returncode == 0 and shot.exists():
        shot.rename(out / "shots" / f"console-{tag}-160x50.svg")
        log(f"screenshot during {tag}: {out / 'shots' / f'console-{tag}-160x50.svg'}")
    else:
        log(f"screenshot during {tag} failed: {proc.stderr.strip()[-300:]}")


def follow(jobs, job_id: str, status_cmd: list[str], out: Path, tag: str, ws_dir: Path | None = None,
           shot_after_s: float = 15.0) -> list[dict]:
    samples = 0
    started = time.monotonic()
    shot = ws_dir is None
    offset, last_progress = 0, 0.0
    last_event = time.monotonic()
    while True:
        info = jobs.get(job_id)
        # Progress lines as they come, so a run cut by the call's time limit still shows how far it got.
        fresh, offset = jobs.events(job_id, offset)
        if fresh:
            last_event = time.monotonic()
        elif info.state == "running" and time.monotonic() - last_event > 45:
            # Silent for 45 s: the job's stacks (`eagle3-console jobs stacks`) say where it is.
            jobs.dump_stacks(job_id)
            time.sleep(1.0)
            log(f"{tag} silent for {time.monotonic() - last_event:.0f} s; its log:\n  " + "\n  ".join(jobs.tail(job_id, 40)))
            last_event = time.monotonic()
        for event in fresh:
            kind = event.get("type")
            if kind == "progress" and tag != "evaluate" and time.monotonic() - last_progress < 15:
                continue  # extraction and training report many times a second: one line per 15 s
            if kind in ("progress", "loaded", "started", "phase"):
                last_progress = time.monotonic() if kind == "progress" else last_progress
                detail = {k: v for k, v in event.items() if k not in ("t", "type", "table")}
                log(f"{tag} {kind}: {json.dumps(detail)[:300]}")
        if samples < 3:
            t0 = time.monotonic()
            proc = subprocess.run(status_cmd, check=False, capture_output=True, text=True, timeout=60)
            (out / f"status_{tag}_{samples}.json").write_text(proc.stdout)
            samples += 1
            if time.monotonic() - t0 > 5:
                log(f"status --json took {time.monotonic() - t0:.1f} s")
        if not shot and info.state == "running" and time.monotonic() - started >= shot_after_s:
            screenshot(ws_dir, out, tag)
            shot = True
        if info.state not in ("starting", "running"):
            break
        time.sleep(2.0)
    events = jobs.events(job_id, 0)[0]
    if info.state != "succeeded":
        raise SystemExit(f"{tag} job {info.state}: " + "\n".join(jobs.tail(job_id, 30)))
    return events


def job_starter(kind: str):
    """The product's own starter of a job kind, the one the console and the CLI call."""
    try:  # engine/registry.py: the one table of stages and jobs
        from engine.registry import starter

        return starter(kind)
    except ImportError:  # before the registry left engine/jobs
        from engine.jobs.registry import STARTERS

        return STARTERS[kind]


def capture_loads(text: str) -> list[tuple[int, int]]:
    """"1x16,4x64" -> [(1, 16), (4, 64)]: client processes x requests in flight, per load."""
    loads = []
    for part in text.split(","):
        clients, _, in_flight = part.strip().partition("x")
        if not (clients.isdigit() and in_flight.isdigit() and int(clients) >= 1 and int(in_flight) >= int(clients)):
            raise argparse.ArgumentTypeError(f"{part!r}: give CLIENTSxIN_FLIGHT, e.g. 4x64 (in flight >= clients >= 1)")
        loads.append((int(clients), int(in_flight)))
    return loads


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/e2e")
    parser.add_argument("--target-seconds", type=float, default=110.0, help="target training budget (the call has 10 min)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--drafter-epochs", type=int, default=6)
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--eval-rounds", type=int, default=3, help="evaluate.rounds")
    parser.add_argument("--eval-concurrency", default="1,4,16", help="evaluate.concurrency, comma-separated")
    parser.add_argument("--eval-sweep", default="2,3,4", help="evaluate.sweep_steps, comma-separated ('' = none)")
    parser.add_argument("--corpus-mb", type=float, default=120.0, help="held-in code, topped up from packages")
    parser.add_argument("--sample-tokens", type=int, default=1024, help="tokens per drafter training sample")
    parser.add_argument("--capture-loads", type=capture_loads, default=capture_loads("1x16,4x64,8x64"),
                        help="capture-overhead loads, CLIENTSxIN_FLIGHT,...; the last is the headline")
    parser.add_argument("--regen-tokens", type=int, default=256,
                        help="answers regenerated by the target, this many tokens at most (0: keep the file's)")
    parser.add_argument("--skip-capture-overhead", action="store_true", help="no capture-overhead rounds")
    parser.add_argument("--compare-online", action="store_true",
                        help="also train a drafter with train.mode = online (same data, steps, seed) and compare")
    parser.add_argument("--beside-capture", action="store_true",
                        help="with --compare-online: the offline training again while extraction jobs capture from "
                             "the same server in their own process (tells GPU sharing from the in-process producer)")
    parser.add_argument("--compare-fp8", action="store_true",
                        help="also extract with extract.aux_format = fp8, train a drafter on it (same data, steps, "
                             "seed) and compare its acceptance with the bf16 one's (issue 22: a drop of at most 2 %%)")
    parser.add_argument("--online-window-frac", type=float, default=0.03,
                        help="online window (train.window_gb) as a fraction of the offline records' bytes")
    parser.add_argument("--port", type=int, default=30123, help="server.port")
    parser.add_argument("--spool-dir", default="/dev/shm/e2e-spool", help="extract.spool_dir")
    args = parser.parse_args()
    if not 0 < args.online_window_frac <= 1:
        parser.error("--online-window-frac must be in (0, 1]: the window is a share of the offline records' bytes")
    import torch

    from engine.config import set_value
    from engine.jobs.manager import JobManager
    from engine.server.manager import ServerManager
    from engine.workspace import init_workspace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    results: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "argv": sys.argv[1:]}
    laps = Laps(results, out)

    held_in, held_out, corpus = code_corpus(8_000_000 if args.quick else int(args.corpus_mb * 1e6))
    results["corpus"] = corpus
    log(f"corpus: {corpus}")
    laps.lap("imports_and_corpus")
    model_dir = out / "target"
    model_dir.mkdir(exist_ok=True)
    tok = build_tokenizer(held_in[:4000], model_dir, 1024 if args.quick else 8192)
    log("tokenizer trained")
    laps.lap("tokenizer")
    results["target"] = train_target(tok, held_in, held_out, model_dir, args.target_seconds, args.quick)
    log(f"target: {results['target']}")
    laps.lap("target_training")
    if gpu:
        torch.cuda.empty_cache()

    ws_dir = out / "ws"
    ws = init_workspace(ws_dir)
    # Standard-library files first, so the drafter learns from the same kind of code it is evaluated on.
    stdlib_in = held_in[:corpus["stdlib_files"] - corpus["held_out_files"]]
    random.Random(0).shuffle(stdlib_in)
    # Adjacent windows: ~3,000 samples from the standard library's 3M tokens.
    n_train = write_dataset(tok, stdlib_in, ws_dir / "train.jsonl", 200 if args.quick else args.samples, 192,
                            256 if args.quick else args.sample_tokens, 0, stride=args.sample_tokens)
    n_eval = write_dataset(tok, held_out, ws_dir / "eval.jsonl", args.eval_prompts, 192, 320, 1)
    train_file = "train.jsonl"
    if args.regen_tokens > 0:
        results["regeneration"] = regenerate_answers(model_dir, tok, ws_dir / "train.jsonl", ws_dir / "train_synth.jsonl",
                                                     64 if args.quick else args.regen_tokens, 32 if args.quick else 384)
        train_file = "train_synth.jsonl"
        log(f"answers regenerated by the target: {results['regeneration']}")
    laps.lap("datasets_and_regeneration")
    config = ws.config
    for key, value in {
        "model.path": str(model_dir), "server.device": "cuda" if gpu else "cpu",
        "model.dtype": "bfloat16" if gpu else "float32", "server.port": args.port, "dataset.path": train_file,
        "dataset.eval_path": "eval.jsonl", "dataset.max_seq_len": max(512, args.sample_tokens), "extract.spool_dir": args.spool_dir,
        "extract.disk_reserve_gb": 2.0, "extract.concurrency": 16, "train.max_len": max(512, args.sample_tokens),
        # 16 records a step: a step of this small drafter is launch-bound, so 16 cost little more than 1
        # (H200: 55 vs 41 ms, bench/training.py --shape e2e); 4 TTT steps for 3 draft steps at decode.
        "train.draft_vocab_size": 8192, "train.batch_size": 2 if args.quick else 16, "train.ttt_steps": 4,
        "train.epochs": 1 if args.quick else args.drafter_epochs, "train.learning_rate": 6e-4, "train.warmup_ratio": 0.05,
        "train.log_every": 20, "train.save_every": 200, "evaluate.num_prompts": args.eval_prompts, "evaluate.max_new_tokens": 128,
        "evaluate.spec_steps": 3, "evaluate.rounds": args.eval_rounds,
        "evaluate.concurrency": [int(x) for x in args.eval_concurrency.split(",")],
        "evaluate.sweep_steps": [int(x) for x in args.eval_sweep.split(",")] if args.eval_sweep else [],
    }.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    log(f"workspace {ws_dir}: {n_train} train samples, {n_eval} eval prompts")
    status_cmd = [sys.executable, "-m", "eagle3_console", "status", "--json", "-w", str(ws_dir)]

    manager = ServerManager(ws)
    asyncio.run(manager.start())
    from engine.checks.context import CheckContext
    from engine.pipeline import Pipeline

    pipeline = Pipeline(CheckContext(ws))
    for stage in ("model", "dataset", "server", "capture", "disk"):
        report = asyncio.run(pipeline.run_stage(stage))
        log(f"stage {stage}: {report.state.value}")
        if report.state.value == "failed":
            print(json.dumps(report.to_dict(), indent=2))
            raise SystemExit(1)
    probe = {r.name: r.evidence for r in pipeline.report("capture").results}
    results["capture_probe"] = probe.get("argmax")
    results["server_decode"] = {r.name: r.evidence for r in pipeline.report("server").results}.get("decode")
    laps.lap("server_and_stages")

    # Capture overhead: the same server, prefill-only requests with capture (rid) vs without.
    sys.path.insert(0, str(ROOT / "bench"))
    import statistics

    from capture_overhead import bench as overhead_bench
    from capture_overhead import cpu_summary, order_effect, ratio_verdict, round_ratios

    # Loads (--capture-loads) on the same server, each 10 alternating rounds a side of 384 prompts x 512
    # tokens. One Python client process tops out near ~300 requests/s of 512 ids (3-5 ms of its CPU each,
    # more when it also frees captured segments): with one client, the client sets both sides' pace and
    # the ratio says little about the server (H200: busiest client at 1.0-1.15 CPU s per wall s). Four
    # clients were flat out again on the uncaptured side at ~470k tok/s. The headline is the last load,
    # declared before it was measured (default: eight client processes, 64 in flight), so neither the
    # clients nor a captured reply's wait for its segment set the pace: it is the server's own prefill
    # throughput with capture against without.
    loads = args.capture_loads
    results["capture_overhead_loads"] = []

    def measure_load(clients: int, concurrency: int) -> dict:
        class A:  # the capture benchmark's knobs
            length, requests, rounds = 512, 384, 10
        A.clients, A.concurrency = clients, concurrency
        if args.quick:  # a CPU smoke run: the code path, not a figure
            A.requests, A.rounds, A.clients = 32, 2, min(clients, 2)
        name = f"{A.clients} client process{'es' if A.clients > 1 else ''}, {A.concurrency} in flight"
        ov = asyncio.run(overhead_bench(manager.record()["url"], ws.spool_dir, A, len(tok),
                                        server_pid=manager.job().pid))
        pairs = round_ratios(ov)
        load = {"load": name, "ratio": round(statistics.median(ov["on"]) / statistics.median(ov["off"]), 3),
                "on_tok_s": [round(x) for x in ov["on"]], "off_tok_s": [round(x) for x in ov["off"]],
                "round_ratios": pairs, "median_round_ratio": statistics.median(pairs),
                "verdict": ratio_verdict(pairs), "order_effect_tok_s": order_effect(ov), "cpu_per_side": cpu_summary(ov)}
        log(f"capture overhead, {name}: ratio of medians {load['ratio']} ({statistics.median(ov['on']):,.0f} vs "
            f"{statistics.median(ov['off']):,.0f} tok/s); round pairs median {load['median_round_ratio']}, "
            f"{min(pairs)}..{max(pairs)}; {load['verdict']}; CPU per side {load['cpu_per_side']}")
        return load

    if not args.skip_capture_overhead:
        for clients, concurrency in loads:
            results["capture_overhead_loads"].append(measure_load(clients, concurrency))
        results["capture_overhead"] = results["capture_overhead_loads"][-1]["ratio"]
        laps.lap("capture_overhead")
    import httpx

    # Whether the prefill-only batches replayed CUDA graphs (and which buckets), and who wrote the
    # segments (EAGLE3_CAPTURE_WRITER: the server's threads or its writer process), as the server says.
    info = httpx.get(manager.record()["url"] + "/server_info", timeout=30).json()
    results["prefill_cuda_graphs"] = info.get("prefill_cuda_graphs")
    results["capture_writer"] = (info.get("capture") or {}).get("writer")
    log(f"server prefill CUDA graphs: {results['prefill_cuda_graphs']}; segments written by "
        f"{results['capture_writer']}")
    save_results(out, results)

    jobs = JobManager(ws.jobs_dir)
    job = job_starter("extract")(ws, jobs)
    results["extraction"] = extraction_figures(follow(jobs, job.id, status_cmd, out, "extract", ws_dir))
    log(f"extraction {results['extraction']}")
    laps.lap("extraction")
    keep_server = args.compare_online or args.compare_fp8  # for their legs (idle while the offline drafter trains)
    if not keep_server:
        asyncio.run(manager.stop(grace=10))  # free the GPU for training and evaluation

    from online_compare import trainer_rate

    job = job_starter("train")(ws, jobs)
    follow(jobs, job.id, status_cmd, out, "train", ws_dir, shot_after_s=75.0)
    results["drafter_training"] = trainer_rate(ws.drafter_dir / "metrics.jsonl")
    log(f"drafter training {results['drafter_training']}")
    laps.lap("offline_training")

    online_error = None
    if args.compare_fp8:
        train_fp8(ws, jobs, status_cmd, out, results)
        laps.lap("fp8_extraction_and_training")
        if not args.compare_online:
            asyncio.run(manager.stop(grace=10))
    if args.compare_online and args.beside_capture:
        train_beside_capture(ws, jobs, status_cmd, out, results)
        laps.lap("training_beside_capture")
    if args.compare_online:
        online_error = train_online(ws, jobs, status_cmd, out, results, args.online_window_frac)
        laps.lap("online_training")
        asyncio.run(manager.stop(grace=10))  # both drafters evaluated alike: our server stopped
        laps.lap("server_stop")
        ws.save_config(set_value(set_value(ws.config, "train.run", "run1"), "evaluate.run", "run1"))

    report = evaluate(ws, jobs, status_cmd, out, "evaluate", "report.json")
    results["evaluation"] = report.get("overall")
    laps.lap("evaluation")
    if args.compare_online and online_error is None:
        ws.save_config(set_value(set_value(ws.config, "train.run", ONLINE_RUN), "evaluate.run", ONLINE_RUN))
        online_report = evaluate(ws, jobs, status_cmd, out, "evaluate_online", "report_online.json")
        results["online"]["evaluation"] = online_report.get("overall")
        laps.lap("online_evaluation")
        compare(results, report, online_report)
        results["comparison"]["drafters"] = drafters_apart(report, online_report)
    elif args.compare_online:
        log(f"online leg failed, no comparison: {online_error}")
    if args.compare_fp8:
        results["fp8"]["comparison"] = compare_fp8(ws, jobs, status_cmd, out, results, report)
        laps.lap("fp8_evaluation")
    save_results(out, results)
    print(json.dumps(results, indent=2))
    from drafter_diff import describe

    if args.compare_online and "comparison" in results:
        print(render_comparison(results["comparison"]))
        print(describe(**results["comparison"]["drafters"]))
    if args.compare_fp8:
        from fp8_compare import render

        print(render(results["fp8"]["comparison"]))
        print(describe(**results["fp8"]["comparison"]["drafters"]))
    return 0 if online_error is None else 1


ONLINE_RUN = "online1"  # train.run (and evaluate.run) of the online drafter; the offline one is run1
FP8_RUN = "fp8"  # extract.run, train.run and evaluate.run of the fp8 leg


def extraction_figures(events: list[dict]) -> dict:
    progress = [e for e in events if e["type"] == "progress"]
    finished = next(e for e in events if e["type"] == "finished")
    secs = finished["t"] - next(e for e in events if e["type"] == "started")["t"]
    return {"samples": finished["samples"], "tokens": finished["tokens"], "bytes": finished["bytes"],
            "seconds": round(secs, 1), "tok_s": round(finished["tokens"] / secs),
            "mb_s": round(finished["bytes"] / secs / 1e6, 1),
            "peak_tok_s": max((p.get("tokens_per_s") or 0) for p in progress) if progress else None}


def fp8_config(config, on: bool):
    """console.toml for the fp8 leg (on) or back to the bf16 run and drafter (off)."""
    from engine.config import set_value

    run = FP8_RUN if on else "run1"
    for key, value in {"extract.run": run, "extract.aux_format": "fp8" if on else "bf16", "train.run": run,
                       "evaluate.run": run}.items():
        config = set_value(config, key, value)
    return config


def train_fp8(ws, jobs, status_cmd: list[str], out: Path, results: dict) -> None:
    """The extraction again with extract.aux_format = fp8 into extract.run = FP8_RUN, then the same training
    job on it into train.run = FP8_RUN (same dataset, steps, seed)."""
    from online_compare import trainer_rate

    ws.save_config(fp8_config(ws.config, True))
    job = job_starter("extract")(ws, jobs)
    results["fp8"] = {"extraction": extraction_figures(follow(jobs, job.id, status_cmd, out, "extract_fp8"))}
    log(f"fp8 extraction {results['fp8']['extraction']}")
    job = job_starter("train")(ws, jobs)
    follow(jobs, job.id, status_cmd, out, "train_fp8")
    results["fp8"]["training"] = trainer_rate(ws.drafter_dir / "metrics.jsonl")
    log(f"fp8 drafter training {results['fp8']['training']}")
    ws.save_config(fp8_config(ws.config, False))
    save_results(out, results)


def compare_fp8(ws, jobs, status_cmd: list[str], out: Path, results: dict, bf16_report: dict) -> dict:
    """Evaluate the fp8 drafter as the bf16 one was; the two acceptance lengths against issue 22's 2 %."""
    from fp8_compare import summary
    from online_compare import acceptance_interval

    ws.save_config(fp8_config(ws.config, True))
    report = evaluate(ws, jobs, status_cmd, out, "evaluate_fp8", "report_fp8.json")
    ws.save_config(fp8_config(ws.config, False))
    results["fp8"]["evaluation"] = report.get("overall")
    block = summary(acceptance_interval(bf16_report.get("prompts") or []), acceptance_interval(report.get("prompts") or []),
                    results["extraction"], results["fp8"]["extraction"])
    block["drafters"] = drafters_apart(bf16_report, report)
    return block


def drafters_apart(report_a: dict, report_b: dict) -> dict:
    """Weights and accepted tokens of two evaluated drafters, side by side (bench/drafter_diff.py)."""
    from drafter_diff import prompt_difference, weight_difference

    drafter_a, drafter_b = report_a["drafter"], report_b["drafter"]
    return {"weights": weight_difference(drafter_a["path"], drafter_b["path"], drafter_a.get("weights", "model.safetensors")),
            "prompts": prompt_difference(report_a, report_b)}


def evaluate(ws, jobs, status_cmd: list[str], out: Path, tag: str, name: str) -> dict:
    """The evaluation job on the drafter train.run names; its report is copied to out/<name>."""
    job = job_starter("evaluate")(ws, jobs)
    events = follow(jobs, job.id, status_cmd, out, tag)
    final = next(e for e in events if e["type"] == "finished")
    report = json.loads((ws.eval_dir / "report.json").read_text())
    (out / name).write_text(json.dumps(report, indent=2))
    print(final.get("table", ""), flush=True)
    return report


def train_online(ws, jobs, status_cmd: list[str], out: Path, results: dict, window_frac: float) -> str | None:
    """The same training job with train.mode = "online" into train.run = ONLINE_RUN, the server up; the
    window directory sampled every ~50 ms meanwhile. None when it succeeded, else why not."""
    from online_compare import DirPeak, job_rate, trainer_rate

    from engine.config import set_value
    from engine.train.window import GB, window_budget, window_dir

    offline_bytes = results["extraction"]["bytes"]
    window_gb = max(0.0001, round(offline_bytes * window_frac / GB, 4))
    config = ws.config
    for key, value in {"train.mode": "online", "train.window_gb": window_gb, "train.run": ONLINE_RUN}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    budget, wdir = window_budget(ws.config), window_dir(ws)
    results["online"] = {"window_gb": window_gb, "window_budget": budget, "offline_records_bytes": offline_bytes,
                         "window_share": round(budget / offline_bytes, 4), "window_dir": str(wdir)}
    log(f"online training: window {budget:,} B = {budget / offline_bytes:.1%} of the offline records' "
        f"{offline_bytes:,} B, in {wdir}")
    sampler = DirPeak(wdir)
    sampler.start()
    error = None
    try:
        job = job_starter("train")(ws, jobs)
        events = follow(jobs, job.id, status_cmd, out, "train_online")
    except SystemExit as exc:  # the job failed: keep the offline figures, report why
        error, events = str(exc), []
    finally:
        results["online"]["window_sampled"] = sampler.stop()
    results["online"]["error"] = error
    if error is None:
        results["online"]["training"] = trainer_rate(ws.drafter_dir / "metrics.jsonl")
        results["online"]["job"] = job_rate(events)
        log(f"online training {results['online']['training']}; job {results['online']['job']}")
    log(f"online window sampled: {results['online']['window_sampled']} (budget {budget:,} B)")
    save_results(out, results)
    return error


BESIDE_RUN, SCRATCH_EXTRACT = "beside1", "scratch1"


def train_beside_capture(ws, jobs, status_cmd: list[str], out: Path, results: dict) -> None:
    """The offline training job again (train.run = BESIDE_RUN) while extraction jobs of the same dataset
    capture from the same server into a scratch run, one after another: the trainer's rate with the GPU
    and the host shared with capture, the capture in a process of its own. Beside the online rate, this
    tells what sharing costs from what the online producer (a thread of the trainer) costs."""
    from online_compare import trainer_rate

    from engine.config import set_value

    original = ws.config
    ws.save_config(set_value(original, "train.run", BESIDE_RUN))
    train = job_starter("train")(ws, jobs)
    live = ("starting", "running")
    # The job reads console.toml as it starts: switch the extraction run only once it has started.
    while jobs.get(train.id).state in live and not any(e.get("type") == "started" for e in jobs.events(train.id, 0)[0]):
        time.sleep(0.2)
    ws.save_config(set_value(ws.config, "extract.run", SCRATCH_EXTRACT))
    rounds, captured = 0, 0
    scratch, beside = ws.hidden_dir, ws.path(original.train.output_dir) / BESIDE_RUN
    while jobs.get(train.id).state in live:
        shutil.rmtree(scratch, ignore_errors=True)
        extract = job_starter("extract")(ws, jobs)
        while jobs.get(extract.id).state in live:
            time.sleep(0.2)
        events, _ = jobs.events(extract.id, 0)
        finished = next((e for e in events if e.get("type") == "finished"), None)
        if finished is None:
            log(f"scratch extraction {extract.id} ended without finishing: {jobs.tail(extract.id, 10)}")
            break
        rounds, captured = rounds + 1, captured + finished["tokens"]
    follow(jobs, train.id, status_cmd, out, "train_beside")
    shutil.rmtree(scratch, ignore_errors=True)
    ws.save_config(original)
    results["beside_capture"] = {**trainer_rate(beside / "metrics.jsonl"),
                                 "extraction_rounds": rounds, "tokens_captured": captured}
    log(f"offline training beside capture {results['beside_capture']}")
    save_results(out, results)


def compare(results: dict, offline_report: dict, online_report: dict) -> None:
    from online_compare import acceptance_interval, summary

    online = results["online"]
    block = summary(acceptance_interval(offline_report.get("prompts") or []),
                    acceptance_interval(online_report.get("prompts") or []),
                    results["extraction"]["tok_s"], results["drafter_training"]["tok_s"],
                    online["training"]["tok_s"], online["window_sampled"], online["window_budget"])
    # For reading the ratio: the extraction's best 15 s and the online job's own producer/consumer medians.
    block["rates"]["capture_peak_tok_s"] = results["extraction"].get("peak_tok_s")
    block["rates"]["online_job"] = online.get("job")
    block["speedup_interval"] = {side: (r.get("measurement") or {}).get("speedup")
                                 for side, r in (("offline", offline_report), ("online", online_report))}
    results["comparison"] = block


def render_comparison(block: dict) -> str:
    from online_compare import render

    return render(block)


if __name__ == "__main__":
    sys.exit(main())
