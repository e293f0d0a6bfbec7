"""Tokenising conversations with the target's own chat template, with an assistant-token mask.

The template is the one the server uses, so the token ids we train on are the ids the
target sees in serving. `loss_mask` is 1 on tokens the assistant produces.

Two ways to find those tokens:

* "generation" — the template marks assistant output with `{% generation %}`; transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)` reports the tokens inside.
* "prefix-diff" — any other template. For each assistant turn i we render the prompt up
  to it (`messages[:i]`, add_generation_prompt=True) and the conversation through it
  (`messages[:i+1]`). When the full rendering starts with both, the characters between
  their ends are what the assistant writes (content plus the end-of-turn marker; trailing
  whitespace the template adds after the marker is left out). Templates that rewrite
  earlier turns (e.g. dropping old reasoning) break the prefix property; then the turn's
  content is searched for in the rendering after the previous turn. Tokens overlapping
  the character spans (offset mapping of a fast tokenizer) get mask 1.

Both ways tokenise the rendered text once, in batches, through the fast tokenizer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence
from engine.errors import EngineError

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# transformers logs "Token indices sequence length is longer than the specified maximum sequence
# length" for any sample past model_max_length; we cut to max_seq_len ourselves and report it.
_QUIET = {"verbose": False}


class TokenizerError(EngineError):
    """The tokenizer or its chat template cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: list[int]  # cut to max_seq_len
    loss_mask: list[int]  # same length; 1 on assistant tokens
    full_length: int  # tokens before truncation
    truncated: int  # tokens cut off (full_length - len(input_ids))

    @property
    def trainable(self) -> int:
        return sum(self.loss_mask)


def load_tokenizer(model_dir: Path | str):
    """AutoTokenizer from the model directory (never the network); it must be fast and have a template."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken directory
        raise TokenizerError(f"cannot load the tokenizer from {model_dir} ({type(exc).__name__}: {exc}); "
                             "fix the `model` stage first") from None
    if not getattr(tok, "is_fast", False):
        raise TokenizerError(f"the tokenizer in {model_dir} is not a fast tokenizer (no tokenizer.json); "
                             "the assistant mask needs character offsets: add tokenizer.json")
    if not getattr(tok, "chat_template", None):
        raise TokenizerError(f"the tokenizer in {model_dir} has no chat template; add the serving template "
                             "(tokenizer_config.json 'chat_template') so training data matches serving")
    return tok


def mask_method(tokenizer) -> str:
    template = tokenizer.get_chat_template() if hasattr(tokenizer, "get_chat_template") else tokenizer.chat_template
    return "generation" if GENERATION_TAG.search(str(template or "")) else "prefix-diff"


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_token_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    """One conversation rendered and tokenised by the chat template, as plain ids."""
    rendered: object = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(rendered, Mapping):  # newer transformers return a BatchEncoding
        rendered = rendered["input_ids"]
    if not isinstance(rendered, list):
        raise TypeError(f"the chat template gave {type(rendered).__name__}, not a list of token ids")
    return [int(i) for i in rendered]


def assistant_spans(tokenizer, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Character spans of `text` (the full rendering) that the assistant writes (prefix-diff)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content = message["content"]
        prompt = _render(tokenizer, messages[:i], True) if i else ""
        through = _render(tokenizer, messages[: i + 1], False)
        if i and text.startswith(prompt) and text.startswith(through) and len(through) >= len(prompt) + len(content):
            start, end = len(prompt), len(through)
            while end > start + len(content) and text[end - 1].isspace():
                end -= 1
        else:
            found = text.find(content, cursor) if content else -1
            if found < 0:
                continue  # cannot place this turn: it stays unmasked (counted as no trainable token)
            start, end = found, found + len(content)
        if end > start:
            spans.append((start, end))
            cursor = end
    return spans


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    span = 0
    for t, (lo, hi) in enumerate(offsets):
        while span < len(spans) and lo >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if hi > spans[span][0] and hi > lo:
            mask[t] = 1
    return mask


def _cut(ids: list[int], mask: list[int], max_seq_len: int) -> TokenizedSample:
    full = len(ids)
    keep = min(full, max_seq_len)
    return TokenizedSample(list(ids[:keep]), [int(m) for m in mask[:keep]], full, full - keep)


def tokenize_batch(tokenizer, conversations: list[list[dict[str, str]]], max_seq_len: int,
                   method: str | None = None) -> list[TokenizedSample]:
    """Tokenise many conversations at once (one fast-tokenizer call per batch)."""
    if not conversations:
        return []
    method = method or mask_method(tokenizer)
    if method == "generation":
        out: Any = tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True, tokenizer_kwargs=_QUIET)
        return [_cut(ids, mask, max_seq_len) for ids, mask in zip(out["input_ids"], out["assistant_masks"])]
    texts = [_render(tokenizer, conv, False) for conv in conversations]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, **_QUIET)
    results = []
    for conv, text, ids, offsets in zip(conversations, texts, enc["input_ids"], enc["offset_mapping"]):
        mask = _mask_from_offsets(offsets, assistant_spans(tokenizer, conv, text))
        results.append(_cut(ids, mask, max_seq_len))
    return results


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_seq_len: int) -> TokenizedSample:
    """One conversation -> input_ids and loss_mask (1 on assistant tokens), cut to max_seq_len."""
    return tokenize_batch(tokenizer, [messages], max_seq_len)[0]


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered with the generation prompt (what the server continues)."""
    text = _render(tokenizer, messages, True)
    return list(tokenizer(text, add_special_tokens=False, **_QUIET)["input_ids"])
