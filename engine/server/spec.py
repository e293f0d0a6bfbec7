"""A server launch: argv and environment, built from config, shown to the user before it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

SECRET_ENV = ("LOCALSERVER_API_KEY",)


@dataclass(frozen=True)
class LaunchSpec:
    backend: str  # local | sglang
    argv: list[str]
    env: dict[str, str]  # the complete child environment
    env_set: dict[str, str]  # what we added or changed, for display
    host: str
    port: int
    api_key: str | None = None
    capture: bool = True
    spool_dir: str = ""
    capture_layers: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)  # why flags were chosen

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def redacted_argv(self) -> list[str]:
        """argv with any API key replaced, safe to log and show."""
        from engine.jobs.manager import redact_argv

        return redact_argv(self.argv)

    def redacted_env_set(self) -> dict[str, str]:
        return {k: ("***" if k in SECRET_ENV else v) for k, v in self.env_set.items()}

    def to_json(self) -> dict:
        """What `server command --json` prints: everything needed to run it, secrets redacted."""
        return {"backend": self.backend, "argv": self.redacted_argv(), "env": self.redacted_env_set(),
                "url": self.url, "capture": self.capture, "capture_layers": list(self.capture_layers),
                "spool_dir": self.spool_dir, "notes": list(self.notes)}
