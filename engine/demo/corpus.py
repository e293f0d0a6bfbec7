"""The bundled demo dataset: operations Q&A conversations generated from templates.

Every conversation is built in code from templates written for this project (GPU
memory, disks, servers, unit conversions, arithmetic, lists, throughput and a small
table of facts about the pipeline). Answers follow a fixed pattern given the
prompt, so a tiny target model can learn them and a drafter trained on its hidden
states gets measurable acceptance.

Output is OpenAI `messages` JSONL, one conversation per line:
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}

The split is deterministic: the same seed gives byte-identical files. No user-turn
sequence of the eval split appears in the train split.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.io import atomic

Message = dict[str, str]
Conversation = list[Message]

DEFAULT_SEED = 0
DEFAULT_N_TRAIN = 400
DEFAULT_N_EVAL = 40

SYSTEM_PROMPTS = (
    "You are an operations assistant for a GPU cluster. Answer briefly.",
    "You help engineers run speculative decoding pipelines. Be precise.",
    "Answer in one or two short sentences.",
)

HOSTS = tuple(f"{prefix}-{i}" for prefix in ("gpu", "node", "box") for i in range(1, 9))
MOUNTS = ("/data", "/scratch", "/mnt/nvme0", "/mnt/nvme1", "/home", "/models", "/hidden")
GPU_MODELS = (("H100", 80), ("H200", 141), ("A100", 80), ("L40S", 48), ("RTX 6000", 48))
STATUSES = ("healthy", "degraded", "down")

# (answer, paraphrases): each paraphrase is one prompt; the answer never varies.
FACTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "NCCL stands for NVIDIA Collective Communications Library.",
        ("What does NCCL stand for?", "Expand the acronym NCCL.", "What is NCCL short for?"),
    ),
    (
        "EAGLE-3 is a speculative decoding method: a small draft model proposes tokens and the target model verifies them.",
        ("What is EAGLE-3?", "Explain EAGLE-3 in one sentence.", "What does an EAGLE-3 drafter do?"),
    ),
    (
        "A bf16 value takes 2 bytes.",
        ("How many bytes does a bf16 value take?", "What is the size of one bf16 number?", "Bytes per bf16 element?"),
    ),
    (
        "A float32 value takes 4 bytes.",
        ("How many bytes does a float32 value take?", "What is the size of one float32 number?", "Bytes per fp32 element?"),
    ),
    (
        "The SGLang server listens on port 30000 by default.",
        ("Which port does SGLang use by default?", "What is the default SGLang port?", "Default port of the SGLang server?"),
    ),
    (
        "Turn the radix cache off, otherwise cached prefixes are not captured.",
        ("Should the radix cache be on during capture?", "Why disable the radix cache for extraction?", "Radix cache during hidden state capture?"),
    ),
    (
        "Acceptance length is the average number of tokens accepted per verification step.",
        ("What is acceptance length?", "Define acceptance length.", "What does acceptance length measure?"),
    ),
    (
        "Speedup is the decode throughput with speculation divided by the throughput without it.",
        ("How is speedup computed?", "What does speedup mean here?", "Define speedup for speculative decoding."),
    ),
    (
        "Tensor parallelism splits each layer's weights across several GPUs.",
        ("What is tensor parallelism?", "What does TP mean for serving?", "Explain tensor parallelism."),
    ),
    (
        "The KV cache stores attention keys and values of earlier tokens so they are not recomputed.",
        ("What is the KV cache?", "What does the KV cache store?", "Why keep a KV cache?"),
    ),
    (
        "A safetensors file holds tensors with a JSON header and raw little-endian data.",
        ("What is a safetensors file?", "Describe the safetensors format.", "What is inside a safetensors file?"),
    ),
    (
        "One GiB is 1024 MiB, while one GB is 1000 MB.",
        ("What is the difference between GiB and GB?", "Is a GiB the same as a GB?", "GiB versus GB?"),
    ),
    (
        "The draft model reads hidden states from three layers of the target model.",
        ("How many target layers does the drafter read?", "Which hidden states does an EAGLE-3 drafter use?", "What does the drafter take as input?"),
    ),
    (
        "Keep the old data until the new run is verified, then delete it.",
        ("When can I delete old hidden states?", "Should I delete the old run before extracting?", "Is it safe to remove old extraction output first?"),
    ),
    (
        "Check free disk space before extraction and keep a reserve.",
        ("What should I check before extraction?", "How do I avoid running out of disk?", "What is the first step before a long extraction?"),
    ),
)


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def _gpu_memory(rng: random.Random) -> Conversation:
    host = rng.choice(HOSTS)
    index = rng.randrange(8)
    name, total_gib = rng.choice(GPU_MODELS)
    used = rng.randrange(1, total_gib)
    free = total_gib - used
    pct = round(100 * used / total_gib)
    conv = [
        _user(f"GPU {index} on {host} is an {name} with {used} GiB of {total_gib} GiB used. How much memory is free?"),
        _assistant(f"GPU {index} on {host} has {free} GiB free ({pct}% used)."),
    ]
    if rng.random() < 0.4:
        need = rng.randrange(1, total_gib)
        verdict = "fits" if need <= free else "does not fit"
        conv += [
            _user(f"Will a {need} GiB model fit there?"),
            _assistant(f"A {need} GiB model {verdict} in {free} GiB free."),
        ]
    return conv


def _disk(rng: random.Random) -> Conversation:
    mount = rng.choice(MOUNTS)
    total = rng.randrange(2, 40) * 100
    used = rng.randrange(1, total // 100) * 100
    free = total - used
    need = rng.randrange(1, 30) * 100
    verdict = "fits" if need <= free else "does not fit"
    return [
        _user(f"Disk {mount} has {total} GB with {used} GB used. Can it hold a {need} GB extraction?"),
        _assistant(f"Free space on {mount} is {free} GB. A {need} GB extraction {verdict}."),
    ]


def _units(rng: random.Random) -> Conversation:
    n = rng.randrange(1, 65)
    big, small = rng.choice((("GiB", "MiB"), ("MiB", "KiB"), ("TiB", "GiB")))
    conv = [
        _user(f"Convert {n} {big} to {small}."),
        _assistant(f"{n} {big} = {n * 1024} {small}."),
    ]
    if small != "KiB" and rng.random() < 0.4:
        smaller = {"MiB": "KiB", "GiB": "MiB"}[small]
        conv += [
            _user(f"And in {smaller}?"),
            _assistant(f"{n} {big} = {n * 1024 * 1024} {smaller}."),
        ]
    return conv


def _arithmetic(rng: random.Random) -> Conversation:
    a, b = rng.randrange(2, 100), rng.randrange(2, 100)
    op = rng.choice(("+", "-", "*"))
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    conv = [_user(f"What is {a} {op} {b}?"), _assistant(f"{a} {op} {b} = {value}.")]
    if rng.random() < 0.4:
        k = rng.randrange(2, 10)
        conv += [_user(f"Now multiply that by {k}."), _assistant(f"{value} * {k} = {value * k}.")]
    return conv


def _lists(rng: random.Random) -> Conversation:
    kind = rng.randrange(3)
    if kind == 0:
        numbers = rng.sample(range(1, 100), rng.randrange(3, 7))
        shown = ", ".join(map(str, numbers))
        return [_user(f"Sort these numbers: {shown}."), _assistant(f"Sorted: {', '.join(map(str, sorted(numbers)))}.")]
    if kind == 1:
        start = rng.randrange(8)
        stop = rng.randrange(start + 1, 9)
        gpus = ", ".join(f"GPU {i}" for i in range(start, stop))
        return [_user(f"List GPUs {start} to {stop - 1}."), _assistant(f"{gpus}.")]
    hosts = rng.sample(HOSTS, rng.randrange(2, 6))
    return [
        _user(f"How many servers are in this list: {', '.join(hosts)}?"),
        _assistant(f"There are {len(hosts)} servers: {', '.join(hosts)}."),
    ]


def _server(rng: random.Random) -> Conversation:
    host = rng.choice(HOSTS)
    status = rng.choice(STATUSES)
    load = rng.randrange(0, 100) / 10
    hours = rng.randrange(1, 500)
    conv = [
        _user(f"Server {host} reports status {status}, load {load}, uptime {hours} hours. Summarize."),
        _assistant(f"{host}: {status}, load {load}, up {hours} h."),
    ]
    if rng.random() < 0.5:
        answer = f"No, {host} is healthy." if status == "healthy" else f"Yes, restart {host}: it is {status}."
        conv += [_user("Should I restart it?"), _assistant(answer)]
    return conv


def _throughput(rng: random.Random) -> Conversation:
    rate = rng.randrange(2, 40)
    minutes = rng.randrange(2, 60)
    samples = rate * minutes
    return [
        _user(f"Extraction runs at {rate} samples per minute. How long do {samples} samples take?"),
        _assistant(f"{samples} samples at {rate} per minute take {minutes} minutes."),
    ]


# Prefixes multiply the distinct prompts per fact, so each fixed answer is seen often
# enough for the tiny model to memorise it.
FACT_PREFIXES = ("", "Quick question: ", "Remind me: ", "Please answer: ", "One more thing. ")


def _fact(rng: random.Random) -> Conversation:
    answer, prompts = rng.choice(FACTS)
    return [_user(rng.choice(FACT_PREFIXES) + rng.choice(prompts)), _assistant(answer)]


# Weights decide the mix of the 440 conversations.
GENERATORS: tuple[tuple[Callable[[random.Random], Conversation], int], ...] = (
    (_gpu_memory, 3),
    (_disk, 2),
    (_units, 2),
    (_arithmetic, 3),
    (_lists, 2),
    (_server, 2),
    (_throughput, 1),
    (_fact, 5),
)


def _user_key(conv: Conversation) -> tuple[str, ...]:
    return tuple(m["content"] for m in conv if m["role"] == "user")


def generate_conversations(n: int, seed: int = DEFAULT_SEED) -> list[Conversation]:
    """`n` conversations whose user-turn sequences are all different, in a seeded order."""
    rng = random.Random(seed)
    funcs = [f for f, _ in GENERATORS]
    weights = [w for _, w in GENERATORS]
    seen: set[tuple[str, ...]] = set()
    out: list[Conversation] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > n * 50:
            raise RuntimeError(f"cannot generate {n} distinct demo conversations")
        conv = rng.choices(funcs, weights)[0](rng)
        key = _user_key(conv)
        if key in seen:
            continue
        seen.add(key)
        if rng.random() < 0.3:
            conv = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + conv
        out.append(conv)
    return out


def split_conversations(
    n_train: int = DEFAULT_N_TRAIN, n_eval: int = DEFAULT_N_EVAL, seed: int = DEFAULT_SEED
) -> tuple[list[Conversation], list[Conversation]]:
    """Train and eval splits; disjoint because every user-turn sequence is unique."""
    convs = generate_conversations(n_train + n_eval, seed)
    return convs[:n_train], convs[n_train:]


def to_jsonl(convs: list[Conversation]) -> str:
    return "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in convs)


@dataclass(frozen=True)
class DemoDatasetPaths:
    train: Path
    eval: Path
    n_train: int
    n_eval: int


def write_demo_dataset(
    data_dir: Path, *, n_train: int = DEFAULT_N_TRAIN, n_eval: int = DEFAULT_N_EVAL, seed: int = DEFAULT_SEED
) -> DemoDatasetPaths:
    """Write `<data_dir>/train.jsonl` and `<data_dir>/eval.jsonl` atomically."""
    data_dir = Path(data_dir)
    train, held_out = split_conversations(n_train, n_eval, seed)
    train_path, eval_path = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    atomic.write_text(train_path, to_jsonl(train))
    atomic.write_text(eval_path, to_jsonl(held_out))
    return DemoDatasetPaths(train=train_path, eval=eval_path, n_train=len(train), n_eval=len(held_out))


def read_conversations(path: Path) -> list[Conversation]:
    """Read a `messages` JSONL file; a malformed line raises ValueError naming the line."""
    convs: list[Conversation] = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a {{\"messages\": [...]}} JSON line ({exc})") from None
            convs.append(messages)
    return convs
