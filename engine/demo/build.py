"""Build the demo target: a byte-level BPE tokenizer and a tiny Llama, trained on CPU.

Everything happens in a temporary directory next to the destination, which is renamed
into place only when the model, tokenizer and configs are all written: an interrupted
build never leaves a directory that looks like a complete model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from engine.io import atomic
from engine.demo.corpus import read_conversations

Progress = Callable[[str], None]

BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS) + ROLE_TOKENS  # ids 0..5, in this order

# No newlines between turns: special tokens split the text, so a prompt rendered with
# add_generation_prompt tokenizes to an exact prefix of the full conversation.
# `{% generation %}` marks the assistant content and its closing <|end|> (the model must
# learn to stop), which is what return_assistant_tokens_mask reports as loss tokens.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown role ' ~ message['role'] ~ ': use system, user or assistant') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- else -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

VOCAB_SIZE = 1024
NUM_LAYERS = 16  # capture layers [1, 7, 12]; deep enough that one drafter layer is cheap next to a
# target step (with 8, speculation did not pay on a CPU: engine/demo/__init__.py)
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 384
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 2048

DEFAULT_STEPS = 260
BATCH_SIZE = 8
BLOCK_LEN = 128
PEAK_LR = 3e-3
WARMUP_STEPS = 20
# Bitwise-identical weights need a fixed thread count (CPU matmul reductions are split
# by thread). One thread: the same bytes whatever the core count, and no OpenMP spinning
# on a busy machine, where two threads that wait on each other run slower than one.
TRAIN_THREADS = 1


def _train_threads() -> int:
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(TRAIN_THREADS, available))


@dataclass(frozen=True)
class DemoModelInfo:
    path: Path
    num_layers: int
    hidden_size: int
    vocab_size: int
    final_loss: float
    seconds: float
    initial_loss: float = float("nan")
    steps: int = 0


def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)


def train_tokenizer(conversations: list[list[dict[str, str]]], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE trained on the message contents, wrapped as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single digits: a number in the prompt and the same number in the answer are the
    # same tokens, so the tiny model can learn to copy them.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    contents = [m["content"] for conv in conversations for m in conv]
    tok.train_from_iterator(contents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def _token_stream(conversations: list[list[dict[str, str]]], tokenizer):
    """All conversations packed into one id stream, and labels that keep assistant tokens only."""
    import torch

    ids: list[int] = []
    labels: list[int] = []
    for conv in conversations:
        out = tokenizer.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids.extend(out["input_ids"])
        labels.extend(t if m else -100 for t, m in zip(out["input_ids"], out["assistant_masks"]))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def _lr_at(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@contextlib.contextmanager
def _deterministic_torch(threads: int) -> Iterator[None]:
    """Fixed thread count, deterministic kernels and a private RNG, all restored afterwards."""
    import torch

    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def _train(model, stream, labels, steps: int, seed: int, progress: Progress | None) -> tuple[float, float]:
    """AdamW on random fixed-length windows of the packed corpus; returns (first, last) loss."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.01)
    max_start = len(stream) - BLOCK_LEN
    if max_start <= 0:
        raise ValueError("demo corpus is too small to train on: add conversations to the train file")
    model.train()
    first = last = float("nan")
    ema = None
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps)
        starts = torch.randint(0, max_start, (BATCH_SIZE,), generator=gen)
        batch = torch.stack([stream[s : s + BLOCK_LEN] for s in starts.tolist()])
        target = torch.stack([labels[s : s + BLOCK_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=target).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()
        if step == 0:
            first = value
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        last = ema
        if progress is not None and (step % 25 == 0 or step == steps - 1):
            progress(f"training demo target: step {step + 1}/{steps}, loss {value:.3f}")
    return first, last


def _write_model(
    out_dir: Path, corpus_train: Path, seed: int, steps: int, progress: Progress | None
) -> tuple[int, float, float]:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    conversations = read_conversations(corpus_train)
    if not conversations:
        raise ValueError(f"{corpus_train} has no conversations: write the demo dataset first")
    _say(progress, f"training tokenizer on {len(conversations)} conversations")
    tokenizer = train_tokenizer(conversations)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    vocab_size = len(tokenizer)
    stream, labels = _token_stream(conversations, tokenizer)
    _say(progress, f"tokenizer: {vocab_size} tokens; corpus: {len(stream)} tokens")

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",  # its name since transformers 4.56 (torch_dtype is deprecated); older ones keep it as an attribute
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    first, last = _train(model, stream, labels, steps, seed, progress)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # init prints its own progress lines; a tqdm bar would garble them
    model.save_pretrained(out_dir, safe_serialization=True)
    _make_portable(out_dir)
    return vocab_size, first, last


def _make_portable(out_dir: Path) -> None:
    """Also spell the configs the transformers 4.x way (SGLang environments pin 4.x).

    transformers 5 writes `dtype`, `rope_parameters`, `tokenizer_class: TokenizersBackend`
    and a list under `extra_special_tokens`; 4.x reads `torch_dtype`, `rope_theta`,
    `PreTrainedTokenizerFast` and `additional_special_tokens`. Both read the result.
    """
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    atomic.write_json(config_path, config)

    tok_path = out_dir / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok.pop("backend", None)
    extra = tok.pop("extra_special_tokens", None)
    tok["additional_special_tokens"] = list(extra) if isinstance(extra, list) else list(ROLE_TOKENS)
    atomic.write_json(tok_path, tok)


def _make_readable(directory: Path) -> None:
    """mkdtemp and some writers create owner-only modes; a model dir is shared like any other."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)


def build_demo_model(
    model_dir: Path,
    corpus_train: Path,
    *,
    seed: int = 0,
    steps: int | None = None,
    progress: Progress | None = None,
) -> DemoModelInfo:
    """Train tokenizer + tiny Llama on `corpus_train` and save a HF model dir at `model_dir`.

    `model_dir` must not exist yet; it appears (by rename) only once complete.
    """
    model_dir = Path(model_dir)
    if model_dir.exists():
        raise FileExistsError(f"{model_dir} already exists: choose another directory or move it away")
    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.partial-", dir=model_dir.parent))
    try:
        threads = _train_threads()
        with _deterministic_torch(threads):
            vocab_size, first, last = _write_model(tmp, corpus_train, seed, steps, progress)
        seconds = time.monotonic() - started
        info = {
            "what": "eagle3-console demo target (tiny Llama trained on the bundled demo corpus)",
            "seed": seed,
            "steps": steps,
            "threads": threads,
            "initial_loss": round(first, 4),
            "final_loss": round(last, 4),
        }
        atomic.write_json(tmp / "demo_info.json", info)
        _make_readable(tmp)
        os.rename(tmp, model_dir)  # fails if model_dir appeared meanwhile: never overwrite
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"demo target ready in {seconds:.1f} s (loss {first:.2f} -> {last:.2f})")
    return DemoModelInfo(
        path=model_dir,
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN_SIZE,
        vocab_size=vocab_size,
        final_loss=last,
        seconds=seconds,
        initial_loss=first,
        steps=steps,
    )


def read_demo_model_info(model_dir: Path) -> DemoModelInfo:
    """Describe an already built demo model from its config.json and demo_info.json."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    info = json.loads((model_dir / "demo_info.json").read_text(encoding="utf-8"))
    return DemoModelInfo(
        path=model_dir,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        final_loss=info["final_loss"],
        seconds=0.0,
        initial_loss=info["initial_loss"],
        steps=info["steps"],
    )
