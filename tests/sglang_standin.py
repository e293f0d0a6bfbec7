"""A stand-in for an SGLang server, for tests only. It is NOT SGLang: it decodes nothing, and its
timings and acceptance are made up by the rules below, so figures measured against it say nothing
about SGLang or about any drafter. What it shares with SGLang is the interface the evaluation uses:
it takes SGLang's launch argv (the flags it needs, others ignored), and answers /health,
/health_generate, /metrics and /generate in SGLang's reply shape (`output_ids`, `text`, `meta_info`
with `completion_tokens`, and with speculation `spec_verify_ct`, `spec_accept_length` and
`spec_accept_histogram`: H[n] = verify steps that accepted exactly n drafts).

Made-up costs, on a pretend accelerator that slows down as more requests share it:
  - a plain request of n tokens takes n steps of STEP_S x (1 + CROWD x (others in flight));
  - with speculation, min(steps, 3) drafts are accepted per verify step, and a
    verify step costs STEP_S x (1 + DRAFT_COST x steps x topk) x (1 + CROWD x (others in flight) x
    3 x draft_tokens): speculation pays alone and stops paying when the batch is crowded.
Each request is logged as a JSON line to $STANDIN_LOG (with how many were in flight), so a test can
check what the client really did (warm-up first, the concurrency it claimed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STEP_S = 0.010  # long enough that a loaded test machine's scheduling noise stays small beside it
DRAFT_COST = 0.15
CROWD = 0.5
SETTLE_S = 0.005  # let a wave of concurrent requests arrive before counting who is in flight


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spec = args.speculative_algorithm is not None
        self.steps = args.speculative_num_steps or 0
        self.topk = args.speculative_eagle_topk or 1
        self.draft_tokens = args.speculative_num_draft_tokens or 0
        self.in_flight = 0
        self.lock = threading.Lock()
        self.log_path = os.environ.get("STANDIN_LOG")

    def log(self, record: dict[str, Any]) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [int(x) for x in body.get("input_ids") or [1]]
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or 16)
        with self.lock:
            self.in_flight += 1
        try:
            time.sleep(SETTLE_S)
            with self.lock:
                others = self.in_flight - 1
            self.log({"t": time.time(), "max_new_tokens": n, "in_flight": others + 1,
                      "setting": [self.steps, self.topk, self.draft_tokens] if self.spec else None})
            output = [(sum(ids) * 31 + k * 7) % 250 + 3 for k in range(n)]  # the same on every server
            meta: dict[str, Any] = {"id": "standin", "prompt_tokens": len(ids), "completion_tokens": n,
                                    "finish_reason": {"type": "length", "length": n}}
            if not self.spec:
                time.sleep(n * STEP_S * (1 + CROWD * others))
            else:
                accepted = min(self.steps, 3)
                cycles = math.ceil(n / (1 + accepted))
                cycle_s = STEP_S * (1 + DRAFT_COST * self.steps * self.topk) * (
                    1 + CROWD * others * 3 * self.draft_tokens)
                time.sleep(cycles * cycle_s)
                histogram = [0] * (self.steps + 1)
                histogram[accepted] = cycles
                meta.update(spec_verify_ct=cycles, spec_accept_length=n / cycles, spec_accept_histogram=histogram)
            return {"text": "", "output_ids": output, "meta_info": meta}
        finally:
            with self.lock:
                self.in_flight -= 1


def handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the job log stays short
            pass

        def _send(self, status: int, body: str, content_type: str = "application/json") -> None:
            data = body.encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/health", "/health_generate"):
                self._send(200, "{}")
            elif self.path == "/metrics":
                length = state.steps and (1 + min(state.steps, 3))
                text = f'sglang:spec_accept_length{{model_name="standin"}} {length}\n' if state.spec else ""
                self._send(200, text, "text/plain")
            else:
                self._send(404, json.dumps({"detail": "Not Found"}))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/generate":
                self._send(404, json.dumps({"detail": "Not Found"}))
            elif state.args.api_key and self.headers.get("Authorization") != f"Bearer {state.args.api_key}":
                self._send(401, json.dumps({"error": "Unauthorized"}))
            else:
                self._send(200, json.dumps(state.generate(body)))

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--speculative-algorithm", default=None)
    parser.add_argument("--speculative-num-steps", type=int, default=None)
    parser.add_argument("--speculative-eagle-topk", type=int, default=None)
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    args, _ = parser.parse_known_args()
    state = State(args)
    state.log({"argv": sys.argv[1:]})
    server = ThreadingHTTPServer((args.host, args.port), handler(state))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
