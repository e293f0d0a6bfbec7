"""Demo content for `eagle3-console init --demo DIR`: a tiny local target model and data.

Everything is generated offline, on CPU, deterministically, in about a minute:

* **Dataset** (`<ws>/data/train.jsonl`, `<ws>/data/eval.jsonl`): 400 train and 40
  held-out eval conversations in OpenAI `messages` JSONL, generated from templates
  written for this project: GPU memory, disk space, server status, unit conversions
  (GiB/MiB/KiB), arithmetic, lists, extraction throughput and a small table of facts
  about speculative decoding (15 facts, each asked in many phrasings). About a fifth
  are multi-turn (follow-up questions), a quarter carry a system prompt. No eval
  user-turn sequence appears in train.

* **Target model** (`<ws>/models/demo-target/`): a standard Hugging Face directory
  (config.json, model.safetensors in float32, generation_config.json, tokenizer.json,
  tokenizer_config.json with the chat template). `LlamaForCausalLM` with 16 decoder
  layers, hidden size 128, 4 attention heads (2 KV heads, head dim 32), SwiGLU MLP 384,
  untied embeddings, 2048 positions, ~3.4 M parameters. Default EAGLE-3 capture layers
  [1, L//2-1, L-4] = [1, 7, 12] (SGLang layers_to_capture [2, 8, 13]). 16 layers rather than 8 so one
  drafter layer is cheap next to a target step, as it is for real targets: with 8, a drafter step
  cost too much of a target step on the lean runner for speculation to pay on a CPU.

* **Tokenizer**: byte-level BPE trained on the corpus (~950 tokens: the corpus is small,
  so every word of it ends up as one token; digits are split one per token). Special tokens `<|pad|>`,
  `<|begin|>` (bos), `<|end|>` (eos, closes every turn), `<|system|>`, `<|user|>`,
  `<|assistant|>`. The chat template marks assistant content plus its `<|end|>` with
  `{% generation %}`, so `return_assistant_tokens_mask=True` yields the loss mask.

* **Training**: AdamW (lr 3e-3, warm-up then cosine), 260 steps of 8 windows of 128
  tokens drawn from the packed train conversations, loss on assistant tokens only,
  seed 0, one CPU thread (about a minute on an idle core).
  The assistant-token loss falls from ~6.9 (uniform over the vocabulary) to ~0.8.
  The model has learned the answer templates, part of the facts (some verbatim), and
  the vocabulary of the tool; it has not learned arithmetic and copies numbers from
  the prompt only sometimes. Its answers follow fixed patterns, which is what a
  drafter needs to reach a measurable acceptance length; they are often not correct.

Same seed and steps on the same kind of CPU give byte-identical model.safetensors.
config.json and tokenizer_config.json carry both the transformers 5 and 4.x spellings.
head_dim is 32: on SGLang GPUs pick an attention backend that supports it (triton).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.demo.build import (
    DemoModelInfo,
    Progress,
    build_demo_model,
    read_demo_model_info,
)
from engine.demo.corpus import (
    DemoDatasetPaths,
    read_conversations,
    split_conversations,
    to_jsonl,
    write_demo_dataset,
)
from engine.io import atomic

DEMO_MODEL_NAME = "demo-target"

__all__ = [
    "DEMO_MODEL_NAME",
    "DemoContent",
    "DemoDatasetPaths",
    "DemoModelInfo",
    "build_demo_model",
    "create_demo_content",
    "read_demo_model_info",
    "write_demo_dataset",
]


@dataclass(frozen=True)
class DemoContent:
    dataset: DemoDatasetPaths
    model: DemoModelInfo
    dataset_reused: bool  # files were already there and were left untouched
    model_reused: bool


def _ensure_dataset(data_dir: Path) -> tuple[DemoDatasetPaths, bool]:
    """Write the demo files that are missing; existing files are kept as they are."""
    train_path, eval_path = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    if not train_path.exists() and not eval_path.exists():
        return write_demo_dataset(data_dir), False
    train, held_out = split_conversations()
    for path, convs in ((train_path, train), (eval_path, held_out)):
        if not path.exists():
            atomic.write_text(path, to_jsonl(convs))
    paths = DemoDatasetPaths(
        train=train_path,
        eval=eval_path,
        n_train=len(read_conversations(train_path)),
        n_eval=len(read_conversations(eval_path)),
    )
    return paths, True


def _existing_model(model_dir: Path) -> DemoModelInfo | None:
    if not model_dir.exists():
        return None
    needed = ("config.json", "model.safetensors", "tokenizer.json", "demo_info.json")
    missing = [name for name in needed if not (model_dir / name).is_file()]
    if missing:
        raise FileExistsError(
            f"{model_dir} exists but is not a complete demo model (missing {', '.join(missing)}): "
            "move it away and run init --demo again"
        )
    return read_demo_model_info(model_dir)


def create_demo_content(ws_dir: Path, progress: Progress | None = None, *, seed: int = 0) -> DemoContent:
    """Create `<ws>/data/{train,eval}.jsonl` and `<ws>/models/demo-target/`.

    Re-running is safe: content already present is reused, never overwritten.
    """
    ws_dir = Path(ws_dir)
    dataset, dataset_reused = _ensure_dataset(ws_dir / "data")
    if progress is not None:
        verb = "kept" if dataset_reused else "wrote"
        progress(f"{verb} demo dataset: {dataset.n_train} train, {dataset.n_eval} eval conversations")
    model_dir = ws_dir / "models" / DEMO_MODEL_NAME
    model = _existing_model(model_dir)
    model_reused = model is not None
    if model is None:
        model = build_demo_model(model_dir, dataset.train, seed=seed, progress=progress)
    elif progress is not None:
        progress(f"kept demo target at {model_dir}")
    return DemoContent(dataset=dataset, model=model, dataset_reused=dataset_reused, model_reused=model_reused)
