"""The local server's settings that come from the environment, read once per runner."""

from __future__ import annotations

from engine.capture.writer_env import DEFAULT_SLOT_TOKENS, slot_tokens_from_env, writer_mode_from_env
from engine.io.env import whole_number_from_env

WRITERS_ENV = "EAGLE3_CAPTURE_WRITERS"
DEFAULT_CAPTURE_WRITERS = 4

# Tokens one shared-memory slot holds when no prefill graphs set the size (CPU, graphs off); with
# graphs, their largest bucket. A larger (eager) batch is cut into several slots.
SPOOL_SLOT_TOKENS = DEFAULT_SLOT_TOKENS
# Slots of the writer process: the model thread copies a batch into free slots and waits when none
# is free, so there should be room for the next batch while the child writes this one. As many as
# fit CAPTURE_SHM_BYTES of shared (and CUDA-pinned) memory, from 3 to 9.
CAPTURE_SHM_BYTES = 1 << 30
CAPTURE_SLOTS = (3, 9)


def capture_slots(slot_bytes: int) -> int:
    """How many slots of `slot_bytes` the writer process gets."""
    low, high = CAPTURE_SLOTS
    return max(low, min(high, CAPTURE_SHM_BYTES // max(slot_bytes, 1)))


def capture_writer_count() -> int:
    """Writer threads: EAGLE3_CAPTURE_WRITERS if set (1..64), else 4; ValueError for anything else.

    Few: four outpace what a fast target captures, and every writer takes the GIL for a little Python
    per segment, which the model thread launching kernels pays for (bench/RESULTS.md)."""
    return whole_number_from_env(WRITERS_ENV, DEFAULT_CAPTURE_WRITERS, 64, "a number of writer threads",
                                 str(DEFAULT_CAPTURE_WRITERS))


def capture_writer_mode() -> str:
    """EAGLE3_CAPTURE_WRITER: "process" (default) hands whole batches to a child process through
    shared memory (engine/capture/spool_process.py), so the writes' GIL hand-offs leave the process
    that launches the kernels (it measured best: bench/RESULTS.md). "threads" writes segments in
    the server process."""
    return writer_mode_from_env()


def capture_slot_tokens(default: int) -> int:
    """Tokens a shared-memory slot of the writer process holds: EAGLE3_CAPTURE_SLOT_TOKENS if set
    (1..1,048,576), else `default`. Smaller slots cost less shared memory; a batch that does not fit
    one is cut into several."""
    return slot_tokens_from_env(default)


def check_capture_environment() -> None:
    """Read every capture setting of the environment once, before the model loads: ValueError naming the
    first bad one and its fix (the server refuses to start rather than run on a value nobody chose)."""
    capture_writer_count()
    capture_writer_mode()
    capture_slot_tokens(SPOOL_SLOT_TOKENS)
