"""Which capture writer the local server and the SGLang hook use, and its slot size, from the
environment. No torch here: the server reads these before it loads anything heavy, to refuse a bad
value at once."""

from __future__ import annotations

import os

from engine.io.env import whole_number_from_env

SLOT_TOKENS_ENV = "EAGLE3_CAPTURE_SLOT_TOKENS"  # tokens one slot holds, for the local server and the SGLang hook
DEFAULT_SLOT_TOKENS = 8192  # SGLang's chunked prefill size on most GPUs, and the largest prefill graph
MAX_SLOT_TOKENS = 1 << 20
WRITER_ENV = "EAGLE3_CAPTURE_WRITER"  # who writes segments, for the local server and the SGLang hook
WRITER_MODES = ("process", "threads")  # the first is the default


def slot_tokens_from_env(default: int) -> int:
    """EAGLE3_CAPTURE_SLOT_TOKENS if set, else `default`. A bad value is refused (ValueError naming the
    variable and the fix), never replaced: the operator set it for a reason."""
    return whole_number_from_env(SLOT_TOKENS_ENV, default, MAX_SLOT_TOKENS, "a whole number of tokens",
                                 f"slots of {default:,} tokens")


def writer_mode_from_env() -> str:
    """EAGLE3_CAPTURE_WRITER: "process" (default) or "threads"; ValueError for anything else."""
    raw = os.environ.get(WRITER_ENV, "").strip().lower()
    if not raw:
        return WRITER_MODES[0]
    if raw in WRITER_MODES:
        return raw
    raise ValueError(f"{WRITER_ENV}={raw!r} is not one of {', '.join(WRITER_MODES)}: set one of them, or unset it "
                     f"for {WRITER_MODES[0]!r}")
