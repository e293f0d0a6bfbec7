"""What the extraction will send: every sample tokenised with the target's chat template."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlannedSample:
    index: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class Plan:
    samples: list[PlannedSample]
    dataset: str
    fingerprint: str  # dataset bytes + tokenizer + max_seq_len: a resumed run must match
    bad_lines: int
    truncated: int

    @property
    def total_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)


def _fingerprint(dataset: Path, model_dir: Path, max_seq_len: int) -> str:
    digest = hashlib.sha256()
    with open(dataset, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            digest.update(path.read_bytes())
    digest.update(str(max_seq_len).encode())
    return digest.hexdigest()[:16]


def build_plan(workspace, limit: int | None = None) -> Plan:
    from transformers import AutoTokenizer

    from engine.dataset import iter_samples, tokenize_conversation

    cfg = workspace.config
    dataset = workspace.path(cfg.dataset.path)
    tokenizer = AutoTokenizer.from_pretrained(str(workspace.model_dir), local_files_only=True)
    samples: list[PlannedSample] = []
    truncated = 0
    reader = iter_samples(dataset, cfg.dataset.format, cfg.dataset.on_bad_line)
    for sample in reader:
        tok = tokenize_conversation(tokenizer, sample.messages, cfg.dataset.max_seq_len)
        truncated += int(tok.truncated > 0)
        if not tok.input_ids:
            continue
        samples.append(PlannedSample(sample.index, sample.id, list(tok.input_ids), list(tok.loss_mask)))
        if limit is not None and len(samples) >= limit:
            break
    bad = int(getattr(reader, "bad_count", 0))
    return Plan(samples, str(dataset), _fingerprint(dataset, workspace.model_dir, cfg.dataset.max_seq_len), bad, truncated)
