"""Does the running server still match console.toml?

A server keeps the settings it was started with: edit `extract.spool_dir`, `model.capture_layers`,
`model.path` or `server.port` while it runs and it goes on capturing into the old spool, the old
layers or the old model, on the old port. `drift(manager)` compares what the server runs with
(the record ServerManager.start wrote: argv, url, spool, layers; and, when given, what the server
itself reports in /server_info) with the launch console.toml asks for now (build_spec, read from
the file on disk: the single source of "what console.toml wants"). Each difference names the
console.toml key, the running value and the wanted one; the fix is always the same: restart the
server to apply.

A difference is `blocking` when captures made now would not be what console.toml describes
(another spool, layers, model, dtype, ...): stages turn red and an extraction refuses to start.
An address change (server.host, server.port) is not: the engine still reaches the server where it
runs (the record's url), so stages turn amber and an extraction says which port it really uses.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

RESTART_FIX = ("restart the server to apply: `eagle3-console server stop` then `eagle3-console server start` "
               "(or `a` on the Server pane)")
ADDRESS_SETTINGS = ("server.host", "server.port")
MEMO_TTL_S = 10.0  # a memoised comparison is re-made at least this often (model files may change)

# Launch flags and the console.toml key each comes from (both backends).
FLAG_SETTINGS = {
    "--model-path": "model.path", "--host": "server.host", "--port": "server.port", "--device": "server.device",
    "--dtype": "model.dtype", "--capture-layers": "model.capture_layers", "--spool-dir": "extract.spool_dir",
    "--tp-size": "model.tp_size", "--dp-size": "model.dp_size", "--ep-size": "model.ep_size",
    "--nnodes": "server.nnodes", "--node-rank": "server.node_rank", "--dist-init-addr": "server.dist_init_addr",
    "--attention-backend": "server.attention_backend", "--api-key": "server.api_key",
    "--forward-hooks": "model.capture_layers",
}
# Compared on their own below (values normalised), never as raw flags.
_STRUCTURED = ("--model-path", "--host", "--port", "--capture-layers", "--spool-dir", "--forward-hooks", "--api-key")


@dataclass(frozen=True)
class Difference:
    setting: str  # the console.toml key
    running: str  # what the running server uses
    wanted: str  # what console.toml asks for now
    blocking: bool = True  # captures made now would not be what console.toml describes

    def describe(self) -> str:
        return f"{self.setting}: the server runs with {self.running}, console.toml says {self.wanted}"

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "running": self.running, "wanted": self.wanted, "blocking": self.blocking}


def describe(differences: list[Difference]) -> str:
    """One line naming every difference."""
    return "; ".join(d.describe() for d in differences)


def api_key_fingerprint(key: str | None) -> str:
    """What the record keeps of the API key: enough to tell a changed key, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def _path(value: Any) -> str:
    return os.path.realpath(os.path.expanduser(str(value))) if value not in (None, "") else ""


def _layers(value: Any) -> str:
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    try:
        return str([int(v) for v in value or ()])
    except (TypeError, ValueError):
        return str(value)


def _flags(argv: list[str]) -> dict[str, str]:
    """`--flag value...` pairs after `python -m module` (a bare flag reads "on")."""
    out: dict[str, list[str]] = {}
    key: str | None = None
    for arg in list(argv)[3:]:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            out[name] = [value] if eq else []
            key = None if eq else name
        elif key is not None:
            out[key].append(arg)
        else:
            out.setdefault("(arguments)", []).append(arg)
    return {k: (" ".join(v) if v else "on") for k, v in out.items()}


def _layer_flags() -> set[str]:
    """Flags whose values are the capture layers in some numbering (compared as model.capture_layers)."""
    flags = {"--capture-layers", "--forward-hooks"}
    try:
        from engine.sglang.versions import PROFILES

        flags |= {p.aux_layer_ids_flag for p in PROFILES.values()}
    except Exception:  # noqa: BLE001,S110 - no SGLang profiles to read: their flags are compared as flags
        pass
    return flags


