"""Shared pytest fixtures.

`tiny_model_dir`: a real (randomly initialised) Llama checkpoint with a real byte-level BPE
tokenizer, saved with save_pretrained so any code path that loads a HF directory can use it.
Other helpers may append fixtures below.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

TINY_CORPUS = [
    "The capital city of France is Paris.",
    "EAGLE-3 drafts tokens from the target model's hidden states.",
    "Speculative decoding verifies several draft tokens in one forward pass.",
    "A small model makes the whole pipeline run on a laptop.",
    "hello world, hello tokens, hello hidden states",
    "0123456789 + - * / = ( ) [ ] { } < > ; : ' \" ? !",
]


def build_tiny_model(target: Path, seed: int = 0) -> Path:
    """Write a 4-layer Llama (hidden 64) and a tiny BPE tokenizer into `target`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(target)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default init so greedy decoding is not a constant token (makes tests meaningful).
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
        # Special tokens get logit 0 while ~300 random logits spread around 0: greedy decoding
        # practically never emits EOS, so generations reach max_new_tokens (stop is tested
        # through stop_token_ids).
        model.lm_head.weight[[fast.bos_token_id, fast.eos_token_id, fast.pad_token_id]] = 0.0
    model.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + BPE tokenizer directory, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}</s>{% endgeneration %}{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model plus a chat template with {% generation %} (for datasets, probes, extraction)."""
    import json
    import shutil

    target = tmp_path_factory.mktemp("tiny_chat") / "m"
    shutil.copytree(tiny_model_dir, target)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return target


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_server_argv(model_dir: Path, port: int, *extra: str, device: str = "cpu",
                      dtype: str = "float32") -> list[str]:
    """The local target server's command line on 127.0.0.1 (for tests that start it as a process)."""
    import sys

    return [sys.executable, "-m", "engine.localserver", "--model-path", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--device", device, "--dtype", dtype, *extra]


def make_workspace(root: Path, model_dir: Path, **changes):
    """A real workspace on `model_dir` with a free port, CPU device and a private spool."""
    from engine.config import set_value
    from engine.workspace import init_workspace

    ws = init_workspace(root)
    config = ws.config
    defaults = {"model.path": str(model_dir), "server.port": free_port(), "server.device": "cpu",
                "server.startup_timeout_s": 60.0, "extract.spool_dir": str(root / "spool"),
                "extract.disk_reserve_gb": 0.0, "extract.spool_reserve_gb": 0.0}
    for key, value in {**defaults, **changes}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    return ws


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """n small OpenAI-format conversations with varied lengths."""
    import json
    import random

    rng = random.Random(seed)
    words = ["gpu", "disk", "server", "token", "hello", "world", "capture", "layer", "draft", "speed"]
    with open(path, "w") as handle:
        for i in range(n):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))
            handle.write(json.dumps({"id": f"c{i:03d}", "messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def wait_healthy(proc, url: str, log: Path, timeout: float = 40.0) -> None:
    """Wait for a started server process to answer /health; fail with its log if it dies or stalls."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server not healthy within {timeout:.0f} s: {log.read_text()}")
        time.sleep(0.2)


def stop_process(proc, grace: float = 10.0) -> None:
    """SIGTERM a test's server process, SIGKILL it if it has not exited after `grace` seconds."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def screen_lines(app) -> list[str]:
    """The screen as plain text lines, rebuilt from the SVG screenshot (what a user sees)."""
    import html
    import re

    svg = app.export_screenshot()
    rows: dict[float, list[tuple[float, str]]] = {}
    for x, y, text in re.findall(r'<text [^>]*x="([\d.]+)" y="([\d.]+)"[^>]*>([^<]*)</text>', svg):
        rows.setdefault(float(y), []).append((float(x), html.unescape(text).replace("\xa0", " ")))
    lines = []
    for y in sorted(rows):
        line = ""
        for x, text in sorted(rows[y]):
            col = round(x / 12.2)
            line = line.ljust(col) + text
        lines.append(line)
    return lines


def screen_text(app) -> str:
    return "\n".join(screen_lines(app))


@contextlib.contextmanager
def lock_held_by_another_process(directory: Path, name: str):
    """A real second process holding the flock `directory/name` (as a concurrent job would);
    yields its pid and kills it on exit."""
    code = ("import sys, time; from pathlib import Path; from engine.workspace import WorkspaceLock; "
            "lock = WorkspaceLock(Path(sys.argv[1]), sys.argv[2]); assert lock.acquire(); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory), name], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


# SGLang 0.5.23's own code for the tests that hand it our artifacts (tests/sglang_judge/).
from sglang_judge.wheel import sglang_cache, sglang_importable, sglang_src, sglang_wheel  # noqa: E402,F401
