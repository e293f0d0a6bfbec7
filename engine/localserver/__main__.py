"""`python -m engine.localserver --model-path DIR --port N [...]`: the local target server.

Start-up fails fast with exit code 2 and one line on stderr for user mistakes:
    model path X: <reason>
    port N on HOST is in use
    capture: <reason>
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
import tempfile
from pathlib import Path

from engine.capture.layers import (
    default_capture_layers,
    parse_layer_list,
    to_sglang_numbering,
    validate_layers,
)
from engine.errors import EngineError

EXIT_USAGE = 2
API_KEY_ENV = "LOCALSERVER_API_KEY"


class StartupError(EngineError):
    """A one-line, user-facing reason the server cannot start."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine.localserver",
        description="Serve a transformers causal LM over SGLang's HTTP subset, optionally capturing "
        "EAGLE-3 hidden states into a spool directory.",
    )
    parser.add_argument("--model-path", required=True, help="a transformers model directory")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--capture-layers", default=None,
                        help="comma-separated 0-indexed decoder-layer outputs, e.g. 1,3,4 "
                        "(SGLang numbers the same layers +1); default with --spool-dir: [1, L//2-1, L-4]")
    parser.add_argument("--spool-dir", default=None, help="enables capture: segments go to <spool>/<rid>/")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV}, which keeps the "
                        "key out of the process list)")
    parser.add_argument("--max-batch", type=int, default=8, help="most requests prefilled together")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def _num_layers_from_config(model_path: Path) -> int | None:
    from engine.model.target import TargetError, text_config

    try:
        value = text_config(model_path).get("num_hidden_layers")
    except TargetError:
        return None
    return value if isinstance(value, int) else None


def resolve_capture_layers(args: argparse.Namespace, num_layers: int) -> list[int] | None:
    if args.spool_dir is None:
        if args.capture_layers is not None:
            raise StartupError("capture: --capture-layers needs --spool-dir (where segments are written)")
        return None
    try:
        if args.capture_layers is None:
            return default_capture_layers(num_layers)
        return validate_layers(parse_layer_list(args.capture_layers), num_layers)
    except ValueError as exc:
        raise StartupError(f"capture: {exc}") from None


def prepare_spool(spool_dir: str) -> Path:
    path = Path(spool_dir).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise StartupError(f"capture: spool dir {path} is not writable ({exc.strerror or exc})") from None
    return path


def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 < port < 65536:
        raise StartupError(f"port {port} is not a valid TCP port (1-65535)")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name such as 'localhost'
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is in use") from None
        raise StartupError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock


def _load(args: argparse.Namespace):
    """Everything that can fail on user input, in order of cost; StartupError on failure."""
    from engine.localserver.loading import ModelLoadError, check_model_dir
    from engine.localserver.settings import check_capture_environment

    try:
        check_capture_environment()
    except ValueError as exc:
        raise StartupError(f"capture: {exc}") from None
    model_path = Path(args.model_path).expanduser()
    try:
        check_model_dir(model_path)  # cheap: before binding the port or importing torch
    except ModelLoadError as exc:
        raise StartupError(f"model path {args.model_path}: {exc}") from None
    early_num_layers = _num_layers_from_config(model_path)
    if early_num_layers is not None:
        resolve_capture_layers(args, early_num_layers)  # fail before the (slow) model load
    spool = prepare_spool(args.spool_dir) if args.spool_dir else None
    sock = bind_socket(args.host, args.port)
    try:
        # torch comes in here, after every check that needs none of it
        from engine.localserver.capture_sink import CaptureConfig
        from engine.localserver.model_runner import ModelRunner

        runner = ModelRunner(model_path, device=args.device, dtype=args.dtype, max_batch=args.max_batch)
        try:
            runner.load()
        except ModelLoadError as exc:
            raise StartupError(f"model path {args.model_path}: {exc}") from None
        layers = resolve_capture_layers(args, runner.info.num_layers)
        if layers is not None and spool is not None:
            try:
                runner.enable_capture(CaptureConfig(layers=layers, spool_dir=spool))
            except ModelLoadError as exc:
                raise StartupError(str(exc)) from None
    except BaseException:
        sock.close()
        raise
    return runner, sock


GIL_SWITCH_ENV = "EAGLE3_GIL_SWITCH_MS"


def apply_gil_switch_interval() -> float | None:
    """EAGLE3_GIL_SWITCH_MS (0.05..50): how long a thread waiting for the GIL waits before asking
    the holder to drop it (Python's default: 5 ms). The model thread launching kernels gives the
    GIL up at every op and waits that long whenever the HTTP loop or a capture writer holds it.
    Returns the interval set, in seconds, or None (unset or invalid: Python's default stays)."""
    raw = os.environ.get(GIL_SWITCH_ENV, "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0.05 <= ms <= 50:
        print(f"warning: ignored {GIL_SWITCH_ENV}={raw!r}: give milliseconds between 0.05 and 50",
              file=sys.stderr, flush=True)
        return None
    sys.setswitchinterval(ms / 1000)
    return ms / 1000


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_gil_switch_interval()
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        runner, sock = _load(args)
    except StartupError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return EXIT_USAGE

    import uvicorn

    from engine.localserver.app import ServerSettings, build_app

    settings = ServerSettings(model_path=str(args.model_path), host=args.host, port=args.port,
                              device=runner.device, dtype=args.dtype, max_batch=runner.max_batch,
                              api_key=api_key)
    app = build_app(runner, settings)
    runner.start()
    capture = runner.capture
    capture_note = (
        f"capture layers {capture.layers} (SGLang layers_to_capture {to_sglang_numbering(capture.layers)}) "
        f"-> {capture.spool_dir}" if capture else "capture off"
    )
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        print(f"warning: listening on {args.host}, reachable beyond this machine", file=sys.stderr)
    print(f"local target server: {args.model_path} on http://{args.host}:{args.port} "
          f"(device {runner.device}, {capture_note}, api key {'on' if api_key else 'off'})",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="off")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