def _address(url: str) -> tuple[str, str]:
    parts = urlsplit(url or "")
    try:
        port = str(parts.port or "")
    except ValueError:
        port = ""
    return parts.hostname or "", port


def _running_capture(record: dict, info: dict | None) -> tuple[str | None, str | None]:
    """(spool, layers) the server captures with: what it reports, else what was recorded."""
    spool = record.get("spool_dir")
    layers = record.get("capture_layers")
    if isinstance(info, dict):
        capture = info.get("capture")
        if isinstance(capture, dict) and capture.get("enabled"):
            spool = capture.get("spool_dir") or spool
            layers = capture.get("layers") if capture.get("layers") is not None else layers
        elif info.get("forward_hooks"):
            from engine.sglang.launch import hook_layers

            hooked, _ = hook_layers(info)
            layers = hooked if hooked is not None else layers
    return (_path(spool) if spool else None), (_layers(layers) if layers is not None else None)


def _capture_differences(record: dict, info: dict | None, spec) -> list[Difference]:
    """The capture's layers and spool (as the server reports or recorded them) against the spec's."""
    spool, layers = _running_capture(record, info)
    found = []
    if layers is not None and layers != _layers(spec.capture_layers):
        found.append(Difference("model.capture_layers", layers, _layers(spec.capture_layers)))
    if spool is not None and spool != _path(spec.spool_dir):
        found.append(Difference("extract.spool_dir", spool, _path(spec.spool_dir)))
    return found


def compare(record: dict, spec, config, info: dict | None = None) -> list[Difference]:
    """The differences between a running server (its record, and /server_info when given) and the
    launch `spec` that console.toml (`config`) asks for now."""
    found: dict[str, Difference] = {}

    def add(setting: str, running: Any, wanted: Any, blocking: bool = True) -> None:
        if setting not in found:
            found[setting] = Difference(setting, str(running), str(wanted), blocking)

    backend = record.get("backend") or ""
    if backend and backend != spec.backend:
        add("model.backend", backend, spec.backend)
    argv = [str(a) for a in record.get("argv") or []]
    running_flags, wanted_flags = _flags(argv), _flags(spec.redacted_argv())

    # The address: where the engine reaches it (the record's url), and where it says it listens.
    host, port = _address(record.get("url", ""))
    if isinstance(info, dict) and info.get("port") not in (None, ""):
        port = str(info.get("port"))
    if port and port != str(spec.port):
        add("server.port", port, spec.port, blocking=False)
    if host and host.strip("[]") != spec.host.strip("[]"):
        add("server.host", host, spec.host, blocking=False)

    # The model.
    running_model = (info or {}).get("model_path") or running_flags.get("--model-path")
    wanted_model = wanted_flags.get("--model-path")
    if running_model and wanted_model and _path(running_model) != _path(wanted_model):
        add("model.path", running_model, wanted_model)
    # The weights at that path, replaced since the server loaded them (a fine-tune saved over them):
    # captures would be stamped with the new weights' id and hold the old ones' states.
    loaded = record.get("model_weights")
    if loaded and wanted_model and "model.path" not in found:
        from engine.model.weights_id import readable_weights_id

        now = readable_weights_id(wanted_model)
        if now is not None and now != loaded:
            add("model.path", f"weights {loaded} (loaded at start)", f"weights {now} (the files at {wanted_model} now)")

    # Capture: on or off, the layers, the spool.
    capturing = bool(record.get("capture"))
    if isinstance(info, dict) and isinstance(info.get("capture"), dict):
        capturing = bool(info["capture"].get("enabled"))
    if capturing != bool(spec.capture):
        add("capture", "capture on" if capturing else "capture off", "capture on" if spec.capture else "capture off")
    elif spec.capture:
        for difference in _capture_differences(record, info, spec):
            add(difference.setting, difference.running, difference.wanted)

    # The API key (the record keeps a fingerprint; older records have none: not compared).
    if "api_key_sha256" in record and record["api_key_sha256"] != api_key_fingerprint(config.server.api_key):
        add("server.api_key", "another key" if record["api_key_sha256"] else "no key",
            "a new key" if config.server.api_key else "no key")

    # Every other launch flag (device, dtype, parallelism, attention backend, extra_args, ...); a
    # record without argv (an older version wrote none) has nothing to compare them with.
    if not argv:
        return list(found.values())
    skip = set(_STRUCTURED) | _layer_flags()
    extra = {a.split("=", 1)[0] for a in config.server.extra_args if a.startswith("--")}
    for flag in sorted(set(running_flags) | set(wanted_flags)):
        if flag in skip:
            continue
        have, want = running_flags.get(flag), wanted_flags.get(flag)
        if have == want:
            continue
        setting = "server.extra_args" if flag in extra else FLAG_SETTINGS.get(flag, f"launch flag {flag}")
        add(setting, f"{flag} {have}" if have is not None else f"no {flag}",
            f"{flag} {want}" if want is not None else f"no {flag}")
    return list(found.values())


