"""Run the local target server with one part of capturing switched off, to find what it costs.

    python bench/capture_ablation.py MODE -- -m engine.localserver --port ...

MODE:
  skip-write  the device-to-host copies run and a writer thread waits for them as usual, but no
              segment file is written (the server's file writes, system calls included, are gone)
  skip-copy   the hooks capture as usual on the GPU, but nothing is copied to the host or written:
              a captured request is answered as soon as its batch is queued
  answer-early  everything is copied and written as usual (process writer), but a captured request is
              answered once its prefill has run, not once the writer process holds its states: what
              the wait for the handover costs clients that send their next request on the answer

Used by `capture_overhead.py --ablate MODE`. A diagnostic only: requests "captured" by skip-write or
skip-copy leave nothing in the spool, so no extraction can run against such a server; answer-early
answers before the batch is submitted, so a writer process that dies then would see its fallback
answer those requests a second time.
"""

from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("skip-write", "skip-copy", "answer-early")


def install(mode: str) -> None:
    from engine.capture import segments
    from engine.localserver.capture_sink import CaptureSink

    if mode == "skip-write":
        def no_write(spool_dir, rid, start, *_args, **_kwargs):
            return segments.segment_path(spool_dir, rid, start)

        segments.write_segment = no_write  # the writer loop imports it from the module when it starts
    elif mode == "skip-copy":
        def answered_at_once(self, completions, rows, *_args, **_kwargs):
            for row in rows:
                completions[row].capture_queued = True
                completions[row].finish_capture()

        CaptureSink.queue_rows = answered_at_once
        CaptureSink.queue_batch = answered_at_once
    elif mode == "answer-early":
        from engine.localserver import capture_sink

        handover_init = capture_sink._AnswerOnHandover.__init__

        def answered_before_handover(self, *args, **kwargs):
            handover_init(self, *args, **kwargs)
            self.handed()  # the request still waits for its prefill (Completion's other part)

        capture_sink._AnswerOnHandover.__init__ = answered_before_handover
    else:
        raise SystemExit(f"unknown mode {mode!r}: give one of {', '.join(MODES)}")


def main() -> None:
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit("usage: capture_ablation.py MODE -- -m MODULE ARGS...")
    split = args.index("--")
    own, target = args[:split], args[split + 1:]
    if len(own) != 1 or target[:1] != ["-m"]:
        raise SystemExit("usage: capture_ablation.py MODE -- -m MODULE ARGS...")
    install(own[0])
    sys.argv = [target[1], *target[2:]]
    runpy.run_module(target[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
