"""`python -m engine.train.torchrun ARGS`: torchrun, except that SIGTERM is the ranks' to answer.

torchrun turns SIGTERM into an exception: it passes SIGTERM on to its ranks (each in a session of its own,
out of the job's process group), waits for them and exits 1, even when every rank checkpointed and exited
0. Here torchrun leaves SIGTERM alone; this process passes it on to the ranks and torchrun waits for them
as for any run, so a stopped run exits 0 and a rank's failure still fails it.
"""

from __future__ import annotations

import dataclasses
import signal
import sys

# torchrun's own default, less SIGTERM
SIGNALS_FOR_TORCHRUN = "SIGINT,SIGHUP,SIGQUIT"


def leaves_sigterm_alone() -> bool:
    """Whether this torch's torchrun takes --signals-to-handle (older releases always catch SIGTERM)."""
    from torch.distributed.launcher.api import LaunchConfig

    return any(field.name == "signals_to_handle" for field in dataclasses.fields(LaunchConfig))


def _pass_on(signum, frame) -> None:
    import psutil

    for rank in psutil.Process().children():  # the ranks; what runs below them is theirs to stop
        try:
            rank.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import main as torchrun_main

    args = list(sys.argv[1:] if argv is None else argv)
    if leaves_sigterm_alone():
        signal.signal(signal.SIGTERM, _pass_on)
        args = ["--signals-to-handle", SIGNALS_FOR_TORCHRUN, *args]
    torchrun_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
