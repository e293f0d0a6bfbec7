"""Dataset statistics: counts, token lengths, truncation, assistant tokens, bad lines.

`compute_stats` streams a file through the parser and the tokenizer in batches bounded in
samples and in characters (memory stays bounded whatever the file: the reader caps a line);
`histogram_text` renders the power-of-two length histogram for evidence and the UI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.dataset.formats import DatasetReader
from engine.dataset.tokenize import mask_method, tokenize_batch

BATCH = 256  # samples per tokenizer call
# ...and at most this many characters of message text per call (one longer sample goes alone):
# tokenising costs hundreds of bytes of memory per character, so 256 long samples at once
# would need far more than any one of them.
BATCH_CHARS = 2 << 20  # the reader's per-line cap (MAX_LINE_BYTES)
SHOW_NO_TRAINABLE = 10
UNLIMITED = 1 << 62  # ids of samples without a trainable token kept in the stats


def length_bucket(length: int) -> int:
    """Lower bound of the power-of-two bucket [2^k, 2^(k+1)) holding `length` (0 for empty)."""
    return 0 if length <= 0 else 1 << (length.bit_length() - 1)


@dataclass
class DatasetStats:
    file: str
    format: str = ""
    mask_method: str = ""
    max_seq_len: int = 0
    samples: int = 0
    total_tokens: int = 0
    total_tokens_after_truncation: int = 0
    trainable_tokens: int = 0  # after truncation (what training sees)
    trainable_tokens_before_truncation: int = 0
    over_max_len: int = 0
    truncated_tokens: int = 0
    longest: int = 0
    no_trainable: int = 0
    no_trainable_ids: list[str] = field(default_factory=list)
    histogram: dict[int, int] = field(default_factory=dict)  # bucket lower bound -> samples
    parse: dict[str, Any] = field(default_factory=dict)  # ParseReport.to_dict()
    seconds: float = 0.0

    @property
    def bad_count(self) -> int:
        return int(self.parse.get("bad_count", 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file, "format": self.format, "mask_method": self.mask_method,
            "max_seq_len": self.max_seq_len, "samples": self.samples, "total_tokens": self.total_tokens,
            "total_tokens_after_truncation": self.total_tokens_after_truncation,
            "trainable_tokens": self.trainable_tokens,
            "trainable_tokens_before_truncation": self.trainable_tokens_before_truncation,
            "over_max_len": self.over_max_len, "truncated_tokens": self.truncated_tokens, "longest": self.longest,
            "no_trainable": self.no_trainable, "no_trainable_ids": list(self.no_trainable_ids),
            "histogram": [{"from": lo, "to": lo * 2 - 1 if lo else 0, "samples": n}
                          for lo, n in sorted(self.histogram.items())],
            "bad_lines": {"count": self.bad_count, "first": self.parse.get("bad_lines", [])},
            "derived_ids": self.parse.get("derived_ids", {}), "seconds": round(self.seconds, 3),
        }


def compute_stats(path: Path | str, tokenizer, max_seq_len: int, format: str = "auto",
                  on_bad_line: str = "skip", progress: Callable[[int], None] | None = None) -> DatasetStats:
    """Parse and tokenise the whole file. Raises DatasetError (missing file, mixed formats, stop)."""
    started = time.monotonic()
    reader = DatasetReader(path, format, on_bad_line)
    method = mask_method(tokenizer)
    stats = DatasetStats(file=str(path), mask_method=method, max_seq_len=max_seq_len)
    pending: list = []
    pending_chars = 0

    def flush() -> None:
        nonlocal pending_chars
        # Tokenised uncut once; truncation is a slice, so both before/after counts are exact.
        tokenized = tokenize_batch(tokenizer, [s.messages for s in pending], UNLIMITED, method)
        for sample, tok in zip(pending, tokenized):
            kept = min(tok.full_length, max_seq_len)
            trainable = sum(tok.loss_mask[:kept])
            stats.samples += 1
            stats.total_tokens += tok.full_length
            stats.total_tokens_after_truncation += kept
            stats.trainable_tokens += trainable
            stats.trainable_tokens_before_truncation += tok.trainable
            stats.longest = max(stats.longest, tok.full_length)
            bucket = length_bucket(tok.full_length)
            stats.histogram[bucket] = stats.histogram.get(bucket, 0) + 1
            if tok.full_length > kept:
                stats.over_max_len += 1
                stats.truncated_tokens += tok.full_length - kept
            if trainable == 0:
                stats.no_trainable += 1
                if len(stats.no_trainable_ids) < SHOW_NO_TRAINABLE:
                    stats.no_trainable_ids.append(sample.id)
        pending.clear()
        pending_chars = 0
        if progress is not None:
            progress(stats.samples)

    for sample in reader:
        chars = sum(len(m["content"]) for m in sample.messages)
        if pending and pending_chars + chars > BATCH_CHARS:
            flush()
        pending.append(sample)
        pending_chars += chars
        if len(pending) >= BATCH:
            flush()
    if pending:
        flush()
    stats.format = reader.report.format
    stats.parse = reader.report.to_dict()
    stats.seconds = time.monotonic() - started
    return stats


def histogram_text(histogram: dict[int, int], width: int = 30) -> str:
    """One line per power-of-two bucket: range, bar, count."""
    if not histogram:
        return "(no samples)"
    top = max(histogram.values())
    lines = []
    for lo in sorted(histogram):
        label = "0" if lo == 0 else f"{lo}-{lo * 2 - 1}"
        bar = "#" * max(1, round(width * histogram[lo] / top))
        lines.append(f"{label:>13} tok | {bar:<{width}} {histogram[lo]:,}")
    return "\n".join(lines)
