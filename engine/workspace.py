"""The workspace: one directory holding config, jobs and outputs, plus the driver lock.

A console can quit and a new one re-attach because everything the engine knows lives
here. Only one process drives a workspace at a time (an flock on `.console.lock`);
others attach read-only and say so.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.io import atomic
from engine.config import (
    CONFIG_NAME,
    Config,
    ConfigError,
    check_value,
    config_comments,
    load_config,
    parse_config,
    render_config,
    resolve_path,
    set_value,
)
from engine.errors import EngineError

LOCK_NAME = ".console.lock"
DEFAULT_WORKSPACE = "eagle3-workspace"


class WorkspaceError(EngineError):
    """A workspace problem explained for the user."""


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    since: float

    def describe(self) -> str:
        age = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host} since {age}"


class WorkspaceLock:
    """Advisory exclusive lock. The kernel drops it if the holder dies, so it is never stale."""

    def __init__(self, root: Path, name: str = LOCK_NAME):
        self.path = root / name
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> bool:
        """Take the lock; False if another process holds it (after trying for `wait_s` seconds,
        which rides out a moment's probe by held_elsewhere)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        os.fsync(fd)
        self._fd = fd
        return True

    def holder(self) -> LockHolder | None:
        try:
            data = json.loads(self.path.read_text())
            return LockHolder(int(data["pid"]), str(data["host"]), float(data["since"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def holder_text(self, unknown: str) -> str:
        """The holder for a message ("pid 123 on host since ..."), or `unknown` if unreadable."""
        holder = self.holder()
        return holder.describe() if holder else unknown

    def live_holder(self) -> LockHolder | None:
        """The holder, unless the lock file only names a console of this host that has exited
        (the file keeps the last holder's details after the kernel drops its lock). Probing with
        flock instead would make a console starting at that instant go read-only."""
        holder = self.holder()
        if holder is None or holder.host != socket.gethostname():
            return holder
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's process
            pass
        return holder

    @property
    def held(self) -> bool:
        return self._fd is not None

    def held_elsewhere(self) -> bool:
        """Whether a live process holds the lock now; probes without creating or rewriting the file."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's shared lock
        return False

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Workspace:
    """Paths and config of one workspace directory."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()
        self.lock = WorkspaceLock(self.root)
        self._config: Config | None = None

    # -- layout
    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_NAME

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def path(self, value: str) -> Path:
        return resolve_path(self.root, value)

    @property
    def model_dir(self) -> Path:
        return self.path(self.config.model.path) if self.config.model.path else self.root / "models" / "unset"

    @property
    def hidden_dir(self) -> Path:
        return self.path(self.config.extract.output_dir) / self.config.extract.run

    @property
    def drafter_dir(self) -> Path:
        return self.path(self.config.train.output_dir) / self.config.train.run

    @property
    def eval_dir(self) -> Path:
        return self.path(self.config.evaluate.output_dir) / self.config.evaluate.run

    @property
    def spool_dir(self) -> Path:
        return self.path(self.config.extract.spool_dir)

    def written_paths(self) -> dict[str, Path]:
        """Every place the pipeline writes to, for the disk sampler."""
        return {
            "workspace": self.root,
            "hidden": self.hidden_dir,
            "drafters": self.drafter_dir,
            "spool": self.spool_dir,
        }

    def reserves(self) -> dict[str, int]:
        """Free space to keep per written path (bytes); the spool has its own, smaller one."""
        gib = 2**30
        ex = self.config.extract
        # load_config has checked both; a Config changed in code is checked here, so a NaN or an
        # infinity is a ConfigError naming the key rather than a traceback from int().
        main = int(check_value("extract.disk_reserve_gb", ex.disk_reserve_gb, self.config_path) * gib)
        spool = int(check_value("extract.spool_reserve_gb", ex.spool_reserve_gb, self.config_path) * gib)
        return {"workspace": main, "hidden": main, "drafters": main, "spool": spool}

    # -- config
    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.root)
        return self._config

    def reload(self) -> Config:
        self._config = None
        return self.config

    def save_config(self, config: Config) -> None:
        atomic.write_text(self.config_path, render_config(config, CONFIG_COMMENTS), mode=0o600)
        self._config = config

    def save_setting(self, dotted: str, value: Any) -> Config:
        """Change one key of console.toml in place: the operator's own comments, notes and layout stay
        (save_config renders the whole file anew). The file is re-read first, so edits made meanwhile
        survive; the value is validated as `set_value` does. ConfigError or OSError; nothing written then."""
        import tomlkit

        text = self.config_path.read_text(encoding="utf-8")
        config = set_value(parse_config(text, self.config_path), dotted, value)
        section_name, key = dotted.split(".", 1)
        document = tomlkit.parse(text)
        section = document.setdefault(section_name, tomlkit.table())
        item = tomlkit.item(getattr(getattr(config, section_name), key))
        old = section.get(key)
        if isinstance(old, tomlkit.items.Item) and old.trivia.comment:
            item.trivia.comment, item.trivia.comment_ws = old.trivia.comment, old.trivia.comment_ws
        section[key] = item
        new_text = tomlkit.dumps(document)
        parse_config(new_text, self.config_path)  # what is written still reads as a valid console.toml
        atomic.write_text(self.config_path, new_text, mode=0o600)
        self._config = config
        return config

    def exists(self) -> bool:
        return self.config_path.is_file()


# The help beside every key of console.toml: derived from the keys' declarations in engine.config.
CONFIG_COMMENTS = config_comments()


def demo_config() -> Config:
    """The embedded default: tiny local target, demo data, sized for a laptop or CI."""
    config = Config()
    config.model.path = "models/demo-target"
    config.model.backend = "local"
    config.server.device = "auto"
    config.server.port = 30017
    config.server.startup_timeout_s = 120.0
    config.dataset.path = "data/train.jsonl"
    config.dataset.eval_path = "data/eval.jsonl"
    config.dataset.max_seq_len = 512
    config.extract.disk_reserve_gb = 1.0
    config.extract.spool_dir = "spool"
    config.extract.spool_reserve_gb = 0.1
    config.train.epochs = 4
    config.train.max_len = 512
    config.train.draft_vocab_size = 512
    config.train.save_every = 50
    config.train.log_every = 5
    config.train.learning_rate = 1e-3
    config.evaluate.num_prompts = 8
    config.evaluate.max_new_tokens = 48
    return config


SERVER_PORTS = range(30000, 32768)  # below Linux's ephemeral range, where clients' own ports land


def free_server_port(host: str, root: Path) -> int:
    """A port no process listens on now, starting from one derived from the workspace path, so two
    workspaces made before either server starts (two demos on one host) get different ports."""
    import socket
    import zlib

    start = zlib.crc32(str(root).encode()) % len(SERVER_PORTS)
    for offset in range(len(SERVER_PORTS)):
        port = SERVER_PORTS[(start + offset) % len(SERVER_PORTS)]
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    raise WorkspaceError(f"no free port in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1} on {host}: "
                         "stop some servers, or set server.port by hand after init")


def init_workspace(root: Path | str, demo: bool = False, progress=None) -> Workspace:
    """Create a workspace; refuses to overwrite an existing config (nothing lost)."""
    ws = Workspace(root)
    if ws.exists():
        raise WorkspaceError(f"{ws.config_path} already exists: this is a workspace already. "
                             f"Open it with `eagle3-console -w {ws.root}` or choose another directory.")
    if ws.root.exists() and not ws.root.is_dir():
        raise WorkspaceError(f"{ws.root} exists and is not a directory: choose another path.")
    try:
        ws.root.mkdir(parents=True, exist_ok=True)
        for sub in ("jobs", "state", "hidden", "drafters", "eval"):
            (ws.root / sub).mkdir(exist_ok=True)
    except OSError as exc:
        raise WorkspaceError(f"cannot create workspace {ws.root}: {exc.strerror}. "
                             "Choose a directory you can write to.") from None
    if demo:
        _create_demo_content(ws, progress)
    config = demo_config() if demo else Config()
    config.server.port = free_server_port(config.server.host, ws.root)
    ws.save_config(config)  # written last: a workspace with a config is complete
    return ws


def _create_demo_content(ws: Workspace, progress) -> None:
    try:
        from engine.demo import create_demo_content
    except ImportError:  # demo builder not available in this build: config only
        return
    create_demo_content(ws.root, progress=progress)


def find_workspace(explicit: str | None, cwd: Path | None = None) -> tuple[Path, bool]:
    """The workspace to open: -w DIR, else cwd if it is one, else ./eagle3-workspace.

    Returns (path, is_default_demo) — the default is created as the demo when missing.
    """
    if explicit:
        return Path(explicit).expanduser().resolve(), False
    cwd = Path(cwd or Path.cwd())
    if (cwd / CONFIG_NAME).is_file():
        return cwd.resolve(), False
    return (cwd / DEFAULT_WORKSPACE).resolve(), True


__all__ = [
    "ConfigError",
    "LockHolder",
    "Workspace",
    "WorkspaceError",
    "WorkspaceLock",
    "demo_config",
    "find_workspace",
    "init_workspace",
]
