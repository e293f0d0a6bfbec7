"""Process identity: is the process behind a recorded pid still the one we started?

Pids are reused, so a pid alone proves nothing after a console restart or a day of
uptime. A job records its pid together with the process create time; a later reader
accepts the pid only when the live process has the same create time.
"""

from __future__ import annotations

import os
import signal
import sys

import psutil

# psutil derives create time from a per-boot tick count plus the boot time; two reads
# of one process agree to the tick (10 ms on Linux).
CREATE_TIME_TOLERANCE_S = 0.01

# When the raw start tick count is known, it decides identity (it never changes, even
# when the wall clock is stepped by NTP, which moves psutil's create time by whole
# seconds). The create time must still be roughly right, so a process of a later boot
# that happens to have the same pid and tick count is not taken for the job.
CLOCK_STEP_ALLOWANCE_S = 600.0


def _alive(proc: psutil.Process) -> bool:
    """True unless the process is gone or a zombie (exited, not yet reaped)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def process_create_time(pid: int | None) -> float | None:
    """Create time (seconds since the epoch) of a live process, None if gone or a zombie."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        if not _alive(proc):
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def process_start_ticks(pid: int | None) -> int | None:
    """Start time in clock ticks since boot (Linux /proc), None where unavailable."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and ')', so split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of the whole line: starttime
    except (IndexError, ValueError):
        return None


def is_same_process(pid: int | None, create_time: float | None, start_ticks: int | None = None) -> bool:
    """True iff `pid` is alive (not a zombie) and is the process created at `create_time`.

    `start_ticks`, when recorded, makes the check immune to wall-clock steps.
    """
    if not isinstance(create_time, (int, float)) or isinstance(create_time, bool):
        return False
    actual = process_create_time(pid)
    if actual is None:
        return False
    if start_ticks is not None:
        ticks = process_start_ticks(pid)
        if ticks is not None:
            return ticks == start_ticks and abs(actual - create_time) < CLOCK_STEP_ALLOWANCE_S
    return abs(actual - float(create_time)) <= CREATE_TIME_TOLERANCE_S


def current_process_identity() -> tuple[int, float | None, int | None]:
    """(pid, create_time, start_ticks) of the calling process, for recording."""
    pid = os.getpid()
    return pid, process_create_time(pid), process_start_ticks(pid)


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG): a torchrun rank
    when torchrun goes, online training's capture process when its trainer goes; otherwise a kill -9 of
    the parent leaves them working on, holding locks and writing, with no job to show or stop them.
    Linux only; False where it cannot be set. The signal fires when the thread that started this process
    ends, so the parent starts it from a thread that lives as long as it is needed."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def name_process(title: str) -> bool:
    """Give the calling process a name that top, ps -o comm and psutil show (prctl PR_SET_NAME, at most 15
    bytes): a helper process started by multiprocessing is otherwise one more "python". Linux only; False
    where it cannot be set."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0) == 0  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        return False
