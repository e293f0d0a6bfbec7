"""`python -m engine.dataset regenerate|stats ...` — dataset tools that run as jobs or by hand."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.dataset", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    regen = sub.add_parser("regenerate", help="replace assistant turns with the target's greedy answers")
    regen.add_argument("--workspace", required=True, help="workspace directory (console.toml)")
    regen.add_argument("--out", required=True, help="new JSONL file to write (never the input)")
    regen.add_argument("--input", default=None, help="dataset to read (default: dataset.path)")
    regen.add_argument("--url", default=None, help="server URL (default: state/server.json)")
    regen.add_argument("--concurrency", type=_positive, default=4)
    regen.add_argument("--max-new-tokens", type=_positive, default=512)
    regen.add_argument("--resume", action="store_true", help="continue an interrupted output file")
    stats = sub.add_parser("stats", help="parse and tokenise the dataset; print the statistics as JSON")
    stats.add_argument("--workspace", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "regenerate":
        from engine.dataset.regenerate import RegenerateOptions, main_regenerate

        return main_regenerate(RegenerateOptions(
            workspace=Path(args.workspace), out=Path(args.out), input=Path(args.input) if args.input else None,
            url=args.url, concurrency=args.concurrency, max_new_tokens=args.max_new_tokens, resume=args.resume))
    from engine.checks.context import CheckContext
    from engine.checks.dataset import check_dataset
    from engine.config import ConfigError
    from engine.dataset.stats_cache import load_cached_stats
    from engine.workspace import Workspace

    ws = Workspace(args.workspace)
    try:
        results = check_dataset(CheckContext(ws))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for result in results:
        print(f"[{result.status.value}] {result.name}: {result.evidence}", file=sys.stderr)
    print(json.dumps(load_cached_stats(ws), indent=2))
    return 0 if all(r.status.value != "fail" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
