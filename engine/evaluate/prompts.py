"""Held-out evaluation prompts: each conversation up to its last assistant turn, rendered with the
target's chat template and the generation prompt (what a server would continue)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from engine.errors import EngineError


class PromptError(EngineError, ValueError):
    """No usable prompts; the message names the setting to fix."""


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    input_ids: list[int]


def prompt_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The turns before the last assistant turn (all turns when there is none)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    return list(messages if last is None else messages[:last])


def load_prompts(workspace, tokenizer, limit: int | None = None, max_new_tokens: int = 0) -> tuple[list[EvalPrompt], int]:
    """The first `limit` usable held-out prompts, and how many were skipped (empty or too long)."""
    from engine.dataset import DatasetError, iter_samples
    from engine.dataset.tokenize import prompt_ids

    cfg = workspace.config
    if not cfg.dataset.eval_path:
        raise PromptError("dataset.eval_path is not set: evaluation needs held-out prompts the drafter never "
                          "trained on. Set dataset.eval_path in console.toml to a JSONL file of conversations")
    path = workspace.path(cfg.dataset.eval_path)
    if not Path(path).is_file():
        raise PromptError(f"dataset.eval_path {path} does not exist: point it at the held-out JSONL file")
    limit = cfg.evaluate.num_prompts if limit is None else limit
    room = cfg.dataset.max_seq_len - max_new_tokens
    prompts: list[EvalPrompt] = []
    skipped = 0
    try:
        for sample in iter_samples(path, cfg.dataset.format, "skip"):
            if len(prompts) >= limit:
                break
            messages = prompt_messages(sample.messages)
            if not messages:
                skipped += 1
                continue
            ids = prompt_ids(tokenizer, messages)
            if not ids or len(ids) > room:
                skipped += 1
                continue
            prompts.append(EvalPrompt(sample.id, ids))
    except DatasetError as exc:
        raise PromptError(f"held-out prompts: {exc}") from None
    if not prompts:
        raise PromptError(f"{path} gave no usable prompt ({skipped} skipped: empty, or longer than "
                          f"dataset.max_seq_len {cfg.dataset.max_seq_len} minus evaluate.max_new_tokens "
                          f"{max_new_tokens})")
    return prompts, skipped
