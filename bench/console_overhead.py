"""What watching costs: CPU seconds per minute of the console, next to nvitop, and start-up time.

Both programs run in their own pseudo-terminal (80x24, TERM=xterm-256color), in the same run,
over the same window, sampling the GPUs once a second (the console: gpu.sample_interval_s = 1,
ui.refresh_s = 1; nvitop: --interval 1, --only GPU). CPU time is the process's user+system
time from psutil over `--seconds` after a warm-up. Start-up time is from process start to the
first full frame: the moment the footer ("palette") and the last pipeline stage ("evaluate")
have both been written to the terminal.

nvitop is optional: pass --nvitop with a wheel (`pip download --no-deps nvitop`), or have it
importable or on PATH. Without NVML (a CPU machine) it is reported as unavailable and the
console is measured alone.

    python bench/console_overhead.py --seconds 60 [--nvitop nvitop-*.whl] [--gpu 0]

Prints one JSON object, then a ratio line.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FRAME_MARKERS = (b"palette", b"evaluate")
WINSIZE_80x24 = b"\x18\x00\x50\x00\x00\x00\x00\x00"


class PtyProcess:
    """A command in its own pty; output is drained (and kept) so the program never blocks."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, WINSIZE_80x24)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True, cwd=str(ROOT))
        os.close(slave)
        self.output = b""
        self.bytes_read = 0

    def drain(self, timeout: float = 0.0) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        while ready:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.bytes_read += len(chunk)
            self.output = (self.output + chunk)[-200_000:]
            ready, _, _ = select.select([self.master], [], [], 0)

    def wait_for(self, markers: tuple[bytes, ...], timeout: float) -> float | None:
        """Seconds from start until every marker was seen, or None on timeout/exit."""
        seen: set[bytes] = set()
        deadline = self.started + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.drain(0.01)
            seen.update(m for m in markers if m in self.output)
            if len(seen) == len(markers):
                return time.monotonic() - self.started
        return None

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self.master)


def make_workspace(root: Path) -> Path:
    """A minimal real workspace (a config-only model: the console needs no weights to watch)."""
    from engine.config import set_value
    from engine.workspace import init_workspace

    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}))
    ws = init_workspace(root / "ws", demo=False)
    config = ws.config
    for key, value in {"model.path": str(model), "gpu.sample_interval_s": 1.0, "ui.refresh_s": 1.0}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    return ws.root


def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def nvitop_command(spec: str | None, gpu: int) -> tuple[list[str] | None, dict[str, str], str]:
    """argv and extra env to run nvitop, or None and why not."""
    env: dict[str, str] = {}
    wheel = spec if spec and spec.endswith(".whl") else None
    if wheel is None and not spec:
        found = sorted(glob.glob(str(ROOT / "nvitop-*.whl")) + glob.glob(str(ROOT / "bench" / "nvitop-*.whl")))
        wheel = found[-1] if found else None
    args = ["--interval", "1", "--only", str(gpu), "--monitor", "compact"]
    if wheel:
        if not Path(wheel).exists():
            return None, env, f"wheel {wheel} not found"
        env["PYTHONPATH"] = os.pathsep.join([str(Path(wheel).resolve()), os.environ.get("PYTHONPATH", "")])
        return [sys.executable, "-m", "nvitop", *args], env, f"wheel {Path(wheel).name}"
    if spec:
        return [spec, *args], env, spec
    probe = subprocess.run([sys.executable, "-c", "import nvitop"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "nvitop", *args], env, "installed module"
    path = shutil.which("nvitop")
    if path:
        return [path, *args], env, path
    return None, env, "nvitop not found (pass --nvitop nvitop-*.whl from `pip download --no-deps nvitop`)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window after warm-up")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds after the first frame before measuring")
    parser.add_argument("--nvitop", default=None, help="nvitop wheel, executable, or nothing to look for one")
    parser.add_argument("--gpu", type=int, default=0, help="GPU index nvitop watches (--only)")
    args = parser.parse_args()

    base_env = {**os.environ, "TERM": "xterm-256color", "COLORTERM": "truecolor"}
    have_nvml = nvml_available()
    result: dict = {"seconds": args.seconds, "nvml": have_nvml, "rate_hz": 1.0}
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp:
        ws_root = make_workspace(Path(tmp))
        console = PtyProcess([sys.executable, "-m", "eagle3_console", "-w", str(ws_root)], base_env)
        nvitop = None
        argv, extra_env, source = nvitop_command(args.nvitop, args.gpu)
        if argv is None or not have_nvml:
            result["nvitop"] = {"available": False,
                                "reason": source if argv is None else "NVML unavailable here (no GPU driver)"}
        try:
            first_frame = console.wait_for(FRAME_MARKERS, timeout=30)
            if first_frame is None:
                raise SystemExit(f"the console showed no full frame in 30 s; output tail: {console.output[-500:]!r}")
            if argv is not None and have_nvml:
                nvitop = PtyProcess(argv, {**base_env, **extra_env})
                if nvitop.wait_for((b"NVITOP",), timeout=10) is None and nvitop.proc.poll() is not None:
                    result["nvitop"] = {"available": False, "reason": f"nvitop exited: {nvitop.output[-300:]!r}"}
                    nvitop.close()
                    nvitop = None
            end_warmup = time.monotonic() + args.warmup
            while time.monotonic() < end_warmup:
                for p in (console, nvitop):
                    if p:
                        p.drain(0.05)
            start = {id(p): p.cpu_seconds() for p in (console, nvitop) if p}
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                for p in (console, nvitop):
                    if p:
                        p.drain(0.05)
            elapsed = time.monotonic() - t0
            def per_minute(p):
                return round((p.cpu_seconds() - start[id(p)]) / elapsed * 60, 3)

            result["console"] = {"first_frame_s": round(first_frame, 3), "cpu_s_per_min": per_minute(console),
                                 "terminal_bytes_per_s": round(console.bytes_read / (time.monotonic() - console.started))}
            if nvitop is not None:
                result["nvitop"] = {"available": True, "source": source, "cpu_s_per_min": per_minute(nvitop)}
        finally:
            console.close()
            if nvitop is not None:
                nvitop.close()
    print(json.dumps(result, indent=2))
    c = result["console"]["cpu_s_per_min"]
    frame_ok = "under" if result["console"]["first_frame_s"] < 1.0 else "OVER"
    if result["nvitop"].get("available"):
        n = result["nvitop"]["cpu_s_per_min"]
        ratio = c / n if n else float("inf")
        print(f"ratio console/nvitop CPU = {ratio:.2f} ({c:.2f} vs {n:.2f} CPU s/min at 1 Hz); "
              f"first frame {result['console']['first_frame_s']:.2f} s ({frame_ok} 1 s)")
    else:
        print(f"ratio console/nvitop CPU = n/a (nvitop unavailable: {result['nvitop']['reason']}); "
              f"console {c:.2f} CPU s/min at 1 Hz; first frame {result['console']['first_frame_s']:.2f} s "
              f"({frame_ok} 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
