"""Run a Python module with a wall-clock stack sampler beside it (for processes py-spy cannot attach to,
such as under gVisor). Every `--interval` seconds it records each thread's Python stack, keyed by the
phase named in `--phase-file` (the benchmark writes "on"/"off" there), and rewrites `OUT` (JSON:
phase -> thread name -> samples, the engine/ lines they were in, top collapsed stacks) every two seconds.

    python bench/stack_sampler.py OUT --phase-file F -- -m engine.localserver --port ...

A thread blocked in C code that released the GIL (a CUDA sync, a write) shows at the Python line
that called it; the sampler needs the GIL to look, so its own cost is in the figures it reports.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import sys
import threading
import time


def _stack(frame, depth: int = 12) -> str:
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return ";".join(reversed(parts))


def _own_line(frame) -> str:
    """The innermost frame in this project's engine/ (where our code spent or waited for the time)."""
    while frame is not None:
        if f"{os.sep}engine{os.sep}" in frame.f_code.co_filename:
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside engine/)"


def _sampler(out: str, phase_file: str | None, interval: float) -> None:
    counts: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    own: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    me = threading.get_ident()
    last_dump = time.monotonic()
    phase = "all"
    while True:
        time.sleep(interval)
        if phase_file:
            try:
                phase = open(phase_file).read().strip() or "idle"
            except OSError:
                phase = "idle"
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident != me:
                name = names.get(ident, str(ident))
                counts[phase][name][_stack(frame)] += 1
                own[phase][name][_own_line(frame)] += 1
        if time.monotonic() - last_dump > 2.0:
            report = {p: {name: {"samples": sum(c.values()), "engine_lines": own[p][name].most_common(15),
                                 "top": c.most_common(25)} for name, c in threads.items()}
                      for p, threads in counts.items()}
            tmp = out + ".tmp"
            with open(tmp, "w") as handle:
                json.dump(report, handle, indent=1)
            os.replace(tmp, out)
            last_dump = time.monotonic()


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--")
    own, target = args[:split], args[split + 1:]
    out = own[0]
    phase_file = own[own.index("--phase-file") + 1] if "--phase-file" in own else None
    interval = float(own[own.index("--interval") + 1]) if "--interval" in own else 0.005
    threading.Thread(target=_sampler, args=(out, phase_file, interval), name="stack-sampler", daemon=True).start()
    if target[0] != "-m":
        raise SystemExit("usage: stack_sampler.py OUT [--phase-file F] [--interval S] -- -m MODULE ARGS...")
    sys.argv = [target[1], *target[2:]]
    runpy.run_module(target[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