def wanted_spec(root, capture: bool):
    """(spec, config) console.toml on disk asks for now; ConfigError when it cannot be built."""
    from engine.server.local import build_spec
    from engine.workspace import Workspace

    fresh = Workspace(root)
    return build_spec(fresh, capture=capture), fresh.config


def drift(manager, info: dict | None = None) -> list[Difference]:
    """The differences between the server `manager` runs now and console.toml on disk; [] when no
    server of this workspace runs or console.toml cannot be read (its own checks say why)."""
    from engine.config import ConfigError
    from engine.jobs.manager import ACTIVE_STATES

    record = manager.record()
    job = manager.job()
    if job is None or job.state not in ACTIVE_STATES:
        return []
    capture = bool(record.get("capture", True))
    root = manager.workspace.root
    try:
        spec, config = wanted_spec(root, capture)
    except ConfigError:
        if not capture:
            return []
        try:  # the capture launch cannot be planned (e.g. a model.path with no model): compare the rest
            spec, config = wanted_spec(root, False)
        except ConfigError:
            return []
        found = compare({**record, "capture": False}, spec, config, None)
        return found + [Difference("capture", "capture on", "no capture launch possible (see the model stage)")]
    return compare(record, spec, config, info)


def _identity(path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def memo_key(manager) -> tuple:
    """What a remembered comparison depends on: console.toml, the server record, its job."""
    job = manager.job()
    return (_identity(manager.workspace.config_path), _identity(manager.workspace.state_dir / "server.json"),
            None if job is None else (job.id, job.state, job.pid))


def remembered_drift(manager, info: dict | None = None) -> list[Difference]:
    """drift(), re-made only when console.toml, the record or the job changed (or after MEMO_TTL_S):
    cheap enough for a poll every second. Never raises."""
    key = (memo_key(manager), id(info) if info is not None else None)
    held = getattr(manager, "_drift_memo", None)
    now = time.monotonic()
    if held is not None and held[0] == key and now - held[1] < MEMO_TTL_S:
        return held[2]
    try:
        found = drift(manager, info)
    except Exception:  # noqa: BLE001 - a comparison must never take a poll or a check down
        found = []
    manager._drift_memo = (key, now, found)
    return found


def reported_drift(info: dict, spec) -> list[Difference]:
    """For a server this workspace did not start (no record: another workspace's, or an extra
    endpoint): what it reports about itself in /server_info against the launch console.toml asks
    for. Only what a capture depends on: the model, capture on, its layers and (local server) spool."""
    found: list[Difference] = []
    model = info.get("model_path")
    wanted_model = _flags(spec.redacted_argv()).get("--model-path")
    if model and wanted_model and _path(model) != _path(wanted_model):
        found.append(Difference("model.path", str(model), str(wanted_model)))
    if not spec.capture:
        return found
    capture = info.get("capture")
    if isinstance(capture, dict) and not capture.get("enabled"):
        return found + [Difference("capture", "capture off", "capture on")]
    return found + _capture_differences({}, info, spec)
