"""What the SGLang capture hook costs a forward loop, hook on vs off, in one run.

`bench/capture_overhead.py` measures the local server's own capture path; SGLang's workers run
`engine/sglang/hook.py` instead, and SGLang itself is not on the lent GPU machines. This bench runs
the hook as SGLang calls it (after the logits processor of every EXTEND batch, on the thread that
launches the model) behind a stand-in forward: `--layers` SwiGLU blocks over a packed batch of
`--rows` requests of `--tokens` tokens, hidden `--hidden`. Rounds alternate on / off; an 'on' round
ends when every segment of it is written (`hook.flush()`), so the writing is paid inside the round it
belongs to. Between rounds the spool is emptied (outside the timing), as an extraction job would.

    python bench/hook_overhead.py                               # CPU smoke: tiny shapes
    python bench/hook_overhead.py --rows 16 --tokens 2048 --hidden 2048 --layers 16   # GPU: the 1b shape
    python bench/hook_overhead.py --rows 64 --tokens 512 --hidden 640 --layers 16     # GPU: the e2e shape
"""

from __future__ import annotations

import argparse
import enum
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.capture.layers import default_capture_layers  # noqa: E402
from capture_overhead import ratio_verdict  # noqa: E402  (bench/ is on sys.path: the script's own folder)
from engine.sglang.hook import CaptureHook  # noqa: E402


class ForwardMode(enum.IntEnum):  # the member name is what the hook reads
    EXTEND = 1


@dataclass
class ForwardBatch:  # the fields of SGLang's ForwardBatch that the hook reads
    forward_mode: ForwardMode
    rids: list[str]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]


class StandIn(torch.nn.Module):
    """A decoder-shaped stack: each layer a SwiGLU MLP with a residual; returns the final state and
    the outputs of the capture layers, as SGLang's EAGLE-3 aux capture hands them over."""

    def __init__(self, hidden: int, layers: int, capture: list[int]) -> None:
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(hidden, 2 * hidden, bias=False) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
        self.capture = set(capture)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        aux = []
        for index, (up, down) in enumerate(zip(self.up, self.down)):
            gate, value = up(x).chunk(2, dim=-1)
            x = x + down(torch.nn.functional.silu(gate) * value)
            if index in self.capture:
                aux.append(x)
        return x, aux


def run_round(model: StandIn, hook: CaptureHook | None, batches: int, rows: int, tokens: int,
              hidden: int, round_id: str) -> float:
    """Prefill tokens per second over `batches` forwards (and, with the hook, their writes)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    total = rows * tokens
    ids = torch.randint(0, 32000, (total,), device=device)
    inputs = torch.randn(total, hidden, device=device, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for number in range(batches):
            final, aux = model(inputs)
            if hook is not None:
                batch = ForwardBatch(ForwardMode.EXTEND, [f"{round_id}-{number}-{row}" for row in range(rows)],
                                     [tokens] * rows, [0] * rows)
                hook(model, (ids, final, None, batch, aux), None)  # as the logits processor's forward hook
    if device.type == "cuda":
        torch.cuda.synchronize()
    if hook is not None and not hook.flush(timeout=600):
        raise RuntimeError("the capture hook did not write its segments within 600 s")
    return batches * total / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--rows", type=int, default=16 if gpu else 4, help="requests a batch")
    parser.add_argument("--tokens", type=int, default=2048 if gpu else 64, help="tokens a request")
    parser.add_argument("--hidden", type=int, default=2048 if gpu else 64)
    parser.add_argument("--layers", type=int, default=16 if gpu else 4)
    parser.add_argument("--batches", type=int, default=8, help="forwards a round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds a side, alternating")
    parser.add_argument("--writer", choices=("process", "threads"), default="process")
    parser.add_argument("--spool", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()

    torch.manual_seed(0)
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    capture = default_capture_layers(args.layers)
    model = StandIn(args.hidden, args.layers, capture).to(device=device, dtype=dtype)
    spool = Path(tempfile.mkdtemp(prefix="hookbench-spool-", dir=args.spool))
    hook = CaptureHook(str(spool), capture, rank_fn=lambda: 0, writer=args.writer)
    result: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, float] = {"on": 0.0, "off": 0.0}
    try:
        for side in ("on", "off"):  # warm both: kernels, the writer process, pinned host blocks
            run_round(model, hook if side == "on" else None, 2, args.rows, args.tokens, args.hidden, f"warm-{side}")
        shutil.rmtree(spool, ignore_errors=True)
        for number in range(args.rounds):
            for side in (("on", "off") if number % 2 == 0 else ("off", "on")):
                before, before_s = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                rate = run_round(model, hook if side == "on" else None, args.batches, args.rows, args.tokens,
                                 args.hidden, f"r{number}")
                wall = time.perf_counter() - before_s
                after = resource.getrusage(resource.RUSAGE_SELF)
                cpu[side] += (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / wall
                result[side].append(rate)
                shutil.rmtree(spool, ignore_errors=True)  # outside the timing: what the job does with a segment
        writer, by_process, written = hook.writer_state, hook.batches_by_process, hook.written
    finally:
        hook.close()
        shutil.rmtree(spool, ignore_errors=True)
    on, off = statistics.median(result["on"]), statistics.median(result["off"])
    pairs = sorted(a / b for a, b in zip(result["on"], result["off"]))
    name = torch.cuda.get_device_name(0) if gpu else f"CPU ({os.cpu_count()} cores)"
    per_token = (len(capture) + 1) * args.hidden * (2 if gpu else 4) + 8
    print(f"{name}; stand-in forward: {args.layers} SwiGLU layers, hidden {args.hidden}, batches of {args.rows} x "
          f"{args.tokens} tokens; capture layers {capture}, {per_token:,} bytes a token; writer {writer} "
          f"({by_process} batches by the process, {written} segments)")
    print(f"hook overhead ratio (on/off): {on / off:.3f}  [{on:,.0f} vs {off:,.0f} tok/s, rounds "
          f"{', '.join(f'{x:.3f}' for x in pairs)}]")
    print(ratio_verdict(pairs))
    print(f"this process's CPU s per wall s (the hook's writer process not counted): on "
          f"{cpu['on'] / args.rounds:.2f}, off {cpu['off'] / args.rounds:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
